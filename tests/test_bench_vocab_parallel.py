"""benchmarks/bench_vocab_parallel.py at a tiny shape in two gloo processes on the CPU: every variant runs on
the ranks it should, the losses agree, and the JSON carries the environment."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]


def test_bench_runs_on_cpu(tmp_path):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path / "vp.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_vocab_parallel.py"), "--device", "cpu", "--shape",
         "48x16x96", "--dtype", "fp32", "--iters", "1", "--warmup", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| flce-vp |" in run.stdout and "| loss_parallel |" in run.stdout
    result = json.loads(out.read_text())
    assert result["env"]["world_size"] == 2 and result["env"]["backend"] == "gloo"
    assert {"torch", "python", "gpu"} <= set(result["env"])
    rows = {row["variant"]: row["ranks"] for row in result["rows"]}
    assert list(rows) == ["flce-vp", "loss_parallel", "flce-1gpu"]
    assert rows["flce-1gpu"][1] == {}  # the single-device reference runs on rank 0 only
    losses = [r["loss"] for ranks in rows.values() for r in ranks if r]
    assert max(losses) - min(losses) < 1e-5, losses
    assert all(r["ms"] > 0 and r["gb"] >= 0 for ranks in rows.values() for r in ranks if r)
