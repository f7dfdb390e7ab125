"""Our op under Inductor's CUDA-graph trees (``mode="reduce-overhead"``): host time per step against compiled
torch's, the tensors the trees rebuild per step, and the memory a step takes.

CUDA-graph trees hand a graph's outputs back as cached tensors, except outputs that alias another graph's
outputs, which they rebuild from metadata at every replay (host time). Our op forms dX and dW in forward and
backward scales them; scaled in place, backward's outputs alias forward's (issue #13: 4 rebuilt a step against
compiled torch's 1). Traced for CUDA graphs, backward now scales into new buffers (``flce_compile/
scaled_gradients.py``). The rows, all with ``mode="reduce-overhead"``:

- compile: ``torch.compile`` of eager PyTorch's ``F.cross_entropy(F.linear(x, w).float(), t)``;
- flce-in-compile: our op called inside the user's ``torch.compile`` (the default: new buffers);
- flce-in-compile, in-place scale: the same, traced with the scale into new buffers turned off (as before);
- flce-backend: eager PyTorch's code under ``torch.compile(backend="flce")``.

Inductor's and AOT autograd's caches are off for the run: the two flce-in-compile rows trace the same graph, and a
cache hit would hand one the other's compiled backward.

    python benchmarks/reduce_overhead.py                     # on a GPU
    python benchmarks/reduce_overhead.py --memory-shape 16384x4096x128256
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[1]
TIMING_SHAPE = "2048x768x50304"
MEMORY_SHAPE = "16384x4096x128256"
CPU_SHAPE = "64x16x64"
VARIANTS = ("compile", "flce-in-compile", "flce-in-compile, in-place scale", "flce-backend")
BASELINE = "compile"
#: Steps over which the rebuilt tensors are counted.
COUNTED_STEPS = 20


@contextlib.contextmanager
def _no_compile_caches() -> Iterator[None]:
    """Inductor's FX-graph cache and AOT autograd's cache off while it lasts: two rows that trace the same graph
    differently must not share a compiled backward."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


@contextlib.contextmanager
def _tracing(variant: str) -> Iterator[None]:
    """While ``variant`` is first called (and traced): the in-place row's backward traced as before the scale into
    new buffers."""
    if variant != "flce-in-compile, in-place scale":
        yield
        return
    import flce_compile.op as op

    with mock.patch.object(op, "traced_for_cuda_graphs", lambda grad_scale: False):
        yield


def losses(variants: list[str]) -> dict[str, Callable]:
    """Each variant's loss function, compiled with ``mode="reduce-overhead"`` (lazily: traced at its first call)."""
    from benchmarks._common import eager_loss
    from benchmarks.host_overhead import _own_code
    from flce_compile import fused_linear_cross_entropy

    def flce(x, w, t):
        return fused_linear_cross_entropy(x, w, t)

    table = {}
    for i, name in enumerate(variants):
        if name == "flce-backend":
            import flce_compile.compiler  # noqa: F401  (registers backend="flce" without the installed entry point)

            table[name] = torch.compile(_own_code(eager_loss, f"v{i}"), backend="flce", dynamic=False,
                                        mode="reduce-overhead")
        else:
            fn = eager_loss if name == "compile" else flce
            table[name] = torch.compile(_own_code(fn, f"v{i}"), dynamic=False, mode="reduce-overhead")
    return table


def _warm_steps(loss_fns: dict[str, Callable], x, w, t, warmup: int, cuda: bool) -> dict[str, Callable[[], None]]:
    """Each variant's training step, run ``warmup`` times (its compile, the trees' warm-up and recording)."""
    from benchmarks.host_overhead import _step

    steps = {}
    for name, fn in loss_fns.items():
        steps[name] = _step(fn, x, w, t, cuda)
        with _tracing(name):
            for _ in range(warmup):
                steps[name]()
    return steps


def rebuilt_per_step(step: Callable[[], None], steps: int = COUNTED_STEPS) -> float:
    """Tensors CUDA-graph trees rebuild from metadata per step (``CUDAGraphNode._reconstruct_from_tensor_metadata``
    calls: outputs they cannot hand back cached). 0 where no tree runs (the CPU)."""
    from torch._inductor import cudagraph_trees

    calls = [0]
    real = cudagraph_trees.CUDAGraphNode._reconstruct_from_tensor_metadata

    def counting(self, *args, **kwargs):
        calls[0] += 1
        return real(self, *args, **kwargs)

    with mock.patch.object(cudagraph_trees.CUDAGraphNode, "_reconstruct_from_tensor_metadata", counting):
        for _ in range(steps):
            step()
    return calls[0] / steps


def paired_ratios(rows: dict[str, dict[str, Any]], baseline: str = BASELINE) -> dict[str, dict[str, Any]]:
    """Per variant: its drained host ms over the baseline's in the same round, median [lowest, highest] over
    rounds, and the rounds in which it was no slower (host speed drifts across a run; a round shares it)."""
    base = rows[baseline]["rounds"]["host_ms"]
    out = {}
    for name, row in rows.items():
        if name == baseline:
            continue
        ratios = [a / b for a, b in zip(row["rounds"]["host_ms"], base)]
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        out[name] = {"median_ratio": statistics.median(ratios), "q1": quartiles[0], "q3": quartiles[2],
                     "rounds_no_slower": sum(r <= 1.0 for r in ratios), "rounds": len(ratios)}
    return out


def step_peak_gb(step: Callable[[], None], name: str, warmup: int) -> dict[str, float]:
    """GB above what was allocated before ``step``'s first call: the peak allocated over its warm-up (compile, the
    trees' warm-up run and recording: replays allocate nothing) and a few replays; and the growth of what the
    allocator reserves, CUDA-graph pools included (a replay's outputs live in its pool, which
    ``memory_allocated`` does not count)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    with _tracing(name):
        for _ in range(warmup + 3):
            step()
    torch.cuda.synchronize()
    return {"peak_gb": (torch.cuda.max_memory_allocated() - base) / 1e9,
            "reserved_gb": (torch.cuda.memory_reserved() - reserved) / 1e9}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.host_overhead import _inputs, environment, time_rounds

    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = args.shape or (TIMING_SHAPE if cuda else CPU_SHAPE)
    variants = [BASELINE] + [v for v in args.variants if v != BASELINE]
    x, w, t = _inputs(shape, args.device, dtype)
    steps = _warm_steps(losses(variants), x, w, t, args.warmup, cuda)
    rows = time_rounds(steps, args.calls, args.rounds, cuda)
    for name, step in steps.items():
        rows[name]["rebuilt_per_step"] = rebuilt_per_step(step)
        print(f"{name}: { {k: v for k, v in rows[name].items() if k != 'rounds'} }", flush=True)
    result: dict[str, Any] = {"env": environment(args.device), "shape": shape, "dtype": str(dtype),
                              "rounds": args.rounds, "calls": args.calls, "timings": rows,
                              "paired": paired_ratios(rows)}
    if cuda and args.memory_shape:
        del steps, x, w, t
        gc.collect()
        xm, wm, tm = _inputs(args.memory_shape, "cuda", dtype)
        memory = {}
        for name, fn in losses(variants).items():
            from benchmarks.host_overhead import _step

            memory[name] = step_peak_gb(_step(fn, xm, wm, tm, True), name, args.warmup)
            print(f"memory {name}: {memory[name]}", flush=True)
        result["memory_shape"], result["memory"] = args.memory_shape, memory
    return result


def table(result: dict[str, Any]) -> str:
    env = result["env"]
    lines = [f"# reduce_overhead: {env['device']}, torch {env['torch']}, triton {env.get('triton', '-')}, "
             f"{env['date']}", "",
             f"Forward + backward, mean, {result['dtype']}, {result['shape']} (BT x H x V), every row compiled with "
             "`mode=\"reduce-overhead\"` (CUDA-graph trees run on CUDA only). host = CPU wall time to issue one "
             "step, on CUDA the GPU drained before each "
             f"(median of {result['calls']} steps in {result['rounds']} rounds, the variants in turns); paired = "
             f"host over {BASELINE}'s in the same round, median [quartiles], rounds no slower; rebuilt = tensors "
             "CUDA-graph trees rebuild from metadata per step; e2e = per step, back to back, CUDA events.", "",
             "| variant | host ms | paired host | rebuilt / step | e2e ms |", "|---|---|---|---|---|"]
    for name, row in result["timings"].items():
        p = result["paired"].get(name)
        ratio = (f"{p['median_ratio']:.3f} [{p['q1']:.3f}, {p['q3']:.3f}], {p['rounds_no_slower']}/{p['rounds']}"
                 if p else "1")
        e2e = f"{row['e2e_ms']:.3f}" if "e2e_ms" in row else "-"
        lines.append(f"| {name} | {row['host_ms']:.3f} | {ratio} | {row['rebuilt_per_step']:.1f} | {e2e} |")
    if result.get("memory"):
        lines += ["", f"Memory at {result['memory_shape']}, GB above the inputs: the peak over compile, warm-up, "
                  "recording and three replays (replays allocate nothing); reserved = what the allocator reserves "
                  "after them beyond what it did before, CUDA-graph pools included (the rows run one after "
                  "another, and a later row may reuse what an earlier one reserved).", "",
                  "| variant | peak GB | reserved GB |", "|---|---|---|"]
        for name, m in result["memory"].items():
            lines.append(f"| {name} | {m['peak_gb']:.2f} | {m['reserved_gb']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", help=f"BT x H x V timed (default {TIMING_SHAPE} on CUDA, {CPU_SHAPE} on the CPU)")
    parser.add_argument("--memory-shape", default=MEMORY_SHAPE, help="BT x H x V of the memory table (CUDA; '' "
                        "skips it)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                        help=f"rows ({BASELINE} always runs: the others are paired with it)")
    parser.add_argument("--calls", type=int, default=960, help="timed steps per variant")
    parser.add_argument("--rounds", type=int, default=48, help="turns the variants take")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="folder of the .md and .json")
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda needs a CUDA GPU")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _no_compile_caches():
            result = run(args)
    finally:
        torch.set_num_threads(threads)
    text = table(result)
    print(text)
    from benchmarks._common import save_results

    stem = f"reduce_overhead_{'cpu' if args.device == 'cpu' else result['env']['device'].replace(' ', '_')}{args.tag}"
    save_results(args.out, stem, text + "\n", result)
    return result


if __name__ == "__main__":
    main()
