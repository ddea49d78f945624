"""bf16 end to end on the serving path: weights, KV pool and decode kernels in bf16
(softmax and accumulation in float32), and logits through the paged cache (chunked
prefill, then decode) within the project's bf16 parity bound of the float32
transformers model, as the dense forward is (``test_parity.py``). The float32
softmax is checked on the lowered steps in ``test_engine_export.py``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxkv
from jaxkv.cache.allocator import SENTINEL_SLOT
from jaxkv.policies import get_policy
from jaxkv.serving.stages.events import compress_row

BF16_BOUND = 2e-2  # test_parity.py: bf16 logits vs float32 transformers, relative to the largest logit


def _parity_input():
    """The input test_parity.py's bf16 bound is set on (64 tokens)."""
    return np.random.default_rng(2).integers(0, 1024, (1, 64))[0].tolist()


def _rel(got, ref):
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


def _hf_logits(torch_model, seq):
    with torch.no_grad():
        return torch_model(torch.tensor([seq])).logits.double().numpy()[0]


def _paged_logits(model, seq, n_prefill, *, backend=None):
    """Logits of every token of ``seq`` through the engine: chunked prefill of the
    first ``n_prefill`` tokens, then teacher-forced decode of the rest. Chunks of 16
    tokens: a 40-token prefill's three pieces are one step program (16-token bucket)."""
    engine = jaxkv.Engine(model, rows=1, max_positions=128, prefill_chunk=16, backend=backend)
    row = engine.open_row()
    (pre,) = engine.prefill([row], [seq[:n_prefill]], all_logits=True)
    n = len(seq) - n_prefill
    _, (dec,) = engine.decode([row], [seq[n_prefill]], n, return_logits=True, forced_tokens=[seq[n_prefill + 1 :]])
    return np.concatenate([pre, dec]), engine


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_bf16_paged_logits_within_the_bf16_bound(hf_checkpoint, family):
    folder, torch_model = hf_checkpoint(family)
    model = jaxkv.load_model(folder, dtype="bfloat16")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(model.split()[1]))
    seq = _parity_input()
    got, engine = _paged_logits(model, seq, 40)  # 3 chunks of prefill, 24 decode steps
    # on XLA:CPU a bf16 model's pool is float32 holding bf16 values (cache.state.float_pool_dtype)
    assert engine.cache.k.dtype == engine.cache.v.dtype == (jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    assert got.dtype == np.float32 and got.shape == (64, 1024)
    k = np.asarray(engine.cache.k, np.float32)  # and it holds bf16 values: what a bf16 pool would
    assert np.any(k != 0) and np.array_equal(k, np.asarray(engine.cache.k.astype(jnp.bfloat16), np.float32))
    err = _rel(got, _hf_logits(torch_model, seq))
    print(f"\n{family}: bf16 paged logits vs float32 transformers: {err:.4f}")
    assert err <= BF16_BOUND


@pytest.mark.slow
def test_bf16_decode_through_the_pallas_kernel_within_the_bf16_bound(hf_checkpoint):
    """The Pallas decode kernel (TPU interpreter) on a bf16 pool, GQA 4: bf16 dots with
    float32 accumulation and softmax, within the bound, and close to the reference."""
    folder, torch_model = hf_checkpoint("llama")
    model = jaxkv.load_model(folder, dtype="bfloat16")
    seq = _parity_input()[:44]  # 4 decode steps through the kernel
    kernel, _ = _paged_logits(model, seq, 40, backend="interpret")
    reference, _ = _paged_logits(model, seq, 40, backend="reference")
    ref = _hf_logits(torch_model, seq)
    print(
        f"\nbf16 Pallas decode vs float32 transformers: {_rel(kernel[40:], ref[40:]):.4f}; "
        f"vs the bf16 reference path: {_rel(kernel[40:], reference[40:]):.4f}"
    )
    assert _rel(kernel[40:], ref[40:]) <= BF16_BOUND
    assert _rel(kernel[40:], reference[40:]) <= BF16_BOUND


def test_bf16_evicted_rows_come_back_bit_identical(hf_checkpoint):
    """RepairKV on a bf16 pool: rows shelved at eviction and restored are the same
    bits (the host tier keeps the pool's dtype: bf16, or on the CPU float32 holding bf16
    values, ``float_pool_dtype``)."""
    folder, _ = hf_checkpoint("qwen3")
    model = jaxkv.load_model(folder, dtype="bfloat16")
    engine = jaxkv.Engine(model, rows=1, max_positions=128)
    row = engine.open_row()
    engine.prefill([row], [np.random.default_rng(9).integers(0, 1024, 40).tolist()])
    before = list(engine.row_state[row].slots)
    k0, v0 = engine.kv.gather_rows(before)
    assert k0.dtype == engine.cache.k.dtype
    shelved = {}

    def on_evict(plan, k, v, scores):
        shelved.update(positions=plan.evicted_positions, k=k, v=v)

    policy = get_policy("random")
    forced = np.zeros(40, bool)
    forced[:4] = forced[-4:] = True
    feats = _features(engine, row, 40)
    compress_row(
        engine, row, policy, policy.make_config(seed=1), policy.init_state(None, None), feats, forced, 16, "dead_slot", on_evict=on_evict
    )
    pos = shelved["positions"][:6]
    assert shelved["k"].dtype == engine.cache.k.dtype and all(engine.row_state[row].slots[p] == SENTINEL_SLOT for p in pos)
    fresh = engine.kv.restore_rows(row, pos, shelved["k"][:, :6], shelved["v"][:, :6])
    k1, v1 = engine.kv.gather_rows(fresh)
    assert k1.dtype == engine.cache.k.dtype
    bits = np.uint16 if k1.dtype.itemsize == 2 else np.uint32
    assert np.array_equal(k1.view(bits), k0[:, pos].view(bits))
    assert np.array_equal(v1.view(bits), v0[:, pos].view(bits))


def _features(engine, row, n):
    from test_repair import _event_features

    return _event_features(engine, row, n)
