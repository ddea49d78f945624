"""What an IntentKV head keeps vs what the full-cache model reads: a diagnosis on training-side seeds.

    JAX_PLATFORMS=cpu python -m eval.profile.intentkv_diagnosis --n 30 --budgets 1280,1536 \
        --methods full,snapkv,h2o,intentkv_memory,intentkv --out runs/diagnosis [--head DIR]

Examples are agent traces of the harness's length (2,048) from the **held-out label
seeds** of ``train.intentkv_data`` (``HELDOUT_SEED_BASE + i``), never the harness's
evaluation seeds, so nothing here tunes on the report. Each cell is replayed with
``train.replay.replay_example`` (the harness's own replay: teacher-forced history,
greedy generation, exact match), and the retention stage's live set is recorded
at every turn, after the turn's compression event (dead-slot: positions are stable).

What the model needs, per assistant turn: one dense full-cache forward of the whole
conversation (``train.intentkv_data.capture_qk``) gives the attention of every
row of the recorded reply (the tokens the model must produce) to every earlier
position, per layer and head. A history position is **read** at turn t when some
reply row of turn t gives it at least ``--read-threshold`` (0.2) of its attention
in some layer and head (copy and induction heads put most of a row's mass on one
position). Forced positions (protected prefix, actionable query) and the reply
itself are never candidates, so they are left out.

Reported per method and budget: accuracy over the scored turns; for the turns
the full cache gets right, the share of read positions the method had evicted,
for turns it then gets right vs wrong; and which kinds of read tokens it evicts
(``kind_of``: value ``v###``, document id ``d###``, key ``k###``, project/topic
word, ``:`` / ``,`` punctuation, other), and whether they carry a §4 label (a
literal match of a future argument value, ``train.intentkv_data.value_masks``).
Writes ``OUT/diagnosis.json`` and prints a markdown summary.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxkv.markdown import md_header, md_row

KINDS = ("value", "doc_id", "key", "word", "punct", "other")


def kind_of(token: str) -> str:
    """Coarse kind of one token of the embedded tokenizer (identifiers are one token)."""
    t = token.lstrip("Ġ ▁")
    if len(t) == 4 and t[0] in "kvd" and t[1:].isdigit():
        return {"k": "key", "v": "value", "d": "doc_id"}[t[0]]
    if t.isalpha():
        return "word"
    if t in (":", ",", ".", '":', '"', "and"):
        return "punct"
    return "other"


class LiveRecorder:
    """Records the live positions after every turn's retention stage (patches
    ``RetentionStage.after_prefill``; ``restore()`` undoes it)."""

    def __init__(self):
        from jaxkv.serving.stages import retention

        self.module = retention
        self.original = retention.RetentionStage.after_prefill
        self.live: list[np.ndarray] = []
        recorder = self

        def after_prefill(stage, turn, captured):  # a turn program: the pipeline runs it (and the stage's own engine work)
            work = recorder.original(stage, turn, captured)
            if work is not None:
                yield from work
            recorder.live.append(np.asarray(turn.req.live_positions()).copy())

        retention.RetentionStage.after_prefill = after_prefill

    def restore(self):
        self.module.RetentionStage.after_prefill = self.original


def diagnose(args) -> dict:
    import jaxkv
    from jaxkv.chat.render import render
    from jaxkv.tasks.agent import one_trace
    from train.intentkv_data import HELDOUT_SEED_BASE, answer_values_of, capture_qk, future_values, read_strength, reply_spans, value_masks
    from train.replay import Cell, replay_example

    model = jaxkv.load_model(args.model)
    tok = model.tokenizer
    methods = args.methods.split(",")
    budgets = [int(b) for b in args.budgets.split(",")]
    cells = [Cell("full", None, None, "agent")] + [Cell(m, b, "dead_slot", "agent") for m in methods if m != "full" for b in budgets]
    options = {"head": args.head} if args.head else {}
    kw = dict(max_new_tokens=64, max_positions=4096)
    stats = {f"{c.method}@{c.budget}": collections.defaultdict(float) for c in cells}
    lost_tokens = {name: collections.Counter() for name in stats}
    per_example = []
    bar = tqdm(total=args.n * len(cells), desc="replays")
    for i in range(args.n):
        seed = HELDOUT_SEED_BASE + i
        ex = one_trace(seed, length=args.length)
        full = render(tok, ex.messages, ex.tools, add_generation_prompt=False)
        enc = tok(full.text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = np.asarray(enc["offset_mapping"], np.int64)
        rows = reply_spans(tok, ex.messages, ex.tools)
        q, k = capture_qk(model, full.ids)
        strength = [read_strength(q, k, n, end) for _, n, end in rows]
        kinds = np.asarray([kind_of(t) for t in tok.convert_ids_to_tokens(full.ids.tolist())])
        scored_j = {t.message_index: ti for ti, t in enumerate(ex.targets)}
        record = {"seed": seed, "verdicts": {}}
        full_ok = None
        for cell in cells:
            rec = LiveRecorder()
            try:
                verdicts, done, _, session = replay_example(
                    model, ex, cell, **kw, **(options if cell.method.startswith("intentkv") else {})
                )
            finally:
                rec.restore()
            bar.update(1)
            name = f"{cell.method}@{cell.budget}"
            record["verdicts"][name] = [bool(v) for v in verdicts]
            if cell.method == "full":
                full_ok = verdicts
            st = stats[name]
            st["correct"] += sum(verdicts)
            st["scored"] += len(verdicts)
            for t, (j, n, end) in enumerate(rows):
                if j not in scored_j:
                    continue
                prompt = render(tok, ex.messages[:j], ex.tools, add_generation_prompt=True)
                forced = np.zeros(n, bool)
                for a, b in (prompt.spans.protected_prefix, prompt.spans.actionable_query):
                    forced[a:b] = True
                read = (strength[t] >= args.read_threshold) & ~forced
                live = np.zeros(n, bool)
                if cell.method == "full" or t >= len(rec.live):
                    live[:] = True
                else:
                    lp = rec.live[t]
                    live[lp[lp < n]] = True
                lost = read & ~live
                ok = bool(verdicts[scored_j[j]])
                if not full_ok[scored_j[j]]:
                    continue
                tag = "ok" if ok else "wrong"
                st[f"turns_{tag}"] += 1
                st[f"read_{tag}"] += read.sum()
                st[f"lost_{tag}"] += lost.sum()
                st[f"turns_{tag}_any_lost"] += bool(lost.any())
                labelled = value_masks(full.text, offsets, future_values(ex.messages, j, 5, answer_values_of(ex)))[:n]
                for kd in KINDS:
                    st[f"lost_{tag}_{kd}"] += (lost & (kinds[:n] == kd)).sum()
                    st[f"read_{kd}"] += (read & (kinds[:n] == kd)).sum()
                st[f"lost_{tag}_labelled"] += (lost & labelled).sum()
                if tag == "wrong":
                    lost_tokens[name].update(tok.convert_ids_to_tokens(full.ids[:n][lost].tolist()))
                st["read_labelled"] += (read & labelled).sum()
        per_example.append(record)
    bar.close()
    result = {
        "args": vars(args),
        "cells": {k: {kk: float(vv) for kk, vv in v.items()} for k, v in stats.items()},
        "lost_tokens_wrong": {k: dict(v.most_common(25)) for k, v in lost_tokens.items()},
        "examples": per_example,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diagnosis.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def summary(result) -> str:
    lines = md_header(
        [
            "cell",
            "accuracy",
            "turns ok/wrong (full ok)",
            "read lost: ok turns",
            "wrong turns",
            "wrong turns with a loss",
            *(f"lost {k} (wrong)" for k in KINDS),
            "lost labelled (wrong)",
        ],
        "l" + "r" * (len(KINDS) + 6),
    )
    for name, st in result["cells"].items():
        g = lambda k: st.get(k, 0.0)  # noqa: E731
        acc = g("correct") / max(g("scored"), 1)
        lines.append(
            md_row(
                [
                    name,
                    f"{acc:.3f}",
                    f"{g('turns_ok'):.0f}/{g('turns_wrong'):.0f}",
                    f"{g('lost_ok') / max(g('read_ok'), 1):.3f}",
                    f"{g('lost_wrong') / max(g('read_wrong'), 1):.3f}",
                    f"{g('turns_wrong_any_lost'):.0f}",
                    *(f"{g(f'lost_wrong_{k}'):.0f}" for k in KINDS),
                    f"{g('lost_wrong_labelled'):.0f}",
                ]
            )
        )
    c = next(iter(result["cells"].values()))
    lines.append("")
    lines.append(
        "read positions by kind (all cells' turns): "
        + ", ".join(f"{k} {c.get(f'read_{k}', 0):.0f}" for k in KINDS)
        + f", labelled {c.get('read_labelled', 0):.0f}"
    )
    lines.append("")
    for name, counts in result.get("lost_tokens_wrong", {}).items():
        if counts:
            lines.append(f"{name}: read tokens evicted at wrong turns: " + ", ".join(f"{t!r} {c}" for t, c in counts.items()))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="embedded")
    p.add_argument("--n", type=int, default=30)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--budgets", default="1280,1536")
    p.add_argument("--methods", default="full,snapkv,h2o,intentkv_memory,intentkv")
    p.add_argument("--head", default=None, help="head folder for the intentkv methods (default: the shipped one)")
    p.add_argument("--read-threshold", type=float, default=0.2)
    p.add_argument("--out", default="runs/diagnosis")
    args = p.parse_args(argv)
    print(summary(diagnose(args)))


if __name__ == "__main__":
    main()
