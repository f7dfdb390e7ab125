"""benchmarks/ce_kernel_tiles.py on the CPU, through Triton's interpreter at tiny shapes (the GPU table comes
from the same code on a GPU)."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import ce_kernel_tiles

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def test_tiles_are_timed_checked_and_rejected_where_invalid(tmp_path):
    results = ce_kernel_tiles.main(["--device", "cpu", "--rows", "3", "--vocabs", "300", "--tiles", "128:4", "256:4",
                                    "4096:4", "--reps", "1", "--out", str(tmp_path)])
    (row,) = results
    assert row["ms"]["4096:4"] is None  # block_v > next_pow2(300): the registry rejects it
    assert row["ms"]["128:4"] > 0 and row["ms"]["256:4"] > 0
    assert row["best_tile"] in ("128:4", "256:4")
    # every timed tile computed the right loss (bf16 logits, fp32 math against fp32 torch)
    assert set(row["loss_err"]) == {"128:4", "256:4"} and max(row["loss_err"].values()) < 1e-4
    saved = json.loads((tmp_path / "ce_kernel_tiles_cpu.json").read_text())
    assert saved["env"]["device"] == "cpu" and saved["results"][0]["vocab"] == 300
    table = (tmp_path / "ce_kernel_tiles_cpu.md").read_text()
    assert "| 3x300 |" in table and "| 128:4 |" in table


def test_bad_tile_is_a_clear_error():
    with pytest.raises(SystemExit):
        ce_kernel_tiles.main(["--device", "cpu", "--tiles", "4096"])


def test_lane_pass_flag_times_the_lane_wise_kernel_and_restores_the_switch(tmp_path):
    from flce_compile.strategies import ce_triton

    before = ce_triton.LANE_PASS
    results = ce_kernel_tiles.main(["--device", "cpu", "--rows", "3", "--vocabs", "300", "--tiles", "128:4", "--reps",
                                    "1", "--lane-pass", "--tag", "_lanes", "--out", str(tmp_path)])
    assert ce_triton.LANE_PASS is before
    (row,) = results
    assert row["lanes"] == {"128:4": 16}  # 128 logits a block, 8 a lane
    assert row["loss_err"]["128:4"] < 1e-4
    saved = json.loads((tmp_path / "ce_kernel_tiles_cpu_lanes.json").read_text())
    assert saved["env"]["lane_pass"] is True
    assert "Pass 1 lane-wise" in (tmp_path / "ce_kernel_tiles_cpu_lanes.md").read_text()
