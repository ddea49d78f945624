"""Token-set granularity at equal KV: one set per (layer, KV head), per layer, or one for all (issue #32, item 6).

    python -m eval.token_sets --task niah_single --context 2048 --n 50 --threads 1 \\
        --out eval/results/real_smollm2/token_sets --resume
    python -m eval.token_sets --report --out eval/results/real_smollm2/token_sets

What it is for
--------------
jaxkv keeps one token set per request, shared by every layer and KV head
(ALGORITHMS.md §1: scores averaged over layers and expanded heads, because an
eviction edits the request's one slot map and live list). kvpress's presses keep
``n_kept`` tokens per layer and KV head (``ScorerPress.compress``), and TOVAPress
one set per layer (its score is already the head mean). On SmolLM2 the report
finds per-layer TOVAPress 20-36 points above jaxkv's TOVA on niah, and per-head
SnapKVPress 24-36 points below jaxkv's SnapKV on passkey and niah. Item 6 asks to
measure whether the granularity is what decides, before changing the paged layout.

This holds everything else fixed: the scorer (kvpress's own ``score`` of each
press, with its defaults), the prefill, the continuation and the examples
(``eval.kvpress_side``'s pipeline, the report's examples) and the KV kept (every
granularity keeps ``compute_n_kept(n, ratio)`` tokens in every layer and KV head),
and varies only where the top-k is taken:

* ``head``: per layer and KV head, the press's own ``compress`` (the kvpress cell);
* ``layer``: per layer, from the score averaged over the layer's KV heads, the same
  tokens for every head of the layer (PyramidKV-style per-layer sets at a uniform
  budget);
* ``one``: one set for the whole model, from the score averaged over layers and KV
  heads: jaxkv's rule, with kvpress's scorer.

``one`` needs every layer's score before it can select, so its ``compress`` returns
the layer's head-averaged score (``LayerScores``) and the selection runs after the
shared prefill (``select_one_sets``), gathering each layer's rows from the full
cache. TOVAPress's ``head`` cell equals its ``layer`` cell (the score is a head
mean, repeated), so it is not run.

Journal: ``OUT/examples.jsonl``, one line per example in ``eval.kvpress_side``'s
format (cells ``PRESS/GRANULARITY@RATIO``), so its ``summary`` reads it; ``--resume``
skips what is there. ``--report`` writes ``OUT/README.md`` (accuracy per cell and the
paired gain of ``layer`` and ``head`` over ``one``, under the findings written by hand
in ``OUT/summary.md``) and ``OUT/token_sets.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from eval import kvpress_side as kp

GRANULARITIES = ("head", "layer", "one")
SCORERS = ("SnapKVPress", "TOVAPress", "ObservedAttentionPress", "KeyDiffPress")
HEAD_MEAN_SCORERS = frozenset({"TOVAPress"})  # the score is already a head mean: `head` is `layer`
RATIOS = kp.RATIOS
OUT = Path("eval/results/real_smollm2/token_sets")


@dataclasses.dataclass
class LayerScores:
    """A ``one`` cell's layer, before every layer's score is known: (1, n) head-averaged scores."""

    scores: object


class TokenSetPress:
    """A kvpress ``ScorerPress`` (``base``) whose top-k is taken per ``granularity``.
    Called by ``kvpress_side.shared_prefill`` exactly as the press itself would be."""

    def __init__(self, base, granularity: str):
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity {granularity!r}: choose from {GRANULARITIES}")
        self.base, self.granularity = base, granularity

    @property
    def compression_ratio(self) -> float:
        return self.base.compression_ratio

    def post_init_from_model(self, model) -> None:
        self.base.post_init_from_model(model)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.granularity == "head":
            return self.base.compress(module, hidden_states, keys, values, attentions, kwargs)
        pooled = self.base.score(module, hidden_states, keys, values, attentions, kwargs).float().mean(1)  # (1, n)
        if self.granularity == "one":
            return LayerScores(pooled)
        return gather_rows(keys, values, top_rows(pooled, keys.shape[2], self.compression_ratio))


def top_rows(pooled, n: int, ratio: float):
    """The kept positions, (1, n_kept), from (1, n) scores (kvpress's count)."""
    from kvpress.utils import compute_n_kept

    return pooled.topk(compute_n_kept(n, ratio), dim=-1).indices


def gather_rows(keys, values, rows):
    """The same kept positions ``rows`` (1, k) for every KV head of one layer."""
    idx = rows[:, None, :, None].expand(keys.shape[0], keys.shape[1], rows.shape[-1], keys.shape[-1])
    return keys.gather(2, idx).contiguous(), values.gather(2, idx).contiguous()


def select_one_sets(prefill: kp.Prefill, presses: dict) -> None:
    """Replace each ``one`` cell's per-layer ``LayerScores`` with the rows of one set
    chosen from the mean over layers, gathered from every layer's full cache."""
    for name, press in presses.items():
        layers = prefill.cells[name]
        if not isinstance(layers[0], LayerScores):
            continue
        mean = sum(layer.scores for layer in layers) / len(layers)
        rows = top_rows(mean, prefill.length, press.compression_ratio)
        prefill.cells[name] = [gather_rows(k, v, rows) for k, v in prefill.full]


def cell_name(scorer: str, granularity: str, ratio: float) -> str:
    return kp.cell_name(f"{scorer}/{granularity}", ratio)


def make_presses(scorers, ratios) -> dict:
    return {cell_name(s, g, r): TokenSetPress(kp.make_press(s, r), g)
            for s in scorers for g in GRANULARITIES if not (g == "head" and s in HEAD_MEAN_SCORERS) for r in ratios}


def run_setting(model, tokenizer, example, setting: str, scorers, ratios, *, stops, greedy: bool = False) -> dict:
    """Every cell of one example in one setting from one shared prefill (eager when a
    scorer reads the attention weights), continued and scored as ``kvpress_side`` does;
    teacher forced only unless ``greedy`` (the granularity moves the digits' argmax
    the same way; greedy replies would triple the cost)."""
    from jaxkv import tasks

    presses = make_presses(scorers, ratios)
    attn = "eager" if kp.EAGER_PRESSES & set(scorers) else None
    plan = tasks.token_plan(example, tokenizer, setting)
    prefill = kp.shared_prefill(model, plan.compressed, presses, example.seed, attn)
    select_one_sets(prefill, presses)
    return kp.score_cells(model, tokenizer, example, plan, prefill, stops=stops, greedy=greedy)


# --------------------------------------------------------------------------- report
def read(path: Path) -> dict:
    """{(task, context, setting): {cell: {seed: cell record}}} from the journal."""
    out: dict = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            for setting, res in rec["settings"].items():
                for name, cell in res["cells"].items():
                    out.setdefault((rec["example_task"], rec["context"], setting), {}).setdefault(name, {})[rec["seed"]] = cell
    return out


def split(name: str) -> tuple[str, str, float]:
    """``PRESS/GRANULARITY@RATIO`` -> (press, granularity, ratio)."""
    press, ratio = name.rsplit("@", 1)
    scorer, granularity = press.split("/")
    return scorer, granularity, float(ratio)


def report(out: Path) -> str:
    from eval.real_model_report import findings, paired

    tables = read(out / "examples.jsonl")
    lines = ["# Token-set granularity at equal KV (issue #32, item 6)", "",
             "Generated by `python -m eval.token_sets --report --out " + str(out) + "` from `examples.jsonl` "
             "(`python -m eval.token_sets ... --resume`). SmolLM2-135M-Instruct in transformers, float32, CPU, "
             "kvpress's scorers with their defaults; every cell keeps the same number of tokens in every layer and "
             "KV head. `head`: top-k per (layer, KV head), kvpress's own cell; `layer`: per layer from the head-mean "
             "score; `one`: one set for the model from the mean over layers and heads (jaxkv's rule). Teacher-forced "
             "accuracy (every answer digit is its row's argmax), %; gains in points with a paired bootstrap 95% "
             "interval over examples.", "", *findings(out)]
    for (task, context, setting), cells in sorted(tables.items()):
        full = cells.get(kp.FULL, {})
        n = len(full)
        acc = 100 * np.mean([c["tf_correct"] for c in full.values()]) if n else float("nan")
        lines += [f"## {task}, {context} tokens, question-{setting}", "", f"Full cache: {acc:.0f}% (n = {n}).", "",
                  "| scorer | ratio | head | layer | one | layer - one | head - one |", "|---|---:|---:|---:|---:|---:|---:|"]
        combos = sorted({split(c)[0::2] for c in cells if c != kp.FULL})
        for scorer, ratio in combos:
            got = {g: cells.get(cell_name(scorer, g, ratio)) for g in GRANULARITIES}
            accs = [f"{100 * np.mean([c['tf_correct'] for c in got[g].values()]):.0f}" if got[g] else "-" for g in GRANULARITIES]
            gains = []
            for g in ("layer", "head"):
                res = paired({s: {"v": float(c["tf_correct"])} for s, c in got[g].items()},
                             {s: {"v": float(c["tf_correct"])} for s, c in got["one"].items()}, "v") if got[g] and got["one"] else None
                gains.append(f"{100 * res[0]:+.0f} [{100 * res[1]:+.0f}, {100 * res[2]:+.0f}]" if res else "-")
            lines.append(f"| {scorer} | {ratio:g} | {' | '.join(accs)} | {' | '.join(gains)} |")
        lines.append("")
    plot(out, tables)
    if (out / "token_sets.png").is_file():
        lines += ["![accuracy vs ratio per granularity](token_sets.png)", ""]
    return "\n".join(lines)


def plot(out: Path, tables: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    keys = sorted(tables)
    scorers = sorted({split(c)[0] for cells in tables.values() for c in cells if c != kp.FULL})
    if not keys or not scorers:
        return
    fig, axes = plt.subplots(len(keys), len(scorers), figsize=(3.6 * len(scorers), 3.2 * len(keys)), squeeze=False)
    style = {"head": ("tab:red", "o"), "layer": ("tab:blue", "s"), "one": ("tab:green", "^")}
    for i, key in enumerate(keys):
        cells = tables[key]
        full = cells.get(kp.FULL, {})
        for j, scorer in enumerate(scorers):
            ax = axes[i][j]
            if full:
                ax.axhline(100 * np.mean([c["tf_correct"] for c in full.values()]), color="grey", ls=":", label="full cache")
            for g in GRANULARITIES:
                pts = sorted((split(c)[2], 100 * np.mean([v["tf_correct"] for v in cells[c].values()]))
                             for c in cells if c != kp.FULL and split(c)[:2] == (scorer, g))
                if pts:
                    ax.plot(*zip(*pts), marker=style[g][1], color=style[g][0], label=g)
            ax.set_title(f"{scorer} · {key[0]} {key[1]} {key[2]}", fontsize=8)
            ax.set_ylim(-3, 103)
            ax.set_xlabel("fraction of KV removed")
            if j == 0:
                ax.set_ylabel("teacher-forced accuracy (%)")
            if j == 0:
                ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(out / "token_sets.png", dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- driver
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.token_sets", description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=[t for t in kp.TASK_CHOICES if t != "lm"], default="niah_single")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--first", type=int, default=0, help="skip the first examples (split a run)")
    ap.add_argument("--ratios", default=",".join(f"{r:g}" for r in RATIOS))
    ap.add_argument("--scorers", default=",".join(SCORERS))
    ap.add_argument("--settings", default=",".join(kp.SETTINGS))
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--greedy", action="store_true", help="also decode greedy replies (teacher forced only by default)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--report", action="store_true", help="write OUT/README.md and the plot from the journal, and exit")
    args = ap.parse_args(argv)
    if args.report:
        text = report(args.out)
        (args.out / "README.md").write_text(text)
        print(text)
        return 0

    import torch

    torch.set_num_threads(args.threads)
    kp.import_kvpress()
    scorers = [s for s in args.scorers.split(",") if s]
    unknown = set(scorers) - set(SCORERS)
    if unknown:
        ap.error(f"unknown scorers {sorted(unknown)}; choose from {SCORERS}")
    ratios = [float(r) for r in args.ratios.split(",") if r]
    settings = [s for s in args.settings.split(",") if s]
    folder = kp.model_folder(kp.MODEL)
    tokenizer = kp.load_tokenizer(folder)
    model = kp.load_hf(folder, "sdpa")
    stops = kp.stop_ids(tokenizer, model)
    examples = kp.eval_examples(args.task, args.first + args.n, args.context, tokenizer)[args.first :]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "examples.jsonl"
    done = kp.done_keys(path) if args.resume else set()
    todo = [ex for ex in examples if (ex.task, ex.length, ex.seed) not in done]
    setup = {"model": kp.MODEL, "dtype": "float32", "device": "cpu", "threads": args.threads, "ratios": ratios,
             "scorers": {s: kp.press_defaults(s) for s in scorers}, "granularities": list(GRANULARITIES),
             "settings": settings, "greedy": args.greedy, "versions": kp._versions()}
    kp.journal_examples(todo, settings,
                        lambda ex, setting: run_setting(model, tokenizer, ex, setting, scorers, ratios, stops=stops, greedy=args.greedy),
                        path, setup, task=args.task, context=args.context, desc="token sets")
    return 0

if __name__ == "__main__":
    sys.exit(main())
