"""Seconds of one ``optimizer.step()`` per ``optimizer.implementation`` (loop, foreach, fused) over a GPT's
parameters, through ``build_optimizer`` (what ``shardwise train`` builds), on this machine's device.

    python benchmarks/optimizer_impl_speed.py [--preset gpt-small] [--name adamw] [--rounds 7] [--steps 10]

Gradients are random (their values do not change the time). Rounds interleave the three implementations, so a
machine that slows down mid-run slows all three; the table gives each one's median over rounds of its median step,
and the final weights' largest difference from the loop's (the three agree to rounding).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from shardwise.models import GPT
from shardwise.runtime.config import load_config
from shardwise.runtime.strategy import build_optimizer

IMPLEMENTATIONS = ("loop", "foreach", "fused")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt-small")
    ap.add_argument("--name", default="adamw", choices=["adamw", "sgd"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    cfg = load_config(preset=args.preset, overrides={"optimizer.name": args.name})
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    runs = {}
    for how in IMPLEMENTATIONS:
        torch.manual_seed(0)
        model = GPT(cfg.model).to(dev)
        params = list(model.parameters())
        gen = torch.Generator(device=dev).manual_seed(1)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, device=dev) * 1e-2
        runs[how] = (params, build_optimizer(params, dataclasses.replace(cfg.optimizer, implementation=how)))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    medians: dict[str, list[float]] = {how: [] for how in IMPLEMENTATIONS}
    for _ in range(args.rounds):
        for how, (_, opt) in runs.items():
            times = []
            for _ in range(args.steps):
                sync()
                start = time.perf_counter()
                opt.step()
                sync()
                times.append(time.perf_counter() - start)
            medians[how].append(statistics.median(times))
    n = sum(p.numel() for p in runs["loop"][0])
    print(f"{args.name}, {args.preset} ({n / 1e6:.2f} M parameters), {dev}, torch {torch.__version__}, "
          f"{args.rounds} rounds x {args.steps} steps")
    print("| implementation | step ms | vs loop | max abs diff to loop |\n|---|---|---|---|")
    base = statistics.median(medians["loop"])
    for how in IMPLEMENTATIONS:
        ms = statistics.median(medians[how])
        diff = max((a - b).abs().max().item() for a, b in zip(runs[how][0], runs["loop"][0]))
        print(f"| {how} | {ms * 1e3:.2f} | {ms / base:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
