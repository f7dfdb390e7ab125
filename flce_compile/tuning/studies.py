"""Kept Optuna studies: one journal file per tuning study beside the user tuning DB, pruned to the last N.

Why keep them: the tuner's plots (``tuning.plots``) are drawn from a study's trials; a kept study can be
redrawn later (``flce-tune --plot DIR --replot``) without measuring again.

Why a journal file per study rather than one shared Optuna storage: deleting a study from a shared journal
only appends a deletion record, so that file (replayed in full on every open) would grow forever, and SQLite
would need sqlalchemy and a VACUUM. A study in its own file is pruned by deleting the file, and two tuners
never write the same file (Optuna's journal locks each append anyway).

Layout: ``<user DB stem>.studies/`` beside the user DB (``~/.cache/flce_compile/tuning_db.studies/``). A study
runs in ``<name>.journal.running`` and is renamed to ``<name>.journal`` when it ends (``keep``), so listing,
replotting and pruning see ended studies only: a concurrent tuner's running study is never pruned. Renames
and pruning hold the directory's lock (``.studies.lock``). A ``.running`` file a killed tuner left behind is
deleted by a later prune once it is ``STALE_RUNNING_S`` old.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..log import logger
from . import atomic

#: A kept study's file suffix, and that of a study still running.
STUDY_SUFFIX = ".journal"
RUNNING_SUFFIX = ".journal.running"
#: How many studies are kept by default (``flce-tune --keep-studies``).
DEFAULT_KEEP = 20
#: A running study's file untouched for this long was left by a killed tuner (a trial takes seconds).
STALE_RUNNING_S = 24 * 3600.0
#: Seconds to wait for the directory lock before giving up.
LOCK_TIMEOUT_S = 60.0

#: ``<gpu kind>_V<vocab>_H<hidden>_<dtype>_T<token bucket>_<UTC start, microseconds>_<4 hex>``; the random tag
#: keeps names of two tuners started in the same microsecond apart.
_NAME = re.compile(r"(?P<kind>[a-z0-9_]+)_V(?P<vocab>\d+)_H(?P<hidden>\d+)_(?P<dtype>bf16|fp16|fp32)_T(?P<tokens>\d+)"
                   r"_(?P<stamp>\d{8}T\d{6}\.\d{6}Z)_(?P<tag>[0-9a-f]{4})")
_STAMP_FORMAT = "%Y%m%dT%H%M%S.%fZ"


class StudyError(Exception):
    """A kept study that cannot be found or read; the message names the study and what to do."""


@dataclass(frozen=True)
class KeptStudy:
    """A kept study's name and file, and when it started (from its name)."""

    name: str
    path: Path
    started: _dt.datetime


def studies_dir(user_db: Path) -> Path:
    """Where the studies of the user DB ``user_db`` are kept: ``<stem>.studies/`` beside it (the path as given,
    so a symlinked shared DB keeps its studies beside the link)."""
    return user_db.with_name(user_db.stem + ".studies")


def new_study_name(kind: str, vocab: int, hidden: int, dtype: str, tokens: int,
                   now: _dt.datetime | None = None) -> str:
    """A unique, informative study name: GPU kind, V, H, dtype, token bucket, UTC start time, random tag.

    ``tokens`` is the token bucket (``db.token_bucket``); ``now`` (UTC) is for tests."""
    when = (now or _dt.datetime.now(_dt.timezone.utc)).strftime(_STAMP_FORMAT)
    name = f"{kind}_V{vocab}_H{hidden}_{dtype}_T{tokens}_{when}_{secrets.token_hex(2)}"
    if _NAME.fullmatch(name) is None:
        raise ValueError(f"cannot name a study for kind={kind!r} dtype={dtype!r}: expected [a-z0-9_] and bf16/fp16/fp32")
    return name


def _journal(path: Path) -> Any:
    """An Optuna journal storage on one file (created if missing)."""
    from optuna.storages import JournalStorage  # noqa: PLC0415

    try:
        from optuna.storages.journal import JournalFileBackend  # noqa: PLC0415 - Optuna >= 4
    except ImportError:  # Optuna 3.x (pyproject allows >= 3.6) names the same class JournalFileStorage
        from optuna.storages import JournalFileStorage as JournalFileBackend  # noqa: PLC0415

    return JournalStorage(JournalFileBackend(str(path)))


def running_storage(directory: Path, name: str) -> Any:
    """The Optuna storage a new study ``name`` runs in (``<name>.journal.running`` in ``directory``, created)."""
    directory.mkdir(parents=True, exist_ok=True)
    return _journal(directory / (name + RUNNING_SUFFIX))


def _lock(directory: Path) -> contextlib.AbstractContextManager[None]:
    return atomic.file_lock(directory / ".studies", LOCK_TIMEOUT_S)


def keep(directory: Path, name: str, keep_last: int) -> Path:
    """End the running study ``name``: rename its file to ``<name>.journal`` and prune the directory to the last
    ``keep_last`` (>= 1) studies, all under the directory's lock. Returns the kept file."""
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1 (0 means: do not run the study in a kept storage)")
    kept = directory / (name + STUDY_SUFFIX)
    with _lock(directory):
        os.replace(directory / (name + RUNNING_SUFFIX), kept)
        _prune_locked(directory, keep_last)
    return kept


def discard(directory: Path, name: str) -> None:
    """Delete the running study ``name`` (a study whose setup failed before it measured anything)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(directory / (name + RUNNING_SUFFIX))


def prune(directory: Path, keep_last: int) -> list[str]:
    """Delete all but the ``keep_last`` most recently started kept studies (and stale running files), under the
    directory's lock; returns the deleted study names. Files whose names are not study names are left alone."""
    if keep_last < 0:
        raise ValueError(f"keep_last={keep_last} must be >= 0")
    if not directory.is_dir():
        return []
    with _lock(directory):
        return _prune_locked(directory, keep_last)


def _prune_locked(directory: Path, keep_last: int) -> list[str]:
    studies = kept_studies(directory)
    doomed = studies[: max(0, len(studies) - keep_last)]
    for study in doomed:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(study.path)
    if doomed:
        logger.info("pruned %d kept tuning studies in %s (keeping the last %d)", len(doomed), directory, keep_last)
    _sweep_stale_running(directory)
    return [s.name for s in doomed]


def _sweep_stale_running(directory: Path) -> None:
    """Delete running-study files (and their journal lock) untouched for ``STALE_RUNNING_S``: a killed tuner's."""
    cutoff = time.time() - STALE_RUNNING_S
    for path in directory.glob("*" + RUNNING_SUFFIX):
        if _NAME.fullmatch(path.name[: -len(RUNNING_SUFFIX)]) is None:
            continue
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_mtime < cutoff:
                path.unlink()
                path.with_name(path.name + ".lock").unlink(missing_ok=True)
                logger.info("deleted %s, a study left running by a killed tuner", path)


def kept_studies(directory: Path) -> list[KeptStudy]:
    """The kept (ended) studies in ``directory``, oldest first; empty when there is no such directory."""
    if not directory.is_dir():
        return []
    out: list[KeptStudy] = []
    for path in directory.glob("*" + STUDY_SUFFIX):
        match = _NAME.fullmatch(path.name[: -len(STUDY_SUFFIX)])
        if match is not None and path.is_file():
            started = _dt.datetime.strptime(match["stamp"], _STAMP_FORMAT).replace(tzinfo=_dt.timezone.utc)
            out.append(KeptStudy(match.string, path, started))
    return sorted(out, key=lambda s: (s.started, s.name))


def load(directory: Path, name: str) -> Any:
    """The kept study ``name`` as an ``optuna.Study`` read from its file (a new storage object, as a later
    process would). Raises StudyError when there is no such kept study or its file cannot be read."""
    import optuna  # noqa: PLC0415

    path = directory / (name + STUDY_SUFFIX)
    if _NAME.fullmatch(name) is None or not path.is_file():
        raise StudyError(f"no kept study named {name!r} in {directory}; flce-tune --list-studies lists the kept ones")
    try:
        return optuna.load_study(study_name=name, storage=_journal(path))
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file: one line, not a traceback
        raise StudyError(f"kept study {name!r} ({path}) cannot be read: {type(exc).__name__}: {exc}") from exc
