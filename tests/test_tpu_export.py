"""Every Pallas kernel lowers for TPU (Mosaic) on this CPU host: ``jax.export`` with
``platforms=["tpu"]`` under an abstract TPU v5e ("TPU v5 lite") and v6e ("TPU v6 lite")
device. Export runs the Pallas-to-Mosaic lowering (block-shape rules, memory spaces,
DMA and semaphore ops); Mosaic's own compile to TPU code happens on a TPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from jaxkv.config import RopeConfig
from jaxkv.kernels import decode_attention, quantized_decode_attention, rope_delta
from jaxkv.kernels.attention.ragged import ragged_attention
from jaxkv.kernels.testing import mixed_quantized_problem

DEVICE_KINDS = ("TPU v5 lite", "TPU v6 lite")
sds = jax.ShapeDtypeStruct


def _export(f, *args, device_kind):
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind=device_kind, num_cores=1, platform="tpu"))
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.export.export(jax.jit(f), platforms=["tpu"])(*args)


def _mosaic_calls(exported) -> int:
    return exported.mlir_module().count("tpu_custom_call")


@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
@pytest.mark.parametrize("dtype,D,G", [(jnp.bfloat16, 128, 4), (jnp.float32, 64, 8)])
def test_decode_attention_exports_for_tpu(device_kind, dtype, D, G):
    B, K, S, N = 4, 8, 4096, 1000
    args = (sds((B, K * G, D), dtype), sds((S, K, D), dtype), sds((S, K, D), dtype), sds((B, N), jnp.int32), sds((B,), jnp.int32))
    exported = _export(functools.partial(decode_attention, backend="tpu"), *args, device_kind=device_kind)
    assert exported.platforms == ("tpu",)
    assert _mosaic_calls(exported) == 1


@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
def test_quantized_decode_attention_exports_for_tpu(device_kind):
    args = mixed_quantized_problem(0, 8, 4, 128, (3, 40), (33, 100), jnp.bfloat16)
    abstract = jax.tree.map(lambda a: sds(a.shape, a.dtype), args)
    exported = _export(functools.partial(quantized_decode_attention, backend="tpu"), *abstract, device_kind=device_kind)
    assert _mosaic_calls(exported) == 2  # the INT4 part and the INT2 part


@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
def test_rope_delta_exports_for_tpu(device_kind):
    pool, slots, delta = sds((4, 4096, 8, 128), jnp.bfloat16), sds((300,), jnp.int32), sds((300,), jnp.int32)
    f = functools.partial(rope_delta, rope=RopeConfig(theta=500000.0), backend="tpu")
    exported = _export(f, pool, slots, delta, device_kind=device_kind)
    assert _mosaic_calls(exported) == 1


@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
@pytest.mark.parametrize("dtype,D,G,K", [(jnp.bfloat16, 128, 4, 8), (jnp.bfloat16, 64, 3, 3), (jnp.float32, 64, 8, 2)])
def test_ragged_attention_exports_for_tpu(device_kind, dtype, D, G, K):
    """The ragged step: the query-tile kernel and the decode rows' split-K kernel."""
    T, R, S, N = 512, 16, 8192, 1000
    i32 = sds((R,), jnp.int32)
    args = (sds((T, K * G, D), dtype), sds((S, K, D), dtype), sds((S, K, D), dtype), sds((R, N), jnp.int32), i32, i32, i32)
    exported = _export(functools.partial(ragged_attention, backend="tpu"), *args, device_kind=device_kind)
    assert _mosaic_calls(exported) == 2
