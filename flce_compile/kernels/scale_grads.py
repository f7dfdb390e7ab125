"""Triton kernel: scale a bf16/fp16 tensor in place by an fp32 factor held in a 0-dim tensor.

Backward multiplies the forward-computed dX/dW/db by grad_scale * grad_output. In eager CUDA ``t.mul_(g)``
with a 0-dim fp32 CUDA tensor ``g`` first casts ``g`` to ``t``'s dtype (only CPU scalars keep their
precision in PyTorch's CUDA binary kernels), so a grad_output that is not a power of two (a loss divided by
3 accumulation steps, say) would be rounded twice. Here the factor is read in fp32 and each element is
rounded once; the factor stays on the GPU, so there is no host sync.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .ce_chunk import _round_bf16_rtne


@triton.jit
def scale_kernel(x_ptr, factor_ptr, numel, BLOCK: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    factor = tl.load(factor_ptr).to(tl.float32)
    y = tl.load(x_ptr + offsets, mask=mask).to(tl.float32) * factor
    if EMULATE_BF16_RTNE:
        y = _round_bf16_rtne(y)
    tl.store(x_ptr + offsets, y.to(x_ptr.dtype.element_ty), mask=mask)


_BLOCK = 4096


def scale_in_place(t: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``t *= factor`` with one rounding: ``t`` contiguous bf16/fp16 on a GPU (or on the CPU under
    TRITON_INTERPRET=1), ``factor`` a 0-dim fp32 tensor on the same device."""
    if not t.is_contiguous() or factor.dim() != 0 or factor.dtype != torch.float32:
        raise ValueError("scale_in_place needs a contiguous tensor and a 0-dim fp32 factor")
    if t.numel():
        scale_kernel[(triton.cdiv(t.numel(), _BLOCK),)](
            t, factor, t.numel(), BLOCK=_BLOCK,
            EMULATE_BF16_RTNE=t.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1",
        )
    return t
