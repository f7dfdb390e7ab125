"""The package logger: everything flce_compile reports goes through ``logging.getLogger("flce_compile")``.

It is also registered with ``torch._logging``, so ``TORCH_LOGS="+flce_compile"`` (debug) or
``TORCH_LOGS="flce_compile"`` (info) shows it beside torch.compile's own logs, with the same formatting.
"""

import logging
import os

logger = logging.getLogger("flce_compile")


def _register_with_torch_logs() -> None:
    try:
        from torch._logging._internal import _init_logs, register_log
    except ImportError:  # a torch without the registry: TORCH_LOGS does not know us, plain logging still works
        return
    register_log("flce_compile", "flce_compile")
    if "flce_compile" in os.environ.get("TORCH_LOGS", ""):
        _init_logs()  # torch may have parsed TORCH_LOGS before this name existed; parse it again


_register_with_torch_logs()
