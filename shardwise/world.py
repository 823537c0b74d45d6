"""Joining the job: ``sw.init`` / ``World`` and the rank's side of launching. The only module that reads
environment variables.

``init()`` joins the job torchrun started (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``), or — with no torchrun environment — makes a world of size 1 so the same script runs on
one process unchanged. ``bind_to_launcher`` ties a rank's life to the launcher that started it
(``runtime/launch.py``'s ``run_local``, which passes its pid in ``SHARDWISE_LAUNCHER_PID``).
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass
from typing import Literal, NoReturn

import torch
import torch.distributed as dist

__all__ = ["World", "init", "shutdown", "exit_process", "barrier_all", "env_flag", "bind_to_launcher", "LAUNCHER_PID"]

LAUNCHER_PID = "SHARDWISE_LAUNCHER_PID"
"""Set by ``run_local`` for its ranks: the pid of the launcher process, whose death must end them."""

Backend = Literal["gloo", "nccl"]


@dataclass(frozen=True)
class World:
    """What ``init`` joined."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


def env_flag(name: str, default: str = "") -> str:
    """Read one ``SHARDWISE_*`` setting (kept here so no other module touches ``os.environ``)."""
    return os.environ.get(name, default)


def init(*, backend: Backend | None = None, timeout_s: float = 60.0, init_method: str | None = None,
         rank: int | None = None, world_size: int | None = None) -> World:
    """Initialise ``torch.distributed`` for this process and return what was joined.

    Under torchrun the rank and world size come from its environment. ``init_method``/``rank``/``world_size``
    may be given explicitly (the test harness does, with a ``file://`` rendezvous). With neither, this is a
    world of size 1 (an in-memory store; nothing listens on the network). ``backend`` defaults to NCCL when
    CUDA is available and gloo otherwise; with NCCL the device is ``cuda:LOCAL_RANK``. ``timeout_s`` bounds
    every collective, so a dead peer turns into an error instead of a hang.
    Calling ``init`` again in an initialised process returns the existing world.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
    bind_to_launcher()
    if rank is None and "RANK" in os.environ:
        rank = int(os.environ["RANK"])
    if world_size is None and "WORLD_SIZE" in os.environ:
        world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank or 0))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA, which this machine does not have; use backend='gloo'")
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if not dist.is_initialized():
        _init_process_group(backend, datetime.timedelta(seconds=timeout_s), init_method, rank, world_size)
    return World(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                 backend=dist.get_backend(), device=device)


def _init_process_group(backend: str, timeout: datetime.timedelta, init_method: str | None,
                        rank: int | None, world_size: int | None) -> None:
    if init_method is None and rank is None and "MASTER_ADDR" not in os.environ:
        # No launcher: a private world of one process.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    if init_method is None:
        init_method = "env://"
    dist.init_process_group(backend, init_method=init_method, rank=rank if rank is not None else -1,
                            world_size=world_size if world_size is not None else -1, timeout=timeout)


def bind_to_launcher() -> None:
    """Under ``run_local`` (``shardwise train``/``run``): make this rank die when its launcher dies, however it
    dies (``kill -9`` included), so no orphan keeps training or writing checkpoints. torchrun starts each rank
    in a session of its own, so a signal to the launcher's process group never reaches it. Linux: the kernel
    sends SIGKILL on the parent's death (``PR_SET_PDEATHSIG``); elsewhere a daemon thread polls the parent pid.
    A no-op outside ``run_local`` and when called again."""
    launcher = os.environ.get(LAUNCHER_PID)
    if not launcher or getattr(bind_to_launcher, "_bound", False):
        return
    bind_to_launcher._bound = True  # type: ignore[attr-defined]
    if not _pdeathsig():
        import threading

        threading.Thread(target=_poll_parent, args=(int(launcher),), daemon=True, name="shardwise-parent").start()
    if os.getppid() != int(launcher):  # the launcher died before the signal was armed
        os._exit(1)


def _pdeathsig() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def _poll_parent(launcher: int) -> None:
    import time

    while os.getppid() == launcher:
        time.sleep(0.5)
    os._exit(1)


def barrier_all() -> None:
    """Wait until every rank of the job arrives, under the job's own timeout (``init(timeout_s=...)``), on the
    default group. ``shardwise train`` joins with a long start-up timeout and trains on meshes with the short
    ``train.timeout_s``: ranks meet here after start-up and after loading a checkpoint, so skew in process
    start or checkpoint reads (a loaded machine, a slow filesystem) is not mistaken for a hung peer. Collective."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def shutdown() -> None:
    """Destroy the process group (safe to call when none exists). Collective when the world has > 1 rank:
    a barrier first, so no rank tears its connections down while a peer still has traffic in flight (that
    race ended a rank with SIGABRT at exit under heavy load)."""
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def exit_process(code: int | None = 0) -> NoReturn:
    """End this process once its work is done (and, in a rank, ``shutdown()`` has run): flush stdio, then
    ``os._exit``. Only for entry points (the ``shardwise`` command, the trainer, the bench workers), and only on
    success: an exception is not routed here (it propagates and exits normally, traceback and all).

    Skips the interpreter's finalisation, for two measured reasons. In ranks, gloo's C++ threads may be torn
    down there after the objects they reference: under load about one run in ten of ``shardwise bench sbp -n 2``
    aborted ("terminate called without an active exception", SIGABRT) after both ranks had returned from
    ``shutdown()``, failing a job whose work was complete. Everywhere, tearing down torch's modules takes
    0.4 s after ``import torch`` and 0.8 s once ``torch.optim`` has pulled in ``torch._dynamo`` — per command."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more can be written anyway
            pass
    os._exit(code or 0)
