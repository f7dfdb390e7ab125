"""No silent wrong results: a write between the lm_head and the loss to anything the lm_head reads (hidden
state, weight, bias, or an alias or view of them) leaves the site unfused, with the reason in ``explain``;
writes to unrelated tensors do not. Each case runs with a frozen lm_head in training (eager autograd then keeps
no copy of the hidden state, so a fused op that read it late would get the loss and the other gradients
wrong), against the uncompiled model, through each inner compiler."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flce_compile.compiler as fc
from flce_compile.compiler.mutations import AliasMap, effect
from flce_compile.compiler.rewrite import flce_fused_loss

V = 11


class Writes(nn.Module):
    """The issue's reproducer, with one kind of write after the lm_head."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, V, bias=False)
        self.lm_head.weight.requires_grad_(False)
        self.register_buffer("buf", torch.zeros(2, 5, 8))
        self.register_buffer("count", torch.zeros(()))
        self.kind = kind

    def forward(self, x, y):
        h = self.body(x)
        if self.kind == "buffer_as_hidden":
            self.buf.copy_(h)
            h = self.buf
        logits = self.lm_head(h)
        kind = self.kind
        if kind == "item_assignment":
            h[:, :, 0] = 100.0
        elif kind == "inplace_keyword":
            F.relu(h, inplace=True)
        elif kind == "inplace_positional":
            F.relu(h, True)
        elif kind == "out":
            with torch.no_grad():
                torch.mul(h, 2.0, out=h)
        elif kind == "copy_":
            h.copy_(torch.ones_like(h))
        elif kind == "method_":
            h.mul_(3.0)
        elif kind == "view_write":
            h.view(-1)[0] = 5.0
        elif kind == "parameter_write":
            with torch.no_grad():
                self.lm_head.weight.mul_(0.5)
        elif kind == "foreach_write":  # a list-taking in-place op (an in-forward decay of the head's parameters)
            with torch.no_grad():
                torch._foreach_mul_(list(self.lm_head.parameters()), 0.5)
        elif kind == "foreach_keyword":  # the written list given by keyword
            torch._foreach_mul_(self=[h], scalar=3.0)
        elif kind == "aten_list_overload":  # an OpOverload whose written argument is a list
            torch.ops.aten._foreach_mul_.Scalar([h], 3.0)
        elif kind == "inplace_function_keyword":
            torch.relu_(input=h)
        elif kind == "buffer_as_hidden":
            self.buf.add_(1.0)
        elif kind == "unrelated_buffer":
            self.count.add_(1.0)
        elif kind == "unrelated_setitem":
            z = h.clone()
            z[:, :, 0] = 1.0
        return F.cross_entropy(logits.view(-1, V), y.view(-1))


WRITES = ["item_assignment", "inplace_keyword", "inplace_positional", "out", "copy_", "method_", "view_write",
          "parameter_write", "foreach_write", "foreach_keyword", "aten_list_overload", "inplace_function_keyword",
          "buffer_as_hidden"]
HARMLESS = ["unrelated_buffer", "unrelated_setitem"]
X, Y = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0)), torch.randint(0, V, (2, 5))


def _fresh(kind: str) -> Writes:
    torch.manual_seed(0)
    return Writes(kind)


def _step(model: Writes, fn) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    if model.kind in ("parameter_write", "foreach_write"):  # eager autograd saved the weight: training would
        # raise, in eager too
        with torch.no_grad():
            return float(fn(X, Y)), torch.zeros(1)
    loss = fn(X, Y)
    loss.backward()
    return float(loss), model.body.weight.grad.clone()


def _compiled_step(kind: str, inner: str):
    graphs = []

    def capture(gm, example_inputs, **kw):
        graphs.append(gm)
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(inner)(gm, example_inputs, **kw)

    torch._dynamo.reset()
    model = _fresh(kind)
    got = _step(model, torch.compile(model, backend="flce", options={"flce.inner": capture}))
    return got, graphs


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
@pytest.mark.parametrize("kind", WRITES + HARMLESS)
def test_write_between_head_and_loss(kind, inner):
    ref_model = _fresh(kind)
    ref_loss, ref_grad = _step(ref_model, ref_model)
    (loss, grad), graphs = _compiled_step(kind, inner)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    fused = any(n.target is flce_fused_loss for gm in graphs for n in gm.graph.nodes)
    assert fused == (kind in HARMLESS)


@pytest.mark.parametrize("kind", ["item_assignment", "inplace_keyword", "parameter_write"])
def test_write_between_head_and_loss_inductor(kind):
    ref_model = _fresh(kind)
    ref_loss, ref_grad = _step(ref_model, ref_model)
    (loss, grad), _ = _compiled_step(kind, "inductor")
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind, text", [
    ("item_assignment", "item assignment"), ("inplace_keyword", "inplace=True"), ("out", "out="),
    ("copy_", "copy_"), ("parameter_write", "mul_"), ("foreach_write", "_foreach_mul_"), ("buffer_as_hidden", "add_"),
])
def test_explain_names_the_write(kind, text):
    report = fc.explain(_fresh(kind), X, Y)
    assert len(report) == 1 and not report[0].fused
    assert text in report[0].reason and "lm_head reads" in report[0].reason


def test_unknown_calls_are_assumed_to_write_their_tensors():
    """Purity is proven, not presumed: a call the pass does not know may write every tensor it is given, and
    an op's result shares memory with its inputs unless the op is known to make a new tensor."""

    def opaque(t):  # stands for library code Dynamo leaves as a call
        return t

    g = torch.fx.Graph()
    h = g.placeholder("h")
    w = g.placeholder("w")
    view = g.call_method("view", (h, -1))
    fresh = g.call_function(torch.tanh, (h,))
    call = g.call_function(opaque, (view, w))
    setitem = g.call_function(__import__("operator").setitem, (view, 0, 1.0))
    foreach = g.call_function(torch._foreach_mul_, ([view, w], 0.5))  # writes each tensor of its list
    g.output((fresh, call, setitem, foreach))
    gm = torch.fx.GraphModule(nn.Module(), g)
    aliases = AliasMap(gm)
    assert effect(gm, call).writes == (view, w)
    assert effect(gm, setitem).writes == (view,)
    assert effect(gm, foreach).writes == (view, w)
    assert effect(gm, fresh).writes == () and effect(gm, fresh).fresh
    assert aliases.roots[view] >= aliases.roots[h]  # a view shares the hidden state's memory
    assert not aliases.roots[fresh] & aliases.roots[h]
    assert aliases.first_write(h, fresh, aliases.roots[h]) is None
    assert aliases.first_write(fresh, g.output_node if hasattr(g, "output_node") else list(g.nodes)[-1],
                               aliases.roots[h]) is call


def test_operator_dunder_methods_have_their_operators_effect():
    """torch 2.11's Dynamo records ``a == b`` as the method call ``a.__eq__(b)``: it reads and makes a new
    tensor, as ``operator.eq`` does; ``+a`` (``torch.positive``) returns ``a`` itself, in either spelling, and
    ``a &= b`` writes ``a``."""
    import operator

    g = torch.fx.Graph()
    a = g.placeholder("a")
    b = g.placeholder("b")
    eq = g.call_method("__eq__", (a, b))
    pos_method = g.call_method("__pos__", (a,))
    pos_operator = g.call_function(operator.pos, (a,))
    iand = g.call_method("__iand__", (a, b))
    g.output((eq, pos_method, pos_operator, iand))
    gm = torch.fx.GraphModule(nn.Module(), g)
    assert effect(gm, eq).writes == () and effect(gm, eq).fresh
    for pos in (pos_method, pos_operator):
        assert effect(gm, pos).writes == () and not effect(gm, pos).fresh
    assert effect(gm, iand).writes == (a,)
    aliases = AliasMap(gm)
    assert aliases.roots[pos_method] >= aliases.roots[a] and not aliases.roots[eq] & aliases.roots[a]


class TwoInputs(nn.Module):
    """The hidden states and a second input written after the lm_head: a view of the hidden states, or not."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lm_head = nn.Linear(8, V)

    def forward(self, h, other, y):
        logits = self.lm_head(h)
        other.mul_(0.0)
        return F.cross_entropy(logits.view(-1, V), y.view(-1))


@pytest.mark.parametrize("aliased", [True, False])
def test_a_write_to_an_input_that_shares_the_hidden_states_memory_is_seen(aliased):
    """Graph inputs that share memory (the hidden states and a view of them, passed apart) share an alias root:
    a write through the view between the lm_head and the loss leaves the site unfused; an unrelated input does
    not."""
    model, graphs = TwoInputs(), []

    def capture(gm, example_inputs, **kw):
        graphs.append(gm)
        return gm

    def call(fn):
        h = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            return float(fn(h, h[:, :3] if aliased else torch.ones(2, 3, 8), Y))

    torch._dynamo.reset()
    got = call(torch.compile(model, backend="flce", options={"flce.inner": capture}))
    assert got == pytest.approx(call(model), rel=1e-6)
    fused = any(n.target is flce_fused_loss for gm in graphs for n in gm.graph.nodes)
    assert fused == (not aliased)
