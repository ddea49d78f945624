"""What each part of the INT3 page format and its write rule costs, on SmolLM2's own agent traffic (issue 74).

    JAX_PLATFORMS=cpu python -m eval.quality.int3_format_study --n 8 --out eval/results/triaxial/int3_study

Why: the compact INT3 pages (``jaxkv.kernels.quant3``: one-byte scale codes on a
2^(1/8) grid rounded up, int8 zero points, values in groups of 64) with the
rewrite rule lose +0.079 nats/token rotated on the agent traces, where INT3 pages
with float16 parameters (values in groups of 32, replies INT4, no rewrite) lost
+0.026. Those runs differ in five ways at once; this study separates them without
the serving harness: one float prefill per trace, then the reply per variant.

What it measures. ``--n`` agent traces of the calibration seed
(``train.calibrate_triaxial.CALIBRATION_SEED``, disjoint from the 24 evaluation
traces), rendered for the model's template. The last scored turn's prompt is
written as the harness writes it (``write_plan``, the rule of
``train.calibrate_triaxial.written_codes`` turn by turn): each turn's prefilled
tokens whose tag gets 3 bits fill INT3 pages of 32 in position order, the
leftovers and every other tag INT4, each earlier reply INT4 as decode writes it;
with the rewrite rule a turn first moves the earlier turns' INT4 tokens with a
3-bit tag into whole INT3 pages in position order (requantized from their INT4
values: a double quantization, or, ``direct``, from the float values). Then the
imported-prefill protocol (KIVI's, ``eval.quality.real_model --quant-prefill
imported``): one float forward of the prompt captures every layer's K/V, each
variant stores them as written (its round trips), and the reply's tokens (from the
last prompt token on) run through every layer over the stored prompt K/V and over
themselves in float (the teacher-forced chunk attends to itself in full
precision), with or without the pool's rotation (``jaxkv.cache.rotation``:
quantized as ``x·R``, read back as ``x̂·Rᵀ``). Unlike the harness's chunked
prefill, a turn's prompt tokens do not see the earlier turns' quantized K/V, so
the error does not propagate through the prompt; the numbers rank variants, they
are not the harness's. Reported per variant, against the float forward on the same tokens: the reply's
NLL increase (nats/token, token-weighted over traces; a paired bootstrap 95%
interval over traces) and KL(float ‖ variant) per token, with the stored bits of
the final prompt's KV (codes, every scale and zero point; INT4 5 bits).

The INT3 page format is modelled here with options (``Fmt``), so that each
variant differs from the served one in one respect; ``Fmt()`` reproduces
``jaxkv.kernels.quant3.pages3_round_trip`` to float32 rounding (checked at start):

* ``params``: ``byte`` (a one-byte scale code and a one-byte zero point per
  group) or ``f16`` (``jaxkv.kernels.quant._fit``'s float16 scale and zero);
* ``vgroup``: channels per value group (32 or 64);
* ``scale``: how a group's scale code is chosen: ``up`` (the smallest grid entry
  that covers the group), ``nearest`` (the grid entry nearest the range / 7 in
  log, the codes clipped where it is smaller), ``mse`` (of the codes ``up``,
  ``up - 1``, ``up - 2`` and zero points ``round(min / scale) + {-1, 0, 1}``,
  the pair with the least squared error over the group: the same bytes; ties go
  to the earlier pair, the zero points in the order 0, -1, +1 as ``quant3``'s
  ``fit="mse"`` tries them; ``quant3`` now searches one code below the cover,
  ``mse_steps=1``, since ``eval/results/triaxial/int3_fit``);
* ``steps``: grid entries per octave (8: ``2^((s - 128)/8)``; 16:
  ``2^((s - 160)/16)``, from 2^-10 to 2^6);
* ``zero``: ``int8`` (in units of the scale) or ``f16`` (a float16 zero rounded
  down, 3 bytes per group);
* writer-only fits of the same bytes (``eval/results/triaxial/int3_fit``):
  ``mse_steps`` / ``mse_offsets`` widen the mse search (scale codes ``up`` to
  ``up - mse_steps``, zero points ``round(min / scale) + {-mse_offsets ..
  mse_offsets}``); ``refine`` rounds of least squares on the chosen codes (``x ~ z
  + c s`` in closed form, ``s`` snapped to the two grid entries around it, ``z`` to
  the zero points around ``z / s``, kept where the group's squared error falls);
  ``keys`` a different scale rule for the keys than for the values; ``power`` the
  search's error, ``sum |x - x_hat| ** power`` (2 the squared error; larger
  between it and the covering fit's worst case);
* ``levels``: a non-uniform 3-bit code (code ``c`` means ``levels[c]`` steps above
  the zero, nearest level written; ``LLOYD_MAX_3`` the Gaussian's Lloyd-Max levels
  with the ends at 0 and 7): a reader change, modelled here only.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.markdown import md_table

PAGE = 32
REPLY_TAGS = ("ASSISTANT", "REASONING", "TOOL_CALL")


@dataclasses.dataclass(frozen=True)
class Fmt:
    """An INT3 page format (module docstring); the default is ``quant3``'s."""

    params: str = "byte"
    vgroup: int = 64
    scale: str = "up"
    steps: int = 8
    zero: str = "int8"
    mse_steps: int = 2  # the mse search: scale codes ``up`` .. ``up - mse_steps``
    mse_offsets: int = 1  # and zero points ``round(min / scale) + {-mse_offsets .. mse_offsets}``
    refine: int = 0  # rounds of least-squares refinement of (scale, zero) on the chosen codes, snapped to the grid
    keys: str = ""  # the keys' scale rule where it differs from ``scale`` (values keep ``scale``)
    power: int = 2  # the mse search's error: the sum of |x - x_hat| ** power over the group (2: squared)
    levels: tuple = ()  # a non-uniform code: code c means ``levels[c]`` steps above the zero (8 sorted values in [0, 7]); () uniform

    def page_bits(self, D: int) -> float:
        """Stored bits per element of an INT3 page token, K and V averaged."""
        per_group = 32 if self.params == "f16" else (24 if self.zero == "f16" else 16)
        return 3 + 0.5 * (per_group / PAGE + per_group / self.vgroup)


@dataclasses.dataclass(frozen=True)
class Rule:
    """The write rule: reply tags' bits, the rewrite rule, and whether rewritten
    tokens are quantized from their INT4 values (``double``) or from float."""

    reply_bits: int = 3
    rewrite: bool = True
    double: bool = True
    sink: int = 0  # leading tokens out of the pages (the attention sink): in float, or INT4 with ``sink_int4``
    sink_int4: bool = False


def _grid(fmt: Fmt):
    centre = 128 if fmt.steps == 8 else 160
    return np.asarray(2.0 ** ((np.arange(256) - centre) / fmt.steps), np.float32)


def fit_byte(x, axis: int, fmt: Fmt, rule: str | None = None):
    """``x`` round-tripped with one-byte parameters per group along ``axis`` (``fmt``;
    ``rule`` the scale rule, ``fmt.scale`` by default)."""
    from jaxkv.kernels.quant import _round_f16

    rule = rule or fmt.scale
    x = x.astype(jnp.float32)
    table = jnp.asarray(_grid(fmt))
    lo = jnp.min(x, axis=axis, keepdims=True)
    hi = jnp.max(x, axis=axis, keepdims=True)
    if fmt.zero == "f16":
        z = _round_f16(lo, -jnp.inf).astype(jnp.float32)
        need = (hi - z) / 7.0
    else:
        need = jnp.maximum((hi - lo) * (1.0 / 7), jnp.abs(lo) * (1.0 / 127))
    up = jnp.clip(jnp.searchsorted(table, need, side="left"), 0, 255)

    def trip(s_code, o):
        """(values, codes) of scale code ``s_code`` and int8 zero point ``o`` (f16 zero: ``o`` unused)."""
        scale = table[jnp.clip(s_code, 0, 255)]
        div = jax.lax.optimization_barrier(jnp.broadcast_to(scale, x.shape))
        if fmt.zero == "f16":
            c = jnp.clip(jnp.round((x - z) / div), 0, 7)
            return z + c * scale, c
        if fmt.levels:  # the nearest level: thresholds at the midpoints between levels
            u = x / div - o
            mids = [(a + b) / 2 for a, b in zip(fmt.levels[:-1], fmt.levels[1:])]
            c = sum((u > m).astype(jnp.float32) for m in mids)
            return o * scale + jnp.asarray(fmt.levels, jnp.float32)[c.astype(jnp.int32)] * scale, c
        c = jnp.clip(jnp.round(x / div - o), 0, 7)
        return o * scale + c * scale, c  # quant3's float32 order

    def zero(s_code, shift):
        return jnp.clip(jnp.round(lo / table[jnp.clip(s_code, 0, 255)]) + shift, -127, 127)

    if rule == "up":
        return trip(up, zero(up, 0))[0]
    if rule == "nearest":
        exact = jnp.log2(jnp.maximum(need, 1e-30)) * fmt.steps + (128 if fmt.steps == 8 else 160)
        s = jnp.clip(jnp.round(exact), 0, 255).astype(up.dtype)
        return trip(s, zero(s, 0))[0]
    best = None  # (err, values, codes)

    def consider(best, s_code, o):
        y, c = trip(s_code, o)
        err = jnp.sum(jnp.abs(y - x) ** fmt.power, axis=axis, keepdims=True)
        if best is None:
            return err, y, c
        take = err < best[0]
        return jnp.where(take, err, best[0]), jnp.where(take, y, best[1]), jnp.where(take, c, best[2])

    offsets = sorted(range(-fmt.mse_offsets, fmt.mse_offsets + 1), key=abs)
    for ds in range(fmt.mse_steps + 1):
        for do in (0,) if fmt.zero == "f16" else offsets:
            best = consider(best, up - ds, zero(up - ds, do))
    for _ in range(fmt.refine):  # least squares on the chosen codes: x ~ z + c s, snapped to the grid
        c = best[2]
        cm, xm = jnp.mean(c, axis=axis, keepdims=True), jnp.mean(x, axis=axis, keepdims=True)
        var = jnp.mean((c - cm) ** 2, axis=axis, keepdims=True)
        s_ls = jnp.where(var > 0, jnp.mean((c - cm) * (x - xm), axis=axis, keepdims=True) / jnp.where(var > 0, var, 1.0), need)
        z_ls = xm - s_ls * cm
        s_exact = jnp.log2(jnp.maximum(s_ls, 1e-30)) * fmt.steps + (128 if fmt.steps == 8 else 160)
        for s_code in (jnp.floor(s_exact), jnp.ceil(s_exact)):
            s_code = jnp.clip(s_code, 0, 255).astype(up.dtype)
            base = jnp.round(z_ls / table[s_code])
            for do in (0, -1, 1):
                best = consider(best, s_code, jnp.clip(base + do, -127, 127))
    return best[1]


def pages_round_trip(k_TKD, v_TKD, fmt: Fmt):
    """``T = 32 Q`` tokens through INT3 pages of ``fmt`` and back (float32)."""
    from jaxkv.kernels.quant import _fit, _pages, _tokens

    D = k_TKD.shape[-1]
    kp, vp = _pages(k_TKD.astype(jnp.float32)), _pages(v_TKD.astype(jnp.float32))  # [Q, K, 32, D]
    vg = vp.reshape(*vp.shape[:-1], D // fmt.vgroup, fmt.vgroup)
    if fmt.params == "f16":

        def f16(x, axis):
            codes, scale, zero = _fit(x, axis, 3)
            s, z = jnp.expand_dims(scale.astype(jnp.float32), axis), jnp.expand_dims(zero.astype(jnp.float32), axis)
            return z + codes.astype(jnp.float32) * s

        k_hat, v_hat = f16(kp, 2), f16(vg, -1)
    else:
        k_hat, v_hat = fit_byte(kp, 2, fmt, fmt.keys or None), fit_byte(vg, -1, fmt)
    return _tokens(k_hat), _tokens(v_hat.reshape(vp.shape))


def check_model_matches_quant3(seed: int = 0) -> None:
    """``Fmt()`` is the served format: ``quant3.pages3_round_trip``'s values to float32
    rounding (the programs fuse differently: a few ulps, never a code step)."""
    from jaxkv.kernels.quant3 import pages3_round_trip

    rng = np.random.default_rng(seed)
    k = jnp.asarray(rng.standard_normal((64, 3, 64)) * np.array([1.0] * 60 + [9.0, 0.1, 3.0, 20.0]) + 0.5, jnp.float32)
    v = jnp.asarray(rng.standard_normal((64, 3, 64)) * 0.3, jnp.float32)
    ref, got = pages3_round_trip(k, v), pages_round_trip(k, v, Fmt())
    for a, b in zip(ref, got):
        if not np.allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6):
            raise AssertionError("the study's Fmt() does not reproduce quant3's INT3 pages")


# ------------------------------------------------------------------ the write plan
def write_plan(tokenizer, example, rule: Rule):
    """``(ids, T0, kind [T0], pages)`` for the last scored turn: ``ids`` prompt +
    reply (the prompt's ``T0`` tokens first); per prompt position ``kind`` 4 (INT4)
    or 3 (in an INT3 page); ``pages`` a list of ``(positions [32], double, keep
    [32])``: a page's tokens in position order, whether it was quantized from their
    INT4 values (the rewrite rule's double quantization), and which of its tokens
    the final prompt still holds (a later turn's prefill from an earlier position
    replaces the rest; module docstring)."""
    from jaxkv.cache.radix import common_prefix_length
    from jaxkv.chat import render
    from jaxkv.chat.tags import Semantic

    msgs, tools = example.messages, example.tools or None
    last = max(t.message_index for t in example.targets)
    turns = [j for j, m in enumerate(msgs) if m.get("role") == "assistant" and j <= last]
    final = render(tokenizer, msgs[:last], tools, add_generation_prompt=True)
    full = render(tokenizer, msgs[: last + 1], tools, add_generation_prompt=False)
    T0 = final.ids.size
    if not np.array_equal(full.ids[:T0], final.ids):
        raise ValueError("the reply's rendering does not extend its prompt")
    reply_sem = [int(getattr(Semantic, n)) for n in REPLY_TAGS]
    kind = np.zeros(T0, np.int8)
    owner = np.full(T0, -1)
    pages = []

    def add(positions, double):
        owner[positions] = len(pages)
        kind[positions] = 3
        pages.append((positions, double))

    cached = None
    for j in turns:
        prompt = render(tokenizer, msgs[:j], tools, add_generation_prompt=True)
        bits = np.where(np.isin(prompt.triaxial["semantic"], reply_sem), rule.reply_bits, 3)
        start = 0 if cached is None else min(common_prefix_length(cached, prompt.ids), prompt.ids.size - 1)
        end = min(prompt.ids.size, T0)
        kind[start:], owner[start:] = 0, -1
        if rule.rewrite and start:  # the history's INT4 tokens with a 3-bit tag, whole pages in position order
            hist = np.flatnonzero((kind[:start] == 4) & (bits[:start] == 3) & (np.arange(start) >= rule.sink))
            for p in hist[: hist.size // PAGE * PAGE].reshape(-1, PAGE):
                add(p, rule.double)
        seg = np.arange(start, end)
        kind[seg] = np.where(seg < rule.sink, 4 if rule.sink_int4 else 1, 4)
        three = seg[(bits[start:end] == 3) & (seg >= rule.sink)]
        for p in three[: three.size // PAGE * PAGE].reshape(-1, PAGE):
            add(p, False)
        cached = render(tokenizer, msgs[: j + 1], tools, add_generation_prompt=False).ids
        kind[prompt.ids.size : min(cached.size, T0)] = 4  # the reply, as decode writes it
    assert (kind > 0).all()
    out = [(p, d, owner[p] == i) for i, (p, d) in enumerate(pages)]
    assert sum(int(k.sum()) for _, _, k in out) == int((kind == 3).sum())
    return full.ids.astype(np.int32), T0, kind, [x for x in out if x[2].any()]


# ------------------------------------------------------------------ the forward
def _idx(pages, Q, double):
    idx = np.zeros((Q, PAGE), np.int32)
    keep = np.zeros((Q, PAGE), bool)
    for i, (p, _, k) in enumerate(x for x in pages if x[1] == double):
        idx[i], keep[i] = p, k
    return jnp.asarray(idx), jnp.asarray(keep)


@functools.partial(jax.jit, static_argnames=("fmt", "rotate"))
def stored_kv(k_LTKD, v_LTKD, int4_T, groups, R, fmt, rotate):
    """Every layer's prompt K/V as the pool would read them back: INT4 rows where
    ``int4_T``, INT3 pages of ``fmt`` over ``groups`` (direct, then from the INT4
    values), float elsewhere; rotated by ``R`` before and back after with ``rotate``."""
    from jaxkv.kernels.quant import dequantize_rows, quantize_rows

    T = k_LTKD.shape[1]

    def layer(args):
        k0, v0, Ri = args
        if rotate:
            k0, v0 = jnp.einsum("tkd,kde->tke", k0, Ri), jnp.einsum("tkd,kde->tke", v0, Ri)
        k4, v4 = dequantize_rows(quantize_rows(k0, 4)), dequantize_rows(quantize_rows(v0, 4))
        kh = jnp.where(int4_T[:, None, None], k4, k0)
        vh = jnp.where(int4_T[:, None, None], v4, v0)
        for (idx, keep), (ks, vs) in zip(groups, ((k0, v0), (k4, v4))):
            flat = idx.reshape(-1)
            dst = jnp.where(keep.reshape(-1), flat, T)
            kp, vp = pages_round_trip(ks[flat], vs[flat], fmt)
            kh, vh = kh.at[dst].set(kp, mode="drop"), vh.at[dst].set(vp, mode="drop")
        if rotate:
            kh, vh = jnp.einsum("tke,kde->tkd", kh, Ri), jnp.einsum("tke,kde->tkd", vh, Ri)
        return kh, vh

    return jax.lax.map(layer, (k_LTKD, v_LTKD, R))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def reply_logprobs(graphdef, params, reply_R, T0, k_LTKD, v_LTKD):
    """Log-probabilities ``[R - 1, V]`` of ``reply_R[1:]``: the reply's tokens (the
    first is the last prompt token, at position ``T0 - 1``, whose K/V it recomputes)
    run through every layer over the stored prompt K/V ``[L, Tp, K, D]`` (positions
    below ``T0 - 1`` visible) and causally over themselves, in float."""
    from flax import nnx

    model = nnx.merge(graphdef, params)
    Rn, Tp = reply_R.size, k_LTKD.shape[1]
    pos = T0 - 1 + jnp.arange(Rn, dtype=jnp.int32)
    visible = jnp.concatenate(
        [jnp.broadcast_to(jnp.arange(Tp)[None] < T0 - 1, (Rn, Tp)), jnp.arange(Rn)[None, :] <= jnp.arange(Rn)[:, None]], axis=1
    )

    def attend(i, q, k, v, carry):
        K = k.shape[2]
        kk = jnp.concatenate([k_LTKD[i][None].astype(k.dtype), k], axis=1)[0]
        vv = jnp.concatenate([v_LTKD[i][None].astype(v.dtype), v], axis=1)[0]
        qg = q[0].reshape(Rn, K, q.shape[2] // K, q.shape[3])
        s = jnp.einsum("rkgd,tkd->kgrt", qg, kk) / jnp.sqrt(jnp.float32(q.shape[3]))
        p = jax.nn.softmax(jnp.where(visible[None, None], s, -jnp.inf), axis=-1)
        o = jnp.einsum("kgrt,tkd->rkgd", p, vv).reshape(q.shape)
        return o, carry, None

    x, _, _ = model.run_layers(model.embed_tokens(reply_R[None]), pos[None], attend)
    return jax.nn.log_softmax(model.logits(x[0, :-1]), -1)


def quantized_forward(model, ids, T0, kind, pages, fmt: Fmt | None, R, rotate: bool, cap):
    """Log-probabilities ``[T - T0, V]`` of the reply's tokens: the float prefill's
    K/V (``cap``: ``capture``'s k, v of the padded prompt) stored as written (``fmt``
    None: float), then the reply over them (the imported-prefill protocol)."""
    k, v = cap
    Tp = k.shape[1]
    if fmt is not None:
        int4 = jnp.asarray(np.r_[kind == 4, np.zeros(Tp - T0, bool)])
        k, v = stored_kv(k, v, int4, (_idx(pages, Tp // PAGE, False), _idx(pages, Tp // PAGE, True)), jnp.asarray(R), fmt, rotate)
    graphdef, params = model.split()
    reply = np.zeros(-(-(ids.size - T0 + 1) // 64) * 64, np.int32)  # padded: one program per length bucket
    reply[: ids.size - T0 + 1] = ids[T0 - 1 :]
    return reply_logprobs(graphdef, params, jnp.asarray(reply), T0, k, v)[: ids.size - T0]


# the 8-level Lloyd-Max quantizer of a unit Gaussian (+-0.2451, +-0.7560, +-1.3439, +-2.1519), its ends at 0 and 7 steps
LLOYD_MAX_3 = tuple(round(float((l + 2.1519) / 4.3038 * 7), 4) for l in (-2.1519, -1.3439, -0.7560, -0.2451, 0.2451, 0.7560, 1.3439, 2.1519))

VARIANTS = {
    # name: (Fmt, Rule)
    "f16_v32, replies INT4, no rewrite (the 4.17-bit cell)": (Fmt(params="f16", vgroup=32), Rule(4, False)),
    "f16_v32, replies INT3, rewrite": (Fmt(params="f16", vgroup=32), Rule(3, True)),
    "served: byte_v64 up, replies INT3, rewrite (the 3.43-bit cell)": (Fmt(), Rule(3, True)),
    "served format, rewrite direct (no INT4 first)": (Fmt(), Rule(3, True, False)),
    "served format, replies INT4": (Fmt(), Rule(4, True)),
    "f16_v64": (Fmt(params="f16", vgroup=64), Rule(3, True)),
    "byte_v32": (Fmt(vgroup=32), Rule(3, True)),
    "byte_v64 mse": (Fmt(scale="mse"), Rule(3, True)),
    "byte_v64 16 steps/octave": (Fmt(steps=16), Rule(3, True)),
    "byte_v64 f16 zero": (Fmt(zero="f16"), Rule(3, True)),
    "served format, token 0 float": (Fmt(), Rule(3, True, sink=1)),
    "served format, token 0 INT4": (Fmt(), Rule(3, True, sink=1, sink_int4=True)),
    "token 0 INT4, mse": (Fmt(scale="mse"), Rule(3, True, sink=1, sink_int4=True)),
    "token 0 INT4, 16 steps/octave": (Fmt(steps=16), Rule(3, True, sink=1, sink_int4=True)),
    "token 0 INT4, mse, 16 steps/octave": (Fmt(scale="mse", steps=16), Rule(3, True, sink=1, sink_int4=True)),
    "tokens 0-31 INT4": (Fmt(), Rule(3, True, sink=32, sink_int4=True)),
    "token 0 INT4, rewrite direct": (Fmt(), Rule(3, True, False, sink=1, sink_int4=True)),
    "token 0 INT4, f16 zero": (Fmt(zero="f16"), Rule(3, True, sink=1, sink_int4=True)),
    "token 0 INT4, byte_v32": (Fmt(vgroup=32), Rule(3, True, sink=1, sink_int4=True)),
    # int3_fit: writer-only fits of the same bytes on top of the rotated pool's rule (position 0 INT4, mse); "served"
    # names the fit served when they ran (two codes below the cover); quant3 serves "sink1 mse 1 step" since
    "sink1 mse (served: 2 steps, offsets +-1)": (Fmt(scale="mse"), Rule(3, True, sink=1, sink_int4=True)),
    "sink1 up (served unrotated)": (Fmt(), Rule(3, True, sink=1, sink_int4=True)),
    "sink1 Lloyd-Max levels, mse 4 steps, offsets +-2": (
        Fmt(scale="mse", mse_steps=4, mse_offsets=2, levels=LLOYD_MAX_3),
        Rule(3, True, sink=1, sink_int4=True),
    ),
    "sink1 Lloyd-Max levels, up": (Fmt(levels=LLOYD_MAX_3), Rule(3, True, sink=1, sink_int4=True)),
    "sink1 mse 1 step": (Fmt(scale="mse", mse_steps=1), Rule(3, True, sink=1, sink_int4=True)),
    "sink1 mse 3 steps": (Fmt(scale="mse", mse_steps=3), Rule(3, True, sink=1, sink_int4=True)),
    "sink1 mse |e|^4, 2 steps": (Fmt(scale="mse", power=4), Rule(3, True, sink=1, sink_int4=True)),
    "sink1 mse |e|^4, 4 steps, offsets +-2": (Fmt(scale="mse", mse_steps=4, mse_offsets=2, power=4), Rule(3, True, sink=1, sink_int4=True)),
    "sink1 mse 4 steps, offsets +-2": (Fmt(scale="mse", mse_steps=4, mse_offsets=2), Rule(3, True, sink=1, sink_int4=True)),
    "sink1 mse 6 steps, offsets +-3": (Fmt(scale="mse", mse_steps=6, mse_offsets=3), Rule(3, True, sink=1, sink_int4=True)),
    "sink1 mse 2 steps, 2 LS rounds": (Fmt(scale="mse", refine=2), Rule(3, True, sink=1, sink_int4=True)),
    "sink1 mse 4 steps, offsets +-2, 2 LS rounds": (Fmt(scale="mse", mse_steps=4, mse_offsets=2, refine=2), Rule(3, True, sink=1, sink_int4=True)),
    "sink1 mse values, keys up": (Fmt(scale="mse", keys="up"), Rule(3, True, sink=1, sink_int4=True)),
    "sink1 mse keys, values up": (Fmt(scale="up", keys="mse"), Rule(3, True, sink=1, sink_int4=True)),
}


def bootstrap(deltas, counts, n=2000, seed=0):
    rng = np.random.default_rng(seed)
    deltas, counts = np.asarray(deltas), np.asarray(counts)
    idx = rng.integers(0, deltas.size, (n, deltas.size))
    est = (deltas[idx] * counts[idx]).sum(1) / counts[idx].sum(1)
    return float(np.percentile(est, 2.5)), float(np.percentile(est, 97.5))


def main(argv=None):
    import jaxkv
    from jaxkv.cache.rotation import rotations
    from jaxkv.tasks import agent_traces
    from jaxkv.tasks.example import for_template
    from train.calibrate_triaxial import CALIBRATION_SEED

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--length", type=int, default=1280)
    p.add_argument("--only", default="", help="comma list of variant name prefixes")
    p.add_argument("--out", default="eval/results/triaxial/int3_study")
    args = p.parse_args(argv)
    check_model_matches_quant3()
    model = jaxkv.load_model(args.model)
    cfg, tok = model.config, model.tokenizer
    R = rotations(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    names = [n for n in VARIANTS if not args.only or any(n.startswith(o) for o in args.only.split(","))]
    rows = {(n, r): [] for n in names for r in (False, True)}
    t0, load = time.time(), os.getloadavg()[0]
    for e, ex in enumerate(agent_traces(args.n, CALIBRATION_SEED, length=args.length)):
        ex = for_template(ex, tok)
        for name in names:
            fmt, rule = VARIANTS[name]
            ids, T0, kind, pages = write_plan(tok, ex, rule)
            if name == names[0]:
                from jaxkv.buckets import bucket
                from train.calibrate_triaxial import capture

                Tp = bucket(T0, minimum=256, step=256)
                tokens = np.zeros(Tp, np.int32)
                tokens[:T0] = ids[:T0]
                cap = capture(*model.split(), jnp.asarray(tokens))[1:3]
                ref = quantized_forward(model, ids, T0, kind, pages, None, R, False, cap)
                target = jnp.asarray(ids[T0:])
                nll_ref = -jnp.take_along_axis(ref, target[:, None], -1)[:, 0]
            paged, flt = (kind == 3).mean(), (kind == 1).mean()
            stored = paged * fmt.page_bits(cfg.head_dim) + flt * 16.0 + (1 - paged - flt) * 5.0
            for rot in (False, True):
                lp = quantized_forward(model, ids, T0, kind, pages, fmt, R, rot, cap)
                nll = -jnp.take_along_axis(lp, target[:, None], -1)[:, 0]
                kl = jnp.sum(jnp.exp(ref) * (ref - lp), -1)
                rows[(name, rot)].append(
                    {
                        "dnll": float(jnp.sum(nll - nll_ref)),
                        "kl": float(jnp.sum(kl)),
                        "n": int(target.size),
                        "stored": float(stored),
                        "code": float(paged * 3 + flt * 16 + (1 - paged - flt) * 4),
                        "double": sum(int(d) for _, d, _ in pages),
                        "pages": len(pages),
                    }
                )
        print(f"trace {e}: {ids.size} tokens, reply {ids.size - T0}, {time.time() - t0:.0f} s", flush=True)
    table = []
    for (name, rot), rs in rows.items():
        n = np.array([r["n"] for r in rs])
        d = np.array([r["dnll"] for r in rs]) / n
        lo, hi = bootstrap(d, n)
        table.append(
            [
                name,
                "on" if rot else "off",
                f"{np.mean([r['stored'] for r in rs]):.3f}",
                f"{np.mean([r['code'] for r in rs]):.3f}",
                f"{(d * n).sum() / n.sum():+.4f} [{lo:+.4f}, {hi:+.4f}]",
                f"{sum(r['kl'] for r in rs) / n.sum():.4f}",
            ]
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.json").write_text(json.dumps({k[0] + (" +rot" if k[1] else ""): v for k, v in rows.items()}, indent=1))
    text = "\n".join(
        [
            f"# INT3 format study: {args.model}, {args.n} calibration-seed agent traces (last scored reply)",
            "",
            f"Command: `python -m eval.quality.int3_format_study --n {args.n} --length {args.length}"
            + (f' --only "{args.only}"' if args.only else "")
            + f"` ({time.time() - t0:.0f} s, "
            f"load {load:.2f} at the start, {time.strftime('%Y-%m-%d %H:%M %Z')}). `eval/quality/int3_format_study.py` says what is measured.",
            "",
            md_table(["variant", "rotation", "stored bits", "code bits", "reply NLL increase [95%]", "KL / token"], table, align="llrrrr"),
            "",
        ]
    )
    (out / "README.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
