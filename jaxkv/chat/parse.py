"""Parse generated assistant text back into an OpenAI-style assistant message.

``parse_assistant(text)`` returns a dict:
  ``role``: ``"assistant"``;
  ``content``: the visible answer (reasoning and well-formed tool calls removed);
  ``reasoning_content``: text of the ``<think>`` block, or None when there is none;
  ``tool_calls``: ``[{"type": "function", "function": {"name": str, "arguments": str}}]``;
  ``parse_errors``: list of strings, one per problem found.

Formats: Qwen ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (any
number, anywhere after the reasoning) and Llama-3.1 ``<|python_tag|>{"name": ...,
"parameters": {...}}`` (several calls separated by ``;``). ``arguments`` is the JSON
text exactly as generated (OpenAI's convention is a JSON string; keeping the
model's own bytes means re-rendering the message reproduces the generated tokens,
so the next turn's prefix still matches the radix cache).

Reasoning: with ``think_open`` given (the caller knows whether the generation
prompt left a ``<think>`` block open, e.g. ``Session`` from its rendered prompt),
the split is *positional*: reasoning is the text up to the first ``</think>``
when the prompt opened the block, else only a ``<think>`` block that starts the
reply (after whitespace); think markers anywhere else are content text. So a
prefix of the text always parses to a prefix of the reasoning and of the content
(streaming relies on this). Without it (``None``) the split guesses: a ``</think>``
anywhere ends the reasoning, even without an opener.

Never raises on model output: a call whose JSON is malformed, lacks a name, or
names a tool not in ``tool_names`` (when given) stays in ``content`` as raw text and
its error is appended to ``parse_errors``; an unterminated ``<think>`` or
``<tool_call>`` (generation cut off) is reported the same way.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Collection

END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>")  # tokens that end a reply
_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ARGUMENT_KEYS = ("arguments", "parameters")
_decoder = json.JSONDecoder()


def stop_token_ids(model) -> frozenset[int]:
    """The tokens that end a generated reply: the checkpoint's ``eos_token_id``s,
    the tokenizer's eos token, and every ``END_TOKENS`` entry in its vocabulary.
    The one stop set of the project (sessions, the CLI, evaluation)."""
    stops = {int(t) for t in model.config.eos_token_ids}
    tok = model.tokenizer
    if tok is not None:
        vocab = tok.get_vocab()
        stops |= {int(vocab[name]) for name in END_TOKENS if name in vocab}
        if tok.eos_token_id is not None:
            stops.add(int(tok.eos_token_id))
    return frozenset(stops)


def parse_assistant(text: str, tool_names: Collection[str] | None = None, *, think_open: bool | None = None) -> dict[str, Any]:
    """Split generated ``text`` into content, reasoning and tool calls (see module doc);
    ``think_open``: whether the generation prompt left a ``<think>`` block open
    (None: guess)."""
    errors: list[str] = []
    text = _strip_end_tokens(text)
    if think_open is None:
        reasoning, text = _split_reasoning(text, errors)
    else:
        reasoning, text = _split_leading_reasoning(text, errors, think_open)

    calls: list[dict[str, Any]] = []
    kept: list[str] = []  # content pieces, raw text of failed calls included
    cursor = 0
    for match in _CALL_RE.finditer(text):
        kept.append(text[cursor : match.start()])
        call = _parse_call(match.group(1), tool_names, errors)
        if call is None:
            kept.append(match.group(0))
        else:
            calls.append(call)
        cursor = match.end()
    rest = text[cursor:]
    if "<tool_call>" in rest:
        errors.append("unterminated <tool_call> block")
    if "<|python_tag|>" in rest:
        head, _, payload = rest.partition("<|python_tag|>")
        kept.append(head)
        parsed = [_parse_call(part, tool_names, errors) for part in _split_calls(payload)]
        if parsed and all(c is not None for c in parsed):
            calls.extend(parsed)
        else:
            kept.append("<|python_tag|>" + payload)
    else:
        kept.append(rest)

    content = "".join(kept)
    if calls:
        content = content.strip()
    return {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": calls, "parse_errors": errors}


@dataclasses.dataclass(frozen=True)
class ReplyFormat:
    """How one turn's generated text becomes its message: everything a reader of
    the reply needs to cut and split it exactly as the final parse does (a
    streaming reader included).

    Attributes:
      prefix: text forced at the start of the reply (``forced_call_prefix``); it
        was prefilled with the prompt, and the reply text starts with it.
      think_open: the generation prompt left a ``<think>`` block open.
      tool_names: names a tool call may use (None: any; empty: none, so every
        call stays in ``content``).
      stop: stop strings; the reply ends before the first one generated.
    """

    prefix: str = ""
    think_open: bool = False
    tool_names: tuple[str, ...] | None = None
    stop: tuple[str, ...] = ()

    def find_stop(self, text: str) -> int | None:
        """Index in ``text`` (the reply text, prefix included) where the earliest
        stop string generated after the prefix begins, or None."""
        found = [i for i in (text.find(s, len(self.prefix)) for s in self.stop if s) if i >= 0]
        return min(found) if found else None

    def parse(self, text: str) -> dict[str, Any]:
        """The message of a reply text (already cut at a stop string)."""
        return parse_assistant(text, self.tool_names, think_open=self.think_open)


def forced_call_prefix(layout: str, name: str | None = None) -> str:
    """The start of a tool call in a chat template's format, to force a reply to
    call ``name`` (or, with None, some tool: the model writes the name).
    ``layout`` is ``jaxkv.chat.tags.ChatMarkers.layout``: ``"chatml"`` (Qwen's
    ``<tool_call>`` JSON) or ``"llama3"`` (``<|python_tag|>`` JSON); ValueError
    for another."""
    quoted = json.dumps(name, ensure_ascii=False) if name is not None else None
    if layout == "chatml":
        head = '<tool_call>\n{"name": '
        key = "arguments"
    elif layout == "llama3":
        head = '<|python_tag|>{"name": '
        key = "parameters"
    else:
        raise ValueError(f"no tool-call format known for the chat layout {layout!r}")
    return head + ('"' if quoted is None else f'{quoted}, "{key}": ')


def _strip_end_tokens(text: str) -> str:
    text = text.rstrip()
    stripped = True
    while stripped:
        stripped = False
        for end in END_TOKENS:
            if text.endswith(end):
                text, stripped = text[: -len(end)].rstrip(), True
    return text


def _split_reasoning(text: str, errors: list[str]) -> tuple[str | None, str]:
    """``(reasoning, rest)``. The generation prompt may already hold ``<think>``, so a
    ``</think>`` without an opener still ends the reasoning."""
    if "</think>" in text:
        head, _, rest = text.partition("</think>")
        reasoning = head.split("<think>", 1)[-1]
        return reasoning.strip("\n"), rest.lstrip("\n")
    if "<think>" in text:
        head, _, reasoning = text.partition("<think>")
        errors.append("unterminated <think> block")
        return reasoning.strip("\n"), head
    return None, text


def _split_leading_reasoning(text: str, errors: list[str], opened: bool) -> tuple[str | None, str]:
    """``(reasoning, rest)`` when the prompt's state is known: the reasoning is the
    text up to the first ``</think>`` if the prompt opened the block, else the
    reply's leading ``<think>`` block; unterminated, all of it is reasoning."""
    if not opened:
        stripped = text.lstrip()
        if not stripped.startswith("<think>"):
            return None, text
        text = stripped[len("<think>") :]
    reasoning, closed, rest = text.partition("</think>")
    if not closed:
        errors.append("unterminated <think> block")
        return reasoning.strip("\n"), ""
    return reasoning.strip("\n"), rest.lstrip("\n")


def _split_calls(payload: str) -> list[str]:
    """Llama ``<|python_tag|>`` payload: one JSON object, or several joined by ';'."""
    parts, idx = [], 0
    payload = payload.strip()
    while idx < len(payload):
        try:
            _, end = _decoder.raw_decode(payload, idx)
        except json.JSONDecodeError:
            return [payload[idx:]]
        parts.append(payload[idx:end])
        idx = end
        while idx < len(payload) and payload[idx] in "; \n\t":
            idx += 1
    return parts


def _parse_call(body: str, tool_names: Collection[str] | None, errors: list[str]) -> dict[str, Any] | None:
    body = body.strip()
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        errors.append(f"malformed tool-call JSON ({exc.msg} at char {exc.pos}): {body[:80]!r}")
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        errors.append(f"tool call without a string 'name': {body[:80]!r}")
        return None
    name = obj["name"]
    if tool_names is not None and name not in tool_names:
        errors.append(f"tool call to unknown tool {name!r}")
        return None
    return {"type": "function", "function": {"name": name, "arguments": _raw_arguments(body, obj)}}


def _raw_arguments(body: str, obj: dict[str, Any]) -> str:
    """The arguments' JSON text as written in ``body`` ("{}" when absent)."""
    for key in _ARGUMENT_KEYS:
        if key not in obj:
            continue
        for found in re.finditer(r'"%s"\s*:\s*' % key, body):
            try:
                value, end = _decoder.raw_decode(body, found.end())
            except json.JSONDecodeError:  # the key text matched inside a string value
                continue
            if value == obj[key]:
                return body[found.end() : end]
        return json.dumps(obj[key], ensure_ascii=False)
    return "{}"
