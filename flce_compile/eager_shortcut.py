"""The eager call's shortcut to its CUDA graph.

At GPT-2's 2048 x 768 x 50304 a replayed forward + backward costs the host more than its graphs do: the API's
argument checks, the option encoding, the config lookup, the graph key and the layers between them ran about
200 us of Python per call on the H200's host, as much as the replays and autograd's own work (issue #13). A
call like one that the full path has already checked and replayed (the same tensor types, shapes, dtypes,
devices, contiguity, weight, gradients asked, options, stream and torch's math settings: ``key_of``) gets the
same answer to each of those questions, so it goes straight to the graph the full path replayed
(``graph_replay.replay_free_instance``), through an autograd.Function that does what ``op``'s does for a
replayed forward. A call that repeats the recent one (a training loop's steady state) replays the very instance
that call replayed, asking the same questions in one frame (``replay_recent``).

Every call still asks what can change between calls with equal arguments: grad mode, inference mode and autocast
(through the recent call's C guard, ``call_guard``, or in the full key), torch modes and transforms
(``op.interception_free``), graph capture, the graph mode and
``graph_replay.disabled``, the strategy registry's and tuning DB's generations (which decide the config; part
of the key), whether a free instance of the graph is there, and the targets where the full path checks them
(on the CPU, and under FLCE_DEBUG=1: ``op.check_targets``). Any other call (the first of its kind, a bias or
class weights, a tensor or dict option, grad mode off) takes the full path, which records the shortcut when
its forward was replayed. A profiled call takes the shortcut too, inside a range named after the op, as the
full path names it: a trace shows the op as unprofiled calls run it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import graph_replay
from .call_guard import RecentCall
from .graph_replay import GraphKey
from .op import (
    _check_first_order,
    _function_apply,
    _scale_present,
    autocast_on,
    check_targets,
    direct_tensors,
    fused_linear_cross_entropy_op,
    interception_free,
    raise_backward_twice,
    targets_checked,
)
from .plan.choose import choice_generations
from .strategies.chunked import output_factor

#: Shortcuts kept before the table starts afresh (a training run has one or a few).
MAX_ENTRIES = 64
#: Option types whose value is the whole option (a tensor's value can change in place; a dict is unhashable).
_PLAIN_OPTIONS = frozenset({int, float, str, bool, type(None), torch.dtype})


@dataclass(frozen=True, slots=True)
class _Entry:
    """Where a key's calls go: the graph key the full path replayed, and what the targets check needs."""

    graph_key: tuple
    cuda: bool
    index: int  # the device's (``Tensor.get_device``), which backward's grad_output must share
    vocab: int
    hidden: int
    ignore_index: int


_ENTRIES: dict[tuple, _Entry] = {}
#: The last call that took the shortcut, whose key a call its guard admits has too (``key_of``).
_RECENT = RecentCall(MAX_ENTRIES)
#: ``graph_replay.hot_record`` of the recent shortcut call, with its entry in the graph key's place
#: (``replay_recent``).
_HOT: tuple | None = None


def replay_recent(input: Any, weight: Any, target: Any, bias: Any, ce_weight: Any, options: tuple) -> Tensor | None:
    """The loss of a call that repeats the recent shortcut call, from the very instance that call replayed; None
    (having run nothing) for any other call, which then takes ``key_of`` and ``replay``.

    The same checks as ``key_of`` and ``replay`` for a call the recent call's guard admits, in one frame: each
    frame and lookup between them cost a replayed call some microseconds of host time on the H200's host, several
    times their tight-loop cost (issue #13), and in a training loop nearly every call is this one. The instance
    must still be one of its key's (``graph_replay.replay_bound_instance``), free, and bound where this call's
    hidden states and targets lie; a call it does not suit takes ``replay``, which picks or captures another."""
    hot = _HOT
    if hot is None or bias is not None or ce_weight is not None:
        return None
    key, varying, cuda, index, guard, entry, graph_ref = hot
    if not (guard.admits(input, weight, target) and interception_free()
            and _varying(weight, options, cuda, index) == varying and graph_replay.replay_allowed_now(cuda)):
        return None
    graph = graph_ref()
    if graph is None:
        return None
    if targets_checked(not cuda):
        check_targets(target, entry.vocab, entry.ignore_index)
    apply = _apply_profiled if torch.autograd._profiler_enabled() else _APPLY
    return graph_replay.replay_bound_instance(entry.graph_key, graph, input, target, apply,
                                              (input, weight, target, graph, entry))


def key_of(input: Any, weight: Any, target: Any, bias: Any, ce_weight: Any, options: tuple) -> tuple | None:
    """The shortcut key of an eager call of ``fused_linear_cross_entropy``, or None when the call cannot take
    the shortcut (and will not record one): ``options`` are its other arguments, in a fixed order. Called
    right before ``replay``, which relies on the state checked here, and only outside Dynamo (the caller asks).
    Holds the config's generations, read before the full path chooses the config (a change then makes a new
    key).

    A call that the recent call's guard admits (``call_guard.RecentCall``: its tensors' types, dispatch keys,
    shapes, strides, dtypes, devices and gradients asked, grad mode, autocast, inference mode) and whose other parts
    of the key are equal (``_varying``) has that call's key, and is not keyed in full.

    Also clears the graph key a previous forward left behind (``graph_replay.forget_replayed_key``), so that
    ``remember`` records this call's."""
    graph_replay.forget_replayed_key()
    if bias is not None or ce_weight is not None:
        return None
    recent = _RECENT.last  # (inline, as in ``graph_replay.body_shortcut_key``: a method would add a frame per call)
    if recent is not None:
        key, varying, cuda, index, guard = recent
        if (guard.admits(input, weight, target) and interception_free()
                and _varying(weight, options, cuda, index) == varying):
            return key
    if not torch.is_grad_enabled():
        return None
    # ``op.direct_call_ok`` but for Dynamo, which the API asked: plain CPU or CUDA tensors (their devices are in
    # the key), nothing that intercepts operators.
    if input is None or weight is None or target is None:  # the full path names the argument
        return None
    if not (direct_tensors(input, weight, target) and interception_free()):
        return None
    cuda = input.is_cuda
    if not graph_replay.replays_on(cuda):  # (the CPU never replays, but in tests)
        return None
    if not _PLAIN_OPTIONS.issuperset(map(type, options)):
        return None
    # Under autocast the full path casts the operands first (a graph of other dtypes); graphs captured in
    # inference mode (grad re-enabled in it) hold inference tensors, which a call outside it cannot write.
    if autocast_on("cuda" if cuda else "cpu") or torch.is_inference_mode_enabled():
        return None
    if not (input.is_contiguous() and weight.is_contiguous() and target.is_contiguous()):
        return None
    index = input.get_device()
    # (varying, (cuda, index, the rest)), the layout ``RecentCall.note`` reads the varying part and device from.
    return GraphKey((_varying(weight, options, cuda, index), (
        cuda, index, weight.get_device(), target.get_device(), input.shape, input.dtype, input.requires_grad,
        target.shape, target.dtype, weight.shape, weight.dtype, weight.requires_grad)))


def _varying(weight: Tensor, options: tuple, cuda: bool, index: int) -> tuple:
    """The parts of an eager call's key that its guard does not cover: the options' types (first: a tensor option
    is then never compared by value) and the options (1 == 1.0 == True), the stream, the weight's address, torch's
    math settings and the config's generations (last, as ``graph_replay.record_shortcut`` reads them)."""
    return (tuple(map(type, options)), options, graph_replay.stream_handle(index) if cuda else None,
            weight.data_ptr(), graph_replay.math_settings(), choice_generations(cuda))


def replay(key: tuple | None, input: Tensor, weight: Tensor, target: Tensor) -> Tensor | None:
    """The loss of a call through its shortcut, or None when the call must take the full path."""
    global _HOT
    entry = _ENTRIES.get(key) if key is not None else None
    if entry is None or not graph_replay.replay_allowed_now(entry.cuda):
        return None
    if targets_checked(not entry.cuda):
        check_targets(target, entry.vocab, entry.ignore_index)
    apply = _apply_profiled if torch.autograd._profiler_enabled() else _APPLY
    replayed = graph_replay.replay_free_instance(
        entry.graph_key, input, weight, target, lambda graph: (apply(input, weight, target, graph, entry), graph))
    if replayed is None:
        return None
    loss, graph = replayed
    _RECENT.note(key, (input, weight, target))
    _HOT = graph_replay.hot_record(_RECENT, key, entry, graph)
    return loss


#: What a profiler trace calls a shortcut call: the op's name, as for any other call of it.
_OP_NAME = fused_linear_cross_entropy_op._qualname


def _apply_profiled(*args: Any) -> Tensor:
    """``_APPLY`` inside a range named after the op, as the full path names it; opened only once an instance is
    there to replay (a call that then falls back to the full path is named there, once)."""
    with torch.autograd.profiler.record_function(_OP_NAME):
        return _APPLY(*args)


def remember(key: tuple | None, input: Tensor, weight: Tensor, ignore_index: int) -> None:
    """After a call with ``key`` took the full path: if its forward was replayed, later calls with the key go
    to that graph (``graph_replay.record_shortcut``)."""
    graph_replay.record_shortcut(_ENTRIES, MAX_ENTRIES, key, lambda graph_key: _Entry(
        graph_key, input.is_cuda, input.get_device(), weight.shape[0], weight.shape[1], int(ignore_index)))


def clear() -> None:
    """Forget every shortcut (calls take the full path until they record one again)."""
    global _HOT
    _ENTRIES.clear()
    _RECENT.clear()
    _HOT = None


class _ReplayedCall(torch.autograd.Function):
    """A shortcut call: the graph's forward replayed, its gradients scaled in backward, with the same results as
    ``op``'s ``_FusedFunction`` for a replayed forward (same graph, same scaling). Leaner than it: the call has
    no bias, its dtype is one a graph takes (never fp64), and backward has the graph at hand."""

    @staticmethod
    def forward(ctx, input, weight, target, graph, entry):
        hidden = entry.hidden
        x = input if input.dim() == 2 else input.view(-1, hidden)
        t = target if target.dim() == 1 else target.view(-1)
        loss, dx, dw, grad_scale = graph.replay_unbiased(x, t)
        ctx.set_materialize_grads(False)  # an unused loss gives backward None
        # Kept on ctx, not saved, as ``op._keep_forward_grads`` keeps them: backward hands them out as the .grad.
        ctx.replayed = (graph, dx, dw, grad_scale, entry, None if x is input else input.shape)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        _check_first_order()
        if grad_loss is None:  # the loss took no part in what is differentiated
            return None, None, None, None, None
        if ctx.replayed is None:
            raise_backward_twice()
        graph, dx, dw, grad_scale, entry, input_shape = ctx.replayed
        # Released now, not with the graph: the graph is replayed again only once nothing holds its outputs,
        # and a training loop keeps the last loss (and so this ctx) into the next forward.
        ctx.replayed = None
        grads = (dx, dw)
        if torch.compiler.is_compiling():  # compiled autograd traces this backward: a functional product
            g = output_factor(grad_loss, grad_scale)
            dx, dw = (t * g if t is not None else None for t in grads)
        # Scaled in place by a replayed graph (``graph_replay._Graph.scale_grads``), else by the op's own
        # scaling. Autograd has given grad_output the loss's shape and dtype, and a 0-dim one its device; a
        # tensor subclass, or one on another device, takes the op's scaling, which reads it through operators.
        elif not (type(grad_loss) is Tensor and grad_loss.get_device() == entry.index
                  and graph_replay.replay_allowed_now(entry.cuda) and graph.scale_grads(grad_loss, _scale_present)):
            _scale_present(grads, grad_loss, grad_scale)
        if dx is not None and input_shape is not None:
            dx = dx.view(input_shape)
        return dx, dw, None, None, None


_APPLY = _function_apply(_ReplayedCall)
