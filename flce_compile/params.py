"""The loss options of one call, validated once and passed down the data path as one value."""

from __future__ import annotations

from dataclasses import dataclass

import torch

REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True)
class LossParams:
    """Cross-entropy options that shape the math (not how it is executed: that is ``FLCEConfig``)."""

    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    softcap: float = 0.0  # 0 = no softcap (the custom op schema has no Optional[float] worth the trouble)
    logit_scale: float = 1.0
    z_loss: float = 0.0


def math_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the op's softmax, loss, lse and scale factors for inputs of ``compute_dtype``: fp32, or fp64
    for fp64 inputs (``torch.autograd.gradcheck`` needs a loss as exact as its inputs)."""
    return torch.float64 if compute_dtype == torch.float64 else torch.float32
