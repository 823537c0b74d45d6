"""Rank-side checks for the uneven all-to-all (``shardwise/comm/alltoall.py``), run by tests/dist/test_alltoall.py.

The expected result never comes from the code under test: every rank's input and every rank's splits are
generated from (seed, coordinate), so each rank rebuilds what every other rank sends it (the hand-built
reference) and compares with equality (an all-to-all moves bytes, it computes nothing). Gradients are compared
with a single-process reference built from all ranks' inputs gathered with ``all_gather``.
"""

from __future__ import annotations

import torch

import shardwise as sw
from shardwise.comm import CommCounter
from shardwise.comm.calibration import AlphaBeta, Calibration
from tests.dist.meshes import mesh

ALGS = ("native", "pairwise")
DTYPES = (torch.float32, torch.bfloat16, torch.int64)
ROWS = ((), (3,), (2, 3))


def split_matrix(seed: int, n: int, case: str = "random") -> list[list[int]]:
    """``S[i][j]``: rows coordinate ``i`` sends to ``j``. ``random``: 0..5 with zeros; ``silent``: random but
    coordinate 0 sends nothing; ``empty``: nothing at all; ``even``: 2 everywhere."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 6, (n, n), generator=g)
    s[s == 1] = 0  # plenty of zero-row pieces
    if case == "silent":
        s[0] = 0
    elif case == "empty":
        s.zero_()
    elif case == "even":
        s.fill_(2)
    return s.tolist()


def rank_input(seed: int, coord: int, rows: int, rest: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Integers in [-100, 100] (exact in bf16 up to 256), reproducible on any rank."""
    g = torch.Generator().manual_seed(seed * 131 + coord)
    return torch.randint(-100, 101, (rows, *rest), generator=g).to(dtype)


def reference(seed: int, s: list[list[int]], me: int, rest: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """What coordinate ``me`` must receive: piece ``me`` of every coordinate's input, in coordinate order."""
    pieces = []
    for j in range(len(s)):
        x = rank_input(seed, j, sum(s[j]), rest, dtype)
        start = sum(s[j][:me])
        pieces.append(x[start:start + s[j][me]])
    return torch.cat(pieces)


def _one(m: sw.Mesh, axis: str, seed: int, s: list[list[int]], rest: tuple[int, ...], dtype: torch.dtype,
         algorithm: str, async_op: bool = False, strided: bool = False) -> bool:
    n, me = m.size(axis), m.coord(axis)
    in_splits, out_splits = s[me], [s[j][me] for j in range(n)]
    x = rank_input(seed, me, sum(in_splits), rest, dtype)
    if strided and x.dim() == 3:  # same values through a non-contiguous view
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    out = torch.full((sum(out_splits), *rest), -7, dtype=dtype)
    got = sw.comm.all_to_all_single(out, x, m, axis, out_splits=out_splits, in_splits=in_splits,
                                    algorithm=algorithm, async_op=async_op)
    if async_op:
        got = got.wait()
    return got is out and torch.equal(out, reference(seed, s, me, rest, dtype))


def check_matrix(axis: str = "dp", axes: dict[str, int] | None = None) -> list[str]:
    """Both algorithms × dtypes × row shapes × split cases (random, a silent rank, all empty, even)."""
    m = mesh(**(axes or {"dp": -1}))
    n = m.size(axis)
    failures = []
    for seed, case in enumerate(("random", "silent", "empty", "even", "random")):
        s = split_matrix(seed, n, case)
        for algorithm in ALGS:
            for dtype in DTYPES:
                for rest in ROWS:
                    if not _one(m, axis, seed, s, rest, dtype, algorithm):
                        failures.append(f"{case} {algorithm} {dtype} rows {rest}")
            if not _one(m, axis, seed, s, (2, 3), torch.float32, algorithm, strided=True):
                failures.append(f"{case} {algorithm} non-contiguous input")
            if not _one(m, axis, seed, s, (3,), torch.float32, algorithm, async_op=True):
                failures.append(f"{case} {algorithm} async")
    return failures


def check_async_order() -> list[str]:
    """Several asynchronous pairwise calls in flight, then a blocking one: each lands in its own output."""
    m = mesh(dp=-1)
    n, me = m.size("dp"), m.coord("dp")
    cases = [(seed, split_matrix(seed, n)) for seed in range(10, 14)]
    handles, outs = [], []
    for seed, s in cases:
        out = torch.empty((sum(s[j][me] for j in range(n)), 4))
        outs.append(out)
        handles.append(sw.comm.all_to_all_single(out, rank_input(seed, me, sum(s[me]), (4,), torch.float32), m,
                                                 "dp", out_splits=[s[j][me] for j in range(n)],
                                                 in_splits=s[me], algorithm="pairwise", async_op=True))
    last = _one(m, "dp", 20, split_matrix(20, n), (4,), torch.float32, "pairwise")
    bad = [f"async #{k}" for k, ((seed, s), h, out) in enumerate(zip(cases, handles, outs))
           if h.wait() is not out or not torch.equal(out, reference(seed, s, me, (4,), torch.float32))]
    return bad + ([] if last else ["blocking call after async ones"])


def check_exchange_counts() -> list[str]:
    """Counts-first exchange: ``k`` counts per destination, received in source order."""
    m = mesh(dp=-1)
    n, me = m.size("dp"), m.coord("dp")
    failures = []
    for k in (1, 3):
        for algorithm in ALGS:
            mine = rank_input(5 + k, me, n * k, (), torch.int64)
            got = sw.comm.exchange_counts(mine, m, "dp", algorithm=algorithm)
            want = torch.cat([rank_input(5 + k, j, n * k, (), torch.int64)[me * k:(me + 1) * k] for j in range(n)])
            if not torch.equal(got, want):
                failures.append(f"exchange_counts k={k} {algorithm}")
    return failures


def counts(algorithm: str, seed: int = 3) -> dict[str, int]:
    """What ``CommCounter`` saw for one call (float32 rows of 3), and what it should have seen by hand."""
    m = mesh(dp=-1)
    n, me = m.size("dp"), m.coord("dp")
    s = split_matrix(seed, n)
    x = rank_input(seed, me, sum(s[me]), (3,), torch.float32)
    out = torch.empty((sum(s[j][me] for j in range(n)), 3))
    with CommCounter() as c:
        sw.comm.all_to_all_single(out, x, m, "dp", out_splits=[s[j][me] for j in range(n)], in_splits=s[me],
                                  algorithm=algorithm)
    return {"calls": c.count("all_to_all"), "algo_calls": c.count("all_to_all", algorithm=algorithm),
            "bytes": c.bytes("all_to_all"), "sent": c.messages_sent, "bytes_sent": c.bytes_sent,
            "received": c.messages_received, "bytes_received": c.bytes_received,
            "want_bytes": sum(s[me]) * 12,
            "want_sent": sum(1 for j in range(n) if j != me and s[me][j]),
            "want_bytes_sent": sum(s[me][j] for j in range(n) if j != me) * 12,
            "want_received": sum(1 for j in range(n) if j != me and s[j][me]),
            "want_bytes_received": sum(s[j][me] for j in range(n) if j != me) * 12}


def check_gradients(algorithm: str, dtype_name: str) -> dict[str, object]:
    """Forward and backward of ``all_to_all_autograd`` against a single-process reference on gathered inputs;
    with the counter's view of the two all-to-alls (forward, reverse in backward)."""
    dtype = getattr(torch, dtype_name)
    m = mesh(dp=-1)
    n, me = m.size("dp"), m.coord("dp")
    s = split_matrix(7, n, "silent")
    g = torch.Generator().manual_seed(100 + me)
    x = torch.randn((sum(s[me]), 4), generator=g).to(dtype).requires_grad_(True)
    w = torch.randn((sum(s[j][me] for j in range(n)), 4), generator=g).to(dtype)  # this rank's loss weights
    with CommCounter() as c:
        y = sw.comm.all_to_all_autograd(x, m, "dp", [s[j][me] for j in range(n)], s[me], algorithm=algorithm)
        (y * w).sum().backward()
    # reference: every rank's x and w, gathered, then the all-to-all as slicing on one process
    xs = sw.comm.all_gather(x.detach(), m, "dp", sizes=[sum(s[j]) for j in range(n)])
    ws = sw.comm.all_gather(w, m, "dp", sizes=[sum(s[j][i] for j in range(n)) for i in range(n)])
    xr = [p.clone().requires_grad_(True) for p in torch.split(xs, [sum(s[j]) for j in range(n)])]
    ys = [torch.cat([xr[j][sum(s[j][:i]):sum(s[j][:i + 1])] for j in range(n)]) for i in range(n)]
    wr = torch.split(ws, [sum(s[j][i] for j in range(n)) for i in range(n)])
    sum((yi.float() * wi.float()).sum() for yi, wi in zip(ys, wr)).backward()
    grad_ok = x.grad is not None and torch.allclose(x.grad.float(), xr[me].grad.float(), rtol=1e-5, atol=1e-6)
    return {"forward": bool(torch.equal(y.detach(), ys[me].detach())), "grad": bool(grad_ok),
            "calls": c.count("all_to_all", algorithm=algorithm), "bytes": c.bytes("all_to_all"),
            "want_bytes": (x.numel() + y.numel()) * x.element_size()}


def _cal(native: tuple[float, float], pairwise: tuple[float, float], n: int) -> Calibration:
    models = {"all_to_all": {"native": AlphaBeta(*native), "pairwise": AlphaBeta(*pairwise)}}
    return Calibration(world_size=n, backend="gloo", device="cpu", models=models)


def check_auto() -> list[str]:
    """``auto``: native without a calibration or at a crossover, pairwise where its model is no worse anywhere."""
    base = mesh(dp=-1)
    n = base.size("dp")
    failures = []
    for cal, want in ((None, "native"), (_cal((50.0, 1e-3), (20.0, 1e-3), n), "pairwise"),
                      (_cal((50.0, 1e-3), (20.0, 2e-3), n), "native")):
        m = base.with_calibration(cal)
        with CommCounter() as c:
            ok = _one(m, "dp", 9, split_matrix(9, n), (2,), torch.float32, "auto")
        if not ok or (n > 1 and c.count("all_to_all", algorithm=want) != 1):
            failures.append(f"auto with {cal and cal.models}: wanted {want}, got {[r.algorithm for r in c.records]}")
    return failures


def errors() -> dict[str, str]:
    """The message of each bad call (raised before any communication, so the ranks stay in step)."""
    m = mesh(dp=-1)
    n, me = m.size("dp"), m.coord("dp")
    x, out = torch.zeros(n, 2), torch.zeros(n, 2)
    ones = [1] * n
    calls = {
        "in_len": lambda: sw.comm.all_to_all_single(out, x, m, "dp", out_splits=ones, in_splits=ones + [0]),
        "out_len": lambda: sw.comm.all_to_all_single(out, x, m, "dp", out_splits=ones[:-1], in_splits=ones),
        "in_sum": lambda: sw.comm.all_to_all_single(out, torch.zeros(n + 1, 2), m, "dp", out_splits=ones,
                                                    in_splits=ones),
        "out_sum": lambda: sw.comm.all_to_all_single(torch.zeros(n + 2, 2), x, m, "dp", out_splits=ones,
                                                     in_splits=ones),
        "negative": lambda: sw.comm.all_to_all_single(out, x, m, "dp", out_splits=ones,
                                                      in_splits=[-1] + [1] * (n - 2) + [2] if n > 1 else [-1]),
        "self": lambda: sw.comm.all_to_all_single(out, torch.zeros(2, 2), m, "dp", out_splits=ones,
                                                  in_splits=[2 if j == me else 0 for j in range(n)]),
        "algorithm": lambda: sw.comm.all_to_all_single(out, x, m, "dp", out_splits=ones, in_splits=ones,
                                                       algorithm="ring"),
        "row_shape": lambda: sw.comm.all_to_all_single(torch.zeros(n, 3), x, m, "dp", out_splits=ones,
                                                       in_splits=ones),
        "float": lambda: sw.comm.all_to_all_single(out, x, m, "dp", out_splits=ones, in_splits=[1.0] * n),
        "tensor_ints": lambda: sw.comm.all_to_all_single(out, x, m, "dp", out_splits=list(torch.tensor(ones)),
                                                         in_splits=torch.tensor(ones).numpy().tolist()),
        "counts": lambda: sw.comm.exchange_counts(torch.zeros(n, dtype=torch.int32), m, "dp"),
        "autograd_len": lambda: sw.comm.all_to_all_autograd(x, m, "dp", ones + [1], ones),
    }
    found = {}
    for name, call in calls.items():
        try:
            call()
            found[name] = "no error"
        except ValueError as exc:
            found[name] = str(exc)
    return found


def debug_mismatch() -> str:
    """With ``Mesh(debug=True)``, splits that disagree across ranks raise on every rank instead of hanging."""
    m = mesh(debug=True, dp=-1)
    n, me = m.size("dp"), m.coord("dp")
    s = split_matrix(0, n, "even")
    in_splits = list(s[me])
    if me == 0:  # coordinate 0 sends 3 rows to coordinate 1, which expects 2
        in_splits[1] += 1
    x = torch.zeros(sum(in_splits), 2)
    try:
        sw.comm.all_to_all_single(torch.zeros(2 * n, 2), x, m, "dp", out_splits=[2] * n, in_splits=in_splits,
                                  algorithm="pairwise")
    except ValueError as exc:
        return str(exc)
    return "no error"


def bench_rows() -> list[tuple[str, str, int, float | None, float]]:
    """``shardwise bench comm``'s all-to-all rows (op, algorithm, count, max error, busbw/algbw) at 3 sizes."""
    from types import SimpleNamespace

    from shardwise.bench.comm import bench_op

    args = SimpleNamespace(algorithms=["native", "ring", "pairwise"], dtype="bfloat16", iters=1, warmup=0,
                           check=True)
    rows = bench_op("all_to_all", [64, 1024, 4096], mesh(world=-1), args)
    return [(r.op, r.algorithm, r.count, r.max_error, r.busbw_GBps / r.algbw_GBps) for r in rows]
