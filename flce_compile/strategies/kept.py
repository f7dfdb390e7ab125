"""Cross-entropy over logits that already exist (the compiler's kept-logits path), chunk by chunk through the
same CE step as the fused op's loop.

When a graph must keep its logits and the loss cannot be fused with the lm_head, the loss is taken from the kept
logits a chunk of rows at a time: forward writes each row's scaled loss and its lse, backward writes the logits
gradient straight in the logits' dtype into a tensor of its own (the logits stay intact). The reduction's scales
are the fused loop's (``_reduction_scales``, ``_gradient_scales``), so mean, sum and none, class weights, label
smoothing, softcap, scale and fully masked batches behave exactly as in the fused op; with the Triton strategy
no fp32 copy of the logits is made at all.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..params import LossParams, math_dtype
from ..plan.config import FLCEConfig
from .chunked import (LSE_DTYPE, _ce_step, _gradient_scales, _reduced_loss, _reduction_scales, _StepRows, _weight_sum,
                      output_factor)


def _as_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as a (rows, V) view when possible (no copy), else None."""
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return None


def _row_blocks(x: torch.Tensor) -> Iterator[torch.Tensor]:
    """(rows, V) pieces of ``x`` in row-major order, views where the layout allows (slices of kept logits)."""
    rows = _as_rows(x)
    if rows is not None:
        yield rows
    elif x.dim() > 2:
        for i in range(x.shape[0]):
            yield from _row_blocks(x[i])
    else:
        yield x.reshape(-1, x.shape[-1])


def _run_rows(logits: torch.Tensor, grad: torch.Tensor | None, p: LossParams, config: FLCEConfig,
              step_rows: _StepRows) -> None:
    """The CE step over every row of ``logits`` (..., V), ``config.chunk_tokens`` rows at a time; with ``grad``
    (contiguous, shaped like the logits) it receives the gradient."""
    step = _ce_step(config)
    grads = grad.view(-1, logits.shape[-1]) if grad is not None else None
    start = 0
    for block in _row_blocks(logits):
        for offset in range(0, block.shape[0], config.chunk_tokens):
            chunk = block[offset:offset + config.chunk_tokens]
            rows = slice(start + offset, start + offset + chunk.shape[0])
            chunk = chunk if chunk.stride(-1) == 1 else chunk.contiguous()  # the step reads unit column strides
            step(step_rows.chunk(chunk, rows, write_grad=grads is not None,
                                 grad_out=grads[rows] if grads is not None else None), p)
        start += block.shape[0]


def kept_forward(logits: torch.Tensor, target: torch.Tensor, ce_weight: torch.Tensor | None, p: LossParams,
                 config: FLCEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse) of the rows of ``logits`` (..., V) against ``target`` (N,) int64: the loss 0-dim for mean/sum,
    (N,) for "none"; lse (N,), which backward needs. The loss in ``math_dtype`` (``ce_weight`` is too), the lse
    in ``chunked.LSE_DTYPE`` (fp64: a confident row's 1 - p survives it)."""
    dtype = math_dtype(logits.dtype)
    n = target.shape[0]
    ce_scale, z_scale = _reduction_scales(target, ce_weight, p, logits.shape[-1], dtype)
    scales = _gradient_scales(ce_scale, z_scale, p.reduction)
    loss_rows = torch.empty(n, dtype=dtype, device=logits.device)
    lse = torch.empty(n, dtype=LSE_DTYPE, device=logits.device)
    weight_sum = _weight_sum(ce_weight, logits.shape[-1], dtype, logits.device)
    _run_rows(logits, None, p, config, _StepRows(target, ce_weight, weight_sum, scales.ce, scales.z, loss_rows, lse))
    if p.reduction == "none":
        return loss_rows, lse
    return _reduced_loss(loss_rows, ce_scale, scales, p), lse


def kept_backward(logits: torch.Tensor, target: torch.Tensor, ce_weight: torch.Tensor | None, lse: torch.Tensor,
                  grad_loss: torch.Tensor, p: LossParams, config: FLCEConfig) -> torch.Tensor:
    """The gradient of ``grad_loss`` . loss with respect to ``logits``, contiguous, in the logits' dtype. The
    reduction's factors and grad_output are folded into the step's per-row scales in fp32, so each element is
    rounded once; a fully masked "mean" gets exact zeros."""
    dtype = math_dtype(logits.dtype)
    ce_scale, z_scale = _reduction_scales(target, ce_weight, p, logits.shape[-1], dtype)
    scales = _gradient_scales(ce_scale, z_scale, p.reduction)
    g = grad_loss.reshape(-1).to(dtype) if p.reduction == "none" else output_factor(grad_loss, scales.post)
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    weight_sum = _weight_sum(ce_weight, logits.shape[-1], dtype, logits.device)
    _run_rows(logits, grad, p, config, _StepRows(target, ce_weight, weight_sum, (scales.ce * g).contiguous(),
                                                  (scales.z * g).contiguous(), lse_in=lse))
    return grad
