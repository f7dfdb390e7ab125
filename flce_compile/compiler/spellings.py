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
"""

from __future__ import annotations

import operator
from typing import Any, Callable

from torch import fx

#: The DTensor calls ``dtensor_call`` recognises.
DTENSOR_CALLS = ("redistribute", "to_local", "from_local")
#: Names of torch 2.11 Dynamo's on-the-fly wrappers, by the call they stand for.
_WRAPPER_NAMES = {"prim_redistribute": "redistribute", "prim_to_local": "to_local", "prim from_local": "from_local"}


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
