"""The engine: jit'd prefill / decode steps over the paged cache, and the host
bookkeeping that decides what they write.

Read top to bottom, a request goes:

1. ``Engine.open_row(prefix_slots)``: take a cache row; a reused prefix (from the
   radix cache) is installed as the row's first positions. Sentinel entries in it
   are holes: neither re-prefilled nor read.
2. ``Engine.prefill(rows, token_lists)``: slots are allocated on the host, then
   ``prefill_step`` (jit) runs chunk by chunk, writing K/V and growing the tables.
3. ``Engine.decode(rows, first_tokens, n)``: slots for ``n`` steps are allocated
   up front, ``decode_loop`` (jit, ``lax.while_loop``) samples until every row hit
   a stop token or ``n`` steps; unused slots go back to the allocator.
4. ``Engine.close_row(row)``: the row drops its references.

Invariants:
  * the host mirror of each row (``RowState``) equals the device tables after
    every call (tests check ``slot_map``/``live_idx`` against it);
  * each row holds exactly one allocator reference per non-sentinel slot it maps;
  * host checks (slots, context length) run before any device call, so a failing
    call leaves cache and allocator untouched;
  * device arrays that depend on lengths are bucketed (powers of two) so compiles
    are reused; decode reads ``live_idx[:, :n_read]``, so attention cost follows
    the live-token count, not the position count.

``generate`` and ``score_logits`` are the public one-shot entry points.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv import pallas
from jaxkv.cache.allocator import SENTINEL_SLOT, SlotAllocator
from jaxkv.cache.state import PagedKVCache, append_tokens
from jaxkv.errors import ContextLengthError, JaxKVError
from jaxkv.models.loading import Model
from jaxkv.models.transformer import NO_FEATURES, Features
from jaxkv.sampling import SamplerSpec, make_sampler, sample


def bucket(n: int, minimum: int = 16, step: int = 512) -> int:
    """Compile-friendly size >= n: a power of two up to ``step``, then a multiple of it.

    Padding costs at most 2x below ``step`` and at most ``step`` entries above, so
    attention over a bucketed live list stays proportional to the live count.
    """
    n = max(int(n), minimum)
    if n <= step:
        return 1 << (n - 1).bit_length()
    return -(-n // step) * step


# ============================================================================ jit'd steps
@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "n_read", "features", "all_logits"),
    donate_argnames=("cache",),
)
def prefill_step(graphdef, params, cache: PagedKVCache, tokens_RT, chunk_len_R, slots_RT, q_row_idx_RX, *, n_read, features, all_logits):
    """Prefill one chunk for every row (rows with ``chunk_len`` 0 are untouched).

    Returns ``(logits, cache, aux)``; logits are ``[R,T,V]`` when ``all_logits``
    else the last real token's ``[R,V]``.
    """
    model = nnx.merge(graphdef, params)
    T = tokens_RT.shape[1]
    positions = cache.seq_len[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    logits, k, v, aux = model.prefill(
        tokens_RT,
        positions,
        cache.k,
        cache.v,
        cache.live_idx[:, :n_read],
        cache.live_len,
        chunk_len_R,
        slots_RT,
        features=features,
        q_row_idx_BR=q_row_idx_RX,
    )
    cache = append_tokens(cache.replace(k=k, v=v), slots_RT, chunk_len_R)
    if not all_logits:
        last = jnp.maximum(chunk_len_R - 1, 0)
        logits = logits[jnp.arange(logits.shape[0]), last]
    return logits, cache, aux


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "n_steps", "n_read", "spec", "backend", "return_logits", "teacher_forced", "features"),
    donate_argnames=("cache",),
)
def decode_loop(
    graphdef,
    params,
    cache: PagedKVCache,
    first_token_R,
    active_R,
    slots_RN,
    stop_ids_X,
    key,
    temperature,
    top_p,
    forced_RN,
    *,
    n_steps,
    n_read,
    spec: SamplerSpec,
    backend=None,
    return_logits=False,
    teacher_forced=False,
    features: Features = NO_FEATURES,
):
    """Decode up to ``n_steps`` tokens per active row.

    Each step feeds the row's last token (writing its K/V at the next slot of
    ``slots_RN``) and samples the next. A row stops after emitting a token in
    ``stop_ids_X`` (padded with -1). With ``teacher_forced`` the fed token of
    step ``s > 0`` is ``forced_RN[:, s-1]`` instead of the sample.

    Returns ``(tokens [R,n], n_fed [R], cache, logits [R,n,V] or None, aux)``
    where ``tokens[:, s]`` is the token sampled at step ``s`` and ``n_fed`` counts
    the tokens written to the cache. ``aux`` holds, when ``features`` asks,
    ``q_rows [n, L, R, Hq, D]`` (the post-RoPE query of each fed token) and
    ``mass_S [S]`` (attention mass each slot received, mean over layers and
    heads, summed over steps).
    """
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    R = first_token_R.shape[0]
    V = cfg.vocab_size
    logits_buf = jnp.zeros((R, n_steps if return_logits else 0, V), jnp.float32)
    aux0 = {}
    if features.query_rows:
        aux0["q_rows"] = jnp.zeros((n_steps, cfg.num_layers, R, cfg.num_heads, cfg.head_dim), jnp.float32)
    if features.attn_mass:
        aux0["mass_S"] = jnp.zeros((cache.num_slots,), jnp.float32)

    def cond(carry):
        step, _, _, _, active, _, _, _ = carry
        return (step < n_steps) & active.any()

    def body(carry):
        step, cache, tokens, fed, active, last, logits_buf, aux = carry
        slot = jnp.where(active, slots_RN[:, step], SENTINEL_SLOT)
        pos = cache.seq_len
        cache = append_tokens(cache, slot[:, None], active.astype(jnp.int32))
        live_BN = cache.live_idx[:, :n_read]
        logits, k, v, step_aux = model.decode(
            last, pos, cache.k, cache.v, live_BN, cache.live_len, slot, features=features,
            decode_attention=functools.partial(pallas.decode_attention, backend=backend),
        )
        cache = cache.replace(k=k, v=v)
        aux = dict(aux)
        if features.query_rows:
            aux["q_rows"] = aux["q_rows"].at[step].set(step_aux["q_rows"][:, :, 0].astype(jnp.float32))
        if features.attn_mass:
            per_entry = step_aux["attn_mass"].mean(axis=(0, 2)) * active[:, None]  # [R, n_read]
            aux["mass_S"] = aux["mass_S"].at[live_BN].add(per_entry)
        nxt = sample(logits, jax.random.fold_in(key, step), spec, temperature, top_p)
        nxt = jnp.where(active, nxt, -1)
        tokens = tokens.at[:, step].set(nxt)
        fed = fed + active.astype(jnp.int32)
        if return_logits:
            logits_buf = logits_buf.at[:, step].set(logits)
        stopped = (nxt[:, None] == stop_ids_X[None, :]).any(-1)
        new_active = active & ~stopped
        feed = forced_RN[:, step] if teacher_forced else nxt
        return step + 1, cache, tokens, fed, new_active, feed, logits_buf, aux

    tokens = jnp.full((R, n_steps), -1, jnp.int32)
    carry = (jnp.int32(0), cache, tokens, jnp.zeros((R,), jnp.int32), active_R, first_token_R, logits_buf, aux0)
    _, cache, tokens, fed, _, _, logits_buf, aux = jax.lax.while_loop(cond, body, carry)
    return tokens, fed, cache, (logits_buf if return_logits else None), aux


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _dense_logits(graphdef, params, tokens_BT):
    return nnx.merge(graphdef, params)(tokens_BT)


@jax.jit
def _gather_keys(k_LSKD, slots_N):
    return k_LSKD[:, slots_N].astype(jnp.float32)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _copy_rows(cache: PagedKVCache, src_M, dst_M):
    return cache.replace(k=cache.k.at[:, dst_M].set(cache.k[:, src_M]), v=cache.v.at[:, dst_M].set(cache.v[:, src_M]))


@functools.partial(jax.jit, donate_argnames=("cache",))
def _install_row(cache: PagedKVCache, row, slot_map_P, live_idx_P, live_len, seq_len):
    return cache.replace(
        slot_map=cache.slot_map.at[row].set(slot_map_P),
        live_idx=cache.live_idx.at[row].set(live_idx_P),
        live_len=cache.live_len.at[row].set(live_len),
        seq_len=cache.seq_len.at[row].set(seq_len),
    )


# ============================================================================ host side
@dataclasses.dataclass
class RowState:
    """Host mirror of one cache row.

    Attributes:
      slots: position -> slot for every position written so far (sentinel = hole).
      live: the live-index list (slots attention reads, in position order).
    """

    slots: list[int] = dataclasses.field(default_factory=list)
    live: list[int] = dataclasses.field(default_factory=list)

    @property
    def seq_len(self) -> int:
        return len(self.slots)

    def owned(self) -> np.ndarray:
        """Slots this row holds a reference on (its non-sentinel positions)."""
        s = np.asarray(self.slots, dtype=np.int64)
        return s[s != SENTINEL_SLOT]


class Engine:
    """A paged KV pool plus the host bookkeeping for up to ``rows`` requests.

    Args:
      model: a loaded ``Model``.
      rows: concurrent requests (cache rows).
      max_positions: positions per row (P); defaults to the model context, at most 8192.
      num_slots: pool slots including the sentinel; default ``rows * P + 1``.
      prefill_chunk: tokens per prefill call.
      backend: decode-attention backend passed to ``jaxkv.pallas.decode_attention``.
      reclaim: optional ``reclaim(n_slots) -> freed`` called when fewer than the
        needed slots are free (e.g. the radix cache's LRU eviction); only if it
        cannot free enough does the allocation raise ``OutOfSlotsError``.
    """

    def __init__(self, model: Model, *, rows: int = 1, max_positions: int | None = None, num_slots: int | None = None, prefill_chunk: int = 512, backend=None, reclaim=None):
        cfg = model.config
        self.model = model
        self.graphdef, self.params = model.split()
        P = int(max_positions or min(cfg.max_position_embeddings, 8192))
        if P > cfg.max_position_embeddings:
            raise ContextLengthError(
                f"max_positions {P} exceeds the model context {cfg.max_position_embeddings}"
            )
        self.max_positions = P
        self.allocator = SlotAllocator(num_slots or rows * P + 1)
        self.cache = PagedKVCache.create(
            num_layers=cfg.num_layers,
            num_slots=self.allocator.num_slots,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            rows=rows,
            positions=P,
            dtype=model.dtype,
        )
        self.prefill_chunk = int(prefill_chunk)
        self.backend = backend
        self.row_state: list[RowState | None] = [None] * rows
        self.reclaim = reclaim

    def allocate(self, n: int) -> np.ndarray:
        """``n`` fresh slots, reclaiming cached ones first when the pool is short."""
        short = n - self.allocator.num_free
        if short > 0 and self.reclaim is not None:
            self.reclaim(short)
        return self.allocator.allocate(n)

    # -- rows ------------------------------------------------------------------
    def open_row(self, prefix_slots: Sequence[int] = ()) -> int:
        """Take a free row; install ``prefix_slots`` (may contain sentinel holes)."""
        try:
            row = self.row_state.index(None)
        except ValueError:
            raise JaxKVError(f"all {len(self.row_state)} cache rows are in use") from None
        prefix = np.asarray(prefix_slots, dtype=np.int64).reshape(-1)
        if prefix.size > self.max_positions:
            raise ContextLengthError(f"prefix of {prefix.size} tokens exceeds {self.max_positions} positions")
        owned = prefix[prefix != SENTINEL_SLOT]
        self.allocator.ref(owned)  # validates before changing anything
        state = RowState(slots=prefix.tolist(), live=owned.tolist())
        self.row_state[row] = state
        self._push_row(row)
        return row

    def close_row(self, row: int) -> np.ndarray:
        """Release the row's references; returns slots that became free."""
        state = self._row(row)
        freed = self.allocator.release(state.owned())
        self.row_state[row] = None
        return freed

    def _row(self, row: int) -> RowState:
        if not 0 <= row < len(self.row_state) or self.row_state[row] is None:
            raise JaxKVError(f"cache row {row} is not open")
        return self.row_state[row]

    def _push_row(self, row: int) -> None:
        state = self.row_state[row]
        P = self.max_positions
        slot_map = np.zeros(P, np.int32)
        slot_map[: state.seq_len] = state.slots
        live = np.zeros(P, np.int32)
        live[: len(state.live)] = state.live
        self.cache = _install_row(self.cache, row, slot_map, live, len(state.live), state.seq_len)

    def truncate_row(self, row: int, length: int) -> np.ndarray:
        """Forget positions ``>= length`` of a row (e.g. a generation that a replay
        discards); returns the slots that became free."""
        state = self._row(row)
        if not 0 <= length <= state.seq_len:
            raise JaxKVError(f"cannot truncate row {row} of {state.seq_len} positions to {length}")
        dropped = np.asarray(state.slots[length:], np.int64)
        dropped = dropped[dropped != SENTINEL_SLOT]
        gone = set(dropped.tolist())
        state.slots = state.slots[:length]
        state.live = [s for s in state.live if s not in gone]
        freed = self.allocator.release(dropped)
        self._push_row(row)
        return freed

    def live_positions(self, row: int) -> np.ndarray:
        """Positions of the row's live entries (in live-list order = position order)."""
        slots = np.asarray(self._row(row).slots)
        return np.flatnonzero(slots != SENTINEL_SLOT)

    def gather_keys(self, row: int, n: int | None = None) -> jax.Array:
        """Post-RoPE keys of the row's live positions ``[L, N, Hkv, D]``, padded
        with the sentinel's row up to ``n`` entries when given."""
        live = np.asarray(self._row(row).live, np.int32)
        if n is not None:
            live = np.concatenate([live, np.full(n - live.size, SENTINEL_SLOT, np.int32)])
        return _gather_keys(self.cache.k, jnp.asarray(live))

    def gather_rows(self, slots) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of the K and V rows at ``slots``: ``[L, M, Hkv, D]`` each."""
        idx = np.asarray(slots, np.int32)
        return np.asarray(self.cache.k[:, idx]), np.asarray(self.cache.v[:, idx])

    def apply_layout(self, row: int, plan) -> None:
        """Apply a ``jaxkv.policies.layouts.LayoutPlan`` to a row (pool + tables)."""
        from jaxkv.pallas import rope_delta

        self._row(row)
        if plan.copy_src.size:
            src = jnp.asarray(plan.copy_src, jnp.int32)
            dst = jnp.asarray(plan.copy_dst, jnp.int32)
            self.cache = _copy_rows(self.cache, src, dst)
            k = rope_delta(self.cache.k, dst, jnp.asarray(plan.delta, jnp.int32), self.model.config.rope)
            self.cache = self.cache.replace(k=k)
        self.set_row_tables(row, plan.slots, plan.live)
        self.allocator.release(plan.released)

    def set_row_tables(self, row: int, slots: Sequence[int], live: Sequence[int]) -> None:
        """Replace a row's host + device tables (used by layouts that edit them)."""
        state = self._row(row)
        state.slots, state.live = list(slots), list(live)
        self._push_row(row)

    # -- prefill -----------------------------------------------------------------
    def prefill(self, rows: Sequence[int], token_lists: Sequence[Sequence[int]], *, all_logits=False, features: Features = NO_FEATURES, q_row_positions=None):
        """Append ``token_lists[i]`` to ``rows[i]``; returns logits of the new tokens.

        Returns a list (one per row) of float32 numpy arrays: ``[n_i, V]`` when
        ``all_logits`` else ``[V]`` for the last token. With ``features``, returns
        ``(logits, aux)``: with ``features.attn_mass``, ``aux["attn_mass"][i]`` is
        ``[L, Hq, seq_len]`` float32, the attention mass each position of row i
        received from this prefill's query rows (summed over rows and chunks; 0
        at holes); with ``features.query_rows``, ``aux["q_rows"]`` is
        ``[L, len(rows), X, Hq, D]``: the post-RoPE queries at
        ``q_row_positions[i]`` (X indices into ``token_lists[i]``).
        """
        states = [self._row(r) for r in rows]
        lens = [len(t) for t in token_lists]
        for r, st, n in zip(rows, states, lens):
            if st.seq_len + n > self.max_positions:
                raise ContextLengthError(
                    f"row {r}: {st.seq_len} cached + {n} new tokens exceed {self.max_positions} positions"
                )
        new_slots = self.allocate(sum(lens))  # raises before any change
        per_row = np.split(new_slots, np.cumsum(lens)[:-1])
        R = len(self.row_state)
        C = min(self.prefill_chunk, bucket(max(lens + [1])))
        outputs = [[] for _ in rows]
        cfg = self.model.config
        mass = [np.zeros((cfg.num_layers, cfg.num_heads, st.seq_len + n), np.float32) for st, n in zip(states, lens)] if features.attn_mass else None
        q_pos = np.asarray(q_row_positions if q_row_positions is not None else [[0]] * len(rows), np.int64)
        n_q = q_pos.shape[1]
        q_rows = None
        for start in range(0, max(lens + [0]), C):
            tokens = np.zeros((R, C), np.int32)
            slots = np.zeros((R, C), np.int32)
            counts = np.zeros((R,), np.int32)
            for i, r in enumerate(rows):
                piece = list(token_lists[i][start : start + C])
                tokens[r, : len(piece)] = piece
                slots[r, : len(piece)] = per_row[i][start : start + len(piece)]
                counts[r] = len(piece)
            n_read = min(bucket(max(len(s.live) for s in self.row_state if s is not None)), self.max_positions)
            q_idx = np.zeros((R, n_q), np.int32)
            for i, r in enumerate(rows):
                q_idx[r] = np.clip(q_pos[i] - start, 0, C - 1)
            logits, self.cache, aux = prefill_step(
                self.graphdef, self.params, self.cache, tokens, counts, slots, q_idx,
                n_read=n_read, features=features, all_logits=all_logits,
            )
            logits = np.asarray(logits)
            if features.attn_mass:
                chunk_mass = np.asarray(aux["attn_mass"])  # [L, R, Hq, n_read + C]
                for i, r in enumerate(rows):
                    st = states[i]
                    slots_np = np.asarray(st.slots)
                    live_pos = np.flatnonzero(slots_np != SENTINEL_SLOT)  # live list is in position order
                    mass[i][:, :, live_pos] += chunk_mass[:, r, :, : live_pos.size]
                    k = counts[r]
                    mass[i][:, :, st.seq_len : st.seq_len + k] += chunk_mass[:, r, :, n_read : n_read + k]
            for i, r in enumerate(rows):
                if counts[r]:
                    outputs[i].append(logits[r, : counts[r]] if all_logits else logits[r])
                    added = per_row[i][start : start + counts[r]].tolist()
                    states[i].slots += added
                    states[i].live += added
            if features.query_rows:
                chunk_q = np.asarray(aux.pop("q_rows"))[:, list(rows)]  # [L, len(rows), X, Hq, D]
                if q_rows is None:
                    q_rows = np.zeros_like(chunk_q)
                here = (q_pos >= start) & (q_pos < start + C)  # [len(rows), X]
                q_rows[:, here] = chunk_q[:, here]
        result = [np.concatenate(o) if all_logits else o[-1] for o in outputs]
        if features == NO_FEATURES:
            return result
        aux_out = {}
        if features.attn_mass:
            aux_out["attn_mass"] = mass
        if q_rows is not None:
            aux_out["q_rows"] = q_rows
        return result, aux_out

    # -- decode ------------------------------------------------------------------
    def decode(self, rows: Sequence[int], first_tokens: Sequence[int], n_steps: int, *, temperature=0.0, top_k=None, top_p=None, key=None, stop_token_ids=(), return_logits=False, forced_tokens=None, features: Features = NO_FEATURES):
        """Feed ``first_tokens`` and decode up to ``n_steps`` tokens per row.

        Returns ``(tokens, logits)``: ``tokens[i]`` the sampled tokens of row i
        (ending with its stop token when one was hit); ``logits[i]`` ``[n, V]``
        when ``return_logits``. ``forced_tokens[i]`` (teacher forcing) replaces
        the fed token of every step after the first. With ``features``, returns
        ``(tokens, logits, aux)``: ``aux["q_rows"][i]`` ``[n_i, L, Hq, D]`` the
        query of each fed token; ``aux["attn_mass"][i]`` ``[seq_len]`` the mass
        each position of row i received during this call (mean over layers and
        heads, summed over steps).
        """
        spec, temp, top_p_val = make_sampler(temperature, top_k, top_p)
        if n_steps <= 0:
            return [[] for _ in rows], None
        states = [self._row(r) for r in rows]
        for r, st in zip(rows, states):
            if st.seq_len + n_steps > self.max_positions:
                raise ContextLengthError(
                    f"row {r}: {st.seq_len} cached + {n_steps} decode steps exceed {self.max_positions} positions"
                )
        new_slots = self.allocate(n_steps * len(rows)).reshape(len(rows), n_steps)
        R = len(self.row_state)
        slots = np.zeros((R, n_steps), np.int32)
        first = np.zeros((R,), np.int32)
        active = np.zeros((R,), bool)
        forced = np.zeros((R, n_steps), np.int32)
        for i, r in enumerate(rows):
            slots[r] = new_slots[i]
            first[r] = first_tokens[i]
            active[r] = True
            if forced_tokens is not None:
                f = list(forced_tokens[i])[: n_steps]
                forced[r, : len(f)] = f
        stop = np.asarray(sorted(set(stop_token_ids)) or [-1], np.int32)
        longest = max(len(s.live) for s in self.row_state if s is not None) + n_steps
        n_read = min(bucket(longest), self.max_positions)
        tokens, fed, self.cache, logits, aux = decode_loop(
            self.graphdef, self.params, self.cache, first, active, slots, stop,
            key if key is not None else jax.random.key(0), temp, top_p_val, forced,
            n_steps=n_steps, n_read=n_read, spec=spec, backend=self.backend,
            return_logits=return_logits, teacher_forced=forced_tokens is not None,
            features=features,
        )
        tokens, fed = np.asarray(tokens), np.asarray(fed)
        out_tokens, out_logits = [], []
        unused = []
        for i, r in enumerate(rows):
            n = int(fed[r])
            used = new_slots[i][:n].tolist()
            states[i].slots += used
            states[i].live += used
            unused.append(new_slots[i][n:])
            out_tokens.append(tokens[r, :n].tolist())
            if return_logits:
                out_logits.append(np.asarray(logits[r, :n]))
        self.allocator.release(np.concatenate(unused))
        if features == NO_FEATURES:
            return out_tokens, (out_logits if return_logits else None)
        aux_out = {}
        if features.query_rows:
            q = np.asarray(aux["q_rows"])
            aux_out["q_rows"] = [q[: int(fed[r]), :, r] for r in rows]
        if features.attn_mass:
            mass_S = np.asarray(aux["mass_S"])
            aux_out["attn_mass"] = [
                np.where(np.asarray(st.slots) != SENTINEL_SLOT, mass_S[np.asarray(st.slots)], 0.0) for st in states
            ]
        return out_tokens, (out_logits if return_logits else None), aux_out


# ============================================================================ public
def score_logits(model: Model, token_ids) -> jax.Array:
    """Full-sequence float32 logits ``[B,T,V]`` with no cache: the parity oracle."""
    tokens = jnp.asarray(token_ids, dtype=jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"token_ids must be [batch, time], got shape {tokens.shape}")
    _check_ids(model, np.asarray(tokens).reshape(-1))
    graphdef, params = model.split()
    return _dense_logits(graphdef, params, tokens)


def _check_ids(model: Model, ids: np.ndarray) -> None:
    bad = (ids < 0) | (ids >= model.config.vocab_size)
    if bad.any():
        raise ValueError(f"token ids out of range [0, {model.config.vocab_size}): {ids[bad][:5].tolist()}")


def generate(model: Model, prompts, max_new_tokens: int, temperature: float = 0.0, top_k=None, top_p=None, seed: int = 0, stop_token_ids=None, *, backend=None) -> list[list[int]]:
    """Generate up to ``max_new_tokens`` tokens for each prompt (a list of id lists).

    Greedy when ``temperature == 0``. Sampling draws from ``jax.random.key(seed)``.
    A row ends after its first stop token (included in its output).
    """
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    prompts = [list(map(int, p)) for p in prompts]
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    for p in prompts:
        _check_ids(model, np.asarray(p))
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    make_sampler(temperature, top_k, top_p)  # validate before any work
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > model.config.max_position_embeddings:
        raise ContextLengthError(
            f"prompt + max_new_tokens = {longest} tokens exceed the model context "
            f"{model.config.max_position_embeddings}"
        )
    if max_new_tokens == 0:
        return [[] for _ in prompts]
    P = min(bucket(longest), model.config.max_position_embeddings)
    engine = Engine(model, rows=len(prompts), max_positions=P, backend=backend)
    rows = [engine.open_row() for _ in prompts]
    last_logits = engine.prefill(rows, prompts)
    spec, temp, top_p_val = make_sampler(temperature, top_k, top_p)
    key = jax.random.key(seed)
    first = np.asarray(sample(jnp.asarray(np.stack(last_logits)), jax.random.fold_in(key, 1 << 30), spec, temp, top_p_val))
    stop = set(stop_token_ids or ())
    outputs = [[int(t)] for t in first]
    live_rows = [i for i, t in enumerate(first) if int(t) not in stop]
    if max_new_tokens > 1 and live_rows:
        tokens, _ = engine.decode(
            [rows[i] for i in live_rows], [int(first[i]) for i in live_rows], max_new_tokens - 1,
            temperature=temperature, top_k=top_k, top_p=top_p, key=key, stop_token_ids=stop,
        )
        for i, toks in zip(live_rows, tokens):
            outputs[i] += toks
    return outputs


# ============================================================================ compression
@dataclasses.dataclass(frozen=True)
class CompressionReport:
    """What one compression event did (positions in the numbering before it)."""

    live_before: int
    live_after: int
    kept_positions: np.ndarray
    plan: object
    evicted_scores: np.ndarray | None = None  # policy score of each plan.evicted_positions entry


@functools.partial(jax.jit, static_argnames=("policy", "cfg"))
def score_and_select(policy, cfg, state, feats, forced_N, budget):
    """One event's decision, jit'd per (policy, config, padded N): forced set =
    engine-forced ∪ the policy's keep set (real entries only), scores, kept mask."""
    from jaxkv.policies.base import select

    valid = feats.valid()
    forced = jnp.asarray(forced_N, bool)
    if policy.keep is not None:
        forced = forced | policy.keep(cfg, feats)
    forced = forced & valid
    candidates = ~forced & valid
    scores, state = policy.score(cfg, state, feats, candidates)
    return select(scores, forced, candidates, budget), scores, state


def compress_row(engine: Engine, row: int, policy, cfg, state, feats, forced_N, budget: int, layout: str, on_evict=None):
    """One compression event on a row: score, select, apply the layout.

    ``feats`` are the row's ``EventFeatures`` (live positions in order, padded
    with ``valid_N`` false entries) and ``forced_N`` the engine-forced mask
    (protected prefix, actionable query); the policy's own keep set is added
    here. ``on_evict(plan, k_LMKD, v_LMKD, scores_M)``, when given, receives host
    copies of the evicted rows and their compression scores before the layout
    releases them (the RepairKV host tier). Returns ``(state, report)``.
    """
    from jaxkv.policies import layouts

    valid = np.asarray(feats.valid())
    live_pos = np.asarray(feats.positions_N)[valid]
    keep_mask, scores, state = score_and_select(policy, cfg, state, feats, jnp.asarray(forced_N, bool), jnp.int32(budget))
    kept = live_pos[np.asarray(keep_mask)[valid]]
    slots = engine.row_state[row].slots
    if layout == "dead_slot":
        plan = layouts.dead_slot(slots, kept)
    elif layout == "compact":
        plan = layouts.compact(slots, kept, engine.allocate(kept.size))
    else:
        raise ValueError(f"unknown layout {layout!r}; known: {', '.join(layouts.LAYOUTS)}")
    live_scores = np.asarray(scores, np.float32)[valid]
    evicted_scores = live_scores[np.searchsorted(live_pos, plan.evicted_positions)]
    if on_evict is not None and plan.evicted_positions.size:
        k_LMKD, v_LMKD = engine.gather_rows(plan.evicted_slots)
        on_evict(plan, k_LMKD, v_LMKD, evicted_scores)
    engine.apply_layout(row, plan)
    return state, CompressionReport(int(live_pos.size), int(kept.size), kept, plan, evicted_scores)
