"""This tree's engine against the engine of another commit: same logits within 1e-5.

    python -m eval.profile.engine_parity [--old 44e9456] [--out eval/results/engine_parity.md]

The other engine (the default ``--old``: the one before the token-budget step; the
engine in parts was checked against 687d1db, ``eval/results/engine_parity_parts.md``) is
checked out from git at ``--old`` into a scratch worktree and run in its own
process; this tree's engine in another. Both run the same requests on the same
weights (float32): tiny random Llama, Qwen2 and Qwen3 checkpoints (built with
transformers, as the tests build them) and SmolLM2-135M-Instruct (the real model,
``jaxkv fetch smollm2-135m-instruct``). Per model, two rows of different lengths
are prefilled in chunks (all logits), then decode teacher-forced tokens (every
step's logits), and a third row reads a prefix with evicted holes; the report gives
each model's worst logit error relative to its largest logit, new against old,
and both against the cache-free dense forward (``jaxkv.score_logits``) where it
applies. A run writes one markdown table.

Why a script and not a test: the old engine is history (deleted from the tree in
the same change), and running it needs a second checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from jaxkv.markdown import md_table

ROOT = Path(__file__).resolve().parents[2]
OLD = "44e9456"  # main before the token-budget engine
TOL = 1e-5

# One request set per model: (prompt lengths, prefill chunk, decode steps, hole positions of row 2's prefix).
SMALL = dict(lengths=(70, 45), chunk=32, decode=24, holes=(5, 6, 7, 20), positions=256)
REAL = dict(lengths=(700, 1300), chunk=512, decode=16, holes=(3, 4, 100, 101, 102), positions=2048)

RUNNER = r"""
import json, sys
import numpy as np
import jaxkv
from jaxkv.cache.allocator import SENTINEL_SLOT

spec = json.loads(sys.argv[1])
model = jaxkv.load_model(spec["model"], dtype="float32")
rng = np.random.default_rng(0)
V = min(model.config.vocab_size, 30000)
seqs = [rng.integers(1, V, n + spec["decode"] + 1).tolist() for n in spec["lengths"]]
kw = {"prefill_chunk": spec["chunk"]}
engine = jaxkv.Engine(model, rows=3, max_positions=spec["positions"], **kw)
rows = [engine.open_row() for _ in seqs]
pre = engine.prefill(rows, [s[:n] for s, n in zip(seqs, spec["lengths"])], all_logits=True)
_, dec = engine.decode(rows, [s[n] for s, n in zip(seqs, spec["lengths"])], spec["decode"], return_logits=True,
                       forced_tokens=[s[n + 1 : n + 1 + spec["decode"]] for s, n in zip(seqs, spec["lengths"])])
out = {f"row{i}": np.concatenate([p, d]) for i, (p, d) in enumerate(zip(pre, dec))}
n0 = spec["lengths"][0]
slots = [SENTINEL_SLOT if p in spec["holes"] else s for p, s in enumerate(engine.row_state[rows[0]].slots[:n0])]
holed = engine.open_row(slots)
out["holes"] = engine.prefill([holed], [seqs[0][n0 : n0 + 8]], all_logits=True)[0]
np.savez(spec["out"], **out)
"""


def run(tree: Path, spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "JAX_PLATFORMS": "cpu", "JAXKV_XLA_CACHE": "off"}
    subprocess.run([sys.executable, "-c", RUNNER, json.dumps(spec)], check=True, env=env, cwd=tree)
    with np.load(spec["out"]) as f:
        return {k: f[k] for k in f.files}


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", default=OLD, help="git revision of the engine to compare against")
    p.add_argument("--out", default=str(ROOT / "eval/results/engine_parity.md"))
    p.add_argument("--models", default="llama,qwen2,qwen3,smollm2-135m-instruct")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    import hf_models  # noqa: E402 (the tests' tiny checkpoint builder)

    scratch = Path(tempfile.mkdtemp(prefix="jaxkv-parity-"))
    old_tree = scratch / "old"
    subprocess.run(["git", "worktree", "add", "--detach", str(old_tree), args.old], check=True, cwd=ROOT, capture_output=True)
    rows = []
    try:
        for name in args.models.split(","):
            if name in hf_models.FAMILIES:
                folder = scratch / name
                hf_models.build(name, folder)
                spec = dict(SMALL, model=str(folder))
            else:
                spec = dict(REAL, model=name)
            old = run(old_tree, dict(spec, out=str(scratch / f"{name}-old.npz")))
            new = run(ROOT, dict(spec, out=str(scratch / f"{name}-new.npz")))
            worst = max(rel(new[k], old[k]) for k in old)
            rows.append((name, worst, {k: rel(new[k], old[k]) for k in old}))
            print(f"{name}: worst relative logit error new vs old {worst:.2e}", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT, capture_output=True)
    lines = [
        f"# Engine parity: this engine against {args.old}'s",
        "",
        f"Generated by `python -m eval.profile.engine_parity --old {args.old}` (float32, CPU). Each cell is the worst",
        "logit error relative to the largest logit, new engine against old, over two chunked prefills with",
        "all logits plus teacher-forced decode steps (`row0`, `row1`) and a prefill over a prefix with evicted",
        f"holes (`holes`). Bound: {TOL:g}.",
        "",
        md_table(
            ["model", "row0", "row1", "holes", "worst", "within bound"],
            [
                [name, f"{per['row0']:.1e}", f"{per['row1']:.1e}", f"{per['holes']:.1e}", f"{worst:.1e}", "yes" if worst <= TOL else "NO"]
                for name, worst, per in rows
            ],
            align="lrrrrl",
        ),
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    if any(worst > TOL for _, worst, _ in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
