"""The decoder shared by Llama, Qwen2 and Qwen3 (Flax NNX).

Family differences are config flags (``ModelConfig.qkv_bias``, ``o_bias``,
``mlp_bias``, ``qk_norm``, ``tie_word_embeddings``); attribute names mirror the HF
parameter names so ``weights.py`` maps checkpoints mechanically.

Shape letters: B batch, T tokens in the chunk, M model width, F MLP width,
Hq / Hkv query / KV heads (K in einsums), D head dim, V vocab, N live-list length,
S pool slots, L layers, R captured query rows.

Two ways to run the same weights:

* ``model(tokens_BT)``: dense causal forward with no cache (``score_logits``, training).
* ``model.run_layers(x, positions, attend, carry)``: the layer loop (a scan over
  the stacked layer weights) with attention given as a function ``attend(layer,
  q, k, v, carry) -> (o, carry, out)`` that owns the cache. The engine's step
  (``jaxkv.forward``) passes one that writes the layer's K/V into the paged pool (the
  carry) and runs the ragged paged attention; segment reuse (``jaxkv.splice``) one
  that reads spliced rows. The model imports no kernels and knows no cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv import attention as ref_attention
from jaxkv.config import ModelConfig
from jaxkv.rope import apply_rope


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32, scaled in the input dtype (as transformers does)."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


def _accumulation(dtype):
    """The accumulation dtype of a product of ``dtype`` weights: float32 for bfloat16
    (``Linear``), the default otherwise."""
    return jnp.float32 if jnp.dtype(dtype) == jnp.bfloat16 else None


class Linear(nnx.Linear):
    """``nnx.Linear`` whose bfloat16 products accumulate in float32 and round once to
    bfloat16 at the end, as a GPU's or PyTorch's bfloat16 matmul does. On XLA:CPU this
    is also what reaches the host's bfloat16 matrix units (AMX): a bfloat16-in,
    bfloat16-out product runs below float32's rate there, one accumulated in float32
    at 2.8x it at 512 rows (``eval/profile/bf16_dot.py``). Float32 weights are
    untouched (the same product, bit for bit)."""

    def __init__(self, d_in, d_out, *, dtype, **kw):
        super().__init__(d_in, d_out, dtype=dtype, param_dtype=dtype, preferred_element_type=_accumulation(dtype), **kw)

    def __call__(self, x):
        return super().__call__(x).astype(self.dtype)


def _linear(cfg_dtype, rngs, d_in, d_out, bias):
    return Linear(d_in, d_out, use_bias=bias, dtype=cfg_dtype, kernel_init=nnx.initializers.normal(0.02), rngs=rngs)


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


def _stacked_layers(cfg: ModelConfig, dtype, rngs: nnx.Rngs) -> DecoderLayer:
    """``cfg.num_layers`` decoder layers as one module whose every weight has a
    leading layer axis ``[L, ...]`` (``nnx.vmap`` over the layer constructor)."""

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return DecoderLayer(cfg, dtype, rngs)

    return make(rngs)


def _causal(i, q, k, v, carry):
    """``attend`` of the dense forward: causal attention within the batch, no cache."""
    return ref_attention.causal_attention(q, k, v), carry, None


class Transformer(nnx.Module):
    """A Llama / Qwen2 / Qwen3 decoder. Parameters in ``dtype`` (float32 or bfloat16);
    the decoder layers' weights are stacked ``[L, ...]`` (``run_layers``)."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, embedding_init=nnx.initializers.normal(0.02), rngs=rngs
        )
        self.layers = _stacked_layers(cfg, dtype, rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _linear(dtype, rngs, cfg.hidden_size, cfg.vocab_size, False)

    # -- pieces ----------------------------------------------------------------
    def _logits(self, x_BTM):
        x = self.norm(x_BTM)
        if self.cfg.tie_word_embeddings:
            table = self.embed_tokens.embedding[...]
            return jnp.dot(x.astype(table.dtype), table.T, preferred_element_type=_accumulation(table.dtype)).astype(table.dtype)
        return self.lm_head(x)

    def _run(self, tokens_BT, positions_BT, attend=None):
        """The layer loop from the embedding with ``attend`` (``run_layers``'s; default:
        causal attention within the batch, no cache); the final residual."""
        x, _, _ = self.run_layers(self.embed_tokens(tokens_BT), positions_BT, attend or _causal)
        return x

    def layer(self, i) -> DecoderLayer:
        """Layer ``i`` (a static or traced index) as a module of its own weights."""
        graphdef, state = nnx.split(self.layers)
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))

    def run_layers(self, x_BTM, positions_BT, attend, carry=None, start: int = 0, stop: int | None = None):
        """Layers ``[start, stop)`` from the residual stream ``x_BTM`` at the input of
        layer ``start``: the one layer loop, a ``lax.scan`` over the stacked layer
        weights, so a program holds one copy of the layer however deep the model
        (compile time and program size do not grow with the layer count).

        ``attend(i, q, k, v, carry) -> (o, carry, out)`` owns whatever attention
        reads and writes (``i`` is the traced layer index): ``carry`` flows from
        layer to layer (the engine's KV pool), ``out`` is stacked over the layers
        (captured query rows). Returns ``(x at the input of layer stop, carry,
        outs [stop - start, ...])``. The engine's forward (``jaxkv.forward``) and segment
        reuse (``jaxkv.splice``, from a stored residual) run their layers here."""
        L = self.cfg.num_layers
        stop = L if stop is None else stop
        graphdef, state = nnx.split(self.layers)
        if (start, stop) != (0, L):
            state = jax.tree.map(lambda a: a[start:stop], state)

        def body(c, xs):
            x, carry = c
            layer_state, i = xs
            layer = nnx.merge(graphdef, layer_state)
            h = layer.input_layernorm(x)
            q, k, v = layer.self_attn.qkv(h, positions_BT)
            o, carry, out = attend(i, q, k, v, carry)
            x = x + layer.self_attn.out(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            return (x, carry), out

        (x, carry), outs = jax.lax.scan(body, (x_BTM, carry), (state, jnp.arange(start, stop, dtype=jnp.int32)))
        return x, carry, outs

    def unstacked_layers(self) -> list:
        """Every layer as a module of its own arrays (copies of the stacked
        weights): ``run_layers_unrolled``'s input. A program that runs many
        one-token steps takes them once, outside its step loop: inside
        ``run_layers``' scan, XLA:CPU copies each layer's weight slice every
        iteration, which for one token per row costs more than the layer's
        GEMVs themselves."""
        graphdef, state = nnx.split(self.layers)
        return [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state)) for i in range(self.cfg.num_layers)]

    def run_layers_unrolled(self, x_BTM, positions_BT, attend, carry, layers: list):
        """``run_layers`` over every layer, unrolled over ``layers``
        (``unstacked_layers``): ``attend`` gets the layer index as a Python int, so
        per-layer arrays it carries are updated in place. Returns ``(x, carry,
        outs)`` as ``run_layers`` (``outs`` stacked, or None)."""
        outs = []
        for i, layer in enumerate(layers):
            h = layer.input_layernorm(x_BTM)
            q, k, v = layer.self_attn.qkv(h, positions_BT)
            o, carry, out = attend(i, q, k, v, carry)
            x_BTM = x_BTM + layer.self_attn.out(o)
            x_BTM = x_BTM + layer.mlp(layer.post_attention_layernorm(x_BTM))
            outs.append(out)
        return x_BTM, carry, (None if outs[0] is None else jnp.stack(outs))

    # -- entry points ------------------------------------------------------------
    def __call__(self, tokens_BT, positions_BT=None):
        """Dense causal forward, no cache. Returns float32 logits ``[B,T,V]``."""
        B, T = tokens_BT.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        x = self._run(tokens_BT, positions_BT, _causal)
        return self._logits(x).astype(jnp.float32)

    def hidden(self, tokens_BT):
        """Final hidden states ``[B,T,M]`` (before the final norm) of the dense causal
        forward; ``logits(hidden[...])`` at chosen rows is how training skips the
        vocabulary projection of positions that carry no loss."""
        B, T = tokens_BT.shape
        positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        return self._run(tokens_BT, positions_BT, _causal)

    def logits(self, hidden_XM):
        """Float32 logits ``[..., V]`` of final hidden states (any leading shape)."""
        return self._logits(hidden_XM).astype(jnp.float32)

    def hidden_and_logits(self, tokens_BT):
        """Final hidden states (pre-norm) and logits; used by training and probes."""
        B, T = tokens_BT.shape
        positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        x = self._run(tokens_BT, positions_BT, _causal)
        return x, self._logits(x).astype(jnp.float32)
