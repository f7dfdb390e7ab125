"""The inner compiler: how the backend calls it, and what it does when that compiler fails on a fused graph.

Dynamo answers some failures of a backend (a data-dependent operator, an operator fake tensors cannot run:
``torch._dynamo.exc.exceptions_allowed_to_be_fallback``) with a graph break: the lm_head and its loss then run
outside any compiled graph and the loss materializes the logits, as eager does. For transformers' MoE models the
head's whole frame runs uncompiled (Dynamo compiles only the frames it calls). That happens on models the inner
compiler cannot handle, with this backend or without it: transformers 5.17's MoE models with fp32 weights
(autocast's training setup) under torch 2.11 use an expert GEMM whose backward reads its group sizes on the host,
which AOT autograd cannot trace. With ``flce.inner_failure="traced"`` (the default) the backend runs such a graph
as traced instead, uncompiled, the fused op in it: the logits stay unmaterialized, as the backend promises. The
graph is the whole frame Dynamo traced, so none of it is compiled, where Dynamo's fallback still compiles the
frames the head's frame calls; on the H200 the traced graph was the faster of the two all the same
(docs/backend.md).
Under ``fullgraph=True``, where torch.compile would raise such a failure, the graph also runs as traced (logged);
``"dynamo"`` restores torch.compile's answer.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx

from ..log import logger
from .patterns import checkpoint_body, is_checkpoint
from .options import FLCEOptions

#: Inner compilers that never capture CUDA graphs themselves (Inductor: unless its mode or options ask).
_GRAPHLESS_INNER = ("inductor", "eager", "aot_eager", "aot_eager_decomp_partition")
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def inner_compiler(
    opts: FLCEOptions, mode: str | None, inner_options: dict[str, Any], extra: dict[str, Any]
) -> Callable[[fx.GraphModule, Sequence[Any]], Callable[..., Any]]:
    """The inner compiler, called the way ``torch.compile`` would call it with the same mode/options."""
    if opts.inner == "inductor":
        if extra:
            raise TypeError(f"backend 'flce' with inner inductor got unexpected keyword arguments {sorted(extra)}")
        # The same wrapper torch.compile builds for backend="inductor" (applies mode and inductor options).
        return torch._TorchCompileInductorWrapper(mode, inner_options or None, None)
    from torch._dynamo.backends.registry import lookup_backend

    fn = lookup_backend(opts.inner) if isinstance(opts.inner, str) else opts.inner
    kw = dict(extra)
    if mode and mode != "default":
        kw["mode"] = mode
    if inner_options:
        kw["options"] = inner_options
    return functools.partial(fn, **kw) if kw else fn


def compile_graph(
    inner: Callable[[fx.GraphModule, Sequence[Any]], Callable[..., Any]],
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    opts: FLCEOptions,
    fused: bool,
) -> tuple[Callable[..., Any], bool]:
    """``(inner(gm, example_inputs), False)``; or, when that fails on a graph holding a fused site (``fused``)
    with an error Dynamo answers with a graph break and ``opts.inner_failure`` is "traced",
    ``(run_as_traced(gm), True)``. Any other failure is raised, as torch.compile would."""
    try:
        return inner(gm, example_inputs), False
    except Exception as exc:
        # (A RestartAnalysis is no failure: Dynamo traces the frame again, e.g. once AOT autograd specializes a
        # float under dynamic=True.)
        if not fused or isinstance(exc, torch._dynamo.exc.RestartAnalysis):
            raise
        if opts.inner_failure == "traced" and isinstance(exc, torch._dynamo.exc.exceptions_allowed_to_be_fallback):
            logger.warning(
                "flce: the inner compiler %r failed on a graph with a fused lm_head/loss site (%s: %s), an error "
                "torch.compile answers with a graph break, after which the lm_head and its loss run uncompiled, on "
                "materialized logits. The backend runs this graph as traced instead, uncompiled but with the fused "
                "loss (flce.inner_failure='traced'; 'dynamo' leaves the failure to torch.compile). torch.compile with "
                "backend=%r alone fails on this graph too if the cause is outside the head (transformers 5.17's MoE "
                "models with fp32 weights under torch 2.11, say)",
                opts.inner_name, type(exc).__name__, str(exc)[:300], opts.inner_name)
            return run_as_traced(gm), True
        _log_inner_failure(opts, exc)
        raise


def run_as_traced(gm: fx.GraphModule) -> Callable[..., Any]:
    """``gm`` as a Python callable, its activation-checkpointed regions still checkpointed.

    Run outside a compiler, Dynamo's checkpoint calls (``tag_activation_checkpoint``) keep every activation of
    their region under torch 2.11 (pytorch/pytorch#160773): a checkpointed model would keep all its layers'
    activations, more than the logits the fused loss saves. They become ``checkpoint(body, ...)`` calls, nested
    ones too, non-reentrant as Dynamo's own are (it traces ``use_reentrant=True`` into the same call)."""
    _checkpoint_regions(gm)
    return gm.forward


def _checkpoint_regions(gm: fx.GraphModule) -> None:
    """Turn ``gm``'s checkpoint calls, and those inside their bodies, into ``_checkpointed`` calls."""
    regions = [node for node in gm.graph.nodes if is_checkpoint(node)]
    for node in regions:
        body = checkpoint_body(gm, node)
        if body is not None:
            _checkpoint_regions(body[1])
        node.target = _checkpointed
    if regions:
        gm.recompile()


def _checkpointed(body: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    """A checkpointed region of a graph run as traced: ``body(*args)`` under non-reentrant checkpointing, with the
    checkpoint's own keywords and, for selective checkpointing, the policy Dynamo kept on the body."""
    from torch.utils.checkpoint import checkpoint

    kwargs = {k: v for k, v in kwargs.items() if k in _CHECKPOINT_KEYWORDS}
    context_fn = getattr(body, "meta", {}).get("_checkpoint_context_fn")
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    return checkpoint(body, *args, use_reentrant=False, **kwargs)


#: Keywords of torch.utils.checkpoint.checkpoint a traced region may carry (use_reentrant is always False).
_CHECKPOINT_KEYWORDS = ("preserve_rng_state", "determinism_check", "debug", "early_stop")


def _log_inner_failure(opts: FLCEOptions, exc: Exception) -> None:
    """The inner compiler failed on a graph holding a fused site and the failure goes to torch.compile: it
    raises the error, or for some errors breaks the graph there, and the lm_head and loss then run uncompiled and
    unfused."""
    name = opts.inner_name
    logger.warning(
        "flce: the inner compiler %r failed on a graph with a fused lm_head/loss site (%s: %s). torch.compile "
        "raises it, or (for a data-dependent operator, say) breaks the graph there, and the lm_head and its loss "
        "run uncompiled and unfused. If torch.compile with backend=%r alone fails too, the cause is outside the "
        "head; if it does not, the fused op is: please report it",
        name, type(exc).__name__, str(exc)[:300], name)


def no_cuda_graphs_of_its_own(opts: FLCEOptions, mode: str | None, inner_options: Mapping[str, Any]) -> bool:
    """Whether the compiled graph runs outside any CUDA graph of the inner compiler's: only then may the fused op
    replay graphs of its own (``graph_replay``). Inductor's CUDA-graph trees run the graph once to warm up with
    their memory pool installed, and the op's buffers must not land in it."""
    if opts.inner not in _GRAPHLESS_INNER:
        return False
    if opts.inner != "inductor":
        return True
    from torch._inductor import config as inductor_config

    return (mode not in _CUDA_GRAPH_MODES and not inner_options.get("triton.cudagraphs")
            and not inductor_config.triton.cudagraphs)
