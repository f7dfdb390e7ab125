"""Logits a graph returns. The default ``flce.logits="keep"`` hands back logits computed when first read
(``LazyLogits``): the graph forms none, a caller that reads only the loss never pays for them, and one that reads
them, writes into them or takes a loss on them gets eager's values and gradients, also after an optimizer step
when it held them through backward. ``"materialize"`` computes them in the graph, exactly, with the loss and the
lm_head's gradients fused around them: nothing logits-sized is saved for backward, a caller that never uses the
logits gets no logits-sized zero gradient in backward, and one that does (an extra loss on the returned logits,
or on the logits inside the compiled function) gets that gradient exactly. Also: dropped logits under
DDPOptimizer's split graphs, and the fallback when the target cannot be computed before the lm_head."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import flce_compile
import flce_compile.compiler as fc
from flce_compile.compiler.decide import SHARED_NOTE, UNKEPT_NOTE
from flce_compile.compiler.lazy_logits import LazyLogits
from flce_compile.compiler.rewrite import flce_fused_loss, flce_fused_loss_keep, flce_kept_logits_loss

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


def _assert_as_eager(model, got, ref, logits_atol=1e-6):
    """The compiled step's (loss, logits) and the model's gradients against ``_reference``'s."""
    (loss, logits), (ref_loss, ref_logits, ref_grads) = got, ref
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=logits_atol)
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


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
    """One compile per (inner, softcap, extra, logits), shared by the tests. Each new compile resets Dynamo, so an
    earlier model compiles again at its next call: its captured graphs are dropped then, and the tests see one
    compile's graphs whatever order they run in."""
    cache, resets = {}, [0]

    def get(inner, softcap=None, extra=False, logits="keep"):
        key = (inner, softcap, extra, logits)
        if key not in cache:
            torch.manual_seed(0)
            model = LM(softcap, extra)
            cap = _Capture(inner)
            torch._dynamo.reset()
            resets[0] += 1
            compiled = torch.compile(model, backend="flce", options={"flce.inner": cap, "flce.logits": logits})
            cache[key] = [model, compiled, cap, resets[0]]
        model, compiled, cap, at = cache[key]
        if at != resets[0]:  # reset since: the next call traces it again
            cap.graphs.clear()
            cache[key][3] = resets[0]
        return model, compiled, cap

    return get


def _logits_sized(gm) -> list[str]:
    """The nodes of a graph whose values have the logits' size or more."""
    return [n.name for n in gm.graph.nodes if isinstance(v := n.meta.get("example_value"), torch.Tensor)
            and v.numel() >= LOGITS_NUMEL]


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("mode", ["keep", "materialize"])
def test_kept_logits_exact_and_no_logits_sized_backward(inner, softcap, mode, compiled_models):
    model, compiled, cap = compiled_models(inner, softcap, logits=mode)
    idx, labels = _data()
    ref_loss, ref_logits, ref_grads = _reference(model, idx, labels)
    model.zero_grad(set_to_none=True)
    loss, logits = compiled(idx, labels)
    if mode == "keep":  # computed when read, outside a graph that forms nothing logits-sized
        assert type(logits) is LazyLogits and not logits.computed
        assert cap.targets().count(flce_fused_loss) == 1 and flce_fused_loss_keep not in cap.targets()
        assert [_logits_sized(gm) for gm in cap.graphs] == [[]]
    else:
        assert type(logits) is torch.Tensor
        assert cap.targets().count(flce_fused_loss_keep) == 1
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert flce_kept_logits_loss not in cap.targets()
    del logits  # as in `loss = model(...).loss`
    with _BigAllocations(LOGITS_NUMEL) as big:
        loss.backward()
    assert big.seen == []  # no zero tangent, no logits gradient, nothing logits-sized
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("mode", ["keep", "materialize"])
def test_gradient_into_the_returned_logits(inner, softcap, mode, compiled_models):
    """An extra loss on the returned logits, outside the compiled function, reaches every parameter."""
    model, compiled, _ = compiled_models(inner, softcap, logits=mode)
    idx, labels = _data()
    _, _, ref_grads = _reference(model, idx, labels, logits_weight=0.3)
    model.zero_grad(set_to_none=True)
    loss, logits = compiled(idx, labels)
    (loss + 0.3 * (logits.float() ** 3).mean()).backward()
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("mode", ["keep", "materialize"])
def test_logits_written_in_place_before_a_loss_on_them(softcap, mode, compiled_models):
    """Writing into the returned logits (masking a token before an extra loss on them) works as in eager, also
    through a softcap, whose derivative then recomputes the capped logits it can no longer read."""
    model, compiled, _ = compiled_models("aot_eager", softcap, logits=mode)
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


@pytest.mark.parametrize("mode", ["keep", "materialize"])
def test_no_grad_keeps_logits_without_gradients(mode, compiled_models):
    model, compiled, _ = compiled_models("aot_eager", logits=mode)
    idx, labels = _data()
    with torch.no_grad():
        loss, logits = compiled(idx, labels)
        ref_loss, ref_logits = model(idx, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert not logits.requires_grad


@contextlib.contextmanager
def _parameters_restored(model):
    """The model's parameters as they were before the block (the compiled models are shared between tests)."""
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        yield
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(state[n])


def test_lazy_logits_held_through_backward_keep_their_values_after_the_step(compiled_models):
    """``out = model(...); out.loss.backward(); opt.step()``, the logits read after the step: they are the forward's
    (nothing runs in backward; the step copied the weight first)."""
    model, compiled, _ = compiled_models("aot_eager")
    idx, labels = _data()
    _, ref_logits, _ = _reference(model, idx, labels)
    model.zero_grad(set_to_none=True)
    loss, logits = compiled(idx, labels)
    loss.backward()
    assert not logits.computed
    with _parameters_restored(model):
        torch.optim.SGD(model.parameters(), lr=0.5).step()
        assert not logits.computed  # (its weight copied: smaller than these logits)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


def test_lazy_logits_never_read_are_never_computed(compiled_models, monkeypatch):
    """``loss = model(...).loss``: the logits are dropped unread and never computed, in forward or backward."""
    from flce_compile.compiler import lazy_logits

    model, compiled, _ = compiled_models("aot_eager")
    idx, labels = _data()
    computed = []
    real = lazy_logits._Source.value
    monkeypatch.setattr(lazy_logits._Source, "value", lambda self: computed.append(1) or real(self))
    loss = compiled(idx, labels)[0]
    loss.backward()
    assert computed == []
    loss, logits = compiled(idx, labels)
    logits.sum()
    logits.max()
    assert computed == [1]  # once, then kept


def test_lazy_logits_refuse_operands_changed_before_they_were_read():
    """Logits not yet computed whose lm_head weight was written in place, or moved (as FSDP's resharding frees
    it), raise an error naming the fix, never values of another weight; ``materialize`` computes them at once."""
    idx, labels = _data()
    torch.manual_seed(0)
    model = LM()
    for mode in ("keep", "materialize"):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="flce", options={"flce.inner": "aot_eager", "flce.logits": mode})
        with torch.no_grad():
            ref = model(idx, labels)[1]
            _, written = compiled(idx, labels)
            _, moved = compiled(idx, labels)
            model.lm_head.weight.mul_(2.0)
            model.lm_head.weight.div_(2.0)  # the same values, but written: the logits cannot know
            weight = model.lm_head.weight.data
            model.lm_head.weight.data = weight.clone()
        if mode == "keep":
            # An optimizer step (which computes held logits first) leaves the error to the reader.
            torch.optim.SGD(model.parameters(), lr=0.0).step()
            with pytest.raises(flce_compile.StaleLogitsError,
                               match="its weight was written in place.*flce.logits': 'materialize'"):
                written.sum()
            with pytest.raises(flce_compile.StaleLogitsError, match="weight's memory was moved or freed"):
                moved.sum()
        else:
            torch.testing.assert_close(written, ref)
            torch.testing.assert_close(moved, ref)


def test_lazy_logits_read_outside_the_dispatcher(tmp_path, compiled_models):
    """Pickling, deepcopy, lists, numpy and repr see the values, as for a plain tensor (numpy and deepcopy refuse
    what they refuse on one that requires grad; a pickled one keeps requires_grad)."""
    import copy

    model, compiled, _ = compiled_models("aot_eager")
    idx, labels = _data()
    with torch.no_grad():
        ref = model(idx, labels)[1]
        outs = [compiled(idx, labels)[1] for _ in range(5)]
    torch.save(outs[0], tmp_path / "logits.pt")
    loaded = torch.load(tmp_path / "logits.pt")
    assert type(loaded) is torch.Tensor and not loaded.requires_grad
    torch.testing.assert_close(loaded, ref)
    torch.testing.assert_close(copy.deepcopy(outs[1]), ref)
    torch.testing.assert_close(torch.tensor(outs[2].tolist()), ref)
    torch.testing.assert_close(torch.from_numpy(outs[3].numpy()), ref)
    assert repr(outs[4]).startswith("LazyLogits(tensor(") and "grad_fn" not in repr(outs[4])
    _, logits = compiled(idx, labels)
    with pytest.raises(RuntimeError, match="requires grad"):
        logits.numpy()
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(logits)
    assert "grad_fn=<_LazyHeadBackward>" in repr(logits)
    torch.save(logits, tmp_path / "grad.pt")
    assert torch.load(tmp_path / "grad.pt").requires_grad


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_lazy_logits_given_to_a_compiled_function(inner, compiled_models):
    """A compiled function given the logits (a metric, an extra loss) gets their values, and their gradient
    reaches the model: Dynamo leaves this class's operators outside its graph."""
    model, compiled, _ = compiled_models("aot_eager")
    idx, labels = _data()
    _, ref_logits, ref_grads = _reference(model, idx, labels, logits_weight=0.3)
    model.zero_grad(set_to_none=True)
    loss, logits = compiled(idx, labels)
    extra = torch.compile(lambda t: (t.float() ** 3).mean() * 0.3, backend=inner)
    (loss + extra(logits)).backward()
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_compiled_function_given_new_lazy_logits_each_step_compiles_once(compiled_models):
    """A compiled metric given each step's logits (``metric(out.logits)`` in a training loop): Dynamo traced the
    class's dispatch and ``compute`` from the metric's frame, guarded on each LazyLogits and compiled them again
    every step, up to its recompile limit. They now run untraced: frames are traced at the first call only, and
    the values are eager's."""
    from torch._dynamo.utils import counters

    model, compiled, _ = compiled_models("aot_eager")
    idx, labels = _data()
    _, ref_logits, _ = _reference(model, idx, labels)
    metric = torch.compile(lambda t, y: F.cross_entropy(t.flatten(0, 1).float(), y.flatten()), backend="eager")
    frames, values = [], []
    for _ in range(4):
        _, logits = compiled(idx, labels)
        counters.clear()
        values.append(metric(logits, labels))
        frames.append(counters["frames"]["total"])
    assert frames[0] > 0 and frames[1:] == [0, 0, 0], frames
    expected = F.cross_entropy(ref_logits.flatten(0, 1).float(), labels.flatten())
    for value in values:
        torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-6)


class _DataWritingSGD(torch.optim.Optimizer):
    """A step that writes the parameters through ``.data``, as fused optimizers write them: no version counter
    sees it."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


@pytest.mark.parametrize("tokens", [S, 4])
def test_lazy_logits_are_secured_before_an_optimizer_step(tokens, compiled_models):
    """Logits held but never backpropagated (another micro-batch's loss was), then a step that writes the weights
    unseen by their version counters (fused optimizers do): the step secured them first (their weight copied, or,
    for logits smaller than the weight, computed), so they are the forward's."""
    model, compiled, _ = compiled_models("aot_eager")
    idx, labels = (t[:, :tokens] for t in _data())
    _, ref_logits, _ = _reference(model, idx, labels)
    model.zero_grad(set_to_none=True)
    _, logits = compiled(idx, labels)
    _, other = compiled(idx, labels)
    compiled(idx, labels)[0].backward()
    with _parameters_restored(model):
        _DataWritingSGD(model.parameters(), lr=0.5).step()
        copied = logits.numel() > model.lm_head.weight.numel()
        assert logits.computed != copied and other.computed != copied
        if copied:  # one copy of the weight for both
            assert logits._source.ws[0] is other._source.ws[0] is not model.lm_head.weight
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(other, ref_logits, rtol=1e-5, atol=1e-5)


class _TransposedHead(nn.Module):
    """``h @ W`` with W stored (H, V): the graph returns the head's weight as ``W.t()``, a view of the parameter
    (no leaf), rebuilt outside the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.w = nn.Parameter(torch.randn(H, V) / H**0.5)

    def forward(self, idx, labels):
        logits = torch.tanh(self.emb(idx)) @ self.w
        return F.cross_entropy(logits.float().view(-1, V), labels.view(-1)), logits


def test_held_logits_of_a_head_that_is_a_view_survive_the_step():
    """Held, unread logits of a head whose weight the graph returns as a view of the parameter: the step's hook
    copies it like any weight, so a step that writes the parameter unseen (as fused optimizers do) leaves the
    logits the forward's (kept by reference, they read the new weight: a review's 4.4 max error)."""
    torch.manual_seed(0)
    model = _TransposedHead()
    idx, labels = _data()
    expected = model(idx, labels)[1].detach()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": "aot_eager"})
    loss, logits = compiled(idx, labels)
    loss.backward()
    _DataWritingSGD(model.parameters(), lr=0.5).step()
    assert not logits.computed
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


class _PromptHead(nn.Module):
    """An lm_head reading a parameter directly (learned query vectors): the hidden states are a graph input, given
    to the head as it is, as a slice of it or as a view of it."""

    def __init__(self, form: str = "whole", tokens: int = 4 * S) -> None:
        super().__init__()
        self.form = form
        self.queries = nn.Parameter(torch.randn(tokens + 2, H))
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, labels):
        queries = {"whole": lambda q: q, "slice": lambda q: q[1:-1], "view": lambda q: q.t().t()}[self.form](
            self.queries if self.form != "whole" else self.queries[:-2])
        logits = self.lm_head(queries[:labels.shape[0]] if self.form == "view" else queries)
        return F.cross_entropy(logits, labels), logits


@pytest.mark.parametrize("form, fused, frozen_after", [
    ("whole", False, False), ("whole", True, False), ("slice", True, False), ("view", True, False),
    ("whole", True, True)])
def test_held_logits_of_a_head_reading_a_parameter_survive_the_step(form, fused, frozen_after):
    """Held, unread logits whose hidden states are a parameter (or a slice or view of one): the step's hook copies
    them as it copies the weight. Only the weight was copied: under a fused Adam (no version counters bumped) the
    logits read the stepped parameter (0.22 off in a review's run), under a plain one reading them raised
    StaleLogitsError. A parameter frozen after backward still holds a .grad, which a step applies: copied too."""
    torch.manual_seed(0)
    model = _PromptHead(form)
    labels = torch.randint(0, V, (4 * S,))
    expected = model(labels)[1].detach()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": "aot_eager"})
    loss, logits = compiled(labels)
    loss.backward()
    if frozen_after:
        model.queries.requires_grad_(False)
    torch.optim.Adam(model.parameters(), lr=0.1, fused=fused).step()
    assert not logits.computed
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_held_logits_smaller_than_the_copies_a_step_needs_are_computed():
    """The step's hook computes held logits that take less memory than the copies it would make, the hidden states
    a step may write counted with the weight: here the weight (V x H) alone is smaller than the logits, the weight
    and the queries together are not."""
    tokens = H + 2  # logits (tokens x V) > V x H, and < V x H + tokens x H
    assert V * H < tokens * V < (V + tokens) * H
    torch.manual_seed(0)
    model = _PromptHead(tokens=tokens)
    labels = torch.randint(0, V, (tokens,))
    expected = model(labels)[1].detach()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": "aot_eager"})
    loss, logits = compiled(labels)
    loss.backward()
    torch.optim.Adam(model.parameters(), lr=0.1, fused=True).step()
    assert logits.computed
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_a_compiled_optimizer_step_with_logits_held_compiles_once(compiled_models):
    """``torch.compile(opt.step)`` (PyTorch's compiled-optimizer recipe) while the model's output is held, as a
    Hugging Face loop holds it: Dynamo traced the step pre-hook that secures held logits, guarded on each of them
    and compiled the step again every step (up to its recompile limit). The hook now runs untraced; the logits
    are still secured (the forward's values after the step)."""
    from torch._dynamo.utils import counters

    model, compiled, _ = compiled_models("aot_eager")
    idx, labels = _data()
    _, ref_logits, _ = _reference(model, idx, labels)
    model.zero_grad(set_to_none=True)
    with _parameters_restored(model):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        step = torch.compile(optimizer.step, backend="eager")
        frames = []
        for _ in range(4):
            loss, logits = compiled(idx, labels)
            loss.backward()
            counters.clear()
            step()
            frames.append(counters["frames"]["total"])  # frames Dynamo traced (a retrace ended in a graph break)
            optimizer.zero_grad(set_to_none=True)
        assert frames[0] > 0 and frames[1:] == [0, 0, 0], frames  # traced at the first step only
        assert not logits.computed or logits.numel() <= model.lm_head.weight.numel()
    with _parameters_restored(model):
        _, logits = compiled(idx, labels)
        step()  # no gradients: the step writes nothing, but its hook runs
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hold", [False, True])
def test_lazy_logits_under_compiled_autograd(hold, compiled_models):
    """Backward traced by compiled autograd (as torchtitan enables it around backward): the default's graph adds no
    hook to the autograd graph that its tracing would trip over; the loss's gradients and the logits are eager's."""
    from torch._dynamo import compiled_autograd

    model, compiled, _ = compiled_models("aot_eager")
    idx, labels = _data()
    _, ref_logits, ref_grads = _reference(model, idx, labels)
    model.zero_grad(set_to_none=True)
    out = compiled(idx, labels)
    loss = out[0]
    if not hold:
        out = None
    with compiled_autograd._enable(torch.compile(backend="aot_eager")):
        loss.backward()
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    if hold:
        torch.testing.assert_close(out[1], ref_logits, rtol=1e-5, atol=1e-5)


class _ReturnsFloat(LM):
    """Returns its logits cast to fp32 off the loss's chain, as Accelerate's mixed precision casts every output
    (``convert_outputs_to_fp32``) inside a model compiled after ``accelerator.prepare``."""

    def forward(self, idx, labels):
        loss, logits = super().forward(idx, labels)
        return loss, logits.float()


def test_lazy_logits_through_a_returned_cast():
    """A cast the graph only returns stays off the graph too: the logits computed when read, in fp32, eager's values
    and gradients."""
    torch.manual_seed(0)
    model = _ReturnsFloat().to(torch.bfloat16)
    idx, labels = _data()
    _, ref_logits, ref_grads = _reference(model, idx, labels, logits_weight=0.3)
    cap = _Capture("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": cap})
    model.zero_grad(set_to_none=True)
    loss, logits = compiled(idx, labels)
    assert type(logits) is LazyLogits and logits.dtype == torch.float32 and not logits.computed
    assert [_logits_sized(gm) for gm in cap.graphs] == [[]]
    (loss + 0.3 * (logits.float() ** 3).mean()).backward()
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, ref_grads[name], rtol=2e-2, atol=1e-3, msg=name)  # (bf16 parameters)


class _ReturnsReshaped(LM):
    """Returns its logits through casts and reshapes off the loss's chain: nanoGPT's ``return logits.view(-1, V),
    loss`` beside the loss's own view, and two such steps one after another."""

    def __init__(self, returned):
        super().__init__()
        self.returned = returned

    def forward(self, idx, labels):
        loss, logits = super().forward(idx, labels)
        return loss, self.returned(logits)


_RESHAPES = {
    "view": (lambda z: z.view(-1, V), (B * S, V)),
    "view_float": (lambda z: z.view(-1, V).float(), (B * S, V)),
    "view_view": (lambda z: z.view(-1, V).view(B, S, V), (B, S, V)),
}


@pytest.mark.parametrize("mode", ["keep", "drop"])
@pytest.mark.parametrize("reshape", list(_RESHAPES))
def test_a_returned_reshape_of_the_logits_stays_off_the_graph(mode, reshape):
    """Reshapes (and a cast) the graph only returns: under "keep" the logits are computed when read, as for a
    returned cast (they took the fused_keep path, forming the logits and a logits-sized gradient buffer in
    backward; two steps one after another did until 2026-12-03); under "drop" the reshape is None, as the logits
    themselves. Eager's values and gradients."""
    returned, shape = _RESHAPES[reshape]
    torch.manual_seed(0)
    model = _ReturnsReshaped(returned)
    idx, labels = _data()
    weight = 0.3 if mode == "keep" else 0.0
    _, ref_logits, ref_grads = _reference(model, idx, labels, logits_weight=weight)
    cap = _Capture("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": cap, "flce.logits": mode})
    model.zero_grad(set_to_none=True)
    loss, logits = compiled(idx, labels)
    assert [_logits_sized(gm) for gm in cap.graphs] == [[]]
    if mode == "drop":
        assert logits is None
        loss.backward()
    else:
        assert type(logits) is LazyLogits and logits.shape == shape and not logits.computed
        (loss + weight * (logits.float() ** 3).mean()).backward()
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


class _ReturnsDtypeView(LM):
    """Returns its fp32 logits' bits viewed as bf16 pairs (``view(dtype)``): no gradient flows through it."""

    def forward(self, idx, labels):
        loss, logits = super().forward(idx, labels)
        return loss, logits.view(torch.bfloat16)


def test_a_returned_dtype_view_of_the_logits_is_no_lazy_reshape():
    """``view(dtype)`` reinterprets the logits' bits, and eager's result requires no grad. Taken as a returned
    reshape, it came back as lazy logits requiring grad, and a backward through them raised (no grad_fn in
    the replayed view). It is left to the graph: eager's values, without grad, and backward works."""
    torch.manual_seed(0)
    model = _ReturnsDtypeView()
    idx, labels = _data()
    ref_loss, ref_view = model(idx, labels)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": "aot_eager"})
    loss, view = compiled(idx, labels)
    assert type(view) is not LazyLogits and not view.requires_grad
    (loss + 0 * view.float().nan_to_num().sum()).backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(view.view(torch.int16), ref_view.view(torch.int16))


def test_lazy_logits_read_through_dlpack_shared_memory_and_data_ptr(compiled_models):
    """Reads that reach a tensor's memory without the dispatcher (DLPack, share_memory_, data_ptr) see the values
    (they read the storage-less wrapper: garbage from NumPy's DLPack, a segfault from torch's, found by a review);
    NumPy's ``copy`` is taken; DLPack refuses logits that require grad, as for any tensor."""
    import warnings

    import numpy as np

    model, compiled, _ = compiled_models("aot_eager")
    idx, labels = _data()
    with torch.no_grad():
        ref = model(idx, labels)[1]
        outs = [compiled(idx, labels)[1] for _ in range(4)]
    torch.testing.assert_close(torch.from_numpy(np.from_dlpack(outs[0]).copy()), ref, rtol=0, atol=0)
    torch.testing.assert_close(torch.from_dlpack(outs[1]).clone(), ref, rtol=0, atol=0)
    assert outs[2].share_memory_() is outs[2] and outs[2].is_shared()
    torch.testing.assert_close(outs[2], ref, rtol=0, atol=0)
    assert outs[3].data_ptr() == outs[3].compute().data_ptr() != 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # NumPy 2's, for an __array__ without ``copy``
        assert np.array(outs[3], copy=True).tolist() == np.asarray(outs[3]).tolist() == ref.tolist()
    _, logits = compiled(idx, labels)
    with pytest.raises(BufferError, match="require gradient"):
        torch.from_dlpack(logits)


def test_a_deepcopy_of_lazy_logits_keeps_views_grad_and_attributes(compiled_models):
    """``copy.deepcopy`` of logits and a view of them in one call: the copies alias as eager's do; a leaf made to
    require grad stays so, and a caller's attribute comes along (each was lost, found by a review)."""
    import copy

    model, compiled, _ = compiled_models("aot_eager")
    idx, labels = _data()
    with torch.no_grad():
        ref = model(idx, labels)[1]
        _, logits = compiled(idx, labels)
    logits.requires_grad_()
    logits.tag = "step 3"
    last = logits[:, -1].detach()
    copied, copied_last = copy.deepcopy([logits, last])
    assert copied.requires_grad and copied.is_leaf and copied.tag == "step 3"
    torch.testing.assert_close(copied.detach(), ref, rtol=0, atol=0)
    with torch.no_grad():
        copied[:, -1] = 3.0
    assert torch.all(copied_last == 3.0)


def test_lazy_logits_first_read_under_inference_mode_stay_writable(compiled_models):
    """A metric read under ``torch.inference_mode()`` computes the values outside it: a write into the logits
    afterwards works, as on eager's logits (it raised "Cannot set version_counter for inference tensor")."""
    model, compiled, _ = compiled_models("aot_eager")
    idx, labels = _data()
    with torch.no_grad():
        ref = model(idx, labels)[1]
        _, logits = compiled(idx, labels)
    with torch.inference_mode():
        top = logits.argmax(-1)
    torch.testing.assert_close(top, ref.argmax(-1), rtol=0, atol=0)
    logits[..., 0] = 0.0
    ref[..., 0] = 0.0
    torch.testing.assert_close(logits, ref, rtol=0, atol=0)


def test_lazy_logits_read_under_autocast_and_made_under_inference_mode(compiled_models):
    """A read inside an autocast region gets the forward's dtype and values; under inference mode (whose tensors
    keep no version counter to check) the logits are computed at once, a plain tensor."""
    model, compiled, _ = compiled_models("aot_eager")
    idx, labels = _data()
    with torch.no_grad():
        ref = model(idx, labels)[1]
        _, logits = compiled(idx, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        text = repr(logits)
    assert "bfloat16" not in text and logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref, rtol=0, atol=0)
    with torch.inference_mode():
        loss, logits = compiled(idx, labels)
    assert type(logits) is torch.Tensor
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)


def test_lazy_logits_written_in_place_keep_the_write(compiled_models):
    model, compiled, _ = compiled_models("aot_eager")
    idx, labels = _data()
    with torch.no_grad():
        ref = model(idx, labels)[1]
        _, logits = compiled(idx, labels)
        logits.mul_(2.0)
        logits[0, 0, 0] = 7.0
    expected = ref * 2.0
    expected[0, 0, 0] = 7.0
    torch.testing.assert_close(logits, expected)
    assert type(logits) is LazyLogits and type(logits * 1) is torch.Tensor


def test_explain_and_log_the_kept_logits(caplog):
    import flce_compile.compiler.rewrite as rewrite

    rewrite._logged_keep = rewrite._logged_lazy = False
    idx, labels = _data()
    report = fc.explain(LM(), idx, labels)
    assert [r.path for r in report] == ["fused_lazy"] and report[0].kept_logits_bytes == 0
    assert "computed when first read" in str(report[0])
    report = fc.explain(LM(), idx, labels, options={"flce.logits": "materialize"})
    assert [r.path for r in report] == ["fused_keep"]
    assert report[0].kept_logits_bytes == LOGITS_NUMEL * 4
    for mode, text in (("keep", "computed when first read"), ("materialize", "kept, exact")):
        torch._dynamo.reset()
        with caplog.at_level("INFO", logger="flce_compile"):
            torch.compile(LM(), backend="flce", options={"flce.inner": "eager", "flce.logits": mode})(idx, labels)
        logged = [r for r in caplog.records if text in r.getMessage() and "options=" in r.getMessage()]
        assert len(logged) == 1 and logged[0].levelname == "INFO", mode
    assert f"{LOGITS_NUMEL * 4 / 1e9:.2f} GB" in logged[0].getMessage()
    # Logits an op of the graph reads: the log names it and does not offer "drop", which cannot free them.
    rewrite._logged_keep = False
    caplog.clear()
    torch._dynamo.reset()
    with caplog.at_level("INFO", logger="flce_compile"):
        torch.compile(_ReadsLogits(), backend="flce", options={"flce.inner": "eager"})(idx, labels)
    logged = [r.getMessage() for r in caplog.records if "so they are formed, exact" in r.getMessage()]
    assert len(logged) == 1 and "(argmax)" in logged[0] and "options=" not in logged[0], caplog.text
    assert "formed in backward" not in logged[0]
    # A reader the analysis counts as giving the logits a gradient (``detach``, kept in the op's graph): the two
    # lines agree (the site's note said a gradient buffer is formed, the other that nothing logits-sized is).
    rewrite._logged_keep = False
    caplog.clear()
    torch._dynamo.reset()
    with caplog.at_level("INFO", logger="flce_compile"):
        torch.compile(_DetachesLogits(), backend="flce", options={"flce.inner": "eager"})(idx, labels)
    (site,) = [r.getMessage() for r in caplog.records if "-> fused_keep" in r.getMessage()]
    (kept,) = [r.getMessage() for r in caplog.records if "so they are formed, exact" in r.getMessage()]
    assert "flows back through the op" in site and "(a gradient those ops give the logits is formed in backward)" \
        in kept, caplog.text


class _DetachesLogits(LM):
    """Returns the norm of its detached logits (a metric, as a forward hook logging them computes it)."""

    def forward(self, idx, labels):
        loss, logits = super().forward(idx, labels)
        return loss, logits.detach().norm()


class _ReadsLogits(LM):
    """Returns its logits' argmax (an op of the graph reads the logits; they are not returned)."""

    def forward(self, idx, labels):
        loss, logits = super().forward(idx, labels)
        return loss, logits.argmax(-1)


class _ReturnsAndMeasures(LM):
    """Returns its logits and an accuracy the graph computes from their argmax (an in-graph read that takes no
    gradient)."""

    def forward(self, idx, labels):
        loss, logits = super().forward(idx, labels)
        return loss, logits, (logits.argmax(-1) == labels).float().mean()


@pytest.mark.parametrize("use_logits", [False, True])
def test_an_argmax_metric_beside_returned_logits_leaves_no_logits_sized_tangent(use_logits):
    """An in-graph read that takes no gradient (an accuracy from the argmax) does not keep the returned logits'
    gradient in the graph: they are re-attached outside it, so a loop that reads only the loss gets no
    logits-sized zero gradient and no GEMMs on it in backward (it did: a (B, S, V) tangent, and the note spoke of
    a gradient buffer); a loss on the returned logits still reaches the weights as in eager."""
    from torch._dynamo.backends.common import aot_autograd

    torch.manual_seed(0)
    model = _ReturnsAndMeasures()
    idx, labels = _data()
    weight = 0.3 if use_logits else 0.0
    model.zero_grad(set_to_none=True)
    ref_loss, ref_logits, ref_acc = model(idx, labels)
    (ref_loss + weight * (ref_logits.float() ** 3).mean()).backward()
    ref_grads = _grads(model)
    backward_inputs = []

    def backward_compiler(gm, example_inputs):
        backward_inputs.extend(tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.op == "placeholder")
        return gm.forward

    inner = aot_autograd(fw_compiler=lambda gm, _: gm.forward, bw_compiler=backward_compiler)
    torch._dynamo.reset()
    (report,) = fc.explain(model, idx, labels)
    assert report.path == "fused_keep" and "gradient buffer" not in str(report), str(report)
    compiled = torch.compile(model, backend="flce", options={"flce.inner": inner})
    model.zero_grad(set_to_none=True)
    loss, logits, acc = compiled(idx, labels)
    (loss + weight * (logits.float() ** 3).mean()).backward()
    assert (B, S, V) not in backward_inputs and (B * S, V) not in backward_inputs, backward_inputs
    torch.testing.assert_close(acc, ref_acc, rtol=0, atol=0)
    torch.testing.assert_close(logits.detach(), ref_logits.detach(), rtol=1e-6, atol=1e-6)
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


class _CappedAndWritten(nn.Module):
    """Gemma-2's softcap, its output written in place through a ``detach`` alias after the loss (``after``) or
    before it, or (``no_grad_loss``) the loss computed under ``torch.no_grad()``; returns (loss, logits)."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.emb, self.lm_head, self.case = nn.Embedding(V, H), nn.Linear(H, V), case

    def forward(self, idx, labels):
        z = self.lm_head(self.emb(idx))
        if self.case == "no_grad_loss":
            with torch.no_grad():
                loss = F.cross_entropy(z.view(-1, V), labels.view(-1))
            return loss, z
        z = torch.tanh(z / 2.0) * 2.0
        if self.case == "before":
            z.detach().mul_(2.0)
        loss = F.cross_entropy(z.float().view(-1, V), labels.view(-1))
        if self.case == "after":
            z.detach().zero_()
        return loss, z


@pytest.mark.parametrize("case", ["after", "before", "no_grad_loss"])
@pytest.mark.parametrize("mode", ["keep", "materialize"])
def test_writes_to_capped_logits_and_a_loss_under_no_grad_are_seen(case, mode):
    """Review cases (2026-12-03), each compared with eager: a ``detach`` alias of the capped logits written after
    the loss counted as a read that takes no gradient, and the re-attached softcap gradient read the written values
    (lm_head gradient norm 119.5 against eager's 110.5); a write to them before the loss was missed, as only the
    head's output was checked (loss 4.358 against 4.843); a loss under ``no_grad`` got a gradient, the op
    running where the head ran (|dW| 1.03 against 0.22). The two last take the kept-logits path now."""
    torch.manual_seed(0)
    model = _CappedAndWritten(case)
    idx, labels = _data()

    def step(fn):
        model.zero_grad(set_to_none=True)
        loss, z = fn(idx, labels)
        total = loss + z.float().sum() if loss.requires_grad or case != "no_grad_loss" else z.float().square().mean()
        total.backward()
        return loss.detach(), loss.requires_grad, _grads(model)

    ref_loss, ref_requires, ref_grads = step(model)
    torch._dynamo.reset()
    loss, requires, grads = step(torch.compile(model, backend="flce", options={"flce.inner": "aot_eager",
                                                                                "flce.logits": mode}))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert requires == ref_requires
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)


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


@pytest.mark.parametrize("mode", ["keep", "materialize"])
def test_target_written_after_the_head(mode):
    """Labels written between the lm_head and the loss: the lazy logits' loss is fused where the loss runs, which
    sees the write; "materialize" cannot move the target before the lm_head and takes the loss from the kept
    logits."""
    torch.manual_seed(0)
    model = RelabelAfterHead()
    idx, labels = _data()
    ref_loss, ref_logits, ref_grads = _reference(model, idx, labels)
    options = {"flce.logits": mode}
    report = fc.explain(model, idx, labels, options=options)
    if mode == "keep":
        assert report[0].path == "fused_lazy", report
    else:
        assert report[0].path == "kept_logits" and "may write the target" in report[0].note
    cap = _Capture("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": cap, **options})
    model.zero_grad(set_to_none=True)
    loss, logits = compiled(idx, labels)
    loss.backward()
    assert (flce_fused_loss if mode == "keep" else flce_kept_logits_loss) in cap.targets()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, ref_logits)
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode", ["drop", "keep"])
def test_logits_under_ddp_optimizer(mode):
    """DDPOptimizer splits the graph into one submodule per gradient bucket and compiles each with our
    backend; a dropped logits output must not reach AOT as a None output (#14), and kept ones are made while the
    splitter runs each piece on fake tensors too (they read the fake weight's memory and crashed: any model over
    DDP's 25 MB bucket hit it, found by a review); at run time they are lazy, eager's values."""
    from torch._dynamo.backends.distributed import DDPOptimizer

    from flce_compile import LazyLogits

    torch.manual_seed(0)
    model = LM()
    idx, labels = _data()
    ref_loss, ref_logits, ref_grads = _reference(model, idx, labels)
    flce = fc.with_options(logits=mode, inner="aot_eager")
    ddp_opt = DDPOptimizer(bucket_bytes_cap=V * H * 4, backend_compile_fn=flce, first_bucket_cap=1)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=ddp_opt.compile_fn)
    model.zero_grad(set_to_none=True)
    loss, logits = compiled(idx, labels)
    loss.backward()
    if mode == "drop":
        assert logits is None
    else:
        assert isinstance(logits, LazyLogits) and not logits.computed
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
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


class _Inner:
    """An inner compiler (``flce.inner``) that keeps the graphs it is given and compiles them with aot_eager."""

    def __init__(self) -> None:
        self.graphs = []

    def __call__(self, gm, example_inputs, **kw):
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs, **kw)


def _softcap_args(gm) -> list:
    """The softcap argument of each fused-op call in ``gm``."""
    return [n.args[8] for n in gm.graph.nodes
            if n.op == "call_function" and n.target in (flce_fused_loss, flce_fused_loss_keep)]


@pytest.mark.parametrize("logits", ["keep", "drop"])
def test_a_softcap_left_symbolic_by_dynamic_true_is_read_at_run_time(logits):
    """Under ``dynamic=True`` Dynamo passes a float attribute (the softcap here, Gemma-2's
    ``final_logit_softcapping``) as a graph input: the op takes it as a tensor and reads it at each call. One graph
    serves every value (a new value recompiles nothing), and the loss, the gradients and the returned logits are
    eager's for each, a negative cap included (``c * tanh(s / c)`` caps at |c|)."""
    torch.manual_seed(0)
    model = LM(softcap=5.0)
    idx, labels = _data()
    inner = _Inner()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": inner, "flce.logits": logits},
                             dynamic=True)
    (site,) = fc.explain(compiled, idx, labels)
    assert site.fused and "(read at run time)" in str(site.softcap), site
    compiled_graphs = []
    if logits == "keep":  # the returned capped logits' gradient is replayed outside the graph, as for a constant;
        # formed in the forward, since a symbolic cap is not replayed when they are read
        assert site.note == "the returned logits are formed in the forward: logits_1 cannot be computed outside the " \
            "graph", site.note
    for cap, logits_weight in ((5.0, 0.0), (7.0, 0.5), (-3.0, 0.5)):
        model.softcap = cap
        ref_loss, ref_logits, ref_grads = _reference(model, idx, labels, logits_weight if logits == "keep" else 0.0)
        model.zero_grad(set_to_none=True)
        loss, out_logits = compiled(idx, labels)
        extra = logits_weight * (out_logits.float() ** 3).mean() if logits == "keep" else 0.0
        (loss + extra).backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for name, g in _grads(model).items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
        if logits == "keep":
            torch.testing.assert_close(out_logits, ref_logits, rtol=1e-5, atol=1e-5)
        else:
            assert out_logits is None
        compiled_graphs.append(len(inner.graphs))
    # (The first call may compile twice: Dynamo traces again once AOT autograd specializes the embedding's float
    # norm_type, which no op reads at run time.)
    assert compiled_graphs[1:] == compiled_graphs[:1] * 2, "a new softcap value recompiled"
    (softcap,) = _softcap_args(inner.graphs[-1])
    assert isinstance(softcap, torch.fx.Node)  # read at run time, not folded
    loss, out_logits = compiled(idx, labels)
    del out_logits  # as in `loss = model(...).loss`
    with _BigAllocations(LOGITS_NUMEL) as big:
        loss.backward()
    assert big.seen == []  # no zero tangent, no logits gradient, nothing logits-sized
    model.softcap = 0.0  # eager's c * tanh(s / c) is nan: an error names the value instead
    with pytest.raises(ValueError, match="softcap read at run time is 0.0"):
        compiled(idx, labels)


def test_a_symbolic_softcap_also_read_before_the_head_fuses_with_the_logits_kept():
    """The float is read once as a graph input (one ``item()``) and used before the lm_head too: the fused op with
    logits keeps that read where it is (it comes before the head already) and takes the softcap from it."""

    class ReadEarly(LM):
        def forward(self, idx, labels):
            h = torch.tanh(self.proj(self.emb(idx)) / self.softcap)
            logits = torch.tanh(self.lm_head(h) / self.softcap) * self.softcap
            return F.cross_entropy(logits.float().view(-1, V), labels.reshape(-1)), logits

    torch.manual_seed(0)
    model = ReadEarly(softcap=5.0)
    idx, labels = _data()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": "aot_eager"}, dynamic=True)
    (site,) = fc.explain(compiled, idx, labels)
    assert site.fused and site.path == "fused_keep", site
    for cap in (5.0, -2.0):
        model.softcap = cap
        ref_loss, ref_logits, ref_grads = _reference(model, idx, labels)
        model.zero_grad(set_to_none=True)
        loss, out_logits = compiled(idx, labels)
        loss.backward()
        _assert_as_eager(model, (loss, out_logits), (ref_loss, ref_logits, ref_grads), logits_atol=1e-5)


@pytest.mark.parametrize("read_before", [False, True])
def test_a_checkpointed_head_reads_its_symbolic_softcap_at_run_time(read_before):
    """The head and the loss inside ``torch.utils.checkpoint`` (Dynamo's checkpoint region, whose body gets
    the float as an argument: the graph input, or, when the float was read before the region too, that read as a
    plain number): fused, the value read at each call, eager's loss and gradients."""

    class Checkpointed(LM):
        def head_loss(self, h, labels):
            logits = self.lm_head(h)
            logits = torch.tanh(logits / self.softcap) * self.softcap
            return F.cross_entropy(logits.float().view(-1, V), labels.reshape(-1))

        def forward(self, idx, labels):
            h = torch.tanh(self.proj(self.emb(idx)))
            if read_before:
                h = h * (self.softcap / 5.0)
            return torch.utils.checkpoint.checkpoint(self.head_loss, h, labels, use_reentrant=False)

    torch.manual_seed(0)
    model = Checkpointed(softcap=5.0)
    idx, labels = _data()
    inner = _Inner()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": inner}, dynamic=True)
    for cap in (5.0, 9.0):
        model.softcap = cap
        model.zero_grad(set_to_none=True)
        ref = model(idx, labels)
        ref.backward()
        ref_grads = _grads(model)
        model.zero_grad(set_to_none=True)
        loss = compiled(idx, labels)
        loss.backward()
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
        for name, g in _grads(model).items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert len({id(g) for g in inner.graphs}) <= 2 and len(_softcap_args(inner.graphs[-1])) == 1


def test_a_symbolic_scale_or_a_kept_logits_softcap_is_reported_and_warned(caplog, monkeypatch):
    """What the op cannot read at run time stays unfused, with the fix in explain and in a warning: a logit scale
    Dynamo left symbolic (also inside a checkpointed region, which then stays), and a symbolic softcap on the
    kept-logits path (a per-token loss whose uncapped logits are returned, under "materialize"; the default
    computes those logits when read, and fuses the loss). The losses are eager's."""
    from flce_compile.compiler import rewrite

    class Scaled(LM):  # returns the unscaled logits
        def forward(self, idx, labels):
            logits = self.lm_head(torch.tanh(self.proj(self.emb(idx))))
            return F.cross_entropy((logits * self.softcap).float().view(-1, V), labels.reshape(-1)), logits

    class PerToken(LM):  # returns the uncapped logits
        def forward(self, idx, labels):
            logits = self.lm_head(torch.tanh(self.proj(self.emb(idx))))
            capped = torch.tanh(logits / self.softcap) * self.softcap
            loss = F.cross_entropy(capped.float().view(-1, V), labels.reshape(-1), reduction="none")
            return loss.mean(), logits

    class CheckpointedScaled(LM):  # the scaled head and its loss inside a checkpointed region
        def head_loss(self, h, labels):
            logits = self.lm_head(h) * self.softcap
            return F.cross_entropy(logits.float().view(-1, V), labels.reshape(-1))

        def forward(self, idx, labels):
            h = torch.tanh(self.proj(self.emb(idx)))
            return torch.utils.checkpoint.checkpoint(self.head_loss, h, labels, use_reentrant=False), h

    idx, labels = _data()
    for cls, mode in ((Scaled, "keep"), (PerToken, "materialize"), (CheckpointedScaled, "keep"), (PerToken, "keep")):
        monkeypatch.setattr(rewrite, "_warned_symbolic_float", False)
        caplog.clear()
        caplog.set_level(logging.WARNING, logger="flce_compile")
        torch.manual_seed(0)
        model = cls(softcap=0.5)
        ref_loss, ref_logits, _ = _reference(model, idx, labels)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="flce", options={"flce.inner": "aot_eager", "flce.logits": mode},
                                 dynamic=True)
        if cls is PerToken and mode == "keep":
            (site,) = fc.explain(compiled, idx, labels)
            assert site.path == "fused_lazy", site
            loss, logits = compiled(idx, labels)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
            continue
        (site,) = fc.explain(compiled, idx, labels)
        assert not site.fused and "Python float Dynamo left symbolic" in site.reason, (cls, site)
        assert "specialize_float = True" in site.reason
        loss, _ = compiled(idx, labels)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert any(r.levelno == logging.WARNING and "left symbolic" in r.getMessage() for r in caplog.records), cls
        with torch._dynamo.config.patch(specialize_float=True):
            (site,) = fc.explain(compiled, idx, labels)
        assert site.fused, (cls, site)


class TwoLosses(nn.Module):
    """A label-smoothed loss to train on and a plain one on the same logits and target, added (``"sum"``) or
    returned detached for logging (``"logged"``), as a custom HF ``loss_function`` might; ``"returned"`` adds them
    and returns the logits too."""

    def __init__(self, use: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.use = use

    def forward(self, idx, labels):
        logits = self.lm_head(torch.tanh(self.emb(idx)))
        flat, target = logits[:, :-1].float().reshape(-1, V), labels[:, 1:].reshape(-1)
        smoothed, plain = F.cross_entropy(flat, target, label_smoothing=0.1), F.cross_entropy(flat, target)
        if self.use == "logged":
            return smoothed, plain.detach()
        return smoothed + 0.5 * plain, logits if self.use == "returned" else None


@pytest.mark.parametrize("use", ["sum", "logged"])
def test_two_losses_on_the_same_logits_and_target_are_both_fused_plainly(use):
    """Each loss kept the logits for the other and moved the shared target's computation before the lm_head, the
    second move behind the first loss's op: the compile failed ("used before it has been defined"). Both are now
    fused, and since each one's other reader is fused too, neither forms the logits."""
    torch.manual_seed(0)
    model = TwoLosses(use)
    idx, labels = _data()
    model.zero_grad(set_to_none=True)
    ref = model(idx, labels)
    ref[0].backward()
    ref_grads = _grads(model)
    report = fc.explain(model, idx, labels)
    assert [(r.path, r.note) for r in report] == [("fused", UNKEPT_NOTE)] * 2, report
    cap = _Capture("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": cap})
    model.zero_grad(set_to_none=True)
    out = compiled(idx, labels)
    out[0].backward()
    targets = cap.targets()
    assert targets.count(flce_fused_loss) == 2 and flce_fused_loss_keep not in targets, targets
    for got, expected in zip(out, ref):
        if expected is not None:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode", ["keep", "drop"])
def test_two_losses_on_logits_that_are_also_returned(mode):
    """With the logits returned, the first loss keeps them (under "keep") and the second reads the lm_head's
    operands; under "drop" the returned logits go, and neither forms them. explain says what the pass does (under
    "drop" the kept logits took the graph output's use before it was dropped, and were returned)."""
    torch.manual_seed(0)
    model = TwoLosses("returned")
    idx, labels = _data()
    ref_loss, ref_logits, ref_grads = _reference(model, idx, labels)
    options = {"flce.logits": mode}
    expected = [("fused_keep", None), ("fused", SHARED_NOTE)] if mode == "keep" else [("fused", UNKEPT_NOTE)] * 2
    report = fc.explain(model, idx, labels, options=options)
    assert [(r.path, r.note if r.path == "fused" else None) for r in report] == expected, report
    cap = _Capture("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": cap, "flce.logits": mode})
    model.zero_grad(set_to_none=True)
    loss, logits = compiled(idx, labels)
    loss.backward()
    targets = cap.targets()
    assert (targets.count(flce_fused_loss_keep), targets.count(flce_fused_loss)) == (
        (1, 1) if mode == "keep" else (0, 2)), targets
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    if mode == "keep":
        torch.testing.assert_close(logits, ref_logits)
    else:
        assert logits is None
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_pass_that_fails_halfway_leaves_the_traced_graph(monkeypatch, caplog):
    """The backend compiles the graph as traced when the pass raises: a failure after some sites were rewritten
    left a half-rewritten graph, which then failed the compile the warning said was going ahead unchanged."""
    import flce_compile.compiler.rewrite as rewrite

    def broken(gm, nodes):
        raise RuntimeError("a bug after the rewrite")

    monkeypatch.setattr(rewrite, "erase_dead", broken)
    torch.manual_seed(0)
    model = LM()
    idx, labels = _data()
    ref_loss, ref_logits, ref_grads = _reference(model, idx, labels)
    cap = _Capture("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": cap, "flce.logits": "materialize"})
    model.zero_grad(set_to_none=True)
    with caplog.at_level(logging.WARNING, logger="flce_compile"):
        loss, logits = compiled(idx, labels)
    loss.backward()
    assert "fusion pass failed, compiling the graph unchanged" in caplog.text
    assert not any("flce" in str(t) for t in cap.targets())
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(logits, ref_logits)
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, ref_grads[name], msg=name)


class AuxLossInPlace(LM):
    """A mixture-of-experts model's loss: transformers' Mixtral and Qwen2-MoE add the router's loss in place
    (``loss += coef * aux_loss``) to the cross-entropy's result, and return the logits."""

    def forward(self, idx, labels):
        h = torch.tanh(self.proj(self.emb(idx)))
        logits = self.lm_head(h)
        loss = F.cross_entropy(logits.float().view(-1, V), labels.reshape(-1))
        loss += 1e-2 * h.square().mean()
        return loss, logits


def test_a_loss_added_to_in_place_leaves_the_logits_to_be_formed_when_read():
    """``F.cross_entropy``'s loss is new memory: an in-place add to it writes nothing the lm_head reads. It was
    taken as a write to the logits, and the logits were formed in every forward (250 MiB more at a step of
    Mixtral's with V=32000 and 2048 tokens); now the lazy path, with eager's loss, gradients and logits."""
    torch.manual_seed(0)
    model = AuxLossInPlace()
    idx, labels = _data()
    (site,) = fc.explain(model, idx, labels)
    assert site.path == "fused_lazy", site
    ref_loss, ref_logits, ref_grads = _reference(model, idx, labels)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": "aot_eager"})
    model.zero_grad(set_to_none=True)
    loss, logits = compiled(idx, labels)
    loss.backward()
    _assert_as_eager(model, (loss, logits), (ref_loss, ref_logits, ref_grads))


class ArgmaxMetric(LM):
    """Returns the logits and an accuracy the graph computes from them (no gradient through it)."""

    def forward(self, idx, labels):
        loss, logits = super().forward(idx, labels)
        return loss, logits, (logits.argmax(-1) == labels).float().mean()


def test_explain_says_why_returned_logits_are_formed_in_the_forward():
    """A fused_keep site whose returned logits could not wait to be read says why (its note was empty)."""
    (site,) = fc.explain(ArgmaxMetric(), *_data())
    assert site.path == "fused_keep", site
    assert site.note.startswith("the returned logits are formed in the forward: ") and "reads them" in site.note


def test_drop_returns_an_evaluations_logits_formed_when_read():
    """flce.logits="drop" is for training: a graph whose logits take no gradient (the Trainer's evaluate, under
    no_grad, which hands them to compute_metrics) returns them as "keep" does, computed when read, eager's values
    (they came back None, and compute_metrics was skipped without a word); a training step's are still None."""
    from flce_compile.compiler.decide import EVAL_KEEP_NOTE

    torch.manual_seed(0)
    model = LM()
    idx, labels = _data()
    options = {"flce.inner": "aot_eager", "flce.logits": "drop"}
    with torch.no_grad():
        ref_loss, ref_logits = model(idx, labels)
        (site,) = fc.explain(model, idx, labels, options=options)
        assert site.path == "fused_lazy" and site.note.startswith(EVAL_KEEP_NOTE), site
        (site,) = fc.explain(ArgmaxMetric(), idx, labels, options=options)  # (formed in the forward: say why)
        assert site.path == "fused_keep" and site.note.startswith(EVAL_KEEP_NOTE + "; the returned logits"), site
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="flce", options=options)
        loss, logits = compiled(idx, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-6)
    loss, logits = compiled(idx, labels)
    assert logits is None
    loss.backward()


@pytest.mark.parametrize("head", ["softcap", "scale"])
def test_an_fp64_models_gradient_through_returned_logits_is_fp64(head):
    """The backward of returned soft-capped or scaled logits (``outputs.LogitsGrad``) was formed in fp32, which
    rounded an fp64 model's dW and dX to ~3e-7 of eager's: it now works in the logits' own fp64."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(48, 8)
            self.lm_head = nn.Linear(8, 48, bias=False)

        def forward(self, idx, t):
            z = self.lm_head(torch.tanh(self.emb(idx)))
            logits = torch.tanh(z / 2.0) * 2.0 if head == "softcap" else z * 0.5
            loss = F.cross_entropy(logits.view(-1, 48), t.view(-1))
            return loss, logits, (logits.argmax(-1) == t).double().mean()

    gen = torch.Generator().manual_seed(0)
    idx, t = torch.randint(0, 48, (2, 6), generator=gen), torch.randint(0, 48, (2, 6), generator=gen)
    torch.manual_seed(0)
    model = Model().double()

    def step(fn):
        model.zero_grad()
        loss, logits, _ = fn(idx, t)
        (loss + (logits ** 2).sum()).backward()  # a loss on the returned logits too: their backward runs
        return model.lm_head.weight.grad.clone(), model.emb.weight.grad.clone()

    ref = step(model)
    torch._dynamo.reset()
    got = step(torch.compile(model, backend="flce", options={"flce.inner": "aot_eager"}))
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


class SuffixLoss(LM):
    """The loss on the logits of a label suffix (``logits[:, -labels.size(1):]``), plus a z-loss that reads the
    logits (so fused_keep): under dynamic shapes the slice's bound is a symbolic size Dynamo traces after the
    lm_head."""

    def forward(self, idx, labels):
        logits = self.lm_head(torch.tanh(self.proj(self.emb(idx))))
        tail = logits[:, -labels.size(1):]
        loss = F.cross_entropy(tail.reshape(-1, V), labels.reshape(-1))
        return loss + 1e-2 * logits.logsumexp(-1).square().mean(), logits


@pytest.mark.parametrize("dynamic", [True, None])
def test_a_slice_bound_traced_after_the_head_moves_before_the_op(dynamic, caplog):
    """The op with logits reads its row selection where the lm_head ran, and a symbolic bound computed after the
    head was used before it was defined: the graph failed its lint, so the site ran unfused (dynamic=None, from
    the recompile for a second length on), or the compile crashed (dynamic=True: Dynamo's restart met the half
    rewritten graph)."""
    from torch._dynamo.backends.registry import lookup_backend

    graphs = []

    def capture(gm, example_inputs, **kw):  # the graphs the inner compiler gets: what the pass made of them
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs, **kw)

    torch.manual_seed(0)
    model = SuffixLoss()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": capture}, dynamic=dynamic)
    g = torch.Generator().manual_seed(2)
    with caplog.at_level(logging.WARNING, logger="flce_compile"):
        for seq, tail in ((8, 5), (11, 6)):
            idx, labels = torch.randint(0, V, (B, seq), generator=g), torch.randint(0, V, (B, tail), generator=g)
            ref = _reference(model, idx, labels)
            model.zero_grad(set_to_none=True)
            loss, logits = compiled(idx, labels)
            loss.backward()
            _assert_as_eager(model, (loss, logits), ref)
    assert "fusion pass failed" not in caplog.text
    assert graphs and all(any(n.target is flce_fused_loss_keep for n in gm.graph.nodes) for gm in graphs), [
        [str(n.target) for n in gm.graph.nodes if n.op == "call_function"] for gm in graphs]


def test_a_failed_pass_leaves_dynamos_own_graph_as_traced(monkeypatch, caplog):
    """A pass that fails halfway is undone; Dynamo restarting its analysis afterwards (under dynamic=True, an
    embedding's float norm_type does) then clears its graph without meeting the pass's half-made nodes."""
    import flce_compile.compiler.rewrite as rewrite

    real = rewrite.run_pass

    def fails_halfway(gm, *args, **kwargs):
        nodes = list(gm.graph.nodes)
        first = next(n for n in nodes if n.op != "placeholder")
        late = next(n for n in reversed(nodes) if n.op == "call_function")
        with gm.graph.inserting_before(first):  # as the pass once did: a node used before it is defined, so
            gm.graph.call_function(torch.neg, (late,))  # erasing the graph from its end meets a node still used
        raise RuntimeError("a bug in the pass")

    monkeypatch.setattr(rewrite, "run_pass", fails_halfway)
    torch.manual_seed(0)
    model = LM()
    idx, labels = _data()
    ref = _reference(model, idx, labels)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": "aot_eager"}, dynamic=True)
    model.zero_grad(set_to_none=True)
    with caplog.at_level(logging.WARNING, logger="flce_compile"):
        loss, logits = compiled(idx, labels)
    loss.backward()
    _assert_as_eager(model, (loss, logits), ref)
    assert "fusion pass failed, compiling the graph unchanged: RuntimeError('a bug in the pass')" in caplog.text
    monkeypatch.setattr(rewrite, "run_pass", real)
