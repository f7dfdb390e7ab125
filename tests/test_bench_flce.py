"""benchmarks/bench_flce.py's ratio to the floor: each variant against a floor timed right before it, paired by
round (CPU: the GPU timers are replaced by scripted ones)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")  # bench_flce imports triton.testing

import benchmarks.bench_flce as bench  # noqa: E402


def _scripted(monkeypatch, floors, variants):
    """Replace the timers by the given sequences; return the order in which they were called."""
    calls = []
    floors, variants = iter(floors), iter(variants)

    def time_floor(x, w):
        calls.append("floor")
        return next(floors)

    def time_fwd_bwd(fn, x, w, t):
        calls.append("variant")
        return next(variants), 0.5 if calls.count("variant") == 1 else -0.1  # later rounds: leftovers in the base

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
