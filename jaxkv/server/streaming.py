"""Streaming a reply: generated token ids in, OpenAI message deltas out.

``ReplyStream`` reads one turn's reply as its tokens arrive and yields deltas
(``{"reasoning_content": ...}``, ``{"content": ...}``, one complete tool call at a
time). The promise: the deltas concatenate **exactly** to the message of the
final reply (``ReplyFormat.parse`` of the whole text, what a non-streaming
request answers), for any token sequence.

How it keeps that promise: after each piece, the text so far is cut back to a
*settled* prefix, one no continuation can reinterpret, and parsed with the same
``ReplyFormat.parse`` as the final reply; only what extends the already sent
text is sent. The settled prefix excludes

* a trailing incomplete character (the tokenizer's U+FFFD for a split
  multi-byte character);
* a trailing partial marker (``<tool_c``, ``</thi``, ``<|im_e``), and an
  unclosed ``<tool_call>`` block or a ``<|python_tag|>`` call, so no fragment of
  tool-call markup is ever sent as content;
* a stop string (the reply ends before it) and a trailing partial one;
* trailing whitespace (a later tool call strips it from the content).

Content that starts with whitespace is held while no tool call was parsed (a
call would strip it). The reasoning split is positional (``ReplyFormat``), so a
settled prefix parses to a prefix of the final reasoning and content. Tool calls
are sent when their block closes (name and JSON-text arguments in one delta).
``finish(final_reply)`` sends what remains.
"""

from __future__ import annotations

import logging

from jaxkv.chat.parse import END_TOKENS, ReplyFormat

log = logging.getLogger(__name__)

MARKERS = ("<tool_call>", "</tool_call>", "<think>", "</think>", "<|python_tag|>", *END_TOKENS)


def settled_text(text: str, fmt: ReplyFormat) -> str:
    """The prefix of a reply text that no continuation can reinterpret (module docstring)."""
    cut = fmt.find_stop(text)
    if cut is not None:
        return text[:cut].rstrip()
    end = len(text)
    for stop in fmt.stop:  # a partial stop string at the end
        for k in range(min(len(stop) - 1, end - len(fmt.prefix)), 0, -1):
            if text.endswith(stop[:k]):
                end = min(end, len(text) - k)
                break
    text = text[:end]
    while text.endswith("\ufffd"):  # an incomplete multi-byte character
        text = text[:-1]
    j = text.rfind("<")
    if j >= 0 and ">" not in text[j:] and any(m.startswith(text[j:]) for m in MARKERS):
        text = text[:j]
    opened = text.rfind("<tool_call>")
    if opened >= 0 and "</tool_call>" not in text[opened:]:
        text = text[:opened]
    tag = text.find("<|python_tag|>")
    if tag >= 0:
        text = text[:tag]
    return text.rstrip()


class ReplyStream:
    """Deltas of one reply as its tokens arrive (module docstring).

    Args:
      tokenizer: decodes the reply ids (special tokens kept, as the final parse).
      fmt: the turn's ``ReplyFormat`` (``ChatHandle.format``).
      call_ids: makes the id of each tool call (``protocol.new_id``).
    """

    def __init__(self, tokenizer, fmt: ReplyFormat, call_ids):
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.call_ids = call_ids
        self.ids: list[int] = []
        self.sent = {"reasoning_content": "", "content": ""}
        self.calls_sent = 0
        self.tool_calls: list[dict] = []  # the calls sent, with their ids (for the final message)

    def feed(self, ids) -> list[dict]:
        """Deltas made certain by the new token ids."""
        self.ids.extend(int(t) for t in ids)
        text = self.fmt.prefix + self.tokenizer.decode(self.ids, skip_special_tokens=False)
        return self._deltas(self.fmt.parse(settled_text(text, self.fmt)), final=False)

    def finish(self, reply: dict) -> list[dict]:
        """The remaining deltas, given the final parsed reply."""
        return self._deltas(reply, final=True)

    def _deltas(self, reply: dict, *, final: bool) -> list[dict]:
        out = []
        calls = reply.get("tool_calls") or []
        pieces = {"reasoning_content": reply.get("reasoning_content") or "", "content": reply.get("content") or ""}
        if not final and not calls and pieces["content"][:1].isspace():
            pieces["content"] = ""  # a later call would strip it
        for field, text in pieces.items():
            sent = self.sent[field]
            if not text.startswith(sent):
                if final:
                    log.error("streamed %s %r is not a prefix of the final %r", field, sent, text)
                continue
            if len(text) > len(sent):
                out.append({field: text[len(sent) :]})
                self.sent[field] = text
        for index in range(self.calls_sent, len(calls)):
            fn = calls[index]["function"]
            call = {"id": self.call_ids(), "type": "function", "function": {"name": fn["name"], "arguments": fn["arguments"]}}
            self.tool_calls.append(call)
            out.append({"tool_calls": [{"index": index, **call}]})
        self.calls_sent = max(self.calls_sent, len(calls))
        return out
