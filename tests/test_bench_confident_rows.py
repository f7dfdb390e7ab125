"""benchmarks/confident_rows.py on the CPU: its inputs are sure of the class they say, and a small run's rows are
within eager's error. (The CPU's vocabulary blocks round as the forward's GEMM, so this run passes whether or not the
recompute backward forms the target's and the largest class's probabilities from the forward's z; that is
test_strategy_recompute.py's test_recompute_backward_takes_the_kept_z_of_each_rows_largest_class.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("confident_rows", REPO / "benchmarks" / "confident_rows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_inputs_are_sure_of_the_class_they_say():
    bench = _bench()
    for sure_of in bench.SURE_OF:
        x, w, t = bench.confident_inputs(64, 32, 100, 16.0, sure_of, "cpu")
        top = (x @ w.t()).argmax(dim=1)
        assert bool((top == t).all()) is (sure_of == "target"), sure_of
        if sure_of != "target":
            assert bool((top != t).all())
    with pytest.raises(ValueError, match="sure_of='both'"):
        bench.confident_inputs(4, 4, 8, 1.0, "both", "cpu")


def test_a_small_run_is_within_eagers_error():
    """Every row within eager's error; rows sure of their target far below it: the CPU's torch step forms the
    target's p - 1 as expm1(z_t - lse), where eager's p - 1 keeps p's rounding at 1 (dW 1.37x eager's error at a
    margin of 24 on an AVX2 CPU, whose sums run in another order than an AVX-512 one's, before 2026-12-07)."""
    bench = _bench()
    rows = bench.measure((128, 32, 200), [torch.float32], [16.0, 24.0], 48, 64, "cpu")
    assert len(rows) == 2 * 2 * 2  # sure of, margins, variants
    for r in rows:
        assert r["dx"] <= 1.35 * r["eager_dx"] and r["dw"] <= 1.35 * r["eager_dw"], r
        if r["sure_of"] == "target":  # (measured 0.002-0.01x eager's)
            assert r["dx"] <= 0.05 * r["eager_dx"] and r["dw"] <= 0.05 * r["eager_dw"], r
    md = bench.table(rows)
    assert md.count("\n") == len(rows) + 1 and "| float32 | another class | 24 | recompute |" in md
    assert bench._ratio(1e-3, 1.0) == "1.0e-03" and bench._ratio(0.5, 1.0) == "0.50"
