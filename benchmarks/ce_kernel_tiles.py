"""The CE step's launch tiles (block_v, num_warps) timed alone, on one chunk of logits, through the op's own path.

The CE kernel is memory-bound: it reads a chunk's logits twice (lse, then the gradient) and writes the gradient
once, in place. Its tiles barely move the whole op's time at the tuner's noise (a few percent of the call is the
CE step), so flce-tune's whole-call trials cannot tell them apart; timed alone they can. Each tile runs
``ce_step_triton`` (what the chunk loop launches: loss + in-place gradient, mean over the rows) on a fresh copy
of the same random bf16 logits, timed by the library's ``flce_compile.tuning.ce_tiles.CEStepTimer`` (the one
``flce-tune --retune-ce-tiles`` uses; rows at the chunk loop's padded stride), and its last run's loss is checked
against ``F.cross_entropy`` in fp32.
A copy of the logits (one read + one write) is timed beside the tiles: three passes at that bandwidth bound the
kernel from below.

    python benchmarks/ce_kernel_tiles.py                      # rows 4096; V 50304, 128256, 151936, 256000
    python benchmarks/ce_kernel_tiles.py --vocabs 128256 --tiles 4096:8 4096:16
    python benchmarks/ce_kernel_tiles.py --lane-pass --tag _lanes   # pass 1 lane-wise (forced: ce_triton.LANE_PASS)

On the CPU (what tests/test_bench_ce_tiles.py runs, Triton's interpreter at tiny shapes):

    TRITON_INTERPRET=1 python benchmarks/ce_kernel_tiles.py --device cpu --rows 4 --vocabs 300 --tiles 128:4 \\
        --reps 2
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import median_ms, save_results, versions  # noqa: E402
from flce_compile.plan import registry  # noqa: E402
from flce_compile.plan.choose import heuristic_config  # noqa: E402
from flce_compile.strategies import ce_triton  # noqa: E402
from flce_compile.tuning.ce_tiles import ce_step_timer  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VOCABS = (50304, 128256, 151936, 256000)
TILES = ("2048:4", "2048:8", "4096:8", "4096:16", "8192:16", "8192:32", "16384:32")


def parse_tile(text: str) -> tuple[int, int]:
    """'block_v:num_warps' -> (block_v, num_warps)."""
    try:
        block_v, num_warps = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"tile {text!r}: expected BLOCK_V:NUM_WARPS, e.g. 4096:8") from None
    return block_v, num_warps


def time_tiles(rows: int, vocab: int, tiles: list[tuple[int, int]], device: str, reps: int) -> dict[str, Any]:
    """One vocabulary size: ms per tile (None where the registry rejects the tile), the copy's ms, the loss
    error of each tile against fp32 torch, and the default tile (heuristic_config's). The tiles are timed by
    the library's own ``CEStepTimer`` (what ``flce-tune --retune-ce-tiles`` times), rows at the chunk loop's
    padded stride, two untimed runs per tile."""
    timer = ce_step_timer(torch.device(device), reps=reps, seed=vocab, warmup=2)
    chunk = timer.chunk(rows, vocab, torch.bfloat16)
    reference = torch.nn.functional.cross_entropy(chunk.source.float(), chunk.args.target, reduction="none")
    base = heuristic_config(rows, vocab, 1, torch.bfloat16, torch.device(device))
    base = dataclasses.replace(base, strategy="triton")
    out: dict[str, Any] = {"vocab": vocab, "rows": rows, "gb": chunk.source.numel() * chunk.source.element_size() / 1e9,
                           "default_tile": f"{base.block_v}:{base.num_warps}", "ms": {}, "loss_err": {}, "lanes": {}}
    scratch = torch.empty_like(chunk.source)
    out["copy_ms"] = median_ms(lambda: scratch.copy_(chunk.source), reps, device)
    for block_v, num_warps in tiles:
        config = dataclasses.replace(base, block_v=block_v, num_warps=num_warps)
        name = f"{block_v}:{num_warps}"
        if registry.get("triton").check(config, vocab) is not None:
            out["ms"][name] = None
            continue
        out["ms"][name] = timer(rows, vocab, torch.bfloat16, (block_v, num_warps, base.num_stages))
        out["lanes"][name] = ce_triton.lanes(block_v, num_warps)  # 0: pass 1 block-wise
        # The last run's loss rows; ce_scale = 1/rows is undone.
        out["loss_err"][name] = float((chunk.args.loss_out * rows - reference).abs().max())
    timed = {k: v for k, v in out["ms"].items() if v is not None}
    out["best_tile"] = min(timed, key=timed.get) if timed else None
    return out


def table(results: list[dict[str, Any]], tiles: list[str]) -> str:
    lines = ["| rows x V | GB | copy ms | 3 x copy / 2 | " + " | ".join(tiles) + " | best | default | default / best | max loss err |",
             "|" + "---|" * (8 + len(tiles))]
    for r in results:
        cells = [("-" if r["ms"].get(t) is None else f"{r['ms'][t]:.3f}") for t in tiles]
        best, default = r["best_tile"], r["default_tile"]
        ratio = (f"{r['ms'][default] / r['ms'][best]:.2f}x"
                 if best and r["ms"].get(default) and r["ms"][best] else "-")
        lines.append(f"| {r['rows']}x{r['vocab']} | {r['gb']:.2f} | {r['copy_ms']:.3f} | {1.5 * r['copy_ms']:.3f} | "
                     + " | ".join(cells) + f" | {best} | {default} | {ratio} | {max(r['loss_err'].values(), default=0.0):.1e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096, help="token rows of the chunk")
    parser.add_argument("--vocabs", type=int, nargs="+", default=list(VOCABS))
    parser.add_argument("--tiles", type=parse_tile, nargs="+", default=[parse_tile(t) for t in TILES],
                        help="BLOCK_V:NUM_WARPS pairs")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=None, help="folder of the .md / .json (default: results/)")
    parser.add_argument("--lane-pass", action="store_true",
                        help="time the CE kernel with its pass 1 lane-wise (ce_triton.LANE_PASS on, restored after)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("ce_kernel_tiles.py: no CUDA GPU (use --device cpu with TRITON_INTERPRET=1)")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("ce_kernel_tiles.py --device cpu runs the kernel in Triton's interpreter: set TRITON_INTERPRET=1")
    if args.rows < 1 or args.reps < 1:
        parser.error("--rows and --reps must be >= 1")
    lane_pass = bool(args.lane_pass)  # forced either way: the timer's configs are block-wise
    with ce_triton.lane_pass(lane_pass):
        results = [time_tiles(args.rows, v, args.tiles, args.device, args.reps) for v in args.vocabs]
    names = [f"{b}:{w}" for b, w in args.tiles]
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    env = {"device": gpu, "date": datetime.date.today().isoformat(), "lane_pass": lane_pass, **versions()}
    md = (f"# ce_kernel_tiles: {gpu}, torch {env['torch']}, triton {env['triton']}, {env['date']}\n\n"
          f"Pass 1 {'lane-wise (forced: ce_triton.LANE_PASS)' if lane_pass else 'block-wise'}. "
          "The CE step alone on one bf16 chunk (loss + in-place gradient; rows at the chunk loop's padded stride), "
          f"ms per tile BLOCK_V:NUM_WARPS (median of {args.reps}, each on freshly refilled logits); '-' = a tile the "
          "registry rejects for that V. copy = one read and one write of the chunk; the kernel's three passes at that "
          "bandwidth take 1.5x it. default = heuristic_config's tile; max loss err: the largest |loss - fp32 torch| "
          "over the tiles.\n\n" + table(results, names) + "\n")
    print(md)
    stem = f"ce_kernel_tiles_{gpu.replace(' ', '_')}{args.tag}"
    save_results(args.out or RESULTS, stem, md, {"env": env, "results": results})
    return results


if __name__ == "__main__":
    main()
