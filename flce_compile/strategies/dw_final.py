"""dW finished inside the last chunk's GEMM: ``dw_final_gemm_kernel`` launched where it can run.

With several chunks, dW's fp32 sums are rounded to the weight's dtype once the chunks are done: a copy that reads
V x H fp32 and writes V x H, after the last chunk's cuBLAS GEMM has written those sums. The kernel folds both into
the last chunk's GEMM (see its module). It needs what its TMA descriptors need: a Hopper-or-newer GPU (sm_90+) or
Triton's interpreter, bf16/fp16 operands with unit column stride, 16-byte aligned bases and row strides, and a
Triton with host tensor descriptors (3.4+). ``can_run`` says whether a call qualifies; ``finish`` runs the kernel
where it does, and the chunk loop falls back to cuBLAS and the copy where it returns False.

A Triton or GPU that cannot compile the kernel (a newer architecture, an older Triton) must not break a backward
that cuBLAS can do: its first launch per (GPU architecture, dtype) is tried, and a failure there turns the kernel
off for that pair in this process, with one warning (running out of memory is raised). After a first launch ran,
errors are raised as any kernel's.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton

from ..log import logger

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton before 3.4: no host descriptors, so no kernel (``can_run`` says False)
    TensorDescriptor = None


@dataclass(frozen=True)
class DwGemmTile:
    """The kernel's output tile and its launch: BLOCK_M (dW rows) x BLOCK_N (dW columns), BLOCK_K chunk rows a
    step, GROUP_M row tiles walked together, ``subtiles`` column pieces of the epilogue (1 or 2)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    warp_specialize: bool = False
    subtiles: int = 2

    def label(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k} g{self.group_m} w{self.num_warps} s{self.num_stages}"
                f"{' ws' if self.warp_specialize else ''} sub{self.subtiles}")


#: The tile the chunk loop launches (the benchmark ``benchmarks/dw_final_gemm.py`` compares the others).
DEFAULT_TILE = DwGemmTile()


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _tma_ready(t: torch.Tensor) -> bool:
    """A 2-D tensor a TMA descriptor can take: unit column stride, 16-byte aligned base and row stride."""
    size = t.element_size()
    return t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * size) % 16 == 0


def can_run(grad_t: torch.Tensor, x: torch.Tensor, sums: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``run`` takes these operands (see the module): otherwise the caller rounds the sums itself.
    ``grad_t`` is the chunk's gradient transposed (V' x C, a view of the C x V' rows), ``x`` the chunk's rows (C x H),
    ``sums`` fp32 (at least out's rows) and ``out`` dW (V x H) in the operands' dtype."""
    if TensorDescriptor is None or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if grad_t.dtype != x.dtype or out.dtype != x.dtype or sums.dtype != torch.float32:
        return False
    if x.device.type == "cuda":
        if _capability(_index(x.device)) < (9, 0):  # TMA and wgmma: Hopper or newer
            return False
    elif not _interpreted():
        return False
    rows, columns = out.shape
    if grad_t.shape[1] != x.shape[0] or x.shape[1] != columns or grad_t.shape[0] < rows or sums.shape[0] < rows:
        return False
    if sums.shape[1] != columns or sums.stride(1) != 1 or out.stride(1) != 1 or x.shape[0] == 0:
        return False
    return _tma_ready(grad_t.t()) and _tma_ready(x)


#: Per (compute capability or "cpu", dtype): True once the kernel ran, False once its first launch failed.
_launched: dict[tuple[object, torch.dtype], bool] = {}


def finish(grad_t: torch.Tensor, x: torch.Tensor, sums: torch.Tensor, out: torch.Tensor) -> bool:
    """``run`` where ``can_run`` holds and the kernel has not failed here before (see the module); False, with
    ``out`` not written, where the caller must add the product and round the sums itself."""
    if not can_run(grad_t, x, sums, out):
        return False
    key = (_capability(_index(x.device)) if x.is_cuda else "cpu", x.dtype)
    state = _launched.get(key)
    if state is False:
        return False
    if state is None:
        try:
            run(grad_t, x, sums, out)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:  # whatever the compiler raises: cuBLAS can still do the work
            _launched[key] = False
            logger.warning("dW's last-chunk kernel failed to run on %s for %s (%s: %s); dW is summed by cuBLAS "
                           "and rounded by a copy instead", key[0], x.dtype, type(exc).__name__, exc)
            return False
        _launched[key] = True
        return True
    run(grad_t, x, sums, out)
    return True


def run(grad_t: torch.Tensor, x: torch.Tensor, sums: torch.Tensor, out: torch.Tensor,
        tile: DwGemmTile = DEFAULT_TILE) -> None:
    """out = round(sums[:V] + grad_t[:V] @ x), V = out's rows, in one kernel (``can_run`` must hold)."""
    from ..kernels.dw_final_gemm import dw_final_gemm_kernel

    grad = grad_t.t()  # C x V' rows: the descriptor's view (its last dimension must be the contiguous one)
    chunk, (rows, columns) = x.shape[0], out.shape
    g_desc = TensorDescriptor(grad, [chunk, rows], [grad.stride(0), 1], [tile.block_k, tile.block_m])
    x_desc = TensorDescriptor(x, [chunk, columns], [x.stride(0), 1], [tile.block_k, tile.block_n])
    tiles = triton.cdiv(rows, tile.block_m) * triton.cdiv(columns, tile.block_n)
    programs = min(tiles, _programs(x.device))
    dw_final_gemm_kernel[(programs,)](
        g_desc, x_desc, sums, out, rows, columns, chunk, sums.stride(0), out.stride(0),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        NUM_PROGRAMS=programs, SUBTILES=tile.subtiles, WARP_SPECIALIZE=tile.warp_specialize,
        INTERPRETED=_interpreted(), EMULATE_BF16_RTNE=_interpreted() and out.dtype == torch.bfloat16,
        num_warps=tile.num_warps, num_stages=tile.num_stages)


def _programs(device: torch.device) -> int:
    """One program an SM (the kernel is persistent); a few under the interpreter, which runs them one by one."""
    if device.type != "cuda":
        return 4
    return _sm_count(_index(device))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
