"""Cross-entropy over logits that already exist (the "keep" path), chunked and exact.

When a graph returns its logits, the logits GEMM has to run anyway. Re-running it inside the fused op would
double the most expensive op of the head, so instead the loss is computed from the kept logits, a chunk of
rows at a time: forward keeps only three fp32 numbers per row (log-sum-exp, target logit, weighted logit sum)
and backward writes the logits gradient straight in the logits' dtype. Neither pass makes an fp32 copy of the
logits (which the unfused ``logits.float()`` -> ``cross_entropy`` path makes two or three of). The reduction
(ignore_index, class weights, label smoothing, mean/sum/none) is done afterwards on the per-row numbers with
plain torch ops, so it matches ``F.cross_entropy`` exactly.

Both passes are ``torch.library`` custom ops with fake implementations, so Dynamo/AOT/Inductor treat them as
opaque (the chunk loop stays a loop) and dynamic token counts trace without specialization.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch import Tensor

from ..op import check_targets

_CHUNK_BYTES = 64 * 2**20  # fp32 working set per chunk


def _chunk_rows(vocab: int) -> int:
    return max(1, _CHUNK_BYTES // (4 * max(1, vocab)))


def _rows(x: Tensor) -> Tensor | None:
    """``x`` as a (rows, V) view when possible (no copy), else None."""
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return None


def _row_blocks(x: Tensor) -> Iterator[Tensor]:
    """(rows, V) pieces of ``x`` in row-major order, views where the layout allows (slices of kept logits)."""
    r = _rows(x)
    if r is not None:
        yield r
    elif x.dim() > 2:
        for i in range(x.shape[0]):
            yield from _row_blocks(x[i])
    else:
        yield x.reshape(-1, x.shape[-1])


def _paired_blocks(x: Tensor, g: Tensor) -> Iterator[tuple[Tensor, Tensor]]:
    """``_row_blocks`` of ``x`` paired with the same rows of the contiguous tensor ``g``."""
    r = _rows(x)
    if r is not None:
        yield r, g.view(-1, g.shape[-1])
    elif x.dim() > 2:
        for i in range(x.shape[0]):
            yield from _paired_blocks(x[i], g[i])
    else:
        yield x.reshape(-1, x.shape[-1]), g.view(-1, g.shape[-1])


def _transform(y: Tensor, softcap: Optional[float], logit_scale: float) -> Tensor:
    z = y.float()
    if logit_scale != 1.0:
        z = z * logit_scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z


@torch.library.custom_op("flce_compiler::kept_logits_ce_fwd", mutates_args=())
def kept_logits_ce_fwd(
    logits: Tensor, target: Tensor, ce_weight: Optional[Tensor], ignore_index: int,
    softcap: Optional[float], logit_scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row (lse, z[target], sum_c w_c z_c) in fp32 over rows of ``logits`` (flattened leading dims)."""
    vocab = logits.shape[-1]
    check_targets(target, vocab, ignore_index)
    n = logits.numel() // max(1, vocab)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    zt = torch.empty_like(lse)
    swz = torch.empty_like(lse)
    t_all = target.reshape(-1)
    safe_t = torch.where(t_all == ignore_index, 0, t_all).clamp(0, vocab - 1)
    step = _chunk_rows(vocab)
    row = 0
    for block in _row_blocks(logits):
        for s in range(0, block.shape[0], step):
            z = _transform(block[s:s + step], softcap, logit_scale)
            e = row + z.shape[0]
            lse[row:e] = torch.logsumexp(z, dim=-1)
            zt[row:e] = z.gather(1, safe_t[row:e, None]).squeeze(1)
            swz[row:e] = (z @ ce_weight.float()) if ce_weight is not None else z.sum(-1)
            row = e
    shape = logits.shape[:-1]
    return lse.view(shape), zt.view(shape), swz.view(shape)


@kept_logits_ce_fwd.register_fake
def _(logits, target, ce_weight, ignore_index, softcap, logit_scale):
    shape = logits.shape[:-1]
    f = logits.new_empty(shape, dtype=torch.float32)
    return f, torch.empty_like(f), torch.empty_like(f)


@torch.library.custom_op("flce_compiler::kept_logits_ce_bwd", mutates_args=())
def kept_logits_ce_bwd(
    logits: Tensor, target: Tensor, ce_weight: Optional[Tensor], ignore_index: int,
    softcap: Optional[float], logit_scale: float, lse: Tensor, g_lse: Tensor, g_zt: Tensor, g_swz: Tensor,
) -> Tensor:
    """d(loss)/d(logits) in the logits' dtype from the per-row output gradients, chunk by chunk."""
    vocab = logits.shape[-1]
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    t_all = target.reshape(-1)
    safe_t = torch.where(t_all == ignore_index, 0, t_all).clamp(0, vocab - 1)
    lse, g_lse, g_zt, g_swz = (t.reshape(-1).float() for t in (lse, g_lse, g_zt, g_swz))
    w = ce_weight.float() if ce_weight is not None else None
    step = _chunk_rows(vocab)
    row = 0
    for block, gblock in _paired_blocks(logits, grad):
        for s in range(0, block.shape[0], step):
            y = block[s:s + step]
            e = row + y.shape[0]
            z = _transform(y, softcap, logit_scale)
            dz = torch.exp(z - lse[row:e, None]).mul_(g_lse[row:e, None])
            dz.scatter_add_(1, safe_t[row:e, None], g_zt[row:e, None])
            dz.add_(g_swz[row:e, None] * w if w is not None else g_swz[row:e, None])
            if softcap is not None:  # z = c*tanh(s/c): dz/ds = 1 - (z/c)^2
                dz.mul_(1.0 - (z / softcap) ** 2)
            if logit_scale != 1.0:
                dz.mul_(logit_scale)
            gblock[s:s + step] = dz.to(grad.dtype)
            row = e
    return grad


@kept_logits_ce_bwd.register_fake
def _(logits, target, ce_weight, ignore_index, softcap, logit_scale, lse, g_lse, g_zt, g_swz):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output) -> None:
    logits, target, ce_weight, ignore_index, softcap, logit_scale = inputs
    ctx.save_for_backward(logits, target, ce_weight, output[0])
    ctx.args = (ignore_index, softcap, logit_scale)


def _backward(ctx, g_lse, g_zt, g_swz):
    logits, target, ce_weight, lse = ctx.saved_tensors
    ignore_index, softcap, logit_scale = ctx.args
    zeros = lambda g: torch.zeros_like(lse) if g is None else g  # noqa: E731 - an unused output's grad
    grad = kept_logits_ce_bwd(
        logits, target, ce_weight, ignore_index, softcap, logit_scale, lse, zeros(g_lse), zeros(g_zt), zeros(g_swz)
    )
    return grad, None, None, None, None, None


kept_logits_ce_fwd.register_autograd(_backward, setup_context=_setup_context)


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
    reduction="none"."""
    vocab = logits.shape[-1]
    lse, zt, swz = kept_logits_ce_fwd(logits, target, ce_weight, ignore_index, softcap, logit_scale)
    lse, zt, swz = lse.reshape(-1), zt.reshape(-1), swz.reshape(-1)
    t = target.reshape(-1)
    valid = t != ignore_index
    # Clamped so a bad class id indexes nothing out of range (on the GPU that would be a device assert); its
    # loss is made NaN below.
    safe_t = torch.where(valid, t, 0).clamp(0, vocab - 1)
    nll = torch.where(valid, lse - zt, 0.0)
    # An out-of-range class id never gives a finite wrong loss (the op raised on the CPU already).
    nll = torch.where(valid & ((t < 0) | (t >= vocab)), float("nan"), nll)
    if ce_weight is not None:
        w_t = torch.where(valid, ce_weight.float()[safe_t], 0.0)
        nll = nll * w_t
        denom = w_t.sum()
        w_sum = ce_weight.float().sum()
    else:
        denom = valid.sum()
        w_sum = float(vocab)
    per_row = nll
    if label_smoothing > 0.0:
        # torch's label smoothing: (1 - eps) * nll + eps / V * sum_c w_c (lse - z_c), with the same normaliser.
        smooth = torch.where(valid, lse * w_sum - swz, 0.0)
        per_row = (1.0 - label_smoothing) * nll + (label_smoothing / vocab) * smooth
    if reduction == "none":
        loss = per_row.view(target.shape)
    elif reduction == "sum":
        loss = per_row.sum()
    else:
        loss = per_row.sum() / denom
    return loss
