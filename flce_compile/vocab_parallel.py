"""The vocabulary-parallel fused op: the lm_head's weight sharded over V across a process group (tensor
parallelism, as ``ColwiseParallel`` + ``loss_parallel()`` shard it), the loss without any rank holding, or
gathering, more than its own slice of the logits.

Every rank holds the same input (N, H) and target (N,) and a contiguous slice of the weight's rows, classes
[vocab_start, vocab_start + V_local) of V.

* Forward walks the tokens in chunks: the chunk's local logits (chunk x V_local), then the CE step in its
  "statistics" mode (``CEStepArgs.stats_out``) writes, per token, the slice's own lse_r of z, z at the target
  when the target lies in the slice (else 0) and the smoothing sum sum_c w_c (z_c - lse_r). After the loop one
  all-gather of those 3 x N numbers (fp64: a slice's lse is max + log(sum) unrounded, which keeps a confident
  row's 1 - p, as the single-device op's kept lse does) gives every rank every slice's statistics; each rank
  combines them in the same order (lse = logsumexp over ranks, the others summed: ``_smoothing_term``), so the
  loss, formed by the CE step's own row formula (``ce_torch.row_loss``, which covers class weights, label
  smoothing, z-loss), is bitwise identical on every rank. Softcap and logit_scale act per logit, inside the CE
  step. Only the per-token lse and target z are saved, with this slice's own largest z and its class, which the
  CE step finds beside its statistics (``chunked.kept_rows``, fp64).
* Backward recomputes the local logits by vocabulary block and token chunk (``recompute_backward`` with the
  shard's class offset): the logit gradient of the slice from the saved global lse (the target's and the slice's
  largest class's probabilities from the forward's z: backward's vocabulary blocks are other GEMMs than forward's,
  whose roundings can differ by more than a confident row's 1 - p), dW and db of the shard's
  rows (kept local: they are this rank's gradient), and this slice's share of dX, summed over ranks with one
  all-reduce (in fp32 by default, rounded once afterwards).

Why gradients in backward (the "recompute" form, four GEMMs) rather than in forward with the row statistics
all-reduced chunk by chunk: forming a chunk's gradient needs the global lse of its rows, so the forward form
needs one (latency-bound) collective per chunk inside the loop, each stalling the GEMMs behind it, plus a
V_local x H fp32 dW accumulator; here forward has a single collective of 24 bytes per token after the loop and
backward one dX all-reduce, the same amount as the forward form's, and the dW buffer is one block's. The cost
is a second logits GEMM, 1/world of the unsharded one on each rank. Reduction "none" (per-token grad_output)
comes for free.

Autograd: two ``torch.library`` custom ops, ``flce::vocab_parallel_cross_entropy`` and its ``_backward``, joined
by ``register_autograd`` (not a ``torch.autograd.Function``): ``torch.compile`` (``fullgraph=True`` included)
traces the public function into one opaque forward node, AOT autograd puts the backward op in the backward
graph, and the collectives run inside the op bodies at run time.

Collectives go through ``torch.distributed`` on the given group (gloo on the CPU, NCCL on GPUs), named by the
group's ``group_name`` across the custom-op boundary. No value is read back to the host on the GPU.
"""

from __future__ import annotations

import json
import weakref
import zlib
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .api import _autocast, _softcap_arg, _validate, _validate_scalars, check_ce_weight_placement
from .compile_cache_key import key_compile_caches
from .plan.precision import accum_dtype_for, check_precision
from .dtensor import describe_layout, is_dtensor, is_vocab_sharded
from .log import logger
from .op import TargetError, _check_first_order, check_targets, op_context
from .params import LossParams, decode_params, encode_params, math_dtype
from .plan.choose import op_config
from .plan.config import FLCEConfig, config_overrides
from .plan.layout import padded_row_elements
from .strategies import GradRequest, Operands
from .strategies.ce_common import CEStepArgs
from .strategies.ce_torch import row_loss
from .strategies.chunked import (
    KEPT_ROWS, LSE_DTYPE, _ce_step, _gradient_scales, _reduced_loss, _reduction_scales, _weight_sum,
    full_precision_gemm_reductions,
)
from .strategies.recompute import recompute_backward

_EMPTY = (0,)


#: All-gather into one tensor: ``all_gather_single`` where torch has it (2.13 deprecates the older name, which
#: torch 2.11 still needs).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _group(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _config(config: str, input: Tensor, weight: Tensor) -> FLCEConfig:
    """The config for this rank's shard (its V_local rows), chosen as the single-device op chooses it."""
    return op_config(config, input.shape[0], weight.shape[0], weight.shape[1], input.dtype, input.device)


def _is_nccl(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` runs on NCCL (GPU tensors; reading a result back is a host sync) rather than gloo."""
    return "nccl" in str(dist.get_backend(group))


def _checks_every_call(group: dist.ProcessGroup) -> bool:
    """Whether the cross-rank checks (``_check_tiling``, ``_agree_on_arguments``) run at every call on ``group``
    (a CPU group: gloo) or only at its first (NCCL, where reading the answer is a host sync). From the group's
    backend, which every rank shares: a setting that could differ between ranks (an environment variable) could
    send one rank into a collective the others skip."""
    return not _is_nccl(group)


#: Groups whose first vocab-parallel call checked the shards' tiling on the host (on the GPU; see ``_check_tiling``).
#: The group objects, not their names: torch names a new world's groups "0", "1", ... again after
#: ``destroy_process_group()``, and a new group must get its own first-call checks.
_CHECKED_GROUPS: weakref.WeakSet = weakref.WeakSet()


#: The fields of ``_call_digest``, as the error that names a difference says them.
_CALL_FIELDS = ("tokens", "hidden size", "dtype", "loss options", "bias", "ce_weight")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}


def _call_digest(input: Tensor, params: str, has_bias: bool, has_ce_weight: bool) -> list[int]:
    """What must be the same on every rank of a call, as ints for the layout check's all-gather (``_CALL_FIELDS``):
    a rank whose copy differs would give its own loss, or mismatched collectives (gloo aborts the process)."""
    return [input.shape[0], input.shape[1], _DTYPE_CODES.get(input.dtype, 9),
            zlib.crc32(params.encode()), int(has_bias), int(has_ce_weight)]


def _call_problem(calls: list[list[int]]) -> str | None:
    """Why the ranks' ``_call_digest`` rows differ, naming each differing field per rank, or None."""
    fields = [i for i in range(len(_CALL_FIELDS)) if len({row[i] for row in calls}) > 1]
    if not fields:
        return None
    names = {code: str(dtype).removeprefix("torch.") for dtype, code in _DTYPE_CODES.items()}
    shown = [", ".join(f"rank {rank} {names.get(row[i], row[i]) if _CALL_FIELDS[i] == 'dtype' else row[i]}"
                       for rank, row in enumerate(calls)) for i in fields]
    return ("vocab_parallel_linear_cross_entropy: the ranks' calls differ (every rank raises this): "
            + "; ".join(f"{_CALL_FIELDS[i]}: {text}" for i, text in zip(fields, shown))
            + ". The input, targets and loss options must be the same on every rank (loss options: a digest of "
            "reduction, ignore_index, label_smoothing, softcap, logit_scale, z_loss)")


def _check_tiling(group: dist.ProcessGroup, vocab_start: int, v_local: int, vocab_total: int,
                  device: torch.device, target: Tensor, ignore_index: int,
                  call: Callable[[], list[int]]) -> None:
    """Raise the same ValueError on every rank when the ranks' shards do not tile the classes [0, V): uneven
    shards given as local tensors without ``vocab_start``/``vocab_size``, whose defaults assume equal ones, would
    otherwise give a wrong loss. One all-gather of ten numbers per rank and a host read (``_checks_every_call``:
    at every call on the CPU; on the GPU, where the read is a host sync, at the group's first call only, or the
    first outside a CUDA-graph capture); later calls there have the device-side guard (each rank's layout
    rides in ``_slice_stats``' all-gather, ``_tiles`` checks it, ``_combine`` returns a NaN loss). Every rank
    checks the same gathered numbers and every rank of a group makes the same calls, so all raise or none does,
    and none waits in a collective for a rank that raised. The same all-gather carries whether this rank's
    ``target`` failed ``check_targets`` (CPU targets, or FLCE_DEBUG=1): a bad label on one rank's copy raises a
    TargetError on every rank; and the rank's ``call()`` (``_call_digest``, formed only when the check runs): a
    rank whose input shape, dtype or loss options differ raises a ValueError on every rank."""
    if not _checks_every_call(group) and (group in _CHECKED_GROUPS or _capturing()):
        check_targets(target, vocab_total, ignore_index)
        return
    try:
        check_targets(target, vocab_total, ignore_index)
        refused = None
    except TargetError as exc:
        refused = exc
    every = _all_gathered(group, [vocab_start, v_local, vocab_total, refused is not None, *call()], device).tolist()
    problem = _tiling_problem([row[:3] for row in every]) or _call_problem([row[4:] for row in every])
    if problem is not None:
        raise ValueError(problem)
    _CHECKED_GROUPS.add(group)
    if refused is not None:
        raise refused
    bad = [rank for rank, row in enumerate(every) if row[3]]
    if bad:
        raise TargetError(f"the targets of rank(s) {', '.join(map(str, bad))} hold class ids outside [0, "
                          f"{vocab_total}) and not ignore_index={ignore_index} (every rank raises this): fix the "
                          "labels there; the targets must be the same on every rank")


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (never on a torch without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _all_gathered(group: Any, values: list[int], device: torch.device) -> Tensor:
    """Every rank's ``values`` (world, len(values)) as int64 on ``device``: one all-gather."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    every = mine.new_empty(dist.get_world_size(group) * len(values))
    _all_gather_single(every, mine, group=group)
    return every.view(-1, len(values))


def _tiling_problem(layouts: list[list[int]]) -> str | None:
    """Why the shards ``layouts`` (per rank: first class, rows, classes in all) do not tile [0, V), or None; the
    test is the device guard's own (``_tiles``)."""
    if bool(_tiles(torch.tensor(layouts), layouts[0][2])):
        return None
    totals = sorted({total for _start, _rows, total in layouts})
    shards = ", ".join(f"rank {rank} [{start}, {start + rows})" for rank, (start, rows, _t) in enumerate(layouts))
    return (f"the ranks' weight shards do not tile the vocabulary: classes {shards} of V = "
            f"{' / '.join(map(str, totals))}. Pass each rank's first class id as vocab_start= and the number of "
            "classes as vocab_size= (the defaults, rank x rows and world x rows, hold for equal shards only; "
            "Shard(0) of a V the world size does not divide leaves the last shards short), or a DTensor weight")


def _slice_stats(ops: Operands, p: LossParams, config: FLCEConfig, vocab_start: int,
                 vocab_total: int) -> tuple[Tensor, Tensor]:
    """(stats, top). stats, (3, N + 1) in ``LSE_DTYPE``: this slice's lse, target z and smoothing sum per token
    (``CEStepArgs.stats_out``), chunk by chunk, and in the last column this rank's first class, rows and classes
    in all (for ``_tiles``). top, (2, N): the slice's largest z per token and its class (``CEStepArgs.top_out``),
    which this rank's backward keeps: the class near p = 1 of a confident row lies in one slice, whose backward
    then forms its probability from the forward's z."""
    x, weight, bias = ops.x, ops.weight, ops.bias
    n = x.shape[0]
    v_local = weight.shape[0]
    dtype = math_dtype(x.dtype)
    stats = torch.empty(3, n + 1, dtype=LSE_DTYPE, device=x.device)
    top = torch.empty(2, n, dtype=LSE_DTYPE, device=x.device)
    for row, number in enumerate((vocab_start, v_local, vocab_total)):  # fills: no host memory, capturable
        stats[row, n].fill_(number)
    chunk = max(1, min(config.chunk_tokens, n))
    buffer = torch.empty(chunk, padded_row_elements(v_local, x.element_size()), dtype=x.dtype, device=x.device)
    one = torch.ones((), dtype=dtype, device=x.device)
    weight_sum = _weight_sum(ops.ce_weight, vocab_total, dtype, x.device)
    ce_step = _ce_step(config)
    weight_t = weight.t()
    with full_precision_gemm_reductions(x.device, chunked=chunk < n):
        for t0 in range(0, n, chunk):
            t1 = min(t0 + chunk, n)
            logits = buffer[: t1 - t0, :v_local]
            if bias is not None:
                torch.addmm(bias, x[t0:t1], weight_t, out=logits)
            else:
                torch.mm(x[t0:t1], weight_t, out=logits)
            ce_step(CEStepArgs(
                logits=logits, target=ops.target[t0:t1], ce_weight=ops.ce_weight, weight_sum=weight_sum,
                ce_scale=one, z_scale=one, loss_out=None, lse_out=None, lse_in=None, write_grad=False,
                class_offset=vocab_start, num_classes=vocab_total, stats_out=stats[:, t0:t1], scratch=True,
                top_out=top[:, t0:t1],
            ), p)
    return stats, top


def _tiles(layouts: Tensor, vocab_total: int) -> Tensor:
    """Whether the ranks' shards tile [0, V), on the device (0-dim bool, no host read): ``layouts`` (world, 3) holds
    each rank's first class, rows and classes in all."""
    starts, rows, totals = layouts.unbind(1)
    order = starts.argsort(stable=True)
    first, ends = starts[order], (starts + rows)[order]
    return ((first[1:] == ends[:-1]).all() & (first[0] == 0) & (ends[-1] == vocab_total)
            & (totals == vocab_total).all())


def _combine(gathered: Tensor, top: Tensor, ops: Operands, p: LossParams,
             vocab_total: int) -> tuple[Tensor, Tensor]:
    """(loss, kept) from every rank's ``_slice_stats``, ``gathered`` (world, 3, N + 1), combined in rank order:
    kept (4, N) holds each token's lse and target z, and this rank's ``top``, for backward (``chunked.kept_rows``).
    When the ranks' layouts (the last column) do not tile the vocabulary, the loss and the lse are NaN: the
    guard of the calls whose layout ``_check_tiling`` did not read on the host."""
    target, ce_weight = ops.target, ops.ce_weight
    stats = gathered[:, :, :-1]
    tiled = _tiles(gathered[:, :, -1], vocab_total)
    dtype = math_dtype(ops.x.dtype)  # the loss's and the scales'; the statistics and the lse stay fp64
    lse = torch.logsumexp(stats[:, 0], dim=0)
    lse = torch.where(tiled, lse, torch.full_like(lse, float("nan")))
    z_y = stats[:, 1].sum(dim=0)
    ignored = target == p.ignore_index
    invalid = ~ignored & ((target < 0) | (target >= vocab_total))
    safe = torch.where(ignored | invalid, torch.zeros_like(target), target)
    w_y = ce_weight[safe] if ce_weight is not None else torch.ones((), dtype=dtype, device=lse.device)
    ce_scale, z_scale = _reduction_scales(target, ce_weight, p, vocab_total, dtype)
    scales = _gradient_scales(ce_scale, z_scale, p.reduction)
    smoothing = _smoothing_term(stats, gathered[:, :, -1], lse, ce_weight) if p.label_smoothing else None
    rows = row_loss(p, lse, z_y, smoothing, w_y, vocab_total, scales.ce, scales.z, ignored, invalid).to(dtype)
    loss = rows if p.reduction == "none" else _reduced_loss(rows, ce_scale, scales, p)
    return torch.where(tiled, loss, torch.full_like(loss, float("nan"))), torch.cat((lse[None], z_y[None], top))


def _smoothing_term(stats: Tensor, layouts: Tensor, lse: Tensor, ce_weight: Tensor | None) -> Tensor:
    """Each token's sum_c w_c (lse - z_c) over all classes, from the slices' sums S_r = sum_c w_c (z_c - lse_r)
    (``CEStepArgs.stats_out``): the sum over ranks of W_r (lse - lse_r) - S_r, with W_r the class weight of rank
    r's slice (its rows without class weights). Every term is >= 0 for non-negative weights, so nothing cancels
    (the ranks' raw sums of w_c z_c did, against W lse, under a large common offset of the logits). W_r comes
    from the layouts (first class, rows) on the device: no host read."""
    starts, rows = layouts[:, 0], layouts[:, 1]
    if ce_weight is None:
        slice_weight = rows.to(lse.dtype)
    else:
        ends_of = torch.cat((ce_weight.new_zeros(1, dtype=lse.dtype), ce_weight.to(lse.dtype).cumsum(0)))
        last = ends_of.shape[0] - 1  # (clamped: a layout that does not tile gives a NaN loss anyway)
        first = starts.long().clamp(0, last)
        slice_weight = ends_of[(starts + rows).long().clamp(0, last)] - ends_of[first]
    gap = slice_weight[:, None] * (lse[None, :] - stats[:, 0])
    gap = torch.where(slice_weight[:, None] == 0, 0.0, gap)  # an empty slice: lse_r = -inf, and 0 * inf is nan
    return (gap - stats[:, 2]).sum(dim=0)


@torch.library.custom_op("flce::vocab_parallel_cross_entropy", mutates_args=())
def vocab_parallel_cross_entropy_op(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor],
    ce_weight: Optional[Tensor],
    params: str,
    accum_dtype: torch.dtype,
    vocab_start: int,
    vocab_total: int,
    group_name: str,
    config: str,
) -> tuple[Tensor, Tensor]:
    """(loss, kept: ``_combine``'s) of this rank's shard ``weight`` (V_local, H), rows
    [vocab_start, +V_local) of ``vocab_total``, over the group ``group_name``; see the module docstring.
    ``accum_dtype`` is for backward."""
    group = _group(group_name)
    p = decode_params(params)
    # First: a rank whose own checks raised while the others waited in a collective would hang them.
    _check_tiling(group, vocab_start, weight.shape[0], vocab_total, input.device, target, p.ignore_index,
                  lambda: _call_digest(input, params, bias is not None, ce_weight is not None))
    ops = Operands(input, weight, target, bias, ce_weight)
    logger.debug("flce: vocab-parallel loss over group %s, classes [%d, %d) of %d", group_name, vocab_start,
                 vocab_start + weight.shape[0], vocab_total)
    with op_context(input.device):
        stats, top = _slice_stats(ops, p, _config(config, input, weight), vocab_start, vocab_total)
        gathered = stats.new_empty((dist.get_world_size(group) * 3, stats.shape[1]))
        _all_gather_single(gathered, stats, group=group)
        return _combine(gathered.view(-1, 3, stats.shape[1]), top, ops, p, vocab_total)


@vocab_parallel_cross_entropy_op.register_fake
def _vocab_parallel_fake(input, weight, target, bias, ce_weight, params, accum_dtype, vocab_start, vocab_total,
                         group_name, config):
    key_compile_caches()  # (compile_cache_key.py)
    n = input.shape[0]
    dtype = math_dtype(input.dtype)
    per_token = decode_params(params).reduction == "none"
    return (input.new_empty((n,) if per_token else (), dtype=dtype),
            input.new_empty((KEPT_ROWS, n), dtype=LSE_DTYPE))


@torch.library.custom_op("flce::vocab_parallel_cross_entropy_backward", mutates_args=())
def vocab_parallel_cross_entropy_backward_op(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor],
    ce_weight: Optional[Tensor],
    lse: Tensor,
    grad_loss: Tensor,
    params: str,
    accum_dtype: torch.dtype,
    vocab_start: int,
    vocab_total: int,
    group_name: str,
    compute_dx: bool,
    compute_dw: bool,
    compute_db: bool,
    config: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw, db): dX of the whole loss (all-reduced over the group), dW and db of this rank's rows only.
    An output not asked for is an empty tensor."""
    p = decode_params(params)
    ops = Operands(input, weight, target, bias, ce_weight)
    grads = GradRequest(compute_dx, compute_dw, compute_db)
    with op_context(input.device):
        dx, dw, db = recompute_backward(ops, lse, grad_loss, p, _config(config, input, weight), accum_dtype, grads,
                                        classes=(vocab_start, vocab_total), round_dx=False)
        if dx is not None:
            dist.all_reduce(dx, op=dist.ReduceOp.SUM, group=_group(group_name))
            dx = dx.to(input.dtype)
    return (dx if dx is not None else input.new_empty(_EMPTY), dw if dw is not None else weight.new_empty(_EMPTY),
            db if db is not None else weight.new_empty(_EMPTY))


@vocab_parallel_cross_entropy_backward_op.register_fake
def _vocab_parallel_backward_fake(input, weight, target, bias, ce_weight, lse, grad_loss, params, accum_dtype,
                                  vocab_start, vocab_total, group_name, compute_dx, compute_dw, compute_db, config):
    return (input.new_empty(input.shape if compute_dx else _EMPTY),
            weight.new_empty(weight.shape if compute_dw else _EMPTY),
            weight.new_empty(bias.shape if compute_db and bias is not None else _EMPTY))


_ARG_NAMES = ("input", "weight", "target", "bias", "ce_weight", "params", "accum_dtype", "vocab_start",
              "vocab_total", "group_name", "config")


def _setup_context(ctx, inputs, output) -> None:
    args = dict(zip(_ARG_NAMES, inputs))
    _loss, lse = output
    ctx.args = {k: v for k, v in args.items() if not isinstance(v, Tensor) and v is not None}
    ctx.has_bias = args["bias"] is not None
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(args["input"], args["weight"], args["target"], args["bias"], args["ce_weight"], lse)


def _backward(ctx, grad_loss, _grad_lse):
    _check_first_order()
    need_x, need_w, _t, need_b = ctx.needs_input_grad[:4]
    rest = (None,) * (len(_ARG_NAMES) - 4)
    if grad_loss is None:
        return (None,) * len(_ARG_NAMES)
    a = ctx.args
    input, weight, target, bias, ce_weight, lse = ctx.saved_tensors
    need_b = bool(need_b and ctx.has_bias)
    dx, dw, db = vocab_parallel_cross_entropy_backward_op(
        input, weight, target, bias, ce_weight, lse, grad_loss, a["params"], a["accum_dtype"], a["vocab_start"],
        a["vocab_total"], a["group_name"], need_x, need_w, need_b, a["config"],
    )
    return (dx if need_x else None, dw if need_w else None, None, db if need_b else None) + rest


torch.library.register_autograd("flce::vocab_parallel_cross_entropy", _backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------------------
# the public function


def _replicated_local(t: Tensor | None, name: str) -> Tensor | None:
    """A replicated DTensor's local tensor (the same on every rank); a plain tensor as it is."""
    if t is None or not is_dtensor(t):
        return t
    from torch.distributed.tensor import Replicate

    if not all(isinstance(pl, Replicate) for pl in t.placements):
        raise ValueError(
            f"{name} is a DTensor with {describe_layout(t)}; the vocabulary-parallel op needs it replicated (the same "
            f"on every rank): pass {name}.redistribute(placements=[Replicate()]) or {name}.full_tensor()"
        )
    return t.to_local()


def _shard0_offset(vocab: int, world: int, rank: int, local_rows: int) -> int:
    """The first row of ``rank``'s block of a Shard(0) DTensor: torch splits V as ``torch.chunk`` does,
    ceil(V / world) rows a rank, the last ones short (computed here from sizes alone: torch's own helper reads
    a tensor, which fails while a compiler traces with fake tensors)."""
    chunk = -(-vocab // world)
    start = min(rank * chunk, vocab)
    if local_rows != min(chunk, vocab - start):
        raise ValueError(
            f"the weight's local shard has {local_rows} rows where Shard(0) of {vocab} rows over {world} ranks "
            f"gives rank {rank} {min(chunk, vocab - start)}: pass its local shard (weight.to_local()) with group=, "
            "vocab_start= (its first class) and vocab_size= (all classes)"
        )
    return start


def _shard_of(weight: Tensor, bias: Tensor | None, group: Any, vocab_start: int | None,
              vocab_size: int | None) -> tuple[Tensor, Tensor | None, Any, int, int]:
    """(local weight, local bias, group, vocab_start, vocab_total) from a Shard(0) DTensor or a local shard."""
    if is_dtensor(weight):
        if not is_vocab_sharded(weight):
            raise ValueError(
                f"weight is a DTensor with {describe_layout(weight)}; vocab_parallel_linear_cross_entropy takes one "
                "sharded over the vocabulary, placements (Shard(0),) on a 1-D mesh. weight.full_tensor() gathers "
                "it for the single-device fused_linear_cross_entropy (exact, but every rank holds all of it)"
            )
        if group is not None or vocab_start is not None or vocab_size is not None:
            raise ValueError("group, vocab_start and vocab_size come from the DTensor weight's mesh and shape; "
                             "pass them only with a plain local-shard weight")
        mesh = weight.device_mesh
        local = weight.to_local()
        start = _shard0_offset(weight.shape[0], mesh.size(), mesh.get_local_rank(), local.shape[0])
        local_bias = None
        if bias is not None:
            if not is_dtensor(bias) or tuple(bias.placements) != tuple(weight.placements):
                raise ValueError("bias must be sharded like the weight: a DTensor with placements (Shard(0),)")
            local_bias = bias.to_local()
        return local, local_bias, mesh.get_group(), start, int(weight.shape[0])
    if group is None:
        raise ValueError(
            "weight is a plain tensor, so the vocabulary-parallel op needs group= (the process group its rows are "
            "sharded over); pass a DTensor with placements (Shard(0),) instead to take the group from its mesh"
        )
    if is_dtensor(bias):
        raise ValueError("bias is a DTensor but weight is a local shard: pass bias's local shard (bias.to_local())")
    v_local = weight.shape[0] if weight.dim() == 2 else 0
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    start = rank * v_local if vocab_start is None else int(vocab_start)
    total = world * v_local if vocab_size is None else int(vocab_size)
    if vocab_start is not None and vocab_size is None:
        # Inferring the total from this rank's rows would let uneven shards disagree on it and hang the others.
        raise ValueError(f"vocab_start={vocab_start} needs vocab_size= too (the number of classes over all ranks)")
    if vocab_start is None and vocab_size is not None and vocab_size != world * v_local:
        raise ValueError(f"vocab_size={vocab_size} is not {world} ranks x {v_local} rows: uneven shards need "
                         "vocab_start= as well")
    if not 0 <= start <= total - v_local:
        raise ValueError(f"vocab_start={start} with {v_local} local rows lies outside the vocabulary [0, {total}): "
                         "pass the shard's first class id as vocab_start and all classes as vocab_size")
    return weight, bias, group, start, total


#: Groups whose ranks agreed on a call's arguments; on GPU groups the agreement runs at their first call only.
#: (Group objects, as ``_CHECKED_GROUPS``.)
_AGREED_GROUPS: weakref.WeakSet = weakref.WeakSet()


def _agreement_group(weight: Any, group: Any) -> Any:
    """The group whose ranks must agree on a call's arguments: ``group``, or a vocabulary-sharded DTensor weight's
    mesh group; None when there is none (then the call's own error is the same on every rank)."""
    if group is not None:
        return group
    return weight.device_mesh.get_group() if is_vocab_sharded(weight) else None


def _traced() -> bool:
    """Whether this call is being traced, as it is on every rank alike (Dynamo, or AOT autograd's trace with fake
    tensors): the wrapper's cross-rank check runs no collective then. A user's own dispatch mode (a FLOP counter,
    perhaps on one rank only) is not tracing: the check runs under it as without it, so the ranks' collectives
    stay paired."""
    if torch.compiler.is_compiling():  # (asked first: Dynamo would break the graph on the rest)
        return True
    keys = torch._C._TorchDispatchModeKey
    return any(torch._C._get_dispatch_mode(key) is not None for key in (keys.FAKE, keys.PROXY))


def _agree_on_arguments(group: Any, error: Exception | None, input: Any, grads: int = 0) -> None:
    """Raise on every rank of ``group`` when any rank refused its arguments (``error``: this rank's refusal, or
    None), so that no rank waits in the op's first collective for one that raised: an uneven or mistyped
    layout (``vocab_start``, ``vocab_size``, a shard's rows, a class-weight shape) or an option can be wrong on
    some ranks only. ``grads``: whether this rank's call asks for dX (``_input_grad_asked``), which must agree too
    (backward's all-reduce of dX runs only where dX is asked: ranks that differ hung there; dW and db are each
    rank's own, so a shard frozen on some ranks only is fine). One all-gather of two
    numbers per rank and a host read (at every call on CPU groups, at a group's first call on NCCL ones:
    ``_checks_every_call``); the refusals' messages are exchanged only when some rank refused. While the call is
    traced (``_traced``) or a CUDA graph is being captured, a rank raises its own error alone."""
    if (group is None or _traced() or _capturing()
            or (not _checks_every_call(group) and group in _AGREED_GROUPS)):  # no exchange: a rank's own error
        if error is not None:
            raise error
        return
    world = dist.get_world_size(group)
    rows = _all_gathered(group, [error is not None, grads], _collective_device(group, input)).tolist()
    if not any(refused for refused, _ in rows):
        if len({asked for _, asked in rows}) > 1:
            asking = ", ".join(str(rank) for rank, (_, asked) in enumerate(rows) if asked)
            raise ValueError("vocab_parallel_linear_cross_entropy: the hidden states require grad on some ranks "
                             f"only (rank(s) {asking} of {world}; every rank raises this): backward all-reduces dX "
                             "across the ranks, so they must require grad (or not) on every rank alike")
        _AGREED_GROUPS.add(group)
        return
    refusals: list[Any] = [None] * world
    dist.all_gather_object(refusals, None if error is None else (type(error).__name__, str(error)), group=group)
    failed = [(rank, refusal) for rank, refusal in enumerate(refusals) if refusal is not None]
    if error is not None and len(failed) == world and len({refusal for _, refusal in failed}) == 1:
        raise error  # every rank refused the same way: its own error, as a single process would raise it
    ranks = "; ".join(f"rank {rank}: {kind}: {message}" for rank, (kind, message) in failed)
    raise ValueError(f"vocab_parallel_linear_cross_entropy: the arguments were refused on {len(failed)} of "
                     f"{world} ranks (every rank raises this) - {ranks}") from error


def _input_grad_asked(input: Tensor) -> int:
    """1 when a call asks for dX (the one gradient whose backward is a collective), else 0."""
    return int(torch.is_grad_enabled() and input.requires_grad)


def _collective_device(group: Any, input: Any) -> torch.device:
    """Where this rank's tensors for a collective on ``group`` go: the CPU for gloo; for NCCL the input's GPU, or
    the current one when the input is not a CUDA tensor (a refused call's)."""
    if not _is_nccl(group):
        return torch.device("cpu")
    if isinstance(input, Tensor) and input.is_cuda:
        return input.device
    return torch.device("cuda", torch.cuda.current_device())


def _check_supported(return_logits: bool, memory_budget_gb: float | None, precision: str,
                     config: Any) -> dict[str, Any] | None:
    """The config's forced fields, after refusing the options this op does not take, and bad ones, before any
    collective (``_agree_on_arguments``: an option wrong on one rank raised there alone, while the others waited
    in the op's first collective)."""
    if return_logits:
        raise NotImplementedError(
            "return_logits=True is not supported by vocab_parallel_linear_cross_entropy: no rank ever holds the "
            "whole logits. Compute the sharded logits with F.linear on the local shard if you need them"
        )
    if memory_budget_gb is not None:
        raise NotImplementedError(
            "memory_budget_gb is not supported by vocab_parallel_linear_cross_entropy: its memory is one chunk of "
            "local logits and the recompute backward's buffers; pass config={'chunk_tokens': ..., 'vocab_block': "
            "...} to make them smaller"
        )
    if check_precision(precision) == "precise":
        # Its forward reduces per-slice statistics of bf16 logits; fp32 logits there are not implemented.
        raise NotImplementedError(
            "precision='precise' is not supported by vocab_parallel_linear_cross_entropy: its forward combines "
            "the ranks' statistics of compute-dtype logits; use 'exact' (errors no larger than eager's) or "
            "'compact'"
        )
    forced = config_overrides(config)
    if forced and forced.get("fp32_logits"):
        raise NotImplementedError(
            "config fp32_logits=True is not supported by vocab_parallel_linear_cross_entropy (its forward combines "
            "the ranks' statistics of compute-dtype logits); leave it out"
        )
    return forced


def vocab_parallel_linear_cross_entropy(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    group: Any = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    ce_weight: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    z_loss: float = 0.0,
    accum_dtype: torch.dtype | None = None,
    precision: str = "exact",
    config: FLCEConfig | Mapping[str, Any] | None = None,
    return_logits: bool = False,
    memory_budget_gb: float | None = None,
) -> Tensor:
    """``fused_linear_cross_entropy`` with the lm_head's weight sharded over the vocabulary across ranks.

    Same loss and options as ``fused_linear_cross_entropy`` over the whole (V, H) weight; no rank forms more
    than its own slice of the logits, a chunk at a time, and none is gathered.

    Args:
        input: (..., H), the same on every rank (a plain tensor, or a DTensor replicated on the mesh).
        weight: either a DTensor with placements (Shard(0),) on a 1-D mesh (the group, the shard's offset and V
            come from it), or this rank's contiguous block of rows (V_local, H) of the full weight with ``group``.
        target: (...) class ids in [0, V), the same on every rank. bias: (V,) sharded like the weight, or None.
        group: the process group of a plain local-shard weight. vocab_start, vocab_size: the shard's first class
            and V; by default rank * V_local and world * V_local (equal, contiguous shards in rank order).
        ce_weight: (V,) class weights over all classes, the same on every rank.
        The other options are ``fused_linear_cross_entropy``'s. ``return_logits=True`` and ``memory_budget_gb``
        raise NotImplementedError: the logits never exist whole, and the memory is fixed by the shard (one
        chunk of local logits in forward, the "recompute" loop's buffers in backward).

    Returns the loss, identical on every rank (a plain tensor): fp32, 0-dim, or shaped like ``target`` for
    "none". Its gradient reaches ``input`` in full (every slice's share, all-reduced), and the weight and bias
    shards with their own rows only (a Shard(0) DTensor gradient for a DTensor weight).
    """
    agreeing = _agreement_group(weight, group)
    try:  # checks that may fail on some ranks only: every rank hears of a refusal before any raises
        forced = _check_supported(return_logits, memory_budget_gb, precision, config)
        weight_local, bias_local, group, start, total = _shard_of(weight, bias, group, vocab_start, vocab_size)
        input = _replicated_local(input, "input")
        target = _replicated_local(target, "target")
        ce_weight = _replicated_local(ce_weight, "ce_weight")
        if isinstance(softcap, torch.Tensor):
            raise TypeError("softcap must be a Python float or None here: the vocab-parallel op takes it as a "
                            "constant (fused_linear_cross_entropy alone also reads a 0-dim CPU tensor at run time)")
        _validate(input, weight_local, target, bias_local, None, reduction, label_smoothing, softcap)
        _validate_scalars(ignore_index, logit_scale, z_loss)
        if ce_weight is not None and (tuple(ce_weight.shape) != (total,) or not ce_weight.is_floating_point()):
            raise ValueError(f"ce_weight must be a floating tensor of shape ({total},) (a weight per class of the "
                             f"whole vocabulary, on every rank), got {tuple(ce_weight.shape)} {ce_weight.dtype} (V is "
                             "vocab_size= when given, else the world size x this rank's rows)")
        if ce_weight is not None:
            check_ce_weight_placement(ce_weight, weight_local.device)
        grads = _input_grad_asked(input)
        input, weight_local, bias_local = _autocast(input, weight_local, bias_local)
        accum = accum_dtype_for(precision, accum_dtype, weight_local.dtype)
    except Exception as exc:  # any refusal (a None weight's AttributeError too) is agreed on before it is raised
        _agree_on_arguments(agreeing, exc, input)
        raise
    _agree_on_arguments(agreeing, None, input, grads)
    hidden = weight_local.shape[1]
    x2d = input.reshape(target.numel(), hidden)
    params = LossParams(int(ignore_index), reduction, float(label_smoothing), _softcap_arg(softcap),
                        float(logit_scale), float(z_loss))
    group_name = group.group_name
    loss, _lse = vocab_parallel_cross_entropy_op(
        x2d.contiguous(),
        weight_local.contiguous(),
        target.reshape(-1).long().contiguous(),
        bias_local.contiguous() if bias_local is not None else None,
        ce_weight.to(math_dtype(weight_local.dtype)).contiguous() if ce_weight is not None else None,
        encode_params(params),
        accum,
        start,
        total,
        group_name,
        json.dumps(forced, sort_keys=True) if forced else "",
    )
    return loss.view(target.shape) if reduction == "none" else loss
