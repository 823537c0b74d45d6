#!/usr/bin/env bash
# One call on a lent GPU machine's host CPU (16 cores): the planner's measured campaign (issue "Predict before
# launch": median/worst error and Kendall tau of 15 layouts on 2 and 4 ranks) where every rank has a core of its own.
# On the 2-core development VM the 4-rank layouts oversubscribe the cores: pipelines there are bounded by Graham's
# list-scheduling bound and the campaign's own rounds agree with each other only to tau 0.54-0.90.
#   OUT=DIR bash benchmarks/device_planner_check.sh        (from the repository root; PYTHON=python3 by default)
#   REPEATS=2 STEPS=8 by default (about 5 minutes of the 10 a call may run, after ~3 minutes of calibration).
# The GPU is hidden: gloo CPU ranks, as on the VM, so the two campaigns differ only in cores per rank.
set -u
OUT=${OUT:-runs/device-planner-check}
REPEATS=${REPEATS:-2}
STEPS=${STEPS:-8}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=""
py=${PYTHON:-python3}
step() {  # step NAME SECONDS ARGS...: `shardwise ARGS` with a limit, appended to $OUT/NAME.log, exit status noted
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "== shardwise $*" >> "$OUT/$name.log"
    timeout "$limit" $py -m shardwise.cli "$@" >> "$OUT/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - t0)) s" >> "$OUT/env.txt"
}
{ nproc; lscpu | grep -m1 "Model name"; uptime; $py -c "import torch; print(torch.__version__)"; } > "$OUT/env.txt" 2>&1
step cal2 120 calibrate -n 2 --out "$OUT/hardware_cpu_2ranks.json"
step cal4 150 calibrate -n 4 --out "$OUT/hardware_cpu_4ranks.json"
step measured 330 bench planner --measured --hardware "$OUT/hardware_cpu_2ranks.json,$OUT/hardware_cpu_4ranks.json" \
    --steps "$STEPS" --repeats "$REPEATS" --json "$OUT/planner_measured.json" --markdown "$OUT/planner_measured.md"
cat "$OUT/env.txt"; grep -A2 "^Step time" "$OUT/measured.log" | head -3
