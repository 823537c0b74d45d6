"""``shardwise prepare``: text, JSON Lines or a ``datasets`` dataset → tokenized, memory-mappable shards.

``prepare(PrepareOptions(...))`` checks everything it can before any work (flags, inputs, tokenizer, the output
directory), then streams the inputs in chunks (``inputs.chunks``) to ``workers`` encoding processes
(``worker_pool``, ``encode_worker``; with one worker, this process encodes), writes their results in input order into each
split's shards (``shard_writer.ShardWriter``), writes the index ``dataset.json`` last and publishes the directory
atomically. At most ``2 × workers`` chunks are in flight, so memory does not grow with the corpus.

The output, and the reader ``open_prepared``, are described in docs/data.md; the index format is
``FORMAT`` below.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections import deque
from contextlib import contextmanager
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from .inputs import Input, chunks, discover
from .worker_pool import WorkerPool
from .tokenizer_info import EOS_CANDIDATES, TokenizerInfo, load_tokenizer_info, require_tokenizers
from .chat_template import ChatRenderer, find_chat_template
from .encode_worker import Chunk, ChunkResult, WorkerConfig, encode_chunk, init_worker, peak_rss_kb
from .shard_writer import ShardWriter, publish, remove_stale_temps, temp_dir_for, write_json_synced
from .prepared import FORMAT, INDEX, SPLIT_RULE
from .text_documents import check_mode

__all__ = ["PrepareOptions", "PrepareReport", "prepare", "default_workers", "check_options"]


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True, kw_only=True)
class PrepareOptions:
    """The flags of ``shardwise prepare`` (same names)."""

    inputs: tuple[str, ...]
    tokenizer: str
    out: str
    val_fraction: float = 0.0
    workers: int = dataclasses.field(default_factory=default_workers)
    field: str = "text"
    sft: bool = False
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"
    """With ``sft``: a record (or dataset column) with this field is a chat record, rendered by the tokenizer's
    chat template (``chat_template.py``)."""
    force: bool = False
    shard_tokens: int = 2 ** 28
    eos_token: str | None = None
    glob: tuple[str, ...] = ()
    """Patterns a directory's files must match (name or relative path) to be read; empty: every file."""
    documents: str = "auto"
    """How text files are cut into documents (``text_documents``): auto, file, blank-lines, lines, separator:STR."""

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.prompt_field, self.response_field) if self.sft else (self.field,)


@dataclass
class PrepareReport:
    """What a prepare did (the summary line, the benchmark)."""

    out: Path
    documents: dict[str, int]
    tokens: dict[str, int]
    skipped: int
    nbytes: int
    seconds: float
    peak_rss_kb: int
    """Peak resident set of this process (VmHWM)."""
    worker_peak_rss_kb: int
    """The largest peak resident set among the worker processes (0 with one worker: it is this process)."""
    shards: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    """Each split's shard entries of the index (none for an empty split)."""
    max_id: dict[str, int] = dataclasses.field(default_factory=dict)
    """Each split's largest token id (the index's ``max_id``: checked against the model's vocabulary at launch)."""


def check_options(o: PrepareOptions) -> None:
    """The flags alone (no file is touched). One-line ``ValueError`` naming the value and the fix."""
    if not (isinstance(o.val_fraction, (int, float)) and 0.0 <= o.val_fraction < 1.0) or math.isnan(o.val_fraction):
        raise ValueError(f"--val-fraction must be in [0, 1), got {o.val_fraction}; e.g. --val-fraction 0.01 (0: no "
                         f"validation split)")
    if o.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {o.workers}; e.g. --workers {default_workers()}")
    if o.shard_tokens < 1:
        raise ValueError(f"--shard-tokens must be >= 1, got {o.shard_tokens}; e.g. --shard-tokens {2 ** 28}")
    check_mode(o.documents)
    if o.sft and o.prompt_field == o.response_field:
        raise ValueError(f"--prompt-field and --response-field are both {o.prompt_field!r}; name two fields")


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise ValueError(f"--out {str(out)!r} already exists; pass --force to replace it, or another directory")
    if out.exists() and not (out.is_dir() and ((out / INDEX).is_file() or not any(out.iterdir()))):
        raise ValueError(f"--out {str(out)!r} is not a prepared dataset (no {INDEX}) and not empty; refusing to "
                         f"replace it even with --force; pass a new directory")
    above = next((p for p in out.absolute().parents if p.exists()), None)
    if above is not None and not above.is_dir():  # the parents are created (mkdir -p) once every check passed
        raise ValueError(f"--out {str(out)!r}: {str(above)!r} is a file, not a directory; pass a path under a "
                         f"directory")


def prepare(options: PrepareOptions, *, progress: Callable[[ChunkResult], None] | None = None) -> PrepareReport:
    """Prepare the dataset (module docstring). Raises a one-line ``ValueError`` for bad flags or inputs, before any
    work where they can be seen without reading the inputs; a failure later removes everything it wrote."""
    check_options(options)
    out = Path(options.out)
    _check_out(out, options.force)
    info = load_tokenizer_info(options.tokenizer, eos_token=options.eos_token)
    template, chat_tokens = find_chat_template(info.file.parent) if options.sft else ("", {})
    if template and options.eos_token is None:
        info = _chat_separator(info, template, chat_tokens)
    inputs = discover(options.inputs, sft=options.sft, fields=options.fields, globs=options.glob,
                      messages_field=options.messages_field)
    out.parent.mkdir(parents=True, exist_ok=True)  # `--out data/web` in a fresh folder: data/ is made
    remove_stale_temps(out)
    tmp = temp_dir_for(out)
    t0 = time.perf_counter()
    tmp.mkdir()
    try:
        _copy_tokenizer(info, tmp)
        cfg = WorkerConfig(tokenizer_file=str(tmp / "tokenizer.json"), eos_id=info.eos_id, dtype=info.dtype,
                           val_fraction=float(options.val_fraction), sft=options.sft, fields=options.fields,
                           messages_field=options.messages_field, chat_template=template,
                           chat_tokens=tuple(sorted(chat_tokens.items())))
        report = _encode_all(options, inputs, cfg, tmp, progress)
        write_json_synced(tmp / INDEX, _index(options, info, inputs, report))
        publish(tmp, out, force=options.force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report.out, report.seconds = out, time.perf_counter() - t0
    return report


def _chat_separator(info: TokenizerInfo, template: str, chat_tokens: dict[str, str]) -> TokenizerInfo:
    """The document separator for SFT data with a chat template: the tokenizer's EOS, unless the template writes
    it inside a conversation (Llama 3 and Qwen instruct tokenizers name their end-of-turn token as EOS); then the
    first of ``EOS_CANDIDATES`` that is a special token the template does not write (``<|end_of_text|>``,
    ``<|endoftext|>``). Probed on a two-exchange conversation; without jinja2 the EOS stays (a chat record then
    fails with the install hint)."""
    probe = [{"role": r, "content": c} for r, c in (("user", "a"), ("assistant", "b"), ("user", "c"),
                                                     ("assistant", "d"))]
    tok = require_tokenizers().Tokenizer.from_file(str(info.file))
    try:
        ids = tok.encode(ChatRenderer(template, chat_tokens).render(probe), add_special_tokens=False).ids
    except Exception:  # no jinja2, or a template that refuses the probe: the records decide
        return info
    if info.eos_id not in ids[:-1]:
        return info
    specials = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    free = next((n for n in EOS_CANDIDATES if n in specials and specials[n] not in ids), None)
    return info if free is None else dataclasses.replace(info, eos_token=free, eos_id=specials[free])


def _copy_tokenizer(info: TokenizerInfo, tmp: Path) -> None:
    shutil.copyfile(info.file, tmp / "tokenizer.json")
    for side in info.side_files:
        shutil.copyfile(side, tmp / side.name)


@contextmanager
def _encoder(cfg: WorkerConfig, workers: int) -> Iterator[Callable[[Chunk], Any]]:
    """``submit(chunk)`` → an object whose ``result()`` is the ``ChunkResult``: ``workers`` processes
    (``worker_pool``), or this process for one worker."""
    if workers > 1:
        with WorkerPool(workers, cfg) as pool:
            yield pool.submit
        return
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one worker = one thread, as in the pool's processes
    init_worker(cfg, set_env=False)
    try:
        yield _Done
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


class _Done:
    """A chunk encoded in this process at once."""

    def __init__(self, chunk: Chunk) -> None:
        self._result = encode_chunk(chunk)

    def result(self) -> ChunkResult:
        return self._result


def _encode_all(o: PrepareOptions, inputs: list[Input], cfg: WorkerConfig, tmp: Path,
                progress: Callable[[ChunkResult], None] | None) -> PrepareReport:
    writers = {s: ShardWriter(tmp, s, cfg.dtype, o.shard_tokens, masked=o.sft) for s in ("train", "val")}
    report = PrepareReport(out=tmp, documents={"train": 0, "val": 0}, tokens={}, skipped=0, nbytes=0, seconds=0.0,
                           peak_rss_kb=0, worker_peak_rss_kb=0)
    in_flight: deque[tuple[int, Any]] = deque()

    def collect() -> None:
        index, fut = in_flight.popleft()
        res: ChunkResult = fut.result()
        for split in ("train", "val"):
            part = getattr(res, split)
            writers[split].write(part.tokens, part.mask)
            report.documents[split] += part.documents
            inputs[index].documents += part.documents
        report.skipped += res.skipped
        report.nbytes += res.nbytes
        if o.workers > 1:
            report.worker_peak_rss_kb = max(report.worker_peak_rss_kb, res.peak_rss_kb)
        if progress is not None:
            progress(res)

    with _encoder(cfg, o.workers) as submit:
        for chunk in chunks(inputs, fields=cfg.fields, documents=o.documents,
                            messages_field=o.messages_field if o.sft else None):
            in_flight.append((chunk.input_index, submit(chunk)))
            if len(in_flight) >= 2 * o.workers:
                collect()
        while in_flight:
            collect()
    report.tokens = {s: w.tokens for s, w in writers.items()}
    report.max_id = {s: w.max_id for s, w in writers.items()}
    report.peak_rss_kb = peak_rss_kb()
    report.shards = {s: w.close() for s, w in writers.items()}
    _check_counts(o, report, inputs)
    return report


def _check_counts(o: PrepareOptions, report: PrepareReport, inputs: list[Input]) -> None:
    docs = report.documents["train"] + report.documents["val"]
    names = ", ".join(repr(i.arg) for i in inputs)
    if docs == 0:
        empty = f" ({report.skipped} empty)" if report.skipped else ""
        raise ValueError(f"the inputs {names} hold no documents with any tokens{empty}; pass files with text in "
                         f"them (JSON Lines: a non-empty {o.fields[0]!r} field)")
    if o.val_fraction > 0 and (report.documents["val"] == 0 or report.documents["train"] == 0):
        empty_split = "val" if report.documents["val"] == 0 else "train"
        cut = ("; text files are cut into documents by --documents (auto: a lone file at blank lines, else at line "
               "ends; several files whole), e.g. --documents lines"
               if any(k == "text" for i in inputs for _, k in i.files) else "")
        raise ValueError(f"--val-fraction {o.val_fraction} left the {empty_split} split empty: too few documents "
                         f"({docs}, {report.documents['train']} train / {report.documents['val']} val); pass more "
                         f"documents, another --val-fraction, or --val-fraction 0 (no validation split){cut}")


def _index(o: PrepareOptions, info: TokenizerInfo, inputs: list[Input], report: PrepareReport) -> dict[str, Any]:
    splits: dict[str, Any] = {}
    for split, shards in report.shards.items():
        if shards:
            splits[split] = {"tokens": report.tokens[split], "documents": report.documents[split],
                             "max_id": report.max_id.get(split, -1), "shards": shards}
    return {
        "format": FORMAT,
        "tokenizer": {"file": "tokenizer.json", "sha256": info.sha256, "eos_token": info.eos_token},
        "vocab_size": info.vocab_size, "eos_id": info.eos_id, "dtype": info.dtype,
        "total_tokens": sum(report.tokens.values()),
        "splits": splits,
        "val_fraction": o.val_fraction,
        "split_rule": SPLIT_RULE if o.val_fraction > 0 else "none: --val-fraction 0",
        "shard_tokens": o.shard_tokens,
        "inputs": [{"path": i.arg, "kind": i.kind, "files": len(i.files), "documents": i.documents} for i in inputs],
        "text_documents": o.documents,
        "skipped_empty_documents": report.skipped,
        "sft": o.sft,
        "fields": ({"prompt": o.prompt_field, "response": o.response_field, "messages": o.messages_field}
                   if o.sft else {"text": o.field}),
    }
