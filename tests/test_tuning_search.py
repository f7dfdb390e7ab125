"""The search loop (space, pruning, Optuna study, failures, confirmation) with injected deterministic objectives,
and the CPU path of the real objective's correctness check. No GPU."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from flce_compile.plan.config import FLCEConfig
from flce_compile.tuning import space as space_mod
from flce_compile.tuning.search import TrialRejected, classify_failure, run_search
from flce_compile.plan import registry
from flce_compile.tuning.space import SearchSpace

V, H, T = 32000, 1024, 8192
DEFAULT = FLCEConfig(strategy="triton", chunk_tokens=512, block_v=4096, num_warps=16, num_stages=1)


@pytest.fixture(autouse=True)
def no_memory_model(monkeypatch):
    """The deterministic objectives report their own peaks; keep the op's real memory model out of these tests
    unless a test installs a fake one."""
    monkeypatch.setattr(space_mod, "predicted_peak_bytes", lambda *a, **k: None)


def small_space(**kw) -> SearchSpace:
    args = dict(tokens=T, vocab=V, hidden=H, chunk_tokens=(512, 1024, 2048, 4096), block_v=(4096, 8192),
                num_warps=(8, 16), num_stages=(1, 2), base=DEFAULT)
    args.update(kw)
    return SearchSpace(**args)


def cost(c: FLCEConfig) -> tuple[float, int]:
    """A separable, deterministic 'timing' with a unique optimum; peak grows with the chunk."""
    # recompute runs a fourth GEMM: slower than triton at its best, so the optimum is unique
    ms = {"torch": 10.0, "recompute": 8.0}.get(c.strategy, 6.0)
    ms *= 1 + 0.3 * abs(math.log2(c.chunk_tokens / 2048))
    if c.strategy == "triton":
        ms *= 1 + 0.2 * abs(math.log2(c.block_v / 8192)) + 0.1 * abs(math.log2(c.num_warps / 8)) + 0.05 * (c.num_stages - 2) ** 2
    ms *= 1.0 if c.dw_path == "addmm" else 1.1
    ms *= 0.95 if c.streams else 1.0
    return ms, c.chunk_tokens * 10**6


def all_configs(space: SearchSpace) -> list[FLCEConfig]:
    out = set()
    for strategy in space.strategies:
        names = registry.get(strategy).params
        for values in itertools.product(*(space.choices(n) for n in names)):
            cfg = FLCEConfig(**{**space.base.to_dict(), "strategy": strategy, **dict(zip(names, values))})
            out.add(space.canonical(cfg))
    return [c for c in out if space.check(c) is None]


def brute_force(space: SearchSpace, budget: int | None = None) -> FLCEConfig:
    ok = [c for c in all_configs(space) if budget is None or cost(c)[1] <= budget]
    return min(ok, key=lambda c: cost(c)[0])


def test_finds_optimum_and_default_first():
    sp = small_space()
    calls: list[FLCEConfig] = []

    def objective(c):
        calls.append(c)
        return cost(c)

    result = run_search(objective, sp, default=DEFAULT, n_trials=60, seed=0)
    assert result.best == brute_force(sp)
    assert result.best_ms == pytest.approx(cost(result.best)[0])
    assert calls[0] == sp.canonical(DEFAULT)  # the heuristic default is the first trial
    assert result.default_ms == pytest.approx(cost(DEFAULT)[0])
    assert result.speedup > 2
    assert result.n_measured == 60
    assert len(set(calls)) == len(calls) - 2  # only the two confirmation runs repeat a config


@pytest.mark.parametrize("vocab", [8, 100, 1000, 2048])
def test_the_heuristic_default_is_measured_at_a_small_vocab(vocab):
    """The GPU heuristic's CE block is the one that holds V, with threads to match, where V is below 4096: its
    4096 block broke the kernel's launch rules at V <= 2048, so the tuner never measured the default there (no
    default time, no confirmation against it)."""
    from flce_compile.plan.choose import heuristic_config

    default = heuristic_config(512, vocab, 64, torch.bfloat16, torch.device("cuda"))
    assert registry._kernel_launch_rules(default, vocab) is None and default.block_v >= min(vocab, 4096)
    sp = SearchSpace(tokens=512, vocab=vocab, hidden=64, base=default, strategies=("triton",))
    calls = []
    result = run_search(lambda c: calls.append(c) or (1 + c.num_warps / 100, 0), sp, default=default, n_trials=4,
                        seed=0)
    assert calls[0] == default and result.default_ms is not None and result.speedup is not None


def test_budget_is_respected():
    sp = small_space()
    budget = int(1.5e9)  # chunk 2048 (the unconstrained optimum) needs 2.048e9
    result = run_search(cost, sp, default=DEFAULT, n_trials=50, seed=1, budget_bytes=budget)
    assert result.best == brute_force(sp, budget)
    assert result.best_peak_bytes <= budget
    assert any(r.status == "infeasible" for r in result.records)
    assert all(r.status != "ok" or r.peak_bytes <= budget for r in result.records)


def test_predicted_memory_prunes_before_running(monkeypatch):
    monkeypatch.setattr(space_mod, "predicted_peak_bytes", lambda c, *a, **k: c.chunk_tokens * 10**6)
    seen: list[FLCEConfig] = []

    def objective(c):
        seen.append(c)
        return cost(c)

    result = run_search(objective, small_space(), default=DEFAULT, n_trials=20, seed=0, budget_bytes=int(1.5e9))
    assert seen and all(c.chunk_tokens <= 1024 for c in seen)  # over-budget configs never ran
    # the chunks that cannot fit left the space before the study (within_budget), so none was even proposed
    assert all(r.config.chunk_tokens <= 1024 for r in result.records)
    chunk_choices = {d.choices for t in result.study.trials for n, d in t.distributions.items()
                     if n.endswith(".chunk_tokens")}
    assert chunk_choices == {(512, 1024)}
    assert result.best.chunk_tokens <= 1024


def test_db_config_enqueued_and_never_slower_than_default():
    # the default is the optimum of this objective: the search must return it
    def objective(c):
        return (1.0 if c == small_space().canonical(DEFAULT) else 2.0 + cost(c)[0]), 1

    db_cfg = FLCEConfig(strategy="torch", chunk_tokens=2048)
    calls: list[FLCEConfig] = []

    def tracked(c):
        calls.append(c)
        return objective(c)

    result = run_search(tracked, small_space(), default=DEFAULT, db_config=db_cfg, n_trials=15, seed=3)
    assert calls[1] == small_space().canonical(db_cfg)
    assert result.best == small_space().canonical(DEFAULT)
    assert result.speedup == pytest.approx(1.0)


def test_larger_chunk_neighbours_carry_the_db_entrys_tile():
    """The default's larger-chunk neighbours are measured with the CE tile of the DB entry (the tile
    flce-tune --retune-ce-tiles picked for it), not the default's; neighbours that move the tile themselves, and
    every neighbour when the DB entry runs another strategy, are as before."""
    sp = small_space()
    db_cfg = FLCEConfig(strategy="triton", chunk_tokens=1024, block_v=8192, num_warps=8, num_stages=2)
    calls: list[FLCEConfig] = []

    def tracked(c):
        calls.append(c)
        return cost(c)

    run_search(tracked, sp, default=DEFAULT, db_config=db_cfg, n_trials=5, seed=0, confirm=False)
    assert calls[:2] == [sp.canonical(DEFAULT), sp.canonical(db_cfg)]
    # chunk x2 with the entry's tile is the entry itself (not measured twice); x4 and x8 carry its tile
    assert FLCEConfig(strategy="triton", chunk_tokens=2048, block_v=8192, num_warps=8, num_stages=2) in calls
    assert all((c.block_v, c.num_warps, c.num_stages) != (4096, 16, 1) for c in calls[2:] if c.chunk_tokens > 512)
    assert FLCEConfig(strategy="triton", chunk_tokens=512, block_v=8192, num_warps=16, num_stages=1) in calls  # its own move

    calls.clear()
    run_search(tracked, sp, default=DEFAULT, db_config=FLCEConfig(strategy="torch", chunk_tokens=2048), n_trials=4,
               seed=0, confirm=False)
    assert calls[2] == sp.canonical(dataclasses.replace(DEFAULT, chunk_tokens=1024))  # the default's own tile


def test_failed_trials_are_recorded_and_never_chosen():
    class OutOfResources(Exception):
        pass

    class CompilationError(Exception):
        pass

    def objective(c):
        if c.strategy == "triton" and c.num_warps == 8 and c.block_v == 8192:
            raise TrialRejected("dW relative error 1e0")  # the fastest region is wrong
        if c.strategy == "triton" and c.num_stages == 2 and c.num_warps == 16:
            raise OutOfResources("out of resource: shared memory")
        if c.chunk_tokens == 4096 and c.strategy == "torch":
            raise torch.OutOfMemoryError("CUDA out of memory")
        if c.dw_path == "mm_add" and c.streams and c.strategy == "triton":
            raise CompilationError("at 1:2: compile failed")
        if c == DEFAULT.__class__(**{**DEFAULT.to_dict(), "chunk_tokens": 1024}):  # an enqueued neighbour
            raise RuntimeError("something else")
        return cost(c)

    sp = small_space()
    result = run_search(objective, sp, default=DEFAULT, n_trials=60, seed=0)
    kinds = result.failures()
    assert {"rejected", "out_of_resources", "oom", "compile_error", "error"} <= set(kinds)
    good = [c for c in all_configs(sp) if _ok(objective, c)]
    assert result.best in good
    assert result.best_ms <= 1.25 * min(cost(c)[0] for c in good)
    bad = {r.config for r in result.records if r.status not in ("ok", "duplicate", "pruned")}
    assert result.best not in bad


def _ok(objective, c) -> bool:
    try:
        objective(c)
    except Exception:
        return False
    return True


def test_study_goes_to_the_given_storage(tmp_path):
    """``storage``/``study_name`` put the study where the caller says (a journal file here), with the same
    search as in memory; a new storage object on that file (a later process) reads every trial back."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    in_memory = run_search(cost, small_space(), default=DEFAULT, n_trials=12, seed=0)
    assert in_memory.study is not None and in_memory.study.trials
    path = tmp_path / "study.journal"
    kept = run_search(cost, small_space(), default=DEFAULT, n_trials=12, seed=0,
                      storage=JournalStorage(JournalFileBackend(str(path))), study_name="shape_a")
    assert kept.study.study_name == "shape_a"
    assert (kept.best, kept.best_ms) == (in_memory.best, in_memory.best_ms)  # the storage changes nothing
    reread = optuna.load_study(study_name="shape_a", storage=JournalStorage(JournalFileBackend(str(path))))
    assert len(reread.trials) == len(kept.records)
    assert reread.best_value == pytest.approx(kept.best_ms)
    assert [t.user_attrs["config"] for t in reread.trials] == [r.config.to_json() for r in kept.records]


def test_classify_failure():
    assert classify_failure(TrialRejected("x")) == "rejected"
    assert classify_failure(torch.OutOfMemoryError("CUDA out of memory")) == "oom"
    assert classify_failure(RuntimeError("CUDA error: an illegal memory access was encountered")) == "device_error"
    assert classify_failure(ValueError("boom")) == "error"


def test_confirmation_rejects_a_lucky_winner():
    lucky = FLCEConfig(strategy="torch", chunk_tokens=2048, block_v=DEFAULT.block_v, num_warps=DEFAULT.num_warps,
                       num_stages=DEFAULT.num_stages)
    calls = {"n": 0}

    def objective(c):
        if c == lucky:
            calls["n"] += 1
            return (0.5 if calls["n"] == 1 else 50.0), 1  # fast once, slow when re-measured
        return 5.0 + cost(c)[0] * 0.0 + (0.0 if c == small_space().canonical(DEFAULT) else 1.0), 1

    sp = small_space(strategies=("torch", "triton"))
    result = run_search(objective, sp, default=DEFAULT, db_config=lucky, n_trials=5, seed=0)
    assert calls["n"] == 2
    assert result.best == sp.canonical(DEFAULT)


@pytest.mark.parametrize("winner_ms, winner_peak, kept", [
    (9.9, 2**30, False),      # 1% faster for 1 GiB more: the default stays
    (9.7, 2**30, True),       # 3% faster: worth the memory
    (9.9, 100 * 2**20, True),  # 1% faster at the default's memory: any gain counts
])
def test_confirmation_wants_a_margin_for_more_memory(winner_ms, winner_peak, kept):
    default = small_space().canonical(DEFAULT)

    def objective(c):
        return (10.0, 100 * 2**20) if c == default else (winner_ms + cost(c)[0] * 1e-6, winner_peak)

    result = run_search(objective, small_space(), default=DEFAULT, n_trials=4, seed=0)
    assert (result.best != default) is kept
    if not kept:
        assert result.best_ms == 10.0 and result.best_peak_bytes == 100 * 2**20
    off = run_search(objective, small_space(), default=DEFAULT, n_trials=4, seed=0, memory_gain_margin=0.0)
    assert off.best != default  # without the margin any confirmed gain wins
    with pytest.raises(ValueError, match="memory_gain_margin"):
        run_search(objective, small_space(), default=DEFAULT, n_trials=4, memory_gain_margin=-0.1)


def test_device_error_and_interrupt_stop_the_study():
    def broken(c):
        if c != small_space().canonical(DEFAULT):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return cost(c)

    result = run_search(broken, small_space(), default=DEFAULT, n_trials=30, seed=0)
    assert result.stopped == "device_error"
    assert result.n_measured == 2 and result.best == small_space().canonical(DEFAULT)

    n = {"calls": 0}

    def interrupted(c):
        n["calls"] += 1
        if n["calls"] == 4:
            raise KeyboardInterrupt
        return cost(c)

    result = run_search(interrupted, small_space(), default=DEFAULT, n_trials=30, seed=0)
    assert result.stopped == "interrupted"
    assert result.best is not None and result.best_ms == min(r.ms for r in result.records if r.status == "ok")


def test_exhausted_space_stops_early_and_timeout():
    sp = small_space(strategies=("torch",), chunk_tokens=(512, 1024), dw_path=("addmm",), streams=(False,))
    result = run_search(cost, sp, default=FLCEConfig(strategy="torch", chunk_tokens=512), n_trials=40, seed=0,
                        max_idle=10)
    assert result.stopped == "exhausted" and result.n_measured == 2
    assert result.best.chunk_tokens == 1024

    import time

    def slow(c):
        time.sleep(0.05)
        return cost(c)

    result = run_search(slow, small_space(), default=DEFAULT, n_trials=1000, seed=0, timeout_s=0.3, confirm=False)
    assert result.stopped == "timeout" and 1 <= result.n_measured < 20


def test_space_rules():
    sp = SearchSpace(tokens=3000, vocab=5000, hidden=64)
    assert max(sp.choices("chunk_tokens")) == 4096  # chunk > tokens (rounded up to pow2) is not offered
    assert sp.check(FLCEConfig(strategy="torch", chunk_tokens=8192)).startswith("chunk_tokens")
    assert "block_v" in sp.check(FLCEConfig(strategy="triton", chunk_tokens=256, block_v=16384))  # > vocab
    assert "threads" in sp.check(FLCEConfig(strategy="triton", chunk_tokens=256, block_v=512, num_warps=32))
    assert "per thread" in sp.check(FLCEConfig(strategy="triton", chunk_tokens=256, block_v=8192, num_warps=1))
    assert sp.check(FLCEConfig(strategy="triton", chunk_tokens=256, block_v=4096, num_warps=8)) is None
    # the torch strategy does not read block_v/warps/stages: they are not sampled and are canonicalised away
    a = sp.canonical(FLCEConfig(strategy="torch", block_v=1024, num_warps=4))
    b = sp.canonical(FLCEConfig(strategy="torch", block_v=8192, num_warps=32))
    assert a == b
    assert set(sp.to_params(a)) == {"strategy", "torch.chunk_tokens", "torch.dw_path", "torch.streams",
                                    "torch.pad_vocab"}
    wide = sp.including([FLCEConfig(strategy="triton", chunk_tokens=384, block_v=4096)])
    assert 384 in wide.choices("chunk_tokens")
    with pytest.raises(ValueError, match="strategies"):
        SearchSpace(tokens=1, vocab=1, hidden=1, strategies=("cuda",))
    with pytest.raises(ValueError, match="chunk_tokens"):
        SearchSpace(tokens=100, vocab=1000, hidden=64, chunk_tokens=(512, 1024))  # nothing <= 128
    with pytest.raises(ValueError, match="n_trials"):
        run_search(cost, small_space(), default=DEFAULT, n_trials=0)


def test_the_rounding_dw_path_only_searched_where_it_differs():
    """dw_path "addmm_round" runs as "addmm" unless the last chunk's GEMM can finish dW (bf16 with fp32 sums): only
    there is it sampled; elsewhere it is canonicalised to "addmm"."""
    bf16 = SearchSpace(tokens=4096, vocab=128256, hidden=768)
    assert bf16.dw_finish_possible() and bf16.choices("dw_path") == ("addmm", "addmm_round", "mm_add")
    rounding = FLCEConfig(strategy="triton", chunk_tokens=1024, dw_path="addmm_round")
    assert bf16.canonical(rounding).dw_path == "addmm_round"
    for other in (SearchSpace(tokens=4096, vocab=128256, hidden=768, dtype=torch.float16),
                  SearchSpace(tokens=4096, vocab=128256, hidden=768, dtype=torch.float32),
                  SearchSpace(tokens=4096, vocab=128256, hidden=768, accum_dtype=torch.bfloat16)):
        assert not other.dw_finish_possible() and other.choices("dw_path") == ("addmm", "mm_add")
        assert other.canonical(rounding).dw_path == "addmm"


def test_pad_vocab_only_searched_where_v_needs_it():
    """GPT-2's V (rows of 100514 bytes) can be padded; 128256 (a multiple of 128 bytes) cannot, so there the
    switch is not sampled and canonicalised away (both values run identically)."""
    odd = SearchSpace(tokens=4096, vocab=50257, hidden=768)
    assert odd.vocab_needs_padding() and odd.choices("pad_vocab") == (False, True)
    base = FLCEConfig(strategy="triton", chunk_tokens=1024)
    assert odd.neighbours(base)[0] == FLCEConfig(strategy="triton", chunk_tokens=1024, pad_vocab=True)
    aligned = SearchSpace(tokens=4096, vocab=128256, hidden=768)
    assert not aligned.vocab_needs_padding() and aligned.choices("pad_vocab") == (False,)
    assert aligned.canonical(FLCEConfig(strategy="triton", pad_vocab=True)).pad_vocab is False
    assert all(not c.pad_vocab for c in aligned.neighbours(base))


def test_default_grid_has_half_steps_and_prunes_them(monkeypatch):
    """The default chunk grid holds the powers of two and the 1.5x steps between them; pruning treats both alike:
    nothing above the token count rounded up to a power of two, and a memory budget can admit a 1.5x step that
    the next power of two misses."""
    sp = SearchSpace(tokens=8192, vocab=V, hidden=H)
    assert sp.choices("chunk_tokens") == (128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
    assert sp.check(FLCEConfig(strategy="torch", chunk_tokens=12288)).startswith("chunk_tokens")
    assert sp.check(FLCEConfig(strategy="torch", chunk_tokens=6144)) is None
    assert max(SearchSpace(tokens=3000, vocab=V, hidden=H).choices("chunk_tokens")) == 4096
    assert 3072 in SearchSpace(tokens=3000, vocab=V, hidden=H).choices("chunk_tokens")
    # 1.5x neighbours of a 1.5x default are on the grid
    default = FLCEConfig(strategy="triton", chunk_tokens=1536, block_v=4096, num_warps=16)
    assert [c.chunk_tokens for c in sp.neighbours(default)][:2] == [3072, 6144]
    # predicted-memory pruning with the half steps: a 1.6e9 budget keeps 1536 and prunes 2048
    budgeted = SearchSpace(tokens=8192, vocab=V, hidden=H, budget_bytes=int(1.6e9))
    monkeypatch.setattr(space_mod, "predicted_peak_bytes", lambda c, *a, **k: c.chunk_tokens * 10**6)
    assert budgeted.over_budget(FLCEConfig(chunk_tokens=1536)) is None
    assert budgeted.over_budget(FLCEConfig(chunk_tokens=2048)).startswith("memory bound")
    result = run_search(cost, SearchSpace(tokens=8192, vocab=V, hidden=H, strategies=("torch",), base=DEFAULT),
                        default=FLCEConfig(strategy="torch", chunk_tokens=512), n_trials=12, seed=0,
                        budget_bytes=int(1.6e9))
    assert result.best.chunk_tokens == 1536  # cost() is fastest at 2048; 1536 is the best that fits
    assert all(r.status != "ok" or r.config.chunk_tokens <= 1536 for r in result.records)


def test_chunks_at_least_the_token_count_are_measured_once():
    """With 1.5x steps, tokens=3000 admits 3072 and 4096, which both run as one chunk of 3000 tokens: only one
    of them costs device time, the other is answered from the cache as a duplicate."""
    sp = SearchSpace(tokens=3000, vocab=V, hidden=H, strategies=("torch",), chunk_tokens=(1024, 2048, 3072, 4096),
                     dw_path=("addmm",), streams=(False,))
    assert sp.run_key(FLCEConfig(chunk_tokens=3072)) == sp.run_key(FLCEConfig(chunk_tokens=4096))
    assert sp.run_key(FLCEConfig(chunk_tokens=2048)) == FLCEConfig(chunk_tokens=2048)
    measured: list[int] = []

    def objective(c):
        measured.append(c.chunk_tokens)
        return 10.0 / min(c.chunk_tokens, 3000), 1

    result = run_search(objective, sp, default=FLCEConfig(strategy="torch", chunk_tokens=1024), n_trials=10, seed=0,
                        max_idle=15, confirm=False)
    assert result.stopped == "exhausted" and result.n_measured == 3
    assert sorted(measured) in ([1024, 2048, 3072], [1024, 2048, 4096])
    assert any(r.status == "duplicate" for r in result.records)


def test_confirmation_reports_the_larger_peak():
    """After the confirmation run the default's and the winner's peaks are the larger of their two measurements
    (a first-trial peak that came out too low, or negative, does not survive)."""
    runs = {"n": 0}
    default = small_space().canonical(DEFAULT)

    def objective(c):
        runs["n"] += 1
        if c == default:
            return 10.0, (-5 if runs["n"] == 1 else 7)  # the first trial of a study under-reported its peak
        return cost(c)[0] * 0.1, 3

    result = run_search(objective, small_space(), default=DEFAULT, n_trials=4, seed=0)
    assert result.best != default and result.default_peak_bytes == 7 and result.best_peak_bytes == 3


# ---- the real objective's correctness check, on CPU with a tiny problem --------------------------------------

def _good_op(x, w, target, *, config):
    return F.cross_entropy(x @ w.T, target, ignore_index=-100)


def _scaled_loss_op(x, w, target, *, config):
    return F.cross_entropy(x @ w.T, target, ignore_index=-100) * 1.01


def _skip_vocab_rows_op(x, w, target, *, config):
    # a kernel that forgets the last 3 vocab entries: dW rows are wrong, the global norm barely moves
    logits = x @ w.T
    logits = torch.cat([logits[:, :-3], logits[:, -3:].detach()], dim=1)
    return F.cross_entropy(logits, target, ignore_index=-100)


def test_measure_objective_on_cpu():
    from flce_compile.tuning.measure import Problem, make_objective, reference

    problem = Problem(tokens=96, vocab=700, hidden=48, dtype=torch.float32, device=torch.device("cpu"))
    x, w, target = problem.make_inputs()
    loss, dx, dw = reference(x, w, target, chunk_bytes=4 * 700 * 40)  # several chunks
    ref = F.cross_entropy(x.detach() @ w.detach().T, target, ignore_index=-100)
    gx, gw = torch.autograd.grad(F.cross_entropy(x @ w.T, target, ignore_index=-100), (x, w))
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, gx, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(dw, gw, rtol=1e-4, atol=1e-6)

    ms, peak = make_objective(problem, op=_good_op, warmup=1, target_ms=1)(FLCEConfig())
    assert ms > 0 and peak == 0
    with pytest.raises(TrialRejected, match="loss"):
        make_objective(problem, op=_scaled_loss_op, warmup=1)(FLCEConfig())
    with pytest.raises(TrialRejected, match="dW worst row"):
        make_objective(problem, op=_skip_vocab_rows_op, warmup=1)(FLCEConfig())
    with pytest.raises(ValueError, match="min_reps"):
        make_objective(problem, op=_good_op, min_reps=3)


class _FakeMemory:
    """Allocator statistics in the shape of measure._CudaMemory, driven by the fake op below."""

    def __init__(self, garbage: int = 0) -> None:
        self.current = self.peak = garbage

    def allocated(self) -> int:
        return self.current

    def reset_peak(self) -> None:
        self.peak = self.current

    def max_allocated(self) -> int:
        return self.peak

    def alloc(self, n: int) -> None:
        self.current += n
        self.peak = max(self.peak, self.current)


def test_measured_peak_excludes_warm_up_and_survives_a_collection(monkeypatch, caplog):
    """The peak run comes after a warm-up run (a one-time workspace allocation is not charged to the trial), with
    the garbage collector off, and the returned gradients are subtracted by their real size. A run during which
    unrelated memory is freed cannot report a negative peak."""
    import gc
    import logging

    from flce_compile.tuning import measure

    problem = measure.Problem(tokens=96, vocab=700, hidden=48, dtype=torch.float32, device=torch.device("cpu"))
    grads = (96 * 48 + 700 * 48) * 4
    mem = _FakeMemory()
    monkeypatch.setattr(measure, "_memory_stats", lambda device: mem)
    state = {"workspace": False, "gc": [], "free_garbage": 0}

    def op(x, w, target, *, config):
        state["gc"].append(gc.isenabled())
        if not state["workspace"]:  # e.g. cuBLAS's workspace, made by the first GEMM and kept
            mem.alloc(10_000)
            state["workspace"] = True
        mem.current -= state["free_garbage"]  # an earlier study's tensors freed now (a collection mid-run)
        state["free_garbage"] = 0
        mem.alloc(3000)  # the op's own temporaries
        mem.alloc(grads)  # dX and dW, alive at the peak
        mem.current -= 3000 + grads  # bookkeeping only: the next run starts where this one did
        return F.cross_entropy(x @ w.T, target, ignore_index=-100)

    objective = measure.make_objective(problem, op=op, warmup=2, target_ms=1)
    ms, peak = objective(FLCEConfig())
    assert ms > 0 and peak == 3000
    assert state["gc"][:3] == [True, False, True]  # warm-up, peak run (collector off), the second warm-up
    assert gc.isenabled()
    caplog.set_level(logging.WARNING, logger="flce_compile")
    mem.current += 50_000  # garbage alive when `before` is read, freed inside the measured run
    state["free_garbage"] = 50_000
    state["gc"].clear()
    # the warm-up run frees it here, so the peak run is clean ...
    assert objective(FLCEConfig())[1] == 3000
    # ... and if it is freed inside the peak run itself, the peak is reported as 0, never negative
    mem.current += 50_000
    calls = {"n": 0}
    original_op = op

    def late_free_op(x, w, target, *, config):
        calls["n"] += 1
        if calls["n"] == 2:
            state["free_garbage"] = 50_000
        return original_op(x, w, target, config=config)

    ms, peak = measure.make_objective(problem, op=late_free_op, warmup=1, target_ms=1)(FLCEConfig())
    assert peak == 0 and "negative" in caplog.text
