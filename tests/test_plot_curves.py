"""benchmarks/plot_curves.py on the CPU at tiny shapes (every variant measured or skipped with a reason, ours
below eager, chunked CE held at its logits while ours falls with more chunks), its e2e bar chart from a small
bench_e2e JSON, and bench_tuning's speed-up plot from a small row list."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("matplotlib")
REPO = Path(__file__).resolve().parents[1]
TOKENS, CHUNK_TOKENS, VOCAB, HIDDEN = (128, 1024), 1024, 1024, 64


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def curves():
    return load("plot_curves")


@pytest.fixture(scope="module")
def cpu_run(curves, tmp_path_factory):
    """One tiny CPU run of main() (all variants but the Triton strategy, which the test set-up runs in the slow
    interpreter); returns (rows, out_dir, requested variant names)."""
    out = tmp_path_factory.mktemp("curves")
    sweep = curves.SWEEPS["cpu"]
    wanted = [v for v in curves.variant_makers("cpu", sweep) if v != "flce-triton"]
    saved_out = os.environ.pop("OUT", None)
    try:
        status = curves.main(["--device", "cpu", "--shapes", f"tiny={VOCAB}x{HIDDEN}", "--tokens", *map(str, TOKENS),
                              "--chunk-tokens", str(CHUNK_TOKENS), "--chunks", "1", "4", "16", "--reps", "1",
                              "--out-dir", str(out), "--no-e2e", "--variants", *wanted])
    finally:
        if saved_out is not None:
            os.environ["OUT"] = saved_out
    assert status == 0
    return curves.read_rows(out / "curves_cpu.csv"), out, wanted


def test_every_variant_measured_or_skipped_with_a_reason(cpu_run):
    rows, _, wanted = cpu_run
    token_rows = [r for r in rows if r["sweep"] == "tokens"]
    assert {r["variant"] for r in token_rows} == set(wanted)
    for name in wanted:
        mine = [r for r in token_rows if r["variant"] == name]
        if mine[0]["status"] == "skipped":
            assert len(mine) == 1 and mine[0]["reason"], name
        else:
            assert [r["tokens"] for r in mine] == list(TOKENS), name
            assert all(r["status"] == "ok" and r["peak_gb"] > 0 and r["ms"] > 0 for r in mine), mine
    measured = {r["variant"] for r in token_rows if r["status"] == "ok"}
    assert {"eager", "torch.compile", "chunked-ce", "flce-torch"} <= measured
    native = hasattr(torch.nn.functional, "linear_cross_entropy")
    assert ("torch-native" in measured) == native
    assert all(r["peak_method"].startswith("torch.profiler") for r in rows)


def test_ours_below_eager_at_the_largest_token_count(cpu_run):
    rows, _, _ = cpu_run
    peak = {r["variant"]: r["peak_gb"] for r in rows if r["sweep"] == "tokens" and r["tokens"] == max(TOKENS)}
    assert peak["flce-torch"] < peak["eager"] / 2, peak


def test_chunked_ce_keeps_its_logits_while_ours_falls_with_chunks(cpu_run):
    rows, _, _ = cpu_run
    chunks = {(r["variant"], r["chunks"]): r["peak_gb"] for r in rows if r["sweep"] == "chunks"}
    logits_gb = CHUNK_TOKENS * VOCAB * 4 / 1e9  # every chunk's fp32 log-softmax, kept for backward
    for k in (1, 4, 16):
        assert chunks[("chunked-ce", k)] >= 0.95 * logits_gb, (k, chunks)
    assert chunks[("flce", 16)] < chunks[("flce", 4)] / 2 < chunks[("flce", 1)] / 4, chunks
    assert chunks[("flce", 16)] < logits_gb / 4, chunks


def test_pngs_and_sidecar_written(cpu_run):
    _, out, _ = cpu_run
    for name in ("curves_cpu_tokens.png", "curves_cpu_chunks.png"):
        assert (out / name).stat().st_size > 10_000, name
    env = json.loads((out / "curves_cpu.json").read_text())
    assert env["kind"] == "cpu" and env["torch"] == torch.__version__ and "time.perf_counter" in env["time_method"]


def e2e_payload(gpu: str, rows: list[tuple[str, int, float, float]], **env) -> dict:
    return {"env": {"gpu": gpu, "torch": "2.11", **env},
            "rows": [{"variant": v, "seq": s, "status": "ok", "peak_gb": gb, "step_ms": ms} for v, s, gb, ms in rows]}


def test_e2e_bars_from_the_newest_run(curves, tmp_path):
    old = tmp_path / "bench_e2e_h200_old.json"
    old.write_text(json.dumps(e2e_payload("NVIDIA H200", [("inductor", 16384, 16.8, 895.0)])))
    first = tmp_path / "bench_e2e_h200_a.json"
    first.write_text(json.dumps(e2e_payload("NVIDIA H200", [("inductor", 16384, 16.3, 438.0),
                                                           ("flce-inductor", 16384, 7.3, 438.0)], causal_skip=True)))
    second = tmp_path / "e2e-20261201-000000.json"
    payload = e2e_payload("NVIDIA H200", [("flce-inductor", 65536, 17.1, 3879.0)], causal_skip=True)
    payload["rows"].append({"variant": "eager", "seq": 65536, "status": "OOM"})
    second.write_text(json.dumps(payload))
    (tmp_path / "bench_e2e_h200.md").write_text("not JSON")
    (tmp_path / "bench_e2e_other.json").write_text(json.dumps({"rows": "not e2e"}))
    for age, path in enumerate((second, first, old)):
        os.utime(path, (1e9 - age * 1000, 1e9 - age * 1000))

    sources = curves.newest_e2e_run(tmp_path, "h200")
    assert sources == [first, second]  # the newest file's run (same env), oldest first; the other run left out
    env, rows = curves.merged_e2e(sources)
    assert env["causal_skip"] and {(r["variant"], r["seq"]) for r in rows} == {
        ("inductor", 16384), ("flce-inductor", 16384), ("flce-inductor", 65536), ("eager", 65536)}
    png = curves.draw_e2e(env, rows, sources, tmp_path / "e2e_h200.png")
    assert png is not None and png.stat().st_size > 10_000
    assert curves.draw_e2e(env, [r for r in rows if r["status"] != "ok"], sources, tmp_path / "none.png") is None
    with pytest.raises(ValueError, match="not a bench_e2e results JSON"):
        curves.merged_e2e([tmp_path / "bench_e2e_other.json"])


def tuning_row(vocab: int, hidden: int, tokens: int, default_ms: float, tuned_ms: float, liger_ms: float | None,
               same_config: bool = False) -> dict:
    row = {"vocab": vocab, "hidden": hidden, "tokens": tokens, "default_ms": default_ms, "tuned_ms": tuned_ms,
           "speedup": default_ms / tuned_ms, "default_config": {"chunk_tokens": 1024},
           "tuned_config": {"chunk_tokens": 1024 if same_config else 2048}}
    if liger_ms is not None:
        row.update(liger_ms=liger_ms, vs_liger=liger_ms / tuned_ms)
    return row


def test_tuning_plot_from_rows_and_from_a_results_json(tmp_path):
    bench = load("bench_tuning")
    rows = [tuning_row(256000, 2304, 8192, 57.4, 51.5, 109.4), tuning_row(256000, 2304, 16384, 110.0, 100.0, None),
            tuning_row(50257, 768, 4096, 2.3, 2.24, 28.1, same_config=True),
            tuning_row(262144, 2560, 65536, 480.0, 479.3, 439.8)]
    png = bench.plot_speedups(rows, tmp_path / "tuning.png", "test")
    assert png is not None and png.stat().st_size > 10_000
    assert bench.plot_speedups([{"vocab": 1, "hidden": 1, "tokens": 1}], tmp_path / "empty.png") is None
    assert not (tmp_path / "empty.png").exists()
    results = tmp_path / "bench_tuning_h200_x.json"
    results.write_text(json.dumps({"meta": {"gpu": "NVIDIA H200"}, "rows": rows}))
    assert bench.main(["--plot-from", str(results)]) == 0
    assert results.with_suffix(".png").stat().st_size > 10_000
