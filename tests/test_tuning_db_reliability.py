"""The tuning DB under hostile conditions (issue #11): bad user files, no home directory, a user file rewritten by
another process, writers killed mid-write, file modes and symlinked DB paths."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import stat
import time
from pathlib import Path

import pytest
from test_tuning_db import dbs, entry, find  # noqa: F401 - dbs is a fixture

from flce_compile.plan import tuning_db
from flce_compile.tuning import db

_INF_VOCAB = json.dumps({"format": db.FORMAT, "schema_version": 1, "entries": [entry().to_dict()]}).replace(
    '"vocab": 151936', '"vocab": Infinity')
BAD_USER_FILES = {
    "not_utf8": b'{"format": "flce_compile.tuning_db", "note": "\xff\xfe"}',
    "infinity": _INF_VOCAB.encode(),
    "deep": b"[" * 200_000 + b"]" * 200_000,
}


class FakeClock:
    """The DB reader's monotonic clock, moved by hand: the index is re-validated only every RECHECK_S."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self) -> None:
        self.now += tuning_db.RECHECK_S + 0.001


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(tuning_db, "_clock", fake)
    db.invalidate_cache()
    return fake


def _count_calls(monkeypatch, name: str) -> list:
    """Record the first argument of every call to the DB reader's <name> (the function still runs)."""
    calls: list = []
    real = getattr(tuning_db, name)

    def counted(*args, **kwargs):
        calls.append(args[0] if args else None)
        return real(*args, **kwargs)

    monkeypatch.setattr(tuning_db, name, counted)
    return calls


@pytest.mark.parametrize("kind", sorted(BAD_USER_FILES))
def test_bad_user_file_keeps_the_shipped_entries_and_is_parsed_once(dbs, clock, monkeypatch, caplog, kind):
    user, shipped = dbs
    db.write_entries(shipped / "h200.json", [entry(chunk=1024)])
    user.parent.mkdir(parents=True)
    user.write_bytes(BAD_USER_FILES[kind])
    parsed = _count_calls(monkeypatch, "parse_file")
    caplog.set_level(logging.WARNING, logger="flce_compile")
    for i in range(200):
        assert find() == (entry(chunk=1024).config, "tuning_db:shipped_exact")
        if i % 50 == 0:
            clock.advance()  # re-validation finds the same file: the verdict is kept
    assert parsed.count(user) == 1, "the bad file was re-parsed"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(user) in warnings[0], warnings
    with pytest.raises(db.DBCorruptError):
        db.read_file(user, strict=True)
    # the writer sets it aside like any other corrupt file and starts a new one
    db.write_entries(user, [entry(chunk=512)])
    assert user.with_name(user.name + ".corrupt").read_bytes() == BAD_USER_FILES[kind]
    assert db.read_file(user, strict=True) == [entry(chunk=512)]
    assert find() == (entry(chunk=512).config, "tuning_db:user_exact")


def test_a_user_file_saved_with_a_byte_order_mark_is_read(dbs):
    """An editor that saves UTF-8 with a BOM: the file's entries answer (it was ignored and then set aside)."""
    user, _ = dbs
    db.write_entries(user, [entry(chunk=512)])
    user.write_bytes(b"\xef\xbb\xbf" + user.read_bytes())
    db.invalidate_cache()
    assert db.read_file(user, strict=True) == [entry(chunk=512)]
    assert find() == (entry(chunk=512).config, "tuning_db:user_exact")
    db.write_entries(user, [entry(chunk=512), entry(tokens=4096)])  # rewritten in place, nothing set aside
    assert not user.with_name(user.name + ".corrupt").exists()
    assert len(db.read_file(user, strict=True)) == 2


def test_an_overflowing_number_skips_only_its_entry(dbs):
    """1e400 is valid JSON (read as inf); int(inf) raises OverflowError, which must skip that entry only."""
    user, _ = dbs
    good = entry(tokens=4096).to_dict()
    text = json.dumps({"format": db.FORMAT, "schema_version": 1, "entries": [{**good, "tokens": 8192}, good]})
    user.parent.mkdir(parents=True)
    user.write_text(text.replace('"tokens": 8192', '"tokens": 1e400'))
    assert db.read_file(user) == [entry(tokens=4096)]


@pytest.mark.parametrize("error", [RuntimeError("Could not determine home directory."), KeyError("getpwuid(): uid")])
def test_no_home_directory_uses_the_shipped_entries_and_caches(dbs, clock, monkeypatch, error):
    """A container running as an arbitrary UID: no $HOME, no passwd entry, no $FLCE_TUNING_DB."""
    _, shipped = dbs
    db.write_entries(shipped / "h200.json", [entry(chunk=1024)])
    monkeypatch.delenv(db.ENV_USER_DB)
    monkeypatch.delenv("HOME", raising=False)

    def no_home(cls=None):
        raise error

    monkeypatch.setattr(Path, "home", classmethod(no_home))
    db.invalidate_cache()
    assert db.user_db_path() is None
    loads = _count_calls(monkeypatch, "shipped_files")
    misses = _count_calls(monkeypatch, "_lookup_uncached")
    for i in range(100):
        if i == 50:
            clock.advance()  # re-validation finds nothing changed: same index, same memo
        assert find() == (entry(chunk=1024).config, "tuning_db:shipped_exact")
        assert find(device="NVIDIA A100-SXM4-80GB") is None  # a miss, remembered too
    assert len(loads) == 1, "the shipped files were re-read"
    assert len(misses) == 2, "answers (the miss included) were not memoised"


def _rewrite(path: str) -> None:
    import flce_compile.tuning.db as dbm

    dbm.write_entries(path, [entry(chunk=4096)])


def test_a_user_file_rewritten_by_another_process_is_noticed(dbs, clock, monkeypatch):
    user, _ = dbs
    db.write_entries(user, [entry(chunk=512)])
    assert find()[0].chunk_tokens == 512
    proc = mp.get_context("spawn").Process(target=_rewrite, args=(str(user),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    checks = _count_calls(monkeypatch, "_signature")
    for _ in range(1000):  # within RECHECK_S: answered from the cache, no stat
        assert find()[0].chunk_tokens == 512
    assert checks == []
    clock.advance()
    assert find()[0].chunk_tokens == 4096
    assert len(checks) == 1
    # an edit keeping size and inode still changes the mtime
    user.write_text(user.read_text().replace('"chunk_tokens": 4096', '"chunk_tokens": 2048'))
    os.utime(user, ns=(time.time_ns(), time.time_ns() + 10**9))
    clock.advance()
    assert find()[0].chunk_tokens == 2048


def test_a_failing_write_leaves_no_temporary_file(dbs, monkeypatch):
    user, _ = dbs
    db.write_entries(user, [entry(chunk=512)])
    before = user.read_bytes()

    def fail(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="No space"):
        db.write_entries(user, [entry(chunk=4096)])
    assert sorted(p.name for p in user.parent.iterdir()) == ["tuning_db.json", "tuning_db.json.lock"]
    assert user.read_bytes() == before


def _killed_writer(path: str) -> None:
    import flce_compile.tuning.db as dbm

    os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # die with the temp file written (a child process)
    dbm.write_entries(path, [entry(chunk=4096)])


def test_temporary_files_of_killed_writers_are_swept(dbs):
    user, _ = dbs
    db.write_entries(user, [entry(chunk=512)])
    for _ in range(3):
        proc = mp.get_context("spawn").Process(target=_killed_writer, args=(str(user),))
        proc.start()
        proc.join(60)
        assert proc.exitcode == -signal.SIGKILL
    left = sorted(p.name for p in user.parent.glob(".*.tmp"))
    assert len(left) == 1, left  # each killed writer swept its predecessor's temp file before dying
    (user.parent / ".tuning_db.json.x_3kq9ab.tmp").write_text("{")  # an older writer's mkstemp name
    keep = [".other.json.abcd1234.tmp", ".tuning_db.json.bak.abcd1234.tmp", "notes.tmp"]  # not this file's
    for name in keep:
        (user.parent / name).write_text("mine")
    db.write_entries(user, [entry(chunk=1024)])
    assert sorted(p.name for p in user.parent.iterdir() if p.name.endswith(".tmp")) == sorted(keep)
    assert db.read_file(user, strict=True) == [entry(chunk=1024)]


def test_a_write_keeps_the_file_mode(dbs):
    user, _ = dbs
    old_umask = os.umask(0o022)
    try:
        db.write_entries(user, [entry()])
        assert stat.S_IMODE(user.stat().st_mode) == 0o644  # a new file: the umask's mode, not mkstemp's 0600
        for mode in (0o640, 0o664):
            user.chmod(mode)
            db.write_entries(user, [entry(tokens=4096)])
            assert stat.S_IMODE(user.stat().st_mode) == mode
    finally:
        os.umask(old_umask)


def test_a_write_goes_through_a_symlink(dbs, tmp_path):
    user, _ = dbs
    shared = tmp_path / "shared" / "team_db.json"
    shared.parent.mkdir()
    user.parent.mkdir(parents=True)
    user.symlink_to(shared)  # dangling: the first write creates the target
    db.write_entries(user, [entry()])
    db.write_entries(user, [entry(tokens=4096)])
    assert user.is_symlink() and os.readlink(user) == str(shared)
    assert len(db.read_file(shared, strict=True)) == 2
    # a corrupt target is set aside beside the target; the link survives
    shared.write_text("{not json")
    db.write_entries(user, [entry()])
    assert user.is_symlink() and (shared.parent / "team_db.json.corrupt").exists()
    assert db.read_file(user, strict=True) == [entry()]
    assert sorted(p.name for p in user.parent.iterdir()) == ["tuning_db.json"]  # nothing written beside the link
