"""The tuning database, write side (``flce-tune``): merging entries into a file under a lock, atomically, and
exporting the shipped layout. Reading, lookup and the file format live in ``flce_compile.plan.tuning_db``,
which the op reads; its public names are re-exported here, so this module is the whole database for the tuner.

Writes take a file lock and replace the file atomically (``atomic``), so several tuners can write at once and a
killed one leaves no partial file.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

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
    FileScan,
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
    scan_file,
    schema_version_for,
    strict_json,
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
    "scan_file", "check_target", "DBConflictError", "export_shipped", "now_iso", "versions", "write_entries",
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


def _dump(entries: Iterable[Entry], unread: Sequence[Any] = (), min_version: int = 1) -> str:
    """The file's text: entries in key order (plain before tiers), then the ``unread`` raw objects as they were,
    under the lowest schema version that holds them (``schema_version_for``; at least ``min_version``, the
    version of the file the unread objects came from). Strict JSON: a NaN or infinity raises ValueError."""
    ordered = sorted(entries, key=lambda e: e.sort_key)
    version = max(schema_version_for(ordered), min_version if unread else 1)
    payload = {"format": FORMAT, "schema_version": version,
               "entries": [e.to_dict() for e in ordered] + list(unread)}
    return json.dumps(payload, indent=1, sort_keys=False, allow_nan=False) + "\n"


class DBConflictError(RuntimeError):
    """A write based on an entry that another writer has changed since (``write_entries(unchanged=...)``)."""


def _check_finite(entries: Sequence[Entry]) -> None:
    """Entries a strict JSON reader (ours) can read back: every time and peak finite."""
    for e in entries:
        for name in ("ms", "peak_gb", "default_ms", "default_peak_gb"):
            value = getattr(e, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"tuning DB entry {e.key}: {name}={value!r} must be a finite number (or None for "
                                 f"peak_gb, default_ms and default_peak_gb); it was not written")


def _aside_name(path: Path) -> Path:
    """A new name for a corrupt file moved aside: ``<path>.corrupt``, or ``.corrupt.1``, ``.2`` ... when that is
    taken, so an earlier corrupt copy is never overwritten."""
    aside = path.with_name(path.name + ".corrupt")
    n = 0
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.corrupt.{n}")
    return aside


def _raw_key(item: Any) -> tuple | None:
    """An unread object's entry key where its key fields parse (so a new entry of that key replaces it), else
    None."""
    try:
        return (normalize_device_name(item["device"]), int(item["vocab"]), int(item["hidden"]),
                normalize_dtype(item["dtype"]), token_bucket(int(item["tokens"])),
                None if item.get("budget_tier_gb") is None else float(item["budget_tier_gb"]))
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError):
        return None


def _scan_to_overwrite(path: Path) -> FileScan | None:
    """``scan_file`` for a writer: None for a missing file; a corrupt one's DBCorruptError as it is (the write
    moves the file aside); a foreign, newer-schema or unreadable file refused (DBFileError), never overwritten."""
    try:
        return scan_file(path)
    except FileNotFoundError:
        return None
    except DBCorruptError:
        raise
    except DBFileError as exc:
        raise DBFileError(f"refusing to overwrite {path}: {exc}") from exc


def _file_to_merge(path: Path) -> tuple[list[Entry], list[Any], int]:
    """The entries of the file a write merges into, the raw objects this version cannot parse (kept as they
    are: a plugin strategy's entries, fields of a newer version) and the file's schema version. A corrupt file
    (DBCorruptError) is moved aside to ``<path>.corrupt`` (never over an earlier one) with a warning; a foreign,
    newer-schema or unreadable one is never overwritten (DBFileError)."""
    try:
        scan = _scan_to_overwrite(path)
    except DBCorruptError as exc:
        aside = _aside_name(path)
        os.replace(path, aside)
        logger.warning("%s; moved it to %s and started a new file", exc, aside)
        return [], [], 1
    if scan is None:
        return [], [], 1
    unread = [item for item in scan.unread if strict_json(item)]
    if len(unread) < len(scan.unread):
        logger.warning("tuning DB file %s: dropping %d entries with non-finite numbers on rewrite", path,
                       len(scan.unread) - len(unread))
    if unread:
        logger.info("tuning DB file %s: keeping %d entries this version cannot read as they are", path, len(unread))
    return scan.entries, unread, scan.schema_version


def check_target(path: str | os.PathLike[str], lock_timeout: float = 60.0) -> Path:
    """Raise now what ``write_entries(path, ...)`` would raise later for the file itself (a foreign or
    newer-schema file: DBFileError; a directory that cannot hold the file or its lock: OSError), so a tuner
    can refuse before it spends device time on results it could not keep. Writes nothing but the lock file and
    the parent directory."""
    target = atomic.real_path(Path(path))
    if target.is_dir():
        raise IsADirectoryError(f"the tuning DB path {path} is a directory; name a .json file in it")
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic.file_lock(target, lock_timeout):
        try:
            _scan_to_overwrite(target)
        except DBCorruptError:
            pass  # the write moves it aside: nothing is lost
        if not os.access(target.parent, os.W_OK | os.X_OK):
            raise PermissionError(f"cannot write the tuning DB {path}: its directory {target.parent} is not writable")
    return Path(path)


def write_entries(
    path: str | os.PathLike[str], entries: Sequence[Entry], *, replace: bool = False, lock_timeout: float = 60.0,
    unchanged: Sequence[Entry] = (),
) -> Path:
    """Merge ``entries`` into the file at ``path`` (new entries replace old ones with the same key: a budget-tier
    entry replaces only the entry of its own tier, never the plain one) and return the path. With
    ``replace=True`` the file holds exactly ``entries``.

    Safe with several writers and with writers killed mid-write: see ``atomic``. The read-merge-write happens
    under a file lock, temporary files a killed writer left are swept first, and the file is replaced
    atomically, keeping its permission bits; a symlinked path is written through (the link stays a link). A
    corrupt existing file is moved aside to ``<path>.corrupt`` (with a warning) rather than merged; a foreign
    or newer-schema file is never overwritten (DBFileError), with ``replace`` too. Entries this version cannot
    parse (a plugin strategy's, a newer version's) are kept as they are unless ``replace`` or a new entry of
    their key replaces them. An entry with a non-finite time or peak raises ValueError, writing nothing.

    ``unchanged``: entries read earlier that the new ones were derived from; if the file no longer holds one of
    them as it was read (another tuner rewrote it meanwhile, even with the same config), DBConflictError is raised
    and nothing is written, so a slow read-modify-write never undoes a newer result.
    """
    _check_finite(entries)
    p = Path(path).expanduser()
    target = atomic.real_path(p)
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic.file_lock(target, lock_timeout):
        atomic.sweep_stale_temps(target)
        old, unread, version = _file_to_merge(target)
        held = {e.key: e for e in old}
        for e in unchanged:  # (the whole entry: a re-tune that kept the config has a newer time and trial count)
            if held.get(e.key) != e:
                raise DBConflictError(f"{p}: the entry {e.key} changed since it was read (another flce-tune wrote it); "
                                      "not overwritten")
        merged = {} if replace else {e.key: e for e in old}
        merged.update((e.key, e) for e in entries)
        new_keys = {e.key for e in entries}
        kept = [] if replace else [item for item in unread if _raw_key(item) not in new_keys]
        atomic.replace_text(target, _dump(merged.values(), kept, version))
    invalidate_cache()
    logger.debug("tuning DB: wrote %d entries to %s", len(entries), p)
    return p


def names_a_json_file(path: Path) -> bool:
    """Whether an output path names a DB file rather than a directory: a ``.json`` suffix in any case
    (``DB.JSON`` made a directory of that name)."""
    return path.suffix.lower() == ".json"


def export_shipped(path: str | os.PathLike[str], entries: Sequence[Entry]) -> list[Path]:
    """Write entries in the shipped layout. ``path`` is a directory (one ``<gpu kind>.json`` per GPU kind,
    merged into existing files) or a ``.json`` file (then the entries must be of one GPU kind)."""
    p = Path(path).expanduser()
    by_device: dict[str, list[Entry]] = {}
    for e in entries:
        by_device.setdefault(e.device, []).append(e)
    if names_a_json_file(p):
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
