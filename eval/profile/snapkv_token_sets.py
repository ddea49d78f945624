"""Why kvpress's SnapKVPress loses passkey on SmolLM2 while jaxkv's SnapKV keeps it (issue #32).

    JAX_PLATFORMS=cpu python -m eval.profile.snapkv_token_sets --n 8

The two differ in two ways: kvpress's defaults (window 64, average pooling of width 5)
against jaxkv's (window 32, max pooling of width 7), and the token sets: kvpress
keeps a top-k per layer and KV head, jaxkv one set for all of them. This runs
jaxkv's SnapKV with kvpress's window and pooling on the same passkey examples and
setting (question-aware, 2k) as the report, branched from one prefill as
``eval.quality.real_model`` does. If it still keeps the needle, the gap is the per-head sets.
"""

from __future__ import annotations

import argparse
import sys

KVPRESS_SNAPKV = {"w": 64, "kernel": 5, "pooling": "avg"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.profile.snapkv_token_sets", description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--setting", default="aware")
    args = p.parse_args(argv)

    import jaxkv
    from eval.quality import real_model
    from jaxkv.tasks import haystack
    from train.haystack_measure import positions_for

    model = jaxkv.load_model("smollm2-135m-instruct")
    options = tuple(sorted(KVPRESS_SNAPKV.items()))
    cells = [real_model.Cell(None)] + [real_model.Cell("snapkv", r, options) for r in real_model.RATIOS]
    correct: dict = {}
    for ex in haystack.examples("passkey", args.n, length=args.context, tokenizer=model.tokenizer):
        rec = real_model.run_example(model, ex, args.setting, cells, positions=positions_for(args.context))
        for name, cell in rec["cells"].items():
            correct.setdefault(name, []).append(cell["tf_correct"])
    print(f"jaxkv SnapKV with {KVPRESS_SNAPKV}, one token set; passkey {args.context}, {args.setting}, teacher forced:")
    for name, v in correct.items():
        print(f"  {name}: {sum(v)}/{len(v)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
