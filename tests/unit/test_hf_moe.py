"""Hugging Face mixtures of experts (mixtral, qwen2_moe, qwen3_moe) in and out: config parsing, the native model
against transformers 5's (same weights: logits and gradients), Hub directories in both key layouts (per-expert,
as save_pretrained writes them, and fused 3-D), each expert block read alone, the export round trip, and the
runtime's MoE fields. Tiny configs: hidden 32, 2 layers, 4-8 experts, fp32."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardwise.checkpoint.hf_dir import attach_pretrained, hf_export, open_pretrained, write_hf_dir
from shardwise.checkpoint.hf_experts import hub_tensors
from shardwise.models.hf_config import hf_config_from_dict, load_hf_config
from shardwise.models.llama import Llama
from shardwise.parallel.common.materialize import deferred_piece, materialize, source_of

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_experts_per_tok=2)
CASES = {
    "mixtral": dict(model_type="mixtral", num_local_experts=4),
    "mixtral-top1": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=1),  # weight 1, as HF
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, moe_intermediate_size=16,
                      shared_expert_intermediate_size=32),
    "qwen2_moe-sparse": dict(model_type="qwen2_moe", num_experts=8, moe_intermediate_size=16,
                             shared_expert_intermediate_size=24, norm_topk_prob=True, decoder_sparse_step=2,
                             qkv_bias=False),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=8, moe_intermediate_size=16, norm_topk_prob=True,
                      head_dim=16, mlp_only_layers=[1], attention_bias=True),
    "qwen3": dict(model_type="qwen3", head_dim=8),  # dense, with the q/k norm the MoE cousin has
}
SEQ = 16


def _hf(case: str, seed: int = 0):
    torch.manual_seed(seed)
    extra = dict(CASES[case])
    cfg = transformers.AutoConfig.for_model(extra.pop("model_type"), **{**BASE, **extra})
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _ours(hf_model) -> Llama:
    model = Llama(hf_config_from_dict(hf_model.config.to_dict()), SEQ).eval()
    model.load_state_dict(hf_model.state_dict(), strict=True)  # the same keys, the same shapes
    return model


def _idx() -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(3))


def test_config_fields_of_each_type():
    mixtral = hf_config_from_dict(_hf("mixtral").config.to_dict())
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (4, 2, 48)
    assert mixtral.norm_topk_prob and mixtral.shared_expert_intermediate_size == 0 and not mixtral.qkv_bias
    assert mixtral.router_aux_loss_coef == 0.001 and mixtral.rope_theta == 1e6
    qwen2 = hf_config_from_dict(_hf("qwen2_moe-sparse").config.to_dict())
    assert (qwen2.num_experts, qwen2.moe_intermediate_size, qwen2.shared_expert_intermediate_size) == (8, 16, 24)
    assert qwen2.norm_topk_prob and not qwen2.qkv_bias and not qwen2.qk_norm
    assert [qwen2.is_moe_layer(i) for i in range(2)] == [False, True]  # (i + 1) % 2 == 0
    qwen3 = hf_config_from_dict(_hf("qwen3_moe").config.to_dict())
    assert qwen3.qk_norm and qwen3.qkv_bias and qwen3.o_bias and qwen3.head_dim == 16
    assert [qwen3.is_moe_layer(i) for i in range(2)] == [True, False]  # mlp_only_layers = [1]
    # transformers' own defaults for a file that names only the shape
    bare = hf_config_from_dict({"model_type": "qwen2_moe", **BASE})
    assert (bare.num_experts, bare.moe_intermediate_size, bare.norm_topk_prob, bare.qkv_bias) == (60, 1408, False, True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_dict_reads_back_through_transformers(case):
    ours = hf_config_from_dict(_hf(case).config.to_dict())
    d = ours.hf_dict()
    again = hf_config_from_dict(transformers.AutoConfig.for_model(**d).to_dict())
    assert dataclasses.replace(again, source="") == dataclasses.replace(ours, source="")


@pytest.mark.parametrize("change, words", [
    ({"router_jitter_noise": 0.1}, ["router_jitter_noise = 0.1", "0.0"]),
    ({"num_experts_per_tok": 9}, ["num_experts_per_tok = 9", "8 experts"]),
    ({"mlp_only_layers": "1"}, ["mlp_only_layers = '1'"]),
    ({"num_local_experts": 0}, ["num_local_experts = 0", "positive int"]),
])
def test_refused_moe_fields_are_one_line(change, words):
    raw = {"model_type": "mixtral", **BASE, "num_local_experts": 8, **change}
    with pytest.raises(ValueError) as err:
        hf_config_from_dict(raw, source="cfg.json")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("cfg.json: ") and all(w in msg for w in words), msg


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_gradients_match_transformers(case):
    hf = _hf(case)
    ours = _ours(hf)
    idx = _idx()
    targets = torch.roll(idx, -1, dims=1)
    hf_out = hf(idx, labels=targets)  # eval mode, no router logits: the cross-entropy alone on both sides
    logits = ours(idx)
    torch.testing.assert_close(logits, hf_out.logits, rtol=1e-5, atol=1e-6)
    # transformers shifts the labels itself: its loss is over positions 0..t-2 predicting idx[1:]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), targets[:, :-1].reshape(-1))
    hf_loss = torch.nn.functional.cross_entropy(hf_out.logits[:, :-1].reshape(-1, 64), targets[:, :-1].reshape(-1))
    loss.backward()
    hf_loss.backward()
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-5, atol=1e-7, msg=lambda s, n=name: f"{n}: {s}")


def _load_meta(directory: Path, arch: str):
    with torch.device("meta"):
        model = Llama(load_hf_config(directory / "config.json"), SEQ)
    pretrained = attach_pretrained(model, directory, arch=arch)
    return model, pretrained


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_save_pretrained_directory_loads(tmp_path, case):
    hf = _hf(case)
    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert not any(k.endswith("gate_up_proj") for k in keys)  # transformers 5 writes the Hub's per-expert layout
    block = "block_sparse_moe" if case == "mixtral" else "mlp"
    proj = "w1" if case == "mixtral" else "gate_proj"
    assert f"model.layers.0.{block}.experts.3.{proj}.weight" in keys
    model, pretrained = _load_meta(tmp_path, case)
    materialize(model, "cpu")
    torch.testing.assert_close(model.eval()(_idx()), hf(_idx()).logits, rtol=1e-5, atol=1e-6)
    assert pretrained.bytes_read == sum(i.nbytes for i in pretrained.tensors.values())  # everything, once


def test_fused_layout_directory_loads(tmp_path):
    hf = _hf("qwen2_moe")
    hf.save_pretrained(tmp_path, save_original_format=False)
    assert "model.layers.0.mlp.experts.gate_up_proj" in open_pretrained(tmp_path).tensors
    model, _ = _load_meta(tmp_path, "qwen2_moe")
    materialize(model, "cpu")
    torch.testing.assert_close(model.eval()(_idx()), hf(_idx()).logits, rtol=1e-5, atol=1e-6)


def _own_hub_dir(tmp_path: Path, case: str = "mixtral") -> tuple[Path, Llama]:
    """A per-expert directory written by hand (safetensors' save_file over ``hub_tensors``)."""
    hf = _hf(case, seed=5)
    ours = _ours(hf)
    model_type = CASES[case]["model_type"]
    tensors = {k: v.contiguous() for name, t in ours.state_dict().items() for k, v in hub_tensors(name, t, model_type)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    return tmp_path, ours


def test_an_expert_block_reads_only_its_experts(tmp_path):
    directory, ours = _own_hub_dir(tmp_path)
    model, pretrained = _load_meta(directory, "mixtral")
    full = model.model.layers[1].mlp.experts.gate_up_proj  # (4, 2·48, 32) from w1 and w3 of each expert
    want = ours.model.layers[1].mlp.experts.gate_up_proj.detach()
    piece = deferred_piece(full, [(2, 2)], None)  # experts [2, 4): rank 1 of an expert split in two
    before = pretrained.bytes_read
    torch.testing.assert_close(source_of(piece).read(), want[2:4], rtol=0, atol=0)
    assert pretrained.bytes_read - before == 2 * 2 * 48 * 32 * 4  # two experts' w1 and w3, fp32
    down = source_of(model.model.layers[0].mlp.experts.down_proj)
    before = pretrained.bytes_read
    torch.testing.assert_close(down.read_flat(48 * 32 + 5, 2 * 48 * 32 - 1),
                               ours.model.layers[0].mlp.experts.down_proj.detach().reshape(-1)[48 * 32 + 5:2 * 48 * 32 - 1])
    assert pretrained.bytes_read - before == 32 * 48 * 4  # expert 1's w2 only
    materialize(model, "cpu")
    torch.testing.assert_close(model.eval()(_idx()), ours(_idx()), rtol=0, atol=0)


def test_missing_expert_is_one_line(tmp_path):
    directory, _ = _own_hub_dir(tmp_path, "qwen2_moe")
    path = directory / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.1.mlp.experts.2.up_proj.weight"}
    save_file(kept, str(path))
    with pytest.raises(ValueError) as err:
        _load_meta(directory, "qwen2_moe")
    msg = str(err.value)
    assert "\n" not in msg and "'model.layers.1.mlp.experts.2.up_proj.weight'" in msg and str(directory) in msg, msg


class _Stub:
    """What ``hf_export`` reads of a checkpoint, over a plain state dict."""

    def __init__(self, tensors: dict[str, torch.Tensor], hf_config: dict, path: Path) -> None:
        self.tensors, self.path = {f"model/{k}": v for k, v in tensors.items()}, path
        self.state, self.index = {"hf_config": hf_config}, {"tensors": self.tensors}

    def keys(self, prefix: str = "") -> list[str]:
        return [k for k in self.tensors if k.startswith(prefix)]

    def full(self, key: str) -> torch.Tensor:
        return self.tensors[key].detach().clone()


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_export_round_trip_through_transformers(tmp_path, case):
    torch.manual_seed(7)
    ours = Llama(hf_config_from_dict(_hf(case).config.to_dict()), SEQ).eval()  # our own init, not transformers'
    state = dict(ours.state_dict())
    state["model.layers.0.mlp.gate.expert_bias"] = torch.zeros(4)  # a selection bias: not a Hub tensor
    config, tensors = hf_export(_Stub(state, ours.config.hf_dict(), tmp_path / "ckpt"))
    index = write_hf_dir(tensors, config, tmp_path / "out")
    assert not any("expert_bias" in k or k.endswith("gate_up_proj") for k in index["weight_map"])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    torch.testing.assert_close(loaded(_idx()).logits, ours(_idx()), rtol=1e-5, atol=1e-6)
    back, _ = _load_meta(tmp_path / "out", case)  # and our reader takes what the export wrote
    materialize(back, "cpu")
    torch.testing.assert_close(back.eval()(_idx()), ours(_idx()), rtol=0, atol=0)


def test_runtime_fills_the_moe_fields(tmp_path):
    from shardwise.runtime.config_schema import ModelConfig
    from shardwise.runtime.model_build import check_tp, model_spec, resolve_hf

    path = tmp_path / "qwen2_moe.json"
    path.write_text(json.dumps(_hf("qwen2_moe-sparse").config.to_dict()))
    m = resolve_hf(ModelConfig(hf_config=str(path), block_size=SEQ), {})
    assert (m.n_experts, m.top_k, m.moe_ffn, m.n_shared_experts, m.router_renorm) == (8, 2, 16, 2, True)
    assert (m.moe_aux_loss_coef, m.moe_every, m.moe_first_dense) == (0.001, 2, 1)
    assert model_spec(m).n_experts == 8  # the planner prices the experts, not a dense MLP
    with pytest.raises(ValueError, match=r"model.n_experts = 4 contradicts model.hf_config"):
        resolve_hf(ModelConfig(hf_config=str(path), block_size=SEQ), {"n_experts": 4})
    with pytest.raises(ValueError, match=r"parallel.tp = 3 must divide num_attention_heads"):
        check_tp(m, 3)
    check_tp(m, 2)
    qwen3 = tmp_path / "qwen3_moe.json"
    qwen3.write_text(json.dumps(_hf("qwen3_moe").config.to_dict()))
    with pytest.raises(ValueError, match=r"parallel.tp = 2 is not supported for model_type 'qwen3_moe'"):
        check_tp(resolve_hf(ModelConfig(hf_config=str(qwen3), block_size=SEQ), {}), 2)


def test_cached_decoding_equals_the_full_forward():
    from shardwise.models.generate import generate

    ours = _ours(_hf("qwen2_moe-sparse"))
    prompt = _idx()[:, :4]
    with torch.no_grad():
        cached = generate(ours, prompt, max_new_tokens=6, temperature=0.0, use_cache=True)
        full = generate(ours, prompt, max_new_tokens=6, temperature=0.0, use_cache=False)
    assert torch.equal(cached, full) and cached.shape == (2, 10)


def test_expert_parallel_refuses_what_it_cannot_split():
    import shardwise as sw
    from shardwise.parallel.expert.style import check_expert_parallel, match_experts

    hf = _hf("mixtral")
    experts = hf.model.layers[0].mlp.experts
    with pytest.raises(ValueError, match=r"^x: ExpertParallel applies to an experts module .* got Linear"):
        check_expert_parallel("x", torch.nn.Linear(4, 4), None, 2)
    with pytest.raises(ValueError, match=r"^e: 4 experts do not divide over 3 ranks; .*\[1, 2, 4\]"):
        check_expert_parallel("e", experts, hf.model.layers[0].mlp, 3)
    with pytest.raises(ValueError, match=r"plan pattern 'model.layers.\*.moe' \(ExpertParallel\) matches no module"):
        match_experts(hf, {"model.layers.*.moe": sw.ExpertParallel()}, 2)
    ours = _ours(hf)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate: ExpertParallel applies to an experts module"):
        match_experts(ours, {"model.layers.*.mlp.gate": sw.ExpertParallel()}, 1)
    assert match_experts(ours, {"model.layers.*.mlp.experts": sw.ExpertParallel()}, 2) == [
        "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def test_expert_parallel_on_one_rank(one_rank_mesh):
    import shardwise as sw
    from shardwise.parallel.expert.style import ExpertParallelExperts

    hf = _hf("qwen2_moe")
    want = hf(_idx()).logits.detach()
    keys = set(hf.state_dict())
    sw.parallelize(hf, one_rank_mesh, {"model.layers.*.mlp.experts": sw.ExpertParallel()}, axis="tp")
    assert isinstance(hf.model.layers[1].mlp.experts, ExpertParallelExperts) and set(hf.state_dict()) == keys
    torch.testing.assert_close(hf(_idx()).logits, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"already split \(ExpertParallel\)"):
        sw.parallelize(hf, one_rank_mesh, {"model.layers.*.mlp.experts": sw.ExpertParallel()}, axis="tp")
    ours = _ours(_hf("mixtral"))
    sw.parallelize(ours, one_rank_mesh, {"model.layers.*.mlp.experts": sw.ExpertParallel()}, axis="tp")
    assert ours.model.layers[0].mlp.shard.replicated
    with pytest.raises(ValueError, match=r"already split \(expert parallelism\)"):
        sw.parallelize(ours, one_rank_mesh, {"model.layers.*.mlp.experts": sw.ExpertParallel()}, axis="tp")


def test_auto_offers_expert_parallel():
    import shardwise as sw

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model("mixtral", **{**BASE, "hidden_size": 256, "intermediate_size": 1024},
                                            num_local_experts=8)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    idx = torch.randint(0, 64, (8, 64), generator=torch.Generator().manual_seed(0))
    layout = sw.MeshLayout(("dp", "tp"), (1, 2))
    plan = sw.auto(hf, layout, (idx,))
    assert plan["model.layers.*.mlp.experts"] == sw.ExpertParallel()  # half the experts' GEMMs per rank pays
    assert sw.ParallelizePlan.from_json(plan.to_json()).styles == plan.styles
    kept = sw.auto(hf, layout, (idx,), pins={"model.layers.*.mlp.experts": "B"})
    assert "model.layers.*.mlp.experts" not in kept
    three = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("mixtral", **BASE, num_local_experts=3))
    with pytest.raises(ValueError, match=r"its 3 experts do not divide over tp=2"):
        sw.auto(three, layout, (_idx(),), pins={"model.layers.*.mlp.experts": "experts"})
