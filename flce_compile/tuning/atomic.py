"""Replace a small text file atomically under an inter-process lock (the tuning DB's writer).

Why a module of its own: the DB must survive several tuners writing at once, writers killed mid-write, DB
paths that are symlinks (a shared DB linked into ``~/.cache``) and files whose mode a user chose; getting
that right is one job, separate from what the DB holds.

The rules: the lock lives next to the real file (``<file>.lock``); the content goes to a temporary file in the
same directory (``.<file>.<8 hex>.tmp``), is fsynced and renamed over the real file, so readers see the old or
the new file, never a partial one. A symlinked path is written through: the link stays, its target gets the
content. The file keeps its permission bits; a new file gets the umask's (``open(..., 0o666)``), not 0600.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Iterator

from ..log import logger


def real_path(path: str | os.PathLike[str]) -> Path:
    """The file a write to ``path`` must replace: symlinks resolved (also a dangling one, whose target is
    created), so the link itself is never replaced by a regular file."""
    return Path(os.path.realpath(Path(path).expanduser()))


@contextlib.contextmanager
def file_lock(path: Path, timeout: float) -> Iterator[None]:
    """An inter-process lock next to ``path`` (``filelock`` if installed, else ``fcntl.flock``)."""
    lock_path = path.with_name(path.name + ".lock")
    # A lock file that cannot be made at all is said now: filelock would retry until the timeout, then blame a lock.
    try:
        os.close(os.open(lock_path, os.O_WRONLY | os.O_CREAT, 0o644))
    except OSError as exc:
        raise OSError(exc.errno, f"cannot create the lock file {lock_path} ({exc.strerror}); write the database to a "
                                 "directory you can write to") from exc
    try:
        import filelock  # noqa: PLC0415
    except ImportError:
        filelock = None  # type: ignore[assignment]
    if filelock is not None:
        try:
            with filelock.FileLock(str(lock_path), timeout=timeout):
                yield
        except filelock.Timeout as exc:
            raise TimeoutError(
                f"could not lock {lock_path} within {timeout}s; another flce-tune may hang on it - delete the "
                f"lock file if no tuner is running"
            ) from exc
        return
    import fcntl  # noqa: PLC0415

    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _temp_pattern(target: Path) -> re.Pattern[str]:
    # Also matches the names tempfile.mkstemp gave earlier versions of this writer ([a-z0-9_]{8}), so their
    # leftovers are swept too; the exact length keeps the temp files of "<name>.<suffix>" targets out.
    return re.compile(rf"\.{re.escape(target.name)}\.[a-z0-9_]{{8}}\.tmp")


def sweep_stale_temps(target: Path) -> int:
    """Delete temporary files a killed writer of ``target`` left behind; call it holding ``target``'s lock.

    Why this is safe: every writer creates its temporary file and renames it away while holding the target's
    lock (also the writers of earlier versions), so while we hold the lock no live writer of this target owns
    one; every file matching this target's temp pattern is provably stale. Temp files of other targets and
    any other file are left alone. Returns how many were deleted.
    """
    pattern = _temp_pattern(target)
    removed = 0
    with contextlib.suppress(OSError), os.scandir(target.parent) as entries:
        for item in entries:
            if pattern.fullmatch(item.name) and item.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(item.path)
                    removed += 1
    if removed:
        logger.info("removed %d stale temporary file(s) of %s left by a killed writer", removed, target)
    return removed


def _create_temp(target: Path) -> tuple[int, Path]:
    """A new temporary file beside ``target``: mode 0666 less the umask, like any new file (mkstemp's 0600
    would leak into the DB file through the rename)."""
    while True:
        temp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), temp
        except FileExistsError:  # 2**32 names: a clash is all but impossible; draw again
            continue


def replace_text(target: Path, text: str) -> None:
    """Replace ``target`` (a real path: see ``real_path``) with ``text``, keeping its permission bits.

    Call it holding ``target``'s lock. On any failure the temporary file is removed and the old file is left
    as it was; a writer killed outright (SIGKILL) leaves its temporary file to the next ``sweep_stale_temps``.
    """
    try:
        mode: int | None = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = None
    fd, temp = _create_temp(target)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            if mode is not None:
                os.fchmod(handle.fileno(), mode)
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
