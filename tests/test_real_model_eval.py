"""The real-model evaluation's branching (``eval.quality.real_model``) and its budget rule.

Every cell of an example is branched from one prefill: the probe captures what
every cell's policy observes, each cell runs its compression event on those
features, measures, and the engine rolls back (its tables only: the slots held at
the prefill stay pinned, so the pool needs no copy). A branched cell must be the
session that runs its policy alone: the same kept positions and the same answer
logits. Checked on a two-layer cut of SmolLM2 (its real tokenizer, template and
head layout; the first layers' attention is what the policies score) with a
short passkey example.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

import jaxkv
from eval.quality.real_model import Cell, ProbeStage, _retention_stage, branch_program, budget_for_ratio
from jaxkv.serving import Session
from jaxkv.serving.pipeline import Turn, run_to_completion
from jaxkv.tasks import haystack, token_plan

POLICIES = ("snapkv", "h2o", "agentkv", "kvzip")  # window rows, attention mass, per-phase rows, reconstruction passes
ROUNDING = 1e-4  # logits are ~10-30 in size: a few float32 ulps
POSITIONS = 1024  # every session's pool: positions_for(512), the lm cells' shape, so programs are shared


def test_budget_for_ratio_keeps_what_kvpress_keeps():
    # kvpress keeps int(n * (1 - ratio)) tokens per layer and head
    assert [budget_for_ratio(r, 2044) for r in (0.0, 0.25, 0.5, 0.75)] == [2044, 1533, 1022, 511]
    assert budget_for_ratio(0.5, 7) == 3 and budget_for_ratio(0.99, 10) == 1
    with pytest.raises(ValueError):
        budget_for_ratio(1.0, 100)


@pytest.fixture(scope="module")
def shallow(smollm2_gguf):
    model = jaxkv.load_model("smollm2-135m-instruct")
    cfg = dataclasses.replace(model.config, num_layers=2)
    small = jaxkv.model_from_config(cfg, tokenizer=model.tokenizer)
    graphdef, state = nnx.split(small.module)
    pure, source = nnx.to_pure_dict(state), nnx.to_pure_dict(nnx.state(model.module))
    pure["embed_tokens"], pure["norm"] = source["embed_tokens"], source["norm"]
    pure["layers"] = jax.tree.map(lambda a: a[:2], source["layers"])  # the stacked layer weights' first two rows
    nnx.replace_by_pure_dict(state, pure)
    small.module = nnx.merge(graphdef, state)
    return small


def _answer_logits(target):
    def measure(turn, first_logits):
        logits = yield from turn.prefill(target, all_logits=True)
        pred = np.concatenate([np.asarray(first_logits)[None], np.asarray(logits)[:-1]])
        return {"pred": pred, "live": turn.req.live_positions().copy()}

    return measure


@pytest.mark.slow
def test_a_branched_cell_is_its_policy_alone(shallow):
    tok = shallow.tokenizer
    (ex,) = haystack.examples("passkey", 1, length=384, tokenizer=tok)
    plan = token_plan(ex, tok, "aware")
    budget = budget_for_ratio(0.5, plan.compressed.size)
    cells = [Cell(None)] + [Cell(p, 0.5) for p in POLICIES]

    session = Session(shallow, max_positions=POSITIONS, protect_query=False)
    stages = [None] + [_retention_stage(c, budget, shallow, ex.seed) for c in cells[1:]]
    probe = ProbeStage(stages[1:])
    session.stages = sorted(list(session.stages) + [probe], key=lambda s: s.order)
    turn = Turn(session, session._render(ex.messages("aware")[:1], None, add_generation_prompt=True))
    # the recorded reply as the alone session's replay feeds it (answer + end of turn): the same pieces, the same programs
    target = session._render(ex.messages("aware"), None, add_generation_prompt=False).ids[plan.compressed.size :]
    branched = run_to_completion(branch_program(turn, probe, cells, stages, _answer_logits(target)), session.server.scheduler)
    # the branches roll back on a tables-only checkpoint (KVManager.checkpoint(kv=False)), whose pins are dropped after
    assert session.server.engine.allocator.num_used == 0
    session.close()

    assert branched["full"]["live"].size == plan.compressed.size + target.size
    for policy in POLICIES:
        alone = Session(shallow, max_positions=POSITIONS, protect_query=False, policy=policy, budget=budget)
        (result,) = alone.replay(ex.messages("aware"), return_logits=True)
        (event,) = alone.compressions
        cell = branched[f"{policy}@0.5"]
        assert np.array_equal(cell["live"][:budget], event.kept_positions), policy
        assert np.array_equal(result.target_ids, target)
        expected = np.concatenate([np.asarray(result.prompt_logits)[-1:], np.asarray(result.target_logits)[:-1]])
        # Equal up to float32 rounding: the probe's prefill captures more (attention
        # mass, more query rows) than the policy's own, so XLA compiles another
        # program for it; the full cell against a plain full-cache session shows the same.
        np.testing.assert_allclose(cell["pred"], expected, rtol=0, atol=ROUNDING, err_msg=policy)
        # ... far below what the eviction itself changes (the comparison can fail)
        assert np.abs(cell["pred"] - branched["full"]["pred"]).max() > 100 * ROUNDING, policy
        alone.close()
    plain = Session(shallow, max_positions=POSITIONS, protect_query=False)
    (result,) = plain.replay(ex.messages("aware"), return_logits=True)
    expected = np.concatenate([np.asarray(result.prompt_logits)[-1:], np.asarray(result.target_logits)[:-1]])
    np.testing.assert_allclose(branched["full"]["pred"], expected, rtol=0, atol=ROUNDING)
    plain.close()


@pytest.fixture(scope="module")
def lm_example(shallow):
    return haystack.examples("lm", 1, length=512, tokenizer=shallow.tokenizer)[0]


@pytest.fixture(scope="module")
def chunked_int4(shallow, lm_example):
    """``run_quant_example`` on the ``lm`` example with one format (suite time), the
    session's own chunked prefill: the record two tests read."""
    from train.haystack_measure import positions_for, run_quant_example

    return run_quant_example(shallow, lm_example, "agnostic", ["int4"], positions=positions_for(512))


def test_lm_cells_compress_the_text_to_their_budget(shallow, lm_example):
    """The ``lm`` task's raw text has no chat messages, so nothing in it is protected:
    each cell keeps its ratio's budget and its continuation's NLL and KL move."""
    from eval.quality.real_model import run_example
    from train.haystack_measure import positions_for

    example = lm_example
    cells = [Cell(None), Cell("snapkv", 0.5), Cell("streaming_llm", 0.75)]
    record = run_example(shallow, example, "agnostic", cells, positions=positions_for(512))
    n, out = record["n_request"], record["cells"]
    assert out["full"]["kept"] == n and out["full"]["kl"] == 0.0
    for cell in cells[1:]:
        got = out[cell.name]
        assert got["kept"] == budget_for_ratio(cell.ratio, n), (cell.name, got)
        assert got["kl"] > 0 and got["nll"] != out["full"]["nll"], (cell.name, got)


def test_quant_cells_run_each_format_on_its_own_pool(chunked_int4):
    """``--kv-quant``: the float pool's full cache is the reference (KL 0) and each
    format's full cache, written by its own prefill, moves the continuation's NLL
    and KL without evicting anything."""
    record = chunked_int4
    n, out = record["n_request"], record["cells"]
    assert list(out) == ["full", "kv:int4"]
    assert out["full"]["kl"] == 0.0 and all(c["kept"] == n for c in out.values())
    assert out["kv:int4"]["kl"] > 0 and out["kv:int4"]["nll"] != out["full"]["nll"], out["kv:int4"]
    assert out["kv:int4"]["kv"]["int4"] >= n and out["kv:int4"]["kv"]["int2"] == 0 and "kv" not in out["full"]


def test_imported_quant_prefill_is_the_one_chunk_prefill(shallow, lm_example, chunked_int4):
    """``--quant-prefill imported``: the float cell's K/V imported into the format's
    pool give the cell a request prefilled in one chunk would give. A 512-token
    request is one chunk for the session's own prefill too, so both protocols must
    agree to the rounding of two programs computing the same K/V."""
    from train.haystack_measure import positions_for, run_quant_example

    example, chunked = lm_example, chunked_int4
    imported = run_quant_example(shallow, example, "agnostic", ["int4"], positions=positions_for(512), prefill="imported")
    assert chunked["n_request"] <= 512  # the premise: one chunk either way
    assert list(imported["cells"]) == ["full", "kv:int4/imported"]
    a, b = chunked["cells"]["kv:int4"], imported["cells"]["kv:int4/imported"]
    assert b["kv"] == a["kv"] and b["kept"] == a["kept"]
    assert b["nll"] == pytest.approx(a["nll"], abs=1e-4) and b["kl"] == pytest.approx(a["kl"], abs=1e-4)
    assert b["kl"] > 0  # the pool is quantized, not the float source
    with pytest.raises(ValueError, match="chunked"):
        run_quant_example(shallow, example, "agnostic", ["int4"], positions=positions_for(512), prefill="one-chunk")


def test_format_specs_name_a_mode_its_budget_and_allocation():
    from train.haystack_measure import format_options

    assert format_options("int4") == {"kv_quant": "int4"}
    assert format_options("triaxial@2.6", {"x": 1}) == {"kv_quant": "triaxial", "kv_bits": 2.6, "kv_allocation": {"x": 1}}
    assert format_options("kivi2", {"x": 1}) == {"kv_quant": "kivi2"}


def test_quant_report_counts_scales_and_kivis_float_window():
    """Bytes per token with scales and zero points: INT4 5 bits per element (3.2x bf16);
    KIVI-2 at 2,048 tokens: 1,920 in INT2 pages (3 bits), the 128 newest in float (16);
    KIVI-4's pages store as INT4 does (5 bits)."""
    from types import SimpleNamespace

    from eval.quality.real_model_quant_report import storage

    cfg = SimpleNamespace(head_dim=64, num_layers=30, num_kv_heads=3)
    int4, kivi2 = storage("int4", 2048, cfg), storage("kivi2", 2048, cfg)
    assert int4["bits"] == pytest.approx(5.0) and int4["capacity"] == pytest.approx(3.2)
    assert int4["bytes"] == pytest.approx(1.25 * 64 * 30 * 3)
    assert kivi2["bits"] == pytest.approx((1920 * 3 + 128 * 16) / 2048)
    assert storage("kivi4", 2048, cfg)["bits"] == pytest.approx((1920 * 5 + 128 * 16) / 2048)  # 4-bit pages: INT4's bytes
    assert storage("none", 2048, cfg)["capacity"] == 1.0


def test_quant_report_names_imported_prefill_cells_and_stores_them_as_their_format():
    from eval.quality.real_model_quant_report import format_of

    assert format_of("kv:kivi2") == ("kivi2", "kivi2")
    assert format_of("kv:kivi2/imported") == ("kivi2", "kivi2, imported prefill")
    assert format_of("kv:triaxial@2.6/imported") == ("triaxial@2.6", "triaxial@2.6, imported prefill")


def test_quant_report_merges_formats_added_by_another_journal(tmp_path):
    """``--kv-quant kivi4 --journal quant_kivi4.jsonl`` adds a format to examples
    already journaled: cells merge by example, the first journal's full cache kept."""
    import json

    from eval.quality.real_model_quant_report import compute_table as rep_compute
    from eval.quality.real_model_quant_report import merged

    def write(name, seeds, cells):
        with (tmp_path / name).open("w") as f:
            for seed in seeds:
                f.write(
                    json.dumps(
                        {
                            "task": "lm",
                            "context": 2048,
                            "seed": seed,
                            "setting": "agnostic",
                            "seconds": 1.0,
                            "n_request": 2048,
                            "cells": {c: {"nll": v + seed, "seconds": 900.0} for c, v in cells.items()},
                        }
                    )
                    + "\n"
                )

    write("quant.jsonl", [1, 2, 3], {"full": 2.0, "kv:int4": 2.01})
    write("quant_kivi4.jsonl", [2, 3], {"full": 9.0, "kv:kivi4/imported": 2.02})
    recs = {r["seed"]: r for r in merged(tmp_path)}
    assert sorted(recs) == [1, 2, 3] and set(recs[1]["cells"]) == {"full", "kv:int4"}
    assert set(recs[2]["cells"]) == {"full", "kv:int4", "kv:kivi4/imported"} and recs[2]["cells"]["full"]["nll"] == 4.0
    assert recs[3]["seconds"] == 2.0
    table = "\n".join(rep_compute(merged(tmp_path)))
    # 3 examples; seeds 2 and 3 took 2 s (two journals), seed 1 took 1 s; in one pass each example's float cell
    # counts once (900 s) with its imported cells (900 s on seeds 2 and 3), the chunked kv:int4 left out: 4,500 s
    assert "| lm | 2048 | 3 | 0.00 | 2 | 1.25 |" in table
    assert "In all 0.00 h of CPU" in table and "about 0.00 h of wall time" in table
    assert "1.25 h of CPU, about 0.62 h on the two cores" in table
    assert "`quant_kivi4.jsonl` 2.00 h" in "\n".join(rep_compute(merged(tmp_path), {"quant_kivi4.jsonl": 7200.0}))


def test_report_puts_a_methods_scoring_passes_beside_its_quality():
    """A cell that forwarded tokens to score (KVzip's reconstruction passes) has
    their mean per example in its row and a line under its table; others none."""
    from eval.quality.real_model_report import ratio_table, rows_for

    cells = {
        "full": {1: {"tf_correct": 1, "gen_correct": 1, "answer_nll": 0.1}, 2: {"tf_correct": 1, "gen_correct": 1, "answer_nll": 0.1}},
        "kvzip@0.5": {
            1: {"tf_correct": 1, "gen_correct": 1, "answer_nll": 0.2, "scoring_tokens": 2100},
            2: {"tf_correct": 0, "gen_correct": 0, "answer_nll": 0.9, "scoring_tokens": 2200},
        },
        "snapkv@0.5": {
            1: {"tf_correct": 1, "gen_correct": 0, "answer_nll": 0.3},
            2: {"tf_correct": 0, "gen_correct": 0, "answer_nll": 1.0},
        },
    }
    key = ("multiq", 2048, "agnostic")
    rows = rows_for("jaxkv", {key: cells})
    assert {r["method"]: r.get("scoring_tokens") for r in rows} == {"full": None, "kvzip": 2150.0, "snapkv": None}
    text = "\n".join(ratio_table(rows, key, ("jaxkv",)))
    assert "jaxkv kvzip@0.5 2150." in text and "snapkv@0.5 " not in text


def test_report_merges_the_cells_of_one_example_across_journals(tmp_path):
    """``eval.quality.real_model --journal examples_<name>.jsonl`` adds methods to examples
    already journaled; the report reads every examples*.jsonl and merges by example."""
    import json

    from eval.quality import real_model_report as rep

    side = tmp_path / "jaxkv"
    side.mkdir()

    def write(name, cells):
        with (side / name).open("w") as f:
            for seed in (1, 2):
                f.write(
                    json.dumps(
                        {
                            "task": "passkey",
                            "context": 2048,
                            "seed": seed,
                            "setting": "agnostic",
                            "cells": {c: {"tf_correct": seed == 1} for c in cells},
                        }
                    )
                    + "\n"
                )

    write("examples.jsonl", ["full", "snapkv@0.5"])
    write("examples_intentkv.jsonl", ["full", "intentkv@0.5"])
    assert [p.name for p in rep.journals(side)] == ["examples.jsonl", "examples_intentkv.jsonl", "sessions.jsonl"]
    table = rep.verdicts([r for f in rep.journals(side) for r in rep.read(f)])
    cells = table[("passkey", 2048, "agnostic")]
    assert set(cells) == {"full", "snapkv@0.5", "intentkv@0.5"}
    assert all(set(by_seed) == {1, 2} for by_seed in cells.values())


def test_head_fidelity_pairs_answer_nll_increases_against_the_rule_and_a_best_baseline_with_enough_examples():
    """Issue #27 on passkey/niah: each cell's answer NLL minus its own side's full
    cache, the head paired with its rule and with the best baseline; a baseline run
    on fewer than half of the head's examples (a pilot) cannot be the best."""
    from eval.quality import real_model_report as rep

    seeds = range(10)

    def side(full, cells):
        table = {"full": {s: {"answer_nll": full} for s in seeds}}
        for name, (value, n) in cells.items():
            table[name] = {s: {"answer_nll": full + value + 0.01 * s} for s in list(seeds)[:n]}
        return {("passkey", 2048, "agnostic"): table}

    tables = {
        "jaxkv": side(0.1, {"intentkv@0.5": (1.0, 10), "intentkv_memory@0.5": (1.5, 10), "snapkv@0.5": (0.8, 10)}),
        "kvpress": side(0.3, {"KeyDiffPress@0.5": (0.0, 3), "TOVAPress@0.5": (0.7, 5)}),
    }
    inc = rep.answer_nll_increase(tables["kvpress"][("passkey", 2048, "agnostic")])
    assert inc["TOVAPress@0.5"][4]["inc"] == pytest.approx(0.74)  # against kvpress's own full cache
    lines = rep.head_fidelity(tables, ("passkey", 2048, "agnostic"), [0.5])
    pairs = [line for line in lines if line.startswith("| 0.5 |")]
    assert pairs == [
        "| 0.5 | rule: jaxkv intentkv_memory | 10 | -0.500 [-0.500, -0.500] |",
        "| 0.5 | best baseline: kvpress TOVAPress | 5 | +0.300 [+0.300, +0.300] |",
    ]


CALIBRATION_LENGTH = 256  # tokens per calibration request (the tables' cost grows with its square)


@pytest.fixture(scope="module")
def calibration(shallow):
    """``train.calibrate_triaxial``'s passkey and niah requests on the cut model and
    their plain captures, shared by the two calibration tests."""
    from train import calibrate_triaxial as ct

    reqs = list(ct.calibration_requests(shallow, ["passkey", "niah"], 1, CALIBRATION_LENGTH))
    return reqs, [ct.Capture(shallow, ids, codes) for _, ids, codes in reqs]


def test_triaxial_calibration_of_a_real_model_tags_its_conversations_and_streams_its_tables(shallow, calibration):
    """``train.calibrate_triaxial`` on a pretrained model: a passkey request is the
    question-agnostic conversation with the acknowledgement coded as a reply (-1,
    written as decode writes it) and every other token tagged; tables built one
    capture at a time equal those of all captures at once."""
    import json

    from train import calibrate_triaxial as ct

    reqs, caps = calibration
    assert [t for t, _, _ in reqs] == ["passkey", "niah"]
    for _, ids, codes in reqs:
        assert ids.size == codes.size and 0 < (codes == -1).sum() < 16 and (codes >= 0).sum() > CALIBRATION_LENGTH - 32
    streamed = ct.DistortionTables()
    # each add returns the request's entries, which a run journals (JSON: string tags)
    journaled = [json.loads(json.dumps(streamed.add(cap))) for cap in caps]
    assert streamed.tables() == ct.distortion_tables(caps, log=lambda *a: None)
    # a resumed run merges the journaled entries instead of replaying
    resumed = ct.DistortionTables()
    for entries in journaled:
        resumed.merge(entries)
    assert resumed.tables() == streamed.tables()
    with pytest.raises(ValueError, match="unknown calibration task"):
        list(ct.calibration_requests(shallow, ["chess"], 1, CALIBRATION_LENGTH))


def test_triaxial_calibration_measures_as_a_rotated_pool_stores_and_keeps_the_sink_out_of_the_tags(shallow, calibration):
    """``--rotate``: the capture is in the pool's frame (attention there is the
    model's, rotated back it gives the model's outputs) and INT3 pages are fitted
    as a rotated pool fits them (``page3_fit``: "mse"); ``--sink-tokens``: the first
    positions belong to no tag (INT4 whatever their tag), the rest keep their codes."""
    from jaxkv.attention import causal_attention
    from jaxkv.cache.rotation import Rotation
    from train import calibrate_triaxial as ct

    ((_, ids, codes), _), (plain, _) = calibration  # the passkey request and its plain capture
    rot = ct.Capture(shallow, ids, codes, rotate=True, sink_tokens=4)
    assert (plain.fit3, rot.fit3) == ("cover", "mse")
    assert (rot.codes[:4] == -1).all() and (rot.codes[4:] == plain.codes[4:]).all() and (plain.codes[:4] >= 0).all()
    R, K = Rotation(plain.k.shape[-1]), plain.k.shape[-2]
    for i in range(plain.k.shape[0]):
        np.testing.assert_allclose(rot.k[i], R.rotate(i, plain.k[i]), atol=1e-5)
        np.testing.assert_allclose(R.unrotate_heads(i, rot.o[i], K), plain.o[i], atol=1e-4)
        o = causal_attention(rot.q[i][None], rot.k[i][None], rot.v[i][None])[0]
        np.testing.assert_allclose(o[: rot.T], rot.o[i][: rot.T], atol=1e-4)
    # quantizing in the pool's frame changes the error (the frame is not the model's)
    every = np.arange(plain.T)
    assert not np.allclose(rot.error(int3_tokens=every)[0], plain.error(int3_tokens=every)[0])


def test_quant_report_counts_a_cells_recorded_precisions_and_pools_niah(tmp_path):
    """A cell's ``kv`` record (live tokens per precision and their bytes) sets its
    row's storage, so a TriAxialKV allocation is counted as it stored; niah_single
    and niah_multikey also appear pooled as ``niah``, each example once."""
    import json
    from types import SimpleNamespace

    from eval.quality import real_model_quant_report as rep

    cfg = SimpleNamespace(head_dim=64, num_layers=30, num_kv_heads=3)
    int2, int4 = 0.75 * 64 * 30 * 3, 1.25 * 64 * 30 * 3  # bytes per token: INT2 3 bits, INT4 5 bits per element
    cells = [
        {"kv": {"int2": 900, "int4": 100, "full": 0, "bytes": 900 * int2 + 100 * int4}},
        {"kv": {"int2": 0, "int4": 1000, "full": 0, "bytes": 1000 * int4}},
    ]
    st = rep.recorded_storage(cells, cfg)
    assert st["bits"] == pytest.approx((900 * 3 + 1100 * 5) / 2000)
    assert st["capacity"] == pytest.approx(16 / st["bits"])
    assert rep.recorded_storage([{"nll": 1.0}], cfg) is None  # no record: the caller falls back to storage()

    with (tmp_path / "quant.jsonl").open("w") as f:
        for task, seeds in (("niah_single", [1, 2, 3]), ("niah_multikey", [1, 2])):
            for seed in seeds:
                cell = {"tf_correct": seed % 2, "gen_correct": 0, "kv": {"int2": 0, "int4": 10, "full": 0, "bytes": 10 * int4}}
                f.write(
                    json.dumps(
                        {
                            "task": task,
                            "context": 2048,
                            "seed": seed,
                            "setting": "aware",
                            "seconds": 1.0,
                            "n_request": 10,
                            "setup": {"kv_quant": ["int4"], "quant_prefill": "imported"},
                            "cells": {"full": {"tf_correct": 1, "gen_correct": 1}, "kv:int4/imported": cell},
                        }
                    )
                    + "\n"
                )
    text = rep.report(tmp_path)
    assert "## niah (niah_single + niah_multikey), 2048 tokens, aware (5 examples)" in text
    pooled = text.split("## niah (niah_single")[1]
    assert "| int4, imported prefill | 5 | 60 | 0 |" in pooled and "| 5.00 | 3.20x |" in pooled
    assert "--task niah_single --context 2048 --n 3 --settings aware --kv-quant int4 --quant-prefill imported" in text
    assert (tmp_path / "quality_vs_bits.png").stat().st_size > 0 and "(quality_vs_bits.png)" in text
    assert "Status" not in text
    (tmp_path / "summary.md").write_text("**Status:** written by hand.\n")  # kept under the title on regeneration
    assert rep.report(tmp_path).split("\n")[2] == "**Status:** written by hand."


def test_repair_is_set_beside_kvpress_at_its_own_live_budget():
    """RepairKV answers with B + K live rows (the matched cell's budget): the kvpress
    ratio whose cells keep about that many tokens is found by their recorded kept
    counts, and its best press returned; no such ratio, no comparison."""
    from eval.quality import real_model_report as rep

    matched = {s: {"budget": 1150, "tf_correct": False} for s in range(4)}
    kp = {
        "full": {s: {"kept": 2044, "tf_correct": True} for s in range(4)},
        "SnapKVPress@0.5": {s: {"kept": 1022, "tf_correct": True} for s in range(4)},
        "StreamingLLMPress@0.4375": {s: {"kept": 1149, "tf_correct": s < 2} for s in range(4)},
        "KeyDiffPress@0.4375": {s: {"kept": 1149, "tf_correct": s < 3} for s in range(4)},
    }
    name, cells = rep.live_budget_best(kp, matched, "tf_correct")
    assert name == "KeyDiffPress@0.4375" and set(cells) == set(range(4))
    del kp["StreamingLLMPress@0.4375"], kp["KeyDiffPress@0.4375"]
    assert rep.live_budget_best(kp, matched, "tf_correct") == (None, None)  # 1022 is not within 2% of 1150
    assert rep.live_budget_best(kp, None, "tf_correct") == (None, None)


def test_reuse_section_pairs_each_mode_with_the_full_recompute(tmp_path):
    """eval.quality.real_model_reuse's journal: per mode its scores, spliced tokens, the units
    computed as a share of prefix caching alone, and the paired gain against none."""
    import json

    from eval.quality import real_model_report as rep

    folder = tmp_path / "reuse"
    folder.mkdir()
    with (folder / "examples.jsonl").open("w") as f:
        for seed in range(4):
            base = {"tf_correct": True, "gen_correct": True, "answer_nll": 0.1, "seconds": 10.0}
            seg = dict(base, tf_correct=seed != 0, spliced=1500, units=9000, full_units=60000, accepted=3, rejected=1, skipped=None)
            f.write(json.dumps({"task": "niah_single", "context": 2048, "seed": seed, "modes": {"none": base, "segment": seg}}) + "\n")
    lines = rep.reuse_section(folder)
    segment = next(line for line in lines if "| segment |" in line)
    cols = [c.strip() for c in segment.split("|")[1:-1]]
    assert cols[3:] == ["4", "75", "100", "0.100", "1500", "15%", "12 / 4", "10.0", cols[-1]]
    assert cols[-1].startswith("-25 [")
    none = next(line for line in lines if "| none |" in line)
    assert none.rstrip().endswith("| - |") and "| 100% |" in none
    assert rep.reuse_section(tmp_path / "absent") == []


def test_a_resumed_repair_run_adds_only_the_trio_cells_an_example_lacks():
    """Two RepairKV trios (K = 128 and 256) share the no-repair cell: a resumed run of
    the second appends its two new cells to examples the first journaled, and runs
    nothing for an example that holds them; the retention grid skips any journaled example."""
    from eval.quality.real_model import Cell, cells_to_run, session_cells

    first = session_cells("snapkv", 0.5, 128)
    second = session_cells("snapkv", 0.5, 256)
    held = {name for name, _ in first}
    assert [c[0] for c in cells_to_run(held, [], second)] == ["repairkv256:snapkv@0.5", "matched256:snapkv@0.5"]
    assert cells_to_run(held | {c[0] for c in second}, [], second) == []
    assert [c[0] for c in cells_to_run(None, [], second)] == [c[0] for c in second]
    grid = [Cell(None), Cell("snapkv", 0.5)]
    assert cells_to_run(None, grid) == grid and cells_to_run({"full"}, grid) == []
    # a per-layer method's trio: named like its branched cell, every session keeping a set per layer
    layered = session_cells("keydiff:layer", 0.5, 128)
    assert [c[0] for c in layered] == ["session:keydiff/layer@0.5", "repairkv128:keydiff/layer@0.5", "matched128:keydiff/layer@0.5"]
    assert all(opts["policy"] == "keydiff" and opts["keep_sets"] == "layer" for _, opts in layered)
    assert (layered[1][1]["repair"], layered[2][1]["extra"]) == (128, 128)


def test_compute_section_projects_each_rows_size_at_its_median_seconds(tmp_path):
    """Each (side, task, context, setting) row: examples run, the report's size for that
    context and side, and the CPU hours that size costs at the median seconds per
    example; kvpress's records give each setting's seconds; a row left out (full cache below the ceiling) is not projected."""
    import json

    from eval.quality.real_model_report import REQUIRED_EXAMPLES, compute_section

    (tmp_path / "jaxkv").mkdir()
    (tmp_path / "kvpress").mkdir()
    jaxkv = [
        {"task": "passkey", "context": 4096, "seed": s, "setting": "aware", "seconds": sec, "cells": {}}
        for s, sec in enumerate([50.0, 70.0, 60.0])
    ]
    jaxkv.append({"task": "niah_multivalue", "context": 2048, "seed": 9, "setting": "aware", "seconds": 10.0, "cells": {}})
    (tmp_path / "jaxkv" / "examples.jsonl").write_text("\n".join(json.dumps(r) for r in jaxkv) + "\n")
    kvpress = [
        {
            "task": "passkey",
            "example_task": "passkey",
            "context": 2048,
            "seed": s,
            "settings": {"aware": {"cells": {}}, "agnostic": {"cells": {}}},
            "seconds": {"aware": 20.0 + s, "agnostic": 30.0, "total": 50.0 + s},
        }
        for s in range(2)
    ]
    (tmp_path / "kvpress" / "examples.jsonl").write_text("\n".join(json.dumps(r) for r in kvpress) + "\n")

    lines = compute_section(tmp_path, left_out={("niah_multivalue", 2048, "aware")})  # below the ceiling
    row = next(x for x in lines if x.startswith("| jaxkv | passkey | 4096 | aware |"))
    want = REQUIRED_EXAMPLES[4096]["jaxkv"]
    assert row == f"| jaxkv | passkey | 4096 | aware | 3 | {want} | 60 | all | {180 / 3600:.2f} | {60 * want / 3600:.2f} |"
    assert not any("niah_multivalue" in x for x in lines)
    aware = next(x for x in lines if x.startswith("| kvpress | passkey | 2048 | aware |"))
    assert aware.split("|")[7].strip() == "20"  # median of 20 and 21 s, rounded
    assert any(x.startswith("| kvpress | passkey | 2048 | agnostic | 2 | 50 | 30 | all |") for x in lines)


def test_compute_section_takes_a_rows_rate_from_its_pinned_examples_once_it_has_enough(tmp_path):
    """Examples run beside more jobs than cores (or as multi-thread jobs) are slower; once
    a row has PINNED_MIN pinned examples (one core, one thread, load at most PINNED_LOAD)
    its rate is their median alone, and the hours spent still count every example."""
    import json

    from eval.quality.real_model_report import PINNED_LOAD, PINNED_MIN, REQUIRED_EXAMPLES, compute_section

    one = {"threads": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1", "cpus": 1}
    two = {"threads": "--xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads=2"}
    recs = [
        {"task": "lm", "context": 2048, "seed": s, "setting": "agnostic", "seconds": 130.0, "cells": {}, "setup": two} for s in range(10)
    ]
    recs += [
        {"task": "lm", "context": 2048, "seed": 100 + s, "setting": "agnostic", "seconds": 40.0 + s, "cells": {}, "setup": one, "load": 2.0}
        for s in range(PINNED_MIN)
    ]
    recs.append(
        {
            "task": "lm",
            "context": 2048,
            "seed": 999,
            "setting": "agnostic",
            "seconds": 500.0,
            "cells": {},
            "setup": one,
            "load": PINNED_LOAD + 1,
        }
    )  # pinned, but started beside two other jobs
    (tmp_path / "jaxkv").mkdir()
    (tmp_path / "jaxkv" / "examples.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    row = next(x for x in compute_section(tmp_path) if x.startswith("| jaxkv | lm | 2048 |")).split("|")
    med = 40 + (PINNED_MIN - 1) / 2
    assert row[5].strip() == str(len(recs)) and row[7].strip() == f"{med:.0f}" and row[8].strip() == f"pinned ({PINNED_MIN})"
    assert row[9].strip() == f"{(1300 + sum(40 + s for s in range(PINNED_MIN)) + 500) / 3600:.2f}"
    assert row[10].strip() == f"{med * REQUIRED_EXAMPLES[2048]['jaxkv'] / 3600:.2f}"


def test_random_cells_draw_per_example_and_other_cells_keep_their_options(shallow):
    """The random control's seed comes from the example (the policy's default is 0 in
    every session, which would keep one index set for a whole run); a seed the cell
    sets is kept, and other methods' options are untouched."""
    from eval.quality.real_model import cell_options

    tok = shallow.tokenizer
    a, b = haystack.examples("passkey", 2, length=384, tokenizer=tok)
    seeds = [_retention_stage(Cell("random", 0.5), 100, shallow, ex.seed).spec.config.seed for ex in (a, b)]
    assert seeds[0] != seeds[1] and seeds == [a.seed % 2**31, b.seed % 2**31]
    assert cell_options(Cell("random", 0.5, (("seed", 7),)), a.seed) == {"seed": 7}
    assert cell_options(Cell("snapkv", 0.5, (("w", 16),)), a.seed) == {"w": 16}
