"""Why jaxkv's prefill is slow on a GPU: a probe that times the pieces apart.

    python eval/prefill_probe.py [--model smollm2-135m-instruct] [--dtype bfloat16]
        [--lengths 2048,8192] [--budget 260] [--out probe.json]

The device check (``eval/device_check.py``) found ``Engine.prefill`` of 8,192 tokens
at 0.12x transformers' speed on an H200 after its compiles (2% of the bf16 matmul
rate), and 0.41x at 2,048. This script separates the candidate causes, one timed
experiment each, first call (compiles) apart from the warm median:

* ``engine``: ``Engine.prefill`` (chunk 512) with ``prefill_attention``'s query
  blocks at ``CAUSAL_BLOCK`` (128 rows, the CPU width, and the GPU's too before this
  probe), with the time inside the ``prefill_step`` calls (dispatch + device, each
  blocked on) apart from the rest (the engine's host bookkeeping between chunks).
* ``engine_block``: the same with the query block widened to the whole chunk (what
  ``jaxkv.attention.query_block`` now picks on a GPU).
* ``engine_chunk``: one chunk as wide as the prompt.
* ``dense``: the model's own dense causal forward (no pool, no gather), jit'd,
  last token's logits, in 128-row blocks, one block, and through
  ``jax.nn.dot_product_attention`` (cuDNN's fused attention on a GPU): what the same
  layers cost with no cache in the way.

Each experiment is skipped, with the reason recorded, once ``--budget`` seconds are
spent. Results go to ``--out`` (JSON lines, written as they come) and stdout. A
diagnostic, not a benchmark: the report that compares against transformers is the
device check's.
"""

from __future__ import annotations

import argparse
import json
import os
import time

# eval.bench_prefill defaults JAX_PLATFORMS to the CPU; this probe runs on whatever
# JAX finds (an empty value is JAX's default), unless the caller chose a platform.
os.environ.setdefault("JAX_PLATFORMS", "")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv import attention as ref_attention  # noqa: E402
from jaxkv import engine as engine_module  # noqa: E402
from eval.bench_prefill import median_time, prefill_runner  # noqa: E402
from jaxkv.engine import PREFILL_CHUNK  # noqa: E402


class StepTimer:
    """Wraps ``jaxkv.engine.prefill_step`` so each call blocks on its result and its
    seconds add up; what a prefill spends outside these calls is host work."""

    def __init__(self):
        self.original = engine_module.prefill_step
        self.seconds = 0.0
        self.calls = 0

    def __enter__(self):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = jax.block_until_ready(self.original(*args, **kwargs))
            self.seconds += time.perf_counter() - t0
            self.calls += 1
            return out

        engine_module.prefill_step = timed
        return self

    def __exit__(self, *exc):
        engine_module.prefill_step = self.original


def time_engine(model, T, chunk, repeats, *, block):
    saved = dict(ref_attention.prefill_attention.__kwdefaults__)
    # the block is not part of prefill_step's jit key: drop its programs on both sides
    ref_attention.prefill_attention.__kwdefaults__["block"] = block
    engine_module.prefill_step.clear_cache()
    try:
        run = prefill_runner(model, T, chunk)
        t0 = time.perf_counter()
        run()
        first = time.perf_counter() - t0
        warm = median_time(run, repeats)
        with StepTimer() as timer:
            run()
        return {"first_s": first, "warm_s": warm, "steps": timer.calls, "in_steps_s": timer.seconds}
    finally:
        ref_attention.prefill_attention.__kwdefaults__.clear()
        ref_attention.prefill_attention.__kwdefaults__.update(saved)
        engine_module.prefill_step.clear_cache()


def fused_attention(q, k, v):
    impl = "cudnn" if jax.default_backend() == "gpu" else None
    return jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), is_causal=True, implementation=impl)


def time_dense(model, T, repeats, *, attention):
    graphdef, params = model.split()

    @jax.jit
    def forward(params, tokens):
        m = nnx.merge(graphdef, params)
        positions = jnp.arange(T, dtype=jnp.int32)[None, :]
        x = m._run(tokens, positions, lambda i, q, k, v: attention(q, k, v))
        return m.logits(x[:, -1:])

    tokens = jnp.asarray(np.random.default_rng(T).integers(0, model.config.vocab_size, (1, T)), jnp.int32)
    t0 = time.perf_counter()
    jax.block_until_ready(forward(params, tokens))
    first = time.perf_counter() - t0
    warm = median_time(lambda: jax.block_until_ready(forward(params, tokens)), repeats)
    return {"first_s": first, "warm_s": warm}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=float, default=260.0, help="seconds; later experiments are skipped past it")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    model = jaxkv.load_model(args.model, dtype=args.dtype)
    lengths = [int(x) for x in args.lengths.split(",")]
    short, long = lengths[0], lengths[-1]
    def one_block(q, k, v):
        return ref_attention.causal_attention(q, k, v, block=q.shape[1])

    def blocks_of_128(q, k, v):
        return ref_attention.causal_attention(q, k, v, block=ref_attention.CAUSAL_BLOCK)

    plan = [
        ("dense", short, "block 128", lambda: time_dense(model, short, args.repeats, attention=blocks_of_128)),
        ("dense", short, "one block", lambda: time_dense(model, short, args.repeats, attention=one_block)),
        ("dense", short, "dot_product_attention", lambda: time_dense(model, short, args.repeats, attention=fused_attention)),
        ("engine", short, f"chunk {PREFILL_CHUNK}, block {ref_attention.CAUSAL_BLOCK}", lambda: time_engine(model, short, PREFILL_CHUNK, args.repeats, block=ref_attention.CAUSAL_BLOCK)),
        ("engine_block", short, f"chunk {PREFILL_CHUNK}, block {PREFILL_CHUNK}", lambda: time_engine(model, short, PREFILL_CHUNK, args.repeats, block=PREFILL_CHUNK)),
        ("engine_chunk", short, f"chunk {short}, block {short}", lambda: time_engine(model, short, short, args.repeats, block=short)),
        ("dense", long, "dot_product_attention", lambda: time_dense(model, long, args.repeats, attention=fused_attention)),
        ("dense", long, "block 128", lambda: time_dense(model, long, args.repeats, attention=blocks_of_128)),
        ("dense", long, "one block", lambda: time_dense(model, long, args.repeats, attention=one_block)),
    ]
    out = open(args.out, "w") if args.out else None
    header = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(), "model": args.model, "dtype": args.dtype, "jax": jax.__version__, "load_s": time.perf_counter() - start}
    print(json.dumps(header), flush=True)
    if out:
        out.write(json.dumps(header) + "\n")
        out.flush()
    for name, T, variant, fn in plan:
        record = {"experiment": name, "tokens": T, "variant": variant}
        if time.perf_counter() - start > args.budget:
            record["skipped"] = "past the budget"
        else:
            try:
                record.update(fn())
            except Exception as exc:  # a diagnostic: record the failure and go on
                record["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        record["elapsed_s"] = time.perf_counter() - start
        print(json.dumps(record), flush=True)
        if out:
            out.write(json.dumps(record) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
