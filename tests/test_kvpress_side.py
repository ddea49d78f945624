"""eval/quality/kvpress_side.py: the shared prefill equals kvpress's own path.

kvpress is not in the test extra (eval/quality/requirements-kvpress.txt installs it), so
these tests skip without it. With it, on SmolLM2-135M-Instruct and a short passkey
example: every press's compressed cache from the one shared prefill equals what
``with press(model): model(ids, past_key_values=cache)`` leaves (bit for bit), and
the answer logits fed after it agree to float tolerance with the same argmax, in
both settings; ObservedAttentionPress under eager attention too. Then one run of
the CLI writes a line and ``--resume`` skips it.
"""

from __future__ import annotations

import json

import pytest

from eval.quality import kvpress_side as K

pytestmark = pytest.mark.skipif(not K.kvpress_available(), reason="kvpress not installed (eval/quality/requirements-kvpress.txt)")

LENGTH = 320


@pytest.fixture(scope="module")
def setup(smollm2_gguf):
    import torch

    torch.set_num_threads(1)  # one per xdist worker (spinning OpenMP threads on shared cores crawl)
    K.import_kvpress()
    folder = K.model_folder(K.MODEL)
    tok = K.load_tokenizer(folder)
    example = K.eval_examples("passkey", 1, LENGTH, tok)[0]
    return folder, tok, example


@pytest.fixture(scope="module")
def model(setup):
    return K.load_hf(setup[0], "sdpa")


@pytest.mark.parametrize("setting,ratio", [("aware", 0.75), ("agnostic", 0.25)])
def test_shared_prefill_matches_kvpress_own_path(setup, model, setting, ratio):
    folder, tok, example = setup
    report = K.verify(model, tok, example, setting, ["SnapKVPress", "KnormPress", "RandomPress", "ExpectedAttentionPress"],
                      [ratio], max_new_tokens=8)
    for name, cell in report["cells"].items():
        assert cell["cache_equal"], (name, cell)
        assert cell["same_argmax"] and cell["answer_logits_max_abs_diff"] < 1e-4, (name, cell)
        assert cell["same_greedy"], (name, cell)
    assert report["ok"]


def test_observed_attention_under_eager(setup, model):
    """ObservedAttentionPress reads the attention weights: the prefill runs eager (the
    model's sdpa outside it), on both paths alike."""
    folder, tok, example = setup
    report = K.verify(model, tok, example, "agnostic", ["ObservedAttentionPress", "TOVAPress"], [0.5], max_new_tokens=8)
    assert report["ok"] and report["prefill_attention"] == "eager", report
    assert all(cell["cache_equal"] for cell in report["cells"].values())
    assert model.config._attn_implementation == "sdpa"


def test_hook_kwargs_shim():
    """transformers >= 5.3 passes ``cache`` and no ``cache_position``; the shim gives
    kvpress both, with cache_position = the new tokens' slots in the cache."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(torch.zeros(1, 3, 7, 4), torch.zeros(1, 3, 7, 4), 0)
    module = type("Attn", (), {"layer_idx": 0})()
    kw = K.kvpress_hook_kwargs(module, {"hidden_states": torch.zeros(1, 7, 8), "cache": cache})
    assert kw["past_key_values"] is cache and kw["cache_position"].tolist() == list(range(7))
    cache.update(torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2, 4), 0)
    kw = K.kvpress_hook_kwargs(module, {"hidden_states": torch.zeros(1, 2, 8), "cache": cache})
    assert kw["cache_position"].tolist() == [7, 8]


def test_cli_writes_and_resumes(setup, tmp_path, capsys):
    args = ["--task", "passkey", "--context", str(LENGTH), "--n", "1", "--presses", "StreamingLLMPress,KnormPress",
            "--ratios", "0.5", "--max-new-tokens", "4", "--threads", "1", "--out", str(tmp_path)]
    assert K.main(args) == 0
    lines = (tmp_path / "examples.jsonl").read_text().splitlines()
    rec = json.loads(lines[0])
    assert set(rec["settings"]) == {"aware", "agnostic"}
    cells = rec["settings"]["agnostic"]["cells"]
    assert set(cells) == {"full", "StreamingLLMPress@0.5", "KnormPress@0.5"}
    n = rec["settings"]["agnostic"]["n_compressed"]
    assert cells["full"]["kept"] == n and cells["KnormPress@0.5"]["kept"] == int(n * 0.5)
    assert rec["setup"]["presses"]["StreamingLLMPress"] == {"n_sink": 4}
    assert K.main(args + ["--resume"]) == 0
    assert len((tmp_path / "examples.jsonl").read_text().splitlines()) == 1
