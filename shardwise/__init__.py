"""shardwise: train one PyTorch model on many devices as if they were one.

This module re-exports the public API and nothing else; the contract is ARCHITECTURE.md, "Public API": every
name in ``shardwise.__all__`` and in the ``__all__`` of the public submodules ``shardwise.comm``,
``shardwise.models``, ``shardwise.planner`` and ``shardwise.schedules``. Any other module is internal and may
move (``tests/unit/test_public_api.py`` checks that the docs and examples use only these names).

    import shardwise as sw
    sw.init()
    mesh = sw.Mesh(dp=2, tp=2)
    model = sw.parallelize(model, mesh, sw.gpt_plan(config), axis="tp")

One name per idea; the old names stay as aliases of the same objects: ``Replicate`` (``Broadcast``, the SBP
``B``), ``ParallelizePlan`` (``Plan``: what ``sw.auto`` returns and ``sw.parallelize`` takes) and, in the
planner, ``sw.planner.Layout`` (``sw.planner.Plan``: a dp × tp × pp layout as plain data).
"""

# public submodules
from . import comm, models, planner, schedules
# processes and meshes
from .world import World, init, shutdown
from .mesh import Mesh, MeshLayout
# SBP global tensors
from .sbp import Broadcast, GlobalTensor, Partial, Replicate, Split, distribute, parse_sbp, to_global
# strategies
from .parallel.data.data_parallel import DataParallel
from .parallel.common.activation_checkpointing import checkpoint_layers, checkpoint_report
from .parallel.common.mixed_precision import MixedPrecision
from .parallel.common.compile import CompileStats, compile, compile_stats
from .parallel.tensor.apply_plan import (ColumnParallel, ContextParallel, QKVParallel, RowParallel, SequenceParallel,
                                         VocabParallel, gpt_plan, parallelize, vocab_parallel_cross_entropy)
from .parallel.expert.style import ExpertParallel
from .parallel.zero.wrap import zero
from .parallel.pipeline.build import Pipeline, pipeline
from .parallel.auto import ParallelizePlan, Plan, auto
from .parallel.context import SeqLayout, context_parallel, ring_attention, shard_sequence, unshard_sequence
# models larger than one device: built on meta, materialised in shards
from .parallel.common.materialize import materialize_model as materialize
from .parallel.common.init_rules import Constant, Normal, Uniform
from .checkpoint.hf_dir import load_pretrained
# fine-tuning: LoRA adapters on a frozen base (peft's layout and keys)
from .models.lora import LoRAConfig, apply_lora, lora_state_dict, merge_lora
# state and accounting
from .checkpoint import full_state_dict
from .parallel.common.memory import memory_report
# data and inference
from .data.prepared import open_prepared
from .models.generate import generate

__version__ = "0.1.0"
"""The package version (also ``pyproject.toml``)."""

__all__ = [
    # public submodules: collectives, reference models, the planner (pure cost model and search), pipeline schedules
    "comm", "models", "planner", "schedules",
    # processes and meshes
    "init", "shutdown", "World", "Mesh", "MeshLayout",
    # SBP global tensors (Broadcast: the old name of Replicate, same class; both print as B)
    "Split", "Replicate", "Broadcast", "Partial", "parse_sbp", "GlobalTensor", "distribute", "to_global",
    # data parallelism and what every strategy shares
    "DataParallel", "MixedPrecision", "checkpoint_layers", "checkpoint_report",
    # regional torch.compile (each transformer block), composing with every layout; its cost and recompiles
    "compile", "compile_stats", "CompileStats",
    # tensor parallelism: styles, the GPT plan, the loss over vocabulary-split logits
    "parallelize", "ColumnParallel", "RowParallel", "VocabParallel", "QKVParallel", "SequenceParallel", "gpt_plan",
    "vocab_parallel_cross_entropy",
    # mixtures of experts: experts split over an axis whose ranks hold the same tokens
    "ExpertParallel",
    # ZeRO and pipelines
    "zero", "pipeline", "Pipeline",
    # context parallelism: ring attention over a sequence split along one mesh axis
    "context_parallel", "shard_sequence", "unshard_sequence", "SeqLayout", "ring_attention",
    "ContextParallel",
    # automatic layouts (Plan: the old name of ParallelizePlan, same class)
    "auto", "ParallelizePlan", "Plan",
    # models larger than one device: built on meta, materialised in shards
    "materialize", "load_pretrained", "Normal", "Uniform", "Constant",
    # fine-tuning: LoRA adapters on a frozen base, split with their base layer in every layout
    "LoRAConfig", "apply_lora", "merge_lora", "lora_state_dict",
    # state and accounting
    "full_state_dict", "memory_report",
    # data: datasets written by shardwise prepare (memory-mapped token shards)
    "open_prepared",
    # inference: sampling text from a model on one device (KV cache)
    "generate",
    "__version__",
]
