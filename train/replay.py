"""Replaying scored synthetic conversations through sessions: one example, one cell, many cells.

The evaluation harness (``eval.quality.harness``) and the scripts beside it, the
TriAxialKV calibration's budget sweep on the embedded model
(``train.calibrate_triaxial.sweep``) and the IntentKV managed-event rows
(``train.intentkv_data``, through ``session_budget``) all replay examples this one
way. It lives in ``train/`` because ``eval/`` may import ``train/`` and ``train/``
never imports ``eval/``.

A ``Cell`` is one configuration of a session: a retention method at a budget and
layout (``"full"``: the full cache), a repair policy and its K, a KV precision and a
reuse mode. ``replay_example`` replays one ``jaxkv.tasks`` example through a fresh
``Session`` configured for the cell, turn by turn with teacher-forced history (the
recorded conversation before each assistant turn). Each scored turn is generated
greedily and matched exactly (``jaxkv.tasks.reply_matches``), or, with
``accuracy="teacher"``, counted when every token of its recorded reply is the argmax
of its teacher-forced row (``teacher_forced_match``); the recorded reply is then
teacher-forced either way, so every turn sees the same history whatever the model
produced. A replay that runs out of context or slots counts every turn wrong and the
example incomplete. Examples of a task in ``SHARED_SERVER_TASKS`` run on one
``Server`` per cell (one tenant's sessions); the others each on a private one.

``run_cell`` replays a cell's examples and returns its row: accuracy over scored
turns, completion, the means of the KV accounting (``jaxkv.metrics``), the bits and
bytes per live token after each prompt prefill (``kv_summary``), the reuse stage's
summary (``reuse_summary``), fidelity (``fidelity_of``: given a folder, the full cell
on the float pool writes each example's reference, the top ``FIDELITY_TOP`` tokens'
log-probabilities and the rest's mass per recorded token, and every other cell
reports its NLL increase and KL over those bins on the turns whose reply read a
managed cache), and the per-example counts under ``PER_EXAMPLE`` for paired
comparisons. ``run_cells`` runs cells in this process or across
``train.workers.pool_map``'s processes.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from jaxkv.cache.quantized_host import stored_bits
from jaxkv.tasks.example import reply_matches
from train.workers import pool_map

FIDELITY_TOP = 64  # tokens of the full cache's distribution kept per position (plus the rest's mass)
REPAIR_POLICIES = ("repairkv", "random", "oldest", "staleq", "wrongq", "refresh")
# A row's per-example counts (correct and scored turns, in example order): kept in the
# journal for paired comparisons, left out of results.csv and the tables.
PER_EXAMPLE = "per_example"
# Tasks whose sessions share one Server per cell (radix cache and segment store),
# as one tenant's sessions do: shared_docs exists to measure reuse across sessions.
SHARED_SERVER_TASKS = ("shared_docs",)
REUSE_TENANT = "tenant0"
# Session options a task needs: an MQ-NIAH document and its first question are one
# user message, so events must be free to evict inside the actionable message
# (``Session(protect_query=False)``), else nothing of the document is ever evicted
# before the question that needs it has been answered.
TASK_SESSION_OPTIONS = {"mqniah": {"protect_query": False}}


@dataclasses.dataclass(frozen=True)
class Cell:
    """One grid cell. With repair, ``budget`` is the budget the session runs at:
    ``base_budget`` for a repair cell, ``base_budget + repair_k`` for the matched
    no-repair cell (``repair_policy == "matched"``). ``kv_quant`` / ``kv_bits``:
    the session's KV precision (``"none"``: full precision; ``kv_bits`` None: the
    calibrated budget; ``kv_rotate``: the pool stores K/V rotated). A float
    ``budget`` is a fraction of each example's length (``session_budget``)."""

    method: str
    budget: int | float | None
    layout: str | None
    task: str
    repair_policy: str = "none"
    repair_k: int = 0
    base_budget: int | None = None
    kv_quant: str = "none"
    kv_bits: float | None = None
    reuse: str = "-"
    kv_rotate: bool = False


def replay_example(
    model,
    example,
    cell: Cell,
    *,
    max_new_tokens: int,
    max_positions: int,
    server=None,
    fidelity: Path | None = None,
    accuracy: str = "greedy",
    **session_options,
):
    """Replay one example through a fresh ``Session`` configured for ``cell``
    (on ``server`` when given, else on a private one).

    Returns ``(verdicts, completed, metrics dict, session)``: ``verdicts[i]`` says
    whether ``example.targets[i]`` was reproduced exactly (all False when the
    replay hit a context or memory error, ``completed`` False then). With
    ``fidelity`` (a folder), the metrics carry ``fidelity`` (``fidelity_of``).
    ``accuracy``: ``"greedy"`` (each scored turn generated and matched) or
    ``"teacher"`` (no generation: ``teacher_forced_match`` on the recorded reply).
    A chat template without a tool section gets the example with its tools
    inlined as text (``jaxkv.tasks.example.for_template``)."""
    import jaxkv
    from jaxkv.serving import Session
    from jaxkv.tasks.example import for_template

    example = for_template(example, model.tokenizer)

    policy = None if cell.method == "full" else cell.method
    options = {**TASK_SESSION_OPTIONS.get(cell.task, {}), **session_options}
    assistant_at = [j for j, m in enumerate(example.messages) if m.get("role") == "assistant"]
    last = max(t.message_index for t in example.targets)
    if policy is not None:
        options.update(policy=policy, budget=session_budget(cell.budget, model.tokenizer, example, last), layout=cell.layout)
    if cell.repair_policy in REPAIR_POLICIES:
        options.update(repair=cell.repair_k, repair_policy=cell.repair_policy)
    else:
        options.pop("repair_wrong_signal", None)
    if cell.kv_quant != "none":
        options["kv_quant"] = cell.kv_quant
        if cell.kv_bits is not None:
            options["kv_bits"] = cell.kv_bits
        if cell.kv_rotate:
            options["kv_rotate"] = True
    else:
        options.pop("kv_allocation", None)
    if cell.reuse != "-":
        options.update(reuse=cell.reuse, tenant=REUSE_TENANT)
    if server is not None:
        session = server.session(max_new_tokens=max_new_tokens, **options)
    else:
        session = Session(model, max_positions=max_positions, max_new_tokens=max_new_tokens, **options)
    try:
        turns = session.replay(
            example.messages[: last + 1],
            example.tools or None,
            generate=accuracy == "greedy",
            max_new_tokens=max_new_tokens,
            return_logits="reply" if fidelity is not None or accuracy == "teacher" else False,
        )
    except (jaxkv.ContextLengthError, jaxkv.OutOfSlotsError):
        return [False] * len(example.targets), False, session.metrics.as_dict(), session
    by_index = dict(zip(assistant_at, turns))
    if accuracy == "teacher":
        verdicts = [teacher_forced_match(by_index[t.message_index]) for t in example.targets]
    else:
        verdicts = [reply_matches(t, by_index[t.message_index].generated) for t in example.targets]
    metrics = session.metrics.as_dict()
    if fidelity is not None:
        metrics["fidelity"] = fidelity_of(turns, cell, example, Path(fidelity))
    return verdicts, True, metrics, session


def session_budget(budget, tokenizer, example, last: int) -> int:
    """A cell's budget for one example: an integer as given; a fraction in (0, 1)
    of the example's length, the tokens of its conversation up to the last scored
    turn (message ``last``) rendered with the model's template (``--budgets 0.5,0.65``)."""
    if isinstance(budget, float):
        from jaxkv.chat import render

        n = render(tokenizer, example.messages[: last + 1], example.tools or None, add_generation_prompt=False).ids.size
        return max(1, round(budget * n))
    return budget


def recorded_logp(turn) -> np.ndarray | None:
    """``[n, V]`` log-probabilities predicting a replayed turn's recorded reply tokens
    (the prompt's last row, then every reply row but the last), or None."""
    from train.haystack_measure import log_softmax

    if turn.target_ids is None or turn.target_logits is None or not len(turn.target_ids):
        return None
    rows = np.concatenate([np.asarray(turn.prompt_logits, np.float32)[-1:], np.asarray(turn.target_logits, np.float32)[:-1]])
    return log_softmax(rows).astype(np.float32)


def teacher_forced_match(turn) -> bool:
    """Whether every token of a turn's recorded reply is the argmax of its
    teacher-forced row: exactly what greedy decoding from the same cache would
    reproduce, token for token (by induction on the position), without decoding.
    Stricter than ``reply_matches`` (the whole reply, reasoning included, not only
    the call), and computed from the logits a replay brings back anyway."""
    logp = recorded_logp(turn)
    if logp is None:
        return False
    return bool(np.array_equal(logp.argmax(-1), np.asarray(turn.target_ids)[: len(logp)]))


def binned_reference(logp_NV: np.ndarray, top: int = FIDELITY_TOP) -> dict:
    """The full cache's distributions, compressed: per position the ``top`` most
    likely token ids, their log-probabilities and the log of the rest's mass."""
    k = min(top, logp_NV.shape[-1])
    ids = np.argpartition(-logp_NV, k - 1, axis=-1)[:, :k]
    top_logp = np.take_along_axis(logp_NV, ids, axis=-1)
    rest = np.clip(1.0 - np.exp(top_logp.astype(np.float64)).sum(-1), 0.0, 1.0)
    return {"ids": ids.astype(np.int32), "logp": top_logp.astype(np.float32), "rest": rest.astype(np.float64)}


def binned_kl(ref: dict, logp_NV: np.ndarray) -> np.ndarray:
    """KL(full || managed) per position over the reference's bins (its top tokens
    and the rest), from the managed cache's full ``logp``. By the data processing
    inequality it is at most the KL over the whole vocabulary, and equal to it when
    the top tokens are the whole vocabulary."""
    p = np.exp(ref["logp"].astype(np.float64))
    q = np.exp(np.take_along_axis(logp_NV, ref["ids"], axis=-1).astype(np.float64))
    q_rest = np.clip(1.0 - q.sum(-1), 1e-300, 1.0)
    p_rest = ref["rest"]
    kl = (p * (ref["logp"] - np.log(np.maximum(q, 1e-300)))).sum(-1)
    kl += np.where(p_rest > 0, p_rest * (np.log(np.maximum(p_rest, 1e-300)) - np.log(q_rest)), 0.0)
    return np.maximum(kl, 0.0)


def is_reference(cell: Cell) -> bool:
    """Whether ``cell`` writes the fidelity reference: the full cache on the float pool."""
    return cell.method == "full" and cell.kv_quant == "none"


def fidelity_of(turns, cell: Cell, example, folder: Path) -> dict:
    """The full cell on the float pool writes the example's reference; another cell
    compares with it on the turns whose reply read a managed cache: after its first
    compression event, or every turn on a quantized pool, whose KV is stored
    quantized from the first prefill on (module docstring)."""
    path = folder / f"{cell.task}-{example.seed}.npz"
    logps = [recorded_logp(t) for t in turns]
    if is_reference(cell):
        keep = [(i, lp) for i, lp in enumerate(logps) if lp is not None]
        refs = [binned_reference(lp) for _, lp in keep]
        nll = [-np.take_along_axis(lp, np.asarray(turns[i].target_ids)[: len(lp), None], -1)[:, 0] for i, lp in keep]
        folder.mkdir(parents=True, exist_ok=True)
        np.savez(
            path,
            turn=np.array([i for i, _ in keep], np.int32),
            offsets=np.cumsum([0] + [len(x) for x in nll]),
            nll=np.concatenate(nll) if nll else np.zeros(0),
            ids=np.concatenate([r["ids"] for r in refs]) if refs else np.zeros((0, 1), np.int32),
            logp=np.concatenate([r["logp"] for r in refs]) if refs else np.zeros((0, 1), np.float32),
            rest=np.concatenate([r["rest"] for r in refs]) if refs else np.zeros(0),
        )
        return {"tokens": 0, "dnll": 0.0, "kl": 0.0}
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the full cell's reference for this example (run the full cell first)")
    ref = np.load(path)
    tokens, dnll, kl = 0, 0.0, 0.0
    for j, i in enumerate(ref["turn"]):
        lp = logps[i] if i < len(logps) else None
        if lp is None or (turns[i].compressions == 0 and cell.kv_quant == "none"):
            continue
        a, b = ref["offsets"][j], ref["offsets"][j + 1]
        target = np.asarray(turns[i].target_ids)[: b - a]
        nll = -np.take_along_axis(lp, target[:, None], -1)[:, 0]
        tokens += b - a
        dnll += float(nll.sum() - ref["nll"][a:b].sum())
        kl += float(binned_kl({"ids": ref["ids"][a:b], "logp": ref["logp"][a:b], "rest": ref["rest"][a:b]}, lp).sum())
    return {"tokens": int(tokens), "dnll": dnll, "kl": kl}


def replay_cell(model, examples, cell: Cell, *, max_new_tokens: int, max_positions: int, progress=None, **session_options):
    """``replay_example`` over ``examples`` in order, yielding ``(verdicts, completed,
    metrics)`` per example; a WrongQ-K cell scores each example with the previous
    example's repair signal (another session's query)."""
    wrong_signal = None
    server = None
    if cell.task in SHARED_SERVER_TASKS:
        from jaxkv.serving import Server

        server = Server(
            model, max_positions=max_positions, kv_quant=None if cell.kv_quant == "none" else cell.kv_quant, kv_rotate=cell.kv_rotate
        )
    try:
        for ex in examples:
            options = dict(session_options)
            if cell.repair_policy == "wrongq":
                options["repair_wrong_signal"] = wrong_signal
            verdicts, done, metrics, session = replay_example(
                model, ex, cell, max_new_tokens=max_new_tokens, max_positions=max_positions, server=server, **options
            )
            wrong_signal = session.repair_signal or wrong_signal
            stage = session._stage("reuse")
            metrics = dict(metrics, reuse_reports=list(stage.reports) if stage is not None else [], kv=kv_summary(model, session))
            if server is None:
                session.close()  # its private server (pool, scheduler thread) goes now, not at exit
            if progress is not None:
                progress(1)
            yield verdicts, done, metrics
    finally:
        if server is not None:
            server.close()


def reuse_summary(reports) -> dict:
    """Per-request means and rates of the reuse stage's ``ReuseReport``s: prefill
    compute (token x layer units), prefill wall time, and acceptance / fallback
    rates over the spans the acceptance test judged (``-`` where nothing ran)."""
    if not reports:
        return {"prefill_tokens_computed": "-", "prefill_s": "-", "accept_rate": "-", "fallback_rate": "-"}
    spans = sum(r.spans for r in reports)
    return {
        "prefill_tokens_computed": float(np.mean([r.units for r in reports])),
        "prefill_s": float(np.mean([r.prefill_s for r in reports])),
        "accept_rate": sum(r.accepted for r in reports) / spans if spans else "-",
        "fallback_rate": sum(r.rejected for r in reports) / spans if spans else "-",
    }


def kv_summary(model, session) -> dict:
    """``bits`` (code bits), ``bytes``, ``tokens`` and ``elements`` summed over a
    session's requests (live KV after each prompt prefill); a full-precision session
    counts 16 bits and bf16 bytes per token (``jaxkv.cache.quantized_host.bytes_per_token``)."""
    from jaxkv.cache.quantized_host import FLOAT, bytes_per_token, elements_per_token

    cfg = model.config
    size = dict(head_dim=cfg.head_dim, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads)
    stage = session.quantization
    if stage is not None:
        recs = stage.records
        n = sum(r.tokens for r in recs)
        return {
            "bits": sum(r.bits for r in recs),
            "bytes": sum(r.bytes for r in recs),
            "tokens": n,
            "elements": n * elements_per_token(**size),
        }
    n = float(sum(r.peak_live_kv for r in session.metrics.requests)) or 1.0
    return {"bits": 16.0 * n, "bytes": bytes_per_token(FLOAT, **size) * n, "tokens": n, "elements": n * elements_per_token(**size)}


def run_cell(model, examples, cell: Cell, *, max_new_tokens: int, max_positions: int, progress=None, **session_options) -> dict:
    t0 = time.perf_counter()
    correct = scored = completed = 0
    metrics, reports, correct_E, scored_E, fidelity = [], [], [], [], []
    for verdicts, done, m in replay_cell(
        model, examples, cell, max_new_tokens=max_new_tokens, max_positions=max_positions, progress=progress, **session_options
    ):
        correct, scored, completed = correct + sum(verdicts), scored + len(verdicts), completed + done
        correct_E.append(int(sum(verdicts)))
        scored_E.append(len(verdicts))
        reports += m.pop("reuse_reports", [])
        fidelity.append(m.pop("fidelity", None))
        metrics.append(m)
    mean = {
        k: float(np.mean([m[k] for m in metrics]))
        for k in ("peak_request_tokens", "peak_live_kv", "raw_kv_reads", "effective_kv_reads", "prefix_hit_rate")
    }
    kv_tokens = sum(m["kv"]["tokens"] for m in metrics) or 1.0
    return {
        "method": cell.method,
        "budget": "-" if cell.budget is None else cell.budget,
        "layout": cell.layout or "-",
        "task": cell.task,
        "n": len(examples),
        "accuracy": correct / max(scored, 1),
        "completion": completed / max(len(examples), 1),
        **mean,
        "wall_s": time.perf_counter() - t0,
        "repair_policy": cell.repair_policy,
        "repair_k": cell.repair_k,
        "base_budget": "-" if cell.base_budget is None else cell.base_budget,
        "kv_quant": cell.kv_quant,
        "kv_bits": "-" if cell.kv_bits is None else cell.kv_bits,
        "kv_rotate": "on" if cell.kv_rotate else "off",
        "avg_bits": sum(m["kv"]["bits"] for m in metrics) / kv_tokens,
        "stored_bits": stored_bits(sum(m["kv"]["bytes"] for m in metrics), sum(m["kv"]["elements"] for m in metrics) or 1.0),
        "kv_bytes_per_token": sum(m["kv"]["bytes"] for m in metrics) / kv_tokens,
        "reuse": cell.reuse,
        **reuse_summary(reports),
        **fidelity_summary(fidelity, cell),
        PER_EXAMPLE: {
            "correct": correct_E,
            "scored": scored_E,
            **({"fidelity": [f for f in fidelity]} if any(f is not None for f in fidelity) else {}),
        },
    }


def fidelity_summary(per_example, cell: Cell) -> dict:
    """``fidelity_tokens``, ``nll_increase`` and ``kl`` of a cell, token-weighted over
    its examples (``-`` without ``--fidelity``, and for the reference cell, the full
    cache on the float pool: 0 by definition)."""
    got = [f for f in per_example if f is not None]
    if not got or is_reference(cell):
        return {"fidelity_tokens": "-", "nll_increase": "-", "kl": "-"}
    tokens = sum(f["tokens"] for f in got)
    if tokens == 0:
        return {"fidelity_tokens": 0, "nll_increase": "-", "kl": "-"}
    return {"fidelity_tokens": tokens, "nll_increase": sum(f["dnll"] for f in got) / tokens, "kl": sum(f["kl"] for f in got) / tokens}


# ----------------------------------------------------------------------------- many cells
def run_cells(model, examples, cells, setup, *, workers=1, bar=None, session_options=None):
    """Yield ``(cell, row)`` as cells finish: in this process in order, or across
    ``workers`` spawned processes in completion order. ``session_options`` go to
    every session (e.g. a ``kv_allocation`` under calibration)."""
    kw = dict(max_new_tokens=setup["max_new_tokens"], max_positions=setup["max_positions"], **(session_options or {}))
    jobs = [(examples[c.task], c, kw) for c in cells]
    for (_, cell, _), row in pool_map(
        _cell_job,
        jobs,
        setup["model"],
        workers=workers,
        model=model,
        bar=bar,
        label=lambda job: f"{job[1].task} {job[1].method} B={job[1].budget} {job[1].layout} {job[1].kv_quant}",
    ):
        yield cell, row


def _cell_job(model, job, progress):
    examples, cell, kw = job
    return run_cell(model, examples, cell, progress=progress, **kw)
