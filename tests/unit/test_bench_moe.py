"""``shardwise bench moe``: bad flags are one line and launch nothing; part (a) compares implementations that
compute the same block; part (b)'s transformers route is really transformers' AllToAllEP and trains the same
model to the same losses as ours and as one process (2 ranks, one LocalWorld for the file)."""

from __future__ import annotations

import argparse

import pytest
import torch

from shardwise.bench import moe
from shardwise.bench.harness import worker_argv
from shardwise.bench.moe_grouped import measure_grouped
from shardwise.bench.moe_peer import peer_available
from shardwise.testing import LocalWorld


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    moe.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("argv, message", [
    (["--experts", "8,x"], "--experts must be comma-separated ints, got '8,x'; e.g. --experts 8,16"),
    (["--part", "ep", "-n", "4", "--ep", "3"], "--ep 3 must divide both -n 4 and --n-experts 16"),
    (["--part", "ep", "--n-experts", "6"], "--ep 4 must divide both -n 4 and --n-experts 6"),
    (["--top-k", "9", "--experts", "8,16"], "--top-k 9 is above the smallest of --experts 8,16; lower it"),
    (["--variants", "sw,deepspeed"], "unknown variants ['deepspeed']; choose from ['sw', 'sw-pairwise', 'hf']"),
    (["--tokens", "0"], "--tokens must be >= 1, got 0"),
])
def test_a_bad_flag_is_one_line_and_launches_nothing(monkeypatch, capsys, argv, message):
    from shardwise.runtime import launch

    monkeypatch.setattr(launch, "run_local", lambda *a, **k: pytest.fail("launched"))
    assert moe.main(_args(argv)) == 2
    assert capsys.readouterr().err.strip() == f"shardwise bench moe: error: {message}"


def test_worker_argv_round_trips_every_flag():
    ns = _args(["--part", "ep", "--ep", "2", "-n", "2", "--variants", "sw,hf", "--moe-ffn", "64"])
    back = _args(worker_argv(ns))
    assert back.worker and back.part == "ep" and back.ep == 2 and back.variants == "sw,hf" and back.moe_ffn == 64


def test_part_a_implementations_compute_the_same_block():
    rows = measure_grouped([4, 8], tokens=64, top_k=2, hidden=32, ffn=16, warmup=0, steps=1, repeats=1)
    assert [r["experts"] for r in rows] == [4, 8]
    for r in rows:
        assert r["rows_per_expert"] == 64 * 2 / r["experts"]
        assert min(r["loop_ms"], r["loop_indexed_ms"], r["grouped_ms"]) > 0 and r["speedup"] > 0
        assert r["max_rel_diff"] < 1e-5  # outputs and every gradient, against the per-expert loop


def _steps(variant: str) -> tuple[list[float], int]:
    """Two AdamW steps of part (b)'s model as ``variant`` on this rank; the losses and, for hf, how many times
    transformers' AllToAllEP ran."""
    import shardwise as sw
    from transformers.distributed import expert_parallel

    args = _args(["--part", "ep", "-n", "2", "--layers", "2", "--embd", "32", "--n-experts", "4", "--moe-ffn", "16",
                  "--seq", "8", "--batch", "2"])
    mesh, emesh = sw.Mesh(dp=-1), sw.Mesh(edp=1, ep=2, one=1)
    calls = [0]
    original = expert_parallel.AllToAllEP.__call__

    def counted(self, *a):
        calls[0] += 1
        return original(self, *a)

    expert_parallel.AllToAllEP.__call__ = counted
    try:
        _, step = moe._build(variant, moe._config(args), mesh, emesh)
        gen = torch.Generator().manual_seed(7)
        from shardwise.models.gpt import synthetic_batch

        whole = [synthetic_batch(4, 8, 512, gen) for _ in range(2)]  # both ranks' rows; each takes its half
        rows = slice(2 * mesh.coord("dp"), 2 * mesh.coord("dp") + 2)
        losses = [step(x[rows], y[rows]) for x, y in whole]
    finally:
        expert_parallel.AllToAllEP.__call__ = original
    return losses, calls[0]


def _one_process() -> list[float]:
    """The same two steps on one process over both ranks' rows (the reference)."""
    from shardwise.models.gpt import GPT, lm_loss, synthetic_batch

    args = _args(["--layers", "2", "--embd", "32", "--n-experts", "4", "--moe-ffn", "16", "--seq", "8"])
    torch.manual_seed(0)
    net = GPT(moe._config(args))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(7)
    losses = []
    for x, y in [synthetic_batch(4, 8, 512, gen) for _ in range(2)]:
        opt.zero_grad()
        loss = lm_loss(net(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.skipif(peer_available() is not None, reason="transformers' expert parallelism is not importable")
def test_part_b_both_routes_train_like_one_process():
    with LocalWorld(2) as world:
        sw_runs = world.run(_steps, "sw", timeout=120)
        hf_runs = world.run(_steps, "hf", timeout=120)
    ref = _one_process()
    assert all(calls == 0 for _, calls in sw_runs)
    assert all(calls == 2 * 2 for _, calls in hf_runs)  # 2 MoE layers x 2 forwards, on every rank
    for (sw_losses, _), (hf_losses, _) in zip(sw_runs, hf_runs):
        assert sw_losses == pytest.approx(hf_losses, rel=1e-5)
    # each rank's loss is its half's mean; the mean over ranks is the one-process loss of the whole batch
    for step in range(2):
        for runs in (sw_runs, hf_runs):
            assert sum(r[0][step] for r in runs) / 2 == pytest.approx(ref[step], rel=1e-5)
