#!/usr/bin/env bash
# From source text to a trained model that transformers loads, offline, in six commands (docs/data.md,
# "Walk-through"). Run it in an empty directory: bash examples/data/walkthrough.sh (STEPS=300 by default).
set -euo pipefail
STEPS=${STEPS:-300}
HERE=$(cd "$(dirname "$0")" && pwd)
LIB=$(python -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
FILES=("$LIB"/json/*.py "$LIB"/email/*.py "$LIB"/logging/*.py "$LIB"/http/*.py "$LIB"/unittest/*.py)

# 1. a tokenizer trained here, on the Python standard library's own source
python "$HERE/train_tokenizer.py" --vocab-size 4096 --out tokenizer "${FILES[@]}"
# 2. tokenize once: memory-mapped shards, an index, a 10 % validation split
mkdir -p data export
shardwise prepare "${FILES[@]}" --tokenizer tokenizer --out data/stdlib --val-fraction 0.1
# 3. train a small Llama; the planner picks the layout; validation every STEPS/4 steps
shardwise train --model.hf_config "$HERE/llama-4k.json" --model.block_size 128 --data.path data/stdlib \
  --data.global_batch 16 --parallel.auto true --train.steps "$STEPS" --train.eval_every $((STEPS / 4)) \
  --train.eval_batches 4 --optimizer.clip_grad_norm 1.0 --optimizer.warmup_steps $((STEPS / 10)) \
  --train.name stdlib --train.log_every 25
# 4. look at what it learned
shardwise generate runs/stdlib --prompt "def " --max-new-tokens 40 --temperature 0
# 5. a Hugging Face directory: config.json, safetensors, the tokenizer
shardwise export runs/stdlib --format hf --out export/stdlib
# 6. transformers loads it, and decodes greedily the same text as step 4
python "$HERE/check_export.py" export/stdlib --prompt "def " --max-new-tokens 40
