"""Where the op's time above the three-GEMM floor goes, timed as bench_flce times (do_bench, back to back: the GPU
at its power cap, not one cool profiled call as in kernel_breakdown.py).

At each shape, in turns, ``--rounds`` times:

* **floor**: the three GEMMs on the loss's own logit gradient (``bench_flce.time_floor``'s steps);
* **gemms**: the op's GEMMs alone, on that gradient: per chunk of the op's ``chunk_tokens``, the logits, dX and dW,
  dW summed in an fp32 accumulator when there is more than one chunk (one chunk writes dW straight in bf16, as the
  op does);
* **rounding**: gemms, then dW's sums rounded to bf16 (the op's last step when it has more than one chunk);
* **op**: the op, forward + backward, with its default config.

So gemms - floor is the cost of chunking the GEMMs, rounding - gemms that of dW's fp32 sums, and op - rounding the
CE step and the rest. ``--beside`` adds the question whether dW's rounding hides beside the last chunk's dX GEMM on
a second stream (stream priority 0 and -1) rather than after it on one.

    python benchmarks/floor_gap.py [--shapes 16384x4096x128256 ...] [--rounds 3] [--beside]

Prints a table and writes it, markdown and JSON with the GPU name and versions, under ``--out``
(benchmarks/results/ by default) and $OUT when set.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import do_bench_ms, make_inputs, parse_turns_args, save_results  # noqa: E402
from benchmarks.bench_flce import environment, floor_gemms, logit_gradient  # noqa: E402
from flce_compile import choose_config, fused_linear_cross_entropy  # noqa: E402
from flce_compile.plan.layout import padded_row_elements  # noqa: E402
from flce_compile.strategies.chunked import add_product  # noqa: E402

#: The three shapes with H = 4096 that issue #13 holds to 1.04x the floor.
SHAPES = ["16384x4096x128256", "16384x4096x151936", "65536x4096x128256"]
#: The steps timed at each shape, in the order of each round.
STEPS = ("floor", "gemms", "rounding", "op")
#: --beside's (V, H, tokens in the last chunk).
BESIDE_SHAPES = ((128256, 4096, 4096), (151936, 4096, 4096), (128256, 4096, 8192))


def chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    """The op's chunks of ``n`` tokens: (start, stop) per chunk of at most ``chunk`` tokens."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: must be at least 1")
    return [(start, min(start + chunk, n)) for start in range(0, n, chunk)]


class GemmSteps:
    """The op's GEMMs on a given logit gradient, without its CE step: ``gemms`` and ``rounding`` (see the module's
    docstring). ``x`` (N, H), ``weight`` (Vp, H) with V padded as the op pads it, ``grad`` (N, Vp), ``vocab`` = V."""

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, vocab: int, chunk: int) -> None:
        self.x, self.weight, self.grad, self.vocab = x, weight, grad, vocab
        self.plan = chunks(x.shape[0], chunk)
        longest = max((stop - start for start, stop in self.plan), default=0)
        self.logits = torch.empty(longest, weight.shape[0], dtype=x.dtype, device=x.device)
        self.dx = torch.empty_like(x)
        self.straight = len(self.plan) <= 1  # one chunk: dW in the weight dtype, no fp32 sums
        self.dw = torch.empty(weight.shape, dtype=x.dtype if self.straight else torch.float32, device=x.device)

    def gemms(self) -> None:
        """Per chunk: logits, dX and dW (summed in fp32 over chunks, or written straight by one chunk)."""
        x, w, grad = self.x, self.weight, self.grad
        for index, (start, stop) in enumerate(self.plan):
            torch.mm(x[start:stop], w.t(), out=self.logits[: stop - start])
            torch.mm(grad[start:stop], w, out=self.dx[start:stop])
            if self.straight:
                torch.mm(grad.t(), x, out=self.dw)
            else:
                add_product(self.dw, grad[start:stop].t(), x[start:stop], overwrite=index == 0)

    def rounding(self) -> torch.Tensor:
        """``gemms``, then dW's V rows in the weight dtype (the op's result)."""
        self.gemms()
        return self.dw[: self.vocab].to(self.x.dtype)


def time_shape(shape: str, rounds: int) -> dict[str, Any]:
    """One shape's row: each step's do_bench ms per round, in turns, and their medians and ratios to the floor."""
    times, chunk, source = _time_steps(shape, rounds)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the shape's tensors went with _time_steps' frame
    medians = {step: statistics.median(ms) for step, ms in times.items()}
    return {"shape": shape, "chunk_tokens": chunk, "config_source": source, "rounds_ms": times,
            "median_ms": medians, "over_floor": {step: medians[step] / medians["floor"] for step in STEPS}}


def _time_steps(shape: str, rounds: int) -> tuple[dict[str, list[float]], int, str]:
    """(each step's ms per round, the op's chunk_tokens, where its config came from) at ``shape``."""
    n, h, v = (int(s) for s in shape.split("x"))
    x, w, t = make_inputs(n, h, v)
    config, source = choose_config(n, v, h, x.dtype, x.device)
    chunk = min(config.chunk_tokens, n)
    v_padded = padded_row_elements(v, x.element_size())
    w_padded = F.pad(w, (0, 0, 0, v_padded - v))
    grad = logit_gradient(x, w, t, v_padded)
    floor_logits = torch.empty(n, v_padded, dtype=x.dtype, device=x.device)
    steps = GemmSteps(x, w_padded, grad, v, chunk)
    xg, wg = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()

    def op() -> None:
        xg.grad = wg.grad = None
        fused_linear_cross_entropy(xg, wg, t).backward()

    fns: dict[str, Callable[[], object]] = {"floor": floor_gemms(x, w_padded, grad, floor_logits),
                                            "gemms": steps.gemms, "rounding": steps.rounding, "op": op}
    times: dict[str, list[float]] = {step: [] for step in STEPS}
    for _ in range(rounds):
        for step in STEPS:
            times[step].append(do_bench_ms(fns[step], warmup_ms=200, rep_ms=1000))
    return times, chunk, source


def time_beside(vocab: int, hidden: int, tokens: int, rounds: int) -> dict[str, Any]:
    """dW's rounding (fp32 (V, H) -> bf16) after a dX GEMM ((tokens, V) @ (V, H)) on one stream, against the
    rounding on a second stream of priority 0 or -1 started before the GEMM; ``hidden`` = the share of the
    rounding's own time that the second stream saved (negative: it cost)."""
    grad = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16) * 1e-3
    weight = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16)
    sums = torch.randn(vocab, hidden, device="cuda", dtype=torch.float32)
    dw = torch.empty(vocab, hidden, device="cuda", dtype=torch.bfloat16)
    dx = torch.empty(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    main = torch.cuda.current_stream()
    sides = {0: torch.cuda.Stream(priority=0), -1: torch.cuda.Stream(priority=-1)}

    def gemm() -> None:
        torch.mm(grad, weight, out=dx)

    def rounding() -> None:
        dw.copy_(sums)

    def one_stream() -> None:
        gemm()
        rounding()

    def beside(priority: int) -> None:
        side = sides[priority]
        side.wait_stream(main)
        with torch.cuda.stream(side):
            rounding()
        gemm()
        main.wait_stream(side)

    fns = {"gemm": gemm, "rounding": rounding, "one stream": one_stream,
           "beside, priority 0": lambda: beside(0), "beside, priority -1": lambda: beside(-1)}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(do_bench_ms(fn, warmup_ms=100, rep_ms=500))
    medians = {name: statistics.median(ms) for name, ms in times.items()}
    hidden_share = {name: (medians["one stream"] - medians[name]) / medians["rounding"]
                    for name in ("beside, priority 0", "beside, priority -1")}
    return {"vocab": vocab, "hidden": hidden, "tokens": tokens, "median_ms": medians, "hidden_share": hidden_share}


def _line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _shape_cells(row: dict[str, Any]) -> list[str]:
    """A shape's ms per step with its ratio to the floor, then the shares of the floor that dW's rounding and the
    CE step with the rest add."""
    ms, ratio = row["median_ms"], row["over_floor"]
    steps = [f"{ms['floor']:.2f}"] + [f"{ms[step]:.2f} ({ratio[step]:.3f})" for step in STEPS[1:]]
    shares = [(ms["rounding"] - ms["gemms"]) / ms["floor"], (ms["op"] - ms["rounding"]) / ms["floor"]]
    return [row["shape"], str(row["chunk_tokens"]), *steps, *(f"{share:.1%}" for share in shares)]


def _beside_cells(row: dict[str, Any]) -> list[str]:
    """One --beside shape's ms per variant, the second stream's with the share of the rounding it hid."""
    ms, hidden = row["median_ms"], row["hidden_share"]
    alone = [f"{ms[name]:.3f}" for name in ("gemm", "rounding", "one stream")]
    paired = [f"{ms[name]:.3f} (hidden {hidden[name]:.0%})" for name in hidden]
    return [f"{row['vocab']}x{row['hidden']}, {row['tokens']}", *alone, *paired]


def table(env: dict[str, str], rounds: int, rows: list[dict[str, Any]], beside: list[dict[str, Any]]) -> str:
    """The markdown the run prints and saves."""
    lines = [f"# floor_gap: {env['gpu']}, torch {env['torch']}, {env['date']}", "",
             f"bf16, ms = the median of {rounds} rounds' do_bench medians, the steps in turns (floor: the three "
             "GEMMs on the logit gradient; gemms: the op's chunked GEMMs on it; rounding: gemms + dW's fp32 sums "
             "rounded to bf16; op: the op, forward + backward). In brackets: the ratio to the floor.", "",
             "| BT x H x V | chunk | floor | gemms | rounding | op | dW rounding / floor | CE and rest / floor |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [_line(_shape_cells(row)) for row in rows]
    if beside:
        lines += ["", "dW's rounding beside the last chunk's dX GEMM on a second stream (hidden = the share of the "
                  "rounding's time saved against one stream; negative: it cost more):", "",
                  "| V x H, tokens | dX GEMM | rounding | one stream | beside, priority 0 | beside, priority -1 |",
                  "|---|---|---|---|---|---|"]
        lines += [_line(_beside_cells(row)) for row in beside]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_turns_args(__doc__, SHAPES, "the steps are timed with CUDA events at the GPU's power cap",
                            lambda parser: parser.add_argument("--beside", action="store_true",
                                                               help="also time dW's rounding beside a dX GEMM"))
    env = environment()
    rows = []
    for shape in args.shapes:
        rows.append(time_shape(shape, args.rounds))
        print(rows[-1], flush=True)
    beside = [time_beside(v, h, tokens, args.rounds) for v, h, tokens in BESIDE_SHAPES] if args.beside else []
    md = table(env, args.rounds, rows, beside)
    print(md)
    stem = f"floor_gap_{env['gpu'].replace(' ', '_')}{args.tag}"
    save_results(args.out, stem, md, {"env": env, "rounds": args.rounds, "rows": rows, "beside": beside})


if __name__ == "__main__":
    main()
