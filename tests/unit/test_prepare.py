"""``shardwise.data.prepare``: the tokens, splits, masks and files it writes, against the tokenizer run directly.

Every expected token sequence is computed here with ``tokenizers`` itself (``encode(text,
add_special_tokens=False).ids + [eos]`` per document, in the documented input order), and the split of each
document from the rule documented in docs/data.md, never read back from the code under test.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from shardwise.data import inputs as prepare_inputs  # noqa: E402
from shardwise.data.prepare import PrepareOptions, prepare  # noqa: E402
from shardwise.data.prepared import open_prepared  # noqa: E402
from shardwise.data.toy_tokenizer import train_bpe  # noqa: E402

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()


def _doc(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(5 + i % 11)) + f"\nline {i}.\n"


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tok")
    (root / "train.txt").write_text("".join(_doc(i) for i in range(200)))
    return train_bpe([root / "train.txt"], 400, root / "tokenizer.json")


def _ids(tok_file: Path, text: str) -> list[int]:
    return tokenizers.Tokenizer.from_file(str(tok_file)).encode(text, add_special_tokens=False).ids


def _corpus(root: Path, n: int) -> tuple[Path, list[str]]:
    """n text files in a directory, written in shuffled order with names that sort differently from creation."""
    d = root / "corpus"
    (d / "sub").mkdir(parents=True)
    docs = {f"{'sub/' if i % 3 == 0 else ''}f{i:03d}.txt": _doc(i) for i in range(n)}
    for name in sorted(docs, key=lambda s: hashlib.md5(s.encode()).hexdigest()):
        (d / name).write_text(docs[name])
    (d / ".hidden.txt").write_text("never read")
    return d, [docs[k] for k in sorted(docs)]  # "f..." < "sub/...": sorted by relative posix path


def _opts(tmp: Path, tok: Path, inputs: list[Path], **kw: object) -> PrepareOptions:
    kw.setdefault("workers", 1)
    return PrepareOptions(inputs=tuple(str(i) for i in inputs), tokenizer=str(tok), out=str(tmp / "ds"), **kw)


def _stream(split) -> list[int]:
    return split.tokens.read(0, len(split.tokens)).tolist()


def test_tokens_are_the_documents_in_order_each_followed_by_eos(tmp_path: Path, tok_file: Path):
    d, docs = _corpus(tmp_path, 12)
    jl = tmp_path / "extra.jsonl"
    jl.write_text(json.dumps({"text": "omega psi", "id": 1}) + "\n\n" + json.dumps({"text": "pi rho"}) + "\n")
    prepare(_opts(tmp_path, tok_file, [d, jl]))
    ds = open_prepared(tmp_path / "ds", verify=True)
    eos = tokenizers.Tokenizer.from_file(str(tok_file)).token_to_id("<|endoftext|>")
    expected = [t for text in docs + ["omega psi", "pi rho"] for t in _ids(tok_file, text) + [eos]]
    assert _stream(ds.train) == expected
    assert (ds.eos_id, ds.dtype, ds.vocab_size, ds.sft, ds.val) == (eos, "uint16", 400, False, None)
    assert ds.train.documents == 14 and ds.train.mask is None
    assert ds.tokenizer_fingerprint == hashlib.sha256(tok_file.read_bytes()).hexdigest()
    assert ds.tokenizer_file.read_bytes() == tok_file.read_bytes()
    index = json.loads((tmp_path / "ds" / "dataset.json").read_text())
    assert [(i["kind"], i["documents"]) for i in index["inputs"]] == [("directory", 12), ("jsonl", 2)]
    assert index["total_tokens"] == len(expected)


def test_val_split_is_by_document_with_the_documented_hash(tmp_path: Path, tok_file: Path):
    d, docs = _corpus(tmp_path, 40)
    prepare(_opts(tmp_path, tok_file, [d], val_fraction=0.3))
    ds = open_prepared(tmp_path / "ds")
    eos = ds.eos_id

    def unit(i: int, text: str) -> float:  # docs/data.md, "Validation split"
        h = hashlib.blake2b(i.to_bytes(8, "little") + text.encode(), digest_size=8).digest()
        return int.from_bytes(h, "little") / 2 ** 64

    val = [unit(i, t) < 0.3 for i, t in enumerate(docs)]
    assert 0 < sum(val) < len(docs)
    assert _stream(ds.train) == [t for v, x in zip(val, docs) if not v for t in _ids(tok_file, x) + [eos]]
    assert ds.val is not None and ds.val.documents == sum(val)
    assert _stream(ds.val) == [t for v, x in zip(val, docs) if v for t in _ids(tok_file, x) + [eos]]


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def test_output_bytes_are_the_same_for_any_number_of_workers(tmp_path: Path, tok_file: Path,
                                                             monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(prepare_inputs, "CHUNK_BYTES", 200)  # many chunks, so the pool really interleaves them
    d, _ = _corpus(tmp_path, 30)
    outs = []
    for workers in (1, 2):
        o = _opts(tmp_path / f"w{workers}", tok_file, [d], val_fraction=0.25, workers=workers, shard_tokens=50)
        (tmp_path / f"w{workers}").mkdir()
        prepare(o)
        outs.append(_files(tmp_path / f"w{workers}" / "ds"))
    assert outs[0] == outs[1]
    assert len([n for n in outs[0] if n.startswith("train-")]) > 3


def test_shards_hold_at_most_shard_tokens_and_read_across_them(tmp_path: Path, tok_file: Path):
    d, docs = _corpus(tmp_path, 9)
    prepare(_opts(tmp_path, tok_file, [d], shard_tokens=7))
    ds = open_prepared(tmp_path / "ds")
    index = json.loads((tmp_path / "ds" / "dataset.json").read_text())
    sizes = [s["tokens"] for s in index["splits"]["train"]["shards"]]
    assert all(n == 7 for n in sizes[:-1]) and 1 <= sizes[-1] <= 7
    whole = np.concatenate([np.fromfile(tmp_path / "ds" / s["file"], dtype="<u2")
                            for s in index["splits"]["train"]["shards"]]).tolist()
    assert whole == [t for x in docs for t in _ids(tok_file, x) + [ds.eos_id]]
    for start, stop in ((0, 7), (5, 9), (6, 22), (13, 14), (0, len(whole)), (len(whole), len(whole))):
        assert ds.train.tokens.read(start, stop).tolist() == whole[start:stop]


def test_sft_masks_mark_response_and_eos_as_targets(tmp_path: Path, tok_file: Path):
    recs = [{"q": "alpha beta", "a": "gamma delta epsilon"}, {"q": "", "a": "zeta"}, {"q": "mu nu xi", "a": "pi"}]
    jl = tmp_path / "sft.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in recs))
    prepare(_opts(tmp_path, tok_file, [jl], sft=True, prompt_field="q", response_field="a"))
    ds = open_prepared(tmp_path / "ds", verify=True)
    tokens, mask = [], []
    for r in recs:
        p, a = _ids(tok_file, r["q"]), _ids(tok_file, r["a"])
        tokens += p + a + [ds.eos_id]
        mask += [0] * len(p) + [1] * (len(a) + 1)
    assert ds.sft and ds.train.mask is not None
    assert _stream(ds.train) == tokens
    assert ds.train.mask.read(0, len(mask)).tolist() == mask
    assert (tmp_path / "ds" / "train-00000.mask").stat().st_size == len(tokens)


def test_sft_empty_response_names_file_and_line(tmp_path: Path, tok_file: Path):
    jl = tmp_path / "sft.jsonl"
    jl.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": ""}\n')
    with pytest.raises(ValueError, match=r"sft.jsonl:2: the response \(field 'response'\) has no tokens"):
        prepare(_opts(tmp_path, tok_file, [jl], sft=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft.jsonl"]


def test_a_worker_error_surfaces_as_one_line_and_leaves_nothing(tmp_path: Path, tok_file: Path):
    d, _ = _corpus(tmp_path, 5)
    jl = d / "z.jsonl"
    jl.write_text('{"text": "ok"}\n{"text": "ok"\n')
    with pytest.raises(ValueError, match=r"z.jsonl:2: not valid JSON") as info:
        prepare(_opts(tmp_path, tok_file, [d], workers=2))
    assert "\n" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


def test_too_few_documents_for_the_split(tmp_path: Path, tok_file: Path):
    (tmp_path / "one.txt").write_text("alpha beta")
    with pytest.raises(ValueError, match=r"left the (val|train) split empty: too few documents \(1,"):
        prepare(_opts(tmp_path, tok_file, [tmp_path / "one.txt"], val_fraction=0.5))


def test_force_replaces_and_refuses_foreign_directories(tmp_path: Path, tok_file: Path):
    d, _ = _corpus(tmp_path, 4)
    prepare(_opts(tmp_path, tok_file, [d]))
    first = _files(tmp_path / "ds")
    with pytest.raises(ValueError, match="already exists; pass --force"):
        prepare(_opts(tmp_path, tok_file, [d]))
    (d / "f001.txt").write_text("omega omega")
    prepare(_opts(tmp_path, tok_file, [d], force=True))
    assert _files(tmp_path / "ds") != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "ds"]  # no .old-/.tmp- left
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    o = PrepareOptions(inputs=(str(d),), tokenizer=str(tok_file), out=str(tmp_path / "mine"), force=True, workers=1)
    with pytest.raises(ValueError, match="is not a prepared dataset .* refusing to replace it even with --force"):
        prepare(o)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_a_stale_temporary_directory_is_removed(tmp_path: Path, tok_file: Path):
    d, _ = _corpus(tmp_path, 3)
    stale = tmp_path / "ds.tmp-999999999"  # no such process
    stale.mkdir()
    (stale / "train-00000.bin").write_bytes(b"\0\0")
    prepare(_opts(tmp_path, tok_file, [d]))
    assert not stale.exists()


def test_in_flight_chunks_are_bounded(tmp_path: Path, tok_file: Path, monkeypatch: pytest.MonkeyPatch):
    """Memory does not grow with the corpus: never more than 2 x workers chunks read ahead of the writer."""
    from shardwise.data import prepare as prepare_mod

    monkeypatch.setattr(prepare_inputs, "CHUNK_BYTES", 100)
    produced = []
    real = prepare_mod.chunks

    def counting(*a, **kw):
        for c in real(*a, **kw):
            produced.append(c)
            yield c

    monkeypatch.setattr(prepare_mod, "chunks", counting)
    ahead = []
    d, _ = _corpus(tmp_path, 40)
    prepare(_opts(tmp_path, tok_file, [d]), progress=lambda res: ahead.append(len(produced) - len(ahead) - 1))
    assert len(produced) >= 10 and max(ahead) <= 2 - 1  # workers=1: at most 2 in flight, 1 beyond the collected


def test_eos_from_tokenizer_config_and_explicit(tmp_path: Path, tok_file: Path):
    from shardwise.data.tokenizer_info import load_tokenizer_info

    tok = tokenizers.Tokenizer.from_file(str(tok_file))
    tok.add_special_tokens(["</s>", "<|im_end|>"])
    (tmp_path / "m").mkdir()
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    assert load_tokenizer_info(tmp_path / "m").eos_token == "<|endoftext|>"  # first of the known names
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    info = load_tokenizer_info(tmp_path / "m")
    assert (info.eos_token, info.eos_id) == ("<|im_end|>", tok.token_to_id("<|im_end|>"))
    assert load_tokenizer_info(tmp_path / "m", eos_token="</s>").eos_id == tok.token_to_id("</s>")
    with pytest.raises(ValueError, match="--eos-token 'nope' is not a token"):
        load_tokenizer_info(tmp_path / "m", eos_token="nope")
    bare = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    bare.save(str(tmp_path / "bare.json"))
    with pytest.raises(ValueError, match="has no end-of-text token .* --eos-token TOKEN"):
        load_tokenizer_info(tmp_path / "bare.json")


def test_missing_optional_packages_name_the_extra(tmp_path: Path, tok_file: Path, monkeypatch: pytest.MonkeyPatch):
    import sys

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ModuleNotFoundError
    with pytest.raises(ValueError, match=r'needs the datasets package; install it with: pip install "shardwise\['
                                         r'datasets\]"'):
        prepare(_opts(tmp_path, tok_file, [tmp_path / "hf"]))
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ValueError, match=r'needs the tokenizers package; install it with: pip install "shardwise\['
                                         r'data\]"'):
        prepare(_opts(tmp_path, tok_file, [tmp_path / "hf"]))


def test_datasets_directory(tmp_path: Path, tok_file: Path):
    datasets = pytest.importorskip("datasets")
    texts = [_doc(i) for i in range(7)]
    datasets.Dataset.from_dict({"body": texts, "n": list(range(7))}).save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(ValueError, match=r"has no column 'text' \(columns: \['body', 'n'\]\); .* --field NAME"):
        prepare(_opts(tmp_path, tok_file, [tmp_path / "hf"]))
    prepare(_opts(tmp_path, tok_file, [tmp_path / "hf"], field="body"))
    ds = open_prepared(tmp_path / "ds")
    assert _stream(ds.train) == [t for x in texts for t in _ids(tok_file, x) + [ds.eos_id]]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match="is a DatasetDict .* e.g. '.*dd/train'"):
        prepare(_opts(tmp_path, tok_file, [tmp_path / "dd"], force=True))


def test_glob_keeps_only_matching_files_of_directories(tmp_path: Path, tok_file: Path):
    """A source tree with binary caches: --glob '*.txt' reads the text files (by name or relative path) and skips the
    rest; without it the binary file is a one-line error that names --glob; a pattern matching nothing is refused."""
    d, docs = _corpus(tmp_path, 6)
    (d / "__pycache__").mkdir()
    (d / "__pycache__" / "f000.cpython-311.pyc").write_bytes(b"\xa7\r\r\n\x00\x00")
    with pytest.raises(ValueError, match=r"is not UTF-8 text .*--glob '\*\.py' keeps only matching files"):
        prepare(_opts(tmp_path, tok_file, [d]))
    prepare(_opts(tmp_path, tok_file, [d], glob=("*.txt",)))
    eos = tokenizers.Tokenizer.from_file(str(tok_file)).token_to_id("<|endoftext|>")
    assert _stream(open_prepared(tmp_path / "ds").train) == [t for text in docs for t in _ids(tok_file, text) + [eos]]
    sub = [text for name, text in zip(sorted(f"{'sub/' if i % 3 == 0 else ''}f{i:03d}.txt" for i in range(6)), docs)
           if name.startswith("sub/")]
    prepare(_opts(tmp_path, tok_file, [d], glob=("sub/*",), force=True))
    assert _stream(open_prepared(tmp_path / "ds").train) == [t for text in sub for t in _ids(tok_file, text) + [eos]]
    with pytest.raises(ValueError, match=r"holds no files matching --glob \['\*\.md'\]"):
        prepare(_opts(tmp_path, tok_file, [d], glob=("*.md",), force=True))
