"""The training configuration's schema: one frozen keyword-only dataclass per section, a docstring per field,
and the named presets. Parsing, overrides and validation live in ``config.py``."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from ..models.gpt import GPTConfig

__all__ = ["ModelConfig", "DataConfig", "OptimizerConfig", "ParallelConfig", "TrainConfig", "LoRASection", "DebugConfig",
           "Config", "PRESETS", "describe_fields"]


@dataclass(frozen=True, kw_only=True)
class ModelConfig(GPTConfig):
    """The ``[model]`` section: the reference GPT's own config (its fields, defaults, docstrings and shape checks
    live in ``shardwise.models.gpt``) plus ``hf_config``. With ``hf_config`` set, the model is the Llama-family
    decoder of that file (``shardwise.models.llama``) and ``vocab_size``, ``n_layer``, ``n_head``, ``n_embd``,
    ``tie_weights``, ``bias`` and ``dropout`` are filled from it (``model_build.resolve_hf``); ``block_size`` stays the
    training sequence length. ``runtime/model_build.py`` builds either model."""

    hf_config: str = ""
    """Path of a Hugging Face ``config.json`` (model_type llama, mistral or qwen2): train that decoder, built from
    the config with random weights (nothing is downloaded); its shape fields replace model.n_layer etc."""
    pretrained: str = ""
    """A Hugging Face model directory (``config.json`` + ``model.safetensors``, or sharded files with
    ``model.safetensors.index.json``) to start from: Llama, Mistral, Qwen2, or GPT-2 (the reference GPT's own
    ``shardwise export --format hf``). Its config sets the model's shape; each rank reads only its slices."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where tokens come from and how many make a step."""

    path: str = ""
    """A dataset directory written by ``shardwise prepare`` (memory-mapped token shards, their index and tokenizer),
    a text file (byte-level tokens) or a pre-tokenized uint16 ``.bin``; empty = the built-in generated corpus."""
    format: Literal["auto", "text", "bin", "prepared"] = "auto"
    """``auto``: a directory is a prepared dataset, ``.bin`` files are uint16 tokens, anything else is text."""
    val_path: str = ""
    """Validation data (same kinds as ``path``); empty = the validation split of a prepared ``path`` (none for a
    file). Read only when ``train.eval_every`` > 0."""
    global_batch: int = 0
    """Sequences per optimizer step over all ranks (= micro_batch × grad_accum × dp); 0 = 16 × max(dp, 2) (32 up to
    dp = 2), raised to the next multiple of dp that a given micro_batch, grad_accum and the pipeline divide."""
    shuffle: bool = True
    """Reshuffle the windows every epoch (seeded by ``train.seed`` + epoch)."""
    document_mask: Literal["auto", "true", "false"] = "auto"
    """Packed documents (EOS-separated) attend only within themselves and their positions restart per document.
    ``auto``: on for fine-tuning data (prepared with a loss mask, ``--sft``), off for pretraining text."""


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Optimizer and learning-rate schedule (linear warmup, then cosine decay to ``min_lr``)."""

    name: Literal["adamw", "sgd"] = "adamw"
    """Optimizer; weight decay applies to matrices (dim ≥ 2) only."""
    lr: float = 3e-3
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = 3e-4
    """Learning rate at the last step of the cosine decay."""
    warmup_steps: int = 50
    """Steps of linear warmup from ~0 to ``lr``."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """After warmup: cosine decay to ``min_lr`` over the remaining steps, or constant ``lr``."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW) / L2 (SGD) on matrices."""
    beta1: float = 0.9
    """AdamW first-moment decay (SGD: momentum)."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    clip_grad_norm: float = 0.0
    """Clip the global gradient norm (over every rank's shards, as one device would) to this value before each
    step; the norm is logged every step. 0 = no clipping."""
    implementation: Literal["auto", "fused", "foreach", "loop"] = "auto"
    """How the optimizer's update runs: ``fused`` (one kernel over all parameters; CUDA), ``foreach`` (batched
    per-op kernels) or ``loop`` (one parameter at a time). ``auto``: fused on CUDA where every parameter allows
    it, foreach otherwise. The three agree to rounding (fused may differ in the last bits)."""


OLD_SPELLINGS: dict[str, dict[Any, str]] = {"parallel.activation_checkpointing": {  # it was a bool
    True: "full", False: "none", "true": "full", "false": "none", "1": "full", "0": "none"},
    "data.document_mask": {True: "true", False: "false", "1": "true", "0": "false", "yes": "true", "no": "false"}}
"""Values a field accepted before it became a choice, and what they mean now (``config._coerce``)."""


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the job is laid out over ranks: mesh ``(dp, tp)`` of ``nproc`` processes, ``(pp, dp, tp)`` with pp > 1."""

    nproc: int = 0
    """Processes on this node; 0 = one per GPU when CUDA is present, else 2 CPU processes."""
    auto: bool = False
    """Let the planner choose the layout (``shardwise plan``'s first choice that train runs); parallel fields
    given on the command line are pins."""
    dp: int = 0
    """Data-parallel ranks; 0 = nproc / (tp × pp)."""
    tp: int = 1
    """Tensor-parallel ranks (Megatron GPT plan); must divide ``model.n_head``."""
    pp: int = 1
    """Pipeline-parallel ranks (``sw.pipeline`` over the mesh axis ``pp``); dp × cp × tp × pp = nproc."""
    cp: int = 1
    """Context-parallel ranks: the sequence split over a ``cp`` mesh axis (ring attention; each rank holds 2 of
    2·cp chunks, so ``model.block_size`` must be divisible by 2·cp), parameters replicated over cp and gradients
    averaged over dp × cp. ``shardwise train``, ``verify``, ``predict`` and ``plan`` all take it."""
    ep: int = 1
    """Expert-parallel ranks (mixtures of experts): each MoE layer's experts split over ``ep`` ranks folded into
    the data-parallel ranks (dp × cp), tokens sent to their experts by all-to-all; ep must divide dp × cp and
    ``model.n_experts``. Dense layers keep their layout; expert gradients average over the dp × cp / ep ranks
    that hold the same experts."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule (``shardwise schedule`` shows each): gpipe, 1f1b, interleaved (pp_chunks ≥ 2), zb-h1, …"""
    pp_microbatches: int = 0
    """Pipeline micro-batches per pass (micro_batch / pp_microbatches sequences each); 0 = largest divisor ≤ 2·pp."""
    pp_chunks: int = 1
    """Model chunks per pipeline rank (``interleaved``: stage s on pp rank s % pp)."""
    pp_split: tuple[str, ...] = ()
    """Units that start pipeline stages 1, 2, … (e.g. ``blocks.2,ln_f``); empty = balanced by parameter count."""
    replicate: tuple[str, ...] = ()
    """Modules kept whole on every tensor-parallel rank instead of split over the vocabulary (data-parallel
    only): ``wte`` and/or ``lm_head``; with ``model.tie_weights`` they share one weight, so either keeps both
    whole (the planner's ``modules.wte=replicate`` pin)."""
    zero_stage: int = 0
    """ZeRO stage 0-3 over the dp axis (0 = plain data parallelism)."""
    micro_batch: int = 0
    """Sequences per forward/backward on one rank (with pp > 1: per pipeline pass of one dp replica); 0 = the
    largest divisor of global_batch / dp up to 16 that the pipeline can cut (global_batch / (grad_accum × dp) when
    grad_accum is given)."""
    grad_accum: int = 0
    """Forward/backward passes per step (pp > 1: pipeline steps); 0 = global_batch / (micro_batch × dp)."""
    offload: Literal["none", "optimizer", "params"] = "none"
    """ZeRO offload: ``optimizer`` keeps the fp32 master weights and optimizer state in host memory and steps there
    (ZeRO 1-3); ``params`` (ZeRO-3) also the parameter shards, copied to the device for each gather. On CPU ranks
    the host is the device: the same numbers and bytes."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward instead of storing them: ``full`` keeps only each block's input,
    ``selective`` keeps the weight matmuls' outputs and recomputes the rest (attention core, norms, activation
    function). ``true``/``false`` (the old boolean) mean full/none."""
    sequence_parallel: bool = False
    """Sequence parallelism inside tensor parallelism (Megatron): outside the column→row pairs the activations
    (norms, residuals, dropout) hold 1/tp of the sequence; needs tp > 1."""
    algorithm: Literal["native", "ring", "tree", "shm", "auto"] = "auto"
    """Collective algorithm of the gradient all-reduce, and of ZeRO's reduce-scatters and all-gathers. ``shm``:
    through shared memory (CPU ranks on one host). ``auto``: per message size the one with the lowest fitted
    cost where a calibration is loaded (``shardwise calibrate``); without one, native for the all-reduce and
    ZeRO's own default (our ring on CPU ranks, NCCL's on GPUs)."""
    calibration: str = ""
    """Hardware file of ``shardwise calibrate`` that ``algorithm = "auto"`` chooses from; empty = the local one
    (``~/.cache/shardwise/hardware-DEVICE-NPROC.json``) if it exists."""
    bucket_cap_mb: float = 25.0
    """Gradient bucket size of data parallelism (MB)."""
    async_tp: bool = False
    """Asynchronous tensor parallelism: tensor-parallel communication overlapped with the matmuls, equal to the
    unoverlapped path up to the order of floating-point sums (``parallel/tensor/overlap.py``). With
    ``sequence_parallel`` each column layer's all-gather and each row layer's reduce-scatter (and their backward
    conjugates) run as tp chunks on a ring, a chunk's transfer hidden under another chunk's matmul; without it
    the row layer's all-reduce runs in max(tp, 2) pieces, each under the next piece's matmul, and the column
    layer's backward all-reduce under its weight-gradient matmul. Needs tp > 1."""

    def __post_init__(self) -> None:
        # the field was a bool: True/False (Python configs, saved runs) still mean full/none
        if isinstance(self.activation_checkpointing, bool):
            object.__setattr__(self, "activation_checkpointing", "full" if self.activation_checkpointing else "none")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The loop: length, intervals, seed, where results go."""

    name: str = "gpt-tiny"
    """Run name; the run directory defaults to ``./runs/NAME``. Not given: the preset's, or for a model from files
    the ``model.pretrained`` directory's name / the ``model.hf_config`` file's (``shardwise train`` names it)."""
    out_dir: str = ""
    """Run directory (metrics, checkpoints, config); empty = ``./runs/NAME``."""
    steps: int = 1000
    """Optimizer steps in total (a resumed run continues up to this number)."""
    log_every: int = 50
    """Steps between progress updates of the summary line (metrics are written every step)."""
    ckpt_every: int = 250
    """Steps between periodic checkpoints (0 = only the final one)."""
    keep_checkpoints: int = 2
    """Checkpoints kept on disk (older ones are deleted after a successful save)."""
    save_frozen: bool = True
    """``false``: checkpoints leave out every frozen parameter (``requires_grad=False``: the pretrained base of a
    LoRA run), which a resume reads from ``model.pretrained`` again (``checkpoint/frozen.py``)."""
    seed: int = 1337
    """Seed of the weights, the data order and per-step RNG."""
    timeout_s: float = 60.0
    """Collective timeout of the training steps: a dead or hung peer becomes an error after this many seconds
    (start-up and checkpoint loading wait up to max(timeout_s, 300 s))."""
    nonfinite: Literal["stop", "skip"] = "stop"
    """A non-finite loss or gradient: ``stop`` the job naming the step and parameter (weights untouched, the last
    good checkpoint stays latest), or ``skip`` the step (counted) and stop after ``max_skipped`` in a row."""
    max_skipped: int = 3
    """With ``nonfinite = "skip"``: consecutive skipped steps after which the job stops."""
    max_restarts: int = 0
    """After a failure, restart all ranks up to this many times, resuming from the latest intact checkpoint."""
    precision: Literal["fp32", "bf16", "bf16-mixed"] = "fp32"
    """``bf16``: autocast compute (forward and loss) in bf16 with fp32 master weights, gradients and optimizer state
    in every layout (``shardwise.parallel.common.autocast``); ``fp32``: no autocast."""
    eval_every: int = 0
    """Steps between validation passes (forward only, every layout): ``val_loss`` and perplexity in metrics,
    progress line and summary; also after the last step. 0 = never."""
    eval_batches: int = 8
    """Global batches (``data.global_batch`` sequences each) per validation pass; the same ones every pass."""
    compile: bool = False
    """Regional ``torch.compile``: each transformer block compiled on its own, as torchtitan does, in every layout
    but context parallelism; equal to eager. Compile time and recompilations go in the summary."""
    compile_backend: str = "inductor"
    """``torch.compile`` backend of ``train.compile`` (``inductor``; ``aot_eager`` traces without generating
    kernels, for debugging)."""
    memory_check: bool = True
    """Refuse to launch, before any rank starts, a layout the planner predicts will not fit a device's memory (per
    rank the larger of the construction peak and the training peak, against the GPU's memory or, on CPU ranks, the
    host's physical RAM shared by the ranks on it); ``false`` launches anyway. ``parallel.auto`` always searches
    among layouts predicted to fit."""


@dataclass(frozen=True, kw_only=True)
class LoRASection:
    """LoRA fine-tuning (``shardwise.models.lora``): adapters on the targeted linear layers, everything else frozen."""

    r: int = 0
    """Adapter rank; 0 = no LoRA (full fine-tuning). With ``lora.init`` and r = 0 the adapter directory's rank."""
    alpha: float = 16.0
    """The update is scaled by alpha / r (peft's ``lora_alpha``)."""
    targets: str = "q_proj,v_proj"
    """Comma-separated module-name suffixes or fnmatch patterns of the nn.Linear layers to adapt (peft's
    ``target_modules``); e.g. ``q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj`` for every linear layer of a
    Llama decoder, ``qkv,proj,fc`` for the reference GPT (``attn.qkv``, ``attn.proj``, ``mlp.fc``, ``mlp.proj``)."""
    dropout: float = 0.0
    """Dropout on each adapter's input (peft's ``lora_dropout``)."""
    use_rslora: bool = False
    """Scale by alpha / sqrt(r) (rank-stabilised LoRA) instead of alpha / r."""
    init: str = ""
    """A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) to start the adapters from;
    its r, alpha and targets are used unless given here, and must agree when given."""


@dataclass(frozen=True, kw_only=True)
class DebugConfig:
    """Fault injection for tests of the framework itself (not for users)."""

    bug: Literal["none", "sum_grads"] = "none"
    """``sum_grads``: multiply the averaged gradients by dp (the classic sum-instead-of-mean bug)."""
    crash_in_save: int = 0
    """Raise inside the checkpoint save of this step, after the shards are written, before the rename."""
    kill_rank: int = -1
    """This rank exits abruptly (os._exit) at step ``kill_step``."""
    kill_step: int = 0
    """Step at which ``kill_rank`` dies."""
    hang: bool = False
    """``kill_rank`` hangs (sleeps) at ``kill_step`` instead of dying: its peers' collectives time out."""
    nonfinite_step: int = 0
    """Make the loss (and so the gradients) of this step NaN on ``nonfinite_rank`` (0 = never)."""
    nonfinite_rank: int = -1
    """Rank whose loss ``nonfinite_step`` poisons (-1: every rank)."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """Everything ``shardwise train`` needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shape."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data source and global batch."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and LR schedule."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Layout over ranks."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Loop, intervals, output."""
    lora: LoRASection = field(default_factory=LoRASection)
    """LoRA adapters (off unless lora.r or lora.init is set)."""
    debug: DebugConfig = field(default_factory=DebugConfig)
    """Fault injection (tests only)."""

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def run_dir(self) -> Path:
        """``train.out_dir``, or ``./runs/NAME`` under the working directory."""
        return Path(self.train.out_dir) if self.train.out_dir else Path("runs") / self.train.name


PRESETS: dict[str, dict[str, Any]] = {
    "gpt-tiny": {"train.name": "gpt-tiny"},
    "gpt-small": {"model.block_size": 256, "model.n_layer": 4, "model.n_head": 4, "model.n_embd": 256,
                  "parallel.micro_batch": 4, "data.global_batch": 16, "train.name": "gpt-small", "optimizer.lr": 1e-3,
                  "optimizer.min_lr": 1e-4},
}
"""Named bundles of dotted overrides (``--preset NAME``)."""


def describe_fields() -> list[tuple[str, str, str]]:
    """``(dotted key, default, docstring)`` of every field, for ``--help`` listings."""
    import ast
    import inspect

    out: list[tuple[str, str, str]] = []
    for f_section in fields(Config):
        section = f_section.name
        cls = typing.get_type_hints(Config)[section]
        docs: dict[str, str] = {}
        for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):  # inherited fields too
            body = ast.parse(inspect.getsource(klass)).body[0].body  # type: ignore[attr-defined]
            for node, nxt in zip(body, body[1:]):
                if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                    docs[node.target.id] = str(nxt.value.value)  # type: ignore[attr-defined]
        for f in fields(cls):
            out.append((f"{section}.{f.name}", repr(f.default), docs.get(f.name, "")))
    return out

