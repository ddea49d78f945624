"""Why a 16-row decode step is slow on a 2-core CPU: the decode window's attention
(``jaxkv.kernels.attention.ragged.window_decode_attention``) runs its two batched
products on one core.

At the 16-client bench's shape (16 rows, a 2,048-entry window, SmolLM2's 3 KV
heads of 64 and 3 query heads per KV head, 30 layers: 1.5 GB of float32 K/V per
step, far more than the last-level cache), it times in one process each:

* ``attention``: the window attention of 30 layers, each layer's output feeding
  the next layer's query through a small mixing product (a layer's join);
* ``products``: the two batched products alone (scores, then values), 30 layers;
* ``read``: summing the same 1.5 GB (the read floor);
* ``halves``: the products over two halves of the rows held as separate arrays,
  with no join between layers (two independent chains);
* ``halves, joined``: the same with the halves joined after every layer, as a
  model's layers join them;
* ``attention, halves joined``: ``attention`` over two halves of the rows held as
  separate windows, joined after every layer;
* ``model step``: a decode step of a SmolLM2-shaped model (random weights: the
  projections and MLP of 576 -> 1536 around ``attention``, 30 layers) on one CPU
  device, and ``model step, two devices``: the same program on two virtual CPU
  devices (``--xla_force_host_platform_device_count=2``), its rows split between
  them (a data-parallel mesh; the weights on both). XLA runs each device's share
  on a thread of its own, so each half's products get a core.

Run it pinned to one core and to both (``--cores 1,2``, each a subprocess pinned
with ``os.sched_setaffinity``): a product whose time does not change with the
cores runs on one. Best of ``--repeats`` after a compile, ms and GB/s of K/V
read; the load average is printed before and after. Written by hand: the
question is one XLA:CPU scheduling fact, which no profiler answers more directly.

    python -m eval.profile.window_threads [--cores 1,2] [--out eval/results/window_threads_cpu.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

R, K, G, D, W, L = 16, 3, 3, 64, 2048, 30


def _measure(repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxkv.kernels.attention.ragged import window_decode_attention

    key = jax.random.key(0)
    q = jax.random.normal(key, (R, K * G, D))
    k = tuple(jax.random.normal(jax.random.fold_in(key, 1 + i), (R, K, D, W)) for i in range(L))
    v = tuple(jax.random.normal(jax.random.fold_in(key, 100 + i), (R, K, W, D)) for i in range(L))
    new_k = jnp.zeros((R, 32, K, D))
    seen = jnp.arange(R, dtype=jnp.int32) * 60 + 1000  # rows of 1,000-1,900 entries in a 2,048 window
    fresh, active = jnp.full((R,), 3, jnp.int32), jnp.ones((R,), bool)
    mix = jax.random.normal(key, (K * G * D, K * G * D)) * 0.01
    h = R // 2

    def attention(q, k, v):
        x = q
        for i in range(L):
            o = window_decode_attention(x, k[i], v[i], seen, new_k, new_k, fresh, active)
            x = (o.reshape(R, -1) @ mix).reshape(x.shape)
        return x

    def products(q, k, v):
        x = q.reshape(R, K, G, D)
        for i in range(L):
            x = jnp.einsum("rkgw,rkwd->rkgd", jnp.einsum("rkgd,rkdw->rkgw", x, k[i]), v[i])
        return x

    def read(q, k, v):
        return sum(a.sum() for a in k) + sum(a.sum() for a in v)

    def halves(q, k0, k1, v0, v1, joined: bool):
        a, b = q[:h].reshape(h, K, G, D), q[h:].reshape(R - h, K, G, D)
        for i in range(L):
            a = jnp.einsum("rkgw,rkwd->rkgd", jnp.einsum("rkgd,rkdw->rkgw", a, k0[i]), v0[i])
            b = jnp.einsum("rkgw,rkwd->rkgd", jnp.einsum("rkgd,rkdw->rkgw", b, k1[i]), v1[i])
            if joined:
                x = (jnp.concatenate([a, b]).reshape(R, -1) @ mix).reshape(R, K, G, D)
                a, b = x[:h], x[h:]
        return a, b

    def attention_halves(q, k0, k1, v0, v1):
        x = q
        for i in range(L):
            a = window_decode_attention(x[:h], k0[i], v0[i], seen[:h], new_k[:h], new_k[:h], fresh[:h], active[:h])
            b = window_decode_attention(x[h:], k1[i], v1[i], seen[h:], new_k[h:], new_k[h:], fresh[h:], active[h:])
            x = (jnp.concatenate([a, b]).reshape(R, -1) @ mix).reshape(x.shape)
        return x

    M, F = 576, 1536

    def scale(i, shape):
        return jax.random.normal(jax.random.fold_in(key, i), shape) * 0.02

    weights = [
        {"qkv": scale(1000 + i, (M, (K * G + 2 * K) * D)), "o": scale(2000 + i, (K * G * D, M)), "g": scale(3000 + i, (M, F)),
         "u": scale(4000 + i, (M, F)), "d": scale(5000 + i, (F, M))}
        for i in range(L)
    ]  # fmt: skip
    x0 = jax.random.normal(jax.random.fold_in(key, 9), (R, M))

    def model_step(x, weights, k, v, seen, new_k, fresh, active):
        for i in range(L):
            w = weights[i]
            q_ = (x @ w["qkv"])[:, : K * G * D].reshape(x.shape[0], K * G, D)
            o = window_decode_attention(q_, k[i], v[i], seen, new_k, new_k, fresh, active)
            x = x + o.reshape(x.shape[0], -1) @ w["o"]
            x = x + (jax.nn.silu(x @ w["g"]) * (x @ w["u"])) @ w["d"]
        return x

    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(jax.devices()[:2], ("rows",))
    by_rows, everywhere = NamedSharding(mesh, PartitionSpec("rows")), NamedSharding(mesh, PartitionSpec())

    def put(tree, where):
        return jax.tree.map(lambda a: jax.device_put(a, where), tree)

    on_two = (put(x0, by_rows), put(weights, everywhere), put(k, by_rows), put(v, by_rows),
              *(put(a, by_rows) for a in (seen, new_k, fresh, active)))  # fmt: skip

    def split(t, s):
        return tuple(jnp.array(a[s]) for a in t)

    k0, k1, v0, v1 = split(k, slice(0, h)), split(k, slice(h, R)), split(v, slice(0, h)), split(v, slice(h, R))
    cases = {
        "attention": (jax.jit(attention), (q, k, v)),
        "products": (jax.jit(products), (q, k, v)),
        "read": (jax.jit(read), (q, k, v)),
        "halves": (jax.jit(lambda *a: halves(*a, joined=False)), (q, k0, k1, v0, v1)),
        "halves, joined": (jax.jit(lambda *a: halves(*a, joined=True)), (q, k0, k1, v0, v1)),
        "attention, halves joined": (jax.jit(attention_halves), (q, k0, k1, v0, v1)),
        "model step": (jax.jit(model_step), (x0, weights, k, v, seen, new_k, fresh, active)),
        "model step, two devices": (jax.jit(model_step, out_shardings=by_rows), on_two),
    }
    out = {}
    for name, (f, args) in cases.items():
        jax.block_until_ready(f(*args))
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(f(*args))
            best = min(best, time.perf_counter() - t)
        out[name] = best
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cores", default="1,2", help="core counts to pin each run to")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        os.sched_setaffinity(0, set(range(args.child)))
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
        print(json.dumps(_measure(args.repeats)))
        return 0
    load0 = os.getloadavg()
    cores = [int(c) for c in args.cores.split(",") if c]
    runs = {}
    for c in cores:
        proc = subprocess.run(
            [sys.executable, "-m", "eval.profile.window_threads", "--child", str(c), "--repeats", str(args.repeats)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        runs[c] = json.loads(proc.stdout.strip().splitlines()[-1])
    load1 = os.getloadavg()
    from jaxkv.markdown import md_table  # here, after the timed children: the parent stays light while they run

    gb = 2 * L * R * K * D * W * 4 / 1e9
    lines = [
        "# The decode window's attention on the CPU: one core or two",
        "",
        (
            f"Generated by `python -m eval.profile.window_threads {' '.join(sys.argv[1:] if argv is None else argv)}`: "
            f"{R} rows x {W} entries x {L} layers ({gb:.2f} GB of float32 K/V), best of {args.repeats}; "
            f"load average {load0[0]:.2f} before, {load1[0]:.2f} after."
        ),
        "",
        md_table(
            ["what", *(f"{c} core{'s' if c > 1 else ''}: ms (GB/s)" for c in cores)],
            ([name, *(f"{runs[c][name] * 1e3:.1f} ({gb / runs[c][name]:.1f})" for c in cores)] for name in runs[cores[0]]),
            align="l" + "r" * len(cores),
        ),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
