"""Rank-side checks for ``sw.DataParallel`` (run inside LocalWorld ranks by tests/dist/test_data_parallel.py).

Every check builds the same model from a seed on every rank, trains it data-parallel on this rank's slice
of a global batch, and compares with a single-process reference built from the same weights and data:
either one process on the full batch (the usual case), or — where replicas legitimately compute different
things (BatchNorm statistics, rank-dependent branches) — the same per-rank losses evaluated in one process.
Checks return small results (errors, per-step parameter hashes, collective counts) for the parent.
"""

from __future__ import annotations

import zlib
from typing import Callable

import torch
import torch.nn as nn

import shardwise as sw
from shardwise.comm import CommCounter
from shardwise.parallel.data.data_parallel import DataParallel
from tests.dist.meshes import mesh

B, STEPS, DIN, DOUT = 3, 5, 8, 4
SMALL = dict(bucket_cap_mb=600 / 2**20, first_bucket_mb=100 / 2**20)  # several buckets for tiny models


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(DIN, 16), nn.Linear(16, 16), nn.Linear(16, DOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class Reversed(nn.Module):
    """Registered c, b, a but applied a → b → c: the observed ready order differs from the default one."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.b, self.a = nn.Linear(16, DOUT), nn.Linear(16, 16), nn.Linear(DIN, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class Tied(nn.Module):
    """One Linear applied twice, and a Parameter shared by two modules (like GPT's wte/lm_head)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.shared = nn.Linear(DIN, 16), nn.Linear(16, 16)
        self.out_a, self.out_b = nn.Linear(16, DOUT), nn.Linear(16, DOUT)
        self.out_b.weight = self.out_a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(torch.tanh(self.shared(torch.tanh(self.inp(x))))))
        return self.out_a(h) + 0.5 * self.out_b(h)


class Branchy(nn.Module):
    """``never`` is never used; ``extra`` only for inputs whose first feature sum is positive (data-dependent,
    so some ranks use it and others do not)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.extra, self.never, self.out = (nn.Linear(DIN, 16), nn.Linear(16, 16), nn.Linear(16, 16),
                                                     nn.Linear(16, DOUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        if x[:, 0].sum() > 0:
            h = torch.tanh(self.extra(h))
        return self.out(h)


class BN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(DIN, 16), nn.BatchNorm1d(16), nn.Linear(16, DOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": MLP, "reversed": Reversed, "tied": Tied, "branchy": Branchy,
                                              "bn": BN}


def build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[kind]()


def data(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(STEPS, n*B, DIN) inputs and (STEPS, n*B, DOUT) targets, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(STEPS, n * B, DIN, generator=g), torch.randn(STEPS, n * B, DOUT, generator=g)


def make_opt(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-5, weight_decay=0.01)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def state_hash(model: nn.Module) -> int:
    flat = torch.cat([t.detach().reshape(-1).double() for t in [*model.parameters(), *model.buffers()]])
    return zlib.crc32(flat.numpy().tobytes())


def reference(kind: str, opt_name: str, n: int, *, per_rank: bool = False, steps: int = STEPS) -> nn.Module:
    """One process. ``per_rank``: average the n micro-batch losses (each forward sees one rank's slice, and
    buffers follow coordinate 0's slice, as broadcast_buffers makes them); else one full-batch loss."""
    model, (X, Y) = build(kind), data(n)
    opt = make_opt(opt_name, model.parameters())
    for k in range(steps):
        opt.zero_grad()
        if not per_rank:
            loss_fn(model(X[k]), Y[k]).backward()
        else:
            start = {name: b.clone() for name, b in model.named_buffers()}
            after0 = start
            for i in range(n):
                model.load_state_dict(start, strict=False)
                (loss_fn(model(X[k][i * B:(i + 1) * B]), Y[k][i * B:(i + 1) * B]) / n).backward()
                if i == 0:
                    after0 = {name: b.clone() for name, b in model.named_buffers()}
            model.load_state_dict(after0, strict=False)
        opt.step()
    return model


def max_err(a: nn.Module, b: nn.Module) -> float:
    pairs = list(zip(a.state_dict().values(), b.state_dict().values()))
    return max((x.double() - y.double()).abs().max().item() / (1e-3 + y.double().abs().max().item())
               for x, y in pairs)


def train(model: DataParallel, opt_name: str, m: sw.Mesh, axis: str = "dp", steps: int = STEPS,
          opt: torch.optim.Optimizer | None = None) -> tuple[list[int], list[dict[str, int]]]:
    """Train on this rank's slice; returns per-step state hashes and per-step collective counts."""
    n, r = m.size(axis), m.coord(axis)
    X, Y = data(n)
    opt = opt or make_opt(opt_name, model.parameters())
    hashes, counts = [], []
    for k in range(steps):
        opt.zero_grad()
        with CommCounter() as c:
            loss_fn(model(X[k][r * B:(r + 1) * B]), Y[k][r * B:(r + 1) * B]).backward()
        opt.step()
        counts.append({"all_reduce": c.count("all_reduce"), "bytes": c.bytes("all_reduce"),
                       "broadcast": c.count("broadcast"), "group": max((x.group_size for x in c.records), default=0)})
        hashes.append(state_hash(model.module))
    return hashes, counts


def grad_bytes(model: nn.Module) -> int:
    """Bytes one step must all-reduce: each trainable Parameter once, plus the status tail (one float each)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() * p.element_size() for p in params) + 4 * len(params)


# -- checks (each runs on every rank) -------------------------------------------------------------------
def check_matches_full_batch(configs: list[tuple], axes: dict[str, int] | None = None) -> list[dict]:
    """``configs``: (model kind, optimizer, overlap, algorithm). Same parameters as one process on the full
    batch; one all-reduce per bucket per step carrying every unique gradient once."""
    m = mesh(**(axes or {"dp": -1}))
    out = []
    for kind, opt_name, overlap, algorithm in configs:
        model = DataParallel(build(kind), m, "dp", overlap=overlap, algorithm=algorithm, **SMALL)
        hashes, counts = train(model, opt_name, m)
        nb, stats = len(model.bucket_plan), model.comm_stats()
        out.append({"cfg": (kind, opt_name, overlap, algorithm), "hashes": hashes, "buckets": nb,
                    "err": max_err(model.module, reference(kind, opt_name, m.size("dp"))),
                    "counts_ok": all(c["all_reduce"] == nb and c["bytes"] == grad_bytes(model.module)
                                     and c["group"] == m.size("dp") for c in counts),
                    "stats_ok": stats.steps == STEPS and stats.buckets == STEPS * nb
                    and 0.0 <= stats.hidden_share <= 1.0 and stats.exposed_s <= stats.backward_s + 1e-3})
    return out


def check_no_sync(opt_name: str, grad_views: bool, set_to_none: bool) -> dict:
    """Two micro-batches per rank and step, the first under no_sync: equal to one step on the 2n·B batch."""
    m = mesh(dp=-1)
    n, r = m.size("dp"), m.coord("dp")
    model = DataParallel(build("mlp"), m, "dp", grad_views=grad_views, **SMALL)
    opt = make_opt(opt_name, model.parameters())
    X, Y = data(2 * n)
    quiet, loud = [], []
    for k in range(STEPS):
        opt.zero_grad(set_to_none=set_to_none)
        rows = [slice((2 * r + j) * B, (2 * r + j + 1) * B) for j in (0, 1)]
        with CommCounter() as c:
            with model.no_sync():
                (loss_fn(model(X[k][rows[0]]), Y[k][rows[0]]) / 2).backward()
        quiet.append(c.count("all_reduce"))
        with CommCounter() as c:
            (loss_fn(model(X[k][rows[1]]), Y[k][rows[1]]) / 2).backward()
        loud.append(c.count("all_reduce"))
        opt.step()
    return {"err": max_err(model.module, reference("mlp", opt_name, 2 * n)), "quiet": quiet, "loud": loud,
            "buckets": len(model.bucket_plan), "hash": state_hash(model.module)}


def _extra_mixed(n: int) -> bool:
    """Whether some step has ranks that use Branchy.extra and ranks that do not (so the test means something)."""
    X, _ = data(n)
    return any(len({bool(X[k][i * B:(i + 1) * B][:, 0].sum() > 0) for i in range(n)}) == 2 for k in range(STEPS))


def check_unused_found() -> dict:
    """find_unused_parameters=True: a never-used and a rank-dependent branch; no extra collective."""
    m = mesh(dp=-1)
    model = DataParallel(build("branchy"), m, "dp", find_unused_parameters=True, **SMALL)
    hashes, counts = train(model, "adamw", m)
    inner = model.module
    return {"err": max_err(inner, reference("branchy", "adamw", m.size("dp"), per_rank=True)), "hashes": hashes,
            "mixed": _extra_mixed(m.size("dp")), "never_grad_none": inner.never.weight.grad is None,
            "extra_grad": inner.extra.weight.grad is not None,
            "counts_ok": all(c["all_reduce"] == len(model.bucket_plan) for c in counts)}


def check_unused_accumulated() -> dict:
    """find_unused_parameters + no_sync: ``extra`` is used only in the first (local) micro-step; its
    accumulated gradient must still be averaged by the synchronised backward."""
    m = mesh(dp=-1)
    n, r = m.size("dp"), m.coord("dp")
    X, Y = data(2 * n)
    X = X.view(STEPS, n, 2, B, DIN).clone()  # [step, rank, micro-step, row, feature]
    X[:, :, 0, :, 0] = X[:, :, 0, :, 0].abs()  # micro-step 0 of every rank takes the branch ...
    X[:, :, 1, :, 0] = -X[:, :, 1, :, 0].abs()  # ... micro-step 1 never does
    Y = Y.view(STEPS, n, 2, B, DOUT)
    model = DataParallel(build("branchy"), m, "dp", find_unused_parameters=True, **SMALL)
    ref = build("branchy")
    opt, ropt = make_opt("sgd", model.parameters()), make_opt("sgd", ref.parameters())
    for k in range(STEPS):
        opt.zero_grad()
        ropt.zero_grad()
        with model.no_sync():
            (loss_fn(model(X[k, r, 0]), Y[k, r, 0]) / 2).backward()
        (loss_fn(model(X[k, r, 1]), Y[k, r, 1]) / 2).backward()
        for i in range(n):
            for j in range(2):
                (loss_fn(ref(X[k, i, j]), Y[k, i, j]) / (2 * n)).backward()
        opt.step()
        ropt.step()
    return {"err": max_err(model.module, ref), "hash": state_hash(model.module),
            "extra_moved": bool((model.module.extra.weight - build("branchy").extra.weight).abs().max() > 0)}


def check_unused_raises(freeze_never: bool) -> str:
    """Without find_unused_parameters every rank raises a ValueError naming the parameters (no hang)."""
    m = mesh(dp=-1)
    net = build("branchy")
    if freeze_never:
        net.never.requires_grad_(False)
    model = DataParallel(net, m, "dp", **SMALL)
    X, Y = data(m.size("dp"))
    r = m.coord("dp")
    for k in range(STEPS):
        try:
            loss_fn(model(X[k][r * B:(r + 1) * B]), Y[k][r * B:(r + 1) * B]).backward()
        except ValueError as exc:
            return f"step {k}: {exc}"
    return "no error"


class _ReentrantMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint
        h = checkpoint(self.fc2, torch.tanh(self.fc1(x)), use_reentrant=True)
        return self.fc3(torch.tanh(h))


def check_reentrant_checkpoint_raises() -> str:
    m = mesh(dp=-1)
    torch.manual_seed(0)
    model = DataParallel(_ReentrantMLP(), m, "dp", **SMALL)
    X, Y = data(m.size("dp"))
    try:
        loss_fn(model(X[0][:B]), Y[0][:B]).backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def check_tied(opt_name: str) -> dict:
    m = mesh(dp=-1)
    model = DataParallel(build("tied"), m, "dp", **SMALL)
    hashes, counts = train(model, opt_name, m)
    unique = sum(p.numel() * 4 for p in {id(p): p for p in model.module.parameters()}.values())
    return {"err": max_err(model.module, reference("tied", opt_name, m.size("dp"))), "hashes": hashes,
            "bytes": [c["bytes"] for c in counts], "expected": unique + 4 * len(list(model.module.parameters())),
            "shared_once": [name for b in model.bucket_plan for name in b if name.endswith("out_a.weight")
                            or name.endswith("out_b.weight")] == ["out_a.weight"]}


def check_param_averaging() -> dict:
    """Local SGD. period=1 + SGD (momentum, weight decay: linear in the gradient) equals gradient averaging;
    period=2 + AdamW with state averaging: replicas agree exactly after every second step only."""
    m = mesh(dp=-1)
    n, r = m.size("dp"), m.coord("dp")
    model = DataParallel(build("mlp"), m, "dp", average="parameters", period=1)
    opt = make_opt("sgd", model.parameters())
    X, Y = data(n)
    backward_comm, averaged = 0, []
    for k in range(STEPS):
        opt.zero_grad()
        with CommCounter() as c:
            loss_fn(model(X[k][r * B:(r + 1) * B]), Y[k][r * B:(r + 1) * B]).backward()
        backward_comm += c.count()
        opt.step()
        with CommCounter() as c:
            averaged.append(model.average_parameters())
        averaged.append(c.count("all_reduce"))
    err = max_err(model.module, reference("mlp", "sgd", n))
    model2 = DataParallel(build("mlp"), m, "dp", average="parameters", period=2)
    opt2 = make_opt("adamw", model2.parameters())
    hashes = []
    for k in range(STEPS):
        opt2.zero_grad()
        loss_fn(model2(X[k][r * B:(r + 1) * B]), Y[k][r * B:(r + 1) * B]).backward()
        opt2.step()
        model2.average_parameters(opt2)
        moments = [opt2.state[p]["exp_avg"] for p in model2.parameters()]
        hashes.append((state_hash(model2.module), zlib.crc32(torch.cat([t.reshape(-1) for t in moments]).numpy().tobytes())))
    return {"err": err, "backward_comm": backward_comm, "averaged": averaged, "hashes": hashes}


def check_batchnorm() -> dict:
    """BatchNorm: per-replica statistics in the step, coordinate 0's buffers broadcast at each forward."""
    m = mesh(dp=-1)
    model = DataParallel(build("bn"), m, "dp", **SMALL)
    hashes, counts = train(model, "sgd", m)
    with torch.no_grad():
        model.eval()
        model(torch.zeros(2, DIN))  # eval: no statistics update; the forward broadcast makes every replica's buffers coordinate 0's
    ref = reference("bn", "sgd", m.size("dp"), per_rank=True)
    return {"err": max_err(model.module, ref), "broadcasts": [c["broadcast"] for c in counts],
            "hash": state_hash(model.module)}


def check_hooks() -> dict:
    """bf16/fp16 compression: close to the reference, half the bytes; a custom hook sees every bucket."""
    from shardwise.parallel.data.comm_hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook
    m = mesh(dp=-1)
    out: dict = {}
    for name, hook in (("bf16", bf16_compress_hook), ("fp16", fp16_compress_hook)):
        model = DataParallel(build("mlp"), m, "dp", **SMALL)
        model.register_comm_hook(hook)
        hashes, counts = train(model, "sgd", m)
        out[name] = {"err": max_err(model.module, reference("mlp", "sgd", m.size("dp"))), "hashes": hashes,
                     "bytes": counts[0]["bytes"], "full": grad_bytes(model.module)}
    seen: list = []

    def spy(bucket):
        seen.append((bucket.index, [id(p) for p in bucket.parameters], bucket.buffer.numel(),
                     [g.shape == p.shape for g, p in zip(bucket.gradients(), bucket.parameters)]))
        return allreduce_hook(bucket)
    model = DataParallel(build("mlp"), m, "dp", **SMALL)
    model.register_comm_hook(spy)
    train(model, "sgd", m, steps=2)
    ids = {id(p): name for name, p in model.module.named_parameters()}
    plan = model.bucket_plan
    out["spy"] = {"indices": [s[0] for s in seen], "names": [[ids[i] for i in s[1]] for s in seen[-len(plan):]],
                  "plan": plan, "shapes_ok": all(all(s[3]) for s in seen)}
    return out


def check_rebuild() -> dict:
    """Buckets are rebuilt once, in the observed ready order (one broadcast at the second forward)."""
    m = mesh(dp=-1)
    model = DataParallel(build("reversed"), m, "dp", **SMALL)
    before = model.bucket_plan
    hashes, counts = train(model, "sgd", m)
    return {"before": before, "after": model.bucket_plan, "broadcasts": [c["broadcast"] for c in counts],
            "err": max_err(model.module, reference("reversed", "sgd", m.size("dp"))), "hashes": hashes}


def check_centralized() -> dict:
    from shardwise.parallel.data.centralized import CentralizedDataParallel
    m = mesh(dp=-1)
    n, r = m.size("dp"), m.coord("dp")
    model = CentralizedDataParallel(build("mlp"), m, "dp", optimizer=lambda ps: make_opt("sgd", ps))
    X, Y = data(n)
    counts, hashes = [], []
    for k in range(STEPS):
        model.zero_grad()
        with CommCounter() as c:
            loss_fn(model(X[k][r * B:(r + 1) * B]), Y[k][r * B:(r + 1) * B]).backward()
            model.step()
        counts.append(c.by_op())
        hashes.append(state_hash(model.module))
    return {"err": max_err(model.module, reference("mlp", "sgd", n)), "counts": counts, "hashes": hashes,
            "has_optimizer": model.optimizer is not None}


def check_state_dict() -> dict:
    m = mesh(dp=-1)
    plain = build("mlp")
    model = DataParallel(build("mlp", seed=5), m, "dp")
    keys_ok = list(model.state_dict()) == list(plain.state_dict())
    model.load_state_dict(plain.state_dict())
    loaded = max_err(model.module, plain) == 0.0
    parent = nn.Sequential(model)
    sd = parent.state_dict()
    parent.load_state_dict(sd)
    return {"keys_ok": keys_ok, "loaded": loaded, "parent_keys": sorted(sd)[:2]}


class _Complex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.z = nn.Parameter(torch.zeros(2, dtype=torch.complex64))


def _error(fn: Callable[[], object]) -> str:
    try:
        fn()
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def check_bad_inputs() -> dict[str, str]:
    """Every bad input raises TypeError/ValueError before training; cross-rank mismatches on every rank."""
    m = mesh(dp=-1)
    r = m.coord("dp")
    out = {"complex": _error(lambda: DataParallel(_Complex(), m))}
    off = build("mlp")  # a meta parameter is materialised in place, when something says how to initialise it
    off.extra = nn.Parameter(torch.empty(3, device="meta"))
    out["device"] = _error(lambda: DataParallel(off, m))
    frozen = build("mlp").requires_grad_(False)
    out["frozen"] = _error(lambda: DataParallel(frozen, m))
    out["axis"] = _error(lambda: DataParallel(build("mlp"), m, "tp"))
    for kw in ({"bucket_cap_mb": 0}, {"bucket_cap_mb": -1.0}, {"first_bucket_mb": 0}, {"period": 0},
               {"average": "both"}, {"algorithm": "bogus"}, {"period": 2}):
        out[repr(kw)] = _error(lambda: DataParallel(build("mlp"), m, "dp", **kw))
    wrapped = DataParallel(build("mlp"), m)
    out["wrapper_twice"] = _error(lambda: DataParallel(wrapped, m))
    out["model_twice"] = _error(lambda: DataParallel(wrapped.module, m))
    out["hook_type"] = _error(lambda: wrapped.register_comm_hook(5))  # type: ignore[arg-type]
    out["hook_param_avg"] = _error(lambda: DataParallel(build("mlp"), m, average="parameters").register_comm_hook(print))
    shape = build("mlp")
    if r == 1:
        shape.fc2 = nn.Linear(16, 17)
    out["shape"] = _error(lambda: DataParallel(shape, m))
    names = ["a", "b"] if r == 0 else ["b", "a"]
    order = nn.ModuleDict({k: nn.Linear(4, 4) for k in names})
    out["order"] = _error(lambda: DataParallel(order, m))
    return out


def check_gpt(checkpointing: bool) -> dict:
    """The reference GPT (tied wte/lm_head), optionally with activation checkpointing, vs one process."""
    from shardwise.models.gpt import GPT, GPTConfig, lm_loss
    m = mesh(dp=-1)
    n, r = m.size("dp"), m.coord("dp")
    cfg = GPTConfig(block_size=16)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (STEPS, n * B, 17), generator=g)

    def fresh() -> nn.Module:
        torch.manual_seed(0)
        return GPT(cfg)
    ref = fresh()
    ropt = make_opt("sgd", ref.parameters())
    for k in range(STEPS):
        ropt.zero_grad()
        lm_loss(ref(tokens[k, :, :-1]), tokens[k, :, 1:]).backward()
        ropt.step()
    net = fresh()
    if checkpointing:
        from shardwise.parallel.common.activation_checkpointing import checkpoint_layers
        checkpoint_layers(net, every=1)
    model = DataParallel(net, m, "dp", bucket_cap_mb=0.05, first_bucket_mb=0.01)
    opt = make_opt("sgd", model.parameters())  # SGD: tight comparison (Adam turns float noise into full steps)
    buckets = []
    for k in range(STEPS):
        opt.zero_grad()
        mine = tokens[k, r * B:(r + 1) * B]
        with CommCounter() as c:
            lm_loss(model(mine[:, :-1]), mine[:, 1:]).backward()
        buckets.append(c.count("all_reduce"))
        opt.step()
    return {"err": max_err(model.module, ref), "hash": state_hash(model.module), "buckets": buckets,
            "plan": len(model.bucket_plan), "tied": model.module.lm_head.weight is model.module.wte.weight}
