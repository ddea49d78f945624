"""Where one engine decode call spends its time on the CPU: SmolLM2 by name, one row
(or ``--rows`` rows decoding together; ``--model qwen3-125m``: the random ~125M of
``eval/bench/serving.py``).

Prefills a 1,024-token random prompt into an ``Engine`` (``rows`` 16, ``num_slots``
40,000, as ``eval/bench/peers.py`` serves it), runs untimed 16-step decode calls until
one compiles nothing, times three more, then traces one with ``jax.profiler`` and prints
the XLA operations that took the most time, summed by name (numbered copies merged).
Behind the peer report's bf16 and INT4 analysis (``eval/results/peers_cpu.md``).

    python -m eval.profile.decode                          # float32 weights and pool
    python -m eval.profile.decode --dtype bfloat16         # bf16 weights
    python -m eval.profile.decode --kv-quant int4          # INT4 pool
    python -m eval.profile.decode --model qwen3-125m --rows 8   # the serving bench's batch
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import tempfile
import time
from pathlib import Path


def summarize(trace_dir: Path, top: int) -> list[tuple[str, float, int]]:
    """``(name, ms, count)`` of the trace's complete events, numbered names merged."""
    trace = max(trace_dir.rglob("*.trace.json.gz"), key=os.path.getmtime)
    events = [e for e in json.load(gzip.open(trace))["traceEvents"] if e.get("ph") == "X"]
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        name = re.sub(r"\.\d+$", "", e["name"])
        total[name] += e.get("dur", 0)
        count[name] += 1
    return [(name, us / 1e3, count[name]) for name, us in total.most_common(top)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--kv-quant", default=None)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--num-slots", type=int, default=40_000)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a name jaxkv.load_model takes, or qwen3-125m")
    ap.add_argument("--rows", type=int, default=1, help="rows decoding together in one call")
    args = ap.parse_args()
    import jax
    import numpy as np

    import jaxkv
    from jaxkv import compiles
    from jaxkv.engine import Engine

    print(f"load average before: {os.getloadavg()[0]:.2f}")
    if args.model == "qwen3-125m":
        from eval.bench.serving import random_qwen3_125m

        model = random_qwen3_125m()
    else:
        model = jaxkv.load_model(args.model, dtype=args.dtype)
    engine = Engine(model, rows=16, max_positions=8192, num_slots=args.num_slots, kv_quant=args.kv_quant)
    rng = np.random.default_rng(0)
    rows = [engine.open_row() for _ in range(args.rows)]
    engine.prefill(rows, [rng.integers(100, model.config.vocab_size, args.context).tolist() for _ in rows])
    tokens = [5] * len(rows)
    before = None
    while before != compiles.count():  # until a call compiles nothing
        before = compiles.count()
        engine.decode(rows, tokens, 16)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        engine.decode(rows, tokens, 16)
        times.append(time.perf_counter() - t)
    print(
        f"{args.dtype} weights, pool {engine.cache.k.dtype if args.kv_quant is None else args.kv_quant}, "
        f"{args.num_slots} slots, {len(rows)} rows, context {args.context}: 16-step decode call "
        f"{sorted(times)[1] * 1e3:.0f} ms (median of 3), {sorted(times)[1] / 16 * 1e3:.1f} ms per step"
    )
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        engine.decode(rows, tokens, 16)
        jax.profiler.stop_trace()
        for name, ms, n in summarize(Path(folder), args.top):
            print(f"{ms:9.1f} ms {n:6d}x  {name}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
