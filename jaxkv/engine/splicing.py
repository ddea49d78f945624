"""Segment reuse's spliced prefill on the engine: the host side of ``jaxkv.splice``.

``splice_prefill`` lays one ``SplicePlan`` out for ``splice_step`` (token groups,
stored K/V and residuals, the row's keys with their positions, each padded to a
``jaxkv.buckets.bucket``: the row's keys from ``MIN_KEYS`` and the stored rows from
``MIN_STORED``, so probes and short pieces compile one program whatever the row's
length below them), runs it and records the result through the KV manager;
``key_deviation`` is CacheBlend's per-token signal. The serving scheduler runs a spliced prefill as
work of its own (``jaxkv.engine.jobs.SpliceJob``), between steps.

Modes: ``"append"`` allocates slots for the plan's tokens at the row's next
positions and records them in the row; ``"rewrite"`` recomputes tokens the row
holds at ``[plan.base, plan.base + T)`` in their own slots; ``"probe"`` runs on
scratch slots (released after) reading only the row's keys before ``plan.base``,
and leaves the row as it was.

Invariant: host checks (context length, slots, holes) run before any device call.
"""

from __future__ import annotations

import numpy as np

from jaxkv.buckets import MIN_WINDOW, bucket
from jaxkv.cache.allocator import SENTINEL_SLOT
from jaxkv.errors import ContextLengthError, JaxKVError
from jaxkv.splice import PAD_POS, layer_key_deviation, splice_step

# The shortest padded key list of a spliced step (padding keys sit at ``PAD_POS``,
# never visible): the CPU decode window's narrowest width. A piece's attention reads
# ``group x keys``, so a short row pays at most ``group x MIN_KEYS`` key reads, and a
# server compiles one program per piece shape for every row up to MIN_KEYS keys
# instead of one per power of two (each document or halo length a new program).
MIN_KEYS = MIN_WINDOW
# The shortest padded list of stored K/V rows: a row costs a rotation and a write per
# spliced layer (no projection), so a coarse floor is cheap and spans of different
# interior lengths below it share a program.
MIN_STORED = 128


def splice_prefill(engine, row: int, plan, *, mode: str = "append"):
    """Run one ``jaxkv.splice.SplicePlan`` on ``row``; returns ``(logits [Y, V],
    resid [A, M])`` (float32 numpy: next-token logits at ``plan.logit_idx`` and
    group A's residual at the input of layer ``plan.cut``).

    ``mode``: ``"append"`` allocates slots for the plan's tokens at the row's
    next positions and records them in the row; ``"rewrite"`` recomputes tokens
    the row holds at ``[plan.base, plan.base + T)`` in their own slots;
    ``"probe"`` runs on scratch slots (released after) reading only the row's
    keys before ``plan.base``, and leaves the row as it was. Host checks
    (context length, slots, holes) run before any device call.
    """
    kv = engine.kv
    state = kv.row(row)
    cfg = engine.model.config
    tokens = np.asarray(plan.tokens, np.int32).reshape(-1)
    T = tokens.size
    live = np.asarray(state.live, np.int64)
    live_pos = state.live_positions()
    if mode == "append":
        base = state.seq_len
        if base + T > kv.max_positions:
            raise ContextLengthError(f"row {row}: {base} cached + {T} new tokens exceed {kv.max_positions} positions")
        slots = kv.allocate(T, row)
        keys, key_pos = np.concatenate([live, slots]), np.concatenate([live_pos, base + np.arange(T)])
    elif mode == "rewrite":
        base = int(plan.base)
        if base < 0 or base + T > state.seq_len:
            raise JaxKVError(f"rewrite of positions [{base}, {base + T}) outside row {row} of {state.seq_len}")
        slots = np.asarray(state.slots[base : base + T], np.int64)
        if (slots == SENTINEL_SLOT).any():
            raise JaxKVError(f"rewrite of positions [{base}, {base + T}) of row {row} crosses a hole")
        keys, key_pos = live, live_pos
    elif mode == "probe":
        base = int(plan.base)
        slots = kv.allocate(T)  # scratch (not counted against the row): released below
        before = live_pos < base
        keys, key_pos = np.concatenate([live[before], slots]), np.concatenate([live_pos[before], base + np.arange(T)])
    else:
        raise JaxKVError(f"unknown splice mode {mode!r}; expected append, rewrite or probe")
    try:
        positions = base + np.arange(T)
        a_idx, b_idx = np.asarray(plan.a_idx, np.int64), np.asarray(plan.b_idx, np.int64)
        A, B = bucket(a_idx.size), bucket(b_idx.size)
        a_tok, a_pos, a_slot = np.zeros(A, np.int32), np.full(A, -1, np.int32), np.zeros(A, np.int32)
        a_tok[: a_idx.size], a_pos[: a_idx.size], a_slot[: a_idx.size] = tokens[a_idx], positions[a_idx], slots[a_idx]
        in_a = np.full(T, -1, np.int64)
        in_a[a_idx] = np.arange(a_idx.size)
        b_src, b_pos = np.full(B, -1, np.int32), np.full(B, -1, np.int32)
        b_slot, b_cut_slot = np.zeros(B, np.int32), np.zeros(B, np.int32)
        b_resid = np.zeros((B, cfg.hidden_size), np.float32)
        b_src[: b_idx.size], b_pos[: b_idx.size], b_slot[: b_idx.size] = in_a[b_idx], positions[b_idx], slots[b_idx]
        cut_write = np.ones(b_idx.size, bool) if plan.b_cut_write is None else np.asarray(plan.b_cut_write, bool)
        b_cut_slot[: b_idx.size] = np.where(cut_write, slots[b_idx], SENTINEL_SLOT)
        if plan.b_resid is not None:
            b_resid[: b_idx.size] = plan.b_resid
        kv_idx = np.asarray(plan.kv_idx, np.int64)
        M = bucket(kv_idx.size, minimum=MIN_STORED)
        nl = max(plan.kv_hi - plan.kv_lo, 0)
        kv_k = np.zeros((nl, M, cfg.num_kv_heads, cfg.head_dim), np.float32)
        kv_v = np.zeros_like(kv_k)
        kv_slot, kv_delta = np.zeros(M, np.int32), np.zeros(M, np.int32)
        if kv_idx.size and nl:
            kv_k[:, : kv_idx.size], kv_v[:, : kv_idx.size] = plan.kv_k, plan.kv_v
            kv_slot[: kv_idx.size] = slots[kv_idx]
            kv_delta[: kv_idx.size] = positions[kv_idx] - np.asarray(plan.kv_old_pos, np.int64)
        order = np.argsort(key_pos, kind="stable")
        N = bucket(keys.size, minimum=MIN_KEYS)
        read = np.ones((1, keys.size), bool)  # which layers read each key (one set for the model: all)
        if state.layer_live is not None:  # per-layer keep sets: a layer sees only its own (new tokens: all)
            old = key_pos < state.seq_len
            read = np.ones((kv.lists, keys.size), bool)
            read[:, old] = state.layer_live[:, key_pos[old]]
        live_N, live_pos_JN = np.zeros(N, np.int32), np.full((read.shape[0], N), PAD_POS, np.int32)
        live_N[: keys.size] = keys[order]
        live_pos_JN[:, : keys.size] = np.where(read[:, order], key_pos[order][None], PAD_POS)
        logit_idx = np.asarray(plan.logit_idx, np.int64)
        Y = bucket(logit_idx.size)  # 16 rows at least, as the groups
        src = in_a if plan.cut >= cfg.num_layers else np.searchsorted(b_idx, np.arange(T))
        logit_src = np.zeros(Y, np.int32)
        logit_src[: logit_idx.size] = src[logit_idx]
        logits, cache, resid = splice_step(
            engine.runner.graphdef,
            engine.runner.params,
            kv.cache,
            a_tok,
            a_pos,
            a_slot,
            b_src,
            b_resid,
            b_pos,
            b_slot,
            b_cut_slot,
            kv_k,
            kv_v,
            kv_slot,
            kv_delta,
            live_N,
            live_pos_JN,
            logit_src,
            cut=int(plan.cut),
            kv_lo=int(plan.kv_lo),
            kv_hi=int(plan.kv_hi) if nl else int(plan.kv_lo),
            backend=engine.runner.backend,
        )
        kv.commit(cache)
        logits, resid = np.asarray(logits)[: logit_idx.size], np.asarray(resid)[: a_idx.size]
    finally:
        if mode == "probe":
            kv.release(slots)
    if mode == "append":
        state.append(tokens, slots)
        kv.push_row(row)
        kv.settle([row])  # kivi2: aged residual -> INT2 pages
    return logits, resid


def key_deviation(engine, x_XM, positions_X, k_old_XKD, old_positions_X, layer: int) -> np.ndarray:
    """CacheBlend's signal: per token, the distance between the post-RoPE key of
    ``layer`` recomputed from the residual ``x_XM`` at its input and the stored
    key rotated from ``old_positions_X`` to ``positions_X`` (``[X]`` float32)."""
    X = len(positions_X)
    P = bucket(X)
    cfg = engine.model.config
    x = np.zeros((P, cfg.hidden_size), np.float32)
    pos, delta = np.zeros(P, np.int32), np.zeros(P, np.int32)
    k = np.zeros((P, cfg.num_kv_heads, cfg.head_dim), np.float32)
    x[:X], pos[:X], k[:X] = x_XM, positions_X, k_old_XKD
    delta[:X] = np.asarray(positions_X, np.int64) - np.asarray(old_positions_X, np.int64)
    out = layer_key_deviation(engine.runner.graphdef, engine.runner.params, x, pos, k, delta, layer=int(layer))
    return np.asarray(out)[:X]
