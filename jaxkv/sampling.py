"""Next-token selection: greedy, temperature, top-k, top-p, from an explicit key.

Two forms of one rule:

* ``sample`` / ``SamplerSpec``: one sampler for a whole batch, the spec static
  (which filters are on), temperature and top-p traced; what ``generate`` and
  ``Engine.prefill``'s callers use for a first token.
* ``sample_batch`` / ``RowSamplers``: every row its own sampler, all of it data,
  so the engine's steps compile once for every mix of samplers.

Both keep the same token set (``_filtered`` is ``sample``'s filter, per row).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.errors import JaxKVError


class SamplingError(JaxKVError, ValueError):
    """Invalid sampling parameters."""


@dataclasses.dataclass(frozen=True)
class SamplerSpec:
    greedy: bool = True
    top_k: int | None = None
    use_top_p: bool = False


def make_sampler(temperature=0.0, top_k=None, top_p=None) -> tuple[SamplerSpec, jnp.ndarray, jnp.ndarray]:
    """Validate user parameters; returns (static spec, temperature, top_p) arrays."""
    if temperature is None or not temperature >= 0:
        raise SamplingError(f"temperature must be >= 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise SamplingError(f"top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise SamplingError(f"top_p must be in (0, 1], got {top_p!r}")
    spec = SamplerSpec(greedy=temperature == 0, top_k=top_k, use_top_p=top_p is not None and top_p < 1.0)
    return spec, jnp.float32(max(temperature, 1e-6)), jnp.float32(top_p if top_p is not None else 1.0)


def sample(logits_RV, key, spec: SamplerSpec, temperature, top_p):
    """One token per row ``[R]`` int32."""
    if spec.greedy:
        return jnp.argmax(logits_RV, axis=-1).astype(jnp.int32)
    logits = logits_RV.astype(jnp.float32) / temperature
    if spec.top_k is not None:
        kth = jax.lax.top_k(logits, min(spec.top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if spec.use_top_p:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        sorted_logits = jnp.where(before < top_p, sorted_logits, -jnp.inf)  # top token always kept
        logits = jnp.full_like(logits, -jnp.inf).at[jnp.arange(logits.shape[0])[:, None], order].set(sorted_logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@struct.dataclass
class RowSamplers:
    """Per-row sampler settings as data, so rows of every sampler share one
    compiled step (``sample_batch``).

    Attributes:
      temperature_R: float32; 0 is greedy (argmax, no key used).
      top_k_R: int32; 0 keeps every token.
      top_p_R: float32; 1 keeps every token.
    """

    temperature_R: jax.Array
    top_k_R: jax.Array
    top_p_R: jax.Array

    @classmethod
    def of(cls, settings) -> "RowSamplers":
        """From ``(temperature, top_k, top_p)`` per row (``None`` = off), as numpy."""
        temp = np.asarray([float(t or 0.0) for t, _, _ in settings], np.float32)
        top_k = np.asarray([int(k or 0) for _, k, _ in settings], np.int32)
        top_p = np.asarray([1.0 if p is None else float(p) for _, _, p in settings], np.float32)
        return cls(temp, top_k, top_p)


def _filtered(logits_V, top_k, top_p):
    """``logits_V`` with the tokens outside the row's top-k and top-p set to -inf:
    the same set ``sample`` keeps (k-th largest value for top-k; then, in sorted
    order, every token whose mass strictly above it is below ``top_p``)."""
    V = logits_V.shape[0]
    order = jnp.argsort(-logits_V)
    sorted_logits = logits_V[order]
    kth = sorted_logits[jnp.clip(top_k - 1, 0, V - 1)]
    sorted_logits = jnp.where((top_k > 0) & (sorted_logits < kth), -jnp.inf, sorted_logits)
    probs = jax.nn.softmax(sorted_logits)
    before = jnp.cumsum(probs) - probs
    sorted_logits = jnp.where((top_p < 1.0) & ~(before < top_p), -jnp.inf, sorted_logits)
    return jnp.full_like(logits_V, -jnp.inf).at[order].set(sorted_logits)


def sample_batch(logits_RV, keys_R, samplers: RowSamplers):
    """One token per row ``[R]`` int32, each row with its own sampler and key: a
    row's token depends on its own inputs only. The top-k / top-p sort runs only
    when some row asks for it (``lax.cond``)."""
    greedy = jnp.argmax(logits_RV, axis=-1).astype(jnp.int32)
    sampled_rows = samplers.temperature_R > 0

    def draw(_):
        logits = logits_RV.astype(jnp.float32) / jnp.maximum(samplers.temperature_R, 1e-6)[:, None]
        filtering = jnp.any(sampled_rows & ((samplers.top_k_R > 0) | (samplers.top_p_R < 1.0)))
        logits = jax.lax.cond(filtering, lambda x: jax.vmap(_filtered)(x, samplers.top_k_R, samplers.top_p_R), lambda x: x, logits)
        drawn = jax.vmap(lambda lg, key: jax.random.categorical(key, lg[None], axis=-1)[0])(logits, keys_R)
        return jnp.where(sampled_rows, drawn.astype(jnp.int32), greedy)

    return jax.lax.cond(jnp.any(sampled_rows), draw, lambda _: greedy, None)


@jax.jit
def sample_row(logits_V, key, fold, samplers: "RowSamplers"):
    """One token (int32 scalar) from one row's logits with its sampler (a one-row
    ``RowSamplers``) and the key ``fold_in(key, fold)``: ``sample_batch`` as one
    compiled program, so the first token of a reply costs no eager ops (each
    would be a program of its own to compile at start-up)."""
    return sample_batch(logits_V[None].astype(jnp.float32), jax.random.fold_in(key, fold)[None], samplers)[0]
