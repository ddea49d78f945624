"""The scheduler: continuous batching of many sessions' turns on one engine.

Sessions submit turn programs (``jaxkv.serving.pipeline``: generators that yield
engine jobs: ``PrefillJob``, ``DecodeJob``, ``SpliceJob``) from any thread;
one scheduler thread owns the engine and runs them. Each loop iteration:

1. **admit** queued turns, first come first served, while a row is free and the
   pool can cover the turn's slot reservation (``TurnTask.need``: prompt + reply
   tokens, more for repair and compact layouts, less the prompt prefix its
   session cached that the turn will reuse, locked meanwhile) next to what
   running turns may still allocate; the radix cache's least recently used
   entries are evicted to make room. So a pool full of sessions' cached
   conversations admits a turn that needs only its new tokens without evicting
   its own history or another session's. A turn that needs more than the whole pool fails at ``submit``
   (``CapacityError``), and ``submit`` raises ``QueueFullError`` when
   ``max_queue`` turns already wait: backpressure instead of unbounded memory.
2. **advance** every running turn whose last work is done: its host code runs
   (compression events, repair, radix insert...) until it yields the next work,
   whose engine job starts at once (slots allocated), or finishes.
3. **splice**: each waiting spliced step (segment reuse) runs, one per turn, so a
   turn that splices several spans never holds the others for all of them.
4. **step**: while any prefill is pending, one engine step, packed here on the
   token budget (``jaxkv.engine.packing.pack_step``): the next token of every
   decoding row, then prefill pieces of the waiting turns, first come first
   served, in what is left (chunked prefill, as vLLM V1 schedules: a decoding row
   never waits behind a long prompt); with no prefill pending, one call of the
   decode loop (``Engine.step_decode``: up to ``decode_chunk`` tokens of every
   decoding row, each with its own sampler; rows stop on their own stop token or
   limit).

So rows join and leave between steps, long prompts are prefilled a piece at a
time beside the decode tokens of the others, and each session keeps its own
policy, budget, layout and repair (those run in its turn's host code).

Invariants: only the scheduler thread touches the engine, the radix cache, the
host tier and the session store; a turn that fails, is cancelled or is dropped
by ``stop`` runs its ``finally`` (``Turn.close``), so its row, slots and radix
lock are released; a failing turn never takes others down (errors are thrown
into its own program; a failing batched step fails only the turns in it).
Bounded time: every admitted turn advances each iteration (decode steps are
bounded by its ``max_new_tokens``, prefill by its prompt), and the queue is FIFO.

Step trace: with ``JAXKV_STEP_TRACE=FILE`` in the environment, every engine step
appends one JSON line to FILE (its kind, the prefill rows and tokens it ran, the
decode rows and tokens it generated, its seconds and the seconds the scheduler
spent outside engine steps since the last one), so a load run can be broken down
step by step (``eval/profile/load_steps.py``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import json
import logging
import os
import threading
import time
from typing import Any, Callable, Generator

from jaxkv import compiles
from jaxkv.buckets import DECODE_CHUNK  # the default decode chunk (re-exported here)
from jaxkv.errors import CapacityError, JaxKVError, OutOfSlotsError, QueueFullError, TurnCancelledError
from jaxkv.engine.jobs import DecodeJob, PrefillJob, SpliceJob
from jaxkv.engine.packing import pack_step

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class TurnTask:
    """A submitted turn.

    Attributes:
      program: the turn's generator (``pipeline.chat_turn`` / ``replay_turn``).
      turn: its ``pipeline.Turn`` (row, request state).
      need: slots reserved for it at admission (prompt + reply tokens, more
        for repair and compact layouts).
      credit_reuse: whether the prompt tokens the turn surely reuses from the
        radix cache come off ``need`` at admission (``Turn.pin_reuse``): they
        are referenced, never allocated (not so for a compact layout, which
        copies kept rows into fresh slots).
      future: resolves to the program's return value (or its error).
      on_progress: called with the decode job after each engine step (streaming).
      work: the work it waits on (None: ready to advance).
      submitted_at / admitted_at: ``time.perf_counter()`` when ``submit`` queued
        it and when ``_admit`` gave it a row (None until then); their difference
        is its queue wait (``jaxkv_queue_wait_seconds`` on ``/metrics``).
    """

    program: Generator
    turn: Any
    need: int
    credit_reuse: bool = False
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    on_progress: Callable | None = None
    work: Any = None
    cancelled: bool = False
    started: bool = False
    id: int = 0
    submitted_at: float | None = None
    admitted_at: float | None = None

    def cancel(self) -> None:
        """Ask the scheduler to drop the turn; its row and slots are freed."""
        self.cancelled = True

    def outstanding(self) -> int:
        """Slots the turn may still allocate under its reservation."""
        req = getattr(self.turn, "req", None) if self.turn.row is not None else None
        return max(self.need - (req.allocated if req is not None else 0), 0)


class Scheduler:
    """Continuous batching over one engine (module docstring).

    Args:
      engine: the ``Engine`` it drives (with ``engine.reclaim`` set to the radix
        cache's eviction, so admission can make room).
      max_queue: turns that may wait for admission before ``submit`` refuses.
      decode_chunk: decode steps per batched engine call.
    """

    def __init__(self, engine, *, max_queue: int = 64, decode_chunk: int = DECODE_CHUNK):
        if max_queue < 1 or decode_chunk < 1:
            raise JaxKVError("max_queue and decode_chunk must be >= 1")
        self.engine = engine
        self.max_queue = int(max_queue)
        self.decode_chunk = int(decode_chunk)
        self._queue: collections.deque[TurnTask] = collections.deque()
        self._calls: collections.deque = collections.deque()  # (fn, future) to run on the scheduler thread
        self._running: list[TurnTask] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ids = itertools.count()
        self.stats = collections.Counter()  # turns_done / turns_failed / turns_cancelled / tokens_generated / prefill_tokens / steps
        self.timing = {"prefill_s": 0.0, "decode_s": 0.0}  # seconds spent in batched engine steps
        self.started_at = time.perf_counter()
        trace = os.environ.get("JAXKV_STEP_TRACE")
        self._trace = open(trace, "a", buffering=1) if trace else None  # line-buffered: readable while serving
        self._last_step_end = time.perf_counter()

    # -- copies (Session.fork) ---------------------------------------------------------
    def __deepcopy__(self, memo):
        import copy

        if self._running or self._queue:
            raise JaxKVError("cannot copy a scheduler with turns in flight")
        twin = Scheduler(copy.deepcopy(self.engine, memo), max_queue=self.max_queue, decode_chunk=self.decode_chunk)
        twin.stats = collections.Counter(self.stats)
        twin.timing = dict(self.timing)
        memo[id(self)] = twin
        return twin

    # -- public ------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._running)

    def submit(self, task: TurnTask) -> concurrent.futures.Future:
        """Queue a turn; returns its future. ``CapacityError`` if it can never fit,
        ``QueueFullError`` if ``max_queue`` turns already wait."""
        capacity = self.engine.allocator.capacity
        if task.need > capacity:
            raise CapacityError(f"the turn needs {task.need} KV slots; the whole pool holds {capacity}")
        with self._cv:
            if self._stopping:
                raise JaxKVError("the server is closed")
            if len(self._queue) >= self.max_queue:
                raise QueueFullError(f"{len(self._queue)} turns are already waiting (max_queue={self.max_queue})")
            task.id = next(self._ids)
            task.submitted_at = time.perf_counter()
            self._queue.append(task)
            self._ensure_thread()
            self._cv.notify_all()
        return task.future

    def call(self, fn) -> concurrent.futures.Future:
        """Run ``fn()`` on the scheduler thread (between iterations); returns a
        future of its result. For host bookkeeping other threads must not touch
        (``Session.close``)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            self._calls.append((fn, future))
            self._ensure_thread()
            self._cv.notify_all()
        return future

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="jaxkv-scheduler", daemon=True)
            self._thread.start()

    def cancel(self, task: TurnTask) -> None:
        with self._cv:
            task.cancel()
            self._cv.notify_all()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Cancel every turn and end the scheduler thread."""
        with self._cv:
            self._stopping = True
            for task in list(self._queue) + self._running:
                task.cancel()
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._trace is not None and not (self._thread is not None and self._thread.is_alive()):
            self._trace.close()
            self._trace = None

    def idle(self) -> bool:
        return not self._queue and not self._running

    @property
    def thread_alive(self) -> bool:
        """Whether the scheduler thread is running (it may outlive ``stop``'s wait)."""
        return self._thread is not None and self._thread.is_alive()

    # -- the loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._running and not self._calls and not self._stopping:
                    self._cv.wait()
                calls = list(self._calls)
                self._calls.clear()
                if self._stopping and not self._running:
                    for task in self._queue:
                        self._resolve_cancelled(task)
                    self._queue.clear()
                stopped = self._stopping and not self._running
                self._drop_cancelled_queued()
            for fn, future in calls:
                try:
                    future.set_result(fn())
                except BaseException as err:
                    future.set_exception(err)
            if stopped:
                return
            try:
                self._admit()
                self._advance()
                self._step()
                compiles.release_if_crowded()  # before a compile could pass the mapping limit
            except Exception as err:  # a bug, not a turn's error: fail what runs, keep serving
                log.exception("scheduler iteration failed")
                for task in list(self._running):
                    self._fail(task, err)

    def _drop_cancelled_queued(self) -> None:
        for task in [t for t in self._queue if t.cancelled]:
            self._queue.remove(task)
            self._resolve_cancelled(task)

    def _admit(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                if not self._queue or engine.free_rows == 0:
                    return
                task = self._queue[0]
            reuse, handle = task.turn.pin_reuse() if task.credit_reuse else (0, None)
            try:
                outstanding = sum(t.outstanding() for t in self._running)
                engine.kv.make_room(task.need - reuse + outstanding)  # the KV manager's one reclaim path
                short = task.need - reuse + outstanding - engine.allocator.num_free
            finally:
                if handle is not None:  # ``open`` (next, on this thread) matches and locks it again
                    task.turn.radix.unlock(handle)
            if short > 0:
                return  # wait for running turns to end (need <= capacity, so it will fit)
            task.need -= reuse
            with self._cv:
                self._queue.popleft()
            task.started = True
            task.admitted_at = time.perf_counter()
            self._running.append(task)
            self._ready(task, None)

    def _advance(self) -> None:
        for task in list(self._running):
            if task.cancelled:
                self._cancel_running(task)

    def _ready(self, task: TurnTask, value, error: BaseException | None = None) -> None:
        """Run a turn's host code until it yields work (started at once) or ends."""
        while True:
            try:
                work = task.program.throw(error) if error is not None else task.program.send(value)
            except StopIteration as done:
                self._finish(task, done.value)
                return
            except BaseException as err:  # the program raised: its finally closed the turn
                self._finish(task, None, err)
                return
            try:
                self._start(work)
            except JaxKVError as err:  # no slots, context too long: the turn's own error
                value, error = None, err
                continue
            task.work = work
            return

    def _start(self, work) -> None:
        """Start a turn's work: an engine job's slots are allocated now."""
        if isinstance(work, (PrefillJob, DecodeJob)):
            self.engine.start(work)
        elif not isinstance(work, SpliceJob):
            raise JaxKVError(f"a turn program yielded {type(work).__name__}, not an engine job or SpliceJob")

    def _finish(self, task: TurnTask, value, error: BaseException | None = None) -> None:
        if task in self._running:
            self._running.remove(task)
        task.work = None
        if error is None:
            self.stats["turns_done"] += 1
            task.future.set_result(value)
        elif isinstance(error, TurnCancelledError):
            self.stats["turns_cancelled"] += 1
            task.future.set_exception(error)
        else:
            self.stats["turns_failed"] += 1
            task.future.set_exception(error)
        with self._cv:
            self._cv.notify_all()

    def _fail(self, task: TurnTask, error: BaseException) -> None:
        self._ready(task, None, error)

    def _cancel_running(self, task: TurnTask) -> None:
        try:
            task.program.close()  # GeneratorExit: the turn's finally releases row, slots, lock
        except Exception as err:
            log.warning("closing a cancelled turn raised %r", err)
        self._finish(task, None, TurnCancelledError("the turn was cancelled"))

    def _resolve_cancelled(self, task: TurnTask) -> None:
        task.program.close()
        self.stats["turns_cancelled"] += 1
        task.future.set_exception(TurnCancelledError("the turn was cancelled before it started"))

    def _step(self, tasks=None) -> None:
        """One iteration's device work for ``tasks`` (default: the running turns):
        their spliced steps, then one engine step or decode-loop call."""
        tasks = self._running if tasks is None else tasks
        for task in [t for t in tasks if isinstance(t.work, SpliceJob)]:
            work = task.work
            try:
                work.result = self.engine.splice_prefill(work.row, work.plan, mode=work.mode)
            except Exception as err:
                self._fail(task, err)
                continue
            self._ready(task, None)
        prefills = [t for t in tasks if isinstance(t.work, PrefillJob)]
        decodes = [t for t in tasks if isinstance(t.work, DecodeJob)]
        if not prefills and not decodes:
            return
        tasks = prefills + decodes
        pjobs, djobs = [t.work for t in prefills], [t.work for t in decodes]
        before = sum(j.done for j in pjobs)
        generated = [len(j.tokens) for j in djobs]
        t0 = time.perf_counter()
        try:
            if prefills:
                self._engine_step(pjobs, djobs)
            else:
                self.engine.step_decode(djobs, self.decode_chunk, regroup=True)  # rows that stop early leave the call
        except OutOfSlotsError:  # not enough slots for all: the decode rows one by one, fail only who cannot fit
            self._one_by_one(prefills, decodes)
            return
        except Exception as err:
            for task in tasks:
                self._fail(task, err)
            return
        finally:
            t1 = time.perf_counter()
            self.timing["prefill_s" if prefills else "decode_s"] += t1 - t0
        if self._trace is not None:
            record = {
                "kind": "mixed" if prefills else "decode",
                "prefill_rows": len(pjobs),
                "prefill_tokens": sum(j.done for j in pjobs) - before,
                "decode_rows": len(djobs),
                "generated": sum(len(j.tokens) for j in djobs) - sum(generated),
                "seconds": round(t1 - t0, 6),
                "host_seconds": round(t0 - self._last_step_end, 6),
            }
            self._trace.write(json.dumps(record) + "\n")
        self._last_step_end = t1
        self.stats["steps"] += 1
        self.stats["prefill_tokens"] += sum(j.done for j in pjobs) - before
        self._after(prefills, decodes, generated)

    def _engine_step(self, pjobs, djobs) -> None:
        """Pack one step of these jobs on the engine's token budget and run it (an
        imported prefill, which runs no forward, stores its next chunk instead)."""
        engine = self.engine
        if any(j.kv_source is not None for j in pjobs):
            return engine.step(prefill_jobs=pjobs, decode_jobs=djobs)
        engine.run(
            pack_step(
                pjobs,
                djobs,
                budget=engine.token_budget,
                rows=engine.rows,
                chunk=engine.prefill_chunk,
                whole_chunks=engine.pool.whole_chunks,
                max_captured=engine.runner.max_captured,
            )
        )

    def run_alone(self, program: Generator):
        """Run one turn program on the calling thread as this scheduler's only turn
        (the scheduler must be idle): the same start, step and advance as the loop's,
        for evaluations that drive a turn themselves. Returns the program's value
        (its error is raised)."""
        if not self.idle():
            raise JaxKVError("run_alone needs an idle scheduler")
        task = TurnTask(program, turn=None, need=0)
        self._running.append(task)
        try:
            self._ready(task, None)
            while task in self._running:
                self._step([task])
        finally:
            if task in self._running:
                self._running.remove(task)
        return task.future.result()

    def _one_by_one(self, prefills, decodes) -> None:
        """After an ``OutOfSlotsError``: prefills alone, then each decode row alone;
        a turn that still cannot get its slots fails, the others go on."""
        groups = [(prefills, [])] if prefills else []
        groups += [([], [task]) for task in decodes]
        for pre, dec in groups:
            generated = [len(t.work.tokens) for t in dec]
            try:
                self._engine_step([t.work for t in pre], [t.work for t in dec])
            except Exception as err:
                for task in pre + dec:
                    self._fail(task, err)
                continue
            self._after(pre, dec, generated)

    def _after(self, prefills, decodes, generated) -> None:
        """Stream the decode rows' new tokens and advance every turn whose work is done."""
        for task, n0 in zip(decodes, generated):
            job = task.work
            self.stats["tokens_generated"] += len(job.tokens) - n0
            if task.on_progress is not None:
                try:
                    task.on_progress(job)
                except Exception:  # a listener's bug must not stop the turn
                    log.exception("on_progress listener failed")
        for task in prefills + decodes:
            if task.work.finished:
                self._ready(task, None)
