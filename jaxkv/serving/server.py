"""``Server``: what many sessions share, and the scheduler that serves them.

A ``Server`` owns one ``Engine`` (pool + rows), one radix prefix cache over the
pool, one host tier (RepairKV), one LRU ``SessionStore`` of per-session policy
state, one ``SegmentStore`` (cross-query segment reuse, per tenant), the latest
repair signals (WrongQ-K) and the ``Scheduler`` that runs every session's turns
with continuous batching. ``server.session(**options)`` makes a ``Session`` on it;
any number of sessions may run turns at once (one thread or asyncio task per
session), up to ``rows`` of them in the engine and ``max_queue`` waiting.

Holes are private: a cached prefix's holes, and every token computed after one,
belong to the session whose policy made them (``cache_owner``: one radix owner
per session, whatever its cache namespace; the rule is ``jaxkv.cache.radix``'s).
Another session, of the same namespace or not, reuses a cached prefix up to the
first hole it did not make and prefills the rest; a full-cache session never
reads a hole; a session's next turn reuses its own pruned prefix, holes
included.

Cache namespaces: ``server.radix_for(name)`` is the radix cache as one
namespace sees it (``NamespacedRadix``): sessions made with
``cache_namespace=name`` match only prefixes cached under the same name, so
tenants of one server never hit (or time) each other's cached prompts, while
all of them share one pool and one LRU eviction. Sessions without a namespace
share the un-namespaced cache.

Counters (``snapshot``): besides the scheduler's, ``counters`` sums over every
turn the prompt tokens and those taken from the radix cache
(``prompt_tokens``, ``cached_tokens``), the positions retention evicted
(``evicted_tokens``), the rows RepairKV promoted (``repaired_rows``) and the
slots the radix cache gave back under pool pressure (``radix_evicted_slots``);
``prefill_seconds`` / ``decode_seconds`` are the scheduler's time in batched
engine steps.

Compiled programs: every shape the engine's steps take comes from the small
bounded set of ``jaxkv.buckets.shape_set`` (one program per step token bucket,
per decode row bucket and CPU window width; samplers, chunk and live lengths are
data). ``Server(..., warmup=True)`` (or ``server.warmup()``) compiles all of it
before the server accepts a turn, with a progress bar, through JAX's persistent
compilation cache in the user cache folder (``jaxkv.compiles``), so a restart
loads instead of compiling; then one short chat turn per sampler compiles the
turn pipeline's own small programs.
``snapshot()`` reports ``xla_compiles`` (programs this process compiled or
loaded; after warm-up a full-cache request adds none) and
``xla_cache_hits``. A CPU process cannot hold a large shape set in memory (each
compiled program keeps hundreds of memory mappings; ``jaxkv.compiles``): the
warm-up and the scheduler drop the compiled programs near the kernel's limit
(``xla_releases``), and a request then loads the program it needs from the
persistent cache (counted in ``xla_compiles`` and ``xla_cache_hits``), never
compiling it again. The warm-up also compiles what retention policies add (by
default every registered policy at its default config; ``warmup_policies``):
the feature-capturing variants of the steps (query rows, attention mass) and
each policy's event programs.
Not in the set (compiled on first use): a policy config whose shapes differ
from the ones warmed (a wider observation window), ``top_k`` values, all-prompt
logits, segment reuse.

Sizing: ``num_slots`` defaults to ``2 * rows * max_positions + 1``, room for
cached prefixes beside running requests; ``kv_memory_bytes`` sizes the pool by
memory instead (the most tokens of the pool's kind that fit). The radix cache
gives back its least recently used entries when a turn needs their slots.

Invariants: device state and host bookkeeping are touched only by the scheduler
thread; ``close()`` cancels what runs (rows and slots are released) and stops
the thread; after every turn, only the radix cache holds slots.
"""

from __future__ import annotations

import collections
import threading

from jaxkv import compiles
from jaxkv.cache.host_tier import HostTier
from jaxkv.cache.quantized_host import check_mode
from jaxkv.cache.radix import NamespacedRadix, RadixTree
from jaxkv.cache.segments import SegmentStore
from jaxkv.cache.session_store import SessionStore
from jaxkv.chat import stop_token_ids
from jaxkv.engine import PREFILL_CHUNK, Engine
from jaxkv.engine.warmup import shape_set
from jaxkv.errors import ConfigError
from jaxkv.models.loading import Model
from jaxkv.serving.scheduler import DECODE_CHUNK, Scheduler


COUNTERS = ("prompt_tokens", "cached_tokens", "evicted_tokens", "repaired_rows", "radix_evicted_slots")


class Server:
    """Shared serving state for many sessions.

    Args:
      model: a loaded ``Model`` with a tokenizer.
      rows: turns that run at once (engine rows).
      max_positions: positions per request (default: model context, at most 8192).
      num_slots: pool slots (default ``2 * rows * max_positions + 1``).
      session_cap: how many sessions' policy state the LRU store keeps.
      host_tier: the ``HostTier`` evicted rows go to when a session repairs
        (default: unbounded per session, at most 2**16 rows in all).
      max_queue: turns that may wait for a row before ``QueueFullError``.
      decode_chunk: decode steps per batched engine call.
      prefill_chunk: the most prompt tokens of one turn an engine step takes.
      token_budget: the most tokens of one engine step (``Engine``'s default: a
        whole chunk beside a decode token of every row).
      backend: decode-attention backend (``jaxkv.kernels``).
      kv_quant: None (float pool) or a quantized pool's mode
        (``jaxkv.cache.quantized_host.MODES``); every session on the server uses
        it (``jaxkv.serving.stages.quantization``).
      kv_memory_bytes: size the pool by memory instead of ``num_slots``: the
        largest pool of ``kv_quant``'s kind whose KV bytes fit
        (``jaxkv.cache.pools.pool_for_bytes``); ``kv_page_share``: the share of
        its tokens in INT2 pages (a quantized pool; default 0 for ``int4`` and
        the triaxial modes, required for the KIVI modes).
      segment_cap: bytes the segment store (cross-query reuse) may hold.
      warmup: compile every program of the engine's shape set before returning
        (``warmup``; module docstring): True for every sampler, or the names of
        the samplers to warm (``Engine.WARMUP_SAMPLERS``).
      warmup_policies: the retention policies whose programs the warm-up
        compiles too (None: every registered policy, at its default config).
      layer_lists: give each engine row a live list per layer, so sessions may
        keep per-layer sets (``keep_sets="layer"``; ``Engine(layer_lists=)``).
      kv_rotate: the quantized pool stores K and V rotated (``Engine(kv_rotate=)``).
    """

    def __init__(
        self,
        model: Model,
        *,
        rows: int = 1,
        max_positions: int | None = None,
        num_slots: int | None = None,
        session_cap: int = 1024,
        backend=None,
        host_tier: HostTier | None = None,
        max_queue: int = 64,
        decode_chunk: int = DECODE_CHUNK,
        prefill_chunk: int = PREFILL_CHUNK,
        token_budget: int | None = None,
        kv_quant=None,
        kv_memory_bytes: int | None = None,
        kv_page_share: float | None = None,
        segment_cap: int = 256 << 20,
        warmup=False,
        warmup_policies=None,
        layer_lists: bool = False,
        kv_rotate: bool = False,
    ):
        if model.tokenizer is None:
            raise ConfigError("sessions need a model with a tokenizer (the folder had none)")
        if int(rows) < 1:
            raise ConfigError(f"a server needs at least one row, got rows={rows!r}")
        P = int(max_positions or min(model.config.max_position_embeddings, 8192))
        self.model = model
        self.kv_quant = check_mode(kv_quant)
        self.kv_rotate = bool(kv_rotate)
        self.engine = Engine(
            model,
            rows=int(rows),
            max_positions=P,
            num_slots=num_slots or (None if kv_memory_bytes is not None else 2 * int(rows) * P + 1),
            backend=backend,
            prefill_chunk=prefill_chunk,
            token_budget=token_budget,
            kv_quant=self.kv_quant,
            kv_memory_bytes=kv_memory_bytes,
            kv_page_share=kv_page_share,
            layer_lists=layer_lists,
            kv_rotate=self.kv_rotate,
        )
        self.radix = RadixTree(self.engine.allocator)
        self.engine.reclaim = self._reclaim
        self.namespaces: dict[str, int] = {}  # cache namespace name -> its key in the radix tree
        self._owners_made = 0  # radix owners handed out (``cache_owner``)
        self._namespace_lock = threading.Lock()
        self.counters = collections.Counter()  # module docstring; written on the scheduler thread
        self.store = SessionStore(session_cap)
        self.segments = SegmentStore(segment_cap)  # reuse stage: per-tenant, byte-capped LRU
        self.host_tier = host_tier if host_tier is not None else HostTier(global_rows=1 << 16)
        self.repair_signals: dict = {}  # session id -> latest repair Signal (WrongQ-K); oldest first
        self.stop_token_ids = stop_token_ids(model)
        self.scheduler = Scheduler(self.engine, max_queue=max_queue, decode_chunk=decode_chunk)
        self.warmup_seconds: float | None = None
        self.warmup_programs: int | None = None
        if warmup:
            self.warmup(**({} if warmup is True else {"samplers": tuple(warmup)}), policies=warmup_policies)

    WARMUP_SAMPLERS = {"greedy": {}, "sample": {"temperature": 1.0}, "top_p": {"temperature": 1.0, "top_p": 0.9}}

    def warmup(
        self, *, samplers=("greedy", "sample", "top_p"), progress: bool = True, session_options: dict | None = None, policies=None
    ) -> int:
        """Compile the engine's bounded shape set (``Engine.warmup``: one program per
        step token bucket and per decode row bucket and window width) on the
        scheduler thread, with the feature-capturing variants of its steps that
        ``policies`` need (None: every registered retention policy; names, or
        ``(name, config dict)`` pairs for a non-default config) and each policy's
        event programs (``retention.warm_events``); then build a scratch session
        per policy (its state and head) and run one short chat turn per sampler
        name of ``WARMUP_SAMPLERS`` (the turn pipeline's own programs; samplers
        are data in the engine's steps, so they add no step program) in a scratch
        session made with ``session_options`` (e.g. a triaxial pool's
        ``kv_allocation``). The persistent compilation cache is turned on first.
        Call it before serving. Records ``warmup_seconds`` and
        ``warmup_programs`` (XLA programs compiled or loaded, ``jaxkv.compiles``)
        and returns the engine programs run."""
        import time

        from tqdm.auto import tqdm

        from jaxkv import compiles
        from jaxkv.serving.stages.retention import policy_warmup, warm_events

        compiles.enable_persistent_cache()
        t0, before = time.perf_counter(), compiles.count()
        eng = self.engine
        specs, variants = policy_warmup(policies)
        shapes = shape_set(eng, self.scheduler.decode_chunk)
        wide = (
            sum(eng.runner.capture_rows(T, wide=True) != eng.runner.capture_rows(T) for T in shapes.steps)
            if variants["capture_wide"]
            else 0
        )
        total = (
            len(shapes.steps) * (1 + variants["capture_q"] + variants["attn_mass"]) + wide + len(shapes.decode) * (1 + variants["decode_q"])
        )
        with tqdm(total=total + len(specs), desc="jaxkv warm-up (XLA programs)", unit="prog", disable=not progress) as bar:
            ran = self.scheduler.call(
                lambda: eng.warmup(self.scheduler.decode_chunk, stop_token_ids=self.stop_token_ids, progress=bar.update, **variants)
            ).result()
            for options, spec in specs:
                self.session(**options).close()  # the policy's state and head, as a session builds them
                ran += self.scheduler.call(lambda: warm_events(spec, eng)).result()
                bar.update(1)
        session = self.session(**(session_options or {}))
        for name in samplers:
            session.chat([{"role": "user", "content": "warm up"}], max_new_tokens=2, **self.WARMUP_SAMPLERS[name])
        session.close()
        self.scheduler.call(lambda: self.radix.evict(eng.allocator.capacity)).result()  # forget the scratch turns
        self.warmup_seconds = time.perf_counter() - t0
        self.warmup_programs = compiles.count() - before
        return ran

    # The class ``session()`` builds. ``jaxkv.serving.session`` sets it to ``Session``
    # when it is imported (always, through ``jaxkv.serving``): a session knows its
    # server, the server only this hook, so the two modules import one way.
    session_type = None

    def session(self, **options):
        """A new ``Session`` on this server (options as in ``Session``)."""
        return self.session_type(self.model, server=self, **options)

    def radix_for(self, namespace: str | None):
        """The radix cache as sessions of ``namespace`` see it (None: the shared,
        un-namespaced cache)."""
        if namespace is None:
            return self.radix
        with self._namespace_lock:
            key = self.namespaces.setdefault(str(namespace), len(self.namespaces))
        return NamespacedRadix(self.radix, key)

    def cache_owner(self) -> int:
        """A fresh radix owner for a new session (``jaxkv.cache.radix``: whose
        holes a request may read): holes are never shared between sessions, even
        of one cache namespace."""
        with self._namespace_lock:
            self._owners_made += 1
            return self._owners_made

    def _reclaim(self, n_slots: int):
        """The engine's way to make room: the radix cache's LRU eviction, counted."""
        freed = self.radix.evict(n_slots)
        self.counters["radix_evicted_slots"] += int(freed.size)
        return freed

    def __getstate__(self):  # copies (Session.fork) get a lock of their own
        state = self.__dict__.copy()
        state.pop("_namespace_lock")
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._namespace_lock = threading.Lock()

    @property
    def max_positions(self) -> int:
        return self.engine.max_positions

    def close(self) -> None:
        """Cancel running and queued turns, stop the scheduler thread, and free the
        KV pool now (``Engine.close``): the server and its engine refer to each
        other (the reclaim hook), so without this the pool's device memory would
        wait for Python's cycle collector, one pool per closed server (a private
        session's server at 4,096 positions holds ~380 MB of SmolLM2 KV).
        The pool stays if the thread is still inside a step after ``stop``'s wait."""
        self.scheduler.stop()
        if not self.scheduler.thread_alive:
            self.engine.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def snapshot(self) -> dict:
        """Counters for monitoring (the HTTP server's ``/metrics``)."""
        alloc = self.engine.allocator
        live = [len(s.live) for s in self.engine.row_state if s is not None]
        stats = self.scheduler.stats
        return {
            "rows": self.engine.rows,
            "rows_busy": self.engine.rows - self.engine.free_rows,
            "slots_capacity": alloc.capacity,
            "slots_used": alloc.num_used,
            "slots_free": alloc.num_free,
            "radix_slots": int(self.radix.held_slots().size),
            "live_kv": int(sum(live)),
            "queue_depth": self.scheduler.queue_depth,
            "host_tier_rows": int(self.host_tier.num_rows),
            **{k: int(v) for k, v in stats.items()},
            "prefill_seconds": float(self.scheduler.timing["prefill_s"]),  # time in batched engine steps
            "decode_seconds": float(self.scheduler.timing["decode_s"]),
            "xla_compiles": compiles.count(),
            "xla_cache_hits": compiles.cache_hits(),
            "xla_releases": compiles.releases(),
            "warmup_programs": self.warmup_programs or 0,
            "warmup_seconds": self.warmup_seconds or 0.0,
            **{k: int(self.counters[k]) for k in COUNTERS},
        }
