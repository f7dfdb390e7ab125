"""Graph outputs the pass changes, and the wrapper that restores them around the compiled graph.

Three things happen to a rewritten graph's outputs:

* ``flce.logits="drop"`` turns logits outputs into None. The inner compiler never sees those Nones (AOT's
  output wrappers and DDPOptimizer's split graphs expect tensors); the wrapper puts them back.
* A kept logits output would cost a BT x V zero gradient in every backward: AOT autograd hands each
  differentiable output a tangent, and autograd materialises a zero one when the caller never uses the
  logits, which is the usual case (``loss = model(...).loss``). So the compiled graph returns the logits
  detached, plus the lm_head's input, weight and bias as extra outputs, and the wrapper re-attaches the
  logits' gradient outside the graph (``LogitsGrad``): nothing at all when the logits get no gradient, and
  exactly the lm_head's own backward (through a softcap or scale in between) when they do.
* A logits output of a ``fused_lazy`` site is not computed in the graph at all: the graph returns the lm_head's
  input, weight and bias as extra outputs, and the wrapper puts a ``LazyLogits`` in its place, computed when
  first read (``lazy_logits``).

The lm_head's input and weight go out as their pieces where a LoRA fold joined them (``lora_head``): W and B
rather than ``[W, B]``, an intermediate of the weight's size whose zero gradient autograd would materialise in every
backward (W, an input of the graph, and B get none, or one of B's size).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import fx

from .graph_meta import joined_pieces
from .lazy_logits import Replay, joined, lazy_logits


class LogitsGrad(torch.autograd.Function):
    """Identity on a logits output computed without autograd, whose backward is the lm_head's.

    ``out = softcap * tanh(logit_scale * z / softcap)`` (or ``logit_scale * z``) with ``z = x @ W.T + b``;
    backward maps dL/d(out) to dL/dx, dL/dW and dL/db, as the unfused graph's backward would. x and W may come as
    pieces joined along their last dimension (``split``: how many of ``pieces`` are x's; the rest are W's): each
    piece gets its own share, by its own GEMM, and a piece that needs no gradient costs none.
    """

    @staticmethod
    def forward(ctx, out, bias, logit_scale, softcap, split, *pieces):  # noqa: D401 - autograd API
        result = out.detach()  # the same memory, not a view: the caller may write into it as into any output
        ctx.logit_scale, ctx.softcap, ctx.has_bias, ctx.split = logit_scale, softcap, bias is not None, split
        ctx.save_for_backward(bias, *pieces)
        # The cap's derivative reads the capped logits, which are the caller's output: kept with their version
        # rather than saved, since a saved output written in place (``out.logits[..., 0] = v``) fails backward
        # where eager's does not (its last op, the multiply by the cap, saves no output). Once written, backward
        # recomputes them (``_capped``).
        ctx.capped = out if softcap is not None else None
        ctx.capped_version = out._version  # (out and result share their version counter)
        return result

    @staticmethod
    def _capped(ctx, xs: list[torch.Tensor], ws: list[torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
        """The capped logits as the forward returned them, recomputed (from the joined pieces) when the caller wrote
        into them since."""
        math = _math_dtype(ctx.capped.dtype)
        if ctx.capped._version == ctx.capped_version:
            return ctx.capped.to(math)
        x, weight = joined(xs), joined(ws)
        z = torch.nn.functional.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        return (ctx.softcap * torch.tanh(ctx.logit_scale * z.to(math) / ctx.softcap)).reshape(ctx.capped.shape)

    @staticmethod
    def backward(ctx, grad_out):
        bias, *pieces = ctx.saved_tensors
        xs, ws = pieces[:ctx.split], pieces[ctx.split:]
        scaled = ctx.softcap is not None or ctx.logit_scale != 1.0
        g = grad_out.to(_math_dtype(grad_out.dtype)) if scaled else grad_out
        if ctx.softcap is not None:
            g = g * (1.0 - (LogitsGrad._capped(ctx, xs, ws, bias) / ctx.softcap) ** 2)
        if ctx.logit_scale != 1.0:
            g = g * ctx.logit_scale
        dtype = ws[0].dtype
        g = g.to(dtype).reshape(-1, ws[0].shape[0])
        need_b, need = ctx.needs_input_grad[1], ctx.needs_input_grad[5:]
        dxs = [(g @ w).view(x.shape) if n else None for x, w, n in zip(xs, ws, need)]  # x's piece i: G W_i
        dws = [g.t() @ x.reshape(-1, x.shape[-1]).to(dtype) if n else None  # W's piece j: G^T x_j
               for x, n in zip(xs, need[len(xs):])]
        db = g.sum(0) if need_b and ctx.has_bias else None
        return (None, db, None, None, None, *dxs, *dws)


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the cap's and the scale's derivatives are formed in: at least fp32 (half-precision logits are
    upcast), and an fp64 model's own (fp32 would round its gradients to fp32's precision)."""
    return torch.promote_types(dtype, torch.float32)


@dataclass
class LogitsOutput:
    """A graph output computed from detached logits, and where its lm_head operands sit among the extras."""

    node: fx.Node
    x: tuple[int, ...]  # the lm_head's input, as its pieces (``OutputFixup.add_pieces``)
    weight: tuple[int, ...]  # and its weight
    bias: int | None
    logit_scale: float
    softcap: float | None
    softcap_extra: int | None = None  # where the softcap read at run time sits among the extras (a 0-dim tensor)


@dataclass
class LazyOutput:
    """A logits output the graph no longer computes: where it sat among the outputs, where its lm_head operands sit
    among the extras, the steps from the raw logits to it, and the lm_head's logits dtype."""

    positions: list[int]
    x: tuple[int, ...]  # the lm_head's input, as its pieces (``OutputFixup.add_pieces``)
    weight: tuple[int, ...]  # and its weight
    bias: int | None
    replay: Replay
    dtype: torch.dtype
    #: the GEMM's dtype when a bias is added to its output (``patterns.LinearMatch.added_bias``; a wider one
    #: promotes it to ``dtype``): the logits are then computed as eager does, the bias added after the GEMM
    gemm_dtype: torch.dtype | None = None
    #: (hidden states' shape) -> a meta tensor shaped as the output (its shape, strides and dtype).
    likes: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def make(self, extras: list[Any]) -> torch.Tensor:
        xs, ws = tuple(extras[i] for i in self.x), tuple(extras[i] for i in self.weight)
        bias = extras[self.bias] if self.bias is not None else None
        key = tuple(xs[0].shape[:-1])
        like = self.likes.get(key)
        if like is None:
            like = self.replay(torch.empty((*key, ws[0].shape[0]), dtype=self.dtype, device="meta"))
            if len(self.likes) >= 64:
                self.likes.clear()
            self.likes[key] = like
        return lazy_logits(xs, ws, bias, self.replay, self.dtype, like, self.gemm_dtype)


def output_node(graph: fx.Graph) -> fx.Node:
    """The graph's output node (its last)."""
    return next(n for n in reversed(graph.nodes) if n.op == "output")


def flat_outputs(graph: fx.Graph) -> list[Any] | None:
    """The graph's outputs when they are one flat tuple/list of nodes and Nones (Dynamo's form), else None."""
    out = output_node(graph)
    items = out.args[0] if len(out.args) == 1 else None
    if not isinstance(items, (tuple, list)) or not all(i is None or isinstance(i, fx.Node) for i in items):
        return None
    return list(items)


@dataclass
class OutputFixup:
    """The changes to one graph's flat output tuple, applied to the graph and undone around the compiled
    callable."""

    extras: list[fx.Node] = field(default_factory=list)
    logits: list[LogitsOutput] = field(default_factory=list)
    lazy: list[LazyOutput] = field(default_factory=list)

    def add_extra(self, node: fx.Node) -> int:
        if node not in self.extras:
            self.extras.append(node)
        return self.extras.index(node)

    def add_pieces(self, node: fx.Node) -> tuple[int, ...]:
        """``node`` as extras: its pieces where a LoRA fold joined them (``graph_meta.joined_pieces``), else itself."""
        return tuple(self.add_extra(piece) for piece in joined_pieces(node) or (node,))

    def apply(self, gm: fx.GraphModule) -> Callable[[Callable[..., Any]], Callable[..., Any]] | None:
        """Rewrite the output node (no Nones, extras appended); returns the wrapper maker, or None when there
        is nothing to undo."""
        items = flat_outputs(gm.graph)
        if items is None:
            return None
        nones = [i for i, item in enumerate(items) if item is None]
        if not nones and not self.extras:
            return None
        positions = {}  # output node -> its positions in the original tuple
        for i, item in enumerate(items):
            if item is not None:
                positions.setdefault(item, []).append(i)
        attach = [(positions.get(spec.node, []), spec) for spec in self.logits]
        out_node = output_node(gm.graph)
        out_node.args = (tuple(i for i in items if i is not None) + tuple(self.extras),)
        n_out, n_extra = len(items), len(self.extras)
        kept = [i for i, item in enumerate(items) if item is not None]
        return lambda compiled: _Restore(compiled, n_out, kept, n_extra, attach, self.lazy)


class _Restore:
    """Calls the compiled graph and rebuilds the outputs the caller expects (see the module docstring)."""

    def __init__(self, compiled: Callable[..., Any], n_out: int, kept: list[int], n_extra: int,
                 attach: Sequence[tuple[list[int], LogitsOutput]], lazy: Sequence[LazyOutput] = ()) -> None:
        self.compiled = compiled
        self.n_out, self.kept, self.n_extra, self.attach, self.lazy = n_out, kept, n_extra, attach, lazy
        # Dynamo calls a "boxed" compiled function with one list of inputs (which it may clear); keep that.
        self._boxed_call = getattr(compiled, "_boxed_call", False)

    def __call__(self, *args: Any) -> list[Any]:
        flat = list(self.compiled(*args))
        extras = flat[len(flat) - self.n_extra:] if self.n_extra else []
        result: list[Any] = [None] * self.n_out
        for i, value in zip(self.kept, flat):
            result[i] = value
        if torch.is_grad_enabled():
            for positions, spec in self.attach:
                if not positions:
                    continue
                bias = extras[spec.bias] if spec.bias is not None else None
                softcap = spec.softcap
                if spec.softcap_extra is not None:  # c * tanh(s / c) caps at |c|; a CPU tensor: no GPU wait
                    softcap = abs(float(extras[spec.softcap_extra]))
                attached = LogitsGrad.apply(result[positions[0]], bias, spec.logit_scale, softcap, len(spec.x),
                                            *(extras[i] for i in spec.x + spec.weight))
                for i in positions:
                    result[i] = attached
        for spec in self.lazy:
            logits = spec.make(extras)
            for i in spec.positions:
                result[i] = logits
        return result
