"""``shardwise schedule`` end to end through ``shardwise.cli.main``."""

from __future__ import annotations

import builtins

import pytest

from shardwise.cli import main


def test_prints_lists_and_closed_form_numbers(capsys):
    assert main(["schedule", "--schedule", "1f1b", "-p", "4", "-m", "8"]) == 0
    out = capsys.readouterr().out
    assert "rank 0: 0F0 0F1 0F2 0F3 0B0 0F4" in out
    # (m+p-1) * (F+B+W) = 11 * 3 and (p-1)/(m+p-1) = 3/11
    assert "step time     33" in out
    assert f"bubble ratio  {3 / 11:.4f}" in out
    assert "rank 0: busy 24  idle 9  peak in flight 4" in out
    assert "rank 3: busy 24  idle 9  peak in flight 1" in out


def test_zb_h1_with_costs_comm_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "zb.png"
    argv = ["schedule", "--schedule", "zb-h1", "-p", "4", "-m", "8", "--costs", "F=1,B=1,W=1,comm=0",
            "--plot", str(png), "--comm"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "0SF0" in out and "1RF0" in out
    # 3m + (p-1)(F+B-W) = 24 + 3
    assert "step time     27" in out
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_zb_h2_listing_and_parallelogram_numbers(capsys):
    assert main(["schedule", "-s", "zb-h2", "-p", "4", "-m", "8"]) == 0
    out = capsys.readouterr().out
    # rank 0: 2p-1 = 7 warm-up forwards, one steady B W F (m - 2p + 1 = 1), then B W to the end
    assert "rank 0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 0B0 0W0 0F7 0B1 0W1 0B2 0W2" in out
    # 3m + p-1 = 27 (rank r busy from r to r + 24); idle p-1 = 3 per rank; holds up to 2p-1 = 7
    assert "step time     27" in out and f"bubble ratio  {3 / 27:.4f}" in out
    assert "rank 0: busy 24  idle 3  peak in flight 7" in out


def test_interleaved_costs_are_per_rank(capsys):
    assert main(["schedule", "-s", "interleaved", "-p", "2", "-m", "4", "--chunks", "2", "--grid"]) == 0
    out = capsys.readouterr().out
    # 3m + (p-1) * 3 / chunks = 12 + 1.5
    assert "step time     13.5" in out and "step  rank 0" in out


def test_deadlocked_file_is_reported(tmp_path, capsys):
    f = tmp_path / "broken.txt"
    f.write_text("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F0 1F1 1B0 1B1\n")
    assert main(["schedule", "--file", str(f)]) == 1
    err = capsys.readouterr().err
    assert "deadlocks" in err and "0B0 <blocked" in err
    # --comm: no simulated run to place receives by, so the listing shows them just before their consumers
    assert main(["schedule", "--file", str(f), "--comm"]) == 1
    out, err = capsys.readouterr()
    assert "rank 1: 1RF0 1F0 1RF1 1F1 1B0 1SB0 1B1 1SB1" in out and "deadlocks" in err


@pytest.mark.parametrize("argv,match", [
    (["-s", "pipedream"], "valid schedules: gpipe, 1f1b, interleaved, zb-h1"),
    (["-s", "interleaved", "-p", "4", "-m", "6", "--chunks", "2"], "multiple of p"),
    (["--costs", "F=1,X=2"], "expected KEY=VALUE with KEY one of F, B, W, comm"),
    (["-p", "0"], "p (pipeline ranks) must be an integer >= 1"),
])
def test_bad_input_exit_2(argv, match, capsys):
    assert main(["schedule", *argv]) == 2
    assert match in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_install(tmp_path, capsys, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert main(["schedule", "-p", "2", "-m", "2", "--plot", str(tmp_path / "x.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_gpipe_bubble_matches_the_formula_with_unequal_b_w(capsys):
    assert main(["schedule", "--schedule", "gpipe", "-p", "4", "-m", "8", "--costs", "F=1,B=2,W=0"]) == 0
    out = capsys.readouterr().out
    # GPipe bubble (p-1)/(m+p-1) = 3/11 with any F, B when costs are uniform across stages.
    assert f"bubble ratio  {3 / 11:.4f}" in out
