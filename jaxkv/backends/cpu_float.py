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
products are plain batched GEMMs over the copy in place; stored flat (``_flat``), so
that XLA keeps every copy of it in that one layout. A quantized pool's window is
this one too, its entries dequantized (``jaxkv.backends.cpu_quant``). A blocked layout (blocks
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
from jaxkv.kernels.quant import dequantize_rows, quantize_rows


@struct.dataclass
class DecodeWindow:
    """The CPU decode loop's copy of its rows' lists (``take_window``), per layer
    (tuples of ``L`` arrays, so the unrolled loop updates each in place), in two
    parts: the entries the rows held before the call (keys ``[R, K, D, W]``, values
    ``[R, K, W, D]``, held flat as ``[R, K, D * W]`` and ``[R, K, W * D]``: ``_flat``;
    the first ``len_LR[i]`` real, read-only in the loop), and the
    entries the call's steps write (``[R, S, K, D]``, row ``r``'s step at index
    ``kv_len - 1 - len_LR[i, r]``). List entry ``len_LR + s`` is new entry ``s``,
    so the two parts together are the row's list (each layer's own,
    ``RowTables.layer_list``)."""

    k: tuple
    v: tuple
    len_LR: jax.Array
    k_new: tuple
    v_new: tuple
    new_bits: int = struct.field(pytree_node=False, default=0)

    def append(self, i: int, k_RKD, v_RKD, kv_len_R, active_R) -> DecodeWindow:
        """Layer ``i`` with each active row's new entry (its ``kv_len - 1``) written:
        as computed, or with ``new_bits`` as the pool stores it and reads it back
        (a quantized pool's decode tokens: INT4 rows, ``jaxkv.kernels.quant``)."""
        R, S = self.k_new[i].shape[:2]
        at = jnp.where(active_R, kv_len_R - 1 - self.len_LR[i], S)  # out of range: dropped
        rows = jnp.arange(R)
        stored = (lambda x: dequantize_rows(quantize_rows(x, self.new_bits))) if self.new_bits else (lambda x: x)
        put = lambda parts, x: parts[:i] + (parts[i].at[rows, at].set(stored(x).astype(parts[i].dtype), mode="drop"),) + parts[i + 1 :]
        return self.replace(k_new=put(self.k_new, k_RKD), v_new=put(self.v_new, v_RKD))

    def roll(self, len_LR) -> DecodeWindow:
        """This window after its call as the start of the next call over the same
        rows: each row's new entries ``s`` with ``len + s < len_LR`` written into the
        first part at list entry ``len + s``, and ``len_LR`` the entries that part now
        holds: the rows' list lengths now (after the call, or fewer where a row was
        truncated since; never more than ``len + fed``), ``-1`` to keep a row as it is
        (padding rows). A window fresh from ``take_window``, given its own lengths,
        is unchanged. Run at the start of the decode program, whose window is
        donated, so the copy changes in place and no program is added for it."""
        R, S, _, D = self.k_new[0].shape
        W = self.k[0].shape[-1] // D
        len_LR = jnp.where(len_LR < 0, self.len_LR, len_LR).astype(self.len_LR.dtype)
        rows = jnp.broadcast_to(jnp.arange(R)[:, None], (R, S))
        ks, vs = [], []
        for i in range(len(self.k)):
            entry = self.len_LR[i][:, None] + jnp.arange(S)[None, :]  # [R, S]: the list entry new entry s is
            at = jnp.where(entry < len_LR[i][:, None], entry, W)  # out of range: dropped
            k, v = self.keys(i), self.values(i)
            ks.append(_flat(k.at[rows, :, :, at].set(self.k_new[i].astype(k.dtype), mode="drop")))
            vs.append(_flat(v.at[rows, :, at, :].set(self.v_new[i].astype(v.dtype), mode="drop")))
        return self.replace(k=tuple(ks), v=tuple(vs), len_LR=len_LR)

    def keys(self, i: int):
        """Layer ``i``'s first part's keys ``[R, K, D, W]``."""
        R, K, DW = self.k[i].shape
        D = self.k_new[i].shape[-1]
        return self.k[i].reshape(R, K, D, DW // D)

    def values(self, i: int):
        """Layer ``i``'s first part's values ``[R, K, W, D]``."""
        R, K, WD = self.v[i].shape
        D = self.v_new[i].shape[-1]
        return self.v[i].reshape(R, K, WD // D, D)

    def attend(self, i: int, q_RHD, kv_len_R, active_R):
        """Layer ``i``'s attention of one query per row over the window."""
        old = self.len_LR[i]
        return window_decode_attention(q_RHD, self.keys(i), self.values(i), old, self.k_new[i], self.v_new[i], kv_len_R - old, active_R)


def _flat(x_RKAB):
    """``[R, K, A, B]`` as ``[R, K, A * B]``, the window's stored form: a reshape is a
    no-op only over row-major memory, so XLA keeps every copy of a window in the
    one layout, the layout the entry's donated window and the loop read. (Held
    4-D, a window copied from a quantized pool left its transposes to layout
    assignment, which laid the copy out as the gather had it; the kept window was
    then transposed into that layout and back on every call: 0.7 s a call at
    8,000 tokens on SmolLM2.)"""
    return x_RKAB.reshape(*x_RKAB.shape[:2], -1)


def take_window(cache, rows_R, *, width: int, n_steps: int) -> DecodeWindow:
    """The CPU decode loop's copy of each row's list entries ``[0, width)``, every
    layer, head-major, and room for ``n_steps`` new entries (``DecodeWindow``);
    traced at the start of the decode program, before its loop writes the donated
    pool (the compiled program reads the pool in place: no copy of it,
    ``tests/test_engine.py``)."""
    read = lambda i, slots: (cache.k[i][slots], cache.v[i][slots])
    return window_of_lists(cache, rows_R, read, num_layers=cache.k.shape[0], width=width, n_steps=n_steps)


def window_of_lists(cache, rows_R, read, *, num_layers: int, width: int, n_steps: int, new_bits: int = 0) -> DecodeWindow:
    """``take_window`` over any pool: ``read(i, slots [R, W]) -> (k, v) [R, W, K, D]``
    is how layer ``i``'s entries read (a quantized pool dequantizes them,
    ``jaxkv.backends.cpu_quant``), ``new_bits`` how the call's new entries are
    stored (``DecodeWindow.append``). The rows' tables are the cache's own
    (``take_rows``), so each layer copies its own list."""
    tables = take_rows(cache, rows_R)
    live = tables.live_idx  # [J, R, P]
    live = live[..., :width] if live.shape[-1] >= width else jnp.pad(live, ((0, 0), (0, 0), (0, width - live.shape[-1])))
    of_layer = jnp.minimum(jnp.arange(num_layers), live.shape[0] - 1)
    layer_lists = live[of_layer]  # [L, R, W]: the list each layer reads
    entries = [read(i, layer_lists[i]) for i in range(num_layers)]  # L x ([R, W, K, D], [R, W, K, D])
    k = tuple(_flat(jnp.transpose(ki, (0, 2, 3, 1))) for ki, _ in entries)  # L x [R, K, D * W]
    v = tuple(_flat(jnp.transpose(vi, (0, 2, 1, 3))) for _, vi in entries)  # L x [R, K, W * D]
    R, _, K, D = entries[0][0].shape
    new = tuple(jnp.zeros((R, n_steps, K, D), k[0].dtype) for _ in range(num_layers))
    return DecodeWindow(k, v, tables.live_len[of_layer], new, new, new_bits=new_bits)


@dataclasses.dataclass(frozen=True)
class CpuFloatBackend(AttentionBackend):
    """Blocked attention over a float pool; the decode loop reads a ``DecodeWindow``."""

    name = "cpu-float"
    uses_window = True

    def reader(self, kv, i, lists_RN, k_TKD=None, v_TKD=None, meta=None) -> PoolReader:
        k, v = kv
        return PoolReader(k, v, pad_lists(lists_RN), layer=i)

    def attend_listed(self, kv, i, q_THD, k_TKD, v_TKD, meta: AttentionMetadata):
        return self.attend_blocked(kv, i, q_THD, k_TKD, v_TKD, meta)

    def take_window(self, cache, rows_R, *, width: int, n_steps: int) -> DecodeWindow:
        return take_window(cache, rows_R, width=width, n_steps=n_steps)
