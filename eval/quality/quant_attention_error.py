"""Attention-output error of each KV format, per layer, on K/V a model computed (issue #26, item 3).

    JAX_PLATFORMS=cpu python -m eval.quality.quant_attention_error \\
        --models embedded,smollm2-135m-instruct --n 6 --length 2048 --out eval/results/quant_attention_error

What it measures. Each model reads ``--n`` prompts per task of its own workload,
drawn from the calibration seed (``train.calibrate_triaxial.CALIBRATION_SEED``,
disjoint from every evaluation seed): the embedded model its agent traces and
4-needle MQ-NIAH (the last scored turn's prompt, as calibration renders it),
any other model the real-model tasks of ``jaxkv.tasks.haystack`` (passkey and
single-needle NIAH with the question and answer, and a continuation window of
real text), rendered with its own chat template. One dense causal prefill per
prompt captures every layer's post-RoPE q, k, v and attention output
(``train.calibrate_triaxial.capture``). Then every token's K and V go through a
format's quantize-dequantize round trip and the layer's attention is replayed
with the same queries:

* ``int4``: per token, 4 bits, one (scale, zero) per 32 channels, K and V
  (``kv_quant="int4"``);
* ``int2_token``: the same at 2 bits for K and V. Not a serving format: it is
  the per-token INT2 that the Hugging Face cache-quantization study saw collapse;
* ``int2_pages``: keys per channel over pages of 32 tokens, values per token,
  2 bits, no full-precision window; the tokens that do not fill a page INT4
  (the page-completion rule). TriAxialKV's INT2 region;
* ``kivi2``: ``int2_pages`` with the most recent 128-159 tokens in full
  precision (``kv_quant="kivi2"``: groups of 32 leave the window oldest first);
* ``kivi4``: KIVI's layout at 4 bits (keys per channel over pages, values per
  token, the same window): ``kv_quant="kivi4"``'s pages, through
  ``jaxkv.kernels.quant.key_pages_round_trip`` (the pool's own quantize and
  dequantize).

Per layer, averaged over prompts: the relative attention-output error over all
query rows (Frobenius) and over the last row (what one decode step reads); the
keys' own relative round-trip error at 2 bits per token and per channel; and the
keys' channel outlier ratio, max over channels of the mean ``|k|`` per channel
over the mean over channels (mean over KV heads; 1 when every channel is alike), the outliers KIVI's per-channel grouping
exists for.

``--formats below4`` (issue #74) ranks candidate formats below 4 stored bits
instead, each a (key layout, key bits, value layout, value bits) with or without
a rotation, through one generic asymmetric round trip (``group_round_trip``: the
pools' own ``_fit``, float16 scale and zero rounded outward, any width from 2 to
8 bits):

* layouts: ``tok32`` / ``tok64`` per token in groups of 32 or 64 channels (64 is
  the whole head on SmolLM2); ``chan`` keys per channel over pages of 32 tokens
  (the tokens that do not fill a page: ``tok32`` at the same bits); ``chan_pre``
  the same on pre-RoPE keys (RoPE undone before, redone after: KVQuant's choice);
* ``+rot``: K and V rotated per (layer, KV head) by ``jaxkv.cache.rotation``'s
  randomized Hadamard before quantization and rotated back after (the same
  attention as rotating the queries and the output, in exact arithmetic);
* stored bits: codes plus a float16 scale and zero per group (32 bits per
  group of 32 or 64 elements), K and V averaged: INT4 per token 5.0, INT3 g64
  3.5, INT2 g32 3.0. The rotation is a static matrix per pool: no bytes.

``--row-stride S`` replays every S-th query row (and the last), over every key:
the all-rows error is then an unbiased estimate from 1/S of the rows, S times
cheaper (the reference is the same replay on the unquantized K/V).

Written by hand because it measures the round trips of jaxkv's own stored
formats (``jaxkv.kernels.quant``) on jaxkv's captures; quantization libraries
measure their own layouts. Outputs in ``--out``: ``README.md`` (tables),
``errors.json`` (every number) and ``per_layer.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.markdown import md_table

FORMATS = ("int4", "int2_token", "int2_pages", "kivi2", "kivi4")


@dataclasses.dataclass(frozen=True)
class Spec:
    """A below-4-bit candidate (module docstring).

    Attributes:
      k_layout, v_layout: ``tok32``, ``tok64``, ``chan`` or ``chan_pre`` (keys only).
      k_bits, v_bits: code widths; rotate: the randomized Hadamard on or off.
    """

    k_layout: str
    k_bits: int
    v_layout: str
    v_bits: int
    rotate: bool = False

    @property
    def stored_bits(self) -> float:
        """Codes plus a float16 scale and zero (32 bits) per group, K and V averaged."""
        group = {"tok32": 32, "tok64": 64, "chan": 32, "chan_pre": 32}
        return 0.5 * sum(b + 32 / group[lay] for lay, b in ((self.k_layout, self.k_bits), (self.v_layout, self.v_bits)))


_BELOW4_BASE = {
    "int4": Spec("tok32", 4, "tok32", 4),
    "int4_g64": Spec("tok64", 4, "tok64", 4),
    "int4_kchan": Spec("chan", 4, "tok32", 4),
    "int3": Spec("tok32", 3, "tok32", 3),
    "int3_g64": Spec("tok64", 3, "tok64", 3),
    "int3_kchan": Spec("chan", 3, "tok32", 3),
    "int3_kchan_v64": Spec("chan", 3, "tok64", 3),
    "int3_kchanpre_v64": Spec("chan_pre", 3, "tok64", 3),
    "k4v2_g64": Spec("tok64", 4, "tok64", 2),
    "k3chan_v2": Spec("chan", 3, "tok32", 2),
    "k3v2_g64": Spec("tok64", 3, "tok64", 2),
    "int2": Spec("tok32", 2, "tok32", 2),
    "int2_g64": Spec("tok64", 2, "tok64", 2),
    "int2_kchan": Spec("chan", 2, "tok32", 2),
    "int2_kchanpre": Spec("chan_pre", 2, "tok32", 2),
}
BELOW4 = {
    **{name: spec for name, spec in _BELOW4_BASE.items()},
    **{name + "+rot": dataclasses.replace(spec, rotate=True) for name, spec in _BELOW4_BASE.items()},
}


def group_round_trip(x, bits: int, group: int, axis: int):
    """``x`` quantized asymmetrically at ``bits`` in groups of ``group`` consecutive
    elements along ``axis`` (float16 scale and zero, ``jaxkv.kernels.quant._fit``)
    and dequantized, float32."""
    from jaxkv.kernels.quant import _fit

    xm = jnp.moveaxis(x, axis, -1)
    grouped = xm.reshape(*xm.shape[:-1], xm.shape[-1] // group, group)
    codes, scale, zero = _fit(grouped, -1, bits)
    deq = zero.astype(jnp.float32)[..., None] + codes.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]
    return jnp.moveaxis(deq.reshape(xm.shape), -1, axis)


def layout_round_trip(x_LTKD, layout: str, bits: int, T: int, rope=None):
    """``x [L, T', K, D]`` through one layout (``Spec``); ``chan`` layouts group the
    first ``T // 32 * 32`` tokens per channel, the rest per token in groups of 32."""
    if layout in ("tok32", "tok64"):
        return group_round_trip(x_LTKD, bits, int(layout[3:]), -1)
    from jaxkv.rope import apply_rope

    paged = T // PAGE * PAGE
    pos = jnp.broadcast_to(jnp.arange(x_LTKD.shape[1], dtype=jnp.int32), x_LTKD.shape[:2])
    x = apply_rope(x_LTKD, -pos, rope) if layout == "chan_pre" else x_LTKD
    head = group_round_trip(x[:, :paged], bits, PAGE, 1) if paged else x[:, :0]
    tail = group_round_trip(x[:, paged:], bits, 32, -1)
    out = jnp.concatenate([head, tail], axis=1)
    return apply_rope(out, pos, rope) if layout == "chan_pre" else out


def spec_round_trip(spec: Spec, k_LTKD, v_LTKD, T: int, rope, R_LKDE):
    """``(k, v)`` after ``spec``'s round trip; with ``spec.rotate`` quantized as
    ``x·R`` and returned as ``x̂·Rᵀ``. A pre-RoPE key layout rotates the pre-RoPE key."""
    if not spec.rotate:
        return layout_round_trip(k_LTKD, spec.k_layout, spec.k_bits, T, rope), layout_round_trip(v_LTKD, spec.v_layout, spec.v_bits, T)
    R = jnp.asarray(R_LKDE)
    rot = lambda x: jnp.einsum("ltkd,lkde->ltke", x, R)  # noqa: E731
    back = lambda x: jnp.einsum("ltke,lkde->ltkd", x, R)  # noqa: E731
    if spec.k_layout == "chan_pre":
        from jaxkv.rope import apply_rope

        pos = jnp.broadcast_to(jnp.arange(k_LTKD.shape[1], dtype=jnp.int32), k_LTKD.shape[:2])
        k_pre = apply_rope(k_LTKD, -pos, rope)
        k_hat = apply_rope(back(layout_round_trip(rot(k_pre), "chan", spec.k_bits, T)), pos, rope)
    else:
        k_hat = back(layout_round_trip(rot(k_LTKD), spec.k_layout, spec.k_bits, T))
    return k_hat, back(layout_round_trip(rot(v_LTKD), spec.v_layout, spec.v_bits, T))


@jax.jit
def strided_attention(q_LTHD, k_LTKD, v_LTKD, rows_R):
    """Causal GQA attention of the query rows ``rows_R`` over every key, per layer:
    ``[L, R, H, D]`` float32."""
    H, K, D = q_LTHD.shape[2], k_LTKD.shape[2], q_LTHD.shape[3]
    G = H // K
    t = jnp.arange(k_LTKD.shape[1])

    def one(args):
        q, k, v = args
        qr = q[rows_R].reshape(rows_R.size, K, G, D)
        s = jnp.einsum("rkgd,tkd->kgrt", qr, k) / jnp.sqrt(jnp.float32(D))
        s = jnp.where(t[None, None, None, :] <= rows_R[None, None, :, None], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("kgrt,tkd->rkgd", p, v).reshape(rows_R.size, H, D)

    return jax.lax.map(one, (q_LTHD, k_LTKD, v_LTKD))


def strided_error(o_LRHD, ref_LRHD):
    """Per layer: relative Frobenius error over the replayed rows, and at the last one."""
    d = o_LRHD - ref_LRHD
    rel = jnp.sqrt(jnp.sum(d**2, axis=(1, 2, 3)) / jnp.sum(ref_LRHD**2, axis=(1, 2, 3)))
    last = jnp.linalg.norm(d[:, -1].reshape(d.shape[0], -1), axis=-1) / jnp.linalg.norm(ref_LRHD[:, -1].reshape(d.shape[0], -1), axis=-1)
    return rel, last


KIVI_WINDOW = 128  # jaxkv.cache.quantized_host.KIVI_RESIDUAL (asserted in main)
PAGE = 32


def workload(model_name: str, tokenizer, n: int, length: int) -> dict[str, list[np.ndarray]]:
    """``{task: [ids]}``: the prompts a model is measured on (module docstring)."""
    from train.calibrate_triaxial import CALIBRATION_SEED, calibration_examples, written_codes

    if model_name == "embedded":
        return {task: [written_codes(tokenizer, ex)[0] for ex in exs] for task, exs in calibration_examples(n, length).items()}
    from jaxkv.tasks import haystack

    out = {}
    for task in ("passkey", "niah_single", "lm"):
        ids = []
        for ex in haystack.examples(task, n, length=length, tokenizer=tokenizer, seed=CALIBRATION_SEED):
            plan = haystack.token_plan(ex, tokenizer, "aware")
            ids.append(np.concatenate([plan.compressed, plan.rest, plan.answer]).astype(np.int32))
        out[task] = ids
    return out


def rows_round_trip(x, bits: int):
    from jaxkv.kernels.quant import dequantize_rows, quantize_rows

    return dequantize_rows(quantize_rows(x, bits))


def round_trip(fmt: str, k_LTKD, v_LTKD, T: int):
    """``(k, v)`` after ``fmt``'s round trip (module docstring); ``T`` real tokens
    (the captures are padded past them; causal rows below ``T`` never read the padding)."""
    from jaxkv.kernels.quant import key_pages_round_trip

    if fmt == "int4":
        return rows_round_trip(k_LTKD, 4), rows_round_trip(v_LTKD, 4)
    if fmt == "int2_token":
        return rows_round_trip(k_LTKD, 2), rows_round_trip(v_LTKD, 2)
    bits = 4 if fmt == "kivi4" else 2
    if fmt == "int2_pages":
        paged, tail = T // PAGE * PAGE, "int4"
    else:  # KIVI: tokens older than the window leave it in whole pages
        paged, tail = max(T - KIVI_WINDOW, 0) // PAGE * PAGE, "float"
    if paged == 0:
        k_pages, v_pages = k_LTKD[:, :0], v_LTKD[:, :0]
    else:
        k_pages = jax.vmap(lambda k: key_pages_round_trip(k, bits))(k_LTKD[:, :paged])
        v_pages = rows_round_trip(v_LTKD[:, :paged], bits)
    k_rest, v_rest = k_LTKD[:, paged:], v_LTKD[:, paged:]
    if tail == "int4":
        k_rest, v_rest = rows_round_trip(k_rest, 4), rows_round_trip(v_rest, 4)
    return jnp.concatenate([k_pages, k_rest], axis=1), jnp.concatenate([v_pages, v_rest], axis=1)


@jax.jit
def attention_error(q_LTHD, k_LTKD, v_LTKD, o_LTHD, row_ok_T):
    """Per layer: relative error of the replayed attention output against ``o`` over
    the real rows (Frobenius) and at the last real row."""
    from jaxkv.attention import causal_attention

    last = jnp.max(jnp.where(row_ok_T, jnp.arange(row_ok_T.size), 0))
    mask = row_ok_T[:, None, None]

    def one(args):
        q, k, v, o_ref = args
        o = causal_attention(q[None], k[None], v[None])[0]
        d = (o - o_ref) * mask
        rel = jnp.sqrt(jnp.sum(d**2) / jnp.sum((o_ref * mask) ** 2))
        rel_last = jnp.linalg.norm(o[last] - o_ref[last]) / jnp.linalg.norm(o_ref[last])
        return rel, rel_last

    return jax.lax.map(one, (q_LTHD, k_LTKD, v_LTKD, o_LTHD))


def key_statistics(k_LTKD, T: int) -> dict[str, np.ndarray]:
    """Per layer: the channel outlier ratio (max over mean: a median can be 0, as
    in the embedded model's first layers, where many channels are nearly silent) and the keys' relative 2-bit round-trip
    error per token and per channel (pages)."""
    from jaxkv.kernels.quant import key_pages_round_trip

    k = k_LTKD[:, :T]
    per_channel = jnp.mean(jnp.abs(k), axis=1)  # [L, K, D]
    ratio = jnp.mean(jnp.max(per_channel, -1) / jnp.mean(per_channel, -1), -1)
    paged = T // PAGE * PAGE
    k_paged = k[:, :paged]

    def rel(x):
        return jnp.sqrt(jnp.sum((x - k_paged) ** 2, axis=(1, 2, 3)) / jnp.sum(k_paged**2, axis=(1, 2, 3)))

    return {
        "outlier_ratio": np.asarray(ratio),
        "key_err_token2": np.asarray(rel(rows_round_trip(k_paged, 2))),
        "key_err_channel2": np.asarray(rel(jax.vmap(lambda x: key_pages_round_trip(x, 2))(k_paged))),
    }


def measure(model_name: str, n: int, length: int, log=print) -> dict:
    """Every number for one model (mean over its prompts)."""
    import jaxkv
    from jaxkv.buckets import bucket
    from train.calibrate_triaxial import ROW_BLOCK, capture

    model = jaxkv.load_model(model_name)
    cfg = model.config
    graphdef, params = model.split()
    prompts = workload(model_name, model.tokenizer, n, length)
    from tqdm import tqdm

    per_prompt = []
    items = [(task, ids) for task, all_ids in prompts.items() for ids in all_ids]
    bar = tqdm(items, desc=f"{model_name}", unit="prompt")
    t0 = time.perf_counter()
    for task, ids in bar:
        T = int(ids.size)
        Tp = bucket(T, minimum=ROW_BLOCK, step=ROW_BLOCK)
        tokens = np.zeros(Tp, np.int32)
        tokens[:T] = ids
        q, k, v, o = capture(graphdef, params, jnp.asarray(tokens))
        row_ok = jnp.asarray(np.arange(Tp) < T)
        entry = {"task": task, "tokens": T, **key_statistics(k, T)}
        for fmt in FORMATS:
            k_hat, v_hat = round_trip(fmt, k, v, T)
            rel, last = attention_error(q, k_hat, v_hat, o, row_ok)
            entry[fmt] = (np.asarray(rel), np.asarray(last))
        per_prompt.append(entry)
    seconds = time.perf_counter() - t0

    def mean(get):
        return np.mean([get(e) for e in per_prompt], axis=0)

    layers = {fmt: {"all_rows": mean(lambda e: e[fmt][0]).tolist(), "last_row": mean(lambda e: e[fmt][1]).tolist()} for fmt in FORMATS}
    keys = {name: mean(lambda e: e[name]).tolist() for name in ("outlier_ratio", "key_err_token2", "key_err_channel2")}
    log(f"{model_name}: {len(per_prompt)} prompts in {seconds:.0f} s")
    return {
        "model": model_name,
        "layers": cfg.num_layers,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "prompts": {task: len(ids) for task, ids in prompts.items()},
        "tokens": [e["tokens"] for e in per_prompt],
        "seconds": round(seconds, 1),
        "per_layer": layers,
        "keys": keys,
    }


def measure_below4(model_name: str, n: int, length: int, stride: int, log=print) -> dict:
    """``BELOW4``'s numbers for one model (module docstring), mean over its prompts."""
    import jaxkv
    from jaxkv.buckets import bucket
    from jaxkv.cache.rotation import rotations
    from train.calibrate_triaxial import ROW_BLOCK, capture

    model = jaxkv.load_model(model_name)
    cfg = model.config
    graphdef, params = model.split()
    R = rotations(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    prompts = workload(model_name, model.tokenizer, n, length)
    per_prompt, t0 = [], time.perf_counter()
    for task, all_ids in prompts.items():
        for ids in all_ids:
            T = int(ids.size)
            Tp = bucket(T, minimum=ROW_BLOCK, step=ROW_BLOCK)
            tokens = np.zeros(Tp, np.int32)
            tokens[:T] = ids
            q, k, v, _ = capture(graphdef, params, jnp.asarray(tokens))
            rows = jnp.asarray(np.unique(np.r_[np.arange(stride - 1, T, stride), T - 1]).astype(np.int32))
            ref = strided_attention(q, k, v, rows)
            entry = {"task": task, "tokens": T}
            for name, spec in BELOW4.items():
                k_hat, v_hat = spec_round_trip(spec, k, v, T, cfg.rope, R)
                rel, last = strided_error(strided_attention(q, k_hat, v_hat, rows), ref)
                entry[name] = (np.asarray(rel), np.asarray(last))
            per_prompt.append(entry)
            log(f"  {task} {T} tokens: {len(per_prompt)} prompts, {time.perf_counter() - t0:.0f} s")
    seconds = time.perf_counter() - t0

    def mean(get):
        return np.mean([get(e) for e in per_prompt], axis=0)

    return {
        "model": model_name,
        "layers": cfg.num_layers,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "row_stride": stride,
        "prompts": {task: len(ids) for task, ids in prompts.items()},
        "tokens": [e["tokens"] for e in per_prompt],
        "seconds": round(seconds, 1),
        "per_layer": {
            name: {"all_rows": mean(lambda e: e[name][0]).tolist(), "last_row": mean(lambda e: e[name][1]).tolist()} for name in BELOW4
        },
        "by_task": {
            task: {name: float(np.mean([np.mean(e[name][0]) for e in per_prompt if e["task"] == task])) for name in BELOW4}
            for task in prompts
        },
    }


def render_below4(r: dict, command: str, header: str) -> str:
    """The ranking table of ``measure_below4``'s result, sorted by stored bits then error."""
    tasks = list(r["by_task"])
    rows = []
    for name, spec in sorted(BELOW4.items(), key=lambda kv: (kv[1].stored_bits, np.mean(r["per_layer"][kv[0]]["all_rows"]))):
        layer = r["per_layer"][name]
        rows.append(
            [
                f"`{name}`",
                f"{spec.k_layout} / {spec.k_bits}",
                f"{spec.v_layout} / {spec.v_bits}",
                "on" if spec.rotate else "off",
                f"{spec.stored_bits:.2f}",
                f"{np.mean(layer['all_rows']):.4f}",
                f"{np.mean(layer['last_row']):.4f}",
                f"{np.max(layer['all_rows']):.3f} (L{int(np.argmax(layer['all_rows']))})",
                *(f"{r['by_task'][t][name]:.4f}" for t in tasks),
            ]
        )
    return "\n".join(
        [
            "# Below 4 bits: attention-output error of candidate KV formats (issue #74)",
            "",
            header,
            "",
            f"Command: `{command}`",
            "",
            f"{r['model']} ({r['layers']} layers, {r['kv_heads']} KV heads, head_dim {r['head_dim']}); prompts: "
            + ", ".join(f"{t} {k}" for t, k in r["prompts"].items())
            + f" ({int(np.mean(r['tokens']))} tokens avg, calibration seed); every {r['row_stride']}-th query row and the last "
            f"replayed over every key; {r['seconds']:.0f} s. Relative attention-output error against the same replay on the "
            "unquantized post-RoPE K/V, mean over layers (*all rows*: Frobenius over the replayed rows; *last*: the last row, "
            "one decode step), mean over prompts; worst layer; then the all-rows error per task. Stored bits: codes plus a "
            "float16 scale and zero per group, K and V averaged (`Spec.stored_bits`). Layout / bits: `tok32`, `tok64` per "
            "token in groups of 32 or 64 channels; `chan` keys per channel over pages of 32 tokens; `chan_pre` the same "
            "before RoPE. `eval/quality/quant_attention_error.py` says how each is made.",
            "",
            md_table(
                ["format", "keys", "values", "rotation", "stored bits", "all rows", "last row", "worst layer", *tasks],
                rows,
                align="llllrrrr" + "r" * len(tasks),
            ),
            "",
        ]
    )


def render_markdown(results: list[dict], command: str, header: str) -> str:
    lines = [
        "# Attention-output error of each KV format, per layer",
        "",
        header,
        "",
        f"Command: `{command}`",
        "",
        "Relative error of the attention output, the layer's K/V round-tripped through the format "
        "and its attention replayed with the same queries (`eval/quality/quant_attention_error.py` says how). "
        "*all rows*: Frobenius over every query row of the prompt; *last*: the last row (one decode step). "
        "Mean over the model's prompts; the summary row is the mean over layers.",
        "",
    ]
    summary = []
    for r in results:
        cells = [f"{np.mean(r['per_layer'][f]['all_rows']):.4f} / {np.mean(r['per_layer'][f]['last_row']):.4f}" for f in FORMATS]
        prompts = ", ".join(f"{t} {k}" for t, k in r["prompts"].items())
        summary.append([r["model"], f"{prompts} ({int(np.mean(r['tokens']))} tokens avg)", *cells])
    lines += [
        "## Summary",
        "",
        md_table(["model", "prompts", *(f"{f} all / last" for f in FORMATS)], summary, align="ll" + "r" * len(FORMATS)),
    ]
    for r in results:
        keys, per_layer = r["keys"], []
        for layer in range(r["layers"]):
            cells = [f"{r['per_layer'][f]['all_rows'][layer]:.4f}" for f in FORMATS]
            cells += [
                f"{keys['outlier_ratio'][layer]:.1f}",
                f"{keys['key_err_token2'][layer]:.3f}",
                f"{keys['key_err_channel2'][layer]:.3f}",
            ]
            per_layer.append([layer, *cells])
        lines += [
            "",
            f"## {r['model']}: per layer ({r['layers']} layers, {r['kv_heads']} KV heads, head_dim {r['head_dim']})",
            "",
            md_table(
                ["layer", *FORMATS, "key channel outlier ratio", "key 2-bit error per token", "per channel"],
                per_layer,
                align="r" * (len(FORMATS) + 4),
            ),
        ]
    lines += ["", "![relative attention-output error per layer](per_layer.png)", ""]
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results):
        for fmt in FORMATS:
            ax.plot(r["per_layer"][fmt]["all_rows"], marker="o", ms=3, label=fmt)
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_ylabel("relative attention-output error (all rows)")
        ax.set_title(r["model"])
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    from jaxkv.cache.quantized_host import KIVI_RESIDUAL as SERVED_WINDOW

    assert SERVED_WINDOW == KIVI_WINDOW
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="embedded,smollm2-135m-instruct")
    p.add_argument("--n", type=int, default=6, help="prompts per task")
    p.add_argument("--length", type=int, default=2048, help="prompt tokens (approximate for the embedded model's tasks)")
    p.add_argument("--out", default="eval/results/quant_attention_error")
    p.add_argument("--formats", choices=("issue26", "below4"), default="issue26", help="below4: issue #74's candidates (BELOW4)")
    p.add_argument("--row-stride", type=int, default=8, help="below4: replay every S-th query row and the last")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m eval.quality.quant_attention_error " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())
    load = os.getloadavg()
    header = (
        f"{platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__} ({jax.default_backend()}), float32 "
        f"captures, {time.strftime('%Y-%m-%d %H:%M %Z')}; load average at the start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}."
    )
    if args.formats == "below4":
        results = [measure_below4(name, args.n, args.length, args.row_stride) for name in args.models.split(",")]
        end = os.getloadavg()
        header += f" Load average at the end {end[0]:.2f} / {end[1]:.2f} / {end[2]:.2f}."
        (out / "errors.json").write_text(json.dumps({"command": command, "results": results}, indent=1) + "\n")
        text = "\n".join(render_below4(r, command, header) for r in results)
        (out / "attention_error.md").write_text(text)
        print(text)
        return results
    results = [measure(name, args.n, args.length) for name in args.models.split(",")]
    (out / "errors.json").write_text(json.dumps({"command": command, "results": results}, indent=1) + "\n")
    plot(results, out / "per_layer.png")
    text = render_markdown(results, command, header)
    (out / "README.md").write_text(text)
    print(text)
    return results


if __name__ == "__main__":
    main()
