"""``flce-tune``: tune the fused op for given shapes on this GPU and store the results in the tuning database.

Why a CLI: tuning needs minutes of GPU time per shape, so it is done once per GPU kind (the results ship in
``tuning_db/``) or by a user for their own shapes (the user DB). Each finished study is written at once, so an
interrupted or time-limited run still leaves valid entries behind. This module may print; the library does not.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn, Sequence

from ..plan import registry
from .studies import DEFAULT_KEEP as DEFAULT_KEEP_STUDIES  # stdlib only: --help stays free of Optuna

#: The (V, H) pairs shipped in tuning_db/, most important first (a time-limited run covers the head).
SHIPPED_SHAPES: tuple[tuple[int, int, str], ...] = (
    (256000, 2304, "Gemma-2 2B"),
    (128256, 4096, "Llama-3 8B"),
    (151936, 4096, "Qwen3 8B"),
    (128256, 2048, "Llama-3.2 1B"),
    (128256, 3072, "Llama-3.2 3B"),
    (128256, 8192, "Llama-3 70B"),
    (151936, 1024, "Qwen3 0.6B"),
    (151936, 2560, "Qwen3 4B"),
    (151936, 5120, "Qwen3 14B/32B"),
    (256000, 3584, "Gemma-2 9B"),
    (262144, 2560, "Gemma-3 4B"),
    (32768, 4096, "Mistral 7B"),
    (131072, 5120, "Mistral-Nemo 12B"),
    (50257, 768, "GPT-2"),
    (129280, 7168, "DeepSeek-V3"),
    (32064, 3072, "Phi-3 mini"),
)
#: The budget of a study when neither --budget-gb nor --budget-over-default-gb is given: the default config's
#: predicted peak plus this (GiB), as for the shipped entries. Without it a search is free to trade any memory
#: for a little speed (a 4.98 GB config at 151936 x 4096, as much as torch.compile's own logits).
DEFAULT_OVER_DEFAULT_GIB = 0.5
#: With --time-budget-s, a study is not started with less time than this left (setup + the default's trial).
MIN_STUDY_S = 5.0
#: Token buckets the shipped files cover.
SHIPPED_TOKENS: tuple[int, ...] = (4096, 8192, 16384, 32768, 65536)

EXAMPLES = """\
examples:
  # tune one shape at two token counts (bf16), 40 measured trials each, into the user DB
  flce-tune --vocab 151936 --hidden 4096 --tokens 8192 16384

  # at most 20 GiB of extra GPU memory for the op, 10 minutes per study: a budget-tier entry, used by calls
  # with memory_budget_gb >= 20 (the plain entry stays)
  flce-tune --vocab 128256 --hidden 4096 --budget-gb 20 --timeout 600

  # the shipped low-memory tier: 0.5 GiB at 16384 tokens (only "recompute" fits at most shapes)
  flce-tune --shipped-set --budget-gb 0.5 --tokens 16384 --trials 4 --out tuning_db/

  # tune the shipped shape list at 8192 tokens, 8 trials each, 400 s in total, into tuning_db/<gpu>.json;
  # run it again with --skip-existing to finish what a time-limited run left out
  flce-tune --shipped-set --tokens 8192 --trials 8 --time-budget-s 400 --out tuning_db/
  flce-tune --shipped-set --tokens 8192 16384 --trials 8 --time-budget-s 400 --out tuning_db/ --skip-existing

  # after a change to the CE kernel: re-pick the CE tile of every entry of this GPU in the shipped file (the
  # CE step timed alone, then the whole call against the default); a time-limited run resumes with
  # --skip-existing, which skips only the tiles already picked for this CE kernel revision
  flce-tune --retune-ce-tiles --out tuning_db/ --time-budget-s 500
  flce-tune --retune-ce-tiles --out tuning_db/ --skip-existing

  # what is in the databases, and copy the user DB into shipped-format files
  flce-tune --list
  flce-tune --show --vocab 151936
  flce-tune --export tuning_db/

  # which config the op would run for a problem on an H200, and where it comes from (works without a GPU);
  # with --budget-gb, for a call with memory_budget_gb=0.5
  flce-tune --which --vocab 151936 --hidden 4096 --tokens 16384 --device-kind h200
  flce-tune --which --vocab 128256 --hidden 4096 --tokens 16384 --device-kind h200 --budget-gb 0.5

  # Optuna's plots of each study (history, importances, chunk vs block size) into plots/; the last 20 studies
  # are kept beside the user DB, so their plots can be redrawn later (no GPU needed)
  flce-tune --vocab 151936 --hidden 4096 --plot plots/
  flce-tune --list-studies
  flce-tune --plot plots/ --replot                     # every kept study, or name some

environment:
  FLCE_TUNING_DB          the user DB file (default ~/.cache/flce_compile/tuning_db.json)
  FLCE_TUNING_DB_SHIPPED  a directory used instead of the shipped tuning_db/ (development)
"""


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:  # "a,,b" or a trailing comma: a shape may have been lost in the typing
            raise argparse.ArgumentTypeError(f"{text!r} has an empty item; separate VOCABxHIDDEN items with single "
                                             "commas, e.g. 151936x4096,128256x4096")
        try:
            v, h = (int(n) for n in part.split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"item {part!r} must look like VOCABxHIDDEN, e.g. 151936x4096") from None
        if v < 1 or h < 1:
            raise argparse.ArgumentTypeError(f"item {part!r} needs a positive VOCAB and HIDDEN, e.g. 151936x4096")
        shapes.append((v, h))
    if not shapes:
        raise argparse.ArgumentTypeError("--shapes needs at least one VOCABxHIDDEN item")
    return shapes


class _Parser(argparse.ArgumentParser):
    """An argument error is one line naming the option and the fix (argparse's usage block is 11 lines and
    hides it); ``--help`` still prints the usage."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="flce-tune",
        description="Autotune flce_compile's fused linear + cross-entropy op on this GPU and record the best "
                    "configs in the tuning database.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = p.add_argument_group("what to tune")
    what.add_argument("--vocab", type=int, help="vocabulary size V (rows of the weight)")
    what.add_argument("--hidden", type=int, help="hidden size H")
    what.add_argument("--shapes", type=_parse_shapes, help="several shapes: VxH,VxH,... (instead of --vocab/--hidden)")
    what.add_argument("--shipped-set", action="store_true",
                      help=f"tune the {len(SHIPPED_SHAPES)} shipped (V, H) shapes, most important first")
    what.add_argument("--tokens", type=int, nargs="+",
                      help="token counts (stored per power-of-two bucket); default 16384, or 8192 with --shipped-set; "
                           "also a filter for --list/--show; --which needs it")
    what.add_argument("--dtype", choices=("bf16", "fp16", "fp32", "fp64"),
                      help="input dtype (default bf16; also a filter for --list/--show; fp64 only for --which: the "
                           "op runs it with the heuristic, which has nothing to tune)")
    what.add_argument("--strategies", nargs="+", choices=registry.names(),
                      help="strategies to search (default all; without --budget-gb the \"recompute\" one is left "
                           "out, as the op runs it only when forced): " + "; ".join(
                          f"{s.name}: {s.summary}" for s in map(registry.get, registry.names())))
    how = p.add_argument_group("how long / how much")
    how.add_argument("--trials", type=int, help="measured trials per study (default 40, 8 with --shipped-set)")
    how.add_argument("--budget-gb", type=float,
                     help="memory budget for the op (GiB, predicted and measured peak). Each winner is written as a "
                          "budget-tier entry tagged with it, beside the plain entry: the op uses it for calls with "
                          "memory_budget_gb >= GB. With --which: answer for a call with this budget; with --list / "
                          "--show: only that tier's entries")
    how.add_argument("--budget-over-default-gb", type=float, metavar="GB",
                     help="per-study memory budget: the default config's predicted peak plus GB (GiB), so a "
                          "tuned entry never costs much more memory than the default (combines with --budget-gb; "
                          f"without either, {DEFAULT_OVER_DEFAULT_GIB} GiB, as for the shipped entries)")
    how.add_argument("--timeout", type=float, help="seconds per study (search stops starting trials after it)")
    how.add_argument("--time-budget-s", type=float,
                     help="seconds for the whole run (from the start of the command, after Python imports), "
                          f"shared out among the remaining studies by their work (V x H x tokens, at least "
                          f"{MIN_STUDY_S:g} s each); studies that do not fit are skipped and everything finished so "
                          "far is written. The last trial and the confirmation may run "
                          "over by a few seconds: leave a margin to any hard limit")
    how.add_argument("--skip-existing", action="store_true",
                     help="skip studies whose (GPU, V, H, dtype, token bucket) is already in the output file "
                          "(resume a partial run)")
    how.add_argument("--seed", type=int, default=0, help="sampler seed (default 0)")
    how.add_argument("--warmup", type=int, default=3, help="untimed runs per trial (default 3)")
    how.add_argument("--reps", type=int, default=10, help="minimum timed runs per trial, >= 10 (default 10)")
    how.add_argument("--no-confirm", action="store_true", help="skip re-measuring the winner against the default")
    how.add_argument("--memory-gain-margin", type=float, default=None, metavar="FRACTION",
                     help="a winner that needs more memory than the default must be this much faster in the "
                          "confirmation run (default 0.02 = 2%%; 0 = any gain)")
    how.add_argument("--device", default="cuda", help="CUDA device (default cuda)")
    where = p.add_argument_group("where results go")
    where.add_argument("--db", type=Path, help="user DB file to write/list (default $FLCE_TUNING_DB or "
                                               "~/.cache/flce_compile/tuning_db.json)")
    where.add_argument("--out", type=Path, help="write results in shipped format instead: a directory "
                                                "(<dir>/<gpu>.json) or a .json file")
    db = p.add_argument_group("database")
    db.add_argument("--list", action="store_true", help="list DB entries (one line each)")
    db.add_argument("--show", action="store_true", help="show DB entries with configs and timings")
    db.add_argument("--export", type=Path, metavar="PATH", help="write the user DB's entries in shipped format "
                                                                 "(a directory: one <gpu>.json per GPU kind)")
    db.add_argument("--retune-ce-tiles", action="store_true",
                    help="re-pick the CE kernel's tile (block_v, num_warps, num_stages) of the entries of this GPU "
                         "in --out FILE/DIR (or the user DB), filtered by --vocab/--hidden/--tokens: the CE step "
                         "timed alone per tile, then the whole call measured against the default and the entry "
                         "rewritten (triton-strategy plain entries; others are listed as kept)")
    db.add_argument("--which", action="store_true",
                    help="print the config the op would run for --vocab/--hidden/--tokens (and --dtype) and its "
                         "source: user exact, shipped exact, nearest bucket, nearest shape or heuristic")
    db.add_argument("--device-kind", help="filter --list/--show/--export by GPU kind, e.g. h200; with --which, the "
                                          "GPU kind to answer for (default: this machine's GPU, or its CPU)")
    plots = p.add_argument_group("plots and kept studies")
    plots.add_argument("--plot", type=Path, metavar="DIR",
                       help="after each study, save Optuna's plots as <study>_<plot>.png in DIR: optimization "
                            "history, parameter importances, contour (or slice) of chunk size against CE block size")
    plots.add_argument("--replot", nargs="*", metavar="STUDY",
                       help="redraw kept studies into --plot DIR without tuning: the named ones, or all")
    plots.add_argument("--list-studies", action="store_true", help="list the kept studies (one line each)")
    plots.add_argument("--keep-studies", type=int, default=DEFAULT_KEEP_STUDIES, metavar="N",
                       help=f"keep the last N studies (Optuna journal files) in <user DB>.studies/ beside the user "
                            f"DB (default {DEFAULT_KEEP_STUDIES}; 0 keeps none and prunes nothing)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


# ------------------------------------------------------------------------------------------------------------
# --list / --show / --export
# ------------------------------------------------------------------------------------------------------------


#: Printed when there is no user DB path: no --db, no $FLCE_TUNING_DB and no home directory.
NO_USER_DB = "no user tuning DB: this process has no home directory; pass --db FILE or set FLCE_TUNING_DB"


def _user_path(args: argparse.Namespace) -> Path | None:
    """--db, else $FLCE_TUNING_DB or ~/.cache/...; None without a home directory (see db.user_db_path)."""
    from . import db  # noqa: PLC0415

    return args.db.expanduser() if args.db else db.user_db_path()


def _required_user_path(args: argparse.Namespace, what: str) -> Path | None:
    """The user DB path for a command that needs one; None after printing ``flce-tune: <what>: <why there is
    none and what to pass>``."""
    path = _user_path(args)
    if path is None:
        print(f"flce-tune: {what}: {NO_USER_DB}", file=sys.stderr)
    return path


def _db_rows(args: argparse.Namespace) -> list[tuple[Any, str]]:
    """(entry, source) for every entry in the user file and the shipped files, user first, filtered."""
    from . import db  # noqa: PLC0415

    user_path = _user_path(args)
    user = db.read_file(user_path) if user_path is not None else []
    user_keys = {e.key for e in user}  # with the budget tier: a user tier entry overrides only that tier
    rows: list[tuple[Any, str]] = [(e, f"user:{user_path}") for e in user]
    for path in db.shipped_files():
        for e in db.read_file(path):
            rows.append((e, f"shipped:{path.name}" + (" (overridden)" if e.key in user_keys else "")))
    dtype = args.dtype

    buckets = {db.token_bucket(t) for t in args.tokens} if args.tokens else None

    def keep(e: Any) -> bool:
        return ((args.vocab is None or e.vocab == args.vocab) and (args.hidden is None or e.hidden == args.hidden)
                and (args.device_kind is None or e.device == db.normalize_device_name(args.device_kind))
                and (dtype is None or e.dtype == dtype) and (buckets is None or e.tokens in buckets)
                and (args.budget_gb is None or e.budget_tier_gb == args.budget_gb))

    return sorted((r for r in rows if keep(r[0])), key=lambda r: (r[0].sort_key, r[1]))


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _tier(entry: Any) -> str:
    """An entry's budget tier for listings: "0.5GiB", or "-" for a plain entry."""
    return "-" if entry.budget_tier_gb is None else f"{entry.budget_tier_gb:g}GiB"


def _print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h)) for i, h in enumerate(headers)]
    print("  ".join(str(h).ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))


def cmd_list(args: argparse.Namespace, detailed: bool) -> int:
    from . import db  # noqa: PLC0415

    rows = _db_rows(args)
    if not rows:
        filtered = any(f is not None for f in (args.vocab, args.hidden, args.device_kind, args.dtype, args.budget_gb)) \
            or args.tokens
        print("no tuning DB entries" + (" match the filters" if filtered else ""))
        print(f"user DB: {_user_path(args) or NO_USER_DB}; shipped: {', '.join(map(str, db.shipped_dirs())) or 'none'}")
        return 0
    if not detailed:
        _print_table(("device", "V", "H", "dtype", "tokens", "budget", "ms", "speedup", "source"),
                     [(e.device, e.vocab, e.hidden, e.dtype, e.tokens, _tier(e), _fmt(e.ms, ".3f"),
                       _fmt(e.speedup, ".2f") + "x", src) for e, src in rows])
        return 0
    for e, src in rows:
        tier = "" if e.budget_tier_gb is None else f" budget {_tier(e)}"
        print(f"{e.device} V={e.vocab} H={e.hidden} {e.dtype} tokens={e.tokens}{tier}  [{src}]")
        print(f"  config:  {e.config.to_json()}")
        print(f"  tuned:   {_fmt(e.ms, '.3f')} ms, peak {_fmt(e.peak_gb, '.2f')} GB")
        print(f"  default: {_fmt(e.default_ms, '.3f')} ms, peak {_fmt(e.default_peak_gb, '.2f')} GB"
              f"  (speedup {_fmt(e.speedup, '.2f')}x)")
        print(f"  trials {e.trials}, torch {e.torch}, triton {e.triton}, {e.date}"
              + (f", {e.extra.get('device_name')}" if e.extra.get("device_name") else ""))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from . import db  # noqa: PLC0415

    user_path = _required_user_path(args, "nothing to export")
    if user_path is None:
        return 1
    entries = db.read_file(user_path)
    if args.device_kind:
        kind = db.normalize_device_name(args.device_kind)
        entries = [e for e in entries if e.device == kind]
    if not entries:
        held = "does not exist" if not user_path.exists() else "has no entries" + (
            " for that --device-kind" if args.device_kind else "")
        print(f"flce-tune: nothing to export: {user_path} {held}", file=sys.stderr)
        return 1
    try:
        paths = db.export_shipped(args.export, entries)
    except (OSError, ValueError) as exc:  # unwritable path, a foreign file there, several kinds into one file
        print(f"flce-tune: could not export to {args.export}: {exc}", file=sys.stderr)
        return 1
    for path in paths:
        print(f"wrote {path}")
    return 0


def cmd_which(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """--which: what ``flce_compile.which_config`` answers, one block per token count."""
    from .which import which_config  # noqa: PLC0415

    if args.vocab is None or args.hidden is None or not args.tokens:
        p.error("--which needs --vocab V --hidden H --tokens N [N ...]; e.g. --which --vocab 151936 --hidden 4096 "
                "--tokens 16384 --device-kind h200")
    dtype = args.dtype or "bf16"
    if args.device_kind is not None:
        _note_unknown_kind(args)
    for tokens in args.tokens:
        try:
            choice = which_config(tokens, args.vocab, args.hidden, dtype, gpu=args.device_kind,
                                  memory_budget_gb=args.budget_gb)
        except ValueError as exc:
            p.error(str(exc))
        print(f"V={args.vocab} H={args.hidden} {dtype} tokens={tokens} on {choice}")
    return 0


def _note_unknown_kind(args: argparse.Namespace) -> None:
    """Say on stderr when no tuning entry, shipped or the user's, is of ``--device-kind`` or of its family: the
    answer is then the heuristic's, and the kind may be misspelt. (A kind of its family's entries answers from them.)"""
    from ..plan.tuning_db import kind_is_served  # noqa: PLC0415
    from . import db  # noqa: PLC0415

    kind = db.normalize_device_name(args.device_kind)
    user_path = _user_path(args)
    files = ([user_path] if user_path is not None else []) + list(db.shipped_files())
    kinds = {e.device for path in files for e in db.read_file(path)}
    if not kind_is_served(kind, kinds):
        print(f"flce-tune: no tuning entries for GPU kind {args.device_kind!r} (normalized {kind!r}) or its family; "
              f"the answers below are the heuristic's. Kinds held: {', '.join(sorted(kinds)) or 'none'}",
              file=sys.stderr)


# ------------------------------------------------------------------------------------------------------------
# --plot / --replot / --list-studies
# ------------------------------------------------------------------------------------------------------------


def _studies_dir(args: argparse.Namespace, what: str | None = None) -> Path | None:
    """Where studies are kept: beside the user DB (--db or $FLCE_TUNING_DB or ~/.cache/...), also with --out.
    None without a user DB; with ``what``, a command that needs the studies, after saying so."""
    from . import studies  # noqa: PLC0415

    user = _user_path(args) if what is None else _required_user_path(args, what)
    return None if user is None else studies.studies_dir(user)


def _prepare_plot_dir(args: argparse.Namespace) -> str | None:
    """Check --plot DIR before any work: matplotlib importable, DIR created and writable. Returns the error line
    to print, or None."""
    from . import plots  # noqa: PLC0415

    try:
        plots.require_matplotlib()
        plots.prepare_dir(args.plot.expanduser())
    except (ImportError, OSError) as exc:
        return f"flce-tune: --plot DIR: {exc}"
    return None


def _draw(study: Any, args: argparse.Namespace) -> None:
    """Draw one study's plots into --plot DIR and say how many (skipped ones are logged by tuning.plots)."""
    from . import plots  # noqa: PLC0415

    written = plots.draw_study(study, args.plot.expanduser())
    print(f"flce-tune: {len(written)} plots of {study.study_name} in {args.plot}", file=sys.stderr)


def _optuna_missing(what: str) -> bool:
    """Whether Optuna cannot be imported; if so, after saying that ``what`` needs it (one line, not the traceback
    of the ``import optuna`` that tuning or reading a kept study would hit)."""
    if importlib.util.find_spec("optuna") is not None:
        return False
    print(f"flce-tune: {what} needs Optuna, a dependency of flce-compile that this environment lacks: "
          "pip install optuna", file=sys.stderr)
    return True


def cmd_list_studies(args: argparse.Namespace) -> int:
    """--list-studies: one line per kept study, oldest first: name, complete trials, best time."""
    from . import studies  # noqa: PLC0415

    directory = _studies_dir(args, "no kept studies")
    if directory is None:
        return 1
    kept = studies.kept_studies(directory)
    if not kept:
        print(f"no kept studies in {directory}")
        return 0
    if _optuna_missing("reading the kept studies"):  # (their journal files are Optuna's)
        return 2
    rows = []
    for item in kept:
        try:
            values = [t.value for t in studies.load(directory, item.name).get_trials(deepcopy=False)
                      if t.value is not None]
            rows.append((item.name, str(len(values)), _fmt(min(values, default=None), ".3f")))
        except studies.StudyError as exc:
            print(f"flce-tune: {exc}", file=sys.stderr)
            rows.append((item.name, "-", "unreadable"))
    _print_table(("study", "complete trials", "best ms"), rows)
    print(f"\n{len(kept)} kept in {directory}")
    return 0


def cmd_replot(args: argparse.Namespace) -> int:
    """--plot DIR --replot [STUDY ...]: redraw kept studies (all when none is named) without tuning. Every named
    study is loaded before anything is drawn, so a wrong name fails fast."""
    from . import studies  # noqa: PLC0415

    directory = _studies_dir(args, "no kept studies to redraw")
    if directory is None:
        return 1
    names = args.replot or [item.name for item in studies.kept_studies(directory)]
    if not names:
        print(f"flce-tune: no kept studies to redraw in {directory}; studies are kept while tuning "
              f"(--keep-studies N, default {DEFAULT_KEEP_STUDIES})", file=sys.stderr)
        return 1
    if _optuna_missing("--replot"):
        return 2
    try:
        loaded = [studies.load(directory, name) for name in names]
    except studies.StudyError as exc:
        print(f"flce-tune: --replot: {exc}", file=sys.stderr)
        return 1
    try:
        for study in loaded:
            _draw(study, args)
    except OSError as exc:
        print(f"flce-tune: --plot {args.plot}: could not write a plot: {exc}", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------------------------------------------------
# tuning
# ------------------------------------------------------------------------------------------------------------


class _Progress:
    """A progress bar per study: tqdm when installed, else one line per measured trial on stderr."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.done = total, desc, 0
        try:
            from tqdm import tqdm  # noqa: PLC0415

            self.bar: Any = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=True)
        except ImportError:
            self.bar = None

    def update(self, record: Any, result: Any) -> None:
        if not record.measured:
            return
        self.done += 1
        best = f"{result.best_ms:.3f} ms" if result.best_ms is not None else "-"
        if self.bar is not None:
            self.bar.set_postfix_str(f"best {best}, last {record.status}", refresh=False)
            self.bar.update(1)
        else:
            print(f"  {self.desc} [{self.done}/{self.total}] {record.status:<8} best {best}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _studies(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    if args.shipped_set:
        shapes = [(v, h) for v, h, _ in SHIPPED_SHAPES]
    elif args.shapes:
        shapes = args.shapes
    else:
        shapes = [(args.vocab, args.hidden)]
    tokens = _one_per_bucket(args.tokens or ([8192] if args.shipped_set else [16384]))
    # token-major: every shape gets its first bucket before any shape gets a second one
    return [(v, h, t) for t in tokens for v, h in shapes]


def _one_per_bucket(tokens: Sequence[int]) -> list[int]:
    """``tokens`` with one count per token bucket, the first given: a DB file holds one entry a bucket, so a
    second study of it would spend device time only to overwrite the first one's entry."""
    from . import db  # noqa: PLC0415

    kept: dict[int, int] = {}
    for t in tokens:
        bucket = db.token_bucket(t)
        if bucket in kept:
            if t != kept[bucket]:
                print(f"flce-tune: --tokens {t} shares the {bucket}-token bucket with {kept[bucket]}; tuning "
                      f"{kept[bucket]} only (the DB holds one entry a bucket)", file=sys.stderr)
            continue
        kept[bucket] = t
    return list(kept.values())


def _time_share(left: float, studies: Sequence[tuple[int, int, int]]) -> float:
    """The first of ``studies``' share of the ``left`` seconds of --time-budget-s: in proportion to its GEMM work
    (V x H x tokens) among the studies still to run, at least MIN_STUDY_S and at most ``left``. An even split
    gave a 65536 x 262144 x 2560 study the time of a 65536 x 32064 x 3072 one (6.8x less work): on the H200
    several 65536-token studies stopped at their share after 2-5 trials, and time left over by small studies
    only reached the ones after them."""
    work = [vocab * hidden * tokens for vocab, hidden, tokens in studies]
    return min(left, max(MIN_STUDY_S, left * work[0] / sum(work)))


def _validate_shape_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--vocab, --hidden and --tokens are positive (tuning, --which and the listings' filters)."""
    for name in ("vocab", "hidden"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name} must be a positive integer, got {value}")
    if args.tokens and min(args.tokens) < 1:
        p.error(f"--tokens must be positive integers, got {args.tokens}")


def _validate_timing_args(p: argparse.ArgumentParser, args: argparse.Namespace,
                          positive: Sequence[tuple[str, str]]) -> None:
    """--warmup and --reps (tuning and --retune-ce-tiles), and the ``positive`` (option, unit) pairs: a positive
    finite number where given."""
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.reps < 10:
        p.error(f"--reps must be >= 10 (timing takes the median of at least 10 runs), got {args.reps}")
    _validate_positive(p, args, positive)


def _validate_positive(p: argparse.ArgumentParser, args: argparse.Namespace,
                       positive: Sequence[tuple[str, str]]) -> None:
    """The ``positive`` (option, unit) pairs: a positive finite number where given."""
    # "not (x > 0)" rather than "x <= 0": NaN compares false both ways and must not pass
    for name, unit in positive:
        value = getattr(args, name)
        scale = 2**30 if unit == "GiB" else 1  # (GiB become bytes: 1e300 GiB are not a finite number of them)
        if value is not None and not (math.isfinite(value * scale) and value > 0):
            p.error(f"--{name.replace('_', '-')} must be a positive finite number of {unit}, got {value}")


def _cuda_device(args: argparse.Namespace) -> Any:
    """--device as an indexed CUDA device, made current; None after saying why when it is not a CUDA device."""
    import torch  # noqa: PLC0415

    try:
        device = torch.device(args.device)
    except (RuntimeError, TypeError, ValueError):
        print(f"flce-tune: --device {args.device!r} is not a device; use e.g. --device cuda:0", file=sys.stderr)
        return None
    if device.type != "cuda":
        print(f"flce-tune: --device {args.device} is not a CUDA device; use e.g. --device cuda:0", file=sys.stderr)
        return None
    if device.index is None:  # torch 2.11's set_device rejects a device without an index
        device = torch.device("cuda", torch.cuda.current_device())
    count = torch.cuda.device_count()
    if device.index >= count:  # set_device would raise "CUDA error: invalid device ordinal" as a traceback
        print(f"flce-tune: --device {args.device}: this machine has {count} CUDA device(s), cuda:0 to "
              f"cuda:{count - 1}; use e.g. --device cuda:0", file=sys.stderr)
        return None
    torch.cuda.set_device(device)
    return device


def _validate_tune_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    chosen = sum(bool(x) for x in (args.shipped_set, args.shapes, args.vocab is not None or args.hidden is not None))
    if chosen != 1:
        p.error("give exactly one of: --vocab V --hidden H, --shapes VxH,..., --shipped-set (or --list/--show/--export/--which)")
    if (args.vocab is None) != (args.hidden is None):
        p.error("--vocab and --hidden go together; e.g. --vocab 151936 --hidden 4096")
    _validate_shape_args(p, args)
    if args.trials is not None and args.trials < 1:
        p.error(f"--trials must be >= 1, got {args.trials}")
    if not 0 <= args.seed < 2**32:
        p.error(f"--seed must be in [0, 2**32 - 1] (the sampler's seed range), got {args.seed}")
    _validate_timing_args(p, args, (("budget_gb", "GiB"), ("timeout", "seconds"), ("time_budget_s", "seconds")))
    if args.budget_over_default_gb is not None and not (math.isfinite(args.budget_over_default_gb * 2**30)
                                                        and args.budget_over_default_gb >= 0):
        p.error(f"--budget-over-default-gb must be >= 0 (GiB, finite), got {args.budget_over_default_gb}")
    if args.memory_gain_margin is not None and not 0 <= args.memory_gain_margin < 1:
        p.error(f"--memory-gain-margin must be in [0, 1), got {args.memory_gain_margin} (0.02 = 2%)")
    if args.keep_studies < 0:
        p.error(f"--keep-studies must be >= 0 (0 keeps no study), got {args.keep_studies}")
    if args.budget_gb is None and args.strategies and not _plain_strategies(args.strategies):
        p.error(f"--strategies {' '.join(args.strategies)}: a plain entry of these would not run (the op runs a "
                "\"recompute\" config only when a memory_budget_gb or config forces it); add --budget-gb G to tune "
                "a budget-tier entry, or search a strategy such as triton")


def _plain_strategies(strategies: Sequence[str]) -> tuple[str, ...]:
    """Those of ``strategies`` whose configs a plain entry may hold: the op runs them without being forced."""
    from ..plan.choose import runs_unforced  # noqa: PLC0415

    return tuple(s for s in strategies if runs_unforced(s))


def _study_budget(budget_bytes: int | None, over_default_gib: float | None, default_predicted: int | None,
                  label: str) -> int | None:
    """The memory budget of one study: ``--budget-gb``, and with ``--budget-over-default-gb`` at most the default
    config's predicted peak plus that many GiB (the smaller of the two when both are given). Without a memory
    model there is no predicted default peak: the relative budget is then left out (with a warning) rather
    than read as an absolute one."""
    if over_default_gib is None:
        return budget_bytes
    if default_predicted is None:
        print(f"flce-tune: {label}: no memory model to predict the default's peak; --budget-over-default-gb is "
              f"not applied" + (" (--budget-gb still is)" if budget_bytes is not None else ""), file=sys.stderr)
        return budget_bytes
    relative = default_predicted + int(over_default_gib * 2**30)
    return relative if budget_bytes is None else min(budget_bytes, relative)


def _begin_study(keep_dir: Path | None, kind: str, vocab: int, hidden: int, dtype: str,
                 tokens: int) -> tuple[str, Any]:
    """The study's name and the Optuna storage it runs in: a running journal file in ``keep_dir``, or None (in
    memory) when studies are not kept or the file cannot be made (the study still runs; a line says why)."""
    from . import db, studies  # noqa: PLC0415

    name = studies.new_study_name(kind, vocab, hidden, dtype, db.token_bucket(tokens))
    if keep_dir is None:
        return name, None
    try:
        return name, studies.running_storage(keep_dir, name)
    except OSError as exc:
        print(f"flce-tune: cannot keep study {name} in {keep_dir} ({exc}); it runs in memory", file=sys.stderr)
        return name, None


def _end_study(args: argparse.Namespace, keep_dir: Path | None, name: str, study: Any, kept: bool) -> int:
    """After a search returned: draw its plots (--plot), then keep the study (rename it into place and prune to
    --keep-studies) even if drawing failed. Returns 1 if the plots could not be written, else 0."""
    from . import studies  # noqa: PLC0415

    status = 0
    try:
        if args.plot is not None and study is not None:
            _draw(study, args)
    except OSError as exc:
        print(f"flce-tune: --plot {args.plot}: could not write the plots of {name}: {exc}", file=sys.stderr)
        status = 1
    finally:
        if kept and keep_dir is not None:
            try:
                studies.keep(keep_dir, name, args.keep_studies)
            except OSError as exc:  # a lock timeout too: the results are in the DB, only the study is lost
                print(f"flce-tune: could not keep study {name} in {keep_dir}: {exc}", file=sys.stderr)
    return status


def _drop_study(keep_dir: Path | None, name: str) -> None:
    """Delete the running file of a study that failed or was interrupted outside the search."""
    from . import studies  # noqa: PLC0415

    if keep_dir is not None:
        studies.discard(keep_dir, name)


def _output_file(args: argparse.Namespace, kind: str) -> Path | None:
    """The DB file results go to: --out (a .json file, or <dir>/<GPU kind>.json), else the user DB; None when
    there is neither."""
    from . import db  # noqa: PLC0415

    if args.out is None:
        return _user_path(args)
    return args.out if db.names_a_json_file(args.out) else args.out / f"{kind}.json"


def _writable_target(args: argparse.Namespace, target: Path, kind: str) -> bool:
    """Whether the results can go to ``target``; after saying why not, False. Asked before the first study (or
    re-timed entry), so a run never spends device time on results it then cannot keep."""
    from . import db  # noqa: PLC0415

    if args.out is not None and not db.names_a_json_file(args.out) and args.out.is_file():
        print(f"flce-tune: --out {args.out} is a file but not a .json one; name a .json file or a directory (results "
              f"go to <dir>/<GPU kind>.json)", file=sys.stderr)
        return False
    try:
        db.check_target(target)
        held = {e.device for e in db.read_file(target)} if target.is_file() else set()
    except (OSError, db.DBFileError) as exc:
        print(f"flce-tune: cannot write the results to {target}: {exc}", file=sys.stderr)
        return False
    if held == {target.stem} and target.stem != kind:  # the shipped layout keeps one kind a file (export_shipped)
        print(f"flce-tune: {target} holds the {target.stem} entries of the shipped layout, and this GPU is a {kind}; "
              f"write to {target.with_name(kind + '.json')} or to the directory (--out {target.parent})",
              file=sys.stderr)
        return False
    return True


def cmd_tune(args: argparse.Namespace, started: float) -> int:
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        print("flce-tune: no CUDA GPU is available (torch.cuda.is_available() is False). Tuning measures the op "
              "on the GPU it will run on; run flce-tune on a machine with an NVIDIA GPU and a CUDA build of torch. "
              "(--list, --show, --export, --which, --list-studies and --plot DIR --replot work without a GPU.)",
              file=sys.stderr)
        return 2

    if _optuna_missing("tuning"):  # the search's sampler, imported where it runs
        return 2

    from ..plan.choose import heuristic_config  # noqa: PLC0415
    from . import db  # noqa: PLC0415
    from .measure import Problem, make_objective  # noqa: PLC0415
    from .search import MEMORY_GAIN_MARGIN, run_search  # noqa: PLC0415
    from .space import SearchSpace  # noqa: PLC0415

    margin = MEMORY_GAIN_MARGIN if args.memory_gain_margin is None else args.memory_gain_margin

    device = _cuda_device(args)
    if device is None:
        return 2
    device_name = torch.cuda.get_device_name(device)
    kind = db.normalize_device_name(device_name)
    args.dtype = args.dtype or "bf16"
    dtype = db.torch_dtype(args.dtype)
    trials = args.trials or (8 if args.shipped_set else 40)
    budget_bytes = int(args.budget_gb * 2**30) if args.budget_gb else None
    tier = args.budget_gb  # an absolute budget makes every entry of this run a budget-tier entry
    studies = _studies(args)
    deadline = started + args.time_budget_s if args.time_budget_s else None
    target = _output_file(args, kind)
    if target is None:
        print(f"flce-tune: nowhere to write the results: {NO_USER_DB} (or --out DIR)", file=sys.stderr)
        return 2
    if not _writable_target(args, target, kind):
        return 2
    keep_dir = _studies_dir(args) if args.keep_studies > 0 else None
    print(f"flce-tune: {device_name} ({kind}), {len(studies)} studies, {trials} trials each, dtype {args.dtype}, "
          + (f"budget-tier entries for {tier:g} GiB, " if tier is not None else "") + f"writing to {target}" + (f", keeping the last {args.keep_studies} studies in {keep_dir}" if keep_dir else ""),
          file=sys.stderr)

    summary: list[tuple[str, ...]] = []
    written = 0
    status = 0
    for index, (vocab, hidden, tokens) in enumerate(studies):
        label = f"V={vocab} H={hidden} T={tokens}"
        # (read at each study: another flce-tune may have written the file meanwhile)
        held = {e.key for e in db.read_file(target)} if args.skip_existing else set()
        to_run = [(v, h, t) for v, h, t in studies[index:]
                  if (kind, v, h, args.dtype, db.token_bucket(t), tier) not in held]
        if not to_run or to_run[0] != (vocab, hidden, tokens):
            summary.append((str(vocab), str(hidden), str(tokens), "-", "-", "-", "-", "-", "0", "skipped (exists)"))
            continue
        study_timeout = args.timeout
        if deadline is not None:
            left = deadline - time.monotonic()
            if left < MIN_STUDY_S:
                for v, h, t in studies[index:]:
                    why = "skipped (time budget)" if (v, h, t) in to_run else "skipped (exists)"
                    summary.append((str(v), str(h), str(t), "-", "-", "-", "-", "-", "0", why))
                print(f"flce-tune: time budget spent; skipping {len(to_run)} studies", file=sys.stderr)
                break
            share = _time_share(left, to_run)
            study_timeout = share if study_timeout is None else min(study_timeout, share)
        study_start = time.monotonic()
        progress = _Progress(trials, label)
        study_name, storage = _begin_study(keep_dir, kind, vocab, hidden, args.dtype, tokens)
        try:
            problem = Problem(tokens=tokens, vocab=vocab, hidden=hidden, dtype=dtype, device=device, seed=args.seed)
            default = heuristic_config(tokens, vocab, hidden, dtype, device)
            found = _db_seed(vocab, hidden, dtype, tokens, device_name, tier)
            space_kwargs: dict[str, Any] = {"tokens": tokens, "vocab": vocab, "hidden": hidden, "dtype": dtype,
                                            "base": default}
            strategies = tuple(args.strategies or registry.names())
            if tier is None:  # a plain entry's config runs unforced: a "recompute" one would not run at all
                strategies = _plain_strategies(strategies)
            space_kwargs["strategies"] = strategies
            space = SearchSpace(**space_kwargs)
            over_default = args.budget_over_default_gb
            if over_default is None and budget_bytes is None:
                over_default = DEFAULT_OVER_DEFAULT_GIB
            study_budget = _study_budget(budget_bytes, over_default, space.predicted_bytes(default), label)
            if study_budget is not None:
                print(f"flce-tune: {label}: memory budget {study_budget / 2**30:.2f} GiB"
                      + ("" if budget_bytes is not None and study_budget == budget_bytes else
                         f" (the default's predicted peak + {over_default:g} GiB)"), file=sys.stderr)
                try:
                    space = replace(space, budget_bytes=study_budget).within_budget()
                except ValueError as exc:  # a property of the shape, not a failure: 16384 x 8192 needs 0.53 GiB
                    progress.close()
                    _drop_study(keep_dir, study_name)
                    print(f"flce-tune: {label}: {exc}; skipped", file=sys.stderr)
                    summary.append((str(vocab), str(hidden), str(tokens), "-", "-", "-", "-", "-", "0",
                                    "skipped (nothing fits the budget)"))
                    continue
                default = space.fit_default(default)
                if tier is not None:
                    print(f"flce-tune: {label}: strategies {', '.join(space.strategies)} fit; measured against "
                          f"{default.strategy} chunk_tokens={default.chunk_tokens}", file=sys.stderr)
            # made after the space: a budget nothing fits skips the study before the GPU holds its inputs
            objective = make_objective(problem, warmup=args.warmup, min_reps=args.reps, max_reps=max(50, args.reps))
            timeout = None if study_timeout is None else max(1.0, study_timeout - (time.monotonic() - study_start))
            result = run_search(objective, space, default=default, db_config=found,
                                n_trials=trials, timeout_s=timeout, seed=args.seed, budget_bytes=study_budget,
                                confirm=not args.no_confirm, on_trial=progress.update,
                                memory_gain_margin=margin, storage=storage, study_name=study_name)
            del objective
        except KeyboardInterrupt:
            progress.close()
            _drop_study(keep_dir, study_name)
            print(f"flce-tune: interrupted during {label}; results written so far are kept", file=sys.stderr)
            summary.append((str(vocab), str(hidden), str(tokens), "-", "-", "-", "-", "-", "-", "interrupted"))
            status = 130
            break
        except Exception as exc:  # noqa: BLE001 - one study's setup failure (e.g. OOM on inputs) must not end the run
            progress.close()
            _drop_study(keep_dir, study_name)
            print(f"flce-tune: {label} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            summary.append((str(vocab), str(hidden), str(tokens), "-", "-", "-", "-", "-", "0", f"failed: {type(exc).__name__}"))
            status = 1
            continue
        finally:
            torch.cuda.empty_cache()
        progress.close()
        note = result.stopped
        if result.failures():
            note += " (" + ", ".join(f"{k} {v}" for k, v in sorted(result.failures().items())) + ")"
        if result.best is not None and not result.db_config_tried:
            # Its winner was never measured against the entry that answers now (a tuned one, say): writing it
            # would replace that entry with an unproven config, and --skip-existing would then keep it.
            print(f"flce-tune: {label}: stopped after {result.n_measured} trials, before trying the tuning DB's "
                  f"current answer; not written (give more --trials or time)", file=sys.stderr)
            note += " (NOT WRITTEN: the DB's answer untried)"
        elif result.best is not None and result.best_ms is not None:
            versions = db.versions()
            entry = db.Entry(
                device=kind, vocab=vocab, hidden=hidden, dtype=args.dtype, tokens=db.token_bucket(tokens),
                config=result.best, ms=round(result.best_ms, 5),
                peak_gb=None if result.best_peak_bytes is None else round(result.best_peak_bytes / 1e9, 4),
                default_ms=None if result.default_ms is None else round(result.default_ms, 5),
                default_peak_gb=None if result.default_peak_bytes is None else round(result.default_peak_bytes / 1e9, 4),
                trials=result.n_measured, torch=versions["torch"], triton=versions["triton"], date=db.now_iso(),
                budget_tier_gb=tier,
                extra={"device_name": device_name, "default_config": result.default.to_dict(),
                       "budget_gb": args.budget_gb, "budget_over_default_gb": args.budget_over_default_gb,
                       "memory_gain_margin": margin,
                       "measured_tokens": tokens, "stopped": result.stopped},
            )
            try:
                db.write_entries(target, [entry])
                written += 1
            except Exception as exc:  # noqa: BLE001 - report and go on; the next study may still be written
                print(f"flce-tune: could not write {label} to {target}: {exc}", file=sys.stderr)
                note += " (NOT WRITTEN)"
                status = 1
        else:
            note = "no valid config; " + note
        summary.append((
            str(vocab), str(hidden), str(tokens), _fmt(result.default_ms, ".3f"), _fmt(result.best_ms, ".3f"),
            _fmt(result.speedup, ".2f") + "x" if result.speedup else "-",
            _fmt(None if result.default_peak_bytes is None else result.default_peak_bytes / 1e9, ".2f"),
            _fmt(None if result.best_peak_bytes is None else result.best_peak_bytes / 1e9, ".2f"),
            str(result.n_measured), note,
        ))
        ended = _end_study(args, keep_dir, study_name, result.study, kept=storage is not None)
        status = status or ended
        if result.stopped == "device_error":
            print("flce-tune: the GPU context broke; stopping. Re-run the remaining shapes in a new process.",
                  file=sys.stderr)
            status = 1
            break
        if result.stopped == "interrupted":
            status = 130
            break

    print()
    _print_table(("V", "H", "tokens", "default ms", "best ms", "speedup", "default GB", "best GB", "trials", "status"), summary)
    print(f"\n{written} entries written to {target} ({time.monotonic() - started:.0f} s)")
    return status


def cmd_retune_ce_tiles(p: argparse.ArgumentParser, args: argparse.Namespace, started: float) -> int:
    """--retune-ce-tiles: see ``cli_retune``; this prints its table."""
    import torch  # noqa: PLC0415

    from .cli_retune import COLUMNS, retune_ce_tiles  # noqa: PLC0415

    _validate_shape_args(p, args)
    _validate_timing_args(p, args, (("time_budget_s", "seconds"),))
    if not torch.cuda.is_available():
        print("flce-tune: --retune-ce-tiles times the CE kernel on a GPU, and there is none "
              "(torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    device = _cuda_device(args)
    if device is None:
        return 2
    from . import db  # noqa: PLC0415

    kind = db.normalize_device_name(torch.cuda.get_device_name(device))
    target = _output_file(args, kind)
    if target is None:
        print(f"flce-tune: --retune-ce-tiles: {NO_USER_DB} (or --out FILE/DIR)", file=sys.stderr)
        return 2
    if not _writable_target(args, target, kind):  # before any timing: each entry costs GPU time
        return 2
    _install_sigterm()
    status, rows, written = retune_ce_tiles(args, target, device, started)
    if rows:
        print()
        _print_table(COLUMNS, rows)
        print(f"\n{written} entries rewritten in {target} ({time.monotonic() - started:.0f} s)")
    return status


def _db_seed(vocab: int, hidden: int, dtype: Any, tokens: int, device_name: str, tier: float | None) -> Any:
    """The config a study enqueues as the database's current answer: for a budget-tier study the entry of the
    same tier and bucket (a re-tune starts from it), else what the op runs from the plain lookup (a one-chunk
    entry's longer calls: one chunk); None when the DB does not answer (the heuristic is the study's first trial)."""
    import torch  # noqa: PLC0415

    from ..plan.choose import choose_config_match  # noqa: PLC0415
    from . import db  # noqa: PLC0415

    if tier is not None:
        same = [m for m in db.find_budget_matches(vocab=vocab, hidden=hidden, dtype=dtype, tokens=tokens,
                                                  device=device_name, budget_gb=tier)
                if m.entry.budget_tier_gb == tier and m.entry.tokens == db.token_bucket(tokens)]
        if same:
            return same[0].config
    config, _source, match = choose_config_match(tokens, vocab, hidden, dtype, torch.device("cuda"),
                                                 gpu=db.normalize_device_name(device_name))
    return None if match is None else config


def _install_sigterm() -> None:
    """Turn SIGTERM (e.g. from `timeout`) into KeyboardInterrupt so the current study's best is still written."""
    def handler(signum: int, frame: Any) -> None:  # noqa: ARG001
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """The ``flce-tune`` command. Output piped into a reader that stops early (``| head``) ends it quietly."""
    try:
        return _main(argv)
    except BrokenPipeError:
        # Python would report the pipe again when it flushes stdout at exit: point stdout at nothing first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: Sequence[str] | None) -> int:
    started = time.monotonic()
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("flce_compile").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    if args.db is not None and args.out is None:
        os.environ["FLCE_TUNING_DB"] = str(args.db.expanduser())  # lookups (DB seeds, --which) read the same file
        from . import db  # noqa: PLC0415

        db.invalidate_cache()  # lookups re-check the environment only once a second
    user = _user_path(args)
    if user is not None and (not user.name or user.is_dir()):
        parser.error(f"the tuning DB {user} ({'--db' if args.db else '$FLCE_TUNING_DB'}) is a directory; name a .json "
                     f"file, e.g. {user / 'tuning_db.json'}")
    from .which import is_gpu_kind  # noqa: PLC0415

    if args.device_kind is not None and not is_gpu_kind(args.device_kind):
        parser.error(f"--device-kind {args.device_kind!r}: name a GPU kind, e.g. h200 or \"NVIDIA H200\" (flce-tune "
                     "--list shows the kinds held); a device such as cuda:0 goes to --device, and the CPU has no "
                     "tuning entries")
    modes = sum(bool(x) for x in (args.list, args.show, args.export is not None, args.which, args.list_studies,
                                  args.replot is not None, args.retune_ce_tiles))
    if modes > 1:
        parser.error("--list, --show, --export, --which, --list-studies, --replot and --retune-ce-tiles are "
                     "separate modes; give one")
    if args.dtype == "fp64" and not args.which:  # (which_config answers fp64: the heuristic, the torch strategy)
        parser.error("--dtype fp64 goes with --which only: the op runs fp64 with its heuristic, which has nothing to "
                     "tune, and the tuning DB holds no fp64 entries")
    if args.plot is not None and modes and args.replot is None:
        parser.error("--plot DIR goes with tuning or --replot; drop it here")
    if args.list or args.show or args.export is not None or args.which:
        _validate_shape_args(parser, args)
        _validate_positive(parser, args, (("budget_gb", "GiB"),))
    if args.list or args.show:
        return cmd_list(args, detailed=args.show)
    if args.export is not None:
        return cmd_export(args)
    if args.which:
        return cmd_which(parser, args)
    if args.list_studies:
        return cmd_list_studies(args)
    if args.retune_ce_tiles:
        return cmd_retune_ce_tiles(parser, args, started)
    if args.replot is not None and args.plot is None:
        parser.error("--replot needs --plot DIR, where the redrawn plots go; e.g. --plot plots/ --replot")
    if args.replot is None:
        _validate_tune_args(parser, args)
    if args.plot is not None and (problem := _prepare_plot_dir(args)) is not None:
        print(problem, file=sys.stderr)
        return 2
    if args.replot is not None:
        return cmd_replot(args)
    _install_sigterm()
    return cmd_tune(args, started)


if __name__ == "__main__":
    sys.exit(main())
