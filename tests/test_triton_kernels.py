"""The Triton (GPU) kernels on the CPU: each launch description run by the Triton
interpreter (``jaxkv.kernels.triton.interpret``, torch CPU tensors, outputs poisoned with
NaN) through the same glue the GPU path uses, against the jnp references and a
float64 oracle. ``tests/conftest.py`` sets ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

from jaxkv.config import RopeConfig  # noqa: E402
from jaxkv.errors import BackendUnavailableError, ConfigError  # noqa: E402
from jaxkv.kernels import decode_attention, quantized_decode_attention, rope_delta  # noqa: E402
from jaxkv.kernels.triton import decode as gpu_decode  # noqa: E402
from jaxkv.kernels.triton import kernels, launch, quant_write  # noqa: E402
from jaxkv.kernels.triton import rope as gpu_rope  # noqa: E402
from jaxkv.kernels.triton.interpret import interpret_call, run  # noqa: E402
from jaxkv.kernels.kv_write import write_int4_rows, write_int4_rows_reference  # noqa: E402
from jaxkv.kernels.quant import quantize_int4  # noqa: E402
from jaxkv.kernels.rope_delta import rope_delta_reference  # noqa: E402
from jaxkv.kernels.testing import (  # noqa: E402
    LLAMA3_ROPE as LLAMA3,
    decode_codes_np,
    decode_f64,
    decode_problem,
    int4_fit_np,
    int4_write_problem,
    masked_float_problem,
    mixed_quantized_problem,
    quantized_attention_f64,
    rel_err,
    request_errors,
    rope_delta_problem,
    tolerance,
)
from jaxkv.rope import inv_frequencies  # noqa: E402

LENGTHS = (1, 31, 32, 33, 64, 65, 130)  # block boundaries; 130: several splits, the last holding two

gpu_float = jax.jit(functools.partial(gpu_decode.decode_attention, launcher=interpret_call))
gpu_quantized = jax.jit(functools.partial(gpu_decode.quantized_decode_attention, launcher=interpret_call))


def _check_decode(out, args, tol):
    q = args[0]
    assert out.dtype == q.dtype and out.shape == q.shape
    assert np.isfinite(np.asarray(out, np.float32)).all()  # every partial was written (outputs start as NaN)
    assert rel_err(out, decode_attention(*args, backend="reference")) <= tol
    assert request_errors(out, decode_f64(*args)) <= tol


# --------------------------------------------------------------------------- float decode


@pytest.mark.parametrize("D,G,dtype", [(64, 1, jnp.float32), (128, 2, jnp.bfloat16), (64, 4, jnp.bfloat16), (128, 8, jnp.float32)])
def test_float_decode_matches_reference_and_f64(D, G, dtype):
    args = decode_problem(D + G, 2, G, D, dtype, LENGTHS)
    _check_decode(gpu_float(*args), args, tolerance(dtype))


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype,lengths,splits,blocks", [(jnp.float32, (1, 33, 1000, 4097), 128, 2), (jnp.bfloat16, (1, 33, 520, 1025), 17, 1)]
)
def test_float_decode_long_lists(dtype, lengths, splits, blocks):
    """Long lists at the production split count: float32 up to 4097 tokens, where the
    split count reaches its cap (1024 programs: 128 splits of two blocks each); bfloat16
    up to 1025 tokens (17 splits of one block each, the last holding one entry)."""
    args = decode_problem(3, 2, 4, 128, dtype, lengths)
    launch = gpu_decode.decode_launch(kernels.decode_float_tokens, args[0], args[1:3], args[3], block=gpu_decode.token_block(dtype))
    assert launch.grid[2] == splits and dict(launch.constexprs)["SPLIT"] == blocks * gpu_decode.token_block(dtype)
    _check_decode(gpu_float(*args), args, tolerance(dtype))


def test_float_decode_ignores_order_and_padding_and_empty_requests():
    """Shuffling a list and rewriting its padding changes nothing; an empty request gives zeros."""
    q, k, v, idx, lens = decode_problem(7, 2, 4, 64, jnp.float32, (40, 130, 0))
    out = np.asarray(gpu_float(q, k, v, idx, lens))
    rng = np.random.default_rng(1)
    idx2 = np.asarray(idx).copy()
    for b, n in enumerate(np.asarray(lens)):
        idx2[b, :n] = rng.permutation(idx2[b, :n])
        idx2[b, n:] = rng.integers(0, k.shape[0], idx2.shape[1] - n)
    assert rel_err(gpu_float(q, k, v, jnp.asarray(idx2), lens), out) <= 1e-5
    assert (out[2] == 0).all()


def test_mixed_dtypes_promote_like_the_pallas_kernel():
    """fp32 queries over a bf16 pool: dots in fp32, output in the query dtype."""
    q, k, v, idx, lens = decode_problem(9, 2, 2, 64, jnp.bfloat16, (5, 70))
    q = q.astype(jnp.float32)
    out = gpu_float(q, k, v, idx, lens)
    assert out.dtype == jnp.float32
    assert rel_err(out, decode_attention(q, k, v, idx, lens, backend="reference")) <= 1e-5


def test_interpreter_poisons_unwritten_outputs():
    """The premise of the checks above: an output element no program writes reads back NaN.

    The production launch with its last split dropped from the grid leaves those partials
    unwritten; the glue's merge then turns them into NaN in the affected rows.
    """
    q, k, v, idx, lens = decode_problem(2, 2, 2, 64, jnp.float32, (300, 300))
    launch = gpu_decode.decode_launch(kernels.decode_float_tokens, q, (k, v), idx, block=gpu_decode.token_block(q.dtype))
    B, K, P = launch.grid
    assert P > 1
    acc, m, l = run(dataclasses.replace(launch, grid=(B, K, P - 1)), lens, idx, q, k, v)
    assert np.isnan(acc[:, P - 1]).all() and np.isnan(m[:, P - 1]).all()
    assert np.isfinite(acc[:, : P - 1]).all()


def test_launch_must_match_its_kernel():
    q, k, v, idx, lens = decode_problem(2, 2, 2, 64, jnp.float32, (3, 4))
    launch = gpu_decode.decode_launch(kernels.decode_float_tokens, q, (k, v), idx, block=32)
    with pytest.raises(TypeError, match="does not match the kernel"):
        dataclasses.replace(launch, constexprs=launch.constexprs[:-1])
    with pytest.raises(TypeError, match="launched with"):
        run(launch, lens, idx, q, k, v.astype(jnp.bfloat16))


# --------------------------------------------------------------------------- quantized decode


def _check_quantized(args, tol):
    out = gpu_quantized(*args)
    q = args[0]
    assert out.dtype == q.dtype and np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_err(out, quantized_decode_attention(*args, backend="reference")) <= tol
    assert request_errors(out, quantized_attention_f64(*args)) <= tol
    return out


def test_quantized_decode_masked_pages_and_float_part():
    """The engine's dual-pool parts on the GPU path: masked INT2 pages (jnp
    partials) and the float part (Triton float kernel) merged with the INT4 launch."""
    args, kw, want = masked_float_problem(7)
    out = jax.jit(functools.partial(gpu_decode.quantized_decode_attention, launcher=interpret_call))(*args, **kw)
    assert rel_err(out, quantized_decode_attention(*args, **kw, backend="reference")) <= 1e-5
    assert request_errors(out, want) <= 1e-5


@pytest.mark.parametrize("masked", [False, True])
def test_four_bit_pages_take_the_jnp_page_part(masked):
    """KIVI-4's 4-bit pages on the GPU path: the page part runs through the jnp
    partials (the Triton page kernel reads 2-bit codes), masked or not, and merges
    with the INT4 (and float) launches as the reference does."""
    if masked:
        args, kw, want = masked_float_problem(13, page_bits=4)
    else:
        args, kw = mixed_quantized_problem(12, 2, 2, 64, (0, 3, 12), (33, 1, 130), jnp.float32, page_bits=4), {}
        want = quantized_attention_f64(*args)
    out = jax.jit(functools.partial(gpu_decode.quantized_decode_attention, launcher=interpret_call))(*args, **kw)
    assert rel_err(out, quantized_decode_attention(*args, **kw, backend="reference")) <= 1e-5
    assert request_errors(out, want) <= 1e-5


@pytest.mark.parametrize("D,G,qdtype", [(128, 2, jnp.float32), (64, 8, jnp.bfloat16)])
def test_quantized_decode_matches_reference_and_f64(D, G, qdtype):
    # (INT2 pages, INT4 tokens): INT4 only, one token, page boundaries, long mixed (several
    # splits of each part), INT4 only.
    pages, tokens = (0, 3, 1, 6, 0), (33, 1, 32, 130, 31)
    args = mixed_quantized_problem(D + G, 2, G, D, pages, tokens, qdtype)
    out = _check_quantized(args, tolerance(qdtype))
    # Without an INT2 pool only the INT4 launch runs; requests 0 and 4 had no pages anyway.
    q, _, _, _, pool4, slots, n = args
    out4 = gpu_quantized(q, None, None, None, pool4, slots, n)
    assert rel_err(out4, quantized_decode_attention(q, None, None, None, pool4, slots, n)) <= tolerance(qdtype)
    assert rel_err(out4[0::4], out[0::4]) <= tolerance(qdtype)


@pytest.mark.slow
def test_quantized_decode_long_lists():
    """1025 INT4 tokens in one request (33 splits, the last holding one token), 20 INT2
    pages and 600 tokens in the other (bf16, G 4)."""
    args = mixed_quantized_problem(5, 2, 4, 128, (0, 20), (1025, 600), jnp.bfloat16)
    _check_quantized(args, tolerance(jnp.bfloat16))


def test_quantized_decode_rejects_head_dims_it_cannot_tile():
    args = mixed_quantized_problem(1, 2, 2, 96, (1,), (3,), jnp.float32)
    with pytest.raises(ConfigError, match="power of two >= 64, got 96"):
        gpu_quantized(*args)


# --------------------------------------------------------------------------- RoPE delta


@pytest.mark.parametrize("rope,shape,dtype", [(RopeConfig(), (3, 300, 2, 128), jnp.float32), (LLAMA3, (2, 200, 3, 64), jnp.bfloat16)])
def test_rope_delta_matches_reference_and_touches_only_its_rows(rope, shape, dtype):
    pool, slots, delta = rope_delta_problem(shape[1], shape, dtype, 130)
    out = jax.jit(functools.partial(gpu_rope.rope_delta, rope=rope, launcher=interpret_call))(pool, slots, delta)
    assert out.dtype == dtype
    assert rel_err(out, rope_delta_reference(pool, slots, delta, rope)) <= tolerance(dtype)
    untouched = np.setdiff1d(np.arange(shape[1]), np.asarray(slots))
    assert np.array_equal(np.asarray(out)[:, untouched], np.asarray(pool)[:, untouched])  # bit-identical


def test_rope_delta_long_deltas_within_float32_angle_bound():
    """|delta| up to 32k: the only error is float32 angle rounding, ~|delta| * 2^-24 rad (float64 oracle)."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((1, 100, 2, 128)), jnp.float32)
    slots = jnp.asarray(rng.permutation(100)[:64], jnp.int32)
    delta = jnp.asarray(rng.integers(-32768, 32769, 64), jnp.int32)
    out = np.asarray(gpu_rope.rope_delta(x, slots, delta, LLAMA3, launcher=interpret_call), np.float64)[0]
    xs = np.asarray(x, np.float64)[0][np.asarray(slots)]
    ang = np.asarray(delta, np.float64)[:, None] * np.asarray(inv_frequencies(LLAMA3, 128), np.float64)
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = xs[..., :64], xs[..., 64:]
    want = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    bound = (np.abs(ang)[:, None] * 2.0**-23 + 2.0**-21) * np.sqrt(x1**2 + x2**2)
    assert (np.abs(out[np.asarray(slots)] - want) <= np.concatenate([bound, bound], -1)).all()


# --------------------------------------------------------------------------- INT4 write


@pytest.mark.parametrize("D,dtype", [(64, jnp.float32), (128, jnp.bfloat16), (128, jnp.float32)])
def test_int4_write_is_bit_identical_to_quantize_rows(D, dtype):
    rows, slots, x = int4_write_problem(D, 70, 2, D, 200, dtype)  # row 0 head 0 starts with a constant group
    got = jax.jit(functools.partial(quant_write.write_int4_rows, launcher=interpret_call))(rows, slots, x)
    want = write_int4_rows_reference(rows, slots, x)
    for a, b in zip((got.data, got.scale, got.zero), (want.data, want.scale, want.zero)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    assert np.asarray(got.scale)[slots[0], 0, 0] == 0  # the constant group
    codes, scale, zero = int4_fit_np(x)  # and both equal the numpy float32 oracle
    at = np.asarray(slots)
    assert np.array_equal(decode_codes_np(np.asarray(got.data)[at], 4), codes)
    assert np.array_equal(np.asarray(got.scale)[at], scale) and np.array_equal(np.asarray(got.zero)[at], zero)


def test_int4_write_public_function_runs_the_reference_on_cpu():
    rows = quantize_int4(jnp.zeros((10, 2, 64), jnp.float32))
    x = jnp.ones((2, 2, 64), jnp.float32)
    out = write_int4_rows(rows, jnp.asarray([3, 5], jnp.int32), x)
    assert np.array_equal(np.asarray(out.data[3]), np.asarray(quantize_int4(x).data[0]))
    with pytest.raises(ValueError, match=r"x must be \[T, Hkv=2, D=64\]"):
        write_int4_rows(out, jnp.asarray([3], jnp.int32), x[:1, :1])


# --------------------------------------------------------------------------- dispatch


def test_gpu_backend_without_cuda_is_a_typed_error():
    """On a CPU-only jaxlib, backend="gpu" says what to install instead of an ImportError traceback."""
    q, k, v, idx, lens = decode_problem(1, 2, 2, 64, jnp.float32, (3, 4))
    qargs = mixed_quantized_problem(1, 2, 2, 64, (1, 1), (2, 2), jnp.float32)
    calls = [
        lambda: decode_attention(q, k, v, idx, lens, backend="gpu"),
        lambda: quantized_decode_attention(*qargs, backend="gpu"),
        lambda: rope_delta(k, jnp.asarray([1], jnp.int32), jnp.asarray([2], jnp.int32), LLAMA3, backend="gpu"),
        lambda: write_int4_rows(qargs[4].k, jnp.asarray([1], jnp.int32), k[:1], backend="gpu"),
    ]
    for call in calls:
        with pytest.raises(BackendUnavailableError, match=r"jax-triton.*pip install 'jaxkv\[cuda\]'") as e:
            call()
        assert isinstance(e.value, ConfigError)


def test_triton_call_hands_the_launch_to_jax_triton(monkeypatch):
    """The GPU adapter passes exactly the launch description (jax-triton 0.3 keywords)."""
    seen = []

    class FakeJaxTriton:
        @staticmethod
        def triton_call(*arrays, kernel, grid, name, num_warps, num_stages, input_output_aliases, out_shape, **params):
            seen.append((arrays, kernel, grid, name, num_warps, num_stages, input_output_aliases, out_shape, params))
            return [jnp.zeros(o.shape, o.dtype) for o in out_shape]

    monkeypatch.setattr(launch, "_jax_triton", lambda: FakeJaxTriton)
    pool = jnp.zeros((1, 50, 2, 64), jnp.float32)
    slots, delta = jnp.asarray([3, 7], jnp.int32), jnp.asarray([1, -1], jnp.int32)
    gpu_rope.rope_delta(pool, slots, delta, LLAMA3, launcher=launch.triton_call)
    want = gpu_rope.rope_delta_launch(pool, 2)
    arrays, kernel, grid, name, warps, stages, aliases, out_shape, params = seen[0]
    assert kernel is kernels.rope_delta_rows and name == "rope_delta_rows"
    assert launch.abstract(*arrays) == want.inputs and tuple(out_shape) == want.outputs
    assert (grid, warps, stages, aliases, params) == (want.grid, want.num_warps, want.num_stages, {3: 0}, want.params)
