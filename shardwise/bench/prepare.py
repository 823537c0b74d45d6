"""``shardwise bench prepare``: throughput and memory of ``shardwise prepare`` against the ``tokenizers`` package's own
``encode_batch`` of the same documents on the same number of cores.

    shardwise bench prepare --corpus-mb 24 --workers 1,2 --rounds 3

The corpus is the Python standard library's ``.py`` files (``sysconfig.get_paths()["stdlib"]``, on every machine;
the UTF-8 ones, in sorted order, cycled until ``--corpus-mb``), one document per file; the tokenizer a byte-level
BPE of ``--vocab`` tokens trained here on its first 4 MB (``runtime/toy_tokenizer.py``). Every measurement runs in a
fresh process (``--measure``, hidden), rounds interleave the two sides:

* **baseline**: the documents read into a list first (not timed), then one ``Tokenizer.encode_batch(docs,
  add_special_tokens=False)`` with ``RAYON_NUM_THREADS=N`` — encoding only, nothing read or written; and the
  same with ``encode_batch_fast`` (no character offsets: what prepare's workers call, where tokenizers has it);
* **prepare**: the whole ``prepare`` call with ``--workers N`` (tokenizer check, reading, encoding in N processes,
  shards, checksums, fsync, the index), with ``--workers 1`` in this process on one thread.

Both count the same tokens (prepare's minus its one EOS per document; checked). Memory: the peak resident set
(VmHWM) of prepare's main process and of its largest worker, for the corpus and for ``--memory-scale`` times it,
against the baseline's (which holds the whole corpus and every encoding at once).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "main"]

TRAIN_MB = 4.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus-mb", type=float, default=24.0, help="corpus size in MB (default 24)")
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts (default 1,2)")
    parser.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size (default 8192)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per worker count (default 3)")
    parser.add_argument("--memory-scale", type=float, default=3.0,
                        help="the memory row's second corpus is this many times --corpus-mb (default 3; 0: skip)")
    parser.add_argument("--dir", default=None, help="work directory; its corpus/, corpus-big/ and ds/ are replaced (default: a temporary one, removed after)")
    parser.add_argument("--json", default=None, help="write the results as JSON to this file")
    parser.add_argument("--measure", choices=("baseline", "baseline-fast", "prepare"), default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("--corpus", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=1, help=argparse.SUPPRESS)


def _validate(args: argparse.Namespace) -> list[int]:
    try:
        workers = [int(w) for w in str(args.workers).split(",") if w.strip()]
    except ValueError:
        raise ValueError(f"--workers must be comma-separated ints, got {args.workers!r}; e.g. --workers 1,2") from None
    if not workers or min(workers) < 1:
        raise ValueError(f"--workers must be ints >= 1, got {args.workers!r}; e.g. --workers 1,2")
    if args.corpus_mb <= 0 or args.rounds < 1 or args.vocab < 257 or args.memory_scale < 0:
        raise ValueError(f"--corpus-mb > 0, --rounds >= 1, --vocab >= 257 and --memory-scale >= 0 are needed, got "
                         f"{args.corpus_mb}, {args.rounds}, {args.vocab}, {args.memory_scale}; e.g. the defaults")
    return workers


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        if "site-packages" in p.parts or not p.is_file():
            continue
        try:
            p.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(p)
    return out


def _make_corpus(dest: Path, files: list[Path], mb: float) -> float:
    """Copy ``files`` (cycled) into ``dest`` as 00000.py, 00001.py, ... until ``mb`` MB; returns the MB written."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    size, i = 0, 0
    while size < mb * 1e6:
        src = files[i % len(files)]
        shutil.copyfile(src, dest / f"{i:06d}.py")
        size += src.stat().st_size
        i += 1
    return size / 1e6


def _run_measure(kind: str, corpus: Path, tokenizer: Path, n: int, work: Path) -> dict[str, Any]:
    env = {**os.environ, "RAYON_NUM_THREADS": str(n), "TOKENIZERS_PARALLELISM": "true" if n > 1 else "false"}
    cmd = [sys.executable, "-m", "shardwise.cli", "bench", "prepare", "--measure", kind, "--corpus", str(corpus),
           "--tokenizer", str(tokenizer), "--n", str(n), "--dir", str(work)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} measurement failed ({out.returncode}):\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _measure(args: argparse.Namespace) -> int:
    """One measurement in this fresh process; prints one JSON line."""
    from ..data.prepare import PrepareOptions, prepare
    from ..data.encode_worker import peak_rss_kb

    corpus, tokenizer = Path(args.corpus), Path(args.tokenizer)
    if args.measure.startswith("baseline"):
        from tokenizers import Tokenizer

        from ..data.inputs import discover

        tok = Tokenizer.from_file(str(tokenizer))
        paths = [p for p, _ in discover([str(corpus)], sft=False, fields=("text",))[0].files]
        docs = [p.read_bytes().decode("utf-8") for p in paths]  # as prepare reads them: no newline translation
        encode = tok.encode_batch_fast if args.measure == "baseline-fast" else tok.encode_batch
        t0, c0 = time.perf_counter(), time.process_time()
        encodings = encode(docs, add_special_tokens=False)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        row = {"seconds": seconds, "cpu_s": cpu, "tokens": sum(len(e.ids) for e in encodings),
               "documents": len(docs),
               "nbytes": sum(len(d.encode()) for d in docs), "peak_rss_kb": peak_rss_kb(), "worker_peak_rss_kb": 0}
    else:
        t0, c0 = time.perf_counter(), time.process_time()
        report = prepare(PrepareOptions(inputs=(str(corpus),), tokenizer=str(tokenizer), out=str(Path(args.dir) / "ds"),
                                        workers=args.n, force=True))
        seconds = time.perf_counter() - t0
        children = resource.getrusage(resource.RUSAGE_CHILDREN)  # the workers, reaped when the pool closed
        row = {"seconds": seconds, "cpu_s": time.process_time() - c0 + children.ru_utime + children.ru_stime,
               "tokens": sum(report.tokens.values()), "documents": sum(report.documents.values()),
               "nbytes": report.nbytes, "peak_rss_kb": report.peak_rss_kb,
               "worker_peak_rss_kb": report.worker_peak_rss_kb}
    print(json.dumps(row))
    return 0


def _throughput(args: argparse.Namespace, workers: list[int], corpus: Path, tok: Path, work: Path) -> list[dict]:
    rows = []
    for n in workers:
        runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "baseline-fast": [], "prepare": []}
        for _ in range(args.rounds):
            for kind in runs:
                runs[kind].append(_run_measure(kind, corpus, tok, n, work))
        base, ours = runs["baseline"][0], runs["prepare"][0]
        if ours["tokens"] - ours["documents"] != base["tokens"]:
            raise RuntimeError(f"prepare wrote {ours['tokens']} tokens for {ours['documents']} documents, the "
                               f"baseline encoded {base['tokens']}: not the same encoding")
        tb = statistics.median(r["seconds"] for r in runs["baseline"])
        tp = statistics.median(r["seconds"] for r in runs["prepare"])
        tf = statistics.median(r["seconds"] for r in runs["baseline-fast"])
        cpu = {k: statistics.median(r["cpu_s"] for r in v) for k, v in runs.items()}
        rows.append({"workers": n, "baseline_s": tb, "baseline_fast_s": tf, "prepare_s": tp, "ratio": tp / tb,
                     "cpu_s": cpu,
                     "ratio_fast": tp / tf,
                     "baseline_tok_s": base["tokens"] / tb, "prepare_tok_s": ours["tokens"] / tp,
                     "mb_s": ours["nbytes"] / 1e6 / tp, "tokens": ours["tokens"], "documents": ours["documents"],
                     "rounds": {k: [r["seconds"] for r in v] for k, v in runs.items()}})
    return rows


def _memory(args: argparse.Namespace, workers: list[int], corpora: list[tuple[Path, float]], tok: Path,
            work: Path) -> list[dict]:
    rows = []
    n = max(workers)
    for corpus, mb in corpora:
        ours = _run_measure("prepare", corpus, tok, n, work)
        base = _run_measure("baseline", corpus, tok, n, work)
        rows.append({"corpus_mb": mb, "workers": n, "main_mb": ours["peak_rss_kb"] / 1024,
                     "worker_mb": ours["worker_peak_rss_kb"] / 1024, "baseline_mb": base["peak_rss_kb"] / 1024})
    return rows


def _print(throughput: list[dict], memory: list[dict], corpus_mb: float, docs: int) -> None:
    print(f"corpus: {corpus_mb:.1f} MB of Python stdlib sources, {docs} documents; median of the rounds")
    print(f"{'workers':>7} {'encode_batch s':>14} {'_fast s':>8} {'prepare s':>10} {'ratio':>6} {'vs _fast':>8} "
          f"{'baseline tok/s':>15} {'prepare tok/s':>14} {'prepare MB/s':>12}  CPU s: batch, _fast, prepare")
    for r in throughput:
        cpu = r["cpu_s"]
        print(f"{r['workers']:>7} {r['baseline_s']:>14.2f} {r['baseline_fast_s']:>8.2f} {r['prepare_s']:>10.2f} "
              f"{r['ratio']:>6.2f} {r['ratio_fast']:>8.2f} {r['baseline_tok_s']:>15,.0f} {r['prepare_tok_s']:>14,.0f} "
              f"{r['mb_s']:>12.1f}  {cpu['baseline']:.2f}, {cpu['baseline-fast']:.2f}, {cpu['prepare']:.2f}")
    if memory:
        print(f"peak resident set (VmHWM), --workers {memory[0]['workers']}:")
        print(f"{'corpus MB':>9} {'prepare main MB':>15} {'largest worker MB':>17} {'encode_batch MB':>15}")
        for m in memory:
            print(f"{m['corpus_mb']:>9.1f} {m['main_mb']:>15.0f} {m['worker_mb']:>17.0f} {m['baseline_mb']:>15.0f}")


def _bench(args: argparse.Namespace, workers: list[int], work: Path) -> int:
    from ..data.toy_tokenizer import train_bpe

    files = _stdlib_files()
    corpus_mb = _make_corpus(work / "corpus", files, args.corpus_mb)
    train_files, size = [], 0
    for p in sorted((work / "corpus").iterdir()):
        train_files.append(p)
        size += p.stat().st_size
        if size >= TRAIN_MB * 1e6:
            break
    tok = train_bpe(train_files, args.vocab, work / "tokenizer.json")
    throughput = _throughput(args, workers, work / "corpus", tok, work)
    corpora = [(work / "corpus", corpus_mb)]
    if args.memory_scale > 0:
        corpora.append((work / "corpus-big", _make_corpus(work / "corpus-big", files, args.corpus_mb * args.memory_scale)))
    memory = _memory(args, workers, corpora, tok, work)
    _print(throughput, memory, corpus_mb, throughput[0]["documents"])
    if args.json:
        Path(args.json).write_text(json.dumps({"corpus_mb": corpus_mb, "vocab": args.vocab, "throughput": throughput,
                                               "memory": memory, "cpus": os.cpu_count()}, indent=1))
    return 0


def main(args: argparse.Namespace) -> int:
    if args.measure:
        return _measure(args)
    try:
        workers = _validate(args)
        import tokenizers  # noqa: F401
    except ValueError as exc:
        print(f"shardwise bench prepare: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError:
        print('shardwise bench prepare: error: needs the tokenizers package; install it with: pip install '
              '"shardwise[data]"', file=sys.stderr)
        return 2
    if args.dir:
        work = Path(args.dir)
        work.mkdir(parents=True, exist_ok=True)
        return _bench(args, workers, work)
    with tempfile.TemporaryDirectory(prefix="shardwise-bench-prepare-") as tmp:
        return _bench(args, workers, Path(tmp))
