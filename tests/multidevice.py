"""The checks that need several devices, run in a process of its own.

``tests/test_sharding.py`` launches ``python tests/multidevice.py SPEC.json OUT.json``:
the process asks XLA for 8 virtual CPU devices (the flag must be set before jax
starts, and the rest of the suite runs on one device), runs each case of SPEC on a
sharded model and on the same model on one device, and writes what it measured
to OUT.json; the tests assert on it. Not a test module itself (pytest never
collects it).

Cases (SPEC: ``{"cases": [{"name", "kind", ...}]}``):

* ``logits``: a checkpoint loaded with ``load_model(folder, mesh=make_mesh(tp, dp))``:
  dense logits, chunked prefill + teacher-forced decode logits through the paged
  pool, greedy ``generate``, where each weight and the pool ended up, and whether
  the donated pool was reused.
* ``kernel``: chunked prefill and decode through the Pallas kernel
  (``backend="interpret"``) per device under ``shard_map``, against one device's jnp
  reference.
* ``session``: a ``Server``/``Session`` with SnapKV eviction and RepairKV, one with
  per-layer keep sets (``layer_sets``) (and one
  with the compact layout) on a sharded model, against the same on one device.
* ``reuse``: cross-query segment reuse (a spliced prefill) on a sharded embedded
  model, against the same on one device; then the OpenAI app on that model, a
  plain request and one with SnapKV + RepairKV chosen in it.
* ``quant``: a quantized pool (INT4) on a sharded embedded model, a spliced
  prefill and a plain chat, against the same on one device.
* ``user_meshes``: meshes a user builds with JAX's own constructors, not jaxkv's
  ``make_mesh``: ``jax.make_mesh`` (Explicit axes, JAX's default) and
  ``jax.sharding.Mesh`` (Auto axes), each through ``load_model``, against one
  device: ``score_logits``, greedy ``generate``, a private ``Session``'s and a
  ``Server``-backed session's turns (teacher-forced logits, generated tokens).
* ``errors``: meshes a model cannot use, and the error each raises.

``python tests/multidevice.py --process I PORT FOLDER OUT`` is one of two processes of
a multi-host run on this machine: ``jax.distributed`` joins them (CPU collectives
over gloo), the mesh puts ``dp`` across the processes and ``tp`` within each (2 x 2
devices), and every process runs the same program (SPMD): greedy ``generate`` and
prefill logits, written to OUT by each process.
"""

from __future__ import annotations

import json
import os
import sys
import time

MULTIHOST = len(sys.argv) > 1 and sys.argv[1] == "--process"
DEVICES = 2 if MULTIHOST else 8  # per process
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

import gc_tuning
import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv import compiles  # noqa: E402
from jaxkv.models.sharding import make_mesh, shard_model  # noqa: E402


def _err(a, b) -> float:
    return float(max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).max() for x, y in zip(a, b)))


def _scale(a) -> float:
    return float(max(np.abs(np.asarray(x)).max() for x in a))


def _specs(model) -> dict:
    """``"layers/0/self_attn/q_proj/kernel" -> [None, "tp"]`` (the mesh axis each
    dimension is split over) for every weight."""
    _, params = model.split()
    from flax import nnx

    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]
    return {"/".join(str(k.key) for k in path): [*x.sharding.spec] + [None] * (x.ndim - len(x.sharding.spec)) for path, x in flat}


def _split(x) -> list:
    """The mesh axis each dimension of ``x`` is split over (None: whole)."""
    spec = [*getattr(x.sharding, "spec", ())]
    return spec + [None] * (x.ndim - len(spec))


def _incremental(model, seqs, prefill_lens, n_decode, backend=None):
    """Chunked prefill (all logits) then teacher-forced decode (all logits), one row
    per sequence; also reports whether the pool given to a step was donated."""
    engine = jaxkv.Engine(model, rows=len(seqs), max_positions=256, prefill_chunk=32, backend=backend)
    rows = [engine.open_row() for _ in seqs]
    before = engine.cache.k
    pre = engine.prefill(rows, [s[:n] for s, n in zip(seqs, prefill_lens)], all_logits=True)
    donated = before.is_deleted()
    _, dec = engine.decode(
        rows,
        [s[n] for s, n in zip(seqs, prefill_lens)],
        n_decode,
        return_logits=True,
        forced_tokens=[s[n + 1 : n + 1 + n_decode] for s, n in zip(seqs, prefill_lens)],
    )
    return pre, dec, engine, donated


def logits_case(case) -> dict:
    mesh = make_mesh(tp=case["tp"], dp=case["dp"])
    single = jaxkv.load_model(case["folder"])
    sharded = jaxkv.load_model(case["folder"], mesh=mesh)
    rng = np.random.default_rng(0)
    V = single.config.vocab_size
    ids = rng.integers(0, V, (2, 96))
    dense = [np.asarray(jaxkv.score_logits(m, ids)) for m in (single, sharded)]
    seqs = [rng.integers(0, V, 120).tolist() for _ in range(3)]
    runs = [_incremental(m, seqs, [70, 45, 9], 12) for m in (single, sharded)]
    prompts = [rng.integers(0, V, n).tolist() for n in (17, 40, 5)]
    gens = [jaxkv.generate(m, prompts, 24) for m in (single, sharded)]
    engine = runs[1][2]
    return {
        "devices": jax.device_count(),
        "mesh": dict(mesh.shape),
        "dense_err": _err(dense[0], dense[1]),
        "dense_scale": _scale(dense[0]),
        "prefill_err": _err(runs[0][0], runs[1][0]),
        "prefill_scale": _scale(runs[0][0]),
        "decode_err": _err(runs[0][1], runs[1][1]),
        "decode_scale": _scale(runs[0][1]),
        "generate_single": gens[0],
        "generate_sharded": gens[1],
        "weight_specs": _specs(sharded),
        "pool_spec": str(engine.cache.k.sharding.spec),
        "pool_devices": len(engine.cache.k.sharding.device_set),
        "pool_shard_shape": list(engine.cache.k.addressable_shards[0].data.shape),
        "pool_shape": list(engine.cache.k.shape),
        "donated_single": runs[0][3],
        "donated_sharded": runs[1][3],
    }


def kernel_case(case) -> dict:
    single = jaxkv.load_model(case["folder"])
    sharded = shard_model(single, make_mesh(tp=case["tp"], dp=case["dp"]))
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, single.config.vocab_size, 24).tolist() for _ in range(2)]
    # Two decode steps: each interpreted step costs ~4 s under the 8-device mesh, and
    # one step past the first already reads a token the kernel itself wrote. A short
    # prefill (17 tokens: the 32-token step) takes 8 s interpreted, a 41-token one 11 s.
    ref = _incremental(single, seqs, [12, 5], 2, backend="reference")
    kern = _incremental(sharded, seqs, [12, 5], 2, backend="interpret")
    return {"prefill_err": _err(ref[0], kern[0]), "decode_err": _err(ref[1], kern[1]), "decode_scale": _scale(ref[1])}


def _conversation(seed):
    """``test_repair``'s conversation with a sixth of its words: about 70 tokens,
    still well past the budget of 40, in fewer step buckets (each server compiles 4
    step programs, not 6)."""
    from test_repair import _conversation as repair_conversation

    return repair_conversation(seed, first_user=20, tool=8, last_user=8)


def _words_model():
    """A random Qwen3 (4 query heads, 2 KV heads) with a word tokenizer and a chat
    template: the ``session`` and ``user_meshes`` cases' model."""
    from jaxkv.chat import build_tokenizer
    from jaxkv.config import ModelConfig
    from test_session import WORDS

    tok = build_tokenizer(WORDS)
    cfg = ModelConfig(
        model_type="qwen3",
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        qk_norm=True,
        max_position_embeddings=2048,
        eos_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),),
    )
    return jaxkv.model_from_config(cfg, seed=0, tokenizer=tok)


def session_case(case) -> dict:
    from jaxkv.serving import Server, Session

    single = _words_model()
    sharded = shard_model(single, make_mesh(tp=case["tp"], dp=case["dp"]))
    out = {}
    for name, model in (("single", single), ("sharded", sharded)):
        server = Server(model, rows=2, max_positions=512)
        repairing = Session(model, server=server, keep_reasoning=True, policy="snapkv", budget=40, w=8, repair=8, repair_policy="repairkv")
        compact = Session(model, server=server, keep_reasoning=True, policy="snapkv", budget=40, w=8, layout="compact")
        turns = repairing.replay(_conversation(0), None, generate=True, max_new_tokens=4)
        compact_turns = compact.replay(_conversation(1), None, generate=True, max_new_tokens=4)
        held = server.radix.held_slots()
        alloc = server.engine.allocator
        out[name] = {
            "replies": [t.generated for t in turns] + [t.generated for t in compact_turns],
            "promoted": [r.promoted_positions.tolist() for r in repairing.repairs],
            "live_after": [int(r.live_after) for r in repairing.repairs],
            "kept": [c.kept_positions.tolist() for c in repairing.compressions + compact.compressions],
            "host_tier_rows": int(server.host_tier.num_rows),
            "leak_free": bool(np.array_equal(alloc.refcounts(), np.bincount(held, minlength=alloc.num_slots))),
            "pool_spec": str(getattr(server.engine.cache.k.sharding, "spec", None)),
        }
        server.close()
        # per-layer keep sets (a live list per layer, pyramid budgets) with RepairKV
        with Server(model, rows=1, max_positions=512, layer_lists=True) as layered:
            per_layer = Session(
                model,
                server=layered,
                keep_reasoning=True,
                policy="snapkv",
                budget=40,
                w=8,
                keep_sets="layer",
                layer_budgets="pyramid",
                repair=8,
            )
            layer_turns = per_layer.replay(_conversation(2), None, generate=True, max_new_tokens=4)
            held = layered.radix.held_slots()
            alloc = layered.engine.allocator
            out[name]["layer_sets"] = {
                "replies": [t.generated for t in layer_turns],
                "layer_live_after": [c.layer_live_after.tolist() for c in per_layer.compressions],
                "promoted": [r.promoted_positions.tolist() for r in per_layer.repairs],
                "leak_free": bool(np.array_equal(alloc.refcounts(), np.bincount(held, minlength=alloc.num_slots))),
            }
    return out


def reuse_case(case) -> dict:
    """Cross-query segment reuse (``Engine.splice_prefill``) on the embedded model: a
    second conversation splices the first one's document; the logits after the
    spliced prefill, and what the acceptance test accepted, as on one device."""
    from jaxkv.tasks import shared_corpus
    from test_reuse import chat, conversation

    doc = shared_corpus(5, n_shelves=1, length=1400)[0]  # the document test_reuse uses
    single = jaxkv.load_model("embedded")
    out = {}
    for name, model in (("single", single), ("sharded", shard_model(single, make_mesh(tp=case["tp"], dp=case["dp"])))):
        server = jaxkv.Server(model, max_positions=2048)
        opts = dict(reuse="segment", tenant="t", reuse_layers=2, halo=2)
        chat(server, *conversation(doc, 0), **opts)
        _, stage, _ = chat(server, *conversation(doc, 2), **opts)
        report = stage.reports[-1]
        out[name] = {
            "logits": np.asarray(stage.last_logits).tolist(),
            "accepted": int(report.accepted),
            "spliced_tokens": int(report.spliced_tokens),
            "pool_split": _split(server.engine.cache.k),
        }
        server.close()
        out[name]["http"] = _http_turns(model, conversation(doc, 1)[0])
    out["single_logits"] = out["single"]["logits"]  # the float pool's spliced prefill: the quant case's scale
    out["logits_err"] = _err([out["single"].pop("logits")], [out["sharded"].pop("logits")])
    return out


def quant_case(case) -> dict:
    """A quantized pool (``kv_quant="int4"``) on a sharded embedded model: a spliced
    prefill (segment reuse) and a plain chat (the pool's own prefill and decode) on
    one server, against the same on one device; where each region ended up. (INT4's
    own effect on the logits is measured in the test against the ``reuse`` case's
    float pool: the same spliced prefill.) (Retention and RepairKV on a quantized pool: ``tests/test_composition.py``;
    on a mesh: the ``session`` case.)"""
    from jaxkv.tasks import shared_corpus
    from test_reuse import chat, conversation

    doc = shared_corpus(5, n_shelves=1, length=1400)[0]
    single = jaxkv.load_model("embedded")
    opts = dict(reuse="segment", tenant="t", reuse_layers=2, halo=2)
    out, codes = {}, {}
    for name, model in (("single", single), ("sharded", shard_model(single, make_mesh(tp=case["tp"], dp=case["dp"])))):
        server = jaxkv.Server(model, max_positions=2048, kv_quant="int4")
        chat(server, *conversation(doc, 0), **opts)
        _, stage, _ = chat(server, *conversation(doc, 2), **opts)
        plain = server.session().chat(*conversation(doc, 1), max_new_tokens=3)  # the pool's own prefill, then decode
        pool = server.engine.cache.pool
        codes[name] = [np.asarray(pool.int4.k.data), np.asarray(pool.int4.v.data)]
        out[name] = {
            "logits": np.asarray(stage.last_logits).tolist(),
            "accepted": int(stage.reports[-1].accepted),
            "reply": plain,
            "int4_split": _split(pool.int4.k.data),
            "int2_split": _split(pool.int2.k.scale),
        }
        server.close()
    # How far INT4 itself moves the logits is measured against the reuse case's float
    # pool (the same spliced prefill on one device): the scale a sharded INT4 run is
    # measured against (a value a rounding-order difference puts on the other side of
    # a code boundary moves by a whole code step, not by fp32 rounding).
    out["single_logits"] = out["single"]["logits"]
    out["logits_err"] = _err([out["single"].pop("logits")], [out["sharded"].pop("logits")])
    # Stored INT4 bytes (two codes each) that differ between the two runs, as a fraction.
    differing = sum(int(np.count_nonzero(a != b)) for a, b in zip(codes["single"], codes["sharded"]))
    out["code_bytes_differing"] = differing / sum(a.size for a in codes["single"])
    return out


def _http_turns(model, msgs) -> dict:
    """Two turns of one session through the OpenAI app on ``model`` (in process,
    ``fastapi.testclient``), the second with SnapKV and RepairKV chosen per
    request: the replies and what the server reports it ran."""
    from fastapi.testclient import TestClient

    from jaxkv.server import OptionRules, make_app

    rules = OptionRules(allow_policies={"snapkv"}, max_budget=512, max_repair=16)
    app = make_app(model, model_name="m", rows=1, max_positions=2048, max_tokens=4, rules=rules)
    out = {}
    with TestClient(app) as client:
        for turn, extra in enumerate(({}, {"policy": "snapkv", "budget": 100, "repair": 16})):
            body = {"model": "m", "messages": msgs, "max_tokens": 3, "temperature": 0, "session_id": f"mesh-{turn}", **extra}
            r = client.post("/v1/chat/completions", json=body).json()
            out[f"turn{turn}"] = {
                "content": r["choices"][0]["message"].get("content"),
                "options": r["jaxkv"]["options"],
                "evicted": r["jaxkv"]["evicted_tokens"],
            }
    return out


def user_meshes_case(case) -> dict:
    """The user's own meshes (see the module docstring): per mesh, how it was
    typed, what ``Model.mesh`` became, and the largest logit error against one
    device of each path; greedy tokens of each path for both."""
    from jax.sharding import Mesh
    from jaxkv.serving import Server, Session
    from test_session import six_turn_conversation

    folder = case["folder"]
    jaxkv.save_pretrained(_words_model(), folder)
    devices = jax.devices()[:4]
    # Both place the model alike (the same devices, names and, once Auto, types; as
    # jaxkv's make_mesh(tp=2, dp=2) does): the second mesh's run reuses the first's
    # programs, so it costs its execution only.
    meshes = {
        "jax_make_mesh_dp2_tp2": lambda: jax.make_mesh((2, 2), ("dp", "tp"), devices=devices),  # JAX's default: Explicit
        "sharding_Mesh_dp2_tp2": lambda: Mesh(np.asarray(devices).reshape(2, 2), ("dp", "tp")),  # Auto
    }
    rng = np.random.default_rng(4)
    single = jaxkv.load_model(folder)
    V = single.config.vocab_size
    ids = rng.integers(0, V, (2, 40))
    prompts = [rng.integers(0, V, n).tolist() for n in (13, 30, 6)]
    msgs = six_turn_conversation()[:5]  # two assistant turns: the second reuses the first's prefix

    def run(model) -> dict:
        out = {"dense": np.asarray(jaxkv.score_logits(model, ids)), "generate": jaxkv.generate(model, prompts, 12)}
        for name, make in (
            ("session", lambda: Session(model, keep_reasoning=True, max_positions=512)),
            ("server_session", lambda: Session(model, server=server, keep_reasoning=True)),
        ):
            server = Server(model, max_positions=512) if name == "server_session" else None
            session = make()
            turns = session.replay(msgs, None, generate=True, max_new_tokens=4, return_logits=True)
            out[name] = [np.concatenate([t.prompt_logits, t.target_logits]) for t in turns]
            out[name + "_tokens"] = [list(map(int, t.reply_ids)) for t in turns]
            session.close()
            if server is not None:
                server.close()
        return out

    ref = run(single)
    result = {"single": {k: ref[k] for k in ref if k == "generate" or k.endswith("_tokens")}}
    for name, make in meshes.items():
        mesh = make()
        try:
            model = jaxkv.load_model(folder, mesh=mesh)
            got = run(model)
        except Exception as e:  # reported per mesh, asserted by the test (the other cases still run)
            result[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            continue
        result[name] = {
            "axis_types": [str(t) for t in mesh.axis_types],
            "mesh": dict(mesh.shape),
            "model_axis_types": [str(t) for t in model.mesh.axis_types],
            "same_devices": model.mesh.devices.tolist() == mesh.devices.tolist(),
            "dense_err": _err([ref["dense"]], [got["dense"]]),
            "dense_scale": _scale([ref["dense"]]),
            "session_err": _err(ref["session"], got["session"]),
            "server_session_err": _err(ref["server_session"], got["server_session"]),
            "generate": got["generate"],
            "session_tokens": got["session_tokens"],
            "server_session_tokens": got["server_session_tokens"],
            "weights_split": sum("tp" in spec for spec in _specs(model).values()),
        }
    return result


def errors_case(case) -> dict:
    from jax.sharding import Mesh

    attempts = {
        "tp_not_dividing_kv_heads": lambda: jaxkv.load_model(case["folder"], mesh=make_mesh(tp=4)),
        "dp_not_power_of_two": lambda: jaxkv.load_model(case["folder"], mesh=make_mesh(tp=1, dp=3)),
        "unknown_axis": lambda: jaxkv.load_model(case["folder"], mesh=Mesh(np.asarray(jax.devices()[:2]), ("x",))),
        "too_many_devices": lambda: make_mesh(tp=4, dp=4),
    }
    out = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = None
        except Exception as e:  # reported, asserted by the test
            out[name] = [type(e).__name__, str(e)]
    return out


KINDS = {
    "logits": logits_case,
    "kernel": kernel_case,
    "session": session_case,
    "reuse": reuse_case,
    "quant": quant_case,
    "user_meshes": user_meshes_case,
    "errors": errors_case,
}


def main(spec_path, out_path) -> None:
    gc_tuning.freeze_loaded()  # as the pytest workers do (tests/gc_tuning.py): 4% less CPU time here, 2026-12-08
    spec = json.loads(open(spec_path).read())
    results = {}
    for case in spec["cases"]:
        t0, cpu0, programs0 = time.perf_counter(), time.process_time(), compiles.count()
        results[case["name"]] = KINDS[case["kind"]](case)
        results[case["name"]]["wall_s"] = time.perf_counter() - t0
        results[case["name"]]["cpu_s"] = time.process_time() - cpu0  # a profiling aid: wall seconds are noise on a loaded host
        results[case["name"]]["programs"] = compiles.count() - programs0
    with open(out_path, "w") as f:
        json.dump(results, f)
    gc_tuning.thaw()


def process_main(index, port, folder, out_path) -> None:
    """One process of the two-process (multi-host) run; see the module docstring."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=int(index), initialization_timeout=120)
    rng = np.random.default_rng(3)
    out = {"processes": jax.process_count(), "devices": jax.device_count(), "local_devices": jax.local_device_count()}
    mesh = make_mesh(tp=2, dp=2)
    out["tp_groups_within_a_process"] = all(len({d.process_index for d in group}) == 1 for group in mesh.devices)
    models = {"sharded": jaxkv.load_model(folder, mesh=mesh)}
    if int(index) == 0:  # the reference: one local device of process 0
        models["single"] = jaxkv.load_model(folder)
    V = models["sharded"].config.vocab_size
    prompts, seqs = [rng.integers(0, V, n).tolist() for n in (17, 9)], [rng.integers(0, V, 48).tolist() for _ in range(2)]
    for name, model in models.items():
        pre, dec, _, _ = _incremental(model, seqs, [40, 23], 6)
        out[name] = {"generate": jaxkv.generate(model, prompts, 16), "logits": [np.concatenate(x).tolist() for x in zip(pre, dec)]}
    with open(out_path, "w") as f:
        json.dump(out, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    if MULTIHOST:
        process_main(*sys.argv[2:])
    else:
        main(*sys.argv[1:])
