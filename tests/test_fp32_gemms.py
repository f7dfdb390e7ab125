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


def test_running_out_of_memory_is_raised_not_taken_for_a_refusal(fresh_probe):
    def out_of_memory():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        fp32_gemms._try("addmm", out_of_memory)
    assert fresh_probe == {} and fp32_gemms.available("addmm")


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


class _FakeGemms:
    """``fp32_gemms``' two GEMMs on the CPU, by upcast operands: ``runs`` says whether they run (True: as on a
    GPU whose torch has them) or are refused (False); ``calls`` records which were asked for."""

    def __init__(self, runs: bool) -> None:
        self.runs, self.calls = runs, []

    def mm_into(self, out, a, b):
        self.calls.append("mm")
        if self.runs:
            torch.mm(a.float(), b.float(), out=out)
        return self.runs

    def addmm_into(self, acc, a, b, beta=1):
        self.calls.append("addmm")
        if self.runs:
            acc.addmm_(a.float(), b.float(), beta=beta)
        return self.runs


@pytest.mark.parametrize("runs", [True, False], ids=["run", "refused"])
def test_the_callers_take_each_gemm_once_or_fall_back_to_the_same_values(monkeypatch, runs):
    """Where the GEMMs run, each caller's result is theirs alone (nothing added twice, no part left out); where
    they are refused, the callers' CPU fallbacks (upcast operands) give the same fp32 sums of the exact
    products: fp32 logits, the dW accumulator (added to and overwritten; its "mm_add" path, a bf16 temporary,
    asks for neither GEMM), the padded tail's dX."""
    fake = _FakeGemms(runs)
    monkeypatch.setattr(fp32_gemms, "mm_into", fake.mm_into)
    monkeypatch.setattr(fp32_gemms, "addmm_into", fake.addmm_into)
    a, b, exact = _operands("cpu")
    close = dict(rtol=1e-6, atol=1e-5)
    logits = torch.full((48, 24), float("nan"))
    wide_logits.fp32_logits_into(logits, a, b.t().contiguous(), None)
    torch.testing.assert_close(logits.double(), exact, **close)
    rounded = (a @ b).double()  # mm_add's temporary: the product rounded once to bf16
    for path, want in (("addmm", exact), ("mm_add", rounded)):
        acc = torch.ones(48, 24)
        chunked.add_product(acc, a, b, path)
        torch.testing.assert_close(acc.double(), want + 1, **close)
        chunked.add_product(acc, a, b, path, overwrite=True)
        torch.testing.assert_close(acc.double(), want, **close)
    w = b.t().contiguous()  # (V = 24, H = 40): an aligned head of 16 rows, a tail of 8
    grad = a[:, :24].contiguous()
    summed = padded_tail._fp32_sum(grad, w, w[16:].contiguous(), 16)
    torch.testing.assert_close(summed.double(), grad.double() @ w.double(), **close)
    # logits; dW's addmm path twice (mm_add takes no fp32-output GEMM); the tail: both, or mm alone when refused
    assert fake.calls == ["mm", "addmm", "addmm"] + (["mm", "addmm"] if runs else ["mm"])


@pytest.mark.gpu
def test_on_the_gpu_both_run_and_sum_in_fp32(fresh_probe):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    a, b, exact = _operands("cuda")
    tol = exact.abs().max().item() * 2**-20  # fp32 sums, unrounded to bf16
    out = torch.empty(48, 24, device="cuda")
    assert fp32_gemms.mm_into(out, a, b)
    assert (out.double() - exact).abs().max().item() <= tol
    acc = torch.ones(48, 24, device="cuda")
    assert fp32_gemms.addmm_into(acc, a, b)
    assert (acc.double() - exact - 1).abs().max().item() <= tol
    out.fill_(float("nan"))
    assert fp32_gemms.addmm_into(out, a, b, beta=0)  # beta = 0 overwrites, NaN and all
    assert (out.double() - exact).abs().max().item() <= tol
    assert fresh_probe == {"mm": True, "addmm": True}


@pytest.mark.gpu
def test_on_the_gpu_the_callers_fall_back_when_refused(fresh_probe):
    """A torch that refuses both (as one before 2.8 would): the callers' CUDA fallbacks give fp32 logits and the
    padded tail's dX from upcast operands, the dW accumulator's sum through a bf16 temporary (rounded once, as
    before the probe moved here); an odd V's call no longer takes the padded tail."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    fresh_probe.update(mm=False, addmm=False)
    a, b, exact = _operands("cuda")
    tol = exact.abs().max().item() * 2**-20
    logits = torch.empty(48, 24, device="cuda")
    wide_logits.fp32_logits_into(logits, a, b.t().contiguous(), None)
    acc = torch.ones(48, 24, device="cuda")
    chunked.add_product(acc, a, b)
    w = b.t().contiguous()
    grad = a[:, :24].contiguous()
    summed = padded_tail._fp32_sum(grad, w, w[16:].contiguous(), 16)
    assert (logits.double() - exact).abs().max().item() <= tol
    assert (summed.double() - grad.double() @ w.double()).abs().max().item() <= tol
    assert (acc.double() - exact - 1).abs().max().item() <= exact.abs().max().item() * 2**-8
    assert not padded_tail.splits_padding(grad, None, True, 50257, 50304)
    fresh_probe.clear()
    assert padded_tail.splits_padding(grad, None, True, 50257, 50304)
