"""Finding ``linear -> cross_entropy`` sites in a Dynamo FX graph (torch-level ops, before AOT autograd).

A site is found from its loss node backwards: the loss's input is followed through ops that keep every logits
row intact (dtype casts, contiguous, view/reshape/flatten that keep the vocab dim last, a transpose into the
(N, C, d) layout, slicing of token dims, a constant scale, a Gemma2-style softcap, log_softmax) until the
LM-head linear is reached. Per-token log-probs gathered from a log_softmax (RL and preference losses) are a loss
too: the negated per-token cross-entropy (``match_log_prob_gather``). Every step is recorded so the rewrite can
replay what matters (slices, scale, softcap) and drop the rest. Nothing here mutates the graph; each site carries
the reason it cannot be fused.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..dtensor import is_dtensor
from ..params import NO_IGNORED_CLASS
from .mutations import unread_nodes
from .spellings import dtensor_call, operator_of, transposed_attribute

# ---------------------------------------------------------------------------------------------------------------
# op tables (functions, methods and modules that Dynamo may leave in the graph)

_LINEAR_FNS = {F.linear, torch._C._nn.linear}
_MATMUL_FNS = {torch.matmul, operator.matmul, torch.mm, torch.Tensor.matmul}
_EINSUM_FNS = {torch.einsum, torch.functional.einsum}
_CE_FNS = {F.cross_entropy}
_NLL_FNS = {F.nll_loss}
_LOG_SOFTMAX_FNS = {F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax}
_DROPOUT_FNS = {F.dropout}
_GATHER_FNS = {torch.gather, torch.Tensor.gather}
_TAKE_ALONG_FNS = {torch.take_along_dim, torch.Tensor.take_along_dim}
_LOGSUMEXP_FNS = {torch.logsumexp, torch.Tensor.logsumexp}
_SUB_FNS = {operator.sub, torch.sub, torch.Tensor.sub}
_SQUEEZE_FNS = {torch.squeeze, torch.Tensor.squeeze}
_STACK_FNS = {torch.stack}
_TANH_FNS = {torch.tanh, F.tanh, torch.Tensor.tanh}
_MUL_FNS = {operator.mul, torch.mul, torch.Tensor.mul}
_DIV_FNS = {operator.truediv, torch.div, torch.true_divide, torch.Tensor.div}
_ADD_FNS = {operator.add, torch.add, torch.Tensor.add}
#: Python's augmented-assignment operators (``logits *= 2`` reaches the graph as ``operator.imul``).
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor,
                      operator.ilshift, operator.irshift}
_RESHAPE_FNS = {torch.reshape, torch.flatten, torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.flatten}
_TRANSPOSE_FNS = {torch.transpose, torch.swapaxes, torch.swapdims, torch.permute}
_IDENTITY_METHODS = {"float", "double", "half", "bfloat16", "contiguous", "clone", "to", "type_as", "type"}
_RESHAPE_METHODS = {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"}
_TRANSPOSE_METHODS = {"transpose", "swapaxes", "swapdims", "permute"}
_OP_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # logits dtypes the fused op accepts


def _is_fn(node: fx.Node, fns: set) -> bool:
    return node.op == "call_function" and node.target in fns


def _is_method(node: fx.Node, names: Iterable[str]) -> bool:
    return node.op == "call_method" and node.target in names


def is_inplace(node: fx.Node) -> bool:
    """Whether the node mutates one of its inputs (``x.mul_(2)``, ``x *= 2``, ``torch.Tensor.add_``)."""
    if node.op == "call_method":
        name = node.target if isinstance(node.target, str) else ""
    elif node.op == "call_function":
        if node.target in _INPLACE_OPERATORS:
            return True
        name = getattr(node.target, "__name__", "")
    else:
        return False
    # ``x.__imul__(2)``: an augmented assignment's dunder is its operator (``spellings.operator_of``)
    return operator_of(name) in _INPLACE_OPERATORS or (name.endswith("_") and not name.endswith("__"))


def _module(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    if node.op != "call_module":
        return None
    try:
        return gm.get_submodule(node.target)
    except AttributeError:
        return None


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Positional-or-keyword argument ``name`` (position ``index``) of a call node."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def meta_value(node: Any) -> Any:
    """The fake tensor (or other value) Dynamo recorded for a node, or None."""
    if not isinstance(node, fx.Node):
        return node
    for key in ("example_value", "val"):
        if key in node.meta:
            return node.meta[key]
    tm = node.meta.get("tensor_meta")  # from fx.passes.shape_prop (symbolic_trace graphs in tests / tools)
    if tm is not None:
        return torch.empty(tm.shape, dtype=tm.dtype, device="meta")
    return None


#: Why a graph break may stand between a Hugging Face lm_head and its loss, and the fix. A model whose config
#: names no loss type (GPT-2's has none) logs a warning at the loss on every call, and Dynamo breaks the graph
#: on logging calls unless told to ignore that one (``hf_logging``, which the backend does where torch and
#: transformers let it); with the type set, the head and the loss share one graph and are fused.
HF_LOSS_TYPE_HINT = ("when the break is at the warning a Hugging Face causal LM with no loss_type (GPT-2, say) "
                     "logs in its loss, where Dynamo could not be told to ignore it "
                     "(FLCE_IGNORE_HF_LOSS_WARNING=0, or a torch whose compile metrics cannot write the listed "
                     "warning), set model.loss_type = 'ForCausalLM' before compiling")
#: Why a scale or softcap read from a Python float blocks fusion under ``dynamic=True``, and the fix: Dynamo
#: leaves such floats symbolic there, and the pass folds constants only, except a softcap ``c * tanh(s / c)``
#: on the fused paths, whose ``c`` the op reads at run time (Gemma-2's ``final_logit_softcapping``).
SYMBOLIC_FLOAT_FIX = "set torch._dynamo.config.specialize_float = True (and compile without dynamic=True)"
SYMBOLIC_FLOAT_HINT = ("a Python float Dynamo left symbolic (under torch.compile(dynamic=True), or once a float the "
                       "model reads changed between calls and Dynamo compiled again, with "
                       "torch._dynamo.config.specialize_float=False, the default); the fused op reads one at run time "
                       "only as the c of a softcap written logits / c, tanh, then times c: " + SYMBOLIC_FLOAT_FIX)

#: What explain says of a tensor-parallel lm_head it cannot fuse (``tensor_parallel`` rewrites the one it can).
ADVICE = "tensor-parallel lm_head: call flce_compile.vocab_parallel_linear_cross_entropy"


def symbolic_softcap_refused(loss: str) -> str:
    """Why a softcap read at run time (``runtime_float``) cannot go to ``loss``, and the fix."""
    return (f"a softcap read from a Python float Dynamo left symbolic (dynamic=True), which {loss} takes only as a "
            f"constant: {SYMBOLIC_FLOAT_FIX}")


def redistribute_step_ok(node: fx.Node) -> str | None:
    """None when ``node`` is ``logits.redistribute(...)`` to the vocabulary-sharded layout the loss_parallel
    loss reads (the logits as every rank's slice of the last dim); else why it stops the logits chain. The
    layout is read off the result (torch 2.11's spelling keeps the arguments out of the graph, ``spellings``)."""
    val, src = meta_value(node), meta_value(node.args[0])
    if not (is_dtensor(val) and is_dtensor(src)):
        return f"redistribute without DTensor information; {ADVICE}"
    placements = tuple(val.placements)
    if len(placements) != 1 or not _is_last_dim_shard(placements[0], val.dim()):
        return f"redistribute to {placements} (only Shard(-1), the vocabulary, can be fused); {ADVICE}"
    return None


def _is_last_dim_shard(placement: Any, ndim: int) -> bool:
    from torch.distributed.tensor import Shard

    return isinstance(placement, Shard) and placement.dim % ndim == ndim - 1


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _symbolic_float(x: Any) -> bool:
    """Whether ``x`` is a graph node holding a symbolic Python float (``SYMBOLIC_FLOAT_HINT``)."""
    return isinstance(x, fx.Node) and isinstance(meta_value(x), torch.SymFloat)


#: While a checkpointed region's body is analyzed (``checkpoints``): its placeholders that hold a symbolic float,
#: mapped to their operands in the outer graph (a float read before the region reaches its body as a number).
_OUTER_FLOATS: contextvars.ContextVar[dict] = contextvars.ContextVar("flce_outer_floats", default={})


@contextlib.contextmanager
def outer_floats(operands: dict[fx.Node, fx.Node]) -> Iterator[None]:
    """Analyze a checkpoint body with ``operands`` (body placeholder -> outer operand) known to ``runtime_float``:
    a body that would fuse once inlined is then seen to."""
    token = _OUTER_FLOATS.set(operands)
    try:
        yield
    finally:
        _OUTER_FLOATS.reset(token)


def runtime_float(x: Any) -> fx.Node | None:
    """The graph input a symbolic float ``x`` is read from, when ``x`` is ``t.item()`` of a 0-dim floating CPU
    tensor that is a graph input: how Dynamo passes a Python float it leaves symbolic (a model's
    ``config.final_logit_softcapping`` under ``dynamic=True``). The fused op can take that tensor as an argument and
    read it at run time, which adds no guard on its value. In a checkpoint body (``outer_floats``), also a
    placeholder whose outer operand is such a read. None for any other value."""
    if isinstance(x, fx.Node) and x.op == "placeholder":
        outer = _OUTER_FLOATS.get().get(x)
        return runtime_float(outer) if outer is not None and _symbolic_float(x) else None
    if not (_symbolic_float(x) and x.op == "call_method" and x.target == "item" and len(x.args) == 1):
        return None
    source = x.args[0]
    val = meta_value(source)
    if not (isinstance(source, fx.Node) and source.op == "placeholder" and isinstance(val, torch.Tensor)):
        return None
    if val.dim() != 0 or not val.is_floating_point() or val.device.type != "cpu":
        return None
    return source


def _static_int(x: Any) -> int | None:
    if isinstance(x, int) and not isinstance(x, bool):
        return x
    if isinstance(x, torch.SymInt):
        try:
            return int(x.node.maybe_as_int()) if x.node.maybe_as_int() is not None else None
        except Exception:  # noqa: BLE001 - a symbol without a constant value
            return None
    return None


def hint_int(x: Any) -> int | None:
    """A concrete size for reporting (the example's value for a symbolic size), without adding guards."""
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        node = x.node
        hint = getattr(node, "hint", None)
        if hint is not None:
            return int(hint)
        try:
            return int(node.shape_env.size_hint(node.expr))
        except Exception:  # noqa: BLE001 - reporting only
            return None
    return None


# ---------------------------------------------------------------------------------------------------------------
# matched pieces


@dataclass
class LinearMatch:
    """The LM-head GEMM: logits = input @ weight.T (+ bias)."""

    node: fx.Node
    input: fx.Node
    weight: fx.Node | None  # (V, H) node; None when it must be read from a call_module (module_target)
    weight_is_transposed: bool = False  # the node holds (H, V): the rewrite passes weight.t()
    bias: fx.Node | None = None
    module_target: str | None = None  # nn.Linear submodule name for call_module forms
    form: str = ""
    #: a vocabulary-sized tensor added to the GEMM's output, ``node`` being the sum (BART's
    #: ``lm_head(h) + final_logits_bias``): a bias of the head, (V,) or (1, ..., 1, V), in a dtype the logits' holds,
    #: or fp32 on 16-bit logits, which it promotes (``wide_bias``)
    added_bias: fx.Node | None = None
    gemm: fx.Node | None = None  # with ``added_bias``: the GEMM's own node (``node`` is the sum)

    @property
    def start(self) -> fx.Node:
        """Where the head starts reading its operands: the GEMM (checks for writes to them run from here)."""
        return self.gemm if self.gemm is not None else self.node

    @property
    def wide_bias(self) -> bool:
        """Whether the added bias is wider than the GEMM's output and promotes the logits (an fp32 bias buffer on
        bf16 logits: BART's ``final_logits_bias`` under autocast), so that the op adds it to fp32 logits."""
        if self.added_bias is None:
            return False
        gemm_dtype = meta_value(self.gemm).dtype
        return torch.promote_types(meta_value(self.added_bias).dtype, gemm_dtype) != gemm_dtype


@dataclass
class LossMatch:
    """The loss call and its (constant) arguments."""

    node: fx.Node
    kind: str  # "cross_entropy" | "nll_loss" | "log_prob_gather" (``match_log_prob_gather``)
    input: fx.Node
    target: fx.Node
    ce_weight: Any = None  # fx.Node, or a get_attr target string for module forms
    ce_weight_attr: str | None = None
    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    form: str = ""
    # A log-prob gather's token dims where its index may cover fewer rows than the log-probs (gather reads a
    # prefix of each; sizes Dynamo left symbolic need not be known equal): the rewrite narrows them to the index's.
    narrow_dims: tuple[int, ...] = ()
    # A log-prob written as the picked logit minus the logsumexp (``match_log_prob_difference``): the input is the
    # logits, with no log_softmax in the chain; ``negated`` False for the per-token loss (logsumexp minus the
    # pick); ``squeezed``: the difference drops the index's last dim; ``inner``: the gather, squeeze and logsumexp
    # nodes, which read the logits but belong to the loss.
    implicit_log_softmax: bool = False
    negated: bool = True
    squeezed: bool = False
    inner: tuple[fx.Node, ...] = ()


@dataclass
class Step:
    """One op between the linear output and the loss input."""

    kind: str  # identity | reshape | slice | scale | tanh | log_softmax | transpose | redistribute
    node: fx.Node
    input: fx.Node  # the logits-side input of ``node``
    index: Any = None  # slice: the getitem index; transpose: the dim permutation; log_softmax: dim
    factor: float = 1.0  # scale factor (x * factor)
    # A scale by a float Dynamo left symbolic: its ``item()`` node (``runtime_float``), and whether the logits
    # are divided by it (``factor`` is then unused).
    symbol: fx.Node | None = None
    inverse: bool = False


@dataclass
class Site:
    """A loss node with everything known about its logits chain; ``reason`` is None when it can be fused."""

    loss: LossMatch | None
    loss_node: fx.Node
    linear: LinearMatch | None = None
    steps: list[Step] = field(default_factory=list)
    reason: str | None = None
    vocab: int | None = None
    hidden: int | None = None
    from_outside_graph: bool = False  # the logits chain starts at a graph input (graph break before the loss?)

    @property
    def chain(self) -> list[fx.Node]:
        """The linear output followed by every step node, in forward order (the loss node not included)."""
        return ([self.linear.node] if self.linear else []) + [s.node for s in self.steps]

    def escapes(self, ignore_output: bool = False) -> dict[fx.Node, list[fx.Node]]:
        """Chain nodes used outside the chain (e.g. logits returned by the graph) -> those users. A use nothing
        reads (``unread_uses``) is none: it would keep the logits of a site that is otherwise fused."""
        off_chain = self._off_chain_users()
        unread = set(self.unread_uses(off_chain))
        out: dict[fx.Node, list[fx.Node]] = {}
        for n, users in off_chain.items():
            users = [u for u in users if u not in unread and not (ignore_output and u.op == "output")]
            if users:
                out[n] = users
        return out

    def unread_uses(self, off_chain: dict[fx.Node, list[fx.Node]] | None = None) -> list[fx.Node]:
        """The nodes off the chain that read it and that can be erased, with everything that reads them, without
        changing what the graph computes (``mutations.unread_nodes``): a view of the logits the model discards,
        which Dynamo leaves in its graph. The rewrite erases them, and with them the last reads of the logits.
        ``off_chain``: ``_off_chain_users``, when the caller has it already."""
        gm = self.loss_node.graph.owning_module
        found: dict[fx.Node, None] = {}  # (ordered: the rewrite's erasures stay deterministic)
        for users in (off_chain if off_chain is not None else self._off_chain_users()).values():
            for user in users:
                found.update(dict.fromkeys(unread_nodes(gm, user) or ()))
        return list(found)

    def _off_chain_users(self) -> dict[fx.Node, list[fx.Node]]:
        """Each chain node -> its users outside the chain and the loss."""
        chain = self.chain
        inside = set(chain) | {self.loss_node} | set(self.loss.inner if self.loss else ())
        return {n: [u for u in n.users if u not in inside] for n in chain}


# ---------------------------------------------------------------------------------------------------------------
# loss matching


def match_loss(gm: fx.GraphModule, node: fx.Node) -> LossMatch | str | None:
    """A loss call (F.cross_entropy, nn.CrossEntropyLoss, F.nll_loss, nn.NLLLoss) or None; a str says why a
    loss was seen but its arguments can't be used."""
    mod = _module(gm, node)
    if _is_fn(node, _CE_FNS) or isinstance(mod, nn.CrossEntropyLoss):
        kind = "cross_entropy"
    elif _is_fn(node, _NLL_FNS) or isinstance(mod, nn.NLLLoss):
        kind = "nll_loss"
    else:
        gathered = match_log_prob_gather(node)
        return gathered if gathered is not None else match_log_prob_difference(node)
    if mod is not None:  # module call: options live on the module
        inp, target = _arg(node, 0, "input"), _arg(node, 1, "target")
        weight = getattr(mod, "weight", None)
        lm = LossMatch(
            node=node, kind=kind, input=inp, target=target,
            ce_weight_attr=(f"{node.target}.weight" if weight is not None else None),
            ignore_index=mod.ignore_index, reduction=mod.reduction,
            label_smoothing=float(getattr(mod, "label_smoothing", 0.0)), form=f"call_module {type(mod).__name__}",
        )
    else:
        inp, target = _arg(node, 0, "input"), _arg(node, 1, "target")
        size_average, reduce = _arg(node, 3, "size_average"), _arg(node, 5, "reduce")
        reduction = _arg(node, 6, "reduction", "mean")
        if size_average is not None or reduce is not None:
            if any(isinstance(x, fx.Node) for x in (size_average, reduce)):
                return "legacy size_average/reduce arguments are graph values"
            reduction = torch.nn._reduction.legacy_get_string(size_average, reduce, emit_warning=False)
        lm = LossMatch(
            node=node, kind=kind, input=inp, target=target, ce_weight=_arg(node, 2, "weight"),
            ignore_index=_arg(node, 4, "ignore_index", -100), reduction=reduction,
            label_smoothing=_arg(node, 7, "label_smoothing", 0.0) if kind == "cross_entropy" else 0.0,
            form=f"call_function {getattr(node.target, '__name__', node.target)}",
        )
    if not isinstance(lm.input, fx.Node) or not isinstance(lm.target, fx.Node):
        return "loss input or target is not a graph tensor"
    if not isinstance(lm.ignore_index, int) or isinstance(lm.ignore_index, bool):
        return f"ignore_index={lm.ignore_index!r} is not a constant int"
    if lm.ignore_index == NO_IGNORED_CLASS:  # the op would read it as a gather's "no class ignored"
        return f"ignore_index={NO_IGNORED_CLASS} is the fused op's marker of a loss that ignores no class"
    if lm.reduction not in ("mean", "sum", "none"):
        return f"reduction={lm.reduction!r} is not a constant 'mean'/'sum'/'none'"
    if _symbolic_float(lm.label_smoothing):  # an nn.CrossEntropyLoss's attribute under dynamic=True
        # Not SYMBOLIC_FLOAT_FIX's words, which the rewrite warns on: with the default inner compiler this loss ends
        # up fused, so the refusal of the first trace is logged at INFO.
        return ("label_smoothing is a Python float Dynamo left symbolic (dynamic=True); an inner compiler built on "
                "AOT autograd (inductor, aot_eager) specializes it and Dynamo traces the frame again, which fuses "
                "(explain shows the first trace); with another inner compiler, set "
                "torch._dynamo.config.specialize_float = True or drop dynamic=True")
    if not _is_number(lm.label_smoothing):
        return f"label_smoothing={lm.label_smoothing!r} is not a constant number"
    lm.label_smoothing = float(lm.label_smoothing)
    if lm.ce_weight is not None and not isinstance(lm.ce_weight, fx.Node):
        return "class weight is not a graph tensor"
    target_val = meta_value(lm.target)
    if isinstance(target_val, torch.Tensor) and target_val.is_floating_point():
        return "target holds class probabilities (floating dtype), not class indices"
    return lm


def match_log_prob_gather(node: fx.Node) -> LossMatch | str | None:
    """Per-token log-probabilities picked from a log_softmax over the vocab, as RL and preference losses write
    them (``torch.gather(logits.log_softmax(-1), -1, labels.unsqueeze(-1))``, ``take_along_dim``): the negated
    per-token cross-entropy (reduction "none", no class ignored), shaped like the index. None for any other node,
    and for a gather that does not read a log_softmax (most gathers are not losses); a str says why a log-prob
    gather can't be used."""
    gather = _is_fn(node, _GATHER_FNS) or _is_method(node, ("gather",))
    if gather:
        log_probs, dim, index = _arg(node, 0, "input"), _arg(node, 1, "dim"), _arg(node, 2, "index")
    elif _is_fn(node, _TAKE_ALONG_FNS) or _is_method(node, ("take_along_dim",)):
        log_probs, index, dim = _arg(node, 0, "input"), _arg(node, 1, "indices"), _arg(node, 2, "dim")
    else:
        return None
    if not _after_log_softmax(log_probs):
        return None
    lp, idx = meta_value(log_probs), meta_value(index)
    if not (isinstance(lp, torch.Tensor) and isinstance(idx, torch.Tensor) and isinstance(index, fx.Node)):
        return "the gathered log-probs or their index carry no shape information"
    if not isinstance(dim, int) or isinstance(dim, bool) or not -lp.dim() <= dim < lp.dim():
        return f"the log-probs are gathered with dim={dim!r}, not a constant dim"
    if dim % lp.dim() != lp.dim() - 1:
        return "the log-probs are gathered over a dim other than the last"
    if idx.is_floating_point() or idx.dtype == torch.bool or idx.dim() != lp.dim() or _static_int(idx.shape[-1]) != 1:
        return "the gather index is not one integer class id per row (shape (..., 1))"
    shorter = tuple(d for d, (a, b) in enumerate(zip(idx.shape[:-1], lp.shape[:-1]))
                    if not statically_known_true(a == b))
    if shorter and not gather:
        return "take_along_dim's index may broadcast over the log-probs' rows (it is not known to cover each)"
    return LossMatch(node=node, kind="log_prob_gather", input=log_probs, target=index,
                     ignore_index=NO_IGNORED_CLASS, reduction="none",
                     form=f"{node.op} {getattr(node.target, '__name__', node.target)} of log_softmax",
                     narrow_dims=shorter)


def match_log_prob_difference(node: fx.Node) -> LossMatch | str | None:
    """Per-token log-probs written without a log_softmax: the target's logit picked with ``gather`` minus the
    logsumexp over the vocab (``logits.gather(-1, t[..., None]).squeeze(-1) - logits.logsumexp(-1)``, or with
    ``keepdim=True`` and no squeeze), as RL code writes them to spare the log-softmax tensor; or the reverse
    difference, the per-token cross-entropy. Both sides must read the same logits tensor and nothing else may read
    the pick or the logsumexp. None for any other node; a str says why such a difference can't be used."""
    if not (_is_fn(node, _SUB_FNS) or _is_method(node, ("sub", "__sub__"))) or len(node.args) != 2 or node.kwargs:
        return None
    first, second = node.args
    for pick_side, lse_side, negated in ((first, second, True), (second, first, False)):
        pick, lse = _logit_pick(pick_side), _last_dim_logsumexp(lse_side)
        if pick is not None and lse is not None:
            break
    else:
        return None
    (gather, squeeze, logits, dim, index), (lse_logits, keepdim, lse_nodes) = pick, lse
    if logits is not lse_logits:
        return None  # a pick of one tensor minus another's logsumexp: not a log-prob
    lv, idx = meta_value(logits), meta_value(index)
    if not (isinstance(lv, torch.Tensor) and isinstance(idx, torch.Tensor) and isinstance(index, fx.Node)):
        return "the picked logits or their index carry no shape information"
    if not isinstance(dim, int) or isinstance(dim, bool) or dim % max(lv.dim(), 1) != lv.dim() - 1:
        return "the logits are picked over a dim other than the last"
    if idx.is_floating_point() or idx.dtype == torch.bool or idx.dim() != lv.dim() or _static_int(idx.shape[-1]) != 1:
        return "the gather index is not one integer class id per row (shape (..., 1))"
    if (squeeze is None) == (not keepdim):
        return "the pick and the logsumexp keep different dims (one has the index's last dim, the other not)"
    if not all(statically_known_true(a == b) for a, b in zip(idx.shape[:-1], lv.shape[:-1])):
        return "the gather index is not known to cover every row of the logits (the difference would broadcast)"
    inner = (gather, *lse_nodes) + ((squeeze,) if squeeze is not None else ())
    ends = {gather: {squeeze or node}, **({squeeze: {node}} if squeeze is not None else {})}
    # The logsumexp's nodes: the first (the stack, or the one logsumexp) read by the difference alone, each other
    # one (a row's logsumexp or its row) by one node among them.
    if (any(set(n.users) != want for n, want in ends.items()) or set(lse_nodes[0].users) != {node}
            or any(len(n.users) != 1 or next(iter(n.users)) not in lse_nodes for n in lse_nodes[1:])):
        return "the picked logits or their logsumexp are read elsewhere too"
    name = "gather minus logsumexp" if negated else "logsumexp minus gather"
    return LossMatch(node=node, kind="log_prob_gather", input=logits, target=index,
                     ignore_index=NO_IGNORED_CLASS, reduction="none", form=f"{node.op} {name}",
                     implicit_log_softmax=True, negated=negated, squeezed=squeeze is not None, inner=inner)


def _logit_pick(node: Any) -> tuple[fx.Node, fx.Node | None, Any, Any, Any] | None:
    """``node`` as ``gather(logits, dim, index)``, squeezed over the last dim or not: (gather, squeeze or None,
    logits, dim, index); None otherwise."""
    if not isinstance(node, fx.Node):
        return None
    squeeze = None
    if _is_fn(node, _SQUEEZE_FNS) or _is_method(node, ("squeeze",)):
        squeeze_dim = _arg(node, 1, "dim")
        source = _arg(node, 0, "input")
        if not isinstance(source, fx.Node) or squeeze_dim not in (-1, _rank(source) - 1):
            return None
        squeeze, node = node, source
    if not (_is_fn(node, _GATHER_FNS) or _is_method(node, ("gather",))):
        return None
    return node, squeeze, _arg(node, 0, "input"), _arg(node, 1, "dim"), _arg(node, 2, "index")


def _last_dim_logsumexp(node: Any) -> tuple[Any, bool, tuple[fx.Node, ...]] | None:
    """``node`` as a logsumexp over the last dim: (its input, keepdim, the nodes that form it); or as the
    logsumexp of each row stacked again, ``torch.stack([torch.logsumexp(row, -1) for row in logits])`` (TRL's
    ``selective_log_softmax`` in fp32, which Dynamo unrolls into one ``logits[i]`` and logsumexp a row): the
    same, of ``logits``. None otherwise."""
    if isinstance(node, fx.Node) and _is_fn(node, _STACK_FNS):
        items, dim = _arg(node, 0, "tensors"), _arg(node, 1, "dim", 0)
        if dim != 0 or not isinstance(items, (list, tuple)) or not items:
            return None
        source, inner = None, [node]
        for i, item in enumerate(items):
            row = _last_dim_logsumexp(item) if isinstance(item, fx.Node) and not _is_fn(item, _STACK_FNS) else None
            if row is None or row[1] or not _is_fn(row[0], {operator.getitem}) or row[0].args[1] != i:
                return None
            if source is None:
                source = row[0].args[0]
            if row[0].args[0] is not source:
                return None
            inner += [*row[2], row[0]]
        rows = meta_value(source)
        if not isinstance(rows, torch.Tensor) or rows.dim() < 2 or _static_int(rows.shape[0]) != len(items):
            return None
        return source, False, tuple(inner)
    if not isinstance(node, fx.Node) or not (_is_fn(node, _LOGSUMEXP_FNS) or _is_method(node, ("logsumexp",))):
        return None
    source, dim, keepdim = _arg(node, 0, "input"), _arg(node, 1, "dim"), _arg(node, 2, "keepdim", False)
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    if not isinstance(source, fx.Node) or not isinstance(keepdim, bool) or dim not in (-1, _rank(source) - 1):
        return None
    return source, keepdim, (node,)


def _rank(node: fx.Node) -> int:
    """The rank of ``node``'s recorded value; 0 when unknown (its last dim is then only spelled -1)."""
    val = meta_value(node)
    return val.dim() if isinstance(val, torch.Tensor) else 0


def _after_log_softmax(node: Any) -> bool:
    """Whether ``node`` is a log_softmax's output, or one taken through casts and token-dim slices
    (``log_probs[:, :-1].float()``)."""
    for _ in range(8):  # a few steps at most; the chain walk then checks each
        if not isinstance(node, fx.Node):
            return False
        if _is_fn(node, _LOG_SOFTMAX_FNS) or _is_method(node, ("log_softmax",)):
            return True
        got = _classify(node)
        if isinstance(got, str) or got[0].kind not in ("identity", "slice"):
            return False
        node = got[1]
    return False


# ---------------------------------------------------------------------------------------------------------------
# linear matching


def match_linear(gm: fx.GraphModule, node: fx.Node) -> LinearMatch | None:
    """The node as an LM-head GEMM (F.linear, nn.Linear, x @ W.T / matmul with a 2-D right operand), or as such a
    GEMM plus a bias (``_biased_head``)."""
    if _is_addition(node):
        return _biased_head(gm, node)
    if _is_fn(node, _LINEAR_FNS):
        x, w, b = _arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 2, "bias")
        if isinstance(x, fx.Node) and isinstance(w, fx.Node) and (b is None or isinstance(b, fx.Node)):
            return LinearMatch(node=node, input=x, weight=w, bias=b, form="F.linear")
        return None
    mod = _module(gm, node)
    if isinstance(mod, nn.Linear):
        x = _arg(node, 0, "input")
        if isinstance(x, fx.Node):
            return LinearMatch(node=node, input=x, weight=None, module_target=str(node.target), form="nn.Linear")
        return None
    if _is_fn(node, _MATMUL_FNS) or _is_method(node, ("matmul", "__matmul__", "mm")):
        if len(node.args) != 2 or node.kwargs:
            return None
        x, wt = node.args
        if not (isinstance(x, fx.Node) and isinstance(wt, fx.Node)):
            return None
        wt_val = meta_value(wt)
        if not isinstance(wt_val, torch.Tensor) or wt_val.dim() != 2:
            return None
        # x @ w.t(): hand the fused op the untransposed weight when it is right there.
        if (_is_method(wt, ("t",)) or _is_fn(wt, {torch.t})) and isinstance(wt.args[0], fx.Node):
            return LinearMatch(node=node, input=x, weight=wt.args[0], form="matmul(x, W.t())")
        if (_is_method(wt, ("transpose",)) or _is_fn(wt, {torch.transpose})) and sorted(
            d % 2 for d in wt.args[1:3] if isinstance(d, int)
        ) == [0, 1]:
            return LinearMatch(node=node, input=x, weight=wt.args[0], form="matmul(x, W.transpose(0, 1))")
        transposed = transposed_attribute(wt)
        if transposed is not None:
            return LinearMatch(node=node, input=x, weight=transposed, form="x @ W.T")
        return LinearMatch(node=node, input=x, weight=wt, weight_is_transposed=True, form="x @ W (W is (H, V))")
    if _is_fn(node, _EINSUM_FNS):
        return _einsum_head(node)
    return None


def _head_plus_tensor(gm: fx.GraphModule, node: fx.Node) -> Iterator[tuple[LinearMatch, Any, Any]]:
    """For ``node`` = ``head(x) + t`` (either order, no ``alpha``) with ``t`` vocabulary-sized, (V,) or (1, ..., 1,
    V): the head's match with ``t`` as its ``added_bias`` (``node`` its output), and both traced values."""
    if not _is_addition(node):
        return
    if len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1 or set(node.kwargs) - {"alpha"}:
        return
    for head, bias in (node.args, node.args[::-1]):
        if not (isinstance(head, fx.Node) and isinstance(bias, fx.Node)) or len(head.users) != 1:
            continue
        lin = match_linear(gm, head)
        out, b = meta_value(head), meta_value(bias)
        if lin is None or lin.added_bias is not None or not (isinstance(out, torch.Tensor)
                                                             and isinstance(b, torch.Tensor)):
            continue
        if 0 < b.dim() <= out.dim() and b.shape[-1] == out.shape[-1] and all(s == 1 for s in b.shape[:-1]):
            lin.gemm, lin.node, lin.added_bias, lin.form = head, node, bias, f"{lin.form} + bias"
            yield lin, out, b


def _biased_head(gm: fx.GraphModule, node: fx.Node) -> LinearMatch | None:
    """``head(x) + b`` as one head with bias ``b`` (``_head_plus_tensor``) when ``_bias_refused`` has no reason."""
    return next((lin for lin, out, b in _head_plus_tensor(gm, node) if _bias_refused(gm, lin, out, b) is None), None)


def own_bias(gm: fx.GraphModule, lin: LinearMatch) -> Any:
    """The head's own bias, not one added to its output: the module's parameter (``nn.Linear`` forms) or the
    GEMM's bias node; None when it has none."""
    return gm.get_submodule(lin.module_target).bias if lin.module_target else lin.bias


def _bias_refused(gm: fx.GraphModule, lin: LinearMatch, out: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why the added bias ``b`` of ``lin``'s logits ``out`` is not folded into the head, or None.

    Folded: a bias the logits' dtype holds, and a bias that promotes bf16/fp16 logits to fp32 (an fp32 one, or a
    bf16 one on fp16 logits and the reverse, which the rewrite casts to fp32, exactly: the op then adds it to fp32
    logits, ``LinearMatch.wide_bias``). Refused: a bias promoting to another dtype; a
    promoting bias that requires grad (the op's bias gradient would come from 16-bit logit gradients, where eager
    sums fp32 ones) or beside the head's own bias; a second bias in 16 bits (their sum, formed once for all tokens,
    would be rounded where eager rounds each token's)."""
    own = own_bias(gm, lin)
    promoted = torch.promote_types(b.dtype, out.dtype)
    if promoted != out.dtype:
        what = f"a {b.dtype} bias added to {out.dtype} logits, which promotes them"
        if promoted != torch.float32 or out.dtype not in (torch.bfloat16, torch.float16):
            return f"{what}; only fp32 on bf16/fp16 logits, or a bias the logits' dtype holds, is folded"
        if b.requires_grad:
            return (f"{what}, and requires grad: the fused op's bias gradient would sum {out.dtype} logit "
                    "gradients where eager sums fp32 ones; a bias buffer (BART's final_logits_bias) is folded")
        if own is not None:
            return f"{what}, on a head with its own bias"
        return None
    if own is not None and out.dtype.itemsize < 4:
        return f"a bias added to {out.dtype} logits of a head with its own bias"
    return None


def _unfolded_bias(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """``_bias_refused``'s reason for ``node`` = ``head(x) + b``; None for other nodes."""
    return next((why for lin, out, b in _head_plus_tensor(gm, node)
                 if (why := _bias_refused(gm, lin, out, b)) is not None), None)


#: How ``match_low_rank_head`` and the fold pass (``lora_head``) name an lm_head with a low-rank adapter.
LOW_RANK_HEAD = ("a low-rank adapter's output is added to the logits (LoRA on the lm_head: peft's target_modules "
                 "holds 'lm_head')")
#: The two ways to fuse the loss of such a head when it cannot be folded into one GEMM.
LOW_RANK_FIX = ("to fuse the loss, leave lm_head out of the adapter, or merge the adapter into the weight first "
                "(peft's merge_and_unload)")
#: The node meta key under which ``lora_head`` records why it left an lm_head with an adapter unfolded.
LOW_RANK_REASON = "flce_low_rank_reason"
_CAST_METHODS = {"float", "double", "half", "bfloat16", "to", "type"}


@dataclass
class LowRankHead:
    """An lm_head with a low-rank adapter, ``logits = head(x) + scale * up(low)`` with ``low = down(dropout(x))``
    (peft's LoRA ``Linear`` with "lm_head" among its target_modules): ``node`` is the logits, the sum or its cast
    back to the head's dtype (peft sums a bf16 head and an fp32 adapter in fp32, then casts)."""

    node: fx.Node
    base: LinearMatch  # the head's own GEMM (any spelling but einsum), nothing added to it
    up_weight: Any  # the up-projection's (V, r) weight: a node, or a get_attr target (nn.Linear forms)
    low: fx.Node  # the adapter's low-rank activations (..., r): dropout and down-projection applied
    scale: float
    symbols: tuple[fx.Node, ...]  # factors of the scale Dynamo left symbolic (peft's scaling under dynamic=True)
    #: the nodes the folded GEMM replaces: the head's GEMM, the up-projection, the scalings, the sum, the cast
    replaced: tuple[fx.Node, ...]
    up_transposed: bool = False  # ``up_weight`` holds (r, V) (``h @ A.t() @ Bt``): the fold joins its transpose


def _cast_source(node: Any) -> fx.Node | None:
    """The input of ``node`` when it is a dtype cast of it (``.to(dtype)``, ``.float()``, ...), else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_method" and node.target in _CAST_METHODS
            and node.args and isinstance(node.args[0], fx.Node)):
        return None
    val, src = meta_value(node), meta_value(node.args[0])
    if not (isinstance(val, torch.Tensor) and isinstance(src, torch.Tensor) and val.shape == src.shape
            and val.device == src.device and val.is_floating_point()):
        return None
    return node.args[0]


def _adapter_source(gm: fx.GraphModule, node: Any) -> Any:
    """What a down-projection reads, before its dropout and dtype casts (peft casts the head's input to the
    adapter's dtype, then applies ``lora_dropout``)."""
    while isinstance(node, fx.Node):
        if _is_fn(node, _DROPOUT_FNS) or isinstance(_module(gm, node), nn.Dropout):
            node = _arg(node, 0, "input")
        elif (src := _cast_source(node)) is not None:
            node = src
        else:
            break
    return node


def _widening_cast_source(node: Any) -> fx.Node | None:
    """The input of ``node`` when it is a dtype cast of it to a dtype that holds every value of the input's (fp16 or
    bf16 to fp32, or to the same dtype); None for narrowing casts, which round."""
    src = _cast_source(node)
    if src is None:
        return None
    wide, narrow = meta_value(node).dtype, meta_value(src).dtype
    return src if torch.promote_types(narrow, wide) == wide else None


def _low_rank_branch(other: fx.Node) -> tuple[fx.Node, float, list[fx.Node], list[fx.Node]]:
    """``other`` without its constant scalings, scalings by a float Dynamo left symbolic (peft's ``scaling`` under
    ``dynamic=True``) and widening casts: (what they apply to, the constants' product, the symbolic factors, the
    scaling and cast nodes)."""
    scale, symbols, steps = 1.0, [], []
    while True:
        if (src := _widening_cast_source(other)) is not None:
            steps.append(other)
            other = src
            continue
        if not (_is_multiplication(other) and len(other.args) == 2 and not other.kwargs):
            break
        a, b = other.args
        factor, inner = (a, b) if isinstance(meta_value(b), torch.Tensor) else (b, a)
        if not (isinstance(inner, fx.Node) and isinstance(meta_value(inner), torch.Tensor)):
            break
        if _is_number(factor):
            scale *= float(factor)
        elif isinstance(factor, fx.Node) and isinstance(meta_value(factor), (torch.SymFloat, torch.SymInt)):
            symbols.append(factor)
        else:
            break
        steps.append(other)
        other = inner
    return other, scale, symbols, steps


def match_low_rank_head(gm: fx.GraphModule, total: fx.Node) -> LowRankHead | str | None:
    """The sum ``total`` as the logits of an lm_head with a low-rank adapter (``LowRankHead``; ``node`` the cast back
    to the head's dtype that is the sum's one user, when the sum is wider); a string saying why such a head cannot
    be folded into one GEMM (``lora_head``); None when ``total`` is no such sum."""
    if not _is_addition(total) or len(total.args) != 2 or total.kwargs:
        return None
    users = list(total.users)
    cast = users[0] if len(users) == 1 and _cast_source(users[0]) is total else None
    for head, other in (total.args, total.args[::-1]):
        if not (isinstance(head, fx.Node) and isinstance(other, fx.Node)):
            continue
        inner, scale, symbols, steps = _low_rank_branch(other)
        up = match_linear(gm, inner)
        down = match_linear(gm, up.input) if up is not None else None
        if down is None:
            continue
        lin = match_linear(gm, head)
        if lin is None and match_low_rank_head(gm, head) is not None:
            return "several low-rank adapters are added to the logits (peft with more than one active adapter)"
        if lin is None or _adapter_source(gm, down.input) is not _adapter_source(gm, lin.input):
            continue
        out, low, summed = meta_value(head), meta_value(up.input), meta_value(total)
        if not all(isinstance(t, torch.Tensor) for t in (out, low, summed)):
            continue
        rank, vocab = _static_int(low.shape[-1]), _static_int(out.shape[-1])
        if rank is None or vocab is None or 2 * rank >= vocab:
            continue
        node = cast if cast is not None and summed.dtype != out.dtype else total  # peft's cast back
        einsum = next((m.form for m in (lin, up) if m.form.startswith("einsum")), None)
        if einsum is not None:  # (its operands may be permuted any way: folded, they would be joined as written)
            return f"the head or the adapter's up-projection is {einsum}"
        if lin.added_bias is not None or up.added_bias is not None:  # (the fold reads the GEMMs' own biases only)
            return "a bias is added to the head's or the adapter's output"
        if own_bias(gm, up) is not None:
            return "the adapter's up-projection has a bias (peft's lora_bias)"
        inside = [head, inner, *steps] + ([total] if total is not node else [])
        if any(len(n.users) != 1 for n in inside):
            return "the head's or the adapter's output is read elsewhere too"
        wide = meta_value(inner).dtype
        if wide != out.dtype:  # eager's adapter branch is wider than one GEMM in the head's dtype could be
            return (f"the adapter computes in {wide} where the head computes in {out.dtype}: one {out.dtype} GEMM "
                    f"would round its activations and weight, for gradients about twice as far from fp64 as "
                    f"eager's (under torch.autocast, or with the adapter in {out.dtype}, peft's "
                    f"autocast_adapter_dtype=False, it is folded)")
        if meta_value(node).dtype != out.dtype:
            return f"the sum is {meta_value(node).dtype} where the head computed {out.dtype}"
        weight = f"{up.module_target}.weight" if up.module_target else up.weight
        return LowRankHead(node, lin, weight, up.input, scale, tuple(symbols), (head, inner, *steps, total)
                           + ((node,) if node is not total else ()), up.weight_is_transposed)
    return None


def _low_rank_addend(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """Why ``node`` = ``head(x) + s * B(A(x))`` is not fused: an lm_head with a low-rank adapter that the fold pass
    left alone (``lora_head`` records its reason on the sum); None for other nodes."""
    got = match_low_rank_head(gm, node)
    if got is None:
        return None
    why = got if isinstance(got, str) else node.meta.get(LOW_RANK_REASON, "it was not folded into one GEMM")
    return f"{LOW_RANK_HEAD}, and {why}; {LOW_RANK_FIX}"


def _einsum_head(node: fx.Node) -> LinearMatch | None:
    """``torch.einsum("bsh,vh->bsv", x, W)`` (any letters, ``...`` too, either operand first) as an lm_head: the
    hidden states contracted over their last dimension with a 2-D weight, whose other dimension ends the output.
    ``"...h,hv->...v"`` reads W as (H, V)."""
    if node.kwargs or len(node.args) != 3 or not isinstance(node.args[0], str):
        return None
    equation, a, b = node.args
    spec = equation.replace(" ", "")
    if spec.count("->") != 1 or not all(isinstance(t, fx.Node) for t in (a, b)):
        return None
    inputs, output = spec.split("->")
    subscripts = inputs.split(",")
    if len(subscripts) != 2:
        return None
    for (x, xs), (w, ws) in (((a, subscripts[0]), (b, subscripts[1])), ((b, subscripts[1]), (a, subscripts[0]))):
        if len(ws) != 2 or not xs or "." in ws:
            continue
        hidden = xs[-1]
        if hidden not in ws or ws[0] == ws[1] or hidden in output:
            continue
        vocab = ws[1] if ws[0] == hidden else ws[0]
        if vocab in xs or output != xs[:-1] + vocab or len(set(xs.replace(".", ""))) != len(xs.replace(".", "")):
            continue
        transposed = ws[0] == hidden
        return LinearMatch(node=node, input=x, weight=w, weight_is_transposed=transposed,
                           form=f"einsum({equation!r})")
    return None


# ---------------------------------------------------------------------------------------------------------------
# chain steps


#: Why a loss reading the result of a checkpointed region (its lm_head inside, the loss after it) is not fused.
CHECKPOINTED_HEAD_REASON = (
    "the logits reach the loss through an activation-checkpointed region (torch.utils.checkpoint) the loss is not "
    "in: an lm_head and its loss are fused when both are in one checkpointed function or neither is in any; move "
    "the loss into that function, or call the lm_head and the ops after it outside the checkpoint")


def is_checkpoint(node: fx.Node) -> bool:
    """Whether ``node`` is a call of an activation-checkpointed region (``tag_activation_checkpoint``)."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    return node.op == "call_function" and hop is not None and node.target is hop


def checkpoint_body(gm: fx.GraphModule, node: fx.Node) -> tuple[str, fx.GraphModule] | None:
    """The body of checkpoint call ``node`` of ``gm`` as (its attribute name, its graph), or None: ``node`` is
    no checkpoint call, or its body is not a graph module of ``gm``."""
    if not is_checkpoint(node) or not node.args or not isinstance(node.args[0], fx.Node) \
            or node.args[0].op != "get_attr":
        return None
    name = str(node.args[0].target)
    body = getattr(gm, name, None)
    return (name, body) if isinstance(body, fx.GraphModule) else None


def _classify(node: fx.Node) -> tuple[Step, fx.Node] | str:
    """Classify one op on the logits path: (step, its logits-side input) or the reason it stops the search."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))
    first = node.args[0] if node.args else node.kwargs.get("input")
    # ``30 * logits`` (nanoGPT-style softcaps write ``c * tanh(s / c)``) has the number first: the
    # multiplication branch below finds the logits in either place.
    if not isinstance(first, fx.Node) and not _is_multiplication(node):
        return f"{node.op} {name} does not take the logits as first argument"
    if is_inplace(node):
        # The mutation is visible through every alias of the logits; dropping or replaying it is not safe.
        return f"in-place {node.op} {name} on the logits"

    if dtensor_call(node) == "redistribute":  # a DTensor lm_head's output hook (``tensor_parallel``)
        problem = redistribute_step_ok(node)
        if problem is not None:
            return problem
        return Step("redistribute", node, first), first
    if node.op == "call_method" and node.target in _IDENTITY_METHODS:
        val = meta_value(node)
        if not (isinstance(val, torch.Tensor) and val.is_floating_point()):
            return f".{node.target}() to a non-floating dtype"
        return Step("identity", node, first), first
    if _is_fn(node, _RESHAPE_FNS) or _is_method(node, _RESHAPE_METHODS):
        if reinterprets_bits(node):
            return f"{node.op} {name} to a dtype, which reinterprets the logits' bits"
        return Step("reshape", node, first), first
    if _is_fn(node, _TRANSPOSE_FNS) or _is_method(node, _TRANSPOSE_METHODS):
        val, src = meta_value(node), meta_value(first)
        if not (isinstance(val, torch.Tensor) and isinstance(src, torch.Tensor)):
            return "transpose without shape information"
        if node.target in ("permute",) or node.target is torch.permute:
            dims = node.args[1:] if node.op == "call_method" else node.args[1:2]
            if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
                dims = dims[0]
            dims = node.kwargs.get("dims", dims)
            perm = [int(d) % src.dim() for d in dims]
        else:
            a = _arg(node, 1, "dim0")
            b = _arg(node, 2, "dim1")
            if not (isinstance(a, int) and isinstance(b, int)):
                return "transpose dims are not constants"
            perm = list(range(src.dim()))
            a, b = a % src.dim(), b % src.dim()
            perm[a], perm[b] = perm[b], perm[a]
        return Step("transpose", node, first, index=perm), first
    if node.op == "call_function" and node.target is operator.getitem:
        idx = node.args[1]
        return Step("slice", node, first, index=idx), first
    if _is_multiplication(node):
        a, b = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
        if isinstance(a, fx.Node) and _is_number(b):
            return Step("scale", node, a, factor=float(b)), a
        if isinstance(b, fx.Node) and _is_number(a):
            return Step("scale", node, b, factor=float(a)), b
        for logits, number in ((a, b), (b, a)):
            if runtime_float(number) is not None and isinstance(meta_value(logits), torch.Tensor):
                return Step("scale", node, logits, symbol=number), logits
        if _symbolic_float(a) or _symbolic_float(b):
            return f"multiplication by {SYMBOLIC_FLOAT_HINT}"
        return "multiplication by a tensor (only constant scales can be folded)"
    if _is_fn(node, _DIV_FNS) or _is_method(node, ("div", "__truediv__", "true_divide")):
        a, b = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
        if node.kwargs.get("rounding_mode") is not None:
            return "division with a rounding_mode"
        if isinstance(a, fx.Node) and _is_number(b) and b != 0:
            return Step("scale", node, a, factor=1.0 / float(b)), a
        if runtime_float(b) is not None and isinstance(meta_value(a), torch.Tensor):
            return Step("scale", node, a, symbol=b, inverse=True), a
        if _symbolic_float(b):
            return f"division by {SYMBOLIC_FLOAT_HINT}"
        return "division by a tensor (only constant divisors can be folded)"
    if _is_fn(node, _TANH_FNS) or _is_method(node, ("tanh",)):
        return Step("tanh", node, first), first
    if _is_fn(node, _LOG_SOFTMAX_FNS) or _is_method(node, ("log_softmax",)):
        dim = _arg(node, 1, "dim")
        if not isinstance(dim, int):
            return "log_softmax without a constant dim"
        return Step("log_softmax", node, first, index=dim), first
    return f"{node.op} {name}"


def reinterprets_bits(node: fx.Node) -> bool:
    """Whether the view or reshape ``node`` takes a dtype (``logits.view(torch.int32)``): a reading of the same bits
    as another dtype, not a reshape, and no gradient flows through it."""
    return any(isinstance(a, torch.dtype) for a in (*node.args[1:], *node.kwargs.values()))


def _is_addition(node: fx.Node) -> bool:
    """``a + b`` in any of its spellings (out-of-place: ``add_`` and ``+=`` are not among them)."""
    return _is_fn(node, _ADD_FNS) or _is_method(node, ("add", "__add__", "__radd__"))


def _is_multiplication(node: fx.Node) -> bool:
    """``a * b`` in any of its spellings (out-of-place: ``mul_`` and ``*=`` are in-place and refused before)."""
    return _is_fn(node, _MUL_FNS) or _is_method(node, ("mul", "__mul__", "__rmul__"))


def _walk(gm: fx.GraphModule, loss: LossMatch) -> Site:
    """Follow the loss input back to the linear; returns a Site (with ``reason`` set if none was found)."""
    site = Site(loss=loss, loss_node=loss.node)
    steps: list[Step] = []
    node = loss.input
    for _ in range(64):  # chains are short; the bound only protects against pathological graphs
        lin = match_linear(gm, node)
        if lin is not None:
            site.linear = lin
            break
        if node.op == "placeholder":
            site.from_outside_graph = True
            site.reason = (
                f"the loss input comes from graph input {node.target!r}: the lm_head is not in this graph "
                f"(a graph break between lm_head and the loss leaves nothing to fuse; {HF_LOSS_TYPE_HINT})"
            )
            return site
        if is_checkpoint(node):
            site.reason = CHECKPOINTED_HEAD_REASON
            return site
        got = _classify(node)
        if isinstance(got, str):
            why = _unfolded_bias(gm, node) or _low_rank_addend(gm, node) or got
            site.reason = f"unsupported op between lm_head and the loss: {why}"
            return site
        step, node = got
        steps.append(step)
    else:
        site.reason = "logits path too long"
        return site
    steps.reverse()
    site.steps = steps
    return site


# ---------------------------------------------------------------------------------------------------------------
# validation: does every step keep logits rows intact, and what must be replayed?


@dataclass
class Plan:
    """What a rewrite needs from the steps after its base tensor."""

    indices: list[Any] = field(default_factory=list)  # getitem indices to apply to the base, in order
    logit_scale: float = 1.0
    # A constant, or the ``item()`` node of a symbolic one (``runtime_float``), which the op reads at run time.
    softcap: float | fx.Node | None = None


def runtime_softcap(plan: Plan) -> bool:
    """Whether ``plan``'s softcap is read at run time (a graph input, ``runtime_float``): the fused op takes it
    (both fused paths); the kept-logits and vocab-parallel losses take constants only."""
    return isinstance(plan.softcap, fx.Node)


class _ScaleFolder:
    """Folds constant scales and one ``c * tanh(...)`` into (logit_scale, softcap), in step order; ``c`` may be
    a symbolic float in exactly ``c * tanh(f * s / c)`` (``add_symbolic``)."""

    def __init__(self) -> None:
        self.scale = 1.0
        self.softcap: float | fx.Node | None = None
        self.logit_scale: float | None = None
        self.pending_tanh = False
        self.divisor: fx.Node | None = None  # the graph input of ``s / c``'s c, until ``c * tanh(...)``

    def add_symbolic(self, symbol: fx.Node, inverse: bool) -> str | None:
        """A scale by the symbolic float ``symbol`` (an ``item()`` node; divided by it when ``inverse``): the
        softcap's two uses of one ``c`` (read from one graph input), ``s / c`` before the tanh and
        ``c * tanh(...)`` after it, and nothing else. With ``c * tanh(s / c) == |c| * tanh(s / |c|)`` the op's
        softcap is |c| and the scales before it stay the logit scale."""
        source = runtime_float(symbol)
        if inverse and self.divisor is None and not self.pending_tanh and self.softcap is None:
            self.divisor = source
            return None
        if not inverse and self.pending_tanh and self.divisor is source:
            self.softcap, self.logit_scale = symbol, self.scale
            self.pending_tanh, self.divisor = False, None
            return None
        return f"a scale by {SYMBOLIC_FLOAT_HINT}"

    def add_scale(self, factor: float) -> str | None:
        if self.divisor is not None:
            return f"a constant scale inside a softcap read from {SYMBOLIC_FLOAT_HINT}"
        if self.pending_tanh:  # c * tanh(f*s)  ==  softcap |c| with logit_scale f*c (tanh is odd)
            if factor == 0.0:
                return "tanh multiplied by 0 (not a softcap)"
            self.softcap, self.logit_scale = abs(factor), self.scale * factor
            self.pending_tanh = False
            return None
        if self.softcap is not None:
            return "a scale after the softcap"
        self.scale *= factor
        return None

    def add_tanh(self) -> str | None:
        if self.softcap is not None or self.pending_tanh:
            return "a second tanh"
        self.pending_tanh = True
        return None

    def finish(self, plan: Plan) -> str | None:
        if self.pending_tanh:
            return "tanh is not followed by a constant multiply (not a softcap)"
        if self.divisor is not None:
            return f"a division by {SYMBOLIC_FLOAT_HINT}"
        plan.softcap = self.softcap
        plan.logit_scale = self.logit_scale if self.softcap is not None else self.scale
        return None


def fold_steps(site: Site, start: int) -> Plan | str:
    """Fold ``site.steps[start:]`` into a Plan, checking the logits rows are only selected, never mixed.

    ``start`` = 0 folds everything after the linear output (fused path; slices then apply to the linear's
    input, which has the same leading dims); ``start`` = k folds what follows step k-1 (kept-logits path).
    """
    base = site.linear.node if start == 0 else site.steps[start - 1].node
    base_val = meta_value(base)
    if not isinstance(base_val, torch.Tensor):
        return "no shape information for the logits"
    vocab = site.vocab
    ndim = base_val.dim()
    if _static_int(base_val.shape[-1]) != vocab:
        return "the logits' last dim is not the vocab"
    class_dim = ndim - 1  # where the vocab dim currently is
    order = list(range(ndim))  # original positions of the current dims (checks row order after transposes)
    reshaped = False  # leading dims changed: later slices no longer line up with the base's dims
    plan = Plan()
    folder = _ScaleFolder()
    log_softmax_seen = False
    for step in site.steps[start:]:
        val = meta_value(step.node)
        if not isinstance(val, torch.Tensor):
            return f"no shape information at {step.node.name}"
        if folder.pending_tanh and step.kind not in ("identity", "scale"):
            return "tanh is not followed by a constant multiply (not a softcap)"
        if step.kind in ("identity", "redistribute"):
            if val.dim() != len(order):
                return f"{step.node.name} changes the rank"
        elif step.kind == "reshape":
            if class_dim != len(order) - 1 or _static_int(val.shape[-1]) != vocab:
                return f"{step.node.name} reshapes the vocab dim"
            if val.dim() != len(order) or any(
                _static_int(a) is None or _static_int(a) != _static_int(b)
                for a, b in zip(val.shape[:-1], meta_value(step.input).shape[:-1])
            ):
                reshaped = True
            order = list(range(val.dim()))
            class_dim = val.dim() - 1
        elif step.kind == "transpose":
            perm = step.index
            order = [order[p] for p in perm]
            class_dim = perm.index(class_dim)
            rows = [o for i, o in enumerate(order) if i != class_dim]
            if rows != sorted(rows):
                return f"{step.node.name} reorders the token dims"
        elif step.kind == "slice":
            if class_dim != len(order) - 1:
                return f"{step.node.name} slices a transposed tensor"
            if reshaped:
                return f"{step.node.name} slices after a reshape of the token dims"
            if _static_int(val.shape[-1]) != vocab:
                return f"{step.node.name} slices the vocab dim"
            if not _index_ok(step.index, len(order)):
                return f"{step.node.name} uses an index other than slices/ints on the token dims"
            plan.indices.append(step.index)
            order = list(range(val.dim()))
            class_dim = val.dim() - 1
        elif step.kind == "scale":
            if log_softmax_seen:
                return "a scale after log_softmax"
            problem = (folder.add_scale(step.factor) if step.symbol is None
                       else folder.add_symbolic(step.symbol, step.inverse))
            if problem:
                return problem
        elif step.kind == "tanh":
            problem = "a second tanh" if log_softmax_seen else folder.add_tanh()
            if problem:
                return problem
        elif step.kind == "log_softmax":
            if step.index % val.dim() != class_dim:
                return "log_softmax over a dim other than the vocab"
            log_softmax_seen = True
        if val.dim() != len(order):
            return f"{step.node.name}: rank bookkeeping mismatch"
    problem = folder.finish(plan)
    if problem:
        return problem
    if site.loss.kind == "nll_loss" and not log_softmax_seen:
        return "nll_loss on logits that are not log_softmax'ed"
    ndim_in = len(order)
    if site.loss.kind == "log_prob_gather":  # gathered over the last dim (``match_log_prob_gather``)
        if not (log_softmax_seen or site.loss.implicit_log_softmax):  # a gather of kept log-probs is no CE of them
            return "the gather reads log-probs the graph keeps (read or written by other ops), not their log_softmax"
        if class_dim != ndim_in - 1:
            return "the log-probs are gathered over a dim other than the vocab"
        if site.loss.narrow_dims and (reshaped or order != sorted(order)):
            return ("the gather index may cover fewer rows than the log-probs, whose token dims are reshaped or "
                    "transposed")
        return plan
    if ndim_in >= 2 and class_dim != 1:
        return "the loss sees the vocab in a dim other than 1"
    if ndim_in == 1 and class_dim != 0:
        return "the loss sees the vocab in a dim other than 0"
    return plan


def output_transform(site: Site, node: fx.Node) -> Plan | str:
    """How the chain node ``node`` is computed from the raw logits, when it is only casts, reshapes that keep
    the vocab dim last, constant scales and a softcap: then its gradient can be replayed outside the compiled
    graph (a logits output the graph returns). A str says what else is in the way."""
    if node is site.linear.node:
        return Plan()
    folder = _ScaleFolder()
    for step in site.steps:
        val = meta_value(step.node)
        if step.kind == "identity" or (
            step.kind == "reshape" and isinstance(val, torch.Tensor) and _static_int(val.shape[-1]) == site.vocab
        ):
            pass
        elif step.kind == "scale":
            problem = (folder.add_scale(step.factor) if step.symbol is None
                       else folder.add_symbolic(step.symbol, step.inverse))
            if problem:
                return problem
        elif step.kind == "tanh":
            problem = folder.add_tanh()
            if problem:
                return problem
        else:
            return f"{step.kind} {step.node.name}"
        if step.node is node:
            break
    if folder.divisor is not None:  # ``s / c`` returned before the softcap's tanh: not a replayable transform
        return "a division by a float read at run time, returned before the softcap's tanh"
    plan = Plan()
    return folder.finish(plan) or plan


def _index_ok(idx: Any, ndim: int) -> bool:
    items = idx if isinstance(idx, tuple) else (idx,)
    if any(i is None or isinstance(i, (fx.Node, torch.Tensor, list, bool)) for i in items):
        return False  # new axes, tensor/bool indexing: not a plain selection of rows
    if sum(1 for i in items if i is Ellipsis) > 1:
        return False
    n_real = sum(1 for i in items if i is not Ellipsis)
    if Ellipsis in items:
        pos = items.index(Ellipsis)
        items = items[:pos] + (slice(None),) * (ndim - n_real) + items[pos + 1:]
    if len(items) > ndim:
        return False
    if len(items) == ndim and items[-1] != slice(None):
        return False  # touches the vocab dim
    return all(isinstance(i, slice) or isinstance(i, int) for i in items)


# ---------------------------------------------------------------------------------------------------------------
# whole-graph search


def find_sites(gm: fx.GraphModule) -> list[Site]:
    """Every loss node in the graph as a Site; ``site.reason`` says why one can't be fused (None = fusable)."""
    sites: list[Site] = []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_module", "call_method"):  # (a method: ``lp.gather(-1, t)``)
            continue
        try:
            loss = match_loss(gm, node)
            if loss is None:
                continue
            if isinstance(loss, str):
                sites.append(Site(loss=None, loss_node=node, reason=loss))
                continue
            site = _walk(gm, loss)
            if site.linear is not None:
                _check_linear(gm, site)
        except Exception as exc:  # noqa: BLE001 - an unexpected graph shape: this site is left alone
            site = Site(loss=None, loss_node=node, reason=f"analysis failed: {exc!r}")
        sites.append(site)
    return sites


def _check_linear(gm: fx.GraphModule, site: Site) -> None:
    """Fill ``site.vocab``/``site.hidden`` from the lm_head, or set ``site.reason`` when its shapes don't fit."""
    lin = site.linear
    out = meta_value(lin.node)
    x = meta_value(lin.input)
    if not (isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor)):
        site.reason = "no shape information for the lm_head"
        return
    site.vocab = _static_int(out.shape[-1])
    site.hidden = _static_int(x.shape[-1])
    if site.vocab is None or site.hidden is None:
        site.reason = "vocab or hidden size is dynamic"
        return
    if lin.module_target is not None:
        mod = gm.get_submodule(lin.module_target)
        w_shape = tuple(mod.weight.shape)
    else:
        w = meta_value(lin.weight)
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            site.reason = "lm_head weight is not a 2-D tensor"
            return
        w_shape = tuple(_static_int(s) for s in w.shape)
        if lin.weight_is_transposed:
            w_shape = w_shape[::-1]
        if lin.bias is not None:
            bv = meta_value(lin.bias)
            if not isinstance(bv, torch.Tensor) or bv.dim() != 1:
                site.reason = "lm_head bias is not 1-D"
                return
    if w_shape != (site.vocab, site.hidden):
        site.reason = f"lm_head weight shape {w_shape} does not match (vocab, hidden)=({site.vocab}, {site.hidden})"
        return
    if out.dtype not in _OP_DTYPES:
        site.reason = f"lm_head output dtype {out.dtype} is not one the fused op supports ({_OP_DTYPES})"
