"""The loss options of one call, validated once and passed down the data path as one value.

They cross the custom-op boundary as one string argument: ``encode_params`` writes it (in ``api`` and
``kept_logits``, traced by Dynamo) and ``decode_params`` reads it (in the op bodies and fake implementations).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

REDUCTIONS = ("mean", "sum", "none")
#: An ignore_index that ignores no class: the one the compiler gives a per-token log-prob gather, which reads
#: every row (a negative id there is out of range, an error as for ``gather``). Fits int32 targets too.
NO_IGNORED_CLASS = -(2**31)


@dataclass(frozen=True)
class LossParams:
    """Cross-entropy options that shape the math (not how it is executed: that is ``FLCEConfig``).

    ``frozen_weight_columns``: the weight's leading columns that get no gradient (their dW is zero and not
    computed): a weight that concatenates a frozen matrix and a trainable one, as the compiler's LoRA fold
    passes ``[W, B]`` with W frozen (``compiler.lora_head``). The op's dW output then holds the other columns
    only, and its autograd formula pads the rest with zeros."""

    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    softcap: float = 0.0  # 0 = no softcap
    logit_scale: float = 1.0
    z_loss: float = 0.0
    frozen_weight_columns: int = 0


_FIELDS = tuple(f.name for f in dataclasses.fields(LossParams))
_PARSE = {"int": int, "str": str, "float": float}  # field annotation -> parser of its text
_PARSERS = {f.name: _PARSE[f.type] for f in dataclasses.fields(LossParams)}


def encode_params(p: LossParams) -> str:
    """The op argument of ``p``: "ignore_index=-100;reduction=mean;label_smoothing=0.1;...", readable in a graph.

    ``str`` of a float round-trips exactly (it is its repr). Written with plain formatting, which Dynamo folds
    to a constant (and specializes an option that arrived as a symbolic float), so the op stays one graph node.
    """
    return ";".join(f"{name}={getattr(p, name)}" for name in _FIELDS)


@functools.lru_cache(maxsize=256)
def decode_params(text: str) -> LossParams:
    """``encode_params``'s inverse. Memoised: it runs on every call of the op, which is host-bound at small
    shapes. A malformed string (a direct op call) is an error that shows the expected form."""
    try:
        items = dict(item.split("=", 1) for item in text.split(";"))
        if set(items) != set(_FIELDS):
            raise ValueError(f"it names {sorted(items)}")
        return LossParams(**{name: _PARSERS[name](value) for name, value in items.items()})
    except ValueError as exc:
        raise ValueError(
            f"loss options {text!r} are malformed ({exc}); the op takes encode_params(LossParams(...)), e.g. "
            f"{encode_params(LossParams())!r}"
        ) from None


def math_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the op's softmax, loss, lse and scale factors for inputs of ``compute_dtype``: fp32, or fp64
    for fp64 inputs (``torch.autograd.gradcheck`` needs a loss as exact as its inputs)."""
    return torch.float64 if compute_dtype == torch.float64 else torch.float32
