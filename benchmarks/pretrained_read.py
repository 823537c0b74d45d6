"""Read rate of a Hugging Face directory into a meta-built model in one process (RESULTS, "Reading a sharded
pretrained directory"): ``python benchmarks/pretrained_read.py DIR`` (drop the page cache first for a cold run:
``sync; echo 3 > /proc/sys/vm/drop_caches``). Also times drawing 50 M initial values by rule."""

import os
import sys
import time

import torch

import shardwise as sw
from shardwise.checkpoint.hf_dir import open_pretrained, pretrained_config
from shardwise.models import GPT, GPTConfig
from shardwise.parallel.common.init_rules import draw

directory = sys.argv[1]
kind = open_pretrained(directory).config.get("model_type")
with torch.device("meta"):
    if kind == "gpt2":
        model = GPT(GPTConfig(**pretrained_config(directory, arch="gpt")))
    else:
        from shardwise.models.hf_config import load_hf_config
        from shardwise.models.llama import Llama

        model = Llama(load_hf_config(os.path.join(directory, "config.json")), 64)
sw.load_pretrained(model, directory)
size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory) if f.endswith(".safetensors"))
start = time.perf_counter()
sw.materialize(model, "cpu")
seconds = time.perf_counter() - start
print(f"{directory}: {size / 1e6:.1f} MB in {seconds:.2f} s, {size / 1e6 / seconds:.0f} MB/s")
start = time.perf_counter()
draw(sw.Normal(0.0, 0.02), 0, "w", 50_000_000, 0, 50_000_000)
print(f"50 M initial values drawn in {time.perf_counter() - start:.2f} s")
