"""KV accounting, as defined in IntentKV §4.1 (all lower-is-better except hits).

Per decode step ``t`` of a request let ``R_t`` be the raw (pre-pruning) attended-to
set, i.e. every position of the uncompressed request the new token would attend
to (itself included), and ``E_t ⊆ R_t`` the effective subset that survives pruning
and is actually read. Per request:

  * ``peak_request_tokens`` (PT): max of the prompt length and ``|R_t|`` over its
    steps -- the uncompressed request size, a memory-footprint upper bound;
  * ``peak_live_kv``: max of ``|E_t|`` over its steps and of every live-KV size the
    engine reports with ``on_live`` (after prefill, after a compression event);
  * ``raw_kv_reads``: ``sum_t |R_t|``;  ``effective_kv_reads``: ``sum_t |E_t|``;
  * ``prefix_hit_tokens``: prompt tokens whose K/V came from the radix cache (holes
    in the matched prefix count: they were neither recomputed nor read);
  * ``wall_s``: seconds from ``start_request`` to ``end_request`` (0 while open).

Per session and overall, over the requests started so far: the two peaks are
maxima, reads, hit tokens and wall time are sums, and
``prefix_hit_rate = sum(prefix_hit_tokens) / sum(prompt_tokens)`` (0 when no
prompt tokens). ``as_dict()`` returns exactly the keys ``METRIC_KEYS``.

Usage by the engine, one request at a time (pass ``request=`` when several are
open)::

    m.start_request(prompt_tokens=len(ids), prefix_hit_tokens=match.length, session_id=sid)
    m.on_live(live_after_prefill)
    for each decode step: m.on_decode_step(raw_attended, effective_attended)
    m.end_request()
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Hashable, Iterable

METRIC_KEYS = (
    "peak_request_tokens",
    "peak_live_kv",
    "raw_kv_reads",
    "effective_kv_reads",
    "prefix_hit_tokens",
    "prefix_hit_rate",
    "wall_s",
)


@dataclasses.dataclass
class RequestMetrics:
    """Counters of one request (see the module docstring for definitions)."""

    session_id: Hashable
    prompt_tokens: int
    prefix_hit_tokens: int
    started_at: float
    peak_request_tokens: int = 0
    peak_live_kv: int = 0
    raw_kv_reads: int = 0
    effective_kv_reads: int = 0
    decode_steps: int = 0
    wall_s: float = 0.0
    open: bool = True

    def on_live(self, live_kv: int) -> None:
        self.peak_live_kv = max(self.peak_live_kv, _count(live_kv, "live_kv"))

    def on_decode_step(self, raw_attended: int, effective_attended: int) -> None:
        raw, eff = _count(raw_attended, "raw_attended"), _count(effective_attended, "effective_attended")
        if eff > raw:
            raise ValueError(f"effective attended set ({eff}) larger than the raw one ({raw})")
        self.raw_kv_reads += raw
        self.effective_kv_reads += eff
        self.peak_request_tokens = max(self.peak_request_tokens, raw)
        self.peak_live_kv = max(self.peak_live_kv, eff)
        self.decode_steps += 1


class Metrics:
    """KV accounting over requests, grouped by session."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self.requests: list[RequestMetrics] = []

    # -- engine hooks --------------------------------------------------------------
    def start_request(self, prompt_tokens: int, prefix_hit_tokens: int = 0, session_id: Hashable = None) -> RequestMetrics:
        prompt, hits = _count(prompt_tokens, "prompt_tokens"), _count(prefix_hit_tokens, "prefix_hit_tokens")
        if hits > prompt:
            raise ValueError(f"prefix hits ({hits}) exceed the prompt ({prompt} tokens)")
        req = RequestMetrics(session_id, prompt, hits, self._clock(), peak_request_tokens=prompt)
        self.requests.append(req)
        return req

    def on_live(self, live_kv: int, request: RequestMetrics | None = None) -> None:
        self._open(request).on_live(live_kv)

    def on_decode_step(self, raw_attended: int, effective_attended: int, request: RequestMetrics | None = None) -> None:
        self._open(request).on_decode_step(raw_attended, effective_attended)

    def end_request(self, request: RequestMetrics | None = None) -> RequestMetrics:
        req = self._open(request)
        req.wall_s = self._clock() - req.started_at
        req.open = False
        return req

    # -- reading -------------------------------------------------------------------
    def sessions(self) -> list[Hashable]:
        """Session ids in order of first appearance."""
        return list(dict.fromkeys(r.session_id for r in self.requests))

    def as_dict(self, session_id: Hashable = ...) -> dict[str, float]:
        """Aggregates over all requests, or over one session's if ``session_id`` is given."""
        reqs = self.requests if session_id is ... else [r for r in self.requests if r.session_id == session_id]
        return aggregate(reqs)

    def table(self) -> str:
        """One row per session and a total row."""
        header = ("session", "requests", *METRIC_KEYS)
        rows = []
        for sid in self.sessions():
            rows.append((str(sid), sum(r.session_id == sid for r in self.requests), *self.as_dict(sid).values()))
        rows.append(("TOTAL", len(self.requests), *self.as_dict().values()))
        cells = [header] + [tuple(_fmt(v) for v in row) for row in rows]
        widths = [max(len(row[c]) for row in cells) for c in range(len(header))]
        return "\n".join("  ".join(cell.rjust(w) if c else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths))) for row in cells)

    __str__ = table

    def _open(self, request: RequestMetrics | None) -> RequestMetrics:
        if request is not None:
            if not request.open:
                raise ValueError("request already ended")
            return request
        open_reqs = [r for r in self.requests if r.open]
        if len(open_reqs) != 1:
            raise ValueError(f"{len(open_reqs)} requests are open; pass request= to say which")
        return open_reqs[0]


def aggregate(requests: Iterable[RequestMetrics]) -> dict[str, float]:
    """The ``METRIC_KEYS`` aggregates of ``requests`` (module docstring)."""
    reqs = list(requests)
    prompt = sum(r.prompt_tokens for r in reqs)
    hits = sum(r.prefix_hit_tokens for r in reqs)
    return {
        "peak_request_tokens": max((r.peak_request_tokens for r in reqs), default=0),
        "peak_live_kv": max((r.peak_live_kv for r in reqs), default=0),
        "raw_kv_reads": sum(r.raw_kv_reads for r in reqs),
        "effective_kv_reads": sum(r.effective_kv_reads for r in reqs),
        "prefix_hit_tokens": hits,
        "prefix_hit_rate": hits / prompt if prompt else 0.0,
        "wall_s": sum(r.wall_s for r in reqs),
    }


def _count(value, name: str) -> int:
    n = int(value)
    if n < 0 or n != value:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return n


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)
