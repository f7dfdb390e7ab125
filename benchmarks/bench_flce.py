"""Fused linear + cross-entropy, side by side on one GPU: eager, torch.compile, Liger, CCE, PyTorch's native
chunked F.linear_cross_entropy, flce, and the three-GEMM floor. bf16, forward + backward, mean reduction, ~6%
ignored targets.

Prints a table (median ms over CUDA-event timings, peak GB above inputs and gradients, ratio to the floor),
the host (CPU) time to issue one call and the end-to-end time per call at a small, host-sensitive shape
(--small-shape, GPT-2 small's 2048 x 768 x 50304), and the errors of loss, dX and dW against fp64 at one
smaller shape; writes them, with the GPU name and versions, to benchmarks/results/ (and to $OUT when set).

The native peer needs torch >= 2.13; on an older torch, --native-from PATH loads its Python implementation
(torch/nn/modules/linear_cross_entropy.py of a newer torch) at run time, else it is skipped with a note.

    python benchmarks/bench_flce.py [--shapes 16384x4096x128256 ...] [--variants flce eager ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import (  # noqa: E402
    cce_loss, do_bench_ms, eager_loss, liger_loss, make_inputs, native_loss, save_results, versions)
from benchmarks.host_overhead import e2e_ms, host_ms  # noqa: E402
from flce_compile import fused_linear_cross_entropy  # noqa: E402
from flce_compile.plan.layout import padded_row_elements  # noqa: E402

SHAPES = ["16384x4096x128256", "16384x4096x151936", "8192x2304x256000", "4096x768x50257", "65536x4096x128256"]
ERROR_SHAPE = (2048, 4096, 128256)
SMALL_SHAPE = "2048x768x50304"  # GPT-2 small, one micro-batch: where host overhead shows
GB = 1e9


#: Names accepted by --variants (the table shows Liger, CCE, ... under their display names).
VARIANTS = ("eager", "compile", "liger", "cce", "native", "flce", "flce-bf16acc", "flce-streams")
NATIVE = "torch native chunked"


#: Chunks of the error table's extra rows of our variants.
ERROR_CHUNKS = 4


def _flce(config: dict | None = None, **options: Any) -> Callable:
    """Our op as a variant: ``options`` are its keyword arguments, ``config`` its forced config fields."""
    return lambda x, w, t: fused_linear_cross_entropy(x, w, t, config=config, **options)


#: Our variants by --variants name: (table name, keyword arguments of the op).
FLCE_VARIANTS = {"flce": ("flce", {}), "flce-bf16acc": ("flce bf16-acc", {"accum_dtype": torch.bfloat16}),
                 "flce-streams": ("flce streams", {"config": {"streams": True}})}


def variants(selected: list[str], native_from: str | None = None) -> dict[str, Callable]:
    out: dict[str, Callable] = {}
    if "eager" in selected:
        out["eager"] = eager_loss
    if "compile" in selected:
        out["torch.compile"] = torch.compile(eager_loss, dynamic=False)
    if "liger" in selected:
        try:
            out["Liger"] = liger_loss()
        except ImportError:
            print("liger-kernel not installed: skipped")
    if "cce" in selected:
        try:
            out["CCE"] = cce_loss()
        except ImportError:
            print("cut-cross-entropy not installed: skipped")
    if "native" in selected:
        try:
            out[NATIVE] = native_loss(native_from)
        except ImportError as exc:
            print(f"{NATIVE} skipped: {exc}")
    for key, (name, options) in FLCE_VARIANTS.items():  # (streams: the op's own pick with streams on)
        if key in selected:
            out[name] = _flce(**options)
    return out


def time_fwd_bwd(fn, x, w, t) -> tuple[float, float]:
    """(median ms, peak GB above inputs and their gradients) of forward + backward."""
    xg, wg = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()

    def step():
        xg.grad = wg.grad = None
        fn(xg, wg, t).backward()

    step()
    torch.cuda.synchronize()
    xg.grad = wg.grad = None
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    grads = xg.grad.numel() * xg.grad.element_size() + wg.grad.numel() * wg.grad.element_size()
    peak = (torch.cuda.max_memory_allocated() - base - grads) / GB
    ms = do_bench_ms(step, warmup_ms=200, rep_ms=1000)
    return ms, peak


def time_host(fns: dict[str, Callable], shape: str, calls: int = 200) -> dict[str, dict[str, float]]:
    """Per variant at ``shape``: host ms (CPU wall time to issue one forward + backward call on an idle GPU,
    median) and e2e ms (back-to-back calls, CUDA events, per call); see host_overhead.py."""
    n, h, v = (int(s) for s in shape.split("x"))
    x, w, t = make_inputs(n, h, v)
    xg, wg = x.requires_grad_(), w.requires_grad_()
    out = {}
    for name, fn in fns.items():
        def step(fn=fn):
            xg.grad = wg.grad = None
            fn(xg, wg, t).backward()

        try:
            for _ in range(20):
                step()
            out[name] = {"host_ms": host_ms(step, calls, cuda=True), "e2e_ms": e2e_ms(step, calls)}
        except torch.OutOfMemoryError:
            out[name] = {"error": "OOM"}
        print(f"{shape} {name}: {out[name]}", flush=True)
    return out


FLOOR_OPERANDS = ("gradient", "logits")


def time_floor(x, w, t, operand: str = "gradient") -> float:
    """The three GEMMs at V rounded up to 128 bytes (zero rows change no result, so an exact FLCE may run
    them; at an odd V the unpadded GEMMs get misaligned operands and run 3-4x slower): the logits, then dX and dW
    from the loss's own logit gradient (``logit_gradient``), the operand an exact FLCE's dX and dW GEMMs read.
    Until 2026-12-06 they read the logits instead (``operand="logits"``, kept for ``floor_operand.py``'s A/B:
    about N(0, 1) values where the gradient's are small, positive and sparse): the op's own GEMM kernels summed
    to 0.92-0.95x that floor in a profile on the H200, so a GPU at its power cap ran the floor's GEMMs slower than
    the op's."""
    if operand not in FLOOR_OPERANDS:
        raise ValueError(f"operand={operand!r}: expected one of {FLOOR_OPERANDS}")
    v_padded = padded_row_elements(w.shape[0], x.element_size())
    w_padded = F.pad(w, (0, 0, 0, v_padded - w.shape[0]))  # zero rows appended
    logits = torch.empty(x.shape[0], v_padded, device="cuda", dtype=x.dtype)
    grad = logit_gradient(x, w, t, v_padded) if operand == "gradient" else logits
    return do_bench_ms(floor_gemms(x, w_padded, grad, logits), warmup_ms=200, rep_ms=1000)


def floor_gemms(x: torch.Tensor, w_padded: torch.Tensor, operand: torch.Tensor,
                logits: torch.Tensor) -> Callable[[], None]:
    """The floor's three GEMMs as one step: the logits into ``logits``, then dX and dW on ``operand`` (N, Vp)."""

    def gemms() -> None:
        torch.mm(x, w_padded.T, out=logits)
        torch.mm(operand, w_padded)
        torch.mm(operand.T, x)

    return gemms


def logit_gradient(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, v_padded: int,
                   rows: int = 4096) -> torch.Tensor:
    """d(mean cross-entropy)/d(logits) of ``F.linear(x, w)`` against ``t`` (-100 ignored): (softmax - one_hot) /
    valid tokens, zero on ignored rows and on the padded columns up to ``v_padded``, in x's dtype; formed
    ``rows`` tokens at a time (an fp32 copy of every token's logits would not fit beside the rest at 65536
    tokens)."""
    vocab = w.shape[0]
    grad = torch.zeros(x.shape[0], v_padded, device=x.device, dtype=x.dtype)
    valid = (t != -100).sum().clamp_min(1)
    for start in range(0, x.shape[0], rows):
        p = torch.softmax(torch.mm(x[start:start + rows], w.T).float(), dim=-1)
        target = t[start:start + rows]
        kept = target != -100
        p[kept.nonzero().squeeze(1), target[kept]] -= 1
        p[~kept] = 0
        grad[start:start + rows, :vocab] = (p / valid).to(x.dtype)
    return grad


def time_against_floor(fn, x, w, t, turns: int = 1) -> dict[str, Any]:
    """A variant's ms, peak GB and ratio to the floor, with the floor timed right before the variant in each of
    ``turns`` rounds. Timed once before all of a shape's variants, the floor left torch.compile's ratio (its code
    unchanged) up to 3.3% apart between two commands (at bcd8e04 and a6470cd, 2026-12-04), more than issue #13's
    targets leave; timings taken back to back are less exposed to the GPU's drift within a command. ms, floor_ms
    and x_floor are medians over the rounds, x_floor of the rounds' own ratios."""
    if turns < 1:
        raise ValueError(f"turns={turns} must be at least 1")
    times, floors, ratios, gbs = [], [], [], []
    for _ in range(turns):
        floor = time_floor(x, w, t)
        ms, gb = time_fwd_bwd(fn, x, w, t)
        times.append(ms)
        floors.append(floor)
        ratios.append(ms / floor)
        gbs.append(gb)
    # GB of the first round: a later round's baseline can hold what earlier rounds left cached (flce's CUDA graphs
    # of their fresh weight copies, say); a turns run read -0.083 GB from its last round at GPT-2's shape.
    return {"ms": statistics.median(times), "gb": gbs[0], "floor_ms": statistics.median(floors),
            "x_floor": statistics.median(ratios), "turns": turns, "round_ratios": ratios}


def time_shape(shape: str, fns: dict[str, Callable], x, w, t, turns: int) -> dict[str, Any]:
    """One shape's row: each variant against its own floor (``time_against_floor``), an OOM noted as the
    variant's result; the row's floor_ms is the median of the variants' floors (the table's floor column)."""
    row: dict[str, Any] = {"shape": shape, "floor_ms": None, "results": {}}
    for name, fn in fns.items():
        try:
            row["results"][name] = time_against_floor(fn, x, w, t, turns)
        except torch.OutOfMemoryError:
            row["results"][name] = {"error": "OOM"}
        torch.cuda.empty_cache()
    floors = [r["floor_ms"] for r in row["results"].values() if "floor_ms" in r]
    row["floor_ms"] = statistics.median(floors) if floors else time_floor(x, w, t)
    return row


def errors(fns: dict[str, Callable]) -> dict[str, dict[str, float]]:
    """Relative Frobenius errors of loss, dX, dW against fp64, bf16 inputs with a peaky softmax. Each of our
    variants also in 4 chunks (``ERROR_CHUNKS``): at the error shape's 2048 tokens the op's own config runs one
    chunk, where the timed shapes run several, whose dW sums across chunks a bf16 accumulator rounds (a review
    found the bf16-accumulation row equal to the exact one's for that reason)."""
    n, h, v = ERROR_SHAPE
    for name, options in FLCE_VARIANTS.values():
        if name in fns:
            config = {**options.get("config", {}), "chunk_tokens": n // ERROR_CHUNKS}
            fns = {**fns, f"{name}, {ERROR_CHUNKS} chunks": _flce(**{**options, "config": config})}
    x, w, t = make_inputs(n, h, v, seed=1, peaky=4.0)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    ref = F.cross_entropy(x64 @ w64.T, t)
    ref.backward()
    out = {}
    for name, fn in fns.items():
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(xg, wg, t)
        loss.backward()
        rel = lambda a, r: float((a.double() - r).norm() / r.norm())  # noqa: E731
        out[name] = {"loss": abs(float(loss) - float(ref)) / abs(float(ref)), "dX": rel(xg.grad, x64.grad),
                     "dW": rel(wg.grad, w64.grad)}
        del xg, wg, loss
    return out


def environment() -> dict[str, str]:
    return {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), **versions()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=SHAPES)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--skip-eager-above", type=int, default=40_000, help="tokens above which eager and "
                        "torch.compile are skipped (their logits no longer fit)")
    parser.add_argument("--flce-configs", nargs="*", default=[], metavar="JSON",
                        help='extra flce variants with forced config fields, e.g. \'{"chunk_tokens": 2048}\'')
    parser.add_argument("--no-errors", action="store_true")
    parser.add_argument("--small-shape", default=SMALL_SHAPE, help="shape of the host / end-to-end columns")
    parser.add_argument("--no-host", action="store_true", help="skip the host / end-to-end columns")
    parser.add_argument("--native-from", metavar="PATH", help="load PyTorch's native chunked linear_cross_entropy "
                        "from this file (torch/nn/modules/linear_cross_entropy.py of torch >= 2.13) when the "
                        "installed torch lacks it")
    parser.add_argument("--turns", type=int, default=1, help="rounds of (floor, variant) timed back to back per "
                        "variant; its ratio to the floor is the median of the rounds' ratios")
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    args = parser.parse_args()
    if args.turns < 1:
        parser.error(f"--turns {args.turns}: must be at least 1")
    if not torch.cuda.is_available():
        sys.exit("bench_flce.py needs a CUDA GPU")
    fns = variants(args.variants, args.native_from)
    for text in args.flce_configs:
        fields = json.loads(text)
        accum = torch.bfloat16 if fields.pop("accum", "fp32") == "bf16" else torch.float32

        def forced(x, w, t, fields=fields, accum=accum):  # fields laid over the op's own pick
            return fused_linear_cross_entropy(x, w, t, accum_dtype=accum, config=fields)

        fns[f"flce {text}"] = forced
    env = environment()
    stem = f"bench_flce_{env['gpu'].replace(' ', '_')}{args.tag}"
    rows: list[dict] = []
    for shape in args.shapes:
        n, h, v = (int(s) for s in shape.split("x"))
        x, w, t = make_inputs(n, h, v)
        skip = ("eager", "torch.compile") if n > args.skip_eager_above else ()
        row = time_shape(shape, {k: f for k, f in fns.items() if k not in skip}, x, w, t, args.turns)
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_results(stem, env, list(fns), rows, {})  # after every shape: a cut-short run keeps its rows
        del x, w, t
        torch.cuda.empty_cache()
    host = {} if args.no_host else {"shape": args.small_shape, "results": time_host(fns, args.small_shape)}
    write_results(stem, env, list(fns), rows, {}, host)
    errs = {} if args.no_errors else errors({k: v for k, v in fns.items()})
    print(write_results(stem, env, list(fns), rows, errs, host))


def write_results(stem: str, env: dict, names: list[str], rows: list[dict], errs: dict, host: dict | None = None
                  ) -> str:
    """Write the markdown table and the JSON under benchmarks/results/ (and $OUT when set); return the table."""
    lines = [f"# bench_flce: {env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date']}", "",
             "bf16 forward + backward, mean, ~6% ignored. ms = median (CUDA events), GB = peak above inputs "
             "and grads, xF = ratio to the 3-GEMM floor (dX and dW from the loss's own logit gradient) timed right "
             "before the variant (with turns, the median of "
             "the rounds' ratios); floor ms = the median of the shape's floors.", "",
             "| BT x H x V | floor ms | " + " | ".join(names) + " |",
             "|---|---|" + "---|" * len(names)]
    for row in rows:
        cells = []
        for name in names:
            r = row["results"].get(name)
            cells.append("-" if r is None else r.get("error") or f"{r['ms']:.1f} / {r['gb']:.3f} / {r['x_floor']:.2f}x")
        lines.append(f"| {row['shape']} | {row['floor_ms']:.1f} | " + " | ".join(cells) + " |")
    if host:
        lines += ["", f"Host and end-to-end time per forward + backward call at {host['shape']} (host = CPU wall "
                  "time to issue one call on an idle GPU, median; e2e = back-to-back calls, CUDA events):", "",
                  "| variant | host ms | e2e ms |", "|---|---|---|"]
        for name in names:
            r = host["results"].get(name)
            cells = "- | -" if r is None else (r["error"] + " | -" if "error" in r else
                                               f"{r['host_ms']:.3f} | {r['e2e_ms']:.3f}")
            lines.append(f"| {name} | {cells} |")
    if errs:
        lines += ["", f"Relative error vs fp64 at {'x'.join(map(str, ERROR_SHAPE))} (peaky softmax):", "",
                  "| variant | loss | dX | dW |", "|---|---|---|---|"]
        lines += [f"| {k} | {e['loss']:.2e} | {e['dX']:.2e} | {e['dW']:.2e} |" for k, e in errs.items()]
    table = "\n".join(lines)
    save_results(Path(__file__).parent / "results", stem, table + "\n",
                 {"env": env, "rows": rows, "errors": errs, "host": host or {}})
    return table


if __name__ == "__main__":
    main()
