"""``shardwise schedule`` through the CLI entry point: action lists, simulated numbers, plot, errors."""

from __future__ import annotations

import pytest

from shardwise.cli import main


def test_zb_h1_prints_lists_and_closed_form_numbers(capsys, tmp_path):
    png = tmp_path / "zb.png"
    args = ["schedule", "--schedule", "zb-h1", "-p", "4", "-m", "8", "--costs", "F=1,B=1,W=1,comm=0"]
    plot = pytest.importorskip("matplotlib") is not None
    assert main(args + (["--plot", str(png)] if plot else [])) == 0
    out = capsys.readouterr().out
    assert out.count("rank ") >= 8 and "0F0" in out and "3W7" in out
    # ZB-H1 with F = B = W: every rank is busy 3m = 24 units; the step is 3m + (p - 1) = 27.
    assert "step time     27" in out and "bubble ratio  0.1111" in out
    if plot:
        assert png.stat().st_size > 10_000


def test_gpipe_bubble_matches_the_formula(capsys):
    assert main(["schedule", "--schedule", "gpipe", "-p", "4", "-m", "8", "--costs", "F=1,B=2,W=0"]) == 0
    out = capsys.readouterr().out
    # GPipe bubble (p-1)/(m+p-1) = 3/11 with any F, B when costs are uniform.
    assert f"bubble ratio  {3 / 11:.4f}" in out


@pytest.mark.parametrize("args,word", [(["--schedule", "nope"], "valid schedules"),
                                       (["--costs", "X=1"], "KEY=VALUE")])
def test_bad_input_is_a_clear_error(capsys, args, word):
    assert main(["schedule", *args]) == 2
    assert word in capsys.readouterr().err
