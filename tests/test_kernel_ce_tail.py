"""The CE kernel's two ways of walking a row (TRITON_INTERPRET=1 on the CPU).

At a vocabulary that is not a multiple of 16 (GPT-2's 50257) the kernel walks ``vocab - vocab % BLOCK_V``
columns without a mask and the last, partial block with one, so that its loads stay vectorized; at a multiple of
16 it keeps one masked loop. Each must give the torch step's loss, lse and gradient and leave the row padding
alone: a multiple of 16 (48), whole blocks and a tail (53), a row shorter than one block (11, only the tail),
whole blocks without a tail (8, which clamps the block to 8), with and without the options whose terms are
summed per block (class weights with smoothing, softcap, z-loss), in place or into a separate gradient buffer.

When the caller owns the rows' padding (``CEStepArgs.padded``, the chunk loop's buffers) a V that is not a multiple
of 16 takes a third walk: one masked loop up to V rounded up to 16. Whatever the padding holds (nan, inf) must
not reach the loss, and those columns' gradient is 0; the columns past that width stay untouched.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from flce_compile.params import LossParams  # noqa: E402
from flce_compile.plan.config import FLCEConfig  # noqa: E402
from flce_compile.strategies.ce_common import CEStepArgs  # noqa: E402
from flce_compile.strategies.ce_torch import ce_step_torch  # noqa: E402
from flce_compile.strategies.ce_triton import ce_step_triton  # noqa: E402

BLOCK_V = 16


def _step(step, store: torch.Tensor, vocab: int, target: torch.Tensor, ce_weight, p: LossParams,
          separate_grad: bool, padded: bool = False):
    """One CE step on a copy of ``store``'s first ``vocab`` columns (its row stride kept): loss, lse, the
    gradient, the copy and the separate gradient's buffer (whose padding columns the step must leave alone)."""
    buffer = store.clone()
    logits = buffer[:, :vocab]
    # A separate gradient buffer at the same padded stride, NaN-filled: a stray write past V lands in its padding.
    grad_buffer = torch.full_like(store, float("nan"))
    grad = grad_buffer[:, :vocab] if separate_grad else None
    weight_sum = ce_weight.sum() if ce_weight is not None else torch.tensor(float(vocab))
    scale = torch.tensor(1.0 / target.numel())
    loss, lse = torch.empty(target.numel()), torch.empty(target.numel())
    step(CEStepArgs(logits=logits, target=target, ce_weight=ce_weight, weight_sum=weight_sum, ce_scale=scale,
                    z_scale=scale, loss_out=loss, lse_out=lse, lse_in=None, write_grad=True, grad_out=grad,
                    padded=padded),
         p, FLCEConfig(block_v=BLOCK_V))
    return loss, lse, grad if separate_grad else logits, buffer, grad_buffer


#: V -> whether the kernel walks whole blocks unmasked (V not a multiple of 16; BLOCK_V is min(16, next_pow2(V))).
WALKS = {48: False, 53: True, 11: True, 8: True}


def _garbage_padding(store: torch.Tensor, vocab: int) -> torch.Tensor:
    """``store`` with nan, inf, -inf and a huge value cycling through its padding columns."""
    store = store.clone()
    junk = torch.tensor([float("nan"), float("inf"), float("-inf"), 3e38])
    pad = store[:, vocab:]
    pad.copy_(junk.repeat(pad.numel() // 4 + 1)[: pad.numel()].view_as(pad))
    return store


@pytest.mark.parametrize("vocab", list(WALKS), ids=["multiple-of-16", "blocks-and-tail", "tail-only",
                                                     "whole-blocks-no-tail"])
@pytest.mark.parametrize("options", ["plain", "weighted-smoothing-softcap"])
@pytest.mark.parametrize("separate_grad", [False, True], ids=["in-place", "grad-out"])
@pytest.mark.parametrize("padded", [False, True], ids=["own-columns", "padded-rows"])
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter on the junk
def test_tail_block_matches_torch_step(vocab: int, options: str, separate_grad: bool, padded: bool, monkeypatch):
    from flce_compile.kernels import ce_chunk

    walks = []
    real = ce_chunk.ce_chunk_kernel

    class Spy:  # records which walk each launch takes
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                walks.append("padded" if kwargs["PADDED"] else "unmasked" if kwargs["UNMASKED_BLOCKS"] else "masked")
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(ce_chunk, "ce_chunk_kernel", Spy())
    g = torch.Generator().manual_seed(vocab)
    rows = 5
    # Rows padded to a multiple of 8 columns, as the chunk loop lays them out (at least V rounded up to 16).
    stride = -(-vocab // 8) * 8 + 8
    width = -(-vocab // 16) * 16
    store = torch.randn(rows, stride, generator=g) * 3
    if padded:
        store = _garbage_padding(store, vocab)
    target = torch.tensor([0, vocab - 1, vocab // 2, -100, vocab - 2])
    ce_weight, p = None, LossParams()
    if options != "plain":
        ce_weight = torch.rand(vocab, generator=g) + 0.5
        p = LossParams(label_smoothing=0.1, softcap=4.0, z_loss=1e-3)
    want = _step(ce_step_torch, store, vocab, target, ce_weight, p, separate_grad)
    got = _step(ce_step_triton, store, vocab, target, ce_weight, p, separate_grad, padded)
    for name, a, b in zip(("loss", "lse", "grad"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    takes_padded = padded and width > vocab
    assert walks == ["padded" if takes_padded else "unmasked" if WALKS[vocab] else "masked"]
    assert torch.isfinite(got[2]).all()  # every column of every row written, the tail's included
    assert got[2].stride(0) == store.stride(0)
    grad_rows = got[4] if separate_grad else got[3]
    written = width if takes_padded else vocab
    if takes_padded:  # the padding up to V rounded up to 16 gets a gradient of 0
        assert torch.equal(grad_rows[:, vocab:width], torch.zeros(rows, width - vocab))
    if separate_grad:
        torch.testing.assert_close(got[3][:, vocab:], store[:, vocab:], rtol=0, atol=0, equal_nan=True)  # logits'
        assert torch.isnan(got[4][:, written:]).all()  # and the separate gradient's padding past what was written
    else:
        torch.testing.assert_close(got[3][:, written:], store[:, written:], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("vocab", [48, 53])
@pytest.mark.parametrize("options", ["plain", "weighted-smoothing-softcap", "scaled", "weighted", "z-loss"])
@pytest.mark.parametrize("padded", [False, True], ids=["own-columns", "padded-rows"])
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_ignored_rows_without_lse_output(vocab: int, options: str, padded: bool):
    """Without an lse output (the usual forward) an ignored row is skipped: its loss and gradient are 0 whatever
    its logits hold, the other rows equal the torch step's, and every row's padding up to the width gets 0."""
    g = torch.Generator().manual_seed(vocab + 1)
    rows, stride = 6, -(-vocab // 8) * 8 + 8
    width = -(-vocab // 16) * 16 if padded else vocab
    clean = torch.randn(rows, stride, generator=g) * 3
    target = torch.tensor([1, -100, vocab - 1, -100, vocab // 2, 0])
    ce_weight, p = None, LossParams()
    if options == "weighted-smoothing-softcap":
        ce_weight = torch.rand(vocab, generator=g) + 0.5
        p = LossParams(label_smoothing=0.1, softcap=4.0, z_loss=1e-3)
    elif options == "scaled":
        p = LossParams(logit_scale=-0.7)
    elif options == "weighted":  # the -inf fill of pass 1 with class weights (one of them 0)
        ce_weight = torch.rand(vocab, generator=g) + 0.5
        ce_weight[0] = 0.0
    elif options == "z-loss":
        p = LossParams(z_loss=1e-3)
    junk = clean.clone()
    junk[1] = float("nan")  # an ignored row's logits are never part of the answer
    junk[3, ::2] = float("inf")

    def step(fn, store):
        buffer = store.clone()
        logits = buffer[:, :vocab]
        weight_sum = ce_weight.sum() if ce_weight is not None else torch.tensor(float(vocab))
        scale = torch.tensor(1.0 / 4)
        loss = torch.empty(rows)
        fn(CEStepArgs(logits=logits, target=target, ce_weight=ce_weight, weight_sum=weight_sum, ce_scale=scale,
                      z_scale=scale, loss_out=loss, lse_out=None, lse_in=None, write_grad=True, padded=padded),
           p, FLCEConfig(block_v=BLOCK_V))
        return loss, buffer

    want_loss, want = step(ce_step_torch, clean)
    got_loss, got = step(ce_step_triton, junk)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[:, :vocab], want[:, :vocab], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[[1, 3], :width], torch.zeros(2, width))  # ignored rows: zeros up to the width
    assert torch.equal(got[:, vocab:width], torch.zeros(rows, width - vocab))  # every row's padding: 0
    assert got_loss[1] == 0 and got_loss[3] == 0


@pytest.mark.parametrize("softcap", [30.0, 50.0, 100.0])
def test_the_kernels_softcap_is_as_exact_as_eagers_tanh(softcap):
    """The kernel's tanh(s / softcap) went through exp(-2|u|), whose 1 - e cancels at small |u| (where nearly every
    logit sits at realistic caps): an absolute error of ~3e-8 whatever u, which made fp32 per-token losses 3-11x
    eager's error against fp64 (a bug hunt of 2026-12-06). Below |u| = 0.4 it now takes the odd series: the losses
    and gradients are within eager's error, as the torch step's are."""
    import torch.nn.functional as F

    from flce_compile import fused_linear_cross_entropy

    g = torch.Generator().manual_seed(1)
    n, v, h = 32, 200, 16
    x, w = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) / 4
    t = torch.randint(0, v, (n,), generator=g)

    def capped(xx, ww):
        s = F.linear(xx, ww)
        return F.cross_entropy(softcap * torch.tanh(s / softcap), t, reduction="none")

    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    ref = capped(x64, w64)
    ref.sum().backward()
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    eager = capped(xe, we)
    eager.sum().backward()
    xo, wo = x.clone().requires_grad_(), w.clone().requires_grad_()
    ours = fused_linear_cross_entropy(xo, wo, t, softcap=softcap, reduction="none",
                                      config={"strategy": "triton", "block_v": 64, "num_warps": 1})
    ours.sum().backward()

    def err(a, r):
        return float((a.double() - r).norm() / r.norm())

    for name, a, b, r in (("loss", ours, eager, ref), ("dX", xo.grad, xe.grad, x64.grad),
                          ("dW", wo.grad, we.grad, w64.grad)):
        assert err(a, r.detach()) <= 1.5 * err(b, r.detach()) + 1e-9, (name, err(a, r.detach()), err(b, r.detach()))
