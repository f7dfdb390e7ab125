"""Behaviour of the public op: argument errors, edge cases, gradient switches, autocast, compile."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

import flce_compile
from flce_compile import FLCEConfig, FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from flce_compile.params import LossParams, decode_params, encode_params
from flce_compile.plan.config import config_overrides
from flce_reference import random_inputs as _inputs
from flce_reference import reference_loss

CFG = {"strategy": "torch", "chunk_tokens": 8}


@pytest.mark.parametrize(
    "mutate, exc, words",
    [
        (lambda x, w, t: (x[:, :-1], w, t, {}), ValueError, "hidden size"),
        (lambda x, w, t: (x, w, t[:-1], {}), ValueError, "target shape"),
        (lambda x, w, t: (x, w, t.float(), {}), TypeError, "integer class ids"),
        (lambda x, w, t: (x, w.double(), t, {}), TypeError, "weight dtype"),
        (lambda x, w, t: (x.bfloat16(), w, t, {}), TypeError, "differs from weight dtype"),
        (lambda x, w, t: (x, w, t, {"bias": torch.zeros(3)}), ValueError, "bias must have shape"),
        (lambda x, w, t: (x, w, t, {"reduction": "avg"}), ValueError, "reduction"),
        (lambda x, w, t: (x, w, t, {"label_smoothing": 1.5}), ValueError, "label_smoothing"),
        (lambda x, w, t: (x, w, t, {"softcap": 0.0}), ValueError, "softcap"),
        (lambda x, w, t: (x, w, t, {"softcap": -1.0}), ValueError, "softcap"),
        (lambda x, w, t: (x, w, t, {"ce_weight": torch.ones(3)}), ValueError, "ce_weight"),
        (lambda x, w, t: (x, w, t, {"accum_dtype": torch.int32}), TypeError, "accum_dtype"),
        (lambda x, w, t: (x, w[0], t, {}), ValueError, "weight must be 2-D"),
        # Wrong Python types: the argument named, not a comparison's or attribute's error from inside.
        (lambda x, w, t: (None, w, t, {}), TypeError, "input, weight and target must be tensors"),
        (lambda x, w, t: (x, w, t, {"bias": 1.0}), TypeError, "bias must be a tensor"),
        (lambda x, w, t: (x, w, t, {"ce_weight": [1.0] * 40}), TypeError, "ce_weight must be a floating tensor"),
        (lambda x, w, t: (x, w, t, {"label_smoothing": "0.1"}), TypeError, "label_smoothing must be a float"),
        (lambda x, w, t: (x, w, t, {"label_smoothing": None}), TypeError, "label_smoothing must be a float"),
        (lambda x, w, t: (x, w, t, {"softcap": "30"}), TypeError, "softcap must be a float"),
        (lambda x, w, t: (x, w, t, {"z_loss": "a"}), TypeError, "z_loss must be a float"),
        (lambda x, w, t: (x, w, t, {"logit_scale": "a"}), TypeError, "logit_scale must be a float"),
        (lambda x, w, t: (x, w, t, {"accum_dtype": "float32"}), TypeError, "accum_dtype must be a floating torch.dtype"),
    ],
)
def test_bad_arguments_name_the_argument(mutate, exc, words):
    x, w, t, kwargs = mutate(*_inputs())
    with pytest.raises(exc, match=words):
        fused_linear_cross_entropy(x, w, t, **kwargs)


@pytest.mark.parametrize("grad", [False, True])
def test_none_in_a_tensors_place_is_named_on_the_shortcut_path_too(monkeypatch, grad):
    """With grad on, a call goes through the eager shortcut's key first, which must leave a None to the full
    path's message (it read ``input.is_cuda`` and raised an AttributeError)."""
    from flce_compile import graph_replay

    monkeypatch.setattr(graph_replay, "replays_on", lambda cuda: True)  # as on a GPU: the key is worked out
    x, w, t = _inputs()
    for args in ((None, w, t), (x, None, t), (x, w, None)):
        with torch.set_grad_enabled(grad), pytest.raises(TypeError, match="input, weight and target must be "
                                                                           "tensors"):
            fused_linear_cross_entropy(*args)


def test_class_weights_that_require_grad_are_refused_as_torch_refuses_them():
    x, w, t = _inputs()
    ce_weight = torch.rand(w.shape[0], requires_grad=True)
    with pytest.raises(RuntimeError):
        F.cross_entropy(x @ w.T, t, weight=ce_weight)
    with pytest.raises(TypeError, match=r"ce_weight requires grad.*ce_weight.detach\(\)"):
        fused_linear_cross_entropy(x, w, t, ce_weight=ce_weight)
    loss = fused_linear_cross_entropy(x, w, t, ce_weight=ce_weight.detach())
    torch.testing.assert_close(loss, reference_loss(x, w, t, ce_weight=ce_weight.detach()))
    with torch.no_grad():  # torch takes them there (an eval loop), and so do we
        torch.testing.assert_close(fused_linear_cross_entropy(x, w, t, ce_weight=ce_weight), loss)
        F.cross_entropy(x @ w.T, t, weight=ce_weight)


@pytest.mark.parametrize("options, exc, words", [
    ({"reduction": "bogus"}, ValueError, "reduction='bogus' is unknown"),
    ({"label_smoothing": 5}, ValueError, "label_smoothing=5 must lie in"),
    ({"label_smoothing": "0.1"}, TypeError, "label_smoothing must be a float"),
    ({"softcap": -1.0}, ValueError, "softcap"),
    ({"z_loss": -1.0}, ValueError, "z_loss"),
    ({"ignore_index": 1.5}, TypeError, "ignore_index"),
    ({"config": {"chunk_tokens": 0}}, ValueError, "chunk_tokens=0"),
    ({"precision": "fast"}, ValueError, "precision='fast' is unknown"),
    ({"accum_dtype": "float32"}, TypeError, "accum_dtype must be a floating torch.dtype"),
    ({"accum_dtype": torch.int32}, TypeError, "accum_dtype must be a floating torch.dtype"),
    ({"memory_budget_gb": -1}, ValueError, "memory_budget_gb=-1"),
    ({"ce_weight": torch.ones(2, 2)}, ValueError, "ce_weight must be a 1-D floating tensor"),
])
def test_the_loss_module_checks_its_options_where_it_is_built(options, exc, words):
    with pytest.raises(exc, match=words):
        FusedLinearCrossEntropyLoss(**options)


def test_the_loss_module_with_good_options_runs_as_the_function():
    x, w, t = _inputs()
    options = dict(label_smoothing=0.1, z_loss=1e-3, softcap=20.0, config=CFG, accum_dtype=torch.float32)
    torch.testing.assert_close(FusedLinearCrossEntropyLoss(**options)(x, w, t),
                               fused_linear_cross_entropy(x, w, t, **options))


def test_device_mismatch_is_reported():
    x, w, t = _inputs()
    with pytest.raises(ValueError, match="one device"):
        fused_linear_cross_entropy(x, w, t.to("meta"))


def test_out_of_range_target_raises_on_cpu():
    """A ValueError, and the IndexError eager's F.cross_entropy raises (code catching either around the loss
    behaves as it did unfused)."""
    x, w, t = _inputs()
    t[4] = 40
    with pytest.raises(ValueError, match="outside"):
        fused_linear_cross_entropy(x, w, t)
    t[4] = -7
    with pytest.raises(IndexError, match="outside"):
        fused_linear_cross_entropy(x, w, t)
    with pytest.raises(IndexError):
        F.cross_entropy(x @ w.T, t)
    with pytest.raises(flce_compile.TargetError):
        fused_linear_cross_entropy(x, w, t)


def test_gpu_targets_are_checked_exactly_while_flce_debug_is_1(monkeypatch):
    """$FLCE_DEBUG is read on every call (the op reads the dict behind ``os.environ``, not ``os.environ.get``):
    set, changed and unset while the process runs, as the GPU test of the check does it."""
    from flce_compile.op import targets_checked

    monkeypatch.delenv("FLCE_DEBUG", raising=False)
    assert targets_checked(True) and not targets_checked(False)
    monkeypatch.setenv("FLCE_DEBUG", "1")
    assert targets_checked(False)
    monkeypatch.setenv("FLCE_DEBUG", "0")
    assert not targets_checked(False)
    monkeypatch.setenv("FLCE_DEBUG", "1")
    monkeypatch.delenv("FLCE_DEBUG")
    assert not targets_checked(False)
    monkeypatch.setattr(os, "environ", {"FLCE_DEBUG": "1"})  # os.environ replaced as a whole
    assert targets_checked(False)


def test_bad_config_is_reported():
    x, w, t = _inputs()
    with pytest.raises(ValueError, match="valid keys"):
        fused_linear_cross_entropy(x, w, t, config={"chunk": 4})
    with pytest.raises(ValueError, match="strategy"):
        fused_linear_cross_entropy(x, w, t, config={"strategy": "magic"})
    with pytest.raises(ValueError, match="power of two"):
        FLCEConfig(block_v=100)
    with pytest.raises(ValueError, match="num_warps=64 must be at most 32"):  # not Triton's launch error
        FLCEConfig(num_warps=64)


def test_a_triton_strategy_off_the_gpu_names_the_strategy_and_the_fix(monkeypatch):
    """Without Triton's interpreter a forced "triton" strategy cannot run on the CPU: the error says so before
    any launch (Triton's own is "0 active drivers"); "recompute" runs its torch step there."""
    monkeypatch.delenv("TRITON_INTERPRET")
    x, w, t = _inputs()
    x, w = x[:5], w[:29]  # shapes of its own: a config memoised by another test is not asked again
    for config in ({"strategy": "triton"}, FLCEConfig(strategy="triton")):
        with pytest.raises(ValueError, match='strategy "triton" launches a Triton kernel.*use strategy "torch"'):
            fused_linear_cross_entropy(x, w, t[:5] % 29, config=config)
    expected = fused_linear_cross_entropy(x, w, t[:5] % 29)
    assert torch.equal(fused_linear_cross_entropy(x, w, t[:5] % 29, config={"strategy": "recompute"}), expected)


@pytest.mark.parametrize("reduction, expected", [("mean", math.nan), ("sum", 0.0)])
def test_empty_input_behaves_like_torch(reduction, expected):
    x, w, _ = _inputs(n=0)
    x.requires_grad_()
    t = torch.empty(0, dtype=torch.long)
    loss = fused_linear_cross_entropy(x, w, t, reduction=reduction)
    ref = F.cross_entropy(x @ w.T, t, reduction=reduction)
    assert (math.isnan(loss.item()) and math.isnan(ref.item())) or loss.item() == ref.item() == expected
    loss.backward()
    assert x.grad.shape == x.shape
    none = fused_linear_cross_entropy(x, w, t, reduction="none")
    assert none.shape == (0,)


def test_all_ignored_mean_is_nan_and_grads_zero():
    x, w, t = _inputs()
    t.fill_(-100)
    x.requires_grad_()
    loss = fused_linear_cross_entropy(x, w, t, config=CFG)
    assert math.isnan(loss.item()) and math.isnan(F.cross_entropy(x @ w.T, t).item())
    assert fused_linear_cross_entropy(x, w, t, reduction="sum").item() == 0.0


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_input_propagates(bad):
    x, w, t = _inputs()
    x[3, 2] = bad
    per_token = fused_linear_cross_entropy(x, w, t, reduction="none", config=CFG)
    assert not torch.isfinite(per_token[3])
    assert torch.isfinite(per_token[torch.arange(20) != 3]).all()
    assert not math.isfinite(fused_linear_cross_entropy(x, w, t).item())


def test_no_grad_and_nothing_requiring_grad_give_the_loss_only():
    x, w, t = _inputs()
    ref = reference_loss(x, w, t)
    with torch.no_grad():
        xg = x.clone().requires_grad_()
        loss = fused_linear_cross_entropy(xg, w, t)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, ref)
    plain = fused_linear_cross_entropy(x, w, t)
    assert not plain.requires_grad
    torch.testing.assert_close(plain, ref)


@pytest.mark.parametrize("frozen", ["weight", "input"])
def test_frozen_weight_or_input(frozen):
    x, w, t = _inputs()
    x.requires_grad_(frozen != "input")
    w.requires_grad_(frozen != "weight")
    loss = fused_linear_cross_entropy(x, w, t, config=CFG)
    loss.backward()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    reference_loss(xr, wr, t).backward()
    if frozen == "weight":
        assert w.grad is None
        torch.testing.assert_close(x.grad, xr.grad)
    else:
        assert x.grad is None
        torch.testing.assert_close(w.grad, wr.grad)


def test_grad_output_scales_the_gradients():
    x, w, t = _inputs()
    x.requires_grad_()
    (fused_linear_cross_entropy(x, w, t) * 0.37).backward()
    xr = x.detach().clone().requires_grad_()
    (reference_loss(xr, w, t) * 0.37).backward()
    torch.testing.assert_close(x.grad, xr.grad)


def test_second_backward_fails_loudly_instead_of_double_scaling():
    x, w, t = _inputs()
    x.requires_grad_()
    loss = fused_linear_cross_entropy(x, w, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError):
        loss.backward()


def test_bias_gradient():
    x, w, t = _inputs()
    b = torch.randn(40, requires_grad=True)
    fused_linear_cross_entropy(x, w, t, b, config=CFG).backward()
    br = b.detach().clone().requires_grad_()
    reference_loss(x, w, t, br).backward()
    torch.testing.assert_close(b.grad, br.grad)


def test_autocast_bf16_matches_eager_autocast():
    x, w, t = _inputs(n=64, h=32, v=96)
    x.requires_grad_()
    w.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(x, w, t, config=CFG)
    loss.backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(xr, wr).float(), t)
    ref.backward()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    F.cross_entropy(x64 @ w64.T, t).backward()
    for ours, eager, exact in ((x.grad, xr.grad, x64.grad), (w.grad, wr.grad, w64.grad)):
        assert (ours.double() - exact).norm() <= (eager.double() - exact).norm() * 1.05 + 1e-6


@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float16])
def test_autocast_takes_16_bit_hidden_states_beside_an_fp32_head(hidden_dtype):
    """Hidden states out of an autocast matmul are 16-bit beside an fp32 lm_head, which F.linear casts under
    autocast; the op refused them ("differs from weight dtype ... or run under torch.autocast") while it did."""
    x, w, t = _inputs(n=64, h=32, v=96)
    h = x.to(hidden_dtype).requires_grad_()
    w.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(h, w, t, config=CFG)
    loss.backward()
    hr, wr = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(hr, wr).float(), t)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    assert h.grad.dtype == hidden_dtype and w.grad.dtype == torch.float32
    torch.testing.assert_close(h.grad, hr.grad)
    torch.testing.assert_close(w.grad, wr.grad)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match="autocast leaves fp64"):
        fused_linear_cross_entropy(x.double(), w, t)  # autocast leaves fp64 alone: still two dtypes
    b = torch.randn(96, dtype=torch.float16)  # a bias of a third dtype: F.linear casts it too
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(fused_linear_cross_entropy(h, w, t, b, config=CFG),
                                   F.cross_entropy(F.linear(h, w, b).float(), t))


@pytest.mark.parametrize("autocast", [False, True])
def test_dtype_errors_suggest_only_a_fix_that_works(autocast):
    """An fp64 input beside an fp32 weight was told to "run under torch.autocast", which leaves fp64 as it is
    (and then refuses it), and an integer weight under autocast was told that "autocast leaves fp64 tensors as
    they are": the weight's own dtype, unsupported, went unnamed."""
    x, w, t = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with pytest.raises(TypeError, match="autocast leaves fp64") as fp64:
            fused_linear_cross_entropy(x.double(), w, t)
        assert "run under torch.autocast" not in str(fp64.value)
        for dtype in (torch.int64, torch.bool):
            with pytest.raises(TypeError, match=f"weight dtype {dtype} is unsupported"):
                fused_linear_cross_entropy(x, w.to(dtype), t)


def test_uint64_targets_are_refused_not_wrapped():
    """uint64 class ids were cast to int64, where 2**64 - 100 wraps to -100: an out-of-range id silently became
    ignore_index (and 2**63 + 1 was reported as a negative id). F.cross_entropy refuses uint64 targets too."""
    x, w, t = _inputs()
    wrapped = t.to(torch.uint64)
    wrapped[0] = torch.tensor(2**64 - 100, dtype=torch.uint64)
    with pytest.raises(TypeError, match="target dtype torch.uint64 is unsupported"):
        fused_linear_cross_entropy(x, w, wrapped)
    for dtype in (torch.uint8, torch.int32):  # ids that convert exactly are still taken
        torch.testing.assert_close(fused_linear_cross_entropy(x, w, t.to(dtype)), fused_linear_cross_entropy(x, w, t))


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("reduction, config", [("none", CFG), ("mean", {**CFG, "strategy": "recompute"})])
def test_batched_grad_outputs_reach_the_backward_computed_in_backward(reduction, config):
    """``is_grads_batched=True`` (and ``jacobian(vectorize=True)``) batch grad_output by autograd's own vmap, whose
    tensors are no functorch wrappers: the direct backward ran on them and failed in ``mul_`` ("vmap: aten::mul_
    ... is not possible") for a backward that recomputes the logits ("none", the recompute strategy)."""
    x, w, t = _inputs()
    x, w = x.double().requires_grad_(), w.double().requires_grad_()
    loss = fused_linear_cross_entropy(x, w, t, reduction=reduction, config=config)
    ref = F.cross_entropy(F.linear(x, w), t, reduction=reduction)
    go = torch.randn(3, *ref.shape, dtype=torch.float64)
    ours = torch.autograd.grad(loss, [x, w], go, is_grads_batched=True)
    theirs = torch.autograd.grad(ref, [x, w], go, is_grads_batched=True)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", [CFG, {"strategy": "recompute", "chunk_tokens": 8, "vocab_block": 32}])
def test_an_fp32_bias_beside_16_bit_weights_promotes_the_logits(dtype, config):
    """An fp32 bias beside bf16/fp16 weights (BART's final_logits_bias under autocast, folded by the backend) is
    added to fp32 logits, as ``F.linear(x, w) + bias`` promotes them: the loss and gradients are nearer fp64 than
    eager's (which rounds the GEMM's output first). It used to be refused as a dtype mismatch."""
    x, w, t = _inputs(n=48, h=16, v=96, dtype=dtype)
    b = torch.randn(96) * 3
    x.requires_grad_()
    w.requires_grad_()
    loss = fused_linear_cross_entropy(x, w, t, b, config=config)
    loss.backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == dtype and w.grad.dtype == dtype
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = F.cross_entropy(F.linear(xr, wr) + b, t)
    ref.backward()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    exact = F.cross_entropy(x64 @ w64.T + b.double(), t)
    exact.backward()
    assert abs(loss.double() - exact) <= abs(ref.double() - exact) + 1e-7
    for ours, eager, want in ((x.grad, xr.grad, x64.grad), (w.grad, wr.grad, w64.grad)):
        assert (ours.double() - want).norm() <= (eager.double() - want).norm() * 1.05 + 1e-6


def test_an_fp32_bias_beside_16_bit_weights_is_refused_when_it_needs_a_gradient_or_another_dtype():
    """Its gradient would sum 16-bit logit gradients where eager sums fp32 ones, so a bias that requires grad is
    an error naming the fixes, as is return_logits (the op's logits are in the compute dtype, unpromoted); a bias of any other dtype is an error naming the two that are accepted. Under
    autocast the bias is cast with the weight, as F.linear casts it."""
    x, w, t = _inputs(n=8, h=16, v=96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="requires grad is not supported.*bias.detach"):
        fused_linear_cross_entropy(x, w, t, torch.zeros(96, requires_grad=True))
    with torch.no_grad():
        fused_linear_cross_entropy(x, w, t, torch.zeros(96, requires_grad=True))  # no gradient asked: runs
    with pytest.raises(ValueError, match=r"return_logits=True with an fp32 bias beside torch.bfloat16 weights"):
        fused_linear_cross_entropy(x, w, t, torch.zeros(96), return_logits=True)  # (its logits would be bf16)
    with pytest.raises(TypeError, match=r"in weight's dtype \(torch.bfloat16\), or float32 beside bf16/fp16"):
        fused_linear_cross_entropy(x, w, t, torch.zeros(96, dtype=torch.float64))
    with pytest.raises(TypeError, match="or float32 beside bf16/fp16"):
        fused_linear_cross_entropy(x.float(), w.float(), t, torch.zeros(96, dtype=torch.bfloat16))
    b = torch.randn(96, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(x, w, t, b, config=CFG)
        ref = F.cross_entropy(F.linear(x, w, b).float(), t)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    loss.backward()
    assert b.grad is not None and b.grad.dtype == torch.float32


def test_accum_dtype_bf16_runs_and_is_close():
    x, w, t = _inputs(dtype=torch.bfloat16)
    w.requires_grad_()
    fused_linear_cross_entropy(x, w, t, accum_dtype=torch.bfloat16, config=CFG).backward()
    wr = w.detach().clone().requires_grad_()
    reference_loss(x, wr, t).backward()
    assert (w.grad.float() - wr.grad.float()).norm() <= 2e-2 * wr.grad.float().norm()


def _grads_of(precision, config, dtype=torch.bfloat16, **kw):
    x, w, t = _inputs(n=40, h=16, v=96, dtype=dtype)
    x.requires_grad_()
    w.requires_grad_()
    loss = fused_linear_cross_entropy(x, w, t, precision=precision, config=config, **kw)
    loss.backward()
    return loss, x.grad, w.grad


def test_precision_policies_are_checked():
    """"precise" is accepted; an unknown policy, or an accum_dtype that contradicts one, is an error that names
    the argument and what to pass instead."""
    x, w, t = _inputs(dtype=torch.bfloat16)
    assert torch.isfinite(fused_linear_cross_entropy(x, w, t, precision="precise"))
    with pytest.raises(ValueError, match=r"precision='fast' is unknown; use one of \('exact', 'compact', 'precise'\)"):
        fused_linear_cross_entropy(x, w, t, precision="fast")
    with pytest.raises(ValueError, match="precision='precise' accumulates in fp32.*drop accum_dtype"):
        fused_linear_cross_entropy(x, w, t, precision="precise", accum_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="valid options"):
        FusedLinearCrossEntropyLoss(precison="precise")
    loss_fn = FusedLinearCrossEntropyLoss(precision="precise")
    torch.testing.assert_close(loss_fn(x, w, t), fused_linear_cross_entropy(x, w, t, precision="precise"))


def test_precise_policy_wins_over_the_config_field():
    """precision="precise" is FLCEConfig.fp32_logits, laid over any config (an FLCEConfig forces every field,
    fp32_logits=False included); the field alone runs the same thing; "exact" differs from both (bf16)."""
    full = FLCEConfig(strategy="torch", chunk_tokens=16)
    by_policy = _grads_of("precise", full)
    by_field = _grads_of("exact", {"strategy": "torch", "chunk_tokens": 16, "fp32_logits": True})
    exact = _grads_of("exact", full)
    for a, b in zip(by_policy, by_field):
        assert torch.equal(a, b)
    assert not torch.equal(by_policy[2], exact[2])


def test_module_form_and_option_check():
    x, w, t = _inputs()
    loss_fn = FusedLinearCrossEntropyLoss(label_smoothing=0.1, reduction="sum")
    torch.testing.assert_close(loss_fn(x, w, t), reference_loss(x, w, t, label_smoothing=0.1, reduction="sum"))
    assert "label_smoothing=0.1" in repr(loss_fn)
    with pytest.raises(TypeError, match="valid options"):
        FusedLinearCrossEntropyLoss(smoothing=0.1)


@pytest.mark.parametrize("config", ["", '{"chunk_tokens": 8, "pad_vocab": true}', '{"pad_vocab": true}'])
def test_custom_op_is_registered(config):
    """opcheck, also with pad_vocab (V=40 fp32 pads to 64 rows), whose dW must not be a view of the padding: over
    chunks, and in one chunk (dW's V rows in two GEMMs, ``chunked._DwAccumulator``)."""
    assert hasattr(torch.ops.flce, "fused_linear_cross_entropy")
    assert hasattr(torch.ops.flce, "fused_linear_cross_entropy_backward")
    x, w, t = _inputs()
    torch.library.opcheck(
        torch.ops.flce.fused_linear_cross_entropy.default,
        (x, w.requires_grad_(), t, None, None, encode_params(LossParams()), torch.float32, False, True, False,
         config),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )
    out = torch.ops.flce.fused_linear_cross_entropy(x, w, t, None, None, encode_params(LossParams()), torch.float32,
                                                    False, True, False, config)
    dw = out[3]
    assert dw.shape == w.shape and dw._base is None and dw.untyped_storage().nbytes() == dw.numel() * 4


def test_fullgraph_compile_is_one_node_and_dynamic_in_tokens():
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(x, w, t):
        return fused_linear_cross_entropy(x, w, t, label_smoothing=0.1)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=capture, fullgraph=True, dynamic=True)
    for n in (17, 33, 50):
        x, w, t = _inputs(n=n)
        x.requires_grad_()
        loss = compiled(x, w, t)
        loss.backward()
        xr = x.detach().clone().requires_grad_()
        reference_loss(xr, w, t, label_smoothing=0.1).backward()
        torch.testing.assert_close(x.grad, xr.grad)
    assert len(graphs) == 1, f"recompiled: {len(graphs)} graphs for 3 token counts"
    ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("flce" in str(op) for op in ops) == 1, ops
    # Nothing the API asks at run time is left in the graph: torch 2.11's Dynamo cannot trace
    # torch._C._is_autocast_available and broke the graph there (fullgraph=False: two graphs, the API eager).
    assert torch._C._is_autocast_available not in ops, ops


def test_a_compiled_call_guards_on_no_eager_shortcut_state():
    """Dynamo guards on every global its trace reads, and checks the guards before each run of the user's
    compiled function: the API's eager-only bookkeeping (the replay shortcut it records) stays out of the trace."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    def step(x, w, t):
        return fused_linear_cross_entropy(x, w, t)

    torch._dynamo.reset()
    x, w, t = _inputs(n=16)
    torch.compile(step, backend="aot_eager", dynamic=False)(x.requires_grad_(), w, t).backward()
    guards = str(_debug_get_cache_entry_list(step.__code__)[0].guard_manager)
    assert "fused_linear_cross_entropy" in guards  # (the guards are those of this trace)
    assert "eager_shortcut" not in guards and "record_shortcut" not in guards


@pytest.mark.parametrize("config", [{"chunk_tokens": 16, "streams": False},
                                    FLCEConfig(strategy="torch", chunk_tokens=24), '{"chunk_tokens": 8}'])
def test_a_config_passed_inside_a_compiled_function_keeps_one_graph(config):
    """``config=`` inside the user's own torch.compile: encoded without the validation helpers Dynamo cannot
    trace (``dataclasses.asdict``, ``json.dumps``), into the text the eager call passes, and the same results."""
    from flce_compile.api import _config_text_while_tracing, config_arg

    assert _config_text_while_tracing(config) == (config if isinstance(config, str) else config_arg(config))
    x, w, t = _inputs(n=64, h=32, v=96)
    w.requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, t: fused_linear_cross_entropy(x, w, t, config=config),
                             backend="aot_eager", fullgraph=True)
    loss = compiled(x, w, t)
    loss.backward()
    torch._dynamo.reset()
    w_eager = w.detach().clone().requires_grad_()
    expected = fused_linear_cross_entropy(x, w_eager, t, config=config)
    expected.backward()
    assert torch.equal(loss, expected) and torch.equal(w.grad, w_eager.grad)


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
def test_a_config_passed_as_an_argument_traces_whole_when_its_ints_change(dynamic):
    """A config passed into a compiled function (or held in a closure) has ints Dynamo may make symbolic: under
    dynamic=True at once, by default after a call with another value. ``str`` of such an int cannot be traced
    (fullgraph=True raised); each value is now a constant of its graph, and a new value compiles again."""
    seen = []

    def capture(gm, example_inputs):
        seen.extend(n.args[10] for n in gm.graph.nodes if "fused_linear_cross_entropy" in str(n.target))
        return gm.forward

    def step(x, w, t, config):
        return fused_linear_cross_entropy(x, w, t, config=config)

    x, w, t = _inputs(n=40, h=16, v=96)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=capture, fullgraph=True, dynamic=dynamic)
    for chunk in (4, 8, 8, 2**40):  # (a huge value allocates nothing while it is specialized)
        config = {"chunk_tokens": chunk}
        torch.testing.assert_close(compiled(x, w, t, config), fused_linear_cross_entropy(x, w, t, config=config))
    assert seen == ['{"chunk_tokens": 4}', '{"chunk_tokens": 8}', '{"chunk_tokens": 1099511627776}'], seen


def test_a_config_on_the_module_keeps_one_graph_under_dynamic_true():
    """Under ``dynamic=True`` Dynamo makes a closure's captured ints symbolic (each value becomes a constant of
    its graph: ``api._constant_int``); a config held by the module traces whole as well."""

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = {"chunk_tokens": 8}

        def forward(self, x, w, t):
            return fused_linear_cross_entropy(x, w, t, config=self.config)

    x, w, t = _inputs(n=40, h=16, v=96)
    torch._dynamo.reset()
    loss = torch.compile(Head(), backend="aot_eager", fullgraph=True, dynamic=True)(x, w, t)
    torch.testing.assert_close(loss, fused_linear_cross_entropy(x, w, t, config={"chunk_tokens": 8}))


def test_a_config_subclass_with_fields_of_its_own_is_refused_inside_compile_too():
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class NotedConfig(FLCEConfig):
        note: str = "mine"

    x, w, t = _inputs(n=16, h=8, v=32)
    with pytest.raises(ValueError, match=r"config has unknown keys \['note'\]"):
        fused_linear_cross_entropy(x, w, t, config=NotedConfig())
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, t: fused_linear_cross_entropy(x, w, t, config=NotedConfig()),
                             backend="aot_eager")
    # Refused by the op while the graph is traced: Dynamo wraps the ValueError, whose message it shows.
    with pytest.raises(Exception, match=r"config has unknown keys \['note'\]"):
        compiled(x, w, t)
    torch._dynamo.reset()


@pytest.mark.parametrize("config, error, message", [
    ({"chunk_tokens": 0}, ValueError, "config.chunk_tokens=0 must be a positive int"),
    ({"chunk": 8}, ValueError, "config has unknown keys"),
    (8, TypeError, "config must be an FLCEConfig, a dict, a JSON object or None, got int"),
])
def test_a_bad_config_inside_a_compiled_function_raises_its_own_error(config, error, message):
    x, w, t = _inputs(n=16, h=8, v=32)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, t: fused_linear_cross_entropy(x, w, t, config=config), backend="aot_eager")
    with pytest.raises(error, match=message):
        compiled(x, w, t)
    torch._dynamo.reset()


def test_numpy_ints_in_a_config_and_dtypes_the_helpers_refuse():
    """Config fields take NumPy ints, as frozen_weight_columns does, held as plain ints (they were refused as not
    "a positive int"); choose_config and peak_bytes refuse a dtype that is no floating torch.dtype by name (a
    string raised AttributeError, an integer dtype was taken)."""
    import numpy as np

    from flce_compile import choose_config, peak_bytes

    x, w, t = _inputs(n=16, h=8, v=32)
    config = {"chunk_tokens": np.int64(4)}
    assert torch.equal(fused_linear_cross_entropy(x, w, t, config=config),
                       fused_linear_cross_entropy(x, w, t, config={"chunk_tokens": 4}))
    assert type(FLCEConfig(chunk_tokens=np.int32(8)).chunk_tokens) is int
    assert config_overrides(config) == {"chunk_tokens": 4} and type(config_overrides(config)["chunk_tokens"]) is int
    for dtype in ("bfloat16", torch.int32):
        with pytest.raises(TypeError, match=f"choose_config: dtype={dtype!r} must be a floating-point torch.dtype"):
            choose_config(100, 1000, 64, dtype, "cpu")
    with pytest.raises(TypeError, match="peak_bytes: dtype=torch.int64 must be a floating-point torch.dtype"):
        peak_bytes(FLCEConfig(), 100, 10, 64, torch.int64)


@pytest.mark.parametrize("known_at_import", [True, False])
def test_autocast_under_compile_casts_as_eager_autocast(known_at_import, monkeypatch):
    """Also for a device type the API did not list at import (a privateuse1 backend renamed later): it asks
    torch then, under compile too. A listed type compiles into one graph; an unlisted one may break the graph
    there (torch 2.11's Dynamo cannot trace the question; 2.13's can), with the same result."""
    from flce_compile import op

    if not known_at_import:
        monkeypatch.setattr(op, "_AUTOCAST_DEVICE_TYPES", ())
    x, w, t = _inputs(n=64, h=32, v=96)

    def step(x, w, t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fused_linear_cross_entropy(x, w, t)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=known_at_import)
    torch._dynamo.reset()
    assert torch.equal(compiled(x, w, t), step(x, w, t))
    unfused = F.cross_entropy(F.linear(x.bfloat16(), w.bfloat16()).float(), t)
    assert step(x, w, t).dtype == torch.float32 and torch.allclose(step(x, w, t), unfused, rtol=1e-3)
    assert not torch.allclose(step(x, w, t), F.cross_entropy(F.linear(x, w), t), rtol=1e-6, atol=0)


def test_loss_options_cross_the_op_as_one_string():
    """encode_params/decode_params round-trip exactly (huge ids, non-finite and long floats), the decode is
    memoised, and a malformed string from a direct op call is an error that shows the form."""
    p = LossParams(ignore_index=2**62 + 1, reduction="none", label_smoothing=0.1 + 0.2, softcap=30.0,
                   logit_scale=float("inf"), z_loss=1e-4)
    text = encode_params(p)
    assert text.startswith("ignore_index=4611686018427387905;reduction=none;label_smoothing=0.30000000000000004;")
    assert decode_params(text) == p and decode_params(text) is decode_params(text)
    assert math.isnan(decode_params(encode_params(LossParams(logit_scale=float("nan")))).logit_scale)
    x, w, t = _inputs()
    for bad in ("", "ignore_index=-100", encode_params(LossParams()).replace("z_loss=0.0", "z_loss=zero")):
        with pytest.raises(ValueError, match="loss options .* malformed"):
            torch.ops.flce.fused_linear_cross_entropy(x, w, t, None, None, bad, torch.float32, False, False, False, "")


def test_a_float_option_passed_to_a_compiled_function():
    """Options that arrive as arguments of a compiled function (which Dynamo makes symbolic once they vary)
    still become the op's constant string: one op node per graph and the right loss for every value."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, t, eps, z: fused_linear_cross_entropy(x, w, t, label_smoothing=eps,
                                                                                z_loss=z),
                             backend=capture, fullgraph=True)
    x, w, t = _inputs()
    for eps, z in ((0.1, 0.0), (0.2, 1e-3), (0.3, 2e-3)):
        torch.testing.assert_close(compiled(x, w, t, eps, z), fused_linear_cross_entropy(x, w, t, label_smoothing=eps,
                                                                                          z_loss=z))
    for gm in graphs:
        assert sum("flce" in str(n.target) for n in gm.graph.nodes if n.op == "call_function") == 1


def test_a_float_softcap_under_dynamic_shapes_traces_whole():
    """Under dynamic=True a float argument is symbolic from the first call, and ``math.isinf`` of it (the API's
    test for "no cap") stopped a fullgraph compile with Dynamo's "torch.* op returned non-Tensor"."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, t, cap: fused_linear_cross_entropy(x, w, t, softcap=cap),
                             backend="aot_eager", fullgraph=True, dynamic=True)
    x, w, t = _inputs()
    for cap in (3.0, math.inf):  # (inf: no cap)
        torch.testing.assert_close(compiled(x, w, t, cap), reference_loss(x, w, t, softcap=min(cap, 1e30)))


def test_aot_compile_runs_the_op_with_gradients():
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda x, w, t: fused_linear_cross_entropy(x, w, t, reduction="none").sum(),
        backend="aot_eager", fullgraph=True, dynamic=True)
    x, w, t = _inputs()
    x.requires_grad_()
    w.requires_grad_()
    compiled(x, w, t).backward()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    reference_loss(xr, wr, t, reduction="none").sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)
    assert flce_compile.__version__


def test_gradients_are_adopted_without_a_copy(monkeypatch):
    """The forward-computed dX/dW become .grad as they are: a copy would hold a second dW-sized buffer."""
    import flce_compile.op as op_module

    produced = {}
    original = op_module.fused_forward

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        produced["dx"], produced["dw"] = out[2].data_ptr(), out[3].data_ptr()
        return out

    monkeypatch.setattr(op_module, "fused_forward", spy)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, w, t = (a.to(device) for a in _inputs(dtype=torch.bfloat16))
    x.requires_grad_()
    w.requires_grad_()
    fused_linear_cross_entropy(x, w, t, accum_dtype=torch.bfloat16).backward()
    assert x.grad.data_ptr() == produced["dx"]
    assert w.grad.data_ptr() == produced["dw"]


def test_grad_output_scaling_is_the_same_compiled_and_eager():
    """bf16 gradients scaled by a grad_output that bf16 cannot represent: eager (in place) and compiled
    (functional) backward scale in fp32 and round once, so they agree bit for bit."""
    x, w, t = _inputs(n=64, h=32, v=96, dtype=torch.bfloat16)
    grads = []
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, t: fused_linear_cross_entropy(x, w, t) / 3.0, backend="aot_eager",
                             fullgraph=True)
    for fn in (lambda x, w, t: fused_linear_cross_entropy(x, w, t) / 3.0, compiled):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        fn(xg, wg, t).backward()
        grads.append((xg.grad, wg.grad))
    for eager, comp in zip(*grads):
        assert torch.equal(eager, comp)


def test_heuristic_chunks_fit_their_logits_budget():
    from flce_compile.plan.choose import heuristic_config

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    for vocab in (32000, 50257, 128256, 151936, 256000):
        for device, budget in ((gpu, 512 * 2**20), (cpu, 64 * 2**20)):
            cfg = heuristic_config(16384, vocab, 4096, torch.bfloat16, device)
            assert cfg.chunk_tokens % 256 == 0 and 256 <= cfg.chunk_tokens <= 8192
            assert cfg.chunk_tokens * vocab * 2 <= budget or cfg.chunk_tokens == 256
    assert heuristic_config(16384, 128256, 4096, torch.bfloat16, gpu).chunk_tokens == 2048
    assert heuristic_config(16384, 128256, 4096, torch.bfloat16, gpu).strategy == "triton"
    assert heuristic_config(16384, 128256, 4096, torch.bfloat16, cpu).strategy == "torch"
    assert heuristic_config(100, 128256, 4096, torch.bfloat16, gpu).chunk_tokens == 256  # not above the tokens' need
    # The GPU default pads an odd V only (aligned GEMMs); the CPU default never copies the weight.
    assert heuristic_config(4096, 50257, 768, torch.bfloat16, gpu).pad_vocab
    assert not heuristic_config(4096, 128256, 768, torch.bfloat16, gpu).pad_vocab
    assert not heuristic_config(4096, 50257, 768, torch.bfloat16, cpu).pad_vocab


def test_chunk_gemms_reduce_in_full_precision_and_restore_the_flags():
    """On CUDA a multi-chunk loop forbids bf16/fp16 split-K reductions (they cost exactness on the H200) and
    puts the user's flags back afterwards, also after an error. The flags are host state, so this runs without a GPU."""
    from flce_compile.strategies.chunked import full_precision_gemm_reductions

    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction)
    try:
        matmul.allow_bf16_reduced_precision_reduction = matmul.allow_fp16_reduced_precision_reduction = True
        with pytest.raises(RuntimeError, match="inside"):
            with full_precision_gemm_reductions(torch.device("cuda")):
                assert not matmul.allow_bf16_reduced_precision_reduction
                assert not matmul.allow_fp16_reduced_precision_reduction
                raise RuntimeError("inside")
        assert matmul.allow_bf16_reduced_precision_reduction and matmul.allow_fp16_reduced_precision_reduction
        with full_precision_gemm_reductions(torch.device("cpu")):
            assert matmul.allow_bf16_reduced_precision_reduction  # the CPU path leaves them alone
        with full_precision_gemm_reductions(torch.device("cuda"), chunked=False):
            assert matmul.allow_bf16_reduced_precision_reduction  # one chunk: eager's own GEMMs and flags
    finally:
        matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = saved


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_a_softcap_tensor_is_read_at_run_time(reduction):
    """A 0-dim CPU tensor softcap (how the backend passes one Dynamo left symbolic) gives the float's results bit
    for bit, its magnitude for a negative value (``c * tanh(s / c)`` caps at |c|), and the value it holds at each
    call; per-token losses recompute in backward with it too. Through the dispatcher alike (opcheck)."""
    x, w, t = _inputs()
    cap = torch.tensor(-3.0, dtype=torch.float64)

    def run(softcap):
        xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        loss = fused_linear_cross_entropy(xr, wr, t, softcap=softcap, reduction=reduction)
        loss.sum().backward()
        return loss.detach(), xr.grad, wr.grad

    for expected, got in zip(run(3.0), run(cap)):
        assert torch.equal(expected, got)
    cap.fill_(5.0)  # changed in place: the next call reads 5
    for expected, got in zip(run(5.0), run(cap)):
        assert torch.equal(expected, got)
    torch.testing.assert_close(run(cap)[0], reference_loss(x, w, t, softcap=5.0, reduction=reduction))
    params = encode_params(LossParams(reduction=reduction, softcap=1.0))
    torch.library.opcheck(
        torch.ops.flce.fused_linear_cross_entropy.default,
        (x, w.requires_grad_(), t, None, None, params, torch.float32, False, True, False, "", cap),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )


def test_a_bad_softcap_tensor_is_refused():
    x, w, t = _inputs()
    for bad, error, match in ((torch.tensor([2.0]), ValueError, "0-dim floating CPU tensor"),
                              (torch.tensor(2), ValueError, "0-dim floating CPU tensor"),
                              (torch.tensor(2.0, requires_grad=True), TypeError, "softcap.detach"),
                              (torch.tensor(0.0), ValueError, "softcap read at run time is 0.0"),
                              (torch.tensor(float("inf")), ValueError, "softcap read at run time is inf"),
                              (torch.tensor(float("nan")), ValueError, "softcap read at run time is nan")):
        with pytest.raises(error, match=match):
            fused_linear_cross_entropy(x, w, t, softcap=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_a_backward_through_the_returned_logits_first_leaves_the_loss_its_own(dtype):
    """An auxiliary loss on the returned logits backpropagated first (retain_graph=True), then the loss: eager's
    gradients. The first backward released the loss's gradients, and the second raised "backward ran twice";
    gradcheck, which asks one output at a time, failed the same way in fp64."""
    x0, w0, t = (v.to(dtype) if v.is_floating_point() else v for v in _inputs(n=10, h=6, v=7))
    results = []
    for fused in (True, False):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        if fused:
            loss, logits = fused_linear_cross_entropy(x, w, t, return_logits=True)
        else:
            logits = F.linear(x, w)
            loss = F.cross_entropy(logits, t)
        (1e-3 * logits.square().mean()).backward(retain_graph=True)
        loss.backward()
        results.append((x.grad, w.grad))
    for ours, eager in zip(*results):
        torch.testing.assert_close(ours, eager)
    if dtype == torch.float64:
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        assert torch.autograd.gradcheck(lambda a, b: fused_linear_cross_entropy(a, b, t, return_logits=True),
                                        (x, w))
