"""benchmarks/ce_lane_pass.py's chunk on the CPU, through Triton's interpreter: the CE step lane-wise and block-wise on
the same logits, both as exact against fp64, and the plain forward takes the lane-wise pass (else the GPU table
would time one kernel twice)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def test_both_ways_on_one_chunk():
    from benchmarks.ce_lane_pass import chunk_gradients
    from flce_compile.plan.config import FLCEConfig

    config = FLCEConfig(strategy="triton", block_v=64, num_warps=2)
    case = chunk_gradients(24, 200, config, device="cpu")
    exact = case["exact"]
    lanes, blocks = case["grads"][True], case["grads"][False]
    error = {name: ((g.double() - exact).norm() / exact.norm()).item() for name, g in (("lanes", lanes),
                                                                                       ("blocks", blocks))}
    assert error["lanes"] < 2.0**-8 and error["lanes"] <= error["blocks"] * 1.05
    assert torch.all((lanes.double() - blocks.double()).abs() <= 2.0**-7 * blocks.double().abs() + 1e-30)
    assert not torch.equal(case["base"][:, :200], lanes)  # the step ran in place
