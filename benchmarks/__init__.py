"""Measurement-campaign tooling and the published tables the planner is checked against.

Not part of the installed package (``pip install .`` ships ``shardwise/`` only): the scripts here run from a
checkout, e.g. ``python benchmarks/planner_published.py``; the tests import ``benchmarks.planner`` and
``benchmarks.faults`` from the repository root. The benchmarks a user runs on their own machine are
``shardwise bench KIND``.
"""
