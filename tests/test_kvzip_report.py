"""``eval.quality.kvzip_report``: issue #75's side-by-side at one ratio over journals of both sides.

Synthetic journals in the two sides' formats (jaxkv's one record per example and
setting; kvpress's ``settings: {setting: {cells}}``), older cells on more examples
than this round's: the report reads only the examples both full caches and both
KVzip cells ran, picks each side's best among the cells that ran all of them, and
its paired gains are the per-example differences' means.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from eval.quality import kvzip_report


def _write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _jx(seed, cells, task="passkey"):
    return {"task": task, "context": 2048, "setting": "agnostic", "seed": seed, "cells": cells}


def _kp(seed, cells, task="passkey"):
    return {"task": task, "example_task": task, "context": 2048, "seed": seed, "settings": {"agnostic": {"cells": cells}}}


def _cell(ok, **extra):
    return {"tf_correct": bool(ok), "gen_correct": bool(ok), "answer_nll": 0.1, "seconds": 1.0, **extra}


def test_report_reads_this_rounds_examples_and_pairs_best_against_best(tmp_path):
    old, new = list(range(10)), list(range(4))  # older cells ran 10 examples, KVzip 4
    jx_kvzip = [1, 1, 1, 0]
    kp_kvzip = [1, 0, 0, 0]
    snap = [0, 1, 0, 1, 1, 1, 1, 1, 1, 1]
    _write(tmp_path / "jx_old" / "examples.jsonl", [_jx(s, {"full": _cell(1), "snapkv@0.5": _cell(snap[s])}) for s in old])
    _write(tmp_path / "jx_new" / "examples_x.jsonl", [_jx(s, {"kvzip@0.5": _cell(jx_kvzip[s], scoring_tokens=2000)}) for s in new])
    _write(tmp_path / "kp_old" / "examples.jsonl", [_kp(s, {"full": _cell(1), "SnapKVPress@0.5": _cell(0)}) for s in old])
    _write(
        tmp_path / "kp_new" / "examples_x.jsonl",
        [_kp(s, {"full": _cell(1), "KVzipPress@0.5": _cell(kp_kvzip[s]), "CURPress@0.5": _cell(1)}) for s in new[:1]]
        + [_kp(s, {"full": _cell(1), "KVzipPress@0.5": _cell(kp_kvzip[s])}) for s in new[1:]],
    )
    text, rows = kvzip_report.report(
        [tmp_path / "jx_old", tmp_path / "jx_new"], [tmp_path / "kp_old", tmp_path / "kp_new"], 0.5, "agnostic"
    )
    by = {(r["side"], r["cell"]): r for r in rows}
    assert by[("jaxkv", "full")]["n"] == by[("jaxkv", "snapkv@0.5")]["n"] == by[("kvpress", "SnapKVPress@0.5")]["n"] == 4
    assert by[("kvpress", "CURPress@0.5")]["n"] == 1  # listed, but not eligible as the best (one example of four)
    assert "kvpress's best press here: KVzipPress@0.5" in text and "jaxkv's best branched cell: kvzip@0.5" in text
    assert by[("jaxkv", "kvzip@0.5")]["score"] == np.mean(jx_kvzip)
    assert by[("jaxkv", "kvzip@0.5")]["scoring_tokens"] == 2000
    assert np.isclose(by[("jaxkv", "kvzip@0.5")]["vs_kvpress_best"], np.mean(jx_kvzip) - np.mean(kp_kvzip))
    assert np.isclose(by[("jaxkv", "snapkv@0.5")]["vs_kvpress_best"], np.mean(snap[:4]) - np.mean(kp_kvzip))
    assert "- KVzip against KVzipPress (kvzip@0.5 − KVzipPress@0.5): +50 [" in text


def test_the_named_kvzip_cell_sets_the_examples_and_stands_against_kvzippress(tmp_path):
    # one-set kvzip ran 2 examples, kvzip/shared 6: with --kvzip-cell kvzip/shared the round is the 6
    shared, one_set, press = [1, 1, 0, 1, 1, 1], [0, 1], [1, 0, 0, 1, 0, 1, 1, 1]
    _write(
        tmp_path / "jx" / "examples.jsonl",
        [
            _jx(s, {"full": _cell(1), "kvzip/shared@0.5": _cell(shared[s])} | ({"kvzip@0.5": _cell(one_set[s])} if s < 2 else {}))
            for s in range(6)
        ],
    )
    _write(tmp_path / "kp" / "examples.jsonl", [_kp(s, {"full": _cell(1), "KVzipPress@0.5": _cell(press[s])}) for s in range(8)])
    text, rows = kvzip_report.report([tmp_path / "jx"], [tmp_path / "kp"], 0.5, kvzip_cell="kvzip/shared")
    by = {(r["side"], r["cell"]): r for r in rows}
    assert by[("jaxkv", "full")]["n"] == by[("kvpress", "KVzipPress@0.5")]["n"] == 6
    assert by[("jaxkv", "kvzip@0.5")]["n"] == 2  # listed on its own examples, not the best (2 of 6)
    assert "jaxkv's best branched cell: kvzip/shared@0.5" in text
    assert f"- KVzip against KVzipPress (kvzip/shared@0.5 − KVzipPress@0.5): +{100 * (np.mean(shared) - np.mean(press[:6])):.0f} [" in text
    default, _ = kvzip_report.report([tmp_path / "jx"], [tmp_path / "kp"], 0.5)  # one-set kvzip's 2 examples
    assert "2 examples both sides ran" in default


def test_lm_scores_are_nll_increases_over_each_sides_full_cache(tmp_path):
    _write(
        tmp_path / "jx" / "examples.jsonl",
        [_jx(s, {"full": {"nll": 2.0 + s, "kl": 0.0}, "kvzip@0.5": {"nll": 2.1 + s, "kl": 0.05}}, "lm") for s in range(3)],
    )
    _write(
        tmp_path / "kp" / "examples.jsonl",
        [_kp(s, {"full": {"nll": 2.5, "kl": 0.0}, "KVzipPress@0.5": {"nll": 2.7, "kl": 0.1}}, "lm") for s in range(3)],
    )
    text, rows = kvzip_report.report([tmp_path / "jx"], [tmp_path / "kp"], 0.5)
    by = {(r["side"], r["cell"]): r for r in rows}
    assert np.isclose(by[("jaxkv", "kvzip@0.5")]["score"], 0.1) and np.isclose(by[("kvpress", "KVzipPress@0.5")]["score"], 0.2)
    assert np.isclose(by[("jaxkv", "kvzip@0.5")]["vs_kvpress_best"], -0.1)  # lower is better: jaxkv ahead
    assert "NLL increase" in text


def test_a_repair_run_can_name_the_trios_cells_it_runs():
    from eval.quality import real_model

    trio = real_model.session_cells("kvzip", 0.5, 128)
    assert [c[0] for c in real_model.trio_of_kinds(trio, None)] == ["session:kvzip@0.5", "repairkv128:kvzip@0.5", "matched128:kvzip@0.5"]
    assert [c[0] for c in real_model.trio_of_kinds(trio, "repairkv")] == ["repairkv128:kvzip@0.5"]
    assert real_model.trio_of_kinds(trio, "repairkv")[0][1] == {"policy": "kvzip", "repair": 128}
    with pytest.raises(SystemExit, match="unknown"):
        real_model.trio_of_kinds(trio, "repair")
