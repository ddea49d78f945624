"""Host tier: evicted KV rows kept in host memory for RepairKV (ALGORITHMS.md §6).

A compression event drops rows from a request's active set; instead of being
discarded, the rows of every layer are copied here with their ORIGINAL positions,
their token ids (to detect a conversation that diverged) and the compression
score that evicted them. At a turn boundary the repair operator
(``jaxkv.policies.repair``) scores them against the new turn's signal and
promotes a budgeted subset back into the device pool (``Engine.restore_rows``), at the
same positions, bit for bit.

Shape letters: L layers, M rows, Hkv KV heads (K in names), D head dim.

Storage: per session one *shelf*: numpy arrays sorted by position
(``positions_M``, ``tokens_M``, ``k_LMKD``, ``v_LMKD``, ``scores_M``,
``stamp_M``). ``stamp`` is a tier-wide counter of ``put`` calls ("age": lower is
older; the rows of one eviction event share it).
Values keep the pool dtype, so a promoted row is bit-identical to the evicted one.

Pinned memory: host bookkeeping is plain numpy (``docs/architecture.md``, "The house
and its invariants"). On an accelerator backend whose device exposes the
``pinned_host`` memory kind, rows handed back
for promotion are staged in page-locked memory first (``stage``), so the
host-to-device copy is a DMA; on CPU (and where the kind is missing) rows go
straight from numpy. A production tier would allocate its shelves in pinned
memory directly (``jax.device_put(x, SingleDeviceSharding(dev,
memory_kind="pinned_host"))``); that is the one place to change.

Capacity (in rows; ``None`` = unbounded):
  * ``session_rows``: a session holding more keeps its newest rows (drops the
    oldest ``stamp`` first, ties by lower position);
  * ``global_rows``: when the tier holds more, rows of the least recently used
    session go first, oldest first; a session left empty is removed entirely,
    then the next least recently used one is trimmed. ``put``, ``rows`` and
    ``take`` count as a use.

Invariants (``check_invariants``):
  * within a shelf positions are unique and strictly increasing; every array of a
    shelf has the same M;
  * a position re-evicted after a promotion replaces its old row (newest wins);
  * ``num_rows`` == sum of shelf sizes <= ``global_rows``; each shelf <=
    ``session_rows``; no shelf is empty (empty sessions are removed);
  * ``drop_session`` releases every row of that session.
Cost: ``put`` / ``take`` / ``drop_from`` are O(M_session) numpy work (a merge);
``rows`` returns views, O(1). Memory: 2 * L * Hkv * D * itemsize bytes per row.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from typing import Hashable

import jax
import numpy as np

from jaxkv.errors import RepairError


@dataclasses.dataclass(frozen=True)
class TierRows:
    """Evicted rows of one session, sorted by position.

    Attributes:
      positions_M: original positions (int64).
      tokens_M: token id at each position (int32).
      k_LMKD / v_LMKD: the K and V rows of every layer, pool dtype.
      scores_M: compression score that evicted each row (float32).
      stamp_M: the ``put`` that shelved the row (int64); lower is older.
    """

    positions_M: np.ndarray
    tokens_M: np.ndarray
    k_LMKD: np.ndarray
    v_LMKD: np.ndarray
    scores_M: np.ndarray
    stamp_M: np.ndarray

    @property
    def size(self) -> int:
        return int(self.positions_M.size)

    def subset(self, idx) -> "TierRows":
        idx = np.asarray(idx)
        return TierRows(
            self.positions_M[idx], self.tokens_M[idx], self.k_LMKD[:, idx], self.v_LMKD[:, idx], self.scores_M[idx], self.stamp_M[idx]
        )

    @staticmethod
    def concat(a: "TierRows", b: "TierRows") -> "TierRows":
        return TierRows(
            np.concatenate([a.positions_M, b.positions_M]),
            np.concatenate([a.tokens_M, b.tokens_M]),
            np.concatenate([a.k_LMKD, b.k_LMKD], axis=1),
            np.concatenate([a.v_LMKD, b.v_LMKD], axis=1),
            np.concatenate([a.scores_M, b.scores_M]),
            np.concatenate([a.stamp_M, b.stamp_M]),
        )


class HostTier:
    """Per-session shelves of evicted rows with row-count bounds and LRU."""

    def __init__(self, *, session_rows: int | None = None, global_rows: int | None = None):
        for name, cap in (("session_rows", session_rows), ("global_rows", global_rows)):
            if cap is not None and int(cap) < 0:
                raise RepairError(f"host tier {name} must be >= 0 or None, got {cap}")
        self.session_rows = None if session_rows is None else int(session_rows)
        self.global_rows = None if global_rows is None else int(global_rows)
        self._shelves: OrderedDict[Hashable, TierRows] = OrderedDict()
        self._stamp = 0
        self.num_rows = 0
        self.dropped_rows = 0  # rows lost to the capacity bounds so far

    # -- queries -------------------------------------------------------------
    @property
    def clock(self) -> int:
        """The stamp the next ``put`` gives its rows (rows with a lower stamp were
        shelved before now)."""
        return self._stamp

    def sessions(self) -> list:
        """Session keys, least recently used first."""
        return list(self._shelves)

    def session_size(self, session: Hashable) -> int:
        shelf = self._shelves.get(session)
        return 0 if shelf is None else shelf.size

    def rows(self, session: Hashable) -> TierRows | None:
        """The session's rows (sorted by position), or ``None``; marks it used."""
        shelf = self._shelves.get(session)
        if shelf is not None:
            self._shelves.move_to_end(session)
        return shelf

    # -- updates -------------------------------------------------------------
    def put(self, session: Hashable, positions_M, tokens_M, k_LMKD, v_LMKD, scores_M) -> int:
        """Store evicted rows of ``session``; returns how many rows it now holds.

        ``k_LMKD`` / ``v_LMKD`` are ``[L, M, Hkv, D]`` host arrays (copied). A
        position already shelved is replaced. Capacity bounds apply afterwards.
        """
        pos = np.asarray(positions_M, np.int64).reshape(-1)
        m = pos.size
        k, v = np.asarray(k_LMKD), np.asarray(v_LMKD)
        tokens = np.asarray(tokens_M, np.int32).reshape(-1)
        scores = np.asarray(scores_M, np.float32).reshape(-1)
        if k.ndim != 4 or k.shape != v.shape or k.shape[1] != m or tokens.size != m or scores.size != m:
            raise RepairError(
                f"host tier put: {m} positions, {tokens.size} tokens, {scores.size} scores, "
                f"K {k.shape}, V {v.shape} (want [L, {m}, Hkv, D] each)"
            )
        if np.unique(pos).size != m or (pos < 0).any():
            raise RepairError("host tier put: positions must be distinct and non-negative")
        if m == 0:
            return self.session_size(session)
        old = self._shelves.get(session)
        row_shape = lambda a: (a.shape[0],) + a.shape[2:]  # noqa: E731
        if old is not None and (row_shape(old.k_LMKD) != row_shape(k) or old.k_LMKD.dtype != k.dtype):
            raise RepairError(f"host tier put: rows {k.shape}/{k.dtype} do not match the shelf's {old.k_LMKD.shape}/{old.k_LMKD.dtype}")
        stamp = np.full(m, self._stamp, np.int64)  # one age per put (one eviction event)
        self._stamp += 1
        new = TierRows(pos, tokens, k.copy(), v.copy(), scores, stamp)
        if old is not None:
            self.num_rows -= old.size
            new = TierRows.concat(old.subset(~np.isin(old.positions_M, pos)), new)
        new = new.subset(np.argsort(new.positions_M, kind="stable"))
        self._shelves[session] = new
        self._shelves.move_to_end(session)
        self.num_rows += new.size
        self._enforce(session)
        return self.session_size(session)

    def take(self, session: Hashable, positions) -> TierRows:
        """Remove and return the rows at ``positions`` (each must be shelved)."""
        want = np.asarray(positions, np.int64).reshape(-1)
        shelf = self._shelves.get(session)
        have = np.zeros(0, np.int64) if shelf is None else shelf.positions_M
        missing = want[~np.isin(want, have)]
        if missing.size or np.unique(want).size != want.size:
            raise RepairError(f"host tier take: positions {missing[:5].tolist()} not shelved (or repeated) for this session")
        if shelf is None:  # want is empty
            raise RepairError("host tier take: the session has no rows")
        self._shelves.move_to_end(session)
        hit = np.isin(shelf.positions_M, want)
        out = shelf.subset(np.flatnonzero(hit))
        self._replace(session, shelf.subset(np.flatnonzero(~hit)))
        return out

    def drop_from(self, session: Hashable, position: int) -> int:
        """Forget the session's rows at positions ``>= position`` (the conversation
        diverged there, so they describe other tokens); returns how many."""
        shelf = self._shelves.get(session)
        if shelf is None:
            return 0
        keep = shelf.positions_M < int(position)
        self._replace(session, shelf.subset(np.flatnonzero(keep)))
        return int((~keep).sum())

    def drop_session(self, session: Hashable) -> int:
        """Release every row of ``session``; returns how many."""
        shelf = self._shelves.pop(session, None)
        if shelf is None:
            return 0
        self.num_rows -= shelf.size
        return shelf.size

    # -- internals -----------------------------------------------------------
    def _replace(self, session, shelf: TierRows) -> None:
        self.num_rows += shelf.size - self._shelves[session].size
        if shelf.size:
            self._shelves[session] = shelf
        else:
            del self._shelves[session]

    def _trim(self, session, n: int) -> None:
        """Drop the ``n`` oldest rows of ``session`` (ties: lower position first)."""
        shelf = self._shelves[session]
        order = np.lexsort((shelf.positions_M, shelf.stamp_M))
        keep = np.sort(order[n:])
        self.dropped_rows += min(n, shelf.size)
        self._replace(session, shelf.subset(keep))

    def _enforce(self, session) -> None:
        if self.session_rows is not None and self.session_size(session) > self.session_rows:
            self._trim(session, self.session_size(session) - self.session_rows)
        while self.global_rows is not None and self.num_rows > self.global_rows:
            victim = next(iter(self._shelves))  # least recently used
            self._trim(victim, min(self.num_rows - self.global_rows, self.session_size(victim)))

    def check_invariants(self) -> None:
        total = 0
        for key, s in self._shelves.items():
            assert s.size > 0, f"empty shelf kept for {key!r}"
            assert (np.diff(s.positions_M) > 0).all(), "positions not strictly increasing"
            for a in (s.tokens_M, s.scores_M, s.stamp_M):
                assert a.shape == (s.size,)
            assert s.k_LMKD.shape[1] == s.v_LMKD.shape[1] == s.size
            assert self.session_rows is None or s.size <= self.session_rows
            total += s.size
        assert total == self.num_rows
        assert self.global_rows is None or total <= self.global_rows


# ============================================================================ device side
@functools.lru_cache(maxsize=None)
def _pinned_sharding(platform: str):
    dev = jax.devices()[0]
    if platform == "cpu":
        return None  # numpy is already host memory; staging would only copy
    kinds = {m.kind for m in dev.addressable_memories()}
    if "pinned_host" not in kinds:
        return None
    return jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")


def stage(x: np.ndarray):
    """Rows about to be promoted: in pinned host memory where the backend has it
    (GPU/TPU), unchanged otherwise."""
    sharding = _pinned_sharding(jax.default_backend())
    return x if sharding is None else jax.device_put(x, sharding)
