"""The three-GEMM floor with two dX/dW operands, A/B in one process: the logits (bench_flce's floor until
2026-12-06) against the loss's own logit gradient (its floor since), alternating ``--rounds`` times at each shape.

A GPU at its power cap runs a GEMM faster on the gradient's small, sparse values than on N(0, 1) logits, so the
choice moves every ratio to the floor; this measures by how much, on the GPU at hand.

    python benchmarks/floor_operand.py [--shapes 16384x4096x128256 ...] [--rounds 3]

Prints a table (median ms of each operand over the rounds, and gradient / logits) and writes it, markdown and
JSON with the GPU name and versions, under ``--out`` (benchmarks/results/ by default) and $OUT when set.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import make_inputs, parse_turns_args, save_results  # noqa: E402
from benchmarks.bench_flce import FLOOR_OPERANDS, SHAPES, environment, time_floor  # noqa: E402


def time_shape(shape: str, rounds: int) -> dict[str, Any]:
    """One shape's row: each operand's floor ms per round, in turns (logits, then gradient), and their medians."""
    n, h, v = (int(s) for s in shape.split("x"))
    x, w, t = make_inputs(n, h, v)
    times: dict[str, list[float]] = {operand: [] for operand in FLOOR_OPERANDS}
    for _ in range(rounds):
        for operand in ("logits", "gradient"):
            times[operand].append(time_floor(x, w, t, operand=operand))
    del x, w, t
    torch.cuda.empty_cache()
    medians = {operand: statistics.median(ms) for operand, ms in times.items()}
    return {"shape": shape, "rounds_ms": times, "median_ms": medians,
            "gradient_over_logits": medians["gradient"] / medians["logits"]}


def table(env: dict[str, str], rounds: int, rows: list[dict[str, Any]]) -> str:
    """The markdown the run prints and saves: a heading with the GPU and versions, then a row per shape."""
    lines = [f"# floor_operand: {env['gpu']}, torch {env['torch']}, {env['date']}", "",
             f"The three GEMMs at V padded to 128 bytes, bf16, dX and dW on the logits or on the loss's own logit "
             f"gradient; {rounds} rounds, alternating; ms = the median of the rounds' do_bench medians.", "",
             "| BT x H x V | logits operand ms | gradient operand ms | gradient / logits |", "|---|---|---|---|"]
    for row in rows:
        ms = row["median_ms"]
        lines.append(f"| {row['shape']} | {ms['logits']:.2f} | {ms['gradient']:.2f} | "
                     f"{row['gradient_over_logits']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_turns_args(__doc__, SHAPES, "the floor is cuBLAS GEMMs timed with CUDA events")
    env = environment()
    rows = []
    for shape in args.shapes:
        rows.append(time_shape(shape, args.rounds))
        print(rows[-1], flush=True)
    md = table(env, args.rounds, rows)
    print(md)
    stem = f"floor_operand_{env['gpu'].replace(' ', '_')}{args.tag}"
    save_results(args.out, stem, md, {"env": env, "rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()
