"""Does the CE step overlap a cuBLAS GEMM on another stream? (issue #13: "use streams where overlap pays: the CE
kernel is memory-bound and the GEMMs are compute-bound")

Two measurements, bf16 on one GPU:

* kernels: one chunk's logits GEMM (4096 x H by H x V) and one CE step (4096 x V, ``ce_step_triton``, 8 warps)
  alone, one after the other on one stream, and each on its own stream at once. If the two overlapped,
  "two streams" would approach the larger of the two alone; if not, it equals "one stream".
* whole op: the fused call at three shapes with ``streams`` off and on (each chunk's dW GEMM on a side stream,
  so the next chunk's CE step can run beside it), with 16 and 8 warps.

    python benchmarks/ce_gemm_overlap.py

Writes benchmarks/results/ce_gemm_overlap_<gpu>.{json,md} (and to $OUT when set). CUDA only.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import make_inputs, median_ms, versions  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KERNEL_SHAPES = ((128256, 4096), (256000, 2304))  # (V, H) of one 4096-token chunk
OP_SHAPES = ((16384, 4096, 128256), (65536, 4096, 128256), (8192, 2304, 256000))


def kernels(vocab: int, hidden: int, rows: int = 4096) -> dict[str, float]:
    """ms of the chunk's logits GEMM, its CE step, both on one stream and both on two streams at once."""
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
    return {name: median_ms(step, 20, dev) for name, step in steps.items()}


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
    configs = list(next(iter(result["whole_op"].values())))
    lines += ["", "| BT x H x V | " + " | ".join(configs) + " |", "|---|" + "---|" * len(configs)]
    for shape, r in result["whole_op"].items():
        lines.append(f"| {shape} | " + " | ".join(f"{r[c]:.1f}" for c in configs) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    if argv:
        raise SystemExit(f"ce_gemm_overlap.py takes no arguments, got {argv}")
    if not torch.cuda.is_available():
        raise SystemExit("ce_gemm_overlap.py needs a CUDA GPU")
    result: dict[str, Any] = {"kernels": {}, "whole_op": {}}
    for vocab, hidden in KERNEL_SHAPES:
        result["kernels"][f"{vocab}x{hidden}"] = kernels(vocab, hidden)
    for n, hidden, vocab in OP_SHAPES:
        result["whole_op"][f"{n}x{hidden}x{vocab}"] = whole_op(n, hidden, vocab)
        torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name()
    env = {"device": gpu, "date": datetime.date.today().isoformat(), **versions()}
    md = (f"# ce_gemm_overlap: {gpu}, torch {env['torch']}, {env['date']}\n\nbf16, median ms (CUDA events). "
          "Kernels: one 4096-token chunk's logits GEMM and CE step (8 warps) on separate buffers; 'hidden share' = "
          "how much of the CE step running on a second stream took off the one-stream time. Whole op: fwd+bwd, "
          "chunk 4096 (2048 at V=256000), block_v 4096, streams off/on.\n\n" + table(result) + "\n")
    print(md)
    for folder in filter(None, [RESULTS, os.environ.get("OUT")]):
        Path(folder).mkdir(parents=True, exist_ok=True)
        stem = f"ce_gemm_overlap_{gpu.replace(' ', '_')}"
        (Path(folder) / f"{stem}.json").write_text(json.dumps({"env": env, **result}, indent=1))
        (Path(folder) / f"{stem}.md").write_text(md)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
