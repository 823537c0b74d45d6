"""Mixture-of-experts tensors between the Hugging Face Hub's per-expert files and our 3-D expert weights.

Our MoE layers (``shardwise.models.moe``, named as transformers 5 names them in memory) hold every expert of a
layer in two 3-D weights; the Hub's files (and transformers 5's ``save_pretrained``, which writes the original
format back) hold one 2-D tensor per expert and projection:

=========================  ==============================================  =============================================
ours (``model.layers.i.``)  Mixtral file (``model.layers.i.``)              Qwen2-MoE / Qwen3-MoE file (``model.layers.i.``)
=========================  ==============================================  =============================================
``mlp.gate.weight``         ``block_sparse_moe.gate.weight``                ``mlp.gate.weight``
``mlp.experts.gate_up_proj``  (E, 2f, h): ``[w1; w3]`` of each expert       ``[gate_proj; up_proj]`` of each expert
  (E, 2f, h)                ``block_sparse_moe.experts.e.w1/w3.weight``     ``mlp.experts.e.{gate,up}_proj.weight``
``mlp.experts.down_proj``   ``block_sparse_moe.experts.e.w2.weight``        ``mlp.experts.e.down_proj.weight``
  (E, h, f)
=========================  ==============================================  =============================================

A directory that holds the fused 3-D keys (ours, ``save_pretrained(save_original_format=False)``) is read as it
is. ``ExpertStackSource`` presents the per-expert tensors as one 3-D tensor to the meta-device machinery: a block
of experts ``[a, b)`` (an expert-parallel rank's piece) reads only those experts' tensors. Local.
"""

from __future__ import annotations

import re
from typing import Iterator

import torch

from ..parallel.common.materialize import flat_from_rows
from .hf_read import PretrainedDir, SafetensorsSource

__all__ = ["ExpertStackSource", "moe_source", "hub_tensors", "HUB_MOE_TYPES"]

HUB_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
_EXPERTS = re.compile(r"(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_ROUTER = re.compile(r"(model\.layers\.\d+)\.mlp\.gate\.weight")
# per type: (the MoE block's name in the files, the gate, up and down projections' names)
_HUB = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"), "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
        "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}


def _expert_keys(layer: str, which: str, model_type: str, e: int) -> list[str]:
    """The Hub keys whose rows make expert ``e`` of ``which`` (gate_up_proj: gate then up; down_proj: down)."""
    block, gate, up, down = _HUB[model_type]
    names = (gate, up) if which == "gate_up_proj" else (down,)
    return [f"{layer}.{block}.experts.{e}.{n}.weight" for n in names]


class ExpertStackSource:
    """The (E, rows, cols) stack of per-expert 2-D tensors: expert ``e`` is the row-wise concatenation of the
    tensors ``keys[e]`` (all present and of the stated shapes: ``expert_stack`` checks). A meta-tensor ``Source``
    (``read``, ``read_flat``): a block of experts reads only those experts' files' bytes."""

    def __init__(self, pretrained: PretrainedDir, keys: list[list[str]], dtype: torch.dtype) -> None:
        self.pretrained, self.keys, self.dtype = pretrained, keys, dtype
        first = [pretrained.tensors[k].shape for k in keys[0]]
        self.shape: tuple[int, ...] = (len(keys), sum(s[0] for s in first), first[0][1])

    def _expert(self, e: int) -> torch.Tensor:
        parts = [SafetensorsSource(self.pretrained, k, self.dtype).read() for k in self.keys[e]]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def _experts(self, a: int, b: int) -> torch.Tensor:
        if b <= a:
            return torch.empty((0, *self.shape[1:]), dtype=self.dtype)
        return torch.stack([self._expert(e) for e in range(a, b)])

    def read(self, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        index = tuple(index or ())
        a, b, step = (index[0] if index else slice(None)).indices(self.shape[0])
        if step != 1:
            raise ValueError(f"expert slices must have step 1, got {index[0]}")
        block = self._experts(a, max(a, b))
        return block[(slice(None), *index[1:])].contiguous() if len(index) > 1 else block

    def read_flat(self, start: int, stop: int) -> torch.Tensor:
        return flat_from_rows(self._experts, self.shape, start, stop)

    def __repr__(self) -> str:
        return f"ExpertStackSource({self.keys[0][0]!r} .. {len(self.keys)} experts)"


def moe_source(pretrained: PretrainedDir, name: str, model_type: str, dtype: torch.dtype,
               shape: tuple[int, ...]) -> tuple[object, list[str]] | None:
    """``(source, file keys it reads)`` of our parameter ``name`` when it is an MoE tensor that the Hub layout
    names differently (see the module docstring); None for any other name, or when the file holds ``name``
    itself (the fused layout). ``ValueError`` (one line naming the key and the directory) for a missing expert."""
    if model_type not in HUB_MOE_TYPES or name in pretrained.tensors:
        return None
    router = _ROUTER.fullmatch(name)
    if router is not None:
        key = f"{router.group(1)}.{_HUB[model_type][0]}.gate.weight"
        return (pretrained.source(key, dtype), [key]) if key in pretrained.tensors else None
    m = _EXPERTS.fullmatch(name)
    if m is None:
        return None
    layer, which = m.groups()
    keys = [_expert_keys(layer, which, model_type, e) for e in range(shape[0])]
    for e, ks in enumerate(keys):
        for k in ks:
            if k not in pretrained.tensors:
                raise ValueError(f"{pretrained.path}: no tensor {k!r} (expert {e} of {name!r}, "
                                 f"{shape[0]} experts); the directory misses an expert: fetch its shards again")
    want = (shape[1] // len(keys[0]), *shape[2:])  # each part's rows: gate and up f each, down h
    bad = next((k for ks in keys for k in ks if tuple(pretrained.tensors[k].shape) != want), None)
    if bad is not None:
        raise ValueError(f"{pretrained.file_of(bad)}: tensor {bad!r} has shape {tuple(pretrained.tensors[bad].shape)}, "
                         f"{name!r} {tuple(shape)} needs {want} per expert; build the model from this directory's "
                         f"config.json")
    src = ExpertStackSource(pretrained, keys, dtype)
    return src, [k for ks in keys for k in ks]


def hub_tensors(name: str, t: torch.Tensor, model_type: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Our tensor ``name`` as the Hub file's ``(key, tensor)`` pairs (per-expert views of ``t``, no copies);
    ``name`` itself for anything the layouts name alike. The selection bias ``expert_bias`` is not a Hub tensor
    of these types: nothing is yielded for it."""
    if name.endswith(".expert_bias"):
        return
    if model_type not in HUB_MOE_TYPES:
        yield name, t
        return
    router, m = _ROUTER.fullmatch(name), _EXPERTS.fullmatch(name)
    if router is not None:
        yield f"{router.group(1)}.{_HUB[model_type][0]}.gate.weight", t
    elif m is not None:
        layer, which = m.groups()
        for e in range(t.size(0)):
            keys = _expert_keys(layer, which, model_type, e)
            parts = t[e].chunk(2, dim=0) if which == "gate_up_proj" else (t[e],)
            yield from zip(keys, parts)
    else:
        yield name, t
