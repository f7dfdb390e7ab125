"""Triton kernel: the cross-entropy part of one chunk, one program per token row.

Pass 1 walks the row's logits in blocks of BLOCK_V with an online softmax (running max and sum) to get lse, and the
weighted sum of logits that label smoothing needs (taken relative to the running max: ``_softmax_block``). The
row's loss follows. Without smoothing or the max's column to find (the chunk loop's plain forward), pass 1 can run
lane-wise (``_lane_pass``, when the launch gives LANES > 0: a config with ``lane_pass``, which the CE tile re-pick
chooses where it is faster): each thread keeps its own running max and sum, and the threads are combined once a
row, so the loop holds no warp shuffles and no barrier between the warps. Pass 2, when a gradient is
wanted, re-reads each block, from the row's end back (the blocks pass 1 read last are the likeliest to be in L2
still), and writes dloss/dlogits to the gradient rows: the logits themselves (in place, the usual case) or a
separate buffer when the logits must stay intact (they are returned to the caller). All math is fp32; the
true-class term is formed in fp32 before the single rounding to the gradient's dtype. The logits may be fp32
while the gradient rows are in the compute dtype (``FLCEConfig.fp32_logits``, the "precise" policy): every load is
converted to fp32 and the store is the one rounding, so nothing here depends on it. With ``WRITE_RESIDUAL`` (that
policy too) each row also writes what that rounding took from its true-class entry, g_y - round(g_y) in fp32 (0
when another slice holds the target), for the loop to add back.

An ignored row (target == ignore_index) has loss 0 and gradient 0: unless its lse or statistics are outputs,
neither pass reads its logits, and its gradient row is written as zeros (padding and prompt tokens can be a large
share of a batch).

A row may hold a slice of the classes (``class_offset``, ``vocab`` of ``num_classes``): with a known lse
(``HAS_LSE_IN``) pass 2 then writes that slice's gradient, and pass 1 alone gives the slice's own lse. The loss
(``WRITE_LOSS``) needs whole rows. ``WRITE_STATS`` writes a slice's partial statistics instead (its own lse,
the target's z when the target lies in the slice, the smoothing sum relative to that lse), which the
vocabulary-parallel op combines over ranks.

A mask against a ``vocab`` that is not a multiple of 16 stops Triton from vectorizing the loads and stores
(GPT-2's 50257 ran the kernel at half its bandwidth), so with ``UNMASKED_BLOCKS`` both passes walk the
``vocab_full`` columns of whole blocks without a mask and only the last, partial block with one. A multiple of 16
keeps the one masked loop: it vectorizes as it is, and the unmasked loop costs registers (52 against 32 per
thread at 16384:32, Triton 3.9 compiling for sm_90: half the programs per SM; on an H200 that tile ran 27%
slower at Gemma's 256000). Better still, when the caller owns its rows' padding (the chunk loop's buffers, rows
padded to 128 bytes), ``PADDED`` walks the one masked loop up to ``width``, V rounded up to 16: every load and
store vectorizes, the math masks the columns past V, and their gradient is written as 0 (the CE step of a
4096 x 768 x 50257 call on an H200: 0.73 -> 0.36 ms, with the per-element savings of the same change).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import LANE_WIDTH

#: ``LANE_WIDTH`` as the kernel reads it (a global a kernel reads must be a constexpr).
_LANE_WIDTH = tl.constexpr(LANE_WIDTH)


@triton.jit
def _transform(raw, logit_scale, softcap, HAS_SOFTCAP: tl.constexpr, SCALED: tl.constexpr):
    """Raw logit -> z (scaled when SCALED, then soft-capped), and tanh(s/softcap) for the derivative."""
    s = raw.to(tl.float32)
    if SCALED:  # a constexpr: a scale of 1 costs no multiply an element (the kernel is near its issue limit)
        s = s * logit_scale
    if HAS_SOFTCAP:
        u = s / softcap
        a = tl.abs(u)
        # tanh(|u|) through exp(-2|u|): no overflow for any u, exact sign. Below |u| = 0.4 its 1 - e cancels (an
        # absolute error of ~3e-8 whatever u: a per-token loss 3-11x eager's error against fp64 at softcaps 30-100,
        # a bug hunt found), so there the odd Taylor series to u^13 (truncation below 1e-9; at most 2.4e-7
        # relative, fp32, against 3.4e-3 before).
        e = tl.exp(-2.0 * a)
        u2 = u * u
        series = a + a * u2 * (-0.3333333333333333 + u2 * (0.13333333333333333 + u2 * (
            -0.05396825396825397 + u2 * (0.021869488536155203 + u2 * (-0.008863235529902197
                                                                        + u2 * 0.003592128036572481)))))
        t = tl.where(a < 0.4, series, (1.0 - e) / (1.0 + e))
        t = tl.where(u < 0, -t, t)
        return t * softcap, t
    return s, s


@triton.jit
def _round_bf16_rtne(x):
    """Pre-round fp32 so that a truncating fp32 -> bf16 cast lands on round-to-nearest-even. Only for the
    Triton interpreter, whose bf16 cast truncates; the GPU's cast already rounds to nearest even."""
    bits = x.to(tl.uint32, bitcast=True)
    bits += 0x7FFF + ((bits >> 16) & 1)
    bits = bits & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_block(ptr, offs, vocab, MASKED: tl.constexpr):
    """``ptr[offs]`` as loaded by a block: masked against ``vocab`` (0 beyond it) only when MASKED."""
    if MASKED:
        return tl.load(ptr + offs, mask=offs < vocab, other=0.0)
    return tl.load(ptr + offs)


@triton.jit
def _finite_shift(running_max):
    """The shift the sums are taken relative to: the running max, or 0 while it is -inf. While every logit so far is
    -inf (classes masked through the bias) the max is -inf too, and -inf - -inf would make the sum nan; exact either
    way, since the sum is 0 until a finite logit. The smoothing sum ends relative to it too."""
    return tl.where(running_max == -float("inf"), 0.0, running_max)


@triton.jit
def _softmax_block(row_ptr, class_weight_ptr, offs, vocab, width, running_max, running_sum, smooth_sum, seen,
                   top_col, logit_scale, softcap, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                   HAS_CE_WEIGHT: tl.constexpr, MASKED: tl.constexpr, SCALED: tl.constexpr,
                   PADDED: tl.constexpr, TRACK_TOP: tl.constexpr):
    """One block of pass 1: the online max/sum (and the smoothing sum) updated with the logits at ``offs``.
    MASKED: the block may run past ``vocab`` (see the module's docstring for when a block is not); loads stop at
    ``width`` (V, or with PADDED the padded row: the columns past V then load whatever they hold and are masked
    here).

    The smoothing sum is sum_c w_c (z_c - shift) over the classes seen so far, relative to the running shift (the
    max), with ``seen`` = sum_c w_c over them: when the max rises, the sum moves by seen * (old - new shift).
    With non-negative class weights every term is <= 0, so nothing cancels; the raw sum_c w_c z_c cancelled
    against W lse when every logit carried a large common offset (fp32 at +1000: the loss 4-27x eager's error).

    TRACK_TOP: ``top_col`` follows the column of the row's largest z (the first of equal ones; -1 while none is
    finite), for a backward that recomputes the logits (``CEStepArgs.top_out``)."""
    if MASKED and not PADDED and not HAS_SOFTCAP and not SCALED and not HAS_SMOOTHING:
        # The load's mask is the class mask and z is the raw logit: loading -inf past V masks the max and the
        # sum without a select an element (the kernel is near its issue limit).
        z = tl.load(row_ptr + offs, mask=offs < vocab, other=-float("inf")).to(tl.float32)
        z_max = z
    else:
        raw = _load_block(row_ptr, offs, width, MASKED)
        z, _t = _transform(raw, logit_scale, softcap, HAS_SOFTCAP, SCALED)  # finite where masked (raw = 0)
        if MASKED:
            z_max = tl.where(offs < vocab, z, -float("inf"))
        else:
            z_max = z
    block_max = tl.max(z_max, axis=0)
    if TRACK_TOP:
        first = tl.min(tl.where(z_max == block_max, offs, 2147483647), axis=0)
        top_col = tl.where(block_max > running_max, first, top_col)
    new_max = tl.maximum(running_max, block_max)
    # ``_finite_shift(new_max)`` (0 while every logit so far is -inf), spelled out: called here it compiled to other
    # instructions and register counts at 20 of kernel_ptx's 144 launches, Triton 3.9, 2026-12-07; its other calls
    # compile as the expression did.
    shift = tl.where(new_max == -float("inf"), 0.0, new_max)
    running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(z_max - shift), axis=0)
    if HAS_SMOOTHING:
        term = z - shift
        if HAS_CE_WEIGHT:
            w = _load_block(class_weight_ptr, offs, vocab, MASKED)  # 0 past V
            term = term * w
        if MASKED:  # past V z may be anything (padding): select
            term = tl.where(offs < vocab, term, 0.0)
        old_shift = _finite_shift(running_max)
        # (only where the shift moved: an inf weight seen times a shift that stayed would be nan)
        smooth_sum += tl.where(old_shift != shift, seen * (old_shift - shift), 0.0) + tl.sum(term, axis=0)
        if HAS_CE_WEIGHT:
            seen += tl.sum(w, axis=0)
        elif MASKED:
            seen += tl.sum(tl.where(offs < vocab, 1.0, 0.0), axis=0)
        else:
            seen += offs.shape[0] * 1.0
    return new_max, running_sum, smooth_sum, seen, top_col


@triton.jit
def _gradient_block(row_ptr, grad_row_ptr, class_weight_ptr, offs, vocab, width, target_col, z_target, top_col, z_top,
                    shift, inv_sum, coef, true_class, ce_scale, smooth_per_class, logit_scale, softcap, residual,
                    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_CE_WEIGHT: tl.constexpr,
                    HAS_TARGET_Z: tl.constexpr, HAS_TOP: tl.constexpr, WRITE_RESIDUAL: tl.constexpr,
                    EMULATE_BF16_RTNE: tl.constexpr, MASKED: tl.constexpr, PADDED: tl.constexpr,
                    SCALED: tl.constexpr):
    """One block of pass 2: dloss/dlogits at ``offs`` stored to the gradient row (of a row that is not ignored:
    ``_zero_row`` writes those); returns the running residual. MASKED and ``width`` as in ``_softmax_block``;
    with PADDED (``width`` > V) the columns past V get 0. HAS_TARGET_Z: the target's column takes ``z_target``,
    the forward's z, for its probability (``CEStepArgs.target_z_in``); HAS_TOP: so does the column of the row's
    largest z (``CEStepArgs.top_in``)."""
    raw = _load_block(row_ptr, offs, width, MASKED)
    z, t = _transform(raw, logit_scale, softcap, HAS_SOFTCAP, SCALED)
    if HAS_TOP:
        z = tl.where(offs == top_col, z_top, z)
    if HAS_TARGET_Z:
        z = tl.where(offs == target_col, z_target, z)
    # p = exp(z - max) / sum, as eager's softmax, not exp(z - lse): lse rounded at the logits' magnitude (2e-6 at
    # 20) took 1 - p of a confident row's target with it (dX 5x eager's error at margins of 16, 8x at 24).
    g = coef * (tl.exp(z - shift) * inv_sum) - tl.where(offs == target_col, true_class, 0.0)
    if HAS_SMOOTHING:
        if HAS_CE_WEIGHT:
            g -= ce_scale * smooth_per_class * _load_block(class_weight_ptr, offs, vocab, MASKED)
        else:
            g -= ce_scale * smooth_per_class
    if HAS_SOFTCAP:
        g = g * (1.0 - t * t)
    if SCALED:
        g = g * logit_scale
    if PADDED:
        g = tl.where(offs < vocab, g, 0.0)
    stored = (_round_bf16_rtne(g) if EMULATE_BF16_RTNE else g).to(grad_row_ptr.dtype.element_ty)
    if WRITE_RESIDUAL:
        residual += tl.sum(tl.where(offs == target_col, g - stored.to(tl.float32), 0.0), axis=0)
    if MASKED:
        tl.store(grad_row_ptr + offs, stored, mask=offs < width)
    else:
        tl.store(grad_row_ptr + offs, stored)
    return residual


@triton.jit
def _zero_row(grad_row_ptr, cols, width, BLOCK_V: tl.constexpr):
    """An ignored row's gradient: 0 up to ``width``, written without reading its logits. Written, not
    multiplied: 0 whatever the row's factors (a fully masked "mean" batch has infinite ones)."""
    zeros = tl.zeros([BLOCK_V], dtype=grad_row_ptr.dtype.element_ty)
    for start in range(0, width, BLOCK_V):
        tl.store(grad_row_ptr + start + cols, zeros, mask=start + cols < width)


@triton.jit
def _softmax_pass(row_ptr, class_weight_ptr, cols, vocab, vocab_full, width, logit_scale, softcap,
                  HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_CE_WEIGHT: tl.constexpr,
                  UNMASKED_BLOCKS: tl.constexpr, PADDED: tl.constexpr, SCALED: tl.constexpr,
                  TRACK_TOP: tl.constexpr, BLOCK_V: tl.constexpr):
    """Pass 1 over a row: (running max, running sum, smoothing sum, its weight, the max's column) of its classes;
    the smoothing sum is sum_c w_c (z_c - max), and its weight sum_c w_c; the column only with TRACK_TOP, else
    -1 (``_softmax_block``)."""
    running_max = -float("inf")
    running_sum = 0.0
    smooth_sum = 0.0
    seen = 0.0
    top_col = -1
    if UNMASKED_BLOCKS:
        for start in range(0, vocab_full, BLOCK_V):
            running_max, running_sum, smooth_sum, seen, top_col = _softmax_block(
                row_ptr, class_weight_ptr, start + cols, vocab, width, running_max, running_sum, smooth_sum, seen,
                top_col, logit_scale, softcap, HAS_SOFTCAP, HAS_SMOOTHING, HAS_CE_WEIGHT, MASKED=False,
                SCALED=SCALED, PADDED=False, TRACK_TOP=TRACK_TOP)
        if vocab_full < vocab:
            running_max, running_sum, smooth_sum, seen, top_col = _softmax_block(
                row_ptr, class_weight_ptr, vocab_full + cols, vocab, width, running_max, running_sum, smooth_sum,
                seen, top_col, logit_scale, softcap, HAS_SOFTCAP, HAS_SMOOTHING, HAS_CE_WEIGHT, MASKED=True,
                SCALED=SCALED, PADDED=False, TRACK_TOP=TRACK_TOP)
    else:
        for start in range(0, width, BLOCK_V):
            running_max, running_sum, smooth_sum, seen, top_col = _softmax_block(
                row_ptr, class_weight_ptr, start + cols, vocab, width, running_max, running_sum, smooth_sum, seen,
                top_col, logit_scale, softcap, HAS_SOFTCAP, HAS_SMOOTHING, HAS_CE_WEIGHT, MASKED=True,
                SCALED=SCALED, PADDED=PADDED, TRACK_TOP=TRACK_TOP)
    return running_max, running_sum, smooth_sum, seen, top_col


@triton.jit
def _lane_block(row_ptr, offs, vocab, width, lane_max, lane_sum, logit_scale, softcap, HAS_SOFTCAP: tl.constexpr,
                MASKED: tl.constexpr, SCALED: tl.constexpr, PADDED: tl.constexpr):
    """One block of the lane-wise pass 1 (``_lane_pass``): each lane's running max and sum updated with its own
    logits at ``offs`` (a [rows, LANES, VEC] tile, a lane's elements in one thread), with no exchange between
    lanes. MASKED, ``width`` and PADDED as in ``_softmax_block``."""
    if MASKED and not PADDED and not HAS_SOFTCAP and not SCALED:
        z = tl.load(row_ptr + offs, mask=offs < vocab, other=-float("inf")).to(tl.float32)
    else:
        raw = _load_block(row_ptr, offs, width, MASKED)
        z, _t = _transform(raw, logit_scale, softcap, HAS_SOFTCAP, SCALED)
        if MASKED:
            z = tl.where(offs < vocab, z, -float("inf"))
    new_max = tl.maximum(lane_max, tl.max(tl.max(z, axis=2), axis=0))
    shift = _finite_shift(new_max)  # a lane of -inf so far: 0
    block_sum = tl.sum(tl.sum(tl.exp(z - shift[None, :, None]), axis=2), axis=0)
    return new_max, lane_sum * tl.exp(lane_max - shift) + block_sum


@triton.jit
def _lane_pass(row_ptr, vocab, vocab_full, width, logit_scale, softcap, HAS_SOFTCAP: tl.constexpr,
               UNMASKED_BLOCKS: tl.constexpr, PADDED: tl.constexpr, SCALED: tl.constexpr, BLOCK_V: tl.constexpr,
               LANES: tl.constexpr, VEC: tl.constexpr):
    """Pass 1 without smoothing or the max's column: (max, sum) of the row, as ``_softmax_pass`` returns them.

    ``_softmax_pass`` reduces each block over the whole program (a max and a sum: two rounds of warp shuffles and
    shared-memory barriers a block), so every warp waits for the slowest one's loads before it may issue its next.
    Here each of LANES lanes (LANES threads x VEC contiguous elements, one thread's 16-byte loads) keeps its own
    running max and sum over the row, and the lanes are combined once, at the row's end: the loop holds no barrier.
    One more exp a lane a block (its sum's rescale), against VEC x rows exps of the block's logits."""
    ROWS: tl.constexpr = BLOCK_V // (LANES * VEC)
    tile = (tl.arange(0, ROWS)[:, None, None] * (LANES * VEC) + tl.arange(0, LANES)[None, :, None] * VEC
            + tl.arange(0, VEC)[None, None, :])
    lane_max = tl.full([LANES], -float("inf"), tl.float32)
    lane_sum = tl.zeros([LANES], tl.float32)
    if UNMASKED_BLOCKS:
        for start in range(0, vocab_full, BLOCK_V):
            lane_max, lane_sum = _lane_block(row_ptr, start + tile, vocab, width, lane_max, lane_sum, logit_scale,
                                             softcap, HAS_SOFTCAP, MASKED=False, SCALED=SCALED, PADDED=False)
        if vocab_full < vocab:
            lane_max, lane_sum = _lane_block(row_ptr, vocab_full + tile, vocab, width, lane_max, lane_sum,
                                             logit_scale, softcap, HAS_SOFTCAP, MASKED=True, SCALED=SCALED,
                                             PADDED=False)
    else:
        for start in range(0, width, BLOCK_V):
            lane_max, lane_sum = _lane_block(row_ptr, start + tile, vocab, width, lane_max, lane_sum, logit_scale,
                                             softcap, HAS_SOFTCAP, MASKED=True, SCALED=SCALED, PADDED=PADDED)
    running_max = tl.max(lane_max, axis=0)
    shift = _finite_shift(running_max)
    return running_max, tl.sum(lane_sum * tl.exp(lane_max - shift), axis=0)


@triton.jit
def _gradient_pass(row_ptr, grad_row_ptr, class_weight_ptr, cols, vocab, vocab_full, width, target_col, z_target,
                   top_col, z_top, shift, inv_sum, coef, true_class, ce_scale, smooth_per_class, logit_scale, softcap,
                   HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_CE_WEIGHT: tl.constexpr,
                   HAS_TARGET_Z: tl.constexpr, HAS_TOP: tl.constexpr, WRITE_RESIDUAL: tl.constexpr,
                   EMULATE_BF16_RTNE: tl.constexpr, UNMASKED_BLOCKS: tl.constexpr, PADDED: tl.constexpr,
                   SCALED: tl.constexpr, BLOCK_V: tl.constexpr):
    """Pass 2 over a row that is not ignored: its gradient written; returns the true-class residual.

    The blocks go from the row's end back to its start: the blocks pass 1 read last are the likeliest to be in L2
    still (on an H200, a chunk's step 2-5% faster at each shape's best tile, V = 32000-256000)."""
    residual = 0.0
    if UNMASKED_BLOCKS:  # the partial last block first, masked; then the whole blocks without a mask
        if vocab_full < vocab:
            residual = _gradient_block(
                row_ptr, grad_row_ptr, class_weight_ptr, vocab_full + cols, vocab, width, target_col, z_target,
                top_col, z_top, shift, inv_sum, coef, true_class, ce_scale, smooth_per_class, logit_scale, softcap,
                residual, HAS_SOFTCAP, HAS_SMOOTHING, HAS_CE_WEIGHT, HAS_TARGET_Z, HAS_TOP, WRITE_RESIDUAL,
                EMULATE_BF16_RTNE, MASKED=True, PADDED=PADDED, SCALED=SCALED)
        blocks = vocab_full // BLOCK_V
    else:  # every block masked up to width
        blocks = tl.cdiv(width, BLOCK_V)
    for index in range(0, blocks):
        residual = _gradient_block(
            row_ptr, grad_row_ptr, class_weight_ptr, (blocks - 1 - index) * BLOCK_V + cols, vocab, width,
            target_col, z_target, top_col, z_top, shift, inv_sum, coef, true_class, ce_scale, smooth_per_class,
            logit_scale, softcap, residual, HAS_SOFTCAP, HAS_SMOOTHING, HAS_CE_WEIGHT, HAS_TARGET_Z, HAS_TOP,
            WRITE_RESIDUAL, EMULATE_BF16_RTNE, MASKED=not UNMASKED_BLOCKS, PADDED=PADDED and not UNMASKED_BLOCKS,
            SCALED=SCALED)
    return residual


@triton.jit
def ce_chunk_kernel(
    logits_ptr,
    stride_row,
    grad_ptr,
    grad_stride_row,
    target_ptr,
    ce_weight_ptr,
    weight_sum_ptr,
    ce_scale_ptr,
    z_scale_ptr,
    scale_stride,
    loss_ptr,
    lse_out_ptr,
    lse_in_ptr,
    target_z_out_ptr,
    target_z_in_ptr,
    top_out_ptr,
    top_in_ptr,
    top_stride,
    stats_ptr,
    stats_stride,
    residual_ptr,
    vocab,
    vocab_full,
    width,
    class_offset,
    num_classes,
    ignore_index,
    label_smoothing,
    softcap,
    logit_scale,
    z_loss,
    HAS_CE_WEIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_LSE_IN: tl.constexpr,
    HAS_TARGET_Z_IN: tl.constexpr,
    HAS_TOP_IN: tl.constexpr,
    WRITE_LOSS: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    WRITE_TARGET_Z: tl.constexpr,
    WRITE_TOP: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    WRITE_STATS: tl.constexpr,
    WRITE_RESIDUAL: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr,
    UNMASKED_BLOCKS: tl.constexpr,
    PADDED: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK_V: tl.constexpr,
    LANES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    target = tl.load(target_ptr + row)
    ignored = target == ignore_index
    invalid = (target < 0) | (target >= num_classes)
    invalid = invalid & (ignored == 0)
    safe_target = tl.where(ignored | invalid, 0, target)
    # The row's columns are classes [class_offset, class_offset + vocab): the target's column, which lies
    # outside them when another slice holds the target (no true-class term here then).
    target_col = (safe_target - class_offset).to(tl.int32)  # int32: compared with every column's offset
    cols = tl.arange(0, BLOCK_V)

    if HAS_LSE_IN:
        # An fp64 lse (the forward's, kept for backward) splits into its fp32 value and the rest, which the
        # probabilities take as a factor: exp(z - lse) from the fp32 value alone lost a confident row's 1 - p.
        # (An fp32 one has no rest; an infinite one keeps exp(z - lse).)
        lse_full = tl.load(lse_in_ptr + row).to(tl.float64)
        lse = lse_full.to(tl.float32)
        rest = tl.where(lse_full - lse_full == 0.0, lse_full - lse.to(tl.float64), 0.0).to(tl.float32)
        smooth_sum = 0.0  # (no pass 1, so no smoothing sum: the chunk loops ask no loss of a call with a kept lse)
        seen = 0.0
        shift, inv_sum = lse, tl.exp(-rest)
    else:
        if WRITE_LSE or WRITE_STATS:  # every row's statistics are outputs
            running_max, running_sum, smooth_sum, seen, top_col = _softmax_pass(
                row_ptr, ce_weight_ptr + class_offset, cols, vocab, vocab_full, width, logit_scale, softcap,
                HAS_SOFTCAP, HAS_SMOOTHING, HAS_CE_WEIGHT, UNMASKED_BLOCKS, PADDED, SCALED, WRITE_TOP, BLOCK_V)
        else:
            # An ignored row's loss is 0 and its gradient 0: its logits are not read (padding and prompt tokens
            # can be a large share of a batch). Its lse stays -inf, unused.
            running_max = -float("inf")
            running_sum = 0.0
            smooth_sum = 0.0
            seen = 0.0
            top_col = -1
            if ignored == 0:
                if LANES > 0 and not HAS_SMOOTHING:
                    running_max, running_sum = _lane_pass(
                        row_ptr, vocab, vocab_full, width, logit_scale, softcap, HAS_SOFTCAP, UNMASKED_BLOCKS,
                        PADDED, SCALED, BLOCK_V, LANES, _LANE_WIDTH)
                else:
                    running_max, running_sum, smooth_sum, seen, top_col = _softmax_pass(
                        row_ptr, ce_weight_ptr + class_offset, cols, vocab, vocab_full, width, logit_scale,
                        softcap, HAS_SOFTCAP, HAS_SMOOTHING, HAS_CE_WEIGHT, UNMASKED_BLOCKS, PADDED, SCALED, False,
                        BLOCK_V)
        log_sum = tl.log(running_sum)
        lse = running_max + log_sum
        shift, inv_sum = running_max, 1.0 / running_sum

    if HAS_CE_WEIGHT:
        w_y = tl.load(ce_weight_ptr + safe_target)
    else:
        w_y = 1.0
    ce_scale = tl.load(ce_scale_ptr + row * scale_stride)
    z_scale = tl.load(z_scale_ptr + row * scale_stride)
    weight_sum = tl.load(weight_sum_ptr)
    smooth_per_class = label_smoothing / num_classes

    if WRITE_LOSS or WRITE_TARGET_Z:  # the target's z: the loss's, and the one a recomputing backward keeps
        z_y, _t = _transform(tl.load(row_ptr + safe_target), logit_scale, softcap, HAS_SOFTCAP, SCALED)
    if (WRITE_LSE and not HAS_LSE_IN) or WRITE_STATS:  # max + log(sum) in fp64: an fp64 output keeps it unrounded
        lse_exact = running_max.to(tl.float64) + log_sum.to(tl.float64)
    if WRITE_LOSS:
        # lse - z_y as (max - z_y) + log(sum): no rounding of lse at the logits' magnitude (a confident row's
        # loss is far below it)
        if HAS_LSE_IN:
            gap_y = lse - z_y
        else:
            gap_y = (running_max - z_y) + log_sum
        ce = (1.0 - label_smoothing) * w_y * gap_y
        if HAS_SMOOTHING:  # sum_c w_c (lse - z_c) = W (lse - max) - sum_c w_c (z_c - max): no cancellation
            if HAS_LSE_IN:  # no pass 1, so no smoothing sum (0): the chunk loops never ask for this loss
                lse_rel = lse
            else:
                lse_rel = (running_max - _finite_shift(running_max)) + log_sum
            ce += smooth_per_class * (weight_sum * lse_rel - smooth_sum)
        loss = ce * ce_scale
        if HAS_Z_LOSS:
            loss += z_loss * lse * lse * z_scale
        loss = tl.where(ignored, 0.0, loss)
        loss = tl.where(invalid, float("nan"), loss)
        tl.store(loss_ptr + row, loss)
    if WRITE_LSE:  # in the output's dtype: fp64 keeps max + log(sum) unrounded (``chunked.LSE_DTYPE``)
        if HAS_LSE_IN:
            tl.store(lse_out_ptr + row, lse)
        else:
            tl.store(lse_out_ptr + row, lse_exact)
    if WRITE_TARGET_Z:  # the target's z, for a backward that recomputes the logits (a whole row: ``CEStepArgs``)
        tl.store(target_z_out_ptr + row, z_y)
    if WRITE_TOP:  # the largest z and its class, for a backward that recomputes the logits (``CEStepArgs.top_out``)
        tl.store(top_out_ptr + row, running_max)
        tl.store(top_out_ptr + top_stride + row, tl.where(top_col >= 0, class_offset + top_col, -1))
    if WRITE_STATS:
        here = (target_col >= 0) & (target_col < vocab)
        raw_t = tl.load(row_ptr + tl.where(here, target_col, 0))
        z_t, _t = _transform(raw_t, logit_scale, softcap, HAS_SOFTCAP, SCALED)
        tl.store(stats_ptr + row, lse_exact)
        tl.store(stats_ptr + stats_stride + row, tl.where(here, z_t, 0.0))
        # The slice's sum_c w_c (z_c - lse_r) = sum_c w_c (z_c - max) - W_r log(sum): terms of one sign, and the
        # ranks' combination adds W_r (lse - lse_r) >= 0 to each (the raw sum_c w_c z_c cancelled there under a
        # large common offset of the logits). A row of -inf keeps its sum (no shift: -inf - -inf would be nan).
        shifted = smooth_sum.to(tl.float64) - seen.to(tl.float64) * log_sum.to(tl.float64)
        tl.store(stats_ptr + 2 * stats_stride + row, tl.where(running_max == -float("inf"), smooth_sum, shifted))

    if WRITE_GRAD and (WRITE_LOSS or WRITE_TARGET_Z or WRITE_STATS):
        # The gradient may overwrite the logits in place, and the warps of this program run apart: without a
        # barrier, the warp storing the target's block could do so before another had loaded the target's
        # logit above (an H100 saw about 1 launch in 200 of a 2048-row chunk give one row the loss of its
        # gradient's value; a replayed training step's loss then differed from the uncaptured one).
        tl.debug_barrier()
    if WRITE_GRAD:
        if HAS_SMOOTHING:  # (not 0 * the weight sum: an inf weight of a class no target has made every g nan)
            coef = ce_scale * ((1.0 - label_smoothing) * w_y + smooth_per_class * weight_sum)
        else:
            coef = ce_scale * w_y
        if HAS_Z_LOSS:
            coef += z_scale * 2.0 * z_loss * lse
        true_class = ce_scale * (1.0 - label_smoothing) * w_y
        # An invalid target makes the whole row nan: through its factor, not a select an element.
        coef = tl.where(invalid, float("nan"), coef)
        if HAS_TARGET_Z_IN:
            z_target = tl.load(target_z_in_ptr + row).to(tl.float32)
        else:
            z_target = 0.0
        if HAS_TOP_IN:  # (class -1, none, matches no column; nor does a class another slice holds)
            z_top = tl.load(top_in_ptr + row).to(tl.float32)
            kept_top_col = (tl.load(top_in_ptr + top_stride + row) - class_offset).to(tl.int32)
        else:
            z_top = 0.0
            kept_top_col = -1
        grad_row_ptr = grad_ptr + row * grad_stride_row
        residual = 0.0
        if ignored:
            _zero_row(grad_row_ptr, cols, width, BLOCK_V)
        else:
            residual = _gradient_pass(
                row_ptr, grad_row_ptr, ce_weight_ptr + class_offset, cols, vocab, vocab_full, width, target_col,
                z_target, kept_top_col, z_top, shift, inv_sum, coef, true_class, ce_scale, smooth_per_class,
                logit_scale, softcap, HAS_SOFTCAP, HAS_SMOOTHING, HAS_CE_WEIGHT, HAS_TARGET_Z_IN, HAS_TOP_IN,
                WRITE_RESIDUAL, EMULATE_BF16_RTNE, UNMASKED_BLOCKS, PADDED, SCALED, BLOCK_V)
        if WRITE_RESIDUAL:
            tl.store(residual_ptr + row, residual)
