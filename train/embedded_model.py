"""Train the embedded default model: a small Qwen3 decoder learning the synthetic tasks.

    JAX_PLATFORMS=cpu python -m train.embedded_model --out runs/embedded

What it trains: a from-scratch Qwen3-architecture ``Transformer`` (about a million
parameters, ``--size``) on a seeded stream of ``jaxkv.tasks`` conversations, half
agent traces (``agent_traces``), half split-query needle retrieval (``mqniah``),
rendered with the toy word-level tokenizer (``jaxkv.chat.toy``) over
``jaxkv.tasks.vocabulary()`` plus the chat template's own words, prose words carrying
their leading space (``embedded_tokenizer``).

Initialisation (``--init copy``, ``copy_circuit_init``): layer-0 heads that attend
1-4 tokens back through one shared value subspace (a bag of the previous tokens), a
layer-1 head that extends the bag further back, mimetic attention elsewhere. See the
function and the model card for what each part is for.

Warm-up (``--raw-drill-steps``): raw 128-token sequences, no chat template, loss on
copy targets only: half needle documents (retrieve the value of a key), half copied
chunks of random tokens of every kind (``train.retrieval_probe`` formats ``needles``
and ``general``). Copy heads form here; without the ``general`` half they form for
keys and values only and never copy names or document ids.

Drills (optional, off by default): copy drills (``--copy-share``, stages up to
``--copy-max-len``: the assistant repeats a list of identifiers) and needle drills
(``--needle-share``: a document made only of needles, every key asked).

Guards: ``--max-minutes`` stops (evaluates, checkpoints, exports) once training has
run that long; ``--export-only`` exports the latest checkpoint in ``--out``.
The shipped model's exact command is in ``jaxkv/assets/embedded-agent/README.md``.

Loss: next-token cross-entropy on assistant tokens only, in the layout they have when
generated (``render_sequence``): reasoning, tool calls, answers and the closing
``<|im_end|>``; identifier tokens weighted ``--copy-weight``. Only the target rows go
through the vocabulary projection (``with_targets``). Padding and every prompt token
are masked.

Curriculum: ``--curriculum "0.25:512,0.6:1280,1.0:2304"`` means steps up to 25% use
sequences of 512 tokens, then 1,280, the rest 2,304 (capped by ``--seq-len``). Tokens
per step stay about constant: a stage of length ``L`` uses ``batch * seq_len // L``
sequences. Example difficulty follows the length: agent traces (from 1,024 tokens)
open as many documents as fit.

Reproducibility: the batch of step ``s`` is a pure function of ``(--seed, s)``, the
initial weights of ``--seed``; resuming from an orbax checkpoint in ``--out/ckpt``
continues the exact same stream.

Held-out accuracy (every ``--eval-every`` steps, and at the end): a fixed set of
examples from another seed, scored under teacher forcing. A scored assistant message
counts as correct when every one of its tokens is the argmax prediction, which is
exactly when greedy decoding would reproduce the message given the same history.

Output (``--out``): ``ckpt/`` (orbax), ``hf/`` (``config.json`` with model_type
qwen3, ``model.safetensors``, tokenizer files; loads with
``jaxkv.load_model(out/"hf")``), ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import math
import random
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

from jaxkv.tasks import Example, agent_traces, embedded_tokenizer, mqniah, template_words, vocabulary  # noqa: F401  (re-exported)
from jaxkv.tasks.example import IdentifierPool
from jaxkv.tasks.words import SYSTEM_PLAIN
from jaxkv.tasks.mqniah import NEEDLE_COUNTS
from jaxkv.tasks.words import IDENTIFIERS, UNSPACED_WORDS
from jaxkv.chat.render import render
from jaxkv.chat.toy import QWEN3_CHAT_TEMPLATE, build_tokenizer
from jaxkv.config import ModelConfig, RopeConfig
from jaxkv.models.loading import Model, save_pretrained
from jaxkv.models.transformer import Transformer

# ------------------------------------------------------------------------ model sizes


@dataclasses.dataclass(frozen=True)
class Size:
    """Decoder shape (vocabulary size comes from the tokenizer)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int


SIZES = {
    "tiny": Size(hidden=32, layers=1, heads=2, kv_heads=2, head_dim=16, ffn=64),
    "mini": Size(hidden=64, layers=3, heads=2, kv_heads=1, head_dim=32, ffn=192),
    "small": Size(hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, ffn=384),
    # the shipped model: "small" with one K/V head per query head (induction heads
    # that match on one feature and copy another do not share K/V with their neighbours)
    "agent": Size(hidden=128, layers=4, heads=4, kv_heads=4, head_dim=32, ffn=384),
    "base": Size(hidden=192, layers=6, heads=6, kv_heads=2, head_dim=32, ffn=512),
}

# Agent-trace documents that fit a given sequence length (with the fewest distractors
# a trace is ~0.9k tokens for one document, ~1.1k for three plus the registry: the tool
# schemas in the system turn are most of it).
_MAX_DOCS_BY_LENGTH = ((1280, 1), (1 << 30, 3))
_MIN_LENGTH_FOR_REGISTRY = 1280


ROPE_THETA = 1_000_000.0  # Qwen3's own; most rotary pairs turn less than a radian over 2k tokens


def model_config(size: Size, vocab_size: int, eos_id: int, max_positions: int, rope_theta: float = ROPE_THETA) -> ModelConfig:
    return ModelConfig(
        model_type="qwen3",
        vocab_size=vocab_size,
        hidden_size=size.hidden,
        intermediate_size=size.ffn,
        num_layers=size.layers,
        num_heads=size.heads,
        num_kv_heads=size.kv_heads,
        head_dim=size.head_dim,
        rope=RopeConfig(theta=rope_theta),
        tie_word_embeddings=True,
        qk_norm=True,
        max_position_embeddings=max_positions,
        eos_token_ids=(eos_id,),
    )


def scale_qk_norm(params, gain: float, skip_layers=()):
    """``params`` with every q/k RMSNorm weight set to ``gain`` (initialisation only).

    Qwen3 normalises queries and keys per head, so an attention logit is at most
    ``gain**2 * sqrt(head_dim)``: about 5.7 at the usual gain 1 and head dim 32, less
    than the ln(2048) = 7.6 a head needs to put half its weight on one of 2,048
    positions. A larger initial gain lets retrieval heads be sharp from the start.
    """
    if gain == 1.0:
        return params

    def fix(path, x):
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        if not any(n in ("q_norm", "k_norm") for n in names):
            return x
        keep = np.isin(np.arange(x.shape[0]), list(skip_layers))  # a stacked layer leaf: one row per layer
        return jnp.where(jnp.asarray(keep).reshape(-1, *([1] * (x.ndim - 1))), x, jnp.full_like(x, gain))

    return jax.tree_util.tree_map_with_path(fix, params)


LAYERS = "['layers']"  # the keystr prefix of the stacked decoder-layer weights ``[L, ...]``


def _leaves_by_name(params) -> dict[str, np.ndarray]:
    """``{name: array}`` of a parameter pytree: the keystr path of each leaf, a
    stacked layer leaf split into one entry per layer (e.g.
    ``"['layers'][0]['self_attn']['q_proj']['kernel'].value"``)."""
    out = {}
    for k, v in jax.tree_util.tree_leaves_with_path(params):
        name, v = jax.tree_util.keystr(k), np.asarray(v)
        if name.startswith(LAYERS):
            out.update({f"{LAYERS}[{i}]{name[len(LAYERS) :]}": v[i] for i in range(v.shape[0])})
        else:
            out[name] = v
    return out


def _replace_leaves(params, updates: dict[str, np.ndarray]):
    """``params`` with the leaves (or layer rows) named in ``updates``
    (``_leaves_by_name`` names) replaced."""

    def pick(path, x):
        name = jax.tree_util.keystr(path)
        if name.startswith(LAYERS):
            rows = {i: updates.get(f"{LAYERS}[{i}]{name[len(LAYERS) :]}") for i in range(x.shape[0])}
            if all(r is None for r in rows.values()):
                return x
            return jnp.stack([x[i] if r is None else jnp.asarray(r, x.dtype) for i, r in rows.items()])
        new = updates.get(name)
        return x if new is None else jnp.asarray(new, x.dtype)

    return jax.tree_util.tree_map_with_path(pick, params)


def mimetic_init(params, seed: int, qk: bool = True, ov: bool = True, mix: float = 0.5):
    """``params`` with attention initialised mimetically (Trockman & Kolter, ICML 2023).

    Per layer, ``k_proj = (1 - mix) q_proj + mix * noise`` so that ``W_q W_k^T`` starts
    near a positive multiple of a per-head projection (a query attends to keys that
    look like itself: token matching, the second half of an induction head), and
    ``o_proj = v_proj^T`` so that ``W_v W_o`` starts near a projection (a head passes
    on what it reads: copying). With the usual small random init both products start
    near zero and the copy circuit sits on a long plateau (see ``train/retrieval_probe.py``).
    Needs one K/V head per query head. Initialisation only; training starts here.
    """
    rng = np.random.default_rng(seed)
    by_name = _leaves_by_name(params)
    updates = {}
    for name, q in by_name.items():
        if not name.endswith("['q_proj']['kernel'].value"):
            continue
        base = name[: -len("['q_proj']['kernel'].value")]
        k_name, v_name, o_name = (base + f"['{n}']['kernel'].value" for n in ("k_proj", "v_proj", "o_proj"))
        if by_name[k_name].shape != q.shape:
            raise ValueError("mimetic_init needs one K/V head per query head")
        if qk:
            noise = rng.normal(0.0, float(q.std()), q.shape).astype(q.dtype)
            updates[k_name] = (1.0 - mix) * q + mix * noise
        if ov:
            updates[o_name] = by_name[v_name].T.copy()
    return _replace_leaves(params, updates)


def shared_embedding_direction(params, seed: int, share: float = 0.7):
    """``params`` with one random unit direction added to every token embedding, at
    ``share`` times the embeddings' mean norm. After the input RMSNorm every token
    then carries a common component, so a projection can produce a content-free query
    or key: what a purely positional head (attend to the previous token) is built
    from under RoPE, where nothing else in the residual stream is constant."""
    rng = np.random.default_rng(seed + 1)
    name, e = next((k, v) for k, v in _leaves_by_name(params).items() if "embed_tokens" in k)
    u = rng.normal(size=e.shape[1])
    u /= np.linalg.norm(u)
    return _replace_leaves(params, {name: e + share * np.linalg.norm(e, axis=1).mean() * u})


def positional_heads_prior(
    params, rope_theta: float, head_dim: int, offsets=(1,), layer: int = 0, pairs: int = 3, gain: float = 3.0, shared_v=None
):
    """Initialise head ``h`` of ``layer`` to attend ``offsets[h]`` positions back.

    Uses the shared embedding direction ``u`` (``shared_embedding_direction``: the
    mean embedding): the head's query is ``(x.u) c`` and its key ``(x.u) R(d theta) c``
    for a fixed ``c`` on the ``pairs`` highest RoPE frequencies, so after RoPE
    ``q_m . k_n = |c|^2 sum_i cos((n - m + d) theta_i)``, largest at ``n = m - d``
    (the layer's q/k RMSNorm gains are set to ``gain`` so the peak is sharp: with 3
    pairs and gain 3 the target position leads its neighbours by about 11 logits);
    every such head reads and writes through the same value subspace (``v_proj``
    columns of the first head, ``o_proj = v_proj^T``), so together they add the
    *bag* of the last ``max(offsets)`` tokens to the residual stream, and two places
    preceded by the same token within that window look alike. These are the
    first halves of induction heads (the second half matches the current token with
    a token ``d`` back), which the small random init takes thousands of steps to find
    on its own. Training is free to change them.
    """
    by_name = _leaves_by_name(params)
    emb = next(v for k, v in by_name.items() if "embed_tokens" in k)
    u = emb.mean(axis=0)
    u /= np.linalg.norm(u)
    half = head_dim // 2
    inv_freq = 1.0 / (rope_theta ** (np.arange(half) * 2.0 / head_dim))
    base = f"['layers'][{layer}]['self_attn']"
    q = by_name[base + "['q_proj']['kernel'].value"].copy()
    k = by_name[base + "['k_proj']['kernel'].value"].copy()
    o = by_name[base + "['o_proj']['kernel'].value"].copy()
    v = by_name[base + "['v_proj']['kernel'].value"].copy()
    v_shared = v[:, :head_dim] if shared_v is None else shared_v
    if len(offsets) * head_dim > q.shape[1]:
        raise ValueError(f"{len(offsets)} positional heads do not fit in layer {layer}")
    scale = float(np.abs(q).std()) * 4
    c = np.zeros(head_dim)
    c[:pairs] = 1.0
    for h, d in enumerate(offsets):
        ang = inv_freq[:pairs] * d
        rc = np.zeros(head_dim)  # R(d theta) c, pairwise (i, i + half)
        rc[:pairs] = np.cos(ang)
        rc[half : half + pairs] = np.sin(ang)
        cols = slice(h * head_dim, (h + 1) * head_dim)
        q[:, cols] = scale * np.outer(u, c)
        k[:, cols] = scale * np.outer(u, rc)
        v[:, cols] = v_shared
        o[cols, :] = v_shared.T
    updates = {
        base + "['q_proj']['kernel'].value": q,
        base + "['k_proj']['kernel'].value": k,
        base + "['v_proj']['kernel'].value": v,
        base + "['o_proj']['kernel'].value": o,
    }
    for norm in ("q_norm", "k_norm"):
        name = base + f"['{norm}']['weight'].value"
        updates[name] = np.full_like(by_name[name], gain)
    return _replace_leaves(params, updates)


INIT_SCHEMES = ("random", "copy")
# Rotary pairs a positional head uses: with 3 the score of ~40 positions within 2.4k
# tokens comes within a sixth of the peak's lead (aliasing of the three frequencies);
# with 6 none does, so the head stays on its offset in long contexts (a quarter of
# the pairs at most: the slow ones cannot tell neighbours apart).
POSITIONAL_PAIRS = 6


def copy_circuit_init(params, cfg, seed: int, scheme: str = "copy", offsets=(1, 2, 3, 4), qk_gain: float = 1.0, layer1_head: bool = True):
    """The trainer's initialisation: ``"random"`` (the module's own small normal
    init) or ``"copy"``: a shared embedding direction, positional heads looking
    ``offsets`` back in layer 0 (one head each, one shared value subspace: the bag of
    the last four tokens), in deeper models a soft head in layer 1 looking about
    ``max(offsets)`` back (3-5) through the same subspace (so the bag reaches about
    eight tokens back), mimetic attention elsewhere and q/k-norm gains ``qk_gain``
    outside the positional layers, so that in-context copying starts from half-built
    induction heads instead of a long plateau (measured in
    ``train/retrieval_probe.py``; see the model card). Needs one K/V head per query
    head."""
    if scheme == "random":
        return params
    if scheme != "copy":
        raise ValueError(f"unknown init scheme {scheme!r}; known: {', '.join(INIT_SCHEMES)}")
    params = shared_embedding_direction(params, seed)
    params = mimetic_init(params, seed)
    params = scale_qk_norm(params, qk_gain)
    offsets = offsets[: cfg.num_heads]
    params = positional_heads_prior(params, cfg.rope.theta, cfg.head_dim, offsets, pairs=min(POSITIONAL_PAIRS, cfg.head_dim // 4))
    if layer1_head and cfg.num_layers > 2:
        v0 = _leaves_by_name(params)["['layers'][0]['self_attn']['v_proj']['kernel'].value"][:, : cfg.head_dim]
        params = positional_heads_prior(params, cfg.rope.theta, cfg.head_dim, (max(offsets),), layer=1, shared_v=v0, gain=1.0)
    return params


def param_count(module) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


# ------------------------------------------------------------------------ tokenizer


# ------------------------------------------------------------------------ data


@dataclasses.dataclass(frozen=True)
class TrainSequence:
    """One rendered training conversation.

    Attributes:
      ids: token ids ``[T]`` int32.
      target_mask: ``[T]`` bool, True where token ``t`` is an assistant target.
      scored: half-open ``(start, end)`` token ranges of the scored assistant messages.
      task: the generator name.
    """

    ids: np.ndarray
    target_mask: np.ndarray
    scored: tuple[tuple[int, int], ...]
    task: str


def training_view(example: Example, rng: random.Random) -> tuple[list[dict], int]:
    """Messages to render: the conversation cut after the reply to a random user turn.

    The Qwen3 template drops the reasoning of assistant turns before the last user
    message, so cutting teaches each turn in the layout it has at inference.
    Returns ``(messages, scored assistant messages kept)``.
    """
    msgs = example.messages
    user_turns = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    ends = [nxt for nxt in user_turns[1:]] + [len(msgs)]
    end = rng.choice(ends)
    return msgs[:end], sum(1 for m in msgs[:end] if m["role"] == "assistant")


def render_sequence(tokenizer, example: Example, messages: list[dict]) -> TrainSequence:
    """Render ``messages``; targets are the assistant messages in the layout they have
    when generated (opening with the think block). The Qwen3 template renders
    assistant turns before the last user query without it, a layout the model never
    produces: those stay context (``training_view`` also cuts after them, so they are
    trained where they are the last turn)."""
    rendered = render(tokenizer, messages, example.tools or None, add_generation_prompt=False)
    think = tokenizer.convert_tokens_to_ids("<think>")
    mask = np.zeros(rendered.ids.size, bool)
    scored = []
    for m in rendered.messages:
        if m.kind == "assistant" and m.content_start < m.end and rendered.ids[m.content_start] == think:
            mask[m.content_start : m.end] = True
            scored.append((m.content_start, m.end))
    return TrainSequence(rendered.ids, mask, tuple(scored), example.task)


# Conversation lengths of a stage: a uniform fraction of its sequence length. With
# one fixed length the position of the last turn says which step comes next (answer
# or registry), and a model trained so answers by position and fails on shorter
# conversations.
LENGTH_FRACTIONS = (0.6, 0.95)


def make_example(seed: int, seq_len: int, task: str) -> Example:
    target = int(seq_len * random.Random(seed ^ 0x5EED).uniform(*LENGTH_FRACTIONS))
    if task == "mqniah":
        # Short curriculum stages ask few needles: retrieval heads form where a document
        # holds a handful of candidates, and stall where it holds many (the probe).
        needles = random.Random(seed).choice(NEEDLE_COUNTS if seq_len >= SHORT_STAGE else NEEDLE_COUNTS[:2])
        return mqniah(1, seed, needles=needles, length=target)[0]
    max_docs = next(d for limit, d in _MAX_DOCS_BY_LENGTH if seq_len < limit)
    rng = random.Random(seed)
    n_docs = rng.randint(1, max_docs)
    registry = rng.random() < 0.6 and seq_len >= _MIN_LENGTH_FOR_REGISTRY
    return agent_traces(1, seed, length=target, n_docs=n_docs, registry=registry)[0]


# Example seeds: training draws below ``TRAIN_SEED_LIMIT``; held-out sets (this file's
# ``heldout_sequences`` and ``eval.quality.embedded_accuracy``) use seeds with bit 30 set.
TRAIN_SEED_LIMIT = 1 << 30
HELDOUT_SEED_BASE = (1 << 30) + 3_000_000
# Agent-trace skeletons (system prompt + tool schemas) take ~800-1400 tokens: shorter
# curriculum stages train on MQ-NIAH only.
MIN_AGENT_LENGTH = 1024
SHORT_STAGE = 768


def copy_drill(seed: int, seq_len: int) -> Example:
    """A warm-up conversation: the user lists random identifiers, the assistant repeats them.

    Every target identifier can only be predicted by copying from the context, so the
    drill gives the dense signal that forms induction (copy) heads within a few hundred
    steps; the task conversations give that signal on a few tokens per example only.
    """
    rng = random.Random(seed)
    pool = IdentifierPool(rng)
    n = rng.randint(16, max(16, min(150, (seq_len - 80) // 4)))
    items = " ".join(pool.draw(rng.choice("kvd")) for _ in range(n))
    messages = [
        {"role": "system", "content": SYSTEM_PLAIN},
        {"role": "user", "content": f"Repeat the list: {items}"},
        {"role": "assistant", "content": items},
    ]
    return Example("copy", seed, messages, [], [], {})


def needle_drill(seed: int, seq_len: int) -> Example:
    """A dense retrieval drill: a document made only of needles, every key asked.

    The user's document is back-to-back MQ-NIAH needles ("The special code for k173
    is v032."); the question lists all keys in random order; the assistant quotes the
    question and answers ``k173 is v032, ...``. Every value in the answer is a
    retrieval target (about one per 22 tokens, against a few per 2,048 tokens in the
    task conversations), and with many needles in context, outputting just any
    value of the document (the shortcut ``train/retrieval_probe.py`` shows small
    models settle on) is worth little. Not yet shown to teach retrieval: see the
    model card.
    """
    from jaxkv.tasks.mqniah import INTRO, NEEDLE_TEMPLATE, _answer, _question

    rng = random.Random(seed)
    pool = IdentifierPool(rng)
    n = max(2, min(pool.left("k"), pool.left("v"), (seq_len - 110) // 28))
    n = rng.randint(max(2, n // 2), n)
    keys = [pool.key() for _ in range(n)]
    value_of = {k: pool.value() for k in keys}
    document = " ".join(NEEDLE_TEMPLATE.format(key=k, value=value_of[k]) for k in keys)
    asked = rng.sample(keys, n)
    messages = [
        {"role": "system", "content": SYSTEM_PLAIN},
        {"role": "user", "content": f"{INTRO}\n\n{document}\n\n{_question(asked)}"},
        {"role": "assistant", "content": _answer(asked, value_of)},
    ]
    return Example("needles", seed, messages, [], [], {})


DRILLS = {"copy": copy_drill, "needles": needle_drill}


def make_sequence(
    tokenizer, seed: int, seq_len: int, mqniah_share: float = 0.5, copy_share: float = 0.0, needle_share: float = 0.0
) -> TrainSequence:
    """A seeded training sequence of at most ``seq_len`` tokens (prefix-truncated).

    A fraction ``copy_share`` are copy drills, ``needle_share`` needle drills; the
    rest are task conversations, ``mqniah_share`` of them MQ-NIAH (all of them below
    ``MIN_AGENT_LENGTH`` tokens), the others agent traces."""
    rng = random.Random(seed)
    u = rng.random()
    if u < copy_share:
        task = "copy"
    elif u < copy_share + needle_share:
        task = "needles"
    else:
        u = (u - copy_share - needle_share) / max(1e-9, 1 - copy_share - needle_share)
        task = "mqniah" if u < mqniah_share or seq_len < MIN_AGENT_LENGTH else "agent_traces"
    ex_seed = rng.randrange(TRAIN_SEED_LIMIT)
    example = DRILLS[task](ex_seed, seq_len) if task in DRILLS else make_example(ex_seed, seq_len, task)
    messages, _ = training_view(example, rng)
    seq = render_sequence(tokenizer, example, messages)
    if seq.ids.size > seq_len:  # rare: the length estimate is within a few percent
        seq = TrainSequence(seq.ids[:seq_len], seq.target_mask[:seq_len], tuple((a, b) for a, b in seq.scored if b <= seq_len), seq.task)
    return seq


def pack_batch(seqs: list[TrainSequence], seq_len: int, pad_id: int, copy_ids=None, copy_weight: float = 1.0) -> dict[str, np.ndarray]:
    """``tokens [B, T]``, ``loss_mask [B, T]`` (weight of the *predicted* token ``t+1``:
    1 on assistant tokens, ``copy_weight`` on those of them in ``copy_ids``, the
    identifiers that can only be copied from the context)."""
    B = len(seqs)
    tokens = np.full((B, seq_len), pad_id, np.int32)
    targets_mask = np.zeros((B, seq_len), bool)
    for b, s in enumerate(seqs):
        tokens[b, : s.ids.size] = s.ids
        targets_mask[b, : s.ids.size] = s.target_mask
    loss_mask = np.zeros((B, seq_len), np.float32)
    loss_mask[:, :-1] = targets_mask[:, 1:]
    if copy_ids is not None and copy_weight != 1.0:
        loss_mask[:, :-1] *= np.where(np.isin(tokens[:, 1:], copy_ids), copy_weight, 1.0)
    return with_targets({"tokens": tokens, "loss_mask": loss_mask})


TARGET_BUCKET = 64


def with_targets(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``batch`` plus the gathered loss targets the train step reads: ``target_pos
    [B, P]`` (positions ``t`` with ``loss_mask[t] > 0``, padded with 0), ``target_ids
    [B, P]`` (``tokens[t + 1]``) and ``target_w [B, P]`` (``loss_mask[t]``, 0 on
    padding). ``P`` is the largest row count rounded up to ``TARGET_BUCKET``, so only
    a few shapes compile. Only these rows go through the vocabulary projection: in a
    2k-token conversation a few percent of the positions carry loss."""
    tokens, loss_mask = batch["tokens"], batch["loss_mask"].copy()
    loss_mask[:, -1] = 0  # the last position predicts nothing in the row
    B, T = tokens.shape
    rows = [np.flatnonzero(loss_mask[b]) for b in range(B)]
    P = max(TARGET_BUCKET, -(-max(len(r) for r in rows) // TARGET_BUCKET) * TARGET_BUCKET)
    pos = np.zeros((B, P), np.int32)
    w = np.zeros((B, P), np.float32)
    for b, r in enumerate(rows):
        pos[b, : len(r)] = r
        w[b, : len(r)] = loss_mask[b, r]
    ids = np.take_along_axis(np.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1), pos, axis=1)
    return {**batch, "loss_mask": loss_mask, "target_pos": pos, "target_ids": ids.astype(np.int32), "target_w": w}


def step_seed(seed: int, step: int) -> int:
    return (seed * 7_919 + step * 104_729 + 17) & 0x7FFFFFFF


def batch_for_step(
    tokenizer,
    seed: int,
    step: int,
    seq_len: int,
    batch: int,
    mqniah_share: float = 0.5,
    copy_share: float = 0.0,
    needle_share: float = 0.0,
    copy_ids=None,
    copy_weight: float = 1.0,
) -> dict[str, np.ndarray]:
    rng = random.Random(step_seed(seed, step))
    seqs = [make_sequence(tokenizer, rng.randrange(1 << 31), seq_len, mqniah_share, copy_share, needle_share) for _ in range(batch)]
    return pack_batch(seqs, seq_len, tokenizer.pad_token_id, copy_ids, copy_weight)


RAW_DRILL_LEN, RAW_DRILL_BATCH = 128, 32


def raw_drill_batch(tokenizer, seed: int, step: int) -> dict[str, np.ndarray]:
    """A warm-up batch: half raw needle documents (``train.copy_drills`` format
    ``needles``: no chat template, loss on the retrieved values only), half copied
    chunks of random tokens of any kind (format ``general``): the dense signal on
    which, from the ``copy`` init, retrieval heads form within ~100 steps, before the
    chat conversations, whose loss is mostly template and prose. Without the
    ``general`` half the heads learn to match on keys and values only, and copying a
    project name or document id after its cue (an agent trace's calls) stalls."""
    from train.copy_drills import Formats, raw_batch

    formats = Formats(tokenizer, RAW_DRILL_LEN, pairs=8, filler=0.2)
    # the probe's own batch seeds (``retrieval_probe.run``: seed * 1_000_003 + step, from 1)
    half = RAW_DRILL_BATCH // 2
    tokens, mask = raw_batch(formats.needles, seed * 1_000_003 + step + 1, RAW_DRILL_BATCH - half, RAW_DRILL_LEN)
    general = raw_batch(formats.general, seed * 1_000_003 + step + 1, half, RAW_DRILL_LEN)
    tokens, mask = np.concatenate([tokens, general[0]]), np.concatenate([mask, general[1]])
    # Formats masks mark t where token t+1 is a target: already the loss-mask layout.
    return with_targets({"tokens": tokens, "loss_mask": mask})


def parse_curriculum(spec: str, max_len: int) -> list[tuple[float, int]]:
    """``"0.6:1024,1.0:2048"`` -> ``[(0.6, 1024), (1.0, 2048)]`` (lengths capped)."""
    stages = []
    for part in spec.split(","):
        frac, length = part.split(":")
        stages.append((float(frac), min(int(length), max_len)))
    if not stages or stages[-1][0] < 1.0:
        stages.append((1.0, max_len))
    return stages


def seq_len_at(step: int, total: int, stages: list[tuple[float, int]]) -> int:
    return next(length for frac, length in stages if step < frac * total or frac >= 1.0)


class Prefetcher:
    """Builds the batches of upcoming steps on a thread while the device trains.

    ``get()`` returns ``(step, batch)`` in step order, at most ``depth`` steps
    ahead. Each batch is a ``concurrent.futures`` future, so a batch that fails
    to build raises its error in ``get()``, in the trainer, rather than leaving
    it waiting for a batch that will never come. ``close()`` cancels the
    batches not yet started."""

    def __init__(self, make, steps: range, depth: int = 2):
        self._make = make
        self._steps = iter(steps)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self._ahead: collections.deque = collections.deque()
        for _ in range(depth):
            self._submit()

    def _submit(self) -> None:
        s = next(self._steps, None)
        if s is not None:
            self._ahead.append((s, self._pool.submit(self._make, s)))

    def get(self):
        s, future = self._ahead.popleft()
        self._submit()
        return s, future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# ------------------------------------------------------------------------ training


def target_xent(model, tokens_BT, target_pos_BP, target_ids_BP, target_w_BP):
    """Weighted cross-entropy of the gathered targets (``with_targets``): the hidden
    state at ``target_pos`` predicts ``target_ids``; only those rows are projected
    onto the vocabulary."""
    hidden = model.hidden(tokens_BT)
    rows = jnp.take_along_axis(hidden, target_pos_BP[..., None], axis=1)  # [B,P,M]
    logp = jax.nn.log_softmax(model.logits(rows), axis=-1)
    nll = -jnp.take_along_axis(logp, target_ids_BP[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * target_w_BP) / jnp.maximum(jnp.sum(target_w_BP), 1.0)


def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float, clip: float):
    schedule = optax.warmup_cosine_decay_schedule(lr / (warmup + 1), lr, max(1, warmup), max(steps, warmup + 1), lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(schedule, b2=0.98, weight_decay=weight_decay)), schedule


def make_train_step(graphdef, optimizer):
    """``train_step(params, opt_state, batch) -> (params, opt_state, loss, grad_norm)``;
    ``batch`` as ``with_targets`` returns it (only its array fields are read)."""

    @jax.jit
    def _step(params, opt_state, tokens, target_pos, target_ids, target_w):
        def loss_fn(p):
            return target_xent(nnx.merge(graphdef, p), tokens, target_pos, target_ids, target_w)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    def train_step(params, opt_state, batch):
        return _step(params, opt_state, batch["tokens"], batch["target_pos"], batch["target_ids"], batch["target_w"])

    return train_step


def make_predict(graphdef):
    @jax.jit
    def predict(params, tokens):
        return jnp.argmax(nnx.merge(graphdef, params)(tokens), axis=-1).astype(jnp.int32)

    return predict


def heldout_sequences(tokenizer, seed: int, n: int, seq_len: int) -> list[TrainSequence]:
    """A fixed held-out set: full conversations (every turn), from a disjoint seed."""
    out = []
    for i in range(n):
        task = "mqniah" if i % 2 else "agent_traces"
        ex = make_example(HELDOUT_SEED_BASE + 1000 * seed + i, seq_len, task)
        seq = render_sequence(tokenizer, ex, ex.messages)
        if seq.ids.size <= seq_len:
            out.append(seq)
    return out


def heldout_accuracy(
    predict, params, seqs: list[TrainSequence], seq_len: int, pad_id: int, batch: int, copy_ids: np.ndarray | None = None
) -> dict[str, float]:
    """Teacher-forced exact match per scored assistant message, per task, token accuracy,
    and (with ``copy_ids``, the identifier token ids) accuracy on the identifier tokens
    of the targets: the tokens that must be copied from the context."""
    turns: dict[str, list[bool]] = {}
    hits = total = copy_hits = copy_total = 0
    for i in range(0, len(seqs), batch):
        chunk = seqs[i : i + batch]
        tokens = pack_batch(chunk, seq_len, pad_id)["tokens"]
        pred = np.asarray(predict(params, tokens))
        for b, s in enumerate(chunk):
            for start, end in s.scored:
                ok = pred[b, start - 1 : end - 1] == s.ids[start:end]
                turns.setdefault(s.task, []).append(bool(ok.all()))
                hits += int(ok.sum())
                total += ok.size
                if copy_ids is not None:
                    is_copy = np.isin(s.ids[start:end], copy_ids)
                    copy_hits += int(ok[is_copy].sum())
                    copy_total += int(is_copy.sum())
    out = {f"turn_acc/{task}": float(np.mean(v)) for task, v in turns.items()}
    out["token_acc"] = hits / max(total, 1)
    if copy_total:
        out["copy_acc"] = copy_hits / copy_total
    return out


def train(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = embedded_tokenizer()
    size = SIZES[args.size]
    vocab = len(tokenizer)
    cfg = model_config(size, vocab, tokenizer.convert_tokens_to_ids("<|im_end|>"), max(args.seq_len, 4096))
    module = Transformer(cfg, jnp.float32, rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(module, nnx.Param)
    params = copy_circuit_init(params, cfg, args.seed, args.init)
    optimizer, schedule = make_optimizer(args.lr, args.steps, args.warmup, args.weight_decay, args.clip)
    opt_state = optimizer.init(params)
    train_step = make_train_step(graphdef, optimizer)
    predict = make_predict(graphdef)
    stages = parse_curriculum(args.curriculum, args.seq_len)

    ckpt = ocp.CheckpointManager((out / "ckpt").absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
    start = 0
    if ckpt.latest_step() is not None and not args.restart:
        start = ckpt.latest_step()
        restored = ckpt.restore(start, args=ocp.args.StandardRestore({"params": params, "opt_state": opt_state}))
        params, opt_state = restored["params"], restored["opt_state"]
        print(f"resumed from step {start}")

    if args.export_only:
        if ckpt.latest_step() is None:
            raise SystemExit(f"--export-only: no checkpoint in {out / 'ckpt'}")
        nnx.update(module, params)
        hf_dir = save_pretrained(Model(cfg, module, tokenizer, jnp.float32), out / "hf")
        print(f"exported step {start} to {hf_dir}")
        return {"losses": [], "hf_dir": hf_dir, "params": param_count(module), "module": module}

    heldout = heldout_sequences(tokenizer, args.seed, args.eval_examples, args.seq_len)
    copy_ids = np.asarray(tokenizer.convert_tokens_to_ids(sorted(IDENTIFIERS)), np.int32)
    n_params = param_count(module)
    print(f"params {n_params:,}  vocab {vocab}  stages {stages}  heldout {len(heldout)}")

    def batch_at(s):
        if s < args.raw_drill_steps:
            return raw_drill_batch(tokenizer, args.seed, s)
        length = seq_len_at(s, args.steps, stages)
        return batch_for_step(
            tokenizer,
            args.seed,
            s,
            length,
            max(1, args.batch * args.seq_len // length),
            args.mqniah_share,
            args.copy_share if length <= args.copy_max_len else 0.0,
            args.needle_share,
            copy_ids,
            args.copy_weight,
        )

    metrics_file = open(out / "metrics.jsonl", "a")
    stop = min(args.steps, args.stop_after or args.steps)
    prefetch = Prefetcher(batch_at, range(start, stop))  # a batch that fails to build raises in get()
    losses = []
    bar = tqdm(range(start, stop), initial=start, total=args.steps, disable=args.quiet)
    t_prev, t0, tok_s = time.perf_counter(), time.perf_counter(), None
    for s in bar:
        step, batch = prefetch.get()
        assert step == s
        params, opt_state, loss, gnorm = train_step(params, opt_state, batch)
        loss = float(loss)  # blocks: the step time below is the real one
        losses.append(loss)
        now = time.perf_counter()
        step_tok_s = int((batch["tokens"] != tokenizer.pad_token_id).sum()) / (now - t_prev)
        tok_s = step_tok_s if tok_s is None else 0.9 * tok_s + 0.1 * step_tok_s
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:.0f}", T=batch["tokens"].shape[1], lr=f"{float(schedule(s)):.1e}")
        record = {
            "step": s + 1,
            "loss": loss,
            "grad_norm": float(gnorm),
            "tok_s": step_tok_s,
            "seq_len": batch["tokens"].shape[1],
            "elapsed_s": now - t0,
        }
        over_time = args.max_minutes is not None and now - t0 > 60 * args.max_minutes
        last = s + 1 == stop or over_time
        if heldout and ((s + 1) % args.eval_every == 0 or last):
            record.update(heldout_accuracy(predict, params, heldout, args.seq_len, tokenizer.pad_token_id, args.eval_batch, copy_ids))
            tqdm.write(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}))
        if (s + 1) % args.ckpt_every == 0 or last:
            ckpt.save(s + 1, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()
        t_prev = time.perf_counter()  # eval and checkpoint time is not step time
        if over_time:
            tqdm.write(f"stopping after step {s + 1}: --max-minutes {args.max_minutes} reached")
            break
    prefetch.close()  # after a --max-minutes stop: drop the batches built ahead
    ckpt.wait_until_finished()
    metrics_file.close()

    nnx.update(module, params)
    hf_dir = save_pretrained(Model(cfg, module, tokenizer, jnp.float32), out / "hf")
    return {"losses": losses, "hf_dir": hf_dir, "params": n_params, "module": module}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/embedded", help="output folder (ckpt/, hf/, metrics.jsonl)")
    p.add_argument("--steps", type=int, default=2300)
    p.add_argument(
        "--seq-len", type=int, default=2304, help="longest sequence (last curriculum stage); evaluation requests are 2.1-2.3k tokens"
    )
    p.add_argument("--batch", type=int, default=2, help="sequences per step at --seq-len (more at shorter stages)")
    p.add_argument("--curriculum", default="0.2:512,0.7:1280,1.0:2304", help="step fraction:sequence length, ...")
    p.add_argument("--size", choices=sorted(SIZES), default="agent")
    p.add_argument("--tiny", action="store_true", help="tiny model, 1024-token sequences (tests)")
    p.add_argument(
        "--mqniah-share",
        type=float,
        default=0.35,
        help="fraction of MQ-NIAH sequences (the rest agent traces; stages too short for one are all MQ-NIAH)",
    )
    p.add_argument("--copy-share", type=float, default=0.1, help="fraction of copy-drill warm-up sequences")
    p.add_argument("--copy-max-len", type=int, default=512, help="curriculum stages longer than this use no copy drill")
    p.add_argument("--needle-share", type=float, default=0.0, help="fraction of needle-drill sequences (all stages)")
    p.add_argument(
        "--raw-drill-steps",
        type=int,
        default=200,
        help="first steps on raw needle documents (loss on values only) before the chat curriculum",
    )
    p.add_argument(
        "--copy-weight", type=float, default=4.0, help="loss weight of identifier tokens (copied from context) among the assistant tokens"
    )
    p.add_argument("--init", choices=INIT_SCHEMES, default="copy", help="initialisation (copy_circuit_init)")
    p.add_argument(
        "--lr", type=float, default=1e-3, help="peak learning rate (3e-3 keeps the identifier embeddings too noisy to learn retrieval)"
    )
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-examples", type=int, default=32)
    p.add_argument("--eval-batch", type=int, default=4)
    p.add_argument("--ckpt-every", type=int, default=500)
    p.add_argument("--stop-after", type=int, default=None, help="checkpoint, export and exit after this step")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="wall-clock guard: evaluate, checkpoint, export and exit once training has run this long",
    )
    p.add_argument("--restart", action="store_true", help="ignore checkpoints in --out")
    p.add_argument("--export-only", action="store_true", help="export the latest checkpoint in --out to --out/hf and exit")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.tiny:
        args.size, args.seq_len, args.curriculum = "tiny", min(args.seq_len, 1024), "1.0:1024"
        args.warmup = min(args.warmup, 1)
        args.raw_drill_steps = 0  # the chat path; raw_drill_batch has its own test
    return args


def main(argv=None):
    result = train(parse_args(argv))
    print(f"exported {result['hf_dir']}")


if __name__ == "__main__":
    main()
