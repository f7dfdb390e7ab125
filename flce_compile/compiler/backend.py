"""The ``flce`` Dynamo backend: parse options, run the fusion pass, hand the graph to the inner compiler.

``torch.compile(model, backend="flce", options={...})`` reaches :func:`flce_backend` as
``flce_backend(gm, example_inputs, options=..., mode=...)`` (that is how ``torch._TorchCompileWrapper`` calls
every non-inductor backend; it forwards ``options``/``mode`` only when they are non-empty/non-default).
``torch.compile`` refuses ``mode=`` together with ``options=``, so :func:`with_options` builds a backend with
both bound for that case.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

from torch import fx

from .. import graph_replay
from ..log import logger
from ..plan.choose import BudgetError
from . import checkpoint_side_effects
from .graph_meta import copy_graph
from .hf_logging import keep_loss_in_graph
from .inner import compile_graph, inner_compiler, no_cuda_graphs_of_its_own
from .options import PREFIX, FLCEOptions, split_options

BACKEND_NAME = "flce"


def flce_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
    **kwargs: Any,
) -> Callable[..., Any]:
    """Dynamo backend: fuse ``lm_head -> cross_entropy`` sites of ``gm``, then compile it with the inner compiler.

    ``options``: ``flce.*`` keys are ours (see ``options.VALID_KEYS``); every other key, ``mode`` and any other
    keyword go to the inner compiler unchanged.
    """
    opts, inner_options = split_options(options)
    inner = inner_compiler(opts, mode, inner_options, kwargs)
    if opts.enabled:
        keep_loss_in_graph()  # for frames traced from now on, should transformers have come after this module
    wrap, fused = None, False
    if opts.enabled and opts.causal_masks:
        _drop_causal_masks(gm)
    if opts.enabled:
        wrap, fused = _fusion_pass(gm, example_inputs, opts)
    if fused:
        from .graph_cache import mark_graph_functions_cacheable

        mark_graph_functions_cacheable()  # (before the inner compiler looks the graph up)
    compiled, traced = compile_graph(inner, gm, example_inputs, opts, fused)
    if fused and (traced or no_cuda_graphs_of_its_own(opts, mode, inner_options)):
        compiled = _AllowGraphReplay(compiled)
    # The graph's outputs changed (dropped logits, kept logits returned detached): restore them for the caller.
    return wrap(compiled) if wrap is not None else compiled


def _fusion_pass(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: FLCEOptions
                 ) -> tuple[Callable[[Callable[..., Any]], Callable[..., Any]] | None, bool]:
    """Run the fusion pass on ``gm``: (the wrapper the compiled graph needs or None, whether a site was fused). A
    failure is logged and leaves the graph as traced; only a memory budget that no config fits raises (the user's
    setting, as in an eager call). A graph with no loss site (most graphs of a model Dynamo splits) is only read:
    the copy of the graph that guards the pass (``copy_graph``, ~0.45 s per 30k nodes) is taken where a loss is."""
    from .rewrite import has_loss_site, report_lone_heads, run_pass

    try:
        if not has_loss_site(gm):
            report_lone_heads(gm)
            return None, False
    except Exception as exc:  # noqa: BLE001 - a reading bug: the guarded pass below decides
        logger.debug("flce: looking for loss sites failed, running the pass: %r", exc)
    # The pass rewrites a copy. Dynamo's own graph object stays as traced: Dynamo keeps it, and a restart of its
    # analysis after this backend ran (a TensorifyScalarRestartAnalysis under dynamic=True) erases its nodes,
    # which failed on a graph a failed pass had left half rewritten.
    as_traced = gm.graph
    try:
        gm.graph = copy_graph(as_traced)
    except Exception as exc:  # noqa: BLE001 - with no way back from a failure, the pass is not run
        logger.warning("flce: could not copy the graph before the fusion pass, compiling it unchanged: %r", exc)
        return None, False
    try:
        result = run_pass(gm, example_inputs, logits=opts.logits, config=opts.config, precision=opts.precision,
                          memory_budget_gb=opts.memory_budget_gb)
    except BaseException as exc:
        gm.graph = as_traced
        gm.recompile()
        if isinstance(exc, BudgetError) or not isinstance(exc, Exception):
            raise
        logger.warning("flce: fusion pass failed, compiling the graph unchanged: %r", exc)  # analysis bugs must
        return None, False  # not break the user's compile
    return result.wrap, any(site.new_node is not None for site in result.sites)


#: Whether a causal mask kept for symbolic shapes was warned of (once a process; INFO after).
_warned_symbolic_masks = False


def _drop_causal_masks(gm: fx.GraphModule) -> None:
    """``causal_mask.drop_causal_masks`` on ``gm``, logged. An error is logged, not raised: the masks are judged
    (and evaluated) before any node changes, so a failed evaluation leaves the graph as it was."""
    from .causal_mask import drop_causal_masks

    try:
        result = drop_causal_masks(gm)
    except Exception as exc:  # noqa: BLE001 - a bug here must not break the user's compile
        logger.warning("flce: causal-mask pass failed, attention left as traced: %r", exc)
        return
    if result.calls or result.refused:  # a kept mask costs SDPA's flash kernel: say why
        global _warned_symbolic_masks
        # A recompile for a new size (the last, smaller batch of an epoch) keeps the masks for every later step:
        # attention about 2x slower at 16384 tokens on an H200 (issue #13's step), so say it once at WARNING.
        warn = result.symbolic and not _warned_symbolic_masks
        _warned_symbolic_masks = _warned_symbolic_masks or warn
        logger.log(logging.WARNING if warn else logging.INFO, "flce: %s", result)


class _AllowGraphReplay:
    """A compiled graph run with the fused op's CUDA-graph replay allowed (``graph_replay.allowed``)."""

    def __init__(self, compiled: Callable[..., Any]) -> None:
        self.compiled = compiled
        # Dynamo calls a "boxed" compiled function with one list of inputs (which it may clear); keep that.
        self._boxed_call = getattr(compiled, "_boxed_call", False)

    def __call__(self, *args: Any) -> Any:
        with graph_replay.allowed():
            return self.compiled(*args)


def with_options(options: Mapping[str, Any] | None = None, mode: str | None = None, **flce: Any) -> Callable[..., Any]:
    """A backend callable with options bound, for ``torch.compile(model, backend=with_options(...))``.

    Use it when you need ``mode=`` and ``flce.*`` options together (``torch.compile`` rejects mode+options).
    Keyword arguments are shorthand for ``flce.*`` keys: ``with_options(logits="drop", inner="aot_eager")`` (the
    prefixed spelling, ``**{"flce.logits": "drop"}``, is taken too).
    Options are validated here, so mistakes surface before compiling: ours, and with Inductor as the inner
    compiler ``mode`` and Inductor's own options too, which ``torch.compile`` checks at its call for Inductor.
    """
    merged = dict(options or {})
    merged.update({k if k.startswith(PREFIX) else PREFIX + k: v for k, v in flce.items()})
    opts, inner_options = split_options(merged)  # validate now
    if opts.inner == "inductor":  # building Inductor's wrapper checks the mode's name and its option names
        inner_compiler(opts, mode, inner_options, {})
    return _BoundBackend(merged, mode)


class _BoundBackend:
    """``with_options``'s backend: ``flce_backend`` with options and mode bound. A class, not a closure, so that it
    pickles (with its options) as the ``options=`` spelling does; ``flce_options`` is read by ``backend_options``."""

    __name__ = "flce_with_options"  # (what Dynamo's logs call a backend)

    def __init__(self, options: dict[str, Any], mode: str | None) -> None:
        self.flce_options, self.mode = options, mode

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
        opt = {**self.flce_options, **(kwargs.pop("options", None) or {})}
        return flce_backend(gm, example_inputs, options=opt, mode=kwargs.pop("mode", self.mode), **kwargs)

    def __repr__(self) -> str:
        return f"flce_compile.with_options({self.flce_options!r}, mode={self.mode!r})"


def compiled_options(model: Any) -> FLCEOptions | None:
    """The ``flce.*`` options ``model`` was compiled with (``torch.compile(model, backend="flce", ...)``,
    ``model.compile(...)`` or a ``with_options`` backend), or None when it was not compiled with this backend.

    Reads torch.compile's own record of the backend and its options (the wrapper Dynamo keeps on the compiled
    object); nothing is stored on the model.
    """
    return backend_options(getattr(_dynamo_context(model), "callback", None))


def backend_options(backend: Any) -> FLCEOptions | None:
    """The ``flce.*`` options of a backend as Dynamo holds it (its callback, or the ``compiler_fn`` of a compile
    under way: torch.compile's wrapper, holding the backend and its options, inside Dynamo's own wrappers), or
    None when the backend is not this package's."""
    for _ in range(8):  # Dynamo's wrappers around the backend, outermost first
        if backend is None:
            return None
        if hasattr(backend, "compiler_fn") and hasattr(backend, "kwargs"):  # torch.compile's wrapper
            fn, kwargs = backend.compiler_fn, backend.kwargs or {}
            bound = getattr(fn, "flce_options", None)
            if fn is not flce_backend and bound is None:
                return None
            return split_options({**(bound or {}), **(kwargs.get("options") or {})})[0]
        if backend is flce_backend or hasattr(backend, "flce_options"):  # passed to Dynamo without torch.compile
            return split_options(getattr(backend, "flce_options", None))[0]
        ddp = getattr(getattr(backend, "__self__", None), "backend_compile_fn", None)  # DDPOptimizer.compile_fn
        backend = ddp if ddp is not None else getattr(backend, "_torchdynamo_orig_backend", None)
    return None


def compiled_dynamic(model: Any) -> bool | None:
    """The ``dynamic=`` a compiled model was compiled with (None: not given, or not a compiled model)."""
    return getattr(_dynamo_context(model), "_dynamic", None)


def _dynamo_context(model: Any) -> Any:
    """Dynamo's context object behind a compiled model (its backend and ``dynamic=``), or None."""
    ctx = getattr(model, "dynamo_ctx", None)  # torch.compile(module): an OptimizedModule
    if ctx is None:
        fn = getattr(model, "_compiled_call_impl", None) or model  # module.compile(), or a compiled function
        cells = getattr(fn, "__closure__", None) or ()
        ctx = next((c.cell_contents for c in cells if hasattr(_cell(c), "callback")), None)
    return ctx


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


flce_backend.with_options = with_options  # type: ignore[attr-defined]


def register() -> None:
    """Make ``backend="flce"`` resolvable in this process when the package's entry point is not installed.

    Never registers when the ``torch_dynamo_backends`` entry point exists: torch would then load the entry
    point and register the same name again, which it rejects as a duplicate.
    """
    from torch._dynamo.backends import registry

    if BACKEND_NAME in registry._COMPILER_FNS:
        return
    try:
        from importlib.metadata import entry_points

        if BACKEND_NAME in entry_points(group="torch_dynamo_backends").names:
            return
    except Exception:  # noqa: BLE001 - metadata problems: fall back to registering directly
        pass
    registry.register_backend(compiler_fn=flce_backend, name=BACKEND_NAME)


register()
checkpoint_side_effects.install(backend_options)  # (kept across torch._dynamo.reset())
keep_loss_in_graph()  # (hf_logging) transformers is usually imported by now: backend="flce" imports this module
