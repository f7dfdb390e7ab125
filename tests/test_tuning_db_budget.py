"""Budget tiers in the tuning database (issue #12 section 4): entries tuned under a memory budget, their file
format, the lookup a call with ``memory_budget_gb`` makes, which_config / --which with a budget, and flce-tune
--budget-gb writing a tagged entry. CPU only: the GPU is faked where the CLI needs one."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_tuning_cli import _fake_gpu
from test_tuning_db import dbs, entry  # noqa: F401 - dbs is a fixture

from flce_compile.plan.choose import choose_config, choose_config_within_budget, heuristic_config
from flce_compile.plan.config import FLCEConfig
from flce_compile.plan.memory import peak_bytes
from flce_compile.tuning import db
from flce_compile.tuning.which import which_config

CUDA = torch.device("cuda")
#: Llama-3 8B's LM head, the issue's shape.
V, H = 128256, 4096
#: The recompute config the H200 measured at 16384 x 4096 x 128256 (docs/op.md, "Low memory": bound 0.371 GB,
#: 110.5 ms).
TIGHT = FLCEConfig(strategy="recompute", chunk_tokens=4096, vocab_block=4096)
PLAIN = FLCEConfig(strategy="triton", chunk_tokens=2048, block_v=8192, num_warps=8)


def tier(budget_gb: float, config: FLCEConfig = TIGHT, tokens: int = 16384, ms: float = 110.0, **kw) -> db.Entry:
    """A budget-tier entry at Llama-3's shape (numbers are test data, not measurements)."""
    return dataclasses.replace(entry(vocab=V, hidden=H, tokens=tokens, ms=ms, **kw), config=config,
                               budget_tier_gb=budget_gb)


def plain(tokens: int = 16384, ms: float = 80.0) -> db.Entry:
    return dataclasses.replace(entry(vocab=V, hidden=H, tokens=tokens, ms=ms), config=PLAIN)


@pytest.fixture
def h200(monkeypatch):
    """The op's CUDA probe answers "NVIDIA H200", so choose_config on a CUDA device reads the h200 entries."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")


def budget_choice(tokens: int, budget_gb: float) -> tuple[FLCEConfig, str]:
    return choose_config(tokens, V, H, torch.bfloat16, CUDA, memory_budget_gb=budget_gb)


# -- the file format -------------------------------------------------------------------------------------------


def test_tier_entries_round_trip_beside_the_plain_entry(dbs):
    user, _ = dbs
    db.write_entries(user, [plain(), tier(0.5)])
    data = json.loads(user.read_text())
    assert data["schema_version"] == db.SCHEMA_VERSION == 2  # a version-1 reader would misread the tier
    assert [e.get("budget_tier_gb") for e in data["entries"]] == [None, 0.5]  # plain first; no key when plain
    assert "budget_tier_gb" not in data["entries"][0]
    assert db.read_file(user, strict=True) == [plain(), tier(0.5)]
    # a tier entry replaces only its own tier; another tier is added beside it
    db.write_entries(user, [tier(0.5, ms=105.0), tier(1.0)])
    got = {e.key: e for e in db.read_file(user, strict=True)}
    assert set(got) == {plain().key, tier(0.5).key, tier(1.0).key}
    assert got[tier(0.5).key].ms == 105.0 and got[plain().key] == plain()
    # a file that loses its tiers is written as version 1 again
    db.write_entries(user, [plain()], replace=True)
    assert json.loads(user.read_text())["schema_version"] == 1


def test_version_1_files_still_load_and_a_bad_tier_skips_its_entry(dbs):
    user, _ = dbs
    good = plain().to_dict()
    user.parent.mkdir(parents=True, exist_ok=True)
    bad = [{**tier(0.5).to_dict(), "budget_tier_gb": value} for value in (-1, 0, "0.5", True, [0.5])]
    user.write_text(json.dumps({"format": db.FORMAT, "schema_version": 1, "entries": [good, *bad]}))
    assert db.read_file(user) == [plain()]
    _, problems = db.parse_file(user)
    assert len(problems) == 5 and all("budget_tier_gb" in p for p in problems)
    user.write_text(json.dumps({"format": db.FORMAT, "schema_version": 2, "entries": [tier(0.5).to_dict()]}))
    assert db.read_file(user, strict=True) == [tier(0.5)]


# -- the lookup ------------------------------------------------------------------------------------------------


def find_plain(tokens: int = 16384, vocab: int = V):
    return db.lookup(vocab=vocab, hidden=H, dtype=torch.bfloat16, tokens=tokens, device="h200")


def tiers_within(budget_gb: float, tokens: int = 16384) -> list[tuple[int, float, str]]:
    return [(m.entry.tokens, m.entry.budget_tier_gb, m.source) for m in db.find_budget_matches(
        vocab=V, hidden=H, dtype=torch.bfloat16, tokens=tokens, device="NVIDIA H200", budget_gb=budget_gb)]


def test_the_plain_lookup_never_sees_tier_entries(dbs):
    _, shipped = dbs
    db.write_entries(shipped / "h200.json", [tier(0.5), tier(0.5, tokens=4096)])
    assert find_plain() is None  # no plain entry: the heuristic, not the tier's recompute config
    assert find_plain(vocab=131072) is None  # nor does the nearest-shape fallback borrow a tier entry
    db.write_entries(shipped / "h200.json", [plain(tokens=4096)])
    assert find_plain() == (PLAIN, "tuning_db:nearest_tokens(shipped tokens=4096)")


def test_tier_entries_within_a_budget_in_order(dbs):
    user, shipped = dbs
    db.write_entries(shipped / "h200.json", [tier(0.5), tier(2.0), tier(1.0, tokens=8192)])
    db.write_entries(user, [tier(1.0)])
    # the exact bucket first, the largest tier <= the budget first within it; the user layer's source says so
    assert tiers_within(1.5) == [(16384, 1.0, "tuning_db:user_exact(budget 1 GiB)"),
                                 (16384, 0.5, "tuning_db:shipped_exact(budget 0.5 GiB)"),
                                 (8192, 1.0, "tuning_db:nearest_tokens(shipped tokens=8192, budget 1 GiB)")]
    assert [t[:2] for t in tiers_within(10.0)] == [(16384, 2.0), (16384, 1.0), (16384, 0.5), (8192, 1.0)]
    assert [t[:2] for t in tiers_within(1.0, tokens=9000)] == [(8192, 1.0), (16384, 1.0), (16384, 0.5)]
    assert tiers_within(0.4) == []  # every tier is larger than the budget
    assert db.find_budget_matches(vocab=V, hidden=H, dtype="bf16", tokens=16384, device="a100", budget_gb=9) == ()


def test_a_gpu_without_tiers_of_the_shape_takes_its_familys(dbs):
    user, shipped = dbs
    db.write_entries(shipped / "h200.json", [tier(0.5), tier(2.0)])

    def h100_tiers(budget_gb: float) -> list[tuple[float, str, str | None]]:
        return [(m.entry.budget_tier_gb, m.source, m.borrowed_from) for m in db.find_budget_matches(
            vocab=V, hidden=H, dtype="bf16", tokens=16384, device="NVIDIA H100 80GB HBM3", budget_gb=budget_gb)]

    assert h100_tiers(1.0) == [(0.5, "tuning_db:shipped_exact(budget 0.5 GiB) (borrowed from h200)", "h200")]
    assert [t[0] for t in h100_tiers(4.0)] == [2.0, 0.5]
    # a tier of the H100's own within the budget: only its own; one that does not fit leaves the family's
    db.write_entries(user, [tier(1.0, device="h100")])
    assert h100_tiers(4.0) == [(1.0, "tuning_db:user_exact(budget 1 GiB)", None)]
    assert h100_tiers(0.75) == [(0.5, "tuning_db:shipped_exact(budget 0.5 GiB) (borrowed from h200)", "h200")]
    # the first kind of the family (by name) with tiers within the budget: a GH200's larger tier does not hide them
    db.write_entries(user, [tier(4.0, device="gh200"), tier(0.6, device="h800")])
    assert [t[2] for t in h100_tiers(0.75)] == ["h200"]
    assert h100_tiers(8.0)[0][:2] == (1.0, "tuning_db:user_exact(budget 1 GiB)")


# -- choose_config / which_config with a budget ----------------------------------------------------------------


def test_a_tight_budget_picks_the_tier_entry(dbs, h200):
    user, _ = dbs
    db.write_entries(user, [plain(), tier(0.5)])
    assert budget_choice(16384, 0.5) == (TIGHT, "tuning_db:user_exact(budget 0.5 GiB)")
    assert budget_choice(16384, 0.6) == (TIGHT, "tuning_db:user_exact(budget 0.5 GiB)")  # a tier <= the budget
    # a budget below every tier: the plain entry fitted to it, as before tiers existed
    config, source = budget_choice(16384, 0.45)
    assert source == "tuning_db:user_exact, fitted to 0.45 GiB" and config.strategy == "recompute"
    # no budget: the plain entry, whatever tiers exist
    assert choose_config(16384, V, H, torch.bfloat16, CUDA) == (PLAIN, "tuning_db:user_exact")
    # a budget the plain entry fits: the plain entry, unless the tier measured faster at that bucket
    assert budget_choice(16384, 100.0) == (PLAIN, "tuning_db:user_exact")
    db.write_entries(user, [tier(20.0, config=dataclasses.replace(PLAIN, chunk_tokens=4096), ms=75.0)])
    assert budget_choice(16384, 100.0) == (dataclasses.replace(PLAIN, chunk_tokens=4096),
                                           "tuning_db:user_exact(budget 20 GiB)")


def test_the_tier_config_must_fit_at_the_real_token_count(dbs, h200):
    """23000 tokens share the 16384 bucket, but the recompute bound grows with the fp32 dX sum: a tier config
    that fits the budget at 16384 tokens but not at 23000 is passed over for the next one that does."""
    user, _ = dbs
    roomy = FLCEConfig(strategy="recompute", chunk_tokens=4096, vocab_block=8192)
    budget = 0.5
    assert peak_bytes(roomy, 16384, V, H, torch.bfloat16) <= budget * 2**30 < peak_bytes(roomy, 23000, V, H,
                                                                                            torch.bfloat16)
    assert peak_bytes(TIGHT, 23000, V, H, torch.bfloat16) <= budget * 2**30
    db.write_entries(user, [tier(0.5, config=roomy), tier(0.4)])
    assert budget_choice(16384, budget) == (roomy, "tuning_db:user_exact(budget 0.5 GiB)")
    assert budget_choice(23000, budget) == (TIGHT, "tuning_db:user_exact(budget 0.4 GiB)")


def test_nearest_bucket_and_the_heuristic_comparison(dbs, h200):
    user, _ = dbs
    db.write_entries(user, [tier(0.5, tokens=8192)])
    assert budget_choice(16384, 0.5) == (TIGHT, "tuning_db:nearest_tokens(user tokens=8192, budget 0.5 GiB)")
    # no plain entry, a heuristic that fits: a tier entry wins only when its study measured it faster than
    # that very heuristic config (its default)
    heuristic = heuristic_config(16384, V, H, torch.bfloat16, CUDA)
    roomy = dataclasses.replace(heuristic, chunk_tokens=4096)
    db.write_entries(user, [tier(20.0, config=roomy, ms=70.0, extra={"default_config": heuristic.to_dict()})])
    assert budget_choice(16384, 30.0) == (roomy, "tuning_db:user_exact(budget 20 GiB)")
    other_default = dataclasses.replace(heuristic, chunk_tokens=512).to_dict()
    db.write_entries(user, [tier(20.0, config=roomy, ms=70.0, extra={"default_config": other_default})])
    assert budget_choice(16384, 30.0) == (heuristic, "heuristic")


def test_which_config_reports_the_tier_entry(dbs, h200):
    _, shipped = dbs
    db.write_entries(shipped / "h200.json", [plain(), tier(0.5)])
    choice = which_config(16384, V, H, gpu="h200", memory_budget_gb=0.5)
    assert (choice.config, choice.source, choice.detail) == (TIGHT, "shipped exact",
                                                             "tuning_db:shipped_exact(budget 0.5 GiB)")
    assert choice.entry == tier(0.5) and choice.memory_budget_gb == 0.5
    text = str(choice)
    assert text.splitlines()[0] == "h200 within 0.5 GiB: shipped exact (tuning_db:shipped_exact(budget 0.5 GiB))"
    assert "tokens=16384 budget 0.5 GiB: 110.000 ms" in text
    # the op's own path answers the same
    assert (choice.config, choice.detail) == budget_choice(16384, 0.5)
    assert choose_config_within_budget(16384, V, H, torch.bfloat16, CUDA, 0.5)[2].entry == tier(0.5)
    assert which_config(16384, V, H, gpu="h200").entry == plain()  # no budget: the plain entry
    with pytest.raises(ValueError, match="memory_budget_gb=-1 must be a positive finite number of GiB"):
        which_config(16384, V, H, gpu="h200", memory_budget_gb=-1)
    with pytest.raises(ValueError, match="memory_budget_gb=inf must be a positive finite number"):
        which_config(16384, V, H, gpu="h200", memory_budget_gb=float("inf"))
    with pytest.raises(ValueError, match="memory_budget_gb=1e[+]?300 must be a positive finite number"):
        which_config(16384, V, H, gpu="h200", memory_budget_gb=1e300)  # (its bytes overflowed int())
    with pytest.raises(ValueError, match="memory_budget_gb=1000000000000000000000000000000000000000000000"):
        which_config(16384, V, H, gpu="h200", memory_budget_gb=10**400)
    with pytest.raises(TypeError, match="memory_budget_gb='1' must be a number of GiB"):
        which_config(16384, V, H, gpu="h200", memory_budget_gb="1")


def test_cpu_calls_never_read_tier_entries(dbs):
    user, _ = dbs
    db.write_entries(user, [dataclasses.replace(tier(0.5), device="cpu")])
    config, source = choose_config(16384, V, H, torch.bfloat16, torch.device("cpu"), memory_budget_gb=0.5)
    assert config.strategy == "recompute" and source.endswith("fitted to 0.5 GiB")


# -- flce-tune --budget-gb -------------------------------------------------------------------------------------


def test_tune_with_budget_gb_writes_a_tier_entry(tmp_path, monkeypatch, capsys):
    """A study under --budget-gb G writes its winner tagged G beside the plain entry; with the real memory model,
    0.1 GiB at 4096 x 1024 x 32000 leaves only "recompute" (the fp32 dW accumulator alone is 0.12 GiB), and the
    winner is measured against what the op ran under that budget before (fit_budget's pick)."""
    from flce_compile.tuning import cli, measure

    _fake_gpu(monkeypatch)
    monkeypatch.setenv(db.ENV_SHIPPED_DIR, str(tmp_path / "noshipped"))
    measured: list[FLCEConfig] = []

    def fake_make_objective(problem, **kw):
        def objective(c):  # larger chunks and blocks are faster; peaks as the bound says
            measured.append(c)
            return 100.0 / (c.chunk_tokens * c.vocab_block) ** 0.25, peak_bytes(c, problem.tokens, problem.vocab,
                                                                                problem.hidden, problem.dtype)
        return objective

    monkeypatch.setattr(measure, "make_objective", fake_make_objective)
    out = tmp_path / "tiers.json"
    db.write_entries(out, [entry(vocab=32000, hidden=1024, tokens=4096)])  # a plain entry that must stay
    args = ["--vocab", "32000", "--hidden", "1024", "--tokens", "4096", "--trials", "6", "--out", str(out)]
    assert cli.main([*args, "--budget-gb", "0.1"]) == 0
    err = capsys.readouterr().err
    assert "budget-tier entries for 0.1 GiB" in err and "strategies recompute fit" in err
    assert {c.strategy for c in measured} == {"recompute"}  # nothing else was measured
    plain_entry, tight = db.read_file(out, strict=True)
    assert plain_entry == entry(vocab=32000, hidden=1024, tokens=4096)
    assert tight.key == ("h200", 32000, 1024, "bf16", 4096, 0.1) and tight.config.strategy == "recompute"
    assert tight.extra["budget_gb"] == 0.1 and tight.peak_gb * 1e9 <= 0.1 * 2**30
    fitted = FLCEConfig.from_dict(tight.extra["default_config"])
    assert fitted.strategy == "recompute" and tight.default_ms is not None and tight.ms <= tight.default_ms
    # --skip-existing skips the tier it already has, not a tier it lacks
    assert cli.main([*args, "--budget-gb", "0.1", "--skip-existing"]) == 0
    assert "skipped (exists)" in capsys.readouterr().out
    measured.clear()
    assert cli.main([*args, "--budget-gb", "0.2", "--skip-existing", "--no-confirm"]) == 0
    assert measured and len(db.read_file(out, strict=True)) == 3
    # --which --budget-gb reports the tier entry
    monkeypatch.setenv(db.ENV_SHIPPED_DIR, str(tmp_path / "shipped"))
    db.write_entries(tmp_path / "shipped" / "h200.json", db.read_file(out))
    capsys.readouterr()
    assert cli.main(["--which", "--vocab", "32000", "--hidden", "1024", "--tokens", "4096", "--device-kind", "h200",
                     "--budget-gb", "0.15"]) == 0
    assert "on h200 within 0.15 GiB: shipped exact (tuning_db:shipped_exact(budget 0.1 GiB))" in capsys.readouterr().out


def test_a_budget_nothing_fits_skips_the_study(tmp_path, monkeypatch, capsys):
    """16384 x 8192 (Llama-3 70B) at 0.5 GiB: recompute's fp32 dX sum alone is 0.5 GiB, so no config fits; the
    study is skipped with the least any config needs, before the GPU holds any input, and the run goes on."""
    from flce_compile.tuning import cli, measure

    _fake_gpu(monkeypatch)
    monkeypatch.setenv(db.ENV_SHIPPED_DIR, str(tmp_path / "noshipped"))
    monkeypatch.setattr(measure, "make_objective", lambda *a, **k: pytest.fail("no objective for a skipped study"))
    out = tmp_path / "none.json"
    assert cli.main(["--vocab", "128256", "--hidden", "8192", "--tokens", "16384", "--trials", "2",
                     "--budget-gb", "0.5", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "no config of strategies" in captured.err and "the least any needs is 0.533 GiB" in captured.err
    assert "skipped (nothing fits the budget)" in captured.out and not out.exists()
