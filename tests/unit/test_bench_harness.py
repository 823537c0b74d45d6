"""The shared benchmark harness: workers get exactly the launcher's flags back; bad flags never launch."""

from __future__ import annotations

import argparse

import pytest

from shardwise.bench import comm, dp, pp, sbp, tp, zero
from shardwise.bench.harness import paired_ratio, run_bench, worker_argv


def _parse(module, argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser, parser.parse_args(argv)


def _fields(ns: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(ns).items() if k not in ("worker", "_bench_parser")}


@pytest.mark.parametrize("module, argv", [
    (comm, ["--max", "1M", "--ops", "all_reduce", "--no-check", "--plain"]), (comm, []),
    (pp, ["--schedules", "1f1b,gpipe", "--late-recv", "--no-torch", "--recv-ahead", "2"]), (dp, ["--sweep", ""]),
    (tp, ["--variants", "sw"]), (zero, ["--json", "z.json"]), (sbp, ["--iters", "5"])])
def test_worker_argv_round_trips_every_flag(module, argv):
    parser, ns = _parse(module, argv)
    back = parser.parse_args(worker_argv(ns))
    assert back.worker and _fields(back) == _fields(ns)


def test_worker_flags_use_the_long_spelling_torchrun_cannot_mistake():
    _, ns = _parse(comm, ["--max", "1M"])
    argv = worker_argv(ns)
    assert "--max-bytes" in argv and "--max" not in argv  # torchrun reads a bare --max as --max-restarts


def test_a_bad_flag_is_one_line_and_launches_nothing(monkeypatch, capsys):
    from shardwise.runtime import launch

    monkeypatch.setattr(launch, "run_local", lambda *a, **k: pytest.fail("launched"))
    _, ns = _parse(sbp, ["--iters", "0"])
    assert run_bench("sbp", ns, validate=lambda a: sbp._validate(a), worker=lambda a: 0) == 2
    assert capsys.readouterr().err.strip() == "shardwise bench sbp: error: --iters must be >= 1, got 0"


def test_paired_ratio_is_the_median_of_per_round_ratios():
    assert paired_ratio([[2.0, 2.0], [3.0], [10.0]], [[1.0], [1.0], [4.0]]) == 2.5
    assert paired_ratio([[1.0]], None) == 0.0
