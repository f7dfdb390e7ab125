"""Which graph tensors a node may write, and which tensors may share memory: the pass's proof that nothing
changes the lm_head's operands between the lm_head and the loss.

The fused op runs where the loss ran, so it reads the hidden states, the weight and the bias later than the
lm_head did. That is only safe when no node in between writes to any of them or to any alias or view of them.
Purity is decided by what is known to be pure, never by a list of ops known to mutate: an ATen op is judged
by its schema, Python's operators and a few tensor methods are known, and any other call is assumed to write
every tensor it is given. Aliasing is as cautious: a result is fresh memory only when the op is known to make
a new tensor; anything else may share memory with every tensor input. ``erase_dead`` removes what a pass left
without users by the same rule: only nodes known to write nothing.
"""

from __future__ import annotations

import builtins
import functools
import inspect
import operator
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import fx, nn

from .spellings import dtensor_call, from_local_may_broadcast, operator_of

#: Python operators that read their operands and return a new value.
_PURE_OPERATORS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow,
    operator.matmul, operator.neg, operator.pos, operator.abs, operator.invert, operator.eq, operator.ne,
    operator.lt, operator.le, operator.gt, operator.ge, operator.and_, operator.or_, operator.xor,
    operator.lshift, operator.rshift, operator.not_, operator.truth, operator.contains, operator.index,
    operator.is_, operator.is_not, operator.getitem,
}
#: Of those, the ones whose result may be an operand itself: ``getitem`` views it, and a tensor's unary ``+``
#: (``torch.positive``) returns the tensor itself.
_ALIASING_OPERATORS = {operator.getitem, operator.pos}
#: Operators that write their first operand (item assignment and the augmented assignments).
_WRITING_OPERATORS = {
    operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior,
    operator.ixor, operator.ilshift, operator.irshift,
}
#: Builtins Dynamo leaves in graphs that only read.
_PURE_BUILTINS = {builtins.getattr, builtins.len, builtins.isinstance, builtins.int, builtins.float,
                  builtins.bool, builtins.min, builtins.max, builtins.abs, builtins.tuple, builtins.list}
#: Tensor methods with no ATen op of their name that only read (casts may return ``self``: not fresh).
_PURE_METHODS = {"float", "double", "half", "bfloat16", "int", "long", "short", "bool", "byte", "char", "cpu",
                 "cuda", "type", "size", "dim", "numel", "stride", "element_size", "is_contiguous",
                 "is_floating_point", "data_ptr", "storage_offset", "get_device", "tolist", "item",
                 "__getitem__", "__len__",
                 # DTensor methods: a new DTensor (or its local tensor, a view) with the same values
                 "redistribute", "to_local", "full_tensor"}
#: ATen ops whose schema promises a new tensor but whose implementation may hand back the input itself.
_MAY_RETURN_INPUT = {"dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d",
                     "dropout2d", "dropout3d", "type_as", "einsum", "__getitem__", "getitem",
                     # the input itself, or a view of it, where no reshaping or conversion is needed
                     "atleast_1d", "atleast_2d", "atleast_3d", "broadcast_tensors", "conj_physical", "dequantize"}
#: torch.nn.functional functions whose ATen op has another name. ``F.cross_entropy``'s loss is new memory: judged
#: as one that may alias the logits, a mixture-of-experts model's ``loss += coef * aux_loss`` (transformers'
#: Mixtral, Qwen2-MoE) read as a write to them, and the returned logits were formed in every forward.
_ATEN_NAMES = {"cross_entropy": "cross_entropy_loss"}
#: torch.nn modules (call_module nodes) that compute a new tensor from their input and write nothing.
_FRESH_MODULES = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.Conv1d, nn.Conv2d, nn.Tanh, nn.GELU,
                  nn.SiLU, nn.Softmax, nn.LogSoftmax, nn.CrossEntropyLoss, nn.NLLLoss)
if hasattr(nn, "RMSNorm"):
    _FRESH_MODULES = _FRESH_MODULES + (nn.RMSNorm,)


@dataclass(frozen=True)
class Effect:
    """What a node does to memory: the graph nodes whose tensors it may write, and whether its result is
    fresh memory (False: it may alias any of its tensor inputs)."""

    writes: tuple[fx.Node, ...]
    fresh: bool


@functools.cache
def _aten_verdict(name: str) -> tuple[bool, bool] | None:
    """(pure, fresh) for the ATen op ``name`` from its schemas, or None when ATen has no op of that name.

    Overloads that write an argument (``out=`` variants, ``add_``) do not count: a graph call reaches them only
    with ``out=`` or an in-place name, which are checked before. Pure when some overload writes nothing;
    fresh when no such overload returns an alias of an input.
    """
    packet = getattr(torch.ops.aten, name, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return None
    reading = []
    for overload in packet.overloads():
        schema = getattr(packet, overload)._schema
        if not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            reading.append(schema)
    if not reading:
        return False, False
    fresh = name not in _MAY_RETURN_INPUT and not any(r.alias_info is not None for s in reading for r in s.returns)
    return True, fresh


def _name(target: Any) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def _inplace_flag(node: fx.Node) -> bool:
    """``inplace=True`` passed by keyword or by position (``F.relu(x, True)``)."""
    if node.kwargs.get("inplace") is True:
        return True
    try:
        params = list(inspect.signature(node.target).parameters)
    except (TypeError, ValueError):
        return False
    if "inplace" in params:
        pos = params.index("inplace")
        return len(node.args) > pos and node.args[pos] is True
    return False


def _tensor_inputs(node: fx.Node) -> tuple[fx.Node, ...]:
    return tuple(n for n in node.all_input_nodes if not _is_non_tensor(n))


def _is_non_tensor(node: fx.Node) -> bool:
    val = node.meta.get("example_value", node.meta.get("val"))
    return val is not None and not isinstance(val, torch.Tensor) and not isinstance(val, (tuple, list))


def _first_argument(node: fx.Node) -> tuple[fx.Node, ...]:
    """The tensors of a call's first argument, which an in-place call writes: one node, or each node of a list,
    given by position or by its usual keyword (``F.relu(input=h, inplace=True)``)."""
    if node.args:
        return _nodes_in(node.args[0])
    return next((_nodes_in(node.kwargs[k]) for k in ("self", "input") if k in node.kwargs), ())


def _nodes_in(value: Any) -> tuple[fx.Node, ...]:
    """The graph nodes of one argument: a node, or those of a list or tuple of them."""
    if isinstance(value, fx.Node):
        return (value,)
    if isinstance(value, (tuple, list)):
        return tuple(n for n in value if isinstance(n, fx.Node))
    return ()


def _out_nodes(node: fx.Node) -> tuple[fx.Node, ...]:
    return _nodes_in(node.kwargs.get("out"))


def effect(gm: fx.GraphModule, node: fx.Node) -> Effect:
    """The memory effect of one node (see the module docstring for the rules)."""
    if node.op in ("placeholder", "get_attr", "output"):
        return Effect((), True)
    first = _first_argument(node)
    unknown = Effect(_tensor_inputs(node), False)
    outs = _out_nodes(node)
    if outs:
        return Effect(outs, False)
    if node.op == "call_module":
        return _module_effect(gm, node, first, unknown)
    hidden = _hidden_writes(node) if node.op == "call_function" else ()
    if hidden:
        return Effect(hidden, False)
    target, name = node.target, _name(node.target)
    if node.op == "call_method":
        if _writes_self(name):
            return Effect(first, False)
        if name in _PURE_METHODS:
            return Effect((), False)
        dunder_of = operator_of(name)  # ``a.__eq__(b)``: how Dynamo in torch 2.11 records ``a == b``
        if dunder_of in _PURE_OPERATORS:
            return Effect((), dunder_of not in _ALIASING_OPERATORS)
        return _by_aten_name(name, unknown)
    if target in _WRITING_OPERATORS:
        return Effect(first, False)
    if target in _PURE_OPERATORS:
        return Effect((), target not in _ALIASING_OPERATORS)
    if target in _PURE_BUILTINS:
        return Effect((), False)
    dtensor = dtensor_call(node)
    if dtensor is not None:  # DTensor calls wrap or move their input; from_local may broadcast into it
        return Effect(first if dtensor == "from_local" and from_local_may_broadcast(node) else (), False)
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        # Each argument the schema marks written (``Tensor(a!)``, ``Tensor(a!)[]``), by position or by name.
        written = tuple(n for i, arg in enumerate(schema.arguments)
                        if arg.alias_info is not None and arg.alias_info.is_write
                        for n in _nodes_in(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)))
        return Effect(written, not any(r.alias_info is not None for r in schema.returns))
    if not (getattr(target, "__module__", None) or "").startswith("torch"):
        return unknown  # user code or a library Dynamo did not inline: may write anything it is given
    if _writes_self(name):
        # An in-place torch function may write more than its first argument (``torch._fused_adam_``, the found_inf
        # of ``torch._amp_foreach_non_finite_check_and_unscale_``): every tensor it is given counts as written.
        return unknown
    if _inplace_flag(node):
        return Effect(first, False)
    if getattr(F, name, None) is target:
        # torch.nn.functional writes only through inplace=, a trailing underscore and the running statistics or
        # max_norm of ``_hidden_writes`` (all checked above).
        verdict = _aten_verdict(_ATEN_NAMES.get(name, name))
        return Effect((), bool(verdict and verdict[1]))
    return _by_aten_name(name, unknown)


def _module_effect(gm: fx.GraphModule, node: fx.Node, first: tuple[fx.Node, ...], unknown: Effect) -> Effect:
    try:
        mod = gm.get_submodule(node.target)
    except AttributeError:
        return unknown
    if getattr(mod, "inplace", False):
        return Effect(first, False)
    if isinstance(mod, _FRESH_MODULES):
        return Effect((), True)
    # torch.nn modules write their inputs only through inplace=; their own buffers (BatchNorm's running
    # statistics) are not graph tensors here.
    return Effect((), False) if type(mod).__module__.startswith("torch.nn.") else unknown


#: ATen ops, and the torch and torch.nn.functional functions of their name, that update the running statistics
#: they are given though their schema marks no write (``Tensor? running_mean``), and the flag under which they do.
_RUNNING_STATS = {"batch_norm": "training", "native_batch_norm": "training", "cudnn_batch_norm": "training",
                  "miopen_batch_norm": "training", "_batch_norm_impl_index": "training",
                  "instance_norm": "use_input_stats"}
#: torch.nn.functional functions that renormalize, in place, the rows of their weight they read when given max_norm.
_RENORMING = frozenset({"embedding", "embedding_bag"})


def _hidden_writes(node: fx.Node) -> tuple[fx.Node, ...]:
    """The tensors a call writes that no schema says it does: the running statistics a batch norm in training (or
    an instance norm on its input's statistics) updates, and the weight ``F.embedding`` / ``F.embedding_bag``
    renormalize under max_norm. ``()`` for any other call."""
    target = node.target
    name = target.overloadpacket.__name__ if isinstance(target, torch._ops.OpOverload) else _name(target)
    if name not in _RUNNING_STATS and name not in _RENORMING:
        return ()
    args = _arguments(node, name)
    if args is None:  # arguments that bind to no signature: any tensor given may be written
        return _tensor_inputs(node)
    if name in _RENORMING:
        return _nodes_in(args.get("weight")) if args.get("max_norm") is not None else ()
    if args.get(_RUNNING_STATS[name]) is False:
        return ()
    return _nodes_in(args.get("running_mean")) + _nodes_in(args.get("running_var"))


def _arguments(node: fx.Node, name: str) -> dict[str, Any] | None:
    """A call's arguments by parameter name, defaults included: by the Python signature of its target, else by the
    schema of the ATen op (an OpOverload's own, or ``aten.<name>``'s first), else None."""
    target, schema = node.target, getattr(node.target, "_schema", None)
    if schema is None:
        try:
            bound = inspect.signature(target).bind(*node.args, **node.kwargs)
        except (TypeError, ValueError):  # a builtin (``torch.batch_norm``): its ATen op's schema
            packet = getattr(torch.ops.aten, name, None)
            overloads = packet.overloads() if isinstance(packet, torch._ops.OpOverloadPacket) else []
            schema = getattr(packet, overloads[0])._schema if overloads else None
        else:
            bound.apply_defaults()
            return dict(bound.arguments)
    if schema is None:
        return None
    args = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    args.update(zip((a.name for a in schema.arguments), node.args))
    args.update(node.kwargs)
    return args


def _writes_own_state(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether a call_module node's module, or one inside it, updates its own state, which no graph node shows:
    a batch or instance norm's running statistics in training, an embedding's rows renormalized under max_norm."""
    if node.op != "call_module":
        return False
    try:
        mod = gm.get_submodule(node.target)
    except AttributeError:
        return True
    return any(isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats
               or isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None for m in mod.modules())


def _writes_self(name: str) -> bool:
    """Whether a tensor method named ``name`` writes ``self``: an augmented or item assignment (``__iadd__``,
    ``__setitem__``: a writing operator's dunder), or an in-place method (``add_``)."""
    if name.startswith("__") and name.endswith("__"):
        return operator_of(name) in _WRITING_OPERATORS
    return name.endswith("_")


def _by_aten_name(name: str, unknown: Effect) -> Effect:
    verdict = _aten_verdict(name)
    if verdict is None or not verdict[0]:
        return unknown
    return Effect((), verdict[1])


def _storage_root(node: fx.Node) -> tuple[Any, ...]:
    """A graph input's memory, as its traced example value's storage: two inputs that share memory (a tensor
    and a view of it, passed apart) share this root, so a write through one is a write to the other. None
    known: ()."""
    val = node.meta.get("example_value", node.meta.get("val"))
    if not isinstance(val, torch.Tensor):
        return ()
    try:
        return (("storage", val.untyped_storage()._cdata),)
    except Exception:  # noqa: BLE001 - a tensor without storage (a subclass, a sparse layout): its own root
        return ()


class AliasMap:
    """For each node: its position in the graph, its ``Effect``, and the set of fresh-memory nodes (roots) its
    tensor may share memory with."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.effects: dict[fx.Node, Effect] = {}
        self.roots: dict[fx.Node, frozenset[Any]] = {}
        self.position: dict[fx.Node, int] = {}
        for node in gm.graph.nodes:
            self.position[node] = len(self.position)
            eff = effect(gm, node)
            self.effects[node] = eff
            if node.op == "get_attr":
                self.roots[node] = frozenset({("attr", str(node.target))})  # one root per attribute name
            elif node.op == "placeholder":
                self.roots[node] = frozenset({node, *_storage_root(node)})
            elif eff.fresh:
                self.roots[node] = frozenset({node})
            else:
                self.roots[node] = frozenset({node}).union(*(self.roots.get(i, frozenset()) for i in node.all_input_nodes))

    def roots_of(self, nodes: Iterable[fx.Node | None], attrs: Iterable[str] = ()) -> frozenset[Any]:
        out: set[Any] = {("attr", a) for a in attrs}
        for n in nodes:
            if isinstance(n, fx.Node):
                out |= self.roots[n]
        return frozenset(out)

    def first_write(self, start: fx.Node, stop: fx.Node, roots: frozenset[Any]) -> fx.Node | None:
        """The first node strictly between ``start`` and ``stop`` (graph order) that may write a tensor sharing
        memory with ``roots``, or None."""
        return next((node for node in nodes_between(start, stop)
                     if any(self.roots[written] & roots for written in self.effects[node].writes)), None)


def nodes_between(start: fx.Node, stop: fx.Node) -> Iterator[fx.Node]:
    """The nodes strictly between ``start`` and ``stop`` in graph order (up to the output, when ``stop`` is not
    after ``start``)."""
    node = start.next
    while node is not stop and node.op != "output":
        yield node
        node = node.next


#: torch.nn.functional's random functions whose names are no random ATen op's (``F.dropout2d`` runs
#: ``feature_dropout``; ``F.gumbel_softmax`` draws with ``exponential_``, ``F.fractional_max_pool2d`` its samples with
#: ``torch.rand``; ``F.multi_head_attention_forward`` drops out): Dynamo records each as one call.
_RANDOM_FUNCTIONS = frozenset({"dropout1d", "dropout2d", "dropout3d", "gumbel_softmax", "fractional_max_pool2d",
                               "fractional_max_pool3d", "fractional_max_pool2d_with_indices",
                               "fractional_max_pool3d_with_indices", "_fractional_max_pool2d", "_fractional_max_pool3d",
                               "multi_head_attention_forward"})
#: torch.nn modules that draw random numbers (a call_module node draws when its module holds one).
_RANDOM_MODULES = (nn.modules.dropout._DropoutNd, nn.RReLU, nn.FractionalMaxPool2d, nn.FractionalMaxPool3d,
                   nn.MultiheadAttention)


@functools.cache
def _aten_random(name: str) -> bool:
    """Whether the ATen op ``name`` draws from a random generator (an overload tagged nondeterministic_seeded)."""
    packet = getattr(torch.ops.aten, name, None)
    return isinstance(packet, torch._ops.OpOverloadPacket) and any(
        torch.Tag.nondeterministic_seeded in getattr(packet, overload).tags for overload in packet.overloads())


def draws_random(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` draws from torch's random generator (``torch.rand``, ``randint``, a dropout, ...): such nodes
    must keep their order, or each draws other numbers than eager's. Calls the ``effect`` rules treat as unknown
    (user code) are refused for their writes before this is asked."""
    if node.op == "call_module":
        try:
            mod = gm.get_submodule(node.target)
        except AttributeError:
            return True
        return any(isinstance(m, _RANDOM_MODULES) for m in mod.modules())
    if node.op not in ("call_function", "call_method"):
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in node.target.tags
    name = _name(node.target)
    return name in _RANDOM_FUNCTIONS or _aten_random(name)


def grad_mode_switch(start: fx.Node, stop: fx.Node) -> fx.Node | None:
    """The first node strictly between ``start`` and ``stop`` that sets grad mode (``torch.no_grad()`` or
    ``enable_grad()`` as Dynamo records them), or None."""
    return next((node for node in nodes_between(start, stop) if node.op == "call_function"
                 and getattr(node.target, "__name__", "") == "_set_grad_enabled"), None)


def describe(node: fx.Node) -> str:
    """A short, user-facing name of a writing node: ``h[...] = ...``, ``x.copy_(...)``, ``F.relu(..., inplace=True)``."""
    name = _name(node.target)
    if node.target is operator.setitem:
        return f"item assignment {node.args[0]}[...] = ... ({node.name})"
    if node.op == "call_method":
        return f"{node.args[0]}.{name}(...) ({node.name})"
    extra = " with out=" if node.kwargs.get("out") is not None else " with inplace=True" if _inplace_flag(node) else ""
    return f"{name or node.target}(...){extra} ({node.name})"


def erase_dead(gm: fx.GraphModule, candidates: list[fx.Node]) -> None:
    """Erase the candidates left without users, then their inputs left without users, and so on.

    Not ``graph.eliminate_dead_code()``: that also removes the user's own unused in-place ops (a buffer's
    ``add_``, an input's ``clamp_``), which FX considers pure. Only nodes known to write nothing go.
    """
    # A candidate may be gone already: a site's unread uses (``patterns.Site.unread_uses``) can take in another
    # site's discarded loss, which that site's rewrite erased itself.
    work, erased, alive = list(candidates), set(), set(gm.graph.nodes)
    while work:
        node = work.pop()
        if node in erased or node not in alive or node.users or not _removable(gm, node):
            continue
        work.extend(node.all_input_nodes)
        gm.graph.erase_node(node)
        erased.add(node)


def unread_nodes(gm: fx.GraphModule | None, node: fx.Node) -> list[fx.Node] | None:
    """``node`` and every node that reads it, directly or through others, when erasing them all changes nothing the
    graph computes: none is the output, each is known to write nothing (``erase_dead``'s rule) and none draws random
    numbers (the draws after it would change). Else None. Dynamo keeps such nodes: its one clean-up of a traced
    graph drops unused getitem, get_attr and size nodes only, so a view whose result the model discards
    (``logits.view(-1, V)`` on a line of its own) stays in the graph with no user."""
    seen, work = {node}, [node]
    while work:  # (iterative: the readers of live logits may run long before the output is reached)
        current = work.pop()
        if not _removable(gm, current) or draws_random(gm, current):
            return None
        for user in current.users:
            if user not in seen:
                seen.add(user)
                work.append(user)
    return list(seen)


def _removable(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op not in ("call_function", "call_method", "call_module", "get_attr"):
        return False
    return not effect(gm, node).writes and not node.is_impure() and not _writes_own_state(gm, node)
