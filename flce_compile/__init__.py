"""flce-compile: fused linear + cross-entropy that never materialises the logits, found automatically by
``torch.compile(model, backend="flce")``."""

from .api import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from .compiler import explain, with_options
from .compiler import flce_backend as backend
from .config import FLCEConfig, choose_config
from .memory import peak_bytes, peak_bytes_expr

__all__ = [
    "FLCEConfig",
    "backend",
    "explain",
    "with_options",
    "FusedLinearCrossEntropyLoss",
    "choose_config",
    "fused_linear_cross_entropy",
    "peak_bytes",
    "peak_bytes_expr",
]
__version__ = "0.1.0"
