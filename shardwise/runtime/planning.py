"""From a training config to the planner's search and back: ``shardwise plan`` and ``shardwise train
--parallel.auto true``.

``config_from_plan`` turns a ``Layout`` into the ``parallel`` fields ``shardwise train`` runs (the config reads a
pipeline's ``micro_batch`` as one *pass* of a dp replica, cut into ``pp_microbatches``; the planner's
``micro_batch`` is one pipeline micro-batch, so a pass is ``micro_batch × microbatches``). ``plan_config``
searches for a config and returns the ranked plans with the config each one runs as.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from ..planner import Hardware, Layout
from ..planner.error_band import ranked
from ..planner.search import SearchResult, search
from .config import REPLICABLE, Config, replicable, validate
from .config_defaults import search_batch
from .config_ranges import check_context_parallel
from .model_build import model_spec, planner_split_names, train_split_names, with_adapters
from .prediction import moe_hf_spec, with_documents

__all__ = ["config_from_plan", "pins_from_flags", "parse_pin", "parse_pins", "plan_config", "apply_plan", "PIN_FIELDS",
           "RECOMMEND_POOL"]

PIN_FIELDS = ("dp", "tp", "pp", "cp", "ep", "zero_stage", "micro_batch", "grad_accum", "pp_schedule", "pp_chunks",
              "pp_microbatches", "pp_split", "activation_checkpointing", "replicate", "async_tp")
"""``parallel.*`` fields that pin the search (``--pin parallel.tp=8``, or given flags with ``--parallel.auto``)."""


def config_from_plan(plan: Layout) -> dict[str, Any]:
    """The ``parallel`` section (field → value) that makes ``shardwise train`` run ``plan``; ``ValueError``
    naming what train cannot run (bf16-mixed)."""
    if plan.precision == "bf16-mixed":
        raise ValueError(f"plan {plan.describe()}: shardwise train runs fp32 or bf16 autocast, not bf16-mixed")
    out: dict[str, Any] = {"dp": plan.dp, "tp": plan.tp, "pp": plan.pp, "cp": plan.cp, "zero_stage": plan.zero_stage,
                           "activation_checkpointing": plan.activation_checkpointing,
                           "sequence_parallel": plan.sequence_parallel, "async_tp": plan.async_tp}
    if plan.ep > 1:  # parallel.ep (absent from a dense plan's section, which stays as it was)
        out["ep"] = plan.ep
    if plan.pp == 1:
        out.update(micro_batch=plan.micro_batch, grad_accum=plan.grad_accum, pp_schedule="1f1b", pp_chunks=1,
                   pp_microbatches=0, pp_split=())
    else:
        m = plan.microbatches
        if m < 1:
            raise ValueError(f"plan {plan.describe()} is not resolved (microbatches = 0); use Layout.resolved()")
        out.update(micro_batch=plan.micro_batch * m, pp_microbatches=m, grad_accum=plan.grad_accum,
                   pp_schedule=plan.schedule, pp_chunks=plan.chunks, pp_split=tuple(plan.pp_split))
    return out


def parse_pin(text: str) -> tuple[str, Any]:
    """``parallel.tp=8`` → ``("tp", 8)``; ``modules.wte=replicate`` → ``("modules.wte", "replicate")``;
    ``ValueError`` naming the pinnable fields."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not raw.strip():
        raise ValueError(f"--pin {text!r} must be FIELD=VALUE, e.g. --pin parallel.tp=8")
    if key.startswith("modules."):
        return key, raw.strip()
    name = key.removeprefix("parallel.")
    if key == "train.precision":
        return "precision", raw.strip()
    if name not in PIN_FIELDS:
        raise ValueError(f"--pin {text!r}: {key!r} cannot be pinned; pinnable: "
                         f"{', '.join('parallel.' + f for f in PIN_FIELDS)}, train.precision, modules.NAME=replicate")
    value: Any = raw.strip()
    if name in ("pp_split", "replicate"):
        value = tuple(v for v in value.split(",") if v)
    elif name == "activation_checkpointing":
        modes = {"none": "none", "full": "full", "selective": "selective", "true": "full", "false": "none",
                 "1": "full", "0": "none"}
        if value.lower() not in modes:
            raise ValueError(f"--pin {text!r}: {name} is none, full or selective")
        value = modes[value.lower()]
    elif name == "async_tp":
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"--pin {text!r}: {name} is true or false")
        value = value.lower() in ("true", "1")
    elif name != "pp_schedule":  # a schedule's name is checked with the other values (_check_pin_values)
        if not value.isdigit():
            raise ValueError(f"--pin {text!r}: {name} must be a whole number, e.g. --pin parallel.{name}=2")
        value = int(value)
    return name, value


def parse_pins(texts: Sequence[str]) -> dict[str, Any]:
    """Every ``--pin`` of a command line through :func:`parse_pin`; one field pinned twice to different values
    is a contradiction (``ValueError`` naming both), the same value twice is harmless."""
    pins: dict[str, Any] = {}
    given: dict[str, str] = {}
    for text in texts:
        name, value = parse_pin(text)
        if name in pins and pins[name] != value:
            raise ValueError(f"--pin {given[name]!r} and --pin {text!r} contradict each other: "
                             f"{name} is pinned twice; keep one of them")
        pins[name] = value
        given[name] = text
    return pins


_INFERRED_BY_ZERO = ("dp", "grad_accum", "pp_microbatches")


def _check_pin_values(pairs: Mapping[str, Any]) -> None:
    """Pinned values the config itself would refuse, named as the user gave them (``parallel.zero_stage``, not
    the planner's ``Layout.zero_stage``). ``ValueError``. Pure."""
    from ..planner.plan import SCHEDULES

    if "zero_stage" in pairs and pairs["zero_stage"] not in (0, 1, 2, 3):
        raise ValueError(f"pin parallel.zero_stage = {pairs['zero_stage']} must be 0, 1, 2 or 3")
    if "pp_schedule" in pairs and pairs["pp_schedule"] not in SCHEDULES:
        raise ValueError(f"pin parallel.pp_schedule = {pairs['pp_schedule']!r} is not one of {list(SCHEDULES)}")
    for key in ("dp", "tp", "pp", "cp", "ep", "grad_accum", "pp_chunks", "pp_microbatches", "micro_batch"):
        value = pairs.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"pin parallel.{key} = {value!r} must be a whole number >= 1")


def pins_from_flags(pairs: Mapping[str, Any]) -> dict[str, Any]:
    """Config-named pins (``tp``, ``pp_schedule``, ``micro_batch`` in train's reading …) → the planner's.

    ``micro_batch`` and ``pp_microbatches`` pin the pass (pp > 1 in train's reading) only together with pp; the
    planner pins what it can: a given ``pp_microbatches`` pins ``microbatches``, and ``micro_batch`` with
    ``pp = 1`` (or with ``pp_microbatches``) pins the planner's micro-batch."""
    # 0 is the config's "infer it" for these: the search infers them anyway, so it pins nothing
    pairs = {k: v for k, v in pairs.items() if not (k in _INFERRED_BY_ZERO and v == 0)}
    _check_pin_values(pairs)
    pins: dict[str, Any] = {}
    modules: dict[str, str] = {}
    for key, value in pairs.items():
        if key.startswith("modules."):
            name = key.removeprefix("modules.")
            modules[REPLICABLE.get(name, name)] = value  # train's module name → the planner's layer
        elif key == "replicate":
            modules.update({REPLICABLE.get(name, name): "replicate" for name in value})
        elif key in ("dp", "tp", "pp", "cp", "ep", "zero_stage", "grad_accum", "precision"):
            pins[key] = value
        elif key == "pp_schedule":
            pins["schedule"] = value
        elif key == "pp_chunks":
            pins["chunks"] = value
        elif key == "pp_microbatches":
            pins["microbatches"] = value
        elif key == "pp_split":
            pins["pp_split"] = tuple(value)
        elif key == "activation_checkpointing":
            pins[key] = value if isinstance(value, str) else "full" if value else "none"
        elif key == "async_tp" and value:  # false pins nothing: the search prices async_tp only when asked
            pins[key] = True
    if "micro_batch" in pairs:
        pp, m = pairs.get("pp"), pairs.get("pp_microbatches")
        if pp == 1:
            pins["micro_batch"] = pairs["micro_batch"]
        elif m:
            if pairs["micro_batch"] % m:
                raise ValueError(f"pins micro_batch {pairs['micro_batch']} and pp_microbatches {m} contradict: a "
                                 f"pipeline pass of micro_batch sequences must cut into pp_microbatches equal parts")
            pins["micro_batch"] = pairs["micro_batch"] // m
        else:
            raise ValueError(f"pin micro_batch {pairs['micro_batch']} needs parallel.pp (1: sequences per pass) or "
                             f"parallel.pp_microbatches (pp > 1: a pass cut into that many micro-batches); add one")
    if modules:
        pins["modules"] = modules
    return pins


RECOMMEND_POOL = 8
"""Plans ``shardwise train --parallel.auto`` and ``shardwise plan`` search for and recommend among
(``planner.error_band.ranked``: the simplest of the fastest and those tied with it): both see the same plans, so
both recommend the same one."""


def plan_config(cfg: Config, hw: Hardware, *, devices: int, pins: Mapping[str, Any], top: int = 3,
                memory_margin: float = 0.1) -> tuple[SearchResult, list[dict[str, Any]]]:
    """Search the layouts of ``cfg``'s model on ``devices`` devices of ``hw`` (``cfg.train.precision``
    fixed); returns the result and, per ranked plan, the ``parallel`` fields train runs it with."""
    pins = dict(pins)
    pins.setdefault("precision", cfg.train.precision)
    if "pp_split" in pins:  # train's unit names → the planner's layer names (an HF decoder's differ)
        pins["pp_split"] = planner_split_names(cfg.model, tuple(pins["pp_split"]))
    names = replicable(cfg.model)  # module pins: train's names → the planner's layers (pins_from_flags knows the GPT's)
    if "modules" in pins:
        pins["modules"] = {names.get(name, name): value for name, value in pins["modules"].items()}
    if not hasattr(cfg.parallel, "ep"):
        pins.setdefault("ep", 1)  # a config without parallel.ep runs no expert parallelism
    cfg = search_batch(cfg, devices, pins)  # a global batch left unset: config_defaults.search_batch
    spec = with_documents(with_adapters(moe_hf_spec(cfg.model) or model_spec(cfg.model), cfg), cfg)
    result = search(spec, hw, devices=devices, global_batch=cfg.data.global_batch, pins=pins,
                    memory_margin=memory_margin, top=top)
    # module pins run as parallel.replicate (train's names); a pin train cannot run is refused there
    layers = {layer: module for module, layer in names.items()}
    replicate = tuple(sorted({layers.get(name, name) for name in pins.get("modules", {})}))
    fields = []
    for p in result:
        f = {**config_from_plan(p.plan), "replicate": replicate}  # () too: a config file's own was not priced
        if hasattr(cfg.parallel, "ep"):
            f["ep"] = p.plan.ep  # ep = 1 too: a config file's own ep was not what the plan priced
        fields.append({**f, "pp_split": train_split_names(cfg.model, f["pp_split"])})
    return result, fields


def apply_plan(cfg: Config, fields: Mapping[str, Any], nproc: int) -> Config:
    """``cfg`` with the plan's ``parallel`` fields, validated as ``shardwise train`` validates."""
    parallel = dataclasses.replace(cfg.parallel, nproc=nproc, **dict(fields))
    return validate(dataclasses.replace(cfg, parallel=parallel))


def auto_layout(cfg: Config, given: Mapping[str, Any], *, device: str, nproc: int) -> tuple[Config, list[str]]:
    """``shardwise train --parallel.auto true``: the plan ``shardwise plan`` recommends (the simplest of the
    fastest and those tied with it inside its error band, ``planner.error_band.ranked``), or the next that train
    runs, for ``nproc`` local ranks (the ``parallel.calibration`` file, else this machine's calibration, else a quick probe), with the
    ``parallel.*`` fields in ``given`` as pins. Returns the validated config and the lines to print (the
    choice and the runner-up). ``ValueError`` when nothing fits or every plan is refused."""
    from ..planner.search import NoFeasiblePlan
    from ..planner.units import format_bytes
    from .prediction import launch_hardware

    if cfg.parallel.sequence_parallel:
        raise ValueError("parallel.auto does not search sequence parallelism; give the layout by hand "
                         "(--parallel.tp N --parallel.sequence_parallel true) without --parallel.auto")
    hw, where = launch_hardware(cfg, device=device, nproc=nproc)
    # the values as the config parsed them (the flags arrive as text)
    pairs = {k.removeprefix("parallel."): getattr(cfg.parallel, k.removeprefix("parallel.")) for k in given
             if k.startswith("parallel.") and k.removeprefix("parallel.") in PIN_FIELDS}
    pins = pins_from_flags(pairs)
    if "cp" in pins:  # a given cp the config refuses (block_size, dropout): its one line, not every plan's
        check_context_parallel(cfg)
    elif cfg.model.dropout:  # the ring has no dropout: every cp > 1 plan would be refused
        pins["cp"] = 1
    cfg = search_batch(cfg, nproc, pins)  # the global batch every searched layout and the chosen one share
    try:
        result, fields = plan_config(cfg, hw, devices=nproc, pins=pins, top=RECOMMEND_POOL)
    except NoFeasiblePlan as exc:
        raise ValueError(f"parallel.auto: {exc}") from None
    refused: list[str] = []
    order = ranked(result.predictions, hw)  # shardwise plan's recommendation first (ties: the simplest)
    for n, i in enumerate(order):
        pred, f = result[i], fields[i]
        try:
            chosen = apply_plan(cfg, f, nproc)
        except ValueError as exc:  # a layout the planner knows but train refuses: take the next one
            refused.append(f"{pred.plan.describe()}: {str(exc).splitlines()[0]}")
            continue
        lines = [f"shardwise train: parallel.auto chose {pred.plan.describe()} — predicted {pred.step_time_s:.3g} "
                 f"s/step, {format_bytes(pred.memory.total)} per rank ({result.candidates} layouts searched in "
                 f"{result.search_s:.2f} s; hardware: {where})"]
        if n + 1 < len(order):
            other = result[order[n + 1]]
            lines.append(f"shardwise train: runner-up {other.plan.describe()} — predicted {other.step_time_s:.3g} "
                         f"s/step ({other.step_time_s / pred.step_time_s - 1:+.1%})")
        lines += [f"shardwise train: skipped {r}" for r in refused]
        return chosen, lines
    raise ValueError(f"parallel.auto: shardwise train refuses all {len(fields)} best plans: " + "; ".join(refused))
