"""Context parallelism without processes: the balanced sequence layout (positions, shard/unshard order, the
causal balance it buys), the ring's block selection, ring attention on a one-rank ring against SDPA, and the
wrapper's routing, positions and error messages (a stand-in mesh: only ``axes``, ``size``, ``coord`` are read)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.parallel.context import SeqLayout, context_parallel, ring_attention, shard_sequence
from shardwise.parallel.context.layout import chunk_order, reorder_gathered
from shardwise.parallel.context.ring import block_pairs


@dataclass
class FakeMesh:
    cp: int
    rank: int
    axes: tuple = ("cp",)

    def size(self, axis: str) -> int:
        return self.cp

    def coord(self, axis: str) -> int:
        return self.rank


def test_positions_are_chunk_i_then_its_mirror():
    assert SeqLayout(2, 0).positions(4).tolist() == [0, 1, 6, 7]
    assert SeqLayout(2, 1).positions(4).tolist() == [2, 3, 4, 5]
    assert SeqLayout(3, 1).positions(2).tolist() == [1, 4]
    assert SeqLayout(1, 0).positions(6).tolist() == list(range(6))
    assert chunk_order(3) == [0, 5, 1, 4, 2, 3]
    for cp in (1, 2, 3, 4):
        every = torch.cat([SeqLayout(cp, r).positions(6) for r in range(cp)])
        assert sorted(every.tolist()) == list(range(6 * cp))  # a permutation of the sequence


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_matches_positions_and_unshard_order_inverts_it(cp):
    S = 4 * cp
    t = torch.arange(2 * S * 3).view(2, S, 3)
    pieces = [shard_sequence(t, FakeMesh(cp, r), "cp", dim=1) for r in range(cp)]
    for r, piece in enumerate(pieces):
        assert piece.is_contiguous() and piece.shape == (2, S // cp, 3)
        assert torch.equal(piece, t[:, SeqLayout(cp, r).positions(S // cp)])
    assert torch.equal(reorder_gathered(torch.cat(pieces, dim=1), cp, dim=1), t)
    x = torch.randn(2, 3, S, 5)  # the attention layout: sequence along dim 2 (or -2)
    assert torch.equal(shard_sequence(x, FakeMesh(cp, cp - 1), dim=2), shard_sequence(x, FakeMesh(cp, cp - 1), dim=-2))


def test_the_layout_balances_causal_work_and_a_plain_split_does_not():
    cp, S = 4, 32
    work = [int((SeqLayout(cp, r).positions(S // cp) + 1).sum()) for r in range(cp)]  # keys each rank's queries see
    assert len(set(work)) == 1
    plain = [sum(range(r * S // cp + 1, (r + 1) * S // cp + 1)) for r in range(cp)]
    assert len(set(plain)) == cp
    # the ring computes, over its cp steps, exactly the chunk pairs (a, c) with c <= a, the same count per rank
    for r in range(cp):
        seen = set()
        for src in range(cp):
            for rows, cols, diag in block_pairs(r, src, cp, 4, causal=True):
                a = (r, 2 * cp - 1 - r)[rows.start // 2]
                c = (src, 2 * cp - 1 - src)[cols.start // 2]
                assert c <= a and diag == (c == a) and (a, c) not in seen
                seen.add((a, c))
        assert len(seen) == 2 * cp + 1  # (r + 1) + (2cp − r) blocks on every rank
        assert seen == {(a, c) for a in (r, 2 * cp - 1 - r) for c in range(2 * cp) if c <= a}
    assert block_pairs(1, 0, cp, 4, causal=False) == [(slice(0, 4), slice(0, 4), False)]


def test_layout_errors_are_one_line_with_the_fix():
    with pytest.raises(ValueError, match=r"^sequence length S=10 must be divisible by 2·cp=4; choose a block size "
                                         r"that is a multiple of 4$"):
        shard_sequence(torch.zeros(1, 10), FakeMesh(2, 0))
    with pytest.raises(ValueError, match="two equal chunks, but the local sequence has 5 tokens"):
        SeqLayout(2, 0).positions(5)
    with pytest.raises(ValueError, match="0 <= rank < cp"):
        SeqLayout(2, 2)


@pytest.mark.parametrize("impl", ["math", "flash"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hkv,dv", [(4, 6), (2, 6), (1, 5)])
def test_one_rank_ring_equals_sdpa(impl, causal, hkv, dv):
    if impl == "flash" and dv != 6:
        with pytest.raises(ValueError, match="impl='flash' needs CPU tensors with equal query and value head dims"):
            ring_attention(*(torch.randn(1, 2, 4, d) for d in (6, 6, dv)), FakeMesh(1, 0), impl=impl)
        return
    g = torch.Generator().manual_seed(hkv)
    q = torch.randn(2, 4, 8, 6, dtype=torch.float64, generator=g).requires_grad_()
    k = torch.randn(2, hkv, 8, 6, dtype=torch.float64, generator=g).requires_grad_()
    v = torch.randn(2, hkv, 8, dv, dtype=torch.float64, generator=g).requires_grad_()
    grad = torch.randn(2, 4, 8, dv, dtype=torch.float64, generator=g)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, scale=0.3)
    out = ring_attention(q, k, v, FakeMesh(1, 0), causal=causal, scale=0.3, impl=impl)
    assert torch.allclose(out, ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("impl", ["math", "flash"])
def test_under_autocast_the_ring_takes_the_autocast_dtype_like_sdpa(impl):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 8, 6, generator=g).requires_grad_() for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = ring_attention(q, k, v, FakeMesh(1, 0), impl=impl)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and q.grad.abs().sum() > 0


@pytest.mark.parametrize("diag", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_blocks_equal_math_blocks(diag, dtype):
    """The block's share of the gradients, given the whole row's output and log-sum-exp (not the block's own)."""
    from shardwise.parallel.context.blocks import FlashBlocks, MathBlocks

    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(2, 3, 6, 8, generator=g).to(dtype) for _ in range(4))
    out, lse = MathBlocks.forward(q, k, v, 0.4, diag)
    fout, flse = FlashBlocks.forward(q, k, v, 0.4, diag)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert torch.allclose(fout, out, **tol) and torch.allclose(flse, lse, **tol)
    out, lse = out.to(dtype), lse + 0.5  # rows whose other blocks hold more mass: a shifted log-sum-exp
    delta = (do.float() * out.float()).sum(-1)
    for a, b in zip(FlashBlocks.backward(do, q, k, v, out, lse, delta, 0.4, diag),
                    MathBlocks.backward(do, q, k, v, out, lse, delta, 0.4, diag)):
        assert torch.allclose(a.float(), b, **tol)


class Attn(nn.Module):
    sequence_layout = None

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, p: float = 0.0) -> torch.Tensor:
        self.depth = len(torch.overrides._get_current_function_mode_stack())
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask, dropout_p=p, is_causal=mask is None)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attn()

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None, **kw) -> torch.Tensor:
        self.position_ids = position_ids
        return self.attn(x, **kw)


def test_wrapper_routes_sets_layouts_and_positions_and_refuses_what_it_cannot_run():
    model = context_parallel(Outer(), FakeMesh(2, 1))  # a cp of 2 seen from rank 1; one-rank ring not needed here
    assert model.attn.sequence_layout == SeqLayout(2, 1) and Attn.sequence_layout is None
    x = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"attn_mask of shape \(8, 8\)"):
        model(x, mask=torch.ones(8, 8, dtype=torch.bool))
    assert torch.overrides._get_current_function_mode_stack() == []  # left after the exception
    with pytest.raises(ValueError, match=r"dropout_p=0.1 .*set dropout 0 with context parallelism"):
        model(x, p=0.1)
    with pytest.raises(ValueError, match="already applied"):
        context_parallel(model, FakeMesh(2, 1))
    with pytest.raises(ValueError, match="axis 'sp' is not an axis"):
        context_parallel(Outer(), FakeMesh(2, 1), axis="sp")
    one = context_parallel(Outer(), FakeMesh(1, 0))
    out = one(x)  # cp=1: the ring runs locally, through the mode entered once for the nested modules
    assert one.attn.depth == 1 and torch.overrides._get_current_function_mode_stack() == []
    assert torch.allclose(out, F.scaled_dot_product_attention(x, x, x, is_causal=True), atol=1e-6)
    assert one.position_ids.tolist() == [list(range(2))]  # tokens from args[0]: x.shape[1] == 2 "positions"
    given = torch.tensor([[5, 6]])
    one(x, position_ids=given)
    assert one.position_ids is given
