"""KVzip's reconstruction passes, run through the engine before a compression event.

A policy whose ``Needs.reconstruction`` is set (``kvzip``) scores the live history
by the attention the model pays it while repeating it (``jaxkv.policies.kvzip``).
The retention stage runs this module's ``run_passes`` (a turn program: it yields
engine jobs, which the scheduler packs with other turns' work) when an event is
due, then hands the result to the event as ``EventFeatures.pass_scores_LNK``:

1. the row's tokens (``RequestState.tokens``, the whole request, holes included:
   a hole's token is repeated, its key is not read) are cut into kvpress's
   reconstruction inputs (``kvzip.repeat_chunks``);
2. each input is one ``PrefillJob`` on the row, after its context (positions
   ``seq_len, seq_len + 1, ...``, the model's ordinary attention over the row's
   live lists), bringing back the post-RoPE query of every input token; the
   input's own keys are read from the pool once it is written;
3. the row is truncated back to its context (``Engine.truncate_row``: the
   input's slots are freed, ``seq_len`` is the context's again), on every exit
   path, so the next input sits at the same positions, as kvpress's do;
4. the pass is scored (``kvzip.pass_scores``: kvpress's softmax over the sinks,
   the chunk and the input's own keys; a per-layer row's softmax in layer ``l``
   reads only the entries layer ``l`` still reads), and the passes are assembled
   as kvpress assembles them (``kvzip.context_scores``).

Shapes: the live entries are padded to the event's size (``buckets.event_size``,
the one the event itself compiles for) and a pass's rows to ``pass_rows`` (a power
of two from 256 up to 512, then multiples of 512), so scoring compiles once per
(event size, pass size); ``warm`` compiles every pair a server's rows can reach.

Room: a pass needs ``prompt + chunk`` positions past the context and as many
slots (the session's reservation holds them: ``slots_needed``). Where the row's
positions cannot hold a ``chunk_size`` chunk, the chunks shrink to what fits (a
departure from kvpress, whose softmax then covers a smaller chunk);
``ContextLengthError`` when not even one context token fits beside the prompt.

Cost: every live token is forwarded once more, plus each pass's prompt (about 2x
the prefill, KVzip's price); ``PassResult.tokens`` counts the tokens forwarded, and
the event's report carries it (``CompressionReport.scoring_tokens``). An
evaluation that branches several cells from one prefill (``Turn.memo``) scores
once for all of them: the result is keyed by the row's state.

Invariants: the row holds after the passes exactly what it held before (tokens,
slots, live lists, tags); nothing here writes the cache but through the KV
manager (``truncate_row``) and the engine's own prefill jobs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator

import jax
import numpy as np

from jaxkv.buckets import MIN_EVENT, bucket, event_size, event_sizes
from jaxkv.engine.jobs import PrefillJob
from jaxkv.errors import ContextLengthError, JaxKVError
from jaxkv.policies import kvzip


def pass_rows(x: int) -> int:
    """Rows a pass of ``x`` input tokens is scored as (padding masked)."""
    return bucket(x, minimum=MIN_EVENT, step=512)


@dataclasses.dataclass(frozen=True)
class PassResult:
    """What a row's reconstruction passes gave an event.

    Attributes:
      scores_LNK: float32 ``[L, N, Hkv]`` over the row's live entries in position
        order, padded to ``N = buckets.event_size(live)`` with zeros
        (``kvzip.context_scores``: the first ``n_sink`` entries on top).
      tokens: tokens the passes forwarded (every input's prompt and chunk).
      chunks: the passes' ``kvzip.RepeatChunk`` inputs, in order.
    """

    scores_LNK: np.ndarray
    tokens: int
    chunks: tuple


_score = jax.jit(kvzip.pass_scores)
# kvpress's assembly of the passes' sum (the passes score disjoint chunks, so their sum
# on the host is exact): one program per event size, not one per count of chunks
_assemble = jax.jit(lambda total_LNK, n_sink: kvzip.context_scores([total_LNK], n_sink), static_argnums=1)


def slots_needed(config, tokenizer, tokens: int) -> int:
    """Slots a turn of ``tokens`` tokens may hold at once for one pass (its
    reservation adds them): the largest chunk and its prompt."""
    return min(int(config.chunk_size), int(tokens)) + kvzip.pass_overhead(tokenizer)


def run_passes(turn, config) -> Generator:
    """Run the passes over ``turn``'s row and score them (module docstring); a turn
    program returning a ``PassResult``. ``config``: the policy's ``KVzipConfig``."""
    engine, row, req = turn.engine, turn.row, turn.req
    n = req.seq_len
    live_pos = req.live_positions()
    L = engine.model.config.num_layers
    layer_mask = req.layer_mask(L)
    key = ("kvzip", config.chunk_size, config.n_sink, n, live_pos.tobytes(), np.packbits(layer_mask).tobytes())
    found = turn.memo.get("reconstruction")
    if found is not None and found[0] == key:
        return found[1]
    tokens = np.asarray(req.tokens[:n], np.int64)
    if (tokens < 0).any():
        raise JaxKVError("kvzip's reconstruction repeats the row's tokens, and some of its positions have no token recorded")
    tokenizer = turn.session.tokenizer
    room = engine.max_positions - n - kvzip.pass_overhead(tokenizer)
    chunk_size = min(int(config.chunk_size), room)
    if chunk_size < 1:
        raise ContextLengthError(
            f"kvzip's reconstruction pass needs {kvzip.pass_overhead(tokenizer) + 1} positions past the row's {n}; "
            f"the engine has {engine.max_positions} (raise max_positions)"
        )
    chunks = kvzip.repeat_chunks(tokenizer, tokens, chunk_size)
    N = event_size(live_pos.size)
    entry = np.arange(N)
    pos_N = np.concatenate([live_pos, np.full(N - live_pos.size, n, np.int64)])  # padding: past every chunk
    real_N = entry < live_pos.size
    reads_LN = np.zeros((L, N), bool)
    reads_LN[:, : live_pos.size] = layer_mask[:, live_pos]
    passes, forwarded = [], 0
    for chunk in chunks:
        X = chunk.ids.size
        job = PrefillJob(row, chunk.ids, logits=None, q_idx_X=np.arange(X), wide_capture=True)
        try:
            yield from turn.run(job)
            keys = np.asarray(engine.kv.gather_keys(row, event_size(live_pos.size + X)), np.float32)
        finally:
            engine.truncate_row(row, n)
        forwarded += X
        Xp = pass_rows(X)
        q = np.zeros((L, Xp, *job.q_rows.shape[2:]), np.float32)
        q[:, :X] = job.q_rows
        k_ctx = np.zeros((L, N, *keys.shape[2:]), np.float32)
        k_ctx[:, : live_pos.size] = keys[:, : live_pos.size]
        k_self = np.zeros((L, Xp, *keys.shape[2:]), np.float32)
        k_self[:, :X] = keys[:, live_pos.size : live_pos.size + X]
        scored_N = real_N & (pos_N >= chunk.start) & (pos_N < chunk.end)
        sinks_N = real_N & (entry < config.n_sink) & (pos_N < chunk.start)
        passes.append(_score(q, k_ctx, k_self, (scored_N | sinks_N)[None] & reads_LN, scored_N[None] & reads_LN, np.arange(Xp) < X))
    total = np.zeros((L, N, engine.model.config.num_kv_heads), np.float32)  # no chunk (nothing after the prefix): all 0
    for score in passes:
        total += np.asarray(score)
    scores = np.asarray(_assemble(total, int(config.n_sink)), np.float32)
    result = PassResult(scores, forwarded, tuple(chunks))
    turn.memo["reconstruction"] = (key, result)
    return result


def warm(config, engine) -> int:
    """Compile the pass scoring of every (event size, pass size) an engine's rows
    can reach: a pass holds at most ``chunk_size`` context tokens and its prompt,
    and no more context than the row's live entries. Returns the programs run."""
    cfg = engine.model.config
    overhead = kvzip.pass_overhead(engine.model.tokenizer)
    widest = pass_rows(min(int(config.chunk_size), engine.max_positions) + overhead)
    ran = 0
    for N in event_sizes(engine.max_positions):
        top = min(widest, pass_rows(N + overhead))
        for Xp in sorted({pass_rows(x) for x in range(1, top + 1, 16)}):
            args = (
                np.zeros((cfg.num_layers, Xp, cfg.num_heads, cfg.head_dim), np.float32),
                np.zeros((cfg.num_layers, N, cfg.num_kv_heads, cfg.head_dim), np.float32),
                np.zeros((cfg.num_layers, Xp, cfg.num_kv_heads, cfg.head_dim), np.float32),
                np.zeros((cfg.num_layers, N), bool),
                np.zeros((cfg.num_layers, N), bool),
                np.zeros(Xp, bool),
            )
            jax.block_until_ready(_score(*args))
            ran += 1
        jax.block_until_ready(_assemble(np.zeros((cfg.num_layers, N, cfg.num_kv_heads), np.float32), int(config.n_sink)))
        ran += 1
    return ran


__all__ = ["PassResult", "pass_rows", "run_passes", "slots_needed", "warm"]
