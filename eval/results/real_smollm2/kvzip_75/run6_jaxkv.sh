#!/bin/bash
# jaxkv's side to the 50 examples (2026-12-07, ninth session): kvzip:shared, question-agnostic at 0.5, 2k,
# one task at a time straight to 50 (resuming run5's 20), nice 10, beside run6_kvpress.sh and nothing else heavy.
# It ran as two loops: multiq, lm and niah_multikey in one, passkey and niah_single in the other (the first loop
# started at 03:59 with every task in turn and was split at 04:27, while multiq ran).
cd "$(git rev-parse --show-toplevel)"
export PYTHONPATH=. JAX_PLATFORMS=cpu
OUT=eval/results/real_smollm2/kvzip_75/jaxkv
run() {
  for T in "$@"; do
    nice -n 10 /work/main/.venv/bin/python -m eval.quality.real_model --task $T --context 2048 --n 50 --ratios 0.5 --methods kvzip:shared \
       --settings agnostic --out $OUT --journal examples_${T}_shared.jsonl --resume
  done
}
run passkey niah_single &
run multiq lm niah_multikey
wait
