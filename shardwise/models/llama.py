"""A native Llama-family decoder (Llama, Mistral, Qwen2, Qwen3 and the mixtures of experts Mixtral, Qwen2-MoE,
Qwen3-MoE) built from a Hugging Face config, with no parallel code inside and no dependency on ``transformers``.

Parameter names are Hugging Face's, so a ``state_dict`` moves between this model and ``LlamaForCausalLM`` /
``MistralForCausalLM`` / ``Qwen2ForCausalLM`` with ``load_state_dict`` (the rotary table is computed, not a
buffer, exactly as HF's non-persistent ``inv_freq``)::

    model.embed_tokens, model.layers[i].{input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
    mlp.{gate,up,down}_proj}, model.norm, lm_head

An MoE layer's ``mlp`` is ``shardwise.models.moe.MoE`` (``llama_moe.py``), whose names are transformers 5's:
``mlp.gate.weight``, ``mlp.experts.{gate_up_proj,down_proj}``, ``mlp.shared_expert.*``, ``mlp.shared_expert_gate``
(the Hub files' per-expert layout is ``checkpoint/hf_map.py``'s business). Qwen3 types add
``self_attn.{q_norm,k_norm}`` (an RMSNorm over each head).

``lm_head.weight`` *is* ``model.embed_tokens.weight`` with ``tie_word_embeddings``. Shapes: ``b`` batch, ``t``
sequence, ``h`` hidden, ``nh`` query heads, ``nkv`` key/value heads, ``hd`` head_dim, ``f`` intermediate,
``v`` vocabulary. Numerics follow HF's: RMSNorm in fp32, rotary cos/sin computed in fp32 and cast to the
activations' dtype, ``scaled_dot_product_attention`` with a causal mask and the ``hd**-0.5`` scale.

Like ``GPT``, the model carries its tensor-parallel plan (``tensor_parallel_plan``) and its pipeline cut points
(``pipeline_units``) as plain data; strategies ask for them.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..parallel.common.init_rules import Constant, InitRule, Normal
from ..parallel.common.materialize import draw_seed, init_from_rules
from ..parallel.context.documents import Documents, active_documents, document_attention, documents_from_tokens
from ..parallel.pipeline.stage import Unit
from ..parallel.tensor.styles import ColumnParallel, RowParallel, SequenceParallel, Style, VocabParallel
from .hf_config import HFDecoderConfig
from .kv_cache import KVCache, cached_attention
from .llama_moe import feed_forward_plan, moe_block, moe_param_init

__all__ = ["Llama", "RMSNorm", "rotary_tables"]


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x²) + eps)``, normalised in fp32 and cast back before the scale (as HF)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotary_tables(t: int, c: HFDecoderConfig, device: torch.device, dtype: torch.dtype,
                  start: int = 0, positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(cos, sin)`` of positions ``start .. start+t-1``, each (t, hd): computed in fp32 outside autocast, cast to
    ``dtype``. Recomputed per call (a few thousand elements) so that no buffer enters the state dict or a pipeline
    stage. ``start``: the first position (decoding with a cache continues from the cache's length).
    ``positions``: (t,) integer positions to use instead (a sequence layout's tokens: context parallelism holds
    chunks of the sequence, not ``0 .. t-1``), or (b, t) per row (packed documents: the tables are then
    (b, 1, t, hd), broadcasting over heads); ``start`` is then ignored."""
    with torch.autocast(device_type=device.type, enabled=False):
        inv_freq = inverse_frequencies(c, device)
        if positions is None:
            pos = torch.arange(start, start + t, device=device, dtype=torch.float)
        else:
            if positions.shape[-1:] != (t,) or positions.dim() > 2:
                raise ValueError(f"rotary_tables: positions must have shape ({t},) or (batch, {t}), got "
                                 f"{tuple(positions.shape)}")
            pos = positions.to(device=device, dtype=torch.float)
        freqs = pos[..., None] * inv_freq  # (t, hd/2) or (b, t, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (t, hd) or (b, t, hd)
        if emb.dim() == 3:
            emb = emb.unsqueeze(1)  # (b, 1, t, hd): one table per row, shared by the heads
        return emb.cos().to(dtype), emb.sin().to(dtype)


def inverse_frequencies(c: HFDecoderConfig, device: torch.device) -> Tensor:
    """(hd/2,) rotary frequencies ``theta^(-2i/hd)``, scaled as ``rope_type`` says: ``linear`` divides all by the
    factor; ``llama3`` divides the long wavelengths (longer than the original context / low_freq_factor) by it,
    keeps the short ones (shorter than context / high_freq_factor) and interpolates in between."""
    hd = c.head_dim
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float, device=device) / hd))
    if c.rope_type == "linear":
        return inv_freq / c.rope_factor
    if c.rope_type != "llama3":
        return inv_freq
    context, low, high = c.rope_original_max_positions, c.rope_low_freq_factor, c.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / c.rope_factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / c.rope_factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, blended, scaled)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of ``x`` (b, heads, t, hd) with the half-split layout HF uses."""
    x1, x2 = x[..., : x.size(-1) // 2], x[..., x.size(-1) // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Grouped-query causal attention: ``nh`` query heads share ``nkv`` key/value heads (``nh / nkv`` each).

    The rotary tables are built here, from the queries' sequence length after the projections: under sequence
    parallelism the input holds ``t / tp`` positions and the column-parallel projections gather the whole
    sequence, so the positions are always those of the sequence attention sees. ``sequence_layout`` (None: the
    positions are ``0 .. t-1``): when set, an object whose ``positions(t, device)`` gives the (t,) global
    positions of the local tokens (context parallelism, where a rank holds chunks of the sequence)."""

    sequence_layout = None

    def __init__(self, c: HFDecoderConfig) -> None:
        super().__init__()
        self._hf = c  # plain attribute: not a module, not in the state dict
        self.head_dim, self.dropout = c.head_dim, c.attention_dropout
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        if c.qk_norm:  # Qwen3: RMSNorm over each head's hd features, before the rotary embedding
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def rotary(self, t: int, device: torch.device, dtype: torch.dtype,
               documents: Documents | None = None) -> tuple[Tensor, Tensor]:
        """``(cos, sin)`` (t, hd) of the ``t`` tokens attention sees: positions ``0 .. t-1``, or the
        ``sequence_layout``'s when set; with ``documents``, (b, 1, t, hd) of each token's place in its document."""
        layout = self.sequence_layout
        positions = None if layout is None else layout.positions(t, device)
        if documents is not None:
            positions = documents.positions
        return rotary_tables(t, self._hf, device, dtype, positions=positions)

    def _heads(self, x: Tensor, tables: tuple[Tensor, Tensor] | None = None,
               documents: Documents | None = None) -> tuple[Tensor, Tensor, Tensor]:
        hd = self.head_dim
        # Head counts come from the projections' outputs, so a tensor-parallel layer (whole heads per rank: nh/tp
        # query and nkv/tp key/value heads) runs this code unchanged; the groups stay aligned because both are
        # split into the same number of contiguous blocks. Batch and length too: under sequence parallelism the
        # projections gather the sequence that ``x`` holds a slice of.
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        b, t = q.size(0), q.size(1)
        q, k = q.view(b, t, -1, hd), k.view(b, t, -1, hd)
        if self._hf.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (b, nh, t, hd), (b, nkv, t, hd)
        v = v.view(b, t, -1, hd).transpose(1, 2)
        # the tables in the dtype of the attention's input, as HF's (the residual stream's, under autocast too)
        cos, sin = tables if tables is not None else self.rotary(t, x.device, x.dtype, documents)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def forward(self, x: Tensor, documents: Documents | None = None) -> Tensor:
        q, k, v = self._heads(x, documents=documents)
        p = self.dropout if self.training else 0.0
        if documents is not None:  # packed documents: each attends within itself (documents.py)
            y = document_attention(q, k, v, documents, dropout_p=p, enable_gqa=k.size(1) != q.size(1))
        elif _SDPA_GQA:  # the nkv-headed K/V go in as they are (context parallelism's ring then carries nkv heads)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                               enable_gqa=k.size(1) != q.size(1))
        else:
            k, v = _expand_groups(k, v, q.size(1))
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        # (b, nh, t, hd) -> (b, t, nh*hd) @ (nh*hd, h); sizes from y (the gathered sequence under SP)
        return self.o_proj(y.transpose(1, 2).reshape(y.size(0), y.size(2), -1))

    def decode(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int) -> Tensor:
        """``forward`` of ``x`` (b, t, h) at positions ``cache.length ..`` (``cos``/``sin`` of those positions):
        the rotated keys and the values are cached as ``layer``'s with their ``nkv`` heads (a GQA cache is
        ``nh / nkv`` times smaller) and the queries attend to every cached position. No dropout (inference)."""
        q, k, v = self._heads(x, (cos, sin))
        past = cache.length
        k, v = cache.append(layer, k, v)  # (b, nkv, past + t, hd)
        k, v = _expand_groups(k, v, q.size(1))
        y = cached_attention(q, k, v, past)
        return self.o_proj(y.transpose(1, 2).reshape(y.size(0), y.size(2), -1))


_SDPA_GQA = torch.__version__ >= "2.5"
"""Whether ``scaled_dot_product_attention`` takes ``enable_gqa`` (torch 2.5 on); before, K/V are expanded here."""


def _expand_groups(k: Tensor, v: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    """(b, nkv, t, hd) keys/values -> (b, nh, t, hd): kv head j serves query heads j*group .. (j+1)*group-1."""
    group = heads // k.size(1)
    if group > 1:
        return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return k, v


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, h → f → h."""

    def __init__(self, c: HFDecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-RMSNorm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``. The attention builds its own rotary
    tables, so a layer is a ``Tensor -> Tensor`` unit (pipeline stages, checkpointing). Layer ``i``'s ``mlp`` is
    an MoE block where the config says so (``HFDecoderConfig.is_moe_layer``)."""

    def __init__(self, c: HFDecoderConfig, i: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = moe_block(c) if c.is_moe_layer(i) else MLP(c)

    def forward(self, x: Tensor, documents: Documents | None = None) -> Tensor:
        h = self.input_layernorm(x)  # one input unless documents are masked (hooks that count inputs: torch's TP)
        x = x + (self.self_attn(h) if documents is None else self.self_attn(h, documents))
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int) -> Tensor:
        """``forward`` with attention over ``cache`` (``Attention.decode``); the caller gives the rotary tables of
        the new positions (one computation per step for all layers)."""
        x = x + self.self_attn.decode(self.input_layernorm(x), cos, sin, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """HF's ``LlamaModel`` tree (``embed_tokens``, ``layers``, ``norm``) so that keys carry the ``model.`` prefix."""

    def __init__(self, c: HFDecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Llama(nn.Module):
    """A Llama-family causal LM of ``config`` (``HFDecoderConfig``), trained on windows of ``block_size`` tokens.

    Initialisation is deterministic given ``torch.manual_seed`` and independent of the layout (``param_init``):
    Linear and Embedding weights N(0, ``initializer_range``), biases zero, norms one (HF's scheme; the values
    differ from HF's draws).

    ``document_eos_id`` (None: off): packed documents separated by this EOS id attend only within themselves and
    their rotary positions restart per document (``parallel/context/documents.py``); ``forward`` derives the
    layout from its token ids (under ``sw.context_parallel`` over the whole rows: its attention's ``sequence_layout``)."""

    document_eos_id: int | None = None

    def __init__(self, config: HFDecoderConfig, block_size: int) -> None:
        super().__init__()
        if not isinstance(config, HFDecoderConfig):
            raise TypeError(f"Llama expects an HFDecoderConfig (shardwise.models.hf_config.load_hf_config), got "
                            f"{type(config).__name__}")
        config.check_block_size(block_size)
        self.init_seed = draw_seed()  # first: submodules' own default init consumes the RNG too
        self.config, self.block_size = config, block_size
        self.model = DecoderStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # one Parameter, two uses
        if not self.lm_head.weight.is_meta:  # on the meta device the strategies draw each rank's pieces
            init_from_rules(self, self.init_seed)

    def param_init(self, name: str) -> InitRule | None:
        """How parameter ``name`` starts: Linear/Embedding weights N(0, ``initializer_range``), biases zero, norm
        scales one — a function of ``(init_seed, name, element)`` only (see ``GPT.param_init``)."""
        module_name, _, attr = name.rpartition(".")
        module = self.get_submodule(module_name)
        if attr == "bias":
            return Constant(0.0)
        if isinstance(module, RMSNorm):
            return Constant(1.0)
        moe = moe_param_init(module, attr, self.config.initializer_range)
        if moe is not None:
            return moe
        if isinstance(module, (nn.Linear, nn.Embedding)):
            return Normal(0.0, self.config.initializer_range)
        return None

    def _check(self, idx: Tensor) -> None:
        if idx.dim() != 2 or idx.size(1) > self.block_size:
            raise ValueError(f"Llama input must be (batch, seq) token ids with seq <= block_size {self.block_size}, "
                             f"got shape {tuple(idx.shape)}")

    def forward(self, idx: Tensor, documents: Documents | None = None) -> Tensor:
        """``idx`` (b, t) int64 token ids → logits (b, t, v). ``documents``: the batch's packed-document layout
        (default: derived from ``idx`` when ``document_eos_id`` is set, else none)."""
        self._check(idx)
        documents = documents if documents is not None else self.documents_of(idx)
        x = self.model.embed_tokens(idx)  # (b, t, h)
        for layer in self.model.layers:
            x = layer(x) if documents is None else layer(x, documents)
        return self.lm_head(self.model.norm(x))

    def documents_of(self, idx: Tensor) -> Documents | None:
        """The packed-document layout of ``idx`` (None when ``document_eos_id`` is not set)."""
        eos = self.document_eos_id
        layout = self.model.layers[0].self_attn.sequence_layout if len(self.model.layers) else None
        return None if eos is None else documents_from_tokens(idx, eos, layout)

    def decode(self, idx: Tensor, cache: KVCache) -> Tensor:
        """``forward`` of the tokens ``idx`` (b, t) that follow the ``cache.length`` positions already in ``cache``
        → logits (b, t, v); rotary positions continue from the cache's length and the new keys/values join it.
        ``ValueError`` past ``block_size`` (``shardwise generate`` builds the model with the architecture's context)."""
        past, t = cache.length, idx.size(-1)
        if idx.dim() != 2 or past + t > self.block_size:
            raise ValueError(f"Llama.decode takes (batch, seq) token ids with cached + new positions <= block_size "
                             f"{self.block_size}, got shape {tuple(idx.shape)} after {past} cached; generate fewer "
                             f"tokens or build the model with a larger block_size")
        x = self.model.embed_tokens(idx)  # (b, t, h)
        cos, sin = rotary_tables(t, self.config, x.device, x.dtype, start=past)  # (t, hd) each
        for i, layer in enumerate(self.model.layers):
            x = layer.decode(x, cos, sin, cache, i)
        cache.advance(t)
        return self.lm_head(self.model.norm(x))

    def num_params(self) -> int:
        """Unique parameter elements (a tied weight counts once)."""
        return sum(p.numel() for p in self.parameters())

    def block_names(self) -> list[str]:
        """The repeated layers (activation checkpointing and ZeRO-3 gather units): ``model.layers.i``."""
        return [f"model.layers.{i}" for i in range(len(self.model.layers))]

    def tensor_parallel_plan(self, sequence_parallel: bool = False) -> dict[str, Style]:
        """Megatron's pairing for this decoder: q/k/v column-parallel in whole heads (query and key/value heads
        split alike, so every rank keeps whole GQA groups), ``o_proj`` row-parallel; gate/up column, down row;
        vocabulary-parallel embedding and head; MoE layers: ``ExpertParallel`` experts over tp (``llama_moe``), unless
        expert parallelism already split them over data-parallel ranks (then they stay whole on tp). With
        sequence parallelism also the RMSNorms (their weights'
        gradients summed over tp once per layer): the q/k/v projections gather the sequence before the
        attention builds its rotary tables, so the positions are those of the whole sequence."""
        c = self.config
        plan: dict[str, Style] = {
            "model.embed_tokens": VocabParallel(), "lm_head": VocabParallel(),
            "model.layers.*.self_attn.q_proj": ColumnParallel(heads=c.num_attention_heads),
            "model.layers.*.self_attn.k_proj": ColumnParallel(heads=c.num_key_value_heads),
            "model.layers.*.self_attn.v_proj": ColumnParallel(heads=c.num_key_value_heads),
            "model.layers.*.self_attn.o_proj": RowParallel(),
            **feed_forward_plan(c, split_experts=not any(getattr(layer.mlp, "shard", None) is not None
                                                         for layer in self.model.layers))}
        if sequence_parallel:
            plan.update({"model.layers.*.input_layernorm": SequenceParallel(),
                         "model.layers.*.post_attention_layernorm": SequenceParallel(),
                         "model.norm": SequenceParallel()})
        return plan

    def pipeline_units(self) -> list[Unit]:
        """Cut points for ``sw.pipeline``: ``model.embed_tokens`` (token ids → hidden), one unit per layer
        ``model.layers.i`` (each builds its rotary tables, so only the hidden state crosses a cut), then
        ``model.norm`` running ``lm_head(norm(x))``. Modules are read when called, so replacements made by
        ``sw.parallelize`` are used."""
        stack, head = self.model, self.lm_head

        def embed(idx: Tensor) -> Tensor:
            self._check(idx)
            return stack.embed_tokens(idx)

        units = [Unit("model.embed_tokens", embed, (("model.embed_tokens", stack.embed_tokens),))]
        units += [Unit(name, _with_documents(layer), ((name, layer),))
                  for name, layer in zip(self.block_names(), stack.layers)]
        units.append(Unit("model.norm", lambda x: head(stack.norm(x)), (("model.norm", stack.norm), ("lm_head", head))))
        return units


def _with_documents(layer: nn.Module) -> "Callable[[Tensor], Tensor]":
    """A pipeline unit running ``layer`` with the micro-batch's documents, if any (``sw.pipeline``'s
    ``microbatch_context`` makes them active: a unit takes one tensor)."""
    def run(x: Tensor) -> Tensor:
        documents = active_documents()
        return layer(x) if documents is None else layer(x, documents)
    return run
