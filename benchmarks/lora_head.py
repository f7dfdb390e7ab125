"""What folding a LoRA adapter on the lm_head into the fused op costs and saves (``compiler/lora_head.py``).

One training step, ``loss = CE(head(x) + s * B(A(x))); loss.backward()``, laid out as peft's LoRA ``Linear`` computes
it (a frozen head W, trainable A (r x H) and B (V x r), all in the model's dtype), run eagerly, through
``torch.compile`` (Inductor) and through ``torch.compile(backend="flce")``, which folds the adapter into one GEMM
over ``[x, s*u]`` and ``[W, B]`` and fuses it. Per token count: the peak memory the step allocates beyond its
inputs (CPU: the profiler's allocation records; CUDA: the allocator's peak) and the median step time, and the
largest differences of the fused step's loss and gradients to eager's.

    python benchmarks/lora_head.py                                  # CPU sizes: V=16000, H=512, r=16
    python benchmarks/lora_head.py --vocab 128256 --hidden 4096 --tokens 2048 8192 16384   # on a GPU

Writes benchmarks/results/lora_head_<device>.{json,md} (and to $OUT when set).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import median_ms, save_results, step_peak_bytes, versions  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("eager", "torch.compile", "flce")


class LoraHead(nn.Module):
    """A frozen lm_head with a trainable low-rank adapter, as peft's LoRA ``Linear`` computes it."""

    def __init__(self, vocab: int, hidden: int, rank: int, scale: float) -> None:
        super().__init__()
        self.lm_head = nn.Linear(hidden, vocab, bias=False).requires_grad_(False)
        self.lora_a = nn.Linear(hidden, rank, bias=False)
        self.lora_b = nn.Linear(rank, vocab, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)  # trained: not peft's zeros
        self.scale = scale

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(x) + self.lora_b(self.lora_a(x)) * self.scale
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), target.view(-1))


def _step(fn: Callable, model: nn.Module, x: torch.Tensor, t: torch.Tensor) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        x.grad = None
        loss = fn(x, t)
        loss.backward()
        return loss
    return step


def run(tokens: int, vocab: int, hidden: int, rank: int, dtype: torch.dtype, device: torch.device, reps: int,
        variants: tuple[str, ...] = VARIANTS, inner: str = "inductor") -> dict[str, Any]:
    """One token count: each variant's peak bytes and median ms, what ``explain`` says the flce backend does with
    the loss (its path: "fused" when folded and fused), and the fused step's differences to eager's."""
    from flce_compile import explain

    torch.manual_seed(0)
    model = LoraHead(vocab, hidden, rank, 2.0).to(device=device, dtype=dtype)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    t = torch.randint(0, vocab, (tokens,), device=device)
    fns = {"eager": model, "torch.compile": torch.compile(model),
           "flce": torch.compile(model, backend="flce", options={"flce.inner": inner})}
    (report,) = explain(model, x, t)
    row: dict[str, Any] = {"tokens": tokens, "flce_path": report.path}
    grads = {}
    for name in variants:
        step = _step(fns[name], model, x, t)
        loss = step()  # compiles
        grads[name] = (loss.detach(), x.grad.clone(), model.lora_a.weight.grad.clone(),
                       model.lora_b.weight.grad.clone())
        row[name] = {"peak_bytes": step_peak_bytes(step, device), "ms": median_ms(step, reps, device.type)}
    if "flce" in grads and "eager" in grads:
        row["flce_vs_eager_max_abs"] = {n: (a.float() - b.float()).abs().max().item() for n, a, b in
                                        zip(("loss", "dx", "dA", "dB"), grads["flce"], grads["eager"])}
    return row


def table(result: dict[str, Any]) -> str:
    """The rows as a markdown table."""
    env, args = result["env"], result["args"]
    variants = [v for v in VARIANTS if v in result["rows"][0]]
    lines = [f"# lora_head: {env['device']}, torch {env['torch']}, {env['date']}", "",
             f"One training step of a frozen lm_head with a LoRA adapter, V={args['vocab']}, H={args['hidden']}, "
             f"r={args['rank']}, {args['dtype']} (head and adapter), `loss = CE(head(x) + 2 * B(A(x)))`: peak MB the "
             "step allocates beyond its inputs, and median ms. flce: `torch.compile(backend=\"flce\")`, the adapter "
             "folded into one GEMM over [x, s*u] and [W, B] and fused (path: what `explain` says of the loss); "
             "torch.compile: Inductor alone. Last column: the fused step's largest absolute differences to eager's "
             "(loss, dX, dA, dB).", "",
             "| tokens | " + " | ".join(f"{v} MB / ms" for v in variants) + " | flce path | flce - eager |",
             "|---|" + "---|" * len(variants) + "---|---|"]
    for row in result["rows"]:
        cells = [f"{row[v]['peak_bytes'] / 2**20:.1f} / {row[v]['ms']:.1f}" for v in variants]
        diff = ", ".join(f"{k} {v:.1e}" for k, v in row.get("flce_vs_eager_max_abs", {}).items())
        lines.append(f"| {row['tokens']} | " + " | ".join(cells) + f" | {row['flce_path']} | {diff} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--reps", type=int, default=5, help="timed steps per variant (after 1 untimed)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    env = {"device": name, "date": datetime.date.today().isoformat(), **versions()}
    rows = [run(n, args.vocab, args.hidden, args.rank, dtype, device, args.reps) for n in args.tokens]
    result = {"env": env, "args": vars(args), "rows": rows}
    md = table(result)
    print(md)
    save_results(RESULTS, f"lora_head_{name.replace(' ', '_')}", md, result)


if __name__ == "__main__":
    main()
