"""``torch.compile(model, backend="flce")``: fuse LM-head + cross-entropy sites in Dynamo graphs.

Modules, top to bottom of the data path: ``backend`` (Dynamo entry, options, inner compiler), ``options``
(``flce.*`` validation), ``patterns`` (site matching), ``rewrite`` (graph rewrite), ``explain`` (site reports).
The runtime ops the rewritten graphs call live beside the op: ``flce_compile.api`` (the fused op) and
``flce_compile.kept_logits`` (the loss over logits a graph must still return).
"""

from .backend import flce_backend, register, with_options
from .explain import SiteReport, explain

__all__ = ["flce_backend", "with_options", "register", "explain", "SiteReport"]
