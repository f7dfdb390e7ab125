"""GPU behaviour of the fused op: no host syncs, NaN for bad targets, CUDA-graph capture, stream overlap.

Numerics against fp64 run on the GPU through test_op_numerics.py (its device is CUDA when present)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from flce_compile import FLCEConfig, fused_linear_cross_entropy
from flce_reference import reference_loss

pytestmark = pytest.mark.gpu


def _inputs(n=4096, h=1024, v=32000, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    w = (torch.randn(v, h, device="cuda", generator=g) * 2.0 / h**0.5).to(dtype)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
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
    args = (x, w, t, None, None, -100, "mean", 0.0, 0.0, 1.0, 0.0, torch.float32, True, True, False,
            FLCEConfig(strategy="triton", chunk_tokens=512, streams=True).to_json())
    op = torch.ops.flce.fused_linear_cross_entropy
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        expected = op(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op(*args)
    graph.replay()
    torch.cuda.synchronize()
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
