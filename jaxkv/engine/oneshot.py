"""Requests run to completion: ``generate`` (prompts in, tokens out, on an engine
made for the call), ``score_logits`` (the dense forward with no cache: the parity
oracle every cached path is tested against), and an engine's ``prefill`` and
``decode`` (``Engine.prefill`` / ``Engine.decode``: jobs started and stepped until
they finish, for a single request, tests and evaluations; the scheduler steps
jobs of many rows itself).

Invariant: bad input raises before any device work (``ValueError`` for malformed
prompts, ``ContextLengthError`` past the model's context, the KV manager's checks
of room and slots before a job starts).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from jaxkv.buckets import bucket
from jaxkv.errors import ContextLengthError
from jaxkv.models.loading import Model
from jaxkv.sampling import make_sampler


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _dense_logits(graphdef, params, tokens_BT):
    return nnx.merge(graphdef, params)(tokens_BT)


def score_logits(model: Model, token_ids) -> jax.Array:
    """Full-sequence float32 logits ``[B,T,V]`` with no cache: the parity oracle."""
    tokens = np.asarray(token_ids, dtype=np.int32)
    if tokens.ndim != 2:
        raise ValueError(f"token_ids must be [batch, time], got shape {tokens.shape}")
    _check_ids(model, tokens.reshape(-1))
    graphdef, params = model.split()
    return _dense_logits(graphdef, params, tokens)


def _check_ids(model: Model, ids: np.ndarray) -> None:
    bad = (ids < 0) | (ids >= model.config.vocab_size)
    if bad.any():
        raise ValueError(f"token ids out of range [0, {model.config.vocab_size}): {ids[bad][:5].tolist()}")


def generate(
    model: Model,
    prompts,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k=None,
    top_p=None,
    seed: int = 0,
    stop_token_ids=None,
    *,
    backend=None,
) -> list[list[int]]:
    """Generate up to ``max_new_tokens`` tokens for each prompt (a list of id lists).

    Greedy when ``temperature == 0``. Prompt ``i`` samples with ``fold_in(key(seed),
    i)``: its first token in its prefill's last step, the rest in the decode loop.
    A row ends after its first stop token (included in its output).
    """
    from jaxkv.engine import FIRST_TOKEN_KEY, Engine
    from jaxkv.engine.jobs import DecodeJob, PrefillJob, Sampling

    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    prompts = [list(map(int, p)) for p in prompts]
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    for p in prompts:
        _check_ids(model, np.asarray(p))
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    make_sampler(temperature, top_k, top_p)  # validate before any work
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > model.config.max_position_embeddings:
        raise ContextLengthError(
            f"prompt + max_new_tokens = {longest} tokens exceed the model context {model.config.max_position_embeddings}"
        )
    if max_new_tokens == 0:
        return [[] for _ in prompts]
    P = min(bucket(longest), model.config.max_position_embeddings)
    engine = Engine(model, rows=len(prompts), max_positions=P, backend=backend)
    key = jax.random.key(seed)
    keys = [jax.random.fold_in(key, i) for i in range(len(prompts))]
    sampling = [Sampling(float(temperature), top_k, top_p, k, FIRST_TOKEN_KEY) for k in keys]
    jobs = [engine.start(PrefillJob(engine.open_row(), p, logits=None, sampling=s)) for p, s in zip(prompts, sampling)]
    while not all(j.finished for j in jobs):
        engine.step(prefill_jobs=jobs)
    stop = tuple(sorted(set(stop_token_ids or ())))
    outputs = [[j.first_token] for j in jobs]
    decode = {
        i: engine.start(DecodeJob(j.row, j.first_token, max_new_tokens - 1, Sampling(float(temperature), top_k, top_p, k), stop))
        for i, (j, k) in enumerate(zip(jobs, keys))
        if j.first_token not in stop
    }
    if max_new_tokens > 1 and decode:
        engine.step_decode(list(decode.values()))
        for i, d in decode.items():
            outputs[i] += d.tokens
    return outputs


def prefill(engine, rows: Sequence[int], token_lists, *, all_logits=False, attn_mass=False, q_row_positions=None, kv_bits=None):
    """Append ``token_lists[i]`` to ``rows[i]``; returns the logits of the new
    tokens per row (``[n_i, V]`` with ``all_logits``, else the last one's ``[V]``).
    With ``attn_mass`` or ``q_row_positions`` it returns ``(logits, aux)``:
    ``aux["attn_mass"][i]`` ``[seq_len]`` the mass each position of row i received
    from this prefill's queries (mean over layers and heads, summed over
    queries); ``aux["q_rows"]`` ``[L, len(rows), X, Hq, D]`` the post-RoPE queries
    at ``q_row_positions[i]`` (indices into ``token_lists[i]``)."""
    for r, tokens in zip(rows, token_lists):
        engine.kv.check_room(r, len(tokens))
    engine.kv.reserve(sum(len(t) for t in token_lists))
    jobs = [
        engine.start_prefill(
            r,
            t,
            all_logits=all_logits,
            attn_mass=attn_mass,
            kv_bits=None if kv_bits is None else kv_bits[i],
            q_idx=None if q_row_positions is None else q_row_positions[i],
        )
        for i, (r, t) in enumerate(zip(rows, token_lists))
    ]
    while not all(j.finished for j in jobs):
        engine.step(prefill_jobs=jobs)
    logits = [j.result_logits() for j in jobs]
    if not attn_mass and q_row_positions is None:
        return logits
    aux = {}
    if attn_mass:
        aux["attn_mass"] = [j.mass for j in jobs]
    if q_row_positions is not None:
        aux["q_rows"] = np.stack([j.q_rows for j in jobs], axis=1)
    return logits, aux


def decode(
    engine,
    rows: Sequence[int],
    first_tokens: Sequence[int],
    n_steps: int,
    *,
    temperature=0.0,
    top_k=None,
    top_p=None,
    key=None,
    stop_token_ids=(),
    return_logits=False,
    forced_tokens=None,
    query_rows=False,
    attn_mass=False,
):
    """Feed ``first_tokens`` and decode up to ``n_steps`` tokens per row. Returns
    ``(tokens, logits)``: ``tokens[i]`` row i's sampled tokens (ending with its stop
    token when one came); ``logits[i]`` ``[n, V]`` with ``return_logits``.
    ``forced_tokens[i]`` replaces the fed token of every step after the first.
    Row ``i`` samples with ``fold_in(key, i)``. With ``query_rows`` or
    ``attn_mass`` it returns ``(tokens, logits, aux)``: ``aux["q_rows"][i]`` ``[n_i,
    L, Hq, D]`` the query of each fed token; ``aux["attn_mass"][i]`` ``[seq_len]``."""
    make_sampler(temperature, top_k, top_p)
    if n_steps <= 0:
        return [[] for _ in rows], None
    key = key if key is not None else jax.random.key(0)
    jobs = [
        engine.start_decode(
            r,
            first_tokens[i],
            n_steps,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            key=jax.random.fold_in(key, i),
            stop_token_ids=stop_token_ids,
            return_logits=return_logits,
            query_rows=query_rows,
            attn_mass=attn_mass,
            forced_tokens=None if forced_tokens is None else forced_tokens[i],
        )
        for i, r in enumerate(rows)
    ]
    engine.step_decode(jobs)
    V = engine.model.config.vocab_size
    logits = [np.concatenate(j.logits) if j.logits else np.zeros((0, V), np.float32) for j in jobs] if return_logits else None
    if not query_rows and not attn_mass:
        return [j.tokens for j in jobs], logits
    aux = {}
    if query_rows:
        aux["q_rows"] = [np.concatenate(j.q_rows) for j in jobs]
    if attn_mass:
        aux["attn_mass"] = [j.mass for j in jobs]
    return [j.tokens for j in jobs], logits, aux
