"""``frozen_weight_columns``: the weight's leading columns get no gradient, and the op does not compute one for them
(the dW GEMM reads only the other columns of the input). The compiler's LoRA fold passes it for a frozen head under
``[W, B]``; here the op itself: the same loss, dX and trainable dW columns as without the option, on every loop
(chunks, one chunk, the recompute strategy, "none", fp32 logits, fp16's fitted sums, a padded vocabulary, returned
logits with a loss on them), zeros in the frozen columns, less memory (no accumulator for them), errors that name
the option, and the fake implementation's shapes under torch.compile."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from flce_compile import FLCEConfig, FusedLinearCrossEntropyLoss, fused_linear_cross_entropy, peak_bytes
from flce_compile.params import LossParams, encode_params

from flce_reference import random_inputs

sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/ ships with the repository, not the wheel
from benchmarks._common import cpu_peak_bytes  # noqa: E402

N, H, V, K = 48, 24, 80, 16


def _grads(x0, w0, t, frozen, logits_loss=False, **kwargs):
    """(loss, dX, dW) of one call (with ``logits_loss``: plus a loss on the returned logits)."""
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    if logits_loss:
        loss, logits = fused_linear_cross_entropy(x, w, t, frozen_weight_columns=frozen, return_logits=True, **kwargs)
        total = loss + 1e-2 * logits.float().pow(2).mean()
    else:
        loss = fused_linear_cross_entropy(x, w, t, frozen_weight_columns=frozen, **kwargs)
        total = loss.sum()
    total.backward()
    return loss.detach(), x.grad, w.grad


CASES = {
    "chunks": dict(config={"chunk_tokens": 16}),
    "one_chunk": dict(config={"chunk_tokens": 1024}),
    "none": dict(reduction="none", config={"chunk_tokens": 16}),
    "sum": dict(reduction="sum", config={"chunk_tokens": 16}),
    "recompute": dict(config={"strategy": "recompute", "chunk_tokens": 16, "vocab_block": 32}),
    "recompute_none": dict(reduction="none", config={"strategy": "recompute", "chunk_tokens": 16, "vocab_block": 32}),
    "precise": dict(precision="precise", config={"chunk_tokens": 16}),
    "pad_vocab": dict(config={"chunk_tokens": 16, "pad_vocab": True}),
    "pad_vocab_one_chunk": dict(config={"chunk_tokens": 1024, "pad_vocab": True}),
    "returned_logits": dict(logits_loss=True, config={"chunk_tokens": 16}),
    "compact": dict(precision="compact", config={"chunk_tokens": 16}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_frozen_columns_change_nothing_but_their_gradient(case, dtype):
    """The loss and dX are bit for bit those without the option; dW's trainable columns match to an ulp (the same
    sums over the same tokens, by one GEMM over fewer columns) and the frozen ones are exactly zero."""
    kwargs = dict(CASES[case])
    if dtype == torch.float16 and kwargs.get("precision") == "precise":
        pytest.skip("the same path as bf16's (fp32 logits)")
    x, w, t = random_inputs(N, H, V + (1 if "pad" in case else 0), dtype)
    t[::7] = -100
    loss0, dx0, dw0 = _grads(x, w, t, 0, **kwargs)
    loss, dx, dw = _grads(x, w, t, K, **kwargs)
    assert torch.equal(loss, loss0)
    assert torch.equal(dx, dx0)
    assert dw.shape == w.shape and dw.dtype == w.dtype
    assert not dw[:, :K].any()
    # The sums' order can differ with the GEMM's width (fp32 last bits; then, rarely, the 16-bit rounding): an ulp
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(dw[:, K:].float(), dw0[:, K:].float(), rtol=eps, atol=eps * dw0.abs().max().item())


def test_every_column_frozen_and_none():
    """``frozen_weight_columns`` = H: dW is all zeros (no GEMM forms it); 0: the option's default, every column."""
    x, w, t = random_inputs(N, H, V)
    _, dx0, dw0 = _grads(x, w, t, 0)
    _, dx, dw = _grads(x, w, t, H)
    assert torch.equal(dx, dx0) and dw.shape == w.shape and not dw.any()
    loss_module = FusedLinearCrossEntropyLoss(frozen_weight_columns=K)
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss_module(xx, ww, t).backward()
    torch.testing.assert_close(ww.grad[:, K:], dw0[:, K:], rtol=2e-7, atol=2e-7 * dw0.abs().max().item())
    assert not ww.grad[:, :K].any()


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (H + 1, ValueError), (True, TypeError), (2.0, TypeError),
                                        ("16", TypeError)])
def test_a_bad_frozen_weight_columns_is_named(bad, error):
    x, w, t = random_inputs(N, H, V)
    with pytest.raises(error, match="frozen_weight_columns"):
        fused_linear_cross_entropy(x, w.requires_grad_(), t, frozen_weight_columns=bad)
    if bad != H + 1:  # (the module cannot know H before its first call)
        with pytest.raises(error, match="frozen_weight_columns"):
            FusedLinearCrossEntropyLoss(frozen_weight_columns=bad)


def test_the_op_called_directly_refuses_more_columns_than_the_weight_has():
    """The registered op checks the option too (the API checks it first): an error naming it, not a failed
    allocation."""
    x, w, t = random_inputs(N, H, V)
    params = encode_params(LossParams(frozen_weight_columns=H + 1))
    with pytest.raises(ValueError, match="frozen_weight_columns"):
        torch.ops.flce.fused_linear_cross_entropy(x, w, t, None, None, params, torch.float32, True, True, False, "")


def test_frozen_columns_under_torch_compile():
    """Through the registered op in a compiled graph (the fake implementation's narrower dW, the padding in the
    autograd formula traced): the eager call's gradients."""
    x, w, t = random_inputs(N, H, V)
    ref = _grads(x, w, t, K, config={"chunk_tokens": 16})
    torch._dynamo.reset()
    compiled = torch.compile(_grads, backend="aot_eager", fullgraph=False)
    got = compiled(x, w, t, K, config={"chunk_tokens": 16})
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert not got[2][:, :K].any()


def test_frozen_columns_hold_no_accumulator_for_them():
    """The fp32 dW accumulator over chunks covers the trainable columns only: the measured peak falls by the frozen
    columns' share, and stays within the bound, which counts dW's columns (``peak_bytes(frozen_columns=...)``)."""
    n, h, v, frozen = 1024, 256, 4096, 240
    x, w, t = random_inputs(n, h, v, torch.bfloat16)
    x.requires_grad_(), w.requires_grad_()
    config = FLCEConfig(strategy="torch", chunk_tokens=256)
    peaks = {}
    for columns in (0, frozen):
        def step():
            fused_linear_cross_entropy(x, w, t, config=config, frozen_weight_columns=columns).backward()

        step()  # warm-up: one-time allocations stay out of the measurement
        x.grad = w.grad = None
        peaks[columns] = cpu_peak_bytes(step)
        x.grad = w.grad = None
        # Above the returned gradients: dX, and dW as the op returns it (its trainable columns), which backward
        # then pads into the weight's shape (eager; in a compiled graph the consumer's slice reads it unpadded).
        returned = (n * h + v * (h - columns) + (v * h if columns else 0)) * 2
        bound = peak_bytes(config, n, v, h, torch.bfloat16, need_dw=True, frozen_columns=columns)
        assert peaks[columns] - returned <= bound, (columns, peaks[columns] - returned, bound)
    accumulator = v * frozen * 4  # the fp32 sums of the frozen columns, no longer formed
    assert peaks[frozen] <= peaks[0] - 0.9 * accumulator, peaks  # (measured: 11.3 MB, frozen 7.1 MB)
    assert peak_bytes(config, n, v, h, torch.bfloat16, frozen_columns=frozen) < peak_bytes(config, n, v, h,
                                                                                           torch.bfloat16)
