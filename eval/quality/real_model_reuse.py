"""Segment reuse on a real model: a document shared across requests (issue #32, item 3).

    JAX_PLATFORMS=cpu python -m eval.quality.real_model_reuse --model smollm2-135m-instruct \\
        --task passkey --context 2048 --n 20 --out eval/results/real_smollm2/reuse --resume

Protocol, per haystack example (``jaxkv.tasks.haystack``, the examples both sides
of ``eval.quality.real_model`` run) and per reuse mode (``none``, ``segment``,
``cacheblend``), on a fresh server so no mode sees another's store:

1. **Primer.** A first session of the tenant reads the document behind another
   left context (its own system prompt), so the document sits at other positions
   after other tokens and the radix prefix cache cannot serve the next request:
   only segment reuse can.
2. **Target.** A second session of the same tenant sends the question-aware
   request (document and question): its prefill goes through the reuse stage and
   the greedy reply is scored (``gen_correct``, ``haystack.reply_correct``). The
   same session then replays the conversation with the reference reply: the
   prompt is its own radix prefix now, so the reply is teacher forced on the very
   cache the reuse stage built (``tf_correct``: every digit token is its row's
   argmax; ``answer_nll``: their mean NLL). (Teacher forcing inside the first
   request would ask for every prompt logit, which a spliced token does not
   produce, and the reuse stage would step aside.)

Recorded per mode: the scores, the tokens spliced instead of recomputed, the
token-layer units computed against prefix caching alone (``ReuseReport``), the
spans accepted and rejected by the acceptance test, and the target prefill's wall
time. ``none`` is the same two requests with reuse off (the full recompute): the
paired ceiling. Journal: one JSON line per (task, length, seed) in
``OUT/examples.jsonl``; ``--resume`` skips what is there.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

from jaxkv.tasks import haystack
from train.haystack_measure import digit_scores, replayed_answer_logits
from train.journal import append_journal, read_journal

MODES = ("none", "segment", "cacheblend")
PRIMER_SYSTEM = "You are a careful reader. Keep every detail of the documents you are given."
TENANT = "eval"


def primer_messages(example) -> list[dict]:
    """The document behind another left context: its own system prompt instead of the
    template's default, so the document starts at another position after other
    tokens (the document opens its user message in both requests, where the
    segmenter's windows start)."""
    return [
        {"role": "system", "content": PRIMER_SYSTEM},
        {"role": "user", "content": example.document},
        {"role": "assistant", "content": haystack.ACK},
    ]


def run_mode(model, example, mode: str, *, positions: int, max_new: int) -> dict:
    """One mode's primer and target requests on a fresh server (module docstring)."""
    import jaxkv

    tok = model.tokenizer
    plan = haystack.token_plan(example, tok, "aware")
    digits = haystack.answer_digit_positions(example, tok, plan.answer)
    options = {} if mode == "none" else {"reuse": mode, "tenant": TENANT}
    with jaxkv.Server(model, rows=1, max_positions=positions) as server:
        primer = server.session(**options)
        primer.replay(primer_messages(example))
        primer.close()
        target = server.session(**options)
        messages = example.messages("aware")
        t0 = time.perf_counter()
        reply = target.chat(messages[:1], max_new_tokens=haystack.reply_budget(plan, max_new))
        seconds = time.perf_counter() - t0
        report = target._stage("reuse").reports[-1] if mode != "none" else None
        # teacher forcing on the same cache: the prompt is now this session's radix prefix
        (result,) = target.replay(messages, return_logits=True)
        target.close()
    text = reply.get("content") or ""
    row = {
        **digit_scores(replayed_answer_logits(result, plan.answer), plan.answer, digits),
        "gen_correct": bool(haystack.reply_correct(example, text)),
        "reply": text,
        "seconds": round(seconds, 3),
    }
    if report is not None:
        row.update(
            spliced=int(report.spliced_tokens),
            units=int(report.units),
            full_units=int(report.full_units),
            accepted=int(report.accepted),
            rejected=int(report.rejected),
            skipped=report.skipped,
        )
    return row


def main(argv=None) -> int:
    import jaxkv
    from tqdm import tqdm

    from train.haystack_measure import MAX_NEW, positions_for

    p = argparse.ArgumentParser(prog="python -m eval.quality.real_model_reuse", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--task", default="passkey", help="passkey, niah, niah_single|niah_multikey|niah_multivalue")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--max-new", type=int, default=MAX_NEW)
    p.add_argument("--out", type=Path, default=Path("eval/results/real_smollm2/reuse"))
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        p.error(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    if args.task == "lm":
        p.error("the lm task has no chat form: segment reuse runs on passkey and niah")
    model = jaxkv.load_model(args.model)
    examples = haystack.examples(args.task, args.first + args.n, length=args.context, tokenizer=model.tokenizer)[args.first :]
    args.out.mkdir(parents=True, exist_ok=True)
    journal = args.out / "examples.jsonl"
    done = {(r["task"], r["context"], r["seed"]) for r in read_journal(journal)} if args.resume else set()
    positions = min(positions_for(args.context), model.config.max_position_embeddings)
    todo = [ex for ex in examples if (ex.task, args.context, ex.seed) not in done]
    for ex in tqdm(todo, desc=f"reuse {args.task} {args.context}", unit="ex"):
        t0 = time.perf_counter()
        modes_out = {m: run_mode(model, ex, m, positions=positions, max_new=args.max_new) for m in modes}
        record = {
            "task": ex.task,
            "context": args.context,
            "seed": ex.seed,
            "length": ex.length,
            "modes": modes_out,
            "seconds": round(time.perf_counter() - t0, 2),
        }
        append_journal(journal, record)
        gc.collect()  # a closed server's pool sits in reference cycles: free it now
    return 0


if __name__ == "__main__":
    sys.exit(main())
