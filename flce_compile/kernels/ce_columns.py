"""Triton kernels: the cross-entropy step over vocabulary-major logits, (V, T), a block of tokens per program.

Why this layout: at a V whose rows are not a multiple of 16 bytes (GPT-2's 50257) token-major logits (T, V) need
every GEMM to run over V padded to 128 bytes, which costs a padded copy of the weight on every call (77 MB at
50257 x 768, 45 us on an H200) and a split dW GEMM. Stored (V, T), each GEMM operand's contiguous extent is T or H,
aligned whatever V is: logits^T = W X^T, dX = (G^T)^T W and dW = G^T X need no copy (``strategies.vocab_major``).

Each program holds BLOCK_T tokens (contiguous columns: its loads are coalesced along them) and walks the
vocabulary's rows in blocks of BLOCK_V. Pass 1 is an online softmax per token (running max and sum); pass 2, when
a gradient is wanted, writes dloss/dlogits over the logits in place, p = exp(z - max) / sum (eager's form: the
``ce_chunk`` kernel says why not exp(z - lse)) minus the true class, times the row's factor. All math is fp32, one
rounding at the store. The vocabulary may be split into SEGMENTS that programs of their own walk, when too few
token blocks would leave SMs idle: the statistics kernel then writes each segment's (max, sum), and the gradient
kernel combines them before its pass.

What this kernel covers is the plain cross-entropy: no label smoothing, class weights, softcap, logit scale or
z-loss, and no lse or statistics outputs (the caller, ``vocab_major.applies``, routes everything else to the
token-major loop). An ignored token (target == ignore_index) has loss 0 and gradient 0, written, not multiplied;
a target outside [0, V) that is not ignored makes the token's loss and gradient nan.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .ce_chunk import _round_bf16_rtne


@triton.jit
def _block_pointers(logits_ptr, stride_v, rows, tokens):
    """Pointers of the (BLOCK_V, BLOCK_T) block: vocabulary rows down, tokens across (contiguous)."""
    return logits_ptr + rows[:, None].to(tl.int64) * stride_v + tokens[None, :]


@triton.jit
def _segment_stats(logits_ptr, stride_v, tokens, token_mask, lo, hi, BLOCK_V: tl.constexpr,
                   BLOCK_T: tl.constexpr):
    """Pass 1 over vocabulary rows [lo, hi): each token's running max and sum of exp(z - max) (sum 0 and max -inf
    for an empty range)."""
    running_max = tl.full([BLOCK_T], -float("inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_T], tl.float32)
    offsets = tl.arange(0, BLOCK_V)
    for start in range(lo, hi, BLOCK_V):
        rows = start + offsets
        mask = (rows < hi)[:, None] & token_mask[None, :]
        z = tl.load(_block_pointers(logits_ptr, stride_v, rows, tokens), mask=mask, other=-float("inf"))
        z = z.to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        # -inf while nothing finite was seen (an empty range, a token past T): shift by 0, not -inf - -inf = nan
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(z - shift[None, :]), axis=0)
        running_max = new_max
    return running_max, running_sum


@triton.jit
def _segment_gradient(logits_ptr, stride_v, tokens, token_mask, lo, hi, safe_target, shift, inv_sum, coef, ignored,
                      EMULATE_BF16_RTNE: tl.constexpr, BLOCK_V: tl.constexpr):
    """Pass 2 over vocabulary rows [lo, hi), from the last block back (those pass 1 read last may still be in
    L2): the gradient written over the logits."""
    offsets = tl.arange(0, BLOCK_V)
    blocks = tl.cdiv(hi - lo, BLOCK_V)
    for index in range(0, blocks):
        rows = lo + (blocks - 1 - index) * BLOCK_V + offsets
        mask = (rows < hi)[:, None] & token_mask[None, :]
        pointers = _block_pointers(logits_ptr, stride_v, rows, tokens)
        z = tl.load(pointers, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(z - shift[None, :]) * inv_sum[None, :]
        g = coef[None, :] * p - tl.where(rows[:, None] == safe_target[None, :], coef[None, :], 0.0)
        g = tl.where(ignored[None, :], 0.0, g)
        stored = (_round_bf16_rtne(g) if EMULATE_BF16_RTNE else g).to(logits_ptr.dtype.element_ty)
        tl.store(pointers, stored, mask=mask)


@triton.jit
def _token_terms(target_ptr, scale_ptr, scale_stride, tokens, token_mask, vocab, ignore_index):
    """Per token: the target (0 where ignored or invalid, safe to index with), whether it is ignored, and the
    gradient's factor (the row's scale; nan for an invalid target)."""
    target = tl.load(target_ptr + tokens, mask=token_mask, other=ignore_index)
    ignored = target == ignore_index
    invalid = ((target < 0) | (target >= vocab)) & (ignored == 0)
    safe_target = tl.where(ignored | invalid, 0, target)
    scale = tl.load(scale_ptr + tokens * scale_stride, mask=token_mask, other=0.0)
    coef = tl.where(invalid, float("nan"), scale)
    return safe_target, ignored, invalid, coef


@triton.jit
def _target_logit(logits_ptr, stride_v, tokens, token_mask, safe_target):
    """Each token's logit at its target, fp32."""
    z_y = tl.load(logits_ptr + safe_target.to(tl.int64) * stride_v + tokens, mask=token_mask, other=0.0)
    return z_y.to(tl.float32)


@triton.jit
def _store_loss(loss_ptr, tokens, token_mask, z_y, ignored, invalid, coef, running_max, running_sum):
    """Each token's loss, (max - z_y) + log(sum) times its factor: no rounding of lse at the logits' magnitude."""
    loss = ((running_max - z_y) + tl.log(running_sum)) * coef
    loss = tl.where(ignored, 0.0, loss)
    loss = tl.where(invalid, float("nan"), loss)
    tl.store(loss_ptr + tokens, loss, mask=token_mask)


@triton.jit
def ce_columns_kernel(logits_ptr, stride_v, target_ptr, scale_ptr, scale_stride, loss_ptr, tokens_total, vocab,
                      ignore_index, WRITE_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr,
                      EMULATE_BF16_RTNE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr):
    """The whole step for BLOCK_T tokens over every vocabulary row (one segment)."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < tokens_total
    safe_target, ignored, invalid, coef = _token_terms(target_ptr, scale_ptr, scale_stride, tokens, token_mask,
                                                       vocab, ignore_index)
    running_max, running_sum = _segment_stats(logits_ptr, stride_v, tokens, token_mask, 0, vocab, BLOCK_V, BLOCK_T)
    if WRITE_LOSS:
        z_y = _target_logit(logits_ptr, stride_v, tokens, token_mask, safe_target)
        _store_loss(loss_ptr, tokens, token_mask, z_y, ignored, invalid, coef, running_max, running_sum)
    if WRITE_GRAD:
        # The gradient overwrites the logits, and this program's warps run apart: the target's logit must have
        # been read by every warp before any stores over it (the ``ce_chunk`` kernel's race).
        tl.debug_barrier()
        _segment_gradient(logits_ptr, stride_v, tokens, token_mask, 0, vocab, safe_target, running_max,
                          1.0 / running_sum, coef, ignored, EMULATE_BF16_RTNE, BLOCK_V)


@triton.jit
def ce_columns_stats_kernel(logits_ptr, stride_v, target_ptr, stats_ptr, tokens_total, vocab, segment_rows,
                            BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr):
    """Pass 1 of one vocabulary segment: its (max, sum) per token, into stats (2 SEGMENTS + 1, T) at rows
    segment and SEGMENTS + segment; segment 0's programs also gather each token's target logit into the last row
    (here, before any gradient is written over the logits)."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < tokens_total
    segment = tl.program_id(1)
    segments = tl.num_programs(1)
    if segment == 0:
        target = tl.load(target_ptr + tokens, mask=token_mask, other=0)
        safe_target = tl.where((target < 0) | (target >= vocab), 0, target)
        z_y = _target_logit(logits_ptr, stride_v, tokens, token_mask, safe_target)
        tl.store(stats_ptr + 2 * segments * tokens_total + tokens, z_y, mask=token_mask)
    lo = segment * segment_rows
    hi = tl.minimum(lo + segment_rows, vocab)
    running_max, running_sum = _segment_stats(logits_ptr, stride_v, tokens, token_mask, lo, hi, BLOCK_V, BLOCK_T)
    tl.store(stats_ptr + segment * tokens_total + tokens, running_max, mask=token_mask)
    tl.store(stats_ptr + (segments + segment) * tokens_total + tokens, running_sum, mask=token_mask)


@triton.jit
def ce_columns_gradient_kernel(logits_ptr, stride_v, stats_ptr, target_ptr, scale_ptr, scale_stride, loss_ptr,
                               tokens_total, vocab, segment_rows, ignore_index, WRITE_LOSS: tl.constexpr,
                               WRITE_GRAD: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr, SEGMENTS: tl.constexpr, BLOCK_V: tl.constexpr,
                               BLOCK_T: tl.constexpr):
    """Combines the segments' statistics per token, writes the loss (segment 0's programs) and one segment's
    gradient. Everything it reads besides its own segment's logits comes from the statistics kernel, launched
    before it on the same stream: other programs overwrite their segments' logits meanwhile."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < tokens_total
    segment = tl.program_id(1)
    indices = tl.arange(0, SEGMENTS)
    offsets = indices[:, None] * tokens_total + tokens[None, :]
    maxes = tl.load(stats_ptr + offsets, mask=token_mask[None, :], other=-float("inf"))
    sums = tl.load(stats_ptr + SEGMENTS * tokens_total + offsets, mask=token_mask[None, :], other=0.0)
    running_max = tl.max(maxes, axis=0)
    shift = tl.where(running_max == -float("inf"), 0.0, running_max)
    running_sum = tl.sum(sums * tl.exp(maxes - shift[None, :]), axis=0)
    safe_target, ignored, invalid, coef = _token_terms(target_ptr, scale_ptr, scale_stride, tokens, token_mask,
                                                       vocab, ignore_index)
    if WRITE_LOSS:
        if segment == 0:
            z_y = tl.load(stats_ptr + 2 * SEGMENTS * tokens_total + tokens, mask=token_mask, other=0.0)
            _store_loss(loss_ptr, tokens, token_mask, z_y, ignored, invalid, coef, running_max, running_sum)
    if WRITE_GRAD:
        lo = segment * segment_rows
        hi = tl.minimum(lo + segment_rows, vocab)
        _segment_gradient(logits_ptr, stride_v, tokens, token_mask, lo, hi, safe_target, running_max,
                          1.0 / running_sum, coef, ignored, EMULATE_BF16_RTNE, BLOCK_V)
