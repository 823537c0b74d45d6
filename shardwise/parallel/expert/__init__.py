"""Expert parallelism: the experts of an MoE block split over a mesh axis, tokens moved to them by all-to-all
(``dispatch.py``), expert weights' pieces and gradients (``shard.py``, ``grads.py``)."""

from .dispatch import ExpertShard, route

__all__ = ["ExpertShard", "route"]
