"""Per-(layer, KV head) orthogonal rotations of K and V before quantization (issue #74).

A rotated pool stores ``K·R`` and ``V·R`` instead of ``K`` and ``V``, with one
fixed orthogonal ``R = B · diag(s)`` per layer and KV head: ``B = H / sqrt(D)``, the
Sylvester Hadamard matrix of the head dim (a seeded random orthogonal matrix when
``D`` is not a power of two), and ``s`` random signs per (layer, KV head, channel).
A rotation spreads an outlier channel over every channel, so a quantization
group's range is set by the row's norm rather than by its largest channel
(QuaRot, SpinQuant; TurboQuant's random rotation before scalar quantization).

Invariants:

* ``R`` is orthogonal: ``R Rᵀ = I`` to float32 rounding; unrotating is ``x·Rᵀ``.
* Attention is unchanged in exact arithmetic when the queries of a KV head's GQA
  group are rotated by its ``R`` and the output is rotated back:
  ``(qR)(kR)ᵀ = qkᵀ`` and ``softmax(·)(VR)Rᵀ = softmax(·)V``
  (``jaxkv.backends.base.AttentionBackend.rotate_in`` / ``rotate_out``, the one
  place the engine's attention does it).
* ``R`` is a pure function of ``(seed, head_dim, layer, KV head)``: the signs are
  an integer hash computed alike in numpy and in a jit'd program, for any traced
  layer index and any number of layers or heads, so a pool, its host tier and any
  reader agree on ``R`` without storing it. Nothing of it is counted in stored
  bits: it is a property of the pool, not of the tokens.
* Applying it costs one ``[D, D]`` product and one sign flip per row
  (``x·R = (x·B) ⊙ s``, ``x·Rᵀ = (x ⊙ s)·Bᵀ``), in float32 at full precision.

Shape letters: T tokens, K KV heads, H query heads (``G = H / K`` per KV head,
head ``h`` reads KV head ``h // G``), D head dim, L layers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

SEED = 74  # the rotation a rotated pool uses unless told otherwise

_MIX = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x2C1B3C6D, 0x297A2D39)


def sylvester_hadamard(n: int) -> np.ndarray:
    """The Sylvester Hadamard matrix of order ``n`` (a power of two), entries ±1."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Sylvester Hadamard needs a power of two, got {n}")
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


@functools.lru_cache(maxsize=16)
def _basis(head_dim: int, seed: int) -> np.ndarray:
    D = head_dim
    if D & (D - 1) == 0:
        b = sylvester_hadamard(D) / np.sqrt(D)
    else:
        q, r = np.linalg.qr(np.random.default_rng(seed).standard_normal((D, D)))
        b = q * np.sign(np.diag(r))[None, :]
    b = b.astype(np.float32)
    b.setflags(write=False)
    return b


def _hash_signs(xp, seed: int, layer, head, channel):
    """±1 float32 from a uint32 hash of (seed, layer, head, channel), broadcast."""
    u = lambda a: xp.asarray(np.uint32(a) if isinstance(a, int) else a).astype(xp.uint32)  # noqa: E731
    h = u(seed) * u(_MIX[0]) + u(layer) * u(_MIX[1]) + u(head) * u(_MIX[2]) + u(channel) * u(_MIX[3])
    h = h ^ (h >> u(15))
    h = h * u(_MIX[4])
    h = h ^ (h >> u(12))
    h = h * u(_MIX[5])
    h = h ^ (h >> u(15))
    return xp.where((h >> u(31)) == u(1), -1.0, 1.0).astype(xp.float32)


@dataclasses.dataclass(frozen=True)
class Rotation:
    """The rotation of a pool (module docstring); hashable, so a static field of the
    pool's device layers.

    Attributes:
      head_dim: D. seed: the signs' and (D not a power of two) the basis' seed.
    """

    head_dim: int
    seed: int = SEED

    @property
    def basis(self) -> np.ndarray:
        """``B [D, D]`` float32, orthogonal."""
        return _basis(self.head_dim, self.seed)

    def signs(self, layer, num_kv_heads: int, xp=jnp):
        """``s [..., K, D]`` of ``layer`` (an int, a traced scalar or an array ``[...]``)."""
        layer = xp.asarray(layer)[..., None, None]
        head = xp.arange(num_kv_heads)[:, None]
        channel = xp.arange(self.head_dim)[None, :]
        return _hash_signs(xp, self.seed, layer, head, channel)

    def matrices(self, num_layers: int, num_kv_heads: int) -> np.ndarray:
        """``R [L, K, D, D]`` float32 (numpy): ``B · diag(s)`` per layer and KV head."""
        s = self.signs(np.arange(num_layers), num_kv_heads, xp=np)
        return (self.basis[None, None] * s[:, :, None, :]).astype(np.float32)

    # -- device ---------------------------------------------------------------------------
    def _b(self, x):
        return jnp.asarray(self.basis)

    def rotate(self, layer, x_KD):
        """``x·R`` of rows ``x [..., K, D]`` of ``layer`` (scalar, or ``[...]`` matching
        ``x``'s leading axes before K), in ``x.dtype``."""
        y = jnp.einsum("...d,de->...e", x_KD.astype(jnp.float32), self._b(x_KD), precision=jax.lax.Precision.HIGHEST)
        return (y * self.signs(layer, x_KD.shape[-2])).astype(x_KD.dtype)

    def unrotate(self, layer, x_KD):
        """``x·Rᵀ``: the inverse of ``rotate``."""
        y = x_KD.astype(jnp.float32) * self.signs(layer, x_KD.shape[-2])
        return jnp.einsum("...e,de->...d", y, self._b(x_KD), precision=jax.lax.Precision.HIGHEST).astype(x_KD.dtype)

    def _grouped(self, fn, layer, x_HD, num_kv_heads: int):
        H, D = x_HD.shape[-2:]
        x = x_HD.reshape(*x_HD.shape[:-2], num_kv_heads, H // num_kv_heads, D)
        y = fn(layer, jnp.swapaxes(x, -2, -3))  # [..., G, K, D]: each query head by its KV head's R
        return jnp.swapaxes(y, -2, -3).reshape(x_HD.shape)

    def rotate_heads(self, layer, x_HD, num_kv_heads: int):
        """``rotate`` of query-head rows ``x [..., H, D]``: head ``h`` by KV head ``h // G``'s ``R``."""
        return self._grouped(self.rotate, layer, x_HD, num_kv_heads)

    def unrotate_heads(self, layer, x_HD, num_kv_heads: int):
        """``unrotate`` of query-head rows (the attention output back to the model's frame)."""
        return self._grouped(self.unrotate, layer, x_HD, num_kv_heads)


def rotations(num_layers: int, num_kv_heads: int, head_dim: int, seed: int = SEED) -> np.ndarray:
    """``R_LKDE [L, K, D, D]`` float32 of the pool rotation (``Rotation.matrices``)."""
    return Rotation(int(head_dim), int(seed)).matrices(int(num_layers), int(num_kv_heads))
