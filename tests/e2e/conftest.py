"""Session fixtures shared by e2e modules that compare against the same runs (``prepared_runs.py``): built once
for the session instead of once per module."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.lora_runs import LoraRuns
from tests.e2e.prepared_runs import ONE, make_data, train_run


@pytest.fixture(scope="session")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The prepared datasets of ``prepared_runs.make_data`` (``ds``, ``sft``), skipped without tokenizers."""
    pytest.importorskip("tokenizers")
    return make_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="session")
def sft_one(data: Path) -> tuple[dict, list, str]:
    """The one-process run on the loss-masked dataset (``SMALL``, run ``sft-one``): losses, evals, stdout — the
    reference of every layout trained on ``sft``."""
    return train_run(data, "sft", "sft-one", ONE)


@pytest.fixture(scope="session")
def lora_runs(tmp_path_factory: pytest.TempPathFactory) -> LoraRuns:
    """LoRA runs on a pretrained Llama (``lora_runs.py``), each layout trained once for the session; skipped
    without transformers and peft."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    return LoraRuns(tmp_path_factory.mktemp("lora"))
