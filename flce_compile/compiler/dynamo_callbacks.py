"""Dynamo compile-start and compile-end callbacks that stay registered across ``torch._dynamo.reset()``.

Dynamo's reset (and ``torch.compiler.reset()``) clears its callback lists. A callback this package needs before
every frame Dynamo traces (``hf_logging``'s listing of transformers' loss warning, ``checkpoint_side_effects``'
flag) was then missing until something registered it again, and the first frames traced after a reset went
without it: a GPT-2 compiled right after a reset, with transformers imported after this package, broke its graph
between the head and the loss and was never fused (a review, 2026-12-05). ``keep`` registers a callback now and
again right after each clear of Dynamo's callback handler. A Dynamo without these callbacks is left alone.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from torch._dynamo import callback as dynamo_callback

#: The callbacks kept, in the order first kept: ("start" or "end", function).
_kept: list[tuple[str, Callable[[Any], None]]] = []
_lock = threading.RLock()  # two threads keeping one callback at once registered it twice


def _handler() -> Any | None:
    """Dynamo's callback handler when it has what ``keep`` needs, else None."""
    handler = getattr(dynamo_callback, "callback_handler", None)
    parts = [(handler, "start_callbacks"), (handler, "end_callbacks"), (handler, "clear"),
             (dynamo_callback, "on_compile_start"), (dynamo_callback, "on_compile_end")]
    return handler if all(hasattr(owner, name) for owner, name in parts) else None


def keep(*, start: Callable[[Any], None] | None = None, end: Callable[[Any], None] | None = None) -> bool:
    """Register ``start`` / ``end`` as Dynamo compile-start / compile-end callbacks, each once, and again whenever
    Dynamo clears its callbacks. Whether this torch has them."""
    handler = _handler()
    if handler is None:
        return False
    with _lock:
        for kind, function in (("start", start), ("end", end)):
            if function is not None and (kind, function) not in _kept:
                _kept.append((kind, function))
        _register(handler)
        if not getattr(handler.clear, "registers_flce_callbacks", False):
            clear = handler.clear

            def clear_then_register() -> None:  # (an attribute of this one handler object, not of its class)
                try:
                    clear()  # (Dynamo empties the lists, then raises when a callback is pending: a reset mid-compile)
                finally:
                    _register(handler)

            clear_then_register.registers_flce_callbacks = True  # type: ignore[attr-defined]
            handler.clear = clear_then_register
    return True


def registered(function: Callable[[Any], None]) -> bool:
    """Whether ``function`` is among Dynamo's compile-start or compile-end callbacks now."""
    handler = _handler()
    return handler is not None and (function in handler.start_callbacks or function in handler.end_callbacks)


def _register(handler: Any) -> None:
    """Add each kept callback to Dynamo's list unless it is there."""
    with _lock:  # (reentrant: ``keep`` holds it too)
        for kind, function in _kept:
            if kind == "start" and function not in handler.start_callbacks:
                dynamo_callback.on_compile_start(function)
            elif kind == "end" and function not in handler.end_callbacks:
                dynamo_callback.on_compile_end(function)
