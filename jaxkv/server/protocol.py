"""OpenAI chat-completions requests in, responses and stream chunks out.

``parse_chat_request(body)`` checks a decoded JSON body field by field and
returns a ``ChatRequest``; every problem is an ``APIError`` 400 naming the field
(``param``). It checks shapes and ranges only: the messages' structure is
checked by ``jaxkv.chat.render`` (``ChatError``), sampling values by the
sampler, options by the session, each in its one place.

What a request may carry:

* OpenAI's fields: ``model``, ``messages`` (roles ``system`` / ``developer``
  (read as ``system``) / ``user`` / ``assistant`` with ``tool_calls`` and
  ``reasoning_content`` / ``tool``; content a string or a list of text parts),
  ``tools``, ``tool_choice``, ``max_tokens`` / ``max_completion_tokens``,
  ``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``,
  ``stream_options.include_usage``, ``n`` (1 only);
* jaxkv's (``extra_body``): ``session_id``, ``top_k``, and the session options
  ``policy`` / ``budget`` / ``layout`` / ``repair`` / ``kv_quant`` / ``kv_bits`` /
  ``reuse`` (``SESSION_OPTIONS``; what the server allows is checked by
  ``sessions.OptionRules``, not here);
* fields that change nothing here and are accepted as such (``user``,
  ``metadata``, ``parallel_tool_calls``, ...). A field that would change the
  answer in a way jaxkv does not implement (``logprobs``, penalties,
  ``logit_bias``, a JSON ``response_format``) is refused, and so is an unknown
  field, so a typo in ``extra_body`` does not silently lose a session.

Responses: ``completion(...)`` is the ``chat.completion`` object (the app adds
``jaxkv``: what the session's mechanisms did, ``sessions.turn_report``),
``chunk(...)`` one ``chat.completion.chunk``; ``message_of(reply)`` turns a
parsed reply (``jaxkv.chat.parse_assistant``) into the OpenAI message, giving
each tool call an id (``call_...``). A stream that has nothing to send for
``KEEPALIVE_S`` seconds sends ``KEEPALIVE``, an SSE comment line.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from jaxkv.server.errors import invalid

SESSION_OPTIONS = ("policy", "budget", "layout", "repair", "kv_quant", "kv_bits", "reuse")  # checked by sessions.OptionRules
IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "modalities",
        "reasoning_effort",
        "verbosity",
    }
)
UNSUPPORTED = {  # field -> values that are fine (the default)
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "functions": (None,),
    "function_call": (None,),
}
KNOWN = (
    frozenset(
        {
            "model",
            "messages",
            "tools",
            "tool_choice",
            "max_tokens",
            "max_completion_tokens",
            "temperature",
            "top_p",
            "seed",
            "stop",
            "stream",
            "stream_options",
            "n",
            "response_format",
            "session_id",
            "top_k",
            "ignore_eos",
            *SESSION_OPTIONS,
        }
    )
    | IGNORED
    | frozenset(UNSUPPORTED)
)
MAX_STOP = 16
KEEPALIVE_S = 15.0  # a silent stream gets an SSE comment this often (app.ServeConfig.keepalive_s)
KEEPALIVE = ": keep-alive\n\n"  # an SSE comment line: SSE clients skip it


@dataclasses.dataclass
class ChatRequest:
    """A checked ``POST /v1/chat/completions`` body.

    Attributes:
      model, messages (normalised: ``developer`` -> ``system``, text parts joined),
      tools (None when absent or empty), tool_choice (None: auto).
      max_tokens: reply budget (None: the server's default, within the context).
      temperature (None: 1.0 as OpenAI), top_p, top_k, seed (None: random), stop.
      ignore_eos: vLLM's extension: decode ``max_tokens`` tokens, past the model's
        stop tokens (benchmarks use it to time replies of a fixed length).
      stream, include_usage.
      session_id: ``extra_body["session_id"]`` (the header is the caller's).
      options: the session options the request names (``SESSION_OPTIONS``).
    """

    model: str
    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: Any = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    session_id: str | None = None
    options: dict = dataclasses.field(default_factory=dict)


def _int(body: dict, name: str, low: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"'{name}' must be an integer, got {value!r}", name)
    if low is not None and value < low:
        raise invalid(f"'{name}' must be >= {low}, got {value}", name)
    return value


def _number(body: dict, name: str, low: float, high: float, *, open_low: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"'{name}' must be a number, got {value!r}", name)
    if not (low < value <= high if open_low else low <= value <= high):
        raise invalid(f"'{name}' must be in {'(' if open_low else '['}{low}, {high}], got {value}", name)
    return float(value)


def _text_content(content, k: int):
    """A message's content: a string, None, or a list of text parts (joined)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise invalid(f"messages[{k}].content[{j}] is a {kind!r} part; only text parts are supported", f"messages[{k}].content")
            if not isinstance(part.get("text"), str):
                raise invalid(f"messages[{k}].content[{j}].text must be a string", f"messages[{k}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(f"messages[{k}].content must be a string or a list of text parts", f"messages[{k}].content")


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise invalid(
            "'messages' must be a non-empty list of messages",
            "messages",
            "missing_required_parameter" if value is None else "invalid_value",
        )
    out = []
    for k, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise invalid(f"messages[{k}] must be an object", f"messages[{k}]")
        msg = dict(msg)
        if msg.get("role") == "developer":
            msg["role"] = "system"
        if "content" in msg:
            msg["content"] = _text_content(msg["content"], k)
        if msg.get("role") in ("user", "system", "tool") and msg.get("content") is None:
            raise invalid(f"messages[{k}] ({msg['role']}) needs a content", f"messages[{k}].content")
        out.append(msg)
    return out


def _tools(value) -> list[dict] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise invalid("'tools' must be a list", "tools")
    for j, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not fn["name"]
        ):
            raise invalid(f"tools[{j}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}", f"tools[{j}]")
    return value or None


def _tool_choice(value, tools):
    if value is None or value == "auto":
        return None
    if value in ("none", "required"):
        return value
    fn = value.get("function") if isinstance(value, dict) else None
    if isinstance(fn, dict) and value.get("type", "function") == "function" and isinstance(fn.get("name"), str):
        names = [t["function"]["name"] for t in tools or ()]
        if fn["name"] not in names:
            raise invalid(f"tool_choice names {fn['name']!r}, which is not in tools {names}", "tool_choice")
        return {"type": "function", "function": {"name": fn["name"]}}
    raise invalid("'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}", "tool_choice")


def parse_chat_request(body) -> ChatRequest:
    """Check a decoded ``/v1/chat/completions`` body (module docstring)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None)
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise invalid(f"unrecognized request argument: {unknown[0]!r}", unknown[0], "unknown_parameter")
    for name, fine in UNSUPPORTED.items():
        if (
            name in body
            and not any(body[name] == f and type(body[name]) is type(f) for f in fine if f is not None)
            and body[name] is not None
        ):
            raise invalid(f"'{name}' is not supported by this server", name, "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' must be a non-empty string", "model", "missing_required_parameter" if model is None else "invalid_value")
    n = _int(body, "n", 1)
    if n not in (None, 1):
        raise invalid(f"'n' must be 1 (one choice per request), got {n}", "n")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise invalid("only response_format {'type': 'text'} is supported", "response_format", "unsupported_parameter")
    messages = _messages(body.get("messages"))
    tools = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"), tools)
    if tool_choice is not None and tool_choice != "none" and not tools:
        raise invalid(f"tool_choice {body.get('tool_choice')!r} needs tools", "tool_choice")
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP):
        raise invalid(f"'stop' must be a string or a list of at most {MAX_STOP} strings", "stop")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid("'stream' must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool)):
        raise invalid("'stream_options' must be {'include_usage': bool}", "stream_options")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise invalid("'ignore_eos' must be true or false", "ignore_eos")
    session_id = body.get("session_id")
    if session_id is not None and (not isinstance(session_id, str) or not session_id or len(session_id) > 256):
        raise invalid("'session_id' must be a non-empty string of at most 256 characters", "session_id")
    return ChatRequest(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0, open_low=True),
        top_k=_int(body, "top_k", 1),
        seed=_int(body, "seed"),
        stop=tuple(s for s in stop or () if s),
        ignore_eos=ignore_eos,
        stream=stream,
        include_usage=bool(options and options.get("include_usage")),
        session_id=session_id,
        options={k: body[k] for k in SESSION_OPTIONS if k in body},
    )


# ============================================================================ responses
def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def tool_calls_of(reply: dict) -> list[dict]:
    """OpenAI tool calls (with ids) of a parsed reply."""
    return [
        {"id": new_id("call_"), "type": "function", "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
        for c in reply.get("tool_calls") or ()
    ]


def message_of(reply: dict) -> dict:
    """The OpenAI assistant message of a parsed reply: ``content`` is None when
    the reply only calls tools; ``reasoning_content`` when the model reasoned."""
    calls = tool_calls_of(reply)
    message: dict = {"role": "assistant", "content": reply.get("content") or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    if reply.get("reasoning_content") is not None:
        message["reasoning_content"] = reply["reasoning_content"]
    return message


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": int(prompt_tokens),
        "completion_tokens": int(completion_tokens),
        "total_tokens": int(prompt_tokens + completion_tokens),
        "prompt_tokens_details": {"cached_tokens": int(cached_tokens)},
    }


def completion(id: str, model: str, message: dict, finish_reason: str, use: dict) -> dict:
    return {
        "id": id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
        "usage": use,
        "system_fingerprint": None,
    }


def chunk(
    id: str,
    model: str,
    created: int,
    delta: dict | None,
    finish_reason: str | None = None,
    *,
    use: dict | None = None,
    include_usage: bool = False,
) -> dict:
    """One stream chunk; ``delta`` None makes the usage-only chunk (no choices)."""
    out = {"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "system_fingerprint": None}
    out["choices"] = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
    if include_usage:
        out["usage"] = use
    return out
