"""Exact match per scored-turn kind on held-out shared_docs, prefix caching only.

    JAX_PLATFORMS=cpu python -m eval.reuse_turn_kinds

Where the embedded model stands on the reuse workload (docs/reuse.md): the same
100 sessions as ``eval.reuse_report``'s headline, one shared ``Server``.
"""

import collections, jaxkv
from eval import harness


def main() -> None:
    model = jaxkv.load_model("embedded")
    exs = harness.make_examples("shared_docs", 100, 0, harness.EVAL_SEED_BASE)
    server = jaxkv.Server(model, max_positions=4096)
    cell = harness.Cell("full", None, None, "shared_docs")
    tot = collections.Counter(); ok = collections.Counter()
    for ex in exs:
        v, _, _, _ = harness.replay_example(model, ex, cell, max_new_tokens=64, max_positions=4096, server=server)
        for t, good in zip(ex.targets, v):
            kind = t.kind if t.kind == "answer" else t.expected["name"]
            tot[kind] += 1; ok[kind] += good
    for k in tot: print(f"{k}: {ok[k]}/{tot[k]} = {ok[k]/tot[k]:.3f}")
    print("all", sum(ok.values()), sum(tot.values()))


if __name__ == "__main__":
    main()
