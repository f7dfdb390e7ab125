"""Cross-entropy over logits that already exist (the compiler's "kept logits" path), as custom ops.

When a graph returns its logits and the loss cannot be fused with the lm_head (its target is written in
between, or it is a "none" loss), re-running the logits GEMM inside the fused op would double the head's most
expensive op. So the loss is taken from the kept logits instead, chunk by chunk through the fused op's own CE
step (``strategies.kept``): the Triton kernel on the GPU, the torch step elsewhere. Forward keeps the per-row
lse for backward; backward writes the logits gradient straight in the logits' dtype. It equals
``F.cross_entropy(z.float().view(-1, V), target.view(-1), ...)``, z the soft-capped, scaled logits.

``flce::kept_logits_cross_entropy`` and its ``_backward`` are ``torch.library`` custom ops with fake
implementations, so Dynamo/AOT/Inductor treat them as opaque (the chunk loop stays a loop) and dynamic token
counts trace without specialization. The loss options cross as one string (``params.encode_params``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .compile_cache_key import key_compile_caches
from .op import check_targets, op_context
from .params import LossParams, decode_params, encode_params, math_dtype
from .plan.choose import kept_logits_config
from .strategies.chunked import LSE_DTYPE
from .strategies.kept import kept_backward, kept_forward


@torch.library.custom_op("flce::kept_logits_cross_entropy", mutates_args=())
def kept_logits_cross_entropy_op(logits: Tensor, target: Tensor, ce_weight: Optional[Tensor],
                                 params: str) -> tuple[Tensor, Tensor]:
    """(loss, lse) over the rows of ``logits`` (..., V); ``target`` (N,) int64, ``ce_weight`` (V,) in the math
    dtype. The loss is 0-dim for mean/sum, (N,) for "none"."""
    p = decode_params(params)
    vocab = logits.shape[-1]
    check_targets(target, vocab, p.ignore_index)
    with op_context(logits.device):
        return kept_forward(logits, target, ce_weight, p, kept_logits_config(vocab, logits.dtype, logits.device))


@kept_logits_cross_entropy_op.register_fake
def _kept_logits_cross_entropy_fake(logits, target, ce_weight, params):
    key_compile_caches()  # (compile_cache_key.py)
    n = target.shape[0]
    dtype = math_dtype(logits.dtype)
    loss = logits.new_empty((n,) if decode_params(params).reduction == "none" else (), dtype=dtype)
    return loss, logits.new_empty((n,), dtype=LSE_DTYPE)


@torch.library.custom_op("flce::kept_logits_cross_entropy_backward", mutates_args=())
def kept_logits_cross_entropy_backward_op(logits: Tensor, target: Tensor, ce_weight: Optional[Tensor], lse: Tensor,
                                          grad_loss: Tensor, params: str) -> Tensor:
    """d(grad_loss . loss)/d(logits), contiguous, in the logits' dtype."""
    p = decode_params(params)
    with op_context(logits.device):
        return kept_backward(logits, target, ce_weight, lse, grad_loss, p,
                             kept_logits_config(logits.shape[-1], logits.dtype, logits.device))


@kept_logits_cross_entropy_backward_op.register_fake
def _kept_logits_cross_entropy_backward_fake(logits, target, ce_weight, lse, grad_loss, params):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output) -> None:
    logits, target, ce_weight, params = inputs
    _loss, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(logits, target, ce_weight, lse)
    ctx.params = params


def _backward(ctx, grad_loss, _grad_lse):
    if grad_loss is None:  # the loss took no part in what is differentiated
        return None, None, None, None
    logits, target, ce_weight, lse = ctx.saved_tensors
    grad = kept_logits_cross_entropy_backward_op(logits, target, ce_weight, lse, grad_loss, ctx.params)
    return grad, None, None, None


kept_logits_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def kept_logits_cross_entropy(
    logits: Tensor,
    target: Tensor,
    *,
    ce_weight: Optional[Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
) -> Tensor:
    """``F.cross_entropy(z.float().view(-1, V), target.view(-1), ...)`` with z = softcap/scale of ``logits``
    (class dim last), computed chunk-wise from the existing logits; returns a target-shaped tensor for
    reduction="none". The loss is fp32 (fp64 for fp64 logits)."""
    params = LossParams(int(ignore_index), reduction, float(label_smoothing),
                        float(softcap) if softcap is not None else 0.0, float(logit_scale))
    t = target.reshape(-1)
    cw = ce_weight.to(math_dtype(logits.dtype)).contiguous() if ce_weight is not None else None
    loss, _lse = kept_logits_cross_entropy_op(logits, (t if t.dtype == torch.int64 else t.long()).contiguous(), cw,
                                              encode_params(params))
    return loss.view(target.shape) if reduction == "none" else loss
