"""``sw.compile`` without processes: names and keys unchanged, recompilations counted and warned about with what
changed, validation grad-mode switches not counted, bad arguments refused, and a pipeline stage holding a
compiled block giving up its zero-bubble weight capture.

Backend ``aot_eager`` (dynamo and AOTAutograd, no code generation): what is tested here — which calls compile,
the counters, the warnings — happens before the backend; inductor's numbers are tested in
tests/dist/test_compile.py and by ``shardwise verify`` (tests/e2e/test_compile_e2e.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import shardwise as sw
from shardwise.models.gpt import GPT, GPTConfig, lm_loss
from shardwise.parallel.common.compile import compiled_regions
from shardwise.parallel.pipeline.weight_grad import WeightCapture
from shardwise.runtime.compiling import CompileWatch
from shardwise.runtime.metrics import compile_row

CFG = GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=32)


def _tokens(t: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, t), generator=torch.Generator().manual_seed(t))


def test_recompile_is_counted_and_warned_once_with_the_changed_input():
    torch.manual_seed(0)
    eager = GPT(CFG)
    torch.manual_seed(0)
    model = sw.compile(GPT(CFG), backend="aot_eager")
    watch = CompileWatch(model)  # the trainer's view: progress lines, metrics records, summary
    assert compiled_regions(model) == ["blocks.0", "blocks.1"] and not CompileWatch(GPT(CFG)).active
    assert list(model.state_dict()) == list(eager.state_dict())  # names and keys as before
    x = _tokens(10)
    loss = lm_loss(model(x), x)
    loss.backward()
    assert torch.allclose(loss, lm_loss(eager(x), x), rtol=1e-6)
    with torch.no_grad():  # validation: its own graph, not a recompilation
        model(x)
    model.eval()
    model(x)  # eval mode: the same
    model.train()
    stats = sw.compile_stats(model)
    assert stats.regions == 2 and stats.recompiles == 0 and stats.graphs >= 1, stats
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(_tokens(12))  # a longer sequence: dynamic=False compiles again
        model(_tokens(13))
    stats = sw.compile_stats(model)
    assert stats.recompiles == 2, stats
    assert "blocks.0 recompiled (input 0: (2, 10, 32) float32 requires_grad -> (2, 12, 32)" in stats.reasons[0]
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "keep input shapes and dtypes fixed" in messages[0], messages  # once per region
    lines: list[str] = []
    watch.note(type("Progress", (), {"note": staticmethod(lines.append)}), 7)
    assert len(lines) == 2 and lines[0].startswith("recompile at step 7: blocks.0 recompiled (input 0:"), lines
    assert watch.record() == {"recompiles": 2} and watch.take() == []
    summary = watch.summary(9.0, 1.0)
    assert summary["recompiles"] == 2 and summary["compile_first_step_excess_s"] == 8.0
    assert "2 recompiles: blocks.0 recompiled" in compile_row(summary)


def test_checkpointed_blocks_keep_checkpointing_around_the_compiled_forward():
    torch.manual_seed(0)
    model = sw.compile(sw.checkpoint_layers(GPT(CFG)), backend="aot_eager")
    assert all(m.forward.body is not None for m in model.blocks)  # the checkpoint wrapper calls the region
    torch.manual_seed(0)
    eager = GPT(CFG)
    x = _tokens(10)
    lm_loss(model(x), x).backward()
    lm_loss(eager(x), x).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown torch.compile backend 'inductr'"):
        sw.compile(GPT(CFG), backend="inductr")
    with pytest.raises(ValueError, match=r"regions \['nope'\] name no module"):
        sw.compile(GPT(CFG), regions=["nope"])
    model = sw.compile(GPT(CFG), backend="aot_eager")
    with pytest.raises(ValueError, match="already compiled"):
        sw.compile(model)
    hooked = GPT(CFG)
    hooked.blocks[0].ln_1.register_forward_hook(lambda *_: None)
    with pytest.raises(ValueError, match=r"fullgraph=True\): \['blocks.0.ln_1'\] must run eagerly"):
        sw.compile(hooked, fullgraph=True, backend="aot_eager")
    assert sw.compile_stats(GPT(CFG)) == sw.CompileStats()  # not compiled: zeros


def test_pipeline_weight_capture_steps_aside_for_compiled_blocks():
    torch.manual_seed(0)
    model = sw.compile(GPT(CFG), backend="aot_eager")
    capture = WeightCapture(model)
    assert not capture.exact and not any(m in capture.modules for m in model.blocks[0].modules())
    out, records = capture.run(model, _tokens(10))
    assert records is None and out.shape == (2, 10, CFG.vocab_size)  # W differentiates the stage again
