"""Ragged paged attention: one attention for every engine step, flash style.

A step is a flat batch of ``T`` query tokens from up to ``R`` rows. Row ``r`` owns
the flat tokens ``[q_start_R[r], q_start_R[r] + q_len_R[r])`` (``q_len 0``: the
row is not in the step) and reads its own live list ``live_RN[r]``: slot ids in
position order, whose first ``kv_len_R[r]`` entries count. The step's own tokens
were written to the pool and appended to the list before the attention runs, so
query ``j`` of row ``r`` (``0 <= j < q_len``) sees the entries
``[0, kv_len - q_len + j + 1)``: every older live entry and its own chunk up to
itself (causal). A prefill chunk, a decode token and a mixed step are the same
call; lengths are data, so one program serves every mix of lengths that fits the
step's token bucket. Flat tokens no row owns are padding: their output is zero.

``ragged_attention`` dispatches (``jaxkv.kernels._dispatch``): the CPU runs
``ragged_attention_blocked`` below, the GPU the Triton kernel of
``jaxkv.kernels.triton.ragged``, the TPU (and ``"interpret"``) the Pallas kernel of
``jaxkv.kernels.attention.ragged_tpu``; ``"reference"`` is ``jaxkv.attention.
ragged_attention_reference``, the dense masked softmax every backend is tested
against.

The CPU implementation (``ragged_attention_blocked``) is XLA with GEMM-shaped
blocks. Why by hand: XLA:CPU has no fused attention, and a dense softmax over a
row's whole list (today's reference) runs its score passes at memory speed (7% of
the GEMM rate at 512 queries x 8,192 keys). Here the score matrix is never
formed: each query tile walks its row's list in key blocks with an online softmax
(FlashAttention), and the number of key blocks is a loop bound computed at run
time, so the cost follows the live length and no length is a shape.

* **Query tiles.** Rows with two or more queries are cut into tiles of
  ``BIG_TILE`` queries, and what is left into tiles of ``SMALL_TILE`` (a 40-token
  tool result pays for 64 rows of work, not 256). A third, smaller tile size for a
  piece's last few queries was measured and not kept: 16 rows of 33-token pieces
  over 800 entries (SmolLM2, float32) ran their attention 0.96 -> 0.79 s, but the
  third tile loop made the attention's compile 65% longer and a cold ``jaxkv
  serve`` 52.7 -> 60.1 s. A tile belongs to one row; its
  ``G`` query heads per KV head are folded into the GEMM's rows (``[K, G*Bq, D]``),
  so each key block is read once for the ``G`` heads that share it. Key blocks
  every query of the tile fully sees run without a mask; the last few (the
  tile's own diagonal) run masked.
* **The decode section** (``decode_section_attention``): the rows with one query
  run as one batch, every such row at once, block by block up to the longest of
  them. A decode step (one token per row) is this section alone.
* **Readers.** What a key block is made of is the reader's business: the float
  pool gathers rows by slot id (``PoolReader``); a quantized pool gathers packed
  codes and dequantizes the block (``jaxkv.cache.quantized``). A step never
  turns a whole live set into float.
* **The CPU decode loop** reads a per-call head-major copy of its rows' lists
  instead (``window_decode_attention``): one unblocked softmax, both products
  plain batched GEMMs.

Shape letters: T flat tokens, R rows, N list entries, S pool slots, Hq / K query /
KV heads, G = Hq / K, D head dim, E key block entries, Q tile queries.

Invariants: scores and softmax state are float32 whatever the input dtype
(products take the pool's dtype with float32 accumulation, ``product``);
scores are scaled by ``1/sqrt(D)`` (folded into the queries); an entry a query
cannot see gets ``MASKED`` and weighs nothing, and every query sees at least its
own entry, so no valid query's sum is zero. Entries past ``kv_len`` may hold any
slot id in ``[0, S)``: they are read only for masked columns.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from jaxkv.kernels._dispatch import resolve_backend

MASKED = -1e30

# Tile and block sizes of the CPU implementation, measured on the 2-core x86-64 CPU
# (SmolLM2 shapes, 9/3 heads, head dim 64). One tile of 512 queries over 8,192 keys:
# 512 x 512 blocks ran at 143 GFLOP/s, 256 x 512 at 134, 128 x 512 at 115, 64 x 512
# at 92 (the float32 GEMM rate that day: 200 GFLOP/s). Whole prompts of 2,048 and
# 8,192 tokens in 512-token chunks (causal, the diagonal's masked work included):
# 256-query tiles with 256-wide diagonal blocks were the best of the combinations
# tried, 98-114 and 120-136 GFLOP/s (run-to-run spread on this machine: ~15%). A
# query tile is padding for a short piece, so wide tiles serve whole stretches of
# a row and narrow ones the rest.
BIG_TILE = 256
SMALL_TILE = 32
KEY_BLOCK = 512
DIAGONAL_BLOCK = 256  # a tile's diagonal runs in sub-tiles of at most this many queries ...
MIN_DIAGONAL_KEYS = 128  # ... reading key blocks as wide, and at least this wide


def product(eq: str, a, b):
    """``einsum(eq, a, b)`` in ``b``'s dtype with float32 accumulation: ``a`` (float32
    queries or probabilities) is rounded to the keys' or values' dtype first. A
    float32 pool computes exactly what a float32 einsum computes; a bf16 pool's
    products take bf16 operands, which the CPU runs on its bf16 units (AMX) at
    about 5x its float32 rate, where casting every key block to float32 first ran
    the products at float32 speed and added the cast's traffic. Rounding the
    probabilities to bf16 before the value product is FlashAttention's practice."""
    return jnp.einsum(eq, a.astype(b.dtype), b, preferred_element_type=jnp.float32)


@struct.dataclass
class PoolReader:
    """Key blocks gathered from a float pool through the rows' live lists.

    Attributes:
      k, v: ``[S, K, D]`` one layer of a pool, or the whole pool ``[L, S, K, D]``
        read at ``layer`` (any float dtype). Reading the whole pool at a static
        layer keeps XLA from copying the layer out of the donated pool.
      live_RN: ``[R, N]`` int32 slot ids per row, ``N`` a multiple of the key block.
      layer: the layer read, when ``k`` / ``v`` are the whole pool.
    """

    k: jax.Array
    v: jax.Array
    live_RN: jax.Array
    layer: int | None = struct.field(pytree_node=False, default=None)

    @property
    def kv_heads(self) -> int:
        return self.k.shape[-2]

    def row_block(self, r, e0, E: int):
        """Entries ``[e0, e0 + E)`` of row ``r``: keys and values ``[E, K, D]`` in the pool's dtype."""
        idx = lax.dynamic_slice_in_dim(self.live_RN[r], e0, E)
        return self.gather(idx)

    def rows_block(self, e0, E: int):
        """Entries ``[e0, e0 + E)`` of every row: keys and values ``[R, E, K, D]`` in the pool's dtype."""
        return self.gather(lax.dynamic_slice_in_dim(self.live_RN, e0, E, axis=1))

    def gather(self, idx):
        """Keys and values of the slots ``idx`` (any shape), in the pool's dtype (the
        products take them as they are: ``product``): one gather from the whole pool
        at ``(layer, slot)`` (a static or traced layer), never a copy of the layer."""
        if self.layer is None:
            return jnp.take(self.k, idx, axis=0, mode="clip"), jnp.take(self.v, idx, axis=0, mode="clip")
        return self.k.at[self.layer, idx].get(mode="clip"), self.v.at[self.layer, idx].get(mode="clip")


def window_decode_attention(q_RHD, k_RKDW, v_RKWD, old_len_R, k_RSKD, v_RSKD, new_len_R, active_R):
    """One query per row over the CPU decode loop's window (``jaxkv.backends.cpu_float.DecodeWindow``):
    the first ``old_len_R`` entries of a head-major copy of each row's list (keys
    ``[R, K, D, W]``, values ``[R, K, W, D]``, read-only in the loop) and the first
    ``new_len_R`` entries the call's own steps wrote (``[R, S, K, D]``).

    Not blocked: one softmax over both parts' scores (only the scores are
    concatenated, never K/V). With the keys head-major both products are plain
    batched GEMMs that XLA:CPU runs on the copy in place; a key-block loop over
    the same copy slices (and copies) every block and measured 0.5-0.8x the speed
    (``eval/results/bench_engine_cpu.md``). The window is at most a bucket wider
    than the rows' lists (``jaxkv.buckets.window_width``), so the masked tail is
    small. Returns ``[R, Hq, D]`` float32, zero where inactive."""
    R, Hq, D = q_RHD.shape
    K, W, S = k_RKDW.shape[1], k_RKDW.shape[3], k_RSKD.shape[1]
    q = q_RHD.astype(jnp.float32).reshape(R, K, Hq // K, D) * (1.0 / math.sqrt(D))
    old = product("rkgd,rkdw->rkgw", q, k_RKDW)
    new = product("rkgd,rskd->rkgs", q, k_RSKD)
    seen = jnp.concatenate([jnp.arange(W)[None, :] < old_len_R[:, None], jnp.arange(S)[None, :] < new_len_R[:, None]], axis=-1)
    s = jnp.where((seen & active_R[:, None])[:, None, None, :], jnp.concatenate([old, new], axis=-1), MASKED)
    p = jnp.exp(s - s.max(-1, keepdims=True))
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    out = product("rkgw,rkwd->rkgd", p[..., :W], v_RKWD)
    out = out + product("rkgs,rskd->rkgd", p[..., W:], v_RSKD)
    return jnp.where(active_R[:, None, None], out.reshape(R, Hq, D), 0.0)


def _online_step(state, s, v, value_eq: str):
    """Fold one block of scaled, masked scores ``s [..., E]`` and values into the
    running ``(max, sum, acc)``."""
    m, l, acc = state
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    alpha = jnp.exp(m - m_new)
    return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + product(value_eq, p, v)


def _tile_attention(reader, q_QHD, r, n_before, count, Q: int, E: int, mass_RN=None):
    """One query tile of row ``r``: ``Q`` queries (``count`` real), query ``i``
    seeing list entries ``[0, n_before + i + 1)``. Returns ``[Q, Hq, D]`` float32
    and, given ``mass_RN`` (``[R, N]``), that array plus the probability every
    entry of the row received from the tile's real queries, summed over them and
    over the query heads (a second pass over the same blocks, with each query's
    final log-sum-exp).

    The tile reads the key blocks every query sees whole ``E`` entries at a time,
    all ``Q`` queries at once; then its diagonal in sub-tiles of at most
    ``DIAGONAL_BLOCK`` queries, each reading blocks as wide (at least
    ``MIN_DIAGONAL_KEYS``) up to its own last query.
    """
    _, Hq, D = q_QHD.shape
    K = reader.kv_heads
    G = Hq // K
    S = min(DIAGONAL_BLOCK, Q)  # queries per diagonal sub-tile
    F = max(S, MIN_DIAGONAL_KEYS)  # keys per diagonal block (E is a multiple)
    q = jnp.transpose(q_QHD.reshape(Q, K, G, D), (1, 2, 0, 3))  # [K, G, Q, D]
    i_Q = jnp.arange(Q, dtype=jnp.int32)
    sees_Q = jnp.minimum(n_before + 1 + i_Q, n_before + count)  # padding queries: no further than the real ones
    unmasked = (n_before + 1) // E  # wide blocks every query sees whole

    def scores(q_KGXD, sees_X, e0, width: int, masked: bool):
        k_EKD, v_EKD = reader.row_block(r, e0, width)
        s = product("kgxd,ekd->kgxe", q_KGXD, k_EKD)
        if masked:
            e = e0 + jnp.arange(width, dtype=jnp.int32)
            s = jnp.where(e[None, None, None, :] < sees_X[None, None, :, None], s, MASKED)
        return s, v_EKD

    def block(j, state, q_KGXD, sees_X, width: int, masked: bool):
        s, v_EKD = scores(q_KGXD, sees_X, j * width, width, masked)
        return _online_step(state, s, v_EKD, "kgxe,ekd->kgxd")

    state = (jnp.full((K, G, Q), MASKED, jnp.float32), jnp.zeros((K, G, Q), jnp.float32), jnp.zeros((K, G, Q, D), jnp.float32))
    state = lax.fori_loop(0, unmasked, functools.partial(block, q_KGXD=q, sees_X=sees_Q, width=E, masked=False), state)
    start = unmasked * (E // F)  # the first narrow block not yet read
    parts = []
    for sub in range(Q // S):  # the diagonal, sub-tile by sub-tile
        x = slice(sub * S, (sub + 1) * S)
        sub_state = tuple(a[:, :, x] for a in state)
        last = jnp.maximum(jnp.minimum(count, (sub + 1) * S), 1)  # queries of the sub-tile that count
        end = (n_before + last + F - 1) // F
        sub_state = lax.fori_loop(
            start, end, functools.partial(block, q_KGXD=q[:, :, x], sees_X=sees_Q[x], width=F, masked=True), sub_state
        )
        parts.append(sub_state)
    m, l, acc = (jnp.concatenate([p[n] for p in parts], axis=2) for n in range(3))
    l = jnp.maximum(l, 1e-30)
    out = jnp.transpose(acc / l[..., None], (2, 0, 1, 3)).reshape(Q, Hq, D)
    if mass_RN is None:
        return out, None
    lse = m + jnp.log(l)
    real_Q = i_Q < count
    blocks = (n_before + count + E - 1) // E

    def add_mass(j, mass):
        s, _ = scores(q, sees_Q, j * E, E, masked=True)
        p = jnp.where(real_Q[None, None, :, None], jnp.exp(s - lse[..., None]), 0.0)
        row = lax.dynamic_slice(mass, (r, j * E), (1, E))
        return lax.dynamic_update_slice(mass, row + p.sum(axis=(0, 1, 2))[None], (r, j * E))

    return out, lax.fori_loop(0, blocks, add_mass, mass_RN)


def _tiles(q_pad, out, mass, reader, kv_len_R, q_start_R, q_len_R, first_R, n_R, Q: int, E: int):
    """Run ``n_R[r]`` tiles of ``Q`` queries for each row, tile ``t`` of row ``r``
    covering its queries ``first_R[r] + t*Q ...``; writes them into ``out`` (and
    their attention mass into ``mass``, unless None)."""
    ends = jnp.cumsum(n_R)
    total = ends[-1] if n_R.shape[0] else 0

    def one(t, carry):
        out, mass = carry
        r = jnp.minimum(jnp.searchsorted(ends, t, side="right"), n_R.shape[0] - 1).astype(jnp.int32)
        t0 = first_R[r] + (t - (ends[r] - n_R[r])) * Q  # the tile's first query, within the row
        count = jnp.minimum(Q, q_len_R[r] - t0)
        at = q_start_R[r] + t0
        q = lax.dynamic_slice_in_dim(q_pad, at, Q)
        o, mass = _tile_attention(reader, q, r, kv_len_R[r] - q_len_R[r] + t0, count, Q, E, mass)
        keep = (jnp.arange(Q) < count)[:, None, None]
        old = lax.dynamic_slice_in_dim(out, at, Q)
        return lax.dynamic_update_slice_in_dim(out, jnp.where(keep, o, old), at, axis=0), mass

    return lax.fori_loop(0, total, one, (out, mass))


def decode_section_attention(reader, q_RHD, kv_len_R, active_R, E: int = KEY_BLOCK, *, return_mass: bool = False, width: int | None = None):
    """One query per row for every row at once (``active_R`` false: skipped),
    query ``r`` seeing its row's entries ``[0, kv_len_R[r])``, block by block up
    to the longest active row. Returns ``[R, Hq, D]`` float32 (zero where
    inactive) and, with ``return_mass``, ``[R, width]``: the probability each entry
    received, summed over the query heads (a second pass, as ``_tile_attention``)."""
    R, Hq, D = q_RHD.shape
    K = reader.kv_heads
    G = Hq // K
    q = q_RHD.astype(jnp.float32).reshape(R, K, G, D) * (1.0 / math.sqrt(D))
    sees_R = jnp.where(active_R, kv_len_R, 0)
    blocks = (jnp.max(sees_R) + E - 1) // E

    def scores(j):
        k_REKD, v_REKD = reader.rows_block(j * E, E)
        s = product("rkgd,rekd->rkge", q, k_REKD)
        e = j * E + jnp.arange(E, dtype=jnp.int32)
        return jnp.where(e[None, None, None, :] < sees_R[:, None, None, None], s, MASKED), v_REKD

    def block(j, state):
        s, v_REKD = scores(j)
        return _online_step(state, s, v_REKD, "rkge,rekd->rkgd")

    state = (jnp.full((R, K, G), MASKED, jnp.float32), jnp.zeros((R, K, G), jnp.float32), jnp.zeros((R, K, G, D), jnp.float32))
    m, l, acc = lax.fori_loop(0, blocks, block, state)
    l = jnp.maximum(l, 1e-30)
    out = jnp.where(active_R[:, None, None], (acc / l[..., None]).reshape(R, Hq, D), 0.0)
    if not return_mass:
        return out
    lse = m + jnp.log(l)

    def add_mass(j, mass):
        s, _ = scores(j)
        p = jnp.where(active_R[:, None, None, None], jnp.exp(s - lse[..., None]), 0.0).sum(axis=(1, 2))
        return lax.dynamic_update_slice_in_dim(mass, lax.dynamic_slice_in_dim(mass, j * E, E, axis=1) + p, j * E, axis=1)

    mass = lax.fori_loop(0, blocks, add_mass, jnp.zeros((R, width), jnp.float32))
    return out, mass


def ragged_attention_blocked(
    q_THD,
    reader,
    kv_len_R,
    q_start_R,
    q_len_R,
    *,
    return_mass: bool = False,
    width: int | None = None,
    big: int = BIG_TILE,
    small: int = SMALL_TILE,
    block: int = KEY_BLOCK,
):
    """The CPU implementation (module docstring): ``[T, Hq, D]`` in ``q_THD.dtype``
    and, with ``return_mass``, ``[R, width]`` float32: the probability each list
    entry received from the step's queries, summed over queries and query heads.

    ``reader`` gives key blocks (``PoolReader``, a quantized pool's reader); its
    lists must be a multiple of ``block`` entries long (``width`` of them).
    """
    T, Hq, D = q_THD.shape
    R = q_len_R.shape[0]
    q = q_THD.astype(jnp.float32) * (1.0 / math.sqrt(D))
    pad = max(big, small)
    q_pad = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
    out = jnp.zeros((T + pad, Hq, D), jnp.float32)
    mass = jnp.zeros((R, width), jnp.float32) if return_mass else None
    tiled = q_len_R > 1
    n_big = jnp.where(tiled, q_len_R // big, 0)
    rest = jnp.where(tiled, q_len_R - n_big * big, 0)
    n_small = (rest + small - 1) // small
    out, mass = _tiles(q_pad, out, mass, reader, kv_len_R, q_start_R, q_len_R, jnp.zeros_like(n_big), n_big, big, block)
    out, mass = _tiles(q_pad, out, mass, reader, kv_len_R, q_start_R, q_len_R, n_big * big, n_small, small, block)
    decode = q_len_R == 1
    at_R = jnp.where(decode, q_start_R, T + pad)  # out of range: dropped
    o = decode_section_attention(
        reader, jnp.take(q_THD, jnp.minimum(at_R, T - 1), axis=0), kv_len_R, decode, block, return_mass=return_mass, width=width
    )
    if return_mass:
        o, decode_mass = o
        mass = mass + decode_mass
    out = out.at[at_R].set(o, mode="drop")[:T].astype(q_THD.dtype)
    return (out, mass) if return_mass else out


def pad_lists(live_RN, block: int = KEY_BLOCK):
    """``live_RN`` widened with sentinel entries to a multiple of ``block``."""
    N = live_RN.shape[1]
    extra = -N % block
    return live_RN if not extra else jnp.pad(live_RN, ((0, 0), (0, extra)))


def check_ragged_inputs(q_THD, k_SKD, v_SKD, live_RN, kv_len_R, q_start_R, q_len_R) -> None:
    """Trace-time checks of shapes and dtypes (errors name the offending shape)."""
    if q_THD.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {q_THD.shape}")
    if k_SKD.ndim != 3 or v_SKD.shape != k_SKD.shape:
        raise ValueError(f"k and v must both be [S, Hkv, D], got {k_SKD.shape} and {v_SKD.shape}")
    _, Hq, D = q_THD.shape
    _, K, Dk = k_SKD.shape
    if Dk != D:
        raise ValueError(f"q head_dim {D} != pool head_dim {Dk}")
    if Hq % K:
        raise ValueError(f"q heads {Hq} not a multiple of KV heads {K}")
    if live_RN.ndim != 2:
        raise ValueError(f"live lists must be [R, N], got shape {live_RN.shape}")
    R = live_RN.shape[0]
    for name, a in (("kv_len", kv_len_R), ("q_start", q_start_R), ("q_len", q_len_R)):
        if a.shape != (R,):
            raise ValueError(f"{name} must be [R={R}], got shape {a.shape}")
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got {a.dtype}")
    for name, a in (("q", q_THD), ("k", k_SKD), ("v", v_SKD)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"{name} must be floating, got {a.dtype}")


def ragged_attention(q_THD, k_SKD, v_SKD, live_RN, kv_len_R, q_start_R, q_len_R, *, backend=None):
    """Attention of a flat batch of ``T`` queries from ``R`` rows over a float
    pool (module docstring for the layout and the causal rule).

    Args:
      q_THD: ``[T, Hq, D]`` post-RoPE queries.
      k_SKD, v_SKD: ``[S, Hkv, D]`` one layer of the pool; the step's own keys and
        values are already written.
      live_RN: ``[R, N]`` int32 slot ids of each row's live list, position order,
        the step's new slots included.
      kv_len_R: ``[R]`` entries of each list that count.
      q_start_R, q_len_R: ``[R]`` each row's flat query tokens.
      backend: ``jaxkv.kernels._dispatch`` (None: reference-free default per platform;
        the CPU runs the blocked XLA implementation).

    Returns:
      ``[T, Hq, D]`` in ``q_THD.dtype``; zero at padding tokens.
    """
    check_ragged_inputs(q_THD, k_SKD, v_SKD, live_RN, kv_len_R, q_start_R, q_len_R)
    return _ragged_attention(q_THD, k_SKD, v_SKD, live_RN, kv_len_R, q_start_R, q_len_R, ragged_backend(backend))


def ragged_backend(backend) -> str:
    """The ragged attention's backend: ``"blocked"`` (the CPU implementation) where
    ``resolve_backend`` picks the jnp reference for decode kernels, else its answer."""
    resolved = resolve_backend(backend)
    return "blocked" if resolved == "reference" and backend is None else resolved


@functools.partial(jax.jit, static_argnums=7)
def _ragged_attention(q_THD, k_SKD, v_SKD, live_RN, kv_len_R, q_start_R, q_len_R, backend):
    if backend == "reference":
        from jaxkv.attention import ragged_attention_reference

        return ragged_attention_reference(q_THD, k_SKD, v_SKD, live_RN, kv_len_R, q_start_R, q_len_R)
    if backend == "blocked":
        return ragged_attention_blocked(q_THD, PoolReader(k_SKD, v_SKD, pad_lists(live_RN)), kv_len_R, q_start_R, q_len_R)
    if backend == "gpu":
        from jaxkv.kernels.triton import ragged as gpu_ragged
        from jaxkv.kernels.triton.launch import triton_call

        return gpu_ragged.ragged_attention(q_THD, k_SKD, v_SKD, live_RN, kv_len_R, q_start_R, q_len_R, launcher=triton_call)
    from jaxkv.kernels.attention import ragged_tpu

    return ragged_tpu.ragged_attention(q_THD, k_SKD, v_SKD, live_RN, kv_len_R, q_start_R, q_len_R, interpret=backend == "interpret")


__all__ = [
    "BIG_TILE",
    "KEY_BLOCK",
    "SMALL_TILE",
    "PoolReader",
    "decode_section_attention",
    "pad_lists",
    "ragged_attention",
    "ragged_attention_blocked",
    "window_decode_attention",
]
