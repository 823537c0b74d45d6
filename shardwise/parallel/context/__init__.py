"""Context parallelism: ring attention over a sequence split along a mesh axis (``cp``), in the causally
balanced layout (rank ``i`` holds chunks ``i`` and ``2·cp−1−i`` of ``2·cp``)."""

from .layout import SeqLayout, shard_sequence, unshard_sequence
from .ring import ring_attention
from .wrap import context_parallel

__all__ = ["context_parallel", "SeqLayout", "shard_sequence", "unshard_sequence", "ring_attention"]
