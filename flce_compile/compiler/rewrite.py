"""Rewriting matched sites: the loss becomes one call of the fused op (or, when logits escape and are kept,
a chunked cross-entropy over those logits), and the logits path left dead is removed.

Shifts on the logits side (``logits[:, :-1]``) are replayed on the hidden states, a constant scale and a
Gemma2-style ``tanh`` softcap become the op's ``logit_scale`` / ``softcap``, and every cast/view in between is
dropped (the op flattens input and target itself and accumulates in fp32). The graph is only changed once a
site's new nodes are built and typed; a failure before that point leaves the graph as it was.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import fx

from ..log import logger
from .kept_logits import kept_logits_cross_entropy
from .patterns import Plan, Site, find_sites, fold_steps, hint_int, is_inplace, meta_value


def flce_fused_loss(
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
    compute_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """The graph-side call of the fused op (a stable node target for the inner compiler and for tests).

    The op is imported at call time so the compiler pass does not depend on import order, and the config
    travels as a plain dict so the generated graph code stays printable. ``compute_dtype`` is the dtype the
    lm_head computed its logits in when that differs from its input's (an autocast region that ended before
    the loss): input, weight and bias are cast to it, as autocast did for the lm_head.
    """
    from ..api import fused_linear_cross_entropy

    if compute_dtype is not None and input.dtype != compute_dtype:
        input, weight = input.to(compute_dtype), weight.to(compute_dtype)
        bias = bias.to(compute_dtype) if bias is not None else None
    # Rows line up after flattening both sides (the pattern check guarantees it), whatever view the loss saw.
    loss = fused_linear_cross_entropy(
        input.reshape(-1, weight.shape[1]), weight, target.reshape(-1), bias, ce_weight=ce_weight,
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing, softcap=softcap,
        logit_scale=logit_scale, config=config,
    )
    if reduction == "none":
        loss = loss.view(target.shape)
    return loss if loss.dtype == out_dtype else loss.to(out_dtype)


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
    """The graph-side call of the kept-logits loss (see ``kept_logits``)."""
    loss = kept_logits_cross_entropy(
        logits, target, ce_weight=ce_weight, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing, softcap=softcap, logit_scale=logit_scale,
    )
    return loss if loss.dtype == out_dtype else loss.to(out_dtype)


@dataclass
class SiteResult:
    """What the pass did with one loss site (the raw material of ``explain`` reports and of the logs)."""

    site: Site
    path: str  # "fused" | "kept_logits" | "unchanged"
    reason: str | None = None
    dropped_outputs: int = 0
    kept_logits_bytes: int = 0  # bytes of logits (+ their gradient) the graph still materializes
    tokens: int | None = None
    logits_dtype: torch.dtype | None = None
    device: torch.device | None = None
    new_node: fx.Node | None = None
    plan: Plan | None = None
    escapes: dict[fx.Node, list[fx.Node]] | None = None  # chain nodes that stay used outside the loss path
    dropped: list[fx.Node] | None = None  # chain nodes whose graph-output uses become None ("drop")

    @property
    def fused(self) -> bool:
        return self.path != "unchanged"


_warned_keep = False


def analyze(gm: fx.GraphModule, logits: str = "keep") -> list[SiteResult]:
    """Decide, without touching the graph, what the pass would do with each loss site."""
    results = []
    for site in find_sites(gm):
        try:
            results.append(_decide(site, logits))
        except Exception as exc:  # noqa: BLE001 - an unexpected graph shape: this site is left alone
            results.append(SiteResult(site, "unchanged", f"analysis failed: {exc!r}"))
    return results


def _mutation_between(site: Site) -> fx.Node | None:
    """An in-place op between the lm_head and the loss (it could change the hidden states or weight that the
    fused op, which runs where the loss ran, reads), or None."""
    node = site.linear.node.next
    while node is not site.loss_node and node.op != "output":
        if is_inplace(node):
            return node
        node = node.next
    return None


def _decide(site: Site, logits_mode: str) -> SiteResult:
    if site.reason is not None or site.linear is None:
        return SiteResult(site, "unchanged", site.reason or "no lm_head linear found")
    res = SiteResult(site, "unchanged")
    out = meta_value(site.linear.node)
    res.tokens = hint_int(out.numel() // out.shape[-1]) if out.dim() > 1 else 1
    res.logits_dtype, res.device = out.dtype, out.device
    all_escapes = site.escapes()
    escapes = site.escapes(ignore_output=True) if logits_mode == "drop" else all_escapes
    res.escapes = escapes
    res.dropped = [n for n in all_escapes if n not in escapes]
    res.dropped_outputs = len(res.dropped)
    if not escapes:
        plan = fold_steps(site, 0)
        if isinstance(plan, str):
            res.reason = plan
            return res
        mutation = _mutation_between(site)
        if mutation is not None:
            res.reason = f"in-place op {mutation.name} runs between the lm_head and the loss"
            return res
        res.path, res.plan = "fused", plan
        return res
    # Logits are used outside the loss path: keep computing them, take the loss from the last escaping node.
    chain = site.chain
    last = max(chain.index(n) for n in escapes)
    plan = fold_steps(site, last)
    if isinstance(plan, str):
        res.reason = f"logits are used outside the loss ({_users(escapes)}) and {plan}"
        return res
    base_val = meta_value(chain[last])
    res.path, res.plan = "kept_logits", plan
    n_elems = hint_int(base_val.numel()) or 0
    res.kept_logits_bytes = 2 * n_elems * base_val.element_size()
    if logits_mode == "drop":
        res.reason = f"logits feed other ops ({_users(escapes)}), so they cannot be dropped"
    return res


def _users(escapes: dict[fx.Node, list[fx.Node]]) -> str:
    names = sorted({u.name for users in escapes.values() for u in users})
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def run_pass(
    gm: fx.GraphModule,
    example_inputs: Any = None,
    *,
    logits: str = "keep",
    config: Optional[dict] = None,
) -> list[SiteResult]:
    """Rewrite every fusable site of ``gm`` in place and return one result per loss site.

    ``config`` holds forced FLCEConfig fields (see ``config_overrides``); each fused node carries them and the
    op chooses the rest at run time.

    Sites that can't be proven safe are left alone with their reason logged; an error while rewriting one
    site leaves that site untouched and is logged, never raised.
    """
    global _warned_keep
    results = analyze(gm, logits)
    fake_mode = _fake_mode(gm, example_inputs)
    dead: list[fx.Node] = []  # nodes our rewrites may have left without users
    for res in results:
        if not res.fused:
            logger.info("flce: loss %s not fused: %s", res.site.loss_node.name, res.reason)
            continue
        try:
            dead += _rewrite(gm, res, config, fake_mode)
        except Exception as exc:  # noqa: BLE001 - the pass must never break a compile
            logger.warning("flce: rewriting loss %s failed, left unfused: %r", res.site.loss_node.name, exc)
            res.path, res.reason = "unchanged", f"rewrite failed: {exc!r}"
            continue
        logger.info(
            "flce: loss %s -> %s (vocab %s, hidden %s, tokens~%s)", res.site.loss_node.name, res.path,
            res.site.vocab, res.site.hidden, res.tokens,
        )
        if res.path == "kept_logits" and not _warned_keep:
            _warned_keep = True
            logger.warning(
                "flce: the compiled graph returns its logits, so they are kept: about %.2f GB (logits and their "
                "gradient at the traced size) that the fused op alone would not use. The loss still takes the "
                "chunked path without a second logits GEMM. Pass options={'flce.logits': 'drop'} to return "
                "logits=None and save that memory.",
                res.kept_logits_bytes / 1e9,
            )
    if any(r.new_node is not None for r in results):
        _erase_dead(gm.graph, dead)
        gm.graph.lint()
        gm.recompile()
    return results


def _erase_dead(graph: fx.Graph, candidates: list[fx.Node]) -> None:
    """Erase the candidates left without users, then their inputs left without users, and so on.

    Not ``graph.eliminate_dead_code()``: that also removes the user's own unused in-place ops (a buffer's
    ``add_``, an input's ``clamp_``), which FX considers pure.
    """
    work, erased = list(candidates), set()
    while work:
        node = work.pop()
        if node in erased or node.users or not _removable(node):
            continue
        work.extend(node.all_input_nodes)
        graph.erase_node(node)
        erased.add(node)


def _removable(node: fx.Node) -> bool:
    if node.op not in ("call_function", "call_method", "call_module", "get_attr"):
        return False
    return not is_inplace(node) and not node.is_impure()


def _fake_mode(gm: fx.GraphModule, example_inputs: Any) -> Any:
    # The mode of the graph's own example values (the tensors new nodes are computed from) comes first.
    for node in gm.graph.nodes:
        val = meta_value(node)
        if isinstance(val, torch._subclasses.FakeTensor):
            return val.fake_mode
    from torch._guards import detect_fake_mode

    return detect_fake_mode(example_inputs) if example_inputs is not None else None


def _rewrite(gm: fx.GraphModule, res: SiteResult, config: Optional[dict], fake_mode: Any) -> list[fx.Node]:
    """Replace one site's loss node; returns the nodes that may have lost their last user."""
    site, plan = res.site, res.plan
    loss, lin = site.loss, site.linear
    graph = gm.graph
    loss_val = meta_value(loss.node)
    out_dtype = loss_val.dtype if isinstance(loss_val, torch.Tensor) else torch.float32
    new_nodes: list[fx.Node] = []

    def add(op: str, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        n = graph.create_node(op, target, args, kwargs or {})
        new_nodes.append(n)
        return n

    try:
        with graph.inserting_before(loss.node):
            ce_weight = loss.ce_weight
            if loss.ce_weight_attr is not None:
                ce_weight = add("get_attr", loss.ce_weight_attr, ())
            if res.path == "fused":
                x = lin.input
                for idx in plan.indices:
                    x = add("call_function", operator.getitem, (x, idx))
                bias = lin.bias
                if lin.module_target is not None:
                    weight = add("get_attr", f"{lin.module_target}.weight", ())
                    if gm.get_submodule(lin.module_target).bias is not None:
                        bias = add("get_attr", f"{lin.module_target}.bias", ())
                elif lin.weight_is_transposed:
                    weight = add("call_method", "t", (lin.weight,))
                else:
                    weight = lin.weight
                cfg = dict(config) if config else None
                x_val, logits_val = meta_value(lin.input), meta_value(lin.node)
                compute_dtype = logits_val.dtype if x_val.dtype != logits_val.dtype else None  # autocast
                new = add("call_function", flce_fused_loss, (
                    x, weight, loss.target, bias, ce_weight, loss.ignore_index, loss.reduction,
                    loss.label_smoothing, plan.softcap, plan.logit_scale, cfg, out_dtype, compute_dtype,
                ))
            else:
                chain = site.chain
                x = chain[max(chain.index(n) for n in res.escapes)]
                for idx in plan.indices:
                    x = add("call_function", operator.getitem, (x, idx))
                new = add("call_function", flce_kept_logits_loss, (
                    x, loss.target, ce_weight, loss.ignore_index, loss.reduction, loss.label_smoothing,
                    plan.softcap, plan.logit_scale, out_dtype,
                ))
        _propagate_meta(gm, new_nodes, fake_mode)
    except Exception:
        for n in reversed(new_nodes):
            graph.erase_node(n)
        raise
    # Commit: nothing below can fail halfway in a way that leaves a broken graph.
    new.meta.update({k: v for k, v in loss.node.meta.items() if k in ("stack_trace", "nn_module_stack", "source_fn_stack")})
    maybe_dead = list(loss.node.all_input_nodes) + site.chain + list(lin.node.all_input_nodes)
    loss.node.replace_all_uses_with(new)
    graph.erase_node(loss.node)
    if res.dropped_outputs:
        dropped = set(res.dropped)
        out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
        out_node.args = fx.node.map_arg(out_node.args, lambda n: None if n in dropped else n)
        maybe_dead += res.dropped
    res.new_node = new
    return maybe_dead


def _propagate_meta(gm: fx.GraphModule, nodes: list[fx.Node], fake_mode: Any) -> None:
    """Give new nodes the ``example_value`` Dynamo gives its own (some inner-compiler passes read it)."""
    if fake_mode is None:  # not a Dynamo graph (e.g. symbolic_trace + ShapeProp): nothing reads example_value
        return
    with fake_mode:
        for n in nodes:
            if n.op == "get_attr":
                val = gm
                for part in str(n.target).split("."):
                    val = getattr(val, part)
                n.meta["example_value"] = fake_mode.from_tensor(val)
                continue
            args = fx.node.map_arg(n.args, meta_value)
            kwargs = fx.node.map_arg(n.kwargs, meta_value)
            if n.op == "call_method":
                n.meta["example_value"] = getattr(args[0], n.target)(*args[1:], **kwargs)
            else:
                n.meta["example_value"] = n.target(*args, **kwargs)
