"""Options of backend="flce": validation, pass-through to the inner compiler, registration."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flce_compile.compiler as fc
from flce_compile.compiler.backend import compiled_options
from flce_compile.compiler.options import split_options
from flce_compile.compiler.rewrite import flce_fused_loss

V, H = 64, 8


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, x, t):
        return F.cross_entropy(self.lm_head(x).view(-1, V), t.view(-1))


def _inputs():
    return torch.randn(2, 3, H), torch.randint(0, V, (2, 3))


def test_split_options_routes_keys():
    ours, inner = split_options({"flce.logits": "drop", "flce.inner": "eager", "max_autotune": True})
    assert ours.logits == "drop" and ours.inner == "eager" and inner == {"max_autotune": True}
    assert split_options({"flce.config": {"chunk_tokens": 64}})[0].config == {"chunk_tokens": 64}


@pytest.mark.parametrize("options,match", [
    ({"flce.bogus": 1}, r"unknown option 'flce.bogus'.*flce.inner.*flce.logits.*flce.config.*flce.enabled"),
    ({"flce.logits": "discard"}, r"flce.logits.*'keep', 'materialize', 'drop'"),
    ({"flce.inner": "no_such_backend"}, r"flce.inner.*not a registered"),
    ({"flce.inner": "flce"}, r"recurse"),
    ({"flce.enabled": "yes"}, r"flce.enabled"),
    ({"flce.config": {"chunk_size": 3}}, r"flce.config.*unknown keys"),
    ({"flce.inner_failure": "skip"}, r"flce.inner_failure.*'traced', 'dynamo'"),
    ({"flce.logit": "drop"}, r"unknown option 'flce.logit'.*did you mean 'flce.logits'"),
    # Ours without the prefix, or with it in capitals, would go to the inner compiler and be lost there.
    ({"logits": "drop"}, r"option 'logits' would go to the inner compiler \(inductor\).*'flce.logits'"),
    ({"logits": "drop", "flce.inner": "aot_eager"}, r"option 'logits' would go to the inner compiler \(aot_eager"),
    ({"FLCE.logits": "drop", "flce.inner": "eager"}, r"'FLCE.logits'.*lower case.*did you mean 'flce.logits'"),
])
def test_invalid_options_name_the_key(options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        split_options(options)
    with pytest.raises(Exception, match=match):  # and through torch.compile (wrapped by Dynamo)
        torch._dynamo.reset()
        torch.compile(Tiny(), backend="flce", options=dict(options))(*_inputs())


def _captured(options=None, mode=None, backend="flce"):
    seen = {}

    def inner(gm, example_inputs, **kwargs):
        seen["gm"], seen["kwargs"] = gm, kwargs
        return gm.forward

    torch._dynamo.reset()
    opts = {"flce.inner": inner, **(options or {})}
    compiled = torch.compile(Tiny(), backend=backend, options=opts) if mode is None else \
        torch.compile(Tiny(), backend=fc.with_options(opts, mode=mode))
    compiled(*_inputs())
    return seen


def _recording(graphs: list, inner: str | None = None):
    """An inner compiler that appends each graph it gets to ``graphs`` and runs it as it is, or through the
    backend named ``inner``."""
    def backend(gm, example_inputs, **kwargs):
        graphs.append(gm)
        if inner is None:
            return gm.forward
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(inner)(gm, example_inputs, **kwargs)

    return backend


def test_other_options_and_mode_reach_the_inner_compiler():
    seen = _captured({"some.inner.option": 3})
    assert seen["kwargs"] == {"options": {"some.inner.option": 3}}
    seen = _captured(mode="max-autotune")
    assert seen["kwargs"] == {"mode": "max-autotune"}
    assert [n.target for n in seen["gm"].graph.nodes].count(flce_fused_loss) == 1


def test_enabled_false_is_the_inner_compiler_alone():
    seen = _captured({"flce.enabled": False})
    assert flce_fused_loss not in [n.target for n in seen["gm"].graph.nodes]
    assert F.cross_entropy in [n.target for n in seen["gm"].graph.nodes]


def test_forced_config_reaches_the_op():
    seen = _captured({"flce.config": {"chunk_tokens": 2}})
    node = next(n for n in seen["gm"].graph.nodes if n.target is flce_fused_loss)
    assert node.args[10]["chunk_tokens"] == 2


def test_backend_object_and_name_and_entry_point():
    x, t = _inputs()
    m = Tiny()
    ref = m(x, t)
    for backend in ("flce", fc.flce_backend, fc.with_options(inner="eager", logits="drop")):
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(m, backend=backend, options=None)(x, t), ref)
    ep = importlib.metadata.EntryPoint(name="flce", value="flce_compile.compiler.backend:flce_backend",
                                       group="torch_dynamo_backends")
    assert ep.load() is fc.flce_backend
    assert "flce" in torch._dynamo.list_backends(exclude_tags=())


def test_a_bare_option_name_of_ours_passes_to_an_inner_compiler_of_the_users_own():
    """Another inner compiler may take an option called ``logits`` itself: it gets it, as every unprefixed key."""
    seen = {}

    def inner(gm, example_inputs, **kwargs):
        seen.update(kwargs)
        return gm.forward

    ours, rest = split_options({"logits": 3, "flce.inner": inner})
    assert ours.logits == "keep" and rest == {"logits": 3}
    torch._dynamo.reset()
    torch.compile(Tiny(), backend="flce", options={"logits": 3, "flce.inner": inner})(*_inputs())
    assert seen.get("options") == {"logits": 3}


def test_a_with_options_backend_pickles_with_its_options():
    """A closure before, which pickle refused ("Can't pickle local object"), where the options= spelling pickles."""
    import pickle

    backend = pickle.loads(pickle.dumps(fc.with_options(logits="drop", inner="aot_eager", mode=None)))
    assert backend.flce_options == {"flce.logits": "drop", "flce.inner": "aot_eager"}
    torch._dynamo.reset()
    model = Tiny()
    compiled = torch.compile(model, backend=backend)
    x, t = _inputs()
    torch.testing.assert_close(compiled(x, t), model(x, t))
    assert compiled_options(compiled).logits == "drop"


def test_with_options_takes_the_prefixed_spelling_too():
    assert fc.with_options(**{"flce.logits": "drop"}).flce_options == {"flce.logits": "drop"}
    assert fc.with_options(logits="drop").flce_options == {"flce.logits": "drop"}


def test_with_options_validates_eagerly():
    with pytest.raises(ValueError, match="flce.logits"):
        fc.with_options(logits="nope")
    # with Inductor inside, the mode and Inductor's own option names too, as torch.compile checks them for it
    with pytest.raises(RuntimeError, match="mode=reduce_overhead"):
        fc.with_options(mode="reduce_overhead")
    with pytest.raises(RuntimeError, match="no_such_inductor_option"):
        fc.with_options({"no_such_inductor_option": True}, logits="drop")
    assert fc.with_options(mode="max-autotune", logits="drop").mode == "max-autotune"
    assert fc.with_options({"max_autotune": True}).flce_options == {"max_autotune": True}
    # another inner compiler's mode is that compiler's to read, when it compiles
    assert fc.with_options(mode="whatever", inner="aot_eager").mode == "whatever"


def test_precision_and_memory_budget_reach_the_op():
    """flce.precision and flce.memory_budget_gb become the fused op's keyword arguments (and are validated)."""
    lm_head = torch.nn.Linear(16, 64, bias=False)

    def fn(x, t):
        return F.cross_entropy(lm_head(x).view(-1, 64), t.view(-1))

    graphs = []
    x, t = torch.randn(2, 8, 16), torch.randint(0, 64, (2, 8))
    torch._dynamo.reset()
    options = {"flce.inner": _recording(graphs), "flce.precision": "compact", "flce.memory_budget_gb": 0.5}
    loss = torch.compile(fn, backend="flce", options=options)(x, t)
    torch.testing.assert_close(loss, fn(x, t), rtol=1e-5, atol=1e-6)
    (node,) = [n for n in graphs[0].graph.nodes if n.target is flce_fused_loss]
    assert node.kwargs == {"precision": "compact", "memory_budget_gb": 0.5}
    for bad, match in ((("flce.precision", "fastest"), r"flce.precision.*'exact', 'compact', 'precise'"),
                       (("flce.precision", None), "flce.precision"), (("flce.memory_budget_gb", -1), "positive")):
        with pytest.raises(ValueError, match=match):
            split_options(dict([bad]))


def test_precise_precision_reaches_the_op():
    """flce.precision="precise" is accepted and becomes the fused op's keyword argument; the compiled loss and
    gradients match eager's (fp32 here: the policy changes nothing but the GEMM's output dtype)."""
    lm_head = torch.nn.Linear(16, 64, bias=False)

    def fn(x, t):
        return F.cross_entropy(lm_head(x).view(-1, 64), t.view(-1))

    graphs = []
    x, t = torch.randn(2, 8, 16, requires_grad=True), torch.randint(0, 64, (2, 8))
    torch._dynamo.reset()
    options = {"flce.inner": _recording(graphs), "flce.precision": "precise"}
    loss = torch.compile(fn, backend="flce", options=options)(x, t)
    (node,) = [n for n in graphs[0].graph.nodes if n.target is flce_fused_loss]
    assert node.kwargs == {"precision": "precise"}
    (gx,) = torch.autograd.grad(loss, [x])
    x_ref = x.detach().requires_grad_()
    ref = fn(x_ref, t)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, x_ref.grad, rtol=1e-5, atol=1e-6)


def test_explain_names_the_options_it_ran_under_and_each_sites_chunking():
    """A review (2026-12-04) found explain's first line naming only flce.logits, flce.inner and flce.config, and
    each site naming its strategy but not its config: the precision, budget and chunk size were missing."""
    lm_head = nn.Linear(16, 100, bias=False)

    def fn(x, t):
        return F.cross_entropy(lm_head(x), t)

    x, t = torch.randn(32, 16), torch.randint(0, 100, (32,))
    plain = fc.explain(fn, x, t, options={"flce.inner": "aot_eager"})
    assert "flce.precision" not in str(plain)  # defaults are not repeated
    options = {"flce.inner": "aot_eager", "flce.precision": "compact", "flce.config": {"chunk_tokens": 8},
               "flce.checkpoint_side_effects": "replay"}
    report = fc.explain(fn, x, t, options=options)
    first = str(report).splitlines()[0]
    assert "flce.precision='compact'" in first and "flce.config={'chunk_tokens': 8}" in first
    assert "flce.checkpoint_side_effects='replay'" in first  # (left out until a docs sweep, 2026-12-05)
    (site,) = report
    assert site.strategy.endswith("chunk_tokens=8)") and "est. memory" in str(site) and "MiB" in str(site)


def test_explain_follows_the_memory_budget(monkeypatch):
    """explain reports the config a memory budget makes the op run, and a budget no config fits as the error the
    backend raises, as an eager call does: left unfused, the loss would use more memory still (bf16 on the CPU:
    the chunked strategy's fp32 dW accumulator, 8 MiB, cannot fit 7 MiB; the op runs "recompute" there)."""
    import flce_compile.op as op_module

    lm_head = nn.Linear(256, 8192, bias=False).to(torch.bfloat16)

    def fn(x, t):
        return F.cross_entropy(lm_head(x).view(-1, 8192).float(), t.view(-1))

    x, t = torch.randn(2, 256, 256, dtype=torch.bfloat16, requires_grad=True), torch.randint(0, 8192, (2, 256))
    calls = []
    original = op_module.recompute_backward
    monkeypatch.setattr(op_module, "recompute_backward", lambda *a, **k: calls.append(1) or original(*a, **k))
    for budget, fused, strategy in ((7 / 1024, True, "recompute"), (1e-6, False, None)):
        options = {"flce.inner": "aot_eager", "flce.memory_budget_gb": budget}
        (site,) = fc.explain(fn, x, t, options=options)
        assert site.fused == fused
        if fused:
            assert site.strategy.startswith(strategy + " (")
        else:
            assert site.reason.startswith("the compile raises: memory_budget_gb=") and "raise the budget" in site.reason
        graphs = []
        calls.clear()
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="flce", options={**options, "flce.inner": _recording(graphs)})
        if not fused:
            with pytest.raises(Exception, match=r"BudgetError: memory_budget_gb=.*raise the budget"):
                compiled(x, t)
            continue
        compiled(x, t).backward()
        assert any(n.target is flce_fused_loss for gm in graphs for n in gm.graph.nodes) == fused
        assert bool(calls) == (strategy == "recompute")  # what explain said is what ran


def test_a_second_backward_through_a_compiled_graph_gives_the_same_gradients():
    """Inside a compiled graph the op's backward scales a copy of the forward's gradients, so
    ``retain_graph=True`` and a second backward add the same gradients again (a direct call raises instead)."""
    torch.manual_seed(0)
    model, (x, t) = Tiny(), _inputs()
    model(x, t).backward()
    once = model.lm_head.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    graphs = []
    torch._dynamo.reset()
    loss = torch.compile(model, backend="flce", options={"flce.inner": _recording(graphs, "aot_eager")})(x, t)
    assert any(n.target is flce_fused_loss for gm in graphs for n in gm.graph.nodes)
    loss.backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(model.lm_head.weight.grad, 2 * once, rtol=1e-5, atol=1e-6)
