"""Rank-side checks for shared-memory point-to-point (``comm/shm_p2p.py``), run by test_comm_shm_p2p.py.

Every payload is a pure function of (seed, sender coordinate, message number), so a receiver rebuilds the
expected bytes on its own, independently of the code under test, and compares bytes (NaN-safe, any dtype).
"""

from __future__ import annotations

import os
import random
import time

import torch

import shardwise as sw
from shardwise.comm import CommCounter
from shardwise.comm.shm_p2p import shm_link_for
from shardwise.comm.shm_segment import NAME_PREFIX, SHM_DIR
from tests.dist.fault_worlds import report_and_exit
from tests.dist.meshes import mesh

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64]
SHAPES = [(), (1,), (2,), (3,), (7,), (1001,), (0,), (2, 0, 3), (3, 5, 7), (65,), (4099,)]
SMALL_RING = 4096
"""Bytes per channel for the streaming checks: most messages below are many times larger."""


def payload(seed: int, sender: int, k: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random bytes (random 0/1 for bool) as a ``dtype`` tensor of ``shape``: reproducible on any rank."""
    g = torch.Generator().manual_seed((seed * 1009 + sender) * 100_003 + k)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    numel = 1
    for d in shape:
        numel *= d
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) if a.numel() else True


def _neighbours(m: sw.Mesh) -> tuple[int, int, int, int]:
    n, me = m.size("pp"), m.coord("pp")
    return n, me, (me + 1) % n, (me - 1) % n


def check_every_dtype_and_shape() -> list[str]:
    """Each rank sends every dtype x shape to the next coordinate and receives from the previous one (a
    ring), and checks the bytes; an empty tensor gives ``None`` handles on both ends."""
    m = mesh(pp=-1)
    link = shm_link_for(m, "pp")
    n, me, nxt, prv = _neighbours(m)
    failures, k = [], 0
    for dtype in DTYPES:
        for shape in SHAPES:
            out = payload(1, me, k, shape, dtype)
            got = torch.empty(shape, dtype=dtype)
            r = link.irecv(got, prv)
            s = link.isend(out, nxt)
            if (r is None) != (got.numel() == 0) or (s is None) != (out.numel() == 0):
                failures.append(f"{dtype} {shape}: handles {r}, {s}")
            for h in (s, r):
                if h is not None:
                    h.wait()
            if not _same(got, payload(1, prv, k, shape, dtype)):
                failures.append(f"{dtype} {shape}: bytes differ")
            k += 1
    return failures


def check_streaming_both_ways(count: int, wait_order: str) -> list[str]:
    """With a 4 KiB ring, every rank sends ``count`` messages (sizes from 1 B to 300 KB) to *both*
    neighbours at once and receives theirs; neighbours therefore stream to each other simultaneously. Receives
    are posted up front and waited for in ``wait_order`` (``forward``, ``reverse``, ``random``); sends after."""
    m = mesh(pp=-1)
    link = shm_link_for(m, "pp", ring_bytes=SMALL_RING)
    n, me, nxt, prv = _neighbours(m)
    peers = [nxt] if n == 2 else [nxt, prv]
    sizes = [random.Random(k).choice([1, 3, 63, 64, 65, 4096, 4097, 70_001, 300_000]) for k in range(count)]
    dtype_of = lambda k: [torch.float32, torch.uint8, torch.float64, torch.bfloat16][k % 4]  # noqa: E731
    shape_of = lambda k: (max(1, sizes[k] // torch.empty(0, dtype=dtype_of(k)).element_size()),)  # noqa: E731
    recvs, sends = [], []
    for frm in peers:
        for k in range(count):
            buf = torch.empty(shape_of(k), dtype=dtype_of(k))
            recvs.append((frm, k, buf, link.irecv(buf, frm, tag=k % 3)))
    for k in range(count):
        for to in peers:
            sends.append(link.isend(payload(2, me, k * n + to, shape_of(k), dtype_of(k)), to, tag=k % 3))
    order = list(recvs)
    if wait_order == "reverse":
        order.reverse()
    elif wait_order == "random":
        random.Random(me).shuffle(order)
    for _, _, _, h in order:
        h.wait()
    for h in sends:
        h.wait()
    return [f"message {k} from {frm}" for frm, k, buf, _ in recvs
            if not _same(buf, payload(2, frm, k * n + me, shape_of(k), dtype_of(k)))]


def check_completion_polling() -> list[str]:
    """``is_completed()`` alone (no ``wait``) makes a receive progress; a send that fits is done at once."""
    m = mesh(pp=-1)
    link = shm_link_for(m, "pp")
    n, me, nxt, prv = _neighbours(m)
    got = torch.empty(1000)
    r = link.irecv(got, prv)
    s = link.isend(payload(3, me, 0, (1000,), torch.float32), nxt)
    failures = [] if s.is_completed() else ["a 4 KB send into an empty 1+ MiB channel is not done at once"]
    deadline = time.monotonic() + 60
    while not r.is_completed():
        if time.monotonic() > deadline:
            return failures + ["is_completed() never became true"]
        time.sleep(1e-4)
    if not _same(got, payload(3, prv, 0, (1000,), torch.float32)):
        failures.append("polled receive: bytes differ")
    return failures


def count_messages() -> dict[str, int]:
    """``CommCounter`` sees every shm message with its bytes, and no collective record."""
    m = mesh(pp=-1)
    link = shm_link_for(m, "pp")
    n, me, nxt, prv = _neighbours(m)
    with CommCounter() as c:
        hs = [link.irecv(torch.empty(10, dtype=torch.float64), prv), link.irecv(torch.empty(3, dtype=torch.int8), prv),
              link.irecv(torch.empty(0), prv), link.isend(torch.ones(10, dtype=torch.float64), nxt),
              link.isend(torch.ones(3, dtype=torch.int8), nxt), link.isend(torch.empty(0), nxt)]
        for h in hs:
            if h is not None:
                h.wait()
    return {"sent": c.messages_sent, "bytes_sent": c.bytes_sent, "received": c.messages_received,
            "bytes_received": c.bytes_received, "records": len(c.records)}


def check_bad_inputs() -> dict[str, str]:
    """Argument errors (``ValueError``, the link stays usable) and a receive that does not match the next
    message (``ShmError`` on the receiver naming both sizes; that link is unusable afterwards)."""
    from shardwise.comm.shm_sync import ShmError

    m = mesh(pp=-1)
    link = shm_link_for(m, "pp")
    n, me, nxt, prv = _neighbours(m)
    out: dict[str, str] = {}
    for name, call in (("self", lambda: link.isend(torch.ones(2), me)),
                       ("range", lambda: link.irecv(torch.ones(2), n)),
                       ("strided", lambda: link.isend(torch.ones(4, 4).t(), nxt))):
        try:
            call()
            out[name] = ""
        except ValueError as exc:
            out[name] = str(exc)
    spare = shm_link_for(m, "pp", ring_bytes=SMALL_RING * 2)  # a separate segment: this one gets broken
    s = spare.isend(torch.ones(10), nxt)
    try:
        spare.irecv(torch.empty(12), prv).wait()
        out["mismatch"] = ""
    except ShmError as exc:
        out["mismatch"] = str(exc)
    s.wait()
    try:
        spare.isend(torch.ones(1), nxt)
        out["after"] = ""
    except ShmError as exc:
        out["after"] = str(exc)
    out["still_ok"] = str(not check_every_dtype_and_shape())  # the first link works on
    return out


def leftover_segments() -> list[str]:
    """Segment files of this process' pid in /dev/shm (none may remain once a link is set up)."""
    shm_link_for(mesh(pp=-1), "pp")
    return [f for f in os.listdir(SHM_DIR) if f.startswith(f"{NAME_PREFIX}{os.getpid()}-")]


def _exchange(link: object, numel: int, k: int) -> None:
    """One ring step: send ``numel`` floats to the next coordinate, receive the previous one's."""
    n, me = link.n, link.me  # type: ignore[attr-defined]
    got = torch.empty(numel)
    r = link.irecv(got, (me - 1) % n)  # type: ignore[attr-defined]
    s = link.isend(payload(4, me, k, (numel,), torch.float32), (me + 1) % n)  # type: ignore[attr-defined]
    r.wait()
    s.wait()
    assert _same(got, payload(4, (me - 1) % n, k, (numel,), torch.float32))


def fault_rank(rank: int, n: int, init_file: str, victim: int, results: object) -> None:
    """One rank of a fresh world (spawned by the test, not LocalWorld): after a working exchange, rank
    ``victim`` exits (``os._exit``) in the middle of streaming its next message (after 5 pieces through a
    4 KiB ring). The others keep exchanging and report what they raised, how long it took, what a later call
    raises and whether the segment file exists."""
    from shardwise.comm.shm_sync import ShmError
    from shardwise.world import init

    init(backend="gloo", init_method=f"file://{init_file}", rank=rank, world_size=n, timeout_s=600)
    m = sw.Mesh(pp=-1)
    link = shm_link_for(m, "pp", ring_bytes=SMALL_RING)
    _exchange(link, 1000, 0)
    if rank == victim:
        push, pieces = link._push, [0]

        def dying(op: object, who: int) -> bool:
            moved = push(op, who)  # type: ignore[arg-type]
            pieces[0] += moved
            if pieces[0] == 5:
                os._exit(3)
            return moved
        link._push = dying  # type: ignore[method-assign]
    start = time.monotonic()
    try:
        for k in range(1, 10_000):
            _exchange(link, 50_000, k)
        outcome = ("no error", "")
    except ShmError as exc:
        outcome = (type(exc).__name__, str(exc))
    elapsed = time.monotonic() - start
    try:
        link.isend(torch.ones(3), (rank + 1) % n)
        later = "no error"
    except ShmError as exc:
        later = f"{type(exc).__name__}: {exc}"
    left = os.path.exists(os.path.join(SHM_DIR, link.name))
    report_and_exit(results, (rank, outcome, elapsed, later, left))


def pipeline_fault_rank(rank: int, n: int, init_file: str, victim: int, results: object) -> None:
    """One rank of a fresh world: a GPT pipeline (1F1B, ``transport="shm"``) trains one step; in the next,
    rank ``victim`` exits (``os._exit``) right after posting its third message. The others report what their
    step raised, how long it took and whether the link's segment file exists."""
    from shardwise.comm.shm_sync import ShmError
    from shardwise.models.gpt import lm_loss
    from shardwise.world import init
    from tests.dist.pipeline_checks import _batches, _model

    init(backend="gloo", init_method=f"file://{init_file}", rank=rank, world_size=n, timeout_s=600)
    m = sw.Mesh(pp=-1)
    pipe = sw.pipeline(_model(n, True), m, "pp", microbatches=6, schedule="1f1b", loss_fn=lm_loss,
                       transport="shm")
    (idx, tgt), *_ = _batches()
    pipe.step(idx, tgt)
    link = pipe.interpreter.p2p
    assert link is not None
    if rank == victim:
        isend, sent = link.isend, [0]

        def dying(t: torch.Tensor, to: int, tag: int = 0) -> object:
            h = isend(t, to, tag)
            sent[0] += 1
            if sent[0] == 3:
                os._exit(3)
            return h
        link.isend = dying  # type: ignore[method-assign]
    start = time.monotonic()
    try:
        pipe.step(idx, tgt)
        outcome = ("no error", "")
    except ShmError as exc:
        outcome = (type(exc).__name__, str(exc))
    left = os.path.exists(os.path.join(SHM_DIR, link.name))
    report_and_exit(results, (rank, outcome, time.monotonic() - start, left))
