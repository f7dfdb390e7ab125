"""Does the CE step overlap a cuBLAS GEMM on another stream? (issue #13: "use streams where overlap pays: the CE
kernel is memory-bound and the GEMMs are compute-bound")

Two measurements, bf16 on one GPU:

* kernels: one chunk's logits GEMM (4096 x H by H x V) and one CE step (4096 x V, ``ce_step_triton``, 8 warps)
  alone, one after the other on one stream, and each on its own stream at once. If the two overlapped,
  "two streams" would approach the larger of the two alone; if not, it equals "one stream".
* whole op: the fused call at three shapes with ``streams`` off and on (each chunk's dW GEMM on a side stream,
  so the next chunk's CE step can run beside it), with 16 and 8 warps.
* carveout: the same pair on two streams with cuBLAS asked to leave K SMs free for the CE step
  (``torch._C._set_sm_carveout_experimental``; torch applies it to cuBLASLt GEMMs, so each K runs with the
  default BLAS library and with cuBLASLt preferred). The GEMM alone under the carveout says what the GEMM loses;
  "net" is the one-stream time minus the two-stream time under the carveout (positive: overlapping pays).

    python benchmarks/ce_gemm_overlap.py [--carveout 4 8 16] [--skip-whole-op]

Writes benchmarks/results/ce_gemm_overlap_<gpu>.{json,md} (and to $OUT when set). CUDA only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import make_inputs, median_ms, save_results, versions  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KERNEL_SHAPES = ((128256, 4096), (256000, 2304))  # (V, H) of one 4096-token chunk
OP_SHAPES = ((16384, 4096, 128256), (65536, 4096, 128256), (8192, 2304, 256000))
BLAS_LIBRARIES = ("default", "cublaslt")


@contextlib.contextmanager
def sm_carveout(sms: int, library: str):
    """cuBLAS GEMMs leave ``sms`` SMs free while the body runs, with ``library`` preferred ("default": as is)."""
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if setter is None:
        raise RuntimeError("this torch has no SM carveout for matmuls (torch._C._set_sm_carveout_experimental)")
    saved, saved_library = torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library()
    try:
        setter(sms)
        if library != "default":
            torch.backends.cuda.preferred_blas_library(library)  # RuntimeError where torch lacks the library
        yield
    finally:
        setter(saved)
        torch.backends.cuda.preferred_blas_library(saved_library)


def kernels(vocab: int, hidden: int, rows: int = 4096, carveouts: tuple[int, ...] = ()) -> dict[str, Any]:
    """ms of the chunk's logits GEMM, its CE step, both on one stream and both on two streams at once; per
    carveout K and BLAS library, the GEMM alone and the two streams with the GEMM leaving K SMs free."""
    from flce_compile.params import LossParams
    from flce_compile.plan.choose import heuristic_config
    from flce_compile.strategies.ce_common import CEStepArgs
    from flce_compile.strategies.ce_triton import ce_step_triton

    dev = "cuda"
    x = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)
    w = torch.randn(vocab, hidden, device=dev, dtype=torch.bfloat16) / hidden**0.5
    out = torch.empty(rows, vocab, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(rows, vocab, device=dev, dtype=torch.bfloat16)  # a second buffer: no data dependency
    one = torch.ones((), device=dev)
    args = CEStepArgs(logits=logits, target=torch.randint(0, vocab, (rows,), device=dev), ce_weight=None,
                      weight_sum=torch.tensor(float(vocab), device=dev), ce_scale=one / rows, z_scale=one / rows,
                      loss_out=torch.empty(rows, device=dev), lse_out=None, lse_in=None, write_grad=True)
    config = dataclasses.replace(heuristic_config(rows, vocab, hidden, torch.bfloat16, torch.device(dev)),
                                 strategy="triton", num_warps=8)
    params = LossParams()
    gemm = lambda: torch.mm(x, w.t(), out=out)  # noqa: E731
    ce = lambda: ce_step_triton(args, params, config)  # noqa: E731
    side_a, side_b = torch.cuda.Stream(), torch.cuda.Stream()

    def two_streams() -> None:
        main = torch.cuda.current_stream()
        side_a.wait_stream(main)
        side_b.wait_stream(main)
        with torch.cuda.stream(side_a):
            gemm()
        with torch.cuda.stream(side_b):
            ce()
        main.wait_stream(side_a)
        main.wait_stream(side_b)

    def one_stream() -> None:
        gemm()
        ce()

    steps = {"gemm": gemm, "ce": ce, "two_streams": two_streams, "one_stream": one_stream}
    for step in steps.values():
        median_ms(step, 3, dev)
    result: dict[str, Any] = {name: median_ms(step, 20, dev) for name, step in steps.items()}
    carved: dict[str, dict[str, float]] = {}
    for sms in carveouts:
        for library in BLAS_LIBRARIES:
            try:
                with sm_carveout(sms, library):
                    for step in (gemm, two_streams):
                        median_ms(step, 3, dev)
                    carved[f"{sms}/{library}"] = {"gemm": median_ms(gemm, 20, dev),
                                                  "two_streams": median_ms(two_streams, 20, dev)}
            except RuntimeError as exc:  # no carveout in this torch, or the library refused
                result["carveout_error"] = str(exc)
                return {**result, "carveout": carved}
    return {**result, "carveout": carved}


def whole_op(n: int, hidden: int, vocab: int) -> dict[str, float]:
    """ms of the fused fwd+bwd per (streams, num_warps), chunk 4096 (2048 at V >= 200000)."""
    from flce_compile import fused_linear_cross_entropy

    x, w, t = make_inputs(n, hidden, vocab)
    x.requires_grad_()
    w.requires_grad_()
    out = {}
    for streams in (False, True):
        for warps in (16, 8):
            config = {"strategy": "triton", "chunk_tokens": 4096 if vocab < 200000 else 2048, "block_v": 4096,
                      "num_warps": warps, "num_stages": 1, "streams": streams}

            def step() -> None:
                x.grad = w.grad = None
                fused_linear_cross_entropy(x, w, t, config=config).backward()

            for _ in range(2):
                step()
            out[f"streams={streams} warps={warps}"] = median_ms(step, 8 if n < 65536 else 4, "cuda")
    return out


def table(result: dict[str, Any]) -> str:
    lines = ["| chunk V x H | GEMM ms | CE ms | one stream ms | two streams ms | hidden share of CE |",
             "|---|---|---|---|---|---|"]
    for shape, r in result["kernels"].items():
        hidden = (r["one_stream"] - r["two_streams"]) / r["ce"]
        lines.append(f"| {shape} | {r['gemm']:.3f} | {r['ce']:.3f} | {r['one_stream']:.3f} | "
                     f"{r['two_streams']:.3f} | {hidden:.0%} |")
    if result["whole_op"]:
        configs = list(next(iter(result["whole_op"].values())))
        lines += ["", "| BT x H x V | " + " | ".join(configs) + " |", "|---|" + "---|" * len(configs)]
        for shape, r in result["whole_op"].items():
            lines.append(f"| {shape} | " + " | ".join(f"{r[c]:.1f}" for c in configs) + " |")
    carved = [(shape, key, c, r) for shape, r in result["kernels"].items() for key, c in r.get("carveout", {}).items()]
    if carved:
        lines += ["", "| chunk V x H | SMs left free / BLAS | GEMM ms (alone: no carveout) | two streams ms | "
                  "net vs one stream |", "|---|---|---|---|---|"]
        for shape, key, c, r in carved:
            lines.append(f"| {shape} | {key} | {c['gemm']:.3f} ({r['gemm']:.3f}) | {c['two_streams']:.3f} | "
                         f"{r['one_stream'] - c['two_streams']:+.3f} |")
    errors = {r["carveout_error"] for r in result["kernels"].values() if "carveout_error" in r}
    lines += [f"\ncarveout not measured: {e}" for e in sorted(errors)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--carveout", type=int, nargs="*", default=[4, 8, 16], metavar="K",
                        help="SMs the logits GEMM leaves free in the carveout rows (none: no carveout rows)")
    parser.add_argument("--skip-whole-op", action="store_true", help="only the kernel pairs")
    args = parser.parse_args(argv)
    if any(k < 1 for k in args.carveout):
        parser.error(f"--carveout takes positive SM counts, got {args.carveout}")
    if not torch.cuda.is_available():
        raise SystemExit("ce_gemm_overlap.py needs a CUDA GPU")
    result: dict[str, Any] = {"kernels": {}, "whole_op": {}}
    for vocab, hidden in KERNEL_SHAPES:
        result["kernels"][f"{vocab}x{hidden}"] = kernels(vocab, hidden, carveouts=tuple(args.carveout))
    for n, hidden, vocab in () if args.skip_whole_op else OP_SHAPES:
        result["whole_op"][f"{n}x{hidden}x{vocab}"] = whole_op(n, hidden, vocab)
        torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name()
    env = {"device": gpu, "date": datetime.date.today().isoformat(), **versions()}
    md = (f"# ce_gemm_overlap: {gpu}, torch {env['torch']}, {env['date']}\n\nbf16, median ms (CUDA events). "
          "Kernels: one 4096-token chunk's logits GEMM and CE step (8 warps) on separate buffers; 'hidden share' = "
          "how much of the CE step running on a second stream took off the one-stream time. Whole op: fwd+bwd, "
          "chunk 4096 (2048 at V=256000), block_v 4096, streams off/on. Carveout: the kernel pair with the GEMM "
          "asked to leave K SMs free (see the script).\n\n" + table(result) + "\n")
    print(md)
    save_results(RESULTS, f"ce_gemm_overlap_{gpu.replace(' ', '_')}", md, {"env": env, **result})
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
