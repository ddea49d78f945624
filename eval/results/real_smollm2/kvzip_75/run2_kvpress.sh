#!/bin/bash
# kvpress's side, the retrieval and lm tasks: KVzipPress and the named presses, every task at 2 examples, then on to 4
cd "$(git rev-parse --show-toplevel)"  # the round ran from a snapshot of commit 8435dc8
export PYTHONPATH=.
OUT=eval/results/real_smollm2/kvzip_75/kvpress
PR="KVzipPress,PyramidKVPress,LagKVPress,CURPress,AdaKVPress(KeyDiffPress),CriticalKVPress(ExpectedAttentionPress)"
for N in 2 4; do
  for T in passkey niah_single niah_multikey lm; do
    nice -n 10 /work/main/.venv/bin/python -m eval.quality.kvpress_side --task $T --context 2048 --n $N --ratios 0.5 --settings agnostic \
       --presses "$PR" --threads 1 --out $OUT --journal examples_$T.jsonl --resume
  done
done
