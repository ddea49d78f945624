"""Rotated quantized pools (``Engine(kv_rotate=True)``, ``jaxkv.cache.rotation``; issue #74).

* The rotation is orthogonal, its numpy and jit'd forms agree, and rotating then
  unrotating is the identity to 1e-5; queries are rotated by their KV head's matrix.
* A rotated pool's float window (KIVI's residual, every token of a short prompt)
  gives the float pool's logits and query rows to 1e-5: the frame cancels exactly
  in attention; its readers (``gather_keys``, ``gather_float``, shelved rows'
  ``host_keys``) hand out the model's frame.
* On K/V with outlier channels, a rotated INT4 pool's logits are closer to the
  float pool's than the unrotated INT4 pool's (the reason to rotate).
* The blocked CPU backend and the fused kernels (interpret mode) agree on a
  rotated pool, INT2 and INT3 pages, INT4 tokens and KIVI's float residual alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.backends import CpuQuantBackend, QuantKernelBackend
from jaxkv.cache.rotation import Rotation, rotations
from jaxkv.engine import Engine, KVSource
from jaxkv.errors import ConfigError
from jaxkv.policies import layouts


def test_rotation_is_orthogonal_and_unrotating_is_the_identity():
    R = rotations(3, 2, 32)  # [L, K, D, D]
    np.testing.assert_allclose(np.einsum("lkde,lkfe->lkdf", R, R), np.broadcast_to(np.eye(32), R.shape), atol=1e-6)
    assert not np.allclose(R[0, 0], R[0, 1]) and not np.allclose(R[0, 0], R[1, 0])  # one matrix per (layer, KV head)
    rot = Rotation(32)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 2, 32)), jnp.float32)
    y = jax.jit(rot.rotate)(1, x)  # the layer traced, as in the layer scan
    np.testing.assert_allclose(np.asarray(y), np.einsum("tkd,kde->tke", np.asarray(x), R[1]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(rot.unrotate(1, y)), np.asarray(x), atol=1e-5)
    q = jnp.asarray(np.random.default_rng(1).standard_normal((5, 6, 32)), jnp.float32)  # 3 query heads per KV head
    q_rot = np.asarray(rot.rotate_heads(2, q, 2))
    np.testing.assert_allclose(q_rot, np.einsum("thd,hde->the", np.asarray(q), np.repeat(R[2], 3, axis=0)), atol=1e-5)
    np.testing.assert_allclose(np.asarray(rot.unrotate_heads(2, jnp.asarray(q_rot), 2)), np.asarray(q), atol=1e-5)
    from jaxkv.cache.pools import make_pool

    with pytest.raises(ConfigError, match="quantized pool"):
        make_pool(None, 16, head_dim=32, float_dtype=np.float32, rotate=True)


def test_a_rotated_float_window_gives_the_float_pools_logits_and_readers_the_models_frame(qmodel):
    rng = np.random.default_rng(2)
    prompt = rng.integers(5, 500, 90).tolist()  # under KIVI's 128-token window: every token stays float
    runs = {}
    pools = {"float": {}, "kivi2+rot": dict(kv_quant="kivi2", kv_rotate=True), "int4+rot": dict(kv_quant="int4", kv_rotate=True)}
    for name, kw in pools.items():
        e = Engine(qmodel, rows=1, max_positions=256, **kw)
        row = e.open_row()
        e.prefill([row], [prompt])
        slots = list(e.row_state[row].slots)
        tokens, logits, aux = e.decode([row], [7], 4, return_logits=True, query_rows=True, forced_tokens=[[11, 12, 13]])
        kv = e.pool.gather_float(e.cache, slots)
        runs[name] = (np.stack(logits[0]), np.stack(aux["q_rows"][0]), kv, np.asarray(e.kv.gather_keys(row)))
        if name == "int4+rot":
            shelved = e.pool.host_keys(e.pool.gather_rows(e.cache, slots)[0])
    (lf, qf, (kf, vf), gf), (lk, qk, (kk, vk), gk) = runs["float"], runs["kivi2+rot"]
    assert np.abs(lk - lf).max() <= 1e-5 * np.abs(lf).max()
    assert np.abs(qk - qf).max() <= 1e-5 * np.abs(qf).max()  # query rows come back in the model's frame
    for got, want in ((kk, kf), (vk, vf), (gk, gf)):
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # INT4 rows: within quantization error of the float pool's (a frame mix-up would be ~100%)
    _, _, (k4, v4), g4 = runs["int4+rot"]
    for got, want in ((k4, kf), (v4, vf), (g4, gf), (shelved, kf)):
        assert np.linalg.norm(got - want) <= 0.15 * np.linalg.norm(want)
    np.testing.assert_allclose(shelved, k4, atol=1e-6)


def _outlier_kv(qmodel, n: int):
    """K/V ``[L, n, K, D]``: Gaussian, two key channels 8x and two value channels 30x
    the rest (larger key outliers make the softmax one-hot, where any error flips
    the attended token and no pool is near the float one)."""
    cfg = qmodel.config
    rng = np.random.default_rng(6)
    shape = (cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim)
    k, v = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    k[..., [3, 17]] *= 8.0
    v[..., [5, 20]] *= 30.0
    return k, v


def _attention(q_XKD, k_LNKD, v_LNKD):
    """Dense attention of queries ``[X, K, D]`` over every row, per layer: ``[L, X, K, D]``."""
    s = np.einsum("xkd,lnkd->lkxn", q_XKD, k_LNKD) / np.sqrt(q_XKD.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("lkxn,lnkd->lxkd", p / p.sum(-1, keepdims=True), v_LNKD)


def test_rotation_brings_an_outlier_pool_closer_to_the_float_pool(qmodel):
    """The same outlier K/V imported into INT4 pools with and without rotation: the
    attention over what each pool stores (read back in the model's frame), and the
    engine's logits after it, are closer to the float pool's with rotation."""
    n = 96
    k, v = _outlier_kv(qmodel, n)
    q = np.random.default_rng(8).standard_normal((16, *k.shape[2:])).astype(np.float32)
    prompt = np.random.default_rng(7).integers(5, 500, n).tolist()
    logits, attn = {}, {}
    for name, kw in {"float": {}, "int4": dict(kv_quant="int4"), "int4+rot": dict(kv_quant="int4", kv_rotate=True)}.items():
        e = Engine(qmodel, rows=1, max_positions=256, prefill_chunk=128, **kw)
        row = e.open_row()
        job = e.start_prefill(row, prompt, kv_source=KVSource(k, v, np.zeros(qmodel.config.vocab_size, np.float32)))
        while not job.finished:
            e.step(prefill_jobs=[job])
        attn[name] = _attention(q, *e.pool.gather_float(e.cache, e.row_state[row].slots))
        # (query rows unused: asked for, the decode is the float-window test's program for two of the pools)
        out = e.decode([row], [7], 4, return_logits=True, query_rows=True, forced_tokens=[[11, 12, 13]])[1]
        logits[name] = np.stack(out[0])
    err = {name: np.linalg.norm(attn[name] - attn["float"]) / np.linalg.norm(attn["float"]) for name in ("int4", "int4+rot")}
    assert err["int4+rot"] < 0.6 * err["int4"], err
    logit_err = {name: np.linalg.norm(logits[name] - logits["float"]) for name in ("int4", "int4+rot")}
    assert logit_err["int4+rot"] < logit_err["int4"], logit_err


@pytest.mark.parametrize("mode", ["triaxial", "kivi2"])
def test_blocked_backend_and_fused_kernels_agree_on_a_rotated_pool(qmodel, mode):
    rng = np.random.default_rng(4)
    prompts = [rng.integers(5, 500, n).tolist() for n in (180, 70)]
    bits = [rng.choice([2, 3, 4], len(p), p=[0.4, 0.35, 0.25]) for p in prompts] if mode == "triaxial" else None
    runs = {}
    for backend in (None, "interpret"):
        e = Engine(qmodel, rows=2, max_positions=256, kv_quant=mode, backend=backend, kv_rotate=True)
        rows = [e.open_row(), e.open_row()]
        e.prefill(rows, prompts, kv_bits=bits)
        keep = np.setdiff1d(np.arange(180), [3, 40, 41, 100])  # pages partly held: their bitmasks read
        e.kv.apply_layout(rows[0], layouts.dead_slot(e.row_state[rows[0]].slots, keep))
        runs[backend] = e.decode(rows, [7, 9], 2, return_logits=True, forced_tokens=[[11], [14]])  # the second step reads the first's token
        if mode == "triaxial":  # INT2 pages, INT3 pages and INT4 rows, some pages partly held
            assert all(e.kv.composition(rows[0])[b] > 0 for b in (2, 3, 4))
        assert type(e.backend) is (QuantKernelBackend if backend else CpuQuantBackend) and e.pool.rotation is not None
    (tok_cpu, log_cpu), (tok_k, log_k) = runs[None], runs["interpret"]
    assert tok_cpu == tok_k
    for a, b in zip(log_k, log_cpu):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()
