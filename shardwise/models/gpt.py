"""Reference GPT (decoder-only transformer, GPT-2 layout) with no parallel code inside.

Every parallel strategy is checked against this model on one device: same seed → same weights → same
numbers. Parameter names are part of the contract (plans address modules by name, e.g.
``blocks.*.mlp.fc``), so the module tree is fixed:

    wte, wpe, drop, blocks[i].{ln_1, attn.{qkv, proj}, ln_2, mlp.{fc, proj}}, ln_f, lm_head

``lm_head.weight`` *is* ``wte.weight`` when ``tie_weights`` is set (one Parameter, two uses), as in GPT-2.
Shapes below: ``b`` batch, ``t`` sequence length, ``h`` = ``n_embd``, ``nh`` heads, ``hd`` = h / nh,
``v`` vocabulary.

The model carries what parallel strategies need to know about it, as plain data: its tensor-parallel plan
(``GPT.tensor_parallel_plan``) and where it may be cut into pipeline stages (``GPT.pipeline_units``). The
strategies ask for these (``shardwise.parallel`` never imports this module); the forward pass stays
single-device code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..parallel.common.init_rules import Constant, InitRule, Normal
from ..parallel.common.materialize import draw_seed, init_from_rules
from ..parallel.context.documents import Documents, active_documents, document_attention, documents_from_tokens
from ..parallel.pipeline.stage import Unit
from ..parallel.tensor.styles import (ColumnParallel, QKVParallel, RowParallel, SequenceParallel, Style,
                                      VocabParallel)
from .kv_cache import KVCache, cached_attention
from .moe import MoE, MoESettings, check_moe_config, moe_init_rule, moe_layer

__all__ = ["GPTConfig", "GPT", "Block", "CausalSelfAttention", "MLP", "lm_loss", "synthetic_batch"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a GPT. Frozen and validated at construction; presets via ``GPTConfig.preset(name)``.

    Also the ``[model]`` section of the training config (``shardwise.runtime.config_schema.ModelConfig`` is this
    class): the field docstrings below are what ``shardwise train --help`` lists for ``--model.*``.
    """

    vocab_size: int = 256
    """Token ids; 256 for the byte-level tokeniser, at least max token + 1 for a ``.bin`` file."""
    block_size: int = 64
    """Sequence length of every training window (and rows of the position embedding)."""
    n_layer: int = 2
    """Transformer blocks."""
    n_head: int = 2
    """Attention heads per block; must divide ``n_embd`` and be divisible by ``parallel.tp``."""
    n_embd: int = 64
    """Hidden width."""
    dropout: float = 0.0
    """Dropout probability (0 keeps every layout bit-comparable)."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers."""
    tie_weights: bool = True
    """Share the token embedding with the output head (GPT-2 style)."""
    n_experts: int = 0
    """Mixture of experts: routed experts per MoE layer (0 = a dense MLP everywhere). Each MoE layer's MLP is
    a router plus ``n_experts`` SwiGLU experts (``shardwise.models.moe``)."""
    top_k: int = 2
    """Experts each token is sent to (1 ≤ top_k ≤ n_experts)."""
    moe_ffn: int = 0
    """Width of one expert; 0 = 4·n_embd / top_k (the dense MLP's compute per token, split over top_k)."""
    n_shared_experts: int = 0
    """Experts every token passes through besides the routed ones (one SwiGLU of n_shared_experts · moe_ffn)."""
    router: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over the experts (Mixtral, Qwen) or a sigmoid per expert (DeepSeek-V3)."""
    router_renorm: bool = True
    """Divide the chosen top_k scores by their sum (Mixtral, Qwen3-MoE, DeepSeek-V3); off: the raw scores."""
    moe_aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (per sequence, Switch form; 0 = off)."""
    moe_bias_rate: float = 0.0
    """Auxiliary-loss-free balancing: after each step every expert's selection-only bias moves by this much
    toward an even load (DeepSeek-V3 uses 0.001); 0 = off."""
    capacity_factor: float = 0.0
    """0 = dropless (the default); c > 0: each expert takes at most ceil(c·top_k·T/n_experts) assignments of each
    sequence of T tokens, the earliest positions first, and drops the rest (the same on every layout)."""
    moe_every: int = 1
    """Every moe_every-th layer (counted after moe_first_dense) is an MoE layer; the others stay dense."""
    moe_first_dense: int = 0
    """The first this-many layers keep a dense MLP (DeepSeek-V3's first_k_dense_replace)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                f"choose n_embd as a multiple of n_head, e.g. n_embd={self.n_head * max(1, self.n_embd // self.n_head)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.n_experts:
            check_moe_config(self)

    @staticmethod
    def preset(name: str) -> "GPTConfig":
        """A named configuration: ``gpt-tiny`` (the defaults, ~0.1M params), ``gpt-small`` (~3.3M),
        ``gpt2-124m`` (the GPT-2 small shape, 124M with tied weights)."""
        if name not in _PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; choose one of {sorted(_PRESETS)}")
        return GPTConfig(**_PRESETS[name])

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` (0-based) has an MoE block instead of the dense MLP."""
        return moe_layer(i, self.n_experts, self.moe_first_dense, self.moe_every)

    def moe_settings(self) -> MoESettings:
        """The MoE block's settings (``n_experts`` > 0)."""
        ffn = self.moe_ffn or max(1, 4 * self.n_embd // self.top_k)
        return MoESettings(n_experts=self.n_experts, top_k=self.top_k, hidden=self.n_embd, ffn=ffn,
                           shared_ffn=self.n_shared_experts * ffn, router=self.router, renorm=self.router_renorm,
                           aux_coef=self.moe_aux_loss_coef, bias_rate=self.moe_bias_rate,
                           capacity_factor=self.capacity_factor)

    def to_dict(self) -> dict[str, object]:
        """Plain-data form (for plans, checkpoints and JSON)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def tensor_parallel_plan(self, sequence_parallel: bool = False) -> dict[str, Style]:
        """The Megatron plan for a GPT of this shape: vocab-parallel embedding and (tied) head, head-aware
        qkv, column → row pairs in attention and MLP; with sequence parallelism also the norms and the position
        embedding (its (t, h) output sliced on the sequence). Lives on the config because it depends on the
        shape only (``n_head``), so a plan can be made before the model is built."""
        plan: dict[str, Style] = {
            "wte": VocabParallel(), "lm_head": VocabParallel(),
            "blocks.*.attn.qkv": QKVParallel(self.n_head), "blocks.*.attn.proj": RowParallel(),
            "blocks.*.mlp.fc": ColumnParallel(), "blocks.*.mlp.proj": RowParallel()}
        if sequence_parallel:
            plan.update({"wpe": SequenceParallel(slice_output=0), "blocks.*.ln_*": SequenceParallel(),
                         "ln_f": SequenceParallel()})
        return plan


_PRESETS: dict[str, dict[str, object]] = {
    "gpt-tiny": {},
    "gpt-small": {"block_size": 256, "n_layer": 4, "n_head": 4, "n_embd": 256},
    "gpt2-124m": {"vocab_size": 50257, "block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768},
}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused ``qkv`` projection ``h → 3h`` and an output ``proj``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def _heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        qkv = self.qkv(x)
        # Sizes come from qkv's output so a tensor-parallel qkv (whole heads per rank, ``n_head`` lowered to
        # the local count) runs this code unchanged: there h is this rank's width, not n_embd.
        b, t, h = qkv.size(0), qkv.size(1), qkv.size(2) // 3
        # (b, t, h) @ (h, 3h) -> three (b, t, h) -> (b, nh, t, hd) each
        q, k, v = qkv.split(h, dim=2)
        q, k, v = (z.view(b, t, self.n_head, h // self.n_head).transpose(1, 2) for z in (q, k, v))
        return q, k, v

    def forward(self, x: Tensor, documents: Documents | None = None) -> Tensor:
        q, k, v = self._heads(x)
        p = self.dropout if self.training else 0.0
        if documents is not None:  # packed documents: each attends within itself (documents.py)
            y = document_attention(q, k, v, documents, dropout_p=p)
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        # (b, nh, t, hd) -> (b, t, h); sizes from y, not x: under sequence parallelism x holds t / tp positions and
        # qkv gathers the whole sequence
        y = y.transpose(1, 2).contiguous().view(y.size(0), y.size(2), -1)
        return self.resid_drop(self.proj(y))

    def decode(self, x: Tensor, cache: KVCache, layer: int) -> Tensor:
        """``forward`` of ``x`` (b, t, h) at positions ``cache.length ..``: its keys/values are appended to
        ``cache`` as ``layer``'s and the queries attend to every cached position. No dropout (inference)."""
        q, k, v = self._heads(x)
        past = cache.length
        k, v = cache.append(layer, k, v)  # (b, nh, past + t, hd)
        y = cached_attention(q, k, v, past)  # (b, nh, t, hd)
        return self.proj(y.transpose(1, 2).contiguous().view(y.size(0), y.size(2), -1))


class MLP(nn.Module):
    """Position-wise feed-forward ``fc`` (h → 4h), GELU, ``proj`` (4h → h)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig, moe: bool = False) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MoE(config.moe_settings()) if moe else MLP(config)

    def forward(self, x: Tensor, documents: Documents | None = None) -> Tensor:
        h = self.ln_1(x)  # the attention is called with one input unless documents are masked (module hooks that
        x = x + (self.attn(h) if documents is None else self.attn(h, documents))  # count inputs: torch's TP)
        return x + self.mlp(self.ln_2(x))

    def decode(self, x: Tensor, cache: KVCache, layer: int) -> Tensor:
        """``forward`` with attention over ``cache`` (``CausalSelfAttention.decode``)."""
        x = x + self.attn.decode(self.ln_1(x), cache, layer)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, final LayerNorm, linear head to vocabulary logits.

    Initialisation is deterministic given ``torch.manual_seed`` (one draw fixes ``init_seed``) and independent
    of the layout (``param_init``): every Linear/Embedding weight is N(0, 0.02), biases zero, LayerNorms
    identity; the projections that write into the residual stream (``attn.proj``, ``mlp.proj``) use std
    0.02 / sqrt(2 · n_layer) so the residual's variance does not grow with depth (GPT-2 paper, section 2.3).
    Built under ``torch.device("meta")`` nothing is allocated; the strategies materialise it in shards.

    ``sequence_layout`` (None: the tokens of ``forward`` are at positions ``0 .. t-1``): when set, an object whose
    ``positions(t, device)`` gives the (t,) global positions of the local tokens, which ``wpe`` embeds (context
    parallelism, where a rank holds chunks of the sequence). ``decode`` ignores it.

    ``document_eos_id`` (None: off): packed documents separated by this EOS id attend only within themselves and
    their positions (``wpe``) restart per document (``parallel/context/documents.py``); ``forward`` derives the
    layout from its token ids.
    """

    sequence_layout = None
    document_eos_id: int | None = None

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT expects a GPTConfig, got {type(config).__name__}; "
                            "use GPTConfig(...) or GPTConfig.preset(name)")
        self.init_seed = draw_seed()  # first: submodules' own default init consumes the RNG too
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, config.is_moe_layer(i)) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            # One Parameter used twice: its gradient is the sum of the embedding and the head contributions.
            self.lm_head.weight = self.wte.weight
        if not self.wte.weight.is_meta:  # on the meta device the strategies draw each rank's pieces instead
            init_from_rules(self, self.init_seed)

    def param_init(self, name: str) -> InitRule | None:
        """How parameter ``name`` starts (plain data; see the class docstring). The values are a function of
        ``(init_seed, name, element)`` only, so a layout that materialises a meta-device GPT in shards draws
        exactly the elements one device holds."""
        module_name, _, attr = name.rpartition(".")
        module = self.get_submodule(module_name)
        if attr == "bias":
            return Constant(0.0)
        if isinstance(module, nn.LayerNorm):
            return Constant(1.0)
        moe_rule = moe_init_rule(module, attr, 0.02, 0.02 / math.sqrt(2 * self.config.n_layer))
        if moe_rule is not None:
            return moe_rule
        if isinstance(module, (nn.Linear, nn.Embedding)):
            residual = module_name.endswith(("attn.proj", "mlp.proj", "shared_expert.down_proj"))
            return Normal(0.0, 0.02 / math.sqrt(2 * self.config.n_layer) if residual else 0.02)
        return None

    def forward(self, idx: Tensor, documents: Documents | None = None) -> Tensor:
        """``idx`` (b, t) int64 token ids → logits (b, t, v). Raises ``ValueError`` if t > block_size.
        ``documents``: the packed-document layout (default: derived from ``idx`` when ``document_eos_id`` is set)."""
        if idx.dim() != 2:
            raise ValueError(f"GPT input must be (batch, seq) token ids, got shape {tuple(idx.shape)}")
        b, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(
                f"sequence length {t} exceeds block_size {self.config.block_size}; "
                f"crop the input to at most {self.config.block_size} tokens or build the model with a larger block_size")
        documents = documents if documents is not None else self.documents_of(idx)
        # (b, t, h) + (t, h) broadcast over the batch, or + (b, t, h) with per-document positions
        x = self.drop(self.wte(idx) + self.wpe(self._positions(t, idx.device, documents)))
        for block in self.blocks:
            x = block(x) if documents is None else block(x, documents)
        return self.lm_head(self.ln_f(x))

    def documents_of(self, idx: Tensor) -> Documents | None:
        """The packed-document layout of ``idx`` (None when ``document_eos_id`` is not set)."""
        eos = self.document_eos_id
        return None if eos is None else documents_from_tokens(idx, eos, self.sequence_layout)

    def _positions(self, t: int, device: torch.device, documents: Documents | None = None) -> Tensor:
        """(t,) positions of the local tokens: ``0 .. t-1``, or ``sequence_layout``'s when set; (b, t) positions
        inside each token's document with ``documents``."""
        if documents is not None:
            return documents.positions
        layout = self.sequence_layout
        if layout is None:
            return torch.arange(t, device=device)
        pos = layout.positions(t, device)
        if pos.shape != (t,):
            raise ValueError(f"GPT.sequence_layout.positions({t}, ...) must have shape ({t},), got {tuple(pos.shape)}")
        return pos

    def decode(self, idx: Tensor, cache: KVCache) -> Tensor:
        """``forward`` of the tokens ``idx`` (b, t) that follow the ``cache.length`` positions already in ``cache``
        → logits (b, t, v); their keys/values join the cache. With an empty cache this is ``forward`` (the
        prefill); then one token per call decodes at the cost of one position. ``ValueError`` past
        ``block_size``."""
        past, t = cache.length, idx.size(-1)
        if idx.dim() != 2 or past + t > self.config.block_size:
            raise ValueError(f"GPT.decode takes (batch, seq) token ids with cached + new positions <= block_size "
                             f"{self.config.block_size}, got shape {tuple(idx.shape)} after {past} cached; generate "
                             f"fewer tokens or use a model with a larger block_size")
        pos = torch.arange(past, past + t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (b, t, h) + (t, h)
        for i, block in enumerate(self.blocks):
            x = block.decode(x, cache, i)
        cache.advance(t)
        return self.lm_head(self.ln_f(x))

    def num_params(self) -> int:
        """Number of unique parameter elements (a tied weight counts once)."""
        return sum(p.numel() for p in self.parameters())  # parameters() already de-duplicates

    def tensor_parallel_plan(self, sequence_parallel: bool = False) -> dict[str, Style]:
        """This model's plan for ``sw.parallelize`` (see ``GPTConfig.tensor_parallel_plan``)."""
        return self.config.tensor_parallel_plan(sequence_parallel)

    def pipeline_units(self) -> list[Unit]:
        """Where ``sw.pipeline`` may cut this model: ``wte`` runs ``drop(wte(idx) + wpe(positions))`` (modules
        ``wte``, ``wpe``, ``drop``), then one unit per block ``blocks.0`` ... ``blocks.{n-1}``, then ``ln_f`` runs
        ``lm_head(ln_f(x))`` (modules ``ln_f``, ``lm_head``): exactly ``forward`` cut at block boundaries.

        Modules are read when called, so a model whose layers were replaced (``sw.parallelize``) is cut with
        its replacements."""
        wte, wpe, drop, ln_f, head = self.wte, self.wpe, self.drop, self.ln_f, self.lm_head
        block_size, positions = self.config.block_size, self._positions

        def embed(idx: Tensor) -> Tensor:
            if idx.dim() != 2 or idx.size(1) > block_size:
                raise ValueError(f"GPT input must be (batch, seq) token ids with seq <= block_size {block_size}, "
                                 f"got shape {tuple(idx.shape)}")
            # (b, t, h) + (t, h), or (b, t, h) with the micro-batch's documents (microbatch_context)
            return drop(wte(idx) + wpe(positions(idx.size(1), idx.device, active_documents())))

        units = [Unit("wte", embed, (("wte", wte), ("wpe", wpe), ("drop", drop)))]
        units += [Unit(f"blocks.{i}", _with_documents(blk), ((f"blocks.{i}", blk),)) for i, blk in enumerate(self.blocks)]
        units.append(Unit("ln_f", lambda x: head(ln_f(x)), (("ln_f", ln_f), ("lm_head", head))))
        return units


def _with_documents(block: nn.Module) -> "Callable[[Tensor], Tensor]":
    """A pipeline unit running ``block`` with the micro-batch's documents, if any (a unit takes one tensor)."""
    def run(x: Tensor) -> Tensor:
        documents = active_documents()
        return block(x) if documents is None else block(x, documents)
    return run


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy over all (b, t) positions. ``logits`` (b, t, v), ``targets`` (b, t)."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree; "
                         "logits must be targets.shape + (vocab,)")
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def synthetic_batch(batch: int, seq: int, vocab: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """A reproducible random token batch: ``idx`` (batch, seq) and ``targets`` = ``idx`` shifted left by one.

    Drawn as one (batch, seq + 1) stream so targets are the true next tokens (the model can learn them
    only through memorisation — enough for parity tests and benchmarks, with no downloads).
    """
    if batch < 1 or seq < 1 or vocab < 1:
        raise ValueError(f"synthetic_batch needs positive sizes, got batch={batch}, seq={seq}, vocab={vocab}")
    stream = torch.randint(0, vocab, (batch, seq + 1), generator=generator, dtype=torch.int64)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()
