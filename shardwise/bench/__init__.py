"""The user benchmarks of ``shardwise bench KIND``: one module per kind, measured on the user's own machine
(``comm``, ``dp``, ``sbp``, ``tp``, ``pp``, ``zero``, ``planner``, ``auto``, ``prepare``, ``moe``), with their shared
launch harness (``harness.py``). The measurement campaigns behind ``benchmarks/RESULTS.md`` are scripts in the
repository's ``benchmarks/`` folder, not part of the package."""
