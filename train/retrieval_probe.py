"""How fast does the embedded model's shape learn in-context copying? A probe for the trainer.

    JAX_PLATFORMS=cpu python -m train.retrieval_probe --format repeat --steps 200 --seq-len 128 --batch 32

Trains a fresh ``--size`` model (the trainer's shapes, tokenizer and optimizer) on
one synthetic copy format and prints held-out accuracy of the copy targets every
``--every`` steps (teacher-forced argmax). The held-out set is the format itself,
except the ``mix`` formats, scored on their needle half. No chat template: raw token
sequences, loss on the copy targets only.

The formats and their batches: ``train.copy_drills``.

Initialisation flags: ``--init-copy`` (the trainer's ``copy_circuit_init``), or its
parts ``--mimetic``, ``--prev-head 1,2,3,4``, ``--embed-mean``, ``--qk-gain``.

Measured results and what they mean for the trainer: the "What made copying
start" and "Earlier models" sections of ``jaxkv/assets/embedded-agent/README.md``.
"""

from __future__ import annotations

import argparse
import json
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.models.transformer import Transformer
from train.copy_drills import FORMATS, Formats, raw_batch
from train.embedded_model import (
    SIZES,
    copy_circuit_init,
    mimetic_init,
    positional_heads_prior,
    scale_qk_norm,
    shared_embedding_direction,
    embedded_tokenizer,
    make_optimizer,
    make_predict,
    make_train_step,
    model_config,
    with_targets,
)


def run(args) -> list[dict]:
    tok = embedded_tokenizer()
    formats = Formats(tok, args.seq_len, args.pairs, args.filler)
    make = getattr(formats, args.format)
    heldout_make = getattr(
        formats,
        {
            "mix": "needles",
            "mix_adjacent": "adjacent",
            "mix_nospace": "nospace",
            "chunks_adjacent": "adjacent",
            "chunks_nospace": "nospace",
        }.get(args.format, args.format),
    )

    batch = lambda seed, builder: raw_batch(builder, seed, args.batch, args.seq_len)

    cfg = model_config(SIZES[args.size], len(tok), 0, 4096)
    graphdef, params = nnx.split(Transformer(cfg, jnp.float32, rngs=nnx.Rngs(args.seed)), nnx.Param)
    if args.init_copy:
        params = copy_circuit_init(params, cfg, args.seed, "copy", layer1_head=args.layer1_head)
    if args.embed_mean or args.prev_head:
        params = shared_embedding_direction(params, args.seed)
    if args.mimetic:
        params = mimetic_init(params, args.seed, qk="qk" in args.mimetic, ov="ov" in args.mimetic)
    optimizer, _ = make_optimizer(args.lr, args.steps, args.warmup, 0.01, 1.0)
    if args.prev_head:
        offsets = tuple(int(d) for d in args.prev_head.split(","))
        params = positional_heads_prior(params, cfg.rope.theta, cfg.head_dim, offsets)
    params = scale_qk_norm(params, args.qk_gain, skip_layers=(0,) if args.prev_head else ())
    opt_state = optimizer.init(params)

    train_step, predict = make_train_step(graphdef, optimizer), make_predict(graphdef)

    held_tokens, held_mask = batch(10**9 + args.seed, heldout_make)
    rows, t0 = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        tokens, mask = batch(args.seed * 1_000_003 + step, make)
        params, opt_state, loss, _ = train_step(params, opt_state, with_targets({"tokens": tokens, "loss_mask": mask}))
        if step % args.every == 0 or step == args.steps:
            pred = np.asarray(predict(params, held_tokens))
            hits = (pred[:, :-1] == held_tokens[:, 1:]) * held_mask[:, :-1]
            row = {
                "step": step,
                "loss": round(float(loss), 3),
                "accuracy": round(float(hits.sum() / held_mask[:, :-1].sum()), 3),
                "seconds": round(time.perf_counter() - t0, 1),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--format", choices=FORMATS, default="repeat")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--pairs", type=int, default=8, help="needles per document (needles, adjacent, nospace, mix)")
    p.add_argument("--filler", type=float, default=0.2, help="chance that a document sentence is filler")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--size", choices=sorted(SIZES), default="agent")
    p.add_argument("--every", type=int, default=50)
    p.add_argument(
        "--mimetic", choices=("", "qk", "ov", "qkov"), default="", help="mimetic attention init (train.embedded_model.mimetic_init)"
    )
    p.add_argument("--init-copy", action="store_true", help="the trainer's copy init (train.embedded_model.copy_circuit_init)")
    p.add_argument("--layer1-head", type=int, default=1, help="with --init-copy: the layer-1 positional head (1) or not (0)")
    p.add_argument("--embed-mean", action="store_true", help="shared embedding direction at init")
    p.add_argument("--prev-head", default="", help="positional head priors in layer 0, offsets such as 1 or 1,2,3,4 (implies --embed-mean)")
    p.add_argument("--qk-gain", type=float, default=1.0, help="initial q/k RMSNorm gain (attention sharpness)")
    p.add_argument("--seed", type=int, default=0)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
