"""Loss sites inside activation-checkpointed regions: moved out of the region so the pass can fuse them.

Dynamo turns ``torch.utils.checkpoint.checkpoint(fn, ...)`` (non-reentrant) into one
``tag_activation_checkpoint`` call whose body is a subgraph; a lm_head and its loss written inside such a
region (a common way to avoid keeping the logits) are invisible to a pass over the outer graph. Checkpointing
them gains nothing once they are fused: the op keeps no activations worth recomputing, and a fused op inside a
checkpoint would run twice (its gradients are computed in forward). So a region whose body holds a site the
pass would fuse is inlined into the outer graph; the rest of that region's ops are then no longer recomputed
in backward (each region is reported). A region that cannot be inlined is left as it is, with the reason, as is
one whose head and loss cannot be fused (reported like a site outside a region).

A region may hold the loss alone, its logits formed by an lm_head before it (``checkpoint(loss_fn, logits,
labels)``, written to recompute the loss's fp32 copy and softmax in backward): the site is then the outer graph's
head and the body's loss, so the region is inlined into a copy of the outer graph first, and into the graph itself
only where the analysis of that copy fuses them with no logits formed in the forward (where it does not, the
checkpoint is what saves memory, and stays).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx

from ..log import logger
from .decide import SiteResult, analyze
from .graph_meta import copy_graph
from .lora_head import analyze_with_folded_heads
from .patterns import checkpoint_body, outer_floats, runtime_float


@dataclass
class CheckpointRegion:
    """A checkpointed region whose body holds a fusable loss site, or only loss sites that cannot be fused
    (``unfused``: then it stays, and the pass and ``explain`` report them as they would outside a region)."""

    name: str  # the body's attribute name, e.g. wrap_body_0
    sites: int  # fusable loss sites in its body (unfusable ones when there is none)
    other_ops: int  # ops of the body that are not part of those sites' head and loss (no longer recomputed)
    inlined: bool = False
    reason: str | None = None  # why it was not inlined
    unfused: list[SiteResult] = field(default_factory=list)  # its loss sites, when none can be fused
    outer_head: bool = False  # its losses read logits formed before the region, by an lm_head of the outer graph

    def __str__(self) -> str:
        if not self.inlined:
            return f"checkpointed region {self.name}: its {self.sites} loss site(s) stay unfused: {self.reason}"
        extra = f"; {self.other_ops} other op(s) of the region are no longer recomputed" if self.other_ops else ""
        heads = " with the lm_head before it" if self.outer_head else ""
        return f"checkpointed region {self.name}: moved out of the checkpoint to fuse its loss site(s){heads}{extra}"


def body_placeholders(node: fx.Node, body: fx.GraphModule) -> list[fx.Node] | None:
    """The placeholders of ``body``, one for each operand of checkpoint call ``node`` (``node.args[1:]``) in
    order, or None when they do not map one to one."""
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    return placeholders if len(placeholders) == len(node.args) - 1 else None


def inline_fusable_checkpoints(gm: fx.GraphModule, logits: str = "keep") -> list[CheckpointRegion]:
    """Inline (in place) every checkpointed region of ``gm`` whose body holds a loss site the pass would fuse
    under ``logits``; returns one record per such region, and one per region left as it is whose body holds only
    loss sites that cannot be fused (``CheckpointRegion.unfused``, so that they are reported)."""
    regions = []
    for node in list(gm.graph.nodes):
        found = checkpoint_body(gm, node)
        if found is None:
            continue
        name, body = found
        placeholders = body_placeholders(node, body) or []
        floats = {p: a for p, a in zip(placeholders, node.args[1:]) if runtime_float(a) is not None}
        with outer_floats(floats):  # a float read before the region too: inlined, the op reads it at run time
            analyzed = analyze(body, logits)
        results = [r for r in analyzed if r.fused]
        if not results and any(r.site.from_outside_graph for r in analyzed):
            # A loss whose logits come into the region: its site is the outer graph's lm_head and this loss, which
            # only the outer graph, with the region inlined, shows.
            region = _inline_for_outer_heads(gm, node, name, body, logits)
            if region is not None:
                regions.append(region)
                continue
        if not results:
            # A head and loss the body holds, left as they are: named as outside a region.
            unfused = [r for r in analyzed if not r.site.from_outside_graph]
            if unfused:
                reason = "; ".join(f"{r.site.loss_node.name}: {r.reason}" for r in unfused)
                regions.append(CheckpointRegion(name, len(unfused), 0, reason=reason, unfused=unfused))
            continue
        region = CheckpointRegion(name, len(results), _other_ops(body, results))
        region.reason = _inline(gm, node, body)
        region.inlined = region.reason is None
        regions.append(region)
    if any(r.inlined for r in regions):
        gm.graph.lint()
        gm.recompile()
    return regions


def _other_ops(body: fx.GraphModule, results: list[SiteResult], copied: dict | None = None) -> int:
    """How many ops of ``body`` are not part of the fused sites ``results`` (their logits chain, loss and target):
    the ops inlining the region no longer recomputes. ``copied`` maps body nodes to the nodes ``results`` name,
    where the results are of a graph the body was inlined into."""
    site_nodes = {n for r in results for n in (r.site.chain + [r.site.loss_node])}
    work = [n for r in results for n in (r.site.loss.target, r.site.loss.ce_weight) if isinstance(n, fx.Node)]
    while work:  # the target's own computation belongs to the site too
        n = work.pop()
        if n.op != "placeholder" and n not in site_nodes:
            site_nodes.add(n)
            work.extend(n.all_input_nodes)
    ops = [n for n in body.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    return len([n for n in ops if (copied or {}).get(n, n) not in site_nodes])


def _inline_for_outer_heads(gm: fx.GraphModule, node: fx.Node, name: str, body: fx.GraphModule,
                            logits: str) -> CheckpointRegion | None:
    """A region whose body computes a loss from logits formed before it (``torch.utils.checkpoint`` around the loss
    alone, to recompute its fp32 copy and softmax in backward): inlined into ``gm`` where that lets the outer
    graph's lm_head and the loss fuse, tried on a copy of ``gm`` first (the region stays where they would not: its
    recomputation is then what saves memory, and the reason is reported; as where they would fuse only around logits
    formed in the forward). None where the trial fails or finds no loss of the body."""
    copied: dict[fx.Node, fx.Node] = {}
    try:
        trial = fx.GraphModule(gm, copy_graph(gm.graph))
        trial_node = next(n for n in trial.graph.nodes if n.name == node.name)
        if _inline(trial, trial_node, body, copied) is not None:
            return None
        inlined = set(copied.values())
        mine = [r for r in analyze_with_folded_heads(trial, logits, log=False) if r.site.loss_node in inlined]
    except Exception as exc:  # noqa: BLE001 - an unexpected graph: the region stays as it is
        logger.debug("flce: trying checkpointed region %s out of its checkpoint failed: %r", name, exc)
        return None
    if not mine:
        return None
    # Only where no logits are formed in the forward: around kept logits (the region's own ops read them, an
    # entropy say), moving the region out would save for backward what its checkpoint recomputes.
    fused = [r for r in mine if r.path in LOGITS_FREE_PATHS]
    if not fused:
        reason = "; ".join(f"{r.site.loss_node.name}: {r.reason or _kept_reason(r)}" for r in mine)
        return CheckpointRegion(name, len(mine), 0, reason=reason, unfused=[r for r in mine if not r.fused])
    region = CheckpointRegion(name, len(fused), _other_ops(body, fused, copied), outer_head=True)
    region.reason = _inline(gm, node, body)
    region.inlined = region.reason is None
    return region


#: The analysis paths on which a fused loss forms no logits in the forward.
LOGITS_FREE_PATHS = ("fused", "fused_lazy")


def _kept_reason(res: SiteResult) -> str:
    """Why a loss the outer analysis would fuse only around kept logits stays in its checkpointed region."""
    return (f"moved out of the checkpoint it would be computed around logits formed in the forward ({res.path}"
            f"{': ' + res.note if res.note else ''}), which the checkpoint keeps from being saved for backward")


def _inline(gm: fx.GraphModule, node: fx.Node, body: fx.GraphModule, copied: dict | None = None) -> str | None:
    """Copy ``body`` into ``gm`` in place of the checkpoint call ``node``; None on success, else why not.
    ``copied``, when given, receives each body node's copy."""
    users = list(node.users)
    if not all(u.op == "call_function" and u.target.__name__ == "getitem" and isinstance(u.args[1], int)
               for u in users):
        return "the region's result is used other than by index"
    if any(n.op in ("get_attr", "call_module") for n in body.graph.nodes):
        return "the region's body reads module attributes of its own"
    placeholders = body_placeholders(node, body)
    if placeholders is None or node.kwargs.get("context_fn") is not None:
        return "the region's arguments do not map onto its body (or it has a context_fn)"
    env: dict[fx.Node, fx.Node] = dict(zip(placeholders, node.args[1:]))
    outputs = None
    with gm.graph.inserting_before(node):
        for bn in body.graph.nodes:
            if bn.op == "placeholder":
                continue
            if bn.op == "output":
                outputs = fx.node.map_arg(bn.args[0], lambda n: env[n])
                continue
            env[bn] = gm.graph.node_copy(bn, lambda n: env[n])
            if copied is not None:
                copied[bn] = env[bn]
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    for user in users:
        user.replace_all_uses_with(outputs[user.args[1]])
        gm.graph.erase_node(user)
    body_attr = node.args[0]
    gm.graph.erase_node(node)
    if not body_attr.users:
        gm.graph.erase_node(body_attr)
    return None
