"""dW finished in the last chunk's GEMM (``strategies.dw_final``): the kernel against fp64, the calls it refuses,
and the chunk loop taking it (dw_path "addmm") or the rounding copy ("addmm_round") with the same dW.

On the CPU the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1); the ``gpu`` tests run it
on the GPU at a realistic shape, where an sm_90+ GPU takes it."""

from __future__ import annotations

import pytest
import torch

from flce_compile import FLCEConfig, fused_linear_cross_entropy
from flce_compile.strategies import dw_final
from flce_compile.strategies.dw_final import DwGemmTile
from flce_reference import reference_loss

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: Small tiles for the interpreter: several tiles a dimension, with partial ones.
SMALL = DwGemmTile(block_m=32, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1)


def _operands(chunk: int, vocab: int, hidden: int, width: int, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    grad = torch.zeros(chunk, width, dtype=dtype)
    grad[:, :vocab] = torch.randn(chunk, vocab, generator=g).to(dtype)
    x = torch.randn(chunk, hidden, generator=g).to(dtype)
    sums = torch.randn(width, hidden, generator=g) * 4.0
    return grad.to(DEVICE), x.to(DEVICE), sums.to(DEVICE)


def _half_ulp(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of ``dtype`` at each |exact| (below the normal range, the subnormals' fixed spacing): the
    most one correct rounding may move."""
    mantissa, smallest_normal = {torch.bfloat16: (8, 2.0**-126), torch.float16: (11, 2.0**-14)}[dtype]
    exponent = torch.floor(torch.log2(exact.abs().clamp_min(smallest_normal)))
    return 2.0 ** (exponent - mantissa)


def _one_step(a: torch.Tensor, b: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """How far two bf16 roundings of the same fp32 sums, added in different orders, may lie apart: one bf16 step at
    the larger of the two, plus the sums' fp32 noise, which where terms cancel can exceed a step of a tiny result
    (K fp32 roundings of terms up to dW's largest entry: bounded here by 2^-14 of that entry, still 64x below a
    bf16 step of it, 2^-8, so an error of the large entries fails)."""
    return 2 * _half_ulp(torch.maximum(a.abs(), b.abs()), torch.bfloat16) + exact.abs().max() * 2.0**-14


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("tile", [SMALL, DwGemmTile(block_m=32, block_n=32, block_k=16, group_m=2, subtiles=1),
                                  DwGemmTile(block_m=32, block_n=64, block_k=16, group_m=3, warp_specialize=True)],
                         ids=["halves", "whole", "group3"])
@pytest.mark.parametrize("chunk", [16, 41], ids=["k_whole", "k_tail"])
def test_kernel_rounds_the_sum_once(dtype, tile, chunk):
    """round(sums + G^T X) to within one rounding of the fp64 sum, at partial tiles in every dimension (V = 100
    of 104 padded rows, H = 72, chunk rows not a multiple of BLOCK_K), on the V rows only."""
    vocab, hidden, width = 100, 72, 104
    grad, x, sums = _operands(chunk, vocab, hidden, width, dtype)
    out = torch.full((vocab, hidden), float("nan"), dtype=dtype, device=DEVICE)
    assert dw_final.can_run(grad.t(), x, sums, out)
    dw_final.run(grad.t(), x, sums, out, tile)
    exact = sums[:vocab].double() + grad[:, :vocab].double().t() @ x.double()
    error = (out.double() - exact).abs()
    # fp32's sum of exact products errs by a few fp32 ulps of its terms' size (where they cancel, more than of
    # the result's) before the one rounding
    size = sums[:vocab].double().abs() + grad[:, :vocab].double().abs().t() @ x.double().abs()
    assert torch.all(error <= _half_ulp(exact, dtype) + size * 2.0**-21), error.max()


def test_kernel_leaves_other_rows_alone():
    """dW rows past V are the caller's: the kernel writes V rows of ``out`` and reads only V rows of the sums."""
    grad, x, sums = _operands(16, 40, 32, 48)
    sums[40:] = float("nan")  # rows it must not read
    out = torch.zeros(48, 32, dtype=torch.bfloat16, device=DEVICE)
    view = out[:40]
    dw_final.run(grad.t(), x, sums, view, SMALL)
    assert torch.isfinite(view.float()).all() and torch.equal(out[40:], torch.zeros_like(out[40:]))


def test_can_run_refuses_what_its_descriptors_cannot_take(monkeypatch):
    grad, x, sums = _operands(16, 40, 32, 48)
    out = torch.empty(40, 32, dtype=torch.bfloat16, device=DEVICE)
    assert dw_final.can_run(grad.t(), x, sums, out)
    odd = torch.zeros(16, 31, dtype=torch.bfloat16, device=DEVICE)  # 62-byte rows: not 16-byte aligned
    assert not dw_final.can_run(grad.t(), odd, sums[:, :31], out[:, :31])
    assert not dw_final.can_run(grad.t(), x[:, 1:], sums[:, 1:], out[:, 1:])  # base off 16 bytes
    assert not dw_final.can_run(grad[:, :39].t(), x, sums, out)  # fewer gradient rows than dW rows
    assert not dw_final.can_run(grad.t().float(), x.float(), sums, out.float())  # fp32 operands: cuBLAS
    assert not dw_final.can_run(grad.t(), x, sums.to(torch.bfloat16), out)  # sums must be fp32
    assert not dw_final.can_run(grad.t(), x[:0], sums, out)  # no rows
    if DEVICE == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        assert not dw_final.can_run(grad.t(), x, sums, out)  # the CPU runs it only in the interpreter


def _loss_and_grads(x, w, t, config, frozen=0, reference=False):
    """(loss, dX, dW) of the op with ``config``, or with ``reference`` of eager torch in the inputs' dtype."""
    leaves = [x.detach().requires_grad_(), w.detach().requires_grad_()]
    if reference:
        loss = reference_loss(*leaves, t, upcast=torch.float64 if x.dtype == torch.float64 else None)
    else:
        loss = fused_linear_cross_entropy(*leaves, t, config=config, frozen_weight_columns=frozen)
    return (loss, *torch.autograd.grad(loss, leaves))


def _spy(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of ``out`` each ``dw_final.run`` call got."""
    calls: list[tuple[int, ...]] = []
    real = dw_final.run

    def spy(grad_t, x, sums, out, tile=dw_final.DEFAULT_TILE):
        calls.append(tuple(out.shape))
        real(grad_t, x, sums, out, tile)

    monkeypatch.setattr(dw_final, "run", spy)
    return calls


@pytest.mark.parametrize("frozen", [0, 8], ids=["all_columns", "frozen_columns"])
def test_chunk_loop_finishes_dw_in_the_last_gemm(monkeypatch, frozen):
    """Three chunks (16, 16, 8 tokens), bf16, the Triton strategy: dw_path "addmm" finishes dW in the last chunk's
    GEMM (one call, V rows), "addmm_round" in the copy; both as exact as eager against fp64, and at most one
    rounding apart; the loss and dX identical. With the weight's first 8 columns frozen (16-byte aligned, so the
    kernel takes the rest) only the other columns go through it, and the frozen ones stay 0."""
    g = torch.Generator().manual_seed(3)
    n, hidden, vocab = 40, 32, 120
    x = torch.randn(n, hidden, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.randn(vocab, hidden, generator=g) * 3.0 / hidden**0.5).to(DEVICE, torch.bfloat16)
    t = torch.randint(0, vocab, (n,), generator=g).to(DEVICE)
    calls = _spy(monkeypatch)
    base = dict(strategy="triton", chunk_tokens=16, block_v=64, num_warps=2)
    ours = _loss_and_grads(x, w, t, FLCEConfig(**base, dw_path="addmm"), frozen)
    assert calls == [(vocab, hidden - frozen)]
    copied = _loss_and_grads(x, w, t, FLCEConfig(**base, dw_path="addmm_round"), frozen)
    assert len(calls) == 1
    eager = _loss_and_grads(x, w, t, None, reference=True)[2][:, frozen:]
    exact = _loss_and_grads(x.double(), w.double(), t, None, reference=True)[2][:, frozen:]
    assert ours[2].dtype == torch.bfloat16 and torch.all(ours[2][:, :frozen] == 0)
    trained, copy = ours[2][:, frozen:].double(), copied[2][:, frozen:].double()
    assert (trained - exact).norm() <= (eager.double() - exact).norm() * 1.02
    assert torch.equal(ours[0], copied[0]) and torch.equal(ours[1], copied[1])  # loss and dX: untouched
    # the same fp32 sums in another order, each rounded once: at most one bf16 step apart (``_one_step``)
    assert torch.all((trained - copy).abs() <= _one_step(trained, copy, exact))


@pytest.mark.parametrize("config", [dict(chunk_tokens=64), dict(chunk_tokens=16, fp32_logits=True),
                                    dict(chunk_tokens=16, strategy="torch"),
                                    pytest.param(dict(chunk_tokens=16, streams=True), marks=pytest.mark.gpu)],
                         ids=["one_chunk", "fp32_logits", "torch_strategy", "streams"])
def test_loops_that_keep_the_copy(monkeypatch, config):
    """One chunk writes dW straight; fp32 logits add their true-class correction to the sums after the last GEMM;
    a side stream would own the output: the copy rounds dW there, as before. The torch strategy takes the kernel
    on a GPU only (no Triton on the CPU but the tests' interpreter)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, 32, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.randn(120, 32, generator=g) / 32**0.5).to(DEVICE, torch.bfloat16)
    t = torch.randint(0, 120, (40,), generator=g).to(DEVICE)
    calls = _spy(monkeypatch)
    _loss_and_grads(x, w, t, FLCEConfig(**{"strategy": "triton", "block_v": 64, "num_warps": 2, **config}))
    sm90 = DEVICE == "cuda" and torch.cuda.get_device_capability() >= (9, 0)
    assert calls == ([(120, 32)] if config.get("strategy") == "torch" and sm90 else [])


@pytest.mark.gpu
def test_gpu_dw_matches_the_copy_at_a_real_shape():
    """4100 tokens in chunks of 1024 (a 4-token last chunk), H = 1024, V = 32000, bf16: dW through the last GEMM
    (where the GPU is sm_90+) is as exact as the copy's against fp64, and at most one rounding from it."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4100, 1024, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(32000, 1024, device="cuda", generator=g) * 2.0 / 32).to(torch.bfloat16)
    t = torch.randint(0, 32000, (4100,), device="cuda", generator=g)
    base = dict(strategy="triton", chunk_tokens=1024)
    ours = _loss_and_grads(x, w, t, FLCEConfig(**base, dw_path="addmm"))[2].double()
    copied = _loss_and_grads(x, w, t, FLCEConfig(**base, dw_path="addmm_round"))[2].double()
    exact = _loss_and_grads(x.double(), w.double(), t, None, reference=True)[2]
    e_ours, e_copy = (ours - exact).norm(), (copied - exact).norm()
    assert e_ours <= e_copy * 1.01, (e_ours, e_copy)
    assert torch.all((ours - copied).abs() <= _one_step(ours, copied, exact))


def test_a_kernel_that_fails_to_compile_falls_back_once(monkeypatch, caplog):
    """A first launch that fails (here: a stand-in compiler error) leaves dW to cuBLAS and the copy, with one
    warning, and the kernel is not tried again in the process; running out of memory is raised instead."""
    monkeypatch.setattr(dw_final, "_launched", {})
    tries = []

    def broken(*args, **kwargs):
        tries.append(1)
        raise RuntimeError("stand-in: PTX assembly failed")

    monkeypatch.setattr(dw_final, "run", broken)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 32, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.randn(120, 32, generator=g) / 32**0.5).to(DEVICE, torch.bfloat16)
    t = torch.randint(0, 120, (40,), generator=g).to(DEVICE)
    base = dict(strategy="triton", chunk_tokens=16, block_v=64, num_warps=2)
    with caplog.at_level("WARNING", logger="flce_compile"):
        fell_back = _loss_and_grads(x, w, t, FLCEConfig(**base))
        again = _loss_and_grads(x, w, t, FLCEConfig(**base))
    copied = _loss_and_grads(x, w, t, FLCEConfig(**base, dw_path="addmm_round"))
    assert len(tries) == 1 and sum("failed to run" in r.getMessage() for r in caplog.records) == 1
    assert torch.equal(fell_back[2], copied[2]) and torch.equal(again[2], copied[2])

    monkeypatch.setattr(dw_final, "_launched", {})

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("stand-in")

    monkeypatch.setattr(dw_final, "run", out_of_memory)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _loss_and_grads(x, w, t, FLCEConfig(**base))
