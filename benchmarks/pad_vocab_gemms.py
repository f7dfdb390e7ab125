"""How the op runs the GEMMs of an odd vocabulary (``FLCEConfig.pad_vocab``, the GPU default for GPT-2's
V = 50257): each of the three GEMMs of a chunk timed with the weight padded to 128-byte rows (a zero-padded
copy), unpadded (odd V), and split at the last aligned row (an aligned GEMM over the head rows and a small one
over the tail, no copy); next to the copies the padding costs (the weight in, dW out).

Unpadded, every operand's leading dimension is still aligned (the logits buffer keeps its padded row stride:
``plan.layout.padded_row_elements``); only the GEMMs' V is odd. Split, dX sums the tail first and the head
into it (``addmm_``, beta 1). Per token count (bf16, triton.testing.do_bench medians), with dX's error against
fp64 for each:

    python benchmarks/pad_vocab_gemms.py                       # 2048, 4096 and 8192 tokens at 768 x 50257

Writes benchmarks/results/pad_vocab_gemms_<gpu>.{json,md} (and to $OUT when set). CUDA only.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import save_results, versions  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def time_gemms(n: int, h: int, v: int) -> dict[str, Any]:
    """Microseconds of each GEMM padded and unpadded, and of the two copies, at ``n`` x ``h`` x ``v``."""
    from triton.testing import do_bench

    from flce_compile.plan.layout import padded_row_elements

    vp = padded_row_elements(v, 2)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=g) * 0.02).bfloat16()
    wp = torch.zeros(vp, h, device="cuda", dtype=torch.bfloat16)
    wp[:v] = w
    logits = torch.empty(n, vp, device="cuda", dtype=torch.bfloat16)
    grad = (torch.randn(n, vp, device="cuda", generator=g) * 1e-3).bfloat16()
    grad[:, v:] = 0
    dx = torch.empty(n, h, device="cuda", dtype=torch.bfloat16)
    dw_padded = torch.empty(vp, h, device="cuda", dtype=torch.bfloat16)
    dw = torch.empty(v, h, device="cuda", dtype=torch.bfloat16)
    head = v // 64 * 64  # the head's rows: a multiple of 128 bytes of bf16 logits

    def dx_split() -> torch.Tensor:
        torch.mm(grad[:, head:v], w[head:], out=dx)
        return dx.addmm_(grad[:, :head], w[:head])

    cases = {
        ("logits", "padded"): lambda: torch.mm(x, wp.t(), out=logits),
        ("logits", "unpadded"): lambda: torch.mm(x, w.t(), out=logits[:, :v]),
        ("dX", "padded"): lambda: torch.mm(grad, wp, out=dx),
        ("dX", "unpadded"): lambda: torch.mm(grad[:, :v], w, out=dx),
        ("dW", "padded"): lambda: torch.mm(grad.t(), x, out=dw_padded),
        ("dW", "unpadded"): lambda: torch.mm(grad[:, :v].t(), x, out=dw),
        ("logits", "split"): lambda: (torch.mm(x, w[:head].t(), out=logits[:, :head]),
                                      torch.mm(x, w[head:].t(), out=logits[:, head:v])),
        ("dX", "split"): dx_split,
        ("dW", "split"): lambda: (torch.mm(grad[:, :head].t(), x, out=dw[:head]),
                                  torch.mm(grad[:, head:v].t(), x, out=dw[head:])),
        ("copy", "weight in"): lambda: (wp[:v].copy_(w), wp[v:].zero_()),
        ("copy", "dW out"): lambda: dw_padded[:v].clone(),
    }
    us = {f"{a} {b}": 1000 * do_bench(fn, warmup=50, rep=300) for (a, b), fn in cases.items()}
    reference = grad[:, :v].double() @ w.double()
    errors = {}
    for name, fn in (("padded", lambda: torch.mm(grad, wp)), ("unpadded", lambda: torch.mm(grad[:, :v], w)),
                     ("split", lambda: dx_split().clone())):
        errors[name] = ((fn().double() - reference).norm() / reference.norm()).item()
    return {"shape": f"{n}x{h}x{v}", "padded_vocab": vp, "split_row": head, "us": us, "dx_error": errors}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| N x H x V | GEMM | padded us | unpadded us | split us |", "|---|---|---|---|---|"]
    for r in rows:
        us = r["us"]
        for gemm in ("logits", "dX", "dW"):
            lines.append(f"| {r['shape']} | {gemm} | {us[gemm + ' padded']:.1f} | {us[gemm + ' unpadded']:.1f} | "
                         f"{us[gemm + ' split']:.1f} |")
        lines.append(f"| {r['shape']} | copies (weight in, dW out) | {us['copy weight in'] + us['copy dW out']:.1f} "
                     "| - | - |")
        e = r["dx_error"]
        lines.append(f"| {r['shape']} | dX error vs fp64 | {e['padded']:.3e} | {e['unpadded']:.3e} | "
                     f"{e['split']:.3e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", nargs="+", type=int, default=[2048, 4096, 8192])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50257)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("pad_vocab_gemms.py needs a CUDA GPU")
    rows = [time_gemms(n, args.hidden, args.vocab) for n in args.tokens]
    env = {**versions(), "date": datetime.date.today().isoformat()}
    gpu = torch.cuda.get_device_name()
    md = (f"# pad_vocab_gemms: {gpu}, torch {torch.__version__}, {env['date']}\n\n"
          "bf16. Each GEMM of a chunk with V padded to 128-byte rows (the weight copied into a zero-padded one), "
          "unpadded (odd V; every leading dimension still aligned) and split at the last 128-byte row (head and "
          "tail GEMMs; dX sums the tail first). triton.testing.do_bench medians; dX's error against fp64.\n\n"
          + table(rows) + "\n")
    print(md)
    save_results(RESULTS, f"pad_vocab_gemms_{gpu.replace(' ', '_')}", md, {"env": env, "rows": rows}, indent=2)
    return rows


if __name__ == "__main__":
    main()
