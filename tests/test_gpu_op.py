"""GPU behaviour of the fused op: no host syncs, NaN for bad targets, CUDA-graph capture, stream overlap, a second
GPU, fully masked batches, fp16 loss scaling and the cuBLAS flags.

Numerics against fp64 run on the GPU through test_op_numerics.py (its device is CUDA when present)."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from flce_compile import FLCEConfig, fused_linear_cross_entropy
from flce_compile.params import LossParams, encode_params
from cuda_capture import plain_and_captured
from flce_reference import fp16_grad_errors, reference_loss

pytestmark = pytest.mark.gpu


def _inputs(n=4096, h=1024, v=32000, dtype=torch.bfloat16, seed=0, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, h, device=device, generator=g).to(dtype)
    w = (torch.randn(v, h, device=device, generator=g) * 2.0 / h**0.5).to(dtype)
    t = torch.randint(0, v, (n,), device=device, generator=g)
    t[::17] = -100
    return x, w, t


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("streams", [False, True])
def test_no_host_sync_forward_backward(reduction, streams):
    x, w, t = _inputs()
    x.requires_grad_()
    w.requires_grad_()
    config = FLCEConfig(strategy="triton", chunk_tokens=1024, streams=streams)
    fused_linear_cross_entropy(x, w, t, reduction=reduction, config=config).sum().backward()  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = fused_linear_cross_entropy(x, w, t, reduction=reduction, config=config, label_smoothing=0.1)
        loss.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_streams_match_single_stream():
    x, w, t = _inputs()
    results = []
    for streams in (False, True):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        cfg = FLCEConfig(strategy="triton", chunk_tokens=512, streams=streams)
        loss = fused_linear_cross_entropy(xs, ws, t, config=cfg)
        loss.backward()
        results.append((loss, xs.grad, ws.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_out_of_range_target_is_nan_without_sync(monkeypatch):
    x, w, t = _inputs(n=64, v=1000)
    t[5] = 5000
    monkeypatch.delenv("FLCE_DEBUG", raising=False)
    per_token = fused_linear_cross_entropy(x, w, t, reduction="none")
    assert math.isnan(per_token[5].item())
    assert torch.isfinite(per_token[torch.arange(64, device="cuda") != 5]).all()
    assert math.isnan(fused_linear_cross_entropy(x, w, t).item())
    monkeypatch.setenv("FLCE_DEBUG", "1")
    with pytest.raises(ValueError, match="outside"):
        fused_linear_cross_entropy(x, w, t)


def test_cuda_graph_capture_of_the_op():
    x, w, t = _inputs(n=2048, v=16384)
    args = (x, w, t, None, None, encode_params(LossParams()), torch.float32, True, True, False,
            FLCEConfig(strategy="triton", chunk_tokens=512, streams=True).to_json())
    op = torch.ops.flce.fused_linear_cross_entropy
    expected, captured = plain_and_captured(lambda: op(*args))
    for a, b in zip(expected, captured):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_realistic_shape_errors_vs_fp64():
    x, w, t = _inputs(n=2048, h=2048, v=65536)
    x.requires_grad_()
    w.requires_grad_()
    fused_linear_cross_entropy(x, w, t).backward()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = reference_loss(x64, w64, t)
    ref.backward()
    xe, we = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    eager = reference_loss(xe, we, t)
    eager.backward()
    for ours, same, exact in ((x.grad, xe.grad, x64.grad), (w.grad, we.grad, w64.grad)):
        e_ours = (ours.double() - exact).norm() / exact.norm()
        e_same = (same.double() - exact).norm() / exact.norm()
        assert e_ours <= e_same * 1.02 + 1e-5, (float(e_ours), float(e_same))


@pytest.mark.parametrize("v", [32000, 50257])  # aligned rows (logits written in place) and GPT-2's odd V
def test_return_logits_errors_vs_fp64(v):
    """return_logits: the logits, the loss and the gradients are as exact as eager's, at an aligned and an
    odd vocabulary, and a loss on the logits themselves reaches the inputs."""
    x, w, t = _inputs(n=2048, h=1024, v=v)
    x.requires_grad_()
    w.requires_grad_()
    extra = torch.randn(2048, v, device="cuda", dtype=torch.float32) * 1e-4
    loss, logits = fused_linear_cross_entropy(x, w, t, return_logits=True, config={"chunk_tokens": 512})
    (loss + (logits.float() * extra).sum()).backward()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logits64 = x64 @ w64.t()
    (reference_loss(x64, w64, t) + (logits64 * extra.double()).sum()).backward()
    xe, we = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    logits_e = xe @ we.t()
    (reference_loss(xe, we, t) + (logits_e.float() * extra).sum()).backward()
    for ours, same, exact in ((logits, logits_e, logits64), (x.grad, xe.grad, x64.grad), (w.grad, we.grad, w64.grad)):
        e_ours = (ours.double() - exact).norm() / exact.norm()
        e_same = (same.double() - exact).norm() / exact.norm()
        assert e_ours <= e_same * 1.02 + 1e-5, (float(e_ours), float(e_same))
    assert logits.is_contiguous() and logits.shape == (2048, v)

def _grads_of(loss_fn, *tensors):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    loss = loss_fn(*leaves)
    loss.sum().backward()
    return loss, [t.grad for t in leaves]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("return_logits", [False, True])
@pytest.mark.parametrize("streams", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_tensors_on_another_gpu_than_the_current_one(dtype, reduction, streams, return_logits):
    """Every tensor on cuda:1 while cuda:0 is current (device_map="auto" puts the lm_head on the last GPU): the
    Triton kernel launched on cuda:0 and failed ("Pointer argument ... cannot be accessed from Triton")."""
    if return_logits and reduction == "none":
        pytest.skip("return_logits needs mean or sum")
    x, w, t = _inputs(n=1024, h=256, v=8192, dtype=dtype, device="cuda:1")
    config = FLCEConfig(strategy="triton", chunk_tokens=256, streams=streams)

    def ours(x, w):
        out = fused_linear_cross_entropy(x, w, t, reduction=reduction, config=config, return_logits=return_logits)
        return out[0] if return_logits else out

    torch.cuda.set_device(0)
    loss, grads = _grads_of(ours, x, w)
    torch.cuda.synchronize(1)
    ref, ref_grads = _grads_of(lambda x, w: reference_loss(x, w, t, reduction=reduction), x, w)
    assert torch.cuda.current_device() == 0
    assert loss.device == x.device and all(g.device == x.device for g in grads)
    tol = {torch.bfloat16: 2e-2, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(loss, ref, rtol=tol, atol=tol)
    for g, r in zip(grads, ref_grads):
        assert ((g.float() - r.float()).norm() / r.float().norm()) < tol


def test_side_stream_per_calling_stream():
    """Each calling stream gets a side stream of its own (a graph capture or another thread's stream must not
    share one), and the op gives the same result from a user stream as from the default one."""
    from flce_compile.strategies.chunked import _side_stream

    device = torch.device("cuda", torch.cuda.current_device())
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    assert _side_stream(device, a.cuda_stream) is _side_stream(device, a.cuda_stream)
    assert _side_stream(device, a.cuda_stream) is not _side_stream(device, b.cuda_stream)
    x, w, t = _inputs(n=2048, v=16384)
    config = FLCEConfig(strategy="triton", chunk_tokens=512, streams=True)
    expected = _grads_of(lambda x, w: fused_linear_cross_entropy(x, w, t, config=config), x, w)
    a.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(a):
        got = _grads_of(lambda x, w: fused_linear_cross_entropy(x, w, t, config=config), x, w)
    torch.cuda.current_stream().wait_stream(a)
    torch.cuda.synchronize()
    # Not bit for bit: only the streams differ, but a missing wait would show as garbage, far past bf16's tolerance.
    torch.testing.assert_close(got[0], expected[0])
    for g, e in zip(got[1], expected[1]):
        torch.testing.assert_close(g, e)


def test_stream_overlap_joins_the_side_stream_on_error(monkeypatch):
    """An error mid-loop still makes the main stream wait for the side stream (try/finally), and the next call
    works."""
    import flce_compile.strategies.ce_torch as ce_torch
    import flce_compile.strategies.chunked as chunked

    joined = []
    original_join = chunked._StreamOverlap.join
    monkeypatch.setattr(chunked._StreamOverlap, "join", lambda self: (joined.append(True), original_join(self)))
    original_step = ce_torch.ce_step_torch
    calls = {"n": 0}

    def failing_step(args, p, config):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("CE step failed")
        original_step(args, p, config)

    monkeypatch.setattr(ce_torch, "ce_step_torch", failing_step)  # the registry's "torch" step, looked up per call
    x, w, t = _inputs(n=2048, v=16384)
    config = FLCEConfig(strategy="torch", chunk_tokens=256, streams=True)
    with pytest.raises(RuntimeError, match="CE step failed"):
        fused_linear_cross_entropy(x, w.requires_grad_(), t, config=config)
    assert joined == [True]
    monkeypatch.setattr(ce_torch, "ce_step_torch", original_step)
    loss, _ = _grads_of(lambda x, w: fused_linear_cross_entropy(x, w, t, config=config), x, w)
    torch.testing.assert_close(loss, reference_loss(x, w, t), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("return_logits", [False, True])
@pytest.mark.parametrize("valid", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fully_masked_batch_has_zero_gradients(dtype, valid, return_logits):
    """A micro-batch whose targets are all ignored (all prompt, in SFT): loss nan as in torch, gradients exactly
    0 on the Triton path (they were nan everywhere); with one valid token, the reference's."""
    x, w, t = _inputs(n=2048, h=512, v=16384, dtype=dtype)
    t.fill_(-100)
    t[:valid] = 5
    config = FLCEConfig(strategy="triton", chunk_tokens=512)

    def ours(x, w):
        out = fused_linear_cross_entropy(x, w, t, config=config, return_logits=return_logits)
        return out[0] if return_logits else out

    loss, grads = _grads_of(ours, x, w)
    if not valid:
        assert math.isnan(loss.item())
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
        return
    ref, ref_grads = _grads_of(lambda x, w: reference_loss(x, w, t, upcast=torch.float64), x, w)
    for g, r in zip(grads, ref_grads):
        assert torch.isfinite(g).all() and (g.double() - r).norm() <= 2e-2 * r.norm()


def test_classes_masked_through_the_bias_on_gpu():
    """The first block_v logits of every row are -inf: the online softmax gave nan on the Triton path."""
    x, w, t = _inputs(n=1024, h=256, v=16384)
    b = torch.zeros(16384, device="cuda", dtype=torch.bfloat16)
    b[:4096] = -math.inf
    t = 4096 + t.clamp(min=0) % 8192
    config = FLCEConfig(strategy="triton", chunk_tokens=256, block_v=4096)
    loss, grads = _grads_of(lambda x, w: fused_linear_cross_entropy(x, w, t, b, config=config), x, w)
    ref, ref_grads = _grads_of(lambda x, w: reference_loss(x, w, t, b), x, w)
    torch.testing.assert_close(loss, ref, rtol=1e-2, atol=1e-2)
    for g, r in zip(grads, ref_grads):
        assert torch.isfinite(g).all() and (g.float() - r.float()).norm() <= 2e-2 * r.float().norm()


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fp16_loss_scaling_is_as_exact_as_eager(reduction):
    """(65536 * loss).backward() in fp16: the mean's 1/count is applied after the GEMMs with the loss scale, so
    p/count no longer flushes to 0 (dX error was 23x eager's at 8192 x 16384 on the CPU path)."""
    x, w, t = _inputs(n=8192, h=1024, v=32768, dtype=torch.float16)
    w = w * 1.5  # a peakier softmax: more tiny p
    scale = 65536.0

    def scaled(fn):
        def run(x, w):
            loss = fn(x, w)
            return scale * (loss.sum() / t.numel() if reduction == "none" else loss)
        return run

    config = FLCEConfig(strategy="triton", chunk_tokens=2048)
    _, ours = _grads_of(scaled(lambda x, w: fused_linear_cross_entropy(x, w, t, reduction=reduction,
                                                                        config=config)), x, w)
    _, eager = _grads_of(scaled(lambda x, w: reference_loss(x, w, t, reduction=reduction)), x, w)
    _, exact = _grads_of(scaled(lambda x, w: reference_loss(x, w, t, reduction=reduction, upcast=torch.float64)),
                         x.double(), w.double())
    for o, e, r in zip(ours, eager, exact):
        e_ours = (o.double() - r).norm() / r.norm()
        e_eager = (e.double() - r).norm() / r.norm()
        assert e_ours <= 1.25 * e_eager, (float(e_ours), float(e_eager))


@pytest.mark.parametrize("config", [None, {"strategy": "triton", "chunk_tokens": 1024}], ids=["default", "chunks"])
def test_fp16_mean_sums_and_smoothed_heavy_classes_stay_finite(config):
    """The CPU cases of test_op_reliability on the GPU's paths (the loss-scales kernel, Triton CE, cuBLAS): dW
    summed over 4096 tokens with a shared feature of 60, and label smoothing with an absent class weighted 1e6,
    were inf in fp16 where eager's are finite."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, v = 4096, 64, 256
    x0 = torch.randn(n, h, device="cuda", generator=g)
    x0[:, 0] = 60.0
    w0 = torch.randn(v, h, device="cuda", generator=g) * 0.01
    t = torch.randint(0, 2, (n,), device="cuda", generator=g)
    rel, finite = fp16_grad_errors(x0.half(), w0.half(), t, config=config)
    assert finite and all(ours <= 1.05 * eager for ours, eager in rel), rel
    v = 3  # few classes: eps/V of the absent heavy class's weight is what the bound must cover
    x0, w0 = torch.randn(n, h, device="cuda", generator=g) / h**0.5, torch.randn(v, h, device="cuda", generator=g)
    cw = torch.ones(v, device="cuda")
    cw[0] = 1e6
    t = torch.randint(1, v, (n,), device="cuda", generator=g)
    rel, finite = fp16_grad_errors(x0.half(), w0.half(), t, config=config, ce_weight=cw, label_smoothing=0.1)
    assert finite and all(ours <= 1.05 * eager for ours, eager in rel), rel


def test_fp64_gradcheck_on_gpu():
    """fp64 runs on the torch strategy on the GPU too (the Triton kernel is fp32), and passes gradcheck."""
    x, w, t = _inputs(n=9, h=6, v=13, dtype=torch.float64)
    leaves = (x.requires_grad_(), w.requires_grad_())
    assert torch.autograd.gradcheck(
        lambda x, w: fused_linear_cross_entropy(x, w, t, label_smoothing=0.1, config={"chunk_tokens": 4}), leaves)


def test_reduction_flags_restored_after_concurrent_calls():
    """Two threads running chunked calls at once leave the user's cuBLAS flags (both halves) as they were."""
    matmul = torch.backends.cuda.matmul
    names = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")

    def state():
        return tuple((getattr(matmul, n), getattr(matmul, n + "_split_k", None)) for n in names)

    before = state()
    x, w, t = _inputs(n=2048, v=16384)
    config = FLCEConfig(strategy="triton", chunk_tokens=256)
    fused_linear_cross_entropy(x, w, t, config=config)  # compile the kernel before the threads race to
    errors = []

    def work():
        try:
            for _ in range(5):
                fused_linear_cross_entropy(x, w.detach().requires_grad_(), t, config=config).backward()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    torch.cuda.synchronize()
    assert not errors and state() == before


def test_recompute_strategy_on_gpu():
    """The recompute strategy: as exact as eager against fp64, no host sync, and its peak within its bound."""
    from flce_compile import peak_bytes

    x, w, t = _inputs(n=4096, h=1024, v=32000)
    config = FLCEConfig(strategy="recompute", chunk_tokens=1024, vocab_block=4096)
    x.requires_grad_()
    w.requires_grad_()
    fused_linear_cross_entropy(x, w, t, config=config).backward()  # warm-up
    x.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = fused_linear_cross_entropy(x, w, t, config=config)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    grads = x.grad.numel() * 2 + w.grad.numel() * 2
    peak = torch.cuda.max_memory_allocated() - base - grads
    assert peak <= peak_bytes(config, 4096, 32000, 1024, torch.bfloat16), peak
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    reference_loss(x64, w64, t).backward()
    xe, we = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    reference_loss(xe, we, t).backward()
    for ours, same, exact in ((x.grad, xe.grad, x64.grad), (w.grad, we.grad, w64.grad)):
        e_ours = (ours.double() - exact).norm() / exact.norm()
        e_same = (same.double() - exact).norm() / exact.norm()
        assert e_ours <= e_same * 1.02 + 1e-5, (float(e_ours), float(e_same))


@pytest.mark.parametrize("return_logits", [False, True])
def test_grad_output_not_a_power_of_two_is_rounded_once(return_logits):
    """(loss / 3).backward(): each gradient is the fp32 product of the forward-computed gradient and
    grad_scale * grad_output, rounded once to bf16 (kernels/scale_grads.py). CUDA's ``mul_`` with a 0-dim CUDA
    tensor would round the factor 1/3 to bf16 first."""
    torch.manual_seed(0)
    x = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(8192, 512, device="cuda") * 0.05).to(torch.bfloat16)
    t = torch.randint(0, 8192, (2048,), device="cuda")

    def grads(factor: float):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fused_linear_cross_entropy(xs, ws, t, return_logits=return_logits)
        loss = out[0] if return_logits else out
        (loss * factor).backward()
        return xs.grad, ws.grad

    one = grads(1.0)  # grad_scale is a power of two: these are the forward's gradients exactly
    third = grads(1 / 3)
    factor = torch.tensor(1 / 3, dtype=torch.float32, device="cuda")
    for g1, g3 in zip(one, third):
        assert torch.equal(g3, (g1.float() * factor).to(torch.bfloat16))


@pytest.mark.parametrize("config", [
    FLCEConfig(strategy="triton", chunk_tokens=1024, streams=True),  # chunks, the dW GEMMs on a side stream
    FLCEConfig(strategy="triton", chunk_tokens=4096),  # one chunk: dW straight in bf16
    FLCEConfig(strategy="recompute", chunk_tokens=1024, vocab_block=8192),
], ids=["chunks_streams", "one_chunk", "recompute"])
def test_frozen_weight_columns_on_the_gpu(config):
    """``frozen_weight_columns``: cuBLAS's dW GEMMs read a column slice of x (its row stride larger than its
    width); loss and dX as without the option, dW's trainable columns to an ulp, the frozen ones zero, with no host
    sync, and CUDA-graph replays (the third call on) alike."""
    x, w, t = _inputs(v=32003)
    frozen = 1024 - 16
    grads = {}
    for columns in (0, frozen):
        for _ in range(3):  # (a plain call, a capture, a replay)
            xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
            loss = fused_linear_cross_entropy(xs, ws, t, config=config, frozen_weight_columns=columns)
            loss.backward()
        grads[columns] = (loss.detach(), xs.grad, ws.grad)
    (loss0, dx0, dw0), (loss, dx, dw) = grads[0], grads[frozen]
    assert torch.equal(loss, loss0) and torch.equal(dx, dx0)
    assert dw.shape == w.shape and not dw[:, :frozen].any()
    eps = torch.finfo(w.dtype).eps
    torch.testing.assert_close(dw[:, frozen:].float(), dw0[:, frozen:].float(), rtol=eps,
                               atol=eps * dw0.abs().max().item())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_linear_cross_entropy(x.requires_grad_(), w.requires_grad_(), t, config=config,
                                   frozen_weight_columns=frozen).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
