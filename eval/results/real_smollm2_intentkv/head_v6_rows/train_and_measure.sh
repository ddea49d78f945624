#!/bin/bash
# Issue #75, the sixth IntentKV head: train two candidates on the 1k-4k managed rows, pick one
# by the yardstick fixed before any grid cell (held-out attention mass kept at B = 1,024; within
# 0.001, at B = 1,280), put it in the asset folder (uncommitted), and measure it at ~1k, ~2k, ~4k
# at 50% and 65%, reusing ../head_v5_1k4k's full cells (journal line and fidelity/ references),
# so only the new head's cells run. Then: python eval/results/real_smollm2_intentkv/head_v6_rows/report.py
# Run from the repository root: bash eval/results/real_smollm2_intentkv/head_v6_rows/train_and_measure.sh DATA
# (DATA: the rows folder, /work/main/runs/intentkv-data-managed-1k4k-v6 in issue #75's sessions).
set -e
DATA=${1:?rows folder}
PY=${PY:-python}
HERE=eval/results/real_smollm2_intentkv/head_v6_rows
V5=eval/results/real_smollm2_intentkv/head_v5_1k4k
export JAX_PLATFORMS=cpu
wait_lock() { while [ -e /tmp/jaxkv_timing.lock ]; do sleep 15; done; }
for spec in "init:--init jaxkv/assets/smollm2-135m-instruct/intentkv-head" "scratch:"; do
  name=${spec%%:*}; extra=${spec#*:}
  [ -f runs/head-v6-$name-e8/summary.json ] && continue
  wait_lock; t0=$(date +%s)
  nice -n 15 $PY -m train.intentkv_head --data $DATA --out runs/head-v6-$name-e8 --labels mass@0.5 \
    --epochs 8 --lr 3e-4 --quiet $extra
  echo "$(date -u +%T) trained $name in $(( $(date +%s) - t0 )) s"
done
pick=$($PY - <<'PY'
import json, sys
s = {n: json.load(open(f"runs/head-v6-{n}-e8/summary.json")) for n in ("init", "scratch")}
for n, x in s.items():
    i, f = x["heldout_initial"], x["heldout_final"]
    print(n, "initial", {k: round(v, 4) for k, v in i.items() if k.startswith("mass")},
          "final", {k: round(v, 4) for k, v in f.items() if k.startswith(("mass", "auc"))}, file=sys.stderr)
a, b = (s[n]["heldout_final"] for n in ("init", "scratch"))
d = a["mass1024_z"] - b["mass1024_z"]
print("init" if d > 0.001 or (abs(d) <= 0.001 and a["mass1280_z"] >= b["mass1280_z"]) else "scratch")
PY
)
echo "picked $pick (the fourth head's yardstick is the init run's heldout_initial)"
cp runs/head-v6-$pick-e8/head.safetensors runs/head-v6-$pick-e8/head.json jaxkv/assets/smollm2-135m-instruct/intentkv-head/
for LN in "1000 12" "1472 10" "2600 4"; do
  set -- $LN; L=$1; N=$2; D=$HERE/len${L}_v6; mkdir -p $D
  [ -f $D/cells.jsonl ] || $PY -c "
import json, sys
for line in open('$V5/len$L/cells.jsonl'):
    if json.loads(line)['row']['method'] == 'full': sys.stdout.write(line)" > $D/cells.jsonl
  cp -r $V5/len$L/fidelity $D/
  wait_lock; t0=$(date +%s)
  nice -n 15 $PY -m eval.quality.harness --model smollm2-135m-instruct --task agent --methods full,intentkv \
    --budgets 0.5,0.65 --layouts dead_slot --n $N --length $L --accuracy teacher --fidelity --compare-to best \
    --focus intentkv --workers 1 --resume --out $D
  rm -r $D/fidelity  # identical to $V5/len$L/fidelity
  echo "$(date -u +%T) len $L in $(( $(date +%s) - t0 )) s"
done
git checkout jaxkv/assets/smollm2-135m-instruct/intentkv-head/  # ship only after reading the table
