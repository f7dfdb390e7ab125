"""The loss over kept logits runs the fused op's CE step: each strategy's (the Triton kernel under
TRITON_INTERPRET=1), over several chunks and a non-viewable slice of the logits, against fp64 torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flce_compile import kept_logits
from flce_compile.plan.config import FLCEConfig

OPTIONS = {
    "plain": {},
    "weighted_smoothed": {"ce_weight": torch.rand(37, generator=torch.Generator().manual_seed(2)) + 0.5,
                          "label_smoothing": 0.1},
    "softcap_scale": {"softcap": 5.0, "logit_scale": 0.5},
}


def _reference(z, t, ce_weight=None, reduction="mean", label_smoothing=0.0, softcap=None, logit_scale=1.0):
    s = z.double() * logit_scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    loss = F.cross_entropy(s.reshape(-1, s.shape[-1]), t.reshape(-1), reduction=reduction,
                           weight=ce_weight.double() if ce_weight is not None else None, label_smoothing=label_smoothing)
    return loss.view(t.shape) if reduction == "none" else loss


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("strategy", ["torch", "triton"])
def test_kept_logits_loss_through_each_strategy(monkeypatch, strategy, reduction, option):
    config = FLCEConfig(strategy=strategy, chunk_tokens=3, block_v=16, num_warps=1)
    monkeypatch.setattr(kept_logits, "kept_logits_config", lambda vocab, dtype, device: config)
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(2, 6, 37, generator=g) * 3)[:, :-1].detach().requires_grad_()  # rows not one view
    t = torch.randint(0, 37, (2, 5), generator=g)
    t[0, 1] = -100
    opts = OPTIONS[option]
    loss = kept_logits.kept_logits_cross_entropy(z, t, reduction=reduction, **opts)
    upstream = torch.rand(loss.shape, generator=g, dtype=torch.float64)
    (loss * upstream).sum().backward()
    zr = z.detach().double().requires_grad_()
    expected = _reference(zr, t, reduction=reduction, **opts)
    (expected * upstream).sum().backward()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(z.grad.double(), zr.grad, rtol=1e-5, atol=1e-6)
