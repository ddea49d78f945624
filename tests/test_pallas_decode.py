"""Decode attention Pallas kernel (the TPU kernel, run by the TPU interpreter) vs the
jnp reference and a float64 oracle; backend dispatch and its typed errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import jaxkv
from jaxkv.attention import decode_attention_reference
from jaxkv.kernels import decode_attention, resolve_backend
from jaxkv.kernels._options import pallas_options
from jaxkv.kernels._splitk import PALLAS_SPLITS, num_splits, split_size
from jaxkv.kernels.attention.decode import TOKEN_BLOCK
from jaxkv.kernels.testing import decode_f64, decode_problem, rel_err, request_errors, tolerance

LENGTHS = (1, 31, 32, 33, 64, 65, 300)  # short and long requests in one batch
LONG = (1, 33, 300, 700)  # 700: four splits of three, three, three and two blocks
_problem = decode_problem


def test_interpret_mode_poisons_outputs():
    """The premise of every kernel test: an unwritten output block reads back NaN."""
    out = pl.pallas_call(lambda o_ref: None, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), **pallas_options(True))()
    assert np.isnan(np.asarray(out)).all()


def _check(out, args, tol):
    q = args[0]
    assert out.dtype == q.dtype and out.shape == q.shape
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_err(out, decode_attention_reference(*args)) <= tol
    assert request_errors(out, decode_f64(*args)) <= tol


@pytest.mark.parametrize("D,G,dtype", [(64, 1, jnp.float32), (128, 2, jnp.bfloat16), (64, 4, jnp.bfloat16), (128, 8, jnp.float32)])
def test_kernel_matches_reference_and_f64(D, G, dtype):
    args = _problem(D * 10 + G, 2, G, D, dtype, LENGTHS)
    _check(decode_attention(*args, backend="interpret"), args, tolerance(dtype))


@pytest.mark.slow
def test_kernel_long_lists():
    """Up to 700 live tokens (every split of a request full, several blocks each)."""
    P = num_splits(max(LONG), TOKEN_BLOCK, PALLAS_SPLITS)
    split = split_size(max(LONG), P, TOKEN_BLOCK)
    assert P == PALLAS_SPLITS and max(LONG) - (P - 1) * split > TOKEN_BLOCK and split >= 2 * TOKEN_BLOCK  # the premise
    args = _problem(11, 2, 4, 128, jnp.bfloat16, LONG)
    _check(decode_attention(*args, backend="interpret"), args, tolerance(jnp.bfloat16))


def test_padding_entries_and_order_are_ignored():
    """Shuffling the live list and rewriting its padding changes nothing."""
    q, k, v, idx, lens = _problem(7, 2, 4, 64, jnp.float32, (40, 300))
    out = decode_attention(q, k, v, idx, lens, backend="interpret")
    rng = np.random.default_rng(1)
    idx2 = np.asarray(idx).copy()
    for b, n in enumerate(np.asarray(lens)):
        idx2[b, :n] = rng.permutation(idx2[b, :n])
        idx2[b, n:] = rng.integers(0, k.shape[0], idx2.shape[1] - n)
    out2 = decode_attention(q, k, v, jnp.asarray(idx2), lens, backend="interpret")
    assert rel_err(out2, out) <= 1e-5


def test_cpu_default_is_the_reference():
    assert resolve_backend(None) == "reference"
    q, k, v, idx, lens = _problem(3, 2, 2, 64, jnp.float32, (5, 9))
    np.testing.assert_array_equal(decode_attention(q, k, v, idx, lens), decode_attention_reference(q, k, v, idx, lens))


def test_bad_inputs_raise_typed_errors():
    q, k, v, idx, lens = _problem(4, 2, 2, 64, jnp.float32, (5, 9))
    with pytest.raises(jaxkv.ConfigError, match="unknown backend 'cuda'"):
        decode_attention(q, k, v, idx, lens, backend="cuda")
    with pytest.raises(ValueError, match=r"q head_dim 32 .* != pool head_dim 64"):
        decode_attention(q[..., :32], k, v, idx, lens)
    with pytest.raises(ValueError, match=r"not a multiple of pool KV heads 2"):
        decode_attention(q[:, :3], k, v, idx, lens)
    with pytest.raises(ValueError, match=r"k_pool and v_pool must both be \[S, Hkv, D\]"):
        decode_attention(q, k, v[:, :1], idx, lens)
    with pytest.raises(ValueError, match=r"live_idx must be \[B=2, N\], got shape \(3, 9\)"):
        decode_attention(q, k, v, jnp.zeros((3, 9), jnp.int32), lens)
    with pytest.raises(ValueError, match=r"live_len must be \[B=2\]"):
        decode_attention(q, k, v, idx, lens[:1])
    with pytest.raises(TypeError, match="live_idx must be an integer array, got float32"):
        decode_attention(q, k, v, idx.astype(jnp.float32), lens)
    with pytest.raises(TypeError, match="k_pool must be floating"):
        decode_attention(q, k.astype(jnp.int32), v, idx, lens)


def test_empty_request_gives_zeros():
    """A request with no live entry weighs nothing in any split: its output is exactly 0."""
    q, k, v, idx, lens = _problem(5, 2, 2, 64, jnp.float32, (0, 40))
    out = np.asarray(decode_attention(q, k, v, idx, lens, backend="interpret"))
    assert (out[0] == 0).all()
    assert rel_err(out[1], decode_f64(q, k, v, idx, lens)[1]) <= 1e-5
