"""``shardwise bench cp``: context parallelism (ring attention) at a long sequence — activation memory per rank,
step time and how much of the ring's communication the block compute hides, against one rank and the planner.

    shardwise bench cp -n 4 --seq 8192 --hardware CALIBRATION.json

Every rank builds the same small Llama (``shardwise.models.Llama``: ``--layers`` decoder layers of width
``--embd``, ``--heads`` query and ``--kv-heads`` key/value heads) and one synthetic sequence of ``--seq`` tokens.
For each ``cp`` of ``--cp`` (which must divide ``-n``) the first ``cp`` ranks run it — cp = 1 plain
``scaled_dot_product_attention`` on one rank, cp > 1 ``sw.context_parallel`` over a ring of ``cp`` ranks, each
holding its ``S/cp`` tokens (``sw.shard_sequence``) — while the other ranks wait. One step is the forward and
backward of the sequence (cross-entropy over the rank's tokens), no optimizer.

Memory: one forward under ``SavedTensorPeak`` — the bytes autograd saves for backward (each storage once,
parameters left out), in all and per decoder layer (the increase across each layer's forward); the maximum over
the ring's ranks. The planner's activation memory for the same shape (``predict(...).memory.activations``, one
micro-batch, fp32) stands beside it.

Time: ``--repeats`` rounds, each running every cp in turn (``--steps`` timed steps each), so machine load hits
them alike; ``step ms`` is the median step (maximum over the ring's ranks), ``speed-up`` the median over rounds
of one rank's step over this cp's step in the same round. Every rank has the same intra-op threads (``--threads``;
0: ``cores / -n``, at least one), so cp = 1 is one such rank and a speed-up counts what the added ranks bring
(ranks beyond the cores share them).

Communication (``ring_timing``): ``ring ms`` is the time a rank spends inside the ring's passes per step
(forward and backward, all layers, compute and communication), ``exposed ms`` the part of it blocked waiting
for a K/V block or a dK/dV accumulator (the maximum over the ring's ranks; ``min``: the rank that waited least,
the slowest one, whose wait is the least inflated by waiting for a late neighbour). ``alone ms`` is what the
same hops take with nothing to overlap: each transfer's size (K/V block; K/V plus the fp32 accumulator; the
accumulator alone) timed as a bare send/receive around the ring, times the hops a step makes. ``hidden`` =
max(0, 1 − min / alone): blocked time beyond the bare hops is a neighbour arriving late (ranks whose compute
drifts apart, e.g. ranks sharing cores), not transfer. ``planner ms`` is the planner's ``cp_comm``
(its exposed ring time) for the same shape on ``--hardware`` (a ``shardwise calibrate`` file of this machine;
without it the time columns from the planner are left out). ``kv bytes/hop`` is a K/V block as the ring sends
it (grouped-query attention: ``hkv`` heads). The line under the table: one bare K/V hop, and what of it still
blocks when twice its time of matrix products runs between posting and waiting — whether the transport itself
progresses under compute. Rank 0 prints the table and writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .harness import add_launch_arguments, paired_ratio, run_bench

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_arguments(parser, nproc=4, what="local ranks (the largest cp)")
    parser.add_argument("--cp", default="1,2,4", help="comma list of ring sizes, each dividing -n (default 1,2,4)")
    parser.add_argument("--seq", type=int, default=8192, help="tokens in the sequence (default 8192)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--embd", type=int, default=256, help="hidden width (default 256)")
    parser.add_argument("--heads", type=int, default=4, help="query heads (default 4)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary (default 512)")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per cp per round (default 1)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per cp first (default 1)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / -n)")
    parser.add_argument("--hardware", default=None, help="calibration file of this machine for the planner's times")
    parser.add_argument("--json", default=None, help="write the results here (rank 0)")


def _cps(args: argparse.Namespace) -> list[int]:
    try:
        cps = [int(c) for c in str(args.cp).split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--cp takes a comma list of ints, got {args.cp!r}; e.g. --cp 1,2,4") from None
    if not cps or any(c < 1 or args.nproc % c for c in cps):
        raise ValueError(f"--cp {args.cp}: every ring size must be >= 1 and divide -n {args.nproc}")
    for c in cps:
        if args.seq % (2 * c):
            raise ValueError(f"--seq {args.seq} must be divisible by 2·cp = {2 * c} (two chunks per rank)")
    return cps


def _validate(args: argparse.Namespace) -> list[int]:
    for flag in ("seq", "layers", "embd", "heads", "kv_heads", "vocab", "steps", "repeats"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.embd % args.heads or args.heads % args.kv_heads:
        raise ValueError(f"--heads {args.heads} must divide --embd {args.embd} and --kv-heads {args.kv_heads} "
                         f"must divide --heads")
    if args.hardware and not os.path.exists(args.hardware):
        raise ValueError(f"--hardware {args.hardware}: no such file (write one with shardwise calibrate)")
    return _cps(args)


def main(args: argparse.Namespace) -> int:
    """Validate, then launch ``-n`` local ranks (or, with ``--worker``, be one rank of a torchrun job)."""
    return run_bench("cp", args, validate=_validate, worker=_run_worker)


# -- inside a rank ----------------------------------------------------------------------------------
def _config(args: argparse.Namespace) -> Any:
    from ..models.hf_config import HFDecoderConfig

    ffn = 256 * -(-int(8 * args.embd / 3) // 256)
    return HFDecoderConfig(model_type="llama", vocab_size=args.vocab, hidden_size=args.embd, intermediate_size=ffn,
                           num_hidden_layers=args.layers, num_attention_heads=args.heads,
                           num_key_value_heads=args.kv_heads, head_dim=args.embd // args.heads, rms_norm_eps=1e-5,
                           rope_theta=10000.0, max_position_embeddings=args.seq)


class _Run:
    """One cp's model, batch and mesh on this rank (``active``: this rank is one of the ring's)."""

    def __init__(self, cp: int, args: argparse.Namespace, world: int) -> None:
        import shardwise as sw
        from ..models.llama import Llama

        self.cp = cp
        self.mesh = sw.Mesh(dp=world // cp, cp=cp)
        self.active = self.mesh.coord("dp") == 0
        torch.manual_seed(0)
        self.model = Llama(_config(args), args.seq)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, args.vocab, (1, args.seq + 1), generator=gen)
        x, y = ids[:, :-1], ids[:, 1:]
        if cp > 1:
            sw.context_parallel(self.model, self.mesh, "cp")
            x, y = sw.shard_sequence(x, self.mesh, "cp"), sw.shard_sequence(y, self.mesh, "cp")
        self.x, self.y = x, y

    def step(self) -> None:
        logits = self.model(self.x)
        F.cross_entropy(logits.float().flatten(0, 1), self.y.flatten()).backward()
        self.model.zero_grad(set_to_none=True)

    def saved_bytes(self) -> tuple[int, list[int]]:
        """(peak bytes autograd saves in one forward, the increase across each decoder layer's forward)."""
        from ..parallel.common.saved_memory import SavedTensorPeak

        layers: list[int] = []
        with SavedTensorPeak() as tracker:
            def before(module: nn.Module, args: Any) -> None:
                module._bench_cp_live = tracker.live

            def after(module: nn.Module, args: Any, out: Any) -> None:
                layers.append(tracker.live - module._bench_cp_live)
            hooks = [h for layer in self.model.model.layers
                     for h in (layer.register_forward_pre_hook(before), layer.register_forward_hook(after))]
            try:
                logits = self.model(self.x)
                loss = F.cross_entropy(logits.float().flatten(0, 1), self.y.flatten())
                peak = tracker.peak
            finally:
                for h in hooks:
                    h.remove()
        loss.backward()
        self.model.zero_grad(set_to_none=True)
        return peak, layers


def _probe_hop(run: _Run, nbytes: int, repeats: int = 5, compute_s: float = 0.0) -> float:
    """Median seconds of one bare ring hop of ``nbytes`` (send to the next rank, receive from the previous);
    with ``compute_s``, the seconds still blocked in ``wait()`` after ``compute_s`` of matrix products run
    between posting the hop and waiting for it (0: the transport hid the hop under that compute)."""
    import shardwise as sw
    from ..parallel.context.ring import _Ring

    ring = _Ring(run.mesh, "cp", run.cp, run.mesh.coord("cp"))
    send = torch.zeros(nbytes // 4)
    recv = torch.empty_like(send)
    a = torch.randn(256, 256)
    times = []
    for _ in range(repeats + 1):
        sw.comm.barrier(run.mesh, "cp")
        t = time.perf_counter()
        handles = ring.shift(send, recv, 7399)
        while time.perf_counter() - t < compute_s:
            a @ a
        w = time.perf_counter()
        for h in handles:
            h.wait()
        times.append(time.perf_counter() - (w if compute_s else t))
    return statistics.median(times[1:])


def _threads(args: argparse.Namespace) -> int:
    return args.threads or max(1, (os.cpu_count() or 1) // args.nproc)


def _run_worker(args: argparse.Namespace) -> int:
    import shardwise as sw
    from ..parallel.context.ring import RingTiming, ring_timing

    world = sw.init()
    n = world.world_size
    cps = _validate(args)
    everyone = sw.Mesh(dp=n)
    torch.set_num_threads(_threads(args))
    runs = {cp: _Run(cp, args, n) for cp in cps}

    def each(cp: int, fn: Any) -> Any:
        """``fn()`` on the ring's ranks of ``cp`` (the others wait at the barrier after it)."""
        run = runs[cp]
        sw.comm.barrier(everyone, "dp")
        out = None
        if run.active:
            out = fn(run)
        sw.comm.barrier(everyone, "dp")
        return out

    memory = {cp: each(cp, lambda r: r.saved_bytes()) for cp in cps}
    for cp in cps:
        each(cp, lambda r: [r.step() for _ in range(args.warmup)])
    times: dict[int, list[list[float]]] = {cp: [] for cp in cps}
    timing = {cp: RingTiming() for cp in cps}

    def timed(r: _Run) -> list[float]:
        out = []
        with ring_timing(timing[r.cp]):
            for _ in range(args.steps):
                t = time.perf_counter()
                r.step()
                out.append(time.perf_counter() - t)
        return out
    for _ in range(args.repeats):
        for cp in cps:
            times[cp].append(each(cp, timed) or [0.0] * args.steps)
    # bare hops of the three transfer sizes a step makes (K/V; K/V + fp32 dK/dV; dK/dV alone)
    hd = args.embd // args.heads
    probes: dict[int, dict[str, float]] = {}
    for cp in cps:
        if cp == 1:
            continue
        kv = 2 * (args.seq // cp) * args.kv_heads * hd * 4
        def probe(r: _Run) -> dict[str, float]:
            out = {"kv": _probe_hop(r, kv), "both": _probe_hop(r, 2 * kv), "grad": _probe_hop(r, kv)}
            out["under_compute"] = _probe_hop(r, kv, compute_s=2 * out["kv"])
            return out
        probes[cp] = each(cp, probe) or {}
    rows = _gather_rows(cps, runs, memory, times, timing, probes, args, everyone)
    if everyone.rank == 0:
        _report(rows, args, n)
    sw.shutdown()
    return 0


def _gather_rows(cps: list[int], runs: dict[int, _Run], memory: dict, times: dict, timing: dict, probes: dict,
                 args: argparse.Namespace, everyone: Any) -> list[dict[str, Any]]:
    import shardwise as sw

    def reduced(values: list[float], op: str = "max") -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        return sw.comm.all_reduce(t, everyone, "dp", op=op).tolist()  # type: ignore[union-attr]

    base = times.get(1)
    rows = []
    for cp in cps:
        run, steps = runs[cp], args.repeats * args.steps
        peak, layers = memory[cp] if run.active else (0, [0] * args.layers)
        med = statistics.median(t for r in times[cp] for t in r) if run.active else 0.0
        # rank 0 is in every ring: its rounds pair each cp's step with one rank's step of the same round
        ratio = 1.0 / paired_ratio(times[cp], base) if everyone.rank == 0 and base is not None else 0.0
        rt = timing[cp]
        p = probes.get(cp, {}) if run.active else {}
        # hops per step: forward cp−1 K/V; backward cp−1 (K/V + dK/dV together) and the last dK/dV alone
        alone = args.layers * ((cp - 1) * (p.get("kv", 0.0) + p.get("both", 0.0)) + p.get("grad", 0.0))
        vals = reduced([peak, *layers, med, ratio, rt.pass_s / steps, rt.wait_s / steps, alone,
                        rt.sent["kv"] / max(1, rt.hops["kv"]), p.get("kv", 0.0), p.get("under_compute", 0.0)])
        # the rank that waited least: the slowest of the ring, whose blocked time is the least skewed by waiting for
        # a late neighbour
        least = reduced([rt.wait_s / steps if run.active else float("inf")], "min")[0]
        k = 1 + args.layers
        rows.append({"cp": cp, "ranks": cp, "saved_bytes": vals[0], "saved_per_layer_bytes": vals[1:k],
                     "step_s": vals[k], "speedup": vals[k + 1] or None, "ring_s": vals[k + 2],
                     "exposed_s": vals[k + 3], "exposed_min_s": least if cp > 1 else 0.0, "alone_s": vals[k + 4],
                     "hidden": max(0.0, 1 - least / vals[k + 4]) if vals[k + 4] > 0 else None,
                     "kv_bytes_per_hop": vals[k + 5], "hop_s": vals[k + 6], "hop_under_compute_s": vals[k + 7]})
    _predict(rows, args)
    return rows


def _predict(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Add the planner's activation memory and (with ``--hardware``) its compute and ``cp_comm`` per step."""
    from ..planner import Hardware, Layout, ModelSpec, PRESETS, predict

    spec = ModelSpec.llama(n_layer=args.layers, hidden=args.embd, heads=args.heads, kv_heads=args.kv_heads,
                           ffn=256 * -(-int(8 * args.embd / 3) // 256), vocab_size=args.vocab, seq_len=args.seq)
    hw = Hardware.load(args.hardware) if args.hardware else next(iter(PRESETS.values()))
    for r in rows:
        pred = predict(spec, Layout(cp=r["cp"]), hw, global_batch=1, seq_len=args.seq)
        r["predicted_activation_bytes"] = pred.memory.activations
        r["predicted_cp_comm_s"] = pred.breakdown.get("cp_comm", 0.0) if args.hardware else None
        r["predicted_compute_s"] = pred.breakdown["compute"] if args.hardware else None


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _report(rows: list[dict[str, Any]], args: argparse.Namespace, n: int) -> None:
    mib = 2**20
    print(f"\nshardwise bench cp: {n} ranks (cpu), Llama {args.layers} layers, width {args.embd}, {args.heads} "
          f"heads / {args.kv_heads} kv heads, seq {args.seq}, fp32, {args.repeats} rounds x {args.steps} timed "
          f"steps per cp, {platform.node()}")
    print(f"{'cp':>3}{'saved MiB':>11}{'/layer':>8}{'vs cp1':>8}{'planner':>9}{'step ms':>10}{'speed-up':>10}"
          f"{'ring ms':>9}{'exposed':>9}{'min':>8}{'alone':>8}{'hidden':>8}{'planner':>9}{'kv B/hop':>10}")
    first = rows[0]["saved_bytes"] or 1.0
    for r in rows:
        per_layer = statistics.mean(r["saved_per_layer_bytes"]) if r["saved_per_layer_bytes"] else 0.0
        hidden = "-" if r["hidden"] is None else f"{r['hidden']:.0%}"
        speed = "-" if not r["speedup"] else f"{r['speedup']:.2f}"
        ring = r["cp"] > 1
        print(f"{r['cp']:>3}{r['saved_bytes'] / mib:>11.1f}{per_layer / mib:>8.1f}{r['saved_bytes'] / first:>8.2f}"
              f"{r['predicted_activation_bytes'] / mib:>9.1f}{r['step_s'] * 1e3:>10.1f}{speed:>10}"
              f"{_ms(r['ring_s']) if ring else '-':>9}{_ms(r['exposed_s']) if ring else '-':>9}"
              f"{_ms(r['exposed_min_s']) if ring else '-':>8}"
              f"{_ms(r['alone_s']) if ring else '-':>8}{hidden if ring else '-':>8}"
              f"{_ms(r['predicted_cp_comm_s']) if ring else '-':>9}"
              f"{int(r['kv_bytes_per_hop']) if ring else '-':>10}")
    print("saved MiB: bytes autograd keeps for backward after one forward, per rank (/layer: per decoder layer); "
          "planner: predicted activations. exposed: ms per step blocked on the ring (max over ranks; min: the rank "
          "that waited least); alone: the same hops with "
          "nothing to overlap; hidden = 1 - min/alone (at least 0); planner (right): its cp_comm (exposed) per step.")
    for r in rows:
        if r["cp"] > 1:
            print(f"cp {r['cp']}: one bare K/V hop {_ms(r['hop_s'])} ms; posted before {_ms(2 * r['hop_s'])} ms of "
                  f"compute, still blocked {_ms(r['hop_under_compute_s'])} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": n, "seq": args.seq, "layers": args.layers, "embd": args.embd, "heads": args.heads,
                       "kv_heads": args.kv_heads, "vocab": args.vocab, "repeats": args.repeats, "steps": args.steps,
                       "hardware": args.hardware, "device": "cpu", "host": platform.node(), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    from shardwise.world import exit_process

    _parser = argparse.ArgumentParser(prog="python -m shardwise.bench.cp",
                                      description="context parallelism memory and time (see `shardwise bench cp -h`)")
    add_arguments(_parser)
    exit_process(main(_parser.parse_args()))
