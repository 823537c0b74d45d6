"""Starting ranks: ``run_local`` runs a script or module on local ranks through torch's own elastic launcher
(torchrun), so a multi-node job is a plain torchrun job. The ranks' side (``sw.init``) is ``shardwise/world.py``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Sequence

from ..world import LAUNCHER_PID

__all__ = ["run_local", "INTERRUPTED"]

INTERRUPTED = 130
"""``run_local``'s code after Ctrl-C (128 + SIGINT, as a shell reports a command that Ctrl-C ended)."""


def run_local(nproc: int, target: Sequence[str], *, module: bool = False, nnodes: str | None = None,
              node_rank: int | None = None, rdzv_endpoint: str | None = None,
              extra: Sequence[str] = (), exit_codes: dict[int, int] | None = None,
              report_interrupt: bool = True) -> int:
    """Launch ``target`` (a script and its arguments, or ``-m module ...``) on ``nproc`` local ranks via
    ``torch.distributed.run``; returns the launcher's exit code. Multi-node: with ``node_rank`` the rendezvous
    is torchrun's static one at ``rdzv_endpoint`` (HOST:PORT of node 0; global rank = node_rank × nproc +
    local rank, so every node's ranks are the same on every launch); without it, the elastic c10d rendezvous
    (ranks assigned in joining order). The ranks die with this process (``bind_to_launcher``). After a failure,
    ``exit_codes`` (if given) receives each failed rank's exit code as torchrun saw it (negative: the signal that
    ended it; ``-SIGTERM`` marks a rank torchrun itself stopped because another failed).

    Ctrl-C: torchrun passes the SIGINT on to the ranks and stops them; this prints one line ("interrupted
    (Ctrl-C): ranks stopped"; not with ``report_interrupt=False``, for a caller that reports it) and returns
    ``INTERRUPTED`` (130). The ranks' own report of it is silenced
    (``world.bind_to_launcher``), as are torchrun's log lines about the signal. ``OMP_NUM_THREADS`` is set to 1
    for several ranks per node when unset, as torchrun would, without torchrun's banner about it."""
    if nproc < 1:
        raise ValueError(f"-n/--nproc must be >= 1, got {nproc}; e.g. -n 2")
    from torch.distributed import run as torchrun

    own_env = {LAUNCHER_PID: str(os.getpid())}  # inherited by the ranks torchrun starts
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:  # torchrun's rule (one rank keeps the cores), unannounced
        own_env["OMP_NUM_THREADS"] = "1"
    os.environ.update(own_env)
    quiet = _SignalLogFilter()
    loggers = [logging.getLogger(name) for name in _TORCHRUN_SIGNAL_LOGGERS]
    for log in loggers:
        log.addFilter(quiet)
    try:
        torchrun.main(_torchrun_args(nproc, target, module, nnodes, node_rank, rdzv_endpoint, extra))
    except SystemExit as exc:  # torchrun exits through SystemExit
        return int(exc.code or 0)
    except KeyboardInterrupt:  # Ctrl-C before torchrun's own handler was in place
        return _interrupted(report_interrupt)
    except Exception as exc:  # ChildFailedError: the launcher already printed each rank's failure
        if getattr(exc, "sigval", None) == signal.SIGINT:  # torchrun's SignalException: Ctrl-C
            return _interrupted(report_interrupt)
        if exit_codes is not None:
            exit_codes.update({int(r): int(f.exitcode) for r, f in getattr(exc, "failures", {}).items()})
        print(f"shardwise run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        for name in own_env:
            os.environ.pop(name, None)
        for log in loggers:
            log.removeFilter(quiet)
    return 0


_TORCHRUN_SIGNAL_LOGGERS = ("torch.distributed.elastic.agent.server.api",
                            "torch.distributed.elastic.multiprocessing.api")


class _SignalLogFilter(logging.Filter):
    """Drops torchrun's warnings that it got SIGINT and passes it on to each rank: Ctrl-C is reported in one
    line by ``run_local``. Everything else (a rank's failure, SIGTERM to the survivors) still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (("death signal" in text and ("SIGINT" in text or "Received 2 " in text))
                    or "closing signal SIGINT" in text)


def _interrupted(report: bool) -> int:
    if report:
        print("shardwise: interrupted (Ctrl-C): ranks stopped", file=sys.stderr, flush=True)
    return INTERRUPTED


def _torchrun_args(nproc: int, target: Sequence[str], module: bool, nnodes: str | None, node_rank: int | None,
                   rdzv_endpoint: str | None, extra: Sequence[str]) -> list[str]:
    args = [f"--nproc-per-node={nproc}"]
    if nnodes is not None:
        args.append(f"--nnodes={nnodes}")
    if rdzv_endpoint is not None and node_rank is not None:
        host, _, port = rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--rdzv-endpoint {rdzv_endpoint!r} must be HOST:PORT, e.g. node0.local:29500")
        args += [f"--node-rank={node_rank}", f"--master-addr={host}", f"--master-port={port}"]
    elif rdzv_endpoint is not None:
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
    elif nnodes in (None, "1", "1:1"):
        args.append("--standalone")  # picks a free port on this machine
    args += list(extra)
    if module:
        args.append("-m")
    return args + list(target)
