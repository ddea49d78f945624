"""Kernel bandwidth benchmark: decode attention (bf16, INT4, mixed ~2.7 bits) and RoPE delta.

For each kernel, context and batch it reports achieved bandwidth = bytes that must
move (the static cost model of ``jaxkv.kernels.cost``: K/V bytes of every live entry
incl. scales/zeros, index lists, q/out; for RoPE delta the rotated rows read and
written) / median wall time, as a fraction of
a device-to-device copy (``-x``: read + write) measured in the same run, and the
speedup of INT4 and mixed decode over bf16 decode. Timing: warm-up call, then
``--reps`` calls each followed by ``block_until_ready``, median; when a working set
is small enough to sit in cache, inputs rotate over several copies.

On an NVIDIA GPU the Triton kernels run (``backend=None`` resolves to ``"gpu"``; a
TPU runs the Pallas kernels): contexts 4k/32k/128k, batch 1 and 32, Hkv 8, G 4,
D 128, so the GPU rows are directly comparable with the floors of
``eval/results/kernels_aot.md``. On CPU only the jnp reference exists and settings are
smaller (contexts 4k/32k, batch 1 and 4, Hkv 2) so it finishes in a few minutes;
the table says which. Usage::

    python -m eval.bench.kernels [--out eval/results/kernels_cpu.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp

from jaxkv.config import RopeConfig
from jaxkv.markdown import md_header, md_row
from jaxkv.kernels import cost
from jaxkv.kernels import decode_attention, quantize_int2_pool, quantize_int4_pool, quantized_decode_attention, resolve_backend, rope_delta

CACHE_BYTES = 256 << 20  # rotate inputs until the set of copies exceeds this
INT2_FRACTION = 0.65  # 0.65 * 2 + 0.35 * 4 = 2.7 bits


def median_call_seconds(fn, inputs, reps):
    """Median wall time of ``fn(*inputs[i])`` (rotating over ``inputs``) after one warm-up call."""
    jax.block_until_ready(fn(*inputs[0]))
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*inputs[i % len(inputs)]))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def input_copies(nbytes):
    """Copies of a working set of ``nbytes`` to rotate over so that repeated calls miss the cache."""
    return max(1, min(4, -(-CACHE_BYTES // max(nbytes, 1))))


def copy_bandwidth(reps, nbytes=None):
    """Device copy bandwidth (bytes read + written per second) of ``-x`` over ``nbytes``
    (default: 2 GiB on an accelerator, ``CACHE_BYTES`` on the CPU)."""
    if nbytes is None:
        nbytes = CACHE_BYTES if jax.default_backend() == "cpu" else 2 << 30
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    neg = jax.jit(lambda a: -a)
    return 2 * x.nbytes / median_call_seconds(neg, [(x,)], reps)


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """One decode-attention call to time: ``public(q, *operands, backend=...)``, or the
    Triton glue with an explicit launcher, ``triton(launcher)(q, *operands)``.

    Attributes:
      name: the table's kernel column ("decode bf16", "decode INT4", "decode mixed 2.7b").
      operands: the arguments after the queries (pools, lists; ``None`` for absent parts).
      quantized: ``quantized_decode_attention`` (else ``decode_attention``).
      cost: bytes and flops that must move (``jaxkv.kernels.cost``).
    """

    name: str
    operands: tuple
    quantized: bool
    cost: cost.Cost

    @property
    def public(self) -> Callable:
        return quantized_decode_attention if self.quantized else decode_attention

    def triton(self, launcher) -> Callable:
        """The ``jaxkv.kernels.triton.decode`` glue of this call with ``launcher`` (imports triton)."""
        from jaxkv.kernels.triton import decode as gpu_decode

        fn = gpu_decode.quantized_decode_attention if self.quantized else gpu_decode.decode_attention
        return functools.partial(fn, launcher=launcher)


def decode_cases(ctx, B, K, G, D, key):
    """``(q [B, K*G, D] bf16, cases)``: bf16 pool, INT4 pool and the mixed INT2/INT4 pool
    (the first ``INT2_FRACTION`` of each request's tokens in INT2 pages) over the same
    random K/V, every request holding ``ctx`` live tokens in random slots."""
    ks = jax.random.split(key, 4)
    S = B * ctx + 1
    k = jax.random.normal(ks[0], (S, K, D), jnp.bfloat16)
    v = jax.random.normal(ks[1], (S, K, D), jnp.bfloat16)
    q = jax.random.normal(ks[2], (B, K * G, D), jnp.bfloat16)
    idx = (jax.random.permutation(ks[3], S - 1)[: B * ctx] + 1).reshape(B, ctx).astype(jnp.int32)
    lens = jnp.full((B,), ctx, jnp.int32)
    Hq = K * G
    pool4 = quantize_int4_pool(k, v)
    cases = [
        DecodeCase("decode bf16", (k, v, idx, lens), False, cost.decode_float(B, Hq, K, D, ctx)),
        DecodeCase("decode INT4", (None, None, None, pool4, idx, lens), True, cost.decode_quantized(B, Hq, K, D, ctx)),
    ]
    n2 = int(INT2_FRACTION * ctx) // 32 * 32
    if n2:
        pool2 = quantize_int2_pool(k[1 : 1 + B * n2], v[1 : 1 + B * n2])
        pages = jnp.arange(B * n2 // 32, dtype=jnp.int32).reshape(B, n2 // 32)
        npages = jnp.full((B,), n2 // 32, jnp.int32)
        idx4, len4 = idx[:, n2:], jnp.full((B,), ctx - n2, jnp.int32)
        mixed = cost.decode_quantized(B, Hq, K, D, ctx - n2, n2 // 32)
        cases.append(DecodeCase("decode mixed 2.7b", (pool2, pages, npages, pool4, idx4, len4), True, mixed))
    return q, cases


def bench_case(ctx, B, K, G, D, reps, key):
    """Rows of the table for one (context, batch)."""
    q, cases = decode_cases(ctx, B, K, G, D, key)
    k, _, idx, _ = cases[0].operands
    rows, times = [], {}
    for case in cases:
        fn = jax.jit(case.public)
        inputs = [(q, *jax.tree.map(jnp.copy, case.operands)) for _ in range(input_copies(case.cost.bytes))]
        times[case.name] = median_call_seconds(fn, inputs, reps)
        rows.append((case.name, case.cost.bytes, times[case.name]))
        del inputs
    # RoPE delta over every live token of the batch, one layer
    delta = jax.random.randint(jax.random.fold_in(key, 4), (B * ctx,), -64, 64, jnp.int32)
    slots = idx.reshape(-1)
    moved = cost.rope_delta(1, B * ctx, K, D).bytes
    rope = RopeConfig(theta=500000.0)
    pool = k.copy()
    t = []
    for _ in range(reps + 1):  # the pool is donated: feed each call the previous output
        t0 = time.perf_counter()
        pool = jax.block_until_ready(rope_delta(pool, slots, delta, rope))
        t.append(time.perf_counter() - t0)
    rows.append(("rope delta", moved, statistics.median(t[1:])))
    bf16 = times["decode bf16"]
    return [(name, ctx, B, m, s, bf16 / s if name.startswith("decode") else None) for name, m, s in rows]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the markdown table here")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    on_cpu = jax.default_backend() == "cpu"
    contexts, batches, K = ((4096, 32768), (1, 4), 2) if on_cpu else ((4096, 32768, 131072), (1, 32), 8)
    G, D = 4, 128
    device = jax.devices()[0].device_kind
    backend = resolve_backend(None)
    copy_bw = copy_bandwidth(args.reps)
    lines = [
        f"# Kernel bandwidth on {device} (backend `{backend}`)",
        "",
        f"Hq={K * G}, Hkv={K}, D={D}, bf16 pool; mixed = {INT2_FRACTION:.0%} of tokens INT2 (~2.7 bits). "
        f"Device copy bandwidth: {copy_bw / 1e9:.1f} GB/s. "
        + ("CPU run: jnp reference path only, reduced settings (contexts 4k/32k, batch 1/4, Hkv 2)." if on_cpu else ""),
        "",
        *md_header(["kernel", "context", "batch", "MB moved", "median ms", "GB/s", "frac of copy", "speedup vs bf16"]),
    ]
    key = jax.random.key(0)
    for ctx in contexts:
        for B in batches:
            for name, c, b, moved, sec, speedup in bench_case(ctx, B, K, G, D, args.reps, key):
                bw = moved / sec
                sp = f"{speedup:.2f}x" if speedup is not None else ""
                lines.append(md_row([name, c, b, f"{moved / 1e6:.1f}", f"{sec * 1e3:.2f}", f"{bw / 1e9:.2f}", f"{bw / copy_bw:.3f}", sp]))
                print(lines[-1], flush=True)
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
