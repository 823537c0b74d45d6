"""Bucket plans (pure): caps, first bucket, dtype/device keys, observed order. No processes."""

from __future__ import annotations

import pytest
import torch

from shardwise.parallel.common.buckets import BucketPlan, default_order, observed_order, plan_buckets

F32 = (torch.float32, "cpu")
BF16 = (torch.bfloat16, "cpu")


def test_default_order_is_reverse_registration() -> None:
    assert default_order(4) == [3, 2, 1, 0]
    assert default_order(0) == []


def test_caps_close_buckets_after_reaching_them() -> None:
    # 6 params of 100 bytes, walked 5..0; first bucket closes at >= 150 B (2 params), later ones at >= 250 B.
    plan = plan_buckets([100] * 6, [F32] * 6, cap_bytes=250, first_cap_bytes=150)
    assert plan.buckets == ((5, 4), (3, 2, 1), (0,))


def test_large_cap_gives_one_bucket_and_tiny_cap_one_per_parameter() -> None:
    sizes = [40, 4, 400, 8]
    assert plan_buckets(sizes, [F32] * 4, cap_bytes=10**9, first_cap_bytes=10**9).buckets == ((3, 2, 1, 0),)
    assert plan_buckets(sizes, [F32] * 4, cap_bytes=1, first_cap_bytes=1).buckets == ((3,), (2,), (1,), (0,))


def test_parameter_larger_than_cap_gets_its_own_bucket() -> None:
    plan = plan_buckets([10, 1000, 10, 10], [F32] * 4, cap_bytes=100, first_cap_bytes=100)
    # walk 3,2,1,0: 3+2 = 20 < 100, +1 -> 1020 closes (3, 2, 1); 0 left over.
    assert plan.buckets == ((3, 2, 1), (0,))


def test_keys_never_share_a_bucket_and_launch_order_follows_readiness() -> None:
    keys = [F32, BF16, F32, BF16, F32]
    plan = plan_buckets([8] * 5, keys, cap_bytes=1000, first_cap_bytes=1000)
    for members in plan.buckets:
        assert len({keys[i] for i in members}) == 1
    # Neither fills: leftovers ordered by when their last member becomes ready (walk 4,3,2,1,0).
    assert plan.buckets == ((3, 1), (4, 2, 0))


def test_observed_order_plan_and_bucket_of() -> None:
    plan = plan_buckets([4] * 4, [F32] * 4, cap_bytes=8, first_cap_bytes=4, order=[0, 2, 1, 3])
    assert plan.buckets == ((0,), (2, 1), (3,))
    assert plan.bucket_of() == {0: (0, 0), 2: (1, 0), 1: (1, 1), 3: (2, 0)}
    assert len(plan) == 3 and isinstance(plan, BucketPlan)


def test_every_parameter_in_exactly_one_bucket() -> None:
    sizes = [7, 300, 12, 5, 90, 1, 64, 64, 2048, 3]
    keys = [F32, F32, BF16, F32, BF16, F32, F32, BF16, F32, F32]
    plan = plan_buckets(sizes, keys, cap_bytes=100, first_cap_bytes=20)
    flat = sorted(i for b in plan.buckets for i in b)
    assert flat == list(range(len(sizes)))


def test_observed_order_completes_with_unused_in_reverse_order() -> None:
    assert observed_order([2, 0, 2], 5) == [2, 0, 4, 3, 1]
    assert observed_order([], 3) == [2, 1, 0]
    with pytest.raises(ValueError, match="outside"):
        observed_order([7], 3)


def test_bad_plans_raise() -> None:
    with pytest.raises(ValueError, match="> 0 bytes"):
        plan_buckets([4], [F32], cap_bytes=0, first_cap_bytes=1)
    with pytest.raises(ValueError, match="permutation"):
        plan_buckets([4, 4], [F32] * 2, cap_bytes=8, first_cap_bytes=8, order=[0, 0])
    with pytest.raises(ValueError, match="keys"):
        plan_buckets([4, 4], [F32], cap_bytes=8, first_cap_bytes=8)
