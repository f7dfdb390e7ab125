"""The loss options of one call, validated once and passed down the data path as one value."""

from __future__ import annotations

from dataclasses import dataclass

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
