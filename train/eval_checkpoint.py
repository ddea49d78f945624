"""Held-out accuracy of one trainer checkpoint at a chosen sequence length.

    JAX_PLATFORMS=cpu python -m train.eval_checkpoint --out runs/embedded --step 875 --seq-len 512

The trainer scores its held-out set at the final ``--seq-len`` only, which says
nothing while the curriculum is still on short sequences (positions past the
current stage were never trained). This restores ``--out/ckpt/<step>`` (orbax) and
prints the trainer's teacher-forced metrics (``heldout_accuracy``) on held-out
conversations that fit ``--seq-len``, plus the raw needle-document accuracy of the
warm-up drill (``train.copy_drills`` format ``needles``, 128 tokens). Assumes
the checkpoint was trained with the current ``embedded_tokenizer`` and ``--size``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxkv.tasks.words import IDENTIFIERS
from jaxkv.models.transformer import Transformer
from train.embedded_model import (
    RAW_DRILL_BATCH,
    RAW_DRILL_LEN,
    SIZES,
    embedded_tokenizer,
    heldout_accuracy,
    heldout_sequences,
    make_optimizer,
    make_predict,
    model_config,
)
from train.copy_drills import Formats, raw_batch


def evaluate_checkpoint(out: str, step: int, seq_len: int, size: str = "agent", n: int = 16, seed: int = 0) -> dict:
    tok = embedded_tokenizer()
    cfg = model_config(SIZES[size], len(tok), tok.convert_tokens_to_ids("<|im_end|>"), 4096)
    graphdef, params = nnx.split(Transformer(cfg, jnp.float32, rngs=nnx.Rngs(0)), nnx.Param)
    opt_state = make_optimizer(1e-3, 10, 1, 0.0, 1.0)[0].init(params)  # structure only
    manager = ocp.CheckpointManager(Path(out, "ckpt").absolute())
    if step not in manager.all_steps():
        raise SystemExit(f"no checkpoint {step} in {out}/ckpt (have {sorted(manager.all_steps())})")
    params = manager.restore(step, args=ocp.args.StandardRestore({"params": params, "opt_state": opt_state}))["params"]
    predict = make_predict(graphdef)
    seqs = heldout_sequences(tok, seed, n, seq_len)
    copy_ids = np.asarray(tok.convert_tokens_to_ids(sorted(IDENTIFIERS)), np.int32)
    row = {"step": step, "seq_len": seq_len, "sequences": len(seqs)}
    row.update(heldout_accuracy(predict, params, seqs, seq_len, tok.pad_token_id, 4, copy_ids))
    tokens, mask = raw_batch(Formats(tok, RAW_DRILL_LEN, 8, 0.2).needles, 10**9 + seed, RAW_DRILL_BATCH, RAW_DRILL_LEN)
    pred = np.asarray(predict(params, tokens))
    row["raw_needle_acc"] = float(((pred[:, :-1] == tokens[:, 1:]) * mask[:, :-1]).sum() / mask[:, :-1].sum())
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the trainer's --out folder")
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--size", choices=sorted(SIZES), default="agent")
    p.add_argument("--n", type=int, default=16, help="held-out conversations tried (those that fit are scored)")
    args = p.parse_args(argv)
    print(json.dumps(evaluate_checkpoint(args.out, args.step, args.seq_len, args.size, args.n)))


if __name__ == "__main__":
    main()
