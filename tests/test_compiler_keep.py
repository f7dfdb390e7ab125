"""The default ``flce.logits="keep"`` when a graph returns its logits: exact logits, and the loss and the
lm_head's gradients fused around them. Nothing logits-sized is saved for backward, a caller that never uses
the logits gets no logits-sized zero gradient in backward, and one that does (an extra loss on the returned
logits, or on the logits inside the compiled function) gets that gradient exactly. Also: dropped logits under
DDPOptimizer's split graphs, and the fallback when the target cannot be computed before the lm_head."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import flce_compile.compiler as fc
from flce_compile.compiler.rewrite import flce_fused_loss_keep, flce_kept_logits_loss

V, H, B, S = 96, 16, 2, 24  # B*S*V (logits) > V*H (dW) > B*S*H (dX): sizes tell the buffers apart
LOGITS_NUMEL = B * S * V


class LM(nn.Module):
    """A nanoGPT-style head that returns (loss, logits); ``softcap`` as Gemma-2 (the returned logits are the
    capped ones); ``extra`` adds a loss on the logits inside the forward."""

    def __init__(self, softcap: float | None = None, extra: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.proj = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, V, bias=True)
        self.softcap, self.extra = softcap, extra

    def forward(self, idx, labels):
        logits = self.lm_head(torch.tanh(self.proj(self.emb(idx))))
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        labels = F.pad(labels, (0, 1), value=-100)[:, 1:]  # HF's shift, computed after the lm_head
        loss = F.cross_entropy(logits.float().view(-1, V), labels.reshape(-1))
        if self.extra:
            loss = loss + 1e-2 * logits.float().square().mean()
        return loss, logits


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _reference(model, idx, labels, logits_weight=0.0):
    model.zero_grad(set_to_none=True)
    loss, logits = model(idx, labels)
    (loss + logits_weight * (logits.float() ** 3).mean()).backward()
    return loss.detach(), logits.detach(), _grads(model)


class _Capture:
    def __init__(self, inner):
        self.inner, self.graphs = inner, []

    def __call__(self, gm, example_inputs, **kw):
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs.append(gm)
        return lookup_backend(self.inner)(gm, example_inputs, **kw)

    def targets(self):
        return [n.target for gm in self.graphs for n in gm.graph.nodes if n.op == "call_function"]


class _BigAllocations(TorchDispatchMode):
    """Records allocations of at least ``numel`` elements."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.seen = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.numel() >= self.numel:
            self.seen.append((str(func), tuple(out.shape)))
        return out


@pytest.fixture(scope="module")
def compiled_models():
    """One compile per (inner, softcap, extra), shared by the tests."""
    cache = {}

    def get(inner, softcap=None, extra=False):
        key = (inner, softcap, extra)
        if key not in cache:
            torch.manual_seed(0)
            model = LM(softcap, extra)
            cap = _Capture(inner)
            torch._dynamo.reset()
            cache[key] = (model, torch.compile(model, backend="flce", options={"flce.inner": cap}), cap)
        return cache[key]

    return get


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_kept_logits_exact_and_no_logits_sized_backward(inner, softcap, compiled_models):
    model, compiled, cap = compiled_models(inner, softcap)
    idx, labels = _data()
    ref_loss, ref_logits, ref_grads = _reference(model, idx, labels)
    model.zero_grad(set_to_none=True)
    loss, logits = compiled(idx, labels)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert cap.targets().count(flce_fused_loss_keep) == 1 and flce_kept_logits_loss not in cap.targets()
    del logits  # as in `loss = model(...).loss`
    with _BigAllocations(LOGITS_NUMEL) as big:
        loss.backward()
    assert big.seen == []  # no zero tangent, no logits gradient, nothing logits-sized
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_gradient_into_the_returned_logits(inner, softcap, compiled_models):
    """An extra loss on the returned logits, outside the compiled function, reaches every parameter."""
    model, compiled, _ = compiled_models(inner, softcap)
    idx, labels = _data()
    _, _, ref_grads = _reference(model, idx, labels, logits_weight=0.3)
    model.zero_grad(set_to_none=True)
    loss, logits = compiled(idx, labels)
    (loss + 0.3 * (logits.float() ** 3).mean()).backward()
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_logits_written_in_place_before_a_loss_on_them(softcap, compiled_models):
    """Writing into the returned logits (masking a token before an extra loss on them) works as in eager, also
    through a softcap, whose derivative then recomputes the capped logits it can no longer read."""
    model, compiled, _ = compiled_models("aot_eager", softcap)
    idx, labels = _data()

    def step(fn):
        model.zero_grad(set_to_none=True)
        loss, logits = fn(idx, labels)
        logits[..., 0] = -3.0
        (loss + 0.3 * (logits.float() ** 3).mean()).backward()
        return loss.detach(), _grads(model)

    ref_loss, ref_grads = step(model)
    loss, grads = step(compiled)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_loss_on_the_logits_inside_the_graph(inner, compiled_models):
    model, compiled, cap = compiled_models(inner, None, True)
    idx, labels = _data()
    ref_loss, ref_logits, ref_grads = _reference(model, idx, labels)
    model.zero_grad(set_to_none=True)
    loss, logits = compiled(idx, labels)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert cap.targets().count(flce_fused_loss_keep) == 1
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_no_grad_keeps_logits_without_gradients(compiled_models):
    model, compiled, _ = compiled_models("aot_eager")
    idx, labels = _data()
    with torch.no_grad():
        loss, logits = compiled(idx, labels)
        ref_loss, ref_logits = model(idx, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert not logits.requires_grad


def test_explain_and_log_the_kept_logits(caplog):
    import flce_compile.compiler.rewrite as rewrite

    rewrite._logged_keep = False
    idx, labels = _data()
    report = fc.explain(LM(), idx, labels)
    assert [r.path for r in report] == ["fused_keep"]
    assert report[0].kept_logits_bytes == LOGITS_NUMEL * 4
    torch._dynamo.reset()
    with caplog.at_level("INFO", logger="flce_compile"):
        torch.compile(LM(), backend="flce", options={"flce.inner": "eager"})(idx, labels)
    kept = [r for r in caplog.records if "kept, exact" in r.getMessage()]
    assert len(kept) == 1 and kept[0].levelname == "INFO"
    assert f"{LOGITS_NUMEL * 4 / 1e9:.2f} GB" in kept[0].getMessage()


class RelabelAfterHead(nn.Module):
    """Writes the labels between the lm_head and the loss: the target cannot move before the lm_head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, idx, labels):
        logits = self.lm_head(self.emb(idx))
        labels = labels.clone()
        labels[:, :2] = -100
        return F.cross_entropy(logits.view(-1, V), labels.view(-1)), logits


def test_target_written_after_the_head_falls_back_to_kept_logits():
    torch.manual_seed(0)
    model = RelabelAfterHead()
    idx, labels = _data()
    ref_loss, ref_logits, ref_grads = _reference(model, idx, labels)
    report = fc.explain(model, idx, labels)
    assert report[0].path == "kept_logits" and "may write the target" in report[0].note
    cap = _Capture("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": cap})
    model.zero_grad(set_to_none=True)
    loss, logits = compiled(idx, labels)
    loss.backward()
    assert flce_kept_logits_loss in cap.targets()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, ref_logits)
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_dropped_logits_under_ddp_optimizer():
    """DDPOptimizer splits the graph into one submodule per gradient bucket and compiles each with our
    backend; a dropped logits output must not reach AOT as a None output (#14)."""
    from torch._dynamo.backends.distributed import DDPOptimizer

    torch.manual_seed(0)
    model = LM()
    idx, labels = _data()
    ref_loss, _, ref_grads = _reference(model, idx, labels)
    flce = fc.with_options(logits="drop", inner="aot_eager")
    ddp_opt = DDPOptimizer(bucket_bytes_cap=V * H * 4, backend_compile_fn=flce, first_bucket_cap=1)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=ddp_opt.compile_fn)
    model.zero_grad(set_to_none=True)
    loss, logits = compiled(idx, labels)
    loss.backward()
    assert logits is None
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert len(ddp_opt.buckets) > 1  # the graph really was split


def test_graph_outputs_restored_exactly():
    """The wrapper hands back what the graph returned: Nones where logits were dropped, the same logits
    object wherever the graph returned it twice."""

    class Twice(LM):
        def forward(self, idx, labels):
            loss, logits = super().forward(idx, labels)
            return loss, logits, logits

    idx, labels = _data()
    torch._dynamo.reset()
    out = torch.compile(Twice(), backend="flce", options={"flce.inner": "aot_eager"})(idx, labels)
    assert out[1] is out[2]
    torch._dynamo.reset()
    out = torch.compile(Twice(), backend="flce", options={"flce.inner": "aot_eager", "flce.logits": "drop"})(
        idx, labels)
    assert out[1] is None and out[2] is None and out[0].requires_grad


def test_a_softcap_left_symbolic_by_dynamic_true_is_reported_and_warned(caplog, monkeypatch):
    """Under ``dynamic=True`` Dynamo traces a float attribute (the softcap here, Gemma-2's
    ``final_logit_softcapping``) as a symbolic input, which the pass cannot fold: explain says so, as the
    compiled model does, and the backend warns with the fix; the loss is eager's. With the float specialized,
    the same model fuses."""
    from flce_compile.compiler import rewrite

    torch.manual_seed(0)
    model = LM(softcap=5.0)
    idx, labels = _data()
    ref_loss, _, _ = _reference(model, idx, labels)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": "aot_eager"}, dynamic=True)
    (site,) = fc.explain(compiled, idx, labels)
    assert not site.fused and "Python float Dynamo left symbolic" in site.reason
    assert "specialize_float = True" in site.reason
    monkeypatch.setattr(rewrite, "_warned_symbolic_float", False)
    caplog.set_level(logging.WARNING, logger="flce_compile")
    loss, _ = compiled(idx, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert any(r.levelno == logging.WARNING and "left symbolic" in r.getMessage() for r in caplog.records)
    with torch._dynamo.config.patch(specialize_float=True):
        (site,) = fc.explain(compiled, idx, labels)
    assert site.fused
