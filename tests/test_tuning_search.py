"""The search loop (space, pruning, Optuna study, failures, confirmation) with injected deterministic objectives,
and the CPU path of the real objective's correctness check. No GPU."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from flce_compile.config import FLCEConfig
from flce_compile.tuning import space as space_mod
from flce_compile.tuning.search import TrialRejected, classify_failure, run_search
from flce_compile.tuning.space import STRATEGY_PARAMS, SearchSpace

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
    ms = 10.0 if c.strategy == "torch" else 6.0
    ms *= 1 + 0.3 * abs(math.log2(c.chunk_tokens / 2048))
    if c.strategy == "triton":
        ms *= 1 + 0.2 * abs(math.log2(c.block_v / 8192)) + 0.1 * abs(math.log2(c.num_warps / 8)) + 0.05 * (c.num_stages - 2) ** 2
    ms *= 1.0 if c.dw_path == "addmm" else 1.1
    ms *= 0.95 if c.streams else 1.0
    return ms, c.chunk_tokens * 10**6


def all_configs(space: SearchSpace) -> list[FLCEConfig]:
    out = set()
    for strategy in space.strategies:
        names = STRATEGY_PARAMS[strategy]
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
    assert any(r.status == "pruned" and "memory bound" in r.message for r in result.records)
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
    assert "threads" in sp.check(FLCEConfig(strategy="triton", chunk_tokens=256, block_v=1024, num_warps=64))
    assert "per thread" in sp.check(FLCEConfig(strategy="triton", chunk_tokens=256, block_v=8192, num_warps=1))
    assert sp.check(FLCEConfig(strategy="triton", chunk_tokens=256, block_v=4096, num_warps=8)) is None
    # the torch strategy does not read block_v/warps/stages: they are not sampled and are canonicalised away
    a = sp.canonical(FLCEConfig(strategy="torch", block_v=1024, num_warps=4))
    b = sp.canonical(FLCEConfig(strategy="torch", block_v=8192, num_warps=32))
    assert a == b
    assert set(sp.to_params(a)) == {"strategy", "torch.chunk_tokens", "torch.dw_path", "torch.streams"}
    wide = sp.including([FLCEConfig(strategy="triton", chunk_tokens=384, block_v=4096)])
    assert 384 in wide.choices("chunk_tokens")
    with pytest.raises(ValueError, match="strategies"):
        SearchSpace(tokens=1, vocab=1, hidden=1, strategies=("cuda",))
    with pytest.raises(ValueError, match="n_trials"):
        run_search(cost, small_space(), default=DEFAULT, n_trials=0)


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
