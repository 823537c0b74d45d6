"""What reading a prepared dataset and the validation pass cost inside `shardwise train` (RESULTS, "Real data").

    python benchmarks/data_eval_cost.py [--steps 60] [--layouts dp2,zero3,tp2,pp2] [--train-flags "..."]

Builds a small corpus from the Python standard library's own sources (present wherever Python is), trains a
4,096-token byte-level BPE on it with the `tokenizers` package, runs `shardwise prepare`, then for each layout
trains the default job's shape (gpt-tiny: 32 sequences × 256 tokens per step) on the prepared data with
`--train.eval_every` and reports, from the run's metrics.jsonl:

* data share: the median time the step spends fetching its batch (memory-mapped reads, int64 conversion) over
  the median step time (steps after the first two);
* eval / forward: one validation pass's time (median over passes) over what its forwards cost inside training:
  ``eval_batches`` × the median forward time of a training step (each step forwards one global batch too).
  1.0 means the pass costs its forwards and nothing more; below 1.0, no autograd graph is being recorded.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

LAYOUTS = {
    "dp2": ["--parallel.dp", "2"],
    "zero3": ["--parallel.dp", "2", "--parallel.zero_stage", "3"],
    "tp2": ["--parallel.tp", "2"],
    "pp2": ["--parallel.pp", "2"],
}


def _corpus(root: Path) -> Path:
    """The .py files of a few standard-library packages, copied under ``root/corpus`` (no caches, no binaries)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = root / "corpus"
    for pkg in ("email", "json", "logging", "http", "asyncio", "unittest", "xml"):
        for f in sorted((lib / pkg).rglob("*.py")):
            dest = out / pkg / f.relative_to(lib / pkg)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dest)
    return out


def _shardwise(*args: str, cwd: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "shardwise.cli", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"shardwise {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def _measure(run: Path, eval_batches: int) -> dict[str, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "kind" not in r][2:]
    evals = [r for r in rows if r.get("kind") == "eval"]
    step_s = statistics.median(r["step_s"] for r in steps)
    data_s = statistics.median(r["data_s"] for r in steps)
    fwd_s = statistics.median(r["fwd_s"] for r in steps)
    eval_s = statistics.median(r["eval_s"] for r in evals)
    return {"step_s": step_s, "data_s": data_s, "data_share": data_s / step_s, "fwd_s": fwd_s, "eval_s": eval_s,
            "eval_over_forwards": eval_s / (eval_batches * fwd_s), "val_loss": evals[-1]["val_loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--train-flags", default="", help="more shardwise train flags, e.g. a larger model")
    args = parser.parse_args()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = Path(tempfile.mkdtemp(prefix="sw-data-bench-"))
    corpus = _corpus(root)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(f) for f in sorted(corpus.rglob("*.py"))], trainer)
    tok.save(str(root / "tokenizer.json"))
    print(_shardwise("prepare", str(corpus), "--tokenizer", str(root / "tokenizer.json"), "--out", str(root / "ds"),
                     "--val-fraction", "0.05", cwd=root).strip().splitlines()[-1])
    every = max(args.steps // 4, 1)
    print(f"{'layout':8} {'step ms':>8} {'data ms':>8} {'data %':>7} {'fwd ms':>8} {'eval ms':>8} {'eval/fwds':>9}")
    for name in args.layouts.split(","):
        _shardwise("train", "--data.path", str(root / "ds"), "--model.vocab_size", "4096", "--parallel.nproc", "2",
                   *LAYOUTS[name], "--train.steps", str(args.steps), "--train.eval_every", str(every),
                   "--train.eval_batches", str(args.eval_batches), "--train.name", name, "--train.ckpt_every", "0",
                   *args.train_flags.split(), cwd=root)
        m = _measure(root / "runs" / name, args.eval_batches)
        print(f"{name:8} {1e3 * m['step_s']:8.1f} {1e3 * m['data_s']:8.2f} {100 * m['data_share']:6.2f}% "
              f"{1e3 * m['fwd_s']:8.1f} {1e3 * m['eval_s']:8.1f} {m['eval_over_forwards']:9.2f}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
