"""An odd vocabulary's GEMMs through the weight's aligned head and a zero-padded copy of its last rows
(``strategies.padded_tail``) instead of a zero-padded copy of the whole weight: the tail's GEMMs against those over
the padded weight, the chunk loop's results against fp64 (no worse than eager) with the whole-weight copy never
made, and on a GPU, where it is the default for one bf16/fp16 chunk, the same at GPT-2's V with the memory it
saves."""

from __future__ import annotations

import pytest
import torch

from flce_compile import fused_linear_cross_entropy
from flce_compile.plan.layout import aligned_head_rows, padded_row_elements
from flce_compile.strategies import chunked
from flce_compile.strategies import padded_tail as tail_module
from flce_reference import reference_loss
from test_op_numerics import check_case


def _weights(v: int, h: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(v, h, generator=g) * 3.0 / h**0.5).to(device=device, dtype=dtype)
    vp = padded_row_elements(v, dtype.itemsize)
    wp = torch.zeros(vp, h, dtype=dtype, device=device)
    wp[:v] = w
    return w, wp


@pytest.mark.parametrize("v", [123, 50, 200])
def test_the_tail_gemms_give_the_padded_weights_products(v):
    """logits_into: the padded weight's logits, 0 in the padding columns; dx_into: grad @ W over the padded
    columns summed once (fp32) and rounded once, as close to fp64 as the one GEMM over the padded weight. V = 50
    in bf16 has no aligned head (all of it tail); 123 and 200 have one."""
    n, h, dtype = 24, 40, torch.bfloat16
    w, wp = _weights(v, h, dtype)
    split = tail_module.padded_tail(w, wp.shape[0])
    assert split.head == aligned_head_rows(v, 2) and split.tail.shape == (wp.shape[0] - split.head, h)
    x = torch.randn(n, h, generator=torch.Generator().manual_seed(1)).to(dtype)
    logits = torch.full((n, wp.shape[0]), float("nan"), dtype=dtype)
    split.logits_into(logits, x)
    torch.testing.assert_close(logits, x @ wp.t(), rtol=2**-7, atol=1e-6)
    assert torch.equal(logits[:, v:], torch.zeros_like(logits[:, v:]))
    grad = (torch.randn(n, wp.shape[0], generator=torch.Generator().manual_seed(2)) * 1e-2).to(dtype)
    grad[:, v:] = 0
    dx = torch.empty(n, h, dtype=dtype)
    split.dx_into(dx, grad)
    exact = grad.double() @ wp.double()
    assert (dx.double() - exact).norm() <= (torch.mm(grad, wp).double() - exact).norm() * 1.05 + 1e-12
    assert (dx.double() - exact).abs().max() <= exact.abs().max() * 2**-8  # one rounding, not two


class _AsOnAGpu:
    """``x`` as ``splits_padding`` sees it, but on a GPU: the rest of its rule applies on the CPU."""

    def __init__(self, x: torch.Tensor) -> None:
        self.device, self.dtype, self.shape, self.element_size = torch.device("cuda"), x.dtype, x.shape, x.element_size


@pytest.fixture
def tail_on_the_cpu(monkeypatch):
    """The chunk loop takes the tail split on the CPU too (it is a GPU default), and records which padding ran."""
    taken = {"tail": 0, "whole_copy": 0}
    real_tail, real_copy = chunked.padded_tail, chunked.zero_padded_rows

    def counted_tail(weight, padded):
        taken["tail"] += 1
        return real_tail(weight, padded)

    def counted_copy(t, rows):
        taken["whole_copy"] += 1
        return real_copy(t, rows)

    real_rule = chunked.splits_padding
    monkeypatch.setattr(chunked, "splits_padding", lambda x, *args: real_rule(_AsOnAGpu(x), *args))
    monkeypatch.setattr(chunked, "padded_tail", counted_tail)
    monkeypatch.setattr(chunked, "zero_padded_rows", counted_copy)
    return taken


@pytest.mark.parametrize("option", ["plain", "label_smoothing", "ce_weight", "z_loss"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("strategy", ["torch", "triton"])
def test_the_chunk_loop_through_the_tail_is_as_exact_as_eager(tail_on_the_cpu, strategy, reduction, option):
    """One padded bf16 chunk (V = 123 -> 128) through the tail split: loss, dX and dW no further from fp64 than
    eager's, and no copy of the whole weight made."""
    check_case("odd_chunks", torch.bfloat16, reduction, option, strategy, pad_vocab=True, chunk=64)
    assert tail_on_the_cpu["tail"] >= 1 and tail_on_the_cpu["whole_copy"] == 0


@pytest.mark.parametrize("case", ["bias", "chunks", "fp32", "fp16_mean", "precise", "no_head", "many_rows"])
def test_the_whole_weight_is_padded_where_the_tail_does_not_apply(tail_on_the_cpu, monkeypatch, case):
    """A bias, several chunks (dW accumulates over them), fp32 operands, an fp16 "mean" (its dW sums are fitted
    into fp16's range in fp32 first), fp32 logits, a V with no aligned head (50 bf16 rows: all tail) or more rows
    than the weight copy would hold of dX's fp32 sum (200 x 31 x 4 bytes against 128 x 31 x 2) keep the padded
    weight copy, and are as exact as eager."""
    import test_op_numerics

    monkeypatch.setitem(test_op_numerics.SHAPES, "many_rows", ((200,), 31, 123, 256))
    dtype = {"fp32": torch.float32, "fp16_mean": torch.float16}.get(case, torch.bfloat16)
    shape = {"no_head": "noncontig", "many_rows": "many_rows"}.get(case, "odd_chunks")
    check_case(shape, dtype, "mean", "bias" if case == "bias" else "plain", "torch", pad_vocab=True,
               precision="precise" if case == "precise" else "exact",
               chunk={"chunks": 16, "many_rows": 256}.get(case, 64))
    assert tail_on_the_cpu["tail"] == 0 and tail_on_the_cpu["whole_copy"] == (2 if case == "bias" else 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, reduction", [(torch.bfloat16, "mean"), (torch.float16, "none")],
                         ids=["bf16_mean", "fp16_none"])
def test_gpt2_vocab_on_the_gpu_by_default(monkeypatch, dtype, reduction):
    """GPT-2's V = 50257 with the default config (pad_vocab, one chunk): the tail split runs; loss, dX and dW are
    no further from fp64 than eager's (plus a tenth of it) and the values of the whole-weight copy's path; the
    call's peak (CUDA graphs off: the op's own allocations) is at least 0.9 of the whole-weight copy below that
    path's; and replayed from a CUDA graph (the default) it gives the same results."""
    from flce_compile import graph_replay
    from flce_compile import eager_shortcut

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n, h, v = 1024, 256, 50257
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).to("cuda", dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) * 3.0 / h**0.5).to("cuda", dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g).cuda()
    t[::17] = -100
    taken = []
    real_tail = chunked.padded_tail
    monkeypatch.setattr(chunked, "padded_tail", lambda weight, padded: taken.append(1) or real_tail(weight, padded))

    def grads_and_peak(calls: int = 2) -> tuple[list[torch.Tensor], int]:
        graph_replay.clear()
        eager_shortcut.clear()
        torch.cuda.empty_cache()
        for _ in range(calls - 1):  # (compiles and warms up; with graphs on, captures)
            x.grad = w.grad = None
            fused_linear_cross_entropy(x, w, t, reduction=reduction).sum().backward()
        x.grad = w.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = fused_linear_cross_entropy(x, w, t, reduction=reduction).sum()
        loss.backward()
        torch.cuda.synchronize()
        return [loss.detach(), x.grad, w.grad], torch.cuda.max_memory_allocated() - base

    graph_replay.set_cuda_graphs("off")
    try:
        ours, peak = grads_and_peak()
        assert taken, "the tail split did not run"
        with monkeypatch.context() as patch:
            patch.setattr(chunked, "splits_padding", lambda *args: False)
            copied, copy_peak = grads_and_peak()
    finally:
        graph_replay.set_cuda_graphs("auto")
    replayed, _peak = grads_and_peak(calls=4)
    graph_replay.clear()
    eager_shortcut.clear()
    assert copy_peak - peak >= 0.9 * padded_row_elements(v, dtype.itemsize) * h * dtype.itemsize, (copy_peak, peak)
    leaves = [x.detach().double().requires_grad_(), w.detach().double().requires_grad_()]
    ref = reference_loss(*leaves, t, reduction=reduction).sum()
    ref_grads = torch.autograd.grad(ref, leaves)
    eager_leaves = [x.detach().requires_grad_(), w.detach().requires_grad_()]
    eager = reference_loss(*eager_leaves, t, reduction=reduction).sum()
    eager_grads = torch.autograd.grad(eager, eager_leaves)
    assert abs(ours[0].double() - ref) <= abs(eager.double() - ref) + 1e-5 * abs(ref)
    for name, a, c, r_, e, r in zip(("dx", "dw"), ours[1:], copied[1:], replayed[1:], eager_grads, ref_grads):
        err, eager_err = (a.double() - r).norm(), (e.double() - r).norm()
        assert err <= eager_err + 0.1 * eager_err, (name, float(err), float(eager_err))
        assert (a.double() - c.double()).norm() <= 0.1 * eager_err  # the copy's values, to rounding
        assert (a.double() - r_.double()).norm() <= 0.01 * eager_err  # replayed: the same
