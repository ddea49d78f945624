"""Exact match per scored-turn kind on held-out shared_docs, prefix caching only.

    JAX_PLATFORMS=cpu python -m eval.profile.reuse_turn_kinds [--task agent] [--n 100]

Where the embedded model stands on the reuse workload (docs/reuse.md): the same
100 sessions as ``eval.quality.reuse_report``'s headline, one shared ``Server``; with
``--task agent``, the same count of held-out agent traces (2048 tokens) for
comparison.
"""

import argparse, collections, jaxkv
from eval.quality import harness
from jaxkv.tasks.seeds import EVAL_SEED_BASE
from train import replay


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--task", default="shared_docs", choices=("shared_docs", "agent"))
    p.add_argument("--n", type=int, default=100)
    args = p.parse_args()
    model = jaxkv.load_model("embedded")
    exs = harness.make_examples(args.task, args.n, 2048, EVAL_SEED_BASE)
    server = jaxkv.Server(model, max_positions=4096)
    cell = replay.Cell("full", None, None, args.task)
    tot = collections.Counter()
    ok = collections.Counter()
    for ex in exs:
        v, _, _, _ = replay.replay_example(model, ex, cell, max_new_tokens=64, max_positions=4096, server=server)
        for t, good in zip(ex.targets, v):
            kind = t.kind if t.kind == "answer" else t.expected["name"]
            tot[kind] += 1
            ok[kind] += good
    for k in tot:
        print(f"{args.task} {k}: {ok[k]}/{tot[k]} = {ok[k] / tot[k]:.3f}")
    print(f"{args.task} all: {sum(ok.values())}/{sum(tot.values())} = {sum(ok.values()) / sum(tot.values()):.3f}")


if __name__ == "__main__":
    main()
