"""The reader of prepared datasets (``shardwise.data.prepared``) on directories built here by hand from the format
in docs/data.md (numpy-written shards, a handwritten index), and on a >65536-token vocabulary (uint32 shards)."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from shardwise.data.prepared import is_prepared, open_prepared

SIZES = (5, 0, 7, 1, 3)  # an empty shard in the middle, a one-token shard


def _build(root: Path, *, dtype: str = "uint16", sft: bool = False, val: bool = True) -> dict[str, np.ndarray]:
    """A dataset directory: train shards of SIZES, a val shard of 4 tokens; returns each split's whole stream."""
    root.mkdir()
    rng = np.random.default_rng(0)
    streams, splits = {}, {}
    for split, sizes in (("train", SIZES), ("val", (4,)) if val else ("val", ())):
        if not sizes:
            continue
        shards, parts = [], []
        for i, n in enumerate(sizes):
            ids = rng.integers(0, 70000 if dtype == "uint32" else 65536, n).astype("<u4" if dtype == "uint32" else "<u2")
            (root / f"{split}-{i:05d}.bin").write_bytes(ids.tobytes())
            entry = {"file": f"{split}-{i:05d}.bin", "tokens": n, "sha256": hashlib.sha256(ids.tobytes()).hexdigest()}
            if sft:
                m = (ids % 2).astype(np.uint8)
                (root / f"{split}-{i:05d}.mask").write_bytes(m.tobytes())
                entry.update(mask_file=f"{split}-{i:05d}.mask", mask_sha256=hashlib.sha256(m.tobytes()).hexdigest())
            shards.append(entry)
            parts.append(ids)
        streams[split] = np.concatenate(parts).astype(np.int64)
        splits[split] = {"tokens": sum(sizes), "documents": 2, "shards": shards}
    (root / "tokenizer.json").write_text("{}")
    index = {"format": "shardwise-prepared-v1", "tokenizer": {"file": "tokenizer.json", "sha256": "ab" * 32},
             "vocab_size": 70000 if dtype == "uint32" else 65536, "eos_id": 3, "dtype": dtype, "sft": sft,
             "splits": splits, "total_tokens": sum(len(s) for s in streams.values())}
    (root / "dataset.json").write_text(json.dumps(index))
    return streams


def test_read_crosses_shard_boundaries(tmp_path: Path):
    streams = _build(tmp_path / "ds")
    ds = open_prepared(tmp_path / "ds")
    whole = streams["train"]
    assert len(ds.train.tokens) == len(whole) == 16
    for start in range(len(whole) + 1):
        for stop in range(start, len(whole) + 1):
            got = ds.train.tokens.read(start, stop)
            assert got.dtype.is_floating_point is False and str(got.dtype) == "torch.int64"
            assert got.tolist() == whole[start:stop].tolist(), (start, stop)
    assert ds.val is not None and ds.val.tokens.read(0, 4).tolist() == streams["val"].tolist()
    assert (ds.vocab_size, ds.eos_id, ds.dtype, ds.sft, ds.tokenizer_fingerprint) == (65536, 3, "uint16", False, "ab" * 32)
    assert ds.train.mask is None and ds.tokenizer_file == tmp_path / "ds" / "tokenizer.json"
    with pytest.raises(IndexError, match=r"\[10, 17\) is outside \[0, 16\)"):
        ds.train.tokens.read(10, 17)


def test_uint32_shards_and_masks(tmp_path: Path):
    streams = _build(tmp_path / "ds", dtype="uint32", sft=True, val=False)
    ds = open_prepared(tmp_path / "ds", verify=True)
    assert ds.val is None and ds.dtype == "uint32" and int(streams["train"].max()) > 65535
    assert ds.train.tokens.read(2, 15).tolist() == streams["train"][2:15].tolist()
    assert ds.train.mask is not None and ds.train.mask.read(0, 16).tolist() == (streams["train"] % 2).tolist()


def test_a_stream_survives_pickling(tmp_path: Path):
    streams = _build(tmp_path / "ds")
    stream = open_prepared(tmp_path / "ds").train.tokens
    stream.read(0, 3)  # mapped here: the copy must map its own
    copy = pickle.loads(pickle.dumps(stream))
    assert copy.read(4, 13).tolist() == streams["train"][4:13].tolist()


def _damage(kind: str, root: Path) -> None:
    index = json.loads((root / "dataset.json").read_text())
    if kind == "no-index":
        (root / "dataset.json").unlink()
    elif kind == "bad-json":
        (root / "dataset.json").write_text('{"format": ')
    elif kind == "format":
        (root / "dataset.json").write_text(json.dumps({**index, "format": "other-v9"}))
    elif kind == "dtype":
        (root / "dataset.json").write_text(json.dumps({**index, "dtype": "int8"}))
    elif kind == "missing-shard":
        (root / "train-00002.bin").unlink()
    elif kind == "truncated":
        (root / "train-00002.bin").write_bytes((root / "train-00002.bin").read_bytes()[:-2])
    elif kind == "escape":
        index["splits"]["train"]["shards"][0]["file"] = "../train-00000.bin"
        (root / "dataset.json").write_text(json.dumps(index))
    elif kind == "no-tokenizer":
        (root / "tokenizer.json").unlink()


@pytest.mark.parametrize("kind,message", [
    ("no-index", r"is half-written or not a prepared dataset: no dataset.json; run shardwise prepare again"),
    ("bad-json", r"half-written or not a prepared dataset: dataset.json cannot be read as JSON"),
    ("format", r"dataset.json has format 'other-v9', not 'shardwise-prepared-v1'"),
    ("dtype", r"dtype 'int8' is not one of \['uint16', 'uint32'\]"),
    ("missing-shard", r"shard 'train-00002.bin' named in dataset.json is missing; run shardwise prepare again"),
    ("truncated", r"shard 'train-00002.bin' holds 12 bytes, but dataset.json gives it 14: truncated"),
    ("escape", r"names shard '../train-00000.bin', which is not a plain file name"),
    ("no-tokenizer", r"tokenizer.json is missing"),
])
def test_a_damaged_directory_is_refused_naming_the_file(tmp_path: Path, kind: str, message: str):
    _build(tmp_path / "ds")
    _damage(kind, tmp_path / "ds")
    with pytest.raises(ValueError, match=message) as info:
        open_prepared(tmp_path / "ds")
    assert "\n" not in str(info.value)


def test_verify_finds_a_flipped_byte(tmp_path: Path):
    _build(tmp_path / "ds", sft=True)
    shard = tmp_path / "ds" / "train-00003.mask"
    shard.write_bytes(bytes([shard.read_bytes()[0] ^ 1]))
    open_prepared(tmp_path / "ds")  # same size: only the checksum can tell
    with pytest.raises(ValueError, match=r"shard 'train-00003.mask' is damaged: sha256 .* run shardwise prepare again"):
        open_prepared(tmp_path / "ds", verify=True)


def test_directories_that_are_not_datasets(tmp_path: Path):
    with pytest.raises(ValueError, match="prepared dataset '.*nowhere' does not exist; make it with shardwise prepare"):
        open_prepared(tmp_path / "nowhere")
    _build(tmp_path / "ds.tmp-12345")  # complete, index included, but still under its temporary name
    assert is_prepared(tmp_path / "ds.tmp-12345") and not is_prepared(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="half-written or not a prepared dataset: a directory that shardwise prepare"):
        open_prepared(tmp_path / "ds.tmp-12345")


def test_more_than_65536_tokens_are_written_as_uint32(tmp_path: Path):
    tokenizers = pytest.importorskip("tokenizers")
    from shardwise.data.prepare import PrepareOptions, prepare

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(70000)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("w69999 w0 w65534 w65535 nope")
    (tmp_path / "b.txt").write_text("w7")
    prepare(PrepareOptions(inputs=(str(tmp_path / "a.txt"), str(tmp_path / "b.txt")), tokenizer=str(tmp_path),
                           out=str(tmp_path / "ds"), workers=1))
    ds = open_prepared(tmp_path / "ds", verify=True)
    assert (ds.dtype, ds.vocab_size) == ("uint32", 70002)
    assert ds.train.tokens.read(0, 8).tolist() == [70001, 2, 65536, 65537, 1, 0, 9, 0]
    assert (tmp_path / "ds" / "train-00000.bin").stat().st_size == 8 * 4
