#!/bin/bash
# jaxkv's side of issue 75's round (niced): every task at 10 examples, the kvzip + RepairKV trio on multiq, then on to 20
cd "$(git rev-parse --show-toplevel)"  # the round ran from a snapshot of commit 8435dc8
export PYTHONPATH=. JAX_PLATFORMS=cpu
OUT=eval/results/real_smollm2/kvzip_75/jaxkv
for N in 10 20; do
  for T in multiq passkey niah_single niah_multikey lm; do
    M=kvzip; [ $T = multiq ] && M=kvzip,kvzip:layer,snapkv,keydiff,keydiff:layer,expected_attention,streaming_llm,tova:layer
    nice -n 10 /work/main/.venv/bin/python -m eval.quality.real_model --task $T --context 2048 --n $N --ratios 0.5 --methods $M --settings agnostic \
       --out $OUT --journal examples_$T.jsonl --resume
  done
  nice -n 10 /work/main/.venv/bin/python -m eval.quality.real_model --task multiq --context 2048 --n $N --repair 128 --repair-method kvzip --repair-ratio 0.5 \
       --out $OUT --resume
done
