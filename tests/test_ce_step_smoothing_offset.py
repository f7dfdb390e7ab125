"""Label smoothing's term under a large common offset of the logits (both CE steps; the kernel through
TRITON_INTERPRET=1 on the CPU).

The term sum_c w_c (lse - z_c) was formed as W lse - sum_c w_c z_c, which cancels when every logit carries a large
offset: fp32 logits at +1000 gave row losses 4-27x eager's error against fp64. Both steps now sum w_c (z_c - max),
terms of one sign; each row's loss must be as close to fp64 as eager's F.cross_entropy on the same fp32 logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flce_compile.params import LossParams
from flce_compile.plan.config import FLCEConfig
from flce_compile.strategies.ce_common import CEStepArgs
from flce_compile.strategies.ce_torch import ce_step_torch

EPS = 0.1


def _steps() -> dict:
    steps = {"torch": (ce_step_torch, (64, 4000))}
    try:
        from flce_compile.strategies.ce_triton import ce_step_triton
    except ImportError:  # no triton: the torch step alone
        return steps
    steps["triton"] = (ce_step_triton, (16, 1000))
    return steps


def _row_losses(step, logits: torch.Tensor, target: torch.Tensor, ce_weight: torch.Tensor | None,
                config: FLCEConfig) -> torch.Tensor:
    n, vocab = logits.shape
    weight_sum = ce_weight.sum() if ce_weight is not None else torch.tensor(float(vocab), device=logits.device)
    one = torch.ones(n, device=logits.device)
    loss = torch.empty(n, device=logits.device)
    step(CEStepArgs(logits=logits.clone(), target=target, ce_weight=ce_weight, weight_sum=weight_sum, ce_scale=one,
                    z_scale=one, loss_out=loss, lse_out=torch.empty_like(loss, dtype=torch.float64), lse_in=None,
                    write_grad=False, grad_out=None),
         LossParams(label_smoothing=EPS), config)
    return loss


def _check(step, n: int, vocab: int, weighted: bool, offset: float, device: str, config: FLCEConfig) -> None:
    """Our row losses against fp64 no further than 1.5x eager's on the same fp32 logits."""
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(n, vocab, generator=g) * 3 + offset).to(device)
    target = torch.randint(0, vocab, (n,), generator=g).to(device)
    ce_weight = (torch.rand(vocab, generator=g) + 0.5).to(device) if weighted else None
    ref = F.cross_entropy(logits.double(), target, weight=None if ce_weight is None else ce_weight.double(),
                          label_smoothing=EPS, reduction="none")
    eager = F.cross_entropy(logits, target, weight=ce_weight, label_smoothing=EPS, reduction="none")
    ours = _row_losses(step, logits, target, ce_weight, config)
    eager_err = (eager.double() - ref).abs().max().item()
    our_err = (ours.double() - ref).abs().max().item()
    assert our_err <= 1.5 * eager_err, (our_err, eager_err)


@pytest.mark.parametrize("strategy", list(_steps()))
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "class_weights"])
@pytest.mark.parametrize("offset", [0.0, 1000.0])
def test_smoothing_term_does_not_cancel_under_a_common_offset(strategy, weighted, offset):
    step, (n, vocab) = _steps()[strategy]
    _check(step, n, vocab, weighted, offset, "cpu", FLCEConfig(block_v=64, num_warps=2))


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 50257], ids=["masked_loop", "unmasked_blocks"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "class_weights"])
def test_the_compiled_kernel_does_not_cancel_either(vocab, weighted):
    """The kernel compiled for the GPU, at a shipped tile, on both walks of a row."""
    from flce_compile.strategies.ce_triton import ce_step_triton

    _check(ce_step_triton, 512, vocab, weighted, 1000.0, "cuda", FLCEConfig(block_v=4096, num_warps=8))


@pytest.mark.parametrize("strategy", list(_steps()))
@pytest.mark.parametrize("weights", ["negative", "inf"])
def test_the_max_relative_sum_keeps_unusual_class_weights_eagers(strategy, weights):
    """Class weights of any sign (the rescale when the max rises is not skipped for a negative running weight
    sum, which gave the kernel wrong losses), and an inf weight (eager's inf, not nan from inf times a shift that
    did not move). Small blocks, so the max rises from block to block."""
    step, _ = _steps()[strategy]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 40, generator=g) * 3
    target = torch.randint(0, 40, (4,), generator=g)
    ce_weight = torch.rand(40, generator=g) + 0.5
    if weights == "negative":
        ce_weight[:16] = -1.0
        logits[:, :16] -= 5  # the first blocks' max is below the later ones'
    else:
        ce_weight[30] = float("inf")
    eager = F.cross_entropy(logits, target, weight=ce_weight, label_smoothing=EPS, reduction="none")
    ours = _row_losses(step, logits, target, ce_weight, FLCEConfig(block_v=16, num_warps=2))
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)


def test_vocab_slices_write_their_sums_relative_to_their_lse():
    """The vocabulary-parallel op combines each slice's sum_c w_c (z_c - lse_r) (``stats_out`` row 2), terms of
    one sign; the torch step writes it (the kernel's: ``test_vocab_parallel.test_stats_step_triton_matches_torch``).
    At +1000 on every logit, the raw sum_c w_c z_c it wrote before is ~3e4 and nothing of it may leak in."""
    g = torch.Generator().manual_seed(3)
    n, vocab, start, width = 8, 50, 20, 30
    logits = torch.randn(n, vocab, generator=g) * 2 + 1000
    target = torch.randint(0, vocab, (n,), generator=g)
    ce_weight = torch.rand(vocab, generator=g) + 0.5
    stats = torch.empty(3, n, dtype=torch.float64)
    one = torch.ones(n)
    ce_step_torch(CEStepArgs(logits=logits[:, start:start + width].clone(), target=target, ce_weight=ce_weight,
                             weight_sum=ce_weight.sum(), ce_scale=one, z_scale=one, loss_out=None, lse_out=None,
                             lse_in=None, write_grad=False, class_offset=start, num_classes=vocab, stats_out=stats,
                             scratch=True),
                  LossParams(label_smoothing=EPS))
    z = logits[:, start:start + width].double()
    expected = (z - torch.logsumexp(z, 1, keepdim=True)) @ ce_weight[start:start + width].double()
    torch.testing.assert_close(stats[2], expected, rtol=1e-6, atol=1e-4)  # fp32 terms ~ -5, their sum ~ -100
