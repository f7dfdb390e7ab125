"""Optuna's own matplotlib plots of one tuning study, saved as PNG files named after the study.

Why: the tuner's summary line says what won, not how the search got there; the optimization history, the
parameter importances and chunk size against CE block size show whether more trials would help and which
knobs matter for a shape. Drawn by ``optuna.visualization.matplotlib`` (no plot code of our own to maintain),
from a study in memory or a kept one (``tuning.studies``). matplotlib is imported only here, with the Agg
backend, so tuning without ``--plot`` never needs it and no display is ever opened.

Plots (``<study>_<kind>.png``): ``history``; ``importances`` (needs 2 complete trials and 2 parameters that
vary); ``contour`` of ``triton.chunk_tokens`` against ``triton.block_v`` when both took 2 values in complete
trials, else a ``slice`` of those of the chunk and block parameters that took 2 values. A plot Optuna cannot draw
meaningfully is skipped with a logged note.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

from ..log import logger

#: The objective's axis label: the search minimises the median time of one fwd+bwd.
TARGET_NAME = "time (ms)"
#: Chunk size against CE block size: the pair the contour shows, then the fallback slice's candidates.
CONTOUR_PARAMS = ("triton.chunk_tokens", "triton.block_v")
SLICE_PARAMS = ("triton.chunk_tokens", "triton.block_v", "torch.chunk_tokens")
#: Saved figure resolution (dots per inch): readable, about 30-60 KB a plot.
DPI = 110


class PlotDirError(OSError):
    """The plot directory cannot be created or written; the message names the path and the reason."""


def require_matplotlib() -> None:
    """Import matplotlib with the Agg backend (files only, no display); ImportError with the fix if missing."""
    try:
        import matplotlib  # noqa: PLC0415
    except ImportError as exc:
        raise ImportError("drawing plots needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")


def prepare_dir(directory: Path) -> Path:
    """Create ``directory`` and check a file can be written in it (before minutes of tuning, not after).

    A probe file rather than ``os.access``: root passes ``os.access`` on a read-only file system."""
    if directory.exists() and not directory.is_dir():
        raise PlotDirError(f"{directory} is a file; give a directory (created if missing)")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise PlotDirError(f"cannot write plots to {directory}: {exc.strerror or exc}") from exc
    return directory


def _complete_params(study: Any) -> list[dict[str, Any]]:
    """The parameters of each complete trial (the only ones Optuna plots)."""
    from optuna.trial import TrialState  # noqa: PLC0415

    return [t.params for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]


def _distinct(trials: list[dict[str, Any]], name: str) -> int:
    return len({t[name] for t in trials if name in t})


def _history(study: Any, trials: list[dict[str, Any]]) -> tuple[str | None, Callable[[], Any]]:
    from optuna.visualization.matplotlib import plot_optimization_history  # noqa: PLC0415

    reason = None if trials else "no complete trial"
    return reason, lambda: plot_optimization_history(study, target_name=TARGET_NAME)


def _importances(study: Any, trials: list[dict[str, Any]]) -> tuple[str | None, Callable[[], Any]]:
    from optuna.visualization.matplotlib import plot_param_importances  # noqa: PLC0415

    varying = [name for name in set().union(*trials) if _distinct(trials, name) > 1]
    reason = None
    if len(trials) < 2:
        reason = f"needs 2 complete trials, the study has {len(trials)}"
    elif len(varying) < 2:
        reason = f"needs 2 parameters that vary, the study varied {len(varying)}"
    return reason, lambda: plot_param_importances(study, target_name=TARGET_NAME)


def _chunk_vs_block(study: Any, trials: list[dict[str, Any]]) -> tuple[str, str | None, Callable[[], Any]]:
    """("contour" or "slice", a reason to skip or None, the drawer) for chunk size against block size."""
    from optuna.visualization.matplotlib import plot_contour, plot_slice  # noqa: PLC0415

    both = [t for t in trials if all(p in t for p in CONTOUR_PARAMS)]
    if all(_distinct(both, p) > 1 for p in CONTOUR_PARAMS):
        return "contour", None, lambda: plot_contour(study, params=list(CONTOUR_PARAMS), target_name=TARGET_NAME)
    varied = [p for p in SLICE_PARAMS if _distinct(trials, p) > 1]
    reason = None if varied else "the chunk and block sizes took one value or none in complete trials"
    return "slice", reason, lambda: plot_slice(study, params=varied, target_name=TARGET_NAME)


def _save(axes: Any, path: Path) -> None:
    """Save the figure of the Axes (or array of Axes) Optuna returned, and free it."""
    import matplotlib.pyplot as plt  # noqa: PLC0415

    first = axes.flat[0] if hasattr(axes, "flat") else axes
    figure = first.figure
    try:
        figure.savefig(path, dpi=DPI, bbox_inches="tight")
    finally:
        plt.close(figure)


def draw_study(study: Any, directory: Path) -> list[Path]:
    """Draw the study's plots into ``directory`` (made by ``prepare_dir``); returns the files written.

    A plot that cannot be drawn meaningfully (too few trials, nothing varied) or that Optuna fails to draw is
    skipped with a logged note; the others are still drawn. A file that cannot be written raises OSError."""
    import optuna  # noqa: PLC0415

    require_matplotlib()
    trials = _complete_params(study)
    kind, reason, draw = _chunk_vs_block(study, trials)
    plots = [("history", *_history(study, trials)), ("importances", *_importances(study, trials)), (kind, reason, draw)]
    written: list[Path] = []
    for kind, reason, draw in plots:
        if reason is not None:
            logger.warning("%s: no %s plot (%s)", study.study_name, kind, reason)
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", category=optuna.exceptions.ExperimentalWarning)
                axes = draw()
        except Exception as exc:  # noqa: BLE001 - one plot Optuna cannot draw must not cost the others
            logger.warning("%s: no %s plot (Optuna: %s: %s)", study.study_name, kind, type(exc).__name__, exc)
            continue
        path = directory / f"{study.study_name}_{kind}.png"
        _save(axes, path)
        written.append(path)
    return written
