"""Keep a checkpointed Hugging Face model in one Dynamo graph when its layers set state in their forward.

transformers 5.25 requires the ``kernels`` package, whose layer hook sets a context variable inside every decoder
layer's forward (``CompileableContextVar.set``: under compile, an attribute of a global object). With gradient
checkpointing that forward runs inside ``torch.utils.checkpoint``, and Dynamo refuses any side effect there
unless ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint`` is on: it breaks the graph at each
checkpoint, the model compiles in pieces, the layers run outside the graphs with the attention masks as their
inputs, and the causal-mask pass cannot drop them (SDPA loses its flash kernel; five graphs for a two-layer Llama
instead of one). This happens with any backend; the fix is that one flag.

So, for the frames Dynamo compiles for ``backend="flce"`` (and only those), the flag is on while Dynamo traces:
a compile-start callback finds the backend of the compile under way (the ``compiler_fn`` of Dynamo's
``_compile`` frame, unwrapped), turns the flag on in the compiling thread when that backend is this package's
and its ``flce.checkpoint_side_effects`` option is ``"once"`` (the default), and the compile-end callback puts
the flag back. What it changes: a side effect in a checkpointed forward runs once, in the forward, and is not
run again in the backward's recompute (eager checkpointing runs it twice; the kernels hook sets and resets its
variable, so for it both are the same). ``"replay"`` leaves Dynamo's default: the graph breaks at such a
checkpoint and the region runs as in eager. A compile of another backend, or a Dynamo without these callbacks
or this flag, is left alone.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

import torch
from torch._dynamo import callback as dynamo_callback
from torch._dynamo import config as dynamo_config

from ..log import logger

FLAG = "skip_fwd_side_effects_in_bwd_under_checkpoint"
_state = threading.local()  # .restore: the flag's value before this package set it, for the compile under way
_options_of: Callable[[Any], Any] | None = None  # backend.backend_options, set by ``install`` (no import cycle)


def flag_supported() -> bool:
    """Whether this torch's Dynamo has the flag."""
    return hasattr(dynamo_config, FLAG)


def install(options_of: Callable[[Any], Any]) -> None:
    """Register the compile-start and compile-end callbacks once (again after ``torch._dynamo.reset()``, which
    drops them). ``options_of(backend)``: the ``FLCEOptions`` of a Dynamo backend object, None when it is not
    this package's."""
    global _options_of
    _options_of = options_of
    start, end = (getattr(dynamo_callback, name, None) for name in ("on_compile_start", "on_compile_end"))
    if not flag_supported() or start is None or end is None:
        return
    handler = getattr(dynamo_callback, "callback_handler", None)
    if _on_compile_start not in getattr(handler, "start_callbacks", []):
        start(_on_compile_start)
    if _on_compile_end not in getattr(handler, "end_callbacks", []):
        end(_on_compile_end)


def compiling_backend() -> Any | None:
    """The backend of the compile under way in this thread: the ``compiler_fn`` of Dynamo's ``_compile`` frame
    on the stack (a parameter of that function in torch 2.11 through 2.15); None when there is none."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_compile" and "compiler_fn" in code.co_varnames and \
                frame.f_globals.get("__name__") == "torch._dynamo.convert_frame":
            return frame.f_locals.get("compiler_fn")
        frame = frame.f_back
    return None


def wanted(options: Any) -> bool:
    """Whether ``options`` (``FLCEOptions``, or None for another backend) ask for the flag."""
    return options is not None and options.enabled and options.checkpoint_side_effects == "once"


def flag_on() -> Any:
    """A context manager that turns the flag on in this thread (``explain``, which traces with Dynamo's own
    backend, uses it to see the graphs ``backend="flce"`` gets)."""
    return dynamo_config.patch(**{FLAG: True})


@torch.compiler.disable
def _on_compile_start(_args: Any) -> None:
    """Turn the flag on for a compile of this package's backend. Never traced (see ``hf_logging``)."""
    if getattr(_state, "restore", None) is not None:  # registered twice: the first call turned it on
        return
    try:
        if _options_of is None or getattr(dynamo_config, FLAG) or not wanted(_options_of(compiling_backend())):
            return
        _state.restore = False
        setattr(dynamo_config, FLAG, True)
    except Exception as exc:  # noqa: BLE001 - a compile must never fail here
        logger.debug("flce: could not allow side effects in checkpointed forwards: %r", exc)


@torch.compiler.disable
def _on_compile_end(_args: Any) -> None:
    """Put the flag back after a compile whose start turned it on."""
    restore = getattr(_state, "restore", None)
    _state.restore = None
    if restore is not None:
        setattr(dynamo_config, FLAG, restore)
