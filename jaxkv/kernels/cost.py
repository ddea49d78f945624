"""Static cost model of the kernels: bytes per call and arithmetic per byte.

Counts are what a call *must* move (compulsory traffic) and the arithmetic the
algorithm needs, independent of backend; ``eval/bench/kernels.py`` divides the same
byte counts by measured time to get achieved bandwidth, and
``python -m jaxkv.kernels.triton.aot`` prints them next to the AOT table.

Bytes per call (``B`` requests, ``Hq``/``Hkv`` heads, head dim ``D``, pool dtype of
``e`` bytes, ``n`` live entries per request):

* decode, float pool: K and V rows ``2 * B * n * Hkv * D * e``, slot ids ``4 * B * n``,
  queries read and outputs written ``2 * B * Hq * D * e``;
* decode, INT4 tokens: per (token, head) K and V each ``D/2 + 4 * D/32`` (codes, f16
  scale and zero), ids 4 per token;
* decode, INT2 pages: per (page of 32 tokens, head) keys ``32 * D/4 + 4 * D``
  (per-channel scale and zero), values ``32 * D/4 + 32 * 4 * D/32``, ids 4 per page;
* RoPE delta: each moved row read and written, ``2 * L * M * Hkv * D * e``, plus
  ``8 * M`` of slots and deltas and ``4 * D/2`` of frequencies;
* INT4 write: reads ``T * Hkv * D * e`` and ``4 * T`` of slots, writes ``T * Hkv * (D/2
  + 4 * D/32)``;
* ragged attention (``ragged``: one step of prefill chunks and decode rows): each
  row's ``kv_len`` K and V rows once, ``2 * kv_len * Hkv * D * e + 4 * kv_len``, and
  the step's queries read and outputs written, ``2 * T * Hq * D * e``.

Flops: decode ``4 * D`` per (live token, query head) for ``q . k`` and ``p @ v`` plus
``~5`` for the softmax; dequantization adds ``2`` per element of K and V. A GPU
program pads the ``G`` query rows of a KV head to ``GP >= 16`` for the tensor cores,
so it *executes* ``GP / G`` times the dot flops (reported as ``executed``). RoPE delta:
``3`` per element plus one sin and cos per (row, pair); INT4 write ``~8`` per element.

Ragged attention: ``4 * D + 5`` per (query head, entry the query sees): a causal
chunk of ``n`` queries after ``c`` cached entries sees ``n * c + n (n + 1) / 2``.
The GPU executes each query tile's ``M`` dot rows (``_ragged_tiles.gpu_tile``: 128
for bf16) over whole key blocks up to its last query (the diagonal's masked half
included), and each decode row's ``G`` heads padded to 16.

Split-K partials (``B * P * Hq * (D + 2) * 4`` bytes written, then read by the merge)
are implementation overhead, listed separately; so are the ragged tiles' re-reads
of their row's list (a row of ``n`` queries is ``ceil(n / Q)`` tiles, each reading
the entries its queries see; mostly served by L2 on a GPU).

Peak figures (public datasheets, dense): A100 SXM 80 GB 2.04 TB/s HBM, 312 TFLOP/s
bf16 tensor, 19.5 fp32; H100 SXM 3.35 TB/s, 989 TFLOP/s bf16 tensor, 67 fp32. A
kernel whose flops per byte is far below ``peak flops / bandwidth`` (153 on A100,
295 on H100 for bf16 tensor math) is bound by memory: its floor is ``bytes / bandwidth``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from jaxkv.kernels._ragged_tiles import TileShape, gpu_tile
from jaxkv.kernels._splitk import gpu_splits

GROUP = 32
PAGE = 32


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    bandwidth: float  # bytes/s
    tensor_flops: float  # bf16 tensor-core flop/s (dense)
    fp32_flops: float  # non-tensor fp32 flop/s


A100 = Device("A100 SXM 80GB", 2.039e12, 312e12, 19.5e12)
H100 = Device("H100 SXM", 3.35e12, 989e12, 67e12)
DEVICES = (A100, H100)


@dataclasses.dataclass(frozen=True)
class Cost:
    """Compulsory traffic and arithmetic of one call.

    Attributes:
      kernel: kernel name; shape: the call's sizes, in words.
      bytes: bytes that must move; flops: arithmetic the algorithm needs;
      executed_flops: flops a GPU program runs (query rows padded to 16);
      overhead_bytes: traffic beyond the compulsory: split-K partials written and
        read back, ragged query tiles' re-reads of their row's list.
    """

    kernel: str
    shape: str
    bytes: int
    flops: int
    executed_flops: int
    overhead_bytes: int = 0

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    def floor_seconds(self, device: Device) -> float:
        """Roofline lower bound: memory or tensor-core arithmetic, whichever is slower."""
        return max(self.bytes / device.bandwidth, self.executed_flops / device.tensor_flops)


def _decode_flops(B, Hq, n, D, dequant_elements=0):
    return B * n * Hq * (4 * D + 5) + 2 * dequant_elements


def _padded(G: int) -> int:
    return max(16, 1 << max(0, G - 1).bit_length())


def _decode(kernel, shape, B, Hq, Hkv, D, e_q, n, kv_bytes, splits, dequant=False):
    G = Hq // Hkv
    io = 2 * B * Hq * D * e_q
    flops = _decode_flops(B, Hq, n, D, 2 * B * n * Hkv * D if dequant else 0)
    executed = flops + B * n * Hkv * 4 * D * (_padded(G) - G)
    overhead = 2 * B * splits * Hq * (D + 2) * 4
    return Cost(kernel, shape, kv_bytes + io, flops, executed, overhead)


def decode_float(B: int, Hq: int, Hkv: int, D: int, n: int, itemsize: int = 2, splits: int = 1) -> Cost:
    """Float-pool decode over ``n`` live tokens per request."""
    kv = 2 * B * n * Hkv * D * itemsize + 4 * B * n
    return _decode("decode float", _shape(B, Hq, Hkv, D, n, itemsize), B, Hq, Hkv, D, itemsize, n, kv, splits)


def int4_token_bytes(Hkv: int, D: int) -> int:
    """K and V bytes of one INT4 token (all heads)."""
    return 2 * Hkv * (D // 2 + 4 * D // GROUP)


def int2_page_bytes(Hkv: int, D: int) -> int:
    """K and V bytes of one INT2 page of 32 tokens (all heads)."""
    return Hkv * (2 * PAGE * D // 4 + 4 * D + PAGE * 4 * D // GROUP)


def decode_quantized(B: int, Hq: int, Hkv: int, D: int, n4: int, pages: int = 0, q_itemsize: int = 2,
                     splits: int = 1) -> Cost:  # fmt: skip
    """INT4 tokens (``n4`` per request) then INT2 pages (``pages`` per request)."""
    kv = B * (n4 * (int4_token_bytes(Hkv, D) + 4) + pages * (int2_page_bytes(Hkv, D) + 4))
    n = n4 + PAGE * pages
    name = "decode INT4" if not pages else "decode INT2+INT4"
    shape = _shape(B, Hq, Hkv, D, n, q_itemsize) + (f", {pages * PAGE / n:.0%} INT2" if pages else "")
    return _decode(name, shape, B, Hq, Hkv, D, q_itemsize, n, kv, splits, dequant=True)


def rope_delta(L: int, M: int, Hkv: int, D: int, itemsize: int = 2) -> Cost:
    """Rotate ``M`` rows of every layer."""
    nbytes = 2 * L * M * Hkv * D * itemsize + 8 * M + 4 * (D // 2)
    flops = L * M * Hkv * D * 3 + 2 * L * M * (D // 2)
    return Cost("rope delta", f"L={L}, M={M}, Hkv={Hkv}, D={D}, {_dtype(itemsize)}", nbytes, flops, flops)


def int4_write(T: int, Hkv: int, D: int, itemsize: int = 2) -> Cost:
    """Quantize ``T`` rows to INT4 and write them at slots."""
    nbytes = T * Hkv * D * itemsize + 4 * T + T * Hkv * (D // 2 + 4 * D // GROUP)
    flops = 8 * T * Hkv * D
    return Cost("INT4 write", f"T={T}, Hkv={Hkv}, D={D}, {_dtype(itemsize)} in", nbytes, flops, flops)


def ragged(rows: Sequence[tuple[int, int]], Hq: int, Hkv: int, D: int, itemsize: int = 2, *,
           tile: TileShape | None = None, shape: str | None = None) -> Cost:  # fmt: skip
    """One ragged attention call: ``rows`` are ``(q_len, kv_len)`` per row (``q_len``
    1: a decode row; 0: absent); ``tile``: the GPU tile (default ``gpu_tile``)."""
    G = Hq // Hkv
    tile = tile or gpu_tile(G, D, itemsize)
    T = sum(n for n, _ in rows)
    seen = sum(n * (c - n) + n * (n + 1) // 2 for n, c in rows)
    kv = sum(c for n, c in rows if n)
    nbytes = 2 * kv * Hkv * D * itemsize + 4 * kv + 2 * T * Hq * D * itemsize
    executed = reread = 0
    for n, c in rows:
        if n == 1:
            executed += _padded(G) * c * Hkv * 4 * D
        elif n > 1:
            for first in range(0, n, tile.queries):
                hi = c - n + min(first + tile.queries, n)  # entries the tile reads
                executed += tile.rows * math.ceil(hi / tile.block) * tile.block * Hkv * 4 * D
                reread += hi
            reread -= c
    flops = seen * Hq * (4 * D + 5)
    decode = sum(1 for n, _ in rows if n == 1)
    partials = 0
    if decode:  # the split-K launch runs over every row of the step
        splits = gpu_splits(len(rows), Hkv, max(c for _, c in rows), 128 // itemsize)
        partials = 2 * len(rows) * splits * Hq * (D + 2) * 4
    shape = shape or (f"T={T}, {sum(1 for n, _ in rows if n > 1)} chunk rows, {decode} decode rows, "
                      f"kv<={max(c for _, c in rows)}, Hq={Hq}, Hkv={Hkv}, D={D}, {_dtype(itemsize)}")  # fmt: skip
    return Cost("ragged attention", shape, nbytes, flops, executed + seen * Hq * 5, reread * 2 * Hkv * D * itemsize + partials)


def ragged_prefill(tokens: int, chunk: int, Hq: int, Hkv: int, D: int, itemsize: int = 2) -> Cost:
    """A whole prompt of ``tokens`` prefilled in ``chunk``-token steps (one row per
    step): the sum of its calls' costs."""
    calls = [ragged([(min(chunk, tokens - s), min(s + chunk, tokens))], Hq, Hkv, D, itemsize) for s in range(0, tokens, chunk)]
    return Cost("ragged prefill", f"{tokens} tokens in {chunk}-token chunks, Hq={Hq}, Hkv={Hkv}, D={D}, {_dtype(itemsize)}",
                sum(c.bytes for c in calls), sum(c.flops for c in calls), sum(c.executed_flops for c in calls),
                sum(c.overhead_bytes for c in calls))  # fmt: skip


def _dtype(itemsize: int) -> str:
    return {2: "bf16", 4: "fp32"}[itemsize]


def _shape(B, Hq, Hkv, D, n, itemsize) -> str:
    return f"B={B}, ctx={n}, Hq={Hq}, Hkv={Hkv}, D={D}, {_dtype(itemsize)}"


def representative() -> list[Cost]:
    """One Llama-3-8B layer (Hq 32, Hkv 8, D 128, bf16) at the contexts the bench uses."""
    Hq, Hkv, D = 32, 8, 128
    costs = []
    for B, n in ((1, 4096), (32, 4096), (1, 32768), (32, 32768), (1, 131072)):
        n2 = int(0.65 * n) // PAGE  # 65% of tokens in INT2 pages: ~2.7 bits
        P = gpu_splits(B, Hkv, n, 64)
        costs += [
            decode_float(B, Hq, Hkv, D, n, splits=P),
            decode_quantized(B, Hq, Hkv, D, n, splits=P),
            decode_quantized(B, Hq, Hkv, D, n - PAGE * n2, n2, splits=P),
        ]
    costs += [rope_delta(32, 4096, Hkv, D), int4_write(32, Hkv, D)]
    costs += [
        ragged_prefill(2048, 512, Hq, Hkv, D),
        ragged_prefill(8192, 2048, Hq, Hkv, D),
        ragged([(512, 2048)] + [(1, 4096)] * 32, Hq, Hkv, D),  # a chunk after 1536 entries, 32 decode rows
    ]
    return costs


def markdown(costs: list[Cost]) -> str:
    """The cost table (floors at peak bandwidth / tensor throughput)."""
    lines = [
        "| kernel | shape | MB moved | GFLOP (executed) | flop/byte | "
        + " | ".join(f"floor on {d.name} (us)" for d in DEVICES)
        + " | overhead MB |",
        "|---|---|---|---|---|" + "---|" * len(DEVICES) + "---|",
    ]
    for c in costs:
        floors = " | ".join(f"{c.floor_seconds(d) * 1e6:.2f}" for d in DEVICES)
        lines.append(
            f"| {c.kernel} | {c.shape} | {c.bytes / 1e6:.2f} | {c.flops / 1e9:.3f} ({c.executed_flops / 1e9:.3f}) | "
            f"{c.intensity:.2f} | {floors} | {c.overhead_bytes / 1e6:.2f} |"
        )
    return "\n".join(lines) + "\n"
