"""A small, deterministic tokenizer with Qwen special tokens and a Qwen3 chat template.

Used by the tests (tagger expectations are written by hand over whole-word tokens)
and by the embedded-model trainer, which needs a vocabulary it controls.

Design:
  * Model: ``tokenizers`` Unigram with byte fallback. The vocabulary is, in id order,
    the special tokens, ``<unk>``, the 256 byte tokens ``<0x00>``..``<0xFF>``, the
    printable ASCII characters (plus ``\\t \\n \\r``), ``TEMPLATE_WORDS`` (role names
    and the words of the tools preamble), then ``words`` in the given order
    (duplicates and words already present skipped). Same arguments, same ids.
  * Pre-tokenizer: text is cut into runs of word characters (``\\w+``), single
    punctuation characters and single whitespace characters. A run that is a vocabulary
    word is one token (words score higher than characters); any other run is spelled
    with characters; a character outside the vocabulary falls back to its UTF-8
    bytes. So encode/decode is lossless for every string (no normaliser, no
    clean-up of spaces), and a space is its own token.
  * ``words`` must be ``\\w+`` runs (the pre-tokenizer never yields anything else).
  * Optional space-prefixed words (``spaced_words``): each listed word also gets a
    variant carrying its leading space (``" report"``), as do the single letters and
    digits, and the pre-tokenizer then keeps one space attached to the run after it.
    A listed word after a space is one token instead of two; any other run after a
    space (an identifier such as ``k123``, punctuation) stays a space token plus the
    run, so such a run is the same token wherever it appears (prose or JSON). The
    embedded model uses this to halve the distance between a word and the words
    around it; the tests' tokenizers leave it off.
  * Qwen specials ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ``<|image_pad|>``,
    ``<|vision_start|>``, ``<|vision_end|>`` are special (skipped by
    ``decode(skip_special_tokens=True)``); the bracket markers ``<think>``,
    ``</think>``, ``<tool_call>``, ``</tool_call>``, ``<tool_response>``,
    ``</tool_response>`` are added but not special, as in Qwen3, so generated text
    keeps them for the tool-call parser.

The default chat template (``QWEN3_CHAT_TEMPLATE``) reproduces the Qwen3 layout (see
its own comment) and adds a ``keep_reasoning`` variable and image content parts.
"""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

if TYPE_CHECKING:  # imported where a tokenizer is built: ``import jaxkv`` stays free of transformers (~0.8 s)
    from transformers import PreTrainedTokenizerFast

QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
QWEN_MARKER_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
UNK_TOKEN = "<unk>"
_BYTE_TOKENS = tuple(f"<0x{b:02X}>" for b in range(256))
_CHARS = tuple(dict.fromkeys(string.printable))  # digits, letters, punctuation, whitespace
_WORD_RE = re.compile(r"^\w+$")
# log-probabilities: a known word beats spelling it out, a character beats bytes.
_WORD_SCORE, _CHAR_SCORE, _BYTE_SCORE, _SPECIAL_SCORE = -1.0, -10.0, -20.0, -100.0

# Qwen3's template (tokenizer_config.json of the Qwen3 releases), reproduced:
#  * with tools: one system turn = system prompt + "# Tools" section listing each
#    schema as JSON inside <tools></tools>;
#  * each message as <|im_start|>role\n...<|im_end|>\n;
#  * assistant reasoning as <think>\n...\n</think>\n\n, rendered only for assistant
#    turns after the last real user query (earlier reasoning is dropped) unless
#    keep_reasoning is true;
#  * tool calls as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>;
#  * tool results as a user turn of <tool_response>\n...\n</tool_response> blocks,
#    consecutive tool messages grouped into one turn;
#  * add_generation_prompt appends <|im_start|>assistant\n.
# Additions: keep_reasoning; list content with {"type": "text"} and {"type": "image"}
# parts (an image renders <|vision_start|><|image_pad|>*n<|vision_end|>, n from
# "num_tokens", default 1).
QWEN3_CHAT_TEMPLATE = r"""
{%- macro render_content(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if part.type == 'image' -%}{{ '<|vision_start|>' + '<|image_pad|>' * (part.num_tokens or 1) + '<|vision_end|>' }}
{%- elif part.type == 'text' -%}{{ part.text }}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}
{{- render_content(messages[0].content) + '\n\n' }}
{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}
{{- "\n" }}{{- tool | tojson }}
{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
{%- set index = (messages|length - 1) - loop.index0 %}
{%- if ns.multi_step_tool and message.role == 'user' and not (message.content is string and message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
{%- set ns.multi_step_tool = false %}
{%- set ns.last_query_index = index %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = render_content(message.content) if message.content is not none else '' %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning_content = '' %}
{%- if message.reasoning_content is string %}
{%- set reasoning_content = message.reasoning_content %}
{%- elif '</think>' in content %}
{%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{%- if (loop.index0 > ns.last_query_index or keep_reasoning) and (loop.last or reasoning_content) %}
{{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + content }}
{%- endif %}
{%- if message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- if (loop.first and content) or (not loop.first) %}{{- '\n' }}{%- endif %}
{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
""".strip()


# Words the templates and tool schemas write, so role headers and the "# Tools"
# preamble are whole tokens; they come before the caller's words.
TEMPLATE_WORDS = tuple(
    "system user assistant tool ipython Tools You may call one or more functions to assist "
    "with the query are provided function signatures within tools XML tags For each return "
    "a json object name and arguments tool_call type description parameters properties "
    "required string integer number boolean array items enum".split()
)


_SPACED_CHARS = tuple(" " + c for c in string.ascii_letters + string.digits)


def toy_vocab(words: Iterable[str], extra_special: Sequence[str] = (), spaced_words: Iterable[str] | None = None) -> list[str]:
    """The id-ordered vocabulary ``build_tokenizer`` uses (see the module docstring)."""
    words = list(words)
    spaced = None if spaced_words is None else list(spaced_words)
    bad = [w for w in words + (spaced or []) if not _WORD_RE.match(w)]
    if bad:
        raise ValueError(f"vocabulary words must be \\w+ runs, got {bad[:5]}")
    head = [*QWEN_SPECIAL_TOKENS, *QWEN_MARKER_TOKENS, *extra_special, UNK_TOKEN]
    vocab = [*head, *_BYTE_TOKENS, *_CHARS, *TEMPLATE_WORDS, *words]
    if spaced is not None:
        vocab += [*_SPACED_CHARS, *(" " + w for w in (*TEMPLATE_WORDS, *spaced))]
    return list(dict.fromkeys(vocab))


def build_tokenizer(
    words: Sequence[str],
    extra_special: Sequence[str] = (),
    save_dir: str | Path | None = None,
    chat_template: str = QWEN3_CHAT_TEMPLATE,
    spaced_words: Sequence[str] | None = None,
) -> PreTrainedTokenizerFast:
    """A toy tokenizer whose vocabulary is ``words`` plus characters and bytes.

    Args:
      words: vocabulary words (``\\w+`` runs), each one token; order fixes the ids.
      extra_special: more special tokens (e.g. Llama-3 header markers), placed after
        the Qwen ones; skipped by ``decode(skip_special_tokens=True)``.
      save_dir: if given, ``save_pretrained`` there (loads with
        ``AutoTokenizer.from_pretrained``).
      chat_template: Jinja chat template; defaults to the Qwen3 layout.
      spaced_words: if given, these words (and the template words, letters and
        digits) also get a variant with their leading space, and one space attaches
        to the run after it (see the module docstring). ``None``: every space is
        its own token.
    """
    vocab = toy_vocab(words, extra_special, spaced_words)
    specials = set(QWEN_SPECIAL_TOKENS) | set(extra_special) | set(QWEN_MARKER_TOKENS)

    def score(piece: str) -> float:
        if piece in specials or piece == UNK_TOKEN:
            return _SPECIAL_SCORE
        if piece in _BYTE_TOKENS:
            return _BYTE_SCORE
        return _CHAR_SCORE if len(piece) == 1 else _WORD_SCORE

    model = models.Unigram([(p, score(p)) for p in vocab], unk_id=vocab.index(UNK_TOKEN), byte_fallback=True)
    core = Tokenizer(model)
    runs = r" ?\w+| ?[^\w\s]|\s" if spaced_words is not None else r"\w+|[^\w\s]|\s"
    core.pre_tokenizer = pre_tokenizers.Split(Regex(runs), behavior="isolated")
    core.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*QWEN_SPECIAL_TOKENS, *extra_special)])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_MARKER_TOKENS])

    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
        chat_template=chat_template,
        model_max_length=1 << 20,
    )
    if save_dir is not None:
        tokenizer.save_pretrained(str(save_dir))
    return tokenizer


def schema(name: str, description: str = "", **params: str) -> dict:
    """An OpenAI-style function schema with string-typed required parameters.

    A convenience for tests and examples: ``schema("get_weather", city="the city")``.
    """
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": "string", "description": d} for p, d in params.items()},
                "required": list(params),
            },
        },
    }


__all__ = ["QWEN3_CHAT_TEMPLATE", "TEMPLATE_WORDS", "build_tokenizer", "schema", "toy_vocab"]
