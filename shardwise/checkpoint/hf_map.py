"""Which Hugging Face tensor feeds which parameter, per architecture, and the config a directory describes.

* ``arch="llama"`` (also ``"mistral"``, ``"qwen2"``, ``"qwen3"``, and the mixtures of experts ``"mixtral"``,
  ``"qwen2_moe"``, ``"qwen3_moe"``): ``shardwise.models.llama.Llama``'s parameter names are HF's
  (``model.embed_tokens.weight``, ``model.layers.0.self_attn.q_proj.weight``, ..., ``lm_head.weight``): identity;
  the MoE layers' router and 3-D experts come from the Hub's per-expert tensors (``hf_experts``: each expert-
  parallel rank reads its experts only), or from the fused 3-D keys when the directory holds those.
* ``arch="gpt"``: the reference GPT ← a GPT-2 directory (``GPT2LMHeadModel``)::

      wte, wpe, ln_f                      ← transformer.wte, transformer.wpe, transformer.ln_f
      blocks.i.ln_1, blocks.i.ln_2        ← transformer.h.i.ln_1, transformer.h.i.ln_2
      blocks.i.attn.qkv, blocks.i.attn.proj  ← transformer.h.i.attn.c_attn, transformer.h.i.attn.c_proj
      blocks.i.mlp.fc, blocks.i.mlp.proj  ← transformer.h.i.mlp.c_fc, transformer.h.i.mlp.c_proj
      lm_head                             ← lm_head (absent with tied embeddings: the head is wte)

  GPT-2's Conv1D weights are stored (in, out), our Linear weights are (out, in): read transposed. c_attn's
  output is q, k, v in that order, as our qkv's. Files whose keys lack the ``transformer.`` prefix (the original
  GPT-2 release) are read too.

A tied parameter (one Parameter under two names: ``lm_head.weight`` is ``wte.weight``) is read from the first of
its names the file holds. Tensors the file holds that are not parameters of any model — GPT-2's causal-mask
buffers ``attn.bias``/``attn.masked_bias``, Llama's ``rotary_emb.inv_freq``, the head of a tied model — are
skipped; any *other* file tensor that no parameter takes is an error (an architecture mismatch such as biases
for a model built without them: silently dropping weights is how a wrong model gets trained).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ..parallel.common.materialize import set_source
from .hf_experts import moe_source
from .hf_read import PretrainedDir, open_pretrained

__all__ = ["ARCHS", "LLAMA_TYPES", "attach_pretrained", "pretrained_config", "gpt2_key", "gpt_config_from_gpt2",
           "gpt2_config_from_gpt"]

LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
ARCHS = ("gpt", *LLAMA_TYPES)

_GPT2_MODULES = {"ln_1": "ln_1", "ln_2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
                 "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
_CONV1D = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
_BLOCK = re.compile(r"blocks\.(\d+)\.(ln_1|ln_2|attn\.qkv|attn\.proj|mlp\.fc|mlp\.proj)\.(weight|bias)")
_TOP = {"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight",
        "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias", "lm_head.weight": "lm_head.weight"}
_SKIP = {"gpt": re.compile(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)"),
         "llama": re.compile(r".*rotary_emb\.inv_freq")}


def _check_arch(arch: str) -> str:
    if arch not in ARCHS:
        raise ValueError(f"arch = {arch!r} is not supported; supported: {', '.join(ARCHS)}")
    return "llama" if arch in LLAMA_TYPES else arch


def gpt2_key(name: str) -> tuple[str, bool]:
    """(GPT-2 key, stored transposed) of the reference GPT's parameter ``name``; ``ValueError`` for a name the
    GPT-2 layout has no place for."""
    if name in _TOP:
        return _TOP[name], False
    m = _BLOCK.fullmatch(name)
    if m is None:
        raise ValueError(f"parameter {name!r} has no GPT-2 counterpart; arch='gpt' reads the reference GPT "
                         f"(wte, wpe, blocks.i.{{ln_1, attn.qkv, attn.proj, ln_2, mlp.fc, mlp.proj}}, ln_f, lm_head)")
    i, module, attr = m.groups()
    return f"transformer.h.{i}.{_GPT2_MODULES[module]}.{attr}", module in _CONV1D and attr == "weight"


def _file_key(pretrained: PretrainedDir, arch: str, name: str) -> tuple[str | None, bool]:
    """(the key holding ``name``'s values, transposed) — key None when the file lacks it."""
    if arch == "llama":
        return (name if name in pretrained.tensors else None), False
    key, transpose = gpt2_key(name)
    if key not in pretrained.tensors and key.startswith("transformer."):
        key = key[len("transformer."):]  # the original GPT-2 files: h.0..., wte.weight
    return (key if key in pretrained.tensors else None), transpose


def _groups(model: nn.Module) -> Iterator[tuple[nn.Parameter, list[str]]]:
    """Every parameter once with all its names (tied ones have several), in registration order."""
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    for pid, p in params.items():
        yield p, names[pid]


def attach_pretrained(model: nn.Module, directory: str | Path | PretrainedDir, *, arch: str) -> PretrainedDir:
    """Give every parameter of the meta-device ``model`` the ``SafetensorsSource`` of its tensor in the Hugging
    Face directory ``directory`` (key mapping of ``arch``: see the module docstring). Nothing is read beyond the
    headers; the strategies (or ``materialize``) then read each rank's block. Returns the opened directory (its
    ``bytes_read`` counts what the sources read). ``ValueError`` (one line naming the file and the tensor) for a
    parameter that is not on the meta device, a missing tensor, a shape mismatch, an unsupported file dtype, or
    a file tensor no parameter takes."""
    kind = _check_arch(arch)
    pretrained = directory if isinstance(directory, PretrainedDir) else open_pretrained(directory)
    used: set[str] = set()
    for param, names in _groups(model):
        if not param.is_meta:
            raise ValueError(f"attach_pretrained: parameter {names[0]!r} is on {param.device}, not the meta device; "
                             f"build the model under `with torch.device('meta'):` so that nothing is drawn twice")
        moe = moe_source(pretrained, names[0], arch, param.dtype, tuple(param.shape)) if kind == "llama" else None
        if moe is not None:  # the Hub's names or per-expert layout (hf_experts)
            set_source(param, moe[0])  # type: ignore[arg-type]
            used.update(moe[1])
            continue
        found = [(n, *_file_key(pretrained, kind, n)) for n in names]
        hits = [(n, k, t) for n, k, t in found if k is not None]
        if not hits:
            key = _file_key_name(kind, names[0])
            raise ValueError(f"{pretrained.where()}: no tensor {key!r} (for parameter {names[0]!r}); the directory "
                             f"is not a {arch} model of this architecture, or was saved without it")
        name, key, transpose = hits[0]
        src = pretrained.source(key, param.dtype, transpose=transpose)
        if tuple(src.shape) != tuple(param.shape):
            t = " (read transposed)" if transpose else ""
            raise ValueError(f"{pretrained.file_of(key)}: tensor {key!r} has shape {tuple(src.shape)}{t}, parameter "
                             f"{name!r} needs {tuple(param.shape)}; build the model from this directory's config.json")
        set_source(param, src)
        used.update(k for _, k, _ in hits)
    _refuse_unused(pretrained, kind, used)
    return pretrained


def _file_key_name(kind: str, name: str) -> str:
    return name if kind == "llama" else gpt2_key(name)[0]


def _refuse_unused(pretrained: PretrainedDir, kind: str, used: set[str]) -> None:
    skip = _SKIP[kind]
    left = [k for k in pretrained.tensors if k not in used and not skip.fullmatch(k)]
    if left:
        more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
        raise ValueError(f"{pretrained.file_of(left[0])}: tensor {left[0]!r}{more} is taken by no parameter of the "
                         f"model; its architecture differs from the directory's (biases, tied head, layer count): "
                         f"build the model from this directory's config.json")


def pretrained_config(directory: str | Path | PretrainedDir, *, arch: str) -> dict[str, Any]:
    """The model config ``directory``'s ``config.json`` describes. ``arch="gpt"``: ``GPTConfig`` keyword arguments
    (``gpt_config_from_gpt2``). Llama family: the ``config.json`` object itself, its ``model_type`` checked — parse
    it with ``shardwise.models.hf_config.hf_config_from_dict`` (or ``load_hf_config(pretrained.config_path)``),
    which this layer cannot import. ``ValueError`` (one line) for what the native model does not compute."""
    kind = _check_arch(arch)
    pretrained = directory if isinstance(directory, PretrainedDir) else open_pretrained(directory)
    raw, where = pretrained.config, str(pretrained.config_path)
    if kind == "gpt":
        return gpt_config_from_gpt2(raw, where=where)
    if raw.get("model_type") not in LLAMA_TYPES:
        raise ValueError(f"{where}: model_type = {raw.get('model_type')!r} is not supported with arch={arch!r}; "
                         f"supported: {', '.join(LLAMA_TYPES)}")
    return dict(raw)


def _int(raw: dict[str, Any], key: str, default: int, where: str) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}: {key} = {value!r} must be a positive int")
    return value


def gpt_config_from_gpt2(raw: dict[str, Any], *, where: str = "config.json") -> dict[str, Any]:
    """``GPTConfig`` keyword arguments of a GPT-2 ``config.json`` (absent fields: ``GPT2Config``'s defaults).
    Refuses what the reference GPT does not compute: another model type, an activation other than exact GELU,
    a LayerNorm epsilon other than 1e-5, an MLP width other than 4·n_embd, unscaled or layer-scaled attention.
    Dropout is a training choice (``model.dropout``), not read."""
    if raw.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"{where}: model_type = {raw.get('model_type')!r}; arch='gpt' reads GPT-2 directories "
                         f"(model_type 'gpt2')")
    act = raw.get("activation_function", "gelu_new")
    if act != "gelu":
        raise ValueError(f"{where}: activation_function = {act!r} is not supported: the reference GPT computes exact "
                         f"GELU (F.gelu), which is 'gelu'; a tanh-approximated GELU would give other logits")
    eps = raw.get("layer_norm_epsilon", 1e-5)
    if eps != 1e-5:
        raise ValueError(f"{where}: layer_norm_epsilon = {eps!r} is not supported; the reference GPT's LayerNorms "
                         f"use 1e-5")
    n_embd = _int(raw, "n_embd", 768, where)
    if raw.get("n_inner") not in (None, 4 * n_embd):
        raise ValueError(f"{where}: n_inner = {raw.get('n_inner')!r} is not supported; the reference GPT's MLP is "
                         f"4 * n_embd = {4 * n_embd} wide (n_inner null)")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if bool(raw.get(key, want)) != want:
            raise ValueError(f"{where}: {key} = {raw.get(key)!r} is not supported; the reference GPT needs {want}")
    cfg = {"vocab_size": _int(raw, "vocab_size", 50257, where), "block_size": _int(raw, "n_positions", 1024, where),
           "n_layer": _int(raw, "n_layer", 12, where), "n_head": _int(raw, "n_head", 12, where), "n_embd": n_embd,
           "bias": True, "tie_weights": bool(raw.get("tie_word_embeddings", True))}
    if n_embd % cfg["n_head"]:
        raise ValueError(f"{where}: n_embd = {n_embd} is not a multiple of n_head = {cfg['n_head']}")
    return cfg


def gpt2_config_from_gpt(model: dict[str, Any]) -> dict[str, Any]:
    """The GPT-2 ``config.json`` of a reference GPT of ``model`` (``GPTConfig`` fields): ``transformers`` builds
    the same network from it (exact GELU, LayerNorm epsilon 1e-5, biases everywhere: zeros where ours has none)."""
    vocab, dropout = int(model["vocab_size"]), float(model.get("dropout", 0.0))
    token = 50256 if vocab > 50256 else None
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "activation_function": "gelu",
            "layer_norm_epsilon": 1e-5, "vocab_size": vocab, "n_positions": int(model["block_size"]),
            "n_embd": int(model["n_embd"]), "n_layer": int(model["n_layer"]), "n_head": int(model["n_head"]),
            "n_inner": None, "tie_word_embeddings": bool(model.get("tie_weights", True)), "resid_pdrop": dropout,
            "embd_pdrop": dropout, "attn_pdrop": dropout, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, "initializer_range": 0.02,
            "bos_token_id": token, "eos_token_id": token, "dtype": str(torch.float32).removeprefix("torch.")}
