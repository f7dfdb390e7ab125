"""The backend's inner compiler failing on a graph: run as traced with the fused loss (an error Dynamo answers with
a graph break, ``flce.inner_failure="traced"``), or left to torch.compile."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import flce_compile.compiler  # noqa: F401  (registers backend="flce")
from flce_compile.compiler.inner import _checkpointed
from flce_compile.compiler.patterns import is_checkpoint
from flce_compile.compiler.rewrite import flce_fused_loss

V, H = 64, 8


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, x, t):
        return F.cross_entropy(self.lm_head(x).view(-1, V), t.view(-1))


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, H, generator=g), torch.randint(0, V, (2, 3), generator=g)


def _failing_on_fused(calls: list, error: Exception):
    """An inner compiler that raises ``error`` on graphs holding a fused site and runs the others as they are;
    ``calls`` records, per graph, whether it held one."""
    def fails_on_fused_graphs(gm, example_inputs, **kwargs):
        calls.append(flce_fused_loss in [n.target for n in gm.graph.nodes])
        if calls[-1]:
            raise error
        return gm.forward

    return fails_on_fused_graphs


def _step(model, fn, x, t):
    model.zero_grad(set_to_none=True)
    loss = fn(x, t)
    loss.backward()
    return loss, model.lm_head.weight.grad.clone()


def test_a_fallback_failure_on_a_fused_graph_runs_it_as_traced_with_the_fused_loss(caplog):
    """The failure Dynamo answers with a graph break (a data-dependent operator: transformers 5.17's
    MoE expert GEMM with fp32 weights under torch 2.11) no longer costs the fused loss: the graph runs as traced,
    the fused op in it, with eager's loss and gradients, and the backend says why and how to opt out."""
    calls = []
    model, (x, t) = Tiny(), _inputs()
    ref, ref_grad = _step(model, model, x, t)
    torch._dynamo.reset()
    inner = _failing_on_fused(calls, DataDependentOutputException(torch.ops.aten._local_scalar_dense.default))
    compiled = torch.compile(model, backend="flce", options={"flce.inner": inner})
    with caplog.at_level("WARNING", logger="flce_compile"):
        for _ in range(2):  # the traced graph is Dynamo's compiled code from then on
            loss, grad = _step(model, compiled, x, t)
            assert type(loss.grad_fn).__name__ == "_FusedFunctionBackward"
            torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert calls == [True]  # compiled once, and Dynamo kept the frame
    text = caplog.text
    assert "inner compiler 'fails_on_fused_graphs' failed on a graph with a fused lm_head/loss site" in text
    assert "DataDependentOutputException" in text and "runs this graph as traced" in text
    assert "flce.inner_failure='traced'; 'dynamo'" in text


class CheckpointedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, x, t):
        h = checkpoint(lambda y: torch.sin(y) * self.layer(y), x, use_reentrant=False)
        return F.cross_entropy(self.lm_head(h).view(-1, V), t.view(-1))


class _CountSin(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.sin = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.sin += func is torch.ops.aten.sin.default
        return func(*args, **(kwargs or {}))


def test_a_graph_run_as_traced_keeps_its_checkpointed_regions_checkpointed():
    """Run outside a compiler, torch 2.11's checkpoint calls in a Dynamo graph keep their region's activations
    (pytorch/pytorch#160773): the traced graph calls checkpoint itself, so backward recomputes the region (its
    sin runs again) and the loss and gradients are eager's."""
    calls, graphs = [], []
    model = CheckpointedLayer()
    x, t = _inputs()
    x.requires_grad_()
    model.zero_grad(set_to_none=True)
    ref = model(x, t)
    ref_grads = torch.autograd.grad(ref, [x, *model.parameters()])
    torch._dynamo.reset()
    failing = _failing_on_fused(calls, DataDependentOutputException(torch.ops.aten._local_scalar_dense.default))

    def inner(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return failing(gm, example_inputs, **kwargs)

    loss = torch.compile(model, backend="flce", options={"flce.inner": inner})(x, t)
    assert calls == [True] and type(loss.grad_fn).__name__ == "_FusedFunctionBackward"
    targets = [n.target for n in graphs[0].graph.nodes]
    assert _checkpointed in targets and not any(is_checkpoint(n) for n in graphs[0].graph.nodes)
    with _CountSin() as counter:
        grads = torch.autograd.grad(loss, [x, *model.parameters()])
    assert counter.sin == 1  # the region ran again in backward (its product saves sin(y))
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _traced_run(model, x, t, seed=0):
    """Loss and gradients of ``model`` eager and through backend="flce" with an inner compiler that fails on the
    fused graph (so it runs as traced), each from ``seed``, with aten.sin calls counted in each backward."""
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        calls = []
        inner = _failing_on_fused(calls, DataDependentOutputException(torch.ops.aten._local_scalar_dense.default))
        fn = torch.compile(model, backend="flce", options={"flce.inner": inner}) if compiled else model
        torch.manual_seed(seed)
        loss = fn(x, t)
        with _CountSin() as counter:
            grads = torch.autograd.grad(loss, [x, *model.parameters()])
        runs.append((loss, grads, counter.sin, calls))
    return runs


class NestedCheckpoints(CheckpointedLayer):
    def forward(self, x, t):
        def outer(y):
            return checkpoint(lambda z: torch.sin(z) * self.layer(z), y, use_reentrant=False) * torch.sin(y)

        h = checkpoint(outer, x, use_reentrant=False)
        return F.cross_entropy(self.lm_head(h).view(-1, V), t.view(-1))


class DropoutInCheckpoint(CheckpointedLayer):
    def forward(self, x, t):
        h = checkpoint(lambda y: F.dropout(torch.sin(y) * self.layer(y), 0.5, training=True), x, use_reentrant=False)
        return F.cross_entropy(self.lm_head(h).view(-1, V), t.view(-1))


def _save_sin(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func is torch.ops.aten.sin.default else CheckpointPolicy.PREFER_RECOMPUTE


class SelectiveCheckpoint(CheckpointedLayer):
    def forward(self, x, t):
        h = checkpoint(lambda y: torch.sin(y) * self.layer(y), x, use_reentrant=False,
                       context_fn=functools.partial(create_selective_checkpoint_contexts, _save_sin))
        return F.cross_entropy(self.lm_head(h).view(-1, V), t.view(-1))


def test_a_selectively_checkpointed_region_keeps_its_policy():
    """Selective checkpointing's policy (kept by Dynamo on the region's body) holds when the graph runs as traced:
    the sin it saves is not recomputed, as in eager."""
    x, t = _inputs()
    (ref, ref_grads, ref_sin, _), (loss, grads, sin, calls) = _traced_run(SelectiveCheckpoint(), x.requires_grad_(), t)
    assert calls == [True] and sin == ref_sin == 0
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type", [NestedCheckpoints, DropoutInCheckpoint])
def test_nested_and_random_checkpointed_regions_run_as_eager_runs_them(model_type):
    """A region inside a checkpointed region is checkpointed too (backward recomputes as often as eager's), and a
    region that draws random numbers recomputes with the same ones (the RNG state kept, as eager's checkpoint
    does): eager's loss and gradients."""
    x, t = _inputs()
    (ref, ref_grads, ref_sin, _), (loss, grads, sin, calls) = _traced_run(model_type(), x.requires_grad_(), t)
    assert calls == [True] and type(loss.grad_fn).__name__ == "_FusedFunctionBackward"
    assert sin == ref_sin > 0
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@torch.library.custom_op("flce_test::doubled", mutates_args=())
def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@torch.library.custom_op("flce_test::doubled_grad", mutates_args=())
def _doubled_grad(g: torch.Tensor) -> torch.Tensor:
    return g * 2


@_doubled.register_fake
def _(x):
    return torch.empty_like(x)


@_doubled_grad.register_fake
def _(g):  # as a backward that reads sizes on the host (transformers 5.17's MoE GEMM under torch 2.11)
    raise DataDependentOutputException(torch.ops.aten._local_scalar_dense.default)


_doubled.register_autograd(lambda ctx, g: _doubled_grad(g))


class DataDependentBackward(CheckpointedLayer):
    def forward(self, x, t):
        h = torch.sin(_doubled(self.layer(x)))
        return F.cross_entropy(self.lm_head(h).view(-1, V), t.view(-1))


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_real_inner_compiler_failure_runs_as_traced(fullgraph, caplog):
    """AOT autograd itself failing on an operator whose backward it cannot trace (the error torch raises, not one
    a test makes up): the graph runs as traced with the fused loss, also under fullgraph=True (logged)."""
    model, (x, t) = DataDependentBackward(), _inputs()
    x.requires_grad_()
    ref = model(x, t)
    ref_grads = torch.autograd.grad(ref, [x, *model.parameters()])
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": "aot_eager"}, fullgraph=fullgraph)
    with caplog.at_level("WARNING", logger="flce_compile"):
        loss = compiled(x, t)
    grads = torch.autograd.grad(loss, [x, *model.parameters()])
    assert type(loss.grad_fn).__name__ == "_FusedFunctionBackward"
    assert "inner compiler 'aot_eager' failed" in caplog.text and "runs this graph as traced" in caplog.text
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_inner_failure_dynamo_leaves_the_failure_to_torch_compile(caplog):
    """With flce.inner_failure="dynamo", Dynamo breaks the graph there: the loss is right, but unfused."""
    calls = []
    model, (x, t) = Tiny(), _inputs()
    ref, ref_grad = _step(model, model, x, t)
    torch._dynamo.reset()
    inner = _failing_on_fused(calls, DataDependentOutputException(torch.ops.aten._local_scalar_dense.default))
    compiled = torch.compile(model, backend="flce", options={"flce.inner": inner, "flce.inner_failure": "dynamo"})
    with caplog.at_level("WARNING", logger="flce_compile"):
        loss, grad = _step(model, compiled, x, t)
    assert calls[0] and type(loss.grad_fn).__name__ != "_FusedFunctionBackward"
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, ref_grad)
    assert "failed on a graph with a fused lm_head/loss site" in caplog.text
    assert "runs this graph as traced" not in caplog.text and "please report it" in caplog.text


def test_an_inner_compiler_failure_on_a_fused_graph_is_explained(caplog):
    """Any other failure on a graph holding a fused site goes to torch.compile, which raises it: the backend says
    so and names the inner compiler; it does not run the graph as traced (that would hide a compiler's bug)."""
    calls = []
    torch._dynamo.reset()
    model, (x, t) = Tiny(), _inputs()
    inner = _failing_on_fused(calls, RuntimeError("aten._local_scalar_dense.default"))
    compiled = torch.compile(model, backend="flce", options={"flce.inner": inner})
    with caplog.at_level("WARNING", logger="flce_compile"), pytest.raises(Exception, match="_local_scalar_dense"):
        compiled(x, t)
    assert calls == [True]
    text = caplog.text
    assert "inner compiler 'fails_on_fused_graphs' failed on a graph with a fused lm_head/loss site" in text
    assert "RuntimeError: aten._local_scalar_dense.default" in text and "please report it" in text
    assert "runs this graph as traced" not in text


def test_a_restart_of_the_analysis_is_no_inner_failure(caplog):
    """Dynamo's restart of the analysis out of the inner compiler (AOT autograd raises
    TensorifyScalarRestartAnalysis when it specializes a float under dynamic=True) is Dynamo tracing the frame
    again, not a failure: no warning."""
    from torch._dynamo.backends.registry import lookup_backend

    calls = []

    def restarts_once(gm, example_inputs, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch._dynamo.exc.TensorifyScalarRestartAnalysis()
        return lookup_backend("aot_eager")(gm, example_inputs, **kwargs)

    torch._dynamo.reset()
    model, (x, t) = Tiny(), _inputs()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": restarts_once})
    with caplog.at_level("WARNING", logger="flce_compile"):
        torch.testing.assert_close(compiled(x, t), model(x, t))
    assert len(calls) == 2 and "failed on a graph" not in caplog.text


@pytest.mark.parametrize("error", [RuntimeError("inner compiler failure"),
                                   DataDependentOutputException(torch.ops.aten._local_scalar_dense.default)])
def test_an_inner_compiler_failure_without_a_fused_site_is_not_ours(caplog, error):
    """A graph with no fused site is the inner compiler's alone: its failure goes to torch.compile, unlogged."""
    def fails(gm, example_inputs, **kwargs):
        raise error

    torch._dynamo.reset()
    compiled = torch.compile(Tiny(), backend="flce", options={"flce.inner": fails, "flce.enabled": False})
    with caplog.at_level("WARNING", logger="flce_compile"):
        try:
            compiled(*_inputs())
        except Exception:  # noqa: BLE001 - torch.compile's own handling of a failing backend
            pass
    assert "failed on a graph with a fused" not in caplog.text
