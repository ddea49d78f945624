"""Tensor- and data-parallel placement on a ``jax.sharding.Mesh``: weights, KV pool, rows.

A mesh has a ``tp`` axis (tensor parallel) and optionally a ``dp`` axis (data
parallel over the rows of a step); ``make_mesh(tp=4, dp=2)`` builds one over the
local devices, and any ``Mesh`` with those axis names works, whoever built it
(multi-host: a mesh over ``jax.devices()`` after ``jax.distributed.initialize()``).

Which meshes, and the one rule for axis types (``usable_mesh``, run by
``load_model`` and ``shard_model`` before any weight is placed): jaxkv's shardings
are auto-partitioned, i.e. every ``PartitionSpec`` below says where an array lives
and XLA's partitioner chooses the collectives (the all-reduce after ``o_proj``
contracts a ``tp``-split dimension). That is JAX's ``AxisType.Auto``. A mesh from
``jax.sharding.Mesh(devices, names)`` has Auto axes; one from ``jax.make_mesh``
has Explicit axes by default, under which such a contraction is a type error
(``ShardingTypeError``) and ``with_sharding_constraint`` may name no axis. So an
Explicit axis is taken as Auto: the model is placed on ``Mesh(mesh.devices,
mesh.axis_names, axis_types=Auto...)`` (the same devices in the same order, the
same names, so the same placement) and ``Model.mesh`` is that mesh. A Manual axis
(the mesh of code running inside a ``shard_map`` over that axis) is refused with
``ConfigError``: jaxkv runs its own ``jit``/``shard_map`` over the whole mesh.

JAX's other way to name a mesh, the context (``with jax.set_mesh(m):``), is not
needed and is ignored on one device. On a mesh, jaxkv's steps must not be traced
under a context mesh other than ``model.mesh`` (JAX rejects the mix of an
Explicit context with Auto-placed weights deep inside the step), so
``check_context`` refuses it with ``ConfigError`` when a step's inputs are taken
(``Model.split``: ``score_logits``, ``generate``, a new ``Engine``, ``Server`` or
``Session``); ``with jax.set_mesh(model.mesh):`` is fine.

What is split, and where XLA puts the collectives:

* **Attention by KV head.** ``q_proj``/``k_proj``/``v_proj`` are split by output
  columns, ``o_proj`` by input rows, so device ``i`` of ``tp`` holds KV heads
  ``[i*Hkv/tp, (i+1)*Hkv/tp)`` and exactly the query heads of their GQA groups
  (query head ``h`` reads KV head ``h // G``): attention needs no communication.
  ``o_proj`` ends in one all-reduce per layer.
* **The KV pool by KV head** (``POOL_SPEC`` over ``[L, S, Hkv, D]``): each device
  stores and reads only its heads' rows; tables (slot maps, live lists) are small
  and replicated, so every device gathers the same slots.
* **The MLP by its hidden width** F: gate/up by columns, down by rows (one
  all-reduce per layer).
* **Rows over ``dp``**: a step's batch axis is split over ``dp`` (``rows_spec``);
  the pool is replicated over ``dp`` (every replica holds every slot, so the host's
  one allocator serves all rows). Embeddings, norms and the LM head are replicated.

The one declaration is ``WEIGHT_AXES``: the logical axes of each weight, keyed by the
name of the module that owns it and the parameter's name; ``MESH_AXIS`` maps
logical axes to mesh axes, and every ``PartitionSpec`` is derived from the two. A
weight not named there is replicated (always correct, just not split).

Invariants (``check_mesh``, ``ConfigError`` otherwise, at ``load_model``): a concrete
``jax.sharding.Mesh`` (not an ``AbstractMesh``); the axes are ``tp`` and/or ``dp``,
each Auto or Explicit (not Manual); ``tp`` divides Hkv (whole KV heads per device,
hence also the query heads) and F; ``dp`` is a power of two (the engine's batch
buckets are, so every step's batch splits evenly).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.errors import ConfigError

TP = "tp"  # tensor parallel: KV heads (with their query heads) and MLP width
DP = "dp"  # data parallel: the rows of a step

# The one declaration: (owning module, parameter) -> logical axes of the weight.
# Linear kernels are [in, out]; embeddings [V, M].
WEIGHT_AXES = {
    ("embed_tokens", "embedding"): ("vocab", "model"),
    ("lm_head", "kernel"): ("model", "vocab"),
    ("q_proj", "kernel"): ("model", "q_heads"),
    ("q_proj", "bias"): ("q_heads",),
    ("k_proj", "kernel"): ("model", "kv_heads"),
    ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "kernel"): ("model", "kv_heads"),
    ("v_proj", "bias"): ("kv_heads",),
    ("o_proj", "kernel"): ("q_heads", "model"),
    ("o_proj", "bias"): ("model",),
    ("gate_proj", "kernel"): ("model", "mlp"),
    ("gate_proj", "bias"): ("mlp",),
    ("up_proj", "kernel"): ("model", "mlp"),
    ("up_proj", "bias"): ("mlp",),
    ("down_proj", "kernel"): ("mlp", "model"),
    ("down_proj", "bias"): ("model",),
}
# Logical axis -> mesh axis; every logical axis not listed is replicated.
MESH_AXIS = {"q_heads": TP, "kv_heads": TP, "mlp": TP}

POOL_SPEC = P(None, None, TP, None)  # a KV pool [L, S, Hkv, D], split by KV head


def axis_size(mesh: Mesh | None, name: str) -> int:
    """Devices along ``name`` (1 when the mesh has no such axis, or no mesh)."""
    if mesh is None or name not in mesh.axis_names:
        return 1
    return int(mesh.shape[name])


def make_mesh(tp: int = 1, dp: int = 1, devices=None) -> Mesh:
    """A ``(dp, tp)`` mesh over ``devices`` (default: the first ``dp * tp`` of
    ``jax.devices()``). Neighbouring devices share a ``tp`` group, so the per-layer
    all-reduces stay on the fastest links (NVLink, ICI)."""
    devices = list(jax.devices() if devices is None else devices)
    if tp < 1 or dp < 1 or tp * dp > len(devices):
        raise ConfigError(f"a mesh of dp={dp} x tp={tp} needs {dp * tp} devices; {len(devices)} available")
    return Mesh(np.asarray(devices[: dp * tp]).reshape(dp, tp), (DP, TP))


def check_mesh(cfg, mesh: Mesh) -> None:
    """``ConfigError`` unless ``mesh`` can hold a model of config ``cfg`` (see the
    module docstring's invariants)."""
    if not isinstance(mesh, Mesh):
        raise ConfigError(
            f"mesh must be a jax.sharding.Mesh over devices (jax.make_mesh, jax.sharding.Mesh or "
            f"jaxkv.models.sharding.make_mesh), got {type(mesh).__name__}"
        )
    extra = [a for a in mesh.axis_names if a not in (TP, DP)]
    if extra:
        raise ConfigError(f"mesh axes must be {TP!r} and/or {DP!r}, got {mesh.axis_names}")
    manual = [a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Manual]
    if manual:
        raise ConfigError(
            f"mesh axes {manual} are AxisType.Manual (the mesh inside a shard_map); jaxkv partitions its "
            f"own steps over the whole mesh and needs Auto or Explicit axes, got axis_types={mesh.axis_types}"
        )
    tp, dp = axis_size(mesh, TP), axis_size(mesh, DP)
    if cfg.num_kv_heads % tp or cfg.intermediate_size % tp:
        raise ConfigError(f"tp={tp} must divide the KV heads ({cfg.num_kv_heads}) and the MLP width ({cfg.intermediate_size})")
    if dp & (dp - 1):
        raise ConfigError(f"dp={dp} must be a power of two (the engine's batch buckets are)")


def usable_mesh(cfg, mesh: Mesh) -> Mesh:
    """The mesh jaxkv places a model of config ``cfg`` on, for a user's ``mesh``:
    ``check_mesh``, then the same devices and axis names with every axis Auto
    (``mesh`` itself when it already is; see the module docstring's rule)."""
    check_mesh(cfg, mesh)
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def check_context(mesh: Mesh | None) -> None:
    """``ConfigError`` when a model placed on ``mesh`` is used under a context mesh
    (``jax.set_mesh``) other than ``mesh`` itself; nothing on one device."""
    if mesh is None:
        return
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context != mesh.abstract_mesh:
        raise ConfigError(
            f"a model on a mesh is used under jax.set_mesh({context}); its weights are on {mesh.abstract_mesh} "
            f"(jaxkv's steps need Auto axes): call jaxkv outside the set_mesh block, or inside "
            f"jax.set_mesh(model.mesh)"
        )


def weight_spec(path) -> P:
    """The ``PartitionSpec`` of the weight at ``path`` in the model state (a tuple of
    keys ending ``(..., module, parameter)``), from ``WEIGHT_AXES``; a decoder
    layer weight (``("layers", ...)``, stacked ``[L, ...]``) is not split by layer."""
    axes = WEIGHT_AXES.get(tuple(str(k) for k in path[-2:]))
    if axes is None:
        return P()
    stacked = (None,) if str(path[0]) == "layers" else ()
    return P(*stacked, *(MESH_AXIS.get(a) for a in axes))


def place(value: np.ndarray, path, mesh: Mesh, dtype) -> jax.Array:
    """``value`` (a host array) in ``dtype`` as a global array split by
    ``weight_spec(path)``. Each process builds only its addressable shards from its
    slices of ``value`` (of a memory map, only those are read), so no device or
    host copy holds the whole weight."""
    dtype = np.dtype(dtype)

    def shard(index):
        part = np.asarray(value[index])
        return part if part.dtype == dtype else part.astype(np.float32).astype(dtype)

    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, weight_spec(path)), shard)


def shard_model(model, mesh: Mesh):
    """A copy of ``model`` (a ``jaxkv.models.loading.Model``) with its weights placed
    on ``mesh`` (``load_model(..., mesh=)`` places them while loading instead)."""
    from flax import nnx

    mesh = usable_mesh(model.config, mesh)
    graphdef, state = nnx.split(model.module)
    pure = jax.tree_util.tree_map_with_path(
        lambda path, x: place(np.asarray(jax.device_get(x)), tuple(k.key for k in path), mesh, x.dtype), nnx.to_pure_dict(state)
    )
    nnx.replace_by_pure_dict(state, pure)
    return dataclasses.replace(model, module=nnx.merge(graphdef, state), mesh=mesh)


def rows_spec(ndim: int) -> P:
    """An array whose leading axis is a step's rows: split over ``dp``."""
    return P(DP, *([None] * (ndim - 1)))


def constrain_rows(tree, mesh: Mesh):
    """Inside jit: split the leading (row) axis of every array of ``tree`` over ``dp``."""
    if axis_size(mesh, DP) == 1:
        return tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, rows_spec(x.ndim))), tree)


def replicate(tree, mesh: Mesh):
    """Inside jit: every array of ``tree`` whole on every device (step outputs the host
    reads: each process of a multi-host run can then fetch them)."""
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P())), tree)


def shard_heads(attend, mesh: Mesh, kv):
    """Run ``attend(kv, q_THD, k_TKD, v_TKD, meta) -> out_THD`` (one layer of the
    engine's attention, any backend) on each device over its own KV heads: a
    ``shard_map``, so a kernel (Pallas, Triton) sees a per-device problem and no
    collective is needed. ``kv`` (the pool pytree, every array split by KV head on
    its axis 2, ``POOL_SPEC``) gives the structure of the pool argument; the step's
    queries, keys and values are split by head, ``meta`` (the step's attention
    metadata: live lists, lengths, plans) is replicated: a step's rows are not
    split over ``dp``, whose devices compute the same step."""
    pool = jax.tree.map(lambda _: POOL_SPEC, kv)
    q = P(None, TP, None)
    return jax.shard_map(
        lambda kv_, q_, k_, v_, meta_: attend(kv_, q_, k_, v_, meta_),
        mesh=mesh,
        in_specs=(pool, q, q, q, P()),
        out_specs=q,
        check_vma=False,
    )
