"""torch's AOT autograd cache for the graphs the pass rewrote.

A rewritten graph calls the pass's own functions (``rewrite.flce_fused_loss`` and its siblings), which torch's AOT
autograd cache does not know: it skipped every such graph ("Unsupported call_function target"), while Inductor's
FX graph cache still served the graph's compiled backward from disk. That cache's key leaves out which saved
tensors the backward may overwrite (AOT autograd's donated buffers, given only to a backward that runs once), so
a process whose first backward kept its graph (``retain_graph=True``, two ``torch.autograd.grad`` calls) ran a
backward cached by an earlier process that had not: it overwrote the forward's gradients it had saved, and the
second backward read them scaled by the first one's grad_output (the lm_head's gradient 3x where eager's is 5x,
with nothing raised). The AOT autograd cache keys on that and refuses such a backward with torch's own error, as
it does for any compiled model (a cold start compiles a backward that keeps them, and runs). So the functions are
marked cacheable (``torch._inductor.config.unsafe_marked_cacheable_functions``), keyed on this package's source:
an entry traced through other code of theirs is never served. Warm starts then skip AOT autograd's tracing too.

What the functions read besides their arguments is torch's state (which the cache keys on, as for any graph) and,
for ``flce.memory_budget_gb`` only, the config the tuning database suggests, which picks the budget's chunk size
when the graph is traced: a cached graph keeps the one chosen then (every config is exact).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ..log import logger
from .rewrite import flce_fused_loss, flce_fused_loss_keep, flce_kept_logits_loss
from .tensor_parallel import flce_vocab_parallel_loss

#: The pass's functions that rewritten graphs call.
GRAPH_FUNCTIONS = (flce_fused_loss, flce_fused_loss_keep, flce_kept_logits_loss, flce_vocab_parallel_loss)

_marked = False


def source_key() -> str:
    """A digest of every Python file of the package (their paths and contents): the cache key the functions carry."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return "flce_compile-" + digest.hexdigest()[:16]


def mark_graph_functions_cacheable() -> None:
    """Let the AOT autograd cache hold graphs that call ``GRAPH_FUNCTIONS`` (once per process; a no-op on a torch
    without the setting). Entries the user added are kept; a dict the user assigns later drops ours, and graphs
    that call them are then compiled afresh, as before."""
    global _marked
    if _marked:
        return
    _marked = True
    config = torch._inductor.config
    marked = getattr(config, "unsafe_marked_cacheable_functions", None)
    if not isinstance(marked, dict):
        logger.debug("flce: this torch has no unsafe_marked_cacheable_functions; rewritten graphs skip the AOT cache")
        return
    key = source_key()
    # A new dict, assigned: the one there may be the config's default, which must stay as it is.
    config.unsafe_marked_cacheable_functions = {
        **marked, **{f"{fn.__module__}.{fn.__name__}": key for fn in GRAPH_FUNCTIONS}}
