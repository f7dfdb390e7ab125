"""The strategy registry: every way the fused op can run the cross-entropy step of a chunk, one entry each.

A strategy is one module (its CE step, in ``flce_compile.strategies``) plus one ``Strategy`` entry here. Every
consumer reads the entry rather than a list of its own: config validation (``FLCEConfig.strategy``), the chunk
loop and the kept-logits loss (the step function), the memory bound (the step's fp32 temporaries), the
heuristic (which strategy a device and dtype get by default), the tuner's search space (the fields it samples
and the legality rules that prune them) and ``flce-tune --strategies``.

Nothing here imports the step modules: ``Strategy.step`` imports its function on first use, so registering or
listing strategies never loads Triton.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

#: A CE step: ``step(args: CEStepArgs, p: LossParams, config: FLCEConfig) -> None`` (see
#: ``strategies.ce_common.CEStepArgs`` for the contract).
CEStep = Callable[..., None]
#: An ``FLCEConfig``. Not imported: ``config`` validates strategy names against this module.
Config = Any


def _no_rules(config: Config, vocab: int) -> str | None:  # noqa: ARG001 - the Strategy.check signature
    return None


@dataclass(frozen=True)
class Strategy:
    """One registry entry."""

    name: str
    #: One line for ``--help`` and error messages.
    summary: str
    #: The FLCEConfig fields the strategy reads besides ``strategy``. The tuner samples these and no others
    #: (the rest take the base config's values), so two configs that run identically compare equal.
    params: tuple[str, ...]
    #: The CE step as "module:function", imported on first use.
    ce_step: str
    #: Chunk-sized fp32 buffers the CE step holds at its peak, given whether a softcap is on: the strategy's term
    #: (``k32``) in the memory bound.
    fp32_temporaries: Callable[[bool], int]
    #: Why ``config`` must not run for a vocabulary of ``vocab`` (the tuner prunes it), or None.
    check: Callable[[Config, int], str | None] = _no_rules
    #: Device types the heuristic picks this strategy for, most specific first: a strategy that names the
    #: device wins over one that runs anywhere ("*"). Empty: only when a config names it.
    devices: tuple[str, ...] = ("*",)
    #: Whether fp64 inputs are computed in fp64 (the Triton kernel computes in fp32: it does not).
    float64: bool = True
    #: The loop that runs the step: "chunked" (token chunks; the gradients are formed in forward, three GEMMs,
    #: an fp32 V x H dW accumulator) or "recompute" (forward keeps each token's lse; backward recomputes the
    #: logits by vocabulary block, four GEMMs, no V x H buffer). Each loop has its own memory bound.
    loop: str = "chunked"
    #: Whether its CE step is the Triton kernel on every device, with no torch fallback: then it runs on a CUDA
    #: GPU only, or anywhere under TRITON_INTERPRET=1 (Triton's interpreter: the CPU tests).
    triton_only: bool = False
    #: For a CE step that is the Triton kernel where ``kernel_step_runs`` and torch ops elsewhere (the CPU, fp64):
    #: the torch ops' chunk-sized fp32 buffers, given a softcap (``fp32_temporaries`` then counts the kernel's).
    #: None: the step is the same everywhere.
    fallback_fp32_temporaries: Callable[[bool], int] | None = None
    #: For a CE step that is torch ops (``ce_torch``) off CUDA: its chunk-sized fp32 buffers there, given a
    #: softcap, for fp32 inputs, whose logits already are the math dtype (the step works in the chunk itself).
    #: None: counted as for any dtype. (On CUDA the bound keeps the general count: not measured there.)
    fp32_input_temporaries: Callable[[bool], int] | None = None

    def runs_on(self, device_type: str) -> bool:
        """Whether the CE step can run on ``device_type``."""
        return not self.triton_only or device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"

    def step(self) -> CEStep:
        """The CE step function (its module is imported now, at the first call, not at registration)."""
        module, _, function = self.ce_step.partition(":")
        return getattr(importlib.import_module(module), function)

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype != torch.float64 or self.float64

    def works_in_fp32_chunk(self, device_type: str, dtype: torch.dtype,
                            accum_dtype: torch.dtype = torch.float32) -> bool:
        """Whether ``fp32_input_temporaries`` counts its CE step on ``device_type`` with ``dtype`` inputs: torch
        ops (off CUDA no step is the kernel) over fp32 logits, with dW summed in fp32 (the only ``accum_dtype``
        the op takes for fp32 weights: another one, which only a direct ``peak_bytes`` call names, would cast
        each dW product's operands, counted as for other dtypes)."""
        return (self.fp32_input_temporaries is not None and dtype == torch.float32 and device_type != "cuda"
                and accum_dtype == torch.float32)

    def temporaries(self, softcap: bool, device_type: str, dtype: torch.dtype,
                    accum_dtype: torch.dtype = torch.float32) -> int:
        """The chunk-sized fp32 buffers its CE step holds on ``device_type`` with ``dtype`` inputs (dW summed in
        ``accum_dtype``): the memory bound's ``k32``."""
        if self.works_in_fp32_chunk(device_type, dtype, accum_dtype):
            return self.fp32_input_temporaries(softcap)
        if self.fallback_fp32_temporaries is not None and not kernel_step_runs(device_type, dtype):
            return self.fallback_fp32_temporaries(softcap)
        return self.fp32_temporaries(softcap)


def kernel_step_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether a CE step with a torch fallback runs the Triton kernel: on a CUDA device, for inputs other than
    fp64 (which the kernel would compute in fp32)."""
    return device_type == "cuda" and dtype != torch.float64


# -- the built-in strategies --------------------------------------------------------------------------------

#: The CE kernel holds block_v / (32 * num_warps) values per thread; more than this spills registers.
MAX_ELEMENTS_PER_THREAD = 128


def next_pow2(n: int) -> int:
    """The least power of two >= ``n`` (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _torch_fp32_temporaries(softcap: bool) -> int:
    """z (then p, then g) and, with a softcap, tanh(z) for the derivative; plus one for the weighted-sum or
    upcast dW operand. A bound: on an fp32 chunk the step may overwrite, z is the chunk itself
    (``_torch_fp32_input_temporaries``)."""
    return 3 if softcap else 2


def _torch_fp32_input_temporaries(softcap: bool) -> int:
    """The torch step over fp32 inputs' logits (``ce_torch._work_buffer``): z is the loop's own chunk buffer,
    which the step overwrites with the gradient, or, where the loop has none (kept logits without gradients), the
    one copy the bound counts as that buffer; with a softcap one more, softcap * tanh(z) beside tanh(z). No
    upcast dW operand: fp32 inputs accumulate dW in fp32 (``precision.accum_dtype_for``). The general count (2,
    or 3) put the CPU bound of fp32 calls at 2.0-3.5x their measured peak, the recompute strategy's up to 7.9x."""
    return 1 if softcap else 0


def _kernel_fp32_temporaries(softcap: bool) -> int:  # noqa: ARG001
    return 0  # the kernel keeps its fp32 values in registers


def _kernel_launch_rules(config: Config, vocab: int) -> str | None:
    """The CE kernel's block and launch parameters that cannot run well for ``vocab``."""
    if config.block_v > max(32, next_pow2(vocab)):  # (32: one warp's threads, the least block below)
        return f"block_v={config.block_v} > vocab={vocab}"
    threads = 32 * config.num_warps
    if config.block_v < threads:
        return f"block_v={config.block_v} < {threads} threads (num_warps={config.num_warps})"
    if config.block_v // threads > MAX_ELEMENTS_PER_THREAD:
        return (f"block_v={config.block_v} with num_warps={config.num_warps} holds "
                f"{config.block_v // threads} values per thread (> {MAX_ELEMENTS_PER_THREAD}, spills)")
    return None


_CHUNK_FIELDS = ("chunk_tokens", "dw_path", "streams", "pad_vocab")

_REGISTRY: dict[str, Strategy] = {}
_generation = 0


def register(strategy: Strategy) -> Strategy:
    """Add ``strategy``; its name must be new. Returns it."""
    global _generation
    if strategy.name in _REGISTRY:
        raise ValueError(f"strategy {strategy.name!r} is already registered")
    _REGISTRY[strategy.name] = strategy
    _generation += 1
    return strategy


def unregister(name: str) -> None:
    """Remove a strategy (a test that registered a toy one)."""
    global _generation
    del _REGISTRY[name]
    _generation += 1


def generation() -> int:
    """A number that changes whenever the registry does: part of the keys of memoised choices."""
    return _generation


def is_registered(name: object) -> bool:
    return isinstance(name, str) and name in _REGISTRY


def get(name: str) -> Strategy:
    """The entry of ``name``; an unknown name is an error that lists the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"strategy {name!r} is unknown; use one of {names()}") from None


def names() -> tuple[str, ...]:
    """The registered strategy names, in registration order."""
    return tuple(_REGISTRY)


def default_for(device_type: str, dtype: torch.dtype) -> Strategy:
    """The strategy the heuristic runs on ``device_type`` for ``dtype``: the first registered one that names
    the device, else the first that runs anywhere, among those that support the dtype."""
    fitting = [s for s in _REGISTRY.values() if s.supports(dtype)]
    for strategy in fitting:
        if device_type in strategy.devices:
            return strategy
    for strategy in fitting:
        if "*" in strategy.devices:
            return strategy
    raise ValueError(f"no registered strategy runs {dtype} on {device_type!r} (registered: {names()})")


register(Strategy(
    name="torch",
    summary="chunked GEMMs, the CE part in torch ops (any device; the CPU default)",
    params=_CHUNK_FIELDS,
    ce_step="flce_compile.strategies.ce_torch:ce_step_torch",
    fp32_temporaries=_torch_fp32_temporaries,
    fp32_input_temporaries=_torch_fp32_input_temporaries,
))
register(Strategy(
    name="triton",
    summary="chunked cuBLAS GEMMs, the CE part in one Triton kernel per chunk (the GPU default)",
    params=("chunk_tokens", "block_v", "num_warps", "num_stages", "dw_path", "streams", "pad_vocab"),
    ce_step="flce_compile.strategies.ce_triton:ce_step_triton",
    fp32_temporaries=_kernel_fp32_temporaries,
    check=_kernel_launch_rules,
    devices=("cuda",),
    float64=False,
    triton_only=True,
))
register(Strategy(
    name="recompute",
    summary="the checkpointed LM head: forward keeps each token's lse, backward recomputes the logits by "
            "vocabulary block (four GEMMs, no V x H fp32 buffer; the least memory)",
    params=("chunk_tokens", "vocab_block", "block_v", "num_warps", "num_stages"),
    ce_step="flce_compile.strategies.recompute:ce_step",
    # The Triton kernel on a GPU; the torch step on the CPU and for fp64 (``recompute.ce_step``).
    fp32_temporaries=_kernel_fp32_temporaries,
    fallback_fp32_temporaries=_torch_fp32_temporaries,
    fp32_input_temporaries=_torch_fp32_input_temporaries,
    check=_kernel_launch_rules,
    devices=(),  # never the heuristic's default: a config or a memory budget asks for it
    loop="recompute",
))
