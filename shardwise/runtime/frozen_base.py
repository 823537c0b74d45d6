"""``train.save_frozen = false`` in the trainer: checkpoints without the frozen base, which a resume reads from
``model.pretrained`` again (``checkpoint/frozen.py`` drops the pieces and lists the names)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..checkpoint.frozen import FROZEN_STATE, drop_frozen, frozen_keys
from ..checkpoint.sharded import Checkpoint, Piece
from .config_schema import Config

__all__ = ["resume_base", "check_resume", "omit_frozen"]


def resume_base(cfg: Config) -> str:
    """What a resumed run reads from ``model.pretrained``: nothing (its checkpoint holds every weight), unless
    the checkpoints leave the frozen base out. Pure."""
    return "" if cfg.train.save_frozen else cfg.model.pretrained


def check_resume(ckpt: Checkpoint, cfg: Config) -> None:
    """A checkpoint without its frozen parameters loads only into a model built from the pretrained base."""
    if ckpt.omitted and not resume_base(cfg):
        raise ValueError(f"checkpoint {ckpt.path} left out {len(ckpt.omitted)} frozen parameters (saved with "
                         f"train.save_frozen = false) but this run does not read them from model.pretrained; resume "
                         f"with --train.save_frozen false and the run's --model.pretrained DIR")


def omit_frozen(pieces: list[Piece], state: dict[str, Any], plain: nn.Module, cfg: Config) -> list[Piece]:
    """``pieces`` as saved: without the frozen parameters' (named in ``state``) under ``train.save_frozen = false``."""
    if cfg.train.save_frozen:
        return pieces
    state[FROZEN_STATE] = frozen_keys(plain)
    return drop_frozen(pieces, state[FROZEN_STATE])
