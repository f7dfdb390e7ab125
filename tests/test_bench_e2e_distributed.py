"""benchmarks/bench_e2e_distributed.py on the CPU: the script's own launcher, two gloo ranks per row, a tiny model
of the benchmark's shape family (2 layers, H 32, V 128, S 16, gradient checkpointing), DDP and FSDP2, eager and
``backend="flce"``: the JSON's rows, every rank's numbers, the pass's fused site, and each rank's first-step loss
against one process without DDP / FSDP2 at fp32 tolerance; a variant that cannot run gives a row, not a hang.

The flce rows use ``--flce-inner aot_eager``: Inductor's C++ build of the compiled graphs takes minutes on a
small CPU, and what is tested here is the rewrite under DDP / FSDP2 and the benchmark's plumbing; the GPU run
uses Inductor, as users do.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
SHAPE = {"vocab": 128, "hidden": 32, "layers": 2}
SEQ = 16
CPU_ARGS = ["--device", "cpu", "--nproc", "2", "--seq", str(SEQ), "--layers", "2", "--hidden", "32", "--vocab", "128",
            "--warmup", "1", "--steps", "1", "--mask", "as-is", "--flce-inner", "aot_eager", "--timeout", "240"]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_e2e_distributed",
                                                  REPO / "benchmarks" / "bench_e2e_distributed.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _needs_gloo() -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")


def test_run_order_and_table():
    """Per mode, bench_e2e.py's order (as-is rows first, the compiled variants again with the mask patch,
    Liger last); the table's loss reference and fused-site column."""
    bench = _bench()
    runs = bench.plan_runs(["ddp", "fsdp2"], ["flce", "flce-drop", "liger-flce"], "both")
    per_mode = [("flce", "as-is"), ("flce-drop", "as-is"), ("flce", "patched"), ("flce-drop", "patched"),
                ("liger-flce", "as-is")]
    assert runs == [(mode, v, m) for mode in ("ddp", "fsdp2") for v, m in per_mode]
    rows = [{"mode": "ddp", "mask": "as-is", "variant": "flce", "seq": 8, "status": "ok", "step_ms": 2.0,
             "first_step_s": 1.0, "loss": 3.0, "losses": [3.0, 4.0], "flce_sites": ["flce: loss l -> fused_keep"],
             "dynamo": {"graphs": 3, "graph_breaks": 2}},
            {"mode": "ddp", "mask": "as-is", "variant": "eager", "seq": 8, "status": "ok", "step_ms": 2.0,
             "first_step_s": 1.0, "loss": 3.5, "losses": [3.5, 4.0], "flce_sites": []},
            {"mode": "ddp", "mask": "as-is", "variant": "liger-flce", "seq": 8, "status": "OOM"}]
    bench.add_loss_deltas(rows)
    assert rows[0]["loss_ref"] == "ddp as-is eager" and rows[0]["max_abs_loss_diff"] == 0.5
    table = bench.table(rows, world=2)
    assert "against ddp as-is eager" in table and "as users run it" in table
    assert "| ddp | as-is | flce | ok |" in table and "| 1/1 | 3 / 2 |" in table
    assert "| ddp | as-is | liger-flce | OOM | nan |" in table


def test_ddp_and_fsdp2_rows_match_one_process(tmp_path):
    """Both modes, eager and flce, two gloo ranks each: every row ran on both ranks, flce fused the loss, and
    each rank's first-step loss equals one process's on that rank's tokens. Without liger-kernel, liger-flce
    rows say so instead of hanging (both ranks fail before any collective, exit, and the run goes on).

    The script runs as users run it, in its own process: its ranks are forked on the CPU, which is only safe
    from a process with no other threads (pytest's may have some from earlier tests)."""
    _needs_gloo()
    bench = _bench()
    liger = importlib.util.find_spec("liger_kernel") is not None  # GPU kernels: the GPU run covers liger-flce
    variants = ["eager", "flce"] + ([] if liger else ["liger-flce"])
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_e2e_distributed.py"), *CPU_ARGS,
                           "--modes", "ddp", "fsdp2", "--variants", *variants, "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| fsdp2 | as-is | flce | ok |" in proc.stdout  # the table, printed last
    data = json.loads((tmp_path / "run.json").read_text())
    rows = data["rows"]
    assert [(r["mode"], r["mask"], r["variant"]) for r in rows] == [
        (mode, "as-is", v) for mode in ("ddp", "fsdp2") for v in variants]
    assert data["env"]["world"] == 2 and data["env"]["transformers"] == transformers.__version__
    assert {"torch", "python", "device"} <= set(data["env"])
    assert data["args"]["flce_inner"] == "aot_eager" and data["args"]["mask"] == "as-is"
    assert (tmp_path / "run.md").read_text().count("| ok |") == 4

    model = bench.bench_e2e.build_model("cpu", torch.float32, **SHAPE)
    with torch.no_grad():
        ref = [float(model(input_ids=ids, labels=ids).loss) for ids in (bench.rank_ids(r, SEQ, 128) for r in (0, 1))]
    for row in rows:
        name = f"{row['mode']} {row['variant']}"
        if row["variant"] == "liger-flce":
            assert row["status"].startswith("unavailable: liger_kernel not importable"), row
            continue
        assert row["status"] == "ok", (name, [r.get("traceback") for r in row["ranks"]])
        assert [r["rank"] for r in row["ranks"]] == [0, 1]
        assert all(r["status"] == "ok" and len(r["step_ms_all"]) == 1 for r in row["ranks"]), name
        assert row["step_ms"] == max(r["step_ms"] for r in row["ranks"])
        assert "peak_gb" not in row  # no CUDA: no peak to report, rather than a wrong one
        torch.testing.assert_close(row["losses"], ref, rtol=1e-5, atol=1e-6, msg=name)
        assert row["loss_ref"] == "ddp as-is eager" and row["max_abs_loss_diff"] < 1e-5, name
        if row["variant"] == "flce":
            assert bench.fused_sites(row) == "1/1", (name, row["flce_sites"])
            assert "-> fused_lazy" in row["flce_sites"][0], name  # no options: logits computed when read
            assert row["dynamo"]["graphs"] >= 1, name


def test_ddp_peak_needs_the_bucket_rebuild_warmed_up():
    """On CUDA, DDP rows refuse --warmup < 2: step 2 rebuilds the gradient buckets and its peak is not a steady
    step's. The check comes before any GPU is looked at, so it runs here."""
    bench = _bench()
    with pytest.raises(SystemExit) as info:
        bench.main(["--modes", "ddp", "--warmup", "1"])
    assert info.value.code == 2
