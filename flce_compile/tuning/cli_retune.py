"""``flce-tune --retune-ce-tiles``: re-pick the CE kernel tile of the entries in a tuning DB file on this GPU
(``ce_tiles`` says why and how). Each entry is written as soon as it is done, so a time-limited or killed run
keeps what it finished, and ``--skip-existing`` resumes it. This module may print; the library does not.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any


def _already_retuned(entry: Any, versions: dict[str, str | None]) -> bool:
    """Whether ``entry`` was re-picked by this torch and triton for this revision of the CE kernel (what
    ``--skip-existing`` skips); a pick that records no revision was made for revision 1."""
    from ..kernels import CE_CHUNK_REVISION  # noqa: PLC0415

    record = entry.extra.get("ce_tile_retune")
    return (isinstance(record, dict) and record.get("kernel_revision", 1) == CE_CHUNK_REVISION
            and entry.torch == versions["torch"] and entry.triton == versions["triton"])


#: The summary table's columns, one row per entry (``retune_ce_tiles``'s rows).
COLUMNS = ("entry", "tile", "CE step ms", "call ms", "default ms", "status")


def retune_ce_tiles(args: argparse.Namespace, target: Path, device: Any,
                    started: float) -> tuple[int, list[tuple[str, ...]], int]:
    """Re-pick the CE tiles of ``target``'s entries for the GPU kind of ``device`` (an indexed CUDA device, made
    current by the caller), filtered by --vocab/--hidden/--tokens. Returns (exit status, one row per entry under
    ``COLUMNS``, entries rewritten); progress goes to stderr."""
    import torch  # noqa: PLC0415

    from ..plan.choose import heuristic_config  # noqa: PLC0415
    from . import ce_tiles, db  # noqa: PLC0415
    from .measure import Problem, make_objective  # noqa: PLC0415

    device_name = torch.cuda.get_device_name(device)
    kind = db.normalize_device_name(device_name)
    entries = [e for e in db.read_file(target) if e.device == kind
               and (args.vocab is None or e.vocab == args.vocab) and (args.hidden is None or e.hidden == args.hidden)
               and (not args.tokens or e.tokens in {db.token_bucket(t) for t in args.tokens})]
    if not entries:
        print(f"flce-tune: --retune-ce-tiles: {target} has no {kind} entries"
              + (" that match the filters" if args.vocab or args.hidden or args.tokens else ""), file=sys.stderr)
        return 1, [], 0
    versions = db.versions()
    stamp = {"torch": versions["torch"], "triton": versions["triton"]}
    deadline = started + args.time_budget_s if args.time_budget_s else None
    timer = ce_tiles.ce_step_timer(device)
    timings: dict = {}
    rows: list[tuple[str, ...]] = []
    written = status = 0
    print(f"flce-tune: re-picking the CE tiles of {len(entries)} {kind} entries in {target}", file=sys.stderr)
    for entry in entries:
        label = f"V={entry.vocab} H={entry.hidden} T={entry.tokens}" + (
            f" ({entry.budget_tier_gb:g} GiB)" if entry.budget_tier_gb is not None else "")
        if args.skip_existing and _already_retuned(entry, versions):
            rows.append((label, "-", "-", "-", "-", "skipped (done)"))
            continue
        if deadline is not None and time.monotonic() > deadline:
            rows.append((label, "-", "-", "-", "-", "skipped (time budget)"))
            continue
        objective = None

        def whole_call(e: Any, config: Any) -> tuple[float, int]:
            nonlocal objective
            if objective is None:  # inputs and the fp32 reference, once per entry
                problem = Problem(tokens=e.measured_tokens, vocab=e.vocab, hidden=e.hidden,
                                  dtype=db.torch_dtype(e.dtype), device=device, seed=args.seed)
                objective = make_objective(problem, warmup=args.warmup, min_reps=args.reps,
                                           max_reps=max(50, args.reps))
            return objective(config)

        try:
            default = heuristic_config(entry.measured_tokens, entry.vocab, entry.hidden,
                                       db.torch_dtype(entry.dtype), device)
            result = ce_tiles.retune_entry(entry, timer, whole_call, default, timings,
                                           stamp={**stamp, "date": db.now_iso()})
        except KeyboardInterrupt:  # also SIGTERM (``timeout``): what is written stays; say where it stopped
            print(f"flce-tune: interrupted during {label}; entries rewritten so far are kept (resume with "
                  f"--skip-existing)", file=sys.stderr)
            rows.append((label, "-", "-", "-", "-", "interrupted"))
            return 130, rows, written
        except Exception as exc:  # noqa: BLE001 - one entry's failure (e.g. a wrong result) must not end the run
            print(f"flce-tune: {label} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            rows.append((label, "-", "-", "-", "-", f"failed: {type(exc).__name__}"))
            status = 1
            continue
        finally:
            objective = None
            torch.cuda.empty_cache()
        if result.new is None:
            rows.append((label, ce_tiles.tile_name(ce_tiles.tile_of(entry.config)), "-", "-", "-",
                         f"kept: {result.skipped}"))
            continue
        try:
            db.write_entries(target, [result.new], unchanged=[entry])
        except db.DBConflictError:
            rows.append((label, "-", "-", "-", "-", "skipped (rewritten by another tuner meanwhile)"))
            continue
        except (OSError, ValueError) as exc:  # DBFileError is a ValueError; the next entry may still be written
            print(f"flce-tune: could not write {label} to {target}: {exc}", file=sys.stderr)
            rows.append((label, "-", "-", "-", "-", "NOT WRITTEN"))
            status = 1
            continue
        written += 1
        pick = result.pick
        note = "default faster: took it" if result.took_default else ("new tile" if pick.changed else "tile kept")
        own, best = pick.ms.get(ce_tiles.tile_name(pick.current)), pick.ms.get(ce_tiles.tile_name(pick.chosen))
        rows.append((label, f"{ce_tiles.tile_name(pick.current)} -> {ce_tiles.tile_name(pick.chosen)}",
                     "-" if own is None or best is None else f"{own:.3f} -> {best:.3f}",
                     f"{result.new.ms:.3f}", f"{result.new.default_ms:.3f}", note))
        print(f"  {label}: {rows[-1][1]}, CE step {rows[-1][2]} ms, call {rows[-1][3]} ms "
              f"(default {rows[-1][4]}): {note}", file=sys.stderr, flush=True)
    return status, rows, written
