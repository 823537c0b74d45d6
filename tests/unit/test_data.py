"""Batch arithmetic, the data-parallel sampler (sharding, shuffling, tail, resume) and token windows."""

from __future__ import annotations

import pytest
import torch

from shardwise.data.windows import (BatchPlan, ShardedSampler, TokenWindows, iter_batches, load_text_tokens,
                                    text_to_tokens, tokens_to_text)


# ---- BatchPlan -------------------------------------------------------------------------------------------

def test_batch_plan_infers_grad_accum() -> None:
    plan = BatchPlan.from_sizes(global_batch=64, micro_batch=4, dp=4)
    assert (plan.grad_accum, plan.rank_batch) == (4, 16)
    assert BatchPlan.from_sizes(global_batch=8, micro_batch=8).grad_accum == 1


def test_batch_plan_rejects_inconsistent_sizes_with_values_and_fix() -> None:
    with pytest.raises(ValueError, match=r"2 × 3 × 2 = 12 ≠ global_batch=10.*from_sizes"):
        BatchPlan(global_batch=10, micro_batch=2, grad_accum=3, dp=2)
    with pytest.raises(ValueError, match=r"global_batch=10 is not a multiple of .* = 4.*global_batch=8 or 12"):
        BatchPlan.from_sizes(global_batch=10, micro_batch=2, dp=2)
    with pytest.raises(ValueError, match=r"use global_batch=4 \(dp=2 must divide global_batch\)"):
        BatchPlan.from_sizes(global_batch=3, micro_batch=2, dp=2)
    with pytest.raises(ValueError, match=r"divides global_batch / dp = 6"):
        BatchPlan.from_sizes(global_batch=12, micro_batch=4, dp=2)


@pytest.mark.parametrize("kw", [{"global_batch": 0, "micro_batch": 1}, {"global_batch": 4, "micro_batch": -1},
                                {"global_batch": 4, "micro_batch": 1, "dp": 0},
                                {"global_batch": 4, "micro_batch": 2.0}])
def test_batch_plan_rejects_non_positive(kw: dict) -> None:
    with pytest.raises(ValueError, match="positive int"):
        BatchPlan.from_sizes(**kw)


# ---- ShardedSampler --------------------------------------------------------------------------------------

def _shards(n: int, dp: int, epoch: int = 0, **kw: object) -> list[list[int]]:
    shards = []
    for r in range(dp):
        s = ShardedSampler(n, dp_size=dp, dp_rank=r, **kw)
        s.set_epoch(epoch)
        shards.append(list(s))
    return shards


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [12, 13, 17])
def test_shards_are_disjoint_equal_and_cover_all_but_the_tail(dp: int, n: int) -> None:
    shards = _shards(n, dp)
    flat = [i for s in shards for i in s]
    assert len(set(len(s) for s in shards)) == 1            # equal counts: no rank waits in a collective
    assert len(flat) == len(set(flat)) == n - n % dp        # disjoint, only the tail dropped
    assert set(flat) <= set(range(n))


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_pad_policy_covers_everything_with_equal_counts(dp: int) -> None:
    n = 13
    shards = _shards(n, dp, drop_last=False)
    flat = [i for s in shards for i in s]
    assert len(set(len(s) for s in shards)) == 1
    assert set(flat) == set(range(n))
    assert len(flat) == -(-n // dp) * dp                    # padded up to a multiple of dp
    assert len(flat) - len(set(flat)) == len(flat) - n      # only the padding repeats


def test_pad_policy_with_fewer_samples_than_ranks() -> None:
    shards = _shards(2, 4, drop_last=False)
    assert [len(s) for s in shards] == [1, 1, 1, 1]
    assert sorted(i for s in shards for i in s) == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="dataset_len=2 < dp_size=4"):
        ShardedSampler(2, dp_size=4, dp_rank=0)


def test_unshuffled_is_strided_over_the_natural_order() -> None:
    assert _shards(10, 3, shuffle=False) == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]


def test_shuffle_is_deterministic_per_epoch_and_differs_across_epochs_and_seeds() -> None:
    assert _shards(50, 2, epoch=3) == _shards(50, 2, epoch=3)
    assert _shards(50, 2, epoch=3) != _shards(50, 2, epoch=4)
    assert _shards(50, 2, epoch=0, seed=1) != _shards(50, 2, epoch=0, seed=2)
    # seed + epoch: the documented permutation, independent of the sampler's code path
    expected = torch.randperm(50, generator=torch.Generator().manual_seed(7 + 2)).tolist()
    assert _shards(50, 1, epoch=2, seed=7)[0] == expected
    assert _shards(50, 2, epoch=2, seed=7)[1] == expected[1::2]


def test_state_dict_resume_gives_the_same_remaining_order() -> None:
    a = ShardedSampler(40, dp_size=3, dp_rank=1, seed=5)
    a.set_epoch(2)
    full = list(a)
    b = ShardedSampler(40, dp_size=3, dp_rank=1, seed=5)
    b.set_epoch(2)
    it = iter(b)
    head = [next(it) for _ in range(5)]
    state = b.state_dict()
    assert state["epoch"] == 2 and state["offset"] == 5

    resumed = ShardedSampler(40, dp_size=3, dp_rank=1, seed=5)
    resumed.load_state_dict(dict(state))
    resumed.set_epoch(2)                                    # the training loop's call keeps the restored offset
    assert head + list(resumed) == full
    resumed.set_epoch(3)                                    # a new epoch starts from its beginning
    assert resumed.offset == 0 and len(list(resumed)) == len(full)


def test_state_dict_consumed_override_and_mismatch_errors() -> None:
    s = ShardedSampler(20, dp_size=2, dp_rank=0)
    list(s)
    assert s.state_dict(consumed=4)["offset"] == 4
    with pytest.raises(ValueError, match=r"consumed must be in \[0, 10\]"):
        s.state_dict(consumed=11)
    other = ShardedSampler(20, dp_size=4, dp_rank=0)
    with pytest.raises(ValueError, match="dp_size=2 but this sampler has dp_size=4"):
        other.load_state_dict(s.state_dict())


def test_finished_epoch_reiterates_the_same_order() -> None:
    s = ShardedSampler(9, dp_size=2, dp_rank=0)
    assert list(s) == list(s)


@pytest.mark.parametrize("kw, match", [({"dp_size": 2, "dp_rank": 2}, r"dp_rank must be in \[0, dp_size=2\)"),
                                       ({"dp_size": 0, "dp_rank": 0}, "dp_size must be a positive int")])
def test_sampler_bad_input(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ShardedSampler(10, **kw)


class _FakeMesh:
    def size(self, axis: str) -> int:
        return {"dp": 3, "tp": 2}[axis]

    def coord(self, axis: str) -> int:
        return {"dp": 2, "tp": 1}[axis]


def test_for_mesh_uses_the_axis_size_and_coordinate() -> None:
    s = ShardedSampler.for_mesh(30, mesh=_FakeMesh(), axis="dp", seed=3)  # type: ignore[arg-type]
    assert (s.dp_size, s.dp_rank, s.seed) == (3, 2, 3)


# ---- tokens ----------------------------------------------------------------------------------------------

def test_byte_tokens_round_trip(tmp_path) -> None:
    text = "naïve café — ok"
    tokens = text_to_tokens(text)
    assert tokens.dtype == torch.uint16 and tokens.numel() == len(text.encode("utf-8"))
    assert tokens_to_text(tokens) == text
    path = tmp_path / "t.txt"
    path.write_bytes(text.encode("utf-8"))
    assert torch.equal(load_text_tokens(path), tokens)
    with pytest.raises(ValueError, match="does not exist"):
        load_text_tokens(tmp_path / "missing.txt")


def test_token_windows_are_shifted_pairs() -> None:
    tokens = torch.arange(11, dtype=torch.int64)
    ds = TokenWindows(tokens, 4)
    assert len(ds) == 2                                     # windows start at 0 and 4; 8 lacks a 5th token
    idx, tgt = ds[1]
    assert idx.tolist() == [4, 5, 6, 7] and tgt.tolist() == [5, 6, 7, 8]
    overlapping = TokenWindows(tokens.to(torch.uint16), 4, stride=1)
    assert len(overlapping) == 7 and overlapping[6][1].dtype == torch.int64
    assert overlapping[6][1].tolist() == [7, 8, 9, 10]
    with pytest.raises(ValueError, match="needs block_size \\+ 1 = 12"):
        TokenWindows(tokens, 11)


def test_iter_batches_stacks_full_batches_and_tracks_offset() -> None:
    ds = TokenWindows(torch.arange(200), 8)                 # 24 windows
    sampler = ShardedSampler(len(ds), dp_size=2, dp_rank=1, seed=1)   # 12 per rank
    batches = list(iter_batches(ds, sampler, 5))            # 2 full batches, 2 samples left over
    assert len(batches) == 2 and batches[0][0].shape == (5, 8)
    expected_first = sampler.epoch_indices()[:5]
    assert batches[0][0][:, 0].tolist() == [8 * i for i in expected_first]
    assert sampler.offset == 10
