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
and the answer with no further event, and is measured as every real-model cell is
(``train.haystack_measure``): teacher forced (``tf_correct``, ``answer_nll``), greedy
(``gen_correct``), and on ``lm`` the continuation's NLL and KL(full || cell).

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
no compression (``train.haystack_measure.run_quant_example``, which the TriAxialKV
calibration's sweep runs too): the float pool first (cell ``full``), then
``kv:<format>``. Journal ``quant.jsonl``. ``--quant-prefill`` chooses the prefill
protocol: ``chunked`` (default; each format's session prefills the request itself,
as a jaxkv server does) or ``imported`` (the float cell's K/V imported into each
format's pool, the papers' protocol; cells ``kv:<format>/imported``).

Journal: one JSON line per finished (task, length, seed, setting) in
``OUT/examples.jsonl`` with every cell; ``--resume`` skips what is there.
``--journal examples_<name>.jsonl`` runs more methods on the same examples into a
journal of their own (the report merges every ``examples*.jsonl`` by example).
``--repair`` journals ``OUT/sessions.jsonl``; its ``--resume`` skips the trio's cells
an example already has, so another K or method on the same examples appends only
its own cells (the no-repair cell ``session:<method>@<ratio>`` is shared);
``--repair-cells repairkv`` runs only the named cells of the trio. On ``multiq`` each
session compresses once (``events="once"``), when the context's prefill ends, as the
branched cells do, and RepairKV promotes at every question's turn boundary from
that event's evicted rows; on the one-question tasks the budget holds on the
question's turn too (a second event, as their journaled runs had). Every cell
records its ``events``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
from pathlib import Path

from jaxkv.serving.stages.base import Capture, Stage
from jaxkv.tasks import haystack
from jaxkv.tasks import real as real_tasks
from train.haystack_measure import (
    MAX_NEW,
    digit_scores,
    positions_for,
    replayed_answer_logits,
    request_and_measure,
    run_quant_example,
    tokens_needed,
)
from train.journal import append_journal, read_journal

METHODS = ("snapkv", "tova", "h2o", "streaming_llm", "random", "agentkv", "intentkv_memory", "intentkv_query")
RATIOS = (0.25, 0.5, 0.75)


def budget_for_ratio(ratio: float, n_request: int) -> int:
    """Live tokens a cell keeps of an ``n_request``-token compressed request at
    kvpress's ``compression_ratio`` (the fraction removed): kvpress keeps
    ``int(n * (1 - ratio))`` tokens in every layer and head; jaxkv keeps that
    many tokens for all of them."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"ratio must be in [0, 1), got {ratio}")
    return max(1, int(n_request * (1.0 - ratio)))


SET_OPTIONS = ("keep_sets", "layer_budgets")  # a Cell option choosing the kept set's granularity, not a policy field
GRANULARITIES = {
    "layer": (("keep_sets", "layer"),),
    "pyramid": (("keep_sets", "layer"), ("layer_budgets", "pyramid")),
    "shared": (("keep_sets", "layer"), ("layer_budgets", "shared")),
}


@dataclasses.dataclass(frozen=True)
class Cell:
    """One branch: a retention method at a ratio (``method=None``: the full cache),
    with the policy's config fields in ``options`` (``(("w", 64),)``; empty: defaults)
    and, there too, ``keep_sets`` / ``layer_budgets`` (per-layer keep sets: the
    cell's name ends in ``/layer``, ``/pyramid`` or ``/shared``; ``--methods snapkv:layer``)."""

    method: str | None
    ratio: float = 0.0
    options: tuple = ()

    @property
    def name(self) -> str:
        if self.method is None:
            return "full"
        opts = dict(self.options)
        sets = (
            ""
            if opts.get("keep_sets", "model") == "model"
            else "/" + {"pyramid": "pyramid", "shared": "shared"}.get(opts.get("layer_budgets"), "layer")
        )
        return f"{self.method}{sets}@{self.ratio:g}"

    @property
    def per_layer(self) -> bool:
        return dict(self.options).get("keep_sets") == "layer"

    @classmethod
    def parse(cls, spec: str, ratio: float) -> "Cell":
        """``"snapkv"``, or ``"snapkv:layer"`` / ``"snapkv:pyramid"`` / ``"snapkv:shared"`` (per-layer sets)."""
        method, _, sets = spec.partition(":")
        if sets and sets not in GRANULARITIES:
            raise SystemExit(f"unknown kept-set granularity {sets!r} in {spec!r}; known: {', '.join(GRANULARITIES)}")
        return cls(method, ratio, GRANULARITIES.get(sets, ()))


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


def pass_positions(cells, model, n_request: int, positions: int) -> int:
    """The positions an example's engine needs: ``positions``, or more where a cell's
    policy runs reconstruction passes (KVzip): room for a pass of ``chunk_size``
    context tokens and its prompt past the compressed request, as kvpress runs it
    (a row with less room is scored in smaller chunks,
    ``jaxkv.serving.stages.reconstruction``), and for the turn's slot reservation,
    which holds one pass beside the whole conversation; within the model's context."""
    from jaxkv.policies import get_policy, kvzip

    need = positions
    for cell in cells:
        if cell.method is None:
            continue
        policy = get_policy(cell.method)
        config = policy.make_config(**{k: v for k, v in cell.options if k not in SET_OPTIONS})
        if policy.needs(config).reconstruction:
            room = min(config.chunk_size, n_request) + kvzip.pass_overhead(model.tokenizer)
            need = max(need, -(-(positions + room) // 256) * 256)  # a turn's reservation holds a pass beside it
    return min(need, model.config.max_position_embeddings)


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
        first_logits = (yield from turn.prefill_prompt(logits="last")).result_logits()
        checkpoint = turn.engine.kv.checkpoint(kv=False)  # cells write only fresh slots (float pool, dead-slot)
        n_reports = len(turn.session.compressions)
        out = {}
        for cell, stage in zip(cells, stages):
            t0 = time.perf_counter()
            kept = turn.req.live_positions().size
            if stage is not None:
                stage.begin(turn)
                stage.prompt_capture(turn)  # the positions its features come from
                work = stage.after_prefill(turn, probe.captured)  # the compression event, as at the end of a prefill
                if work is not None:  # a reconstruction policy's passes (KVzip), then its event
                    yield from work
                stage.end(turn)
                kept = turn.req.reads_per_layer()  # per-layer sets: keys a layer reads (the slots held are their union)
            scoring = sum(c.scoring_tokens for c in turn.session.compressions[n_reports:])
            result = yield from measure(turn, first_logits)
            result.update(kept=int(kept), seconds=round(time.perf_counter() - t0, 3))
            if scoring:
                result["scoring_tokens"] = int(scoring)  # tokens forwarded to score (KVzip's passes), beside the request's
            out[cell.name] = result
            turn.engine.kv.rollback(checkpoint)
            del turn.session.compressions[n_reports:]
        turn.engine.kv.discard(checkpoint)
        return out
    finally:
        turn.close()


# ----------------------------------------------------------------------------- one example
def run_example(model, example, setting: str, cells, *, positions: int, max_new: int = MAX_NEW) -> dict:
    """Every cell of one (example, setting), branched from one prefill."""
    from jaxkv.serving import Session
    from jaxkv.serving.pipeline import Turn, run_to_completion
    from jaxkv.tasks import real

    tok = model.tokenizer
    plans = real.plans(example, tok, setting)
    n_request = int(plans[0].compressed.size)
    positions = pass_positions(cells, model, n_request, positions)
    server = None
    if any(c.per_layer for c in cells):  # per-layer cells need a live list per layer
        from jaxkv.serving import Server

        server = Server(model, max_positions=positions, layer_lists=True)
    session = Session(model, server=server, max_positions=positions, protect_query=False, max_new_tokens=max_new)
    try:
        stages = [
            None if c.method is None else _retention_stage(c, budget_for_ratio(c.ratio, n_request), session.model, example.seed)
            for c in cells
        ]
        probe = ProbeStage([s for s in stages if s is not None])
        session.stages = sorted(list(session.stages) + [probe], key=lambda s: s.order)
        rendered, measure = request_and_measure(session, example, setting, plans, max_new, {})
        turn = Turn(session, rendered)
        program = branch_program(turn, probe, cells, stages, measure)
        session._check_length(tokens_needed(plans, max_new), 0)
        results = run_to_completion(program, session.server.scheduler)
    finally:
        session.close()
        if server is not None:
            server.close()
    return {"n_request": n_request, "cells": results}


# ----------------------------------------------------------------------------- multi-turn sessions
def session_cells(method: str, ratio: float, k: int) -> list[tuple[str, dict]]:
    """RepairKV's matched-budget trio in the question-agnostic setting, as real
    multi-turn sessions (``name``, session options at a budget ``B`` given later):
    no repair at B, RepairKV with K rows at B, and no repair at B + K (the same
    live budget as the repaired cache). Unlike a branched cell, the budget holds
    for the whole session: the question's turn ends with its own event (but on
    ``multiq``: one event, ``run_sessions``). ``method`` is
    a ``--methods`` spec: ``keydiff:layer`` keeps a set per layer (``Cell.parse``)."""
    cell = Cell.parse(method, ratio)
    tag, base = cell.name, {"policy": cell.method, **dict(cell.options)}
    return [(f"session:{tag}", base), (f"repairkv{k}:{tag}", {**base, "repair": k}), (f"matched{k}:{tag}", {**base, "extra": k})]


TRIO_KINDS = ("session", "repairkv", "matched")


def trio_of_kinds(trio: list, kinds: str | None) -> list:
    """The cells of ``session_cells``' trio whose kind (``session``, ``repairkv``,
    ``matched``: the name before ``K:``) ``kinds`` lists (a comma list; None: all)."""
    if not kinds:
        return list(trio)
    wanted = {k.strip() for k in kinds.split(",") if k.strip()}
    bad = wanted - set(TRIO_KINDS)
    if bad:
        raise SystemExit(f"--repair-cells: unknown {', '.join(sorted(bad))}; known: {', '.join(TRIO_KINDS)}")
    return [c for c in trio if c[0].split(":")[0].rstrip("0123456789") in wanted]


def run_sessions(model, example, cells, ratio: float, *, positions: int, max_new: int = MAX_NEW) -> dict:
    """Replay the agnostic conversation through one fresh ``Session`` per cell;
    score each question's answer (turn 2's; a multiq example's every question) as
    the branched cells do.

    Events: a multiq session compresses once (``events="once"``, issue #75's
    protocol): when the context's prefill ends, never at a question's turn, so a
    reconstruction policy's passes (KVzip) run once per cell. RepairKV promotes at
    every question's turn boundary from the rows that event shelved, so at question
    ``q`` the repaired cache holds up to ``B + qK`` of the context's rows where the
    matched cell holds ``B + K`` (the conversation after the context beside both). A one-question task (passkey, the NIAH tasks) keeps the budget on
    every turn: the question's turn takes the history past B again and fires a
    second event, RepairKV promoting after it, the protocol of their journaled
    runs. ``events`` in each cell's record counts what ran."""
    from jaxkv.serving import Session
    from jaxkv.tasks import answer_digit_positions, multiq, real, reply_correct

    tok = model.tokenizer
    plans = real.plans(example, tok, "agnostic")
    views = real.views(example)
    budget = budget_for_ratio(ratio, int(plans[0].compressed.size))
    policies = [Cell(o["policy"], ratio, tuple((k, v) for k, v in o.items() if k not in ("policy", "repair", "extra"))) for _, o in cells]
    positions = pass_positions(policies, model, int(plans[0].compressed.size), positions)
    messages = example.messages("agnostic")
    once = {"events": "once"} if example.task == multiq.TASK else {}
    out = {}
    for name, options in cells:
        options = dict(options)
        t0 = time.perf_counter()
        b = budget + options.pop("extra", 0)
        session = Session(model, max_positions=positions, protect_query=False, max_new_tokens=max_new, budget=b, **once, **options)
        try:
            n_new = max(haystack.reply_budget(p, max_new) for p in plans)
            turns = session.replay(messages, generate=True, return_logits=True, max_new_tokens=n_new)
            scored = []
            for result, plan, view in zip(turns[-len(plans) :], plans, views):  # the questions' turns are the last ones
                pred = replayed_answer_logits(result, plan.answer)
                text = tok.decode(list(result.reply_ids or []), skip_special_tokens=True)
                scored.append(
                    {
                        **digit_scores(pred, plan.answer, answer_digit_positions(view, tok, plan.answer)),
                        "gen_correct": bool(reply_correct(view, text)),
                        "reply": text,
                    }
                )
            cell = multiq.cell_record(scored, example.labels["kinds"]) if example.task == multiq.TASK else scored[0]
            out[name] = {
                **cell,
                "budget": int(b),
                "kept": int(session.compressions[0].live_after) if session.compressions else None,
                "events": len(session.compressions),
                "repaired": int(sum(len(r.promoted_positions) for r in session.repairs)),
                "scoring_tokens": int(sum(c.scoring_tokens for c in session.compressions)),  # KVzip's passes; 0 for the rest
                "seconds": round(time.perf_counter() - t0, 3),
            }
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
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="policies; NAME:layer, NAME:pyramid or NAME:shared keeps a set per layer (equal budgets, PyramidKV's, or one budget the layers divide by score)",
    )
    p.add_argument("--settings", default=None, help="aware,agnostic (lm: agnostic only)")
    p.add_argument("--seed", type=int, default=None, help="the evaluation seed base (default: the task module's EVAL_SEED)")
    p.add_argument("--max-new", type=int, default=MAX_NEW)
    p.add_argument("--out", type=Path, default=Path("eval/results/real_smollm2/jaxkv"))
    p.add_argument("--resume", action="store_true")
    p.add_argument(
        "--journal",
        default=None,
        help="the journal in --out (default: examples.jsonl for the retention grid, quant.jsonl with "
        "--kv-quant); another examples*.jsonl (or quant*.jsonl) adds cells (methods, formats) to the "
        "same examples, which the reports merge by example",
    )
    p.add_argument(
        "--repair",
        type=int,
        default=None,
        metavar="K",
        help="instead of the branched grid: RepairKV with K rows, matched no-repair at B+K and no repair at B, "
        "as multi-turn sessions in the agnostic setting (--repair-method at --repair-ratio)",
    )
    p.add_argument(
        "--kv-quant",
        default=None,
        metavar="FORMATS",
        help="instead of the retention grid: the full cache on the float pool and on each of these KV "
        "formats (int4,kivi2,...), one session each (journal quant.jsonl)",
    )
    p.add_argument(
        "--quant-prefill",
        choices=("chunked", "imported"),
        default="chunked",
        help="with --kv-quant: each format prefills the request itself in 512-token chunks (chunked, what a "
        "jaxkv server does) or imports the float cell's K/V (imported: the papers' full-precision "
        "prefill, one forward per example)",
    )
    p.add_argument("--repair-method", default="snapkv")
    p.add_argument(
        "--repair-cells",
        default=None,
        help=f"with --repair: which of the trio's cells to run, a comma list of {', '.join(TRIO_KINDS)} (default: all three)",
    )
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
    examples = real_tasks.examples(args.task, args.first + args.n, length=args.context, tokenizer=model.tokenizer, seed=args.seed)[
        args.first :
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    kv_formats = [f for f in (args.kv_quant or "").split(",") if f]
    quant_prefill = args.quant_prefill
    if kv_formats and args.repair is not None:
        raise SystemExit("--kv-quant and --repair are separate runs")
    journal = args.out / (
        "sessions.jsonl" if args.repair is not None else args.journal or ("quant.jsonl" if kv_formats else "examples.jsonl")
    )
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
    if trio is not None:
        trio = trio_of_kinds(trio, getattr(args, "repair_cells", None))
    positions = min(positions_for(args.context), model.config.max_position_embeddings)
    setup = {
        "model": args.model,
        "ratios": ratios,
        "methods": methods,
        "max_new": args.max_new,
        "positions": positions,
        **({"kv_quant": kv_formats, "quant_prefill": quant_prefill} if kv_formats else {}),
        "threads": os.environ.get("XLA_FLAGS", ""),
        "cpus": len(os.sched_getaffinity(0)),
    }

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
            record = run_quant_example(model, ex, setting, kv_formats, positions=positions, max_new=args.max_new, prefill=quant_prefill)
        else:
            record = run_example(model, ex, setting, cells, positions=positions, max_new=args.max_new)
        record.update(
            task=ex.task,
            context=args.context,
            seed=ex.seed,
            setting=setting,
            length=ex.length,
            seconds=round(time.perf_counter() - t0, 2),
            load=round(load, 2),
            setup=setup,
        )
        append_journal(journal, record)
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
