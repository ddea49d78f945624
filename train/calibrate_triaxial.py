"""TriAxialKV calibration: per-tag distortion, INT2/INT4 allocation, budget sweep.

    python -m train.calibrate_triaxial --model embedded --n 24 --workers 2 \\
        --out jaxkv/assets/embedded-agent/triaxial.json --plots eval/results/triaxial
    python -m train.calibrate_triaxial --model smollm2-135m-instruct --n 8 --sweep-n 8 --error-requests 6

Any model ``jaxkv.load_model`` loads. The embedded model calibrates on its own
synthetic tasks and its agent accuracy (below). A pretrained model
(``--tasks``, default ``agent,passkey,niah`` for any model but the embedded one)
calibrates on agent traces rendered with its template (tools inlined as text
where the template has no tool section) and on the real-model passkey/niah tasks
in their question-agnostic conversation (``jaxkv.tasks.haystack``; document,
acknowledgement, question); its budget sweep runs the real-model quantized cells
(``train.haystack_measure``, those of ``eval.quality.real_model --kv-quant``)
instead of the harness (a 135M model solves none of the agent turns;
``--sweep-prefill``: the imported protocol by default, one full-precision
forward per example), passkey/niah teacher-forced accuracy (``--sweep-n`` each) and the ``lm``
continuation's NLL, and the calibrated B is the smallest whose accuracy is within
one point of full precision and whose NLL increase is at most ``NLL_TOLERANCE``
(0.05 nats/token). Its ``triaxial.json`` goes to ``<cache>/models/<name>/`` for
a model loaded by name (where ``kv_quant="triaxial"`` finds it,
``jaxkv.models.registry.artifact_paths``), else the model's folder, unless
``--out`` says otherwise; captures are streamed (a 30-layer model's Q/K/V/O of a
2k request are ~0.4 GB), keeping ``--error-requests`` of them for the
attention-error table.

ALGORITHMS.md §7 and the paper's §3.1.4, on held-out calibration conversations
(agent traces and 4-needle MQ-NIAH, seeds disjoint from training and from the
evaluation harness):

1. **Tags as written.** Each conversation is replayed the way the harness serves
   it (``Session.replay``: per assistant turn, the prompt's unmatched suffix is
   prefilled, then the recorded reply teacher-forced). A token's tag is its
   triaxial tag in the request that *writes* it, since a radix-cached token keeps
   the precision it was first written with; reply tokens are written as decode
   would write them (INT4) and take no part in the allocation.
2. **Capture.** The last scored turn's prompt is run through the model once
   (dense causal prefill), capturing post-RoPE Q, K and V at every layer.
3. **Distortion.** For each tag ``k`` present in a request and ``b in {2, 3, 4}``,
   only tag-``k`` tokens are quantized in the serving formats
   (``jaxkv.kernels.quant``: INT4 per token; INT2 (INT3) keys per channel over
   pages of 32 tag-``k`` tokens in position order, INT2 (INT3) values per token,
   the tokens that do not fill a page INT4), attention is replayed for every query row, and the
   output MSE against full precision is taken per head. ``D_k(b)`` = max over
   heads, mean over the requests where ``k`` occurs, sum over layers.
   ``N_k`` = tokens written with tag ``k``, summed over requests (INST tags: the
   median per request, as the prefix cache stores one copy).
4. **Allocation** (``jaxkv.policies.quant_allocation.solve``, among 2, 3 and 4
   bits; journals written before the INT3 tier have no ``D_k(3)`` and allocate
   among 2 and 4) for the full tag
   space, the two ablations (temporal or semantic axis collapsed, D and N
   recomputed on the coarser tags) and ``triaxial_copy``, the tag space with the
   tool output split by its copy sub-tag (``jaxkv.chat.tags.Copy``: plain, key,
   value); ``triaxial`` is the same tags without the split, from the same requests.
5. **Budget sweep** B in {2.0, 2.2, ..., 4.0}: the calibration conversations are
   replayed through the serving path as the evaluation harness replays them
   (``train.replay``) with the triaxial allocation at each B (identical
   allocations run once); the calibrated B is the smallest whose accuracy over
   all scored turns of both tasks is within 1 point of full precision on the same
   conversations (none within a point: B = 4.0).

Also reported, on the captured K/V: the attention-output error of each format
(int4, int2, kivi2, triaxial at the calibrated B): relative error of every
query row and of the last row (a decode step), per layer.

``--rotate`` measures step 3 as a rotated pool stores (``kv_rotate=True``: Q, K,
V and the outputs in the pool's frame, INT3 pages by its ``"mse"`` fit); the
output error is the model frame's (the rotation is orthogonal), but which tokens
lose what differs, and one allocation file serves both pools, so it is the
calibration's choice. ``--sink-tokens n`` takes each request's first ``n``
positions out of every tag (INT4 whatever their tag, ``Allocation.sink_tokens``)
and writes ``"sink_tokens"`` into the file. ``--rewrite-from-float`` (with
``--rewrite-history``) writes ``"rewrite_from_float"``: the served rewrite
rounds recent leftovers once, from float, as the distortions here are measured
(every capture is quantized from float), so it changes the file and the sweep's
sessions, not the journal.

Resumable (``--resume``): each request's distortion entries and each sweep
example's cells are journaled as they finish in ``--work`` (``distortion.jsonl``,
``sweep.jsonl``; default ``runs/calibrate-triaxial/<model>``); a resumed run with
the same setup merges them instead of replaying (the attention-error table's
captures are recomputed: one forward each), and sweep examples are reused only
under the same allocations.

Outputs: the JSON allocation (``--out``: tag table with N, D(2), D(4) per
variant, the calibrated B, the sweep, the attention errors), and in ``--plots``
``dk_per_tag.png`` (D_k(2) and D_k(4) per tag) and ``calibration_sweep.png``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

CALIBRATION_SEED = (1 << 30) + 7_000_000  # disjoint from training (< 2**30) and eval (+9e6)
BUDGETS = tuple(round(2.0 + 0.2 * i, 1) for i in range(11))
TOLERANCE = 0.01  # one accuracy point
NLL_TOLERANCE = 0.05  # nats/token on lm: the real-model criterion's second half (issue #26's goal)
REAL_TASKS = ("agent", "passkey", "niah")
HAYSTACK_SEED = CALIBRATION_SEED + 800_000  # real-model tasks: disjoint from jaxkv.tasks.haystack.EVAL_SEED
VARIANTS = {
    "triaxial": ("temporal", "modal", "semantic"),
    "triaxial_no_temporal": ("modal", "semantic"),
    "triaxial_no_semantic": ("temporal", "modal"),
    "triaxial_copy": ("temporal", "modal", "semantic", "copy"),  # the tool output split by copy sub-tag
}
COPY_TAGS = 1  # version of the copy sub-tags (jaxkv.chat.tags.copy_subtags) the journal's entries used
ROW_BLOCK = 256


def calibration_examples(n: int, length: int):
    """``{task: [Example]}``: ``n`` agent traces and ``n`` 4-needle MQ-NIAH examples."""
    from jaxkv.tasks import agent_traces, mqniah

    return {
        "agent": agent_traces(n, CALIBRATION_SEED, length=length),
        "mqniah": mqniah(n, CALIBRATION_SEED + 500_000, needles=4, length=length),
    }


def calibration_requests(model, tasks, n: int, length: int, rewrite_history: bool = False):
    """``(task, ids [T], codes [T])`` per calibration request (``written_codes``):
    ``agent``/``mqniah``: ``n`` synthetic conversations (rendered for the model's
    template); ``passkey``/``niah``: ``n`` real-model examples of ``length`` tokens
    in the question-agnostic conversation, whose last scored turn is the answer."""
    import types

    from jaxkv.tasks import haystack
    from jaxkv.tasks.example import for_template

    tok = model.tokenizer
    synthetic = {t: exs for t, exs in calibration_examples(n, length).items() if t in tasks} if {"agent", "mqniah"} & set(tasks) else {}
    for task in tasks:
        if task in synthetic:
            for ex in synthetic[task]:
                yield (task, *written_codes(tok, for_template(ex, tok), rewrite_history))
        elif task in ("passkey", "niah"):
            for ex in haystack.examples(task, n, length=length, tokenizer=tok, seed=HAYSTACK_SEED):
                messages = ex.messages("agnostic")
                conversation = types.SimpleNamespace(
                    messages=messages, tools=None, targets=[types.SimpleNamespace(message_index=len(messages) - 1)]
                )
                yield (task, *written_codes(tok, conversation, rewrite_history))
        else:
            raise ValueError(f"unknown calibration task {task!r}; known: agent, mqniah, passkey, niah")


def written_codes(tokenizer, example, rewrite_history: bool = False):
    """The last scored turn's prompt and, per token, the triaxial code it is written
    with when the harness replays the conversation (-1: a teacher-forced reply
    token, written as decode would write it; with ``rewrite_history``, the code of
    its tag in the last prompt, at whose bits a later turn moves it into pages,
    ``Allocation.rewrite_history``). Returns ``(ids [T], codes [T])``."""
    from jaxkv.cache.radix import common_prefix_length
    from jaxkv.chat import render
    from jaxkv.chat.tags import triaxial_codes

    msgs, tools = example.messages, example.tools or None
    last = max(t.message_index for t in example.targets)
    turns = [j for j, m in enumerate(msgs) if m.get("role") == "assistant" and j <= last]
    final = render(tokenizer, msgs[:last], tools, add_generation_prompt=True)
    codes = np.full(final.ids.size, -1, np.int64)
    cached = None
    for j in turns:
        prompt = render(tokenizer, msgs[:j], tools, add_generation_prompt=True)
        start = 0 if cached is None else min(common_prefix_length(cached, prompt.ids), prompt.ids.size - 1)
        end = min(prompt.ids.size, final.ids.size)
        codes[start:end] = triaxial_codes(prompt.triaxial)[start:end]
        full = render(tokenizer, msgs[: j + 1], tools, add_generation_prompt=False)
        codes[prompt.ids.size : min(full.ids.size, final.ids.size)] = -1
        cached = full.ids
    if rewrite_history:
        codes = np.where(codes < 0, triaxial_codes(final.triaxial), codes)
    return final.ids, codes


@functools.partial(jax.jit, static_argnames=("graphdef",))
def capture(graphdef, params, tokens_T):
    """Dense causal prefill of one request; post-RoPE ``q [L, T, Hq, D]``,
    ``k``/``v [L, T, K, D]`` and attention outputs ``o [L, T, Hq, D]``."""
    from flax import nnx

    from jaxkv.attention import causal_attention

    model = nnx.merge(graphdef, params)

    def attend(i, q, k, v, carry):
        o = causal_attention(q, k, v)
        return o, carry, tuple(x[0].astype(jnp.float32) for x in (q, k, v, o))

    T = tokens_T.shape[0]
    _, _, qkvo = model.run_layers(model.embed_tokens(tokens_T[None]), jnp.arange(T, dtype=jnp.int32)[None], attend)
    return qkvo


@functools.partial(jax.jit, static_argnames=("fit3",))
def replay_error(q, k, v, o_ref, int4_mask, page_idx, page_ok, row_ok, page_idx3=None, page_ok3=None, fit3="cover"):
    """Attention outputs with some tokens quantized, against ``o_ref``, per layer.

    Tokens in ``page_idx [Q, 32]`` (where ``page_ok``) are INT2 pages (keys per
    channel, values per token), those in ``page_idx3`` (where ``page_ok3``) INT3
    pages, their parameters chosen by ``fit3`` (``jaxkv.kernels.quant3.FITS``: a
    rotated pool's ``"mse"``, ``jaxkv.cache.quantized.page3_fit``); tokens in
    ``int4_mask`` INT4; all others stay full precision. Returns ``(mse [L, Hq]`` over real
    rows and channels, ``rel [L]`` (Frobenius over real rows), ``last [L]`` (the
    last real row))``.
    """
    from jaxkv.attention import causal_attention
    from jaxkv.kernels.quant import dequantize_int2_pool, dequantize_rows, quantize_int2_pool, quantize_rows
    from jaxkv.kernels.quant3 import pages3_round_trip

    T = k.shape[1]
    pages = [(page_idx.reshape(-1), jnp.where(jnp.repeat(page_ok, 32), page_idx.reshape(-1), T), 2)]
    if page_idx3 is not None:
        pages.append((page_idx3.reshape(-1), jnp.where(jnp.repeat(page_ok3, 32), page_idx3.reshape(-1), T), 3))
    last = jnp.max(jnp.where(row_ok, jnp.arange(T), 0))

    def one(q, k, v, o_ref):
        k_ = jnp.where(int4_mask[:, None, None], dequantize_rows(quantize_rows(k, 4)), k)
        v_ = jnp.where(int4_mask[:, None, None], dequantize_rows(quantize_rows(v, 4)), v)
        for flat, dst, bits in pages:  # INT3: the pool's INT3 page format (one-byte parameters, value groups of 64)
            k2, v2 = (
                pages3_round_trip(k[flat], v[flat], fit3) if bits == 3 else dequantize_int2_pool(quantize_int2_pool(k[flat], v[flat], bits))
            )
            k_ = k_.at[dst].set(k2, mode="drop")
            v_ = v_.at[dst].set(v2, mode="drop")
        o = causal_attention(q[None], k_[None], v_[None])[0]
        d2 = ((o - o_ref) ** 2) * row_ok[:, None, None]
        mse = d2.sum(axis=(0, 2)) / (row_ok.sum() * o.shape[-1])
        rel = jnp.sqrt(d2.sum()) / jnp.sqrt(((o_ref**2) * row_ok[:, None, None]).sum())
        rel_last = jnp.linalg.norm(o[last] - o_ref[last]) / jnp.linalg.norm(o_ref[last])
        return mse, rel, rel_last

    return jax.vmap(one)(q, k, v, o_ref)


def pages_of(token_idx, Tp: int):
    """Pages of 32 of ``token_idx`` (position order) padded to ``Tp/32`` rows and
    the leftover tokens (INT4 under the page-completion rule)."""
    token_idx = np.asarray(token_idx, np.int64)
    n = token_idx.size // 32 * 32
    Q = Tp // 32
    idx = np.zeros((Q, 32), np.int32)
    ok = np.zeros(Q, bool)
    idx[: n // 32] = token_idx[:n].reshape(-1, 32)
    ok[: n // 32] = True
    return idx, ok, token_idx[n:]


@jax.jit
def rotate_capture(q, k, v, o):
    """``q``, ``k``, ``v``, ``o`` of a capture in a rotated pool's frame
    (``jaxkv.cache.rotation.Rotation``, the pool's ``R`` per layer and KV head; a
    query head and its output by its KV head's). Attention in that frame is the
    model's, so the attention-output error of a quantization of ``K·R``, ``V·R``
    against ``o·R`` is its error in the model's frame (``R`` orthogonal)."""
    from jaxkv.cache.rotation import Rotation

    rot, K = Rotation(k.shape[-1]), k.shape[-2]
    layers = jnp.arange(k.shape[0])
    kv = jax.vmap(rot.rotate)
    heads = jax.vmap(lambda i, x: rot.rotate_heads(i, x, K))
    return heads(layers, q), kv(layers, k), kv(layers, v), heads(layers, o)


class Capture:
    """One calibration request: padded captures and write-time codes.

    ``rotate``: measure as a rotated pool stores (K/V in its frame, INT3 pages by
    its ``"mse"`` fit, ``jaxkv.cache.quantized.page3_fit``); ``sink_tokens``: the
    request's first positions are INT4 whatever their tag (``Allocation.sink_tokens``),
    so they belong to no tag (code -1: not counted in ``N``, never in a tag's pages)."""

    def __init__(self, model, ids, codes, rotate: bool = False, sink_tokens: int = 0):
        from jaxkv.buckets import bucket
        from jaxkv.cache.quantized import page3_fit
        from jaxkv.cache.rotation import Rotation

        graphdef, params = model.split()
        self.T = ids.size
        self.Tp = bucket(self.T, minimum=ROW_BLOCK, step=ROW_BLOCK)
        tokens = np.zeros(self.Tp, np.int32)
        tokens[: self.T] = ids
        self.q, self.k, self.v, self.o = capture(graphdef, params, jnp.asarray(tokens))
        if rotate:
            self.q, self.k, self.v, self.o = rotate_capture(self.q, self.k, self.v, self.o)
        self.fit3 = page3_fit(Rotation(self.k.shape[-1]) if rotate else None)
        self.codes = np.concatenate([codes, np.full(self.Tp - self.T, -1)])
        self.codes[: min(int(sink_tokens), self.T)] = -1
        self.row_ok = jnp.asarray(np.arange(self.Tp) < self.T)

    def error(self, int4_tokens=(), int2_tokens=(), float_leftover=False, int3_tokens=None):
        """Errors with these tokens quantized (the rest full precision); INT2 (and
        INT3) tokens that do not fill a page are INT4, or full precision with
        ``float_leftover`` (KIVI's residual)."""
        int4 = np.zeros(self.Tp, bool)
        int4[np.asarray(int4_tokens, np.int64)] = True
        idx, ok, left = pages_of(int2_tokens, self.Tp)
        if not float_leftover:
            int4[left] = True
        three = ()
        if int3_tokens is not None:
            idx3, ok3, left3 = pages_of(int3_tokens, self.Tp)
            int4[left3] = True
            three = (jnp.asarray(idx3), jnp.asarray(ok3))
        args = (self.q, self.k, self.v, self.o, jnp.asarray(int4), jnp.asarray(idx), jnp.asarray(ok), self.row_ok, *three)
        mse, rel, last = replay_error(*args, fit3=self.fit3)
        return np.asarray(mse), np.asarray(rel), np.asarray(last)


class DistortionTables:
    """Per variant: ``{tag index: (N, D2, D4, D3)}`` (module docstring, step 3;
    D3 None where a journaled request predates the INT3 tier), built
    one capture at a time (``add``) so captures need not stay in memory. A
    request's contribution (``request_entries``) is plain JSON, so a run can
    journal it and a resumed run ``merge`` it back instead of replaying."""

    def __init__(self):
        self.per_variant: dict[str, dict[int, dict]] = {name: {} for name in VARIANTS}

    @staticmethod
    def request_entries(cap) -> dict:
        """``{variant: {tag: {"count", "d2" [L], "d3" [L], "d4" [L], "inst"}}}`` of one capture."""
        from jaxkv.chat.tags import Semantic
        from jaxkv.policies.quant_allocation import tag_of_codes

        memo = {}  # the same token set under another variant: reuse
        written = np.flatnonzero(cap.codes >= 0)
        out = {}
        for name, axes in VARIANTS.items():
            tags = tag_of_codes(cap.codes[written], axes)
            out[name] = {}
            for tag in np.unique(tags):
                members = written[tags == tag]
                key = members.tobytes()
                if key not in memo:
                    d4 = cap.error(int4_tokens=members)[0].max(axis=1)  # max over heads, per layer
                    d2 = cap.error(int2_tokens=members)[0].max(axis=1)
                    d3 = cap.error(int3_tokens=members)[0].max(axis=1)
                    memo[key] = (d2.tolist(), d3.tolist(), d4.tolist())
                d2, d3, d4 = memo[key]
                inst = bool((cap.codes[members] % len(Semantic) == Semantic.INST).all()) if "semantic" in axes else None
                out[name][int(tag)] = {"count": int(members.size), "d2": d2, "d3": d3, "d4": d4, "inst": inst}
        return out

    def merge(self, entries: dict) -> None:
        """Add one request's ``request_entries`` (tags may be JSON strings)."""
        for name, per_tag in entries.items():
            for tag, e in per_tag.items():
                entry = self.per_variant[name].setdefault(int(tag), {"counts": [], "d2": [], "d3": [], "d4": [], "inst": None})
                entry["counts"].append(e["count"])
                entry["d2"].append(np.asarray(e["d2"]))
                entry["d3"].append(None if e.get("d3") is None else np.asarray(e["d3"]))
                entry["d4"].append(np.asarray(e["d4"]))
                if e["inst"] is not None:
                    entry["inst"] = e["inst"]

    def add(self, cap) -> dict:
        """Add one capture; returns its ``request_entries``."""
        entries = self.request_entries(cap)
        self.merge(entries)
        return entries

    def tables(self) -> dict:
        tables = {}
        for name, per_tag in self.per_variant.items():
            table = {}
            for tag, e in sorted(per_tag.items()):
                N = float(np.median(e["counts"])) if e["inst"] else float(np.sum(e["counts"]))
                # mean over requests (where the tag occurs), then sum over layers
                d3 = None if any(d is None for d in e["d3"]) else float(np.mean(e["d3"], axis=0).sum())
                table[tag] = (N, float(np.mean(e["d2"], axis=0).sum()), float(np.mean(e["d4"], axis=0).sum()), d3)
            if any(row[3] is None for row in table.values()):  # a journal from before the tier: 2 or 4 bits only
                table = {t: (*row[:3], None) for t, row in table.items()}
            tables[name] = table
        return tables


def distortion_tables(captures, log=print):
    """``DistortionTables`` of a list of captures."""
    acc = DistortionTables()
    for cap in captures:
        acc.add(cap)
    tables = acc.tables()
    for name, table in tables.items():
        log(f"{name}: {len(table)} tags")
    return tables


def allocation_dict(axes, table, budget):
    from jaxkv.policies.quant_allocation import tag_name

    return {
        "axes": list(axes),
        "budget": budget,
        "tags": [
            {"index": t, "name": tag_name(t, axes), "N": n, "D2": d2, **({} if d3 is None else {"D3": d3}), "D4": d4}
            for t, (n, d2, d4, d3) in table.items()
        ],
    }


def attention_errors(captures, alloc, budget):
    """Relative attention-output error per format on the captured K/V (mean over
    requests; per layer and mean), all rows and the last row."""
    from jaxkv.cache.quantized_host import KIVI_RESIDUAL as KIVI_WINDOW  # (the name this module had: KIVI_WINDOW is gone)

    table = alloc.table(budget)
    out = {}
    if not captures:
        return out
    for fmt in ("int4", "int2", "kivi2", "triaxial"):
        rel, last = [], []
        for cap in captures:
            every = np.arange(cap.T)
            if fmt == "int4":
                e = cap.error(int4_tokens=every)
            elif fmt == "int2":
                e = cap.error(int2_tokens=every)
            elif fmt == "kivi2":
                e = cap.error(int2_tokens=every[: max(cap.T - KIVI_WINDOW, 0)], float_leftover=True)
            else:  # written tokens by the allocation, reply tokens INT4
                codes = cap.codes[: cap.T]
                bits = np.where(codes >= 0, table[np.maximum(codes, 0)], 4)
                e = cap.error(int4_tokens=every[bits == 4], int2_tokens=every[bits == 2], int3_tokens=every[bits == 3])
            rel.append(e[1])
            last.append(e[2])
        out[fmt] = {
            "all_rows_per_layer": np.mean(rel, axis=0).tolist(),
            "all_rows": float(np.mean(rel)),
            "last_row_per_layer": np.mean(last, axis=0).tolist(),
            "last_row": float(np.mean(last)),
        }
    return out


def sweep(model_name, examples, alloc_dict, *, workers, max_new_tokens, length, log=print):
    """Calibration accuracy (pooled scored turns) of full precision and of the
    triaxial allocation at each budget; identical allocations run once."""
    from jaxkv.policies.quant_allocation import Allocation
    from train.replay import Cell, run_cells

    alloc = Allocation.from_dict(alloc_dict)
    groups: dict[tuple, list[float]] = {}
    for B in BUDGETS:
        groups.setdefault(tuple(alloc.table(B).tolist()), []).append(B)
    reps = [bs[0] for bs in groups.values()]
    cells = [Cell("full", None, None, t) for t in examples]
    cells += [Cell("full", None, None, t, kv_quant="triaxial", kv_bits=B) for B in reps for t in examples]
    import math

    max_positions = int(min(4096, 1 << math.ceil(math.log2(max(2 * length + 4 * max_new_tokens, 1024)))))
    setup = dict(
        model=model_name,
        n=len(next(iter(examples.values()))),
        length=length,
        seed=CALIBRATION_SEED,
        needles=4,
        max_new_tokens=max_new_tokens,
        max_positions=max_positions,
    )
    rows = {}
    t0 = time.perf_counter()
    for cell, row in run_cells(
        None if workers > 1 else _load(model_name), examples, cells, setup, workers=workers, session_options={"kv_allocation": alloc_dict}
    ):
        rows[(cell.kv_quant, cell.kv_bits, cell.task)] = row
        log(
            f"  {cell.task} {cell.kv_quant} B={cell.kv_bits}: accuracy {row['accuracy']:.3f} avg_bits {row['avg_bits']:.2f} ({time.perf_counter() - t0:.0f} s)"
        )
    turns = {t: sum(len(e.targets) for e in examples[t]) for t in examples}

    def pooled(q, b):
        return sum(rows[(q, b, t)]["accuracy"] * turns[t] for t in examples) / sum(turns.values())

    def bits(q, b):
        return float(np.mean([rows[(q, b, t)]["avg_bits"] for t in examples]))

    full = {"accuracy": pooled("none", None), **{t: rows[("none", None, t)]["accuracy"] for t in examples}}
    out = []
    for bs in groups.values():
        rep = bs[0]
        for B in bs:
            out.append(
                {
                    "B": B,
                    "accuracy": pooled("triaxial", rep),
                    "avg_bits": bits("triaxial", rep),
                    **{t: rows[("triaxial", rep, t)]["accuracy"] for t in examples},
                    **{f"{t}_avg_bits": rows[("triaxial", rep, t)]["avg_bits"] for t in examples},
                }
            )
    return full, sorted(out, key=lambda r: r["B"])


def real_sweep(
    model, alloc_dict, *, n: int, length: int, log=print, journal: Path | None = None, resume: bool = False, prefill: str = "imported"
):
    """The real-model budget sweep (module docstring): full precision and the
    triaxial allocation at each budget (identical allocations once) on ``n``
    passkey, ``n`` niah (question-agnostic) and ``n`` lm examples, each example's
    cells from ``train.haystack_measure.run_quant_example`` under its ``prefill`` protocol
    (``imported``: one full-precision forward per example, the papers' protocol;
    ``chunked``: each allocation's session prefills the request itself). With
    ``journal`` each example's cells are appended as it finishes; ``resume`` reuses
    those of the same allocations and protocol (a changed distortion table changes
    them: nothing reused)."""
    from jaxkv.policies.quant_allocation import Allocation
    from jaxkv.serving.stages.quantization import KVRecord, summarize
    from jaxkv.tasks import haystack
    from tqdm import tqdm
    from train.haystack_measure import IMPORTED, positions_for, run_quant_example
    from train.journal import append_journal, load_journal

    alloc = Allocation.from_dict(alloc_dict)
    groups: dict[tuple, list[float]] = {}
    for B in BUDGETS:
        groups.setdefault(tuple(alloc.table(B).tolist()), []).append(B)
    reps = [bs[0] for bs in groups.values()]
    specs = [f"triaxial@{B}" for B in reps]
    positions = min(positions_for(length), model.config.max_position_embeddings)
    examples = [
        (t, ex)
        for t in ("passkey", "niah", "lm")
        for ex in haystack.examples(t, n, length=length, tokenizer=model.tokenizer, seed=HAYSTACK_SEED)
    ]
    cells: dict[str, list] = {"full": [], **{s: [] for s in specs}}
    setup = {"allocations": {s: alloc.table(B).tolist() for s, B in zip(specs, reps)}, "n": n, "length": length}
    if prefill != "chunked":  # journals written before the option ran chunked and keep their setup
        setup["prefill"] = prefill
    if journal is not None and not resume and journal.exists():
        journal.unlink()
    done = load_journal(journal, setup) if journal is not None and resume else {}
    for i, (task, ex) in enumerate(tqdm(examples, desc=f"sweep ({len(reps)} allocations)", unit="ex")):
        key = f"{task}:{i}"
        rec = done.get(key)
        if rec is None:
            rec = run_quant_example(model, ex, "agnostic", specs, positions=positions, allocation=alloc_dict, prefill=prefill)
            if journal is not None:
                append_journal(journal, {"setup": setup, "key": key, "row": rec})
        for name, res in rec["cells"].items():
            cells[name.removeprefix("kv:").removesuffix(IMPORTED)].append((task, res))

    def summary(name):
        rows = cells[name]
        acc = [float(r["tf_correct"]) for t, r in rows if t != "lm"]
        nll = [r["nll"] for t, r in rows if t == "lm"]
        records = [KVRecord(**r["kv"]) for _, r in rows if "kv" in r]  # the float cell has none: 16 bits
        kv = summarize(records) if records else {"avg_bits": 16.0, "kv_bytes_per_token": None}
        return {
            "accuracy": float(np.mean(acc)),
            "lm_nll": float(np.mean(nll)),
            **kv,
            **{t: float(np.mean([float(r["tf_correct"]) for tt, r in rows if tt == t])) for t in ("passkey", "niah")},
        }

    full = summary("full")
    out = []
    for bs in groups.values():
        got = summary(f"triaxial@{bs[0]}")
        for B in bs:
            out.append({"B": B, **got, "nll_increase": got["lm_nll"] - full["lm_nll"]})
    for r in sorted(out, key=lambda r: r["B"]):
        log(
            f"  B={r['B']}: accuracy {r['accuracy']:.3f} (full {full['accuracy']:.3f}), lm NLL +{r['nll_increase']:.4f}, "
            f"{r['avg_bits']:.2f} bits"
        )
    return full, sorted(out, key=lambda r: r["B"])


def default_out(model, name: str) -> Path:
    """Where a calibration for ``model`` goes by default: the embedded model's
    shipped file, else the first of ``registry.artifact_paths`` that is not a
    converted copy (a named model's cache folder), else the model's folder."""
    from jaxkv.models import registry
    from jaxkv.serving.stages.quantization import CALIBRATION_FILE

    if name == "embedded":
        return Path("jaxkv/assets/embedded-agent") / CALIBRATION_FILE
    paths = registry.artifact_paths(model.path, CALIBRATION_FILE)
    return paths[1] if len(paths) > 1 else paths[0]


def _load(name):
    import jaxkv

    return jaxkv.load_model(name)


def plot(data, out_dir: Path):
    """``dk_per_tag.png`` and ``calibration_sweep.png`` from a calibration file's data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    tags = data["variants"]["triaxial"]["tags"]
    bits = data["variants"]["triaxial"]["bits"]
    x = np.arange(len(tags))
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(tags)), 4.5))
    ax.bar(x - 0.2, [t["D2"] for t in tags], 0.4, label="D_k(2)")
    ax.bar(x + 0.2, [t["D4"] for t in tags], 0.4, label="D_k(4)")
    ax.set_yscale("log")
    ax.set_xticks(x, [f"{t['name']}\nN={t['N']:.0f}, {bits[t['name']]} bits" for t in tags], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("attention-output MSE")
    ax.set_title(f"per-tag distortion (max heads, mean requests, sum layers); bits at B={data['budget']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "dk_per_tag.png", dpi=110)
    plt.close(fig)
    sweep_rows, full = data["sweep"], data["full_precision"]
    if not sweep_rows:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["B"] for r in sweep_rows], [r["accuracy"] for r in sweep_rows], marker="o", label="triaxial (pooled turns)")
    ax.axhline(full["accuracy"], color="black", linestyle="--", label="full precision")
    ax.axhline(full["accuracy"] - TOLERANCE, color="gray", linestyle=":", label="-1 point")
    ax.set_xlabel("budget B (average bits)")
    ax.set_ylabel("calibration accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    if "nll_increase" in sweep_rows[0]:  # a real model's sweep: the lm criterion too
        ax2 = ax.twinx()
        ax2.plot(
            [r["B"] for r in sweep_rows],
            [r["nll_increase"] for r in sweep_rows],
            marker="s",
            color="tab:red",
            label="lm NLL increase (nats/token)",
        )
        ax2.axhline(NLL_TOLERANCE, color="tab:red", linestyle=":", label=f"{NLL_TOLERANCE} nats")
        ax2.set_ylabel("lm NLL increase over full precision", color="tab:red")
        ax2.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(out_dir / "calibration_sweep.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument(
        "--tasks", default=None, help="calibration tasks (default: agent,mqniah for the embedded model, else agent,passkey,niah)"
    )
    ap.add_argument("--n", type=int, default=24, help="calibration conversations per task")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--sweep-n", type=int, default=8, help="real models: passkey, niah and lm examples of the sweep, each")
    ap.add_argument(
        "--sweep-prefill",
        choices=("imported", "chunked"),
        default="imported",
        help="real models: the sweep's prefill protocol (train.haystack_measure, as --quant-prefill of eval.quality.real_model)",
    )
    ap.add_argument(
        "--error-requests",
        type=int,
        default=None,
        help="captures kept for the attention-error table (default: all; a real model's are large)",
    )
    ap.add_argument("--out", default=None, help="the calibration file (default: where kv_quant='triaxial' finds it)")
    ap.add_argument("--plots", default=None, help="plot folder (default: eval/results/triaxial[/<model>])")
    ap.add_argument("--skip-sweep", action="store_true", help="tables only; B = --budget")
    ap.add_argument("--budget", type=float, default=None, help="use this B instead of sweeping")
    ap.add_argument("--replot", action="store_true", help="only redraw the plots from --out")
    ap.add_argument(
        "--journal-only",
        action="store_true",
        help="with --resume: the tables of the journaled requests only (a run cut short), no new captures",
    )
    ap.add_argument(
        "--rewrite-history",
        action="store_true",
        help="calibrate for the rewrite-history write rule (replies and earlier INT4 tokens move into pages at "
        "their tags' bits each turn; Allocation.rewrite_history): replies count with their tags",
    )
    ap.add_argument(
        "--rewrite-from-float",
        action="store_true",
        help="with --rewrite-history: the served rewrite prefills recent leftovers again and rounds them once, from "
        "float (Allocation.rewrite_from_float), as these distortions are measured; written to the file",
    )
    ap.add_argument(
        "--rotate",
        action="store_true",
        help="measure the distortions as a rotated pool stores K/V (kv_rotate=True: its frame, the mse fit of its "
        "INT3 pages); one allocation file serves both, so this is the calibration's choice of pool",
    )
    ap.add_argument(
        "--sink-tokens",
        type=int,
        default=0,
        help="the first positions of every request are INT4 whatever their tag (Allocation.sink_tokens): "
        "measured out of every tag, and written to the file",
    )
    ap.add_argument(
        "--work",
        default=None,
        help="journals of finished requests (distortion.jsonl, sweep.jsonl; default runs/calibrate-triaxial/<model>)",
    )
    ap.add_argument(
        "--resume", action="store_true", help="reuse the journaled requests and sweep examples of the same setup instead of replaying them"
    )
    args = ap.parse_args(argv)
    if args.rewrite_from_float and not args.rewrite_history:
        ap.error("--rewrite-from-float is a source for the rewrite rule: it needs --rewrite-history")
    embedded = args.model == "embedded"
    plots = Path(args.plots or ("eval/results/triaxial" if embedded else f"eval/results/triaxial/{Path(args.model).name}"))
    if args.replot:
        plot(json.loads(Path(args.out).read_text()), plots)
        return 0
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    from tqdm import tqdm

    from jaxkv.policies.quant_allocation import Allocation

    model = _load(args.model)
    out = Path(args.out) if args.out else default_out(model, args.model)
    tasks = [t for t in (args.tasks or ("agent,mqniah" if embedded else ",".join(REAL_TASKS))).split(",") if t]
    t0 = time.perf_counter()
    from train.journal import append_journal, load_journal

    work = Path(args.work or f"runs/calibrate-triaxial/{Path(args.model).name}")
    work.mkdir(parents=True, exist_ok=True)
    journal_setup = {"model": args.model, "tasks": tasks, "n": args.n, "length": args.length, "copy_tags": COPY_TAGS}
    if args.rewrite_history:
        journal_setup["rewrite_history"] = True
    if args.rotate:
        journal_setup["rotate"] = True
    if args.sink_tokens:
        journal_setup["sink_tokens"] = args.sink_tokens
    journal = work / "distortion.jsonl"
    if not args.resume and journal.exists():
        journal.unlink()
    done = load_journal(journal, journal_setup) if args.resume else {}
    if done:
        log(f"--resume: {len(done)} requests' distortion already in {journal}")
    acc, kept, n_requests, merged = DistortionTables(), [], 0, 0
    for task, ids, codes in tqdm(
        calibration_requests(model, tasks, args.n, args.length, args.rewrite_history), total=args.n * len(tasks), desc="capture + distortion", unit="request"
    ):
        key = f"{task}:{n_requests}"
        n_requests += 1
        keep = args.error_requests is None or len(kept) < args.error_requests
        if key in done:
            acc.merge(done[key])
            merged += 1
            if keep:
                kept.append(Capture(model, ids, codes, args.rotate, args.sink_tokens))  # one forward, for the attention-error table
            continue
        if args.journal_only:
            continue
        cap = Capture(model, ids, codes, args.rotate, args.sink_tokens)
        append_journal(journal, {"setup": journal_setup, "key": key, "row": acc.add(cap)})
        if keep:
            kept.append(cap)
    tables = acc.tables()
    log(f"captured {n_requests} requests, distortion tables ({time.perf_counter() - t0:.0f} s)")
    tri = allocation_dict(VARIANTS["triaxial"], tables["triaxial"], 4.0)
    if args.rewrite_history:
        tri["rewrite_history"] = True  # the sweep's sessions write under the rule the distortions assume
    if args.rewrite_from_float:
        tri["rewrite_from_float"] = True
    if args.sink_tokens:
        tri["sink_tokens"] = args.sink_tokens
    full, sweep_rows = None, []
    if args.budget is not None or args.skip_sweep:
        budget = args.budget if args.budget is not None else max(BUDGETS)
        criterion = "given (--budget)"
    elif embedded:
        examples = {t: exs for t, exs in calibration_examples(args.n, args.length).items() if t in tasks}
        full, sweep_rows = sweep(
            args.model, examples, tri, workers=args.workers, max_new_tokens=args.max_new_tokens, length=args.length, log=log
        )
        ok = [r["B"] for r in sweep_rows if r["accuracy"] >= full["accuracy"] - TOLERANCE]
        budget = min(ok) if ok else max(BUDGETS)  # none within a point: the most precise budget
        criterion = f"smallest B in {list(BUDGETS)} whose pooled calibration accuracy is within {TOLERANCE:.2f} of full precision"
    else:
        full, sweep_rows = real_sweep(
            model,
            tri,
            n=args.sweep_n,
            length=args.length,
            log=log,
            journal=work / "sweep.jsonl",
            resume=args.resume,
            prefill=args.sweep_prefill,
        )
        ok = [r["B"] for r in sweep_rows if r["accuracy"] >= full["accuracy"] - TOLERANCE and r["nll_increase"] <= NLL_TOLERANCE]
        budget = min(ok) if ok else max(BUDGETS)
        criterion = (
            f"smallest B in {list(BUDGETS)} whose passkey/niah teacher-forced accuracy is within {TOLERANCE:.2f} "
            f"of full precision and whose lm NLL increase is at most {NLL_TOLERANCE} nats/token "
            f"({args.sweep_prefill} prefill)"
        )
    log(f"calibrated B = {budget}")
    variants = {}
    for name, axes in VARIANTS.items():
        d = allocation_dict(axes, tables[name], budget)
        d["bits"] = Allocation.from_dict(d).bits()
        variants[name] = d
    errors = attention_errors(kept, Allocation.from_dict(variants["triaxial"]), budget)
    data = {
        "model": args.model,
        "budget": budget,
        "criterion": criterion,
        "calibration": {
            "seed": CALIBRATION_SEED,
            "n_per_task": args.n,
            "tasks": tasks,
            "length": args.length,
            **({"rotate": True} if args.rotate else {}),
            "requests": merged if args.journal_only else n_requests,
            "error_requests": len(kept),
            "seconds": round(time.perf_counter() - t0, 1),
            "command": "python -m train.calibrate_triaxial " + " ".join(argv or sys.argv[1:]),
        },
        "full_precision": full,
        "sweep": sweep_rows,
        "attention_error": errors,
        "variants": variants,
        **({"rewrite_history": True} if args.rewrite_history else {}),
        **({"rewrite_from_float": True} if args.rewrite_from_float else {}),
        **({"sink_tokens": args.sink_tokens} if args.sink_tokens else {}),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    plot(data, plots)
    if not embedded:
        (plots / "triaxial.json").write_text(out.read_text())  # the calibration beside its plots, in the report
    log(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
    print(json.dumps({k: data[k] for k in ("budget", "full_precision", "attention_error")}, indent=1))
    for name, v in variants.items():
        print(name, v["bits"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
