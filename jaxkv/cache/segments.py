"""The segment store: KV of prompt fragments kept for reuse across requests and positions.

Cross-query segment reuse (ALGORITHMS.md §9) needs, for a new prompt, the stored
fragments whose tokens reappear in it at any offset, with their lower layers' K/V
and the residual stream at the cut. This module is the host side of that: what a
segment holds, how prompts are cut into segments, how candidates are found, and
the byte-capped, per-tenant LRU that owns the arrays. The stage
(``jaxkv.serving.stages.reuse``) decides what to splice; the engine applies it.

Segmentation (``segment_units``): structural anchors (the tagger's message spans:
system with its tool schemas, user, assistant, tool responses) cut the prompt;
inside each anchor, windows of ``window`` tokens every ``stride`` tokens, the last
one flush with the anchor's end; an anchor shorter than a window is one unit.
Windows restart at every anchor, so a document that reappears in another
conversation yields the same units at any absolute offset.

Signatures: MinHash (``datasketch``) over the set of token ``k``-shingles (k
consecutive ids hashed to 32 bits), in a ``MinHashLSH`` per (tenant, namespace)
banded for recall (``LSH_PARAMS``: 64 bands of 2 rows): LSH is the recall step. Each segment also
keeps a MinHash of its ``W``-token left context. Matching (``align``) then verifies
candidates exactly: shingle hits vote for offsets; at each of the best offsets the
segment's tokens are compared with the prompt's, giving the match fraction (the
similarity ``τ_seg`` thresholds: a segment with 10% of its tokens edited scores 0.9,
while its shingle Jaccard, with every edit breaking ``k`` shingles, falls to ~0.35)
and the runs of equal tokens that can be spliced.

Isolation: every stored segment belongs to one tenant and one namespace (the reuse
layout: which layers' K/V and which residual it holds). A lookup searches only the
caller's (tenant, namespace) index, ``get`` refuses a segment of another tenant,
and no operation returns or mutates another tenant's arrays.

Invariants: ``nbytes <= cap_bytes`` after every call; a segment is in the LRU iff it
is in its space's dict and LSH; on eviction (byte cap, ``remove``, ``drop_tenant``)
every array of the segment is zero-filled before it is forgotten.

Cost: shingling and one MinHash per unit are O(unit length) host work; an LSH
query is O(bands) hash lookups, independent of the index size (``eval/bench/reuse.py``);
``align`` is O(candidate length + prompt length) numpy.

``datasketch`` is imported where a signature or an index is first made, not with the
module: it pulls in scipy (about 1.4 s of CPU), which a process that never reuses a
segment (every ``import jaxkv``) should not pay.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import TYPE_CHECKING, Sequence

import numpy as np

from jaxkv.errors import ConfigError, JaxKVError

if TYPE_CHECKING:
    from datasketch import LeanMinHash

NUM_PERM = 128
SHINGLE = 6
# LSH bands x rows: P(candidate | Jaccard J) = 1 - (1 - J^2)^64: 0.99 at J = 0.26 (a
# 10%-edited window seen through a query window shifted by a quarter of its
# length), 0.15 at J = 0.05 (unrelated text; ``align`` drops those cheaply).
LSH_PARAMS = (64, 2)
MINHASH_SEED = 1
_MIX = np.uint64(0x9E3779B97F4A7C15)


def shingle_hashes(tokens, k: int = SHINGLE) -> np.ndarray:
    """32-bit hashes of every ``k`` consecutive ids (``[max(n - k + 1, 0)]`` uint32);
    a sequence shorter than ``k`` is one shingle of itself."""
    t = np.asarray(tokens, np.int64).astype(np.uint64)
    if t.size == 0:
        return np.zeros(0, np.uint32)
    if t.size < k:
        k = t.size
    h = np.zeros(t.size - k + 1, np.uint64)
    with np.errstate(over="ignore"):
        for j in range(k):
            h = (h ^ (t[j : t.size - k + 1 + j] + np.uint64(j + 1))) * _MIX
            h ^= h >> np.uint64(29)
    return (h >> np.uint64(32)).astype(np.uint32)


def _hash32(b: bytes) -> int:
    return int.from_bytes(b, "little")


def minhash(tokens, k: int = SHINGLE, num_perm: int = NUM_PERM) -> LeanMinHash:
    """MinHash signature of the set of ``k``-shingles of ``tokens``."""
    from datasketch import LeanMinHash, MinHash

    m = MinHash(num_perm=num_perm, seed=MINHASH_SEED, hashfunc=_hash32)
    hs = np.unique(shingle_hashes(tokens, k))
    if hs.size:
        m.update_batch([int(x).to_bytes(4, "little") for x in hs])
    return LeanMinHash(m)


def segment_units(
    n: int,
    anchors: Sequence[tuple[int, int]],
    start: int = 0,
    stop: int | None = None,
    *,
    window: int = 128,
    stride: int = 64,
    min_len: int = 16,
) -> list[tuple[int, int]]:
    """Units ``[(a, b)]`` of positions ``[start, stop)`` (module docstring): windows
    inside each anchor span, restarted at every anchor; units shorter than
    ``min_len`` are dropped. Spans outside every anchor are not units."""
    if not 0 < stride <= window:
        raise ConfigError(f"need 0 < stride <= window, got stride={stride}, window={window}")
    stop = n if stop is None else stop
    units = []
    for a, b in anchors:
        a, b = max(int(a), start), min(int(b), stop)
        if b - a < min_len:
            continue
        if b - a <= window:
            units.append((a, b))
            continue
        s = a
        while True:
            units.append((s, min(s + window, b)))
            if s + window >= b:
                break
            s = min(s + stride, b - window)
    return list(dict.fromkeys(units))


@dataclasses.dataclass(eq=False)
class Segment:
    """One stored fragment.

    Attributes:
      id: unique in its store. tenant / namespace: whose, and which layout.
      origin: id of the request it was computed in (segments of one origin at
        consistent positions are one contiguous computation).
      tokens ``[m]`` int32, positions ``[m]`` int64: ids and original positions.
      k, v: ``[n, m, Hkv, D]`` post-RoPE keys / values of layers ``0..n-1``.
      resid: ``[m, M]`` the residual stream at the cut (input of the last reused
        layer), or None when the layout keeps none.
      sig, ctx_sig: MinHash of the tokens' shingles and of the ``W``-token left context.
      hits: times it was spliced. nbytes: bytes of its arrays.
    """

    id: int
    tenant: str
    namespace: tuple
    origin: int
    tokens: np.ndarray
    positions: np.ndarray
    k: np.ndarray
    v: np.ndarray
    resid: np.ndarray | None
    sig: LeanMinHash
    ctx_sig: LeanMinHash
    hits: int = 0

    @property
    def arrays(self) -> list[np.ndarray]:
        return [a for a in (self.tokens, self.positions, self.k, self.v, self.resid) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def __len__(self) -> int:
        return int(self.tokens.size)


class _Space:
    def __init__(self, params: tuple[int, int], num_perm: int):
        from datasketch import MinHashLSH

        self.lsh = MinHashLSH(num_perm=num_perm, params=params)
        self.segments: dict[int, Segment] = {}


class SegmentStore:
    """Byte-capped LRU of segments, one LSH index per (tenant, namespace).

    Args:
      cap_bytes: bound on the bytes of stored arrays (LRU eviction past it).
      num_perm: MinHash permutations of the signatures it indexes.
      lsh_params: LSH (bands, rows per band), ``bands * rows <= num_perm``.

    The shingle size and ``W`` are the caller's (``minhash``), and belong in the
    namespace: signatures of different shingle sizes never share an index.
    """

    def __init__(self, cap_bytes: int = 256 << 20, *, num_perm: int = NUM_PERM, lsh_params: tuple[int, int] = LSH_PARAMS):
        if cap_bytes < 0 or lsh_params[0] * lsh_params[1] > num_perm:
            raise ConfigError(f"bad segment store settings: cap_bytes={cap_bytes}, lsh_params={lsh_params}, num_perm={num_perm}")
        self.cap_bytes = int(cap_bytes)
        self.num_perm = int(num_perm)
        self.lsh_params = tuple(lsh_params)
        self._spaces: dict[tuple, _Space] = {}
        self._lru: collections.OrderedDict[int, Segment] = collections.OrderedDict()
        self._ids = itertools.count(1)
        self.nbytes = 0
        self.evictions = 0

    # -- reading ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._lru)

    def segments(self, tenant: str, namespace: tuple) -> list[Segment]:
        space = self._spaces.get((tenant, namespace))
        return list(space.segments.values()) if space else []

    def get(self, tenant: str, namespace: tuple, seg_id: int) -> Segment:
        """The segment ``seg_id`` of this tenant and namespace; ``JaxKVError`` if it
        is absent or belongs to anyone else."""
        space = self._spaces.get((tenant, namespace))
        seg = space.segments.get(seg_id) if space else None
        if seg is None or seg.tenant != tenant:
            raise JaxKVError(f"no segment {seg_id} for this tenant")
        return seg

    def candidates(self, tenant: str, namespace: tuple, query_sigs) -> list[Segment]:
        """Segments of (tenant, namespace) the LSH returns for any of ``query_sigs``
        (no threshold beyond the LSH's own), most recently used first."""
        space = self._spaces.get((tenant, namespace))
        if space is None:
            return []
        found: dict[int, Segment] = {}
        for sig in query_sigs:
            for seg_id in space.lsh.query(sig):
                seg = space.segments.get(seg_id)
                if seg is not None and seg.tenant == tenant:
                    found[seg_id] = seg
        return sorted(found.values(), key=lambda s: -s.id)  # newest first

    # -- writing ---------------------------------------------------------------------
    def add(self, tenant: str, namespace: tuple, tokens, positions, k, v, resid, sig, ctx_sig, origin: int = 0) -> Segment | None:
        """Store a segment (arrays are copied) with its signatures (``minhash`` of its
        tokens and of its left context, computed by the caller with the namespace's
        shingle size and ``W``); returns it, or None when it alone exceeds the cap.
        Evicts least recently used segments (any tenant) first."""
        if not isinstance(tenant, str):
            raise ConfigError(f"tenant must be a string, got {tenant!r}")
        tokens = np.array(tokens, np.int32).reshape(-1)
        seg = Segment(
            next(self._ids),
            tenant,
            tuple(namespace),
            int(origin),
            tokens,
            np.array(positions, np.int64).reshape(-1),
            np.array(k, np.float32),
            np.array(v, np.float32),
            None if resid is None else np.array(resid, np.float32),
            sig,
            ctx_sig,
        )
        if (
            seg.positions.size != tokens.size
            or seg.k.shape[1] != tokens.size
            or (seg.resid is not None and seg.resid.shape[0] != tokens.size)
        ):
            raise ConfigError("segment arrays disagree on the token count")
        size = seg.nbytes
        if size > self.cap_bytes:
            _zeroise(seg)
            return None
        while self.nbytes + size > self.cap_bytes and self._lru:
            self.remove(next(iter(self._lru.values())))
            self.evictions += 1
        space = self._spaces.get((tenant, seg.namespace))
        if space is None:
            space = self._spaces[(tenant, seg.namespace)] = _Space(self.lsh_params, self.num_perm)
        space.lsh.insert(seg.id, seg.sig)
        space.segments[seg.id] = seg
        self._lru[seg.id] = seg
        self.nbytes += size
        return seg

    def touch(self, seg: Segment) -> None:
        """Mark a segment used (LRU)."""
        if seg.id in self._lru:
            self._lru.move_to_end(seg.id)
            seg.hits += 1

    def remove(self, seg: Segment) -> None:
        """Forget a segment and zero its arrays (no-op if already gone)."""
        if self._lru.pop(seg.id, None) is None:
            return
        space = self._spaces[(seg.tenant, seg.namespace)]
        space.lsh.remove(seg.id)
        del space.segments[seg.id]
        self.nbytes -= seg.nbytes
        _zeroise(seg)

    def drop_tenant(self, tenant: str) -> int:
        """Remove every segment of ``tenant``; returns how many."""
        segs = [s for s in self._lru.values() if s.tenant == tenant]
        for s in segs:
            self.remove(s)
        return len(segs)


def _zeroise(seg: Segment) -> None:
    for a in seg.arrays:
        a.fill(0)


# ============================================================================ matching
@dataclasses.dataclass(frozen=True)
class Alignment:
    """A candidate segment placed on the prompt.

    Attributes:
      segment: the candidate. offset: prompt position of the segment's token 0
        (may be negative or past the prompt: only the overlap counts).
      similarity: fraction of the segment's tokens equal to the prompt's there.
      runs: ``[(j0, j1)]`` maximal runs of equal tokens (segment indices).
    """

    segment: Segment
    offset: int
    similarity: float
    runs: tuple


class PromptIndex:
    """Shingle positions of one prompt region, for ``align`` (built once per request)."""

    def __init__(self, tokens, lo: int, hi: int, k: int = SHINGLE):
        self.tokens = np.asarray(tokens, np.int64)
        self.lo, self.hi, self.k = int(lo), int(hi), int(k)
        hs = shingle_hashes(self.tokens[lo:hi], k)
        order = np.argsort(hs, kind="stable")
        self._h, self._pos = hs[order], order + lo

    def positions_of(self, hashes: np.ndarray):
        """For each hash, the prompt positions of the shingles with that hash: flat
        ``(query index, position)`` pairs."""
        left = np.searchsorted(self._h, hashes, "left")
        right = np.searchsorted(self._h, hashes, "right")
        counts = right - left
        q = np.repeat(np.arange(hashes.size), counts)
        starts = np.repeat(left - np.cumsum(counts) + counts, counts)
        idx = np.arange(q.size) + starts
        return q, self._pos[idx]


def align(seg: Segment, prompt: PromptIndex, *, max_offsets: int = 3, min_run: int = 8) -> list[Alignment]:
    """Place ``seg`` on the prompt: shingle hits vote for offsets (prompt position
    minus segment index); at each of the ``max_offsets`` best, compare tokens over
    the overlap with ``[lo, hi)`` and keep runs of ``>= min_run`` equal tokens."""
    hs = shingle_hashes(seg.tokens, prompt.k)
    if hs.size == 0:
        return []
    q, pos = prompt.positions_of(hs)
    if q.size == 0:
        return []
    offsets, votes = np.unique(pos - q, return_counts=True)
    best = offsets[np.argsort(-votes, kind="stable")[:max_offsets]]
    out = []
    m = len(seg)
    for o in best.tolist():
        j0, j1 = max(0, prompt.lo - o), min(m, prompt.hi - o)
        if j1 <= j0:
            continue
        eq = np.zeros(m, bool)
        eq[j0:j1] = seg.tokens[j0:j1] == prompt.tokens[o + j0 : o + j1]
        runs = _runs(eq, min_run)
        if runs:
            out.append(Alignment(seg, int(o), float(eq.sum()) / m, tuple(runs)))
    return out


def _runs(mask: np.ndarray, min_len: int) -> list[tuple[int, int]]:
    """Maximal runs of True of length ``>= min_len`` as ``(start, end)``."""
    d = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    starts, ends = np.flatnonzero(d == 1), np.flatnonzero(d == -1)
    return [(int(a), int(b)) for a, b in zip(starts, ends) if b - a >= min_len]
