"""The "recompute" strategy: the checkpointed LM head, for little memory at one more GEMM.

Forward runs the chunk loop without gradients and keeps each token's log-sum-exp, its target's z and its largest
z with that class: 4N numbers (``chunked.kept_rows``). Backward recomputes the logits one block of vocabulary rows
at a time; for each block it walks the token chunks, forms the logit gradient from the saved lse (the CE step over a
slice of the classes; the target's and the largest class's probabilities from the forward's z, as recomputed
logits can round apart from the forward's), adds the block's share of dX into an fp32 N x H sum and accumulates
the block's dW rows in fp32, which are rounded once when the block is done. So there is no V x H fp32 buffer (the
chunked strategies' dW accumulator): the extra memory is the N x H fp32 dX sum, one block's fp32 dW rows and one
chunk x block buffer of logits. The matrix work is four GEMMs instead of three: the logits twice, then dX and dW.
With ``FLCEConfig.fp32_logits`` (the "precise" policy) both logits GEMMs write fp32 (the forward through the
chunk loop, the backward into an fp32 chunk x block buffer beside the gradient's) and each row's true-class
rounding goes back into the fp32 sums (``true_class``), at no extra GEMM.

Every factor of the gradient (the reduction's scales and grad_output) goes into the logit gradient before its
one rounding, as in eager PyTorch, so a loss scale reaches fp16 gradients before any underflow.
"""

from __future__ import annotations

import torch

from ..params import LossParams, math_dtype
from ..plan import registry
from ..plan.config import FLCEConfig
from ..plan.layout import padded_row_elements
from ..plan.precision import fp32_logits_on
from .ce_common import CEStepArgs
from . import true_class
from .wide_logits import fp32_logits_into
from .chunked import (
    ForwardResult, GradRequest, Grads, Operands, _ce_step, _reduction_scales, add_product,
    full_precision_gemm_reductions, fused_forward,
)


def ce_step(args: CEStepArgs, p: LossParams, config: FLCEConfig) -> None:
    """The strategy's CE step: the Triton kernel for fp16/bf16/fp32 on a GPU, the torch step otherwise (the CPU,
    fp64)."""
    if registry.kernel_step_runs(args.logits.device.type, args.logits.dtype):
        from .ce_triton import ce_step_triton

        ce_step_triton(args, p, config)
    else:
        from .ce_torch import ce_step_torch

        ce_step_torch(args, p, config)


def recompute_forward(ops: Operands, p: LossParams, config: FLCEConfig, accum_dtype: torch.dtype) -> ForwardResult:
    """The loss and what backward needs of each token (``chunked.kept_rows``); no gradients, no logits kept."""
    return fused_forward(ops, p, config, accum_dtype, GradRequest(), keep_lse=True)


def row_factors(ops: Operands, p: LossParams, grad_output: torch.Tensor,
                num_classes: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors of the CE and z-loss terms of each row's gradient: the reduction's scales times grad_output
    (0-dim for mean/sum, per row for "none"), in the loss's math dtype. A fully masked "mean" has infinite
    scales and every row ignored: its factors are 0, so its gradients are exactly 0. Class weights that sum to
    0 over the valid tokens leave only the CE scale infinite: that factor stays so, and the gradients are NaN,
    as eager's and the chunked loop's (``chunked._gradient_scales``). ``num_classes``: all the classes when the
    weight holds a slice of them (default: its rows)."""
    dtype = math_dtype(ops.x.dtype)
    vocab = num_classes if num_classes is not None else ops.weight.shape[0]
    ce_scale, z_scale = _reduction_scales(ops.target, ops.ce_weight, p, vocab, dtype)
    g = grad_output.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=g.device)
    valid = torch.isfinite(z_scale)  # some token counted: z_scale is 1 / their count
    return torch.where(valid, ce_scale * g, zero), torch.where(valid, z_scale * g, zero)


def recompute_backward(
    ops: Operands,
    kept: torch.Tensor,
    grad_output: torch.Tensor,
    p: LossParams,
    config: FLCEConfig,
    accum_dtype: torch.dtype,
    grads: GradRequest,
    *,
    classes: tuple[int, int] | None = None,
    round_dx: bool = True,
) -> Grads:
    """dX, dW and db of the loss (times ``grad_output``: 0-dim, or per row for "none") from what the forward kept,
    ``kept`` (``chunked.kept_rows``: each token's lse, its target's z, its largest z and that class).

    ``accum_dtype`` sets the dX sum and the dW blocks' dtype (fp32 by default; the weight dtype saves the N x H
    fp32 sum at the usual accuracy cost). ``classes`` = (offset, total): the weight's rows are classes
    [offset, offset + rows) of ``total`` (one rank's vocabulary shard; ``ce_weight`` then covers all ``total``
    classes), so dX is this slice's share. ``round_dx=False`` returns dX as the unrounded ``accum_dtype`` sum
    (for a caller that adds the shares of several slices before rounding once).
    """
    x, weight, target, bias, ce_weight = ops.x, ops.weight, ops.target, ops.bias, ops.ce_weight
    n, hidden = x.shape
    vocab = weight.shape[0]
    offset, total = classes if classes is not None else (0, vocab)
    device, dtype = x.device, x.dtype
    ce_rows, z_rows = row_factors(ops, p, grad_output, total)
    math = math_dtype(dtype)  # (not the lse's: fp64, for its precision, beside fp32 math)
    weight_sum = ce_weight.sum() if ce_weight is not None else torch.full((), float(total), dtype=math,
                                                                              device=device)
    chunk = max(1, min(config.chunk_tokens, n))
    block = max(1, min(config.vocab_block, vocab))
    acc_dtype = accum_dtype if dtype != torch.float64 else torch.float64
    dx_sum = torch.zeros(n, hidden, dtype=acc_dtype, device=device) if grads.dx else None
    dw_columns = hidden - grads.dw_from  # (frozen leading columns get no dW: ``GradRequest.dw_from``)
    dw = torch.empty(vocab, dw_columns, dtype=weight.dtype, device=device) if grads.dw else None
    db = torch.empty_like(bias) if grads.db and bias is not None else None
    # One logits buffer, its rows padded to 128 bytes for aligned GEMMs; with fp32 logits (the "precise"
    # policy) the GEMM writes an fp32 buffer beside it and the CE step writes the gradient into this one.
    stride = padded_row_elements(block, x.element_size())
    buffer = torch.empty(chunk, stride, dtype=dtype, device=device)
    wide = torch.empty(chunk, stride, dtype=torch.float32, device=device) if fp32_logits_on(
        config.fp32_logits, dtype) else None
    bias32 = bias.float() if wide is not None and bias is not None else None
    residual = torch.empty(chunk, dtype=torch.float32, device=device) if wide is not None else None
    ce_step = _ce_step(config)
    per_row = ce_rows.dim() == 1
    lse, target_z, top = kept[0], kept[1], kept[2:]
    # One block's sums, allocated once and zeroed per block: a fresh tensor per block would be allocated
    # while the previous block's is still referenced, two blocks at the peak.
    dw_block = torch.empty(block, dw_columns, dtype=acc_dtype, device=device) if dw is not None else None
    db_block = torch.empty(block, dtype=math, device=device) if db is not None else None
    with full_precision_gemm_reductions(device):
        for v0 in range(0, vocab, block):
            v1 = min(v0 + block, vocab)
            w_b, b_b = weight[v0:v1], bias[v0:v1] if bias is not None else None
            dw_sum = dw_block[: v1 - v0].zero_() if dw_block is not None else None
            db_sum = db_block[: v1 - v0].zero_() if db_block is not None else None
            for t0 in range(0, n, chunk):
                t1 = min(t0 + chunk, n)
                rows = slice(t0, t1)
                logits = buffer[: t1 - t0, : v1 - v0]
                x_c = x[rows]
                x_dw = x_c[:, grads.dw_from:] if grads.dw_from else x_c
                if wide is not None:
                    wide_logits = wide[: t1 - t0, : v1 - v0]
                    fp32_logits_into(wide_logits, x_c, w_b, bias32[v0:v1] if bias32 is not None else None)
                elif b_b is not None:
                    torch.addmm(b_b, x_c, w_b.t(), out=logits)
                else:
                    torch.mm(x_c, w_b.t(), out=logits)
                ce_step(CEStepArgs(
                    logits=wide_logits if wide is not None else logits, target=target[rows], ce_weight=ce_weight,
                    weight_sum=weight_sum, ce_scale=ce_rows[rows] if per_row else ce_rows,
                    z_scale=z_rows[rows] if per_row else z_rows, loss_out=None, lse_out=None, lse_in=lse[rows],
                    target_z_in=target_z[rows], top_in=top[:, rows],
                    write_grad=True, grad_out=logits if wide is not None else None, class_offset=offset + v0,
                    num_classes=total, residual_out=residual[: t1 - t0] if residual is not None else None,
                ), p)
                if dx_sum is not None:
                    _add(dx_sum[rows], logits, w_b)
                if dw_sum is not None:
                    _add(dw_sum, logits.t(), x_dw)
                if db_sum is not None:
                    db_sum.add_(logits.sum(dim=0, dtype=db_sum.dtype))
                if residual is not None:  # the true-class roundings, back into the fp32 sums
                    r, local = residual[: t1 - t0], true_class.target_rows(target[rows], offset + v0, v1 - v0)
                    if dx_sum is not None:
                        dx_sum[rows].add_(w_b.index_select(0, local) * r[:, None])
                    true_class.add_to_weight_grads(dw_sum, db_sum, local, r, x_dw)
            if dw is not None:
                dw[v0:v1].copy_(dw_sum)  # the block's one rounding
            if db is not None:
                db[v0:v1].copy_(db_sum)
    dx = dx_sum.to(dtype) if dx_sum is not None and round_dx else dx_sum
    return dx, dw, db


def _add(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, in acc's dtype (fp32 sums of bf16/fp16 products, or plain in the weight dtype)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    else:
        add_product(acc, a, b)
