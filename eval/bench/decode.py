"""Decode throughput: jaxkv vs transformers on the same weights (a random ~125M Qwen3, or ``--model``), CPU.

Both run the same weights (built in torch, saved, loaded by jaxkv) in float32,
batch 1 and 8, context 512 and 4096, in one process, so the numbers are
comparable. The KV cache of the context is filled with random values in both
(decode cost does not depend on KV contents, and a full 4k x 8 prefill would take
minutes on a laptop CPU); then N greedy decode steps are timed after a warm-up.

transformers baselines, both timed in the same run: a manual
``model(next_token, past_key_values=cache)`` loop under ``torch.no_grad()``, and
``generate`` (greedy, ``min_new_tokens = max_new_tokens = steps``) continuing the
same random cache; the faster of the two is the reference of the ratio.

jaxkv is timed twice: as it runs (on the CPU each decode call gathers every row's
live K/V once, ``jaxkv.backends.cpu_float.take_window``) and gathering them from the pool
in every step, the path kernel backends take.

Bandwidth floor: a decode step must read every weight once plus the KV of the
batch's context, so ``floor tok/s = batch / ((weight bytes + KV bytes) / read
bandwidth)``, the read bandwidth measured here by a multi-threaded reduction over
a 1 GiB array. Reports each engine's fraction of that floor.

``--model NAME_OR_PATH`` runs both on a real checkpoint instead (for example
``smollm2-135m-instruct``; transformers reads the same float32 weights).

Usage: python -m eval.bench.decode [--model M] [--steps 16] [--contexts 512,4096] [--batches 1,8] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv.engine import Engine  # noqa: E402
from jaxkv.markdown import md_header, md_row  # noqa: E402

QWEN3_125M = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=64,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
    max_position_embeddings=8192,
)


def read_bandwidth_gbs(nbytes=1 << 30, repeats=5) -> float:
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: jnp.sum(a))
    f(x).block_until_ready()
    best = min(_timed(lambda: f(x).block_until_ready()) for _ in range(repeats))
    return nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def build_models(folder, model: str | None = None, *, config=QWEN3_125M, dtype="float32"):
    """``(transformers model, jaxkv model, parameter count, label)`` on the same weights:
    a random Qwen3 of ``config`` (``model=None``: built in torch, float32, saved to
    ``folder``, loaded by jaxkv in ``dtype``), or any name or path ``jaxkv.load_model``
    takes (transformers then loads the folder jaxkv read, or jaxkv's export of it to
    ``folder``: a GGUF or a reference model's converted copy)."""
    import torch
    import transformers

    if model is None:
        torch.manual_seed(0)
        cfg = transformers.Qwen3Config(**config)
        tm = transformers.Qwen3ForCausalLM(cfg).eval()
        tm.save_pretrained(folder)
        n_params = sum(p.numel() for p in tm.parameters())
        return tm, jaxkv.load_model(folder, dtype=dtype), n_params, f"Random Qwen3 {n_params / 1e6:.0f}M"
    ours = jaxkv.load_model(model, dtype=dtype)
    source = ours.path if ours.path is not None and (ours.path / "config.json").is_file() else jaxkv.save_pretrained(ours, folder)
    tm = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in tm.parameters())
    return tm, ours, n_params, f"{model} ({ours.config.model_type}, {n_params / 1e6:.0f}M)"


def decode_bytes_per_step(cfg, n_params: int, batch: int, ctx: int, itemsize: int) -> int:
    """What one decode step must read: every weight once plus the batch's K and V."""
    kv = batch * ctx * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
    return n_params * itemsize + kv


def fill_pool_randomly(engine, rng) -> None:
    """Random K/V in the whole pool, in its dtype, drawn on its device (decode cost
    does not depend on the values)."""
    key = jax.random.key(int(rng.integers(1 << 31)))
    k, v = engine.cache.k, engine.cache.v
    engine.kv.commit(
        engine.cache.replace(
            k=jax.random.normal(jax.random.fold_in(key, 0), k.shape, k.dtype) * 0.5,
            v=jax.random.normal(jax.random.fold_in(key, 1), v.shape, v.dtype) * 0.5,
        )
    )


def bench_jaxkv(model, batch, ctx, steps, window=True) -> float:
    """jaxkv decode tok/s; ``window=False`` gathers the context from the pool in
    every step instead of once per call (``jaxkv.backends.cpu_float.take_window``)."""
    cfg = model.config
    engine = Engine(model, rows=batch, max_positions=ctx + steps + 1)
    engine.runner.use_window = window
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(batch):
        slots = engine.allocator.allocate(ctx)
        rows.append(engine.open_row(slots))
        engine.allocator.release(slots)  # the row holds the only reference now
    fill_pool_randomly(engine, rng)
    first = rng.integers(0, cfg.vocab_size, batch).tolist()
    snapshot = [list(engine.row_state[r].slots) for r in rows]
    engine.decode(rows, first, steps)  # compile + warm-up
    for r, s in zip(rows, snapshot):  # rewind the rows to the context only
        engine.truncate_row(r, len(s))
    jax.block_until_ready(engine.cache.k)
    t = _timed(lambda: engine.decode(rows, first, steps))
    return batch * steps / t


def torch_place(tm):
    """``(device, dtype)`` of a transformers model's weights: where its inputs and cache go."""
    p = next(tm.parameters())
    return p.device, p.dtype


def torch_sync(tm) -> None:
    """Wait for the model's device (CUDA work is asynchronous; the CPU needs nothing)."""
    import torch

    device, _ = torch_place(tm)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def torch_generator(tm, seed: int):
    import torch

    return torch.Generator(device=torch_place(tm)[0]).manual_seed(seed)


def random_cache(tm, batch, ctx, g):
    """A transformers ``DynamicCache`` holding ``ctx`` random positions per layer, drawn
    with ``g`` on the model's device, in its dtype."""
    import torch
    from transformers import DynamicCache

    cfg = tm.config
    device, dtype = torch_place(tm)
    cache = DynamicCache(config=cfg)
    shape = (batch, cfg.num_key_value_heads, ctx, cfg.head_dim)
    for layer in range(cfg.num_hidden_layers):
        kv = [torch.randn(shape, generator=g, device=device, dtype=dtype) * 0.5 for _ in range(2)]
        cache.update(kv[0], kv[1], layer)
    return cache


def bench_torch(tm, batch, ctx, steps) -> float:
    """The manual ``model(token, past_key_values=cache)`` loop."""
    import torch

    cfg = tm.config
    g = torch_generator(tm, 0)

    def run(cache):
        tok = torch.randint(0, cfg.vocab_size, (batch, 1), generator=g, device=g.device)
        with torch.no_grad():
            for _ in range(steps):
                out = tm(tok, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
        torch_sync(tm)

    run(random_cache(tm, batch, ctx, g))  # warm-up
    cache = random_cache(tm, batch, ctx, g)
    torch_sync(tm)
    t = _timed(lambda: run(cache))
    return batch * steps / t


def bench_torch_generate(tm, batch, ctx, steps) -> float:
    """``generate`` continuing a random cache of ``ctx`` tokens by ``steps`` tokens."""
    import torch

    g = torch_generator(tm, 1)

    def run():
        cache = random_cache(tm, batch, ctx, g)
        ids = torch.randint(0, tm.config.vocab_size, (batch, ctx + 1), generator=g, device=g.device)
        torch_sync(tm)
        t0 = time.perf_counter()
        with torch.no_grad():
            tm.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                past_key_values=cache,
                max_new_tokens=steps,
                min_new_tokens=steps,
                do_sample=False,
                pad_token_id=0,
            )
        torch_sync(tm)
        return time.perf_counter() - t0

    run()  # warm-up
    return batch * steps / run()


def decode_table(tm, model, n_params, steps, contexts, batches, label: str = "random Qwen3") -> list[str]:
    """The decode rows (printed as they come): jaxkv vs the faster transformers loop."""
    import torch

    bw = read_bandwidth_gbs()
    cfg = model.config
    lines = [
        f"Decode throughput, {label} float32, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}; "
        f"measured read bandwidth {bw:.1f} GB/s; {steps} timed greedy steps after warm-up.",
        "",
        *md_header(
            [
                "batch",
                "context",
                "jaxkv tok/s",
                "jaxkv, per-step gather tok/s",
                "transformers loop tok/s",
                "transformers generate tok/s",
                "ratio (vs faster)",
                "floor tok/s",
                "jaxkv % floor",
                "transformers % floor",
            ],
            "r" * 10,
        ),
    ]
    print("\n".join(lines), flush=True)
    for batch in batches:
        for ctx in contexts:
            floor = batch / (decode_bytes_per_step(cfg, n_params, batch, ctx, 4) / (bw * 1e9))
            ours = bench_jaxkv(model, batch, ctx, steps)
            ours_gather = bench_jaxkv(model, batch, ctx, steps, window=False)
            loop = bench_torch(tm, batch, ctx, steps)
            gen = bench_torch_generate(tm, batch, ctx, steps)
            ref = max(loop, gen)
            row = md_row(
                [
                    batch,
                    ctx,
                    f"{ours:.1f}",
                    f"{ours_gather:.1f}",
                    f"{loop:.1f}",
                    f"{gen:.1f}",
                    f"{ours / ref:.2f}x",
                    f"{floor:.1f}",
                    f"{100 * ours / floor:.0f}%",
                    f"{100 * ref / floor:.0f}%",
                ]
            )
            lines.append(row)
            print(row, flush=True)
    return lines


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--model", default=None, help="any name or path jaxkv.load_model takes (default: a random ~125M Qwen3)")
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as folder:
        tm, model, n_params, label = build_models(folder, args.model)
        lines = decode_table(
            tm, model, n_params, args.steps, [int(c) for c in args.contexts.split(",")], [int(b) for b in args.batches.split(",")], label
        )
    table = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    return table


if __name__ == "__main__":
    main()
