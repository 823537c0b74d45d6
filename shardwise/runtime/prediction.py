"""What the planner says about a training config: its ``Layout``, the hardware it runs on, and the records the
launcher writes (``shardwise predict`` and the prediction ``shardwise train`` prints before it starts).

``plan_from_config`` is pure. ``resolve_hardware`` reads a preset or a calibration file. ``quick_probe_hardware``
times a few kernels in this process (well under a second) for a machine that has no calibration yet.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from ..planner import PRESETS, Hardware, Link, ModelSpec, Layout, Prediction, predict
from ..planner.overhead import TINY_BLOCK, autocast_factor, with_launch_cost
from .config import Config
from .model_build import planner_split_names

__all__ = ["plan_from_config", "gpt_spec", "with_documents", "moe_hf_spec", "local_calibration", "resolve_hardware", "quick_probe_hardware",
           "quick_probe_measurements", "probed_hardware", "launch_hardware", "predict_launch", "prediction_record",
           "prediction_line"]

_PRECISION = {"fp32": "fp32", "bf16": "bf16", "bf16-mixed": "bf16-mixed"}
"""``train.precision`` → ``Layout.precision``: ``bf16`` is autocast over fp32 weights in both; ``bf16-mixed`` bf16
weights and gradients with fp32 masters in both."""

# Layout field → the config key it comes from, so that a Layout error names what the user typed.
_KEYS = (("Layout.schedule", "parallel.pp_schedule"), ("Layout.chunks", "parallel.pp_chunks"),
         ("Layout.microbatches", "parallel.pp_microbatches"), ("Layout.micro_batch", "parallel.micro_batch"),
         ("Layout.grad_accum", "parallel.grad_accum"), ("Layout.zero_stage", "parallel.zero_stage"),
         ("Layout.precision", "train.precision"), ("Layout.", "parallel."))


def plan_from_config(cfg: Config, *, train_passes: bool = False) -> Layout:
    """The ``Layout`` of a validated config (``validate``: ``nproc`` and ``dp`` resolved).

    Field by field: ``dp``, ``cp``, ``tp``, ``pp``, ``ep`` (``parallel.ep``, 1 where the config has none),
    ``zero_stage`` as they are; ``optimizer`` from ``optimizer.name`` (SGD with ``beta1`` > 0 keeps a momentum
    buffer); ``activation_checkpointing`` as it is (``none``, ``full``, ``selective``); ``train.precision`` ``fp32``/``bf16`` → the same plan precision
    (bf16 autocast over fp32 weights); ``sequence_parallel`` and ``async_tp`` as they are.

    The batch with pp = 1: ``micro_batch`` sequences per pass, ``grad_accum`` passes (0: inferred by
    ``Layout.resolved`` from the global batch).

    The batch with pp > 1 has two readings:

    * default (``shardwise predict``; Megatron's semantics, the planner's): ``parallel.micro_batch`` is the
      sequences of ONE pipeline micro-batch, ``parallel.pp_microbatches`` the micro-batches per flush (0: every
      micro-batch of the step in one flush), ``parallel.grad_accum`` the flushes per step (0: inferred);
      ``global_batch = dp × grad_accum × micro_batch × pp_microbatches``.
    * ``train_passes=True`` (what ``shardwise train`` runs today, on a config ``validate`` resolved):
      ``parallel.micro_batch`` is the sequences of one pipeline *pass* of a dp replica, cut into
      ``pp_microbatches`` equal micro-batches, ``grad_accum`` passes per step; so the plan's micro-batch is
      ``micro_batch / pp_microbatches``. (Should train adopt Megatron's reading, this keyword goes away.)

    ``ValueError`` naming the config key when the layout is not one the planner knows.
    """
    p = cfg.parallel
    dp = p.dp or p.nproc // (p.tp * p.pp * p.cp)
    fields: dict[str, Any] = dict(
        dp=dp, cp=p.cp, tp=p.tp, pp=p.pp, ep=getattr(p, "ep", 1), zero_stage=p.zero_stage, grad_accum=p.grad_accum,
        activation_checkpointing=p.activation_checkpointing,
        sequence_parallel=p.sequence_parallel, async_tp=p.async_tp,
        precision=_PRECISION.get(cfg.train.precision, cfg.train.precision), optimizer=_optimizer(cfg),
        schedule=p.pp_schedule if p.pp > 1 else "1f1b", chunks=p.pp_chunks if p.pp > 1 else 1,
        pp_split=planner_split_names(cfg.model, tuple(p.pp_split)) if p.pp > 1 else ())
    if p.pp == 1:
        fields.update(micro_batch=p.micro_batch)
    elif train_passes:
        m = p.pp_microbatches
        if m < 1 or p.micro_batch % m:
            raise ValueError(f"parallel.pp_microbatches = {m} must be >= 1 and divide parallel.micro_batch = "
                             f"{p.micro_batch} (validate the config first)")
        fields.update(micro_batch=p.micro_batch // m, microbatches=m)
    else:
        fields.update(micro_batch=p.micro_batch, microbatches=p.pp_microbatches)
    try:
        return Layout(**fields)
    except ValueError as exc:
        text = str(exc)
        for ours, theirs in _KEYS:
            text = text.replace(ours, theirs)
        raise ValueError(text) from None


def _optimizer(cfg: Config) -> str:
    """``Layout.optimizer`` of the config: AdamW, or SGD with (``optimizer.beta1`` > 0: the momentum) or without a
    momentum buffer."""
    if cfg.optimizer.name == "sgd":
        return "sgd-momentum" if cfg.optimizer.beta1 > 0 else "sgd"
    return "adamw"


def local_calibration(device: str, nproc: int) -> Path | None:
    """``default_calibration_path(device, nproc)`` (``shardwise calibrate``'s file) when it exists, else None
    (also when this build's ``shardwise.comm`` has no calibration files)."""
    try:
        from ..comm.hardware import default_calibration_path
    except ImportError:
        return None
    path = default_calibration_path(device, nproc)
    return path if path.is_file() else None


def resolve_hardware(name_or_path: str | None, *, device: str, nproc: int,
                     devices_per_node: int | None = None) -> Hardware:
    """A preset name or a calibration file; ``None``: this machine's calibration for ``nproc`` ranks on
    ``device``. ``ValueError`` (one line, listing the presets) when there is none or the file is bad."""
    if devices_per_node is not None and devices_per_node < 1:
        raise ValueError(f"--devices-per-node {devices_per_node} must be >= 1; e.g. --devices-per-node 8")
    if name_or_path is None:
        path = local_calibration(device, nproc)
        if path is None:
            raise ValueError(f"no --hardware given and no calibration of this machine for {nproc} {device} ranks; "
                             f"pass --hardware with one of {sorted(PRESETS)} or a calibration file "
                             f"(`shardwise calibrate --out FILE`)")
        name_or_path = str(path)
    try:
        return Hardware.resolve(name_or_path, devices_per_node=devices_per_node)
    except (OSError, TypeError, KeyError) as exc:
        raise ValueError(f"hardware file {name_or_path!r} cannot be read as a calibration "
                         f"({type(exc).__name__}: {exc}); regenerate it with `shardwise calibrate --out FILE`") from None


# The intra-node link of CPU ranks over gloo, from benchmarks/calibration_cpu_4ranks.json (4 ranks on a
# 2-core VM): the native all-reduce's alpha = 2.1 ms over 2(n-1) = 6 steps, beta = 1.73e-3 us/B, i.e. a bus
# bandwidth of 2(n-1)/n / beta = 0.87 GB/s. Hard-coded: nothing reads repository files at run time.
_CPU_LINK = Link(alpha_s=3.5e-4, bus_bandwidth_Bps=0.87e9)
# NCCL within a node when nothing was measured: a modest PCIe-class figure (NVLink machines are faster).
_CUDA_LINK = Link(alpha_s=1e-5, bus_bandwidth_Bps=20e9)


def _per_call(fn: Callable[[], Any], sync: Callable[[], None], budget_s: float = 0.03) -> float:
    """Seconds per call of ``fn`` (one warm-up call, then as many as fit in ``budget_s``, at most 200)."""
    fn()
    sync()
    calls, start = 0, time.perf_counter()
    while calls < 200 and (calls < 2 or time.perf_counter() - start < budget_s):
        fn()
        calls += 1
    sync()
    return max((time.perf_counter() - start) / calls, 1e-9)


def _threads_per_rank(nproc: int, cores: int) -> int:
    """Threads one rank computes with: ``OMP_NUM_THREADS`` when set, else torchrun's default (1 for several
    ranks per node, all cores for one)."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    return int(given) if given.isdigit() and int(given) > 0 else (1 if nproc > 1 else cores)


def quick_probe_hardware(nproc: int, *, device: str = "cpu") -> Hardware:
    """This machine as ``nproc`` training ranks see it, from a probe of well under a second in THIS process
    (``quick_probe_measurements``, then the pure ``probed_hardware``)."""
    return probed_hardware(**quick_probe_measurements(nproc, device=device))


def quick_probe_measurements(nproc: int, *, device: str = "cpu") -> dict[str, Any]:
    """What the quick probe measures, as ``probed_hardware``'s keyword arguments (plain numbers and lists: a
    record can keep them): fp32 matmuls of 64..512 (the GEMM curve and peak), one large elementwise op (memory
    bandwidth), one tiny op (per-op overhead) and a tiny block's forward + backward (per-launch cost).

    On the CPU the ranks share the cores. The probe runs on the threads one rank computes with (torchrun gives
    each of several ranks one; a single rank gets the cores, or ``OMP_NUM_THREADS``), at most ``cores /
    nproc``; ranks that outnumber the cores run at ``cores / nproc`` of that (4 ranks on 2 cores at half: the
    throughput of all cores divided among the ranks sharing them). Memory bandwidth and launches are scaled
    alike, and each rank gets ``1/nproc`` of the physical memory. The link is a default gloo one (hard-coded,
    from a 4-rank calibration); bf16 is taken to run at the fp32 rate on a CPU, and timed (squares to 4096 and
    GPT-2-sized shapes) on a GPU. A first-order estimate: ``shardwise calibrate`` measures all of it with every
    rank busy. On ``device="cuda"`` the probe runs on this process's GPU (one per rank, nothing shared) with a
    default NCCL link, and also times the tiny block under bf16 autocast."""
    import torch

    cuda, cores = device == "cuda", os.cpu_count() or 1
    dev = torch.device("cuda" if cuda else "cpu")
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    # a CPU rank computes with its own threads (timed with them: small GEMMs and launches gain nothing from a
    # second thread); ranks that outnumber the cores get their share of them (scale < 1)
    rank_threads = 1 if cuda else max(1, min(_threads_per_rank(nproc, cores), cores // max(nproc, 1)))
    scale = 1.0 if cuda else min(1.0, cores / max(nproc, 1))
    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads)
    try:
        rows = []
        for n in ((256, 512, 1024, 2048) if cuda else (64, 128, 256, 512)):
            a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
            rows.append((float(n), 2.0 * n ** 3 / _per_call(lambda: a @ b, sync)))
        # beyond the caches: 32 MiB on a CPU; 256 MiB on a GPU (an H100/H200's L2 holds 50-60 MB, and a 32 MiB
        # buffer measured the L2's bandwidth, several times the HBM's). The calibration's op, y = b + a·x with a
        # 0-d tensor b (one read and one write per element): an in-place x += 1 streams faster than training's
        # elementwise kernels do (H200: 4.1 TB/s against 2.8, and a step predicted 17 % too fast)
        x = torch.rand(1 << (26 if cuda else 23), device=dev)
        y, bias = torch.empty_like(x), torch.tensor(0.5, device=dev)
        bandwidth = 2 * x.numel() * 4 / _per_call(lambda: torch.add(bias, x, alpha=1.5, out=y), sync)
        del x, y
        tiny = torch.zeros(1, device=dev)
        overhead = _per_call(lambda: tiny.add_(1.0), sync, budget_s=0.005)
        block_s = _per_call(tiny_block_step(dev), sync, budget_s=0.02)
        # GPU: one more block's launches without the pass's fixed costs (see tiny_block_step)
        block2_s = _per_call(tiny_block_step(dev, 2), sync, budget_s=0.02) if cuda else None
        # GPU: the same block under bf16 autocast (bf16 plans pay autocast's dispatch and casts per launch)
        block_ac_s = _per_call(tiny_block_step(dev, autocast=True), sync, budget_s=0.02) if cuda else None
    finally:
        torch.set_num_threads(threads)
    # a GPU's bf16 tensor cores run ~15x its fp32 units and fill only at larger sizes: time bf16 squares too,
    # for bf16's own peak and efficiency points (a CPU without bf16 units would only be slower, and the planner
    # takes its bf16 rate = fp32 there)
    bf16_rows = _bf16_points(dev, sync) if cuda else []
    if cuda:
        memory = float(torch.cuda.get_device_properties(dev).total_memory)
    else:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / max(nproc, 1)
    return {"device": device, "nproc": nproc, "cores": cores, "scale": scale, "rows": rows, "bf16_rows": bf16_rows,
            "bandwidth": bandwidth, "overhead": overhead, "memory": memory, "block_s": block_s, "block2_s": block2_s,
            "block_ac_s": block_ac_s}


def probed_hardware(*, device: str, nproc: int, cores: int, scale: float, rows: list[tuple[float, float]],
                    bf16_rows: list[tuple[float, float, float, float]], bandwidth: float, overhead: float,
                    memory: float, block_s: float, block2_s: float | None,
                    block_ac_s: float | None = None) -> Hardware:
    """The quick probe's ``Hardware`` from its measurements (pure): ``rows`` are ``(n, FLOP/s)`` of n-square
    fp32 matmuls, ``bf16_rows`` ``(m, n, k, FLOP/s)`` of bf16 ones (a GPU's own peak and efficiency points;
    none: bf16 at the fp32 rate), ``block_s``/``block2_s`` one and two tiny blocks per pass (the per-launch
    cost), ``block_ac_s`` one under bf16 autocast, all per rank at the threads it computes with, before
    ``scale`` (its share of the cores where ranks outnumber them)."""
    cuda = device == "cuda"
    peak = max(f for _, f in rows)
    bf16_peak = max((row[3] for row in bf16_rows), default=peak)
    link = _CUDA_LINK if cuda else _CPU_LINK
    hw = Hardware(name=f"{device}-quick-probe", peak_flops={"fp32": peak * scale, "bf16": bf16_peak * scale},
                  memory_bytes=memory, memory_bandwidth_Bps=bandwidth * scale, devices_per_node=max(nproc, 1),
                  intra=link, inter=link, gemm_curve=tuple((d, min(1.0, f / peak)) for d, f in rows),
                  op_overhead_s=overhead, p2p_alpha_s=2 * link.alpha_s, kind="gpu" if cuda else "cpu",
                  gemm_points_bf16=tuple((m, n, k, f / bf16_peak) for m, n, k, f in bf16_rows),
                  autocast_launch_factor=autocast_factor(block_s, block_ac_s),
                  source=f"quick probe ({nproc} rank{'s' * (nproc > 1)}{'' if cuda else f' on {cores} cores'}, "
                         f"default link)")
    return with_launch_cost(hw, block_s / scale, gpu=cuda, tiny2_s=block2_s)


GPU_SKINNY_GEMMS = ((16384, 768, 768), (16384, 3072, 768), (16384, 768, 3072))
"""``(m, n, k)`` of a GPT-2-sized layer (16,384 tokens): a GPU probe times these besides squares. On an H200 a
short burst of 4096-squares ran at 805 TFLOP/s while these ran at 530-720: priced from squares alone, a
training step came out 20 % too fast."""


def _bf16_points(dev: Any, sync: Callable[[], None]) -> list[tuple[float, float, float, float]]:
    """``(m, n, k, FLOP/s)`` of bf16 matmuls on a GPU: squares 256 … 4096 and ``GPU_SKINNY_GEMMS`` (tens of
    milliseconds)."""
    import torch

    rows = []
    for m, n, k in [(s, s, s) for s in (256, 512, 1024, 2048, 4096)] + list(GPU_SKINNY_GEMMS):
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
        rows.append((float(m), float(n), float(k), 2.0 * m * n * k / _per_call(lambda: a @ b, sync)))
    return rows


def tiny_block_step(dev: Any, depth: int = 1, *, autocast: bool = False) -> Callable[[], None]:
    """One forward + backward of ``depth`` reference blocks at ``TINY_BLOCK`` on ``dev``: their arithmetic is
    microseconds, so timing them measures what each launch costs in eager training (``planner/overhead.py``).
    Timed by the quick probe here and by the calibration (``cli/calibrate_probe.py``). One call also pays a whole
    pass's fixed costs (the ``sum``, the autograd engine's start); a GPU probe times ``depth`` 2 as well, and
    the difference is one block's launches alone. ``autocast``: the forward under bf16 autocast and the
    backward outside it, as ``shardwise train`` runs ``train.precision bf16``."""
    import torch

    from ..models.gpt import Block, GPTConfig

    t = TINY_BLOCK
    cfg = GPTConfig(n_embd=t["n_embd"], n_head=t["n_head"], block_size=t["seq"])
    blocks = torch.nn.Sequential(*[Block(cfg) for _ in range(depth)]).to(dev)
    x = torch.randn(t["batch"], t["seq"], t["n_embd"], device=dev, requires_grad=True)
    if not autocast:
        return lambda: blocks(x).sum().backward()

    def step() -> None:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = blocks(x).float().sum()
        loss.backward()

    return step


_PROBED: dict[tuple[str, int], Hardware] = {}


def launch_hardware(cfg: Config, *, device: str, nproc: int) -> tuple[Hardware, str]:
    """``(hardware, where its numbers come from)`` for a launch of ``nproc`` ranks here: the
    ``parallel.calibration`` file, else this machine's calibration, else ``quick_probe_hardware`` (probed once
    per process, so that ``--parallel.auto``'s choice and the printed prediction use the same numbers)."""
    path = cfg.parallel.calibration or local_calibration(device, nproc)
    if path:
        return Hardware.load(path), f"calibration {path}"
    if (device, nproc) not in _PROBED:
        _PROBED[(device, nproc)] = quick_probe_hardware(nproc, device=device)
    hw = _PROBED[(device, nproc)]
    return hw, f"{hw.source[:-1]}; `shardwise calibrate` measures it)"


def predict_launch(cfg: Config, *, device: str, nproc: int) -> tuple[Prediction, str]:
    """``(prediction, where the hardware numbers come from)`` for a config ``validate`` resolved, as
    ``shardwise train`` runs it (``train_passes``) with ``nproc`` ranks on this node: the local calibration
    if there is one, else ``quick_probe_hardware``."""
    hw, where = launch_hardware(cfg, device=device, nproc=nproc)
    plan = plan_from_config(cfg, train_passes=True)
    return predict(gpt_spec(cfg), plan, hw, global_batch=cfg.data.global_batch), where


def gpt_spec(cfg: Config) -> ModelSpec:
    """The planner's spec of ``cfg``'s model (the GPT, or the Llama shape of ``model.hf_config``), with the modules
    ``parallel.replicate`` keeps whole."""
    from .config import replicable, replicated_modules
    from .model_build import model_spec, with_adapters

    spec = with_documents(with_adapters(moe_hf_spec(cfg.model) or model_spec(cfg.model), cfg), cfg)
    whole = replicated_modules(cfg)
    return spec.replicate(sorted(replicable(cfg.model)[name] for name in whole)) if whole else spec


def with_documents(spec: ModelSpec, cfg: Config) -> ModelSpec:
    """``spec`` as the run trains it under ``data.document_mask``, resolved as the trainer does
    (``documents.document_eos``) from the prepared dataset's index (no shard read): documents of the train split's
    mean length (tokens / documents) cut at the rows' edges (``planner.documents.row_document_length``). ``spec``
    itself when masking is off, the data is not a prepared dataset (``check_data`` names a problem) or its index
    counts no documents."""
    from types import SimpleNamespace

    from ..data.prepared import open_prepared
    from ..planner.documents import row_document_length
    from .documents import document_eos

    path, fmt = cfg.data.path, cfg.data.format
    prepared = fmt == "prepared" or (fmt == "auto" and bool(path) and Path(path).is_dir())
    if cfg.data.document_mask == "false" or not prepared:
        return spec
    try:
        ds = open_prepared(path)
    except (ValueError, OSError):
        return spec
    if document_eos(cfg, SimpleNamespace(masked=ds.sft, eos_id=ds.eos_id)) is None:  # type: ignore[arg-type]
        return spec
    tokens, documents = len(ds.train.tokens), ds.train.documents
    if tokens < 1 or documents < 1:
        return spec
    return spec.with_documents(row_document_length(tokens / documents, spec.seq_len))


def moe_hf_spec(m: Any) -> ModelSpec | None:
    """The planner's own spec of an HF mixture of experts (``model.hf_config`` of a ``model_type`` in
    ``planner.hf_spec.MOE_TYPES``: experts, shared experts, sliding windows, MLA), read from the file's JSON at
    ``model.block_size`` tokens; None for any other model (the GPT, a dense HF decoder)."""
    import json

    from ..planner.hf_spec import MOE_TYPES

    path = getattr(m, "hf_config", "")
    if not path:
        return None
    try:
        raw = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError):
        return None  # model_spec's reader names the problem
    if not isinstance(raw, dict) or raw.get("model_type") not in MOE_TYPES:
        return None
    return ModelSpec.from_hf(raw, seq_len=m.block_size)


def _states(memory: dict[str, Any]) -> float:
    return float(memory["params"] + memory["grads"] + memory["optimizer"])


def prediction_record(pred: Prediction, where: str, *, step: int) -> dict[str, Any]:
    """The ``{"kind": "prediction"}`` record of ``metrics.jsonl``: written before the ranks start, ``step``
    being the step training starts from."""
    memory = pred.memory.to_json()
    return {"kind": "prediction", "step": step, "step_time_s": pred.step_time_s,
            "peak_memory_bytes": memory["total_bytes"], "model_state_bytes": _states(memory),
            "construction_bytes": memory["construction"],
            "tokens_per_s": pred.tokens_per_s, "fits": pred.fits, "memory": memory,
            "breakdown": dict(pred.breakdown), "plan": pred.plan.to_json(), "hardware": pred.hardware,
            "hardware_source": where, "time": time.time()}


def prediction_line(record: dict[str, Any]) -> str:
    """One line for the launcher's output."""
    from .metrics import format_bytes

    return (f"shardwise train: predicted {record['step_time_s']:.3g} s/step, {format_bytes(record['peak_memory_bytes'])}"
            f" peak per rank (model states {format_bytes(record['model_state_bytes'])}, construction "
            f"{format_bytes(record.get('construction_bytes', 0.0))}); hardware: {record['hardware_source']}")
