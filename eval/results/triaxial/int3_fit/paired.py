"""Paired differences of an INT3 format study's variants against one of them, per
rotation: KL per reply token and the reply NLL increase (token-weighted over traces,
a paired bootstrap 95% interval over traces, 4000 draws), from its ``study.json``.

    python eval/results/triaxial/int3_fit/paired.py STUDY.json "BASELINE NAME"
"""

import json
import sys

import numpy as np

d = json.load(open(sys.argv[1]))
base = sys.argv[2]
rng = np.random.default_rng(0)
print("| variant | rotation | KL / token minus baseline [95%] | NLL increase minus baseline [95%] |")
print("|---|---|---:|---:|")
for rot in ("", " +rot"):
    b = d[base + rot]
    for k, v in d.items():
        if (k.endswith(" +rot")) != bool(rot) or k == base + rot:
            continue
        n = np.array([r["n"] for r in v])
        idx = rng.integers(0, n.size, (4000, n.size))
        cells = []
        for field in ("kl", "dnll"):
            x = np.array([r[field] for r in v]) - np.array([r[field] for r in b])
            lo, hi = np.percentile(x[idx].sum(1) / n[idx].sum(1), [2.5, 97.5])
            cells.append(f"{x.sum() / n.sum():+.4f} [{lo:+.4f}, {hi:+.4f}]")
        print(f"| {k[: -len(rot)] if rot else k} | {'on' if rot else 'off'} | {cells[0]} | {cells[1]} |")
