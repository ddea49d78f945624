"""What one KVzip compression event costs on a real model, its pass's forward and its scoring apart, with and without the step's capture cap.

A ``policy="kvzip"`` session replays the first turn of a ``multiq`` example (the
document, compressed when its prefill ends to half its tokens). The reconstruction
pass (``jaxkv.serving.stages.reconstruction.run_passes``) is timed whole and its
scoring calls (``reconstruction._score``, each blocked on) apart; the forward is the
rest. ``wide`` runs the pass as ``PrefillJob.wide_capture`` jobs (every token's
query back from a step of the prefill chunk); ``capped`` builds the same jobs
without it, so the packer cuts them to ``runner.CAPTURE_ROWS`` query rows per step,
as before. The two alternate in one process, so load from other work falls on
both; the first of each compiles and is reported apart.

    JAX_PLATFORMS=cpu python -m eval.bench.kvzip_event --context 2048 --reps 3

Prints one line per replay and the medians; the numbers depend on the machine's
load (the line prints the load average), so compare the two modes of one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.bench.kvzip_event", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--reps", type=int, default=3, help="timed replays per mode after the first (compiling) one")
    args = p.parse_args(argv)

    import jaxkv
    from eval.quality.real_model import Cell, pass_positions
    from jaxkv.engine import jobs as jobs_mod
    from jaxkv.serving import Session
    from jaxkv.serving.stages import reconstruction
    from jaxkv.tasks import real

    model = jaxkv.load_model(args.model)
    (example,) = real.examples("multiq", 1, length=args.context, tokenizer=model.tokenizer)
    plan = real.plans(example, model.tokenizer, "agnostic")[0]
    n = int(plan.compressed.size)
    positions = pass_positions([Cell("kvzip", 0.5, ())], model, n, n + 512)
    messages = example.messages("agnostic")[:2]  # system + the document's turn: compressed when its prefill ends

    clock = {"score": 0.0, "passes": 0.0}
    score = reconstruction._score

    def timed_score(*a):
        t0 = time.perf_counter()
        out = jax.block_until_ready(score(*a))
        clock["score"] += time.perf_counter() - t0
        return out

    run_passes = reconstruction.run_passes

    def timed_passes(turn, config):
        t0 = time.perf_counter()
        out = yield from run_passes(turn, config)
        clock["passes"] += time.perf_counter() - t0
        return out

    reconstruction._score = timed_score
    reconstruction.run_passes = timed_passes
    original = jobs_mod.PrefillJob.__post_init__

    def replay(wide: bool) -> dict:
        def post_init(job):
            original(job)
            if job.wide_capture and not wide:
                job.wide_capture = False  # the old path: pieces cut to the capture cap

        jobs_mod.PrefillJob.__post_init__ = post_init
        clock.update(score=0.0, passes=0.0)
        session = Session(model, max_positions=positions, protect_query=False, policy="kvzip", budget=n // 2)
        try:
            t0 = time.perf_counter()
            session.replay(messages, generate=False)
            turn = time.perf_counter() - t0
            (event,) = session.compressions
            return {
                "turn": turn,
                "passes": clock["passes"],
                "score": clock["score"],
                "forward": clock["passes"] - clock["score"],
                "tokens": event.scoring_tokens,
            }
        finally:
            session.close()
            jobs_mod.PrefillJob.__post_init__ = original

    results = {"capped": [], "wide": []}
    for rep in range(args.reps + 1):
        for mode in ("capped", "wide"):
            r = replay(mode == "wide")
            load = os.getloadavg()[0]
            tag = "compile" if rep == 0 else f"rep {rep}"
            print(
                f"{mode:6s} {tag:7s} turn {r['turn']:6.1f} s  passes {r['passes']:6.1f} s (forward {r['forward']:5.1f}, "
                f"scoring {r['score']:5.1f})  {r['tokens']} tokens  load {load:.2f}",
                flush=True,
            )
            if rep:
                results[mode].append(r)
    for mode, rs in results.items():
        if rs:
            med = {k: float(np.median([r[k] for r in rs])) for k in ("turn", "passes", "forward", "score")}
            print(
                f"median {mode}: turn {med['turn']:.1f} s, passes {med['passes']:.1f} s (forward {med['forward']:.1f}, scoring {med['score']:.1f}); {n} context tokens"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
