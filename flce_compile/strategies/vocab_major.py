"""The one-chunk loop over vocabulary-major logits, (V, T): an odd V's GEMMs aligned without a padded weight.

The token-major loop (``chunked._run_chunks``) gives an odd V (GPT-2's 50257, whose bf16 rows are not a multiple
of 16 bytes) GEMMs over V padded to 128-byte rows, since unaligned ones run 3-7x slower on cuBLAS
(``pad_vocab_gemms_NVIDIA_H200.md``); that costs a zero-padded copy of the weight on every call and a dW split
into an aligned head and an odd tail. With the logits stored (V, T) instead, every operand's contiguous extent is
the tokens' T or the hidden H: logits^T = W X^T, dX = (G^T)^T W and dW = G^T X run on the weight as it is, in one
GEMM each, the shapes eager's GEMMs have (transposed), so the user's cuBLAS reduction flags are kept as in the
one-chunk token-major call. The CE step is ``kernels.ce_columns``.

Taken only where it is measured to pay and the kernel covers the options (``applies``); everything else runs the
token-major loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from ..params import LossParams
from ..plan.config import FLCEConfig
from ..plan.layout import vocab_needs_padding

Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


@dataclass(frozen=True)
class ColumnTiles:
    """Launch parameters of the ``ce_columns`` kernels: tokens per program, vocabulary rows per block, warps,
    pipeline stages, and the fewest programs per SM before the vocabulary is split into segments."""

    block_t: int = 32
    block_v: int = 64
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 1


#: The tiles the loop launches with (measured: see docs/op.md, "Odd vocabularies").
TILES = ColumnTiles()
#: Devices the loop runs on: where the token-major loop pads (the CPU's rows are never padded: ``chunked``).
DEVICES = ("cuda",)


def applies(x: torch.Tensor, weight: torch.Tensor, p: LossParams, config: FLCEConfig, *, single_chunk: bool,
            plain_outputs: bool, has_bias: bool, has_class_weights: bool, wide: bool) -> bool:
    """Whether a call runs this loop: one chunk on CUDA with the Triton strategy, a V that ``pad_vocab`` would pad,
    a token count whose rows of logits^T are 16-byte aligned, and what ``kernels.ce_columns`` covers (no bias,
    class weights, label smoothing, softcap, logit scale or z-loss; no kept logits, lse or fp32 logits;
    ``plain_outputs``: the caller asks only the loss and the gradients)."""
    itemsize = x.element_size()
    return (x.device.type in DEVICES and single_chunk and plain_outputs and not wide and config.strategy == "triton"
            and config.pad_vocab and vocab_needs_padding(weight.shape[0], itemsize)
            and (x.shape[0] * itemsize) % 16 == 0 and not has_bias and not has_class_weights
            and p.label_smoothing == 0 and not p.softcap and p.logit_scale == 1.0 and p.z_loss == 0)


def run_vocab_major(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, p: LossParams, *,
                    ce_scale: torch.Tensor, loss_rows: torch.Tensor | None, want_dx: bool, want_dw: bool,
                    dw_from: int = 0, tiles: ColumnTiles | None = None) -> Grads:
    """Loss rows (into ``loss_rows``, each times its ``ce_scale``) and dX, dW of one chunk holding every token;
    db is None (no bias here). ``ce_scale`` is 0-dim or (T,); dW covers the weight's columns from ``dw_from``."""
    n = x.shape[0]
    logits_t = torch.empty(weight.shape[0], n, dtype=x.dtype, device=x.device)
    torch.mm(weight, x.t(), out=logits_t)
    write_grad = want_dx or want_dw
    ce_columns_step(logits_t, target, ce_scale, loss_rows, p.ignore_index, write_grad=write_grad, tiles=tiles)
    dx = torch.mm(logits_t.t(), weight) if want_dx else None
    dw = torch.mm(logits_t, x[:, dw_from:] if dw_from else x) if want_dw else None
    return dx, dw, None


def _segments(token_blocks: int, device: torch.device, tiles: ColumnTiles) -> int:
    """How many vocabulary segments the step splits into: 1 when the token blocks alone give every SM
    ``programs_per_sm`` programs, else the power of two that does (at most 64)."""
    if device.type != "cuda":
        return 1
    wanted = tiles.programs_per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    segments = 1
    while token_blocks * segments < wanted and segments < 64:
        segments *= 2
    return segments


def ce_columns_step(logits_t: torch.Tensor, target: torch.Tensor, ce_scale: torch.Tensor,
                    loss_rows: torch.Tensor | None, ignore_index: int, *, write_grad: bool,
                    tiles: ColumnTiles | None = None, segments: int | None = None) -> None:
    """The CE step over ``logits_t`` (V, T), unit column stride: each token's loss times its ``ce_scale`` (0-dim
    or (T,)) into ``loss_rows`` (T,) fp32 when given, and with ``write_grad`` the gradient over the logits in
    place. ``tiles``: default ``TILES``; ``segments``: the vocabulary split (a power of two; default
    ``_segments``)."""
    from ..kernels.ce_columns import ce_columns_gradient_kernel, ce_columns_kernel, ce_columns_stats_kernel

    tiles = tiles if tiles is not None else TILES
    vocab, tokens = logits_t.shape
    if tokens == 0 or (loss_rows is None and not write_grad):
        return
    scale_stride = 1 if ce_scale.dim() == 1 else 0
    emulate = logits_t.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    loss_out = loss_rows if loss_rows is not None else ce_scale  # any fp32 tensor where WRITE_LOSS is off
    token_blocks = triton.cdiv(tokens, tiles.block_t)
    if segments is None:
        segments = _segments(token_blocks, logits_t.device, tiles)
    launch = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    if segments == 1:
        ce_columns_kernel[(token_blocks,)](
            logits_t, logits_t.stride(0), target, ce_scale, scale_stride, loss_out, tokens, vocab, ignore_index,
            WRITE_LOSS=loss_rows is not None, WRITE_GRAD=write_grad, EMULATE_BF16_RTNE=emulate,
            BLOCK_V=tiles.block_v, BLOCK_T=tiles.block_t, **launch)
        return
    if segments & (segments - 1):
        raise ValueError(f"segments={segments} must be a power of two")
    segment_rows = triton.cdiv(triton.cdiv(vocab, segments), tiles.block_v) * tiles.block_v
    stats = torch.empty(2 * segments + 1, tokens, dtype=torch.float32, device=logits_t.device)
    ce_columns_stats_kernel[(token_blocks, segments)](
        logits_t, logits_t.stride(0), target, stats, tokens, vocab, segment_rows,
        BLOCK_V=tiles.block_v, BLOCK_T=tiles.block_t, **launch)
    ce_columns_gradient_kernel[(token_blocks, segments)](
        logits_t, logits_t.stride(0), stats, target, ce_scale, scale_stride, loss_out, tokens, vocab, segment_rows,
        ignore_index, WRITE_LOSS=loss_rows is not None, WRITE_GRAD=write_grad, EMULATE_BF16_RTNE=emulate,
        SEGMENTS=segments,
        BLOCK_V=tiles.block_v, BLOCK_T=tiles.block_t, **launch)
