"""RepairKV: score evicted rows against the next turn's signal, pick K to promote
(ALGORITHMS.md §6, papers/repairkv.md §3.3).

Shape letters: L layers, X signal (query) rows, Hq / Hkv query / KV heads (K in
names), G = Hq / Hkv, D head dim, N context (active) rows, M candidate (evicted)
rows, C rows of one chunk.

**Score** (pure, jit-able). With the post-RoPE signal rows ``q_s``:
``A^{l,h} = softmax(q_s · [K_active, K_evicted]^T / √d)`` over active ∪ evicted
columns; keep the evicted columns; ``a_i = mean_{l,h} max_t A^{l,h}_{t,i}``
(mean over layers and all Hq query heads; GQA expands each KV head to its G
query heads). A signal row at position p sees only keys at positions ``<= p``
(causal, as the model would attend); padded rows/columns are masked. It runs in
chunks of C candidates, in two passes, so the candidate pool can exceed device
memory: pass 1 folds the softmax normaliser of every (l, h, t) over the context
and each candidate chunk with log-sum-exp; pass 2 turns each chunk's logits
into probabilities and takes the per-column max. ``repair_scores`` scans chunks
of an in-memory array; ``repair_scores_streamed`` pulls chunks from any source
(host tier, memory map, generator); both run the same two chunk kernels.

**Rank**: descending ``a_i``; ties by descending compression score (the score
that evicted the row: a row that nearly survived comes first); then ascending
position.

**Select** (``select_bursts``): ranked rows not yet selected become anchors in
rank order, at most ``anchors`` of them (default ``ceil(K / (L + R + 1))``, this
project's choice: the number of full bursts K can hold). An anchor i expands to
the burst ``{i−L … i+R} ∩ (evicted \\ selected)`` with (L, R) = (2, 20): rows
outside ``[0, last evicted position]`` (sequence ends) and active rows are not
evicted, so they are never selected (a burst skips them and continues past). A
burst is taken nearest-first (i, i+1, i−1, i+2, i−2, i+3, …, i+R, right first
at equal distance) and cut when K rows are selected. If the anchors' bursts do
not fill K, single ranked rows backfill. Exactly ``min(K, M)`` rows result.

**Controls**: ``random`` (K uniform rows, seeded per event), ``oldest`` (K lowest
positions), ``staleq`` / ``wrongq`` (the same scorer and selection with the
previous turn's / another session's signal), ``refresh`` (``select_refresh``:
reselect all ``B + K`` rows from active ∪ evicted by the same scorer and rank; no
bursts; active rows rank above evicted ones at equal score).

**Apply** (``Engine.restore_rows``, host tables by ``jaxkv.cache.request.promotion_tables``): promoted rows take fresh slots at
their ORIGINAL positions: the positions' slot-map entries (holes) point to the
new slots and the live-index list grows (position order). Only the dead-slot
layout keeps original positions; a renumbered (compact) request cannot be
repaired (``RepairError``).

Invariants: scoring and selection are pure (no engine, no pool); the promoted set
is a subset of the candidates, has no repeats and at most K rows; the same
inputs give the same set.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.attention import group_heads, gqa_scores
from jaxkv.buckets import bucket
from jaxkv.cache.allocator import SENTINEL_SLOT
from jaxkv.errors import RepairConfigError, RepairError

POLICIES = ("repairkv", "random", "oldest", "staleq", "wrongq", "refresh")
WHEN = ("turn", "tool")
SCORED = ("repairkv", "staleq", "wrongq", "refresh")


@dataclasses.dataclass(frozen=True)
class RepairConfig:
    """A session's repair choice.

    Attributes:
      k: restore budget K (rows promoted per turn boundary; refresh: net growth).
      policy: one of ``POLICIES``.
      when: ``"turn"`` (every turn boundary) or ``"tool"`` (only when the new
        turn's actionable message is a tool result).
      left / right: burst extent (L, R) = (2, 20) (paper §3.3).
      anchors: anchors whose bursts are taken before backfill (None: ceil(K / (L+R+1))).
      chunk: candidate rows per scoring chunk.
      signal_rows: the signal is the last ``signal_rows`` rows of the actionable query.
      seed: seed of the Random-K control.
    """

    k: int
    policy: str = "repairkv"
    when: str = "turn"
    left: int = 2
    right: int = 20
    anchors: int | None = None
    chunk: int = 4096
    signal_rows: int = 256
    seed: int = 0

    def __post_init__(self):
        if int(self.k) < 1:
            raise RepairConfigError(f"repair budget K must be >= 1, got {self.k}")
        if self.policy not in POLICIES:
            raise RepairConfigError(f"unknown repair policy {self.policy!r}; known: {', '.join(POLICIES)}")
        if self.when not in WHEN:
            raise RepairConfigError(f"unknown repair_when {self.when!r}; known: {', '.join(WHEN)}")
        if self.left < 0 or self.right < 0 or self.chunk < 1 or self.signal_rows < 1:
            raise RepairConfigError("repair left/right must be >= 0, chunk and signal_rows >= 1")


@dataclasses.dataclass(frozen=True)
class Signal:
    """A turn's repair signal: post-RoPE query rows and their positions.

    Attributes:
      q_LXHD: ``[L, X, Hq, D]`` float32.
      positions_X: int64 ``[X]``.
    """

    q_LXHD: np.ndarray
    positions_X: np.ndarray


@dataclasses.dataclass(frozen=True)
class RepairReport:
    """What one turn boundary's repair did.

    Attributes:
      turn: index of the request in its session (0-based).
      policy, k: the repair choice.
      candidates: eligible evicted rows (shelved by earlier requests, holes here).
      promoted_positions: positions brought back (sorted).
      demoted_positions: active positions evicted by ``refresh`` (else empty).
      live_before / live_after: live rows of the request around the repair.
      skipped: why nothing was promoted, when that was decided up front.
    """

    turn: int
    policy: str
    k: int
    candidates: int
    promoted_positions: np.ndarray
    demoted_positions: np.ndarray
    live_before: int
    live_after: int
    skipped: str | None = None


# ============================================================================ scoring
def _group(q_LXHD, num_kv_heads):
    return group_heads(jnp.asarray(q_LXHD, jnp.float32), num_kv_heads)


def _masked_logits(q_LXKGD, q_pos_X, q_valid_X, k_LCKD, pos_C, valid_C):
    """Scaled logits ``[L, Hkv, G, X, C]`` and the visibility mask ``[X, C]``."""
    s = gqa_scores(q_LXKGD, k_LCKD)
    mask_XC = q_valid_X[:, None] & valid_C[None, :] & (pos_C[None, :] <= q_pos_X[:, None])
    return s, mask_XC


def _chunk_lse(q_LXKGD, q_pos_X, q_valid_X, k_LCKD, pos_C, valid_C):
    """Pass 1 kernel: log-sum-exp of one chunk's visible logits ``[L, Hkv, G, X]``."""
    s, mask = _masked_logits(q_LXKGD, q_pos_X, q_valid_X, k_LCKD, pos_C, valid_C)
    return jax.nn.logsumexp(jnp.where(mask, s, -jnp.inf), axis=-1)


def _chunk_score(q_LXKGD, q_pos_X, q_valid_X, k_LCKD, pos_C, valid_C, lse_LKGX):
    """Pass 2 kernel: ``a_c = mean_{l,h} max_t softmax`` for one chunk ``[C]``."""
    s, mask = _masked_logits(q_LXKGD, q_pos_X, q_valid_X, k_LCKD, pos_C, valid_C)
    p = jnp.where(mask, jnp.exp(s - lse_LKGX[..., None]), 0.0)
    return p.max(axis=3).mean(axis=(0, 1, 2))


_chunk_lse_jit = jax.jit(_chunk_lse)
_chunk_score_jit = jax.jit(_chunk_score)


@functools.partial(jax.jit, static_argnames=("chunk",))
def repair_scores(q_LXHD, q_pos_X, q_valid_X, ctx_k_LNKD, ctx_pos_N, ctx_valid_N, cand_k_LMKD, cand_pos_M, cand_valid_M, *, chunk: int):
    """``a_M`` for in-memory candidates (float32 ``[M]``; 0 where invalid or unseen).

    ``ctx_*`` are the columns that only normalise (the active rows), ``cand_*`` the
    scored columns (the evicted rows); both enter the softmax. Candidates are
    scanned ``chunk`` rows at a time (M is padded up to a multiple).
    """
    L, M, Hkv, D = cand_k_LMKD.shape
    q = _group(q_LXHD, Hkv)
    n = -(-M // chunk)
    pad = n * chunk - M
    k_nLCKD = jnp.pad(cand_k_LMKD, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(L, n, chunk, Hkv, D).swapaxes(0, 1)
    pos_nC = jnp.pad(cand_pos_M, (0, pad)).reshape(n, chunk)
    valid_nC = jnp.pad(cand_valid_M, (0, pad)).reshape(n, chunk)
    lse0 = _chunk_lse(q, q_pos_X, q_valid_X, ctx_k_LNKD, ctx_pos_N, ctx_valid_N)

    def pass1(lse, xs):
        return jnp.logaddexp(lse, _chunk_lse(q, q_pos_X, q_valid_X, *xs)), None

    lse, _ = jax.lax.scan(pass1, lse0, (k_nLCKD, pos_nC, valid_nC))

    def pass2(carry, xs):
        return carry, _chunk_score(q, q_pos_X, q_valid_X, *xs, lse)

    _, a_nC = jax.lax.scan(pass2, None, (k_nLCKD, pos_nC, valid_nC))
    return a_nC.reshape(-1)[:M]


ChunkSource = Callable[[], Iterable[tuple]]


def repair_scores_streamed(q_LXHD, q_pos_X, q_valid_X, ctx_k_LNKD, ctx_pos_N, ctx_valid_N, chunks: ChunkSource) -> np.ndarray:
    """``a`` for candidates pulled chunk by chunk: ``chunks()`` yields
    ``(k_LCKD, pos_C, valid_C)`` (fixed C keeps one compile) and is called twice
    (one pass each), so only one chunk need be on the device at a time.
    Returns the concatenated valid and padded entries, in the order yielded."""
    Hkv = ctx_k_LNKD.shape[2]
    q = _group(q_LXHD, Hkv)
    q_pos, q_valid = (
        np.asarray(q_pos_X, np.int32),
        np.asarray(q_valid_X, bool),
    )  # host arrays: jit transfers them (jnp.asarray would compile a program per shape)
    lse = _chunk_lse_jit(q, q_pos, q_valid, ctx_k_LNKD, np.asarray(ctx_pos_N, np.int32), np.asarray(ctx_valid_N, bool))
    for k, pos, valid in chunks():
        lse = jnp.logaddexp(lse, _chunk_lse_jit(q, q_pos, q_valid, k, pos, valid))
    out = [_chunk_score_jit(q, q_pos, q_valid, k, pos, valid, lse) for k, pos, valid in chunks()]
    return np.concatenate([np.asarray(a) for a in out]) if out else np.zeros(0, np.float32)


def score_rows(signal: Signal, ctx_k_LNKD, ctx_pos_N, cand_k_LMKD, cand_pos_M, *, chunk: int = 4096, see_all: bool = False) -> np.ndarray:
    """Host entry: pad X, N, M to powers of two (compiles are reused) and run
    ``repair_scores``. ``see_all`` lets every signal row see every key (a foreign
    signal, whose positions mean nothing here). Returns float32 ``[M]``."""
    q = np.asarray(signal.q_LXHD, np.float32)
    L, X, Hq, D = q.shape
    N, M = int(np.shape(ctx_pos_N)[0]), int(np.shape(cand_pos_M)[0])
    Xp, Np, Mp = (bucket(n, minimum=8, step=1 << 62) for n in (X, N, M))
    C = min(int(chunk), Mp)
    Mp = -(-Mp // C) * C
    q_pos = np.full(Xp, np.iinfo(np.int32).max if see_all else -1, np.int64)
    if not see_all:
        q_pos[:X] = signal.positions_X
    q_pad = np.zeros((L, Xp, Hq, D), np.float32)
    q_pad[:, :X] = q

    def pad_rows(k, n):
        k = np.asarray(k)
        return np.pad(k, ((0, 0), (0, n - k.shape[1]), (0, 0), (0, 0)))

    def pad_vec(x, n):
        return np.pad(np.asarray(x, np.int64), (0, n - len(x)))

    a = repair_scores(
        q_pad,
        q_pos.astype(np.int32),
        np.arange(Xp) < X,
        pad_rows(ctx_k_LNKD, Np),
        pad_vec(ctx_pos_N, Np).astype(np.int32),
        np.arange(Np) < N,
        pad_rows(cand_k_LMKD, Mp),
        pad_vec(cand_pos_M, Mp).astype(np.int32),
        np.arange(Mp) < M,
        chunk=C,
    )
    return np.asarray(a)[:M]


# ============================================================================ selection
def rank(a_M, comp_M, positions_M) -> np.ndarray:
    """Candidate indices, best first: ``a`` desc, compression score desc, position asc."""
    return np.lexsort((np.asarray(positions_M), -np.asarray(comp_M, np.float64), -np.asarray(a_M, np.float64)))


def burst_offsets(left: int, right: int) -> np.ndarray:
    """Burst order around an anchor: 0, +1, −1, +2, −2, …, then the longer side."""
    return np.asarray(sorted(range(-left, right + 1), key=lambda d: (abs(d), d < 0)), np.int64)


def select_bursts(positions_M, order_M, k: int, *, left: int = 2, right: int = 20, anchors: int | None = None) -> np.ndarray:
    """Promoted positions (sorted) by anchors + bursts + backfill (module docstring)."""
    pos = np.asarray(positions_M, np.int64)
    k = min(int(k), pos.size)
    if k <= 0:
        return np.zeros(0, np.int64)
    n_anchors = math.ceil(k / (left + right + 1)) if anchors is None else int(anchors)
    ranked = pos[np.asarray(order_M)]
    avail = np.zeros(int(pos.max()) + 1, bool)  # evicted and not yet selected
    avail[pos] = True
    offsets = burst_offsets(left, right)
    chosen: list[int] = []
    used = 0
    for p in ranked:
        if used >= n_anchors or len(chosen) >= k:
            break
        if not avail[p]:
            continue
        used += 1
        burst = p + offsets
        burst = burst[(burst >= 0) & (burst < avail.size)]
        burst = burst[avail[burst]][: k - len(chosen)]
        avail[burst] = False
        chosen += burst.tolist()
    if len(chosen) < k:  # backfill single ranked rows
        rest = ranked[avail[ranked]][: k - len(chosen)]
        chosen += rest.tolist()
    return np.sort(np.asarray(chosen, np.int64))


def select_random(positions_M, k: int, seed) -> np.ndarray:
    """Random-K: ``min(K, M)`` uniform positions (``seed`` any numpy seed sequence)."""
    pos = np.asarray(positions_M, np.int64)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(pos, min(int(k), pos.size), replace=False))


def select_oldest(positions_M, k: int) -> np.ndarray:
    """Oldest-K: the ``min(K, M)`` lowest positions."""
    return np.sort(np.asarray(positions_M, np.int64))[: int(k)]


def select_refresh(a_M, comp_M, positions_M, n_keep: int) -> np.ndarray:
    """Refresh: bool mask of the ``n_keep`` best-ranked rows of active ∪ evicted
    (active rows carry compression score +inf so they win ties)."""
    keep = np.zeros(len(positions_M), bool)
    keep[rank(a_M, comp_M, positions_M)[: max(int(n_keep), 0)]] = True
    return keep


def choose(cfg: RepairConfig, positions_M, comp_M, a_M=None, *, event: int = 0) -> np.ndarray:
    """The promoted positions of one event for every policy but ``refresh``."""
    if cfg.policy == "random":
        return select_random(positions_M, cfg.k, (cfg.seed, event))
    if cfg.policy == "oldest":
        return select_oldest(positions_M, cfg.k)
    if cfg.policy == "refresh":
        raise RepairError("refresh reselects active rows too: use select_refresh")
    if a_M is None:
        raise RepairError(f"repair policy {cfg.policy!r} needs scores")
    order = rank(a_M, comp_M, positions_M)
    return select_bursts(positions_M, order, cfg.k, left=cfg.left, right=cfg.right, anchors=cfg.anchors)


# ============================================================================ apply
