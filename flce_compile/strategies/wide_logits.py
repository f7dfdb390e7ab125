"""The logits GEMM with fp32 output (``FLCEConfig.fp32_logits``, what precision="precise" runs).

bf16/fp16 operands, fp32 accumulation and an fp32 result that is never rounded to the compute dtype: on CUDA
one cuBLAS GEMM (``out_dtype``), the same tensor-core work as the usual bf16-output one. The CPU has no
mixed-dtype GEMM (nor has a torch without ``out_dtype``), so there the operands are upcast (exact: every
bf16/fp16 value is an fp32 value) one block of ``UPCAST_VOCAB_BLOCK`` weight rows at a time, which bounds the
upcast copies at (chunk + block) x H fp32 values.
"""

from __future__ import annotations

import torch

from ..plan.layout import UPCAST_VOCAB_BLOCK
from . import fp32_gemms


def fp32_logits_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias32: torch.Tensor | None) -> None:
    """``out = x @ weight.T + bias32`` in fp32 from bf16/fp16 ``x`` (rows, H) and ``weight`` (V, H); ``out``
    (rows, V) fp32 with unit column stride; ``bias32`` (V,) fp32 or None."""
    if not fp32_gemms.mm_into(out, x, weight.t()):
        # Upcast operands: exact products, fp32 sums (a tf32 GEMM keeps them exact too: bf16 and fp16 values
        # have at most tf32's 10 mantissa bits).
        x32 = x.float()
        for v0 in range(0, weight.shape[0], UPCAST_VOCAB_BLOCK):
            v1 = min(v0 + UPCAST_VOCAB_BLOCK, weight.shape[0])
            torch.mm(x32, weight[v0:v1].float().t(), out=out[:, v0:v1])
    if bias32 is not None:
        out.add_(bias32)
