"""Errors of the precision policies against fp64, by number of chunks, beside eager PyTorch in the same dtype:
"exact" (fp32 accumulators, the default), "compact" (accumulators in the weight dtype) and "precise" (fp32
logits into the CE step and each row's true-class rounding added back; ``flce_compile.plan.precision``).

The compact policy rounds dW to bf16/fp16 after every chunk's GEMM, so its error grows with the number of
chunks; the exact one rounds once and equals eager's; the precise one stays below eager's. Relative Frobenius
errors of dX and dW; peaky logits (std ~3); ``--ignored-fraction`` sets that share of targets to -100 (the
"mean" then divides by a count that is not a power of two, which makes eager's gradient rounding coherent).

    python benchmarks/precision_errors.py                      # the GPU when there is one, else the CPU
    python benchmarks/precision_errors.py --device cpu --shape 512x256x8192 1024x512x4096 --chunks 1 4 16 \
        --ignored-fraction 0 0.06 --ablation
    python benchmarks/precision_errors.py --device cuda        # 2048x4096x128256, with CUDA-event timings

On a GPU (``--device cuda``) each policy is also timed (forward + backward with the op's default config, median
of CUDA-event runs) against eager and the three-GEMM floor. ``--ablation`` adds emulated variants (explicit
GEMMs, no op) that show where eager's error comes from. Prints the tables and writes them (markdown and JSON,
with the device and versions) under ``--out`` (benchmarks/results/ by default) and $OUT when set.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import median_ms, save_results  # noqa: E402
from flce_compile import fused_linear_cross_entropy  # noqa: E402
from flce_compile.plan.layout import padded_row_elements  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("exact", "compact", "precise")


def _inputs(n: int, h: int, v: int, dtype: torch.dtype, device: str, ignored: float):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(v, h, generator=g) * 3.0 / h**0.5).to(device=device, dtype=dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < ignored] = -100
    return x, w, t.to(device)


def _grads(fn, x, w, t):
    xs, ws = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    fn(xs, ws, t).backward()
    return xs.grad, ws.grad


def _error(ours: torch.Tensor, exact: torch.Tensor) -> float:
    return float((ours.double() - exact).norm() / exact.norm())


def _eager(a, b, c):
    return F.cross_entropy(F.linear(a, b).float(), c)


def measure(x, w, t, chunks: list[int]) -> list[dict]:
    """One row per chunk count: dX and dW errors of eager and of each policy."""
    n = x.shape[0]
    x64, w64 = _grads(lambda a, b, c: F.cross_entropy(F.linear(a, b), c), x.double(), w.double(), t)
    eager = _grads(_eager, x, w, t)
    rows = []
    for k in chunks:
        row = {"chunks": k, "chunk_tokens": -(-n // k),
               "eager_dx": _error(eager[0], x64), "eager_dw": _error(eager[1], w64)}
        for precision in POLICIES:
            config = {"chunk_tokens": -(-n // k)}
            dx, dw = _grads(lambda a, b, c: fused_linear_cross_entropy(a, b, c, precision=precision, config=config),
                            x, w, t)
            row[f"{precision}_dx"], row[f"{precision}_dw"] = _error(dx, x64), _error(dw, w64)
        rows.append(row)
    return rows


def ablation(x, w, t) -> dict[str, tuple[float, float]]:
    """dX/dW errors (x eager's) of emulated gradients, each with explicit fp32-accumulated GEMMs on bf16/fp16
    operands and dX/dW rounded once: eager (logits and gradient rounded), fp32 logits, fp32 logits plus the
    true-class residual (what "precise" runs), fp32 logits with the gradient as a hi + lo pair (two more
    GEMMs), and bf16 logits with the hi + lo pair."""
    dtype = x.dtype
    rnd = lambda a: a.to(dtype).float()  # noqa: E731
    xf, wf = x.float(), w.float()
    valid = t != -100
    rows, ys = torch.arange(len(t), device=t.device)[valid], t[valid]
    scale = 1.0 / int(valid.sum())

    def grad(z: torch.Tensor) -> torch.Tensor:
        g = torch.softmax(z, dim=1)
        g[rows, ys] -= 1.0
        g[~valid] = 0.0
        return g * scale

    g64 = grad(x.double() @ w.double().T)
    dx64, dw64 = g64 @ w.double(), g64.T @ x.double()
    z32 = xf @ wf.T
    variants = {}
    for name, z in (("eager (bf16 logits, bf16 G)", rnd(z32)), ("fp32 logits", z32)):
        g = grad(z)
        hi = rnd(g)
        variants[name] = (hi @ wf, hi.T @ xf)
        lo = rnd(g - hi)
        if name == "fp32 logits":
            r = torch.zeros_like(g[:, 0])
            r[rows] = g[rows, ys] - hi[rows, ys]
            dx = hi @ wf + r[:, None] * wf[t.clamp(min=0)]
            dw = (hi.T @ xf).index_add_(0, ys, r[rows][:, None] * xf[rows])
            variants["fp32 logits + true-class residual (precise)"] = (dx, dw)
            variants["fp32 logits + hi/lo G (+2 GEMMs)"] = (hi @ wf + lo @ wf, hi.T @ xf + lo.T @ xf)
        else:
            variants["bf16 logits + hi/lo G (+2 GEMMs)"] = (hi @ wf + lo @ wf, hi.T @ xf + lo.T @ xf)
    base = variants["eager (bf16 logits, bf16 G)"]
    base_err = (_error(rnd(base[0]), dx64), _error(rnd(base[1]), dw64))
    return {k: (_error(rnd(a), dx64) / base_err[0], _error(rnd(b), dw64) / base_err[1])
            for k, (a, b) in variants.items()}


def _cuda_ms(fn, reps: int = 20) -> float:
    """Median ms of ``fn`` over CUDA-event timings, after a warm-up."""
    for _ in range(3):
        fn()
    return median_ms(fn, reps, "cuda")


def timings(x, w, t) -> dict[str, float]:
    """Forward + backward ms of eager and of each policy (the op's own config), and the three-GEMM floor at V
    rounded up to 128 bytes (as in bench_flce.py)."""
    xs, ws = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()

    def step(fn):
        def run():
            xs.grad = ws.grad = None
            fn(xs, ws, t).backward()
        return run

    out = {"eager": _cuda_ms(step(_eager))}
    torch.cuda.empty_cache()
    for precision in POLICIES:
        out[precision] = _cuda_ms(step(lambda a, b, c: fused_linear_cross_entropy(a, b, c, precision=precision)))
    v_padded = padded_row_elements(w.shape[0], x.element_size())
    w_padded = F.pad(w, (0, 0, 0, v_padded - w.shape[0]))
    logits = torch.empty(x.shape[0], v_padded, device=x.device, dtype=x.dtype).normal_()

    def gemms():
        torch.mm(x, w_padded.T, out=logits)
        torch.mm(logits, w_padded)
        torch.mm(logits.T, x)

    out["floor"] = _cuda_ms(gemms)
    return out


def table(rows: list[dict]) -> str:
    head = "| chunks | tokens/chunk | " + " | ".join(
        f"{g} {p}" for g in ("dX", "dW") for p in ("eager",) + POLICIES) + " |"
    lines = [head, "|" + "---|" * (2 + 2 * (1 + len(POLICIES)))]
    for r in rows:
        cells = []
        for g in ("dx", "dw"):
            cells.append(f"{r[f'eager_{g}']:.2e}")
            cells += [f"{r[f'{p}_{g}']:.2e} ({r[f'{p}_{g}'] / r[f'eager_{g}']:.2f}x)" for p in POLICIES]
        lines.append(f"| {r['chunks']} | {r['chunk_tokens']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", nargs="+", default=None,
                        help="NxHxV (default: 2048x4096x128256 on a GPU, 4096x256x8192 on the CPU)")
    parser.add_argument("--chunks", type=int, nargs="+", default=None,
                        help="chunk counts (default: 1 2 4 8 16 32 on the CPU, 1 on a GPU)")
    parser.add_argument("--ignored-fraction", type=float, nargs="+", default=[0.0],
                        help="share(s) of targets set to -100 (default 0)")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--device", choices=["cuda", "cpu"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ablation", action="store_true", help="add the emulated variants' error ratios")
    parser.add_argument("--no-timing", action="store_true", help="on a GPU, skip the timings")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="folder of the .md and .json (default: benchmarks/results/, whose committed files it "
                             "replaces)")
    args = parser.parse_args()
    on_gpu = args.device == "cuda"
    shapes = args.shape or (["2048x4096x128256"] if on_gpu else ["4096x256x8192"])
    chunks = args.chunks or ([1] if on_gpu else [1, 2, 4, 8, 16, 32])
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    env = {"device": torch.cuda.get_device_name() if on_gpu else f"cpu ({platform.processor()})",
           "torch": torch.__version__, "python": platform.python_version(), "dtype": args.dtype}
    text = ("# Precision policies: errors against fp64 (relative Frobenius; x eager's)\n\n"
            f"{', '.join(f'{k} {val}' for k, val in env.items())}\n")
    print(text, flush=True)
    cases = []
    for shape in shapes:
        n, h, v = (int(s) for s in shape.split("x"))
        for ignored in args.ignored_fraction:
            printed = len(text)
            x, w, t = _inputs(n, h, v, dtype, args.device, ignored)
            case = {"shape": shape, "ignored_fraction": ignored, "valid_tokens": int((t != -100).sum()),
                    "rows": measure(x, w, t, chunks)}
            text += (f"\n## {shape}, logits std 3, {ignored:g} of the targets ignored ({case['valid_tokens']} "
                     f"valid)\n\n{table(case['rows'])}")
            if args.ablation:
                case["ablation"] = ablation(x, w, t)
                text += "\nEmulated (explicit GEMMs, x eager's error, dX / dW):\n\n" + "".join(
                    f"- {k}: {a:.2f}x / {b:.2f}x\n" for k, (a, b) in case["ablation"].items())
            if on_gpu and not args.no_timing:
                case["ms"] = timings(x, w, t)
                ms = case["ms"]
                text += ("\nForward + backward, median ms of CUDA-event runs (x the three-GEMM floor, "
                         f"{ms['floor']:.2f} ms):\n\n" + "".join(
                             f"- {k}: {ms[k]:.2f} ms ({ms[k] / ms['floor']:.3f}x)\n"
                             for k in ("eager",) + POLICIES))
            cases.append(case)
            print(text[printed:], flush=True)
            del x, w, t
    kind = "h200" if "H200" in env["device"] else args.device
    save_results(args.out, f"precision_errors_{kind}", text, {"env": env, "cases": cases}, indent=2)


if __name__ == "__main__":
    main()
