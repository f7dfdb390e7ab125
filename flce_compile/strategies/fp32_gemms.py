"""bf16/fp16 GEMMs with an fp32 result on CUDA: cuBLAS sums the products in fp32 and writes them unrounded.

torch exposes them through ``out_dtype`` on ``mm`` and ``addmm`` from 2.8; the package admits older torch, and a
build may refuse an overload, so each overload is tried at its first use and, if refused, never again in the
process (one warning per overload; running out of memory is raised, not taken for a refusal). Callers fall back
on what they did before (upcast operands, a temporary product, a padded weight copy) when these return False;
on the CPU, which has no such GEMM, they always return False.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..log import logger

#: Per overload ("mm", "addmm"): True once it ran, False once it was refused; absent until first tried.
_supported: dict[str, bool] = {}


def available(overload: str) -> bool:
    """Whether ``overload`` may still run here: not yet refused (untried counts as available)."""
    return _supported.get(overload, True)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """``out = a @ b`` with ``out`` fp32 and ``a``, ``b`` bf16/fp16, on CUDA; False where it cannot run
    (``out`` is then left as it was)."""
    return out.device.type == "cuda" and _try("mm", lambda: torch.mm(a, b, out_dtype=out.dtype, out=out))


def addmm_into(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: int = 1) -> bool:
    """``acc = beta * acc + a @ b`` in place with ``acc`` fp32 and ``a``, ``b`` bf16/fp16, on CUDA (``beta`` = 0:
    ``acc`` is only written, so it may be uninitialised); False where it cannot run (``acc`` is then left as
    it was: the caller adds the product its own way)."""
    return acc.device.type == "cuda" and _try(
        "addmm", lambda: torch.addmm(acc, a, b, out_dtype=acc.dtype, beta=beta, out=acc))


def _try(overload: str, gemm: Callable[[], object]) -> bool:
    """Run ``gemm`` unless ``overload`` was refused before; record whether it ran."""
    if not available(overload):
        return False
    try:
        gemm()
    except torch.cuda.OutOfMemoryError:
        raise  # the GEMM exists: running out of memory must not switch it off for the whole process
    except (RuntimeError, TypeError) as exc:  # torch < 2.8, or a build without this overload's fp32 output
        _supported[overload] = False
        logger.warning("fp32-output %s unavailable (%s); bf16/fp16 products summed in fp32 go through upcast "
                       "operands or temporaries instead", overload, exc)
        return False
    _supported[overload] = True
    return True
