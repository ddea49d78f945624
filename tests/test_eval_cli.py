"""``jaxkv eval --task T --n 1`` runs for every task T, through the command line.

The command is found the way the ``jaxkv`` script finds it: the ``jaxkv.commands``
entry point, here read from ``pyproject.toml`` (the declaration, not a possibly stale
install's copy of it). Each synthetic task (``harness.TASKS``) runs on a tiny random
model with the task tokenizer; each real-model task (``real_model.REAL_TASKS``) on a
tiny random model with SmolLM2's tokenizer and chat template, which is all the
haystack examples need of the real one. The task lists are read from the modules,
so a new task is a new case here. One case runs the real SmolLM2, by name, with the
KV format that once crashed this path (``--kv-quant triaxial``: its shipped
calibration)."""

from __future__ import annotations

import csv
import json
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from eval.quality import harness, real_model
from jaxkv import cli
from jaxkv.errors import ConfigError
from tests.conftest import tiny_qwen3_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def jaxkv_eval(monkeypatch):
    """``jaxkv_eval(*argv) -> exit code`` of ``jaxkv eval ARGV``, the plugin loaded
    from the entry point ``pyproject.toml`` declares."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][cli.PLUGIN_GROUP]
    monkeypatch.setattr(cli, "_plugins", lambda: {n: EntryPoint(n, v, cli.PLUGIN_GROUP) for n, v in declared.items()})
    return lambda *argv: cli.main(["eval", *map(str, argv)])


@pytest.fixture(scope="module")
def smollm2_tokenizer_model_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Qwen3 (head_dim 32: quantizable) with SmolLM2's tokenizer, saved once."""
    import jaxkv

    tok = smollm2_tokenizer
    cfg = tiny_qwen3_config(tok)
    folder = tmp_path_factory.mktemp("smollm2_tokenizer_model")
    jaxkv.save_pretrained(jaxkv.model_from_config(cfg, seed=0, tokenizer=tok), folder)
    return folder


def journal(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("task", harness.TASKS)
def test_every_synthetic_task_runs_from_the_command_line(task, task_model_dir, tmp_path, jaxkv_eval):
    out = tmp_path / task
    assert (
        jaxkv_eval(
            "--model",
            task_model_dir,
            "--task",
            task,
            "--n",
            1,
            "--methods",
            "full,snapkv",
            "--budgets",
            256,
            "--layouts",
            "dead_slot",
            "--length",
            600,
            "--max-new-tokens",
            4,
            "--out",
            out,
        )
        == 0
    )
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["method"] for r in rows) == ["full", "snapkv"] and {r["task"] for r in rows} == {task}
    assert f"## {task}: accuracy" in (out / "results.md").read_text()


@pytest.mark.parametrize("task", real_model.REAL_TASKS)
def test_every_real_model_task_runs_from_the_command_line(task, smollm2_tokenizer_model_dir, tmp_path, jaxkv_eval, capsys):
    """The run ends with its table: printed, and in ``results.md`` / ``results.csv``
    (and the accuracy plot, for a retrieval task) beside the journal."""
    context = 384 if task == "multiq" else 256  # six facts and their distractors need room
    short = ("--max-new-tokens", 8) if task == "multiq" else ()  # six greedy replies per cell
    assert (
        jaxkv_eval(
            "--model",
            smollm2_tokenizer_model_dir,
            "--task",
            task,
            "--n",
            1,
            "--context",
            context,
            "--methods",
            "snapkv",
            "--ratios",
            0.5,
            "--settings",
            "agnostic",
            "--out",
            tmp_path,
            *short,
        )
        == 0
    )
    (record,) = journal(tmp_path / "examples.jsonl")
    assert record["task"] == task or (task == "niah" and record["task"].startswith("niah_"))  # niah: the variants in turn
    assert record["setting"] == "agnostic" and record["context"] == context
    assert set(record["cells"]) == {"full", "snapkv@0.5"}
    assert record["setup"]["model"] == str(smollm2_tokenizer_model_dir)
    printed = capsys.readouterr().out
    assert f"wrote {tmp_path / 'examples.jsonl'}" in printed
    heading = f"## {record['task']}, {context} tokens, question-agnostic"
    md = (tmp_path / "results.md").read_text()
    assert heading in md and heading in printed and "## The full cache (the ceiling)" in md
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["method"], float(r["ratio"])) for r in rows} == {("full", 0.0), ("snapkv", 0.5)}
    assert {r["task"] for r in rows} == {record["task"]} and {r["setting"] for r in rows} == {"agnostic"}
    assert ("nll_increase" if task == "lm" else "tf_acc") in rows[0]
    assert (tmp_path / "accuracy_vs_ratio.png").is_file() == (task != "lm")
    if task == "multiq":
        questions = record["cells"]["snapkv@0.5"]["questions"]
        assert len(questions) >= 4 and all(q["kind"] in ("number", "passkey", "pair") for q in questions)
        assert "Per question" in md


def test_a_real_model_task_with_kv_formats_writes_the_quant_journal(smollm2_tokenizer_model_dir, tmp_path, jaxkv_eval):
    """``--kv-quant`` (the harness's modes, ``none`` dropped) runs the full cache on
    the float pool and on each format: the run that crashed with ``'Namespace' object
    has no attribute 'journal'``."""
    assert (
        jaxkv_eval(
            "--model",
            smollm2_tokenizer_model_dir,
            "--task",
            "passkey",
            "--n",
            1,
            "--context",
            256,
            "--methods",
            "full",
            "--kv-quant",
            "none,int4",
            "--settings",
            "agnostic",
            "--out",
            tmp_path,
        )
        == 0
    )
    (record,) = journal(tmp_path / "quant.jsonl")
    assert list(record["cells"]) == ["full", "kv:int4"] and record["setup"]["kv_quant"] == ["int4"]
    assert not (tmp_path / "examples.jsonl").exists()
    assert "passkey, 256 tokens, agnostic" in (tmp_path / "results.md").read_text()
    with open(tmp_path / "results.csv") as f:
        assert [r["kv_format"] for r in csv.DictReader(f)] == ["none (float)", "int4"]
    assert (tmp_path / "quality_vs_bits.png").is_file()


def test_a_repair_run_uses_the_method_and_ratio_it_names(smollm2_tokenizer_model_dir, tmp_path, jaxkv_eval):
    """``--repair-ks K`` with one ``--methods`` and one ``--ratios`` runs RepairKV's trio
    for that method at that ratio (it ran snapkv at 0.5 whatever was named), and the
    report has its cells."""
    assert (
        jaxkv_eval(
            "--model",
            smollm2_tokenizer_model_dir,
            "--task",
            "passkey",
            "--n",
            1,
            "--context",
            256,
            "--methods",
            "keydiff",
            "--ratios",
            0.25,
            "--repair-ks",
            8,
            "--out",
            tmp_path,
        )
        == 0
    )
    (record,) = journal(tmp_path / "sessions.jsonl")
    assert set(record["cells"]) == {"session:keydiff@0.25", "repairkv8:keydiff@0.25", "matched8:keydiff@0.25"}
    assert "repairkv8:keydiff" in (tmp_path / "results.md").read_text()


def test_real_model_tasks_refuse_what_they_cannot_use(smollm2_tokenizer_model_dir, tmp_path, jaxkv_eval, capsys):
    base = ("--model", smollm2_tokenizer_model_dir, "--n", 1, "--out", tmp_path)
    for argv, message in (
        (("--task", "passkey", "--layouts", "compact"), "--layouts"),
        (("--task", "passkey,agent"), "runs alone"),
        (("--task", "passkey", "--repair-ks", "8,16"), "one repair budget"),
        (("--task", "passkey", "--repair-ks", "8", "--methods", "snapkv,tova"), "one method at one ratio"),
        (("--task", "passkey", "--kv-quant", "int3"), "unknown kv_quant"),
    ):
        assert jaxkv_eval(*base, *argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    with pytest.raises(ConfigError, match="pretrained"):
        harness.main(["--model", "embedded", "--task", "lm", "--n", "1", "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())  # nothing ran


@pytest.mark.slow
def test_the_reported_command_runs_on_smollm2_by_name(smollm2_gguf, tmp_path, jaxkv_eval):
    """Issue #62's command, shortened (``--n 1``, a 256-token request, one setting):
    SmolLM2 by name, its shipped TriAxialKV calibration."""
    assert (
        jaxkv_eval(
            "--model",
            "smollm2-135m-instruct",
            "--task",
            "passkey",
            "--methods",
            "full",
            "--kv-quant",
            "triaxial",
            "--n",
            1,
            "--context",
            256,
            "--settings",
            "agnostic",
            "--out",
            tmp_path,
        )
        == 0
    )
    (record,) = journal(tmp_path / "quant.jsonl")
    assert list(record["cells"]) == ["full", "kv:triaxial"]
    assert record["cells"]["kv:triaxial"]["kv"]["int2"] + record["cells"]["kv:triaxial"]["kv"]["int4"] > 0
