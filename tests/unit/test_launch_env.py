"""``run_local``'s environment for the ranks: torchrun's thread rule (one intra-op thread per rank when several
share a node, every core for a lone rank), applied without torchrun's banner, and nothing left behind."""

from __future__ import annotations

import os

import pytest
from torch.distributed import run as torchrun

from shardwise.runtime.launch import run_local
from shardwise.world import LAUNCHER_PID


@pytest.mark.parametrize("nproc,user,expected", [(2, None, "1"), (4, None, "1"), (1, None, None), (2, "3", "3")])
def test_threads_per_rank_follow_torchruns_rule(monkeypatch: pytest.MonkeyPatch, nproc: int, user: str | None,
                                                expected: str | None):
    if user is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", user)
    seen: dict[str, str | None] = {}

    def fake_main(args):  # what the ranks would inherit
        seen.update(omp=os.environ.get("OMP_NUM_THREADS"), launcher=os.environ.get(LAUNCHER_PID))
        raise SystemExit(0)

    monkeypatch.setattr(torchrun, "main", fake_main)
    assert run_local(nproc, ["x.py"]) == 0
    assert seen == {"omp": expected, "launcher": str(os.getpid())}
    assert os.environ.get("OMP_NUM_THREADS") == user and LAUNCHER_PID not in os.environ
