"""Rank-side checks of LoRA (run inside LocalWorld ranks by tests/dist/test_lora.py). The reference is ``peft``'s
LoRA on a transformers ``LlamaForCausalLM`` trained on one process with the same weights and batches; the layouts
run either the same ``PeftModel`` (peft's layers, unchanged) or our ``Llama`` with ``sw.apply_lora`` holding the
same weights (the names match: ``base_layer``, ``lora_A``/``lora_B``, peft's adapter name left out)."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

import shardwise as sw
from shardwise.comm import CommCounter
from shardwise.models.hf_config import hf_config_from_dict
from shardwise.models.llama import Llama
from shardwise.models.lora import LoRAConfig, apply_lora
from tests.dist.meshes import mesh

VOCAB, SEQ, BATCH, STEPS, LR = 64, 8, 4, 3, 0.5
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
R, ALPHA = 4, 8
HF = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, use_cache=False)
TP_PLAN = {"model.layers.*.self_attn.q_proj": sw.parallel.tensor.ColumnParallel(heads=4),
           "model.layers.*.self_attn.[kv]_proj": sw.parallel.tensor.ColumnParallel(heads=2),
           "model.layers.*.self_attn.o_proj": sw.parallel.tensor.RowParallel(),
           "model.layers.*.mlp.[gu]*_proj": sw.parallel.tensor.ColumnParallel(),
           "model.layers.*.mlp.down_proj": sw.parallel.tensor.RowParallel()}


def peft_model() -> nn.Module:
    """A transformers Llama wrapped by peft (B drawn at random, not zero, so that A's gradient is not zero)."""
    import peft
    import transformers as tf

    torch.manual_seed(0)
    base = tf.LlamaForCausalLM(tf.LlamaConfig(**HF))
    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0,
                          init_lora_weights=False)
    return peft.get_peft_model(base, cfg)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def ours_key(peft_key: str) -> str:
    """A PeftModel state-dict key → our model's (peft's prefix and adapter name dropped)."""
    return peft_key.removeprefix("base_model.model.").replace(".default.", ".")


@functools.lru_cache(maxsize=1)
def reference() -> tuple[tuple[float, ...], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(losses, final state under our keys, initial state under our keys) of peft on one process."""
    pm = peft_model()
    start = {ours_key(k): v.detach().clone() for k, v in pm.state_dict().items()}
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=LR)
    losses = []
    for ids in batches():
        loss = pm(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return tuple(losses), {ours_key(k): v.detach().clone() for k, v in pm.state_dict().items()}, start


def our_llama() -> Llama:
    """Our Llama + our LoRA holding the reference's initial weights (base and adapters)."""
    cfg = hf_config_from_dict({**HF, "model_type": "llama"})
    model = Llama(cfg, block_size=SEQ)
    apply_lora(model, LoRAConfig(r=R, alpha=ALPHA, targets=TARGETS))
    missing = model.load_state_dict(reference()[2], strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    return model


def compare(losses: list[float], full: dict[str, torch.Tensor]) -> dict:
    """Relative errors of the losses and of the adapters against peft; whether the base is bit-identical."""
    ref_losses, ref_state, start = reference()
    full = {ours_key(k): v for k, v in full.items()}
    assert sorted(full) == sorted(ref_state), sorted(set(full) ^ set(ref_state))
    adapters = [k for k in ref_state if ".lora_" in k]
    base = [k for k in ref_state if ".lora_" not in k]
    err = max(float((full[k] - ref_state[k]).abs().max() / ref_state[k].abs().max()) for k in adapters)
    moved = max(float((ref_state[k] - start[k]).abs().max()) for k in adapters)
    return {"loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)), "adapter_err": err,
            "adapters_moved": moved, "base_same": all(torch.equal(full[k], start[k]) for k in base),
            "n_adapters": len(adapters)}


def _train(model: nn.Module, opt: torch.optim.Optimizer, step) -> list[float]:
    losses = []
    for ids in batches():
        losses.append(float(step(model, ids)))
        opt.step()
        opt.zero_grad()
    return losses


def _hf_step(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach()


def _our_step(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)  # (b, t, V); labels shifted as transformers does
    loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach()


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def check_peft_tp() -> dict:
    """peft's own model under ``sw.parallelize`` (tp 2): adapters split with their base layers."""
    m = mesh(tp=2)
    pm = peft_model()
    sw.parallelize(pm.base_model.model, m, TP_PLAN, axis="tp")
    with CommCounter() as c:
        losses = _train(pm, torch.optim.SGD(_trainable(pm), lr=LR), _hf_step)
    out = compare(losses, sw.full_state_dict(pm.base_model.model))
    out["collectives"] = c.by_op()
    out["a_shape"] = tuple(pm.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.shape)
    out["b_shape"] = tuple(pm.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.shape)
    out["row_a_shape"] = tuple(pm.base_model.model.model.layers[0].self_attn.o_proj.lora_A["default"].weight.shape)
    return out


def check_peft_dp() -> dict:
    """peft's model under ``sw.DataParallel`` (dp 2): only the adapters' gradients cross the wire."""
    m = mesh(dp=2)
    pm = peft_model()
    dp = sw.DataParallel(pm, m, axis="dp")
    with CommCounter() as c:
        losses = _train(dp, torch.optim.SGD(_trainable(pm), lr=LR), _dp_hf_step(m))
    out = compare(losses, {k: v for k, v in pm.state_dict().items()})
    out["reduced_bytes"] = c.bytes("all_reduce")
    out["adapter_bytes"] = sum(p.numel() * 4 for p in _trainable(pm))
    return out


def _dp_hf_step(m: sw.Mesh):
    """A step on this dp rank's half of the batch (the model's own loss); returns the loss averaged over dp."""
    half, c0 = BATCH // 2, m.coord("dp")

    def step(model, ids):
        local = ids[c0 * half:(c0 + 1) * half]
        loss = model(input_ids=local, labels=local).loss
        loss.backward()
        return _global_mean(loss.detach(), m, "dp")
    return step


def _global_mean(x: torch.Tensor, m: sw.Mesh, axis: str) -> torch.Tensor:
    y = x.clone()
    torch.distributed.all_reduce(y, group=m.group(axis))
    return y / m.size(axis)


def check_peft_zero3() -> dict:
    """peft's model under ZeRO-3 (dp 2): the frozen base sharded with no gradient shard."""
    m = mesh(dp=2)
    pm = peft_model()
    zm, opt = sw.zero(pm, m, stage=3, optimizer=functools.partial(torch.optim.SGD, lr=LR),
                      units=[[f"base_model.model.model.layers.{i}"] for i in range(2)])
    losses = _train(zm, opt, _dp_hf_step(m))
    return compare(losses, sw.full_state_dict(zm))


def check_ours_layouts(layout: str) -> dict:
    """Our Llama + our LoRA in ``layout``: ``pp2`` (1f1b), ``tp2``, ``tp2dp2`` (4 ranks)."""
    model = our_llama()
    if layout == "tp2":
        m = mesh(tp=2)
        sw.parallelize(model, m, model.tensor_parallel_plan(), axis="tp")
        from shardwise.parallel.tensor.apply_plan import vocab_parallel_cross_entropy

        def step(mod, ids):
            logits = mod(ids)
            loss = vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:], mesh=m, axis="tp", vocab_size=VOCAB)
            loss.backward()
            return loss.detach()
        losses = _train(model, torch.optim.SGD(_trainable(model), lr=LR), step)
        return compare(losses, sw.full_state_dict(model))
    if layout == "pp2":
        m = mesh(pp=2)

        def loss_fn(logits, ids):
            return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        pipe = sw.pipeline(model, m, "pp", microbatches=2, schedule="1f1b", loss_fn=loss_fn)
        opt = torch.optim.SGD(_trainable(pipe), lr=LR)
        losses = []
        for ids in batches():
            losses.append(float(pipe.step(ids, ids)))
            opt.step()
            opt.zero_grad()
        return compare(losses, sw.full_state_dict(pipe))
    raise ValueError(layout)


def check_peft_pp() -> dict:
    """peft's model as a graph pipeline (pp 2, 1f1b): the captured graph carries peft's layers unchanged."""
    m = mesh(pp=2)
    pm = peft_model()
    example = {"input_ids": torch.zeros(BATCH // 2, SEQ, dtype=torch.long)}
    example["labels"] = example["input_ids"]
    pipe = sw.pipeline(pm.base_model.model, m, "pp", microbatches=2, schedule="1f1b", example_inputs=example)
    opt = torch.optim.SGD(_trainable(pipe), lr=LR)
    losses = []
    for ids in batches():
        losses.append(float(pipe.step(input_ids=ids, labels=ids)))
        opt.step()
        opt.zero_grad()
    return compare(losses, sw.full_state_dict(pipe))


def check_tp2dp2() -> dict:
    """Our Llama + LoRA, tp 2 inside dp 2 (4 ranks): adapters split over tp, averaged over dp."""
    from shardwise.parallel.tensor.apply_plan import vocab_parallel_cross_entropy

    m = mesh(dp=2, tp=2)
    model = our_llama()
    sw.parallelize(model, m, model.tensor_parallel_plan(), axis="tp")
    dp = sw.DataParallel(model, m, axis="dp")
    half, c0 = BATCH // 2, m.coord("dp")

    def step(mod, ids):
        local = ids[c0 * half:(c0 + 1) * half]
        logits = mod(local)
        loss = vocab_parallel_cross_entropy(logits[:, :-1], local[:, 1:], mesh=m, axis="tp", vocab_size=VOCAB)
        loss.backward()
        return _global_mean(loss.detach(), m, "dp")
    with CommCounter() as c:
        losses = _train(dp, torch.optim.SGD(_trainable(model), lr=LR), step)
    out = compare(losses, sw.full_state_dict(model))
    out["dp_bytes"] = c.bytes("all_reduce", axis="dp")
    out["adapter_bytes"] = sum(p.numel() * 4 for p in _trainable(model))
    return out


def _gpt_lora() -> nn.Module:
    """The reference GPT (fused q/k/v: QKVParallel) with LoRA on qkv, proj and fc; B drawn so A trains too."""
    from shardwise.models.gpt import GPT, GPTConfig

    torch.manual_seed(3)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32, tie_weights=True))
    apply_lora(model, LoRAConfig(r=R, alpha=ALPHA, targets=("qkv", "proj", "fc"), seed=5))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return model


def check_gpt_tp(sequence_parallel: bool) -> dict:
    """Our GPT + LoRA under tp 2 (its own plan: fused qkv split by heads, B's rows with them), optionally with
    sequence parallelism, against the same model on one process (SGD)."""
    from shardwise.models.gpt import lm_loss, synthetic_batch
    from shardwise.parallel.tensor.apply_plan import vocab_parallel_cross_entropy

    gen = torch.Generator().manual_seed(9)
    data = [synthetic_batch(BATCH, SEQ, VOCAB, gen) for _ in range(STEPS)]
    ref = _gpt_lora()
    start = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    ref_losses = _train(ref, torch.optim.SGD(_trainable(ref), lr=LR), _pairs_step(data, lm_loss))
    m = mesh(tp=2)
    model = _gpt_lora()
    sw.parallelize(model, m, model.config.tensor_parallel_plan(sequence_parallel), axis="tp",
                   sequence_parallel=sequence_parallel)
    loss_fn = functools.partial(vocab_parallel_cross_entropy, mesh=m, axis="tp", vocab_size=VOCAB)
    losses = _train(model, torch.optim.SGD(_trainable(model), lr=LR), _pairs_step(data, loss_fn))
    full, want = sw.full_state_dict(model), ref.state_dict()
    adapters = [k for k in want if ".lora_" in k]
    return {"loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "adapter_err": max(float((full[k] - want[k]).abs().max() / want[k].abs().max()) for k in adapters),
            "adapters_moved": max(float((want[k] - start[k]).abs().max()) for k in adapters),
            "base_same": all(torch.equal(full[k], start[k]) for k in want if ".lora_" not in k),
            "n_adapters": len(adapters)}


def _pairs_step(data, loss_fn):
    it = iter(data)

    def step(model, _ids):
        x, y = next(it)
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss.detach()
    return step


def check_peft_auto() -> dict:
    """``sw.auto`` on peft's model (tp 2): the plan it picks keeps each adapter with its base layer."""
    m = mesh(tp=2)
    pm = peft_model()
    ids = batches()[0]
    pins = {"*.mlp.gate_proj.base_layer": "column", "*.mlp.up_proj.base_layer": "column",
            "*.mlp.down_proj.base_layer": "row"}  # a model this small is cheapest replicated: make it split
    plan = sw.auto(pm.base_model.model, m, example_inputs={"input_ids": ids, "labels": ids}, pins=pins)
    sw.parallelize(pm.base_model.model, m, plan)
    losses = _train(pm, torch.optim.SGD(_trainable(pm), lr=LR), _hf_step)
    out = compare(losses, sw.full_state_dict(pm.base_model.model))
    out["split"] = sorted(dict(plan))
    out["b_shape"] = tuple(pm.base_model.model.model.layers[0].mlp.up_proj.lora_B["default"].weight.shape)
    return out
