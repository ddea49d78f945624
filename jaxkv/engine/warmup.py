"""Compiling every program a server can reach, before it serves (the compilation
manager of tpu-inference, for jaxkv's bounded shape set).

``shape_set`` lists an engine's shapes (``jaxkv.buckets.shape_set``): each step
token bucket, and each decode-loop program (rows bucket x window width on the
CPU). ``warmup`` runs each once on scratch rows, through the very methods
requests use, with every static variant a server's turns reach. A decode
program's rows share one scratch list of fresh slots as their cached prefix, so
they reach their window's width with nothing computed and ``width`` slots taken:
prefilling them cost prefill work and slots that grew with rows x width (16 rows
at 8,192 positions: over 15 minutes of start-up, then out of slots).

* steps bring back nothing but tokens (the reply's first token is sampled in the
  step), or query rows (``capture_q``: retention windows, query spans, phase rows),
  or attention mass with query rows (``attn_mass``: one variant for both), or every
  flat token's query (``capture_wide``: a reconstruction pass's steps, KVzip's;
  a program of its own only where a step holds more tokens than the capture cap,
  ``ModelRunner.capture_rows``);
* decode calls bring back nothing but tokens, or every fed token's query
  (``decode_q``: policies that compress during decode), always with ``regroup``
  (the scheduler's calls) and the server's stop tokens (their count is a shape).

Logits never reach a server's host (``jaxkv serve`` has no logprobs); evaluations
that ask for them compile those variants when they first run.

Invariant: the engine is idle before and after (scratch rows are closed), and a
warm-up compiles no program twice.
"""

from __future__ import annotations

import numpy as np

from jaxkv import buckets, compiles
from jaxkv.engine.jobs import DecodeJob, PrefillJob
from jaxkv.errors import JaxKVError


def shape_set(engine, decode_chunk: int) -> buckets.ShapeSet:
    """The bounded set of step shapes ``engine`` compiles (``jaxkv.buckets``)."""
    runner = engine.runner
    windows = runner.use_window and engine.backend.uses_window and engine.mesh is None
    return buckets.shape_set(engine.rows, engine.max_positions, engine.token_budget, decode_chunk, windows=windows)


def warmup(
    engine,
    decode_chunk: int,
    *,
    stop_token_ids=(),
    progress=None,
    capture_q: bool = False,
    attn_mass: bool = False,
    decode_q: bool = False,
    capture_wide: bool = False,
) -> int:
    """Compile every program of ``shape_set`` with the variants the flags ask for
    (module docstring). ``progress(n)`` is called after each program. Returns how
    many programs it ran."""
    if any(state is not None for state in engine.row_state):
        raise JaxKVError("warm-up needs an idle engine (a row is open)")
    shapes = shape_set(engine, decode_chunk)
    ran = 0

    def tick():
        nonlocal ran
        compiles.release_if_crowded()
        ran += 1
        if progress is not None:
            progress(1)

    rows = [engine.open_row() for _ in range(engine.rows)]
    try:
        variants = [(False, False, False)] + [
            v[:3] for v in ((True, False, False, capture_q), (True, True, False, attn_mass), (True, False, True, capture_wide)) if v[3]
        ]
        for T in shapes.steps:
            # a step of T tokens: a piece of up to a chunk, and beside it decode tokens for what is left
            # (the budget's bucket holds a whole chunk beside a decode token of every other row)
            n = min(T, engine.prefill_chunk) if T > buckets.MIN_STEP_TOKENS else 1
            d = min(T - n, engine.rows - 1) if T > engine.prefill_chunk else 0
            for q, m, wide in variants:
                if wide and engine.runner.capture_rows(T, wide=True) == engine.runner.capture_rows(T):
                    continue  # no more tokens than the cap: the capture_q program
                for r in rows[1 : 1 + d]:
                    engine.step(prefill_jobs=[engine.start(PrefillJob(r, np.zeros(1, np.int32), logits=None))])
                decode = [engine.start(DecodeJob(r, 0, 1)) for r in rows[1 : 1 + d]]
                job = PrefillJob(rows[0], np.zeros(n, np.int32), logits=None, q_idx_X=[0] if q else None, attn_mass=m, wide_capture=wide)
                job = engine.start(job)
                engine.step(prefill_jobs=[job], decode_jobs=decode)
                for r in rows:
                    engine.truncate_row(r, 0)
                tick()
    finally:
        for r in rows:
            engine.close_row(r)
    for B, W in shapes.decode:
        for q in (False, True) if decode_q else (False,):
            # rows whose list length makes a window of width W: one scratch list of fresh slots, shared as a
            # cached prefix is (nothing computed: the window's content does not matter, only its width)
            scratch = engine.kv.allocate(min(W, engine.max_positions - decode_chunk)) if W else np.zeros(0, np.int64)
            rows = [engine.open_row(prefix_slots=scratch) for _ in range(B)]
            engine.kv.release(scratch)  # the rows hold their own references now
            try:
                if not W:
                    for r in rows:
                        engine.step(prefill_jobs=[engine.start(PrefillJob(r, np.zeros(1, np.int32), logits=None))])
                # one step each: the program (its loop bound is decode_chunk, static) is the same, its run 1/decode_chunk as long
                jobs = [engine.start(DecodeJob(r, 0, 1, stop_ids=tuple(stop_token_ids), query_rows=q)) for r in rows]
                engine.step_decode(jobs, decode_chunk, regroup=True)
                tick()
            finally:
                for r in rows:
                    engine.close_row(r)
    engine.runner.forget_window()  # the last scratch window: rows x width of every layer's K/V (6 GB at 16 x 8,192 on SmolLM2)
    return ran
