"""The public one-shot entry points: ``generate`` (prompts in, tokens out, on an
engine made for the call) and ``score_logits`` (the dense forward with no cache:
the parity oracle every cached path is tested against).

Invariant: bad input raises before any device work (``ValueError`` for malformed
prompts, ``ContextLengthError`` past the model's context).
"""

from __future__ import annotations

import functools

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
