"""`shardwise train --train.compile true` against a plain compiled PyTorch loop of the same model, in one run.

    python benchmarks/compile_check.py --out DIR [--steps 30] [--small] [--backend inductor]

(a) ``shardwise train`` of a 355M GPT (24 layers, 1,024 wide, 16 heads, 1,024 tokens, vocabulary 50,304) in bf16
with ``--train.compile true`` and ``--optimizer.implementation auto`` on one device; its tokens/s is the rank
summary's (median step). (b) The plain loop of ``shardwise.bench.planner_device.plain_loop_step_s`` with
``compiled=True`` (each block ``torch.compile``-d, fused AdamW, bf16 autocast, the steps after warm-up timed
together) over the same model and batch. MFU of both as ``shardwise train``'s summary computes it (6·N + attention
FLOPs per token over the device's dense bf16 peak). Writes ``DIR/compile_check.json`` and ``DIR/compile_check.md``.

``--small``: a tiny model on whatever device is here (a dry run of the script on a CPU; MFU then n/a).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

LARGE = ["--model.n_layer", "24", "--model.n_embd", "1024", "--model.n_head", "16", "--model.block_size", "1024",
         "--model.vocab_size", "50304", "--data.global_batch", "32", "--parallel.micro_batch", "16"]
SMALL = ["--model.n_layer", "2", "--model.n_embd", "64", "--model.n_head", "2", "--model.block_size", "64",
         "--model.vocab_size", "256", "--data.global_batch", "4", "--parallel.micro_batch", "2"]


def train(flags: list[str], steps: int, backend: str, out: Path) -> dict[str, Any]:
    """(a): one ``shardwise train`` process; its rank summary and config."""
    argv = [sys.executable, "-m", "shardwise.cli", "train", *flags, "--train.precision", "bf16",
            "--train.compile", "true", "--train.compile_backend", backend, "--optimizer.implementation", "auto",
            "--parallel.nproc", "1", "--train.steps", str(steps), "--train.ckpt_every", "0",
            "--train.log_every", "10", "--train.out_dir", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    (out.parent / "train.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"shardwise train failed (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}")
    rank = json.loads((out / "ranks" / "rank00000.json").read_text())
    return {"rank": rank, "config": json.loads((out / "config.json").read_text())}


def mfu(tokens_per_s: float, config: dict[str, Any], device: str) -> float | None:
    """Model FLOPs utilisation as ``shardwise train``'s summary computes it; None off CUDA or unknown peak."""
    import torch

    from shardwise.runtime.config import config_from_dict
    from shardwise.runtime.metrics import flops_per_token, peak_flops
    from shardwise.runtime.model_build import attention_width, num_params

    cfg = config_from_dict(config)
    if not device.startswith("cuda"):
        return None
    peak = peak_flops(torch.device(device), "bf16")
    flops = flops_per_token(n_params=num_params(cfg.model), n_layer=cfg.model.n_layer,
                            n_embd=attention_width(cfg.model), block_size=cfg.model.block_size)
    return tokens_per_s * flops / peak if peak else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from shardwise.bench.planner_device import plain_loop_step_s
    from shardwise.runtime.model_build import num_params
    from shardwise.runtime.config import config_from_dict

    result: dict[str, Any] = {"steps": args.steps, "backend": args.backend}
    try:
        run = train(SMALL if args.small else LARGE, args.steps, args.backend, out / "train")
        rank, config = run["rank"], run["config"]
        result["shardwise"] = {"tokens_per_s": rank["tokens_per_s"], "step_s": rank["step_s"],
                               "mfu": mfu(rank["tokens_per_s"], config, rank["device"]), "device": rank["device"]}
    except (RuntimeError, OSError, KeyError) as exc:  # (b) still runs: the plain loop needs torch alone
        result["shardwise"] = {"error": str(exc)[-600:]}
        from shardwise.runtime.config import load_config

        config = load_config(overrides=dict(zip((f[2:] for f in (SMALL if args.small else LARGE)[::2]),
                                                (SMALL if args.small else LARGE)[1::2]))).to_dict()
        config["train"]["precision"] = "bf16"
    step_s = plain_loop_step_s(config, args.steps, compiled=True, backend=args.backend)
    tokens = config["data"]["global_batch"] * config["model"]["block_size"]
    import torch

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    result["plain_compiled"] = {"tokens_per_s": tokens / step_s, "step_s": step_s,
                                "mfu": mfu(tokens / step_s, config, device), "device": device}
    result["parameters"] = num_params(config_from_dict(config).model)
    sw, plain = result["shardwise"], result["plain_compiled"]
    result["ratio"] = sw["tokens_per_s"] / plain["tokens_per_s"] if "tokens_per_s" in sw else None
    (out / "compile_check.json").write_text(json.dumps(result, indent=2))
    fmt = lambda v: "n/a" if v is None else f"{v:.1%}"  # noqa: E731
    lines = [f"GPT {result['parameters'] / 1e6:.1f}M, bf16, {args.steps} steps, backend {args.backend}, {device}", "",
             "| loop | tokens/s | step s | MFU |", "|---|---|---|---|"]
    for name, r in (("shardwise train --train.compile true", sw), ("plain compiled PyTorch loop", plain)):
        lines.append(f"| {name} | {r.get('tokens_per_s', 0):,.0f} | {r.get('step_s', 0):.4f} | {fmt(r.get('mfu'))} |"
                     if "tokens_per_s" in r else f"| {name} | failed: {r['error'][-200:]!r} | | |")
    lines += ["", f"shardwise / plain tokens/s: {fmt(result['ratio'])} (goal >= 97 %); shardwise MFU goal >= 45 %"]
    (out / "compile_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
