"""KeyDiff (Park et al., 2025, arXiv 2504.15364): keep the keys least like the average key.

Rule (kvpress ``KeyDiffPress``, v0.5.5): per layer ``l`` and KV head ``h`` the anchor
is the mean of the unit-normalised keys of every live position,
``a = mean_j k̂_j`` with ``k̂ = k / ‖k‖``, and a key's score is its negative cosine
similarity to it, ``s_i = −cos(k_i, a) = −k̂_i · a / ‖a‖``. Keys that point away
from the average direction score highest and are kept. Question-agnostic: it
reads no query and no attention, only the post-RoPE keys already in the pool.

One kept set for the model (ALGORITHMS.md §1): ``score_i = mean_{l,h} s_i^{l,h}``,
the plain mean over layers and KV heads. Every per-head score is a cosine in
``[−1, 1]``, so no head or layer outweighs another by scale and no further
normalisation is applied. (With GQA the mean over expanded heads is the same
number: each KV head is repeated ``G`` times.) This is ``eval.quality.token_sets``'s
``KeyDiffPress/one`` cell.

The anchor is taken over every real live position (forced ones included: it is
the cache's average key, as kvpress takes it over the whole cache); padding
entries (``valid_N`` false) take no part and score 0. The policy forces nothing.

Departures from kvpress: kvpress keeps a top-k per layer and KV head; jaxkv keeps
one set per request (the mean above) by default, or one per layer
(``keep_sets="layer"``: the score above of that layer alone), never one per head.
The paper's block-wise prompt processing is kvpress's ``BlockPress`` wrapper, not
this press; here, as in kvpress, one event scores the whole live
history. A zero key has no direction: its cosine is 0 (``common.unit_norm``'s
epsilon), where torch's would also be 0.

Defaults: no options but the schedule, after prefill only (kvpress scores at
prefill). Shapes: ``keys_LNKD`` ``[L, N, Hkv, D]`` in, ``[N]`` out.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkv.policies.base import Needs, Policy, register
from jaxkv.policies.common import unit_norm


@dataclasses.dataclass(frozen=True)
class KeyDiffConfig:
    """Attributes:
    decode_interval: compress every this many decoded tokens; None (default): after
      prefill only.
    """

    decode_interval: int | None = None


def key_dissimilarity(keys_LNKD, valid_N):
    """``−cos(k_i, mean_j k̂_j)`` per layer and KV head, ``[L, N, Hkv]`` float32;
    the mean runs over the ``valid_N`` entries, the others score 0."""
    valid = jnp.asarray(valid_N, bool)
    unit_LNKD = unit_norm(keys_LNKD)
    w_N = valid.astype(jnp.float32)
    anchor_LKD = jnp.einsum("lnkd,n->lkd", unit_LNKD, w_N) / jnp.maximum(w_N.sum(), 1.0)
    cos_LNK = jnp.einsum("lnkd,lkd->lnk", unit_LNKD, unit_norm(anchor_LKD))
    return jnp.where(valid[None, :, None], -cos_LNK, 0.0)


def score(cfg: KeyDiffConfig, state, feats, candidates_N):
    return key_dissimilarity(feats.keys_LNKD, feats.valid()).mean(axis=(0, 2)), state


def needs(cfg: KeyDiffConfig) -> Needs:
    return Needs(decode_interval=cfg.decode_interval)


POLICY = register(
    Policy(
        name="keydiff",
        config=KeyDiffConfig,
        score=score,
        needs=needs,
        doc="KeyDiff: negative cosine of each key to the mean unit key, averaged over layers and KV heads.",
    )
)
