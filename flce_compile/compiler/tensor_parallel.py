"""The tensor-parallel loss site: an lm_head sharded over the vocabulary with ``ColwiseParallel`` and its loss
taken under ``loss_parallel()``, rewritten into the vocabulary-parallel op.

What Dynamo records for ``parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Shard(-1),
use_local_output=False)})`` with ``F.cross_entropy`` on the logits while ``loss_parallel()`` is active (the
DTensor ops stay torch-level calls on DTensors; AOT autograd desugars them later)::

    x_dt = torch.distributed.tensor._api.from_local(x, mesh, (Replicate(),), run_check=False)   # input hook
    logits = torch._C._nn.linear(x_dt, weight, None)             # weight: a DTensor, (Shard(0),) on a 1-D mesh
    logits = logits.redistribute(placements=(Shard(dim=-1),), async_op=True)                     # output hook
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))   # a DTensor, (Replicate(),)

``patterns`` walks the ``redistribute`` as a step of the logits chain (``redistribute_step``); ``decide`` takes
such a site on the "vocab_parallel" path when ``vocab_parallel_obstacle`` finds nothing in the way, and the
rewrite calls ``flce_vocab_parallel_loss`` in place of the loss, on the lm_head's local input and its DTensor
weight: the redistribute, the GEMM and the loss's collectives leave the graph.

``loss_parallel()`` must be active while Dynamo traces, i.e. around the compiled call: entered inside the
compiled function, Dynamo does not apply it, and torch (2.13) fails to compile the loss ("got mixed
torch.Tensor and DTensor") before any backend sees the graph.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import fx

from ..dtensor import describe_layout, is_dtensor, is_vocab_sharded
from .patterns import ADVICE, Site, meta_value
from .spellings import dtensor_call, from_local_may_broadcast

#: What ``explain`` and the logs say about a tensor-parallel lm_head the pass does not rewrite.
def returned_through_redistribute(node: fx.Node) -> bool:
    """Whether the lm_head ``node``'s logits leave the graph through the output hook's ``redistribute`` (a
    tensor-parallel lm_head whose loss is computed outside the compiled graph)."""
    return any(dtensor_call(u) == "redistribute" and any(o.op == "output" for o in u.users) for u in node.users)


#: explain's reason for a tensor-parallel lm_head whose loss is not in the graph.
LONE_HEAD = (f"{ADVICE} on the logits (the loss is outside this graph); or compute the loss in the compiled "
             "forward and enter loss_parallel() around the compiled call, which backend='flce' rewrites")


def is_tensor_parallel(site: Site) -> bool:
    """Whether the site's logits pass through a ``redistribute`` (a DTensor lm_head)."""
    return any(step.kind == "redistribute" for step in site.steps)


def local_input(site: Site) -> fx.Node:
    """The lm_head's input as the plain tensor each rank holds: the argument of the input hook's
    ``from_local(x, mesh, (Replicate(),))`` when there is one that leaves it as it is, else the (replicated
    DTensor) input itself, which ``vocab_parallel_linear_cross_entropy`` takes as it is: a ``from_local`` with
    ``run_check=True`` may replace each rank's values with rank 0's (and torch 2.11 does not show the flag)."""
    x = site.linear.input
    if dtensor_call(x) == "from_local" and x.args and not from_local_may_broadcast(x):
        return x.args[0]
    return x


def vocab_parallel_obstacle(site: Site, escapes: dict[fx.Node, list[fx.Node]]) -> str | None:
    """None when the tensor-parallel ``site`` can be rewritten into the vocabulary-parallel op; else why not,
    ending with the advice to call the op directly."""
    lin, loss = site.linear, site.loss
    why = None
    weight = meta_value(lin.weight) if lin.weight is not None else None
    if lin.weight is None or lin.weight_is_transposed:
        why = f"the lm_head is a {lin.form}"
    elif not is_vocab_sharded(weight):
        layout = describe_layout(weight) if is_dtensor(weight) else "a plain tensor"
        why = f"the lm_head weight has {layout}, not (Shard(0),) on a 1-D mesh"
    elif lin.bias is not None and not is_vocab_sharded(meta_value(lin.bias)):
        why = "the lm_head bias is not sharded like its weight"
    elif lin.added_bias is not None:
        why = "a bias is added to the logits"
    elif loss.kind == "log_prob_gather":
        why = "the loss gathers per-token log-probs, which the vocabulary-parallel op does not return"
    elif escapes:
        why = f"the logits are used outside the loss ({', '.join(sorted(n.name for n in escapes))})"
    elif is_dtensor(meta_value(loss.target)):
        why = "the target is a DTensor"
    else:
        # The DTensor the lm_head reads (the input hook's from_local, in either spelling, or the input itself):
        # its layout, not that of the local tensor the op is then given.
        x = meta_value(site.linear.input)
        if is_dtensor(x) and not all(type(pl).__name__ == "Replicate" for pl in x.placements):
            why = f"the lm_head input has {describe_layout(x)}, not replicated"
    return None if why is None else f"{ADVICE} ({why})"


def flce_vocab_parallel_loss(
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
    as_dtensor: bool,
    compute_dtype: Optional[torch.dtype] = None,
    *,
    precision: str = "exact",
) -> torch.Tensor:
    """The graph-side call of the vocabulary-parallel op (a stable node target for the inner compiler and for
    tests): ``input`` (..., H) the same on every rank, ``weight`` the lm_head's Shard(0) DTensor. With
    ``as_dtensor`` the loss comes back as the replicated DTensor the loss_parallel loss was. ``compute_dtype``:
    the dtype the lm_head computed in, as for the single-device op (``head_dtype.compute_operands``); the op runs
    with autocast off."""
    from ..vocab_parallel import vocab_parallel_linear_cross_entropy
    from .head_dtype import compute_operands, head_autocast_off

    input, weight, bias = compute_operands(input, weight, bias, compute_dtype)
    with head_autocast_off(input):
        loss = vocab_parallel_linear_cross_entropy(
            input.reshape(-1, weight.shape[1]), weight, target.reshape(-1), bias, ce_weight=ce_weight,
            ignore_index=ignore_index,
            reduction=reduction, label_smoothing=label_smoothing, softcap=softcap, logit_scale=logit_scale,
            config=config, precision=precision,
        )
    if reduction == "none":
        loss = loss.view(target.shape)
    if loss.dtype != out_dtype:
        loss = loss.to(out_dtype)
    if as_dtensor:
        from torch.distributed.tensor import DTensor, Replicate

        loss = DTensor.from_local(loss, weight.device_mesh, [Replicate()], run_check=False)
    return loss
