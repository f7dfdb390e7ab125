"""Triton kernel: the factors of a "mean" (or "sum") loss without class weights in one launch (the GPU path).

``chunked._reduction_scales`` + ``_gradient_scales`` compute them with 9 small torch ops (count, reciprocal,
frexp, ...) and the CE step's ``weight_sum`` with a 10th; at small shapes the op is bound by launches, so this
kernel does it all in one program and writes exactly the same values:

* split (fp16 inputs): z = 2m and post = 2^(e-1), where 1/count = m * 2^e with m in [0.5, 1): post is 1/count
  with its mantissa bits cleared (1/count is a normal float), z = (1/count) / post exactly, and 1/count is the
  IEEE division (div_rn, not Triton's default approximate division). With no valid token both are 0 (the
  gradients are exactly 0).
* not split (bf16/fp32): z = 1/count and post = 1 (both 0 with no valid token).
* loss_factor: post, or nan with no valid token (the loss is then nan, as torch's mean; see ``_reduced_loss``).
* weight_sum: V as a float (the class weights' sum without class weights).

The count is exact up to 2^24 valid tokens, as torch's fp32 sum of the mask is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Targets read per step of the single program's loop.
BLOCK = 1024


@triton.jit
def loss_scales_kernel(target_ptr, n, ignore_index, out_ptr, post_ptr, vocab_f, BLOCK: tl.constexpr,
                       SPLIT: tl.constexpr, SUM: tl.constexpr):
    count = tl.zeros((), dtype=tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        target = tl.load(target_ptr + offs, mask=offs < n, other=ignore_index)
        count += tl.sum((target != ignore_index).to(tl.int32), axis=0)
    valid = count > 0
    # 1 / max(count, 1): with no valid token every factor is replaced below (and nothing divides by zero).
    z_scale = tl.math.div_rn(tl.full((), 1.0, tl.float32), tl.maximum(count, 1).to(tl.float32))
    if SUM:  # every factor 1 (0 without a valid token), the loss too: a sum over nothing is 0
        post = tl.full((), 1.0, tl.float32)
        z = post
    elif SPLIT:
        post = (z_scale.to(tl.uint32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        z = tl.math.div_rn(z_scale, post)  # exact: a division by a power of two
    else:
        post = tl.full((), 1.0, tl.float32)
        z = z_scale
    tl.store(out_ptr, tl.where(valid, z, 0.0))
    tl.store(out_ptr + 1, vocab_f)
    tl.store(out_ptr + 2, tl.where(valid, post, 0.0 if SUM else float("nan")))
    tl.store(post_ptr, tl.where(valid, post, 0.0))  # 0 without a valid token: see chunked.output_factor


def loss_scales(target: torch.Tensor, ignore_index: int, vocab: int, split: bool = True,
                reduction: str = "mean") -> tuple[torch.Tensor, ...]:
    """(z, post, loss_factor, weight_sum), each 0-dim fp32 on target's device, for a "mean" (or, with
    ``reduction="sum"``, a "sum": every factor 1, or 0 without a valid token, ``chunked._reduction_scales``) over
    ``target`` (N,) int64 without class weights; z is also the CE factor; ``split`` as in
    ``chunked._gradient_scales`` (a "mean" only). ``post`` has storage of its own: it is returned from the op as
    ``grad_scale``, which must not share memory with anything else."""
    out = torch.empty(3, dtype=torch.float32, device=target.device)
    post = torch.empty((), dtype=torch.float32, device=target.device)
    loss_scales_kernel[(1,)](target, target.shape[0], ignore_index, out, post, float(vocab), BLOCK=BLOCK,
                             SPLIT=split and reduction == "mean", SUM=reduction == "sum")
    z, weight_sum, loss_factor = out.unbind()
    return z, post, loss_factor, weight_sum
