"""Train the IntentKV residual head (ALGORITHMS.md §4) on rows from ``train.intentkv_data``.

    JAX_PLATFORMS=cpu python -m train.intentkv_head --data runs/intentkv-data --out runs/intentkv-head [--quick]

The base model is frozen: its features were captured once by ``train.intentkv_data``
(``k̄``, the Phase-1 score ``s``, ``m̄``, the query span, labels). Only the head
(``jaxkv.policies.intentkv_head``, fp32, split once) is trained.

Loss per row (ALGORITHMS.md §4 defaults), over its labelled candidates
(``y ∈ {0, 1}``; −1 and forced positions are ignored), with ``z = s + α·r``:

* ``L_bce``: BCE on ``z`` as a logit, positives weighted ``w+ = clip((1−p)/p, 1, 50)``,
  ``p`` the row's positive rate, averaged over labelled candidates;
* ``L_rank``: mean over (positive, hard negative) pairs of ``softplus(γ − (z_pos −
  z_neg))`` against the ``k_neg = 16`` highest-scoring negatives, ``γ = 1``;
* ``L_keep``: mean over candidates of ``sigmoid(z)``;
* ``L_norm``: the row's ``mean (‖m_pre‖ − 1)²`` (memory before projection). The
  memory is built from the frozen model's queries, so this term is a constant
  here (no gradient); it is reported so the objective is the paper's.

``L = L_bce + 0.5·L_rank + 0.01·L_keep + 0.01·L_norm``, averaged over the rows of a
step. AdamW (lr 1e-4, weight decay 0.01; ``--lr``...), linear warm-up from
``lr/(warmup+1)`` then cosine decay to 5% of the peak, global-norm clipping (1.0), gradient accumulation
(``optax.MultiSteps``: ``--micro-batch`` rows per micro-step, ``--accum`` micro-steps
per update). Two epochs; each epoch shuffles the sessions (traces, seeded) and
replays each session's rows in increasing turn order, as the memory accumulates at
inference. α is learned unclipped; held-out metrics clip it to ``[0, alpha_max]``
as inference does.

Held-out metrics (every ``--eval-every`` updates and at the end), on the held-out
split's rows, for ``z`` and for the rule ``s`` alone:

* ``recall@B``: the share of positives kept by ``jaxkv.policies.select`` at budget
  ``B`` (forced = the row's protected prefix and query span, every other prompt
  position a candidate), over rows with more than ``B`` positions (rows where an
  event would run), for ``B`` in ``--budgets`` (1024, 1280, 1536: the harness's);
* ``auc``: ROC-AUC of the score between positive and negative candidates, per row,
  averaged over rows (ranking happens within a row);
* ``mass@B`` (rows generated with ``read_mass``): the share of the candidates'
  attention mass from the next replies that the kept set holds at budget ``B``,
  over the same rows as ``recall@B``; it depends on no label, so heads trained on
  different labels compare on it;
* the held-out loss.

``--measure-labels SPEC,...`` (default ``actions``) measures the final head once more
on each other label spec's held-out rows (``summary.json``'s ``heldout_final_on``
and the card), so heads trained on different labels are compared on one yardstick.

Reproducibility: the step order is a pure function of ``--seed`` and the epoch;
the head's initial weights of ``--seed``, or ``--init HEAD_FOLDER``'s (a warm start
from a trained head; its ``HeadConfig`` must match). Orbax checkpoints (``OUT/ckpt``) every
``--ckpt-every`` updates; a rerun resumes from the latest (``--restart`` ignores
them). Outputs in ``--out``: ``metrics.jsonl``, ``training.png`` (loss and held-out
metrics), ``head.safetensors`` + ``head.json`` (config, base model, training record),
``summary.json`` and ``README.md`` (the head's card). ``--export DIR`` copies the
head, its plot and card to ``DIR``: ``<model folder>/intentkv-head`` is where
``Session(model, policy="intentkv")`` finds a model's head
(``jaxkv.serving.stages.retention.head_folder_of``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import tqdm

from jaxkv.markdown import md_table
from jaxkv.policies import select
from jaxkv.errors import ConfigError
from jaxkv.policies.intentkv_head import Head, HeadConfig, alpha_of, combine, init_head, load_head, residual_scores, save_head
from train.intentkv_data import label_array, label_keys, load_meta, load_shards

BUDGETS = (1024, 1280, 1536)
PAD_TO = 256  # rows are padded to a multiple of this (few compiled shapes)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Attributes:
    w_max: cap of the positive weight ``w+``; 50.
    gamma: rank margin γ; 1.
    k_neg: hard negatives per positive; 16.
    rank: λ_rank; 0.5.
    keep: λ_keep; 0.01.
    norm: λ_norm; 0.01.
    """

    w_max: float = 50.0
    gamma: float = 1.0
    k_neg: int = 16
    rank: float = 0.5
    keep: float = 0.01
    norm: float = 0.01


# -- data ----------------------------------------------------------------------------------
class Rows:
    """Every row of a split that has a positive under ``labels`` (a label spec,
    ``train.intentkv_data.label_array``: the shards keep a row when any variant
    has one), with views per row (see ``train.intentkv_data``)."""

    def __init__(self, shards: list[dict], labels: str = "actions"):
        if not shards or sum(s["row_len"].size for s in shards) == 0:
            raise SystemExit("no rows: generate them with `python -m train.intentkv_data` first")
        try:
            self.labels = [label_array(s, labels) for s in shards]
        except KeyError as e:
            raise SystemExit(str(e)) from None
        self.items = []  # (shard, row index) in shard order
        self.shards = shards
        for si, s in enumerate(shards):
            off = s["row_offset"]
            self.items += [(si, r) for r in range(s["row_len"].size) if (self.labels[si][off[r] : off[r + 1]] == 1).any()]
        self.session = np.asarray([self._get(i, "row_seed") for i in range(len(self.items))], np.int64)
        self.turn = np.asarray([self._get(i, "row_turn") for i in range(len(self.items))], np.int32)
        self.length = np.asarray([self._get(i, "row_len") for i in range(len(self.items))], np.int32)
        self.head_dim = int(shards[0]["kbar"].shape[1])

    def __len__(self):
        return len(self.items)

    def _get(self, i, key):
        si, r = self.items[i]
        return self.shards[si][key][r]

    def row(self, i: int) -> dict[str, np.ndarray]:
        si, r = self.items[i]
        s = self.shards[si]
        n = int(s["row_len"][r])
        t = int(s["row_trace"][r])
        k0 = int(s["trace_offset"][t])
        o0 = int(s["row_offset"][r])
        a, b = (int(x) for x in s["row_span"][r])
        p = int(s["row_protected"][r])
        if "forced" in s:  # managed rows (``--events managed``): the session's own masks
            forced = s["forced"][o0 : o0 + n].astype(bool)
            span = s["span"][o0 : o0 + n].astype(bool)
        else:
            forced = np.zeros(n, bool)
            forced[:p] = True
            forced[a:b] = True
            span = np.zeros(n, bool)
            span[a:b] = True
        mass = s["read_mass"][o0 : o0 + n] if "read_mass" in s else np.zeros(n, np.float32)
        return {
            "kbar": s["kbar"][k0 : k0 + n],
            "s": s["s"][o0 : o0 + n],
            "labels": self.labels[si][o0 : o0 + n],
            "forced": forced,
            "span": span,
            "mbar": s["row_mbar"][r],
            "norm_err": s["row_norm_err"][r],
            "mass": mass,
        }

    def batch(self, idx) -> dict[str, np.ndarray]:
        """Rows ``idx`` padded to a common length (padding: no candidate, label −1)."""
        rows = [self.row(int(i)) for i in idx]
        N = -(-max(r["kbar"].shape[0] for r in rows) // PAD_TO) * PAD_TO
        B, D = len(rows), self.head_dim
        out = {
            "kbar": np.zeros((B, N, D), np.float32),
            "s": np.zeros((B, N), np.float32),
            "labels": np.full((B, N), -1, np.int8),
            "forced": np.zeros((B, N), bool),
            "mass": np.zeros((B, N), np.float32),
            "valid": np.zeros((B, N), bool),
            "span": np.zeros((B, N), bool),
            "mbar": np.stack([r["mbar"] for r in rows]).astype(np.float32),
            "norm_err": np.asarray([r["norm_err"] for r in rows], np.float32),
        }
        for b, r in enumerate(rows):
            n = r["kbar"].shape[0]
            for key in ("kbar", "s", "labels", "forced", "span", "mass"):
                out[key][b, :n] = r[key]
            out["valid"][b, :n] = True
        return out


def epoch_order(rows: Rows, seed: int, epoch: int) -> np.ndarray:
    """Row indices of one epoch: sessions shuffled (seeded by epoch), each session's
    rows in increasing turn order."""
    sessions = np.unique(rows.session)
    np.random.default_rng([seed, epoch]).shuffle(sessions)
    rank = {int(s): i for i, s in enumerate(sessions)}
    return np.asarray(sorted(range(len(rows)), key=lambda i: (rank[int(rows.session[i])], int(rows.turn[i]))))


# -- loss ----------------------------------------------------------------------------------
def row_loss(z_N, labels_N, cand_N, norm_err, lc: LossConfig):
    """The four loss terms of one row (see the module docstring)."""
    labelled = (labels_N >= 0) & cand_N
    pos = (labels_N == 1) & labelled
    neg = (labels_N == 0) & labelled
    n_lab = jnp.maximum(labelled.sum(), 1)
    p = pos.sum() / n_lab
    w_pos = jnp.clip((1.0 - p) / jnp.maximum(p, 1e-9), 1.0, lc.w_max)
    bce = jnp.sum(jnp.where(pos, w_pos * jax.nn.softplus(-z_N), 0.0) + jnp.where(neg, jax.nn.softplus(z_N), 0.0)) / n_lab
    z_neg, _ = jax.lax.top_k(jnp.where(neg, z_N, -jnp.inf), lc.k_neg)
    neg_ok = jnp.isfinite(z_neg)
    pair = jax.nn.softplus(lc.gamma - (z_N[:, None] - jnp.where(neg_ok, z_neg, 0.0)[None, :]))
    pair_ok = pos[:, None] & neg_ok[None, :]
    rank = jnp.sum(jnp.where(pair_ok, pair, 0.0)) / jnp.maximum(pair_ok.sum(), 1)
    keep = jnp.sum(jnp.where(cand_N, jax.nn.sigmoid(z_N), 0.0)) / jnp.maximum(cand_N.sum(), 1)
    total = bce + lc.rank * rank + lc.keep * keep + lc.norm * norm_err
    return total, {"bce": bce, "rank": rank, "keep": keep, "norm": norm_err}


def batch_scores(graphdef, params, batch, alpha):
    """``z [B, N]`` of a padded batch (rows vmapped; the head is batched over candidates)."""
    r = jax.vmap(lambda k, m, sp: residual_scores(graphdef, params, k, m, sp))(batch["kbar"], batch["mbar"], batch["span"])
    return combine(batch["s"], r, alpha)


def batch_loss(graphdef, params, batch, lc: LossConfig, clip_alpha: float | None = None):
    z = batch_scores(graphdef, params, batch, alpha_of(params, clip_alpha))
    cand = batch["valid"] & ~batch["forced"]
    total, parts = jax.vmap(lambda *a: row_loss(*a, lc))(z, batch["labels"], cand, batch["norm_err"])
    return total.mean(), jax.tree.map(jnp.mean, parts)


def make_optimizer(args, total_updates: int):
    warmup = min(args.warmup, max(total_updates - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        args.lr / (warmup + 1), args.lr, max(warmup, 1), max(total_updates, warmup + 1), args.lr * 0.05
    )
    opt = optax.chain(optax.clip_by_global_norm(args.clip), optax.adamw(schedule, weight_decay=args.weight_decay))
    return optax.MultiSteps(opt, every_k_schedule=args.accum), schedule


def make_step(graphdef, optimizer, lc: LossConfig):
    @jax.jit
    def step(params, opt_state, batch):
        (loss, parts), grads = jax.value_and_grad(lambda p: batch_loss(graphdef, p, batch, lc), has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, parts, optax.tree.norm(grads)

    return step


# -- held-out metrics ----------------------------------------------------------------------
def roc_auc(score, y) -> float:
    """ROC-AUC of ``score`` for binary ``y`` (ties count one half); NaN without both classes."""
    from scipy.stats import rankdata

    pos, n = int(y.sum()), y.size
    if pos == 0 or pos == n:
        return float("nan")
    ranks = rankdata(score)
    return float((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * (n - pos)))


_select_rows = jax.jit(jax.vmap(select, in_axes=(0, 0, 0, None)))


def evaluate(graphdef, params, rows: Rows, lc: LossConfig, alpha_max: float, budgets=BUDGETS, batch_rows: int = 8):
    """Held-out loss, recall at each budget and per-row AUC, for ``z`` and for ``s``."""
    kept_pos = {(name, B): 0 for name in ("z", "s") for B in budgets}
    kept_mass = {(name, B): 0.0 for name in ("z", "s") for B in budgets}
    total_pos = {B: 0 for B in budgets}
    total_mass = {B: 0.0 for B in budgets}
    aucs = {"z": [], "s": []}
    losses = []
    score_fn = _eval_scores(graphdef, alpha_max)
    for start in range(0, len(rows), batch_rows):
        batch = rows.batch(range(start, min(len(rows), start + batch_rows)))
        z, loss = score_fn(params, batch, lc)
        z = np.asarray(z)
        losses.append(float(loss) * len(batch["s"]))
        cand = batch["valid"] & ~batch["forced"]
        lengths = batch["valid"].sum(axis=1)
        pos = batch["labels"] == 1
        for name, score in (("z", z), ("s", batch["s"])):
            for b in range(score.shape[0]):
                lab = cand[b] & (batch["labels"][b] >= 0)
                aucs[name].append(roc_auc(score[b][lab], pos[b][lab]))
            for B in budgets:
                kept = np.asarray(_select_rows(jnp.asarray(score), jnp.asarray(batch["forced"]), jnp.asarray(cand), B))
                event = lengths > B
                kept_pos[(name, B)] += int((kept & pos & cand)[event].sum())
                kept_mass[(name, B)] += float(np.where(kept & cand, batch["mass"], 0.0)[event].sum())
        for B in budgets:
            total_pos[B] += int((pos & cand)[lengths > B].sum())
            total_mass[B] += float(np.where(cand, batch["mass"], 0.0)[lengths > B].sum())
    out = {"heldout_loss": float(np.sum(losses) / len(rows))}
    for name in ("z", "s"):
        out[f"auc_{name}"] = float(np.nanmean(aucs[name]))
        for B in budgets:
            out[f"recall{B}_{name}"] = kept_pos[(name, B)] / max(total_pos[B], 1)
            if total_mass[B] > 0:  # rows generated with read_mass
                out[f"mass{B}_{name}"] = kept_mass[(name, B)] / total_mass[B]
    out["heldout_rows"] = len(rows)
    for B in budgets:
        out[f"events{B}"] = int(np.sum(rows.length > B))
    return out


@functools.lru_cache(maxsize=None)
def _eval_scores(graphdef, alpha_max):
    @functools.partial(jax.jit, static_argnums=2)
    def run(params, batch, lc):
        loss, _ = batch_loss(graphdef, params, batch, lc, clip_alpha=alpha_max)
        return batch_scores(graphdef, params, batch, alpha_of(params, alpha_max)), loss

    return run


# -- plot ------------------------------------------------------------------------------------
def plot(records: list[dict], path: Path, budgets=BUDGETS) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "auc_z" in r]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    if train:
        steps = np.asarray([r["update"] for r in train])
        loss = np.asarray([r["loss"] for r in train])
        axes[0].plot(steps, loss, alpha=0.3, color="C0", label="train (micro-batch)")
        k = max(1, len(loss) // 30)
        axes[0].plot(steps[k - 1 :], np.convolve(loss, np.ones(k) / k, mode="valid"), color="C0", label=f"train, mean of {k}")
    if evals:
        e_steps = [r["update"] for r in evals]
        axes[0].plot(e_steps, [r["heldout_loss"] for r in evals], "o-", color="C3", label="held-out")
        for i, B in enumerate(budgets):
            axes[1].plot(e_steps, [r[f"recall{B}_z"] for r in evals], "o-", color=f"C{i}", label=f"z (head), B={B}")
            axes[1].plot(e_steps, [r[f"recall{B}_s"] for r in evals], "--", color=f"C{i}", label=f"s (rule), B={B}")
        axes[2].plot(e_steps, [r["auc_z"] for r in evals], "o-", color="C0", label="z (head)")
        axes[2].plot(e_steps, [r["auc_s"] for r in evals], "--", color="C1", label="s (rule)")
    axes[0].set(title="loss", xlabel="update")
    axes[1].set(title="held-out recall of positives in the kept set", xlabel="update")
    axes[2].set(title="held-out ROC-AUC (per row, mean)", xlabel="update")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- training --------------------------------------------------------------------------------
def heldout_rows(data: Path, labels: str, max_rows: int | None = None) -> Rows:
    """The held-out split's rows under ``labels``, the first ``max_rows`` of them if given."""
    rows = Rows(load_shards(data, "heldout"), labels)
    if max_rows:
        rows.items, rows.length = rows.items[:max_rows], rows.length[:max_rows]
    return rows


def train(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data)
    train_rows = Rows(load_shards(data, "train"), args.labels)
    heldout = heldout_rows(data, args.labels, args.max_heldout_rows)
    lc = LossConfig()
    head_cfg = HeadConfig(head_dim=train_rows.head_dim, span_keys=args.span_keys)
    head = init_head(head_cfg, seed=args.seed)
    if args.init is not None:  # warm start: the same shapes, another head's weights
        start_head = load_head(args.init)
        if start_head.cfg != head_cfg:
            raise ConfigError(f"--init {args.init} has config {start_head.cfg}, the rows and flags ask for {head_cfg}")
        head = start_head
    graphdef, params = head.graphdef, head.params
    per_epoch = -(-len(train_rows) // args.micro_batch)
    micro_total = per_epoch * args.epochs if args.steps is None else args.steps * args.accum
    total_updates = max(1, micro_total // args.accum)
    optimizer, schedule = make_optimizer(args, total_updates)
    opt_state = optimizer.init(params)
    step_fn = make_step(graphdef, optimizer, lc)

    ckpt = ocp.CheckpointManager((out / "ckpt").absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
    start = 0
    if ckpt.latest_step() is not None and not args.restart:
        start = ckpt.latest_step()
        restored = ckpt.restore(start, args=ocp.args.StandardRestore({"params": params, "opt_state": opt_state}))
        params, opt_state = restored["params"], restored["opt_state"]
        tqdm.write(f"resumed from micro-step {start}")
    metrics_path = out / "metrics.jsonl"
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() and start else []
    records = [r for r in records if r.get("micro_step", 0) <= start]
    metrics_file = open(metrics_path, "w")
    for r in records:
        metrics_file.write(json.dumps(r) + "\n")

    def log(record):
        records.append(record)
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()

    meta = {
        "rows": len(train_rows),
        "heldout_rows": len(heldout),
        "sessions": int(np.unique(train_rows.session).size),
        "updates": total_updates,
        "micro_steps": micro_total,
        "params": int(sum(x.size for x in jax.tree.leaves(params))),
    }
    tqdm.write(json.dumps(meta))
    if start == 0:
        log({"update": 0, "micro_step": 0, **evaluate(graphdef, params, heldout, lc, head_cfg.alpha_max, args.budgets)})
        tqdm.write(json.dumps(records[-1]))
    losses = []
    t0 = time.perf_counter()
    stop = micro_total if args.stop_after is None else min(micro_total, args.stop_after * args.accum)
    bar = tqdm(range(start, stop), initial=start, total=micro_total, disable=args.quiet, desc="micro-steps")
    orders: dict[int, np.ndarray] = {}
    for m in bar:
        epoch, k = divmod(m, per_epoch)
        if epoch not in orders:
            orders[epoch] = epoch_order(train_rows, args.seed, epoch)
        idx = orders[epoch][k * args.micro_batch : (k + 1) * args.micro_batch]
        params, opt_state, loss, parts, gnorm = step_fn(params, opt_state, train_rows.batch(idx))
        loss = float(loss)
        losses.append(loss)
        update = (m + 1) // args.accum
        bar.set_postfix(loss=f"{loss:.3f}", alpha=f"{float(params['alpha'][...]):.3f}", lr=f"{float(schedule(update)):.1e}")
        log(
            {
                "update": update,
                "micro_step": m + 1,
                "epoch": epoch,
                "loss": loss,
                "grad_norm": float(gnorm),
                "alpha": float(params["alpha"][...]),
                "elapsed_s": round(time.perf_counter() - t0, 2),
                **{k: float(v) for k, v in parts.items()},
            }
        )
        last = m + 1 == stop
        at_update = (m + 1) % args.accum == 0
        if last or (at_update and update % args.eval_every == 0):
            log({"update": update, "micro_step": m + 1, **evaluate(graphdef, params, heldout, lc, head_cfg.alpha_max, args.budgets)})
            tqdm.write(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in records[-1].items()}))
        if last or (at_update and update % args.ckpt_every == 0):
            ckpt.save(m + 1, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
    ckpt.wait_until_finished()
    metrics_file.close()
    seconds = time.perf_counter() - t0

    evals = [r for r in records if "auc_z" in r]
    train_losses = [r["loss"] for r in records if "loss" in r]
    n_avg = max(1, min(len(train_losses) // 10, 50))
    summary = {
        "command": "python -m train.intentkv_head " + " ".join(args.argv),
        "labels": args.labels,
        "data": {**meta, "folder": str(data), "data_meta": load_meta(data)},
        "train_seconds_this_run": round(seconds, 1),
        "loss_first": float(np.mean(train_losses[:n_avg])) if train_losses else None,
        "loss_last": float(np.mean(train_losses[-n_avg:])) if train_losses else None,
        "loss_window": n_avg,
        "heldout_initial": evals[0] if evals else None,
        "heldout_final": evals[-1] if evals else None,
        "alpha": float(params["alpha"][...]),
    }
    # the same head measured on other labels (their own held-out rows): heads trained on
    # different labels compare on one yardstick
    summary["heldout_final_on"] = {}
    for spec in args.measure_labels:
        if spec == args.labels:
            continue
        other = heldout_rows(data, spec, args.max_heldout_rows)
        summary["heldout_final_on"][spec] = evaluate(graphdef, params, other, lc, head_cfg.alpha_max, args.budgets)
    trained = Head(head_cfg, graphdef, params)
    save_head(trained, out, base_model=_base_model(args), training=summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(records, out / "training.png", args.budgets)
    (out / "README.md").write_text(head_card(trained, _base_model(args), summary, args.budgets))
    if args.export:
        export_head(out, Path(args.export))
    return {"losses": losses, "summary": summary, "head": trained, "records": records}


CARD_FILES = ("head.safetensors", "head.json", "training.png", "README.md")


def data_command(data_meta: dict) -> str:
    """The ``train.intentkv_data`` command that wrote a data folder (from its ``meta.json``)."""
    args = dict(data_meta.get("args") or {})
    parts = data_parts(data_meta)
    if parts > 1:  # one process per K wrote the folder; meta.json is the last one's
        args["part"] = f"K/{parts}"
    flags = [f"--{k.replace('_', '-')} {v}" for k, v in args.items() if v is not None and not isinstance(v, bool)]
    flags += [f"--{k}" for k, v in args.items() if v is True]
    return "python -m train.intentkv_data " + " ".join(flags)


def head_card(head: Head, base_model: dict, summary: dict, budgets) -> str:
    """The head's card (``README.md`` beside it): what it is for, what it was
    trained on, and its held-out metrics against the rule it corrects."""
    n_params = sum(int(np.size(x)) for x in jax.tree.leaves(head.params))
    data = summary["data"].get("data_meta") or {}
    split = lambda name: data.get(name) or {}  # noqa: E731
    fin, ini = summary.get("heldout_final") or {}, summary.get("heldout_initial") or {}
    rows = [("ROC-AUC (per row)", "auc")] + [(f"recall at B = {b}", f"recall{b}") for b in budgets]
    if any(f"mass{b}_z" in fin for b in budgets):
        rows += [(f"attention mass kept at B = {b}", f"mass{b}") for b in budgets]
    cell = lambda m, key: f"{m.get(key, float('nan')):.3f}"  # noqa: E731
    table = md_table(
        ["metric", "rule `s` alone", "head, before training", "head `z`, trained"],
        [[label, cell(fin, key + "_s"), cell(ini, key + "_z"), cell(fin, key + "_z")] for label, key in rows],
        "lrrr",
    )
    other_tables = ""
    for spec, m in (summary.get("heldout_final_on") or {}).items():
        other_tables += (
            f"\nThe same head on `{spec}` labels ({m.get('heldout_rows', '?')} held-out rows):\n\n"
            + md_table(
                ["metric", "rule `s` alone", "head `z`, trained"],
                [[label, cell(m, key + "_s"), cell(m, key + "_z")] for label, key in rows],
                "lrr",
            )
            + "\n"
        )
    files = md_table(
        ["file", "what"],
        [
            ["`head.safetensors`", f"{n_params:,} float32 parameters"],
            ["`head.json`", "`HeadConfig`, the base model's signature, the training record"],
            ["`training.png`", "loss and held-out metrics during training"],
        ],
    )
    sig = base_model.get("signature") or {}
    return f"""# intentkv-head for {base_model.get("name", "unknown")}

IntentKV's learned residual head (ALGORITHMS.md §4): `z_i = s_i + α·r_i`, the
QueryMemory rule `s` plus a small head `r` on the frozen model's mean keys and
queries (`jaxkv/policies/intentkv_head.py`). `Session(model, policy="intentkv")`
finds it in the model's folder (`<model folder>/intentkv-head`), or pass
`head=PATH`. It refuses any other model (`jaxkv.ConfigError`): it was trained for
{", ".join(f"{k} {v}" for k, v in sig.items()) or "the model recorded in head.json"}.

{files}

## Training

    {data_command(data)}
    {summary["command"]}

- Data: `{summary["data"].get("folder")}`, model `{(data.get("args") or {}).get("model", "?")}`:
  {split("train").get("traces", "?")} training traces ({split("train").get("rows", "?")} rows, seeds
  {split("train").get("seeds")}) and {split("heldout").get("traces", "?")} held-out traces
  ({split("heldout").get("rows", "?")} rows, seeds {split("heldout").get("seeds")}), disjoint from every
  evaluation seed (`train.intentkv_data.check_seed_ranges`); data generation took {data.get("seconds", "?")} s{_per_process(data)}.
- Labels: `{summary["labels"]}`; {summary["train_seconds_this_run"]} s of training in the last run;
  loss {summary["loss_first"]:.4f} -> {summary["loss_last"]:.4f} (mean of {summary["loss_window"]} updates); α = {summary["alpha"]:.3f}.

## Held-out rows

{table}
{other_tables}"""


def data_parts(data_meta: dict) -> int:
    """How many ``--part`` processes wrote a data folder (from its ``meta.json``)."""
    return int(str((data_meta.get("args") or {}).get("part", "0/1")).split("/")[-1])


def _per_process(data_meta: dict) -> str:
    parts = data_parts(data_meta)
    return f" in the last of {parts} processes (K = 0..{parts - 1}) that ran side by side" if parts > 1 else ""


def export_head(out: Path, folder: Path) -> Path:
    """Copy the trained head and its card from ``out`` into ``folder`` (a model
    folder's ``intentkv-head``, where sessions find it)."""
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    for name in CARD_FILES:
        shutil.copy2(out / name, folder / name)
    return folder


def _base_model(args) -> dict:
    meta = load_meta(args.data) or {}
    model = (meta.get("args") or {}).get("model", "unknown")
    base = {"name": "embedded-agent" if model == "embedded" else str(model)}
    if meta.get("model_signature"):  # the model the rows came from (check_head_model)
        base["signature"] = meta["model_signature"]
    return base


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default="runs/intentkv-data", help="rows from `python -m train.intentkv_data`")
    p.add_argument("--out", default="runs/intentkv-head")
    p.add_argument(
        "--export", default=None, help="also copy the head and its card here, e.g. MODEL_FOLDER/intentkv-head (where sessions find it)"
    )
    p.add_argument(
        "--labels",
        default="actions",
        help="label spec (train.intentkv_data.label_array): actions (§4 future-action grounding, the default), "
        "cue (+ each match's cue tokens), read (what the next replies attend to), read@T (read at attention "
        "threshold T, from the rows' read_max), mass@F (the fraction F of each row's candidates the next replies "
        "spend the most attention on, from read_mass), or a union such as actions+read or actions+read@0.05",
    )
    p.add_argument(
        "--measure-labels",
        default="actions",
        help="comma list of label specs the trained head is also measured on (held-out recall and AUC of "
        "each spec's own held-out rows, in summary.json and the card), beside --labels",
    )
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=None, help="optimizer updates (default: --epochs over the rows)")
    p.add_argument("--micro-batch", type=int, default=4, help="rows per micro-step")
    p.add_argument("--accum", type=int, default=4, help="micro-steps per optimizer update (gradient accumulation)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=20, help="warm-up updates")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument("--span-keys", type=int, default=512, help="K̄_Q capacity (HeadConfig.span_keys)")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="held-out recall budgets")
    p.add_argument("--eval-every", type=int, default=100, help="updates between held-out evaluations")
    p.add_argument("--max-heldout-rows", type=int, default=None)
    p.add_argument("--ckpt-every", type=int, default=50, help="updates between checkpoints")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--init",
        default=None,
        help="start from this head folder's weights (a warm start; its HeadConfig must match) instead of --seed's initial weights",
    )
    p.add_argument("--stop-after", type=int, default=None, help="checkpoint, export and exit after this update")
    p.add_argument("--restart", action="store_true", help="ignore checkpoints in --out")
    p.add_argument("--quick", action="store_true", help="3 updates on the same 8 rows, 4 held-out rows (tests)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    args.argv = argv
    args.measure_labels = tuple(x for x in str(args.measure_labels).split(",") if x)
    try:
        for spec in (args.labels, *args.measure_labels):
            label_keys(spec)
    except ValueError as e:
        p.error(str(e))
    args.budgets = tuple(int(b) for b in str(args.budgets).split(","))
    if args.quick:
        args.steps = 3 if args.steps is None else args.steps
        args.micro_batch, args.accum, args.warmup = 8, 1, 1  # an epoch is one step: every step sees the same rows
        args.eval_every = args.ckpt_every = args.steps
        args.max_heldout_rows = args.max_heldout_rows or 4
    return args


def main(argv=None):
    result = train(parse_args(argv))
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
