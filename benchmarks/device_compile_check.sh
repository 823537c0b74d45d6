#!/usr/bin/env bash
# One H100/H200: `shardwise train --train.compile true` on a 355M GPT in bf16 against a plain compiled PyTorch
# loop of the same model in the same run (issue 40: at least 45 % MFU, within 3 % of the plain loop), then the
# planner's measured campaign on the host CPU.
#   OUT=DIR bash benchmarks/device_compile_check.sh     (from the repository root; PYTHON=python3 by default)
#   PARTS=compile,planner by default. compile: ~4 min (two compilations of the model, 30 steps each; limit
#   300 s); planner: benchmarks/device_planner_check.sh (its own limits add up to 590 s). Both together exceed
#   one 600 s call: run PARTS=compile and PARTS=planner as two calls.
#   SMALL=1: a tiny model on whatever device is here, backend aot_eager (a dry run of the script on a CPU).
set -u
OUT=${OUT:-runs/device-compile-check}
PARTS=${PARTS:-compile,planner}
STEPS=${STEPS:-30}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
{ nvidia-smi -L 2>/dev/null || echo "no GPU"; $py -c "import torch; print(torch.__version__, torch.version.cuda)"; } \
    > "$OUT/env.txt" 2>&1
if [[ ",$PARTS," == *",compile,"* ]]; then
    small=(); backend=${BACKEND:-inductor}
    if [ "${SMALL:-0}" = 1 ]; then small=(--small); backend=${BACKEND:-aot_eager}; STEPS=${STEPS_SMALL:-6}; fi
    timeout 300 $py benchmarks/compile_check.py --out "$OUT/compile" --steps "$STEPS" --backend "$backend" \
        "${small[@]}" > "$OUT/compile.log" 2>&1
    echo "compile: exit $?" >> "$OUT/env.txt"
    tail -8 "$OUT/compile.log"
fi
if [[ ",$PARTS," == *",planner,"* ]]; then
    OUT="$OUT/planner" bash benchmarks/device_planner_check.sh > "$OUT/planner.log" 2>&1
    echo "planner: exit $?" >> "$OUT/env.txt"
    tail -5 "$OUT/planner.log"
fi
cat "$OUT/env.txt"
