"""Loss-masked data (supervised fine-tuning) and the validation pass, in every layout, against one device.

The one-device reference is plain torch, not our trainer: the SMALL GPT with the same initial weights, the whole
global batch in one forward, ``F.cross_entropy(..., reduction="sum", ignore_index=-100) / N`` (``N``: the counted
targets of the step) and ``torch.optim.SGD``. Every layout must give the same step losses (the token-weighted
mean), the same weights after the steps, and the same validation sums (Σ CE over counted targets and their
count) — whatever number of counted tokens each micro-batch, rank or pipeline micro-batch happens to hold.
A mean of per-micro-batch means (what the layouts' plain losses compute) misses these numbers by far more than
the tolerances (asserted below), so the test fails if the token weighting is lost.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwise.models.gpt import GPT
from shardwise.runtime.config import load_config, validate
from tests.dist import token_checks as tc

LOSS_RTOL = 1e-5
PARAM_ATOL = 2e-5


def _reference(overrides: dict[str, str]) -> dict:
    cfg = validate(load_config(overrides={**tc.SMALL, **overrides, "parallel.nproc": "1"}))
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optimizer.lr, momentum=cfg.optimizer.beta1)
    losses, naive = [], []
    for s in range(tc.STEPS):
        x, y = tc.masked_batch(100 + s)
        logits = model(x)
        total = F.cross_entropy(logits.reshape(-1, tc.V), y.reshape(-1), reduction="sum", ignore_index=-100)
        loss = total / int((y != -100).sum())
        # what a mean of per-micro-batch means would report (micro-batches of 2 rows; empty ones count 0)
        parts = [F.cross_entropy(logits[i:i + 2].reshape(-1, tc.V), y[i:i + 2].reshape(-1), ignore_index=-100)
                 for i in range(0, tc.G, 2)]
        naive.append(float(torch.stack([p.detach() for p in parts if p.isfinite()]).mean()))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    x, y = tc.masked_batch(7, 2 * tc.G)
    with torch.no_grad():
        val = F.cross_entropy(model(x).reshape(-1, tc.V), y.reshape(-1), reduction="sum", ignore_index=-100)
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "naive": naive, "params": params, "val": (float(val), int((y != -100).sum()))}


def _check(name: str, res: dict, ref: dict) -> None:
    assert res["losses"] == pytest.approx(ref["losses"], rel=LOSS_RTOL), (name, res["losses"], ref["losses"])
    for k, want in ref["params"].items():
        err = float((res["params"][k] - want).abs().max())
        assert err <= PARAM_ATOL, (name, k, err)
    total, count = res["val"]
    assert count == ref["val"][1], (name, count, ref["val"][1])
    assert total == pytest.approx(ref["val"][0], rel=LOSS_RTOL), (name, total, ref["val"][0])
    assert not res["grads_touched"], name


@pytest.fixture(scope="module")
def refs() -> dict[str, dict]:
    return {"n_layer2": _reference({}), "n_layer4": _reference({"model.n_layer": "4"})}


def _ref_for(name: str, refs: dict[str, dict]) -> dict:
    layouts = {**tc.LAYOUTS, **tc.HYBRIDS}
    return refs["n_layer4" if layouts[name].get("model.n_layer") == "4" else "n_layer2"]


def test_reference_is_not_the_naive_mean(refs):
    """The token-weighted loss differs from a mean of micro-batch means on these batches (else the test is void)."""
    ref = refs["n_layer2"]
    assert abs(ref["losses"][0] - ref["naive"][0]) > 100 * LOSS_RTOL * ref["losses"][0], ref


@pytest.mark.parametrize("ranks", [2, 4])
def test_masked_loss_and_validation_in_every_layout(worlds, refs, ranks: int):
    names = list(tc.LAYOUTS if ranks == 2 else tc.HYBRIDS)
    per_rank = worlds.get(ranks).run(tc.check_layouts, names, timeout=360)
    for k, name in enumerate(names):
        for results in per_rank:
            _check(name, results[k], _ref_for(name, refs))
