"""benchmarks/lora_head.py on the CPU at a small size: the flce step is the folded, fused one and matches eager's;
the peaks and times it reports are measured; the table shows them."""

from __future__ import annotations

import torch

from benchmarks import lora_head


def test_run_measures_each_variant_and_the_fold_fuses():
    row = lora_head.run(64, 200, 32, 4, torch.float32, torch.device("cpu"), reps=1, variants=("eager", "flce"),
                        inner="aot_eager")
    assert row["flce_path"] == "fused"
    for name in ("eager", "flce"):
        assert row[name]["peak_bytes"] > 0 and row[name]["ms"] > 0
    assert max(row["flce_vs_eager_max_abs"].values()) < 1e-4, row["flce_vs_eager_max_abs"]
    text = lora_head.table({"env": {"device": "cpu", "torch": "2.13", "date": "2026-12-05"},
                            "args": {"vocab": 200, "hidden": 32, "rank": 4, "dtype": "fp32"}, "rows": [row]})
    assert "| eager MB / ms | flce MB / ms | flce path |" in text and "| 64 | " in text and "| fused |" in text
