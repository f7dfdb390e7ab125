"""Would the CE step's first pass pay inside the logits GEMM's epilogue? (issue #13's route "the CE step fused into
the logits GEMM's epilogue")

The CE step reads a chunk's logits twice (pass 1: each row's max and sum of exp; pass 2: the gradient, read and
written). If the GEMM that writes the logits also wrote each (row, N tile)'s max and sum of exp, pass 1 would go:
its DRAM read is what fusing saves. That only pays if a GEMM able to carry the epilogue is as fast as cuBLAS's,
and if the epilogue costs less than the pass it saves. Per shape (one chunk, bf16, V padded to 128 bytes):

* cuBLAS: ``torch.mm`` into the padded logits buffer, as the op runs it;
* a Triton GEMM (pointer loads, ``tl.dot``, grouped tile order) per tile config, without and with the epilogue;
* the same persistent, with TMA tensor descriptors and optionally warp specialization (Triton's fastest Hopper
  matmul form), without and with the epilogue; a variant this Triton cannot compile is listed as failed;
* the CE step as shipped (two passes, the shipped tile) and its pass 2 alone (the lse given, as the epilogue's
  statistics would give it): their difference is what the fusion could save.

    python benchmarks/logits_epilogue_gemm.py [--shapes 4096x768x50257 4096x4096x128256]

Writes benchmarks/results/logits_epilogue_gemm_<gpu>.{json,md} (and to $OUT when set). CUDA only.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import median_ms, save_results, shape_table, versions  # noqa: E402
from flce_compile.kernels.tile_order import grouped_tile  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
#: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages): the usual Hopper tiles of Triton's matmul.
CONFIGS = ((128, 256, 64, 8, 8, 3), (128, 256, 64, 8, 8, 4), (128, 128, 64, 8, 4, 4), (128, 128, 64, 8, 8, 4),
           (256, 128, 64, 8, 8, 3), (128, 128, 128, 8, 8, 3), (64, 256, 64, 8, 4, 4))
#: The persistent TMA kernel's (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, warp_specialize): the
#: tile of Triton's persistent Hopper matmul (128x256x64, 8 warps, 3 stages), with 4 stages, and the two fastest of
#: ``CONFIGS`` with the pointer kernel on the H200 (2026-12-05), each without and with warp specialization.
TMA_CONFIGS = tuple((bm, bn, bk, 8, warps, stages, ws) for bm, bn, bk, warps, stages in
                    ((128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4))
                    for ws in (False, True))
#: rows x H x V -> the CE tile the shipped H200 entries carry at that V (block_v, num_warps).
SHAPES = {"4096x768x50257": (4096, 8), "4096x4096x128256": (8192, 8)}


@triton.jit
def _tile_statistics(out, offs_m, offs_n, pid_n, M, V, max_ptr, sum_ptr, n_tiles):
    """Each row's max and sum of exp(z - max) over this tile's columns below V, of the rounded logits (as the CE
    step reads them), at [row, tile] of max_ptr / sum_ptr."""
    z = tl.where(offs_n[None, :] < V, out.to(tl.float32), -float("inf"))
    row_max = tl.max(z, 1)
    row_sum = tl.sum(tl.exp(z - row_max[:, None]), 1)
    tl.store(max_ptr + offs_m * n_tiles + pid_n, row_max, mask=offs_m < M)
    tl.store(sum_ptr + offs_m * n_tiles + pid_n, row_sum, mask=offs_m < M)


@triton.jit
def logits_gemm_kernel(x_ptr, w_ptr, out_ptr, max_ptr, sum_ptr, M, N, K, V, stride_xm, stride_wn, stride_om, n_tiles,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       STATS: tl.constexpr):
    """out = x @ w^T (x: M x K, w: N x K, K a multiple of BLOCK_K), one program a tile, pointer loads; with STATS
    the tile's statistics (``_tile_statistics``)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    safe_m = tl.where(offs_m < M, offs_m, 0)
    safe_n = tl.where(offs_n < N, offs_n, 0)
    x_ptrs = x_ptr + safe_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + safe_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _k in range(0, K, BLOCK_K):
        acc = tl.dot(tl.load(x_ptrs), tl.load(w_ptrs), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = acc.to(out_ptr.dtype.element_ty)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=mask)
    if STATS:
        _tile_statistics(out, offs_m, offs_n, pid_n, M, V, max_ptr, sum_ptr, n_tiles)


@triton.jit
def logits_gemm_tma_kernel(x_ptr, w_ptr, out_ptr, max_ptr, sum_ptr, M, N, K, V, stride_om, n_tiles,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, STATS: tl.constexpr,
                           WARP_SPECIALIZE: tl.constexpr):
    """The same product, persistent (NUM_PROGRAMS programs walk the tiles) with TMA tensor descriptors for the
    loads and the store (x, w contiguous; partial tiles are filled with zeros on load and clipped on store), and
    optionally warp-specialized (producer warps load while consumer warps multiply): the form Triton's own
    Hopper matmul takes to approach cuBLAS."""
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    o_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[stride_om, 1], block_shape=[BLOCK_M, BLOCK_N])
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=True, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(k_tiles):
            a = x_desc.load([pid_m * BLOCK_M, kk * BLOCK_K])
            b = w_desc.load([pid_n * BLOCK_N, kk * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        out = acc.to(out_ptr.dtype.element_ty)
        o_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], out)
        if STATS:
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            _tile_statistics(out, offs_m, offs_n, pid_n, M, V, max_ptr, sum_ptr, n_tiles)


def _statistics_buffers(rows: int, n_tiles: int, out: torch.Tensor, stats: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-(row, N tile) max and sum of exp the epilogue writes; without it, ``out`` twice (never written)."""
    if not stats:
        return out, out
    return torch.empty(rows, n_tiles, device=out.device), torch.empty(rows, n_tiles, device=out.device)


def logits_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, vocab: int, config: tuple[int, ...],
                stats: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Launch ``logits_gemm_kernel`` with ``config``; with ``stats`` return the per-tile (max, sum) it wrote."""
    block_m, block_n, block_k, group_m, warps, stages = config
    m, k = x.shape
    n = w.shape[0]
    if k % block_k:
        raise ValueError(f"H={k} must be a multiple of BLOCK_K={block_k}")
    n_tiles = triton.cdiv(n, block_n)
    tile_max, tile_sum = _statistics_buffers(m, n_tiles, out, stats)
    grid = (triton.cdiv(m, block_m) * n_tiles,)
    logits_gemm_kernel[grid](x, w, out, tile_max, tile_sum, m, n, k, vocab, x.stride(0), w.stride(0), out.stride(0),
                             n_tiles, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
                             STATS=stats, num_warps=warps, num_stages=stages)
    return (tile_max, tile_sum) if stats else None


def logits_gemm_tma(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, vocab: int, config: tuple[int, ...],
                    stats: bool, programs: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Launch ``logits_gemm_tma_kernel`` with ``config`` (a ``TMA_CONFIGS`` tuple) on ``programs`` programs (the
    GPU's SM count by default, at most one a tile); with ``stats`` return the per-tile (max, sum) it wrote."""
    block_m, block_n, block_k, group_m, warps, stages, warp_specialize = config
    m, k = x.shape
    n = w.shape[0]
    if not (x.is_contiguous() and w.is_contiguous() and out.stride(1) == 1):
        raise ValueError("x and w must be contiguous and out's rows contiguous (TMA descriptors)")
    if (out.stride(0) * out.element_size()) % 16 or (k * x.element_size()) % 16:
        raise ValueError(f"out's row stride ({out.stride(0)}) and H={k} must be multiples of 16 bytes (TMA)")
    n_tiles = triton.cdiv(n, block_n)
    tiles = triton.cdiv(m, block_m) * n_tiles
    if programs is None:
        programs = torch.cuda.get_device_properties(x.device).multi_processor_count
    programs = min(programs, tiles)
    if x.is_cuda:  # device-side descriptors take their scratch from this allocator
        triton.set_allocator(lambda size, _align, _stream: torch.empty(size, dtype=torch.int8, device=x.device))
    tile_max, tile_sum = _statistics_buffers(m, n_tiles, out, stats)
    logits_gemm_tma_kernel[(programs,)](
        x, w, out, tile_max, tile_sum, m, n, k, vocab, out.stride(0), n_tiles, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, GROUP_M=group_m, NUM_PROGRAMS=programs, STATS=stats, WARP_SPECIALIZE=warp_specialize,
        num_warps=warps, num_stages=stages)
    return (tile_max, tile_sum) if stats else None


def combined_lse(tile_max: torch.Tensor, tile_sum: torch.Tensor) -> torch.Tensor:
    """Each row's lse from its tiles' (max, sum of exp)."""
    row_max = tile_max.max(1).values
    return row_max + torch.log((tile_sum * torch.exp(tile_max - row_max[:, None])).sum(1))


def _ms(fn: Callable[[], object], before: Callable[[], object] | None = None) -> float:
    """Median ms of 30 runs of ``fn`` after 5 untimed ones (``median_ms``; ``before`` refills, untimed)."""
    median_ms(fn, 5, "cuda", before)  # warm-up: compiles and autotunes outside the timed runs
    return median_ms(fn, 30, "cuda", before)


def run_shape(shape: str, ce_tile: tuple[int, int]) -> tuple[list[str], dict[str, Any]]:
    from flce_compile.params import LossParams
    from flce_compile.plan.config import FLCEConfig
    from flce_compile.plan.layout import padded_row_elements
    from flce_compile.strategies.ce_common import CEStepArgs
    from flce_compile.strategies.ce_triton import ce_step_triton

    rows, hidden, vocab = map(int, shape.split("x"))
    dev = torch.device("cuda")
    width = padded_row_elements(vocab, 2)
    gen = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(rows, hidden, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
    w = torch.zeros(width, hidden, device=dev, dtype=torch.bfloat16)  # pad_vocab's zero rows below V
    w[:vocab] = (torch.randn(vocab, hidden, device=dev, generator=gen) * (3.0 / hidden ** 0.5)).to(torch.bfloat16)
    ref = torch.empty(rows, width, device=dev, dtype=torch.bfloat16)
    cublas = _ms(lambda: torch.mm(x, w.t(), out=ref))
    lse_ref = torch.logsumexp(ref[:, :vocab].float(), 1)
    lines = [f"| {shape} | cuBLAS (torch.mm) | {cublas:.4f} | 1.000 | |"]
    data: dict[str, Any] = {"shape": shape, "cublas_ms": cublas, "triton": []}
    out = torch.empty_like(ref)
    variants = [(f"Triton {bm}x{bn}x{bk} group {gm}, {warps} warps, {stages} stages", logits_gemm, config)
                for config in CONFIGS for bm, bn, bk, gm, warps, stages in [config]]
    variants += [(f"Triton TMA persistent {bm}x{bn}x{bk} group {gm}, {warps} warps, {stages} stages, warp "
                  f"specialization {'on' if ws else 'off'}", logits_gemm_tma, config)
                 for config in TMA_CONFIGS for bm, bn, bk, gm, warps, stages, ws in [config]]
    for label, launch, config in variants:
        for stats in (False, True):
            try:
                ms = _ms(lambda: launch(x, w, out, vocab, config, stats))
            except Exception as err:  # a tile this GPU cannot hold, a form this Triton cannot compile: listed
                lines.append(f"| {shape} | {label}, epilogue {'on' if stats else 'off'} | failed: "
                             f"{type(err).__name__}: {str(err).splitlines()[0][:120]} | | |")
                data["triton"].append({"variant": label, "config": config, "epilogue": stats, "failed": str(err)})
                continue
            tiles = launch(x, w, out, vocab, config, stats)
            note = f"logits diff {(out.float() - ref.float()).abs().max().item():.1e}"
            if tiles is not None:
                note += f", lse diff {(combined_lse(*tiles) - lse_ref).abs().max().item():.1e}"
            lines.append(f"| {shape} | {label}, epilogue {'on' if stats else 'off'} | {ms:.4f} | {ms / cublas:.3f} "
                         f"| {note} |")
            data["triton"].append({"variant": label, "config": config, "epilogue": stats, "ms": ms, "note": note})
    # The CE step on the cuBLAS logits (refilled before each run): as shipped, and pass 2 alone (lse given).
    target = torch.randint(0, vocab, (rows,), device=dev, generator=gen)
    scale = torch.full((), 1.0 / rows, device=dev)
    config = FLCEConfig(strategy="triton", block_v=ce_tile[0], num_warps=ce_tile[1], num_stages=1)

    def ce_ms(lse_in: torch.Tensor | None) -> float:
        args = CEStepArgs(logits=out[:, :vocab], target=target, ce_weight=None,
                          weight_sum=torch.full((), float(vocab), device=dev), ce_scale=scale, z_scale=scale,
                          loss_out=torch.empty(rows, device=dev), lse_out=None, lse_in=lse_in, write_grad=True,
                          padded=True)
        return _ms(lambda: ce_step_triton(args, LossParams(), config), before=lambda: out.copy_(ref))

    full, pass2 = ce_ms(None), ce_ms(lse_ref.double())
    data.update(ce_two_passes_ms=full, ce_pass2_ms=pass2)
    lines += [f"| {shape} | CE step, two passes (tile {ce_tile[0]}:{ce_tile[1]}) | {full:.4f} | | |",
              f"| {shape} | CE step, pass 2 alone (lse given) | {pass2:.4f} | | the fusion could save "
              f"{full - pass2:.4f} ms |"]
    return lines, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="rows x H x V of one chunk")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("logits_epilogue_gemm.py needs a CUDA GPU")
    gpu = torch.cuda.get_device_name()
    env = {"device": gpu, "date": datetime.date.today().isoformat(), **versions()}
    lines = [f"# logits_epilogue_gemm: {gpu}, torch {env['torch']}, triton {env.get('triton')}, {env['date']}", "",
             "One chunk, bf16, V padded to 128 bytes; median ms by CUDA events; x = against cuBLAS.", "",
             "| chunk | variant | ms | x | note |", "|---|---|---|---|---|"]
    md, rows = shape_table(lines, args.shapes, lambda shape: run_shape(shape, SHAPES.get(shape, (4096, 8))))
    save_results(RESULTS, f"logits_epilogue_gemm_{gpu.replace(' ', '_')}", md, {"env": env, "rows": rows})


if __name__ == "__main__":
    main()
