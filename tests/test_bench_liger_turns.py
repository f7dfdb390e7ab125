"""benchmarks/liger_turns.py on the CPU: its table and its refusal without a GPU (the timings need CUDA)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import liger_turns


def test_table_reports_each_variant_against_liger():
    result = {"env": {"device": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "liger_kernel": "0.8.5",
                      "date": "2026-12-01"},
              "rounds": 4, "calls": 3,
              "shapes": {"129280x7168x65536": {"db": {"ms": 546.7, "least_ms": 545.1, "peak_gb": 5.83},
                                               "liger": {"ms": 547.2, "least_ms": 545.9, "peak_gb": 1.06}}}}
    text = liger_turns.table(result)
    assert "4 rounds of 3 calls" in text
    assert "| 129280x7168x65536 | db | 546.7 | 545.1 | 5.83 | 1.001x |" in text
    assert "| 129280x7168x65536 | liger | 547.2 | 545.9 | 1.06 | 1.000x |" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_cuda():
    with pytest.raises(SystemExit, match="needs a GPU"):
        liger_turns.main(["--shapes", "64x16x64"])
