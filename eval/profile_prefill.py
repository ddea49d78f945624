"""Where a long prefill's time goes: per-chunk wall time of one request's prefill
on the engine, against the chunk's read length, split into the chunk's attention
and everything else.

    python eval/profile_prefill.py [--model smollm2-135m-instruct] [--tokens 8000] [--chunk 512]

One row, chunks of ``--chunk`` tokens; each chunk is timed on the engine
(``Engine.step_prefill``, after an untimed pass compiled every read length).
The attention part is ``jaxkv.attention.prefill_attention`` jit'd alone at the
chunk's shapes (the layer's cached rows, padded to the step's read length, plus the chunk) times the layer count;
the rest (projections, MLP, the pool write, the per-layer gather of the cached
rows) is the chunk time minus that. Printed as a markdown table, with the
machine's load average before and after.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv import buckets  # noqa: E402
from jaxkv.attention import prefill_attention  # noqa: E402
from jaxkv.engine import Engine  # noqa: E402


def attention_seconds(cfg, N: int, T: int, repeats: int = 3) -> float:
    """Median seconds of one layer's chunk attention over ``N`` cached rows."""
    rng = np.random.default_rng(0)
    K, Hq, D = cfg.num_kv_heads, cfg.num_heads, cfg.head_dim
    q = jnp.asarray(rng.standard_normal((1, T, Hq, D)), jnp.float32)
    kn = jnp.asarray(rng.standard_normal((1, T, K, D)), jnp.float32)
    kc = jnp.asarray(rng.standard_normal((1, N, K, D)), jnp.float32)
    f = jax.jit(lambda q, kn, vn, kc, vc, ll, cl: prefill_attention(q, kn, vn, kc, vc, ll, cl)[0])
    args = (q, kn, kn, kc, kc, jnp.asarray([N], jnp.int32), jnp.asarray([T], jnp.int32))
    f(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(*args).block_until_ready()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=8000)
    p.add_argument("--chunk", type=int, default=512)
    args = p.parse_args(argv)
    load0 = os.getloadavg()
    model = jaxkv.load_model(args.model)
    cfg = model.config
    engine = Engine(model, rows=1, max_positions=8192, prefill_chunk=args.chunk)
    tokens = np.random.default_rng(1).integers(100, cfg.vocab_size - 100, args.tokens)
    chunk_times = []
    for timed in (False, True):  # the first pass compiles every read length
        row = engine.open_row()
        job = engine.start_prefill(row, tokens)
        times = []
        while not job.finished:
            t = time.perf_counter()
            engine.step_prefill([job])
            jax.block_until_ready(engine.cache)
            times.append((job.done, time.perf_counter() - t))
        engine.close_row(row)
        chunk_times = times
    print(f"Prefill of {args.tokens} tokens in {args.chunk}-token chunks, {args.model} ({cfg.num_layers} layers), "
          f"{jax.devices()[0].platform}, {os.cpu_count()} cores; load average before {load0[0]:.2f}\n")
    print("| chunk ends at | chunk s | attention s (all layers) | rest s | attention share |")
    print("|---:|---:|---:|---:|---:|")
    total, att_total = 0.0, 0.0
    for done, secs in chunk_times:
        T = min(args.chunk, done)
        N = buckets.read_length(done - T, engine.max_positions)  # the padded read the step makes
        att = attention_seconds(cfg, N, args.chunk) * cfg.num_layers
        total += secs
        att_total += att
        print(f"| {done} | {secs:.2f} | {att:.2f} | {secs - att:.2f} | {att / secs:.0%} |")
    print(f"\nTotal {total:.1f} s, of which attention {att_total:.1f} s ({att_total / total:.0%}); "
          f"load average after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
