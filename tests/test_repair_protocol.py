"""The RepairKV matched-budget protocol driver on a tiny random model: the grid of
cells and budgets, the outputs, forked turn-1 sharing equal to fresh replays, the
resumable journal, the paired bootstrap, calibration's choice of B_base, and its
refusal when the model fails with the full cache."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from eval.quality import repair_protocol as rp


# 480-token documents: a run's max_positions (2 * 480 + 8 * 4 tokens, rounded up to
# 1024) is test_forked_cells_equal_fresh_replays's, so the tests share their programs.
def _args(task_model_dir, out, *extra):
    return rp.build_parser().parse_args(
        [
            "--model",
            str(task_model_dir),
            "--needles",
            "4",
            "--n",
            "1",
            "--length",
            "480",
            "--max-new-tokens",
            "4",
            "--out",
            str(out),
            *extra,
        ]
    )


def test_grid_cells_budgets_and_outputs(task_model_dir, tmp_path):
    out = tmp_path / "grid"
    rows = rp.run(_args(task_model_dir, out, "--base-budget", "200", "--ks", "8,16", "--policies", "repairkv,random"))
    cells = [(r["cell"], r["repair_k"], r["budget"]) for r in rows]
    assert cells == [
        ("full", 0, "-"),
        ("none", 0, 200),
        ("matched", 8, 208),
        ("repairkv", 8, 200),
        ("random", 8, 200),
        ("matched", 16, 216),
        ("repairkv", 16, 200),
        ("random", 16, 200),
    ]
    assert all(r["base_budget"] == 200 and 0.0 <= r["accuracy"] <= 1.0 for r in rows)
    with open(out / "results.csv") as f:
        assert tuple(csv.DictReader(f).fieldnames) == rp.FIELDS
    assert "| K | repairkv | matched no-repair | random | REPAIRKV − matched [95% CI] |" in (out / "results.md").read_text()
    assert (out / "repair_vs_k.png").stat().st_size > 0 and (out / "figure2.png").stat().st_size > 0
    repaired = [r for r in rows if r["cell"] in ("repairkv", "random")]
    assert all(r["gain_ci_low"] <= r["gain_vs_matched"] <= r["gain_ci_high"] for r in repaired)


def test_forked_cells_equal_fresh_replays(task_model_dir, monkeypatch):
    """Every repair cell of ``example_verdicts`` (turn 1 once, then a fork per
    (policy, K)) generates what a fresh session for that cell generates."""
    import jaxkv
    from jaxkv.tasks import mqniah
    from train import replay

    reply = lambda target, generated: generated.get("content")  # noqa: E731  (compare replies, not verdicts)
    monkeypatch.setattr(rp, "reply_matches", reply)
    monkeypatch.setattr(replay, "reply_matches", reply)
    model = jaxkv.load_model(str(task_model_dir))
    examples = mqniah(2, rp.PROTOCOL_SEED, needles=4, length=480)
    setup = dict(first_stage="snapkv", base_budget=120, ks=[8, 40], policies=list(rp.REPAIR_POLICIES), max_new_tokens=6, max_positions=1024)
    donor = rp.turn2_signal(model, examples[1], setup)
    record = rp.example_verdicts(model, examples[0], setup, donor)
    assert record["signal"] is not None and not record["incomplete"]
    assert set(record["verdicts"]) == set(rp.cell_names(setup["ks"], setup["policies"]))
    for k in setup["ks"]:
        for policy in setup["policies"]:
            cell = replay.Cell("snapkv", 120, "dead_slot", "mqniah", policy, k, 120)
            fresh, done, _, session = replay.replay_example(
                model,
                examples[0],
                cell,
                max_new_tokens=6,
                max_positions=1024,
                protect_query=False,
                repair_wrong_signal=donor if policy == "wrongq" else None,
            )
            assert done and record["verdicts"][f"{policy}@{k}"] == fresh, (policy, k)
            assert session.repairs[1].candidates > 0  # the first event compressed the document
    assert all(isinstance(v, str) for v in record["verdicts"]["repairkv@8"])


def test_resume_skips_journaled_examples(task_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "resume"
    first = rp.run(_args(task_model_dir, out, "--n", "3", "--chunk", "2", "--base-budget", "200", "--ks", "8", "--policies", "repairkv"))
    lines = (out / "examples.jsonl").read_text().splitlines()
    assert len(lines) == 3

    def boom(*a, **k):
        raise AssertionError("a journaled example was replayed")

    monkeypatch.setattr(rp, "example_verdicts", boom)
    again = rp.run(_args(task_model_dir, out, "--n", "3", "--base-budget", "200", "--ks", "8", "--policies", "repairkv", "--resume"))
    assert again == first and len((out / "examples.jsonl").read_text().splitlines()) == 3
    assert rp.run(_args(task_model_dir, out, "--report-only")) == first
    with pytest.raises(rp.ProtocolError, match="no journal"):
        rp.run(_args(task_model_dir, tmp_path / "empty", "--report-only"))
    # another setup (a different B_base) is not served from the journal
    with pytest.raises(AssertionError, match="journaled"):
        rp.run(_args(task_model_dir, out, "--n", "3", "--base-budget", "210", "--ks", "8", "--policies", "repairkv", "--resume"))


def test_paired_gain_and_chunking():
    gain, low, high = rp.paired_gain([1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1])
    assert (gain, low, high) == (1.0, 1.0, 1.0)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 2, 200), rng.integers(0, 2, 200)
    gain, low, high = rp.paired_gain(a, b, np.ones(200))
    assert gain == pytest.approx((a.sum() - b.sum()) / 200) and low < gain < high and high - low < 0.3
    assert rp._runs([0, 1, 2, 3, 4, 7, 8, 10], 2) == [[0, 1], [2, 3], [4], [7, 8], [10]]


def test_five_turn_schedule_runs(task_model_dir, tmp_path):
    rows = rp.run(_args(task_model_dir, tmp_path / "five", "--turns", "5", "--base-budget", "200", "--ks", "8", "--policies", "repairkv"))
    assert {r["turns"] for r in rows} == {5}


def test_calibration_refuses_a_model_that_fails_with_the_full_cache(task_model_dir, tmp_path):
    with pytest.raises(rp.ProtocolError, match="full-cache accuracy"):
        rp.run(_args(task_model_dir, tmp_path / "cal", "--ks", "8", "--policies", "repairkv"))
    assert (
        rp.main(
            [
                "--model",
                str(task_model_dir),
                "--needles",
                "4",
                "--n",
                "1",
                "--length",
                "480",
                "--max-new-tokens",
                "4",
                "--ks",
                "8",
                "--out",
                str(tmp_path / "cal2"),
            ]
        )
        == 2
    )


def test_calibration_picks_the_budget_whose_matched_accuracy_is_nearest_half_of_full(monkeypatch):
    accuracy = {100: 0.05, 200: 0.3, 400: 0.55, 800: 0.9}  # no repair at B + 96
    monkeypatch.setattr(rp, "score", lambda model, examples, cell, **kw: {"accuracy": accuracy[cell.budget - 96]})
    base, tried = rp.calibrate(None, [], "snapkv", sorted(accuracy), full_accuracy=1.0, min_full=0.5)
    assert base == 400 and tried == sorted(accuracy.items())


def test_bad_arguments_are_rejected(task_model_dir, tmp_path):
    with pytest.raises(ValueError, match="policies"):
        rp.run(_args(task_model_dir, tmp_path / "bad", "--policies", "nope"))
    with pytest.raises(ValueError, match="positive"):
        rp.run(_args(task_model_dir, tmp_path / "bad", "--ks", "0"))
