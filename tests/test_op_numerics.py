"""The fused op against an fp64 reference: |ref64 - ours| <= |ref64 - eager torch in the same dtype| + tol.

Per element for reduction="none" losses, by norm for gradients; over dtype x reduction x option x shape, on
the PyTorch strategy and (a cross-section) on the Triton kernel through the interpreter or the GPU. The
"precise" policy passes the same grid and, on a peaky softmax, holds dX and dW to 0.7x eager's error.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flce_compile import fused_linear_cross_entropy
from flce_reference import reference_loss

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Slack on top of eager's own error, relative to the reference's size: well under eager's error in that dtype
# (bf16 ~4e-3, fp16 ~5e-4), so the test fails if we are clearly less exact than eager.
REL_TOL = {torch.float32: 2e-6, torch.bfloat16: 4e-4, torch.float16: 6e-5}
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
OPTIONS = {
    "plain": {},
    "ignore_index": {"ignore_index": 3},
    "label_smoothing": {"label_smoothing": 0.15},
    "ce_weight": {"ce_weight": "random"},
    "bias": {"bias": True},
    "softcap": {"softcap": 4.0},
    "logit_scale": {"logit_scale": 0.6},
    "z_loss": {"z_loss": 1e-3},
}
# name: (leading shape, H, V, chunk_tokens)
SHAPES = {
    "bt1": ((1,), 256, 512, 16),  # wide, so one row still gives the error norms some statistics
    "odd_chunks": ((47,), 31, 123, 16),
    "3d": ((2, 9), 24, 70, 8),
    "noncontig": ((20,), 16, 50, 7),
    "all_ignored": ((6,), 16, 40, 4),
}


def make_case(shape_name: str, dtype: torch.dtype, option: str, device: str = DEVICE, seed: int = 0):
    lead, hidden, vocab, chunk = SHAPES[shape_name]
    g = torch.Generator().manual_seed(seed)
    opts = dict(OPTIONS[option])
    ignore_index = opts.get("ignore_index", -100)
    if shape_name == "noncontig":
        base = torch.randn(*lead, 2 * hidden, generator=g)
        x = base.to(device=device, dtype=dtype)[..., ::2]
        assert not x.is_contiguous()
    else:
        x = torch.randn(*lead, hidden, generator=g).to(device=device, dtype=dtype)
    # Logits with std ~3: a peaky softmax, where low-precision gradients are hardest.
    w = (torch.randn(vocab, hidden, generator=g) * 3.0 / hidden**0.5).to(device=device, dtype=dtype)
    t = torch.randint(0, vocab, lead, generator=g).to(device)
    if shape_name == "all_ignored":
        t.fill_(ignore_index)
    elif t.numel() > 2:
        t.view(-1)[1] = ignore_index
    b = torch.randn(vocab, generator=g).to(device=device, dtype=dtype) if opts.pop("bias", False) else None
    if opts.get("ce_weight") == "random":
        opts["ce_weight"] = (torch.rand(vocab, generator=g) + 0.5).to(device)
    return x, w, t, b, opts, chunk


def _grads(loss, inputs, grad_out):
    return torch.autograd.grad(loss, inputs, grad_out)


def check_case(shape_name: str, dtype: torch.dtype, reduction: str, option: str, strategy: str,
               pad_vocab: bool = False, precision: str = "exact", chunk: int | None = None) -> None:
    x, w, t, b, opts, shape_chunk = make_case(shape_name, dtype, option)
    chunk = chunk or shape_chunk
    leaves = [x.detach().requires_grad_(), w.detach().requires_grad_()] + (
        [b.detach().requires_grad_()] if b is not None else [])
    bias_arg = leaves[2] if b is not None else None
    config = {"strategy": strategy, "chunk_tokens": chunk, "block_v": 64, "num_warps": 2,  # 2 blocks over V
              "pad_vocab": pad_vocab, "vocab_block": 32}  # recompute: several vocabulary blocks
    ours = fused_linear_cross_entropy(leaves[0], leaves[1], t, bias_arg, reduction=reduction, config=config,
                                      precision=precision, **opts)
    same = reference_loss(leaves[0], leaves[1], t, bias_arg, reduction=reduction, **opts)
    ref = reference_loss(leaves[0], leaves[1], t, bias_arg, reduction=reduction, upcast=torch.float64, **opts)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    gen = torch.Generator().manual_seed(1)
    # Per-token grad_output for "none"; for mean/sum a power of two, which scales the forward-computed
    # gradients exactly (any other factor adds one rounding in bf16/fp16: documented).
    grad_out = (torch.rand(ref.shape, generator=gen) + 0.5).to(DEVICE) if reduction == "none" else (
        torch.full((), 0.5, device=DEVICE))
    ref_nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(ours), ref_nan), "NaN pattern differs from the reference"
    keep = ~ref_nan
    e_ours = (ours.double() - ref)[keep]
    e_same = (same.double() - ref)[keep]
    tol = REL_TOL[dtype] * ref[keep].abs() + 1e-7
    if reduction == "none":
        # Per token, one rounding of a logit (which eager may round twice, luckily closer) moves a loss by
        # up to an ulp of the logits: allowed per element; over all tokens we must still be no worse.
        ulp = ULP[dtype] * (ref[keep].abs() + 1.0)
        assert torch.all(e_ours.abs() <= e_same.abs() + tol + ulp), f"loss error {e_ours.abs().max():.3e}"
        assert e_ours.norm() <= e_same.norm() + REL_TOL[dtype] * ref[keep].norm() + ulp.norm() / ulp.numel() ** 0.5
    else:
        # The same rounding luck, averaged over the tokens.
        ulp = ULP[dtype] * (ref.abs() + 1.0) / max(1, t.numel()) ** 0.5
        assert torch.all(e_ours.abs() <= e_same.abs() + tol + ulp), (
            f"loss error {e_ours.abs().max():.3e} vs eager {e_same.abs().max():.3e}")
    if reduction != "none" and bool(ref_nan.any()):
        return  # all targets ignored: mean is nan, gradients are not defined by torch either

    g_ours = _grads(ours, leaves, grad_out.to(ours.dtype))
    g_same = _grads(same, leaves, grad_out.to(same.dtype))
    g_ref = _grads(ref, leaves, grad_out.to(ref.dtype))
    for name, a, s, r in zip(("dx", "dw", "db"), g_ours, g_same, g_ref):
        assert a.dtype == dtype and a.shape == r.shape
        e_a = (a.double() - r).norm()
        e_s = (s.double() - r).norm()
        tol = REL_TOL[dtype] * r.norm() + 1e-9
        assert e_a <= e_s + tol, f"{name}: error {e_a:.3e} vs eager {e_s:.3e} (tol {tol:.1e})"


@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_torch_strategy_grid(dtype, reduction, option, shape_name):
    check_case(shape_name, DTYPES[dtype], reduction, option, "torch")


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_triton_kernel_grid(dtype, reduction, option):
    check_case("odd_chunks", DTYPES[dtype], reduction, option, "triton")


@pytest.mark.parametrize("shape_name", ["bt1", "3d", "noncontig", "all_ignored"])
def test_triton_kernel_shapes(shape_name):
    check_case(shape_name, torch.bfloat16, "sum", "softcap", "triton")


@pytest.mark.parametrize("option", ["plain", "bias", "ce_weight", "label_smoothing", "softcap"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("strategy", ["torch", "triton"])
def test_padded_vocab(strategy, reduction, option):
    """pad_vocab (zero rows appended to the weight, V=123 -> 128) is as exact as eager, bias gradient included."""
    check_case("odd_chunks", torch.bfloat16, reduction, option, strategy, pad_vocab=True)


@pytest.mark.parametrize("option", ["plain", "bias", "label_smoothing"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["torch", "triton"])
@pytest.mark.parametrize("shape_name", ["odd_chunks", "noncontig"])
def test_padded_vocab_one_chunk(shape_name, strategy, dtype, option):
    """pad_vocab in one chunk, where dW's V rows come from two GEMMs, the aligned head and the odd tail
    (``chunked._DwAccumulator``), with no padded dW: as exact as eager. V=123 pads to 128 (a head of 64 bf16
    rows, 96 fp32); V=50 to 64 (a head of 32 fp32 rows; in bf16 no head, all of it tail)."""
    check_case(shape_name, DTYPES[dtype], "mean", option, strategy, pad_vocab=True, chunk=64)


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_recompute_strategy_grid(dtype, reduction, option):
    """The checkpointed head (gradients from the saved lse, by vocabulary block) is as exact as eager."""
    check_case("odd_chunks", DTYPES[dtype], reduction, option, "recompute")


@pytest.mark.parametrize("shape_name", ["bt1", "3d", "noncontig", "all_ignored"])
def test_recompute_strategy_shapes(shape_name):
    check_case(shape_name, torch.bfloat16, "mean", "label_smoothing", "recompute")


# -- precision="precise": fp32 logits into the CE step ---------------------------------------------------------


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_precise_torch_grid(dtype, reduction, option):
    check_case("odd_chunks", DTYPES[dtype], reduction, option, "torch", precision="precise")


@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_precise_torch_shapes(shape_name):
    check_case(shape_name, torch.bfloat16, "mean", "bias", "torch", precision="precise")


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_precise_triton_kernel_grid(reduction, option):
    check_case("odd_chunks", torch.bfloat16, reduction, option, "triton", precision="precise")


@pytest.mark.parametrize("option", ["plain", "bias"])
@pytest.mark.parametrize("strategy", ["torch", "triton"])
def test_precise_padded_vocab(strategy, option):
    """With pad_vocab the gradient buffer's padding columns are written by no GEMM: they must stay zeros."""
    check_case("odd_chunks", torch.bfloat16, "mean", option, strategy, pad_vocab=True, precision="precise")


@pytest.mark.parametrize("option", ["plain", "bias", "softcap", "label_smoothing", "ce_weight"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_precise_recompute(reduction, option):
    check_case("odd_chunks", torch.bfloat16, reduction, option, "recompute", precision="precise")


#: strategy: (tokens, H, V, chunk_tokens) of the peaky case; smaller for the kernel in the interpreter.
PEAKY_SHAPES = {"torch": (256, 128, 4096, 64), "recompute": (256, 128, 4096, 64), "triton": (64, 64, 1024, 16)}
PRECISE_RATIO = 0.7  # issue #12: dX and dW errors at most 0.7x eager's on a peaky softmax


def _peaky_errors(strategy: str, dtype: torch.dtype, reduction: str, precision: str, return_logits: bool = False):
    """Relative dX and dW errors against fp64 of the op with ``precision`` and of eager PyTorch, on logits of
    std 3 (the benchmark's peaky case); with ``return_logits`` also the logits the op returned."""
    n, hidden, vocab, chunk = PEAKY_SHAPES[strategy]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, hidden, generator=g).to(device=DEVICE, dtype=dtype)
    w = (torch.randn(vocab, hidden, generator=g) * 3.0 / hidden**0.5).to(device=DEVICE, dtype=dtype)
    t = torch.randint(0, vocab, (n,), generator=g).to(DEVICE)
    t[::17] = -100
    config = {"strategy": strategy, "chunk_tokens": chunk, "block_v": 256, "num_warps": 2, "vocab_block": 1024}

    def grads(fn, a, b):
        a, b = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
        out = fn(a, b)
        loss = out[0] if isinstance(out, tuple) else out
        loss.sum().backward()
        return a.grad, b.grad, (out[1] if isinstance(out, tuple) else None)

    def eager(a, b):
        return reference_loss(a, b, t, reduction=reduction)

    ref = grads(lambda a, b: reference_loss(a, b, t, reduction=reduction, upcast=torch.float64), x, w)
    same = grads(eager, x, w)
    ours = grads(lambda a, b: fused_linear_cross_entropy(a, b, t, reduction=reduction, config=config,
                                                         precision=precision, return_logits=return_logits), x, w)

    def err(a, r):
        return float((a.double() - r.double()).norm() / r.double().norm())

    errors = {name: (err(ours[i], ref[i]), err(same[i], ref[i])) for i, name in enumerate(("dx", "dw"))}
    return errors, ours[2], F.linear(x, w)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("strategy", list(PEAKY_SHAPES))
def test_precise_beats_eager_on_a_peaky_softmax(strategy, dtype, reduction):
    """dX and dW errors against fp64 at most 0.7x eager's (measured 0.42x-0.51x); "exact" on the same case
    equals eager's, so the bound is the policy's doing."""
    errors, _, _ = _peaky_errors(strategy, DTYPES[dtype], reduction, "precise")
    for name, (ours, eager) in errors.items():
        assert ours <= PRECISE_RATIO * eager, f"{name}: precise {ours:.3e} vs eager {eager:.3e} ({ours / eager:.2f}x)"
    exact, _, _ = _peaky_errors(strategy, DTYPES[dtype], reduction, "exact")
    for name, (ours, eager) in exact.items():
        assert ours > PRECISE_RATIO * eager, f"{name}: exact {ours:.3e} vs eager {eager:.3e}"


@pytest.mark.parametrize("strategy", ["torch", "triton"])
def test_precise_keeps_the_returned_logits_eager_like(strategy):
    """With return_logits the op still returns logits in the compute dtype, rounded once from the fp32 ones
    (eager's own GEMM rounding), while its gradients get the precise policy's errors."""
    errors, logits, eager_logits = _peaky_errors(strategy, torch.bfloat16, "mean", "precise", return_logits=True)
    assert logits.dtype == torch.bfloat16
    # At most one bf16 ulp apart (2^-7 relative at the bottom of a binade): another fp32 summation order.
    torch.testing.assert_close(logits, eager_logits, rtol=2.0**-7, atol=1e-6)
    assert (logits != eager_logits).float().mean() < 1e-3
    for name, (ours, eager) in errors.items():
        assert ours <= PRECISE_RATIO * eager, f"{name}: precise {ours:.3e} vs eager {eager:.3e}"


@pytest.mark.parametrize("strategy", ["torch", "triton"])
def test_precise_is_exact_for_fp32_inputs(strategy):
    """fp32 logits already are the GEMM's accumulator: "precise" runs exactly what "exact" runs."""
    x, w, t, b, opts, chunk = make_case("odd_chunks", torch.float32, "plain")
    config = {"strategy": strategy, "chunk_tokens": chunk, "block_v": 64, "num_warps": 2}
    results = []
    for precision in ("exact", "precise"):
        xs, ws = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        loss = fused_linear_cross_entropy(xs, ws, t, config=config, precision=precision)
        loss.backward()
        results.append((loss, xs.grad, ws.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
