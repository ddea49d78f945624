"""The record every synthetic task produces, and the helpers the generators share.

An ``Example`` is one conversation in OpenAI chat format plus what an evaluator
needs to score it turn by turn with teacher forcing: for each scored assistant
message, the exact tool-call arguments or answer string the model must produce, and
where in the earlier conversation every copied value first appeared (``Evidence``).

Invariants every generator keeps (``tests/test_tasks.py`` checks them):

* deterministic: the same arguments give the same ``Example`` (``random.Random(seed)``);
* every value a scored turn copies appears, verbatim, in an earlier message;
* identifiers (keys ``k173``, values ``v032``, document ids ``d102``) are unique
  within an example, so a copied value names exactly one record. They come from the
  fixed pools in ``jaxkv.tasks.words`` (400 keys, 400 values, 200 document ids), which
  are part of ``vocabulary()``: each identifier is one token of the word-level
  tokenizer, so copying a value is single-token induction. When a long example needs
  more distractor records than a pool holds, the rest of its budget is filler prose.
* every ``\\w+`` run comes from ``vocabulary()``.

Token counts: ``approx_tokens`` counts what the embedded model's tokenizer (the toy
tokenizer with space-prefixed words, ``jaxkv.chat.toy.build_tokenizer(...,
spaced_words=...)``) produces for a string made of vocabulary words, identifiers,
punctuation and whitespace: a prose word is one token together with the space before
it; a pool identifier or a project name (``UNSPACED_WORDS``, the words tool calls copy
into JSON) is one token, plus one for a space before it; punctuation is one
token, plus one for a space before it; an identifier-like run outside the pools (e.g.
``k1234``) is one token per character. The ``length`` knob of the generators is
measured in these tokens.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from typing import Any

from jaxkv.tasks.words import DOC_POOL, IDENTIFIERS, KEY_POOL, UNSPACED_WORDS, VALUE_POOL

_RUN_RE = re.compile(r" ?\w+| ?[^\w\s]|\s")
_IDENT_RE = re.compile(r"^[kvd]\d+$")  # identifier-shaped; one token only if in a pool

# Tokens the Qwen3 chat template adds around messages and tool schemas, so that
# ``length`` approximates the rendered prompt rather than the raw contents.
TEMPLATE_TOKENS_PER_MESSAGE = 7
TEMPLATE_TOKENS_FOR_TOOLS = 108


@dataclasses.dataclass(frozen=True)
class Evidence:
    """Where a copied value first appears.

    Attributes:
      value: the copied string (an identifier or a phrase).
      message_index: index into ``Example.messages`` of the message holding it.
      char_start, char_end: ``messages[message_index]["content"][char_start:char_end] == value``.
    """

    value: str
    message_index: int
    char_start: int
    char_end: int


@dataclasses.dataclass(frozen=True)
class ScoredTurn:
    """One assistant message an evaluator scores by exact match.

    Attributes:
      message_index: index of the assistant message in ``Example.messages``.
      kind: ``"tool_call"`` (compare ``name`` and ``arguments``) or ``"answer"``
        (compare the message ``content``).
      expected: the tool call ``{"name": ..., "arguments": {...}}`` or the answer string.
      evidence: one entry per value the turn copies from earlier messages.
      values: the copied values in the order the turn uses them (partial credit).
    """

    message_index: int
    kind: str
    expected: Any
    evidence: tuple[Evidence, ...]
    values: tuple[str, ...]


def reply_matches(target, reply: dict) -> bool:
    """Whether a parsed assistant ``reply`` (``content``, ``tool_calls`` in OpenAI
    format) is exactly what ``target`` asks for: the exact-match rule of a
    ``ScoredTurn`` (or of anything with its ``kind`` and ``expected``). An ``answer``
    turn matches when the reply makes no tool call and its stripped content equals the
    expected string; a ``tool_call`` turn when the reply makes exactly one call, with
    the expected name and arguments (arguments given as a JSON string are parsed; a
    string that does not parse matches nothing)."""
    if target.kind == "answer":
        return not reply.get("tool_calls") and (reply.get("content") or "").strip() == target.expected
    calls = reply.get("tool_calls") or []
    if len(calls) != 1:
        return False
    fn = calls[0]["function"]
    args = fn["arguments"]
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return False
    return fn["name"] == target.expected["name"] and args == target.expected["arguments"]


@dataclasses.dataclass
class Example:
    """One synthetic conversation and its scoring targets.

    Attributes:
      task: generator name (``"agent_traces"``, ``"mqniah"``).
      seed: the per-example seed (reproduces this example alone).
      messages: OpenAI-style messages; assistant messages may carry
        ``reasoning_content`` and ``tool_calls``.
      tools: OpenAI function schemas offered in the system turn (may be empty).
      targets: the scored assistant turns, in message order.
      labels: task-specific annotations (needle positions, query splits, ...).
    """

    task: str
    seed: int
    messages: list[dict]
    tools: list[dict]
    targets: list[ScoredTurn]
    labels: dict = dataclasses.field(default_factory=dict)

    def approx_tokens(self) -> int:
        """Rendered prompt length estimate, in toy-tokenizer tokens."""
        return conversation_tokens(self.messages, self.tools)


def inline_tools(messages, tools) -> list[dict]:
    """The conversation as plain text messages, for a chat template with no tool
    section (SmolLM2's ChatML renders each message's role and ``content`` and
    nothing else). The task code makes this prompt-design choice for its own
    conversations; ``jaxkv.chat.render`` refuses ``tools`` such a template would
    drop and leaves the choice to the caller:

    * the system message gains one line per tool schema (JSON) and how to call one;
    * an assistant message becomes ``jaxkv.chat.render.assistant_as_text``: its
      reasoning in ``<think>..</think>``, its content, then each call as
      ``<tool_call>{"name": .., "arguments": {..}}</tool_call>`` (the bracket text
      Qwen's templates write, so ``jaxkv.chat.parse`` reads the model's own calls back);
    * tool results keep the ``tool`` role (the tagger's TOOL phase).

    Messages stay one for one (index ``j`` here is index ``j`` of the input), so
    scored turns and labels that point at message indices still hold.
    """
    from jaxkv.chat.render import assistant_as_text

    if tools and not (messages and messages[0].get("role") == "system"):
        raise ValueError("inline_tools needs a system message to carry the tool schemas (indices stay one for one)")
    out = []
    schemas = "\n".join(json.dumps(t) for t in tools or ())
    for i, m in enumerate(messages):
        m = dict(m)
        if i == 0 and m.get("role") == "system" and schemas:
            m["content"] = (
                f"{m.get('content') or ''}\n\nTools you can call, one JSON schema per line:\n{schemas}\n"
                'To call a tool, reply with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
            )
        if m.get("role") == "assistant":
            m = assistant_as_text(m)
        out.append(m)
    return out


def for_template(example: "Example", tokenizer) -> "Example":
    """``example`` as ``tokenizer``'s chat template can render it: unchanged when
    the template renders tools, else with ``inline_tools`` and no ``tools``."""
    from jaxkv.chat.render import template_takes_tools

    if not example.tools or template_takes_tools(tokenizer):
        return example
    return dataclasses.replace(example, messages=inline_tools(example.messages, example.tools), tools=[])


def approx_tokens(text: str) -> int:
    """Tokens of ``text`` under the embedded tokenizer (see the module docstring)."""
    n = 0
    for run in _RUN_RE.findall(text):
        body = run[1:] if len(run) > 1 and run[0] == " " else run
        space = len(run) - len(body)
        if body in UNSPACED_WORDS or not (body[0].isalnum() or body[0] == "_"):
            n += 1 + space  # identifiers, project names and punctuation never carry the space
        elif _IDENT_RE.match(body):
            n += len(body)  # spelled out; the first character carries the space
        else:
            n += 1  # a prose word (every generated word is in the vocabulary)
    return n


def conversation_tokens(messages: list[dict], tools: list[dict]) -> int:
    total = TEMPLATE_TOKENS_FOR_TOOLS + sum(approx_tokens(json.dumps(t)) for t in tools) if tools else 0
    for m in messages:
        total += TEMPLATE_TOKENS_PER_MESSAGE + approx_tokens(m.get("content") or "")
        total += approx_tokens(m.get("reasoning_content") or "")
        for call in m.get("tool_calls") or ():
            total += 8 + approx_tokens(json.dumps(call["function"]))
    return total


class PoolExhausted(ValueError):
    """An identifier pool has no identifier left for this example."""


class IdentifierPool:
    """Draws identifiers from the fixed pools without repetition within one example."""

    def __init__(self, rng: random.Random):
        self._rng = rng
        self._left = {"k": list(KEY_POOL), "v": list(VALUE_POOL), "d": list(DOC_POOL)}

    def left(self, prefix: str) -> int:
        """Identifiers of pool ``prefix`` (``"k"``, ``"v"``, ``"d"``) not yet drawn."""
        return len(self._left[prefix])

    def exclude(self, identifiers) -> None:
        """Never draw ``identifiers`` (those an example takes from elsewhere)."""
        gone = set(identifiers)
        for prefix, left in self._left.items():
            left[:] = [x for x in left if x not in gone]

    def draw(self, prefix: str) -> str:
        left = self._left[prefix]
        if not left:
            raise PoolExhausted(f"identifier pool {prefix!r} exhausted; lower `length`")
        i = self._rng.randrange(len(left))
        left[i], left[-1] = left[-1], left[i]
        return left.pop()

    def key(self) -> str:
        return self.draw("k")

    def value(self) -> str:
        return self.draw("v")

    def doc_id(self) -> str:
        return self.draw("d")


def find_evidence(messages: list[dict], value: str, before: int) -> Evidence:
    """The first occurrence of ``value`` as a whole token run in ``messages[:before]``."""
    pattern = re.compile(rf"(?<!\w){re.escape(value)}(?!\w)")
    for i, m in enumerate(messages[:before]):
        hit = pattern.search(m.get("content") or "")
        if hit:
            return Evidence(value, i, hit.start(), hit.end())
    raise AssertionError(f"value {value!r} does not occur before message {before}")


def join_list(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def tool_call(name: str, **arguments: str) -> dict:
    """An OpenAI-style ``tool_calls`` entry."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def scored(messages: list[dict], index: int, kind: str, expected: Any, values: list[str]) -> ScoredTurn:
    """A ``ScoredTurn`` whose evidence is looked up in the messages before ``index``."""
    evidence = tuple(find_evidence(messages, v, index) for v in values)
    return ScoredTurn(index, kind, expected, evidence, tuple(values))


def example_seed(seed: int, i: int) -> int:
    """Per-example seed: example ``i`` of a batch is reproducible on its own."""
    return (seed * 1_000_003 + i) & 0x7FFFFFFF
