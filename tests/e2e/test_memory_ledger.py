"""The memory ledger end to end: ``shardwise train`` (2 ranks, tiny) writes each rank's ``memory_ledger`` with
every phase and a ratio, the summary record and table carry it; ``shardwise bench memory`` on a tiny model
prints its table for two layouts and a refused one, and writes the JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.runs import cli

TINY = ["--data.global_batch", "8", "--parallel.micro_batch", "2", "--train.steps", "2", "--train.log_every", "1"]
MODEL = ["--layers", "2", "--hidden", "64", "--heads", "2", "--vocab", "256", "--seq", "32", "--steps", "2",
         "--optimizer", "sgd"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("ledger")
    for name, layout in (("dp", []), ("pp", ["--parallel.pp", "2"])):
        proc = cli(cwd, "train", *TINY, "--train.name", name, *layout)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "memory ledger" in proc.stdout
    return cwd / "runs"


@pytest.mark.parametrize("name,passes", [("dp", ["forward", "backward"]), ("pp", ["forward+backward"])])
def test_each_rank_has_every_phase_and_a_ratio(runs, name, passes):
    for rank in (0, 1):
        summary = json.loads((runs / name / "ranks" / f"rank{rank:05d}.json").read_text())
        book = summary["memory_ledger"]
        # the run's peak survives the per-phase resets: every phase's peak is inside it
        assert summary["peak_memory"] - book["bare_runtime"] <= book["whole_peak"]
        assert book["whole_peak"] >= max(p["peak"] for p in book["phases"].values())
        assert book["mode"] == "rss"
        assert set(book["phases"]) == {"construction", *passes, "step", "save"}
        assert book["floor"]["total"] > 0 and book["ratio"] == pytest.approx(book["whole_peak"] / book["floor"]["total"])
        for phase in book["phases"].values():
            # the named parts are the whole excess over the phase's floor
            assert sum(b for _, b in phase["excess"]) == max(0, phase["peak"] - phase["floor"])
            assert 0 < phase["peak"] <= book["whole_peak"]


def test_the_summary_record_holds_every_ranks_ledger(runs):
    rows = [json.loads(line) for line in (runs / "dp" / "metrics.jsonl").read_text().splitlines()]
    summary = [r for r in rows if r.get("kind") == "summary"][-1]
    assert [b["phases"].keys() >= {"step"} for b in summary["memory_ledger"]] == [True, True]


def test_bench_memory_prints_each_layout_and_a_refused_ones_error(tmp_path):
    out = tmp_path / "rows.json"
    proc = cli(tmp_path, "bench", "memory", *MODEL, "--layouts", "dp2,zero3-dp2,tp3", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["layout"]: r for r in json.loads(out.read_text())["rows"]}
    assert "must divide model.n_head" in rows["tp3"]["error"] and "refused" in proc.stdout
    for name in ("dp2", "zero3-dp2"):
        assert rows[name]["ratio"] > 0 and rows[name]["peak_phase"] and name in proc.stdout
    # ZeRO-3 over 2 shards parameters, gradients and optimizer state: its floor's model states are half dp's
    states = lambda r: sum(r["floor_terms"][k] for k in ("params", "grads", "optimizer"))  # noqa: E731
    assert states(rows["zero3-dp2"]) == pytest.approx(states(rows["dp2"]) / 2)
    assert rows["dp2"]["floor_terms"]["optimizer"] == 0  # SGD without momentum keeps no state


def test_bench_memory_refuses_a_bad_layout_name_in_one_line(tmp_path):
    proc = cli(tmp_path, "bench", "memory", "--layouts", "dp2,xx4")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "'xx4' is not dpN, tpN, ppN or zeroK" in proc.stderr
