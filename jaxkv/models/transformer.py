"""The decoder shared by Llama, Qwen2 and Qwen3 (Flax NNX).

Family differences are config flags (``ModelConfig.qkv_bias``, ``o_bias``,
``mlp_bias``, ``qk_norm``, ``tie_word_embeddings``); attribute names mirror the HF
parameter names so ``weights.py`` maps checkpoints mechanically.

Shape letters: B batch, T tokens in the chunk, M model width, F MLP width,
Hq / Hkv query / KV heads (K in einsums), D head dim, V vocab, N live-list length,
S pool slots, L layers, R captured query rows.

Three ways to run the same weights:

* ``model(tokens_BT)``: dense causal forward with no cache (``score_logits``, training).
* ``model.prefill(...)``: a chunk attends to the request's cached live slots and to
  itself; its K/V are written to the pool at the slots the host chose.
* ``model.decode(...)``: one token per request; its K/V are written first, then it
  attends over the live-index list (which already lists the new slot) through the
  ``decode_attention`` function it is given (the engine passes
  ``jaxkv.pallas.decode_attention`` bound to a backend; default: the jnp
  reference). The model imports no kernels.

Features for retention policies (post-RoPE query rows at chosen chunk indices,
per-key attention mass) are returned in an ``aux`` dict when the static
``Features`` asks for them; the model never knows what a policy does with them.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv import attention as ref_attention
from jaxkv.config import ModelConfig
from jaxkv.rope import apply_rope


@dataclasses.dataclass(frozen=True)
class Features:
    """Static request for auxiliary outputs (hashable: safe as a jit static arg).

    Attributes:
      query_rows: return post-RoPE queries ``q_rows [L, B, R, Hq, D]`` at the chunk
        indices passed as ``q_row_idx_BR``.
      attn_mass: return per-key attention mass ``[L, B, Hq, keys]`` (prefill: keys
        are ``[cached live list..., chunk...]``; decode: the live list).
    """

    query_rows: bool = False
    attn_mass: bool = False


NO_FEATURES = Features()


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32, scaled in the input dtype (as transformers does)."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


def _linear(cfg_dtype, rngs, d_in, d_out, bias):
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=bias,
        dtype=cfg_dtype,
        param_dtype=cfg_dtype,
        kernel_init=nnx.initializers.normal(0.02),
        rngs=rngs,
    )


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        Hq, Hkv, D, M = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = _linear(dtype, rngs, M, Hq * D, cfg.qkv_bias)
        self.k_proj = _linear(dtype, rngs, M, Hkv * D, cfg.qkv_bias)
        self.v_proj = _linear(dtype, rngs, M, Hkv * D, cfg.qkv_bias)
        self.o_proj = _linear(dtype, rngs, Hq * D, M, cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)

    def qkv(self, x_BTM, positions_BT):
        """Post-RoPE queries ``[B,T,Hq,D]``, keys and values ``[B,T,Hkv,D]``."""
        cfg = self.cfg
        B, T, _ = x_BTM.shape
        q = self.q_proj(x_BTM).reshape(B, T, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x_BTM).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x_BTM).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, positions_BT, cfg.rope), apply_rope(k, positions_BT, cfg.rope), v

    def out(self, o_BTHD):
        B, T = o_BTHD.shape[:2]
        return self.o_proj(o_BTHD.reshape(B, T, -1))


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        M, F = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(dtype, rngs, M, F, cfg.mlp_bias)
        self.up_proj = _linear(dtype, rngs, M, F, cfg.mlp_bias)
        self.down_proj = _linear(dtype, rngs, F, M, cfg.mlp_bias)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)


class Transformer(nnx.Module):
    """A Llama / Qwen2 / Qwen3 decoder. Parameters in ``dtype`` (float32 or bfloat16)."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=dtype,
            param_dtype=dtype,
            embedding_init=nnx.initializers.normal(0.02),
            rngs=rngs,
        )
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _linear(dtype, rngs, cfg.hidden_size, cfg.vocab_size, False)

    # -- pieces ----------------------------------------------------------------
    def _logits(self, x_BTM):
        x = self.norm(x_BTM)
        if self.cfg.tie_word_embeddings:
            return self.embed_tokens.attend(x)
        return self.lm_head(x)

    def _run(self, tokens_BT, positions_BT, attend):
        """Shared layer loop; ``attend(layer_index, q, k, v) -> o`` owns the cache."""
        return self.run_layers(self.embed_tokens(tokens_BT), positions_BT, attend)

    def run_layers(self, x_BTM, positions_BT, attend, start: int = 0, stop: int | None = None):
        """Layers ``[start, stop)`` from the residual stream ``x_BTM`` at the input of
        layer ``start``; returns the residual at the input of layer ``stop``. The one
        layer loop: ``_run`` is ``run_layers(embed(tokens), ...)``, and segment reuse
        (``jaxkv.splice``) runs the upper layers from a stored residual."""
        stop = len(self.layers) if stop is None else stop
        x = x_BTM
        for i in range(start, stop):
            layer = self.layers[i]
            with jax.named_scope(f"layer_{i}"):
                h = layer.input_layernorm(x)
                q, k, v = layer.self_attn.qkv(h, positions_BT)
                x = x + layer.self_attn.out(attend(i, q, k, v))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    # -- entry points ------------------------------------------------------------
    def __call__(self, tokens_BT, positions_BT=None):
        """Dense causal forward, no cache. Returns float32 logits ``[B,T,V]``."""
        B, T = tokens_BT.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        x = self._run(tokens_BT, positions_BT, lambda i, q, k, v: ref_attention.causal_attention(q, k, v))
        return self._logits(x).astype(jnp.float32)

    def hidden(self, tokens_BT):
        """Final hidden states ``[B,T,M]`` (before the final norm) of the dense causal
        forward; ``logits(hidden[...])`` at chosen rows is how training skips the
        vocabulary projection of positions that carry no loss."""
        B, T = tokens_BT.shape
        positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        return self._run(tokens_BT, positions_BT, lambda i, q, k, v: ref_attention.causal_attention(q, k, v))

    def logits(self, hidden_XM):
        """Float32 logits ``[..., V]`` of final hidden states (any leading shape)."""
        return self._logits(hidden_XM).astype(jnp.float32)

    def hidden_and_logits(self, tokens_BT):
        """Final hidden states (pre-norm) and logits; used by training and probes."""
        B, T = tokens_BT.shape
        positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        x = self._run(tokens_BT, positions_BT, lambda i, q, k, v: ref_attention.causal_attention(q, k, v))
        return x, self._logits(x).astype(jnp.float32)

    def prefill(
        self,
        tokens_BT,
        positions_BT,
        k_pool_LSKD,
        v_pool_LSKD,
        live_idx_BN,
        live_len_B,
        chunk_len_B,
        write_slots_BT,
        *,
        features: Features = NO_FEATURES,
        q_row_idx_BR=None,
        logits_idx_BY=None,
    ):
        """Chunked prefill through the paged pool.

        Each layer gathers the request's cached live rows from the pool (one gather
        of ``N`` rows, never a copy of the layer), attends, and scatters the chunk's
        K/V to ``write_slots_BT``. Logits are computed only at the chunk indices
        ``logits_idx_BY`` (default: every index), so a prompt pays for one vocabulary
        projection, not ``T``.

        Returns ``(logits [B,Y,V] f32, k_pool, v_pool, aux)``. Padding tokens
        (index >= ``chunk_len_B``) must carry write slot 0 (the sentinel).
        """
        pools = {"k": k_pool_LSKD, "v": v_pool_LSKD}
        aux = {"q_rows": [], "attn_mass": []}

        def attend(i, q, k, v):
            # write first, then read: the chunk's slots are not in the live rows, so
            # the gather reads the same values, and XLA can update the donated pool in
            # place (a gather of the pool before a scatter into it made XLA:CPU copy
            # the whole pool every layer: a prefill step cost O(pool size))
            pools["k"] = pools["k"].at[i, write_slots_BT].set(k.astype(pools["k"].dtype))
            pools["v"] = pools["v"].at[i, write_slots_BT].set(v.astype(pools["v"].dtype))
            o, mass = ref_attention.prefill_attention(
                q,
                k,
                v,
                pools["k"][i, live_idx_BN],
                pools["v"][i, live_idx_BN],
                live_len_B,
                chunk_len_B,
                return_mass=features.attn_mass,
            )
            if features.query_rows:
                aux["q_rows"].append(jnp.take_along_axis(q, q_row_idx_BR[:, :, None, None], axis=1))
            if features.attn_mass:
                aux["attn_mass"].append(mass)
            return o

        x = self._run(tokens_BT, positions_BT, attend)
        if logits_idx_BY is not None:
            x = jnp.take_along_axis(x, logits_idx_BY[:, :, None], axis=1)
        return self._logits(x).astype(jnp.float32), pools["k"], pools["v"], _stack_aux(aux)

    def decode(
        self,
        tokens_B,
        positions_B,
        k_pool_LSKD,
        v_pool_LSKD,
        live_idx_BN,
        live_len_B,
        write_slots_B,
        *,
        features: Features = NO_FEATURES,
        decode_attention=ref_attention.decode_attention_reference,
        window: DecodeWindow | None = None,
    ):
        """One decode step. ``live_idx_BN[:live_len]`` must already list the new slot.

        ``decode_attention(q_BHD, k_pool_SKD, v_pool_SKD, live_idx_BN, live_len_B)
        -> out_BHD`` reads one layer of the pool. Returns ``(logits [B,V] f32, k_pool, v_pool, aux)``.

        With a ``window`` (``DecodeWindow``) the step reads no pool rows: it writes
        its new K/V to the pool and to the window's new rows at ``window.step``,
        and attends over the window's two parts (``decode_attention_two_parts``).
        The updated window is ``aux["window"]``; ``aux["attn_mass"]`` is still per
        live-list entry ``[L, B, Hq, N]``.
        """
        pools = {"k": k_pool_LSKD, "v": v_pool_LSKD}
        aux = {"q_rows": [], "attn_mass": []}
        if window is not None:
            new_rows = {"k": list(window.k_new), "v": list(window.v_new)}
            B, N = live_idx_BN.shape
            len_new_B = jnp.full((B,), window.step + 1, jnp.int32)
            new_at_BT = jnp.minimum(window.len_B[:, None] + jnp.arange(window.k_new[0].shape[1])[None, :], N - 1)

        def attend(i, q, k, v):
            pools["k"] = pools["k"].at[i, write_slots_B].set(k[:, 0].astype(pools["k"].dtype))
            pools["v"] = pools["v"].at[i, write_slots_B].set(v[:, 0].astype(pools["v"].dtype))
            if window is not None:
                for name, x in (("k", k), ("v", v)):
                    new_rows[name][i] = new_rows[name][i].at[:, window.step].set(x[:, 0].astype(new_rows[name][i].dtype))
                out = ref_attention.decode_attention_two_parts(
                    q[:, 0], window.k[i], window.v[i], window.len_B, new_rows["k"][i], new_rows["v"][i], len_new_B,
                    return_probs=features.attn_mass,
                )
                if features.attn_mass:  # back to live-list order: new row t is entry len_B + t
                    o, (p_old, p_new) = out
                    p_BHN = jnp.pad(p_old, ((0, 0), (0, 0), (0, N - p_old.shape[-1])))
                    p_BHN = jax.vmap(lambda p, at, add: p.at[:, at].add(add))(p_BHN, new_at_BT, p_new)
                    out = (o, p_BHN)
            elif features.attn_mass:
                out = ref_attention.decode_attention_reference(
                    q[:, 0], pools["k"][i], pools["v"][i], live_idx_BN, live_len_B, return_probs=True
                )
            else:
                out = decode_attention(q[:, 0], pools["k"][i], pools["v"][i], live_idx_BN, live_len_B)
            o = out
            if features.attn_mass:
                o, probs = out
                aux["attn_mass"].append(probs)
            if features.query_rows:
                aux["q_rows"].append(q)
            return o[:, None]

        x = self._run(tokens_B[:, None], positions_B[:, None], attend)
        aux = _stack_aux(aux)
        if window is not None:
            aux["window"] = window._replace(k_new=tuple(new_rows["k"]), v_new=tuple(new_rows["v"]))
        return self._logits(x)[:, 0].astype(jnp.float32), pools["k"], pools["v"], aux


class DecodeWindow(NamedTuple):
    """What a decode chunk reads instead of the pool (``Transformer.decode``).

    ``k``/``v``: per layer, each row's live K/V rows in list order, gathered once
    before the chunk and read-only in it, head-major (keys ``[B, Hkv, D, W]``,
    values ``[B, Hkv, W, D]``, see ``decode_attention_two_parts``); the first
    ``len_B`` are real. ``k_new``/``v_new``: per layer ``[B, T, Hkv, D]``, the rows the
    chunk's steps write, step ``s`` at index ``s``; ``step`` is the current one.
    One array per layer, not one ``[L, ...]`` array: XLA:CPU then updates each in
    place inside the loop. Live-list entry ``len_B + s`` is new row ``s``.
    """

    k: tuple
    v: tuple
    len_B: jax.Array
    k_new: tuple
    v_new: tuple
    step: jax.Array


def _stack_aux(aux):
    return {name: jnp.stack(rows) for name, rows in aux.items() if rows}
