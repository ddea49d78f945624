"""Which side of the device check's INT4-write comparison is off on a GPU.

Quantizes the device check's INT4-write problem five ways (the Triton write kernel;
``write_int4_rows_reference`` under XLA on the GPU, eager and jit'd, and on the CPU)
and compares each with the numpy float32 oracle ``jaxkv.kernels.testing.int4_fit_np``,
counting differing codes, scales and zeros over the written rows. On the H200 on
2026-11-26 it showed the kernel equal to the oracle and XLA:GPU off (see
``eval/results/device_NVIDIA_H200_followup.md``).

    python -m eval.profile.int4_write            # on a CUDA machine with jax-triton
    python -m eval.profile.int4_write --cpu      # the same comparison, kernel in the Triton interpreter
"""

from __future__ import annotations

import argparse
import functools
import os


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="Triton interpreter, XLA:CPU only, 1024 slots")
    args = ap.parse_args()
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxkv.kernels.triton import quant_write
    from jaxkv.kernels.kv_write import write_int4_rows_reference
    from jaxkv.kernels.testing import decode_codes_np, int4_fit_np, int4_write_problem

    if args.cpu:
        from jaxkv.kernels.triton.interpret import interpret_call as launcher
    else:
        from jaxkv.kernels.triton.launch import triton_call as launcher
    rows, slots, x = int4_write_problem(4, 512, 8, 128, 1024 if args.cpu else 16384, jnp.bfloat16)
    results = {"triton": jax.jit(functools.partial(quant_write.write_int4_rows, launcher=launcher))(rows, slots, x)}
    cpu = jax.devices("cpu")[0]
    if not args.cpu:
        results["xla_gpu_eager"] = write_int4_rows_reference(rows, slots, x)
        results["xla_gpu_jit"] = jax.jit(write_int4_rows_reference)(rows, slots, x)
    on_cpu = jax.device_put((rows, slots, x), cpu)
    with jax.default_device(cpu):
        results["xla_cpu_eager"] = write_int4_rows_reference(*on_cpu)
        results["xla_cpu_jit"] = jax.jit(write_int4_rows_reference)(*on_cpu)
    at = np.asarray(slots)
    oracle = int4_fit_np(x)
    for name, r in results.items():
        got = (decode_codes_np(np.asarray(r.data)[at], 4), np.asarray(r.scale)[at], np.asarray(r.zero)[at])
        codes, scales, zeros = (int(np.sum(a != b)) for a, b in zip(got, oracle))
        print(f"{name:14s} vs the float32 oracle: {codes} codes, {scales} scales, {zeros} zeros differ (of {oracle[0].size} codes)")


if __name__ == "__main__":
    main()
