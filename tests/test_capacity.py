"""KV pools sized by memory (``kv_memory_bytes``), the admission credit for a
session's own cached history, and the fixed-memory capacity bench's sizing and
report (``eval/bench/capacity.py``; no timing here)."""

import jax
import numpy as np
import pytest

from jaxkv.cache.pools import FloatKV, kv_bytes, pool_for_bytes
from jaxkv.engine import Engine
from jaxkv.errors import ConfigError
from jaxkv.kernels.quant import PAGE
from jaxkv.serving import Server
from tests.conftest import tiny_chat_model


@pytest.fixture(scope="module")
def quant_model():
    return tiny_chat_model(head_dim=32)


def unit_bytes(model):
    """KV bytes per token of the float pool (float32 on the CPU), INT4 and INT2,
    from the formats: L layers x K heads x (K + V)."""
    c = model.config
    per = c.num_layers * c.num_kv_heads
    return {
        "float": per * 2 * c.head_dim * 4,
        "int4": per * 2 * (c.head_dim // 2 + 2 * 2 * c.head_dim // 32),
        "int2": per * 0.75 * c.head_dim,
    }


@pytest.mark.parametrize("kv_quant,share", [(None, None), ("int4", None), ("triaxial", None), ("triaxial", 0.6), ("kivi2", 0.8)])
@pytest.mark.parametrize("budget", [40_000, 123_457])
def test_each_pool_kind_stays_within_its_byte_budget(quant_model, kv_quant, share, budget):
    engine = Engine(quant_model, rows=2, max_positions=256, kv_quant=kv_quant, kv_memory_bytes=budget, kv_page_share=share)
    used = kv_bytes(engine.cache)
    assert used == sum(x.nbytes for x in jax.tree.leaves(engine.cache.kv))
    u = unit_bytes(quant_model)
    assert budget - (u["float"] + PAGE * u["int2"]) < used <= budget  # within one page and one token of the budget
    if kv_quant == "triaxial" and share:  # the share of the pool's tokens in pages, to a page
        geo = engine.pool.geometry
        pages = PAGE * (geo.pages - 1)
        assert abs(pages / (pages + geo.int4_slots) - share) < PAGE / (pages + geo.int4_slots)
    engine.close()


def test_pool_tokens_scale_with_bytes_per_token(quant_model):
    cfg, budget = quant_model.config, 10 << 20
    u = unit_bytes(quant_model)
    flt = pool_for_bytes(None, budget, cfg, float_dtype=np.float32)
    int4 = pool_for_bytes("int4", budget, cfg, float_dtype=np.float32)
    tri = pool_for_bytes("triaxial", budget, cfg, float_dtype=np.float32)
    assert flt.allocator.capacity == budget // u["float"] - 1
    assert int4.allocator.capacity == (budget - PAGE * u["int2"]) // u["int4"]
    assert int4.allocator.capacity / flt.allocator.capacity == pytest.approx(u["float"] / u["int4"], rel=1e-3)  # 6.4x
    assert tri.geometry == int4.geometry  # share 0 by default: every token in the INT4 region


def test_bad_sizes_are_config_errors(quant_model):
    cfg = quant_model.config
    with pytest.raises(ConfigError, match="kv_page_share"):
        pool_for_bytes("kivi2", 1 << 20, cfg, float_dtype=np.float32)
    with pytest.raises(ConfigError, match="holds no token"):
        pool_for_bytes(None, 100, cfg, float_dtype=np.float32)
    with pytest.raises(ConfigError, match=r"\[0, 1\)"):
        pool_for_bytes("triaxial", 1 << 20, cfg, float_dtype=np.float32, page_share=1.0)
    with pytest.raises(ConfigError, match="not both"):
        Engine(quant_model, rows=1, max_positions=64, num_slots=65, kv_memory_bytes=1 << 20)
    assert isinstance(pool_for_bytes("none", 1 << 20, cfg, float_dtype=np.float32), FloatKV)


def test_a_full_pool_serves_a_sessions_next_turn_without_evicting_anyone(quant_model):
    """Admission reserves a turn's new tokens, not the history it reuses: a pool
    holding two sessions' conversations and room for their next turns' new
    tokens serves those turns without evicting a cached slot (reserving each
    turn's whole prompt would have evicted the other session's history)."""
    from jaxkv.chat import render

    tok = quant_model.tokenizer
    words = "the weather in paris is sunny and the weather in london is rainy".split()
    first = [[{"role": "user", "content": " ".join(words[i:] + words[:i]) * 3}] for i in (0, 3)]
    second = [h + [{"role": "assistant", "content": "sunny"}, {"role": "user", "content": "and rome"}] for h in first]
    n = lambda h: int(render(tok, h, None, add_generation_prompt=True).ids.size)  # noqa: E731
    new = 4
    held = sum(n(h) + new for h in first)  # each first turn's prompt and reply stay cached
    room = sum(n(b) - n(a) + new for a, b in zip(first, second))  # the later turns' new tokens
    server = Server(quant_model, rows=1, max_positions=256, num_slots=1 + held + room)
    sessions = [server.session(session_id=f"s{i}") for i in range(2)]
    for s, h in zip(sessions, first):
        s.start_chat(h, max_new_tokens=new, ignore_eos=True).result()
    for s, a, b in zip(sessions, first, second):
        turn = s.start_chat(b, max_new_tokens=new, ignore_eos=True).result()
        assert turn.cached_tokens >= n(a) - 1  # its own history came from the cache
    assert server.counters["radix_evicted_slots"] == 0
    server.close()


def test_capacity_bench_holds_sessions_in_proportion_to_bytes_and_renders():
    import jaxkv
    from eval.bench import capacity as bench

    model = jaxkv.load_model("embedded")
    plans = bench.plans(model, 24, 256, 2, 8)
    assert all(len(p.histories) == 2 and p.footprint == p.prompt_tokens[-1] + 16 for p in plans)
    foot = [p.footprint for p in plans]
    kinds = bench.kinds_for(model, ["none", "int4", "triaxial"])
    assert kinds[2].page_share == pytest.approx((4.0 - 4.0) / 2)  # the embedded calibration: B = 4.0
    budget = bench.float_budget(model, foot[:2])
    tokens = {k.label: bench.pool_tokens(bench.size_pool(model, k, budget)) for k in kinds}
    held = {k: bench.sessions_held(t, foot) for k, t in tokens.items()}
    assert held["float"] == 2 and tokens["float"] == sum(foot[:2])
    u = unit_bytes(model)
    assert tokens["int4"] / tokens["float"] == pytest.approx(u["float"] / u["int4"], rel=0.02)  # 6.4x the tokens
    assert sum(foot[: held["int4"]]) <= tokens["int4"] < sum(foot[: held["int4"] + 1])  # added until full
    assert held["int4"] >= 5 * held["float"]
    rows = [
        {
            "kind": k,
            "budget": budget,
            "pool_bytes": budget - 1,
            "pool_tokens": tokens[k],
            "sessions": held[k],
            "turns": 2 * held[k],
            "prefilled": 100 * held[k],
            "generated": 16 * held[k],
            "wall_s": 2.0,
            "compile_s": 1.0,
            "programs": 3,
            "gen_tok_s": 8.0 * held[k],
            "served_tok_s": 58.0 * held[k],
            "radix_evicted": 0,
            "reprefilled_turns": 0,
            "errors": [],
        }
        for k in held
    ]
    meta = {
        "model": "embedded",
        "command": "python -m eval.bench.capacity --model embedded",
        "machine": bench.machine(),
        "jax": jax.__version__,
        "backend": "cpu",
        "threads": bench.threads(),
        "load_before": bench.load(),
        "load_after": bench.load(),
        "budget": budget,
        "budget_note": "test",
        "workload": "test",
    }
    text = bench.render_report(meta, rows)
    assert "| float |" in text and "| int4 |" in text and "python -m eval.bench.capacity --model embedded" in text
    assert f"{held['int4'] / held['float']:.2f}x" in text and "Goal (issue #60)" in text
