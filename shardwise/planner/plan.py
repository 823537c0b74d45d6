"""A parallel layout as plain data: ``Layout`` (round-trips through JSON; field names are the training config's
``parallel`` section where both have them). ``sw.planner.Plan`` is an alias of it, the name it had first.

Batch arithmetic (Megatron's convention): one *micro-batch* is ``micro_batch`` sequences through one forward
and backward; a data-parallel replica runs ``microbatches`` of them per pipeline flush (pp > 1) and
``grad_accum`` flushes (or, without a pipeline, passes) per optimizer step:
``global_batch = dp × grad_accum × micro_batch × microbatches``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping

__all__ = ["Layout", "Plan", "SCHEDULES", "CHECKPOINTING", "PRECISIONS"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2")
CHECKPOINTING = ("none", "full", "selective")
PRECISIONS = ("fp32", "bf16", "bf16-mixed")
OPTIMIZERS = ("adamw", "sgd-momentum", "sgd")
"""What the optimizer keeps per parameter element: AdamW two moments, SGD with momentum one buffer, plain SGD
nothing (``planner/memory.py``)."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How one training step is laid out over ``dp × cp × tp × pp`` devices."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    """Context-parallel ranks: each sequence split over a ``cp`` mesh axis (ring attention, 2 of ``2·cp``
    chunks per rank for causal balance); parameters are replicated over cp and gradients averaged (ZeRO sharded)
    over dp × cp. The sequence length must be divisible by ``2·cp``."""
    ep: int = 1
    """Expert-parallel ranks (mixtures of experts): folded into the ``dp × cp`` ranks, each of ``ep`` of them holds
    ``1/ep`` of every MoE layer's routed experts and tokens travel to their experts by all-to-all; ``ep`` must
    divide ``dp × cp`` (and the model's expert count, which ``predict`` checks). Expert gradients are averaged
    (ZeRO sharded) over the ``dp × cp / ep`` ranks that hold the same experts (``expert_group``)."""
    zero_stage: int = 0
    """ZeRO stage over dp: 1 shards optimizer state, 2 also gradients, 3 also parameters."""
    micro_batch: int = 1
    """Sequences per forward/backward (per pipeline micro-batch)."""
    grad_accum: int = 0
    """Passes (pp = 1) or pipeline flushes (pp > 1) per optimizer step; 0 = inferred from the global batch."""
    microbatches: int = 0
    """Pipeline micro-batches per flush (pp > 1); 0 = inferred (one flush per step)."""
    schedule: str = "1f1b"
    chunks: int = 1
    """Model chunks per pipeline rank (``interleaved``)."""
    activation_checkpointing: str = "none"
    """``none``, ``full`` (keep each layer's input, recompute the layer) or ``selective`` (keep the weight GEMMs'
    outputs, recompute the attention core and the elementwise operations: Korthikanti et al. 2022's idea)."""
    sequence_parallel: bool = False
    async_tp: bool = False
    """Tensor-parallel communication overlapped with the matmuls (``parallel.async_tp``): each collective cut
    into pieces that travel while other pieces' matmuls run (``planner/tp_overlap.py`` prices it). Needs tp > 1."""
    pp_split: tuple[str, ...] = ()
    """Names of the layers (model units) that start pipeline stages 1, 2, … (``pp × chunks - 1`` of them);
    empty = balanced by parameter count, as ``shardwise train`` cuts by default."""
    precision: str = "fp32"
    """``fp32``; ``bf16``: autocast over fp32 weights (what ``shardwise train`` runs); ``bf16-mixed``: bf16
    weights and gradients with fp32 master copies in the optimizer (ZeRO/Megatron accounting 2 + 2 + 12)."""
    optimizer: str = "adamw"
    """The optimizer's state per parameter (``OPTIMIZERS``): ``adamw`` (8 bytes in fp32), ``sgd-momentum`` (4),
    ``sgd`` (none); the fp32 master copy of ``bf16-mixed`` comes on top of each."""

    def __post_init__(self) -> None:
        if isinstance(self.pp_split, str):
            raise ValueError(f"Layout.pp_split must be a list of layer names, got the string {self.pp_split!r}; "
                             f"use [{self.pp_split!r}]")
        object.__setattr__(self, "pp_split", tuple(self.pp_split))
        if self.pp_split and len(self.pp_split) != self.pp * self.chunks - 1:
            raise ValueError(f"Layout.pp_split names {len(self.pp_split)} stage starts but pp × chunks = {self.pp} × "
                             f"{self.chunks} stages need {self.pp * self.chunks - 1}; give that many or none")
        for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch", "chunks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Layout.{name} must be an int >= 1, got {value!r}")
        for name in ("grad_accum", "microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Layout.{name} must be an int >= 0 (0 = inferred), got {value!r}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"Layout.ep = {self.ep} must divide dp × cp = {self.dp} × {self.cp} = {self.dp * self.cp} "
                             f"(expert parallelism is folded into the data-parallel ranks); use an ep among "
                             f"{[d for d in range(1, self.dp * self.cp + 1) if self.dp * self.cp % d == 0]}")
        if not isinstance(self.async_tp, bool):
            raise ValueError(f"Layout.async_tp must be a bool, got {self.async_tp!r}")
        if self.activation_checkpointing is True or self.activation_checkpointing is False:
            object.__setattr__(self, "activation_checkpointing", "full" if self.activation_checkpointing else "none")
        for name, allowed in (("schedule", SCHEDULES), ("activation_checkpointing", CHECKPOINTING),
                              ("precision", PRECISIONS), ("optimizer", OPTIMIZERS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Layout.{name} = {getattr(self, name)!r} is not one of {list(allowed)}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"Layout.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.schedule == "interleaved" and self.pp > 1 and self.chunks < 2:
            raise ValueError(f"Layout.schedule 'interleaved' needs chunks >= 2, got {self.chunks}; use '1f1b' for one "
                             f"chunk per rank")
        if self.chunks > 1 and self.schedule != "interleaved":
            raise ValueError(f"Layout.chunks = {self.chunks} needs schedule 'interleaved', got {self.schedule!r}")

    @property
    def devices(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def zero_group(self) -> int:
        """Ranks that average the gradients and over which ZeRO shards: dp × cp (cp ranks hold the same
        parameters and see different tokens of the same sequences)."""
        return self.dp * self.cp

    @property
    def expert_group(self) -> int:
        """Ranks that hold the same experts and average (ZeRO: shard) their gradients: ``dp × cp / ep``."""
        return self.dp * self.cp // self.ep

    def check_seq_len(self, seq_len: int) -> None:
        """``ValueError`` when context parallelism cannot split a sequence of ``seq_len`` tokens."""
        if self.cp > 1 and seq_len % (2 * self.cp):
            raise ValueError(f"Layout.cp = {self.cp} needs the sequence length divisible by 2·cp = {2 * self.cp} "
                             f"(2 chunks per cp rank), got {seq_len}; use a cp whose 2·cp divides {seq_len}")

    def resolved(self, global_batch: int) -> "Layout":
        """This plan with ``grad_accum`` (and ``microbatches`` for pp > 1) inferred from ``global_batch``;
        ``ValueError`` naming the fix when the batch does not divide."""
        per_replica, rest = divmod(global_batch, self.dp * self.micro_batch)
        if global_batch < 1 or rest or per_replica < 1:
            raise ValueError(f"global_batch = {global_batch} must be a positive multiple of dp × micro_batch = "
                             f"{self.dp} × {self.micro_batch} = {self.dp * self.micro_batch}; use a global batch of "
                             f"{max(1, global_batch // (self.dp * self.micro_batch) or 1) * self.dp * self.micro_batch}"
                             f" or another micro_batch")
        if self.pp == 1:
            accum = self.grad_accum or per_replica
            if accum != per_replica:
                raise ValueError(f"grad_accum = {self.grad_accum} disagrees with global_batch = {global_batch} = "
                                 f"dp × micro_batch × grad_accum = {self.dp} × {self.micro_batch} × {per_replica}")
            return replace(self, grad_accum=accum, microbatches=1)
        m = self.microbatches or (per_replica // self.grad_accum if self.grad_accum else per_replica)
        accum = self.grad_accum or per_replica // m
        if m * accum != per_replica:
            raise ValueError(f"microbatches × grad_accum = {m} × {accum} must equal global_batch / (dp × micro_batch) "
                             f"= {per_replica}")
        if self.schedule == "interleaved" and m % self.pp:
            raise ValueError(f"schedule 'interleaved' needs the micro-batches per flush ({m}) to be a multiple of "
                             f"pp = {self.pp}; use a global batch that is a multiple of dp × micro_batch × pp = "
                             f"{self.dp * self.micro_batch * self.pp}")
        return replace(self, grad_accum=accum, microbatches=m)

    def describe(self) -> str:
        """One line, e.g. ``dp=8 tp=8 pp=16 zero=1 mb=1 interleaved×2 ckpt=full sp bf16`` (``cp=N`` after dp
        when cp > 1, then ``ep=N`` when ep > 1, ``async-tp`` after ``sp`` when set)."""
        parts = [f"dp={self.dp}"] + ([f"cp={self.cp}"] if self.cp > 1 else []) + ([f"ep={self.ep}"] if self.ep > 1
                                                                                   else [])
        parts += [f"tp={self.tp}", f"pp={self.pp}"]
        if self.zero_stage:
            parts.append(f"zero={self.zero_stage}")
        parts.append(f"mb={self.micro_batch}")
        if self.pp > 1:
            parts.append(f"{self.schedule}" + (f"×{self.chunks}" if self.chunks > 1 else ""))
        if self.activation_checkpointing != "none":
            parts.append(f"ckpt={self.activation_checkpointing}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.async_tp:
            parts.append("async-tp")
        parts.append(self.precision)
        return " ".join(parts)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["pp_split"] = list(self.pp_split)
        if self.ep == 1:
            del data["ep"]  # a dense layout's record reads as it did before expert parallelism
        return data

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)

    @staticmethod
    def from_json(data: Mapping[str, Any] | str) -> "Layout":
        """Parse ``to_json``'s dictionary (or its JSON text); ``ValueError`` naming unknown fields."""
        if isinstance(data, str):
            data = json.loads(data)
        known = {f.name for f in fields(Layout)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Layout has no field(s) {unknown}; known fields: {sorted(known)}")
        return Layout(**dict(data))


Plan = Layout
"""The first name of ``Layout`` (``sw.planner.Plan``): the same class."""
