"""render(): templates (Qwen3 toy, Qwen2.5-style, Llama-3.1-style), validation, save/load."""

import numpy as np
import pytest
from transformers import AutoTokenizer

from jaxkv.chat import Phase, Semantic, build_tokenizer, render
from jaxkv.chat.toy import schema, toy_vocab
from jaxkv.errors import ChatError, JaxKVError

WORDS = ["Hi", "weather", "Paris", "sunny", "ok", "hmm", "get_weather", "city"]
TOOLS = [schema("get_weather", "the weather", city="a city")]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
MESSAGES = [
    {"role": "system", "content": "ok"},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "", "reasoning_content": "hmm", "tool_calls": [CALL]},
    {"role": "tool", "content": "sunny"},
]

LLAMA_SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>")
# A small Llama-3.1-style template: tools in the system turn, calls after <|python_tag|>,
# tool results in the ipython role.
LLAMA31_TEMPLATE = (
    "<|begin_of_text|>"
    "{%- if messages[0].role == 'system' or tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "{%- if tools %}Environment: ipython\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}<|eot_id|>{% endif %}"
    "{%- for m in messages %}{% if m.role != 'system' %}"
    "{%- if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n<|python_tag|>"
    "{%- for c in m.tool_calls %}{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}"
    "{% if not loop.last %}; {% endif %}{% endfor %}<|eom_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endif %}"
    "{%- endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Qwen2.5's layout: ChatML, default system prompt, no reasoning, tools in the system turn.
QWEN25_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{{ messages[0].content if messages[0].role == 'system' else 'You are Qwen' }}"
    "\n\n# Tools\n\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- else %}<|im_start|>system\nYou are Qwen<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant{% if m.content %}\n{{ m.content }}{% endif %}"
    '{%- for c in m.tool_calls or [] %}\n<tool_call>\n{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n'
    "{%- elif m.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}{{ '\\n' }}"
    "<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(WORDS)


def pieces(tokenizer, r):
    return tokenizer.convert_ids_to_tokens(r.ids.tolist())


def test_rendered_arrays_are_aligned_and_decode_to_the_text(tok):
    r = render(tok, MESSAGES, tools=TOOLS)
    assert r.ids.dtype == np.int32 and r.phase.dtype == np.int8
    assert r.ids.shape == r.phase.shape == r.triaxial.shape
    assert tok.decode(r.ids.tolist()) == r.text
    assert r.text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in r.text
    assert "hmm" in r.text  # the assistant turn follows the last user query: reasoning kept
    p = pieces(tok, r)
    assert r.phase[p.index("hmm")] == Phase.THINK
    assert r.phase[p.index("sunny")] == Phase.TOOL


def test_saved_tokenizer_loads_and_round_trips(tok, tmp_path):
    build_tokenizer(WORDS, save_dir=tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    text = 'Hi {"city": "Paris", "n": 42} — ünïcödé ✓\n\t<think>x</think><|im_end|>'
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert loaded.decode(ids) == text
    assert render(loaded, MESSAGES, tools=TOOLS).ids.tolist() == render(tok, MESSAGES, tools=TOOLS).ids.tolist()
    assert loaded.decode(ids, skip_special_tokens=True) == text.replace("<|im_end|>", "")


def test_builder_is_deterministic_and_words_are_single_tokens():
    a, b = build_tokenizer(WORDS), build_tokenizer(list(WORDS))
    assert a.get_vocab() == b.get_vocab()
    assert len(a.get_vocab()) == len(toy_vocab(WORDS))
    for w in WORDS:
        assert a(w, add_special_tokens=False)["input_ids"] == [a.get_vocab()[w]]
    with pytest.raises(ValueError):
        build_tokenizer(["two words"])


def test_llama31_layout():
    tok = build_tokenizer(WORDS, extra_special=LLAMA_SPECIALS, chat_template=LLAMA31_TEMPLATE)
    r = render(tok, MESSAGES, tools=TOOLS)
    p = pieces(tok, r)
    assert p[0] == "<|begin_of_text|>"
    assert r.phase[p.index("<|python_tag|>")] == Phase.ACT
    assert r.triaxial["semantic"][p.index("Paris", p.index("<|python_tag|>"))] == Semantic.TOOL_CALL
    ipython = p.index("ipython", p.index("<|python_tag|>"))  # the role header, not "Environment: ipython"
    assert r.phase[ipython] == Phase.TOOL and r.phase[ipython - 1] == Phase.TOOL  # header opens TOOL
    assert r.phase[p.index("sunny")] == Phase.TOOL and r.triaxial["semantic"][p.index("sunny")] == Semantic.OBS
    assert r.spans.actionable_query == (p.index("sunny"), p.index("sunny") + 1)
    assert r.spans.session_span == (p.index("Hi"), p.index("Hi") + 1)
    lo, hi = r.spans.protected_prefix
    assert lo == 0 and p[hi] == "<|start_header_id|>" and p[hi + 1] == "user"
    assert r.triaxial["semantic"][p.index("get_weather")] == Semantic.INST  # schema in the system turn


def test_qwen25_layout():
    tok = build_tokenizer(WORDS, chat_template=QWEN25_TEMPLATE)
    r = render(tok, MESSAGES[1:], tools=TOOLS)
    p = pieces(tok, r)
    assert "<think>" not in p
    call = p.index("<tool_call>", p.index("assistant"))
    assert r.phase[call] == Phase.ACT and r.phase[call + 1] == Phase.ACT
    assert r.phase[p.index("sunny")] == Phase.TOOL
    assert r.spans.session_span == (p.index("Hi"), p.index("Hi") + 1)
    assert p[r.spans.protected_prefix[1] + 1] == "user"


@pytest.mark.parametrize(
    "messages, tools, needle",
    [
        ([], None, "at least one message"),
        ([{"role": "robot", "content": "Hi"}], None, "unknown role"),
        ([{"content": "Hi"}], None, "unknown role"),
        (["Hi"], None, "not a mapping"),
        ([{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": CALL}], None, "must be a list"),
        (
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}],
            None,
            "function name",
        ),
        (
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [{"function": {"name": "rm_rf", "arguments": 3}}]}],
            TOOLS,
            "rm_rf",
        ),
    ],
)
def test_bad_requests_raise_chat_error(tok, messages, tools, needle):
    with pytest.raises(ChatError, match=needle) as info:
        render(tok, messages, tools=tools)
    assert isinstance(info.value, JaxKVError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_a_call_to_a_tool_not_offered_renders_and_is_tagged(tok, tools):
    """Models call tools they were not offered; the history still renders, and the
    call is tagged like any other (ACT), its result like any other (TOOL)."""
    call = {"type": "function", "function": {"name": "rm_rf", "arguments": {"city": "Paris"}}}
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "content": "sunny"}]
    r = render(tok, messages, tools=tools)
    p = [tok.convert_ids_to_tokens(int(i)) for i in r.ids]
    at = p.index("<tool_call>", p.index("assistant"))
    assert r.phase[at] == Phase.ACT and r.phase[at + 1] == Phase.ACT
    assert "rm_rf" in r.text and r.phase[p.index("sunny")] == Phase.TOOL


CONTENT_ONLY_TEMPLATE = (  # SmolLM2's layout: ChatML with each message's role and content, nothing else
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_calls_in_the_history_render_as_text_where_the_template_drops_tool_calls(tok, smollm2_tokenizer):
    """A template that never reads ``tool_calls`` would drop an earlier turn's calls
    without a word; they render as the text a model writes for them instead, which
    the reply parser reads back as the same call. Reasoning goes in only with
    ``keep_reasoning``. A template that renders calls is left to render them."""
    import copy

    from jaxkv.chat.parse import parse_assistant

    plain = copy.deepcopy(tok)
    plain.chat_template = CONTENT_ONLY_TEMPLATE
    history = MESSAGES[1:]  # user, assistant (reasoning + a call), tool
    for tokenizer in (plain, smollm2_tokenizer):
        r = render(tokenizer, history)
        assistant = r.text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
        assert assistant == '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        assert parse_assistant(assistant)["tool_calls"] == [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]
        kept = render(tokenizer, history, keep_reasoning=True).text
        assert "<think>\nhmm\n</think>\n<tool_call>" in kept
    p = pieces(plain, render(plain, history))
    at = p.index("<tool_call>")
    assert render(plain, history).phase[at] == Phase.ACT  # tagged as the call it is
    assert render(tok, history).text == tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)


def test_folder_tokenizer_skips_auto_tokenizer_only_for_the_generic_class(tmp_path, monkeypatch):
    """A folder naming transformers' generic fast class loads without AutoTokenizer (which
    imports torch) and equals what AutoTokenizer gives; any other class still goes through it."""
    import json
    import shutil
    from pathlib import Path

    import transformers

    import jaxkv
    from jaxkv.models.tokenizer import folder_tokenizer

    generic = Path(jaxkv.__file__).parent / "assets" / "embedded-agent"
    build_tokenizer(WORDS, save_dir=tmp_path / "built")
    text = 'Hi {"city": "Paris"} — ünïcödé\n\t<think>x</think><|im_end|>'
    expected = {}
    for folder in (generic, tmp_path / "built"):
        ref = AutoTokenizer.from_pretrained(str(folder))
        expected[folder] = (type(ref), ref.get_vocab(), ref.all_special_tokens, ref.chat_template, ref(text)["input_ids"])

    calls = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: calls.append(a) or real(*a, **k))
    for folder, (cls, vocab, specials, template, ids) in expected.items():
        got = folder_tokenizer(folder)
        assert type(got) is cls and got.get_vocab() == vocab and got.all_special_tokens == specials
        assert got.chat_template == template and got(text)["input_ids"] == ids
    assert calls == [], "the generic class went through AutoTokenizer"

    named = tmp_path / "named"
    shutil.copytree(generic, named, ignore=shutil.ignore_patterns("*.safetensors", "intentkv-head"))
    config = json.loads((named / "tokenizer_config.json").read_text())
    (named / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    folder_tokenizer(named)
    assert len(calls) == 1, "a model-specific class must go through AutoTokenizer"
