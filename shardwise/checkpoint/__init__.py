"""Checkpoints: full (unsharded) state dicts, and sharded save/load with resharding and integrity checks."""

from .full_state import full_state_dict, unwrap
from .integrity import CheckpointError, latest_intact_checkpoint, verify_checkpoint

__all__ = ["full_state_dict", "unwrap", "CheckpointError", "verify_checkpoint", "latest_intact_checkpoint"]
