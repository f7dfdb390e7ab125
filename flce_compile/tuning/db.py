"""The tuning database, write side (``flce-tune``): merging entries into a file under a lock, atomically, and
exporting the shipped layout. Reading, lookup and the file format live in ``flce_compile.plan.tuning_db``,
which the op reads; its public names are re-exported here, so this module is the whole database for the tuner.

Writes take a file lock and replace the file atomically (``atomic``), so several tuners can write at once and a
killed one leaves no partial file.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path
from typing import Iterable, Sequence

import torch

from ..log import logger
from ..plan.tuning_db import (
    ENV_SHIPPED_DIR,
    ENV_USER_DB,
    FORMAT,
    MATCH_KINDS,
    MAX_SHAPE_DISTANCE,
    PLAIN_SCHEMA_VERSION,
    RESCALE_TOLERANCE,
    SCHEMA_VERSION,
    DBCorruptError,
    DBFileError,
    Entry,
    Match,
    device_key,
    find_budget_matches,
    find_match,
    invalidate_cache,
    load_entries,
    lookup,
    normalize_device_name,
    normalize_dtype,
    parse_file,
    read_file,
    schema_version_for,
    shipped_dirs,
    shipped_files,
    token_bucket,
    torch_dtype,
    user_db_path,
)
from . import atomic

__all__ = [  # the read side's public names, then the writer's
    "ENV_SHIPPED_DIR", "ENV_USER_DB", "FORMAT", "MATCH_KINDS", "MAX_SHAPE_DISTANCE", "RESCALE_TOLERANCE",
    "PLAIN_SCHEMA_VERSION", "SCHEMA_VERSION", "DBCorruptError", "DBFileError", "Entry", "Match", "device_key",
    "find_budget_matches", "find_match", "invalidate_cache", "load_entries", "lookup", "normalize_device_name",
    "normalize_dtype", "parse_file", "read_file", "schema_version_for", "shipped_dirs", "shipped_files", "token_bucket", "torch_dtype", "user_db_path",
    "export_shipped", "now_iso", "versions", "write_entries",
]


def versions() -> dict[str, str | None]:
    """torch and triton versions, stored with every entry (a result may not carry over to other versions)."""
    try:
        import triton  # noqa: PLC0415

        triton_version: str | None = triton.__version__
    except Exception:  # noqa: BLE001 - triton is optional (CPU installs)
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version}


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def _dump(entries: Iterable[Entry]) -> str:
    """The file's text: entries in key order (plain before tiers), under the lowest schema version that holds
    them (``schema_version_for``)."""
    ordered = sorted(entries, key=lambda e: e.sort_key)
    payload = {"format": FORMAT, "schema_version": schema_version_for(ordered),
               "entries": [e.to_dict() for e in ordered]}
    return json.dumps(payload, indent=1, sort_keys=False) + "\n"


def _entries_to_keep(path: Path) -> list[Entry]:
    """The entries of the file a write merges into. A corrupt file (DBCorruptError) is moved aside to
    ``<path>.corrupt`` with a warning; a foreign, newer-schema or unreadable one is never overwritten."""
    try:
        old, problems = parse_file(path)
    except FileNotFoundError:
        return []
    except DBCorruptError as exc:
        aside = path.with_name(path.name + ".corrupt")
        os.replace(path, aside)
        logger.warning("%s; moved it to %s and started a new file", exc, aside)
        return []
    except DBFileError as exc:
        raise DBFileError(f"refusing to overwrite {path}: {exc}") from exc
    if problems:
        logger.warning("tuning DB file %s: dropping %d malformed entries on rewrite (%s)", path, len(problems), problems[0])
    return old


def write_entries(
    path: str | os.PathLike[str], entries: Sequence[Entry], *, replace: bool = False, lock_timeout: float = 60.0
) -> Path:
    """Merge ``entries`` into the file at ``path`` (new entries replace old ones with the same key: a budget-tier
    entry replaces only the entry of its own tier, never the plain one) and return the path. With ``replace=True`` the file holds exactly ``entries``.

    Safe with several writers and with writers killed mid-write: see ``atomic``. The read-merge-write happens
    under a file lock, temporary files a killed writer left are swept first, and the file is replaced
    atomically, keeping its permission bits; a symlinked path is written through (the link stays a link). A
    corrupt existing file is moved aside to ``<path>.corrupt`` (with a warning) rather than merged; a foreign
    or newer-schema file is never overwritten (DBFileError).
    """
    p = Path(path).expanduser()
    target = atomic.real_path(p)
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic.file_lock(target, lock_timeout):
        atomic.sweep_stale_temps(target)
        merged = {} if replace else {e.key: e for e in _entries_to_keep(target)}
        merged.update((e.key, e) for e in entries)
        atomic.replace_text(target, _dump(merged.values()))
    invalidate_cache()
    logger.debug("tuning DB: wrote %d entries to %s", len(entries), p)
    return p


def export_shipped(path: str | os.PathLike[str], entries: Sequence[Entry]) -> list[Path]:
    """Write entries in the shipped layout. ``path`` is a directory (one ``<gpu kind>.json`` per GPU kind,
    merged into existing files) or a ``.json`` file (then the entries must be of one GPU kind)."""
    p = Path(path).expanduser()
    by_device: dict[str, list[Entry]] = {}
    for e in entries:
        by_device.setdefault(e.device, []).append(e)
    if p.suffix == ".json":
        if len(by_device) > 1:
            raise ValueError(
                f"export path {p} is one file but the entries span GPU kinds {sorted(by_device)}; pass a "
                f"directory to get one <gpu kind>.json per kind"
            )
        held = {e.device for e in read_file(p)} - set(by_device) if p.is_file() else set()
        if held:
            raise ValueError(
                f"export path {p} holds entries of GPU kind(s) {sorted(held)}, and the shipped layout keeps one kind "
                f"a file; export {sorted(by_device)} to a directory (one <gpu kind>.json each) or to another file"
            )
        return [write_entries(p, entries)]
    return [write_entries(p / f"{dev}.json", items) for dev, items in sorted(by_device.items())]
