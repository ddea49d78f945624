"""Scaling of cross-query segment reuse: bytes per segment, lookup latency, break-even.

    JAX_PLATFORMS=cpu python -m eval.bench.reuse [--max-index 100000] [--out eval/results/reuse/bench.md]

Prints three tables, each next to its reference in the same run:

1. **Bytes per stored segment** (a 128-token window): token ids and positions,
   post-RoPE K and V of ``n`` reused layers, the residual at the cut and the two
   MinHash signatures, measured on real ``Segment`` objects for the embedded model
   and for a Llama-3-8B shape (32 layers, 8 KV heads of 128, width 4096), float32
   as stored and bf16 as a KV pool would hold them. Formula:
   ``T * (2 n Hkv D + M) * bytes + T * 12 + 2 * num_perm * 8``.
2. **Lookup latency vs index size** (one tenant, 10^2 .. 10^5 segments): the
   MinHash of a 128-token query window, the LSH query, and ``align`` of the
   candidates; the reference is recomputing that window's prefill on the embedded
   model (measured in the same run).
3. **Break-even segment length**: the prompt ``[context, segment of T tokens,
   tail]`` prefilled with the segment recomputed (prefix caching alone) and with it
   spliced (``reuse="segment"``, default settings but the acceptance threshold
   at infinity, so every T measures the splice path), median wall time and
   token x layer units per T; the analytic break-even in units,
   ``T* = 2h + p (2L - n + 1) / (n - 1)`` (halo, probe reference and the probe's
   spliced copy against ``n - 1`` skipped layers per interior token).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from jaxkv.markdown import md_header, md_row


def _segment_bytes(store_cls, minhash, T, n, Hkv, D, M):
    store = store_cls(cap_bytes=1 << 40)
    toks = np.arange(T) % 1000
    k = np.zeros((n, T, Hkv, D), np.float32)
    seg = store.add("t", ("b",), toks, np.arange(T), k, k, np.zeros((T, M), np.float32), minhash(toks), minhash(toks[:32]))
    sig = 2 * seg.sig.hashvalues.nbytes
    return seg.nbytes + sig, seg.k.nbytes + seg.v.nbytes, seg.resid.nbytes, sig


def bytes_table(num_perm: int) -> str:
    from jaxkv.cache.segments import SegmentStore, minhash

    shapes = {"embedded (L=4, Hkv=4, D=32, M=128)": (4, 4, 32, 128), "Llama-3-8B (L=32, Hkv=8, D=128, M=4096)": (32, 8, 128, 4096)}
    lines = md_header(
        [
            "model",
            "n = L_reuse",
            "bytes / segment (f32, as stored)",
            "of which K+V",
            "residual",
            "signatures",
            "bf16 K/V + residual",
            "per token (f32)",
        ],
        "l" + "r" * 7,
    )
    T = 128
    for name, (L, Hkv, D, M) in shapes.items():
        for n in sorted({1, 2, L // 2, L - 1, L}):
            total, kv, res, sig = _segment_bytes(SegmentStore, minhash, T, n, Hkv, D, M)
            bf16 = (kv + res) // 2 + T * 12 + sig
            lines.append(md_row([name, n, f"{total:,}", f"{kv:,}", f"{res:,}", f"{sig:,}", f"{bf16:,}", f"{total / T:,.0f}"]))
    return "\n".join(lines)


def lookup_table(max_index: int, model) -> str:
    from jaxkv.cache.segments import PromptIndex, SegmentStore, align, minhash

    rng = np.random.default_rng(0)
    store = SegmentStore(cap_bytes=1 << 40)
    z = np.zeros((1, 128, 1, 1), np.float32)
    ns = ("bench",)
    sizes = [s for s in (100, 1_000, 10_000, 100_000) if s <= max_index]
    target = rng.integers(0, 1900, 128)
    query = np.concatenate([rng.integers(0, 1900, 300), target, rng.integers(0, 1900, 50)])
    rows = md_header(
        [
            "segments in the index",
            "MinHash of the query window (ms)",
            "LSH query (ms)",
            "align candidates (ms)",
            "candidates",
            "total lookup (ms)",
            "found",
        ],
        "r" * 6 + "l",
    )
    have = 0
    t_build = time.perf_counter()
    for size in sizes:
        while have < size:
            toks = target if have == 0 else rng.integers(0, 1900, 128)
            store.add("t", ns, toks, np.arange(128), z, z, None, minhash(toks), minhash([]))
            have += 1
        reps = 20
        t0 = time.perf_counter()
        for _ in range(reps):
            sig = minhash(query[300:428])
        t_sig = (time.perf_counter() - t0) / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            cands = store.candidates("t", ns, [sig])
        t_lsh = (time.perf_counter() - t0) / reps
        t0 = time.perf_counter()
        prompt = PromptIndex(query, 0, query.size)
        found = False
        for seg in cands:
            for al in align(seg, prompt):
                found |= al.similarity == 1.0
        t_align = time.perf_counter() - t0
        rows.append(
            md_row(
                [
                    f"{size:,}",
                    f"{1e3 * t_sig:.2f}",
                    f"{1e3 * t_lsh:.3f}",
                    f"{1e3 * t_align:.2f}",
                    len(cands),
                    f"{1e3 * (t_sig + t_lsh + t_align):.2f}",
                    found,
                ]
            )
        )
    build = time.perf_counter() - t_build
    # reference: recomputing the same 128-token window (prefill after a 300-token context)
    import jaxkv
    from jaxkv.engine import Engine

    eng = Engine(model, rows=1, max_positions=1024)
    ctx, win = np.arange(300) % 1900, np.arange(128) % 1900
    times = []
    for _ in range(6):
        r = eng.open_row()
        eng.prefill([r], [ctx])
        t0 = time.perf_counter()
        eng.prefill([r], [win])
        times.append(time.perf_counter() - t0)
        eng.close_row(r)
    ref = 1e3 * float(np.median(times[1:]))
    rows.append("")
    rows.append(
        f"Reference, same run: prefill of that 128-token window on the embedded model after 300 tokens: {ref:.2f} ms "
        f"(index build: {have:,} segments in {build:.1f} s)."
    )
    del jaxkv
    return "\n".join(rows)


def breakeven_table(model, lengths) -> str:
    import jaxkv
    from jaxkv.serving.stages.reuse import ReuseConfig
    from jaxkv.tasks.words import SYSTEM_AGENT

    cfg = ReuseConfig()
    L = model.config.num_layers
    n, h, p = cfg.reuse_layers, cfg.halo, cfg.probe_tokens
    t_star = 2 * h + p * (2 * L - n + 1) / (n - 1)
    rng = np.random.default_rng(1)
    vocab_words = ["k%03d: v%03d" % (i, (7 * i) % 400) for i in range(400)]
    rows = md_header(
        [
            "segment tokens T",
            "prefix caching: units",
            "s (median)",
            "segment reuse: units",
            "s (median)",
            "accepted",
            "unit saving",
            "time saving",
        ],
        "r" * 8,
    )
    for T in lengths:
        words = " ".join(rng.choice(vocab_words, max(T // 3, 2)))
        doc = model.tokenizer.decode(model.tokenizer(words)["input_ids"][:T])
        res = {}
        for mode in ("none", "segment"):
            server = jaxkv.Server(model, max_positions=2048)
            units, secs, acc = [], [], 0
            for i in range(7):
                history = " ".join(rng.choice(vocab_words, 20))  # new text, same length: the same compiled shapes
                msgs = [
                    {"role": "system", "content": SYSTEM_AGENT},
                    {"role": "user", "content": history},
                    {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": doc},
                ]
                s = server.session(reuse=mode, tenant="t", **({"kl_epsilon": float("inf")} if mode == "segment" else {}))
                s.chat(msgs, max_new_tokens=1)
                rep = s._stage("reuse").reports[-1]
                if i >= 2:  # 0: stores the segment; 1: compiles the spliced steps
                    units.append(rep.units)
                    secs.append(rep.prefill_s)
                    acc += rep.accepted
            server.close()
            res[mode] = (float(np.mean(units)), float(np.median(secs)), acc)
        (u0, s0, _), (u1, s1, a1) = res["none"], res["segment"]
        rows.append(md_row([T, f"{u0:.0f}", f"{s0:.4f}", f"{u1:.0f}", f"{s1:.4f}", f"{a1}/5", f"{u0 / u1:.2f}x", f"{s0 / s1:.2f}x"]))
    rows.append("")
    rows.append(
        f"Analytic break-even in units at the defaults (L={L}, n={n}, h={h}, probe p={p}): T* = 2h + p(2L - n + 1)/(n - 1) = {t_star:.0f} tokens "
        f"(the user-turn tokens around the segment and the template are recomputed either way)."
    )
    return "\n".join(rows)


def main(argv=None) -> int:
    import jaxkv
    from jaxkv.cache.segments import NUM_PERM

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-index", type=int, default=100_000)
    p.add_argument("--lengths", default="16,32,64,128,256,512")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    model = jaxkv.load_model("embedded")
    parts = [
        "## Bytes per stored segment (128 tokens)",
        "",
        bytes_table(NUM_PERM),
        "",
        "## Lookup latency vs index size (one tenant, 128-token windows)",
        "",
        lookup_table(args.max_index, model),
        "",
        "## Break-even segment length (embedded model, CPU)",
        "",
        breakeven_table(model, [int(x) for x in args.lengths.split(",")]),
        "",
    ]
    text = "\n".join(parts)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
