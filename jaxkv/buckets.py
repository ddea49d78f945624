"""Compile-friendly sizes: the one bucketing rule of the project, and the finite
set of shapes the engine's jit'd steps take.

A jit'd function compiles once per distinct static shape, so every length that
reaches a shape (chunk tokens, live-list length, batch rows, captured query rows,
candidate counts) is rounded up with ``bucket``: a power of two up to ``step``,
then a multiple of ``step``. Padding costs at most 2x below ``step`` and at most
``step`` entries above, so work over a bucketed list stays proportional to its
real length, and the number of compiles grows with log(length) below ``step``.

The engine's steps (``jaxkv.engine``) take their shapes from the named rules
below, and ``shape_set`` lists every value each can take for one engine
(rows, max positions, prefill chunk, decode chunk): the set a server compiles at
start-up (``Engine.warmup``, ``Server(warmup=True)``).

* rows of a prefill step: ``prefill_rows``, powers of two (a group of 9 jobs runs
  as 8 + 1), at least the mesh's data-parallel size;
* rows of a decode call: ``decode_rows``, powers of two up to ``DECODE_ROW_STEP``,
  then multiples of it (12 jobs run as 12 rows, not 16);
* prefill chunk widths: ``prefill_width``, powers of two from ``SHORT_CHUNK`` up to
  the prefill chunk (128, 256, 512 at the defaults);
* read lengths (how much of each row's live list a step reads): ``read_length``,
  ``bucket`` of the live length (plus the call's new tokens for decode), at most
  the engine's positions;
* decode window widths (the CPU decode path's per-call copy of each row's K/V):
  ``window_width``, powers of two up to ``WINDOW_STEP``, then multiples of it;
* decode steps per call: the scheduler's decode chunk (one value, ``DECODE_CHUNK``
  by default; a turn driven alone, ``run_to_completion``, uses it too).

* compression events (a retention policy's key gather, scoring and ``observe``):
  ``event_sizes``, the ``bucket`` of the row's live length; the observation
  window and the observed rows are padded to fixed sizes
  (``jaxkv.serving.stages.retention``);
* feature captures: a prefill step that captures query rows captures all of
  its ``width`` rows, so a capturing step is one variant per plain step (and
  another for attention mass); decode calls capture query rows always (one row
  per step), attention mass in a variant; steps of different feature sets never
  share a batch.

Outside this set: all-prompt logits, ``top_k`` values and the segment-reuse
splice compile on first use.
"""

from __future__ import annotations

import dataclasses

WINDOW_STEP = 128  # CPU decode window widths: powers of two up to this, then multiples of it
SHORT_CHUNK = 128  # the narrowest prefill width (wider ones: powers of two up to the chunk size)
DECODE_ROW_STEP = 4  # decode batches: powers of two up to 4 rows, then multiples of 4
# Decode steps per batched engine call: how often rows can join or leave. Each call
# has a fixed cost (on the CPU, gathering every row's live K/V once: see
# ``jaxkv.engine.gather_window``) that a longer chunk spreads over more tokens.
# Chosen by measurement (``eval/bench_serving.py --decode-chunk``, ~125M model, 8
# sessions, medians of 3 runs): 32 gives 3.24x one session's decode tokens/s and
# p50 turn 5.5 s; 16 gives 2.92x and 6.0 s.
DECODE_CHUNK = 32


def bucket(n: int, minimum: int = 16, step: int = 512) -> int:
    """The smallest bucket >= max(n, minimum) (see the module docstring)."""
    n = max(int(n), int(minimum), 1)
    if n <= step:
        return 1 << (n - 1).bit_length()
    return -(-n // step) * step


def prefill_rows(n_jobs: int, min_batch: int = 1) -> int:
    """Rows of a prefill step serving ``n_jobs`` jobs of one group."""
    return bucket(n_jobs, minimum=min_batch)


def decode_rows(n_jobs: int, min_batch: int = 1) -> int:
    """Rows of a decode call serving ``n_jobs`` jobs."""
    return bucket(n_jobs, minimum=min_batch, step=max(DECODE_ROW_STEP, min_batch))


def prefill_width(piece: int, chunk: int, short_chunk: int = SHORT_CHUNK) -> int:
    """Chunk width of a prefill step whose next piece has ``piece`` tokens
    (``short_chunk``: the narrowest width, a power of two)."""
    short = min(short_chunk, chunk)
    return min(bucket(min(piece, chunk), minimum=short, step=chunk), chunk)


def read_length(live: int, max_positions: int) -> int:
    """Live-list entries a step reads for rows of at most ``live`` entries."""
    return min(bucket(live), max_positions)


def event_sizes(max_positions: int) -> list[int]:
    """Live-list lengths a compression event is padded to (``bucket`` of the
    row's live length), for rows of up to ``max_positions`` positions."""
    return sorted({bucket(n) for n in range(1, int(max_positions) + 1)})


def window_width(live: int, max_positions: int) -> int:
    """Decode window width for rows of at most ``live`` live tokens."""
    return min(bucket(live, step=WINDOW_STEP), max_positions)


@dataclasses.dataclass(frozen=True)
class ShapeSet:
    """Every shape the engine's prefill and decode steps take (module docstring).

    Attributes:
      prefill: ``(rows, width, read length, live)`` per prefill program; ``live``
        is a row length that reaches it (the longest one).
      decode: ``(rows, read length, window width, live)`` per decode program.
      decode_steps: steps per decode call.
    """

    prefill: tuple
    decode: tuple
    decode_steps: int

    @property
    def size(self) -> int:
        return len(self.prefill) + len(self.decode)


def shape_set(rows: int, max_positions: int, prefill_chunk: int, decode_chunk: int, min_batch: int = 1, short_chunk: int = SHORT_CHUNK) -> ShapeSet:
    """The finite shape set of one engine (module docstring)."""
    P, n = int(max_positions), int(decode_chunk)
    prefill_groups = sorted({prefill_rows(1 << k, min_batch) for k in range(max(rows, 1).bit_length()) if 1 << k <= rows})
    decode_groups = sorted({decode_rows(b, min_batch) for b in range(1, rows + 1)})
    widths = sorted({prefill_width(p, prefill_chunk, short_chunk) for p in range(1, prefill_chunk + 1)})
    prefill = []
    for C in widths:
        longest: dict[int, int] = {}  # read length -> the longest live length that reads it
        for live in range(0, P - C + 1):
            longest[read_length(live, P)] = live
        prefill += [(B, C, r, live) for B in prefill_groups for r, live in sorted(longest.items())]
    pairs: dict[tuple[int, int], int] = {}
    for live in range(0, P - n + 1):
        pairs[(read_length(live + n, P), window_width(live, P))] = live
    decode = [(B, r, w, live) for B in decode_groups for (r, w), live in sorted(pairs.items())]
    return ShapeSet(tuple(prefill), tuple(decode), n)
