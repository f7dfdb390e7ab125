"""Does the CE kernel's lane-wise pass 1 pay? (issue #13: the CE step is what separates the op from the floor)

``ce_chunk._lane_pass`` keeps a running max and sum per lane (a thread's 8 contiguous logits) and combines the lanes
once a row, where the block-wise ``_softmax_pass`` reduces every block over the whole program (warp shuffles and
shared-memory barriers a block). A config's ``lane_pass`` decides whether the chunk loop's plain forward takes it
(``flce-tune --retune-ce-tiles`` picks it per entry, with the tile); this A/B forces it each way
(``ce_triton.LANE_PASS``), whatever the shape's config says. Per shape:

* the CE step alone on one chunk (the shape's config: its chunk rows and CE tile), lane-wise and not, alternating
  ``--rounds`` times: median ms, DRAM passes of time (a copy of the chunk = 2), and how the two gradients differ
  (entries rounded apart, and each one's error against an fp64 gradient, as a norm relative to the gradient's);
* the op, forward + backward, lane-wise and not, in ``--turns`` rounds, each run right after the floor
  (``bench_flce.time_floor``), the variants alternating within a round: ratios to the floor.

By default both passes run the shape's config as it is, so its CE tile, picked for the block-wise pass. The tile
that suits one pass need not suit the other (on an H100, 2026-12-07, the lane-wise pass lost at the tuned tiles and
won at 8192:32), so ``--own-tiles`` first times the CE step at each of ``--tiles`` (and the config's own), each
way, on the shape's chunk, and then runs each pass, alone and in the op, at its own fastest tile.

    python benchmarks/ce_lane_pass.py [--shapes 16384x4096x128256 ...] [--turns 4] [--rounds 6] [--tag _rev]
                                      [--own-tiles [--tiles 4096:8 8192:32 ...]]

Writes benchmarks/results/ce_lane_pass_<gpu><tag>.{json,md} (and to $OUT when set). CUDA only.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import make_inputs, median_ms, save_results, shape_table, versions  # noqa: E402
from benchmarks.bench_flce import time_floor, time_fwd_bwd  # noqa: E402
from benchmarks.ce_kernel_tiles import TILES, parse_tile  # noqa: E402
from flce_compile import fused_linear_cross_entropy  # noqa: E402
from flce_compile.params import LossParams  # noqa: E402
from flce_compile.plan import registry  # noqa: E402
from flce_compile.plan.choose import resolve_config  # noqa: E402
from flce_compile.plan.config import FLCEConfig  # noqa: E402
from flce_compile.plan.layout import padded_row_elements  # noqa: E402
from flce_compile.strategies import ce_triton  # noqa: E402
from flce_compile.strategies.ce_common import CEStepArgs  # noqa: E402
from flce_compile.tuning.ce_tiles import Tile, ce_step_timer, tile_name, with_tile  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = ("16384x4096x128256", "16384x4096x151936", "65536x4096x128256", "8192x2304x256000", "4096x768x50257")


def lane_wise(on: bool, fn: Callable[[], Any]) -> Any:
    """``fn()`` with the lane-wise pass 1 switched on or off (restored after)."""
    with ce_triton.lane_pass(on):
        return fn()


def both_ways(config: FLCEConfig) -> dict[bool, FLCEConfig]:
    """``config`` for the lane-wise pass (True) and the block-wise one (False): the same tile."""
    return {True: config, False: config}


def chunk_gradients(rows: int, vocab: int, configs: Mapping[bool, FLCEConfig], device: str = "cuda",
                    seed: int = 0) -> dict[str, Any]:
    """One chunk's CE step both ways on the same logits (N(0, 2), rows padded to 128 bytes, ~6% ignored, "mean"),
    lane-wise with ``configs[True]``'s tile and block-wise with ``configs[False]``'s: the two gradients, an fp64
    one, and a step function per way that refills the logits and runs the step."""
    gen = torch.Generator(device=device).manual_seed(seed)
    stride = padded_row_elements(vocab, 2)
    base = (torch.randn(rows, stride, device=device, generator=gen) * 2).to(torch.bfloat16)
    target = torch.randint(0, vocab, (rows,), device=device, generator=gen)
    target[torch.rand(rows, device=device, generator=gen) < 0.06] = -100
    kept = target != -100
    scale = torch.full((), 1.0 / max(1, int(kept.sum())), device=device)
    buf = base.clone()
    args = CEStepArgs(logits=buf[:, :vocab], target=target, ce_weight=None,
                      weight_sum=torch.full((), float(vocab), device=device), ce_scale=scale, z_scale=scale,
                      loss_out=torch.empty(rows, device=device), lse_out=None, lse_in=None, write_grad=True,
                      padded=True)
    lanes = configs[True]
    assert lane_wise(True, lambda: ce_triton.lanes(lanes.block_v, lanes.num_warps)) > 0, "no lanes at this tile"
    steps = {on: (lambda on=on: lane_wise(on, lambda: ce_triton.ce_step_triton(args, LossParams(), configs[on])))
             for on in (True, False)}
    grads = {}
    for on, step in steps.items():
        buf.copy_(base)
        step()
        grads[on] = buf[:, :vocab].clone()
    z = base[:, :vocab].double()
    exact = torch.softmax(z, 1)
    exact[kept.nonzero().squeeze(1), target[kept]] -= 1
    exact = exact * scale.double() * kept[:, None]
    return {"grads": grads, "exact": exact, "steps": steps, "refill": lambda: buf.copy_(base), "base": base}


def own_tiles(rows: int, vocab: int, config: FLCEConfig, tiles: list[tuple[int, int]],
              reps: int = 10, device: str = "cuda") -> tuple[dict[bool, FLCEConfig], dict[str, dict[str, float]]]:
    """Each pass's fastest tile on the (rows, V) chunk: the CE step timed (``CEStepTimer``, what ``flce-tune
    --retune-ce-tiles`` times) at each of ``tiles`` and ``config``'s own, at ``config``'s num_stages, each way
    (a tile the launch rules reject for V is left out). Returns ``config`` at each pass's fastest tile, and the
    ms per tile name each way ("lanes", "blocks")."""
    timer = ce_step_timer(torch.device(device), reps=reps, warmup=2)
    candidates = dict.fromkeys([*tiles, (config.block_v, config.num_warps)])
    rules = registry.get("triton").check
    # The launch rules do not look at the pass (as in ce_tiles.legal_tiles): one check serves both ways.
    legal = [pair for pair in candidates
             if rules(with_tile(config, Tile(*pair, config.num_stages, False)), vocab) is None]
    if not legal:
        raise SystemExit(f"ce_lane_pass.py --own-tiles: no tile of {sorted(candidates)} runs V={vocab}; "
                         "pass --tiles with some that do")
    chosen: dict[bool, FLCEConfig] = {}
    timed: dict[str, dict[str, float]] = {}
    for on, way in ((True, "lanes"), (False, "blocks")):
        # The tile carries the pass: no switch to force.
        ms = {tile: timer(rows, vocab, torch.bfloat16, tile)
              for tile in (Tile(block_v, num_warps, config.num_stages, on) for block_v, num_warps in legal)}
        chosen[on] = with_tile(config, min(ms, key=ms.get))
        timed[way] = {tile_name(tile[:3]): t for tile, t in ms.items()}  # the pass is the dict's
    return chosen, timed


def ce_alone(rows: int, vocab: int, configs: Mapping[bool, FLCEConfig], rounds: int) -> dict[str, Any]:
    """The CE step alone on one chunk, lane-wise and not, alternating ``rounds`` times (see the module)."""
    case = chunk_gradients(rows, vocab, configs)
    src = case["base"]
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), 20, "cuda")
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for on in (True, False):
            median_ms(case["steps"][on], 2, "cuda", before=case["refill"])  # warm (and compile)
            times[on].append(median_ms(case["steps"][on], 10, "cuda", before=case["refill"]))
    exact = case["exact"]
    err = {on: ((g.double() - exact).norm() / exact.norm()).item() for on, g in case["grads"].items()}
    return {"copy_ms": copy_ms, "ms": {on: statistics.median(t) for on, t in times.items()}, "rounds": times,
            "error": err, "apart": int((case["grads"][True] != case["grads"][False]).sum().item())}


def op_turns(n: int, hidden: int, vocab: int, turns: int,
             configs: Mapping[bool, FLCEConfig | None] | None = None) -> dict[bool, list[tuple[float, float, float]]]:
    """The op, forward + backward, lane-wise and not (with ``configs[on]``, or as called without options), each
    right after the floor, alternating in ``turns`` rounds: (ms, floor ms, ratio) per round."""
    x, w, t = make_inputs(n, hidden, vocab)
    op: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    for _ in range(turns):
        for on in (True, False):
            config = (configs or {}).get(on)
            fn = fused_linear_cross_entropy if config is None else (
                lambda a, b, c, config=config: fused_linear_cross_entropy(a, b, c, config=config))
            floor = time_floor(x, w, t)
            ms, _gb = lane_wise(on, lambda: time_fwd_bwd(fn, x, w, t))
            op[on].append((ms, floor, ms / floor))
    return op


def run_shape(shape: str, turns: int, rounds: int,
              tiles: list[tuple[int, int]] | None = None) -> tuple[list[str], dict[str, Any]]:
    """One shape's row: at the config's tile, or with ``tiles`` each pass at its own fastest of them."""
    n, hidden, vocab = map(int, shape.split("x"))
    config, _source = resolve_config(None, n, vocab, hidden, torch.bfloat16, torch.device("cuda"))
    rows = min(config.chunk_tokens, n)
    configs, tile_ms = both_ways(config), None
    if tiles is not None:
        configs, tile_ms = own_tiles(rows, vocab, config, tiles)
        torch.cuda.empty_cache()
    ce = ce_alone(rows, vocab, configs, rounds)
    torch.cuda.empty_cache()
    op = op_turns(n, hidden, vocab, turns, configs if tiles is not None else None)
    torch.cuda.empty_cache()
    ratio = {on: statistics.median(r for _ms, _f, r in op[on]) for on in op}
    ms, err, copy_ms = ce["ms"], ce["error"], ce["copy_ms"]
    tile = {on: f"{c.block_v}:{c.num_warps}" for on, c in configs.items()}
    data = {"shape": shape, "config": str(config), "chunk_rows": rows, "copy_ms": copy_ms,
            "tiles": {"lanes": tile[True], "blocks": tile[False]}, "tile_ms": tile_ms,
            "ce_ms": {"lanes": ms[True], "blocks": ms[False]},
            "ce_rounds": {"lanes": ce["rounds"][True], "blocks": ce["rounds"][False]},
            "grad_error": {"lanes": err[True], "blocks": err[False]}, "entries_apart": ce["apart"],
            "op": {"lanes": op[True], "blocks": op[False]},
            "x_floor": {"lanes": ratio[True], "blocks": ratio[False]}}
    tiles_cell = tile[True] if tile[True] == tile[False] else f"{tile[True]} / {tile[False]}"
    line = (f"| {shape} | {rows} x {tiles_cell} | {ms[True]:.3f} / {2 * ms[True] / copy_ms:.2f} "
            f"| {ms[False]:.3f} / {2 * ms[False] / copy_ms:.2f} | {err[True]:.3e} / {err[False]:.3e} | {ce['apart']} "
            f"| {ratio[True]:.4f} | {ratio[False]:.4f} | {' '.join(f'{r:.4f}' for *_x, r in op[True])} "
            f"| {' '.join(f'{r:.4f}' for *_x, r in op[False])} |")
    return [line], data


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="BT x H x V")
    parser.add_argument("--turns", type=int, default=4, help="rounds of the op against its floor, both ways")
    parser.add_argument("--rounds", type=int, default=6, help="alternations of the CE step alone")
    parser.add_argument("--tag", default="", help="suffix of the results' file names")
    parser.add_argument("--own-tiles", action="store_true",
                        help="run each pass at its own fastest CE tile of --tiles (and the config's), not the config's")
    parser.add_argument("--tiles", type=parse_tile, nargs="+", default=None, metavar="BLOCK_V:NUM_WARPS",
                        help=f"the tiles --own-tiles times (default: {' '.join(TILES)})")
    args = parser.parse_args(argv)
    if args.tiles is not None and not args.own_tiles:
        parser.error("--tiles is what --own-tiles times: pass --own-tiles too")
    tiles = (args.tiles or [parse_tile(t) for t in TILES]) if args.own_tiles else None
    if not torch.cuda.is_available():
        sys.exit("ce_lane_pass.py needs a CUDA GPU")
    gpu = torch.cuda.get_device_name()
    env = {"device": gpu, "date": datetime.date.today().isoformat(), **versions(),
           "own_tiles": None if tiles is None else [f"{b}:{w}" for b, w in tiles]}
    where = (", each pass at its own fastest tile (lanes / blocks where they differ; every tile's ms in the JSON)"
             if tiles is not None else ", at its tile")
    heading = [f"# ce_lane_pass: {gpu}, torch {env['torch']}, triton {env.get('triton')}, {env['date']}", "",
               "The CE kernel's pass 1 lane-wise (a max and sum per lane, combined once a row) against block-wise. "
               f"CE step alone on one chunk of the shape's config{where}: median ms / DRAM passes of time "
               "(a copy = 2); "
               "gradient error = |g - fp64| / |fp64| (norms), lanes / blocks; apart = entries rounded differently. "
               "Op = forward + backward against the floor timed right before it, median of the rounds' ratios, then "
               "each round's.", "",
               "| BT x H x V | chunk x tile | CE lanes | CE blocks | gradient error | apart | op lanes | op blocks "
               "| rounds lanes | rounds blocks |", "|---|---|---|---|---|---|---|---|---|---|"]
    md, rows = shape_table(heading, args.shapes, lambda shape: run_shape(shape, args.turns, args.rounds, tiles))
    save_results(RESULTS, f"ce_lane_pass_{gpu.replace(' ', '_')}{args.tag}", md, {"env": env, "rows": rows})


if __name__ == "__main__":
    main()
