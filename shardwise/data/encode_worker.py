"""One encoding worker of ``shardwise prepare``: a chunk of inputs in, each split's packed tokens (and SFT masks) out.

``init_worker`` loads the tokenizer once per process; ``encode_chunk`` reads (text files) or parses (JSON lines)
its chunk, decides each document's split, encodes the documents with one ``encode_batch`` call and packs them:
``tokens(doc) + [EOS]`` after each other. SFT examples pack ``tokens(prompt) + tokens(response) + [EOS]`` with a
mask that is 1 on the response and the EOS (the prediction targets) and 0 on the prompt; chat records (a
``messages`` list) pack the tokens of the conversation rendered by the tokenizer's chat template
(``chat_template.py``), then the EOS unless the conversation ends with it, with a mask that is 1 on the assistant
turns only. Workers run with
``TOKENIZERS_PARALLELISM=false``: the parallelism is the processes, one thread each.

The split of a document depends only on its ordinal and its content (``val_unit``), so it is the same for any
number of workers.

This file is also run on its own, outside the package (``serve``, started by ``worker_pool.WorkerPool``): a
worker process then imports only numpy and tokenizers, not shardwise (and torch) — so it imports nothing
relative, and what crosses the pipe is plain tuples and numpy arrays.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import queue
import signal
import struct
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal

import numpy as np

__all__ = ["Chunk", "WorkerConfig", "Part", "ChunkResult", "init_worker", "encode_chunk", "val_unit", "peak_rss_kb",
           "serve", "send_message", "read_message"]


@dataclass(frozen=True)
class Chunk:
    """Work for one worker call. ``kind``: ``files`` (payload: paths, one document each), ``lines`` (payload: raw
    JSON lines of ``source`` starting at line ``first_line``; blank lines are skipped), ``rows`` (payload: texts,
    or (prompt, response) pairs, of a dataset; row numbers from ``first_line``)."""

    kind: Literal["files", "lines", "rows"]
    input_index: int
    first_ordinal: int
    """Document ordinal of the payload's first item (items count from 0 over all inputs, blank lines included)."""
    payload: list[Any]
    source: str = ""
    first_line: int = 1


@dataclass(frozen=True)
class WorkerConfig:
    tokenizer_file: str
    eos_id: int
    dtype: str
    val_fraction: float
    sft: bool
    fields: tuple[str, ...]
    """``(text,)``, or ``(prompt, response)`` with ``sft``."""
    messages_field: str = "messages"
    """With ``sft``: a record holding this field is a chat record."""
    chat_template: str = ""
    """The tokenizer's chat template ("" when it has none: a chat record is then refused)."""
    chat_tokens: tuple[tuple[str, str], ...] = ()
    """(name, string) of the special tokens the template may name (``bos_token``, ``eos_token``, ...)."""


@dataclass
class Part:
    """One split's share of a chunk: packed tokens ``(n,)``, the aligned mask ``(n,)`` uint8 (SFT), documents."""

    tokens: np.ndarray
    mask: np.ndarray | None
    documents: int


@dataclass
class ChunkResult:
    train: Part
    val: Part
    skipped: int
    """Documents without a single token (empty files, empty text fields): left out."""
    nbytes: int
    """UTF-8 bytes of the documents' text."""
    peak_rss_kb: int
    """This process's peak resident set so far (VmHWM), 0 where /proc is not there."""


_STATE: dict[str, Any] = {}


def init_worker(config: WorkerConfig, *, set_env: bool = True) -> None:
    """Load the tokenizer for this process (a pool's initializer; ``set_env=False`` in the main process)."""
    if set_env:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(config.tokenizer_file)
    _STATE.clear()
    _STATE.update(config=config, tok=tok,
                  encode=getattr(tok, "encode_batch_fast", tok.encode_batch))  # _fast: no offsets (tokenizers>=0.20)


def _chat() -> tuple[Any, Any]:
    """``chat_template.py`` (loaded by path: this file imports nothing relative) and the renderer, once."""
    if "chat" not in _STATE:
        import importlib.util

        spec = importlib.util.spec_from_file_location("_shardwise_chat_template",
                                                      os.path.join(os.path.dirname(__file__), "chat_template.py"))
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        _STATE["chat"] = (module, None)
    return _STATE["chat"]


def _renderer(where: str) -> Any:
    module, renderer = _chat()
    cfg: WorkerConfig = _STATE["config"]
    if renderer is None:
        if not cfg.chat_template:
            raise ValueError(f"{where}: a chat record (field {cfg.messages_field!r}), but the tokenizer has no "
                             f"chat_template (tokenizer_config.json or chat_template.jinja); pass --tokenizer a "
                             f"directory whose tokenizer has one")
        renderer = module.ChatRenderer(cfg.chat_template, dict(cfg.chat_tokens))
        _STATE["chat"] = (module, renderer)
    return renderer


def val_unit(ordinal: int, content: bytes) -> float:
    """A number in [0, 1) fixed by the document's ordinal and content: the document goes to val when it is below
    the val fraction (a stable hash: blake2b, not Python's salted ``hash``)."""
    digest = hashlib.blake2b(ordinal.to_bytes(8, "little") + content, digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64


def peak_rss_kb() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _read_file(path: str) -> tuple[str, int]:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8"), len(raw)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path!r} is not UTF-8 text ({exc.reason} at byte {exc.start}); convert it to UTF-8 or "
                         f"leave it out of the inputs (in a directory: --glob '*.py' keeps only matching files)") from None


def _field(obj: Any, name: str, where: str, fields: tuple[str, ...], sft: bool) -> str:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a JSON {type(obj).__name__}, not an object; each line must be one JSON object "
                         f"with a {name!r} field")
    if name not in obj:
        flag = "--field" if not sft else ("--prompt-field" if name == fields[0] else "--response-field")
        chat = ("; a chat record's 'messages' list needs --sft" if not sft and "messages" in obj else
                " (or a chat record's list under --messages-field)" if sft else "")
        raise ValueError(f"{where}: no field {name!r} (fields: {sorted(obj)}); pass {flag} NAME with the field that "
                         f"holds it{chat}")
    value = obj[name]
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {name!r} is a {type(value).__name__}, not a string; store the text as a "
                         f"JSON string")
    return value


def _values(obj: Any, where: str, cfg: WorkerConfig) -> Any:
    """A record's fields: its strings (text, or prompt and response), or a chat record's checked messages."""
    if cfg.sft and isinstance(obj, dict) and cfg.messages_field in obj:
        return _chat()[0].check_messages(obj[cfg.messages_field], where, cfg.messages_field)
    return tuple(_field(obj, f, where, cfg.fields, cfg.sft) for f in cfg.fields)


def _content(values: Any) -> bytes:
    """The bytes the split hash reads: the fields joined by NUL, or a chat record's messages as compact JSON."""
    if isinstance(values, list):
        return json.dumps(values, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode()
    return "\0".join(values).encode()


def _records(chunk: Chunk, cfg: WorkerConfig) -> tuple[list[tuple[int, str, Any]], int]:
    """(ordinal, where, values) of every document of the chunk, and their UTF-8 bytes."""
    out: list[tuple[int, str, Any]] = []
    nbytes = 0
    for j, item in enumerate(chunk.payload):
        ordinal = chunk.first_ordinal + j
        if chunk.kind == "files":
            text, n = _read_file(item)
            out.append((ordinal, item, (text,)))
            nbytes += n
        elif chunk.kind == "lines":
            if not item.strip():
                continue
            where = f"{chunk.source}:{chunk.first_line + j}"
            try:
                obj = json.loads(item)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"{where}: not valid JSON ({exc}); fix the line or remove it") from None
            out.append((ordinal, where, _values(obj, where, cfg)))
            nbytes += len(item)
        else:  # a dataset's row: a text, a (prompt, response) pair or a chat row {messages_field: [...]}
            where = f"{chunk.source} row {chunk.first_line + j}"
            obj = item if isinstance(item, dict) else dict(zip(cfg.fields, item if isinstance(item, tuple) else (item,)))
            out.append((ordinal, where, _values(obj, where, cfg)))
            nbytes += len(_content(out[-1][2]))
    return out, nbytes


def _encode_chats(records: list[tuple[int, str, Any]], cfg: WorkerConfig) -> dict[int, Any]:
    """Each chat record's document (by its position in ``records``): the rendered conversation's tokens (one
    ``encode_batch`` with offsets), the assistant turns' mask, then the EOS (mask 0) unless the conversation ends
    with it. The EOS separates documents, so it must not occur inside a conversation."""
    chats = [(k, r) for k, r in enumerate(records) if isinstance(r[2], list)]
    if not chats:
        return {}
    rendered = [_renderer(r[1]).assistant_spans(r[2], r[1]) for _, r in chats]
    tok = _STATE["tok"]
    special = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    out: dict[int, Any] = {}
    for (k, record), (text, spans), enc in zip(chats, rendered, tok.encode_batch([t for t, _ in rendered],
                                                                                 add_special_tokens=False)):
        ids = list(enc.ids)
        if cfg.eos_id in ids[:-1]:
            free = [t.content for i, t in sorted(tok.get_added_tokens_decoder().items()) if t.special and i not in ids]
            raise ValueError(f"{record[1]}: the chat template writes the document separator "
                             f"{tok.id_to_token(cfg.eos_id)!r} inside the conversation, which would cut it into "
                             f"separate documents; pass --eos-token with a special token it does not write, e.g. "
                             f"{free[:3]}")
        mask = _chat()[0].token_mask(enc.offsets, ids, spans, special)
        if not ids or ids[-1] != cfg.eos_id:
            ids, mask = ids + [cfg.eos_id], mask + [0]
        out[k] = (ids, mask)
    return out


def encode_chunk(chunk: Chunk) -> ChunkResult:
    """Encode and pack one chunk (after ``init_worker``). Raises a one-line ``ValueError`` naming the file (and
    line) of a malformed record, and of an SFT example whose response has no tokens."""
    cfg: WorkerConfig = _STATE["config"]
    records, nbytes = _records(chunk, cfg)
    plain = [r if not isinstance(r[2], list) else (r[0], r[1], ("",) * len(cfg.fields)) for r in records]
    columns = [[r[2][k] for r in plain] for k in range(len(cfg.fields))]
    encoded = [[e.ids for e in _STATE["encode"](col, add_special_tokens=False)] if col else [] for col in columns]
    chats = _encode_chats(records, cfg)
    is_val = [cfg.val_fraction > 0 and val_unit(r[0], _content(r[2])) < cfg.val_fraction for r in records]
    parts: dict[bool, list[Any]] = {False: [], True: []}
    skipped = 0
    for k, record in enumerate(records):
        if k in chats:
            parts[is_val[k]].append(chats[k])
        elif cfg.sft:
            prompt, response = encoded[0][k], encoded[1][k]
            if not response:
                raise ValueError(f"{record[1]}: the response (field {cfg.fields[1]!r}) has no tokens; every SFT "
                                 f"example needs a response to learn; fix the record or remove it")
            parts[is_val[k]].append((prompt + response + [cfg.eos_id], len(prompt)))
        elif encoded[0][k]:
            parts[is_val[k]].append((encoded[0][k] + [cfg.eos_id], None))
        else:
            skipped += 1
    return ChunkResult(train=_pack(parts[False], cfg), val=_pack(parts[True], cfg), skipped=skipped,
                       nbytes=nbytes, peak_rss_kb=peak_rss_kb())


def _pack(docs: list[Any], cfg: WorkerConfig) -> Part:
    """The documents after each other: tokens ``(sum(len),)``; with SFT the aligned 0/1 mask. A document is its
    tokens (its EOS included) and its targets: None (no SFT), the offset where they start (prompt/response: the
    response and the EOS) or the whole 0/1 mask (chat)."""
    total = sum(len(ids) for ids, _ in docs)
    tokens = np.empty(total, dtype=cfg.dtype)
    mask = np.zeros(total, dtype=np.uint8) if cfg.sft else None
    pos = 0
    for ids, targets in docs:
        tokens[pos:pos + len(ids)] = ids
        if isinstance(targets, int):
            mask[pos + targets:pos + len(ids)] = 1  # type: ignore[index]  # the response and its EOS are targets
        elif targets is not None:
            mask[pos:pos + len(ids)] = targets  # type: ignore[index]
        pos += len(ids)
    return Part(tokens=tokens, mask=mask, documents=len(docs))


# --- the worker process (``worker_pool.WorkerPool`` starts this file with ``serve``) ---
# Messages are pickles with an 8-byte little-endian length in front. In: the WorkerConfig's fields, then one chunk
# (its fields as a tuple) per message; end of input ends the worker. Out, per chunk: ("ok", result fields) or
# ("error", "ValueError" | "crash", text).

_LENGTH = struct.Struct("<Q")


def send_message(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)))
    stream.write(data)
    stream.flush()


def read_message(stream: BinaryIO) -> Any:
    """The next message, or raises ``EOFError`` when the stream ends (between or inside messages)."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError
    (n,) = _LENGTH.unpack(head)
    data = stream.read(n)
    if len(data) < n:
        raise EOFError
    return pickle.loads(data)


def result_fields(r: ChunkResult) -> tuple[Any, ...]:
    return (r.train.tokens, r.train.mask, r.train.documents, r.val.tokens, r.val.mask, r.val.documents, r.skipped,
            r.nbytes, r.peak_rss_kb)


def result_from_fields(f: tuple[Any, ...]) -> ChunkResult:
    return ChunkResult(train=Part(f[0], f[1], f[2]), val=Part(f[3], f[4], f[5]), skipped=f[6], nbytes=f[7],
                       peak_rss_kb=f[8])


def _drain(stream: BinaryIO, inbox: queue.Queue) -> None:
    """Read every message into ``inbox`` as it arrives (None at the end): the parent's writes never wait for this
    worker to finish a chunk, so parent and worker never block on each other's full pipe."""
    try:
        while True:
            inbox.put(read_message(stream))
    except (EOFError, OSError):
        inbox.put(None)


def serve() -> None:
    """The worker loop over stdin/stdout. Library output goes to stderr: stdout carries only messages."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent handles it
    out = sys.stdout.buffer
    sys.stdout = sys.stderr
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_drain, args=(sys.stdin.buffer, inbox), daemon=True).start()
    config = inbox.get()
    if config is None:
        return
    init_worker(WorkerConfig(*config))
    while (fields := inbox.get()) is not None:
        try:
            reply: tuple[Any, ...] = ("ok", result_fields(encode_chunk(Chunk(*fields))))
        except ValueError as exc:
            reply = ("error", "ValueError", str(exc))
        except Exception:
            reply = ("error", "crash", traceback.format_exc())
        try:
            send_message(out, reply)
        except OSError:  # the parent is gone
            return
