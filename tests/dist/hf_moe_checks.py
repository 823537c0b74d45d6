"""Rank-side checks of ``sw.ExpertParallel`` (run by tests/dist/test_hf_moe.py): the experts of transformers 5's
mixtures of experts (Mixtral, Qwen2-MoE) and of our Llama-family MoE split over an axis whose ranks hold the
same tokens, against the same model trained on one device in the same process (same seed, same batches, fp32,
AdamW): losses, every gradient of the first step and every parameter after the steps (gathered through
``full_state_dict``); the collectives counted. Also a meta-built model from a Hub directory (each rank reads its
experts only) saved as a checkpoint and exported back."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

import shardwise as sw
from shardwise.comm import CommCounter
from shardwise.models.gpt import lm_loss
from shardwise.models.hf_config import hf_config_from_dict, load_hf_config
from shardwise.models.llama import Llama
from shardwise.parallel.tensor.apply_plan import full_tensor, vocab_parallel_cross_entropy
from tests.dist.meshes import mesh

STEPS, B, T = 2, 4, 16
PLAN = {"model.layers.*.mlp.experts": sw.ExpertParallel()}
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_experts_per_tok=2)
KINDS = {"mixtral": dict(num_local_experts=4),
         "qwen2_moe": dict(num_experts=8, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                           norm_topk_prob=False)}


def hf_model(kind: str):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(kind, **TINY, **KINDS[kind], router_aux_loss_coef=0.05)
    return transformers.AutoModelForCausalLM.from_config(cfg).train()


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, TINY["vocab_size"], (B, T + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _train(model: torch.nn.Module, loss_fn) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """AdamW steps: the losses, the first step's full gradients (None → zeros: an expert no token chose), the
    final full state. Collective when ``model`` is split."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    losses, grads = [], {}
    for s in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(model, *_data(s))
        loss.backward()
        if s == 0:
            grads = {n: full_tensor(p, p.grad if p.grad is not None else torch.zeros_like(p))
                     for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return losses, grads, sw.full_state_dict(model)


def _same(got: tuple, want: tuple) -> None:
    """Losses and first-step gradients at rtol 1e-5; parameters after the AdamW steps at rtol 1e-5 with atol
    2e-6 (params ~0.02, steps ~1e-2): AdamW divides each gradient by its own size, so where a gradient is
    tiny (a rare token's embedding row) its last-bit differences of summation order become 1e-4 of a step."""
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), rtol=1e-5, atol=0)
    for i, what, atol in ((1, "gradient", 1e-7), (2, "parameter", 2e-6)):
        assert set(got[i]) == set(want[i]), sorted(set(got[i]) ^ set(want[i]))
        for k, v in want[i].items():
            torch.testing.assert_close(got[i][k], v, rtol=1e-5, atol=atol, msg=lambda s, k=k: f"{what} {k}: {s}")


def _hf_loss(model, x, y):
    return model(input_ids=x, labels=y, output_router_logits=True).loss  # cross-entropy + coef · aux loss


def check_hf_expert_parallel(kind: str, size: int) -> dict[str, dict[str, int]]:
    """transformers' model, its experts split over ``tp`` (``size`` ranks): the model's own loss (aux loss
    included), gradients and parameters equal one device's. Returns the collectives of one forward and one
    backward."""
    m = mesh(tp=size)
    model = hf_model(kind)
    want = _train(copy.deepcopy(model), _hf_loss)
    sw.parallelize(model, m, PLAN, axis="tp")
    experts = model.model.layers[0].mlp.experts
    n = KINDS[kind].get("num_local_experts", KINDS[kind].get("num_experts"))
    assert experts.gate_up_proj.shape[0] == n // size, experts.gate_up_proj.shape
    got = _train(model, _hf_loss)
    _same(got, want)
    return _counted(model, _hf_loss)


def _counted(model, loss_fn) -> dict[str, dict[str, int]]:
    x, y = _data(0)
    with CommCounter() as fwd:
        loss = loss_fn(model, x, y)
    with CommCounter() as bwd:
        loss.backward()
    return {"forward": fwd.by_op(), "backward": bwd.by_op()}


def _llama(kind: str) -> Llama:
    cfg = hf_model(kind).config.to_dict()
    torch.manual_seed(1)
    return Llama(hf_config_from_dict(cfg), T).train()


def _ours_loss(model, x, y):
    return lm_loss(model(x), y)


def check_ours_expert_parallel(kind: str, size: int) -> dict[str, dict[str, int]]:
    """Our Llama-family MoE (its balancing loss on), only the experts split: as one device."""
    m = mesh(tp=size)
    model = _llama(kind)
    want = _train(copy.deepcopy(model), _ours_loss)
    sw.parallelize(model, m, PLAN, axis="tp")
    assert model.model.layers[1].mlp.shard.replicated
    got = _train(model, _ours_loss)
    _same(got, want)
    return _counted(model, _ours_loss)


def check_llama_tp_plan(kind: str, size: int) -> None:
    """The model's own tensor-parallel plan (attention and dense parts Megatron-split, vocabulary-parallel head,
    ExpertParallel experts, column/row shared expert) equals one device."""
    m = mesh(tp=size)
    model = _llama(kind)
    want = _train(copy.deepcopy(model), _ours_loss)
    sw.parallelize(model, m, model.tensor_parallel_plan(), axis="tp")

    def loss_fn(model, x, y):
        return vocab_parallel_cross_entropy(model(x), y, mesh=m, axis="tp", vocab_size=TINY["vocab_size"])

    _same(_train(model, loss_fn), want)


def check_meta_from_hub(directory: str, size: int, out: str) -> int:
    """A meta-built Llama from a Hub directory, its experts split over ``tp``: each rank reads only its experts'
    bytes, logits equal transformers' from the same directory; its checkpoint (saved on every rank) exports to a
    directory that transformers loads with the same logits. Returns the bytes this rank read."""
    import transformers

    from shardwise.checkpoint.hf_dir import attach_pretrained, hf_export, write_hf_dir
    from shardwise.checkpoint.layout import model_pieces
    from shardwise.checkpoint.sharded import Checkpoint, save_checkpoint

    m = mesh(tp=size)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.device("meta"):
        model = Llama(load_hf_config(Path(directory) / "config.json"), T)
    pretrained = attach_pretrained(model, directory, arch=hf.config.model_type)
    sw.parallelize(model, m, PLAN, axis="tp")
    sw.materialize(model, m)
    x, _ = _data(0)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), hf(x).logits, rtol=1e-5, atol=1e-6)
    root = Path(out) / "ckpt"
    save_checkpoint(root, 1, model_pieces(model, m), mesh=m, state={"hf_config": model.config.hf_dict()},
                    rank_state={})
    if m.rank == 0:
        config, tensors = hf_export(Checkpoint(root / "step_000001"))
        write_hf_dir(tensors, config, Path(out) / "export")
        again = transformers.AutoModelForCausalLM.from_pretrained(Path(out) / "export", dtype=torch.float32).eval()
        with torch.no_grad():
            torch.testing.assert_close(again(x).logits, hf(x).logits, rtol=1e-5, atol=1e-6)
    return pretrained.bytes_read


def check_auto_plan(kind: str, size: int) -> None:
    """``sw.auto`` with the experts pinned to ``"experts"``: its plan (whatever it chose for the rest) runs
    through ``sw.parallelize`` and trains as one device."""
    m = mesh(tp=size)
    model = hf_model(kind)
    want = _train(copy.deepcopy(model), _hf_loss)
    plan = sw.auto(model, m, (_data(0)[0],), pins={"model.layers.*.mlp.experts": "experts"})
    assert plan["model.layers.*.mlp.experts"] == sw.ExpertParallel()
    sw.parallelize(model, m, plan)
    _same(_train(model, _hf_loss), want)
