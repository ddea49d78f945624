"""Per-token tags from chat-template structure: AgentKV phases, TriAxialKV triples, spans.

One scan over the token ids, driven only by special-token ids (role markers, message
delimiters, bracket markers) and the text of role-header tokens; no model inference.
Every output array is aligned with the tokens.

Layouts recognised (``ChatMarkers.layout``):
  * ``"chatml"`` (Qwen2.5, Qwen3): ``<|im_start|>role\\n ... <|im_end|>``; the header
    ends at the first token whose text contains a newline.
  * ``"llama3"`` (Llama-3.1): ``<|start_header_id|>role<|end_header_id|>\\n\\n ...
    <|eot_id|>`` (or ``<|eom_id|>``); one whitespace token after the header is header.
  * anything else: ``"unknown"`` -- a warning is logged and every token is
    ``OTHERS`` / ``DELIM`` with empty spans. Never an exception.

Messages and their base tags (phase, semantic) for content outside any bracket:
  system -> (OTHERS, INST), user -> (OTHERS, USER), assistant -> (OTHERS, ASSISTANT),
  tool / ipython / function -> (TOOL, OBS); an unknown role -> (OTHERS, DELIM) plus a
  warning. A user message whose first content token is ``<tool_response>`` (Qwen's
  way of returning tool results) is a *tool-result* message: base (TOOL, DELIM), its
  kind becomes ``"tool"``, and it does not start a turn.
Brackets inside a message override the base:
  ``<think>..</think>`` -> (THINK, REASONING), ``<tool_call>..</tool_call>`` ->
  (ACT, TOOL_CALL), ``<tool_response>..</tool_response>`` -> (TOOL, OBS),
  ``<|python_tag|>`` .. end of message -> (ACT, TOOL_CALL).
Brackets are ignored inside system messages (Qwen's tools preamble shows an example
``<tool_call>`` there: it is instruction, INST / OTHERS, with the marker DELIM).
Markers and scaffolding:
  * every marker token, role header and message delimiter has semantic DELIM;
  * a marker belongs to the phase it opens (AgentKV App. D.2): ``<think>`` is THINK,
    ``</think>`` is the message's base phase, a tool-role header is TOOL, a
    message-close token and the tokens between messages are OTHERS.
Temporal: a turn runs from the header of one user message (not a tool-result
message) up to, not including, the next; tokens before the first user message join
the first turn. ``CURRENT`` is the last turn, then ``TURN_M1``, ``TURN_M2``,
``OLDER``. Modal: ``IMAGE`` for image-placeholder tokens (``<|image_pad|>``),
else ``TEXT``; an image token takes its message's phase and semantic, and the
vision brackets around it are DELIM.

Streaming: ``TagScanner.feed`` continues the scan over decoded tokens, so the engine
tags generated tokens (the phase of each decoded query for the AgentKV rings) with
the same state machine. A header split across two ``feed`` calls keeps the
provisional tags of its tokens fed earlier (generation ends at a message close, so
this does not occur in decode).

Copy sub-tags of the tool output (``Copy``, the fourth tag axis, issue 74 item 4):
which tool-output tokens a later reply may copy. ``copy_subtags`` reads the text of
each maximal run of ``OBS`` tokens (the concatenated pieces, ``ChatMarkers.piece``
per id) and matches, left to right without overlap, quoted strings
(``"..."``, backslash escapes, no newline) and bare words (runs of ASCII letters,
digits and ``_``):
  * ``KEY``: a word or quoted string whose next non-blank character is ``:`` or
    ``=`` (a JSON key, ``k066`` in ``k066: v053``, the cue before a value);
  * ``VALUE``: any other quoted string, or a bare word holding a digit or ``_``
    (identifiers, numbers, ids: ``v053``, ``d038``, ``user_id``, ``42``);
  * ``PLAIN``: everything else (prose words, punctuation, whitespace, footers), and
    every token that is not ``OBS``.
A token takes the highest class (``PLAIN < KEY < VALUE``) of the characters it
holds, so `` v`` of `` v053`` is ``VALUE`` and ``:`` is ``PLAIN``. Deterministic,
O(T + characters), one ``piece`` per distinct id (cached by ``ChatMarkers``);
decode-time tokens (``TagScanner.feed``) are ``PLAIN``. The axis is a separate
code range (``tag_codes``: ``triaxial code + NUM_TRIAXIAL_CODES * copy``), so a
``PLAIN`` token's code is its triaxial code of before the axis existed, and an
allocation without the ``copy`` axis gives every copy class of a tag the same bits.

Cost: O(T) Python steps; one ``decode`` per distinct header-token id (cached).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import re
from typing import Callable

import numpy as np

from jaxkv.errors import ChatError

log = logging.getLogger(__name__)


class Phase(enum.IntEnum):
    """AgentKV phase of a token."""

    THINK = 0
    ACT = 1
    TOOL = 2
    OTHERS = 3


class Temporal(enum.IntEnum):
    """TriAxialKV temporal axis: distance of a token's turn from the last turn."""

    OLDER = 0
    TURN_M2 = 1
    TURN_M1 = 2
    CURRENT = 3


class Modal(enum.IntEnum):
    TEXT = 0
    IMAGE = 1


class Semantic(enum.IntEnum):
    """TriAxialKV semantic axis (Table 1 of the paper)."""

    INST = 0
    USER = 1
    ASSISTANT = 2
    REASONING = 3
    TOOL_CALL = 4
    OBS = 5
    DELIM = 6


class Copy(enum.IntEnum):
    """Copy sub-tag of a tool-output token (module docstring); ``PLAIN`` elsewhere."""

    PLAIN = 0
    KEY = 1
    VALUE = 2


TRIAXIAL_DTYPE = np.dtype([("temporal", np.int8), ("modal", np.int8), ("semantic", np.int8), ("copy", np.int8)])
NUM_TRIAXIAL_CODES = len(Temporal) * len(Modal) * len(Semantic)
NUM_TAG_CODES = NUM_TRIAXIAL_CODES * len(Copy)


def triaxial_codes(triaxial: np.ndarray) -> np.ndarray:
    """Flat tag code per token, the index into a per-tag bit-width table:
    ``(temporal * |Modal| + modal) * |Semantic| + semantic`` in ``[0, NUM_TRIAXIAL_CODES)``,
    plus ``NUM_TRIAXIAL_CODES * copy`` where the array has the ``copy`` field (codes in
    ``[0, NUM_TAG_CODES)``; a ``PLAIN`` token's code is the code without the axis)."""
    t = triaxial["temporal"].astype(np.int32)
    m = triaxial["modal"].astype(np.int32)
    s = triaxial["semantic"].astype(np.int32)
    c = triaxial["copy"].astype(np.int32) if "copy" in (triaxial.dtype.names or ()) else 0
    return (t * len(Modal) + m) * len(Semantic) + s + NUM_TRIAXIAL_CODES * c


_COPY_PATTERN = re.compile(r'"(?:[^"\\\n]|\\.)*"|[A-Za-z0-9_]+')
_KEY_FOLLOWS = re.compile(r"[ \t]*[:=]")


def copy_subtags(ids, semantic: np.ndarray, piece: Callable[[int], str]) -> np.ndarray:
    """``Copy`` per token ``[T]`` int8 (module docstring): non-``PLAIN`` only inside
    runs of ``Semantic.OBS`` tokens, from the text ``piece`` gives each id."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    semantic = np.asarray(semantic).reshape(-1)
    if semantic.size != ids.size:
        raise ChatError(f"copy_subtags: {ids.size} token ids but {semantic.size} semantic tags")
    out = np.zeros(ids.size, np.int8)
    obs = np.concatenate([[False], semantic == Semantic.OBS, [False]])
    starts = np.flatnonzero(~obs[:-1] & obs[1:])
    ends = np.flatnonzero(obs[:-1] & ~obs[1:])
    for a, b in zip(starts.tolist(), ends.tolist()):
        pieces = [piece(int(i)) for i in ids[a:b].tolist()]
        text = "".join(pieces)
        cls = np.zeros(len(text), np.int8)
        for match in _COPY_PATTERN.finditer(text):
            word = match.group()
            if _KEY_FOLLOWS.match(text, match.end()):
                cls[match.start() : match.end()] = Copy.KEY
            elif word.startswith('"') or any(ch.isdigit() or ch == "_" for ch in word):
                cls[match.start() : match.end()] = Copy.VALUE
        lengths = np.fromiter((len(p) for p in pieces), np.int64, len(pieces))
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        has = lengths > 0  # a token that decodes to nothing stays PLAIN
        if has.any():
            out[a:b][has] = np.maximum.reduceat(cls, offsets[has])
    return out


def triaxial_array(ids, tags: TokenTags, temporal: np.ndarray, markers: ChatMarkers) -> np.ndarray:
    """The ``[T]`` ``TRIAXIAL_DTYPE`` array of a scanned prompt (``tag_prompt``'s
    tags and temporal axis; the copy sub-tags from ``copy_subtags``)."""
    tri = np.empty(tags.semantic.size, TRIAXIAL_DTYPE)
    tri["temporal"], tri["modal"], tri["semantic"] = temporal, tags.modal, tags.semantic
    tri["copy"] = copy_subtags(ids, tags.semantic, markers.piece)
    return tri


_ROLE_KIND = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool", "ipython": "tool", "function": "tool"}
_KIND_BASE = {
    "system": (Phase.OTHERS, Semantic.INST),
    "user": (Phase.OTHERS, Semantic.USER),
    "assistant": (Phase.OTHERS, Semantic.ASSISTANT),
    "tool": (Phase.TOOL, Semantic.OBS),
    "unknown": (Phase.OTHERS, Semantic.DELIM),
}
_TOOL_RESULT_BASE = (Phase.TOOL, Semantic.DELIM)
_OUTSIDE = (Phase.OTHERS, Semantic.DELIM)
_MAX_HEADER_CHARS = 64  # a role header longer than this is treated as unrecognised


@dataclasses.dataclass(frozen=True)
class ChatMarkers:
    """Special-token ids that drive the scan, resolved once per tokenizer.

    Attributes:
      layout: ``"chatml"``, ``"llama3"`` or ``"unknown"``.
      msg_open: id opening a message header (``<|im_start|>`` / ``<|start_header_id|>``).
      header_close: id ending a header (Llama ``<|end_header_id|>``); None for chatml.
      msg_close: ids closing a message (``<|im_end|>``; ``<|eot_id|>``, ``<|eom_id|>``).
      brackets: opening id -> (closing id or None, phase, semantic); None closes at
        the end of the message (``<|python_tag|>``).
      image: image-placeholder ids.
      scaffold: template ids tagged DELIM wherever they occur (``<|vision_start|>``,
        ``<|vision_end|>``, ``<|begin_of_text|>`` and every bracket marker, so a
        marker where it opens or closes nothing is DELIM with the current phase).
      piece: decoded text of one token id (used for role headers only).
    """

    layout: str
    msg_open: int | None
    header_close: int | None
    msg_close: frozenset[int]
    brackets: dict[int, tuple[int | None, Phase, Semantic]]
    image: frozenset[int]
    scaffold: frozenset[int]
    piece: Callable[[int], str]

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "ChatMarkers":
        vocab = tokenizer.get_vocab()

        def tid(token: str) -> int | None:
            return vocab.get(token)

        cache: dict[int, str] = {}

        def piece(token_id: int) -> str:
            if token_id not in cache:
                cache[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
            return cache[token_id]

        # a tokenizer may carry both marker sets (the toy one does): the template decides
        template = tokenizer.chat_template if isinstance(getattr(tokenizer, "chat_template", None), str) else ""
        prefer_llama = "<|start_header_id|>" in template and "<|im_start|>" not in template
        if tid("<|im_start|>") is not None and tid("<|im_end|>") is not None and not prefer_llama:
            layout, msg_open, header_close = "chatml", tid("<|im_start|>"), None
            msg_close = {tid("<|im_end|>")}
        elif tid("<|start_header_id|>") is not None and tid("<|end_header_id|>") is not None:
            layout, msg_open, header_close = "llama3", tid("<|start_header_id|>"), tid("<|end_header_id|>")
            msg_close = {tid("<|eot_id|>"), tid("<|eom_id|>")} - {None}
        else:
            layout, msg_open, header_close, msg_close = "unknown", None, None, set()
        brackets: dict[int, tuple[int | None, Phase, Semantic]] = {}
        for open_tok, close_tok, phase, sem in (
            ("<think>", "</think>", Phase.THINK, Semantic.REASONING),
            ("<tool_call>", "</tool_call>", Phase.ACT, Semantic.TOOL_CALL),
            ("<tool_response>", "</tool_response>", Phase.TOOL, Semantic.OBS),
        ):
            if tid(open_tok) is not None and tid(close_tok) is not None:
                brackets[tid(open_tok)] = (tid(close_tok), phase, sem)
        if tid("<|python_tag|>") is not None:
            brackets[tid("<|python_tag|>")] = (None, Phase.ACT, Semantic.TOOL_CALL)
        image = frozenset(i for i in (tid("<|image_pad|>"), tid("<|image|>")) if i is not None)
        scaffold = {tid(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|begin_of_text|>")}
        scaffold |= {i for opener, (closer, _, _) in brackets.items() for i in (opener, closer)}
        scaffold -= {None}
        return cls(layout, msg_open, header_close, frozenset(msg_close), brackets, image, frozenset(scaffold), piece)


@dataclasses.dataclass
class Message:
    """One message found by the scan (token indices, half-open).

    Attributes:
      role: role text from the header; kind: system/user/assistant/tool/unknown.
      start: index of the header's first token; content_start: first content token;
      content_end: index of the closing token (or the end of the tokens, if open);
      end: one past the closing token (== content_end while open).
    """

    role: str
    kind: str
    start: int
    content_start: int
    content_end: int
    end: int

    @property
    def closed(self) -> bool:
        return self.end > self.content_end


@dataclasses.dataclass(frozen=True)
class TokenTags:
    """Tags of a run of tokens, all arrays ``[T]``.

    Attributes:
      phase: ``Phase`` per token (int8).
      semantic, modal: ``Semantic`` / ``Modal`` per token (int8).
      turn: turn index per token (int32, first turn is 1).
    """

    phase: np.ndarray
    semantic: np.ndarray
    modal: np.ndarray
    turn: np.ndarray


class TagScanner:
    """The tagging state machine; ``feed`` tags tokens and keeps state for more."""

    def __init__(self, markers: ChatMarkers):
        self.markers = markers
        self.messages: list[Message] = []
        self.position = 0  # absolute index of the next token fed
        self.turn = 1
        self._seen_user_turn = False
        self._msg: Message | None = None  # the open message
        self._base = _OUTSIDE
        self._bracket: tuple[int | None, Phase, Semantic] | None = None
        self._header: str | None = None  # accumulated header text while in a header
        self._absorb_newlines = 0  # Llama: newlines after <|end_header_id|> still to absorb
        self._await_first_content = False  # user message: is it a tool-result message?
        if markers.layout == "unknown":
            log.warning("chat template not recognised; tagging every token OTHERS/DELIM")

    def feed(self, ids) -> TokenTags:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n = ids.size
        phase = np.full(n, Phase.OTHERS, np.int8)
        sem = np.full(n, Semantic.DELIM, np.int8)
        modal = np.zeros(n, np.int8)
        turn = np.zeros(n, np.int32)
        offset = self.position
        m = self.markers
        for j, tok in enumerate(ids.tolist()):
            i = offset + j
            if tok in m.image:
                modal[j] = Modal.IMAGE
            if m.layout != "unknown":
                phase[j], sem[j] = self._step(tok, i, turn, phase, offset)
            turn[j] = self.turn
        self.position += n
        return TokenTags(phase, sem, modal, turn)

    # -- the state machine ------------------------------------------------------
    def _step(self, tok: int, i: int, turn: np.ndarray, phase: np.ndarray, offset: int):
        m = self.markers
        if tok == m.msg_open:
            self._close_message(i, closed=False)
            self._msg = Message("", "unknown", i, i + 1, i + 1, i + 1)
            self._header, self._bracket, self._base = "", None, _OUTSIDE
            return _OUTSIDE
        if self._header is not None:
            if not (tok in m.msg_close or tok in m.scaffold or tok in m.image):
                return self._step_header(tok, i, phase, offset)
            # a marker cuts the header short (Qwen2.5: '<|im_start|>assistant<tool_call>')
            self._resolve_header(self._header.strip(), i, i, phase, offset)
        if self._absorb_newlines > 0:  # Llama: the blank line after the header
            text = m.piece(tok)
            if text.strip() == "":
                self._absorb_newlines -= max(text.count("\n"), 1)
                self._msg.content_start = i + 1
                return (self._header_phase(), Semantic.DELIM)
            self._absorb_newlines = 0
        if self._await_first_content:  # first content token of a user message
            self._await_first_content = False
            bracket = m.brackets.get(tok)
            if bracket is not None and bracket[1] == Phase.TOOL:
                self._msg.kind, self._base = "tool", _TOOL_RESULT_BASE
            else:
                self._start_turn(i, turn, offset)
        if tok in m.msg_close:
            self._close_message(i, closed=True)
            return _OUTSIDE
        bracket = m.brackets.get(tok) if self._msg is not None and self._msg.kind != "system" else None
        if bracket is not None and self._bracket is None:
            self._bracket = bracket
            return (bracket[1], Semantic.DELIM)
        if self._bracket is not None and tok == self._bracket[0]:
            self._bracket = None
            return (self._base[0], Semantic.DELIM)
        if tok in m.scaffold:  # scaffolding, or a bracket marker out of place
            return (self._bracket[1] if self._bracket is not None else self._base[0], Semantic.DELIM)
        if self._bracket is not None:
            return (self._bracket[1], self._bracket[2])
        return self._base

    def _step_header(self, tok: int, i: int, phase: np.ndarray, offset: int):
        """A token inside a role header: accumulate its text until the header ends."""
        m = self.markers
        if m.layout == "llama3":
            done = tok == m.header_close
            if not done:
                self._header += m.piece(tok)
            role = self._header
        else:
            self._header += m.piece(tok)
            done = "\n" in self._header
            role = self._header.split("\n", 1)[0]
        if not done and len(self._header) <= _MAX_HEADER_CHARS:
            return _OUTSIDE
        self._resolve_header(role.strip() if done else "", i + 1, i, phase, offset)
        return (self._header_phase(), Semantic.DELIM)

    def _resolve_header(self, role: str, content_start: int, i: int, phase: np.ndarray, offset: int) -> None:
        """The open message's role is known at token ``i``; its content starts at
        ``content_start``. Header tokens before ``i`` fed in this call get the phase
        the header opens (the caller tags token ``i``)."""
        kind = _ROLE_KIND.get(role, "unknown")
        if kind == "unknown":
            log.warning("unrecognised chat role %r at token %d; tagging it OTHERS/DELIM", role, content_start)
        msg = self._msg
        msg.role, msg.kind, msg.content_start = role, kind, content_start
        msg.content_end = msg.end = content_start
        self._header = None
        self._base = _KIND_BASE[kind]
        self._absorb_newlines = 2 if self.markers.layout == "llama3" else 0
        self._await_first_content = kind == "user"
        phase[max(msg.start - offset, 0) : i - offset] = self._header_phase()

    def _header_phase(self) -> Phase:
        return Phase.TOOL if self._msg is not None and self._msg.kind == "tool" else Phase.OTHERS

    def _start_turn(self, i: int, turn: np.ndarray, offset: int) -> None:
        """The open user message starts a turn: its tokens before ``i`` join it."""
        if self._seen_user_turn:
            self.turn += 1
        self._seen_user_turn = True
        turn[max(self._msg.start - offset, 0) : i - offset] = self.turn

    def _close_message(self, i: int, closed: bool) -> None:
        msg = self._msg
        if msg is None:
            return
        if self._header is not None:  # header never finished
            msg.content_start = i
        msg.content_end = i
        msg.end = i + 1 if closed else i
        self.messages.append(msg)
        self._msg, self._base, self._bracket, self._header = None, _OUTSIDE, None, None
        self._absorb_newlines, self._await_first_content = 0, False

    def open_message(self) -> Message | None:
        """The message still open at the end of the tokens fed (e.g. the generation
        prompt's assistant header), with ``content_end == end ==`` tokens fed."""
        if self._msg is None:
            return None
        msg = dataclasses.replace(self._msg)
        if self._header is not None:
            msg.content_start = self.position
        msg.content_end = msg.end = self.position
        return msg


# -- whole-prompt tagging ---------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Spans:
    """Half-open token spans of a rendered prompt; ``(0, 0)`` means absent.

    Attributes:
      protected_prefix: every token before the first non-system message (BOS, system
        prompt, tool schemas); ``(0, T)`` if every message is a system message.
      actionable_query: content of the latest user or tool-result message; if that is
        a tool-result message, extended back over the tool-result messages right
        before it (all results of the last round of calls).
      session_span: content of the first user message (not a tool-result message).
    """

    protected_prefix: tuple[int, int]
    actionable_query: tuple[int, int]
    session_span: tuple[int, int]


def tag_prompt(ids, markers: ChatMarkers) -> tuple[TokenTags, np.ndarray, Spans, list[Message], TagScanner]:
    """Scan a whole prompt: tags, temporal axis, spans and the scanner for decode.

    Returns ``(tags, temporal[T] int8, spans, messages, scanner)``; ``messages``
    includes a still-open last message (the generation prompt).
    """
    scanner = TagScanner(markers)
    tags = scanner.feed(ids)
    n = int(tags.phase.size)
    last_turn = int(tags.turn.max()) if n else 1
    temporal = np.maximum(Temporal.CURRENT - (last_turn - tags.turn), Temporal.OLDER).astype(np.int8)
    messages = list(scanner.messages)
    open_msg = scanner.open_message()
    if open_msg is not None:
        messages.append(open_msg)
    spans = find_spans(messages, n, markers.layout != "unknown")
    return tags, temporal, spans, messages, scanner


def find_spans(messages: list[Message], n: int, recognised: bool = True) -> Spans:
    """The three spans of ``Spans`` from the scanned messages of ``n`` tokens."""
    if not recognised:
        return Spans((0, 0), (0, 0), (0, 0))
    first_other = next((msg.start for msg in messages if msg.kind != "system"), n)
    protected = (0, first_other) if first_other > 0 else (0, 0)

    actionable = (0, 0)
    for k in range(len(messages) - 1, -1, -1):
        if messages[k].kind in ("user", "tool"):
            first = k
            if messages[k].kind == "tool":
                while first > 0 and messages[first - 1].kind == "tool":
                    first -= 1
            actionable = (messages[first].content_start, messages[k].content_end)
            break

    session = next(((msg.content_start, msg.content_end) for msg in messages if msg.kind == "user"), (0, 0))
    return Spans(protected, actionable, session)
