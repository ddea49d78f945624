"""Retention methods on a real model, every cell branched from one prefill (issue #32).

    JAX_PLATFORMS=cpu python -m eval.quality.real_model --model smollm2-135m-instruct \\
        --task passkey --context 2048 --n 100 --ratios 0.25,0.5,0.75 \\
        --out eval/results/real_smollm2/jaxkv --resume

Protocol (the one kvpress uses, so the two sides run the same examples the same
way; ``eval.quality.kvpress_side`` is the other side): each example's ``token_plan``
(``jaxkv.tasks.haystack``) splits its ids into the request that is compressed
once, the ``rest`` fed after it (question-agnostic: the acknowledgement and the
question's turn) and the ``answer``. A cell compresses the request's KV once,
when its prefill ends, to ``budget_for_ratio`` live tokens, then feeds the rest
and the answer with no further event:

* teacher forced: the answer's digit tokens' exact argmax (``tf_correct``) and
  their mean NLL (``answer_nll``). The answer's other tokens are given, not
  scored: SmolLM2 writes a space token before a number, and a cell whose argmax
  there is another word (" a unique identifier ...") still scores its digits.
  That is where greedy and teacher-forced scores part (question-agnostic passkey:
  every such gap, all methods);
* greedy: up to ``haystack.reply_budget`` tokens from the same cache, scored by
  ``reply_correct`` (``gen_correct``). Greedy decoding emits the answer's tokens for
  as long as each is the argmax of its teacher-forced row (by induction on the
  position), so it starts from the first answer token that is not, with the
  answer's agreeing prefix already in the cache; a reply whose every answer token
  agrees is the answer itself, which names every value (``reply`` then stops at
  the answer's end; ``decoded`` counts the tokens actually decoded). The only
  difference from decoding every token is that the agreeing prefix's keys come
  from a prefill instead of decode steps (float32 rounding);
* ``lm``: the mean NLL of the continuation and the mean KL(full || cell) per
  token, against the full cache's logits of the same run.

Settings: ``aware`` (the question is in the compressed request, inside every
observation window) and ``agnostic`` (the document is turn 1, compressed when its
prefill ends; the question arrives in turn 2). ``protect_query=False`` in both,
so jaxkv may evict inside the question as kvpress may; the protected prefix
(the system prompt) stays pinned, as in every jaxkv session.

Several questions over one context (``multiq``, ``jaxkv.tasks.multiq``): the same
compression event once the compressed request's prefill ends, then every question
answered from that one cache, in conversation order: each question's turn fed and
its answer scored both ways as above, then the reference answer left in the cache
(teacher-forced history) before the next question; no event fires after the first.
A cell records each question (``questions``, with its fact's kind) and, as its own
``tf_correct``, ``gen_correct`` and ``answer_nll``, their means over the questions
(``multiq.cell_record``, the same on kvpress's side).

One prefill per (example, setting), every cell branched from it: the request is
prefilled once by a session whose probe stage captures the union of what every
cell's policy observes (window queries, attention mass, phase rows). Each cell
then builds its own ``RetentionStage`` and runs its compression event on those
features, exactly as the stage does at the end of a prefill, measures, and the
engine rolls back (``Engine.checkpoint`` / ``rollback``) for the next cell.
``tests/test_real_model_eval.py`` checks that a branched cell equals a session
running that policy alone. Cells: the full cache, then each method x ratio.

KV quantization (issue #26, ``--kv-quant int4,kivi2``): instead of retention
cells, each example runs once per KV format in a session of its own, full cache,
no compression: the float pool first (cell ``full``, the reference of the ``lm``
KL), then ``kv:<format>``, each measured as above. Journal ``quant.jsonl``. Two
prefill protocols (``--quant-prefill``):

* ``chunked`` (default; what a jaxkv server does): each format's session
  prefills the request itself, in 512-token chunks, each chunk attending to the
  *dequantized* earlier chunks, so the formats cannot share a prefill;
* ``imported`` (the papers' protocol: KIVI and transformers' quantized cache
  prefill in full precision and store the result quantized): the float cell's
  prefill is the only forward; its K/V and last logits are imported into each
  format's pool (``jaxkv.engine.KVSource``) as that format's prefill of the
  whole request in one chunk would store them (bit for bit:
  ``tests/test_triaxial.py``), then the rest is measured on the quantized cache.
  A format's cell costs its measure alone. Cells ``kv:<format>/imported``.

Journal: one JSON line per finished (task, length, seed, setting) in
``OUT/examples.jsonl`` with every cell; ``--resume`` skips what is there.
``--journal examples_<name>.jsonl`` runs more methods on the same examples into a
journal of their own (the report merges every ``examples*.jsonl`` by example).
``--repair`` journals ``OUT/sessions.jsonl``; its ``--resume`` skips the trio's cells
an example already has, so another K or method on the same examples appends only
its own cells (the no-repair cell ``session:<method>@<ratio>`` is shared).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from jaxkv.serving.stages.base import Capture, Stage
from jaxkv.tasks import haystack
from jaxkv.tasks import real as real_tasks

METHODS = ("snapkv", "tova", "h2o", "streaming_llm", "random", "agentkv", "intentkv_memory", "intentkv_query")
RATIOS = (0.25, 0.5, 0.75)
MAX_NEW = 48  # the cap of a greedy reply (haystack.reply_budget sets each reply's own)


def budget_for_ratio(ratio: float, n_request: int) -> int:
    """Live tokens a cell keeps of an ``n_request``-token compressed request at
    kvpress's ``compression_ratio`` (the fraction removed): kvpress keeps
    ``int(n * (1 - ratio))`` tokens in every layer and head; jaxkv keeps that
    many tokens for all of them."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"ratio must be in [0, 1), got {ratio}")
    return max(1, int(n_request * (1.0 - ratio)))


SET_OPTIONS = ("keep_sets", "layer_budgets")  # a Cell option choosing the kept set's granularity, not a policy field
GRANULARITIES = {"layer": (("keep_sets", "layer"),), "pyramid": (("keep_sets", "layer"), ("layer_budgets", "pyramid"))}


@dataclasses.dataclass(frozen=True)
class Cell:
    """One branch: a retention method at a ratio (``method=None``: the full cache),
    with the policy's config fields in ``options`` (``(("w", 64),)``; empty: defaults)
    and, there too, ``keep_sets`` / ``layer_budgets`` (per-layer keep sets: the
    cell's name ends in ``/layer`` or ``/pyramid``; ``--methods snapkv:layer``)."""

    method: str | None
    ratio: float = 0.0
    options: tuple = ()

    @property
    def name(self) -> str:
        if self.method is None:
            return "full"
        opts = dict(self.options)
        sets = "" if opts.get("keep_sets", "model") == "model" else "/" + ("pyramid" if opts.get("layer_budgets") == "pyramid" else "layer")
        return f"{self.method}{sets}@{self.ratio:g}"

    @property
    def per_layer(self) -> bool:
        return dict(self.options).get("keep_sets") == "layer"

    @classmethod
    def parse(cls, spec: str, ratio: float) -> "Cell":
        """``"snapkv"``, or ``"snapkv:layer"`` / ``"snapkv:pyramid"`` (per-layer sets)."""
        method, _, sets = spec.partition(":")
        if sets and sets not in GRANULARITIES:
            raise SystemExit(f"unknown kept-set granularity {sets!r} in {spec!r}; known: {', '.join(GRANULARITIES)}")
        return cls(method, ratio, GRANULARITIES.get(sets, ()))


def positions_for(context: int, answer_room: int = 256) -> int:
    """The engine's position count for a context length: one pool shape per
    length (so one compile set), with room for the rest, answer and reply."""
    return int(math.ceil((context * 1.02 + answer_room) / 256) * 256)


# ----------------------------------------------------------------------------- branching
class ProbeStage(Stage):
    """Captures, at the request's prefill, the union of what the cells observe."""

    name = "probe"
    order = 90

    def __init__(self, stages):
        self.cell_stages = stages
        self.captured = None

    def prompt_capture(self, turn) -> Capture:
        return Capture.union([Capture()] + [s.prompt_capture(turn) for s in self.cell_stages])

    def after_prefill(self, turn, captured) -> None:
        self.captured = captured


def cell_options(cell: Cell, example_seed: int) -> dict:
    """A cell's policy options for one example: ``cell.options``, and for the ``random``
    control a seed drawn from the example's (unless the cell sets one). The policy's
    default seed is 0 in every session, so without it every example of a run keeps
    the same index set: the run measures one draw, not the control's expectation. It
    matters where examples share structure by index: on ``lm`` (each context's last
    tokens) the one draw and kvpress's per-example draws differed well beyond noise
    (``eval/results/real_smollm2/token_sets``)."""
    options = dict(cell.options)
    if cell.method == "random":
        options.setdefault("seed", int(example_seed) % (2**31))
    return options


def _retention_stage(cell: Cell, budget: int, model, example_seed: int):
    from jaxkv.serving.stages.retention import RetentionSpec, RetentionStage

    options = cell_options(cell, example_seed)
    sets = {k: options.pop(k) for k in SET_OPTIONS if k in options}
    return RetentionStage(RetentionSpec.make(cell.method, budget, "dead_slot", options, model=model, **sets))


def branch_program(turn, probe: ProbeStage, cells, stages, measure):
    """A turn program: prefill the request once, then for each cell run its
    compression event on the captured features, ``measure`` (a generator
    yielding engine work), and roll the engine back. Returns ``{cell name: result}``."""
    try:
        turn.open()
        first_logits = yield from turn.prefill_prompt()
        checkpoint = turn.engine.checkpoint(kv=False)  # cells write only fresh slots (float pool, dead-slot)
        n_reports = len(turn.session.compressions)
        out = {}
        for cell, stage in zip(cells, stages):
            t0 = time.perf_counter()
            kept = turn.req.live_positions().size
            if stage is not None:
                stage.begin(turn)
                stage.prompt_capture(turn)  # the positions its features come from
                stage.after_prefill(turn, probe.captured)  # the compression event, as at the end of a prefill
                stage.end(turn)
                kept = turn.req.reads_per_layer()  # per-layer sets: keys a layer reads (the slots held are their union)
            result = yield from measure(turn, first_logits)
            result.update(kept=int(kept), seconds=round(time.perf_counter() - t0, 3))
            out[cell.name] = result
            turn.engine.rollback(checkpoint)
            del turn.session.compressions[n_reports:]
        turn.engine.discard(checkpoint)
        return out
    finally:
        turn.close()


# ----------------------------------------------------------------------------- measuring
def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def digit_scores(pred, answer, digit_idx) -> dict:
    """Teacher-forced score of an answer: ``pred[i]`` the logits predicting
    ``answer[i]``; ``tf_correct`` (every digit token its row's argmax) and
    ``answer_nll`` (their mean NLL)."""
    pred, want = np.asarray(pred)[digit_idx], np.asarray(answer)[digit_idx]
    logp = log_softmax(pred)
    return {"tf_correct": bool((pred.argmax(-1) == want).all()),
            "answer_nll": round(float(-logp[np.arange(want.size), want].mean()), 5)}


def replayed_answer_logits(result, answer) -> np.ndarray:
    """The logits predicting each ``answer`` token from a replayed turn's
    ``TurnResult`` (``return_logits``): the prompt's last row, then every reply
    row but the last (row i of a prefill follows token i)."""
    if not np.array_equal(np.asarray(result.target_ids)[: len(answer)], answer):
        raise AssertionError("the replayed reply's tokens differ from the token plan's answer")
    rows = [np.asarray(result.prompt_logits, np.float32)[-1:], np.asarray(result.target_logits, np.float32)[:-1]]
    return np.concatenate(rows)[: len(answer)]


def answer_turn(turn, last_logits, fed, plan, example, tokenizer, max_new: int, *, restore: bool = False):
    """Feed ``fed`` then ``plan.answer`` (teacher forced) on the turn's cache and
    score the answer both ways (module docstring); ``last_logits`` predicts the
    first fed token's successor when ``fed`` is empty. ``restore``: leave the
    reference answer in the cache after a greedy reply (the next question's history).
    Returns the scores and the row that follows the answer's last token."""
    from jaxkv.tasks import answer_digit_positions, reply_correct

    mark = turn.req.seq_len
    # one prefill of fed + answer (all logits): fed's last row predicts the answer's first token
    logits = yield from turn.prefill(np.concatenate([fed, plan.answer]), all_logits=True)
    logits = np.concatenate([np.asarray(last_logits, np.float32)[None], np.asarray(logits, np.float32)])
    r = fed.size
    pred = logits[r : r + plan.answer.size]  # row i predicts answer token i
    # Greedy shares the teacher-forced prefix: up to the first answer token that is
    # not the argmax, greedy decoding emits the answer itself (by induction), so
    # it decodes only from there (module docstring).
    wrong = np.flatnonzero(pred.argmax(-1) != plan.answer)
    agree = int(wrong[0]) if wrong.size else int(plan.answer.size)
    budget = haystack.reply_budget(plan, max_new)
    if agree == plan.answer.size:
        reply = list(plan.answer)  # names every value; what follows cannot change the first digit run
    else:
        turn.rewind(mark + r + agree)
        reply = list(plan.answer[:agree]) + (yield from turn.generate(logits[r + agree], budget - agree))
        if restore:
            turn.rewind(mark + r + agree)
            yield from turn.prefill(plan.answer[agree:])
    text = tokenizer.decode(reply, skip_special_tokens=True)
    digit_idx = answer_digit_positions(example, tokenizer, plan.answer)
    scores = {**digit_scores(pred, plan.answer, digit_idx), "gen_correct": bool(reply_correct(example, text)),
              "reply": text, "decoded": len(reply) - agree}
    return scores, logits[-1]


def answer_measure(example, plan, tokenizer, max_new: int):
    """Teacher-forced and greedy scoring of a retrieval answer (module docstring)."""

    def measure(turn, first_logits):
        scores, _ = yield from answer_turn(turn, first_logits, plan.rest, plan, example, tokenizer, max_new)
        return scores

    return measure


def multiq_measure(example, plans, tokenizer, max_new: int):
    """Every question of a ``multiq`` example from the one compressed cache: the
    conversation is fed once, question by question (``multiq.new_rest``), each
    answer scored as ``answer_measure`` scores one and then left in the cache as
    its reference (teacher-forced history); no event fires after the first."""
    from jaxkv.tasks import multiq

    def measure(turn, first_logits):
        last, out = first_logits, []
        for q, (plan, view) in enumerate(zip(plans, example.views())):
            scores, last = yield from answer_turn(turn, last, multiq.new_rest(plans, q), plan, view, tokenizer, max_new,
                                                  restore=True)
            out.append(scores)
        return multiq.cell_record(out, example.labels["kinds"])

    return measure


def lm_measure(plan, reference: dict):
    """Continuation NLL and KL(full || cell) per token; the first cell (the full
    cache) fills ``reference`` with its log-probabilities."""

    def measure(turn, first_logits):
        logits = yield from turn.prefill(plan.answer, all_logits=True)
        pred = np.concatenate([np.asarray(first_logits, np.float32)[None], np.asarray(logits, np.float32)[:-1]])
        logp = log_softmax(pred)
        nll = float(-logp[np.arange(plan.answer.size), plan.answer].mean())
        if "logp" not in reference:
            reference["logp"] = logp
        ref = reference["logp"]
        kl = float((np.exp(ref) * (ref - logp)).sum(axis=-1).mean())
        return {"nll": round(nll, 5), "kl": round(max(kl, 0.0), 6)}

    return measure


# ----------------------------------------------------------------------------- one example
def lm_rendered(ids, tokenizer):
    """Raw text ids as a ``Rendered`` (no chat template: the tagger finds no
    message, so every token is tagged OTHERS). No span is protected: the tagger
    reads a prompt without messages as all protected prefix (``Spans``), which
    would pin every token and leave nothing for a policy to evict."""
    from jaxkv.chat.render import Rendered, chat_markers
    from jaxkv.chat.tags import TRIAXIAL_DTYPE, Spans, tag_prompt

    ids = np.asarray(ids, np.int32)
    tags, temporal, _, found, scanner = tag_prompt(ids, chat_markers(tokenizer))
    tri = np.empty(ids.size, TRIAXIAL_DTYPE)
    tri["temporal"], tri["modal"], tri["semantic"] = temporal, tags.modal, tags.semantic
    return Rendered("", ids, tags.phase, tri, Spans((0, 0), (0, 0), (0, 0)), tuple(found), scanner)


def request_and_measure(session, example, setting: str, plans, max_new: int, reference: dict):
    """The compressed request as the session renders it (``lm``: the raw text) and
    the measure of the example's task (``plans``: ``jaxkv.tasks.real.plans``);
    checks the rendering is the token plan's."""
    from jaxkv.tasks import multiq

    tok = session.model.tokenizer
    plan = plans[0]
    if example.task == "lm":
        return lm_rendered(plan.compressed, tok), lm_measure(plan, reference)
    rendered = session._render(example.messages(setting)[:1], None, add_generation_prompt=True)
    if not np.array_equal(rendered.ids, plan.compressed):
        raise AssertionError("the session's rendering differs from the token plan")
    if example.task == multiq.TASK:
        return rendered, multiq_measure(example, plans, tok, max_new)
    return rendered, answer_measure(example, plan, tok, max_new)


def tokens_needed(plans, max_new: int) -> int:
    """Positions a cell's measure fills: the compressed request, everything fed after
    it up to the last answer, that answer and a reply."""
    last = plans[-1]
    return int(last.compressed.size + last.rest.size + last.answer.size + max_new)


def run_example(model, example, setting: str, cells, *, positions: int, max_new: int = MAX_NEW) -> dict:
    """Every cell of one (example, setting), branched from one prefill."""
    from jaxkv.serving import Session
    from jaxkv.serving.pipeline import Turn, run_to_completion
    from jaxkv.tasks import real

    tok = model.tokenizer
    plans = real.plans(example, tok, setting)
    n_request = int(plans[0].compressed.size)
    server = None
    if any(c.per_layer for c in cells):  # per-layer cells need a live list per layer
        from jaxkv.serving import Server

        server = Server(model, max_positions=positions, layer_lists=True)
    session = Session(model, server=server, max_positions=positions, protect_query=False, max_new_tokens=max_new)
    try:
        stages = [None if c.method is None else _retention_stage(c, budget_for_ratio(c.ratio, n_request), session.model, example.seed)
                  for c in cells]
        probe = ProbeStage([s for s in stages if s is not None])
        session.stages = sorted(list(session.stages) + [probe], key=lambda s: s.order)
        rendered, measure = request_and_measure(session, example, setting, plans, max_new, {})
        turn = Turn(session, rendered)
        program = branch_program(turn, probe, cells, stages, measure)
        session._check_length(tokens_needed(plans, max_new), 0)
        results = run_to_completion(program, session.server.engine)
    finally:
        session.close()
        if server is not None:
            server.close()
    return {"n_request": n_request, "cells": results}


IMPORTED = "/imported"  # the cell-name suffix of a format measured under the imported prefill


class ImportedPrompt(Stage):
    """Hands the request's prefill a ``KVSource`` (the float cell's K/V and last
    logits): the session's pool imports them instead of running the model."""

    name = "imported_prompt"
    order = 95

    def __init__(self, tokens, source):
        self.tokens, self.source = np.asarray(tokens), source

    def before_prefill(self, turn, work) -> None:
        if not np.array_equal(work.tokens, self.tokens):
            raise AssertionError("the imported K/V belong to another prompt")
        work.options["kv_source"] = self.source


def single_program(turn, measure, export: dict | None = None):
    """A turn program: prefill the request, then ``measure`` on the full cache.
    ``export``: filled with the request's ``KVSource`` after its prefill (float K/V
    of every layer and its last logits) for ``ImportedPrompt``."""
    from jaxkv.engine import KVSource

    try:
        turn.open()
        first_logits = yield from turn.prefill_prompt()
        if export is not None:
            engine = turn.engine
            k, v = engine.pool.gather_float(engine.cache, engine.row_state[turn.row].slots)
            export["source"] = KVSource(k, v, np.asarray(first_logits, np.float32))
        kept = int(turn.req.live_positions().size)  # the request's tokens, before the measure feeds more
        t0 = time.perf_counter()
        result = yield from measure(turn, first_logits)
        result.update(kept=kept, measure_seconds=round(time.perf_counter() - t0, 3))
        return result
    finally:
        turn.close()


def format_options(fmt: str, allocation=None) -> dict:
    """Session options of a KV format spec: a ``kv_quant`` mode (``int4``,
    ``kivi2``, ``kivi4``, ``triaxial``, an ablation), a triaxial mode at an average-bit
    budget (``triaxial@3.0``), and ``allocation`` as the triaxial modes'
    ``kv_allocation`` (None: the model's calibration file)."""
    mode, _, bits = fmt.partition("@")
    opts = {"kv_quant": mode}
    if bits:
        opts["kv_bits"] = float(bits)
    if allocation is not None and mode.startswith("triaxial"):
        opts["kv_allocation"] = allocation
    return opts


def run_quant_example(model, example, setting: str, formats, *, positions: int, max_new: int = MAX_NEW,
                      allocation=None, prefill: str = "chunked") -> dict:
    """The full cache of one (example, setting) on the float pool (cell ``full``)
    and on each KV format spec in ``formats`` (``format_options``; cells
    ``kv:<spec>``, ``kv:<spec>/imported`` under ``prefill="imported"``), one session
    each (module docstring: the two prefill protocols). A quantized cell also
    records ``kv``: the compressed request's live tokens per precision and their
    bytes after its prefill (``jaxkv.serving.stages.quantization.KVRecord``)."""
    from jaxkv.buckets import bucket
    from jaxkv.serving import Session
    from jaxkv.serving.pipeline import Turn, run_to_completion
    from jaxkv.tasks import real

    if prefill not in ("chunked", "imported"):
        raise ValueError(f"prefill must be 'chunked' or 'imported', got {prefill!r}")
    tok = model.tokenizer
    plans = real.plans(example, tok, setting)
    reference: dict = {}
    export: dict = {}
    out = {}
    for fmt in (None, *formats):
        t0 = time.perf_counter()
        options = {"kv_quant": None} if fmt is None else format_options(fmt, allocation)
        session = Session(model, max_positions=positions, protect_query=False, max_new_tokens=max_new, **options)
        importing = prefill == "imported" and fmt is not None
        try:
            rendered, measure = request_and_measure(session, example, setting, plans, max_new, reference)
            if importing:
                # the request in one chunk: the page plan a one-chunk quantized prefill makes
                session.server.engine.prefill_chunk = min(bucket(rendered.ids.size), positions)
                session.stages = sorted([*session.stages, ImportedPrompt(rendered.ids, export["source"])], key=lambda s: s.order)
            session._check_length(tokens_needed(plans, max_new), 0)
            exporting = prefill == "imported" and fmt is None  # the float cell: the others' source
            program = single_program(Turn(session, rendered), measure, export if exporting else None)
            result = run_to_completion(program, session.server.engine)
            stage = session.quantization
            if stage is not None and stage.records:
                result["kv"] = dataclasses.asdict(stage.records[0])
        finally:
            session.close()
        result["seconds"] = round(time.perf_counter() - t0, 3)
        out["full" if fmt is None else f"kv:{fmt}{IMPORTED if importing else ''}"] = result
    return {"n_request": int(plans[0].compressed.size), "cells": out}


# ----------------------------------------------------------------------------- multi-turn sessions
def session_cells(method: str, ratio: float, k: int) -> list[tuple[str, dict]]:
    """RepairKV's matched-budget trio in the question-agnostic setting, as real
    multi-turn sessions (``name``, session options at a budget ``B`` given later):
    no repair at B, RepairKV with K rows at B, and no repair at B + K (the same
    live budget as the repaired cache). Unlike a branched cell, the budget holds
    for the whole session: the question's turn ends with its own event. ``method`` is
    a ``--methods`` spec: ``keydiff:layer`` keeps a set per layer (``Cell.parse``)."""
    cell = Cell.parse(method, ratio)
    tag, base = cell.name, {"policy": cell.method, **dict(cell.options)}
    return [(f"session:{tag}", base),
            (f"repairkv{k}:{tag}", {**base, "repair": k}),
            (f"matched{k}:{tag}", {**base, "extra": k})]


def run_sessions(model, example, cells, ratio: float, *, positions: int, max_new: int = MAX_NEW) -> dict:
    """Replay the agnostic conversation through one fresh ``Session`` per cell;
    score each question's answer (turn 2's; a multiq example's every question) as
    the branched cells do. The session's budget holds on every turn, so a multiq
    session compresses again whenever a turn takes it past the budget, and RepairKV
    promotes at every turn boundary."""
    from jaxkv.serving import Session
    from jaxkv.tasks import answer_digit_positions, multiq, real, reply_correct

    tok = model.tokenizer
    plans = real.plans(example, tok, "agnostic")
    views = real.views(example)
    budget = budget_for_ratio(ratio, int(plans[0].compressed.size))
    messages = example.messages("agnostic")
    out = {}
    for name, options in cells:
        options = dict(options)
        t0 = time.perf_counter()
        b = budget + options.pop("extra", 0)
        session = Session(model, max_positions=positions, protect_query=False, max_new_tokens=max_new, budget=b, **options)
        try:
            n_new = max(haystack.reply_budget(p, max_new) for p in plans)
            turns = session.replay(messages, generate=True, return_logits=True, max_new_tokens=n_new)
            scored = []
            for result, plan, view in zip(turns[-len(plans):], plans, views):  # the questions' turns are the last ones
                pred = replayed_answer_logits(result, plan.answer)
                text = tok.decode(list(result.reply_ids or []), skip_special_tokens=True)
                scored.append({**digit_scores(pred, plan.answer, answer_digit_positions(view, tok, plan.answer)),
                               "gen_correct": bool(reply_correct(view, text)), "reply": text})
            cell = multiq.cell_record(scored, example.labels["kinds"]) if example.task == multiq.TASK else scored[0]
            out[name] = {**cell, "budget": int(b),
                         "kept": int(session.compressions[0].live_after) if session.compressions else None,
                         "repaired": int(sum(len(r.promoted_positions) for r in session.repairs)),
                         "seconds": round(time.perf_counter() - t0, 3)}
        finally:
            session.close()
    return {"n_request": int(plans[0].compressed.size), "cells": out}


# ----------------------------------------------------------------------------- driver
def cells_to_run(held: set | None, cells, trio=None) -> list:
    """What a resumed run still runs for one (example, setting) whose journaled cells
    are ``held`` (None: no record): the retention grid's ``cells`` unless the example
    has a record; with a RepairKV ``trio`` (``session_cells``), the trio's cells not held."""
    if trio is None:
        return [] if held is not None else list(cells)
    return [c for c in trio if c[0] not in (held or ())]


def read_journal(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


REAL_TASKS = real_tasks.TASKS
DEFAULT_MODEL = "smollm2-135m-instruct"


def build_parser() -> argparse.ArgumentParser:
    """The options of a grid run: ``run_grid`` reads every one of them (``jaxkv eval``
    starts from their defaults, ``build_parser().parse_args([])``, and sets its own)."""
    p = argparse.ArgumentParser(prog="python -m eval.quality.real_model", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--task", default="passkey", help="passkey, niah, niah_single|niah_multikey|niah_multivalue, lm, multiq")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--first", type=int, default=0, help="skip the first F examples (split a run): --first 50 --n 50 runs examples 50-99")
    p.add_argument("--ratios", default=",".join(f"{r:g}" for r in RATIOS))
    p.add_argument("--methods", default=",".join(METHODS), help="policies; NAME:layer or NAME:pyramid keeps a set per layer (equal or PyramidKV budgets)")
    p.add_argument("--settings", default=None, help="aware,agnostic (lm: agnostic only)")
    p.add_argument("--seed", type=int, default=None, help="the evaluation seed base (default: the task module's EVAL_SEED)")
    p.add_argument("--max-new", type=int, default=MAX_NEW)
    p.add_argument("--out", type=Path, default=Path("eval/results/real_smollm2/jaxkv"))
    p.add_argument("--resume", action="store_true")
    p.add_argument("--journal", default=None,
                   help="the journal in --out (default: examples.jsonl for the retention grid, quant.jsonl with "
                        "--kv-quant); another examples*.jsonl (or quant*.jsonl) adds cells (methods, formats) to the "
                        "same examples, which the reports merge by example")
    p.add_argument("--repair", type=int, default=None, metavar="K",
                   help="instead of the branched grid: RepairKV with K rows, matched no-repair at B+K and no repair at B, "
                        "as multi-turn sessions in the agnostic setting (--repair-method at --repair-ratio)")
    p.add_argument("--kv-quant", default=None, metavar="FORMATS",
                   help="instead of the retention grid: the full cache on the float pool and on each of these KV "
                        "formats (int4,kivi2,...), one session each (journal quant.jsonl)")
    p.add_argument("--quant-prefill", choices=("chunked", "imported"), default="chunked",
                   help="with --kv-quant: each format prefills the request itself in 512-token chunks (chunked, what a "
                        "jaxkv server does) or imports the float cell's K/V (imported: the papers' full-precision "
                        "prefill, one forward per example)")
    p.add_argument("--repair-method", default="snapkv")
    p.add_argument("--repair-ratio", type=float, default=0.5)
    return p


def main(argv=None) -> int:
    return run_grid(build_parser().parse_args(argv))


def run_grid(args) -> int:
    """Run the cells ``args`` asks for (every option of ``build_parser``), appending to the journal."""
    import jaxkv
    from jaxkv import compiles

    from tqdm import tqdm

    # A run compiles each (pool format, prefill width, read length) program once; the
    # read-length bucket flips where a request straddles 2,048 tokens, and every KV
    # format has its own programs, so a quantized niah run spent its first examples
    # (~300 s each) compiling. JAX's persistent cache (``$JAXKV_XLA_CACHE``, off with
    # ``off``) keeps them for the next run and for a --resume after a stop.
    compiles.enable_persistent_cache()

    ratios = [float(r) for r in args.ratios.split(",") if r]
    methods = [m for m in args.methods.split(",") if m]
    cells = [Cell(None)] + [Cell.parse(m, r) for m in methods for r in ratios]
    settings = args.settings.split(",") if args.settings else (["agnostic"] if args.task == "lm" else ["aware", "agnostic"])
    model = jaxkv.load_model(args.model)
    examples = real_tasks.examples(args.task, args.first + args.n, length=args.context, tokenizer=model.tokenizer, seed=args.seed)[args.first :]
    args.out.mkdir(parents=True, exist_ok=True)
    kv_formats = [f for f in (args.kv_quant or "").split(",") if f]
    quant_prefill = args.quant_prefill
    if kv_formats and args.repair is not None:
        raise SystemExit("--kv-quant and --repair are separate runs")
    journal = args.out / ("sessions.jsonl" if args.repair is not None else args.journal or ("quant.jsonl" if kv_formats else "examples.jsonl"))
    if args.repair is not None:
        settings = ["agnostic"]
    # What the journal holds, per (task, context, seed, setting): the cell names. A
    # retention or quantization run skips an example it holds; a RepairKV run skips
    # the trio's cells it holds, so another K or method on the same examples appends
    # only its own cells (the report merges an example's cells across records).
    held: dict[tuple, set] = {}
    for r in read_journal(journal) if args.resume else []:
        held.setdefault((r["task"], r["context"], r["seed"], r["setting"]), set()).update(r["cells"])
    trio = session_cells(args.repair_method, args.repair_ratio, args.repair) if args.repair is not None else None
    positions = min(positions_for(args.context), model.config.max_position_embeddings)
    setup = {"model": args.model, "ratios": ratios, "methods": methods, "max_new": args.max_new, "positions": positions,
             **({"kv_quant": kv_formats, "quant_prefill": quant_prefill} if kv_formats else {}),
             "threads": os.environ.get("XLA_FLAGS", ""), "cpus": len(os.sched_getaffinity(0))}
    def missing(ex, setting) -> list:
        return cells_to_run(held.get((ex.task, args.context, ex.seed, setting)), cells, trio)

    todo = [(ex, s) for ex in examples for s in settings if missing(ex, s)]
    bar = tqdm(todo, desc=f"{args.task} {args.context}", unit="ex")
    for ex, setting in bar:
        load = os.getloadavg()[0]  # the 1-minute load when the example starts: more jobs than cores shows here
        t0 = time.perf_counter()
        if trio is not None:
            record = run_sessions(model, ex, missing(ex, setting), args.repair_ratio, positions=positions, max_new=args.max_new)
        elif kv_formats:
            record = run_quant_example(model, ex, setting, kv_formats, positions=positions, max_new=args.max_new,
                                       prefill=quant_prefill)
        else:
            record = run_example(model, ex, setting, cells, positions=positions, max_new=args.max_new)
        record.update(task=ex.task, context=args.context, seed=ex.seed,
                      setting=setting, length=ex.length, seconds=round(time.perf_counter() - t0, 2), load=round(load, 2), setup=setup)
        with journal.open("a") as f:
            f.write(json.dumps(record) + "\n")
        gc.collect()  # a closed session's pool sits in reference cycles (stages, turns); free it now, not at the next GC
        # Every compiled XLA:CPU program holds memory mappings; a quantized run (each format's
        # programs at each width and read length) passed the kernel's limit and died inside
        # an LLVM compile ("Cannot allocate memory") a few niah examples in. Drop them when
        # crowded; the persistent cache above reloads them.
        compiles.release_if_crowded()

        first = next(iter(record["cells"].values()))
        bar.set_postfix(s=f"{record['seconds']:.0f}", first=first.get("tf_correct", first.get("nll")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
