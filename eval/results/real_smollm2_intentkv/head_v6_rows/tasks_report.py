"""The sixth head on passkey (100 examples) and question-agnostic niah_single (50) at 2k,
beside the fourth head (``real_smollm2/jaxkv_head_v4/``) and its rule
``intentkv_memory`` (``real_smollm2/jaxkv/examples.jsonl``), on the same examples: per
compression ratio, teacher-forced accuracy (%), the paired gains (points) over the
rule and over the fourth head, and the answer NLL's paired difference from the rule.

    python eval/results/real_smollm2_intentkv/head_v6_rows/tasks_report.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

from eval.common.stats import paired_gain
from eval.quality.real_model_report import read, verdicts

RES = ROOT / "eval/results/real_smollm2"
TASKS = (
    ("niah_single", "jaxkv/examples_intentkv_niah.jsonl", "jaxkv_head_v4/examples_intentkv_niah.jsonl"),
    ("passkey", "jaxkv/examples_intentkv.jsonl", "jaxkv_head_v4/examples_intentkv.jsonl"),
)


def load(path: Path, task: str) -> dict:
    """``{cell: {seed: record}}`` of the question-agnostic 2k examples of ``task``
    (``real_model_report``'s reader; the latest record wins)."""
    return verdicts(read(path)).get((task, 2048, "agnostic"), {})


def gain(a: np.ndarray, b: np.ndarray, scale: float, digits: int) -> str:
    g, lo, hi = (scale * v for v in paired_gain(a, b, np.ones(len(a))))
    return f"{g:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]"


def main() -> None:
    print("| task | ratio | n | sixth head % | fourth head % | rule % | sixth − rule | sixth − fourth | answer NLL, sixth − rule |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for task, f6, f4 in TASKS:
        six, four, base = load(RES / f6, task), load(RES / f4, task), load(RES / "jaxkv/examples.jsonl", task)
        for ratio in ("0.25", "0.5", "0.75"):
            s6, s4, rule = six[f"intentkv@{ratio}"], four[f"intentkv@{ratio}"], base[f"intentkv_memory@{ratio}"]
            seeds = sorted(set(s6) & set(s4) & set(rule))
            ok = {k: np.array([float(d[s]["tf_correct"]) for s in seeds]) for k, d in (("6", s6), ("4", s4), ("r", rule))}
            nll = {k: np.array([float(d[s]["answer_nll"]) for s in seeds]) for k, d in (("6", s6), ("r", rule))}
            print(
                f"| {task} | {ratio} | {len(seeds)} | {100 * ok['6'].mean():.0f} | {100 * ok['4'].mean():.0f} | "
                f"{100 * ok['r'].mean():.0f} | {gain(ok['6'], ok['r'], 100, 0)} | {gain(ok['6'], ok['4'], 100, 0)} | "
                f"{gain(nll['6'], nll['r'], 1, 2)} |"
            )


if __name__ == "__main__":
    main()
