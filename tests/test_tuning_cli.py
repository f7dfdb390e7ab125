"""``flce-tune``: the entry point through a subprocess (the real no-GPU exit status), help, --list/--show/--export
and the tuning flow (fake GPU) in process, the shipped tuning_db/ directory, and the built wheel carrying it."""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from flce_compile.plan.config import FLCEConfig
from flce_compile.tuning import db, studies

REPO = Path(__file__).resolve().parents[1]


def _cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.update(extra or {})
    return env


def make_entry(**kw) -> db.Entry:
    base = dict(device="h200", vocab=256000, hidden=2304, dtype="bf16", tokens=8192,
                config=FLCEConfig(strategy="triton", chunk_tokens=2048, block_v=8192, num_warps=8),
                ms=20.0, peak_gb=2.5, default_ms=31.0, default_peak_gb=1.1, trials=8, torch="2.x", triton="3.x",
                date="2025-01-01T00:00:00+00:00")
    base.update(kw)
    return db.Entry(**base)


@pytest.fixture(autouse=True)
def _private_env(monkeypatch, tmp_path):
    """cli.main sets $FLCE_TUNING_DB for --db; keep that (and the DB caches) from leaking into other tests. The
    user DB is a file of this test's own (never the developer's): tuning keeps its studies beside it, also with
    --out."""
    monkeypatch.setenv(db.ENV_USER_DB, str(tmp_path / "private_user_db.json"))
    db.invalidate_cache()
    yield
    db.invalidate_cache()


def test_no_gpu_exits_2(tmp_path):
    """The real entry point (``python -m``) and the real CUDA probe: the only subprocess here (each one pays the
    package import, which takes seconds)."""
    proc = subprocess.run([sys.executable, "-m", "flce_compile.tuning.cli", "--vocab", "151936", "--hidden", "4096",
                           "--tokens", "4096", "--trials", "2"], capture_output=True, text=True, timeout=180,
                          env=_cli_env({"CUDA_VISIBLE_DEVICES": "", "FLCE_TUNING_DB": str(tmp_path / "nogpu.json")}),
                          cwd=str(REPO))
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA GPU" in proc.stderr
    assert not (tmp_path / "nogpu.json").exists()


def test_help_has_examples(capsys):
    from flce_compile.tuning import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for text in ("examples:", "--shipped-set", "--time-budget-s", "--budget-gb", "--budget-over-default-gb",
                 "--export", "FLCE_TUNING_DB"):
        assert text in out


def test_list_with_the_real_shipped_dir(tmp_path, monkeypatch, capsys):
    """--list shows the user DB and every entry of the committed tuning_db/ (whatever it holds)."""
    from flce_compile.tuning import cli

    monkeypatch.delenv(db.ENV_SHIPPED_DIR, raising=False)
    user = tmp_path / "user.json"
    db.write_entries(user, [make_entry(), make_entry(tokens=16384, ms=30.0)])
    assert cli.main(["--list", "--db", str(user)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["device", "V", "H", "dtype", "tokens", "budget", "ms", "speedup", "source"]
    assert any(l.split()[:6] == ["h200", "256000", "2304", "bf16", "8192", "-"] and "user:" in l for l in lines)
    for path in sorted((REPO / "tuning_db").glob("*.json")):  # shipped entries are listed too, with their tier
        for e in db.read_file(path, strict=True):
            assert any(l.split()[:6] == [e.device, str(e.vocab), str(e.hidden), e.dtype, str(e.tokens), cli._tier(e)]
                       for l in lines)


def test_arguments_and_modes_in_process(tmp_path, monkeypatch, capsys):
    from flce_compile.tuning import cli

    for bad, message in ((["--warmup", "-1"], "--warmup must be >= 0"),
                         (["--budget-over-default-gb", "-0.5"], "--budget-over-default-gb must be >= 0"),
                         (["--memory-gain-margin", "1.5"], "--memory-gain-margin must be in [0, 1)")):
        with pytest.raises(SystemExit) as exc:
            cli.main(["--vocab", "151936", "--hidden", "4096", *bad])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    user = tmp_path / "user.json"
    shipped = tmp_path / "shipped"
    db.write_entries(user, [make_entry(), make_entry(tokens=16384, ms=30.0)])
    db.write_entries(shipped / "h100.json", [make_entry(device="h100", vocab=32768, hidden=4096)])
    monkeypatch.setenv(db.ENV_SHIPPED_DIR, str(shipped))
    with pytest.raises(SystemExit) as exc:
        cli.main(["--vocab", "151936"])
    assert exc.value.code == 2 and "--vocab and --hidden go together" in capsys.readouterr().err
    assert cli.main(["--list", "--db", str(user)]) == 0
    listing = capsys.readouterr().out
    assert any(l.startswith("h100") and "shipped:h100.json" in l for l in listing.splitlines())
    assert cli.main(["--show", "--db", str(user), "--vocab", "256000", "--device-kind", "NVIDIA H200 NVL"]) == 0
    shown = capsys.readouterr().out
    assert "chunk_tokens" in shown and "speedup 1.55x" in shown and "h100" not in shown
    out = tmp_path / "export"
    assert cli.main(["--export", str(out), "--db", str(user)]) == 0
    assert len(db.read_file(out / "h200.json", strict=True)) == 2
    assert cli.main(["--export", str(out), "--db", str(tmp_path / "missing.json")]) == 1
    assert "nothing to export" in capsys.readouterr().err
    assert [s[:3] for s in cli._studies(cli.build_parser().parse_args(["--shipped-set", "--tokens", "4096", "8192"]))][:2] \
        == [(256000, 2304, 4096), (128256, 4096, 4096)]  # token-major, most important shape first


def test_shipped_dir_is_readable():
    """Whatever is committed in tuning_db/ parses strictly, holds one GPU kind per file named after it, and only
    measured entries (a default measurement and a positive trial count)."""
    shipped = REPO / "tuning_db"
    assert shipped.is_dir()
    for path in sorted(shipped.glob("*.json")):
        entries = db.read_file(path, strict=True)
        assert {e.device for e in entries} <= {path.stem}, f"{path.name} holds another GPU kind"
        for e in entries:
            assert e.trials >= 1 and e.ms > 0 and e.date and e.torch
            assert e.default_ms is None or e.ms <= e.default_ms * 1.05, f"{path.name}: {e.key} slower than default"


def test_shipped_h200_file_covers_every_shipped_shape_and_bucket():
    """The H200 file holds a tuned bf16 entry for each shipped (V, H) at every shipped token bucket: a missing
    one would silently fall back to a neighbour's config."""
    from flce_compile.tuning.cli import SHIPPED_SHAPES, SHIPPED_TOKENS

    entries = db.read_file(REPO / "tuning_db" / "h200.json", strict=True)
    have = {(e.vocab, e.hidden, e.tokens) for e in entries
            if e.dtype == "bf16" and e.default_ms is not None and e.budget_tier_gb is None}
    want = {(v, h, t) for v, h, _ in SHIPPED_SHAPES for t in SHIPPED_TOKENS}
    assert sorted(want - have) == []


def tier_gaps(entries: list[db.Entry]) -> list[tuple[float, int, int, int]]:
    """(tier GiB, V, H, bucket) missing from a shipped set of budget-tier entries: for every tier and token bucket
    it holds, each shipped (V, H) that some config of the tuner's space fits by the memory bound needs a bf16
    entry (16384 x 8192 cannot fit 0.5 GiB: its fp32 dX sum alone is 0.5 GiB, so flce-tune skips it)."""
    from flce_compile.tuning.cli import SHIPPED_SHAPES
    from flce_compile.tuning.space import SearchSpace

    tiers = [e for e in entries if e.budget_tier_gb is not None and e.dtype == "bf16"]
    have = {(e.budget_tier_gb, e.vocab, e.hidden, e.tokens) for e in tiers}
    gaps = []
    for tier, bucket in sorted({(e.budget_tier_gb, e.tokens) for e in tiers}):
        for v, h, _ in SHIPPED_SHAPES:
            fits = SearchSpace(tokens=bucket, vocab=v, hidden=h).least_predicted_bytes() <= tier * 2**30
            if fits and (tier, v, h, bucket) not in have:
                gaps.append((tier, v, h, bucket))
    return gaps


def test_tier_gaps_finds_a_missing_shape():
    from flce_compile.tuning.cli import SHIPPED_SHAPES

    tight = [make_entry(vocab=v, hidden=h, tokens=16384, budget_tier_gb=0.5) for v, h, _ in SHIPPED_SHAPES
             if (v, h) not in {(128256, 8192), (151936, 4096)}]  # Llama-3 70B cannot fit; Qwen3 8B is missing
    assert tier_gaps(tight) == [(0.5, 151936, 4096, 16384)]
    assert tier_gaps([make_entry(tokens=16384)]) == []  # no tier present: nothing to complete


def test_shipped_budget_tiers_are_complete_and_fit():
    """Whatever budget tiers tuning_db/h200.json holds, each (tier, bucket) covers every shipped shape that can fit
    it, and each tier entry fits its tier: by the bound at its bucket and by its measured peak."""
    from flce_compile.plan.memory import peak_bytes

    entries = db.read_file(REPO / "tuning_db" / "h200.json", strict=True)
    assert tier_gaps(entries) == []
    for e in (e for e in entries if e.budget_tier_gb is not None):
        budget = e.budget_tier_gb * 2**30
        assert peak_bytes(e.config, e.tokens, e.vocab, e.hidden, db.torch_dtype(e.dtype)) <= budget, e.key
        assert e.peak_gb is not None and e.peak_gb * 1e9 <= budget, e.key


def test_wheel_ships_tuning_db(tmp_path):
    """Build the wheel from a copy of the project with one DB file added, check the JSON is inside, install it
    into a target directory and read the DB from there."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "setup.py", "MANIFEST.in"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, src / name)
    if not (src / "pyproject.toml").exists():
        pytest.skip("no pyproject.toml yet")
    if not (src / "README.md").exists():
        (src / "README.md").write_text("flce-compile\n")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(REPO / "flce_compile", src / "flce_compile", ignore=ignore)
    shutil.copytree(REPO / "tuning_db", src / "tuning_db", ignore=ignore)
    db.write_entries(src / "tuning_db" / "testgpu.json", [make_entry(device="testgpu")])
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    shipped_names = {f"flce_compile/tuning_db/{p.name}" for p in (src / "tuning_db").glob("*.json")}
    assert shipped_names <= set(names), (
        "the wheel lacks tuning_db/*.json: pyproject.toml must map the top-level tuning_db/ to the package "
        "flce_compile.tuning_db ([tool.setuptools] packages list with \"flce_compile.tuning_db\", "
        "[tool.setuptools.package-dir] \"flce_compile.tuning_db\" = \"tuning_db\", "
        "[tool.setuptools.package-data] \"flce_compile.tuning_db\" = [\"*.json\"])")
    # every subpackage of flce_compile made it (guards an explicit packages list that forgot one)
    for init in (REPO / "flce_compile").rglob("__init__.py"):
        rel = init.relative_to(REPO).as_posix()
        assert rel in names, f"{rel} missing from the wheel: add its package to pyproject.toml"
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # read it the way an installed flce_compile does (in-process: a subprocess would pay another torch import)
    installed = target / "flce_compile"
    dirs = db.shipped_dirs(package_dir=installed)
    assert dirs == [installed / "tuning_db"]
    entries = [e for d in dirs for p in sorted(d.glob("*.json")) for e in db.read_file(p, strict=True)]
    assert make_entry(device="testgpu") in entries


def _fake_gpu(monkeypatch) -> None:
    """torch.cuda as far as cmd_tune uses it, as strict as torch 2.11: set_device rejects a device without an
    index (``torch.cuda.set_device(torch.device("cuda"))`` crashed flce-tune on an H200)."""

    def set_device(device):
        index = device if isinstance(device, int) else torch.device(device).index
        if index is None:
            raise ValueError(f"Expected a cuda device with a specified index or an integer, but got: {device}")
        if index != 0:  # one GPU, as torch says it
            raise RuntimeError("CUDA error: invalid device ordinal")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200 NVL")


def test_tune_flow_with_a_fake_gpu(tmp_path, monkeypatch, capsys):
    """The tuning path of the CLI end to end on CPU: the GPU probe and the measurement are faked; entries are
    written per study (so a time-limited run leaves valid entries), the time budget skips what does not fit."""
    import time as _time

    from flce_compile.tuning import cli, measure

    _fake_gpu(monkeypatch)
    monkeypatch.setattr("flce_compile.tuning.space.predicted_peak_bytes", lambda *a, **k: None)
    monkeypatch.setenv(db.ENV_SHIPPED_DIR, str(tmp_path / "noshipped"))
    monkeypatch.setenv(db.ENV_USER_DB, str(tmp_path / "user.json"))
    db.invalidate_cache()

    def fake_make_objective(problem, **kw):
        assert problem.device.index is not None  # the GPU the study measures on is named
        def objective(c):
            _time.sleep(0.01)
            if c.strategy == "triton" and c.num_warps == 32:
                raise RuntimeError("out of resource: shared memory")
            return 100.0 / c.chunk_tokens ** 0.5 + (1.0 if c.strategy == "torch" else 0.0), c.chunk_tokens * 1000
        return objective

    monkeypatch.setattr(measure, "make_objective", fake_make_objective)
    out = tmp_path / "out"
    code = cli.main(["--shapes", "256000x2304,32768x4096", "--tokens", "8192", "--trials", "6", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    entries = db.read_file(out / "h200.json", strict=True)
    assert {(e.vocab, e.hidden, e.tokens) for e in entries} == {(256000, 2304, 8192), (32768, 4096, 8192)}
    for e in entries:
        assert e.ms <= e.default_ms and e.trials >= 6 and e.extra["device_name"] == "NVIDIA H200 NVL"
    assert "speedup" in captured.out and "2 entries written" in captured.out
    # a time budget too small for all studies: the first is written, the rest are reported as skipped
    code = cli.main(["--shipped-set", "--tokens", "4096", "--trials", "3", "--time-budget-s", "5.5"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    written = db.read_file(tmp_path / "user.json", strict=True)
    assert 1 <= len(written) < len(cli.SHIPPED_SHAPES)
    assert (written[0].vocab, written[0].hidden) in {(v, h) for v, h, _ in cli.SHIPPED_SHAPES}
    assert "skipped (time budget)" in captured.out


def test_a_plain_study_searches_no_strategy_the_op_would_not_run(tmp_path, monkeypatch, capsys):
    """A plain entry's config runs unforced, and the op runs a "recompute" config only when forced
    (``plan.choose.runs_unforced``): a plain study leaves that strategy out even where it would time fastest,
    and asking for it alone without --budget-gb is refused with the fix."""
    from flce_compile.tuning import cli, measure

    _fake_gpu(monkeypatch)
    monkeypatch.setattr("flce_compile.tuning.space.predicted_peak_bytes", lambda *a, **k: None)
    monkeypatch.setenv(db.ENV_SHIPPED_DIR, str(tmp_path / "noshipped"))
    monkeypatch.setenv(db.ENV_USER_DB, str(tmp_path / "user.json"))
    db.invalidate_cache()
    seen = set()

    def fake_make_objective(problem, **kw):
        def objective(c):
            seen.add(c.strategy)
            return (1.0 if c.strategy == "recompute" else 10.0 / c.chunk_tokens ** 0.5), c.chunk_tokens * 1000
        return objective

    monkeypatch.setattr(measure, "make_objective", fake_make_objective)
    out = tmp_path / "out"
    assert cli.main(["--vocab", "32768", "--hidden", "4096", "--tokens", "8192", "--trials", "12", "--out", str(out),
                     "--strategies", "triton", "recompute", "torch"]) == 0
    [written] = db.read_file(out / "h200.json", strict=True)
    assert written.config.strategy != "recompute" and "recompute" not in seen and seen
    with pytest.raises(SystemExit):
        cli.main(["--vocab", "32768", "--hidden", "4096", "--strategies", "recompute", "--out", str(out)])
    assert "add --budget-gb G to tune a budget-tier entry" in capsys.readouterr().err


def test_time_budget_is_shared_by_work():
    """--time-budget-s: each study gets the time left in proportion to its V x H x tokens among the studies
    still to run, at least MIN_STUDY_S, at most what is left."""
    from flce_compile.tuning import cli

    big, small = (262144, 2560, 65536), (32064, 3072, 65536)
    share = cli._time_share(300.0, [big, small])
    assert share == pytest.approx(300.0 * 262144 * 2560 / (262144 * 2560 + 32064 * 3072))
    assert cli._time_share(300.0, [small, big]) == pytest.approx(300.0 - share)
    assert cli._time_share(300.0, [small] + [big] * 100) == cli.MIN_STUDY_S
    assert cli._time_share(3.0, [small, big]) == 3.0


def test_time_budget_goes_to_the_studies_skip_existing_leaves(tmp_path, monkeypatch):
    """--time-budget-s with --skip-existing: a study's share counts only the studies that will run. It counted the
    ones already in the file too, so the last study left got a fraction of the budget (5 of 60 s in a review's
    run) and the rest went unused."""
    from flce_compile.tuning import cli, measure, search

    _fake_gpu(monkeypatch)
    monkeypatch.setattr("flce_compile.tuning.space.predicted_peak_bytes", lambda *a, **k: None)
    monkeypatch.setenv(db.ENV_SHIPPED_DIR, str(tmp_path / "noshipped"))
    monkeypatch.setenv(db.ENV_USER_DB, str(tmp_path / "user.json"))
    db.invalidate_cache()
    monkeypatch.setattr(measure, "make_objective", lambda problem, **kw: lambda c: (10.0 / c.chunk_tokens, 1000))
    given = []
    real = search.run_search
    monkeypatch.setattr(search, "run_search", lambda *a, **kw: given.append(kw["timeout_s"]) or real(*a, **kw))
    out = tmp_path / "h200.json"
    db.write_entries(out, [db.Entry(device="h200", vocab=256000, hidden=2304, dtype="bf16", tokens=8192,
                                    config=FLCEConfig(strategy="triton"), ms=1.0)])  # 4.4x the other's work
    assert cli.main(["--shapes", "32768x4096,256000x2304", "--tokens", "8192", "--trials", "3", "--time-budget-s",
                     "60", "--skip-existing", "--out", str(out), "--no-confirm"]) == 0
    assert len(given) == 1 and given[0] > 50, given  # (11 s before)


def test_a_spent_time_budget_names_the_studies_skip_existing_skips_as_existing(tmp_path, monkeypatch, capsys):
    """A budget spent before a study: the studies left that the file holds read "skipped (exists)", the others
    "skipped (time budget)", and the count is of those (all read "time budget" before)."""
    from flce_compile.tuning import cli

    _fake_gpu(monkeypatch)
    monkeypatch.setenv(db.ENV_SHIPPED_DIR, str(tmp_path / "noshipped"))
    monkeypatch.setenv(db.ENV_USER_DB, str(tmp_path / "user.json"))
    db.invalidate_cache()
    out = tmp_path / "h200.json"
    db.write_entries(out, [db.Entry(device="h200", vocab=256000, hidden=2304, dtype="bf16", tokens=8192,
                                    config=FLCEConfig(strategy="triton"), ms=1.0)])
    assert cli.main(["--shapes", "32768x4096,256000x2304", "--tokens", "8192", "--trials", "3", "--time-budget-s",
                     "1", "--skip-existing", "--out", str(out), "--no-confirm"]) == 0
    captured = capsys.readouterr()
    rows = {line.split()[0]: line for line in captured.out.splitlines() if "skipped" in line}
    assert "skipped (time budget)" in rows["32768"] and "skipped (exists)" in rows["256000"], captured.out
    assert "skipping 1 studies" in captured.err


def test_tuning_into_another_kinds_shipped_file_is_refused(tmp_path, monkeypatch, capsys):
    """--out tuning_db/h100.json on an H200 put h200 entries into the H100's file of the shipped layout, which keeps
    one kind a file (``export_shipped`` refuses the same). It is refused before any study, naming the file to use; a
    file of mixed kinds (a user DB) is written as before."""
    from flce_compile.tuning import cli, measure

    _fake_gpu(monkeypatch)
    monkeypatch.setattr("flce_compile.tuning.space.predicted_peak_bytes", lambda *a, **k: None)
    monkeypatch.setenv(db.ENV_SHIPPED_DIR, str(tmp_path / "noshipped"))
    monkeypatch.setattr(measure, "make_objective", lambda problem, **kw: lambda c: (10.0 / c.chunk_tokens, 1000))
    shipped_h100 = tmp_path / "h100.json"
    db.write_entries(shipped_h100, [make_entry(device="h100", vocab=32768, hidden=4096)])
    args = ["--vocab", "32768", "--hidden", "4096", "--tokens", "8192", "--trials", "3", "--no-confirm", "--out"]
    assert cli.main(args + [str(shipped_h100)]) == 2
    assert f"{tmp_path / 'h200.json'}" in capsys.readouterr().err
    assert {e.device for e in db.read_file(shipped_h100)} == {"h100"}
    mixed = tmp_path / "mine.json"
    db.write_entries(mixed, [make_entry(device="h100", vocab=32768, hidden=4096)])
    assert cli.main(args + [str(mixed)]) == 0
    assert {e.device for e in db.read_file(mixed)} == {"h100", "h200"}


def test_budget_over_default_with_a_fake_gpu(tmp_path, monkeypatch, capsys):
    """--budget-over-default-gb: each study's budget is the default config's predicted peak plus GB (GiB), the
    smaller one wins with --budget-gb, and without a memory model it is not applied (with a warning)."""
    from flce_compile.tuning import cli, measure

    _fake_gpu(monkeypatch)
    predicted = lambda config, *a, **k: config.chunk_tokens * 10**6  # noqa: E731 - the fake memory model
    monkeypatch.setattr("flce_compile.tuning.space.predicted_peak_bytes", predicted)
    monkeypatch.setenv(db.ENV_SHIPPED_DIR, str(tmp_path / "noshipped"))
    db.invalidate_cache()
    measured: list[int] = []

    def fake_make_objective(problem, **kw):
        def objective(c):
            measured.append(c.chunk_tokens)
            return 100.0 / c.chunk_tokens ** 0.5, c.chunk_tokens * 10**6  # larger chunks: faster, more memory
        return objective

    monkeypatch.setattr(measure, "make_objective", fake_make_objective)
    # V=256000 bf16: the default chunk is 1024 tokens -> predicted 1.024e9 bytes; + 0.5 GiB = 1.56e9 bytes, so
    # the 1.5x step 1536 fits and 2048 does not
    out = tmp_path / "relative.json"
    # 12 trials: the budget narrows the space to 7 chunks x dw_path x streams (within_budget), all measured
    base = ["--vocab", "256000", "--hidden", "2304", "--tokens", "8192", "--trials", "12", "--strategies", "torch"]
    assert cli.main([*base, "--budget-over-default-gb", "0.5", "--out", str(out)]) == 0, capsys.readouterr().err
    (e,) = db.read_file(out, strict=True)
    assert e.extra["default_config"]["chunk_tokens"] == 1024
    assert e.config.chunk_tokens == 1536 and e.peak_gb == pytest.approx(1.536)
    assert e.extra["budget_over_default_gb"] == 0.5 and e.extra["budget_gb"] is None
    assert e.budget_tier_gb is None  # a relative budget keeps writing plain entries
    assert e.extra["memory_gain_margin"] == 0.02  # the study's rule is recorded with its result
    assert max(measured) <= 1536  # over-budget chunks were pruned before running
    # neither flag: the same budget by default, and the run prints it
    out = tmp_path / "implicit.json"
    assert cli.main([*base, "--out", str(out)]) == 0
    assert db.read_file(out, strict=True)[0].config.chunk_tokens == 1536
    assert "memory budget 1.45 GiB (the default's predicted peak + 0.5 GiB)" in capsys.readouterr().err
    # with --budget-gb as well, the smaller budget wins (1.2 GiB = 1.29e9 bytes: 1024 fits, 1536 does not)
    out = tmp_path / "both.json"
    assert cli.main([*base, "--budget-over-default-gb", "0.5", "--budget-gb", "1.2", "--out", str(out)]) == 0
    (e,) = db.read_file(out, strict=True)
    assert e.config.chunk_tokens == 1024
    assert e.budget_tier_gb == 1.2  # an absolute budget makes a budget-tier entry, also with the relative one
    # no memory model: the relative budget is not applied, and the run says so
    monkeypatch.setattr("flce_compile.tuning.space.predicted_peak_bytes", lambda *a, **k: None)
    out = tmp_path / "nomodel.json"
    assert cli.main([*base, "--budget-over-default-gb", "0.5", "--out", str(out)]) == 0
    assert "--budget-over-default-gb is not applied" in capsys.readouterr().err
    assert db.read_file(out, strict=True)[0].config.chunk_tokens > 1536


def test_list_survives_a_bad_user_db(tmp_path, monkeypatch, capsys, caplog):
    """A non-UTF-8 user DB: --list warns about it and still lists the shipped entries (was a traceback)."""
    from flce_compile.tuning import cli

    shipped = tmp_path / "shipped"
    db.write_entries(shipped / "h100.json", [make_entry(device="h100", vocab=32768, hidden=4096)])
    monkeypatch.setenv(db.ENV_SHIPPED_DIR, str(shipped))
    user = tmp_path / "user.json"
    user.write_bytes(b"\xff\xfe not utf-8")
    assert cli.main(["--list", "--db", str(user)]) == 0
    assert any(l.startswith("h100") and "shipped:h100.json" in l for l in capsys.readouterr().out.splitlines())
    assert "is not UTF-8" in caplog.text


def test_export_to_an_unwritable_path_is_one_line(tmp_path, capsys):
    from flce_compile.tuning import cli

    user = tmp_path / "user.json"
    db.write_entries(user, [make_entry()])
    (tmp_path / "a_file").write_text("")
    assert cli.main(["--export", str(tmp_path / "a_file" / "out"), "--db", str(user)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("flce-tune: could not export to ") and "Not a directory" in err


@pytest.mark.parametrize("bad,message", [
    (["--shapes", "0x0"], "item '0x0' needs a positive VOCAB and HIDDEN"),
    (["--shapes", "151936x0"], "needs a positive VOCAB and HIDDEN"),
    (["--vocab", "8", "--hidden", "8", "--budget-gb", "nan"], "--budget-gb must be a positive finite number"),
    (["--vocab", "8", "--hidden", "8", "--budget-gb", "inf"], "--budget-gb must be a positive finite number"),
    (["--vocab", "8", "--hidden", "8", "--budget-gb", "1e300"], "--budget-gb must be a positive finite number"),
    (["--vocab", "8", "--hidden", "8", "--budget-over-default-gb", "1e300"],
     "--budget-over-default-gb must be >= 0 (GiB, finite), got 1e+300"),
    (["--vocab", "8", "--hidden", "8", "--timeout", "nan"], "--timeout must be a positive finite number"),
    (["--vocab", "8", "--hidden", "8", "--time-budget-s", "nan"], "--time-budget-s must be a positive finite"),
    (["--vocab", "8", "--hidden", "8", "--budget-over-default-gb", "nan"], "--budget-over-default-gb must be >= 0"),
    (["--vocab", "8", "--hidden", "8", "--keep-studies", "-1"], "--keep-studies must be >= 0"),
    (["--replot"], "--replot needs --plot DIR"),
    (["--list", "--plot", "plots"], "--plot DIR goes with tuning or --replot"),
    (["--list-studies", "--replot"], "are separate modes"),
    (["--list", "--device-kind", ""], "--device-kind '': name a GPU kind"),
    (["--show", "--device-kind", " "], "name a GPU kind, e.g. h200"),
    (["--which", "--vocab", "8", "--hidden", "8", "--tokens", "8", "--device-kind", "cpu"], "the CPU has no tuning"),
    (["--export", "out", "--device-kind", "cuda:0"], "a device such as cuda:0 goes to --device"),
    (["--shapes", "10x10,,20x20"], "has an empty item"),
    (["--shapes", "151936x4096,"], "has an empty item"),
    # the listings' filters (a traceback of token_bucket's ValueError, or "no tuning DB entries" for 0)
    (["--list", "--tokens", "0"], "--tokens must be positive integers"),
    (["--show", "--tokens", "-5"], "--tokens must be positive integers"),
    (["--list", "--hidden", "0"], "--hidden must be a positive integer"),
    (["--list", "--budget-gb", "-1"], "--budget-gb must be a positive finite number"),
    (["--vocab", "8", "--hidden", "8", "--dtype", "fp64"], "--dtype fp64 goes with --which only"),
    (["--list", "--dtype", "fp64"], "--dtype fp64 goes with --which only"),
])
def test_bad_numbers_are_one_clear_line(capsys, bad, message):
    """Zero shapes and NaN/inf numbers used to pass validation (and reach the GPU probe)."""
    from flce_compile.tuning import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(bad)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err
    assert err.count("\n") == 1 and err.startswith("flce-tune: error: "), err


def test_which_says_when_no_entry_is_of_the_device_kind(tmp_path, capsys):
    """A misspelt --device-kind got the heuristic's answer without a word."""
    from flce_compile.tuning import cli

    args = ["--which", "--vocab", "151936", "--hidden", "4096", "--tokens", "16384", "--db", str(tmp_path / "u.json")]
    assert cli.main(args + ["--device-kind", "nosuchgpu"]) == 0
    out, err = capsys.readouterr()
    assert "no tuning entries for GPU kind 'nosuchgpu'" in err and "heuristic" in out
    assert "h200" in err.split("Kinds held: ")[1].strip().split(", ")  # the shipped kinds, whichever else ship
    assert cli.main(args + ["--device-kind", "NVIDIA H200"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "shipped" in out
    # a kind with no entries of its own whose family holds some answers from them, without the note (an H800
    # runs the shipped H100 and H200 files)
    assert cli.main(args + ["--device-kind", "h800"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "borrowed from h" in out


def test_a_reader_that_stops_early_ends_the_command_quietly(monkeypatch):
    """``flce-tune --list | head -1``: a write into the pipe the reader closed ended in a BrokenPipeError traceback.
    Now the command returns 1, with stdout pointed at nothing (Python's flush at exit would raise again)."""
    from flce_compile.tuning import cli

    def closed_pipe(argv):
        raise BrokenPipeError(32, "Broken pipe")

    redirected = []
    monkeypatch.setattr(cli, "_main", closed_pipe)
    monkeypatch.setattr(cli.os, "dup2", lambda fd, fd2: redirected.append(fd2))
    monkeypatch.setattr(cli.sys, "stdout", type("Out", (), {"fileno": staticmethod(lambda: 99)})())
    assert cli.main(["--list"]) == 1
    assert redirected == [99]


def test_list_filters_by_tokens_and_export_names_a_missing_db(tmp_path, capsys):
    from flce_compile.tuning import cli

    user = tmp_path / "user.json"
    db.write_entries(user, [make_entry(tokens=8192), make_entry(tokens=16384)])
    assert cli.main(["--list", "--db", str(user), "--tokens", "13000"]) == 0  # the 16384 bucket (the nearest)
    rows = [line for line in capsys.readouterr().out.splitlines() if "user:" in line]
    assert len(rows) == 1 and " 16384 " in rows[0]
    db.write_entries(user, [make_entry(tokens=16384), make_entry(tokens=16384, budget_tier_gb=0.5)])
    assert cli.main(["--list", "--db", str(user), "--budget-gb", "0.5"]) == 0  # only that tier (it was ignored)
    rows = [line for line in capsys.readouterr().out.splitlines() if "user:" in line]
    assert len(rows) == 1 and " 0.5GiB " in rows[0]
    assert cli.main(["--list", "--db", str(user), "--budget-gb", "0.7", "--vocab", "1"]) == 0
    assert capsys.readouterr().out.startswith("no tuning DB entries match the filters")
    assert cli.main(["--export", str(tmp_path / "out"), "--db", str(tmp_path / "none.json")]) == 1
    assert f"nothing to export: {tmp_path / 'none.json'} does not exist" in capsys.readouterr().err


def test_a_lock_file_that_cannot_be_made_is_said_at_once(tmp_path):
    """filelock retries a lock file it cannot create until its timeout, then blamed another tuner for it."""
    from flce_compile.tuning.atomic import file_lock

    with pytest.raises(OSError, match="cannot create the lock file /proc/flce_nowhere/db.json.lock"):
        with file_lock(Path("/proc/flce_nowhere/db.json"), timeout=2.0):
            pass


@pytest.mark.parametrize("mode", [[], ["--retune-ce-tiles"]])
def test_a_device_index_past_the_machines_gpus_is_one_line(tmp_path, monkeypatch, capsys, mode):
    """--device cuda:1 on a one-GPU machine ended in set_device's "invalid device ordinal" traceback."""
    from flce_compile.tuning import cli

    _fake_gpu(monkeypatch)
    out = tmp_path / "db.json"
    if mode:
        db.write_entries(out, [make_entry()])
    argv = [*mode, "--device", "cuda:1", "--out", str(out)]
    assert cli.main(argv + ([] if mode else ["--vocab", "8", "--hidden", "8", "--tokens", "8"])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cuda:1: this machine has 1 CUDA device(s)" in err, err


def test_out_names_a_json_file_in_any_case(tmp_path):
    """--out DB.JSON is a file (it was taken as a directory: the results went to DB.JSON/h200.json)."""
    import argparse

    from flce_compile.tuning import cli

    for name in ("db.json", "DB.JSON", "db.Json"):
        assert cli._output_file(argparse.Namespace(out=tmp_path / name), "h200") == tmp_path / name
    assert cli._output_file(argparse.Namespace(out=tmp_path / "dir"), "h200") == tmp_path / "dir" / "h200.json"


def test_retune_into_an_unwritable_file_refuses_before_timing(tmp_path, monkeypatch, capsys):
    """--retune-ce-tiles timed every entry and then reported each one NOT WRITTEN; now it asks first, as tuning
    does. (Root may write anywhere, so the directory's refusal is check_target's, as it raises for one.)"""
    from flce_compile.tuning import cli, cli_retune

    _fake_gpu(monkeypatch)
    out = tmp_path / "db.json"
    db.write_entries(out, [make_entry()])

    def unwritable(path, *a, **k):
        raise PermissionError(f"cannot write the tuning DB {path}: its directory is not writable")

    monkeypatch.setattr(db, "check_target", unwritable)
    monkeypatch.setattr(cli_retune, "retune_ce_tiles", lambda *a, **k: pytest.fail("timed before checking"))
    assert cli.main(["--retune-ce-tiles", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write the results to" in err and "not writable" in err, err


def test_tuning_without_optuna_is_one_line(tmp_path, monkeypatch, capsys):
    import importlib.util

    from flce_compile.tuning import cli

    _fake_gpu(monkeypatch)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "optuna" else real(name, *a))
    assert cli.main(["--vocab", "8", "--hidden", "8", "--tokens", "8", "--out", str(tmp_path / "db.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tuning needs Optuna" in err and "pip install optuna" in err


def test_kept_studies_without_optuna_are_one_line(tmp_path, monkeypatch, capsys):
    """--list-studies and --replot read Optuna journal files: without Optuna (a second environment sharing
    ~/.cache) they ended in the traceback of ``import optuna``; now one line, exit 2, as tuning does."""
    from flce_compile.tuning import cli

    directory = studies.studies_dir(tmp_path / "private_user_db.json")
    directory.mkdir()
    (directory / (studies.new_study_name("h200", 8, 8, "bf16", 8) + studies.STUDY_SUFFIX)).write_text("")
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna raises, find_spec answers None
    assert cli.main(["--list-studies"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs Optuna" in err and "pip install optuna" in err, err
    if importlib.util.find_spec("matplotlib") is not None:  # --plot DIR checks matplotlib first
        assert cli.main(["--plot", str(tmp_path / "plots"), "--replot"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--replot needs Optuna" in err, err


def test_no_home_directory(tmp_path, monkeypatch, capsys):
    """No $HOME, no passwd entry, no $FLCE_TUNING_DB: --list shows the shipped entries, writing to the user DB
    says what to pass instead of a traceback."""
    from flce_compile.tuning import cli

    shipped = tmp_path / "shipped"
    db.write_entries(shipped / "h100.json", [make_entry(device="h100", vocab=32768, hidden=4096)])
    monkeypatch.setenv(db.ENV_SHIPPED_DIR, str(shipped))
    monkeypatch.delenv(db.ENV_USER_DB)
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: (_ for _ in ()).throw(RuntimeError("no home"))))
    assert cli.main(["--list"]) == 0
    assert "shipped:h100.json" in capsys.readouterr().out
    assert cli.main(["--export", str(tmp_path / "out")]) == 1
    assert cli.NO_USER_DB in capsys.readouterr().err
    _fake_gpu(monkeypatch)
    assert cli.main(["--vocab", "8", "--hidden", "8", "--tokens", "8", "--trials", "1"]) == 2
    assert "nowhere to write the results" in capsys.readouterr().err


def test_which(tmp_path, monkeypatch, capsys):
    """--which prints what which_config answers, per token count; on a machine without a GPU and without
    --device-kind it answers for the CPU."""
    from flce_compile.plan.choose import CPU_SOURCE
    from flce_compile.tuning import cli

    monkeypatch.setenv(db.ENV_SHIPPED_DIR, str(tmp_path / "noshipped"))
    user = tmp_path / "user.json"
    db.write_entries(user, [make_entry(tokens=8192)])
    base = ["--which", "--db", str(user), "--vocab", "256000", "--hidden", "2304"]
    assert cli.main([*base, "--tokens", "8192", "2000", "--device-kind", "NVIDIA H200"]) == 0
    out = capsys.readouterr().out
    assert "V=256000 H=2304 bf16 tokens=8192 on h200: user exact (tuning_db:user_exact)" in out
    assert "tokens=2000 on h200: nearest bucket (tuning_db:nearest_tokens(user tokens=8192))" in out
    assert '"chunk_tokens": 2048' in out and "1.55x over the default" in out
    # fp64, which which_config answers (refused by --dtype's choices until 2026-12-05)
    assert cli.main([*base, "--tokens", "8192", "--device-kind", "h200", "--dtype", "fp64"]) == 0
    assert "fp64 tokens=8192 on h200: heuristic (the tuning DB holds no float64 entries)" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main([*base, "--tokens", "8192"]) == 0
    assert f"on cpu: {CPU_SOURCE}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main(["--which", "--vocab", "256000", "--tokens", "8192"])
    assert exc.value.code == 2 and "--which needs --vocab V --hidden H --tokens N" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------
# --plot, --replot, --list-studies, --keep-studies
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_tuner(tmp_path, monkeypatch):
    """cmd_tune on CPU: a fake GPU, no memory model, no shipped DB, and a deterministic objective whose optimum
    is 2048-token chunks with 8192-wide CE blocks. Returns the user DB path (studies are kept beside it)."""
    from flce_compile.tuning import measure

    _fake_gpu(monkeypatch)
    monkeypatch.setattr("flce_compile.tuning.space.predicted_peak_bytes", lambda *a, **k: None)
    monkeypatch.setenv(db.ENV_SHIPPED_DIR, str(tmp_path / "noshipped"))
    user = tmp_path / "user.json"
    monkeypatch.setenv(db.ENV_USER_DB, str(user))
    db.invalidate_cache()

    def fake_make_objective(problem, **kw):
        def objective(c):
            block = abs(math.log2(c.block_v / 8192)) if c.strategy == "triton" else 2.0
            return 5.0 + abs(math.log2(c.chunk_tokens / 2048)) + block, c.chunk_tokens * 10**6
        return objective

    monkeypatch.setattr(measure, "make_objective", fake_make_objective)
    return user


def assert_pngs(directory: Path, study: str, kinds: tuple[str, ...]) -> None:
    """Exactly these plots of ``study`` are in ``directory``, each a non-trivial PNG."""
    assert sorted(p.name for p in directory.iterdir()) == sorted(f"{study}_{k}.png" for k in kinds)
    for kind in kinds:
        data = (directory / f"{study}_{kind}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, kind


def test_plot_keeps_the_study_and_replots_it(fake_tuner, tmp_path, capsys):
    """--plot DIR draws the three plots of the study; the study is kept beside the user DB (the one that wrote
    the entry: same best time), listed by --list-studies and redrawn by --replot from a new storage object."""
    from flce_compile.tuning import cli

    pytest.importorskip("matplotlib")
    plots = tmp_path / "plots"
    code = cli.main(["--vocab", "32000", "--hidden", "1024", "--tokens", "8192", "--trials", "10",
                     "--strategies", "triton", "--plot", str(plots)])
    err = capsys.readouterr().err
    assert code == 0, err
    directory = studies.studies_dir(fake_tuner)
    (kept,) = studies.kept_studies(directory)
    assert kept.name.startswith("h200_V32000_H1024_bf16_T8192_") and f"keeping the last 20 studies in {directory}" in err
    assert not list(directory.glob("*" + studies.RUNNING_SUFFIX))
    assert_pngs(plots, kept.name, ("history", "importances", "contour"))
    (entry,) = db.read_file(fake_tuner, strict=True)
    study = studies.load(directory, kept.name)
    assert study.best_value == pytest.approx(entry.ms) and len(study.trials) >= 10

    assert cli.main(["--list-studies"]) == 0
    out = capsys.readouterr().out
    assert kept.name in out and f"{entry.ms:.3f}" in out and f"1 kept in {directory}" in out
    again = tmp_path / "again"
    assert cli.main(["--plot", str(again), "--replot", kept.name]) == 0
    assert_pngs(again, kept.name, ("history", "importances", "contour"))
    assert f"3 plots of {kept.name} in {again}" in capsys.readouterr().err
    shutil.rmtree(again)
    assert cli.main(["--plot", str(again), "--replot"]) == 0  # no names: every kept study
    assert_pngs(again, kept.name, ("history", "importances", "contour"))


def test_keep_studies_prunes_to_the_last_n(fake_tuner, capsys):
    """Three studies with --keep-studies 2 leave the last two; --keep-studies 0 keeps none and prunes nothing."""
    from flce_compile.tuning import cli

    base = ["--tokens", "4096", "--trials", "2", "--strategies", "torch", "--no-confirm"]
    assert cli.main(["--shapes", "32000x1024,32768x4096,50257x768", *base, "--keep-studies", "2"]) == 0
    directory = studies.studies_dir(fake_tuner)
    kept = [s.name for s in studies.kept_studies(directory)]
    assert [n.split("_")[1:3] for n in kept] == [["V32768", "H4096"], ["V50257", "H768"]]
    assert "keeping the last 2 studies" in capsys.readouterr().err
    assert cli.main(["--vocab", "151936", "--hidden", "4096", *base, "--keep-studies", "0"]) == 0
    assert "keeping the last" not in capsys.readouterr().err
    assert [s.name for s in studies.kept_studies(directory)] == kept
    assert not list(directory.glob("*" + studies.RUNNING_SUFFIX))
    assert len(db.read_file(fake_tuner, strict=True)) == 4  # the tuning itself is unchanged


def test_plot_without_a_user_db_draws_from_memory(fake_tuner, tmp_path, monkeypatch, capsys):
    """No home directory and no $FLCE_TUNING_DB: nothing is kept, --plot still draws the in-memory study."""
    from flce_compile.tuning import cli

    pytest.importorskip("matplotlib")
    monkeypatch.delenv(db.ENV_USER_DB)
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: (_ for _ in ()).throw(RuntimeError("no home"))))
    plots = tmp_path / "plots"
    assert cli.main(["--vocab", "32000", "--hidden", "1024", "--tokens", "8192", "--trials", "4", "--strategies",
                     "torch", "--out", str(tmp_path / "out"), "--plot", str(plots)]) == 0
    assert "keeping the last" not in capsys.readouterr().err
    (history,) = plots.glob("*_history.png")
    assert history.name.startswith("h200_V32000_H1024_bf16_T8192_") and history.stat().st_size > 5000
    assert not list(tmp_path.rglob("*.journal*"))
    assert cli.main(["--list-studies"]) == 1
    assert cli.NO_USER_DB in capsys.readouterr().err


def test_plot_and_replot_errors_are_one_line(fake_tuner, tmp_path, capsys):
    """An unusable --plot DIR is refused before tuning; an unknown or missing study is one line, exit 1."""
    from flce_compile.tuning import cli

    pytest.importorskip("matplotlib")
    (tmp_path / "a_file").write_text("")
    tune = ["--vocab", "32000", "--hidden", "1024", "--tokens", "4096", "--trials", "2"]
    for plot_dir, message in ((tmp_path / "a_file", "is a file; give a directory"),
                              (tmp_path / "a_file" / "below", "cannot write plots to")):
        assert cli.main([*tune, "--plot", str(plot_dir)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("flce-tune: --plot DIR: ") and message in err, err
    assert not fake_tuner.exists()  # refused before any tuning
    plots = str(tmp_path / "plots")
    assert cli.main(["--list-studies"]) == 0
    assert "no kept studies in" in capsys.readouterr().out
    assert cli.main(["--plot", plots, "--replot"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no kept studies to redraw" in err
    assert cli.main([*tune, "--strategies", "torch"]) == 0
    capsys.readouterr()
    assert cli.main(["--plot", plots, "--replot", "h200_nope"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no kept study named 'h200_nope'" in err and "--list-studies" in err
