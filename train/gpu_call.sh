#!/bin/bash
# One device call of the embedded model's training (the device tool runs it in the repository root):
#   bash train/gpu_call.sh MINUTES [train.train options]
# On a machine of several GPUs it trains one data-parallel replica per GPU.
# Continues runs/run when it is there (carried from the previous call), trains for MINUTES of wall
# time, then packs the run folder (checkpoint + log, ~24 MB) into $OUT in pieces the tool brings back.
# Unpack here with: mkdir -p runs && cat $FILES/run.tar.* | tar -C runs -xf -
set -o pipefail
export PYTHONUNBUFFERED=1
minutes=$1; shift
resume=""
[ -f runs/run/train_state.json ] && resume="--resume"
# One data-parallel replica per GPU (train/replicas.py); the machine's NCCL settings are kept as they are.
gpus=$(nvidia-smi -L | wc -l)
launch="python -m train.train"
[ "$gpus" -gt 1 ] && launch="torchrun --standalone --nproc-per-node $gpus -m train.train"
$launch --out runs/run --device cuda --minutes "$minutes" $resume "$@" 2>&1 | tee "$OUT/train.log"
rc=$?
tar -C runs -cf - run | split -b 15M - "$OUT/run.tar."
exit $rc
