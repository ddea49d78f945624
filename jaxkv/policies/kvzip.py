"""KVzip's score (Kim et al., NeurIPS 2025, arXiv 2505.23416): the attention a context KV pair gets while the model repeats the context.

KVzip is question-agnostic: after the context is prefilled, the model is fed a
prompt that asks it to repeat the context, followed by the context itself
(teacher forced), and each context KV pair is scored by the largest attention any
of those reconstruction queries pays it. A pair the model needs to reproduce its
context is one any later question may need, so one compressed cache serves every
later turn. This module is the score as pure, jit-able functions over explicit
arrays, the host-side builder of kvpress's reconstruction inputs, and the retention
policy ``kvzip`` that keeps the top scores. Feeding the inputs through jaxkv's
engine is the retention stage's (``jaxkv.serving.stages.reconstruction``: each
pass is a prefill of the row, its queries captured, its own KV truncated away).

What kvpress 0.5.5 does (``kvpress/presses/kvzip_press.py``, ``KVzipPress``), and
what each function here matches:

* **Inputs** (``repeat_chunks``). The context's tokens after the chat template's
  prefix (``prefix_length`` tokens: what the template writes before a user message's
  content, found by rendering a dummy message) are cut into chunks of
  ``chunk_size`` (2048) tokens. Chunk 0 is fed as ``"\\n\\nRepeat the previous
  context exactly."``, then the template's suffix after a user message (SmolLM2's
  ``<|im_end|>\\n<|im_start|>assistant\\n``), then the chunk's own tokens; chunk
  ``i > 0`` as ``"\\n\\nRepeat the part of the previous context exactly, starting
  with"`` followed by the previous chunk's last 8 tokens, the suffix and the chunk.
  Each chunk's input is one forward over the cache holding the whole context, at
  positions ``n_context, n_context + 1, ...`` (every chunk at the same positions:
  the cache is cut back to the context after each), with the model's ordinary
  attention over everything.
* **Score** (``reconstruction_scores``). In each layer, for the chunk's input rows
  ``x`` (post-RoPE queries, every row of the input: prompt, suffix and the repeated
  tokens alike), a softmax of ``q_x · k / √D`` runs over **the sinks, the chunk
  and the input's own keys** only: the first ``min(n_sink, start)`` context keys,
  the chunk's context keys ``[start, end)``, and the input's keys up to ``x``
  (causal). The rest of the context is not in the denominator. A chunk key ``i``
  of KV head ``k`` scores ``max_x max_{h in k's group} p^{h}_{x, i}``; the sinks'
  and the input's own columns score nothing. ``n_sink`` = 4.
* **KVzip+** (``kvzip_plus_normalization``, off by default): each probability is
  divided by its row's hidden-state norm ``‖h_x‖`` (the layer input) and multiplied
  by its column's ``‖v_i W_O^{(h)}‖`` (the slice of the output projection that
  query head ``h`` reads) before the maxima: ``row_scale_LX`` and
  ``col_scale_LHN`` here.
* **Assembly** (``context_scores``). A position belongs to one chunk, whose pass
  writes its score; the template prefix's positions are in no chunk and keep 0,
  then the first ``n_sink`` positions get the global maximum plus 1 (never
  evicted).
* **Selection** (kvpress's). kvpress drops the lowest scores over every layer, KV
  head and position at once (``layerwise=False``: each layer keeps its own count,
  each KV head its own set within it) and masks the dropped keys in attention
  (``masked_key_indices``, no memory saved); ``layerwise=True`` drops the same
  count in every layer.

The policy (``kvzip``, ``KVzipConfig``). The engine's passes give each live
position a score per layer and KV head (``EventFeatures.pass_scores_LNK``, assembled
by ``context_scores``); a keep set takes their mean over layers and KV heads
(``aggregate="max"``: their maximum), a per-layer set (``keep_sets="layer"``) its
layer's mean over KV heads, and keeps ``F ∪ top-k`` as every policy does
(ALGORITHMS.md §1), the first ``n_sink`` live entries forced (kvpress's sinks at
the maximum plus one). A per-KV-head set, kvpress's, is not offered yet.

Where jaxkv departs, or may: nothing in the score. The functions take the context
keys the softmax may read as a mask (``softmax_N``) rather than slicing them, so one
compiled shape serves every chunk and padding; called with kvpress's masks
(``chunk_masks``) they compute kvpress's numbers (``tests/test_kvzip.py`` holds them
to a float64 NumPy statement of kvpress's code, GQA and padding included). Which keep
set the scores feed (one per request, per layer, per KV head) and how the scores are
aggregated for it are the policy's choice (above), not the score's. What the
passes cost is reported beside the event (``CompressionReport.scoring_tokens``:
the tokens forwarded to score, beside the context's own prefill).

Shape letters (``jaxkv.policies.base``): L layers, N context entries, X rows of a
reconstruction input, Hq query heads (H in names), Hkv KV heads (K in names),
G = Hq / Hkv, D head dim, A (layer, KV head) pairs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.attention import gqa_scores, group_heads, masked_softmax
from jaxkv.errors import ConfigError
from jaxkv.policies.base import Needs, Policy, register

N_SINK = 4
CHUNK_SIZE = 2048
PREV_POSTFIX = 8  # tokens of the previous chunk that start a later chunk's prompt
FIRST_PROMPT = "\n\nRepeat the previous context exactly."
LATER_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"


# --------------------------------------------------------------------------- the score
def reconstruction_scores(q_LXHD, k_LNKD, kself_LXKD, softmax_N, scored_N, valid_X, row_scale_LX=None, col_scale_LHN=None):
    """KVzip's score of one reconstruction pass, ``[L, N, Hkv]`` float32.

    Args:
      q_LXHD: post-RoPE queries of the pass's input rows ``[L, X, Hq, D]``.
      k_LNKD: post-RoPE context keys ``[L, N, Hkv, D]`` (the whole context, or any
        part that holds what ``softmax_N`` marks).
      kself_LXKD: post-RoPE keys of the input rows themselves ``[L, X, Hkv, D]``.
      softmax_N: context entries in the softmax's denominator (bool ``[N]``;
        kvpress: the sinks and the chunk, ``chunk_masks``).
      scored_N: context entries that get a score (bool ``[N]``; kvpress: the chunk);
        the rest score 0.
      valid_X: real input rows (bool ``[X]``); padding rows neither query nor are keys.
      row_scale_LX, col_scale_LHN: KVzip+'s factors (``1/‖h_x‖`` per row, ``‖v_i
        W_O^{(h)}‖`` per query head and context entry), applied to the probabilities
        before the maxima; None: 1.

    Row ``x`` attends to the ``softmax_N`` context entries and to input rows
    ``y <= x`` (causal); the score of entry ``i`` of KV head ``k`` is the maximum
    over valid rows and over ``k``'s ``G`` query heads of its probability.
    """
    L, X, Hq, _ = q_LXHD.shape
    Hkv = k_LNKD.shape[2]
    N = k_LNKD.shape[1]
    q_LXKGD = group_heads(q_LXHD, Hkv)
    logits_LKGXM = jnp.concatenate([gqa_scores(q_LXKGD, k_LNKD), gqa_scores(q_LXKGD, kself_LXKD)], axis=-1)
    valid_X = jnp.asarray(valid_X, bool)
    causal_XX = jnp.tril(jnp.ones((X, X), bool)) & valid_X[None, :]
    visible_XM = jnp.concatenate([jnp.broadcast_to(jnp.asarray(softmax_N, bool)[None, :], (X, N)), causal_XX], axis=-1)
    probs_LKGXN = masked_softmax(logits_LKGXM, visible_XM)[..., :N]
    if row_scale_LX is not None:
        probs_LKGXN = probs_LKGXN * jnp.asarray(row_scale_LX, jnp.float32)[:, None, None, :, None]
    if col_scale_LHN is not None:
        col_LKGN = jnp.asarray(col_scale_LHN, jnp.float32).reshape(L, Hkv, Hq // Hkv, N)
        probs_LKGXN = probs_LKGXN * col_LKGN[:, :, :, None, :]
    probs_LKGXN = jnp.where(valid_X[None, None, None, :, None], probs_LKGXN, 0.0)
    score_LKN = probs_LKGXN.max(axis=(2, 3))
    return jnp.where(jnp.asarray(scored_N, bool)[None, :, None], score_LKN.transpose(0, 2, 1), 0.0)


def chunk_masks(n: int, start: int, end: int, n_sink: int = N_SINK) -> tuple[np.ndarray, np.ndarray]:
    """kvpress's columns for the chunk ``[start, end)`` of an ``n``-entry context:
    ``softmax_N`` (the first ``min(n_sink, start)`` entries and the chunk) and
    ``scored_N`` (the chunk)."""
    if not 0 <= start <= end <= n:
        raise ValueError(f"chunk [{start}, {end}) is not inside a context of {n}")
    idx = np.arange(n)
    scored = (idx >= start) & (idx < end)
    return scored | (idx < min(n_sink, start)), scored


def context_scores(chunk_scores_LNK, n_sink: int = N_SINK):
    """The pass scores assembled as kvpress assembles them: each chunk's pass
    (``reconstruction_scores``, 0 outside its chunk) written into one array (the sum,
    since the chunks are disjoint), positions in no chunk at 0, and the first
    ``n_sink`` positions at the global maximum plus 1, so no selection drops them.
    ``chunk_scores_LNK``: one ``[L, N, Hkv]`` array per chunk (a sequence or a
    stacked ``[C, L, N, Hkv]``)."""
    total_LNK = jnp.sum(jnp.stack(list(chunk_scores_LNK)), axis=0)
    return total_LNK.at[:, :n_sink].set(total_LNK.max() + 1.0)


PASS_ROW_BLOCK = 128  # rows of a pass whose scores ``pass_scores`` holds at once
PASS_SELF_BLOCK = 256  # the pass's own keys per step of its causal walk


def pass_scores(q_LXHD, k_LNKD, kself_LXKD, softmax_LN, scored_LN, valid_X, block: int = PASS_ROW_BLOCK, self_block: int = PASS_SELF_BLOCK):
    """``reconstruction_scores`` of one pass with a context mask per layer, one layer
    and ``block`` rows at a time: ``[L, N, Hkv]`` float32.

    ``softmax_LN`` / ``scored_LN`` (bool ``[L, N]``) are layer ``l``'s
    ``softmax_N`` / ``scored_N`` (per-layer keep sets: each layer's softmax runs
    over the entries it still reads); the other arguments are
    ``reconstruction_scores``'s, and so are the numbers (to float32 rounding).

    How, and why: the score of entry ``i`` is ``max_x p_{x,i} = exp(max_x (l_{x,i}
    - lse_x))``, with ``l`` the scaled logits and ``lse_x`` row ``x``'s log of the
    softmax's denominator. So a block of rows never forms the probabilities: it
    takes ``lse`` over the context's visible entries and, by an online
    log-sum-exp, over the pass's own keys walked causally in blocks of
    ``self_block`` up to the block's last row (the keys after it are never
    visible, so they are never multiplied), then keeps the maximum of ``l - lse``
    per entry; one exponential per entry at the end. A layer's KV heads run
    together (``[Hkv, G, block, N]`` logits), and a block whose rows are all
    invalid (a pass padded to its compiled size) is skipped. Against a softmax per
    (layer, KV head) pair and block over ``[context, every input key]``, this
    reads half the pass's own keys and makes one pass fewer over the logits: 2.87x
    at SmolLM2's 2k shapes (``python -m eval.bench.kvzip_scoring``, which runs the
    two side by side; ``eval.bench.kvzip_event`` times a whole event)."""
    _, X, _, D = q_LXHD.shape
    N, Hkv = k_LNKD.shape[1], k_LNKD.shape[2]
    R = min(int(block), X)
    S = -(-max(int(self_block), R) // R) * R  # a whole number of row blocks
    Xp = -(-X // S) * S  # rows and the pass's keys, padded (invalid)
    neg = jnp.float32(-jnp.inf)
    q_LKGXD = jnp.transpose(group_heads(jnp.asarray(q_LXHD, jnp.float32), Hkv), (0, 2, 3, 1, 4)) * jnp.float32(1.0 / np.sqrt(D))
    q_LKGXD = jnp.pad(q_LKGXD, ((0, 0), (0, 0), (0, 0), (0, Xp - X), (0, 0)))
    k_LKND = jnp.transpose(jnp.asarray(k_LNKD, jnp.float32), (0, 2, 1, 3))
    kself_LKXD = jnp.pad(jnp.transpose(jnp.asarray(kself_LXKD, jnp.float32), (0, 2, 1, 3)), ((0, 0), (0, 0), (0, Xp - X), (0, 0)))
    valid_X = jnp.pad(jnp.asarray(valid_X, bool), (0, Xp - X))

    def finite_or_zero(m):
        return jnp.where(jnp.isfinite(m), m, 0.0)

    def layer(args):
        q_KGXD, k_KND, kself_KXD, softmax_N, scored_N = args

        def block_scores(b):
            q_KGRD = jax.lax.dynamic_slice_in_dim(q_KGXD, b * R, R, axis=2)
            row_R = b * R + jnp.arange(R)
            logit_KGRN = jnp.where(softmax_N, jnp.einsum("kgrd,knd->kgrn", q_KGRD, k_KND), neg)
            m_KGR = logit_KGRN.max(-1)
            z_KGR = jnp.exp(logit_KGRN - finite_or_zero(m_KGR)[..., None]).sum(-1)

            def own_keys(c, mz):  # the pass's keys [c·S, (c+1)·S): the online log-sum-exp
                m, z = mz
                col_S = c * S + jnp.arange(S)
                visible_RS = (col_S[None, :] <= row_R[:, None]) & jax.lax.dynamic_slice_in_dim(valid_X, c * S, S)[None, :]
                kself_KSD = jax.lax.dynamic_slice_in_dim(kself_KXD, c * S, S, axis=1)
                logit_KGRS = jnp.where(visible_RS, jnp.einsum("kgrd,ksd->kgrs", q_KGRD, kself_KSD), neg)
                m_new = jnp.maximum(m, logit_KGRS.max(-1))
                rescale = jnp.exp(jnp.where(jnp.isfinite(m), m - finite_or_zero(m_new), neg))
                return m_new, z * rescale + jnp.exp(logit_KGRS - finite_or_zero(m_new)[..., None]).sum(-1)

            m_KGR, z_KGR = jax.lax.fori_loop(0, (b * R + R - 1) // S + 1, own_keys, (m_KGR, z_KGR))
            # (l - m) - log z, not l - (m + log z): the logits' scale never enters the rounding
            log_p_KGRN = (logit_KGRN - finite_or_zero(m_KGR)[..., None]) - jnp.log(z_KGR)[..., None]
            live_R = jax.lax.dynamic_slice_in_dim(valid_X, b * R, R)
            return jnp.where(live_R[:, None], log_p_KGRN, neg).max(axis=(1, 2))

        def rows(b):  # a block of padding rows only scores 0 everywhere: skipped (a pass is padded to pass_rows)
            live = jax.lax.dynamic_slice_in_dim(valid_X, b * R, R).any()
            return jax.lax.cond(live, block_scores, lambda b: jnp.full((Hkv, N), neg), b)

        best_KN = jax.lax.map(rows, jnp.arange(Xp // R)).max(axis=0)
        return jnp.where(scored_N & softmax_N, jnp.exp(best_KN), 0.0)

    softmax_LN, scored_LN = jnp.asarray(softmax_LN, bool), jnp.asarray(scored_LN, bool)
    score_LKN = jax.lax.map(layer, (q_LKGXD, k_LKND, kself_LKXD, softmax_LN, scored_LN))
    return score_LKN.transpose(0, 2, 1)


# --------------------------------------------------------------------------- the inputs (host side)
@dataclasses.dataclass(frozen=True)
class RepeatChunk:
    """One reconstruction pass: the context entries ``[start, end)`` it scores and the
    token ids fed after the context (``ids``, int32) to score them; ``prompt`` is how
    many of those ids come before the chunk's own tokens (the repeat prompt, the
    previous chunk's tail and the template's suffix)."""

    start: int
    end: int
    ids: np.ndarray
    prompt: int


def template_split(tokenizer) -> tuple[int, np.ndarray]:
    """kvpress's reading of a chat template: the tokens the template writes before a
    user message's content (their count, ``prefix_length``) and the ids of what it
    writes after it with a generation prompt (the suffix). Without a template: 0 and
    ``"\\n"``."""
    if getattr(tokenizer, "chat_template", None) is None:
        prefix_text, suffix_text = "", "\n"
    else:
        dummy = "dummy context"
        separator = "\n" + "#" * len(dummy)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": dummy + separator}], add_generation_prompt=True, tokenize=False, enable_thinking=False
        )
        context, suffix_text = text.split(separator)
        prefix_text = context.split(dummy)[0]
    encode = lambda t: tokenizer.encode(t, add_special_tokens=False)
    return len(encode(prefix_text)), np.asarray(encode(suffix_text), np.int32)


def repeat_chunks(tokenizer, context_ids, chunk_size: int = CHUNK_SIZE, prev_postfix: int = PREV_POSTFIX) -> list[RepeatChunk]:
    """kvpress's reconstruction inputs for a prefilled context ``context_ids`` (module
    docstring): the tokens after the template's prefix in chunks of ``chunk_size``,
    each with its repeat prompt and the template's suffix before it."""
    context_ids = np.asarray(context_ids, np.int32)
    prefix, suffix = template_split(tokenizer)
    body = context_ids[prefix:]
    encode = lambda t: np.asarray(tokenizer.encode(t, add_special_tokens=False), np.int32)
    out = []
    for i, lo in enumerate(range(0, body.size, chunk_size)):
        chunk = body[lo : lo + chunk_size]
        tail = body[lo - min(prev_postfix, chunk_size) : lo]  # the previous chunk's last tokens
        head = encode(FIRST_PROMPT) if i == 0 else np.concatenate([encode(LATER_PROMPT), tail])
        ids = np.concatenate([head, suffix, chunk])
        out.append(RepeatChunk(prefix + lo, prefix + lo + chunk.size, ids, int(head.size + suffix.size)))
    return out


def pass_overhead(tokenizer, prev_postfix: int = PREV_POSTFIX) -> int:
    """The most ids a pass's input carries besides its chunk (``RepeatChunk.prompt``
    of a later chunk, or of the first when that is longer): what a row needs past
    its context for a pass, beside the chunk."""
    _, suffix = template_split(tokenizer)
    encode = lambda t: len(tokenizer.encode(t, add_special_tokens=False))
    return max(encode(FIRST_PROMPT), encode(LATER_PROMPT) + int(prev_postfix)) + int(suffix.size)


# --------------------------------------------------------------------------- the policy
AGGREGATES = ("mean", "max")


@dataclasses.dataclass(frozen=True)
class KVzipConfig:
    """Attributes:
    chunk_size: context tokens per reconstruction pass; default 2,048 (kvpress's).
      A row whose positions past the context cannot hold a pass of this many
      tokens is scored in smaller chunks (``jaxkv.serving.stages.reconstruction``).
    n_sink: the first live entries every pass's softmax reads and every keep set
      holds; default 4 (kvpress's).
    aggregate: a position's one score from its scores per layer and KV head:
      ``"mean"`` (default, ALGORITHMS.md §1) or ``"max"``.
    """

    chunk_size: int = CHUNK_SIZE
    n_sink: int = N_SINK
    aggregate: str = "mean"

    def __post_init__(self):
        if self.aggregate not in AGGREGATES:
            raise ConfigError(f"kvzip aggregate must be one of {AGGREGATES}, got {self.aggregate!r}")
        if self.chunk_size < 1 or self.n_sink < 0:
            raise ConfigError(f"kvzip needs chunk_size >= 1 and n_sink >= 0, got chunk_size={self.chunk_size}, n_sink={self.n_sink}")


def keep(cfg: KVzipConfig, feats):
    """The first ``n_sink`` real entries (kvpress's sinks, scored above every other)."""
    valid = feats.valid()
    return valid & (jnp.cumsum(valid) <= cfg.n_sink)


def score(cfg: KVzipConfig, state, feats, candidates_N):
    """The passes' scores of each live position, aggregated over layers and KV heads."""
    if feats.pass_scores_LNK is None:
        raise ConfigError("kvzip scores from its reconstruction passes: the event's features carry none (pass_scores_LNK)")
    s_LNK = jnp.asarray(feats.pass_scores_LNK, jnp.float32)
    s_N = s_LNK.mean(axis=(0, 2)) if cfg.aggregate == "mean" else s_LNK.max(axis=(0, 2))
    return jnp.where(jnp.asarray(candidates_N, bool), s_N, 0.0), state


def needs(cfg: KVzipConfig) -> Needs:
    return Needs(reconstruction=True)


POLICY = register(
    Policy(
        name="kvzip",
        config=KVzipConfig,
        score=score,
        needs=needs,
        keep=keep,
        doc="KVzip: attention from the model's reconstruction of its context (extra passes); sinks kept.",
    )
)
