"""Starting ranks: ``run_local`` runs a script or module on local ranks through torch's own elastic launcher
(torchrun), so a multi-node job is a plain torchrun job. The ranks' side (``sw.init``) is ``shardwise/world.py``.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from ..world import LAUNCHER_PID

__all__ = ["run_local"]


def run_local(nproc: int, target: Sequence[str], *, module: bool = False, nnodes: str | None = None,
              node_rank: int | None = None, rdzv_endpoint: str | None = None,
              extra: Sequence[str] = (), exit_codes: dict[int, int] | None = None) -> int:
    """Launch ``target`` (a script and its arguments, or ``-m module ...``) on ``nproc`` local ranks via
    ``torch.distributed.run``; returns the launcher's exit code. Multi-node: with ``node_rank`` the rendezvous
    is torchrun's static one at ``rdzv_endpoint`` (HOST:PORT of node 0; global rank = node_rank × nproc +
    local rank, so every node's ranks are the same on every launch); without it, the elastic c10d rendezvous
    (ranks assigned in joining order). The ranks die with this process (``bind_to_launcher``). After a failure,
    ``exit_codes`` (if given) receives each failed rank's exit code as torchrun saw it (negative: the signal that
    ended it; ``-SIGTERM`` marks a rank torchrun itself stopped because another failed)."""
    if nproc < 1:
        raise ValueError(f"-n/--nproc must be >= 1, got {nproc}; e.g. -n 2")
    from torch.distributed import run as torchrun

    os.environ[LAUNCHER_PID] = str(os.getpid())  # inherited by the ranks torchrun starts
    try:
        torchrun.main(_torchrun_args(nproc, target, module, nnodes, node_rank, rdzv_endpoint, extra))
    except SystemExit as exc:  # torchrun exits through SystemExit
        return int(exc.code or 0)
    except Exception as exc:  # ChildFailedError: the launcher already printed each rank's failure
        if exit_codes is not None:
            exit_codes.update({int(r): int(f.exitcode) for r, f in getattr(exc, "failures", {}).items()})
        print(f"shardwise run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        os.environ.pop(LAUNCHER_PID, None)
    return 0


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
