"""Rank-side checks for sw.pipeline (run by tests/dist/test_pipeline.py through LocalWorld).

Reference: the same GPT (same seed) trained on one device with plain SGD on the whole batch; every rank
computes it locally (tiny model), so parity is asserted against numbers the pipeline code never touched.
"""

from __future__ import annotations

import torch

import shardwise as sw
from shardwise.models.gpt import GPT, GPTConfig, lm_loss, synthetic_batch
from shardwise.parallel.pipeline.communication import lower_communication
from tests.dist.meshes import mesh

LR, STEPS, BATCH, SEQ = 0.5, 3, 12, 8


def _model(n_layer: int, tie: bool, kind: str = "gpt") -> torch.nn.Module:
    torch.manual_seed(1234)
    if kind == "mlp-shared":  # the same Linear twice (units "2" and "4"): a weight used in two places
        shared = torch.nn.Linear(16, 16)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), shared, torch.nn.Tanh(), shared,
                                   torch.nn.Tanh(), torch.nn.Linear(16, 4))
    if kind == "mlp":  # an nn.Sequential: one unit per child
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                   torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return GPT(GPTConfig(n_layer=n_layer, n_embd=32, n_head=2, vocab_size=64, block_size=16, tie_weights=tie))


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def _batches(kind: str = "gpt") -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    if kind.startswith("mlp"):
        return [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)) for _ in range(STEPS)]
    return [synthetic_batch(BATCH, SEQ, 64, generator=g) for _ in range(STEPS)]


def _pieces(case: dict, idx: torch.Tensor, tgt: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of one optimizer step: ``accum`` equal parts whose gradients add up."""
    k = case.get("accum", 1)
    return list(zip(idx.chunk(k), tgt.chunk(k)))


def _reference(case: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    kind = case.get("model", "gpt")
    model = _model(case["n_layer"], case.get("tie", True), kind)
    loss_fn = _mse if kind.startswith("mlp") else lm_loss
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for idx, tgt in _batches(kind):
        for x, y in _pieces(case, idx, tgt):
            loss = loss_fn(model(x), y)
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _run_case(case: dict) -> dict:
    m = mesh(pp=-1, dp=case["dp"]) if "dp" in case else mesh(pp=-1)
    p = m.size("pp")
    kind = case.get("model", "gpt")
    model = _model(case["n_layer"], case.get("tie", True), kind)
    pipe = sw.pipeline(model, m, "pp", microbatches=case["m"], schedule=case["schedule"],
                       loss_fn=_mse if kind.startswith("mlp") else lm_loss, split=case.get("split"),
                       chunks=case.get("chunks", 1), dp_axis="dp" if "dp" in case else None,
                       recv_ahead=case.get("ahead"), recv_before_send=False if case.get("late") else None)
    if "ahead" not in case:  # CPU defaults: one action ahead, and before the send
        assert (pipe.recv_ahead, pipe.recv_before_send) == (1, True)
        assert pipe.actions == lower_communication(pipe.schedule).ranks[m.coord("pp")]
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    losses, sends, dp_reduces = [], [], []
    for idx, tgt in _batches(kind):
        for x, y in _pieces(case, idx, tgt):
            with sw.comm.CommCounter() as c:
                losses.append(pipe.step(x, y))
            sends.append(c.count("send"))
            dp_reduces.append(c.count("all_reduce", axis="dp"))
        opt.step()
        opt.zero_grad()
    with sw.comm.CommCounter() as c:
        full = sw.full_state_dict(pipe)
    ref_losses, ref_state = _reference(case)
    whole = _model(case["n_layer"], case.get("tie", True), kind)  # a fresh, unreleased copy
    # what this rank still stores: its stages' tensors only (others were released at construction)
    kept = {id(t): t.numel() for t in (*model.parameters(), *model.buffers()) if t.numel() > 0}
    mine = {id(t): t.numel() for st in pipe.stages.values() for t in (*st.parameters(), *st.buffers())}
    return {
        "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "param_err": max(_rel_err(full[k], v) for k, v in ref_state.items()),
        "keys_ok": sorted(full) == sorted(ref_state),
        "sends": sends,
        "dp_reduces": dp_reduces,
        "stages": {s: names for s, names in pipe.stage_names().items()},
        "my_stages": sorted(pipe.stages),
        "tied_peers": [peer for _, peer in pipe.tied],
        "tied_values": [q.detach().clone() for q, _ in pipe.tied],
        "coord": m.coord("pp"),
        "p": p,
        "state_dict_sends": c.count("send"),
        "peak_held": pipe.last_peak_held,
        "kept_numel": sum(kept.values()),
        "stage_numel": sum(mine.values()),
        "model_numel": sum({id(t): t.numel() for t in (*whole.parameters(), *whole.buffers())}.values()),
    }


def check_parity(cases: list[dict]) -> list[dict]:
    """Train every case for STEPS steps; per case the errors against one device and the send counts."""
    return [_run_case(case) for case in cases]


_BAD = {
    "split_unknown": dict(split=["blocks.9"]),
    "split_inner": dict(split=["lm_head"]),
    "split_empty": dict(split=["blocks.1", "blocks.1"]),
    "split_count": dict(split=["blocks.1", "blocks.2"]),
    "split_order": dict(split=["blocks.2", "blocks.1", "ln_f"]),
    "too_few_units": dict(n_layer=1, chunks=4, schedule="interleaved", m=8),
    "interleaved_m": dict(schedule="interleaved", chunks=2, m=3),
    "microbatches_zero": dict(m=0),
    "schedule_unknown": dict(schedule="zb-v"),
    "dp_axis_is_pp": dict(dp_axis="pp"),
    "recv_ahead_negative": dict(recv_ahead=-1),
}


def check_bad_input(names: list[str]) -> dict[str, str]:
    """Each bad configuration raises ValueError before any message; returns name -> message ('' if none)."""
    m = mesh(pp=-1)
    out: dict[str, str] = {}
    for name in names:
        kw = {"n_layer": 4, "m": 4, "schedule": "1f1b", "chunks": 1, **_BAD.get(name, {})}
        model = _model(kw.pop("n_layer"), True)
        with sw.comm.CommCounter() as c:
            try:
                pipe = sw.pipeline(model, m, "pp", microbatches=kw["m"], schedule=kw["schedule"], loss_fn=lm_loss,
                                   split=kw.get("split"), chunks=kw["chunks"], dp_axis=kw.get("dp_axis"),
                                   recv_ahead=kw.get("recv_ahead"))
                if name == "batch_not_divisible":
                    idx, tgt = synthetic_batch(10, SEQ, 64)  # 10 % 4 != 0
                    pipe.step(idx, tgt)
                out[name] = ""
            except ValueError as e:
                out[name] = str(e)
                if name != "batch_not_divisible":  # that one is refused by step(), after the cut
                    # refused before the model was cut: no stage's tensors were released
                    assert all(t.numel() > 0 for t in model.parameters()), name
        assert not c.records and c.messages_sent == 0, (name, c.records)
    return out


def check_timeline(schedule: str, m_count: int, path: str) -> list[tuple[int, str, float, float]]:
    """Two steps of a 4-layer GPT; the second step's measured timeline (a trace file written to ``path``)."""
    m = mesh(pp=-1)
    pipe = sw.pipeline(_model(4, True), m, "pp", microbatches=m_count, schedule=schedule, loss_fn=lm_loss)
    for idx, tgt in _batches()[:2]:
        pipe.step(idx, tgt)
        pipe.zero_grad()
    return [(e.rank, str(e.action), e.start, e.end) for e in pipe.write_trace(path)]


def check_transport_parity(cases: list[dict]) -> list[dict]:
    """Per case: train STEPS steps with ``transport="shm"``, ``"native"`` and ``"auto"`` from the same weights
    and data; whether losses and final parameters are bit-identical to native's, the transport each used, and
    per step its sends recorded as (shm, native); the tied embedding/head exchange stays native."""
    out = []
    for case in cases:
        m = mesh(pp=-1, dp=case["dp"]) if "dp" in case else mesh(pp=-1)
        runs = {}
        for transport in ("shm", "native", "auto"):
            pipe = sw.pipeline(_model(case["n_layer"], True), m, "pp", microbatches=case["m"],
                               schedule=case["schedule"], loss_fn=lm_loss, chunks=case.get("chunks", 1),
                               dp_axis="dp" if "dp" in case else None, transport=transport)
            opt = torch.optim.SGD(pipe.parameters(), lr=LR)
            losses, sends = [], []
            for idx, tgt in _batches():
                with sw.comm.CommCounter() as c:
                    losses.append(pipe.step(idx, tgt))
                sends.append((c.count("send", algorithm="shm"), c.count("send", algorithm="native")))
                opt.step()
                opt.zero_grad()
            runs[transport] = (losses, sw.full_state_dict(pipe), pipe.used_transport, sends, len(pipe.tied))
        ref_losses, ref_state = runs["native"][:2]
        out.append({
            "resolved": [runs[t][2] for t in ("shm", "native", "auto")],
            "sends": [runs[t][3] for t in ("shm", "native", "auto")],
            "tied": runs["native"][4],
            "losses_equal": all(runs[t][0] == ref_losses for t in ("shm", "auto")),
            "params_equal": all(torch.equal(runs[t][1][k], v) for t in ("shm", "auto") for k, v in ref_state.items()),
        })
    return out


def check_transport_hosts() -> dict[str, str]:
    """Every rank claims its own host: ``transport="shm"`` is refused at the first step (``ValueError``, no
    message sent), ``"auto"`` falls back to native and trains; a fresh mesh (the host check is cached on it)."""
    from shardwise.comm import shm_rendezvous

    m = sw.Mesh(pp=-1)
    real = shm_rendezvous.host_identity
    shm_rendezvous.host_identity = lambda: f"fake-host-{m.rank}/boot"
    out: dict[str, str] = {}
    try:
        idx, tgt = _batches()[0]
        for transport in ("shm", "auto"):
            pipe = sw.pipeline(_model(2, True), m, "pp", microbatches=2, schedule="1f1b", loss_fn=lm_loss,
                               transport=transport)
            with sw.comm.CommCounter() as c:
                try:
                    loss = pipe.step(idx, tgt)
                    out[transport] = f"ran {pipe.used_transport} loss {loss:.4f}"
                except ValueError as exc:
                    out[transport] = str(exc)
            out[transport + "_sends"] = str(c.count("send"))
        try:
            sw.pipeline(_model(2, True), m, "pp", microbatches=2, loss_fn=lm_loss, transport="tcp")
            out["tcp"] = ""
        except ValueError as exc:
            out["tcp"] = str(exc)
    finally:
        shm_rendezvous.host_identity = real
    return out
