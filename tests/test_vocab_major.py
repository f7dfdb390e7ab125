"""The vocabulary-major one-chunk loop (``strategies.vocab_major``) and its kernels (``kernels.ce_columns``), on the
CPU through TRITON_INTERPRET=1 at small shapes.

The step must give each token's loss and gradient as fp64 cross-entropy does, whether the vocabulary is walked by
one program per token block or split into segments, at token counts and vocabularies that are not multiples of
the tiles, with ignored and out-of-range targets, a 0-dim or per-token factor, and without a gradient (the logits
untouched). The loop must be what an odd V's one-chunk call on the Triton strategy runs, and nothing else.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from flce_compile import fused_linear_cross_entropy  # noqa: E402
from flce_compile.strategies import vocab_major  # noqa: E402
from flce_compile.strategies.vocab_major import ColumnTiles, ce_columns_step  # noqa: E402

TILES = ColumnTiles(block_t=16, block_v=32)


def _case(n: int, v: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=g) * 4
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = -100
    return z, t


@pytest.mark.parametrize("segments", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("per_token", [False, True], ids=["0-dim-scale", "per-token-scale"])
def test_step_matches_fp64_cross_entropy(segments: int, dtype: torch.dtype, per_token: bool):
    n, v = 37, 203  # neither a multiple of block_t nor of block_v
    z, t = _case(n, v)
    t[3] = v + 2  # out of range, not ignored: that token's loss and gradient are nan
    logits_t = z.t().contiguous().to(dtype)
    z64 = logits_t.double().t().clone().requires_grad_()
    scale = torch.rand(n) + 0.5 if per_token else torch.tensor(1.0 / n)
    loss = torch.full((n,), 7.0)
    ce_columns_step(logits_t, t, scale, loss, -100, write_grad=True, tiles=TILES, segments=segments)

    valid_t = t.clone()
    valid_t[3] = -100
    rows = F.cross_entropy(z64, valid_t, ignore_index=-100, reduction="none") * scale.double()
    rows.sum().backward()
    rest = torch.arange(n) != 3
    grad = logits_t.double().t()
    assert math.isnan(loss[3]) and grad[3].isnan().all()
    torch.testing.assert_close(loss[rest].double(), rows.detach()[rest], rtol=1e-6, atol=1e-7)
    rtol = 1e-5 if dtype == torch.float32 else 2**-8  # bf16: one rounding of g, at most half its ulp
    torch.testing.assert_close(grad[rest], z64.grad[rest], rtol=rtol, atol=1e-9)
    assert (grad[t == -100] == 0).all()  # ignored tokens: loss 0 and gradient exactly 0
    assert (loss[t == -100] == 0).all()


@pytest.mark.parametrize("segments", [1, 4])
def test_without_gradient_the_logits_stay(segments: int):
    z, t = _case(40, 100)
    logits_t = z.t().contiguous()
    before = logits_t.clone()
    loss = torch.empty(40)
    ce_columns_step(logits_t, t, torch.tensor(1.0), loss, -100, write_grad=False, tiles=TILES, segments=segments)
    assert torch.equal(logits_t, before)
    expected = F.cross_entropy(z.double(), t, ignore_index=-100, reduction="none")
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-7)


def test_segment_count_must_be_a_power_of_two():
    z, t = _case(16, 64)
    with pytest.raises(ValueError, match="segments=3 must be a power of two"):
        ce_columns_step(z.t().contiguous(), t, torch.tensor(1.0), torch.empty(16), -100, write_grad=True,
                        tiles=TILES, segments=3)


@pytest.fixture
def on_the_cpu(monkeypatch):
    """The loop allowed on the CPU, and a record of the calls that took it."""
    monkeypatch.setattr(vocab_major, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(vocab_major, "TILES", TILES)  # read at each call
    taken = []
    real = vocab_major.run_vocab_major

    def spy(*args, **kwargs):
        taken.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(vocab_major, "run_vocab_major", spy)
    return taken


ONE_CHUNK = {"strategy": "triton", "chunk_tokens": 4096, "pad_vocab": True, "block_v": 32}


def _grads(loss_fn, x, w, t):
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = loss_fn(xg, wg, t)
    loss.backward()
    return loss, xg.grad, wg.grad


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_odd_vocab_one_chunk_call_takes_it_and_matches_fp64(on_the_cpu, reduction: str):
    g = torch.Generator().manual_seed(1)
    n, h, v = 48, 32, 203  # fp32 rows of 812 bytes: pad_vocab pads them
    x = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) / h**0.5
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = -100
    ours = _grads(lambda a, b, c: fused_linear_cross_entropy(a, b, c, reduction=reduction, config=ONE_CHUNK), x, w, t)
    assert len(on_the_cpu) == 1
    exact = _grads(lambda a, b, c: F.cross_entropy(a @ b.t(), c, reduction=reduction), x.double(), w.double(), t)
    for got, want in zip(ours, exact):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", [
    dict(config={**ONE_CHUNK, "chunk_tokens": 16}),  # several chunks
    dict(config={**ONE_CHUNK, "pad_vocab": False}),
    dict(config={**ONE_CHUNK, "strategy": "torch"}),
    dict(vocab=256),  # rows already aligned
    dict(tokens=47),  # logits^T rows of 47 fp32: not 16-byte aligned
    dict(config={**ONE_CHUNK, "strategy": "recompute"}),
    dict(dtype=torch.bfloat16, precision="precise"),  # fp32 logits
    dict(dtype=torch.float16),  # fp16 dW: sums kept in fp32 and fitted into fp16's range
    dict(label_smoothing=0.1),
    dict(softcap=30.0),
    dict(logit_scale=2.0),
    dict(z_loss=1e-4),
    dict(reduction="none"),
    dict(bias=True),
    dict(ce_weight=True),
    dict(return_logits=True),
], ids=["chunked", "no-pad-vocab", "torch-strategy", "aligned-vocab", "unaligned-tokens", "recompute", "precise",
        "fp16", "smoothing", "softcap", "logit-scale", "z-loss", "per-token", "bias", "class-weights", "kept-logits"])
def test_other_calls_keep_the_token_major_loop(on_the_cpu, case: dict):
    case = dict(case)
    n, v, dtype = case.pop("tokens", 48), case.pop("vocab", 203), case.pop("dtype", torch.float32)
    x, w = torch.randn(n, 32, dtype=dtype), (torch.randn(v, 32) / 32**0.5).to(dtype)
    t = torch.randint(0, v, (n,))
    config = case.pop("config", ONE_CHUNK)
    if case.pop("bias", False):
        case["bias"] = torch.randn(v)
    if case.pop("ce_weight", False):
        case["ce_weight"] = torch.rand(v) + 0.5
    out = fused_linear_cross_entropy(x.requires_grad_(), w.requires_grad_(), t, config=config, **case)
    loss = out[0] if isinstance(out, tuple) else out
    loss.sum().backward()
    assert on_the_cpu == []


@pytest.mark.parametrize("needs", ["dw-only", "dx-only", "frozen-columns"])
def test_partial_gradients_match_fp64(on_the_cpu, needs: str):
    """dW alone (x needs no gradient: the CE step must still write the gradient), dX alone, and dW of the
    columns past the frozen ones."""
    g = torch.Generator().manual_seed(2)
    n, h, v, frozen = 48, 32, 203, 8
    x = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) / h**0.5
    t = torch.randint(0, v, (n,), generator=g)
    xg, wg = x.clone().requires_grad_(needs != "dw-only"), w.clone().requires_grad_(needs != "dx-only")
    extra = {"frozen_weight_columns": frozen} if needs == "frozen-columns" else {}
    fused_linear_cross_entropy(xg, wg, t, config=ONE_CHUNK, **extra).backward()
    assert len(on_the_cpu) == 1
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    F.cross_entropy(x64 @ w64.t(), t).backward()
    if needs != "dw-only":
        torch.testing.assert_close(xg.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)
    if needs != "dx-only":
        want = w64.grad.clone()
        if needs == "frozen-columns":
            want[:, :frozen] = 0
        torch.testing.assert_close(wg.grad.double(), want, rtol=1e-5, atol=1e-6)
