"""Rank-side checks for ``algorithm="shm"`` (run inside LocalWorld ranks by tests/dist/test_comm_shm.py).

The reference is the backend's own collective (``algorithm="native"``) on the same data, and, for sums of
small integers (exact in every dtype whatever the order), the exact value computed independently of both.
"""

from __future__ import annotations

import os
import time

import torch

import shardwise as sw
from shardwise.comm import CommCounter, shard_sizes
from shardwise.comm import shm_rendezvous
from shardwise.comm.ops import SUPPORTED_DTYPES
from shardwise.comm.shm_segment import NAME_PREFIX, SHM_DIR
from tests.dist.comm_checks import expected_reduce, rank_input
from tests.dist.fault_worlds import report_and_exit
from tests.dist.meshes import mesh

LENGTHS = [0, 1, 2, 3, 5, 7, 1000, 4099, 70_001]
"""Odd lengths; the last is above the small-message path (64 KiB) in every dtype."""
OPS = ("sum", "avg", "max", "min")


def _ops(dtype: torch.dtype) -> tuple[str, ...]:
    return OPS if dtype.is_floating_point else ("sum", "max", "min")


def check_all_reduce_matrix(piece_bytes: int | None = None) -> list[str]:
    """Every supported dtype x op x odd length: shm equals native (and the exact value for sum/max/min)."""
    m = mesh(dp=-1)
    ranks = list(range(m.size("dp")))
    kw = {"piece_bytes": piece_bytes} if piece_bytes else {}
    failures = []
    for dtype in SUPPORTED_DTYPES:
        for op in _ops(dtype):
            for seed, length in enumerate(LENGTHS):
                x = rank_input(seed, m.rank, (length,), dtype)
                ref = sw.comm.all_reduce(x.clone(), m, "dp", op=op, algorithm="native")
                out = sw.comm.all_reduce(x, m, "dp", op=op, algorithm="shm", **kw)
                exact = op == "avg" or dtype == torch.uint8 or torch.equal(
                    out.double(), expected_reduce(seed, ranks, (length,), dtype, op))
                if out is not x or not torch.equal(out, ref) or not exact:
                    failures.append(f"all_reduce shm {op} {dtype} L={length} pieces={piece_bytes}")
    return failures


def check_shapes() -> list[str]:
    """0-d, multi-dimensional and non-contiguous inputs are reduced in place, shape kept, like native."""
    m = mesh(dp=-1)
    failures = []
    for seed, shape in enumerate([(), (3, 5), (2, 3, 4), (0, 4)]):
        x = rank_input(seed, m.rank, shape, torch.float32)
        ref = sw.comm.all_reduce(x.clone(), m, "dp", algorithm="native")
        sw.comm.all_reduce(x, m, "dp", algorithm="shm")
        if x.shape != shape or not torch.equal(x, ref):
            failures.append(f"shape {shape}")
    base = rank_input(7, m.rank, (40, 60), torch.float32)
    ref = sw.comm.all_reduce(base.clone(), m, "dp", algorithm="native")
    sw.comm.all_reduce(base.t(), m, "dp", algorithm="shm")  # non-contiguous (60, 40) view
    if not torch.equal(base, ref):
        failures.append("non-contiguous view not reduced in place")
    return failures


def check_bit_identical_sums() -> list[str]:
    """Random (non-integer) floats, many pieces: every rank gets bit-identical sums (fixed reduction order),
    close to native's (whose order may differ)."""
    m = mesh(dp=-1)
    failures = []
    for dtype, length, piece in ((torch.float32, 300_007, 4096), (torch.bfloat16, 5_001, None),
                                 (torch.float16, 100_003, 1024)):
        x = torch.randn(length, generator=torch.Generator().manual_seed(m.rank)).to(dtype)
        ref = sw.comm.all_reduce(x.clone(), m, "dp", algorithm="native")
        kw = {"piece_bytes": piece} if piece else {}
        sw.comm.all_reduce(x, m, "dp", algorithm="shm", **kw)
        bits = (x.view(torch.int16) if dtype != torch.float32 else x.view(torch.int32)).to(torch.int64)
        gathered = sw.comm.all_gather(bits.reshape(1, -1), m, "dp", algorithm="native")
        if not all(torch.equal(row, gathered[0]) for row in gathered):
            failures.append(f"{dtype}: ranks differ")
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        if not torch.allclose(x.double(), ref.double(), rtol=tol, atol=tol):
            failures.append(f"{dtype}: far from native")
    return failures


def check_reduce_scatter() -> list[str]:
    """Uneven rows (``shard_sizes``), dims 0 and 1, every op, several dtypes, small and many-piece: equal to
    native; the input is left unchanged."""
    m = mesh(dp=-1)
    n = m.size("dp")
    failures = []
    for dtype in (torch.float32, torch.bfloat16, torch.int32, torch.uint8, torch.float64):
        for seed, rows in enumerate([0, 1, n, 2 * n + 1, 1001, 40_003]):
            for dim in (0, 1):
                shape = (rows, 3) if dim == 0 else (2, rows)
                for op in _ops(dtype):
                    x = rank_input(seed, m.rank, shape, dtype)
                    before = x.clone()
                    ref = sw.comm.reduce_scatter(x.clone(), m, "dp", op=op, dim=dim, algorithm="native")
                    piece = 512 if rows == 1001 else None
                    kw = {"piece_bytes": piece} if piece else {}
                    out = sw.comm.reduce_scatter(x, m, "dp", op=op, dim=dim, algorithm="shm", **kw)
                    if out.shape != ref.shape or not torch.equal(out, ref) or not torch.equal(x, before):
                        failures.append(f"reduce_scatter {dtype} {op} rows={rows} dim={dim}")
    return failures


def check_all_gather() -> list[str]:
    """Even and uneven (``sizes``) gathers along dims 0 and 1, 0-d and empty inputs: equal to native."""
    m = mesh(dp=-1)
    n, r = m.size("dp"), m.coord("dp")
    failures = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
        for seed, total in enumerate([0, 1, n, 2 * n + 1, 1001, 3 * 70_001]):
            sizes = shard_sizes(total, n)
            for dim in (0, 1):
                shape = (sizes[r], 3) if dim == 0 else (2, sizes[r])
                x = rank_input(seed, r, shape, dtype)
                ref = sw.comm.all_gather(x, m, "dp", dim=dim, sizes=sizes, algorithm="native")
                piece = 256 if total == 1001 else None
                kw = {"piece_bytes": piece} if piece else {}
                out = sw.comm.all_gather(x, m, "dp", dim=dim, sizes=sizes, algorithm="shm", **kw)
                if out.shape != ref.shape or not torch.equal(out, ref):
                    failures.append(f"all_gather {dtype} total={total} dim={dim}")
                if dim == 0:  # in place: this rank's rows already sit in the caller's buffer (ZeRO's flat shard)
                    buf = torch.zeros_like(ref)
                    lo = sum(sizes[:r])
                    buf[lo:lo + sizes[r]] = x
                    got = sw.comm.all_gather(buf[lo:lo + sizes[r]], m, "dp", sizes=sizes, algorithm="shm", out=buf,
                                             **kw)
                    if got.data_ptr() != buf.data_ptr() or not torch.equal(buf, ref):
                        failures.append(f"all_gather out= {dtype} total={total}")
    scalar = torch.tensor(float(r + 1))
    out = sw.comm.all_gather(scalar, m, "dp", algorithm="shm")
    if not torch.equal(out, torch.arange(1, n + 1, dtype=torch.float32)):
        failures.append(f"all_gather 0-d got {out.tolist()}")
    return failures


def check_broadcast() -> list[str]:
    """Every source, odd lengths (one piece and many), several dtypes, 0-d."""
    m = mesh(dp=-1)
    n = m.size("dp")
    failures = []
    for src in range(n):
        for dtype in (torch.bfloat16, torch.int32, torch.float64):
            for length in (0, 1, 5, 3001, 300_001):
                x = rank_input(src, m.rank, (length,), dtype)
                out = sw.comm.broadcast(x, m, "dp", src=src, algorithm="shm", piece_bytes=4096)
                if out is not x or not torch.equal(x, rank_input(src, src, (length,), dtype)):
                    failures.append(f"broadcast src={src} {dtype} L={length}")
        s = torch.tensor(float(m.rank))
        sw.comm.broadcast(s, m, "dp", src=src, algorithm="shm")
        if float(s) != src:
            failures.append(f"broadcast 0-d src={src}")
    return failures


def check_async() -> list[str]:
    """Asynchronous calls of every collective in flight at once, waited in reverse order; then a sync one."""
    m = mesh(dp=-1)
    n, r = m.size("dp"), m.coord("dp")
    xs = [rank_input(s, m.rank, (257 * (s + 1) + 5000 * s,), torch.float32) for s in range(4)]
    refs = [sw.comm.all_reduce(x.clone(), m, "dp", algorithm="native") for x in xs]
    handles = [sw.comm.all_reduce(x, m, "dp", algorithm="shm", async_op=True) for x in xs]
    g = sw.comm.all_gather(torch.full((2,), float(r)), m, "dp", algorithm="shm", async_op=True)
    rs = sw.comm.reduce_scatter(torch.ones(3 * n), m, "dp", algorithm="shm", async_op=True)
    b = sw.comm.broadcast(torch.full((3,), float(r)), m, "dp", src=n - 1, algorithm="shm", async_op=True)
    failures = []
    if not torch.equal(b.wait(), torch.full((3,), float(n - 1))) or \
            not torch.equal(rs.wait(), torch.full((3,), float(n))):
        failures.append("async broadcast/reduce_scatter")
    if not torch.equal(g.wait(), torch.arange(n, dtype=torch.float32).repeat_interleave(2)):
        failures.append("async all_gather")
    for s in reversed(range(4)):
        out = handles[s].wait()
        if out is not xs[s] or not torch.equal(out, refs[s]):
            failures.append(f"async all_reduce #{s}")
    y = rank_input(9, m.rank, (10,), torch.float32)
    want = sw.comm.all_reduce(y.clone(), m, "dp", algorithm="native")
    if not torch.equal(sw.comm.all_reduce(y, m, "dp", algorithm="shm"), want):
        failures.append("sync after async")
    return failures


def check_many_calls(calls: int) -> dict[str, object]:
    """``calls`` consecutive small all-reduces (each one piece: the slots wrap around calls/4 times) with a
    value that changes every call; returns failures and how far the group's sequence counter moved."""
    m = mesh(dp=-1)
    n = m.size("dp")
    group = shm_rendezvous.shm_group_for(m, "dp")
    start = group.seq
    failures = []
    for k in range(calls):
        x = torch.tensor([float(k + m.rank), float(k % 7)])
        sw.comm.all_reduce(x, m, "dp", algorithm="shm")
        want = torch.tensor([float(n * k + n * (n - 1) // 2), float(n * (k % 7))])
        if not torch.equal(x, want):
            failures.append(f"call {k}: {x.tolist()} != {want.tolist()}")
            break
    return {"failures": failures, "pieces": group.seq - start, "slots": group.layout.slots}


def check_two_axes_alternately(rounds: int) -> dict[str, object]:
    """On Mesh(dp=2, tp=2): all-reduces over dp and tp interleaved; each sums exactly its group's ranks, and
    the two axes use different segments."""
    m = mesh(dp=2, tp=2)
    failures = []
    for k in range(rounds):
        for axis in ("dp", "tp"):
            seed = 2 * k + (axis == "tp")
            length = 3 if k % 2 else 9000  # alternate the small path and the pieced path
            x = rank_input(seed, m.rank, (length,), torch.float32)
            sw.comm.all_reduce(x, m, axis, algorithm="shm")
            if not torch.equal(x.double(), expected_reduce(seed, m.ranks(axis), (length,), torch.float32, "sum")):
                failures.append(f"round {k} axis {axis}")
    names = {a: shm_rendezvous.shm_group_for(m, a).name for a in ("dp", "tp")}
    return {"failures": failures, "names": names}


def count_records() -> dict[str, object]:
    """CommCounter sees each shm collective once, with algorithm 'shm', and no point-to-point messages."""
    m = mesh(dp=-1)
    n = m.size("dp")
    with CommCounter() as c:
        sw.comm.all_reduce(torch.ones(1000), m, "dp", algorithm="shm")
        sw.comm.all_gather(torch.ones(10), m, "dp", algorithm="shm")
        sw.comm.reduce_scatter(torch.ones(10 * n), m, "dp", algorithm="shm")
        sw.comm.broadcast(torch.ones(10), m, "dp", algorithm="shm").tolist()
    return {"records": [(r.op, r.algorithm, r.nbytes, r.group_size) for r in c.records],
            "messages": c.messages_sent + c.messages_received}


def check_debug_mode() -> dict[str, str]:
    """``Mesh(debug=True)``: matching shm calls pass the signature check; a mismatch is a ValueError."""
    m = mesh(debug=True, dp=-1)
    x = torch.ones(5)
    sw.comm.all_reduce(x, m, "dp", algorithm="shm")
    ok = "ok" if torch.equal(x, torch.full((5,), float(m.size("dp")))) else f"wrong {x.tolist()}"
    try:
        sw.comm.all_reduce(torch.ones(4 + m.rank), m, "dp", algorithm="shm")
        mismatch = "no error"
    except ValueError as exc:
        mismatch = str(exc)
    return {"ok": ok, "mismatch": mismatch}


def check_auto(fake_hosts: bool) -> list[str]:
    """``algorithm="auto"`` with a calibration whose cheapest all-reduce is shm: the algorithm that ran
    (``CommCounter``), on a fresh mesh; with ``fake_hosts`` every rank claims its own host."""
    from shardwise.comm.calibration import AlphaBeta, Calibration

    m = sw.Mesh(dp=-1)
    n = m.size("dp")
    models = {"all_reduce": {"native": AlphaBeta(400.0, 2e-3), "ring": AlphaBeta(300.0, 1e-3),
                             "shm": AlphaBeta(5.0, 1e-4)}}
    m = m.with_calibration(Calibration(world_size=n, backend="gloo", device="cpu", models=models))
    real = shm_rendezvous.host_identity
    if fake_hosts:
        shm_rendezvous.host_identity = lambda: f"fake-host-{m.rank}/boot"
    try:
        x = torch.ones(100)
        with CommCounter() as c:
            sw.comm.all_reduce(x, m, "dp", algorithm="auto")
            sw.comm.all_reduce(x, m, "dp", algorithm="auto", async_op=True).wait()
        forced = "no error"
        try:
            sw.comm.all_reduce(torch.ones(3), m, "dp", algorithm="shm")
        except ValueError as exc:
            forced = str(exc)
    finally:
        shm_rendezvous.host_identity = real
    ok = torch.equal(x, torch.full((100,), float(n * n)))
    return [r.algorithm for r in c.records] + [forced, "values ok" if ok else f"values {x[:3].tolist()}"]


def leftover_segments() -> list[str]:
    """Segment files of this process' pid in /dev/shm (there must be none once a group is set up)."""
    mesh(dp=-1)
    return [f for f in os.listdir(SHM_DIR) if f.startswith(f"{NAME_PREFIX}{os.getpid()}-")]


def latency_us(algorithm: str, calls: int) -> float:
    """Mean microseconds of an 8-byte all-reduce (informational: tests assert no timing)."""
    m = mesh(dp=-1)
    x = torch.ones(2)
    for _ in range(20):
        sw.comm.all_reduce(x, m, "dp", algorithm=algorithm)
    start = time.perf_counter()
    for _ in range(calls):
        sw.comm.all_reduce(x, m, "dp", algorithm=algorithm)
    return (time.perf_counter() - start) / calls * 1e6


def fault_rank(rank: int, n: int, init_file: str, victim: int, results: object) -> None:
    """One rank of a fresh world (spawned by the test, not LocalWorld): after a working all-reduce, rank
    ``victim`` exits (``os._exit``) in the middle of the next one, right after publishing its third piece.
    The others report what they raised, how long it took, what a later call raises and whether the segment
    file exists."""
    from shardwise.comm.shm_segment import ARRIVE
    from shardwise.comm.shm_sync import ShmError
    from shardwise.world import init

    init(backend="gloo", init_method=f"file://{init_file}", rank=rank, world_size=n, timeout_s=600)
    m = sw.Mesh(dp=-1)
    sw.comm.all_reduce(torch.ones(1000), m, "dp", algorithm="shm")
    group = shm_rendezvous.shm_group_for(m, "dp")
    if rank == victim:
        publish, arrived = group._publish, [0]

        def dying(field: int, value: int) -> None:
            publish(field, value)
            arrived[0] += field == ARRIVE
            if arrived[0] == 3:
                os._exit(3)
        group._publish = dying  # type: ignore[method-assign]
    start = time.monotonic()
    try:
        sw.comm.all_reduce(torch.ones(100_000), m, "dp", algorithm="shm", piece_bytes=4096)
        outcome = ("no error", "")
    except ShmError as exc:
        outcome = (type(exc).__name__, str(exc))
    elapsed = time.monotonic() - start
    try:
        sw.comm.all_reduce(torch.ones(3), m, "dp", algorithm="shm")
        later = "no error"
    except ShmError as exc:
        later = f"{type(exc).__name__}: {exc}"
    left = os.path.exists(os.path.join(SHM_DIR, group.name))
    report_and_exit(results, (rank, outcome, elapsed, later, left))


def check_data_parallel_gradients() -> list[str]:
    """``DataParallel(algorithm="shm")`` (asynchronous bucket all-reduces during backward) averages the same
    gradients as ``algorithm="native"`` from the same weights and data, and calls only shm all-reduces."""
    m = mesh(dp=-1)
    grads = {}
    for algorithm in ("native", "shm"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
        model = sw.DataParallel(net, m, "dp", algorithm=algorithm, bucket_cap_mb=0.002, first_bucket_mb=0.001)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(m.rank))
        with CommCounter() as c:
            model(x).square().sum().backward()
        grads[algorithm] = [p.grad.clone() for p in net.parameters()]
        used = {r.algorithm for r in c.records if r.op == "all_reduce"}
        if used != {algorithm}:
            return [f"{algorithm}: all-reduces {c.by_op()} with {used}"]
    return [f"grad {k}" for k, (a, b) in enumerate(zip(grads["native"], grads["shm"]))
            if not torch.allclose(a, b, rtol=1e-6, atol=1e-7)]
