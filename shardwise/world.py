"""Joining the job: ``sw.init`` / ``World`` and the rank's side of launching. The only module that reads
environment variables.

``init()`` joins the job torchrun started (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``), or — with no torchrun environment — makes a world of size 1 so the same script runs on
one process unchanged. ``bind_to_launcher`` ties a rank's life to the launcher that started it
(``runtime/launch.py``'s ``run_local``, which passes its pid in ``SHARDWISE_LAUNCHER_PID``).
"""

from __future__ import annotations

import atexit
import datetime
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Literal, NoReturn

import torch
import torch.distributed as dist

from .allocator import bound_retention

__all__ = ["World", "init", "shutdown", "exit_process", "barrier_all", "env_flag", "bind_to_launcher", "LAUNCHER_PID",
           "on_teardown", "interrupted"]

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

    At exit (the script ends, raises or calls ``sys.exit``), an ``atexit`` hook registered here tears the job
    down while the interpreter is still whole, without communicating: shardwise's own transports stop, the
    process groups are destroyed and gloo's worker threads are let finish (``_at_exit``). Exit code, traceback
    and the user's own ``atexit`` handlers are untouched. ``shutdown()`` does the same explicitly, with a barrier.
    On CPU (gloo) it also bounds what glibc keeps of freed tensors (``allocator.bound_retention``; opt out with
    ``SHARDWISE_MALLOC=keep``).
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
    malloc = env_flag("SHARDWISE_MALLOC")
    if backend == "gloo" and malloc != "keep":  # CPU ranks: freed tensors go back to the system (allocator.py)
        bound_retention(*([int(malloc)] if malloc.isdigit() else []))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if not dist.is_initialized():
        _init_process_group(backend, datetime.timedelta(seconds=timeout_s), init_method, rank, world_size)
        _EXIT["done"] = False  # a new job after a shutdown(): the exit hook tears this one down
    _arm_exit_hook()
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
    Ctrl-C is the launcher's to report: SIGINT still raises ``KeyboardInterrupt`` here and is recorded
    (``interrupted()``), and a rank prints no traceback once it came (``_quiet_interrupt``). A no-op outside
    ``run_local`` and when called again."""
    launcher = os.environ.get(LAUNCHER_PID)
    if not launcher or getattr(bind_to_launcher, "_bound", False):
        return
    bind_to_launcher._bound = True  # type: ignore[attr-defined]
    sys.excepthook = _quiet_interrupt(sys.excepthook)
    sys.unraisablehook = _quiet_interrupt(sys.unraisablehook)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is \
            signal.default_int_handler:  # a handler of the script's own stays
        signal.signal(signal.SIGINT, _on_sigint)
    if not _pdeathsig():
        threading.Thread(target=_poll_parent, args=(int(launcher),), daemon=True, name="shardwise-parent").start()
    if os.getppid() != int(launcher):  # the launcher died before the signal was armed
        os._exit(1)


def interrupted() -> bool:
    """Whether this rank got its launcher's SIGINT (Ctrl-C; ``run_local`` passes it on to every rank). True
    even where the ``KeyboardInterrupt`` it raised was swallowed (it can land in a finalizer, which Python
    reports and ignores) and the rank met the error of a peer that stopped instead."""
    return _EXIT["interrupted"]


def _on_sigint(signum: int, frame: object) -> None:
    _EXIT["interrupted"] = True
    raise KeyboardInterrupt


def _quiet_interrupt(previous: Callable[..., object]) -> Callable[..., object]:
    """``sys.excepthook`` / ``sys.unraisablehook`` for a rank under ``run_local``: Ctrl-C reaches the launcher,
    which passes SIGINT on to every rank and reports the interruption in one line, so once it has arrived a
    rank prints no traceback (its ``KeyboardInterrupt``, or a peer's exit it met in a collective); the rank
    still ends by it, its ``except``/``finally`` blocks run. Before Ctrl-C, as ``previous``."""
    def hook(*args):  # type: ignore[no-untyped-def]
        kind = args[0] if len(args) == 3 else args[0].exc_type
        if not (_EXIT["interrupted"] or (isinstance(kind, type) and issubclass(kind, KeyboardInterrupt))):
            previous(*args)
    return hook


def _pdeathsig() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

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
    """End this rank's part in the job: a barrier (when the world has > 1 rank, so no rank tears its connections
    down while a peer still has traffic in flight to it), then the same teardown as the exit hook: shardwise's
    transports stop, the process groups are destroyed, gloo's worker threads finish. Idempotent, and safe
    when no process group exists; afterwards the exit hook has nothing left to do. Optional in a script:
    without it, the exit hook tears down the same way minus the barrier. Collective (the barrier)."""
    if dist.is_initialized() and not _EXIT["done"] and dist.get_world_size() > 1:
        dist.barrier()
    _teardown()


def on_teardown(step: Callable[[], None]) -> None:
    """Register a collective-free teardown step of one of shardwise's transports (``comm/`` stops its
    shared-memory threads this way; the layer below cannot import it). Steps run newest first, once, in
    ``shutdown()`` or the exit hook, before the process groups are destroyed; a step that raises is skipped."""
    _STEPS.append(step)


_EXIT = {"armed": False, "done": False, "interrupted": False}
_STEPS: list[Callable[[], None]] = []
_QUIET_POLLS = 3          # consecutive polls that must find gloo's workers asleep
_QUIET_POLL_S = 0.002
_QUIET_MAX_S = 1.0        # a worker kept busy (a collective nobody waited for) delays the exit at most this long


def _arm_exit_hook() -> None:
    """Register ``_at_exit`` once per process. atexit runs handlers newest first, so the handlers a script
    registers after ``init`` run before ours, with the process groups still usable."""
    if not _EXIT["armed"]:
        _EXIT["armed"] = True
        atexit.register(_at_exit)


def _at_exit() -> None:
    """The exit hook: ``shutdown()`` minus the barrier (a rank that raised must not wait for its peers).

    Why: gloo runs each collective on worker threads of its own. A worker drops its reference to a finished
    collective a moment after the caller's ``wait()`` returned; when that reference is the last one to a
    tensor whose Python object is already gone, dropping it takes the GIL. Once the interpreter finalises, a
    thread that asks for the GIL is ended with ``pthread_exit``, whose unwinding through gloo's ``noexcept``
    destructor calls ``std::terminate``: "terminate called without an active exception", SIGABRT, after the
    script's work was done (measured: 8 runs in 20 of the README example under load). Here, before
    finalisation, those threads are given the GIL and the time to finish."""
    try:
        _teardown()
    except Exception as exc:  # an exit hook must not turn a finished job into a traceback
        print(f"shardwise: teardown at exit failed ({type(exc).__name__}: {exc}); exiting anyway", file=sys.stderr)


def _teardown() -> None:
    if _EXIT["done"]:
        return
    _EXIT["done"] = True
    while _STEPS:
        step = _STEPS.pop()
        try:
            step()
        except Exception:  # a transport that cannot stop cleanly is ended with the process anyway
            pass
    if dist.is_initialized():
        dist.destroy_process_group()
        _wait_for_quiet_threads()


def _wait_for_quiet_threads() -> None:
    """Sleep (the GIL released) until gloo's worker threads (``pt_gloo_runloop``; every other thread where torch
    does not name them) have been asleep for a few polls in a row (Linux: ``/proc/self/task``), at most
    ``_QUIET_MAX_S``; elsewhere a short fixed sleep. A worker still letting go of a collective is runnable, or
    takes the GIL as soon as this thread sleeps."""
    me, tasks = str(threading.get_native_id()), f"/proc/{os.getpid()}/task"
    if not os.path.isdir(tasks):
        time.sleep(0.05)
        return
    deadline, quiet = time.monotonic() + _QUIET_MAX_S, 0
    while quiet < _QUIET_POLLS and time.monotonic() < deadline:
        time.sleep(_QUIET_POLL_S)
        quiet = quiet + 1 if not _busy_threads(tasks, me) else 0


def _busy_threads(tasks: str, me: str) -> bool:
    """Whether a gloo worker (any thread but ``me`` if none is named so) is running, runnable or in
    uninterruptible sleep."""
    states: dict[str, str] = {}
    for tid in os.listdir(tasks) if os.path.isdir(tasks) else []:
        try:
            with open(f"{tasks}/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
        if tid != me:
            states[name + "/" + tid] = state
    gloo = [s for key, s in states.items() if key.startswith("pt_gloo_")]
    return any(s in ("R", "D") for s in (gloo if gloo else states.values()))


def exit_process(code: int | None = 0) -> NoReturn:
    """End this process once its work is done (and, in a rank, ``shutdown()`` has run): flush stdio, then
    ``os._exit``. Only for entry points (the ``shardwise`` command, the trainer, the bench workers), and only on
    success: an exception is not routed here (it propagates and exits normally, traceback and all).

    Skips the interpreter's finalisation: tearing down torch's modules takes 0.4 s after ``import torch`` and
    0.8 s once ``torch.optim`` has pulled in ``torch._dynamo`` — per command. (The SIGABRT that finalisation
    could end a rank with, gloo's worker threads asking for the GIL too late, is prevented by ``shutdown()``
    and the exit hook themselves: ``_at_exit``.)"""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more can be written anyway
            pass
    os._exit(code or 0)
