"""LoRA in every layout against peft's LoRA on one process: the table of RESULTS "Fine-tuning".

    python benchmarks/lora_parity.py

Runs the checks of tests/dist/lora_checks.py (a transformers Llama, 2 layers × 32, LoRA r = 4 on all seven
projections, B drawn at random so both factors train, 3 SGD steps, fp32) on worlds of 2 and 4 CPU ranks and prints,
per layout, the largest relative error of the losses and of the adapters against peft, and whether every base
tensor is bit-identical to its start.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardwise.testing.local_world import LocalWorld  # noqa: E402
from tests.dist import lora_checks as lc  # noqa: E402

CASES = [("peft model, sw.parallelize tp 2", 2, lc.check_peft_tp, ()),
         ("peft model, sw.DataParallel dp 2", 2, lc.check_peft_dp, ()),
         ("peft model, sw.zero stage 3, dp 2", 2, lc.check_peft_zero3, ()),
         ("peft model, graph pipeline pp 2 (1F1B)", 2, lc.check_peft_pp, ()),
         ("our Llama + sw.apply_lora, tp 2", 2, lc.check_ours_layouts, ("tp2",)),
         ("our Llama + sw.apply_lora, pp 2 (1F1B)", 2, lc.check_ours_layouts, ("pp2",)),
         ("our Llama + sw.apply_lora, tp 2 x dp 2", 4, lc.check_tp2dp2, ())]


def main() -> None:
    rows = []
    for size in (2, 4):
        world = LocalWorld(size, collective_timeout_s=120)
        try:
            for name, n, fn, args in CASES:
                if n == size:
                    outs = world.run(fn, *args)
                    rows.append((name, max(o["loss_err"] for o in outs), max(o["adapter_err"] for o in outs),
                                 all(o["base_same"] for o in outs)))
        finally:
            world.close()
    print(f"{'layout':42}{'loss rel err':>14}{'adapter rel err':>17}  base bit-identical")
    for name, loss, adapter, same in rows:
        print(f"{name:42}{loss:14.1e}{adapter:17.1e}  {same}")


if __name__ == "__main__":
    main()
