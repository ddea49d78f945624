"""Split-K (flash-decoding) decode attention: the partials layout, the merge, and
the Pallas skeleton that TPU (Mosaic) and interpret mode run.

**Partials** (shared with the Triton kernels of ``jaxkv.kernels.triton``): a request's
entries (tokens, or INT2 pages of 32 tokens) are listed in ``idx_BN`` with a length
``len_B`` and cut into ``P`` splits of ``split`` entries. Each split leaves its
unnormalised accumulator ``acc [B, P, Hq, D]``, running max ``m [B, P, Hq]`` and
running sum ``l [B, P, Hq]`` (float32); ``merge`` combines the splits of one or
several parts (INT2 pages and INT4 tokens of one request) by log-sum-exp. A split
with no valid entry leaves ``m = MASKED``, ``l = 0``, ``acc = 0`` and weighs
nothing; a request with no entry at all gets a zero output.

**Pallas skeleton**: grid ``(B, P)``; program ``(b, s)`` reads entries
``[s*split, (s+1)*split)`` of request ``b`` for every KV head (the GQA group of a
head, ``G`` query rows, is processed together, so each K/V byte is read once).
Per step of ``reader.block`` entries it copies the entry ids into SMEM, starts one
DMA per (entry, operand) that gathers the entry's rows of *all* heads from HBM into
a VMEM buffer ``[K, block, ...]``, waits for all of them with one wait per operand,
then runs one online-softmax step per head. Mosaic has no vector-indexed HBM
loads, so the gather is explicit DMA; interpret mode (``pltpu.InterpretParams``)
simulates the same DMAs, semaphores and memory spaces, so the CPU tests run the
kernel that TPU compiles.

What is read is a *reader*: it turns the gathered buffers of head ``k`` into score
chunks ``q . k`` (``[G, T]`` float32, unscaled) and probabilities back into value
contributions, one per output channel chunk. The float, INT4 and INT2 kernels are
this one skeleton with different readers, so the softmax, masking and merge
exist once.

TPU layout rules (Mosaic wants the last two block dims divisible by (8, 128) or
equal to the array's): queries are blocked ``[K, G, D]``, ``acc`` ``[K, G, D]`` and
the running max and sum are written lane-dense, broadcast over 128 lanes
(``[K, G, 128]``); the wrapper keeps lane 0.

Invariants:
* Entries at or past ``len_B`` are never attended: their ids are replaced by 0
  (the sentinel slot, which the engine keeps finite) and their scores masked; a
  reader with ``block == 1`` only ever sees valid entries.
* Scores are scaled by ``1/sqrt(D)`` after the dot, in float32.
* Every output block is written, including empty splits (interpret mode fills
  outputs with NaN before the kernel runs, so a missed block would show).

Cost model: one DMA per (entry, operand) of ``K * row`` bytes; the split partials
add ``B * P * Hq * (D + 2 * 128) * 4`` bytes written and read once by the merge.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Protocol, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxkv.kernels._options import pallas_options

MASKED = -1e30
LANES = 128  # lane width of a TPU vector register: running stats are stored lane-dense
PALLAS_SPLITS = 4  # splits per request on TPU / interpret: a TPU grid runs in order, a few splits test the merge
GPU_TARGET_PROGRAMS = 1024  # programs per GPU launch (B * Hkv * P): eight per SM of an H100


class Partials(NamedTuple):
    """Per-split softmax state of one part (float32).

    Attributes:
      acc: ``[B, P, Hq, D]`` unnormalised ``sum_t exp(s_t - m) v_t``.
      m: ``[B, P, Hq]`` running max of the scaled scores (``MASKED`` if the split is empty).
      l: ``[B, P, Hq]`` running ``sum_t exp(s_t - m)``.
    """

    acc: jnp.ndarray
    m: jnp.ndarray
    l: jnp.ndarray


def num_splits(items: int, block: int, per_row: int) -> int:
    """Splits per request: ``per_row`` at most, never more than there are blocks."""
    return max(1, min(per_row, math.ceil(items / block)))


def gpu_splits(batch: int, kv_heads: int, items: int, block: int) -> int:
    """Splits per request of a GPU launch: enough programs to fill the GPU."""
    return num_splits(items, block, math.ceil(GPU_TARGET_PROGRAMS / (batch * kv_heads)))


def split_size(items: int, splits: int, block: int) -> int:
    """Entries per split, a multiple of ``block`` (``splits * size >= items``)."""
    return math.ceil(math.ceil(items / splits) / block) * block


def merge(parts: Sequence[Partials], dtype) -> jnp.ndarray:
    """Log-sum-exp merge of the splits of every part -> ``out [B, Hq, D]`` in ``dtype``."""
    acc = jnp.concatenate([p.acc for p in parts], axis=1)
    m = jnp.concatenate([p.m for p in parts], axis=1)
    l = jnp.concatenate([p.l for p in parts], axis=1)
    w = jnp.exp(m - jnp.max(m, axis=1, keepdims=True))  # [B, P, Hq]
    total = jnp.sum(l * w, axis=1)
    out = jnp.sum(acc * w[..., None], axis=1) / jnp.where(total > 0, total, 1.0)[..., None]
    return out.astype(dtype)


def dot_nt(a, b):
    """``a[M, C] @ b[T, C].T`` with float32 accumulation."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot_nn(a, b):
    """``a[M, T] @ b[T, C]`` with float32 accumulation."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


class Reader(Protocol):
    """How one kind of entry is read (see the module docstring).

    ``bufs[r]`` is the VMEM buffer of operand ``r``: ``[K, block, *row]`` where
    ``operand[entry]`` is ``[K, *row]``.

    Attributes:
      block: entries per step (``1`` for INT2 pages of 32 tokens).
      out_chunks: ``(channel, width)`` of each value contribution, in order.
    """

    block: int
    out_chunks: Sequence[tuple[int, int]]

    def scores(self, q_GD, bufs, k: int) -> list: ...

    def values(self, bufs, k: int, probs: list) -> list: ...


def _kernel(len_ref, idx_hbm, q_ref, *rest, reader: Reader, num_operands: int, split: int, scale: float):
    operands = rest[:num_operands]
    acc_ref, m_ref, l_ref = rest[num_operands : num_operands + 3]
    ids_smem, sems, *bufs = rest[num_operands + 3 :]
    b, s = pl.program_id(0), pl.program_id(1)
    K, G = q_ref.shape[0], q_ref.shape[1]
    block = reader.block
    start = s * split
    stop = jnp.minimum(start + split, len_ref[b])
    num_blocks = (jnp.maximum(stop - start, 0) + block - 1) // block

    def gather(first):
        pltpu.sync_copy(idx_hbm.at[b, pl.ds(first, block)], ids_smem)

        def start_row(j, carry):
            entry = jnp.where(first + j < stop, ids_smem[j], 0)
            for r, (src, buf) in enumerate(zip(operands, bufs)):
                pltpu.make_async_copy(src.at[entry], buf.at[:, j], sems.at[r]).start()
            return carry

        jax.lax.fori_loop(0, block, start_row, 0)
        for r, buf in enumerate(bufs):  # one wait per operand covers the bytes of all its rows
            pltpu.make_async_copy(buf, buf, sems.at[r]).wait()

    def body(j, carry):
        first = start + j * block
        gather(first)
        valid = first + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1) < stop
        new = []
        for k in range(K):
            m, l, accs = carry[k]
            chunks = [c * scale for c in reader.scores(q_ref[k], bufs, k)]
            if block > 1:
                chunks = [jnp.where(valid, c, MASKED) for c in chunks]
            m_new = functools.reduce(jnp.maximum, [jnp.max(c, axis=1, keepdims=True) for c in chunks], m)
            alpha = jnp.exp(m - m_new)
            probs = [jnp.exp(c - m_new) for c in chunks]
            l_new = alpha * l + sum(jnp.sum(p, axis=1, keepdims=True) for p in probs)
            contribs = reader.values(bufs, k, probs)
            new.append((m_new, l_new, tuple(a * alpha + c for a, c in zip(accs, contribs))))
        return tuple(new)

    init = tuple(
        (
            jnp.full((G, 1), MASKED, jnp.float32),
            jnp.zeros((G, 1), jnp.float32),
            tuple(jnp.zeros((G, w), jnp.float32) for _, w in reader.out_chunks),
        )
        for _ in range(K)
    )
    final = jax.lax.fori_loop(0, num_blocks, body, init)
    for k, (m, l, accs) in enumerate(final):
        for (channel, width), a in zip(reader.out_chunks, accs):
            acc_ref[k, :, pl.ds(channel, width)] = a
        m_ref[k] = jnp.broadcast_to(m, (G, LANES))
        l_ref[k] = jnp.broadcast_to(l, (G, LANES))


def split_k(q_BHD, reader: Reader, operands, idx_BN, len_B, *, interpret: bool) -> Partials:
    """Run ``reader`` over every request's entries with the Pallas skeleton.

    Args:
      q_BHD: ``[B, Hq, D]`` queries.
      reader: the entry reader; ``operands`` its arrays, each ``[entries, K, ...]``.
      idx_BN, len_B: entry ids and counts per request.
      interpret: run under the TPU interpreter instead of compiling with Mosaic.
    """
    B, Hq, D = q_BHD.shape
    K = operands[0].shape[1]
    G = Hq // K
    N = idx_BN.shape[1]
    P = num_splits(N, reader.block, PALLAS_SPLITS)
    split = split_size(N, P, reader.block)
    idx_BN = jnp.pad(idx_BN.astype(jnp.int32), ((0, 0), (0, P * split - N)))
    kernel = functools.partial(_kernel, reader=reader, num_operands=len(operands), split=split, scale=1.0 / math.sqrt(D))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    per_program = lambda *shape: pl.BlockSpec((None, None) + shape, lambda b, s, lens: (b, s) + (0,) * len(shape))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(B, P),
        in_specs=[hbm, pl.BlockSpec((None, K, G, D), lambda b, s, lens: (b, 0, 0, 0))] + [hbm] * len(operands),
        out_specs=[per_program(K, G, D), per_program(K, G, LANES), per_program(K, G, LANES)],
        scratch_shapes=[pltpu.SMEM((reader.block,), jnp.int32), pltpu.SemaphoreType.DMA((len(operands),))]
        + [pltpu.VMEM((K, reader.block) + a.shape[2:], a.dtype) for a in operands],
    )
    f32 = jnp.float32
    acc, m, l = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((B, P, K, G, D), f32),
            jax.ShapeDtypeStruct((B, P, K, G, LANES), f32),
            jax.ShapeDtypeStruct((B, P, K, G, LANES), f32),
        ],
        name=f"decode_{type(reader).__name__.lower()}",
        **pallas_options(interpret),
    )(len_B.astype(jnp.int32), idx_BN, q_BHD.reshape(B, K, G, D), *operands)
    return Partials(acc.reshape(B, P, Hq, D), m[..., 0].reshape(B, P, Hq), l[..., 0].reshape(B, P, Hq))
