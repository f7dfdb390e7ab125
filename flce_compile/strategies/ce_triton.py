"""The cross-entropy step of one chunk through the Triton kernel (GPU, or CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
import triton

from ..kernels import LANE_WIDTH
from ..params import LossParams
from ..plan.config import FLCEConfig
from .ce_common import CEStepArgs


#: A masked loop vectorizes its loads and stores when its bound is a multiple of this (elements).
_VECTOR = 16
#: Forces pass 1 lane-wise (True) or block-wise (False) at every launch; None (the default): each launch as its
#: config's ``lane_pass`` says, which ``flce-tune --retune-ce-tiles`` picks per tuning entry with the rest of the CE
#: tile. Forcing it is for the A/B benchmarks (``benchmarks/ce_lane_pass.py``, ``ce_kernel_tiles.py --lane-pass``)
#: and the interpreter tests, which hold the two passes to the same numbers. Not an option: set the config's field.
LANE_PASS: bool | None = None


@contextlib.contextmanager
def lane_pass(on: bool | None) -> Iterator[None]:
    """``LANE_PASS`` set to ``on`` inside the block and restored after (the A/B benchmarks and tests switch it)."""
    global LANE_PASS
    saved, LANE_PASS = LANE_PASS, on
    try:
        yield
    finally:
        LANE_PASS = saved


def lanes(block_v: int, num_warps: int, lane_wise: bool = False) -> int:
    """The kernel's LANES for a launch whose config says ``lane_wise`` (``LANE_PASS`` overrides it when set): one
    a thread, each ``kernels.LANE_WIDTH`` contiguous elements wide, as many as a block holds (0: the block-wise
    pass 1)."""
    on = lane_wise if LANE_PASS is None else LANE_PASS
    return min(32 * num_warps, block_v // LANE_WIDTH) if on else 0


def ce_step_triton(args: CEStepArgs, p: LossParams, config: FLCEConfig) -> None:
    """Launch ``ce_chunk_kernel`` over the chunk's rows (see ``CEStepArgs`` for the contract)."""
    from ..kernels.ce_chunk import ce_chunk_kernel

    logits = args.logits
    rows, vocab = logits.shape
    if rows == 0:
        return
    block_v = min(config.block_v, triton.next_power_of_2(vocab))
    per_row = args.ce_scale.dim() == 1
    dummy = args.weight_sum  # any fp32 tensor stands in for pointers a constexpr flag disables
    grad = args.grad_out if args.grad_out is not None else logits
    # The padded loop (see the kernel) needs rows that really are that wide.
    width = -(-vocab // _VECTOR) * _VECTOR if args.padded else vocab
    padded = width > vocab and logits.stride(0) >= width and grad.stride(0) >= width
    width = width if padded else vocab
    # (never both: top_out finds the lse, top_in takes a kept one; ``CEStepArgs.check_slice``)
    top = args.top_out
    top_in = args.top_in if args.lse_in is not None and args.write_grad else None
    ce_chunk_kernel[(rows,)](
        logits,
        logits.stride(0),
        grad,
        grad.stride(0),
        args.target,
        args.ce_weight if args.ce_weight is not None else dummy,
        args.weight_sum,
        args.ce_scale,
        args.z_scale,
        1 if per_row else 0,
        args.loss_out if args.loss_out is not None else dummy,
        args.lse_out if args.lse_out is not None else dummy,
        args.lse_in if args.lse_in is not None else dummy,
        args.target_z_out if args.target_z_out is not None else dummy,
        args.target_z_in if args.target_z_in is not None else dummy,
        top if top is not None else dummy,
        top_in if top_in is not None else dummy,
        (top if top is not None else top_in).stride(0) if top is not None or top_in is not None else 0,
        args.stats_out if args.stats_out is not None else dummy,
        args.stats_out.stride(0) if args.stats_out is not None else 0,
        args.residual_out if args.residual_out is not None else dummy,
        vocab,
        vocab - vocab % block_v,  # the whole blocks: without a mask when UNMASKED_BLOCKS (the kernel says why)
        width,
        args.class_offset,
        args.classes(),
        p.ignore_index,
        float(p.label_smoothing),
        float(p.softcap or 1.0),
        float(p.logit_scale),
        float(p.z_loss),
        HAS_CE_WEIGHT=args.ce_weight is not None,
        HAS_SOFTCAP=bool(p.softcap),
        HAS_SMOOTHING=p.label_smoothing > 0,
        HAS_Z_LOSS=p.z_loss != 0,
        HAS_LSE_IN=args.lse_in is not None,
        HAS_TARGET_Z_IN=args.lse_in is not None and args.target_z_in is not None and args.write_grad,
        HAS_TOP_IN=top_in is not None,
        WRITE_LOSS=args.loss_out is not None,
        WRITE_LSE=args.lse_out is not None,
        WRITE_TARGET_Z=args.target_z_out is not None,
        WRITE_TOP=top is not None,
        WRITE_GRAD=args.write_grad,
        WRITE_STATS=args.stats_out is not None,
        WRITE_RESIDUAL=args.write_grad and args.residual_out is not None,
        # The rounding that matters is the gradient's (the logits may be fp32: FLCEConfig.fp32_logits).
        EMULATE_BF16_RTNE=grad.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1",
        UNMASKED_BLOCKS=vocab % _VECTOR != 0 and not padded,
        PADDED=padded,
        SCALED=p.logit_scale != 1.0,
        BLOCK_V=block_v,
        LANES=lanes(block_v, config.num_warps, config.lane_pass),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
