"""Where jaxkv's ``kvzip`` and kvpress's ``KVzipPress`` part on one example: their scores, then their keep sets.

Both sides score the same compressed request (``jaxkv.tasks.real.plans``, the
question-agnostic setting) by KVzip's reconstruction. This runs each once:

* kvpress: ``KVzipPress`` on kvpress's own path (``kvpress_side.own_path_prefill``,
  the float32 HF model), its ``score_val`` taken before its selection
  (``compress_post``), ``[L, Hkv, n]``;
* jaxkv: a ``policy="kvzip"`` session on the same ids, the scores its event read
  (``reconstruction.run_passes``' ``PassResult.scores_LNK``) and the set it kept
  (``lm``, raw text with no chat form: the evaluation's branched ``kvzip`` cell, and
  the set the policy's rule takes from its scores, the sinks forced and the top of
  the mean over layers and KV heads; with ``--layer-budgets shared``, each layer's
  mean over its KV heads ranked across the layers, ``select_across_layers``);

then prints how far the scores are apart (the largest difference against the
largest score, and the rank correlation per layer and KV head), and what each
keep set holds of the last 128 positions, of the first half, and of the digits the questions ask for (every digit run of the
document that is a fact's value): jaxkv's one set (the mean over layers and KV
heads, ``F ∪ top-k``; with ``--layer-budgets shared`` the ``kvzip:shared`` cell's
set per layer, read from the session's lists) against kvpress's selection (the lowest scores over every
layer, KV head and position dropped at once, the sinks on top), as the share of
(layer, KV head) pairs that keep each digit. Nothing is written but what it prints
(``--out`` a JSON of the numbers).

    python -m eval.quality.kvzip_trace --task multiq --context 2048 --index 0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def kvpress_scores(task: str, context: int, index: int, ratio: float) -> tuple[np.ndarray, np.ndarray, object]:
    import torch

    from eval.quality import kvpress_side as kp
    from jaxkv.tasks import real

    folder = kp.model_folder(kp.MODEL)
    tokenizer = kp.load_tokenizer(folder)
    model = kp.load_hf(folder, "sdpa")
    kp.import_kvpress()
    example = kp.eval_examples(task, index + 1, context, tokenizer)[index]
    ids = np.asarray(real.plans(example, tokenizer, "agnostic")[0].compressed)
    press = kp.make_press("KVzipPress", ratio)
    captured = {}
    select = type(press).compress_post.__get__(press)

    def take(model_):
        captured["scores"] = press.score_val[:, 0].detach().to(torch.float32).numpy().copy()  # [L, Hkv, n]
        select(model_)

    press.compress_post = take
    kp.own_path_prefill(model, ids, press, example.seed)
    return captured["scores"], ids, example


def jaxkv_scores(example, ratio: float, layer_budgets: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """jaxkv's scores ``[L, Hkv, n]``, the compressed ids, and its keep set: positions
    (one set), or with ``layer_budgets`` (``"shared"``: the ``kvzip:shared`` cell) a
    session with a set per layer and its kept mask ``[L, n]``, read from the
    request's per-layer lists when its turn ends."""
    import jaxkv
    from eval.quality.real_model import Cell, budget_for_ratio, pass_positions
    from jaxkv.serving import Session
    from jaxkv.serving.stages import reconstruction
    from jaxkv.tasks import real

    model = jaxkv.load_model("smollm2-135m-instruct")
    ids = np.asarray(real.plans(example, model.tokenizer, "agnostic")[0].compressed)
    n = ids.size
    seen = {}
    run_passes = reconstruction.run_passes

    def keep(turn, config):
        out = yield from run_passes(turn, config)
        seen["result"], seen["tokens"] = out, np.asarray(turn.req.tokens[: turn.req.seq_len])
        return out

    reconstruction.run_passes = keep
    positions = pass_positions([Cell("kvzip", ratio, ())], model, n, n + 512)
    if example.task == "lm":  # raw text, no chat form: the evaluation's branched cell, its set computed from its scores
        from eval.quality.real_model import run_example
        from train.haystack_measure import positions_for

        try:
            run_example(model, example, "agnostic", [Cell(None), Cell("kvzip", ratio, ())], positions=positions_for(example.length))
        finally:
            reconstruction.run_passes = run_passes
        scores = seen["result"].scores_LNK[:, :n]
        B = budget_for_ratio(ratio, n)
        if layer_budgets is not None:
            # the rule's sets per layer from the same scores: each layer's mean over its KV heads, ranked together
            from jaxkv.policies.base import select_across_layers

            L = scores.shape[0]
            forced = np.zeros((L, n), bool)
            forced[:, :4] = True  # the sinks, in every layer
            kept = np.asarray(select_across_layers(scores.mean(axis=2), forced, ~forced, L * B))
            return scores.transpose(0, 2, 1), np.asarray(seen["tokens"]), kept
        mean = scores.mean(axis=(0, 2))
        mean[:4] = np.inf  # the sinks, forced; nothing else is (a raw request has no protected prefix)
        kept = np.sort(np.argsort(-mean, kind="stable")[:B])
        return scores.transpose(0, 2, 1), np.asarray(seen["tokens"]), kept
    sets = {} if layer_budgets is None else {"keep_sets": "layer", "layer_budgets": layer_budgets}
    from jaxkv.serving.stages.retention import RetentionStage

    end = RetentionStage.end

    def end_seen(stage, turn):
        seen["layer_live"] = None if turn.req.layer_live is None else np.asarray(turn.req.layer_live).copy()
        return end(stage, turn)

    RetentionStage.end = end_seen
    session = Session(model, max_positions=positions, protect_query=False, policy="kvzip", budget=budget_for_ratio(ratio, n), **sets)
    try:
        session.replay(example.messages("agnostic")[:2], generate=False)
        (event,) = session.compressions
        kept = np.asarray(event.kept_positions) if layer_budgets is None else seen["layer_live"][:, :n]
    finally:
        session.close()
        reconstruction.run_passes = run_passes
        RetentionStage.end = end
    assert np.array_equal(seen["tokens"], ids), "the two sides' compressed requests differ"
    return seen["result"].scores_LNK[:, :n].transpose(0, 2, 1), ids, kept  # [L, Hkv, n]


def kvpress_keep(scores_LKN: np.ndarray, ratio: float, n_sink: int = 4) -> np.ndarray:
    """``KVzipPress.compress_post``'s selection (``layerwise=False``) as a kept mask ``[L, Hkv, n]``."""
    s = scores_LKN.copy()
    s[..., :n_sink] = s.max() + 1.0
    drop = int(s.size * ratio)
    order = np.argsort(s.reshape(-1), kind="stable")[:drop]
    kept = np.ones(s.size, bool)
    kept[order] = False
    return kept.reshape(s.shape)


def fact_positions(example, tokenizer, ids: np.ndarray) -> dict:
    """``{value: token positions}`` of every asked fact's digits in ``ids``."""
    facts = example.labels.get("facts") or example.labels.get("needles") or []
    out = {}
    for fact in facts:
        value = str(fact.get("value", ""))
        if not value or fact.get("question", 0) is None or fact.get("asked") is False:  # distractors: never asked
            continue
        want = tokenizer.encode(value, add_special_tokens=False)
        for start in range(ids.size - len(want) + 1):
            if ids[start : start + len(want)].tolist() == want:
                out[value] = np.arange(start, start + len(want))
                break
    return out


def rank_corr(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.quality.kvzip_trace", description=__doc__.splitlines()[0])
    p.add_argument("--task", default="multiq")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--index", type=int, default=0, help="which example of the evaluation's (0: its first)")
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--layer-budgets", choices=("shared",), default=None, help="jaxkv's cell with a set per layer under one budget (kvzip:shared)"
    )
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    kp_s, ids, example = kvpress_scores(args.task, args.context, args.index, args.ratio)
    jx_s, jx_ids, jx_kept = jaxkv_scores(example, args.ratio, args.layer_budgets)
    assert np.array_equal(ids, jx_ids)
    n = ids.size
    L, K = kp_s.shape[:2]
    scored = kp_s[..., 4:] > 0  # the sinks and the template prefix score nothing on either side
    diff = np.abs(jx_s - kp_s)[..., 4:][scored]
    corr = [rank_corr(jx_s[l, k, 4:], kp_s[l, k, 4:]) for l in range(L) for k in range(K)]
    kp_keep = kvpress_keep(kp_s, args.ratio)
    if jx_kept.ndim == 2:  # a set per layer [L, n]: every KV head of a layer keeps it
        jx_keep = np.broadcast_to(jx_kept[:, None, :], (L, K, n))
    else:
        jx_keep = np.zeros(n, bool)
        jx_keep[jx_kept] = True
        jx_keep = np.broadcast_to(jx_keep, (L, K, n))
    from transformers import AutoTokenizer

    from eval.quality import kvpress_side as kp

    tokenizer = AutoTokenizer.from_pretrained(str(kp.model_folder(kp.MODEL)))
    facts = fact_positions(example, tokenizer, ids)
    report = {
        "task": args.task,
        "seed": int(example.seed),
        "n": int(n),
        "max_abs_diff_over_max": float(diff.max() / kp_s.max()),
        "rank_corr_min": float(np.min(corr)),
        "rank_corr_median": float(np.median(corr)),
        "layer_budgets": args.layer_budgets,
        "kept_jaxkv_per_layer": jx_keep[:, 0].sum(1).tolist(),
        "kept_kvpress_per_layer": kp_keep.reshape(L, -1).sum(1).tolist(),
        "overlap": float((kp_keep & jx_keep).sum() / kp_keep.sum()),
        "last_128_jaxkv_pairs_kept": float(jx_keep[..., -128:].mean()),
        "last_128_kvpress_pairs_kept": float(kp_keep[..., -128:].mean()),
        "first_half_jaxkv_pairs_kept": float(jx_keep[..., : n // 2].mean()),
        "first_half_kvpress_pairs_kept": float(kp_keep[..., : n // 2].mean()),
        "facts": {
            v: {"jaxkv_pairs_kept": float(jx_keep[..., pos].mean()), "kvpress_pairs_kept": float(kp_keep[..., pos].mean())}
            for v, pos in facts.items()
        },
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(report, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
