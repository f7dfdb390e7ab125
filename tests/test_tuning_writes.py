"""What flce-tune keeps and refuses when it writes the tuning DB: a study that never tried the DB's current
answer, an output it cannot write (found out before any study runs), non-finite numbers, entries this version
cannot parse, corrupt files moved aside, a stale read-modify-write, and argument errors (a bug hunt of
2026-12-06). CPU only: the GPU and the measurement are faked as in test_tuning_cli."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from flce_compile.plan.config import FLCEConfig
from flce_compile.tuning import db

from test_tuning_ce_tiles import _fast_tile_timer
from test_tuning_cli import _fake_gpu, _private_env, make_entry  # noqa: F401 - _private_env: autouse fixture

TUNED = FLCEConfig(strategy="triton", chunk_tokens=8192, block_v=8192, num_warps=8, num_stages=3)


def _strict(path) -> dict:
    """The file as a strict JSON reader (ours, and most tools) reads it."""
    def refuse(name):
        raise ValueError(f"{name} in {path}")
    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.fixture
def tuner(tmp_path, monkeypatch):
    """cmd_tune on CPU with a fake GPU (an H200) and an objective that counts its calls; TUNED is fastest."""
    from flce_compile.tuning import measure

    _fake_gpu(monkeypatch)
    monkeypatch.setattr("flce_compile.tuning.space.predicted_peak_bytes", lambda *a, **k: None)
    monkeypatch.setenv(db.ENV_SHIPPED_DIR, str(tmp_path / "noshipped"))
    db.invalidate_cache()
    measured: list[FLCEConfig] = []

    def fake_make_objective(problem, **kw):
        def objective(c):
            measured.append(c)
            return (1.0 if c == TUNED else 5.0 + abs(math.log2(c.chunk_tokens / 2048))), 10**6
        return objective

    monkeypatch.setattr(measure, "make_objective", fake_make_objective)
    return measured


def test_a_study_that_stops_before_the_dbs_answer_does_not_replace_it(tuner, tmp_path, monkeypatch, capsys):
    """One trial measures only the heuristic; writing it replaced a tuned entry (and --skip-existing kept the
    loss). The entry stays until a study has tried it."""
    from flce_compile.tuning import cli

    user = tmp_path / "user.json"
    monkeypatch.setenv(db.ENV_USER_DB, str(user))
    tuned = make_entry(vocab=151936, hidden=4096, tokens=16384, config=TUNED, ms=1.0, trials=40)
    db.write_entries(user, [tuned])
    argv = ["--vocab", "151936", "--hidden", "4096", "--tokens", "16384"]
    assert cli.main([*argv, "--trials", "1"]) == 0
    captured = capsys.readouterr()
    assert len(tuner) == 1 and tuner[0] != TUNED
    assert "before trying the tuning DB's current answer; not written" in captured.err
    assert "NOT WRITTEN: the DB's answer untried" in captured.out
    assert db.read_file(user, strict=True) == [tuned]
    # with a second trial the study tries the DB's answer: it wins and is written back, measured again
    assert cli.main([*argv, "--trials", "2"]) == 0
    [kept] = db.read_file(user, strict=True)
    assert kept.config == TUNED and kept.trials == 2 and TUNED in tuner
    # a study of another strategy cannot try the answer: its winner is written, as asked
    out = tmp_path / "torch_only.json"
    assert cli.main([*argv, "--trials", "2", "--strategies", "torch", "--out", str(out)]) == 0
    [torch_entry] = db.read_file(out, strict=True)
    assert torch_entry.config.strategy == "torch" and "NOT WRITTEN" not in capsys.readouterr().out


def test_an_output_it_cannot_write_is_refused_before_any_study(tuner, tmp_path, capsys):
    from flce_compile.tuning import cli

    argv = ["--vocab", "32768", "--hidden", "256", "--tokens", "1024", "2048", "--trials", "2"]
    foreign = tmp_path / "foreign.json"
    foreign.write_text('{"some": "other tool config"}')
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({"format": db.FORMAT, "schema_version": db.SCHEMA_VERSION + 1, "entries": []}))
    a_file = tmp_path / "plain_file"
    a_file.write_text("x")
    cases = [
        (["--out", str(foreign)], "is not an flce_compile tuning DB"),
        (["--out", str(newer)], "newer than this flce_compile understands"),
        (["--out", str(a_file / "db.json")], "cannot write the results to"),
        (["--out", str(a_file)], "is a file but not a .json one"),
    ]
    for extra, message in cases:
        assert cli.main([*argv, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert message in err, (extra, err)
        assert tuner == [], extra  # no study ran
    assert foreign.read_text() == '{"some": "other tool config"}'


@pytest.mark.parametrize("argv, message", [
    (["--vocab", "8", "--hidden", "8", "--seed", "-5"], "--seed must be in [0, 2**32 - 1]"),
    (["--vocab", "8", "--hidden", "8", "--seed", str(2**32)], "--seed must be in [0, 2**32 - 1]"),
    (["--list", "--db", "."], "is a directory; name a .json file"),
])
def test_bad_arguments_are_one_clear_line(argv, message, capsys):
    from flce_compile.tuning import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and err.count("\n") == 1, err


def test_a_directory_as_the_user_db_and_a_bad_device_string(tuner, tmp_path, monkeypatch, capsys):
    from flce_compile.tuning import cli

    monkeypatch.setenv(db.ENV_USER_DB, str(tmp_path))
    with pytest.raises(SystemExit):
        cli.main(["--list-studies"])
    assert "($FLCE_TUNING_DB) is a directory" in capsys.readouterr().err
    monkeypatch.setenv(db.ENV_USER_DB, str(tmp_path / "user.json"))
    for device in ("1", "gpu0"):
        assert cli.main(["--vocab", "8", "--hidden", "8", "--device", device]) == 2
        assert f"--device '{device}' is not a device; use e.g. --device cuda:0" in capsys.readouterr().err


def test_token_counts_of_one_bucket_run_one_study(tuner, tmp_path, capsys):
    from flce_compile.tuning import cli

    out = tmp_path / "out.json"
    assert cli.main(["--vocab", "32768", "--hidden", "256", "--tokens", "1024", "1100", "2048", "--trials", "2",
                     "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "--tokens 1100 shares the 1024-token bucket with 1024; tuning 1024 only" in captured.err
    entries = db.read_file(out, strict=True)
    assert sorted(e.tokens for e in entries) == [1024, 2048]
    assert all(e.extra["measured_tokens"] == e.tokens for e in entries)


def test_non_finite_numbers_are_neither_written_nor_read(tmp_path, caplog):
    path = tmp_path / "db.json"
    good = make_entry(tokens=4096)
    db.write_entries(path, [good])
    with pytest.raises(ValueError, match="default_ms=nan must be a finite number"):
        db.write_entries(path, [make_entry(default_ms=float("nan"))])
    assert db.read_file(path, strict=True) == [good]
    # hand edits: a string "nan", and 1e999 (which Python's json reads as infinity)
    data = _strict(path)
    bad_string = {**good.to_dict(), "tokens": 8192, "peak_gb": "nan"}
    data["entries"].append(bad_string)
    path.write_text(json.dumps(data)[:-2] + ', {"device": "h200", "vocab": 1000, "hidden": 64, "dtype": "bf16", '
                    '"tokens": 2048, "config": {"strategy": "triton"}, "ms": 1.0, "peak_gb": 1e999}, '
                    '{"device": "h200", "vocab": 1000, "hidden": 64, "dtype": "bf16", "tokens": 1024, '
                    '"config": {"strategy": "triton"}, "ms": 1.0, "note": [1e999]}]}')
    with caplog.at_level("WARNING", logger="flce_compile"):
        assert db.read_file(path) == [good]  # the bad entries are skipped, the file is not
    assert "peak_gb='nan' must be a finite number or null" in caplog.text and "skipped 3 malformed" in caplog.text
    # (1e999 in a field outside the schema was read into the entry's extra, and every later write then failed)
    with pytest.raises(ValueError, match=r"a field outside the schema holds a non-finite number \(\['note'\]\)"):
        db.Entry.from_dict({**good.to_dict(), "note": [float("inf")]})
    new = make_entry(tokens=16384)
    db.write_entries(path, [new])
    written = _strict(path)  # no Infinity in it: the entries with 1e999 are dropped, the string one kept as it was
    assert bad_string in written["entries"] and len(written["entries"]) == 3
    assert db.read_file(path, strict=True) == [good, new]
    # a number written as a string by hand is read as before
    data = _strict(path)
    data["entries"][0]["peak_gb"] = "1.5"
    path.write_text(json.dumps(data))
    assert db.read_file(path, strict=True)[0].peak_gb == 1.5


def test_corrupt_files_are_moved_aside_without_overwriting_an_earlier_copy(tmp_path):
    path = tmp_path / "db.json"
    for n, junk in enumerate((b'{"entries": [', b"\xff\xfe not utf-8", b"[[[")):
        path.write_bytes(junk)
        db.write_entries(path, [make_entry(tokens=4096 << n)])
    assert (tmp_path / "db.json.corrupt").read_bytes() == b'{"entries": ['
    assert (tmp_path / "db.json.corrupt.1").read_bytes() == b"\xff\xfe not utf-8"
    assert (tmp_path / "db.json.corrupt.2").read_bytes() == b"[[["
    assert [e.tokens for e in db.read_file(path, strict=True)] == [16384]  # the last write's alone


def test_entries_this_version_cannot_parse_are_kept_through_a_rewrite(tmp_path):
    """A plugin strategy's entries (the plugin is not registered in flce-tune's process) and entries of a newer
    version's config field were deleted by the next write."""
    path = tmp_path / "db.json"
    good = make_entry(tokens=4096)
    plugin = {**good.to_dict(), "tokens": 8192, "config": {"strategy": "my_plugin", "chunk_tokens": 4096}}
    newer = {**good.to_dict(), "tokens": 16384, "config": {**good.config.to_dict(), "future_knob": 3}}
    tier = {**plugin, "budget_tier_gb": 2.0}
    note = "hand-written: keep 151936x4096 at 2048 tokens"  # (items that are not objects were dropped silently)
    path.write_text(json.dumps({"format": db.FORMAT, "schema_version": db.SCHEMA_VERSION,
                                "entries": [good.to_dict(), plugin, newer, tier, note, 42]}))
    other = make_entry(tokens=32768)
    db.write_entries(path, [other])
    written = _strict(path)
    assert written["schema_version"] == db.SCHEMA_VERSION  # the kept tier entry still needs it
    kept = (plugin, newer, tier, note, 42)
    assert list(kept) == [e for e in written["entries"] if e in kept]
    assert db.read_file(path) == [good, other]
    # a new entry of an unread one's key replaces it; replace=True keeps none
    replacing = make_entry(tokens=8192)
    db.write_entries(path, [replacing])
    assert plugin not in _strict(path)["entries"] and newer in _strict(path)["entries"]
    db.write_entries(path, [good], replace=True)
    assert _strict(path)["entries"] == [good.to_dict()]


def test_replace_never_overwrites_a_foreign_or_newer_file(tmp_path):
    foreign = tmp_path / "foreign.json"
    foreign.write_text('{"some": "other tool config"}')
    with pytest.raises(db.DBFileError, match="refusing to overwrite"):
        db.write_entries(foreign, [make_entry()], replace=True)
    assert foreign.read_text() == '{"some": "other tool config"}'


def test_a_stale_read_modify_write_is_refused(tmp_path):
    path = tmp_path / "db.json"
    read = make_entry()
    db.write_entries(path, [read])
    newer = make_entry(config=TUNED, ms=1.0)  # another tuner's result, written meanwhile
    db.write_entries(path, [newer])
    with pytest.raises(db.DBConflictError, match="changed since it was read"):
        db.write_entries(path, [make_entry(ms=2.0)], unchanged=[read])
    assert db.read_file(path, strict=True) == [newer]
    db.write_entries(path, [make_entry(config=TUNED, ms=0.5)], unchanged=[newer])
    assert db.read_file(path, strict=True)[0].ms == 0.5
    # Another re-tune that found the same config again, with a newer time and more trials: refused as well (only
    # a changed config was; the 40-trial result was lost in a review's run).
    [read] = db.read_file(path, strict=True)
    retuned = dataclasses.replace(read, ms=0.4, trials=40, date="2026-12-06T12:00:00+00:00")
    db.write_entries(path, [retuned])
    with pytest.raises(db.DBConflictError, match="changed since it was read"):
        db.write_entries(path, [dataclasses.replace(read, ms=0.45)], unchanged=[read])
    assert db.read_file(path, strict=True) == [retuned]


def test_retune_skips_an_entry_rewritten_meanwhile_and_times_its_measured_rows(tmp_path, monkeypatch, capsys):
    """--retune-ce-tiles reads its entries once, then takes minutes per entry: a flce-tune result written in
    between is not undone. And the CE step is timed on the chunk the call runs at its measured token count."""
    from flce_compile.tuning import ce_tiles, cli, measure

    _fake_gpu(monkeypatch)
    rows_timed = []

    def timer(rows, vocab, dtype, tile):
        rows_timed.append(rows)
        return _fast_tile_timer()(rows, vocab, dtype, tile)

    monkeypatch.setattr(ce_tiles, "ce_step_timer", lambda device, **kw: timer)
    path = tmp_path / "h200.json"
    first = make_entry(tokens=8192, config=FLCEConfig(strategy="triton", chunk_tokens=16384, block_v=8192,
                                                      num_warps=16), extra={"measured_tokens": 10000})
    second = make_entry(tokens=16384, config=FLCEConfig(strategy="triton", chunk_tokens=2048, block_v=8192,
                                                        num_warps=16))
    db.write_entries(path, [first, second])
    meanwhile = make_entry(tokens=16384, config=TUNED, ms=0.5)

    def fake_make_objective(problem, **kw):
        if problem.tokens == 16384:  # while the second entry is timed, another tuner rewrites it
            db.write_entries(path, [meanwhile])
        return lambda config: (3.0, 1_000_000)

    monkeypatch.setattr(measure, "make_objective", fake_make_objective)
    assert cli.main(["--retune-ce-tiles", "--out", str(path)]) == 0
    captured = capsys.readouterr()
    assert "skipped (rewritten by another tuner meanwhile)" in captured.out
    by_tokens = {e.tokens: e for e in db.read_file(path, strict=True)}
    assert by_tokens[16384] == meanwhile and by_tokens[8192].config.num_warps == 8
    assert set(rows_timed) == {10000, 2048}
