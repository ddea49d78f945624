"""What an 8-row decode call costs against a 1-row one, by live length: where batching's gain goes (CPU).

    JAX_PLATFORMS=cpu python -m eval.bench.decode_rows [--model embedded|qwen3-125m]
        [--lives 64,256,1024,2048] [--rows 1,8] [--out FILE.md]

One ``Engine`` (8 rows, 4,096 positions; the model's float32 pool). For each live
length and row count, every row is prefilled with that many random tokens, then
``Engine.step_decode`` runs 32-step calls with no stop token (one untimed call,
then five timed ones, the rows truncated back after each); the fastest call's
seconds per step are reported. Per step a row reads its live K/V once
(``layers x 2 x KV heads x head_dim x 4 bytes`` per live token), so the table
also prints the K/V bytes one step reads across its rows and what throughput 8
rows buy over 1 (``x 1 row``: 8 x the 1-row step time over the 8-row step time).

A live length where the 8-row step costs about 8 x (the 1-row step minus its
fixed part) is bound by K/V reads, which batching cannot share between rows;
the fixed part (weights, per-op overhead) is what batching amortizes. The
1-minute load average is printed before and after: a run that starts above 0.5
shares the machine and is not a figure.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from jaxkv.markdown import md_header, md_row  # noqa: E402

STEPS = 32
REPEATS = 5


def load(name: str):
    import jaxkv

    if name == "embedded":
        return jaxkv.load_model("embedded")
    if name == "qwen3-125m":
        from eval.bench.serving import random_qwen3_125m

        return random_qwen3_125m()
    return jaxkv.load_model(name)


def step_seconds(engine, n_rows: int, live: int, rng) -> float:
    """Fastest of ``REPEATS`` 32-step decode calls over ``n_rows`` rows of ``live`` tokens, per step."""
    rows = [engine.open_row() for _ in range(n_rows)]
    try:
        vocab = engine.model.config.vocab_size
        engine.prefill(rows, [rng.integers(3, vocab, live) for _ in rows])
        times = []
        for _ in range(REPEATS + 1):  # the first call compiles
            jobs = [engine.start_decode(r, 5, STEPS) for r in rows]
            t0 = time.perf_counter()
            engine.step_decode(jobs, STEPS)
            times.append(time.perf_counter() - t0)
            for r in rows:
                engine.truncate_row(r, live)
        return min(times[1:]) / STEPS
    finally:
        for r in rows:
            engine.close_row(r)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--lives", default="64,256,1024,2048")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from jaxkv.engine import Engine

    load_before = os.getloadavg()[0]
    model = load(args.model)
    cfg = model.config
    row_counts = [int(x) for x in args.rows.split(",")]
    engine = Engine(model, rows=max(row_counts), max_positions=4096)
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    rng = np.random.default_rng(0)
    lines = [
        f"# Decode call cost by rows: {args.model} ({cfg.num_layers} layers, {cfg.num_kv_heads} KV heads x {cfg.head_dim}, "
        f"{kv_per_token / 1024:.1f} KiB of K/V per live token)",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores; `python -m eval.bench.decode_rows --model {args.model} "
        f"--lives {args.lives} --rows {args.rows}`; {STEPS}-step calls, fastest of {REPEATS}.",
        f"1-minute load average before: {load_before:.2f}.",
        "",
        *md_header(["live tokens", "rows", "ms per step", "K/V read per step (MiB)", "x 1 row (tokens/s)"], "rrrrr"),
    ]
    for live in (int(x) for x in args.lives.split(",")):
        base = None
        for n in row_counts:
            s = step_seconds(engine, n, live, rng)
            base = s if n == 1 else base
            ratio = f"{n * base / s:.2f}x" if base else ""
            lines.append(md_row([live, n, f"{s * 1e3:.3f}", f"{n * live * kv_per_token / 2**20:.1f}", ratio]))
            print(lines[-1], flush=True)
    lines += ["", f"1-minute load average after: {os.getloadavg()[0]:.2f}."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
