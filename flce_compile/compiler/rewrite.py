"""Rewriting matched sites (see ``decide`` for the paths): the loss, or the lm_head and the loss, become one
call of the fused op, or a chunked cross-entropy over logits the graph keeps, and the logits path left dead is
removed.

Shifts on the logits side (``logits[:, :-1]``) are replayed on the hidden states (or, when the op also returns
the logits, on the target, with ignore_index on the rows the loss does not see), a constant scale and a
Gemma2-style ``tanh`` softcap become the op's ``logit_scale`` / ``softcap`` (a softcap Dynamo left symbolic is
passed as the tensor it reads, on the fused paths), and every cast/view in between is
dropped (the op flattens input and target itself and accumulates in fp32). The graph is only changed once a
site's new nodes are built and typed; a failure before that point leaves the graph as it was.
"""

from __future__ import annotations

import logging
import operator
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import fx

from ..dtensor import is_dtensor
from ..kept_logits import kept_logits_cross_entropy
from ..log import logger
from ..plan.choose import BudgetError
from .checkpoints import CheckpointRegion, inline_fusable_checkpoints
from .decide import (LONE_HEAD_REASON, SHARED_NOTE, UNKEPT_NOTE, LoneHead, SiteResult, classifier_classes,
                     lone_heads, vocab_wide)
from .graph_meta import copy_source_meta, graph_fake_mode, propagate_meta
from .head_dtype import compute_operands, head_autocast_off, head_compute_dtype
from .lora_head import FROZEN_COLUMNS, analyze_with_folded_heads
from .mutations import erase_dead
from .outputs import LazyOutput, LogitsOutput, OutputFixup, flat_outputs, output_node
from .patterns import (HF_LOSS_TYPE_HINT, SYMBOLIC_FLOAT_FIX, checkpoint_body, find_sites, meta_value, own_bias,
                       runtime_softcap)
from .tensor_parallel import flce_vocab_parallel_loss, local_input


def flce_fused_loss(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor],
    ce_weight: Optional[torch.Tensor],
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    softcap: Optional[float | torch.Tensor],
    logit_scale: float,
    config: Optional[dict],
    out_dtype: torch.dtype,
    compute_dtype: Optional[torch.dtype] = None,
    *,
    precision: str = "exact",
    memory_budget_gb: Optional[float] = None,
    wide_bias: bool = False,
    frozen_weight_columns: int = 0,
) -> torch.Tensor:
    """The graph-side call of the fused op (a stable node target for the inner compiler and for tests).

    The op is imported at call time so the compiler pass does not depend on import order, and the config
    travels as a plain dict so the generated graph code stays printable. ``compute_dtype``: see
    ``head_dtype.compute_operands``. ``softcap`` is a constant, or the 0-dim CPU tensor Dynamo passes a symbolic
    float in (``patterns.runtime_float``), which the op reads at run time. ``wide_bias``: ``bias`` is an fp32 bias
    added to the 16-bit logits (``patterns.LinearMatch.wide_bias``), which the op adds to fp32 logits: it keeps its
    dtype where autocast's casts would round the head's own bias. ``frozen_weight_columns``: the weight's leading
    columns get no gradient (a LoRA fold's frozen head, ``lora_head.FROZEN_COLUMNS``).
    """
    from ..api import fused_linear_cross_entropy

    if wide_bias:
        input, weight, _ = compute_operands(input, weight, None, compute_dtype)
    else:
        input, weight, bias = compute_operands(input, weight, bias, compute_dtype)
    # Rows line up after flattening both sides (the pattern check guarantees it), whatever view the loss saw.
    with head_autocast_off(input):
        loss = fused_linear_cross_entropy(
            input.reshape(-1, weight.shape[1]), weight, target.reshape(-1), bias, ce_weight=ce_weight,
            ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing, softcap=softcap,
            logit_scale=logit_scale, config=config, precision=precision, memory_budget_gb=memory_budget_gb,
            frozen_weight_columns=frozen_weight_columns,
        )
    if reduction == "none":
        loss = loss.view(target.shape)
    return loss if loss.dtype == out_dtype else loss.to(out_dtype)


def flce_fused_loss_keep(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor],
    ce_weight: Optional[torch.Tensor],
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    softcap: Optional[float],
    logit_scale: float,
    config: Optional[dict],
    out_dtype: torch.dtype,
    compute_dtype: Optional[torch.dtype],
    indices: tuple,
    *,
    precision: str = "exact",
    memory_budget_gb: Optional[float] = None,
    frozen_weight_columns: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The graph-side call of the fused op that also returns the lm_head's logits: (loss, logits shaped like
    the lm_head's output).

    ``indices`` are the row selections the loss applied to the logits (``logits[:, :-1]``): the target is
    spread over all rows, with ``ignore_index`` on the rows the loss did not see, which leaves every
    reduction unchanged. ``frozen_weight_columns``: as for ``flce_fused_loss``.
    """
    from ..api import fused_linear_cross_entropy

    input, weight, bias = compute_operands(input, weight, bias, compute_dtype)
    if indices:
        full = target.new_full(input.shape[:-1], ignore_index)
        rows, rank = full, input.dim()
        for index in indices:
            index = _row_index(index, rank)
            rank -= sum(isinstance(i, int) for i in index)
            rows = rows[index]
        rows.copy_(target.reshape(rows.shape))
        target = full
    else:
        target = target.reshape(input.shape[:-1])  # rows line up after flattening (the pattern check)
    with head_autocast_off(input):
        loss, logits = fused_linear_cross_entropy(
            input, weight, target, bias, ce_weight=ce_weight, ignore_index=ignore_index, reduction=reduction,
            label_smoothing=label_smoothing, softcap=softcap, logit_scale=logit_scale, config=config,
            return_logits=True, precision=precision, memory_budget_gb=memory_budget_gb,
            frozen_weight_columns=frozen_weight_columns,
        )
    return (loss if loss.dtype == out_dtype else loss.to(out_dtype)), logits


def _row_index(index: Any, rank: int) -> tuple:
    """A logits index (token dims then, optionally, a full slice of the vocab dim) as an index of the token
    dims only: Ellipsis expanded, the vocab entry dropped."""
    items = index if isinstance(index, tuple) else (index,)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items = items[:at] + (slice(None),) * (rank - len(items) + 1) + items[at + 1:]
    return tuple(items[: rank - 1])


def flce_kept_logits_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    ce_weight: Optional[torch.Tensor],
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    softcap: Optional[float],
    logit_scale: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The graph-side call of the kept-logits loss (see ``flce_compile.kept_logits``)."""
    loss = kept_logits_cross_entropy(
        logits, target, ce_weight=ce_weight, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing, softcap=softcap, logit_scale=logit_scale,
    )
    return loss if loss.dtype == out_dtype else loss.to(out_dtype)


@dataclass
class PassResult:
    """The sites of one graph and, when its outputs changed, what restores them around the compiled graph."""

    sites: list[SiteResult]
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None
    regions: list[CheckpointRegion] = field(default_factory=list)  # checkpointed regions holding sites


#: The start of the reason of a site whose rewrite raised (left unfused, the pass goes on).
REWRITE_FAILED = "rewrite failed"

_logged_keep = False
_logged_lazy = False
_warned_kept_logits = False
_warned_graph_break = False
_warned_symbolic_float = False
_warned_unfused = False


def run_pass(
    gm: fx.GraphModule,
    example_inputs: Any = None,
    *,
    logits: str = "keep",
    config: Optional[dict] = None,
    precision: str = "exact",
    memory_budget_gb: Optional[float] = None,
) -> PassResult:
    """Rewrite every fusable site of ``gm`` in place; returns one result per loss site and, when the graph's
    outputs changed, the wrapper the compiled graph needs (``PassResult.wrap``).

    ``config`` holds forced FLCEConfig fields (see ``config_overrides``); each fused node carries them and the
    op chooses the rest at run time.

    Sites that can't be proven safe are left alone with their reason logged; an error while rewriting one
    site leaves that site untouched and is logged, never raised.
    """
    regions = inline_fusable_checkpoints(gm, logits)
    for region in regions:
        if region.unfused:  # as a site outside a region is logged (a warning where the fix is one line)
            for res in region.unfused:
                _log_unfused(res)
        else:
            logger.info("flce: %s", region)
    fake_mode = graph_fake_mode(gm, example_inputs)
    results = analyze_with_folded_heads(gm, logits, fake_mode)
    for head in lone_heads(gm, results):
        _log_lone_head(head)
    fixup = OutputFixup()
    dead: list[fx.Node] = []  # nodes our rewrites may have left without users
    rewritten: list[SiteResult] = []
    for res in results:
        if res.fused and res.path == "vocab_parallel" and precision == "precise":
            # The vocabulary-parallel op refuses it when the graph runs; decide here, where the site can stay.
            res.path, res.reason = "unchanged", ("flce.precision='precise' is not supported by the "
                                                 "vocabulary-parallel op; use 'exact' or 'compact'")
        if not res.fused:
            _log_unfused(res)
            continue
        if res.path == "vocab_parallel" and memory_budget_gb is not None:
            logger.info("flce: loss %s: flce.memory_budget_gb does not apply to the vocabulary-parallel op "
                        "(its memory is one chunk of its slice of the logits)", res.site.loss_node.name)
        try:
            dead += _rewrite(gm, res, config, fake_mode, fixup, _op_kwargs(precision, memory_budget_gb))
        except BudgetError:  # flce.memory_budget_gb that nothing fits: unfused, the loss would use more still
            raise
        except Exception as exc:  # noqa: BLE001 - the pass must never break a compile otherwise
            logger.warning("flce: rewriting loss %s failed, left unfused: %r", res.site.loss_node.name, exc)
            res.path, res.reason = "unchanged", f"{REWRITE_FAILED}: {exc!r}"
            continue
        rewritten.append(res)
    if rewritten:
        erase_dead(gm, dead)
        unkept = [res for res in rewritten if res.path == "fused_keep" and not _logits_read(_keep_node(res.new_node))]
        for res in unkept:
            _unkeep(gm, res, fake_mode)
        kept_heads = {res.site.linear.node for res in rewritten if res.path == "fused_keep"}
        for res in unkept:  # (as ``decide.mark_unkept`` reports them)
            res.note = SHARED_NOTE if res.site.linear.node in kept_heads else UNKEPT_NOTE
    for res in rewritten:
        _log_rewrite(res)
    wrap = None
    if rewritten:
        wrap = fixup.apply(gm)
        gm.graph.lint()
        gm.recompile()
    return PassResult(results, wrap, regions)


def trial_pass(gm: fx.GraphModule, **options: Any) -> PassResult | Exception:
    """What ``run_pass(gm, **options)`` does, tried on a copy of ``gm`` without a word in the logs (the pass's own
    logs come when the graph is compiled): its result, or the exception it raises (the backend logs a failure and
    compiles the graph as traced). For ``explain``, which otherwise only analyzes: a site whose rewrite fails, or a
    pass that fails as a whole, is reported as the backend leaves it, unfused. The trial's thread logs nothing from
    the compiler's modules and sets none of the once-a-process flags above (``_in_trial``): another thread's compile
    still warns as it would, and so does the tuning DB's reading, should the pass's config choice read it."""
    from .graph_meta import copy_graph

    quiet = _TrialRecords()
    logger.addFilter(quiet)
    _trial.active = True
    try:
        return run_pass(fx.GraphModule(gm, copy_graph(gm.graph)), **options)
    except Exception as exc:  # noqa: BLE001 - reported, as the backend logs it
        return exc
    finally:
        _trial.active = False
        logger.removeFilter(quiet)


#: ``_trial.active``: this thread runs ``trial_pass`` (the log helpers below then neither log nor set their flags).
_trial = threading.local()


def _in_trial() -> bool:
    return getattr(_trial, "active", False)


class _TrialRecords(logging.Filter):
    """Drops the records the compiler's modules log in a thread that runs a trial (``_in_trial``; a logger's
    filters run in the logging thread), no other."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_in_trial() and record.pathname.startswith(_COMPILER_DIR))


_COMPILER_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def has_loss_site(gm: fx.GraphModule) -> bool:
    """Whether ``gm``, or the body of a checkpointed region in it, holds a loss call ``run_pass`` looks at (fusable
    or not). Without one the pass changes nothing and only reports the graph's lone lm_heads
    (``report_lone_heads``): the backend then spares its copy of the graph (``graph_meta.copy_graph``). Reads only."""
    if find_sites(gm):
        return True
    bodies = (checkpoint_body(gm, node) for node in gm.graph.nodes)
    return any(found is not None and find_sites(found[1]) for found in bodies)


def report_lone_heads(gm: fx.GraphModule) -> None:
    """Log the lm_heads of a graph with no loss site, as ``run_pass`` logs them (``decide.lone_heads``)."""
    for head in lone_heads(gm, []):
        _log_lone_head(head)


def _keep_node(result: fx.Node) -> fx.Node:
    """The ``flce_fused_loss_keep`` node a fused_keep site's loss (``SiteResult.new_node``) comes from."""
    node = result
    while node.target is not flce_fused_loss_keep:  # through the loss's getitem, and a neg or squeeze after it
        node = node.args[0]
    return node


def _logits_read(keep: fx.Node) -> bool:
    """Whether anything reads the logits a ``flce_fused_loss_keep`` node returns."""
    return any(user.args[1] == 1 and user.users for user in keep.users)


def _unkeep(gm: fx.GraphModule, res: SiteResult, fake_mode: Any) -> None:
    """A fused_keep site whose kept logits nothing reads once every site is rewritten becomes a plain fused loss,
    where the keep node was. Two losses on the same logits (a label-smoothed one beside a plain one for logging):
    the first rewritten takes every reader of the logits, so the second's are unread; the first's are too when the
    other loss was their only reader, and then the logits, the size of eager's, are not formed at all."""
    keep = _keep_node(res.new_node)
    x, weight, target, bias, *rest = keep.args
    *loss_args, indices = rest
    new = _NewNodes(gm.graph)
    with gm.graph.inserting_before(keep):
        for index in indices:
            x = new.add("call_function", operator.getitem, (x, index))
        fused = new.add("call_function", flce_fused_loss, (x, weight, target, bias, *loss_args), dict(keep.kwargs))
    propagate_meta(gm, new.nodes, fake_mode)
    for user in list(keep.users):
        if user.args[1] == 0:
            user.replace_all_uses_with(fused)
            if res.new_node is user:
                res.new_node = fused
        gm.graph.erase_node(user)
    copy_source_meta(keep, fused)
    gm.graph.erase_node(keep)
    res.path, res.kept_logits_bytes = "fused", 0


def _log_unfused(res: SiteResult) -> None:
    """A WARNING for the first site left unfused in a process (the user compiled with backend="flce" and this loss
    keeps its logits: without it the loss was silent unless INFO was on), INFO for later ones; a WARNING, once a
    process each, for reasons with a one-line fix: a softcap or scale Dynamo left symbolic (``dynamic=True``), or a
    loss whose logits come from outside the compiled graph (only the loss was compiled, or a graph break separates
    it from the lm_head, whose usual cause in Hugging Face models has a one-line fix)."""
    global _warned_graph_break, _warned_symbolic_float, _warned_unfused
    if _in_trial():
        return
    if SYMBOLIC_FLOAT_FIX in (res.reason or "") and not _warned_symbolic_float:
        _warned_symbolic_float = True  # a model that fuses without dynamic=True: the user loses the fusion silently
        logger.warning("flce: loss %s not fused: %s", res.site.loss_node.name, res.reason)
        return
    if res.site.from_outside_graph and not _warned_graph_break:
        _warned_graph_break = True
        logger.warning(
            "flce: loss %s not fused: its logits come from outside the compiled graph, and the lm_head must be in "
            "the same graph as the loss. If a graph break separates them, flce_compile.explain(model, ...) shows "
            "where; %s.", res.site.loss_node.name, HF_LOSS_TYPE_HINT)
        return
    outputs = classifier_classes(res.site)
    if outputs is not None:  # a classifier's few classes (a question-answering head's 2): no logits worth a warning
        logger.info("flce: loss %s not fused (its linear has %d outputs, fewer than twice its input's width: not "
                    "logits worth a warning): %s", res.site.loss_node.name, outputs, res.reason)
        return
    if not (_warned_unfused or res.site.from_outside_graph):  # (that one's warning is the graph break's, above)
        _warned_unfused = True
        logger.warning("flce: loss %s not fused: %s. Its logits are formed as without the backend; "
                       "flce_compile.explain(model, ...) reports every site (later ones are logged at INFO).",
                       res.site.loss_node.name, res.reason)
        return
    logger.info("flce: loss %s not fused: %s", res.site.loss_node.name, res.reason)


def _log_lone_head(head: LoneHead) -> None:
    """INFO for an lm_head whose logits the graph returns with no loss reading them; a WARNING, once a process (with
    a loss whose logits come from outside the graph: the same split, seen from the loss's side), when they require
    grad: a training loop computes the loss after the compiled code, and nothing is fused."""
    global _warned_graph_break
    if head.tensor_parallel or _in_trial():
        return  # (its loss under loss_parallel() after the compiled code is tensor_parallel's advice, in explain)
    warn = head.requires_grad and not _warned_graph_break
    _warned_graph_break = _warned_graph_break or warn
    logger.log(logging.WARNING if warn else logging.INFO, "flce: lm_head %s (V=%s, tokens~%s) not fused: %s.",
               head.node.name, head.vocab, head.tokens, LONE_HEAD_REASON)


def _log_rewrite(res: SiteResult) -> None:
    global _logged_keep, _logged_lazy, _warned_kept_logits
    if _in_trial():
        return
    logger.info("flce: loss %s -> %s (vocab %s, hidden %s, tokens~%s)%s", res.site.loss_node.name, res.path,
                res.site.vocab, res.site.hidden, res.tokens, f"; {res.note}" if res.note else "")
    if res.path == "fused_lazy" and not _logged_lazy:
        _logged_lazy = True
        logger.info(
            "flce: the compiled graph returns its logits: they are computed when first read, outside the graph, "
            "so a loop that reads only the loss never forms them. options={'flce.logits': 'materialize'} computes "
            "them in the forward; 'drop' returns logits=None.")
    if res.path == "fused_keep" and not _logged_keep:
        _logged_keep = True
        gb = res.kept_logits_bytes / 1e9
        if res.logits_users:  # (a z-loss, a metric): "drop" frees only logits that are returned
            logger.info(
                "flce: the compiled graph's own ops read its logits (%s), so they are formed, exact: %.2f GB at the "
                "traced size. The loss and the lm_head's gradients are fused around them and nothing logits-sized "
                "is saved for backward%s.", ", ".join(res.logits_users[:4]), gb,
                " (a gradient those ops give the logits is formed in backward)" if res.logits_graded else "")
        else:
            logger.info(
                "flce: the compiled graph returns its logits, so they are kept, exact: %.2f GB at the traced size. "
                "The loss and the lm_head's gradients are fused around them and nothing logits-sized is saved for "
                "backward. options={'flce.logits': 'drop'} returns logits=None and saves those %.2f GB.", gb, gb)
    if res.path == "kept_logits" and not _warned_kept_logits:
        # "drop" frees only logits the graph returns, and fuses only a loss whose steps the op takes: not ones its
        # own ops read (an entropy beside log-probs), nor a sequence classifier's pick of each sequence's last token.
        if res.logits_users:
            fix = f"; the graph's own ops read them ({', '.join(res.logits_users[:4])})"
        else:
            fix = ("; options={'flce.logits': 'drop'} fuses the loss and frees them when nothing but the graph's "
                   "outputs needs the logits" if res.drop_frees else "")
        # A WARNING for vocabulary-sized logits; a classifier's few classes hold little (INFO, not marked warned).
        vocab_sized = vocab_wide(res.site.vocab or 0, res.site.hidden or 0)
        _warned_kept_logits = vocab_sized
        graded = bool(getattr(meta_value(res.site.linear.node), "requires_grad", True))  # (not in an evaluation)
        logger.log(logging.WARNING if vocab_sized else logging.INFO,
                   "flce: loss %s is taken from the logits the graph keeps (%s): about %.2f GB of logits%s stay%s.",
                   res.site.loss_node.name, res.note, res.kept_logits_bytes / 1e9,
                   " and their gradient" if graded else "", fix)


class _NewNodes:
    """The nodes one rewrite creates; erased again when the rewrite fails before it commits."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph, self.nodes = graph, []

    def add(self, op: str, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        node = self.graph.create_node(op, target, args, kwargs or {})
        self.nodes.append(node)
        return node

    def rollback(self) -> None:
        for node in reversed(self.nodes):
            self.graph.erase_node(node)


def _gathered_rows(new: _NewNodes, x: fx.Node, loss: Any) -> fx.Node:
    """``x`` (the rows the loss reads, hidden states or logits) narrowed to the size of a log-prob gather's index
    in each token dim where it may hold fewer rows than the log-probs (``LossMatch.narrow_dims``: gather reads a
    prefix of each); ``x`` itself for every other loss."""
    for dim in loss.narrow_dims:
        size = new.add("call_method", "size", (loss.target, dim))
        x = new.add("call_method", "narrow", (x, dim, 0, size))
    return x


def _op_kwargs(precision: str, memory_budget_gb: Optional[float]) -> dict[str, Any]:
    """The fused op's keyword arguments from the backend options, left out at their defaults (readable
    graphs)."""
    kwargs: dict[str, Any] = {}
    if precision != "exact":
        kwargs["precision"] = precision
    if memory_budget_gb is not None:
        kwargs["memory_budget_gb"] = memory_budget_gb
    return kwargs


def _nodes_before(graph: fx.Graph, node: fx.Node) -> set[fx.Node]:
    """The nodes of ``graph`` that come before ``node``."""
    before = set()
    for n in graph.nodes:
        if n is node:
            return before
        before.add(n)
    raise ValueError(f"{node.name} is not in the graph")


def _rewrite(gm: fx.GraphModule, res: SiteResult, config: Optional[dict], fake_mode: Any,
             fixup: OutputFixup, op_kwargs: dict[str, Any]) -> list[fx.Node]:
    """Rewrite one site; returns the nodes that may have lost their last user."""
    site, plan, loss, lin = res.site, res.plan, res.site.loss, res.site.linear
    loss_val = meta_value(loss.node)
    out_dtype = loss_val.dtype if isinstance(loss_val, torch.Tensor) else torch.float32
    cfg = dict(config) if config else None
    # Uses of the logits nothing reads did not count as escapes (``Site.unread_uses``): erased with the chain, they
    # free the logits. Taken before the op's nodes join the chain's users.
    unread = site.unread_uses()
    new = _NewNodes(gm.graph)
    if res.path == "fused_keep":
        # The target's computation, proven pure and unwritten, now comes first; a node another site on this head
        # moved already stays where it is (before that site's op, which reads it).
        placed = _nodes_before(gm.graph, lin.start)
        for node in res.prelude:
            if node not in placed:
                lin.start.prepend(node)
    anchor = lin.start if res.path == "fused_keep" else loss.node
    try:
        with gm.graph.inserting_before(anchor):
            ce_weight = new.add("get_attr", loss.ce_weight_attr, ()) if loss.ce_weight_attr else loss.ce_weight
            softcap = _runtime_softcap_tensor(new, plan.softcap) if runtime_softcap(plan) else plan.softcap
            loss_args = (ce_weight, loss.ignore_index, loss.reduction, loss.label_smoothing, softcap,
                         plan.logit_scale)
            if res.path == "vocab_parallel":
                weight, bias = _head_operands(gm, lin, new)
                x = local_input(site)
                for idx in plan.indices:
                    x = new.add("call_function", operator.getitem, (x, idx))
                x, weight_read, bias_read = _detached_without_grad(new, lin, (x, weight, bias))
                result = new.add("call_function", flce_vocab_parallel_loss, (
                    x, weight_read, loss.target, bias_read, *loss_args, cfg, out_dtype, is_dtensor(loss_val),
                    head_compute_dtype(gm, lin)),
                    {k: v for k, v in op_kwargs.items() if k == "precision"})
            elif res.path == "kept_logits":
                x = site.chain[max(site.chain.index(n) for n in res.escapes)]
                for idx in plan.indices:
                    x = new.add("call_function", operator.getitem, (x, idx))
                x = _gathered_rows(new, x, loss)
                result = new.add("call_function", flce_kept_logits_loss, (x, loss.target, *loss_args, out_dtype))
            else:
                weight, bias = _head_operands(gm, lin, new)
                tail = (cfg, out_dtype, head_compute_dtype(gm, lin))
                frozen = lin.start.meta.get(FROZEN_COLUMNS)  # a LoRA fold's frozen head (``lora_head``)
                op_kwargs = {**op_kwargs, "frozen_weight_columns": frozen} if frozen else op_kwargs
                if res.path in ("fused", "fused_lazy"):
                    x = lin.input
                    for idx in plan.indices:
                        x = new.add("call_function", operator.getitem, (x, idx))
                    x = _gathered_rows(new, x, loss)
                    operands = _detached_without_grad(new, lin, (x, weight, bias))
                    result = new.add("call_function", flce_fused_loss, (
                        operands[0], operands[1], loss.target, operands[2], *loss_args, *tail),
                        {**op_kwargs, "wide_bias": True} if lin.wide_bias else op_kwargs)
                else:
                    both = new.add("call_function", flce_fused_loss_keep, (
                        lin.input, weight, loss.target, bias, *loss_args, *tail, tuple(plan.indices)), op_kwargs)
                    result = new.add("call_function", operator.getitem, (both, 0))
                    logits = new.add("call_function", operator.getitem, (both, 1))
                    attach = bool(res.logits_outputs) and flat_outputs(gm.graph) is not None
                    if res.logits_outputs and not attach:
                        res.logits_outputs, res.note = {}, "the graph's outputs are not a flat tuple"
                    graph_logits = new.add("call_method", "detach", (logits,)) if attach else logits
            if loss.kind == "log_prob_gather" and loss.negated:  # the per-token loss, shaped like the index, is
                result = new.add("call_function", operator.neg, (result,))  # the negated log-prob
            if loss.squeezed:  # a difference of the pick, squeezed, and the logsumexp (``match_log_prob_difference``)
                result = new.add("call_method", "squeeze", (result, -1))
        propagate_meta(gm, new.nodes, fake_mode)
    except Exception:
        new.rollback()
        raise
    # Commit: nothing below can fail halfway in a way that leaves a broken graph.
    copy_source_meta(loss.node, result)
    maybe_dead = list(loss.node.all_input_nodes) + site.chain + list(lin.node.all_input_nodes) + unread
    if res.dropped_outputs:  # first: the kept logits below take the lm_head's uses, its graph output's too
        dropped = set(res.dropped)
        out_node = output_node(gm.graph)
        out_node.args = fx.node.map_arg(out_node.args, lambda n: None if n in dropped else n)
        maybe_dead += res.dropped
    if res.path == "fused_keep":
        lin.node.replace_all_uses_with(graph_logits)
        for node, transform in res.logits_outputs.items():
            # A transform's softcap read at run time is the op's: both fold the same steps of the one chain.
            runtime = runtime_softcap(transform)
            fixup.logits.append(LogitsOutput(
                graph_logits if node is lin.node else node, fixup.add_pieces(lin.input), fixup.add_pieces(weight),
                fixup.add_extra(bias) if bias is not None else None, transform.logit_scale,
                None if runtime else transform.softcap, fixup.add_extra(softcap) if runtime else None,
            ))
    if res.path == "fused_lazy":
        maybe_dead += _lazy_outputs(gm, res, lin, weight, bias, fixup)
    loss.node.replace_all_uses_with(result)
    gm.graph.erase_node(loss.node)
    res.new_node = result
    return maybe_dead


def _detached_without_grad(new: _NewNodes, lin: Any, operands: tuple) -> tuple:
    """``operands`` (the op's input, weight and bias nodes), each detached where the head ran without grad (under
    no_grad, say): the op runs where the loss does, maybe with grad, and no gradient may reach them, as none
    reaches eager's logits."""
    if meta_value(lin.node).requires_grad:
        return operands
    return tuple(new.add("call_method", "detach", (t,)) if isinstance(t, fx.Node) else t for t in operands)


def _lazy_outputs(gm: fx.GraphModule, res: SiteResult, lin: Any, weight: fx.Node, bias: fx.Node | None,
                  fixup: OutputFixup) -> list[fx.Node]:
    """The fused_lazy site's logits outputs leave the graph (None there, as dropped ones): the wrapper puts a
    LazyLogits in each place, computed from the lm_head's operands (extra outputs) through the steps the graph took
    from the lm_head to that output, copied into a graph of their own (``decide.lazy_steps``). Returns the returned
    nodes, which may now be dead."""
    out_node = output_node(gm.graph)
    items = flat_outputs(gm.graph)
    dtype = meta_value(lin.node).dtype
    # A bias added to the output of a head with none of its own is added after the GEMM here, as eager adds it:
    # the op folds it into its GEMM (one rounding, which in 16 bits can differ from eager's sum in the last bit),
    # and the returned logits stay eager's.
    gemm_dtype = meta_value(lin.gemm).dtype if lin.added_bias is not None and own_bias(gm, lin) is None else None
    for node, steps in res.lazy_outputs.items():
        replay = fx.Graph()
        env = {lin.node: replay.placeholder("logits")}
        for step in steps:
            env[step] = replay.node_copy(step, env.__getitem__)
        replay.output(env[node])
        fixup.lazy.append(LazyOutput(
            [i for i, item in enumerate(items) if item is node], fixup.add_pieces(lin.input), fixup.add_pieces(weight),
            fixup.add_extra(bias) if bias is not None else None, fx.GraphModule(torch.nn.Module(), replay), dtype,
            gemm_dtype))
    lazy = set(res.lazy_outputs)
    out_node.args = fx.node.map_arg(out_node.args, lambda n: None if n in lazy else n)
    return list(lazy)


def _runtime_softcap_tensor(new: _NewNodes, scalar: fx.Node) -> fx.Node:
    """The op's softcap argument for a softcap Dynamo left symbolic (``scalar``, its ``item()`` node): a 0-dim
    CPU fp64 tensor, ``ones * scalar``. Not the graph input itself: AOT autograd's pass that turns symbolic
    floats into tensors (``tensorify_python_scalars``) specializes any float it finds no arithmetic on, and
    Dynamo then traces the frame again with the value as a constant (a recompile per value); the product is
    such arithmetic, which the pass turns into a read of the graph input at run time."""
    one = new.add("call_function", torch.ones, ((),), {"dtype": torch.float64, "device": "cpu"})
    return new.add("call_function", operator.mul, (one, scalar))


def _head_operands(gm: fx.GraphModule, lin: Any, new: _NewNodes) -> tuple[fx.Node, fx.Node | None]:
    """The lm_head's weight (V, H) and bias as graph nodes: the GEMM's bias plus a bias added to its output
    (``patterns._biased_head``), flattened to (V,), when there is one."""
    bias = lin.bias
    if lin.module_target is not None:
        weight = new.add("get_attr", f"{lin.module_target}.weight", ())
        if own_bias(gm, lin) is not None:
            bias = new.add("get_attr", f"{lin.module_target}.bias", ())
    elif lin.weight_is_transposed:
        weight = new.add("call_method", "t", (lin.weight,))
    else:
        weight = lin.weight
    if lin.added_bias is not None:
        added = new.add("call_method", "reshape", (lin.added_bias, -1))
        dtype = meta_value(lin.gemm).dtype
        # A narrower bias (bf16 on fp32 logits) is exact in theirs. A wider one (``wide_bias``, the head then has
        # no bias of its own) is added by the op to fp32 logits, in fp32 (a bf16 bias on fp16 logits promotes to
        # fp32 as well, and is exact there).
        cast_to = torch.float32 if lin.wide_bias else dtype
        if meta_value(lin.added_bias).dtype != cast_to:
            added = new.add("call_method", "to", (added, cast_to))
        bias = added if bias is None else new.add("call_function", operator.add, (bias, added))
    return weight, bias
