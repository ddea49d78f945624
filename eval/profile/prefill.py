"""Where a long prefill's time goes: per-step wall time of one request's prefill on
the engine, split into the ragged attention and everything else, with each part's
rate against the float32 GEMM rate measured in the same run.

    python -m eval.profile.prefill [--model smollm2-135m-instruct] [--tokens 8000] [--chunk 512]

One row, steps of ``--chunk`` tokens (``Engine.step``, after an untimed
pass that compiled the step). The attention part is the CPU implementation
(``jaxkv.kernels.attention.ragged.ragged_attention_blocked``) jit'd alone at the
step's shapes (the row's list as long as it is at that step, plus the chunk)
times the layer count; the rest (projections, MLP, the pool write, the tables) is
the step time minus that. Each part's achieved GFLOP/s counts its matmul work:
causal attention (QK and PV of every query over the entries it sees) and the
weights times tokens. Printed as a markdown table, with the GEMM rate and the
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
from jaxkv.engine import Engine  # noqa: E402
from jaxkv.markdown import md_header, md_row  # noqa: E402
from jaxkv.kernels.attention.ragged import KEY_BLOCK, PoolReader, ragged_attention_blocked  # noqa: E402


def attention_seconds(cfg, before: int, T: int, repeats: int = 3) -> float:
    """Median seconds of one layer's ragged attention of a ``T``-token chunk over a
    row with ``before`` older live entries."""
    rng = np.random.default_rng(0)
    K, Hq, D = cfg.num_kv_heads, cfg.num_heads, cfg.head_dim
    n = before + T
    S = n + KEY_BLOCK + 1
    q = jnp.asarray(rng.standard_normal((T, Hq, D)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((S, K, D)), jnp.float32)
    live = jnp.asarray(np.arange(1, n + 1 + (-n) % KEY_BLOCK, dtype=np.int32)[None])
    f = jax.jit(lambda q, kv, live, kvl, qs, ql: ragged_attention_blocked(q, PoolReader(kv, kv, live), kvl, qs, ql))
    args = (q, kv, live, jnp.asarray([n], jnp.int32), jnp.zeros(1, jnp.int32), jnp.asarray([T], jnp.int32))
    f(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(*args).block_until_ready()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def gemm_gflops(cfg, T: int, repeats: int = 5) -> float:
    """Best float32 GFLOP/s of the MLP's ``[T, M] x [M, F]`` in this process."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((T, cfg.hidden_size)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((cfg.hidden_size, cfg.intermediate_size)), jnp.float32)
    f = jax.jit(jnp.matmul)
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * T * cfg.hidden_size * cfg.intermediate_size / best / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=8000)
    p.add_argument("--chunk", type=int, default=512)
    args = p.parse_args(argv)
    load0 = os.getloadavg()
    model = jaxkv.load_model(args.model)
    cfg = model.config
    P = -(-args.tokens // 512) * 512
    engine = Engine(model, rows=1, max_positions=P, num_slots=P + 1, prefill_chunk=args.chunk)
    tokens = np.random.default_rng(1).integers(100, cfg.vocab_size - 100, args.tokens)
    step_times = []
    for _ in range(2):  # the first pass compiles the step's buckets
        row = engine.open_row()
        job = engine.start_prefill(row, tokens)
        times = []
        while not job.finished:
            before = job.done
            t = time.perf_counter()
            engine.step(prefill_jobs=[job])
            jax.block_until_ready(engine.cache.k)
            times.append((before, job.done - before, time.perf_counter() - t))
        engine.close_row(row)
        step_times = times
    gemm = gemm_gflops(cfg, args.chunk)
    L, M, F, Hq, K, D = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    linear_per_token = 2 * L * (M * Hq * D * 2 + M * K * D * 2 + 3 * M * F)
    print(
        f"Prefill of {args.tokens} tokens in {args.chunk}-token steps, {args.model} ({L} layers), "
        f"{jax.devices()[0].platform}, {os.cpu_count()} cores; float32 GEMM rate {gemm:.0f} GFLOP/s; "
        f"load average before {load0[0]:.2f}\n"
    )
    print(
        "\n".join(
            md_header(
                [
                    "step starts at",
                    "tokens",
                    "step s",
                    "attention s (all layers)",
                    "attention GFLOP/s",
                    "rest s",
                    "rest GFLOP/s",
                    "attention share",
                ],
                "r" * 8,
            )
        )
    )
    total = att_total = att_flops_total = 0.0
    for before, n, secs in step_times:
        att = attention_seconds(cfg, before, n) * L
        att_flops = 4 * L * Hq * D * n * (before + (n + 1) / 2)
        rest = secs - att
        total, att_total, att_flops_total = total + secs, att_total + att, att_flops_total + att_flops
        print(
            md_row(
                [
                    before,
                    n,
                    f"{secs:.2f}",
                    f"{att:.2f}",
                    f"{att_flops / att / 1e9:.0f}",
                    f"{rest:.2f}",
                    f"{linear_per_token * n / max(rest, 1e-9) / 1e9:.0f}",
                    f"{att / secs:.0%}",
                ]
            )
        )
    whole = (att_flops_total + linear_per_token * args.tokens) / total / 1e9
    print(
        f"\nTotal {total:.1f} s, of which attention {att_total:.1f} s ({att_total / total:.0%}, "
        f"{att_flops_total / att_total / 1e9:.0f} GFLOP/s); the whole prefill at {whole:.0f} GFLOP/s = "
        f"{whole / gemm:.0%} of the GEMM rate; load average after {os.getloadavg()[0]:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
