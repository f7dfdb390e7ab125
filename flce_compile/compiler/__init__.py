"""``torch.compile(model, backend="flce")``: fuse LM-head + cross-entropy sites in Dynamo graphs.

Modules, top to bottom of the data path: ``backend`` (Dynamo entry, options), ``inner`` (how the inner compiler is
called, and a graph it fails on run as traced with its fused loss), ``hf_logging``
(keeps a Hugging Face loss in the head's graph where transformers logs a warning at it), ``options``
(``flce.*`` validation), ``patterns`` (site matching), ``decide`` (what each site gets), ``rewrite`` (graph
rewrite), ``outputs`` and ``lazy_logits`` (the outputs handed back around the compiled graph: logits computed when
read), ``explain`` (site reports).
The runtime ops the rewritten graphs call live beside the op: ``flce_compile.api`` (the fused op) and
``flce_compile.kept_logits`` (the loss over logits a graph must still return).
"""

from .backend import flce_backend, register, with_options
from .explain import SiteReport, explain
from .lazy_logits import LazyLogits, StaleLogitsError

__all__ = ["flce_backend", "with_options", "register", "explain", "SiteReport", "LazyLogits", "StaleLogitsError"]
