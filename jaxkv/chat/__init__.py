"""Chat requests as token ids: rendering, per-token tags and spans, tool-call
parsing, session ids, and a toy tokenizer with a Qwen3-format template."""

from jaxkv.chat.parse import ReplyFormat, forced_call_prefix, parse_assistant, stop_token_ids
from jaxkv.chat.render import Rendered, render
from jaxkv.chat.session_id import derive_session_id
from jaxkv.chat.tags import Copy, Modal, Phase, Semantic, Spans, TagScanner, Temporal, triaxial_codes
from jaxkv.chat.toy import build_tokenizer

__all__ = [
    "Copy",
    "Modal",
    "Phase",
    "Rendered",
    "ReplyFormat",
    "Semantic",
    "Spans",
    "TagScanner",
    "Temporal",
    "build_tokenizer",
    "derive_session_id",
    "forced_call_prefix",
    "parse_assistant",
    "render",
    "stop_token_ids",
    "triaxial_codes",
]
