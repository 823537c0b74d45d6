"""The batch sizes a user left unset (``runtime/config_defaults.py``), checked by their invariants over a grid of
layouts against an oracle written here from the documented rule (docs/training.md, "Derived batch defaults"), not
against the code's outputs; and the vocabulary a prepared dataset states."""

from __future__ import annotations

import itertools
import json

import pytest

from shardwise.runtime.config import load_config, validate
from shardwise.runtime.config_defaults import search_batch

CAP = 16  # the documented largest derived micro-batch and per-rank share of the default global batch


def _cuts(pass_size: int, pp: int) -> bool:
    """Oracle: shardwise train's pipeline pass of ``pass_size`` sequences cuts into some equal number of
    micro-batches up to 2·pp (1f1b; any pass can, in 1 piece)."""
    return pp == 1 or any(pass_size % k == 0 for k in range(1, min(pass_size, 2 * pp) + 1))


def _micro_options(gb: int, dp: int, pp: int, micro: int | None) -> list[int]:
    """Oracle: the micro-batches the rule allows for a global batch: the given one if it divides, else every
    divisor of gb / dp up to 16 that the pipeline cuts."""
    if gb % dp:
        return []
    per = gb // dp
    if micro is not None:
        return [micro] if per % micro == 0 else []
    return [d for d in range(1, min(CAP, per) + 1) if per % d == 0 and _cuts(d, pp)]


GRID = [(n, tp, pp, cp, gb, mb) for n, tp, pp, cp, gb, mb in itertools.product(
    (1, 2, 3, 4, 6, 8), (1, 2), (1, 2), (1, 2), (None, 2, 4, 12, 30, 48, 64), (None, 2, 4, 16))
    if n % (tp * pp * cp) == 0]


@pytest.mark.parametrize("nproc,tp,pp,cp,gb,mb", GRID)
def test_derived_batch_invariants(nproc, tp, pp, cp, gb, mb):
    flags = {"parallel.nproc": nproc, "parallel.tp": tp, "parallel.pp": pp, "parallel.cp": cp}
    flags.update({"data.global_batch": gb} if gb is not None else {})
    flags.update({"parallel.micro_batch": mb} if mb is not None else {})
    dp = nproc // (tp * pp * cp)  # tp, pp and cp never change dp's share of the batch
    cfg = load_config(overrides={k: str(v) for k, v in flags.items()})
    if gb is not None and not _micro_options(gb, dp, pp, mb):
        with pytest.raises(ValueError, match="data.global_batch|micro_batch"):  # a given batch: a clear error
            validate(cfg)
        return
    out = validate(cfg)  # with no batch given, it never fails
    g, m, p = out.data.global_batch, out.parallel.micro_batch, out.parallel
    assert p.dp == dp and g == m * p.grad_accum * dp  # the batch arithmetic holds
    assert gb is None or g == gb  # given values are kept
    assert mb is None or m == mb
    if gb is None:  # the default: the smallest multiple of dp from 16 × max(dp, 2) on that works
        floor = CAP * max(dp, 2)
        assert g >= floor and g % dp == 0
        assert not any(_micro_options(smaller, dp, pp, mb) for smaller in range(floor, g) if smaller % dp == 0)
    if mb is None:  # derived: the largest allowed divisor of global_batch / dp up to 16
        assert m == max(_micro_options(g, dp, pp, None))
    if pp > 1:
        assert m % p.pp_microbatches == 0 and p.pp_microbatches <= 2 * pp


def test_the_measured_commands_need_no_batch_flag():
    """shardwise train --parallel.nproc 4 (and 3, 8), --data.global_batch 4 on 2 ranks, the pp 2 variant."""
    for n in (3, 4, 8):
        out = validate(load_config(overrides={"parallel.nproc": str(n)}))
        assert out.data.global_batch == CAP * n and out.parallel.micro_batch == CAP and out.parallel.grad_accum == 1
    out = validate(load_config(overrides={"parallel.nproc": "2", "data.global_batch": "4"}))
    assert (out.parallel.micro_batch, out.parallel.grad_accum) == (2, 1)
    out = validate(load_config(overrides={"parallel.nproc": "2", "data.global_batch": "4", "parallel.pp": "2"}))
    assert (out.parallel.dp, out.parallel.micro_batch, out.parallel.grad_accum) == (1, 4, 1)
    for n in (1, 2):  # up to dp = 2 the defaults are those of before: 32 sequences in micro-batches of 16
        out = validate(load_config(overrides={"parallel.nproc": str(n)}))
        assert (out.data.global_batch, out.parallel.micro_batch) == (32, 16)


def test_given_values_keep_their_errors():
    with pytest.raises(ValueError, match="global_batch=32 is not a multiple of micro_batch × dp = 16 × 4 = 64"):
        validate(load_config(overrides={"parallel.nproc": "4", "data.global_batch": "32", "parallel.micro_batch": "16"}))
    with pytest.raises(ValueError, match=r"data.global_batch = 2 must be a multiple of dp = 4.*--data.global_batch 4$"):
        validate(load_config(overrides={"parallel.nproc": "4", "data.global_batch": "2"}))
    with pytest.raises(ValueError, match="grad_accum"):  # an explicit grad_accum fixes global = micro × accum × dp
        validate(load_config(overrides={"parallel.nproc": "2", "data.global_batch": "30", "parallel.grad_accum": "2"}))


def test_grad_accum_given_fixes_the_micro_batch():
    out = validate(load_config(overrides={"parallel.nproc": "2", "parallel.grad_accum": "4"}))
    assert out.data.global_batch == 32 and out.parallel.micro_batch * 4 * 2 == 32
    out = validate(load_config(overrides={"parallel.nproc": "2", "parallel.grad_accum": "3"}))
    g = out.data.global_batch  # the next multiple of grad_accum × dp from 32
    assert g == 36 and out.parallel.micro_batch * 3 * 2 == g


def test_interleaved_pipeline_gets_a_micro_batch_it_can_cut():
    flags = {"parallel.nproc": "2", "parallel.pp": "2", "parallel.pp_schedule": "interleaved",
             "parallel.pp_chunks": "2", "model.n_layer": "4", "data.global_batch": "6"}
    out = validate(load_config(overrides=flags))
    assert out.parallel.pp_microbatches % 2 == 0 and out.parallel.micro_batch % out.parallel.pp_microbatches == 0
    assert out.parallel.micro_batch == 6  # the largest divisor of 6 that cuts into 2 or 4 equal parts
    flags["data.global_batch"] = "3"  # no pass of 1 or 3 sequences cuts into a multiple of 2: the next that does
    with pytest.raises(ValueError, match="use --data.global_batch 4"):
        validate(load_config(overrides=flags))


def test_resumed_micro_batch_is_capped_by_the_saved_one():
    cfg = load_config(overrides={"data.global_batch": "32", "parallel.nproc": "4"})
    assert validate(cfg, micro_cap=4).parallel.micro_batch == 4
    assert validate(cfg).parallel.micro_batch == 8
    assert validate(cfg, micro_cap=3).parallel.micro_batch == 2  # the largest divisor of 8 up to 3


def test_predict_reading_derives_the_same_defaults():
    """shardwise predict (launch=False): nproc is the device count; the default batch follows dp alike."""
    out = validate(load_config(overrides={"parallel.nproc": "8"}), launch=False)
    assert out.data.global_batch == CAP * 8 and out.parallel.micro_batch == CAP
    out = validate(load_config(overrides={"parallel.nproc": "8", "parallel.pp": "2"}), launch=False)
    per = out.data.global_batch // out.parallel.dp  # one micro-batch × micro-batches per flush × flushes
    assert out.data.global_batch == CAP * 4 and per % out.parallel.micro_batch == 0


def test_predict_command_on_eight_devices(capsys):
    from shardwise.cli.main import main

    rc = main(["predict", "--parallel.nproc", "8", "--hardware", "a100-80g-sxm", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["global_batch"] == CAP * 8


@pytest.mark.parametrize("devices,pins,dp", [(8, {}, 8), (8, {"tp": 2}, 4), (8, {"dp": 2}, 2), (1, {}, 1),
                                             (16, {"tp": 2, "pp": 2, "cp": 2}, 2)])
def test_search_batch_divides_every_searchable_dp(devices, pins, dp):
    out = search_batch(load_config(), devices, pins)
    g = out.data.global_batch
    assert g == CAP * max(dp, 2)
    assert all(g % d == 0 for d in range(1, dp + 1) if dp % d == 0)
    given = load_config(overrides={"data.global_batch": "24"})
    assert search_batch(given, devices, pins).data.global_batch == 24


def test_vocabulary_from_a_prepared_dataset(tmp_path):
    from shardwise.data.prepared import FORMAT, INDEX

    root = tmp_path / "ds"
    root.mkdir()
    index = {"format": FORMAT, "vocab_size": 1000, "eos_id": 0, "dtype": "uint16", "splits": {"train": {}},
             "tokenizer": {}, "sft": False}
    (root / INDEX).write_text(json.dumps(index))
    assert load_config(overrides={"data.path": str(root)}).model.vocab_size == 1000
    assert load_config(overrides={"data.path": str(root), "model.vocab_size": "2048"}).model.vocab_size == 2048
    toml = tmp_path / "run.toml"
    toml.write_text(f'[data]\npath = "{root}"\n[model]\nvocab_size = 512\n')
    assert load_config(path=toml).model.vocab_size == 512  # a config file gives it too
    assert load_config(overrides={"data.path": str(tmp_path / "missing")}).model.vocab_size == 256  # the default
    (root / INDEX).write_text("{broken")
    assert load_config(overrides={"data.path": str(root)}).model.vocab_size == 256  # the data check says why
