"""Hugging Face model directories in and out: one import for the pieces.

* In: ``open_pretrained(directory)`` validates a directory from its headers (``hf_read``);
  ``attach_pretrained(model, directory, arch=...)`` gives every parameter of a meta-device model the
  ``SafetensorsSource`` of its tensor, so each rank reads only its block (``hf_map``: the key mappings);
  ``pretrained_config(directory, arch=...)`` is the model config the directory describes.
* Out: ``write_hf_dir(tensors, config, out)`` writes shards and their index tensor by tensor, atomically
  (``hf_write``); ``hf_export(checkpoint)`` is a training checkpoint as ``(config.json, tensors)`` (``hf_export``).

The user's guide is docs/training.md, "Pretrained weights in and out".
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from .hf_export import hf_export
from .hf_map import (ARCHS, attach_pretrained, gpt2_config_from_gpt, gpt2_key, gpt_config_from_gpt2,
                     pretrained_config)
from .hf_read import PretrainedDir, SafetensorsSource, TensorInfo, open_pretrained, read_header
from .hf_write import DEFAULT_SHARD_BYTES, check_out_dir, write_hf_dir

__all__ = ["load_pretrained", "open_pretrained", "PretrainedDir", "TensorInfo", "SafetensorsSource", "read_header", "attach_pretrained",
           "pretrained_config", "gpt_config_from_gpt2", "gpt2_config_from_gpt", "gpt2_key", "ARCHS", "write_hf_dir",
           "check_out_dir", "DEFAULT_SHARD_BYTES", "hf_export"]


def load_pretrained(model: "nn.Module", directory: "str | Path") -> "nn.Module":
    """``sw.load_pretrained``: give every parameter of the meta-device ``model`` (built with
    ``torch.device("meta")``) its tensor in the Hugging Face directory ``directory`` as its source of values; the
    wrappers (``sw.zero``, ``sw.parallelize``, ``sw.pipeline``, ``sw.DataParallel``) or ``sw.materialize`` then
    read each rank's slices only. The directory's ``model_type`` picks the key mapping: ``gpt2`` for the reference
    GPT (``shardwise.models.GPT``; Conv1D weights transposed), ``llama``/``mistral``/``qwen2`` for
    ``shardwise.models.llama.Llama`` (Hugging Face's own names). Returns ``model``. One-line ``ValueError`` naming
    the file and tensor for a damaged directory or a mismatch. Local (headers only are read here)."""
    pretrained = open_pretrained(directory)
    kind = pretrained.config.get("model_type")
    attach_pretrained(model, pretrained, arch="gpt" if kind == "gpt2" else str(kind))
    return model
