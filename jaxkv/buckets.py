"""Compile-friendly sizes: the one bucketing rule of the project.

A jit'd function compiles once per distinct static shape, so every length that
reaches a shape (chunk tokens, live-list length, batch rows, captured query rows,
candidate counts) is rounded up with ``bucket``: a power of two up to ``step``,
then a multiple of ``step``. Padding costs at most 2x below ``step`` and at most
``step`` entries above, so work over a bucketed list stays proportional to its
real length, and the number of compiles grows with log(length) below ``step``.
"""

from __future__ import annotations


def bucket(n: int, minimum: int = 16, step: int = 512) -> int:
    """The smallest bucket >= max(n, minimum) (see the module docstring)."""
    n = max(int(n), int(minimum), 1)
    if n <= step:
        return 1 << (n - 1).bit_length()
    return -(-n // step) * step
