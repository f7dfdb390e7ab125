"""The "recompute" strategy's pieces: the CE step over a slice of the classes (both backends) equals the same
columns of the whole row's step, the strategy keeps no V x H buffer, its memory bound, and its registry entry."""

from __future__ import annotations

import pytest
import torch

from flce_compile import FLCEConfig, fused_linear_cross_entropy, peak_bytes
from flce_compile.params import LossParams
from flce_compile.plan import registry
from flce_compile.strategies.ce_common import CEStepArgs
from flce_compile.strategies.ce_torch import ce_step_torch
from flce_compile.strategies.ce_triton import ce_step_triton
from flce_reference import random_inputs

STEPS = {"torch": ce_step_torch, "triton": ce_step_triton}


def _args(logits, target, ce_weight, lse, grad_out, offset=0, classes=None):
    rows = logits.shape[0]
    scale = torch.full((rows,), 0.37)
    weight_sum = ce_weight.sum() if ce_weight is not None else torch.tensor(float(classes or logits.shape[1]))
    return CEStepArgs(logits=logits, target=target, ce_weight=ce_weight, weight_sum=weight_sum, ce_scale=scale,
                      z_scale=scale * 0.5, loss_out=None, lse_out=None, lse_in=lse, write_grad=True,
                      grad_out=grad_out, class_offset=offset, num_classes=classes)


@pytest.mark.parametrize("backend", list(STEPS))
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.2, "z_loss": 1e-3}, {"softcap": 3.0, "logit_scale": 0.8}])
@pytest.mark.parametrize("weighted", [False, True])
def test_slices_of_the_classes_match_the_whole_row(backend, options, weighted):
    g = torch.Generator().manual_seed(0)
    rows, vocab = 9, 70
    logits = torch.randn(rows, vocab, generator=g) * 3
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[2] = -100
    ce_weight = torch.rand(vocab, generator=g) + 0.5 if weighted else None
    p = LossParams(label_smoothing=options.get("label_smoothing", 0.0), z_loss=options.get("z_loss", 0.0),
                   softcap=options.get("softcap", 0.0), logit_scale=options.get("logit_scale", 1.0))
    z = logits * p.logit_scale
    z = p.softcap * torch.tanh(z / p.softcap) if p.softcap else z
    lse = torch.logsumexp(z, dim=1)
    step = STEPS[backend]
    config = FLCEConfig(strategy=backend, block_v=16, num_warps=1)
    whole = torch.empty_like(logits)
    step(_args(logits, target, ce_weight, lse, whole), p, config)
    for start in range(0, vocab, 24):  # slices of 24, 24 and 22 classes
        stop = min(start + 24, vocab)
        part = torch.empty(rows, stop - start)
        step(_args(logits[:, start:stop], target, ce_weight, lse, part, start, vocab), p, config)
        torch.testing.assert_close(part, whole[:, start:stop], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", list(STEPS))
@pytest.mark.parametrize("options", [{}, {"softcap": 30.0, "logit_scale": 1.1}])
def test_the_targets_probability_comes_from_the_forwards_z(backend, options):
    """Backward's logits, recomputed in other GEMMs, can round a few ulps apart from the forward's; at a confident
    row's target that is more than its 1 - p. With the forward's target z (``target_z_out`` there,
    ``target_z_in`` here) the target's gradient is the one of the forward's logits; from the logits at hand it
    was off by the ulps (found 2026-12-04: dX 6-11x eager's error with vocabulary blocks that did not divide the
    shard)."""
    g = torch.Generator().manual_seed(0)
    rows, vocab = 6, 40
    logits = torch.randn(rows, vocab, generator=g)
    target = torch.tensor([10, 20, 30, 39, 3, -100])
    cols = torch.arange(5)
    logits[cols, target[:5]] += 16.0  # confident rows: 1 - p about 1e-5
    p = LossParams(softcap=options.get("softcap", 0.0), logit_scale=options.get("logit_scale", 1.0))
    config = FLCEConfig(strategy=backend, block_v=16, num_warps=1)
    step = STEPS[backend]
    kept = torch.full((2, rows), float("nan"), dtype=torch.float64)  # as ``chunked.kept_rows``
    forward = CEStepArgs(**{**_args(logits, target, None, None, None).__dict__, "write_grad": False,
                            "loss_out": torch.empty(rows), "lse_out": kept[0], "target_z_out": kept[1]})
    step(forward, p, config)
    nudged = logits.clone()
    for r in range(5):  # four ulps up at the target
        for _ in range(4):
            nudged[r, target[r]] = torch.nextafter(nudged[r, target[r]], torch.tensor(1e9))

    def grad(lgts, target_z):
        out = torch.empty(rows, vocab)
        args = CEStepArgs(**{**_args(lgts, target, None, kept[0], out).__dict__, "target_z_in": target_z})
        step(args, p, config)
        return out

    exact = grad(logits, None)  # from the forward's own logits
    at_target = (cols, target[:5])
    got = grad(nudged, kept[1])
    torch.testing.assert_close(got[at_target], exact[at_target], rtol=1e-6, atol=0.0)
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-9)  # the rest: the nudged logits' relative change
    lost = grad(nudged, None)[at_target] - exact[at_target]
    assert float(lost.abs().max()) > 100 * float((got[at_target] - exact[at_target]).abs().max())


@pytest.mark.parametrize("backend", list(STEPS))
@pytest.mark.parametrize("options", [{}, {"softcap": 30.0, "logit_scale": 1.1}])
def test_the_largest_class_probability_comes_from_the_forwards_z(backend, options):
    """The same for a confident wrong class, the row's largest z and not its target: its p near 1 took the
    recomputed logit's ulps whole (an H100, fp32, backward blocks of 1000: dX 32x eager's error at margins of 24,
    found 2026-12-06). The forward keeps the row's largest z and its class (``top_out``); backward's step takes
    them (``top_in``), in whichever slice of the classes holds that class, and no other slice changes."""
    g = torch.Generator().manual_seed(0)
    rows, vocab = 6, 40
    logits = torch.randn(rows, vocab, generator=g)
    target = torch.tensor([10, 20, 30, 39, 3, -100])
    wrong = torch.tensor([11, 0, 35, 2, 39])
    cols = torch.arange(5)
    logits[cols, wrong] += 16.0  # confident rows, each sure of another class than its target
    p = LossParams(softcap=options.get("softcap", 0.0), logit_scale=options.get("logit_scale", 1.0))
    config = FLCEConfig(strategy=backend, block_v=16, num_warps=1)
    step = STEPS[backend]
    kept = torch.full((4, rows), float("nan"), dtype=torch.float64)  # as ``chunked.kept_rows``
    forward = CEStepArgs(**{**_args(logits, target, None, None, None).__dict__, "write_grad": False,
                            "loss_out": torch.empty(rows), "lse_out": kept[0], "target_z_out": kept[1],
                            "top_out": kept[2:]})
    step(forward, p, config)
    z = logits * p.logit_scale
    z = p.softcap * torch.tanh(z / p.softcap) if p.softcap else z
    assert torch.equal(kept[3, :5], wrong.double())
    torch.testing.assert_close(kept[2], z.max(dim=1).values.double(), rtol=1e-6, atol=0.0)
    nudged = logits.clone()
    for r in range(5):  # four ulps up at the confident wrong class
        for _ in range(4):
            nudged[r, wrong[r]] = torch.nextafter(nudged[r, wrong[r]], torch.tensor(1e9))

    def grad(lgts, top, start=0, stop=vocab):
        out = torch.empty(rows, stop - start)
        args = CEStepArgs(**{**_args(lgts[:, start:stop].contiguous(), target, None, kept[0], out, start,
                                     vocab).__dict__, "target_z_in": kept[1], "top_in": top})
        step(args, p, config)
        return out

    exact = grad(logits, None)  # from the forward's own logits
    at_wrong = (cols, wrong)
    got = grad(nudged, kept[2:])
    torch.testing.assert_close(got[at_wrong], exact[at_wrong], rtol=1e-6, atol=0.0)
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-9)
    lost = grad(nudged, None)[at_wrong] - exact[at_wrong]
    # (a softcap's derivative, 1 - tanh^2, still reads the recomputed logit: an fp32 ulp of the entry is left)
    assert float(lost.abs().max()) > 10 * float((got[at_wrong] - exact[at_wrong]).abs().max())
    # by slices of 16, 16 and 8 classes: each row's class substituted in its own slice only
    sliced = torch.cat([grad(nudged, kept[2:], start, min(start + 16, vocab)) for start in range(0, vocab, 16)], 1)
    torch.testing.assert_close(sliced, got, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_the_forward_keeps_each_rows_largest_z_and_its_class(reduction):
    """The recompute forward keeps ``chunked.kept_rows`` whole: the lse, the target's z, the largest z and its
    class; the chunked loop's "none" keeps class -1 there (its backward recomputes each chunk in the same GEMM)."""
    from flce_compile.strategies import GradRequest, Operands, fused_forward
    from flce_compile.strategies.recompute import recompute_forward

    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(50, 8, generator=g), torch.randn(70, 8, generator=g)
    t = torch.randint(0, 70, (50,), generator=g)
    t[4] = -100
    ops, p = Operands(x, w, t, None, None), LossParams(reduction=reduction)
    kept = recompute_forward(ops, p, FLCEConfig(strategy="recompute", chunk_tokens=16), torch.float32).lse
    z = x @ w.t()
    torch.testing.assert_close(kept[0], torch.logsumexp(z.double(), dim=1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kept[2], z.max(dim=1).values.double(), rtol=1e-6, atol=0.0)
    assert torch.equal(kept[3], z.argmax(dim=1).double())
    if reduction == "none":
        chunked = fused_forward(ops, p, FLCEConfig(strategy="torch", chunk_tokens=16), torch.float32, GradRequest())
        assert torch.equal(chunked.lse[3], torch.full((50,), -1.0, dtype=torch.float64))


@pytest.mark.parametrize("strategy", ["torch", "triton", "recompute"])
def test_the_op_tracks_the_largest_z_only_for_a_recomputing_backward(strategy):
    """Through the op a "none" forward keeps its rows for backward whatever the strategy, but only the recompute
    loop's backward reads the largest z and its class: the chunked loop's recomputes each chunk in the forward's
    GEMM. Finding them there cost the CPU's "none" forward 40% (4096 x 64 x 32000, the torch step's max()) and
    the kernel a select and a reduction a block, for rows its backward never read."""
    from flce_compile.api import config_arg
    from flce_compile.op import fused_linear_cross_entropy_op
    from flce_compile.params import encode_params

    g = torch.Generator().manual_seed(7)
    x, w, t = torch.randn(12, 8, generator=g), torch.randn(30, 8, generator=g), torch.randint(0, 30, (12,), generator=g)
    kept = fused_linear_cross_entropy_op(x, w, t, None, None, encode_params(LossParams(reduction="none")),
                                         torch.float32, True, True, False, config_arg({"strategy": strategy}))[1]
    assert kept.shape == (4, 12)
    classes = (x @ w.t()).argmax(dim=1).double() if strategy == "recompute" else torch.full((12,), -1.0)
    assert torch.equal(kept[3], classes.to(kept.dtype))


def test_a_slice_needs_the_lse_and_has_no_loss():
    logits, target = torch.randn(3, 8), torch.randint(0, 16, (3,))
    args = _args(logits, target, None, None, None, offset=8, classes=16)
    with pytest.raises(ValueError, match="lse_in"):
        ce_step_torch(args, LossParams())
    # the target z a forward keeps is a whole row's: a slice may not hold the target
    args = CEStepArgs(**{**_args(logits, target, None, torch.zeros(3), None, offset=8, classes=16).__dict__,
                         "target_z_out": torch.empty(3, dtype=torch.float64)})
    with pytest.raises(ValueError, match="target_z_out"):
        ce_step_torch(args, LossParams())
    # the largest z is found with the lse: not from a kept one
    args = CEStepArgs(**{**_args(logits, target, None, torch.zeros(3), None).__dict__,
                         "top_out": torch.empty(2, 3, dtype=torch.float64)})
    with pytest.raises(ValueError, match="top_out"):
        ce_step_torch(args, LossParams())


def test_recompute_keeps_no_vocab_sized_buffer():
    """Everything the strategy allocates is token- or block-sized: no V x H (or BT x V) tensor, in forward or
    backward, besides the returned dW."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and func.__name__.startswith(("empty", "zeros", "new_", "full")):
                self.largest = max(self.largest, out.numel())
            return out

    n, h, v = 64, 16, 512
    x, w, t = random_inputs(n=n, h=h, v=v)
    x.requires_grad_()
    w.requires_grad_()
    with Sizes() as sizes:
        loss = fused_linear_cross_entropy(x, w, t, config={"strategy": "recompute", "chunk_tokens": 16,
                                                            "vocab_block": 64})
        loss.backward()
    assert sizes.largest <= n * h  # dX's fp32 sum: the largest; dW (v x h) is returned, not allocated apart
    assert w.grad.shape == (v, h)


def test_recompute_bound_and_registry():
    """The bound of the recompute loop has no V x H term: at Llama-3's shape it fits the 0.35 GB the issue
    asks for, where every chunked config needs the fp32 dW accumulator (2.1 GB)."""
    recompute = FLCEConfig(strategy="recompute", chunk_tokens=1024, vocab_block=2048)
    assert peak_bytes(recompute, 16384, 128256, 4096, torch.bfloat16) <= 0.35e9
    assert peak_bytes(FLCEConfig(strategy="triton", chunk_tokens=256), 16384, 128256, 4096,
                      torch.bfloat16) > 128256 * 4096 * 4
    entry = registry.get("recompute")
    assert entry.loop == "recompute" and "vocab_block" in entry.params
    # A config never gets it by default: the heuristic's pick is a chunked strategy on every device.
    assert registry.default_for("cuda", torch.bfloat16).loop == "chunked"
    assert registry.default_for("cpu", torch.float32).loop == "chunked"


def test_a_tight_budget_leaves_the_tuner_only_recompute():
    """flce-tune --budget-gb 0.5 at Llama-3's shape: the memory bound prunes every chunked config (each holds
    the fp32 V x H dW accumulator), so the search can only find a recompute config."""
    from flce_compile.tuning.search import run_search
    from flce_compile.tuning.space import SearchSpace

    budget = int(0.5 * 2**30)
    space = SearchSpace(tokens=16384, vocab=128256, hidden=4096, budget_bytes=budget,
                        base=FLCEConfig(strategy="triton", chunk_tokens=2048))
    for strategy in ("torch", "triton"):
        assert space.over_budget(FLCEConfig(strategy=strategy, chunk_tokens=128)) is not None

    def objective(config):  # deterministic: larger chunks and blocks are faster; memory as the bound says
        return 100.0 / (config.chunk_tokens * config.vocab_block) ** 0.25, space.predicted_bytes(config)

    result = run_search(objective, space, default=space.base, n_trials=12, seed=0, budget_bytes=budget)
    assert result.best is not None and result.best.strategy == "recompute"
    assert space.predicted_bytes(result.best) <= budget


def test_fit_budget_moves_from_smaller_chunks_to_recompute():
    from flce_compile.plan.choose import fit_budget

    base = FLCEConfig(strategy="triton", chunk_tokens=2048)
    args = (16384, 128256, 4096, torch.bfloat16, torch.float32)
    assert fit_budget(base, *args, int(3.0 * 2**30)) == base  # 2.45 GiB: the usual config fits
    smaller = fit_budget(base, *args, int(2.3 * 2**30))
    assert smaller.strategy == "triton" and smaller.chunk_tokens < 2048
    tight = fit_budget(base, *args, int(0.5 * 2**30))
    assert tight.strategy == "recompute" and peak_bytes(tight, *args[:4]) <= 0.5 * 2**30
    with pytest.raises(ValueError, match="memory_budget_gb=0.01: no config fits .* raise the budget"):
        fit_budget(base, *args, int(0.01 * 2**30))


def test_a_budget_fits_the_fields_a_config_leaves_free_and_never_overrides_forced_ones():
    """A config= beside memory_budget_gb: the budget used to replace the forced fields silently (an FLCEConfig's
    strategy="torch" ran as "recompute", a forced chunk_tokens=4096 as 512). Forced fields stay; the budget fits
    the others, or the error says the forced ones do not fit."""
    from flce_compile.plan.choose import BudgetError, config_within_budget

    args = (16384, 128256, 4096, torch.bfloat16, torch.device("cuda"), torch.float32)
    free, _ = config_within_budget({"chunk_tokens": 4096}, 0.5, *args)
    assert free.chunk_tokens == 4096 and free.strategy == "recompute" and peak_bytes(free, *args[:4]) <= 0.5 * 2**30
    with pytest.raises(BudgetError, match=r"with the forced fields chunk_tokens=4096, strategy='triton' fits .* "
                                          r"raise the budget or force fewer fields"):
        config_within_budget({"strategy": "triton", "chunk_tokens": 4096}, 0.5, *args)
    everything = FLCEConfig(strategy="triton", chunk_tokens=1024).to_dict()
    assert config_within_budget(everything, 3.0, *args)[0] == FLCEConfig(**everything)
    with pytest.raises(BudgetError, match="force fewer fields"):
        config_within_budget(everything, 0.5, *args)
    # through the op, on the CPU: an FLCEConfig forcing the torch strategy keeps it or says why it cannot
    x, w, t = random_inputs(n=512, h=256, v=8192, dtype=torch.bfloat16)
    with pytest.raises(BudgetError, match="with the forced fields"):
        fused_linear_cross_entropy(x.requires_grad_(), w.requires_grad_(), t,
                                   config=FLCEConfig(strategy="torch", chunk_tokens=512), memory_budget_gb=7 / 1024)


def test_memory_budget_of_the_op(monkeypatch):
    """memory_budget_gb: bf16 on the CPU, where the chunked strategy's fp32 dW accumulator (8 MiB) cannot fit
    7 MiB; the op then runs the recompute strategy, with eager's gradients."""
    import flce_compile.op as op_module
    from flce_reference import reference_loss

    calls = []
    original = op_module.recompute_backward
    monkeypatch.setattr(op_module, "recompute_backward", lambda *a, **k: calls.append(1) or original(*a, **k))
    x, w, t = random_inputs(n=512, h=256, v=8192, dtype=torch.bfloat16)
    for budget, recomputed in ((1.0, False), (7 / 1024, True)):
        calls.clear()
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        fused_linear_cross_entropy(xs, ws, t, memory_budget_gb=budget).backward()
        assert bool(calls) == recomputed
        xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
        reference_loss(xe, we, t).backward()
        torch.testing.assert_close(ws.grad.float(), we.grad.float(), rtol=2e-2, atol=2e-4)
    with pytest.raises(ValueError, match="memory_budget_gb"):
        fused_linear_cross_entropy(x, w, t, memory_budget_gb=-1.0)


def test_choose_config_with_a_budget():
    from flce_compile import choose_config

    args = (16384, 128256, 4096, torch.bfloat16, torch.device("cuda"))
    config, source = choose_config(*args, memory_budget_gb=0.5)
    assert config.strategy == "recompute" and source.endswith("fitted to 0.5 GiB")
    assert choose_config(*args, memory_budget_gb=100.0) == choose_config(*args)


@pytest.mark.parametrize("backend", list(STEPS))
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.2, "softcap": 3.0}])
def test_true_class_residual_is_the_rounding_of_g_y(backend, options):
    """With fp32 logits and a bf16 gradient (precision="precise") both CE steps write, per row, what rounding
    took from the true-class entry: g_y - bf16(g_y) of the step's own fp32 gradient (the kernel's and the torch
    step's differ in fp32's last bits, and so would their residuals); 0 for an ignored row and for a slice that
    does not hold the target."""
    g = torch.Generator().manual_seed(0)
    rows, vocab = 9, 70
    logits = torch.randn(rows, vocab, generator=g) * 3
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[2] = -100
    p = LossParams(label_smoothing=options.get("label_smoothing", 0.0), softcap=options.get("softcap", 0.0))
    z = p.softcap * torch.tanh(logits / p.softcap) if p.softcap else logits
    lse = torch.logsumexp(z, dim=1)
    config = FLCEConfig(strategy=backend, block_v=16, num_warps=1)
    exact = torch.empty(rows, vocab)
    STEPS[backend](_args(logits, target, None, lse, exact), p, config)  # the step's own fp32 gradient
    for start, stop in ((0, vocab), (0, 24), (24, 70)):
        grad, residual = torch.empty(rows, stop - start, dtype=torch.bfloat16), torch.full((rows,), 7.0)
        args = _args(logits[:, start:stop], target, None, lse, grad, start, vocab)
        args.residual_out = residual
        STEPS[backend](args, p, config)
        here = (target >= start) & (target < stop)
        g_y = exact[torch.arange(rows), target.clamp(0)]
        expected = torch.where(here, g_y - g_y.bfloat16().float(), 0.0)
        torch.testing.assert_close(residual, expected, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(grad, exact[:, start:stop].bfloat16(), rtol=0, atol=0)
        assert bool((expected != 0).any()) or not bool(here.any())


def test_the_least_memory_a_budget_error_names_fits_as_the_budget():
    """The error of a budget nothing fits names the least any config needs, rounded up, so that figure passed as the
    budget fits (rounded to nearest, 0.517 GiB at 16384 x 128256 x 8192 raised again, naming 0.517); and the
    rounding holds at a byte over a whole figure."""
    import re

    from flce_compile.plan.choose import BudgetError, budget_bytes, fit_budget, gib_rounded_up

    args = (FLCEConfig(strategy="torch", chunk_tokens=4096), 16384, 128256, 8192, torch.bfloat16, torch.float32)
    with pytest.raises(BudgetError) as raised:
        fit_budget(*args, int(0.5 * 2**30))
    least = float(re.search(r"the least memory any needs is ([0-9.e+-]+) GiB", str(raised.value)).group(1))
    assert fit_budget(*args, budget_bytes(least)).strategy == "recompute"
    for nbytes in (2**30, 2**30 + 1, 100 * 2**30 + 1, 555155456, 1):
        assert budget_bytes(float(gib_rounded_up(nbytes))) >= nbytes, nbytes
    assert gib_rounded_up(2**30) == "1"


@pytest.mark.parametrize("z_loss", [0.0, 0.01])
@pytest.mark.parametrize("strategy", ["torch", "recompute"])
def test_class_weights_summing_to_zero_give_nan_gradients_as_eager(strategy, z_loss):
    """Every valid target's class weight 0: eager's "mean" divides by 0, its loss and gradients are NaN. The
    recompute loop's backward zeroed the infinite CE factor as if no token were valid, so the gradients came out
    0 (with a z-loss, finite: training went on under a NaN loss)."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(3, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    t, class_weight = torch.tensor([0, 0, 0]), torch.tensor([0.0, 1, 1, 1, 1], dtype=torch.float64)
    config = {"strategy": strategy, "chunk_tokens": 2, "vocab_block": 2}
    loss = fused_linear_cross_entropy(h, w, t, ce_weight=class_weight, z_loss=z_loss, config=config)
    loss.backward()
    assert loss.isnan() and h.grad.isnan().all() and w.grad.isnan().any()
    eager_h = h.detach().clone().requires_grad_(True)
    torch.nn.functional.cross_entropy(eager_h @ w.detach().T, t, weight=class_weight).backward()
    assert eager_h.grad.isnan().all()


@pytest.mark.parametrize("block", [16, 48])
def test_recompute_backward_takes_the_kept_z_of_each_rows_largest_class(block):
    """Through ``recompute_backward``, not only the CE step: backward's logits recomputed a few ulps apart at the
    class each row is sure of (its weight row scaled by 1 + 2^-21 here: on the CPU the blocks' GEMMs round as the
    forward's, on a GPU they need not) leave dX and dW as from the forward's own logits, since that class's
    probability comes from the forward's z (``kept_rows`` rows 2-3, ``CEStepArgs.top_in``); with class -1 kept
    there (nothing tracked) the recomputed z's ulps reach the gradient whole (here dX 13x, dW 500x further off).
    No test through the op could fail on the CPU without that wiring."""
    from flce_compile.strategies import GradRequest, Operands
    from flce_compile.strategies.recompute import recompute_backward, recompute_forward

    g = torch.Generator().manual_seed(11)
    n, h, vocab, margin = 64, 16, 48, 16.0
    w = torch.randn(vocab, h, generator=g)
    w = w / w.norm(dim=1, keepdim=True)
    t = torch.randint(0, vocab, (n,), generator=g)
    sure = (t + torch.randint(1, vocab, (n,), generator=g)) % vocab  # each row sure of another class than its target
    x = w[sure] * margin + torch.randn(n, h, generator=g) * 0.1
    p, cfg = LossParams(), FLCEConfig(strategy="recompute", chunk_tokens=16, vocab_block=block)
    kept = recompute_forward(Operands(x, w, t, None, None), p, cfg, torch.float32).lse
    assert torch.equal(kept[3], sure.double())
    nudged = w.clone()
    nudged[sure.unique()] *= 1 + 2.0 ** -21  # (a relative 2^-21: 8 ulps of z near 16)
    one, request = torch.ones(()), GradRequest(True, True, False)

    def grads(weight, rows):
        return recompute_backward(Operands(x, weight, t, None, None), rows, one, p, cfg, torch.float32, request)[:2]

    exact = grads(w, kept)
    untracked = kept.clone()
    untracked[3] = -1.0
    for got, lost, ref in zip(grads(nudged, kept), grads(nudged, untracked), exact):
        err, err_lost = float((got - ref).norm() / ref.norm()), float((lost - ref).norm() / ref.norm())
        assert err < 1e-6 and err_lost > 5 * err, (err, err_lost)
