"""The model runner: executes one scheduled step, or one call of the decode loop,
and writes what came back into the jobs.

It owns the model's weights split once (``graphdef``, ``params``), the attention
backend chosen for the engine (``jaxkv.backends``) and the backend's kept decode
state; it allocates nothing itself and decides nothing about which rows run: the
KV manager (``jaxkv.engine.kv_manager``) allocates and records, the packer
(``jaxkv.engine.packing``) schedules. Per step it

1. takes the step's decode slots from the KV manager (``OutOfSlotsError`` before
   any change),
2. lays the step out as a ``jaxkv.forward.StepBatch`` (decode tokens first, then
   the prefill pieces) padded to its token bucket, with only the outputs some job
   asked for (``Outputs``: logits, query rows gathered on the device to the rows
   asked for, attention mass),
3. runs ``jaxkv.forward.run_step``, hands the new cache to the KV manager and
   records each row's new tokens.

Each row's next token is sampled in the step; a prefill job's last piece samples
its reply's first token there (``PrefillJob.sampling``), so nothing is sampled on
the host.

The decode call (``decode``) runs ``jaxkv.forward.run_decode``: up to ``n`` steps
of every job's row in one program. On the CPU its rows' entries are read from a
window the program copies at its start (the backend's ``take_window``), which the
runner keeps for the next call over the same rows when the backend allows
(``DecodeState``).

Invariants: the runner is the only caller of the engine's forward programs; a
step's query rows, logits and mass reach the host only when a job in it asked.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxkv import buckets
from jaxkv.backends.base import DecodeState
from jaxkv.engine.jobs import DecodeJob, PrefillJob
from jaxkv.engine.packing import ScheduledStep
from jaxkv.forward import DecodeBatch, Outputs, StepBatch, layer_copies, run_decode, run_step
from jaxkv.sampling import RowSamplers

CAPTURE_ROWS = 128  # the most flat tokens a step returns queries of (``buckets.capture_rows``)


def _list_mass(mass_JN, positions_J, seq_len: int, n_new: int) -> np.ndarray:
    """Attention mass per position ``[seq_len + n_new]`` of one step row from the
    mass of each of its live lists' entries (``mass_JN``: list ``j``'s entries are
    the positions ``positions_J[j]``, then the step's ``n_new`` tokens)."""
    out = np.zeros(seq_len + n_new, np.float32)
    new = seq_len + np.arange(n_new)
    for m_N, pos in zip(mass_JN, positions_J):
        np.add.at(out, np.concatenate([pos, new]), m_N[: pos.size + n_new])
    return out


@functools.lru_cache(maxsize=1)
def _default_key_data() -> np.ndarray:
    return np.asarray(jax.random.key_data(jax.random.key(0)))


def _key_data(key) -> np.ndarray:
    """A row's key as host data (None: ``key(0)``, unused by a greedy row)."""
    return _default_key_data() if key is None else np.asarray(jax.random.key_data(key))


class ModelRunner:
    """Executes steps for one engine (module docstring).

    Args:
      model: the loaded ``Model``. kv: the ``KVManager``. backend: the attention
      backend. token_budget: tokens per step at most.
    """

    def __init__(self, model, kv, backend, *, token_budget: int):
        self.model = model
        self.cfg = model.config
        self.graphdef, self.params = model.split()
        self.kv = kv
        self.backend = backend
        self.mesh = model.mesh
        self.token_budget = int(token_budget)
        self.use_window = True  # the CPU decode loop may read a window (tests turn it off to compare)
        self.regathers = 0  # decode calls whose kept window was replaced by a fresh copy
        self._kept: DecodeState | None = None
        self._layer_params = None

    def close(self) -> None:
        self._kept = None
        self._layer_params = None

    def forget_window(self) -> None:
        """Drop the kept decode window and its memory (the next call copies a fresh one)."""
        self._kept = None

    # -- one step ----------------------------------------------------------------------
    @property
    def max_captured(self) -> int | None:
        """The most flat tokens whose queries one step returns (the packer cuts pieces
        to fit): ``CAPTURE_ROWS``, or no limit where pieces are whole planned chunks
        (a quantized pool), whose steps return every token's."""
        return None if self.kv.pool.whole_chunks else CAPTURE_ROWS

    def capture_rows(self, T: int, wide: bool = False) -> int:
        """The query rows a step of ``T`` tokens returns (its static shape): every
        token's where ``wide`` (a piece of a ``PrefillJob.wide_capture`` job is in
        the step) or the pool sets no cap, else at most ``max_captured``."""
        return T if wide or self.max_captured is None else min(T, self.max_captured)

    def run(self, step: ScheduledStep) -> None:
        """Execute ``step`` and write its results into its jobs (module docstring)."""
        kv, R = self.kv, self.kv.rows
        decode = list(step.decode)
        fresh = kv.allocate(len(decode)) if decode else np.zeros(0, np.int64)  # raises before any change
        entries = [(j, np.asarray([j.next_feed], np.int32), np.asarray([s], np.int64)) for j, s in zip(decode, fresh)]
        entries += [(j, j.tokens[j.done : j.done + n], j.slots[j.done : j.done + n]) for j, n in step.pieces]
        T = buckets.step_tokens(step.tokens, self.token_budget)
        tokens, positions, slots = np.zeros(T, np.int32), np.zeros(T, np.int32), np.zeros(T, np.int32)
        rows, q_start, q_len = np.full(R, R, np.int32), np.zeros(R, np.int32), np.zeros(R, np.int32)
        key_data = np.zeros((R, *_key_data(None).shape), np.uint32)
        step_idx = np.zeros(R, np.int32)
        settings = [(0.0, None, None)] * R
        query_idx = []  # flat tokens whose queries come back
        at = 0
        for r, (j, toks, sl) in enumerate(entries):
            n = toks.size
            tokens[at : at + n], slots[at : at + n] = toks, sl
            positions[at : at + n] = kv.row(j.row).seq_len + np.arange(n)
            rows[r], q_start[r], q_len[r] = j.row, at, n
            if isinstance(j, DecodeJob):
                key_data[r], step_idx[r], settings[r] = _key_data(j.sampling.key), j.step_index, j.sampling.settings
                if j.query_rows:
                    query_idx.append(at)
            else:
                if j.done + n == j.tokens.size:  # the last piece draws the reply's first token
                    key_data[r], step_idx[r], settings[r] = _key_data(j.sampling.key), j.sampling.index, j.sampling.settings
                if j.q_idx_X is not None:
                    here = np.flatnonzero((j.q_idx_X >= j.done) & (j.q_idx_X < j.done + n))
                    query_idx.extend((at + j.q_idx_X[here] - j.done).tolist())
            at += n
        outputs = self._outputs(entries)
        X = self.capture_rows(T, wide=any(j.wide_capture for j, _ in step.pieces))
        if len(query_idx) > X:
            raise AssertionError(f"a step of {T} tokens captures {len(query_idx)} query rows, at most {X}")
        query_idx_X = np.zeros(X if outputs.query_rows else 1, np.int32)
        query_idx_X[: len(query_idx)] = query_idx
        batch = StepBatch(tokens, positions, slots, rows, q_start, q_len, key_data, step_idx, RowSamplers.of(settings), query_idx_X)
        plan = kv.pool.step_plan(list(step.pieces), [int(q_start[len(decode) + i]) for i in range(len(step.pieces))], T)
        sampled, cache, aux = run_step(
            self.graphdef, self.params, kv.cache, batch, plan, backend=self.backend, mesh=self.mesh, outputs=outputs
        )
        kv.commit(cache)
        self._record_step(entries, np.asarray(sampled), aux, q_start, query_idx)
        kv.settle([e[0].row for e in entries])

    def _outputs(self, entries) -> Outputs:
        """The union of what the step's jobs ask for. A step that brings back mass
        brings back query rows too (one program for both). A prefill job that asks
        for its last token's logits asks in every step it is in, so its chunks run
        one program, not one without logits and one with (``_record_step`` copies
        them to the host only when a job takes them)."""
        pieces = [(j, toks) for j, toks, _ in entries if isinstance(j, PrefillJob)]
        decode = [j for j, _, _ in entries if isinstance(j, DecodeJob)]
        logits = None
        if any(j.logits == "all" for j, _ in pieces):
            logits = "all"
        elif any(j.return_logits for j in decode) or any(j.logits == "last" for j, _ in pieces):
            logits = "last"
        mass = any(j.attn_mass for j, _ in pieces) or any(j.attn_mass for j in decode)
        rows = mass or any(j.q_idx_X is not None for j, _ in pieces) or any(j.query_rows for j in decode)
        return Outputs(logits, rows, mass)

    def _record_step(self, entries, sampled, aux, q_start, query_idx) -> None:
        """Bring the jobs and the rows' host records up to date after a step
        (``aux``: the step's device outputs; logits are copied to the host at the
        first job that takes them, the rest at once)."""
        kv = self.kv
        host_logits = functools.cache(lambda: np.asarray(aux["logits"]))
        q_rows = np.asarray(aux["q_rows"]) if "q_rows" in aux else None  # [L, X, Hq, D]
        mass_JRN = np.asarray(aux["mass"]) if "mass" in aux else None
        where = {flat: x for x, flat in enumerate(query_idx)}
        for r, (j, toks, sl) in enumerate(entries):
            st = kv.row(j.row)
            n, start = toks.size, int(q_start[r])
            mass_P = None
            if mass_JRN is not None and j.attn_mass:
                mass_P = _list_mass(mass_JRN[:, r], st.layer_positions(kv.lists), st.seq_len, n)  # old positions, then the n new
            if isinstance(j, DecodeJob):
                tok = int(sampled[r])
                kv.append(j.row, [j.next_feed], sl)
                st.allocated += 1
                j.tokens.append(tok)
                j.fed += 1
                j.stopped = tok in j.stop_ids
                if j.return_logits:
                    j.logits.append(host_logits()[r][None])
                if j.query_rows:
                    j.q_rows.append(q_rows[:, where[start]][None])
                if mass_P is not None:
                    if j.mass is not None:
                        mass_P[: j.mass.size] += j.mass
                    j.mass = mass_P
                continue
            if mass_P is not None:
                j.mass[: mass_P.size] += mass_P
            if j.q_idx_X is not None:
                here = np.flatnonzero((j.q_idx_X >= j.done) & (j.q_idx_X < j.done + n))
                j.q_rows[:, here] = q_rows[:, [where[start + int(i) - j.done] for i in j.q_idx_X[here]]]
            last = j.done + n == j.tokens.size
            if j.logits == "all":
                j.logit_pieces.append(host_logits()[start : start + n])
            elif j.logits == "last" and last:
                j.logit_pieces.append(host_logits()[r][None])
            if last:
                j.first_token = int(sampled[r])
            kv.append(j.row, toks, sl)
            j.done += n

    def import_chunk(self, job: PrefillJob, chunk: int) -> None:
        """Store the next chunk (at most ``chunk`` tokens: a quantized pool's pages are
        planned per chunk) of an imported prefill (``KVSource``) as a step would
        store it, without a forward."""
        n = min(job.tokens.size - job.done, chunk)
        T = buckets.step_tokens(n, self.token_budget)
        cfg = self.cfg
        k = np.zeros((cfg.num_layers, T, cfg.num_kv_heads, cfg.head_dim), np.float32)
        v = np.zeros_like(k)
        k[:, :n] = job.kv_source.k[:, job.done : job.done + n]
        v[:, :n] = job.kv_source.v[:, job.done : job.done + n]
        plan = self.kv.pool.step_plan([(job, n)], [0], T)
        self.kv.import_rows(job.row, job.tokens[job.done : job.done + n], job.slots[job.done : job.done + n], k, v, plan, T)
        if job.done + n == job.tokens.size:  # no step ran: the reply's first token is drawn from the source's logits
            job.logit_pieces.append(np.asarray(job.kv_source.last_logits, np.float32)[None])
        job.done += n
        self.kv.settle([job.row])

    # -- the decode loop -----------------------------------------------------------------
    def decode(self, jobs: list, max_steps: int | None = None, *, regroup: bool = False) -> None:
        """Advance every job by up to ``max_steps`` steps (default: all it has left)
        in one ``run_decode`` call. Jobs of any samplers share the call. ``regroup``:
        end the call once half its rows have stopped. Slots for the steps are taken
        first (``OutOfSlotsError`` before any change) and the unused ones released
        after."""
        kv = self.kv
        steps = [j.n_steps - j.fed if max_steps is None else min(j.n_steps - j.fed, max_steps) for j in jobs]
        n = max(steps) if max_steps is None else int(max_steps)  # a fixed chunk: one compile, rows stop at their limit
        fresh = kv.allocate(sum(steps))  # raises before any change
        per_job = np.split(fresh, np.cumsum(steps)[:-1])
        states = [kv.row(j.row) for j in jobs]
        B = buckets.decode_row_bucket(len(jobs))
        rows = np.full(B, kv.rows, np.int32)
        first, limit = np.zeros(B, np.int32), np.zeros(B, np.int32)
        slots = np.zeros((B, n), np.int32)
        stop = np.full((B, buckets.stop_width(max(len(j.stop_ids) for j in jobs))), -1, np.int32)
        key_data = np.zeros((B, *_key_data(None).shape), np.uint32)
        step0, forced = np.zeros(B, np.int32), np.zeros((B, n), np.int32)
        settings = [(0.0, None, None)] * B
        for b, (j, k, s) in enumerate(zip(jobs, steps, per_job)):
            rows[b], first[b], limit[b] = j.row, j.next_feed, k
            slots[b, :k] = s
            stop[b, : len(j.stop_ids)] = j.stop_ids
            key_data[b], step0[b], settings[b] = _key_data(j.sampling.key), j.step_index, j.sampling.settings
            if j.forced is not None:
                f = j.forced[j.fed : j.fed + n]
                forced[b, : len(f)] = f
        outputs = Outputs("last" if any(j.return_logits for j in jobs) else None, any(j.query_rows for j in jobs))
        batch = DecodeBatch(rows, first, limit, slots, stop, key_data, step0, RowSamplers.of(settings), forced)
        plan = kv.pool.decode_plan(states, [s[:k] for s, k in zip(per_job, steps)], B, n)
        window, window_len, regather, width, len_JB = self._window(rows, states, n)
        tokens, fed, cache, aux, window = run_decode(
            self.graphdef,
            self.params,
            kv.cache,
            batch,
            plan,
            window,
            self._layer_copies() if width else None,
            window_len,
            regather,
            backend=self.backend,
            n_steps=n,
            width=width,
            outputs=outputs,
            teacher_forced=any(j.forced is not None for j in jobs),
            mesh=self.mesh,
            regroup=regroup,
        )
        kv.commit(cache)
        tokens, fed = np.asarray(tokens), np.asarray(fed)
        self._kept = DecodeState(window, (tuple(int(r) for r in rows), n, width), kv.writes, len_JB, fed) if len_JB is not None else None
        logits = np.asarray(aux["logits"]) if "logits" in aux else None
        q_rows = np.asarray(aux["q_rows"]) if "q_rows" in aux else None
        unused = []
        for b, (j, st, s) in enumerate(zip(jobs, states, per_job)):
            k = int(fed[b])
            new = tokens[b, :k].tolist()
            rest = j.forced[j.fed : j.fed + k - 1] if j.forced is not None else new[: k - 1]
            kv.append(j.row, ([j.next_feed] + list(rest))[:k], s[:k])
            st.allocated += k
            unused.append(s[k:])
            j.tokens += new
            j.fed += k
            j.stopped = bool(k and new[-1] in j.stop_ids)
            if j.return_logits:
                j.logits.append(logits[b, :k])
            if j.query_rows:
                j.q_rows.append(q_rows[:k, :, b])
        kv.release(np.concatenate(unused))
        kv.settle([j.row for j in jobs])

    @property
    def kept(self) -> DecodeState | None:
        """The decode state kept for the next call (None: the next call copies its window)."""
        return self._kept

    def uses_window(self, B: int, width: int) -> bool:
        """Whether a decode call of ``B`` rows reads a window of ``width`` entries:
        on a backend that has one, off a mesh, while the copy has no more entries
        than the pool has slots (``B * width <= S``)."""
        return self.use_window and self.backend.uses_window and self.mesh is None and B * width <= self.kv.allocator.num_slots

    def _window(self, rows, states, n: int):
        """The decode call's window inputs: ``(window, len_LR, regather, width,
        len_JB)``; ``width`` 0: no window.

        A backend with a window (``uses_window``) is handed the kept window: rolled on (``regather`` false) when it was made for
        the same rows and shape and nothing but truncations wrote the cache since
        (each list is then at most what it held after that call), else as the
        buffer a fresh copy replaces (the kept one when its shape fits, zeros
        otherwise), so one program serves both. ``len_LR`` ``[L, B]`` are the entries
        each layer's list of each row has now (``-1``: a padding row); ``len_JB``
        the same per live list (host)."""
        none = (None, None, None, 0, None)
        if not self.backend.uses_window:
            return none
        width = buckets.window_width(self.backend.window_entries(states), self.kv.max_positions)
        if not self.uses_window(len(rows), width):
            return none
        J, L = self.kv.lists, self.cfg.num_layers
        len_JB = np.full((J, len(rows)), -1, np.int32)
        for b, st in enumerate(states):
            len_JB[:, b] = [len(x) for x in st.layer_lists(J)]
        len_LR = len_JB[np.minimum(np.arange(L), J - 1)]
        key = (tuple(int(r) for r in rows), n, width)
        kept, self._kept = self._kept, None
        if kept is not None and kept.key == key and kept.writes == self.kv.writes and np.all(len_JB <= kept.len_JB + kept.fed_B[None, :]):
            return kept.loop_state, len_LR, np.False_, width, len_JB
        self.regathers += 1
        same_shape = kept is not None and len(kept.key[0]) == len(rows) and kept.key[1:] == key[1:]
        buffer = kept.loop_state if same_shape else self._zero_window(rows, n, width)
        return buffer, len_LR, np.True_, width, len_JB

    def _zero_window(self, rows, n: int, width: int):
        """A window-shaped buffer of zeros (the program replaces it with a fresh copy),
        made on the host: no program is compiled for it."""
        shape = jax.eval_shape(lambda c: self.backend.take_window(c, rows, width=width, n_steps=n), self.kv.cache)
        return jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype)), shape)

    def _layer_copies(self) -> tuple:
        """The layers' weights one array set per layer (``jaxkv.forward.layer_copies``),
        taken on the first windowed decode call and kept: the CPU decode loop's
        weights. A second copy of the layer weights in host memory, for about a
        tenth more batch-1 decode speed (``eval/bench/engine.py``)."""
        if self._layer_params is None:
            self._layer_params = layer_copies(self.graphdef, self.params)
        return self._layer_params
