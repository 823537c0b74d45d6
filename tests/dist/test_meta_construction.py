"""Meta-device construction in every layout, on a world of 4 CPU ranks, against one process that built the same
model for real (rank-side checks: tests/dist/meta_checks.py).

The promise under test: a model built on the meta device and handed to any wrapper starts with exactly the
values one device draws from the same seed (bit-identical), trains to the same numbers (SGD, relative 1e-5),
each rank holds only its share of the parameters, and nothing it drew itself is broadcast.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import meta_checks as mc

LAYOUTS = [("dp", {"dp": 4}), ("tp", {"tp": 4}), ("zero1", {"dp": 4}), ("zero2", {"dp": 4}),
           ("zero3", {"dp": 4}), ("zero3", {"dp": 2, "tp": 2}), ("pp", {"pp": 4}), ("pp", {"pp": 2, "dp": 2}),
           ("pp-graph", {"pp": 2, "dp": 2}), ("pp-tp", {"pp": 2, "tp": 2})]


def test_every_layout_starts_and_trains_as_one_device(worlds):
    world = worlds.get(4)
    per_rank = world.run(mc.check_layouts, LAYOUTS, timeout=300)
    for k, (layout, axes) in enumerate(LAYOUTS):
        for rank, results in enumerate(per_rank):
            res = results[k]
            assert res["same_init"], (layout, axes, rank)
            assert res["err"] < 1e-5, (layout, axes, rank, res["err"])
            assert res["broadcasts"] == 0, (layout, axes, rank, res["broadcasts"])
            if layout.startswith("zero"):
                assert res["save_gathers"] == 0, (layout, axes, res)  # own ranges, with tp inside too
                assert res["in_flight"] <= 2, (layout, axes, res)  # reduce-scatters outstanding at once
                assert layout != "zero3" or res["groups"] > 2, res  # ... with more units than that
            share = res["held"] / res["whole"]
            if layout in ("zero1", "zero2") or (layout == "zero3" and axes == {"dp": 4}):
                assert share < 0.26, (layout, share)  # the optimizer steps 1/4 of the flat groups (+ rounding)
            elif layout == "zero3":
                assert share < 0.3, (layout, axes, share)  # flat ranges of the tp pieces: ~1/4 of everything
            elif layout == "pp-tp":
                assert share < 0.4, (layout, share)  # its stage's tp pieces only, not every stage's
            elif layout == "tp":
                assert share < 0.4, (layout, share)  # the matrices split 4 ways; norms, biases, wpe whole
            elif layout == "pp" and axes == {"pp": 4}:
                assert share < 0.6, (layout, rank, share)  # one of wte | block | block | ln_f+head (tied wte)
            elif layout == "dp":
                assert share >= 1.0, (layout, share)  # replicated: every rank steps the whole model


def test_a_model_without_param_init_starts_from_its_layers_reset(worlds):
    per_rank = worlds.get(4).run(mc.check_user_model, {"dp": 4}, timeout=120)
    for res in per_rank:
        assert res["same_init"] and res["differs_per_layer"], res



def test_transformers_model_on_meta_loads_pretrained_into_a_graph_pipeline(worlds, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    for res in worlds.get(2).run(mc.check_hf_meta_pipeline, str(tmp_path / "llama"), timeout=180):
        assert res["err"] < 1e-6 and res["same"], res
