"""Prefill (and decode) speed: jaxkv vs transformers on the same weights, CPU.

    JAX_PLATFORMS=cpu python -m eval.bench.prefill [--model M] [--lengths 512,2048]
        [--chunks 256,512,1024,2048] [--decode] [--out FILE.md]

One process, one set of weights, float32, batch 1: a random ~125M Qwen3 (built in
torch, saved, loaded by jaxkv) or, with ``--model``, any name or path
``jaxkv.load_model`` takes (``smollm2-135m-instruct``), transformers reading the
same float32 weights. Printed side by side:

* **GEMM peak**: the best GFLOP/s of a jit'd float32 matmul of the model's own
  shapes (``[T, 768] x [768, 2048]`` and ``[T, 2048] x [2048, 768]``), measured in
  this run: the ceiling both engines share on this CPU.
* **Prefill** of a random prompt of each length from an empty cache: jaxkv's
  ``Engine.prefill`` (the serving path: paged pool, chunked, logits of the last
  token only) at the default chunk size and, with ``--chunks``, at each chunk size
  (how ``PREFILL_CHUNK`` was chosen); the public ``jaxkv.generate(model, [ids],
  max_new_tokens=1)`` (time to first token as a library user sees it: engine
  set-up and sampling included); transformers' forward two ways, all logits
  (``model(ids)``) and the last token's (``logits_to_keep=1``), the faster being the
  reference. Each engine's achieved GFLOP/s counts the matmul work it does
  (weights x tokens, causal attention, and the vocabulary projection of the
  tokens it scores) and is reported as a fraction of the GEMM peak.
* With ``--decode`` (default on), the decode table of ``eval/bench/decode.py`` in
  the same run, with both transformers loops (manual cache loop and ``generate``).

Times are medians of ``--repeats`` runs after a warm-up (compiles excluded). The
machine should be otherwise idle: the README's table says when it was.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from eval.bench.decode import build_models, decode_table, read_bandwidth_gbs, torch_generator, torch_sync  # noqa: E402
from jaxkv import buckets  # noqa: E402
from jaxkv.engine import PREFILL_CHUNK, Engine  # noqa: E402
from jaxkv.markdown import md_header, md_row  # noqa: E402


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_peak_gflops(T: int, M: int, F: int, repeats: int = 5) -> float:
    """Best float32 GFLOP/s of ``[T,M]x[M,F]`` and ``[T,F]x[F,M]`` (the MLP's shapes)."""
    best = 0.0
    rng = np.random.default_rng(0)
    for a_shape, b_shape in (((T, M), (M, F)), ((T, F), (F, M))):
        a = jnp.asarray(rng.standard_normal(a_shape, np.float32))
        b = jnp.asarray(rng.standard_normal(b_shape, np.float32))
        f = jax.jit(jnp.matmul)
        f(a, b).block_until_ready()
        t = min(median_time(lambda: f(a, b).block_until_ready(), 1) for _ in range(repeats))
        best = max(best, 2 * a_shape[0] * a_shape[1] * b_shape[1] / t / 1e9)
    return best


def prefill_flops(cfg, T: int, scored_tokens: int) -> float:
    """Matmul FLOPs of a causal prefill of T tokens from an empty cache."""
    M, F, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_token_linear = 2 * L * (M * Hq * D * 2 + M * Hkv * D * 2 + 3 * M * F)
    attention = 2 * 2 * L * Hq * D * T * (T + 1) / 2  # QK^T and PV, causal
    vocab = 2 * M * cfg.vocab_size * scored_tokens
    return per_token_linear * T + attention + vocab


def prefill_programs(T: int, chunk: int, rows: int = 1) -> int:
    """Step programs a fresh ``Engine(rows=rows, prefill_chunk=chunk)`` compiles for
    one ``T``-token prompt: one per distinct token bucket of its pieces
    (``jaxkv.buckets.step_tokens``); live lengths are data, not shapes."""
    budget = buckets.token_budget(chunk, rows)
    sizes, done = set(), 0
    while done < T:
        n = min(chunk, T - done)
        sizes.add(buckets.step_tokens(n, budget))
        done += n
    return len(sizes)


def prefill_runner(model, T: int, chunk: int):
    """A fresh one-row engine and ``run()``: one ``Engine.prefill`` of the same random
    ``T``-token prompt (seeded by ``T``) from an empty row, blocked on, row closed."""
    rng = np.random.default_rng(T)
    tokens = rng.integers(0, model.config.vocab_size, T).tolist()
    engine = Engine(model, rows=1, max_positions=T, num_slots=T + 1, prefill_chunk=chunk)

    def run():
        row = engine.open_row()
        engine.prefill([row], [tokens])
        jax.block_until_ready(engine.cache.k)
        engine.close_row(row)

    return run


def time_jaxkv(model, T: int, chunk: int, repeats: int) -> tuple[float, float]:
    """``(first, median)`` seconds of ``Engine.prefill`` of a random ``T``-token prompt
    on a fresh engine (``prefill_runner``): the first call (its ``prefill_programs``
    compiles and one run), then the median of ``repeats`` calls after it."""
    run = prefill_runner(model, T, chunk)
    start = time.perf_counter()
    run()  # compile + warm-up
    first = time.perf_counter() - start
    return first, median_time(run, repeats)


def bench_jaxkv(model, T: int, chunk: int, repeats: int) -> float:
    """Median seconds of ``Engine.prefill`` after a warm-up (``time_jaxkv``)."""
    return time_jaxkv(model, T, chunk, repeats)[1]


def bench_generate_ttft(model, T: int, repeats: int) -> float:
    """Time to first token through the public ``jaxkv.generate(model, [ids],
    max_new_tokens=1)``: what a user calling the library sees (engine set-up and
    sampling included), after a warm-up call."""
    import jaxkv

    rng = np.random.default_rng(T)
    tokens = rng.integers(0, model.config.vocab_size, T).tolist()
    run = lambda: jaxkv.generate(model, [tokens], max_new_tokens=1)  # noqa: E731
    run()
    return median_time(run, repeats)


def bench_torch(tm, T: int, repeats: int, keep_last: bool) -> float:
    import torch

    g = torch_generator(tm, T)
    ids = torch.randint(0, tm.config.vocab_size, (1, T), generator=g, device=g.device)
    kwargs = {"logits_to_keep": 1} if keep_last else {}

    def run():
        with torch.no_grad():
            tm(ids, use_cache=True, **kwargs)
        torch_sync(tm)

    run()
    return median_time(run, repeats)


def prefill_table(tm, model, lengths, chunks, repeats: int) -> list[str]:
    cfg = model.config
    peak = max(gemm_peak_gflops(T, cfg.hidden_size, cfg.intermediate_size) for T in lengths)
    bandwidth = read_bandwidth_gbs()
    lines = [
        f"GEMM peak (float32, the MLP's shapes, best of the lengths): {peak:.0f} GFLOP/s; "
        f"read bandwidth (a float32 sum over 1 GiB): {bandwidth:.1f} GB/s",
        "",
        *md_header(
            [
                "tokens",
                "jaxkv s (chunk)",
                "jaxkv.generate TTFT s",
                "transformers s, all logits",
                "transformers s, last logits",
                "ratio (ref / jaxkv)",
                "ratio (ref / generate)",
                "jaxkv % peak",
                "transformers % peak",
            ],
            "r" * 9,
        ),
    ]
    print("\n".join(lines), flush=True)
    sweep = []
    for T in lengths:
        ours = bench_jaxkv(model, T, PREFILL_CHUNK, repeats)
        public = bench_generate_ttft(model, T, repeats)
        hf_all = bench_torch(tm, T, repeats, keep_last=False)
        hf_last = bench_torch(tm, T, repeats, keep_last=True)
        ref, ref_scored = (hf_last, 1) if hf_last <= hf_all else (hf_all, T)
        ours_pct = 100 * prefill_flops(cfg, T, 1) / ours / 1e9 / peak
        ref_pct = 100 * prefill_flops(cfg, T, ref_scored) / ref / 1e9 / peak
        row = md_row(
            [
                T,
                f"{ours:.3f} ({min(PREFILL_CHUNK, T)})",
                f"{public:.3f}",
                f"{hf_all:.3f}",
                f"{hf_last:.3f}",
                f"{ref / ours:.2f}x",
                f"{ref / public:.2f}x",
                f"{ours_pct:.0f}%",
                f"{ref_pct:.0f}%",
            ]
        )
        lines.append(row)
        print(row, flush=True)
        for c in chunks:
            if c != PREFILL_CHUNK and c <= T:
                sweep.append((T, c, bench_jaxkv(model, T, c, repeats)))
    if sweep:
        lines += [
            "",
            "Chunk-size sweep (jaxkv prefill seconds; the default is chosen from this):",
            "",
            *md_header(["tokens", "chunk", "jaxkv s"], "rrr"),
        ]
        lines += [md_row([T, c, f"{t:.3f}"]) for T, c, t in sweep]
        print("\n".join(lines[-len(sweep) - 4 :]), flush=True)
    return lines


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--chunks", default="", help="also time these prefill chunk sizes (e.g. 256,512,1024,2048)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode", action=argparse.BooleanOptionalAction, default=True, help="also run the decode table")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per cell")
    ap.add_argument("--model", default=None, help="any name or path jaxkv.load_model takes (default: a random ~125M Qwen3)")
    ap.add_argument("--out", default=None, help="also write the markdown here")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    lengths = [int(x) for x in args.lengths.split(",")]
    chunks = [int(x) for x in args.chunks.split(",") if x]
    with tempfile.TemporaryDirectory() as folder:
        tm, model, n_params, label = build_models(folder, args.model)
        context = model.config.max_position_embeddings
        if max(lengths) >= context:  # the TTFT column asks one token more than the prompt
            raise SystemExit(
                f"--lengths: every length must be below the model's context ({context}): "
                f"jaxkv.generate's TTFT row needs the prompt plus one token"
            )
        header = (
            f"{label} float32, batch 1, {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores, jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}; "
            f"medians of {args.repeats} runs after a warm-up; load average at start "
            f"{os.getloadavg()[0]:.2f}."
        )
        print(header, "\n", flush=True)
        lines = [header, "", "### Prefill", ""] + prefill_table(tm, model, lengths, chunks, args.repeats)
        if args.decode:
            lines += ["", "### Decode (same run)", ""] + decode_table(tm, model, n_params, args.steps, (512, 4096), (1, 8), label)
    load = os.getloadavg()
    lines += [
        "",
        f"Load average (1/5/15 min) at the end of the run: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} "
        f"(the bench itself keeps about 2 on these 2 cores; other jobs running would push it higher).",
    ]
    print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return text


if __name__ == "__main__":
    main()
