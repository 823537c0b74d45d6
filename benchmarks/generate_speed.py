"""Decode speed of ``sw.generate`` with and without the key/value cache (benchmarks/RESULTS.md, "Generation").

    python benchmarks/generate_speed.py --new 256 --repeats 3 [--threads N] [--device cpu] [--json out.json]

A randomly initialised reference GPT (default: the ``gpt-small`` shape — 4 layers, width 256, 4 heads — with a
512-position context so that prompt + new tokens fit), a 16-token prompt, greedy decoding of ``--new`` tokens
(EOS off, so every run makes all of them). Both paths produce the same tokens (checked here); the time includes
the prefill. The best of ``--repeats`` runs is reported (the machine may be shared: the minimum is the least
disturbed), plus the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import shardwise as sw


def _time(model: torch.nn.Module, prompt: torch.Tensor, new: int, cache: bool, device: torch.device) -> tuple[float, torch.Tensor]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = sw.generate(model, prompt, max_new_tokens=new, temperature=0, use_cache=cache)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=256, help="tokens to generate (default 256)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default="", help="also write the numbers to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = sw.models.GPTConfig(vocab_size=256, block_size=args.prompt_len + args.new, n_layer=args.n_layer,
                              n_head=args.n_head, n_embd=args.n_embd)
    model = sw.models.GPT(cfg).to(device).eval()
    prompt = torch.randint(0, 256, (args.prompt_len,), device=device)
    sw.generate(model, prompt, max_new_tokens=8, temperature=0)  # warm-up (allocator, kernels)
    rows, outputs = {}, {}
    for cache in (True, False):
        times = []
        for _ in range(args.repeats):
            seconds, outputs[cache] = _time(model, prompt, args.new, cache, device)
            times.append(seconds)
        rows["kv_cache" if cache else "no_cache"] = {
            "best_tokens_per_s": round(args.new / min(times), 1),
            "median_tokens_per_s": round(args.new / statistics.median(times), 1), "seconds": [round(t, 3) for t in times]}
    assert torch.equal(outputs[True], outputs[False]), "the cached and the uncached paths disagree"
    result = {"model": {**cfg.to_dict(), "params": model.num_params()}, "prompt_len": args.prompt_len, "new": args.new,
              "device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__, **rows,
              "speedup_best": round(rows["kv_cache"]["best_tokens_per_s"] / rows["no_cache"]["best_tokens_per_s"], 2)}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
