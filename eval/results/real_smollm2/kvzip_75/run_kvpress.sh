#!/bin/bash
# the kvpress side of issue 75's round (one thread, niced): every task at 10 examples, then on to 20
cd "$(git rev-parse --show-toplevel)"  # the round ran from a snapshot of commit 8435dc8
export PYTHONPATH=.
OUT=eval/results/real_smollm2/kvzip_75/kvpress
P75="KVzipPress,PyramidKVPress,LagKVPress,CURPress,LeverageScorePress,NonCausalAttnPress,CompactorPress,CapPress,AdaKVPress(SnapKVPress),AdaKVPress(ExpectedAttentionPress),AdaKVPress(KeyDiffPress),CriticalKVPress(SnapKVPress),CriticalKVPress(ExpectedAttentionPress),CriticalAdaKVPress(SnapKVPress),CriticalAdaKVPress(ExpectedAttentionPress),ChunkKVPress(SnapKVPress),ChunkPress(SnapKVPress),EntropyGatedChunkKVPress(SnapKVPress),BlockPress(KeyDiffPress),MergingPress(KnormPress),KeyRerotationPress(SnapKVPress)"
P32="SnapKVPress,StreamingLLMPress,TOVAPress,RandomPress,KnormPress,ExpectedAttentionPress,KeyDiffPress"
for N in 10 20; do
  for T in multiq passkey niah_single niah_multikey lm; do
    PR=$P75; [ $T = multiq ] && PR="$P32,$P75"
    nice -n 10 /work/main/.venv/bin/python -m eval.quality.kvpress_side --task $T --context 2048 --n $N --ratios 0.5 --settings agnostic \
       --presses "$PR" --threads 1 --out $OUT --journal examples_$T.jsonl --resume
  done
done
