"""Rank-side checks for the collectives (run inside LocalWorld ranks by tests/dist/test_comm.py).

Inputs are integer-valued floats generated from (seed, rank), so every rank can compute the exact expected
result of a sum/max/min over all ranks *independently of the code under test*: sums of small integers are
exact in float16, bfloat16 and float32 whatever the reduction order, so we compare with equality.
"""

from __future__ import annotations

import torch

import shardwise as sw
from shardwise.comm import CommCounter, shard_sizes
from tests.dist.meshes import mesh

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64]
LENGTHS = [0, 1, 2, 3, 5, 7, 1000, 4099]


def rank_input(seed: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Integers in [-8, 8] as ``dtype``: rank-dependent, reproducible on any rank."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(-8, 9, shape, generator=g).to(dtype)


def expected_reduce(seed: int, ranks: list[int], shape: tuple[int, ...], dtype: torch.dtype, op: str) -> torch.Tensor:
    xs = torch.stack([rank_input(seed, r, shape, torch.float64) for r in ranks])
    if op in ("sum", "avg"):
        out = xs.sum(0)
        return out / len(ranks) if op == "avg" else out
    return xs.max(0).values if op == "max" else xs.min(0).values


def _close(got: torch.Tensor, want: torch.Tensor, op: str) -> bool:
    if got.shape != want.shape:
        return False
    if op == "avg":  # one rounding of the final division is allowed
        tol = 1e-2 if got.dtype in (torch.float16, torch.bfloat16) else 1e-6
        return bool(torch.allclose(got.double(), want, rtol=tol, atol=tol))
    return bool(torch.equal(got.double(), want))


def check_all_reduce_matrix(algorithms: list[str], piece_bytes: int | None = None) -> list[str]:
    """Every algorithm × op × dtype × awkward length on a 1-D mesh over the whole world."""
    m = mesh(dp=-1)
    ranks = list(range(m.size("dp")))
    failures = []
    for algorithm in algorithms:
        for dtype in DTYPES:
            for op in ("sum", "avg", "max", "min"):
                if op == "avg" and not dtype.is_floating_point:
                    continue
                for seed, length in enumerate(LENGTHS):
                    x = rank_input(seed, m.rank, (length,), dtype)
                    kw = {"piece_bytes": piece_bytes} if piece_bytes else {}
                    out = sw.comm.all_reduce(x, m, "dp", op=op, algorithm=algorithm, **kw)
                    want = expected_reduce(seed, ranks, (length,), dtype, op)
                    if out is not x or not _close(x, want, op):
                        failures.append(f"all_reduce {algorithm} {op} {dtype} L={length}")
    return failures


def check_all_reduce_shapes(algorithm: str) -> list[str]:
    """Multi-dimensional, 0-d and non-contiguous inputs are reduced in place with their shape kept."""
    m = mesh(dp=-1)
    ranks = list(range(m.size("dp")))
    failures = []
    for seed, shape in enumerate([(3, 5), (), (2, 3, 4)]):
        x = rank_input(seed, m.rank, shape, torch.float32)
        sw.comm.all_reduce(x, m, "dp", algorithm=algorithm)
        if not _close(x, expected_reduce(seed, ranks, shape, torch.float32, "sum"), "sum"):
            failures.append(f"shape {shape}")
    base = rank_input(7, m.rank, (4, 6), torch.float32)
    view = base.t()  # non-contiguous (6, 4)
    sw.comm.all_reduce(view, m, "dp", algorithm=algorithm)
    if not _close(base, expected_reduce(7, ranks, (4, 6), torch.float32, "sum"), "sum"):
        failures.append("non-contiguous view not reduced in place")
    return failures


def check_random_floats_match_native(algorithm: str) -> float:
    """Random (non-integer) float32 data: the algorithm agrees with the backend's own all-reduce."""
    m = mesh(dp=-1)
    g = torch.Generator().manual_seed(m.rank)
    x = torch.randn(100_003, generator=g)
    ref = x.clone()
    sw.comm.all_reduce(ref, m, "dp", algorithm="native")
    sw.comm.all_reduce(x, m, "dp", algorithm=algorithm, piece_bytes=4096)
    return float((x - ref).abs().max())


def count_all_reduce_messages(algorithm: str, length: int) -> tuple[int, int, int]:
    """(collective records, p2p messages sent, bytes sent) on this rank for one float32 all-reduce."""
    m = mesh(dp=-1)
    x = torch.ones(length)
    with CommCounter() as c:
        sw.comm.all_reduce(x, m, "dp", algorithm=algorithm)
    return c.count("all_reduce", algorithm=algorithm), c.messages_sent, c.bytes_sent


def check_all_gather(algorithm: str) -> list[str]:
    """Even and uneven gathers along dims 0 and 1, compared with the concatenation of every rank's input."""
    m = mesh(dp=-1)
    n, r = m.size("dp"), m.rank
    failures = []
    for seed, total in enumerate([0, 1, n, 2 * n + 1, 1001]):
        sizes = shard_sizes(total, n)
        for dim in (0, 1):
            shape = (sizes[r], 3) if dim == 0 else (2, sizes[r])
            x = rank_input(seed, r, shape, torch.float32)
            out = sw.comm.all_gather(x, m, "dp", dim=dim, sizes=sizes, algorithm=algorithm)
            parts = [rank_input(seed, j, (sizes[j], 3) if dim == 0 else (2, sizes[j]), torch.float32)
                     for j in range(n)]
            if not torch.equal(out, torch.cat(parts, dim=dim)):
                failures.append(f"all_gather {algorithm} total={total} dim={dim}")
        # out=: into the caller's buffer, the input a separate tensor or this rank's own rows of the buffer
        # (ZeRO's flat shard: then nothing of this rank's is copied), blocking and async
        want = torch.cat([rank_input(seed, j, (sizes[j], 3), torch.float32) for j in range(n)])
        lo = sum(sizes[:r])
        for own_slice, async_op in ((False, False), (True, False), (True, True)):
            buf = torch.full((total, 3), -1.0)
            x = rank_input(seed, r, (sizes[r], 3), torch.float32)
            if own_slice:
                buf[lo:lo + sizes[r]] = x
                x = buf[lo:lo + sizes[r]]
            got = sw.comm.all_gather(x, m, "dp", sizes=sizes, algorithm=algorithm, out=buf, async_op=async_op)
            got = got.wait() if async_op else got
            if got.data_ptr() != buf.data_ptr() or not torch.equal(buf, want):
                failures.append(f"all_gather out= {algorithm} total={total} own_slice={own_slice} async={async_op}")
    for bad, words in ((torch.empty(n * 2, 4), "shape"), (torch.empty(n * 2, 3, dtype=torch.float64), "float32"),
                       (torch.empty(3, n * 2).t(), "non-contiguous")):
        try:
            sw.comm.all_gather(torch.zeros(2, 3), m, "dp", algorithm=algorithm, out=bad)
            failures.append(f"all_gather out= {algorithm}: {words} accepted")
        except ValueError as exc:
            if words not in str(exc):
                failures.append(f"all_gather out= {algorithm}: {exc}")
    return failures


def check_reduce_scatter(algorithm: str) -> list[str]:
    """Shards of the exact sum, uneven rows per ``shard_sizes``, along dims 0 and 1, for sum/avg/max."""
    m = mesh(dp=-1)
    n, r = m.size("dp"), m.rank
    ranks = list(range(n))
    failures = []
    for seed, rows in enumerate([0, 1, n, 2 * n + 1, 1001]):
        for dim in (0, 1):
            shape = (rows, 3) if dim == 0 else (2, rows)
            for op in ("sum", "avg", "max"):
                x = rank_input(seed, r, shape, torch.float32)
                before = x.clone()
                out = sw.comm.reduce_scatter(x, m, "dp", op=op, dim=dim, algorithm=algorithm)
                full = expected_reduce(seed, ranks, shape, torch.float32, op)
                want = torch.split(full, shard_sizes(rows, n), dim=dim)[r]
                if not _close(out, want, op) or not torch.equal(x, before):
                    failures.append(f"reduce_scatter {algorithm} {op} rows={rows} dim={dim}")
    return failures


def check_broadcast(algorithm: str) -> list[str]:
    m = mesh(dp=-1)
    n = m.size("dp")
    failures = []
    for src in range(n):
        for length in (0, 1, 5, 3001):
            x = rank_input(src, m.rank, (length,), torch.bfloat16)
            sw.comm.broadcast(x, m, "dp", src=src, algorithm=algorithm, piece_bytes=1024)
            if not torch.equal(x, rank_input(src, src, (length,), torch.bfloat16)):
                failures.append(f"broadcast {algorithm} src={src} L={length}")
    return failures


def check_all_to_all() -> list[str]:
    """S(0) -> S(1) redistribution of a (rows, cols) matrix with uneven rows and columns."""
    m = mesh(dp=-1)
    n, r = m.size("dp"), m.rank
    full = rank_input(3, 0, (2 * n + 1, 3 * n - 1), torch.float32)
    row_sizes = shard_sizes(full.shape[0], n)
    mine = torch.split(full, row_sizes, dim=0)[r]
    out = sw.comm.all_to_all(mine, m, "dp", split_dim=1, concat_dim=0, concat_sizes=row_sizes)
    want = torch.split(full, shard_sizes(full.shape[1], n), dim=1)[r]
    return [] if torch.equal(out, want) else [f"all_to_all got {tuple(out.shape)} want {tuple(want.shape)}"]


def check_send_recv_ring() -> list[str]:
    """Each rank sends its rank to the right neighbour; everyone receives its left neighbour's."""
    m = mesh(dp=-1)
    n, r = m.size("dp"), m.coord("dp")
    if n == 1:
        return []
    out = torch.zeros(3, dtype=torch.int64)
    h = sw.comm.isend(torch.full((3,), r, dtype=torch.int64), m, "dp", dst=(r + 1) % n)
    sw.comm.recv(out, m, "dp", src=(r - 1) % n)
    h.wait()
    return [] if torch.equal(out, torch.full((3,), (r - 1) % n)) else [f"recv got {out.tolist()}"]


def check_async(algorithm: str) -> list[str]:
    """Several asynchronous all-reduces in flight at once, waited in reverse order, each correct."""
    m = mesh(dp=-1)
    ranks = list(range(m.size("dp")))
    xs = [rank_input(s, m.rank, (257 * (s + 1),), torch.float32) for s in range(4)]
    handles = [sw.comm.all_reduce(x, m, "dp", algorithm=algorithm, async_op=True) for x in xs]
    failures = []
    for s in reversed(range(4)):
        out = handles[s].wait()
        if out is not xs[s] or not _close(out, expected_reduce(s, ranks, (257 * (s + 1),), torch.float32, "sum"), "sum"):
            failures.append(f"async {algorithm} #{s}")
    # A synchronous call after asynchronous ones must queue behind them, not overtake them.
    y = rank_input(9, m.rank, (10,), torch.float32)
    sw.comm.all_reduce(y, m, "dp", algorithm=algorithm)
    if not _close(y, expected_reduce(9, ranks, (10,), torch.float32, "sum"), "sum"):
        failures.append(f"sync after async {algorithm}")
    return failures


def check_2d_mesh_axes(algorithm: str) -> list[str]:
    """On Mesh(dp=2, tp=2): a reduction over each axis sums exactly the ranks of that axis' group."""
    m = mesh(dp=2, tp=2)
    failures = []
    for seed, axis in enumerate(("dp", "tp")):
        x = rank_input(seed, m.rank, (11,), torch.float32)
        sw.comm.all_reduce(x, m, axis, algorithm=algorithm)
        if not _close(x, expected_reduce(seed, m.ranks(axis), (11,), torch.float32, "sum"), "sum"):
            failures.append(f"2x2 {axis} {algorithm}")
    return failures


def debug_mismatch(kind: str) -> str:
    """With ``Mesh(debug=True)``, ranks that disagree get a ValueError (returned as text), not a hang."""
    m = mesh(debug=True, dp=-1)
    try:
        if kind == "length":
            sw.comm.all_reduce(torch.ones(4 + m.rank), m, "dp", algorithm="ring")
        elif kind == "op":
            sw.comm.all_reduce(torch.ones(4), m, "dp", op="sum" if m.rank == 0 else "max")
        elif kind == "dtype":
            sw.comm.all_reduce(torch.ones(4, dtype=torch.float32 if m.rank else torch.float64), m, "dp")
    except ValueError as exc:
        return str(exc)
    return "no error"


def bad_input(case: str) -> str:
    """Local argument errors raise ValueError before any communication; returns the message."""
    m = mesh(dp=-1)
    calls = {
        "algorithm": lambda: sw.comm.all_reduce(torch.ones(2), m, "dp", algorithm="butterfly"),
        "avg_int": lambda: sw.comm.all_reduce(torch.ones(2, dtype=torch.int64), m, "dp", op="avg"),
        "op": lambda: sw.comm.all_reduce(torch.ones(2), m, "dp", op="prod"),
        "axis": lambda: sw.comm.all_reduce(torch.ones(2), m, "tp"),
        "a2a_ring": lambda: sw.comm.all_to_all(torch.ones(2, 2), m, "dp", split_dim=0, concat_dim=1,
                                               algorithm="ring"),
        "ring_dtype": lambda: sw.comm.all_reduce(torch.ones(2, dtype=torch.complex64), m, "dp", algorithm="ring"),
        "bcast_src": lambda: sw.comm.broadcast(torch.ones(2), m, "dp", src=99),
        "gather_sizes": lambda: sw.comm.all_gather(torch.ones(2), m, "dp", sizes=[5] * m.size("dp")),
        "mesh_product": lambda: sw.Mesh(dp=m.size("dp") + 1),
    }
    try:
        calls[case]()
    except ValueError as exc:
        return str(exc)
    return "no error"


def check_auto_algorithm() -> dict[str, object]:
    """``algorithm="auto"`` on a (dp=2, tp=2) mesh whose calibration covers groups of 2 only (tree below 64 KiB,
    ring above): which implementation each call ran (CommCounter) and whether it equals native's result."""
    from tests.unit.test_hardware_calibration import crossover_calibration

    m = mesh(dp=2, tp=2).with_calibration(crossover_calibration(2))
    out: dict[str, object] = {"same": True}
    for name, length in (("small", 256), ("large", 64 << 10)):  # 1 KiB and 256 KiB of float32
        x = rank_input(7, m.rank, (length,), torch.float32)
        want = sw.comm.all_reduce(x.clone(), m, "tp", algorithm="native")
        with CommCounter() as c:
            got = sw.comm.all_reduce(x.clone(), m, "tp", algorithm="auto")
            h = sw.comm.all_reduce(x.clone(), m, "tp", algorithm="auto", async_op=True)
            got_async = h.wait()
        out[name] = [r.algorithm for r in c.records]
        out["messages_" + name] = c.messages_sent
        out["same"] = out["same"] and torch.equal(got, want) and torch.equal(got_async, want)
    with CommCounter() as c:  # no model for all_gather, none for this mesh, none for a 4-rank axis: native
        sw.comm.all_gather(torch.ones(4), m, "tp", algorithm="auto")
        sw.comm.all_reduce(torch.ones(4), mesh(dp=2, tp=2), "tp", algorithm="auto")
        sw.comm.all_reduce(torch.ones(4), mesh(dp=-1).with_calibration(crossover_calibration(2)), "dp",
                           algorithm="auto")
    out["fallback"] = [r.algorithm for r in c.records]
    out["sub"] = m.sub("tp").calibration_for(2) is m.calibration_for(2)
    model = sw.DataParallel(torch.nn.Linear(4, 4), m, "tp", algorithm="auto")  # 80 B of gradients: tree
    with CommCounter() as c:
        model(torch.full((2, 4), float(m.coord("tp") + 1))).sum().backward()
    out["dp"] = [r.algorithm for r in c.records if r.op == "all_reduce"]
    return out
