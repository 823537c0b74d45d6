"""The training configuration: one typed tree of frozen dataclasses, from presets, TOML and dotted flags.

Precedence, lowest first: field defaults ← named preset (``--preset``, or ``preset = "..."`` at the top of the
TOML file) ← the TOML file ← dotted flags (``--parallel.tp 2``). ``validate`` checks everything that can be
checked before any process starts (batch arithmetic, divisibility by tp, world size, strategy availability);
every error names the field, the value and the fix. Pure: nothing here starts processes or communicates.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import sys
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

__all__ = ["ModelConfig", "DataConfig", "OptimizerConfig", "ParallelConfig", "TrainConfig", "DebugConfig",
           "Config", "PRESETS", "load_config", "parse_overrides", "apply_overrides", "config_from_dict",
           "validate", "default_nproc", "describe_fields", "read_config_file"]

from .compiling import check_compile
from .config_moe import check_experts
from .config_defaults import MICRO_BATCH_CAP, dataset_vocab, grad_accum_of, inferred_dp, resolve_batch
from .config_ranges import (check_async_tp, check_context_parallel, check_mixed, check_numbers, check_offload,
                            check_selective,
                            check_sequence_parallel)
from .config_schema import (OLD_SPELLINGS, PRESETS, Config, DataConfig, DebugConfig, ModelConfig,  # noqa: F401
                            OptimizerConfig, ParallelConfig, TrainConfig, describe_fields)
from .lora_setup import check_lora, lora_given, resolved_lora
from .model_build import HF_REPLICABLE, check_tp, hf_of, meta_model, resolve_hf, resolve_pretrained


_SECTIONS = {f.name: f for f in fields(Config)}


def _section_type(name: str) -> type:
    return typing.get_type_hints(Config)[name]


def _field_types(section: str) -> dict[str, Any]:
    return typing.get_type_hints(_section_type(section))


def _unknown(kind: str, name: str, choices: Sequence[str]) -> ValueError:
    close = difflib.get_close_matches(name, choices, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ValueError(f"unknown {kind} {name!r}; {hint}valid: {', '.join(sorted(choices))}")




def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Check/convert one value (from TOML or a string flag) to the field's type."""
    if typing.get_origin(typ) is Literal:
        choices = typing.get_args(typ)
        value = OLD_SPELLINGS.get(key, {}).get(value.lower() if isinstance(value, str) else value, value)
        if value not in choices:
            raise ValueError(f"{key} = {value!r} is not allowed; choose one of {list(choices)}")
        return value
    if typ is bool:
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, bool):
            return value
    elif typ is int:
        try:
            if isinstance(value, str):
                return int(value)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        except ValueError:
            pass
    elif typ is float:
        try:
            if isinstance(value, str):
                return float(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        except ValueError:
            pass
    elif typ is str:
        if isinstance(value, str):
            return value
    elif typing.get_origin(typ) is tuple:  # tuple[str, ...]: a TOML/JSON list, or "a,b" from a flag
        items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
        if isinstance(items, (list, tuple)) and all(isinstance(v, str) for v in items):
            return tuple(items)
        raise ValueError(f"{key} must be a list of names, got {value!r}; e.g. --{key} blocks.2,ln_f")
    name = getattr(typ, "__name__", str(typ))
    example = {bool: "true", int: "2", float: "0.001", str: "NAME"}.get(typ, "VALUE")
    raise ValueError(f"{key} must be a {name}, got {value!r}; e.g. --{key} {example}")


def config_from_dict(tree: Mapping[str, Any], base: Config | None = None) -> Config:
    """``base`` (default: all defaults) with the sections of a nested dict applied, types checked."""
    return apply_overrides(base or Config(), _flatten(tree))


def _flatten(tree: Mapping[str, Any]) -> dict[str, Any]:
    """``{"model": {"n_layer": 2}}`` → ``{"model.n_layer": 2}``; unknown sections and non-tables raise."""
    flat: dict[str, Any] = {}
    for section, values in tree.items():
        if section not in _SECTIONS:
            raise _unknown("config section", section, list(_SECTIONS))
        if not isinstance(values, Mapping):
            raise ValueError(f"config section [{section}] must be a table of fields, got {values!r}; write it as "
                             f"[{section}] followed by lines like field = value")
        for key, value in values.items():
            flat[f"{section}.{key}"] = value
    return flat


def apply_overrides(config: Config, overrides: Mapping[str, Any]) -> Config:
    """``config`` with dotted ``section.field`` values replaced (strings are converted to the field type)."""
    changes: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        if section not in _SECTIONS or not name:
            raise _unknown("config key", key, [f"{s}.{f}" for s in _SECTIONS for f in _field_types(s)])
        types_ = _field_types(section)
        if name not in types_:
            raise _unknown(f"field of [{section}]", name, list(types_))
        changes.setdefault(section, {})[name] = _coerce(key, value, types_[name])
    try:
        parts = {s: dataclasses.replace(getattr(config, s), **changes.get(s, {})) for s in _SECTIONS}
        given = changes.get("model", {})
        parts["model"] = resolve_hf(resolve_pretrained(parts["model"], given), given)  # they set the shape
        lora_given(parts["lora"], changes.get("lora", {}))
    except ValueError as exc:
        # [model] is GPTConfig, which checks its shape when built: name the config keys, not the class
        raise ValueError(str(exc).replace("GPTConfig.", "model.")) from None
    return Config(**parts)


def parse_overrides(tokens: Sequence[str]) -> dict[str, str]:
    """``["--parallel.tp", "2", "--train.steps=5"]`` → ``{"parallel.tp": "2", "train.steps": "5"}``."""
    out: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--") or "." not in tok:
            raise ValueError(f"unexpected argument {tok!r}; config overrides look like --section.field VALUE, "
                             f"e.g. --parallel.tp 2")
        key, eq, value = tok[2:].partition("=")
        if not eq:
            if i + 1 >= len(tokens):
                raise ValueError(f"--{key} needs a value, e.g. --{key} VALUE")
            value, i = tokens[i + 1], i + 1
        out[key] = value
        i += 1
    return out


def _read_toml(path: Path) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ValueError("reading TOML on Python 3.10 needs the 'tomli' package: pip install tomli") from None
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist; pass the path of a TOML file")
    with path.open("rb") as f:
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config file {str(path)!r} is not valid TOML: {exc}; fix the syntax there "
                             f"(tables like [model], lines like n_layer = 2)") from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The tree of a config file as written: TOML, or ``.json`` (a saved run config)."""
    p = Path(path)
    return json.loads(p.read_text()) if p.suffix == ".json" else _read_toml(p)


def load_config(*, path: str | Path | None = None, preset: str | None = None,
                overrides: Mapping[str, Any] | None = None, base: Config | None = None) -> Config:
    """Defaults (or ``base``) ← preset ← TOML file (``.json``: a saved run config) ← dotted overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        tree = dict(read_config_file(path))
        preset = preset or tree.pop("preset", None)
        tree.pop("preset", None)
    if preset is not None and preset not in PRESETS:
        raise _unknown("preset", preset, list(PRESETS))
    # One pass over all layers (later keys win): the [model] section validates its shape when built, so a shape
    # made valid only by a later layer (TOML n_head, flag n_embd) must not be checked half-applied.
    flat: dict[str, Any] = dict(PRESETS[preset]) if preset is not None else {}
    flat.update(_flatten(tree))
    flat.update(overrides or {})
    flat = dataset_vocab(flat, Config()) if base is None else flat  # a prepared dataset states its vocabulary
    return apply_overrides(base or Config(), flat)


def default_nproc() -> int:
    """Ranks to start when ``parallel.nproc`` is 0: every local GPU, else 2 CPU processes."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _check_devices(config: Config) -> None:
    """What only the machine that launches can check: its devices."""
    if config.parallel.algorithm == "shm" and _cuda_available():
        raise ValueError("parallel.algorithm = 'shm' moves host memory between CPU ranks, but this machine trains "
                         "on its GPUs; use --parallel.algorithm auto (or native)")
    from .optimizer_impl import check_implementation

    check_implementation(config.optimizer, "cuda" if _cuda_available() else "cpu")  # fused kernels on this device


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _optional_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def validate(config: Config, *, launch: bool = True, micro_cap: int = MICRO_BATCH_CAP) -> Config:
    """Check the whole tree before anything starts; returns it with ``nproc``, ``dp``, ``grad_accum`` and the
    batch (``data.global_batch``, ``parallel.micro_batch``: ``config_defaults.py``) resolved. Raises ``ValueError`` naming the field, the value and the fix.

    ``launch=False`` (``shardwise predict``: a layout on devices that are not here) skips what only a launch
    on this machine needs: ``parallel.nproc`` is not inferred from the local devices (give it, or dp), and with
    pp > 1 the batch is read with the planner's Megatron semantics (``runtime/prediction.py``), so neither
    train's pass-cutting of ``micro_batch`` into ``pp_microbatches`` nor its batch arithmetic is checked
    (``grad_accum`` and ``pp_microbatches`` stay as given; the planner checks its own). ``micro_cap`` bounds a
    derived micro-batch (a resumed run's saved one)."""
    # config.model (a GPTConfig) checked its own shape when it was built
    m, p, t, o = config.model, config.parallel, config.train, config.optimizer
    _positive(("parallel.tp", p.tp), ("parallel.pp", p.pp), ("parallel.cp", p.cp),
              ("train.steps", t.steps),
              ("train.log_every", t.log_every), ("train.keep_checkpoints", t.keep_checkpoints),
              ("train.max_skipped", t.max_skipped), ("train.eval_batches", t.eval_batches))
    for key, value in (("parallel.nproc", p.nproc), ("parallel.dp", p.dp), ("parallel.grad_accum", p.grad_accum),
                       ("train.ckpt_every", t.ckpt_every), ("optimizer.warmup_steps", o.warmup_steps),
                       ("train.eval_every", t.eval_every), ("parallel.micro_batch", p.micro_batch),
                       ("data.global_batch", config.data.global_batch)):
        if value < 0:
            meaning = "off" if key.startswith(("train", "optimizer")) else "infer it"
            raise ValueError(f"{key} = {value} must be >= 0 (0 means: {meaning}); e.g. --{key} 0")
    check_numbers(config)
    _check_strategies(config)
    if launch:
        _check_devices(config)
    nproc = p.nproc or (default_nproc() if launch else p.dp * p.cp * p.tp * p.pp)
    if not nproc:
        raise ValueError("parallel.nproc = 0 (infer it) needs local devices, but nothing is launched here; give the "
                         "device count, e.g. --parallel.nproc 8")
    if not -1 <= config.debug.nonfinite_rank < nproc:
        raise ValueError(f"debug.nonfinite_rank = {config.debug.nonfinite_rank} must be -1 (every rank) or a rank in "
                         f"[0, {nproc}); e.g. --debug.nonfinite_rank 0")
    dp = inferred_dp(p, nproc)
    check_experts(config, dp)
    axes = {"dp": dp, **({"cp": p.cp} if p.cp > 1 else {}), "tp": p.tp, "pp": p.pp}  # cp named where it is used
    if dp * p.cp * p.tp * p.pp != nproc:
        raise ValueError(f"{' × '.join('parallel.' + k for k in axes)} = {' × '.join(map(str, axes.values()))} = "
                         f"{dp * p.cp * p.tp * p.pp} must equal the number of processes parallel.nproc = {nproc}; set "
                         f"--parallel.nproc {max(dp, 1) * p.cp * p.tp * p.pp} or pick {'/'.join(axes)} whose product "
                         f"is {nproc}")
    config = resolve_batch(config, dp, passes=launch, cap=micro_cap)  # the batch left unset: from dp, the pipeline
    p, accum = config.parallel, grad_accum_of(config, dp, launch=launch)
    m = _check_pipeline(config, cut=launch)
    return dataclasses.replace(config, parallel=dataclasses.replace(p, nproc=nproc, dp=dp, grad_accum=accum,
                                                                    pp_microbatches=m), lora=resolved_lora(config.lora))


REPLICABLE = {"wte": "wte", "lm_head": "ln_f"}
"""``parallel.replicate`` names → the planner's layer that holds the module (the head layer is ``ln_f``)."""


def replicable(model: ModelConfig) -> dict[str, str]:
    """``REPLICABLE`` of the GPT, or of the HF decoder of ``model.hf_config`` (``model.embed_tokens``, ``lm_head``)."""
    return HF_REPLICABLE if hf_of(model) is not None else REPLICABLE


def replicated_modules(config: Config) -> set[str]:
    """The modules ``parallel.replicate`` keeps whole on every tp rank: the named ones, and with
    ``model.tie_weights`` their partner (one weight, split alike in both uses)."""
    names = set(config.parallel.replicate)
    return set(replicable(config.model)) if names and config.model.tie_weights else names


def _positive(*pairs: tuple[str, int]) -> None:
    for key, value in pairs:
        if value < 1:
            raise ValueError(f"{key} = {value} must be >= 1; e.g. --{key} 1")


def _check_strategies(config: Config) -> None:
    m, p = config.model, config.parallel
    if p.tp > 1:
        if not _optional_module("shardwise.parallel.tensor.apply_plan"):
            raise ValueError(f"parallel.tp = {p.tp} needs tensor parallelism, which this build lacks; "
                             f"use --parallel.tp 1")
        check_tp(m, p.tp, p.ep)
    check_sequence_parallel(config)
    check_async_tp(config)
    check_selective(config), check_offload(config), check_mixed(config)
    check_context_parallel(config)
    check_compile(config), check_lora(config.lora, lambda: meta_model(m))
    allowed = replicable(m)
    unknown = [name for name in p.replicate if name not in allowed]
    if unknown:
        raise ValueError(f"parallel.replicate = {list(p.replicate)}: {unknown} cannot be kept whole; the modules "
                         f"tensor parallelism splits that may stay data-parallel are {list(allowed)} (tied: "
                         f"either keeps both whole), e.g. --parallel.replicate {next(iter(allowed))}")
    if p.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"parallel.zero_stage = {p.zero_stage} must be 0, 1, 2 or 3; e.g. --parallel.zero_stage 1 "
                         f"(0 = plain data parallelism)")
    if p.zero_stage and not _optional_module("shardwise.parallel.zero.wrap"):
        raise ValueError(f"parallel.zero_stage = {p.zero_stage} needs ZeRO (shardwise.parallel.zero.wrap), which this "
                         f"build lacks; use --parallel.zero_stage 0")
    if p.pp > 1:
        _check_pipeline_hybrids(p)


def _check_pipeline_hybrids(p: ParallelConfig) -> None:
    """What ``shardwise train`` does not combine with pp > 1: the ONE place listing it. Supported: dp, tp inside
    the stages, ZeRO 1-3 over dp (with accumulation; with tp too: each tp rank's local shards sharded over dp),
    activation checkpointing (``runtime/strategy/pipeline.py``). Refused: a non-native gradient algorithm
    (below) and offload (``config_ranges.check_offload``)."""
    if p.algorithm not in ("native", "auto"):  # auto: the pipeline's dp buckets stay native
        raise ValueError(f"parallel.algorithm = {p.algorithm!r} with parallel.pp = {p.pp} is not supported by "
                         f"shardwise train (the pipeline reduces its dp gradient buckets with the native "
                         f"collective); use --parallel.algorithm native or auto, or --parallel.pp 1")


def _pp_microbatches(p: ParallelConfig) -> int:
    """``parallel.pp_microbatches`` resolved (0: the largest divisor of micro_batch up to 2 × pp; a multiple of pp
    for ``interleaved``); ``ValueError`` when micro_batch cannot be cut into that many equal micro-batches."""
    interleaved = p.pp_schedule == "interleaved"
    if p.pp_microbatches:
        m = p.pp_microbatches
        if p.micro_batch % m:
            divisors = [d for d in range(1, p.micro_batch + 1) if p.micro_batch % d == 0]
            raise ValueError(f"parallel.micro_batch = {p.micro_batch} must be divisible by parallel.pp_microbatches = "
                             f"{m} (each pipeline pass cuts micro_batch sequences into pp_microbatches equal "
                             f"micro-batches); use --parallel.pp_microbatches from {divisors} or a micro_batch that is "
                             f"a multiple of {m}")
        return m
    fits = [d for d in range(1, min(p.micro_batch, 2 * p.pp) + 1)
            if p.micro_batch % d == 0 and (not interleaved or d % p.pp == 0)]
    if not fits:
        raise ValueError(f"parallel.pp_schedule = 'interleaved' needs pipeline micro-batches in a multiple of "
                         f"parallel.pp = {p.pp}, but parallel.micro_batch = {p.micro_batch} cannot be cut into "
                         f"{p.pp} equal parts; use --parallel.micro_batch {p.pp * max(1, -(-p.micro_batch // p.pp))}")
    return max(fits)


def _check_pipeline(config: Config, *, cut: bool = True) -> int:
    """Validate the pipeline fields with ``sw.pipeline``'s own checks (schedule, micro-batches, stages; pure, the
    model is built on the meta device); returns the resolved ``pp_microbatches`` (0 when pp == 1). ``cut=False``
    (``validate(launch=False)``): ``pp_microbatches`` is not derived from cutting ``micro_batch`` (0 stays 0)."""
    from ..parallel.pipeline.schedules import SCHEDULES, get_schedule

    p = config.parallel
    if p.pp_schedule not in SCHEDULES:
        raise _unknown("parallel.pp_schedule", p.pp_schedule, list(SCHEDULES))
    _positive(("parallel.pp_chunks", p.pp_chunks))
    if p.pp_microbatches < 0:
        raise ValueError(f"parallel.pp_microbatches = {p.pp_microbatches} must be >= 0 (0 means: infer it)")
    if p.pp == 1:
        given = [(k, v) for k, v, default in (("pp_chunks", p.pp_chunks, 1), ("pp_split", p.pp_split, ()),
                                              ("pp_microbatches", p.pp_microbatches, 0)) if v != default]
        if given:
            raise ValueError(f"parallel.{given[0][0]} = {given[0][1]!r} only applies to pipeline parallelism, but "
                             f"parallel.pp = 1; set --parallel.pp 2 (or more), or drop parallel.{given[0][0]}")
        return 0
    m = _pp_microbatches(p) if cut else p.pp_microbatches
    try:
        get_schedule(p.pp_schedule, p=p.pp, m=m or p.pp, chunks=p.pp_chunks)  # m unknown yet (0): pp checks the rest
    except ValueError as exc:
        raise ValueError(f"parallel.pp_schedule = {p.pp_schedule!r} with parallel.pp = {p.pp}, parallel.pp_chunks = "
                         f"{p.pp_chunks}, parallel.pp_microbatches = {m} (p = pp, m = pp_microbatches): "
                         f"{exc}") from None
    from ..parallel.pipeline.stage import build_stages

    model = meta_model(config.model)  # names and parameter counts only: nothing is allocated
    try:
        build_stages(model, p.pp * p.pp_chunks, list(p.pp_split) or None)
    except ValueError as exc:
        raise ValueError(f"parallel.pp = {p.pp} × parallel.pp_chunks = {p.pp_chunks} stages, parallel.pp_split = "
                         f"{list(p.pp_split)}, model.n_layer = {config.model.n_layer}: {exc}") from None
    return m
