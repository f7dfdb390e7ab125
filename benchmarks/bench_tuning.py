"""Benchmark: tuned config vs the heuristic default vs Liger, for every shape the tuning DB holds for this GPU
(its own entries, and those it runs from another kind of its family: an H100 the H200's; ``--own-only``: its own).

A fourth column, "liger-rule", runs our op with the default config but Liger-Kernel's fixed chunk rule
(tokens per chunk = next_pow2(ceil(BT / ceil(V / H))), the rule the tuning issue names): it separates what the
chunk size buys from what the kernels buy. By default it is measured at the target shape only
(``--liger-rule-shapes``).

bf16, forward + backward (dX and dW), median ms from ``triton.testing.do_bench`` with at least 10 timed runs, in
``--turns`` rounds (default 2) that each time every variant of a shape once; a variant's ms is its rounds' median.
Peak GB: ``torch.cuda.max_memory_allocated`` over one warm fwd+bwd with the op's CUDA-graph replay off, above the
inputs and the returned dX and dW (the definition of the DB's ``peak_gb`` and of
``flce_compile.plan.memory.peak_bytes``), in 1e9 bytes: the working set that a replayed call's graph holds.

Writes ``bench_tuning_<gpu>_<time>.json`` and ``.md`` (GPU name, torch/triton versions) under
``benchmarks/results/`` (or ``--out-dir``) after every shape, so a run stopped by a time limit still leaves
the shapes it finished; ``"complete": false`` and a note in the markdown say that it is partial.
``--time-budget-s`` stops before a shape that would not fit (estimated from the slowest shape so far).

Targets reported: at tokens=8192, H=2304, V=256000 the tuned config is >= 1.5x faster than the default rule
(judged against the liger-rule column; the speedup over our heuristic default is printed beside it); the tuned
config is never slower than the heuristic default (2% measurement tolerance; a row whose tuned config is the
default itself is not judged, and the spread of those rows is printed as the run's noise; nor is a budget-tier
entry, whose config fits a memory budget the unbudgeted default breaks); and the op's default (the plain entry's
tuned config) is never slower than Liger's FLCE at any shape, strictly.

    python benchmarks/bench_tuning.py                    # every DB shape of this GPU (shipped + user)
    python benchmarks/bench_tuning.py --shipped-only --out-dir $OUT --time-budget-s 120
    python benchmarks/bench_tuning.py --shapes 256000x2304,151936x4096x16384 --max-shapes 1
    python benchmarks/bench_tuning.py --shipped-only --resume results/bench_tuning_h200_<time>.json  # finish it

``--resume`` continues a partial run in a later process (a GPU lease of 10 minutes a command): it keeps the
earlier rows, measures only the shapes they lack, and rewrites the same file names under ``--out-dir``.

``--latest JSON [JSON ...]`` measures nothing (no GPU): it takes, for every entry the DB holds now, the row of the
newest of those runs that timed the entry's current config, and judges them together, so checks spread over
several device commands (or re-runs of a few entries after a re-tune) add up to one verdict per entry. Rows
that timed another config than the entry's current one are left out; entries without a row are listed. Writes
``bench_tuning_<gpu>_latest.{json,md}`` under ``--out-dir``.

    python benchmarks/bench_tuning.py --shipped-only --latest benchmarks/results/bench_tuning_h200_2026*-*.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import json
import math
import platform
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import do_bench_ms, output_dirs  # noqa: E402
from flce_compile.plan.tuning_db import family_kinds  # noqa: E402

TARGET = (256000, 2304, 8192)  # (V, H, tokens) of the 1.5x target
TARGET_SPEEDUP = 1.5
LIGER_RULE_SHAPES = ("target", "all", "none")  # where the liger-rule column is measured
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


def liger_chunk_tokens(tokens: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk under Liger-Kernel's fixed rule: next_pow2(ceil(tokens / ceil(vocab / hidden)))."""
    chunk = -(-tokens // -(-vocab // hidden))
    return 1 << (chunk - 1).bit_length()


def _bench(fn: Callable[[], Any], grads: list[torch.Tensor], rep_ms: float) -> float:
    def step():
        fn().backward()

    step()  # compile / autotune outside the timing
    torch.cuda.synchronize()
    return do_bench_ms(step, warmup_ms=25, rep_ms=rep_ms, grad_to_none=grads)


def _peak_gb(fn: Callable[[], Any], grads: list[torch.Tensor]) -> float:
    """Peak of one fwd+bwd above the inputs and the returned gradients (run after ``_bench``: warm), with the op's
    CUDA-graph replay off: a replayed call allocates nothing (its graph's pool, the working set it holds between
    calls, was allocated at the capture, before ``before``) and hands out its gradients as views of that pool, so
    the peak read minus the gradients, negative (-0.08 GB at GPT-2's shape in the H100 table of 2026-12-06); the
    uncaptured call's peak is the working set a graph keeps."""
    from flce_compile import graph_replay

    for g in grads:
        g.grad = None
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    gc.disable()  # a collection during the run could free unrelated memory and hide the run's own
    try:
        with graph_replay.disabled():
            fn().backward()
        torch.cuda.synchronize()
    finally:
        gc.enable()
    returned = sum(g.grad.numel() * g.grad.element_size() for g in grads if g.grad is not None)
    peak = torch.cuda.max_memory_allocated() - before - returned
    for g in grads:
        g.grad = None
    if peak < 0:
        raise RuntimeError(f"peak {peak} B below the returned gradients: the call allocated them elsewhere")
    return peak / 1e9


# ----------------------------------------------------------------------------------------------------------
# Selection, the time-limited loop and the results files (no GPU needed: tested on CPU)
# ----------------------------------------------------------------------------------------------------------


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """``VxH`` or ``VxHxTOKENS`` items, comma separated."""
    shapes: list[tuple[int, ...]] = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        try:
            values = tuple(int(v) for v in part.split("x"))
        except ValueError:
            values = ()
        if len(values) not in (2, 3):
            raise argparse.ArgumentTypeError(f"--shapes item {part!r} must look like VxH or VxHxTOKENS, e.g. 256000x2304")
        shapes.append(values)
    if not shapes:
        raise argparse.ArgumentTypeError("--shapes needs at least one VxH item")
    return shapes


def entries_served(entries: Sequence[Any], kind: str, *, own_only: bool = False) -> list[Any]:
    """The bf16 entries to judge GPU ``kind`` on: its own, and each entry of another kind of its family that the
    op's lookup answers ``kind``'s calls with at that entry's shape and token bucket (a tier entry: with a budget
    of its tier), so an H100 is judged on the H200's entries it runs and on no others. ``own_only``: its own
    alone. Sorted as the DB sorts them."""
    own = [e for e in entries if e.device == kind and e.dtype == "bf16"]
    if own_only:
        return own
    family = set(family_kinds(kind))
    borrowed = [e for e in entries if e.device in family and e.dtype == "bf16" and answered_with(e, kind)]
    return sorted(own + borrowed, key=lambda e: (e.sort_key[1:], e.device))


def answered_with(e: Any, kind: str) -> bool:
    """Whether the op's pick for a call on GPU ``kind`` at ``e``'s (V, H, dtype, token bucket) comes from ``e``
    (``plan.choose.choose_config_match``, as a call without options; a budget-tier entry: the first of the tier
    entries a call with a budget of its tier may use)."""
    from flce_compile.plan.choose import choose_config_match  # noqa: PLC0415
    from flce_compile.tuning import db  # noqa: PLC0415

    if e.budget_tier_gb is None:
        match = choose_config_match(e.tokens, e.vocab, e.hidden, db.torch_dtype(e.dtype), torch.device("cuda"),
                                    gpu=kind)[2]
    else:
        matches = db.find_budget_matches(vocab=e.vocab, hidden=e.hidden, dtype=e.dtype, tokens=e.tokens,
                                         device=kind, budget_gb=e.budget_tier_gb)
        match = matches[0] if matches else None
    return match is not None and match.entry == e


def select_entries(entries: Sequence[Any], shapes: Sequence[tuple[int, ...]] | None = None,
                   max_shapes: int | None = None) -> list[Any]:
    """The DB entries to benchmark: those matching ``shapes`` (in the order given; all, in DB order, if None),
    at most ``max_shapes`` of them."""
    if shapes:
        picked = [i for s in shapes for i, e in enumerate(entries)
                  if (e.vocab, e.hidden) == tuple(s[:2]) and (len(s) == 2 or e.tokens == s[2])]
        chosen = [entries[i] for i in dict.fromkeys(picked)]  # each entry once, first request first
    else:
        chosen = list(entries)
    return chosen[:max_shapes] if max_shapes is not None else chosen


def run_shapes(entries: Sequence[Any], measure: Callable[[Any], dict[str, Any]],
               write: Callable[[list[dict[str, Any]], list[Any], bool], None], *,
               time_budget_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> int:
    """Measure ``entries`` one by one and call ``write(rows, not_measured, complete)`` after each, so a run that
    is stopped (a time limit, Ctrl-C) still leaves its results. With ``time_budget_s``, a shape is not started
    when the slowest shape so far would not fit in what is left. Returns the exit status (130: interrupted)."""
    started = clock()
    rows: list[dict[str, Any]] = []
    slowest = 0.0
    for index, e in enumerate(entries):
        if time_budget_s is not None and clock() - started + slowest > time_budget_s:
            rest = list(entries[index:])
            print(f"time budget ({time_budget_s:.0f} s) spent: {len(rest)} shapes not measured", flush=True)
            write(rows, rest, False)
            return 0
        shape_start = clock()
        try:
            row = measure(e)
        except KeyboardInterrupt:
            print("interrupted: writing the shapes measured so far", flush=True)
            write(rows, list(entries[index:]), False)
            return 130
        slowest = max(slowest, clock() - shape_start)
        rows.append(row)
        write(rows, list(entries[index + 1:]), index + 1 == len(entries))
    if not entries:
        write(rows, [], True)
    return 0


def resume_state(payload: dict[str, Any], meta: dict[str, Any], entries: Sequence[Any]) -> tuple[list[dict[str, Any]], list[Any]]:
    """(rows kept from an earlier run's results ``payload``, the ``entries`` still to measure). Refuses results
    from another GPU kind or other torch/triton versions: their rows would not compare with new ones."""
    old = payload.get("meta", {})
    for key in ("gpu_kind", "torch", "triton"):
        if old.get(key) != meta.get(key):
            raise ValueError(f"--resume file was measured with {key}={old.get(key)!r}, this run has "
                             f"{meta.get(key)!r}; start a new run instead")
    rows = list(payload.get("rows", []))
    for r in rows:  # rows written before rows carried their tier: the entry whose config they timed
        if "budget_tier_gb" not in r:
            match = [e for e in entries if (e.vocab, e.hidden, e.tokens) == (r["vocab"], r["hidden"], r["tokens"])
                     and e.config.to_dict() == r.get("tuned_config")]
            r["budget_tier_gb"] = match[0].budget_tier_gb if len(match) == 1 else None
    # A plain entry and its budget tier share (V, H, tokens): the tier tells them apart.
    done = {_row_key(r) for r in rows}
    return rows, [e for e in entries if _entry_key(e) not in done]


def _row_key(r: dict[str, Any]) -> tuple[int, int, int, float | None]:
    """A results row's entry: (V, H, tokens, tier); a plain entry and its budget tier share the rest."""
    return r["vocab"], r["hidden"], r["tokens"], r.get("budget_tier_gb")


def _entry_key(e: Any) -> tuple[int, int, int, float | None]:
    """``_row_key`` of a DB entry."""
    return e.vocab, e.hidden, e.tokens, e.budget_tier_gb


def runs_the_default(r: dict[str, Any]) -> bool:
    """The tuned config is the default itself: its "speedup" times one config twice, i.e. the noise."""
    return "tuned_config" in r and r["tuned_config"] == r.get("default_config")


def summarize(rows: Sequence[dict[str, Any]]) -> tuple[list[str], str, str]:
    """(markdown table lines, target status, never-slower status)."""

    def f(v: Any, spec: str = ".3f") -> str:
        return "-" if v is None else format(v, spec)

    def x(v: Any) -> str:
        return "-" if v is None else f"{v:.2f}x"

    header = ["V", "H", "tokens", "default ms", "tuned ms", "speedup", "liger-rule ms", "vs liger-rule",
              "liger ms", "vs liger", "default GB", "tuned GB", "liger GB"]
    table = [[str(r["vocab"]), str(r["hidden"]), _tokens_cell(r), f(r.get("default_ms")), f(r.get("tuned_ms")),
              x(r.get("speedup")), f(r.get("liger_rule_ms")), x(r.get("vs_liger_rule")), f(r.get("liger_ms")),
              x(r.get("vs_liger")), f(r.get("default_peak_gb"), ".2f"), f(r.get("tuned_peak_gb"), ".2f"),
              f(r.get("liger_peak_gb"), ".2f")]
             for r in rows]
    if any("run" in r for r in rows):  # rows merged from several runs (``--latest``) say which one
        header.append("run")
        for row, r in zip(table, rows):
            row.append(str(r.get("run", "-")))
    target_row = next((r for r in rows if (r["vocab"], r["hidden"], r["tokens"]) == TARGET), None)
    if target_row is None or target_row.get("vs_liger_rule") is None:
        target_status = ("NOT MEASURED (no liger-rule timing for V=256000 H=2304 tokens=8192 on this GPU; "
                         f"tuned vs heuristic default: {x((target_row or {}).get('speedup'))})")
    else:
        ok = target_row["vs_liger_rule"] >= TARGET_SPEEDUP
        target_status = (f"{'PASS' if ok else 'FAIL'} ({target_row['vs_liger_rule']:.2f}x over our op with Liger's "
                         f"chunk rule, target >= {TARGET_SPEEDUP}x; over the heuristic default: "
                         f"{x(target_row.get('speedup'))})")
    timed = [r for r in rows if r.get("speedup") is not None and not r.get("budget_tier_gb")]
    tiers = sum(1 for r in rows if r.get("budget_tier_gb"))
    same = [r for r in timed if runs_the_default(r)]
    slower = [r for r in timed if not runs_the_default(r) and r["speedup"] < NOT_SLOWER_TOLERANCE]
    never_slower = ("PASS" if not slower else
                    "FAIL: " + ", ".join(f"V={r['vocab']} H={r['hidden']} T={r['tokens']} ({r['speedup']:.2f}x)" for r in slower))
    if tiers:  # a tier entry's config fits a budget the unbudgeted default breaks: no like-for-like default
        never_slower += f" ({tiers} budget-tier row{'s' * (tiers != 1)} not judged)"
    if same:
        spread = sorted(r["speedup"] for r in same)
        never_slower += (f" ({len(same)} row{'s' * (len(same) != 1)} whose tuned config is the default not judged; "
                         "that config timed twice "
                         f"spans {spread[0]:.3f}x-{spread[-1]:.3f}x)")
    if not rows:
        never_slower = "NOT MEASURED (no rows)"
    widths = [max(len(h), *(len(row[i]) for row in table)) if table else len(h) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "| " + " | ".join("-" * w for w in widths) + " |"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in table]
    return lines, target_status, never_slower


def _tokens_cell(r: dict[str, Any]) -> str:
    """The tokens column: a budget-tier entry's row says its tier, a borrowed entry's row the kind it is from."""
    tier = r.get("budget_tier_gb")
    cell = f"{r['tokens']} (<= {tier:g} GiB)" if tier else str(r["tokens"])
    return f"{cell} ({r['borrowed_from']}'s)" if r.get("borrowed_from") else cell


def never_slower_than_liger(rows: Sequence[dict[str, Any]]) -> str:
    """Whether the op's default for each plain DB entry (its tuned config: what a call without options gets) is
    at least as fast as Liger's FLCE, strictly (no tolerance). Budget-tier rows trade speed for a memory budget
    Liger does not have, so they are not judged."""
    judged = [r for r in rows if r.get("vs_liger") is not None and not r.get("budget_tier_gb")]
    if not judged:
        return "NOT MEASURED (no Liger timings)"
    slower = [r for r in judged if r["vs_liger"] < 1.0]
    if not slower:
        return f"PASS ({len(judged)} shape{'s' * (len(judged) != 1)})"
    return (f"FAIL at {len(slower)} of {len(judged)} shapes: "
            + ", ".join(f"V={r['vocab']} H={r['hidden']} T={r['tokens']} ({r['vs_liger']:.3f}x)" for r in slower))


def op_runs_entries(rows: Sequence[dict[str, Any]]) -> str:
    """Whether a call without options, on the GPU of the run, runs the plain entry each row timed (the verdicts
    above judge it as "the default"); rows from before the runs recorded it are not counted."""
    checked = [r for r in rows if "op_runs_tuned" in r]
    if not checked:
        return "NOT RECORDED"
    other = [r for r in checked if not r["op_runs_tuned"]]
    if not other:
        return f"yes ({len(checked)} plain entr{'ies' if len(checked) != 1 else 'y'})"
    return (f"NO at {len(other)} of {len(checked)}: " + ", ".join(
        f"V={r['vocab']} H={r['hidden']} T={r['tokens']} ({r.get('op_source')})" for r in other))


def write_results(base: Path, meta: dict[str, Any], rows: Sequence[dict[str, Any]], not_measured: Sequence[Any],
                  complete: bool) -> None:
    """(Re)write ``<base>.json`` and ``<base>.md`` with the rows so far; each file is replaced atomically."""
    lines, target_status, never_slower = summarize(rows)
    missing = [f"{e.vocab}x{e.hidden}x{e.tokens}" for e in not_measured]
    payload = {"meta": meta, "complete": complete, "rows": list(rows), "not_measured": missing,
               "target": target_status, "never_slower": never_slower,
               "never_slower_than_liger": never_slower_than_liger(rows), "op_runs_entries": op_runs_entries(rows)}
    md = [f"# flce_compile tuning benchmark ({meta['gpu']})", "",
          f"torch {meta['torch']}, triton {meta['triton']}, bf16 fwd+bwd, median ms (do_bench), {meta['date']} UTC. "
          "Peak GB: above the inputs and the returned dX/dW (1e9 bytes).", ""]
    if not complete:
        md += [f"**Partial**: {len(rows)} shapes measured, {len(missing)} not measured "
               f"({', '.join(missing) or 'none'}).", ""]
    md += [*lines, "", f"- target 8192x2304x256000 tuned >= {TARGET_SPEEDUP}x the default rule: {target_status}",
           f"- tuned never slower than default: {never_slower}",
           f"- default (the tuned entry) never slower than Liger: {never_slower_than_liger(rows)}",
           f"- a call without options runs the entry timed: {op_runs_entries(rows)}", ""]
    for folder in output_dirs(base.parent):  # and $OUT, the GPU machine's way back, as every benchmark writes
        for suffix, text in ((".json", json.dumps(payload, indent=1) + "\n"), (".md", "\n".join(md))):
            path = folder / (base.name + suffix)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(text)
            tmp.replace(path)


def plot_speedups(rows: Sequence[dict[str, Any]], path: Path, heading: str = "") -> Path | None:
    """Draw ``rows`` (as ``write_results`` saves them) to a PNG: tuned over the heuristic default and tuned over
    Liger (ratios of median ms, > 1: the tuned config is faster), one heat-map row per (V, H) shape, one column per
    token count. A star marks rows whose tuned config is the default itself (their ratio is timing noise).
    Returns ``path``, or None when no row has either ratio."""
    from flce_compile.tuning.cli import SHIPPED_SHAPES  # noqa: PLC0415

    panels = [("speedup", "tuned over the heuristic default", "default ms / tuned ms"),
              ("vs_liger", "tuned over Liger FLCE", "Liger ms / tuned ms")]
    panels = [p for p in panels if any(r.get(p[0]) for r in rows)]
    if not panels:
        return None
    plt = _pyplot()
    from matplotlib.colors import TwoSlopeNorm  # noqa: PLC0415
    from matplotlib.ticker import FuncFormatter  # noqa: PLC0415

    names = {(v, h): name for v, h, name in SHIPPED_SHAPES}
    shapes = sorted({(r["vocab"], r["hidden"]) for r in rows}, key=lambda s: (-s[0], -s[1]))
    tokens = sorted({r["tokens"] for r in rows})
    cells = {(r["vocab"], r["hidden"], r["tokens"]): r for r in rows}
    fig, axes = plt.subplots(1, len(panels), figsize=(7.2 * len(panels), 1.8 + 0.42 * len(shapes)), squeeze=False)
    for ax, (key, what, ratio) in zip(axes[0], panels):
        grid = [[math.log2(cells[(v, h, t)][key]) if cells.get((v, h, t), {}).get(key) else math.nan for t in tokens]
                for v, h in shapes]
        finite = [g for line in grid for g in line if not math.isnan(g)]
        norm = TwoSlopeNorm(vcenter=0.0, vmin=min(min(finite), -0.05), vmax=max(max(finite), 0.05))
        cmap = plt.get_cmap("RdYlGn").with_extremes(bad="#dddddd")
        image = ax.imshow(grid, cmap=cmap, norm=norm, aspect="auto")
        for i, (v, h) in enumerate(shapes):
            for j, t in enumerate(tokens):
                r = cells.get((v, h, t))
                if r and r.get(key):
                    star = "*" if key == "speedup" and runs_the_default(r) else ""
                    ax.text(j, i, f"{r[key]:.2f}{star}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(tokens)), [f"{t // 1024}K" for t in tokens])
        ax.set_yticks(range(len(shapes)), [f"{names.get(s, '')} V {s[0]} H {s[1]}".strip() for s in shapes], fontsize=8)
        ax.set_xlabel("tokens (BT)")
        ax.set_title(f"{what}\n({ratio}, > 1: tuned faster)", fontsize=10)
        bar = fig.colorbar(image, ax=ax, ticks=_colourbar_ticks(norm), format=FuncFormatter(lambda x, _pos: f"{2 ** x:.3g}x"))
        bar.set_label(f"{ratio} (log scale)")
    note = "* the tuned config is the default itself: the ratio is run-to-run noise"
    fig.suptitle(f"{heading}\n{note}" if heading else note, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _colourbar_ticks(norm: Any, gap: float = 0.07) -> list[float]:
    """log2 of round ratios inside the colour scale, outward from 1x, at least ``gap`` of the bar apart."""
    ticks = [0.0]
    for side in ((0.98, 0.95, 0.9, 0.8, 0.5, 0.25), (1.02, 1.05, 1.1, 1.2, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0)):
        last = 0.0
        for ratio in side:
            tick = math.log2(ratio)
            if norm.vmin <= tick <= norm.vmax and abs(float(norm(tick)) - float(norm(last))) >= gap:
                ticks.append(tick)
                last = tick
    return sorted(ticks)


def plot_heading(meta: dict[str, Any]) -> str:
    return (f"flce tuning benchmark: {meta.get('gpu', '?')}, torch {meta.get('torch', '?')}, triton "
            f"{meta.get('triton', '?')}, {meta.get('dtype', 'bf16')} {meta.get('pass', 'fwd+bwd')}, {meta.get('date', '')}")


def plot_from(json_path: Path, out: Path | None = None) -> Path | None:
    """Redraw a results JSON of this script to ``out`` (default: the JSON's path with .png)."""
    payload = json.loads(json_path.read_text())
    return plot_speedups(payload["rows"], out or json_path.with_suffix(".png"), plot_heading(payload.get("meta", {})))


def _pyplot() -> Any:
    """matplotlib.pyplot from plot_curves (the one place the benchmarks import matplotlib)."""
    repo = str(Path(__file__).resolve().parents[1])
    if repo not in sys.path:
        sys.path.append(repo)
    from benchmarks.plot_curves import pyplot  # noqa: PLC0415

    return pyplot()


# ----------------------------------------------------------------------------------------------------------


def timed_in_turns(fns: dict[str, Callable[[], Any]], bench: Callable[[Callable[[], Any]], float], turns: int,
                   after_error: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """``<name>_ms`` (the median of its rounds) and ``<name>_ms_rounds`` per variant, timed with ``bench`` in
    ``turns`` rounds that each time every variant once, in order: one timing per variant left a ratio such as
    ``vs_liger`` to the GPU's drift between two timings (0.3-1.2% at the closest shapes). A variant that raises
    gets ``<name>_ms`` None and ``<name>_error``, and is left out of the later rounds (``after_error`` runs then:
    the caller frees what it can)."""
    rounds: dict[str, list[float]] = {name: [] for name in fns}
    out: dict[str, Any] = {}
    for _ in range(turns):
        for name, fn in fns.items():
            if f"{name}_error" in out:
                continue
            try:
                rounds[name].append(bench(fn))
            except Exception as exc:  # noqa: BLE001 - report, go on
                out[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                after_error()
    for name, times in rounds.items():
        failed = f"{name}_error" in out
        out[f"{name}_ms"] = None if failed or not times else statistics.median(times)
        if times and not failed:
            out[f"{name}_ms_rounds"] = times
    return out


def _measure_entry(e: Any, liger: Callable[..., Any] | None, rep_ms: float, liger_rule: bool,
                   kind: str | None = None, turns: int = 2) -> dict[str, Any]:
    from flce_compile import fused_linear_cross_entropy  # noqa: PLC0415
    from flce_compile.plan.choose import heuristic_config  # noqa: PLC0415

    device = torch.device("cuda")
    # timed at the token count the entry was measured at (its bucket unless a study measured another count)
    vocab, hidden, tokens = e.vocab, e.hidden, e.measured_tokens
    # generated on the GPU: a CPU generator spends seconds per shape at 65536 x 8192
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=gen, device=device) / hidden**0.5).to(torch.bfloat16).requires_grad_(True)
    t = torch.randint(0, vocab, (tokens,), generator=gen, device=device)
    default_cfg = heuristic_config(tokens, vocab, hidden, torch.bfloat16, device)
    configs = {"default": default_cfg, "tuned": e.config}
    if liger_rule:
        configs["liger_rule"] = dataclasses.replace(default_cfg, chunk_tokens=liger_chunk_tokens(tokens, vocab, hidden))
    fns: dict[str, Callable[[], Any]] = {
        name: (lambda c=c: fused_linear_cross_entropy(x, w, t, config=c)) for name, c in configs.items()}
    if liger is not None:
        fns["liger"] = lambda: liger(x, w, t)
    row: dict[str, Any] = {"vocab": vocab, "hidden": hidden, "tokens": e.tokens, "measured_tokens": tokens,
                           "budget_tier_gb": e.budget_tier_gb,
                           **{f"{name}_config": c.to_dict() for name, c in configs.items()},
                           "db_ms": e.ms, "db_default_ms": e.default_ms}
    if kind is not None and e.device != kind:
        row["borrowed_from"] = e.device
    if e.budget_tier_gb is None:
        row.update(op_choice(e, device))
    names = list(fns)
    try:
        with torch.no_grad():
            row["loss"] = {name: float(fn()) for name, fn in fns.items()}
        row.update(timed_in_turns(fns, lambda fn: _bench(fn, [x, w], rep_ms), turns, torch.cuda.empty_cache))
        for name, fn in fns.items():
            if row.get(f"{name}_ms") is None:
                continue
            try:
                row[f"{name}_peak_gb"] = _peak_gb(fn, [x, w])
            except Exception as exc:  # noqa: BLE001 - the time stands; the peak is reported missing
                row[f"{name}_peak_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                torch.cuda.empty_cache()
    finally:
        del x, w, t, fns
        torch.cuda.empty_cache()
    if row.get("tuned_ms") and row.get("default_ms"):
        row["speedup"] = row["default_ms"] / row["tuned_ms"]
    for name in ("liger", "liger_rule"):
        if row.get("tuned_ms") and row.get(f"{name}_ms"):
            row[f"vs_{name}"] = row[f"{name}_ms"] / row["tuned_ms"]
    print(f"V={vocab} H={hidden} T={tokens}: " + ", ".join(f"{name} {row.get(f'{name}_ms')}" for name in names),
          flush=True)
    return row


def op_choice(e: Any, device: torch.device) -> dict[str, Any]:
    """Whether a call without options on ``device`` at plain entry ``e``'s shape and measured token count runs
    ``e``'s config (``op_runs_tuned``; the op's own pick, ``plan.choose.op_config``), and the lookup's source."""
    from flce_compile.plan.choose import choose_config, op_config  # noqa: PLC0415

    tokens = e.measured_tokens
    return {"op_source": choose_config(tokens, e.vocab, e.hidden, torch.bfloat16, device)[1],
            "op_runs_tuned": op_config("", tokens, e.vocab, e.hidden, torch.bfloat16, device) == e.config}


def latest_rows(payloads: Sequence[dict[str, Any]], entries: Sequence[Any], kind: str | None = None
                ) -> tuple[list[dict[str, Any]], list[Any], int]:
    """(for each of ``entries`` that some run timed with its current config, that row from the newest such run,
    marked with ``"run"`` = the run's date stamp, in ``entries``' order; the entries no run timed so; how many
    rows were passed over because they timed another config). Runs are ordered by ``meta["date"]``. With the
    runs' GPU ``kind``, each row's ``borrowed_from`` names the kind of the entry it stands for now (a row timed
    when the GPU borrowed a config it now holds as its own entry loses it)."""
    current = {_entry_key(e): e.config.to_dict() for e in entries}
    devices = {_entry_key(e): e.device for e in entries}
    newest: dict[tuple, dict[str, Any]] = {}
    stale = 0
    for payload in sorted(payloads, key=lambda p: p["meta"]["date"]):
        for r in payload.get("rows", []):
            key = _row_key(r)
            if key not in current:
                continue
            if r.get("tuned_config") != current[key]:
                stale += 1
                continue
            newest[key] = {**r, "run": payload["meta"]["date"]}
            if kind is not None:
                newest[key].pop("borrowed_from", None)
                if devices[key] != kind:
                    newest[key]["borrowed_from"] = devices[key]
    rows = [newest[k] for k in current if k in newest]
    missing = [e for e in entries if _entry_key(e) not in newest]
    return rows, missing, stale


def latest_meta(payloads: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The merged runs' description: one GPU kind (else ValueError), the torch/triton versions they ran. A
    merged result itself is refused (its date is no run's: it would count as the newest)."""
    if any("merged" in p["meta"] for p in payloads):
        raise ValueError("a file passed is itself a --latest result (bench_tuning_<gpu>_latest.json); pass the "
                         "runs only, e.g. bench_tuning_h200_2026*-*.json")
    kinds = {p["meta"].get("gpu_kind") for p in payloads}
    if len(kinds) != 1:
        raise ValueError(f"the runs were measured on different GPU kinds {sorted(map(str, kinds))}; merge one at "
                         "a time")
    first = payloads[0]["meta"]
    dates = sorted(p["meta"]["date"] for p in payloads)
    return {"gpu": first["gpu"], "gpu_kind": first.get("gpu_kind"),
            "torch": ", ".join(sorted({p["meta"]["torch"] for p in payloads})),
            "triton": ", ".join(sorted({p["meta"]["triton"] for p in payloads})),
            "date": "the newest row per entry of " + ", ".join(dates), "merged": dates}


def _latest(paths: Sequence[Path], shipped_only: bool, out_dir: Path, own_only: bool = False) -> int:
    """``--latest``: merge the runs at ``paths`` against the DB's entries now, then write and print the verdicts."""
    from flce_compile.tuning import db  # noqa: PLC0415

    payloads = [json.loads(path.read_text()) for path in paths]
    meta = latest_meta(payloads)
    entries = entries_served(db.load_entries(layer="shipped" if shipped_only else "merged"), meta["gpu_kind"],
                             own_only=own_only)
    rows, missing, stale = latest_rows(payloads, entries, meta["gpu_kind"])
    meta.update(shipped_only=shipped_only, own_only=own_only)
    meta["rows_from"] = {run: sum(1 for r in rows if r["run"] == run) for run in meta["merged"]}
    meta["rows_with_another_config"] = stale
    base = out_dir / f"bench_tuning_{meta['gpu_kind']}_latest"
    write_results(base, meta, rows, missing, complete=not missing)
    lines, _, never_slower = summarize(rows)
    print("\n".join(lines))
    print(f"rows per run: {meta['rows_from']}; {stale} rows timed another config than the current entry's")
    print(f"tuned never slower than default (tolerance {NOT_SLOWER_TOLERANCE}): {never_slower}")
    print(f"default never slower than Liger: {never_slower_than_liger(rows)}")
    print(f"a call without options runs the entry timed: {op_runs_entries(rows)}")
    if missing:
        names = ", ".join(f"{e.vocab}x{e.hidden}x{e.tokens}" for e in missing)
        print(f"{len(missing)} entries without a row: {names}")
    print(f"wrote {base}.json and {base}.md")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shipped-only", action="store_true", help="only shipped entries (ignore the user DB)")
    p.add_argument("--own-only", action="store_true", help="only this GPU kind's own entries (by default also "
                   "those it runs from another kind of its family, e.g. an H100 the H200's)")
    p.add_argument("--shapes", type=parse_shapes, help="only these DB shapes, in this order: VxH or VxHxTOKENS, comma separated")
    p.add_argument("--max-shapes", type=int, help="at most this many shapes (after --shapes)")
    p.add_argument("--time-budget-s", type=float,
                   help="seconds for the whole run: a shape is not started if the slowest one so far would not fit; "
                        "results are written after every shape either way")
    p.add_argument("--rep-ms", type=float, default=200.0, help="do_bench rep time per measurement (ms)")
    p.add_argument("--turns", type=int, default=2, help="rounds per shape, each timing every variant once; a "
                   "variant's time is the median of its rounds (default 2)")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--no-liger", action="store_true")
    p.add_argument("--resume", type=Path, metavar="JSON",
                   help="results .json of an earlier, partial run: keep its rows, measure the shapes it lacks")
    p.add_argument("--plot-from", type=Path, metavar="JSON",
                   help="draw the speed-up heat maps of an earlier run's results .json to <json>.png (no GPU) and exit")
    p.add_argument("--latest", type=Path, nargs="+", metavar="JSON",
                   help="results .json files of earlier runs: judge every DB entry by the newest row that timed "
                        "its current config, measure nothing (no GPU), and exit")
    p.add_argument("--liger-rule-shapes", choices=LIGER_RULE_SHAPES, default="target",
                   help="where to time our op with Liger's chunk rule: the 8192x2304x256000 target (default), "
                        "every shape, or nowhere")
    return p


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    p = build_parser()
    args = p.parse_args(argv)
    if args.max_shapes is not None and args.max_shapes < 1:
        p.error(f"--max-shapes must be >= 1, got {args.max_shapes}")
    if args.time_budget_s is not None and args.time_budget_s <= 0:
        p.error(f"--time-budget-s must be positive, got {args.time_budget_s}")
    if args.turns < 1:
        p.error(f"--turns must be >= 1, got {args.turns}")
    if args.plot_from is not None:
        print(f"wrote {plot_from(args.plot_from)}")
        return 0
    if args.latest is not None:
        try:
            return _latest(args.latest, args.shipped_only, args.out_dir, args.own_only)
        except (OSError, ValueError, KeyError) as exc:
            p.error(f"--latest: {exc}")
    if not torch.cuda.is_available():
        print("bench_tuning: needs a CUDA GPU", file=sys.stderr)
        return 2

    import triton  # noqa: PLC0415

    from flce_compile.tuning import db  # noqa: PLC0415

    def on_sigterm(signum: int, frame: Any) -> None:  # noqa: ARG001 - `timeout` sends SIGTERM
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_sigterm)
    gpu = torch.cuda.get_device_name()
    kind = db.normalize_device_name(gpu)
    entries = entries_served(db.load_entries(layer="shipped" if args.shipped_only else "merged"), kind,
                             own_only=args.own_only)
    entries = select_entries(entries, args.shapes, args.max_shapes)
    liger = None if args.no_liger else _liger()
    print(f"{gpu} ({kind}); torch {torch.__version__}, triton {triton.__version__}; {len(entries)} DB shapes; "
          f"liger {'yes' if liger else 'not available'}", flush=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    meta = {"gpu": gpu, "gpu_kind": kind, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "date": stamp, "dtype": "bf16", "pass": "fwd+bwd",
            "timing": "triton.testing.do_bench median, >= 10 timed runs, the median of --turns rounds",
            "rep_ms": args.rep_ms, "turns": args.turns,
            "peak": "max_memory_allocated above inputs and returned dX/dW, 1e9 bytes", "liger": bool(liger),
            "liger_rule_shapes": args.liger_rule_shapes, "shipped_only": args.shipped_only,
            "own_only": args.own_only}
    base = args.out_dir / f"bench_tuning_{kind}_{stamp}"
    kept: list[dict[str, Any]] = []
    if args.resume is not None:
        try:
            payload = json.loads(args.resume.read_text())
            kept, entries = resume_state(payload, meta, entries)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            p.error(f"--resume {args.resume}: {exc}")
        meta = {**payload["meta"], "resumed": [*payload["meta"].get("resumed", []), stamp]}
        base = args.out_dir / args.resume.stem
        print(f"resuming {args.resume.name}: {len(kept)} shapes kept, {len(entries)} to measure", flush=True)
    final: dict[str, Any] = {}

    def write(rows: list[dict[str, Any]], not_measured: list[Any], complete: bool) -> None:
        rows = kept + rows
        write_results(base, meta, rows, not_measured, complete)
        final.update(rows=rows, complete=complete)

    def measure(e: Any) -> dict[str, Any]:
        liger_rule = args.liger_rule_shapes == "all" or (
            args.liger_rule_shapes == "target" and (e.vocab, e.hidden, e.tokens) == TARGET)
        return _measure_entry(e, liger, args.rep_ms, liger_rule, kind, args.turns)

    budget = None if args.time_budget_s is None else args.time_budget_s - (time.monotonic() - started)
    status = run_shapes(entries, measure, write, time_budget_s=budget)
    lines, target_status, never_slower = summarize(final.get("rows", []))
    print("\n".join(lines))
    print(f"target 8192x2304x256000 tuned >= {TARGET_SPEEDUP}x the default rule: {target_status}")
    print(f"tuned never slower than default (tolerance {NOT_SLOWER_TOLERANCE}): {never_slower}")
    print(f"default never slower than Liger: {never_slower_than_liger(final.get('rows', []))}")
    print(f"a call without options runs the entry timed: {op_runs_entries(final.get('rows', []))}")
    print(f"wrote {base}.json and {base}.md" + ("" if final.get("complete") else " (partial)"))
    try:
        print(f"wrote {plot_speedups(final.get('rows', []), base.with_suffix('.png'), plot_heading(meta))}")
    except ImportError as exc:  # the GPU machine may lack matplotlib: redraw later with --plot-from
        print(f"no plot ({exc}); draw it with --plot-from {base}.json")
    return status


if __name__ == "__main__":
    sys.exit(main())
