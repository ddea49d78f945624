"""How one real-model example is measured on a cache, and the example run on each KV format.

The real-model tasks (``jaxkv.tasks.haystack``: passkey, RULER needles, ``lm``
continuations) split an example's ids by its ``token_plan`` into the request, the
``rest`` fed after it (question-agnostic: the acknowledgement and the question's
turn) and the ``answer``. Whatever a cell did to the request's KV (a retention event
in ``eval.quality.real_model``'s branched cells, a KV format here), the rest and the
answer are then fed with no further event and measured the same way
(``request_and_measure``):

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

KV quantization (issue #26; ``run_quant_example``): each example runs once per KV
format in a session of its own, full cache, no compression: the float pool first
(cell ``full``, the reference of the ``lm`` KL), then ``kv:<format>``, each measured
as above. Two prefill protocols:

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

Who runs it: the evaluation's real-model grid (``eval.quality.real_model``, its
retention cells and ``--kv-quant``) and the TriAxialKV calibration's budget sweep on a
pretrained model (``train.calibrate_triaxial.real_sweep``). It lives in ``train/``
because ``eval/`` may import ``train/`` and ``train/`` never imports ``eval/``.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from jaxkv.serving.stages.base import PrefillLogits, Stage
from jaxkv.tasks import haystack

MAX_NEW = 48  # the cap of a greedy reply (haystack.reply_budget sets each reply's own)


def positions_for(context: int, answer_room: int = 256) -> int:
    """The engine's position count for a context length: one pool shape per
    length (so one compile set), with room for the rest, answer and reply."""
    return int(math.ceil((context * 1.02 + answer_room) / 256) * 256)


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
    return {"tf_correct": bool((pred.argmax(-1) == want).all()), "answer_nll": round(float(-logp[np.arange(want.size), want].mean()), 5)}


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
        reply = list(plan.answer[:agree]) + (yield from turn.generate(PrefillLogits(logits[r + agree]), budget - agree))
        if restore:
            turn.rewind(mark + r + agree)
            yield from turn.prefill(plan.answer[agree:])
    text = tokenizer.decode(reply, skip_special_tokens=True)
    digit_idx = answer_digit_positions(example, tokenizer, plan.answer)
    scores = {
        **digit_scores(pred, plan.answer, digit_idx),
        "gen_correct": bool(reply_correct(example, text)),
        "reply": text,
        "decoded": len(reply) - agree,
    }
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
            scores, last = yield from answer_turn(turn, last, multiq.new_rest(plans, q), plan, view, tokenizer, max_new, restore=True)
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
    from jaxkv.chat.tags import Spans, tag_prompt, triaxial_array

    ids = np.asarray(ids, np.int32)
    markers = chat_markers(tokenizer)
    tags, temporal, _, found, scanner = tag_prompt(ids, markers)
    tri = triaxial_array(ids, tags, temporal, markers)
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


# ----------------------------------------------------------------------------- on each KV format
IMPORTED = "/imported"  # the cell-name suffix of a format measured under the imported prefill


class ImportedPrompt(Stage):
    """Hands the request's prefill a ``KVSource`` (the float cell's K/V and last
    logits): the session's pool imports them instead of running the model."""

    name = "imported_prompt"
    order = 95

    def __init__(self, tokens, source):
        self.tokens, self.source = np.asarray(tokens), source

    def before_prefill(self, turn, job):
        if not np.array_equal(job.tokens, self.tokens):
            raise AssertionError("the imported K/V belong to another prompt")
        job.kv_source = self.source
        return None


def single_program(turn, measure, export: dict | None = None):
    """A turn program: prefill the request, then ``measure`` on the full cache.
    ``export``: filled with the request's ``KVSource`` after its prefill (float K/V
    of every layer and its last logits) for ``ImportedPrompt``."""
    from jaxkv.engine import KVSource

    try:
        turn.open()
        first_logits = (yield from turn.prefill_prompt(logits="last")).result_logits()
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


def run_quant_example(
    model, example, setting: str, formats, *, positions: int, max_new: int = MAX_NEW, allocation=None, prefill: str = "chunked"
) -> dict:
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
            result = run_to_completion(program, session.server.scheduler)
            stage = session.quantization
            if stage is not None and stage.records:
                result["kv"] = dataclasses.asdict(stage.records[0])
        finally:
            session.close()
        result["seconds"] = round(time.perf_counter() - t0, 3)
        out["full" if fmt is None else f"kv:{fmt}{IMPORTED if importing else ''}"] = result
    return {"n_request": int(plans[0].compressed.size), "cells": out}
