"""Our op against Liger's FLCE at shapes where the two are level, timed in turns (issue #13: "never slower than
Liger at any shipped shape").

bench_tuning.py times each variant once, one after the other; at 400-550 ms a call the GPU's clocks and power
drift by about as much as the difference being judged. Here every variant runs ``--calls`` calls in each of
``--rounds`` rounds, in turn, and the median of all its calls counts. Variants: our op with the tuning DB's
config ("db"), with ``chunk_tokens`` forced to each ``--chunks`` value ("cN"), and Liger.

    python benchmarks/liger_turns.py                                   # the two level shipped shapes
    python benchmarks/liger_turns.py --shapes 131072x5120x65536 --chunks 16384 32768

bf16, forward + backward, mean, ~6% ignored (``make_inputs``). Writes ``liger_turns_<gpu>.{md,json}`` under
``benchmarks/results`` (and $OUT when set). CUDA only.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import liger_loss, make_inputs, save_results, versions  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
#: (V, H, tokens): the shipped entries bench_tuning found level with Liger on 2026-12-01.
SHAPES = ("131072x5120x65536", "129280x7168x65536")


def _variants(chunks: list[int]) -> dict[str, Callable]:
    from flce_compile import fused_linear_cross_entropy

    def ours(config: dict | None) -> Callable:
        return lambda x, w, t: fused_linear_cross_entropy(x, w, t, config=config)

    table = {"db": ours(None)}
    table.update({f"c{c}": ours({"chunk_tokens": c}) for c in chunks})
    table["liger"] = liger_loss()
    return table


def time_in_turns(shape: str, variants: dict[str, Callable], rounds: int, calls: int) -> dict[str, dict]:
    """Per variant: median and least ms of its ``rounds * calls`` fwd+bwd calls (CUDA events), and its peak GB
    above the inputs and gradients (one call)."""
    v, h, n = (int(s) for s in shape.split("x"))
    x, w, t = make_inputs(n, h, v)
    x.requires_grad_()
    w.requires_grad_()

    def step(fn: Callable) -> None:
        x.grad = w.grad = None
        fn(x, w, t).backward()

    peaks = {}
    for name, fn in variants.items():
        step(fn)  # warm up (compiles, captures)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(fn)
        torch.cuda.synchronize()
        peaks[name] = (torch.cuda.max_memory_allocated() - base) / 1e9
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            for _ in range(calls):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step(fn)
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end))
    del x, w, t
    torch.cuda.empty_cache()
    return {name: {"ms": statistics.median(ts), "least_ms": min(ts), "peak_gb": peaks[name]}
            for name, ts in times.items()}


def table(result: dict) -> str:
    env = result["env"]
    lines = [f"# liger_turns: {env['device']}, torch {env['torch']}, triton {env.get('triton', '-')}, liger "
             f"{env.get('liger_kernel', '-')}, {env['date']}", "",
             f"bf16 fwd+bwd, mean, ~6% ignored; {result['rounds']} rounds of {result['calls']} calls a variant, in "
             "turns; ms = median (least), GB = peak above inputs and grads.", "",
             "| V x H x tokens | variant | ms | least ms | GB | vs liger |", "|---|---|---|---|---|---|"]
    for shape, rows in result["shapes"].items():
        liger = rows["liger"]["ms"]
        for name, r in rows.items():
            lines.append(f"| {shape} | {name} | {r['ms']:.1f} | {r['least_ms']:.1f} | {r['peak_gb']:.2f} | "
                         f"{liger / r['ms']:.3f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="V x H x tokens")
    parser.add_argument("--chunks", nargs="*", type=int, default=[16384, 32768],
                        help="chunk_tokens values forced on our op beside the DB's config")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=3, help="calls per variant per round")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("liger_turns.py times CUDA kernels: it needs a GPU")
    variants = _variants(args.chunks)
    env = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), **versions()}
    result = {"env": env, "rounds": args.rounds, "calls": args.calls, "shapes": {}}
    for shape in args.shapes:
        result["shapes"][shape] = time_in_turns(shape, variants, args.rounds, args.calls)
        print(f"{shape}: {result['shapes'][shape]}", flush=True)
    text = table(result)
    print(text)
    stem = f"liger_turns_{env['device'].replace(' ', '_')}{args.tag}"
    save_results(RESULTS, stem, text + "\n", result)
    return result


if __name__ == "__main__":
    main()
