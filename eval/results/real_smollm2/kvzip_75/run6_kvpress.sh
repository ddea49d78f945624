#!/bin/bash
# kvpress's side to the 50 examples (2026-12-07, ninth session): KVzipPress alone, question-agnostic at 0.5,
# 2k, each task straight to 50 (resuming run5's 20); one thread, nice 10, beside run6_jaxkv.sh and nothing else heavy.
# What ran, as parallel loops (the first loop started at 03:59 with every task in turn and was split as the others
# finished early): multiq then lm; passkey then niah_single; niah_multikey 35-49 (from 04:58), 27-34 (from
# 05:21) and 20-26 (from 05:31) in journals of their own (the report reads every examples*.jsonl, paired by seed).
cd "$(git rev-parse --show-toplevel)"
export PYTHONPATH=.
OUT=eval/results/real_smollm2/kvzip_75/kvpress
kvzip() {  # task, first example, how many, journal
  nice -n 10 /work/main/.venv/bin/python -m eval.quality.kvpress_side --task $1 --context 2048 --first $2 --n $3 --ratios 0.5 \
     --settings agnostic --presses KVzipPress --threads 1 --out $OUT --journal $4 --resume
}
(kvzip multiq 0 50 examples_multiq_kvzip.jsonl; kvzip lm 0 50 examples_lm.jsonl) &
(kvzip passkey 0 50 examples_passkey.jsonl; kvzip niah_single 0 50 examples_niah_single.jsonl) &
kvzip niah_multikey 35 15 examples_niah_multikey_35.jsonl &
kvzip niah_multikey 27 8 examples_niah_multikey_27.jsonl &
kvzip niah_multikey 20 7 examples_niah_multikey_20.jsonl &
wait
