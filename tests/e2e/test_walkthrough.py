"""The offline walk-through of docs/data.md, run as written (``examples/data/walkthrough.sh``, fewer steps): a tokenizer
trained here → ``shardwise prepare`` → ``shardwise train --parallel.auto true`` with validation → ``shardwise
generate`` → ``shardwise export --format hf`` → transformers loads the export and decodes greedily the same text."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "data" / "walkthrough.sh"
STEPS = 40


def test_walkthrough_runs_and_the_export_decodes_like_generate(tmp_path: Path):
    env = {**os.environ, "STEPS": str(STEPS), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "stdlib" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r.get("kind") == "eval"]
    assert [e["step"] for e in evals] == [10, 20, 30, 40]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.2, evals  # the validation loss falls
    assert "parallel.auto chose" in proc.stdout
    # shardwise generate (greedy, KV cache) and transformers on the export decode the same continuation
    ours = subprocess.run([sys.executable, "-m", "shardwise.cli", "generate", "runs/stdlib", "--prompt", "import ",
                           "--max-new-tokens", "24", "--temperature", "0", "--json"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert ours.returncode == 0, ours.stderr
    theirs = subprocess.run([sys.executable, str(SCRIPT.parent / "check_export.py"), "export/stdlib", "--prompt",
                             "import ", "--max-new-tokens", "24"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert theirs.returncode == 0, theirs.stderr
    record = json.loads(ours.stdout)
    assert theirs.stdout.rstrip("\n") == (record["prompt"] + record["completion"]).rstrip("\n")
    assert (tmp_path / "export" / "stdlib" / "tokenizer.json").is_file()


def test_docs_walkthrough_is_the_script():
    """Every command of the script appears, as written, in the walk-through of docs/data.md."""
    doc = (ROOT / "docs" / "data.md").read_text()
    section = doc[doc.index("## Walk-through"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = [line.strip() for line in SCRIPT.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith(("#", "set ", "HERE=", "STEPS="))]
    for line in commands:
        assert line in block, line
