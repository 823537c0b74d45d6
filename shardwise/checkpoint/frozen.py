"""Checkpoints without the frozen parameters (``train.save_frozen = false``): a fine-tuning run's pretrained base.

Under LoRA the base is most of the model and never changes; saving it every ``ckpt_every`` steps copies the
pretrained directory again and again. With the option the model pieces of every parameter with
``requires_grad=False`` are left out (their optimizer state does not exist anyway) and the index state lists
their names under ``FROZEN_STATE``. Loading such a checkpoint skips those names — the model must already hold
them, i.e. be built from the same ``model.pretrained`` — and a reader that asks for one gets a ``ValueError``
naming that (``Checkpoint._info``). Pure.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from .sharded import Piece

__all__ = ["FROZEN_STATE", "frozen_keys", "drop_frozen"]

FROZEN_STATE = "frozen_not_saved"
"""Index-state key: the plain model's names of the parameters a checkpoint left out."""


def frozen_keys(model: nn.Module) -> list[str]:
    """The plain model's ``state_dict`` names of its frozen parameters, tied names included (sorted). Pure."""
    frozen = {id(p) for p in model.parameters() if not p.requires_grad}
    return sorted(k for k, t in model.state_dict(keep_vars=True).items() if id(t) in frozen)


def drop_frozen(pieces: Sequence[Piece], keys: Sequence[str]) -> list[Piece]:
    """``pieces`` without the model pieces of ``keys`` (``model/<key>``). Pure."""
    left_out = {f"model/{k}" for k in keys}
    return [p for p in pieces if p.key not in left_out]
