"""Split-K (flash-decoding) skeleton shared by every decode-attention kernel.

A request's entries (tokens, or INT2 pages of 32 tokens) are listed in an index
list ``idx_BN`` with a length ``len_B``. The grid is ``(B, Hkv, P)``: program
``(b, k, s)`` reads entries ``[s*split, (s+1)*split)`` of request ``b`` for KV head
``k`` and processes all ``G`` query heads of that group together (one ``[G, D]``
query tile, so every K/V byte is loaded once per group). Inside a split, an
online softmax runs over blocks of ``reader.block`` entries; the program writes
its unnormalised accumulator ``acc [G, D]``, running max ``m [G]`` and running
sum ``l [G]`` (float32). ``merge`` combines splits, and several parts (INT2 pages
and INT4 tokens of one request), by log-sum-exp.

What is read is a *reader*: it turns a block of entry ids into score chunks
``q . k`` (``[G, T]`` float32, unscaled) and turns probabilities back into value
contributions, one per output channel chunk. The float, INT4 and INT2 kernels are
this one skeleton with different readers, so the softmax, masking and merge
exist once.

Invariants:
* A split with no valid entry writes ``m = -1e30``, ``l = 0``, ``acc = 0``
  (every output block is written, which the interpret-mode NaN fill checks).
* Entries at or past ``len_B`` are never read: block ids past the end are
  replaced by 0 (the sentinel slot) and their scores masked; a reader with
  ``block == 1`` only ever sees valid entries.
* Scores are scaled by ``1/sqrt(D)`` after the dot, in float32; a request with
  no entries gets a zero output (the reference gives finite garbage there).

Gathers: ids are loaded as a vector and used as an integer index into the whole
pool ref (``k_ref[ids, h, cols]``). In interpret mode this is a gather; the Triton
lowering turns it into a pointer gather (one row pointer per id, coalesced
along ``D``). Mosaic (TPU) does not lower vector-indexed HBM loads; the ``tpu``
backend compiles but is untested and would need a DMA-per-row variant.
"""

from __future__ import annotations

import functools
import math
from typing import Protocol, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxkv.pallas._dispatch import min_rows, pallas_options

MASKED = -1e30


def dot_nt(a, b):
    """``a[M, C] @ b[T, C].T`` with float32 accumulation."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot_nn(a, b):
    """``a[M, T] @ b[T, C]`` with float32 accumulation."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


class Reader(Protocol):
    """How one kind of entry is read (see the module docstring).

    Attributes:
      block: entries per inner step; ``1`` means ``ids`` is a scalar.
      out_chunks: ``(channel, width)`` of each value contribution, in order.
    """

    block: int
    out_chunks: Sequence[tuple[int, int]]

    def scores(self, q_ref, refs, h, ids) -> list: ...

    def values(self, refs, h, ids, probs: list) -> list: ...


def _kernel(len_ref, idx_ref, q_ref, *rest, reader: Reader, split: int, scale: float):
    refs, (acc_ref, m_ref, l_ref) = rest[:-3], rest[-3:]
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    G = q_ref.shape[0]
    block = reader.block
    start = s * split
    stop = jnp.minimum(start + split, len_ref[b])
    num_blocks = (jnp.maximum(stop - start, 0) + block - 1) // block

    def body(j, carry):
        m, l, accs = carry
        first = start + j * block
        if block == 1:
            ids = idx_ref[b, first]
            chunks = [c * scale for c in reader.scores(q_ref, refs, h, ids)]
        else:
            valid = first + jax.lax.broadcasted_iota(jnp.int32, (block,), 0) < stop
            ids = jnp.where(valid, idx_ref[b, pl.ds(first, block)], 0)
            chunks = [jnp.where(valid[None, :], c * scale, MASKED) for c in reader.scores(q_ref, refs, h, ids)]
        m_new = functools.reduce(jnp.maximum, [jnp.max(c, axis=1) for c in chunks], m)
        alpha = jnp.exp(m - m_new)
        probs = [jnp.exp(c - m_new[:, None]) for c in chunks]
        l_new = alpha * l + sum(jnp.sum(p, axis=1) for p in probs)
        contribs = reader.values(refs, h, ids, probs)
        accs = tuple(a * alpha[:, None] + c for a, c in zip(accs, contribs))
        return m_new, l_new, accs

    init = (
        jnp.full((G,), MASKED, jnp.float32),
        jnp.zeros((G,), jnp.float32),
        tuple(jnp.zeros((G, w), jnp.float32) for _, w in reader.out_chunks),
    )
    m, l, accs = jax.lax.fori_loop(0, num_blocks, body, init)
    for (channel, width), a in zip(reader.out_chunks, accs):
        acc_ref[:, pl.ds(channel, width)] = a
    m_ref[...] = m
    l_ref[...] = l


def num_splits(batch: int, kv_heads: int, items: int, block: int, backend: str) -> int:
    """Splits per (request, head): enough programs to fill a GPU, none empty by design."""
    # Interpret mode runs programs one after another: a few splits test the merge.
    per_row = 4 if backend == "interpret" else math.ceil(1024 / (batch * kv_heads))
    return max(1, min(per_row, math.ceil(items / block)))


def split_k(q_BKGD, reader: Reader, refs, idx_BN, len_B, *, backend: str):
    """Run ``reader`` over every request's entries; per-split ``(acc, m, l)``.

    Returns ``acc [B, K, P, G, D]``, ``m [B, K, P, G]``, ``l [B, K, P, G]`` float32.
    """
    B, K, G, D = q_BKGD.shape
    N = idx_BN.shape[1]
    P = num_splits(B, K, N, reader.block, backend)
    split = math.ceil(math.ceil(N / P) / reader.block) * reader.block
    idx_BN = jnp.pad(idx_BN.astype(jnp.int32), ((0, 0), (0, P * split - N)))
    kernel = functools.partial(_kernel, reader=reader, split=split, scale=1.0 / math.sqrt(D))
    whole = pl.BlockSpec(memory_space=pl.ANY) if backend == "tpu" else pl.no_block_spec
    f32 = jnp.float32
    return pl.pallas_call(
        kernel,
        grid=(B, K, P),
        in_specs=[whole, whole, pl.BlockSpec((None, None, G, D), lambda b, k, s: (b, k, 0, 0))]
        + [whole] * len(refs),
        out_specs=[
            pl.BlockSpec((None, None, None, G, D), lambda b, k, s: (b, k, s, 0, 0)),
            pl.BlockSpec((None, None, None, G), lambda b, k, s: (b, k, s, 0)),
            pl.BlockSpec((None, None, None, G), lambda b, k, s: (b, k, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, K, P, G, D), f32),
            jax.ShapeDtypeStruct((B, K, P, G), f32),
            jax.ShapeDtypeStruct((B, K, P, G), f32),
        ],
        name=f"decode_{type(reader).__name__.lower()}",
        **pallas_options(backend),
    )(len_B.astype(jnp.int32), idx_BN, q_BKGD, *refs)


def group_queries(q_BHD, kv_heads: int, backend: str):
    """``q [B, Hq, D]`` -> ``[B, K, Gp, D]``, G padded with zeros to what the backend lowers."""
    B, Hq, D = q_BHD.shape
    G = Hq // kv_heads
    Gp = max(G, min_rows(backend))
    if backend == "gpu":
        Gp = pl.next_power_of_2(Gp)
    q = q_BHD.reshape(B, kv_heads, G, D)
    return jnp.pad(q, ((0, 0), (0, 0), (0, Gp - G), (0, 0)))


def merge(parts, q_BHD):
    """Log-sum-exp merge of ``(acc, m, l)`` parts over splits -> ``out [B, Hq, D]``."""
    acc = jnp.concatenate([p[0] for p in parts], axis=2)
    m = jnp.concatenate([p[1] for p in parts], axis=2)
    l = jnp.concatenate([p[2] for p in parts], axis=2)
    m_max = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_max)  # [B, K, P, Gp]
    total = jnp.sum(l * w, axis=2)
    out = jnp.sum(acc * w[..., None], axis=2) / jnp.where(total > 0, total, 1.0)[..., None]
    B, Hq, D = q_BHD.shape
    G = Hq // out.shape[1]
    return out[:, :, :G].reshape(B, Hq, D).astype(q_BHD.dtype)
