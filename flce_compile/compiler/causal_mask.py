"""Causal attention masks built in the graph: SDPA calls that receive one run with ``is_causal=True`` instead (and
masks that hide nothing, with no mask).

Compiled Hugging Face models lose SDPA's flash kernel: under Dynamo, transformers cannot rule out padding or
packed sequences (checks it makes on tensor values in eager), so it builds an explicit S x S mask from the
position ids, and SDPA then runs its memory-efficient or math kernel on it. At 16384 tokens that made every
compiled variant of a Llama-3.2-1B-shaped model 1.6x slower than eager and kept the mask and the slower
kernel's buffers (issue #13's end-to-end benchmark). Eager transformers skips the mask in the same case.

This pass proves a mask causal and drops it: the mask must be computed in the graph from constants alone
(no graph input's values: an ``attention_mask`` or ``position_ids`` the user passes may differ from call to
call, and then nothing is changed), with static shapes, outside any autocast region of the graph, by Python
operators and ATen ops that draw no random numbers (nothing opaque, whose result could depend on state the
graph does not show), and nothing else in the graph may write to it. It is then evaluated once, here, on the
device it is built on, and compared with ``tril(ones(L, L))`` (SDPA's ``is_causal``; query and key lengths must
be equal, as in training, so that no kernel's alignment convention matters; a float mask must hold only 0 and
-inf or the dtype's lowest value). Only then does each SDPA call that receives it, directly or through an
activation checkpoint's operand, get ``attn_mask=None, is_causal=True``; the mask's nodes left without users are
erased. A mask that hides nothing (all True, or all 0: an encoder's or a cross-attention's mask without padding,
which transformers 5.17 builds under Dynamo where eager passes none; BART's encoder and cross-attention) is dropped
the same way, the call then getting ``attn_mask=None, is_causal=False``, for any query and key lengths.
Evaluating costs the mask's memory once at compile time, which every step of the unchanged graph would pay;
an evaluation that fails (out of memory, say) leaves the graph as it was.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import fx

from .checkpoints import body_placeholders
from .mutations import AliasMap, erase_dead
from .patterns import checkpoint_body, is_checkpoint, meta_value
from .spellings import operator_of

#: SDPA as Dynamo records it.
_SDPA_TARGETS = tuple(t for t in (getattr(torch._C._nn, "scaled_dot_product_attention", None),
                                  torch.nn.functional.scaled_dot_product_attention) if t is not None)
#: SDPA's parameters in order (to read a call made with positional arguments).
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
#: Tensor methods with no ATen op of their name that only convert or describe a tensor.
_PLAIN_METHODS = {"float", "double", "half", "bfloat16", "int", "long", "short", "bool", "byte", "char", "type",
                  "size", "dim", "numel"}
#: Graph nodes that open and close an autocast region (ops inside it may compute in another dtype).
_AUTOCAST_ENTER, _AUTOCAST_EXIT = "_enter_autocast", "_exit_autocast"
#: How a refusal for symbolic shapes ends. Dynamo makes a size symbolic when a new one recompiles a graph (a
#: smaller last batch of an epoch does it), and the mask then stays for the rest of the run: ``MaskRewrite.symbolic``.
SYMBOLIC = ("symbolic, not static (under dynamic=True, or after Dynamo recompiled the graph for a new size, a "
            "smaller last batch say; torch.compile(..., dynamic=False) keeps shapes static, one graph per shape)")
#: Rows of the mask compared with the causal pattern at a time (bounds the comparison's extra memory).
_ROW_BLOCK = 4096


@dataclass
class MaskRewrite:
    """What the pass did to one graph: SDPA calls whose mask it dropped (given ``is_causal=True``, or, of those,
    ``unmasked`` ones whose mask hid nothing), and masks it left alone, with why."""

    calls: int = 0
    refused: dict[str, str] = field(default_factory=dict)  # mask node name -> reason
    unmasked: int = 0

    @property
    def symbolic(self) -> bool:
        """Whether a mask was kept because the graph's shapes are symbolic (``SYMBOLIC``)."""
        return any(why.endswith(SYMBOLIC) for why in self.refused.values())

    def __str__(self) -> str:
        causal = self.calls - self.unmasked
        parts = [f"{causal} SDPA call(s) run with is_causal=True instead of an in-graph causal mask"] if (
            causal or not self.unmasked) else []
        if self.unmasked:
            parts.append(f"{self.unmasked} SDPA call(s) run without an in-graph mask that hides nothing")
        text = "; ".join(parts)
        if self.refused:
            text += "; masks kept: " + "; ".join(f"{name}: {why}" for name, why in self.refused.items())
        return text


def drop_causal_masks(gm: fx.GraphModule) -> MaskRewrite:
    """Give every SDPA call of ``gm`` (and of its activation checkpoints' bodies) whose mask is proven causal
    ``is_causal=True`` and no mask, and every one whose mask is proven to hide nothing no mask, in place. Returns
    what was done."""
    facts = _Facts(gm)
    calls = _sdpa_calls(facts)
    result = MaskRewrite()
    # Per (mask node in gm, query shape, key length): True (causal for that attention), False (it hides nothing)
    # or the reason it is neither. One mask may serve attentions of other shapes, for which it broadcasts
    # differently.
    verdicts: dict[tuple, bool | str] = {}
    for sdpa in calls:
        if sdpa.key not in verdicts:
            verdicts[sdpa.key] = _mask_verdict(facts, sdpa.outer_mask, sdpa.query_shape, sdpa.key_len)
            if isinstance(verdicts[sdpa.key], str):
                result.refused[sdpa.outer_mask.name] = verdicts[sdpa.key]
    # A call inside a checkpoint body is shared by every call of that body: it changes only when all of them
    # pass a mask of one kind (and the body writes nothing into it).
    by_node: dict[fx.Node, list[_SDPACall]] = {}
    for sdpa in calls:
        by_node.setdefault(sdpa.node, []).append(sdpa)
    changed_bodies: dict[str, fx.GraphModule] = {}
    for node, uses in by_node.items():
        kinds = {verdicts[u.key] for u in uses}
        if len(kinds) != 1 or isinstance(is_causal := kinds.pop(), str) or not all(u.body_safe for u in uses):
            continue
        _drop_mask(node, is_causal)
        result.calls += 1
        result.unmasked += not is_causal
        if uses[0].body is not None:
            changed_bodies[uses[0].body_name] = uses[0].body
    for name, body in changed_bodies.items():
        _drop_unused_operands(gm, name, body)
        body.graph.lint()
        body.recompile()
    if result.calls:
        erase_dead(gm, list({sdpa.outer_mask for sdpa in calls}))
        gm.graph.lint()
        gm.recompile()
    return result


@dataclass
class _SDPACall:
    node: fx.Node  # the SDPA call (in gm, or in a checkpoint body)
    outer_mask: fx.Node  # the mask node in gm
    query_shape: tuple[int, ...] | None  # None unless static
    key_len: int | None
    body: fx.GraphModule | None = None  # the checkpoint body holding ``node``
    body_name: str = ""
    body_safe: bool = True  # the body writes nothing into its mask operand, and has no other name in gm

    @property
    def key(self) -> tuple:
        return (self.outer_mask, self.query_shape, self.key_len)


def _sdpa_calls(facts: _Facts) -> list[_SDPACall]:
    """The SDPA calls with a mask and ``is_causal=False``, with their mask as a node of the graph (a mask that is
    a graph input is found too, to be refused with its reason, as explain reports it)."""
    found = []
    names: dict[int, set[str]] = {}  # a body's attribute names in gm (one, unless a module is registered twice)
    for node in facts.gm.graph.nodes:
        if _is_sdpa(node):
            mask = _mask_arg(node)
            if mask is not None:  # a graph input too: refused, with the reason, as in a checkpoint body
                found.append(_SDPACall(node, mask, *_shapes(node)))
            continue
        checkpoint = checkpoint_body(facts.gm, node)
        if checkpoint is None:
            continue
        name, body = checkpoint
        names.setdefault(id(body), set()).add(name)
        placeholders = body_placeholders(node, body)
        if placeholders is None:
            continue
        for inner in body.graph.nodes:
            mask = _mask_arg(inner) if _is_sdpa(inner) else None
            if mask is None or mask.op != "placeholder":
                continue
            outer = node.args[1 + placeholders.index(mask)]
            if isinstance(outer, fx.Node):
                safe = outer not in facts.checkpoint_writes(node)
                found.append(_SDPACall(inner, outer, *_shapes(inner), body, name, safe))
    for call in found:  # _drop_unused_operands finds a body's calls by one name
        if call.body is not None and len(names[id(call.body)]) > 1:
            call.body_safe = False
    return found


def _is_sdpa(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _SDPA_TARGETS


def _arguments(node: fx.Node) -> dict[str, object]:
    merged = dict(zip(_SDPA_PARAMS, node.args))
    merged.update(node.kwargs)
    return merged


def _mask_arg(node: fx.Node) -> fx.Node | None:
    """The node ``node`` (an SDPA call) takes as its mask, when it takes one and ``is_causal`` is False."""
    arguments = _arguments(node)
    mask = arguments.get("attn_mask")
    if not isinstance(mask, fx.Node) or arguments.get("is_causal", False) is not False:
        return None
    return mask


def _shapes(node: fx.Node) -> tuple[tuple[int, ...] | None, int | None]:
    """The query's shape and the key's sequence length (its second-to-last size) of an SDPA call, when static."""
    arguments = _arguments(node)
    query, key = meta_value(arguments.get("query")), meta_value(arguments.get("key"))
    query_shape = key_len = None
    if isinstance(query, torch.Tensor) and query.dim() >= 2 and all(isinstance(n, int) for n in query.shape):
        query_shape = tuple(query.shape)
    if isinstance(key, torch.Tensor) and key.dim() >= 2 and isinstance(key.shape[-2], int):
        key_len = key.shape[-2]
    return query_shape, key_len


def _mask_verdict(facts: _Facts, mask: fx.Node, query_shape: tuple[int, ...] | None,
                  key_len: int | None) -> bool | str:
    """True when ``mask`` is a constant causal mask for an SDPA of these shapes, False when it is a constant mask
    that hides nothing; else why it is neither."""
    if query_shape is None or key_len is None:
        return f"the attention's shapes are {SYMBOLIC}"
    ancestors = _ancestors(mask)
    for node in ancestors:
        if node.op == "placeholder":
            return f"it depends on the values of graph input {node.target!r}"
        if node.op not in ("call_function", "call_method"):
            return f"it is built from {node.op} {node.target!r}"
        why = _not_constant(node)
        if why is not None:
            return why
        if node in facts.in_autocast:
            return "it is built inside a torch.autocast region of the graph"
        if _symbolic(meta_value(node)):
            return f"its shape is {SYMBOLIC}"
    if facts.written((n for n in facts.gm.graph.nodes if n not in ancestors), facts.aliases.roots_of(ancestors)):
        return "another node of the graph may write to it"
    try:
        with torch.no_grad():
            value = _evaluate(facts.gm, mask, ancestors)
        return _compare(value, query_shape, key_len)
    except Exception as exc:  # noqa: BLE001 - out of memory, an op that cannot run here: keep the mask
        if isinstance(exc, torch.OutOfMemoryError) and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return f"evaluating it failed: {exc!r}"


def _not_constant(node: fx.Node) -> str | None:
    """Why ``node`` (a call) may give another value at run time than here from the same inputs, or None: it must
    be a Python operator, or a torch function or tensor method of an ATen op that draws no random numbers (or a
    plain cast). Anything else (a user function Dynamo was told to leave opaque) may read state the graph does
    not show."""
    target = node.target
    if node.op == "call_method":
        name = str(target)
        if operator_of(name) is not None:  # ``a.__eq__(b)``: how Dynamo in torch 2.11 records ``a == b``
            return None
    elif getattr(target, "__module__", None) in ("_operator", "operator"):
        return None
    elif (getattr(target, "__module__", None) or "").split(".")[0] == "torch" and hasattr(target, "__name__"):
        name = target.__name__
    else:
        return f"it is built by {getattr(target, '__name__', target)!s}, which the pass cannot see into"
    if node.op == "call_method" and name in _PLAIN_METHODS:
        return None
    base = name[:-1] if name.endswith("_") and not name.endswith("__") else name
    packet = getattr(torch.ops.aten, base, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return f"it is built by {name}, which is not an ATen op the pass knows"
    if any(torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads()):
        return f"it is built with {name}, which draws random numbers"
    return None


def _in_autocast(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes of ``gm`` inside an autocast region the graph opens (its ops may compute in another dtype)."""
    inside, depth = set(), 0
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
        if name == _AUTOCAST_ENTER:
            depth += 1
        elif name == _AUTOCAST_EXIT:
            depth = max(0, depth - 1)
        elif depth:
            inside.add(node)
    return inside


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, work = set(), [node]
    while work:
        n = work.pop()
        if n not in seen:
            seen.add(n)
            work.extend(n.all_input_nodes)
    return seen


def _symbolic(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return not all(isinstance(s, int) for s in value.shape)
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


class _Facts:
    """What the judgements on one graph share, each worked out once and only when first asked: the alias map, the
    nodes inside autocast regions, and which operands each checkpoint call may write."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self._aliases: AliasMap | None = None
        self._in_autocast: set[fx.Node] | None = None
        self._checkpoint_writes: dict[fx.Node, tuple[fx.Node, ...]] = {}

    @property
    def aliases(self) -> AliasMap:
        if self._aliases is None:
            self._aliases = AliasMap(self.gm)
        return self._aliases

    @property
    def in_autocast(self) -> set[fx.Node]:
        if self._in_autocast is None:
            self._in_autocast = _in_autocast(self.gm)
        return self._in_autocast

    def checkpoint_writes(self, node: fx.Node) -> tuple[fx.Node, ...]:
        """The operands of checkpoint call ``node`` its body may write (all of them when the body is unknown)."""
        if node not in self._checkpoint_writes:
            operands = tuple(a for a in node.args[1:] if isinstance(a, fx.Node))
            checkpoint = checkpoint_body(self.gm, node)
            placeholders = body_placeholders(node, checkpoint[1]) if checkpoint is not None else None
            if placeholders is not None:
                inner = _Facts(checkpoint[1])
                operands = tuple(outer for outer, ph in zip(node.args[1:], placeholders) if isinstance(outer, fx.Node)
                                 and inner.written(inner.gm.graph.nodes, inner.aliases.roots[ph]))
            self._checkpoint_writes[node] = operands
        return self._checkpoint_writes[node]

    def written(self, nodes: Iterable[fx.Node], roots: frozenset) -> bool:
        """Whether any of ``nodes`` may write memory shared with ``roots``. A checkpoint call writes only what
        its body writes of its operands; every other call is judged by ``mutations.effect``."""
        aliases = self.aliases
        for node in nodes:
            written = self.checkpoint_writes(node) if is_checkpoint(node) else aliases.effects[node].writes
            if any(aliases.roots.get(w, frozenset({w})) & roots for w in written):
                return True
        return False


def _evaluate(gm: fx.GraphModule, mask: fx.Node, ancestors: set[fx.Node]) -> object:
    """Run the nodes that build ``mask`` (no graph inputs among them) and return its value."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node in ancestors:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[mask])
    return fx.GraphModule(gm, graph)()


def _compare(value: object, query_shape: tuple[int, ...], key_len: int) -> bool | str:
    """For a query of ``query_shape`` and ``key_len`` keys, in every batch and head, ``value`` broadcast as SDPA
    broadcasts it: True when it is SDPA's causal mask (query and key lengths equal: SDPA documents a top-left
    causal mask otherwise, and not every kernel is checked), False when it hides nothing; else why neither."""
    query_len = query_shape[-2]
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return "it is not a tensor of two or more dimensions"
    if tuple(value.shape[-2:]) != (query_len, key_len):
        return f"its last two sizes {tuple(value.shape[-2:])} are not the attention's ({query_len}, {key_len})"
    batch = query_shape[:-2]
    if value.dim() - 2 > len(batch) or any(
            m not in (1, q) for m, q in zip(reversed(value.shape[:-2]), reversed(batch))):
        return f"its shape {tuple(value.shape)} does not broadcast to the attention's {batch + (query_len, key_len)}"
    if value.dtype != torch.bool and not value.is_floating_point():
        return f"its dtype {value.dtype} is neither bool nor floating point"
    for dim in range(value.dim() - 2):  # broadcast (stride-0) dims hold one slice
        if value.stride(dim) == 0:
            value = value.narrow(dim, 0, 1)
    value = value.reshape(-1, query_len, key_len)
    columns = torch.arange(key_len, device=value.device)
    is_causal, hides_nothing = query_len == key_len, True
    for start in range(0, query_len, _ROW_BLOCK):
        rows = value[:, start:start + _ROW_BLOCK]
        if value.dtype == torch.bool:
            allowed = rows
        else:
            allowed = rows == 0
            low = torch.finfo(value.dtype).min
            if not bool((allowed | (rows == float("-inf")) | (rows == low)).all()):
                return "a float mask with values other than 0 and -inf (or the dtype's lowest value)"
        hides_nothing = hides_nothing and bool(allowed.all())
        if is_causal:
            causal = columns[None, :] <= torch.arange(start, start + rows.shape[1], device=value.device)[:, None]
            is_causal = bool((allowed == causal).all())
        if not (is_causal or hides_nothing):
            break
    if is_causal:  # (a 1 x 1 mask hides nothing too: either way the same attention)
        return True
    if hides_nothing:
        return False
    if query_len != key_len:
        return f"its query and key lengths differ ({query_len} and {key_len}) and it hides some keys"
    return "it is not causal (padding, packed sequences, a window or another pattern)"


def _drop_mask(node: fx.Node, is_causal: bool) -> None:
    """SDPA call ``node`` with ``attn_mask=None`` and ``is_causal``, every other argument as it was."""
    arguments = _arguments(node)
    query, key, value = (arguments.pop(name) for name in _SDPA_PARAMS[:3])
    arguments["attn_mask"] = None
    arguments["is_causal"] = is_causal
    node.args = (query, key, value)
    node.kwargs = arguments


def _drop_unused_operands(gm: fx.GraphModule, name: str, body: fx.GraphModule) -> None:
    """Remove the placeholders of ``body`` left without users, and the matching operand of each checkpoint
    call of it, so the mask is no longer passed in (and can be erased)."""
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    unused = {i for i, ph in enumerate(placeholders) if not ph.users}
    if not unused:
        return
    for node in gm.graph.nodes:
        checkpoint = checkpoint_body(gm, node)
        if checkpoint is not None and checkpoint[0] == name:
            node.args = (node.args[0],) + tuple(a for i, a in enumerate(node.args[1:]) if i not in unused)
    for i in sorted(unused, reverse=True):
        body.graph.erase_node(placeholders[i])
