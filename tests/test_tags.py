"""Tagger tests: phases, triaxial tags and spans over toy-tokenizer renderings."""

import logging

import numpy as np
import pytest

from jaxkv.chat import Modal, Phase, Semantic, Temporal, build_tokenizer, render
from jaxkv.chat.tags import ChatMarkers, TagScanner, tag_prompt, triaxial_codes, NUM_TRIAXIAL_CODES

WORDS = ["Help", "Hi", "sunny", "rain", "ok", "hmm", "Thanks", "f", "g"]

# One short conversation: a system prompt, a user turn with an image, an assistant
# turn with reasoning (dropped by the template: it precedes the last user query)
# and two tool calls, two tool results (grouped into one user turn), an answer, then
# a second user turn whose answer keeps its reasoning.
CONVERSATION = [
    {"role": "system", "content": "Help"},
    {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image"}]},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "hmm",
        "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": {}}},
            {"type": "function", "function": {"name": "g", "arguments": {}}},
        ],
    },
    {"role": "tool", "content": "sunny"},
    {"role": "tool", "content": "rain"},
    {"role": "assistant", "content": "ok"},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "ok", "reasoning_content": "hmm"},
]
TOOLS = [{"type": "function", "function": {"name": n}} for n in ("f", "g")]

O, T, A, K = Phase.OTHERS, Phase.THINK, Phase.ACT, Phase.TOOL
M1, CUR = Temporal.TURN_M1, Temporal.CURRENT
D, INST, USER, ASST, REAS, CALL, OBS = (
    Semantic.DELIM,
    Semantic.INST,
    Semantic.USER,
    Semantic.ASSISTANT,
    Semantic.REASONING,
    Semantic.TOOL_CALL,
    Semantic.OBS,
)
CALL_F = '\n { " name " : ␣ " f " , ␣ " arguments " : ␣ { } } \n'
CALL_G = CALL_F.replace(" f ", " g ")
# (token pieces separated by spaces, '␣' is a space token, phase, temporal, semantic);
# the rendering without tools (the system turn is just "Help").
EXPECTED = [
    ("<|im_start|> system \n", O, M1, D),
    ("Help", O, M1, INST),
    ("<|im_end|> \n", O, M1, D),
    ("<|im_start|> user \n", O, M1, D),
    ("Hi", O, M1, USER),
    ("<|vision_start|>", O, M1, D),
    ("<|image_pad|>", O, M1, USER),
    ("<|vision_end|>", O, M1, D),
    ("<|im_end|> \n", O, M1, D),
    ("<|im_start|> assistant \n", O, M1, D),  # reasoning "hmm" dropped by the template
    ("<tool_call>", A, M1, D),
    (CALL_F, A, M1, CALL),
    ("</tool_call>", O, M1, D),
    ("\n", O, M1, ASST),
    ("<tool_call>", A, M1, D),
    (CALL_G, A, M1, CALL),
    ("</tool_call>", O, M1, D),
    ("<|im_end|> \n", O, M1, D),
    ("<|im_start|> user \n", O, M1, D),  # a tool-result message: no new turn
    ("<tool_response>", K, M1, D),
    ("\n sunny \n", K, M1, OBS),
    ("</tool_response> \n <tool_response>", K, M1, D),
    ("\n rain \n", K, M1, OBS),
    ("</tool_response>", K, M1, D),
    ("<|im_end|> \n", O, M1, D),
    ("<|im_start|> assistant \n", O, M1, D),
    ("ok", O, M1, ASST),
    ("<|im_end|> \n", O, M1, D),
    ("<|im_start|> user \n", O, CUR, D),  # the second turn starts at its header
    ("Thanks", O, CUR, USER),
    ("<|im_end|> \n", O, CUR, D),
    ("<|im_start|> assistant \n", O, CUR, D),
    ("<think>", T, CUR, D),
    ("\n hmm \n", T, CUR, REAS),
    ("</think>", O, CUR, D),
    ("\n \n ok", O, CUR, ASST),
    ("<|im_end|> \n", O, CUR, D),
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(WORDS)


def expand(expected):
    rows = []
    for pieces, phase, temporal, semantic in expected:
        for piece in pieces.split(" "):
            rows.append((piece.replace("␣", " "), int(phase), int(temporal), int(semantic)))
    return rows


def test_hand_written_conversation_token_by_token(tok):
    text = tok.apply_chat_template(CONVERSATION, tokenize=False)  # no tools: short system turn
    ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"])
    tags, temporal, spans, _, _ = tag_prompt(ids, ChatMarkers.from_tokenizer(tok))
    got = list(zip(tok.convert_ids_to_tokens(ids.tolist()), tags.phase.tolist(), temporal.tolist(), tags.semantic.tolist()))
    want = expand(EXPECTED)
    assert len(got) == len(want), (len(got), len(want))
    for k, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"token {k}: got {g}, want {w}"
    image = [k for k, (piece, *_) in enumerate(want) if piece == "<|image_pad|>"]
    assert tags.modal.tolist() == [int(Modal.IMAGE) if k in image else int(Modal.TEXT) for k in range(len(want))]
    pieces = [w[0] for w in want]
    assert spans.protected_prefix == (0, 6)  # <|im_start|> system \n Help <|im_end|> \n
    assert spans.session_span == (pieces.index("Hi"), pieces.index("<|vision_end|>") + 1)
    assert spans.actionable_query == (pieces.index("Thanks"), pieces.index("Thanks") + 1)


def test_keep_reasoning_tags_the_earlier_think_block(tok):
    dropped = render(tok, CONVERSATION, tools=TOOLS, add_generation_prompt=False)
    kept = render(tok, CONVERSATION, tools=TOOLS, add_generation_prompt=False, keep_reasoning=True)
    assert (dropped.phase == Phase.THINK).sum() == 4  # only the last turn's block
    assert (kept.phase == Phase.THINK).sum() == 8
    first_think = int(np.flatnonzero(kept.phase == Phase.THINK)[0])
    pieces = tok.convert_ids_to_tokens(kept.ids.tolist())
    assert pieces[first_think : first_think + 5] == ["<think>", "\n", "hmm", "\n", "</think>"]
    assert kept.triaxial["temporal"][first_think] == Temporal.TURN_M1
    # the kept reasoning shifts everything after it: the two prompts diverge there
    n = min(dropped.ids.size, kept.ids.size)
    assert int(np.flatnonzero(dropped.ids[:n] != kept.ids[:n])[0]) == first_think


def test_tools_go_into_the_protected_prefix_as_instructions(tok):
    r = render(tok, CONVERSATION[:2], tools=TOOLS)
    lo, hi = r.spans.protected_prefix
    pieces = tok.convert_ids_to_tokens(r.ids.tolist())
    assert pieces[hi : hi + 2] == ["<|im_start|>", "user"]
    body = r.triaxial["semantic"][lo:hi]
    assert set(body.tolist()) == {Semantic.INST, Semantic.DELIM}
    assert (r.phase[lo:hi] == Phase.OTHERS).all()  # the preamble's example <tool_call> is not ACT
    assert "f" in pieces[lo:hi] and "g" in pieces[lo:hi]


def test_actionable_query_after_tool_results_covers_all_results(tok):
    r = render(tok, CONVERSATION[:5], tools=TOOLS)
    lo, hi = r.spans.actionable_query
    pieces = tok.convert_ids_to_tokens(r.ids[lo:hi].tolist())
    assert pieces[0] == "<tool_response>" and pieces[-1] == "</tool_response>"
    assert "sunny" in pieces and "rain" in pieces
    # the generation prompt is an open assistant header, tagged OTHERS / DELIM
    assert tok.convert_ids_to_tokens(r.ids[-3:].tolist()) == ["<|im_start|>", "assistant", "\n"]
    assert (r.triaxial["semantic"][-3:] == Semantic.DELIM).all()


def test_temporal_axis_counts_back_from_the_last_turn(tok):
    msgs = []
    for k in range(5):
        msgs += [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "ok"}]
    r = render(tok, msgs, add_generation_prompt=False)
    pieces = tok.convert_ids_to_tokens(r.ids.tolist())
    his = [k for k, p in enumerate(pieces) if p == "Hi"]
    assert [int(r.triaxial["temporal"][k]) for k in his] == [0, 0, 1, 2, 3]  # OLDER OLDER M2 M1 CURRENT


def test_scanner_continues_over_decoded_tokens(tok):
    r = render(tok, CONVERSATION[:2], tools=TOOLS)
    generated = tok("<think>\nhmm\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>", add_special_tokens=False)["input_ids"]
    tags = r.scanner.feed(generated)
    assert tags.phase.tolist() == [T, T, T, T, O, O, O, A, A, A, A, A, O, O]
    # same answer as scanning prompt + generation at once
    whole, *_ = tag_prompt(np.concatenate([r.ids, generated]), ChatMarkers.from_tokenizer(tok))
    assert whole.phase[r.ids.size :].tolist() == tags.phase.tolist()


def test_tool_role_layout(tok):
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok2 = build_tokenizer(WORDS, chat_template=template)
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rain"},
    ]
    r = render(tok2, msgs)
    pieces = tok2.convert_ids_to_tokens(r.ids.tolist())
    tool_header = pieces.index("tool")
    assert r.phase[tool_header - 1] == Phase.TOOL  # a tool header opens the tool phase
    assert r.phase[pieces.index("sunny")] == Phase.TOOL
    assert r.triaxial["semantic"][pieces.index("rain")] == Semantic.OBS
    lo, hi = r.spans.actionable_query  # both trailing tool messages
    assert lo == pieces.index("sunny") and hi == pieces.index("rain") + 1
    assert set(r.triaxial["temporal"].tolist()) == {Temporal.CURRENT}


def test_unrecognised_template_degrades_with_a_warning(caplog):
    tok3 = build_tokenizer(WORDS, chat_template="{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    # hide the ChatML markers from the tagger: a template it does not know
    markers = ChatMarkers("unknown", None, None, frozenset(), {}, frozenset(), frozenset(), lambda i: "")
    with caplog.at_level(logging.WARNING, logger="jaxkv.chat.tags"):
        tags, temporal, spans, msgs, _ = tag_prompt(tok3("user: Hi\n")["input_ids"], markers)
    assert "not recognised" in caplog.text
    assert set(tags.phase.tolist()) == {Phase.OTHERS} and set(tags.semantic.tolist()) == {Semantic.DELIM}
    assert spans.protected_prefix == spans.actionable_query == spans.session_span == (0, 0)


def test_unknown_role_in_the_stream_is_delim_with_a_warning(tok, caplog):
    ids = tok("<|im_start|>narrator\nHi<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n", add_special_tokens=False)["input_ids"]
    with caplog.at_level(logging.WARNING, logger="jaxkv.chat.tags"):
        tags, _, spans, msgs, _ = tag_prompt(ids, ChatMarkers.from_tokenizer(tok))
    assert "narrator" in caplog.text
    assert [m.kind for m in msgs] == ["unknown", "user"]
    first_hi = tok.convert_ids_to_tokens(ids).index("Hi")
    assert tags.semantic[first_hi] == Semantic.DELIM and tags.phase[first_hi] == Phase.OTHERS


def test_triaxial_codes_are_distinct_per_tag():
    arr = np.zeros(NUM_TRIAXIAL_CODES, dtype=[("temporal", "i1"), ("modal", "i1"), ("semantic", "i1")])
    combos = [(t, m, s) for t in Temporal for m in Modal for s in Semantic]
    for k, (t, m, s) in enumerate(combos):
        arr[k] = (t, m, s)
    assert sorted(triaxial_codes(arr).tolist()) == list(range(NUM_TRIAXIAL_CODES))
