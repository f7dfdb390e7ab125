"""The package logger: everything flce_compile reports goes through ``logging.getLogger("flce_compile")``.

It is also registered with ``torch._logging``, so ``TORCH_LOGS="+flce_compile"`` (debug) or
``TORCH_LOGS="flce_compile"`` (info) shows it beside torch.compile's own logs, with the same formatting.
"""

import logging
import os
import sys

logger = logging.getLogger("flce_compile")


def _register_with_torch_logs() -> None:
    try:
        from torch._logging._internal import _init_logs, register_log
    except ImportError:  # a torch without the registry: TORCH_LOGS does not know us, plain logging still works
        return
    register_log("flce_compile", "flce_compile")
    if "flce_compile" in os.environ.get("TORCH_LOGS", "") and not _torch_importing():
        _init_logs()  # torch may have parsed TORCH_LOGS before this name existed; parse it again


def _torch_importing() -> bool:
    """Whether ``import torch`` is still running: torch 2.13 imports a package TORCH_LOGS names while it
    parses TORCH_LOGS at its import, and sets its handlers up after that (a parse of ours then gave every line
    twice), as the ``_init_logs`` that ends torch's import would anyway."""
    spec = getattr(sys.modules.get("torch"), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


_register_with_torch_logs()
