"""benchmarks/ce_gemm_overlap.py without a GPU: its refusal and its table (the numbers come from an H200)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import ce_gemm_overlap


def test_needs_cuda_and_checks_its_arguments(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        ce_gemm_overlap.main([])
    with pytest.raises(SystemExit):
        ce_gemm_overlap.main(["--shapes"])
    assert "unrecognized arguments: --shapes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ce_gemm_overlap.main(["--carveout", "0"])
    assert "positive SM counts" in capsys.readouterr().err


def test_carveout_is_set_and_restored():
    """The carveout context sets the SM count torch's cuBLASLt GEMMs leave free and the preferred library, and
    restores both, also when the body raises."""
    if not hasattr(torch._C, "_set_sm_carveout_experimental"):
        pytest.skip("this torch has no SM carveout")
    def state():
        return torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library()

    before = state()
    with pytest.raises(ValueError):
        with ce_gemm_overlap.sm_carveout(8, "default"):
            assert torch._C._get_sm_carveout_experimental() == 8
            raise ValueError("body fails")
    assert state() == before
    try:
        with ce_gemm_overlap.sm_carveout(4, "cublaslt"):
            assert state() == (4, torch._C._BlasBackend.Cublaslt)
    except RuntimeError as exc:  # a torch built without cuBLASLt (the CPU wheel) refuses the library
        assert "cuBLASLt" in str(exc)
    assert state() == before


def test_table_reports_the_hidden_share():
    result = {"kernels": {"128256x4096": {"gemm": 6.0, "ce": 1.0, "one_stream": 7.0, "two_streams": 6.5}},
              "whole_op": {"16384x4096x128256": {"streams=False warps=8": 80.0, "streams=True warps=8": 79.0}}}
    text = ce_gemm_overlap.table(result)
    assert "| 128256x4096 | 6.000 | 1.000 | 7.000 | 6.500 | 50% |" in text
    assert "| 16384x4096x128256 | 80.0 | 79.0 |" in text and "streams=True warps=8" in text
    assert "SMs left free" not in text  # no carveout rows asked for


def test_table_reports_the_carveout_rows_and_why_some_are_missing():
    kernels = {"128256x4096": {"gemm": 6.0, "ce": 1.0, "one_stream": 7.0, "two_streams": 6.9,
                               "carveout": {"8/default": {"gemm": 6.0, "two_streams": 6.95},
                                            "8/cublaslt": {"gemm": 6.3, "two_streams": 6.5}}},
               "256000x2304": {"gemm": 7.0, "ce": 2.0, "one_stream": 9.0, "two_streams": 8.5, "carveout": {},
                               "carveout_error": "this torch has no SM carveout for matmuls"}}
    text = ce_gemm_overlap.table({"kernels": kernels, "whole_op": {}})
    assert "| 128256x4096 | 8/cublaslt | 6.300 (6.000) | 6.500 | +0.500 |" in text
    assert "| 128256x4096 | 8/default | 6.000 (6.000) | 6.950 | +0.050 |" in text
    assert "carveout not measured: this torch has no SM carveout for matmuls" in text
    assert "BT x H x V" not in text  # --skip-whole-op: no whole-op table
