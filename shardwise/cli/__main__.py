"""``python -m shardwise.cli ...`` (what the tests and the benchmarks' workers run)."""

from . import entry

entry()
