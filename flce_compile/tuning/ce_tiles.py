"""Re-pick the CE kernel's launch tile (block_v, num_warps, num_stages, and pass 1 lane-wise or block-wise) of
stored tuning entries, timing the CE step alone (``flce-tune --retune-ce-tiles``).

Why alone: the CE step is a few percent of a call (4.9 of 80 ms at 16384 x 4096 x 128256 on an H200), so the
tile barely moves a whole call at the tuner's noise, and whole-call trials could not tell tiles apart: until
this command re-picked them, the entries in ``tuning_db/h200.json`` kept the 16 warps they were seeded with,
although 8 warps run the step 15-18% faster there. Timed alone, on the chunk the entry's config launches it on (``min(chunk_tokens, tokens)`` rows
by V), the tiles separate clearly. The tile changes nothing else: not the GEMMs, not the memory.

After the pick, the whole call is measured again, the entry's config and the current default side by side in
the same process (``measure.make_objective``, which also checks the result against an fp32 reference), so an
entry's ``ms`` and ``default_ms`` always describe the code that wrote them. Where the default comes out faster
the entry takes the default, as a search's confirmation does.

Only the "triton" strategy's entries without a budget tier are re-picked: the recompute strategy launches its
kernel on other shapes in backward (vocabulary blocks), and a budget tier's default is fitted to the budget.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

from ..kernels import CE_CHUNK_REVISION
from ..log import logger
from ..params import LossParams
from ..plan import registry
from ..plan.config import FLCEConfig
from ..plan.layout import padded_row_elements
from ..plan.tuning_db import Entry, torch_dtype

#: The tiles the search space samples (``SearchSpace``'s defaults): every legal combination is timed.
BLOCK_V = (1024, 2048, 4096, 8192, 16384)
NUM_WARPS = (4, 8, 16, 32)
NUM_STAGES = (1, 2, 3)
#: A new tile must run the CE step at least this much faster than the entry's own (a fraction of its time), or
#: the entry keeps its tile: timings of one tile repeat within about 1% on an H200.
MIN_GAIN = 0.02
#: Where the default's whole call is faster than the entry's by more than this fraction, the entry takes the
#: default (the search keeps the default on a tie; 1% is the whole-call noise the tuner sees).
DEFAULT_WINS_BY = 0.01
#: The strategy whose entries are re-picked (its CE step runs on the chunk rows, see the module docstring).
STRATEGY = "triton"


class Tile(NamedTuple):
    """The CE kernel's launch: block, warps, stages, and whether pass 1 runs lane-wise (``FLCEConfig.lane_pass``)."""

    block_v: int
    num_warps: int
    num_stages: int
    lane_pass: bool = False


#: How a lane-wise tile's name ends ('8192:32:1:lanes'); a block-wise tile's name has three numbers, as before.
_LANES = "lanes"


def tile_of(config: FLCEConfig) -> Tile:
    return Tile(config.block_v, config.num_warps, config.num_stages, config.lane_pass)


def with_tile(config: FLCEConfig, tile: Tile) -> FLCEConfig:
    """``config`` launching its CE kernel with ``tile`` (a (block_v, num_warps, num_stages) triple: block-wise)."""
    tile = Tile(*tile)
    return dataclasses.replace(config, block_v=tile.block_v, num_warps=tile.num_warps, num_stages=tile.num_stages,
                               lane_pass=tile.lane_pass)


def tile_name(tile: Tile) -> str:
    """'block_v:num_warps:num_stages', with ':lanes' for a lane-wise pass 1, as the records and the CLI print it."""
    tile = Tile(*tile)  # a (block_v, num_warps, num_stages) triple is block-wise
    numbers = ":".join(map(str, tile[:3]))
    return f"{numbers}:{_LANES}" if tile.lane_pass else numbers


def parse_tile(name: str) -> Tile:
    """The tile ``tile_name`` printed as ``name``."""
    *numbers, last = name.split(":")
    lane_wise = last == _LANES
    if not lane_wise:
        numbers.append(last)
    block_v, num_warps, num_stages = (int(v) for v in numbers)
    return Tile(block_v, num_warps, num_stages, lane_wise)


def legal_tiles(vocab: int) -> list[Tile]:
    """The tiles the triton strategy's launch rules accept for ``vocab``, each block-wise and lane-wise, in a stable
    order (the two passes differ by a few percent either way, by shape and GPU: ``FLCEConfig.lane_pass``)."""
    rules = registry.get(STRATEGY).check
    out = []
    for block_v, num_warps, num_stages in itertools.product(BLOCK_V, NUM_WARPS, NUM_STAGES):
        config = FLCEConfig(strategy=STRATEGY, block_v=block_v, num_warps=num_warps, num_stages=num_stages)
        if rules(config, vocab) is None:  # the rules do not look at the pass: one check serves both
            out += [Tile(block_v, num_warps, num_stages, lane_wise) for lane_wise in (False, True)]
    return out


def retunable(entry: Entry) -> str | None:
    """Why ``entry`` is not re-picked, or None when it is."""
    if entry.config.strategy != STRATEGY:
        return f"strategy {entry.config.strategy} (its kernel runs on vocabulary blocks in backward)"
    if entry.budget_tier_gb is not None:
        return f"budget tier {entry.budget_tier_gb:g} GiB (its default is fitted to the budget)"
    return None


def ce_rows(entry: Entry) -> int:
    """The rows of the chunk the entry's config launches the CE step on, at the token count the entry was timed
    at (``measured_tokens``: a ``--tokens 10000`` entry's bucket is 8192, its chunk may hold 10000)."""
    return max(1, min(entry.config.chunk_tokens, entry.measured_tokens))


#: times a CE step: (rows, vocab, dtype, tile) -> median ms
CETimer = Callable[[int, int, torch.dtype, Tile], float]


class CEChunk(NamedTuple):
    """The inputs a ``CEStepTimer`` times tiles on: ``source`` the random logits, ``logits`` the buffer each run
    refills from it and the step overwrites (both at the chunk loop's padded row stride), ``args`` the step's
    arguments, whose ``loss_out`` holds the last run's loss rows (times ``ce_scale`` = 1 / rows)."""

    source: torch.Tensor
    logits: torch.Tensor
    args: Any


class CEStepTimer:
    """Times ``ce_step_triton`` alone on one (rows, V) chunk of random logits, as the chunk loop launches it
    (loss rows + in-place gradient, mean scales, rows at the loop's padded stride, which it may use). Each run
    starts from freshly refilled logits (the step overwrites them) and only the step is timed: CUDA events on a GPU,
    ``perf_counter`` on the CPU (Triton's interpreter: the tests). ``warmup`` untimed runs first (the first
    compiles). Inputs are made once per (rows, V, dtype) and kept for the next tile; ``chunk`` hands them out
    (``benchmarks/ce_kernel_tiles.py`` checks each tile's loss on them)."""

    def __init__(self, device: torch.device, reps: int = 20, seed: int = 0, warmup: int = 2) -> None:
        self.device, self.reps, self.seed, self.warmup = device, reps, seed, warmup
        self._cache: dict[tuple[int, int, torch.dtype], CEChunk] = {}
        self._params = LossParams()

    def chunk(self, rows: int, vocab: int, dtype: torch.dtype) -> CEChunk:
        """The (rows, V, dtype) chunk the tiles are timed on, made on first use."""
        from ..strategies.ce_common import CEStepArgs  # noqa: PLC0415 - imports the kernel path only when timing

        key = (rows, vocab, dtype)
        if key not in self._cache:
            self._cache.clear()  # one chunk at a time: a 4096 x 262144 bf16 chunk is 2 GiB, twice with its copy
            device = self.device
            gen = torch.Generator(device=device).manual_seed(self.seed)
            # Rows at the chunk loop's padded stride: an odd V (GPT-2's 50257) in unpadded rows misaligns the
            # kernel's loads, a layout the op never runs (4096:8 then took 1.73x the time of 8192:32 on an H200).
            stride = padded_row_elements(vocab, dtype.itemsize)
            source = torch.randn(rows, stride, device=device, generator=gen).mul_(3).to(dtype)[:, :vocab]
            logits = torch.empty(rows, stride, dtype=dtype, device=device)[:, :vocab]  # empty_like: contiguous
            target = torch.randint(0, vocab, (rows,), device=device, generator=gen)
            scale = torch.full((), 1.0 / rows, device=device)
            args = CEStepArgs(logits=logits, target=target, ce_weight=None,
                              weight_sum=torch.full((), float(vocab), device=device), ce_scale=scale,
                              z_scale=scale, loss_out=torch.empty(rows, device=device), lse_out=None,
                              lse_in=None, write_grad=True, padded=True)
            self._cache[key] = CEChunk(source, logits, args)
        return self._cache[key]

    def __call__(self, rows: int, vocab: int, dtype: torch.dtype, tile: Tile) -> float:
        """Median ms of the CE step with ``tile`` on the (rows, V, dtype) chunk."""
        from ..strategies.ce_triton import ce_step_triton  # noqa: PLC0415

        source, logits, args = self.chunk(rows, vocab, dtype)
        config = with_tile(FLCEConfig(strategy=STRATEGY), tile)
        times = []
        for run in range(self.reps + self.warmup):
            logits.copy_(source)
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                ce_step_triton(args, self._params, config)
                end.record()
                torch.cuda.synchronize(self.device)
                elapsed = start.elapsed_time(end)
            else:
                began = time.perf_counter()
                ce_step_triton(args, self._params, config)
                elapsed = (time.perf_counter() - began) * 1e3
            if run >= self.warmup:
                times.append(elapsed)
        return statistics.median(times)


def ce_step_timer(device: torch.device, reps: int = 20, seed: int = 0, warmup: int = 2) -> CEStepTimer:
    """The CE-step timer ``retune_entry`` uses (a ``CEStepTimer``; tests put a fake in its place)."""
    return CEStepTimer(device, reps=reps, seed=seed, warmup=warmup)


@dataclass
class TilePick:
    """The CE-step timings of one (rows, V, dtype) chunk and the tile an entry gets from them."""

    rows: int
    vocab: int
    current: Tile
    chosen: Tile
    ms: dict[str, float] = field(default_factory=dict)  # tile name -> CE step ms; a failed tile is absent
    failed: dict[str, str] = field(default_factory=dict)  # tile name -> why it could not run

    @property
    def changed(self) -> bool:
        return self.chosen != self.current

    def record(self) -> dict[str, Any]:
        """What the entry stores about the pick (its ``extra["ce_tile_retune"]``): the two tiles and their CE
        step times, not all of them (120 tiles a chunk would be most of the shipped file)."""
        own, chosen = self.ms.get(tile_name(self.current)), self.ms.get(tile_name(self.chosen))
        return {"rows": self.rows, "from": tile_name(self.current), "to": tile_name(self.chosen),
                "from_ms": None if own is None else round(own, 4),
                "to_ms": None if chosen is None else round(chosen, 4), "tiles_timed": len(self.ms),
                "kernel_revision": CE_CHUNK_REVISION}


def pick_tile(timer: CETimer, rows: int, vocab: int, dtype: torch.dtype, current: Tile,
              timings: dict[tuple[int, int, torch.dtype], tuple[dict[str, float], dict[str, str]]] | None = None,
              min_gain: float = MIN_GAIN) -> TilePick:
    """Time every legal tile on a (rows, V) chunk (memoised in ``timings`` across entries that share it) and
    choose the fastest, unless it beats ``current`` by less than ``min_gain`` (or ``current`` could not be
    timed and nothing could)."""
    current = Tile(*current)
    key = (rows, vocab, dtype)
    if timings is not None and key in timings:
        ms, failed = timings[key]
    else:
        ms, failed = {}, {}
        for tile in legal_tiles(vocab):
            try:
                ms[tile_name(tile)] = timer(rows, vocab, dtype, tile)
            except Exception as exc:  # noqa: BLE001 - out of resources for one tile must not end the pick
                failed[tile_name(tile)] = f"{type(exc).__name__}: {exc}"
                logger.debug("CE tile %s on %dx%d failed: %s", tile_name(tile), rows, vocab, exc)
        if timings is not None:
            timings[key] = (ms, failed)
    chosen = current
    if ms:
        best_name = min(ms, key=ms.get)
        own = ms.get(tile_name(current))
        if own is None or ms[best_name] < own * (1 - min_gain):
            chosen = parse_tile(best_name)
    return TilePick(rows=rows, vocab=vocab, current=current, chosen=chosen, ms=ms, failed=failed)


#: Measures the whole call of a config for one entry's problem: (entry, config) -> (ms, peak bytes).
WholeCall = Callable[[Entry, FLCEConfig], "tuple[float, int]"]


@dataclass
class Retuned:
    """One entry after the re-pick: the new entry to write (None: not re-picked, see ``skipped``)."""

    old: Entry
    new: Entry | None
    pick: TilePick | None = None
    skipped: str | None = None
    took_default: bool = False


def retune_entry(entry: Entry, timer: CETimer, whole_call: WholeCall, default: FLCEConfig,
                 timings: dict | None = None, *, stamp: dict[str, Any] | None = None) -> Retuned:
    """Re-pick ``entry``'s CE tile, then measure its whole call and the default's (``default``: the
    heuristic's config for the entry's problem) and build the entry to write. ``stamp`` holds the fields of
    the run (torch, triton, date) the new entry carries."""
    why = retunable(entry)
    if why is not None:
        return Retuned(old=entry, new=None, skipped=why)
    dtype = torch_dtype(entry.dtype)
    pick = pick_tile(timer, ce_rows(entry), entry.vocab, dtype, tile_of(entry.config), timings)
    config = with_tile(entry.config, pick.chosen)
    ms, peak = whole_call(entry, config)
    default_ms, default_peak = (ms, peak) if default == config else whole_call(entry, default)
    took_default = default_ms < ms * (1 - DEFAULT_WINS_BY)
    if took_default:
        config, ms, peak = default, default_ms, default_peak
    extra = {**entry.extra, "default_config": default.to_dict(),
             "ce_tile_retune": {**pick.record(), "took_default": took_default}}
    new = dataclasses.replace(
        entry, config=config, ms=round(ms, 5), peak_gb=round(peak / 1e9, 4),
        default_ms=round(default_ms, 5), default_peak_gb=round(default_peak / 1e9, 4),
        extra=extra, **(stamp or {}))
    return Retuned(old=entry, new=new, pick=pick, took_default=took_default)

