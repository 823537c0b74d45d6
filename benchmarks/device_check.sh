#!/usr/bin/env bash
# One accelerator, one call: what benchmarks/RESULTS.md's "On one GPU" section records.
#   OUT=DIR bash benchmarks/device_check.sh        (from the repository root; PYTHON=python3 by default)
# 1. `shardwise calibrate --nproc 1` on the GPU, written to $OUT (not the default path, so that train's own
#    prediction below stays the quick probe's);
# 2. the planner against single-device layouts of a 124M GPT (shardwise bench planner --single-device),
#    predicted with the h100/h200 presets, the calibration and train's own quick probe, plus a plain PyTorch loop;
# 3. the main job (`shardwise train`, defaults) on the GPU.
# Each step has its own time limit and the next runs whatever the previous did.
set -u
OUT=${OUT:-runs/device-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
{ nvidia-smi -L; $py -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; } \
    > "$OUT/env.txt" 2>&1
timeout 100 $py -m shardwise.cli calibrate --nproc 1 --out "$OUT/hw-cuda-1.json" > "$OUT/calibrate.log" 2>&1
echo "calibrate: exit $?" >> "$OUT/env.txt"
hw=h100-80g-sxm,h200-141g-sxm
[ -s "$OUT/hw-cuda-1.json" ] && hw="$hw,$OUT/hw-cuda-1.json"
timeout 240 $py -m shardwise.cli bench planner --single-device --hardware "$hw" --steps 20 \
    --json "$OUT/single.json" --markdown "$OUT/single.md" > "$OUT/single.log" 2>&1
echo "single: exit $?" >> "$OUT/env.txt"
timeout 50 $py -m shardwise.cli train --train.out_dir /tmp/sw-main-job > "$OUT/train.log" 2>&1
echo "train: exit $?" >> "$OUT/env.txt"
cat "$OUT/env.txt"; tail -20 "$OUT/single.log"; tail -18 "$OUT/train.log"
