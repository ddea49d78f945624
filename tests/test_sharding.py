"""Tensor and data parallelism on 8 virtual CPU devices: sharded logits equal
single-device logits, greedy generation is identical, weights and the KV pool are
split by KV head / MLP width and stay so (donated) through the jit'd steps, the
Pallas decode kernel runs per device, and a Session with eviction and RepairKV
(and one with segment reuse) runs sharded with the same outcome as on one device; two processes joined by
``jax.distributed`` (multi-host) match one device too. Meshes users build with JAX's
own constructors (``jax.make_mesh``: Explicit axes; ``jax.sharding.Mesh``: Auto)
work the same through ``load_model``; a mesh or context jaxkv cannot use is refused
with ``ConfigError`` before any step (those checks run in this process, on one
device).

The device count is fixed when jax starts, so the measurements come from one
subprocess (``tests/multidevice.py``) that this module runs once; each test
asserts one behaviour on what it measured."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import jaxkv
from jaxkv.errors import ConfigError
from jaxkv.models.sharding import MESH_AXIS, WEIGHT_AXES

HERE = os.path.dirname(__file__)
TOL = 1e-5  # fp32: sharded vs single device (only the all-reduce order differs)

LOGITS_CASES = {
    # name: (family, checkpoint overrides, tp, dp)
    "qwen2_biases_dp4_tp2": ("qwen2", {}, 2, 4),
    "qwen3_8kv_tp8": ("qwen3", {"num_attention_heads": 8, "num_key_value_heads": 8}, 8, 1),
}


def _run_subprocess(hf_checkpoint, tmp, out) -> None:
    folders = {name: str(hf_checkpoint(fam, **over)[0]) for name, (fam, over, _, _) in LOGITS_CASES.items()}
    cases = [dict(name=name, kind="logits", folder=folders[name], tp=tp, dp=dp) for name, (_, _, tp, dp) in LOGITS_CASES.items()]
    cases += [  # Llama: GQA 4 and llama3 rope scaling
        dict(name="kernel", kind="kernel", folder=str(hf_checkpoint("llama")[0]), tp=2, dp=2),
        dict(name="session", kind="session", tp=2, dp=2),
        dict(name="reuse", kind="reuse", tp=2, dp=2),
        dict(name="user_meshes", kind="user_meshes", folder=str(tmp / "qwen3_words")),
        dict(name="errors", kind="errors", folder=folders["qwen2_biases_dp4_tp2"]),
    ]
    cases.append(dict(name="quant", kind="quant", tp=2, dp=2))
    spec, part = tmp / "spec.json", tmp / "partial.json"
    spec.write_text(json.dumps({"cases": cases}))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "multidevice.py"), str(spec), str(part)], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    os.replace(part, out)


@pytest.fixture(scope="module")
def measured(hf_checkpoint, tmp_path_factory):
    """The subprocess's measurements, made once per test run: under xdist every worker
    that gets a test of this module calls this fixture, so the workers share one
    folder (the parent of their temp folders, unique to the run) and the first one
    to take its lock runs the subprocess while the others wait for its output."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    tmp, out = shared / "multidevice", shared / "multidevice" / "out.json"
    tmp.mkdir(exist_ok=True)
    with open(tmp / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.is_file():
            _run_subprocess(hf_checkpoint, tmp, out)
    results = json.loads(out.read_text())
    print(
        "\nmultidevice subprocess, per case: seconds (CPU seconds, programs compiled): "
        + ", ".join(f"{k} {v['wall_s']:.1f} ({v['cpu_s']:.1f}, {v['programs']})" for k, v in results.items())
    )
    return results


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("case", list(LOGITS_CASES))
def test_sharded_logits_equal_single_device(measured, case):
    m = measured[case]
    assert m["devices"] == 8
    _, _, tp, dp = LOGITS_CASES[case]
    assert m["mesh"] == {"dp": dp, "tp": tp}
    print(
        f"\n{case}: max |sharded - single| dense {m['dense_err']:.2e}, prefill {m['prefill_err']:.2e}, "
        f"decode {m['decode_err']:.2e} (logits up to {m['dense_scale']:.1f})"
    )
    for what in ("dense", "prefill", "decode"):
        assert m[f"{what}_err"] <= TOL, what


@pytest.mark.parametrize("case", list(LOGITS_CASES))
def test_greedy_generate_is_identical(measured, case):
    m = measured[case]
    assert [len(g) for g in m["generate_sharded"]] == [24, 24, 24]
    assert m["generate_sharded"] == m["generate_single"]


SPLIT_COLUMNS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # kernels [M, heads x D or F]
SPLIT_ROWS = ("o_proj", "down_proj")  # kernels [heads x D or F, M]


def _expected_split(path: str, ndim: int) -> list:
    """The mesh axis each dimension of a weight should be split over (a decoder
    layer's weight, stacked ``[L, ...]``, is not split by layer)."""
    module, param = path.split("/")[-2:]
    layer = [None] if path.startswith("layers/") else []
    if module in SPLIT_COLUMNS:
        return layer + ([None, "tp"] if param == "kernel" else ["tp"])
    if module in SPLIT_ROWS and param == "kernel":
        return layer + ["tp", None]
    return [None] * ndim  # embeddings, norms, LM head, output biases: replicated


@pytest.mark.parametrize("case", list(LOGITS_CASES))
def test_weights_split_by_kv_head_and_mlp_width(measured, case):
    """Every weight loaded with ``mesh=`` is placed by its role: q/k/v (and their
    biases) by output column, o_proj by input row (heads); gate/up by column and
    down by row (MLP width); everything else replicated."""
    specs = measured[case]["weight_specs"]
    for path, split in specs.items():
        assert split == _expected_split(path, len(split)), path
    n_split = sum("tp" in split for split in specs.values())
    biases = 3 if LOGITS_CASES[case][0] == "qwen2" else 0
    assert n_split == 7 + biases  # 7 stacked kernels + q/k/v biases, every layer in each
    assert set(MESH_AXIS) <= {a for axes in WEIGHT_AXES.values() for a in axes}


@pytest.mark.parametrize("case", list(LOGITS_CASES))
def test_pool_split_by_kv_head_and_donated(measured, case):
    m = measured[case]
    _, _, tp, dp = LOGITS_CASES[case]
    L, S, K, D = m["pool_shape"]
    assert m["pool_spec"] == "P(None, None, 'tp')"
    assert m["pool_devices"] == tp * dp  # replicated over dp, split over tp
    assert m["pool_shard_shape"] == [L, S, K // tp, D]
    assert m["donated_sharded"] and m["donated_single"]  # the step reused the pool's buffers


def test_pallas_decode_kernel_runs_per_device(measured):
    """backend="interpret" (the Pallas TPU kernel) under shard_map on a dp x tp mesh
    equals the one-device jnp reference, in prefill (all logits) and decode."""
    m = measured["kernel"]
    print(f"\nsharded Pallas prefill / decode vs single-device reference: {m['prefill_err']:.2e} / {m['decode_err']:.2e}")
    assert m["prefill_err"] <= TOL and m["decode_err"] <= TOL


def test_session_with_eviction_and_repair_runs_sharded(measured):
    single, sharded = measured["session"]["single"], measured["session"]["sharded"]
    assert sum(len(p) for p in single["promoted"]) > 0  # repair did promote rows
    assert single["kept"] and all(single["kept"])  # eviction ran
    for key in ("replies", "promoted", "live_after", "kept", "host_tier_rows"):
        assert sharded[key] == single[key], key
    assert sharded["leak_free"] and single["leak_free"]
    assert sharded["pool_spec"] == "P(None, None, 'tp')"  # still split after layouts, repairs and copies
    layered, layered_single = sharded["layer_sets"], single["layer_sets"]  # per-layer keep sets (pyramid) + RepairKV
    assert layered_single["layer_live_after"] and layered_single["leak_free"]
    assert layered == layered_single


def test_segment_reuse_runs_sharded(measured):
    """A spliced prefill on a dp 2 x tp 2 mesh accepts and splices what one device
    does, gives its logits within 1e-5 and leaves the pool split."""
    m = measured["reuse"]
    print(f"\nspliced prefill, sharded vs one device: max logit error {m['logits_err']:.2e}")
    assert m["single"]["accepted"] > 0 and m["single"]["spliced_tokens"] > 0  # reuse did splice
    for key in ("accepted", "spliced_tokens"):
        assert m["sharded"][key] == m["single"][key], key
    assert m["logits_err"] <= TOL
    assert m["sharded"]["pool_split"] == [None, None, "tp", None] and m["single"]["pool_split"] == [None] * 4


def test_the_http_app_on_a_mesh_replies_as_on_one_device(measured):
    """The OpenAI app over a dp 2 x tp 2 model: a plain request and one choosing
    SnapKV + RepairKV in ``extra_body`` reply as on one device, and the second
    evicted what it evicts there."""
    single, sharded = measured["reuse"]["single"]["http"], measured["reuse"]["sharded"]["http"]
    assert single["turn1"]["options"]["policy"] == "snapkv" and single["turn1"]["evicted"] > 0
    assert sharded == single


def test_quantized_pool_with_reuse_runs_sharded(measured):
    """An INT4 pool on a dp 2 x tp 2 mesh: every region split by KV head; a spliced
    prefill accepts what one device does and stores the same codes; a plain chat
    (the pool's prefill and decode) replies as on one device.

    The logits are not held to fp32's 1e-5: the sharded matmuls round in another
    order, and a key that lands within that rounding of a code boundary is stored
    one INT4 step away (a few bytes of the pool). So the stored codes must agree
    but for a 1e-4 fraction, and the logits must move by under 1% of what INT4
    itself moves them (the same prefill into a float pool). A sharding fault (a
    head on the wrong device, a scale from another head) changes far more codes."""
    m = measured["quant"]
    int4_effect = float(np.abs(np.subtract(m["single_logits"], measured["reuse"]["single_logits"], dtype=np.float64)).max())
    print(
        f"\nINT4 pool, spliced prefill, sharded vs one device: max logit error {m['logits_err']:.2e}, "
        f"INT4 vs float {int4_effect:.2e}, code bytes differing {m['code_bytes_differing']:.1e}"
    )
    assert m["single"]["accepted"] > 0  # reuse spliced
    for key in ("accepted", "reply"):
        assert m["sharded"][key] == m["single"][key], key
    assert m["code_bytes_differing"] <= 1e-4
    assert int4_effect > 0.01  # the scale below is INT4's, not fp32 noise
    assert m["logits_err"] <= 0.01 * int4_effect
    assert m["sharded"]["int4_split"][:3] == [None, None, "tp"] and m["sharded"]["int2_split"][:3] == [None, None, "tp"]


def test_meshes_a_model_cannot_use_raise_config_error(measured):
    errors = measured["errors"]
    for name, expect in (
        ("tp_not_dividing_kv_heads", "KV heads"),
        ("dp_not_power_of_two", "power of two"),
        ("unknown_axis", "mesh axes"),
        ("too_many_devices", "devices"),
    ):
        assert errors[name] is not None, name
        kind, message = errors[name]
        assert kind == "ConfigError" and expect in message, (name, message)


USER_MESHES = {  # name in multidevice.user_meshes_case: (axis types as built, mesh shape)
    "jax_make_mesh_dp2_tp2": (["AxisType.Explicit"] * 2, {"dp": 2, "tp": 2}),
    "sharding_Mesh_dp2_tp2": (["AxisType.Auto"] * 2, {"dp": 2, "tp": 2}),
}


@pytest.mark.parametrize("name", list(USER_MESHES))
def test_meshes_built_with_jax_match_one_device(measured, name):
    """A random Qwen3 (4 query heads, 2 KV heads) loaded with a mesh from
    ``jax.make_mesh`` (Explicit axes, JAX's default) or ``jax.sharding.Mesh`` (Auto):
    ``score_logits`` and the teacher-forced logits of a private ``Session``'s and a
    ``Server``-backed session's two turns equal one device's within 1e-5; greedy
    ``generate`` and the sessions' generated tokens are the same tokens. The model
    lives on the same devices with Auto axes, its weights split as usual."""
    m, single = measured["user_meshes"][name], measured["user_meshes"]["single"]
    assert "error" not in m, m.get("error")
    types, shape = USER_MESHES[name]
    assert m["axis_types"] == types and m["mesh"] == shape  # the mesh really was built that way
    assert m["model_axis_types"] == ["AxisType.Auto"] * len(types) and m["same_devices"]
    assert m["weights_split"] == 7  # q, k, v, o, gate, up, down: every layer's, stacked
    print(
        f"\n{name}: max |mesh - one device| score_logits {m['dense_err']:.2e}, session {m['session_err']:.2e}, "
        f"server session {m['server_session_err']:.2e} (logits up to {m['dense_scale']:.2f})"
    )
    for what in ("dense", "session", "server_session"):
        assert m[f"{what}_err"] <= TOL, what
    assert [len(g) for g in single["generate"]] == [12, 12, 12]
    for what in ("generate", "session_tokens", "server_session_tokens"):
        assert m[what] == single[what], what


@pytest.fixture(scope="module")
def qwen2_folder(hf_checkpoint):
    return hf_checkpoint("qwen2")[0]


def _one_device_mesh(axis_type=AxisType.Explicit, names=("tp",)) -> Mesh:
    return Mesh(np.asarray(jax.devices()[:1]).reshape((1,) * len(names)), names, axis_types=(axis_type,) * len(names))


@pytest.mark.parametrize(
    "mesh, message",
    [
        (lambda: _one_device_mesh(AxisType.Manual), "AxisType.Manual"),
        (lambda: jax.make_mesh((1,), ("model",)), "mesh axes must be 'tp' and/or 'dp'"),
        (lambda: _one_device_mesh().abstract_mesh, "must be a jax.sharding.Mesh"),
        (lambda: ("tp", 1), "must be a jax.sharding.Mesh"),
    ],
    ids=["manual_axis", "axis_named_model", "abstract_mesh", "not_a_mesh"],
)
def test_a_mesh_jaxkv_cannot_use_is_refused_at_load_model(qwen2_folder, mesh, message):
    with pytest.raises(ConfigError, match=message):
        jaxkv.load_model(qwen2_folder, mesh=mesh())


def test_explicit_mesh_is_used_as_auto_and_a_foreign_context_mesh_is_refused(qwen2_folder):
    """In this process (one device): a ``jax.make_mesh`` mesh (Explicit) becomes
    ``Model.mesh`` with Auto axes over the same device and scores like no mesh; under
    ``jax.set_mesh`` of an Explicit mesh a step would fail inside JAX, so jaxkv
    refuses it with ``ConfigError`` before any step, while ``jax.set_mesh(model.mesh)``
    is fine."""
    user = jax.make_mesh((1,), ("tp",))
    assert user.axis_types == (AxisType.Explicit,)  # JAX's default, the case of the issue
    model = jaxkv.load_model(qwen2_folder, mesh=user)
    assert model.mesh.axis_types == (AxisType.Auto,) and model.mesh.devices.tolist() == user.devices.tolist()
    ids = np.random.default_rng(5).integers(0, model.config.vocab_size, (1, 12))
    ref = np.asarray(jaxkv.score_logits(jaxkv.load_model(qwen2_folder), ids))
    assert np.abs(np.asarray(jaxkv.score_logits(model, ids)) - ref).max() <= TOL
    with jax.set_mesh(user), pytest.raises(ConfigError, match="jax.set_mesh"):
        jaxkv.score_logits(model, ids)
    with jax.set_mesh(user), pytest.raises(ConfigError, match="jax.set_mesh"):
        jaxkv.generate(model, [[1, 2]], 2)
    with jax.set_mesh(model.mesh):
        assert np.abs(np.asarray(jaxkv.score_logits(model, ids)) - ref).max() <= TOL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_through_jax_distributed_match_one_device(hf_checkpoint, tmp_path):
    """Multi-host as on a cluster, on this machine: two processes joined by
    ``jax.distributed`` (2 CPU devices each, gloo collectives), ``dp`` across the
    processes and ``tp`` within, each running the same program: both get the same
    greedy tokens and logits as one device."""
    folder = str(hf_checkpoint("qwen2")[0])
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # make test's XLA flags too: a float model, nothing quantized
    port = _free_port()
    outs = [tmp_path / f"process{i}.json" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "multidevice.py"), "--process", str(i), str(port), folder, str(outs[i])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        logs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
    first, second = (json.loads(o.read_text()) for o in outs)
    assert (first["processes"], first["devices"], first["local_devices"]) == (2, 4, 2)
    assert first["tp_groups_within_a_process"]  # make_mesh keeps the per-layer all-reduces inside a host
    assert first["sharded"]["generate"] == second["sharded"]["generate"] == first["single"]["generate"]
    assert first["sharded"]["logits"] == second["sharded"]["logits"]  # every process holds the same outputs
    err = max(np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(first["sharded"]["logits"], first["single"]["logits"]))
    print(f"\ntwo processes (dp) x 2 devices (tp) vs one device: max logit error {err:.2e}")
    assert err <= TOL
