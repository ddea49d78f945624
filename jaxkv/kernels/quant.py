"""TriAxialKV quantized KV formats: quantize, dequantize, pools, packing layout.

Formats (ALGORITHMS.md §7, TriAxialKV §3.2.1), all asymmetric with group 32, at
2, 3 or 4 bits per code (3 bits: the INT3 tier of issue 74, pages only):

* **INT4 per token** (keys and values): each (token, head) row of ``D`` channels
  is split into groups of 32 consecutive channels, each with its own
  ``(scale, zero)``.
* **INT2 values per token**: same as INT4 with 2-bit codes.
* **INT2 keys per channel**: tokens are grouped in pages of 32; within a
  (page, head) every channel has its own ``(scale, zero)`` over the page's 32 tokens.
  Tokens that do not fill a page are stored as INT4 (the caller's job).

Code: ``c = clip(round((x - zero) / scale), 0, 2**bits - 1)`` (IEEE float32
division, round half to even); value
``x_hat = zero + c * scale`` (float32). ``scale`` and ``zero`` are float16 with
*directed* rounding: ``zero`` is rounded down (``zero <= min``) and ``scale`` up
(``zero + (2**bits - 1) * scale >= max``), so every x of a group lies inside the
code range and ``|x - x_hat| <= scale / 2`` (plus float32 rounding) for every
group, whatever float16 does to the parameters. Inputs must be finite and within
float16 range (|x| < 65504). A constant group gets ``scale = 0`` and code 0.

Packing layout (one rule for every data buffer): a row of ``D`` channels at ``b``
bits holds ``per = 8 / b`` codes per byte in ``R = D / per`` bytes; byte ``j``
holds channel ``i * R + j`` in bits ``[b*i, b*i + b)`` for ``i < per`` (bit-planes
of contiguous channel ranges: plane ``i`` covers channels ``[i*R, (i+1)*R)``). A
kernel unpacks plane ``i`` of a byte range with one shift and mask and gets a
contiguous channel range back, with no interleave. ``plane_chunks`` lists the
(channel range, plane, byte range, group) pieces that a kernel walks.

INT3 rows are a **2 + 1 bit-plane split**: the low two bits of every code packed
as a 2-bit row (``D/4`` bytes), then the high bit packed as a 1-bit row (``D/8``
bytes), ``3D/8`` bytes in all. Why not ten codes in a 32-bit word or codes that
straddle bytes: with the split every byte holds whole codes of one plane, so a
kernel reads an INT3 chunk as the 2-bit read it already has plus one 1-bit read
(``(low >> 2p) & 3 | ((high >> p') & 1) << 2``), no word or byte boundary is ever
crossed, and an INT3 page keeps its low plane in exactly the bytes an INT2 page
uses: the dual pool's page arrays stay one array of 2-bit rows for both tiers,
with the INT3 pages' high planes in a side array (``jaxkv.cache.quantized``). An
INT2 row read as INT3 (its high plane zero) gives its INT2 codes back.

Buffers (S INT4 slots, P INT2 pages, K = Hkv, dtype):

=====================  =========================  ===========================
buffer                 data (uint8)               scale, zero (float16)
=====================  =========================  ===========================
INT4 keys / values     ``[S, K, D/2]``            ``[S, K, D/32]``
INT2 keys (pages)      ``[P, K, 32, D/4]``        ``[P, K, D]`` (per channel)
INT2 values (pages)    ``[P, K, 32, D/4]``        ``[P, K, 32, D/32]``
=====================  =========================  ===========================

INT2 page ``p`` holds tokens ``32p .. 32p+31`` of the array it was quantized from;
a (page, head) entry of either INT2 buffer is contiguous in memory. Bytes per
token and head for D=128: bf16 256; INT4 64 + 16 = 80; INT2 keys 32 + 16 (per-channel
scale and zero, 512 bytes per page, amortised over 32 tokens); INT2 values 32 + 16.
K and V of a mixed pool with 65% INT2 tokens (~2.7 bits) are ~4.3x smaller than bf16.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.errors import ConfigError

GROUP = 32  # channels per per-token group, and tokens per INT2 key page
PAGE = 32


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A contiguous channel range that lies inside one bit-plane and one group.

    Attributes:
      channel: first channel; width: number of channels (and bytes);
      plane: bit-plane (shift = plane * bits); byte: first byte of the packed row;
      group: index of the 32-channel group (per-token scale column).
    """

    channel: int
    width: int
    plane: int
    byte: int
    group: int
    hi_plane: int = 0  # INT3 only: the high bit's plane and first byte (in the whole row)
    hi_byte: int = 0


BITS = (2, 3, 4)  # the code widths a pool stores


def check_head_dim(head_dim: int) -> None:
    if head_dim % GROUP:
        raise ConfigError(f"quantized KV needs head_dim divisible by {GROUP}, got {head_dim}")


def check_bits(bits, allowed=BITS) -> None:
    if bits not in allowed:
        raise ConfigError(f"bits must be one of {allowed}, got {bits}")


def plane_chunks(head_dim: int, bits: int) -> tuple[Chunk, ...]:
    """The pieces of a packed row of ``head_dim`` channels, in channel order. At 3
    bits a piece lies in one plane of the 2-bit low row and one plane of the 1-bit
    high row (``hi_plane``, ``hi_byte``: its bytes in the whole ``3D/8``-byte row)."""
    check_head_dim(head_dim)
    check_bits(bits)
    if bits == 3:
        low, high = head_dim // 4, head_dim // 8  # bytes per plane of the 2-bit and 1-bit rows
        cuts = sorted(set(range(0, head_dim, GROUP)) | set(range(0, head_dim, high)) | {head_dim})
        return tuple(
            Chunk(a, b - a, a // low, a % low, a // GROUP, hi_plane=a // high, hi_byte=low + a % high) for a, b in itertools.pairwise(cuts)
        )
    row_bytes = head_dim * bits // 8
    cuts = sorted(set(range(0, head_dim, GROUP)) | set(range(0, head_dim, row_bytes)) | {head_dim})
    return tuple(
        Chunk(channel=a, width=b - a, plane=a // row_bytes, byte=a % row_bytes, group=a // GROUP) for a, b in zip(cuts[:-1], cuts[1:])
    )


def pack(codes: jnp.ndarray, bits: int) -> jnp.ndarray:
    """Pack integer codes ``[..., D]`` (each < 2**bits) into uint8 ``[..., D*bits/8]``
    (bits 1, 2, 4; 3: the 2 + 1 split, module docstring)."""
    if bits == 3:
        codes = codes.astype(jnp.uint8)
        return jnp.concatenate([pack(codes & 3, 2), pack(codes >> 2, 1)], axis=-1)
    per = 8 // bits
    planes = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], per, codes.shape[-1] // per)
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits)[:, None]
    return jnp.bitwise_or.reduce(planes << shifts, axis=-2)


def unpack(data: jnp.ndarray, bits: int) -> jnp.ndarray:
    """Inverse of ``pack``: uint8 ``[..., R]`` -> codes uint8 ``[..., R*8/bits]``."""
    if bits == 3:
        low = data.shape[-1] * 2 // 3  # the 2-bit row's bytes: D/4 of 3D/8
        return unpack(data[..., :low], 2) | (unpack(data[..., low:], 1) << 2)
    per = 8 // bits
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits)[:, None]
    codes = (data[..., None, :] >> shifts) & jnp.uint8((1 << bits) - 1)
    return codes.reshape(*data.shape[:-1], per * data.shape[-1])


def _round_f16(x: jnp.ndarray, direction: float) -> jnp.ndarray:
    """float32 -> float16 rounded toward ``direction`` (+inf or -inf), bit for bit alike on
    every backend and in the Triton write kernel (``kernels._f16_directed``).

    The nearest float16 passes an optimization barrier: without it XLA:GPU may drop the
    float32 -> float16 -> float32 round trip (its default excess precision), never see
    the rounding, and leave half the scales rounded to nearest (seen on an H200). The
    step to the neighbour is integer arithmetic on the bits, not ``nextafter``, which a
    backend may evaluate in float32.
    """
    h = jax.lax.optimization_barrier(x.astype(jnp.float16))
    back = h.astype(jnp.float32)
    up = direction > 0
    wrong = (back < x) if up else (back > x)
    bits = jax.lax.bitcast_convert_type(h, jnp.int16)
    toward_zero, away = (bits - 1, bits + 1)
    if up:  # from zero the step is the smallest positive subnormal, 0x0001
        stepped = jnp.where(back == 0, jnp.int16(1), jnp.where(back > 0, away, toward_zero))
    else:  # from zero the step is the smallest negative subnormal, 0x8001
        stepped = jnp.where(back == 0, jnp.int16(-32767), jnp.where(back > 0, toward_zero, away))
    return jnp.where(wrong, jax.lax.bitcast_convert_type(stepped.astype(jnp.int16), jnp.float16), h)


def _fit(x: jnp.ndarray, axis: int, bits: int):
    """(codes, scale f16, zero f16) of ``x`` with groups along ``axis``."""
    x = x.astype(jnp.float32)
    top = (1 << bits) - 1
    zero = _round_f16(jnp.min(x, axis=axis, keepdims=True), -jnp.inf)
    zero32 = zero.astype(jnp.float32)
    # Times the float32 reciprocal, not divided: XLA rewrites a division by a constant into this
    # product, so writing it out makes every backend (the Triton write kernel too) round alike.
    scale = _round_f16((jnp.max(x, axis=axis, keepdims=True) - zero32) * (1.0 / top), jnp.inf)
    scale32 = scale.astype(jnp.float32)
    # An IEEE division, as the Triton write kernel's ``div_rn``: XLA rewrites a division by a
    # broadcast value into a product with its reciprocal (on the CPU too), which rounds
    # differently and lands ties (ratio exactly k + 0.5) on the other code; behind an
    # optimization barrier the divisor is no broadcast, and the division stays a division.
    divisor = jax.lax.optimization_barrier(jnp.broadcast_to(jnp.where(scale32 > 0, scale32, 1.0), x.shape))
    ratio = (x - zero32) / divisor
    codes = jnp.where(scale32 > 0, jnp.clip(jnp.round(ratio), 0, top), 0)
    return codes.astype(jnp.uint8), jnp.squeeze(scale, axis), jnp.squeeze(zero, axis)


@struct.dataclass
class PackedRows:
    """Per-token groups: rows of ``D`` channels, one (scale, zero) per 32 channels.

    Attributes:
      data: uint8 ``[..., D*bits/8]`` packed codes (layout in the module docstring).
      scale, zero: float16 ``[..., D/32]``.
      bits: 2, 3 or 4 (static).
    """

    data: jnp.ndarray
    scale: jnp.ndarray
    zero: jnp.ndarray
    bits: int = struct.field(pytree_node=False)

    @property
    def head_dim(self) -> int:
        return self.data.shape[-1] * 8 // self.bits

    def take(self, index) -> "PackedRows":
        """Rows at ``index`` along the leading axis (gather)."""
        return PackedRows(self.data[index], self.scale[index], self.zero[index], self.bits)


@struct.dataclass
class PackedKeyPages:
    """Keys per channel over pages of 32 tokens (INT2; INT3 pages: 3 bits; KIVI-4's: 4).

    Attributes:
      data: uint8 ``[P, K, 32, D*bits/8]`` packed codes, one packed row per token.
      scale, zero: float16 ``[P, K, D]``, shared by the page's 32 tokens.
      bits: 2, 3 or 4 (static).
    """

    data: jnp.ndarray
    scale: jnp.ndarray
    zero: jnp.ndarray
    bits: int = struct.field(pytree_node=False, default=2)

    @property
    def head_dim(self) -> int:
        return self.scale.shape[-1]

    def take(self, index) -> "PackedKeyPages":
        return PackedKeyPages(self.data[index], self.scale[index], self.zero[index], self.bits)


@functools.partial(jax.jit, static_argnames="bits")
def quantize_rows(x: jnp.ndarray, bits: int) -> PackedRows:
    """Per-token asymmetric quantization of ``x[..., D]`` in groups of 32 channels."""
    check_bits(bits)
    D = x.shape[-1]
    check_head_dim(D)
    grouped = x.reshape(*x.shape[:-1], D // GROUP, GROUP)
    codes, scale, zero = _fit(grouped, -1, bits)
    return PackedRows(pack(codes.reshape(x.shape), bits), scale, zero, bits)


def dequantize_codes(codes: jnp.ndarray, scale: jnp.ndarray, zero: jnp.ndarray, axis: int = -1) -> jnp.ndarray:
    """float32 ``zero + code * scale`` of unpacked codes whose ``scale`` / ``zero``
    hold one entry per ``GROUP`` consecutive elements along ``axis`` (the shape of
    ``codes`` with that axis divided by 32): the one dequantization of every
    format and layout (per-token groups of channels, a page's 32 tokens per
    channel, head-major copies)."""
    axis = axis % codes.ndim
    shape = codes.shape
    grouped = codes.astype(jnp.float32).reshape(*shape[:axis], shape[axis] // GROUP, GROUP, *shape[axis + 1 :])
    at = lambda p: jnp.expand_dims(p.astype(jnp.float32), axis + 1)  # noqa: E731
    return (at(zero) + grouped * at(scale)).reshape(shape)


@jax.jit
def dequantize_rows(packed: PackedRows) -> jnp.ndarray:
    """float32 ``[..., D]`` values of ``PackedRows`` (INT2, INT3 or INT4)."""
    return dequantize_codes(unpack(packed.data, packed.bits), packed.scale, packed.zero)


def quantize_int4(x: jnp.ndarray) -> PackedRows:
    """INT4 per token (keys or values): ``x[..., D]`` -> ``PackedRows`` with bits 4."""
    return quantize_rows(x, 4)


def quantize_int2_values(x: jnp.ndarray) -> PackedRows:
    """INT2 per token (values): ``x[..., D]`` -> ``PackedRows`` with bits 2."""
    return quantize_rows(x, 2)


def _pages(x_TKD: jnp.ndarray) -> jnp.ndarray:
    """``[T, K, D]`` (T a multiple of 32) -> ``[T/32, K, 32, D]``."""
    T, K, D = x_TKD.shape
    if T % PAGE:
        raise ValueError(f"INT2 pages need a token count divisible by {PAGE}, got shape {x_TKD.shape}")
    return x_TKD.reshape(T // PAGE, PAGE, K, D).transpose(0, 2, 1, 3)


def _tokens(x_PKTD: jnp.ndarray) -> jnp.ndarray:
    """Inverse of ``_pages``."""
    P, K, T, D = x_PKTD.shape
    return x_PKTD.transpose(0, 2, 1, 3).reshape(P * T, K, D)


@functools.partial(jax.jit, static_argnames="bits")
def quantize_int2_keys(k_TKD: jnp.ndarray, bits: int = 2) -> PackedKeyPages:
    """Keys per channel over pages: ``k[T, K, D]`` (T % 32 == 0) -> pages of
    ``bits``-bit codes (2: the INT2 pool's; 3: INT3 pages; 4: KIVI-4's)."""
    check_bits(bits)
    check_head_dim(k_TKD.shape[-1])
    codes, scale, zero = _fit(_pages(k_TKD), 2, bits)  # groups along the page's tokens
    return PackedKeyPages(pack(codes, bits), scale, zero, bits)


@jax.jit
def dequantize_int2_keys(pages: PackedKeyPages) -> jnp.ndarray:
    """float32 ``[..., P, K, 32, D]`` keys of key pages (any leading axes, any bits)."""
    codes = unpack(pages.data, pages.bits).astype(jnp.float32)
    return pages.zero.astype(jnp.float32)[..., None, :] + codes * pages.scale.astype(jnp.float32)[..., None, :]


@functools.partial(jax.jit, static_argnames="bits")
def key_pages_round_trip(k_TKD: jnp.ndarray, bits: int) -> jnp.ndarray:
    """``k[T, K, D]`` (T % 32 == 0) quantized per channel over pages of 32 tokens at
    ``bits`` and dequantized, float32 ``[T, K, D]`` in token order: the page pool's
    key format (2 bits: INT2; 4: KIVI-4's). For error analysis
    (``eval.quality.quant_attention_error``)."""
    return _tokens(dequantize_int2_keys(quantize_int2_keys(k_TKD, bits)))


@struct.dataclass
class Int4Pool:
    """INT4 pool: per-token keys and values ``PackedRows`` of shape ``[S, K, ...]``."""

    k: PackedRows
    v: PackedRows

    def buffers(self) -> tuple:
        """``(k data, k scale, k zero, v data, v scale, v zero)``: the order kernels take them."""
        return (self.k.data, self.k.scale, self.k.zero, self.v.data, self.v.scale, self.v.zero)


@struct.dataclass
class Int2Pool:
    """The pool of pages: per-channel keys, per-token values, ``[P, K, 32, ...]``;
    INT2 codes, or 4-bit ones for KIVI-4 (``bits``, keys and values alike).
    The name stays the INT2 pool's: every mode but ``kivi4`` stores 2 bits here."""

    k: PackedKeyPages
    v: PackedRows

    def buffers(self) -> tuple:
        """``(k data, k scale, k zero, v data, v scale, v zero)``: the order kernels take them."""
        return (self.k.data, self.k.scale, self.k.zero, self.v.data, self.v.scale, self.v.zero)

    @property
    def bits(self) -> int:
        return self.k.bits


def quantize_int4_pool(k_SKD: jnp.ndarray, v_SKD: jnp.ndarray) -> Int4Pool:
    """Quantize a whole float pool to INT4 (slot ``s`` stays slot ``s``)."""
    return Int4Pool(quantize_int4(k_SKD), quantize_int4(v_SKD))


def quantize_int3_values(x: jnp.ndarray) -> PackedRows:
    """INT3 per token (an INT3 page's values): ``x[..., D]`` -> ``PackedRows`` with bits 3."""
    return quantize_rows(x, 3)


@functools.partial(jax.jit, static_argnames="bits")
def quantize_int2_pool(k_TKD: jnp.ndarray, v_TKD: jnp.ndarray, bits: int = 2) -> Int2Pool:
    """Quantize ``T = 32 P`` tokens into ``P`` pages (token ``t`` -> page ``t // 32``)
    of ``bits``-bit codes (2: INT2; 4: KIVI-4's pages)."""
    return Int2Pool(quantize_int2_keys(k_TKD, bits), quantize_rows(_pages(v_TKD), bits))


def dequantize_int4_pool(pool: Int4Pool) -> tuple[jnp.ndarray, jnp.ndarray]:
    """float32 ``(k[S,K,D], v[S,K,D])``."""
    return dequantize_rows(pool.k), dequantize_rows(pool.v)


@jax.jit
def dequantize_int2_pool(pool: Int2Pool) -> tuple[jnp.ndarray, jnp.ndarray]:
    """float32 ``(k[T,K,D], v[T,K,D])`` with ``T = 32 P`` in page order."""
    return _tokens(dequantize_int2_keys(pool.k)), _tokens(dequantize_rows(pool.v))
