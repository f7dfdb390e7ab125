"""Triton kernel: the last chunk's dW GEMM, finishing dW in its epilogue.

Over several chunks dW is summed in fp32 (``chunked._DwAccumulator``): each chunk's cuBLAS GEMM adds G_c^T X_c to
the sums, and a copy then rounds them to the weight's dtype. That copy reads the V x H fp32 sums and writes dW
(3.2 GB at V = 128256, H = 4096: 1.0 ms on an H100, 1.4% of the floor at 16384 tokens). Here the last chunk's GEMM
reads the sums in its epilogue instead, adds its own product in fp32 and stores dW rounded once: the same sum and
the same single rounding, without the sums' last write and read back.

The GEMM is persistent (one program an SM walks the output tiles) with TMA tensor descriptors, Triton's fastest
form on Hopper. The gradient chunk G (C x V, row-major) is the product's left operand transposed: its tiles load
as [BLOCK_K, BLOCK_M] and enter the dot transposed, which wgmma reads straight from shared memory. Tiles past
the chunk's rows load as zeros (TMA's padding), so any C works; rows past V and columns past H are masked on store.
The epilogue works on column halves of the tile (``SUBTILES``), so the sums' registers do not double the tile's.

``INTERPRETED``: for the Triton interpreter (the CPU tests), whose bf16 dot returns garbage (Triton 3.9): the
operands go to the dot in fp32 (their products are exact there too). ``EMULATE_BF16_RTNE``: its bf16 cast
truncates, so a bf16 dW is pre-rounded to nearest even (``ce_chunk._round_bf16_rtne``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flce_compile.kernels.ce_chunk import _round_bf16_rtne
from flce_compile.kernels.tile_order import grouped_tile


@triton.jit
def _finish(part, sums_ptr, out_ptr, offs_m, offs_n, M, N, stride_sums, stride_out,
            EMULATE_BF16_RTNE: tl.constexpr):
    """out = round(sums + part) over one (sub)tile, masked to M x N."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    total = tl.load(sums_ptr + offs_m[:, None] * stride_sums + offs_n[None, :], mask=mask, other=0.0) + part
    if EMULATE_BF16_RTNE:
        total = _round_bf16_rtne(total)
    tl.store(out_ptr + offs_m[:, None] * stride_out + offs_n[None, :], total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dw_final_gemm_kernel(g_desc, x_desc, sums_ptr, out_ptr, M, N, K, stride_sums, stride_out,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                         NUM_PROGRAMS: tl.constexpr, SUBTILES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                         INTERPRETED: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr):
    """out[:M, :N] = round(sums + G^T X): G is K x M (``g_desc``, tiles [BLOCK_K, BLOCK_M]), X is K x N
    (``x_desc``, tiles [BLOCK_K, BLOCK_N]), sums fp32 M x N."""
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=True, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(k_tiles):
            g = g_desc.load([kk * BLOCK_K, pid_m * BLOCK_M])
            x = x_desc.load([kk * BLOCK_K, pid_n * BLOCK_N])
            if INTERPRETED:
                acc = tl.dot(g.T.to(tl.float32), x.to(tl.float32), acc)
            else:
                acc = tl.dot(g.T, x, acc)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        if SUBTILES == 2:
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
            _finish(left, sums_ptr, out_ptr, offs_m, offs_n, M, N, stride_sums, stride_out, EMULATE_BF16_RTNE)
            _finish(right, sums_ptr, out_ptr, offs_m, offs_n + BLOCK_N // 2, M, N, stride_sums, stride_out,
                    EMULATE_BF16_RTNE)
        else:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            _finish(acc, sums_ptr, out_ptr, offs_m, offs_n, M, N, stride_sums, stride_out, EMULATE_BF16_RTNE)
