"""``python -m shardwise.cli ...`` (what the tests and the benchmarks' workers run)."""

import sys

from .main import main

sys.exit(main())
