"""Loss sites inside activation-checkpointed regions: moved out of the region so the pass can fuse them.

Dynamo turns ``torch.utils.checkpoint.checkpoint(fn, ...)`` (non-reentrant) into one
``tag_activation_checkpoint`` call whose body is a subgraph; a lm_head and its loss written inside such a
region (a common way to avoid keeping the logits) are invisible to a pass over the outer graph. Checkpointing
them gains nothing once they are fused: the op keeps no activations worth recomputing, and a fused op inside a
checkpoint would run twice (its gradients are computed in forward). So a region whose body holds a site the
pass would fuse is inlined into the outer graph; the rest of that region's ops are then no longer recomputed
in backward (each region is reported). A region that cannot be inlined is left as it is, with the reason, as is
one whose head and loss cannot be fused (reported like a site outside a region).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from .decide import SiteResult, analyze
from .patterns import outer_floats, runtime_float


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

    def __str__(self) -> str:
        if not self.inlined:
            return f"checkpointed region {self.name}: its {self.sites} loss site(s) stay unfused: {self.reason}"
        extra = f"; {self.other_ops} other op(s) of the region are no longer recomputed" if self.other_ops else ""
        return f"checkpointed region {self.name}: moved out of the checkpoint to fuse its loss site(s){extra}"


def is_checkpoint(node: fx.Node) -> bool:
    """Whether ``node`` is a call of an activation-checkpointed region (``tag_activation_checkpoint``)."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    return node.op == "call_function" and hop is not None and node.target is hop


def checkpoint_body(gm: fx.GraphModule, node: fx.Node) -> tuple[str, fx.GraphModule] | None:
    """The body of checkpoint call ``node`` of ``gm`` as (its attribute name, its graph), or None: ``node`` is
    no checkpoint call, or its body is not a graph module of ``gm``."""
    if not is_checkpoint(node) or not node.args or not isinstance(node.args[0], fx.Node) \
            or node.args[0].op != "get_attr":
        return None
    name = str(node.args[0].target)
    body = getattr(gm, name, None)
    return (name, body) if isinstance(body, fx.GraphModule) else None


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
        if not results:
            # A head and loss the body holds, left as they are: named as outside a region (not a loss whose logits
            # come into the region from outside: the site is then the outer graph's lm_head and this loss).
            unfused = [r for r in analyzed if not r.site.from_outside_graph]
            if unfused:
                reason = "; ".join(f"{r.site.loss_node.name}: {r.reason}" for r in unfused)
                regions.append(CheckpointRegion(name, len(unfused), 0, reason=reason, unfused=unfused))
            continue
        site_nodes = {n for r in results for n in (r.site.chain + [r.site.loss_node])}
        work = [n for r in results for n in (r.site.loss.target, r.site.loss.ce_weight) if isinstance(n, fx.Node)]
        while work:  # the target's own computation belongs to the site too
            n = work.pop()
            if n.op != "placeholder" and n not in site_nodes:
                site_nodes.add(n)
                work.extend(n.all_input_nodes)
        ops = [n for n in body.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
        region = CheckpointRegion(name, len(results), len([n for n in ops if n not in site_nodes]))
        region.reason = _inline(gm, node, body)
        region.inlined = region.reason is None
        regions.append(region)
    if any(r.inlined for r in regions):
        gm.graph.lint()
        gm.recompile()
    return regions


def _inline(gm: fx.GraphModule, node: fx.Node, body: fx.GraphModule) -> str | None:
    """Copy ``body`` into ``gm`` in place of the checkpoint call ``node``; None on success, else why not."""
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
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    for user in users:
        user.replace_all_uses_with(outputs[user.args[1]])
        gm.graph.erase_node(user)
    body_attr = node.args[0]
    gm.graph.erase_node(node)
    if not body_attr.users:
        gm.graph.erase_node(body_attr)
    return None
