"""Helpers shared by the benchmark scripts (bench_flce.py, plot_curves.py) and the memory tests: the inputs,
the eager reference, the peers (Liger, CCE), the package versions and the CPU peak-memory measurement.

Importing this module imports torch only; the peers and triton are imported when asked for.
"""

from __future__ import annotations

import platform
from typing import Callable

import torch
import torch.nn.functional as F

#: A loss function of the benchmarks: (hidden (N, H), weight (V, H), targets (N,)) -> scalar loss.
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
IGNORED_FRACTION = 0.06  # share of targets set to ignore_index (-100)


def make_inputs(n: int, h: int, v: int, seed: int = 0, peaky: float = 1.0, device: str = "cuda",
                dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random hidden states (n, h), weight (v, h) scaled by ``peaky / sqrt(h)`` and targets with ~6% = -100."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, h, device=device, generator=g, dtype=torch.float32).to(dtype)
    w = (torch.randn(v, h, device=device, generator=g) * peaky / h**0.5).to(dtype)
    t = torch.randint(0, v, (n,), device=device, generator=g)
    t[torch.rand(n, device=device, generator=g) < IGNORED_FRACTION] = -100
    return x, w, t


def eager_loss(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The plain PyTorch reference: full logits, cast to fp32, cross-entropy."""
    return F.cross_entropy(F.linear(x, w).float(), t, ignore_index=-100)


def liger_loss() -> LossFn:
    """Liger-Kernel's fused linear cross-entropy; raises ImportError when liger-kernel is not installed."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    liger = LigerFusedLinearCrossEntropyLoss()
    return lambda x, w, t: liger(w, x, t)  # the module takes (lin_weight, _input, target)


def cce_loss() -> LossFn:
    """Cut Cross-Entropy with its defaults; raises ImportError when cut-cross-entropy is not installed."""
    from cut_cross_entropy import linear_cross_entropy

    return lambda x, w, t: linear_cross_entropy(x, w, t)


def versions() -> dict[str, str]:
    """torch, triton (when importable), Python, and the peers' versions where installed."""
    from importlib.metadata import version

    out = {"torch": torch.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    out["python"] = platform.python_version()
    for mod in ("liger_kernel", "cut_cross_entropy"):
        try:
            out[mod] = version(mod.replace("_", "-"))
        except Exception:  # noqa: BLE001 - not installed
            pass
    return out


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of live CPU allocations made while ``fn`` runs: the profiler's raw allocation/free records, one per
    allocation, replayed in time order (memory allocated before the call does not count).

    (FunctionEvent.self_cpu_memory_usage is not enough: it nets each op's allocations and frees, and a free
    that happens inside the fused op is charged to the op's start, which hid every internal peak.)
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    if not records:
        raise RuntimeError("the profiler recorded no allocations: the measurement would be empty")
    for event in sorted(records, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak
