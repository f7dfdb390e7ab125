"""Does dW's rounding pay inside the last chunk's GEMM? (issue #13: the op's time above the floor)

Over several chunks the op sums dW in fp32: the last chunk's cuBLAS GEMM adds its product to the sums (addmm),
and a copy then rounds them to bf16. ``strategies.dw_final`` does both in one Triton GEMM (persistent, TMA) whose
epilogue reads the sums and stores dW rounded. Per shape (the last chunk of a shipped H200 entry: its rows x H x V,
V padded to 128 bytes as the chunk loop's buffers are):

* cuBLAS: ``chunked.add_product`` (the op's addmm into the fp32 sums) and the copy to bf16, together and apart;
* the Triton kernel at each tile of ``TILES`` (a tile this GPU or Triton cannot run is listed as failed);
* each path's largest error against an fp64 sum, relative to the largest |dW|, and how many of dW's entries the
  two paths round differently.

    python benchmarks/dw_final_gemm.py [--shapes 8192x4096x151936 ...] [--reps 30]

Writes benchmarks/results/dw_final_gemm_<gpu><tag>.{json,md} (and to $OUT when set). CUDA (sm_90+) only.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import median_ms, save_results, shape_table, versions  # noqa: E402
from flce_compile.plan.layout import padded_row_elements  # noqa: E402
from flce_compile.strategies import dw_final  # noqa: E402
from flce_compile.strategies.chunked import add_product  # noqa: E402
from flce_compile.strategies.dw_final import DwGemmTile  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
#: The last chunk of the H200 entries at H = 4096 (16384 x 128256 in chunks of 6144; 16384 x 151936 and
#: 65536 x 128256 in chunks of 8192).
SHAPES = ("4096x4096x128256", "8192x4096x151936", "8192x4096x128256")
TILES = (
    DwGemmTile(),
    DwGemmTile(warp_specialize=True),
    DwGemmTile(subtiles=1),
    DwGemmTile(group_m=16),
    DwGemmTile(block_n=128, num_stages=4, subtiles=1),
    DwGemmTile(block_n=128, num_stages=4, subtiles=1, warp_specialize=True),
    DwGemmTile(block_n=128, num_warps=4, num_stages=4, subtiles=1),
    DwGemmTile(block_m=256, block_n=128),
    DwGemmTile(group_m=4),
    DwGemmTile(group_m=32),
    DwGemmTile(block_k=128, num_stages=2),
    DwGemmTile(num_stages=4),
)


def make_operands(chunk: int, hidden: int, vocab: int, seed: int = 0, device: str = "cuda") -> dict[str, torch.Tensor]:
    """A gradient chunk (chunk x V padded, softmax-gradient sized values, zero padding), the chunk's rows and
    fp32 sums as earlier chunks would leave them."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    width = padded_row_elements(vocab, 2)
    grad = torch.zeros(chunk, width, device=dev, dtype=torch.bfloat16)
    grad[:, :vocab] = (torch.randn(chunk, vocab, device=dev, generator=gen) * 1e-5).to(torch.bfloat16)
    x = torch.randn(chunk, hidden, device=dev, generator=gen).to(torch.bfloat16)
    sums = torch.randn(width, hidden, device=dev, generator=gen) * 1e-3
    return {"grad": grad, "x": x, "sums": sums}


def _ms(fn: Callable[[], object], reps: int, device: str) -> float:
    median_ms(fn, 3, device)  # warm-up: compiles outside the timed runs
    return median_ms(fn, reps, device)


def run_shape(shape: str, reps: int, tiles: tuple[DwGemmTile, ...] = TILES,
              device: str = "cuda") -> tuple[list[str], dict[str, Any]]:
    """The table's rows for one last chunk (``shape``: its rows x H x V) and their data. (The CPU runs it only in
    Triton's interpreter: the tests.)"""
    chunk, hidden, vocab = map(int, shape.split("x"))
    ops = make_operands(chunk, hidden, vocab, device=device)
    grad, x, sums = ops["grad"], ops["x"], ops["sums"]
    exact = sums[:vocab].double() + grad[:, :vocab].double().t() @ x.double()
    scale = exact.abs().max().item()

    def cublas(acc: torch.Tensor) -> torch.Tensor:
        add_product(acc, grad.t(), x)
        return acc[:vocab].to(torch.bfloat16)

    acc = sums.clone()
    reference = cublas(acc)
    data: dict[str, Any] = {"shape": shape, "cublas_error": (reference.double() - exact).abs().max().item() / scale}
    work = sums.clone()
    data["cublas_addmm_round_ms"] = _ms(lambda: cublas(work), reps, device)
    data["cublas_addmm_ms"] = _ms(lambda: add_product(work, grad.t(), x), reps, device)
    data["round_ms"] = _ms(lambda: work[:vocab].to(torch.bfloat16), reps, device)
    base = data["cublas_addmm_round_ms"]
    lines = [f"| {shape} | cuBLAS addmm + round | {base:.3f} | 1.000 | {data['cublas_error']:.2e} | |",
             f"| {shape} | cuBLAS addmm alone | {data['cublas_addmm_ms']:.3f} | {data['cublas_addmm_ms'] / base:.3f} "
             "| | |",
             f"| {shape} | round alone | {data['round_ms']:.3f} | {data['round_ms'] / base:.3f} | | |"]
    out = torch.empty(vocab, hidden, device=x.device, dtype=torch.bfloat16)
    if not dw_final.can_run(grad.t(), x, sums, out):
        raise SystemExit(f"dw_final.can_run refused {shape} on {device} (the kernel needs sm_90+)")
    data["triton"] = []
    for tile in tiles:
        try:
            ms = _ms(lambda: dw_final.run(grad.t(), x, sums, out, tile), reps, device)
        except Exception as err:  # a tile this GPU cannot hold, a form this Triton cannot compile: listed
            first = str(err).splitlines()[0][:120] if str(err) else ""
            lines.append(f"| {shape} | Triton {tile.label()} | failed: {type(err).__name__}: {first} | | | |")
            data["triton"].append({"tile": tile.label(), "failed": str(err)})
            continue
        dw_final.run(grad.t(), x, sums, out, tile)
        error = (out.double() - exact).abs().max().item() / scale
        differ = int((out != reference).sum().item())
        lines.append(f"| {shape} | Triton {tile.label()} | {ms:.3f} | {ms / base:.3f} | {error:.2e} | {differ} |")
        data["triton"].append({"tile": tile.label(), "ms": ms, "error": error, "differ_from_cublas": differ})
    return lines, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="last chunk's rows x H x V")
    parser.add_argument("--reps", type=int, default=30, help="timed runs of each variant (median)")
    parser.add_argument("--tag", default="", help="suffix of the results' file names")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("dw_final_gemm.py needs a CUDA GPU")
    gpu = torch.cuda.get_device_name()
    env = {"device": gpu, "date": datetime.date.today().isoformat(), **versions()}
    lines = [f"# dw_final_gemm: {gpu}, torch {env['torch']}, triton {env.get('triton')}, {env['date']}", "",
             "The last chunk's dW: its product added to fp32 sums and rounded to bf16; median ms by CUDA events; "
             "x = against cuBLAS addmm + round; error = largest |dW - fp64| / largest |dW|; differ = entries "
             "rounded unlike cuBLAS's path.", "",
             "| last chunk (rows x H x V) | variant | ms | x | error | differ |", "|---|---|---|---|---|---|"]
    md, rows = shape_table(lines, args.shapes, lambda shape: run_shape(shape, args.reps))
    save_results(RESULTS, f"dw_final_gemm_{gpu.replace(' ', '_')}{args.tag}", md, {"env": env, "rows": rows})


if __name__ == "__main__":
    main()
