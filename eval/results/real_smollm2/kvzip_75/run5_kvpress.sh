#!/bin/bash
# kvpress's side toward the size (2026-12-07): KVzipPress alone, question-agnostic at 0.5, 2k, every task
# at 20 examples, then 35, then 50 (multiq included), as far as the session's clock allows; the other presses'
# cells on these seeds are the older journals. One thread, niced under the other jobs.
cd "$(git rev-parse --show-toplevel)"
export PYTHONPATH=.
OUT=eval/results/real_smollm2/kvzip_75/kvpress
for N in 20 35 50; do
  for T in passkey niah_single niah_multikey lm multiq; do
    J=examples_$T.jsonl; [ $T = multiq ] && J=examples_multiq_kvzip.jsonl
    nice -n 19 /work/main/.venv/bin/python -m eval.quality.kvpress_side --task $T --context 2048 --n $N --ratios 0.5 --settings agnostic \
       --presses KVzipPress --threads 1 --out $OUT --journal $J --resume
  done
done
