"""The ``jaxkv`` command: generate through the chat template, typed errors as one line."""

from __future__ import annotations

import pytest

import jaxkv
from jaxkv import cli
from jaxkv.chat import build_tokenizer
from jaxkv.config import ModelConfig


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat_model")
    tok = build_tokenizer("hello world how are you".split())
    cfg = ModelConfig(
        model_type="qwen3",
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        qk_norm=True,
        max_position_embeddings=256,
        eos_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),),
    )
    jaxkv.save_pretrained(jaxkv.model_from_config(cfg, seed=1, tokenizer=tok), folder)
    return folder


def test_generate_applies_chat_template(chat_model_dir, capsys):
    assert cli.main(["generate", "--model", str(chat_model_dir), "--prompt", "hello world", "--max-new-tokens", "5"]) == 0
    out, err = capsys.readouterr()
    assert "prompt tokens" in err and "generated" in err
    model = jaxkv.load_model(chat_model_dir)
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": "hello world"}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert f"[{len(ids)} prompt tokens" in err  # the template was applied
    expected = jaxkv.generate(model, [list(ids)], 5, stop_token_ids=list(model.config.eos_token_ids))[0]
    assert out.strip() == model.tokenizer.decode(expected, skip_special_tokens=False).strip()


def test_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    assert cli.main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "x"])  # --model is required: argparse exits
