"""Rank-side checks for graph pipelines: ``sw.pipeline(model, mesh, example_inputs=...)`` on third-party
decoders (Hugging Face ``transformers`` Llama and Qwen2 built from a small config, no download; ``cache=True``
leaves ``use_cache`` at its default, True, so every forward makes a ``DynamicCache`` that its layers fill) and
on a model of our own with keyword inputs and a dataclass output.

Reference: the same model (same seed) trained on one device with plain SGD on the whole batch, computed on
every rank, so parity is asserted against numbers the pipeline code never touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import shardwise as sw
from tests.dist.meshes import mesh

LR, STEPS, BATCH, SEQ, VOCAB = 0.5, 2, 8, 12, 96


@dataclass
class Out:
    loss: torch.Tensor | None
    logits: torch.Tensor


class Toy(nn.Module):
    """Not a chain: keyword inputs, a mask and position ids computed once and used by every layer, a skip
    connection from the embedding to the head, a dataclass output with the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.pos = nn.Embedding(SEQ, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, scale: float = 1.0) -> Out:
        h0 = self.embed(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        mask = (input_ids % 5 != 0).unsqueeze(-1).to(h0.dtype)
        h = h0 + self.pos(positions)
        for layer in self.layers:
            h = h + torch.tanh(layer(h)) * mask * scale
        logits = self.head(self.norm(h) + h0)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        return Out(loss, logits)


def _model(kind: str, cache: bool = False) -> nn.Module:
    torch.manual_seed(4321)
    if kind == "toy":
        return Toy()
    import transformers as tf
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  **({} if cache else {"use_cache": False}))
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common, tie_word_embeddings=False))
    if kind == "qwen2":  # q/k/v biases, embedding tied to the head (one Parameter on the first and last stage)
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=True))
    raise ValueError(kind)


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def _reference(kind: str, cache: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model(kind, cache)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for ids in _batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _logits_loss(out: Out, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), targets.reshape(-1))


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _pipe(case: dict) -> tuple[sw.Mesh, nn.Module, object]:
    axes = dict(pp=2, **{k: case[k] for k in ("dp", "tp") if k in case})
    m = mesh(**axes) if len(axes) > 1 else mesh(pp=-1)
    model = _model(case["model"], case.get("cache", False))
    if "tp" in case:  # Megatron pairs inside each decoder layer; the head stays whole (the model's own loss)
        plan = {"model.layers.*.self_attn.q_proj": sw.parallel.tensor.ColumnParallel(heads=4),
                "model.layers.*.self_attn.[kv]_proj": sw.parallel.tensor.ColumnParallel(heads=2),
                "model.layers.*.self_attn.o_proj": sw.parallel.tensor.RowParallel(),
                "model.layers.*.mlp.[gu]*_proj": sw.parallel.tensor.ColumnParallel(),
                "model.layers.*.mlp.down_proj": sw.parallel.tensor.RowParallel()}
        sw.parallelize(model, m, plan, axis="tp")
    rows = BATCH // case["m"] // case.get("dp", 1)
    example = {"input_ids": torch.zeros(rows, SEQ, dtype=torch.long)}
    example["labels"] = example["input_ids"]
    loss_fn = _logits_loss if case.get("loss_fn") else None
    if loss_fn is not None:
        example.pop("labels")
    pipe = sw.pipeline(model, m, "pp", microbatches=case["m"], schedule=case["schedule"], loss_fn=loss_fn,
                       split=case.get("split"), chunks=case.get("chunks", 1), example_inputs=example,
                       dp_axis="dp" if "dp" in case else None, checkpoint=case.get("checkpoint", False))
    return m, model, pipe


def _run_case(case: dict) -> dict:
    m, model, pipe = _pipe(case)
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    losses, sends = [], []
    for ids in _batches():
        with sw.comm.CommCounter() as c:
            losses.append(pipe.step(ids, input_ids=ids) if case.get("loss_fn") else
                          pipe.step(input_ids=ids, labels=ids))
        sends.append(c.count("send"))
        opt.step()
        opt.zero_grad()
    full = sw.full_state_dict(pipe)
    ref_losses, ref_state = _reference(case["model"], case.get("cache", False))
    return {
        "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "param_err": max(_rel_err(full[k], v) for k, v in ref_state.items()),
        "keys_ok": sorted(full) == sorted(ref_state),
        "sends": sends,
        "n_send": [s.n_send for s in pipe.all_stages],
        "stages": pipe.stage_names(),
        "tied": len(pipe.tied),
        "coord": m.coord("pp"),
        "made": [x.kind for x in pipe.all_stages[0].graph.made],
    }


def check_parity(cases: list[dict]) -> list[dict]:
    return [_run_case(case) for case in cases]
