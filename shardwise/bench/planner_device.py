"""``shardwise bench planner --single-device``: the planner against one accelerator, layout by layout.

One device hosts no data, tensor or pipeline group, but it runs every choice a layout makes *inside* a rank:
micro-batch size and accumulation, activation checkpointing, precision. Each layout of ``SINGLE_LAYOUTS``
trains briefly through ``shardwise train --parallel.nproc 1`` (one subprocess each, one after another); the
rank's summary gives the median step and the allocator's peak. The same layout is predicted with every
``--hardware`` given (a preset such as ``h100-80g-sxm``, or this machine's ``shardwise calibrate`` file) and
with the quick probe that ``shardwise train`` itself ran before launch (its ``prediction`` record). A plain
PyTorch loop (the same GPT module, ``torch.optim.AdamW``, autocast in the layout's precision, no shardwise)
times the first layout, so the framework's own share of a step is measured too.

Default model: the GPT-2 small shape (12 layers, 768 wide, 12 heads, 1,024 tokens, vocabulary 50,304;
124M parameters) — big enough that a GPU is busy. ``--model-flags`` replaces it (e.g. a tiny model to try the
bench on a CPU). On a CPU every number is the CPU's; the command is meant for a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["SINGLE_LAYOUTS", "GPT2_SMALL_FLAGS", "single_device", "plain_loop_step_s"]

GPT2_SMALL_FLAGS = ("--model.n_layer 12 --model.n_embd 768 --model.n_head 12 --model.block_size 1024 "
                    "--model.vocab_size 50304 --data.global_batch 16")

SINGLE_LAYOUTS: list[tuple[str, list[str]]] = [
    ("bf16 mb16", ["--train.precision", "bf16", "--parallel.micro_batch", "16"]),
    ("bf16 mb8 x2", ["--train.precision", "bf16", "--parallel.micro_batch", "8"]),
    ("bf16 mb4 x4", ["--train.precision", "bf16", "--parallel.micro_batch", "4"]),
    ("bf16 mb2 x8", ["--train.precision", "bf16", "--parallel.micro_batch", "2"]),
    ("bf16 mb16 ckpt", ["--train.precision", "bf16", "--parallel.micro_batch", "16",
                        "--parallel.activation_checkpointing", "true"]),
    ("fp32 mb8 x2", ["--train.precision", "fp32", "--parallel.micro_batch", "8"]),
]


def _train(model_flags: list[str], flags: list[str], steps: int, out: Path) -> dict[str, Any]:
    argv = [sys.executable, "-m", "shardwise.cli", "train", *model_flags, *flags, "--parallel.nproc", "1",
            "--train.steps", str(steps), "--train.ckpt_every", "0", "--train.log_every", str(steps),
            "--train.out_dir", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"`{shlex.join(argv[2:])}` failed (exit {proc.returncode}):\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    rank = json.loads((out / "ranks" / "rank00000.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = next((r for r in records if r.get("kind") == "summary"), {})
    steps = [r for r in records if "step_s" in r and not r.get("kind")][2:]  # after allocator warm-up
    phases = {k: statistics.median(r[f"{k}_s"] for r in steps) for k in ("fwd", "bwd", "opt", "data", "overhead")
              if steps and all(f"{k}_s" in r for r in steps)}
    return {"step_s": rank["step_s"], "peak_bytes": rank["peak_memory"], "device": rank["device"], "phases": phases,
            "config": json.loads((out / "config.json").read_text()),
            "quick_probe_s": summary.get("predicted_step_s")}


def plain_loop_step_s(config: dict[str, Any], steps: int, *, host_reads: bool = False, compiled: bool = False,
                      backend: str = "inductor") -> float:
    """Median step of a plain single-device PyTorch loop over the same model, batch and precision as
    ``config`` (a ``shardwise train`` config dict): forward under autocast, ``loss / accum`` backward per
    micro-batch, ``torch.optim.AdamW`` step. Data: random tokens (their values do not change the time).
    ``host_reads``: also the two host reads ``shardwise train`` makes every step — whether the loss and every
    gradient are finite, before the optimizer step (one fused inf-norm, one ``.item()``), and the loss after
    it — so the difference to the bare loop is what those reads cost.

    ``compiled``: the loop as one would write it for speed with torch alone — each transformer block
    ``torch.compile``-d on its own (``backend``), fused AdamW, and no per-step synchronisation: the steps after
    warm-up are timed together (one synchronize at each end), so the result is the device-bound step."""
    import torch

    from ..models import lm_loss

    m, p = config["model"], config["parallel"]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, opt = _plain_model(m, dev, backend if compiled else None)
    mb = p["micro_batch"]
    accum = config["data"]["global_batch"] // mb
    bf16 = config["train"]["precision"] == "bf16"
    idx = torch.randint(0, m["vocab_size"], (mb, m["block_size"]), device=dev)
    tgt = torch.randint(0, m["vocab_size"], (mb, m["block_size"]), device=dev)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)

    def step() -> None:
        for _ in range(accum):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
                loss = lm_loss(model(idx), tgt) / accum
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if compiled:
        return _unsynchronised_step_s(step, sync, steps)
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        total = torch.zeros((), device=dev)
        for _ in range(accum):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
                loss = lm_loss(model(idx), tgt) / accum
            loss.backward()
            total += loss.detach()
        if host_reads:
            norms = torch._foreach_norm([p.grad for p in model.parameters()], float("inf"))
            if not bool(torch.isfinite(torch.stack([total, *norms])).all().item()):
                raise FloatingPointError("non-finite step in the plain loop")
        opt.step()
        opt.zero_grad(set_to_none=True)
        if host_reads:
            float(total)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:] if len(times) > 4 else times)


def _plain_model(m: dict[str, Any], dev: Any, backend: str | None) -> tuple[Any, Any]:
    """The config's GPT on ``dev`` and its AdamW; ``backend``: each block ``torch.compile``-d with it, fused AdamW."""
    import torch

    from ..models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=m["vocab_size"], block_size=m["block_size"], n_layer=m["n_layer"],
                          n_head=m["n_head"], n_embd=m["n_embd"], dropout=m["dropout"], bias=m["bias"],
                          tie_weights=m["tie_weights"])).to(dev)
    if backend is not None:
        for block in model.blocks:
            block.compile(backend=backend)  # regional: one graph per block, reused by the identical blocks
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if backend else {}))


def _unsynchronised_step_s(step: Any, sync: Any, steps: int) -> float:
    """Mean seconds of ``step()`` over the steps after warm-up (compilation happens in the first ones), queued
    back to back with one synchronize at each end: the device-bound step of a loop that never reads."""
    warm = min(3, max(1, steps // 4))
    for _ in range(warm):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(steps - warm):
        step()
    sync()
    return (time.perf_counter() - start) / max(1, steps - warm)


def _predict(cfg: Any, hardware: list[tuple[str, Any]]) -> dict[str, dict[str, Any]]:
    from ..planner import predict
    from ..runtime.prediction import gpt_spec, plan_from_config

    out = {}
    for name, hw in hardware:
        pred = predict(gpt_spec(cfg), plan_from_config(cfg, train_passes=True), hw,
                       global_batch=cfg.data.global_batch)
        out[name] = {"step_s": pred.step_time_s, "peak_bytes": pred.memory.total, "dominant": pred.dominant,
                     "mfu": pred.mfu, "tflops": pred.tflops_per_device}
    return out


def single_device(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """Train every single-device layout, predict each, and tabulate; ``--hardware`` names presets/files."""
    from ..planner import Hardware
    from ..runtime.config import config_from_dict

    names = [h.strip() for h in (args.hardware or "").split(",") if h.strip()]
    hardware = [(Path(n).stem if n.endswith(".json") else n, Hardware.resolve(n)) for n in names]
    model_flags = shlex.split(getattr(args, "model_flags", None) or GPT2_SMALL_FLAGS)
    wanted = {s.strip() for s in (args.only or "").split(",") if s.strip()}
    chosen = [(n, f) for n, f in SINGLE_LAYOUTS if not wanted or n in wanted]
    rows: list[dict[str, Any]] = []
    first_config: dict[str, Any] | None = None
    failed: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sw-bench-single-") as tmp:
        for name, flags in chosen:
            try:
                got = _train(model_flags, flags, args.steps, Path(tmp) / name.replace(" ", "_"))
            except RuntimeError as exc:  # one failing layout must not lose the others' numbers
                print(f"{name:16s} FAILED: {exc}", flush=True)
                failed.append({"layout": name, "error": str(exc)[-3000:]})
                continue
            cfg = config_from_dict(got["config"])
            first_config = first_config or got["config"]
            row = {"layout": name, "device": got["device"], "measured_s": got["step_s"],
                   "measured_peak_bytes": got["peak_bytes"], "quick_probe_s": got["quick_probe_s"],
                   "predicted": _predict(cfg, hardware), "tokens": cfg.data.global_batch * cfg.model.block_size,
                   "phases": got["phases"]}
            rows.append(row)
            print(f"{name:16s} measured {got['step_s'] * 1e3:8.2f} ms  "
                  + "  ".join(f"{k} {v['step_s'] * 1e3:8.2f} ms" for k, v in row["predicted"].items()), flush=True)
    plain = plain_loop_step_s(first_config, args.steps) if first_config else None
    reads = plain_loop_step_s(first_config, args.steps, host_reads=True) if first_config else None
    data = {"single_device": rows, "failed": failed,
            "plain_loop": {"layout": rows[0]["layout"], "step_s": plain, "with_host_reads_s": reads} if rows else None}
    lines = _table(rows, [n for n, _ in hardware], plain)
    if rows and reads:
        ph = rows[0]["phases"]
        lines.insert(1, f"Plain loop with shardwise train's two host reads per step (finite check, loss): "
                        f"{reads * 1e3:.2f} ms. shardwise train's phases (median ms): "
                        + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in ph.items()) + ".\n")
    return lines, data


def _table(rows: list[dict[str, Any]], hw_names: list[str], plain: float | None) -> list[str]:
    head = "| layout | measured step (ms) | tokens/s | quick probe (ms) | " + " | ".join(
        f"{n} (ms) | error" for n in hw_names) + " | measured peak (GiB) | " + " | ".join(
        f"{n} peak (GiB)" for n in hw_names) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [r["layout"], f"{r['measured_s'] * 1e3:.2f}", f"{r['tokens'] / r['measured_s']:,.0f}",
                 f"{r['quick_probe_s'] * 1e3:.2f}" if r["quick_probe_s"] else "–"]
        for n in hw_names:
            p = r["predicted"][n]["step_s"]
            cells += [f"{p * 1e3:.2f}", f"{p / r['measured_s'] - 1:+.1%}"]
        cells.append(f"{r['measured_peak_bytes'] / 2**30:.2f}")
        cells += [f"{r['predicted'][n]['peak_bytes'] / 2**30:.2f}" for n in hw_names]
        lines.append("| " + " | ".join(cells) + " |")
    if rows and plain:
        lines.insert(0, f"Plain PyTorch loop, layout {rows[0]['layout']!r}: {plain * 1e3:.2f} ms per step; "
                        f"shardwise train {rows[0]['measured_s'] * 1e3:.2f} ms "
                        f"({rows[0]['measured_s'] / plain - 1:+.1%}). Device: {rows[0]['device']}.\n")
    return lines
