"""Offload for ``sw.zero``: the optimizer's fp32 master shards and state (``offload="optimizer"``, stages 1-3), and
stage 3's compute shards too (``offload="params"``), live in host memory; the step runs on the host.

What moves where, per flat group on a rank (ZeRO-Offload's split; FSDP2's ``CPUOffloadPolicy`` for parameters):

* ``optimizer``: ``master`` (the fp32 shard the optimizer updates, ``(hi - lo,)``) and the optimizer's state are
  host tensors (pinned on CUDA, so copies run asynchronously). Each averaged gradient shard is copied to a
  pinned host buffer as soon as its reduce-scatter has been waited for (``GradientToHost.stored``: during
  backward, overlapped with the earlier layers' backward); the step waits for those copies, runs the inner
  optimizer on the host (torch's CPU AdamW/SGD, fused where the config asks for it) and copies the updated
  master back into the device's compute ``shard`` (stages 1-2 then all-gather as without offload).
* ``params`` (stage 3 only): the compute ``shard`` that is all-gathered into ``full`` stays on the host as well
  (for fp32 compute it is the master itself); each gather first copies it to a device staging buffer.

On a CPU mesh the host *is* the device: every "copy" is the tensor itself (``Tensor.to`` of a tensor already
there returns it), so offload computes bit for bit what no offload computes and holds the same bytes; the
memory report then says which bytes an accelerator would have moved to the host (``host_tensors``).
Nothing here communicates.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["Offload", "OFFLOADS", "check_offload", "to_host", "GradientToHost"]

Offload = Literal["optimizer", "params"]
OFFLOADS = ("optimizer", "params")


def check_offload(offload: object, stage: object) -> None:
    """One-line ``ValueError`` for an unknown offload, or ``params`` below stage 3. Pure."""
    if offload is None:
        return
    if offload not in OFFLOADS:
        raise ValueError(f"offload = {offload!r} is not one of {list(OFFLOADS)} (or None): 'optimizer' keeps the master "
                         f"weights and optimizer state in host memory, 'params' (stage 3) also the parameter shards")
    if offload == "params" and stage != 3:
        raise ValueError(f"offload = 'params' moves ZeRO-3's parameter shards to host memory, but stage = {stage!r} "
                         f"keeps whole parameters on every rank; use stage=3, or offload='optimizer'")


def to_host(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` in host memory: itself when it is there already (a CPU mesh), else a pinned copy (CUDA)."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=device.type == "cuda")
    out.copy_(t)
    return out


class GradientToHost:
    """Copies each group's averaged gradient shard into its host ``master.grad`` as soon as it is stored (a
    reduction waited for during backward), asynchronously on CUDA; ``wait`` before the host reads them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pending = False
        self.copied: set[int] = set()
        """``id`` of the groups whose current shard was copied since the last step."""

    def stored(self, group: object, master: torch.nn.Parameter, shard: torch.Tensor) -> None:
        """Start copying ``shard`` (device) into ``master.grad`` (host, master dtype). No-op on a CPU mesh, where
        the step reads the shard itself."""
        if shard.device == master.device:
            return
        if master.grad is None or master.grad.shape != master.shape:
            master.grad = torch.empty(master.shape, dtype=master.dtype, device="cpu", pin_memory=True)
        master.grad.copy_(shard, non_blocking=True)
        self.copied.add(id(group))
        self.pending = True

    def wait(self) -> None:
        """Wait for the copies started so far (the current stream's work: the copies were queued on it)."""
        if self.pending and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.pending = False
