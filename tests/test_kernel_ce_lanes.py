"""The CE kernel's lane-wise pass 1 (``ce_chunk._lane_pass``) against its block-wise one, through Triton's
interpreter: the same loss and gradient up to the sum's order of additions, both against fp64, on every kind of
loop the kernel has (padded rows, odd V unpadded with a masked tail, V a multiple of 16), tiles of one and of
several elements a lane, rows of -inf and ignored rows; on a GPU, at the tiles and widths the op runs."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from flce_compile.params import LossParams
from flce_compile.plan.config import FLCEConfig
from flce_compile.strategies import ce_triton
from flce_compile.strategies.ce_common import CEStepArgs

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")

ROWS = 12


def _step(logits: torch.Tensor, target: torch.Tensor, vocab: int, config: FLCEConfig, padded: bool,
          lane_wise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, gradient) of one chunk's CE step ("sum": a factor of 1), the config's pass 1 lane-wise or not."""
    buf, dev = logits.clone(), logits.device
    args = CEStepArgs(logits=buf[:, :vocab], target=target, ce_weight=None,
                      weight_sum=torch.tensor(float(vocab), device=dev), ce_scale=torch.tensor(1.0, device=dev),
                      z_scale=torch.tensor(1.0, device=dev), loss_out=torch.empty(len(target), device=dev),
                      lse_out=None, lse_in=None, write_grad=True, padded=padded)
    ce_triton.ce_step_triton(args, LossParams(), dataclasses.replace(config, lane_pass=lane_wise))
    return args.loss_out, buf[:, :vocab].float()


def _exact(logits: torch.Tensor, target: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, gradient) in fp64 of the chunk's first ``vocab`` columns ("sum"; ignored rows 0)."""
    z = logits[:, :vocab].double()
    kept = target != -100
    loss = torch.where(kept, torch.logsumexp(z, 1) - z.gather(1, target.clamp(min=0)[:, None])[:, 0], 0.0)
    grad = torch.softmax(z, 1)
    grad[kept.nonzero()[:, 0], target[kept]] -= 1
    grad[~kept] = 0
    return loss, grad


@interpreted
@pytest.mark.parametrize("vocab,stride,padded", [(1203, 1216, True), (1203, 1203, False), (1280, 1280, False)],
                         ids=["padded", "odd V", "V % 16 == 0"])
@pytest.mark.parametrize("block_v,num_warps", [(64, 2), (512, 1)], ids=["8 a lane", "16 a lane"])
def test_lane_wise_matches_block_wise_and_fp64(vocab, stride, padded, block_v, num_warps):
    assert block_v // ce_triton.lanes(block_v, num_warps, True) == (8 if block_v == 64 else 16)  # a lane's logits
    gen = torch.Generator().manual_seed(vocab + block_v)
    logits = (torch.randn(ROWS, stride, generator=gen) * 3).to(torch.bfloat16)
    logits[:, vocab:] = 1e4  # padding holds anything: never a class
    logits[2, : vocab // 2] = -float("inf")  # masked classes in the first half
    logits[3, 17] = 60.0  # one confident row
    target = torch.randint(0, vocab, (ROWS,), generator=gen)
    target[5] = -100
    target[2] = vocab - 1
    config = FLCEConfig(strategy="triton", block_v=block_v, num_warps=num_warps)
    loss_l, grad_l = _step(logits, target, vocab, config, padded, lane_wise=True)
    loss_b, grad_b = _step(logits, target, vocab, config, padded, lane_wise=False)

    exact_loss, exact_grad = _exact(logits, target, vocab)
    for loss in (loss_l, loss_b):
        assert torch.allclose(loss.double(), exact_loss, rtol=2e-6, atol=2e-6)
    assert torch.allclose(loss_l, loss_b, rtol=1e-6, atol=1e-6)
    err_l = ((grad_l.double() - exact_grad).norm() / exact_grad.norm()).item()
    err_b = ((grad_b.double() - exact_grad).norm() / exact_grad.norm()).item()
    assert err_l < 2.0**-8 and err_l <= err_b * 1.05 + 1e-12
    # at most one bf16 step apart wherever they differ; the ignored row 0 and the masked classes 0 both ways
    assert torch.all((grad_l - grad_b).abs() <= 2.0**-7 * grad_b.abs() + 1e-30)
    assert torch.all(grad_l[5] == 0) and torch.all(grad_l[2, : vocab // 2] == 0)


@interpreted
def test_a_row_of_minus_inf_is_as_block_wise():
    # every class -inf: the lanes' max stays -inf, their sums 0 (no -inf - -inf), and the row ends as eager's
    vocab, config = 320, FLCEConfig(strategy="triton", block_v=64, num_warps=2)
    logits = torch.randn(ROWS, vocab).to(torch.bfloat16)
    logits[4] = -float("inf")
    target = torch.zeros(ROWS, dtype=torch.long)
    loss_l, grad_l = _step(logits, target, vocab, config, False, lane_wise=True)
    loss_b, grad_b = _step(logits, target, vocab, config, False, lane_wise=False)
    assert torch.equal(loss_l.isnan(), loss_b.isnan()) and torch.equal(loss_l.isinf(), loss_b.isinf())
    assert torch.equal(grad_l.isnan(), grad_b.isnan())
    assert torch.allclose(loss_l[5:], loss_b[5:], rtol=1e-6)


def test_lanes_follow_the_config_and_the_tile(monkeypatch):
    assert ce_triton.lanes(4096, 8) == 0  # a config without lane_pass: the block-wise pass
    assert ce_triton.lanes(4096, 8, True) == 256  # a thread a lane: 2 x 8 elements each per block
    assert ce_triton.lanes(1024, 8, True) == 128  # fewer lanes than threads when the block is small
    monkeypatch.setattr(ce_triton, "LANE_PASS", False)  # forced (the A/B benchmarks): the config is overruled
    assert ce_triton.lanes(4096, 8, True) == 0
    with ce_triton.lane_pass(True):
        assert ce_triton.lanes(4096, 8) == 256
    assert ce_triton.LANE_PASS is False


@interpreted
def test_the_op_runs_pass_1_as_its_config_says(monkeypatch):
    """``FLCEConfig.lane_pass`` reaches the kernel from the op's config argument (a tuning entry's config takes the
    same path), and the op's loss and gradients match the block-wise pass's."""
    from flce_compile import fused_linear_cross_entropy

    launched = []
    real = ce_triton.lanes
    monkeypatch.setattr(ce_triton, "lanes", lambda *a: launched.append(real(*a)) or launched[-1])
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(24, 16, generator=g), torch.randn(300, 16, generator=g) / 4
    t = torch.randint(0, 300, (24,), generator=g)
    out = {}
    for lane_wise in (False, True):
        xo, wo = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fused_linear_cross_entropy(xo, wo, t, config={"strategy": "triton", "block_v": 64, "num_warps": 2,
                                                              "chunk_tokens": 8, "lane_pass": lane_wise})
        loss.backward()
        out[lane_wise] = (loss.detach(), xo.grad, wo.grad)
        assert launched and all((n > 0) == lane_wise for n in launched)
        launched.clear()
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab,stride", [(128256, 128256), (50257, 50304)], ids=["Llama 3", "GPT-2 padded"])
@pytest.mark.parametrize("block_v,num_warps", [(4096, 8), (8192, 8), (16384, 32)])
def test_on_the_gpu_lane_wise_is_as_exact_as_block_wise(vocab, stride, block_v, num_warps):
    gen = torch.Generator(device="cuda").manual_seed(block_v)
    rows = 64
    logits = (torch.randn(rows, stride, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    logits[0, 5] = 40.0  # a confident row
    target = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    target[1] = -100
    config = FLCEConfig(strategy="triton", block_v=block_v, num_warps=num_warps)
    padded = stride != vocab
    loss_l, grad_l = _step(logits, target, vocab, config, padded, lane_wise=True)
    loss_b, grad_b = _step(logits, target, vocab, config, padded, lane_wise=False)
    exact_loss, exact_grad = _exact(logits, target, vocab)
    err = {name: ((g.double() - exact_grad).norm() / exact_grad.norm()).item()
           for name, g in (("lanes", grad_l), ("blocks", grad_b))}
    assert err["lanes"] <= err["blocks"] * 1.05 + 1e-12, err
    assert (loss_l.double() - exact_loss).abs().max() <= 2 * (loss_b.double() - exact_loss).abs().max() + 1e-6
    assert torch.all((grad_l - grad_b).abs() <= 2.0**-7 * grad_b.abs() + 1e-30)
