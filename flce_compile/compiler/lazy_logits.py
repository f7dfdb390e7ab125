"""Logits a compiled graph returns, computed when first used.

A Hugging Face model returns its logits beside the loss, and most training loops never read them (``loss =
model(...).loss``). Computed in the graph, they would be alive at the end of the forward, where a training step
peaks: 4.2 GB at S = 16384 and V = 128256 in bf16, for nothing. When the graph only returns them (through casts,
reshapes, constant scales, a softcap), the pass fuses the loss as if they were dropped and returns the lm_head's
input, weight and bias instead; the wrapper around the compiled graph hands the caller a ``LazyLogits`` in their
place: a tensor of the logits' shape, dtype and device whose values are ``replay(F.linear(x, W, b))`` (the
graph's own steps from the lm_head to the output), computed by the first operator that reads them and kept from
then on. A caller that never reads them pays for none; one that does gets a plain tensor out of every operator
on them, the values eager computes (the same ``F.linear`` and steps), and gradients through them exactly (the
lm_head's backward, recomputing the logits once: a fourth GEMM, only for a loss on the logits).

The values must be those of the forward that returned them. Before any optimizer's step (a global step pre-hook:
fused optimizers write the weights without telling their version counters), the logits still held and not yet
computed are secured: their weight and bias are copied (``_Source.freeze``; hidden states that are a parameter, or
a view of one, too), or, when the logits are the smaller, computed. Any other write to the hidden states, weight or
bias in place (their version counters), or a weight whose memory was moved or freed (FSDP's resharding after
backward), makes reading not-yet-computed logits an error that says so, never another weight's values. Writes
through ``param.data`` reach no version counter: logits held across such a write must be read before it. (Nothing
runs in backward: a hook on the compiled graph's autograd node breaks compiled autograd's tracing of backward,
torch 2.13.)

They are computed with autocast off (a read inside an autocast region gets the forward's dtype and values).
Under inference mode they are computed at once (inference tensors keep no version counter to check).
A function compiled with torch.compile and given them runs its operators on them outside the graph (Dynamo does
not trace this class: its dispatch and ``compute`` are ``torch.compiler.disable``d, and ``fullgraph=True``
refuses them); any operator's result (``logits.clone()``) is a plain tensor it traces.

``flce.logits="materialize"`` computes them in the graph instead (a plain tensor at once, as before).

A LoRA fold's head (``lora_head``) computes ``F.linear([x, s*u], [W, B])``: its hidden states and weight come as
their pieces (``xs``, ``ws``), joined only when the logits are computed. The graph then returns W and B themselves
rather than the V x (H + r) joined weight, which, as an intermediate, would have had a zero gradient of that size
materialised in every backward.
"""

from __future__ import annotations

import contextlib
import weakref
from copy import deepcopy
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_map

#: The steps from the raw logits to one returned output, as a callable of the raw logits.
Replay = Callable[[Tensor], Tensor]


class StaleLogitsError(RuntimeError):
    """Logits not yet computed whose operands changed since the forward: they can no longer be computed."""


#: Tensors joined along their last dimension (one tensor: itself): the lm_head's hidden states or weight.
Pieces = tuple[Tensor, ...]


class _Source:
    """What a LazyLogits is computed from: the lm_head's operands (the hidden states and weight as their pieces),
    with what they held when the forward returned them (version counters, the weight's memory), and the steps to
    the returned output."""

    __slots__ = ("xs", "ws", "bias", "replay", "dtype", "gemm_dtype", "versions", "weight_memory")

    def __init__(self, xs: Pieces, ws: Pieces, bias: Tensor | None, replay: Replay, dtype: torch.dtype,
                 gemm_dtype: torch.dtype | None = None) -> None:
        self.xs, self.ws, self.bias, self.replay, self.dtype = xs, ws, bias, replay, dtype
        self.gemm_dtype = gemm_dtype
        self.versions = tuple(t._version for t in self.operands())
        self.weight_memory = [_memory(w) for w in ws]

    def operands(self) -> tuple[Tensor, ...]:
        return _operands(self.xs, self.ws, self.bias)

    def names(self) -> list[str]:
        """``operands``' names, for the error."""
        return ["hidden states"] * len(self.xs) + ["weight"] * len(self.ws) + ["bias"] * (self.bias is not None)

    def check(self) -> None:
        """Raise when an operand changed since the forward, so the logits can no longer be computed."""
        written = list(dict.fromkeys(name for name, t, v in zip(self.names(), self.operands(), self.versions)
                                     if t._version != v))
        moved = [_memory(w) for w in self.ws] != self.weight_memory
        if written or moved:
            what = [f"its {' and '.join(written)} {'were' if len(written) > 1 else 'was'} written in place"
                    ] if written else []
            what += ["its weight's memory was moved or freed (e.g. resharded by FSDP)"] if moved else []
            raise StaleLogitsError(
                "flce: these logits are computed when first read, from the lm_head's operands as the forward left "
                f"them, but since then {' and '.join(what)} outside a torch.optim optimizer's step (whose step "
                "pre-hook secures held logits first; a manual update such as `with torch.no_grad(): p.add_(...)` "
                "does not). Read the logits before changing those tensors, or compile with "
                "options={'flce.logits': 'materialize'} to compute them in the forward.")

    def freeze(self, copies: dict[int, Tensor]) -> None:
        """Copy the weight and bias, and the pieces of the hidden states an optimizer may write (``_steppable``),
        so that what the forward read survives an optimizer step (hidden states the graph computed are reached
        only by a write in place, which ``check`` sees). ``copies``: the copies made in this step so far, by the
        id of the tensor copied (held logits of one weight share one). Every weight piece is copied, a frozen one
        too: a view of a parameter (an (H, V) weight's transpose) is no leaf, and a head frozen now may be
        unfrozen before a later step (keeping either by reference gave a fused optimizer's new values, a review
        found)."""
        self.check()

        def copy(t: Tensor) -> Tensor:
            if id(t) not in copies:
                copies[id(t)] = t.detach().clone()
            return copies[id(t)]

        self.xs = tuple(copy(x) if _steppable(x) else x for x in self.xs)
        self.ws = tuple(copy(w) for w in self.ws)
        self.bias = copy(self.bias) if self.bias is not None else None
        self.versions = tuple(t._version for t in self.operands())
        self.weight_memory = [_memory(w) for w in self.ws]

    def frozen_numel(self) -> int:
        """The elements ``freeze`` copies (the bias aside)."""
        return sum(t.numel() for t in (*self.ws, *filter(_steppable, self.xs)))

    def value(self) -> Tensor:
        self.check()
        return _values(self.xs, self.ws, self.bias, self.replay, self.dtype, self.gemm_dtype)


def _steppable(x: Tensor) -> bool:
    """Whether an optimizer's step may write ``x`` in place unseen: a parameter (learned prompt or query vectors the
    head reads directly) or another leaf that requires grad or holds one (a step writes any tensor with a ``.grad``,
    frozen after backward or not), or a view of one (the graph returns an input's alias as a view of it). Such
    hidden states held by reference read the step's new values (a fused optimizer bumps no version counter).
    Hidden states the graph computed, even without grad (a frozen trunk's), no step writes."""
    base = x if x._base is None else x._base
    return isinstance(base, nn.Parameter) or (base.is_leaf and (base.requires_grad or base.grad is not None))


def _operands(xs: Pieces, ws: Pieces, bias: Tensor | None) -> tuple[Tensor, ...]:
    """The lm_head's tensors, the pieces in order (no bias when it has none)."""
    return (*xs, *ws) if bias is None else (*xs, *ws, bias)


def joined(pieces: Pieces) -> Tensor:
    """The pieces joined along their last dimension (one piece: itself, no copy)."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, -1)


def _values(xs: Pieces, ws: Pieces, bias: Tensor | None, replay: Replay, dtype: torch.dtype,
            gemm_dtype: torch.dtype | None = None) -> Tensor:
    """The returned logits' values, without autograd history, with autocast off (the forward's values), and
    outside inference mode: values first read under ``torch.inference_mode()`` (a metric) stay writable afterwards,
    as eager's logits, made before it, are."""
    with torch.inference_mode(False), torch.no_grad(), _no_autocast(xs[0]):  # (the first enables grad)
        return replay(_head(joined(xs), joined(ws), bias, dtype, gemm_dtype))


def _head(x: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype,
          gemm_dtype: torch.dtype | None = None) -> Tensor:
    """The raw logits, as the graph's lm_head computed them: in its logits dtype (as under autocast). With
    ``gemm_dtype``, the GEMM ran in it and ``bias`` was added to its output, as eager adds it (BART's
    ``final_logits_bias``; an fp32 one on bf16 logits promotes them to ``dtype``)."""
    if gemm_dtype is not None:
        return F.linear(x.to(gemm_dtype), weight.to(gemm_dtype)) + bias
    return F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))


def _no_autocast(t: Tensor) -> contextlib.AbstractContextManager:
    """Autocast off on ``t``'s device: the logits are the forward's, whatever region reads them."""
    return torch.autocast(t.device.type, enabled=False)


def _memory(t: Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class LazyLogits(Tensor):
    """A logits output whose values are computed by the first operator that reads them (see the module
    docstring). Every operator on it returns plain tensors; writes in place go to the computed values."""

    # Plain tensors out of every function (the default would wrap results in this class, without a source).
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, source: _Source, like: Tensor) -> LazyLogits:
        return Tensor._make_wrapper_subclass(cls, like.shape, strides=like.stride(), dtype=like.dtype,
                                             device=source.xs[0].device)

    def __init__(self, source: _Source, like: Tensor) -> None:
        super().__init__()
        self._source, self._value = source, None
        _PENDING[id(self)] = self

    @property
    def computed(self) -> bool:
        """Whether the values have been computed (they then live as long as this tensor)."""
        return self._value is not None

    def secure(self, copies: dict[int, Tensor]) -> None:
        """Make the values survive an optimizer's writes: copy the weight and bias, and hidden states a step may
        write (``_Source.freeze``; ``copies`` shares copies between logits of one weight), or compute the values
        when they take less memory than those copies."""
        source = self._source
        if source is None:
            return
        if self.numel() <= source.frozen_numel():
            self.compute()
            return
        source.freeze(copies)
        _PENDING.pop(id(self), None)

    @torch.compiler.disable
    def compute(self) -> Tensor:
        """The values (a plain tensor without autograd history), computed now if they were not yet. Never traced:
        reached from a function the user compiled (``metric(out.logits)``), Dynamo traced it, guarded on this
        object and recompiled it for every new LazyLogits, up to its recompile limit."""
        if self._value is None:
            self._value = self._source.value()
            self._source = None  # the operands are free to go (autograd keeps what backward needs)
            _PENDING.pop(id(self), None)
        return self._value

    @classmethod
    @torch.compiler.disable  # as ``compute``: Dynamo traced it from the user's compiled function, once per object
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        def unwrap(t: Any) -> Any:
            return t.compute() if isinstance(t, LazyLogits) else t

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

    # Reads that bypass the dispatcher (numpy, lists, pickling, copies) get the computed values. (Its storage is
    # not the values': torch's own code asks a wrapper's storage, and must see that it has none.)
    def __repr__(self, *, tensor_contents: Any = None) -> str:
        grad = f", grad_fn=<{type(self.grad_fn).__name__}>" if self.grad_fn is not None else ""
        return f"LazyLogits({self.compute()!r}{grad})"

    def __reduce_ex__(self, protocol: int) -> Any:
        return self.compute().detach().requires_grad_(self.requires_grad).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> Tensor:
        if self.grad_fn is not None:  # as for any tensor autograd made
            raise RuntimeError("Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
                               "protocol at the moment; LazyLogits.detach() is a plain copyable tensor")
        # Through ``memo``, by the values' storage: views of them copied in the same call stay views of the copy.
        copied = deepcopy(self.compute(), memo).requires_grad_(self.requires_grad)
        for name, attribute in self.__dict__.items():  # a caller's attributes, as Tensor.__deepcopy__ copies them
            if name not in ("_source", "_value"):
                setattr(copied, name, deepcopy(attribute, memo))
        return copied

    def tolist(self) -> Any:
        return self.compute().tolist()

    def numpy(self, *, force: bool = False) -> Any:
        if self.requires_grad and not force:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() "
                               "instead.")
        return self.compute().numpy(force=force)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> Any:
        array = self.compute().__array__(dtype)  # (NumPy 2 passes ``copy``, which Tensor.__array__ does not take)
        return array.copy() if copy else array

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        if self.requires_grad:  # as torch's own, for any tensor that requires grad
            raise BufferError("Can't export tensors that require gradient, use tensor.detach()")
        return self.compute().__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> Any:
        return self.compute().__dlpack_device__()

    def data_ptr(self) -> int:
        return self.compute().data_ptr()

    def share_memory_(self) -> LazyLogits:
        self.compute().share_memory_()
        return self

    def is_shared(self) -> bool:
        return self.compute().is_shared()



#: Logits made and not yet computed or secured, by id: an optimizer's step secures them (``_secure_pending``).
_PENDING: weakref.WeakValueDictionary[int, LazyLogits] = weakref.WeakValueDictionary()
_step_hook: Any = None


@torch.compiler.disable  # under a compiled ``opt.step``, traced, it guarded on each pending object: a recompile a step
def _secure_pending(*_args: Any) -> None:
    """A global optimizer step pre-hook (an optimizer, fused ones included, may write the weights without bumping a
    version counter): every held, not yet computed LazyLogits keeps what its forward read, through a copy of its
    weight and bias or, when the logits are smaller than the weight, computed. One whose operands already changed
    is left to raise when it is read (not in the step); it is no longer pending.

    Never traced by Dynamo: under ``torch.compile(opt.step)`` it runs as a graph break, as it must (it reads
    which logits are held now)."""
    copies: dict[int, Tensor] = {}
    for lazy in list(_PENDING.values()):
        try:
            lazy.secure(copies)
        except StaleLogitsError:
            _PENDING.pop(id(lazy), None)


class _LazyHead(torch.autograd.Function):
    """A LazyLogits with the lm_head's backward: a gradient into the logits reaches the hidden states, the weight
    (each of their pieces) and the bias as through the unfused graph (the logits recomputed with autograd through
    the same steps)."""

    @staticmethod
    def forward(ctx, source, like, *operands):  # noqa: D401 - autograd API
        ctx.source = source
        ctx.save_for_backward(*operands)  # autograd's own check refuses them if written in place since
        return LazyLogits(source, like)

    @staticmethod
    def backward(ctx, grad):
        operands, source = ctx.saved_tensors, ctx.source
        need = ctx.needs_input_grad[2:]
        inputs = [t.detach().requires_grad_(n) for t, n in zip(operands, need)]
        n_x, n_w = len(source.xs), len(source.ws)
        xs, ws, bias = inputs[:n_x], inputs[n_x:n_x + n_w], (inputs[n_x + n_w] if source.bias is not None else None)
        with torch.enable_grad(), _no_autocast(xs[0]):
            out = source.replay(_head(joined(tuple(xs)), joined(tuple(ws)), bias, source.dtype, source.gemm_dtype))
        wanted = [t for t, n in zip(inputs, need) if n]
        grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return (None, None) + tuple(next(grads) if n else None for n in need)


def lazy_logits(xs: Pieces, ws: Pieces, bias: Tensor | None, replay: Replay, dtype: torch.dtype,
                like: Tensor, gemm_dtype: torch.dtype | None = None) -> Tensor:
    """The LazyLogits standing for ``replay(F.linear(x, weight, bias))`` in ``dtype`` (``_head``: with
    ``gemm_dtype``, ``replay(F.linear(x, weight) + bias)``, the GEMM in ``gemm_dtype``), x and weight being the
    pieces ``xs`` and ``ws`` joined along their last dimension; ``like`` (a meta tensor) gives its shape, strides
    and dtype. With autograd history when grad mode is on and an operand requires grad. Under inference mode, the
    logits themselves (computed now). On fake or meta tensors (a compile-time run: DDP's graph splitter runs each
    piece on fake tensors), a tensor shaped as the logits, computed as the graph would, with autograd (such tensors
    hold no memory to read later, nor a version to check)."""
    global _step_hook
    operands = _operands(xs, ws, bias)
    if any(isinstance(t, FakeTensor) or t.device.type == "meta" for t in operands):
        with _no_autocast(xs[0]):
            return replay(_head(joined(xs), joined(ws), bias, dtype, gemm_dtype))
    if torch.is_inference_mode_enabled() or any(t.is_inference() for t in operands):
        return _values(xs, ws, bias, replay, dtype, gemm_dtype)
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(_secure_pending)
    source = _Source(xs, ws, bias, replay, dtype, gemm_dtype)
    if torch.is_grad_enabled() and any(t.requires_grad for t in operands):
        return _LazyHead.apply(source, like, *operands)
    return LazyLogits(source, like)
