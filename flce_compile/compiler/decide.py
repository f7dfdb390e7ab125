"""Deciding, without touching the graph, what the pass does with each loss site.

Paths, from most to least memory saved:

* ``fused``: nothing but the loss uses the logits (or they are dropped): the fused op replaces the lm_head and
  the loss, and no logits exist at all.
* ``fused_lazy``: the graph only returns the logits (through casts, reshapes, constant scales, a softcap), and
  ``flce.logits`` is "keep": the loss is fused as on ``fused``, and the returned logits are computed when first
  read, outside the graph (``lazy_logits``), so a caller that only reads the loss never forms them.
* ``fused_keep``: the graph also returns (or otherwise uses) the logits. One op computes them exactly and,
  around them, the loss and the lm_head's gradients chunk by chunk, so nothing BT x V is saved for backward.
  It runs where the lm_head ran, so the target is computed before it; when the graph's only other use of the
  logits is to return them (through casts, reshapes, a scale or a softcap), their gradient is re-attached
  outside the compiled graph (see ``outputs``), so a caller that never uses them pays nothing in backward.
* ``kept_logits``: the logits stay as the graph computes them and the loss is taken from them chunk-wise
  (used when ``fused_keep`` cannot be proven safe; its reason is in ``note``).
* ``vocab_parallel``: a tensor-parallel lm_head (weight sharded over the vocabulary, loss under
  ``loss_parallel()``) whose logits only the loss uses: the vocabulary-parallel op replaces the lm_head and the
  loss (see ``tensor_parallel``).
* ``unchanged``: with the reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import fx

from .mutations import AliasMap, describe, draws_random, grad_mode_switch, nodes_between
from .outputs import flat_outputs, output_node
from .patterns import (ADVICE, HF_LOSS_TYPE_HINT, LinearMatch, LowRankHead, Plan, Site, checkpoint_body, find_sites,
                       fold_steps, hint_int, match_linear, match_low_rank_head, meta_value, output_transform,
                       reinterprets_bits, runtime_softcap, symbolic_softcap_refused)
from .tensor_parallel import is_tensor_parallel, returned_through_redistribute, vocab_parallel_obstacle

PATHS = ("fused", "fused_lazy", "fused_keep", "kept_logits", "vocab_parallel", "unchanged")


@dataclass
class SiteResult:
    """What the pass does with one loss site (the raw material of ``explain`` reports and of the logs)."""

    site: Site
    path: str  # one of PATHS
    reason: str | None = None
    note: str | None = None  # why a fused_keep site took the kept_logits path, or what its logits cost
    dropped_outputs: int = 0
    #: ops in the graph, other than returning them (through casts and reshapes), that read the logits: "drop"
    #: cannot free logits these need (a user's z-loss, an accuracy metric)
    logits_users: list[str] = field(default_factory=list)
    kept_logits_bytes: int = 0  # bytes of logits the graph still materializes (+ their gradient on kept_logits)
    tokens: int | None = None
    logits_dtype: torch.dtype | None = None
    device: torch.device | None = None
    new_node: fx.Node | None = None
    plan: Plan | None = None
    escapes: dict[fx.Node, list[fx.Node]] | None = None  # chain nodes that stay used outside the loss path
    dropped: list[fx.Node] | None = None  # chain nodes whose graph-output uses become None ("drop")
    prelude: list[fx.Node] = field(default_factory=list)  # target nodes moved before the op (fused_keep)
    #: fused_keep: returned chain nodes whose gradient is re-attached outside the graph -> their transform.
    logits_outputs: dict[fx.Node, Plan] = field(default_factory=dict)
    #: fused_lazy: returned nodes computed outside the graph -> the steps from the lm_head to each (``lazy_steps``).
    lazy_outputs: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)
    #: fused_keep: graph ops that read the logits may give them a gradient, which flows back through the op
    logits_graded: bool = False
    #: kept_logits: whether flce.logits="drop" would fuse this loss without the logits
    drop_frees: bool = False

    @property
    def fused(self) -> bool:
        return self.path != "unchanged"


def analyze(gm: fx.GraphModule, logits: str = "keep") -> list[SiteResult]:
    """What the pass would do with each loss site of ``gm`` (``logits``: the ``flce.logits`` option)."""
    results = []
    aliases = AliasMap(gm)
    transform = _functorch_transform(gm)
    for site in find_sites(gm):
        if transform is not None:
            results.append(SiteResult(site, "unchanged", transform))
            continue
        try:
            results.append(_decide(site, logits, aliases))
        except Exception as exc:  # noqa: BLE001 - an unexpected graph shape: this site is left alone
            results.append(SiteResult(site, "unchanged", f"analysis failed: {exc!r}"))
    return results


#: What Dynamo puts in a graph traced under a torch.func transform (``torch.compile(grad(f))``): the level's
#: start (the vmap, grad and jvp kinds), its inputs wrapped for it.
_FUNCTORCH_NESTING = frozenset(
    getattr(torch._C._functorch, name, None)
    for name in ("_grad_increment_nesting", "_vmap_increment_nesting", "_jvp_increment_nesting", "_wrap_for_grad")
) - {None}


#: The note of a site whose logits flce.logits="drop" keeps: they take no gradient (``_decide``).
EVAL_KEEP_NOTE = ("flce.logits='drop' drops the logits of graphs that take a gradient; these take none (an "
                  "evaluation), so they are returned as under 'keep'")
#: The note of a fused_keep site whose logits only other fused losses read (``mark_unkept``, ``rewrite._unkeep``).
UNKEPT_NOTE = "the logits' other readers, losses on the same logits, are fused too: the logits are not formed"
#: The note of a later fused_keep site on an lm_head whose first one keeps the logits for every reader.
SHARED_NOTE = "another loss on the same logits keeps them for their readers: this one reads the lm_head's operands"
#: The paths whose rewrite reads the lm_head's operands, not its logits (so a loss on them reads no logits).
_HEAD_PATHS = ("fused", "fused_lazy", "fused_keep")


def mark_unkept(results: list[SiteResult]) -> None:
    """Report the fused_keep sites as the pass leaves them (``rewrite._unkeep`` decides from the rewritten graph;
    this is for reports made without rewriting, ``explain``). Of several on one lm_head (a label-smoothed loss and
    a plain one on the same logits) the first rewritten takes every reader of the logits, so the others become the
    plain fused op; the first does too when its logits' only readers are the other fused losses on that head."""
    first_on: dict[fx.Node, SiteResult] = {}
    for res in results:
        if res.path == "fused_keep":
            first_on.setdefault(res.site.linear.node, res)
    for head, first in first_on.items():
        others = [r for r in results if r is not first and r.path in _HEAD_PATHS and r.site.linear.node is head]
        losses = {node for r in others for node in (*r.site.chain, r.site.loss_node)}
        users = [user for users in first.escapes.values() for user in users]
        unkept = not first.logits_outputs and bool(users) and all(user in losses for user in users)
        if unkept:
            first.path, first.note, first.kept_logits_bytes = "fused", UNKEPT_NOTE, 0
        for res in others:
            if res.path == "fused_keep":
                res.path, res.note, res.kept_logits_bytes = "fused", UNKEPT_NOTE if unkept else SHARED_NOTE, 0


def _functorch_transform(gm: fx.GraphModule) -> str | None:
    """Why no site of ``gm`` is fused when its code runs under a torch.func transform (grad, vmap, jvp) that
    Dynamo traced into the graph: the fused op forms its gradients inside and has no rule for a transform's
    levels (its compile failed there); else None."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _FUNCTORCH_NESTING:
            return ("the graph runs under a torch.func transform (grad, vmap or jvp), which the fused op does not "
                    "support; call the model with loss.backward() or torch.autograd.grad instead")
    return None


def _decide(site: Site, logits_mode: str, aliases: AliasMap) -> SiteResult:
    if site.reason is not None or site.linear is None:
        return SiteResult(site, "unchanged", site.reason or "no lm_head linear found")
    res = SiteResult(site, "unchanged")
    out = meta_value(site.linear.node)
    res.tokens = hint_int(out.numel() // out.shape[-1]) if out.dim() > 1 else 1
    res.logits_dtype, res.device = out.dtype, out.device
    all_escapes = site.escapes()
    # The uses that read the logits in the graph: without the outputs and the casts or reshapes only returned.
    read, returned_steps = _without_returned_steps(site.escapes(ignore_output=True))
    res.logits_users = sorted({r.name for node, users in read.items() for u in users for r in _readers(u, node)})
    # "drop" is for training: a graph whose logits take no gradient (an evaluation under no_grad, the Trainer's
    # evaluate, which hands them to compute_metrics) returns them as "keep" does, formed only when read (as
    # Liger's patches compute them outside training). Dropped there, compute_metrics was skipped without a word.
    eval_keep = logits_mode == "drop" and not out.requires_grad and bool(all_escapes)
    if eval_keep:
        logits_mode = "keep"
    if logits_mode == "drop":  # a cast or reshape the graph only returns (``.float()``) is dropped with it
        escapes = read
    else:
        escapes, returned_steps = all_escapes, []
    res.escapes = escapes
    res.dropped = [n for n in all_escapes if n not in escapes] + returned_steps
    res.dropped_outputs = len(res.dropped)
    if is_tensor_parallel(site):
        return _vocab_parallel(site, res, escapes, aliases)
    if not escapes:
        plan = fold_steps(site, 0)
        if isinstance(plan, str):
            res.reason = plan
            return res
        write = _head_write(site, aliases)
        if write is not None:
            res.reason = (f"{describe(write)} may write to a tensor the lm_head reads (its input, weight or bias, "
                          "or a view of them) between the lm_head and the loss")
            return res
        res.path, res.plan = "fused", plan
        return res
    if logits_mode == "drop":
        res.reason = f"logits feed other ops ({_users(escapes)}), so they cannot be dropped"
    lazy_refused = _lazy(site, res, aliases) if logits_mode == "keep" else None
    if res.path == "fused_lazy":
        return _eval_noted(res, eval_keep)
    obstacle = _fused_keep_obstacle(site, res, aliases)
    if obstacle is None:
        if res.path == "fused_keep" and res.note is None and lazy_refused is not None:
            res.note = f"the returned logits are formed in the forward: {lazy_refused}"
        return _eval_noted(res, eval_keep)
    return _eval_noted(_kept_logits(site, res, obstacle, aliases), eval_keep)


def _eval_noted(res: SiteResult, eval_keep: bool) -> SiteResult:
    """``res``, its note led by ``EVAL_KEEP_NOTE`` where "drop" kept an evaluation's logits (``_decide``)."""
    if eval_keep and res.fused:
        res.note = EVAL_KEEP_NOTE + (f"; {res.note}" if res.note else "")
    return res


def _vocab_parallel(site: Site, res: SiteResult, escapes: dict[fx.Node, list[fx.Node]],
                    aliases: AliasMap) -> SiteResult:
    """The tensor-parallel site: the vocab_parallel path, or unchanged with the reason and the advice. Logits only
    returned (a Hugging Face model's, through a cast or reshape or not) are the one obstacle an option removes: the
    reason names it when nothing else would stop the site."""
    obstacle, plan = _vocab_parallel_obstacle(site, escapes, aliases)
    if obstacle is None:
        res.path, res.plan = "vocab_parallel", plan
        return res
    if (escapes and not _without_returned_steps(site.escapes(ignore_output=True))[0]
            and _vocab_parallel_obstacle(site, {}, aliases)[0] is None):
        obstacle += ("; the logits are only returned: options={'flce.logits': 'drop'} fuses the loss (the model "
                     "then returns logits=None)")
    res.reason = obstacle
    return res


def _vocab_parallel_obstacle(site: Site, escapes: dict[fx.Node, list[fx.Node]], aliases: AliasMap
                             ) -> tuple[str | None, Plan | None]:
    """(why the tensor-parallel site cannot take the vocab_parallel path with these escapes, or None; its plan)."""
    obstacle = vocab_parallel_obstacle(site, escapes)
    plan = fold_steps(site, 0) if obstacle is None else None
    if isinstance(plan, str):
        return f"{ADVICE} ({plan})", None
    if plan is not None and runtime_softcap(plan):
        return f"{ADVICE} ({symbolic_softcap_refused('the vocab-parallel loss')})", None
    write = _head_write(site, aliases) if obstacle is None else None
    if write is not None:
        return f"{ADVICE} ({describe(write)} may write to a tensor the lm_head reads)", None
    return obstacle, plan


def _lazy(site: Site, res: SiteResult, aliases: AliasMap) -> str | None:
    """Set ``res`` up for the fused_lazy path (and return None) when the graph only returns its logits, through
    steps that can be replayed outside it (``lazy_steps``), and nothing in the graph writes the lm_head's operands
    or the logits after the lm_head (the logits are computed later, from the operands as the graph leaves them).
    Otherwise return why not, for ``explain``'s note on the fused_keep path that forms the logits instead."""
    returned: dict[fx.Node, fx.Node] = {}  # each returned node -> the chain node it is computed from
    for node, users in res.escapes.items():
        for user in users:
            if user.op == "output":
                returned[node] = node
                continue
            after = _returned_after(user, node)
            if after is None:
                return f"{user.name} reads them in the graph"
            returned.update(dict.fromkeys(after, node))
    if flat_outputs(site.loss_node.graph) is None:
        return "the graph's outputs are not a flat sequence of tensors"
    # Logits the head formed under another grad mode than the one they are read in later would be computed with
    # the reader's (a reference model's logits under no_grad would require grad when read outside it).
    switch = grad_mode_switch(site.linear.start, output_node(site.loss_node.graph))
    if switch is not None:
        return f"{switch.name} changes grad mode after the lm_head"
    transforms = [output_transform(site, chain_node) for chain_node in returned.values()]
    blocked = next((t for t in transforms if isinstance(t, str)), None)
    if blocked is not None:
        return f"they are returned through {blocked}"
    steps = {node: lazy_steps(site, node) for node in returned}
    unreplayable = next((node for node, s in steps.items() if s is None), None)
    if unreplayable is not None:
        return f"{unreplayable.name} cannot be computed outside the graph"
    plan = fold_steps(site, 0)
    if isinstance(plan, str):
        return plan
    lin = site.linear
    roots = _head_roots(site, aliases, lin.node)
    write = aliases.first_write(lin.start, output_node(site.loss_node.graph), roots)
    if write is not None:
        return f"{describe(write)} may write the lm_head's operands after it"
    out = meta_value(lin.node)
    size = (hint_int(out.numel()) or 0) * out.element_size()
    res.path, res.plan, res.lazy_outputs = "fused_lazy", plan, steps
    res.note = (f"the returned logits are computed when first read (~{size / 2**30:.3f} GiB then), outside the "
                "graph; a caller that reads only the loss never forms them")
    return None


#: Methods a returned logits may go through off the loss's chain and still be computed when read: casts (what
#: Accelerate's mixed precision does to every output: ``.float()``) and reshapes with constant sizes (nanoGPT's
#: ``return logits.view(-1, V), loss`` beside the loss's own ``logits.view(-1, V)``), one after another.
_RETURNED_METHODS = frozenset({"float", "to", "contiguous", "view", "reshape", "flatten"})


def _off_chain_step(user: fx.Node, node: fx.Node) -> bool:
    """Whether ``user`` is a cast or reshape of ``node`` alone (``_RETURNED_METHODS``, constants otherwise)."""
    if user.target == "view" and reinterprets_bits(user):
        return False  # no gradient flows through ``view(dtype)``, as the lazy head's would
    return user.op == "call_method" and user.target in _RETURNED_METHODS and user.all_input_nodes == [node]


def _returned_after(user: fx.Node, node: fx.Node) -> list[fx.Node] | None:
    """The nodes the graph returns among ``user`` and the steps after it, when ``user`` is an off-chain step of
    ``node`` (``_off_chain_step``) and each use after it is another such step or the graph's output
    (``logits.view(-1, V).float()``); None when anything else uses them."""
    if not _off_chain_step(user, node):
        return None
    returned = []
    for after in user.users:
        if after.op == "output":
            returned.append(user)
            continue
        more = _returned_after(after, user)
        if more is None:
            return None
        returned += more
    return returned


def _readers(user: fx.Node, node: fx.Node) -> list[fx.Node]:
    """The ops that read ``node``'s values through its use ``user``: ``user``, or past the casts and reshapes it
    starts (``_off_chain_step``), the first other op on each path (returning them is no read)."""
    if not _off_chain_step(user, node):
        return [user]
    return [r for after in user.users if after.op != "output" for r in _readers(after, user)]


def _without_returned_steps(escapes: dict[fx.Node, list[fx.Node]]
                            ) -> tuple[dict[fx.Node, list[fx.Node]], list[fx.Node]]:
    """``escapes`` less the uses that are casts or reshapes the graph only returns (``_returned_after``), and the
    returned nodes among them: under "drop" their outputs become None, as the logits' own would."""
    kept: dict[fx.Node, list[fx.Node]] = {}
    returned: list[fx.Node] = []
    for node, users in escapes.items():
        others = []
        for user in users:
            after = _returned_after(user, node)
            if after is None:
                others.append(user)
            else:
                returned += after
        if others:
            kept[node] = others
    return kept, returned


def lazy_steps(site: Site, node: fx.Node) -> list[fx.Node] | None:
    """The nodes from the lm_head's output (exclusive) to ``node`` (inclusive), when each is a function or
    method whose only graph input is the step before it (constants otherwise, no float read at run time): the
    steps a LazyLogits replays on the raw logits. ``node`` is a chain node, or a cast or reshape off the chain that
    the graph returns (``_returned_after``). None when they can't be replayed outside the graph."""
    steps: list[fx.Node] = []
    if node is site.linear.node:
        return steps
    if node not in site.chain:  # checked by ``_returned_after``: a step back to the chain, or to another such step
        inputs = node.all_input_nodes
        if len(inputs) != 1 or not _off_chain_step(node, inputs[0]):
            return None
        before = lazy_steps(site, inputs[0])
        return None if before is None else before + [node]
    for step in site.steps:
        if step.symbol is not None or step.node.op not in ("call_function", "call_method"):
            return None
        if step.node.all_input_nodes != [step.input]:
            return None
        steps.append(step.node)
        if step.node is node:
            return steps
    return None


def _fused_keep_obstacle(site: Site, res: SiteResult, aliases: AliasMap) -> str | None:
    """Set ``res`` up for the fused_keep path and return None, or return why it can't be taken."""
    plan = fold_steps(site, 0)
    if isinstance(plan, str):
        return plan
    if site.loss.kind == "log_prob_gather":
        return "the loss is per-token log-probs (the op with logits computes mean/sum cross-entropy)"
    if site.loss.reduction == "none":
        return "reduction='none' (the op with logits computes mean/sum losses)"
    if site.linear.wide_bias:
        return ("an fp32 bias promotes the logits, which the op with logits returns in the lm_head's dtype, "
                "unpromoted")
    # The op computes the loss where the lm_head ran: a write to the logits, or to a step after them (a softcap's
    # output), before the loss would be missed; so would a change of grad mode (a loss under no_grad).
    write = aliases.first_write(site.linear.start, site.loss_node, aliases.roots_of(site.chain))
    if write is not None:
        return f"{describe(write)} may write the logits between the lm_head and the loss"
    switch = grad_mode_switch(site.linear.start, site.loss_node)
    if switch is not None:
        return f"{switch.name} changes grad mode between the lm_head and the loss"
    also = [plan.softcap] if runtime_softcap(plan) else []
    if site.linear.added_bias is not None:  # the op runs where the GEMM ran: a bias computed after it moves too
        also.append(site.linear.added_bias)
    # A slice bound the loss took from a symbolic size (``logits[:, n - 1:-1]``, ``[:, -labels.size(1):]``) may be
    # traced after the lm_head: the op's row selection reads it before, so it moves too.
    fx.node.map_arg(tuple(plan.indices), also.append)
    prelude = _target_prelude(site, aliases, also)
    if isinstance(prelude, str):
        return prelude
    out = meta_value(site.linear.node)
    res.path, res.plan, res.prelude = "fused_keep", plan, prelude
    res.kept_logits_bytes = (hint_int(out.numel()) or 0) * out.element_size()
    if not out.requires_grad:
        return None  # no gradient anywhere: nothing to re-attach
    # In-graph reads that take no gradient (an argmax metric) read the detached logits as well; any other keeps
    # the logits' gradient in the graph (a view or cast too: it may be returned and used in a loss; and
    # ``detach``, whose alias could write the values the re-attached gradient of a softcap reads).
    graded = [u for users in res.escapes.values() for u in users
              if u.op != "output" and not (_takes_no_gradient(u) and aliases.effects[u].fresh)]
    if graded:
        res.note = (f"the logits feed {', '.join(sorted({u.name for u in graded})[:4])} in the graph, so a "
                    "gradient they give the logits flows back through the op (a logits-sized buffer in backward "
                    "where one is given)")
        res.logits_graded = True
        return None
    transforms = {node: output_transform(site, node) for node, users in res.escapes.items()
                  if any(u.op == "output" for u in users)}
    blocked = {n.name: t for n, t in transforms.items() if isinstance(t, str)}
    if blocked:
        res.note = (f"the returned logits {', '.join(blocked)} are computed through "
                    f"{'; '.join(blocked.values())}: their gradient stays in the graph (a logits-sized zero "
                    "gradient in backward when they get none)")
        return None
    res.logits_outputs = transforms
    return None


def _takes_no_gradient(node: fx.Node) -> bool:
    """Whether ``node``'s traced value is one tensor that does not require grad (``argmax``, a comparison,
    ``detach``, anything computed under ``no_grad``): no gradient reaches the logits through it."""
    value = meta_value(node)
    return isinstance(value, torch.Tensor) and not value.requires_grad


def _kept_logits(site: Site, res: SiteResult, why: str, aliases: AliasMap) -> SiteResult:
    """The fallback: the loss from the logits the graph keeps, from the last escaping chain node on."""
    chain = site.chain
    last = max(chain.index(n) for n in res.escapes)
    plan = fold_steps(site, last)
    if not isinstance(plan, str) and runtime_softcap(plan):
        plan = symbolic_softcap_refused("the kept-logits loss")
    # The loss reads the kept node where the loss ran and replays the steps after it there: a write to the kept
    # node, or to a step after it, once the first of those steps has read it would be missed (or applied twice).
    roots = aliases.roots_of(chain[last:])
    write = (aliases.first_write(chain[last + 1], site.loss_node, roots)
             if last < len(chain) - 1 and not isinstance(plan, str) else None)
    if write is not None:
        plan = f"{describe(write)} may write them between the lm_head and the loss"
    # It also keeps them for its backward, where eager's loss may keep something else (log_softmax its output):
    # a write after the loss would fail backward's version check where eager runs.
    write = (aliases.first_write(site.loss_node, output_node(site.loss_node.graph), roots)
             if not isinstance(plan, str) else None)
    if write is not None:
        plan = f"{describe(write)} may write them after the loss, which reads them again in backward"
    if isinstance(plan, str):
        res.reason = f"logits are used outside the loss ({_users(res.escapes)}) and {plan}"
        return res
    base_val = meta_value(chain[last])
    res.path, res.plan, res.note = "kept_logits", plan, f"the fused op cannot return the logits here: {why}"
    # "drop" fuses the loss where nothing in the graph reads the logits, its steps fold from the lm_head on, nothing
    # writes the head's operands before the loss, and the logits take a gradient (else "drop" keeps them)
    res.drop_frees = (not res.logits_users and not isinstance(fold_steps(site, 0), str)
                      and _head_write(site, aliases) is None and bool(meta_value(site.linear.node).requires_grad))
    res.kept_logits_bytes = 2 * (hint_int(base_val.numel()) or 0) * base_val.element_size()
    return res


def _head_write(site: Site, aliases: AliasMap) -> fx.Node | None:
    """A node between the lm_head and the loss that may write the lm_head's input, weight or bias."""
    return aliases.first_write(site.linear.start, site.loss_node, _head_roots(site, aliases))


def _head_roots(site: Site, aliases: AliasMap, *nodes: fx.Node) -> frozenset:
    """The memory the lm_head reads (its input, weight and bias, as graph values or module attributes), and that of
    ``nodes``."""
    lin = site.linear
    attrs = [f"{lin.module_target}.weight", f"{lin.module_target}.bias"] if lin.module_target else []
    return aliases.roots_of([lin.input, lin.weight, lin.bias, lin.added_bias, *nodes], attrs)


def _target_prelude(site: Site, aliases: AliasMap, also: list[fx.Node]) -> list[fx.Node] | str:
    """The nodes between the lm_head and the loss that compute the loss's target and class weights (and ``also``:
    a softcap's read of a graph input, ``patterns.runtime_float``; an added bias; the symbolic bounds of the loss's
    slice of the logits), which fused_keep moves before the lm_head; a str says why they can't move."""
    loss, lin = site.loss, site.linear
    start, stop = aliases.position[lin.start], aliases.position[site.loss_node]
    needed = [n for n in (loss.target, loss.ce_weight) if isinstance(n, fx.Node)] + also
    prelude: set[fx.Node] = set()
    work = list(needed)
    while work:
        node = work.pop()
        if node in prelude or aliases.position[node] <= start:
            if node is lin.node or node is lin.start:
                return "the target, class weights or slice bounds of the loss are computed from the logits"
            continue
        if aliases.position[node] >= stop:
            return f"{node.name} comes after the loss"
        if aliases.effects[node].writes:
            return f"the target is built with {describe(node)}, which writes a tensor"
        prelude.add(node)
        work.extend(node.all_input_nodes)
    read = needed + [i for n in prelude for i in n.all_input_nodes]  # moved earlier: nothing may write these
    write = aliases.first_write(lin.start, site.loss_node, aliases.roots_of(read))
    if write is not None:
        return f"{describe(write)} may write the target or class weights between the lm_head and the loss"
    moved = sorted(prelude, key=aliases.position.__getitem__)
    drawn = [n for n in moved if draws_random(aliases.gm, n)]
    if drawn:  # moved before the lm_head, it would draw before random nodes that drew first in eager
        first = next((n for n in nodes_between(lin.start, drawn[-1])
                      if n not in prelude and draws_random(aliases.gm, n)), None)
        if first is not None:
            return (f"the target or class weights are drawn at random ({drawn[-1].name}) after {first.name} draws "
                    "random numbers too; moved before the lm_head, each would draw other numbers than eager's")
    return moved


def _users(escapes: dict[fx.Node, list[fx.Node]]) -> str:
    names = sorted({u.name for users in escapes.values() for u in users})
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


@dataclass(frozen=True)
class LoneHead:
    """An lm_head the graph returns the logits of, with no loss in the graph reading them: its loss, if any, is
    computed after the compiled code (the loop computes it, or a graph break separates them), so nothing can be
    fused."""

    node: fx.Node
    form: str
    tokens: int | None
    vocab: int
    tensor_parallel: bool  # a DTensor lm_head, its logits returned through the output hook's redistribute
    requires_grad: bool  # a training graph (an eval or generation graph returns logits without)


#: Why a lone lm_head (``LoneHead``, not tensor-parallel) is not fused, and the fixes.
LONE_HEAD_REASON = ("no loss in this graph reads its logits: a loss computed after the compiled code (in the "
                    "training loop, or after a graph break) cannot be fused with it. Compile a function that calls "
                    "the model and computes the loss, or call flce_compile.fused_linear_cross_entropy on the hidden "
                    f"states there; flce_compile.explain(...) shows graph breaks ({HF_LOSS_TYPE_HINT})")


#: What a feed-forward block's or an adapter's widening linear is called (the last name of its module path,
#: lower-cased, numbers dropped): before a graph break its output is returned like logits, and it is no lm_head.
_WIDENING_NAMES = {"up_proj", "gate_proj", "gate_up_proj", "fc1", "c_fc", "fc_in", "wi", "wi_0", "wi_1", "w1", "w3",
                   "w13", "dense_h_to_4h", "linear1", "ff1", "up", "gate", "in_proj", "lora_b"}
#: Module names a widening linear sits in (``intermediate.dense``, ``mlp.0``), or is, among its path's last three
#: names (as ``_WIDENING_NAMES``; and any name holding "adapter").
_WIDENING_PARENTS = {"mlp", "ffn", "feed_forward", "feedforward", "ff", "intermediate", "experts"}


def _module_names(node: fx.Node, lin: LinearMatch) -> list[list[str]]:
    """The module paths ``node``'s GEMM and its weight belong to, each as its names from the outside in, lower-cased,
    indices and numbers dropped (``L['self'].mlp[0]`` and ``..._modules_mlp_modules_0_parameters_weight_``: both
    ``["self", "mlp"]``)."""
    paths = [lin.module_target] if lin.module_target else []
    weight = lin.weight if isinstance(lin.weight, fx.Node) else None
    for n in (node, weight):
        stack = list((n.meta.get("nn_module_stack") or {}).values())[-1:] if n is not None else []
        paths += [str(path) for path, _ in stack]
    if weight is not None and weight.op == "placeholder" and "_parameters_" in weight.name:
        paths.append(".".join(weight.name.split("_parameters_")[0].split("_modules_")))
    names = []
    for path in paths:
        parts = [p.lower().rstrip("0123456789_") for p in re.sub(r"\[[^\]]*\]", ".", path).split(".")]
        names.append([p for p in parts if p])
    return names


def vocab_wide(outputs: int, inputs: int) -> bool:
    """Whether a linear of ``inputs`` -> ``outputs`` columns is wide enough to compute logits (at least twice its
    input's width); a narrower one is a classifier's (a question-answering head's 2 outputs), never worth a warning
    (lone heads, refused losses, kept logits: each report asks this)."""
    return outputs >= 2 * inputs


def _vocab_sized(node: fx.Node, lin: LinearMatch, width: int, in_width: int) -> bool:
    """Whether the linear ``node`` (``lin``), ``in_width`` -> ``width`` columns, may compute logits: at least twice
    as wide, and not named as a feed-forward block's or an adapter's widening linear is (an up-projection before a
    graph break, reported as an lm_head until 2026-12-05). Unknown names count: a misreport costs a log line, a
    missed lm_head the warning that nothing was fused."""
    if not vocab_wide(width, in_width):
        return False
    for names in _module_names(node, lin):
        if any(n in _WIDENING_NAMES or n in _WIDENING_PARENTS or "adapter" in n for n in names[-3:]):
            return False
    return True


def classifier_classes(site: Site) -> int | None:
    """The classes of the linear a refused loss site reads, where it has fewer than twice its input's width (a
    classifier, not an lm_head), else None; looked for up the loss input's first operands where the analysis
    stopped before reaching it."""
    node, gm = site.loss.input if site.loss else None, site.loss_node.graph.owning_module
    for _ in range(8):
        if not isinstance(node, fx.Node) or gm is None:
            return None
        lin = site.linear if site.linear is not None and site.linear.node is node else match_linear(gm, node)
        if lin is not None:
            out, x = meta_value(lin.node), meta_value(lin.input)
            if not (isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor) and out.dim() and x.dim()):
                return None
            classes, width = hint_int(out.shape[-1]), hint_int(x.shape[-1])
            return classes if classes is not None and width is not None and not vocab_wide(classes, width) else None
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if node.op not in ("call_function", "call_method") or name not in _SELECTING_STEPS:
            return None  # (through a contraction the walk would reach the hidden states' own linear)
        node = node.args[0] if node.args else None
    return None


#: Steps between a classifier's linear and its loss that pick, reshape or cast its outputs (``classifier_classes``
#: walks through these only).
_SELECTING_STEPS = {"getitem", "squeeze", "unsqueeze", "view", "reshape", "flatten", "split", "chunk", "unbind",
                    "contiguous", "float", "to", "type", "transpose", "permute", "t", "select", "narrow", "clone"}


def _adapted_logits(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """The logits of the low-rank-adapted lm_head whose own GEMM is ``node`` (peft's LoRA on "lm_head": the sum
    with the adapter, or its cast back: ``patterns.match_low_rank_head``), else None."""
    if len(node.users) != 1:
        return None
    head = match_low_rank_head(gm, next(iter(node.users)))
    return head.node if isinstance(head, LowRankHead) and head.base.node is node else None


def lone_heads(gm: fx.GraphModule, results: list[SiteResult]) -> list[LoneHead]:
    """The graph's lm_heads that no loss site of ``results`` has: a linear whose output, vocabulary-sized
    (``_vocab_sized``), the graph only returns (itself, or through casts and reshapes; with a low-rank adapter, its
    sum with it): logits an op of the graph reads may feed a loss the analysis refused, whose own reason is the one
    to give."""
    linked = {r.site.linear.node for r in results if r.site.linear is not None}
    heads = []
    for node in gm.graph.nodes:
        if node in linked or node.op not in ("call_function", "call_module"):
            continue
        lin = match_linear(gm, node)
        if lin is None:
            continue
        logits = _adapted_logits(gm, node) or node  # a LoRA'd head's logits are its sum with the adapter
        tensor_parallel = returned_through_redistribute(node)
        if not (tensor_parallel or (logits.users and _only_returned(logits))):
            continue
        out, x = meta_value(logits), meta_value(lin.input)
        if not isinstance(out, torch.Tensor) or out.dim() < 2 or not isinstance(out.shape[-1], int):
            continue
        in_width = (hint_int(x.shape[-1]) or 0) if isinstance(x, torch.Tensor) and x.dim() else 0
        if not _vocab_sized(node, lin, out.shape[-1], in_width):
            continue
        heads.append(LoneHead(node, lin.form, hint_int(out.numel() // out.shape[-1]), out.shape[-1],
                              tensor_parallel, out.requires_grad))
    return heads + _checkpointed_lone_heads(gm)


def _checkpointed_lone_heads(gm: fx.GraphModule) -> list[LoneHead]:
    """The lone lm_heads of ``gm``'s checkpointed regions: a head whose region returns its logits, the graph
    returning the region's outputs (``checkpoint_wrapper(model.lm_head)``: the head is the region's body). A region
    with a loss in it is the pass's (``checkpoints``), whose site reports give its reasons."""
    heads = []
    for node in gm.graph.nodes:
        region = checkpoint_body(gm, node)
        if region is None or not node.users:
            continue
        if all(u.op == "output" or _only_returned(u) for u in node.users):  # the region's outputs, taken apart
            heads += lone_heads(region[1], [])
    return heads


def _only_returned(node: fx.Node) -> bool:
    """Whether the graph only returns ``node``: each use is the output or a chain of off-chain steps to it
    (``_returned_after``)."""
    return all(u.op == "output" or _returned_after(u, node) is not None for u in node.users)
