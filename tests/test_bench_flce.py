"""benchmarks/bench_flce.py's ratio to the floor: each variant against a floor timed right before it, paired by
round (CPU: the GPU timers are replaced by scripted ones), the floor's GEMMs on the loss's own logit gradient."""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytest.importorskip("triton")  # bench_flce times with triton.testing (_common.do_bench_ms)

import benchmarks.bench_flce as bench  # noqa: E402


def _scripted(monkeypatch, floors, variants):
    """Replace the timers by the given sequences; return the order in which they were called."""
    calls = []
    floors, variants = iter(floors), iter(variants)

    def time_floor(x, w, t):
        calls.append("floor")
        return next(floors)

    def time_fwd_bwd(fn, x, w, t):
        calls.append("variant")
        # Later rounds' GB differs either way (leftovers of earlier rounds in the base): only the first is the call's.
        return next(variants), 0.5 if calls.count("variant") == 1 else 0.7

    monkeypatch.setattr(bench, "time_floor", time_floor)
    monkeypatch.setattr(bench, "time_fwd_bwd", time_fwd_bwd)
    return calls


def test_each_round_times_the_floor_right_before_the_variant(monkeypatch):
    calls = _scripted(monkeypatch, [10.0, 10.0, 10.0], [11.0, 11.0, 11.0])
    bench.time_against_floor(None, None, None, None, turns=3)
    assert calls == ["floor", "variant"] * 3


def test_the_ratio_is_the_median_of_the_rounds_own_ratios(monkeypatch):
    # A floor that drifts with the variant: each round's ratio is 1.05, whatever the ratio of the medians says.
    _scripted(monkeypatch, [100.0, 104.0, 90.0], [105.0, 109.2, 94.5])
    got = bench.time_against_floor(None, None, None, None, turns=3)
    assert got["x_floor"] == pytest.approx(1.05)
    assert got["ms"] == 105.0 and got["floor_ms"] == 100.0 and got["turns"] == 3
    assert got["gb"] == 0.5  # the first round's peak
    assert got["ms"] / got["floor_ms"] == pytest.approx(1.05)  # here equal; below, the medians pair apart
    _scripted(monkeypatch, [100.0, 90.0, 80.0], [120.0, 100.0, 99.0])  # ratios 1.2, 1.111, 1.2375
    got = bench.time_against_floor(None, None, None, None, turns=3)
    assert got["x_floor"] == pytest.approx(1.2)
    assert got["round_ratios"] == pytest.approx([1.2, 100.0 / 90.0, 99.0 / 80.0])
    assert got["ms"] / got["floor_ms"] == pytest.approx(100.0 / 90.0)


def test_one_turn_is_one_pair(monkeypatch):
    calls = _scripted(monkeypatch, [2.0], [2.5])
    got = bench.time_against_floor(None, None, None, None)
    assert calls == ["floor", "variant"]
    assert got["x_floor"] == pytest.approx(1.25) and got["floor_ms"] == 2.0


def test_zero_turns_is_an_error_that_names_the_argument():
    with pytest.raises(ValueError, match="turns=0"):
        bench.time_against_floor(None, None, None, None, turns=0)


def test_main_passes_the_turns_and_the_row_floor_is_the_median_of_the_variants_floors(tmp_path, monkeypatch):
    # Three variants, three turns each; each variant's floors read 10, 30 and 20 ms.
    floors = [10.0] * 3 + [30.0] * 3 + [20.0] * 3
    _scripted(monkeypatch, floors, [11.0] * 9)
    monkeypatch.setattr(bench, "__file__", str(tmp_path / "bench_flce.py"))
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "environment", lambda: {"gpu": "GPU", "torch": "2.x", "triton": "3.x", "date": "today"})
    monkeypatch.setattr(bench, "make_inputs", lambda n, h, v: (None, None, None))
    monkeypatch.setattr(sys, "argv", ["bench_flce.py", "--shapes", "8x4x16", "--variants", "flce", "flce-bf16acc",
                                      "flce-streams", "--turns", "3", "--no-host", "--no-errors", "--tag", "_t"])
    bench.main()
    row = json.loads((tmp_path / "results" / "bench_flce_GPU_t.json").read_text())["rows"][0]
    assert [r["turns"] for r in row["results"].values()] == [3, 3, 3]
    assert [r["floor_ms"] for r in row["results"].values()] == [10.0, 30.0, 20.0]
    assert row["floor_ms"] == 20.0  # the median, not the first variant's


def test_the_floors_dx_and_dw_read_the_losss_own_logit_gradient():
    """The floor's dX and dW GEMMs read d(loss)/d(logits), softmax - one_hot over the valid tokens, zero on ignored
    rows and padded columns (they read the logits, about N(0, 1), which a GPU at its power cap ran slower than the
    op's own GEMMs on the gradient), formed a few rows at a time."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(10, 6, generator=g, dtype=torch.float64), torch.randn(13, 6, generator=g, dtype=torch.float64)
    t = torch.randint(0, 13, (10,), generator=g)
    t[[1, 7]] = -100
    logits = (x @ w.T).requires_grad_()
    torch.nn.functional.cross_entropy(logits, t).backward()
    grad = bench.logit_gradient(x, w, t, 16, rows=3)
    assert grad.shape == (10, 16) and grad.dtype == torch.float64
    torch.testing.assert_close(grad[:, :13], logits.grad)
    assert not grad[:, 13:].any() and not grad[[1, 7]].any()


def test_the_error_table_also_runs_our_variants_in_several_chunks(monkeypatch):
    """At the error shape's 2048 tokens the op's own config runs one chunk, so a bf16 accumulator summed nothing
    across chunks and read exactly the exact row's errors: each of our variants gets a row in ERROR_CHUNKS chunks
    too, where the bf16 accumulator's dW error shows."""
    from benchmarks._common import make_inputs

    monkeypatch.setattr(bench, "ERROR_SHAPE", (256, 32, 96))
    monkeypatch.setattr(bench, "make_inputs", lambda *a, **k: make_inputs(*a, **{**k, "device": "cpu"}))
    out = bench.errors(bench.variants(["flce", "flce-bf16acc"]))
    assert list(out) == ["flce", "flce bf16-acc", "flce, 4 chunks", "flce bf16-acc, 4 chunks"]
    assert all(e["dW"] < 2e-2 and e["dX"] < 2e-2 for e in out.values()), out
    assert out["flce bf16-acc"]["dW"] == out["flce"]["dW"]  # one chunk: nothing summed in bf16
    assert out["flce bf16-acc, 4 chunks"]["dW"] > out["flce, 4 chunks"]["dW"]
