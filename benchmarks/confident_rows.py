"""Errors at confident rows against fp64, beside eager PyTorch in the same dtype: rows sure of their target, or of
another class (confident and wrong), where a softmax entry near 1 makes the gradient sensitive to one ulp of one
logit. The "recompute" strategy's backward recomputes the logits in vocabulary blocks, other GEMMs than the
forward's, whose roundings can differ; it forms the target's and the largest class's probabilities from the
forward's z (``CEStepArgs.target_z_in``, ``top_in``). Before the largest class's z was kept, a row sure of another
class at a margin of 24 read dX 32x eager's error in fp32 on an H100 (blocks of 1000).

Inputs: unit-norm weight rows; hidden states ``margin`` along the sure class's row plus N(0, 0.1) noise. Relative
Frobenius errors of dX and dW, and the worst row's relative dX error.

    python benchmarks/confident_rows.py                       # the GPU when there is one, else the CPU
    python benchmarks/confident_rows.py --device cpu --shape 256x64x1000 --vocab-block 96

Prints a table and writes it (markdown and JSON, with the device and versions) under ``--out``
(benchmarks/results/ by default) and $OUT when set.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import save_results, versions  # noqa: E402
from flce_compile import fused_linear_cross_entropy  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SURE_OF = ("target", "another class")


def confident_inputs(n: int, h: int, v: int, margin: float, sure_of: str, device: str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden states, weight, targets) in fp32: rows ``margin`` along their target's weight row, or along another
    class's (``sure_of``)."""
    if sure_of not in SURE_OF:
        raise ValueError(f"sure_of={sure_of!r}: use one of {SURE_OF}")
    g = torch.Generator(device=device).manual_seed(int(margin))
    w = torch.randn(v, h, device=device, generator=g)
    w = w / w.norm(dim=1, keepdim=True)
    t = torch.randint(0, v, (n,), device=device, generator=g)
    sure = (t + torch.randint(1, v, (n,), device=device, generator=g)) % v if sure_of != "target" else t
    return w[sure] * margin + torch.randn(n, h, device=device, generator=g) * 0.1, w, t


def _grads(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, dtype: torch.dtype,
           loss: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = x.to(dtype).clone().requires_grad_(), w.to(dtype).clone().requires_grad_()
    loss(a, b, t).backward()
    return a.grad.double(), b.grad.double()


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm())


def _worst_row(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((got - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)).max())


def variants(vocab_block: int, chunk_tokens: int) -> dict[str, Callable[..., torch.Tensor]]:
    """Our op's default and its recompute strategy with backward blocks of ``vocab_block`` classes."""
    recompute = {"strategy": "recompute", "vocab_block": vocab_block, "chunk_tokens": chunk_tokens}
    return {"default": lambda a, b, t: fused_linear_cross_entropy(a, b, t),
            "recompute": lambda a, b, t: fused_linear_cross_entropy(a, b, t, config=recompute)}


def measure(shape: tuple[int, int, int], dtypes: list[torch.dtype], margins: list[float], vocab_block: int,
            chunk_tokens: int, device: str) -> list[dict[str, Any]]:
    """One row per (dtype, sure_of, margin, variant): dX, dW and worst-row dX errors, and eager's."""
    rows = []
    eager = lambda a, b, t: F.cross_entropy(a @ b.t(), t)  # noqa: E731
    for dtype in dtypes:
        for sure_of in SURE_OF:
            for margin in margins:
                x, w, t = confident_inputs(*shape, margin, sure_of, device)
                # the fp64 reference of the inputs as the dtype holds them
                x, w = x.to(dtype).to(torch.float32), w.to(dtype).to(torch.float32)
                ref, base = _grads(x, w, t, torch.float64, eager), _grads(x, w, t, dtype, eager)
                for name, loss in variants(vocab_block, chunk_tokens).items():
                    got = _grads(x, w, t, dtype, loss)
                    rows.append({
                        "dtype": str(dtype).removeprefix("torch."), "sure_of": sure_of, "margin": margin,
                        "variant": name, "dx": _rel(got[0], ref[0]), "dw": _rel(got[1], ref[1]),
                        "dx_worst_row": _worst_row(got[0], ref[0]), "eager_dx": _rel(base[0], ref[0]),
                        "eager_dw": _rel(base[1], ref[1]), "eager_dx_worst_row": _worst_row(base[0], ref[0])})
    return rows


def _ratio(ours: float, eager: float) -> str:
    """ours / eager, two decimals, or two digits in e-notation below 0.01 (the torch step's confident rows)."""
    r = ours / eager
    return f"{r:.2f}" if r >= 0.01 else f"{r:.1e}"


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: each error and its ratio to eager's."""
    lines = ["| dtype | sure of | margin | variant | dX (x eager) | dW (x eager) | worst row dX (eager's) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['sure_of']} | {r['margin']:g} | {r['variant']} "
                     f"| {r['dx']:.2e} ({_ratio(r['dx'], r['eager_dx'])}x) "
                     f"| {r['dw']:.2e} ({_ratio(r['dw'], r['eager_dw'])}x) "
                     f"| {r['dx_worst_row']:.2e} ({r['eager_dx_worst_row']:.2e}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default=None, help="BTxHxV (default 2048x1024x16384 on a GPU, 256x64x1000 on "
                        "the CPU)")
    parser.add_argument("--margins", type=float, nargs="+", default=[8.0, 16.0, 24.0])
    parser.add_argument("--vocab-block", type=int, default=None, help="the recompute backward's block (default "
                        "1000 on a GPU, 96 on the CPU: neither divides V)")
    parser.add_argument("--chunk-tokens", type=int, default=1024)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    args = parser.parse_args()
    gpu = args.device.startswith("cuda")
    shape = tuple(int(s) for s in (args.shape or ("2048x1024x16384" if gpu else "256x64x1000")).split("x"))
    block = args.vocab_block or (1000 if gpu else 96)
    torch.backends.cuda.matmul.allow_tf32 = False  # eager's fp32 GEMMs in full precision, as the op's
    rows = measure(shape, [getattr(torch, d) for d in args.dtypes], args.margins, block, args.chunk_tokens,
                   args.device)
    name = torch.cuda.get_device_name() if gpu else "cpu"
    env = {"device": name, **versions(), "shape": "x".join(map(str, shape)), "vocab_block": block}
    if not gpu:  # the CPU's vector width sets the order of eager's and the torch step's sums
        env["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    md = (f"# Confident rows, errors vs fp64: {name}, {', '.join(f'{k} {v}' for k, v in env.items() if k != 'device')}"
          f"\n\n{table(rows)}\n")
    print(md)
    stem = f"confident_rows_{'gpu' if gpu else 'cpu'}_{name.replace(' ', '_')}{args.tag}"
    save_results(args.out, stem, md, {"env": env, "rows": rows})


if __name__ == "__main__":
    main()
