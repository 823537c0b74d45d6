"""What ``shardwise train`` runs: config, trainer, strategies, launch and restarts, metrics.

The data pipeline lives in ``shardwise.data``. Its modules used to live here; the old import paths
(``shardwise.runtime.prepare``, ``shardwise.runtime.prepared``, ``shardwise.runtime.data``, ...) still import,
as the same module objects, through the finder below, so code written against them keeps working.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

MOVED: dict[str, str] = {
    "prepare": "prepare", "prepare_inputs": "inputs", "prepare_worker": "encode_worker",
    "prepare_pool": "worker_pool", "prepare_tokenizer": "tokenizer_info", "prepare_write": "shard_writer",
    "prepared": "prepared", "corpus": "corpus", "toy_tokenizer": "toy_tokenizer", "data": "windows",
    "train_data": "sources",
}
"""Old module name under ``shardwise.runtime`` → its name under ``shardwise.data``."""


class _MovedLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)  # the one module object, under both names

    def exec_module(self, module: ModuleType) -> None:
        return None  # already executed under its own name


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        prefix, _, leaf = fullname.rpartition(".")
        if prefix != __name__ or leaf not in MOVED:
            return None
        new = f"shardwise.data.{MOVED[leaf]}"
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader(new))


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedFinder())
