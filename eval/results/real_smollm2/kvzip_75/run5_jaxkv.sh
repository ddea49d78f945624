#!/bin/bash
# jaxkv's side toward the size (2026-12-07): kvzip with one budget over the layers (kvzip:shared),
# question-agnostic at 0.5, 2k, every task at 20 examples, then 35, then 50, as far as the session's clock allows;
# niced under the head retrain; the older methods' cells on these seeds are ../jaxkv's journals.
cd "$(git rev-parse --show-toplevel)"
export PYTHONPATH=. JAX_PLATFORMS=cpu
OUT=eval/results/real_smollm2/kvzip_75/jaxkv
for N in 20 35 50; do
  for T in passkey niah_single niah_multikey lm multiq; do
    nice -n 19 /work/main/.venv/bin/python -m eval.quality.real_model --task $T --context 2048 --n $N --ratios 0.5 --methods kvzip:shared \
       --settings agnostic --out $OUT --journal examples_${T}_shared.jsonl --resume
  done
done
