"""Rank-side checks of context parallelism (run inside LocalWorld ranks by tests/dist/test_ring_attention.py).

Every rank builds the same full inputs from one seed, computes the one-device reference with
``F.scaled_dot_product_attention`` on the whole sequence, and compares its local share of the output and of
every gradient. Reported: relative errors (max |a − b| / max |b|) and the point-to-point messages and bytes
this rank sent during the forward and during the backward.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.parallel.context import SeqLayout, context_parallel, ring_attention, shard_sequence, unshard_sequence
from shardwise.parallel.context.blocks import select
from tests.dist.meshes import mesh as cached_mesh

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "hf"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-30))


def _counted(fn: Any) -> tuple[Any, dict[str, int]]:
    with sw.comm.CommCounter() as c:
        result = fn()
    return result, {"messages": c.messages_sent, "bytes": c.bytes_sent, "received": c.messages_received,
                    "sends": c.count("send"), "other": len([r for r in c.records if r.op not in ("send", "recv")])}


def _inputs(case: dict) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(case.get("seed", 0))
    b, h, hkv, s, d, dv = case["b"], case["h"], case["hkv"], case["S"], case["d"], case.get("dv", case["d"])
    dtype = getattr(torch, case.get("dtype", "float32"))  # bf16: inputs rounded to bf16, the reference in fp32
    q, k, v = (torch.randn(b, n, s, e, generator=g).to(dtype) for n, e in ((h, d), (hkv, d), (hkv, dv)))
    return q, k, v, torch.randn(b, h, s, dv, generator=g).to(dtype)


def _one_ring_case(case: dict) -> dict:
    mesh = cached_mesh(**case["axes"])
    q, k, v, grad = _inputs(case)
    causal = case["causal"]
    full = [t.to(torch.float32, copy=True).requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=True)
    ref.backward(grad.float())
    local = [shard_sequence(t, mesh, "cp", dim=2).requires_grad_() for t in (q, k, v)]
    impl = case.get("impl", "auto")
    out, fwd = _counted(lambda: ring_attention(*local, mesh, "cp", causal=causal, impl=impl))
    _, bwd = _counted(lambda: out.backward(shard_sequence(grad, mesh, "cp", dim=2)))
    res = {"out": rel(out, shard_sequence(ref, mesh, "cp", dim=2)), "fwd": fwd, "bwd": bwd,
           "unshard": rel(unshard_sequence(out, mesh, "cp", dim=2), ref), "cp": mesh.size("cp"),
           "blocks": select(impl, q, v).name}
    for name, t, f in zip("qkv", local, full):
        res["d" + name] = rel(t.grad, shard_sequence(f.grad, mesh, "cp", dim=2))
    # the same ring on a plain contiguous split (the wrong layout) must not match: the test can fail
    cp, r, s = mesh.size("cp"), mesh.coord("cp"), case["S"] // mesh.size("cp")
    plain = [t[:, :, r * s:(r + 1) * s] for t in (q, k, v)]
    wrong = ring_attention(*plain, mesh, "cp", causal=causal, impl=impl)
    res["wrong_layout"] = rel(wrong, ref[:, :, r * s:(r + 1) * s])
    return res


def check_ring(cases: list[dict]) -> list[dict]:
    """Ring attention forward and backward against the full-sequence SDPA, per case."""
    return [_one_ring_case(case) for case in cases]


def check_errors(axes: dict) -> dict:
    """Bad inputs raise one-line ValueErrors on every rank before anything is sent."""
    mesh = cached_mesh(**axes)
    q = torch.randn(1, 2, 8, 4)
    out = {}
    with sw.comm.CommCounter() as c:
        for name, fn in {
            "dropout": lambda: ring_attention(q, q, q, mesh, "cp", dropout_p=0.1),
            "odd": lambda: ring_attention(q[:, :, :7], q[:, :, :7], q[:, :, :7], mesh, "cp"),
            "heads": lambda: ring_attention(q, q[:, :1].expand(1, 3, 8, 4), q[:, :1].expand(1, 3, 8, 4), mesh, "cp"),
            "axis": lambda: ring_attention(q, q, q, mesh, "sp"),
            "shard": lambda: shard_sequence(torch.zeros(1, 6), mesh, "cp"),
        }.items():
            try:
                fn()
                out[name] = None
            except ValueError as e:
                out[name] = str(e)
    out["messages"] = c.messages_sent + len(c.records)
    return out


# -- models --------------------------------------------------------------------------------------------------

def _tiny_llama(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float()


def _model_case(kind: str, ckpt: bool) -> tuple[torch.nn.Module, Any, int, int]:
    """(model, forward(model, ids) -> logits, vocab, layers)."""
    if kind == "hf-llama":
        model = _tiny_llama(1)
        if ckpt:
            from transformers.models.llama.modeling_llama import LlamaDecoderLayer
            sw.checkpoint_layers(model, policy=lambda name, m: isinstance(m, LlamaDecoderLayer))
        return model, lambda m, ids: m(input_ids=ids).logits, 64, 2
    if kind == "gpt":
        torch.manual_seed(1)
        model = sw.models.GPT(dataclasses.replace(sw.models.GPTConfig.preset("gpt-tiny"), dropout=0.0))
        vocab, layers, blocks = model.config.vocab_size, model.config.n_layer, "blocks."
    else:
        from shardwise.models.hf_config import load_hf_config
        from shardwise.models.llama import Llama
        torch.manual_seed(1)
        model = Llama(load_hf_config(EXAMPLES / "tiny-llama.json"), block_size=32)
        vocab, layers, blocks = model.config.vocab_size, model.config.num_hidden_layers, "model.layers."
    if ckpt:  # every block: its forward recomputed during backward, through the ring again
        depth = blocks.count(".")
        sw.checkpoint_layers(model, policy=lambda name, _m: name.startswith(blocks) and name.count(".") == depth)
    return model, lambda m, ids: m(ids), vocab, layers


def check_model(axes: dict, kind: str, ckpt: bool = False, b: int = 2, S: int = 16) -> dict:
    """Logits of the local tokens and every parameter gradient (summed over cp) against one device; the
    forward's messages; the mode is gone after the forward."""
    mesh = cached_mesh(**axes)
    model, fwd, vocab, layers = _model_case(kind, ckpt)
    cp_model = context_parallel(copy.deepcopy(model), mesh, "cp")
    g = torch.Generator().manual_seed(7)
    ids, targets = torch.randint(0, vocab, (b, S), generator=g), torch.randint(0, vocab, (b, S), generator=g)
    logits = fwd(model, ids)
    F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), reduction="sum").div(b * S).backward()
    local_ids, local_t = shard_sequence(ids, mesh, "cp"), shard_sequence(targets, mesh, "cp")
    modes_before = len(torch.overrides._get_current_function_mode_stack())
    local_logits, counts = _counted(lambda: fwd(cp_model, local_ids))
    modes_after = len(torch.overrides._get_current_function_mode_stack())
    loss = F.cross_entropy(local_logits.reshape(-1, vocab), local_t.reshape(-1), reduction="sum").div(b * S)
    loss.backward()
    grads = {n: p.grad for n, p in cp_model.named_parameters()}
    worst, missing = 0.0, []
    for name, p in model.named_parameters():
        if grads.get(name) is None:
            missing.append(name)
            continue
        total = sw.comm.all_reduce(grads[name].clone(), mesh, "cp")
        worst = max(worst, rel(total, p.grad))
    return {"logits": rel(local_logits, shard_sequence(logits, mesh, "cp")), "grads": worst, "missing": missing,
            "fwd": counts, "layers": layers,
            "layouts": sum(1 for m in cp_model.modules() if getattr(m, "sequence_layout", None) is not None),
            "cp": mesh.size("cp"), "modes": (modes_before, modes_after)}


def check_model_errors(axes: dict) -> dict:
    """A model passing an explicit mask or dropout in training is refused with the fix, before any message."""
    mesh = cached_mesh(**axes)

    class Masked(torch.nn.Module):
        def __init__(self, **kw: Any) -> None:
            super().__init__()
            self.kw = kw

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(x, x, x, **self.kw)

    x = torch.randn(1, 2, 8, 4)
    out = {}
    with sw.comm.CommCounter() as c:
        bad = {"mask": {"attn_mask": torch.ones(8, 8, dtype=torch.bool)}, "dropout": {"dropout_p": 0.1}}
        for name, kw in bad.items():
            try:
                context_parallel(Masked(**kw), mesh, "cp")(x)
                out[name] = None
            except ValueError as e:
                out[name] = str(e)
    out["messages"] = c.messages_sent + len(c.records)
    out["modes"] = len(torch.overrides._get_current_function_mode_stack())
    with sw.comm.CommCounter() as c:  # outside the model: the ordinary attention, no ring
        F.scaled_dot_product_attention(x, x, x, is_causal=True)
    out["outside_messages"] = c.messages_sent
    return out


def check_hf_own_loss(axes: dict, b: int = 2, S: int = 16) -> dict:
    """A ``transformers`` model's own loss: ``labels=`` alone is refused (the model would shift inside the local
    chunks); with ``shift_labels=`` (shifted over the whole sequence, then sharded) and the global
    ``num_items_in_batch`` every parameter gradient summed over cp equals one device's ``labels=`` loss."""
    mesh = cached_mesh(**axes)
    model = _tiny_llama(2)
    cp_model = context_parallel(copy.deepcopy(model), mesh, "cp")
    ids = torch.randint(0, 64, (b, S), generator=torch.Generator().manual_seed(9))
    model(input_ids=ids, labels=ids).loss.backward()
    local_ids = shard_sequence(ids, mesh, "cp")
    try:
        cp_model(input_ids=local_ids, labels=local_ids)
        refused = None
    except ValueError as e:
        refused = str(e)
    shifted = shard_sequence(F.pad(ids, (0, 1), value=-100)[:, 1:], mesh, "cp")
    out = cp_model(input_ids=local_ids, labels=shifted, shift_labels=shifted,
                   num_items_in_batch=torch.tensor(b * (S - 1)))
    out.loss.backward()
    grads = dict(cp_model.named_parameters())
    worst = max(rel(sw.comm.all_reduce(grads[n].grad.clone(), mesh, "cp"), p.grad) for n, p in model.named_parameters())
    with torch.no_grad():  # the caller's own position_ids (and no mask): the same logits as one device
        pos = SeqLayout(mesh.size("cp"), mesh.coord("cp")).positions(S // mesh.size("cp")).expand(b, -1)
        explicit = rel(cp_model(input_ids=local_ids, position_ids=pos).logits,
                       shard_sequence(model(input_ids=ids).logits, mesh, "cp"))
    return {"refused": refused, "grads": worst, "explicit_positions": explicit}


def check_with_data_parallel(axes: dict, b: int = 4, S: int = 16) -> dict:
    """The documented recipes with ``sw.DataParallel``: over cp alone (each rank's mean loss over its tokens;
    the replicas' average is one device's gradient), and over dp of a dp×cp mesh (each replica's loss over its
    rows; gradients summed over cp by hand, averaged over dp by the wrapper). The reference GPT, one SGD step
    of the full batch's mean loss on one device."""
    mesh = cached_mesh(**axes)
    torch.manual_seed(3)
    model = sw.models.GPT(dataclasses.replace(sw.models.GPTConfig.preset("gpt-tiny"), dropout=0.0))
    vocab = model.config.vocab_size
    dp = mesh.size("dp") if "dp" in axes else 1
    wrapped = sw.DataParallel(context_parallel(copy.deepcopy(model), mesh, "cp"), mesh, axis="dp" if dp > 1 else "cp")
    g = torch.Generator().manual_seed(11)
    ids, targets = torch.randint(0, vocab, (b, S), generator=g), torch.randint(0, vocab, (b, S), generator=g)
    sw.models.lm_loss(model(ids), targets).backward()
    rows = slice(mesh.coord("dp"), None, dp) if dp > 1 else slice(None)
    local_ids, local_t = shard_sequence(ids[rows], mesh, "cp"), shard_sequence(targets[rows], mesh, "cp")
    logits = wrapped(local_ids)
    if dp > 1:  # this replica's tokens: the sum over this rank's, divided by the replica's count
        loss = F.cross_entropy(logits.reshape(-1, vocab), local_t.reshape(-1), reduction="sum")
        loss = loss / (local_t.numel() * mesh.size("cp"))
    else:
        loss = sw.models.lm_loss(logits, local_t)
    loss.backward()
    worst = 0.0
    ours = dict(wrapped.module.named_parameters())
    for name, p in model.named_parameters():
        grad = ours[name].grad
        if dp > 1:
            grad = sw.comm.all_reduce(grad.clone(), mesh, "cp")
        worst = max(worst, rel(grad, p.grad))
    return {"grads": worst}
