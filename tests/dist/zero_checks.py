"""Rank-side checks for ``sw.zero`` (run inside LocalWorld ranks by tests/dist/test_zero.py).

Every check builds the same model from a seed on every rank, trains it with ZeRO on this rank's slice of a
global batch, and compares with one process training the same weights on the whole batch (the reference
is plain PyTorch: ``torch.optim`` over ``model.parameters()``). Results are small dicts for the parent.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

import shardwise as sw
from shardwise.comm import CommCounter
from shardwise.models.gpt import GPT, GPTConfig, lm_loss
from shardwise.parallel.common.mixed_precision import MixedPrecision
from tests.dist.meshes import mesh

GLOBAL_B, STEPS, SEQ = 12, 5, 6
# No biases: attention key biases get mathematically zero gradients, and Adam turns their float noise
# into full steps; every remaining parameter has a real gradient.
TINY = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=12, bias=False)
SMALL_BUCKETS = dict(bucket_cap_mb=900 / 2**20, first_bucket_mb=300 / 2**20)
OPTS = {"sgd": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        "adamw": functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-5, weight_decay=0.1)}


class Uneven(nn.Module):
    """Odd sizes everywhere (no parameter or total divisible by 2, 3 or 4) and one parameter tied twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(5, 7), nn.Linear(7, 7), nn.Linear(7, 5)
        self.d = nn.Linear(7, 5)
        self.d.weight = self.c.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.c(h) + 0.5 * self.d(h)


def build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind in ("gpt", "gpt-ckpt"):
        model = GPT(TINY)
        return sw.checkpoint_layers(model) if kind == "gpt-ckpt" else model
    return Uneven()


def batch(kind: str, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    if kind.startswith("gpt"):
        x = torch.randint(0, TINY.vocab_size, (GLOBAL_B, SEQ + 1), generator=g)
        return x[:, :-1], x[:, 1:]
    return torch.randn(GLOBAL_B, 5, generator=g), torch.randn(GLOBAL_B, 5, generator=g)


def loss_of(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return lm_loss(out.float(), y) if kind.startswith("gpt") else ((out.float() - y) ** 2).mean()


def _local(t: torch.Tensor, m: sw.Mesh) -> torch.Tensor:
    n, i = m.size("dp"), m.coord("dp")
    per = t.shape[0] // n
    return t[i * per:(i + 1) * per]


_REFERENCES: dict[tuple, tuple[dict[str, torch.Tensor], list[float]]] = {}


def cached_reference(kind: str, opt: str, steps: int, *, clip: float | None = None,
                     micro: int = 1) -> tuple[nn.Module, list[float]]:
    """``reference`` computed once per rank process per configuration (every stage compares with it)."""
    key = (kind, opt, steps, clip, micro)
    if key not in _REFERENCES:
        model, norms = reference(kind, opt, steps, clip=clip, micro=micro)
        _REFERENCES[key] = ({k: v.clone() for k, v in model.state_dict().items()}, norms)
    state, norms = _REFERENCES[key]
    model = build(kind)
    model.load_state_dict(state)
    return model, norms


def reference(kind: str, opt: str, steps: int, *, clip: float | None = None, micro: int = 1) -> tuple[nn.Module, list[float]]:
    """One process, whole batch, plain torch."""
    model = build(kind)
    optim = OPTS[opt](model.parameters())
    norms = []
    for s in range(steps):
        for u in range(micro):
            loss_of(kind, model, *batch(kind, s, u)).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optim.step()
        optim.zero_grad()
    return model, norms


def train_zero(kind: str, opt: str, stage: int, steps: int, *, clip: float | None = None, micro: int = 1,
               counts: bool = False, **kw: Any) -> tuple[Any, Any, list[float], list[dict[str, dict[str, int]]]]:
    m = mesh(dp=-1)
    model, optim = sw.zero(build(kind), m, stage=stage, optimizer=OPTS[opt], **SMALL_BUCKETS, **kw)
    norms, phases = [], []
    for s in range(steps):
        ph: dict[str, dict[str, int]] = {}
        for u in range(micro):
            x, y = (_local(t, m) for t in batch(kind, s, u))
            ctx = model.no_sync() if u < micro - 1 else _null()
            with ctx:
                with CommCounter() as cf:
                    loss = loss_of(kind, model, x, y)
                with CommCounter() as cb:
                    loss.backward()
            ph["forward"], ph["backward"] = cf.by_op(), cb.by_op()
            ph[f"backward{u}"] = cb.by_op()
        with CommCounter() as cs:
            if clip is not None:
                norms.append(float(optim.clip_grad_norm_(clip)))
            optim.step()
        ph["step"] = cs.by_op()
        phases.append(ph)
    return model, optim, norms, phases


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def compare(full: dict[str, torch.Tensor], ref: nn.Module) -> dict[str, Any]:
    """Largest per-tensor relative error ``max|a - b| / (1e-3 + max|b|)`` (as in dp_checks)."""
    err = 0.0
    for k, v in ref.state_dict().items():
        got = full[k].double()
        err = max(err, float((got - v.double()).abs().max()) / (1e-3 + float(v.double().abs().max())))
    return {"err": err, "keys_ok": sorted(full) == sorted(ref.state_dict())}


def expected_counts(model: Any, stage: int) -> dict[str, dict[str, int]]:
    """What the docs promise per step (no accumulation, no clipping)."""
    groups = len(model.groups)
    if stage == 3:
        rest = 1 if model._stage3.has_rest else 0
        blocks = groups - rest
        bwd = {"all_gather": blocks, "reduce_scatter": groups} if blocks else {"reduce_scatter": groups}
        return {"forward": {"all_gather": rest + blocks}, "backward": bwd, "step": {}}
    # Stages 1-2 alike: every bucket reduce-scattered in backward, the step only all-gathers parameters.
    return {"forward": {}, "backward": {"reduce_scatter": groups}, "step": {"all_gather": groups}}


def check_parity(configs: list[tuple]) -> list[dict[str, Any]]:
    """``(kind, opt, stage, variant)`` with variant plain | clip | accum. Final params vs the reference."""
    out = []
    for kind, opt, stage, variant in configs:
        clip = 0.05 if variant in ("clip", "offload") else None
        micro = 2 if variant.endswith("accum") else 1
        ref, ref_norms = cached_reference(kind.replace("-ckpt", ""), opt, STEPS, clip=clip, micro=micro)
        # "units": the tied wte/lm_head as units of their own -> shared, so they move to the rest unit
        kw: dict[str, Any] = {"units": [["wte"], ["blocks.0", "blocks.1"], ["ln_f"], ["lm_head"]]} if variant == "units" else {}
        if variant == "serial":  # no overlap of reductions with backward, no prefetch of units
            kw = {"overlap": False, "prefetch": False}
        if variant.startswith("offload"):
            kw = {"offload": "params" if variant == "offload-params" else "optimizer"}
        model, _, norms, phases = train_zero(kind, opt, stage, STEPS, clip=clip, micro=micro, **kw)
        res = compare(sw.full_state_dict(model), ref)
        res["cfg"] = (kind, opt, stage, variant)
        res["norms_ok"] = all(abs(a - b) <= 1e-5 * abs(b) + 1e-7 for a, b in zip(norms, ref_norms))
        if variant in ("plain", "ckpt", "serial"):
            want = expected_counts(model, stage)
            res["counts_ok"] = all({k: ph[k] for k in want} == want for ph in phases)
            res["phases"] = phases[-1]
        if variant.endswith("accum"):  # the no_sync micro-batch's backward reduces nothing
            res["quiet"] = all("reduce_scatter" not in ph["backward0"] for ph in phases)
        res["groups"] = len(model.groups)
        res["group_names"] = [g.names for g in model.groups]
        out.append(res)
    return out


def check_load(stages: list[int]) -> list[dict[str, Any]]:
    """A full state dict of a one-process model loads into every stage; training then continues exactly."""
    out = []
    for stage in stages:
        ref, _ = reference("gpt", "sgd", 2)
        state = {k: v.clone() for k, v in ref.state_dict().items()}
        m = mesh(dp=-1)
        model, optim = sw.zero(build("gpt", seed=7), m, stage=stage, optimizer=OPTS["sgd"], **SMALL_BUCKETS)
        model.load_state_dict(state)
        loaded = compare(sw.full_state_dict(model), ref)["err"] == 0.0
        with torch.no_grad():  # an evaluation forward (stage 3: gathers, then frees everything)
            x_eval = batch("gpt", 99)[0]
            eval_err = float((model(x_eval) - ref(x_eval)).abs().max())
        ref_opt = OPTS["sgd"](ref.parameters())
        for s in range(2, 4):
            x, y = batch("gpt", s)
            loss_of("gpt", ref, x, y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            loss_of("gpt", model, *(_local(t, m) for t in (x, y))).backward()
            optim.step()
        res = compare(sw.full_state_dict(model), ref)
        missing = _error(lambda: model.load_state_dict({k: v for k, v in state.items() if k != "wpe.weight"}))
        out.append({"stage": stage, "loaded": loaded, "err": res["err"], "missing": missing, "eval_err": eval_err,
                    "freed": stage != 3 or not any(g.gathered for g in model.groups)})
    return out


class Wide(nn.Module):
    """~0.1M parameters, none divisible by 3: the memory formulas' Ψ."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(97, 251), nn.Linear(251, 199), nn.Linear(199, 97)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _measure(model: nn.Module, optim: Any, m: sw.Mesh) -> dict[str, int]:
    """Model-state bytes after one full step (optimizer state exists) and the next backward."""
    for s in range(2):
        x = torch.randn(4, 97, generator=torch.Generator().manual_seed(s))
        model(x).float().pow(2).mean().backward()
        if s == 0:
            optim.step()
            optim.zero_grad()
    return sw.memory_report(model, optim)


def check_memory() -> list[dict[str, Any]]:
    """Measured model-state bytes per rank vs the ZeRO formulas (fp32 Adam and bf16/fp32 mixed)."""
    m = mesh(dp=-1)
    n = m.size("dp")
    torch.manual_seed(0)
    plain = Wide()
    psi = sum(p.numel() for p in plain.parameters())
    out = [{"case": "none-fp32", "want": 16 * psi, "got": _measure(plain, torch.optim.AdamW(plain.parameters()), m)}]
    formulas = {(1, False): 8 * psi + 8 * psi / n, (2, False): 4 * psi + 12 * psi / n, (3, False): 16 * psi / n,
                (1, True): 4 * psi + 12 * psi / n, (2, True): 2 * psi + 14 * psi / n, (3, True): 16 * psi / n}
    for (stage, mixed), want in formulas.items():
        torch.manual_seed(0)
        mp = MixedPrecision(param_dtype=torch.bfloat16) if mixed else None
        model, optim = sw.zero(Wide(), m, stage=stage, optimizer=OPTS["adamw"], mixed_precision=mp)
        got = _measure(model, optim, m)
        out.append({"case": f"stage{stage}-{'bf16' if mixed else 'fp32'}", "want": want, "got": got})
    for r in out:
        r["total"] = r["got"]["params"] + r["got"]["grads"] + r["got"]["optimizer"]
        r["rel"] = abs(r["total"] - r["want"]) / r["want"]
    return out


def _error(fn: Any) -> str:
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def check_bad_input() -> dict[str, str]:
    m = mesh(dp=-1)
    sgd = OPTS["sgd"]
    out = {}
    for stage in (0, 4, "2", True):
        out[f"stage={stage!r}"] = _error(lambda: sw.zero(build("uneven"), m, stage=stage, optimizer=sgd))
    built = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    out["optimizer-instance"] = _error(lambda: sw.zero(build("uneven"), m, stage=2, optimizer=built))
    out["optimizer-class"] = _error(lambda: sw.zero(build("uneven"), m, stage=2, optimizer=nn.Linear))
    out["optimizer-returns"] = _error(lambda: sw.zero(build("uneven"), m, stage=2, optimizer=lambda ps: list(ps)))
    out["optimizer-int"] = _error(lambda: sw.zero(build("uneven"), m, stage=2, optimizer=3))
    wrapped, _ = sw.zero(build("uneven"), m, stage=1, optimizer=sgd)
    out["wrapped-twice"] = _error(lambda: sw.zero(wrapped, m, stage=2, optimizer=sgd))
    out["inner-twice"] = _error(lambda: sw.zero(wrapped.module, m, stage=3, optimizer=sgd))
    out["data-parallel"] = _error(lambda: sw.zero(sw.DataParallel(build("uneven"), m), m, stage=2, optimizer=sgd))
    mixed = build("uneven")
    mixed.b.double()
    out["mixed-dtypes"] = _error(lambda: sw.zero(mixed, m, stage=2, optimizer=sgd))
    off = build("uneven")  # a meta parameter is built in place, if something says how to initialise it
    off.extra = nn.Module()
    off.extra.w = nn.Parameter(torch.empty(3, device="meta"))
    out["meta-no-source"] = _error(lambda: sw.zero(off, m, stage=3, optimizer=sgd))
    out["algorithm"] = _error(lambda: sw.zero(build("uneven"), m, stage=1, optimizer=sgd, algorithm="fast"))
    out["unit-name"] = _error(lambda: sw.zero(build("gpt"), m, stage=3, optimizer=sgd, units=[["blocks.9"]]))
    out["unit-container"] = _error(lambda: sw.zero(build("gpt"), m, stage=3, optimizer=sgd, units=[["blocks"]]))
    out["offload-params-stage2"] = _error(lambda: sw.zero(build("gpt"), m, stage=2, optimizer=sgd, offload="params"))
    out["offload-unknown"] = _error(lambda: sw.zero(build("gpt"), m, stage=3, optimizer=sgd, offload="disk"))
    return out


def check_accumulation_errors(stage: int) -> dict[str, str]:
    """Misuse of no_sync and of stage-1 clipping raises instead of silently dropping gradients."""
    m = mesh(dp=-1)
    model, optim = sw.zero(build("uneven"), m, stage=stage, optimizer=OPTS["sgd"])
    x, y = (_local(t, m) for t in batch("uneven", 0))
    out = {}
    with model.no_sync():
        loss_of("uneven", model, x, y).backward()
        out["step-inside"] = _error(optim.step)
        out["clip-inside"] = _error(lambda: optim.clip_grad_norm_(1.0))
    out["step-unreduced"] = _error(optim.step)
    optim.zero_grad()
    loss_of("uneven", model, x, y).backward()
    optim.clip_grad_norm_(1.0)
    out["backward-after-clip"] = _error(lambda: loss_of("uneven", model, x, y).backward())
    return out


def check_mixed(kind: str) -> dict[str, Any]:
    """bf16: stages 1 and 3 train identically (N=2 sums are order-free; stage 2 reduces in fp32) and close
    to fp32; fp16 with
    dynamic loss scaling skips overflowing steps, lowers the scale, then trains close to fp32."""
    m = mesh(dp=-1)
    finals, losses = [], []
    for stage in (1, 2, 3):
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32 if stage == 2 else None)
        model, optim = sw.zero(build(kind), m, stage=stage, optimizer=OPTS["sgd"], mixed_precision=mp,
                               **SMALL_BUCKETS)
        for s in range(STEPS):
            loss = loss_of(kind, model, *(_local(t, m) for t in batch(kind, s)))
            loss.backward()
            optim.step()
        losses.append(float(loss.detach()))
        finals.append(sw.full_state_dict(model))
    ref, _ = reference(kind, "sgd", STEPS)
    spread = max(float((finals[0][k] - finals[2][k]).abs().max()) for k in finals[0])
    out: dict[str, Any] = {"bf16_err": max(compare(f, ref)["err"] for f in finals), "stage_spread": spread,
                           "dtypes": sorted({str(v.dtype) for v in finals[0].values()})}
    mp16 = MixedPrecision(param_dtype=torch.float16, init_scale=2.0**20, growth_interval=3)
    model, optim = sw.zero(build(kind), m, stage=3, optimizer=OPTS["sgd"], mixed_precision=mp16)
    took, scales = [], []
    for s in range(8):
        loss = loss_of(kind, model, *(_local(t, m) for t in batch(kind, s)))
        optim.scale_loss(loss).backward()
        took.append(optim.step())
        scales.append(optim.loss_scale)
    ref = build(kind)
    ref_opt = OPTS["sgd"](ref.parameters())
    for s in [s for s, ok in enumerate(took) if ok]:
        loss_of(kind, ref, *batch(kind, s)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    out.update(took=took, scales=scales, fp16_err=compare(sw.full_state_dict(model), ref)["err"])
    return out


def check_stage3_residency() -> dict[str, Any]:
    """How many units are gathered (or being prefetched) at once during a stage-3 step of a 4-block GPT."""
    m = mesh(dp=-1)
    torch.manual_seed(0)
    model, optim = sw.zero(GPT(GPTConfig(**{**TINY.to_dict(), "n_layer": 4})), m, stage=3, optimizer=OPTS["sgd"])
    runtime = model._stage3
    seen: list[int] = []
    calls = {"ensure": 0}
    original_ensure, original_start = runtime.ensure, runtime.start

    def resident() -> None:
        seen.append(sum(g.gathered for g in model.groups) + len(runtime.pending))

    def ensure(k: int) -> None:
        original_ensure(k)
        calls["ensure"] += 1
        resident()

    def start(k: int) -> None:
        original_start(k)
        resident()
    runtime.ensure, runtime.start = ensure, start  # type: ignore[method-assign]
    reducer = model._reducer
    flats: list[int] = []  # unit-sized flat gradients alive at each launch: filling + reducing
    original_launch = reducer._launch

    def launch(k: int) -> None:
        original_launch(k)
        flats.append(sum(f is not None for f in reducer._flat) + len(reducer.handles))
    reducer._launch = launch  # type: ignore[method-assign]
    x, y = (_local(t, m) for t in batch("gpt", 0))
    loss_of("gpt", model, x, y).backward()
    after_backward = sum(g.gathered for g in model.groups)
    grads_left = sum(p.grad is not None for p in model.module.parameters())
    shards = len(reducer.held_shards())
    optim.step()
    return {"max_resident": max(seen), "calls": calls["ensure"], "groups": len(model.groups),
            "after_backward": after_backward, "max_flats": max(flats), "grads_left": grads_left,
            "shards_after_backward": shards, "shards_after_step": len(reducer.held_shards()),
            "in_flight": reducer.peak_in_flight}
