"""The traced values of nodes a pass adds to a Dynamo graph: computed as Dynamo computes its own, from the
example values of their inputs, under the graph's fake mode (later passes and the inner compiler read them); and
the marks a pass leaves on its nodes for the passes after it."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch import fx

from .patterns import meta_value


def graph_fake_mode(gm: fx.GraphModule, example_inputs: Any = None) -> Any:
    """The fake mode of the graph's own example values (the tensors new nodes are computed from), else the one
    ``example_inputs`` carry, else None (a graph not traced by Dynamo)."""
    for node in gm.graph.nodes:
        val = meta_value(node)
        if isinstance(val, torch._subclasses.FakeTensor):
            return val.fake_mode
    from torch._guards import detect_fake_mode

    return detect_fake_mode(example_inputs) if example_inputs is not None else None


#: Where a node came from in the user's code, as Dynamo records it (stack traces and module paths in logs).
_SOURCE_KEYS = ("stack_trace", "nn_module_stack", "source_fn_stack")


def copy_source_meta(node: fx.Node, new: fx.Node) -> None:
    """Give ``new``, which stands for ``node`` in the graph, ``node``'s record of where it came from."""
    new.meta.update({k: v for k, v in node.meta.items() if k in _SOURCE_KEYS})


def propagate_meta(gm: fx.GraphModule, nodes: list[fx.Node], fake_mode: Any, on_meta: bool = False) -> None:
    """Give new nodes the ``example_value`` Dynamo gives its own. Without a fake mode (a graph from
    ``symbolic_trace`` + ShapeProp) nothing reads them, unless ``on_meta``: then they are computed on meta
    tensors, for a pass whose analysis reads the new nodes' shapes and dtypes."""
    if fake_mode is None and not on_meta:
        return
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        for n in nodes:
            if n.op == "get_attr":
                val = gm
                for part in str(n.target).split("."):
                    val = getattr(val, part)
                n.meta["example_value"] = (fake_mode.from_tensor(val) if fake_mode is not None
                                           else torch.empty_like(val, device="meta"))
                continue
            args = fx.node.map_arg(n.args, meta_value)
            kwargs = fx.node.map_arg(n.kwargs, meta_value)
            if n.op == "call_method":
                n.meta["example_value"] = getattr(args[0], n.target)(*args[1:], **kwargs)
            else:
                n.meta["example_value"] = n.target(*args, **kwargs)


#: A node's meta key: the node joins the tensors of its first argument along their last dimension (a LoRA fold's
#: ``[x, s*u]`` and ``[W, B]``: ``lora_head``), so the pieces can stand for it where a graph returns it.
JOINED = "flce_joined_pieces"


def joined_pieces(node: fx.Node) -> list[fx.Node] | None:
    """The pieces a node marked ``JOINED`` joins, in order; None for any other node."""
    return list(node.args[0]) if node.meta.get(JOINED) else None


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` whose nodes have shallow copies of the originals' metadata (the passes assign keys, never
    change a value in place) and keep the attributes Dynamo set on them (a placeholder's ``_dynamo_source``): what
    the backend puts back should the fusion pass, which changes the graph in place, fail halfway, and what a pass
    tries a change on before making it."""
    copied_graph = copy.deepcopy(graph)
    for node, copied in zip(graph.nodes, copied_graph.nodes):
        copied.__dict__.update(vars(node))
    return copied_graph
