"""benchmarks/dw_final_gemm.py on the CPU, through Triton's interpreter: its rows for one small last chunk (partial
tiles in every dimension) must time both paths on the same operands and find the kernel's dW as exact as cuBLAS's
path against fp64, else the GPU table would compare a wrong kernel."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def test_rows_of_one_small_chunk():
    from benchmarks.dw_final_gemm import make_operands, run_shape
    from flce_compile.strategies.dw_final import DwGemmTile

    ops = make_operands(24, 32, 100, device="cpu")
    assert ops["grad"].shape == (24, 128) and not ops["grad"][:, 100:].any()  # V padded to 128 bytes, zeros
    tile = DwGemmTile(block_m=32, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1)
    lines, data = run_shape("24x32x100", reps=1, tiles=(tile,), device="cpu")
    assert [line.split(" | ")[1] for line in lines] == ["cuBLAS addmm + round", "cuBLAS addmm alone", "round alone",
                                                        f"Triton {tile.label()}"]
    (row,) = data["triton"]
    assert row["ms"] > 0 and data["round_ms"] > 0
    # both round the same fp32 sums once (at this size, to the same bits)
    assert 0 < data["cublas_error"] < 2.0**-8 and row["error"] == data["cublas_error"]
    assert row["differ_from_cublas"] == 0
