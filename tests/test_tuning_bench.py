"""benchmarks/bench_tuning.py without a GPU: shape selection, the time budget, and results written after every
shape (a run stopped by a time limit still leaves a results file)."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from flce_compile.plan.config import FLCEConfig
from flce_compile.tuning import db
from test_tuning_db import dbs  # noqa: F401 - a fixture

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_tuning", REPO / "benchmarks" / "bench_tuning.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def entry(vocab: int, hidden: int, tokens: int = 8192) -> db.Entry:
    return db.Entry(device="h200", vocab=vocab, hidden=hidden, dtype="bf16", tokens=tokens,
                    config=FLCEConfig(strategy="triton", chunk_tokens=2048), ms=2.0, default_ms=3.0, trials=5)


ENTRIES = [entry(32064, 3072), entry(256000, 2304), entry(256000, 2304, 16384), entry(151936, 4096)]
META = {"gpu": "NVIDIA H200", "torch": "t", "triton": "tr", "date": "20250101-000000"}


def fake_row(e: db.Entry, default_ms: float = 3.0, tuned_ms: float = 2.0, liger_rule_ms: float | None = 3.0) -> dict:
    row = {"vocab": e.vocab, "hidden": e.hidden, "tokens": e.tokens, "default_ms": default_ms, "tuned_ms": tuned_ms,
           "speedup": default_ms / tuned_ms}
    if liger_rule_ms is not None:
        row.update(liger_rule_ms=liger_rule_ms, vs_liger_rule=liger_rule_ms / tuned_ms)
    return row


def test_liger_chunk_rule(bench):
    # next_pow2(ceil(BT / ceil(V / H))): the Gemma-2 target runs 128-token chunks, Llama-3 8B 512
    assert bench.liger_chunk_tokens(8192, 256000, 2304) == 128
    assert bench.liger_chunk_tokens(16384, 128256, 4096) == 512
    assert bench.liger_chunk_tokens(4096, 50257, 768) == 64
    assert bench.liger_chunk_tokens(1, 256000, 2304) == 1
    args = bench.build_parser().parse_args([])
    assert args.liger_rule_shapes == "target"
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--liger-rule-shapes", "some"])


def test_target_is_judged_against_liger_rule_and_reports_the_default(bench):
    gemma = ENTRIES[1]
    _, target, never_slower = bench.summarize([fake_row(gemma, default_ms=3.0, tuned_ms=2.0, liger_rule_ms=2.5)])
    assert target.startswith("FAIL (1.25x over our op with Liger's chunk rule") and "heuristic default: 1.50x" in target
    assert never_slower == "PASS"
    _, target, _ = bench.summarize([fake_row(gemma, liger_rule_ms=None)])
    assert target.startswith("NOT MEASURED") and "1.50x" in target
    _, target, never_slower = bench.summarize([fake_row(ENTRIES[0], default_ms=1.0, tuned_ms=2.0)])
    assert target.startswith("NOT MEASURED") and never_slower.startswith("FAIL: V=32064 H=3072 T=8192 (0.50x)")


def test_shape_selection(bench):
    assert bench.parse_shapes("256000x2304, 151936x4096x16384") == [(256000, 2304), (151936, 4096, 16384)]
    for bad in ("256000", "ax2", "1x2x3x4", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_shapes(bad)
    assert bench.select_entries(ENTRIES) == ENTRIES
    assert bench.select_entries(ENTRIES, max_shapes=2) == ENTRIES[:2]
    # in the order asked for; VxH takes every token count, VxHxT one
    assert bench.select_entries(ENTRIES, [(151936, 4096), (256000, 2304)]) == [ENTRIES[3], ENTRIES[1], ENTRIES[2]]
    assert bench.select_entries(ENTRIES, [(256000, 2304, 16384)]) == [ENTRIES[2]]
    assert bench.select_entries(ENTRIES, [(256000, 2304), (256000, 2304, 8192)], max_shapes=1) == [ENTRIES[1]]
    args = bench.build_parser().parse_args(["--shapes", "256000x2304", "--max-shapes", "1", "--time-budget-s", "60"])
    assert args.shapes == [(256000, 2304)] and args.max_shapes == 1 and args.time_budget_s == 60


def test_results_are_written_after_every_shape(bench, tmp_path):
    base = tmp_path / "bench_tuning_h200_x"
    seen: list[int] = []

    def measure(e):
        if len(seen) == 2:
            raise KeyboardInterrupt  # a time limit's SIGTERM during the third shape
        seen.append(e.vocab)
        # the file already holds every earlier shape while this one runs
        if seen[:-1]:
            assert len(json.loads(base.with_suffix(".json").read_text())["rows"]) == len(seen) - 1
        return fake_row(e)

    def write(rows, not_measured, complete):
        bench.write_results(base, META, rows, not_measured, complete)

    assert bench.run_shapes(ENTRIES, measure, write) == 130
    data = json.loads(base.with_suffix(".json").read_text())
    assert data["complete"] is False and len(data["rows"]) == 2
    assert data["not_measured"] == ["256000x2304x16384", "151936x4096x8192"]
    assert data["target"].startswith("PASS (1.50x")  # 256000x2304x8192 was measured: 3.0 / 2.0
    md = base.with_suffix(".md").read_text()
    assert "**Partial**: 2 shapes measured, 2 not measured" in md and "| 256000" in md
    assert not list(tmp_path.glob("*.tmp"))


def test_results_also_land_in_out_where_the_gpu_machine_reads_them_back(bench, tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    bench.write_results(tmp_path / "res" / "bench_tuning_h100_x", META, [fake_row(ENTRIES[0])], ENTRIES[1:], False)
    for folder in (tmp_path / "res", out):
        assert json.loads((folder / "bench_tuning_h100_x.json").read_text())["rows"][0]["vocab"] == 32064
        assert "**Partial**: 1 shapes measured" in (folder / "bench_tuning_h100_x.md").read_text()
        assert not list(folder.glob("*.tmp"))


def test_time_budget_stops_before_a_shape_that_does_not_fit(bench, tmp_path):
    now = {"t": 0.0}
    durations = iter([30.0, 40.0, 10.0, 10.0])

    def measure(e):
        now["t"] += next(durations)
        return fake_row(e, tuned_ms=1.0)

    writes: list[tuple[int, int, bool]] = []

    def write(rows, not_measured, complete):
        writes.append((len(rows), len(not_measured), complete))
        bench.write_results(tmp_path / "b", META, rows, not_measured, complete)

    # after 30 + 40 s, 30 s are left and the slowest shape took 40 s: stop before the third
    assert bench.run_shapes(ENTRIES, measure, write, time_budget_s=100, clock=lambda: now["t"]) == 0
    assert writes == [(1, 3, False), (2, 2, False), (2, 2, False)]
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["complete"] is False and data["target"].startswith("PASS (3.00x")
    # enough time: every shape, the last write is complete
    now["t"], durations, writes[:] = 0.0, iter([1.0] * 4), []
    assert bench.run_shapes(ENTRIES, measure, write, time_budget_s=100, clock=lambda: now["t"]) == 0
    assert writes[-1] == (4, 0, True)
    assert json.loads((tmp_path / "b.json").read_text())["never_slower"] == "PASS"


def test_resume_keeps_earlier_rows_and_measures_the_rest(bench, tmp_path):
    meta = {**META, "gpu_kind": "h200"}
    bench.write_results(tmp_path / "run", meta, [fake_row(ENTRIES[0]), fake_row(ENTRIES[2])], ENTRIES[1::2], False)
    payload = json.loads((tmp_path / "run.json").read_text())
    rows, todo = bench.resume_state(payload, meta, ENTRIES)
    assert [r["vocab"] for r in rows] == [32064, 256000] and todo == [ENTRIES[1], ENTRIES[3]]
    for key in ("gpu_kind", "torch"):
        with pytest.raises(ValueError, match=f"--resume file was measured with {key}="):
            bench.resume_state(payload, {**meta, key: "other"}, ENTRIES)
    args = bench.build_parser().parse_args(["--resume", str(tmp_path / "run.json")])
    assert args.resume == tmp_path / "run.json"


def test_a_tuned_config_equal_to_the_default_is_noise_not_a_slowdown(bench):
    config = FLCEConfig(strategy="triton").to_dict()
    noisy = {**fake_row(ENTRIES[0], default_ms=1.0, tuned_ms=1.03), "tuned_config": config, "default_config": config}
    slower = {**fake_row(ENTRIES[3], default_ms=1.0, tuned_ms=1.03), "tuned_config": config,
              "default_config": {**config, "chunk_tokens": 4096}}
    _, _, never_slower = bench.summarize([noisy])
    assert never_slower == "PASS (1 row whose tuned config is the default not judged; that config timed twice spans 0.971x-0.971x)"
    _, _, never_slower = bench.summarize([noisy, slower])
    assert never_slower.startswith("FAIL: V=151936 H=4096 T=8192 (0.97x) (1 row")


def test_budget_tier_rows_and_the_liger_check(bench):
    """A budget-tier entry's row is labelled and not judged against the unbudgeted default (its config fits a
    budget the default breaks); the default-vs-Liger check takes the plain rows, strictly, and names the losers."""
    plain = fake_row(ENTRIES[2], default_ms=3.0, tuned_ms=2.0)
    tier = {**fake_row(ENTRIES[2], default_ms=3.0, tuned_ms=4.0), "budget_tier_gb": 0.5, "vs_liger": 0.5}
    lines, _, never_slower = bench.summarize([plain, tier])
    assert never_slower == "PASS (1 budget-tier row not judged)"
    assert any("16384 (<= 0.5 GiB)" in line for line in lines)
    assert bench.never_slower_than_liger([plain, tier]) == "NOT MEASURED (no Liger timings)"
    faster = {**plain, "vs_liger": 1.01}
    slower = {**fake_row(ENTRIES[3]), "vs_liger": 0.995}
    assert bench.never_slower_than_liger([faster, tier]) == "PASS (1 shape)"
    assert bench.never_slower_than_liger([faster, slower, tier]) == (
        "FAIL at 1 of 2 shapes: V=151936 H=4096 T=8192 (0.995x)")


def test_resume_labels_older_rows_with_their_tier(bench):
    """Rows of a run made before rows carried their tier get it from the entry whose config they timed."""
    tier_entry = db.Entry(device="h200", vocab=256000, hidden=2304, dtype="bf16", tokens=16384,
                          config=FLCEConfig(strategy="recompute", chunk_tokens=1024), ms=9.0, default_ms=3.0,
                          trials=5, budget_tier_gb=0.5)
    entries = [ENTRIES[2], tier_entry]
    rows = [{**fake_row(e), "tuned_config": e.config.to_dict()} for e in entries]
    kept, rest = bench.resume_state({"meta": META, "rows": rows}, META, entries + [ENTRIES[3]])
    assert [r["budget_tier_gb"] for r in kept] == [None, 0.5]
    assert rest == [ENTRIES[3]]
    # Only the plain entry measured: its tier sibling, same (V, H, tokens), is still to measure.
    kept, rest = bench.resume_state({"meta": META, "rows": rows[:1]}, META, entries)
    assert rest == [tier_entry]


def _run(date: str, rows: list[dict], kind: str = "h200") -> dict:
    return {"meta": {**META, "gpu_kind": kind, "date": date}, "rows": rows}


def test_latest_takes_the_newest_row_of_each_entrys_current_config(bench):
    """Checks spread over several runs add up to one verdict per entry: the newest row that timed the entry's
    current config counts; a newer row of another config (the entry was re-tuned since) does not; entries no
    run timed with their config are listed."""
    current = [{**fake_row(e), "tuned_config": e.config.to_dict()} for e in ENTRIES]
    old_config = FLCEConfig(strategy="triton", chunk_tokens=1024).to_dict()
    early = _run("20260101-000000", [{**current[0], "vs_liger": 0.99}, {**current[1], "vs_liger": 1.2}])
    late = _run("20260102-000000", [{**current[0], "vs_liger": 1.01},
                                    {**current[1], "tuned_config": old_config, "vs_liger": 0.5},
                                    {**current[3], "vs_liger": 1.1}])
    rows, missing, stale = bench.latest_rows([late, early], ENTRIES)  # the order given does not matter
    assert [(r["vocab"], r["tokens"], r["run"], r["vs_liger"]) for r in rows] == [
        (32064, 8192, "20260102-000000", 1.01), (256000, 8192, "20260101-000000", 1.2),
        (151936, 8192, "20260102-000000", 1.1)]
    assert missing == [ENTRIES[2]] and stale == 1
    assert bench.never_slower_than_liger(rows) == "PASS (3 shapes)"
    meta = bench.latest_meta([early, late])
    assert meta["merged"] == ["20260101-000000", "20260102-000000"] and meta["gpu_kind"] == "h200"
    with pytest.raises(ValueError, match="different GPU kinds"):
        bench.latest_meta([early, _run("20260103-000000", [], kind="h100")])
    with pytest.raises(ValueError, match="itself a --latest result"):
        bench.latest_meta([early, {"meta": meta, "rows": rows}])


def test_latest_from_the_command_line(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(db, "load_entries", lambda layer="merged": ENTRIES)
    rows = [{**fake_row(e), "tuned_config": e.config.to_dict(), "vs_liger": 1.05} for e in ENTRIES]
    (tmp_path / "a.json").write_text(json.dumps(_run("20260101-000000", rows[:2])))
    (tmp_path / "b.json").write_text(json.dumps(_run("20260102-000000", rows[2:])))
    out = tmp_path / "out"
    assert bench.main(["--latest", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out-dir", str(out)]) == 0
    assert "default never slower than Liger: PASS (4 shapes)" in capsys.readouterr().out
    payload = json.loads((out / "bench_tuning_h200_latest.json").read_text())
    assert payload["complete"] and payload["meta"]["rows_from"] == {"20260101-000000": 2, "20260102-000000": 2}
    assert "| 20260102-000000 |" in (out / "bench_tuning_h200_latest.md").read_text()  # each row names its run
    with pytest.raises(SystemExit):
        bench.main(["--latest", str(tmp_path / "missing.json")])


def test_a_gpu_is_judged_on_the_entries_it_runs_from_its_family(bench, dbs, tmp_path, capsys, monkeypatch):
    """An H100 is judged on its own entries and on those of its family the op's lookup answers its calls with."""
    def on(kind: str, e: db.Entry, **change) -> db.Entry:
        return db.Entry(**{**{f: getattr(e, f) for f in ("vocab", "hidden", "dtype", "tokens", "config", "ms",
                                                          "default_ms", "trials", "budget_tier_gb")},
                           "device": kind, **change})

    _, shipped = dbs
    small = FLCEConfig(strategy="triton", chunk_tokens=1024)
    h200 = [*ENTRIES, on("h200", ENTRIES[0], budget_tier_gb=0.5), on("h200", ENTRIES[2], budget_tier_gb=0.5)]
    h100 = [on("h100", ENTRIES[3], ms=1.0),  # its own 151936 x 4096 x 8192: the H200's there is not run
            on("h100", ENTRIES[2], config=small),  # its own 256000 x 2304 at 16384: the H200's 8192 one is closer
            on("h100", ENTRIES[0], tokens=16384, budget_tier_gb=0.5),  # its own tier: the H200's 8192 one not run
            on("h100", ENTRIES[0], dtype="fp16")]
    db.write_entries(shipped / "h200.json", h200)
    db.write_entries(shipped / "h100.json", h100)
    db.write_entries(shipped / "gh200.json", [on("gh200", ENTRIES[1], ms=9.0), on("gh200", ENTRIES[0], config=small)])
    db.write_entries(shipped / "a100.json", [on("a100", ENTRIES[2])])
    db.invalidate_cache()
    held = db.load_entries(layer="shipped")

    def names(entries):
        return [(e.device, e.vocab, e.tokens, e.budget_tier_gb) for e in entries]

    served = bench.entries_served(held, "h100")
    # the family's exact bucket before its own other bucket; gh200 before h200 by name; bf16; the family's tiers
    # only for a (V, H) with none of its own within the tier
    assert names(served) == [("gh200", 32064, 8192, None), ("h100", 32064, 16384, 0.5), ("h100", 151936, 8192, None),
                             ("gh200", 256000, 8192, None), ("h100", 256000, 16384, None),
                             ("h200", 256000, 16384, 0.5)]
    for e in served:  # each is what the op's lookup answers an H100 call at its key with
        found = (db.find_match(vocab=e.vocab, hidden=e.hidden, dtype="bf16", tokens=e.tokens, device="h100")
                 if e.budget_tier_gb is None else db.find_budget_matches(
                     vocab=e.vocab, hidden=e.hidden, dtype="bf16", tokens=e.tokens, device="h100",
                     budget_gb=e.budget_tier_gb)[0])
        assert found.entry == e
    assert names(bench.entries_served(held, "h100", own_only=True)) == [
        ("h100", 32064, 16384, 0.5), ("h100", 151936, 8192, None), ("h100", 256000, 16384, None)]
    assert names(bench.entries_served(held, "a100")) == [("a100", 256000, 16384, None)]  # no family: its own
    assert len(bench.entries_served(held, "h200")) == len(h200)  # every key its own: nothing borrowed
    # on an H100 (the CUDA probe faked), a call without options runs each plain entry served, not the H200's
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda")
    for e in served:
        if e.budget_tier_gb is None:
            assert bench.op_choice(e, cuda)["op_runs_tuned"], e
    assert bench.op_choice(ENTRIES[0], cuda) == {"op_source": "tuning_db:shipped_exact (borrowed from gh200)",
                                                 "op_runs_tuned": False}  # the H200's, where the GH200's is run
    # the tokens column names the kind a borrowed row is from; the op-choice line reports a row it would not run
    rows = [{**fake_row(e), "borrowed_from": e.device if e.device != "h100" else None, "op_runs_tuned": True}
            for e in served if e.budget_tier_gb is None]
    lines, _, _ = bench.summarize(rows)
    assert "| 8192 (gh200's) " in lines[2] and "| 8192 " in lines[3] and "'s)" not in lines[3]
    assert bench.op_runs_entries(rows) == "yes (4 plain entries)"
    rows[1]["op_runs_tuned"], rows[1]["op_source"] = False, "heuristic"
    assert bench.op_runs_entries(rows) == "NO at 1 of 4: V=151936 H=4096 T=8192 (heuristic)"
    assert bench.op_runs_entries([fake_row(ENTRIES[0])]) == "NOT RECORDED"
    # --latest on an H100's runs merges the family's rows too, relabelled by the entries now held: a row timed
    # as the H200's entry whose config is now the H100's own entry is the H100's
    run_rows = [{**fake_row(e), "tuned_config": e.config.to_dict(), "vs_liger": 1.05,
                 "budget_tier_gb": e.budget_tier_gb, "borrowed_from": "h200"} for e in served]
    for r in run_rows:  # as _measure_entry records it: for plain rows
        if r["budget_tier_gb"] is None:
            r["op_runs_tuned"] = True
    (tmp_path / "a.json").write_text(json.dumps(_run("20260101-000000", run_rows, kind="h100")))
    assert bench.main(["--latest", str(tmp_path / "a.json"), "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "default never slower than Liger: PASS (4 shapes)" in out
    assert "a call without options runs the entry timed: yes (4 plain entries)" in out
    merged = json.loads((tmp_path / "bench_tuning_h100_latest.json").read_text())
    assert [r.get("borrowed_from") for r in merged["rows"]] == ["gh200", None, None, "gh200", None, "h200"]
    assert merged["meta"]["own_only"] is False
    assert bench.main(["--latest", str(tmp_path / "a.json"), "--out-dir", str(tmp_path), "--own-only"]) == 0
    assert "default never slower than Liger: PASS (2 shapes)" in capsys.readouterr().out


def test_an_entry_measured_below_its_bucket_is_judged_at_its_own_token_count(bench, dbs, monkeypatch):
    """A study at 6000 tokens stores its entry in the 8192 bucket; at 8192 tokens the op runs such an entry as one
    chunk, so the benchmark times it (and asks the op about it) at the 6000 tokens it was measured at."""
    user, _ = dbs
    measured = db.Entry(device="h200", vocab=32064, hidden=3072, dtype="bf16", tokens=8192,
                        config=FLCEConfig(strategy="triton", chunk_tokens=6144), ms=2.0, default_ms=3.0, trials=5,
                        extra={"measured_tokens": 6000})
    db.write_entries(user, [measured])
    db.invalidate_cache()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    [e] = db.load_entries()
    assert e.measured_tokens == 6000
    assert bench.op_choice(e, torch.device("cuda")) == {"op_source": "tuning_db:user_exact", "op_runs_tuned": True}


def test_variants_are_timed_in_turns_and_a_failing_one_drops_out(bench):
    """``timed_in_turns``: each round times every variant once, in order; a variant's ms is its rounds' median;
    one that raises gets None and its error, is not timed again, and the others keep their rounds."""
    calls: list[str] = []
    times = {"default": iter([3.0, 1.0, 2.0]), "liger": iter([5.0, 4.0, 6.0])}

    def fake_bench(fn):
        name = fn()
        calls.append(name)
        if name == "tuned" and calls.count("tuned") == 2:
            raise RuntimeError("out of memory")
        return next(times[name]) if name in times else 1.5

    fns = {name: (lambda n=name: n) for name in ("default", "tuned", "liger")}
    freed = []
    out = bench.timed_in_turns(fns, fake_bench, 3, lambda: freed.append(True))
    assert calls == ["default", "tuned", "liger", "default", "tuned", "liger", "default", "liger"]
    assert out["default_ms"] == 2.0 and out["default_ms_rounds"] == [3.0, 1.0, 2.0]
    assert out["liger_ms"] == 5.0
    assert out["tuned_ms"] is None and out["tuned_error"] == "RuntimeError: out of memory" and freed == [True]
    assert "tuned_ms_rounds" not in out
    with pytest.raises(SystemExit):
        bench.main(["--turns", "0"])
