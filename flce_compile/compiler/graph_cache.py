"""torch's AOT autograd cache for the graphs the pass rewrote.

A rewritten graph calls the pass's own functions (``rewrite.flce_fused_loss`` and its siblings, the LoRA fold's
``lora_head.join_frozen``), which torch's AOT autograd cache does not know: it skipped every such graph
("Unsupported call_function target"), while Inductor's FX graph cache still served the graph's compiled backward
from disk. That cache's key leaves out which saved tensors the backward may overwrite (AOT autograd's donated
buffers, given only to a backward that runs once), so a process whose first backward kept its graph
(``retain_graph=True``, two ``torch.autograd.grad`` calls) ran a backward cached by an earlier process that had not:
it overwrote the forward's gradients it had saved, and the second backward read them scaled by the first one's
grad_output (the lm_head's gradient 3x where eager's is 5x, with nothing raised). The AOT autograd cache keys on
that and refuses such a backward with torch's own error, as it does for any compiled model (a cold start compiles a
backward that keeps them, and runs). So the functions are marked cacheable
(``torch._inductor.config.unsafe_marked_cacheable_functions``), keyed on this package's source (``cache_key``): an
entry traced through other code of theirs is never served. Warm starts then skip AOT autograd's tracing too.

Graphs that the AOT autograd cache still skips (one holding a custom ``torch.autograd.Function``, or selective
activation checkpointing whose ``context_fn`` has no ``cache_hash``) stay exposed to that FX graph cache gap, as
they are without this backend; ``torch._functorch.config.donated_buffer = False`` closes it for them.

What the functions read besides their arguments is torch's state (which the cache keys on, as for any graph),
the strategy registry (a config that forces a strategy of the "recompute" loop saves other tensors for backward:
the key holds each registered strategy's name and loop, so a strategy registered or changed between runs makes
another key) and, for ``flce.memory_budget_gb`` only, the config the tuning database suggests, which picks the
budget's chunk size when the graph is traced: a cached graph keeps the one chosen then (every config is exact).
"""

from __future__ import annotations

from ..compile_cache_key import mark_cacheable
from ..log import logger
from .lora_head import join_frozen
from .rewrite import flce_fused_loss, flce_fused_loss_keep, flce_kept_logits_loss
from .tensor_parallel import flce_vocab_parallel_loss

#: The pass's functions that rewritten graphs call (a graph calling any other is skipped by the AOT autograd cache).
GRAPH_FUNCTIONS = (flce_fused_loss, flce_fused_loss_keep, flce_kept_logits_loss, flce_vocab_parallel_loss,
                   join_frozen)


def mark_graph_functions_cacheable() -> None:
    """Let the AOT autograd cache hold graphs that call ``GRAPH_FUNCTIONS``, under ``cache_key`` (asked before each
    fused graph is compiled: a strategy registered since changes it; a no-op on a torch without the setting).
    Entries the user added are kept; a dict the user assigns later drops ours until the next fused graph."""
    import torch._inductor.config  # noqa: F401  (loaded: ``mark_cacheable`` reads it from sys.modules)

    try:
        marked = mark_cacheable(f"{fn.__module__}.{fn.__name__}" for fn in GRAPH_FUNCTIONS)
    except Exception as exc:  # noqa: BLE001 - an unreadable source file: the graph skips the AOT cache, as before
        logger.debug("flce: no AOT cache key for the graph functions: %r", exc)
        return
    if not marked:
        logger.debug("flce: this torch has no unsafe_marked_cacheable_functions; rewritten graphs skip the AOT cache")
