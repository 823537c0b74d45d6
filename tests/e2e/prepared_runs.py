"""The prepared datasets and the one-process loss-masked run that several e2e modules compare against
(``test_train_data``, ``test_train_cp``): built once per session by the fixtures in ``conftest.py``.

Nothing here imports ``tokenizers`` at import time: the fixtures skip without it, the modules that use them run."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from tests.e2e.runs import cli, losses

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon "
         "phi chi psi omega").split()
G, T, K = 8, 32, 2
SMALL = ["--model.vocab_size", "512", "--model.block_size", str(T), "--model.n_layer", "2", "--data.global_batch",
         str(G), "--parallel.micro_batch", "2", "--train.steps", "4", "--train.eval_every", "2",
         "--train.eval_batches", str(K), "--optimizer.warmup_steps", "0", "--train.log_every", "1"]
ONE = ["--parallel.nproc", "1"]


def doc(i: int) -> str:
    return " ".join(WORDS[(i * 7 + j * j) % len(WORDS)] for j in range(40 + i % 13)) + ".\n"


def make_data(root: Path) -> Path:
    """A 120-document corpus, a 400-token BPE (``tok``), the prepared dataset (``ds``, 10 % validation) and an SFT
    dataset (``sft``) under ``root``."""
    from shardwise.data.toy_tokenizer import train_bpe

    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(120):
        (corpus / f"{i:03d}.txt").write_text(doc(i) * 3)
    tok = train_bpe(sorted(corpus.glob("*.txt")), 400, root / "tok")
    proc = cli(root, "prepare", "corpus", "--tokenizer", str(tok), "--out", "ds", "--val-fraction", "0.1")
    assert proc.returncode == 0, proc.stderr
    lines = [json.dumps({"prompt": doc(i)[:60], "response": doc(i + 1)}) for i in range(120)]
    (root / "chats.jsonl").write_text("\n".join(lines) + "\n")
    proc = cli(root, "prepare", "chats.jsonl", "--sft", "--tokenizer", str(tok), "--out", "sft",
               "--val-fraction", "0.1")
    assert proc.returncode == 0, proc.stderr
    return root


def evals(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "eval"]


def train_run(data: Path, dataset: str, name: str, layout: list[str]) -> tuple[dict, list, str]:
    """``shardwise train`` on ``data/dataset`` with ``SMALL`` in ``layout``: (losses, evals, stdout)."""
    proc = cli(data, "train", "--data.path", dataset, *SMALL, *layout, "--train.name", name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return losses(data / "runs" / name), evals(data / "runs" / name), proc.stdout


def reference_val_loss(run: Path, dataset: Path) -> float:
    """Plain torch: the final checkpoint's weights, the first K·G validation windows in order, mean CE per token."""
    from shardwise.cli.export import consolidate
    from shardwise.data.prepared import open_prepared
    from shardwise.runtime.config import load_config
    from shardwise.runtime.model_build import build_model

    cfg = load_config(path=run / "config.json")
    model = build_model(cfg.model)
    state, _ = consolidate(run)
    model.load_state_dict(state)
    stream = open_prepared(dataset).val.tokens
    rows = torch.stack([stream.read(i * T, i * T + T + 1) for i in range(K * G)])
    with torch.no_grad():
        logits = model(rows[:, :-1])
    return float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1)))
