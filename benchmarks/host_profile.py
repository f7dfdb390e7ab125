"""Where the host time of one eager forward + backward call goes: cProfile of the op, CUDA graph replay on and off.

For each mode: the median and least host time of a whole call (the GPU drained before each, as
host_overhead.py times it), of its forward and of its backward alone, then the functions with the most own
time over ``--calls`` back-to-back calls. Writes ``host_profile_<gpu>.txt`` (GPU name and versions first).

    python benchmarks/host_profile.py                        # 2048x768x50304 bf16 on the GPU
    python benchmarks/host_profile.py --out benchmarks/results --top 30
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._common import make_inputs, versions  # noqa: E402
from flce_compile import fused_linear_cross_entropy, graph_replay, set_cuda_graphs  # noqa: E402


def _host_us(fn, calls: int) -> tuple[float, float]:
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6, min(times) * 1e6


def profile_mode(mode: str, shape: str, calls: int, top: int) -> str:
    n, h, v = (int(s) for s in shape.split("x"))
    x, w, t = make_inputs(n, h, v)
    x.requires_grad_()
    w.requires_grad_()
    set_cuda_graphs(mode)

    def step() -> None:
        x.grad = w.grad = None
        fused_linear_cross_entropy(x, w, t).backward()

    for _ in range(20):
        step()
    whole = _host_us(step, calls)
    fwd, bwd = [], []
    for _ in range(calls):
        x.grad = w.grad = None
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = fused_linear_cross_entropy(x, w, t)
        mid = time.perf_counter()
        loss.backward()
        fwd.append(mid - start)
        bwd.append(time.perf_counter() - mid)
        del loss
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(calls):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return (f"## CUDA graphs {mode} ({graph_replay.graph_count()} captured)\n\n"
            f"host us per fwd+bwd: median {whole[0]:.0f}, least {whole[1]:.0f}; forward median "
            f"{statistics.median(fwd) * 1e6:.0f}, backward median {statistics.median(bwd) * 1e6:.0f}\n\n"
            + text.getvalue().strip() + "\n")


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="2048x768x50304", help="BT x H x V")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--top", type=int, default=22, help="functions listed per mode")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_profile.py profiles the CUDA launch path: it needs a GPU")
    gpu = torch.cuda.get_device_name()
    header = f"# host_profile: {gpu}, {versions()}, bf16 {args.shape}\n\n"
    report = header + "\n".join(profile_mode(mode, args.shape, args.calls, args.top) for mode in ("auto", "off"))
    set_cuda_graphs("auto")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"host_profile_{gpu.replace(' ', '_')}.txt"
    path.write_text(report)
    print(report)
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
