"""Curves of the fused linear + cross-entropy against its peers, drawn with matplotlib (Agg).

1. Peak memory and forward + backward time against the token count, at the Llama-3 (V 128256, H 4096) and
   GPT-2 (V 50257, H 768) shapes, for: eager (F.linear + F.cross_entropy), torch.compile of it, a chunked-CE
   baseline that keeps every chunk's autograd graph until backward, Liger and CCE (when importable),
   PyTorch's native chunked ``F.linear_cross_entropy`` (when this torch has it), and ours with each registered
   strategy (``flce_compile.plan.registry.names()``) that works on the device (one that raises is skipped with a
   note).
2. Peak memory (and time) against the number of chunks at a fixed token count, at the first shape: chunked
   CE against ours, ours forced with ``config={"chunk_tokens": tokens // chunks}``.
3. The end-to-end training step of benchmarks/bench_e2e.py as bars (peak GB and step ms per variant, per
   sequence length), from its results JSON: by default the newest run under benchmarks/results/ (the files
   that share the newest file's environment: a run split over several commands), or the files given by --e2e.

    python benchmarks/plot_curves.py                    # GPU: bf16, 2K-64K tokens (3-5 min on an H200, estimated)
    python benchmarks/plot_curves.py --device cpu       # CPU: fp32, one thread, V 4096/H 256 and V 2048/H 128,
                                                        # 256-2048 tokens, ours in 256-token chunks (50 s)
    python benchmarks/plot_curves.py --from-csv benchmarks/results/curves_h200.csv   # redraw, no measuring

Writes under benchmarks/results/ (or --out-dir), and also under $OUT when set (<kind> is the GPU kind,
e.g. h200, or cpu):

    curves_<kind>.csv           every measured row: sweep, shape, tokens, chunks, variant, status (ok, skipped,
                                OOM, error) with its reason, peak GB, median ms, how peak and time were measured
    curves_<kind>.json          the environment: device name, torch / triton / Python / peer versions, methods
    curves_<kind>_tokens.png    peak memory and time against tokens, one row per shape
    curves_<kind>_chunks.png    peak memory and time against the number of chunks (first shape)
    e2e_<gpu kind>.png          the e2e step, named after the GPU the e2e JSON was measured on

Peak memory is the peak above the inputs and the returned dX/dW: on the GPU torch.cuda.max_memory_allocated
minus what was allocated before the step; on the CPU the torch.profiler allocation records (profile_memory)
replayed in time order. Time: CUDA events on the GPU, time.perf_counter on the CPU; the median of a few runs
after warm-up. Inputs are random, ~6% of the targets -100. A variant that runs out of memory or raises is
recorded in the CSV and left out of the plot. Without matplotlib the CSV is still written (redraw later with
--from-csv).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import functools
import gc
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._common import (  # noqa: E402
    LossFn, cce_loss, eager_loss, liger_loss, make_inputs, median_ms, output_dirs, step_peak_bytes, versions)
from flce_compile import fused_linear_cross_entropy  # noqa: E402
from flce_compile.plan import registry  # noqa: E402
from flce_compile.plan.choose import resolve_config  # noqa: E402
from flce_compile.plan.config import config_overrides  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
GB = 1e9
FIELDS = ("sweep", "shape", "vocab", "hidden", "tokens", "chunks", "variant", "status", "reason", "peak_gb", "ms",
          "peak_method", "time_method")
#: A strategy that fails its probe gets this hint after the error.
STRATEGY_HINTS = {"triton": "needs a CUDA GPU, or TRITON_INTERPRET=1 on the CPU"}


class Unavailable(Exception):
    """A variant that cannot run here (not installed, not in this torch, fails on this device)."""


@dataclass(frozen=True)
class Shape:
    name: str
    vocab: int
    hidden: int


@dataclass(frozen=True)
class Sweep:
    """What one run measures; the defaults per device are in SWEEPS, the command line overrides them."""

    shapes: tuple[Shape, ...]
    tokens: tuple[int, ...]
    chunk_sweep_tokens: int  # the fixed token count of the chunk sweep
    chunks: tuple[int, ...]
    ce_chunks: int  # chunks of the chunked-CE baseline in the token sweep
    flce_chunk_tokens: int | None  # ours' tokens per chunk in the token sweep; None: the op's own pick
    dtype: torch.dtype
    warmup: int
    reps: int


SWEEPS = {
    "cuda": Sweep(shapes=(Shape("Llama-3", 128256, 4096), Shape("GPT-2", 50257, 768)),
                  tokens=(2048, 4096, 8192, 16384, 32768, 65536), chunk_sweep_tokens=16384,
                  chunks=(1, 2, 4, 8, 16, 32), ce_chunks=8, flce_chunk_tokens=None, dtype=torch.bfloat16,
                  warmup=1, reps=5),
    # fp32: bf16 GEMMs on a CPU without bf16 units ran 15x slower than fp32 ones here (6.4 s vs 0.4 s a step).
    # Ours with 256-token chunks: its CPU default (64 MiB of logits a chunk) is one chunk at these sizes.
    "cpu": Sweep(shapes=(Shape("Llama-3-like", 4096, 256), Shape("GPT-2-like", 2048, 128)),
                 tokens=(256, 512, 1024, 2048), chunk_sweep_tokens=1024, chunks=(1, 2, 4, 8, 16), ce_chunks=8,
                 flce_chunk_tokens=256, dtype=torch.float32, warmup=1, reps=3),
}
#: CPU threads: one, as the CPU runs share two cores with other jobs (two threads under that load ran slower
#: and no steadier).
CPU_THREADS = 1


# ---------------------------------------------------------------------------------------------------------
# The variants
# ---------------------------------------------------------------------------------------------------------


def chunked_ce_loss(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, chunks: int) -> torch.Tensor:
    """Cross-entropy over token chunks, written plainly: every chunk's graph (its fp32 log-softmax) is kept
    until backward, so however many chunks, the peak stays above one fp32 copy of all the logits (only the
    per-chunk temporaries shrink)."""
    loss = torch.zeros((), device=x.device, dtype=torch.float32)
    for x_c, t_c in zip(x.tensor_split(chunks), t.tensor_split(chunks)):
        logits = x_c @ w.T
        loss = loss + F.cross_entropy(logits.float(), t_c, ignore_index=-100, reduction="sum")
    return loss / (t != -100).sum()


def compiled_eager_loss() -> LossFn:
    """torch.compile of the eager loss, the token dimension marked dynamic: one compile per shape (V, H) for
    the whole token sweep instead of one per token count; the kernels stay specialised to V and H."""
    compiled = torch.compile(eager_loss)

    def run(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        torch._dynamo.maybe_mark_dynamic(x, 0)
        torch._dynamo.maybe_mark_dynamic(t, 0)
        return compiled(x, w, t)

    return run


def native_loss() -> LossFn:
    """PyTorch's chunked ``F.linear_cross_entropy`` with default ``LinearCrossEntropyOptions`` (torch >= 2.13;
    ``options=None`` would be its unchunked reference path)."""
    fn = getattr(F, "linear_cross_entropy", None)
    options_cls = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if fn is None or options_cls is None:
        raise Unavailable(f"torch {torch.__version__} has no F.linear_cross_entropy")
    options = options_cls()
    return lambda x, w, t: fn(x, w, t, options=options)


def flce_loss(config: dict[str, Any]) -> LossFn:
    """Our op with ``config`` fields forced (the rest: tuning DB or heuristic, as users get it)."""
    return lambda x, w, t: fused_linear_cross_entropy(x, w, t, config=config)


def probed_strategy(config: dict[str, Any], device: str) -> LossFn:
    """Our op with ``config`` (a strategy, maybe a chunk size) forced, after one tiny fwd+bwd on ``device``;
    raises Unavailable if that fails."""
    fn = flce_loss(config)
    x, w, t = make_inputs(256, 128, 1024, device=device, dtype=SWEEPS[device].dtype)
    try:
        fn(x.requires_grad_(), w.requires_grad_(), t).backward()
    except Exception as exc:  # noqa: BLE001 - any failure means: not on this device
        hint = STRATEGY_HINTS.get(config["strategy"])
        raise Unavailable(f"raised {type(exc).__name__}: {first_line(exc)}" + (f" ({hint})" if hint else "")) from exc
    return fn


def flce_config(strategy: str, sweep: Sweep) -> dict[str, Any]:
    """The fields forced on our op in the token sweep."""
    return {"strategy": strategy, **({"chunk_tokens": sweep.flce_chunk_tokens} if sweep.flce_chunk_tokens else {})}


def variant_makers(device: str, sweep: Sweep) -> dict[str, Callable[[], LossFn]]:
    """Every variant by name, as a function that builds it or raises Unavailable / ImportError."""
    makers: dict[str, Callable[[], LossFn]] = {
        "eager": lambda: eager_loss,
        "torch.compile": compiled_eager_loss,
        "chunked-ce": lambda: functools.partial(chunked_ce_loss, chunks=sweep.ce_chunks),
        "liger": liger_loss,
        "cce": cce_loss,
        "torch-native": native_loss,
    }
    for strategy in registry.names():  # read at run time: a new strategy shows up here by itself
        makers[f"flce-{strategy}"] = functools.partial(probed_strategy, flce_config(strategy, sweep), device)
    return makers


def build_variants(device: str, sweep: Sweep, wanted: Sequence[str] | None) -> tuple[dict[str, LossFn], dict[str, str]]:
    """(the variants that run, by name; the skipped ones -> why)."""
    ready: dict[str, LossFn] = {}
    skipped: dict[str, str] = {}
    for name, make in variant_makers(device, sweep).items():
        if wanted is not None and name not in wanted:
            continue
        try:
            ready[name] = make()
        except (Unavailable, ImportError) as exc:
            skipped[name] = f"not importable: {exc}" if isinstance(exc, ImportError) else str(exc)
    return ready, skipped


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


# ---------------------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def silenced_stderr() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null: the profiler's C++ side prints a start/stop line per profile."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def cpu_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op CPU threads set to ``threads`` (None: left alone) inside the block, restored after."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def returned_bytes(params: Sequence[torch.Tensor]) -> int:
    return sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)


def peak_bytes_above_inputs(step: Callable[[], None], params: Sequence[torch.Tensor]) -> int:
    """Peak bytes of one warm ``step`` above the memory allocated before it and the gradients it returns."""
    for p in params:
        p.grad = None
    gc.collect()
    device = params[0].device
    with silenced_stderr() if device.type != "cuda" else contextlib.nullcontext():  # the profiler's lines
        peak = step_peak_bytes(step, device)
    return peak - returned_bytes(params)


def measure(fn: LossFn, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], sweep: Sweep) -> dict[str, Any]:
    """{"status": "ok", "peak_gb", "ms"} of forward + backward, or {"status": "OOM" | "error", "reason"}."""
    x, w, t = inputs
    xg, wg = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()

    def step() -> None:
        xg.grad = wg.grad = None
        fn(xg, wg, t).backward()

    try:
        for _ in range(sweep.warmup):
            step()
        peak = peak_bytes_above_inputs(step, [xg, wg])
        ms = median_ms(step, sweep.reps, x.device.type)
        return {"status": "ok", "peak_gb": peak / GB, "ms": ms}
    except torch.OutOfMemoryError as exc:
        return {"status": "OOM", "reason": first_line(exc)}
    except Exception as exc:  # noqa: BLE001 - a failing variant is a result, not the end of the run
        return {"status": "error", "reason": f"{type(exc).__name__}: {first_line(exc)}"}
    finally:
        del xg, wg
        if x.device.type == "cuda":  # give the next variant the memory back (a collection takes ~0.1 s)
            gc.collect()
            torch.cuda.empty_cache()


def flce_chunks(config: dict[str, Any], tokens: int, shape: Shape, sweep: Sweep, device: str) -> int:
    """How many chunks our op runs at this size with these forced fields (its own pick for the rest)."""
    chosen, _ = resolve_config(config_overrides(config), tokens, shape.vocab, shape.hidden, sweep.dtype,
                               torch.device(device))
    return math.ceil(tokens / chosen.chunk_tokens)


# ---------------------------------------------------------------------------------------------------------
# The sweeps
# ---------------------------------------------------------------------------------------------------------


def token_sweep(shape: Shape, fns: dict[str, LossFn], sweep: Sweep, device: str) -> Iterator[dict[str, Any]]:
    """Rows of every variant at every token count; a variant that ran out of memory is not tried larger."""
    oom_at: dict[str, int] = {}
    for tokens in sweep.tokens:
        inputs = make_inputs(tokens, shape.hidden, shape.vocab, device=device, dtype=sweep.dtype)
        for name, fn in fns.items():
            row = {"sweep": "tokens", "shape": shape.name, "vocab": shape.vocab, "hidden": shape.hidden,
                   "tokens": tokens, "variant": name, "chunks": None}
            if name == "chunked-ce":
                row["chunks"] = sweep.ce_chunks
            elif name.startswith("flce-"):
                row["chunks"] = flce_chunks(flce_config(name[5:], sweep), tokens, shape, sweep, device)
            if name in oom_at:
                yield {**row, "status": "OOM", "reason": f"not run: out of memory at {oom_at[name]} tokens"}
                continue
            result = measure(fn, inputs, sweep)
            if result["status"] == "OOM":
                oom_at[name] = tokens
            yield {**row, **result}
        del inputs


def chunk_sweep(shape: Shape, sweep: Sweep, device: str) -> Iterator[dict[str, Any]]:
    """Rows of chunked CE and of our op (its own strategy, forced chunk size) at each chunk count."""
    tokens = sweep.chunk_sweep_tokens
    inputs = make_inputs(tokens, shape.hidden, shape.vocab, device=device, dtype=sweep.dtype)
    for chunks in sweep.chunks:
        forced = {"chunk_tokens": max(1, tokens // chunks)}
        fns = {"chunked-ce": functools.partial(chunked_ce_loss, chunks=chunks), "flce": flce_loss(forced)}
        for name, fn in fns.items():
            row = {"sweep": "chunks", "shape": shape.name, "vocab": shape.vocab, "hidden": shape.hidden,
                   "tokens": tokens, "variant": name,
                   "chunks": chunks if name == "chunked-ce" else flce_chunks(forced, tokens, shape, sweep, device)}
            yield {**row, **measure(fn, inputs, sweep)}


def skipped_rows(shapes: Sequence[Shape], skipped: dict[str, str]) -> list[dict[str, Any]]:
    return [{"sweep": "tokens", "shape": s.name, "vocab": s.vocab, "hidden": s.hidden, "variant": name,
             "status": "skipped", "reason": reason} for s in shapes for name, reason in skipped.items()]


# ---------------------------------------------------------------------------------------------------------
# Environment and files
# ---------------------------------------------------------------------------------------------------------


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_kind(device: str) -> str:
    if device == "cpu":
        return "cpu"
    from flce_compile.tuning.db import normalize_device_name

    return normalize_device_name(torch.cuda.get_device_name())


def methods(device: str, sweep: Sweep) -> dict[str, str]:
    runs = f"median of {sweep.reps} runs after {sweep.warmup} warm-up"
    if device == "cuda":
        return {"peak_method": "torch.cuda.max_memory_allocated above the inputs and the returned dX/dW",
                "time_method": f"CUDA events, {runs}"}
    return {"peak_method": "torch.profiler allocation records replayed, above the inputs and the returned dX/dW",
            "time_method": f"time.perf_counter, {runs}"}


def environment(device: str, sweep: Sweep) -> dict[str, Any]:
    threads = torch.get_num_threads()
    name = torch.cuda.get_device_name() if device == "cuda" else f"{cpu_name()}, {threads} thread{'s' * (threads != 1)}"
    return {"device": name, "kind": device_kind(device), **versions(), "dtype": str(sweep.dtype).removeprefix("torch."),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), **methods(device, sweep),
            "ignored_targets": "~6% = -100", "ce_chunks": sweep.ce_chunks, "flce_chunk_tokens": sweep.flce_chunk_tokens,
            "load_average_at_start": [round(v, 2) for v in os.getloadavg()]}


def write_rows(rows: Sequence[dict[str, Any]], env: dict[str, Any], out_dir: Path) -> Path:
    """curves_<kind>.csv and the curves_<kind>.json sidecar in every output folder; returns the CSV path."""
    for folder in output_dirs(out_dir):
        with open(folder / f"curves_{env['kind']}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
            writer.writeheader()
            for row in rows:
                writer.writerow({**{k: env.get(k, "") for k in ("peak_method", "time_method")}, **row})
        (folder / f"curves_{env['kind']}.json").write_text(json.dumps(env, indent=1) + "\n")
    return out_dir / f"curves_{env['kind']}.csv"


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a curves CSV, numbers parsed back."""
    numeric = {"vocab": int, "hidden": int, "tokens": int, "chunks": int, "peak_gb": float, "ms": float}
    with open(path, newline="") as f:
        return [{k: (numeric[k](v) if k in numeric and v not in ("", None) else (v or None)) for k, v in row.items()}
                for row in csv.DictReader(f)]


# ---------------------------------------------------------------------------------------------------------
# The end-to-end results
# ---------------------------------------------------------------------------------------------------------


def load_e2e(path: Path) -> dict[str, Any] | None:
    """A bench_e2e results payload ({"env", "rows"}), or None when the file is something else."""
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(payload, dict) and isinstance(payload.get("env"), dict) and isinstance(payload.get("rows"), list)
    return payload if ok and all({"variant", "seq", "status"} <= set(r) for r in payload["rows"]) else None


def file_time(path: Path) -> float:
    """When the file was last committed (its git history), else its modification time."""
    try:
        out = subprocess.run(["git", "-C", str(path.parent), "log", "-1", "--format=%ct", "--", path.name],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        if out:
            return float(out)
    except (OSError, subprocess.SubprocessError):
        pass
    return path.stat().st_mtime


def newest_e2e_run(folder: Path, kind: str | None) -> list[Path]:
    """The files of the newest e2e run in ``folder``: the newest e2e JSON (of GPU ``kind`` when there is one)
    and every other with the same environment (bench_e2e runs are split over commands by time limits)."""
    from flce_compile.tuning.db import normalize_device_name

    found = {p: e for p in sorted(set(folder.glob("bench_e2e*.json")) | set(folder.glob("e2e-*.json")))
             if (e := load_e2e(p)) is not None}
    same_kind = {p: e for p, e in found.items() if normalize_device_name(e["env"].get("gpu") or "?") == kind}
    found = same_kind or found
    if not found:
        return []
    newest = max(found, key=lambda p: (file_time(p), p.name))
    return sorted((p for p, e in found.items() if e["env"] == found[newest]["env"]), key=file_time)


def merged_e2e(paths: Sequence[Path]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the first file's env, the rows of all files; a later file's row replaces an earlier one's)."""
    env: dict[str, Any] = {}
    rows: dict[tuple[str, int, str], dict[str, Any]] = {}
    for path in paths:
        payload = load_e2e(path)
        if payload is None:
            raise ValueError(f"{path} is not a bench_e2e results JSON (needs 'env' and 'rows' with variant/seq/status)")
        env = env or payload["env"]
        rows.update({(r["variant"], r["seq"], r.get("mask", "as-is")): r for r in payload["rows"]})
    return env, list(rows.values())


# ---------------------------------------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------------------------------------


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (the one place the benchmarks import matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


LABELS = {"eager": "eager (F.linear + F.cross_entropy)", "torch.compile": "torch.compile(eager)",
          "chunked-ce": "chunked CE (graphs kept)", "liger": "Liger FLCE", "cce": "CCE",
          "torch-native": "torch native F.linear_cross_entropy", "flce": "flce (ours), chunk_tokens = tokens / chunks"}
#: tab10 colour slots, so a variant keeps its colour across figures (ours: purple, pink); others take 8, 7, ...
COLOUR_SLOTS = {"eager": 0, "torch.compile": 1, "chunked-ce": 2, "torch-native": 3, "flce": 4, "flce-triton": 4,
                "liger": 5, "flce-torch": 6, "cce": 9}
#: Names of bench_e2e's variants on the bars.
E2E_LABELS = {"inductor": "inductor (torch.compile)", "dynamo-eager": 'torch.compile(backend="eager")',
              "liger-flce": "Liger FLCE only (eager)", "liger": "Liger default patch (eager)",
              "flce": 'backend="flce", no options (ours; logits kept)',
              "flce-drop": 'backend="flce", flce.logits="drop" (ours)',
              "flce-drop-chunk1024": 'flce, logits dropped, 1024-token chunks',
              "flce-inductor": "flce + inductor (ours)", "flce-aot_eager": "flce + aot_eager (ours)",
              "flce-eager": "flce + dynamo eager (ours)", "flce-inductor-chunk1024": "flce + inductor, 1024-token chunks"}


def label(variant: str, env: dict[str, Any], sweep: str) -> str:
    if variant == "chunked-ce" and sweep == "tokens" and env.get("ce_chunks"):
        return f"chunked CE, {env['ce_chunks']} chunks (graphs kept)"
    if variant.startswith("flce-"):
        chunking = f", {env['flce_chunk_tokens']}-token chunks" if env.get("flce_chunk_tokens") else ", own config"
        return f"flce (ours), strategy {variant[5:]}{chunking}"
    return LABELS.get(variant, variant)


def style(variant: str, order: Sequence[str]) -> dict[str, Any]:
    """One colour per variant across panels and figures; ours drawn thicker."""
    import matplotlib

    colours = matplotlib.colormaps["tab10"].colors
    others = [v for v in order if v not in COLOUR_SLOTS]
    slot = COLOUR_SLOTS[variant] if variant in COLOUR_SLOTS else 8 - others.index(variant)
    ours = variant.startswith("flce")
    return {"color": colours[slot % len(colours)], "linewidth": 2.6 if ours else 1.4,
            "marker": "o" if ours else "s", "markersize": 5 if ours else 4}


def token_label(n: float, _pos: Any = None) -> str:
    return f"{n / 1024:g}K" if n >= 1024 else f"{n:g}"


def format_axes(ax: Any, xs: Sequence[int], xlabel: str, ylabel: str, tokens_axis: bool) -> None:
    """Log-2 x axis with a tick at each measured point; a log y axis (1-2-5 ticks, plain numbers) when the
    values span more than a decade, else a linear one. Call after plotting."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter, NullLocator

    plain = FuncFormatter(lambda v, _pos: f"{v:g}")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sorted(set(xs))))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(token_label) if tokens_axis else plain)
    low, high = (min(line.get_ydata()) for line in ax.get_lines()), (max(line.get_ydata()) for line in ax.get_lines())
    low, high = min(low, default=1.0), max(high, default=1.0)
    if high > 10 * low:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(NullFormatter())
        ylabel += ", log scale"
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)


def plotted(rows: Sequence[dict[str, Any]], sweep: str, shape: str, variant: str, x: str, y: str) -> tuple[list, list]:
    """(xs, ys) of the ok rows of one curve, positive values only (log axes)."""
    points = sorted((r[x], r[y]) for r in rows if r["sweep"] == sweep and r["shape"] == shape
                    and r["variant"] == variant and r["status"] == "ok" and r.get(y) is not None and r[y] > 0)
    return [p[0] for p in points], [p[1] for p in points]


def title(env: dict[str, Any], what: str) -> str:
    versions_text = ", ".join(f"{k} {env[k]}" for k in ("torch", "triton") if env.get(k))
    return (f"{what}: {env['device']}, {versions_text}, {env['dtype']}, fwd+bwd, mean loss\n"
            f"peak: {env['peak_method']}; time: {env['time_method']}")


def draw_curves(all_rows: Sequence[dict[str, Any]], env: dict[str, Any], sweep: str, path: Path) -> Path | None:
    """Peak memory (left) and time (right) against tokens or chunks, one row per shape."""
    plt = pyplot()
    rows = [r for r in all_rows if r["sweep"] == sweep]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows if r["status"] == "ok"))
    if not shapes or not variants:
        return None
    x = "tokens" if sweep == "tokens" else "chunks"
    xlabel = "tokens (BT)" if sweep == "tokens" else "number of chunks (ours: chunk_tokens = tokens / chunks)"
    fig, axes = plt.subplots(len(shapes), 2, figsize=(13, 1.6 + 4.2 * len(shapes)), squeeze=False)
    for row_index, shape in enumerate(shapes):
        first = next(r for r in rows if r["shape"] == shape)
        heading = f"{shape} (V {first['vocab']}, H {first['hidden']})"
        if sweep == "chunks":
            heading += f", {first['tokens']} tokens"
        for col, (y, ylabel) in enumerate((("peak_gb", "peak memory above inputs and grads (GB)"),
                                           ("ms", "fwd+bwd time, median (ms)"))):
            ax = axes[row_index][col]
            xs_all: list[int] = []
            for variant in variants:
                xs, ys = plotted(rows, sweep, shape, variant, x, y)
                if xs:
                    ax.plot(xs, ys, label=label(variant, env, sweep), **style(variant, variants))
                    xs_all += xs
            reference = eager_value(all_rows, shape, first["tokens"], y) if sweep == "chunks" else None
            if reference:
                ax.axhline(reference, color="grey", linestyle="--", linewidth=1,
                           label=f"eager at {token_label(first['tokens'])} tokens (token sweep)")
            format_axes(ax, xs_all or [1], xlabel, ylabel, tokens_axis=sweep == "tokens")
            ax.set_title(heading, fontsize=10)
    legend = {lab: h for ax in axes.flat for h, lab in zip(*ax.get_legend_handles_labels())}
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=min(3, len(legend)), fontsize=9,
               frameon=False)
    what = "Fused linear + cross-entropy vs tokens" if sweep == "tokens" else "Chunked CE vs ours by number of chunks"
    fig.suptitle(title(env, what), fontsize=10)
    legend_rows = math.ceil(len(legend) / 3)
    fig.tight_layout(rect=(0, (0.1 + 0.22 * legend_rows) / fig.get_figheight(), 1,
                           1 - 0.55 / fig.get_figheight()))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def eager_value(rows: Sequence[dict[str, Any]], shape: str, tokens: int, y: str) -> float | None:
    """Eager's measured ``y`` at this shape and token count in the token sweep, if any."""
    return next((r[y] for r in rows if r["sweep"] == "tokens" and r["shape"] == shape and r["variant"] == "eager"
                 and r["tokens"] == tokens and r["status"] == "ok"), None)


def draw_e2e(env: dict[str, Any], rows: Sequence[dict[str, Any]], sources: Sequence[Path], path: Path) -> Path | None:
    """Horizontal bars of peak GB (top) and step ms (bottom) per variant, one column per sequence length."""
    plt = pyplot()
    ok = [r for r in rows if r.get("status") == "ok"]
    seqs = sorted({r["seq"] for r in ok})
    if not seqs:
        return None
    variants = list(dict.fromkeys(_e2e_name(r) for r in sorted(ok, key=lambda r: (r.get("mask", "as-is"), r["variant"]))))
    fig, axes = plt.subplots(2, len(seqs), figsize=(6.2 * len(seqs), 1.8 + 0.5 * len(variants) * 2), squeeze=False)
    colours = plt.get_cmap("tab10").colors
    for col, seq in enumerate(seqs):
        by_variant = {_e2e_name(r): r for r in ok if r["seq"] == seq}
        for row_index, (key, unit) in enumerate((("peak_gb", "peak memory (GB)"), ("step_ms", "step time, median (ms)"))):
            ax = axes[row_index][col]
            names = [v for v in variants if v in by_variant]
            values = [by_variant[v][key] for v in names]
            bars = ax.barh(names, values,
                           color=[colours[variants.index(v) % 10] for v in names])
            ax.bar_label(bars, labels=[f"{v:.1f}" if v < 100 else f"{v:.0f}" for v in values], padding=3, fontsize=8)
            ax.invert_yaxis()
            ax.set_xlabel(unit)
            ax.set_xlim(0, max(values) * 1.18)
            ax.set_title(f"sequence length {seq}", fontsize=10)
            ax.grid(True, axis="x", alpha=0.3)
    meta = ", ".join(f"{k} {env[k]}" for k in ("gpu", "torch", "transformers", "liger_kernel") if env.get(k))
    skip = "; compiled variants with --causal-skip" if env.get("causal_skip") else ""
    fig.suptitle(f"One training step (fwd+bwd), Llama-3.2-1B shape, bf16, batch 1, gradient checkpointing"
                 f"{skip}\n{meta}; peak: torch.cuda.max_memory_allocated\n"
                 f"from {', '.join(p.name for p in sources)}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / fig.get_figheight()))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _e2e_name(row: dict[str, Any]) -> str:
    """A bar's label: the variant, marked when the bench-only mask patch was on."""
    name = E2E_LABELS.get(row["variant"], row["variant"])
    return name + " [mask patch]" if row.get("mask") == "patched" else name


def draw_all(rows: Sequence[dict[str, Any]], env: dict[str, Any], out_dir: Path, e2e: Sequence[Path]) -> list[Path]:
    """Every PNG under ``out_dir`` (copied to $OUT when set); nothing, with a note, without matplotlib."""
    try:
        pyplot()
    except ImportError as exc:
        print(f"matplotlib not importable ({exc}): no PNGs; redraw with --from-csv on a machine that has it")
        return []
    kind = env["kind"]
    drawn = [draw_curves(rows, env, "tokens", out_dir / f"curves_{kind}_tokens.png"),
             draw_curves(rows, env, "chunks", out_dir / f"curves_{kind}_chunks.png")]
    if e2e:
        from flce_compile.tuning.db import normalize_device_name

        e2e_env, e2e_rows = merged_e2e(e2e)
        e2e_kind = normalize_device_name(e2e_env.get("gpu") or "unknown")
        drawn.append(draw_e2e(e2e_env, e2e_rows, e2e, out_dir / f"e2e_{e2e_kind}.png"))
    written = [p for p in drawn if p is not None]
    for folder in output_dirs(out_dir)[1:]:
        for p in written:
            (folder / p.name).write_bytes(p.read_bytes())
    return written


def parse_shape(text: str) -> Shape:
    """NAME=VxH, e.g. Llama-3=128256x4096."""
    name, _, dims = text.partition("=")
    try:
        vocab, hidden = (int(d) for d in dims.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes item {text!r} must look like NAME=VxH, e.g. GPT-2=50257x768") from None
    return Shape(name, vocab, hidden)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--shapes", nargs="+", type=parse_shape, metavar="NAME=VxH", help="default: per device, see SWEEPS")
    p.add_argument("--tokens", nargs="+", type=int, help="token counts of the token sweep")
    p.add_argument("--chunk-tokens", type=int, help="the fixed token count of the chunk sweep")
    p.add_argument("--chunks", nargs="+", type=int, help="chunk counts of the chunk sweep")
    p.add_argument("--ce-chunks", type=int, help="chunks of the chunked-CE baseline in the token sweep")
    p.add_argument("--flce-chunk-tokens", type=int,
                   help="ours' tokens per chunk in the token sweep (0: the op's own pick; default: GPU 0, CPU 256)")
    p.add_argument("--variants", nargs="+", metavar="NAME",
                   help="only these of: eager torch.compile chunked-ce liger cce torch-native "
                        + " ".join(f"flce-{s}" for s in registry.names()))
    p.add_argument("--warmup", type=int, help="warm-up runs before measuring")
    p.add_argument("--reps", type=int, help="timed runs (median)")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--e2e", nargs="+", type=Path, metavar="JSON",
                   help="bench_e2e results to draw (default: the newest run under benchmarks/results/)")
    p.add_argument("--no-e2e", action="store_true", help="do not draw the e2e chart")
    p.add_argument("--from-csv", type=Path, metavar="CSV", help="redraw from a curves CSV (and its .json sidecar)")
    return p


def sweep_from_args(args: argparse.Namespace) -> Sweep:
    base = SWEEPS[args.device]
    fields = {"shapes": args.shapes and tuple(args.shapes), "tokens": args.tokens and tuple(args.tokens),
              "chunk_sweep_tokens": args.chunk_tokens, "chunks": args.chunks and tuple(args.chunks),
              "ce_chunks": args.ce_chunks, "warmup": args.warmup, "reps": args.reps,
              "flce_chunk_tokens": args.flce_chunk_tokens}
    chosen = {**base.__dict__, **{k: v for k, v in fields.items() if v is not None}}
    return Sweep(**{**chosen, "flce_chunk_tokens": chosen["flce_chunk_tokens"] or None})


def measure_all(sweep: Sweep, device: str, wanted: Sequence[str] | None, env: dict[str, Any],
                out_dir: Path) -> list[dict[str, Any]]:
    """Both sweeps, every row printed and the CSV rewritten as it comes (a run cut short keeps its rows)."""
    fns, skipped = build_variants(device, sweep, wanted)
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}", flush=True)
    rows = skipped_rows(sweep.shapes, skipped)
    started = time.monotonic()
    sweeps = [functools.partial(token_sweep, shape, fns, sweep, device) for shape in sweep.shapes]
    sweeps.append(functools.partial(chunk_sweep, sweep.shapes[0], sweep, device))
    for run in sweeps:
        for row in run():
            rows.append(row)
            shown = (f"{row['peak_gb']:.4f} GB, {row['ms']:.2f} ms" if row["status"] == "ok"
                     else f"{row['status']}: {row.get('reason')}")
            print(f"[{time.monotonic() - started:6.1f} s] {row['sweep']} {row['shape']} {row['tokens']} tokens "
                  f"{row['variant']} (chunks {row['chunks']}): {shown}", flush=True)
            write_rows(rows, env, out_dir)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.from_csv is not None:
        rows = read_rows(args.from_csv)
        env = json.loads(args.from_csv.with_suffix(".json").read_text())
    else:
        if args.device == "cuda" and not torch.cuda.is_available():
            parser.error("no CUDA GPU here: use --device cpu")
        sweep = sweep_from_args(args)
        unknown = sorted(set(args.variants or ()) - set(variant_makers(args.device, sweep)))
        if unknown:
            parser.error(f"unknown --variants {unknown}; choose from {sorted(variant_makers(args.device, sweep))}")
        with cpu_threads(CPU_THREADS if args.device == "cpu" else None):
            env = environment(args.device, sweep)
            rows = measure_all(sweep, args.device, args.variants, env, args.out_dir)
        print(f"wrote {write_rows(rows, env, args.out_dir)}")
    e2e = [] if args.no_e2e else (args.e2e or newest_e2e_run(RESULTS, env["kind"]))
    for path in draw_all(rows, env, args.out_dir, e2e):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
