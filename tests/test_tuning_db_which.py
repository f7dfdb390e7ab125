"""which_config (issue #15): the config the op would pick and its source, on a CPU-only machine, for every kind
of source; and choose_config's CPU answer."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_tuning_db import dbs, entry  # noqa: F401 - dbs is a fixture

import flce_compile
from flce_compile.plan.choose import CPU_SOURCE, choose_config, choose_config_match, heuristic_config
from flce_compile.tuning import db
from flce_compile.tuning.which import SOURCES, ConfigChoice, which_config

REPO = Path(__file__).resolve().parents[1]
CUDA = torch.device("cuda")


def test_each_source_is_what_the_op_would_pick_on_that_gpu(dbs, monkeypatch):
    user, shipped = dbs
    db.write_entries(shipped / "h200.json", [entry(chunk=1024), entry(tokens=4096, chunk=256),
                                             entry(vocab=128256, tokens=8192, chunk=4096)])
    db.write_entries(user, [entry(vocab=32000, hidden=1024, chunk=512)])
    cases = {  # (tokens, vocab, hidden) -> (source, key of the entry it came from)
        (16384, 32000, 1024): ("user exact", ("h200", 32000, 1024, "bf16", 16384, None)),
        (16384, 151936, 4096): ("shipped exact", ("h200", 151936, 4096, "bf16", 16384, None)),
        (2000, 151936, 4096): ("nearest bucket", ("h200", 151936, 4096, "bf16", 4096, None)),
        (8192, 131072, 4096): ("nearest shape", ("h200", 128256, 4096, "bf16", 8192, None)),
        (16384, 2000, 128): ("heuristic", None),
    }
    choices = {args: which_config(*args, gpu="h200") for args in cases}
    assert {c.source for c in choices.values()} == set(SOURCES)
    # the op on an H200 (the CUDA probe faked) picks the same config with the same source string
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    for (tokens, vocab, hidden), (source, key) in cases.items():
        choice = choices[tokens, vocab, hidden]
        assert (choice.source, choice.target) == (source, "h200")
        assert (choice.entry.key if choice.entry else None) == key
        assert (choice.config, choice.detail) == choose_config(tokens, vocab, hidden, torch.bfloat16, CUDA)
    assert choices[16384, 2000, 128].config == heuristic_config(16384, 2000, 128, torch.bfloat16, CUDA)
    assert choices[16384, 2000, 128].config.strategy == "triton"  # the GPU heuristic, computed on a CPU
    # a GPU name and a dtype name work as well as a kind and a torch dtype
    assert which_config(16384, 32000, 1024, dtype="bf16", gpu="NVIDIA H200 NVL") == choices[16384, 32000, 1024]


def test_an_h100_answer_names_the_kind_it_borrowed_from(dbs, monkeypatch):
    _, shipped = dbs
    db.write_entries(shipped / "h200.json", [entry(chunk=1024)])
    choice = which_config(16384, 151936, 4096, gpu="h100")
    assert (choice.source, choice.target, choice.borrowed_from, choice.entry.device) == (
        "shipped exact", "h100", "h200", "h200")
    assert choice.config == entry(chunk=1024).config and "borrowed from h200" in str(choice)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert choose_config(16384, 151936, 4096, torch.bfloat16, CUDA) == (choice.config, choice.detail)
    assert which_config(16384, 151936, 4096, gpu="h200").borrowed_from is None
    # a shape the family has nothing near: the plain heuristic (the DB has entries for the H100, through the H200)
    far = which_config(16384, 2000, 128, gpu="h100")
    assert (far.source, far.detail, far.borrowed_from) == ("heuristic", "heuristic", None)
    assert "no entries for GPU kind 'a100'" in which_config(16384, 2000, 128, gpu="a100").detail


def test_a_plain_recompute_entry_is_answered_as_the_op_runs_it(dbs, monkeypatch):
    """The op runs a plain pick of a "recompute" config as the heuristic (it runs one only when forced):
    which_config answers what the op runs, and says why."""
    import dataclasses

    from flce_compile.plan.choose import op_config

    user, _ = dbs
    recompute = dataclasses.replace(entry().config, strategy="recompute")
    db.write_entries(user, [dataclasses.replace(entry(), config=recompute)])
    choice = which_config(16384, 151936, 4096, gpu="h200")
    assert choice.config == heuristic_config(16384, 151936, 4096, torch.bfloat16, CUDA) != recompute
    assert (choice.source, choice.entry, choice.borrowed_from) == ("heuristic", None, None)
    assert choice.detail.startswith("heuristic (tuning_db:user_exact holds a 'recompute' config")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert op_config("", 16384, 151936, 4096, torch.bfloat16, CUDA) == choice.config
    # every other reporter says the same: choose_config (explain, bench_tuning) and the tuner's seed
    assert choose_config(16384, 151936, 4096, torch.bfloat16, CUDA) == (choice.config, choice.detail)
    from flce_compile.tuning.cli import _db_seed
    assert _db_seed(151936, 4096, torch.bfloat16, 16384, "NVIDIA H200", None) is None
    # where the strategy is forced, the entry answers: under a budget (the whole pick is forced) and with a config
    # naming the strategy (the entry gives the other fields)
    budget = which_config(16384, 151936, 4096, gpu="h200", memory_budget_gb=0.6)
    assert (budget.config, budget.source) == (recompute, "user exact")
    assert op_config('{"strategy": "recompute"}', 16384, 151936, 4096, torch.bfloat16, CUDA) == recompute


def test_on_the_cpu_the_answer_says_the_db_is_for_gpus(dbs, monkeypatch):
    user, _ = dbs
    db.write_entries(user, [entry(device="cpu", chunk=512)])  # even a CPU entry is not used
    config, source = choose_config(16384, 151936, 4096, torch.bfloat16, torch.device("cpu"))
    assert source == CPU_SOURCE == "heuristic (the tuning DB holds GPU entries; CPU calls use the heuristic)"
    assert config == heuristic_config(16384, 151936, 4096, torch.bfloat16, torch.device("cpu"))
    choice = which_config(16384, 151936, 4096, device="cpu")
    assert (choice.config, choice.source, choice.detail, choice.target, choice.entry) == (
        config, "heuristic", CPU_SOURCE, "cpu", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert which_config(16384, 151936, 4096) == choice  # no GPU here: the default device is the CPU


def test_the_real_shipped_h200_file_answers_without_a_gpu(monkeypatch):
    monkeypatch.delenv(db.ENV_SHIPPED_DIR, raising=False)
    monkeypatch.setenv(db.ENV_USER_DB, "/nonexistent/flce_user_db.json")
    db.invalidate_cache()
    try:
        choice = which_config(16384, 151936, 4096, gpu="h200")
    finally:
        db.invalidate_cache()
    assert (choice.source, choice.detail) == ("shipped exact", "tuning_db:shipped_exact")
    assert choice.entry in db.read_file(REPO / "tuning_db" / "h200.json", strict=True)
    assert choice.config == choice.entry.config


def test_the_real_shipped_h100_file_answers_with_the_h200s_where_it_has_no_entry(monkeypatch):
    """tuning_db/h100.json holds the H100's own studies at a few shapes; an H100 call runs them there and the
    H200's entry of its bucket elsewhere (closer than an H100 entry of another bucket)."""
    monkeypatch.delenv(db.ENV_SHIPPED_DIR, raising=False)
    monkeypatch.setenv(db.ENV_USER_DB, "/nonexistent/flce_user_db.json")
    db.invalidate_cache()
    try:
        own = which_config(16384, 128256, 4096, gpu="h100")
        other_bucket = which_config(8192, 128256, 4096, gpu="NVIDIA H100 80GB HBM3")
        other_shape = which_config(16384, 151936, 5120, gpu="h100")
    finally:
        db.invalidate_cache()
    h100 = db.read_file(REPO / "tuning_db" / "h100.json", strict=True)
    assert {e.device for e in h100} == {"h100"}
    assert (own.source, own.detail, own.borrowed_from) == ("shipped exact", "tuning_db:shipped_exact", None)
    assert own.entry in h100 and own.config == own.entry.config
    for choice in (other_bucket, other_shape):
        assert (choice.source, choice.borrowed_from, choice.entry.device) == ("shipped exact", "h200", "h200")
        assert choice.detail == "tuning_db:shipped_exact (borrowed from h200)"


def test_readable_str_and_errors(dbs):
    _, shipped = dbs
    db.write_entries(shipped / "h200.json", [entry(tokens=4096, chunk=256)])
    text = str(which_config(2000, 151936, 4096, gpu="h200"))
    assert text.splitlines()[0] == "h200: nearest bucket (tuning_db:nearest_tokens(shipped tokens=4096))"
    assert '"chunk_tokens": 256' in text and "h200 V=151936 H=4096 bf16 tokens=4096: 10.000 ms, 1.50x" in text
    assert str(which_config(8, 8, 8, device="cpu")).splitlines()[0] == f"cpu: {CPU_SOURCE}"
    with pytest.raises(ValueError, match="not both"):
        which_config(16384, 151936, 4096, device="cuda", gpu="h200")
    for device in ("cuda", "cuda:1", "cpu", "mps", "meta", ""):  # (a device as the kind gave the heuristic, silently)
        with pytest.raises(ValueError, match="must name a GPU kind"):
            which_config(16384, 151936, 4096, gpu=device)
    with pytest.raises(ValueError, match="tokens=0 must be a positive int"):
        which_config(0, 151936, 4096, gpu="h200")
    for bad in (True, 2.5, torch.tensor(16.0), torch.tensor(True), torch.tensor([16])):
        with pytest.raises(ValueError, match="must be a positive int"):
            which_config(bad, 151936, 4096, gpu="h200")
    # a kind the DB has no entry for is answered by the heuristic, which says so and names the kinds it has
    assert str(which_config(2000, 151936, 4096, gpu="h2OO")).splitlines()[0] == (
        "h2oo: heuristic (the tuning DB holds no entries for GPU kind 'h2oo'; it has h200)")
    # any integer type counts (numpy's, a 0-dim integer tensor: refused until 2026-12-05), answered as the int
    assert which_config(np.int64(2000), torch.tensor(151936), 4096, gpu="h200").config == \
        which_config(2000, 151936, 4096, gpu="h200").config
    with pytest.raises(ValueError, match="dtype=torch.int8 is not one the op runs"):
        which_config(16384, 151936, 4096, dtype=torch.int8, gpu="h200")
    if not torch.cuda.is_available():  # (torch's own AssertionError named no argument)
        with pytest.raises(ValueError, match="device='cuda', but this torch sees no CUDA device"):
            which_config(16384, 151936, 4096, device="cuda")


def test_fp64_which_the_op_runs_answers_as_the_op_picks(dbs):
    """fp64 (the checking dtype) is never tuned, but the op runs it: which_config refused it as "not tunable"."""
    for device, gpu in (("cpu", None), (None, "h200")):
        for dtype in (torch.float64, "fp64", "float64", "double"):
            choice = which_config(64, 1000, 32, dtype=dtype, device=device, gpu=gpu)
            config, detail, match = choose_config_match(64, 1000, 32, torch.float64, torch.device(device or "cuda"),
                                                        gpu=gpu)
            assert match is None and (choice.config, choice.source, choice.detail) == (config, "heuristic", detail)


def test_fp64_under_a_budget_answers_for_fp64_accumulators_as_the_op_runs(monkeypatch):
    """The op accumulates fp64 weights in fp64; which_config fitted the budget for fp32 accumulators and named
    another config than the op ran (a review's case: 512 x 256 against 4096 classes at 0.01 GB)."""
    import flce_compile.api as api

    picked = []
    real = api.config_within_budget

    def spy(*args, **kwargs):
        picked.append(real(*args, **kwargs)[0])
        return picked[-1]

    monkeypatch.setattr(api, "config_within_budget", lambda *a, **k: (spy(*a, **k), "spied"))
    x, w = torch.randn(512, 256, dtype=torch.float64), torch.randn(4096, 256, dtype=torch.float64)
    t = torch.randint(0, 4096, (512,))
    for budget in (0.006, 0.01, 0.02):
        flce_compile.fused_linear_cross_entropy(x.requires_grad_(), w.requires_grad_(), t, memory_budget_gb=budget)
        assert which_config(512, 4096, 256, dtype=torch.float64, device="cpu",
                            memory_budget_gb=budget).config == picked[-1], budget


def test_exported_from_the_package_without_importing_dynamo():
    assert flce_compile.which_config is which_config and flce_compile.ConfigChoice is ConfigChoice
    assert {"which_config", "ConfigChoice"} <= set(flce_compile.__all__)
    code = "import sys, flce_compile; assert 'torch._dynamo' not in sys.modules, 'dynamo imported'"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_one_chunk_entry_runs_a_longer_call_as_one_chunk(dbs):
    """An entry timed as one chunk answers its whole token bucket; a call with more tokens than its chunk runs as
    one chunk too (rounded up to 256 tokens): no fp32 dW accumulator, which a full and a short chunk would need.
    The token count the entry was measured at, calls that fit its chunk, and entries timed with several chunks
    run as stored."""
    _, shipped = dbs
    db.write_entries(shipped / "h200.json", [entry(vocab=256000, hidden=2304, tokens=8192, chunk=8192),
                                             entry(tokens=16384, chunk=6144)])
    gemma = {n: which_config(n, 256000, 2304, gpu="h200") for n in (6000, 8192, 8193, 10000, 11585)}
    assert {n: c.config.chunk_tokens for n, c in gemma.items()} == {
        6000: 8192, 8192: 8192, 8193: 8448, 10000: 10240, 11585: 11776}
    assert gemma[8192].detail == "tuning_db:shipped_exact"
    assert gemma[10000].detail == "tuning_db:shipped_exact, one chunk of 10240 tokens"
    assert gemma[10000].entry.config.chunk_tokens == 8192 and gemma[10000].source == "shipped exact"
    stored = gemma[10000].entry.config
    assert flce_compile.peak_bytes(gemma[10000].config, 10000, 256000, 2304, torch.bfloat16) < \
        flce_compile.peak_bytes(stored, 10000, 256000, 2304, torch.bfloat16)
    several = which_config(20000, 151936, 4096, gpu="h200")
    assert several.config.chunk_tokens == 6144 and several.detail == "tuning_db:shipped_exact"
    # a nearest-bucket answer (no entry for the call's bucket) runs the entry's chunk: one chunk of 65536 tokens
    # would hold ~34 GB
    for tokens in (16384, 65536):
        far = which_config(tokens, 256000, 2304, gpu="h200")
        assert far.source == "nearest bucket" and far.config.chunk_tokens == 8192, (tokens, far)


def test_one_chunk_reads_only_the_entrys_own_config_and_a_sane_measured_count(dbs):
    """Nearest-shape answers (their chunk is rescaled already) keep their chunk; an entry's measured token count
    that is no positive int falls back to its bucket instead of breaking the call; the tuner seeds a study with
    what the op runs (the one-chunk config)."""
    from flce_compile.tuning.cli import _db_seed

    _, shipped = dbs
    gemma = entry(vocab=256000, hidden=2304, tokens=8192, chunk=8192, extra={"measured_tokens": "8192"})
    assert gemma.measured_tokens == 8192
    for bad, want in (("8192", 8192), (True, 8192), (-1, 8192), (6000, 6000)):
        assert entry(tokens=8192, extra={"measured_tokens": bad}).measured_tokens == want
    db.write_entries(shipped / "h200.json", [gemma])
    assert which_config(10000, 256000, 2304, gpu="h200").config.chunk_tokens == 10240
    near = which_config(8192, 262144, 2304, gpu="h200")
    assert near.source == "nearest shape" and "one chunk" not in near.detail
    assert _db_seed(256000, 2304, torch.bfloat16, 10000, "h200", None).chunk_tokens == 10240
    assert _db_seed(256000, 2304, torch.bfloat16, 8192, "h200", None).chunk_tokens == 8192


def test_an_empty_call_on_a_gpu_is_answered_by_the_heuristic_without_a_warning(dbs, monkeypatch, caplog):
    """0 tokens, or H = 0, which the op supports, made the lookup raise inside (token_bucket(0), a distance
    divided by H), reported as a failed tuning-DB lookup though nothing was wrong with the DB."""
    from flce_compile.plan.choose import op_config

    user, _ = dbs
    db.write_entries(user, [entry()])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    with caplog.at_level(logging.DEBUG, logger="flce_compile"):
        for tokens, hidden in ((0, 4096), (64, 0)):
            config = op_config("", tokens, 151936, hidden, torch.bfloat16, CUDA)
            assert config == heuristic_config(tokens, 151936, hidden, torch.bfloat16, CUDA)
            assert choose_config(tokens, 151936, hidden, torch.bfloat16, CUDA, memory_budget_gb=4.0)[1] == "heuristic"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
