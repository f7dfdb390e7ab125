"""A low-rank adapter on the lm_head, folded into one GEMM the fused op takes.

peft's LoRA with "lm_head" among its target_modules computes ``logits = x @ W.T + s * (u @ B.T)`` with
``u = A(dropout(x))``, the adapter's (..., r) activations. That is one GEMM over concatenated operands,
``[x, s*u] @ [W, B].T``: the fused op takes it as it takes any lm_head, so the logits are never formed, and the
gradients reach x, W and B (and, through ``u``, A and the dropout) by autograd through the concatenations. ``u`` is
computed in the graph as before, once (the dropout's mask included). Written by hand, the head and the adapter
may be spelled as the head may (``F.linear``, ``nn.Linear``, ``x @ W.T``, ``x @ W`` of an (H, V) weight), not as an
einsum; a weight held as (H, V) is joined through its transpose.

What the fold costs beside the fused op: the concatenated weight, V x (H + r) in the head's dtype, formed at each
call. Where W is frozen (peft freezes it) the op is told so (``frozen_weight_columns`` = H, recorded on the GEMM as
``FROZEN_COLUMNS``): its dW GEMM reads only ``s*u``, so dW is B's V x r and no GEMM of the head's size is added to
eager's two (the logits and dX); the weight is then joined by ``join_frozen``, whose backward hands B its columns
as a tensor of their own, so that nothing of the weight's size is formed in backward either. Both concatenations
are marked ``graph_meta.JOINED``: where the graph returns the logits, their pieces go out (``outputs``), not the
joined tensors. Eager formed the logits instead, with their fp32 copy and gradient for the loss
(`benchmarks/lora_head.py` measures both).

Numerics: one GEMM in the head's dtype with fp32 accumulation, where eager rounds the head's GEMM, the adapter's
and their sum. An adapter that computes wider than the head (peft's fp32 adapter beside a bf16 head, outside
autocast) is not folded: one bf16 GEMM would round its activations and weight, for A and B gradients about twice
as far from fp64 as eager's. Folded, the loss and the gradients of x, A and B come out at least as close to fp64
as eager's (``tests/test_compiler_lora_head.py``). The returned logits, computed when read, are the folded GEMM's
values: not bit-equal to eager's.

The pass runs before the analysis (``analyze_with_folded_heads``): each such head becomes ``F.linear(cat(x, s*u),
cat(W, B))`` in place of its logits. A fold whose loss the analysis then fuses on the head's operands stays (the
GEMMs it replaced are erased); the others are undone and the graph analyzed again, so a head the pass leaves
unfused computes as eager did, and the reason says what stopped it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from ..log import logger
from .decide import SiteResult, analyze
from .graph_meta import JOINED, copy_source_meta, graph_fake_mode, propagate_meta
from .mutations import AliasMap, describe, erase_dead, grad_mode_switch
from .patterns import LOW_RANK_REASON, LowRankHead, match_low_rank_head, meta_value, own_bias

#: The analysis paths on which the fused op reads the head's operands (the folded GEMM's), not kept logits.
OPERAND_PATHS = ("fused", "fused_lazy", "fused_keep")
#: The folded GEMM's meta key: the weight's leading columns (the frozen head's H) whose gradient the op skips.
FROZEN_COLUMNS = "flce_frozen_weight_columns"


@dataclass
class Fold:
    """One folded head: ``linear`` (the GEMM over the concatenations) stands in for ``head.node``."""

    head: LowRankHead
    total: fx.Node  # the sum of the head and the adapter, where an undone fold's reason is recorded
    linear: fx.Node
    created: list[fx.Node]  # every node the fold added, ``linear`` last

    def keep(self, gm: fx.GraphModule) -> None:
        """The fold stays: the head's GEMM, the adapter's up-projection and the sum, now unused, go."""
        erase_dead(gm, list(self.head.replaced))

    def undo(self, gm: fx.GraphModule, why: str) -> None:
        """The graph as it was, with ``why`` recorded for the analysis's reason (``patterns._low_rank_addend``)."""
        self.linear.replace_all_uses_with(self.head.node)
        for node in reversed(self.created):
            gm.graph.erase_node(node)
        self.total.meta[LOW_RANK_REASON] = why


class _FrozenJoin(torch.autograd.Function):
    """``cat([frozen, trainable], 1)`` whose backward hands ``trainable`` its columns of the gradient as a tensor of
    their own (and ``frozen`` none). Through ``torch.cat`` B's gradient was a view of the whole V x (H + r) one,
    which Inductor then formed in full to return the view; a copy of B's columns lets it compute only those (the
    fused op's dW holds only them: ``frozen_weight_columns``)."""

    @staticmethod
    def forward(ctx: Any, frozen: torch.Tensor, trainable: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.columns = frozen.shape[1]
        return torch.cat([frozen, trainable], 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:  # noqa: D102
        return None, grad[:, ctx.columns:].contiguous()


def join_frozen(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The folded weight ``[W, B]`` of a frozen head W from ``pieces`` = [W, B] (a graph node's target, called as
    ``torch.cat``: see ``_FrozenJoin``)."""
    frozen, trainable = pieces
    return _FrozenJoin.apply(frozen, trainable)


def analyze_with_folded_heads(gm: fx.GraphModule, logits: str = "keep", fake_mode: Any = None,
                              log: bool = True) -> list[SiteResult]:
    """``decide.analyze`` of ``gm`` with its lm_heads' low-rank adapters folded where that lets the loss fuse;
    changes ``gm`` only there. ``log=False`` for a trial on a copy (``checkpoints``): the folds are not logged."""
    folds = fold_low_rank_heads(gm, fake_mode if fake_mode is not None else graph_fake_mode(gm), log)
    results = analyze(gm, logits)
    if not folds:
        return results
    by_linear = {r.site.linear.node: r for r in results if r.site.linear is not None}
    undone = False
    for fold in folds:
        res = by_linear.get(fold.linear)
        if res is not None and res.path in OPERAND_PATHS:
            fold.keep(gm)
            if not log:
                continue
            logger.info("flce: the low-rank adapter on the lm_head at %s folded into one GEMM (rank %d, scale %g)%s",
                        fold.total.name, meta_value(fold.head.low).shape[-1], fold.head.scale,
                        "; the head is frozen: dW of the adapter's columns only" if FROZEN_COLUMNS in fold.linear.meta
                        else "")
            continue
        if res is None:
            why = "no loss in this graph reads its logits"
        else:
            why = res.reason or f"its loss would be computed from kept logits ({res.path})"
        fold.undo(gm, f"folded into one GEMM its loss is not fused either ({why})")
        undone = True
    return analyze(gm, logits) if undone else results


def fold_low_rank_heads(gm: fx.GraphModule, fake_mode: Any, log: bool = True) -> list[Fold]:
    """Fold every lm_head with a low-rank adapter in ``gm`` (``patterns.match_low_rank_head``) that reads its
    operands unchanged; the others get their reason recorded on their sum."""
    folds = []
    for node in list(gm.graph.nodes):
        got = match_low_rank_head(gm, node)
        if got is None:
            continue
        why = got if isinstance(got, str) else _unfoldable(gm, got)
        if why is None:
            try:
                folds.append(_fold(gm, node, got, fake_mode))
                continue
            except Exception as exc:  # noqa: BLE001 - an unexpected graph: the head stays as it was
                why = f"folding it failed ({exc!r})"
        node.meta[LOW_RANK_REASON] = why
        if log:
            logger.info("flce: the low-rank adapter on the lm_head at %s not folded: %s", node.name, why)
    return folds


def _unfoldable(gm: fx.GraphModule, head: LowRankHead) -> str | None:
    """Why the folded GEMM, reading its operands where the logits were formed, could read other values or run
    under another grad mode than the head's and the adapter's GEMMs did; None when it cannot."""
    lin = head.base
    aliases = AliasMap(gm)  # built per head: folds before this one added nodes
    attrs = [a for a in (f"{lin.module_target}.weight", f"{lin.module_target}.bias") if lin.module_target]
    attrs += [head.up_weight] if isinstance(head.up_weight, str) else []
    roots = aliases.roots_of([lin.input, lin.weight, lin.bias, head.low, head.up_weight], attrs)
    # From the first of the head's and the adapter's GEMMs (either may come first) to the sum, where the fold reads.
    first = min(head.replaced, key=aliases.position.__getitem__)
    write = aliases.first_write(first, head.node, roots)
    if write is not None:
        return f"{describe(write)} writes to its operands between the head's and the adapter's GEMMs and the sum"
    switch = grad_mode_switch(first, head.node)
    if switch is not None:
        return f"grad mode changes between the head's and the adapter's GEMMs and the sum ({switch.name})"
    return None


def _fold(gm: fx.GraphModule, total: fx.Node, head: LowRankHead, fake_mode: Any) -> Fold:
    """Put ``F.linear(cat(x, s*u), cat(W, B), b)`` in place of the head's logits (all users of ``head.node``)."""
    graph, lin, created = gm.graph, head.base, []

    def add(op: str, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        created.append(graph.create_node(op, target, args, kwargs or {}))
        return created[-1]

    def value(operand: Any) -> Any:  # a node's traced value, or the parameter a get_attr target names
        return gm.get_parameter(operand) if isinstance(operand, str) else meta_value(operand)

    def cast(node: fx.Node, dtype: torch.dtype, to: torch.dtype) -> fx.Node:
        return node if dtype == to else add("call_method", "to", (node, to))

    weight_of_head = f"{lin.module_target}.weight" if lin.module_target else lin.weight
    head_weight = value(weight_of_head)
    if lin.weight_is_transposed:  # ``x @ W`` with W (H, V)
        head_weight = head_weight.t()
    x_dtype, w_dtype = meta_value(lin.input).dtype, head_weight.dtype
    frozen = not head_weight.requires_grad
    try:
        with graph.inserting_before(head.node):
            low = head.low  # scaled as the adapter's output was (a number and symbolic factors keep its dtype)
            for factor in ((head.scale,) if head.scale != 1.0 else ()) + head.symbols:
                low = add("call_function", operator.mul, (low, factor))
            hidden = add("call_function", torch.cat,
                         ([lin.input, cast(low, meta_value(head.low).dtype, x_dtype)], -1))
            weight = add("get_attr", weight_of_head, ()) if lin.module_target else lin.weight
            if lin.weight_is_transposed:
                weight = add("call_method", "t", (weight,))
            up = add("get_attr", head.up_weight, ()) if isinstance(head.up_weight, str) else head.up_weight
            if head.up_transposed:
                up = add("call_method", "t", (up,))
            up = cast(up, value(head.up_weight).dtype, w_dtype)
            both = add("call_function", join_frozen, ([weight, up],)) if frozen else add(
                "call_function", torch.cat, ([weight, up], 1))
            hidden.meta[JOINED] = both.meta[JOINED] = True  # (returned, W and B go out: ``outputs.add_pieces``)
            # Joined again in backward where backward reads them (the op keeps its operands for the gradient of
            # logits the graph reads, ``fused_keep``): the pieces are there anyway, the joined copies would be held
            # from forward to backward. (AOT autograd carries the tag to its joint graph, as for checkpointing.)
            hidden.meta["recompute"] = both.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            bias = own_bias(gm, lin)
            if lin.module_target and bias is not None:
                bias = add("get_attr", f"{lin.module_target}.bias", ())
            linear = add("call_function", F.linear, (hidden, both, bias))
        propagate_meta(gm, created[:-1], fake_mode, on_meta=True)
    except Exception:
        for node in reversed(created):
            graph.erase_node(node)
        raise
    # The traced logits' value: their shape, the dtype the head computed in (autocast's), whether they need grad.
    linear.meta["example_value"] = meta_value(head.node)
    if frozen:  # (Dynamo guards requires_grad: a head unfrozen later compiles again)
        # The weight's columns as an int (a parameter's are static; a symbolic input's hidden size would be a SymInt
        # in the op's arguments and in the memory bound's)
        linear.meta[FROZEN_COLUMNS] = int(head_weight.shape[1])
    copy_source_meta(head.node, linear)
    head.node.replace_all_uses_with(linear)
    return Fold(head, total, linear, created)
