"""The one attention entry of the engine's forward, and how a backend plugs into it.

Every layer of every step (``jaxkv.forward``) writes its new K/V into the pool and
then attends through one call, ``AttentionBackend.attend``. What sits behind that
call depends on the pool's kind and the platform, and is chosen once per engine
(``jaxkv.backends.select_backend``), as sglang-jax's ``AttentionBackend`` and
tpu-inference's attention interface are:

* ``CpuFloatBackend``: the blocked XLA implementation over a float pool
  (``jaxkv.kernels.attention.ragged``), with the CPU decode loop's window as its
  private state;
* ``CpuQuantBackend``: the same blocked implementation over the dual INT2/INT4
  pool, dequantizing one key block at a time, with its own decode window;
* ``FloatKernelBackend``: the ragged paged kernels (Pallas on TPU and in
  interpret mode, Triton on NVIDIA GPUs) over a float pool;
* ``QuantKernelBackend``: the fused quantized decode kernels over the dual pool
  (its steps with several tokens per row run the blocked reader);
* ``ReferenceBackend``: the dense masked softmax over the whole pool, the oracle.

A backend has two halves. The *device half* is the backend object itself: a
frozen, hashable dataclass (a static argument of the jit'd programs) whose methods
run inside ``jax.jit``; it holds no arrays. The *host half* is ``DecodeState``:
what a backend keeps between decode calls (the CPU backends' windows), made and
kept by ``jaxkv.engine.runner.ModelRunner`` (its ``kept``; ``_window`` hands it to the
next decode call over the same rows).

``AttentionMetadata`` is the one pytree every backend reads: the rows' tables
after the step's tokens were appended, where each flat token lives, and the
pool's write and read plans. Segment reuse's spliced step attends through the
same entry with metadata that lists its keys with explicit positions instead of
tables (``AttentionMetadata.positional``, ``attend_positional``).

Attention mass (H2O's feature: the probability every list entry receives) is a
second pass of the blocked implementation over the same key blocks; every
backend computes it through its blocked reader (``attend_with_mass``), so a
kernel backend needs no mass variant of its kernel.

A rotated quantized pool (``Engine(kv_rotate=True)``, ``jaxkv.cache.rotation``)
stores ``K·R`` and ``V·R``; the forward moves each layer's q, k, v into that frame
once (``rotate_in``) and the output back (``rotate_out``), so backends are
frame-blind: ``(qR)(kR)ᵀ = qkᵀ`` and the output's ``R`` cancels.

Invariants: ``write`` runs before ``attend`` in every layer, so a step's queries
read their own keys as the pool stores them (a quantized pool's prefill pieces
read their own tokens in full precision, ``StepTokens``); a backend never changes
the tables; padding tokens write the sentinel slot and read nothing.

Shape letters: T flat tokens, R step rows, N list entries, Hq / K query / KV heads,
D head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.attention import positional_attention
from jaxkv.cache.state import RowTables
from jaxkv.kernels.attention.ragged import decode_section_attention, ragged_attention_blocked


@struct.dataclass
class AttentionMetadata:
    """What one step's attention reads, for every layer.

    Attributes:
      tables: the step rows' tables with the step's tokens appended
        (``RowTables``; ``tables.layer_list(i)`` is layer ``i``'s list and length).
      slots_T: ``[T]`` the pool slot each flat token is written to (padding: the sentinel).
      q_start_R, q_len_R: ``[R]`` row ``r`` owns flat tokens ``[q_start, q_start + q_len)``.
      write_plan: the pool's write plan of the step (a quantized pool's INT2 pages; None).
      read_plan: a decode call's reading plan by kind (a quantized pool's
        ``DecodeParts``; None: read through the live lists).
      decode: every row holds one token and row ``r`` is flat token ``r`` (the decode loop).
      q_pos_T, key_slots_N, key_pos_JN: explicit key positions instead of tables
        (segment reuse's spliced step, ``jaxkv.splice``): flat token ``t`` at
        position ``q_pos_T[t]`` reads the keys in slots ``key_slots_N`` whose
        position, as layer ``i`` sees them (row ``min(i, J - 1)`` of
        ``key_pos_JN``), is at most its own. None elsewhere.
    """

    tables: RowTables
    slots_T: jax.Array
    q_start_R: jax.Array
    q_len_R: jax.Array
    write_plan: Any = None
    read_plan: Any = None
    decode: bool = struct.field(pytree_node=False, default=False)
    q_pos_T: Any = None
    key_slots_N: Any = None
    key_pos_JN: Any = None

    @classmethod
    def positional(cls, slots_T, q_pos_T=None, key_slots_N=None, key_pos_JN=None) -> "AttentionMetadata":
        """Metadata of a step whose tokens read keys by explicit position (no tables):
        ``slots_T`` where they are written; the reading fields as in the class doc
        (None: the metadata only writes)."""
        return cls(None, slots_T, None, None, q_pos_T=q_pos_T, key_slots_N=key_slots_N, key_pos_JN=key_pos_JN)

    def layer_list(self, i):
        """``(live_RN, kv_len_R)`` of layer ``i`` (static or traced)."""
        return self.tables.layer_list(i)

    @property
    def active_R(self):
        return self.q_len_R > 0


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """The device half every backend shares (module docstring).

    Attributes:
      layers: the pool's device layers (``jaxkv.cache.pools.FloatLayers`` or
        ``jaxkv.cache.quantized.QuantLayers``): how one layer is written and read.

    Class attributes: ``name``; ``uses_window``: the decode loop may read a copy
    of its rows' entries (the CPU backends: ``take_window`` traced at the start of
    the decode program, ``window_entries`` on the host, the copy read by
    ``DecodeWindow.attend`` and kept for the next call over the same rows).
    """

    layers: Any
    name = "backend"
    uses_window = False

    def rotate_in(self, i, q_THD, k_TKD, v_TKD):
        """The step's queries, keys and values of layer ``i`` in the pool's stored
        frame (``jaxkv.cache.rotation``): a rotated pool's ``R`` of each KV head
        applied to its keys and values and to the queries of its GQA group; the
        identity for an unrotated pool. The engine's forward calls it once per layer
        before ``write`` and ``attend``, so every backend, the window and the kernels
        alike, reads and writes one frame and none of them knows about rotation."""
        rot = self.layers.rotation
        if rot is None:
            return q_THD, k_TKD, v_TKD
        K = k_TKD.shape[-2]
        return rot.rotate_heads(i, q_THD, K), rot.rotate(i, k_TKD), rot.rotate(i, v_TKD)

    def rotate_out(self, i, o_THD, num_kv_heads: int):
        """Attention output of layer ``i`` back to the model's frame (``rotate_in``'s inverse)."""
        rot = self.layers.rotation
        return o_THD if rot is None else rot.unrotate_heads(i, o_THD, num_kv_heads)

    def write(self, kv, i, k_TKD, v_TKD, meta: AttentionMetadata):
        """Store the step's keys and values of layer ``i`` at ``meta.slots_T``."""
        return self.layers.write(kv, i, k_TKD, v_TKD, meta.slots_T, meta.write_plan)

    def attend(self, kv, i, q_THD, k_TKD, v_TKD, meta: AttentionMetadata, loop_state=None):
        """The attention entry: layer ``i``'s attention (its K/V already written).
        Returns ``(o_THD, loop_state)``: ``loop_state`` is the decode loop's private
        state (a window), None elsewhere. Metadata with explicit key positions is
        read by position (``attend_positional``); the decode loop of a backend with
        a window reads that (its new entry written first); any other step reads
        through the rows' lists (``attend_listed``, what each backend implements)."""
        if meta.key_pos_JN is not None:
            return self.attend_positional(kv, i, q_THD, meta), loop_state
        if loop_state is not None:
            _, kv_len = meta.layer_list(i)
            window = loop_state.append(i, k_TKD, v_TKD, kv_len, meta.active_R)
            return window.attend(i, q_THD, kv_len, meta.active_R).astype(q_THD.dtype), window
        return self.attend_listed(kv, i, q_THD, k_TKD, v_TKD, meta), None

    def attend_listed(self, kv, i, q_THD, k_TKD, v_TKD, meta: AttentionMetadata):
        """Layer ``i``'s attention through the rows' live lists (``meta.tables``):
        ``o_THD``."""
        raise NotImplementedError

    def window_entries(self, states) -> int:
        """Entries a decode window must hold for these rows (``RequestState``): the
        longest list."""
        return max(len(s.live) for s in states)

    def attend_positional(self, kv, i, q_THD, meta: AttentionMetadata):
        """Layer ``i``'s attention by explicit key positions: the keys of
        ``meta.key_slots_N`` read back in float through the pool's layer read, each
        query over those at or before its position (``positional_attention``). Every
        pool kind and platform shares this one implementation; a backend may
        override it with a kernel."""
        k_NKD, v_NKD = self.layers.read(kv, i, meta.key_slots_N)
        key_pos_N = meta.key_pos_JN[jnp.minimum(i, meta.key_pos_JN.shape[0] - 1)]
        return positional_attention(q_THD, meta.q_pos_T, k_NKD, v_NKD, key_pos_N)

    def reader(self, kv, i, lists_RN, k_TKD=None, v_TKD=None, meta: AttentionMetadata | None = None):
        """Layer ``i``'s key-block reader for the blocked implementation."""
        raise NotImplementedError

    def attend_blocked(self, kv, i, q_THD, k_TKD, v_TKD, meta: AttentionMetadata):
        """The blocked implementation through this backend's reader."""
        lists, kv_len = meta.layer_list(i)
        reader = self.reader(kv, i, lists, k_TKD, v_TKD, meta)
        if meta.decode:  # one token per row, rows in order: the decode section alone
            return decode_section_attention(reader, q_THD, kv_len, meta.active_R).astype(q_THD.dtype)
        return ragged_attention_blocked(q_THD, reader, kv_len, meta.q_start_R, meta.q_len_R, width=reader.live_RN.shape[1])

    def attend_with_mass(self, kv, i, q_THD, k_TKD, v_TKD, meta: AttentionMetadata):
        """``(o_THD, mass_RN)``: the attention and the probability each list entry
        received, summed over the step's queries and query heads (the blocked
        implementation's second pass, whatever the backend)."""
        lists, kv_len = meta.layer_list(i)
        reader = self.reader(kv, i, lists, k_TKD, v_TKD, meta)
        return ragged_attention_blocked(
            q_THD, reader, kv_len, meta.q_start_R, meta.q_len_R, return_mass=True, width=reader.live_RN.shape[1]
        )


@dataclasses.dataclass
class DecodeState:
    """The host half's kept state between decode calls (``ModelRunner``).

    Attributes:
      loop_state: what the next decode call's loop starts from (a window), or None.
      key: what it was made for (rows, steps, width): a call over other rows with
        the same steps and width hands it in as the buffer its fresh window replaces.
      writes: the KV manager's write count when it was kept; any later write of the
        cache but a truncation makes it stale.
      len_JB: list lengths per live list and call row at the call's start (host);
      fed_B: the entries the call wrote per row.
    """

    loop_state: Any
    key: tuple
    writes: int
    len_JB: Any
    fed_B: Any
