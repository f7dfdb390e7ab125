"""The fused op as torch.library custom ops, with fake implementations and an autograd formula.

``flce::fused_linear_cross_entropy`` takes 2-D input and 1-D target and returns (loss, lse, dx, dw, db,
grad_scale): for mean/sum the gradients are computed in the forward pass (three GEMMs in all), divided by
grad_scale (1, or for an fp16 "mean" a power of two, 0 when fully masked: ``chunked._gradient_scales``), and
backward only scales them by grad_scale * grad_output; for "none" the forward returns the per-token loss and
"lse", (4, N): each token's lse, its target's z and, for the recompute loop only, its largest z with that class
(``chunked.kept_rows``; class -1 otherwise), and backward calls ``flce::fused_linear_cross_entropy_backward``,
which recomputes the logits chunk by chunk (a fourth GEMM).
A compiled graph holds each as one opaque node; the execution config is picked inside, at run time, from
the real token count, so a varying token count never recompiles. Through the dispatcher (compiled graphs),
the CPU and CUDA kernels are the bodies themselves (``_KERNELS``). In eager mode ``call_fused`` runs the same
body and autograd formula without the dispatcher's Python round trip when nothing could tell the difference
(``direct_call_ok``): at small shapes the op is bound by host work.

Every op takes the loss options as one string, ``params`` (``params.encode_params`` of a ``LossParams``), and
optionally, last, ``softcap_value``: a 0-dim CPU tensor whose value is the softcap, read at run time
(``runtime_params``; how a softcap Dynamo left symbolic reaches the op), and
the config as the JSON of the fields the caller forces, ``config`` ("" for none). Both are decoded through
memoised functions, and the choice of the rest of the config (``plan.choose.op_config``) is memoised too, so
the "none" backward, which gets the forward's ``config`` string, makes the same choice for the cost of a few
dictionary lookups. (It cannot be handed the forward's resolved config itself: under torch.compile the
backward is traced before the forward op first runs, so only a tensor could carry a value chosen at run time.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

from . import graph_replay
from .compile_cache_key import key_compile_caches
from .log import logger
from .params import NO_IGNORED_CLASS, LossParams, decode_params, encode_params, math_dtype
from .plan import registry
from .plan.choose import op_config
from .plan.config import FLCEConfig, forced_fields
from .plan.memory import peak_bytes
from .scaled_gradients import kernel_scales, scaled_gradients_body, scaled_gradients_op, traced_for_cuda_graphs
from .strategies import ForwardResult, GradRequest, Operands, fused_backward_per_token, fused_forward
from .strategies.chunked import KEPT_ROWS, LSE_DTYPE, output_factor
from .strategies.recompute import recompute_backward

_EMPTY = (0,)


#: The softcap a caller's ``params`` hold when the op reads it at run time from ``softcap_value`` (any cap > 0:
#: memory estimates made from those ``params`` count the softcap's buffer).
RUNTIME_SOFTCAP = 1.0


def runtime_params(params: str, softcap_value: Tensor | None) -> str:
    """``params`` with the softcap read from ``softcap_value`` now (None: ``params`` as they are). Called first
    in each op body, so that every key and choice after it (the CUDA graphs', the shortcuts') sees the value.

    ``c * tanh(s / c)`` is the cap |c| for any c != 0 (tanh is odd); for c = 0, inf or nan it is nan or no cap at
    all, which the model that computed it cannot have meant: an error names the value."""
    if softcap_value is None:
        return params
    value = softcap_value.item()  # a CPU tensor (checked by the API): no wait for a GPU
    if value == 0 or not math.isfinite(value):
        raise ValueError(
            f"the softcap read at run time is {value}: a softcap c * tanh(s / c) needs a finite c != 0 (c = 0 is "
            "nan, and c = inf caps nothing); fix the value the model reads (e.g. config.final_logit_softcapping)"
        )
    return encode_params(dataclasses.replace(decode_params(params), softcap=abs(value)))


def _config(config: str, input: Tensor, weight: Tensor) -> FLCEConfig:
    """``config`` is the JSON of the forced fields ("" for none); the rest is chosen from the real shapes."""
    return op_config(config, input.shape[0], weight.shape[0], weight.shape[1], input.dtype, input.device)


def grads_in_backward(p: LossParams, config: str) -> bool:
    """Whether the gradients are formed in backward (from each token's saved lse) rather than in forward:
    for reduction "none" (backward needs the per-token grad_output), and for a config that forces a strategy
    of the "recompute" loop. Decided from the arguments alone, so the fake implementation, which sees no real
    shapes, agrees with the op."""
    if p.reduction == "none":
        return True
    strategy = dict(forced_fields(config)).get("strategy")
    return strategy is not None and registry.get(strategy).loop == "recompute"


def targets_checked(on_cpu: bool) -> bool:
    """Whether ``check_targets`` checks targets on the CPU (``on_cpu``) or else on a GPU: $FLCE_DEBUG, read on
    every call."""
    if on_cpu:
        return True
    environ = os.environ
    if environ is not _ENVIRON_OWNER:  # replaced (a test's mock), or another Python's: the mapping's own lookup
        return environ.get(DEBUG_ENV_VAR) == "1"
    return _ENVIRON.get(_DEBUG_KEY) == _DEBUG_ON


DEBUG_ENV_VAR = "FLCE_DEBUG"
# ``os.environ.get`` of a variable that is not set raises and catches a KeyError inside: ~0.5 us, on every GPU call
# of the op (issue #13). The dict behind ``os.environ``, which its assignments (and pytest's monkeypatch) update,
# answers in a lookup. (``os.putenv`` alone reaches neither.)
try:
    _ENVIRON_OWNER, _ENVIRON = os.environ, os.environ._data
    _DEBUG_KEY, _DEBUG_ON = os.environ.encodekey(DEBUG_ENV_VAR), os.environ.encodevalue("1")
except AttributeError:  # another Python's os.environ
    _ENVIRON_OWNER = None


class TargetError(ValueError, IndexError, RuntimeError):
    """A class id outside [0, V) that is not ignored. It is each exception a caller's code may catch around the
    unfused loss: eager ``F.cross_entropy`` raises IndexError for it, ``torch.gather`` RuntimeError, and this
    library's argument checks ValueError."""


def check_targets(target: Tensor, vocab: int, ignore_index: int) -> None:
    """Out-of-range targets raise ``TargetError`` on the CPU (and under FLCE_DEBUG=1); on the GPU their loss is
    NaN instead, because checking would cost a host sync."""
    if not targets_checked(target.is_cpu):
        return
    bad = (target < 0) | (target >= vocab)
    if ignore_index != NO_IGNORED_CLASS:  # (the gather's marker is no class id: gather refuses it too)
        bad &= target != ignore_index
    if bool(bad.any()):
        first = int(target[bad][0])
        if ignore_index == NO_IGNORED_CLASS:  # the compiler's per-token log-prob gather
            raise TargetError(
                f"the log-prob gather's index holds class id {first}, outside [0, {vocab}): a gather ignores no "
                "label (torch.gather raises for it too). Mask such labels before the gather, e.g. "
                f"labels.clamp(min=0), and zero their log-probs after. (A direct call of the op with "
                f"ignore_index={NO_IGNORED_CLASS}, the gather's marker, ignores no label either: pass the "
                "ignore_index the labels use.)")
        raise TargetError(
            f"target holds class id {first}, outside [0, {vocab}) and not ignore_index={ignore_index}; "
            "fix the labels or pass the ignore_index they use"
        )


def frozen_columns(p: LossParams, weight: Tensor) -> int:
    """``p.frozen_weight_columns``, checked against the weight's columns (the API checks it; a direct op call
    with a wrong one gets this error rather than a failed allocation)."""
    frozen = p.frozen_weight_columns
    if frozen and not 0 <= frozen <= weight.shape[1]:
        raise ValueError(f"frozen_weight_columns={frozen} must lie in [0, {weight.shape[1]}] (the weight's columns)")
    return frozen


def _autocast_device_types() -> tuple[str, ...]:
    """The device types this torch has autocast for. Asked once, at import: Dynamo in torch 2.11 cannot trace
    ``torch._C._is_autocast_available`` and broke the user's graph on it (issue #13: a second graph and the
    API's Python run eagerly on every call made the op ~0.2 ms slower inside a user's compile)."""
    types = []
    for name in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "xla", "ipu", "privateuseone"):
        try:
            if torch.amp.is_autocast_available(name):
                types.append(name)
        except RuntimeError:  # a device type this build does not know
            continue
    return tuple(types)


_AUTOCAST_DEVICE_TYPES = _autocast_device_types()


def autocast_on(device_type: str) -> bool:
    """Whether torch.autocast is on for ``device_type``. Devices without autocast (meta) cannot be asked whether
    it is on: they answer False. A type not known at import (meta, a privateuse1 backend renamed later) is asked
    now, also while Dynamo traces (a graph break on torch 2.11)."""
    if device_type not in _AUTOCAST_DEVICE_TYPES and not torch.amp.is_autocast_available(device_type):
        return False
    return torch.is_autocast_enabled(device_type)


class _OpContext:
    """``op_context``'s manager: a class, not a generator (entered on every call of the op, which the host
    bounds at small shapes), and the device switched by index as ``torch.cuda.device`` does, without its
    argument parsing."""

    __slots__ = ("_index", "_previous", "_autocast_off")

    def __init__(self, device: torch.device) -> None:
        self._index = (-1 if device.type != "cuda" else
                       device.index if device.index is not None else torch.cuda.current_device())
        self._previous = -1
        # Entering autocast costs a few microseconds per call; when it is off there is nothing to turn off.
        self._autocast_off = torch.autocast(device.type, enabled=False) if autocast_on(device.type) else None

    def __enter__(self) -> None:
        if self._index >= 0:
            self._previous = torch.cuda._exchange_device(self._index)
        if self._autocast_off is not None:
            try:
                self._autocast_off.__enter__()
            except BaseException:  # leave nothing switched
                if self._index >= 0:
                    torch.cuda._maybe_exchange_device(self._previous)
                raise

    def __exit__(self, *exc: object) -> bool:
        if self._autocast_off is not None:
            self._autocast_off.__exit__(*exc)
        if self._index >= 0:
            torch.cuda._maybe_exchange_device(self._previous)
        return False


def op_context(device: torch.device) -> contextlib.AbstractContextManager:
    """The context of an op body: autocast off (the op's dtypes are final) and, on CUDA, ``device`` made current.

    Triton launches on the current device, and streams and events default to it, so without the guard a call
    whose tensors are all on cuda:1 while cuda:0 is current (Hugging Face's ``device_map="auto"`` puts the
    lm_head on the last GPU) fails in the kernel launch.
    """
    return _OpContext(device)


def _fused_forward_body(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor],
    ce_weight: Optional[Tensor],
    params: str,
    accum_dtype: torch.dtype,
    compute_dx: bool,
    compute_dw: bool,
    compute_db: bool,
    config: str,
    softcap_value: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Forward of the fused op on (input (N,H), weight (V,H), target (N,)); see the module docstring."""
    r = _forward_result(input, weight, target, bias, ce_weight, params, accum_dtype, compute_dx, compute_dw,
                        compute_db, config, softcap_value)
    lse = r.lse if r.lse is not None else input.new_empty(_EMPTY, dtype=math_dtype(input.dtype))
    return (r.loss, lse) + _grads_or_empty(input, weight, r.dx, r.dw, r.db) + (r.grad_scale,)


def _forward_result(input: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, ce_weight: Tensor | None,
                    params: str, accum_dtype: torch.dtype, compute_dx: bool, compute_dw: bool, compute_db: bool,
                    config: str, softcap_value: Tensor | None = None) -> ForwardResult:
    """The fused forward's results (``lse`` set when backward forms the gradients, else dx/dw/db as asked),
    through a replayed CUDA graph where ``graph_replay`` takes the call."""
    if torch.autograd.forward_ad._current_level >= 0:  # (one attribute read on the hot path)
        refuse_forward_ad((input, weight, bias))
    params = runtime_params(params, softcap_value)
    p = decode_params(params)
    check_targets(target, weight.shape[0], p.ignore_index)
    # A call like one whose forward was replayed goes straight to that graph (``graph_replay``'s body shortcut):
    # first a repeat of the recent such call, to the instance it replayed.
    extra = (params, accum_dtype, compute_dx, compute_dw, compute_db, config)
    if bias is None and ce_weight is None:
        r = graph_replay.body_shortcut_recent(input, weight, target, extra)
        if r is not None:
            return r
    ops = Operands(input, weight, target, bias, ce_weight)
    shortcut = graph_replay.body_shortcut_key(ops, extra)
    r = graph_replay.body_shortcut_replay(shortcut, ops)
    if r is not None:
        return r
    later = grads_in_backward(p, config)
    with op_context(input.device):
        cfg = _config(config, input, weight)
        grads = GradRequest() if later else GradRequest(compute_dx, compute_dw, compute_db, frozen_columns(p, weight))
        # Each row's largest z and its class only for the recompute loop's backward (its other GEMMs): "none"'s
        # chunked backward recomputes each chunk in this GEMM and reads them not (``fused_forward``'s keep_lse)
        keep_top = later and registry.get(cfg.strategy).loop == "recompute"

        def run(o: Operands) -> ForwardResult:
            return fused_forward(o, p, cfg, accum_dtype, grads, keep_lse=keep_top)

        def run_in_context(o: Operands) -> ForwardResult:  # graph_replay may capture it again from a shortcut
            with op_context(o.x.device):
                return run(o)

        r = graph_replay.replayed_forward(
            ops, (params, accum_dtype, cfg, grads), run_in_context, grads_in_forward=not later,
            estimated_bytes=lambda: _graph_bytes(ops, p, cfg, accum_dtype, grads),
        )
        if r is None:
            return run(ops)
    graph_replay.body_shortcut_remember(shortcut)
    return r


fused_linear_cross_entropy_op = torch.library.custom_op("flce::fused_linear_cross_entropy",
                                                        mutates_args=())(_fused_forward_body)


def _graph_bytes(ops: Operands, p: LossParams, cfg: FLCEConfig, accum_dtype: torch.dtype, grads: GradRequest) -> int:
    """What a CUDA graph of this forward would hold: the loop's working set (``peak_bytes``), the gradients it
    returns and its copies of the hidden states and targets."""
    n, h = ops.x.shape
    vocab, size = ops.weight.shape[0], ops.x.element_size()
    need_db = grads.db and ops.bias is not None
    working = peak_bytes(cfg, n, vocab, h, ops.x.dtype, accum_dtype, need_dw=grads.dw, need_db=need_db,
                         softcap=p.softcap > 0, need_dx=grads.dx, frozen_columns=grads.dw_from, device=ops.x.device)
    returned = (grads.dx * n * h + grads.dw * vocab * (h - grads.dw_from) + need_db * vocab) * size
    return working + returned + ops.x.nbytes + ops.target.nbytes


def _grads_or_empty(input: Tensor, weight: Tensor, dx, dw, db) -> tuple[Tensor, Tensor, Tensor]:
    # Absent results are distinct empty tensors: custom op outputs may not alias each other.
    return (
        dx if dx is not None else input.new_empty(_EMPTY),
        dw if dw is not None else weight.new_empty(_EMPTY),
        db if db is not None else weight.new_empty(_EMPTY),
    )


@fused_linear_cross_entropy_op.register_fake
def _fused_linear_cross_entropy_fake(input, weight, target, bias, ce_weight, params, accum_dtype, compute_dx,
                                     compute_dw, compute_db, config, softcap_value=None):
    key_compile_caches()  # traced: torch's compile caches must key on this package's code (compile_cache_key.py)
    n = input.shape[0]
    p = decode_params(params)
    per_token, later = p.reduction == "none", grads_in_backward(p, config)
    dtype = math_dtype(input.dtype)
    loss = input.new_empty((n,) if per_token else (), dtype=dtype)
    lse = input.new_empty((KEPT_ROWS, n), dtype=LSE_DTYPE) if later else input.new_empty(_EMPTY, dtype=dtype)
    grads = _fake_grads(input, weight, bias, not later, compute_dx, compute_dw, compute_db, frozen_columns(p, weight))
    return (loss, lse) + grads + (input.new_empty((), dtype=dtype),)


def _fake_grads(input, weight, bias, grads, compute_dx, compute_dw, compute_db,
                frozen: int) -> tuple[Tensor, Tensor, Tensor]:
    dx = input.new_empty(input.shape if grads and compute_dx else _EMPTY)
    # dW holds the columns that are not frozen (``GradRequest.dw_from``); the autograd formula pads the rest
    dw = weight.new_empty((weight.shape[0], weight.shape[1] - frozen) if grads and compute_dw else _EMPTY)
    db = bias.new_empty(bias.shape) if grads and compute_db and bias is not None else weight.new_empty(_EMPTY)
    return dx, dw, db


def _with_logits_body(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor],
    ce_weight: Optional[Tensor],
    params: str,
    accum_dtype: torch.dtype,
    compute_dx: bool,
    compute_dw: bool,
    compute_db: bool,
    config: str,
    softcap_value: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The fused op that also returns the raw logits ``input @ weight.T + bias`` (N, V), exact and intact.

    Returns (loss, logits, dx, dw, db, grad_scale), reduction "mean" or "sum" only. The logits are written
    chunk by chunk as the loop computes them; the loss and the logit gradient come from them into a chunk-sized
    buffer, and dX/dW are formed in forward (divided by grad_scale) as in ``fused_linear_cross_entropy``, so
    nothing of size N x V is saved for backward. The logits are contiguous.
    """
    if torch.autograd.forward_ad._current_level >= 0:
        refuse_forward_ad((input, weight, bias))
    p = decode_params(runtime_params(params, softcap_value))
    check_targets(target, weight.shape[0], p.ignore_index)
    with op_context(input.device):
        r = fused_forward(
            Operands(input, weight, target, bias, ce_weight), p, _config(config, input, weight), accum_dtype,
            GradRequest(compute_dx, compute_dw, compute_db, frozen_columns(p, weight)), keep_logits=True,
        )
    return (r.loss, r.logits) + _grads_or_empty(input, weight, r.dx, r.dw, r.db) + (r.grad_scale,)


fused_linear_cross_entropy_with_logits_op = torch.library.custom_op(
    "flce::fused_linear_cross_entropy_with_logits", mutates_args=())(_with_logits_body)


@fused_linear_cross_entropy_with_logits_op.register_fake
def _fused_linear_cross_entropy_with_logits_fake(input, weight, target, bias, ce_weight, params, accum_dtype,
                                                 compute_dx, compute_dw, compute_db, config, softcap_value=None):
    key_compile_caches()
    n, vocab = input.shape[0], weight.shape[0]
    dtype = math_dtype(input.dtype)
    loss = input.new_empty((), dtype=dtype)
    logits = input.new_empty((n, vocab))
    grads = _fake_grads(input, weight, bias, True, compute_dx, compute_dw, compute_db,
                        frozen_columns(decode_params(params), weight))
    return (loss, logits) + grads + (input.new_empty((), dtype=dtype),)


def _backward_body(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor],
    ce_weight: Optional[Tensor],
    lse: Tensor,
    grad_rows: Tensor,
    params: str,
    accum_dtype: torch.dtype,
    compute_dx: bool,
    compute_dw: bool,
    compute_db: bool,
    config: str,
    softcap_value: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of a loss whose forward kept each token's lse, recomputing the logits: with the
    "recompute" loop, of the loss (``params``' reduction) times ``grad_rows`` (0-dim, or per row for "none"), by
    vocabulary block; else of sum_i grad_rows[i] * loss_i for reduction "none", by token chunk."""
    p = decode_params(runtime_params(params, softcap_value))
    ops = Operands(input, weight, target, bias, ce_weight)
    cfg = _config(config, input, weight)
    grads = GradRequest(compute_dx, compute_dw, compute_db, frozen_columns(p, weight))
    with op_context(input.device):
        if registry.get(cfg.strategy).loop == "recompute":
            dx, dw, db = recompute_backward(ops, lse, grad_rows, p, cfg, accum_dtype, grads)
        else:
            dx, dw, db = fused_backward_per_token(ops, lse, grad_rows, p, cfg, accum_dtype, grads)
    return _grads_or_empty(input, weight, dx, dw, db)


fused_linear_cross_entropy_backward_op = torch.library.custom_op(
    "flce::fused_linear_cross_entropy_backward", mutates_args=())(_backward_body)


@fused_linear_cross_entropy_backward_op.register_fake
def _fused_linear_cross_entropy_backward_fake(input, weight, target, bias, ce_weight, lse, grad_rows, params,
                                              accum_dtype, compute_dx, compute_dw, compute_db, config,
                                              softcap_value=None):
    return _fake_grads(input, weight, bias, True, compute_dx, compute_dw, compute_db,
                       frozen_columns(decode_params(params), weight))


_ARG_NAMES = ("input", "weight", "target", "bias", "ce_weight", "params", "accum_dtype", "compute_dx", "compute_dw",
              "compute_db", "config", "softcap_value")


def _setup_context(ctx, inputs, output) -> None:
    _loss, lse, dx, dw, db, grad_scale = output
    ctx.mark_non_differentiable(lse, dx, dw, db, grad_scale)
    # Backward ignores the gradients of those outputs: without this, autograd would materialise them as
    # zero tensors of their size (a dX- and a dW-sized allocation in every backward).
    ctx.set_materialize_grads(False)
    _keep_for_backward(ctx, inputs, lse, dx, dw, db, grad_scale)


def _keep_for_backward(ctx, inputs: tuple, lse: Tensor | None, dx: Tensor | None, dw: Tensor | None,
                       db: Tensor | None, grad_scale: Tensor) -> None:
    """What ``_backward`` reads: the options, and the saved operands and lse (gradients formed in backward) or the
    forward's gradients (``_keep_forward_grads``; then none of them is None)."""
    # By position (``_ARG_NAMES``), not through a dict of them: this runs on every call.
    input, weight, target, bias, ce_weight, params, accum_dtype = inputs[:7]
    config = inputs[10]
    p = decode_params(params)
    ctx.params, ctx.accum_dtype, ctx.config = params, accum_dtype, config
    ctx.has_bias, ctx.frozen = bias is not None, p.frozen_weight_columns
    if grads_in_backward(p, config):  # (the softcap read at run time decides neither)
        softcap_value = inputs[11] if len(inputs) > 11 else None
        ctx.save_for_backward(input, weight, target, bias, ce_weight, lse, softcap_value)
    else:
        _keep_forward_grads(ctx, dx, dw, db, grad_scale)


def _keep_forward_grads(ctx, dx: Tensor | None, dw: Tensor | None, db: Tensor | None, grad_scale: Tensor) -> None:
    # The forward-computed gradients are kept on ctx, not saved: backward takes the only reference and
    # returns them scaled in place, so autograd can adopt them as .grad without a copy (a saved tensor
    # would still be referenced, and AccumulateGrad would clone a dW-sized buffer). They are
    # non-differentiable outputs, so no reference cycle runs through them.
    ctx.grads = (dx, dw, db)
    ctx.grad_scale = grad_scale


def _check_first_order() -> None:
    """Backward runs with grad mode on only under ``create_graph=True``: refuse it rather than return
    gradients without a graph (a gradient penalty would silently lose its second-order term)."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "double backward (create_graph=True) through fused_linear_cross_entropy is not supported: its "
            "gradients are formed inside the op and have no graph of their own. For gradient penalties or "
            "Hessian-vector products compute this loss unfused, F.cross_entropy(F.linear(input, weight, bias)"
            ".float(), target), or backward without create_graph=True"
        )


def raise_backward_twice() -> None:
    """The error of a second backward through a call whose gradients the first one consumed."""
    raise RuntimeError(
        "backward ran twice through the fused linear cross-entropy (retain_graph=True, or one "
        "torch.autograd.grad call per input); its gradients are computed in the forward pass and consumed "
        "by the first backward. Ask for every gradient in one call (torch.autograd.grad(loss, [input, "
        "weight])), recompute the loss, or use reduction='none' (whose backward recomputes)"
    )


def _scaled_forward_grads(ctx, grad_loss: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The forward-computed (dx, dw, db) times grad_scale * grad_output; one not requested is empty."""
    if ctx.grads is None:
        raise_backward_twice()
    grads, grad_scale = ctx.grads, ctx.grad_scale  # a gradient not asked for is empty
    # One factor in the loss's dtype (fp32, fp64 for fp64), applied so that each element is rounded once
    # (``_scale_in_place``). grad_scale is a power of two, so the factor is as exact as grad_output; with
    # GradScaler's power-of-two scales it is exact.
    if grad_scale.dtype == torch.float64:
        # fp64 is the checking dtype: scale copies and keep the originals, so backward can run again
        # (torch.autograd.gradcheck runs it twice); a second dW-sized buffer does not matter there.
        g = output_factor(grad_loss, grad_scale)
        return tuple(t * g if t is not None and t.numel() else t for t in grads)
    # Released now, not with the graph: a CUDA-graph replay's outputs (``graph_replay``) are reused only once
    # nothing holds them, and a training loop keeps the last loss (and so this ctx) into the next forward.
    ctx.grads = ctx.grad_scale = None
    if traced_for_cuda_graphs(grad_scale):  # new buffers, not the saved ones: see scaled_gradients.py
        return _scaled_copies(grads, grad_loss, grad_scale)
    # Scaled in place: a copy would hold a second dW-sized buffer at the peak. Under torch.compile the
    # product is functional and Inductor reuses the buffer for it.
    if torch.compiler.is_compiling():
        g = output_factor(grad_loss, grad_scale)
        return tuple(t * g if t is not None and t.numel() else t for t in grads)
    # A replayed forward's outputs are scaled by a replayed graph too (two launches instead of a multiply and
    # a Triton launch: at small shapes backward is host-bound as well).
    if not graph_replay.scaled_by_graph(grad_scale, grad_loss, _scale_present):
        _scale_present(grads, grad_loss, grad_scale)
    return grads


def _scaled_copies(grads: tuple[Tensor | None, ...], grad_loss: Tensor,
                   grad_scale: Tensor) -> tuple[Tensor | None, ...]:
    """``grads`` with each non-empty one replaced by its product with grad_loss * grad_scale in a new tensor."""
    present = [i for i, t in enumerate(grads) if t is not None and t.numel()]
    if not present:
        return grads
    scaled = dict(zip(present, scaled_gradients_op([grads[i] for i in present], grad_loss, grad_scale)))
    return tuple(scaled.get(i, t) for i, t in enumerate(grads))


def _scale_present(grads: tuple[Tensor | None, ...], grad_loss: Tensor, grad_scale: Tensor) -> None:
    """``t *= grad_loss * grad_scale`` for each non-empty gradient of ``grads`` (None: not requested), each
    element rounded once."""
    present = [t for t in grads if t is not None and t.numel()]
    if kernel_scales(present, grad_loss, grad_scale):
        from .kernels.scale_grads import scale_all_in_place

        # One launch for all of them, which forms the factor too (``output_factor``'s three small ops would be
        # three launches more: at small shapes backward is bound by the host).
        scale_all_in_place(present, grad_loss, post=grad_scale)
        return
    g = output_factor(grad_loss, grad_scale)
    for t in present:
        _scale_in_place(t, g)


def _scale_in_place(t: Tensor, g: Tensor) -> Tensor:
    """``t *= g`` with a single rounding (see ``scaled_gradients.kernel_scales``)."""
    if kernel_scales([t], g):
        from .kernels.scale_grads import scale_in_place

        return scale_in_place(t, g)
    return t.mul_(g)


def _input_grads(ctx, dx: Tensor | None, dw: Tensor | None, db: Tensor | None) -> tuple:
    need_x, need_w, _t, need_b = ctx.needs_input_grad[:4]
    # ``_grads_or_empty``'s "none" is 1-D and empty (dX and dW are 2-D here, db has V >= 1 elements).
    if need_x and dx is not None and dx.dim() == 1:
        raise _no_gradient_formed("input")
    if need_w and dw is not None and dw.dim() == 1:
        raise _no_gradient_formed("weight")
    if need_b and db is not None and db.numel() == 0:
        raise _no_gradient_formed("bias")
    if need_w and dw is not None and ctx.frozen:
        # The frozen columns' gradient: zeros. (In a compiled graph the LoRA fold's ``join_frozen`` copies the other
        # columns out again, which Inductor computes from dW itself: the padded tensor is never formed there.)
        dw = torch.nn.functional.pad(dw, (ctx.frozen, 0))
    return (
        dx if need_x else None,
        dw if need_w else None,
        None,
        db if need_b and ctx.has_bias else None,
    ) + (None,) * (len(_ARG_NAMES) - 4)


def _no_gradient_formed(name: str) -> RuntimeError:
    """The error of a backward that needs a gradient the forward did not form, because ``name`` read
    requires_grad=False when the op was called (autograd's own said "invalid gradient ... got [0]")."""
    return RuntimeError(
        f"fused_linear_cross_entropy formed no gradient for its {name}: it read requires_grad=False when the op was "
        "called or traced, yet backward asks for one. A traced graph keeps what it read then: a module exported "
        f"(torch.export) with an example {name} that did not require grad, under no_grad or with the {name} frozen, "
        "then trained, needs exporting again as it is trained; torch.func.vmap inside torch.compile traces batched "
        "tensors that read requires_grad=False: call vmap outside torch.compile (eager vmap gives the gradient), or "
        "compute this loss unfused there")


def _backward(ctx, grad_loss, *_other_outputs):
    """The gradients of the op's inputs; only the loss's gradient counts (the other outputs are
    non-differentiable, and the direct call returns the loss alone)."""
    _check_first_order()
    if grad_loss is None:  # the loss took no part in what is differentiated
        return _input_grads(ctx, None, None, None)
    if grads_in_backward(decode_params(ctx.params), ctx.config):
        need_x, need_w, _t, need_b = ctx.needs_input_grad[:4]
        input, weight, target, bias, ce_weight, lse, softcap_value = ctx.saved_tensors
        args = (input, weight, target, bias, ce_weight, lse, grad_loss, ctx.params, ctx.accum_dtype, need_x, need_w,
                bool(need_b and ctx.has_bias), ctx.config, softcap_value)
        # A grad_loss batched by autograd's own (legacy) vmap, of is_grads_batched=True and
        # jacobian(vectorize=True), is no functorch wrapper: the registered op's vmap fallback takes it.
        direct = (direct_call_ok(input, weight, target, bias, ce_weight, lse, grad_loss, softcap_value)
                  and not _is_legacy_batched(grad_loss))
        dx, dw, db = _backward_body(*args) if direct else fused_linear_cross_entropy_backward_op(*args)
    else:
        dx, dw, db = _scaled_forward_grads(ctx, grad_loss)
    return _input_grads(ctx, dx, dw, db)


torch.library.register_autograd(
    "flce::fused_linear_cross_entropy", _backward, setup_context=_setup_context
)


def _setup_context_with_logits(ctx, inputs, output) -> None:
    args = dict(zip(_ARG_NAMES, inputs))
    _loss, _logits, dx, dw, db, grad_scale = output
    ctx.has_bias = args["bias"] is not None
    ctx.frozen = decode_params(args["params"]).frozen_weight_columns
    ctx.mark_non_differentiable(dx, dw, db, grad_scale)
    ctx.set_materialize_grads(False)  # no gradient into the logits costs nothing (see _backward_with_logits)
    _keep_forward_grads(ctx, dx, dw, db, grad_scale)
    # For a gradient that reaches the logits themselves (an extra loss on them): small next to the logits.
    ctx.save_for_backward(args["input"], args["weight"])


def _backward_with_logits(ctx, grad_loss, grad_logits, _grad_dx, _grad_dw, _grad_db, _grad_scale):
    """The loss's gradients, scaled as in ``_backward``, plus, when the logits received a gradient G, the
    linear's own: dX += G W, dW += G^T X, db += sum_rows G (each GEMM in the weight dtype, as eager's)."""
    _check_first_order()
    need_x, need_w, _t, need_b = ctx.needs_input_grad[:4]
    # A backward through the logits alone keeps the loss's gradients for a later one through the loss (an
    # auxiliary loss on the logits backpropagated first with retain_graph=True; gradcheck's one output at a
    # time): released there, that one failed as a backward run twice.
    dx, dw, db = (
        _scaled_forward_grads(ctx, grad_loss) if grad_loss is not None else (None, None, None)
    )
    if grad_logits is not None:
        input, weight = ctx.saved_tensors
        g = grad_logits.to(weight.dtype)
        dx = _add(dx, g @ weight if need_x else None)
        dw = _add(dw, g.t() @ input[:, ctx.frozen:] if need_w else None)  # (frozen columns: padded later)
        db = _add(db, g.sum(0) if need_b and ctx.has_bias else None)
    return _input_grads(ctx, dx, dw, db)


def _add(acc: Tensor | None, extra: Tensor | None) -> Tensor | None:
    if extra is None:
        return acc
    if acc is None or not acc.numel():
        return extra
    return acc.add_(extra) if not torch.compiler.is_compiling() else acc + extra


torch.library.register_autograd(
    "flce::fused_linear_cross_entropy_with_logits", _backward_with_logits, setup_context=_setup_context_with_logits
)


# -- the registered ops' CPU and CUDA kernels, without torch.library's Python layer ---------------------------------
#: ``custom_op`` puts each op's body behind Python layers that, on every call, look the kernel up again and check
#: that no output aliases an input: about 8 us a call on the CPU (issue #13), paid wherever the op runs through the
#: dispatcher, i.e. in every graph torch.compile makes of it (``backend="flce"`` and the user's own). The same
#: bodies are the CPU and CUDA kernels here, so those calls skip them. Their outputs never alias the inputs (fresh
#: tensors, or a replayed CUDA graph's own buffers): ``torch.library.opcheck``'s schema test checks it (tests).
#: Dynamo stays off inside them, as custom_op has it: a kernel run eagerly in a frame Dynamo watches (a skipped
#: frame of a compiled function) must not be traced into. Other device types keep ``custom_op``'s kernel.
#: A second copy of this module in one process finds the keys taken, which torch 2.11 refuses (2.13 overrides):
#: its calls then keep custom_op's kernel.
_KERNELS = torch.library.Library("flce", "IMPL")
for _name, _body in (("fused_linear_cross_entropy", _fused_forward_body),
                     ("fused_linear_cross_entropy_with_logits", _with_logits_body),
                     ("fused_linear_cross_entropy_backward", _backward_body),
                     ("scaled_gradients", scaled_gradients_body)):
    _kernel = torch._disable_dynamo(_body)
    for _key in ("CPU", "CUDA"):
        try:
            _KERNELS.impl(_name, _kernel, _key)
        except RuntimeError as _exc:  # noqa: PERF203 - eight registrations at import
            logger.debug("flce: flce::%s keeps custom_op's %s kernel: %s", _name, _key, _exc)


# -- the direct call: the same op without the dispatcher round trip, where nothing could tell the two apart --------


class _FusedFunction(torch.autograd.Function):
    """``flce::fused_linear_cross_entropy`` as a plain autograd.Function (see ``call_fused``): the op's own
    forward and backward, with the loss as its only output. The op's other outputs are non-differentiable and
    the caller drops them; not forming them saves an empty lse, and autograd wraps one output instead of six
    (a host cost on every call)."""

    @staticmethod
    def forward(ctx, *args):
        # ctx-style forward, not a separate setup_context: with one, Function.apply binds the arguments through
        # inspect.signature on every call (~20 us).
        r = _forward_result(*args)
        input, weight = args[:2]
        ctx.set_materialize_grads(False)  # as in _setup_context: an unused loss gives backward None
        if r.lse is not None:
            _keep_for_backward(ctx, args, r.lse, None, None, None, r.grad_scale)
        else:
            _keep_for_backward(ctx, args, None, *_grads_or_empty(input, weight, r.dx, r.dw, r.db), r.grad_scale)
        return r.loss

    @staticmethod
    def backward(ctx, grad_loss):
        return _backward(ctx, grad_loss)


class _WithLogitsFunction(torch.autograd.Function):
    """``flce::fused_linear_cross_entropy_with_logits`` as a plain autograd.Function (see ``call_fused``)."""

    @staticmethod
    def forward(ctx, *args):
        output = _with_logits_body(*args)
        _setup_context_with_logits(ctx, args, output)
        return output

    @staticmethod
    def backward(ctx, *grads):
        return _backward_with_logits(ctx, *grads)


#: Tensor types the direct call takes: plain tensors and parameters (an lm_head's weight), which dispatch alike.
_DIRECT_TYPES = graph_replay.PLAIN_TENSORS


def direct_call_ok(*tensors: Tensor | None) -> bool:
    """Whether a call on ``tensors`` may skip the dispatcher and run the op's body (and autograd formula)
    directly: plain CPU/CUDA tensors, eager mode, and nothing that intercepts operators (no torch-function or
    torch-dispatch mode, no functorch transform, no JIT trace, no Dynamo trace). Anything else, fake, meta and
    subclass tensors included, goes through the registered op, which those systems know.

    Why: the custom op's Python dispatch path (``torch.library``'s autograd wrapper, its ``fill_defaults`` over
    the 12-argument schema, the redispatch) cost about 100-200 us per forward + backward on the CPU, more than
    the rest of the op's host work at small shapes.
    """
    return not torch.compiler.is_compiling() and interception_free() and direct_tensors(*tensors)


def direct_tensors(*tensors: Tensor | None) -> bool:
    """``direct_call_ok``'s part that asks the tensors: plain CPU or CUDA tensors (or None)."""
    for t in tensors:
        # is_cuda / is_cpu rather than t.device.type: no device object per tensor per call. A functorch wrapper
        # that outlived its transform (a "dead" one, leaked out of torch.func.grad) is a plain Tensor by type; the
        # registered op unwraps it, as Function.apply's Python wrapper, which the direct call skips, would.
        if t is not None and (type(t) not in _DIRECT_TYPES or not (t.is_cuda or t.is_cpu)
                              or _is_functorch_wrapped(t) or t.is_neg() or t.is_nested or t.layout is not _STRIDED):
            # (a negative view's memory is not its value: a graph keyed on the address would read -t; sparse and
            # nested tensors get the full path's error, which names the argument)
            return False
    return True


_STRIDED = torch.strided


_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_is_legacy_batched = torch._C._functorch.is_legacy_batchedtensor


#: ``torch.jit.is_tracing`` without its Python frame (which only adds the TorchScript case, not eager's).
_jit_tracing = getattr(torch._C, "_is_tracing", None) or torch.jit.is_tracing


def interception_free() -> bool:
    """``direct_call_ok``'s part that asks the thread's state, but for Dynamo, which its callers ask about first:
    no JIT trace, no
    forward-mode AD level, no torch-function or torch-dispatch mode and no functorch transform."""
    if _jit_tracing() or torch.autograd.forward_ad._current_level >= 0:  # dual tensors: the registered op
        return False
    if torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack():
        return False
    return torch._C._functorch.peek_interpreter_stack() is None


def refuse_unsupported_autodiff(tensors: tuple) -> None:
    """Raise for forward-mode AD and for torch.func's differentiating transforms through the op's inputs, which
    the op does not support.

    Forward-mode AD (dual tensors, ``torch.func.jvp``) through a ``torch.library`` op without a jvp rule gives
    a tangent of 0 (torch 2.13), a silently wrong derivative; torch.func.grad / vjp / jacrev fail inside torch
    with a message that names no op. Only inputs the transform differentiates count: a loss on tensors the
    transform does not track (a frozen head scored inside ``torch.func.grad`` over something else) runs, and
    vmap over the forward pass works."""
    refuse_forward_ad(tensors)
    if torch._C._functorch.peek_interpreter_stack() is None:
        return
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters  # noqa: PLC0415 - rare path

    kinds = {interpreter.level(): interpreter.key() for interpreter in retrieve_all_functorch_interpreters()}
    # Under no_grad no grad level records the op, inner or outer (its result is a constant to all of them, as an
    # unfused loss's is); jvp levels still see tangents.
    grad_enabled = torch.is_grad_enabled()
    for tensor in tensors:
        what = _differentiated_by(tensor, kinds, grad_enabled) if isinstance(tensor, Tensor) else None
        if what is not None:
            raise _unsupported_autodiff(what)


def refuse_forward_ad(tensors: tuple) -> None:
    """Raise if a forward-mode AD level is open and one of ``tensors`` (not functorch's wrappers, which
    ``_differentiated_by`` reads) carries a dual tangent. Also asked in the op bodies: a compiled graph runs the
    registered op below autograd, where torch's custom-op autograd dropped the tangent without a word
    (torch.compile with aot_eager or Inductor, ``backend="flce"`` included)."""
    if torch.autograd.forward_ad._current_level < 0:
        return
    # Read with autograd's keys dispatched again (below autograd, in the op bodies, unpack_dual asserts) and with
    # functorch off (a torch.func transform above hides a plain dual's tangent).
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.Autograd, False), \
            torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False), \
            torch._C._DisableFuncTorch():
        dual = any(t is not None and not torch._C._functorch.is_functorch_wrapped_tensor(t)
                   and torch.autograd.forward_ad.unpack_dual(t).tangent is not None for t in tensors)
    if dual:
        raise _unsupported_autodiff("forward-mode AD (dual tensors or torch.func.jvp)")


def _differentiated_by(tensor: Tensor, kinds: dict, grad_enabled: bool = True) -> str | None:
    """The differentiating functorch transform that tracks ``tensor`` at some level of its wrappers, named for
    the error, or None. A grad level tracks a wrapper that requires grad, with grad mode on; a jvp level one with
    a tangent, which can be read only where no grad or jvp level sits above it (a closure into an inner
    torch.func.grad hides it: a jvp over such a loss gave a tangent of 0), so otherwise any wrapper of a jvp level
    counts."""
    functorch = torch._C._functorch
    transform = functorch.TransformType
    differentiating = (transform.Grad, transform.Jvp)
    while functorch.is_functorch_wrapped_tensor(tensor):
        level = functorch.maybe_get_level(tensor)
        kind = kinds.get(level)
        if kind == transform.Grad and tensor.requires_grad and grad_enabled:
            return "torch.func.grad, vjp and jacrev"
        if kind == transform.Jvp:
            hidden = any(k in differentiating for above, k in kinds.items() if above > level)
            if hidden or torch.autograd.forward_ad.unpack_dual(tensor).tangent is not None:
                return "forward-mode AD (torch.func.jvp, jacfwd, hessian)"
        tensor = functorch.get_unwrapped(tensor)
    return None


def _unsupported_autodiff(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"fused_linear_cross_entropy does not support {what}: only reverse mode through torch.autograd "
        "(loss.backward(), torch.autograd.grad). Use that, or compute this loss unfused, "
        "F.cross_entropy(F.linear(input, weight, bias).float(), target), inside the transform")


def _function_apply(function: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``function.apply`` without ``Function.apply``'s Python wrapper, which only unwraps functorch's dead
    wrappers (none on the direct path: ``direct_call_ok`` refuses functorch transforms) and costs ~3 us per call
    on the CPU, more on a GPU host. Falls back to ``function.apply`` where torch lays it out otherwise."""
    raw = getattr(super(torch.autograd.Function, function), "apply", None)
    return raw if raw is not None and getattr(raw, "__self__", None) is function else function.apply


_APPLY_FUSED = _function_apply(_FusedFunction)
_APPLY_WITH_LOGITS = _function_apply(_WithLogitsFunction)


def call_fused(return_logits: bool, *args) -> tuple[Tensor, Tensor | None]:
    """Call ``fused_linear_cross_entropy_op`` (or ``..._with_logits_op`` when ``return_logits``) on ``args``,
    directly (``direct_call_ok``) or through the dispatcher, and return (loss, logits or None). Both paths run
    the same body and autograd formula, so the results are identical. The direct path names itself in a
    profiler trace as the op would."""
    op = fused_linear_cross_entropy_with_logits_op if return_logits else fused_linear_cross_entropy_op
    if not direct_call_ok(*args[:5], *args[11:]):  # (and the softcap tensor, when there is one)
        if not torch.compiler.is_compiling():
            refuse_unsupported_autodiff(args[:5])
        out = op(*args)
    elif torch.autograd._profiler_enabled():  # a range named after the op, so traces look the same
        with torch.autograd.profiler.record_function(op._qualname):
            out = _call_direct(return_logits, args)
    else:
        out = _call_direct(return_logits, args)
    if isinstance(out, Tensor):  # the direct autograd call of the plain op returns the loss alone
        return out, None
    return out[0], (out[1] if return_logits else None)


def _call_direct(return_logits: bool, args: tuple) -> Tensor | tuple[Tensor, ...]:
    # The eager call may replay CUDA graphs (``graph_replay``): nothing here can be inside another graph's warm-up.
    with graph_replay.allowed():
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args[:5]):
            return (_APPLY_WITH_LOGITS if return_logits else _APPLY_FUSED)(*args)
        return _with_logits_body(*args) if return_logits else _forward_result(*args).loss
