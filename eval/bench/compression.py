"""Cost of one compression event vs one decode step, per method (~125M Qwen3 shape).

    JAX_PLATFORMS=cpu python -m eval.bench.compression [--lives 4096,16384,32768] [--out FILE.md]

For each live-token count N the pool holds one request of N random post-RoPE
keys (the shape of the ~125M model of ``bench_decode``: 12 layers, 12 query / 4
KV heads, head_dim 64); an event is what a session runs: gather the live keys,
``policy.score`` (eager, as sessions call it), ``select`` at budget N/2, and the
dead-slot layout applied to the row. Its median time over repeats is printed next
to the median time of one greedy decode step of the same model at the same
context, measured in the same run, and their ratio. Policy state is warmed as in
a session (AgentKV rings filled, IntentKV memory initialised, H2O mass present).
The actionable query span is the last ``SPAN`` live positions (``query_span_N``);
the learned IntentKV policies run a freshly initialised head of this shape's head
dim with a non-zero output layer (``--head PATH`` to time another): its cost does
not depend on its weights.
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
from eval.bench.decode import QWEN3_125M, fill_pool_randomly  # noqa: E402
from jaxkv.config import ModelConfig  # noqa: E402
from jaxkv.engine import Engine  # noqa: E402
from jaxkv.markdown import md_header, md_row  # noqa: E402
from jaxkv.serving.stages.events import compress_row  # noqa: E402
from jaxkv.policies import REGISTRY, EventFeatures, Observation  # noqa: E402

CFG_125M = ModelConfig.from_hf({**QWEN3_125M, "model_type": "qwen3", "max_position_embeddings": 40960})  # the decode bench's shape
METHODS = ("streaming_llm", "snapkv", "h2o", "tova", "random", "oldest", "agentkv", "intentkv_memory", "intentkv_query", "intentkv")
LEARNED = ("intentkv", "intentkv_no_memory", "intentkv_no_xattn", "intentkv_no_residual")
SPAN = 1024  # live positions of the actionable query span (a long tool response)


def _median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _fill_row(engine, n, rng):
    """A row of n live slots; the benchmark keeps its own reference on them so an
    event's evictions never free them and the row can be restored."""
    slots = engine.allocator.allocate(n)
    return engine.open_row(slots)


def _features(engine, row, n, rng, cfg):
    L, Hq, D = cfg.num_layers, cfg.num_heads, cfg.head_dim
    live_pos = engine.kv.live_positions(row)
    return EventFeatures(
        keys_LNKD=engine.kv.gather_keys(row).astype(jnp.float32),
        positions_N=jnp.asarray(live_pos, jnp.int32),
        phase_N=jnp.asarray(rng.integers(0, 4, n), jnp.int32),
        window_q_LWHD=jnp.asarray(rng.standard_normal((L, 32, Hq, D), np.float32)),
        window_pos_W=jnp.arange(n - 32, n, dtype=jnp.int32),
        window_valid_W=jnp.ones(32, bool),
        acc_mass_N=jnp.asarray(rng.random(n, np.float32)),
        query_mean_LHD=jnp.asarray(rng.standard_normal((L, Hq, D), np.float32)),
        seq_len=jnp.int32(n),
        query_span_N=jnp.arange(n) >= n - SPAN,
    )


def bench_head(cfg, folder) -> str:
    """A head for ``cfg.head_dim`` with every parameter non-zero, saved in ``folder``."""
    from jaxkv.policies.intentkv_head import HeadConfig, init_head, save_head

    head = init_head(HeadConfig(head_dim=cfg.head_dim), seed=0)
    leaves, treedef = jax.tree_util.tree_flatten(head.params)
    leaves = [x + 0.01 for x in leaves]
    head = type(head)(head.cfg, head.graphdef, jax.tree_util.tree_unflatten(treedef, leaves))
    return str(save_head(head, folder))


def _warm_state(policy, cfg_p, cfg, rng):
    state = policy.init_state(cfg_p, cfg)
    if policy.observe is not None:
        L, Hq, D = cfg.num_layers, cfg.num_heads, cfg.head_dim
        obs = Observation(
            q_LXHD=jnp.asarray(rng.standard_normal((L, 64, Hq, D), np.float32)),
            phase_X=jnp.asarray(np.repeat(np.arange(4), 16), jnp.int32),
            valid_X=jnp.ones(64, bool),
            query_mean_LHD=jnp.asarray(rng.standard_normal((L, Hq, D), np.float32)),
            new_turn=jnp.asarray(True),
        )
        state = policy.observe(cfg_p, state, obs)
    return state


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lives", default="4096,16384,32768")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--head", default=None, help="IntentKV head folder for the learned methods (default: a random one)")
    args = ap.parse_args(argv)
    cfg = CFG_125M
    tmp = tempfile.TemporaryDirectory()
    head = args.head or bench_head(cfg, tmp.name)
    rng = np.random.default_rng(0)
    model = jaxkv.model_from_config(cfg, seed=0)
    lines = [
        f"One compression event vs one decode step, random Qwen3 ~125M shape, float32, "
        f"{platform.machine()} {os.cpu_count()} cores, jax {jax.__version__} ({jax.default_backend()}); "
        f"median of {args.repeats}; event = gather keys + score + select (B = N/2) + dead-slot layout.",
        "",
        *md_header(["live tokens", "method", "event ms", "decode step ms", "event / step"], "rlrrr"),
    ]
    print("\n".join(lines), flush=True)
    for n in map(int, args.lives.split(",")):
        engine = Engine(model, rows=1, max_positions=n + 64, num_slots=2 * n + 130)
        fill_pool_randomly(engine, rng)
        row = _fill_row(engine, n, rng)
        base = list(engine.row_state[row].slots)
        _one_step(engine, row, base)  # compile
        decode_ms = 1e3 * _median_time(lambda: _one_step(engine, row, base), args.repeats)
        for method in args.methods.split(","):
            policy = REGISTRY[method]
            cfg_p = policy.make_config(head=head) if method in LEARNED else policy.make_config()
            state = _warm_state(policy, cfg_p, cfg, rng)

            def event():
                feats = _features(engine, row, n, rng, cfg)
                forced = np.zeros(n, bool)
                forced[:64] = True
                compress_row(engine, row, policy, cfg_p, state, feats, forced, n // 2, "dead_slot")
                jax.block_until_ready(engine.cache.k)
                _restore(engine, row, base)

            event()  # warm-up / compile
            ms = 1e3 * _median_time(event, args.repeats)
            line = md_row([n, method, f"{ms:.1f}", f"{decode_ms:.1f}", f"{ms / decode_ms:.2f}x"])
            lines.append(line)
            print(line, flush=True)
        engine.close_row(row)
    table = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    return table


def _restore(engine, row, base):
    """Undo an event: the row maps its original slots again (refs re-taken)."""
    current = engine.row_state[row].owned()
    engine.allocator.release(current)
    engine.allocator.ref([s for s in base])
    engine.kv.set_row_tables(row, base, base)


def _one_step(engine, row, base):
    engine.decode([row], [1], 1)
    jax.block_until_ready(engine.cache.k)
    engine.truncate_row(row, len(base))


if __name__ == "__main__":
    main()
