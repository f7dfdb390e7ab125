"""A low-rank adapter on the lm_head (peft's LoRA with "lm_head" among its target_modules), folded into one GEMM
over ``[x, s*u]`` and ``[W, B]`` that the fused op takes (``flce_compile/compiler/lora_head.py``): fused and exact
against eager (fp32) and against fp64 (a bf16 head with a bf16 adapter, and with peft's fp32 adapter under
autocast), the logits never formed in the graph, the dropout's mask kept; heads the fold refuses (peft's fp32
adapter beside a bf16 head outside autocast among them), or whose loss is not fused once folded, compute as eager
did and say why; and a real peft model, when peft is installed."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flce_compile.compiler as fc
from flce_compile.compiler.rewrite import flce_fused_loss, flce_fused_loss_keep

V, H, R = 96, 16, 4


class LoraHead(nn.Module):
    """An lm_head with a low-rank adapter laid out as peft's LoRA ``Linear`` computes it: the head in ``dtype``, the
    adapter in fp32 reading the head's input cast to the adapter's dtype (then dropout ``p``), the fp32 sum cast back.
    ``loss_form(logits, t)`` gives the loss; ``up_bias``: peft's lora_bias; ``widen``: the adapter's output cast
    to fp32 and the sum left so; ``cast_back=False``: the sum not cast back (plain code, not peft); ``source``: what
    the adapter reads, ``"x"`` or ``"tanh"`` (something else); ``return_logits=False``: only the loss returned."""

    def __init__(self, dtype=torch.float32, p=0.0, up_bias=False, widen=False, source="x", loss_form=None,
                 cast_back=True, return_logits=True):
        super().__init__()
        self.emb = nn.Embedding(V, H).to(dtype)
        self.lm_head = nn.Linear(H, V, bias=False).to(dtype)
        self.lora_a = nn.Linear(H, R, bias=False)
        self.lora_b = nn.Linear(R, V, bias=up_bias)
        nn.init.normal_(self.lora_b.weight, std=0.2)  # peft starts it at zero: a trained adapter's is not
        self.p, self.widen, self.source, self.cast_back = p, widen, source, cast_back
        self.return_logits = return_logits
        self.loss_form = loss_form or (lambda logits, t: F.cross_entropy(logits.float().view(-1, V), t.view(-1)))

    def logits(self, x):
        head = self.lm_head(x)
        read = x if self.source == "x" else torch.tanh(x)
        low = F.dropout(read.to(self.lora_a.weight.dtype), self.p, self.training)  # peft's cast
        branch = self.lora_b(self.lora_a(low)) * 2.0
        if self.widen:
            return head + branch.float()
        return (head + branch).to(head.dtype) if self.cast_back else head + branch

    def forward(self, idx, t):
        x = self.emb(idx)
        logits = self.logits(x)
        return self.loss_form(logits, t), logits if self.return_logits else None


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (2, 8), generator=g), torch.randint(0, V, (2, 8), generator=g)


def _grads(model, fn, *args, seed=None):
    model.zero_grad(set_to_none=True)
    if seed is not None:
        torch.manual_seed(seed)
    loss, logits = fn(*args)
    loss.backward()
    return loss.detach(), logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class _Graphs:
    """An inner compiler that records the graphs it gets and runs them as they are."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def targets(self):
        return [n.target for gm in self.graphs for n in gm.graph.nodes if n.op == "call_function"]


def _compiled(model, dynamic=None, **options):
    torch._dynamo.reset()
    graphs = _Graphs()
    return torch.compile(model, backend="flce", dynamic=dynamic, options={"flce.inner": graphs, **options}), graphs


def _vocab_sized(gm) -> list[str]:
    """Nodes of ``gm`` whose traced value has the vocabulary as its last dimension (logits-sized, or W / B)."""
    out = []
    for n in gm.graph.nodes:
        val = n.meta.get("example_value")
        if isinstance(val, torch.Tensor) and val.dim() >= 2 and val.shape[-1] == V:
            out.append(n.name)
    return out


@pytest.mark.parametrize("p, cast_back", [(0.0, True), (0.3, True), (0.0, False)],
                         ids=["no_dropout", "dropout", "no_cast_back"])
def test_fused_and_exact_in_fp32(p, cast_back):
    """Fused: the graph holds the fused op and forms no logits; the loss, every gradient (the head's, the
    adapter's A and B, the embedding's) and the returned logits (computed when read) match eager's. With dropout
    the mask is eager's under the same seed: the adapter's activations are computed in the graph as before.
    Without peft's cast back, the loss's own upcast (``logits.float()``) is no cast back of the sum (it was taken
    for one, and the head refused as "wider than the head")."""
    torch.manual_seed(0)
    model = LoraHead(p=p, cast_back=cast_back).train()
    idx, t = _data()
    (report,) = fc.explain(model, idx, t)
    assert report.fused and report.path == "fused_lazy" and report.hidden == H + R, report
    ref_loss, ref_logits, ref = _grads(model, model, idx, t, seed=1)
    compiled, graphs = _compiled(model)
    loss, logits, got = _grads(model, compiled, idx, t, seed=1)
    assert flce_fused_loss in graphs.targets()
    assert not any(_vocab_sized(gm) for gm in graphs.graphs)  # no logits, no adapter output of V columns
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert got.keys() == ref.keys() == {"emb.weight", "lm_head.weight", "lora_a.weight", "lora_b.weight"}
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(logits, ref_logits.detach(), rtol=1e-5, atol=1e-5)


class MatmulLoraHead(nn.Module):
    """An lm_head and a low-rank adapter written with ``@`` (plain code, not peft): ``x @ W.T + (x @ A.T) @ B.T * 2``,
    or with ``hv`` the head's and B's weights held as (H, V) and (R, V) parameters, ``x @ W + (x @ A) @ B * 2``."""

    def __init__(self, hv=False, frozen=False, bias=False):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        shapes = ((H, V), (H, R), (R, V)) if hv else ((V, H), (R, H), (V, R))
        self.w, self.a, self.b = (nn.Parameter(torch.randn(*shape) * 0.3) for shape in shapes)
        self.w.requires_grad_(not frozen)
        self.hv = hv
        self.bias = nn.Parameter(torch.randn(V)) if bias else None  # added to the head's output

    def forward(self, idx, t):
        x = self.emb(idx)
        head = x @ self.w if self.hv else x @ self.w.T
        if self.bias is not None:
            head = head + self.bias
        logits = head + ((x @ self.a) @ self.b if self.hv else (x @ self.a.T) @ self.b.T) * 2.0
        return F.cross_entropy(logits.view(-1, V), t.view(-1)), logits


@pytest.mark.parametrize("hv", [False, True], ids=["x@W.T", "x@W_hv"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trained_head", "frozen_head"])
def test_an_adapter_written_with_matmul_folds_and_is_exact(hv, frozen):
    """A hand-written adapter spelled with ``@`` folds as the F.linear spelling does (it was refused with peft's
    advice); with a frozen head its dW GEMM reads the adapter's columns only."""
    torch.manual_seed(0)
    model = MatmulLoraHead(hv=hv, frozen=frozen)
    idx, t = _data()
    ref_loss, ref_logits, ref = _grads(model, model, idx, t)
    compiled, graphs = _compiled(model)
    loss, logits, got = _grads(model, compiled, idx, t)
    fused = _fused_calls(graphs)
    (gm,) = graphs.graphs
    inputs = {n.name for n in gm.graph.nodes if n.op in ("placeholder", "get_attr")}  # (H, V) weights with hv
    assert len(fused) == 1 and not set(_vocab_sized(gm)) - inputs, gm.code  # no logits
    assert fused[0].args[0].meta["example_value"].shape[-1] == H + R
    assert fused[0].kwargs.get("frozen_weight_columns", 0) == (H if frozen else 0), fused[0].kwargs
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(logits, ref_logits.detach(), rtol=1e-5, atol=1e-5)


def test_an_adapter_on_a_head_before_a_checkpointed_loss_folds():
    """``checkpoint(loss_fn, lm_head(x) + s * B(A(x)), labels)``: the trial of moving the region out folds the
    adapter as the pass does (it analysed the copy without folding: the region stayed, and the log blamed the
    adapter), so the loss fuses, exact."""
    class CheckpointedLoss(LoraHead):
        def forward(self, idx, t):
            logits = self.logits(self.emb(idx))
            return torch.utils.checkpoint.checkpoint(self.loss_form, logits, t, use_reentrant=False), logits

    torch.manual_seed(0)
    model = CheckpointedLoss(cast_back=False)
    idx, t = _data()
    ref_loss, ref_logits, ref = _grads(model, model, idx, t)
    compiled, graphs = _compiled(model)
    loss, logits, got = _grads(model, compiled, idx, t)
    assert len(_fused_calls(graphs)) == 1 and not any(_vocab_sized(gm) for gm in graphs.graphs)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(logits, ref_logits.detach(), rtol=1e-5, atol=1e-5)


def _fused_calls(graphs):
    """The fused op's calls in the recorded graphs (either graph-side function)."""
    return [n for gm in graphs.graphs for n in gm.graph.nodes
            if n.op == "call_function" and n.target in (flce_fused_loss, flce_fused_loss_keep)]


@functools.cache  # the installed torch's answer, asked once for both parametrizations
def _dynamo_sees_unfreezing() -> bool:
    """Whether Dynamo compiles again once a module's frozen parameter requires grad. Torch 2.11's does not: it
    skips a parameter's tensor guard while its module's parameter dict is unchanged, and then every backend
    (aot_eager and Inductor too) leaves the unfrozen parameter without a gradient."""
    lin = nn.Linear(2, 2).requires_grad_(False)
    frames = []
    fn = torch.compile(lambda x: lin(x), backend=lambda gm, _: frames.append(gm) or gm.forward)
    fn(torch.ones(1, 2))
    lin.weight.requires_grad_(True)
    fn(torch.ones(1, 2))
    return len(frames) == 2


@pytest.mark.parametrize("keep", [False, True], ids=["lazy_logits", "kept_logits"])
def test_a_frozen_head_gets_no_weight_gradient_gemm(keep):
    """peft freezes the head: the fold tells the op (``frozen_weight_columns`` = H), whose dW covers B's columns
    only; the gradients of the embedding, A and B are eager's, the head gets none. Unfrozen later, the graph is
    compiled again (Dynamo guards requires_grad) without the option, and the head's gradient is eager's."""
    torch.manual_seed(0)
    zloss = lambda logits, t: (F.cross_entropy(logits.view(-1, V), t.view(-1))  # noqa: E731
                               + 1e-2 * logits.logsumexp(-1).pow(2).mean())
    model = LoraHead(p=0.2, loss_form=zloss if keep else None).train()
    model.lm_head.weight.requires_grad_(False)
    idx, t = _data()
    ref_loss, _, ref = _grads(model, model, idx, t, seed=1)
    sees_unfreezing = _dynamo_sees_unfreezing()
    compiled, graphs = _compiled(model)
    if not sees_unfreezing:  # (torch 2.11) compile with the guard it skips, so the unfreezing half tests the pass
        compiled = torch._dynamo.config.patch(skip_tensor_guards_with_matching_dict_tags=False)(compiled)
    loss, _, got = _grads(model, compiled, idx, t, seed=1)
    (call,) = _fused_calls(graphs)
    assert call.target is (flce_fused_loss_keep if keep else flce_fused_loss)
    assert call.kwargs.get("frozen_weight_columns") == H
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert got.keys() == ref.keys() == {"emb.weight", "lora_a.weight", "lora_b.weight"}
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)

    model.lm_head.weight.requires_grad_(True)
    ref_loss, _, ref = _grads(model, model, idx, t, seed=1)
    loss, _, got = _grads(model, compiled, idx, t, seed=1)
    assert len(graphs.graphs) == 2 and "frozen_weight_columns" not in _fused_calls(graphs)[-1].kwargs
    assert "lm_head.weight" in got
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


class _Measured(LoraHead):
    """Returns the logits and an accuracy read from them in the graph (no gradient): the op keeps the logits,
    returned detached, with their gradient attached outside the graph (``outputs.LogitsGrad``)."""

    def forward(self, idx, t):
        loss, logits = super().forward(idx, t)
        return loss, logits, (logits.argmax(-1) == t).float().mean()


@pytest.mark.parametrize("path", ["fused", "fused_lazy", "fused_keep", "fused_keep_metric"])
def test_a_frozen_head_takes_nothing_of_the_weights_size_into_backward(path):
    """With W frozen, backward takes no V x (H + r) input on any path: no tangent (returned logits go out as W and
    B rather than ``[W, B]``, an intermediate whose zero gradient autograd materialised in each backward) and no
    saved tensor (where the op keeps its weight for the logits' own gradient, ``fused_keep``, the join is
    recomputed in backward from W and B, which the graph has anyway: it kept ``[W, B]`` from forward to backward).
    A loss on the returned logits outside the graph still reaches A, B and the embedding as in eager (through the
    lazy logits' backward, and through ``LogitsGrad``'s GEMM for each piece)."""
    from torch._dynamo.backends.common import aot_autograd

    torch.manual_seed(0)
    zloss = lambda logits, t: (F.cross_entropy(logits.view(-1, V), t.view(-1))  # noqa: E731
                               + 1e-2 * logits.logsumexp(-1).pow(2).mean())
    model = (_Measured() if path == "fused_keep_metric" else
             LoraHead(loss_form=zloss if path == "fused_keep" else None, return_logits=path != "fused"))
    model.lm_head.weight.requires_grad_(False)
    idx, t = _data()
    (report,) = fc.explain(model, idx, t)
    assert report.path == path.removesuffix("_metric"), report

    def step(fn):
        model.zero_grad(set_to_none=True)
        loss, logits, *_ = fn(idx, t)
        (loss + (0.1 * logits.float().pow(2).mean() if logits is not None else 0)).backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    shapes = []

    def backward_compiler(gm, example_inputs):
        shapes.extend(tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.op == "placeholder")
        return gm.forward

    ref_loss, ref = step(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={
        "flce.inner": aot_autograd(fw_compiler=lambda gm, _: gm.forward, bw_compiler=backward_compiler)})
    loss, got = step(compiled)
    assert shapes and (V, H + R) not in shapes, shapes
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert got.keys() == ref.keys() == {"emb.weight", "lora_a.weight", "lora_b.weight"}
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_inductor_forms_no_padded_weight_gradient():
    """The op returns B's columns of dW (``frozen_weight_columns``) and its formula pads them to the weight's shape;
    the join's backward copies B's columns back out, which Inductor computes from the op's output directly: the
    compiled backward allocates nothing of the weight's size (through ``torch.cat`` B's gradient was a view, and
    Inductor formed the whole padded tensor to return it)."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = LoraHead()  # the logits returned: the lazy path, a Hugging Face model's
    model.lm_head.weight.requires_grad_(False)
    idx, t = _data()
    ref_loss, _, ref = _grads(model, model, idx, t)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce")
    (loss, _, got), code = run_and_get_code(lambda: _grads(model, compiled, idx, t))
    forward, backward = code
    assert f"({V}, {H + R})" in forward and f"({V}, {H + R})" not in backward, backward
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


class _FromHidden(LoraHead):
    """The head and adapter on hidden states the caller passes (a graph input: symbolic under ``dynamic=True``)."""

    def forward(self, x, t):
        return self.loss_form(self.logits(x), t), None


def test_a_frozen_head_on_symbolic_hidden_states_passes_an_int():
    """Under ``dynamic=True`` with the hidden states a graph input, their hidden size is symbolic: the op's
    ``frozen_weight_columns`` comes from the weight's static shape, a plain int (a SymInt in the node's arguments
    warned, and made ``explain`` under a memory budget say the compile raises, which it did not), and the gradients
    are eager's at every token count of the one graph."""
    torch.manual_seed(0)
    model = _FromHidden(return_logits=False)
    model.lm_head.weight.requires_grad_(False)
    x, t = torch.randn(2, 8, H, requires_grad=True), torch.randint(0, V, (2, 8))
    budget = {"flce.memory_budget_gb": 1.0}
    (report,) = fc.explain(torch.compile(model, backend="flce", dynamic=True, options=budget), x, t)
    assert report.fused, report
    compiled, graphs = _compiled(model, dynamic=True, **budget)
    for n in (8, 5, 11):
        x, t = torch.randn(2, n, H, requires_grad=True), torch.randint(0, V, (2, n))
        ref = _grads(model, lambda: (model(x, t)[0], None))
        ref_dx, x.grad = x.grad, None
        got = _grads(model, lambda: (compiled(x, t)[0], None))
        torch.testing.assert_close(x.grad, ref_dx, rtol=1e-5, atol=1e-6)
        for name in ref[2]:
            torch.testing.assert_close(got[2][name], ref[2][name], rtol=1e-5, atol=1e-6, msg=name)
    (call,) = _fused_calls(graphs)
    assert type(call.kwargs["frozen_weight_columns"]) is int and call.kwargs["frozen_weight_columns"] == H


def test_the_folds_graph_functions_are_cacheable():
    """Every function of this package that a rewritten graph calls is one the AOT autograd cache is told it may
    hold (``graph_cache.GRAPH_FUNCTIONS``): a graph calling another is skipped by that cache, which left the LoRA
    fold's frozen-head graphs exposed to the FX graph cache's donated-buffer gap (a second backward through a
    kept graph gave B 0.6x eager's gradient, a review found)."""
    from flce_compile.compiler import graph_cache

    torch.manual_seed(0)
    zloss = lambda logits, t: (F.cross_entropy(logits.view(-1, V), t.view(-1))  # noqa: E731
                               + 1e-2 * logits.logsumexp(-1).pow(2).mean())
    idx, t = _data()
    called = set()
    for model in (LoraHead(), LoraHead(return_logits=False), LoraHead(loss_form=zloss), _Measured()):
        for frozen in (True, False):
            model.lm_head.weight.requires_grad_(not frozen)
            compiled, graphs = _compiled(model)
            compiled(idx, t)
            called |= {n.target for gm in graphs.graphs for n in gm.graph.nodes if n.op == "call_function"
                       and getattr(n.target, "__module__", "").startswith("flce_compile")}
    from flce_compile.compiler.lora_head import join_frozen

    assert join_frozen in called and flce_fused_loss in called and flce_fused_loss_keep in called
    assert called <= set(graph_cache.GRAPH_FUNCTIONS), called - set(graph_cache.GRAPH_FUNCTIONS)


def test_held_logits_of_a_frozen_head_keep_the_forwards_values():
    """Returned logits held, unread, across optimizer steps that write the parameters unseen by their version
    counters (as fused optimizers do), the head unfrozen before the second: they come out as the forward computed
    them (their pieces W and B copied at the first step; keeping the frozen W by reference gave the second step's
    values, a review found)."""
    torch.manual_seed(0)
    model = LoraHead()
    model.lm_head.weight.requires_grad_(False)
    g = torch.Generator().manual_seed(2)
    idx, t = torch.randint(0, V, (4, 8), generator=g), torch.randint(0, V, (4, 8), generator=g)  # logits > [W, B]
    compiled, _ = _compiled(model)
    _, expected = model(idx, t)
    _, logits = compiled(idx, t)
    compiled(idx, t)[0].backward()  # another forward's loss: these logits get no gradient
    from test_compiler_keep import _DataWritingSGD  # writes through ``.data``, as a fused kernel would

    _DataWritingSGD(model.parameters(), lr=0.5).step()
    model.lm_head.weight.requires_grad_(True)  # unfrozen: the next step writes it
    model.zero_grad(set_to_none=True)
    model(idx, t)[0].backward()
    _DataWritingSGD(model.parameters(), lr=0.5).step()
    assert not logits.computed and logits._source.ws[0] is not model.lm_head.weight  # (copied, not computed)
    torch.testing.assert_close(logits, expected.detach(), rtol=1e-5, atol=1e-5)


def _errors(model, fn, ref, idx, t, autocast):
    """Absolute errors of the loss and the norms of the errors of the gradients of the hidden states (the
    embedding's), A and B against ``ref``, the same quantities in fp64."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss, _, grads = _grads(model, fn, idx, t)
    got = [loss.double()] + [grads[n].double() for n in ("emb.weight", "lora_a.weight", "lora_b.weight")]
    return [(a - b).norm().item() for a, b in zip(got, ref)]


@pytest.mark.parametrize("adapter, autocast, cast_back", [(torch.bfloat16, False, True), (torch.float32, True, True),
                                                      (torch.bfloat16, False, False)],
                         ids=["bf16_adapter", "fp32_adapter_autocast", "bf16_adapter_no_cast_back"])
def test_bf16_head_is_at_least_as_exact_as_eager(adapter, autocast, cast_back):
    """A bf16 head with a bf16 adapter, and with peft's fp32 adapter under autocast (the Trainer's bf16): the folded
    GEMM rounds the logits once where eager rounds the head's GEMM, the adapter's and their sum, so the gradients
    of the hidden states, A and B are no further from fp64 than eager's (plus a sliver); the loss, a mean of
    per-token roundings, is within an ulp of the logits over the square root of the token count. Without peft's
    cast back (plain code), the loss's ``logits.float()`` is not taken for one (the head was refused as wider)."""
    torch.manual_seed(0)
    model = LoraHead(dtype=torch.bfloat16, cast_back=cast_back, return_logits=cast_back)  # the sum's one user
    model.lora_a.to(adapter), model.lora_b.to(adapter)
    idx, t = torch.randint(0, V, (8, 64)), torch.randint(0, V, (8, 64))
    exact = LoraHead(dtype=torch.float64)
    exact.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    exact.lora_a.double(), exact.lora_b.double()
    loss, _, grads = _grads(exact, exact, idx, t)
    ref = [loss] + [grads[n] for n in ("emb.weight", "lora_a.weight", "lora_b.weight")]
    eager = _errors(model, model, ref, idx, t, autocast)
    compiled, graphs = _compiled(model)
    fused = _errors(model, compiled, ref, idx, t, autocast)
    assert flce_fused_loss in graphs.targets()
    assert fused[0] <= eager[0] + 2.0**-8 * (loss.abs().item() + 1.0) / idx.numel() ** 0.5, (fused[0], eager[0])
    for name, ours, theirs, r in zip(("dX", "dA", "dB"), fused[1:], eager[1:], ref[1:]):
        assert ours <= theirs + 4e-4 * r.norm().item(), f"{name}: {ours:.3e} against eager's {theirs:.3e}"


def test_logits_read_in_the_graph_come_from_the_fused_op():
    """A loss on the logits beside the cross-entropy (a z-loss) keeps them in the graph: the op returns the folded
    GEMM's logits (``fused_keep``), and the gradients still match eager's."""
    torch.manual_seed(0)
    zloss = lambda logits, t: (F.cross_entropy(logits.view(-1, V), t.view(-1))  # noqa: E731
                               + 1e-2 * logits.logsumexp(-1).pow(2).mean())
    model = LoraHead(loss_form=zloss)
    idx, t = _data()
    ref_loss, _, ref = _grads(model, model, idx, t)
    compiled, graphs = _compiled(model)
    loss, _, got = _grads(model, compiled, idx, t)
    assert flce_fused_loss_keep in graphs.targets()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("case, reason", [
    ("up_bias", "the adapter's up-projection has a bias"),
    ("fp32_adapter", "the adapter computes in torch.float32 where the head computes in torch.bfloat16"),
    ("fp32_sum", "the sum is torch.float32 where the head computed torch.bfloat16"),
    ("in_place", "writes to its operands between the head's and the adapter's GEMMs and the sum"),
    ("write_between", "writes to its operands between the head's and the adapter's GEMMs and the sum"),
    ("adapter_no_grad", "grad mode changes between the head's and the adapter's GEMMs and the sum"),
    ("two_adapters", "several low-rank adapters are added to the logits"),
    ("added_bias", "a bias is added to the head's or the adapter's output"),
    ("matmul_added_bias", "a bias is added to the head's or the adapter's output"),
])
def test_heads_the_fold_refuses_are_named(case, reason):
    """An adapter with a bias on its up-projection, an fp32 adapter beside a bf16 head without autocast (one bf16
    GEMM would be less exact than eager's fp32 branch), a sum left wider than the head (its logits are, in eager)
    and a write to the head's input between its GEMM and the sum are not folded: the reason names the adapter,
    why, and the two ways to fuse."""
    model = {"up_bias": lambda: LoraHead(up_bias=True),
             "fp32_adapter": lambda: LoraHead(dtype=torch.bfloat16),
             "fp32_sum": lambda: LoraHead(dtype=torch.bfloat16, widen=True).to(torch.bfloat16),
             "in_place": lambda: InPlaceLoraHead(), "write_between": lambda: WriteBetweenLoraHead(),
             "adapter_no_grad": lambda: NoGradAdapterHead(), "two_adapters": lambda: TwoAdapterHead(),
             "added_bias": lambda: AddedBiasHead(), "matmul_added_bias": lambda: MatmulLoraHead(bias=True)}[case]()
    (report,) = fc.explain(model, *_data())
    assert not report.fused and "low-rank adapter's output is added to the logits" in report.reason
    assert reason in report.reason and "merge_and_unload" in report.reason, report.reason


class InPlaceLoraHead(LoraHead):
    """The head's input written (in place) after the head's GEMM and before the adapter reads it."""

    def logits(self, x):
        x = x * 1.0
        head = self.lm_head(x)
        x.mul_(0.5)
        return head + self.lora_b(self.lora_a(x)) * 2.0


class WriteBetweenLoraHead(LoraHead):
    """The adapter's activations written in place after its up-projection and before the head's GEMM: the sum
    reads the up-projection's output, computed before the write (found by a review: the fold read them after)."""

    def logits(self, x):
        u = self.lora_a(x)
        branch = self.lora_b(u)
        u.mul_(0.5)
        return self.lm_head(x) + branch * 2.0


class NoGradAdapterHead(LoraHead):
    """The adapter run under no_grad before the head: B gets no gradient in eager (the fold gave it one)."""

    def logits(self, x):
        with torch.no_grad():
            branch = self.lora_b(self.lora_a(x))
        return self.lm_head(x) + branch * 2.0


class TwoAdapterHead(LoraHead):
    """Two adapters on the head (peft with two active adapters): one sum after the other."""

    def logits(self, x):
        return self.lm_head(x) + self.lora_b(self.lora_a(x)) * 2.0 + self.lora_b(self.lora_a(x)) * 3.0


class AddedBiasHead(LoraHead):
    """A vocabulary-sized bias added to the head's output beside the adapter (the fold reads the GEMMs' own biases
    only: folded, the bias was dropped, for a wrong loss)."""

    def __init__(self):
        super().__init__(cast_back=False)
        self.extra = nn.Parameter(torch.randn(V))

    def logits(self, x):
        return self.lm_head(x) + self.extra + self.lora_b(self.lora_a(x)) * 2.0


def test_an_adapter_under_no_grad_gets_no_gradient():
    """The review's case compiled: B's gradient stays None, as in eager."""
    model = NoGradAdapterHead()
    idx, t = _data()
    _, _, ref = _grads(model, model, idx, t)
    compiled, _ = _compiled(model)
    _, _, got = _grads(model, compiled, idx, t)
    assert "lora_b.weight" not in ref and got.keys() == ref.keys()


def test_a_narrowing_cast_in_the_adapter_branch_is_no_adapter():
    """``(B(A(x)) * s).half().float()`` rounds the adapter's output to fp16 (inf past its range): not stripped as a
    cast, so the branch is not taken for an adapter, and the loss is eager's (it was folded, the rounding dropped)."""
    class Narrowing(LoraHead):
        def logits(self, x):
            return self.lm_head(x) + (self.lora_b(self.lora_a(x)) * 0.7).half().float()

    model = Narrowing()
    idx, t = _data()
    (report,) = fc.explain(model, idx, t)
    assert not report.fused and "adapter" not in report.reason, report.reason
    ref_loss, _, _ = _grads(model, model, idx, t)
    compiled, _ = _compiled(model)
    loss, _, _ = _grads(model, compiled, idx, t)
    assert loss == ref_loss


def test_a_fold_whose_loss_is_not_fused_is_undone():
    """Folded, the loss still is not fused (the logits are written in place before it): the fold is undone, the
    graph computes the head and the adapter as eager did (no concatenated weight), and the reason says both."""
    def in_place_loss(logits, t):
        logits = logits * 1.0
        logits.add_(1.0)
        return F.cross_entropy(logits.view(-1, V), t.view(-1))

    torch.manual_seed(0)
    model = LoraHead(loss_form=in_place_loss)
    idx, t = _data()
    (report,) = fc.explain(model, idx, t)
    assert not report.fused and "folded into one GEMM its loss is not fused either" in report.reason, report.reason
    ref_loss, _, ref = _grads(model, model, idx, t)
    compiled, graphs = _compiled(model)
    loss, _, got = _grads(model, compiled, idx, t)
    assert torch.cat not in graphs.targets() and flce_fused_loss not in graphs.targets()
    assert loss == ref_loss and all(torch.equal(got[n], ref[n]) for n in ref)


def test_an_adapter_reading_something_else_is_no_lora_head():
    """A low-rank branch that reads something other than the head's input is not called an adapter."""
    (report,) = fc.explain(LoraHead(source="tanh"), *_data())
    assert not report.fused and "adapter" not in report.reason and "call_function add" in report.reason


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_peft_llama_with_lora_on_the_lm_head(dynamic):
    """A real peft model (Llama, LoRA on q_proj and lm_head, dropout 0.1): the head fused, one graph; loss and
    gradients as eager's under the same seed, the returned logits as eager's (fp32). Under ``dynamic=True`` peft's
    ``scaling`` is a float Dynamo leaves symbolic: the fold multiplies by it in the graph (it was not matched)."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg), peft.LoraConfig(
        r=R, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "lm_head"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.1)
    ids = _data()[0]
    call = lambda fn: (lambda: (lambda out: (out.loss, out.logits))(fn(input_ids=ids, labels=ids)))  # noqa: E731
    explained = torch.compile(model, backend="flce", dynamic=True) if dynamic else model  # explain traces as compiled
    (report,) = fc.explain(explained, input_ids=ids, labels=ids)
    assert report.fused and report.hidden == 32 + R, report
    ref_loss, ref_logits, ref = _grads(model, call(model), seed=3)
    compiled, graphs = _compiled(model, dynamic=dynamic)
    loss, logits, got = _grads(model, call(compiled), seed=3)
    assert len(graphs.graphs) == 1 and flce_fused_loss in graphs.targets()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(logits, ref_logits.detach(), rtol=1e-5, atol=1e-5)


def test_a_lora_head_of_call_module_nodes_folds():
    """A graph not made by Dynamo (``symbolic_trace``): the head and the adapter are call_module nodes, whose
    weights the fold reads as get_attr nodes; it folds, fuses, and matches the module, with its bias too."""
    from torch.fx.passes.shape_prop import ShapeProp

    from flce_compile.compiler.rewrite import run_pass

    class Biased(LoraHead):
        def __init__(self):
            super().__init__(cast_back=False)  # (traced, ``.to(head.dtype)`` reads the head's output: a second user)
            self.lm_head = nn.Linear(H, V, bias=True)

        def forward(self, idx, t):
            return self.loss_form(self.logits(self.emb(idx)), t)

    torch.manual_seed(0)
    model = Biased()
    gm = torch.fx.symbolic_trace(model)
    idx, t = _data()
    ShapeProp(gm).propagate(idx, t)
    (result,) = run_pass(gm, [idx, t]).sites
    assert result.path == "fused" and result.site.hidden == H + R
    assert not any(n.op == "call_module" and "lm_head" in str(n.target) for n in gm.graph.nodes)
    torch.testing.assert_close(gm(idx, t), model(idx, t), rtol=1e-5, atol=1e-6)


class LogitsOnlyLoraHead(LoraHead):
    """peft's LoRA'd lm_head in a model that returns the logits: the loss is the training loop's."""

    def forward(self, idx):
        return self.logits(self.emb(idx))


def test_a_lora_head_whose_loss_comes_after_the_compiled_code_is_reported(caplog):
    """Nothing can be fused when the loop computes the loss from the returned logits, and the backend says so for a
    LoRA'd head as for a plain one (the head's own GEMM feeds the adapter's sum, not the output: it went unreported);
    explain lists it too."""
    model = LogitsOnlyLoraHead()
    idx, t = _data()
    with caplog.at_level("INFO", logger="flce_compile"):
        compiled, graphs = _compiled(model)
        F.cross_entropy(compiled(idx).view(-1, V), t.view(-1)).backward()
    said = [r.getMessage() for r in caplog.records if "no loss in this graph" in r.getMessage()]
    assert len(said) == 1 and f"(V={V}," in said[0], said
    (report,) = fc.explain(model, idx)
    assert not report.fused and "no loss in this graph" in report.reason
