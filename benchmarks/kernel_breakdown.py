"""Where the GPU time of one fused forward + backward call goes (issue #13): its kernels by kind, under
torch.profiler, next to the three-GEMM floor.

Per shape (bf16, mean, the op's default config on this GPU), over a few profiled calls (median):

* span: first kernel start to last kernel end; busy: the union of the kernel intervals (span - busy is idle).
* per kind (GEMM, CE step, scale factors, copies/fills/other), the kernels' summed time and count. The sums
  can exceed busy where kernels of two streams overlap.
* floor: the three cuBLAS GEMMs alone (logits, dX, dW at V padded to 128 bytes), CUDA events.

    python benchmarks/kernel_breakdown.py                                  # the five bench_flce shapes
    python benchmarks/kernel_breakdown.py --shapes 4096x768x50257 --config '{"chunk_tokens": 2048}'

Writes benchmarks/results/kernel_breakdown_<gpu>.{json,md} (and to $OUT when set). CUDA only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import (  # noqa: E402
    busy_and_span_ns, cuda_events, make_inputs, median_ms, save_results, versions)

SHAPES = ["16384x4096x128256", "16384x4096x151936", "8192x2304x256000", "4096x768x50257", "65536x4096x128256"]
RESULTS = Path(__file__).resolve().parent / "results"
#: Kernel kinds, by a piece of the kernel's name (first match wins); the rest are "other".
KINDS = (
    ("CE step", ("ce_chunk_kernel",)),
    ("scale factors", ("loss_scales_kernel", "scale_kernel")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "ampere_", "splitk", "splitK")),
)


def kind_of(name: str) -> str:
    """The kind of a kernel named ``name`` (see KINDS)."""
    for kind, pieces in KINDS:
        if any(piece in name for piece in pieces):
            return kind
    return "other"


def profile_call(step, reps: int = 3) -> dict[str, Any]:
    """Median over ``reps`` profiled calls of ``step``: span and busy ms, and per kind the summed ms and count."""
    from torch.profiler import ProfilerActivity, profile

    runs = []
    for _ in range(reps):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        events = cuda_events(prof)
        busy, span = busy_and_span_ns(events)
        kinds: dict[str, list[float]] = {}
        others: dict[str, float] = {}
        for e in events:
            kind = kind_of(e.name())
            entry = kinds.setdefault(kind, [0.0, 0])
            entry[0] += e.duration_ns() / 1e6
            entry[1] += 1
            if kind == "other":
                name = e.name()[:80]
                others[name] = others.get(name, 0.0) + e.duration_ns() / 1e6
        runs.append({"span_ms": span / 1e6, "busy_ms": busy / 1e6, "kinds": kinds, "others": others})
    best = sorted(runs, key=lambda r: r["span_ms"])[len(runs) // 2]
    top = sorted(best["others"].items(), key=lambda kv: -kv[1])[:5]
    return {"span_ms": best["span_ms"], "busy_ms": best["busy_ms"],
            "kinds": {k: {"ms": v[0], "count": v[1]} for k, v in sorted(best["kinds"].items())},
            "top_other_ms": {name: round(ms, 4) for name, ms in top}}


def floor_ms(x: torch.Tensor, w: torch.Tensor) -> float:
    """The three GEMMs at V padded to 128 bytes, timed alone (CUDA events, median)."""
    from flce_compile.plan.layout import padded_row_elements

    v = padded_row_elements(w.shape[0], w.element_size())
    wp = torch.zeros(v, w.shape[1], dtype=w.dtype, device=w.device)
    wp[: w.shape[0]] = w
    g = torch.randn(x.shape[0], v, dtype=x.dtype, device=x.device)

    def gemms() -> None:
        torch.mm(x, wp.t())
        torch.mm(g, wp)
        torch.mm(g.t(), x)

    for _ in range(3):
        gemms()
    return median_ms(gemms, 10, "cuda")


def run(shapes: list[str], config: dict | None) -> list[dict[str, Any]]:
    from flce_compile import fused_linear_cross_entropy

    rows = []
    for shape in shapes:
        n, h, v = (int(s) for s in shape.split("x"))
        x, w, t = make_inputs(n, h, v)
        x.requires_grad_()
        w.requires_grad_()

        def step() -> None:
            x.grad = w.grad = None
            fused_linear_cross_entropy(x, w, t, config=config).backward()

        for _ in range(3):
            step()
        row = {"shape": shape, **profile_call(step), "floor_ms": floor_ms(x.detach(), w.detach())}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del x, w, t
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    kinds = sorted({k for r in rows for k in r["kinds"]})
    head = "| BT x H x V | floor ms | span ms | busy ms | " + " | ".join(f"{k} ms (n)" for k in kinds) + " |"
    lines = [head, "|" + "---|" * (4 + len(kinds))]
    for r in rows:
        cells = [f"{r['kinds'][k]['ms']:.2f} ({r['kinds'][k]['count']})" if k in r["kinds"] else "-" for k in kinds]
        lines.append(f"| {r['shape']} | {r['floor_ms']:.2f} | {r['span_ms']:.2f} | {r['busy_ms']:.2f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=SHAPES)
    parser.add_argument("--config", default=None, help="JSON of forced config fields (default: the op's choice)")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernel_breakdown.py needs a CUDA GPU")
    rows = run(args.shapes, json.loads(args.config) if args.config else None)
    env = {**versions(), "date": datetime.date.today().isoformat(), "config": args.config or "the op's default"}
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    md = (f"# kernel_breakdown: {torch.cuda.get_device_name()}, torch {torch.__version__}, {env['date']}\n\n"
          f"One bf16 forward + backward call (mean, ~6% ignored), config: {env['config']}. Kernel time by kind "
          "under torch.profiler (median of 3 calls); busy = union of kernel intervals; floor = the three GEMMs "
          "alone at V padded to 128 bytes (CUDA events). Sums over kinds exceed busy where streams overlap.\n\n"
          + table(rows) + "\n")
    print(md)
    save_results(RESULTS, f"kernel_breakdown_{gpu}{args.tag}", md, {"env": env, "rows": rows}, indent=2)
    return rows


if __name__ == "__main__":
    main()
