"""The shipped embedded agent model: its files load, it solves held-out generated tasks
at the evaluation length through jaxkv's engine, transformers (torch) continues the
same prompts the same way, and the demo runs on it."""

from __future__ import annotations

import json

import pytest

from jaxkv.models.loading import EMBEDDED_DIR

pytestmark = pytest.mark.skipif(not (EMBEDDED_DIR / "config.json").is_file(), reason="embedded model not installed")

EVAL_LENGTH = 2048  # the evaluation length (longest request per example >= this)


@pytest.fixture(scope="module")
def model():
    import jaxkv

    return jaxkv.load_model("embedded")


def test_shipped_files_are_complete_and_small():
    names = {p.name for p in EMBEDDED_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"} <= names
    assert sum(p.stat().st_size for p in EMBEDDED_DIR.iterdir()) < 25 * 2**20
    cfg = json.loads((EMBEDDED_DIR / "config.json").read_text())
    assert cfg["model_type"] == "qwen3"


def test_reaches_80_percent_on_12_heldout_examples(model):
    """6 MQ-NIAH (4 needles, both turns: 12 scored turns) + 6 agent traces, full cache,
    >= 2,048 tokens: a regression guard (eval/quality/embedded_accuracy.py measures 200 per task)."""
    from eval.quality.embedded_accuracy import evaluate

    rows, request_tokens, _ = evaluate(model, n=6, length=EVAL_LENGTH, batch=6, verbose=False)
    overall = {r["task"]: r["acc"] for r in rows if r["scored"] == "all scored turns"}
    assert all(peak_min >= EVAL_LENGTH for _, peak_min, _ in request_tokens.values()), request_tokens
    assert len(overall) == 2
    for task, acc in overall.items():
        assert acc >= 0.8, (task, acc, rows)


def test_transformers_gives_the_same_greedy_continuation():
    pytest.importorskip("torch")
    from eval.quality.embedded_parity import run_parity

    matches, n, details = run_parity("embedded", n=4, max_new_tokens=16, verbose=False)
    assert matches == n, [(plen, a, b) for plen, a, b in details if a != b]


def test_demo_runs_an_agent_session_on_the_embedded_model(capsys):
    from jaxkv.demo import run_demo

    assert run_demo(turns=2, seed=1, length=1024) == 0
    out = capsys.readouterr().out
    assert "task accuracy" in out and "prefix-hit rate" in out and "KV reads" in out
    assert "step 1:" in out and "turn 2:" in out  # an agent task and both needle turns ran
    assert "prompt tokens cached" in out
