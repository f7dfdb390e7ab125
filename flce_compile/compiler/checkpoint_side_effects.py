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
or this flag, is left alone. Under DDP, Dynamo compiles with DDP's graph splitter, which holds the backend.
``torch._dynamo.reset()`` clears Dynamo's callbacks; these come back at once (``install``).
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

import torch
from torch._dynamo import config as dynamo_config

from ..log import logger
from . import dynamo_callbacks

FLAG = "skip_fwd_side_effects_in_bwd_under_checkpoint"
_state = threading.local()  # .turned_on: this package turned the flag on for the compile under way in this thread
_options_of: Callable[[Any], Any] | None = None  # backend.backend_options, set by ``install`` (no import cycle)
_warned_no_frame = False


def flag_supported() -> bool:
    """Whether this torch's Dynamo has the flag."""
    return hasattr(dynamo_config, FLAG)


def install(options_of: Callable[[Any], Any]) -> None:
    """Register the compile-start and compile-end callbacks, kept across ``torch._dynamo.reset()``
    (``dynamo_callbacks``). ``options_of(backend)``: the ``FLCEOptions`` of a Dynamo backend object, None when it
    is not this package's."""
    global _options_of
    _options_of = options_of
    if flag_supported():
        dynamo_callbacks.keep(start=_on_compile_start, end=_on_compile_end)


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


def _put_back() -> None:
    """Turn the flag off again in this thread if this package turned it on."""
    if getattr(_state, "turned_on", False):
        _state.turned_on = False
        setattr(dynamo_config, FLAG, False)


@torch.compiler.disable
def _on_compile_start(args: Any) -> None:
    """Turn the flag on for a Dynamo compile of this package's backend. Never traced (see ``hf_logging``).

    Dynamo runs these callbacks when its count of compiles under way, one for all threads, leaves and returns to
    0, so a compile that overlaps another thread's may see no end here: a flag still on from one is put back
    first (as from these callbacks registered twice)."""
    global _warned_no_frame
    _put_back()
    try:
        backend = compiling_backend()
        if backend is None:
            if getattr(getattr(args, "callback_trigger", None), "name", None) == "DYNAMO" and not _warned_no_frame:
                _warned_no_frame = True  # a torch whose Dynamo moved its internals: say why models may break
                logger.info("flce: no Dynamo _compile frame found for a compile under way: side effects in "
                            "checkpointed forwards are left to Dynamo's default (see flce.checkpoint_side_effects)")
            return
        if _options_of is None or getattr(dynamo_config, FLAG) or not wanted(_options_of(backend)):
            return
        setattr(dynamo_config, FLAG, True)
        _state.turned_on = True
    except Exception as exc:  # noqa: BLE001 - a compile must never fail here
        logger.debug("flce: could not allow side effects in checkpointed forwards: %r", exc)


@torch.compiler.disable
def _on_compile_end(_args: Any) -> None:
    """Put the flag back after a compile whose start turned it on."""
    _put_back()
