"""Kept tuning studies (journal files beside the user DB, pruned to the last N, safe with concurrent tuners) and
Optuna's plots of a study (which are drawn, which are skipped and why). CPU only, deterministic studies."""

from __future__ import annotations

import datetime as dt
import logging
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from flce_compile.tuning import studies

optuna = pytest.importorskip("optuna")

T0 = dt.datetime(2025, 1, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


def name_at(minutes: float, vocab: int = 32000) -> str:
    return studies.new_study_name("h200", vocab, 1024, "bf16", 8192, now=T0 + dt.timedelta(minutes=minutes))


def run_study(directory: Path, name: str, trials: int = 3) -> None:
    """A finished study in ``directory``'s running file: what the tuner leaves before ``studies.keep``."""
    study = optuna.create_study(storage=studies.running_storage(directory, name), study_name=name)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study.optimize(lambda t: float(t.suggest_categorical("triton.chunk_tokens", [512, 1024, 2048])), n_trials=trials)


def test_names_are_unique_and_informative():
    a, b = name_at(0), name_at(0)
    assert a != b  # same microsecond, two tuners: the random tag tells them apart
    assert a.startswith("h200_V32000_H1024_bf16_T8192_20250101T120000.000000Z_")
    with pytest.raises(ValueError, match="cannot name a study"):
        studies.new_study_name("H200 NVL", 1, 1, "bf16", 1)  # not a normalised GPU kind
    assert studies.studies_dir(Path("/x/tuning_db.json")) == Path("/x/tuning_db.studies")


def test_keep_renames_prunes_to_the_last_n_by_start_time(tmp_path):
    """Studies are kept newest-by-start-time (not by file age); files that are not studies, and studies still
    running (a concurrent tuner's), are never pruned."""
    d = tmp_path / "s"
    names = [name_at(m) for m in (3, 1, 4, 0, 2)]  # started out of order of their ends
    running = name_at(-5)  # the oldest start, still running
    run_study(d, running)
    (d / "notes.txt").write_text("mine")
    (d / "foreign.journal").write_text("not a study name")
    for name in names:
        run_study(d, name)
        studies.keep(d, name, keep_last=3)
    kept = [s.name for s in studies.kept_studies(d)]
    assert kept == [names[4], names[0], names[2]]  # started at minutes 2, 3, 4
    assert (d / (running + studies.RUNNING_SUFFIX)).exists()
    assert (d / "notes.txt").read_text() == "mine" and (d / "foreign.journal").exists()
    assert studies.prune(d, 1) == [names[4], names[0]]
    assert [s.name for s in studies.kept_studies(d)] == [names[2]]
    assert studies.prune(tmp_path / "missing", 1) == []
    with pytest.raises(ValueError, match="keep_last=0 must be >= 1"):
        studies.keep(d, running, keep_last=0)


def test_stale_running_files_are_swept(tmp_path):
    """A tuner killed mid-study leaves ``<name>.journal.running``; a prune deletes it once it is a day old."""
    d = tmp_path / "s"
    stale, fresh = name_at(0), name_at(1)
    run_study(d, stale)
    run_study(d, fresh)
    old = time.time() - studies.STALE_RUNNING_S - 60
    os.utime(d / (stale + studies.RUNNING_SUFFIX), (old, old))
    studies.prune(d, 5)
    assert not (d / (stale + studies.RUNNING_SUFFIX)).exists()
    assert (d / (fresh + studies.RUNNING_SUFFIX)).exists()


def test_a_kept_study_loads_in_a_new_storage(tmp_path):
    d = tmp_path / "s"
    name = name_at(0)
    run_study(d, name, trials=4)
    with pytest.raises(studies.StudyError, match="no kept study named"):
        studies.load(d, name)  # still running: not kept yet
    studies.keep(d, name, keep_last=2)
    study = studies.load(d, name)
    assert study.study_name == name and len(study.trials) == 4
    for bad in ("nope", "../s/" + name, name_at(9)):
        with pytest.raises(studies.StudyError, match="--list-studies lists the kept ones"):
            studies.load(d, bad)
    broken = name_at(10)
    (d / (broken + studies.STUDY_SUFFIX)).write_text("{not a journal\n")
    with pytest.raises(studies.StudyError, match="cannot be read"):
        studies.load(d, broken)


def _tuner(directory: str, index: int, rounds: int, keep_last: int) -> None:
    """One tuner process: studies one after another, each kept and the directory pruned."""
    for r in range(rounds):
        name = studies.new_study_name("h200", 1000 + index, 64, "bf16", 8192)
        run_study(Path(directory), name, trials=2)
        studies.keep(Path(directory), name, keep_last=keep_last)


def test_concurrent_tuners_keep_exactly_the_last_n(tmp_path):
    """Two tuner processes keeping and pruning at once: no error, no lost or half-written file; exactly the last
    N studies remain and each one loads."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_tuner, args=(str(tmp_path), i, 6, 3)) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert [p.exitcode for p in procs] == [0, 0]
    kept = studies.kept_studies(tmp_path)
    assert len(kept) == 3
    assert not list(tmp_path.glob("*" + studies.RUNNING_SUFFIX))
    for item in kept:
        assert len(studies.load(tmp_path, item.name).trials) == 2


# ------------------------------------------------------------------------------------------------------------
# plots
# ------------------------------------------------------------------------------------------------------------


def make_study(params: dict[str, list], trials: int) -> "optuna.Study":
    """An in-memory study over categorical ``params`` with a deterministic objective, sampled in a grid order."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(study_name=name_at(0), sampler=optuna.samplers.RandomSampler(seed=0))

    def objective(trial):
        values = [trial.suggest_categorical(name, choices) for name, choices in params.items()]
        return 1.0 + sum(abs(v - 2048) / 1024 for v in values if isinstance(v, int)) + 0.1 * trial.number

    study.optimize(objective, n_trials=trials)
    return study


def assert_png(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = matplotlib.image.imread(path).shape[:2]
    assert height > 200 and width > 200, (path, height, width)


@pytest.fixture
def plots_mod():
    pytest.importorskip("matplotlib")
    from flce_compile.tuning import plots

    return plots


def test_draws_history_importances_and_contour(tmp_path, plots_mod):
    study = make_study({"strategy": ["triton"], "triton.chunk_tokens": [512, 2048, 8192],
                        "triton.block_v": [4096, 8192], "triton.num_warps": [8, 16]}, trials=12)
    written = plots_mod.draw_study(study, plots_mod.prepare_dir(tmp_path / "new" / "plots"))
    assert [p.name for p in written] == [f"{study.study_name}_{k}.png" for k in ("history", "importances", "contour")]
    for path in written:
        assert_png(path)


def test_slice_when_no_contour_and_notes_for_skipped_plots(tmp_path, plots_mod, caplog):
    """A torch-only study has no CE block: a slice of its chunk size instead of the contour. One complete trial:
    the history alone (the others are logged notes, not errors), and nothing without a complete trial."""
    study = make_study({"strategy": ["torch"], "torch.chunk_tokens": [512, 2048], "torch.streams": [False, True]}, 6)
    assert [p.name.rsplit("_", 1)[1] for p in plots_mod.draw_study(study, tmp_path)] == \
        ["history.png", "importances.png", "slice.png"]
    one = make_study({"triton.chunk_tokens": [512, 2048], "triton.block_v": [4096, 8192]}, trials=1)
    with caplog.at_level(logging.WARNING, logger="flce_compile"):
        written = plots_mod.draw_study(one, tmp_path)
    assert written == [tmp_path / f"{one.study_name}_history.png"]
    assert "no importances plot (needs 2 complete trials, the study has 1)" in caplog.text
    assert "no slice plot (the chunk and block sizes took one value or none" in caplog.text
    empty = optuna.create_study(study_name=name_at(1))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flce_compile"):
        assert plots_mod.draw_study(empty, tmp_path) == []
    assert "no history plot (no complete trial)" in caplog.text and "no importances plot" in caplog.text
    assert "no slice plot" in caplog.text


def test_one_varying_parameter_has_no_importances(tmp_path, plots_mod, caplog):
    study = make_study({"triton.chunk_tokens": [512, 2048, 8192], "triton.block_v": [4096]}, trials=6)
    with caplog.at_level(logging.WARNING, logger="flce_compile"):
        written = plots_mod.draw_study(study, tmp_path)
    assert [p.name.rsplit("_", 1)[1] for p in written] == ["history.png", "slice.png"]
    assert "needs 2 parameters that vary, the study varied 1" in caplog.text


def test_prepare_dir_refuses_a_file_and_an_unwritable_dir(tmp_path, plots_mod):
    (tmp_path / "f").write_text("")
    with pytest.raises(plots_mod.PlotDirError, match="is a file; give a directory"):
        plots_mod.prepare_dir(tmp_path / "f")
    with pytest.raises(plots_mod.PlotDirError, match="cannot write plots to"):
        plots_mod.prepare_dir(tmp_path / "f" / "below")
