"""Data paths that work: ``shardwise prepare --documents`` cuts a text file into documents (so one large file has a
validation split), ``--out`` parents are created, ``--data.path x.jsonl`` is refused in one line naming the
prepare command, and ``train``'s hint for missing validation data names commands that work for that data.

Expected documents are computed here with plain ``str`` operations, never read back from the code under test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.data.sources import check_data
from shardwise.data.text_documents import check_mode, resolve_mode, text_documents
from shardwise.runtime.config import load_config

PARAS = ["First paragraph, line one.\nline two of it.", "Second paragraph.", "Third\r\nwith CRLF."]


def _docs(path: Path, mode: str) -> list[str]:
    return [t for _, t in text_documents(path, mode)]


def test_modes_cut_a_text_file(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(("\n\n  \n".join(PARAS) + "\n\n").encode())
    assert _docs(f, "blank-lines") == PARAS
    lines = [ln.rstrip("\r") for p in PARAS for ln in p.split("\n")]
    assert _docs(f, "lines") == lines
    assert _docs(f, "file") == [f.read_bytes().decode()]
    g = tmp_path / "b.txt"
    g.write_text("one<|endoftext|>two\nlines<|endoftext|><|endoftext|>three")
    assert _docs(g, "separator:<|endoftext|>") == ["one", "two\nlines", "three"]
    h = tmp_path / "c.txt"
    h.write_text("x\n---\ny\n---\n")
    assert _docs(h, "separator:\\n---\\n") == ["x", "y"]


def test_auto_cuts_a_lone_file_at_blank_lines_when_it_has_paragraphs_else_at_lines(tmp_path):
    paragraphs, lines = tmp_path / "p.txt", tmp_path / "l.txt"
    paragraphs.write_text("a\nb\n\nc\n")
    lines.write_text("a\nb\nc\n\n\n")  # trailing blank lines separate nothing
    assert resolve_mode("auto", paragraphs, alone=True) == "blank-lines"
    assert resolve_mode("auto", lines, alone=True) == "lines"
    assert resolve_mode("auto", paragraphs, alone=False) == "file"  # one of several files: a document
    assert resolve_mode("lines", paragraphs, alone=False) == "lines"


def test_a_bad_mode_and_bad_utf8_are_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"--documents 'words' is not a way .* use one of auto, file"):
        check_mode("words")
    with pytest.raises(ValueError):
        check_mode("separator:")
    f = tmp_path / "bad.txt"
    f.write_bytes(b"fine\nbad \xff byte\n")
    with pytest.raises(ValueError, match=r"bad.txt' line 2: not UTF-8"):
        _docs(f, "lines")


def test_one_text_file_prepares_with_a_validation_split_into_a_new_folder(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from shardwise.data.prepare import PrepareOptions, prepare
    from shardwise.data.prepared import open_prepared
    from shardwise.data.toy_tokenizer import train_bpe

    lines = [f"line {i}: a sentence about item {i * 13 % 97} and the weather." for i in range(300)]
    big = tmp_path / "big.txt"
    big.write_text("\n".join(lines) + "\n")
    tok = train_bpe([big], 300, tmp_path / "tokenizer.json")
    out = tmp_path / "fresh" / "data" / "web"  # fresh/ and data/ do not exist
    report = prepare(PrepareOptions(inputs=(str(big),), tokenizer=str(tok), out=str(out), val_fraction=0.05,
                                    workers=1))
    assert report.documents["train"] + report.documents["val"] == len(lines)
    assert report.documents["val"] > 0 and report.documents["train"] > 0
    ds = open_prepared(out)
    t = tokenizers.Tokenizer.from_file(str(tok))
    eos = ds.eos_id
    whole = [i for ln in lines for i in t.encode(ln, add_special_tokens=False).ids + [eos]]
    got = ds.train.tokens.read(0, len(ds.train.tokens)).tolist() + ds.val.tokens.read(0, len(ds.val.tokens)).tolist()
    assert sorted(got) == sorted(whole) and len(got) == len(whole)  # every line once, each followed by EOS


def test_several_text_files_stay_one_document_each_unless_asked(tmp_path):
    pytest.importorskip("tokenizers")
    from shardwise.data.prepare import PrepareOptions, prepare
    from shardwise.data.toy_tokenizer import train_bpe

    files = []
    for k in range(3):
        files.append(tmp_path / f"f{k}.py")
        files[-1].write_text(f"def f{k}():\n    return {k}\n\n\nclass C{k}:\n    pass\n")
    tok = train_bpe(files, 300, tmp_path / "tokenizer.json")
    whole = prepare(PrepareOptions(inputs=tuple(map(str, files)), tokenizer=str(tok), out=str(tmp_path / "a"),
                                   workers=1))
    assert whole.documents["train"] == 3  # source files: one document each
    lines = prepare(PrepareOptions(inputs=tuple(map(str, files)), tokenizer=str(tok), out=str(tmp_path / "b"),
                                   workers=1, documents="lines"))
    assert lines.documents["train"] == sum(len([x for x in f.read_text().splitlines() if x.strip()]) for f in files)


def test_out_under_a_file_is_refused(tmp_path):
    pytest.importorskip("tokenizers")
    from shardwise.data.prepare import PrepareOptions, prepare

    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=r"is a file, not a directory"):
        prepare(PrepareOptions(inputs=(str(tmp_path / "f"),), tokenizer="none", out=str(tmp_path / "f" / "ds")))


def _cfg(**over: str):
    return load_config(overrides={"data.global_batch": "2", "parallel.micro_batch": "1", "model.block_size": "16",
                                  **over})


@pytest.mark.parametrize("name", ["chats.jsonl", "chats.json"])
def test_json_lines_as_data_path_is_refused_naming_prepare(tmp_path, name):
    f = tmp_path / name
    f.write_text("\n".join(json.dumps({"text": "hello there " * 20}) for _ in range(50)))
    with pytest.raises(ValueError) as err:
        check_data(_cfg(**{"data.path": str(f)}))
    text = str(err.value)
    assert "\n" not in text and "JSON Lines, which must be prepared first" in text
    assert f"shardwise prepare {f} --tokenizer TOKENIZER --out DIR" in text


def test_validation_hint_for_a_text_file_names_working_commands(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("some text here. " * 200)
    with pytest.raises(ValueError) as err:
        check_data(_cfg(**{"data.path": str(f), "train.eval_every": "5"}))
    text = str(err.value)
    assert "--data.val_path PATH" in text and "--train.eval_every 0" in text
    assert f"shardwise prepare {f} --tokenizer TOKENIZER --out DIR --val-fraction 0.01" in text
