#!/bin/bash
# jaxkv's side, the retrieval and lm tasks: kvzip (and the full cache), every task at 2 examples, then on to 5
cd "$(git rev-parse --show-toplevel)"  # the round ran from a snapshot of commit 8435dc8
export PYTHONPATH=. JAX_PLATFORMS=cpu
OUT=eval/results/real_smollm2/kvzip_75/jaxkv
for N in 2 5; do
  for T in passkey niah_single niah_multikey lm; do
    nice -n 10 /work/main/.venv/bin/python -m eval.quality.real_model --task $T --context 2048 --n $N --ratios 0.5 --methods kvzip --settings agnostic \
       --out $OUT --journal examples_$T.jsonl --resume
  done
done
