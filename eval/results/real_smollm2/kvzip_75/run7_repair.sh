#!/bin/bash
# kvzip:shared + RepairKV (K = 128) on multiq, the protocol: each session compresses once, after the context
# (events="once", which --repair uses on multiq), and RepairKV promotes at every question's turn boundary; the trio
# (no repair at B, RepairKV at B, no repair at B + K), question-agnostic at 0.5, 2k, on the first examples of the
# 50-example cells' seeds. Two processes over two ranges of examples (a --repair run journals OUT/sessions.jsonl, so
# each range has a folder of its own, repair_once_<first>/). Run on 2026-12-07 with N=5 and stopped after 3 examples
# (06:11-06:20): RepairKV had next to nothing to restore (README, "KVzip + RepairKV").
cd "$(git rev-parse --show-toplevel)"
export PYTHONPATH=. JAX_PLATFORMS=cpu
R=eval/results/real_smollm2/kvzip_75
trio() {  # first example, how many
  nice -n 10 /work/main/.venv/bin/python -m eval.quality.real_model --task multiq --context 2048 --first $1 --n $2 --repair 128 \
     --repair-method kvzip:shared --repair-ratio 0.5 --out $R/repair_once_$1 --resume
}
trio 0 ${N:-10} &
trio ${N:-10} ${N:-10} &
wait
