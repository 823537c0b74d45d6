"""The default training corpus: English-like text generated from a tiny grammar (no downloads, no licence).

Sentences are drawn from fixed word lists with a seeded ``random.Random``, so every rank (and every run)
generates the identical byte stream. The structure — spelling, word boundaries, agreement of a few fixed
phrases, punctuation — is easy to learn at byte level, so the loss of a small GPT falls visibly within a
few hundred steps (from ln 256 ≈ 5.5 nats towards ~1.3).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

    from .windows import ShardedSampler, TokenWindows

__all__ = ["generated_text", "load_corpus", "StepBatches"]

_SUBJECTS = ["the cat", "a small dog", "the old sailor", "my neighbour", "the red fox", "a tired student",
             "the baker", "our teacher", "the young queen", "a quiet robot", "the farmer", "every child"]
_VERBS = ["watches", "finds", "carries", "paints", "follows", "remembers", "builds", "sells", "opens", "loves"]
_OBJECTS = ["a blue boat", "the wooden door", "an apple", "the long letter", "a bright lamp", "the garden",
            "seven stones", "the map", "a warm coat", "the last train", "a paper bird", "the river"]
_PLACES = ["in the morning", "near the market", "under the bridge", "after the rain", "at the station",
           "before dinner", "by the sea", "on a cold night"]
_ENDINGS = [".", ".", ".", "!", "?"]


def _sentence(rng: random.Random) -> str:
    words = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    if rng.random() < 0.6:
        words += f" {rng.choice(_PLACES)}"
    if rng.random() < 0.3:
        words += f" and {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    return words[0].upper() + words[1:] + rng.choice(_ENDINGS)


def generated_text(n_bytes: int = 1_000_000, *, seed: int = 0) -> str:
    """About ``n_bytes`` of generated paragraphs (ASCII, so one byte per character); deterministic in ``seed``."""
    if n_bytes < 1:
        raise ValueError(f"n_bytes must be >= 1, got {n_bytes}")
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        paragraph = " ".join(_sentence(rng) for _ in range(rng.randint(2, 5))) + "\n"
        parts.append(paragraph)
        size += len(paragraph)
    return "".join(parts)[:n_bytes]


def load_corpus(path: str, fmt: str = "auto") -> "torch.Tensor":
    """The token stream of ``data.path``: the generated corpus when empty, a text file as bytes, or a
    pre-tokenized ``.bin`` of little-endian uint16 ids. Returns a 1-D uint16 tensor."""
    import torch

    from .windows import load_text_tokens, text_to_tokens

    if not path:
        return text_to_tokens(generated_text())
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"data.path = {path!r} does not exist; pass a text file or a uint16 .bin file")
    if p.stat().st_size == 0:
        raise ValueError(f"data.path = {path!r} is empty (0 bytes); pass a text file or uint16 .bin file with "
                         f"tokens in it, or drop --data to train on the generated corpus")
    if fmt == "bin" or (fmt == "auto" and p.suffix == ".bin"):
        size = p.stat().st_size
        if size % 2:
            raise ValueError(f"data.path = {path!r} has {size} bytes, not a whole number of uint16 tokens; "
                             f"write the ids as little-endian uint16 (numpy: ids.astype('<u2').tofile(path))")
        return torch.from_file(str(p), shared=False, size=size // 2, dtype=torch.uint16)
    return load_text_tokens(p)


class StepBatches:
    """This rank's micro-batches, one optimizer step at a time, and the data position as training state.

    Step ``k`` of an epoch uses positions ``[k·G, (k+1)·G)`` of the epoch's shared order (G = global batch),
    strided over dp ranks by ``ShardedSampler``; steps per epoch = ⌊windows / G⌋ whatever the layout, so
    every layout — and a resumed run — sees the same samples at the same step.

    ``prefetch`` (default: on CUDA): each ``next`` also gathers the following step's rows into pinned host
    memory and starts their copy to the GPU on a side stream, so the copy overlaps this step's compute and the
    host never waits on a pageable copy; the consumer's stream waits on the copy's event. The data position
    (``state_dict``) stays the consumer's: the prefetched step is not consumed until ``next`` returns it. On
    CPU ``prefetch=True`` gathers ahead without pinning or streams (what the tests check).
    """

    def __init__(self, dataset: "TokenWindows", sampler: "ShardedSampler", *, micro_batch: int, grad_accum: int,
                 device: "torch.device", transform: "Callable[[list[tuple[torch.Tensor, torch.Tensor]]], list[tuple[torch.Tensor, torch.Tensor]]] | None" = None,
                 prefetch: bool | None = None) -> None:
        self.dataset, self.sampler, self.device = dataset, sampler, device
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.transform = transform
        """Applied to each step's pairs (context parallelism: this rank's sequence chunks)."""
        self._order: tuple[int, list[int]] | None = None
        self.prefetch = device.type == "cuda" if prefetch is None else prefetch
        self._ahead: _Ahead | None = None
        """The next step's batch in flight, and the sampler position before it was taken."""

    def next(self) -> list[tuple["torch.Tensor", "torch.Tensor"]]:
        """``grad_accum`` pairs ``(idx, targets)`` of shape (micro_batch, block_size), int64 on the device."""
        if not self.prefetch:
            x, y = self._rows()
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        else:
            ahead = self._ahead or self._launch()
            self._ahead = None
            x, y = ahead.wait()
            self._ahead = self._launch()  # the following step's copy overlaps this step's compute
        pairs = list(zip(x.split(self.micro_batch), y.split(self.micro_batch)))
        return self.transform(pairs) if self.transform is not None else pairs

    def _rows(self) -> tuple["torch.Tensor", "torch.Tensor"]:
        """The next step's rows on the host, ``(idx, targets)`` each (grad_accum·micro_batch, block_size);
        advances the sampler."""
        import torch

        need = self.micro_batch * self.grad_accum
        if self.sampler.offset + need > self.sampler.num_samples:
            self.sampler.set_epoch(self.sampler.epoch + 1)
        if self._order is None or self._order[0] != self.sampler.epoch:
            self._order = (self.sampler.epoch, self.sampler.epoch_indices())
        picked = self._order[1][self.sampler.offset:self.sampler.offset + need]
        self.sampler.offset += need
        rows = [self.dataset[i] for i in picked]
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])

    def _launch(self) -> "_Ahead":
        position = (self.sampler.epoch, self.sampler.offset)
        return _Ahead(*self._rows(), self.device, position)

    def _position(self) -> tuple[int, int]:
        """``(epoch, offset)`` of the consumer: before the prefetched step, if one is in flight."""
        return self._ahead.position if self._ahead is not None else (self.sampler.epoch, self.sampler.offset)

    def state_dict(self) -> dict[str, int]:
        """Layout-free position: the epoch and the samples of it consumed by *all* dp ranks together."""
        epoch, offset = self._position()
        return {"epoch": epoch, "global_offset": offset * self.sampler.dp_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        dp = self.sampler.dp_size
        if state["global_offset"] % dp:
            raise ValueError(f"saved data position {state['global_offset']} is not divisible by dp={dp}; "
                             f"resume with a dp that divides the global batch")
        self._ahead = None  # a prefetched step of the old position is dropped
        self.sampler.load_state_dict({"epoch": state["epoch"], "offset": state["global_offset"] // dp})


class _Ahead:
    """One step's ``(idx, targets)`` on their way to ``device``. On CUDA: copied from pinned host memory on a
    side stream (``non_blocking``); ``wait`` makes the current stream wait for the copy and marks the tensors
    as used there (``record_stream``: the allocator must not hand their memory out again before the current
    stream is done with them). Elsewhere: the host tensors as they are (``.to`` a CPU device is a no-op)."""

    _streams: "dict[torch.device, torch.cuda.Stream]" = {}

    def __init__(self, x: "torch.Tensor", y: "torch.Tensor", device: "torch.device", position: tuple[int, int]) -> None:
        import torch

        self.position = position
        self.host = (x, y)  # kept alive until consumed (the pinned allocator also waits for the copy's event)
        self.event: torch.cuda.Event | None = None
        if device.type != "cuda":
            self.tensors = (x.to(device), y.to(device))
            return
        # the copy's device memory comes from the side stream's pool; record_stream in wait() keeps it from
        # being reused before the consumer's stream is done with it, so the copy need not wait for that stream
        stream = self._streams.setdefault(device, torch.cuda.Stream(device))
        with torch.cuda.stream(stream):
            self.tensors = (x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True))
            self.event = torch.cuda.Event()
            self.event.record(stream)

    def wait(self) -> tuple["torch.Tensor", "torch.Tensor"]:
        import torch

        if self.event is not None:
            current = torch.cuda.current_stream(self.tensors[0].device)
            current.wait_event(self.event)
            for t in self.tensors:
                t.record_stream(current)
        return self.tensors
