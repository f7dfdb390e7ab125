"""The Optuna study that searches a ``SearchSpace`` by calling an injected objective.

Why injected: the real objective (``measure.make_objective``) needs a GPU; the loop itself (seeding with the
default and the current DB entry, pruning, the memory constraint, failure handling, the final confirmation)
is plain Python and is tested on CPU with a deterministic objective.

The objective is ``config -> (ms, peak_bytes)``. It raises ``TrialRejected`` for wrong results, and any other
exception for a config that cannot run (out of resources, compile error, OOM); each is recorded as a failed
trial and the study goes on. Freeing what a failed trial left behind (e.g. tensors held by an OOM's traceback)
is the objective's job: ``measure.make_objective`` collects garbage before it measures. Only
``KeyboardInterrupt``/``SystemExit`` end the study early (the best result so far is still returned).
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from ..plan.config import FLCEConfig
from ..log import logger
from .ce_tiles import tile_of, with_tile
from .space import SearchSpace

#: The objective: measure one config, return (median ms, peak bytes), or raise.
Objective = Callable[[FLCEConfig], "tuple[float, int]"]

#: A winner that needs more memory than the default must be at least this much faster (a fraction of the
#: default's time) in the confirmation run, or the default is kept: on the H200 the search's 1% wins were
#: within run-to-run noise (bench_tuning re-measured one at 1.00x), and each cost up to 0.5 GB.
MEMORY_GAIN_MARGIN = 0.02
#: Peaks within this many bytes of the default's count as equal memory (allocator rounding).
SAME_PEAK_SLACK_BYTES = 2**20


class TrialRejected(Exception):
    """The config ran but produced a wrong loss or wrong gradients; it must never be stored."""


class _TrialFailed(Exception):
    """Internal: marks an Optuna trial FAIL after the failure was recorded."""


def classify_failure(exc: BaseException) -> str:
    """A short kind for a failed trial: rejected, device_error, oom, out_of_resources, compile_error or error.

    By class name and message, so no GPU library has to be importable here.
    """
    if isinstance(exc, TrialRejected):
        return "rejected"
    names = {cls.__name__ for cls in type(exc).__mro__}
    text = str(exc).lower()
    if any(s in text for s in ("illegal memory access", "unspecified launch failure", "device-side assert",
                               "misaligned address", "illegal instruction")):
        return "device_error"  # the CUDA context is unusable: the study must stop
    if "OutOfMemoryError" in names or "out of memory" in text:
        return "oom"
    if "OutOfResources" in names or "out of resource" in text:
        return "out_of_resources"
    if names & {"CompilationError", "CompileTimeAssertionFailure", "MLIRCompilationError"} or "compil" in text:
        return "compile_error"
    return "error"


@dataclass
class TrialRecord:
    """What happened to one trial. ``status``: ok, infeasible (over the memory budget as measured), pruned
    (not run), duplicate (already measured in this study), rejected, device_error, oom, out_of_resources,
    compile_error, error."""

    number: int
    config: FLCEConfig
    status: str
    ms: float | None = None
    peak_bytes: int | None = None
    predicted_bytes: int | None = None
    message: str | None = None
    seconds: float = 0.0

    @property
    def measured(self) -> bool:
        """Whether the objective was called for this trial (it cost device time)."""
        return self.status not in ("pruned", "duplicate")


@dataclass
class SearchResult:
    """The outcome of one study. ``best`` is None when no config both ran correctly and fit the budget."""

    best: FLCEConfig | None
    best_ms: float | None
    best_peak_bytes: int | None
    default: FLCEConfig
    default_ms: float | None
    default_peak_bytes: int | None
    records: list[TrialRecord] = field(default_factory=list)
    elapsed_s: float = 0.0
    stopped: str = "done"
    #: The database's current answer the study was seeded with (as the space spells it), or None (also where the
    #: space cannot hold it: another strategy, over the budget).
    db_config: FLCEConfig | None = None
    #: The Optuna study the search ran (in memory, or in the ``storage`` given to ``run_search``): its trials
    #: are what ``tuning.plots`` draws. None if the study could not be created.
    study: Any = field(default=None, repr=False, compare=False)

    @property
    def n_measured(self) -> int:
        return sum(r.measured for r in self.records)

    @property
    def db_config_tried(self) -> bool:
        """Whether the database's current answer, if there is one, had a trial (measured, pruned by the budget,
        failed, or answered as a duplicate). A study that stopped before it cannot say its winner beats it."""
        return self.db_config is None or any(r.config == self.db_config for r in self.records)

    @property
    def speedup(self) -> float | None:
        if self.best_ms is None or self.default_ms is None:
            return None
        return self.default_ms / self.best_ms

    def failures(self) -> dict[str, int]:
        """Count of trials per failure kind."""
        out: dict[str, int] = {}
        for r in self.records:
            if r.status not in ("ok", "duplicate"):
                out[r.status] = out.get(r.status, 0) + 1
        return out


def _has_set_constraint() -> bool:
    import optuna  # noqa: PLC0415

    return hasattr(optuna.trial.Trial, "set_constraint")


def memory_constraints(trial: Any) -> list[float]:
    """Optuna constraints function: [GiB over the memory budget] (feasible when <= 0).

    The excess is ``max(measured peak, the op's sympy bound) - budget`` and is stored on the trial by the
    objective wrapper. With Optuna >= 5 the same value is set through ``trial.set_constraint``; this function
    is passed as the sampler's ``constraints_func`` on older versions.
    """
    return [float(trial.user_attrs.get("memory_excess_gib", 0.0))]


def _with_tile_of(neighbour: FLCEConfig, db_config: FLCEConfig | None, default: FLCEConfig,
                  space: SearchSpace) -> FLCEConfig:
    """A larger-chunk neighbour of the default with the DB entry's CE tile (what ``flce-tune --retune-ce-tiles``
    picks for an entry), where the entry runs the same
    strategy and its tile is legal here; any other neighbour as it is. The tile is about the walk along a row of
    V, not the rows, so the tile the entry's chunk ran best with is the likelier winner at a larger chunk too,
    and a re-tune with a small trial budget should not trade a re-picked tile for the default's (it did on the
    H200: six 32768- and 65536-token entries went back to 4096:8:1)."""
    if (db_config is None or db_config.strategy != neighbour.strategy
            or neighbour.chunk_tokens == default.chunk_tokens
            or tile_of(neighbour) != tile_of(default)):
        return neighbour
    tiled = space.canonical(with_tile(neighbour, tile_of(db_config)))
    return tiled if space.check(tiled) is None else neighbour


def run_search(
    objective: Objective,
    space: SearchSpace,
    *,
    default: FLCEConfig,
    db_config: FLCEConfig | None = None,
    n_trials: int = 40,
    timeout_s: float | None = None,
    seed: int = 0,
    budget_bytes: int | None = None,
    confirm: bool = True,
    memory_gain_margin: float = MEMORY_GAIN_MARGIN,
    seed_neighbours: bool = True,
    max_idle: int = 50,
    on_trial: Callable[[TrialRecord, "SearchResult"], None] | None = None,
    storage: Any = None,
    study_name: str | None = None,
) -> SearchResult:
    """Search for the fastest correct config that fits the memory budget.

    * TPE, seeded. The heuristic ``default`` and ``db_config`` (the current DB answer) are enqueued first, then
      (``seed_neighbours``) a few larger-chunk neighbours of the default, with the DB answer's CE tile where it
      runs the same strategy; so the default is always measured and the result is never worse than it.
    * ``n_trials`` counts configs actually measured; pruned and duplicate proposals are free (a duplicate is a
      config that runs like one already tried: ``SearchSpace.run_key``). The study also
      stops after ``timeout_s`` seconds, or after ``max_idle`` proposals in a row that measured nothing (the
      legal space is exhausted).
    * ``budget_bytes``: the space is first narrowed to what can fit it (``SearchSpace.within_budget``: a
      ValueError when nothing can); configs whose predicted bound exceeds it are pruned before running;
      measured ones carry ``max(measured, predicted) - budget`` as an Optuna constraint and only feasible ones
      can win.
    * ``confirm``: the winner and the default are measured once more, interleaved, and the winner is kept only
      if it is still faster (guards against a lucky measurement); a winner that takes more memory than the
      default must be faster by ``memory_gain_margin`` (a fraction of the default's time) or the default stays.
    * ``on_trial(record, partial_result)`` is called after every trial (progress bars).
    * ``storage`` / ``study_name``: where Optuna keeps the study (an Optuna storage object or URL, and a name
      new to it); default an unnamed in-memory study. ``tuning.studies`` passes a journal file so the study
      can be plotted later. Either way the study is ``result.study``.
    """
    import optuna  # noqa: PLC0415

    if n_trials < 1:
        raise ValueError(f"n_trials={n_trials} must be >= 1")
    if not 0 <= memory_gain_margin < 1:
        raise ValueError(f"memory_gain_margin={memory_gain_margin} must be in [0, 1) (0.02 = 2% faster)")
    if budget_bytes is not None and budget_bytes <= 0:
        raise ValueError(f"budget_bytes={budget_bytes} must be positive (or None for no budget)")
    if budget_bytes is not None and space.budget_bytes != budget_bytes:
        space = dataclasses.replace(space, budget_bytes=budget_bytes)
    space = space.within_budget()  # a tight budget leaves fewer strategies and values to sample
    default = space.canonical(default)
    db_config = space.canonical(db_config) if db_config is not None else None
    seeds: list[FLCEConfig] = [default]
    if db_config is not None and db_config != default:
        seeds.append(db_config)
    if seed_neighbours:
        # Neighbours over the budget would only be pruned, and would widen the narrowed space back.
        neighbours = (_with_tile_of(c, db_config, default, space) for c in space.neighbours(default))
        seeds.extend(c for c in neighbours if c not in seeds and space.over_budget(c) is None)
    space = space.including(seeds)

    # The DB's answer counts as a seed to try only where the space can hold it: a study of other strategies
    # (``--strategies torch``), or under a budget it does not fit, cannot try it, and its winner still stands.
    tryable = db_config if db_config is not None and space.check(db_config) is None else None
    result = SearchResult(best=None, best_ms=None, best_peak_bytes=None, default=default, default_ms=None,
                          default_peak_bytes=None, db_config=tryable)
    cache: dict[FLCEConfig, TrialRecord] = {}
    use_set_constraint = _has_set_constraint()
    idle = 0
    underestimates: list[FLCEConfig] = []
    started = time.monotonic()

    def excess_gib(peak: int | None, predicted: int | None) -> float:
        if budget_bytes is None:
            return 0.0
        used = max(peak or 0, predicted or 0)
        return (used - budget_bytes) / 2**30

    def constrain(trial: Any, excess: float) -> None:
        trial.set_user_attr("memory_excess_gib", excess)
        if use_set_constraint and budget_bytes is not None:
            trial.set_constraint("memory_gib", excess)

    def finish(record: TrialRecord) -> None:
        result.records.append(record)
        if record.status == "ok" and record.ms is not None and (result.best_ms is None or record.ms < result.best_ms):
            result.best, result.best_ms, result.best_peak_bytes = record.config, record.ms, record.peak_bytes
        if record.config == default and record.measured and result.default_ms is None and record.status in ("ok", "infeasible"):
            result.default_ms, result.default_peak_bytes = record.ms, record.peak_bytes
        if on_trial is not None:
            on_trial(record, result)

    def optuna_objective(trial: Any) -> float:
        nonlocal idle
        config = space.suggest(trial)
        trial.set_user_attr("config", config.to_json())
        run_key = space.run_key(config)
        seen = cache.get(run_key) or cache.get(config)
        if seen is not None:  # a config that runs like a measured one: answer from the cache, no device time
            idle += 1
            finish(TrialRecord(trial.number, config, "duplicate", seen.ms, seen.peak_bytes, seen.predicted_bytes,
                               f"same as trial {seen.number} ({seen.status})"))
            if seen.status in ("ok", "infeasible"):
                constrain(trial, excess_gib(seen.peak_bytes, seen.predicted_bytes))
                assert seen.ms is not None
                return seen.ms
            if seen.status == "pruned":
                raise optuna.TrialPruned(seen.message)
            raise _TrialFailed(seen.message)
        reason = space.check(config) or space.over_budget(config)
        if reason is not None:
            idle += 1
            record = TrialRecord(trial.number, config, "pruned", message=reason)
            cache[config] = record  # a pruning reason may be the config's own (its chunk), not its run's
            trial.set_user_attr("pruned", reason)
            if reason.startswith("memory bound"):
                constrain(trial, excess_gib(None, space.predicted_bytes(config)))
            finish(record)
            logger.debug("trial %d pruned: %s (%s)", trial.number, reason, config.to_json())
            raise optuna.TrialPruned(reason)
        idle = 0
        predicted = space.predicted_bytes(config)
        t0 = time.monotonic()
        failure: str | None = None
        try:
            ms, peak = objective(config)
            ms, peak = float(ms), int(peak)
            if not math.isfinite(ms) or ms <= 0:
                raise ValueError(f"objective returned ms={ms!r}; it must be a positive finite number")
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is a recorded trial, the study goes on
            kind = classify_failure(exc)
            failure = f"{type(exc).__name__}: {str(exc)[:300]}"
            record = TrialRecord(trial.number, config, kind, predicted_bytes=predicted, message=failure,
                                 seconds=time.monotonic() - t0)
            cache[run_key] = record
            trial.set_user_attr("failure", kind)
            trial.set_user_attr("message", failure)
            finish(record)
            logger.info("trial %d %s: %s (%s)", trial.number, kind, failure, config.to_json())
            if kind == "device_error":
                logger.error("the GPU context is broken (%s); stopping this search - restart the process", failure)
                result.stopped = "device_error"
                trial.study.stop()
        if failure is not None:
            # Raised outside the except block, so the failed run's traceback (and the GPU tensors its frames
            # hold, e.g. after an OOM) is not chained to this exception as its __context__.
            raise _TrialFailed(failure)
        if predicted is not None and peak > predicted * 1.05 + 64 * 2**20:
            log = logger.debug if underestimates else logger.warning  # once per search, details at debug level
            underestimates.append(config)
            log("measured peak %.3f GiB exceeds the memory bound %.3f GiB for %s; the memory model "
                           "underestimates", peak / 2**30, predicted / 2**30, config.to_json())
        excess = excess_gib(peak, predicted)
        constrain(trial, excess)
        trial.set_user_attr("peak_bytes", peak)
        status = "ok" if excess <= 0 else "infeasible"
        record = TrialRecord(trial.number, config, status, ms, peak, predicted, seconds=time.monotonic() - t0)
        if status == "infeasible":
            record.message = f"peak {max(peak, predicted or 0) / 2**30:.2f} GiB over the budget"
        cache[run_key] = record
        finish(record)
        logger.debug("trial %d %s: %.4f ms, %.3f GiB (%s)", trial.number, status, ms, peak / 2**30, config.to_json())
        return ms

    def stopper(study: Any, _trial: Any) -> None:
        if result.n_measured >= n_trials:
            study.stop()
        elif idle >= max_idle:
            result.stopped = "exhausted"
            study.stop()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=optuna.exceptions.ExperimentalWarning)
        warnings.simplefilter("ignore", category=FutureWarning)
        sampler = optuna.samplers.TPESampler(
            seed=seed,
            n_startup_trials=max(2, min(10, n_trials // 3)),
            multivariate=True,
            group=True,
            constraints_func=None if use_set_constraint else memory_constraints,
        )
    previous_verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # failed trials are ours to report, not Optuna's
    try:
        study = optuna.create_study(direction="minimize", sampler=sampler, storage=storage, study_name=study_name)
        result.study = study
        for config in seeds:
            if space.check(config) is None:
                study.enqueue_trial(space.to_params(config), skip_if_exists=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", category=optuna.exceptions.ExperimentalWarning)
            study.optimize(optuna_objective, n_trials=max(n_trials * 20, n_trials + 100), timeout=timeout_s,
                           catch=(_TrialFailed,), callbacks=[stopper], gc_after_trial=False)
        if result.stopped == "done" and result.n_measured < n_trials:
            result.stopped = "timeout" if timeout_s is not None else "trial cap"
    except (KeyboardInterrupt, SystemExit):
        result.stopped = "interrupted"
        logger.warning("search interrupted after %d measured trials; keeping the best so far", result.n_measured)
    finally:
        optuna.logging.set_verbosity(previous_verbosity)

    if confirm and result.stopped not in ("interrupted", "device_error"):
        try:
            _confirm(objective, result, budget_bytes, space, memory_gain_margin)
        except (KeyboardInterrupt, SystemExit):
            result.stopped = "interrupted"  # keep the unconfirmed best: it was measured and checked
            logger.warning("interrupted during the confirmation run; keeping the unconfirmed best")
    result.elapsed_s = time.monotonic() - started
    return result


def _confirm(objective: Objective, result: SearchResult, budget_bytes: int | None, space: SearchSpace,
             memory_gain_margin: float) -> None:
    """Re-measure the winner and the default, interleaved; keep the winner only if it is still faster, by
    ``memory_gain_margin`` when it needs more memory than the default."""
    if result.best is None or result.default_ms is None or result.best == result.default:
        return
    try:
        default_ms, default_peak = objective(result.default)
        best_ms, best_peak = objective(result.best)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:  # noqa: BLE001 - a winner that fails on re-run is not a winner
        logger.warning("confirmation run failed (%s: %s); falling back to the default config", type(exc).__name__, exc)
        if result.default_peak_bytes is not None and (budget_bytes is None or result.default_peak_bytes <= budget_bytes):
            result.best, result.best_ms, result.best_peak_bytes = result.default, result.default_ms, result.default_peak_bytes
        else:
            result.best = result.best_ms = result.best_peak_bytes = None
        return
    # The decision and the reported times use the fresh, interleaved pair only: taking the minimum with the
    # search's measurement would let one lucky run survive. Peaks are the larger of the two measurements, for
    # the default and the winner alike.
    result.default_ms = default_ms
    result.default_peak_bytes = max(default_peak, result.default_peak_bytes or 0)
    default_fits = (budget_bytes is None
                    or max(result.default_peak_bytes, space.predicted_bytes(result.default) or 0) <= budget_bytes)
    best_peak = max(best_peak, result.best_peak_bytes or 0)
    margin = memory_gain_margin if best_peak > result.default_peak_bytes + SAME_PEAK_SLACK_BYTES else 0.0
    if best_ms >= default_ms * (1.0 - margin) and default_fits:
        logger.info("confirmation: the winner (%.4f ms, %d B) is not faster than the default (%.4f ms, %d B) by "
                    "the required %.0f%%; keeping the default", best_ms, best_peak, default_ms,
                    result.default_peak_bytes, margin * 100)
        result.best, result.best_ms, result.best_peak_bytes = result.default, default_ms, result.default_peak_bytes
    else:
        result.best_ms, result.best_peak_bytes = best_ms, best_peak
