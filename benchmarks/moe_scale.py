"""The MoE scale goal of issue 46 (RESULTS, "Mixtures of experts"): a GPT of at least 1B total parameters trains 2
steps under ``--parallel.ep 4`` on 4 CPU ranks, each rank holding at most a third of the expert parameters.

    python benchmarks/moe_scale.py [--out DIR] [--optimizer sgd|adamw] [--small]

Runs ``shardwise train`` (the real command, its launcher and checks) with the shape below, samples the resident
memory of the launcher and every rank while it runs, then counts, independently of the run's own claims:

* the model's parameters on the meta device (``GPTConfig`` → ``GPT``): total, expert, dense;
* each rank's expert parameters twice: from the final checkpoint's index (the expert pieces each rank file
  holds) and from the rank's own report of its parameter bytes (``ranks/rankN.json``: params bytes / 4 minus the
  dense count, every dense parameter being whole on every rank);
* the peak resident set of each rank (the run's VmHWM report and this script's sampling) and of all together.

``--small`` is the same pipeline on a tiny shape (seconds), for checking the script itself. The default optimizer
is plain SGD (no momentum: no optimizer state), so that 1B fp32 parameters and their gradients (8 GB over the 4
ranks' shares plus the replicated dense part) fit this 24 GiB machine shared with other jobs; ``--optimizer adamw``
adds 8 bytes per parameter of state.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(n_layer=5, n_embd=1024, n_head=8, n_experts=64, top_k=2, moe_ffn=1024, vocab_size=256, block_size=32)
SMALL = dict(n_layer=2, n_embd=64, n_head=2, n_experts=8, top_k=2, moe_ffn=64, vocab_size=256, block_size=32)


def counts(shape: dict) -> dict:
    """Total, expert and dense parameters of the GPT of ``shape``, counted on the meta device."""
    from shardwise.models.gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(**shape))
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return {"total": total, "expert": expert, "dense": total - expert}


def command(shape: dict, out: Path, optimizer: str) -> list[str]:
    flags = [f"--model.{k}={v}" for k, v in shape.items()]
    flags += ["--parallel.nproc=4", "--parallel.ep=4", "--parallel.micro_batch=1", "--data.global_batch=4",
              "--train.steps=2", "--train.log_every=1", "--train.ckpt_every=0", f"--train.out_dir={out}",
              f"--optimizer.name={optimizer}", "--optimizer.warmup_steps=1", "--train.timeout_s=600"]
    if optimizer == "sgd":
        flags.append("--optimizer.beta1=0")  # no momentum buffer: no optimizer state at all
    return [sys.executable, "-m", "shardwise.cli", "train", *flags]


def _tree_rss(pid: int) -> dict[int, int]:
    """Resident bytes of ``pid`` and every descendant (from /proc)."""
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                rss = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS")), 0)
            out[p] = rss
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
    return out


def run(cmd: list[str], log: Path) -> tuple[int, float, dict]:
    """Run ``cmd`` with its output in ``log``; its return code, wall seconds and the sampled memory peaks."""
    peaks = {"total": 0, "per_process": {}}
    with open(log, "w") as f:
        start = time.time()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                rss = _tree_rss(proc.pid)
                peaks["total"] = max(peaks["total"], sum(rss.values()))
                for p, r in rss.items():
                    peaks["per_process"][p] = max(peaks["per_process"].get(p, 0), r)
                done.wait(0.5)
        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        rc = proc.wait()
        done.set()
        thread.join()
    return rc, time.time() - start, peaks


def expert_pieces(ckpt: Path) -> dict[str, int]:
    """Expert elements per rank file, from a checkpoint's index (``*.experts.*`` tensors' pieces)."""
    index = json.loads((ckpt / "index.json").read_text())
    per: dict[str, int] = {}
    for name, t in index["tensors"].items():
        if ".experts." not in name or not name.startswith("model/"):
            continue
        for piece in t["pieces"]:
            n = 1
            for _start, size in piece["extent"]:  # (start, size) per dimension
                n *= size
            per[piece["file"]] = per.get(piece["file"], 0) + n
    return dict(sorted(per.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/shardwise-moe-scale", help="run directory (replaced)")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--small", action="store_true", help="a tiny shape, to check this script")
    parser.add_argument("--json", default=None, help="write the record here")
    args = parser.parse_args()
    shape = SMALL if args.small else SHAPE
    c = counts(shape)
    out = Path(args.out)
    subprocess.run(["rm", "-rf", str(out)], check=True)
    out.mkdir(parents=True)
    cmd = command(shape, out / "run", args.optimizer)
    print(f"params: total {c['total']:,}, expert {c['expert']:,}, dense {c['dense']:,}", flush=True)
    print(" ".join(cmd[1:]), flush=True)
    rc, wall, peaks = run(cmd, out / "train.log")
    record = {"shape": shape, "params": c, "optimizer": args.optimizer, "command": " ".join(["shardwise"] + cmd[3:]),
              "rc": rc, "wall_s": wall, "sampled_peak_total_bytes": peaks["total"],
              "sampled_peak_per_process_bytes": sorted(peaks["per_process"].values(), reverse=True)}
    if rc == 0:
        ckpt = out / "run" / "checkpoints" / "latest"
        ckpt = out / "run" / "checkpoints" / ckpt.read_text().strip() if ckpt.is_file() else ckpt.resolve()
        pieces = expert_pieces(ckpt)
        ranks = [json.loads(p.read_text()) for p in sorted((out / "run" / "ranks").glob("rank*.json"))]
        record.update({
            "expert_params_per_rank_checkpoint": list(pieces.values()),
            "expert_params_per_rank_reported": [r["memory"]["params"] // 4 - c["dense"] for r in ranks],
            "rank_peak_rss_bytes": [r["peak_memory"] for r in ranks],
            "final_loss": [r["final_loss"] for r in ranks], "step_s": [r["step_s"] for r in ranks],
            "construction_s": [r["construction_s"] for r in ranks]})
        share = max(record["expert_params_per_rank_checkpoint"]) / c["expert"]
        record["max_expert_share"] = share
        record["goal_met"] = c["total"] >= 1e9 and share <= 1 / 3 and all(
            a == b for a, b in zip(record["expert_params_per_rank_checkpoint"],
                                   record["expert_params_per_rank_reported"]))
    print(json.dumps(record, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
