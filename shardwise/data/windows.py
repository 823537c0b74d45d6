"""Data for training: batch arithmetic, the data-parallel sampler, and a byte-level token-stream dataset.

Nothing here communicates. Data parallelism splits the batch (``S(0)`` over the ``dp`` axis): every dp rank
must see a disjoint shard of each epoch, the *same number* of samples, in an order that every rank can
recompute alone from ``(seed, epoch)`` — so no index lists are ever sent between ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..mesh import Mesh

__all__ = ["BatchPlan", "ShardedSampler", "TokenWindows", "BYTE_VOCAB", "text_to_tokens", "tokens_to_text",
           "load_text_tokens", "iter_batches", "IGNORE", "out_of_vocab", "DataError"]

BYTE_VOCAB = 256
"""Vocabulary size of the byte-level tokeniser: one token per byte value."""


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """How one optimizer step's samples are split: ``global_batch = micro_batch × grad_accum × dp``.

    This is the one place that rule is checked. Each dp rank runs ``grad_accum`` forward/backward passes
    of ``micro_batch`` samples per step, so the step sees ``global_batch`` samples in total.
    """

    global_batch: int
    """Samples per optimizer step, summed over all data-parallel ranks and accumulation steps."""
    micro_batch: int
    """Samples in one forward/backward pass on one rank."""
    grad_accum: int
    """Forward/backward passes per optimizer step on each rank (gradients are summed, synced once)."""
    dp: int
    """Number of data-parallel ranks (size of the ``dp`` mesh axis)."""

    def __post_init__(self) -> None:
        for name in ("global_batch", "micro_batch", "grad_accum", "dp"):
            _positive_int(f"BatchPlan.{name}", getattr(self, name))
        product = self.micro_batch * self.grad_accum * self.dp
        if product != self.global_batch:
            raise ValueError(
                f"global_batch must equal micro_batch × grad_accum × dp, but {self.micro_batch} × {self.grad_accum} "
                f"× {self.dp} = {product} ≠ global_batch={self.global_batch}; use BatchPlan.from_sizes(global_batch="
                f"{self.global_batch}, micro_batch={self.micro_batch}, dp={self.dp}) to infer grad_accum")

    @staticmethod
    def from_sizes(*, global_batch: int, micro_batch: int, dp: int = 1) -> "BatchPlan":
        """Infer ``grad_accum = global_batch / (micro_batch × dp)``; ``ValueError`` if it is not a whole number."""
        for name, value in (("global_batch", global_batch), ("micro_batch", micro_batch), ("dp", dp)):
            _positive_int(name, value)
        per_pass = micro_batch * dp
        if global_batch % per_pass != 0:
            lower, upper = global_batch // per_pass * per_pass, (global_batch // per_pass + 1) * per_pass
            nearest = f"{lower} or {upper}" if lower else f"{upper}"
            other = (f"or a micro_batch that divides global_batch / dp = {global_batch // dp}"
                     if global_batch % dp == 0 else f"(dp={dp} must divide global_batch)")
            raise ValueError(
                f"global_batch={global_batch} is not a multiple of micro_batch × dp = {micro_batch} × {dp} = {per_pass}, "
                f"so no whole number of accumulation steps fits; use global_batch={nearest} {other}")
        return BatchPlan(global_batch=global_batch, micro_batch=micro_batch, grad_accum=global_batch // per_pass, dp=dp)

    @property
    def rank_batch(self) -> int:
        """Samples one dp rank consumes per optimizer step (``micro_batch × grad_accum``)."""
        return self.micro_batch * self.grad_accum


def check_grad_accum(global_batch: int, micro_batch: int, grad_accum: int, dp: int) -> None:
    """``ValueError`` in ``shardwise train``'s words when a given ``parallel.grad_accum`` (0: inferred) breaks
    ``global_batch = micro_batch × grad_accum × dp``, naming the flags that fix it."""
    product = micro_batch * grad_accum * dp
    if not grad_accum or product == global_batch:
        return
    fits = global_batch % (micro_batch * dp) == 0
    raise ValueError(
        f"batch arithmetic: data.global_batch = {global_batch} must equal parallel.micro_batch × parallel.grad_accum "
        f"× dp = {micro_batch} × {grad_accum} × {dp} = {product}; set --data.global_batch {product}"
        + (f", or --parallel.grad_accum {global_batch // (micro_batch * dp)}" if fits else "")
        + ", or leave parallel.grad_accum at 0 to infer it")


class ShardedSampler:
    """Indices of one data-parallel rank's shard of a dataset, reshuffled every epoch.

    Order: with ``shuffle`` the epoch's order is ``torch.randperm(dataset_len)`` from a ``torch.Generator``
    seeded with ``seed + epoch`` — identical on every rank, different each epoch, no communication.
    Sharding is *strided*: rank ``r`` takes positions ``r, r + dp_size, r + 2·dp_size, …`` of that order,
    so the i-th micro-batch of all ranks together is a contiguous slice of the global order (the same
    samples a single device would see at that step with a dp× larger batch).

    Uneven tail (``dataset_len`` not a multiple of ``dp_size``): every rank must yield the *same* number
    of samples, because each step ends in a collective (the gradient all-reduce) — a rank with one more
    batch would wait in that collective forever. ``drop_last=True`` (default) drops the last
    ``dataset_len % dp_size`` positions of the epoch's order (different samples each epoch when
    shuffling); ``drop_last=False`` pads by wrapping around to the start of the order, so a few samples
    are seen twice in that epoch.

    Position: the sampler counts what it has yielded in the current epoch; ``state_dict()`` /
    ``load_state_dict()`` save and restore ``(epoch, offset)`` so a resumed run continues with exactly the
    remaining indices.
    """

    def __init__(self, dataset_len: int, *, dp_size: int, dp_rank: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True) -> None:
        _positive_int("dataset_len", dataset_len)
        _positive_int("dp_size", dp_size)
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank!r}")
        if drop_last and dataset_len < dp_size:
            raise ValueError(
                f"dataset_len={dataset_len} < dp_size={dp_size} with drop_last=True leaves every rank with no samples; "
                f"use a dataset of at least {dp_size} samples or drop_last=False (wrap-around padding)")
        self.dataset_len, self.dp_size, self.dp_rank = dataset_len, dp_size, dp_rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.offset = 0
        """Indices of the current epoch already yielded by this rank."""

    @classmethod
    def for_mesh(cls, dataset_len: int, *, mesh: "Mesh", axis: str = "dp", **kwargs: Any) -> "ShardedSampler":
        """The sampler of this rank's coordinate along ``axis``; ranks differing only on other axes (e.g.
        tensor-parallel peers) get the same shard, as they must. Does not communicate."""
        return cls(dataset_len, dp_size=mesh.size(axis), dp_rank=mesh.coord(axis), **kwargs)

    @property
    def num_samples(self) -> int:
        """Samples this rank yields per epoch (equal on every rank)."""
        if self.drop_last:
            return self.dataset_len // self.dp_size
        return -(-self.dataset_len // self.dp_size)

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's permutation. Moving to a different epoch restarts at offset 0; setting the
        epoch already loaded by ``load_state_dict`` keeps the restored offset (so the usual
        ``for e in range(start, n): sampler.set_epoch(e)`` loop resumes mid-epoch)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        if epoch != self.epoch:
            self.epoch, self.offset = epoch, 0

    def epoch_indices(self) -> list[int]:
        """All of this rank's indices for the current epoch, in order (ignores ``offset``)."""
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_len, generator=gen)
        else:
            order = torch.arange(self.dataset_len)
        total = self.num_samples * self.dp_size
        if total > self.dataset_len:
            # Wrap around (possibly several times when dataset_len < dp_size) to pad the tail.
            order = order.repeat(-(-total // self.dataset_len))
        return order[:total][self.dp_rank::self.dp_size].tolist()

    def __iter__(self) -> Iterator[int]:
        if self.offset >= self.num_samples:
            self.offset = 0  # re-iterating a finished epoch without set_epoch repeats its order
        indices = self.epoch_indices()
        while self.offset < len(indices):
            index = indices[self.offset]
            self.offset += 1
            yield index

    def state_dict(self, *, consumed: int | None = None) -> dict[str, int]:
        """``{"epoch", "offset", ...}`` as plain ints. Pass ``consumed`` (samples of this epoch actually
        trained on) when a prefetching loader has pulled indices ahead of training."""
        offset = self.offset if consumed is None else consumed
        if not 0 <= offset <= self.num_samples:
            raise ValueError(f"consumed must be in [0, {self.num_samples}] (samples per epoch on this rank), got {offset}")
        return {"epoch": self.epoch, "offset": offset, "seed": self.seed, "dataset_len": self.dataset_len,
                "dp_size": self.dp_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the position. The shard layout (seed, dataset_len, dp_size) must match the saved one,
        otherwise the remaining order would differ silently."""
        for key in ("seed", "dataset_len", "dp_size"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]} but this sampler has {key}={getattr(self, key)}; "
                                 f"build the sampler with {key}={state[key]} to resume this position")
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset <= self.num_samples:
            raise ValueError(f"invalid sampler state epoch={epoch}, offset={offset}: need epoch >= 0 and "
                             f"0 <= offset <= {self.num_samples}")
        self.epoch, self.offset = epoch, offset


class TokenWindows(torch.utils.data.Dataset):
    """Fixed-length training windows over one 1-D token stream.

    Sample ``i`` is ``tokens[i·stride : i·stride + block_size + 1]`` split into ``idx`` (the first
    ``block_size`` tokens) and ``targets`` (the same window shifted by one), both int64 ``(block_size,)``.
    ``stride`` defaults to ``block_size`` (non-overlapping windows). The stream may be stored compactly as
    uint16 (vocabularies up to 65,536); windows are converted to int64 on access.

    ``tokens`` is a 1-D tensor or a ``TokenStream`` of a prepared dataset (memory-mapped shards: ``len`` and
    ``read(start, stop)`` → int64). ``mask`` (same length, 0/1): where token ``j`` does not count as a target
    (supervised fine-tuning: prompt tokens), its target is ``IGNORE`` (-100), which every loss of the trainer
    skips.

    ``vocab`` (optional): every window's ids are checked to be below it, so a damaged shard that the launch check
    did not sample fails as one line naming the id, the vocabulary and ``source`` (e.g. ``data.path = 'DIR'``), not
    inside the embedding.
    """

    def __init__(self, tokens: Any, block_size: int, *, stride: int | None = None, mask: Any = None,
                 vocab: int | None = None, source: str = "") -> None:
        if isinstance(tokens, Tensor):
            if tokens.dim() != 1:
                raise ValueError(f"tokens must be a 1-D tensor, got {tuple(tokens.shape)}")
            if tokens.dtype not in (torch.uint8, torch.uint16, torch.int32, torch.int64):
                raise TypeError(f"tokens must be an integer tensor (uint8/uint16/int32/int64), got {tokens.dtype}")
        elif not hasattr(tokens, "read"):
            raise ValueError(f"tokens must be a 1-D tensor or a token stream, got {type(tokens).__name__}")
        _positive_int("block_size", block_size)
        self.stride = block_size if stride is None else _positive_int("stride", stride)
        n = _length(tokens)
        if n < block_size + 1:
            raise ValueError(f"a token stream of {n} tokens is too short for one window of "
                             f"block_size={block_size} (needs block_size + 1 = {block_size + 1}); "
                             "use more text or a smaller block_size")
        if mask is not None and _length(mask) != n:
            raise ValueError(f"mask has {_length(mask)} entries for {n} tokens; they must align one to one")
        self.tokens, self.block_size, self.mask = tokens, block_size, mask
        self.vocab, self.source = vocab, source

    def __len__(self) -> int:
        return (_length(self.tokens) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"window {i} out of range for {len(self)} windows")
        start = (i % len(self)) * self.stride
        window = _read(self.tokens, start, start + self.block_size + 1)
        if self.vocab is not None and int(window.max()) >= self.vocab:
            raise DataError(out_of_vocab(int(window.max()), self.vocab, self.source, f"tokens {start}.."))
        targets = window[1:]
        if self.mask is not None:  # mask[j] = 0: token j is not a target (its prediction is not trained)
            keep = _read(self.mask, start + 1, start + self.block_size + 1).bool()
            targets = targets.masked_fill(~keep, IGNORE)
        return window[:-1], targets


IGNORE = -100
"""Target id of a position that does not count (``F.cross_entropy``'s default ``ignore_index``)."""


class DataError(ValueError):
    """A problem of the training data met while reading it (a token id outside the vocabulary): its one-line
    message says everything, so a rank reports it without a traceback."""


def out_of_vocab(token: int, vocab: int, what: str, where: str = "") -> str:
    """The one-line message of a token id outside the model's vocabulary (launch check and run time alike);
    ``what`` names the data (``data.path = 'DIR'``), ``where`` the place in it."""
    at = f" ({where})" if where else ""
    return (f"{what or 'the data'} holds token id {token}{at}, but the model's vocabulary has {vocab} ids "
            f"(0..{vocab - 1}); the data is damaged or was tokenized for another model: set --model.vocab_size "
            f"{token + 1} or larger, or prepare it again (shardwise prepare ... --force)")


def _length(stream: Any) -> int:
    return stream.numel() if isinstance(stream, Tensor) else len(stream)


def _read(stream: Any, start: int, stop: int) -> Tensor:
    """``stream[start:stop]`` as int64: a tensor slice, or a prepared stream's ``read`` (memory-mapped)."""
    if isinstance(stream, Tensor):
        return stream[start:stop].to(torch.int64)
    return stream.read(start, stop)


def iter_batches(dataset: TokenWindows, sampler: ShardedSampler, batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Stack the sampler's indices into ``(idx, targets)`` batches of shape (batch_size, block_size).

    A trailing partial batch is dropped so every rank runs the same number of steps (see ShardedSampler);
    the sampler's offset therefore counts exactly the samples handed out in full batches.
    """
    _positive_int("batch_size", batch_size)
    remaining = sampler.num_samples - (sampler.offset if sampler.offset < sampler.num_samples else 0)
    if remaining < batch_size:
        return
    it = iter(sampler)
    for _ in range(remaining // batch_size):
        rows = [dataset[next(it)] for _ in range(batch_size)]
        yield torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def text_to_tokens(text: str | bytes) -> Tensor:
    """Byte-level tokeniser: UTF-8 bytes as token ids in [0, 256), a 1-D uint16 tensor."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.uint16)


def tokens_to_text(tokens: Tensor) -> str:
    """Inverse of ``text_to_tokens`` (invalid UTF-8, e.g. a cut multi-byte character, becomes U+FFFD)."""
    values = tokens.reshape(-1).to(torch.int64)  # uint16 lacks min/max kernels
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= BYTE_VOCAB):
        raise ValueError(f"byte tokens must be in [0, {BYTE_VOCAB}), got range [{int(values.min())}, {int(values.max())}]")
    return bytes(values.tolist()).decode("utf-8", errors="replace")


def load_text_tokens(path: str | Path) -> Tensor:
    """Read a text file's raw bytes as byte-level tokens (no decoding, so any encoding works)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"text data file {str(p)!r} does not exist; pass the path of a text file")
    return text_to_tokens(p.read_bytes())
