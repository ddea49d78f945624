"""The reuse stage: cross-query KV segment reuse (ALGORITHMS.md §8-9), and CacheBlend.

Session options it owns: ``reuse`` (None, ``"none"``: prefix caching only but
measured, ``"segment"``, ``"cacheblend"``), ``tenant`` (whose segment namespace;
default ``"default"``) and ``ReuseConfig``'s fields (``reuse_layers=4, halo=8,
tau_seg=0.8, kl_epsilon=2.0, ...``). The radix prefix cache stays on in every mode: the stage
only sees the prompt suffix the radix match did not cover.

With other stages: a stage that reads prefill features (SnapKV's window queries,
H2O's and TOVA's attention mass, AgentKV's observed rows, RepairKV's query rows)
needs every prompt token through every layer, which a spliced token skips, so
those prefills run in full; their reports say so (``ReuseReport.skipped``) and
the replies are the session's without reuse. A policy that reads no prefill
feature (``streaming_llm``) splices as a session without one would, then evicts.
On a quantized pool the spliced prefill writes the token region (INT4; the KIVI
modes: float), and a triaxial session's tokens whose tags choose 2 bits then move to
INT2 pages (``Engine.requantize``), so reused tokens are stored at the precision
their tags choose.

Segment mode, per prompt (``before_prefill`` takes the prefill over):

1. **Match.** The suffix is cut into units (``segment_units``: windows inside the
   tagger's message spans); their MinHash signatures query the tenant's LSH index;
   each candidate is aligned on the suffix (``align``) and kept when its token match
   fraction is ``>= tau_seg`` and the MinHash Jaccard of the ``W`` tokens before it
   with its stored left context is ``>= tau_ctx``. Runs of equal tokens are
   assigned longest first; consecutive tokens from one origin at one position
   shift form a *span*. The last prompt token is never spliced.
2. **Splice.** For each span ``[p0, p1)``: the interior ``[p0 + h, p1 - h)`` gets
   the stored K/V of layers ``L_reuse = {0..n-1}`` (keys moved from their old
   positions by ``rope_delta``, exact: ALGORITHMS.md §8); interior tokens skip
   layers ``0..n-2``, run layer ``n-1`` from the stored residual at its input
   (their K/V there are the spliced ones) and every layer above. The ``h`` halo
   tokens at each end and all other tokens are recomputed through every layer.
   With ``n = L`` interior tokens run nothing (no layer reads their top output).
3. **Accept.** Probe: the first ``probe_tokens`` interior tokens. Reference path:
   the same tokens recomputed through every layer on scratch slots, reading only
   the row's keys before them (exact given everything before the span), cost
   ``probe_tokens x L`` token-layers; the spliced path already computed their
   logits. Accept iff every probed token's ``KL(ref || spliced) <= kl_epsilon``.
   Otherwise the row is truncated at the interior, which is recomputed in full
   (fallback), and the rejected segments are dropped from the store; the fresh
   computation replaces them (step 4) when no accepted splice precedes it. Both
   the probe and the wasted splice count in ``units`` (the savings ledger).
4. **Store.** Units of the exactly computed part of the suffix (before the first
   accepted splice) are stored (K/V of layers ``0..n-1`` gathered from the pool,
   the residual at layer ``n-1``'s input from the step), with their left context.

Why the residual is taken at the *input* of the last reused layer: the residual at
a layer's output depends on the context through that layer's attention, while the
K/V of a layer are a function of the residual at its input. Cutting there makes
``L_reuse = {0}`` exact (layer-0 K/V depend on the token and position only, and the
residual at its input is the embedding), and ``L_reuse = {0..n-1}`` reuses exactly
what the stored K/V were computed from.

CacheBlend (``reuse="cacheblend"``, Yao et al. 2024; LMCache): matched spans reuse
the K/V of every layer; layer 0 runs for every suffix token, the layer-1 key of
each reused token is recomputed and compared with its stored (rotated) key, and
the ``blend_ratio`` (15%) with the largest deviation are recomputed in layers
``1..L-1`` with the others' K/V spliced. No halo, no acceptance test.

``audit`` (evaluation only): after the prefill, the whole suffix is recomputed on
scratch slots and the next-token KL against it is recorded at the last prompt
token and, per accepted span, at the ``BOUNDARY`` tokens right after its spliced
interior (the right halo, then what follows; the boundary KL is their maximum); a
false accept is an accepted span whose boundary KL exceeds ``kl_epsilon``. The
audit's cost is excluded from the ledger and the prefill time.

Reports: one ``ReuseReport`` per prompt in ``stage.reports``.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from jaxkv.cache.segments import PromptIndex, align, minhash, segment_units
from jaxkv.engine.jobs import SpliceJob
from jaxkv.engine.splicing import key_deviation
from jaxkv.errors import ConfigError
from jaxkv.serving.stages.base import PrefillLogits, Stage, register
from jaxkv.splice import SplicePlan

MODES = ("none", "segment", "cacheblend")
BOUNDARY = 8  # audit: the recomputed tokens right after a reused interior whose KL is the boundary KL


@dataclasses.dataclass(frozen=True)
class ReuseConfig:
    """Reuse settings (session options of the same names).

    Attributes:
      mode: ``"none"`` (prefix caching only, measured), ``"segment"``, ``"cacheblend"``.
      reuse_layers: n: ``L_reuse = {0..n-1}`` (an int, or that set; clipped to
        the model's depth: the default, the lower 4 layers, is every layer of the
        embedded model).
      halo: h, tokens recomputed at each end of a spliced span.
      tau_seg: minimum token match fraction of a candidate at its alignment.
      tau_ctx: minimum MinHash Jaccard of the ``W``-token left contexts.
      ctx_window: W. seg_window / seg_stride: unit windows inside anchors.
      shingle: k of the token k-shingles.
      probe_tokens: interior tokens the acceptance test probes per span.
      kl_epsilon: acceptance threshold on KL(reference || spliced), nats. The
        default was calibrated on pilot sessions (other seeds than the report's):
        clean matches gave a median probe KL of 0.2-0.6 nats with boundary KL
        under 0.15 even when every span was accepted, corrupted segments give
        KL > 5 (``docs/reuse.md``).
      min_interior: spans whose interior is shorter are not spliced.
      blend_ratio: CacheBlend's recomputed fraction of reused tokens.
      audit: record KL against a full recompute (evaluation; costly).
    """

    mode: str = "segment"
    reuse_layers: int = 4
    halo: int = 8
    tau_seg: float = 0.8
    tau_ctx: float = 0.0
    ctx_window: int = 32
    seg_window: int = 128
    seg_stride: int = 64
    shingle: int = 6
    probe_tokens: int = 4
    kl_epsilon: float = 2.0
    min_interior: int = 16
    blend_ratio: float = 0.15
    audit: bool = False

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"unknown reuse mode {self.mode!r}; known: None, {', '.join(MODES)}")
        n = self.reuse_layers
        if not isinstance(n, (int, np.integer)):
            layers = sorted(int(i) for i in n)
            if layers != list(range(len(layers))) or not layers:
                raise ConfigError(f"L_reuse must be the lower layers {{0..n-1}}, got {n!r}")
            object.__setattr__(self, "reuse_layers", len(layers))
        if self.reuse_layers < 1 or self.halo < 0 or self.probe_tokens < 1 or self.min_interior < self.probe_tokens:
            raise ConfigError(f"bad reuse sizes: {self}")
        if not (0.0 <= self.tau_seg <= 1.0 and 0.0 <= self.tau_ctx <= 1.0 and 0.0 < self.blend_ratio <= 1.0 and self.kl_epsilon >= 0):
            raise ConfigError(f"bad reuse thresholds: {self}")
        if self.shingle < 1 or self.ctx_window < 0 or not 0 < self.seg_stride <= self.seg_window:
            raise ConfigError(f"bad reuse windows: {self}")

    def namespace(self, num_layers: int) -> tuple:
        """What a stored segment's arrays mean (segments of other layouts never match)."""
        n = num_layers if self.mode == "cacheblend" else min(self.reuse_layers, num_layers)
        return (self.mode, n, self.ctx_window, self.shingle)


def _precision(turn) -> tuple:
    """The session's KV precision, part of a segment's namespace: a segment holds
    the pool's float view of rows written at that precision, so sessions of
    another precision (or the float pool) never splice it."""
    quant = turn.session.quantization
    return (None, None) if quant is None else (quant.mode, quant.budget)


@dataclasses.dataclass
class ReuseReport:
    """One prompt prefill under reuse.

    Attributes:
      suffix_tokens: tokens the radix prefix did not cover. units: token x layer
        units computed (probe references and wasted splices included);
        full_units: ``suffix_tokens x L`` (prefix caching alone).
      spans / accepted / rejected: spans tried, accepted, rejected by the test;
        matched_tokens: tokens of the spans tried.
      spliced_tokens: interior tokens kept spliced. probe_kl: max probe KL per
        span tried; ctx_jaccard: its left-context Jaccard.
      boundary_kl / last_kl: audit KL, per accepted span the maximum over the
        ``BOUNDARY`` tokens after its interior, and at the last prompt token.
      false_accepts: accepted spans whose boundary KL exceeds ``kl_epsilon`` (audit).
      stored: segments stored. prefill_s: wall time of the prefill (audit excluded).
      skipped: why the prefill ran in full instead (None: it went through reuse).
    """

    suffix_tokens: int
    units: int = 0
    full_units: int = 0
    spans: int = 0
    accepted: int = 0
    rejected: int = 0
    matched_tokens: int = 0
    spliced_tokens: int = 0
    probe_kl: list = dataclasses.field(default_factory=list)
    ctx_jaccard: list = dataclasses.field(default_factory=list)
    boundary_kl: list = dataclasses.field(default_factory=list)
    last_kl: float | None = None
    false_accepts: int = 0
    stored: int = 0
    skipped: str | None = None
    prefill_s: float = 0.0


@dataclasses.dataclass
class Span:
    """Consecutive prompt positions ``[p0, p1)`` served by stored segments of one
    origin at one position shift, with their per-token stored arrays."""

    p0: int
    p1: int
    old_pos: np.ndarray
    k: np.ndarray  # [n, m, Hkv, D]
    v: np.ndarray
    resid: np.ndarray | None  # [m, M]
    segments: list
    ctx: float = 1.0  # left-context Jaccard of its first segment


def kl_divergence(ref_logits, logits) -> np.ndarray:
    """``KL(softmax(ref) || softmax(x))`` per row, float64 nats."""
    a, b = np.asarray(ref_logits, np.float64), np.asarray(logits, np.float64)
    la = a - a.max(-1, keepdims=True)
    la -= np.log(np.exp(la).sum(-1, keepdims=True))
    lb = b - b.max(-1, keepdims=True)
    lb -= np.log(np.exp(lb).sum(-1, keepdims=True))
    return (np.exp(la) * (la - lb)).sum(-1)


class ReuseStage(Stage):
    """Segment reuse / CacheBlend for one session (module docstring)."""

    name = "reuse"

    def __init__(self, config: ReuseConfig, tenant: str):
        self.config = config
        self.tenant = tenant
        self.reports: list[ReuseReport] = []
        self.last_logits: np.ndarray | None = None  # next-token logits of the latest spliced prompt
        self._origin = 0

    def before_prefill(self, turn, job):
        needs = [
            name
            for name, on in (
                ("query rows", job.q_idx_X is not None),
                ("attention mass", job.attn_mass),
                ("every logit", job.logits == "all"),
            )
            if on
        ]
        if needs:
            # Another stage (a retention policy's scorer, a replay's logits) reads
            # prefill features that spliced tokens never produce (they skip the
            # lower layers): this prefill runs in full, and the report says why.
            full = int(job.tokens.size) * turn.engine.model.config.num_layers
            self.reports.append(ReuseReport(int(job.tokens.size), units=full, full_units=full, skipped=" and ".join(needs)))
            return None
        return self._handler(turn, job)

    # -- the prefill ---------------------------------------------------------------------
    def _handler(self, turn, job):
        """The prompt's prefill, run by this stage: spliced steps (``SpliceJob``,
        which the scheduler runs between its steps), or the job as it is."""
        t0 = time.perf_counter()
        n_layers = turn.engine.model.config.num_layers
        rep = ReuseReport(int(job.tokens.size))
        rep.full_units = rep.suffix_tokens * n_layers
        if self.config.mode == "none":
            job = yield from turn.run(job)
            rep.units = rep.full_units
            rep.prefill_s = time.perf_counter() - t0
            self.reports.append(rep)
            return job
        self._origin = id(turn) ^ int(t0 * 1e6)
        if self.config.mode == "segment":
            logits, audit_s = yield from self._segment(turn, rep)
        else:
            logits, audit_s = yield from self._cacheblend(turn, rep)
        if job.kv_bits is not None:  # a triaxial session: its tags' 2-bit tokens go to INT2 pages now
            turn.engine.kv.requantize(turn.row, np.arange(turn.reused, turn.reused + job.tokens.size), job.kv_bits)
        rep.prefill_s = time.perf_counter() - t0 - audit_s
        self.reports.append(rep)
        self.last_logits = logits
        return PrefillLogits(logits)

    def _splice(self, turn, plan, mode: str = "append"):
        """One spliced step, yielded to the scheduler: ``(logits, resid)``."""
        work = yield from turn.run(SpliceJob(turn.row, plan, mode))
        return work.result

    def _segment(self, turn, rep: ReuseReport):
        cfg = self.config
        engine, row, ids = turn.engine, turn.row, turn.rendered.ids
        L = engine.model.config.num_layers
        n_reuse = min(cfg.reuse_layers, L)
        cut = n_reuse - 1
        start, n = turn.reused, ids.size
        store, ns = turn.server.segments, cfg.namespace(L) + (_precision(turn),)
        spans = self._match(turn, ns, min_len=2 * cfg.halo + cfg.min_interior)
        resid = np.zeros((n - start, engine.model.config.hidden_size), np.float32)
        got: dict[int, np.ndarray] = {}  # position -> spliced-path logits (audit)
        want: set[int] = set()
        exact_until, cursor = n, start
        accepted_spans, stale = [], []
        for span in spans:
            s, e = span.p0 + cfg.halo, span.p1 - cfg.halo
            if s < cursor:
                continue
            rep.spans += 1
            rep.matched_tokens += span.p1 - span.p0
            rep.ctx_jaccard.append(span.ctx)
            T = e - cursor
            inter = np.arange(s - cursor, T)
            a_idx = np.arange(s - cursor)
            probe = inter[: cfg.probe_tokens]
            b_idx = np.arange(T) if n_reuse < L else np.concatenate([a_idx, probe])
            from_store = b_idx >= s - cursor
            b_resid = np.zeros((b_idx.size, resid.shape[1]), np.float32)
            j = b_idx[from_store] - (span.p0 - cursor)
            b_resid[from_store] = span.resid[j]
            kv_j = inter - (span.p0 - cursor)
            extra = [p - cursor for p in want if cursor <= p < s]
            plan = SplicePlan(
                ids[cursor:e],
                cut,
                a_idx,
                b_idx,
                b_resid=b_resid,
                b_cut_write=~from_store,
                kv_idx=inter,
                kv_lo=0,
                kv_hi=n_reuse,
                kv_k=span.k[:, kv_j],
                kv_v=span.v[:, kv_j],
                kv_old_pos=span.old_pos[kv_j],
                logit_idx=np.concatenate([probe, np.asarray(extra, np.int64)]),
            )
            logits, res_a = yield from self._splice(turn, plan)
            rep.units += plan.units(L)
            resid[cursor - start : s - start] = res_a
            for i, p in enumerate(extra):
                got[cursor + p] = logits[probe.size + i]
            ref_plan = SplicePlan.full(ids[s : s + probe.size], L, logit_idx=np.arange(probe.size))
            ref_plan.base = s
            ref, _ = yield from self._splice(turn, ref_plan, "probe")
            rep.units += ref_plan.units(L)
            kl = float(kl_divergence(ref, logits[: probe.size]).max())
            rep.probe_kl.append(kl)
            if kl <= cfg.kl_epsilon:
                rep.accepted += 1
                rep.spliced_tokens += e - s
                exact_until = min(exact_until, s)
                accepted_spans.append((span, e))
                for seg in span.segments:
                    store.touch(seg)
                want.update(range(e, min(e + BOUNDARY, n)))
                cursor = e
            else:
                rep.rejected += 1
                engine.kv.truncate_row(row, s)
                stale += span.segments
                cursor = s
        extra = sorted(p - cursor for p in want if p >= cursor)
        last = n - 1 - cursor
        plan = SplicePlan.full(ids[cursor:n], cut, logit_idx=[*extra, last])
        logits, res_a = yield from self._splice(turn, plan)
        rep.units += plan.units(L)
        resid[cursor - start :] = res_a
        for i, p in enumerate(extra):
            got[cursor + p] = logits[i]
        got[n - 1] = logits[-1]
        for seg in dict.fromkeys(stale):
            store.remove(seg)  # replaced by the fresh computation below
        rep.stored = self._store(turn, ns, start, exact_until, n_reuse, resid)
        audit_s = (yield from self._audit(turn, rep, got, [range(e, e + BOUNDARY) for _, e in accepted_spans])) if cfg.audit else 0.0
        return got[n - 1], audit_s

    def _cacheblend(self, turn, rep: ReuseReport):
        cfg = self.config
        engine, row, ids = turn.engine, turn.row, turn.rendered.ids
        L = engine.model.config.num_layers
        start, n = turn.reused, ids.size
        T = n - start
        store, ns = turn.server.segments, cfg.namespace(L) + (_precision(turn),)
        spans = self._match(turn, ns, min_len=cfg.min_interior)
        # step 1: layer 0 for every suffix token (K/V exact: they depend on token and position)
        plan1 = SplicePlan(ids[start:n], 1, np.arange(T), np.zeros(0, np.int64))
        _, x1 = yield from self._splice(turn, plan1)
        rep.units += T
        reused = np.concatenate([np.arange(sp.p0, sp.p1) for sp in spans]) - start if spans else np.zeros(0, np.int64)
        got: dict[int, np.ndarray] = {}
        if reused.size:
            k1 = np.concatenate([sp.k[1] for sp in spans], axis=0)
            old = np.concatenate([sp.old_pos for sp in spans])
            dev = key_deviation(engine, x1[reused], reused + start, k1, old, layer=1)
            n_sel = int(math.ceil(cfg.blend_ratio * reused.size))
            selected = np.sort(reused[np.argsort(-dev, kind="stable")[:n_sel]])
            keep = np.setdiff1d(reused, selected)  # spliced in layers 1..L-1
            keep_rows = np.searchsorted(reused, keep)
            kv_k = np.concatenate([sp.k[1:] for sp in spans], axis=1)[:, keep_rows]
            kv_v = np.concatenate([sp.v[1:] for sp in spans], axis=1)[:, keep_rows]
            b_idx = np.setdiff1d(np.arange(T), keep)
            computed = set(b_idx.tolist())
            want = sorted({p - start for sp in spans for p in range(sp.p1, sp.p1 + BOUNDARY) if p - start in computed and p < n - 1})
            plan2 = SplicePlan(
                ids[start:n],
                1,
                np.zeros(0, np.int64),
                b_idx,
                b_resid=x1[b_idx],
                kv_idx=keep,
                kv_lo=1,
                kv_hi=L,
                kv_k=kv_k,
                kv_v=kv_v,
                kv_old_pos=old[keep_rows],
                logit_idx=np.asarray([*want, T - 1], np.int64),
                base=start,
            )
            logits, _ = yield from self._splice(turn, plan2, "rewrite")
            rep.units += plan2.units(L)
            for i, p in enumerate(want):
                got[start + p] = logits[i]
            rep.spans = rep.accepted = len(spans)
            rep.matched_tokens = int(reused.size)
            rep.spliced_tokens = int(keep.size)
            for sp in spans:
                for seg in sp.segments:
                    store.touch(seg)
            exact_until = spans[0].p0
        else:
            plan2 = SplicePlan(ids[start:n], 1, np.zeros(0, np.int64), np.arange(T), b_resid=x1, logit_idx=[T - 1], base=start)
            logits, _ = yield from self._splice(turn, plan2, "rewrite")
            rep.units += plan2.units(L)
            exact_until = n
        got[n - 1] = logits[-1]
        rep.stored = self._store(turn, ns, start, exact_until, L, None)
        audit_s = (yield from self._audit(turn, rep, got, [range(sp.p1, sp.p1 + BOUNDARY) for sp in spans])) if cfg.audit else 0.0
        return got[n - 1], audit_s

    # -- matching --------------------------------------------------------------------------
    def _anchors(self, turn) -> list[tuple[int, int]]:
        return [(m.content_start, m.content_end) for m in turn.rendered.messages]

    def _match(self, turn, ns, *, min_len: int) -> list[Span]:
        """Spans of the suffix served by stored segments (module docstring, step 1)."""
        cfg = self.config
        ids, start = turn.rendered.ids, turn.reused
        n = ids.size
        store = turn.server.segments
        hi = n - 1  # the last prompt token is always computed
        # query units at half the storage stride: a stored window then overlaps some
        # query window by at least 3/4 of its length, whatever the shift
        units = segment_units(
            n, self._anchors(turn), start, hi, window=cfg.seg_window, stride=max(cfg.seg_stride // 2, 1), min_len=max(min_len, cfg.shingle)
        )
        if not units or not store.segments(self.tenant, ns):
            return []
        cands = store.candidates(self.tenant, ns, [minhash(ids[a:b], cfg.shingle) for a, b in units])
        if not cands:
            return []
        prompt = PromptIndex(ids, start, hi, cfg.shingle)
        ctx_sigs: dict[int, object] = {}
        ctx_of: dict[int, float] = {}
        runs = []
        for seg in cands:
            for al in align(seg, prompt, min_run=min_len):
                if al.similarity < cfg.tau_seg:
                    continue
                o = al.offset
                if o not in ctx_sigs:
                    ctx_sigs[o] = minhash(ids[max(0, o - cfg.ctx_window) : max(0, o)], cfg.shingle)
                ctx = ctx_sigs[o].jaccard(seg.ctx_sig)
                if ctx < cfg.tau_ctx:
                    continue
                ctx_of[seg.id] = ctx
                for j0, j1 in al.runs:
                    runs.append((j1 - j0, -seg.id, seg, al.offset, j0, j1))
        runs.sort(key=lambda r: (-r[0], r[1]))
        src_seg: list = [None] * n
        src_j = np.zeros(n, np.int64)
        for _, _, seg, o, j0, j1 in runs:
            for j in range(j0, j1):
                p = o + j
                if start <= p < hi and src_seg[p] is None:
                    src_seg[p], src_j[p] = seg, j
        spans, p = [], start
        while p < hi:
            seg = src_seg[p]
            if seg is None:
                p += 1
                continue
            q = p + 1
            shift = int(seg.positions[src_j[p]]) - p
            while (
                q < hi and src_seg[q] is not None and src_seg[q].origin == seg.origin and int(src_seg[q].positions[src_j[q]]) - q == shift
            ):
                q += 1
            if q - p >= min_len:
                spans.append(self._span(src_seg, src_j, p, q))
                spans[-1].ctx = ctx_of[seg.id]
            p = q
        return spans

    @staticmethod
    def _span(src_seg, src_j, p0: int, p1: int) -> Span:
        pieces, segs, p = [], [], p0
        while p < p1:
            seg, q = src_seg[p], p + 1
            while q < p1 and src_seg[q] is seg and src_j[q] == src_j[q - 1] + 1:
                q += 1
            j0, j1 = int(src_j[p]), int(src_j[p]) + q - p
            pieces.append((seg, j0, j1))
            segs.append(seg)
            p = q
        k = np.concatenate([s.k[:, j0:j1] for s, j0, j1 in pieces], axis=1)
        v = np.concatenate([s.v[:, j0:j1] for s, j0, j1 in pieces], axis=1)
        resid = None if pieces[0][0].resid is None else np.concatenate([s.resid[j0:j1] for s, j0, j1 in pieces])
        old = np.concatenate([s.positions[j0:j1] for s, j0, j1 in pieces])
        return Span(p0, p1, old, k, v, resid, list(dict.fromkeys(segs)))

    # -- storing -----------------------------------------------------------------------------
    def _store(self, turn, ns, start: int, stop: int, n_layers: int, resid) -> int:
        """Store the units of the exactly computed positions ``[start, stop)``."""
        cfg = self.config
        ids = turn.rendered.ids
        units = segment_units(
            ids.size,
            self._anchors(turn),
            start,
            stop,
            window=cfg.seg_window,
            stride=cfg.seg_stride,
            min_len=max(2 * cfg.halo + cfg.min_interior, cfg.shingle),
        )
        if not units:
            return 0
        lo, hi = min(a for a, _ in units), max(b for _, b in units)
        slots = turn.req.slots[lo:hi]
        k, v = turn.engine.kv.gather_float(slots)  # float K/V, whatever the pool stores
        store, stored = turn.server.segments, 0
        for a, b in units:
            seg = store.add(
                self.tenant,
                ns,
                ids[a:b],
                np.arange(a, b),
                k[:n_layers, a - lo : b - lo],
                v[:n_layers, a - lo : b - lo],
                None if resid is None else resid[a - start : b - start],
                minhash(ids[a:b], cfg.shingle),
                minhash(ids[max(0, a - cfg.ctx_window) : a], cfg.shingle),
                origin=self._origin,
            )
            stored += seg is not None
        return stored

    # -- audit --------------------------------------------------------------------------------
    def _audit(self, turn, rep: ReuseReport, got: dict, boundaries) -> float:
        t0 = time.perf_counter()
        ids, start, n = turn.rendered.ids, turn.reused, turn.rendered.ids.size
        pos = sorted(got)
        plan = SplicePlan.full(ids[start:n], turn.engine.model.config.num_layers, logit_idx=[p - start for p in pos])
        plan.base = start
        ref, _ = yield from self._splice(turn, plan, "probe")
        kl = dict(zip(pos, kl_divergence(ref, np.stack([got[p] for p in pos])).tolist()))
        rep.last_kl = kl[n - 1]
        for positions in boundaries:
            near = [kl[p] for p in positions if p in kl]
            if near:
                rep.boundary_kl.append(max(near))
                rep.false_accepts += max(near) > self.config.kl_epsilon
        return time.perf_counter() - t0


# ============================================================================ options
OPTION_NAMES = tuple(f.name for f in dataclasses.fields(ReuseConfig) if f.name != "mode")


def _factory(session, options: dict, built: list):
    mode = options.pop("reuse", None)
    tenant = options.pop("tenant", None)
    fields = {k: options.pop(k) for k in list(options) if k in OPTION_NAMES}
    if "L_reuse" in options:
        fields["reuse_layers"] = options.pop("L_reuse")
    if mode is None:
        if fields:
            raise ConfigError(f"reuse options {', '.join(sorted(fields))} need reuse='segment' or 'cacheblend'")
        return None
    if tenant is not None and not isinstance(tenant, str):
        raise ConfigError(f"tenant must be a string, got {tenant!r}")
    return ReuseStage(ReuseConfig(mode=mode, **fields), tenant if tenant is not None else "default")


register("reuse", 10, _factory)
