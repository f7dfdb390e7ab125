"""The real objective: run the fused op with one config, check it against a reference, time it, report peak memory.

Why each step:
* Correctness first: a config that is fast but wrong (a kernel block that skips vocab entries, a stream race)
  must never reach the database, so every trial's loss and gradients are compared with an independent fp32
  reference before it is timed; a mismatch raises ``TrialRejected``.
* Timing: fwd+bwd, a fixed number of untimed runs, then at least ``min_reps`` timed runs with CUDA events
  (one pair per run), median. Gradients are reset outside the timed region.
* Peak memory: ``torch.cuda.max_memory_allocated`` over one fwd+bwd, minus what was allocated before it
  (inputs, reference results) and minus the returned dX and dW: the same quantity the op's sympy bound
  (``flce_compile.plan.memory.peak_bytes``) describes, so the two can be compared. That run comes after one
  warm-up run, so one-time allocations (cuBLAS workspaces, a side stream's workspace, Triton compilation)
  are not charged to the config that happens to run first; garbage is collected before it and the collector
  is off during it, so memory freed by an unrelated collection cannot hide the run's allocations.

On CPU the same code runs with ``time.perf_counter`` and a peak of 0 (used by tests with a small op).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..plan.config import FLCEConfig
from ..log import logger
from .search import Objective, TrialRejected

#: op(input, weight, target, *, config) -> scalar mean loss; defaults to flce_compile.fused_linear_cross_entropy.
Op = Callable[..., torch.Tensor]

#: (loss relative error, gradient relative Frobenius error, per-row relative error) allowed per input dtype.
TOLERANCES: dict[torch.dtype, tuple[float, float, float]] = {
    torch.bfloat16: (5e-3, 3e-2, 0.15),
    torch.float16: (5e-3, 2e-2, 0.1),
    torch.float32: (1e-3, 5e-3, 0.02),
}


def default_op() -> Op:
    """The package's fused op, imported lazily (the op module may load Triton)."""
    from ..api import fused_linear_cross_entropy  # noqa: PLC0415

    return fused_linear_cross_entropy


@dataclass
class Problem:
    """One tuning problem: a (tokens x hidden) input, a (vocab x hidden) weight, random targets."""

    tokens: int
    vocab: int
    hidden: int
    dtype: torch.dtype = torch.bfloat16
    device: torch.device = torch.device("cuda")
    ignore_fraction: float = 0.05
    seed: int = 0

    def make_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inputs whose logits are ~N(0, 1) (a realistic softmax), with some ignored targets."""
        # Generated on the device: a (V x H) weight made on the CPU costs seconds per study.
        gen = torch.Generator(device=self.device).manual_seed(self.seed)
        kw = {"device": self.device, "generator": gen}
        x = torch.randn(self.tokens, self.hidden, **kw).to(self.dtype).requires_grad_(True)
        w = torch.randn(self.vocab, self.hidden, **kw).mul_(self.hidden**-0.5).to(self.dtype).requires_grad_(True)
        target = torch.randint(0, self.vocab, (self.tokens,), **kw)
        target[torch.rand(self.tokens, **kw) < self.ignore_fraction] = -100
        return x, w, target


@torch.no_grad()
def reference(
    x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, chunk_bytes: int = 2**30
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean cross-entropy of ``x @ w.T`` and its gradients (loss, dx, dw), in fp32, chunked over tokens so the
    full logits never exist. Independent of the op under test."""
    tokens, _ = x.shape
    vocab = w.shape[0]
    wf = w.float()
    valid = target != ignore_index
    n_valid = max(1, int(valid.sum()))
    chunk = max(1, chunk_bytes // (4 * vocab))
    loss = torch.zeros((), dtype=torch.float64, device=x.device)
    dx = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    dw = torch.zeros(w.shape, dtype=torch.float32, device=x.device)
    previous_tf32 = torch.backends.cuda.matmul.allow_tf32
    # TF32 keeps a reference for bf16/fp16 inputs fast and ~1e-3 accurate; fp32 inputs get full fp32.
    torch.backends.cuda.matmul.allow_tf32 = x.dtype != torch.float32
    try:
        for start in range(0, tokens, chunk):
            xc = x[start:start + chunk].float()
            tc = target[start:start + chunk]
            vc = valid[start:start + chunk]
            logits = xc @ wf.T
            lse = torch.logsumexp(logits, dim=1)
            safe_t = torch.where(vc, tc, torch.zeros_like(tc))
            picked = logits.gather(1, safe_t[:, None]).squeeze(1)
            loss += ((lse - picked) * vc).sum(dtype=torch.float64)
            grad = torch.softmax(logits, dim=1)
            grad[torch.arange(grad.shape[0], device=grad.device), safe_t] -= 1.0
            grad *= (vc.float() / n_valid)[:, None]
            dx[start:start + chunk] = grad @ wf
            dw.addmm_(grad.T, xc)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous_tf32
    return (loss / n_valid).float(), dx, dw


def _compare(name: str, got: torch.Tensor | None, ref: torch.Tensor, tol: float, row_tol: float) -> str | None:
    """None if ``got`` matches ``ref``, else a description. Checks finiteness, the relative Frobenius error, and
    the worst per-row relative error (catches a few skipped vocab entries or tokens that a global norm hides)."""
    if got is None:
        return f"{name} is missing (no gradient was produced)"
    if got.shape != ref.shape:
        return f"{name} has shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    got = got.float()
    if not bool(torch.isfinite(got).all()):
        return f"{name} has non-finite values"
    diff = got - ref
    ref_norm = float(torch.linalg.vector_norm(ref))
    err = float(torch.linalg.vector_norm(diff)) / max(ref_norm, 1e-30)
    if err > tol:
        return f"{name} relative error {err:.3e} > {tol:.1e}"
    if ref.dim() == 2:
        row_ref = torch.linalg.vector_norm(ref, dim=1)
        floor = 1e-3 * float(row_ref.pow(2).mean().sqrt()) + 1e-30
        row_err = float((torch.linalg.vector_norm(diff, dim=1) / (row_ref + floor)).max())
        if row_err > row_tol:
            return f"{name} worst row relative error {row_err:.3e} > {row_tol:.1e}"
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _CudaMemory:
    """The allocator statistics the peak measurement reads (an object, so tests can substitute a fake)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def max_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))


def _memory_stats(device: torch.device) -> _CudaMemory | None:
    """The allocator statistics for ``device``, or None where there are none (CPU: the peak is reported as 0)."""
    return _CudaMemory(device) if device.type == "cuda" else None


def _grad_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the gradients the op returned (whatever their dtype): they are outputs, not the op's overhead."""
    return sum(t.grad.numel() * t.grad.element_size() for t in tensors if t.grad is not None)


def make_objective(
    problem: Problem,
    *,
    op: Op | None = None,
    warmup: int = 3,
    min_reps: int = 10,
    max_reps: int = 50,
    target_ms: float = 300.0,
    check: bool = True,
) -> Objective:
    """Build ``config -> (median ms, peak bytes)`` for one problem; raises ``TrialRejected`` for a wrong result.

    The inputs and the reference are made once here (not per trial). Per trial: one warm-up run, one run that
    measures the peak and checks the result, ``warmup - 1`` more untimed runs (at least one untimed run always
    precedes the peak run), then ``min_reps`` timed runs at least, more (up to ``max_reps``) for fast configs
    so each trial spends about ``target_ms`` timing.
    """
    if warmup < 0 or min_reps < 10 or max_reps < min_reps:
        raise ValueError(f"warmup={warmup}, min_reps={min_reps}, max_reps={max_reps}: need warmup >= 0, "
                         f"min_reps >= 10 and max_reps >= min_reps")
    run_op = op if op is not None else default_op()
    device = problem.device
    x, w, target = problem.make_inputs()
    ref = reference(x, w, target) if check else None
    loss_tol, grad_tol, row_tol = TOLERANCES.get(problem.dtype, TOLERANCES[torch.float32])
    on_cuda = device.type == "cuda"

    def clear() -> None:
        x.grad = None
        w.grad = None

    def step(config: FLCEConfig) -> torch.Tensor:
        loss = run_op(x, w, target, config=config)
        loss.backward()
        return loss

    def measure_peak(config: FLCEConfig) -> tuple[torch.Tensor, int, float]:
        """One fwd+bwd: (loss, bytes above the inputs and the returned gradients, wall ms)."""
        memory = _memory_stats(device)
        # Free what earlier trials and studies left in reference cycles now, and keep the collector off during
        # the run: a collection in the middle of it once freed an earlier study's tensors, and the run's own
        # allocations refilled that room without raising the peak (a negative peak was reported).
        gc.collect()
        _sync(device)
        before = memory.allocated() if memory is not None else 0
        if memory is not None:
            memory.reset_peak()  # after reading `before`: the peak starts from the same state
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            t0 = time.perf_counter()
            loss = step(config)
            _sync(device)
            elapsed_ms = (time.perf_counter() - t0) * 1e3
        finally:
            if gc_was_enabled:
                gc.enable()
        if memory is None:
            return loss, 0, elapsed_ms
        # Same definition as flce_compile.plan.memory.peak_bytes: above the inputs and the returned gradients.
        peak = memory.max_allocated() - before - _grad_bytes(x, w)
        if peak < 0:
            logger.warning("measured peak %.3f GiB is negative for %s (memory was freed during the run); "
                           "reporting 0", peak / 2**30, config.to_json())
            peak = 0
        return loss, peak, elapsed_ms

    def objective(config: FLCEConfig) -> tuple[float, int]:
        clear()
        try:
            # 1. a warm-up run, so one-time allocations and compilation are outside the measured peak
            step(config)
            clear()
            # 2. one run: peak memory and the correctness check
            loss, peak, run_ms = measure_peak(config)
            if ref is not None:
                ref_loss, ref_dx, ref_dw = ref
                loss_err = abs(float(loss.detach().float()) - float(ref_loss)) / max(1.0, abs(float(ref_loss)))
                problems = []
                if not (loss_err <= loss_tol):  # also catches NaN
                    problems.append(f"loss relative error {loss_err:.3e} > {loss_tol:.1e}")
                for name, got, expected in (("dX", x.grad, ref_dx), ("dW", w.grad, ref_dw)):
                    problem_text = _compare(name, got, expected, grad_tol, row_tol)
                    if problem_text:
                        problems.append(problem_text)
                if problems:
                    raise TrialRejected("; ".join(problems))
            del loss
            clear()
            # 3. the remaining warm-up runs, then timed runs
            extra_warmup = max(0, warmup - 1)
            t_warm = time.perf_counter()
            for _ in range(extra_warmup):
                step(config)
                clear()
            _sync(device)
            estimate_ms = (time.perf_counter() - t_warm) * 1e3 / extra_warmup if extra_warmup else run_ms
            reps = int(min(max_reps, max(min_reps, target_ms / max(estimate_ms, 1e-3))))
            times: list[float] = []
            if on_cuda:
                events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
                for start, end in events:
                    start.record()
                    step(config)
                    end.record()
                    clear()
                torch.cuda.synchronize(device)
                times = [start.elapsed_time(end) for start, end in events]
            else:
                for _ in range(reps):
                    t0 = time.perf_counter()
                    step(config)
                    times.append((time.perf_counter() - t0) * 1e3)
                    clear()
            ms = statistics.median(times)
            logger.debug("measured %s: %.4f ms (median of %d), peak %.3f GiB", config.to_json(), ms, reps, peak / 2**30)
            return ms, peak
        finally:
            clear()
            if on_cuda:
                try:
                    torch.cuda.synchronize(device)
                    torch.cuda.empty_cache()  # an OOM leaves cached blocks behind; the next trial starts clean
                except Exception:  # noqa: BLE001 - a broken context is reported by the next trial
                    pass

    return objective
