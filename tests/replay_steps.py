"""What the CPU and GPU tests of CUDA-graph replay share: the captured instances, and training steps whose hidden
states keep their memory while their values change."""

from __future__ import annotations

from typing import Any, Callable

import torch

from flce_compile import fused_linear_cross_entropy, graph_replay


def instances() -> list:
    """Every captured instance (``graph_replay._Graph``), key by key."""
    return [g for gs in graph_replay._cache.graphs.values() for g in gs]


def steps_at(w: torch.Tensor, places: list, observe: Callable[[], Any] | None = None) -> tuple[list, list]:
    """One step per (x, t) of ``places``: x's values changed in place (same memory), forward, backward. Returns
    each step's (loss, dx, dw) copies and what ``observe()`` saw after it (by default the instances'
    ``bound_at``)."""
    out, seen = [], []
    for x, t in places:
        with torch.no_grad():
            x.mul_(1.25)
        loss = fused_linear_cross_entropy(x.requires_grad_(), w, t)
        loss.backward()
        out.append((loss.detach().clone(), x.grad.clone(), w.grad.clone()))
        x.grad = w.grad = None
        del loss
        seen.append(observe() if observe is not None else [g.bound_at for g in instances()])
    return out, seen
