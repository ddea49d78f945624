"""Expected Attention (Devoto et al., 2025, arXiv 2510.00636): attention future queries should pay.

Rule (kvpress ``ExpectedAttentionPress``, v0.5.5). Per layer ``l`` and query head
``h``, model the next queries as a Gaussian and score each key by the softmax of
its expected attention logit:

1. **Query statistics, before RoPE.** The samples are the valid rows of the
   observation window (the last ``w`` query rows: after prefill the prompt's, at a
   decode event the last decoded ones), without rows at positions ``< n_sink``.
   The window holds post-RoPE queries, so each row is first un-rotated to its
   pre-RoPE vector, ``q̂_r = R(−p_r) q_r`` (``jaxkv.rope.apply_rope`` with minus its
   position); RoPE is linear in the position, so this is exact.
2. **Rotate to the future.** The next queries sit at positions
   ``T .. T + n_future_positions − 1`` with ``T = seq_len``, the next position.
   Their rotation is averaged, ``R̄ = mean_t R(t)`` (``jaxkv.rope.mean_rotation``),
   and ``f_r = R̄ q̂_r``. Then ``μ = mean_r f_r`` and
   ``Σ = mean_r (f_r − μ)(f_r − μ)ᵀ``: by linearity these are kvpress's ``R̄ μ̂``
   and ``R̄ Σ̂ R̄ᵀ`` of the pre-RoPE mean and (population) covariance.
3. **Expected softmax numerator.** For a Gaussian query ``q ~ N(μ, Σ)`` and a
   post-RoPE key ``k``, ``E[exp(q·k/√d)] = exp(μ·k/√d + kᵀΣk/(2d))``, so
   ``a_i^{l,h} = softmax_i(μ·k_i/√d + k_iᵀΣk_i/(2d))`` over the live positions
   ``≥ n_sink`` (K expanded under GQA; ``use_covariance=False`` drops the second
   term).
4. **One kept set** (ALGORITHMS.md §1): ``score_i = mean_{l,h} a_i^{l,h}``, the mean
   over layers and query heads (= kvpress's mean over the GQA group, then over
   layers and KV heads). Each ``a^{l,h}`` is a distribution over the same keys,
   so heads weigh alike, as in SnapKV and TOVA.

The first ``n_sink`` positions are kept (``keep``) and left out of the softmax,
as kvpress removes them before scoring and pads their scores with the maximum plus one.
Padding entries (``valid_N`` false) are neither in the softmax nor kept: score 0.
With no usable window row, ``μ = 0`` and ``Σ = 0``: every candidate scores alike
and ``select`` keeps the lower positions.

Departures from kvpress:

* **No value norms.** kvpress rescales by the value norm, ``(a_i + ε)·‖v_i‖``
  (``use_vnorm=True``, ``epsilon=0``). ``EventFeatures`` carries no values, so this
  is kvpress's ``use_vnorm=False`` variant. The engine would need to pass
  ``value_norm_LNK`` ``[L, N, Hkv]`` (``‖v‖`` of each live row per layer and KV
  head, gathered beside ``keys_LNKD`` and only when a ``Needs`` flag asks); the
  rescale then applies to ``expected_attention_probs``'s ``[L, Hkv, N]`` output
  before the mean over layers and heads.
* **Which queries.** At prefill kvpress takes the statistics over every prompt
  query after the sinks; jaxkv captures only the observation window, ``w = 256``
  rows by default (kvpress's ``DecodingPress`` buffer of recent hidden states has
  256). With a radix hit the window holds only the new suffix's rows.
* **Where the future starts.** ``T = seq_len``, the request's next position. kvpress
  uses the length of the hidden states it was handed, which is the next position
  at prefill but the buffer length under ``DecodingPress``.
* **Granularity.** kvpress keeps a top-k per layer and KV head; jaxkv one set per
  request (step 4).

Defaults (kvpress's): ``n_future_positions = 512``, ``n_sink = 4``,
``use_covariance = True``; ``w = 256``; after prefill only.
Shapes: ``window_q_LWHD`` ``[L, W, Hq, D]``, ``keys_LNKD`` ``[L, N, Hkv, D]``; the
statistics ``μ`` ``[L, Hq, D]``, ``Σ`` ``[L, Hq, D, D]``; outputs ``[N]``. Cost: the
quadratic form is ``N·D²`` per layer and query head, independent of ``W``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import struct

from jaxkv.attention import group_heads, gqa_scores, masked_softmax
from jaxkv.config import RopeConfig
from jaxkv.errors import ConfigError
from jaxkv.policies.base import Needs, Policy, register
from jaxkv.rope import apply_rope, mean_rotation


@dataclasses.dataclass(frozen=True)
class ExpectedAttentionConfig:
    """Attributes:
    w: observation-window rows whose queries give the statistics; default 256.
    n_future_positions: the next positions the query rotation is averaged over;
      default 512.
    n_sink: positions ``< n_sink`` are kept and left out of the softmax; window rows
      there are left out of the statistics; default 4.
    use_covariance: add the ``kᵀΣk/(2d)`` term (False: the mean query only);
      default True.
    decode_interval: compress every this many decoded tokens; None (default): after
      prefill only.
    """

    w: int = 256
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    decode_interval: int | None = None

    def __post_init__(self):
        if self.w < 1 or self.n_future_positions < 1 or self.n_sink < 0:
            raise ConfigError(
                "expected_attention needs w >= 1, n_future_positions >= 1 and n_sink >= 0, got "
                f"w={self.w}, n_future_positions={self.n_future_positions}, n_sink={self.n_sink}"
            )


@struct.dataclass
class ExpectedAttentionState:
    """What ``score`` needs from the model and ``EventFeatures`` does not carry.

    Attributes:
      rope: the model's ``RopeConfig`` (static metadata, no array leaves): un-rotates
        the window's queries and rotates them to the future positions.
    """

    rope: RopeConfig = struct.field(pytree_node=False)


def init_state(cfg: ExpectedAttentionConfig, model_cfg) -> ExpectedAttentionState:
    return ExpectedAttentionState(model_cfg.rope)


def future_query_stats(cfg: ExpectedAttentionConfig, rope: RopeConfig, feats):
    """``(μ [L, Hq, D], Σ [L, Hq, D, D])`` of the window's queries moved to the next
    ``n_future_positions`` positions (steps 1-2 of the module docstring); float32."""
    q_LWHD = jnp.asarray(feats.window_q_LWHD, jnp.float32)
    pos_W = jnp.asarray(feats.window_pos_W, jnp.int32)
    L, W, _, _ = q_LWHD.shape
    pre_LWHD = apply_rope(q_LWHD, jnp.broadcast_to(-pos_W, (L, W)), rope)  # R(−p) R(p) q̂ = q̂
    f_LWHD = mean_rotation(pre_LWHD, feats.seq_len, cfg.n_future_positions, rope)
    w_W = (jnp.asarray(feats.window_valid_W, bool) & (pos_W >= cfg.n_sink)).astype(jnp.float32)
    n = jnp.maximum(w_W.sum(), 1.0)
    mu_LHD = jnp.einsum("lwhd,w->lhd", f_LWHD, w_W) / n
    c_LWHD = (f_LWHD - mu_LHD[:, None]) * w_W[None, :, None, None]
    cov_LHDE = jnp.einsum("lwhd,lwhe->lhde", c_LWHD, c_LWHD) / n
    return mu_LHD, cov_LHDE


def expected_attention_probs(mu_LHD, cov_LHDE, keys_LNKD, mask_N):
    """``softmax_i(μ·k_i/√d + k_iᵀΣk_i/(2d))`` over ``mask_N``, averaged over each GQA
    group: ``[L, Hkv, N]`` float32, 0 outside the mask. ``cov_LHDE=None``: mean only."""
    L, N, Hkv, D = keys_LNKD.shape
    keys = jnp.asarray(keys_LNKD, jnp.float32)
    logits_LKGN = gqa_scores(group_heads(mu_LHD[:, None], Hkv), keys)[:, :, :, 0]  # μ·k/√d
    if cov_LHDE is not None:
        cov_LKGDE = cov_LHDE.reshape(L, Hkv, -1, D, D)
        kcov_LKGNE = jnp.einsum("lnkd,lkgde->lkgne", keys, cov_LKGDE)  # Σk: N·D² per head, never k⊗k
        logits_LKGN = logits_LKGN + jnp.einsum("lkgne,lnke->lkgn", kcov_LKGNE, keys) / (2.0 * D)
    mask = jnp.asarray(mask_N, bool)
    probs_LKGN = jnp.where(mask, masked_softmax(logits_LKGN, mask), 0.0)
    return probs_LKGN.mean(axis=2)


def keep(cfg: ExpectedAttentionConfig, feats):
    return feats.positions_N < cfg.n_sink


def score(cfg: ExpectedAttentionConfig, state: ExpectedAttentionState, feats, candidates_N):
    mu_LHD, cov_LHDE = future_query_stats(cfg, state.rope, feats)
    mask_N = feats.valid() & (feats.positions_N >= cfg.n_sink)
    probs_LKN = expected_attention_probs(mu_LHD, cov_LHDE if cfg.use_covariance else None, feats.keys_LNKD, mask_N)
    return probs_LKN.mean(axis=(0, 1)), state


def needs(cfg: ExpectedAttentionConfig) -> Needs:
    return Needs(window=cfg.w, decode_interval=cfg.decode_interval)


POLICY = register(
    Policy(
        name="expected_attention",
        config=ExpectedAttentionConfig,
        score=score,
        needs=needs,
        init_state=init_state,
        keep=keep,
        doc="Expected Attention: softmax of the expected logit under the future queries' mean and covariance.",
    )
)
