"""Errors of the precision policies against fp64, by number of chunks: "exact" (fp32 accumulators, the default)
against "compact" (accumulators in the weight dtype), beside eager PyTorch in the same dtype.

The compact policy rounds dW to bf16/fp16 after every chunk's GEMM, so its error grows with the number of
chunks; the exact one rounds once. Relative Frobenius errors of dX and dW; peaky logits (std ~3).

    python benchmarks/precision_errors.py                       # the GPU when there is one, else the CPU
    python benchmarks/precision_errors.py --shape 4096x256x8192 --chunks 1 2 4 8 16 32 --device cpu

Prints a table and writes it (markdown and JSON, with the device and versions) under benchmarks/results/ and
$OUT when set.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flce_compile import fused_linear_cross_entropy  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _inputs(n: int, h: int, v: int, dtype: torch.dtype, device: str):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(v, h, generator=g) * 3.0 / h**0.5).to(device=device, dtype=dtype)
    t = torch.randint(0, v, (n,), generator=g).to(device)
    return x, w, t


def _grads(fn, x, w, t):
    xs, ws = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    fn(xs, ws, t).backward()
    return xs.grad, ws.grad


def _error(ours: torch.Tensor, exact: torch.Tensor) -> float:
    return float((ours.double() - exact).norm() / exact.norm())


def measure(n: int, h: int, v: int, chunks: list[int], dtype: torch.dtype, device: str) -> list[dict]:
    """One row per chunk count: dX and dW errors of eager, exact and compact."""
    x, w, t = _inputs(n, h, v, dtype, device)
    x64, w64 = _grads(lambda a, b, c: F.cross_entropy(F.linear(a, b), c), x.double(), w.double(), t)
    eager = _grads(lambda a, b, c: F.cross_entropy(F.linear(a, b).float(), c), x, w, t)
    rows = []
    for k in chunks:
        row = {"chunks": k, "chunk_tokens": -(-n // k),
               "eager_dx": _error(eager[0], x64), "eager_dw": _error(eager[1], w64)}
        for precision in ("exact", "compact"):
            config = {"chunk_tokens": -(-n // k)}
            dx, dw = _grads(lambda a, b, c: fused_linear_cross_entropy(a, b, c, precision=precision, config=config),
                            x, w, t)
            row[f"{precision}_dx"], row[f"{precision}_dw"] = _error(dx, x64), _error(dw, w64)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| chunks | tokens/chunk | dX eager | dX exact | dX compact | dW eager | dW exact | dW compact "
             "(x eager) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['chunks']} | {r['chunk_tokens']} | {r['eager_dx']:.2e} | {r['exact_dx']:.2e} | "
                     f"{r['compact_dx']:.2e} | {r['eager_dw']:.2e} | {r['exact_dw']:.2e} | {r['compact_dw']:.2e} "
                     f"({r['compact_dw'] / r['eager_dw']:.2f}x) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default=None, help="NxHxV (default: 16384x2048x32000 on a GPU, 4096x256x8192 "
                                                      "on the CPU)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    shape = args.shape or ("16384x2048x32000" if args.device == "cuda" else "4096x256x8192")
    n, h, v = (int(s) for s in shape.split("x"))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    rows = measure(n, h, v, args.chunks, dtype, args.device)
    env = {"device": torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({platform.processor()})",
           "torch": torch.__version__, "python": platform.python_version(), "shape": shape, "dtype": args.dtype}
    text = (f"# Precision policies: errors against fp64 by number of chunks\n\n"
            f"{', '.join(f'{k} {val}' for k, val in env.items())}\n\n{table(rows)}")
    print(text)
    kind = "h200" if "H200" in env["device"] else args.device
    for folder in filter(None, [RESULTS, os.environ.get("OUT")]):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"precision_errors_{kind}.md").write_text(text)
        (Path(folder) / f"precision_errors_{kind}.json").write_text(json.dumps({"env": env, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
