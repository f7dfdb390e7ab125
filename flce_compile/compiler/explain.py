"""``explain(model, *args, options=None, **kwargs)``: what ``backend="flce"`` does with each lm_head/loss site.

It captures the model's Dynamo graphs with ``torch._dynamo.explain`` (which runs the model once and resets
Dynamo's caches, like any ``torch._dynamo.explain`` call), analyzes every graph, tries the backend's rewrite on a
copy of it (a site whose rewrite fails is reported unfused, as the backend leaves it), and reports one entry per
loss site plus one per lm_head that a graph break separated from its loss, and notes (attention masks the backend
drops, checkpointed regions it opens). The options are the ones a compiled model was compiled with, or
``options=`` (the same dict ``torch.compile`` takes).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import fx, nn

from ..log import logger
from ..plan.choose import BudgetError
from ..plan.config import FLCEConfig
from . import checkpoint_side_effects
from .backend import compiled_dynamic, compiled_options
from .causal_mask import drop_causal_masks
from .checkpoints import inline_fusable_checkpoints
from .decide import LONE_HEAD_REASON, SiteResult, lone_heads, mark_unkept
from .hf_logging import keep_loss_in_graph
from .lora_head import FROZEN_COLUMNS, analyze_with_folded_heads
from .options import FLCEOptions, split_options
from .rewrite import REWRITE_FAILED, has_loss_site, trial_pass
from .patterns import Plan, meta_value
from .tensor_parallel import LONE_HEAD


@dataclass
class SiteReport:
    """One loss site (or a lone lm_head) as ``explain`` sees it."""

    graph: int
    loss: str
    fused: bool
    path: str  # one of decide.PATHS
    reason: str | None
    strategy: str | None
    tokens: int | None
    vocab: int | None
    hidden: int | None
    softcap: float | str | None = None  # a str names the graph input the op reads it from at run time
    logit_scale: float = 1.0
    logits_escape: bool = False
    est_saved_bytes: int = 0
    cost_note: str = ""  # what outweighs the logits where ``est_saved_bytes`` is negative
    kept_logits_bytes: int = 0
    note: str | None = None
    logits_users: list[str] = field(default_factory=list)  # the graph's ops that read the logits (not the loss)
    drop_frees: bool = True  # whether flce.logits="drop" frees kept logits (``SiteResult.drop_frees``)

    def __str__(self) -> str:
        head = f"[graph {self.graph}] {self.loss}: "
        if not self.fused:
            return head + f"NOT fused - {self.reason}"
        extra = []
        if isinstance(self.softcap, str):
            extra.append(f"softcap={self.softcap}")
        elif self.softcap is not None:
            extra.append(f"softcap={self.softcap:g}")
        if self.logit_scale != 1.0:
            extra.append(f"logit_scale={self.logit_scale:g}")
        text = (
            f"fused ({self.path}, strategy={self.strategy}) tokens~{self.tokens} V={self.vocab} H={self.hidden}"
            + (" " + " ".join(extra) if extra else "")
            + (f", est. memory saved {_bytes_text(self.est_saved_bytes)}" if self.est_saved_bytes >= 0 else
               f", est. memory cost {_bytes_text(-self.est_saved_bytes)} above unfused ({self.cost_note})")
        )
        kept = f"~{_bytes_text(self.kept_logits_bytes)}"
        users = ", ".join(self.logits_users[:4]) + (", ..." if len(self.logits_users) > 4 else "")
        # "drop" frees only logits the graph returns, not logits its own ops read (a z-loss, a metric)
        why = f"the graph's own ops read them ({users})" if users else "they are returned"
        advice = "" if users or not self.drop_frees else " (options={'flce.logits': 'drop'} frees them)"
        if self.path == "fused_keep":
            text += f"; the logits are formed, exact, as {why}: {kept} stay, nothing logits-sized is saved for " \
                    f"backward{advice}"
        elif self.path == "kept_logits":
            text += f"; logits are kept as {why}: {kept} stay{advice}"
        if self.note:
            text += f"; note: {self.note}"
        if self.reason:  # a fused site can still have a reason, e.g. logits that "drop" could not drop
            text += f"; {self.reason}"
        return head + text


class ExplainReport(list):
    """A list of :class:`SiteReport` that prints as a table (``print(flce_compile.explain(...))``)."""

    graph_count: int = 0
    graph_breaks: list[str]
    #: Dynamo's count of graph breaks, which can exceed its reasons (``graph_breaks``): some breaks come with none
    graph_break_count: int = 0
    #: What Dynamo's break counters recorded during the trace, where it gave breaks no reason (``_counted_breaks``)
    counted_breaks: list[str]
    notes: list[str]  # e.g. checkpointed regions moved out of their checkpoint
    options: FLCEOptions = FLCEOptions()

    def __str__(self) -> str:
        opts = self.options
        state = "" if opts.enabled else ", flce.enabled=False: nothing is rewritten"
        # The two options every report names, then each other one that is not at its default.
        others = "".join(f", flce.{name}={getattr(opts, name)!r}" for name in _OTHER_OPTIONS
                         if getattr(opts, name) != getattr(_DEFAULT_OPTIONS, name))
        lines = [f"flce explain (flce.logits={opts.logits!r}, flce.inner={opts.inner_name!r}{others}{state}): "
                 f"{self.graph_count} graph(s), {max(self.graph_break_count, len(self.graph_breaks))} graph "
                 f"break(s), {sum(r.fused for r in self)} of {len(self)} site(s) fused"]
        lines += ["  " + str(r) for r in self]
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  graph break: {b}" for b in self.graph_breaks]
        unnamed = self.graph_break_count - len(self.graph_breaks)
        if unnamed > 0:
            counted = ("; its break counters recorded, in this frame or the frames it calls: "
                       + "; ".join(self.counted_breaks)) if self.counted_breaks else ""
            lines.append(f"  graph break: {unnamed} more that Dynamo gave no reason for (TORCH_LOGS=\"graph_breaks\" "
                         f"names each){counted}")
        return "\n".join(lines)

    __repr__ = __str__


def _bytes_text(n: float) -> str:
    """A size in GiB, or in MiB below a tenth of one (a small model's would read 0.000 GiB)."""
    return f"{n / 2**30:.3f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:.2f} MiB"


_DEFAULT_OPTIONS = FLCEOptions()
#: The options a report's first line names when they are not at their defaults (``enabled`` has its own words).
_OTHER_OPTIONS = ("config", "precision", "memory_budget_gb", "causal_masks", "inner_failure",
                  "checkpoint_side_effects")


def _config_text(cfg: FLCEConfig, source: str) -> str:
    """The strategy, its chunking, and where the config came from."""
    chunks = f"chunk_tokens={cfg.chunk_tokens}"
    if cfg.strategy == "recompute":
        chunks += f", vocab_block={cfg.vocab_block}"
    return f"{cfg.strategy} ({source}; {chunks})"


def _strategy(res: SiteResult, options: FLCEOptions) -> tuple[str | None, FLCEConfig | None]:
    """The strategy the site's op would run, and where its config comes from, as the op chooses it under
    ``options`` (forced config fields, precision, memory budget), with that config (None where the site's op has
    none to choose, or choosing failed). A ValueError when a memory budget leaves no config (the backend then
    leaves the site unfused)."""
    if res.path == "kept_logits":
        return "chunked-ce-over-kept-logits", None
    if res.path == "vocab_parallel":
        return "vocab-parallel (lse in forward, logits recomputed by shard in backward)", None
    if res.path not in ("fused", "fused_lazy", "fused_keep"):
        return None, None
    from ..plan.choose import config_within_budget, resolve_config
    from ..plan.precision import accum_dtype_for, forced_by

    lin = res.site.linear
    forced = forced_by(options.precision, options.config, lin.wide_bias)  # (a wide bias: the op's fp32 logits)
    dtype = meta_value(lin.start).dtype  # the GEMM's, which a wider bias added after it does not change
    args = (res.tokens or 1, res.site.vocab, res.site.hidden, dtype, res.device)
    if options.memory_budget_gb is not None:  # errors here are the rewrite's own: let them through
        cfg, source = config_within_budget(forced, options.memory_budget_gb, *args,
                                           accum_dtype_for(options.precision, None, dtype),
                                           **_needs(res))
        return _config_text(cfg, source), cfg
    try:
        cfg, source = resolve_config(forced, *args)
        return _config_text(cfg, source), cfg
    except Exception as exc:  # noqa: BLE001 - reporting only
        return f"unknown ({exc!r})", None


def _needs(res: SiteResult) -> dict[str, bool | int]:
    """The gradients the site's op would form (from the traced tensors; all of them when a tensor is not in the
    graph; none for a LoRA fold's frozen head columns), and whether it caps its logits: what its memory bound
    depends on."""
    lin = res.site.linear

    def requires_grad(node: fx.Node | None, default: bool) -> bool:
        value = meta_value(node) if node is not None else None
        return value.requires_grad if isinstance(value, torch.Tensor) else default

    return {"need_dx": requires_grad(lin.input if lin else None, True),
            "need_dw": requires_grad(lin.weight if lin else None, True),
            "need_db": lin is not None and any(requires_grad(b, True) for b in (lin.bias, lin.added_bias)
                                               if b is not None),
            "softcap": res.plan is not None and res.plan.softcap is not None,
            "frozen_columns": lin.start.meta.get(FROZEN_COLUMNS, 0) if lin is not None else 0}


def _softcap_text(plan: Plan | None) -> float | str | None:
    """The report's softcap: the constant, or where the op reads it at run time (``runtime_float``)."""
    if plan is None or not isinstance(plan.softcap, fx.Node):
        return plan.softcap if plan is not None else None
    return f"{plan.softcap.args[0].name} (read at run time)"


def _memory_estimate(res: SiteResult, cfg: FLCEConfig | None, options: FLCEOptions) -> tuple[int, str]:
    """(What fusing spares against the unfused loss, and where that is negative what outweighs the logits.)

    The unfused loss keeps logits + fp32 upcast + fp32 log-softmax + fp32 grad + grad in the logits dtype; from
    that go the logits the site keeps, the op's own working set (``peak_bytes``: chunk buffers, a dW accumulator)
    and, where the op forms the gradients in forward, dX and dW held from there to backward, where unfused
    training forms them. Negative where the op costs more: with fewer tokens than about the hidden size a V x H
    dW outweighs the logits, and at a small shape the working set does (1 MiB of it allocator slack)."""
    if not res.fused or res.tokens is None or res.site.vocab is None:
        return 0, ""
    n = res.tokens * res.site.vocab
    s = res.logits_dtype.itemsize
    unfused = n * (s + (4 if s != 4 else 0) + 4 + 4 + (s if s != 4 else 0))
    working, held = _op_bytes(res, cfg, options)
    saved = unfused - res.kept_logits_bytes - working - held
    if saved >= 0:
        return saved, ""
    if held >= working:
        return saved, "fewer tokens than about H: the dX and dW the op forms in forward and holds to backward"
    return saved, "a small shape: the op's working set, with 1 MiB of allocator slack, outweighs the logits"


def _op_bytes(res: SiteResult, cfg: FLCEConfig | None, options: FLCEOptions) -> tuple[int, int]:
    """The fused op's (working set, gradients it holds from forward to backward) for ``_memory_estimate``; zeros when
    they cannot be told (no config, a shape Dynamo left symbolic)."""
    hidden, lin = res.site.hidden, res.site.linear
    if cfg is None or not isinstance(hidden, int) or lin is None:
        return 0, 0
    from ..plan.memory import peak_bytes
    from ..plan.precision import accum_dtype_for
    from ..plan.registry import get as strategy_named

    dtype = meta_value(lin.start).dtype
    needs = _needs(res)
    try:
        working = peak_bytes(cfg, res.tokens, res.site.vocab, hidden, dtype,
                             accum_dtype_for(options.precision, None, dtype), device=res.device or "cpu", **needs)
    except (TypeError, ValueError):  # (reporting only)
        return 0, 0
    reduction = res.site.loss.reduction if res.site.loss is not None else "mean"
    if strategy_named(cfg.strategy).loop == "recompute" or reduction == "none":
        return working, 0  # the gradients are formed in backward, as unfused
    dw_columns = hidden - needs["frozen_columns"]
    held = needs["need_dx"] * res.tokens * hidden + needs["need_dw"] * res.site.vocab * dw_columns
    return working, held * dtype.itemsize


def report_graph(gm: fx.GraphModule, index: int = 0, options: FLCEOptions = FLCEOptions()) -> list[SiteReport]:
    """Site reports for one Dynamo graph under ``options``. ``gm`` is analyzed (which may fold a LoRA head into it);
    the rewrite is tried on a copy, so that a site the backend would leave unfused because its rewrite fails is
    reported so."""
    reports: list[SiteReport] = []
    failed = _rewrite_failures(gm, options)
    results = analyze_with_folded_heads(gm, options.logits)
    mark_unkept(results)  # (as the rewrite will find them)
    for res in results:
        site = res.site
        plan = res.plan
        why_unfused = failed.get(site.loss_node.name) or failed.get(None)
        if not options.enabled:
            res = SiteResult(site, "unchanged", "flce.enabled=False")
        elif res.fused and why_unfused:
            res = SiteResult(site, "unchanged", why_unfused)
        try:
            strategy, cfg = _strategy(res, options)
        except ValueError as exc:  # the memory budget fits no config: the backend raises (BudgetError)
            res, strategy, cfg = SiteResult(site, "unchanged", f"the compile raises: {exc}"), None, None
        estimate = _memory_estimate(res, cfg, options)
        reports.append(SiteReport(
            graph=index, loss=f"{site.loss_node.name} ({site.loss.form if site.loss else site.loss_node.target})",
            fused=res.fused, path=res.path, reason=res.reason, strategy=strategy,
            tokens=res.tokens, vocab=site.vocab, hidden=site.hidden, softcap=_softcap_text(plan),
            logit_scale=plan.logit_scale if plan else 1.0, logits_escape=bool(site.linear and site.escapes()),
            est_saved_bytes=estimate[0], cost_note=estimate[1], kept_logits_bytes=res.kept_logits_bytes, note=res.note,
            logits_users=res.logits_users, drop_frees=res.path != "kept_logits" or res.drop_frees,
        ))
    for head in lone_heads(gm, results):  # lm_heads whose loss is in another graph, or after the compiled code
        reports.append(SiteReport(
            graph=index, loss=f"{head.node.name} (lm_head-like {head.form}, output returned by the graph)",
            fused=False, path="unchanged", strategy=None, tokens=head.tokens, vocab=head.vocab, hidden=None,
            reason=LONE_HEAD if head.tensor_parallel else LONE_HEAD_REASON,
        ))
    return reports


def _rewrite_failures(gm: fx.GraphModule, options: FLCEOptions) -> dict[str | None, str]:
    """The backend's pass tried on a copy of ``gm`` (``rewrite.trial_pass``): loss node name -> why its rewrite
    failed, with the key None when the whole pass failed (the backend then compiles the graph as traced). Empty
    when nothing failed, and for a memory budget no config fits, which the site's report names already."""
    if not options.enabled or not has_loss_site(gm):
        return {}
    outcome = trial_pass(gm, logits=options.logits, config=options.config, precision=options.precision,
                         memory_budget_gb=options.memory_budget_gb)
    if isinstance(outcome, BudgetError):
        return {}
    if isinstance(outcome, Exception):
        return {None: f"the fusion pass failed on this graph ({outcome!r}): the backend logs it and compiles the "
                      f"graph unfused"}
    return {res.site.loss_node.name: res.reason for res in outcome.sites
            if res.path == "unchanged" and (res.reason or "").startswith(REWRITE_FAILED)}


def explain(model: nn.Module | Any, *args: Any, options: Mapping[str, Any] | None = None,
            **kwargs: Any) -> ExplainReport:
    """Run ``model(*args, **kwargs)`` under Dynamo and report what ``backend="flce"`` does with every
    lm_head/cross-entropy site.

    ``model`` may be compiled (``torch.compile(model, backend="flce", options=...)``, ``model.compile(...)``
    or a ``with_options`` backend): the report then follows the options it was compiled with. For an
    uncompiled model pass ``options=`` as you would to ``torch.compile``; ``options=`` also overrides a
    compiled model's. Returns an :class:`ExplainReport` (a list of :class:`SiteReport`) that prints as a
    table; it is also logged at INFO on the ``flce_compile`` logger.
    """
    opts = split_options(options)[0] if options is not None else compiled_options(model) or FLCEOptions()
    if opts.enabled:
        keep_loss_in_graph()  # as the backend does (``hf_logging``): the graphs it would get
    # The graphs the compiled model gets: floats left symbolic (say), checkpointed side effects run once.
    side_effects_once = checkpoint_side_effects.wanted(opts) and checkpoint_side_effects.flag_supported()
    with _dynamic_as(compiled_dynamic(model)), \
            checkpoint_side_effects.flag_on() if side_effects_once else contextlib.nullcontext():
        counted_before = Counter(torch._dynamo.utils.counters["graph_break"])
        out = torch._dynamo.explain(_uncompiled(model))(*args, **kwargs)
        counted = Counter(torch._dynamo.utils.counters["graph_break"]) - counted_before
    report = ExplainReport()
    report.counted_breaks = _counted_breaks(counted)
    report.options = opts
    report.graph_count = out.graph_count
    report.graph_breaks = [_break_text(b) for b in out.break_reasons]
    report.graph_break_count = int(getattr(out, "graph_break_count", len(report.graph_breaks)))
    report.notes = []
    for i, gm in enumerate(out.graphs):
        # As the passes do; explain's captured graphs are its own, so changing them is harmless.
        if opts.enabled and opts.causal_masks:
            masks = drop_causal_masks(gm)
            if masks.calls or masks.refused:
                report.notes.append(f"[graph {i}] attention: {masks}")
        regions = inline_fusable_checkpoints(gm, opts.logits) if opts.enabled else []
        report.notes += [f"[graph {i}] {r}" for r in regions if r.inlined]
        report.extend(SiteReport(graph=i, loss=f"loss site(s) in checkpointed region {r.name}", fused=False,
                                 path="unchanged", reason=str(r), strategy=None, tokens=None, vocab=None,
                                 hidden=None) for r in regions if not r.inlined)
        report.extend(report_graph(gm, i, opts))
    torch._dynamo.reset()  # explain's captured frames should not linger in the code cache
    if opts.enabled:
        keep_loss_in_graph()  # the reset dropped its compile-start callback
    hint = None if side_effects_once else _checkpoint_side_effect_hint(model)
    if hint is not None:
        report.notes.append(hint)
    logger.info("%s", report)
    return report


def _checkpoint_side_effect_hint(model: Any) -> str | None:
    """A note for a checkpointed Hugging Face model with the ``kernels`` package loaded (a dependency of
    transformers 5.25) while Dynamo refuses side effects inside checkpoints: the package's layer hook sets a
    context variable in each checkpointed forward, so Dynamo compiles such a model in pieces (the decoder layers
    left out, their attention masks kept; five graphs for a two-layer Llama). None otherwise."""
    import sys

    import torch._dynamo.config as dynamo_config

    from .checkpoint_side_effects import FLAG

    module = getattr(model, "_orig_mod", model)
    # transformers 5.25 renamed the property and warns on the old name (read only where the new one is missing).
    checkpointed = (module.is_activation_checkpointing if hasattr(type(module), "is_activation_checkpointing")
                    else getattr(module, "is_gradient_checkpointing", False))
    if "kernels" not in sys.modules or checkpointed is not True or getattr(dynamo_config, FLAG, True):
        return None
    return ("the model is checkpointed and the `kernels` package (which transformers 5.25 requires) is loaded: its "
            "layer hook sets a context variable inside each checkpointed forward, a side effect Dynamo refuses "
            "there, so the layers may run outside these graphs with their attention masks; "
            "flce.checkpoint_side_effects='once' (the default, with flce.enabled) or "
            "torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True before compiling gives one "
            "graph")


def _dynamic_as(dynamic: bool | None) -> contextlib.AbstractContextManager:
    """Dynamo's settings for ``torch.compile(dynamic=dynamic)``, as torch.compile applies them (None: as they
    are)."""
    if dynamic is None:
        return contextlib.nullcontext()
    if dynamic:
        return torch._dynamo.config.patch(assume_static_by_default=False)
    return torch._dynamo.config.patch(automatic_dynamic_shapes=False, assume_static_by_default=True)


def _uncompiled(model: Any) -> Any:
    """The callable a compiled model wraps: explain traces it afresh (the compiled one would run its cache)."""
    if getattr(model, "_orig_mod", None) is not None:  # torch.compile(module)
        model = model._orig_mod
    if isinstance(model, nn.Module) and getattr(model, "_compiled_call_impl", None) is not None:
        return model._call_impl  # module.compile(): the module's own, uncompiled call
    return getattr(model, "_torchdynamo_orig_callable", model)


def _counted_breaks(counted: Counter) -> list[str]:
    """Dynamo's break counters of one trace, by the first line of each reason (a first call can break where later
    ones do not: transformers installs its output hooks on the first forward, a setattr Dynamo cannot trace)."""
    by_text: Counter = Counter()
    for reason, times in counted.items():
        by_text[str(reason).strip().splitlines()[0]] += times
    return [f"{text} ({times}x)" for text, times in by_text.most_common(4)]


def _break_text(reason: Any) -> str:
    where = ""
    stack = getattr(reason, "user_stack", None)
    if stack:
        frame = stack[-1]
        where = f" at {frame.filename}:{frame.lineno}"
    return f"{getattr(reason, 'reason', reason)}".strip().splitlines()[0] + where
