"""``sw.ExpertParallel`` on worlds of 2 and 4 ranks: transformers 5's Mixtral and Qwen2-MoE and our Llama-family
MoE against one device (AdamW, fp32, rtol 1e-5: losses, first-step gradients, final parameters), the collectives
per forward and backward counted, and a meta-built model read from a Hub directory (each rank its experts only),
checkpointed and exported. Rank-side code: tests/dist/hf_moe_checks.py."""

from __future__ import annotations

import pytest

from tests.dist import hf_moe_checks as hc

pytest.importorskip("transformers")
LAYERS = 2  # every layer of both tiny configs is an MoE layer


@pytest.mark.parametrize("kind, size", [("mixtral", 2), ("qwen2_moe", 2), ("mixtral", 4), ("qwen2_moe", 4)])
def test_transformers_experts_split_equal_one_device(worlds, kind, size):
    counts = worlds.get(size).run(hc.check_hf_expert_parallel, kind, size, timeout=240)
    # forward: one all-reduce of the experts' (N, h) output per MoE layer; backward: the Megatron pair's
    # all-reduce of the tokens' gradient and one of the routing weights' gradient per layer; nothing else
    assert counts[0] == {"forward": {"all_reduce": LAYERS}, "backward": {"all_reduce": 2 * LAYERS}}, counts[0]
    assert all(c == counts[0] for c in counts)


@pytest.mark.parametrize("kind, size", [("mixtral", 2), ("qwen2_moe", 4)])
def test_our_experts_split_equal_one_device(worlds, kind, size):
    counts = worlds.get(size).run(hc.check_ours_expert_parallel, kind, size, timeout=240)
    # forward: the (N, k, h) assignment outputs summed once per layer; backward: the tokens' gradient once
    assert counts[0] == {"forward": {"all_reduce": LAYERS}, "backward": {"all_reduce": LAYERS}}, counts[0]


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_llama_moe_tensor_parallel_plan(worlds, kind):
    worlds.get(2).run(hc.check_llama_tp_plan, kind, 2, timeout=240)


def test_meta_model_from_hub_reads_its_experts(worlds, tmp_path):
    hf = hc.hf_model("qwen2_moe")
    hf.save_pretrained(tmp_path / "hub")  # the Hub's per-expert layout
    read = worlds.get(2).run(hc.check_meta_from_hub, str(tmp_path / "hub"), 2, str(tmp_path), timeout=240)
    from shardwise.checkpoint.hf_dir import open_pretrained

    tensors = open_pretrained(tmp_path / "hub").tensors
    total = sum(i.nbytes for i in tensors.values())
    experts = sum(i.nbytes for k, i in tensors.items() if ".experts." in k)
    assert read == [total - experts // 2] * 2, (read, total, experts)  # the dense part, and half the experts


def test_auto_plan_with_expert_parallel(worlds):
    worlds.get(2).run(hc.check_auto_plan, "qwen2_moe", 2, timeout=240)
