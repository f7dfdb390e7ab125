"""The ``flce`` Dynamo backend: parse options, run the fusion pass, hand the graph to the inner compiler.

``torch.compile(model, backend="flce", options={...})`` reaches :func:`flce_backend` as
``flce_backend(gm, example_inputs, options=..., mode=...)`` (that is how ``torch._TorchCompileWrapper`` calls
every non-inductor backend; it forwards ``options``/``mode`` only when they are non-empty/non-default).
``torch.compile`` refuses ``mode=`` together with ``options=``, so :func:`with_options` builds a backend with
both bound for that case.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx

from .. import graph_replay
from ..log import logger
from .hf_logging import keep_loss_in_graph
from .options import FLCEOptions, split_options

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
    inner = _inner_compiler(opts, mode, inner_options, kwargs)
    if opts.enabled:
        keep_loss_in_graph()  # for frames traced from now on, should transformers have come after this module
    wrap, fused = None, False
    if opts.enabled and opts.causal_masks:
        _drop_causal_masks(gm)
    if opts.enabled:
        from .rewrite import run_pass

        try:
            result = run_pass(gm, example_inputs, logits=opts.logits, config=opts.config, precision=opts.precision,
                              memory_budget_gb=opts.memory_budget_gb)
            wrap, fused = result.wrap, any(site.new_node is not None for site in result.sites)
        except Exception as exc:  # noqa: BLE001 - analysis bugs must not break the user's compile
            logger.warning("flce: fusion pass failed, compiling the graph unchanged: %r", exc)
    try:
        compiled = inner(gm, example_inputs)
    except Exception as exc:
        # Dynamo will split the graph and retry: say what that costs the fused site. (A RestartAnalysis is no
        # failure: Dynamo traces the frame again, e.g. once AOT autograd specializes a float under dynamic=True.)
        if fused and not isinstance(exc, torch._dynamo.exc.RestartAnalysis):
            _log_inner_failure(opts, exc)
        raise
    if fused and _no_cuda_graphs_of_its_own(opts, mode, inner_options):
        compiled = _AllowGraphReplay(compiled)
    # The graph's outputs changed (dropped logits, kept logits returned detached): restore them for the caller.
    return wrap(compiled) if wrap is not None else compiled


def _log_inner_failure(opts: FLCEOptions, exc: Exception) -> None:
    """The inner compiler failed on a graph holding a fused site. torch.compile raises the error, or for some
    errors (a data-dependent operator under torch 2.11) splits the graph at breaks and compiles the pieces; the
    lm_head and its loss may then land in different pieces and the site is no longer fused (the pass says so on
    the piece with the loss). Seen with Inductor on transformers 5.17's MoE models on CUDA, which fail the same
    way without this backend."""
    name = opts.inner_name
    logger.warning(
        "flce: the inner compiler %r failed on a graph with a fused lm_head/loss site (%s: %s). torch.compile "
        "raises it, or (for a data-dependent operator, say) splits the graph and compiles the pieces, and the site "
        "stays unfused if the lm_head and the loss end up in different pieces. If torch.compile with backend=%r "
        "alone fails too (Inductor does on transformers 5.17's MoE models on CUDA), the cause is outside the head; "
        "if it does not, the fused op is: please report it",
        name, type(exc).__name__, str(exc)[:300], name)


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
        logger.info("flce: %s", result)


#: Inner compilers that never capture CUDA graphs themselves (Inductor: unless its mode or options ask).
_GRAPHLESS_INNER = ("inductor", "eager", "aot_eager", "aot_eager_decomp_partition")
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _no_cuda_graphs_of_its_own(opts: FLCEOptions, mode: str | None, inner_options: Mapping[str, Any]) -> bool:
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


class _AllowGraphReplay:
    """A compiled graph run with the fused op's CUDA-graph replay allowed (``graph_replay.allowed``)."""

    def __init__(self, compiled: Callable[..., Any]) -> None:
        self.compiled = compiled
        # Dynamo calls a "boxed" compiled function with one list of inputs (which it may clear); keep that.
        self._boxed_call = getattr(compiled, "_boxed_call", False)

    def __call__(self, *args: Any) -> Any:
        with graph_replay.allowed():
            return self.compiled(*args)


def _inner_compiler(
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


def with_options(options: Mapping[str, Any] | None = None, mode: str | None = None, **flce: Any) -> Callable[..., Any]:
    """A backend callable with options bound, for ``torch.compile(model, backend=with_options(...))``.

    Use it when you need ``mode=`` and ``flce.*`` options together (``torch.compile`` rejects mode+options).
    Keyword arguments are shorthand for ``flce.*`` keys: ``with_options(logits="drop", inner="aot_eager")``.
    Options are validated here, so mistakes surface before compiling.
    """
    merged = dict(options or {})
    merged.update({f"flce.{k}": v for k, v in flce.items()})
    split_options(merged)  # validate now

    def flce_with_options(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
        opt = {**merged, **(kwargs.pop("options", None) or {})}
        return flce_backend(gm, example_inputs, options=opt, mode=kwargs.pop("mode", mode), **kwargs)

    flce_with_options.flce_options = merged  # type: ignore[attr-defined]  (read by compiled_options)
    return flce_with_options


def compiled_options(model: Any) -> FLCEOptions | None:
    """The ``flce.*`` options ``model`` was compiled with (``torch.compile(model, backend="flce", ...)``,
    ``model.compile(...)`` or a ``with_options`` backend), or None when it was not compiled with this backend.

    Reads torch.compile's own record of the backend and its options (the wrapper Dynamo keeps on the compiled
    object); nothing is stored on the model.
    """
    wrapper = _compile_wrapper(model)
    if wrapper is None:
        return None
    fn, kwargs = getattr(wrapper, "compiler_fn", None), getattr(wrapper, "kwargs", None) or {}
    bound = getattr(fn, "flce_options", None)
    if fn is not flce_backend and bound is None:
        return None
    return split_options({**(bound or {}), **(kwargs.get("options") or {})})[0]


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


def _compile_wrapper(model: Any) -> Any:
    """torch.compile's backend wrapper (an object with ``compiler_fn`` and ``kwargs``) behind a compiled model."""
    backend = getattr(_dynamo_context(model), "callback", None)
    for _ in range(8):  # Dynamo's wrappers around the backend, outermost first
        if backend is None or hasattr(backend, "compiler_fn") and hasattr(backend, "kwargs"):
            return backend
        backend = getattr(backend, "_torchdynamo_orig_backend", None)
    return None


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
keep_loss_in_graph()  # (hf_logging) transformers is usually imported by now: backend="flce" imports this module
