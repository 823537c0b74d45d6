"""Re-predict a stored ``shardwise bench planner --measured`` campaign (its ``--json FILE``) with this code and
the campaign's calibration files: nothing is trained. Pure except for reading the stored JSON. Run by
``python benchmarks/planner_rescore.py JSON --hardware FILES``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from shardwise.bench.planner_measured import LAYOUTS, layout_config, measured_table, predict_layout
from shardwise.planner import Hardware

__all__ = ["rescore"]


def rescore(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """Re-predict a stored ``--measured`` campaign (its JSON) with this code and ``--hardware``: nothing runs."""
    path = Path(args.rescore)
    if not path.is_file():
        raise ValueError(f"{args.rescore}: no such file; give the JSON a campaign wrote "
                         "(`shardwise bench planner --measured ... --json FILE`)")
    try:
        stored = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{args.rescore} is not JSON ({exc}); give the JSON a campaign wrote "
                         "(`shardwise bench planner --measured ... --json FILE`)") from None
    if not isinstance(stored, dict) or not isinstance(stored.get("measured"), list):
        raise ValueError(f"{args.rescore} is not the JSON of `shardwise bench planner --measured --json FILE` "
                         "(no 'measured' list)")
    unknown = [r.get("layout") for r in stored["measured"] if r.get("layout") not in dict(LAYOUTS)]
    if unknown:
        raise ValueError(f"{args.rescore}: layouts {unknown} are not this version's; known: {[n for n, _ in LAYOUTS]}")
    by_ranks = {h.devices_per_node: h for h in (Hardware.resolve(f.strip()) for f in args.hardware.split(",")
                                                 if f.strip())}
    rows = []
    for old in stored["measured"]:
        cfg = layout_config(old["layout"])
        if cfg.parallel.nproc not in by_ranks:
            raise ValueError(f"layout {old['layout']!r} runs {cfg.parallel.nproc} ranks but --hardware has "
                             f"calibrations for {sorted(by_ranks)} ranks; add the campaign's file for "
                             f"{cfg.parallel.nproc} ranks")
        seconds, pmem, dominant = predict_layout(cfg, by_ranks[cfg.parallel.nproc])
        rows.append({**old, "predicted_s": seconds, "predicted_mem": pmem, "dominant": dominant})
    return measured_table(rows), {"measured": rows}
