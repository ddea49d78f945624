"""The INT3 page format (issue 74): 3-bit codes with one byte of scale and one
byte of zero point per group, keys per channel over a page's 32 tokens, values
per token in groups of 64 channels (``value_group``).

Why: an INT3 page with ``jaxkv.kernels.quant``'s float16 scale and zero per group
of 32 stores 4.0 bits per element, a third of it parameters. Here the parameters
take 2 bytes per group instead of 4, over groups twice as wide for values, so an
INT3 token stores ``3 + (16/32 + 16/64) / 2 = 3.375`` bits (head dim 64; 3.5 for
a head dim of 32, whose value groups stay 32 wide): ``bytes_per_token``.

Parameters of a group with minimum ``m`` and maximum ``M``:

* **scale**: a uint8 code ``s`` on a logarithmic grid, ``scale = SCALE_TABLE[s] =
  2 ** ((s - 128) / 8)`` (float32, from 2^-16 to 2^15.9, steps of 9%);
* **zero point**: an int8 ``o`` in units of the scale, the zero ``o * scale``
  (float32): the standard integer zero point.

Code ``c = clip(round(x / scale - o), 0, 7)`` (IEEE float32 division, round half
to even), value ``x_hat = o * scale + c * scale`` (float32). Inputs must be finite
and within float16 range. Two rules choose ``(s, o)`` (``FITS``, the ``fit``
argument; the bytes mean the same under both, so every reader is unchanged):

* ``"cover"`` (an unrotated pool's): ``s`` the smallest entry at least
  ``max((M - m) / 7, |m| / 127)`` (rounded *up*: a step at most 9% wider than
  float16's) and ``o = round(m / scale)``. With ``scale >= |m| / 127`` it fits int8
  and ``m`` lies within half a step of it, so with ``scale >= (M - m) / 7`` every x
  lies within ``[o - 1/2, o + 7 + 1/2]`` steps: ``|x - x_hat| <= scale / 2`` (plus
  float32 rounding) for every element, as in every other format.
* ``"mse"`` (a rotated pool's, ``jaxkv.cache.quantized.page3_fit``): of the covering
  code and the ``MSE_STEPS`` (one) below it, each with the zero points ``round(m /
  scale) + {0, -1, +1}``, the pair whose values have the least squared error over
  the group (ties: the earlier, the covering pair first). The covering pair is among
  them, so a group's squared error is at most its ``"cover"`` error; an element may
  now be clipped (more than half a step off). Why: on rotated K/V (near-Gaussian
  groups) clipping the extremes pays, and on SmolLM2's agent traces the rotated
  pool's reply KL fell from 0.063 to 0.054 and its NLL increase from +0.041 to
  +0.006 (two codes below, ``eval/results/triaxial/int3_study``); unrotated, the
  extremes are outlier channels and tokens attention reads, and the same fit cost
  more than it saved. Why one code below, not two or more: a wider search lowers the
  squared error further but clips more of each group's extremes, and the loss goes
  the other way; one code below was the best of the widths offline (rotated KL
  -4% against two) and on the 24 held-out agent traces the calibrated allocation's
  rotated NLL increase went from +0.0473 to +0.0419 (paired -0.0054 [-0.0129,
  +0.0025]) and its KL from 0.040 to 0.033 (``eval/results/triaxial/int3_fit``,
  where wider searches, least-squares refinement, a fourth-power error and a
  non-uniform code were no better).

Readers never see the bytes: ``params`` expands them to float32 ``(scale, zero)``
at the granularity every page reader already takes (keys ``[..., D]`` per channel,
values ``[..., D/32]`` per 32 channels, a 64-channel group's pair repeated), so a
page of either width goes through the one dequantization
(``jaxkv.cache.quantized.page_params``). The codes are ``jaxkv.kernels.quant``'s
2 + 1 bit-plane rows, unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.errors import ConfigError
from jaxkv.kernels.quant import GROUP, PAGE, _pages, _tokens, check_head_dim, pack, unpack

BITS3 = 3
TOP = (1 << BITS3) - 1
OFFSET_MAX = 127  # int8 zero points in [-127, 127]
SCALE_TABLE = np.asarray(2.0 ** ((np.arange(256) - 128) / 8.0), np.float32)  # uint8 code -> scale
FITS = ("cover", "mse")  # how a group's parameters are chosen (module docstring)
MSE_STEPS = 1  # the mse fit tries the covering scale code and this many below it (module docstring: why one)


def value_group(head_dim: int) -> int:
    """Channels per value group of an INT3 page: 64 where the head dim allows, else 32."""
    check_head_dim(head_dim)
    return 64 if head_dim % 64 == 0 else GROUP


def page3_bytes(head_dim: int) -> float:
    """Bytes one INT3 page token holds per layer and KV head, K + V: codes ``2 * 3D/8``,
    key parameters ``2D`` bytes per page over its 32 tokens, value parameters 2 bytes
    per group of ``value_group`` channels."""
    D = head_dim
    return 2 * 3 * D / 8 + 2 * D / PAGE + 2 * D / value_group(D)


def _fit8(x: jnp.ndarray, axis: int, fit: str = "cover"):
    """(codes uint8, scale code uint8, zero point int8) of ``x`` with groups along
    ``axis``, the parameters chosen by ``fit`` (module docstring)."""
    if fit not in FITS:
        raise ConfigError(f"INT3 page fit must be one of {FITS}, got {fit!r}")
    x = x.astype(jnp.float32)
    table = jnp.asarray(SCALE_TABLE)
    lo = jnp.min(x, axis=axis, keepdims=True)
    need = jnp.maximum((jnp.max(x, axis=axis, keepdims=True) - lo) * (1.0 / TOP), jnp.abs(lo) * (1.0 / OFFSET_MAX))
    cover = jnp.clip(jnp.searchsorted(table, need, side="left"), 0, 255)  # the smallest entry >= need
    tries = ((0, 0),) if fit == "cover" else tuple((ds, do) for ds in range(MSE_STEPS + 1) for do in (0, -1, 1))
    best = None
    for ds, do in tries:
        s_code = jnp.clip(cover - ds, 0, 255)
        scale = table[s_code]
        # IEEE divisions (``jaxkv.kernels.quant._fit``: a barrier keeps XLA from a reciprocal product)
        divisor = jax.lax.optimization_barrier(jnp.broadcast_to(scale, x.shape))
        offset = jnp.clip(jnp.round(lo / scale) + do, -OFFSET_MAX, OFFSET_MAX)
        codes = jnp.clip(jnp.round(x / divisor - offset), 0, TOP)
        if len(tries) > 1:  # the squared error of the values ``params`` gives back
            err = jnp.sum((offset * scale + codes * scale - x) ** 2, axis=axis, keepdims=True)
            if best is not None:  # strictly less: ties keep the earlier try (the covering pair first)
                take = err < best[0]
                err, codes, s_code, offset = (jnp.where(take, a, b) for a, b in zip((err, codes, s_code, offset), best))
            best = (err, codes, s_code, offset)
    if best is not None:
        codes, s_code, offset = best[1:]
    return codes.astype(jnp.uint8), jnp.squeeze(s_code, axis).astype(jnp.uint8), jnp.squeeze(offset, axis).astype(jnp.int8)


def params(s_code: jnp.ndarray, offset: jnp.ndarray, repeat: int = 1):
    """float32 ``(scale, zero)`` of scale codes and zero points, each entry repeated
    ``repeat`` times along the last axis (a value group's 32-channel halves)."""
    scale = jnp.asarray(SCALE_TABLE)[s_code.astype(jnp.int32)]  # a constant of the traced program (no device array at import)
    zero = offset.astype(jnp.float32) * scale
    if repeat > 1:
        scale, zero = jnp.repeat(scale, repeat, axis=-1), jnp.repeat(zero, repeat, axis=-1)
    return scale, zero


@struct.dataclass
class Pages3:
    """INT3 pages ``[Q, K, 32, ...]``: 3-bit rows (``jaxkv.kernels.quant``'s 2 + 1
    split) and one-byte parameters.

    Attributes:
      k_data, v_data: uint8 ``[Q, K, 32, 3D/8]``.
      k_scale, k_zero: uint8 scale codes, int8 zero points ``[Q, K, D]`` (per channel
        over the page's 32 tokens).
      v_scale, v_zero: the same ``[Q, K, 32, D/G]``, ``G = value_group(D)``.
    """

    k_data: jnp.ndarray
    v_data: jnp.ndarray
    k_scale: jnp.ndarray
    k_zero: jnp.ndarray
    v_scale: jnp.ndarray
    v_zero: jnp.ndarray

    def params(self) -> tuple:
        """``(k_scale, k_zero, v_scale, v_zero)``, the one-byte arrays as stored."""
        return (self.k_scale, self.k_zero, self.v_scale, self.v_zero)


@functools.partial(jax.jit, static_argnames="fit")
def quantize_pages3(k_TKD: jnp.ndarray, v_TKD: jnp.ndarray, fit: str = "cover") -> Pages3:
    """``T = 32 Q`` tokens into ``Q`` INT3 pages (token ``t`` -> page ``t // 32``),
    parameters chosen by ``fit`` (``FITS``)."""
    D = k_TKD.shape[-1]
    G = value_group(D)
    kc, ks, kz = _fit8(_pages(k_TKD), 2, fit)  # keys: groups along the page's tokens
    v = _pages(v_TKD)
    vc, vs, vz = _fit8(v.reshape(*v.shape[:-1], D // G, G), -1, fit)
    return Pages3(pack(kc, BITS3), pack(vc.reshape(v.shape), BITS3), ks, kz, vs, vz)


@jax.jit
def dequantize_pages3(pages: Pages3) -> tuple[jnp.ndarray, jnp.ndarray]:
    """float32 ``(k, v)`` ``[T, K, D]`` of ``Pages3`` in token order."""
    D = pages.k_scale.shape[-1]
    ks, kz = params(pages.k_scale, pages.k_zero)
    vs, vz = params(pages.v_scale, pages.v_zero, value_group(D) // GROUP)
    k = kz[..., None, :] + unpack(pages.k_data, BITS3).astype(jnp.float32) * ks[..., None, :]
    codes = unpack(pages.v_data, BITS3).astype(jnp.float32)
    grouped = codes.reshape(*codes.shape[:-1], D // GROUP, GROUP)
    v = (vz[..., None] + grouped * vs[..., None]).reshape(codes.shape)
    return _tokens(k), _tokens(v)


def pages3_round_trip(k_TKD: jnp.ndarray, v_TKD: jnp.ndarray, fit: str = "cover") -> tuple[jnp.ndarray, jnp.ndarray]:
    """``k, v [T, K, D]`` (T % 32 == 0) through INT3 pages and back, float32: the
    error an INT3 page gives (``train.calibrate_triaxial``, ``eval.quality.quant_attention_error``)."""
    if k_TKD.shape[0] % PAGE:
        raise ConfigError(f"INT3 pages need a token count divisible by {PAGE}, got {k_TKD.shape[0]}")
    return dequantize_pages3(quantize_pages3(k_TKD, v_TKD, fit))
