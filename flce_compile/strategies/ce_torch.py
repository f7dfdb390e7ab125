"""The cross-entropy step of one chunk in plain PyTorch: the CPU path, and the reference for the kernel.

Given one chunk of raw logits (rows x V, in the compute dtype) it writes each row's scaled loss and lse and,
when asked, writes the gradient of the loss with respect to them (over the logits, or into ``grad_out``). All
math is fp32 (fp64 for fp64 logits).

Memory: one chunk-sized buffer in the math dtype, ``z``, goes from the transformed logits to exp(z - max) to
the gradient in place; where the gradient overwrites logits already in the math dtype (the CPU's fp32 chunk
loop), ``z`` is the logits themselves, and where it goes to a gradient buffer in the math dtype (kept logits on
the CPU), ``z`` is that buffer. No ``torch.logsumexp``, whose exp(z - max) is a temporary of the
chunk's size; the probabilities are exp(z - max) / sum instead of exp(z - lse), which also spares them the
rounding of a large lse. The lse is max + log1p(the sum of the classes other than the max) and the target's
gradient takes p - 1 as expm1(z_t - lse): a confident row's 1 - p is far below the rounding of p and of the
sum at 1, which eager's softmax keeps (``_exp_shifted_``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..params import LossParams, math_dtype
from .ce_common import CEStepArgs

if TYPE_CHECKING:
    from ..plan.config import FLCEConfig


def ce_step_torch(args: CEStepArgs, p: LossParams, config: FLCEConfig | None = None) -> None:  # noqa: ARG001
    """Run the CE step of one chunk with torch ops (see ``CEStepArgs`` for the contract). ``config`` is the
    registry's step signature; this step has no launch parameters to read from it."""
    args.check_slice()
    logits, target = args.logits, args.target
    columns, vocab, offset = logits.shape[1], args.classes(), args.class_offset
    eps = p.label_smoothing
    z = _work_buffer(args)
    if p.logit_scale != 1.0:
        z.mul_(p.logit_scale)
    tanh_z = None
    if p.softcap:
        tanh_z = z.div_(p.softcap).tanh_()
        z = tanh_z * p.softcap
    ignored = target == p.ignore_index
    invalid = ~ignored & ((target < 0) | (target >= vocab))
    safe_target = torch.where(ignored | invalid, torch.zeros_like(target), target)
    col = safe_target - offset
    here = (col >= 0) & (col < columns)
    col_index = torch.where(here, col, 0)[:, None]  # each row's target column in this slice (0 when elsewhere)
    # What the loss and the statistics read of z, taken before z turns into probabilities.
    wants_stats = args.stats_out is not None or args.loss_out is not None or args.target_z_out is not None
    z_y = z.gather(1, col_index).squeeze(1) if wants_stats else None
    if args.target_z_out is not None:
        args.target_z_out.copy_(z_y)
    peak = None
    if args.top_out is not None:  # the row's largest z and its class, for a recomputing backward (``CEStepArgs``)
        peak = z.max(dim=1)
        top_col = peak.indices
        args.top_out[0].copy_(peak.values)
        args.top_out[1].copy_(torch.where(peak.values > float("-inf"), top_col + offset, -1))
    if args.top_in is not None and args.lse_in is not None and args.write_grad:
        # The forward's largest z in its class's column, where that lies in this slice (as the target's, below)
        top_class = args.top_in[1].to(torch.int64)
        top_col = top_class - offset
        has_top = (top_class >= 0) & (top_col >= 0) & (top_col < columns)
        _put_kept_z_(z, torch.where(has_top, top_col, 0)[:, None], has_top, args.top_in[0])
    if args.target_z_in is not None and args.lse_in is not None:
        # The forward's target z in the target's column, where the target lies in this slice: the probability
        # formed from it is the forward's, whatever rounding the recomputed logits got (``CEStepArgs``)
        _put_kept_z_(z, col_index, here, args.target_z_in)
    # The target's z as the probabilities read it, for its 1 - p (below)
    z_t = z.gather(1, col_index).squeeze(1) if args.write_grad else None
    wants_sum = bool(eps) and wants_stats
    class_w = args.ce_weight[offset:offset + columns] if args.ce_weight is not None else None
    # lse_full: max + log1p(the others' sum) unrounded, in fp64 (``chunked.LSE_DTYPE``), for the loss (lse - z_y
    # of a confident row is far below lse's rounding at the logits' magnitude), the kept lse and backward's p
    if args.lse_in is None:
        # z is exp(z - max) from here on; with smoothing, rel_sum = sum_c w_c (z_c - max)
        sums, lse_full, shift, rel_sum = _exp_shifted_(
            z, class_w, wants_sum and (args.loss_out is not None or args.stats_out is not None), peak)
    else:
        sums, lse_full, shift, rel_sum = None, args.lse_in, None, None
        if wants_sum and args.loss_out is not None:  # relative to the kept lse (the chunk loops never ask this)
            shift = lse_full.to(z.dtype)
            rel_sum = _class_sum(z - shift[:, None], class_w)
    lse = lse_full.to(z.dtype)  # (fp32 + fp32 is exact in fp64, so this is the fp32 sum's rounding)
    w_y = args.ce_weight[safe_target] if args.ce_weight is not None else torch.ones_like(lse)
    ce_scale, z_scale = args.ce_scale, args.z_scale

    if args.stats_out is not None:
        _write_stats(args, p, lse_full, torch.where(here, z_y, 0.0), rel_sum, shift, class_w)
    if args.loss_out is not None:
        # sum_c w_c (lse - z_c) = W (lse - max) - sum_c w_c (z_c - max): terms of one sign, nothing cancels (the
        # raw W lse - sum_c w_c z_c did, under a large common offset of the logits)
        smoothing = args.weight_sum * (lse_full - shift.to(lse_full.dtype)) - rel_sum if wants_sum else None
        args.loss_out.copy_(row_loss(p, lse_full, z_y, smoothing, w_y, vocab, ce_scale, z_scale, ignored, invalid))
        if args.lse_out is not None:
            args.lse_out.copy_(lse_full)

    if not args.write_grad:
        return
    # d loss_i / d z_ic = coef_i * p_ic - a_i (1-eps) w_y [c == y] - a_i (eps/V) w_c, with a_i the CE scale.
    # Over a slice of the classes, the true-class term falls on the rows whose target lies in the slice.
    g = z.div_(sums[:, None]) if sums is not None else _probabilities_from_lse_(z, lse_full)
    p_t = g.gather(1, col_index).squeeze(1)
    # coef = true + rest: the true-class weight a_i (1-eps) w_y, and the smoothing and z-loss parts
    # (the class-weight sum only with smoothing: 0 * an inf weight of a class no target has made every gradient nan)
    coef = ce_scale * ((1.0 - eps) * w_y + (eps / vocab) * args.weight_sum if eps else w_y)
    rest = ce_scale * ((eps / vocab) * args.weight_sum) if eps else torch.zeros_like(lse)
    if p.z_loss:
        z_term = z_scale * (2.0 * p.z_loss) * lse
        coef, rest = coef + z_term, rest + z_term
    g.mul_(coef[:, None])
    true_class = ce_scale * (1.0 - eps) * w_y
    # The target's coef p - true as rest p + true (p - 1), with p - 1 = expm1(z_t - lse) from the fp64 lse: a
    # confident row's p rounds within an ulp of 1, and coef p - true kept that rounding alone (dX and dW of rows
    # sure of their target at a margin of 24: 1e-3 from fp64, as eager's; 2-5e-6 this way)
    p_minus_1 = torch.expm1(z_t.to(lse_full.dtype) - lse_full).to(g.dtype)
    g_t = rest * p_t + true_class * p_minus_1
    g.scatter_(1, col_index, torch.where(here, g_t, coef * p_t)[:, None])  # (elsewhere: the value g holds)
    if eps:
        if class_w is None:
            class_w = torch.ones(columns, dtype=g.dtype, device=g.device)
        g.addr_(ce_scale.expand_as(lse).contiguous(), class_w, alpha=-eps / vocab)
    if tanh_z is not None:
        g.mul_(tanh_z.square_().neg_().add_(1.0))  # d softcap*tanh(s/softcap) / ds = 1 - tanh^2
    if p.logit_scale != 1.0:
        g.mul_(p.logit_scale)
    g.masked_fill_(ignored[:, None], 0.0).masked_fill_(invalid[:, None], float("nan"))
    out = args.grad_out if args.grad_out is not None else logits
    if args.residual_out is not None:
        g_y = g.gather(1, col_index).squeeze(1)
        rounding = g_y - g_y.to(out.dtype).to(g_y.dtype)
        args.residual_out.copy_(torch.where(here, rounding, 0.0))
    if out is not g:
        out.copy_(g)


def _work_buffer(args: CEStepArgs) -> torch.Tensor:
    """The math-dtype buffer the step works in, holding the logits: the logits themselves when the gradient
    overwrites them or they are the caller's scratch, the gradient buffer when it is in the math dtype (kept
    logits on the CPU), else a copy."""
    logits, out = args.logits, args.grad_out
    dtype = math_dtype(logits.dtype)
    if (args.write_grad or args.scratch) and out is None and logits.dtype == dtype:
        return logits
    if args.write_grad and out is not None and out.dtype == dtype:
        return out.copy_(logits)
    return logits.to(dtype, copy=True)


def _put_kept_z_(z: torch.Tensor, index: torch.Tensor, here: torch.Tensor, kept_z: torch.Tensor) -> None:
    """Each row's z at column ``index`` (rows, 1) replaced by the forward's ``kept_z`` where ``here``: recomputed
    logits can round apart from the forward's (``CEStepArgs.target_z_in``, ``top_in``)."""
    kept = torch.where(here, kept_z.to(z.dtype), z.gather(1, index).squeeze(1))
    z.scatter_(1, index, kept[:, None])


def _exp_shifted_(z: torch.Tensor, class_w: torch.Tensor | None = None, smoothing: bool = False,
                  peak: torch.return_types.max | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Turn ``z`` (rows x C) into exp(z - shift) in place, the shift being each row's max; return each row's sum
    of exp(z - shift), its lse in fp64 (max + log(sum) unrounded), the shift and, with ``smoothing``,
    sum_c w_c (z_c - shift) (``class_w``: w, None for ones).
    The lse is max + log1p(the sum without the max's own 1): summed with the 1, a confident row's lse - max
    (about 1e-6 when the other classes lie 14 and more below the max) is a few ulps of 1 (1.2e-7), and it is
    that row's loss and its target's 1 - p.
    A row of -inf gets lse -inf. A row holding +inf has no softmax: its sum, and so its lse, loss and
    probabilities, is nan, as eager's log_softmax and the Triton kernel give it (torch.logsumexp's +inf gave
    this step a loss of inf there: the same call read inf on the CPU and nan on a GPU). Its shift is the largest
    finite value, so finite z do not overflow. ``peak``: each row's max and its column (``z.max(dim=1)``), when
    the caller has them already."""
    peak_z, peak_col = z.max(dim=1) if peak is None else peak
    shift = torch.where(peak_z == float("-inf"), 0.0, peak_z.clamp(max=torch.finfo(z.dtype).max))
    z.sub_(shift[:, None])
    rel_sum = _class_sum(z, class_w) if smoothing else None
    z.exp_()
    # the max's own term (1; 0 for a row of -inf, inf or nan for a row holding +inf or nan), summed apart
    peak_col = peak_col[:, None]
    own = z.gather(1, peak_col)
    others = z.scatter_(1, peak_col, 0.0).sum(dim=1)
    z.scatter_(1, peak_col, own)
    own = own.squeeze(1)
    sums = others + own
    sums.masked_fill_(peak_z == float("inf"), float("nan"))
    log_sum = torch.where(own == 1.0, torch.log1p(others.double()), sums.double().log())
    return sums, log_sum.add_(shift.double()), shift, rel_sum


def _class_sum(z: torch.Tensor, class_w: torch.Tensor | None) -> torch.Tensor:
    """Each row's sum_c w_c z_c (plain sum without class weights)."""
    return z @ class_w if class_w is not None else z.sum(dim=1)


def _probabilities_from_lse_(z: torch.Tensor, lse_full: torch.Tensor) -> torch.Tensor:
    """Turn ``z`` into exp(z - lse) in place, as the Triton kernel forms it from a kept lse: an fp64 lse splits
    into its value in z's dtype and the rest, which the probabilities take as a factor (a confident row's 1 - p
    needs more than the fp32 lse). ``z.sub_`` of the fp64 lse itself computed in fp64 through a temporary twice
    the chunk's fp32 size, which the memory bound leaves out. An infinite lse has no rest."""
    if lse_full.dtype == z.dtype:
        return z.sub_(lse_full[:, None]).exp_()
    lse = lse_full.to(z.dtype)
    rest = torch.where(torch.isfinite(lse_full), lse_full - lse.to(lse_full.dtype), 0.0).to(z.dtype)
    return z.sub_(lse[:, None]).exp_().mul_(rest.neg_().exp_()[:, None])


def row_loss(p: LossParams, lse: torch.Tensor, z_y: torch.Tensor, smoothing: torch.Tensor | None,
             w_y: torch.Tensor, vocab: int, ce_scale: torch.Tensor, z_scale: torch.Tensor, ignored: torch.Tensor,
             invalid: torch.Tensor) -> torch.Tensor:
    """Each row's scaled loss from its statistics over all ``vocab`` classes: the lse, the target's z, the
    smoothing term sum_c w_c (lse - z_c) (None without label smoothing) and the target's class weight. 0 for
    ignored rows, nan for out-of-range targets. Shared by the CE step and the vocabulary-parallel op, which sums
    the statistics of its ranks' slices first."""
    eps = p.label_smoothing
    ce = (1.0 - eps) * w_y * (lse - z_y)
    if eps:
        ce = ce + (eps / vocab) * smoothing
    row = ce * ce_scale
    if p.z_loss:
        row = row + p.z_loss * lse * lse * z_scale
    return row.masked_fill(ignored, 0.0).masked_fill(invalid, float("nan"))


def _write_stats(args: CEStepArgs, p: LossParams, lse: torch.Tensor, z_y: torch.Tensor,
                 rel_sum: torch.Tensor | None, shift: torch.Tensor, class_w: torch.Tensor | None) -> None:
    """A slice's partial statistics (see ``CEStepArgs.stats_out``): its lse, the target's z where the target
    lies in the slice (else 0) and, with label smoothing, the slice's sum_c w_c (z_c - lse_r) from ``rel_sum``
    = sum_c w_c (z_c - shift): rel_sum - W_r (lse_r - shift), terms of one sign (the kernel's formula)."""
    out = args.stats_out
    out[0].copy_(lse)
    out[1].copy_(z_y)
    if p.label_smoothing:
        slice_weight = class_w.sum(dtype=lse.dtype) if class_w is not None else float(args.logits.shape[1])
        log_sum = lse - shift.to(lse.dtype)
        rel_sum = rel_sum.to(lse.dtype)
        # a row of -inf keeps its sum (no shift: -inf - -inf would be nan)
        out[2].copy_(torch.where(lse == float("-inf"), rel_sum, rel_sum - slice_weight * log_sum))
    else:
        out[2].zero_()
