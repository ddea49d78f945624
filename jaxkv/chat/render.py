"""Render a chat request to token ids with per-token tags and spans.

``render`` validates the messages, renders them with the tokenizer's own chat
template (``apply_chat_template(..., tokenize=False)``), encodes the text without
adding special tokens (the template already wrote them) and tags the ids with one
scan (``jaxkv.chat.tags``). Works with any template whose layout the tagger
recognises (ChatML: Qwen2.5 / Qwen3; Llama-3.1 headers); others still render, with
every token tagged OTHERS / DELIM and a logged warning.

Prefix divergence between turns (Qwen3 drops the reasoning of assistant turns
before the last user query, so turn t+1's prompt differs from turn t's prompt plus
its generation inside the old assistant turn): there is no helper here on purpose;
``jaxkv.cache.radix.RadixTree.match`` returns the longest common prefix with
everything cached, which is exactly the reusable part. ``keep_reasoning=True``
keeps the reasoning, so the prefix does not diverge (AgentKV App. D.1).

Invariants of ``Rendered``: ``ids``, ``phase`` and ``triaxial`` have one entry per
token; ``decode(ids) == text``; spans are half-open ``(start, end)`` into ``ids``,
``(0, 0)`` when absent.
"""

from __future__ import annotations

import dataclasses
import json
import re
import weakref
from typing import Any, Mapping, Sequence

import numpy as np

from jaxkv.chat.tags import ChatMarkers, Message, Spans, TagScanner, tag_prompt, triaxial_array
from jaxkv.errors import ChatError

ROLES = frozenset({"system", "user", "assistant", "tool", "ipython"})


@dataclasses.dataclass(frozen=True)
class Rendered:
    """A rendered chat request.

    Attributes:
      text: the rendered prompt text.
      ids: token ids ``[T]`` int32.
      phase: ``Phase`` per token ``[T]`` int8.
      triaxial: ``[T]`` structured array of ``TRIAXIAL_DTYPE`` (fields ``temporal``,
        ``modal``, ``semantic`` and the tool output's ``copy`` sub-tag;
        ``tags.triaxial_codes`` flattens it).
      spans: protected prefix, actionable query and session spans.
      messages: the messages the tagger found (token indices).
      scanner: the tag scanner positioned after the prompt; ``scanner.feed(new_ids)``
        tags decoded tokens (their phase; they are in the current turn).
    """

    text: str
    ids: np.ndarray
    phase: np.ndarray
    triaxial: np.ndarray
    spans: Spans
    messages: tuple[Message, ...]
    scanner: TagScanner


_markers_cache: "weakref.WeakKeyDictionary[Any, ChatMarkers]" = weakref.WeakKeyDictionary()


def chat_markers(tokenizer) -> ChatMarkers:
    """The tokenizer's ``ChatMarkers``, resolved once and cached per tokenizer."""
    markers = _markers_cache.get(tokenizer)
    if markers is None:
        markers = _markers_cache[tokenizer] = ChatMarkers.from_tokenizer(tokenizer)
    return markers


def render(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    keep_reasoning: bool = False,
    reply_prefix: str = "",
) -> Rendered:
    """Render ``messages`` (OpenAI-style dicts) and tag every token.

    Raises ``ChatError`` for a malformed request (``validate_messages``). A call to
    a tool that is not in ``tools`` renders and is tagged like any other call. A
    template that never reads ``tool_calls`` (SmolLM2's ChatML) would drop the calls
    of earlier assistant turns, so those turns render as the text a model writes for
    its calls instead (``assistant_as_text``): the history keeps what the model did,
    in the words the reply parser reads back.
    ``reply_prefix``: text appended after the generation prompt, the forced start
    of the reply (``jaxkv.chat.parse.forced_call_prefix``); it is tokenized and
    tagged with the prompt.
    """
    validate_messages(messages, tools)
    if not template_reads(tokenizer, "tool_calls"):
        messages = [
            assistant_as_text(m, reasoning=keep_reasoning) if m.get("role") == "assistant" and m.get("tool_calls") else m for m in messages
        ]
    if tools and not template_takes_tools(tokenizer):
        raise ChatError(
            "this model's chat template has no tool section, so the tool schemas would be dropped silently; "
            "send the request without `tools` (describe the tools in the system message if the model should know them), "
            "or serve a model whose template renders tools"
        )
    if reply_prefix and not add_generation_prompt:
        raise ChatError("a reply prefix needs the generation prompt")
    text = (
        tokenizer.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            keep_reasoning=keep_reasoning,
        )
        + reply_prefix
    )
    ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)
    markers = chat_markers(tokenizer)
    tags, temporal, spans, found, scanner = tag_prompt(ids, markers)
    return Rendered(text, ids, tags.phase, triaxial_array(ids, tags, temporal, markers), spans, tuple(found), scanner)


def template_takes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` at all.

    A template that never reads the ``tools`` variable (SmolLM2's ChatML template,
    for one) would drop the schemas without a word, and the model would answer as
    if no tool existed. ``render`` refuses such a request with ``ChatError`` (an
    HTTP 400) instead: the caller decides whether to describe the tools in the
    system message, which is a prompt-design choice jaxkv should not make for it.
    """
    return template_reads(tokenizer, "tools")


def template_reads(tokenizer, variable: str) -> bool:
    """Whether the tokenizer's chat template (any of its named templates) mentions
    ``variable`` (``tools``, ``tool_calls``) at all."""
    template = getattr(tokenizer, "chat_template", None)
    pattern = rf"\b{re.escape(variable)}\b"
    if isinstance(template, dict):  # named templates: "default" plus "tool_use" etc.
        return any(re.search(pattern, t or "") for t in template.values())
    return bool(template) and re.search(pattern, template) is not None


def assistant_as_text(message: Mapping[str, Any], reasoning: bool = True) -> dict:
    """An assistant message as plain text, for a template that renders only ``content``:
    the reasoning first in ``<think>..</think>`` (if ``reasoning``), then the content,
    then each call as ``<tool_call>{"name": .., "arguments": {..}}</tool_call>`` (the
    bracket text Qwen's templates write, which ``jaxkv.chat.parse`` reads back)."""
    parts = []
    if reasoning and message.get("reasoning_content"):
        parts.append(f"<think>\n{message['reasoning_content']}\n</think>")
    if message.get("content"):
        parts.append(message["content"])
    for call in message.get("tool_calls") or ():
        fn = call.get("function", call)
        args = fn.get("arguments") or {}
        args = json.loads(args) if isinstance(args, str) else args
        parts.append("<tool_call>" + json.dumps({"name": fn["name"], "arguments": args}) + "</tool_call>")
    return {"role": "assistant", "content": "\n".join(parts)}


def tool_name(tool: Mapping[str, Any]) -> str | None:
    """Name of an OpenAI-style tool schema (``{"function": {"name": ...}}``) or a
    bare one (``{"name": ...}``)."""
    fn = tool.get("function", tool)
    return fn.get("name") if isinstance(fn, Mapping) else None


def validate_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> None:
    """Check that a request is well formed; raises ``ChatError`` naming the problem.

    Structure only: a tool call naming a tool missing from ``tools`` is well formed
    (models call tools they were not offered, and their history must still render
    and be tagged like any other call). Malformed: no messages, a message that is
    not a mapping, an unknown role, ``tool_calls`` that is not a list, a call
    without a function name, arguments that are neither a JSON string nor a mapping.
    """
    if messages is None or len(messages) == 0:
        raise ChatError("a chat request needs at least one message")
    for k, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ChatError(f"message {k} is a {type(msg).__name__}, not a mapping")
        role = msg.get("role")
        if role not in ROLES:
            raise ChatError(f"message {k} has unknown role {role!r}; expected one of {sorted(ROLES)}")
        calls = msg.get("tool_calls")
        if calls is None:
            continue
        if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence):
            raise ChatError(f"message {k}: tool_calls must be a list of calls, got {type(calls).__name__}")
        for j, call in enumerate(calls):
            fn = call.get("function", call) if isinstance(call, Mapping) else None
            name = fn.get("name") if isinstance(fn, Mapping) else None
            if not isinstance(name, str) or not name:
                raise ChatError(f"message {k}, tool call {j}: a call needs a function name, got {call!r}")
            args = fn.get("arguments", fn.get("parameters", {}))
            if not isinstance(args, (str, Mapping)):
                raise ChatError(
                    f"message {k}, tool call {j} ({name}): arguments must be a JSON string or an object, got {type(args).__name__}"
                )
