"""What a model costs, layer by layer, as plain data: parameters, GEMM shapes, memory-bound traffic and the
activations backward keeps — per *sequence* of ``seq_len`` tokens, so that a plan's micro-batch multiplies it.

Three sources: the reference GPT (``ModelSpec.gpt``, analytic), a Llama-style decoder (``ModelSpec.llama``:
grouped-query attention, SwiGLU MLP, RMSNorm, untied head) and any ``nn.Module`` traced on the meta device
(``ModelSpec.trace`` in ``trace.py``). Tensor parallelism is described per GEMM (``split``) and per
activation (``act_tp`` vs ``act_rep``), in Megatron's pairing (column then row).

Activations follow Korthikanti et al. 2022 (arXiv 2205.05198) §4, Table 2, counted in *elements* (the
compute dtype's size multiplies them): a transformer layer keeps ``s·h·(5 + 12/t)`` plus ``2.5·a·s²/t`` for
unfused attention with dropout (their ``34 + 5as/h`` bytes at 16 bits), less without dropout masks or with
a fused (flash) attention kernel that keeps only ``O(s)`` statistics.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Mapping

from .builders import gpt_layers, llama_layers
from .moe_builders import gpt_mlp_part, is_moe_layer, llama_mlp_part, moe_part, swap_mlp
from .layers import Gemm, Layer
from .hf_spec import hf_layers, read_hf, tp_divisors as hf_tp_divisors
from .trace import trace_fields

__all__ = ["Gemm", "Layer", "ModelSpec"]

@dataclass(frozen=True)
class ModelSpec:
    """A model as the planner sees it."""

    name: str
    seq_len: int
    layers: tuple[Layer, ...]
    hidden: int = 0
    heads: int = 0
    kv_heads: int = 0
    vocab: int = 0
    attention: str = "flash"
    """``flash`` (fused kernel, causal half skipped, O(s) kept; on a GPU priced as an IO-aware kernel with O(s·h)
    traffic, ``compute.io_aware_attention``) or ``unfused`` (scores materialised)."""
    tp_divisors: tuple[int, ...] = ()
    """What tensor parallelism must divide (heads, kv heads, ffn width, vocab); empty: no tp plan."""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def params(self) -> int:
        return sum(layer.params - layer.shared for layer in self.layers)

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: ``params`` less the routed experts it is not sent to (equal to
        ``params`` for a dense model)."""
        return self.params - sum(layer.inactive for layer in self.layers)

    @property
    def n_experts(self) -> int:
        """Routed experts per MoE layer (0: dense)."""
        return max((g.experts for layer in self.layers for g in layer.gemms), default=0)

    @property
    def blocks(self) -> int:
        return sum(1 for layer in self.layers if layer.kind == "block")

    def units_text(self) -> str:
        """The pipeline units a stage cut can fall between, counted for messages: ``"6 pipeline units (4 blocks +
        wte, ln_f)"`` — a stage may hold the embedding or the head alone, so a model of n blocks has more than n."""
        others = [layer.name for layer in self.layers if layer.kind != "block"]
        if not self.blocks or not others:
            return f"{len(self.layers)} layers"
        shown = ", ".join(others[:3]) + (", …" if len(others) > 3 else "")
        return f"{len(self.layers)} pipeline units ({self.blocks} block{'s' * (self.blocks != 1)} + {shown})"

    def flops_per_sequence(self) -> float:
        """Forward GEMM FLOPs of one sequence (model FLOPs: × 3 for forward + backward)."""
        return sum(layer.flops for layer in self.layers)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def with_seq_len(self, seq_len: int) -> "ModelSpec":
        """The same analytic model at another sequence length (traced specs cannot be rescaled)."""
        builder = self.meta.get("builder")
        if seq_len == self.seq_len:
            return self
        if self.meta.get("cp", 1) != 1:
            whole = replace(self, meta={k: v for k, v in self.meta.items() if k != "cp"})
            return whole.with_seq_len(seq_len).for_cp(self.meta["cp"])
        if "documents" in self.meta:
            whole = replace(self, meta={k: v for k, v in self.meta.items() if k != "documents"})
            return whole.with_seq_len(seq_len).with_documents(self.meta["documents"])
        if "adapters" in self.meta:
            plain = replace(self, layers=tuple(replace(x, params=x.frozen, frozen=0) for x in self.layers),
                            meta={k: v for k, v in self.meta.items() if k != "adapters"})
            return plain.with_seq_len(seq_len).with_adapters(self.meta["adapters"])
        if builder == "gpt":
            return ModelSpec.gpt(**{**self.meta["args"], "seq_len": seq_len})
        if builder == "llama":
            return ModelSpec.llama(**{**self.meta["args"], "seq_len": seq_len})
        if builder == "hf":
            return ModelSpec.from_hf(**{**self.meta["args"], "seq_len": seq_len})
        raise ValueError(f"model spec {self.name!r} was traced at seq_len={self.seq_len}; trace it again with "
                         f"inputs of length {seq_len}")

    def with_adapters(self, adapters: Mapping[str, int]) -> "ModelSpec":
        """The model fine-tuned with a frozen base: every parameter frozen and ``adapters[layer]`` trainable
        elements added to each named layer (LoRA: r·(i + o) per adapted linear layer). Their FLOPs are not
        priced (r ≪ h). Kept through ``with_seq_len``."""
        unknown = sorted(set(adapters) - {layer.name for layer in self.layers})
        if unknown:
            raise ValueError(f"adapters name layers {unknown} that {self.name!r} does not have; its layers are "
                             f"{[layer.name for layer in self.layers][:6]} ...")
        layers = [replace(layer, params=layer.params + int(adapters.get(layer.name, 0)), frozen=layer.params)
                  for layer in self.layers]
        return replace(self, layers=tuple(layers), meta={**self.meta, "adapters": dict(adapters)})

    def with_documents(self, doc_len: float) -> "ModelSpec":
        """The model trained on packed documents of ``doc_len`` tokens that attend only within themselves
        (``data.document_mask``; ``documents.py``): each attention core sees ``min(keys, doc_len)`` keys, the
        unfused cores' kept scores shrink alike. Kept through ``with_seq_len``; apply before ``for_cp``."""
        if isinstance(doc_len, bool) or not isinstance(doc_len, (int, float)) or not doc_len >= 1:
            raise ValueError(f"with_documents needs the documents' length in tokens, a number >= 1, got "
                             f"{doc_len!r}; e.g. the training split's tokens / documents")
        if self.meta.get("cp", 1) != 1:
            raise ValueError(f"model spec {self.name!r} is the view of one of cp = {self.meta['cp']} ranks; take "
                             f"with_documents of the whole model, then for_cp")
        if "documents" in self.meta:
            if self.meta["documents"] == doc_len:
                return self
            raise ValueError(f"model spec {self.name!r} already prices documents of {self.meta['documents']} "
                             f"tokens; take with_documents({doc_len}) of the model without documents")
        from .documents import document_layers

        dropout = bool(self.meta.get("args", {}).get("dropout", False))
        layers = document_layers(self.layers, seq_len=self.seq_len, doc_len=doc_len,
                                 flash=self.attention == "flash", dropout=dropout)
        return replace(self, layers=layers, meta={**self.meta, "documents": doc_len})

    # -- constructors ------------------------------------------------------------------------------------
    @staticmethod
    def gpt(config: Any = None, *, n_layer: int = 0, n_embd: int = 0, n_head: int = 0, vocab_size: int = 0,
            seq_len: int = 0, block_size: int = 0, tie_weights: bool = True, bias: bool = True,
            dropout: bool | None = None, attention: str = "flash", name: str = "gpt",
            **moe: Any) -> "ModelSpec":
        """The reference GPT (``shardwise.models.gpt``) from its config or from the numbers.

        ``attention="unfused"`` with ``dropout=True`` is Megatron-LM's 2021 GPT (the published tables);
        the default describes ``shardwise.models.GPT`` (fused SDPA, dropout as configured). ``moe``: the
        mixture-of-experts fields of ``GPTConfig`` (``n_experts`` (0 = dense), ``top_k``, ``moe_ffn`` (0 =
        4·n_embd / top_k), ``n_shared_experts``, ``moe_every``, ``moe_first_dense``) and ``moe_imbalance`` (the most
        loaded expert-parallel rank's tokens over the mean, default 1.0), read from ``config`` when given."""
        if config is not None:
            n_layer, n_embd, n_head = config.n_layer, config.n_embd, config.n_head
            vocab_size, block_size = config.vocab_size, config.block_size
            tie_weights, bias = config.tie_weights, config.bias
            dropout = config.dropout > 0 if dropout is None else dropout
            moe = {**{k: getattr(config, k) for k in _MOE_FIELDS if hasattr(config, k)}, **moe}
        moe = _moe_args(moe, default_ffn=lambda k: max(1, 4 * n_embd // k), where="ModelSpec.gpt")
        args = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size, block_size=block_size,
                    tie_weights=tie_weights, bias=bias, dropout=bool(dropout), attention=attention, name=name, **moe)
        s = seq_len or block_size
        for key, value in (("n_layer", n_layer), ("n_embd", n_embd), ("n_head", n_head),
                           ("vocab_size", vocab_size), ("seq_len", s)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelSpec.gpt needs a positive int {key}, got {value!r}")
        if n_embd % n_head:
            raise ValueError(f"ModelSpec.gpt: n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        layers = gpt_layers(n_layer=n_layer, h=n_embd, a=n_head, v=vocab_size, s=s, positions=block_size or s,
                            tie=tie_weights, bias=bias, dropout=bool(dropout), attention=attention)
        layers = _with_moe(layers, moe, s=s, h=n_embd, dense=gpt_mlp_part(s=s, h=n_embd, bias=bias))
        return ModelSpec(name=name, seq_len=s, layers=layers, hidden=n_embd, heads=n_head, kv_heads=n_head,
                         vocab=vocab_size, attention=attention,
                         tp_divisors=(n_head, vocab_size) + _moe_widths(moe),
                         meta={"builder": "gpt", "args": {**args, "seq_len": s}})

    @staticmethod
    def llama(*, n_layer: int, hidden: int, heads: int, kv_heads: int | None = None, ffn: int | None = None,
              vocab_size: int, seq_len: int, tie_weights: bool = False, attention: str = "flash",
              name: str = "llama", **moe: Any) -> "ModelSpec":
        """A Llama-style decoder: RMSNorm, rotary positions (no position table), grouped-query attention with
        ``kv_heads`` key/value heads, SwiGLU MLP of width ``ffn`` (default ``8/3·hidden`` rounded up to 256),
        no biases, untied head. ``moe``: as ``gpt`` (``moe_ffn`` 0 = ``ffn``)."""
        kv_heads = kv_heads or heads
        ffn = ffn or 256 * -(-int(8 * hidden / 3) // 256)
        for key, value in (("n_layer", n_layer), ("hidden", hidden), ("heads", heads), ("kv_heads", kv_heads),
                           ("ffn", ffn), ("vocab_size", vocab_size), ("seq_len", seq_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelSpec.llama needs a positive int {key}, got {value!r}")
        if hidden % heads or heads % kv_heads:
            raise ValueError(f"ModelSpec.llama: heads ({heads}) must divide hidden ({hidden}) and kv_heads "
                             f"({kv_heads}) must divide heads")
        moe = _moe_args(moe, default_ffn=lambda k: ffn, where="ModelSpec.llama")
        layers = llama_layers(n_layer=n_layer, h=hidden, a=heads, kv=kv_heads, f=ffn, v=vocab_size, s=seq_len,
                              tie=tie_weights, attention=attention)
        layers = _with_moe(layers, moe, s=seq_len, h=hidden, dense=llama_mlp_part(s=seq_len, h=hidden, ffn=ffn))
        args = dict(n_layer=n_layer, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn,
                    vocab_size=vocab_size, seq_len=seq_len, tie_weights=tie_weights, attention=attention, name=name,
                    **moe)
        return ModelSpec(name=name, seq_len=seq_len, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                         vocab=vocab_size, attention=attention,
                         tp_divisors=(kv_heads, ffn, vocab_size) + _moe_widths(moe),
                         meta={"builder": "llama", "args": args})

    @staticmethod
    def from_hf(config: Mapping[str, Any], *, seq_len: int, attention: str = "flash", moe_imbalance: float = 1.0,
                name: str = "") -> "ModelSpec":
        """A Hugging Face decoder from its ``config.json`` dict (``hf_spec``: Llama-like, ``mixtral``,
        ``qwen2_moe``, ``qwen3_moe``, ``gpt_oss``, ``deepseek_v3``) at ``seq_len`` tokens."""
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"ModelSpec.from_hf needs a positive int seq_len, got {seq_len!r}")
        _check_imbalance(moe_imbalance, "ModelSpec.from_hf")
        shape = read_hf(config)
        layers = hf_layers(shape, s=seq_len, attention=attention, imbalance=moe_imbalance)
        name = name or f"hf-{shape.model_type}"
        args = dict(config=dict(config), attention=attention, moe_imbalance=moe_imbalance, name=name)
        return ModelSpec(name=name, seq_len=seq_len, layers=layers, hidden=shape.hidden, heads=shape.heads,
                         kv_heads=shape.kv_heads, vocab=shape.vocab, attention=attention,
                         tp_divisors=hf_tp_divisors(shape), meta={"builder": "hf", "args": args})

    @staticmethod
    def trace(module: Any, example_inputs: Any, *, loss_fn: Any = None, name: str = "") -> "ModelSpec":
        """Any ``nn.Module`` traced on the meta device with ``example_inputs`` (see ``shardwise.planner.trace``)."""
        fields_ = trace_fields(module, example_inputs, loss_fn=loss_fn)
        return ModelSpec(name=name or type(module).__name__, attention="flash", meta={"builder": "trace"}, **fields_)

    def for_cp(self, cp: int) -> "ModelSpec":
        """The model as one of ``cp`` context-parallel ranks runs it (``context.cp_local``: per-token work and
        activations / cp, attention rows / cp against all keys; with documents against their documents' keys,
        ``documents.cp_document_layers``); ``seq_len`` stays the whole sequence. Itself
        for cp = 1 or when it already is that rank's view; ``ValueError`` when 2·cp does not divide the sequence."""
        done = self.meta.get("cp", 1)
        if cp == done:
            return self
        if done != 1:
            raise ValueError(f"model spec {self.name!r} is already the view of one of cp = {done} ranks; take "
                             f"for_cp({cp}) of the whole model")
        if self.seq_len % (2 * cp):
            raise ValueError(f"cp = {cp} needs the sequence length divisible by 2·cp = {2 * cp} (2 chunks per cp "
                             f"rank), got {self.seq_len}; use a cp whose 2·cp divides {self.seq_len}")
        from .context import cp_local
        from .documents import cp_document_layers

        local = (cp_document_layers(self.layers, cp) if self.meta.get("documents", self.seq_len) < self.seq_len
                 else cp_local(self.layers, cp))
        return replace(self, layers=local, meta={**self.meta, "cp": cp})

    def rename(self, name: str) -> "ModelSpec":
        return replace(self, name=name)

    def replicate(self, names: "list[str] | tuple[str, ...]") -> "ModelSpec":
        """This spec with the named layers kept whole on every tensor-parallel rank (pinned data-parallel).
        A layer tied to a named one (the LM head to the embedding) follows it: both uses must shard the
        weight alike. ``ValueError`` naming an unknown layer."""
        known = [layer.name for layer in self.layers]
        for name in names:
            if name not in known:
                raise ValueError(f"module pin {name!r} is not a layer of model {self.name!r}; layers are "
                                 f"{known[:4]} … {known[-2:]}")
        chosen = set(names)
        chosen |= {layer.name for layer in self.layers if layer.tied in chosen}
        chosen |= {layer.tied for layer in self.layers if layer.name in chosen and layer.tied}
        layers = tuple(replace(layer, replicated=True) if layer.name in chosen else layer for layer in self.layers)
        return replace(self, layers=layers)


_MOE_FIELDS = ("n_experts", "top_k", "moe_ffn", "n_shared_experts", "moe_every", "moe_first_dense")
_MOE_DEFAULTS = dict(n_experts=0, top_k=2, moe_ffn=0, n_shared_experts=0, moe_every=1, moe_first_dense=0,
                     moe_imbalance=1.0)


def _check_imbalance(value: Any, where: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}: moe_imbalance is the most loaded expert-parallel rank's tokens over the mean, "
                         f"a number >= 1 (1.0: ideal balance), got {value!r}")


def _moe_args(moe: dict[str, Any], *, default_ffn: Callable[[int], int], where: str) -> dict[str, Any]:
    """The MoE keyword arguments resolved (``moe_ffn`` 0 → the default width); ``{}`` for a dense model (so
    that a dense spec's ``meta`` is what it was). ``ValueError`` naming a bad field."""
    unknown = sorted(set(moe) - set(_MOE_DEFAULTS))
    if unknown:
        raise TypeError(f"{where} got unexpected keyword argument(s) {unknown}; MoE fields: {sorted(_MOE_DEFAULTS)}")
    args = {**_MOE_DEFAULTS, **moe}
    if not args["n_experts"]:
        return {}
    for key in ("n_experts", "top_k", "moe_every"):
        if not isinstance(args[key], int) or args[key] < 1:
            raise ValueError(f"{where}: {key} must be a positive int for an MoE, got {args[key]!r}")
    if args["top_k"] > args["n_experts"]:
        raise ValueError(f"{where}: top_k ({args['top_k']}) must be <= n_experts ({args['n_experts']})")
    _check_imbalance(args["moe_imbalance"], where)
    return {**args, "moe_ffn": args["moe_ffn"] or default_ffn(args["top_k"])}


def _with_moe(layers: tuple[Layer, ...], moe: dict[str, Any], *, s: int, h: int, dense: dict[str, Any]) -> tuple[Layer, ...]:
    """``layers`` with the MLP of every MoE block (``moe_builders.is_moe_layer``) swapped for the MoE part."""
    if not moe:
        return layers
    part = moe_part(s=s, h=h, n_experts=moe["n_experts"], top_k=moe["top_k"], ffn=moe["moe_ffn"],
                    shared_ffn=moe["n_shared_experts"] * moe["moe_ffn"], imbalance=moe["moe_imbalance"])
    out, i = [], 0
    for layer in layers:
        if layer.kind == "block":
            if is_moe_layer(i, moe["n_experts"], moe["moe_first_dense"], moe["moe_every"]):
                layer = swap_mlp(layer, dense, part)
            i += 1
        out.append(layer)
    return tuple(out)


def _moe_widths(moe: dict[str, Any]) -> tuple[int, ...]:
    """What tensor parallelism must divide besides the dense model's: the expert width."""
    return (moe["moe_ffn"],) if moe else ()
