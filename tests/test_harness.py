"""The evaluation harness end to end on a tiny random model with the task tokenizer:
CSV columns, markdown, plots, and the prefix-hit contrast of the two layouts."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from eval.quality import harness
from train import replay


def test_harness_writes_csv_markdown_and_plots(task_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    args = harness.build_parser().parse_args(
        [
            "--model",
            str(task_model_dir),
            "--task",
            "mqniah",
            "--methods",
            "full,snapkv,oldest",
            "--budgets",
            "200,400",
            "--layouts",
            "dead_slot,compact",
            "--n",
            "1",
            "--length",
            "600",
            "--max-new-tokens",
            "4",
            "--out",
            str(out),
        ]
    )
    rows = harness.run(args)
    assert len(rows) == 1 + 2 * 2 * 2  # full once + 2 methods x 2 budgets x 2 layouts
    with open(out / "results.csv") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == harness.COLUMNS
        table = list(reader)
    assert len(table) == len(rows)
    for name in ("results.md", "accuracy_vs_budget.png", "kv_reads_vs_budget.png"):
        assert (out / name).stat().st_size > 0
    full = next(r for r in rows if r["method"] == "full")
    for r in rows:
        assert 0.0 <= r["accuracy"] <= 1.0 and r["completion"] == 1.0
        if r["layout"] == "dead_slot":  # hole-preserving eviction keeps the full cache's reuse
            assert r["prefix_hit_rate"] == pytest.approx(full["prefix_hit_rate"])
        if r["layout"] == "compact":  # renumbered requests are never reused
            assert r["prefix_hit_rate"] == 0.0
        if r["method"] != "full":
            assert r["peak_live_kv"] < full["peak_live_kv"]
    assert "prefix-hit rate on mqniah" in capsys.readouterr().out


def test_harness_rejects_bad_arguments(task_model_dir, tmp_path):
    kv_allocation_without_triaxial = ["--kv-quant", "none,int4", "--kv-allocation", "allocation.json"]
    for bad in (
        ["--methods", "nope"],
        ["--layouts", "sideways"],
        ["--budgets", "abc"],
        ["--task", "chess"],
        kv_allocation_without_triaxial,
    ):
        args = harness.build_parser().parse_args(["--model", str(task_model_dir), "--out", str(tmp_path), *bad])
        with pytest.raises(ValueError):
            harness.run(args)


def test_harness_repair_cells_and_matched_budget(task_model_dir, tmp_path):
    out = tmp_path / "repair"
    args = harness.build_parser().parse_args(
        [
            "--model",
            str(task_model_dir),
            "--task",
            "mqniah",
            "--methods",
            "snapkv",
            "--budgets",
            "200",
            "--layouts",
            "dead_slot",
            "--n",
            "2",
            "--length",
            "600",
            "--max-new-tokens",
            "4",
            "--repair-ks",
            "8,16",
            "--repair-policies",
            "repairkv,wrongq",
            "--out",
            str(out),
        ]
    )
    rows = harness.run(args)
    by = {(r["repair_policy"], r["repair_k"]): r for r in rows}
    assert by[("none", 0)]["budget"] == 200
    for k in (8, 16):
        assert by[("matched", k)]["budget"] == 200 + k and by[("matched", k)]["base_budget"] == 200
        for policy in ("repairkv", "wrongq"):
            assert by[(policy, k)]["budget"] == 200 and by[(policy, k)]["base_budget"] == 200
    with open(out / "results.csv") as f:
        assert tuple(csv.DictReader(f).fieldnames) == harness.COLUMNS
    assert (out / "repair_accuracy_vs_k.png").stat().st_size > 0


def _grid_args(model_dir, out, *extra):
    return harness.build_parser().parse_args(
        [
            "--model",
            str(model_dir),
            "--task",
            "mqniah",
            "--methods",
            "full,snapkv",
            "--budgets",
            "200,400",
            "--layouts",
            "dead_slot",
            "--n",
            "1",
            "--length",
            "600",
            "--max-new-tokens",
            "4",
            "--out",
            str(out),
            *extra,
        ]
    )


def _without_wall(rows):
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]


def test_harness_resume_skips_recorded_cells_and_workers_agree(task_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "grid"
    first = harness.run(_grid_args(task_model_dir, out))
    journal = (out / "cells.jsonl").read_text().splitlines()
    assert len(journal) == len(first) == 3
    md = (out / "results.md").read_text()
    assert "## mqniah: accuracy" in md and "| snapkv |" in md  # the method x budget pivot

    # drop the last recorded cell (an interrupted run): --resume replays only that one
    (out / "cells.jsonl").write_text("\n".join(journal[:-1]) + "\n")
    replayed = []
    real_run_cell = replay.run_cell
    monkeypatch.setattr(replay, "run_cell", lambda *a, **k: replayed.append(a[2]) or real_run_cell(*a, **k))
    # --report-only writes the report from the recorded cells, runs none, lists the rest
    reported = harness.run(_grid_args(task_model_dir, out, "--resume", "--report-only"))
    assert replayed == [] and _without_wall(reported) == _without_wall(first[:-1])
    assert f"Not run (--report-only; 1 cells of the grid): {first[-1]['method']}@{first[-1]['budget']}" in (out / "results.md").read_text()
    resumed = harness.run(_grid_args(task_model_dir, out, "--resume"))
    assert [(c.method, c.budget) for c in replayed] == [(first[-1]["method"], first[-1]["budget"])]
    assert _without_wall(resumed) == _without_wall(first)

    # another setup (here n) never reuses recorded cells: none of them counts as finished
    with pytest.raises(ValueError, match="no finished cell of this grid"):
        harness.run(_grid_args(task_model_dir, out, "--resume", "--report-only", "--n", "2"))
    monkeypatch.undo()

    # two worker processes reproduce the in-process rows exactly (the snapkv cells:
    # one spawned process per cell, so the full-cache cell would only add a process)
    parallel = harness.run(_grid_args(task_model_dir, tmp_path / "parallel", "--workers", "2", "--methods", "snapkv"))
    assert len(parallel) == 2 and _without_wall(parallel) == _without_wall([r for r in first if r["method"] == "snapkv"])


def _row(method, budget, correct, scored=None):
    scored = scored or [2] * len(correct)
    return {
        "method": method,
        "budget": budget,
        "layout": "dead_slot" if budget != "-" else "-",
        "task": "agent",
        "repair_policy": "none",
        "accuracy": sum(correct) / sum(scored),
        "peak_request_tokens": 10.0,
        "peak_live_kv": 5.0,
        "raw_kv_reads": 100.0,
        "effective_kv_reads": 50.0,
        replay.PER_EXAMPLE: {"correct": correct, "scored": scored},
    }


def test_compare_to_best_baseline_pairs_examples_and_never_picks_a_learned_method():
    n = 40
    rows = [_row("full", "-", [2] * n)]
    rows += [
        _row("snapkv", 100, [1] * n),
        _row("h2o", 100, [1] * (n // 2) + [0] * (n // 2)),
        _row("intentkv", 100, [2] * n),
        _row("intentkv_no_xattn", 100, [1] * n),
    ]
    (col,) = harness.comparison(rows, "agent", "best", focus="intentkv")
    assert col["reference"]["method"] == "snapkv"  # the most accurate baseline; intentkv is never one
    by = {e["row"]["method"]: e for e in col["entries"]}
    assert by["snapkv"]["gain"] is None  # the reference itself
    gain, low, high = by["intentkv"]["gain"]
    assert gain == 0.5 and low == high == 0.5  # every example gains the same: a zero-width interval
    g, lo, hi = by["intentkv_no_xattn"]["gain"]
    assert g == lo == hi == 0.0
    assert by["full"]["share"] == 1.0 and by["h2o"]["share"] == 0.25
    assert col["focus_gains"]["h2o"][1] > 0 and set(col["focus_gains"]) == {"snapkv", "h2o"}
    md = harness.comparison_markdown(rows, "agent", "best", "intentkv")
    assert "reference snapkv (0.500)" in md and "+0.500 [+0.500, +0.500]" in md and "**yes**" in md
    # a baseline cell without per-example counts (an older journal) leaves the verdict open
    old = _row("tova", 100, [0] * n)
    del old[replay.PER_EXAMPLE]
    md = harness.comparison_markdown(rows + [old], "agent", "best", "intentkv")
    assert "tova -" in md and "**not decided** (no per-example counts for tova" in md
    # a method that loses on some examples gets an interval that reaches below its gain
    rows.append(_row("tova", 100, [0, 2] * (n // 2)))
    (col,) = harness.comparison(rows, "agent", "tova")
    g, lo, hi = next(e for e in col["entries"] if e["row"]["method"] == "snapkv")["gain"]
    assert g == 0.0 and lo < 0 < hi


def test_a_cell_without_reuse_keeps_its_journal_key_from_before_the_reuse_field():
    """Journals written before ``Cell.reuse`` existed (the committed harness reports) still resume."""
    cell = replay.Cell("snapkv", 1280, "dead_slot", "agent", base_budget=1280)
    assert harness.cell_key(cell) == '["snapkv", 1280, "dead_slot", "agent", "none", 0, 1280]'
    assert harness.cell_key(harness.dataclasses.replace(cell, reuse="segment")).endswith(', 1280, "segment"]')


@pytest.fixture(scope="module")
def quant_run(quant_model_dir, tmp_path_factory):
    """``(rows, out)`` of one KV-precision grid on the quantizable model, shared by the
    two tests below: the full cache on the float pool, INT4 and TriAxial at 2 and 4
    bits, with ``--fidelity`` and teacher-forced accuracy. ``none`` is named after
    ``int4``: the float pool's reference cell must still run first."""
    out = tmp_path_factory.mktemp("quant")
    args = harness.build_parser().parse_args(
        [
            "--model",
            str(quant_model_dir),
            "--task",
            "agent",
            "--methods",
            "full",
            "--n",
            "1",
            "--length",
            "300",
            "--max-new-tokens",
            "4",
            "--kv-quant",
            "int4,none,triaxial",
            "--kv-bits",
            "2.0,4.0",
            "--fidelity",
            "--accuracy",
            "teacher",
            "--out",
            str(out),
        ]
    )
    return harness.run(args), out


def test_harness_kv_quant_axis_and_columns(quant_run, quant_model_dir, tmp_path):
    rows, out = quant_run
    assert [(r["kv_quant"], r["kv_bits"]) for r in rows] == [("int4", "-"), ("none", "-"), ("triaxial", 2.0), ("triaxial", 4.0)]
    by = {(r["kv_quant"], r["kv_bits"]): r for r in rows}
    assert by[("none", "-")]["avg_bits"] == 16.0 and by[("int4", "-")]["avg_bits"] == 4.0
    assert by[("triaxial", 4.0)]["avg_bits"] == 4.0 < by[("none", "-")]["avg_bits"]
    assert 2.0 <= by[("triaxial", 2.0)]["avg_bits"] < 4.0
    # bytes per token: bf16 4D, INT4 1.25D per layer and KV head (scales and zero points included)
    assert by[("none", "-")]["kv_bytes_per_token"] == 2 * 1 * 4 * 32
    assert by[("int4", "-")]["kv_bytes_per_token"] == 2 * 1 * 1.25 * 32
    # stored bits count the scales and zero points (8 * bytes / elements): INT4 5, bf16 16, INT2 pages 3
    assert by[("none", "-")]["stored_bits"] == 16.0 and by[("int4", "-")]["stored_bits"] == 5.0
    assert 3.0 <= by[("triaxial", 2.0)]["stored_bits"] < 5.0 == by[("triaxial", 4.0)]["stored_bits"]
    assert harness.stored_bits_of({**by[("int4", "-")], "stored_bits": "-"}, by[("none", "-")]) == 5.0  # older journals
    with open(out / "results.csv") as f:
        assert tuple(csv.DictReader(f).fieldnames) == harness.COLUMNS
    assert "## agent: KV precision" in (out / "results.md").read_text()
    assert (out / "accuracy_vs_kv_bits.png").stat().st_size > 0
    with pytest.raises(ValueError):
        harness.run(harness.build_parser().parse_args(["--model", str(quant_model_dir), "--out", str(tmp_path), "--kv-quant", "int3"]))


def test_fidelity_of_a_quantized_pool_counts_every_reply_against_the_float_pool(quant_run):
    """With --kv-quant, only the full cache on the float pool writes the references
    (it runs first, though named after int4); a quantized full cell compares every
    recorded reply (its KV is quantized from the first prefill on, no compression event
    needed), and the KV-precision table gives its NLL increase with a paired interval."""
    rows, out = quant_run
    by = {r["kv_quant"]: r for r in rows if r["kv_quant"] != "triaxial"}
    assert by["none"]["nll_increase"] == "-" and by["int4"]["completion"] == 1.0
    (ex,) = harness.make_examples("agent", 1, 300)
    assert [p.name for p in (out / "fidelity").iterdir()] == [f"agent-{ex.seed}.npz"]  # the float pool's cell alone
    replies = int(np.load(out / "fidelity" / f"agent-{ex.seed}.npz")["nll"].size)
    assert replies > 0 and by["int4"]["fidelity_tokens"] == replies  # every reply token of the trace
    assert by["int4"]["nll_increase"] != 0 and by["int4"]["kl"] > 0
    d = harness.quant_nll_increase(by["int4"])
    assert d[0] == pytest.approx(by["int4"]["nll_increase"]) and d[1] <= d[0] <= d[2]
    assert harness.quant_nll_increase(by["none"]) is None
    assert "NLL increase [95% CI] | KL per token |" in (out / "results.md").read_text()


def test_binned_kl_is_the_exact_kl_with_every_token_and_a_lower_bound_with_fewer():
    import numpy as np

    from train.haystack_measure import log_softmax

    rng = np.random.default_rng(0)
    full, managed = (log_softmax(rng.normal(size=(5, 40)) * 2).astype(np.float32) for _ in range(2))
    exact = (np.exp(full) * (full - managed)).sum(-1)
    np.testing.assert_allclose(replay.binned_kl(replay.binned_reference(full, top=40), managed), exact, rtol=1e-5, atol=1e-7)
    coarse = replay.binned_kl(replay.binned_reference(full, top=4), managed)
    assert (coarse <= exact + 1e-9).all() and (coarse > 0).all()


def test_fidelity_compares_each_cell_with_the_full_cache_after_its_events(task_model_dir, tmp_path):
    """--fidelity: the full cell runs first and writes its references; a compressing
    cell reports the NLL increase and KL on the turns after its first event."""
    out = tmp_path / "fid"
    args = harness.build_parser().parse_args(
        [
            "--model",
            str(task_model_dir),
            "--task",
            "agent",
            "--methods",
            "snapkv,full",
            "--budgets",
            "150,100000",
            "--layouts",
            "dead_slot",
            "--n",
            "1",
            "--length",
            "600",
            "--max-new-tokens",
            "4",
            "--fidelity",
            "--out",
            str(out),
        ]
    )
    rows = harness.run(args)
    by = {(r["method"], r["budget"]): r for r in rows}
    assert by[("full", "-")]["nll_increase"] == "-" and sorted(p.name for p in (out / "fidelity").iterdir())
    small = by[("snapkv", 150)]
    assert small["fidelity_tokens"] > 0 and small["kl"] > 0 and small["nll_increase"] != 0
    assert by[("snapkv", 100000)]["fidelity_tokens"] == 0  # a budget above the trace never compresses: nothing to compare
    assert "## agent: fidelity against the best baseline" in (out / "results.md").read_text()
    with pytest.raises(ValueError, match="add full"):
        harness.run(
            harness.build_parser().parse_args(
                ["--model", str(task_model_dir), "--methods", "snapkv", "--fidelity", "--out", str(tmp_path / "x"), "--n", "1"]
            )
        )


def test_fractional_budgets_are_a_share_of_each_examples_rendered_length(task_model_dir, tmp_path):
    import jaxkv
    from jaxkv.chat import render

    assert harness.parse_budgets("0.5,0.65,700") == [0.5, 0.65, 700]
    for bad in ("1.5", "0", "0.0", "-3", "half", ""):
        with pytest.raises(ValueError):
            harness.parse_budgets(bad)
    model = jaxkv.load_model(task_model_dir)
    examples = harness.make_examples("mqniah", 2, 600) + harness.make_examples("mqniah", 1, 900)
    for ex in examples:
        last = max(t.message_index for t in ex.targets)
        n = render(model.tokenizer, ex.messages[: last + 1], ex.tools or None, add_generation_prompt=False).ids.size
        assert replay.session_budget(0.5, model.tokenizer, ex, last) == round(0.5 * n)
        assert replay.session_budget(300, model.tokenizer, ex, last) == 300
    # a grid with a fractional budget: test_teacher_forced_accuracy_... runs one
    with pytest.raises(ValueError, match="fractions"):
        harness.run(
            harness.build_parser().parse_args(
                ["--model", str(task_model_dir), "--out", str(tmp_path / "r2"), "--budgets", "0.5", "--repair-ks", "16"]
            )
        )


def test_fidelity_differences_are_paired_over_examples_against_the_lowest_baseline():
    """The table's reference is the baseline with the lowest NLL increase; a method
    whose every example loses less than it gets a negative difference with its whole
    interval below zero; the reference against itself differs by exactly zero."""

    def row(method, dnll):
        fid = [{"tokens": 10, "dnll": d, "kl": abs(d)} for d in dnll]
        return {
            "method": method,
            "task": "agent",
            "layout": "dead_slot",
            "budget": 0.5,
            "repair_policy": "none",
            "reuse": "-",
            "accuracy": 0.5,
            "fidelity_tokens": 10 * len(dnll),
            "nll_increase": sum(dnll) / (10 * len(dnll)),
            "kl": sum(map(abs, dnll)) / (10 * len(dnll)),
            replay.PER_EXAMPLE: {"fidelity": fid},
        }

    snap, h2o = row("snapkv", [1.0, 2.0, 3.0, 4.0]), row("h2o", [2.0, 3.0, 5.0, 6.0])
    head = row("intentkv", [0.5, 1.5, 2.0, 3.5])
    diff, low, high = harness.paired_nll_difference(head[replay.PER_EXAMPLE]["fidelity"], snap[replay.PER_EXAMPLE]["fidelity"])
    assert diff == pytest.approx((7.5 - 10.0) / 40) and low <= diff <= high < 0
    assert harness.paired_nll_difference(snap[replay.PER_EXAMPLE]["fidelity"], snap[replay.PER_EXAMPLE]["fidelity"]) == (0.0, 0.0, 0.0)
    md = harness.fidelity_comparison_markdown([h2o, head, snap], "agent")
    assert "best baseline snapkv (+0.2500)" in md
    lines = [x for x in md.splitlines() if x.startswith(("| intentkv", "| h2o"))]
    assert lines[0].startswith("| intentkv | +0.1875") and lines[1].startswith("| h2o | +0.4000 | 0.4000 | +0.1500")
    # the verdicts: without its rule in the column only the goal, here met
    assert "- Goal: the head minus the best baseline (`snapkv`): -0.0625" in md and "met (lowest" in md
    assert "- Minimum: `intentkv_memory` is not in this column yet." in md
    rule = row("intentkv_memory", [0.4, 1.4, 1.9, 3.4])  # better on every example: the best baseline now
    md = harness.fidelity_comparison_markdown([h2o, head, snap, rule], "agent")
    assert "- Minimum: the head minus `intentkv_memory`: +0.0100" in md and "loses to its rule" in md
    assert "best baseline (`intentkv_memory`)" in md and "not met (not the lowest NLL increase)" in md
    worse = row("intentkv_memory", [0.6, 1.6, 2.1, 3.6])
    assert "the head beats its rule" in harness.fidelity_comparison_markdown([h2o, head, snap, worse], "agent")


def test_teacher_forced_accuracy_counts_a_turn_only_when_every_reply_token_is_the_argmax(task_model_dir, tmp_path):
    """--accuracy teacher decodes nothing; a turn counts when every recorded reply
    token is the argmax of its teacher-forced row (the prompt's last row predicts
    the first reply token, each reply row the next)."""
    import types

    rng = np.random.default_rng(0)
    prompt_logits, target_logits = rng.normal(size=(3, 11)), rng.normal(size=(4, 11))
    rows = np.concatenate([prompt_logits[-1:], target_logits[:-1]])
    turn = types.SimpleNamespace(prompt_logits=prompt_logits, target_logits=target_logits, target_ids=rows.argmax(-1))
    assert replay.teacher_forced_match(turn)
    for i in range(4):
        wrong = rows.argmax(-1).copy()
        wrong[i] = (wrong[i] + 1) % 11
        assert not replay.teacher_forced_match(
            types.SimpleNamespace(prompt_logits=prompt_logits, target_logits=target_logits, target_ids=wrong)
        )
    assert not replay.teacher_forced_match(types.SimpleNamespace(prompt_logits=None, target_logits=None, target_ids=None))

    import jaxkv

    model = jaxkv.load_model(task_model_dir)
    ex = harness.make_examples("agent", 1, 600)[0]
    cell = replay.Cell("snapkv", 150, "dead_slot", "agent")
    verdicts, done, _, session = replay.replay_example(model, ex, cell, max_new_tokens=8, max_positions=2048, accuracy="teacher")
    assert done and verdicts == [False] * len(ex.targets)  # a random model reproduces no recorded reply
    assert session.compressions and all(m.decode_steps == 0 for m in session.metrics.requests)  # nothing decoded
    session.close()
    args = harness.build_parser().parse_args(
        [
            "--model",
            str(task_model_dir),
            "--task",
            "agent",
            "--methods",
            "full,snapkv",
            "--budgets",
            "0.5",
            "--layouts",
            "dead_slot",
            "--n",
            "1",
            "--length",
            "600",
            "--accuracy",
            "teacher",
            "--out",
            str(tmp_path / "t"),
        ]
    )
    rows = {r["method"]: r for r in harness.run(args)}
    assert all(r["accuracy"] == 0.0 and r["completion"] == 1.0 for r in rows.values())
    assert rows["snapkv"]["budget"] == 0.5  # a fraction of each example's length
    assert rows["snapkv"]["peak_live_kv"] < rows["full"]["peak_live_kv"]
    assert "accuracy by teacher forcing" in (tmp_path / "t" / "results.md").read_text()
