"""What a device and its links can do, as plain data: peak FLOP/s, achievable GEMM efficiency, memory,
bandwidth and an alpha–beta model of every collective per link.

Two sources: named presets from public spec sheets (``Hardware.preset("a100-80g-sxm")``) and a calibration
of the user's own machine written by ``shardwise calibrate`` (``Hardware.load(path)``).

The time of one GEMM ``(m × k) @ (k × n)`` is a roofline with a size-dependent efficiency:
``max(2mnk / (peak · eff(d)), bytes / memory_bandwidth) + op_overhead`` with ``d = (m·n·k)^(1/3)`` and
``eff(d)`` interpolated in ``log d`` from ``gemm_curve``: small GEMMs do not fill the device's units (tiles,
waves, cores), large ones reach ``eff_max``.

Collectives follow the Hockney (alpha–beta) model in the nccl-tests "bus bandwidth" convention: a ring
all-reduce of ``S`` bytes over ``n`` ranks moves ``2(n-1)/n · S`` bytes through each rank's link and pays
``2(n-1)`` latencies; all-gather and reduce-scatter half of that. A group that spans nodes is limited by the
slower of the intra-node fabric and its members' share of the inter-node NICs (see ``group_bus_bandwidth``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from ..comm.calibration import Calibration
from .calibrated import hardware_fields
from .kernels import ATTENTION_TABLES
from .link import Link

__all__ = ["Link", "Hardware", "PRESETS"]

_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class Hardware:
    """A device type and its interconnect. Every field is per device unless it says otherwise."""

    name: str
    peak_flops: Mapping[str, float]
    """Dense peak FLOP/s per compute precision (``fp32``, ``bf16``)."""
    memory_bytes: float
    """Device memory usable by one rank."""
    memory_bandwidth_Bps: float
    """Achievable bandwidth of memory-bound (elementwise) kernels."""
    devices_per_node: int
    intra: Link
    """Within a node (NVLink/NVSwitch; shared memory on a CPU host)."""
    inter: Link
    """Across nodes, per device (its NIC share)."""
    gemm_curve: tuple[tuple[float, float], ...] = ((256.0, 0.35), (1024.0, 0.65), (4096.0, 0.80))
    """``(d, efficiency)`` points, ``d`` = cube root of m·n·k; efficiency of the dense peak."""
    op_overhead_s: float = 5e-6
    """Fixed cost of launching one kernel (dispatch, launch latency)."""
    kind: str = "gpu"
    """``gpu``: kernels run on a device of their own, queued by the host; ``cpu``: CPU ranks, whose host runs
    them (see ``host_launch_s``)."""
    host_launch_s: float = 0.0
    """A device that runs kernels on its own (a GPU): the host's time to issue one kernel in eager training
    (Python, the module call, autograd, dispatch). The host queues ahead while the device works, so a kernel
    costs ``max(device time + op_overhead_s, host_launch_s)``: small kernels are host-bound, large ones hide
    it. 0: not modelled (CPU ranks, whose host *is* the device and pays ``op_overhead_s`` per kernel; the GPU
    presets, which describe a framework that keeps the GPU fed). Set from a timed tiny block by the
    calibration and the quick probe (``overhead.py``)."""
    autocast_launch_factor: float = 1.0
    """``host_launch_s`` under ``torch.autocast`` (plan precision ``bf16``) over fp32: autocast dispatches
    every op through its cast policy and adds the casts' own launches. Timed on the tiny block both ways by a
    GPU calibration and the quick probe; 1: not measured."""
    p2p_alpha_s: float = 2e-5
    """Latency of one point-to-point send/recv pair between pipeline stages."""
    collectives: Mapping[int, Calibration] = field(default_factory=dict)
    """Measured alpha–beta models by group size (calibrated machines only); preferred over ``intra``."""
    source: str = ""
    """Where the numbers come from."""
    host_cores: int = 0
    """CPU ranks share a host: its core count (0: every device is its own, as GPUs are)."""
    calibrated_ranks: int = 0
    """Ranks that ran the probe at once (a shared host's per-rank speed depends on how many share it)."""
    gemm_points: tuple[tuple[float, float, float, float], ...] = ()
    """Measured ``(m, n, k, efficiency)`` (calibrated machines): preferred over ``gemm_curve`` (see
    ``gemm_efficiency``)."""
    gemm_points_bf16: tuple[tuple[float, float, float, float], ...] = ()
    """The same for bfloat16 GEMMs, as efficiency of the bf16 peak (calibrated machines whose probe timed
    them). A GPU's tensor cores fill only at a few thousand per side, while its fp32 units are near their peak
    much earlier, so a bf16 GEMM is priced on bf16's own points; empty: ``gemm_points`` serve both."""
    block_probe: Mapping[str, float] = field(default_factory=dict)
    """The measured transformer block (calibrated machines), times per block: ``n_embd``, ``n_head``, ``seq``,
    ``batch``, ``fwd_s``, ``bwd_s`` and (newer files) ``ckpt_s`` and ``depth`` (blocks in the timed stack); ``predict`` turns it into ``fwd_factor`` /
    ``bwd_factor`` / ``recompute_factor``."""
    sync_skew_s: float = 0.0
    """Extra wait of one blocking collective between pieces of compute (ranks arrive apart; measured on shared
    hosts by the calibration, 0 for the presets)."""
    fwd_factor: float = 1.0
    """Measured over predicted forward of the probe block (1: no probe)."""
    bwd_factor: float = 1.0
    """Measured over predicted backward of the probe block (1: no probe)."""
    recompute_factor: float = 1.0
    """What full activation checkpointing adds to a block's backward, in forwards of the block: measured by the
    probe as (checkpointed forward + backward − forward − backward) / forward (1: no probe, a recomputed
    forward costs one forward)."""
    sustained_fraction: float = 1.0
    """The share of its kernels' published throughput (``gemm_curve``, the attention tables) the device sustains
    through a long training run — clocks under the power limit, kernels around the GEMMs that the model does not
    list. The one constant fitted to published tables (leave-one-table-out, ``docs/planner.md``); 1 on calibrated
    machines, whose GEMMs and block were measured in place."""

    attention_table: str = ""
    """The published throughput of the fused attention kernel this device runs (a name in
    ``kernels.ATTENTION_TABLES``, by head dimension, sequence, mask and direction); ``""``: priced at the GEMM
    efficiency of its per-head products (calibrated machines, CPU ranks, presets without a published table)."""

    def __post_init__(self) -> None:
        missing = [d for d in _DTYPES if d not in self.peak_flops]
        if missing or any(not v > 0 for v in self.peak_flops.values()):
            raise ValueError(f"Hardware {self.name!r} needs a positive peak_flops for {list(_DTYPES)}, got "
                             f"{dict(self.peak_flops)}")
        if not (self.memory_bytes > 0 and self.memory_bandwidth_Bps > 0 and self.devices_per_node >= 1):
            raise ValueError(f"Hardware {self.name!r} needs memory_bytes > 0, memory_bandwidth_Bps > 0 and "
                             f"devices_per_node >= 1, got {self.memory_bytes!r}, {self.memory_bandwidth_Bps!r} and "
                             f"{self.devices_per_node!r}; fix the preset or regenerate the calibration with "
                             f"`shardwise calibrate --out FILE`")
        if not 0 < self.sustained_fraction <= 1:
            raise ValueError(f"Hardware {self.name!r}: sustained_fraction must be in (0, 1], got {self.sustained_fraction!r}")
        if self.attention_table and self.attention_table not in ATTENTION_TABLES:
            raise ValueError(f"Hardware {self.name!r}: unknown attention_table {self.attention_table!r}; choose one "
                             f"of {sorted(ATTENTION_TABLES)} or \"\" (the per-head-GEMM proxy)")
        if not self.gemm_curve or any(not (d > 0 and 0 < e <= 1) for d, e in self.gemm_curve):
            raise ValueError(f"Hardware {self.name!r}: gemm_curve needs (d > 0, 0 < efficiency <= 1) points, "
                             f"got {self.gemm_curve}")

    # -- construction ------------------------------------------------------------------------------------
    @staticmethod
    def preset(name: str, *, devices_per_node: int | None = None) -> "Hardware":
        """A named preset (``a100-80g-sxm``, ``h100-80g-sxm``, ``h200-141g-sxm``; any case); ``ValueError`` listing
        them otherwise, with the presets the name is part of or close to (``h100`` → ``h100-80g-sxm``)."""
        key = _preset_key(name)
        if key is None:
            import difflib

            lower = name.strip().lower()
            close = [k for k in sorted(PRESETS) if lower and lower in k] or difflib.get_close_matches(
                lower, list(PRESETS), n=1)
            hint = f" (did you mean {' or '.join(repr(k) for k in close)}?)" if close else ""
            raise ValueError(f"unknown hardware {name!r}{hint}; choose one of {sorted(PRESETS)}, or pass a "
                             f"calibration file written by `shardwise calibrate --out FILE`")
        hw = PRESETS[key]
        return hw if devices_per_node is None else replace(hw, devices_per_node=devices_per_node)

    @staticmethod
    def resolve(name_or_path: str, *, devices_per_node: int | None = None) -> "Hardware":
        """A preset name (any case), or else the path of a calibration file."""
        if _preset_key(name_or_path) is not None or not (name_or_path.endswith(".json")
                                                          or Path(name_or_path).exists()):
            return Hardware.preset(name_or_path, devices_per_node=devices_per_node)
        hw = Hardware.load(name_or_path)
        return hw if devices_per_node is None else replace(hw, devices_per_node=devices_per_node)

    @staticmethod
    def load(path: str | Path) -> "Hardware":
        """Read a calibration written by ``shardwise calibrate --out FILE``."""
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"hardware file {str(path)!r} does not exist; create it with "
                             f"`shardwise calibrate --out {path}` or use a preset: {sorted(PRESETS)}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"hardware file {str(path)!r} is not valid JSON ({exc}); regenerate it with "
                             f"`shardwise calibrate --out {path}`") from None
        return Hardware(**hardware_fields(data, str(path)))

    def for_devices(self, n: int) -> "Hardware":
        """This hardware as each of ``n`` ranks sees it. Devices of their own: unchanged. Ranks sharing a host's
        ``host_cores``: each gets ``min(1, cores / n)`` of a core, so the probe's per-rank speed (measured with
        ``calibrated_ranks`` busy) is rescaled by ``share(n) / share(calibrated_ranks)``."""
        if not (self.host_cores and self.calibrated_ranks) or n < 1:
            return self
        share = lambda k: min(1.0, self.host_cores / k)  # noqa: E731
        f = share(min(n, self.devices_per_node)) / share(self.calibrated_ranks)
        if f == 1.0:
            return self
        return replace(self, peak_flops={k: v * f for k, v in self.peak_flops.items()},
                       memory_bandwidth_Bps=self.memory_bandwidth_Bps * f, op_overhead_s=self.op_overhead_s / f,
                       calibrated_ranks=min(n, self.devices_per_node))

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["collectives"] = {str(k): v.to_json() for k, v in self.collectives.items()}
        return out

    # -- costs -------------------------------------------------------------------------------------------
    def gemm_efficiency(self, m: float, n: float, k: float, dtype: str = "fp32") -> float:
        """Fraction of the dense peak a GEMM of this shape reaches: from the measured shapes nearest in
        ``(log m, log n, log k)`` (inverse-distance weights) on a calibrated machine, else interpolated in
        log size on ``gemm_curve``."""
        if dtype == "bf16" and self.gemm_points_bf16:
            return _nearest_efficiency(self.gemm_points_bf16, m, n, k)
        if self.gemm_points:
            return _nearest_efficiency(self.gemm_points, m, n, k)
        return self.sustained_fraction * self._curve_efficiency(m, n, k)

    def _curve_efficiency(self, m: float, n: float, k: float) -> float:
        d = max(m * n * k, 1.0) ** (1.0 / 3.0)
        pts = sorted(self.gemm_curve)
        if d <= pts[0][0]:
            return pts[0][1] * d / pts[0][0]  # below the table: proportionally less
        for (d0, e0), (d1, e1) in zip(pts, pts[1:]):
            if d <= d1:
                w = math.log(d / d0) / math.log(d1 / d0)
                return e0 + w * (e1 - e0)
        return pts[-1][1]

    def gemm_time(self, m: float, n: float, k: float, *, dtype: str, batch: float = 1.0,
                  elem_bytes: int = 2) -> float:
        """Seconds for ``batch`` GEMMs of ``(m × k) @ (k × n)``: roofline plus one launch."""
        if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
            return 0.0
        flops = 2.0 * m * n * k * batch
        compute = flops / (self.peak_flops[dtype] * self.gemm_efficiency(m, n, k, dtype))
        traffic = elem_bytes * (m * k + k * n + m * n) * batch / self.memory_bandwidth_Bps
        return self._launched(max(compute, traffic), 1.0)

    def kernel_time(self, compute_s: float, nbytes: float, launches: float) -> float:
        """Seconds for ``launches`` fused kernels doing ``compute_s`` of arithmetic while moving ``nbytes``
        (roofline: the longer of the two)."""
        return self._launched(max(compute_s, nbytes / self.memory_bandwidth_Bps), launches)

    def memory_time(self, nbytes: float, ops: float = 0.0) -> float:
        """Seconds for memory-bound kernels moving ``nbytes`` in ``ops`` launches."""
        return self._launched(nbytes / self.memory_bandwidth_Bps, ops)

    def _launched(self, device_s: float, launches: float) -> float:
        """``device_s`` of work issued in ``launches`` launches (see ``host_launch_s``)."""
        return max(device_s + launches * self.op_overhead_s, launches * self.host_launch_s)

    def group_bus_bandwidth(self, size: int, per_node: int) -> tuple[float, float]:
        """``(bus bandwidth per device, per-step latency)`` of a group of ``size`` ranks with ``per_node`` of
        them on each node. Within one node: the intra link. Across nodes the ring's node-crossing traffic is
        spread over the NICs of the group's members on a node, so the group gets ``per_node ×`` one device's
        NIC share, never more than the intra fabric (NCCL puts one ring channel through each NIC)."""
        if size <= per_node or per_node >= size:
            return self.intra.bus_bandwidth_Bps, self.intra.alpha_s
        bw = min(self.intra.bus_bandwidth_Bps, per_node * self.inter.bus_bandwidth_Bps)
        return bw, max(self.intra.alpha_s, self.inter.alpha_s)

    def collective_time(self, op: str, nbytes: float, size: int, *, per_node: int | None = None,
                        algorithm: str = "auto") -> float:
        """Seconds of one ``op`` (all_reduce, all_gather, reduce_scatter, broadcast) on a full buffer of
        ``nbytes`` over ``size`` ranks, ``per_node`` of them per node (default: packed). On a calibrated machine
        ``algorithm`` is the implementation the caller runs: ``native`` (the backend's own, what tensor
        parallelism, ZeRO and the pipeline call) or ``auto`` (the calibration's fastest at this size, what
        data parallelism's ``algorithm = "auto"`` picks); the analytic model has no such choice."""
        if size <= 1 or nbytes <= 0:
            return 0.0
        per_node = min(size, self.devices_per_node) if per_node is None else per_node
        measured = self._measured(op, nbytes, size, per_node, algorithm)
        if measured is not None:
            return measured
        bw, alpha = self.group_bus_bandwidth(size, per_node)
        factor = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "broadcast": 1.0}[op]
        steps = factor * (size - 1)
        return factor * (size - 1) / size * nbytes / bw + steps * alpha

    def p2p_time(self, nbytes: float, *, cross_node: bool) -> float:
        """Seconds to send ``nbytes`` to one peer (pipeline stage boundary)."""
        if nbytes <= 0:
            return 0.0
        link = self.inter if cross_node else self.intra
        return self.p2p_alpha_s + nbytes / link.bus_bandwidth_Bps

    def _measured(self, op: str, nbytes: float, size: int, per_node: int, algorithm: str = "auto") -> float | None:
        if not self.collectives or per_node < size:
            return None
        cal = self.collectives.get(size)
        if cal is None or op not in cal.models:
            return None
        if algorithm not in cal.models[op]:
            algorithm = cal.best_algorithm(op, nbytes)
        return cal.predict_us(op, algorithm, nbytes) * 1e-6


def _nearest_efficiency(points: tuple[tuple[float, float, float, float], ...], m: float, n: float,
                        k: float) -> float:
    """Inverse-distance-weighted efficiency of the three measured shapes nearest to ``(m, n, k)`` in log space
    (a skinny GEMM is compared with skinny probes, not with squares of the same FLOPs)."""
    target = (math.log(max(m, 1.0)), math.log(max(n, 1.0)), math.log(max(k, 1.0)))
    ranked = sorted((math.dist(target, (math.log(a), math.log(b), math.log(c))), e) for a, b, c, e in points)[:3]
    if ranked[0][0] < 1e-9:
        return ranked[0][1]
    weights = [1.0 / d for d, _ in ranked]
    return sum(w * e for w, (_, e) in zip(weights, ranked)) / sum(weights)


def _preset_key(name: str) -> str | None:
    """The ``PRESETS`` key ``name`` spells, in any case and without surrounding blanks; None if none."""
    if name in PRESETS:
        return name
    return next((k for k in PRESETS if k.lower() == name.strip().lower()), None)


# Spec-sheet numbers. A100: NVIDIA A100 Tensor Core GPU datasheet (80GB SXM: 312 TF/s dense BF16/FP16,
# 19.5 TF/s FP32, 2,039 GB/s HBM2e, NVLink 600 GB/s); Selene (Narayanan et al. 2021, §5): 8 GPUs per node,
# 8 × 200 Gb/s HDR InfiniBand per node (25 GB/s per GPU). H100: NVIDIA H100 Tensor Core GPU datasheet (SXM:
# 989 TF/s dense BF16, 67 TF/s FP32, 3.35 TB/s HBM3, NVLink 900 GB/s), DGX H100: 8 × 400 Gb/s NDR per node
# (50 GB/s per GPU). Achieved all-reduce bus bandwidth within a node: A100 ≈ 230 GB/s, H100 ≈ 370 GB/s
# (nccl-tests issues #149, #212, maintainers' figures). Inter-node: 90 % of the NIC line rate. Memory
# bandwidth: 85 % of the HBM peak, a typical STREAM-like figure for large elementwise kernels.
# The A100's GEMM curve was set from typical cuBLAS bf16 results on an A100 (``docs/planner.md``). The H100's is
# measured: XLA's cuBLAS bf16 GEMM table for sm_90 (openxla/xla, xla/service/gpu/model/matmul_interpolator_data.h,
# "NVIDIA H100"), the shapes with m, n >= 1024 and k >= 2048: 1024x1024x2048 350 TF/s, 1024x2048x2048 524,
# 2048^3 632, 4096^3 783 (of 989). Hopper's larger tiles leave more of its 132 SMs idle on a mid-sized GEMM, so it
# fills later than the A100 (0.64 against 0.74 at 2048^3). The H200 is the H100's chip.
_GEMM_CURVE = ((128.0, 0.20), (512.0, 0.55), (1024.0, 0.68), (2048.0, 0.74), (8192.0, 0.78))
_GEMM_CURVE_H100 = ((1290.0, 0.354), (1625.0, 0.530), (2048.0, 0.639), (4096.0, 0.792))
# Fused attention on Hopper: cuDNN's published throughput (FlashAttention-3 paper, Figs. 5-6; ``kernels.py``), the
# kernel Transformer Engine's FusedAttention runs, as Megatron-Core does; the A100 keeps the per-head-GEMM proxy.

PRESETS: dict[str, Hardware] = {
    "a100-80g-sxm": Hardware(
        name="a100-80g-sxm", peak_flops={"fp32": 19.5e12, "bf16": 312e12}, memory_bytes=80e9,
        memory_bandwidth_Bps=0.85 * 2.039e12, devices_per_node=8,
        intra=Link(alpha_s=2e-6, bus_bandwidth_Bps=230e9), inter=Link(alpha_s=5e-6, bus_bandwidth_Bps=22.5e9),
        gemm_curve=_GEMM_CURVE, op_overhead_s=4e-6, p2p_alpha_s=2e-5, sustained_fraction=0.92,
        source="NVIDIA A100 80GB SXM datasheet; Selene interconnect (Narayanan et al. 2021 §5); nccl-tests"),
    "h100-80g-sxm": Hardware(
        name="h100-80g-sxm", peak_flops={"fp32": 67e12, "bf16": 989e12}, memory_bytes=80e9,
        memory_bandwidth_Bps=0.85 * 3.35e12, devices_per_node=8,
        intra=Link(alpha_s=2e-6, bus_bandwidth_Bps=370e9), inter=Link(alpha_s=5e-6, bus_bandwidth_Bps=45e9),
        gemm_curve=_GEMM_CURVE_H100, op_overhead_s=4e-6, p2p_alpha_s=2e-5, attention_table="h100-cudnn",
        sustained_fraction=0.92, source="NVIDIA H100 SXM datasheet; DGX H100 8x NDR 400 Gb/s; nccl-tests; XLA sm_90 GEMM table; "
               "FlashAttention-3 Figs. 5-6 (cuDNN)"),
}
# H200 SXM: the H100's chip with 141 GB of HBM3e at 4.8 TB/s (NVIDIA H200 datasheet; the same dense BF16/FP32 rates
# and NVLink 900 GB/s); HGX H200 nodes carry the DGX H100's 8 x NDR 400 Gb/s, so every other number is the H100's.
PRESETS["h200-141g-sxm"] = replace(
    PRESETS["h100-80g-sxm"], name="h200-141g-sxm", memory_bytes=141e9, memory_bandwidth_Bps=0.85 * 4.8e12,
    source="NVIDIA H200 SXM datasheet; HGX H200 8x NDR 400 Gb/s; nccl-tests (H100 figures, same NVLink); the H100's "
           "chip: XLA sm_90 GEMM table, FlashAttention-3 Figs. 5-6 (cuDNN)")
