"""The causal-mask pass (``compiler/causal_mask.py``): SDPA calls that receive a causal mask built in the graph
from constants run with ``is_causal=True``; every other mask stays. Checked on the graphs Dynamo captures (a
Hugging Face Llama as users call it, plain functions), by their contents and by running them before and after."""

import contextlib
import copy
import logging
import operator
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import fx

from flce_compile.compiler.causal_mask import drop_causal_masks
from flce_compile.compiler.options import split_options
from flce_compile.compiler.patterns import is_checkpoint

transformers = pytest.importorskip("transformers")


def capture(fn, *args, **kwargs) -> tuple[fx.GraphModule, list]:
    """The one graph Dynamo captures of ``fn(*args, **kwargs)``, and its example inputs."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, dynamic=False)(*args, **kwargs)
    torch._dynamo.reset()
    assert len(graphs) == 1
    return graphs[0]


def sdpa_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for sub in gm.modules() if isinstance(sub, fx.GraphModule) for n in sub.graph.nodes
            if n.op == "call_function" and n.target is F.scaled_dot_product_attention]


def run(gm: fx.GraphModule, inputs: list):
    out = gm(*inputs)
    return [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]


@pytest.fixture(scope="module")
def llama():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.config.use_cache = False  # as with gradient checkpointing: transformers then always builds the mask
    return model


def checkpoint_side_effects_allowed():
    """The Dynamo flag ``backend="flce"`` turns on for its own compiles (``compiler/checkpoint_side_effects.py``),
    for captures with a backend of these tests: transformers 5.25's ``kernels`` dependency sets a context variable
    in each layer's forward, a side effect Dynamo refuses inside the checkpoint (it compiled the Llama in five
    pieces, the layers left out). Nothing on a torch without the flag."""
    from flce_compile.compiler import checkpoint_side_effects

    if not checkpoint_side_effects.flag_supported():
        return contextlib.nullcontext()
    return checkpoint_side_effects.flag_on()


@pytest.fixture(scope="module")
def llama_graphs(llama):
    """(plain, checkpointed, with attention_mask) graphs of the Llama, captured once for the module."""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    plain = capture(llama, input_ids=ids, labels=ids)
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[1, :5] = 0
    padded = capture(llama, input_ids=ids, labels=ids, attention_mask=padding)
    llama.gradient_checkpointing_enable()
    try:
        with checkpoint_side_effects_allowed():
            checkpointed = capture(llama, input_ids=ids, labels=ids)
    finally:
        llama.gradient_checkpointing_disable()
    return {"plain": plain, "checkpointed": checkpointed, "padded": padded}


def test_llama_mask_recorded_with_operator_methods_is_dropped(llama_graphs):
    """torch 2.11's Dynamo (the H200's) records the mask's ``a == b`` as the method call ``a.__eq__(b)``: the pass
    takes it as the operator it is (it had kept the mask there, and the compiled HF model lost the flash kernel
    again). The graph of this torch is rewritten to that spelling, ``&`` too (as a later release might)."""
    gm, inputs = llama_graphs["plain"]
    gm = copy.deepcopy(gm)
    before = run(gm, inputs)
    spelled = 0
    for node in gm.graph.nodes:
        if (node.op == "call_function" and node.target in (operator.eq, operator.and_)
                and all(isinstance(a, fx.Node) for a in node.args)):
            node.op, node.target = "call_method", f"__{node.target.__name__.rstrip('_')}__"
            spelled += 1
    gm.recompile()
    assert spelled

    result = drop_causal_masks(gm)

    assert result.calls == len(sdpa_nodes(gm)) == 2 and not result.refused
    after = run(gm, inputs)
    for b, a in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_llama_mask_is_dropped_on_the_gpu(llama):
    """The same on CUDA with this machine's torch and transformers, the H200's combination: ``pytest -m gpu``
    passed there while the pass kept every mask (torch 2.11's ``a.__eq__(b)``; only the CPU tests, which the
    GPU run skips, looked at the pass)."""
    model = copy.deepcopy(llama).cuda()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1)).cuda()
    gm, inputs = capture(model, input_ids=ids, labels=ids)
    before = run(gm, inputs)

    result = drop_causal_masks(gm)

    assert result.calls == len(sdpa_nodes(gm)) == 2 and not result.refused, str(result)
    for b, a in zip(before, run(gm, inputs)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["plain", "checkpointed"])
def test_llama_mask_is_dropped_and_results_unchanged(llama_graphs, kind):
    gm, inputs = llama_graphs[kind]
    gm = copy.deepcopy(gm)
    before = run(gm, inputs)
    assert sdpa_nodes(gm) and all(n.kwargs.get("attn_mask") is not None for n in sdpa_nodes(gm))
    masks = {n.name for n in gm.graph.nodes if n.users and any(
        u.op == "call_function" and (u.target is F.scaled_dot_product_attention or is_checkpoint(u))
        for u in n.users) and _is_square_bool(n)}
    assert masks

    result = drop_causal_masks(gm)

    calls = sdpa_nodes(gm)
    assert result.calls == len(calls) == 2 and not result.refused
    assert all(n.kwargs["attn_mask"] is None and n.kwargs["is_causal"] is True for n in calls)
    # The mask is no longer built (what built it may stay where something else uses it).
    assert not masks & {n.name for n in gm.graph.nodes}
    if kind == "checkpointed":  # and the checkpoints no longer take it as an operand
        for node in gm.graph.nodes:
            if is_checkpoint(node):
                body = getattr(gm, node.args[0].target)
                assert len([p for p in body.graph.nodes if p.op == "placeholder"]) == len(node.args) - 1
                assert not any(isinstance(a, fx.Node) and _is_square_bool(a) for a in node.args[1:])
    after = run(gm, inputs)
    assert len(before) == len(after)
    for b, a in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _is_square_bool(node: fx.Node) -> bool:
    value = node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.shape[-2:] == (16, 16)


def test_llama_padding_mask_stays(llama_graphs):
    gm, _ = llama_graphs["padded"]
    gm = copy.deepcopy(gm)
    result = drop_causal_masks(gm)
    assert result.calls == 0
    assert list(result.refused.values()) == ["it depends on the values of graph input 'L_kwargs_attention_mask_'"]
    assert all(n.kwargs.get("attn_mask") is not None for n in sdpa_nodes(gm))


QKV = [torch.randn(2, 3, 8, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]


def _causal_bool(q, k, v):
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _causal_float_neg_inf(q, k, v):
    mask = torch.full((8, 8), float("-inf")).triu(1)
    return F.scaled_dot_product_attention(q, k, v, mask)  # positional


def _causal_float_lowest(q, k, v):
    mask = torch.full((1, 1, 8, 8), torch.finfo(torch.float32).min).triu(1).expand(2, 1, 8, 8)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)


@pytest.mark.parametrize("fn", [_causal_bool, _causal_float_neg_inf, _causal_float_lowest])
def test_constant_causal_masks_are_dropped(fn):
    gm, inputs = capture(fn, *QKV)
    expected = fn(*QKV)
    result = drop_causal_masks(gm)
    assert result.calls == 1 and not result.refused
    (node,) = sdpa_nodes(gm)
    assert node.args == tuple(node.args[:3]) and len(node.args) == 3
    assert node.kwargs["attn_mask"] is None and node.kwargs["is_causal"] is True
    assert [n.op for n in gm.graph.nodes] == ["placeholder"] * 3 + ["call_function", "output"]
    torch.testing.assert_close(run(gm, inputs)[0], expected, rtol=1e-5, atol=1e-6)


def _shifted(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool).tril(-1))


def _window(q, k, v):
    i = torch.arange(8)
    mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 4)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _soft(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.full((8, 8), -1e4).triu(1))


def _random(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.rand(8, 8) >= 0)


def _written_later(q, k, v):
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    view = mask[0]
    view[1] = True  # a write through a view: the mask is no longer causal
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _written_through_atleast_2d(q, k, v):
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    torch.atleast_2d(mask).fill_(True)  # atleast_2d returns its 2-D input itself
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _built_under_autocast(q, k, v):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = torch.full((8, 1), 1.0 + 2**-10) @ torch.ones(1, 8)  # 1.000977 in fp32, 1.0 in bf16
    mask = torch.ones(8, 8, dtype=torch.bool).tril() | (x <= 1.0)  # causal in fp32 only
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _rrelu(q, k, v):
    noise = torch.rrelu(-torch.ones(8, 8), 0.1, 0.3, True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool).tril() | (noise > 0))


@torch._dynamo.allow_in_graph
def _opaque_window(n):
    i = torch.arange(n)
    return (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < _WINDOW[0])


_WINDOW = [100]  # state the graph does not show: causal now, a window if it changes


def _opaque(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_opaque_window(8))


def _from_input(q, k, v):
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril() & (q[0, 0, :, :1] > -99)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("fn, reason", [
    (_shifted, "it is not causal"),
    (_window, "it is not causal"),
    (_soft, "a float mask with values other than 0 and -inf"),
    (_random, "draws random numbers"),
    (_written_later, "another node of the graph may write to it"),
    (_written_through_atleast_2d, "another node of the graph may write to it"),
    (_built_under_autocast, "it is built inside a torch.autocast region of the graph"),
    (_rrelu, "it is built with rrelu, which draws random numbers"),
    (_opaque, "it is built by _opaque_window, which the pass cannot see into"),
    (_from_input, "it depends on the values of graph input"),
])
def test_other_masks_stay(fn, reason):
    gm, inputs = capture(fn, *QKV)
    expected = fn(*QKV) if fn not in (_random, _rrelu) else None
    result = drop_causal_masks(gm)
    assert result.calls == 0
    (why,) = result.refused.values()
    assert why.startswith(reason) or reason in why, why
    (node,) = sdpa_nodes(gm)
    assert node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None) is not None
    if expected is not None:
        torch.testing.assert_close(run(gm, inputs)[0], expected)


def test_a_mask_that_is_a_graph_input_stays_with_its_reason():
    """A mask handed to the graph (OPT's decoder layers in training: its layerdrop breaks the graph before them)
    stays, even a causal one, and is reported with the reason, as one handed to a checkpoint is (it had gone
    unmentioned)."""
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    gm, inputs = capture(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), *QKV, mask)
    result = drop_causal_masks(gm)
    assert result.calls == 0
    (why,) = result.refused.values()
    assert "graph input" in why, why


def test_a_mask_shared_by_attentions_of_other_shapes_is_judged_for_each():
    def fn(q, k, v):
        mask = torch.ones(1, 1, dtype=torch.bool)  # causal for one query and one key; all-true when broadcast
        return (F.scaled_dot_product_attention(q[..., :1, :], k[..., :1, :], v[..., :1, :], attn_mask=mask),
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask))

    gm, inputs = capture(fn, *QKV)
    expected = fn(*QKV)
    result = drop_causal_masks(gm)
    assert result.calls == 1
    assert result.refused == {"mask": "its last two sizes (1, 1) are not the attention's (8, 8)"}
    short, full = sdpa_nodes(gm)
    assert short.kwargs["is_causal"] is True and full.kwargs["attn_mask"] is not None
    for got, want in zip(run(gm, inputs), expected):
        torch.testing.assert_close(got, want)


def test_a_mask_for_a_query_shorter_than_the_keys_stays():
    def fn(q, k, v):  # causal in SDPA's top-left sense, but kernels are only trusted with equal lengths
        return F.scaled_dot_product_attention(q[..., :4, :], k, v, attn_mask=torch.ones(4, 8, dtype=torch.bool).tril())

    gm, inputs = capture(fn, *QKV)
    result = drop_causal_masks(gm)
    assert result.calls == 0 and list(result.refused.values()) == [
        "its query and key lengths differ (4 and 8) and it hides some keys"]
    torch.testing.assert_close(run(gm, inputs)[0], fn(*QKV))


def _all_true(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(1, 8, 8, dtype=torch.bool))


def _zeros(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(8, 8))


def _cross(q, k, v):  # a shorter query over every key: a cross-attention without padding
    return F.scaled_dot_product_attention(q[..., :4, :], k, v, attn_mask=torch.ones(4, 8, dtype=torch.bool))


@pytest.mark.parametrize("fn", [_all_true, _zeros, _cross])
def test_a_mask_that_hides_nothing_is_dropped(fn):
    """An encoder's or a cross-attention's mask without padding, all True (or all 0), which transformers 5.17
    builds under Dynamo where eager passes none (BART's encoder and cross-attention): the call runs without it
    (the flash kernel), for any query and key lengths, with the same output. It was kept ("not causal")."""
    gm, inputs = capture(fn, *QKV)
    expected = fn(*QKV)
    result = drop_causal_masks(gm)
    assert (result.calls, result.unmasked, result.refused) == (1, 1, {})
    assert str(result) == "1 SDPA call(s) run without an in-graph mask that hides nothing"
    (node,) = sdpa_nodes(gm)
    assert node.kwargs["attn_mask"] is None and node.kwargs["is_causal"] is False
    torch.testing.assert_close(run(gm, inputs)[0], expected)


def test_a_checkpoint_body_given_a_causal_and_a_hide_nothing_mask_keeps_both():
    """One activation-checkpoint body called with a causal mask and with one that hides nothing: its one SDPA call
    cannot take both forms, so it stays as traced; calls outside checkpoints change each by its own mask."""
    from torch.utils.checkpoint import checkpoint

    def attend(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def fn(q, k, v):
        causal, full = torch.ones(8, 8, dtype=torch.bool).tril(), torch.ones(8, 8, dtype=torch.bool)
        return (checkpoint(attend, q, k, v, causal, use_reentrant=False)
                + checkpoint(attend, q, k, v, full, use_reentrant=False)
                + attend(q, k, v, causal) + attend(q, k, v, full))

    gm, inputs = capture(fn, *QKV)
    expected = fn(*QKV)
    first, second = [n for n in gm.graph.nodes if is_checkpoint(n)]
    second.args = (first.args[0], *second.args[1:])  # one body for both calls (Dynamo traced one each here)
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.recompile()
    result = drop_causal_masks(gm)
    assert (result.calls, result.unmasked) == (2, 1), str(result)
    assert str(result) == ("1 SDPA call(s) run with is_causal=True instead of an in-graph causal mask; 1 SDPA "
                           "call(s) run without an in-graph mask that hides nothing")
    kept = [n for n in sdpa_nodes(gm) if n.kwargs.get("attn_mask") is not None]
    assert len(kept) == 1 and kept[0].graph is not gm.graph  # the checkpoint body's
    torch.testing.assert_close(run(gm, inputs)[0], expected)


def test_a_mask_that_does_not_broadcast_to_the_query_stays():
    def fn(q, k, v):  # SDPA itself refuses this mask when it runs; the pass must not make the call succeed
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(2, 1, 8, 8, dtype=torch.bool).tril())

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with pytest.raises(RuntimeError):
        torch.compile(fn, backend=backend, dynamic=False)(*(t[:1] for t in QKV))
    torch._dynamo.reset()
    result = drop_causal_masks(graphs[0])
    assert result.calls == 0
    assert list(result.refused.values()) == ["its shape (2, 1, 8, 8) does not broadcast to the attention's (1, 3, 8, 8)"]


def test_dynamic_shapes_keep_the_mask():
    def fn(q, k, v):
        n = q.shape[-2]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(n, n, dtype=torch.bool).tril())

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, dynamic=True)(*QKV)
    torch._dynamo.reset()
    result = drop_causal_masks(graphs[0])
    assert result.calls == 0 and result.symbolic, result.refused


def test_a_recompile_for_a_smaller_last_batch_warns_once_of_the_kept_masks(llama, caplog, monkeypatch):
    """After a batch of another size Dynamo recompiles with the batch size symbolic, and the masks stay for the rest
    of the run (attention ~2x slower at 16384 tokens): said once at WARNING with the fix, at INFO after."""
    from flce_compile.compiler import backend

    monkeypatch.setattr(backend, "_warned_symbolic_masks", False)
    g = torch.Generator().manual_seed(3)
    caplog.set_level(logging.INFO, logger="flce_compile")
    torch._dynamo.reset()
    compiled = torch.compile(llama, backend="flce", options={"flce.inner": "aot_eager"})
    for batch in (4, 2, 3):
        ids = torch.randint(0, 128, (batch, 16), generator=g)
        compiled(input_ids=ids, labels=ids)
    torch._dynamo.reset()
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "SDPA" in r.getMessage()]
    assert [level for level, _ in said] == ["INFO", "WARNING"], said  # (batch 3 reuses batch 2's dynamic graph)
    assert said[0][1].startswith("flce: 2 SDPA call(s) run with is_causal=True")
    assert "torch.compile(..., dynamic=False) keeps shapes static" in said[1][1]


def test_option_turns_the_pass_off_and_is_validated(llama, caplog):
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(2))
    seen = []
    caplog.set_level(logging.INFO, logger="flce_compile")

    def inner(gm, example_inputs):
        seen.append([n.kwargs.get("is_causal") for n in sdpa_nodes(gm)])
        return gm.forward

    for flag in (True, False):
        torch._dynamo.reset()
        torch.compile(llama, backend="flce", options={"flce.inner": inner, "flce.causal_masks": flag})(
            input_ids=ids, labels=ids)
    torch._dynamo.reset()
    assert seen == [[True, True], [False, False]]
    said = [r.getMessage() for r in caplog.records if "SDPA" in r.getMessage()]
    assert said == ["flce: 2 SDPA call(s) run with is_causal=True instead of an in-graph causal mask"]
    with pytest.raises(TypeError, match=r"options\['flce.causal_masks'\] must be True or False"):
        split_options({"flce.causal_masks": "yes"})


def test_explain_reports_the_attention_rewrite(llama):
    import flce_compile

    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(3))
    report = flce_compile.explain(llama, input_ids=ids, labels=ids)
    assert report.notes == ["[graph 0] attention: 2 SDPA call(s) run with is_causal=True instead of an in-graph "
                            "causal mask"]
    assert "attention: 2 SDPA call(s)" in str(report)
    off = flce_compile.explain(llama, input_ids=ids, labels=ids, options={"flce.causal_masks": False})
    assert not any("attention" in note for note in off.notes)


def test_explain_names_the_checkpoint_side_effect_fix_when_kernels_is_loaded(llama, monkeypatch):
    """transformers 5.25 requires ``kernels``, whose hook made a checkpointed Llama compile in five pieces (CI's
    clean clone, 2026-12-03): explain says so and names the fix, only for a checkpointed model with the package
    loaded, the flag off and ``flce.checkpoint_side_effects="replay"``; with the default it reports the one graph
    the backend gets."""
    import sys
    import types

    import torch._dynamo.config as dynamo_config

    import flce_compile

    if not hasattr(dynamo_config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        pytest.skip("this torch has no such flag")
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(4))
    hooked = "kernels" in sys.modules  # the real package, whose hook transformers 5.25 puts in each layer
    monkeypatch.setitem(sys.modules, "kernels", sys.modules.get("kernels") or types.ModuleType("kernels"))
    flag = "skip_fwd_side_effects_in_bwd_under_checkpoint = True"

    replay = {"flce.checkpoint_side_effects": "replay"}

    def explained(options=None):
        with dynamo_config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=False):
            return flce_compile.explain(llama, input_ids=ids, labels=ids, options=options)

    def noted(report) -> bool:
        return any(flag in note for note in report.notes)

    assert not noted(explained(replay))  # not checkpointed
    llama.gradient_checkpointing_enable()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pieces = explained(replay)
        assert noted(pieces) and (pieces.graph_count > 1 or not hooked)
        # (transformers 5.25 renamed the property it reads, and warns on the old name)
        assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
        default = explained()  # the backend's default turns the flag on for its compiles: one graph, no note
        assert not noted(default) and default.graph_count == 1
        with checkpoint_side_effects_allowed():
            assert not any(flag in n for n in flce_compile.explain(llama, input_ids=ids, labels=ids,
                                                                  options=replay).notes)
    finally:
        llama.gradient_checkpointing_disable()
