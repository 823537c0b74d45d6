"""Checkpoint integrity in a world of one process: checksums verified on every read, precise one-line errors for
damaged, truncated, missing or mis-described pieces, confined file names, no non-finite checkpoint published,
and the fallback to the newest intact checkpoint."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import shardwise as sw
import shardwise.checkpoint.integrity as integrity
from shardwise import checkpoint as ckpt_pkg
from shardwise.checkpoint.layout import model_pieces
from shardwise.checkpoint.sharded import (Checkpoint, CheckpointError, latest_checkpoint, latest_intact_checkpoint,
                                          save_checkpoint, verify_checkpoint)

KEY = "model/fc.weight"
FILE = "rank00000.safetensors"


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.ln = nn.LayerNorm(4)
        self.register_buffer("count", torch.arange(5))


@pytest.fixture(scope="module")
def mesh(one_rank_mesh):
    return one_rank_mesh


def _save(mesh: sw.Mesh, root: Path, step: int, model: nn.Module) -> Path:
    return save_checkpoint(root / "checkpoints", step, model_pieces(model, mesh), mesh=mesh, state={"step": step},
                           rank_state={"rank": 0})


@pytest.fixture
def saved(mesh: sw.Mesh, tmp_path: Path) -> tuple[Path, Tiny]:
    torch.manual_seed(0)
    model = Tiny()
    return _save(mesh, tmp_path / "run", 1, model), model


def _data_range(path: Path, key: str) -> tuple[int, int]:
    """Byte range of ``key``'s data in a safetensors file, read from its header."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8:8 + n])[key]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def _flip(path: Path, key: str) -> None:
    begin, end = _data_range(path, key)
    assert end - begin >= 8
    raw = bytearray(path.read_bytes())
    raw[begin:begin + 8] = bytes(b ^ 0xFF for b in raw[begin:begin + 8])
    path.write_bytes(bytes(raw))


def _edit_index(ckpt: Path, fn) -> None:  # type: ignore[no-untyped-def]
    index = json.loads((ckpt / "index.json").read_text())
    fn(index)
    (ckpt / "index.json").write_text(json.dumps(index))


def _error(ckpt: Path, key: str = KEY) -> tuple[str, str]:
    """The messages of verify_checkpoint and of Checkpoint(...).full(key), both CheckpointErrors."""
    with pytest.raises(CheckpointError) as verify:
        verify_checkpoint(ckpt)
    with pytest.raises(CheckpointError) as full:
        Checkpoint(ckpt).full(key)
    for msg in (str(verify.value), str(full.value)):
        assert "\n" not in msg and str(ckpt) in msg and "--resume" in msg
    return str(verify.value), str(full.value)


def test_intact_checkpoint_verifies_and_round_trips(saved: tuple[Path, Tiny]) -> None:
    ckpt, model = saved
    verify_checkpoint(ckpt)
    loaded = Checkpoint(ckpt)
    assert loaded.index["format"] == "shardwise-sharded-v2"
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.full(f"model/{key}"), value)
        piece = loaded.index["tensors"][f"model/{key}"]["pieces"][0]
        assert piece["crc32"] == zlib.crc32(value.contiguous().numpy().tobytes())
    assert ckpt_pkg.CheckpointError is CheckpointError and issubclass(CheckpointError, ValueError)


def test_flipped_bytes_are_detected_naming_file_and_tensor(saved: tuple[Path, Tiny]) -> None:
    ckpt, model = saved
    _flip(ckpt / FILE, KEY)
    for msg in _error(ckpt):
        assert FILE in msg and repr(KEY) in msg and "checksum does not match" in msg
    assert torch.equal(Checkpoint(ckpt).full("model/ln.weight"), model.ln.weight.detach())  # others still load


def test_truncated_file_is_named(saved: tuple[Path, Tiny]) -> None:
    ckpt, _ = saved
    path = ckpt / FILE
    path.write_bytes(path.read_bytes()[:-7])
    for msg in _error(ckpt):
        assert FILE in msg and "truncated or damaged" in msg


def test_missing_file_is_named(saved: tuple[Path, Tiny]) -> None:
    ckpt, _ = saved
    (ckpt / FILE).unlink()
    for msg in _error(ckpt):
        assert FILE in msg and "missing" in msg


def test_piece_file_outside_the_checkpoint_is_refused_unopened(saved: tuple[Path, Tiny], monkeypatch) -> None:
    ckpt, model = saved
    decoy = (ckpt / "../../x").resolve()
    save_file({k: v.contiguous() for k, v in
               {"model/fc.weight": model.fc.weight.detach(), "model/fc.bias": model.fc.bias.detach()}.items()},
              str(decoy))
    _edit_index(ckpt, lambda ix: ix["tensors"][KEY]["pieces"][0].update(file="../../x"))
    opened: list[str] = []
    real = integrity.safe_open
    monkeypatch.setattr(integrity, "safe_open", lambda p, **kw: (opened.append(p), real(p, **kw))[1])
    with pytest.raises(CheckpointError, match=r"'\.\./\.\./x'.*not a plain") as verify:
        verify_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match=r"'\.\./\.\./x'"):
        Checkpoint(ckpt)
    assert "index.json" in str(verify.value) and repr(KEY) in str(verify.value)
    assert all(Path(p).resolve().parent == ckpt.resolve() for p in opened) and str(decoy) not in opened


def test_wrong_shape_in_index_is_reported_precisely(saved: tuple[Path, Tiny]) -> None:
    ckpt, model = saved
    real = tuple(model.fc.weight.shape)
    wrong = (real[0] + 1, *real[1:])

    def grow(ix: dict) -> None:  # type: ignore[type-arg]
        info = ix["tensors"][KEY]
        info["view_shape"] = info["full_shape"] = list(wrong)
        info["pieces"][0]["extent"] = [[0, n] for n in wrong]

    _edit_index(ckpt, grow)
    for msg in _error(ckpt):
        assert repr(KEY) in msg and str(wrong) in msg and str(real) in msg and FILE in msg
        assert "missing?" not in msg


def test_uncovered_elements_are_reported(saved: tuple[Path, Tiny]) -> None:
    ckpt, model = saved
    rows, cols = model.fc.weight.shape
    _edit_index(ckpt, lambda ix: ix["tensors"][KEY]["pieces"][0].update(extent=[[0, rows - 1], [0, cols]]))
    for msg in _error(ckpt):
        assert repr(KEY) in msg and f"cover {(rows - 1) * cols} of {rows * cols}" in msg


@pytest.mark.parametrize("text, needle", [("{not json", "JSON"), ('{"format": "other"}', "unknown format"),
                                          ('{"format": "shardwise-sharded-v2"}', "lacks")])
def test_bad_index_is_a_checkpoint_error_naming_it(saved: tuple[Path, Tiny], text: str, needle: str) -> None:
    ckpt, _ = saved
    (ckpt / "index.json").write_text(text)
    with pytest.raises(CheckpointError, match=needle) as exc:
        verify_checkpoint(ckpt)
    assert str(ckpt / "index.json") in str(exc.value)


def test_nonfinite_checkpoint_is_refused_and_latest_kept(mesh: sw.Mesh, saved: tuple[Path, Tiny]) -> None:
    ckpt, model = saved
    with torch.no_grad():
        model.ln.bias[1] = float("inf")
    with pytest.raises(ValueError, match=r"step 2.*'model/ln\.bias'"):
        _save(mesh, ckpt.parent.parent, 2, model)
    root = ckpt.parent
    assert latest_checkpoint(root) == ckpt
    assert sorted(p.name for p in root.iterdir()) == ["latest", ckpt.name]


def test_latest_intact_falls_back_from_a_damaged_latest(mesh: sw.Mesh, saved: tuple[Path, Tiny]) -> None:
    first, model = saved
    run = first.parent.parent
    second = _save(mesh, run, 2, model)
    assert latest_intact_checkpoint(run) == (second, [])
    _flip(second / FILE, "model/ln.weight")
    found, skipped = latest_intact_checkpoint(run)
    assert found == first
    assert [p for p, _ in skipped] == [second] and "'model/ln.weight'" in skipped[0][1] and FILE in skipped[0][1]
    (first / FILE).unlink()
    assert latest_intact_checkpoint(run)[0] is None and len(latest_intact_checkpoint(run)[1]) == 2


def test_latest_pointer_must_name_a_step_directory(saved: tuple[Path, Tiny]) -> None:
    ckpt, _ = saved
    (ckpt.parent / "latest").write_text("../../elsewhere\n")
    with pytest.raises(CheckpointError, match="not a plain step_NNNNNN"):
        latest_checkpoint(ckpt.parent.parent)
    found, skipped = latest_intact_checkpoint(ckpt.parent.parent)
    assert found == ckpt and skipped[0][0].name == "latest"


def test_v1_index_without_checksums_still_loads(saved: tuple[Path, Tiny]) -> None:
    ckpt, model = saved

    def to_v1(ix: dict) -> None:  # type: ignore[type-arg]
        ix["format"] = "shardwise-sharded-v1"
        for info in ix["tensors"].values():
            for piece in info.get("pieces", []):
                del piece["crc32"]

    _edit_index(ckpt, to_v1)
    verify_checkpoint(ckpt)
    assert torch.equal(Checkpoint(ckpt).full(KEY), model.fc.weight.detach())


def test_pieces_must_tile_the_view_exactly(tmp_path: Path) -> None:
    """Two row halves tile a (4, 3) view; two pieces with the right element count but overlapping leave a hole."""
    info = {"view_shape": [4, 3], "full_shape": [12], "dtype": "float32", "sbp": "S(0)", "axes": ["dp"],
            "pieces": [{"file": "rank00000.safetensors", "extent": [[0, 2], [0, 3]]},
                       {"file": "rank00001.safetensors", "extent": [[2, 2], [0, 3]]}]}
    assert integrity.check_layout(tmp_path, "k", info) == torch.float32
    info["pieces"][1]["extent"] = [[1, 2], [0, 3]]
    with pytest.raises(CheckpointError, match=r"cover 9 of 12"):
        integrity.check_layout(tmp_path, "k", info)
    info["pieces"][1]["extent"] = [[3, 2], [0, 3]]
    with pytest.raises(CheckpointError, match=r"does not lie within the view shape \(4, 3\)"):
        integrity.check_layout(tmp_path, "k", info)


def test_a_run_without_checkpoints_has_no_intact_one(tmp_path: Path) -> None:
    assert latest_intact_checkpoint(tmp_path) == (None, [])


def _ranged(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    """A (4, 3) tensor saved as ZeRO × tp saves it: S(1) blocks (columns 0-1 and column 2), the first block's
    flattening in two ranges on two ranks (``BlockRangePiece``), the second whole as one range."""
    full = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    left, right = full[:, :2].reshape(-1), full[:, 2:].reshape(-1)  # (8,), (4,): the blocks' flattenings
    parts = [(left[:5], [[0, 4], [0, 2]], [0, 5]), (left[5:], [[0, 4], [0, 2]], [5, 3]),
             (right, [[0, 4], [2, 1]], [0, 4])]
    pieces = []
    for rank, (values, extent, span) in enumerate(parts):
        save_file({"k": values.clone()}, str(tmp_path / f"rank{rank:05d}.safetensors"))
        pieces.append({"file": f"rank{rank:05d}.safetensors", "extent": extent, "range": span,
                       "crc32": integrity.tensor_crc32(values.clone())})
    info = {"view_shape": [4, 3], "full_shape": [4, 3], "dtype": "float32", "sbp": "B,S(1)", "axes": ["dp", "tp"],
            "pieces": pieces}
    index = {"format": integrity.FORMAT, "step": 1, "mesh": {"dp": 2, "tp": 2}, "world_size": 3, "state": {},
             "tensors": {"k": info}}
    (tmp_path / "index.json").write_text(json.dumps(index))
    return tmp_path, full


def test_ranges_of_blocks_verify_and_read_back(tmp_path: Path) -> None:
    ckpt, full = _ranged(tmp_path)
    verify_checkpoint(ckpt)
    assert torch.equal(Checkpoint(ckpt).full("k"), full)


def test_ranges_must_tile_their_blocks_exactly(tmp_path: Path) -> None:
    """Ranges with the right element count but overlapping leave a hole; a range past its block is refused."""
    ckpt, _ = _ranged(tmp_path)
    info = json.loads((ckpt / "index.json").read_text())["tensors"]["k"]
    info["pieces"][1]["range"] = [4, 3]  # 5 + 3 + 4 = 12 elements, but [0, 5) and [4, 7) overlap: element 7 uncovered
    with pytest.raises(CheckpointError, match=r"cover 11 of 12"):
        integrity.check_layout(ckpt, "k", info)
    info["pieces"][1]["range"] = [6, 3]
    with pytest.raises(CheckpointError, match=r"range \[6, 3\], which does not lie within its block of 8"):
        integrity.check_layout(ckpt, "k", info)
