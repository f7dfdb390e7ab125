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

The values must be those of the forward that returned them, so the logits are computed before anything can change
what they are read from:

* when backward reaches the compiled graph that returned them (a caller holding the outputs through backward:
  ``out = model(...); out.loss.backward()``), before an optimizer step or FSDP's resharding can change or free
  the weight;
* any other write to the hidden states, weight or bias in place (their version counters), or a weight whose memory
  was moved or freed, makes reading not-yet-computed logits an error that says so, never wrong values.

``flce.logits="materialize"`` computes them in the graph instead (a plain tensor at once, as before).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._pytree import tree_map

#: The steps from the raw logits to one returned output, as a callable of the raw logits.
Replay = Callable[[Tensor], Tensor]


class _Source:
    """What a LazyLogits is computed from: the lm_head's operands, with what they held when the forward returned
    them (version counters, the weight's memory), and the steps to the returned output."""

    __slots__ = ("x", "weight", "bias", "replay", "dtype", "versions", "weight_memory")

    def __init__(self, x: Tensor, weight: Tensor, bias: Tensor | None, replay: Replay, dtype: torch.dtype) -> None:
        self.x, self.weight, self.bias, self.replay, self.dtype = x, weight, bias, replay, dtype
        self.versions = tuple(t._version for t in self.operands())
        self.weight_memory = _memory(weight)

    def operands(self) -> tuple[Tensor, ...]:
        return (self.x, self.weight) if self.bias is None else (self.x, self.weight, self.bias)

    def check(self) -> None:
        """Raise when an operand changed since the forward, so the logits can no longer be computed."""
        changed = [name for name, t, v in zip(("hidden states", "weight", "bias"), self.operands(), self.versions)
                   if t._version != v]
        if _memory(self.weight) != self.weight_memory:
            changed.append("weight's memory (moved or freed, e.g. resharded by FSDP)")
        if changed:
            raise RuntimeError(
                "flce: these logits are computed when first read, from the lm_head's operands as the forward left "
                f"them, but the lm_head's {', '.join(changed)} changed in place since then (and backward, which "
                "computes them first, had not run). Read the logits before changing those tensors, or compile "
                "with options={'flce.logits': 'materialize'} to compute them in the forward.")

    def logits(self) -> Tensor:
        """The raw logits, as the graph's lm_head computed them (in its dtype, as under autocast)."""
        dt = self.dtype
        bias = None if self.bias is None else self.bias.to(dt)
        return F.linear(self.x.to(dt), self.weight.to(dt), bias)

    def value(self) -> Tensor:
        self.check()
        with torch.no_grad():
            return self.replay(self.logits())


def _memory(t: Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class LazyLogits(Tensor):
    """A logits output whose values are computed by the first operator that reads them (see the module
    docstring). Every operator on it returns plain tensors; writes in place go to the computed values."""

    # Plain tensors out of every function (the default would wrap results in this class, without a source).
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, source: _Source | None, like: Tensor, value: Tensor | None = None) -> LazyLogits:
        return Tensor._make_wrapper_subclass(cls, like.shape, strides=like.stride(), dtype=like.dtype,
                                             device=value.device if value is not None else source.x.device)

    def __init__(self, source: _Source | None, like: Tensor, value: Tensor | None = None) -> None:
        super().__init__()
        self._source, self._value = source, value

    @property
    def computed(self) -> bool:
        """Whether the values have been computed (they then live as long as this tensor)."""
        return self._value is not None

    def compute(self) -> Tensor:
        """The values (a plain tensor without autograd history), computed now if they were not yet."""
        if self._value is None:
            self._value = self._source.value()
            self._source = None  # the operands are free to go (autograd keeps what backward needs)
        return self._value

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        def unwrap(t: Any) -> Any:
            return t.compute() if isinstance(t, LazyLogits) else t

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

    # torch.compile of a function given these logits: Dynamo traces them as their computed values.
    def __tensor_flatten__(self) -> tuple[list[str], None]:
        self.compute()
        return ["_value"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Tensor], ctx: Any, outer_size: Any, outer_stride: Any) -> LazyLogits:
        value = inner["_value"]
        return LazyLogits(None, value, value)

    # Reads that bypass the dispatcher (numpy, lists, pickling, copies) get the computed values. (Its storage is
    # not the values': torch's own code asks a wrapper's storage, and must see that it has none.)
    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"LazyLogits({self.compute()!r})"

    def __reduce_ex__(self, protocol: int) -> Any:
        return self.compute().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> Tensor:
        return self.compute().clone()

    def tolist(self) -> Any:
        return self.compute().tolist()

    def numpy(self, *, force: bool = False) -> Any:
        return self.compute().numpy(force=force)

    def __array__(self, dtype: Any = None) -> Any:
        return self.compute().__array__(dtype)


class _LazyHead(torch.autograd.Function):
    """A LazyLogits with the lm_head's backward: a gradient into the logits reaches x, W and b as through the
    unfused graph (the logits recomputed with autograd through the same steps)."""

    @staticmethod
    def forward(ctx, x, weight, bias, source, like):  # noqa: D401 - autograd API
        ctx.source = source
        ctx.save_for_backward(x, weight, bias)  # autograd's own check refuses them if written in place since
        return LazyLogits(source, like)

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        source = ctx.source
        need = ctx.needs_input_grad[:3]
        inputs = [t.detach().requires_grad_(n) if t is not None else None for t, n in zip((x, weight, bias), need)]
        with torch.enable_grad():
            dt = source.dtype
            b = None if inputs[2] is None else inputs[2].to(dt)
            out = source.replay(F.linear(inputs[0].to(dt), inputs[1].to(dt), b))
        wanted = [t for t, n in zip(inputs, need) if n and t is not None]
        grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return tuple(next(grads) if n and t is not None else None for t, n in zip(inputs, need)) + (None, None)


def lazy_logits(x: Tensor, weight: Tensor, bias: Tensor | None, replay: Replay, dtype: torch.dtype,
                like: Tensor) -> LazyLogits:
    """The LazyLogits standing for ``replay(F.linear(x, weight, bias))`` in ``dtype``; ``like`` (a meta tensor)
    gives its shape, strides and dtype. With autograd history when grad mode is on and an operand requires grad."""
    source = _Source(x, weight, bias, replay, dtype)
    if torch.is_grad_enabled() and any(t.requires_grad for t in source.operands()):
        return _LazyHead.apply(x, weight, bias, source, like)
    return LazyLogits(source, like)


def compute_before_backward(outputs: list[Any], lazies: list[LazyLogits]) -> None:
    """Compute ``lazies`` (those still alive) when backward reaches the autograd node of the compiled graph's
    ``outputs``, before an optimizer step or FSDP's resharding can change the operands they are computed from."""
    node = next((t.grad_fn for t in outputs if isinstance(t, Tensor) and t.grad_fn is not None), None)
    if node is None:
        return
    refs = [weakref.ref(t) for t in lazies]

    def compute_alive(grad_outputs: Any) -> None:
        for ref in refs:
            lazy = ref()
            if lazy is not None and not lazy.computed:
                lazy.compute()

    node.register_prehook(compute_alive)
