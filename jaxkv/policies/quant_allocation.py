"""TriAxialKV bit allocation: per-tag INT2/INT3/INT4 under an average-bit budget.

ALGORITHMS.md §7, paper §3.1.3 and App. A. Given per-tag distortions ``D_k(2)``,
``D_k(4)`` (and, with the INT3 tier, ``D_k(3)``) and token counts ``N_k``, choose
``b_k in {2, 4}`` (``{2, 3, 4}`` when ``D3`` is given) to

    minimise  sum_k D_k(b_k)   subject to   sum_k N_k b_k <= B * sum_k N_k.

``solve`` enumerates every assignment of the tags with ``N_k > 0`` when there
are at most ``EXHAUSTIVE_MAX = 22`` of them (``EXHAUSTIVE3_MAX = 13`` with three
widths, 3^13 = 1.6M assignments; ties: fewer bits, then the lowest assignment
index), else walks the tags by ``rho_k = (D_k(2) - D_k(4)) / (2 N_k)``
descending and upgrades each whose ``2 N_k`` still fits (the paper's greedy; with
three widths the greedy takes one-bit steps, 2 -> 3 or 3 -> 4, by the gain per
added bit ``(D_k(b) - D_k(b+1)) / N_k`` descending, each that still fits).
Tags with ``N_k = 0`` never occur in calibration and get 4 bits. Without ``D3``
every result is the two-width allocation's, bit for bit.

An allocation may also be *pinned* (``Allocation.pinned``: bits per tag row, from
the JSON's ``"bits"`` per row): its table is those bits at every budget. That is
how a hand-set allocation (every tag INT3, the tool output INT3) is measured
beside the calibrated ones; it is not a calibration.

``Allocation`` is a calibrated tag table (``train/calibrate_triaxial.py`` writes
it, ``jaxkv/assets/<model>/triaxial.json`` ships it): the axes its tags keep
(a subset of ``AXES``: the three triaxial axes, fewer for the axis ablations,
or with the tool output's ``copy`` sub-tag, ``jaxkv.chat.tags.Copy``), one row
per tag, and the calibrated budget. ``Allocation.table(B)`` expands the solution
to a bits table over every ``jaxkv.chat.tags.triaxial_codes`` code
(``NUM_TAG_CODES``), which is what the quantization stage indexes per prompt token.

Index compatibility: a tag index is the flat index over the kept axes in
``AXES`` order, and ``copy`` is last in ``AXES``, so a file whose axes lack it
(every file written before the axis) reads its indices exactly as before, and
its table gives every copy class of a tag that tag's bits (``tests/test_copy_tags.py``
checks the shipped files against the formula of before).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np

from jaxkv.chat.tags import NUM_TAG_CODES, NUM_TRIAXIAL_CODES, Copy, Modal, Semantic, Temporal
from jaxkv.errors import ConfigError

EXHAUSTIVE_MAX = 22
EXHAUSTIVE3_MAX = 13
AXES = ("temporal", "modal", "semantic", "copy")  # "copy" last: files without it keep their indices
_ENUMS = {"temporal": Temporal, "modal": Modal, "semantic": Semantic, "copy": Copy}
BLOCK = 1 << 16  # assignments scored per numpy step


def solve(D2, D4, N, budget: float, D3=None) -> np.ndarray:
    """Bits per tag (int8 2 or 4; 2, 3 or 4 with ``D3``) minimising ``sum D``
    within the budget (module docstring). ``budget`` is the average bits B in [2, 4]."""
    D2, D4, N = (np.asarray(x, np.float64).reshape(-1) for x in (D2, D4, N))
    if not (D2.size == D4.size == N.size) or (D3 is not None and np.size(D3) != N.size):
        raise ConfigError(f"D2, D3, D4, N disagree in length: {D2.size}, {None if D3 is None else np.size(D3)}, {D4.size}, {N.size}")
    if not 2.0 <= budget <= 4.0:
        raise ConfigError(f"the average-bit budget must be in [2, 4], got {budget}")
    bits = np.full(N.size, 4, np.int8)
    act = np.flatnonzero(N > 0)
    if act.size == 0:
        return bits
    spare = (budget - 2.0) * N[act].sum() * (1 + 1e-12)  # extra bits above all-INT2
    if D3 is not None:
        D = np.stack([D2[act], np.asarray(D3, np.float64).reshape(-1)[act], D4[act]], axis=1)  # [tags, width 2/3/4]
        steps = _exhaustive3(D, N[act], spare) if act.size <= EXHAUSTIVE3_MAX else _greedy3(D, N[act], spare)
        bits[act] = 2 + steps
        return bits
    if act.size <= EXHAUSTIVE_MAX:
        up = _exhaustive(D2[act], D4[act], N[act], spare)
    else:
        up = _greedy(D2[act], D4[act], N[act], spare)
    bits[act] = np.where(up, 4, 2)
    return bits


def _exhaustive(D2, D4, N, spare) -> np.ndarray:
    n = N.size
    best = (np.inf, np.inf, 0)
    gain, cost = D2 - D4, 2.0 * N
    for start in range(0, 1 << n, BLOCK):
        idx = np.arange(start, min(start + BLOCK, 1 << n), dtype=np.int64)
        up = ((idx[:, None] >> np.arange(n)) & 1).astype(bool)
        extra = up.astype(np.float64) @ cost
        loss = D2.sum() - up.astype(np.float64) @ gain
        loss = np.where(extra <= spare, loss, np.inf)
        order = np.lexsort((idx, extra, loss))[0]
        cand = (loss[order], extra[order], int(idx[order]))
        if cand < best:
            best = cand
    return ((best[2] >> np.arange(n)) & 1).astype(bool)


def _exhaustive3(D, N, spare) -> np.ndarray:
    """Steps above 2 bits (0, 1, 2) per tag of the best assignment (ties: fewer
    bits, then the lowest assignment index in base 3)."""
    n = N.size
    best = (np.inf, np.inf, 0)
    powers = 3 ** np.arange(n, dtype=np.int64)
    for start in range(0, 3**n, BLOCK):
        idx = np.arange(start, min(start + BLOCK, 3**n), dtype=np.int64)
        steps = (idx[:, None] // powers) % 3  # [A, n]
        extra = steps.astype(np.float64) @ N
        loss = np.take_along_axis(np.broadcast_to(D, (idx.size, n, 3)), steps[..., None], axis=2)[..., 0].sum(axis=1)
        loss = np.where(extra <= spare, loss, np.inf)
        order = np.lexsort((idx, extra, loss))[0]
        best = min(best, (loss[order], extra[order], int(idx[order])))
    return (best[2] // powers) % 3


def _greedy3(D, N, spare) -> np.ndarray:
    steps = np.zeros(N.size, np.int64)
    while True:
        gains = [((D[k, steps[k]] - D[k, steps[k] + 1]) / N[k], k) for k in range(N.size) if steps[k] < 2 and N[k] <= spare]
        if not gains:
            return steps
        _, k = max(gains, key=lambda g: (g[0], -g[1]))
        steps[k] += 1
        spare -= N[k]


def _greedy(D2, D4, N, spare) -> np.ndarray:
    rho = (D2 - D4) / (2.0 * N)
    up = np.zeros(N.size, bool)
    for k in sorted(range(N.size), key=lambda k: (-rho[k], k)):
        if 2.0 * N[k] <= spare:
            up[k] = True
            spare -= 2.0 * N[k]
    return up


def tag_of_codes(codes, axes) -> np.ndarray:
    """Tag index of full tag codes (``triaxial_codes``) under ``axes`` (a subset of
    ``AXES``): the flat index over the kept axes, in ``AXES`` order."""
    codes = np.asarray(codes, np.int64)
    c, codes = np.divmod(codes, NUM_TRIAXIAL_CODES)
    t, rest = np.divmod(codes, len(Modal) * len(Semantic))
    m, s = np.divmod(rest, len(Semantic))
    values = {"temporal": t, "modal": m, "semantic": s, "copy": c}
    out = np.zeros_like(codes)
    for axis in AXES:
        if axis in axes:
            out = out * len(_ENUMS[axis]) + values[axis]
    return out


def tag_name(index: int, axes) -> str:
    """``"current|text|obs"`` style name of a tag index under ``axes``."""
    parts = []
    for axis in reversed([a for a in AXES if a in axes]):
        enum = _ENUMS[axis]
        index, v = divmod(index, len(enum))
        parts.append(enum(v).name.lower())
    return "|".join(reversed(parts)) or "all"


@dataclasses.dataclass(frozen=True)
class Allocation:
    """A calibrated tag table.

    Attributes:
      axes: the tag axes kept (``AXES`` or a subset: the ablations).
      tags: tag indices (``tag_of_codes``) with rows; N, D2, D4: per tag.
      budget: the calibrated average-bit budget B.
      D3: per tag, or None (a calibration without the INT3 tier: 2 or 4 bits).
      pinned: bits per tag (2, 3 or 4), or None; when set, the table at every
        budget (a hand-set allocation, module docstring).
      rewrite_history: the write rule the distortions were measured under (JSON
        ``"rewrite_history"``): each turn, before its prefill, the request's
        reused tokens still in the token region (INT4: teacher-forced or decoded
        replies, the leftovers of the page-completion rule) move into pages at
        their tag's bits in that turn's rendering, in whole pages
        (``jaxkv.serving.stages.quantization``). False: a token keeps the
        precision it was first written with.
      sink_tokens: the first ``sink_tokens`` positions of every request are written
        INT4 whatever their tag (JSON ``"sink_tokens"``, default 0), and the
        rewrite rule leaves them there: the attention sink (position 0, read by
        every query) kept out of the pages, where it would set a whole page's
        per-channel key ranges and lose up to half a step in each (issue 74's
        "outlier tokens may stay in higher precision", counted in stored bits).
      rewrite_from_float: with ``rewrite_history``, the rewrite's source (JSON
        ``"rewrite_from_float"``): the history's INT4 tokens at 2 or 3 bits among
        the last ``REFRESH_TOKENS`` cached ones
        (``jaxkv.serving.stages.quantization``) are prefilled again (the turn's
        reuse cut back to the first of them) and so written once, from float, at
        their bits; older ones are re-encoded from their INT4 values as before.
        Nothing more is stored: the recomputation replaces a second rounding.
    """

    axes: tuple
    tags: tuple
    N: tuple
    D2: tuple
    D4: tuple
    budget: float
    D3: tuple | None = None
    pinned: tuple | None = None
    rewrite_history: bool = False
    sink_tokens: int = 0
    rewrite_from_float: bool = False

    def __post_init__(self):
        if self.rewrite_from_float and not self.rewrite_history:
            raise ConfigError("rewrite_from_float is a source for the rewrite rule: it needs rewrite_history")

    def solve(self, budget: float) -> np.ndarray:
        """Bits per tag row at ``budget`` (``solve``; the pinned bits if any)."""
        if self.pinned is not None:
            if not 2.0 <= budget <= 4.0:
                raise ConfigError(f"the average-bit budget must be in [2, 4], got {budget}")
            return np.asarray(self.pinned, np.int8)
        return solve(self.D2, self.D4, self.N, budget, self.D3)

    @property
    def num_tags(self) -> int:
        n = 1
        for axis in self.axes:
            n *= len(_ENUMS[axis])
        return n

    def bits(self, budget: float | None = None) -> dict:
        """``{tag name: bits}`` at ``budget`` (default: the calibrated one)."""
        b = self.solve(self.budget if budget is None else budget)
        return {tag_name(t, self.axes): int(x) for t, x in zip(self.tags, b)}

    def table(self, budget: float | None = None) -> np.ndarray:
        """Bits of every full tag code ``[NUM_TAG_CODES]`` int8 (codes of tags
        without calibration rows: 4)."""
        return _table(self, self.budget if budget is None else float(budget))

    @classmethod
    def from_dict(cls, d: dict) -> "Allocation":
        axes = tuple(d["axes"])
        if not axes or any(a not in AXES for a in axes):
            raise ConfigError(f"allocation axes must be a subset of {AXES}, got {axes}")
        rows = d["tags"]
        has = lambda key: [key in r for r in rows]  # noqa: E731
        for key in ("D3", "bits"):
            if any(has(key)) and not all(has(key)):
                raise ConfigError(f"allocation rows must all have {key!r} or none")
        pinned = tuple(int(r["bits"]) for r in rows) if rows and all(has("bits")) else None
        if pinned is not None and not set(pinned) <= {2, 3, 4}:
            raise ConfigError(f"pinned bits must be 2, 3 or 4, got {sorted(set(pinned))}")
        return cls(
            axes,
            tuple(int(r["index"]) for r in rows),
            tuple(float(r["N"]) for r in rows),
            tuple(float(r["D2"]) for r in rows),
            tuple(float(r["D4"]) for r in rows),
            float(d["budget"]),
            tuple(float(r["D3"]) for r in rows) if rows and all(has("D3")) else None,
            pinned,
            bool(d.get("rewrite_history", False)),
            _sink_tokens(d.get("sink_tokens", 0)),
            bool(d.get("rewrite_from_float", False)),
        )


def _sink_tokens(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"sink_tokens must be a non-negative integer, got {n!r}")
    return n


FILE_LEVEL = ("rewrite_history", "sink_tokens", "rewrite_from_float")  # write rules a calibration file may state once for every variant


def variant_dict(data: dict, variant: str) -> dict:
    """The ``variant`` of a calibration file's dict (``data["variants"]``) with the
    file-level ``budget`` and write rules (``FILE_LEVEL``) where the variant has
    none; ``ConfigError`` if absent."""
    v = data.get("variants", {}).get(variant)
    if v is None:
        raise ConfigError(f"the allocation has no {variant!r} variant; it has {sorted(data.get('variants', {}))}")
    return {**{k: data[k] for k in FILE_LEVEL if k in data}, "budget": data["budget"], **v}


@functools.lru_cache(maxsize=64)
def _table(alloc: Allocation, budget: float) -> np.ndarray:
    bits = alloc.solve(budget)
    per_tag = np.full(alloc.num_tags, 4, np.int8)
    per_tag[list(alloc.tags)] = bits
    table = per_tag[tag_of_codes(np.arange(NUM_TAG_CODES), alloc.axes)]
    table.setflags(write=False)
    return table


def load_allocation(path, variant: str = "triaxial") -> Allocation:
    """The ``variant`` (``"triaxial"``, ``"triaxial_no_temporal"``,
    ``"triaxial_no_semantic"``, ``"triaxial_copy"``) of a calibration file;
    ``ConfigError`` if absent."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"no TriAxialKV calibration at {path}: run train/calibrate_triaxial.py for this model")
    data = json.loads(path.read_text())
    if variant not in data.get("variants", {}):
        raise ConfigError(f"{path} has no allocation {variant!r}; it has {sorted(data.get('variants', {}))}")
    return Allocation.from_dict(variant_dict(data, variant))
