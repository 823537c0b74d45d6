"""``shardwise export`` on damaged checkpoints: every failure is one stderr line with exit code 2 and no traceback,
and a failed export neither creates ``--out`` nor changes an existing one (the output is written atomically)."""

from __future__ import annotations

import dataclasses
import errno
import json
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import shardwise as sw
from shardwise.checkpoint.layout import model_pieces, optimizer_pieces, tied_aliases
from shardwise.checkpoint.sharded import save_checkpoint
from shardwise.cli import main as cli_main
from shardwise.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
FILE = "rank00000.safetensors"
KEY = "model/blocks.0.mlp.fc.weight"
PREVIOUS = b"an earlier export, to be kept"


@pytest.fixture(scope="module")
def mesh(one_rank_mesh):
    return one_rank_mesh


@pytest.fixture(scope="module")
def pristine(mesh: sw.Mesh, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPT]:
    """A run directory with one checkpoint saved like ``Trainer.save`` does for the plain layout."""
    tmp_path = tmp_path_factory.mktemp("pristine")
    torch.manual_seed(0)
    model = GPT(CFG)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    optimizer.step()
    state = {"step": 3, "config": {"model": dataclasses.asdict(CFG)}, "aliases": tied_aliases(model)}
    save_checkpoint(tmp_path / "run" / "checkpoints", 3, model_pieces(model, mesh) + optimizer_pieces(model, optimizer,
                    mesh), mesh=mesh, state=state, rank_state={"rank": 0})
    return tmp_path / "run", model


@pytest.fixture
def run(pristine: tuple[Path, GPT], tmp_path: Path) -> tuple[Path, GPT]:
    """A fresh copy of the pristine run, for one test to damage."""
    shutil.copytree(pristine[0], tmp_path / "run")
    return tmp_path / "run", pristine[1]


def _ckpt(run: Path) -> Path:
    return run / "checkpoints" / "step_000003"


def _export(run: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    rc = cli_main(["export", str(run), "--out", str(out)])
    return rc, capsys.readouterr().err.splitlines()


def _edit_index(run: Path, fn: Callable[[dict], None]) -> None:  # type: ignore[type-arg]
    path = _ckpt(run) / "index.json"
    index = json.loads(path.read_text())
    fn(index)
    path.write_text(json.dumps(index))


def _flip(run: Path) -> None:
    path = _ckpt(run) / FILE
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    begin = 8 + n + json.loads(raw[8:8 + n])[KEY]["data_offsets"][0]
    raw[begin:begin + 8] = bytes(b ^ 0x5A for b in raw[begin:begin + 8])
    path.write_bytes(bytes(raw))


def _truncate(run: Path) -> None:
    path = _ckpt(run) / FILE
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _wrong_shape(run: Path) -> None:
    def grow(ix: dict) -> None:  # type: ignore[type-arg]
        info = ix["tensors"][KEY]
        wrong = [info["view_shape"][0] * 2, *info["view_shape"][1:]]
        info["view_shape"] = info["full_shape"] = wrong
        info["pieces"][0]["extent"] = [[0, n] for n in wrong]

    _edit_index(run, grow)


def _traversal(run: Path) -> None:
    save_file({KEY: torch.zeros(4)}, str(run / "x"))  # a decoy where "../../x" leads
    _edit_index(run, lambda ix: ix["tensors"][KEY]["pieces"][0].update(file="../../x"))


def _nonfinite(run: Path) -> None:
    """A NaN stored with a matching checksum (so only the finiteness check can catch it)."""
    path = _ckpt(run) / FILE
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    tensors[KEY][0, 0] = float("nan")
    save_file(tensors, str(path), metadata=meta)
    crc = zlib.crc32(tensors[KEY].contiguous().numpy().tobytes())
    _edit_index(run, lambda ix: ix["tensors"][KEY]["pieces"][0].update(crc32=crc))


FAULTS: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "flipped bytes": (_flip, (FILE, repr(KEY), "checksum does not match")),
    "truncated": (_truncate, (FILE, "truncated")),
    "missing rank file": (lambda run: (_ckpt(run) / FILE).unlink(), (FILE, "missing")),
    "wrong shape": (_wrong_shape, (repr(KEY), FILE, "the file holds shape")),
    "traversal": (_traversal, ("'../../x'", "not a plain")),
    "non-finite": (_nonfinite, (repr(KEY), "NaN/Inf")),
    "bad path": (lambda run: None, ("no checkpoint under",)),
    "damaged index": (lambda run: (_ckpt(run) / "index.json").write_text("{"), ("index.json", "JSON")),
}


def test_export_of_an_intact_checkpoint(run: tuple[Path, GPT], tmp_path: Path, capsys) -> None:
    path, model = run
    out = tmp_path / "out" / "m.safetensors"
    out.parent.mkdir()
    out.write_bytes(PREVIOUS)
    rc, err = _export(path, out, capsys)
    assert rc == 0 and err == []
    exported = load_file(str(out))
    assert set(exported) == set(GPT(CFG).state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(exported[key], value), key
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temporary file left


@pytest.mark.parametrize("existing", [True, False], ids=["out-exists", "no-out"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_failure_is_one_line_exit_2_and_out_untouched(run: tuple[Path, GPT], tmp_path: Path, capsys,
                                                           fault: str, existing: bool) -> None:
    path, _ = run
    damage, needles = FAULTS[fault]
    damage(path)
    target = tmp_path / "nowhere" if fault == "bad path" else path
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "m.safetensors"
    if existing:
        out.write_bytes(PREVIOUS)
    rc, err = _export(target, out, capsys)
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("shardwise export: error: ") and "Traceback" not in err[0], err
    for needle in needles:
        assert needle in err[0], (needle, err[0])
    assert [p.name for p in out_dir.iterdir()] == ([out.name] if existing else [])
    if existing:
        assert out.read_bytes() == PREVIOUS


def test_out_that_is_a_directory_is_one_line(run: tuple[Path, GPT], tmp_path: Path, capsys) -> None:
    path, _ = run
    out = tmp_path / "dir"
    (out / "inside").mkdir(parents=True)
    rc, err = _export(path, out, capsys)
    assert rc == 2 and len(err) == 1 and "--out" in err[0] and str(out) in err[0]
    assert sorted(p.name for p in tmp_path.joinpath("dir").iterdir()) == ["inside"]


def test_a_write_that_fails_midway_leaves_out_unchanged(run: tuple[Path, GPT], tmp_path: Path, capsys,
                                                         monkeypatch) -> None:
    import safetensors.torch

    def half_then_full_disk(tensors, filename, metadata=None):  # type: ignore[no-untyped-def]
        Path(filename).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", half_then_full_disk)
    out = tmp_path / "out" / "m.safetensors"
    out.parent.mkdir()
    out.write_bytes(PREVIOUS)
    rc, err = _export(run[0], out, capsys)
    assert rc == 2 and len(err) == 1 and "No space left" in err[0] and str(out) in err[0]
    assert out.read_bytes() == PREVIOUS and [p.name for p in out.parent.iterdir()] == [out.name]


def test_through_the_command_line_no_traceback(run: tuple[Path, GPT], tmp_path: Path) -> None:
    path, _ = run
    _flip(path)
    out = tmp_path / "m.safetensors"
    proc = subprocess.run([sys.executable, "-m", "shardwise.cli", "export", str(path), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert FILE in lines[0] and repr(KEY) in lines[0] and not out.exists()
