"""Checkpoints: full (unsharded) state dicts now; sharded save/load with resharding later."""

from .full_state import full_state_dict, unwrap

__all__ = ["full_state_dict", "unwrap"]
