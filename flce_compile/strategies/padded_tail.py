"""An odd vocabulary's logits and dX GEMMs without a padded copy of the weight (one chunk, bf16/fp16, CUDA).

cuBLAS runs a GEMM whose V is not a multiple of 128 bytes of elements several times slower (GPT-2's 50257: the
logits GEMM 6.9x, dX 5.8x on an H200, ``pad_vocab_gemms_NVIDIA_H200.md``), so ``pad_vocab`` runs them over V
rounded up (``plan.layout.padded_row_elements``), which took a zero-padded copy of the whole weight per call
(77 MB at 50257 x 768). Here the weight is split where its rows stop being aligned
(``plan.layout.aligned_head_rows``): the aligned head is used as it is, and only the tail, its last few rows
(17 of GPT-2's), is copied into a small zero-padded block that fills the padded width. Each GEMM then runs as
two aligned ones: the logits into the head's and the tail's columns of the padded logits buffer; dX as the head's
product plus the tail's, summed in fp32 and rounded once (as one GEMM rounds it: two bf16 GEMMs added would round
twice). dW needs no weight (``chunked._DwAccumulator`` splits its GEMM at the same row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..plan.layout import aligned_head_rows
from . import fp32_gemms


@dataclass(frozen=True)
class PaddedTail:
    """``weight`` (V, H) as its aligned head rows [0, head) and ``tail``: rows [head, V) followed by zero rows up
    to the padded width (padded - head rows)."""

    weight: torch.Tensor
    head: int
    tail: torch.Tensor

    def logits_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """``out`` (rows, padded) = x @ [W; 0]^T: the padded columns get the tail's zero rows' 0."""
        torch.mm(x, self.weight[: self.head].t(), out=out[:, : self.head])
        torch.mm(x, self.tail.t(), out=out[:, self.head:])

    def dx_into(self, out: torch.Tensor, grad: torch.Tensor) -> None:
        """``out`` (rows, H) = grad @ [W; 0] over the padded columns of ``grad``, summed in fp32, rounded once."""
        out.copy_(_fp32_sum(grad, self.weight, self.tail, self.head))


def padded_tail(weight: torch.Tensor, padded: int) -> PaddedTail:
    """Split ``weight`` (V, H) for GEMMs over ``padded`` >= V columns: the tail block is the one copy made."""
    head = aligned_head_rows(weight.shape[0], weight.element_size())
    return PaddedTail(weight, head, zero_padded_rows(weight[head:], padded - head))


def zero_padded_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` (V, ...) with zero rows appended up to ``rows``: their logits are 0, and so is their gradient,
    because the CE step writes nothing or 0 past column V. Only the appended rows are zeroed (not a fill of the
    whole block before the copy). (The whole weight's copy where ``splits_padding`` does not apply; the tail's.)"""
    out = t.new_empty((rows, *t.shape[1:]))
    out[: t.shape[0]].copy_(t)
    out[t.shape[0]:].zero_()
    return out


def splits_padding(x: torch.Tensor, bias: torch.Tensor | None, dw_straight: bool, vocab: int, padded: int) -> bool:
    """Whether a call that pads its vocabulary (V = ``vocab`` to ``padded``) does it through ``PaddedTail`` rather
    than a padded weight copy: on a GPU (where a vocabulary is padded by default) whose torch has not refused the
    fp32-output GEMMs (``fp32_gemms``: torch >= 2.8); one chunk whose dW GEMM writes dW straight (``dw_straight``:
    ``chunked._DwAccumulator``'s single chunk, whose GEMM it splits at the same row); no bias; bf16/fp16
    operands; an aligned head at all (a V below 128 bytes of rows is all tail); and dX's fp32 sum (rows x H) no
    larger than the weight copy it replaces (``plan.memory`` bounds the call with that copy)."""
    itemsize = x.element_size()
    return (x.device.type == "cuda" and fp32_gemms.available("mm") and fp32_gemms.available("addmm")
            and dw_straight and bias is None
            and x.dtype in (torch.bfloat16, torch.float16) and aligned_head_rows(vocab, itemsize) > 0
            and 4 * x.shape[0] <= padded * itemsize)


def _fp32_sum(grad: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor, head: int) -> torch.Tensor:
    """grad[:, :head] @ weight[:head] + grad[:, head:] @ tail in fp32, unrounded: cuBLAS's bf16/fp16 -> fp32
    GEMMs on a GPU (torch's ``out_dtype``), the second adding into the first's output. Elsewhere (the CPU tests
    of this path), and where torch refuses them at their first use here (later calls then take the whole-weight
    copy: ``splits_padding``), the operands are upcast, whose products are as exact, at the cost of fp32 copies."""
    summed = torch.empty(grad.shape[0], weight.shape[1], dtype=torch.float32, device=grad.device)
    if fp32_gemms.mm_into(summed, grad[:, :head], weight[:head]) and fp32_gemms.addmm_into(
            summed, grad[:, head:], tail):
        return summed
    torch.mm(grad[:, :head].float(), weight[:head].float(), out=summed)
    return summed.addmm_(grad[:, head:].float(), tail.float())
