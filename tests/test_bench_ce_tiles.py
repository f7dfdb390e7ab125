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
