"""The data room: everything between a user's text and the token windows a rank trains on.

- ``prepare`` (with ``inputs``, ``tokenizer_info``, ``encode_worker``, ``worker_pool``, ``shard_writer``):
  ``shardwise prepare`` — text, JSON Lines or a ``datasets`` dataset into memory-mapped uint16/uint32 shards.
- ``prepared``: the reader of those shards (``open_prepared``), one index and memory maps.
- ``corpus``: the built-in generated corpus and the pinned step-batch prefetch.
- ``toy_tokenizer``: a small byte-level BPE trained here (no download).
- ``windows``: batch arithmetic, the data-parallel sampler, the training windows, byte-level text.
- ``byte_tokenizer``: that byte-level encoding as a Hugging Face ``tokenizer.json`` (for exports).
- ``sources``: where ``shardwise train``'s training and validation windows come from, and their launch checks.

The room depends on ``mesh`` only; the runtime (trainer, config, launch, metrics) depends on it.
"""

from .prepared import PreparedDataset, open_prepared
from .windows import BatchPlan, ShardedSampler, TokenWindows

__all__ = ["open_prepared", "PreparedDataset", "BatchPlan", "ShardedSampler", "TokenWindows"]
