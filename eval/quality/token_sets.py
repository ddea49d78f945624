"""Token-set granularity at equal KV: one set per (layer, KV head), per layer, or one for all (issue #32, item 6).

    python -m eval.quality.token_sets --task niah_single --context 2048 --n 50 --threads 1 \\
        --out eval/results/real_smollm2/token_sets --resume
    python -m eval.quality.token_sets --report --out eval/results/real_smollm2/token_sets

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
(``eval.quality.kvpress_side``'s pipeline, the report's examples) and the KV kept (every
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

Journal: ``OUT/examples.jsonl``, one line per example in ``eval.quality.kvpress_side``'s
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

from eval.quality import kvpress_side as kp
from jaxkv.markdown import md_header, md_row
from jaxkv.policies.h2o import H2OConfig

GRANULARITIES = ("head", "layer", "one")
ACCUMULATED = "AccumulatedAttentionPress"
EXPECTED = "ExpectedAttentionPress"
# ExpectedAttentionPress with one of jaxkv's departures each (jaxkv/policies/expected_attention.py):
# no value-norm rescale; and also the statistics of the last EA_WINDOW queries only
EA_NO_VNORM, EA_WINDOW = "ExpectedAttentionPress-novnorm", "ExpectedAttentionPress-window"
EA_WINDOW_ROWS = 256  # jaxkv's observation window (ExpectedAttentionConfig.w)
# kvpress's presses, plus ACCUMULATED and the EA variants (below); the first four are the default run
SCORERS = (
    "SnapKVPress",
    "TOVAPress",
    "ObservedAttentionPress",
    "KeyDiffPress",
    "RandomPress",
    ACCUMULATED,
    EXPECTED,
    EA_NO_VNORM,
    EA_WINDOW,
)
DEFAULT_SCORERS = SCORERS[:4]
H2O_RECENT = H2OConfig().recent  # jaxkv's H2O recent floor (32)

EAGER_SCORERS = kp.EAGER_PRESSES | {ACCUMULATED}  # read the prefill's attention weights
HEAD_MEAN_SCORERS = frozenset({"TOVAPress"})  # the score is already a head mean: `head` is `layer`
# a one-set cell and the jaxkv method whose rule it is (ALGORITHMS.md §2), compared on the same examples
JAXKV_RULES = {
    "TOVAPress/one": "tova",
    "RandomPress/one": "random",
    f"{ACCUMULATED}/one": "h2o",
    "ObservedAttentionPress/one": "h2o",
    f"{EA_WINDOW}/one": "expected_attention",
}
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


_ACCUMULATED_CLASS = None


def accumulated_attention_press(ratio: float, recent: int = H2O_RECENT):
    """jaxkv's H2O score (ALGORITHMS.md §2) in kvpress's frame: the attention mass each
    token received from every prefill query, summed, not divided by the number of
    queries that could see it (ObservedAttentionPress divides, so late tokens are not
    outranked by early ones for being seen less), with the ``recent`` last positions
    always kept (H2O's recent floor, jaxkv's default 32). With the ``one`` granularity
    this is jaxkv's rule with kvpress's prefill. A subclass of kvpress's press, written
    here because kvpress has neither the raw sum nor the floor."""
    global _ACCUMULATED_CLASS
    if _ACCUMULATED_CLASS is None:
        kp.import_kvpress()
        from kvpress import ObservedAttentionPress

        @dataclasses.dataclass
        class AccumulatedAttentionPress(ObservedAttentionPress):
            recent: int = H2O_RECENT

            def score(self, module, hidden_states, keys, values, attentions, kwargs):
                assert attentions is not None, "needs the eager attention weights"
                bsz, kv_heads, n, _ = keys.shape
                scores = attentions.sum(2).view(bsz, kv_heads, -1, n).mean(2)
                if self.recent:
                    scores[..., max(n - self.recent, 0) :] = float("inf")
                return scores

        _ACCUMULATED_CLASS = AccumulatedAttentionPress
    return _ACCUMULATED_CLASS(compression_ratio=ratio, recent=recent)


_EA_WINDOW_CLASS = None


def expected_attention_press(ratio: float, *, vnorm: bool, window: int | None):
    """kvpress's ExpectedAttentionPress with jaxkv's departures, one at a time, so a
    difference between the two sides can be put on its cause: ``vnorm=False`` drops the
    value-norm rescale (kvpress's own option); ``window`` takes the query statistics
    from the last ``window`` prompt rows only, as jaxkv's observation window does (the
    future positions still start at the prompt's end). A subclass of kvpress's press,
    written here because kvpress has no window option."""
    global _EA_WINDOW_CLASS
    kvpress = kp.import_kvpress()
    if window is None:
        return kvpress.ExpectedAttentionPress(compression_ratio=ratio, use_vnorm=vnorm)
    if _EA_WINDOW_CLASS is None:

        @dataclasses.dataclass
        class WindowExpectedAttentionPress(kvpress.ExpectedAttentionPress):
            window: int = EA_WINDOW_ROWS

            def get_query_statistics(self, module, hidden_states):
                import torch

                # The parent drops the first n_sink rows and averages the rest: hand it the last
                # `window` rows behind n_sink rows for it to drop.
                n = hidden_states.shape[1]
                start = max(n - self.window, self.n_sink)
                h = hidden_states[:, start - self.n_sink :]
                mu, cov = super().get_query_statistics(module, h)
                # It rotated them to the positions after len(h), not after n. RoPE's rotations
                # compose, R(a) R(t) = R(a + t), so the mean rotation over [n, n + F) is R(n - len(h))
                # times the one it applied: move mu and cov on by that shift.
                shift = n - h.shape[1]
                if shift:
                    cos, sin = module.rotary_emb(mu, torch.tensor([[shift]], device=mu.device))
                    d = mu.shape[-1]
                    half = torch.eye(d // 2, dtype=cos.dtype, device=cos.device)
                    rotate_half = torch.zeros((d, d), dtype=cos.dtype, device=cos.device)
                    rotate_half[d // 2 :, : d // 2], rotate_half[: d // 2, d // 2 :] = half, -half
                    R = torch.diag(cos[0, 0]) + torch.diag(sin[0, 0]) @ rotate_half
                    mu = mu @ R.T
                    cov = R @ cov @ R.T if cov is not None else None
                return mu, cov

        _EA_WINDOW_CLASS = WindowExpectedAttentionPress
    return _EA_WINDOW_CLASS(compression_ratio=ratio, use_vnorm=vnorm, window=window)


def make_scorer(name: str, ratio: float):
    """The press named ``name`` at ``ratio``: kvpress's own, ``ACCUMULATED`` or an EA variant."""
    if name == ACCUMULATED:
        return accumulated_attention_press(ratio)
    if name in (EA_NO_VNORM, EA_WINDOW):
        return expected_attention_press(ratio, vnorm=False, window=EA_WINDOW_ROWS if name == EA_WINDOW else None)
    return kp.make_press(name, ratio)


def scorer_settings(name: str) -> dict:
    """The scorer's settings other than the ratio, for the journal's setup line."""
    press = make_scorer(name, 0.0)
    return {f.name: getattr(press, f.name) for f in dataclasses.fields(press) if f.name != "compression_ratio"}


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
    return {
        cell_name(s, g, r): TokenSetPress(make_scorer(s, r), g)
        for s in scorers
        for g in GRANULARITIES
        if not (g == "head" and s in HEAD_MEAN_SCORERS)
        for r in ratios
    }


def run_setting(model, tokenizer, example, setting: str, scorers, ratios, *, stops, greedy: bool = False) -> dict:
    """Every cell of one example in one setting from one shared prefill (eager when a
    scorer reads the attention weights), continued and scored as ``kvpress_side`` does;
    teacher forced only unless ``greedy`` (the granularity moves the digits' argmax
    the same way; greedy replies would triple the cost)."""
    from jaxkv import tasks

    presses = make_presses(scorers, ratios)
    attn = "eager" if EAGER_SCORERS & set(scorers) else None
    plan = tasks.token_plan(example, tokenizer, setting)
    prefill = kp.shared_prefill(model, plan.compressed, presses, example.seed, attn)
    select_one_sets(prefill, presses)
    return kp.score_cells(model, tokenizer, example, plan, prefill, stops=stops, greedy=greedy)


# --------------------------------------------------------------------------- report
def read(out: Path) -> dict:
    """{(task, context, setting): {cell: {seed: cell record}}} from every journal in
    ``out`` (``examples.jsonl``, then ``examples_*.jsonl``: more scorers on the same
    examples, ``--journal``); the cells of one example merge across them."""
    tables: dict = {}
    for path in [out / "examples.jsonl", *sorted(p for p in out.glob("examples*.jsonl") if p.name != "examples.jsonl")]:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                for setting, res in rec["settings"].items():
                    for name, cell in res["cells"].items():
                        tables.setdefault((rec["example_task"], rec["context"], setting), {}).setdefault(name, {})[rec["seed"]] = cell
    return tables


def split(name: str) -> tuple[str, str, float]:
    """``PRESS/GRANULARITY@RATIO`` -> (press, granularity, ratio)."""
    press, ratio = name.rsplit("@", 1)
    scorer, granularity = press.split("/")
    return scorer, granularity, float(ratio)


def cell_values(task: str, cells: dict, name: str) -> dict:
    """{seed: the per-example score} of a cell: the teacher-forced verdict (0/1), or on
    ``lm`` the NLL increase over the full cache (nats per token; lower is better)."""
    if task != "lm":
        return {s: float(c["tf_correct"]) for s, c in cells.get(name, {}).items()}
    full = cells.get(kp.FULL, {})
    return {s: c["nll"] - full[s]["nll"] for s, c in cells.get(name, {}).items() if s in full}


def fmt_gain(task: str, res) -> str:
    if res is None:
        return "-"
    if task == "lm":
        return f"{res[0]:+.3f} [{res[1]:+.3f}, {res[2]:+.3f}]"
    return f"{100 * res[0]:+.0f} [{100 * res[1]:+.0f}, {100 * res[2]:+.0f}]"


def fmt_mean(task: str, values: dict) -> str:
    if not values:
        return "-"
    m = float(np.mean(list(values.values())))
    return f"{m:+.3f}" if task == "lm" else f"{100 * m:.0f}"


def paired_values(a: dict, b: dict):
    """Paired gain of ``a`` over ``b`` on their common examples: (mean, lo, hi, n)."""
    from eval.quality.real_model_report import paired

    return paired({s: {"v": v} for s, v in a.items()}, {s: {"v": v} for s, v in b.items()}, "v")


def side_rows(out: Path, tables: dict, side: str, rules: dict) -> list[str]:
    """Table rows setting a token-set cell beside a cell of ``side``'s own journals (in
    ``out``'s parent, the report's root) on the examples both ran: ``rules`` maps
    ``PRESS/GRANULARITY`` to the other side's method or press. Differences are the
    other side minus the token-set cell, paired."""
    from eval.quality import real_model_report as rr

    theirs_all = rr.verdicts([r for path in rr.journals(out.parent / side) for r in rr.read(path)])
    lines = []
    for key, cells in sorted(tables.items()):
        task, theirs = key[0], theirs_all.get(key)
        if not theirs:
            continue
        for cell in sorted(c for c in cells if c != kp.FULL):
            scorer, granularity, ratio = split(cell)
            method = rules.get(f"{scorer}/{granularity}")
            name = f"{method}@{ratio:g}"
            if method is None or name not in theirs:
                continue
            other, mine = cell_values(task, theirs, name), cell_values(task, cells, cell)
            res = paired_values(other, mine)
            if res is None:
                continue
            common = set(other) & set(mine)
            lines.append(
                md_row(
                    [
                        f"{task} {key[1]} {key[2]}",
                        cell,
                        name,
                        res[3],
                        fmt_mean(task, {s: mine[s] for s in common}),
                        fmt_mean(task, {s: other[s] for s in common}),
                        fmt_gain(task, res),
                    ]
                )
            )
    return lines


def counterpart_rows(out: Path, tables: dict) -> list[str]:
    """Each one-set cell beside the jaxkv method whose rule it is (``JAXKV_RULES``), and
    each ``head`` cell (TOVAPress: ``layer``) beside kvpress's own press, on the
    examples both ran: where the first agree, a jaxkv-vs-kvpress gap is what this
    report varies (the granularity, and for H2O the score), not the two pipelines."""
    own = {f"{p}/head": p for p in kp.PRESSES} | {f"{p}/layer": p for p in HEAD_MEAN_SCORERS}
    out_lines = []
    rows = side_rows(out, tables, "jaxkv", JAXKV_RULES)
    if rows:
        out_lines += [
            "## One set in kvpress's pipeline beside jaxkv's method",
            "",
            "Each one-set cell beside the jaxkv cell whose rule it is, on the examples both ran (jaxkv's "
            "journals under the report root's `jaxkv/`): accuracy in % (teacher forced) or, on `lm`, the NLL "
            "increase over each side's own full cache (nats per token, lower is better); the difference is "
            "jaxkv minus the one-set cell with a paired bootstrap 95% interval. What still differs: the "
            "pipelines (jaxkv's engine, transformers), jaxkv's pinned system prompt (none on `lm`), and "
            "the random draws.",
            "",
            *md_header(["task", "one-set cell", "jaxkv cell", "n", "one set", "jaxkv", "jaxkv - one set"], "lllrrrr"),
            *rows,
            "",
        ]
    rows = side_rows(out, tables, "kvpress", own)
    if rows:
        out_lines += [
            "## kvpress's own cells, reproduced",
            "",
            "Each `head` cell (TOVAPress: `layer`) beside the press's own cell in the main report's kvpress "
            "journals, on the examples both ran (kvpress minus the cell here): zero where this pipeline "
            "is kvpress's.",
            "",
            *md_header(["task", "cell", "kvpress cell", "n", "here", "kvpress", "kvpress - here"], "lllrrrr"),
            *rows,
            "",
        ]
    return out_lines


def report(out: Path) -> str:
    from eval.quality.real_model_report import findings

    tables = read(out)
    lines = [
        "# Token-set granularity at equal KV (issue #32, item 6)",
        "",
        "Generated by `python -m eval.quality.token_sets --report --out " + str(out) + "` from `examples*.jsonl` "
        "(`python -m eval.quality.token_sets ... --resume`). SmolLM2-135M-Instruct in transformers, float32, CPU, "
        "kvpress's scorers with their defaults (and `AccumulatedAttentionPress`, H2O's raw accumulated "
        "attention); every cell keeps the same number of tokens in every layer and "
        "KV head. `head`: top-k per (layer, KV head), kvpress's own cell; `layer`: per layer from the head-mean "
        "score; `one`: one set for the model from the mean over layers and heads (jaxkv's rule). Retrieval: "
        "teacher-forced accuracy (every answer digit is its row's argmax), %, gains in points; `lm`: the NLL "
        "increase over the full cache, nats per token (lower is better), differences in nats; paired bootstrap "
        "95% intervals over examples.",
        "",
        *findings(out),
    ]
    for (task, context, setting), cells in sorted(tables.items()):
        full = cells.get(kp.FULL, {})
        n = len(full)
        if task == "lm":
            head = f"Full cache: NLL {np.mean([c['nll'] for c in full.values()]):.3f} nats per token (n = {n})." if n else "Full cache: -."
        else:
            head = f"Full cache: {100 * np.mean([c['tf_correct'] for c in full.values()]):.0f}% (n = {n})." if n else "Full cache: -."
        lines += [
            f"## {task}, {context} tokens, question-{setting}",
            "",
            head,
            "",
            *md_header(["scorer", "ratio", "head", "layer", "one", "layer - one", "head - one"], "l" + "r" * 6),
        ]
        combos = sorted({split(c)[0::2] for c in cells if c != kp.FULL})
        for scorer, ratio in combos:
            got = {g: cell_values(task, cells, cell_name(scorer, g, ratio)) for g in GRANULARITIES}
            means = [fmt_mean(task, got[g]) for g in GRANULARITIES]
            gains = [fmt_gain(task, paired_values(got[g], got["one"]) if got[g] and got["one"] else None) for g in ("layer", "head")]
            lines.append(md_row([scorer, f"{ratio:g}", *means, *gains]))
        lines.append("")
    lines += counterpart_rows(out, tables)
    plot(out, tables)
    if (out / "token_sets.png").is_file():
        lines += ["![score vs ratio per granularity](token_sets.png)", ""]
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
        cells, lm = tables[key], key[0] == "lm"
        scale = 1.0 if lm else 100.0
        for j, scorer in enumerate(scorers):
            ax = axes[i][j]
            if not any(c != kp.FULL and split(c)[0] == scorer for c in cells):
                ax.axis("off")  # this scorer did not run on this task
                continue
            if lm:
                ax.axhline(0.0, color="grey", ls=":", label="full cache")
            elif cells.get(kp.FULL):
                ax.axhline(100 * np.mean([c["tf_correct"] for c in cells[kp.FULL].values()]), color="grey", ls=":", label="full cache")
            for g in GRANULARITIES:
                pts = sorted(
                    (split(c)[2], scale * np.mean(list(cell_values(key[0], cells, c).values())))
                    for c in cells
                    if c != kp.FULL and split(c)[:2] == (scorer, g)
                )
                if pts:
                    ax.plot(*zip(*pts), marker=style[g][1], color=style[g][0], label=g)
            ax.set_title(f"{scorer} · {key[0]} {key[1]} {key[2]}", fontsize=8)
            if not lm:
                ax.set_ylim(-3, 103)
            ax.set_xlabel("fraction of KV removed")
            if j == 0:
                ax.set_ylabel("NLL increase (nats/token)" if lm else "teacher-forced accuracy (%)")
                ax.legend(fontsize=7, loc="upper left" if lm else "upper right")
    fig.tight_layout()
    fig.savefig(out / "token_sets.png", dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- driver
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.quality.token_sets", description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=kp.TASK_CHOICES, default="niah_single")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--first", type=int, default=0, help="skip the first examples (split a run)")
    ap.add_argument("--ratios", default=",".join(f"{r:g}" for r in RATIOS))
    ap.add_argument("--scorers", default=",".join(DEFAULT_SCORERS), help=f"from {','.join(SCORERS)}")
    ap.add_argument("--settings", default=",".join(kp.SETTINGS), help="aware,agnostic (lm: agnostic only)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--greedy", action="store_true", help="also decode greedy replies (teacher forced only by default)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument(
        "--journal",
        default="examples.jsonl",
        help="the journal in --out; another examples_*.jsonl adds scorers to the same examples (merged by --report)",
    )
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
    settings = ["agnostic"] if args.task == "lm" else [s for s in args.settings.split(",") if s]
    folder = kp.model_folder(kp.MODEL)
    tokenizer = kp.load_tokenizer(folder)
    model = kp.load_hf(folder, "sdpa")
    stops = kp.stop_ids(tokenizer, model)
    examples = kp.eval_examples(args.task, args.first + args.n, args.context, tokenizer)[args.first :]
    args.out.mkdir(parents=True, exist_ok=True)
    if not (args.journal.startswith("examples") and args.journal.endswith(".jsonl")):
        ap.error("--journal must be named examples*.jsonl (the report reads those)")
    path = args.out / args.journal
    done = kp.done_keys(path) if args.resume else set()
    todo = [ex for ex in examples if (ex.task, ex.length, ex.seed) not in done]
    setup = {
        "model": kp.MODEL,
        "dtype": "float32",
        "device": "cpu",
        "threads": args.threads,
        "ratios": ratios,
        "scorers": {s: scorer_settings(s) for s in scorers},
        "granularities": list(GRANULARITIES),
        "settings": settings,
        "greedy": args.greedy,
        "versions": kp._versions(),
    }
    kp.journal_examples(
        todo,
        settings,
        lambda ex, setting: run_setting(model, tokenizer, ex, setting, scorers, ratios, stops=stops, greedy=args.greedy),
        path,
        setup,
        task=args.task,
        context=args.context,
        desc="token sets",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
