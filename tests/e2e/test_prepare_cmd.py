"""``shardwise prepare`` as a user runs it (a real process): the summary line, the directory the reader opens, and a
prepare killed with SIGKILL halfway, which must leave nothing the reader accepts and nothing running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")

from shardwise.data.prepared import is_prepared, open_prepared  # noqa: E402
from shardwise.data.toy_tokenizer import train_bpe  # noqa: E402

TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs.\n"


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "shardwise.cli", "prepare", *args]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tok")
    (root / "t.txt").write_text(TEXT * 50)
    return train_bpe([root / "t.txt"], 300, root)


def test_prepare_writes_a_dataset_the_reader_opens(tmp_path: Path, tok: Path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(30):
        (corpus / f"{i:02d}.txt").write_text(TEXT * (i + 1))
    out = subprocess.run(_cmd(str(corpus), "--tokenizer", str(tok), "--out", str(tmp_path / "ds"), "--val-fraction",
                              "0.2", "--workers", "2"), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""  # not a terminal: no progress bar
    ds = open_prepared(tmp_path / "ds", verify=True)
    assert ds.val is not None
    line = out.stdout.strip()
    assert line.startswith(f"shardwise prepare: wrote {tmp_path / 'ds'}: train {len(ds.train.tokens):,} tokens in "
                           f"{ds.train.documents:,} documents; val {len(ds.val.tokens):,} tokens in "
                           f"{ds.val.documents:,} documents"), line
    assert ds.train.documents + ds.val.documents == 30


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc to find the worker processes")
def test_a_killed_prepare_leaves_nothing_the_reader_accepts(tmp_path: Path, tok: Path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(300):
        (corpus / f"{i:03d}.txt").write_text(TEXT * 600)  # 15 MB in all: seconds of encoding, killed long before
    proc = subprocess.Popen(_cmd(str(corpus), "--tokenizer", str(tok), "--out", str(tmp_path / "ds"), "--workers", "2",
                                 "--shard-tokens", "10000"), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    tmp = tmp_path / f"ds.tmp-{proc.pid}"
    deadline = time.monotonic() + 60
    while not (tmp / "train-00001.bin").exists():  # the workers have handed back tokens
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the prepare never started writing"
        time.sleep(0.02)
    workers = _children(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert len(workers) == 2
    assert not (tmp_path / "ds").exists() and not is_prepared(tmp_path / "ds") and not is_prepared(tmp)
    with pytest.raises(ValueError, match="half-written or not a prepared dataset: .*run shardwise prepare again"):
        open_prepared(tmp)
    deadline = time.monotonic() + 30
    while any(_alive(w) for w in workers):  # their input ended: each finishes its chunk and exits
        assert time.monotonic() < deadline, f"workers {workers} outlived the killed prepare"
        time.sleep(0.05)
    for p in list(corpus.iterdir())[20:]:
        p.unlink()
    again = subprocess.run(_cmd(str(corpus), "--tokenizer", str(tok), "--out", str(tmp_path / "ds"), "--workers", "1"),
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert not tmp.exists(), "the next prepare removes what the killed one left"
    assert json.loads((tmp_path / "ds" / "dataset.json").read_text())["splits"]["train"]["documents"] == 20
    assert sorted(os.listdir(tmp_path)) == ["corpus", "ds"]


def test_bench_prepare_runs_and_counts_the_same_tokens(tmp_path: Path):
    """A small ``shardwise bench prepare``: both sides run, the table and the JSON come out (the bench itself
    refuses to report when prepare's tokens differ from encode_batch's)."""
    out = subprocess.run([sys.executable, "-m", "shardwise.cli", "bench", "prepare", "--corpus-mb", "0.3", "--rounds",
                          "1", "--memory-scale", "0", "--vocab", "300", "--workers", "2", "--json", "r.json"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "encode_batch s" in out.stdout and "peak resident set" in out.stdout, out.stdout
    result = json.loads((tmp_path / "r.json").read_text())
    row = result["throughput"][0]
    assert row["workers"] == 2 and row["tokens"] > row["documents"] > 10 and row["prepare_s"] > 0
    assert result["memory"][0]["worker_mb"] > 0
