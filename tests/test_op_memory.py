"""The sympy memory bound against measured peaks (CPU: allocation events of the profiler; GPU: the CUDA
allocator's peak), and that the bound stays far below materialised logits."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import sympy
import torch

from flce_compile import FLCEConfig, fused_linear_cross_entropy, peak_bytes, peak_bytes_expr
from flce_compile.params import LossParams
from flce_compile.plan import registry
from flce_compile.plan.layout import padded_row_elements
from flce_compile.plan.memory import SLACK_BYTES, TORCH_STEP_CLASS_BYTES, TORCH_STEP_ROW_BYTES
from flce_compile.strategies.ce_common import CEStepArgs
from flce_compile.strategies.ce_torch import ce_step_torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/ ships with the repository, not the wheel
from benchmarks._common import cpu_peak_bytes  # noqa: E402  (the profiler's allocation records, replayed)


def test_expression_names_its_symbols():
    names = {s.name for s in peak_bytes_expr().free_symbols}
    assert {"BT", "V", "H", "chunk", "s", "acc"} <= names
    assert "H_dw" not in names  # dW's own columns (frozen_weight_columns) stay inside peak_bytes
    assert isinstance(peak_bytes_expr(), sympy.Expr)


@pytest.mark.parametrize("dtype, accum, softcap, v, pad, precision, chunk", [
    (torch.float32, torch.float32, None, 4096, False, "exact", 64),
    (torch.bfloat16, torch.float32, None, 4096, False, "exact", 64),
    (torch.bfloat16, torch.bfloat16, 5.0, 4096, False, "exact", 64),
    (torch.bfloat16, torch.float32, None, 4097, False, "exact", 64),  # odd V: padded chunk rows
    (torch.bfloat16, torch.float32, None, 8193, True, "exact", 64),  # and a zero-padded weight copy
    (torch.bfloat16, torch.bfloat16, None, 8193, True, "exact", 64),
    (torch.bfloat16, torch.float32, None, 4096, False, "precise", 64),  # an fp32 chunk of logits besides
    (torch.bfloat16, torch.float32, 5.0, 8193, True, "precise", 64),
    (torch.bfloat16, torch.float32, None, 4096, False, "exact", 1024),  # one chunk: dW in bf16, no fp32 sums
    (torch.bfloat16, torch.float32, None, 8193, True, "exact", 2048),
    # fp16 keeps fp32 dW sums whatever the chunking and accum_dtype, to fit them into fp16's range (dividing
    # them in one pass into an fp16 tensor made the CPU write an fp32 temporary as large: 3.7 MB over the bound)
    (torch.float16, torch.float32, None, 4096, False, "exact", 64),
    (torch.float16, torch.float16, None, 4096, False, "exact", 64),
    (torch.float16, torch.float32, None, 4096, False, "exact", 1024),
])
def test_cpu_peak_within_bound(dtype, accum, softcap, v, pad, precision, chunk):
    n = 1024
    # with pad, the weight copy (2.1 MB) outweighs the bound's 1 MB of slack; fp16's V x H fp32 sums must too
    h = 128 if pad else 256 if dtype == torch.float16 else 64
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) / 8).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    config = FLCEConfig(strategy="torch", chunk_tokens=chunk, pad_vocab=pad, fp32_logits=precision == "precise")

    def step():
        loss = fused_linear_cross_entropy(x, w, t, softcap=softcap, accum_dtype=accum, config=config,
                                          precision=precision)
        loss.backward()

    step()  # warm-up: one-time allocations (autograd, profiler) stay out of the measurement
    x.grad = w.grad = None
    measured = cpu_peak_bytes(step)
    itemsize = torch.empty((), dtype=dtype).element_size()
    grads = (n * h + v * h) * itemsize  # the returned gradients are outputs, not overhead
    bound = peak_bytes(config, n, v, h, dtype, accum, need_dw=True, softcap=softcap is not None)
    assert measured - grads <= bound, f"measured {measured - grads} B above outputs > bound {bound} B"
    # The bound must also mean something: the logits a plain implementation holds are several times larger
    # (twice, with fp32 logits beside the gradient chunk and the torch step's fp32 copies of 1/16 of them).
    if chunk < n:
        full_logits = n * v * (itemsize + 4)
        assert bound < full_logits / (3 if precision == "exact" else 2)


def test_one_chunk_keeps_no_fp32_dw_sums():
    """A call that fits in one chunk writes dW straight in the weight dtype (the GEMM sums in fp32 inside), so an
    fp32 accumulator request costs it nothing: the same peak as bf16 accumulation, and the same dW bits."""
    n, h, v = 256, 64, 4096
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(v, h, generator=g) / 8).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    config = FLCEConfig(strategy="torch", chunk_tokens=n)
    peaks, grads = {}, {}
    for accum in (torch.float32, torch.bfloat16):
        def step():
            fused_linear_cross_entropy(x, w, t, accum_dtype=accum, config=config).backward()

        step()
        x.grad = w.grad = None
        peaks[accum] = cpu_peak_bytes(step)
        grads[accum] = w.grad
        x.grad = w.grad = None
    assert peaks[torch.float32] == peaks[torch.bfloat16]
    assert torch.equal(grads[torch.float32], grads[torch.bfloat16])
    assert peak_bytes(config, n, v, h, torch.bfloat16, torch.float32) == peak_bytes(config, n, v, h, torch.bfloat16,
                                                                                   torch.bfloat16)


def test_one_chunk_over_a_padded_vocabulary_holds_no_padded_dw():
    """pad_vocab in one chunk writes dW's V rows straight (``chunked._DwAccumulator``): the padding costs the peak
    the zero-padded weight copy and the wider chunk, not also a padded dW beside the dW copied out of it; dW is
    the same either way. (Few tokens and a wide H, so that the end of the call, where the old code held both, is
    the peak.)"""
    n, h, v = 16, 512, 8193
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(v, h, generator=g) / 8).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    peaks, grads = {}, {}
    for pad in (False, True):
        config = FLCEConfig(strategy="torch", chunk_tokens=n, pad_vocab=pad)

        def step():
            fused_linear_cross_entropy(x, w, t, config=config).backward()

        step()
        x.grad = w.grad = None
        peaks[pad] = cpu_peak_bytes(step)
        grads[pad] = w.grad
        x.grad = w.grad = None
    vp = padded_row_elements(v, 2)
    weight_copy, wider_chunk = vp * h * 2, n * (vp - v) * (2 + 4)  # (the chunk and the CE step's fp32 rows)
    assert peaks[True] - peaks[False] <= weight_copy + wider_chunk + 64 * 1024
    assert torch.equal(grads[True], grads[False])


@pytest.mark.parametrize("in_place, softcap, dtype", [
    (True, 0.0, torch.float32), (False, 0.0, torch.float32), (True, 30.0, torch.float32),
    (False, 0.0, torch.bfloat16),
])
def test_torch_ce_step_holds_at_most_one_fp32_chunk(in_place, softcap, dtype):
    """The PyTorch CE step (the CPU's) works in the fp32 chunk it overwrites with the gradient, or in the fp32
    gradient buffer it writes instead (kept logits): no chunk-sized temporary (no copy, no logsumexp's exp
    buffer); on bf16 logits one fp32 copy; with a softcap one more, tanh(z) for the derivative. Its loss and
    gradient are F.cross_entropy's."""
    rows, vocab = 128, 4096
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    target = torch.randint(0, vocab, (rows,), generator=g)
    chunk = logits.clone()
    grad = None if in_place else torch.empty_like(chunk)
    loss = torch.empty(rows)
    args = CEStepArgs(logits=chunk, target=target, ce_weight=None, weight_sum=torch.tensor(float(vocab)),
                      ce_scale=torch.tensor(1.0 / rows), z_scale=torch.tensor(0.0), loss_out=loss, lse_out=None,
                      lse_in=None, write_grad=True, grad_out=grad)
    measured = cpu_peak_bytes(lambda: ce_step_torch(args, LossParams(softcap=softcap)))
    chunk_bytes = rows * vocab * 4
    temporaries = (0 if dtype == torch.float32 else 1) + (1 if softcap else 0)
    assert measured <= temporaries * chunk_bytes + chunk_bytes // 8, f"{measured} B, {temporaries} chunk(s) allowed"
    if not in_place:
        assert torch.equal(chunk, logits)  # kept logits stay intact
    ref = logits.double().requires_grad_()
    z = softcap * torch.tanh(ref / softcap) if softcap else ref
    want = torch.nn.functional.cross_entropy(z, target, reduction="none")
    want.mean().backward()
    torch.testing.assert_close(loss.double(), want.detach() / rows, rtol=1e-6, atol=1e-9)
    # bf16: the gradient is rounded once to bf16
    tol = {"rtol": 1e-5, "atol": 1e-9} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-5}
    torch.testing.assert_close((chunk if in_place else grad).double(), ref.grad, **tol)


@pytest.mark.parametrize("grad", [False, True])
def test_the_cpu_loop_holds_one_fp32_chunk_with_or_without_gradients(grad):
    """An fp32 loss on the CPU (an eval loop under no_grad, a training step): the loop's chunk buffer is the
    only chunk-sized allocation. Under no_grad the torch CE step copied the chunk, which is the loop's own
    scratch (two chunks: 128 MiB against 64 at 8192 x 64 x 8192 with 2048-token chunks); and the loss is the
    same."""
    n, h, v, chunk = 512, 16, 2048, 128
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).requires_grad_(grad)
    w = (torch.randn(v, h, generator=g) * 0.1).requires_grad_(grad)
    t = torch.randint(0, v, (n,), generator=g)
    config = {"chunk_tokens": chunk, "strategy": "torch"}

    def step():
        with torch.set_grad_enabled(grad):
            loss = fused_linear_cross_entropy(x, w, t, config=config)
            if grad:
                loss.backward()
        return loss

    step()  # first call: config choice and caches
    x.grad = w.grad = None
    measured = cpu_peak_bytes(step)
    chunk_bytes = chunk * v * 4
    assert measured < 2 * chunk_bytes, f"{measured} B: more than one {chunk_bytes} B chunk"
    torch.testing.assert_close(step().detach(), torch.nn.functional.cross_entropy(x.detach() @ w.detach().T, t),
                               rtol=1e-6, atol=1e-6)


def test_torch_ce_step_rows_with_infinite_logits():
    """Rows holding -inf or nan logits give what torch.logsumexp and exp(z - lse) give; a row holding +inf has no
    softmax: lse and the whole gradient row nan, as eager's log_softmax gives it (not logsumexp's +inf)."""
    inf = float("inf")
    logits = torch.tensor([[inf, 100.0, 0.0], [-inf, -inf, -inf], [float("nan"), 1.0, 2.0], [-inf, 3.0, 1.0]])
    target = torch.tensor([2, 0, 1, 2])
    lse = torch.empty(4)
    args = CEStepArgs(logits=logits.clone(), target=target, ce_weight=None, weight_sum=torch.tensor(3.0),
                      ce_scale=torch.tensor(1.0), z_scale=torch.tensor(0.0), loss_out=torch.empty(4),
                      lse_out=lse, lse_in=None, write_grad=True)
    ce_step_torch(args, LossParams())
    want_lse = torch.logsumexp(logits, dim=1)
    want_lse[0] = float("nan")
    want = (logits - want_lse[:, None]).exp()
    want[torch.arange(4), target] -= 1.0
    torch.testing.assert_close(lse, want_lse, equal_nan=True)
    torch.testing.assert_close(args.logits, want, equal_nan=True)
    assert args.logits[0].isnan().all() and args.loss_out[0].isnan()
    assert torch.nn.functional.log_softmax(logits, dim=1)[0].isnan().all()  # eager's, which the row follows


@pytest.mark.parametrize("vocab, itemsize, padded", [
    (128256, 2, 128256), (50257, 2, 50304), (50257, 4, 50272), (1, 2, 64), (64, 2, 64),
])
def test_logits_rows_padded_to_128_bytes(vocab, itemsize, padded):
    assert padded_row_elements(vocab, itemsize) == padded


def test_bound_counts_the_row_padding():
    config = FLCEConfig(strategy="triton", chunk_tokens=256)
    odd = peak_bytes(config, 4096, 50257, 768, torch.bfloat16, need_dw=False)
    aligned = peak_bytes(config, 4096, 50304, 768, torch.bfloat16, need_dw=False)
    assert odd == aligned


def test_bound_at_the_benchmark_shape():
    config = FLCEConfig(strategy="triton", chunk_tokens=1024)
    fp32 = peak_bytes(config, 16384, 128256, 4096, torch.bfloat16, torch.float32)
    bf16 = peak_bytes(config, 16384, 128256, 4096, torch.bfloat16, torch.bfloat16)
    assert fp32 < 2.5e9 and bf16 < 0.3e9
    assert fp32 - bf16 == 128256 * 4096 * 4  # the fp32 dW accumulator


def test_bound_counts_the_fp32_logits():
    """precision="precise" (FLCEConfig.fp32_logits): one fp32 chunk of logits beside the bf16 gradient chunk,
    the fp32 bias, the CPU's upcast operands and the true-class correction's per-row terms; nothing for fp32
    inputs, whose logits already are fp32. The recompute strategy grows by at least its backward's fp32 block
    of logits (its forward, less the gradients not yet allocated, is the larger half only with fp32 logits)."""
    n, v, h, chunk = 16384, 128256, 4096, 2048
    for strategy in ("triton", "recompute"):
        exact = FLCEConfig(strategy=strategy, chunk_tokens=chunk, vocab_block=4096)
        precise = FLCEConfig(strategy=strategy, chunk_tokens=chunk, vocab_block=4096, fp32_logits=True)
        grown = peak_bytes(precise, n, v, h, torch.bfloat16) - peak_bytes(exact, n, v, h, torch.bfloat16)
        per_row = 6 * h + 8 + 32
        if strategy == "triton":
            assert grown == (chunk * padded_row_elements(v, 2) * 4 + 4 * v + 4 * h * (chunk + 1024)
                             + chunk * per_row)
        else:
            assert grown >= chunk * padded_row_elements(4096, 2) * 4
        assert peak_bytes(precise, n, v, h, torch.float32) == peak_bytes(exact, n, v, h, torch.float32)
    assert "fp32_logits" in {s.name for s in peak_bytes_expr().free_symbols}


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["exact", "precise"])
def test_gpu_peak_within_bound_by_precision(precision):
    n, h, v = 8192, 2048, 65536
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(v, h, device="cuda") / h**0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")
    config = {"strategy": "triton", "chunk_tokens": 1024}
    fused_linear_cross_entropy(x, w, t, config=config, precision=precision).backward()
    x.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fused_linear_cross_entropy(x, w, t, config=config, precision=precision).backward()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base - (n * h + v * h) * 2
    bound = peak_bytes(FLCEConfig(strategy="triton", chunk_tokens=1024, fp32_logits=precision == "precise"),
                       n, v, h, torch.bfloat16)
    assert measured <= bound, (measured, bound)


@pytest.mark.gpu
@pytest.mark.parametrize("accum, streams, v", [
    (torch.float32, False, 65536), (torch.bfloat16, False, 65536), (torch.float32, True, 65536),
    (torch.bfloat16, False, 50257),
])
def test_gpu_peak_within_bound(accum, streams, v):
    n, h = 8192, 2048
    dev = "cuda"
    x = torch.randn(n, h, device=dev, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(v, h, device=dev) / h**0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), device=dev)
    config = FLCEConfig(strategy="triton", chunk_tokens=1024, streams=streams)
    fused_linear_cross_entropy(x, w, t, accum_dtype=accum, config=config).backward()
    x.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fused_linear_cross_entropy(x, w, t, accum_dtype=accum, config=config).backward()
    torch.cuda.synchronize()
    grads = (n * h + v * h) * 2
    measured = torch.cuda.max_memory_allocated() - base - grads
    bound = peak_bytes(config, n, v, h, torch.bfloat16, accum)
    assert measured <= bound, (measured, bound)


@pytest.mark.parametrize("dtype, reduction, strategy, softcap", [
    (torch.float32, "none", "torch", None),
    (torch.bfloat16, "none", "torch", None),
    (torch.bfloat16, "mean", "recompute", None),
    (torch.bfloat16, "mean", "recompute", 30.0),
    (torch.float32, "none", "recompute", None),
])
def test_cpu_peak_within_bound_per_token_and_recompute(dtype, reduction, strategy, softcap):
    """What a kept lse feeds on the CPU stays within the CPU's bound: "none"'s backward and the recompute
    strategy form p = exp(z - lse) from an fp64 lse (an fp64 temporary twice the chunk's fp32 size, until
    2026-12-05: 4.8 chunks at 4096 x 64 x 32000 against a bound of 2.9), and the recompute strategy's torch step
    holds the torch step's fp32 copies of a chunk (a bf16 chunk, a softcap's tanh), which its bound now counts
    off the GPU (it left them out: 98 MiB against 21)."""
    n, h, v = 1024, 64, 8000
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) / 8).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    config = FLCEConfig(strategy=strategy, chunk_tokens=256, vocab_block=2048)

    def step():
        loss = fused_linear_cross_entropy(x, w, t, reduction=reduction, softcap=softcap, config=config)
        loss.backward(torch.ones_like(loss))

    step()
    x.grad = w.grad = None
    measured = cpu_peak_bytes(step) - (n * h + v * h) * x.element_size()
    bound = peak_bytes(config, n, v, h, dtype, softcap=softcap is not None, device="cpu")
    assert measured <= bound, f"measured {measured} B above outputs > bound {bound} B"


def test_the_recompute_bound_counts_the_cpu_step():
    """The recompute strategy's CE step is the Triton kernel on a GPU (no chunk-sized fp32 buffers) and torch ops
    elsewhere (2, with a softcap 3, in forward a whole row's chunk): its bound on the CPU holds them; fp64 runs
    the torch step everywhere."""
    config = FLCEConfig(strategy="recompute", chunk_tokens=512, vocab_block=8192)
    args = (config, 4096, 32000, 256, torch.bfloat16)
    fp32_chunk = 512 * 32000 * 4
    assert peak_bytes(*args) < 2 * fp32_chunk < peak_bytes(*args, device="cpu")
    assert peak_bytes(*args, softcap=True, device="cpu") - peak_bytes(*args, device="cpu") == fp32_chunk
    fp64 = (config, 4096, 32000, 256, torch.float64)
    assert peak_bytes(*fp64, device="cpu") == peak_bytes(*fp64, device=torch.device("cuda"))


def test_the_fp32_cpu_bound_counts_no_spare_fp32_chunk():
    """fp32 inputs off CUDA: the torch step works in the loop's fp32 chunk of logits (``ce_torch._work_buffer``), so
    the bound counts no chunk-sized temporaries besides it (one with a softcap: softcap * tanh(z)), and instead the
    step's own vectors, ``TORCH_STEP_ROW_BYTES`` a chunk row and ``TORCH_STEP_CLASS_BYTES`` a class. It counted two
    (three): 3.0-3.5x the measured peak of the "torch" strategy, up to 7.9x the recompute one's. On CUDA, and for
    bf16, the counts stay."""
    n, v, h, chunk = 4096, 32000, 256, 512
    fp32_chunk, row_vectors = chunk * v * 4, chunk * TORCH_STEP_ROW_BYTES + v * TORCH_STEP_CLASS_BYTES
    for softcap in (False, True):
        torch_step = FLCEConfig(strategy="torch", chunk_tokens=chunk)
        cuda = peak_bytes(torch_step, n, v, h, torch.float32, softcap=softcap)
        assert cuda - peak_bytes(torch_step, n, v, h, torch.float32, softcap=softcap, device="cpu") == (
            2 * fp32_chunk - row_vectors)
        # the recompute strategy's backward block as wide as V: its CE step on the GPU is the kernel (no chunk)
        recompute = FLCEConfig(strategy="recompute", chunk_tokens=chunk, vocab_block=v)
        cuda = peak_bytes(recompute, n, v, h, torch.float32, softcap=softcap)
        assert peak_bytes(recompute, n, v, h, torch.float32, softcap=softcap, device="cpu") - cuda == (
            softcap * fp32_chunk + row_vectors)
    for name in ("torch", "recompute"):
        strategy = registry.get(name)
        assert strategy.temporaries(False, "cpu", torch.float32) == 0
        assert strategy.temporaries(True, "cpu", torch.float32) == 1
        assert strategy.temporaries(False, "cpu", torch.bfloat16) == 2
        assert strategy.temporaries(True, "cpu", torch.float64) == 3
        assert strategy.temporaries(False, "cpu", torch.float32, torch.bfloat16) == 2  # (only peak_bytes takes it)
    assert registry.get("torch").temporaries(False, "cuda", torch.float32) == 2
    assert registry.get("triton").temporaries(False, "cpu", torch.float32) == 0


#: fp32 CPU calls (n, v, h, chunk_tokens, reduction, dX wanted, dW wanted, softcap) of the torch step's strategies.
#: Over 216 such calls (n 512-8192, V 4096-32000, H 64-1024, chunks 128-2048, both reductions, dX and dW each or
#: both) the bound was 1.05-1.64 MiB above the measured peak, (bound - SLACK_BYTES) / peak at most 1.11: the
#: 1 MiB of slack is most of what is left (1.3-7.9x the peak, 3.0-3.5x for "torch", with the two fp32 chunks it
#: counted before).
_FP32_CPU_CALLS = [
    (2048, 8192, 64, 512, "mean", True, True, False),
    (2048, 8192, 64, 512, "none", True, True, False),
    (2048, 8192, 64, 512, "mean", False, True, True),
    (1024, 16000, 256, 256, "mean", True, False, False),
    (1024, 4096, 1024, 1024, "none", True, True, True),
    (4096, 4096, 64, 4096, "mean", True, True, False),  # one chunk: dW straight
]


@pytest.mark.parametrize("strategy", ["torch", "recompute"])
@pytest.mark.parametrize("n, v, h, chunk, reduction, dx, dw, softcap", _FP32_CPU_CALLS)
def test_fp32_cpu_bound_is_tight(strategy, n, v, h, chunk, reduction, dx, dw, softcap):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).requires_grad_(dx)
    w = (torch.randn(v, h, generator=g) / 8).requires_grad_(dw)
    t = torch.randint(0, v, (n,), generator=g)
    config = FLCEConfig(strategy=strategy, chunk_tokens=chunk, vocab_block=2048)
    grad_output = torch.ones(n if reduction == "none" else ())

    def step():
        loss = fused_linear_cross_entropy(x, w, t, reduction=reduction, softcap=30.0 if softcap else None,
                                          config=config)
        loss.backward(grad_output)

    step()
    x.grad = w.grad = None
    returned = (dx * n * h + dw * v * h + (n if reduction == "none" else 0)) * 4  # gradients, a "none" loss
    measured = cpu_peak_bytes(step) - returned
    bound = peak_bytes(config, n, v, h, torch.float32, need_dw=dw, need_dx=dx, softcap=softcap, device="cpu")
    assert measured <= bound <= 1.2 * measured + SLACK_BYTES, (
        f"measured {measured / 2**20:.2f} MiB above outputs, bound {bound / 2**20:.2f} MiB")


#: What fills the torch step's row vectors most: every per-row option at once.
_ALL_ROW_OPTIONS = dict(softcap=30.0, label_smoothing=0.1, z_loss=1e-4, logit_scale=0.5)


@pytest.mark.parametrize("strategy", ["torch", "recompute"])
@pytest.mark.parametrize("reduction, grad", [("mean", True), ("none", True), ("sum", False)])
def test_fp32_cpu_bound_holds_the_torch_steps_row_vectors(strategy, reduction, grad):
    """With no spare fp32 chunk in the fp32 CPU bound, a chunk of many rows over few classes is where the step's
    own row vectors (masks, int64 indices, the fp64 lse and loss terms) show: at 2^17 rows of 64 classes they took
    up to 31 bytes a row past the other terms (2.9 MiB over a bound that counted none), which
    ``TORCH_STEP_ROW_BYTES`` holds."""
    n, v, h = 2**17, 64, 1
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).requires_grad_(grad)
    w = (torch.randn(v, h, generator=g) / 8).requires_grad_(grad)
    t = torch.randint(0, v, (n,), generator=g).int()  # int32: the int64 copy too
    t[::3] = -100
    ce_weight = torch.rand(v, generator=g) + 0.5
    config = FLCEConfig(strategy=strategy, chunk_tokens=n, vocab_block=v)
    grad_output = torch.ones(n if reduction == "none" else ())

    def step():
        with torch.set_grad_enabled(grad):
            loss = fused_linear_cross_entropy(x, w, t, ce_weight=ce_weight, reduction=reduction, config=config,
                                              **_ALL_ROW_OPTIONS)
            if grad:
                loss.backward(grad_output)

    step()
    x.grad = w.grad = None
    returned = (grad * (n * h + v * h) + (n if reduction == "none" else 0)) * 4
    measured = cpu_peak_bytes(step) - returned
    bound = peak_bytes(config, n, v, h, torch.float32, need_dw=grad, need_dx=grad, softcap=True, device="cpu")
    assert measured <= bound, f"measured {measured / 2**20:.2f} MiB above outputs > bound {bound / 2**20:.2f} MiB"


@pytest.mark.parametrize("strategy", ["torch", "recompute"])
@pytest.mark.parametrize("reduction, bias", [("mean", False), ("mean", True), ("none", True)])
def test_fp32_cpu_bound_holds_the_torch_steps_class_vectors(strategy, reduction, bias):
    """Few rows over many classes: label smoothing's class weights of ones and db's column sums are fp32 vectors
    over the chunk's classes, which a bound without a spare fp32 chunk must count (``TORCH_STEP_CLASS_BYTES``): at
    4 tokens x 2M classes the ones took 6.6 MiB past a bound that counted none, so did the recompute backward's db
    sums of a block."""
    n, v, h = 4, 2_000_000, 4
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).requires_grad_()
    w = (torch.randn(v, h, generator=g) / 8).requires_grad_()
    b = torch.randn(v, generator=g).requires_grad_() if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    config = FLCEConfig(strategy=strategy, chunk_tokens=n, vocab_block=v)
    grad_output = torch.ones(n if reduction == "none" else ())

    def step():
        fused_linear_cross_entropy(x, w, t, b, label_smoothing=0.1, reduction=reduction, config=config).backward(
            grad_output)

    step()
    x.grad = w.grad = None
    if bias:
        b.grad = None
    returned = (n * h + v * h + bias * v + (n if reduction == "none" else 0)) * 4
    measured = cpu_peak_bytes(step) - returned
    bound = peak_bytes(config, n, v, h, torch.float32, need_db=bias, device="cpu")
    assert measured <= bound, f"measured {measured / 2**20:.2f} MiB above outputs > bound {bound / 2**20:.2f} MiB"


#: Cases where the measured CPU peak passed the bound (a bug hunt of 2026-12-06), n x v x h, MiB over it:
#: off CUDA each fp32 sum of bf16 products upcasts its operands (a recompute block's weight rows, +12.0; a chunk's
#: hidden states for dW, +11.9); frozen columns pad dW at the end while the unpadded one lives (+4.5); fp64
#: returns scaled copies of its gradients (+29.0).
_MISSED = {
    "recompute upcast": dict(n=512, v=4096, h=2048, config=FLCEConfig(strategy="recompute", chunk_tokens=128,
                                                                       vocab_block=2048)),
    "chunked upcast": dict(n=2048, v=256, h=4096, config=FLCEConfig(strategy="torch", chunk_tokens=1024)),
    "frozen columns": dict(n=64, v=4096, h=2048, frozen=1024, config=FLCEConfig(strategy="torch", chunk_tokens=64)),
    "frozen columns, recompute": dict(n=64, v=4096, h=2048, frozen=1024,
                                      config=FLCEConfig(strategy="recompute", chunk_tokens=64, vocab_block=512)),
    "fp64": dict(n=256, v=4096, h=1024, dtype=torch.float64, config=FLCEConfig(strategy="torch", chunk_tokens=64)),
}


@pytest.mark.parametrize("case", _MISSED)
def test_cpu_peak_within_bound_where_it_was_missed(case):
    c = dict(_MISSED[case])
    n, v, h, config = c["n"], c["v"], c["h"], c["config"]
    dtype, frozen = c.get("dtype", torch.bfloat16), c.get("frozen", 0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) / 8).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)

    def step():
        fused_linear_cross_entropy(x, w, t, config=config, frozen_weight_columns=frozen).backward()

    step()
    x.grad = w.grad = None
    measured = cpu_peak_bytes(step) - (n * h + v * h) * x.element_size()  # less the returned gradients
    bound = peak_bytes(config, n, v, h, dtype, frozen_columns=frozen, device="cpu")
    assert measured <= bound, f"measured {measured / 2**20:.2f} MiB above outputs > bound {bound / 2**20:.2f} MiB"


#: More cases a bug hunt of 2026-12-06 found past the bound (over it, measured then): the recompute forward's
#: zero-padded weight copy (pad_vocab, +3.2 MiB); the int64 copy of int32 targets (8 B a token); the recompute
#: loop's per-row factors of a "none" loss (+2.7 B a token in fp32, +8.3 in bf16).
_MISSED_TOO = {
    "recompute, padded V": dict(n=256, v=4097, h=1024, dtype=torch.float32, softcap=30.0, dx=False,
                                config=FLCEConfig(strategy="recompute", chunk_tokens=256, vocab_block=512,
                                                  pad_vocab=True)),
    "int32 targets": dict(n=2**19, v=8, h=4, dtype=torch.float32, targets=torch.int32,
                          config=FLCEConfig(strategy="recompute", chunk_tokens=4096, vocab_block=8)),
    "recompute none, bf16": dict(n=2**19, v=8, h=4, dtype=torch.bfloat16, reduction="none",
                                 config=FLCEConfig(strategy="recompute", chunk_tokens=4096, vocab_block=8)),
    "recompute none, fp32": dict(n=2**19, v=8, h=4, dtype=torch.float32, reduction="none",
                                 config=FLCEConfig(strategy="recompute", chunk_tokens=4096, vocab_block=8)),
    # each of the two per-token terms alone (the recompute cases above hold both: one covered for the other)
    "int32 targets, chunked none": dict(n=2**19, v=8, h=4, dtype=torch.float32, reduction="none",
                                        targets=torch.int32, config=FLCEConfig(strategy="torch", chunk_tokens=4096)),
    "int32 targets, recompute none, bf16": dict(n=2**19, v=8, h=4, dtype=torch.bfloat16, reduction="none",
                                                targets=torch.int32,
                                                config=FLCEConfig(strategy="recompute", chunk_tokens=4096,
                                                                  vocab_block=8)),
}


@pytest.mark.parametrize("case", _MISSED_TOO)
def test_cpu_peak_within_bound_where_it_was_missed_too(case):
    c = dict(_MISSED_TOO[case])
    n, v, h, config, dtype = c["n"], c["v"], c["h"], c["config"], c["dtype"]
    reduction, dx = c.get("reduction", "mean"), c.get("dx", True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).to(dtype).requires_grad_(dx)
    w = (torch.randn(v, h, generator=g) / 8).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g).to(c.get("targets", torch.int64))
    grad_output = torch.ones(n if reduction == "none" else (), dtype=dtype)

    def step():
        loss = fused_linear_cross_entropy(x, w, t, reduction=reduction, softcap=c.get("softcap"), config=config)
        loss.backward(grad_output)

    step()
    x.grad = w.grad = None
    returned = (dx * n * h + v * h + (n if reduction == "none" else 0)) * x.element_size()  # gradients, the loss
    measured = cpu_peak_bytes(step) - returned
    bound = peak_bytes(config, n, v, h, dtype, need_dx=dx, softcap="softcap" in c, device="cpu")
    assert measured <= bound, f"measured {measured / 2**20:.2f} MiB above outputs > bound {bound / 2**20:.2f} MiB"


def test_a_budget_drops_the_padded_weight_copy_of_a_recompute_config_last():
    """A budget's recompute candidates inherit the heuristic's pad_vocab (an odd V on the GPU), whose weight copy
    the bound now counts; a budget that only an unpadded one fits gets it (before, the padded one was chosen, its
    bound blind to the 77 MB copy at GPT-2's V and H)."""
    from flce_compile.plan.choose import budget_candidates, choose_config_within_budget

    cuda = torch.device("cuda")
    padded = FLCEConfig(strategy="triton", chunk_tokens=4096, pad_vocab=True)
    candidates = budget_candidates(padded, torch.bfloat16)
    first_unpadded = next(i for i, c in enumerate(candidates) if not c.pad_vocab)
    assert all(c.strategy == "recompute" and not c.pad_vocab for c in candidates[first_unpadded:])
    assert not [c for c in budget_candidates(FLCEConfig(strategy="triton"), torch.bfloat16) if c.pad_vocab]
    config, _, _ = choose_config_within_budget(4096, 50257, 768, torch.bfloat16, cuda, 0.05, need_dw=False)
    assert config.strategy == "recompute" and not config.pad_vocab
    assert peak_bytes(config, 4096, 50257, 768, torch.bfloat16, need_dw=False) <= 0.05 * 2**30
    assert peak_bytes(dataclasses.replace(config, pad_vocab=True), 4096, 50257, 768, torch.bfloat16,
                      need_dw=False) > 0.05 * 2**30


def test_a_budget_counts_the_copies_of_a_non_contiguous_input_and_weight():
    """The bound is above the op's inputs, and a non-contiguous input (hidden states sliced before the head) or
    weight (given as ``w.t()``) is copied first: a budget holds those copies too (they took 13-14 MiB past the
    bound), or says they do not fit."""
    from flce_compile.plan.choose import BudgetError

    n, v, h = 4096, 512, 1024
    g = torch.Generator().manual_seed(0)
    base = torch.randn(n, h + 8, generator=g).to(torch.bfloat16)
    w_t = (torch.randn(h, v, generator=g) / 8).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    copies = (n * h + v * h) * 2  # 9 MiB
    budget = 14 / 1024

    def step():
        fused_linear_cross_entropy(base[:, 4:4 + h], w_t.t(), t, memory_budget_gb=budget).backward()

    step()
    w_t.grad = None
    measured = cpu_peak_bytes(step) - v * h * 2  # less the returned dW
    assert copies < measured <= budget * 2**30
    with pytest.raises(BudgetError, match=r"memory_budget_gb=0.0078125: 0.008789 GiB of it go to the contiguous "
                                          r"copies .* leaves nothing for the op"):
        fused_linear_cross_entropy(base[:, 4:4 + h], w_t.t(), t, memory_budget_gb=8 / 1024)
    with pytest.raises(BudgetError, match=r"memory_budget_gb=0.0089843.: 0.008789 GiB of it go to .* in the "
                                          r"0.0001953 GiB left, no config fits"):
        fused_linear_cross_entropy(base[:, 4:4 + h], w_t.t(), t, memory_budget_gb=9.2 / 1024)
    # contiguous inputs of any rank copy nothing (a reshape view: inference mode gives it no ``_base``)
    x3 = torch.randn(4, n // 4, h, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.isfinite(fused_linear_cross_entropy(x3, w_t.t().contiguous(), t.view(4, -1),
                                                         memory_budget_gb=2 / 1024))
