"""Benchmark: tuned config vs the heuristic default vs Liger, for every shape the tuning DB holds for this GPU.

bf16, forward + backward (dX and dW), median ms from ``triton.testing.do_bench`` with at least 10 timed runs.
Prints a table and writes ``bench_tuning_<gpu>_<time>.json`` and ``.md`` (GPU name, torch/triton versions)
under ``benchmarks/results/`` (or ``--out-dir``).

Targets reported: at tokens=8192, H=2304, V=256000 the tuned config is >= 1.5x faster than the default; the
tuned config is never slower than the default (2% measurement tolerance).

    python benchmarks/bench_tuning.py                    # every DB shape of this GPU (shipped + user)
    python benchmarks/bench_tuning.py --shipped-only --out-dir $OUT
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
from pathlib import Path
from typing import Any, Callable

import torch

TARGET = (256000, 2304, 8192)  # (V, H, tokens) of the 1.5x target
TARGET_SPEEDUP = 1.5
NOT_SLOWER_TOLERANCE = 0.98  # tuned/default speedup below this counts as "slower"


def _liger() -> Callable[..., Any] | None:
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy  # noqa: PLC0415

        def run(x, w, t):
            out = liger_fused_linear_cross_entropy(x, w, t)
            return out[0] if isinstance(out, tuple) else out

        return run
    except Exception:  # noqa: BLE001 - optional comparison
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # noqa: PLC0415

            loss_fn = LigerFusedLinearCrossEntropyLoss()
            return lambda x, w, t: loss_fn(w, x, t)  # Liger's module takes (lin_weight, _input, target)
        except Exception:  # noqa: BLE001
            return None


def _bench(fn: Callable[[], Any], grads: list[torch.Tensor], rep_ms: float) -> float:
    import triton  # noqa: PLC0415

    def step():
        fn().backward()

    step()  # compile / autotune outside the timing
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    estimate = start.elapsed_time(end)
    # do_bench repeats rep_ms / estimate times: make that >= 10 timed runs
    rep = max(rep_ms, 11 * estimate)
    return float(triton.testing.do_bench(step, warmup=max(25, 2 * estimate), rep=rep, grad_to_none=grads,
                                         return_mode="median"))


def _peak_gb(fn: Callable[[], Any], grads: list[torch.Tensor]) -> float:
    for g in grads:
        g.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    for g in grads:
        g.grad = None
    return peak / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shipped-only", action="store_true", help="only shipped entries (ignore the user DB)")
    p.add_argument("--rep-ms", type=float, default=200.0, help="do_bench rep time per measurement (ms)")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--no-liger", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_tuning: needs a CUDA GPU", file=sys.stderr)
        return 2

    import triton  # noqa: PLC0415

    from flce_compile import fused_linear_cross_entropy  # noqa: PLC0415
    from flce_compile.config import heuristic_config  # noqa: PLC0415
    from flce_compile.tuning import db  # noqa: PLC0415

    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name(device)
    kind = db.normalize_device_name(gpu)
    entries = [e for e in db.load_entries(layer="shipped" if args.shipped_only else "merged")
               if e.device == kind and e.dtype == "bf16"]
    liger = None if args.no_liger else _liger()
    print(f"{gpu} ({kind}); torch {torch.__version__}, triton {triton.__version__}; {len(entries)} DB shapes; "
          f"liger {'yes' if liger else 'not available'}")
    rows: list[dict[str, Any]] = []
    for e in entries:
        vocab, hidden, tokens = e.vocab, e.hidden, e.tokens
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16).requires_grad_(True)
        w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).to(device, torch.bfloat16).requires_grad_(True)
        t = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
        default_cfg = heuristic_config(tokens, vocab, hidden, torch.bfloat16, device)
        fns: dict[str, Callable[[], Any]] = {
            "default": lambda c=default_cfg: fused_linear_cross_entropy(x, w, t, config=c),
            "tuned": lambda c=e.config: fused_linear_cross_entropy(x, w, t, config=c),
        }
        if liger is not None:
            fns["liger"] = lambda: liger(x, w, t)
        row: dict[str, Any] = {"vocab": vocab, "hidden": hidden, "tokens": tokens, "tuned_config": e.config.to_dict(),
                               "default_config": default_cfg.to_dict(), "db_ms": e.ms, "db_default_ms": e.default_ms}
        with torch.no_grad():
            losses = {name: float(fn()) for name, fn in fns.items()}
        row["loss"] = losses
        for name, fn in fns.items():
            try:
                row[f"{name}_ms"] = _bench(fn, [x, w], args.rep_ms)
                row[f"{name}_peak_gb"] = _peak_gb(fn, [x, w])
            except Exception as exc:  # noqa: BLE001 - report, go on
                row[f"{name}_ms"] = None
                row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                torch.cuda.empty_cache()
        if row.get("tuned_ms") and row.get("default_ms"):
            row["speedup"] = row["default_ms"] / row["tuned_ms"]
        if row.get("tuned_ms") and row.get("liger_ms"):
            row["vs_liger"] = row["liger_ms"] / row["tuned_ms"]
        rows.append(row)
        print(f"V={vocab} H={hidden} T={tokens}: default {row.get('default_ms')}, tuned {row.get('tuned_ms')}, "
              f"liger {row.get('liger_ms')}", flush=True)
        del x, w, t
        torch.cuda.empty_cache()

    def f(v: Any, spec: str = ".3f") -> str:
        return "-" if v is None else format(v, spec)

    header = ["V", "H", "tokens", "default ms", "tuned ms", "speedup", "liger ms", "tuned vs liger",
              "default GB", "tuned GB", "liger GB"]
    table = [[str(r["vocab"]), str(r["hidden"]), str(r["tokens"]), f(r.get("default_ms")), f(r.get("tuned_ms")),
              f(r.get("speedup"), ".2f") + "x", f(r.get("liger_ms")), f(r.get("vs_liger"), ".2f") + "x",
              f(r.get("default_peak_gb"), ".2f"), f(r.get("tuned_peak_gb"), ".2f"), f(r.get("liger_peak_gb"), ".2f")]
             for r in rows]
    target_row = next((r for r in rows if (r["vocab"], r["hidden"], r["tokens"]) == TARGET), None)
    if target_row is None or target_row.get("speedup") is None:
        target_status = "NOT MEASURED (no DB entry for V=256000 H=2304 tokens=8192 on this GPU)"
    else:
        ok = target_row["speedup"] >= TARGET_SPEEDUP
        target_status = f"{'PASS' if ok else 'FAIL'} ({target_row['speedup']:.2f}x, target >= {TARGET_SPEEDUP}x)"
    slower = [r for r in rows if r.get("speedup") is not None and r["speedup"] < NOT_SLOWER_TOLERANCE]
    never_slower = ("PASS" if not slower else
                    "FAIL: " + ", ".join(f"V={r['vocab']} H={r['hidden']} T={r['tokens']} ({r['speedup']:.2f}x)" for r in slower))
    if not rows:
        never_slower = "NOT MEASURED (no DB entries)"

    widths = [max(len(h), *(len(row[i]) for row in table)) if table else len(h) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "| " + " | ".join("-" * w for w in widths) + " |"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in table]
    print("\n".join(lines))
    print(f"target 8192x2304x256000 tuned >= {TARGET_SPEEDUP}x default: {target_status}")
    print(f"tuned never slower than default (tolerance {NOT_SLOWER_TOLERANCE}): {never_slower}")

    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    meta = {"gpu": gpu, "gpu_kind": kind, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "date": stamp, "dtype": "bf16", "pass": "fwd+bwd",
            "timing": "triton.testing.do_bench median, >= 10 timed runs", "liger": bool(liger)}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    base = args.out_dir / f"bench_tuning_{kind}_{stamp}"
    base.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "target": target_status,
                                                     "never_slower": never_slower}, indent=1) + "\n")
    md = [f"# flce_compile tuning benchmark ({gpu})", "",
          f"torch {torch.__version__}, triton {triton.__version__}, bf16 fwd+bwd, median ms (do_bench), {stamp} UTC", "",
          *lines, "", f"- target 8192x2304x256000 tuned >= {TARGET_SPEEDUP}x default: {target_status}",
          f"- tuned never slower than default: {never_slower}", ""]
    base.with_suffix(".md").write_text("\n".join(md))
    print(f"wrote {base}.json and {base}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
