"""The data pipeline lives in ``shardwise.data``; the import paths it had under ``shardwise.runtime`` still work."""

from __future__ import annotations

import importlib

import pytest

from shardwise.runtime import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_runtime_path_is_the_same_module(old: str):
    legacy = importlib.import_module(f"shardwise.runtime.{old}")
    assert legacy is importlib.import_module(f"shardwise.data.{MOVED[old]}")


def test_from_import_of_a_moved_name():
    from shardwise.runtime.data import TokenWindows
    from shardwise.runtime.prepared import open_prepared

    import shardwise.data as data
    assert TokenWindows is data.TokenWindows and open_prepared is data.open_prepared


def test_unknown_runtime_module_still_fails():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("shardwise.runtime.no_such_module")


def test_runtime_holds_no_data_module():
    from pathlib import Path
    runtime = Path(importlib.import_module("shardwise.runtime").__file__).parent
    assert not [m for m in MOVED if (runtime / f"{m}.py").exists()]
