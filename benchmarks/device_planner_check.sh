#!/usr/bin/env bash
# One call on a lent GPU machine's host CPU (16 cores): the planner's measured campaign (issue "Predict before
# launch": median/worst error and Kendall tau of 15 layouts on 2 and 4 ranks) where every rank has a core of its own.
# On the 2-core development VM the 4-rank layouts oversubscribe the cores: pipelines there are bounded by Graham's
# list-scheduling bound and the campaign's own rounds agree with each other only to tau 0.54-0.90.
#   OUT=DIR bash benchmarks/device_planner_check.sh        (from the repository root; PYTHON=python3 by default)
#   REPEATS=2 STEPS=6 by default; the three steps' limits add up to 590 s (a call may run 600). A calibration
#   already in $OUT is reused (a second call, or a dry run: ONLY=dp2,pp4\ 1f1b limits the layouts).
# The GPU is hidden: gloo CPU ranks, as on the VM, so the two campaigns differ only in cores per rank.
set -u
OUT=${OUT:-runs/device-planner-check}
REPEATS=${REPEATS:-2}
STEPS=${STEPS:-6}
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
for n in 2 4; do  # the 4-rank calibration took 3.5 min on the 2-core VM; with a core per rank it is much shorter
    [ -s "$OUT/hardware_cpu_${n}ranks.json" ] || step "cal$n" $((n * 50)) calibrate -n "$n" --out "$OUT/hardware_cpu_${n}ranks.json"
done
step measured 290 bench planner --measured --hardware "$OUT/hardware_cpu_2ranks.json,$OUT/hardware_cpu_4ranks.json" \
    --steps "$STEPS" --repeats "$REPEATS" ${ONLY:+--only "$ONLY"} \
    --json "$OUT/planner_measured.json" --markdown "$OUT/planner_measured.md"
cat "$OUT/env.txt"; grep -A2 "^Step time" "$OUT/measured.log" | head -3
