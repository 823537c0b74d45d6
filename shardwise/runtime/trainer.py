"""The per-rank side of ``shardwise train``: ``python -m shardwise.runtime.trainer --run-dir DIR [--resume CKPT]``.

The launcher (``cli/train.py``, ``runtime/job.py``) validated the config and wrote it to ``DIR/launch.json``;
every rank reads it, joins the job (``sw.init``), builds the mesh ``(dp, tp)`` and asks ``build_strategy``
(``runtime/strategy/``) for the reference GPT under the requested layout, its optimizer and the step's passes;
then it runs the loop: per step ``grad_accum`` forward/backward passes (gradient
sync on the last only), one optimizer step, the mean loss over dp (one all-reduce), metrics, and periodic
atomic sharded checkpoints. Collective throughout: every rank runs the same steps. On CUDA a step's loss and
non-finite flag stay on the device until the next step is queued (``host_overlap.py``).

Pipeline parallelism (``parallel.pp > 1``, mesh ``(pp, dp, tp)``, ``strategy/pipeline.py``): each of the
``grad_accum`` passes is one ``pipe.step`` over the pass's ``micro_batch × dp`` sequences (every rank loads them,
each dp replica takes its slice); gradients accumulate over the passes and average over dp in each ``pipe.step``.
Mixtures of experts (``parallel.ep``): ``MoESteps`` (``step_support.py``) around the passes and the step.

RNG: reseeded at every step from ``(train.seed, step, dp coordinate)``, so restoring the step restores it, and
dropout differs between data-parallel replicas as it must.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Sequence

import torch

from ..checkpoint.layout import tied_aliases
from ..checkpoint.sharded import CHECKPOINTS, Checkpoint, save_checkpoint
from .frozen_base import check_resume, omit_frozen, resume_base
from .calibration import mesh_calibrations
from .config import Config, load_config
from .context_split import context_split
from .documents import enable_documents
from ..data.corpus import StepBatches
from ..data.windows import ShardedSampler
from .token_loss import TokenNormalized, counted_targets
from ..data.sources import DataError, open_data
from .validation import ValBatches, evaluate
from ..world import World, barrier_all, bind_to_launcher, exit_process, init, interrupted, shutdown
from ..parallel.common.saved_memory import SavedTensorPeak
from .model_build import hf_of, model_mismatch
from .metrics import MetricsWriter, ProgressReporter, peak_memory_bytes
from .memory_ledger import PhaseMeter, activation_peak, fullest, rank_ledger, strategy_memory
from .step_support import MoESteps, build_mesh as _build_mesh, lr_at, peer_hint, synchronizer  # tests patch _build_mesh
from .host_overlap import PendingStep, can_defer, finish_deferred, read
from .nonfinite import NonFiniteError, agree, failure_message, first_nonfinite, local_flag
from .strategy import Strategy, ZeroStrategy, build_optimizer, build_strategy

__all__ = ["Trainer", "lr_at", "build_optimizer", "main"]

STARTUP_TIMEOUT_S = 300.0
"""Deadline of start-up and checkpoint loading (``world.barrier_all``): process start and checkpoint reads
can be slow and uneven on a loaded machine or filesystem; training steps use ``train.timeout_s``."""


class Trainer:
    """One rank's training state and loop (see module docstring). The parallel layout is ``self.strategy``
    (``strategy/``), chosen once from the config; nothing below depends on which one it is."""

    def __init__(self, cfg: Config, run_dir: Path, world: World, *, resuming: bool = False) -> None:
        self.cfg, self.run_dir, self.world = cfg, run_dir, world
        p = cfg.parallel
        calibration = mesh_calibrations(p, world.device, world.rank, world.world_size)
        self.mesh = _build_mesh(p, cfg.train.timeout_s, calibration)
        barrier_all()  # every rank started: from here on, the short timeout measures the work, not the start
        import torch._dynamo  # noqa: F401  (every torch.optim optimizer imports it when built: ~75 MiB resident)
        self.bare_runtime = peak_memory_bytes(world.device)
        """The process peak before anything is built (torch and shardwise imported — with ``torch._dynamo``, which
        building any ``torch.optim`` optimizer imports, so that it counts as runtime, not model — and the mesh's
        process groups made): the summary's baseline."""
        self.meter = PhaseMeter(world.device, begin="construction")  # the ledger's peak per phase (memory_ledger.py)
        built = time.perf_counter()
        # a resume's weights come from its checkpoint (not lora.init's adapter; model.pretrained: resume_base)
        built_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, pretrained=resume_base(cfg)),
                                        lora=dataclasses.replace(cfg.lora, init="")) if resuming else cfg
        self.strategy: Strategy = build_strategy(built_cfg, self.mesh)
        self.split = context_split(cfg, self.strategy.plain)  # parallel.cp > 1: ring attention, sequence chunks
        self.construction_s = time.perf_counter() - built
        """Seconds building the layout: materialising this rank's pieces (drawn, or read from model.pretrained)."""
        self.construction_peak = self.meter.close()
        if hasattr(self.strategy, "phase"):  # passes that mark their own forward and backward (strategy/plain.py)
            self.strategy.phase = self.meter.begin  # type: ignore[attr-defined]
        """The process peak once the layout is built, before the first step (construction and loading)."""
        data = open_data(cfg)  # memory maps of a prepared dataset; small files and the generated corpus in memory
        self.document_eos = enable_documents(cfg, self.strategy, data)  # data.document_mask: documents.py
        dp_size, dp_rank = self.strategy.data_shard()  # a pipeline loads all of dp's sequences: not sharded
        if self.split is not None and dp_size > 1:  # cp peers read the same sequences (dp × cp axis: cp inner)
            dp_size, dp_rank = dp_size // p.cp, dp_rank // p.cp
        sampler = ShardedSampler(len(data.train), dp_size=dp_size, dp_rank=dp_rank, shuffle=cfg.data.shuffle,
                                 seed=cfg.train.seed)
        self.data = StepBatches(data.train, sampler, micro_batch=p.micro_batch * p.dp // dp_size,
                                grad_accum=p.grad_accum, device=self.mesh.device, transform=self.split)
        # a loss call covers r rows of S / cp tokens: cp × the calls of the same rows without cp average a step
        self.token_loss = (TokenNormalized(self.strategy.sum_loss, cfg.data.global_batch * p.cp)
                           if data.masked else None)
        """Loss-masked data: every counted token weighs alike in every layout (``token_loss.py``); else None."""
        self.val = (ValBatches(data.val, global_batch=cfg.data.global_batch, eval_batches=cfg.train.eval_batches,
                               dp_size=dp_size, dp_rank=dp_rank, micro_batch=p.micro_batch * p.dp // dp_size,
                               device=self.mesh.device, transform=self.split) if data.val is not None else None)
        self.evals: list[dict[str, Any]] = []
        self.step, self._beat_fd = 0, None
        self.last_ckpt: Path | None = None
        self.tokens_per_step = cfg.data.global_batch * cfg.model.block_size
        # non-finite steps skipped (train.nonfinite = skip) in this run, and in a row
        self.skipped, self.skipped_in_row, self.last_skipped = 0, 0, False
        self.memory: dict[str, int] | None = None  # the strategy's report where fullest: after the first step
        self.activations = SavedTensorPeak()
        """Saved-for-backward bytes over the run (the activation peak a CPU has no allocator statistic for)."""
        self.moe = MoESteps(self.strategy)  # a mixture of experts' per-step calls (runtime/experts.py)
        self.overlap = can_defer(self.strategy, self.mesh.device, cfg) and self.moe.experts is None  # MoE reads

    # The strategy's parts under the trainer's historical names (tests and tools read them).
    @property
    def model(self) -> Any:
        """What the step calls: the plain module, ``DataParallel``, ``ZeroModel`` or ``Pipeline``."""
        return self.strategy.model

    @property
    def plain(self) -> torch.nn.Module:
        return self.strategy.plain

    @property
    def optimizer(self) -> Any:
        return self.strategy.optimizer

    @property
    def zero(self) -> bool:
        """Whether the layout is ``sw.zero`` (ZeRO-1 inside a pipeline is the pipeline's)."""
        return isinstance(self.strategy, ZeroStrategy)

    def resume(self, path: str | Path) -> None:
        """Load model, optimizer state and data position from a checkpoint of any layout. Local (file reads)."""
        ckpt = Checkpoint(path)
        diff = model_mismatch(ckpt.state["config"]["model"], ckpt.state.get("hf_config"), self.cfg.model)
        if diff:
            raise ValueError(f"checkpoint {ckpt.path} was trained with another model: "
                             + ", ".join(f"{k} = {new!r} (saved {old!r})" for k, (old, new) in diff.items())
                             + "; resume with the saved model config (drop the model.* overrides)")
        check_resume(ckpt, self.cfg)
        self.strategy.load(ckpt)
        self.data.load_state_dict(ckpt.state["data"])
        self.step, self.last_ckpt = ckpt.step, ckpt.path

    def train_step(self) -> tuple[float, dict[str, float]]:
        """One optimizer step; returns the mean loss over dp and the phase times. Collective."""
        return self._settle(self.launch_step(defer=False), time.perf_counter())

    def launch_step(self, *, defer: bool) -> PendingStep:
        """One optimizer step; ``defer``: left queued on the device (``host_overlap.py``), else read. Collective."""
        cfg, sync = self.cfg, synchronizer(self.mesh.device)
        self.step += 1
        torch.manual_seed(cfg.train.seed * 1_000_003 + self.step * 1_009 + self.mesh.coord("dp"))
        lr = lr_at(self.step, cfg.optimizer, cfg.train.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        start = time.perf_counter()
        batches = self.data.next()
        t: dict[str, float] = {"fwd": 0.0, "bwd": 0.0, "comm": 0.0, "data": time.perf_counter() - start}
        if self.token_loss is not None:  # the step's counted targets over all ranks (one all-reduce over dp)
            self.token_loss.tokens = counted_targets(batches, self.mesh, self.strategy.data_shard()[0])
        # injected non-finite loss (debug.nonfinite_step): NaN loss, NaN gradients
        poison = cfg.debug.nonfinite_step == self.step and cfg.debug.nonfinite_rank in (-1, self.world.rank)
        # the bytes autograd keeps for backward, at their high-water mark; a GPU's allocator peak says it without
        # a Python hook per saved tensor (which would cost host time the GPU waits for at small micro-batches)
        late: dict[str, Any] = {"marks_out": []} if defer else {}  # the passes' timing marks, read with the step
        self.moe.before(len(batches))
        if not hasattr(self.strategy, "phase"):  # a pipeline interleaves forward and backward: one phase
            self.meter.begin("forward+backward")
        with self.activations if self.mesh.device.type != "cuda" else nullcontext():
            loss_sum = self.strategy.passes(batches, t, sync, poison=poison, loss_fn=self.token_loss, **late)
        self.moe.synced()  # expert pieces' gradients (before the guard and clipping read them)
        self.meter.begin("step")  # clipping, the optimizer step, zero_grad
        t0 = time.perf_counter()
        if cfg.debug.bug == "sum_grads":
            self.strategy.scale_param_grads(self.mesh.size("dp"))  # injected bug: the sum over dp (× cp), not the mean
        if defer:
            return finish_deferred(self.strategy, self.mesh, loss_sum, self.strategy.grads(), step=self.step, lr=lr,
                                   t=t, marks=late["marks_out"])  # the next phase's begin closes "step"
        local_loss = loss_sum if isinstance(loss_sum, torch.Tensor) else torch.tensor(loss_sum, device=self.mesh.device)
        self.grad_norm = float("nan")  # the step's norm before clipping (logged with clipping on; NaN: skipped)
        if self._finite(local_loss):  # collective: every rank takes the same branch
            self.skipped_in_row, self.last_skipped = 0, False
            if cfg.optimizer.clip_grad_norm > 0:  # collective: one tiny all-reduce per axis needing it (grad_clip.py)
                self.grad_norm = self.strategy.clip_grad_norm(cfg.optimizer.clip_grad_norm)
            self.optimizer.step()
            if self.memory is None:  # the first step: parameters, gradients and optimizer state all live
                self.memory = strategy_memory(self.strategy)
        else:
            self._skip(local_loss)  # raises NonFiniteError unless train.nonfinite = skip allows this one
        self.moe.after(not self.last_skipped)  # MoE: bias update and routing statistics (collective over dp)
        self.optimizer.zero_grad(set_to_none=True)
        sync()
        self.meter.end()
        t1 = time.perf_counter()
        value = self.strategy.mean_loss(loss_sum)  # collective over dp (a pipeline's loss is already the mean)
        t2 = time.perf_counter()
        t.update(opt=t1 - t0, comm=t["comm"] + t2 - t1, step=t2 - start)
        return PendingStep(self.step, lr, value, t)

    def _settle(self, p: PendingStep, since: float) -> tuple[float, dict[str, float]]:
        """``(loss, times)`` of a step; a deferred one is read now (``host_overlap.read``), then its skip policy."""
        if not p.deferred:
            return float(p.loss), p.t
        loss, self.last_skipped, t = read(p, since)
        self.skipped_in_row = self.skipped_in_row if self.last_skipped else 0
        if self.last_skipped:
            self._skip(loss, late=p.step)  # counts the skip, or raises NonFiniteError
        return loss, t

    def _finite(self, loss: torch.Tensor) -> bool:
        """Whether this step's loss and every gradient are finite on every rank (``nonfinite.py``): one fused
        local check, then one ``max`` all-reduce of one number per mesh axis. Collective over the whole mesh."""
        return not agree(local_flag(loss, self.strategy.grads()), self.mesh)

    def _skip(self, loss: torch.Tensor | float, late: int = 0) -> None:
        """A non-finite step: drop its gradients without an optimizer step (weights, optimizer state and its
        step count unchanged; the step counter, LR schedule and data position still advance), or raise
        ``NonFiniteError`` (policy ``stop``, or the ``train.max_skipped``-th skip in a row). ``late``: step
        ``late`` was read a step late: its gradients are gone, the optimizer already skipped it. Local."""
        cfg = self.cfg.train
        if cfg.nonfinite == "skip":
            self.skipped, self.skipped_in_row, self.last_skipped = self.skipped + 1, self.skipped_in_row + 1, True
            if self.skipped_in_row < cfg.max_skipped:
                self.optimizer.zero_grad(set_to_none=True)  # ZeRO/pipeline optimizers zero their flat buffers
                return
        where = "not named (read a step late on CUDA)" if late else first_nonfinite(self.strategy.grads())
        raise NonFiniteError(failure_message(late or self.step, float(loss), where,
                                             skipped=self.skipped_in_row if cfg.nonfinite == "skip" else 0))

    def save(self) -> Path:
        """Atomic sharded checkpoint of the current step. Collective over the whole mesh."""
        self.meter.begin("save")
        state: dict[str, Any] = {"step": self.step, "data": self.data.state_dict(), "config": self.cfg.to_dict(),
                                 "aliases": tied_aliases(self.plain)}
        hf = hf_of(self.cfg.model)
        if hf is not None:  # the architecture itself, so that an export stays loadable if the file moves
            state["hf_config"] = hf.hf_dict()
        pieces = omit_frozen(self.strategy.pieces(), state, self.plain, self.cfg)  # collective for ZeRO
        state.update(self.strategy.shared_state())
        rank_state: dict[str, Any] = {"rank": self.world.rank, **self.strategy.rank_state()}
        self.last_ckpt = save_checkpoint(self.run_dir / CHECKPOINTS, self.step, pieces, mesh=self.mesh, state=state,
                                         rank_state=rank_state, keep=self.cfg.train.keep_checkpoints,
                                         crash_before_rename=self.cfg.debug.crash_in_save == self.step)
        return self.last_ckpt  # the next phase's begin (or the ledger) closes "save"

    def run(self, *, save: bool = True) -> dict[str, Any]:
        """Train from ``self.step`` to ``train.steps``; checkpoints every ``ckpt_every`` and at the end."""
        cfg, rank0 = self.cfg, self.world.rank == 0
        writer = MetricsWriter(self.run_dir, truncate_after=self.step) if rank0 else None
        progress = (ProgressReporter(total=cfg.train.steps, start=self.step, log_every=cfg.train.log_every)
                    if rank0 else None)
        loss, timings, start_step, t_begin = float("nan"), [], self.step, time.perf_counter()
        queued: PendingStep | None = None  # a deferred step not read yet (host_overlap.py)
        try:
            while self.step < cfg.train.steps:
                if cfg.debug.kill_rank == self.world.rank and cfg.debug.kill_step == self.step + 1:
                    while cfg.debug.hang:  # injected hang: alive, silent, never reaching the collective
                        time.sleep(1)
                    os._exit(13)  # injected death: no cleanup, no message, like a segfault or an OOM kill
                self._beat()
                read_at = time.perf_counter() if queued is None else read_at
                launched = self.launch_step(defer=self.overlap and self.memory is not None)  # 1st: memory report
                if queued is not None:  # the previous step, read now that this one is queued behind it
                    loss, read_at = self._log(queued, read_at, timings, writer, progress), time.perf_counter()
                evaluate = self.val is not None and (self.step % cfg.train.eval_every == 0 or self.step == cfg.train.steps)
                periodic = cfg.train.ckpt_every and self.step % cfg.train.ckpt_every == 0
                queued = launched
                if not launched.deferred or evaluate or periodic or self.step == cfg.train.steps:
                    loss, queued = self._log(launched, read_at, timings, writer, progress), None
                if evaluate:
                    self._evaluate(writer, progress)
                if save and periodic and self.step < cfg.train.steps:
                    self.save()
        finally:
            if progress is not None:
                progress.close()
            if writer is not None:
                writer.close()
        if save and (self.last_ckpt is None or Checkpoint(self.last_ckpt).step != self.step):
            self.save()
        return self._summary(loss, timings, self.step - start_step, time.perf_counter() - t_begin)

    def _evaluate(self, writer: MetricsWriter | None, progress: ProgressReporter | None) -> None:
        """A validation pass (``validation.py``), written to the metrics and the progress line. Collective."""
        assert self.val is not None
        self.meter.begin("eval")
        record = evaluate(self.strategy, self.plain, self.val, self.step)
        self.evals.append(record)
        if writer is not None and progress is not None:
            writer.write(record)
            progress.note(f"eval  step {record['step']:>6}  val_loss {record['val_loss']:.4f}  "
                          f"ppl {record['val_ppl']:.2f}  ({record['val_tokens']:,} tokens, {record['eval_s']:.2f} s)")

    def _beat(self) -> None:
        """Record the step this rank is starting in ``RUN/ranks/rankN.step`` (one pwrite, ~µs): after a failure
        the launcher names the rank that fell behind — the one that died or hung."""
        if self._beat_fd is None:
            (self.run_dir / "ranks").mkdir(exist_ok=True)
            path = self.run_dir / "ranks" / f"rank{self.world.rank:05d}.step"
            self._beat_fd = os.open(path, os.O_WRONLY | os.O_CREAT)
        os.pwrite(self._beat_fd, f"{self.step + 1:<12d}".encode(), 0)

    def _log(self, p: PendingStep, since: float, timings: list[dict[str, float]], writer: MetricsWriter | None,
             progress: ProgressReporter | None) -> float:
        """Read step ``p`` (``_settle``); its times, metrics record and progress line. Local."""
        loss, t = self._settle(p, since)
        timings.append(t)
        if writer is not None and progress is not None:
            writer.write({**self._record(loss, t, p), **self.strategy.compiled.record(), **self.moe.record()})
            for line in self.moe.warnings():  # an expert without tokens for STARVED_STEPS steps
                progress.note(line)
            progress.update(p.step, loss, self.tokens_per_step / t["step"])
            self.strategy.compiled.note(progress, p.step)  # train.compile: a recompilation is reported, not silent
        return loss

    def _record(self, loss: float, t: dict[str, float], p: PendingStep | None = None) -> dict[str, Any]:
        step, lr = (p.step, p.lr) if p is not None else (self.step, self.optimizer.param_groups[0]["lr"])
        overhead = t["step"] - t["fwd"] - t["bwd"] - t["opt"] - t["comm"]
        return {"step": step, "loss": loss, "lr": lr,
                "tokens": step * self.tokens_per_step, "tokens_per_s": self.tokens_per_step / t["step"],
                "step_s": t["step"], "fwd_s": t["fwd"], "bwd_s": t["bwd"], "opt_s": t["opt"], "comm_s": t["comm"],
                "data_s": t["data"], "overhead_s": overhead, "time": time.time(), "skipped": self.last_skipped,
                **({"grad_norm": self.grad_norm} if self.cfg.optimizer.clip_grad_norm > 0 else {}),
                **({"host_wait_s": t["host_wait"]} if "host_wait" in t else {})}

    def _summary(self, loss: float, timings: list[dict[str, float]], steps: int, wall: float) -> dict[str, Any]:
        # Medians over the steps after the first two (allocator warm-up, bucket rebuild): robust to the
        # pauses of a shared machine, which a mean would charge to the framework.
        steady = timings[2:] if len(timings) > 2 else timings
        step_s = statistics.median(t["step"] for t in steady) if steady else 0.0
        outside = [t["step"] - t["fwd"] - t["bwd"] - t["opt"] - t["comm"] for t in steady]
        overhead = statistics.median(outside) if outside else 0.0
        # the strategy's report: model states and peak (on CUDA the run's: the meter resets the allocator's mark)
        memory = fullest(self.memory or {}, strategy_memory(self.strategy), self.meter)
        return {"rank": self.world.rank, "final_loss": loss, "steps": steps, "wall_s": wall,
                "tokens_per_s": self.tokens_per_step / step_s if step_s else 0.0,
                "wall_tokens_per_s": steps * self.tokens_per_step / wall if wall else 0.0,
                "step_s": step_s, "overhead_s": overhead, "peak_memory": self.meter.whole_peak(),
                "device": str(self.mesh.device), "checkpoint": str(self.last_ckpt) if self.last_ckpt else None,
                "skipped_steps": self.skipped, "memory": memory, "bare_runtime_bytes": self.bare_runtime,
                "construction_peak_bytes": self.construction_peak, "construction_s": self.construction_s,
                "pretrained_bytes_read": getattr(self.strategy, "pretrained_bytes_read", 0),
                "val_loss": self.evals[-1]["val_loss"] if self.evals else None,
                "eval_s": statistics.median(e["eval_s"] for e in self.evals) if self.evals else None,
                "model_state_bytes": sum(memory.get(k, 0) for k in ("params", "grads", "optimizer")),
                "activation_peak_bytes": activation_peak(self.meter, memory, self.activations.peak),
                "memory_ledger": rank_ledger(self.meter, self.bare_runtime, self.cfg, self.mesh.coord("pp")
                                             if self.cfg.parallel.pp > 1 else 0, self.activations.peak, memory),
                **self.strategy.compiled.summary(timings[0]["step"] if timings else None, step_s)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardwise.runtime.trainer", description=__doc__)
    parser.add_argument("--run-dir", required=True, help="run directory holding config.json")
    parser.add_argument("--resume", default=None, help="checkpoint to continue from")
    parser.add_argument("--no-save", action="store_true", help="write no checkpoints (shardwise verify)")
    parser.add_argument("--config", default=None, help="config of this launch (default RUN_DIR/config.json)")
    parser.add_argument("--attempt", type=int, default=0, help="restart count (debug.* faults fire on attempt 0 only)")
    args = parser.parse_args(argv)
    bind_to_launcher()  # first: an orphaned rank must never train on
    run_dir = Path(args.run_dir)
    cfg = load_config(path=args.config or run_dir / "config.json")
    if args.attempt > 0:  # a restarted job resumes past the injected fault instead of meeting it again
        cfg = dataclasses.replace(cfg, debug=type(cfg.debug)())
    world = init(timeout_s=max(cfg.train.timeout_s, STARTUP_TIMEOUT_S))  # the default group: start-up only
    trainer = Trainer(cfg, run_dir, world, resuming=bool(args.resume))
    try:
        if args.resume:
            trainer.resume(args.resume)
            barrier_all()  # ranks read the checkpoint at different speeds; meet before the first timed step
        summary = trainer.run(save=not args.no_save)
    except (KeyboardInterrupt, Exception) as exc:
        if isinstance(exc, KeyboardInterrupt) or interrupted():  # interrupted(): Ctrl-C swallowed where it
            # landed (a finalizer), then a collective failed as the peers stopped. The launcher passes Ctrl-C on
            # to every rank and reports it, once. Saves are atomic: the last published checkpoint stays intact.
            (run_dir / "ranks").mkdir(exist_ok=True)
            (run_dir / "ranks" / f"rank{world.rank:05d}.interrupted").write_text(str(trainer.step))
            return 130
        message = f"rank {world.rank} failed at step {trainer.step}: {type(exc).__name__}: {exc}"
        (run_dir / "ranks").mkdir(exist_ok=True)
        (run_dir / "ranks" / f"rank{world.rank:05d}.error").write_text(message)
        print(f"shardwise train: {message}{peer_hint(exc, cfg.train.timeout_s)}", file=sys.stderr, flush=True)
        raise SystemExit(1) if isinstance(exc, DataError) else exc  # bad data is said in full above: no traceback
    (run_dir / "ranks").mkdir(exist_ok=True)
    (run_dir / "ranks" / f"rank{world.rank:05d}.json").write_text(json.dumps(summary))
    shutdown()
    return 0


if __name__ == "__main__":
    exit_process(main())
