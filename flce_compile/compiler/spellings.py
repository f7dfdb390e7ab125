"""One call, two spellings: how Dynamo's versions record the same Python in a graph differently.

The passes read the graphs of torch 2.11 (the GPU machine) and of the current release (CI), and a call one of
them takes for something it does not know is left alone: an unfused site or a kept attention mask, never a
wrong result, but the speed is lost without a word in the tests of the other version. So each spelling the
passes must recognise is named here once:

* ``a == b`` with a tensor on the left: ``operator.eq(a, b)`` (2.13), or the method call ``a.__eq__(b)`` (2.11,
  seen in the Hugging Face mask; the only operator 2.11 respells so). ``operator_of`` maps any operator's dunder
  method back to the operator, whichever a later release respells.
* ``x.redistribute(...)`` / ``x.to_local()`` of a DTensor: method calls with their arguments (2.13), or a call of
  a function Dynamo makes on the fly that holds every argument but the tensor (2.11: "prim_redistribute",
  "prim_to_local"); ``DTensor.from_local(x, mesh, placements)``: the function itself (2.13) or such a wrapper
  ("prim from_local", 2.11). ``dtensor_call`` names the call either way; where the passes need the placements,
  they read them off the result's example value, which both spellings carry. 2.11 also hides ``from_local``'s
  ``run_check`` (``from_local_may_broadcast``).
* ``w.T`` / ``w.mT``: the attribute read, ``getattr(w, "T")`` (2.11, 2.13), or the ATen op behind it,
  ``aten.numpy_T(w)`` / ``aten.mT(w)`` (2.15; the LM head ``x @ W.T`` was then taken for a head whose weight is
  (H, V), and a LoRA fold kept two transposes of it). ``transposed_attribute`` names the tensor either way.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
from torch import fx

#: The DTensor calls ``dtensor_call`` recognises.
DTENSOR_CALLS = ("redistribute", "to_local", "from_local")
#: Names of torch 2.11 Dynamo's on-the-fly wrappers, by the call they stand for.
_WRAPPER_NAMES = {"prim_redistribute": "redistribute", "prim_to_local": "to_local", "prim from_local": "from_local"}


def _packet_and_overloads(name: str) -> list[Any]:
    """An ATen op's packet and each of its overloads (none where this torch lacks the op)."""
    packet = getattr(torch.ops.aten, name, None)
    return [] if packet is None else [packet, *(getattr(packet, o) for o in packet.overloads())]


#: The ATen ops a tensor's ``.T`` and ``.mT`` call, as torch 2.15's Dynamo records them (packets and overloads).
_TRANSPOSE_OPS = frozenset(op for name in ("numpy_T", "mT") for op in _packet_and_overloads(name))


def transposed_attribute(node: fx.Node) -> fx.Node | None:
    """The tensor whose ``.T`` or ``.mT`` ``node`` reads, in either spelling; None for any other node."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.target is getattr:
        return node.args[0] if node.args[1:] in (("T",), ("mT",)) else None
    return node.args[0] if node.target in _TRANSPOSE_OPS and len(node.args) == 1 and not node.kwargs else None


def operator_of(method: str) -> Callable[..., Any] | None:
    """The Python operator a tensor method named ``method`` is (``"__eq__"`` -> ``operator.eq``), or None."""
    if not (method.startswith("__") and method.endswith("__")):
        return None
    op = vars(operator).get(method)  # the module's own names: not attributes every module has (``__init__``)
    return op if callable(op) else None


def dtensor_call(node: fx.Node) -> str | None:
    """"redistribute", "to_local" or "from_local" when ``node`` is that DTensor call in either spelling."""
    if node.op == "call_method":
        return node.target if node.target in ("redistribute", "to_local") else None
    if node.op != "call_function":
        return None
    name = getattr(node.target, "__name__", "")
    if name == "from_local" and _module_of(node.target).startswith("torch.distributed.tensor"):
        return "from_local"
    return _WRAPPER_NAMES.get(name) if _is_dynamo_wrapper(node) else None


def from_local_may_broadcast(node: fx.Node) -> bool:
    """Whether a ``from_local`` call (``dtensor_call(node) == "from_local"``) may overwrite its input with rank 0's
    values: ``run_check=True`` broadcasts into it. PyTorch's own parallel styles pass ``run_check=False``, the
    default; torch 2.11's wrapper keeps the flag out of the graph, so there the answer is yes."""
    return _is_dynamo_wrapper(node) or node.kwargs.get("run_check", False) is not False


def _module_of(target: Any) -> str:
    return getattr(target, "__module__", None) or ""


def _is_dynamo_wrapper(node: fx.Node) -> bool:
    """Whether ``node`` calls a function Dynamo made on the fly (torch 2.11's spelling of DTensor calls)."""
    return node.op == "call_function" and _module_of(node.target).startswith("torch._dynamo")
