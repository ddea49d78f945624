#!/bin/bash
# After run5_jaxkv.sh's 20-example round: one-set kvzip (the policy's default) on lm at 20 examples, the task where
# its keep set parted from KVzipPress's (+0.171 nats on 2 examples), niced as run5_jaxkv.sh.
cd "$(git rev-parse --show-toplevel)"
export PYTHONPATH=. JAX_PLATFORMS=cpu
OUT=eval/results/real_smollm2/kvzip_75/jaxkv
nice -n 19 /work/main/.venv/bin/python -m eval.quality.real_model --task lm --context 2048 --n 20 --ratios 0.5 --methods kvzip \
   --settings agnostic --out $OUT --journal examples_lm.jsonl --resume
