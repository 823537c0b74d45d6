"""The memory ledger: the floor of a layout (planner/ledger.py, hand-computed from a tiny GPT's shapes) and the
phase meter (runtime/memory_ledger.py: a phase's peak sees what it allocated; the next phase, after the reset,
does not)."""

from __future__ import annotations

import pytest
import torch

from shardwise.planner import Layout, ModelSpec
from shardwise.planner.ledger import MAX_IN_FLIGHT, layout_floor, phase_floors
from shardwise.runtime.ledger_report import ledger_row
from shardwise.runtime.memory_ledger import HELD, PhaseMeter, allocator_slack, ledger

# A GPT of 2 blocks, width 64, 4 heads, vocabulary 256, 32 positions, tied head. By hand:
H, V, S = 64, 256, 32
EMBED = V * H + S * H  # wte + wpe
BLOCK = (2 * H) + (H * 3 * H + 3 * H) + (H * H + H) + (2 * H) + (H * 4 * H + 4 * H) + (4 * H * H + H)
PSI = EMBED + 2 * BLOCK + 2 * H  # + ln_f; the head is wte's weight
MB = 2


def spec() -> ModelSpec:
    return ModelSpec.gpt(n_layer=2, n_embd=H, n_head=4, vocab_size=V, seq_len=S)


def floor(**kw):
    m = kw.get("microbatches", 1)
    return layout_floor(spec(), Layout(micro_batch=MB, **kw), global_batch=MB * m * kw.get("dp", 1))


def test_the_hand_count_is_the_specs():
    assert spec().params == PSI == 118528


def test_zero3_over_4_with_adamw_is_16_psi_over_4_plus_two_units():
    (f,) = floor(dp=4, zero_stage=3)
    assert f.params + f.grads + f.optimizer == 16 * PSI / 4
    assert f.gathered == 2 * BLOCK * 4  # the current and the prefetched unit (a block), fp32
    assert f.comm == (1 + MAX_IN_FLIGHT) * BLOCK * 4  # the unit filling and the one reducing


def test_plain_data_parallelism_holds_16_psi_and_no_extra_buffers():
    (f,) = floor(dp=4)
    assert (f.params, f.grads, f.optimizer, f.gathered, f.comm) == (4 * PSI, 4 * PSI, 8 * PSI, 0, 0)


@pytest.mark.parametrize("optimizer,per_element", [("sgd", 0), ("sgd-momentum", 4), ("adamw", 8)])
def test_the_optimizer_state_follows_the_optimizer(optimizer, per_element):
    (f,) = floor(dp=2, zero_stage=1, optimizer=optimizer)
    assert f.optimizer == per_element * PSI / 2
    assert f.params == 4 * PSI and f.grads == 4 * PSI


def test_bf16_mixed_keeps_2_2_and_12_bytes():
    (f,) = floor(dp=2, zero_stage=2, precision="bf16-mixed")
    assert (f.params, f.grads, f.optimizer) == (2 * PSI, 2 * PSI / 2, 12 * PSI / 2)


def test_pipeline_stages_hold_their_own_layers_and_the_first_keeps_more_micro_batches():
    first, last = floor(pp=2, microbatches=4)
    assert first.params == 4 * (EMBED + BLOCK)
    assert last.params == 4 * (BLOCK + 2 * H + V * H)  # ln_f and its own copy of the tied head
    # 1F1B: the first stage holds pp = 2 micro-batches' activations at its peak, the last one
    assert first.activations > last.activations
    assert first.comm == last.comm == 2 * MB * S * H * 4  # a message received and one sent


def test_tensor_parallelism_splits_the_matrices_and_the_vocabulary():
    (f,) = floor(tp=2)
    split = H * 3 * H + 3 * H + H * H + H * 4 * H + 4 * H + 4 * H * H  # column and row weights, column biases
    per_block = split // 2 + (BLOCK - split)
    assert f.params == 4 * (V * H // 2 + S * H + 2 * per_block + 2 * H)


def test_phase_floors_hold_what_is_live_in_each_phase():
    plan = Layout(dp=4, micro_batch=MB)
    (f,) = floor(dp=4)
    phases = phase_floors(f, plan)
    assert phases["construction"] == 8 * PSI  # parameters and data parallelism's persistent buckets
    assert phases["step"] == 16 * PSI
    assert phases["backward"] == f.total > phases["forward"] - 1


def test_the_floors_constant_is_the_reducers():
    from shardwise.parallel.zero import grads

    assert MAX_IN_FLIGHT == grads.MAX_IN_FLIGHT


def test_a_phase_sees_what_it_allocated_and_the_next_does_not():
    meter = PhaseMeter(torch.device("cpu"))
    if meter.mode != "rss":
        pytest.skip("no /proc/self/clear_refs here")
    meter.begin("big")
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, every page touched
    del block
    meter.begin("small")
    meter.end()
    assert meter.peaks["big"] - meter.peaks["small"] > 48 * 2**20
    assert meter.rise["big"] > 48 * 2**20 > meter.rise["small"]
    assert meter.whole_peak() >= meter.peaks["big"]


def test_the_allocator_slack_is_read_on_glibc():
    slack = allocator_slack()
    assert slack is None or slack >= 0


class _Meter(PhaseMeter):
    def __init__(self, peaks, rise, slack):  # noqa: D107 - canned readings
        self.mode, self.peaks, self.rise, self.slack, self.current, self.whole = "rss", peaks, rise, slack, None, 0

    def _read(self):
        return max(self.peaks.values())


def test_the_ledger_names_the_excess_and_it_adds_up():
    bare = 100
    terms = {"total": 1000.0, "activations": 300.0, "largest": "optimizer"}
    # step: floor 600, it rose 250 and allocates nothing of its floor itself; 50 was allocator slack
    meter = _Meter({"step": bare + 900}, {"step": 250}, {"step": 50})
    book = ledger(meter, bare, (terms, {"step": 600.0}, {"step": 0.0}))
    excess = dict(book["phases"]["step"]["excess"])
    assert excess == {"allocator slack": 50, "optimizer temporaries": 250}
    assert sum(excess.values()) == 900 - 600
    assert book["ratio"] == pytest.approx(0.9) and book["biggest_excess"] == ["step", "optimizer temporaries", 250]
    name, text = ledger_row([{"rank": 0, "memory_ledger": book}])
    assert name == "memory ledger" and "0.90x" in text and "optimizer temporaries" in text


def test_what_a_phase_did_not_allocate_was_held_on_entry():
    meter = _Meter({"forward": 100 + 900}, {"forward": 100}, {})
    book = ledger(meter, 100, ({"total": 1000.0, "activations": 300.0, "largest": "activations"},
                               {"forward": 500.0}, {"forward": 80.0}))
    assert book["phases"]["forward"]["excess"] == [["forward temporaries", 20], [HELD, 380]]
    assert book["held_on_entry"] == 380 and book["biggest_excess"] == ["forward", "forward temporaries", 20]


def test_bf16_autocast_keeps_a_2_byte_copy_of_each_weight_or_of_the_gathered_units():
    (plain,) = floor(dp=2, precision="bf16")
    (zero3,) = floor(dp=2, zero_stage=3, precision="bf16")
    assert plain.casts == 2 * PSI and zero3.casts == 2 * 2 * BLOCK
    assert floor(dp=2)[0].casts == 0


def test_on_cuda_the_meter_resets_the_allocators_mark_per_phase(monkeypatch):
    state = {"allocated": 100, "peak": 500}  # a fake allocator: the mark before the meter started was 500

    def reset(device=None):
        state["peak"] = state["allocated"]

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    meter = PhaseMeter(torch.device("cuda", 0), begin="forward")
    state["allocated"], state["peak"] = 100, 300  # forward peaks at 300 and frees back to 100
    meter.begin("step")
    meter.end()
    assert meter.mode == "cuda" and meter.peaks == {"forward": 300, "step": 100}
    assert meter.rise == {"forward": 200, "step": 0} and meter.slack == {}
    assert meter.whole_peak() == 500  # the mark cleared by the first reset still counts for the run
