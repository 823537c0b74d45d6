"""``shardwise train`` on a ``shardwise prepare`` dataset, as a user runs it: the validation loss in every layout
equals plain torch's cross-entropy of the final weights on the same validation windows; loss-masked (SFT) data
trains to the same losses in another layout; and the data checks refuse, in one line, what cannot work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.runs import cli

pytest.importorskip("tokenizers")

from shardwise.data.toy_tokenizer import train_bpe  # noqa: E402
from tests.e2e.prepared_runs import G, K, SMALL, T, train_run  # noqa: E402
from tests.e2e.prepared_runs import evals as _evals, reference_val_loss as _reference_val_loss  # noqa: E402

# data: the session fixture of tests/e2e/conftest.py (a corpus, its BPE, the prepared ``ds`` and ``sft``), shared
# with test_train_cp; sft_one: the one-process run on ``sft`` both modules compare against.


@pytest.mark.parametrize("layout", [["--parallel.nproc", "1"], ["--parallel.nproc", "2"],
                                    ["--parallel.nproc", "2", "--parallel.pp", "2"],
                                    ["--parallel.nproc", "2", "--parallel.tp", "2", "--parallel.zero_stage", "3"]],
                         ids=["one", "dp2", "pp2", "tp2-zero3"])
def test_validation_loss_equals_plain_torch(data: Path, layout: list[str], request: pytest.FixtureRequest):
    name = "v-" + request.node.callspec.id
    proc = cli(data, "train", "--data.path", "ds", *SMALL, *layout, "--train.name", name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    evals = _evals(data / "runs" / name)
    assert [e["step"] for e in evals] == [2, 4]
    assert all(e["val_tokens"] == K * G * T and e["val_batches"] == K for e in evals)
    assert evals[-1]["val_loss"] == pytest.approx(_reference_val_loss(data / "runs" / name, data / "ds"), rel=1e-5)
    assert "eval  step      4  val_loss" in proc.stdout
    summary = [json.loads(line) for line in (data / "runs" / name / "metrics.jsonl").read_text().splitlines()][-1]
    assert summary["kind"] == "summary" and summary["final_val_loss"] == evals[-1]["val_loss"]
    if request.node.callspec.id == "one":  # the plot draws the validation points next to the training loss
        from shardwise.cli.plot import plot_run

        pngs = plot_run(data / "runs" / name, data / "plots")
        assert (data / "plots" / "loss.png") in pngs and (data / "plots" / "loss.png").stat().st_size > 0


def test_loss_masked_data_trains_alike_in_two_layouts(data: Path, sft_one: tuple[dict, list, str]):
    (one, one_evals, _) = sft_one
    (pp, pp_evals, _) = train_run(data, "sft", "sftpp", ["--parallel.nproc", "2", "--parallel.pp", "2"])
    assert one == pytest.approx(pp, rel=1e-5)
    assert [e["val_loss"] for e in one_evals] == pytest.approx([e["val_loss"] for e in pp_evals], rel=1e-5)
    # only response tokens count: fewer counted than the K·G·T targets of the batches
    assert 0 < one_evals[-1]["val_tokens"] < K * G * T


@pytest.mark.parametrize("args, expect", [
    (["--data.path", "ds", "--model.vocab_size", "256"],
     ("data.path = ", "was tokenized with a vocabulary of {V} tokens but model.vocab_size = 256",
      "set --model.vocab_size {V} or larger")),
    (["--data.path", "noval", "--model.vocab_size", "512", "--train.eval_every", "5"],
     ("train.eval_every = 5 needs validation data", "has no validation split (prepared with --val-fraction 0)")),
    (["--data.path", "ds", "--model.vocab_size", "512", "--train.eval_every", "5", "--data.val_path", "other"],
     ("was tokenized with another tokenizer", "prepare both with the same --tokenizer")),
    (["--data.path", "half", "--model.vocab_size", "512"], ("half-written or not a prepared dataset",)),
], ids=["vocab-too-small", "no-val-split", "val-other-tokenizer", "half-written"])
def test_bad_data_is_one_line_before_launch(data: Path, args: list[str], expect: tuple[str, ...]):
    if not (data / "other").exists():  # the same corpus under another tokenizer
        tok = train_bpe(sorted((data / "corpus").glob("*.txt"))[:50], 300, data / "tok2")
        assert cli(data, "prepare", "corpus", "--tokenizer", str(tok), "--out", "other").returncode == 0
        assert cli(data, "prepare", "corpus", "--tokenizer", str(data / "tok"), "--out", "noval").returncode == 0
        (data / "half").mkdir()
        (data / "half" / "train-00000.bin").write_bytes(b"\0" * 64)  # shards without an index: a killed prepare
    proc = cli(data, "train", *args, "--train.name", "bad")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("shardwise train: error: "), err
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(data / "tok")).get_vocab_size(with_added_tokens=True)
    for text in expect:
        assert text.replace("{V}", str(vocab)) in err, (text, err)
    assert not (data / "runs" / "bad").exists()


def test_vocabulary_comes_from_the_prepared_dataset(data: Path):
    """No --model.vocab_size: the model takes the vocabulary the dataset's index states (the tokenizer's size,
    read here from the tokenizer itself), and config.json records it."""
    from tokenizers import Tokenizer

    proc = cli(data, "train", "--data.path", "ds", "--model.block_size", str(T), "--train.steps", "1",
               "--parallel.nproc", "1", "--train.name", "vocab")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    saved = json.loads((data / "runs" / "vocab" / "config.json").read_text())
    assert saved["model"]["vocab_size"] == Tokenizer.from_file(str(data / "tok")).get_vocab_size(with_added_tokens=True)
