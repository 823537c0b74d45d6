"""``StepBatches(prefetch=True)`` (the CUDA path, forced on CPU: gathered a step ahead, without pinning or
streams) yields the same batches in the same order as without, and its saved position is the consumer's —
a checkpoint taken while the next step is in flight resumes at the step after the last one consumed."""

from __future__ import annotations

import torch

from shardwise.data.corpus import StepBatches
from shardwise.data.windows import ShardedSampler, TokenWindows

TOKENS = torch.arange(4 * 101 + 1, dtype=torch.int64) % 256
DS = TokenWindows(TOKENS, 4)  # 101 windows; global batch 8 → 12 steps per epoch


def _stream(prefetch: bool, dp: int = 2, rank: int = 1) -> StepBatches:
    return StepBatches(DS, ShardedSampler(len(DS), dp_size=dp, dp_rank=rank, seed=3), micro_batch=2, grad_accum=2,
                       device=torch.device("cpu"), prefetch=prefetch)


def _flat(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[int]]:
    return [torch.cat([x, y], 1).tolist() for x, y in pairs]


def test_prefetched_batches_equal_the_plain_ones_across_epochs() -> None:
    plain, ahead = _stream(False), _stream(True)
    assert not _stream(None).prefetch  # type: ignore[arg-type]  # CPU default: off
    for _ in range(15):  # crosses an epoch boundary (12 steps per epoch)
        a, b = plain.next(), ahead.next()
        assert [x.shape for x, _ in b] == [torch.Size([2, 4])] * 2 and b[0][0].dtype == torch.int64
        assert _flat(a) == _flat(b)
        assert plain.state_dict() == ahead.state_dict()
    assert ahead.state_dict() == {"epoch": 1, "global_offset": 24}
    assert ahead.sampler.offset == 16  # the sampler itself is one step further: the prefetched step


def test_resume_from_a_prefetching_stream_continues_after_the_consumed_step() -> None:
    ahead, plain = _stream(True), _stream(False)
    for _ in range(5):
        ahead.next()
        plain.next()
    saved = ahead.state_dict()
    resumed = _stream(True)
    resumed.load_state_dict(saved)
    assert _flat(resumed.next()) == _flat(plain.next())
    ahead.load_state_dict({"epoch": 0, "global_offset": 8})  # a reload drops the step in flight
    fresh = _stream(False)
    fresh.load_state_dict({"epoch": 0, "global_offset": 8})
    assert _flat(ahead.next()) == _flat(fresh.next())
