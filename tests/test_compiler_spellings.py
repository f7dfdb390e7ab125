"""``compiler/spellings.py``: the passes recognise a call in torch 2.13's spelling and in torch 2.11's (the GPU
machine's) or 2.15's, which CI cannot trace. torch 2.11's Dynamo wrappers are built here as it builds them: a function
made on the fly in ``torch._dynamo``, named after the call, that holds every argument but the tensor."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx, nn

from flce_compile.compiler.mutations import effect
from flce_compile.compiler.patterns import match_linear
from flce_compile.compiler.spellings import dtensor_call, from_local_may_broadcast, operator_of, transposed_attribute


def _dynamo_wrapper(name: str, module: str = "torch._dynamo.variables.tensor"):
    def wrapper(x):  # what the wrapper does does not matter here: only how the passes name it
        return x

    wrapper.__name__ = name
    wrapper.__module__ = module
    return wrapper


@pytest.mark.parametrize("method, op", [("__eq__", operator.eq), ("__and__", operator.and_),
                                        ("__iand__", operator.iand), ("__getitem__", operator.getitem),
                                        ("eq", None), ("__dunder_nobody_has__", None), ("__init__", None)])
def test_operator_of(method, op):
    assert operator_of(method) is op


def test_dtensor_calls_in_both_spellings_and_nothing_else():
    g = fx.Graph()
    x = g.placeholder("x")
    nodes = {
        "redistribute (2.13)": g.call_method("redistribute", (x,)),
        "to_local (2.13)": g.call_method("to_local", (x,)),
        "redistribute (2.11)": g.call_function(_dynamo_wrapper("prim_redistribute"), (x,)),
        "to_local (2.11)": g.call_function(_dynamo_wrapper("prim_to_local"), (x,)),
        "from_local (2.11)": g.call_function(_dynamo_wrapper("prim from_local", "torch._dynamo.variables.torch"),
                                             (x,)),
        "a user's function of the same name": g.call_function(_dynamo_wrapper("prim_redistribute", "mylib"), (x,)),
        "another method": g.call_method("view", (x, -1)),
    }
    g.output(tuple(nodes.values()))
    gm = fx.GraphModule(nn.Module(), g)
    named = {label: dtensor_call(node) for label, node in nodes.items()}
    assert named == {"redistribute (2.13)": "redistribute", "to_local (2.13)": "to_local",
                     "redistribute (2.11)": "redistribute", "to_local (2.11)": "to_local",
                     "from_local (2.11)": "from_local", "a user's function of the same name": None,
                     "another method": None}
    # The alias analysis takes each DTensor call as writing nothing (its result may share the input's memory),
    # but 2.11's from_local, whose run_check flag (a broadcast into the input) the graph does not show; the
    # user's function of the same name may write what it is given.
    for label, node in nodes.items():
        if named[label] is not None:
            writes = (x,) if label == "from_local (2.11)" else ()
            assert effect(gm, node).writes == writes and not effect(gm, node).fresh, label
    assert effect(gm, nodes["a user's function of the same name"]).writes == (x,)
    assert from_local_may_broadcast(nodes["from_local (2.11)"])


def test_from_local_itself_is_recognised_with_its_run_check():
    """2.13's spelling shows ``run_check``: only ``run_check=True`` (or a value the graph computes) may broadcast
    rank 0's values into the input, so only then is the input written and not handed to the fused op as it is."""
    tensor_api = pytest.importorskip("torch.distributed.tensor")
    g = fx.Graph()
    x = g.placeholder("x")
    calls = {flag: g.call_function(tensor_api.DTensor.from_local, (x,), {} if flag is None else {"run_check": flag})
             for flag in (None, False, True)}
    g.output(tuple(calls.values()))
    gm = fx.GraphModule(nn.Module(), g)
    assert all(dtensor_call(node) == "from_local" for node in calls.values())
    assert [from_local_may_broadcast(node) for node in calls.values()] == [False, False, True]
    assert [effect(gm, node).writes for node in calls.values()] == [(), (), (x,)]


def test_an_attributes_transpose_in_both_spellings():
    """``w.T`` and ``w.mT`` as an attribute read (2.11, 2.13) or as the ATen op behind it (2.15), and the LM head
    ``x @ W.T`` matched on the untransposed weight either way."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    nodes = {
        "w.T (2.13)": g.call_function(getattr, (w, "T")),
        "w.mT (2.13)": g.call_function(getattr, (w, "mT")),
        "w.T (2.15)": g.call_function(torch.ops.aten.numpy_T, (w,)),
        "w.mT (2.15)": g.call_function(torch.ops.aten.mT, (w,)),
        "w.T (2.15, an overload)": g.call_function(torch.ops.aten.numpy_T.default, (w,)),
        "w.mT (2.15, another overload)": g.call_function(torch.ops.aten.mT.a, (w,)),
        "w.shape": g.call_function(getattr, (w, "shape")),
        "w.t()": g.call_method("t", (w,)),
        "another op": g.call_function(torch.ops.aten.relu, (w,)),
    }
    transposed = {label: transposed_attribute(node) for label, node in nodes.items()}
    assert transposed == {label: w if label.startswith(("w.T", "w.mT")) else None for label in nodes}
    heads = {}
    for label in ("w.T (2.13)", "w.T (2.15)", "w.mT (2.15)"):
        nodes[label].meta["example_value"] = torch.empty(4, 6)  # (H, V): W is (6, 4)
        heads[label] = g.call_function(operator.matmul, (x, nodes[label]))
    g.output(tuple(heads.values()))
    gm = fx.GraphModule(nn.Module(), g)
    for label, head in heads.items():
        match = match_linear(gm, head)
        assert (match.weight, match.form, match.weight_is_transposed) == (w, "x @ W.T", False), label
