"""RepairKV runtime probe: repair latency against candidate count (a benchmark, not a test).

One repair = score every evicted candidate against the turn's signal (the chunked
two-pass scorer of ``jaxkv.policies.repair``, streamed chunk by chunk, so the
candidate pool never has to fit on the device) + rank + burst selection of K
rows + the host-to-device copy of the K promoted rows (K and V, every layer).
Shapes are the ~125M model's: 12 layers, 12 query / 4 KV heads, head dim 64;
the signal is 64 query rows; the active (context) set is 4096 rows.

Candidate source: 1M rows x 12 layers x 4 heads x 64 x 4 bytes is 12 GB of keys
alone, so candidates come from a generated source: ``--buffers`` resident chunks
of ``--chunk`` rows (random normal keys) cycled through; every chunk is a
separate full-size array read by the kernels, so the work and memory traffic
per chunk equal those of a real store; only the values repeat. Timing: one
warm-up repair (compiles; chunk shapes are the same for every size), then ``--reps`` repairs per size (fewer for
the largest sizes when ``--budget-s`` would be exceeded; the table says how many
ran), p50 / p95 over reps, each ``block_until_ready``. Scoring does not depend
on K, so each rep scores once and selects for every K.

Usage::

    python -m eval.bench.repair [--sizes 32768,131072,1048576] [--ks 96,5000]
        [--out eval/results/repair_latency_cpu.md]
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.markdown import md_header, md_row
from jaxkv.policies import repair

L, HQ, HKV, D = 12, 12, 4, 64


def _pct(xs, q):
    return float(np.percentile(np.asarray(xs), q))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="32768,131072,1048576")
    ap.add_argument("--ks", default="96,5000")
    ap.add_argument("--signal-rows", type=int, default=64)
    ap.add_argument("--active", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=None, help="candidate rows per chunk (default: 512 on CPU, 8192 elsewhere)")
    ap.add_argument("--buffers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop adding reps past this total")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    C, X, N = args.chunk or (512 if jax.default_backend() == "cpu" else 8192), args.signal_rows, args.active
    dev = jax.devices()[0]
    device = f"{dev.platform}: {dev.device_kind} ({platform.processor() or platform.machine()}, {jax.device_count()} device)"

    key = jax.random.key(0)
    kq, kc, kb = jax.random.split(key, 3)
    q = jax.random.normal(kq, (L, X, HQ, D), jnp.float32)
    q_pos = jnp.full((X,), 2**30, jnp.int32)  # the signal sees every candidate
    q_valid = jnp.ones((X,), bool)
    ctx_k = jax.random.normal(kc, (L, N, HKV, D), jnp.float32)
    ctx_pos = jnp.arange(N, dtype=jnp.int32)
    ctx_valid = jnp.ones((N,), bool)
    buffers = [jax.random.normal(k, (L, C, HKV, D), jnp.float32) for k in jax.random.split(kb, args.buffers)]
    jax.block_until_ready(buffers)
    v_row = np.zeros((L, 1, HKV, D), np.float32)

    def source(M):
        def chunks():
            for i in range(-(-M // C)):
                start = N + i * C
                n = min(C, M - i * C)
                yield buffers[i % len(buffers)], jnp.arange(start, start + C, dtype=jnp.int32), jnp.arange(C) < n

        return chunks

    rows = []
    t_all = time.perf_counter()
    for M in sizes:
        comp = np.random.default_rng(M).random(M).astype(np.float32)
        positions = np.arange(N, N + M, dtype=np.int64)
        score_t, select_t = [], {k: [] for k in ks}
        copy_t = {k: [] for k in ks}
        for rep in range(0 if M == sizes[0] else 1, args.reps + 1):  # rep 0 (first size) compiles
            if rep > 1 and time.perf_counter() - t_all > args.budget_s:
                break
            t0 = time.perf_counter()
            a = repair.repair_scores_streamed(q, q_pos, q_valid, ctx_k, ctx_pos, ctx_valid, source(M))[:M]
            t1 = time.perf_counter()
            for K in ks:
                t2 = time.perf_counter()
                chosen = repair.select_bursts(positions, repair.rank(a, comp, positions), K)
                t3 = time.perf_counter()
                k_rows = np.broadcast_to(v_row, (L, chosen.size, HKV, D))
                jax.block_until_ready(jax.device_put((k_rows, k_rows)))  # promoted K and V rows
                t4 = time.perf_counter()
                if rep:
                    select_t[K].append(t3 - t2)
                    copy_t[K].append(t4 - t3)
            if rep:
                score_t.append(t1 - t0)
            print(f"M={M} rep={rep} score={t1 - t0:.3f}s", flush=True)
        for K in ks:
            total = [s + a + b for s, a, b in zip(score_t, select_t[K], copy_t[K])]
            rows.append((M, K, len(score_t), score_t, select_t[K], total))

    lines = [
        "# RepairKV repair latency",
        "",
        f"Device: **{device}**. jax {jax.__version__}. Produced by `eval/bench/repair.py` "
        f"(sizes {args.sizes}, K {args.ks}, reps {args.reps}, budget {args.budget_s:.0f} s).",
        "",
        f"Shapes: L={L}, Hq={HQ}, Hkv={HKV}, D={D} (float32); signal X={X} query rows; active set N={N}; "
        f"candidates streamed in chunks of {C} rows from {args.buffers} resident buffers (generated keys, "
        "see the module docstring). One repair = two-pass chunked scoring over active ∪ candidates + "
        "rank + burst selection + host-to-device copy of the K promoted K/V rows. Scoring does not depend on K.",
        "",
        *md_header(
            [
                "candidates M",
                "K",
                "reps",
                "score p50 (s)",
                "score p95 (s)",
                "select p50 (ms)",
                "total p50 (s)",
                "total p95 (s)",
                "candidates/s (p50)",
            ],
            "r" * 9,
        ),
    ]
    for M, K, n, sc, se, tot in rows:
        lines.append(
            md_row(
                [
                    f"{M:,}",
                    f"{K:,}",
                    n,
                    f"{_pct(sc, 50):.3f}",
                    f"{_pct(sc, 95):.3f}",
                    f"{1e3 * _pct(se, 50):.1f}",
                    f"{_pct(tot, 50):.3f}",
                    f"{_pct(tot, 95):.3f}",
                    f"{M / _pct(tot, 50):,.0f}",
                ]
            )
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
