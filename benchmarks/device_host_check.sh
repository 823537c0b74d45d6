#!/usr/bin/env bash
# One call on a lent GPU machine (one GPU, 16 host cores): what benchmarks/RESULTS.md's "A GPU host" section records.
#   OUT=DIR bash benchmarks/device_host_check.sh        (from the repository root; PYTHON=python3 by default)
# GPU (world size 1), no calibration file, so `shardwise train` predicts with its built-in quick probe:
#   1. shardwise bench planner --single-device --hardware h200-141g-sxm   (six layouts of a 124M GPT, plain loop)
#   2. shardwise train --parallel.auto true on the same model: the search's choice for one GPU, trained
# CPU ranks on the same host with the GPU hidden (gloo, one core per rank, nothing oversubscribed):
#   3. shardwise bench comm -n 2 and -n 4, gloo against the shared-memory transport, 8 B .. 16 MiB
#   4. shardwise bench dp / tp / zero / pp -n 4 against torch's own, with and without shm
# Each step has its own time limit and the next runs whatever the previous did.
set -u
OUT=${OUT:-runs/device-host-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
step() {  # step NAME LOG SECONDS ARGS...: `shardwise ARGS` with a limit, appended to $OUT/LOG, exit status noted
    local name=$1 log=$2 limit=$3; shift 3
    local t0=$SECONDS
    echo "== shardwise $*" >> "$OUT/$log"
    timeout "$limit" $py -m shardwise.cli "$@" >> "$OUT/$log" 2>&1
    echo "$name: exit $? in $((SECONDS - t0)) s" >> "$OUT/env.txt"
}
{ nvidia-smi -L; nproc; lscpu | grep -m1 "Model name"; $py -c "import torch; print(torch.__version__, torch.version.cuda)"; } \
    > "$OUT/env.txt" 2>&1
GPT2="--model.n_layer 12 --model.n_embd 768 --model.n_head 12 --model.block_size 1024 --model.vocab_size 50304"
step single single.log 150 bench planner --single-device --hardware h200-141g-sxm --steps 20 --json "$OUT/single.json"
# shellcheck disable=SC2086
step auto auto.log 70 train $GPT2 --data.global_batch 16 --parallel.nproc 1 --parallel.auto true --train.precision bf16 \
    --train.steps 30 --train.ckpt_every 0 --train.log_every 30 --train.out_dir /tmp/sw-auto
export CUDA_VISIBLE_DEVICES=""
COMM="--ops all_reduce,all_gather,reduce_scatter,broadcast --algorithms native,shm --min 8 --max 16M --warmup 10"
# shellcheck disable=SC2086
step comm2 comm.log 60 bench comm -n 2 $COMM --iters 100 --json "$OUT/comm2.json"
# shellcheck disable=SC2086
step comm4 comm.log 60 bench comm -n 4 $COMM --iters 50 --json "$OUT/comm4.json"
step dp4 benches.log 40 bench dp -n 4 --variants torch-ddp,sw,sw-shm --sweep ""
step tp4 benches.log 50 bench tp -n 4 --iters 50
step zero4 benches.log 50 bench zero -n 4 --variants torch-zero1,sw-zero1,sw-zero1-shm,fsdp2,sw-zero3,sw-zero3-shm
step pp4 benches.log 50 bench pp -n 4 --schedules gpipe,1f1b,zb-h1 --repeats 4
cat "$OUT/env.txt"; tail -12 "$OUT/single.log"; grep -v "^W" "$OUT/auto.log" | grep -i "chose\|runner\|vs prediction\|measured/pred\|tokens/s" 
