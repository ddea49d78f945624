"""The RepairKV matched-budget protocol driver on a tiny random model: the grid of
cells and budgets, the outputs, calibration's choice of B_base, and its refusal
when the model fails with the full cache."""

from __future__ import annotations

import csv

import pytest

from eval import repair_protocol as rp


def _args(task_model_dir, out, *extra):
    return rp.build_parser().parse_args(["--model", str(task_model_dir), "--needles", "4", "--n", "1", "--length", "600",
                                         "--max-new-tokens", "4", "--out", str(out), *extra])


def test_grid_cells_budgets_and_outputs(task_model_dir, tmp_path):
    out = tmp_path / "grid"
    rows = rp.run(_args(task_model_dir, out, "--base-budget", "200", "--ks", "8,16", "--policies", "repairkv,random"))
    cells = [(r["cell"], r["repair_k"], r["budget"]) for r in rows]
    assert cells == [("full", 0, "-"), ("none", 0, 200),
                     ("matched", 8, 208), ("repairkv", 8, 200), ("random", 8, 200),
                     ("matched", 16, 216), ("repairkv", 16, 200), ("random", 16, 200)]
    assert all(r["base_budget"] == 200 and 0.0 <= r["accuracy"] <= 1.0 for r in rows)
    with open(out / "results.csv") as f:
        assert tuple(csv.DictReader(f).fieldnames) == rp.FIELDS
    assert "| K | repairkv | matched no-repair | random |" in (out / "results.md").read_text()
    assert (out / "repair_vs_k.png").stat().st_size > 0


def test_five_turn_schedule_runs(task_model_dir, tmp_path):
    rows = rp.run(_args(task_model_dir, tmp_path / "five", "--turns", "5", "--base-budget", "200", "--ks", "8",
                        "--policies", "repairkv"))
    assert {r["turns"] for r in rows} == {5}


def test_calibration_refuses_a_model_that_fails_with_the_full_cache(task_model_dir, tmp_path):
    with pytest.raises(rp.ProtocolError, match="full-cache accuracy"):
        rp.run(_args(task_model_dir, tmp_path / "cal", "--ks", "8", "--policies", "repairkv"))
    assert rp.main(["--model", str(task_model_dir), "--needles", "4", "--n", "1", "--length", "600",
                    "--max-new-tokens", "4", "--ks", "8", "--out", str(tmp_path / "cal2")]) == 2


def test_calibration_picks_the_budget_nearest_half_of_full(monkeypatch):
    accuracy = {100: 0.05, 200: 0.3, 400: 0.55, 800: 0.9}
    monkeypatch.setattr(rp, "score", lambda model, examples, cell, **kw: {"accuracy": accuracy[cell.budget]})
    base, tried = rp.calibrate(None, [], "snapkv", sorted(accuracy), full_accuracy=1.0, min_full=0.5)
    assert base == 400 and tried == sorted(accuracy.items())


def test_bad_arguments_are_rejected(task_model_dir, tmp_path):
    with pytest.raises(ValueError, match="policies"):
        rp.run(_args(task_model_dir, tmp_path / "bad", "--policies", "nope"))
    with pytest.raises(ValueError, match="positive"):
        rp.run(_args(task_model_dir, tmp_path / "bad", "--ks", "0"))
