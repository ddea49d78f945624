"""CPU decode speed of the quantized pool vs the float pool, one run.

The ~125M random Qwen3 of ``eval/bench/decode.py`` (float32 weights, built
in-process with ``jaxkv.model_from_config``), batch 1, one request holding
``N`` live tokens (4k and 32k), ``--steps`` greedy decode steps timed after a
warm-up (one ``run_decode`` call of ``--steps`` steps; ``--repeats`` calls, the
median counts), for six runs of the
same engine:

* ``float``: the float32 pool as a ``Server`` sizes it (2 x positions + 1 slots),
  where the CPU decode loop reads a per-call head-major window of the row's list
  (``jaxkv.backends.cpu_float.take_window``);
* ``float-gather``: the float32 pool too tight for that window, so every step
  gathers key blocks through the live list;
* ``int4``: every live token INT4 (``Engine(kv_quant="int4")``), read through the
  float window of its dequantized entries (``CpuQuantBackend.take_window``: the
  row's list dequantized once, kept across calls as the float pool's window is,
  each step's new token stored INT4);
* ``int4-gather``: the same pool without the window (``engine.runner.use_window =
  False``): every step gathers packed rows from the pool by slot and dequantizes
  them (``decode_parts_attention``), the path before the window;
* ``mixed`` / ``mixed-gather``: 65% of the live tokens in INT2 pages, 35% INT4
  (~2.7 average bits, ``kv_quant="triaxial"``), with and without the window (the
  window holds the row's entries dequantized in list order, pages and INT4 tokens
  alike).

Pool contents are random (decode cost does not depend on the values). The KV
bytes each pool holds for the request (what the per-step gather reads) and the
ratio to the ``float`` pool's tokens/s are printed side by side.

``--model NAME_OR_PATH`` runs a real checkpoint instead (for SmolLM2-135M-Instruct:
``--model smollm2-135m-instruct --contexts 4096,8000``; its context is 8,192
positions, so a context must leave room for the timed steps). The 1-minute load
average is printed before and after: a run that starts above 0.5 shared the machine.

Batch-1 decode on a 2-core machine moves by up to 25% from one process's run to the
next, so with ``--rounds R`` every pool of a context is built and warmed first and
the timed calls then go round the pools ``R`` times (float, int4, mixed, float,
...): a drift of the machine's speed touches every pool alike, the table gives each
pool's median over the rounds, and the ratio to the float pool in each round.
``--modes`` picks the pools (default: all six).

Usage: python -m eval.bench.quant_decode [--steps 16] [--repeats 1] [--rounds 1] [--modes float,int4,mixed]
    [--contexts 4096,32768] [--model M] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxkv  # noqa: E402
from eval.bench.decode import QWEN3_125M, fill_pool_randomly  # noqa: E402
from jaxkv.cache.quantized import INT2, INT4, FLOAT  # noqa: E402
from jaxkv.cache.quantized_host import bytes_per_token  # noqa: E402
from jaxkv.config import ModelConfig  # noqa: E402
from jaxkv.engine import Engine  # noqa: E402
from jaxkv.markdown import md_header, md_row  # noqa: E402
from jaxkv.kernels.quant import PAGE  # noqa: E402

INT2_SHARE = 0.65  # mixed pool: 0.65 * 2 + 0.35 * 4 = 2.7 bits


def build_model(max_context: int, dtype="float32", config=QWEN3_125M):
    """A random Qwen3 of ``config`` (default the ~125M shape) whose context holds ``max_context``."""
    cfg = ModelConfig.from_hf({**config, "model_type": "qwen3", "max_position_embeddings": max_context})
    return jaxkv.model_from_config(cfg, dtype=dtype, seed=0)


def fill_packed_randomly(engine, rng) -> None:
    """Random codes and small positive scales in every quantized buffer."""

    def rand(a):
        if a.dtype == jnp.uint8:
            return jnp.asarray(rng.integers(0, 256, a.shape, dtype=np.uint8))
        return jnp.asarray(rng.uniform(0.01, 0.1, a.shape).astype(np.float16)).astype(a.dtype)

    engine.kv.commit(engine.cache.with_kv(jax.tree.map(rand, engine.cache.pool)))


def open_request(engine, n: int, mode: str) -> int:
    """A row holding ``n`` live tokens of the pool's kinds (random contents)."""
    if mode == "mixed":
        pages = int(INT2_SHARE * n) // PAGE
        _, two = engine.allocator.allocate_pages(np.full(pages, PAGE))
        four = engine.allocator.allocate(n - two.size)
        slots = np.concatenate([two, four])
    else:
        slots = engine.allocator.allocate(n)
    row = engine.open_row(slots)
    engine.allocator.release(slots)  # the row holds the only reference now
    return row


MODES = ("float", "float-gather", "int4", "int4-gather", "mixed", "mixed-gather")


def prepare(model, mode: str, n: int, steps: int) -> dict:
    """One request of ``n`` live tokens in a pool of ``mode``, its decode program
    compiled and warmed: the engine, the row, its first token and the KV bytes the
    request holds in its pool's format."""
    rng = np.random.default_rng(0)
    kind, _, gather = mode.partition("-")
    kv_quant = {"float": None, "int4": "int4", "mixed": "triaxial"}[kind]
    P = n + steps + 1
    # the pool a Server sizes (2 x rows x positions + 1 slots: room for the window,
    # ``ModelRunner.uses_window``); "-gather" turns the window off
    engine = Engine(model, rows=1, max_positions=P, num_slots=2 * P + 1, kv_quant=kv_quant)
    engine.runner.use_window = not gather
    row = open_request(engine, n, kind)
    if kv_quant is None:
        fill_pool_randomly(engine, rng)
    else:
        fill_packed_randomly(engine, rng)
    cfg = model.config
    size = dict(head_dim=cfg.head_dim, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads)
    if kv_quant is None:
        kv_bytes = n * bytes_per_token(FLOAT, **size) * jnp.dtype(model.dtype).itemsize / 2  # FLOAT counts bf16
    else:
        comp = engine.kv.composition(row)
        kv_bytes = comp[INT2] * bytes_per_token(INT2, **size) + comp[INT4] * bytes_per_token(INT4, **size)
    first = [int(rng.integers(0, cfg.vocab_size))]
    engine.decode([row], first, steps)  # compile + warm-up
    return dict(engine=engine, row=row, first=first, n=n, kv_bytes=kv_bytes)


def time_calls(run: dict, steps: int, repeats: int) -> float:
    """Tokens/s of the median of ``repeats`` timed decode calls of ``steps`` steps,
    each from the request's ``n`` live tokens."""
    engine, row = run["engine"], run["row"]
    times = []
    for _ in range(repeats):
        engine.truncate_row(row, run["n"])  # rewind to the n live tokens
        jax.block_until_ready(engine.cache.kv)
        t0 = time.perf_counter()
        engine.decode([row], run["first"], steps)
        times.append(time.perf_counter() - t0)
    return steps / float(np.median(times))


def bench(model, mode: str, n: int, steps: int, repeats: int = 1) -> tuple[float, float]:
    """(tokens/s, KV bytes of the request in its pool's format) of one request of
    ``n`` live tokens."""
    run = prepare(model, mode, n, steps)
    return time_calls(run, steps, repeats), run["kv_bytes"]


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1, help="timed decode calls per run; their median counts")
    ap.add_argument("--rounds", type=int, default=1, help="timed calls go round the pools this many times; medians per pool")
    ap.add_argument("--modes", default=",".join(MODES), help="the pools, comma-separated, the float one first")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--model", default=None, help="a model name or folder (default: the random ~125M Qwen3)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    if not modes or modes[0] != "float" or set(modes) - set(MODES):
        ap.error(f"--modes: some of {', '.join(MODES)}, beginning with float (the ratios' base)")
    load_before = os.getloadavg()[0]
    if args.model:
        model = jaxkv.load_model(args.model)
        room = model.config.max_position_embeddings - args.steps - 1
        if max(contexts) > room:
            ap.error(
                f"--contexts: {args.model} holds {model.config.max_position_embeddings} positions, so at most {room} live tokens with {args.steps} steps"
            )
    else:
        model = build_model(max(contexts) + args.steps + 64)
    n_params = sum(x.size for x in jax.tree.leaves(model.split()[1]))
    what = f"{args.model} ({n_params / 1e6:.0f}M" if args.model else f"random Qwen3 ({n_params / 1e6:.0f}M"
    lines = [
        f"1-minute load average before the run: {load_before:.2f}.",
        "",
        f"Quantized vs float KV pool, decode, {what} float32 weights), batch 1, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__} ({jax.default_backend()}); "
        f"{args.steps} timed greedy steps after warm-up (one decode call; the median of {args.repeats}"
        f"{f'; {args.rounds} rounds over the pools, alternating, the median of the rounds' if args.rounds > 1 else ''}); "
        "float / int4 / mixed = the decode window (float rows; the quantized pools' entries dequantized once into it, kept across calls), "
        "-gather = the window off: key blocks gathered from the pool every step (quantized: decode_parts_attention); KV bytes = the request's entries in its pool's format.",
        "",
        *md_header(["live tokens", "pool", "tok/s", "vs float", "vs float per round", "KV bytes (pool format)", "vs float"], "rlrrlrr"),
    ]
    print("\n".join(lines), flush=True)
    for n in contexts:
        runs = {mode: prepare(model, mode, n, args.steps) for mode in modes}
        tps = {mode: [] for mode in modes}
        for _ in range(args.rounds):
            for mode in modes:
                tps[mode].append(time_calls(runs[mode], args.steps, args.repeats))
        base, base_bytes = float(np.median(tps["float"])), runs["float"]["kv_bytes"]
        for mode in modes:
            med, kv_bytes = float(np.median(tps[mode])), runs[mode]["kv_bytes"]
            per_round = ", ".join(f"{t / f:.2f}" for t, f in zip(tps[mode], tps["float"]))
            row = md_row(
                [n, mode, f"{med:.2f}", f"{med / base:.2f}x", per_round, f"{kv_bytes / 2**20:.1f} MiB", f"{kv_bytes / base_bytes:.2f}x"]
            )
            lines.append(row)
            print(row, flush=True)
        del runs
    lines += ["", f"1-minute load average after the run: {os.getloadavg()[0]:.2f}."]
    print(lines[-1], flush=True)
    table = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    return table


if __name__ == "__main__":
    main()
