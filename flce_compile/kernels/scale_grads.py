"""Triton kernel: scale bf16/fp16 tensors by an fp32 factor held in a 0-dim tensor, in place or into new tensors.

Backward multiplies the forward-computed dX/dW/db by grad_scale * grad_output. In eager CUDA ``t.mul_(g)``
with a 0-dim fp32 CUDA tensor ``g`` first casts ``g`` to ``t``'s dtype (only CPU scalars keep their
precision in PyTorch's CUDA binary kernels), so a grad_output that is not a power of two (a loss divided by
3 accumulation steps, say) would be rounded twice. Here the factor is read in fp32 and each element is
rounded once; the factor stays on the GPU, so there is no host sync. dX, dW and db are scaled in one launch
(``scale_all_in_place``): at small shapes the op is bound by the host, and each launch costs ~20 us of it. A
factor of exactly 1 leaves the tensors untouched without reading them (what ``loss.backward()`` of a bf16/fp32
"mean" or "sum" gives: see ``chunked.keeps_power_of_two_apart``). ``scale_all_into`` writes the products into
new tensors instead (``scaled_gradients``: backward in a graph that CUDA-graph trees replay), and so always runs.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .ce_chunk import _round_bf16_rtne


@triton.jit
def _scale_block(x_ptr, out_ptr, block, numel, factor, BLOCK: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr):
    offsets = tl.cast(block, tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    y = tl.load(x_ptr + offsets, mask=mask).to(tl.float32) * factor
    if EMULATE_BF16_RTNE:
        y = _round_bf16_rtne(y)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_blocks(a_ptr, a_out, a_numel, a_blocks, b_ptr, b_out, b_numel, b_blocks, c_ptr, c_out, c_numel,
                  total_blocks, factor, BLOCK: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr):
    for block in range(tl.program_id(0), total_blocks, tl.num_programs(0)):
        if block < a_blocks:
            _scale_block(a_ptr, a_out, block, a_numel, factor, BLOCK, EMULATE_BF16_RTNE)
        elif block < a_blocks + b_blocks:
            _scale_block(b_ptr, b_out, block - a_blocks, b_numel, factor, BLOCK, EMULATE_BF16_RTNE)
        else:
            _scale_block(c_ptr, c_out, block - a_blocks - b_blocks, c_numel, factor, BLOCK, EMULATE_BF16_RTNE)


@triton.jit
def scale_kernel(a_ptr, a_out, a_numel, a_blocks, b_ptr, b_out, b_numel, b_blocks, c_ptr, c_out, c_numel,
                 total_blocks, factor_ptr, post_ptr, BLOCK: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr,
                 HAS_POST: tl.constexpr, IN_PLACE: tl.constexpr):
    """Blocks [0, a_blocks) scale tensor a into a_out, the next b_blocks tensor b, the rest tensor c; a program
    walks blocks pid, pid + programs, ... With ``HAS_POST`` the factor is factor * post, or 0 where post is 0
    (``chunked.output_factor``: no token counted, and grad_output may be inf). ``IN_PLACE``: each out is its
    tensor."""
    factor = tl.load(factor_ptr).to(tl.float32)
    if HAS_POST:
        post = tl.load(post_ptr).to(tl.float32)
        factor = tl.where(post != 0.0, factor * post, 0.0)
    # In place, a factor of 1 (grad_output 1 and the whole mean in the gradient, the usual loss.backward())
    # changes nothing: each program returns without reading or writing; new tensors are written whatever the
    # factor. The branch is on a device value, so the host neither knows nor waits. The grid is a few programs
    # per SM, not one per block: a program that only returns still costs its launch, and a V x H dW has ~150K
    # blocks (0.6 ms of empty programs on an H200 at 16384 x 4096 x 151936).
    if (factor != 1.0) | (not IN_PLACE):
        _scale_blocks(a_ptr, a_out, a_numel, a_blocks, b_ptr, b_out, b_numel, b_blocks, c_ptr, c_out, c_numel,
                      total_blocks, factor, BLOCK, EMULATE_BF16_RTNE)


_BLOCK = 4096
#: Tensors one launch scales.
MAX_TENSORS = 3
#: Programs per SM: enough resident programs to keep the memory system busy when the factor is not 1.
_PROGRAMS_PER_SM = 8
#: The grid on the CPU (the Triton interpreter runs programs one after another).
_CPU_PROGRAMS = 4


@functools.lru_cache(maxsize=16)
def _programs(device: torch.device) -> int:
    """How many programs a launch on ``device`` runs: a few per SM on a GPU."""
    if device.type != "cuda":
        return _CPU_PROGRAMS
    return _PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def scale_all_in_place(tensors: list[torch.Tensor], factor: torch.Tensor,
                       post: torch.Tensor | None = None) -> list[torch.Tensor]:
    """``t *= factor`` for each of up to three ``tensors`` in one launch, each element rounded once: contiguous
    tensors of one dtype, bf16/fp16, on a GPU (or on the CPU under TRITON_INTERPRET=1); ``factor`` a 0-dim fp32
    tensor on the same device. With ``post`` (the same kind of tensor) the factor is ``chunked.output_factor(
    factor, post)``, formed in the kernel (backward's grad_output and grad_scale: no launches to form it first).
    Returns ``tensors``."""
    _launch(tensors, tensors, factor, post)
    return tensors


def scale_all_into(tensors: list[torch.Tensor], factor: torch.Tensor,
                   post: torch.Tensor | None = None) -> list[torch.Tensor]:
    """``scale_all_in_place``'s products written into new tensors (``tensors`` are only read): one launch,
    which runs whatever the factor."""
    outs = [torch.empty_like(t) for t in tensors]
    _launch(tensors, outs, factor, post)
    return outs


def _launch(tensors: list[torch.Tensor], outs: list[torch.Tensor], factor: torch.Tensor,
            post: torch.Tensor | None) -> None:
    """One launch of ``scale_kernel``: ``out = t * factor(, post)`` for each pair; in place where outs is
    tensors."""
    if not 0 < len(tensors) <= MAX_TENSORS:
        raise ValueError(f"the gradient scale takes 1 to {MAX_TENSORS} tensors, got {len(tensors)}")
    if any(f.dim() != 0 or f.dtype != torch.float32 for f in (factor, post) if f is not None):
        raise ValueError("the gradient scale needs a 0-dim fp32 factor (and post)")
    dtype = tensors[0].dtype
    if any(not t.is_contiguous() or t.dtype != dtype for t in tensors):
        raise ValueError("the gradient scale needs contiguous tensors of one dtype")
    # Absent tensors are the first one with 0 elements and 0 blocks: no placeholder allocation on this hot path.
    a, b, c = (tensors + [tensors[0]] * MAX_TENSORS)[:MAX_TENSORS]
    a_out, b_out, c_out = (outs + [outs[0]] * MAX_TENSORS)[:MAX_TENSORS]
    a_numel, b_numel, c_numel = ([t.numel() for t in tensors] + [0] * MAX_TENSORS)[:MAX_TENSORS]
    a_blocks, b_blocks, c_blocks = (triton.cdiv(numel, _BLOCK) for numel in (a_numel, b_numel, c_numel))
    total = a_blocks + b_blocks + c_blocks
    if total:
        scale_kernel[(min(total, _programs(a.device)),)](
            a, a_out, a_numel, a_blocks, b, b_out, b_numel, b_blocks, c, c_out, c_numel, total, factor,
            post if post is not None else factor, BLOCK=_BLOCK,
            EMULATE_BF16_RTNE=dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1",
            HAS_POST=post is not None, IN_PLACE=outs is tensors,
        )


def scale_in_place(t: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``t *= factor`` with one rounding (``scale_all_in_place`` for one tensor)."""
    return scale_all_in_place([t], factor)[0]
