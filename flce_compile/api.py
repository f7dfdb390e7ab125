"""The public entry points: ``fused_linear_cross_entropy`` and ``FusedLinearCrossEntropyLoss``.

They check the arguments (errors name the argument and the fix), apply autocast, flatten to 2-D and call the
custom op. Everything here is traceable by Dynamo, so ``torch.compile(fullgraph=True)`` sees one op node. An
eager call like one whose forward the op replayed from a CUDA graph skips all that: ``eager_shortcut``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import operator
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from . import eager_shortcut
from .dtensor import refuse_dtensors
from .op import RUNTIME_SOFTCAP, autocast_on, call_fused, refuse_unsupported_autodiff
from .params import REDUCTIONS, LossParams, encode_params, math_dtype
from .plan.choose import BudgetError, budget_bytes, config_within_budget
from .plan.config import FLCEConfig, config_overrides
from .plan.precision import accum_dtype_for, check_precision, forced_by

#: Argument types that cannot be DTensors.
_PLAIN = (Tensor, nn.Parameter, type(None))
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_INT64 = (-(2**63), 2**63 - 1)


def _validate(input: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, ce_weight: Tensor | None,
              reduction: str, label_smoothing: float, softcap: float | Tensor | None) -> None:
    if not isinstance(input, Tensor) or not isinstance(weight, Tensor) or not isinstance(target, Tensor):
        raise TypeError("input, weight and target must be tensors")
    _check_dense(input=input, weight=weight, target=target, bias=bias, ce_weight=ce_weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (vocab, hidden), got shape {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError(f"weight has no classes (shape {tuple(weight.shape)}); cross-entropy needs vocab >= 1")
    if input.dim() < 1:
        raise ValueError("input must have a hidden dimension: shape (..., hidden)")
    if input.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"input's hidden size {input.shape[-1]} differs from weight's {weight.shape[1]}: weight must be "
            "(vocab, hidden) as in nn.Linear(hidden, vocab).weight"
        )
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal input's leading shape {tuple(input.shape[:-1])}"
        )
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise TypeError(
            f"target must hold integer class ids, got dtype {target.dtype}; probabilities/soft targets are "
            "not supported (cast class ids with target.long())"
        )
    if target.dtype == torch.uint64:  # (F.cross_entropy refuses it too)
        raise TypeError("target dtype torch.uint64 is unsupported: the op reads class ids as int64, where ids past "
                        "2**63 wrap to negative ones (2**64 - 100 to ignore_index -100); pass int64 class ids")
    if input.dtype not in _FLOATS:
        raise TypeError(f"input dtype {input.dtype} is unsupported; use one of {_FLOATS}")
    if weight.dtype not in _FLOATS:
        raise TypeError(f"weight dtype {weight.dtype} is unsupported; use one of {_FLOATS} (e.g. weight.float())")
    if input.dtype != weight.dtype and not _autocast_casts_both(input, weight):
        # Autocast gives 16/32-bit tensors one dtype, never an fp64 one: suggest it only where it would help.
        how = ("autocast leaves fp64 tensors as they are" if torch.float64 in (input.dtype, weight.dtype)
               else f"or run under torch.autocast for {input.device.type}")
        raise TypeError(f"input dtype {input.dtype} differs from weight dtype {weight.dtype}; cast one of them ({how})")
    if input.device != weight.device or target.device != input.device:
        raise ValueError(
            f"input ({input.device}), weight ({weight.device}) and target ({target.device}) must be on one device"
        )
    if bias is not None:
        if not isinstance(bias, Tensor):
            raise TypeError(f"bias must be a tensor of shape ({weight.shape[0]},) or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},) (one per class), got {tuple(bias.shape)}")
        if bias.device != weight.device or not (bias.dtype == weight.dtype or _wide_bias(bias, weight)
                                                or _autocast_casts_both(bias, weight)):
            raise TypeError(f"bias must be on weight's device ({weight.device}) in weight's dtype ({weight.dtype}), "
                            f"or float32 beside bf16/fp16 weights (added to fp32 logits); got {bias.dtype} on "
                            f"{bias.device}")
    if ce_weight is not None:
        if not isinstance(ce_weight, Tensor):
            raise TypeError(f"ce_weight must be a floating tensor of shape ({weight.shape[0]},) (a weight per class) "
                            f"or None, got {type(ce_weight).__name__}")
        if tuple(ce_weight.shape) != (weight.shape[0],) or not ce_weight.is_floating_point():
            raise ValueError(
                f"ce_weight must be a floating tensor of shape ({weight.shape[0]},) (a weight per class), "
                f"got {tuple(ce_weight.shape)} {ce_weight.dtype}"
            )
        check_ce_weight_placement(ce_weight, weight.device)
    _validate_loss_options(reduction, label_smoothing, softcap)


def _check_dense(**tensors: Tensor | None) -> None:
    """Each of ``tensors`` (by argument name) a dense strided tensor or None: a sparse or nested one failed deep
    inside (``.contiguous()``'s "unsupported memory format") with no argument named."""
    for name, t in tensors.items():
        if isinstance(t, Tensor) and t.is_nested:
            raise TypeError(f"{name} must be a dense tensor, got a nested one; pass its sequences concatenated "
                            f"(torch.cat({name}.unbind())), and the other tensors' likewise")
        if isinstance(t, Tensor) and t.layout != torch.strided:
            raise TypeError(f"{name} must be a dense tensor, got a {t.layout} one; pass {name}.to_dense()")


def check_ce_weight_placement(ce_weight: Tensor, device: torch.device) -> None:
    """``ce_weight`` (its shape already checked) on ``device`` and not asking for a gradient, as F.cross_entropy
    refuses class weights that do (with grad on): they get none. The vocab-parallel op asks this too."""
    _check_dense(ce_weight=ce_weight)
    if ce_weight.device != device:
        raise ValueError(f"ce_weight must be on {device}, got {ce_weight.device}")
    if ce_weight.requires_grad and torch.is_grad_enabled():
        raise TypeError("ce_weight requires grad, but cross-entropy's class weights get no gradient (nor do "
                        "they in F.cross_entropy, which refuses them): pass ce_weight.detach()")


def _validate_loss_options(reduction: str, label_smoothing: float, softcap: float | Tensor | None) -> None:
    """The loss options among ``_validate``'s checks, which need no tensors (``FusedLinearCrossEntropyLoss``
    checks them at construction)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is unknown; use one of {REDUCTIONS}")
    _check_number("label_smoothing", label_smoothing, "a float in [0, 1]")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must lie in [0, 1]")
    if isinstance(softcap, Tensor):
        _validate_softcap_tensor(softcap)
    elif softcap is not None:
        _check_number("softcap", softcap, "a float > 0, a 0-dim CPU tensor, or None")
        if not softcap > 0:
            raise ValueError(f"softcap={softcap} must be > 0 (inf means no cap), or None for no softcap")


#: What a scalar option may be: a Python or NumPy number, the symbolic one Dynamo passes under dynamic=True, or a
#: one-element tensor (read at each call: its value may change in place).
_NUMBERS = (numbers.Real, torch.SymInt, torch.SymFloat, Tensor)


def _check_number(name: str, value: Any, expected: str) -> None:
    """A TypeError naming ``name`` unless ``value`` is a real number (a bool, which Python counts as one, is
    refused: ``True`` for a smoothing or a cap is a mistake)."""
    if type(value) is float or type(value) is int:  # (the usual case, asked first: this runs on every call)
        return
    if isinstance(value, bool) or not isinstance(value, _NUMBERS):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} as a tensor must hold one number, got shape {tuple(value.shape)}; pass a "
                             "float or a one-element tensor")
        if value.dtype == torch.bool:
            raise TypeError(f"{name} must be {expected}, got a bool tensor")
        _refuse_transformed_option(name, value)
        if value.requires_grad and torch.is_grad_enabled():  # (under no_grad no gradient is lost)
            raise TypeError(f"{name} is a tensor that requires grad, but the fused op takes it as a constant and "
                            f"would give it no gradient: pass {name}.detach()")


def _refuse_transformed_option(name: str, value: Tensor) -> None:
    """A tensor option is read as one number per call: a jvp or torch.func tangent on it would be lost (a tangent
    of 0), and vmap over it fails inside torch (.item() under vmap) with a message that names no option."""
    refuse_unsupported_autodiff((value,))
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(value):
        if functorch.is_batchedtensor(value):
            raise NotImplementedError(
                f"{name} is batched by torch.func.vmap, but the fused op reads it as one number per call: vmap over "
                f"the inputs with {name} fixed, or compute this loss unfused inside vmap")
        value = functorch.get_unwrapped(value)


def _validate_softcap_tensor(softcap: Tensor) -> None:
    """A softcap the op reads at run time (``op.runtime_params``): a 0-dim floating CPU tensor, the way Dynamo
    passes a Python float it leaves symbolic. On a GPU, reading it would wait for the GPU; a gradient for it would
    be lost."""
    if softcap.dim() != 0 or not softcap.is_floating_point() or softcap.device.type != "cpu":
        raise ValueError(
            f"softcap as a tensor must be a 0-dim floating CPU tensor (read at run time), got shape "
            f"{tuple(softcap.shape)} {softcap.dtype} on {softcap.device}; pass a Python float otherwise"
        )
    _refuse_transformed_option("softcap", softcap)
    if softcap.requires_grad and torch.is_grad_enabled():
        raise TypeError("softcap is a tensor that requires grad, but the fused op reads it as a constant at run "
                        "time and would give it no gradient: pass softcap.detach()")


def _validate_scalars(ignore_index: int, logit_scale: float | Tensor, z_loss: float) -> None:
    """The scalar options the op takes as constants."""
    try:
        if isinstance(ignore_index, bool):  # an int to Python, but never a class id (F.cross_entropy refuses it)
            raise TypeError
        index = operator.index(ignore_index)
    except TypeError:
        raise TypeError(f"ignore_index={ignore_index!r} must be an int (a class id)") from None
    if not _INT64[0] <= index <= _INT64[1]:
        raise ValueError(f"ignore_index={ignore_index} does not fit int64 (class ids are int64); use e.g. -100")
    if isinstance(logit_scale, Tensor):
        _refuse_transformed_option("logit_scale", logit_scale)
        if logit_scale.requires_grad and torch.is_grad_enabled():
            raise TypeError(
                "logit_scale is a tensor that requires grad, but the fused op takes it as a constant and would give "
                "it no gradient: pass float(logit_scale.detach()) for a fixed scale, or pass input * logit_scale "
                "(and bias * logit_scale) so autograd reaches a learned one"
            )
    _check_number("logit_scale", logit_scale, "a float")
    _check_number("z_loss", z_loss, "a float >= 0")
    if not z_loss >= 0:
        raise ValueError(f"z_loss={z_loss} must be >= 0 (0 disables it); a negative z-loss rewards large logits")


def _check_frozen_columns(frozen_weight_columns: int, hidden: int | None = None) -> None:
    """``frozen_weight_columns`` is an int in [0, hidden] (``hidden``: the weight's columns, when known)."""
    try:
        if isinstance(frozen_weight_columns, bool):
            raise TypeError
        columns = operator.index(frozen_weight_columns)
    except TypeError:
        raise TypeError(f"frozen_weight_columns={frozen_weight_columns!r} must be an int (how many leading weight "
                        "columns get no gradient; 0 for none)") from None
    if columns < 0 or (hidden is not None and columns > hidden):
        raise ValueError(f"frozen_weight_columns={columns} must lie in [0, {'hidden' if hidden is None else hidden}]"
                         " (the weight's leading columns that get no gradient; 0 for none)")


def _softcap_arg(softcap: float | Tensor | None) -> float:
    """The op's softcap argument: 0 for no cap, which is also what an infinite cap means (its tanh is the
    identity; computed, it would be inf * 0 = nan). A tensor's value is read by the op at run time: its
    ``params`` then hold ``RUNTIME_SOFTCAP`` until the op puts the value in (``op.runtime_params``)."""
    if isinstance(softcap, Tensor):
        return RUNTIME_SOFTCAP
    if softcap is None:
        return 0.0
    # A comparison, not math.isinf, which Dynamo cannot trace for the symbolic float of dynamic=True (softcap > 0
    # is checked already, so inf is the only infinity)
    return 0.0 if softcap == math.inf else float(softcap)


def _wide_bias(bias: Tensor, weight: Tensor) -> bool:
    """Whether ``bias`` is fp32 beside bf16/fp16 ``weight``: it promotes the logits, which the op then forms in
    fp32 (BART's ``final_logits_bias`` buffer under autocast, folded into the head by the ``flce`` backend)."""
    return bias.dtype == torch.float32 and weight.dtype in (torch.bfloat16, torch.float16)


def _autocast_casts_both(input: Tensor, weight: Tensor) -> bool:
    """Whether autocast will give ``input`` (the hidden states, or the bias) and ``weight`` one dtype
    (``_autocast``): it is on for their device and leaves neither in fp64 (hidden states out of an autocast matmul
    are bf16 beside an fp32 head, as F.linear takes them)."""
    return (input.dtype in _FLOATS and weight.dtype in _FLOATS and torch.float64 not in (input.dtype, weight.dtype)
            and autocast_on(input.device.type))


def _autocast(input: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """Under torch.autocast, compute in the autocast dtype as F.linear would (the casts are differentiable,
    so fp32 parameters receive fp32 gradients). fp64 tensors stay fp64, as autocast leaves them."""
    device_type = input.device.type
    if not autocast_on(device_type):
        return input, weight, bias
    dtype = torch.get_autocast_dtype(device_type)
    cast = (lambda t: t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t)
    return cast(input), cast(weight), cast(bias)


def fused_linear_cross_entropy(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    ce_weight: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | Tensor | None = None,
    logit_scale: float = 1.0,
    z_loss: float = 0.0,
    accum_dtype: torch.dtype | None = None,
    config: FLCEConfig | Mapping[str, Any] | None = None,
    return_logits: bool = False,
    precision: str = "exact",
    memory_budget_gb: float | None = None,
    frozen_weight_columns: int = 0,
) -> Tensor | tuple[Tensor, Tensor]:
    """Cross-entropy of ``input @ weight.T + bias`` against ``target`` without materialising the logits.

    Equals ``F.cross_entropy(z.float().view(-1, V), target.view(-1), weight=ce_weight,
    ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)`` with
    ``z = softcap * tanh(s / softcap)`` (or ``s`` without softcap) and ``s = logit_scale * (input @ weight.T + bias)``,
    plus the z-loss ``z_loss * lse**2`` over non-ignored tokens (unweighted; divided by the count of
    non-ignored tokens for "mean"). The loss is fp32 (fp64 for fp64 inputs, which run the "torch" strategy);
    "none" returns a tensor shaped like ``target``. A "mean" over a batch whose targets are all ignored is nan,
    as in torch, and its gradients are exactly 0.

    Args:
        input: (..., H) hidden states. weight: (V, H). target: (...) integer class ids. bias: (V,) or None, in
            the weight's dtype, or fp32 beside bf16/fp16 weights: it then promotes the logits as
            ``F.linear(input, weight) + bias`` does, and the op forms them in fp32 (``FLCEConfig.fp32_logits``;
            such a bias may not require grad, nor come with ``return_logits``). Under autocast it is cast with
            the weight, as F.linear casts it.
        accum_dtype: dtype of the dW accumulator over chunks; torch.float32 (the default, from
            ``precision="exact"``) is as exact as eager, the weight dtype (``precision="compact"``) saves V*H*4
            bytes at some accuracy cost. fp64 weights always accumulate in fp64.
        precision: "exact" (default: errors no larger than eager's), "compact" (accumulators in the weight
            dtype) or "precise" (bf16/fp16: the logits stay fp32 into the CE step and each row's true-class
            gradient rounding is added back, so dX and dW errors are about half of eager's, at the same three
            GEMMs and 3x the chunk buffer; see ``plan.precision``). It wins over a config's ``fp32_logits``.
        memory_budget_gb: the most the op may use above its inputs and gradients (GiB, by its memory bound): the
            config is the first that fits, from the usual one with smaller chunks to the "recompute" strategy
            (four GEMMs, no V x H buffer); an error says when nothing fits.
        softcap: a cap > 0; None or inf for none; or a 0-dim floating CPU tensor, read at run time (as
            Dynamo passes a Python float it leaves symbolic: the ``flce`` backend's graphs under
            ``dynamic=True``), whose cap is |value| (``c * tanh(s / c)`` for any c != 0); a value 0, inf or nan
            is an error there. logit_scale: a constant (a tensor that requires grad is an error: it would get no
            gradient). z_loss: >= 0.
        config: force an execution config: an ``FLCEConfig`` fixes every field; a dict (or JSON object) fixes
            only its keys, e.g. ``{"chunk_tokens": 1024}``, and the tuning database / heuristic picks the rest
            from the real token count at run time, as it does for everything when None.
        return_logits: also return the raw logits ``input @ weight.T + bias`` (shape (..., V), in the compute
            dtype), exact, as ``(loss, logits)``. They are written as the chunks are computed, so this costs the
            logits' memory and nothing else; a gradient that reaches them (an extra loss on the logits) is
            added to the inputs' gradients. "mean" and "sum" only.
        frozen_weight_columns: the weight's leading columns that are frozen: their gradient is zero and is not
            computed (the dW GEMM reads only the other columns of ``input``). For a weight that concatenates a
            frozen matrix and a trainable one, ``[W, B]`` with ``input = [x, u]``: a low-rank adapter on the
            lm_head, which the ``flce`` backend folds so (W frozen, as peft freezes it). 0 (default): every column.
    """
    shortcut = None
    # Dynamo traces the full path: one op node in the user's graph. (The eager shortcut's replayed backward hands
    # out dW as the graph wrote it: a call with frozen columns, whose dW the op's backward pads, takes the full path.)
    if not torch.compiler.is_compiling() and type(frozen_weight_columns) is int and frozen_weight_columns == 0:
        options = (ignore_index, reduction, label_smoothing, softcap, logit_scale, z_loss, accum_dtype, config,
                   return_logits, precision, memory_budget_gb)
        loss = eager_shortcut.replay_recent(input, weight, target, bias, ce_weight, options)
        if loss is not None:
            return loss
        shortcut = eager_shortcut.key_of(input, weight, target, bias, ce_weight, options)
        loss = eager_shortcut.replay(shortcut, input, weight, target)
        if loss is not None:
            return loss
    if not (type(input) in _PLAIN and type(weight) in _PLAIN and type(target) in _PLAIN and type(bias) in _PLAIN
            and type(ce_weight) in _PLAIN):  # (checked in one line: this runs on every call)
        refuse_dtensors(input=input, weight=weight, target=target, bias=bias, ce_weight=ce_weight)
    _validate(input, weight, target, bias, ce_weight, reduction, label_smoothing, softcap)
    _validate_scalars(ignore_index, logit_scale, z_loss)
    if type(frozen_weight_columns) is not int or frozen_weight_columns:  # (0, the usual case, asks nothing more)
        _check_frozen_columns(frozen_weight_columns, weight.shape[1])
    if return_logits is not False and return_logits is not True:
        if isinstance(return_logits, (str, bytes)) or return_logits not in (True, False):  # (np.bool_, 0 and 1 are)
            raise TypeError(f"return_logits must be True or False, got {type(return_logits).__name__} "
                            f"{return_logits!r}")
        return_logits = bool(return_logits)
    if return_logits and reduction == "none":
        raise ValueError(
            "return_logits=True needs reduction 'mean' or 'sum'; for per-token losses with logits, compute "
            "F.cross_entropy(logits.float().flatten(0, -2), target.flatten(), reduction='none') on the logits"
        )
    input, weight, bias = _autocast(input, weight, bias)
    # An fp32 bias beside 16-bit weights promotes the logits, as ``F.linear(input, weight) + bias`` does: the op
    # adds it to fp32 logits (``forced_by`` forces ``FLCEConfig.fp32_logits``, whatever the precision policy).
    wide = bias is not None and _wide_bias(bias, weight)
    if wide and torch.is_grad_enabled() and bias.requires_grad:
        raise ValueError(
            f"an fp32 bias beside {weight.dtype} weights that requires grad is not supported: its gradient would "
            f"sum {weight.dtype} logit gradients, where eager's sums fp32 ones. Pass bias.detach() for a fixed "
            f"bias, or a bias in {weight.dtype}")
    if wide and return_logits:
        raise ValueError(
            f"return_logits=True with an fp32 bias beside {weight.dtype} weights is not supported: the op returns "
            f"logits in {weight.dtype}, where the bias promotes them to fp32. Compute them as "
            "F.linear(input, weight) + bias, or pass a bias in the weight's dtype")
    fast_config = memory_budget_gb is None and check_precision(precision) != "precise" and not wide
    if fast_config:  # the memoised argument: nothing is laid over the caller's fields
        config_text = config_arg(config)
    else:
        forced = forced_by(precision, config_overrides(config), wide)
    accum_dtype = accum_dtype_for(precision, accum_dtype, weight.dtype)
    grad_on = torch.is_grad_enabled()
    hidden = weight.shape[1]
    # Already 2-D / 1-D: no reshape, whose view would add a node to every backward.
    x2d = input if input.dim() == 2 else input.reshape(target.numel(), hidden)  # not -1: ambiguous for hidden 0
    if not x2d.is_contiguous():
        x2d = x2d.contiguous()
    t1d = target if target.dim() == 1 else target.reshape(-1)
    if t1d.dtype != torch.int64:
        t1d = t1d.long()
    cw = ce_weight.to(math_dtype(weight.dtype)).contiguous() if ce_weight is not None else None
    params, params_text = _params_arg(ignore_index, reduction, label_smoothing, softcap, logit_scale, z_loss,
                                      frozen_weight_columns)
    if memory_budget_gb is not None:
        # An eager call counts the copies it makes of a non-contiguous input or weight against the budget. (In a
        # compiled graph the copies are the graph's, made before the op and sized by it as any other op's; an
        # explain() of the graph asks the op's budget alone.)
        copied = 0 if torch.compiler.is_compiling() else (
            (0 if input.is_contiguous() else input.numel() * input.element_size())
            + (0 if weight.is_contiguous() else weight.numel() * weight.element_size()))
        forced = _budget_config(forced, memory_budget_gb, x2d, weight, bias, accum_dtype, params, grad_on, copied)
    if not fast_config:
        config_text = _forced_text(forced)
    loss, logits = call_fused(
        return_logits,
        x2d,
        weight.contiguous(),
        t1d.contiguous(),
        bias.contiguous() if bias is not None else None,
        cw,
        params_text,
        accum_dtype,
        grad_on and _needs_grad(input),
        grad_on and _needs_grad(weight),
        grad_on and bias is not None and _needs_grad(bias),
        config_text,
        *((softcap,) if isinstance(softcap, Tensor) else ()),  # read at run time (``op.runtime_params``)
    )
    if return_logits:
        return loss, logits.view(*input.shape[:-1], weight.shape[0])
    if reduction == "none":
        return loss.view(target.shape)
    if shortcut is not None:  # (never under Dynamo: tracing it would only add guards to the user's graph)
        eager_shortcut.remember(shortcut, input, weight, ignore_index)
    return loss


#: Entries each memo of this module keeps before it starts afresh.
_MEMO_SIZE = 256
#: ``_params_arg``'s answers by the options' values and types.
_PARAMS_ARGS: dict[tuple[Any, ...], tuple[LossParams, str]] = {}
_PLAIN_OPTION_TYPES = (int, float, str, type(None))


def _params_arg(ignore_index: int, reduction: str, label_smoothing: float, softcap: float | Tensor | None,
                logit_scale: float | Tensor, z_loss: float, frozen_weight_columns: int = 0) -> tuple[LossParams, str]:
    """The loss options (already validated) as ``LossParams`` and as the op's ``params`` string.

    Memoised on the options' values and types when they are plain Python numbers and strings (not a tensor
    scale, whose value can change in place, and not while Dynamo traces): building and encoding them costs
    ~10 us per call on the H200's host, for options that are the same in every call of a training run."""
    options = (ignore_index, reduction, label_smoothing, softcap, logit_scale, z_loss, frozen_weight_columns)
    key = None
    if not torch.compiler.is_compiling() and all(type(o) in _PLAIN_OPTION_TYPES for o in options):
        key = tuple((type(o), o) for o in options)
        hit = _PARAMS_ARGS.get(key)
        if hit is not None:
            return hit
    params = LossParams(int(ignore_index), reduction, float(label_smoothing), _softcap_arg(softcap),
                        float(logit_scale), float(z_loss), operator.index(frozen_weight_columns))
    answer = (params, encode_params(params))
    if key is not None:
        if len(_PARAMS_ARGS) >= _MEMO_SIZE:
            _PARAMS_ARGS.clear()
        _PARAMS_ARGS[key] = answer
    return answer


#: ``config_arg``'s answers by ``_config_key``.
_CONFIG_ARGS: dict[tuple[Any, ...], str] = {}


def config_arg(config: FLCEConfig | Mapping[str, Any] | str | None) -> str:
    """The op's ``config`` argument for a caller's ``config``: the JSON of the fields it forces, validated
    (``config_overrides``), "" for none.

    Memoised by value (``_config_key``): validating a dict builds two FLCEConfigs and encoding it is a
    ``json.dumps``, about 30 us per call on the CPU, for an argument that is the same in every call of a
    training run. A config that fails validation raises every time (nothing is stored). Not memoised while
    Dynamo traces: there a global cache would be traced too, and the trace runs once anyway.
    """
    if config is None:
        return ""
    if torch.compiler.is_compiling():
        return _config_text_while_tracing(config)
    key = _config_key(config)
    if key is not None:
        hit = _CONFIG_ARGS.get(key)
        if hit is not None:
            return hit
    text = _checked_config_text(config)
    if key is not None:
        if len(_CONFIG_ARGS) >= _MEMO_SIZE:
            _CONFIG_ARGS.clear()
        _CONFIG_ARGS[key] = text
    return text


#: FLCEConfig's field names, for reading one without ``dataclasses.asdict`` (which Dynamo cannot trace).
_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(FLCEConfig))
_DEFAULT_CONFIG = FLCEConfig()


def _config_text_while_tracing(config: FLCEConfig | Mapping[str, Any] | str) -> str:
    """``config_arg`` while Dynamo traces the caller: the same JSON, built by plain Python that Dynamo follows.
    ``config_overrides``' validation (``dataclasses.asdict``) and ``json.dumps`` would break the user's graph at
    the call. A dict is validated here by FLCEConfig's own checks, which Dynamo follows (a bad one raises, with
    the eager call's message). A JSON string goes to the op as it is (its parsing cannot be traced): the op
    validates it when the graph is traced, so a bad one raises inside Dynamo's TorchRuntimeError, with the
    eager message. A config whose ints change between calls, which Dynamo makes symbolic, traces whole too: each
    value becomes a constant of its graph (``_constant_int``)."""
    if isinstance(config, str):
        return config
    if type(config) is FLCEConfig:  # a subclass may carry fields of its own, which the usual path refuses
        items = _fields_of(config)
    elif isinstance(config, Mapping):
        items = dict(config)
        if any(name not in _CONFIG_FIELDS for name in items):
            return _checked_config_text(items)  # the ValueError that lists the valid keys
        FLCEConfig(**{**_fields_of(_DEFAULT_CONFIG), **items})  # validate
    else:
        return _checked_config_text(config)
    return _forced_text(items)


def _fields_of(config: FLCEConfig) -> dict[str, Any]:
    """``config.to_dict()`` as Dynamo can trace it."""
    return {name: getattr(config, name) for name in _CONFIG_FIELDS}


def _checked_config_text(config: Any) -> str:
    """``config_arg``'s text the usual way, validated: eagerly, and while tracing (Dynamo breaks the graph here)
    for an FLCEConfig subclass, a ``config`` that is no config (the TypeError names the accepted types) or a dict
    with unknown keys (the ValueError lists the valid ones)."""
    forced = config_overrides(config)
    return json.dumps(forced, sort_keys=True) if forced else ""


def _forced_text(forced: Mapping[str, Any] | None) -> str:
    """The op's ``config`` text of the fields ``forced`` (already validated): ``json.dumps``, or while Dynamo
    traces the caller the same text by plain Python (``json.dumps`` would break the user's graph)."""
    if not forced:
        return ""
    if torch.compiler.is_compiling():
        return "{" + ", ".join([_json_pair(name, forced[name]) for name in sorted(forced)]) + "}"
    return json.dumps(forced, sort_keys=True)


def _json_pair(name: Any, value: Any) -> str:
    """``"name": value`` as ``json.dumps`` writes it, for the value types a config holds; anything else goes
    through json (a graph break, but the same text)."""
    if type(name) is not str or '"' in name or "\\" in name:
        return json.dumps({name: value})[1:-1]
    if value is True or value is False:
        text = "true" if value else "false"
    elif type(value) is int:
        text = str(_constant_int(value))
    elif type(value) is str and '"' not in value and "\\" not in value and value.isprintable():
        text = '"' + value + '"'
    elif value is None:
        text = "null"
    else:
        text = json.dumps(value)
    return '"' + name + '": ' + text


def _constant_int(value: int) -> int:
    """``value`` as a constant of the trace: under Dynamo an int that a compiled function received may be symbolic
    (a config passed as an argument, after a call with another chunk_tokens), and ``str`` of it cannot be traced
    (fullgraph=True raised). The length of a range of it makes Dynamo specialize it, without allocating anything:
    the op's config is a constant, and a new value compiles again. Outside a compile, the int itself."""
    if not torch.compiler.is_compiling():
        return value
    return len(range(value)) if value >= 0 else -len(range(-value))


def _config_key(config: Any) -> tuple[Any, ...] | None:
    """A hashable key that equals another only for configs that validate and encode alike, or None (not
    memoised). Values carry their type: ``{"streams": 1}`` (an error) must not hit ``{"streams": True}``, which
    equals it in Python."""
    if isinstance(config, (FLCEConfig, str)):
        return (type(config), config)
    if not isinstance(config, Mapping):
        return None
    try:
        key = tuple(sorted((name, type(value), value) for name, value in config.items()))
        hash(key)
    except TypeError:  # an unhashable value, or keys that do not sort: validation will say what is wrong
        return None
    return (dict, key)


def _budget_config(forced: dict[str, Any] | None, budget_gb: float, x2d: Tensor, weight: Tensor,
                   bias: Tensor | None, accum_dtype: torch.dtype, params: LossParams, grad_on: bool,
                   copied_bytes: int = 0) -> dict[str, Any]:
    """Every field of the config that fits ``budget_gb`` (``config_within_budget``), chosen now and forced: under
    torch.compile this runs while tracing, with the traced token count, so the loop (gradients in forward or, for
    "recompute", in backward) is fixed in the graph, and only a config's numbers could change with the token
    count. ``copied_bytes``: the contiguous copies made of a non-contiguous input or weight, which the op's bound
    (above its inputs) does not hold and the budget must."""
    vocab, hidden = weight.shape
    budget_bytes(budget_gb)  # a bad budget is named as given
    copies = (f"memory_budget_gb={budget_gb:g}: {copied_bytes / 2**30:.4g} GiB of it go to the contiguous copies of "
              "a non-contiguous input or weight (pass contiguous tensors to spare them)")
    left_gb = budget_gb - copied_bytes / 2**30
    if left_gb <= 0:
        raise BudgetError(f"{copies}, which leaves nothing for the op; raise the budget")
    try:
        config, _source = config_within_budget(
            forced, left_gb, _size_hint(x2d.shape[0]), vocab, hidden, weight.dtype, weight.device, accum_dtype,
            need_dx=grad_on and _needs_grad(x2d), need_dw=grad_on and _needs_grad(weight),
            need_db=grad_on and bias is not None and _needs_grad(bias), softcap=bool(params.softcap),
            frozen_columns=params.frozen_weight_columns)
    except BudgetError as exc:
        if not copied_bytes:
            raise
        rest = str(exc).split(": ", 1)[-1]  # (its budget is what the copies left)
        raise BudgetError(f"{copies}; in the {left_gb:.4g} GiB left, {rest}") from None
    return config.to_dict()


def _needs_grad(t: Tensor) -> bool:
    """``t.requires_grad``, seen through functorch's wrappers: a tensor batched by ``torch.func.vmap`` reads False
    even where the tensor it wraps requires grad, and the op, run per batch entry under autograd, must still form
    that gradient (an empty one failed backward). While Dynamo traces, ``t.requires_grad`` itself: it cannot trace
    the wrapper checks (a graph break for every frozen weight), so a compiled vmap forms no such gradient and its
    backward says so (``op._no_gradient_formed``)."""
    if t.requires_grad or torch.compiler.is_compiling():
        return t.requires_grad
    while _is_functorch_wrapped(t):
        t = torch._C._functorch.get_unwrapped(t)
        if t.requires_grad:
            return True
    return False


_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _size_hint(n: Any) -> int:
    """A concrete size: ``n`` itself, or a symbolic size's example value (no guard is added)."""
    if isinstance(n, int):
        return n
    hint = getattr(getattr(n, "node", None), "hint", None)
    return int(hint) if hint is not None else int(n)


def _validate_module_options(options: Mapping[str, Any]) -> None:
    """The checks of ``fused_linear_cross_entropy``'s options that need no batch, with its errors, so that a
    ``FusedLinearCrossEntropyLoss`` with a bad option fails where it is built, not at its first forward."""
    get = options.get
    _validate_loss_options(get("reduction", "mean"), get("label_smoothing", 0.0), get("softcap"))
    _validate_scalars(get("ignore_index", -100), get("logit_scale", 1.0), get("z_loss", 0.0))
    _check_frozen_columns(get("frozen_weight_columns", 0))
    precision = check_precision(get("precision", "exact"))
    accum_dtype = get("accum_dtype")
    if accum_dtype is not None:  # its type, and its agreement with precision; the weight's dtype is checked per call
        accum_dtype_for(precision, accum_dtype, accum_dtype)
    config_overrides(get("config"))
    if get("memory_budget_gb") is not None:
        budget_bytes(get("memory_budget_gb"))
    ce_weight = get("ce_weight")
    if ce_weight is not None and (not isinstance(ce_weight, Tensor) or ce_weight.dim() != 1
                                  or not ce_weight.is_floating_point()):
        raise ValueError("ce_weight must be a 1-D floating tensor (a weight per class) or None")


class FusedLinearCrossEntropyLoss(nn.Module):
    """Module form of :func:`fused_linear_cross_entropy`: options at construction, tensors at call."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        # Validate option names now rather than on the first batch.
        allowed = {f.name for f in dataclasses.fields(LossParams)} | {"ce_weight", "accum_dtype", "config",
                                                                       "precision", "memory_budget_gb"}
        unknown = set(options) - allowed
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}; valid options are {sorted(allowed)}")
        _validate_module_options(options)
        ce_weight = options.pop("ce_weight", None)
        self.register_buffer("ce_weight", ce_weight)  # saved with the module, as nn.CrossEntropyLoss's weight
        self.options = options

    def forward(self, input: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None) -> Tensor:
        return fused_linear_cross_entropy(input, weight, target, bias, ce_weight=self.ce_weight, **self.options)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        # Checkpoints from before ce_weight was saved lack it: keep the constructor's, rather than fail strict loads.
        key = prefix + "ce_weight"
        if self.ce_weight is not None and key not in state_dict:
            state_dict = {**state_dict, key: self.ce_weight}
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())
