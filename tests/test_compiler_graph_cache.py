"""Rewritten graphs and torch's compile caches: a backward compiled by an earlier run (from the FX graph cache)
must never hand a backward that keeps its graph wrong gradients (``compiler.graph_cache``)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flce_compile.compiler  # noqa: F401  (registers backend="flce")
from flce_compile.compiler import graph_cache
from flce_compile.compile_cache_key import ENTRY, cache_key, source_key

V, H = 48, 16


class TiedLM(nn.Module):
    """An embedding tied to the lm_head, as GPT-2 and Llama-3.2-1B have it: the lm_head's gradient and the
    embedding's meet in one buffer in the compiled backward."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.mix = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids, labels):
        h = torch.tanh(self.mix(self.embed(ids)))
        return F.cross_entropy(self.lm_head(h).view(-1, V), labels.view(-1))


def _fresh_cache():
    from torch._inductor import utils

    return (getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache)()


def _grads_after(model, fn, ids, labels, scales):
    """The tied weight's gradient after each backward of one forward, by ``scales`` (all but the last keep the
    graph)."""
    loss = fn(ids, labels)
    out = []
    for i, s in enumerate(scales):
        (s * loss).backward(retain_graph=i < len(scales) - 1)
        out.append(model.embed.weight.grad.clone())
    return out


def test_a_backward_that_keeps_its_graph_never_runs_a_cached_one_that_overwrote_its_saved_gradients():
    """A second run (here: after ``torch._dynamo.reset()``, from the same on-disk caches) whose first backward keeps
    the graph: its gradients are eager's, or torch refuses the cached backward with its own error, as for any
    compiled model (it does here). Before, the FX graph cache served the backward compiled for a single backward,
    which overwrote the forward's lm_head gradient it had saved: after the second backward the tied weight's
    gradient was 4.10x the first's where eager's is 5x (max error 22%), with nothing raised."""
    torch.manual_seed(0)
    base = TiedLM()
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, V, (2, 8), generator=g), torch.randint(0, V, (2, 8), generator=g)
    eager_model = copy.deepcopy(base)
    expected = _grads_after(eager_model, eager_model, ids, labels, (0.5, 2.0))
    with _fresh_cache():
        torch._dynamo.reset()
        first = copy.deepcopy(base)
        torch.compile(first, backend="flce")(ids, labels).backward()  # a backward that runs once, cached
        torch._dynamo.reset()
        second = copy.deepcopy(base)
        try:
            got = _grads_after(second, torch.compile(second, backend="flce"), ids, labels, (0.5, 2.0))
        except RuntimeError as exc:
            assert "donated buffers" in str(exc)
        else:
            for e, o in zip(expected, got):
                torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-6)
        torch._dynamo.reset()


def test_the_graph_functions_are_marked_cacheable_keyed_on_the_source_and_the_strategies(monkeypatch):
    """Marked beside what the user marked, with a key that names the package's source and the registered
    strategies' loops: a strategy registered between two runs (a "recompute" one saves other tensors for backward)
    must not get the other run's graphs (a review found a warm start crashing on them)."""
    from flce_compile.plan import registry

    config = torch._inductor.config
    if not isinstance(getattr(config, "unsafe_marked_cacheable_functions", None), dict):
        pytest.skip("this torch has no unsafe_marked_cacheable_functions")
    # Set through the config's own patch, not monkeypatch: pytest 9.2's undo deletes an attribute that lives
    # outside the module's __dict__, and torch 2.11's config then hides the setting (every later Inductor
    # compile in the process failed with "unsafe_marked_cacheable_functions does not exist").
    with config.patch(unsafe_marked_cacheable_functions={"user.fn": "1"}):
        graph_cache.mark_graph_functions_cacheable()
        marked = config.unsafe_marked_cacheable_functions
        names = [f"{fn.__module__}.{fn.__name__}" for fn in graph_cache.GRAPH_FUNCTIONS]
        key = marked[names[0]]
        assert marked["user.fn"] == "1"
        assert {marked[n] for n in names} == {key} and key.startswith(source_key() + "-")
        recompute = registry.get("recompute")
        mine = dataclasses.replace(recompute, name="mine")
        monkeypatch.setattr(registry, "_REGISTRY", {**registry._REGISTRY, "mine": mine})
        graph_cache.mark_graph_functions_cacheable()
        mine_recompute = config.unsafe_marked_cacheable_functions[names[0]]
        monkeypatch.setitem(registry._REGISTRY, "mine", dataclasses.replace(recompute, name="mine", loop="chunked"))
        graph_cache.mark_graph_functions_cacheable()
        mine_chunked = config.unsafe_marked_cacheable_functions[names[0]]
        assert len({key, mine_recompute, mine_chunked}) == 3
        assert config.unsafe_marked_cacheable_functions["user.fn"] == "1"
    assert isinstance(config.unsafe_marked_cacheable_functions, dict)  # still a setting for later compiles


def test_a_graph_calling_the_op_directly_is_cached_under_this_packages_code(monkeypatch):
    """A graph that calls the op itself (inside the user's own ``torch.compile``) holds the op's name, not its
    Python autograd formula, which torch's compile caches do not key on: a cache filled by another version of this
    package served that version's traced backward (a review found the in-place scale 240ab6e replaced still served
    from a warm cache). Tracing the op puts this package's key into Inductor's config, which the caches read: the
    same code hits, other code misses."""
    from torch._dynamo.utils import counters

    from flce_compile import compile_cache_key, fused_linear_cross_entropy

    config = torch._inductor.config
    if not isinstance(getattr(config, "unsafe_marked_cacheable_functions", None), dict):
        pytest.skip("this torch has no unsafe_marked_cacheable_functions")
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(12, H, generator=g, requires_grad=True), torch.randn(V, H, generator=g, requires_grad=True)
    t = torch.randint(0, V, (12,), generator=g)

    def loss_fn(x, w, t):
        return fused_linear_cross_entropy(x, w, t)

    def compile_once():
        torch._dynamo.reset()
        counters.clear()
        torch.compile(loss_fn)(x, w, t).backward()
        return dict(counters["aot_autograd"])

    with _fresh_cache(), config.patch(unsafe_marked_cacheable_functions={"user.fn": "1"}):
        first = compile_once()
        assert config.unsafe_marked_cacheable_functions == {"user.fn": "1", ENTRY: cache_key()}
        again = compile_once()
        monkeypatch.setattr(compile_cache_key, "_source", "flce_compile-another-version")
        other = compile_once()
    torch._dynamo.reset()
    assert first.get("autograd_cache_miss") == 1 and again.get("autograd_cache_hit") == 1, (first, again)
    assert other.get("autograd_cache_miss") == 1 and not other.get("autograd_cache_hit"), other
