"""Training rows for the IntentKV residual head: agent traces replayed with the full cache.

    JAX_PLATFORMS=cpu python -m train.intentkv_data --out runs/intentkv-data [--traces 1600 --heldout 200]

What a row is. A session with a retention policy runs a compression event after
the prompt of every assistant turn (IntentKV has no decode interval). With the
full cache every position of the prompt is live and keys are causal, so one
dense forward of the whole rendered conversation, capturing post-RoPE q/k per
layer through ``Transformer._run``'s ``attend`` callback, gives every key the
event of turn t sees: the prompt of assistant turn t is a prefix of the full
render (asserted for every turn; the agent traces have one user message, so
Qwen3's template keeps every reasoning), and the keys at its positions are the
full forward's keys there. Per assistant turn t (prompt length ``n``) a row holds:

* ``k̄_i`` for every live position ``i < n`` (mean over layers and KV heads,
  ``intentkv_head.mean_keys``). Rows of one trace share its ``k̄ [T, D]``:
  position ``i`` has the same key in every prompt that contains it.
* ``s_i``: the Phase-1 memory score of the event (the registered
  ``intentkv_memory`` score function on ``EventFeatures`` padded to the
  session's bucket), with the memory folded turn by turn exactly as a session
  does (``intentkv.update_memory`` with ``q̄_t``, the mean post-RoPE query over
  the turn's actionable query span, ``β = 0.7``); ``s`` is 0 off candidates.
* ``m̄`` (mean of the unit-norm memory), ``q̄`` (mean of ``q̄_t``) and
  ``q̄_unit`` (mean of the unit-norm ``q̄_t``, the no-memory ablation's vector),
  each ``[D]``; ``norm_err = mean_{l,h} (‖m_pre‖ − 1)²``, the memory's squared
  distance from unit norm before its projection (``L_norm``).
* the query span ``(a, b)``: ``K̄_Q`` is ``k̄[a:b]`` (every span position is
  live), and the protected prefix end ``p``.
* labels ``y_i ∈ {1, 0, −1}`` (``label_row``), int8.

Candidates and forced tokens. As in a session (``protect_query=True``), the
forced set is the protected prefix (system prompt + tool schemas, ``[0, p)``)
and the actionable query span ``[a, b)``; every other position ``< n`` is a
candidate (``cand = ~forced``; ``s`` and the softmax behind it range over
candidates only). Forced tokens are never candidates at inference, so they carry
label −1 and take no part in any loss or metric, whatever their text.

Labels (future-action grounding, ALGORITHMS.md §4). The future actions of turn t
are the next ``--horizon`` (5) assistant actions from turn t on, turn t's own
call included: every tool call counts as one action and contributes its argument
values; the final answer counts as one and contributes the values it reports
(the generator's ``ScoredTurn.values`` of the answer: record values and the
resolved registry value). A candidate token is positive when its characters
overlap a whole-word literal match (``(?<!\\w)value(?!\\w)``) of a future value in
the rendered text; −1 for forced tokens (current query span, protected prefix)
and for template/special tokens (special token ids, and every token the chat
tagger marks ``Semantic.DELIM``: role headers, message delimiters, bracket
markers); 0 otherwise. Rows with no positive are dropped.

Label variants (named options; ``labels`` above is §4's and the default; the
trainer picks with ``--labels``, ``label_array``): every row also carries

* ``labels_cue`` (``cue``): §4's matches plus, per match, the up to
  ``--cue-tokens`` (4) tokens right before it on its line (``k173: v032``,
  ``Orchid travel: d017``): the cue a copy of the value is found by;
* ``labels_read`` (``read``): what the model reads. A candidate is positive when
  some token of one of the next ``--horizon`` assistant replies (turn t's own
  included) gives it at least ``--read-threshold`` (0.2) of its attention in some
  layer and head of the full-cache forward (``read_strength``); template tokens
  are labelled too (0/1: they are candidates at inference and replies read them),
  only forced tokens get −1. Measured reason (``eval.profile.intentkv_diagnosis``): on
  held-out label seeds, under 5% of the positions the full-cache replies read
  carry a §4 label; a head trained on §4 alone keeps every labelled one and
  evicts the newlines, role headers, words and keys the replies also read.

A row is kept when any variant has a positive; ``label_array`` unions variants
(``actions+read``). Rows also carry ``read_max`` (float16): the attention weight
behind ``labels_read`` before its threshold, so ``read@T`` (``actions+read@0.05``)
labels at another threshold without regenerating the rows; and ``read_mass``
(float32): the mean attention weight the next ``--horizon`` replies give each
position (over layers, query heads and reply rows, ``read_stats``), so ``mass@F``
labels the fraction ``F`` of each row's candidates with the most mass: what the
replies' attention outputs lose most when they are evicted. Measured reason
(SmolLM2, the first grid of issue #27): a head trained on ``actions+read`` (30% of
candidates positive at 0.2) kept the replies further from the full cache than its
rule; ``read_max`` is a maximum over 270 heads, and one head attending to a token
says little about what evicting it costs.

Managed rows (``--events managed``). The rows above are off-policy: every event
sees the keys of an uncompressed context, while at inference every event after the
first runs on a cache the policy already compressed, whose later keys were
computed over the kept rows only. With ``--events managed`` a session runs
``--managed-policy`` (``intentkv_memory``, the rule the head corrects) on each
trace at a budget of ``--managed-budgets`` (fractions of the trace's rendered
length, taken in turn by seed; 0.5 and 0.65, the evaluation's) in the dead-slot
layout, teacher-forced, as an evaluation cell replays it, and each of its
compression events gives a row (``managed_trace_rows``): the live keys, the
session's forced set and query span, the policy's state and the rule score on
exactly what the event saw. Labels are still the full cache's (what the next
replies read with nothing evicted), at the live positions. Such a row has its own
``k̄`` (one "trace" per row in a shard) and carries per-position ``forced``,
``span`` and ``positions`` arrays, which the trainer reads instead of rebuilding
the masks from ``row_protected`` and ``row_span``. Turns before the first event
give no row. ``--part K/N`` lets N processes fill one folder (shards K, K+N, ...).

Seeds (disjoint from every evaluation seed; ``check_seed_ranges`` asserts it):
training traces use the per-example seeds ``one_trace(TRAIN_SEED_BASE + i)``,
``TRAIN_SEED_BASE = 200,000,000``, held-out traces ``HELDOUT_SEED_BASE + i``,
``300,000,000``, each split at most ``SPLIT_SEEDS = 10,000,000`` seeds. The
evaluation sets use per-example seeds ``example_seed(EVAL_SEED_BASE, i) =
996,773,056 + i`` (harness agent traces, ``EVAL_SEED_BASE = 2**30 + 9,000,000``;
note that ``example_seed`` hashes the batch seed to below 2**30),
``example_seed(EVAL_SEED_BASE + 500,000, i)`` (harness MQ-NIAH),
``DEMO_SEED_BASE + 1000·seed + i`` (demo, ``2**30 + 9,000,000``, at or above
2**30) and ``2**30 + 7,100,000 + i`` (``eval.quality.embedded_accuracy``). Trace lengths
are drawn per seed in ``[--length-min, --length-max]`` (1,792-2,304 tokens; the
harness uses 2,048); documents (1-3) and the registry as the generator draws them.

Shards (``SPLIT-00000.npz``, ``--shard-size`` traces each, written atomically):
``kbar`` ``[ΣT, D]`` f32 with ``trace_offset [traces+1]``; per row ``row_trace``,
``row_turn``, ``row_len`` (n), ``row_span [R, 2]``, ``row_protected``,
``row_mbar / row_qbar / row_qbar_unit [R, D]``, ``row_norm_err``, ``row_seed``,
and the per-position ``s`` f32 / ``labels`` int8 concatenated with ``row_offset
[R+1]``. A shard that exists is skipped, so an interrupted run resumes where it
stopped; ``meta.json`` records the arguments and totals. Its ``seconds`` is the
generation time of this run plus, when it reused shards, the ``seconds`` of the
last finished run (``seconds_this_run``: this run alone); an interrupted run's time
is not counted.

Cost (issue #75, managed rows of SmolLM2-135M traces of 1k-4k tokens, measured on
seeds 200,000,000-2 on a 2-core host shared with other jobs, nice 15). A trace
costs two forwards of its whole conversation and the replies' reads: the
full-cache capture (``capture_qk``, about 20-27 s a trace), the managed
session's replay (about 19-25 s), ``read_stats`` (1-10 s: numpy, memory-bound,
so it varies most with the host's load) and the programs of shapes the process
has not met yet (a capture bucket, a session's event sizes and steps: 27 programs
on a process's first trace, 6-8 on each of the next two, 40-60 s of compiles over
the three). ``generate`` turns on the persistent compilation cache
(``jaxkv.compiles.enable_persistent_cache``, ``$JAXKV_XLA_CACHE``), so a resumed
or later run loads those programs: 188 s for the three traces without it, 132 s
with a warm cache, the rows bitwise equal. The forwards are the floor: about 40 s
a trace on that host.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import math
import os
import random
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxkv import attention as ref_attention
from jaxkv.chat.render import render
from jaxkv.chat.tags import Semantic
from jaxkv.buckets import bucket
from jaxkv.policies import EventFeatures, get_policy, intentkv
from jaxkv.policies.common import unit_norm
from jaxkv.policies.intentkv_head import mean_keys, mean_query

TRAIN_SEED_BASE = 200_000_000
HELDOUT_SEED_BASE = 300_000_000
SPLIT_SEEDS = 10_000_000
SPLITS = {"train": TRAIN_SEED_BASE, "heldout": HELDOUT_SEED_BASE}
HORIZON = 5
CUE_TOKENS = 4  # the ``cue`` variant: tokens before a match, on its line (``Orchid travel: d017``)
READ_THRESHOLD = 0.2  # the ``read`` variant: attention weight that counts as a read
LABEL_VARIANTS = {"actions": "labels", "cue": "labels_cue", "read": "labels_read"}  # --labels -> shard array
EVAL_EXAMPLES = 1_000_000  # evaluation sets are assumed to use fewer examples per seed than this


def evaluation_seed_ranges() -> dict[str, range]:
    """Per-example seeds the evaluation code uses (a range per evaluation set)."""
    from jaxkv.demo import DEMO_SEED_BASE
    from jaxkv.tasks.example import example_seed
    from jaxkv.tasks.seeds import ACCURACY_SEED_BASE, EVAL_SEED_BASE

    def batch(seed):
        start = example_seed(seed, 0)
        assert example_seed(seed, EVAL_EXAMPLES - 1) == start + EVAL_EXAMPLES - 1  # no wrap-around
        return range(start, start + EVAL_EXAMPLES)

    return {
        "harness agent": batch(EVAL_SEED_BASE),
        "harness mqniah": batch(EVAL_SEED_BASE + 500_000),
        "demo": range(DEMO_SEED_BASE, DEMO_SEED_BASE + 1000 * 1000 + EVAL_EXAMPLES),
        "embedded_accuracy": range(ACCURACY_SEED_BASE, ACCURACY_SEED_BASE + 100_000 + EVAL_EXAMPLES),
    }


def check_seed_ranges() -> None:
    """Assert the training and held-out seed ranges meet each other and no evaluation range."""
    ranges = {name: range(base, base + SPLIT_SEEDS) for name, base in SPLITS.items()}
    ranges.update(evaluation_seed_ranges())
    for name in SPLITS:
        r = ranges[name]
        for other, o in ranges.items():
            assert other == name or r.stop <= o.start or o.stop <= r.start, f"seed ranges {name} {r} and {other} {o} overlap"


# -- the frozen model's features ---------------------------------------------------------
@functools.partial(jax.jit, static_argnums=0)
def _capture_qk(graphdef, params, tokens_1T):
    module = nnx.merge(graphdef, params)

    def attend(i, q, k, v, carry):
        return ref_attention.causal_attention(q, k, v), carry, (q[0].astype(jnp.float32), k[0].astype(jnp.float32))

    T = tokens_1T.shape[1]
    _, _, (qs, ks) = module.run_layers(module.embed_tokens(tokens_1T), jnp.arange(T, dtype=jnp.int32)[None], attend)
    return qs, ks


def capture_qk(model, ids) -> tuple[np.ndarray, np.ndarray]:
    """Post-RoPE ``q [L, T, Hq, D]`` and ``k [L, T, Hkv, D]`` of one dense causal
    forward of ``ids`` (padded to a bucket at the end, which causality hides)."""
    ids = np.asarray(ids, np.int32)
    T = ids.size
    padded = np.zeros((1, bucket(T)), np.int32)
    padded[0, :T] = ids
    graphdef, params = model.split()
    q, k = _capture_qk(graphdef, params, jnp.asarray(padded))
    return np.asarray(q[:, :T]), np.asarray(k[:, :T])


@functools.lru_cache(maxsize=None)
def _memory_score_jit():
    policy = get_policy("intentkv_memory")
    cfg = policy.make_config()
    return cfg, jax.jit(functools.partial(policy.score, cfg))


def memory_scores(state, keys_LnKD, q_mean_LHD, cand_n) -> np.ndarray:
    """``intentkv_memory``'s score at an event whose live keys are ``keys_LnKD``,
    computed as a session does (features padded to its bucket)."""
    L, n, K, D = keys_LnKD.shape
    N = bucket(n)
    keys = np.zeros((L, N, K, D), np.float32)
    keys[:, :n] = keys_LnKD
    cand = np.zeros(N, bool)
    cand[:n] = cand_n
    feats = EventFeatures(
        keys_LNKD=jnp.asarray(keys),
        positions_N=jnp.arange(N, dtype=jnp.int32),
        phase_N=jnp.zeros(N, jnp.int32),
        window_q_LWHD=jnp.zeros((L, 1, q_mean_LHD.shape[1], D), jnp.float32),
        window_pos_W=jnp.zeros(1, jnp.int32),
        window_valid_W=jnp.zeros(1, bool),
        acc_mass_N=jnp.zeros(N, jnp.float32),
        query_mean_LHD=jnp.asarray(q_mean_LHD, jnp.float32),
        seq_len=jnp.int32(n),
        valid_N=jnp.asarray(np.arange(N) < n),
    )
    _, score = _memory_score_jit()
    s, _ = score(state, feats, jnp.asarray(cand))
    return np.asarray(s)[:n]


# -- labels --------------------------------------------------------------------------------
def future_values(messages, j: int, horizon: int = HORIZON, answer_values=()) -> list[str]:
    """Values of the next ``horizon`` actions from assistant message ``j`` on: each
    tool call's argument values, and the final answer's ``answer_values`` (one action)."""
    values, actions = [], 0
    for m in messages[j:]:
        if m.get("role") != "assistant":
            continue
        calls = m.get("tool_calls") or ()
        for call in calls:
            if actions == horizon:
                return values
            args = call.get("function", call).get("arguments") or {}
            if isinstance(args, str):
                args = json.loads(args)
            values += [v if isinstance(v, str) else json.dumps(v) for v in args.values()]
            actions += 1
        if not calls:
            if actions == horizon:
                return values
            values += list(answer_values)
            actions += 1
    return values


def value_masks(text: str, offsets: np.ndarray, values, cue_tokens: int = 0) -> np.ndarray:
    """Bool ``[T]``: tokens whose characters overlap a whole-word match of a value.

    ``cue_tokens > 0`` (the ``cue`` label variant) also marks, for every match, the
    up to ``cue_tokens`` tokens right before it that start on the match's line: the
    cue a copy of the value is found by (``k173: v032`` marks ``k173`` ``:`` `` ``;
    ``Orchid travel: d017`` marks the whole line). ``0`` is §4's label exactly."""
    hit = np.zeros(len(offsets), bool)
    starts, ends = offsets[:, 0], offsets[:, 1]
    for value in dict.fromkeys(v for v in values if v):
        for m in re.finditer(rf"(?<!\w){re.escape(value)}(?!\w)", text):
            match = (starts < m.end()) & (ends > m.start())
            hit |= match
            if cue_tokens and match.any():
                first = int(np.argmax(match))
                before = np.arange(max(0, first - cue_tokens), first)
                hit[before[starts[before] >= text.rfind("\n", 0, m.start()) + 1]] = True
    return hit


def reply_spans(tok, messages, tools) -> list[tuple[int, int, int]]:
    """``(message index j, prompt length n, reply end)`` per assistant message: the
    reply's tokens are positions ``[n, end)`` of the full render, its prompt ``[0, n)``."""
    out = []
    for j, m in enumerate(messages):
        if m.get("role") == "assistant":
            n = render(tok, messages[:j], tools, add_generation_prompt=True).ids.size
            end = render(tok, messages[: j + 1], tools, add_generation_prompt=False).ids.size
            out.append((j, n, end))
    return out


def read_strength(q_LTHD, k_LTKD, n: int, end: int) -> np.ndarray:
    """``a [n]``: the largest attention weight any reply row ``[n, end)`` gives each
    prompt position ``< n`` in the full-cache forward, over layers and query heads
    (the model's own ``softmax(q·k/√D)``, causal; query head ``h`` reads KV head
    ``h // (Hq / Hkv)``)."""
    return read_stats(q_LTHD, k_LTKD, n, end)[0]


def read_stats(q_LTHD, k_LTKD, n: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """``(read_strength, mass)``, each ``[n]``: the largest attention weight any reply
    row ``[n, end)`` gives each prompt position (``read_strength``), and the mean
    weight over layers, query heads and reply rows (the attention mass a reply
    token spends on the position, on average: what evicting it takes from the
    replies' attention outputs). One batched matmul per (layer, KV head, group): a
    plain ``einsum`` over the GQA-expanded keys took 10 s per reply on SmolLM2's 30 x 9 heads."""
    L, T, H, D = q_LTHD.shape
    K = k_LTKD.shape[2]
    q = np.asarray(q_LTHD[:, n:end], np.float32).reshape(L, end - n, K, H // K, D).transpose(0, 2, 3, 1, 4)
    k = np.asarray(k_LTKD[:, :end], np.float32).transpose(0, 2, 3, 1)[:, :, None]  # [L, K, 1, D, end]
    logits = np.matmul(q, k) / np.sqrt(np.float32(D))  # [L, K, G, rows, end]
    causal = np.arange(end)[None, :] <= (n + np.arange(end - n))[:, None]
    logits = np.where(causal, logits, -np.inf)
    logits -= logits.max(-1, keepdims=True)
    np.exp(logits, out=logits)
    logits /= logits.sum(-1, keepdims=True)
    return logits.max(axis=(0, 1, 2, 3))[:n], logits.mean(axis=(0, 1, 2, 3))[:n]


def template_mask(tokenizer, rendered) -> np.ndarray:
    """Bool ``[T]``: special tokens and the tagger's DELIM tokens (template scaffolding)."""
    special = np.isin(rendered.ids, np.asarray(sorted(tokenizer.all_special_ids), np.int64))
    return special | (rendered.triaxial["semantic"] == Semantic.DELIM)


def label_row(prompt, positive_T: np.ndarray, template_n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(labels [n] int8, cand [n] bool)`` of one event on ``prompt`` (a ``Rendered``).

    ``positive_T`` marks value matches over the full conversation (``value_masks``);
    forced tokens (protected prefix, actionable query) and template tokens get −1."""
    n = prompt.ids.size
    forced = np.zeros(n, bool)
    for a, b in (prompt.spans.protected_prefix, prompt.spans.actionable_query):
        forced[a:b] = True
    labels = positive_T[:n].astype(np.int8)
    labels[forced | template_n] = -1
    return labels, ~forced


# -- one trace -----------------------------------------------------------------------------
def full_cache_reads(model, messages, tools):
    """What the labels of one conversation come from: ``(full, offsets, q, k,
    replies, stats)``: its render, the character offsets of its tokens, the
    post-RoPE ``q [L, T, Hq, D]`` / ``k [L, T, Hkv, D]`` of one full-cache forward,
    ``reply_spans`` and each reply's ``read_stats`` (what it reads of its prompt)."""
    tok = model.tokenizer
    full = render(tok, messages, tools, add_generation_prompt=False)
    enc = tok(full.text, add_special_tokens=False, return_offsets_mapping=True)
    assert np.array_equal(np.asarray(enc["input_ids"]), full.ids), "offsets must describe the rendered ids"
    offsets = np.asarray(enc["offset_mapping"], np.int64)
    q_LTHD, k_LTKD = capture_qk(model, full.ids)
    replies = reply_spans(tok, messages, tools)
    stats = [read_stats(q_LTHD, k_LTKD, n, end) for _, n, end in replies]
    return full, offsets, q_LTHD, k_LTKD, replies, stats


def trace_rows(
    model,
    messages,
    tools,
    answer_values=(),
    horizon: int = HORIZON,
    beta: float | None = None,
    keep_empty=False,
    cue_tokens: int = CUE_TOKENS,
    read_threshold: float = READ_THRESHOLD,
    label_messages=None,
):
    """Rows of one conversation (see the module docstring) as a dict of arrays:
    ``kbar [T, D]`` and lists of per-row entries, each with the three label
    variants (``labels``: §4; ``labels_cue``: with ``cue_tokens``; ``labels_read``:
    attention of the next ``horizon`` replies at ``read_threshold``). ``beta``: the
    memory decay (default: ``intentkv_memory``'s). A row is kept when any variant
    has a positive; ``keep_empty`` keeps every row (tests). ``label_messages``: the
    conversation the future actions are read from when ``messages`` is its
    rendering for a template without tools (``jaxkv.tasks.example.inline_tools``,
    one message for one); default ``messages``."""
    beta = intentkv.IntentKVMemoryConfig().beta if beta is None else beta
    tok = model.tokenizer
    full, offsets, q_LTHD, k_LTKD, replies, stats = full_cache_reads(model, messages, tools)
    kbar = np.asarray(mean_keys(k_LTKD))
    cfg = model.config
    state = intentkv.QueryMemory(jnp.zeros((cfg.num_layers, cfg.num_heads, cfg.head_dim), jnp.float32), jnp.zeros((), bool))
    rows = []
    masks: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    for turn, (j, n, _) in enumerate(replies):
        prompt = render(tok, messages[:j], tools, add_generation_prompt=True)
        assert np.array_equal(full.ids[:n], prompt.ids), f"the prompt of assistant message {j} is not a prefix of the render"
        a, b = prompt.spans.actionable_query
        if b <= a:
            continue  # no actionable query: a session folds nothing into the memory
        q_mean = q_LTHD[:, a:b].mean(axis=1)
        norm_err = float(np.mean((np.linalg.norm(np.asarray(intentkv.blend_memory(beta, state, q_mean)), axis=-1) - 1.0) ** 2))
        state = intentkv.update_memory(beta, state, q_mean)
        values = tuple(future_values(messages if label_messages is None else label_messages, j, horizon, answer_values))
        if values not in masks:
            masks[values] = (value_masks(full.text, offsets, values), value_masks(full.text, offsets, values, cue_tokens))
        template = template_mask(tok, prompt)
        labels, cand = label_row(prompt, masks[values][0], template)
        labels_cue, _ = label_row(prompt, masks[values][1], template)
        # a read is a read whatever the token: template tokens (``\n``, ``<|im_start|>``) are
        # candidates at inference and the replies attend to them, so only forced ones are ignored
        read_max = np.max([r[:n] for r, _ in stats[turn : turn + horizon]], axis=0)
        read_mass = np.mean([m[:n] for _, m in stats[turn : turn + horizon]], axis=0)
        labels_read, _ = label_row(prompt, read_max >= read_threshold, np.zeros(n, bool))
        if not keep_empty and not any((x == 1).any() for x in (labels, labels_cue, labels_read)):
            continue
        s = memory_scores(state, k_LTKD[:, :n], q_mean, cand)
        rows.append(
            dict(
                turn=turn,
                len=n,
                span=(a, b),
                protected=prompt.spans.protected_prefix[1],
                mbar=np.asarray(mean_query(state.m_LHD)),
                qbar=np.asarray(mean_query(q_mean)),
                qbar_unit=np.asarray(mean_query(unit_norm(q_mean))),
                norm_err=norm_err,
                s=s.astype(np.float32),
                labels=labels,
                labels_cue=labels_cue,
                labels_read=labels_read,
                values=values,
                read_max=read_max.astype(np.float16),
                read_mass=read_mass.astype(np.float32),
            )
        )
    return {"kbar": kbar, "rows": rows, "ids": full.ids}


@contextlib.contextmanager
def recorded_events():
    """Record the inputs of every compression event sessions run inside the block:
    a list that fills with ``(policy, config, state, feats, forced_N, budget)`` per
    event, taken as ``RetentionStage.compress`` hands them to ``compress_row`` (the
    state is the policy's after this turn's ``observe``, before the event)."""
    from jaxkv.serving.stages import retention

    events = []
    original = retention.compress_row

    def recording(engine, row, policy, cfg, state, feats, forced_N, budget, *args, **kwargs):
        events.append((policy, cfg, state, feats, np.asarray(forced_N, bool), budget))
        return original(engine, row, policy, cfg, state, feats, forced_N, budget, *args, **kwargs)

    retention.compress_row = recording
    try:
        yield events
    finally:
        retention.compress_row = original


_SESSION_IDS = itertools.count()


def managed_trace_rows(
    model,
    messages,
    tools,
    answer_values=(),
    *,
    server,
    budget: int,
    policy: str = "intentkv_memory",
    horizon: int = HORIZON,
    cue_tokens: int = CUE_TOKENS,
    read_threshold: float = READ_THRESHOLD,
    label_messages=None,
):
    """Rows of one conversation replayed on a managed cache (``--events managed``).

    A session on ``server`` replays the conversation (teacher-forced) under
    ``policy`` at ``budget`` live tokens, dead-slot layout, as an evaluation cell
    does; every compression event it runs gives one row, built from what that
    event saw: the live keys (computed over the rows earlier events kept), their
    positions, the session's forced set and query span, the policy's state, and
    the rule score ``s`` on exactly those features. Labels come from the
    full-cache forward (``full_cache_reads``): what the next ``horizon`` replies
    read of each live position with nothing evicted, the same variants as
    ``trace_rows``. Positions an earlier event evicted are in no row.

    Returns a list of single-row traces (``{"kbar": [n, D], "rows": [row]}``):
    each event has its own keys, so rows share none. A row carries per-position
    ``forced`` and ``span`` masks (the trainer reads them instead of rebuilding
    them from ``protected`` and ``span``), and ``positions`` (each live entry's
    position in the conversation). ``norm_err`` is 0: the session folds the
    memory before the event, and the loss term it feeds is a constant of the data."""
    from jaxkv.policies.intentkv import scoring_memory
    from jaxkv.serving.stages.events import score_and_select

    tok = model.tokenizer
    full, offsets, _, _, replies, stats = full_cache_reads(model, messages, tools)
    template_T = template_mask(tok, full)
    turn_of = {n: turn for turn, (_, n, _) in enumerate(replies)}
    # an id of its own: a derived one (ALGORITHMS.md §4) would join an earlier replay of the
    # same conversation on this server, and its policy state
    session = server.session(policy=policy, budget=int(budget), layout="dead_slot", session_id=f"intentkv-data-{next(_SESSION_IDS)}")
    with recorded_events() as events:
        try:
            session.replay(messages, tools)
        finally:
            session.close()
    traces, masks = [], {}
    for pol, cfg, state, feats, forced_N, event_budget in events:
        valid_N = np.asarray(feats.valid_N)
        n = int(valid_N.sum())
        pos = np.asarray(feats.positions_N)[:n]
        turn = turn_of.get(int(feats.seq_len))
        if turn is None:
            continue  # an event inside a reply (a decode interval): no prompt to label
        j, n_prompt, _ = replies[turn]
        _, s_N, _ = score_and_select(pol, cfg, state, feats, forced_N, np.int32(event_budget))  # the event's own program
        memory = getattr(state, "memory", state)  # intentkv's state wraps the rule's QueryMemory
        q_mean = np.asarray(feats.query_mean_LHD, np.float32)
        forced = forced_N[:n]
        span = np.asarray(feats.query_span_N)[:n] if feats.query_span_N is not None else np.zeros(n, bool)
        values = tuple(future_values(messages if label_messages is None else label_messages, j, horizon, answer_values))
        if values not in masks:
            masks[values] = (value_masks(full.text, offsets, values), value_masks(full.text, offsets, values, cue_tokens))
        ignored = forced | template_T[pos]
        labels = np.where(ignored, -1, masks[values][0][pos]).astype(np.int8)
        labels_cue = np.where(ignored, -1, masks[values][1][pos]).astype(np.int8)
        read_max = np.max([r[:n_prompt][pos] for r, _ in stats[turn : turn + horizon]], axis=0)
        read_mass = np.mean([m[:n_prompt][pos] for _, m in stats[turn : turn + horizon]], axis=0)
        labels_read = np.where(forced, -1, read_max >= read_threshold).astype(np.int8)
        if not any((x == 1).any() for x in (labels, labels_cue, labels_read)):
            continue
        at = np.flatnonzero(span)
        traces.append(
            {
                "kbar": np.asarray(mean_keys(np.asarray(feats.keys_LNKD)[:, :n])),
                "rows": [
                    dict(
                        turn=turn,
                        len=n,
                        span=(int(at[0]), int(at[-1]) + 1) if at.size else (0, 0),
                        protected=int(np.argmin(forced)) if not forced.all() else n,
                        mbar=np.asarray(mean_query(scoring_memory(memory, feats))),
                        qbar=np.asarray(mean_query(q_mean)),
                        qbar_unit=np.asarray(mean_query(unit_norm(q_mean))),
                        norm_err=0.0,
                        s=np.asarray(s_N, np.float32)[:n],
                        labels=labels,
                        labels_cue=labels_cue,
                        labels_read=labels_read,
                        values=values,
                        read_max=read_max.astype(np.float16),
                        read_mass=read_mass.astype(np.float32),
                        forced=forced,
                        span_mask=span,
                        positions=pos.astype(np.int32),
                    )
                ],
            }
        )
    return traces


def answer_values_of(example) -> tuple[str, ...]:
    """The values the example's final answer reports (its answer target's ``values``)."""
    return next((tuple(t.values) for t in example.targets if t.kind == "answer"), ())


def trace_length(seed: int, lo: int, hi: int) -> int:
    return random.Random(seed ^ 0x5EED).randint(lo, hi)


# -- shards --------------------------------------------------------------------------------
def pack_shard(traces: list[dict], seeds: list[int]) -> dict[str, np.ndarray]:
    kbar = [t["kbar"] for t in traces]
    rows = [(i, r) for i, t in enumerate(traces) for r in t["rows"]]
    D = kbar[0].shape[1] if kbar else 0
    out = {
        "kbar": np.concatenate(kbar) if kbar else np.zeros((0, D), np.float32),
        "trace_offset": np.concatenate([[0], np.cumsum([k.shape[0] for k in kbar])]).astype(np.int64),
        "trace_seed": np.asarray(seeds, np.int64),
        "row_trace": np.asarray([i for i, _ in rows], np.int32),
        "row_seed": np.asarray([seeds[i] for i, _ in rows], np.int64),
        "row_turn": np.asarray([r["turn"] for _, r in rows], np.int32),
        "row_len": np.asarray([r["len"] for _, r in rows], np.int32),
        "row_span": np.asarray([r["span"] for _, r in rows], np.int32).reshape(-1, 2),
        "row_protected": np.asarray([r["protected"] for _, r in rows], np.int32),
        "row_mbar": np.asarray([r["mbar"] for _, r in rows], np.float32).reshape(-1, D),
        "row_qbar": np.asarray([r["qbar"] for _, r in rows], np.float32).reshape(-1, D),
        "row_qbar_unit": np.asarray([r["qbar_unit"] for _, r in rows], np.float32).reshape(-1, D),
        "row_norm_err": np.asarray([r["norm_err"] for _, r in rows], np.float32),
        "row_offset": np.concatenate([[0], np.cumsum([r["len"] for _, r in rows])]).astype(np.int64),
        "s": np.concatenate([r["s"] for _, r in rows]) if rows else np.zeros(0, np.float32),
    }
    for key in LABEL_VARIANTS.values():
        out[key] = np.concatenate([r[key] for _, r in rows]) if rows else np.zeros(0, np.int8)
    if rows and all("forced" in r for _, r in rows):  # managed rows: the session's own forced set and query span
        out["forced"] = np.concatenate([r["forced"] for _, r in rows]).astype(bool)
        out["span"] = np.concatenate([r["span_mask"] for _, r in rows]).astype(bool)
        out["positions"] = np.concatenate([r["positions"] for _, r in rows]).astype(np.int32)
    out["read_max"] = np.concatenate([r["read_max"] for _, r in rows]) if rows else np.zeros(0, np.float16)
    out["read_mass"] = np.concatenate([r["read_mass"] for _, r in rows]) if rows else np.zeros(0, np.float32)
    return out


def shard_path(out: Path, split: str, index: int) -> Path:
    return out / f"{split}-{index:05d}.npz"


def write_shard(path: Path, arrays: dict[str, np.ndarray]) -> None:
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def load_meta(folder) -> dict | None:
    """The ``meta.json`` a finished run wrote in ``folder`` (arguments and totals), or None."""
    path = Path(folder) / "meta.json"
    return json.loads(path.read_text()) if path.is_file() else None


def label_keys(spec: str) -> list[str]:
    """The shard arrays of a label spec: names of ``LABEL_VARIANTS`` joined by ``+``
    (``actions`` is §4's label; ``actions+read``), where ``read@T`` is the ``read``
    variant at attention threshold ``T`` (from ``read_max``) and ``mass@F`` the
    fraction ``F`` of each row's candidates with the most attention mass (from
    ``read_mass``); ValueError otherwise."""
    keys = []
    for name in dict.fromkeys(spec.split("+")):
        base, at, threshold = name.partition("@")
        if base == "mass":
            try:
                if not 0.0 < float(threshold) < 1.0:
                    raise ValueError
            except ValueError:
                raise ValueError(f"label spec {spec!r}: mass@F needs a fraction of candidates in (0, 1), got {threshold!r}") from None
            keys += ["labels_read", "read_mass"]
            continue
        if base not in LABEL_VARIANTS or (at and base != "read"):
            raise ValueError(f"label spec {spec!r}: {name!r} is not one of {tuple(LABEL_VARIANTS)}, read@T or mass@F")
        if at:
            try:
                if not 0.0 < float(threshold) <= 1.0:
                    raise ValueError
            except ValueError:
                raise ValueError(f"label spec {spec!r}: read@T needs an attention threshold in (0, 1], got {threshold!r}") from None
            keys += ["labels_read", "read_max"]
        else:
            keys.append(LABEL_VARIANTS[base])
    return list(dict.fromkeys(keys))


def label_array(arrays: dict, spec: str) -> np.ndarray:
    """The labels of ``arrays`` (a shard, or one row of ``trace_rows``) under a label
    spec (``label_keys``): the elementwise maximum, so a position is positive where
    any named variant marks it, 0 where one labels it and none marks it, and −1
    (ignored) only where all ignore it. ``read@T``: positive where ``read_max >= T``,
    −1 where ``labels_read`` ignores the position (forced tokens). ``mass@F``: per
    row (``row_offset``; ``arrays`` without it is one row), the ``ceil(F·m)`` of its
    ``m`` candidates with the largest ``read_mass`` positive, the rest 0, forced −1.
    KeyError when ``arrays`` lacks what the spec needs (rows generated before
    ``read_max`` or ``read_mass``)."""
    missing = [k for k in label_keys(spec) if k not in arrays]
    if missing:
        raise KeyError(f"no {missing} here: regenerate the rows with `python -m train.intentkv_data`")
    parts = []
    for name in dict.fromkeys(spec.split("+")):
        base, _, threshold = name.partition("@")
        if base == "mass":
            parts.append(top_mass_labels(arrays, float(threshold)))
        elif threshold:
            read = np.asarray(arrays["read_max"], np.float32) >= float(threshold)
            parts.append(np.where(np.asarray(arrays["labels_read"]) == -1, -1, read).astype(np.int8))
        else:
            parts.append(np.asarray(arrays[LABEL_VARIANTS[base]]))
    return functools.reduce(np.maximum, parts)


def top_mass_labels(arrays: dict, fraction: float) -> np.ndarray:
    """``mass@F`` labels (``label_array``): per row, the top ``ceil(F·m)`` of its ``m``
    candidates by ``read_mass`` are 1, the others 0; forced positions −1."""
    ignored = np.asarray(arrays["labels_read"]) == -1
    mass = np.asarray(arrays["read_mass"], np.float32)
    offsets = arrays.get("row_offset", np.asarray([0, mass.size]))
    out = np.where(ignored, -1, 0).astype(np.int8)
    for a, b in zip(offsets[:-1], offsets[1:]):
        cand = np.flatnonzero(~ignored[a:b])
        top = cand[np.argsort(-mass[a:b][cand], kind="stable")[: math.ceil(fraction * cand.size)]]
        out[a + top] = 1
    return out


def load_shards(folder, split: str) -> list[dict[str, np.ndarray]]:
    """Every shard of ``split`` in ``folder``, in order (dicts of arrays)."""
    paths = sorted(Path(folder).glob(f"{split}-*.npz"))
    paths = [p for p in paths if not p.name.endswith(".tmp.npz")]
    return [dict(np.load(p)) for p in paths]


def generate(args) -> dict:
    import jaxkv
    from jaxkv import compiles
    from jaxkv.tasks.agent import one_trace
    from jaxkv.tasks.example import for_template
    from train.replay import session_budget

    check_seed_ranges()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Each trace's lengths reach new shapes (its capture's bucket, its session's event
    # sizes): a run compiles tens of programs, about a third of a cold process's first
    # traces. The persistent cache keeps them for a resumed run (module docstring, Cost).
    compiles.enable_persistent_cache()
    model = jaxkv.load_model(args.model)
    plan = [("train", args.traces), ("heldout", args.heldout)]
    part, parts = args.part
    total = sum(
        min(n, start + args.shard_size) - start
        for _, n in plan
        for index, start in enumerate(range(0, n, args.shard_size))
        if index % parts == part
    )
    server = None
    if args.events == "managed":
        from jaxkv.serving import Server

        server = Server(model, max_positions=1 << math.ceil(math.log2(max(2 * args.length_max, 1024))))
    bar = tqdm(total=total, desc="traces", disable=args.quiet)
    t0 = time.perf_counter()
    earlier = load_meta(out) or {}
    reused = 0  # traces whose shard an earlier run wrote: that run's seconds count too
    for split, n in plan:
        if n > SPLIT_SEEDS:
            raise ValueError(f"--{split} {n} exceeds the split's {SPLIT_SEEDS} seeds")
        for index, start in enumerate(range(0, n, args.shard_size)):
            if index % parts != part:
                continue  # another --part's shard
            seeds = [SPLITS[split] + i for i in range(start, min(n, start + args.shard_size))]
            path = shard_path(out, split, index)
            if path.exists():
                bar.update(len(seeds))
                reused += len(seeds)
                continue
            traces, trace_seeds = [], []
            for seed in seeds:
                ex = one_trace(seed, length=trace_length(seed, args.length_min, args.length_max))
                shown = for_template(ex, model.tokenizer)  # SmolLM2: tools inlined as text
                common = dict(
                    horizon=args.horizon, cue_tokens=args.cue_tokens, read_threshold=args.read_threshold, label_messages=ex.messages
                )
                if server is None:
                    traces.append(trace_rows(model, shown.messages, shown.tools or None, answer_values_of(ex), **common))
                    trace_seeds.append(seed)
                else:
                    fraction = args.managed_budgets[seed % len(args.managed_budgets)]
                    budget = session_budget(fraction, model.tokenizer, shown, len(shown.messages) - 1)  # as a grid cell's
                    got = managed_trace_rows(
                        model,
                        shown.messages,
                        shown.tools or None,
                        answer_values_of(ex),
                        server=server,
                        budget=budget,
                        policy=args.managed_policy,
                        **common,
                    )
                    traces += got
                    trace_seeds += [seed] * len(got)
                bar.update(1)
                bar.set_postfix(split=split, rows=sum(len(t["rows"]) for t in traces))
            write_shard(path, pack_shard(traces, trace_seeds))
    bar.close()
    from jaxkv.policies.intentkv_head import model_signature

    seconds = time.perf_counter() - t0
    summary = {
        "args": {**vars(args), "part": f"{part}/{parts}", "managed_budgets": ",".join(map(str, args.managed_budgets))},
        "model_signature": model_signature(model.config),
        # every run that wrote these shards, so a resumed or extended run states the whole cost
        "seconds": round(seconds + (earlier.get("seconds", 0.0) if reused else 0.0), 1),
        "seconds_this_run": round(seconds, 1),
    }
    for split, _ in plan:
        shards = load_shards(out, split)
        summary[split] = {
            "traces": int(sum(np.unique(s["trace_seed"]).size for s in shards)),
            "rows": int(sum(s["row_len"].size for s in shards)),
            "positions": int(sum(s["labels"].size for s in shards)),
            "candidates_labelled": int(sum((s["labels"] >= 0).sum() for s in shards)),
            "positives": int(sum((s["labels"] == 1).sum() for s in shards)),
            **{f"positives_{name}": int(sum((s[key] == 1).sum() for s in shards if key in s)) for name, key in LABEL_VARIANTS.items()},
            "seeds": [SPLITS[split], SPLITS[split] + _ - 1] if _ else [],
        }
    (out / "meta.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/intentkv-data")
    p.add_argument("--model", default="embedded")
    p.add_argument("--traces", type=int, default=1600, help="training traces (seeds TRAIN_SEED_BASE + i)")
    p.add_argument("--heldout", type=int, default=200, help="held-out traces (seeds HELDOUT_SEED_BASE + i)")
    p.add_argument("--shard-size", type=int, default=100, help="traces per shard")
    p.add_argument("--length-min", type=int, default=1792)
    p.add_argument("--length-max", type=int, default=2304)
    p.add_argument("--horizon", type=int, default=HORIZON, help="future actions whose values label a row")
    p.add_argument("--cue-tokens", type=int, default=CUE_TOKENS, help="label variant cue: tokens before a match on its line")
    p.add_argument("--read-threshold", type=float, default=READ_THRESHOLD, help="label variant read: attention that counts as a read")
    p.add_argument(
        "--events",
        choices=("full", "managed"),
        default="full",
        help="full: rows from one full-cache forward per trace (every turn, keys of an uncompressed context); "
        "managed: rows from the compression events of a session running --managed-policy "
        "(the keys and live set an event of a managed cache sees; labels still from the full cache)",
    )
    p.add_argument("--managed-policy", default="intentkv_memory", help="--events managed: the policy the sessions run")
    p.add_argument(
        "--managed-budgets",
        default="0.5,0.65",
        help="--events managed: budgets as fractions of each trace's rendered length, one per trace in turn (by seed)",
    )
    p.add_argument("--part", default="0/1", help="K/N: generate only shards K, K+N, ... (N processes share one folder)")
    p.add_argument("--quick", action="store_true", help="a few traces (tests)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        args.part = tuple(int(x) for x in args.part.split("/"))
        if len(args.part) != 2 or not 0 <= args.part[0] < args.part[1]:
            raise ValueError
    except ValueError:
        p.error(f"--part takes K/N with 0 <= K < N, got {args.part!r}")
    try:
        args.managed_budgets = tuple(float(x) for x in str(args.managed_budgets).split(","))
        if not all(0.0 < f < 1.0 for f in args.managed_budgets):
            raise ValueError
    except ValueError:
        p.error(f"--managed-budgets takes fractions in (0, 1), got {args.managed_budgets!r}")
    if args.quick:
        args.traces, args.heldout, args.shard_size = min(args.traces, 6), min(args.heldout, 4), 3
    return args


def main(argv=None):
    print(json.dumps(generate(parse_args(argv)), indent=2))


if __name__ == "__main__":
    main()
