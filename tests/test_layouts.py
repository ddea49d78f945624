"""Layouts applied to the paged cache: after a dead-slot or compact eviction, decode
logits equal attention computed directly over the kept positions only."""

from __future__ import annotations

import numpy as np
import pytest

import jaxkv
from jaxkv.cache.allocator import SENTINEL_SLOT
from jaxkv.policies import layouts
from oracles import logits_over_kept


def _rel(got, ref):
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request, hf_checkpoint):
    return jaxkv.load_model(hf_checkpoint(request.param)[0])


def _evict_and_decode(model, layout, keep, prompt, new_tokens):
    engine = jaxkv.Engine(model, rows=1, max_positions=128, num_slots=200)
    row = engine.open_row()
    engine.prefill([row], [prompt])
    before = list(engine.row_state[row].slots)
    if layout == "dead_slot":
        plan = layouts.dead_slot(before, keep)
    else:
        plan = layouts.compact(before, keep, engine.kv.allocate(len(keep)))
    engine.kv.apply_layout(row, plan)
    engine.refcounts_after_layout = engine.allocator.refcounts()
    _, logits = engine.decode([row], [new_tokens[0]], len(new_tokens), return_logits=True, forced_tokens=[new_tokens[1:]])
    return engine, row, before, plan, logits[0]


@pytest.mark.parametrize("layout", ["dead_slot", "compact"])
def test_decode_after_eviction_equals_attention_over_kept(model, layout):
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 1024, 60).tolist()
    new = rng.integers(0, 1024, 6).tolist()
    keep = np.sort(np.concatenate([np.arange(4), rng.choice(np.arange(4, 50), 20, replace=False), np.arange(50, 60)]))
    engine, row, before, plan, got = _evict_and_decode(model, layout, keep, prompt, new)
    ref = logits_over_kept(model, prompt, keep, new, renumber=layout == "compact")
    assert _rel(got, ref) <= 1e-5
    state = engine.row_state[row]
    assert len(state.live) == keep.size + len(new)
    assert SENTINEL_SLOT not in state.live
    if layout == "dead_slot":  # survivors keep slot and position; the rest are holes
        assert [state.slots[p] for p in keep] == [before[p] for p in keep]
        dropped = sorted(set(range(60)) - set(keep.tolist()))
        assert all(state.slots[p] == SENTINEL_SLOT for p in dropped)
        assert all(engine.refcounts_after_layout[before[p]] == 0 for p in dropped)
    else:  # renumbered to 0..K-1, old slots all released
        assert state.seq_len == keep.size + len(new)
        assert all(engine.refcounts_after_layout[s] == 0 for s in before)


def test_dead_slot_never_frees_what_others_hold(hf_checkpoint):
    model = jaxkv.load_model(hf_checkpoint("qwen3")[0])
    engine = jaxkv.Engine(model, rows=2, max_positions=64, num_slots=100)
    a = engine.open_row()
    engine.prefill([a], [list(range(1, 31))])
    shared = list(engine.row_state[a].slots)
    b = engine.open_row(shared)  # b reuses a's 30 slots (refcount 2)
    plan = layouts.dead_slot(shared, np.arange(10))
    engine.kv.apply_layout(b, plan)
    assert all(engine.allocator.refcount(s) == 1 for s in shared[10:])  # a still holds them
    assert engine.row_state[a].live == shared
    freed = engine.close_row(a)
    assert sorted(freed.tolist()) == sorted(shared[10:])


def test_layout_rejects_holes_as_kept():
    with pytest.raises(ValueError, match="live"):
        layouts.dead_slot([5, 0, 7], [1])
    with pytest.raises(ValueError, match="fresh"):
        layouts.compact([5, 6, 7], [0, 2], [9])
