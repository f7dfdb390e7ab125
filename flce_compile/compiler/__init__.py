"""``torch.compile(model, backend="flce")``: fuse LM-head + cross-entropy sites in Dynamo graphs.

Modules, top to bottom of the data path: ``backend`` (Dynamo entry, options, inner compiler), ``options``
(``flce.*`` validation), ``patterns`` (site matching), ``rewrite`` (graph rewrite), ``kept_logits`` (the loss
over logits a graph must still return), ``explain`` (site reports).
"""

from .backend import flce_backend, register, with_options
from .explain import SiteReport, explain

__all__ = ["flce_backend", "with_options", "register", "explain", "SiteReport"]
