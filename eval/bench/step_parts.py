"""Where a CPU engine step's time goes, part by part, on one host in one run.

    JAX_PLATFORMS=cpu taskset -c 0,1 python -m eval.bench.step_parts [--parts gemm,mixed,attention,window]
        [--model smollm2-135m-instruct] [--out FILE.md]

Four parts, each timed as the best (and median) of a few calls after a warm-up call
(compiles excluded), every one in this process:

* ``gemm``: XLA:CPU's matrix products at the model's shapes, float32 and bf16 operands
  with float32 accumulation (the form that reaches AMX), in GFLOP/s.
* ``mixed``: whole engine steps (``Engine.prefill``) of ``R`` rows with ``n`` new
  tokens each over a cached prefix of ``C`` tokens per row, float32 and bf16: the
  16-client agent run's mixed steps are 16 short pieces over ~800-token prefixes.
* ``attention``: the blocked ragged attention alone
  (``jaxkv.kernels.attention.ragged.ragged_attention_blocked``) for the same
  shapes over 30 layers of a random pool, with the useful GFLOP/s (causal work only).
* ``window``: the CPU decode loop's window products alone (one query per row over
  ``W`` entries, 16 rows, 30 layers, SmolLM2's heads) and the K/V bytes per second
  they read.

Why by hand: the peers bench (``eval/bench/peers.py``) gives the served total, and
the step trace (``JAXKV_STEP_TRACE``) the seconds per step; neither says which part
of a step is slow. The 1-minute load average is printed before and after: a run that
starts above 0.5 is not a figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.markdown import md_table

MIXED = ((16, 33, 0), (16, 33, 800), (16, 32, 800), (1, 512, 0), (1, 512, 800))
GEMMS = ((2048, 2048, 2048), (528, 576, 1536), (528, 1536, 576), (16, 576, 1536), (16, 576, 49152))
WIDTHS = (512, 2048)


def timed(fn, calls: int = 5) -> tuple[float, float]:
    """``(best, median)`` seconds of ``calls`` calls after one untimed call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return min(times), statistics.median(times)


def gemm_rows() -> list[list]:
    rows = []
    for M, K, N in GEMMS:
        rates = []
        for dtype in (jnp.float32, jnp.bfloat16):
            a, b = jnp.ones((M, K), dtype), jnp.ones((K, N), dtype)
            f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
            best, _ = timed(lambda f=f, a=a, b=b: f(a, b))
            rates.append(2 * M * K * N / best / 1e9)
        rows.append([f"{M} x {K} x {N}", f"{rates[0]:.0f}", f"{rates[1]:.0f}"])
    return rows


def mixed_rows(model_name: str) -> list[list]:
    import jaxkv
    from jaxkv.engine import Engine

    rows = []
    for dtype in ("float32", "bfloat16"):
        model = jaxkv.load_model(model_name, dtype=dtype)
        for R, n, C in MIXED:
            rng = np.random.default_rng(0)
            engine = Engine(model, rows=R, max_positions=2048, num_slots=R * 2048 + 1)
            ids = [engine.open_row() for _ in range(R)]
            if C:
                engine.prefill(ids, [rng.integers(100, 40000, C).tolist() for _ in ids])

            def step(engine=engine, ids=ids, n=n, C=C, rng=rng):
                engine.prefill(ids, [rng.integers(100, 40000, n).tolist() for _ in ids])
                jax.block_until_ready(jax.tree.leaves(engine.cache)[0])
                for r in ids:
                    engine.truncate_row(r, C)

            best, med = timed(step)
            rows.append([dtype, R, n, C, f"{best:.3f}", f"{med:.3f}"])
            del engine
    return rows


def attention_rows(layers: int = 30) -> list[list]:
    from jaxkv.kernels.attention.ragged import PoolReader, pad_lists, ragged_attention_blocked

    K, G, D, P = 3, 3, 64, 2048
    rows = []
    for dtype in (jnp.float32, jnp.bfloat16):
        for R, n, C in MIXED[1:3] + MIXED[4:]:
            S = R * P + 1
            k = jax.random.normal(jax.random.key(0), (layers, S, K, D), dtype)
            v = jax.random.normal(jax.random.key(1), (layers, S, K, D), dtype)
            live = jnp.asarray(1 + np.arange(R)[:, None] * P + np.arange(P)[None, :], jnp.int32)
            T = R * n
            q = jax.random.normal(jax.random.key(2), (T, K * G, D), dtype)
            kv_len = jnp.full((R,), C + n, jnp.int32)
            q_start, q_len = jnp.arange(R, dtype=jnp.int32) * n, jnp.full((R,), n, jnp.int32)

            @jax.jit
            def attend(q, k, v, live=live, kv_len=kv_len, q_start=q_start, q_len=q_len):
                total = jnp.float32(0)
                for i in range(layers):
                    out = ragged_attention_blocked(q, PoolReader(k, v, pad_lists(live), layer=i), kv_len, q_start, q_len)
                    total = total + out.astype(jnp.float32).sum()
                return total

            best, med = timed(lambda attend=attend, q=q, k=k, v=v: attend(q, k, v))
            useful = 4 * R * n * K * G * D * (C + n / 2) * layers
            rows.append([jnp.dtype(dtype).name, R, n, C, f"{best:.3f}", f"{med:.3f}", f"{useful / best / 1e9:.0f}"])
    return rows


def window_rows(layers: int = 30) -> list[list]:
    from jaxkv.kernels.attention.ragged import window_decode_attention

    R, K, G, D, S = 16, 3, 3, 64, 32
    rows = []
    for dtype in (jnp.float32, jnp.bfloat16):
        for W in WIDTHS:
            ks = [jax.random.normal(jax.random.key(i), (R, K, D, W), dtype) for i in range(layers)]
            vs = [jax.random.normal(jax.random.key(100 + i), (R, K, W, D), dtype) for i in range(layers)]
            new = jnp.zeros((R, S, K, D), dtype)
            q = jax.random.normal(jax.random.key(7), (R, K * G, D), jnp.float32)
            old_len, new_len, active = jnp.full((R,), W, jnp.int32), jnp.ones((R,), jnp.int32), jnp.ones((R,), bool)

            @jax.jit
            def attend(q, ks, vs, new=new, old_len=old_len, new_len=new_len, active=active):
                return sum(window_decode_attention(q, k, v, old_len, new, new, new_len, active).sum() for k, v in zip(ks, vs))

            best, med = timed(lambda attend=attend, q=q, ks=ks, vs=vs: attend(q, ks, vs))
            gb = 2 * R * K * D * W * layers * jnp.dtype(dtype).itemsize / 1e9
            rows.append([jnp.dtype(dtype).name, W, f"{best * 1e3:.1f}", f"{med * 1e3:.1f}", f"{gb / best:.1f}"])
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="gemm,mixed,attention,window")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--out", default=None, help="also write the tables to this markdown file")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    lines = ["# Where a CPU step's time goes", "", f"`python -m eval.bench.step_parts --parts {args.parts}`", ""]
    lines.append(f"CPU cores this process may use: {len(os.sched_getaffinity(0))}; 1-minute load before: {os.getloadavg()[0]:.2f}")
    lines.append("")
    if "gemm" in parts:
        lines += ["## Matrix products, GFLOP/s", "", md_table(["M x K x N", "float32", "bf16 -> float32"], gemm_rows(), "lrr"), ""]
    if "mixed" in parts:
        lines += [f"## Whole engine steps ({args.model}): R rows x n new tokens over C cached tokens each, seconds", ""]
        lines += [md_table(["dtype", "R", "n", "C", "best s", "median s"], mixed_rows(args.model), "lrrrrr"), ""]
    if "attention" in parts:
        lines += ["## The blocked attention alone, 30 layers (SmolLM2 heads: 9 query, 3 KV, dim 64), seconds", ""]
        lines += [md_table(["dtype", "R", "n", "C", "best s", "median s", "useful GFLOP/s"], attention_rows(), "lrrrrrr"), ""]
    if "window" in parts:
        lines += ["## The decode window's products alone, 16 rows, 30 layers, one step, ms", ""]
        lines += [md_table(["dtype", "width W", "best ms", "median ms", "K/V GB/s"], window_rows(), "lrrrr"), ""]
    lines.append(f"1-minute load after: {os.getloadavg()[0]:.2f}")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
