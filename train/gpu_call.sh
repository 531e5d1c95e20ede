#!/bin/bash
# One device call of the embedded model's training (the device tool runs it in the repository root):
#   bash train/gpu_call.sh MINUTES [train.train options]
# Continues runs/run when it is there (carried from the previous call), trains for MINUTES of wall
# time, then packs the run folder (checkpoint + log, ~24 MB) into $OUT in pieces the tool brings back.
# Unpack here with: mkdir -p runs && cat $FILES/run.tar.* | tar -C runs -xf -
set -o pipefail
export PYTHONUNBUFFERED=1
minutes=$1; shift
resume=""
[ -f runs/run/train_state.json ] && resume="--resume"
python -m train.train --out runs/run --device cuda --minutes "$minutes" $resume "$@" 2>&1 | tee "$OUT/train.log"
rc=$?
tar -C runs -cf - run | split -b 15M - "$OUT/run.tar."
exit $rc
