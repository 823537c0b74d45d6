"""Pure parts of ZeRO (no processes): flat layouts, units, mixed-precision policy, loss scaling, byte counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel.common.memory import storage_bytes
from shardwise.parallel.common.mixed_precision import LossScaler, MixedPrecision
from shardwise.parallel.zero.flat import flat_layout
from shardwise.parallel.zero.stage3 import default_units


def test_flat_layout_follows_the_shard_sizes_rule():
    lay = flat_layout([6, 3, 5], 4)  # L = 14 -> 4, 4, 3, 3
    assert lay.total == 14 and lay.offsets == (0, 6, 9)
    assert lay.shard_sizes == (4, 4, 3, 3) and lay.shard_offsets == (0, 4, 8, 11, 14)
    assert [lay.shard(r) for r in range(4)] == [(0, 4), (4, 8), (8, 11), (11, 14)]
    # rank 1 owns elements 4..8: the end of param 0 and the first two of param 1
    assert lay.pieces(1) == [(0, 4, 6), (1, 0, 2)]
    assert lay.pieces(3) == [(2, 2, 5)]


def test_flat_layout_pieces_cover_every_element_once():
    numels = [7, 1, 0, 13, 2]
    for parts in (1, 2, 3, 4, 5, 30):
        lay = flat_layout(numels, parts)
        covered = [0] * len(numels)
        for r in range(parts):
            for k, a, b in lay.pieces(r):
                assert 0 <= a < b <= numels[k]
                covered[k] += b - a
        assert covered == numels
        assert sum(lay.shard_sizes) == sum(numels)


def test_flat_layout_rejects_bad_input():
    with pytest.raises(ValueError, match="at least 1"):
        flat_layout([3], 0)
    with pytest.raises(ValueError, match=">= 0"):
        flat_layout([3, -1], 2)


def test_default_units_are_the_blocks():
    model = GPT(GPTConfig(n_layer=3))
    assert default_units(model) == [["blocks.0"], ["blocks.1"], ["blocks.2"]]
    assert default_units(nn.Sequential(nn.Linear(2, 2))) == []


def test_mixed_precision_policy():
    assert MixedPrecision(param_dtype=torch.float16).dynamic
    assert not MixedPrecision(param_dtype=torch.bfloat16).dynamic
    assert not MixedPrecision(param_dtype=torch.float16, loss_scale=128.0).dynamic
    with pytest.raises(ValueError, match="bfloat16 or torch.float16"):
        MixedPrecision(param_dtype=torch.float32)
    with pytest.raises(ValueError, match="reduce_dtype"):
        MixedPrecision(reduce_dtype=torch.int8)
    with pytest.raises(ValueError, match="loss_scale"):
        MixedPrecision(loss_scale=0.0)


def test_dynamic_loss_scale_halves_on_overflow_and_grows_after_clean_steps():
    s = LossScaler(MixedPrecision(param_dtype=torch.float16, init_scale=1024.0, growth_interval=2))
    assert s.scale == 1024.0
    s.update(True)
    assert s.scale == 512.0 and s.skipped == 1
    s.update(False)
    assert s.scale == 512.0
    s.update(False)
    assert s.scale == 1024.0
    fixed = LossScaler(MixedPrecision(param_dtype=torch.float16, loss_scale=8.0))
    fixed.update(True)
    assert fixed.scale == 8.0 and fixed.skipped == 1
    assert LossScaler(None).scale == 1.0 and LossScaler(MixedPrecision()).scale == 1.0


def test_storage_bytes_counts_each_storage_once():
    flat = torch.zeros(100)  # 400 bytes
    a, b = flat[:50], flat[50:]
    other = torch.zeros(10, dtype=torch.bfloat16)  # 20 bytes
    freed = torch.zeros(8)
    freed.untyped_storage().resize_(0)
    got = storage_bytes({"params": [a, b, freed], "grads": [other, flat], "optimizer": [None]})
    assert got == {"params": 400, "grads": 20, "optimizer": 0}


def test_bench_zero_rejects_bad_arguments_before_launching(capsys):
    import argparse

    from shardwise.bench import zero as zero_bench

    parser = argparse.ArgumentParser()
    zero_bench.add_arguments(parser)
    assert zero_bench.main(parser.parse_args(["--variants", "fsdp2,nope"])) == 2
    assert "nope" in capsys.readouterr().err
    assert zero_bench.main(parser.parse_args(["--steps", "0"])) == 2
