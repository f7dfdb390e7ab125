"""benchmarks/reduce_overhead.py on the CPU at a tiny shape (CUDA-graph trees run on a GPU only: there the same code
counts the tensors they rebuild and the memory a step takes)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import reduce_overhead


def test_reduce_overhead_runs_on_the_cpu(tmp_path):
    result = reduce_overhead.main(["--device", "cpu", "--variants", "flce-in-compile, in-place scale", "--calls", "4",
                                   "--rounds", "2", "--warmup", "2", "--out", str(tmp_path)])
    assert list(result["timings"]) == ["compile", "flce-in-compile, in-place scale"]  # the baseline always runs
    assert all(row["host_ms"] > 0 and row["rebuilt_per_step"] == 0 for row in result["timings"].values())
    assert result["paired"]["flce-in-compile, in-place scale"]["rounds"] == 2
    saved = json.loads((tmp_path / "reduce_overhead_cpu.json").read_text())
    assert saved["env"]["torch"] == torch.__version__
    table = (tmp_path / "reduce_overhead_cpu.md").read_text()
    assert "| compile | " in table and "| flce-in-compile, in-place scale | " in table


def test_paired_ratios_are_taken_round_by_round():
    rows = {"compile": {"rounds": {"host_ms": [1.0, 2.0, 4.0]}},
            "flce-in-compile": {"rounds": {"host_ms": [1.1, 1.8, 4.0]}}}
    out = reduce_overhead.paired_ratios(rows)
    assert set(out) == {"flce-in-compile"}
    assert out["flce-in-compile"]["median_ratio"] == pytest.approx(1.0)
    assert out["flce-in-compile"]["rounds_no_slower"] == 2 and out["flce-in-compile"]["rounds"] == 3


def test_the_benchmark_leaves_the_process_as_it_found_it():
    """main() turns the compile caches off and torch to one thread for its run only (a review found them left so
    for the rest of the test session)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    before = (inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache, torch.get_num_threads())
    with reduce_overhead._no_compile_caches():
        assert not inductor_config.fx_graph_cache and not functorch_config.enable_autograd_cache
    assert (inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache, torch.get_num_threads()) == before
