"""parse_assistant: reasoning, Qwen and Llama tool calls, malformed output kept."""

import json

from jaxkv.chat import build_tokenizer, parse_assistant, render
from jaxkv.chat.toy import schema


def test_reasoning_content_and_several_calls():
    text = (
        "<think>\nlook it up\n</think>\n\nChecking.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz":"CET"}}\n</tool_call><|im_end|>'
    )
    msg = parse_assistant(text)
    assert msg["reasoning_content"] == "look it up"
    assert msg["content"] == "Checking."
    assert msg["parse_errors"] == []
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "get_time"]
    assert all(c["type"] == "function" for c in msg["tool_calls"])
    # arguments keep the generated JSON text byte for byte
    assert msg["tool_calls"][1]["function"]["arguments"] == '{"tz":"CET"}'
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


def test_plain_answer_and_reasoning_opened_by_the_prompt():
    assert parse_assistant("Paris is sunny.") == {
        "role": "assistant",
        "content": "Paris is sunny.",
        "reasoning_content": None,
        "tool_calls": [],
        "parse_errors": [],
    }
    msg = parse_assistant("hmm\n</think>\n\nok")  # '<think>' was in the generation prompt
    assert msg["reasoning_content"] == "hmm" and msg["content"] == "ok"


def test_malformed_json_is_kept_in_content_and_reported():
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
    good = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    msg = parse_assistant("Trying.\n" + bad + "\n" + good)
    assert bad in msg["content"]
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["f"]
    assert len(msg["parse_errors"]) == 1 and "malformed tool-call JSON" in msg["parse_errors"][0]


def test_missing_name_unknown_tool_and_truncation_are_reported():
    msg = parse_assistant('<tool_call>{"arguments": {}}</tool_call>')
    assert msg["tool_calls"] == [] and "name" in msg["parse_errors"][0]
    msg = parse_assistant('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', tool_names={"f"})
    assert msg["tool_calls"] == [] and "unknown tool 'rm'" in msg["parse_errors"][0]
    assert "<tool_call>" in msg["content"]
    msg = parse_assistant("<think>still thinking")
    assert msg["reasoning_content"] == "still thinking" and msg["parse_errors"] == ["unterminated <think> block"]
    msg = parse_assistant('ok <tool_call>{"name": "f", "argu')
    assert msg["content"] == 'ok <tool_call>{"name": "f", "argu'
    assert msg["parse_errors"] == ["unterminated <tool_call> block"]


def test_llama_python_tag_calls():
    msg = parse_assistant('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}<|eom_id|>')
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [("f", '{"x": 1}'), ("g", "{}")]
    msg = parse_assistant("<|python_tag|>{oops")
    assert msg["tool_calls"] == [] and msg["content"] == "<|python_tag|>{oops" and msg["parse_errors"]


def test_parsed_message_renders_back_to_the_generated_tokens():
    tok = build_tokenizer(["Hi", "hmm", "Paris", "city", "get_weather"])
    tools = [schema("get_weather", city="c")]
    prompt = render(tok, [{"role": "user", "content": "Hi"}], tools=tools)
    generated = '<think>\nhmm\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    msg = parse_assistant(generated)
    nxt = render(tok, [{"role": "user", "content": "Hi"}, msg, {"role": "tool", "content": "ok"}], tools=tools)
    assert nxt.text.startswith(prompt.text + generated + "\n")
