"""The compute probe of ``shardwise calibrate``: GEMM throughput, memory bandwidth and per-op overhead.

Measured the way training runs: every rank of the job probes at the same time (a barrier before each
measurement), so ``nproc`` ranks on one machine share its cores, memory bus or GPU as they do in a step. Each
number is per rank: the median over ranks of the median over ``blocks`` timed blocks of the mean time per call
in the block. A block lasts about ``block_s`` — much longer than an OS time slice, so with more ranks than
cores a block's mean includes the time the rank waited for a core (timing single short calls would not: the
median call runs uncontended). Calls per block are agreed between ranks (from the slowest warm-up) so they all
stay busy for the same stretch. On CUDA each block ends with ``torch.cuda.synchronize``. A GEMM whose
predicted time exceeds ``max_call_s`` (bfloat16 on a CPU without bfloat16 units is ~50× slower than float32)
is skipped, and so are the larger ones after it.

``run_probe(mesh, quick)`` is collective over the mesh's single axis ``world``; the rest is pure.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..comm.ops import gather_into_tensor
from ..runtime.prediction import GPU_SKINNY_GEMMS

__all__ = ["ProbeSettings", "probe_settings", "gemm_shapes", "run_probe"]


@dataclass(frozen=True)
class ProbeSettings:
    squares: tuple[int, ...]
    """Square GEMM sizes ``m = n = k``."""
    skinny: tuple[tuple[int, int, int], ...]
    """``(m, n, k)`` with many rows and narrow ``n, k``: a linear layer over a batch of tokens."""
    dtypes: tuple[str, ...]
    block_s: float
    """Target duration of one timed block (calls per block = block_s / one call, at least 1)."""
    blocks: int
    """Timed blocks per measurement (their median is the rank's time)."""
    max_call_s: float
    """Skip a GEMM predicted to take longer than this per call."""
    bandwidth_elements: int
    """float32 elements of the bandwidth probe ``y = a·x + b``."""


def probe_settings(quick: bool, device_type: str = "cpu") -> ProbeSettings:
    """The sweep for ``shardwise calibrate`` (``quick``: seconds). On a GPU the squares go on to 8192 and the
    skinny shapes to a GPT-2-sized layer (16,384 tokens x 768 x 3,072): a GPU's tensor cores fill only from
    a few thousand per side, and a CPU-sized sweep would set the peak at half the device's."""
    if device_type == "cuda":
        base = probe_settings(quick)
        # the bandwidth probe's buffer well past a GPU's L2 (50-60 MB on an H100/H200): 256 MiB
        return replace(base, squares=base.squares + ((2048, 4096, 8192) if quick else (4096, 8192)),
                       skinny=base.skinny + GPU_SKINNY_GEMMS,
                       bandwidth_elements=64 << 20)
    if quick:
        return ProbeSettings(squares=(64, 128, 256, 512), skinny=((4096, 64, 64), (4096, 256, 256)),
                             dtypes=("float32", "bfloat16"), block_s=0.02, blocks=3, max_call_s=0.05,
                             bandwidth_elements=8 << 20)
    return ProbeSettings(squares=(64, 128, 256, 512, 1024, 2048),
                         skinny=((4096, 64, 64), (4096, 256, 256), (4096, 256, 1024), (16384, 128, 128)),
                         dtypes=("float32", "bfloat16"), block_s=0.1, blocks=3, max_call_s=1.0,
                         bandwidth_elements=32 << 20)


def gemm_shapes(settings: ProbeSettings) -> list[tuple[int, int, int]]:
    """The GEMM sweep in increasing FLOP order: squares then skinny shapes. Pure."""
    shapes = [(s, s, s) for s in settings.squares] + list(settings.skinny)
    return sorted(dict.fromkeys(shapes), key=lambda s: (s[0] * s[1] * s[2], s))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _agreed_max(value: float, group: Any, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t[0])


def _median_over_ranks(value: float, group: Any, device: torch.device) -> float:
    n = dist.get_world_size(group)
    t = torch.tensor([value], dtype=torch.float64, device=device)
    out = torch.empty(n, dtype=torch.float64, device=device)
    gather_into_tensor(out, t, group=group)
    return float(statistics.median(out.tolist()))


def timed(call: Callable[[], object], mesh: Any, settings: ProbeSettings) -> float:
    """Seconds per call of ``call``: per rank the median over ``blocks`` of a block's mean, then the median over
    ranks. All ranks run it at once. Collective."""
    group, device = mesh.group("world"), mesh.device
    call()  # warm-up (allocations, kernel selection)
    _sync(device)
    start = time.perf_counter()
    call()
    _sync(device)
    one = _agreed_max(time.perf_counter() - start, group, device)
    per_block = max(1, math.ceil(settings.block_s / max(one, 1e-9)))
    dist.barrier(group=group)
    samples = []
    for _ in range(settings.blocks):
        start = time.perf_counter()
        for _ in range(per_block):
            call()
        _sync(device)
        samples.append((time.perf_counter() - start) / per_block)
    return _median_over_ranks(statistics.median(samples), group, device)


def _gemm(dtype_name: str, shapes: list[tuple[int, int, int]], mesh: Any,
          settings: ProbeSettings) -> list[list[float]]:
    dtype, device = getattr(torch, dtype_name), mesh.device
    rows: list[list[float]] = []
    for m, n, k in shapes:
        flop = 2.0 * m * n * k
        if rows and flop / rows[-1][3] > settings.max_call_s:
            break  # every rank skips alike: the prediction comes from the agreed median
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(k, n, device=device).to(dtype)
        out = torch.empty(m, n, device=device, dtype=dtype)
        seconds = timed(lambda: torch.mm(a, b, out=out), mesh, settings)
        rows.append([m, n, k, flop / seconds])
    return rows


def run_probe(mesh: Any, settings: ProbeSettings) -> dict[str, Any]:
    """The ``probe`` object of the hardware file, measured on every rank at once. Collective over ``world``."""
    device = mesh.device
    shapes = gemm_shapes(settings)
    gemm = {name: _gemm(name, shapes, mesh, settings) for name in settings.dtypes}
    x = torch.rand(settings.bandwidth_elements, device=device)
    y, bias = torch.empty_like(x), torch.tensor(0.5, device=device)
    # y = a·x + b: one read and one write of every element (one kernel; b is a 0-d tensor)
    seconds = timed(lambda: torch.add(bias, x, alpha=1.5, out=y), mesh, settings)
    bandwidth = 2 * x.numel() * x.element_size() / seconds
    del x, y
    one, res = torch.ones(1, device=device), torch.empty(1, device=device)
    overhead = timed(lambda: torch.add(one, one, out=res), mesh, settings)
    return {"gemm": gemm, "memory_bandwidth_Bps": bandwidth, "op_overhead_s": overhead,
            "block": _block(mesh, settings), "sync_skew_s": _sync_skew(mesh, settings)}


def _sync_skew(mesh: Any, settings: ProbeSettings) -> float:
    """What one all-reduce *between two pieces of compute* costs beyond the same all-reduce in a tight loop:
    ranks arrive at different times (on a host with fewer cores than ranks, a peer may not even be scheduled;
    a sleeping receiver has to be woken), and the early one waits. Training pays it at every blocking
    collective inside the step (tensor-parallel all-reduces, pipeline receives). The compute between two
    collectives is a few milliseconds and the message a layer's activation (64 Ki elements), as in a
    tensor-parallel block; waits are heavy-tailed, so blocks are longer and more than elsewhere. Seconds per
    collective, median over ranks."""
    group, device = mesh.group("world"), mesh.device
    a = torch.randn(256, 256, device=device)
    msg = torch.ones(64 * 1024, device=device)

    def work() -> None:
        for _ in range(16):
            torch.mm(a, a)

    def both() -> None:
        work()
        dist.all_reduce(msg, group=group)

    longer = replace(settings, block_s=max(settings.block_s, 0.25), blocks=max(settings.blocks, 5))
    alone = timed(lambda: dist.all_reduce(msg, group=group), mesh, longer)
    compute = timed(work, mesh, longer)
    return max(timed(both, mesh, longer) - compute - alone, 0.0)


def _block(mesh: Any, settings: ProbeSettings) -> dict[str, Any]:
    """A stack of reference transformer blocks (``shardwise.models.gpt.Block``) in training: forward, forward +
    backward, and forward + backward under activation checkpointing (``torch.utils.checkpoint``, non-reentrant,
    as ``sw.checkpoint_layers`` runs it), at a shape that keeps one call well under a second. Several blocks,
    not one, so that activations pile up across layers as they do in a model (on a CPU host fresh memory for
    kept activations costs page faults that a single block, recycling its buffers, never pays). The planner
    compares the per-block times with its own prediction of the block on the measured GEMMs and bandwidth:
    what kernels alone do not show (autograd, Python, allocation, kernels the cost model counts coarsely)
    becomes one forward and one backward factor, and what checkpointing adds over plain backward becomes the
    recomputation factor. Times in the file are per block."""
    from torch.utils.checkpoint import checkpoint

    from ..models.gpt import Block, GPTConfig

    h, heads, seq, batch = (1024, 16, 1024, 8) if mesh.device.type == "cuda" else (256, 4, 256, 4)
    depth = 4
    torch.manual_seed(0)
    blocks = [Block(GPTConfig(n_embd=h, n_head=heads, block_size=seq)).to(mesh.device) for _ in range(depth)]
    x = torch.randn(batch, seq, h, device=mesh.device, requires_grad=True)

    def forward(ckpt: bool) -> torch.Tensor:
        y = x
        for block in blocks:
            y = checkpoint(block, y, use_reentrant=False) if ckpt else block(y)
        return y

    fwd = timed(lambda: forward(False), mesh, settings) / depth
    both = timed(lambda: forward(False).sum().backward(), mesh, settings) / depth
    ckpt = timed(lambda: forward(True).sum().backward(), mesh, settings) / depth
    return {"n_embd": h, "n_head": heads, "seq": seq, "batch": batch, "depth": depth, "fwd_s": fwd,
            "bwd_s": max(both - fwd, 1e-9), "ckpt_s": ckpt, **_tiny_blocks(mesh, settings)}


def _tiny_blocks(mesh: Any, settings: ProbeSettings) -> dict[str, float]:
    """Forward + backward of one ``planner.overhead.TINY_BLOCK`` block (every rank at once): its arithmetic is
    microseconds, so it measures what a kernel launch costs in eager training, which the probe block above
    cannot tell apart from its arithmetic (the planner solves the per-launch overhead from it): ``tiny_s``.
    On a GPU also two such blocks in one pass, ``tiny2_s``: the difference is one block's launches without the
    pass's fixed costs, which a GPU's host pays once per micro-batch, not once per block."""
    from ..runtime.prediction import tiny_block_step

    out = {"tiny_s": timed(tiny_block_step(mesh.device), mesh, settings)}
    if mesh.device.type == "cuda":
        out["tiny2_s"] = timed(tiny_block_step(mesh.device, 2), mesh, settings)
        out["tiny_ac_s"] = timed(tiny_block_step(mesh.device, autocast=True), mesh, settings)
    return out
