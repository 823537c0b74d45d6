"""The launcher's failure report names the rank at fault from the files the ranks and the launcher leave."""

from __future__ import annotations

from pathlib import Path

from shardwise.runtime.config import Config, validate
from shardwise.runtime.metrics import failure_report


def _run(tmp_path: Path, files: dict[str, str]) -> str:
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    for name, text in files.items():
        (ranks / name).write_text(text)
    return failure_report(tmp_path, 1, validate(Config()))


def test_silent_death_names_the_rank_not_stopped_by_torchrun(tmp_path):
    # both started step 7; rank 0 died of SIGKILL, rank 1 was stopped by torchrun's SIGTERM afterwards
    report = _run(tmp_path, {"rank00000.step": "7", "rank00001.step": "7", "rank00000.exit": "-9",
                             "rank00001.exit": "-15"})
    assert "rank 0 failed first (last step it started: 7)" in report and "rank 1" not in report


def test_without_exit_codes_every_silent_rank_is_named(tmp_path):
    report = _run(tmp_path, {"rank00000.step": "7", "rank00001.step": "7"})
    assert "rank 0, rank 1 failed first" in report


def test_a_hung_rank_killed_by_the_supervisor_is_named(tmp_path):
    # rank 0's collective timed out (a peer error); rank 1 never finished and was killed after the grace
    report = _run(tmp_path, {"rank00000.step": "5", "rank00001.step": "5",
                             "rank00000.error": "rank 0 failed at step 5: RuntimeError: Connection closed by peer",
                             "rank00001.killed": "killed", "rank00001.exit": "-9"})
    assert "rank 1 failed first" in report and "rank 1 did not exit after the failure and was killed" in report


def test_a_python_error_is_quoted(tmp_path):
    report = _run(tmp_path, {"rank00000.error": "rank 0 failed at step 2: NonFiniteError: loss nan",
                             "rank00001.error": "rank 1 failed at step 2: NonFiniteError: loss nan"})
    assert "ranks 0, 1 failed at step 2: NonFiniteError: loss nan" in report
    assert "Last complete checkpoint: none" in report
