"""The engine's programs (``run_step``, ``run_decode``) for a bf16 model lower
for TPU and for CUDA on this CPU host (``jax.export``): everything around the
kernels (dtypes, donation of the pool, sharding over a mesh) is checked for both
platforms without the hardware.

* TPU ("TPU v5 lite", "TPU v6 lite" abstract devices): the ragged attention through
  the Pallas kernel (``backend="tpu"``: a Mosaic custom call in the module).
* CUDA: the ragged attention through the jnp reference (the Triton kernels go
  through jax-triton, which needs a CUDA jaxlib to lower).
* Sharded: the same steps on an abstract 2 x 2 (dp x tp) mesh: the pool arguments
  are donated and split by KV head, the kernel runs inside the per-device
  ``shard_map``.

Every step keeps the pool in bf16, returns float32 logits, and computes every
softmax exponential in float32."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh, NamedSharding

from jaxkv.backends import select_backend
from jaxkv.cache.state import PagedKVCache
from jaxkv.config import ModelConfig
from jaxkv.cache.pools import FloatLayers
from jaxkv.forward import DecodeBatch, Outputs, StepBatch, cache_sharding, run_decode, run_step
from jaxkv.models import sharding
from jaxkv.models.transformer import Transformer
from jaxkv.sampling import RowSamplers

DEVICE_KINDS = ("TPU v5 lite", "TPU v6 lite")
sds = jax.ShapeDtypeStruct
i32 = jnp.int32
# A small Qwen3 with the shapes production kernels use: head_dim 128, GQA 4.
CFG = ModelConfig(
    model_type="qwen3",
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=384,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=128,
    qk_norm=True,
    max_position_embeddings=4096,
)
B, T, N_STEPS, SLOTS, ROWS, POSITIONS = 4, 128, 16, 4097, 4, 1024


def _abstract_args(mesh=None):
    """Abstract (shape, dtype, sharding) arguments of both steps for a bf16 model."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(CFG, jnp.bfloat16, rngs=nnx.Rngs(0))))
    pure = jax.tree_util.tree_map_with_path(
        lambda path, x: sds(
            x.shape, x.dtype, sharding=None if mesh is None else NamedSharding(mesh, sharding.weight_spec(tuple(k.key for k in path)))
        ),
        nnx.to_pure_dict(params),
    )
    nnx.replace_by_pure_dict(params, pure)
    cache = jax.eval_shape(
        lambda: PagedKVCache.create(
            num_layers=CFG.num_layers,
            num_slots=SLOTS,
            num_kv_heads=CFG.num_kv_heads,
            head_dim=CFG.head_dim,
            rows=ROWS,
            positions=POSITIONS,
            dtype=jnp.bfloat16,
        )
    )
    if mesh is not None:
        cache = jax.tree.map(lambda x, s: sds(x.shape, x.dtype, sharding=s), cache, cache_sharding(cache, mesh))
    samplers = RowSamplers(sds((B,), jnp.float32), sds((B,), i32), sds((B,), jnp.float32))
    step = StepBatch(
        sds((T,), i32),
        sds((T,), i32),
        sds((T,), i32),
        sds((B,), i32),
        sds((B,), i32),
        sds((B,), i32),
        sds((B, 2), jnp.uint32),
        sds((B,), i32),
        samplers,
        sds((T,), i32),
    )
    decode = DecodeBatch(
        sds((B,), i32),
        sds((B,), i32),
        sds((B,), i32),
        sds((B, N_STEPS), i32),
        sds((B, 1), i32),
        sds((B, 2), jnp.uint32),
        sds((B,), i32),
        samplers,
        sds((B, N_STEPS), i32),
    )
    return graphdef, params, cache, step, decode


def _export_steps(platform, backend, mesh=None, capture_q=False):
    graphdef, params, cache, step, decode = _abstract_args(mesh)
    attention = select_backend(FloatLayers(), backend)
    outputs = Outputs(logits="last", query_rows=capture_q)
    exported_step = jax.export.export(run_step, platforms=[platform])(
        graphdef, params, cache, step, backend=attention, mesh=mesh, outputs=outputs
    )
    exported_decode = jax.export.export(run_decode, platforms=[platform])(
        graphdef, params, cache, decode, backend=attention, n_steps=N_STEPS, mesh=mesh, outputs=Outputs(query_rows=capture_q)
    )
    return exported_step, exported_decode


def _tpu_mesh(device_kind, shape=(1,), names=("x",)):
    return AbstractMesh(shape, names, abstract_device=AbstractDevice(device_kind=device_kind, num_cores=1, platform="tpu"))


def _arg_attrs(exported, name: str) -> str:
    """The attributes of the exported ``main``'s argument named ``name`` (e.g. cache.k)."""
    text = exported.mlir_module()
    found = re.search(r"%arg\d+: tensor<[^>]*> \{((?:(?!%arg).)*?)\} loc\(\"" + re.escape(name) + r"\"\)", text)
    assert found, f"no argument {name} in the exported module"
    return found.group(1)


def _softmax_exp_dtypes(exported) -> set[str]:
    """Element types of the softmax exponentials: every ``exponential`` of the module
    except SiLU's (whose last axis is the MLP width F, in the model dtype)."""
    found = re.findall(r"stablehlo\.exponential %\S+ : tensor<((?:\d+x)+)([a-z]+\d+)>", exported.mlir_module())
    last = [(int(dims.split("x")[-2]), dtype) for dims, dtype in found]
    assert any(n == CFG.intermediate_size for n, _ in last)  # SiLU is there: the pattern reads this module
    return {dtype for n, dtype in last if n != CFG.intermediate_size}


def _check_bf16_steps(exported_prefill, exported_decode, platform):
    for exported in (exported_prefill, exported_decode):
        assert exported.platforms == (platform,)
        pool_avals = [a for a in exported.in_avals if a.shape == (CFG.num_layers, SLOTS, CFG.num_kv_heads, CFG.head_dim)]
        assert len(pool_avals) == 2 and all(a.dtype == jnp.bfloat16 for a in pool_avals)
        weights = [a for a in exported.in_avals if a.ndim >= 2 and CFG.hidden_size in a.shape]
        assert weights and all(a.dtype == jnp.bfloat16 for a in weights)
        assert _softmax_exp_dtypes(exported) == {"f32"}  # softmax in float32 on a bf16 model
    logits = exported_prefill.out_avals[-1]  # (tokens, cache, aux["logits"])
    assert logits.shape == (B, CFG.vocab_size) and logits.dtype == jnp.float32


@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
def test_bf16_steps_export_for_tpu_through_pallas(device_kind):
    with jax.sharding.use_abstract_mesh(_tpu_mesh(device_kind)):
        exported_prefill, exported_decode = _export_steps("tpu", "tpu")
    _check_bf16_steps(exported_prefill, exported_decode, "tpu")
    for exported in (exported_prefill, exported_decode):
        assert "tpu_custom_call" in exported.mlir_module()  # the ragged attention: the Mosaic kernel
        for leaf in ("cache.k", "cache.v", "cache.live_idx"):
            assert "tf.aliasing_output" in _arg_attrs(exported, leaf), leaf  # the pool is donated


def test_bf16_steps_export_for_cuda_with_reference_attention():
    exported_prefill, exported_decode = _export_steps("cuda", "reference")
    _check_bf16_steps(exported_prefill, exported_decode, "cuda")
    for exported in (exported_prefill, exported_decode):
        assert "custom_call" not in exported.mlir_module()  # plain XLA: no kernel, no host callback
        for leaf in ("cache.k", "cache.v"):
            assert "tf.aliasing_output" in _arg_attrs(exported, leaf), leaf


def test_features_export_for_tpu():
    """The step that captures query rows (retention events) lowers too."""
    with jax.sharding.use_abstract_mesh(_tpu_mesh(DEVICE_KINDS[0])):
        exported_step, exported_decode = _export_steps("tpu", "tpu", capture_q=True)
    assert _softmax_exp_dtypes(exported_step) == _softmax_exp_dtypes(exported_decode) == {"f32"}
    assert exported_step.out_avals[-1].shape == (CFG.num_layers, T, CFG.num_heads, CFG.head_dim)  # the captured query rows
    assert exported_decode.out_avals[-1].shape == (N_STEPS, CFG.num_layers, B, CFG.num_heads, CFG.head_dim)  # every fed token's


@pytest.mark.parametrize(
    "platform,backend,device_kind", [("tpu", "tpu", DEVICE_KINDS[0]), ("tpu", "tpu", DEVICE_KINDS[1]), ("cuda", "reference", None)]
)
def test_sharded_steps_export(platform, backend, device_kind):
    """On a 2 x 2 (dp x tp) mesh: the pool arguments are donated and split by KV head,
    the attention projections and the MLP by tp; on TPU the kernel runs per device."""
    if platform == "tpu":
        mesh = _tpu_mesh(device_kind, (2, 2), (sharding.DP, sharding.TP))
    else:
        mesh = AbstractMesh(
            (2, 2),
            (sharding.DP, sharding.TP),
            abstract_device=AbstractDevice(device_kind="NVIDIA A100-SXM4-80GB", num_cores=None, platform="cuda"),
        )
    with jax.sharding.use_abstract_mesh(mesh):
        exported_prefill, exported_decode = _export_steps(platform, backend, mesh)
    _check_bf16_steps(exported_prefill, exported_decode, platform)
    for exported in (exported_prefill, exported_decode):
        assert exported.nr_devices == 4
        for leaf in ("cache.k", "cache.v"):
            attrs = _arg_attrs(exported, leaf)
            assert "jax.buffer_donor = true" in attrs and '[{}, {}, {"tp"}, {}]' in attrs, attrs
        assert '[{}, {}, {"tp"}]' in _arg_attrs(exported, "params['layers']['self_attn']['k_proj']['kernel'].value")
        assert '[{}, {"tp"}, {}]' in _arg_attrs(exported, "params['layers']['mlp']['down_proj']['kernel'].value")
        text = exported.mlir_module()
        assert "sdy.manual_computation" in text  # the ragged attention inside the per-device shard_map
        if platform == "tpu":
            assert "tpu_custom_call" in text
