"""The KV-quantization report on a real model (issue #26) from ``eval.quality.real_model --kv-quant`` journals.

    python -m eval.quality.real_model_quant_report --root eval/results/real_smollm2_quant

Reads ``ROOT/summary.md`` (the findings in prose, written by hand from the
tables; placed under the title, so regenerating keeps it), ``ROOT/quant.jsonl``
and any other ``ROOT/quant*.jsonl`` (one line per example: the float pool's full
cache, cell ``full``, and each format's, ``kv:<format>``, on the same example;
formats added later by ``--journal`` merge by example, ``merged``) and writes
``ROOT/README.md``, each format's row over the examples it ran, paired with the
full cache of the same run:

* ``lm``: per format, the mean continuation NLL increase over the float pool
  (nats per token) and the mean KL(full || format) per token, each with a 95%
  bootstrap interval over examples (the NLL increase is paired by construction);
* retrieval tasks: teacher-forced and greedy accuracy per format, and the paired
  difference from the float pool with its interval;
* retrieval tasks again, pooled: ``niah`` = ``niah_single`` + ``niah_multikey``
  (the two variants SmolLM2 can do; issue #26 asks for niah at 100 examples per
  cell, which the two variants' 50 each make);
* storage: KV bytes per token (K + V, every layer and KV head, scales and zero
  points included; ``jaxkv.cache.quantized_host.bytes_per_token``), average stored
  bits per element and capacity against bf16, for the request as its prefill
  leaves it. A cell that recorded its request's live tokens per precision
  (``kv``: ``jaxkv.serving.stages.quantization.KVRecord``) is counted from that
  record, which is the only way to know a TriAxialKV allocation's bits; older
  cells without it from the format alone (``storage``: KIVI's tokens past its
  window in pages, INT2 or KIVI-4's 4 bits, the rest in float);
* compute: the CPU hours per task and context length and per journal, the wall
  time of the whole as two one-core jobs, and what the grid costs in one pass
  (``compute_table``, ``one_pass_seconds``).
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import numpy as np

from eval.common.stats import mean_ci
from eval.quality.real_model_report import findings
from jaxkv.markdown import md_header, md_row

PAGE = 32


def read(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def storage(fmt: str, n_tokens: float, config) -> dict:
    """Bytes per token, stored bits per element and capacity vs bf16 of a request of
    ``n_tokens`` as its prefill leaves it in ``fmt``."""
    from jaxkv.cache.quantized import FLOAT, INT2, INT4
    from jaxkv.cache.quantized_host import KIVI_RESIDUAL as KIVI_WINDOW, bytes_per_token

    geo = dict(head_dim=config.head_dim, num_layers=config.num_layers, num_kv_heads=config.num_kv_heads)
    if fmt == "int4":
        per = bytes_per_token(INT4, **geo)
    elif fmt in ("kivi2", "kivi4"):  # kivi4's 4-bit pages take INT4's bytes per token
        paged = max(n_tokens - KIVI_WINDOW, 0) // PAGE * PAGE
        page_kind = INT2 if fmt == "kivi2" else INT4
        per = (paged * bytes_per_token(page_kind, **geo) + (n_tokens - paged) * bytes_per_token(FLOAT, **geo)) / n_tokens
    else:
        per = bytes_per_token(FLOAT, **geo)
    return storage_of(per, config)


def storage_of(per: float, config) -> dict:
    """``storage``'s row from ``per`` KV bytes per token: stored bits per element
    (K and V, every layer and KV head) and capacity against bf16."""
    from jaxkv.cache.quantized import FLOAT
    from jaxkv.cache.quantized_host import bytes_per_token, elements_per_token, stored_bits

    geo = dict(head_dim=config.head_dim, num_layers=config.num_layers, num_kv_heads=config.num_kv_heads)
    return {"bytes": per, "bits": stored_bits(per, elements_per_token(**geo)), "capacity": bytes_per_token(FLOAT, **geo) / per}


def recorded_storage(cells: list[dict], config) -> dict | None:
    """``storage``'s numbers from the ``kv`` records of ``cells`` (one format's cell on
    each example): bytes summed over the examples' requests per token; None if any
    cell lacks its record."""
    if not cells or any("kv" not in c for c in cells):
        return None
    tokens = sum(c["kv"]["int2"] + c["kv"]["int4"] + c["kv"]["full"] for c in cells)
    return storage_of(sum(c["kv"]["bytes"] for c in cells) / tokens, config)


POOLED = {"niah": ("niah_single", "niah_multikey")}


def commands(root: Path) -> list[str]:
    """The ``eval.quality.real_model`` command behind each (journal, task, length, setting)
    group of examples, from the setup each journal line records."""
    out = []
    for path in sorted(root.glob("quant*.jsonl")):
        runs: dict = {}
        for rec in read(path):
            setup = rec.get("setup", {})
            key = (
                setup.get("model", "smollm2-135m-instruct"),
                rec["task"],
                rec["context"],
                rec["setting"],
                ",".join(setup.get("kv_quant", [])),
                setup.get("quant_prefill", "chunked"),
            )
            runs[key] = runs.get(key, 0) + 1
        for (model, task, context, setting, formats, prefill), n in runs.items():
            out.append(
                f"`python -m eval.quality.real_model --model {model} --task {task} --context {context} --n {n} "
                f"--settings {setting} --kv-quant {formats} --quant-prefill {prefill} --out {root} "
                f"--journal {path.name} --resume` ({n} examples)"
            )
    return out


def format_of(cell: str) -> tuple[str, str]:
    """``(format spec, row name)`` of a cell name: ``kv:int4`` -> ``int4``;
    ``kv:int4/imported`` (``eval.quality.real_model --quant-prefill imported``) -> ``int4``,
    named "int4, imported prefill"."""
    spec = cell.split(":", 1)[1]
    base, imported, _ = spec.partition("/imported")
    return base, f"{base}, imported prefill" if imported else base


def merged(root: Path) -> list[dict]:
    """One record per (task, context, seed, setting) from ``quant.jsonl`` and any
    other ``quant*.jsonl`` (more formats on the same examples, ``eval.quality.real_model
    --journal``): cells merge, the first journal's full cache kept (every journal
    recomputes it on the same machine); ``seconds`` add up."""
    out: dict = {}
    paths = [root / "quant.jsonl", *sorted(p for p in root.glob("quant*.jsonl") if p.name != "quant.jsonl")]
    for path in paths:
        for rec in read(path):
            key = (rec["task"], rec["context"], rec["seed"], rec["setting"])
            if key not in out:
                out[key] = dict(rec, cells=dict(rec["cells"]))
            else:
                kept = out[key]
                kept["cells"].update({k: v for k, v in rec["cells"].items() if k not in kept["cells"]})
                kept["seconds"] = kept["seconds"] + rec["seconds"]
    return list(out.values())


def one_pass_seconds(record: dict) -> float:
    """What one example of the grid costs run in one pass: its float cell once (the
    full-precision prefill every imported format is branched from) plus each
    imported-prefill format's cell, from the seconds each cell recorded. Chunked
    protocol cells (no ``/imported``) are the extra protocol comparison beside the
    grid and are left out; so is the per-journal overhead of re-prefilling the same
    example when formats were added by later journals (``merged`` keeps one full
    cache)."""
    cells = record["cells"]
    return sum(c.get("seconds", 0.0) for name, c in cells.items() if name == "full" or name.endswith("/imported"))


def compute_table(records: list[dict], journals: dict | None = None) -> list[str]:
    """The CPU the journals took, per (task, context): examples, hours (every
    journal's seconds for an example added up, ``merged``), the median seconds per
    example, and the hours of the same grid run in one pass (``one_pass_seconds``);
    then the whole, and the wall time of running it as two jobs, one pinned to each
    of the 2 cores (how these runs were made; half the sum, since the jobs share
    nothing but the machine); with ``journals`` (name: seconds), the hours each
    journal took."""
    by = collections.defaultdict(list)
    for r in records:
        by[(r["task"], r["context"])].append((r["seconds"], one_pass_seconds(r)))
    lines = md_header(["task", "context", "examples", "CPU h (journals)", "median s / example", "CPU h (grid in one pass)"], "lrrrrr")
    for (task, context), secs in sorted(by.items()):
        spent, once = np.array(secs).T
        lines.append(md_row([task, context, len(secs), f"{spent.sum() / 3600:.2f}", f"{np.median(spent):.0f}", f"{once.sum() / 3600:.2f}"]))
    total, once_total = np.array([s for secs in by.values() for s in secs]).sum(axis=0)
    lines += [
        "",
        f"In all {total / 3600:.2f} h of CPU: as two jobs, one per core, about {total / 7200:.2f} h of wall time "
        "on the 2-core machine (one-core jobs; compile warm-ups included, shared with other runs as stated above). "
        f"The grid in one pass (each example's float prefill once, every imported-prefill format branched from it, "
        f"the chunked-protocol extras left out; the sum of the cells' own recorded seconds): {once_total / 3600:.2f} h "
        f"of CPU, about {once_total / 7200:.2f} h on the two cores.",
    ]
    if journals:  # journal name -> its seconds: which runs the hours went to
        lines += ["", "Per journal: " + ", ".join(f"`{name}` {secs / 3600:.2f} h" for name, secs in journals.items()) + "."]
    return lines


def report(root: Path, model_name: str = "smollm2-135m-instruct", points: list | None = None) -> str:
    """The markdown (module docstring); ``points``, when given, receives the plot's
    points (one per group and format: ``group``, ``name``, ``bits``, ``y``, ``lo``, ``hi``)."""
    import jaxkv

    records = merged(root)
    config = jaxkv.load_model(model_name, load_tokenizer=False).config  # the geometry the bytes follow
    groups = collections.defaultdict(list)
    for r in records:
        groups[(r["task"], r["context"], r["setting"])].append(r)
    for pooled, parts in POOLED.items():
        for task, context, setting in list(groups):
            if task == parts[0] and all((p, context, setting) in groups for p in parts[1:]):
                groups[(pooled, context, setting)] = [r for p in parts for r in groups[(p, context, setting)]]
    seconds = sum(r["seconds"] for r in records)
    points = [] if points is None else points  # one per (group, format): the plot's stored bits against quality
    lines = [
        f"# KV quantization on {model_name}: the full cache on each KV format, on the same examples",
        "",
        *findings(root),
        f"Journals `quant*.jsonl`: {len(records)} examples, {seconds / 3600:.2f} h of CPU in all (2-core x86_64, "
        "sums of per-example seconds, mostly shared with other runs). Regenerate: "
        f"`python -m eval.quality.real_model_quant_report --root {root}` after the runs below (each `--resume`s).",
        "",
        *[f"- {c}" for c in commands(root)],
        "",
        *compute_table(records, {p.name: sum(r["seconds"] for r in read(p)) for p in sorted(root.glob("quant*.jsonl"))}),
        "",
    ]
    for (task, context, setting), every in sorted(groups.items()):
        formats = list(dict.fromkeys(c for r in every for c in r["cells"] if c != "full"))
        n_tokens = float(np.mean([r["n_request"] for r in every]))
        # each format's row: the examples it ran (a format added later may cover fewer so far), paired with the full cache
        ran = {fmt: [r for r in every if fmt in r["cells"]] for fmt in ["full"] + formats}
        title = f"{task} ({' + '.join(POOLED[task])})" if task in POOLED else task
        lines += [f"## {title}, {context} tokens, {setting} ({len(every)} examples)", ""]
        if task == "lm":
            full = np.array([r["cells"]["full"]["nll"] for r in every])
            lines += [
                f"Float pool (the ceiling): continuation NLL {full.mean():.3f} nats/token.",
                "",
                *md_header(
                    [
                        "format",
                        "n",
                        "NLL increase, nats/token [95%]",
                        "KL(full \\|\\| format) per token [95%]",
                        "KV bytes / token",
                        "stored bits",
                        "capacity vs bf16",
                    ],
                    "l" + "r" * 6,
                ),
            ]
            for fmt in formats:
                d = np.array([r["cells"][fmt]["nll"] - r["cells"]["full"]["nll"] for r in ran[fmt]])
                kl = np.array([r["cells"][fmt]["kl"] for r in ran[fmt]])
                spec, name = format_of(fmt)
                st = recorded_storage([r["cells"][fmt] for r in ran[fmt]], config) or storage(spec, n_tokens, config)
                m, lo, hi = mean_ci(d)
                km, klo, khi = mean_ci(kl)
                points.append(dict(group=(task, context, setting), name=name, bits=st["bits"], y=m, lo=lo, hi=hi))
                lines.append(
                    md_row(
                        [
                            name,
                            d.size,
                            f"{m:+.4f} [{lo:+.4f}, {hi:+.4f}]",
                            f"{km:.4f} [{klo:.4f}, {khi:.4f}]",
                            f"{st['bytes']:.0f}",
                            f"{st['bits']:.2f}",
                            f"{st['capacity']:.2f}x",
                        ]
                    )
                )
        else:
            lines += md_header(
                [
                    "format",
                    "n",
                    "teacher-forced %",
                    "greedy %",
                    "Δ teacher-forced pt [95%]",
                    "KV bytes / token",
                    "stored bits",
                    "capacity vs bf16",
                ],
                "l" + "r" * 7,
            )
            for fmt in ["full"] + formats:
                full = np.array([r["cells"]["full"]["tf_correct"] for r in ran[fmt]], float)
                tf = np.array([r["cells"][fmt]["tf_correct"] for r in ran[fmt]], float)
                gen = np.array([r["cells"][fmt]["gen_correct"] for r in ran[fmt]], float)
                m, lo, hi = mean_ci(100 * (tf - full))
                spec, name = ("none", "none (float)") if fmt == "full" else format_of(fmt)
                st = recorded_storage([r["cells"][fmt] for r in ran[fmt]], config) or storage(spec, n_tokens, config)  # full: no record
                acc, acc_lo, acc_hi = mean_ci(100 * tf)
                points.append(dict(group=(task, context, setting), name=name, bits=st["bits"], y=acc, lo=acc_lo, hi=acc_hi))
                lines.append(
                    md_row(
                        [
                            name,
                            tf.size,
                            f"{100 * tf.mean():.0f}",
                            f"{100 * gen.mean():.0f}",
                            f"{m:+.1f} [{lo:+.1f}, {hi:+.1f}]",
                            f"{st['bytes']:.0f}",
                            f"{st['bits']:.2f}",
                            f"{st['capacity']:.2f}x",
                        ]
                    )
                )
        lines.append("")
    if plot(root, points):
        lines += [
            "![quality against stored bits](quality_vs_bits.png)",
            "",
            "`quality_vs_bits.png`: each format's quality against its stored bits per element, one panel per task "
            "(teacher-forced accuracy, or the `lm` NLL increase over the float pool), 95% intervals over examples.",
            "",
        ]
    lines += [
        "Stored bits count the scales and zero points (INT4 = 5 bits per element, INT2 = 3, float counted as "
        "bf16 = 16; KIVI-4's 4-bit pages store as INT4 does), for the request as its prefill leaves it; capacity is bf16's bytes per token over the format's.",
        "",
    ]
    for speed in sorted(root.glob("decode_speed_cpu_*.md")):  # eval/bench/quant_decode.py --model ... --out
        lines += [
            f"## Decode speed on the CPU ({speed.stem.rsplit('_', 1)[1]}, `{speed.name}`)",
            "",
            f"`python -m eval.bench.quant_decode --model {model_name} --contexts 4096,8000 --out {root / speed.name}`, "
            "on an otherwise idle machine:",
            "",
            speed.read_text().strip(),
            "",
        ]
    return "\n".join(lines)


def plot(root: Path, points: list[dict]) -> bool:
    """``ROOT/quality_vs_bits.png`` from ``report``'s points; False without matplotlib
    or points."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = list(dict.fromkeys(p["group"] for p in points))
    if not groups:
        return False
    # one panel per group: a column per (task, setting), a row per context length
    columns = list(dict.fromkeys((g[0], g[2]) for g in groups))
    contexts = sorted({g[1] for g in groups})
    fig, axes = plt.subplots(len(contexts), len(columns), figsize=(4.4 * len(columns), 4.2 * len(contexts)), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    bases = list(dict.fromkeys(p["name"].split(",")[0] for p in points))  # a format keeps its colour in every panel
    colour = dict(zip(bases, plt.get_cmap("tab10").colors * 2))
    for group in groups:
        ax = axes[contexts.index(group[1])][columns.index((group[0], group[2]))]
        ax.set_visible(True)
        sel = [p for p in points if p["group"] == group]
        labels: dict = {}  # formats at the same point (an ablation that allocates as another) share one label
        for p in sel:
            ax.errorbar(
                p["bits"],
                p["y"],
                yerr=[[p["y"] - p["lo"]], [p["hi"] - p["y"]]],
                fmt="o",
                ms=4,
                capsize=2,
                color=colour[p["name"].split(",")[0]],
            )
            short = p["name"].replace(", imported prefill", " (imp.)").replace("triaxial_", "").replace("triaxial", "tri")
            labels.setdefault((round(p["bits"], 2), round(p["y"], 4)), []).append(short)
        for (bits, y), names in labels.items():  # inside the panel; the layout leaves them out so panels keep their width
            ax.annotate(" = ".join(names), (bits, y), fontsize=6, xytext=(3, 3), textcoords="offset points", clip_on=True).set_in_layout(
                False
            )
        ax.set_xlim(right=max(p["bits"] for p in sel) * 1.35)  # room for the rightmost point's label
        task, context, setting = group
        ax.set_title(f"{task} {context} ({setting})", fontsize=9)
        ax.set_xlabel("stored bits per element")
        ax.set_ylabel("NLL increase, nats/token" if task == "lm" else "teacher-forced accuracy %")
        if task == "lm":
            ax.axhline(0.0, color="0.6", lw=0.8)
    fig.tight_layout()
    fig.savefig(root / "quality_vs_bits.png", dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=Path("eval/results/real_smollm2_quant"))
    p.add_argument("--model", default="smollm2-135m-instruct")
    args = p.parse_args(argv)
    text = report(args.root, args.model)
    (args.root / "README.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
