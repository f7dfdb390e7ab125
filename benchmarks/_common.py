"""Helpers shared by the benchmark scripts (bench_flce.py, plot_curves.py, host_overhead.py, ...) and the memory
tests: the inputs, the eager reference, the peers (Liger, CCE, PyTorch's native chunked loss), the package versions,
the CPU peak-memory measurement, the median timing of a step and the command line of the benchmarks that time
their steps in turns.

Importing this module imports torch only; the peers and triton are imported when asked for.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

#: A loss function of the benchmarks: (hidden (N, H), weight (V, H), targets (N,)) -> scalar loss.
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
IGNORED_FRACTION = 0.06  # share of targets set to ignore_index (-100)


def make_inputs(n: int, h: int, v: int, seed: int = 0, peaky: float = 1.0, device: str = "cuda",
                dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random hidden states (n, h), weight (v, h) scaled by ``peaky / sqrt(h)`` and targets with ~6% = -100."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, h, device=device, generator=g, dtype=torch.float32).to(dtype)
    w = (torch.randn(v, h, device=device, generator=g) * peaky / h**0.5).to(dtype)
    t = torch.randint(0, v, (n,), device=device, generator=g)
    t[torch.rand(n, device=device, generator=g) < IGNORED_FRACTION] = -100
    return x, w, t


def eager_loss(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The plain PyTorch reference: full logits, cast to fp32, cross-entropy."""
    return F.cross_entropy(F.linear(x, w).float(), t, ignore_index=-100)


def liger_loss() -> LossFn:
    """Liger-Kernel's fused linear cross-entropy; raises ImportError when liger-kernel is not installed."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    liger = LigerFusedLinearCrossEntropyLoss()
    return lambda x, w, t: liger(w, x, t)  # the module takes (lin_weight, _input, target)


def cce_loss() -> LossFn:
    """Cut Cross-Entropy with its defaults; raises ImportError when cut-cross-entropy is not installed."""
    from cut_cross_entropy import linear_cross_entropy

    return lambda x, w, t: linear_cross_entropy(x, w, t)


def native_loss(path: str | None = None) -> LossFn:
    """PyTorch's own chunked ``F.linear_cross_entropy`` (torch >= 2.13) with default ``LinearCrossEntropyOptions``.

    Where the installed torch lacks it, ``path`` may name its Python implementation from a newer torch, loaded at
    run time (nothing of it is copied here): the file ``torch/nn/modules/linear_cross_entropy.py`` or its folder,
    with ``linear_cross_entropy_options.py`` beside it. The call then does what ``F.linear_cross_entropy`` does
    for a 2-D input, int64 targets, mean, no smoothing: resolve the options for the call (``_adjust``) and run
    the chunked op. Raises ImportError, saying why, when neither is available.
    """
    function = getattr(F, "linear_cross_entropy", None)
    options_cls = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if function is not None and options_cls is not None:
        options = options_cls()
        return lambda x, w, t: function(x, w, t, options=options)
    if path is None:
        raise ImportError(f"torch {torch.__version__} has no F.linear_cross_entropy with LinearCrossEntropyOptions; "
                          "pass --native-from PATH (torch/nn/modules/linear_cross_entropy.py of torch >= 2.13)")
    import importlib.util
    from pathlib import Path

    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    modules = {}
    for stem in ("linear_cross_entropy_options", "linear_cross_entropy"):
        file = folder / f"{stem}.py"
        if not file.is_file():
            raise ImportError(f"{file} not found: --native-from names linear_cross_entropy.py of torch >= 2.13 "
                              "(or its folder), with linear_cross_entropy_options.py beside it")
        spec = importlib.util.spec_from_file_location(f"_native_{stem}", file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there while the class is built
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001 - a newer torch's file may need what this torch lacks
            raise ImportError(f"{file} does not load under torch {torch.__version__}: {exc}") from exc
        modules[stem] = module
    options = modules["linear_cross_entropy_options"].LinearCrossEntropyOptions()
    chunked = modules["linear_cross_entropy"]._linear_cross_entropy_batch_chunked

    def loss(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        o = options._adjust(num_batches=x.shape[0], in_features=x.shape[1], num_classes=w.shape[0], dtype=x.dtype,
                            device=x.device)
        grad = torch.is_grad_enabled()
        return chunked(x, w, t, None, None, "mean", -100, 0.0, o.batch_chunk_size, o.acc_policy, o.acc_dtype,
                       o.allow_retain_graph, grad and x.requires_grad, grad and w.requires_grad, False)[0]

    return loss


def versions() -> dict[str, str]:
    """torch, triton (when importable), Python, and the peers' versions where installed."""
    from importlib.metadata import version

    out = {"torch": torch.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    out["python"] = platform.python_version()
    for mod in ("liger_kernel", "cut_cross_entropy"):
        try:
            out[mod] = version(mod.replace("_", "-"))
        except Exception:  # noqa: BLE001 - not installed
            pass
    return out


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of live CPU allocations made while ``fn`` runs: the profiler's raw allocation/free records, one per
    allocation, replayed in time order (memory allocated before the call does not count).

    (FunctionEvent.self_cpu_memory_usage is not enough: it nets each op's allocations and frees, and a free
    that happens inside the fused op is charged to the op's start, which hid every internal peak.)
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    if not records:
        raise RuntimeError("the profiler recorded no allocations: the measurement would be empty")
    for event in sorted(records, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def step_peak_bytes(step: Callable[[], object], device: torch.device) -> int:
    """Peak bytes one call of ``step`` allocates beyond what was allocated before it: the CUDA allocator's peak on
    a GPU, the profiler's allocation records elsewhere (``cpu_peak_bytes``)."""
    if device.type != "cuda":
        return cpu_peak_bytes(step)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def cuda_events(prof) -> list:
    """The GPU activity (kernels, memcpys, memsets) a finished ``torch.profiler.profile`` recorded, each with a
    positive duration; raises when there is none (an idle share or a breakdown of nothing would mean nothing)."""
    events = [e for e in prof.profiler.kineto_results.events()
              if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0]
    if not events:
        raise RuntimeError("the profiler recorded no GPU activity")
    return events


def busy_and_span_ns(events: list) -> tuple[int, int]:
    """(length of the union of the events' intervals, first start to last end), in ns."""
    intervals = sorted((e.start_ns(), e.start_ns() + e.duration_ns()) for e in events)
    busy, cur_start, cur_end = 0, *intervals[0]
    for start, end in intervals[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return busy, max(end for _, end in intervals) - intervals[0][0]


def median_ms(step: Callable[[], object], reps: int, device: str,
              before: Callable[[], object] | None = None) -> float:
    """Median wall time of ``reps`` runs of ``step`` in ms: CUDA events on the GPU, perf_counter on the CPU.
    ``before`` runs ahead of each run, untimed (e.g. restoring inputs the step overwrites)."""
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            step()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def do_bench_ms(step: Callable[[], object], warmup_ms: float, rep_ms: float,
                grad_to_none: list[torch.Tensor] | None = None) -> float:
    """``triton.testing.do_bench``'s median over at least about 10 timed runs: it repeats ``rep_ms`` / (one run's
    time), which at ``rep_ms`` = 1000 timed 1-3 runs of a 300-700 ms step (65536 tokens; a review read 1 for CCE),
    so one timed run first sets a longer ``rep`` and ``warmup`` where the step needs them."""
    import triton  # noqa: PLC0415

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    estimate = start.elapsed_time(end)
    return float(triton.testing.do_bench(step, warmup=max(warmup_ms, 2 * estimate), rep=max(rep_ms, 11 * estimate),
                                         grad_to_none=grad_to_none, return_mode="median"))


def output_dirs(out_dir: Path | str) -> list[Path]:
    """``out_dir`` and, when set, $OUT (the GPU machine's way back), created."""
    dirs = [Path(out_dir)] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    return dirs


def shape_table(heading: list[str], shapes: list[str],
                run_shape: Callable[[str], tuple[list[str], Any]]) -> tuple[str, list[Any]]:
    """A table built shape by shape: ``heading`` (title and header lines) printed first, then each shape's rows
    as ``run_shape`` returns them (with its data), printed as they come. Returns the markdown and the data."""
    lines = list(heading)
    for line in lines:
        print(line, flush=True)
    rows = []
    for shape in shapes:
        shape_lines, data = run_shape(shape)
        lines += shape_lines
        rows.append(data)
        for line in shape_lines:
            print(line, flush=True)
    return "\n".join(lines) + "\n", rows


def save_results(out_dir: Path | str, stem: str, md: str, data: Any, indent: int = 1) -> None:
    """``<stem>.md`` (the table as printed) and ``<stem>.json`` (``data``) in ``out_dir`` and $OUT."""
    for folder in output_dirs(out_dir):
        (folder / f"{stem}.md").write_text(md)
        (folder / f"{stem}.json").write_text(json.dumps(data, indent=indent))


def parse_turns_args(doc: str, shapes: list[str], needs_gpu: str,
                     add_arguments: Callable[[argparse.ArgumentParser], object] | None = None) -> argparse.Namespace:
    """The command line of a benchmark that times its steps in turns at each shape: ``--shapes``, ``--rounds``
    (at least 1), ``--tag`` (appended to the result files' names), ``--out`` and whatever ``add_arguments`` adds.
    Refuses to run without CUDA, saying ``needs_gpu`` (why the benchmark needs the GPU)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=shapes)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tag", default="", help="appended to the result files' names")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error(f"needs a CUDA GPU: {needs_gpu}")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be at least 1")
    return args
