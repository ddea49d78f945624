"""Next-token selection: greedy, temperature, top-k, top-p, from an explicit key.

``SamplerSpec`` is static (hashable) so each distinct combination of *which*
filters are on compiles once; the temperature and top-p threshold are traced
values, so changing them does not recompile.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

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
        logits = jnp.full_like(logits, -jnp.inf).at[
            jnp.arange(logits.shape[0])[:, None], order
        ].set(sorted_logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def sample_rows(logits_RV, keys_R, spec: SamplerSpec, temperature_R, top_p_R):
    """``sample`` with a key, temperature and top-p per row ``[R]``: a row's token
    depends on its own inputs only, whatever other rows share the batch."""
    if spec.greedy:
        return jnp.argmax(logits_RV, axis=-1).astype(jnp.int32)

    def one(logits_V, key, temperature, top_p):
        return sample(logits_V[None], key, spec, temperature, top_p)[0]

    return jax.vmap(one)(logits_RV, keys_R, temperature_R, top_p_R)
