#!/bin/bash
# kvpress's side of multiq (the first run, 28 presses, was killed by the kernel's OOM killer at 5.6 GB before its first example): eleven presses
cd "$(git rev-parse --show-toplevel)"  # the round ran from a snapshot of commit 8435dc8
export PYTHONPATH=.
OUT=eval/results/real_smollm2/kvzip_75/kvpress
PR="KVzipPress,SnapKVPress,StreamingLLMPress,TOVAPress,KeyDiffPress,ExpectedAttentionPress,PyramidKVPress,LagKVPress,CURPress,AdaKVPress(KeyDiffPress),CriticalKVPress(ExpectedAttentionPress)"
for N in 3 10; do
  nice -n 10 /work/main/.venv/bin/python -m eval.quality.kvpress_side --task multiq --context 2048 --n $N --ratios 0.5 --settings agnostic \
     --presses "$PR" --threads 1 --out $OUT --journal examples_multiq.jsonl --resume
done
