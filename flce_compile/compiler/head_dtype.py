"""The dtype an lm_head computed in, and the autocast state its fused loss runs in.

Dynamo records autocast as casts and dtypes on the nodes, so the traced graph says what the lm_head did: an
autocast region around the head leaves fp32 parameters and low-precision logits; an lm_head kept out of autocast
(``with autocast(enabled=False): logits = lm_head(h.float())``) leaves fp32 logits. The fused node stands where
the loss stood, whose autocast state can differ from the head's, so the rewrite casts the operands as the head
saw them (``compute_operands``) and runs the op with autocast off (``head_autocast_off``). Both the single-device
and the vocabulary-parallel call read this.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch import fx

from .patterns import meta_value


def head_compute_dtype(gm: fx.GraphModule, lin: Any) -> torch.dtype | None:
    """The dtype the lm_head ``lin`` (a ``patterns`` linear) computed in, its GEMM's output's, when any operand has
    another one (autocast), else None. (Not the logits' dtype: a wider bias added after the GEMM promotes those,
    ``LinearMatch.wide_bias``, and the GEMM still ran in 16 bits.)"""
    if lin.module_target is not None:
        mod = gm.get_submodule(lin.module_target)
        operands = [mod.weight, mod.bias]
    else:
        operands = [meta_value(lin.weight), meta_value(lin.bias)]
    operands.append(meta_value(lin.input))
    logits_dtype = meta_value(lin.start).dtype
    mixed = any(isinstance(t, torch.Tensor) and t.dtype != logits_dtype for t in operands)
    return logits_dtype if mixed else None


def compute_operands(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The lm_head's operands cast to ``dtype``, the one it computed in (``head_compute_dtype``), as autocast cast
    them for the head; unchanged when ``dtype`` is None. The casts are differentiable: fp32 parameters get fp32
    gradients."""
    if dtype is None:
        return input, weight, bias
    cast = lambda t: t.to(dtype) if t is not None and t.dtype != dtype else t  # noqa: E731
    return cast(input), cast(weight), cast(bias)


def head_autocast_off(input: torch.Tensor) -> Any:
    """A context with autocast off for ``input``'s device type (a null context when it is off already): the
    operands are in the head's dtype (``compute_operands``), and autocast around the fused call would redo the
    casts with the loss's state, not the head's (an fp32 head's GEMMs in bf16)."""
    from ..op import autocast_on

    device_type = input.device.type
    return torch.autocast(device_type, enabled=False) if autocast_on(device_type) else contextlib.nullcontext()
