"""The CPU's attention over a float pool: the blocked XLA implementation, and the
decode loop's window as the backend's private state.

Steps (prefill pieces beside decode tokens) read the pool through the rows' live
lists in key blocks (``PoolReader``, ``jaxkv.kernels.attention.ragged``). The
multi-step decode loop instead reads a per-call, head-major copy of its rows'
lists (``DecodeWindow``): every step's one query per row then runs two plain
batched GEMMs over contiguous memory, several times faster on the CPU than
gathering key blocks by slot id every step (``eval/bench/decode.py`` prints
both). ``take_window`` takes the copy at the start of the decode program (no
program of its own); the loop writes each step's new entry into the window's
second part and attends over both parts with one softmax. The runner keeps a
call's window for the next call over the same rows (``DecodeWindow.roll`` folds
the last call's new entries into its first part), so a long generation copies its
rows' lists once; a call over other rows hands the kept window in as the buffer a
fresh copy replaces (``lax.cond``: one program per rows x width either way).

Layout: keys ``[R, K, D, W]`` and values ``[R, K, W, D]`` per layer, so both
products are plain batched GEMMs over the copy in place. A blocked layout (blocks
``[nb, R, K, D, E]`` on the leading axis, walked by a ``fori_loop`` up to the
longest row, so that a step's cost would follow the live length rather than the
width) ran 18% slower per step inside the decode loop (SmolLM2 shapes, 8 rows x
4,096 entries x 30 layers, 8 steps: 0.84 s against 0.72 s), and was not kept.

Invariants: the window never changes the pool; its first part holds each row's list
entries ``[0, len_LR[i, r])`` of each layer's own list, exactly as the pool holds
them, and the new part holds exactly what the call's steps write to the pool, so
reading the window equals reading the pool
(``tests/test_engine.py::test_decode_window_equals_per_step_gather``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.backends.base import AttentionBackend, AttentionMetadata
from jaxkv.cache.state import take_rows
from jaxkv.kernels.attention.ragged import PoolReader, pad_lists, window_decode_attention


@struct.dataclass
class DecodeWindow:
    """The CPU decode loop's copy of its rows' lists (``take_window``), per layer
    (tuples of ``L`` arrays, so the unrolled loop updates each in place), in two
    parts: the entries the rows held before the call (keys ``[R, K, D, W]``, values
    ``[R, K, W, D]``, the first ``len_LR[i]`` real, read-only in the loop), and the
    entries the call's steps write (``[R, S, K, D]``, row ``r``'s step at index
    ``kv_len - 1 - len_LR[i, r]``). List entry ``len_LR + s`` is new entry ``s``,
    so the two parts together are the row's list (each layer's own,
    ``RowTables.layer_list``)."""

    k: tuple
    v: tuple
    len_LR: jax.Array
    k_new: tuple
    v_new: tuple

    def append(self, i: int, k_RKD, v_RKD, kv_len_R, active_R) -> "DecodeWindow":
        """Layer ``i`` with each active row's new entry (its ``kv_len - 1``) written."""
        R, S = self.k_new[i].shape[:2]
        at = jnp.where(active_R, kv_len_R - 1 - self.len_LR[i], S)  # out of range: dropped
        rows = jnp.arange(R)
        put = lambda parts, x: parts[:i] + (parts[i].at[rows, at].set(x.astype(parts[i].dtype), mode="drop"),) + parts[i + 1 :]  # noqa: E731
        return self.replace(k_new=put(self.k_new, k_RKD), v_new=put(self.v_new, v_RKD))

    def roll(self, len_LR) -> "DecodeWindow":
        """This window after its call as the start of the next call over the same
        rows: each row's new entries ``s`` with ``len + s < len_LR`` written into the
        first part at list entry ``len + s``, and ``len_LR`` the entries that part now
        holds: the rows' list lengths now (after the call, or fewer where a row was
        truncated since; never more than ``len + fed``), ``-1`` to keep a row as it is
        (padding rows). A window fresh from ``take_window``, given its own lengths,
        is unchanged. Run at the start of the decode program, whose window is
        donated, so the copy changes in place and no program is added for it."""
        R, _, _, W = self.k[0].shape
        S = self.k_new[0].shape[1]
        len_LR = jnp.where(len_LR < 0, self.len_LR, len_LR).astype(self.len_LR.dtype)
        rows = jnp.broadcast_to(jnp.arange(R)[:, None], (R, S))
        ks, vs = [], []
        for i in range(len(self.k)):
            entry = self.len_LR[i][:, None] + jnp.arange(S)[None, :]  # [R, S]: the list entry new entry s is
            at = jnp.where(entry < len_LR[i][:, None], entry, W)  # out of range: dropped
            ks.append(self.k[i].at[rows, :, :, at].set(self.k_new[i].astype(self.k[i].dtype), mode="drop"))
            vs.append(self.v[i].at[rows, :, at, :].set(self.v_new[i].astype(self.v[i].dtype), mode="drop"))
        return self.replace(k=tuple(ks), v=tuple(vs), len_LR=len_LR)

    def attend(self, i: int, q_RHD, kv_len_R, active_R):
        """Layer ``i``'s attention of one query per row over the window."""
        old = self.len_LR[i]
        return window_decode_attention(q_RHD, self.k[i], self.v[i], old, self.k_new[i], self.v_new[i], kv_len_R - old, active_R)


def take_window(cache, rows_R, *, width: int, n_steps: int) -> DecodeWindow:
    """The CPU decode loop's copy of each row's list entries ``[0, width)``, every
    layer, head-major, and room for ``n_steps`` new entries (``DecodeWindow``);
    traced at the start of the decode program, before its loop writes the donated
    pool (the compiled program reads the pool in place: no copy of it,
    ``tests/test_engine.py``)."""
    tables = take_rows(cache, rows_R)
    live = tables.live_idx  # [J, R, P]
    live = live[..., :width] if live.shape[-1] >= width else jnp.pad(live, ((0, 0), (0, 0), (0, width - live.shape[-1])))
    L, J = cache.k.shape[0], live.shape[0]
    of_layer = jnp.minimum(jnp.arange(L), J - 1)
    layer_lists = live[of_layer]  # [L, R, W]: the list each layer reads
    k = tuple(jnp.transpose(cache.k[i][layer_lists[i]], (0, 2, 3, 1)) for i in range(L))  # L x [R, K, D, W]
    v = tuple(jnp.transpose(cache.v[i][layer_lists[i]], (0, 2, 1, 3)) for i in range(L))  # L x [R, K, W, D]
    new = tuple(jnp.zeros((rows_R.shape[0], n_steps, *cache.k.shape[2:]), cache.k.dtype) for _ in range(L))
    return DecodeWindow(k, v, tables.live_len[of_layer], new, new)


@dataclasses.dataclass(frozen=True)
class CpuFloatBackend(AttentionBackend):
    """Blocked attention over a float pool; the decode loop reads a ``DecodeWindow``."""

    name = "cpu-float"
    uses_window = True
    keeps_window = True  # a call's window starts the next call over the same rows (``DecodeWindow.roll``)

    def reader(self, kv, i, lists_RN, k_TKD=None, v_TKD=None, meta=None) -> PoolReader:
        k, v = kv
        return PoolReader(k, v, pad_lists(lists_RN), layer=i)

    def attend_listed(self, kv, i, q_THD, k_TKD, v_TKD, meta: AttentionMetadata, loop_state=None):
        if loop_state is None:
            return self.attend_blocked(kv, i, q_THD, k_TKD, v_TKD, meta), None
        _, kv_len = meta.layer_list(i)
        window = loop_state.append(i, k_TKD, v_TKD, kv_len, meta.active_R)
        return window.attend(i, q_THD, kv_len, meta.active_R).astype(q_THD.dtype), window

    def take_window(self, cache, rows_R, plan, *, width: int, n_steps: int) -> DecodeWindow:
        return take_window(cache, rows_R, width=width, n_steps=n_steps)

    # -- host half ---------------------------------------------------------------------
    def window_entries(self, states, plan) -> int:
        """Entries the window must hold for these rows: the longest list."""
        return max(len(s.live) for s in states)

    def window_fits(self, plan, width: int) -> bool:
        return True
