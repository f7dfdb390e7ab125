"""benchmarks/ce_lane_pass.py's chunk on the CPU, through Triton's interpreter: the CE step lane-wise and block-wise on
the same logits, both as exact against fp64, and the plain forward takes the lane-wise pass (else the GPU table
would time one kernel twice); with ``--own-tiles``, each pass at the fastest of the tiles it timed."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def _errors(case) -> dict[str, float]:
    exact = case["exact"]
    return {name: ((case["grads"][on].double() - exact).norm() / exact.norm()).item()
            for name, on in (("lanes", True), ("blocks", False))}


def test_both_ways_on_one_chunk():
    from benchmarks.ce_lane_pass import both_ways, chunk_gradients
    from flce_compile.plan.config import FLCEConfig

    config = FLCEConfig(strategy="triton", block_v=64, num_warps=2)
    case = chunk_gradients(24, 200, both_ways(config), device="cpu")
    lanes, blocks = case["grads"][True], case["grads"][False]
    error = _errors(case)
    assert error["lanes"] < 2.0**-8 and error["lanes"] <= error["blocks"] * 1.05
    assert torch.all((lanes.double() - blocks.double()).abs() <= 2.0**-7 * blocks.double().abs() + 1e-30)
    assert not torch.equal(case["base"][:, :200], lanes)  # the step ran in place


def test_each_pass_at_a_tile_of_its_own():
    from benchmarks.ce_lane_pass import chunk_gradients
    from flce_compile.plan.config import FLCEConfig

    lanes_at = FLCEConfig(strategy="triton", block_v=128, num_warps=4)
    blocks_at = FLCEConfig(strategy="triton", block_v=64, num_warps=2)
    case = chunk_gradients(24, 200, {True: lanes_at, False: blocks_at}, device="cpu")
    error = _errors(case)
    assert max(error.values()) < 2.0**-8


def test_own_tiles_picks_each_pass_fastest_legal_tile(monkeypatch):
    from benchmarks import ce_lane_pass
    from flce_compile.plan.config import FLCEConfig
    from flce_compile.strategies import ce_triton

    timed = []

    class Timer:  # a fixed time a (tile, pass): the lane-wise pass fastest at 128:4, the block-wise at 64:2
        def __call__(self, rows, vocab, dtype, tile):
            assert ce_triton.LANE_PASS is None  # not forced: the tile's pass is the one its config runs
            timed.append((tile, tile.lane_pass))
            fast = (128, 4, 1) if tile.lane_pass else (64, 2, 1)
            return 1.0 if tile[:3] == fast else 2.0 + tile[0] / 1e4

    monkeypatch.setattr(ce_lane_pass, "ce_step_timer", lambda device, reps, warmup: Timer())
    before = ce_triton.LANE_PASS
    config = FLCEConfig(strategy="triton", block_v=256, num_warps=4, num_stages=1)
    chosen, ms = ce_lane_pass.own_tiles(24, 200, config, [(64, 2), (128, 4), (4096, 4)], device="cpu")
    assert ce_triton.LANE_PASS is before
    assert (chosen[True].block_v, chosen[True].num_warps) == (128, 4)
    assert (chosen[False].block_v, chosen[False].num_warps) == (64, 2)
    assert chosen[True].chunk_tokens == config.chunk_tokens  # only the tile moves
    assert chosen[True].lane_pass and not chosen[False].lane_pass  # each config says its pass
    # 4096 is past V's next power of two (the launch rules reject it); the config's own tile is timed too
    assert set(ms["lanes"]) == set(ms["blocks"]) == {"64:2:1", "128:4:1", "256:4:1"}
    assert sorted(on for _tile, on in timed) == [False] * 3 + [True] * 3


def test_own_tiles_with_none_that_runs_the_vocabulary_is_a_clear_error(monkeypatch):
    from benchmarks import ce_lane_pass
    from flce_compile.plan.config import FLCEConfig

    monkeypatch.setattr(ce_lane_pass, "ce_step_timer", lambda device, reps, warmup: lambda *a: 1.0)
    config = FLCEConfig(strategy="triton", block_v=4096, num_warps=4)
    with pytest.raises(SystemExit, match="--tiles"):
        ce_lane_pass.own_tiles(24, 200, config, [(8192, 4)], device="cpu")


def test_tiles_without_own_tiles_is_refused(capsys):
    from benchmarks import ce_lane_pass

    with pytest.raises(SystemExit):
        ce_lane_pass.main(["--tiles", "4096:8"])
    assert "--own-tiles" in capsys.readouterr().err


def test_own_tiles_times_the_real_ce_step_both_ways():
    from benchmarks import ce_lane_pass
    from flce_compile.plan.config import FLCEConfig

    config = FLCEConfig(strategy="triton", block_v=128, num_warps=4, num_stages=1)
    chosen, ms = ce_lane_pass.own_tiles(3, 300, config, [(256, 4)], reps=1, device="cpu")
    assert set(ms) == {"lanes", "blocks"}
    assert all(set(t) == {"128:4:1", "256:4:1"} and min(t.values()) > 0 for t in ms.values())
    for on, way in ((True, "lanes"), (False, "blocks")):
        assert f"{chosen[on].block_v}:{chosen[on].num_warps}:1" == min(ms[way], key=ms[way].get)
