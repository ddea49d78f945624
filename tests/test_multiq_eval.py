"""The multi-question task in jaxkv's real-model grid (``eval.quality.real_model``).

A cell answers every question from its one compressed cache, and between questions
the conversation goes on with the *reference* answers, whatever the greedy reply
was: the full cache's teacher-forced scores of every question are the dense model's
over the whole reference conversation (``jaxkv.score_logits``). A random model
replies wrongly, so every question takes the decode-then-restore path. RepairKV's
trio, as real sessions, compresses once too and repairs at every question. Then
the report's per-question table reads the cell records. A tiny random model with
SmolLM2's tokenizer and chat template; no weights.
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxkv
from eval.quality import real_model as R
from train import haystack_measure
from eval.quality import real_model_report as report
from jaxkv.tasks import multiq, real


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer):
    import dataclasses

    from tests.conftest import tiny_qwen3_config

    tok = smollm2_tokenizer
    cfg = dataclasses.replace(tiny_qwen3_config(tok), max_position_embeddings=2048)
    return jaxkv.model_from_config(cfg, seed=0, tokenizer=tok)


def test_every_question_is_scored_on_the_reference_history(tiny):
    tok = tiny.tokenizer
    (ex,) = multiq.examples(1, length=384, tokenizer=tok, questions=4)
    record = R.run_example(tiny, ex, "agnostic", [R.Cell(None), R.Cell("snapkv", 0.5)], positions=R.positions_for(384), max_new=8)
    plans = real.plans(ex, tok, "agnostic")
    ids = np.concatenate([plans[-1].compressed, plans[-1].rest, plans[-1].answer])
    logp = haystack_measure.log_softmax(np.asarray(jaxkv.score_logits(tiny, ids[None]))[0])
    full = record["cells"]["full"]
    assert len(full["questions"]) == 4 and [q["kind"] for q in full["questions"]] == list(ex.labels["kinds"])
    for plan, view, q in zip(plans, ex.views(), full["questions"]):
        start = plan.compressed.size + plan.rest.size  # the answer's first token; row start - 1 predicts it
        digits = jaxkv.tasks.answer_digit_positions(view, tok, plan.answer)
        nll = -logp[start - 1 + digits, plan.answer[digits]].mean()
        assert q["answer_nll"] == pytest.approx(nll, abs=2e-3)
        assert q["decoded"] > 0  # a random model's reply: greedy decoded, then the reference put back
    assert full["tf_correct"] == np.mean([q["tf_correct"] for q in full["questions"]])
    assert record["cells"]["snapkv@0.5"]["kept"] == R.budget_for_ratio(0.5, record["n_request"])


def test_a_multiq_session_compresses_once_and_repairs_at_every_question(tiny):
    """RepairKV's trio as sessions (``run_sessions``): on multiq one event, after the
    context, however many questions follow, and RepairKV promotes at each question's
    turn; a one-question task keeps the budget on its question's turn (two events)."""
    tok = tiny.tokenizer
    (ex,) = multiq.examples(1, length=384, tokenizer=tok, questions=4)
    trio = R.trio_of_kinds(R.session_cells("snapkv", 0.5, 8), "session,repairkv")
    cells = R.run_sessions(tiny, ex, trio, 0.5, positions=R.positions_for(384), max_new=4)["cells"]
    assert [c["events"] for c in cells.values()] == [1, 1]
    assert cells["repairkv8:snapkv@0.5"]["repaired"] == 4 * 8  # K at each of the 4 questions' turns
    (single,) = real.examples("passkey", 1, length=384, tokenizer=tok)
    cells = R.run_sessions(tiny, single, trio[:1], 0.5, positions=R.positions_for(384), max_new=4)["cells"]
    assert cells["session:snapkv@0.5"]["events"] == 2  # the context's, then the question's turn's


def test_the_report_has_a_column_per_question_and_per_kind():
    qs = lambda *ok: [{"tf_correct": o, "kind": k} for o, k in zip(ok, ("passkey", "number", "pair"))]
    cells = {
        "full": {1: {"questions": qs(1, 1, 1)}, 2: {"questions": qs(1, 0, 1)}},
        "snapkv@0.5": {1: {"questions": qs(0, 1, 0)}, 2: {"questions": qs(1, 1, 0)}},
    }
    lines = report.question_table({"jaxkv": cells})
    assert lines[2].split("|")[1:-1] == [f" {c} " for c in ("side", "cell", "n", "Q1", "Q2", "Q3", "number", "pair", "passkey")]
    assert lines[4] == "| jaxkv | full | 2 | 100 | 50 | 100 | 50 | 100 | 100 |"
    assert lines[5] == "| jaxkv | snapkv@0.5 | 2 | 50 | 100 | 0 | 100 | 0 | 50 |"
