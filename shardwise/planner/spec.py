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
from typing import Any

from .builders import gpt_layers, llama_layers
from .layers import Gemm, Layer
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
        if builder == "gpt":
            return ModelSpec.gpt(**{**self.meta["args"], "seq_len": seq_len})
        if builder == "llama":
            return ModelSpec.llama(**{**self.meta["args"], "seq_len": seq_len})
        raise ValueError(f"model spec {self.name!r} was traced at seq_len={self.seq_len}; trace it again with "
                         f"inputs of length {seq_len}")

    # -- constructors ------------------------------------------------------------------------------------
    @staticmethod
    def gpt(config: Any = None, *, n_layer: int = 0, n_embd: int = 0, n_head: int = 0, vocab_size: int = 0,
            seq_len: int = 0, block_size: int = 0, tie_weights: bool = True, bias: bool = True,
            dropout: bool | None = None, attention: str = "flash", name: str = "gpt") -> "ModelSpec":
        """The reference GPT (``shardwise.models.gpt``) from its config or from the numbers.

        ``attention="unfused"`` with ``dropout=True`` is Megatron-LM's 2021 GPT (the published tables);
        the default describes ``shardwise.models.GPT`` (fused SDPA, dropout as configured)."""
        if config is not None:
            n_layer, n_embd, n_head = config.n_layer, config.n_embd, config.n_head
            vocab_size, block_size = config.vocab_size, config.block_size
            tie_weights, bias = config.tie_weights, config.bias
            dropout = config.dropout > 0 if dropout is None else dropout
        args = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size, block_size=block_size,
                    tie_weights=tie_weights, bias=bias, dropout=bool(dropout), attention=attention, name=name)
        s = seq_len or block_size
        for key, value in (("n_layer", n_layer), ("n_embd", n_embd), ("n_head", n_head),
                           ("vocab_size", vocab_size), ("seq_len", s)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelSpec.gpt needs a positive int {key}, got {value!r}")
        if n_embd % n_head:
            raise ValueError(f"ModelSpec.gpt: n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        layers = gpt_layers(n_layer=n_layer, h=n_embd, a=n_head, v=vocab_size, s=s, positions=block_size or s,
                            tie=tie_weights, bias=bias, dropout=bool(dropout), attention=attention)
        return ModelSpec(name=name, seq_len=s, layers=layers, hidden=n_embd, heads=n_head, kv_heads=n_head,
                         vocab=vocab_size, attention=attention, tp_divisors=(n_head, vocab_size),
                         meta={"builder": "gpt", "args": {**args, "seq_len": s}})

    @staticmethod
    def llama(*, n_layer: int, hidden: int, heads: int, kv_heads: int | None = None, ffn: int | None = None,
              vocab_size: int, seq_len: int, tie_weights: bool = False, attention: str = "flash",
              name: str = "llama") -> "ModelSpec":
        """A Llama-style decoder: RMSNorm, rotary positions (no position table), grouped-query attention with
        ``kv_heads`` key/value heads, SwiGLU MLP of width ``ffn`` (default ``8/3·hidden`` rounded up to 256),
        no biases, untied head."""
        kv_heads = kv_heads or heads
        ffn = ffn or 256 * -(-int(8 * hidden / 3) // 256)
        for key, value in (("n_layer", n_layer), ("hidden", hidden), ("heads", heads), ("kv_heads", kv_heads),
                           ("ffn", ffn), ("vocab_size", vocab_size), ("seq_len", seq_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelSpec.llama needs a positive int {key}, got {value!r}")
        if hidden % heads or heads % kv_heads:
            raise ValueError(f"ModelSpec.llama: heads ({heads}) must divide hidden ({hidden}) and kv_heads "
                             f"({kv_heads}) must divide heads")
        layers = llama_layers(n_layer=n_layer, h=hidden, a=heads, kv=kv_heads, f=ffn, v=vocab_size, s=seq_len,
                              tie=tie_weights, attention=attention)
        args = dict(n_layer=n_layer, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn,
                    vocab_size=vocab_size, seq_len=seq_len, tie_weights=tie_weights, attention=attention, name=name)
        return ModelSpec(name=name, seq_len=seq_len, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                         vocab=vocab_size, attention=attention, tp_divisors=(kv_heads, ffn, vocab_size),
                         meta={"builder": "llama", "args": args})

    @staticmethod
    def trace(module: Any, example_inputs: Any, *, loss_fn: Any = None, name: str = "") -> "ModelSpec":
        """Any ``nn.Module`` traced on the meta device with ``example_inputs`` (see ``shardwise.planner.trace``)."""
        fields_ = trace_fields(module, example_inputs, loss_fn=loss_fn)
        return ModelSpec(name=name or type(module).__name__, attention="flash", meta={"builder": "trace"}, **fields_)

    def for_cp(self, cp: int) -> "ModelSpec":
        """The model as one of ``cp`` context-parallel ranks runs it (``context.cp_local``: per-token work and
        activations / cp, attention rows / cp against all keys); ``seq_len`` stays the whole sequence. Itself
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

        return replace(self, layers=cp_local(self.layers, cp), meta={**self.meta, "cp": cp})

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
