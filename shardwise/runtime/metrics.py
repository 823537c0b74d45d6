"""Training metrics: one JSON line per step, TensorBoard when installed, a live progress bar, and the numbers
of the final summary (model FLOPs, FLOPs utilisation against the device's peak, peak memory per rank).

Nothing here communicates; rank 0 writes the files.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from ..planner.units import format_bytes  # re-exported: the one binary-unit formatter of every printed size
from .ledger_report import ledger_row

__all__ = ["MetricsWriter", "ProgressReporter", "flops_per_token", "peak_flops", "peak_memory_bytes",
           "resident_peak_bytes", "read_metrics", "append_record", "summary_record", "format_bytes"]

# Dense FP32 (no tensor cores) peak FLOP/s: ``shardwise train`` computes in float32 with TF32 off (torch's
# default for matmuls). First matching substring of torch.cuda.get_device_name() wins (most specific first).
_PEAK_FP32: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 51.2e12), ("H100", 66.9e12), ("H200", 66.9e12), ("H800", 66.9e12), ("GH200", 66.9e12),
    ("A100", 19.5e12), ("A800", 19.5e12), ("A10G", 31.2e12), ("A10", 31.2e12), ("L40S", 91.6e12), ("L40", 90.5e12),
    ("L4", 30.3e12), ("V100", 15.7e12), ("T4", 8.1e12), ("RTX 4090", 82.6e12), ("RTX 3090", 35.6e12),
)


# Dense BF16 tensor-core peak FLOP/s (datasheets; no sparsity), for ``train.precision = bf16``.
_PEAK_BF16: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("H800", 989e12), ("GH200", 989e12),
    ("A100", 312e12), ("A800", 312e12), ("A10G", 70e12), ("A10", 125e12), ("L40S", 362e12), ("L40", 181e12),
    ("L4", 121e12), ("RTX 4090", 165e12), ("RTX 3090", 71e12),
)


def peak_flops(device: torch.device, precision: str = "fp32") -> float | None:
    """The device's dense peak in FLOP/s for ``precision`` (``fp32``: no tensor cores, TF32 off as in
    torch's default; ``bf16``: tensor cores), or None when unknown (every CPU, unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    table = _PEAK_BF16 if precision == "bf16" else _PEAK_FP32
    return next((peak for key, peak in table if key in name), None)


def flops_per_token(*, n_params: int, n_layer: int, n_embd: int, block_size: int,
                    n_trainable: int | None = None) -> float:
    """Training FLOPs per token: 6·N for the matmuls with the parameters (forward 2N, backward 4N) plus
    6·2·L·h·T for attention scores and values (PaLM appendix B, causal mask not discounted). With a frozen base
    (``n_trainable`` < N: LoRA) the backward computes weight gradients for the trainable elements only:
    4·N + 2·n_trainable (the adapters' own forward FLOPs, ~r/h of the base's, are not counted)."""
    weights = 6.0 * n_params if n_trainable is None else 4.0 * n_params + 2.0 * n_trainable
    return weights + 12.0 * n_layer * n_embd * block_size


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process so far: CUDA allocator peak on a GPU, peak resident set size on the CPU
    (``resident_peak_bytes``). Nothing resets either: building and loading the model count."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resident_peak_bytes()


def resident_peak_bytes() -> int:
    """This process's peak resident set size in bytes. On Linux ``VmHWM`` of ``/proc/self/status``: the
    high-water mark of this program's own memory, whereas ``getrusage``'s ``ru_maxrss`` carries over the parent's
    resident set at ``fork`` across ``exec`` (a rank started by torchrun would report at least the launcher's);
    elsewhere ``ru_maxrss`` (KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl`` (flushed, so a crash keeps every finished step)
    and mirrors scalars to TensorBoard when ``torch.utils.tensorboard`` can be imported."""

    def __init__(self, run_dir: Path, *, truncate_after: int | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        if truncate_after is not None and self.path.is_file():
            # Resuming from step k: steps after k were trained by the crashed run and are trained again.
            kept = [r for r in read_metrics(self.path, kind=None) if r.get("step", 0) <= truncate_after]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._file: TextIO = self.path.open("a")
        self._tb: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:  # optional: pip install tensorboard
            pass

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path, *, kind: str | None = "step") -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (a torn last line from a crash is skipped): one per step (no ``kind``
    field) by default; ``kind="prediction"`` / ``"summary"``: the launcher's records (``append_record``);
    ``kind=None``: all of them, in file order."""
    out: list[dict[str, Any]] = []
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if kind is None or record.get("kind", "step") == kind:
            out.append(record)
    return out


def append_record(run_dir: Path, record: dict[str, Any], *, truncate_after: int | None = None) -> None:
    """Append one launcher record (``{"kind": "prediction" | "summary", "step": N, ...}``) to ``metrics.jsonl``.
    ``truncate_after``: first drop what a run from that step replaces, as the trainer's ``MetricsWriter`` does on
    resuming (records after that step), and earlier records of this kind at that very step (a relaunch)."""
    path = run_dir / "metrics.jsonl"
    if truncate_after is not None and path.is_file():
        kept = [r for r in read_metrics(path, kind=None) if r.get("step", 0) < truncate_after
                or (r.get("step", 0) == truncate_after and r.get("kind") != record.get("kind"))]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


class ProgressReporter:
    """A live rich progress bar (step, loss, tokens/s, ETA) on a terminal; a plain line every
    ``log_every`` steps otherwise (logs, CI, pipes)."""

    def __init__(self, *, total: int, start: int, log_every: int) -> None:
        from rich.console import Console

        self.console = Console(stderr=False)
        self.total, self.log_every = total, log_every
        self._t0, self._start = time.perf_counter(), start
        self._bar: Any = None
        if self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
                                 TextColumn("ETA"), TimeRemainingColumn(), console=self.console)
            self._task = self._bar.add_task("train", total=total, completed=start, loss=float("nan"), tps=0.0)
            self._bar.start()

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=loss, tps=tokens_per_s)
        elif step % self.log_every == 0 or step == self.total:
            done = step - self._start
            elapsed = time.perf_counter() - self._t0
            eta = elapsed / max(done, 1) * (self.total - step)
            print(f"step {step:>6}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  ETA {eta:4.0f}s", flush=True)

    def note(self, line: str) -> None:
        """A line above the live bar (or between the plain progress lines): e.g. a validation result."""
        if self._bar is not None:
            self._bar.console.print(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _rank_summaries(run_dir: Path) -> list[dict[str, Any]]:
    files = sorted((run_dir / "ranks").glob("rank*.json")) if (run_dir / "ranks").is_dir() else []
    return [json.loads(f.read_text()) for f in files]


def _model_states(memory: dict[str, Any]) -> int | None:
    parts = [memory.get(k) for k in ("params", "grads", "optimizer")]
    return int(sum(parts)) if all(isinstance(v, (int, float)) for v in parts) else None


def summary_record(cfg: Any, run_dir: Path, prediction: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The ``{"kind": "summary"}`` record of ``metrics.jsonl``: the step time (rank 0's median over the steps
    after the first two) and each rank's memory (its strategy's ``memory()`` report: model states and peak)
    measured, next to ``prediction`` (``runtime/prediction.py``'s record, or None when it was skipped). Per rank
    also ``measured_process_peak_bytes``, the whole process's peak including building and loading the model
    (``peak_memory_bytes``: peak resident set on a CPU, CUDA allocator peak on a GPU), and ``bare_runtime_bytes``,
    the same measure at the trainer's start (torch and shardwise imported, nothing built).
    None when no rank left a summary."""
    ranks = _rank_summaries(run_dir)
    if not ranks:
        return None
    head, memory = ranks[0], [r.get("memory") or {} for r in ranks]
    pred = prediction or {}
    return {"kind": "summary", "step": cfg.train.steps, "steps": head["steps"], "final_loss": head["final_loss"],
            "device": head["device"], "predicted_step_s": pred.get("step_time_s"), "measured_step_s": head["step_s"],
            "predicted_peak_memory_bytes": pred.get("peak_memory_bytes"),
            "measured_peak_memory_bytes": [m.get("peak") for m in memory],
            "predicted_model_state_bytes": pred.get("model_state_bytes"),
            "measured_model_state_bytes": [_model_states(m) for m in memory],
            "predicted_construction_bytes": pred.get("construction_bytes"),
            "measured_process_peak_bytes": [r.get("peak_memory") for r in ranks],
            "bare_runtime_bytes": [r.get("bare_runtime_bytes") for r in ranks],
            "measured_construction_peak_bytes": [r.get("construction_peak_bytes") for r in ranks],
            "construction_s": [r.get("construction_s") for r in ranks],
            "memory_ledger": [r.get("memory_ledger") for r in ranks],  # per rank (runtime/memory_ledger.py)
            "pretrained_bytes_read": [r.get("pretrained_bytes_read") for r in ranks],
            "final_val_loss": head.get("val_loss"), "eval_s": head.get("eval_s"),
            **({"compile_s": [r.get("compile_s") for r in ranks], "recompiles": [r.get("recompiles") for r in ranks]}
               if "compile_s" in head else {}),
            "hardware": pred.get("hardware_source"), "time": time.time()}


def _comparison_rows(record: dict[str, Any]) -> list[tuple[str, str]]:
    """Predicted next to measured, for the summary table (nothing when there was no prediction)."""
    if record.get("predicted_step_s") is None:
        return []
    pred, meas = record["predicted_step_s"], record["measured_step_s"]
    ratio = f"; measured/predicted {meas / pred:.2f}" if pred > 0 else ""
    rows = [("step time vs prediction", f"{pred:.3g} s predicted, {meas:.3g} s measured (median after 2 steps){ratio}")]
    fmt = lambda values: ", ".join(f"r{i} {format_bytes(v)}" for i, v in enumerate(values) if v is not None)  # noqa: E731
    if record["device"].startswith("cuda"):
        rows.append(("memory vs prediction", f"peak {format_bytes(record['predicted_peak_memory_bytes'])} predicted; "
                                        f"allocator peak measured {fmt(record['measured_peak_memory_bytes'])}"))
    else:  # no allocator statistic on the CPU: the strategy reports model states only
        rows.append(("memory vs prediction", f"model states {format_bytes(record['predicted_model_state_bytes'])} "
                                        f"predicted (peak {format_bytes(record['predicted_peak_memory_bytes'])} with "
                                        f"activations and buffers); model states measured "
                                        f"{fmt(record['measured_model_state_bytes'])}"))
        above = [p - b if isinstance(p, (int, float)) and isinstance(b, (int, float)) else None
                 for p, b in zip(record.get("measured_process_peak_bytes") or [], record.get("bare_runtime_bytes") or [])]
        if record.get("predicted_construction_bytes") is not None and any(v is not None for v in above):
            rows.append(("peak vs prediction", f"{format_bytes(record['predicted_peak_memory_bytes'])} predicted (the "
                                               f"larger of training and construction; construction "
                                               f"{format_bytes(record['predicted_construction_bytes'])}); resident "
                                               f"above the bare runtime measured {fmt(above)}"))
    return rows


def _peak_row(ranks: list[dict[str, Any]]) -> tuple[str, str]:
    """Each rank's process peak (construction and loading included) and its increment over the bare runtime."""
    what = "allocated" if str(ranks[0].get("device", "")).startswith("cuda") else "resident"

    def one(r: dict[str, Any]) -> str:
        bare = r.get("bare_runtime_bytes")
        extra = (f" (bare runtime {format_bytes(bare)}, +{format_bytes(max(0, r['peak_memory'] - bare))})"
                 if isinstance(bare, (int, float)) else "")
        built = r.get("construction_peak_bytes")
        if isinstance(built, (int, float)) and isinstance(bare, (int, float)):
            extra += f"; built +{format_bytes(max(0, built - bare))} in {r.get('construction_s', 0.0):.1f} s"
        return f"r{r['rank']} {format_bytes(r['peak_memory'])}{extra}"

    return f"peak {what} per rank (incl. construction)", ", ".join(one(r) for r in ranks)


def compile_row(head: dict[str, Any]) -> str:
    """The summary's ``torch.compile`` row from rank 0's summary (``runtime/compiling.py``)."""
    excess = head.get("compile_first_step_excess_s")
    why = f": {'; '.join(head.get('recompile_reasons') or [])}" if head.get("recompiles") else ""
    return (f"{head['compile_s']:.1f} s compiling (rank 0; first step {excess or 0.0:.1f} s above the median), "
            f"{head.get('compile_graphs', 0)} graphs, {head.get('compile_graph_breaks', 0)} graph breaks, "
            f"{head.get('recompiles', 0)} recompiles{why}")


def print_summary(cfg: Any, run_dir: Path, prediction: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The end-of-run table, from the ranks' summary files (``RUN/ranks/``) and the config, with the
    prediction made before the launch next to what was measured; returns ``summary_record``."""
    from rich.console import Console
    from rich.table import Table

    from .model_build import attention_width, num_params, trainable_params

    ranks = _rank_summaries(run_dir)
    if not ranks:
        print(f"shardwise train: finished, but no rank summaries in {run_dir / 'ranks'}")
        return None
    head = ranks[0]
    n_params = num_params(cfg.model)  # the GPT's or the HF decoder's
    flops = flops_per_token(n_params=n_params, n_layer=cfg.model.n_layer, n_embd=attention_width(cfg.model),
                            block_size=cfg.model.block_size, n_trainable=trainable_params(cfg))
    precision = getattr(cfg.train, "precision", "fp32")
    peak = peak_flops(torch.device(head["device"]), precision) if head["device"].startswith("cuda") else None
    mfu = (f"{head['tokens_per_s'] * flops / (peak * len(ranks)):.1%} (of the dense {precision} peak)" if peak
           else "n/a (peak FLOP/s unknown for this device)")
    table = Table(title="shardwise train: summary", show_header=False)
    val = head.get("val_loss")
    for k, v in (("final loss", f"{head['final_loss']:.4f}"
                  + (f"; validation {val:.4f} (perplexity {math.exp(min(val, 700)):.2f})" if val is not None else "")),
                 ("steps this run", str(head["steps"])),
                 ("parameters", f"{n_params / 1e6:.2f} M"),
                 ("tokens/s", f"{head['tokens_per_s']:,.0f} (median step, all ranks together); "
                              f"{head.get('wall_tokens_per_s', 0):,.0f} over the whole run"),
                 ("model FLOPs utilisation", mfu),
                 ("framework overhead", f"{head['overhead_s'] / max(head['step_s'], 1e-12):.1%} of a step (time "
                                        f"outside forward, backward, optimizer, communication)"),
                 _peak_row(ranks),
                 ("checkpoint", str(head["checkpoint"])), ("metrics", str(run_dir / "metrics.jsonl"))):
        table.add_row(k, v)
    record = summary_record(cfg, run_dir, prediction)
    for k, v in _comparison_rows(record or {}) + [row for row in [ledger_row(ranks)] if row is not None]:
        table.add_row(k, v)
    if "compile_s" in head:  # train.compile: what compiling cost, and whether anything recompiled
        table.add_row("torch.compile", compile_row(head))
    skipped = head.get("skipped_steps", 0)
    if skipped:  # train.nonfinite = skip: steps whose loss or gradients were not finite, dropped on every rank
        table.add_row("non-finite", f"skipped {skipped} non-finite step{'s' if skipped != 1 else ''} "
                                    f"(marked \"skipped\" in metrics.jsonl)")
    Console().print(table)
    return record


_PEER_ERRORS = ("connection closed", "connection reset", "timed out", "timeout", "broken pipe")


def _merge_errors(errors: dict[int, str]) -> str:
    """One clause per distinct message: ``rank 0 failed at step 2: X`` and the same from rank 1 read
    ``ranks 0, 1 failed at step 2: X``."""
    groups: dict[str, list[int]] = {}
    for rank, text in sorted(errors.items()):
        prefix = f"rank {rank} "
        groups.setdefault(text[len(prefix):] if text.startswith(prefix) else text, []).append(rank)
    return "; ".join(f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))} {rest}" if rest != errors[rs[0]] else rest
                     for rest, rs in groups.items())


def _own_fault(ranks_dir: Path, candidates: list[int]) -> list[int]:
    """Of ``candidates``, the ranks that did not end by torchrun's own SIGTERM (sent to the survivors once one
    rank failed), per ``RUN/ranks/rankN.exit``; all of them when that tells nothing apart."""
    import signal

    codes = {r: (ranks_dir / f"rank{r:05d}.exit").read_text().strip() for r in candidates
             if (ranks_dir / f"rank{r:05d}.exit").is_file()}
    own = [r for r in candidates if r in codes and codes[r] != str(-int(signal.SIGTERM))]
    return own or candidates


def failure_report(run_dir: Path, rc: int, cfg: Any) -> str:
    """What to tell the user after a failed job: which rank failed first, what it said, and the last complete
    checkpoint (saves are atomic, so it is intact). The culprit is the rank that fell behind (its step file,
    ``RUN/ranks/rankN.step``, shows the lowest step: it died or hung there while the others waited in a
    collective), else the ranks that raised."""
    from ..checkpoint.sharded import latest_checkpoint

    ranks_dir = run_dir / "ranks"
    steps: dict[int, int] = {}
    errors: dict[int, str] = {}
    for r in range(cfg.parallel.nproc):
        step_file, error_file = ranks_dir / f"rank{r:05d}.step", ranks_dir / f"rank{r:05d}.error"
        if step_file.is_file() and step_file.read_text().strip():
            steps[r] = int(step_file.read_text().split()[0])
        if error_file.is_file():
            errors[r] = error_file.read_text().strip()
    finished = {r["rank"] for r in _rank_summaries(run_dir)}
    victims = {r for r, e in errors.items() if any(k in e.lower() for k in _PEER_ERRORS)}
    raised = [r for r in errors if r not in victims]
    behind = [r for r, s in steps.items() if s == min(steps.values())] if steps else []
    silent = [r for r in range(cfg.parallel.nproc) if r not in errors and r not in finished]
    interrupted = sorted(ranks_dir.glob("rank*.interrupted")) if ranks_dir.is_dir() else []
    if interrupted:
        head = f"interrupted (Ctrl-C) at step {interrupted[0].read_text().strip()}; no checkpoint was half-written"
    elif raised:
        head = _merge_errors({r: errors[r] for r in raised})
    elif silent or len(behind) < len(steps):
        culprits = _own_fault(ranks_dir, silent if silent else behind)
        head = (f"{', '.join(f'rank {r}' for r in culprits)} failed first"
                f"{f' (last step it started: {steps[culprits[0]]})' if culprits[0] in steps else ''}: it died or hung "
                f"without a Python error (killed, crashed, out of memory, stuck); the other ranks stopped when their "
                f"collectives with it failed or timed out")
    elif errors:
        head = "; ".join(errors.values())
    else:
        head = "see the launcher's report above ('Root Cause ... rank: N')"
    killed = sorted(ranks_dir.glob("rank*.killed")) if ranks_dir.is_dir() else []
    if killed:
        head += (f"; {', '.join(f'rank {int(k.stem[4:])}' for k in killed)} did not exit after the failure and "
                 f"{'was' if len(killed) == 1 else 'were'} killed (SIGKILL)")
    last = latest_checkpoint(run_dir)
    resume = f"; continue with: shardwise train --resume {run_dir}" if last else ""
    verdict = "stopped" if interrupted else f"the job failed (exit code {rc})"
    timeout = "" if interrupted else f" Collective timeout train.timeout_s={cfg.train.timeout_s:g}s."
    return f"shardwise train: {verdict}: {head}.{timeout} Last complete checkpoint: {last or 'none'}{resume}"
