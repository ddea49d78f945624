"""RoPE delta rotation: composition, agreement with recomputed RoPE, untouched rows,
kernel (interpret) vs reference, accuracy at long positions vs float64."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.config import RopeConfig
from jaxkv.rope import apply_rope, inv_frequencies
from jaxkv.kernels import rope_delta
from jaxkv.kernels.testing import LLAMA3_ROPE as LLAMA3, rel_err


def _setup(seed, shape, max_pos, max_delta, moved):
    """Pre-RoPE keys, their positions, the post-RoPE pool and random moves."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    S = shape[-3]
    p0 = jnp.asarray(rng.integers(max_delta, max_pos, S))  # stays >= 0 after any move
    slots = jnp.asarray(rng.permutation(S)[:moved], jnp.int32)
    d1, d2 = (jnp.asarray(rng.integers(-max_delta // 2, max_delta // 2 + 1, moved), jnp.int32) for _ in range(2))
    return x, p0, slots, d1, d2


def _rope_at(x, positions_S, rope):
    return apply_rope(x, jnp.broadcast_to(positions_S, x.shape[:-2]), rope)


@pytest.mark.parametrize("rope,shape", [(RopeConfig(), (3, 300, 2, 128)), (LLAMA3, (300, 4, 64))])
@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_delta_composes_and_matches_recomputed_rope(rope, shape, backend):
    x, p0, slots, d1, d2 = _setup(0, shape, max_pos=48, max_delta=32, moved=200)
    pool = np.asarray(_rope_at(x, p0, rope))
    twice = rope_delta(rope_delta(jnp.array(pool), slots, d1, rope, backend=backend), slots, d2, rope, backend=backend)
    once = rope_delta(jnp.array(pool), slots, d1 + d2, rope, backend=backend)
    recomputed = _rope_at(x, p0.at[slots].add(d1 + d2), rope)
    assert rel_err(twice, once) <= 1e-5
    assert rel_err(twice, recomputed) <= 1e-5
    untouched = np.setdiff1d(np.arange(shape[-3]), np.asarray(slots))
    twice = np.asarray(twice)
    assert np.array_equal(twice[..., untouched, :, :], pool[..., untouched, :, :])  # bit-identical
    assert not np.allclose(twice[..., np.asarray(slots), :, :], pool[..., np.asarray(slots), :, :])


def test_kernel_matches_reference_bf16_pool():
    x, _, slots, d1, _ = _setup(1, (2, 200, 2, 64), max_pos=300, max_delta=100, moved=130)
    pool = x.astype(jnp.bfloat16)
    a = rope_delta(jnp.array(pool), slots, d1, LLAMA3, backend="interpret")
    b = rope_delta(jnp.array(pool), slots, d1, LLAMA3, backend="reference")
    assert a.dtype == jnp.bfloat16
    assert rel_err(a, b) <= 2e-2


def test_long_deltas_within_float32_angle_bound():
    """At |delta| up to 32k the only error is float32 angle rounding: ~|delta| * 2^-24 rad."""
    x, _, slots, d1, _ = _setup(2, (100, 2, 128), max_pos=70000, max_delta=65536, moved=64)
    out = np.asarray(rope_delta(jnp.array(x), slots, d1, LLAMA3, backend="interpret"), np.float64)
    xs = np.asarray(x, np.float64)[np.asarray(slots)]
    ang = np.asarray(d1, np.float64)[:, None] * np.asarray(inv_frequencies(LLAMA3, 128), np.float64)
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = xs[..., :64], xs[..., 64:]
    want = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    err = np.abs(out[np.asarray(slots)] - want)
    pair = np.sqrt(x1**2 + x2**2)
    bound = (np.abs(ang)[:, None] * 2.0**-23 + 2.0**-21) * pair
    bound = np.concatenate([bound, bound], -1)
    assert (err <= bound).all()


def test_bad_inputs():
    pool = jnp.zeros((10, 2, 64), jnp.float32)
    s, d = jnp.arange(3, dtype=jnp.int32), jnp.ones(3, jnp.int32)
    with pytest.raises(ValueError, match=r"\[S, Hkv, D\] or \[L, S, Hkv, D\], got shape \(10, 64\)"):
        rope_delta(pool[:, 0], s, d, LLAMA3)
    with pytest.raises(ValueError, match=r"got \(3,\) and \(2,\)"):
        rope_delta(pool, s, d[:2], LLAMA3)
    with pytest.raises(TypeError, match="delta must be an integer array, got float32"):
        rope_delta(pool, s, d.astype(jnp.float32), LLAMA3)
    with pytest.raises(TypeError, match="k_pool must be floating"):
        rope_delta(pool.astype(jnp.int32), s, d, LLAMA3)
    with pytest.raises(ValueError, match="unknown backend 'cpu'"):
        rope_delta(pool, s, d, LLAMA3, backend="cpu")
