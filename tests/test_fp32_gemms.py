"""bf16/fp16 GEMMs with fp32 output (``strategies.fp32_gemms``): refused once, never tried again and warned about
once; never run on the CPU; where refused, the callers' fallbacks give the same values; on a GPU, the fp32 sums
of the exact products."""

from __future__ import annotations

import logging

import pytest
import torch

from flce_compile.strategies import chunked, fp32_gemms, padded_tail, wide_logits


@pytest.fixture
def fresh_probe(monkeypatch):
    """An untried probe, restored after the test (other tests must not inherit a refusal)."""
    monkeypatch.setattr(fp32_gemms, "_supported", {})
    return fp32_gemms._supported


def test_a_refused_overload_is_not_tried_again_and_warned_about_once(fresh_probe, caplog):
    caplog.set_level(logging.WARNING, logger="flce_compile")
    calls = []

    def refused():
        calls.append(1)
        raise TypeError("mm() got an unexpected keyword argument 'out_dtype'")

    assert fp32_gemms.available("mm") and fp32_gemms.available("addmm")
    assert not fp32_gemms._try("mm", refused)
    assert not fp32_gemms._try("mm", refused)
    assert calls == [1] and not fp32_gemms.available("mm")
    assert fp32_gemms.available("addmm")  # each overload is probed for itself
    assert fp32_gemms._try("addmm", lambda: None) and fresh_probe == {"mm": False, "addmm": True}
    assert caplog.text.count("fp32-output mm unavailable") == 1 and "out_dtype" in caplog.text


def test_nothing_runs_on_the_cpu(fresh_probe):
    a, b = torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(8, 3, dtype=torch.bfloat16)
    out = torch.full((4, 3), 7.0)
    assert not fp32_gemms.mm_into(out, a, b) and not fp32_gemms.addmm_into(out, a, b)
    assert torch.equal(out, torch.full((4, 3), 7.0)) and fresh_probe == {}


def _operands(device: str):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(48, 40, generator=g).to(device, torch.bfloat16)
    b = torch.randn(40, 24, generator=g).to(device, torch.bfloat16)
    return a, b, a.double() @ b.double()


def test_the_callers_fall_back_to_the_same_values_when_refused(fresh_probe):
    """With both overloads refused: fp32 logits from upcast operands, the dW accumulator through a temporary, the
    padded tail's dX from upcast operands; each the fp32 sum of the exact products."""
    fresh_probe.update(mm=False, addmm=False)
    a, b, exact = _operands("cpu")
    logits = torch.empty(48, 24)
    wide_logits.fp32_logits_into(logits, a, b.t().contiguous(), None)
    torch.testing.assert_close(logits.double(), exact, rtol=1e-6, atol=1e-5)
    acc = torch.ones(48, 24)
    chunked.add_product(acc, a, b)
    torch.testing.assert_close(acc.double(), exact + 1, rtol=1e-6, atol=1e-5)
    w = b.t().contiguous()  # (V = 24, H = 40): an aligned head of 16 rows, a tail of 8
    summed = padded_tail._fp32_sum(a[:, :24].contiguous(), w, w[16:].contiguous(), 16)
    torch.testing.assert_close(summed.double(), a[:, :24].double() @ w.double(), rtol=1e-6, atol=1e-5)


@pytest.mark.gpu
def test_on_the_gpu_both_run_and_sum_in_fp32(fresh_probe):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    a, b, exact = _operands("cuda")
    out = torch.empty(48, 24, device="cuda")
    assert fp32_gemms.mm_into(out, a, b)
    acc = torch.ones(48, 24, device="cuda")
    assert fp32_gemms.addmm_into(acc, a, b)
    assert fp32_gemms.addmm_into(out, a, b, beta=0)  # beta = 0 overwrites
    tol = exact.abs().max().item() * 2**-20
    for got, want in ((out, exact), (acc, exact + 1)):
        assert (got.double() - want).abs().max().item() <= tol  # unrounded to bf16: fp32 sums
    assert fresh_probe == {"mm": True, "addmm": True}
