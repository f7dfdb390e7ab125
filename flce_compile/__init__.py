"""flce-compile: fused linear + cross-entropy that never materialises the logits, found automatically by
``torch.compile(model, backend="flce")``."""

from typing import Any

from .api import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from .graph_replay import cuda_graphs_mode, set_cuda_graphs
from .op import TargetError
from .plan.choose import choose_config
from .plan.config import FLCEConfig
from .plan.memory import peak_bytes, peak_bytes_expr
from .tuning.which import ConfigChoice, which_config
from .vocab_parallel import vocab_parallel_linear_cross_entropy

__all__ = [
    "ConfigChoice",
    "FLCEConfig",
    "backend",
    "explain",
    "with_options",
    "FusedLinearCrossEntropyLoss",
    "LazyLogits",
    "StaleLogitsError",
    "TargetError",
    "choose_config",
    "cuda_graphs_mode",
    "fused_linear_cross_entropy",
    "peak_bytes",
    "peak_bytes_expr",
    "set_cuda_graphs",
    "vocab_parallel_linear_cross_entropy",
    "which_config",
]
__version__ = "0.1.0"

# The compiler pass imports torch._dynamo (seconds); users of the op alone, and flce-tune, need not pay that.
# backend="flce" itself resolves through the torch_dynamo_backends entry point.
_COMPILER_EXPORTS = {"backend": "flce_backend", "explain": "explain", "with_options": "with_options",
                     "LazyLogits": "LazyLogits", "StaleLogitsError": "StaleLogitsError"}


def __getattr__(name: str) -> Any:
    if name in _COMPILER_EXPORTS:
        from . import compiler

        return getattr(compiler, _COMPILER_EXPORTS[name])
    raise AttributeError(f"module 'flce_compile' has no attribute {name!r}")
