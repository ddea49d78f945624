#!/bin/bash
# kvzip + RepairKV (K = 128) on multiq, the repair cell alone (a kvzip session runs its passes at every turn past its budget)
cd "$(git rev-parse --show-toplevel)"  # the round ran from a snapshot of commit 8435dc8
export PYTHONPATH=. JAX_PLATFORMS=cpu
OUT=eval/results/real_smollm2/kvzip_75/jaxkv
nice -n 10 /work/main/.venv/bin/python -m eval.quality.real_model --task multiq --context 2048 --n 3 --repair 128 --repair-method kvzip --repair-ratio 0.5 \
   --repair-cells repairkv --out $OUT --resume
