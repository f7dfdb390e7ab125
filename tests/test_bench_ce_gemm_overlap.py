"""benchmarks/ce_gemm_overlap.py without a GPU: its refusal and its table (the numbers come from an H200)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import ce_gemm_overlap


def test_needs_cuda_and_takes_no_arguments(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        ce_gemm_overlap.main([])
    with pytest.raises(SystemExit, match="no arguments"):
        ce_gemm_overlap.main(["--shapes"])


def test_table_reports_the_hidden_share():
    result = {"kernels": {"128256x4096": {"gemm": 6.0, "ce": 1.0, "one_stream": 7.0, "two_streams": 6.5}},
              "whole_op": {"16384x4096x128256": {"streams=False warps=8": 80.0, "streams=True warps=8": 79.0}}}
    text = ce_gemm_overlap.table(result)
    assert "| 128256x4096 | 6.000 | 1.000 | 7.000 | 6.500 | 50% |" in text
    assert "| 16384x4096x128256 | 80.0 | 79.0 |" in text and "streams=True warps=8" in text
