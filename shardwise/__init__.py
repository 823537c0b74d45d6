"""shardwise: train one PyTorch model on many devices as if they were one.

Public API re-exports only; the contract is ARCHITECTURE.md, "Public API".
"""

from . import comm, models, planner
from .checkpoint import full_state_dict
from .checkpoint.hf_dir import load_pretrained
from .mesh import Mesh, MeshLayout
from .models.generate import generate
from .parallel.common.activation_checkpointing import checkpoint_layers
from .parallel.auto import Plan, auto
from .parallel.data.data_parallel import DataParallel
from .parallel.common.init_rules import Constant, Normal, Uniform
from .parallel.common.materialize import materialize_model as materialize
from .parallel.common.memory import memory_report
from .parallel.common.mixed_precision import MixedPrecision
from .parallel.pipeline.build import Pipeline, pipeline
from .parallel.tensor.apply_plan import ColumnParallel, QKVParallel, RowParallel, SequenceParallel, VocabParallel, parallelize
from .parallel.zero.wrap import zero
from .sbp import Broadcast, GlobalTensor, Partial, Split, distribute, parse_sbp, to_global
from .runtime.prepared import open_prepared
from .world import World, init, shutdown

__version__ = "0.1.0"

__all__ = [
    # processes and meshes
    "init", "shutdown", "World", "Mesh", "MeshLayout", "comm",
    # SBP global tensors
    "Split", "Broadcast", "Partial", "parse_sbp", "GlobalTensor", "distribute", "to_global",
    # strategies
    "DataParallel", "checkpoint_layers", "parallelize", "ColumnParallel", "RowParallel", "VocabParallel",
    "QKVParallel", "SequenceParallel", "zero", "MixedPrecision", "pipeline", "Pipeline",
    # models larger than one device: built on meta, materialised in shards
    "materialize", "load_pretrained", "Normal", "Uniform", "Constant",
    # state and accounting
    "full_state_dict", "memory_report", "models", "__version__",
    # data: datasets written by shardwise prepare (memory-mapped token shards)
    "open_prepared",
    # inference: sampling text from a model on one device (KV cache)
    "generate",
    # planning (pure: no processes)
    "planner", "auto", "Plan",
]
