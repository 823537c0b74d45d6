"""Token ids against the model's vocabulary, before launch and while training: ``prepare`` records each split's
largest id in ``dataset.json``, the launch check (``check_data``) compares it and reads the shards (whole when
small, evenly spaced blocks when large), and a window holding an id the check missed fails as one line naming the
id, the vocabulary and the data — never inside the embedding."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from shardwise.data import prepared as prepared_mod
from shardwise.data.prepared import open_prepared
from shardwise.data.sources import check_data, open_data
from shardwise.data.windows import TokenWindows
from shardwise.runtime.config import load_config

tokenizers = pytest.importorskip("tokenizers")
from shardwise.data.prepare import PrepareOptions, prepare  # noqa: E402
from shardwise.data.toy_tokenizer import train_bpe  # noqa: E402

DOCS = [f"document {i}: the quick brown fox number {i * 7} jumps over the lazy dog {i % 5} times.\n" for i in range(60)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ids")
    (root / "corpus.txt").write_text("".join(DOCS))
    tok = train_bpe([root / "corpus.txt"], 300, root / "tokenizer.json")
    for i, doc in enumerate(DOCS):
        (root / "docs").mkdir(exist_ok=True)
        (root / "docs" / f"{i:03d}.txt").write_text(doc)
    prepare(PrepareOptions(inputs=(str(root / "docs"),), tokenizer=str(tok), out=str(root / "ds"), workers=1,
                           val_fraction=0.2))
    return root / "ds", tok


def _cfg(ds: Path, vocab: int = 512, **extra: str):
    return load_config(overrides={"data.path": str(ds), "model.vocab_size": str(vocab), "model.block_size": "16",
                                  "data.global_batch": "2", "parallel.micro_batch": "1", **extra})


def test_prepare_records_each_splits_largest_id(dataset):
    ds, tok_file = dataset
    tok = tokenizers.Tokenizer.from_file(str(tok_file))
    index = json.loads((ds / "dataset.json").read_text())
    eos = index["eos_id"]
    everything = [i for d in DOCS for i in tok.encode(d, add_special_tokens=False).ids] + [eos]
    recorded = [index["splits"][s]["max_id"] for s in ("train", "val")]
    assert max(recorded) == max(everything)  # the splits together hold every document, each followed by EOS
    assert all(0 <= r <= max(everything) for r in recorded)


def _damaged(ds: Path, tmp_path: Path, value: int, *, drop_max_id: bool = False) -> Path:
    copy = tmp_path / "ds"
    copy.mkdir()
    for f in ds.iterdir():
        copy.joinpath(f.name).write_bytes(f.read_bytes())
    shard = copy / "train-00000.bin"
    ids = np.fromfile(shard, dtype="<u2")
    ids[len(ids) // 2] = value
    ids.tofile(shard)
    if drop_max_id:  # a dataset prepared before dataset.json recorded max_id
        index = json.loads((copy / "dataset.json").read_text())
        for split in index["splits"].values():
            split.pop("max_id")
        (copy / "dataset.json").write_text(json.dumps(index))
    return copy


@pytest.mark.parametrize("drop_max_id", [False, True], ids=["recorded", "older-index"])
def test_a_damaged_shard_is_refused_at_launch_in_one_line(dataset, tmp_path, drop_max_id):
    ds = _damaged(dataset[0], tmp_path, 60000, drop_max_id=drop_max_id)
    with pytest.raises(ValueError) as err:
        check_data(_cfg(ds))
    text = str(err.value)
    assert "\n" not in text
    for part in ("token id 60000", "512 ids", str(ds), "train-00000.bin", "--model.vocab_size 60001"):
        assert part in text, text


def test_the_recorded_max_id_alone_refuses(dataset, tmp_path):
    ds = _damaged(dataset[0], tmp_path, 3)  # shards in range, but the index says an id of 9000 was written
    index = json.loads((ds / "dataset.json").read_text())
    index["splits"]["train"]["max_id"] = 9000
    (ds / "dataset.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"token id 9000 \(the max_id dataset.json records\)"):
        check_data(_cfg(ds))
    check_data(_cfg(ds, vocab=9001))


def test_a_large_split_is_sampled_in_evenly_spaced_blocks(dataset, tmp_path, monkeypatch):
    ds = _damaged(dataset[0], tmp_path, 60000)
    stream = open_prepared(ds).train.tokens
    n = len(stream)
    monkeypatch.setattr(prepared_mod, "SCAN_ALL", 8)
    monkeypatch.setattr(prepared_mod, "SCAN_BLOCKS", 3)
    monkeypatch.setattr(prepared_mod, "SCAN_BLOCK", 4)
    top, _, whole = stream.largest()
    sampled = np.fromfile(ds / "train-00000.bin", dtype="<u2").astype(np.int64)
    starts = [0, (n - 4) // 2, n - 4]  # evenly spaced: first, middle, last
    assert not whole and top == max(int(sampled[s:s + 4].max()) for s in starts)


def test_an_id_the_check_missed_fails_in_one_line_when_its_window_is_read(dataset, tmp_path):
    ds = _damaged(dataset[0], tmp_path, 60000)
    data = open_data(_cfg(ds))
    with pytest.raises(ValueError) as err:
        for i in range(len(data.train)):
            data.train[i]
    assert "\n" not in str(err.value) and "token id 60000" in str(err.value) and str(ds) in str(err.value)
    windows = TokenWindows(torch.tensor([1, 2, 3, 300, 5]), 2, vocab=300, source="data.path = 'x.bin'")
    assert windows[0][0].tolist() == [1, 2]
    with pytest.raises(ValueError, match=r"data.path = 'x.bin' holds token id 300 .* vocabulary has 300 ids"):
        windows[1]
