"""The fused op against an fp64 reference: |ref64 - ours| <= |ref64 - eager torch in the same dtype| + tol.

Per element for reduction="none" losses, by norm for gradients; over dtype x reduction x option x shape, on
the PyTorch strategy and (a cross-section) on the Triton kernel through the interpreter or the GPU.
"""

from __future__ import annotations

import pytest
import torch

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
               pad_vocab: bool = False) -> None:
    x, w, t, b, opts, chunk = make_case(shape_name, dtype, option)
    leaves = [x.detach().requires_grad_(), w.detach().requires_grad_()] + (
        [b.detach().requires_grad_()] if b is not None else [])
    bias_arg = leaves[2] if b is not None else None
    config = {"strategy": strategy, "chunk_tokens": chunk, "block_v": 64, "num_warps": 2,  # 2 blocks over V
              "pad_vocab": pad_vocab, "vocab_block": 32}  # recompute: several vocabulary blocks
    ours = fused_linear_cross_entropy(leaves[0], leaves[1], t, bias_arg, reduction=reduction, config=config, **opts)
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


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_recompute_strategy_grid(dtype, reduction, option):
    """The checkpointed head (gradients from the saved lse, by vocabulary block) is as exact as eager."""
    check_case("odd_chunks", DTYPES[dtype], reduction, option, "recompute")


@pytest.mark.parametrize("shape_name", ["bt1", "3d", "noncontig", "all_ignored"])
def test_recompute_strategy_shapes(shape_name):
    check_case(shape_name, torch.bfloat16, "mean", "label_smoothing", "recompute")
