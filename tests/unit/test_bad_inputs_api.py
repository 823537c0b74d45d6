"""Bad-input catalogue, Python API: each misuse raises ``ValueError``/``TypeError`` whose message is one line naming
the offending value and the fix, before anything communicates or is written.

In-process on a world of one (``sw.init()`` without torchrun's environment); the command-line cases are in
``tests/e2e/test_bad_inputs.py``; docs/failures.md "Errors: cause and fix" lists both. Ranks that disagree on a
collective under ``Mesh(debug=True)`` need several processes: ``tests/dist/test_comm.py::
test_debug_mode_turns_mismatch_into_error`` covers that case.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from shardwise.mesh import MeshLayout
from shardwise.runtime.config_schema import OptimizerConfig
from shardwise.data.windows import BatchPlan
from shardwise.runtime.optimizer_impl import check_implementation


@pytest.fixture(scope="module")
def env() -> Iterator[SimpleNamespace]:
    """Meshes of a one-process world: ``(dp, tp)``, ``(pp)``, ``(dp)`` and ``(cp)``."""
    created = not dist.is_initialized()
    sw.init(backend="gloo")
    yield SimpleNamespace(m=sw.Mesh(dp=1, tp=1), pm=sw.Mesh(pp=1), d=sw.Mesh(dp=-1), c=sw.Mesh(cp=1))
    if created:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def nothing_written(tmp_path, monkeypatch) -> Iterator[None]:
    monkeypatch.chdir(tmp_path)
    yield
    assert not any(tmp_path.iterdir()), "an API error wrote to disk"


def _gpt() -> nn.Module:
    return sw.models.GPT(sw.models.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return out.sum()


_SGD = functools.partial(torch.optim.SGD, lr=0.1)


class _Sdpa(nn.Module):
    """Self-attention of its input through ``F.scaled_dot_product_attention`` with ``kwargs``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.kwargs = kwargs

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, **self.kwargs)


_Q = torch.zeros(1, 2, 8, 4)  # (batch, heads, seq, dim)

Call = Callable[[SimpleNamespace], Any]

# (id, call, exception type, substrings of the one-line message: the offending value first, then the fix)
CASES: list[tuple[str, Call, type[Exception], tuple[str, ...]]] = [
    # --- meshes ---
    ("mesh-product", lambda e: sw.Mesh(dp=2, tp=2), ValueError,
     ("{'dp': 2, 'tp': 2} multiply to 4 but the world size is 1", "set one axis to -1")),
    ("mesh-two-inferred", lambda e: sw.Mesh(dp=-1, tp=-1), ValueError,
     ("only one mesh axis may be -1", "give the others explicit sizes")),
    ("mesh-zero-size", lambda e: sw.Mesh(dp=0), ValueError, ("axis 'dp' has size 0", "sizes are positive ints")),
    ("mesh-str-size", lambda e: sw.Mesh(dp="2"), ValueError, ("size '2'", "sizes are positive ints")),
    ("mesh-no-axes", lambda e: sw.Mesh(), ValueError, ("at least one axis", "e.g. Mesh(dp=-1)")),
    ("mesh-bad-axis-name", lambda e: sw.Mesh(**{"d p": 1}), ValueError,
     ("mesh axis name 'd p'", "use a short identifier such as 'dp'")),
    ("mesh-not-divisible", lambda e: MeshLayout.infer({"dp": 3, "tp": -1}, 4), ValueError,
     ("world size 4 is not divisible by the product 3", "choose sizes whose product divides 4")),
    ("mesh-unknown-axis", lambda e: e.m.size("pp"), ValueError, ("unknown mesh axis 'pp'", "axes ['dp', 'tp']")),
    # --- SBP placements ---
    ("sbp-malformed", lambda e: sw.parse_sbp("S(x),B"), ValueError,
     ("cannot parse SBP 'S(x)'", "use S(dim), B, P or P(max)")),
    ("sbp-long-name", lambda e: sw.parse_sbp("Split(0)"), ValueError, ("'Split(0)'", "e.g. 'S(0),B'")),
    ("sbp-unknown-partial", lambda e: sw.Partial("min"), ValueError, ("got 'min'", "must be 'sum' or 'max'")),
    ("sbp-split-dim-type", lambda e: sw.Split(1.5), TypeError, ("got 1.5", "must be an int")),
    ("sbp-count", lambda e: sw.distribute(torch.ones(4), e.d, "S(0),B"), ValueError,
     ("'S(0),B' has 2 placements but the mesh has 1 axes", "one placement per mesh axis")),
    ("sbp-split-dim-range", lambda e: sw.distribute(torch.ones(4), e.d, "S(2)"), ValueError,
     ("Split dim 2 is out of range for a 1-d tensor", "use a dim in [-1, 0]")),
    # --- tensor parallelism ---
    ("tp-style-on-layernorm", lambda e: sw.parallelize(_gpt(), e.m, {"blocks.*.ln_1": sw.ColumnParallel()}),
     ValueError, ("blocks.0.ln_1: ColumnParallel applies to nn.Linear, got LayerNorm", "match the Linear layers")),
    ("tp-style-on-embedding", lambda e: sw.parallelize(_gpt(), e.m, {"wte": sw.RowParallel()}), ValueError,
     ("wte: RowParallel applies to nn.Linear, got Embedding", "match the Linear layers only")),
    ("tp-pattern-matches-nothing", lambda e: sw.parallelize(_gpt(), e.m, {"blocks.*.nope": sw.ColumnParallel()}),
     ValueError, ("'blocks.*.nope' matches no module", "e.g. 'blocks.*.mlp.fc'")),
    ("tp-plan-not-a-style", lambda e: sw.parallelize(_gpt(), e.m, {"blocks.*.mlp.fc": "column"}), TypeError,
     ("got 'column'", "must be one of ['ColumnParallel'")),
    ("tp-axis-missing", lambda e: sw.parallelize(_gpt(), e.m, {"blocks.*.mlp.fc": sw.ColumnParallel()}, axis="model"),
     ValueError, ("axis 'model' is not a mesh axis", "the mesh has ['dp', 'tp']")),
    ("tp-algorithm", lambda e: sw.parallelize(_gpt(), e.m, {"blocks.*.mlp.fc": sw.ColumnParallel()},
                                              algorithm="butterfly"),
     ValueError, ("unknown algorithm 'butterfly' for the tensor-parallel collectives", "'shm'")),
    # --- pipeline ---
    ("pp-schedule-name", lambda e: sw.pipeline(_gpt(), e.pm, microbatches=2, schedule="1fb1", loss_fn=_loss),
     ValueError, ("unknown pipeline schedule '1fb1'", "did you mean '1f1b'?")),
    ("pp-microbatches-zero", lambda e: sw.pipeline(_gpt(), e.pm, microbatches=0, loss_fn=_loss), ValueError,
     ("got 0", "microbatches must be an integer >= 1")),
    ("pp-interleaved-one-chunk", lambda e: sw.pipeline(_gpt(), e.pm, microbatches=2, schedule="interleaved",
                                                        loss_fn=_loss), ValueError,
     ("got chunks=1", "use schedule='1f1b' for one chunk per rank")),
    ("pp-split-unknown", lambda e: sw.pipeline(_gpt(), e.pm, microbatches=2, split=["nope"], loss_fn=_loss),
     ValueError, ("'nope' names no module", "one of ['blocks.0', 'blocks.1', 'ln_f']")),
    ("pp-axis-missing", lambda e: sw.pipeline(_gpt(), e.m, microbatches=2, loss_fn=_loss), ValueError,
     ("pipeline axis 'pp' is not an axis", "use one of ['dp', 'tp']")),
    ("pp-zero-stage-5", lambda e: sw.pipeline(_gpt(), e.pm, microbatches=2, loss_fn=_loss, zero_stage=5), ValueError,
     ("got 5", "must be 0, 1, 2 or 3")),
    ("pp-zero-3-no-dp", lambda e: sw.pipeline(_gpt(), e.pm, microbatches=2, loss_fn=_loss, zero_stage=3), ValueError,
     ("dp_axis is None", "pass dp_axis='dp'")),
    ("pp-autocast-fp16", lambda e: sw.pipeline(_gpt(), e.pm, microbatches=2, loss_fn=_loss, autocast=torch.float16),
     ValueError, ("got torch.float16", "fp16 needs loss scaling")),
    # --- ZeRO, data parallelism, checkpointing, mixed precision ---
    ("zero-stage-4", lambda e: sw.zero(nn.Linear(2, 2), e.m, stage=4, optimizer=_SGD), ValueError,
     ("ZeRO stage must be one of [1, 2, 3], got 4", "1 shards optimizer state")),
    ("zero-built-optimizer", lambda e: sw.zero(nn.Linear(2, 2), e.m, stage=1,
                                               optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1)),
     TypeError, ("not an already built SGD", "functools.partial(torch.optim.AdamW")),
    ("dp-bucket-cap-zero", lambda e: sw.DataParallel(nn.Linear(2, 2), e.m, bucket_cap_mb=0), ValueError,
     ("got 0", "e.g. bucket_cap_mb=25")),
    ("dp-bucket-cap-negative", lambda e: sw.DataParallel(nn.Linear(2, 2), e.m, bucket_cap_mb=-1), ValueError,
     ("got -1", "e.g. bucket_cap_mb=25")),
    ("dp-axis-missing", lambda e: sw.DataParallel(nn.Linear(2, 2), e.m, axis="data"), ValueError,
     ("unknown mesh axis 'data'", "axes ['dp', 'tp']")),
    ("checkpoint-every-zero", lambda e: sw.checkpoint_layers(_gpt(), every=0), ValueError,
     ("got 0", "e.g. every=1")),
    ("checkpoint-nothing-selected", lambda e: sw.checkpoint_layers(nn.Linear(2, 2)), ValueError,
     ("matched no module in Linear", "pass policy=lambda name, module")),
    ("mixed-precision-dtype", lambda e: sw.MixedPrecision(param_dtype="half"), ValueError,
     ("got half", "torch.bfloat16 or torch.float16")),
    # --- collectives ---
    ("comm-algorithm", lambda e: sw.comm.all_reduce(torch.ones(2), e.d, "dp", algorithm="butterfly"), ValueError,
     ("algorithm 'butterfly'", "choose one of ['native', 'ring', 'tree', 'shm', 'auto']")),
    ("comm-op", lambda e: sw.comm.all_reduce(torch.ones(2), e.d, "dp", op="prod"), ValueError,
     ("unknown reduce op 'prod'", "choose one of ['sum', 'avg', 'max', 'min']")),
    ("comm-avg-int", lambda e: sw.comm.all_reduce(torch.ones(2, dtype=torch.int64), e.d, "dp", op="avg"), ValueError,
     ("torch.int64", "use op='sum' and divide")),
    ("comm-broadcast-src", lambda e: sw.comm.broadcast(torch.ones(2), e.d, "dp", src=99), ValueError,
     ("src 99", "use 0..0")),
    ("comm-axis-missing", lambda e: sw.comm.all_reduce(torch.ones(2), e.d, "tp"), ValueError,
     ("unknown mesh axis 'tp'", "this mesh has axes ['dp']")),
    # --- context parallelism (a cp axis of 1: the checks run before the ring; on 4 ranks in
    # tests/dist/test_ring_attention.py::test_bad_inputs_raise_before_communicating) ---
    ("cp-attn-mask", lambda e: sw.context_parallel(_Sdpa(attn_mask=torch.ones(8, 8, dtype=torch.bool)), e.c)(_Q),
     ValueError, ("attn_mask of shape (8, 8)", "pass is_causal=True and no mask")),
    ("cp-dropout", lambda e: sw.context_parallel(_Sdpa(dropout_p=0.1, is_causal=True), e.c)(_Q), ValueError,
     ("dropout_p=0.1", "set dropout 0 with context parallelism")),
    ("cp-ring-dropout", lambda e: sw.ring_attention(_Q, _Q, _Q, e.c, "cp", dropout_p=0.1), ValueError,
     ("dropout_p=0.1", "set dropout 0 with context parallelism")),
    ("cp-sequence-length", lambda e: sw.shard_sequence(torch.zeros(2, 15), e.c, "cp", dim=1), ValueError,
     ("S=15 must be divisible by 2·cp=2", "a multiple of 2")),
    ("cp-unknown-axis", lambda e: sw.context_parallel(_gpt(), e.c, "sp"), ValueError,
     ("axis 'sp' is not an axis of the mesh ('cp',)", "pass axis= one of them")),
    ("cp-applied-twice", lambda e: sw.context_parallel(sw.context_parallel(_gpt(), e.c), e.c), ValueError,
     ("already applied to this model", "apply it once")),
    ("cp-not-module", lambda e: sw.context_parallel(_loss, e.c), TypeError,
     ("got function", "takes an nn.Module")),
    # --- process start-up, models, batches ---
    ("init-timeout", lambda e: sw.init(timeout_s=0), ValueError, ("got 0", "timeout_s must be > 0 seconds")),
    ("init-backend", lambda e: sw.init(backend="mpi"), ValueError, ("got 'mpi'", "backend must be 'gloo' or 'nccl'")),
    ("gpt-shape", lambda e: sw.models.GPTConfig(n_embd=65, n_head=2), ValueError,
     ("n_embd (65) must be divisible by n_head (2)", "e.g. n_embd=64")),
    ("batch-plan", lambda e: BatchPlan.from_sizes(global_batch=10, micro_batch=4), ValueError,
     ("global_batch=10 is not a multiple of micro_batch × dp = 4 × 1 = 4", "use global_batch=8 or 12")),
    # the launch check of optimizer.implementation (a torch whose fused kernels miss the device)
    ("optimizer-fused-device", lambda e: check_implementation(OptimizerConfig(implementation="fused"), "cpu",
                                                              supported=("cuda",)), ValueError,
     ("optimizer.implementation = 'fused'", "not for cpu", "--optimizer.implementation auto")),
]


@pytest.mark.parametrize("call,exc_type,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_api_misuse_raises_one_line_naming_value_and_fix(env, call, exc_type, expected):
    with pytest.raises(exc_type) as info:
        call(env)
    message = str(info.value)
    assert message and "\n" not in message, f"not one line:\n{message}"
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_catalogue_ids_are_distinct() -> None:
    ids = [c[0] for c in CASES]
    assert len(set(ids)) == len(ids)
