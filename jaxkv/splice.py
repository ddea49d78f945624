"""Spliced prefill: the jit'd step of cross-query segment reuse (ALGORITHMS.md §8-9).

A prompt piece is prefilled into a cache row with some of its tokens *spliced*:
their lower layers' K/V come from a stored segment (keys delta-rotated to the new
positions), and only part of the layer stack runs for them. One jit'd step,
``splice_step``, serves every reuse mode through one description, ``SplicePlan``:

* group A (token indices ``a_idx``) runs layers ``[0, cut)`` from the embedding;
* group B (``b_idx``) runs layers ``[cut, L)``: a B token that is also in A
  continues from its A residual, any other B token starts from a stored residual
  (``b_resid``: the residual stream at the input of layer ``cut``);
* tokens ``kv_idx`` get the K/V of layers ``[kv_lo, kv_hi)`` written from the
  store (``kv_k`` post-RoPE at ``kv_old_pos``, rotated by ``rope_delta``); a B
  token whose layer-``cut`` K/V were written so does not overwrite them
  (``b_cut_write`` false);
* every computed token attends, at each layer, to the row's keys whose position
  is at most its own, after that layer's writes, through the engine's attention
  entry with explicit key positions (``AttentionBackend.attend_positional``).

Segment reuse with ``L_reuse = {0..n-1}`` is ``cut = n - 1``: interior tokens skip
layers ``0..n-2``, run the last reused layer from its stored input residual with
the spliced K/V, and every layer above (``jaxkv.serving.stages.reuse``). CacheBlend
is two steps: layer 0 for every token (``cut = 1``, B empty), then layers
``1..L-1`` for the recomputed tokens with the others' K/V spliced. The acceptance
test's reference is a ``probe`` step: the probed tokens through every layer
(``cut = L``) on scratch slots, reading only keys before them.

Modes (``Engine.splice_prefill``): ``append`` allocates slots for ``tokens`` at the
row's next positions and records them in the row; ``rewrite`` recomputes tokens
the row already holds at ``[base, base + T)`` in their slots; ``probe`` runs on
scratch slots (released after) and reads only the row's keys before ``base``:
nothing of the row changes.

Invariants: only slots of the piece (or scratch slots) are written, plus padding
writes to the sentinel slot 0, which is never read; keys are read through the
explicit ``live``/``live_pos`` lists, padded with the sentinel at position
``PAD_POS`` (never visible). Cost model: per layer, ``|group| x N`` attention
(queries in blocks of ``CAUSAL_BLOCK``, no diagonal skipping) plus the group's
projections; the token x layer units a plan computes are ``SplicePlan.units``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.backends.base import AttentionMetadata
from jaxkv.kernels.rope_delta import rope_delta

PAD_POS = 1 << 30  # position of padding keys: after every query, so never visible


@functools.partial(jax.jit, static_argnames=("graphdef", "cut", "kv_lo", "kv_hi", "backend"), donate_argnames=("cache",))
def splice_step(
    graphdef,
    params,
    cache,
    a_tok_A,
    a_pos_A,
    a_slot_A,
    b_src_B,
    b_resid_BM,
    b_pos_B,
    b_slot_B,
    b_cut_slot_B,
    kv_k_LMKD,
    kv_v_LMKD,
    kv_slot_M,
    kv_delta_M,
    live_N,
    live_pos_JN,
    logit_src_Y,
    *,
    cut,
    kv_lo,
    kv_hi,
    backend,
):
    """One spliced piece (module docstring). Padding: A/B entries with slot 0 and
    position -1 (they see no key and write to the sentinel), K/V rows with slot 0.

    ``live_pos_JN``: the position of each ``live_N`` entry as layer ``i`` sees it,
    from row ``min(i, J - 1)``: a row that keeps per-layer sets gives an entry its
    layer does not read ``PAD_POS`` (never visible), so each layer attends to its
    own keep set (J = 1: every layer reads every entry).

    Every layer writes and attends through the engine's attention entry
    (``backend``, ``jaxkv.backends``) with metadata that carries explicit key
    positions (``AttentionMetadata.positional``): the backend writes float rows at
    the pool's precision and reads the listed keys back in float, so a quantized
    pool splices as the float pool does.

    ``logit_src_Y`` indexes group B (``b``) when B runs layers, else group A.
    Returns ``(logits [Y, V] f32, cache, resid_AM)``: ``resid_AM`` is group A's
    residual at the input of layer ``cut`` (what a stored segment keeps).
    """
    model = nnx.merge(graphdef, params)
    L = model.cfg.num_layers
    kv = cache.kv
    if kv_hi > kv_lo:
        M = kv_slot_M.shape[0]
        k_rot = rope_delta(kv_k_LMKD, jnp.arange(M, dtype=jnp.int32), kv_delta_M, model.cfg.rope)
        stored = AttentionMetadata.positional(kv_slot_M)
        for i in range(kv_lo, kv_hi):
            to_stored = functools.partial(backend.layers.to_stored, i)  # a rotated pool's frame
            kv = backend.write(kv, i, to_stored(k_rot[i - kv_lo]), to_stored(kv_v_LMKD[i - kv_lo]), stored)

    def attender(q_pos, slots_for):
        def attend(i, q, k, v, kv):
            meta = AttentionMetadata.positional(slots_for(i), q_pos, live_N, live_pos_JN)
            q_THD, k_TKD, v_TKD = backend.rotate_in(i, q[0], k[0], v[0])  # a rotated pool's frame, as the forward's
            kv = backend.write(kv, i, k_TKD, v_TKD, meta)
            o, _ = backend.attend(kv, i, q_THD, k_TKD, v_TKD, meta)
            return backend.rotate_out(i, o, k_TKD.shape[-2])[None], kv, None

        return attend

    x_a, kv, _ = model.run_layers(model.embed_tokens(a_tok_A[None]), a_pos_A[None], attender(a_pos_A, lambda i: a_slot_A), kv, 0, cut)
    x_a = x_a[0]
    if cut < L:
        from_a = (b_src_B >= 0)[:, None]
        x_b = jnp.where(from_a, x_a[jnp.clip(b_src_B, 0)], b_resid_BM.astype(x_a.dtype))
        slots_b = lambda i: jnp.where(i == cut, b_cut_slot_B, b_slot_B)  # noqa: E731
        x_out, kv, _ = model.run_layers(x_b[None], b_pos_B[None], attender(b_pos_B, slots_b), kv, cut, L)
        x_out = x_out[0]
    else:
        x_out = x_a
    logits = model.logits(x_out[logit_src_Y])
    return logits, cache.with_kv(kv), x_a


@functools.partial(jax.jit, static_argnames=("graphdef", "layer"))
def layer_key_deviation(graphdef, params, x_XM, pos_X, k_old_XKD, delta_X, *, layer):
    """CacheBlend's selection signal: ``|| K_layer(x) - R(delta) k_old ||`` per token,
    the recomputed post-RoPE key of ``layer`` from the residual ``x_XM`` at its input
    against the stored key moved to the new position (``rope_delta``). ``[X]`` f32."""
    model = nnx.merge(graphdef, params)
    blk = model.layer(layer)
    _, k, _ = blk.self_attn.qkv(blk.input_layernorm(x_XM[None]), pos_X[None])
    X = pos_X.shape[0]
    k_old = rope_delta(k_old_XKD, jnp.arange(X, dtype=jnp.int32), delta_X, model.cfg.rope)
    diff = k[0].astype(jnp.float32) - k_old.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(diff * diff, axis=(-2, -1)))


@dataclasses.dataclass
class SplicePlan:
    """What one ``splice_step`` does to a piece of ``T`` tokens (module docstring).

    Attributes:
      tokens: ``[T]`` ids of the piece, at positions ``base .. base + T``.
      cut: group A runs layers ``[0, cut)``, group B ``[cut, L)``.
      a_idx: ``[A]`` indices into ``tokens`` of group A, ascending.
      b_idx: ``[B]`` indices of group B, ascending; ``b_resid``: ``[B, M]`` residual
        at the input of layer ``cut`` for B tokens not in A (rows of A tokens are
        ignored), or None when every B token is in A.
      b_cut_write: ``[B]`` bool, write the layer-``cut`` K/V of that B token (False
        where the store supplied them); None: all True.
      kv_idx: ``[M]`` indices whose K/V of layers ``[kv_lo, kv_hi)`` come from
        ``kv_k`` / ``kv_v`` ``[kv_hi - kv_lo, M, Hkv, D]`` (keys post-RoPE at
        ``kv_old_pos [M]``).
      logit_idx: ``[Y]`` indices into ``tokens`` whose next-token logits to return
        (each must run the top layer: in B, or in A when ``cut == L``).
      base: position of ``tokens[0]`` (``rewrite`` / ``probe`` modes; ``append``
        uses the row's length).
    """

    tokens: np.ndarray
    cut: int
    a_idx: np.ndarray
    b_idx: np.ndarray
    b_resid: np.ndarray | None = None
    b_cut_write: np.ndarray | None = None
    kv_idx: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    kv_lo: int = 0
    kv_hi: int = 0
    kv_k: np.ndarray | None = None
    kv_v: np.ndarray | None = None
    kv_old_pos: np.ndarray | None = None
    logit_idx: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    base: int = 0

    def units(self, num_layers: int) -> int:
        """Token x layer units the plan computes (a layer counts whole even when its
        K/V projection is skipped)."""
        return int(len(self.a_idx)) * self.cut + int(len(self.b_idx)) * (num_layers - self.cut)

    @staticmethod
    def full(tokens, cut: int, logit_idx=()) -> "SplicePlan":
        """Every token through every layer (A = B = all), keeping the residual at ``cut``."""
        T = len(tokens)
        idx = np.arange(T)
        return SplicePlan(np.asarray(tokens, np.int32), cut, idx, idx, logit_idx=np.asarray(logit_idx, np.int64))
