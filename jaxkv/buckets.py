"""Compile-friendly sizes: the one bucketing rule of the project, and the small
bounded set of programs an engine's steps compile.

A jit'd function compiles once per distinct static shape. The engine's steps
(``jaxkv.forward``) keep every length as data (live lengths, chunk lengths, rows'
query offsets: the ragged attention's loop bounds), so only these reach shapes:

* **step tokens** (``step_tokens``): a mixed step's flat batch is padded to a
  token bucket: powers of two from ``MIN_STEP_TOKENS`` below the engine's token
  budget, then the budget itself (16, 32, ..., 512, 528 for a 512-token chunk and
  16 rows). One program per bucket, whatever rows, chunks and lengths it holds;
  a variant captures query rows (retention policies' windows), another brings
  back every logit (scoring).
* **decode rows** (``decode_row_bucket``): the decode loop (``jaxkv.forward.run_decode``)
  runs its rows compactly: powers of two up to ``DECODE_ROW_STEP`` rows, then
  multiples of it (12 jobs run as 12 rows, not 16);
* **window widths** (``window_width``, the CPU decode loop's per-call copy of the
  rows' lists before the call): powers of two from ``MIN_WINDOW`` up to the row's
  positions. The loop's attention reads the whole width each step (one unblocked
  GEMM, ``jaxkv.kernels.attention.ragged.window_decode_attention``), so a row just
  past a power of two reads up to twice its list: the price of a few programs.
* **decode steps per call**: the scheduler's decode chunk (one value,
  ``DECODE_CHUNK`` by default).

``shape_set`` lists them for one engine: what a server compiles at start-up
(``Engine.warmup``), tens of programs. A compression event pads the row's list
to ``event_size`` (powers of two from ``MIN_EVENT``). ``bucket`` is the rule for
the other lengths that reach shapes (captured rows, gathers of rows): a power of
two up to ``step``, then a multiple of ``step``.
"""

from __future__ import annotations

import dataclasses

MIN_STEP_TOKENS = 16  # the narrowest step: a few decode rows
DECODE_ROW_STEP = 4  # decode batches: powers of two up to 4 rows, then multiples of 4
MIN_WINDOW = 512  # the narrowest CPU decode window
MIN_EVENT = 256  # the shortest list a compression event scores
STOP_WIDTH = 4  # stop-token columns of a decode call: a request's own count (0 with ignore_eos) must not be a shape
# Decode steps per batched engine call: how often rows can join or leave. Each call
# has a fixed cost (on the CPU, copying every row's live K/V once: see
# ``jaxkv.backends.cpu_float.take_window``) that a longer chunk spreads over more tokens.
# Chosen by measurement (``eval/bench/serving.py --decode-chunk``, ~125M model, 8
# sessions, medians of 3 runs): 32 gives 3.24x one session's decode tokens/s and
# p50 turn 5.5 s; 16 gives 2.92x and 6.0 s.
DECODE_CHUNK = 32


def bucket(n: int, minimum: int = 16, step: int = 512) -> int:
    """The smallest bucket >= max(n, minimum) (see the module docstring)."""
    n = max(int(n), int(minimum), 1)
    if n <= step:
        return 1 << (n - 1).bit_length()
    return -(-n // step) * step


def token_budget(prefill_chunk: int, rows: int) -> int:
    """An engine's default token budget per step: one whole prefill chunk beside a
    decode token of every row, rounded up to a multiple of ``MIN_STEP_TOKENS``."""
    need = int(prefill_chunk) + int(rows)
    return -(-need // MIN_STEP_TOKENS) * MIN_STEP_TOKENS


def token_buckets(budget: int) -> list[int]:
    """The step token buckets of an engine with this budget (module docstring)."""
    sizes, n = [], MIN_STEP_TOKENS
    while n < budget:
        sizes.append(n)
        n *= 2
    return sizes + [int(budget)]


def step_tokens(n: int, budget: int) -> int:
    """The bucket of a step of ``n`` tokens (``n <= budget``)."""
    return next(size for size in token_buckets(budget) if size >= n)


def stop_width(n_stop_ids: int) -> int:
    """Columns of a decode call's stop-token table for rows of at most ``n_stop_ids``
    stop tokens: ``STOP_WIDTH``, or the next power of two above it (padding is -1)."""
    return max(STOP_WIDTH, 1 << max(int(n_stop_ids) - 1, 0).bit_length())


def decode_row_bucket(n_jobs: int) -> int:
    """Rows of a decode call serving ``n_jobs`` jobs."""
    return bucket(n_jobs, minimum=1, step=DECODE_ROW_STEP)


def window_width(entries: int, max_positions: int) -> int:
    """Width of the CPU decode window holding ``entries`` list entries: a power of
    two from ``MIN_WINDOW``, at most the positions rounded up to a power of two."""
    cap = 1 << (max(int(max_positions), 1) - 1).bit_length()
    return min(bucket(entries, minimum=MIN_WINDOW, step=1 << 30), cap)


def window_widths(max_positions: int) -> list[int]:
    """Every ``window_width`` an engine of ``max_positions`` can ask for."""
    return sorted(
        {window_width(n, max_positions) for n in [1] + [1 << k for k in range(int(max_positions).bit_length() + 1)] + [max_positions]}
    )


def event_size(live: int) -> int:
    """The list length a compression event of a row with ``live`` entries is padded
    to: a power of two from ``MIN_EVENT`` (scoring is cheap beside a step, so
    coarse sizes cost little and keep a policy's event programs few)."""
    return bucket(live, minimum=MIN_EVENT, step=1 << 30)


def event_sizes(max_positions: int) -> list[int]:
    """Every ``event_size`` of rows of up to ``max_positions`` positions."""
    return sorted({event_size(1 << k) for k in range(int(max_positions).bit_length())} | {event_size(max_positions)})


@dataclasses.dataclass(frozen=True)
class ShapeSet:
    """Every shape the engine's steps take (module docstring).

    Attributes:
      steps: the token buckets of ``run_step``.
      decode: ``(rows, window width or 0)`` per ``run_decode`` program (0: no
        window: a kernel backend, a quantized pool or a mesh reads the pool).
      decode_steps: steps per decode call.
    """

    steps: tuple
    decode: tuple
    decode_steps: int

    @property
    def size(self) -> int:
        return len(self.steps) + len(self.decode)


def shape_set(rows: int, max_positions: int, budget: int, decode_chunk: int, *, windows: bool = True) -> ShapeSet:
    """The bounded shape set of one engine (module docstring)."""
    groups = sorted({decode_row_bucket(b) for b in range(1, rows + 1)})
    widths = window_widths(max_positions) if windows else [0]
    decode = tuple((B, W) for B in groups for W in widths)
    return ShapeSet(tuple(token_buckets(budget)), decode, int(decode_chunk))
