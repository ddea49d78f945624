#!/bin/bash
# The sixth head on the 50 held-out traces of ../../cells.jsonl (2026-12-07, 01:55-02:17 UTC, 1,308 s, nice 15,
# beside two KVzip evaluations at nice 19). Before it: the full cell's journal line of ../../cells.jsonl and
# ../../fidelity/ copied here (--resume skips the full cell; the copy was deleted after, identical to the parent's).
cd "$(git rev-parse --show-toplevel)"
export JAX_PLATFORMS=cpu PYTHONPATH=.
D=eval/results/real_smollm2_intentkv/head_v6_rows/len1472_n50_v6
nice -n 15 python -m eval.quality.harness --model smollm2-135m-instruct --task agent --methods full,intentkv \
    --budgets 0.5,0.65 --layouts dead_slot --n 50 --length 1472 --accuracy teacher --fidelity --compare-to best \
    --focus intentkv --workers 1 --resume --out $D
