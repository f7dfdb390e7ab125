"""The chunk loop shared by every strategy: per chunk of tokens, logits GEMM -> CE step -> dX and dW GEMMs.

Only one chunk of logits exists at a time (two with stream overlap); the CE step overwrites it with the logit
gradient, so the three GEMMs are all the matrix work a call does. Nothing here reads a device value on the
host: token counts and normalisers stay on the device, so the loop never stalls the GPU and can be captured
in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from ..params import LossParams, math_dtype
from ..plan import registry
from ..plan.config import FLCEConfig
from ..plan.layout import aligned_head_rows, padded_row_elements
from ..plan.precision import fp32_logits_on
from .ce_common import CEStepArgs
from . import fp32_gemms, true_class
from .padded_tail import padded_tail, splits_padding, zero_padded_rows
from .wide_logits import fp32_logits_into

Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


@dataclass(frozen=True)
class Operands:
    """The tensors of one call: x (N, H), weight (V, H), target (N,) int64, bias (V,) and class weights (V,)
    fp32, both optional."""

    x: torch.Tensor
    weight: torch.Tensor
    target: torch.Tensor
    bias: torch.Tensor | None = None
    ce_weight: torch.Tensor | None = None


@dataclass(frozen=True)
class GradRequest:
    """Which gradients a pass computes. ``dw_from``: dW only for the weight's columns from this one on (the
    leading ones are frozen: ``LossParams.frozen_weight_columns``); the dW returned has H - dw_from columns."""

    dx: bool = False
    dw: bool = False
    db: bool = False
    dw_from: int = 0

    @property
    def any(self) -> bool:
        return self.dx or self.dw or self.db


def _ce_step(config: FLCEConfig) -> Callable[[CEStepArgs, LossParams], None]:
    """The CE step of ``config``'s strategy (its registry entry), with the config's launch parameters bound."""
    return functools.partial(registry.get(config.strategy).step(), config=config)


@functools.lru_cache(maxsize=64)
def _side_stream(device: torch.device, main_stream: int) -> torch.cuda.Stream:
    """The side stream of the calling stream ``main_stream`` (its handle) on ``device``.

    One per calling stream, not one per device: a CUDA-graph capture, or a thread on a stream of its own, must
    not share its side stream with work on other streams (a captured stream may not wait on uncaptured work).
    Streams come from a bounded pool, so the cache stays small; an evicted entry only costs a new stream.
    """
    return torch.cuda.Stream(device=device)


class _StreamOverlap:
    """Runs each chunk's dW/db GEMMs on a side stream while the main stream goes on (``config.streams``).

    Events order the two: a chunk's weight-gradient GEMMs start after its logit gradient is written, and a
    buffer is only rewritten after the GEMMs that read it are done. ``join`` must run however the loop ends,
    or a buffer could go back to the allocator while the side stream still reads it.
    """

    def __init__(self, device: torch.device) -> None:
        self.main = torch.cuda.current_stream(device)
        self.side = _side_stream(device, self.main.cuda_stream)
        self.buffer_free: list[torch.cuda.Event | None] = [None, None]

    def wait_for_buffer(self, slot: int) -> None:
        """Make the main stream wait until the GEMMs that last read buffer ``slot`` are done."""
        if self.buffer_free[slot] is not None:
            self.main.wait_event(self.buffer_free[slot])

    @contextlib.contextmanager
    def on_side(self, slot: int) -> Iterator[None]:
        """Run the body on the side stream, after the main stream's work so far; it reads buffer ``slot``."""
        self.side.wait_event(self.main.record_event())
        with torch.cuda.stream(self.side):
            yield
            self.buffer_free[slot] = self.side.record_event()

    def join(self) -> None:
        """Order everything after the loop (and the buffers' release) behind the side stream's work."""
        self.main.wait_stream(self.side)


def _stream_overlap(config: FLCEConfig, device: torch.device, grads: "GradRequest") -> _StreamOverlap | None:
    """A side-stream overlap when the config asks for one and there is weight-gradient work to move there."""
    if config.streams and device.type == "cuda" and (grads.dw or grads.db):
        return _StreamOverlap(device)
    return None


def add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, path: str = "addmm", *,
                overwrite: bool = False) -> None:
    """``acc += a @ b`` with ``acc`` in a wider dtype than ``a`` and ``b`` (fp32 sums of bf16/fp16 products);
    with ``overwrite``, ``acc = a @ b`` (``acc``'s old contents, uninitialised memory included, are never read:
    the GEMM runs with beta = 0, so the accumulator needs no zeroing before the first chunk).

    On CUDA, bf16/fp16 operands can add straight into an fp32 accumulator (cuBLAS with an fp32 C, through
    ``out_dtype``); where that is missing, or with path="mm_add", the product goes through a temporary. On
    the CPU the operands are upcast (no mixed-dtype GEMM there).
    """
    beta = 0 if overwrite else 1
    into = path != "mm_add"  # "addmm", and "addmm_round" (which differs only in how the last chunk's sums end)
    if into and fp32_gemms.addmm_into(acc, a, b, beta):
        return
    if into and acc.device.type != "cuda":
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype), beta=beta)
    else:
        _store(acc, torch.mm(a, b), overwrite)


def _store(acc: torch.Tensor, product: torch.Tensor, overwrite: bool) -> None:
    """``acc = product`` or ``acc += product``, in acc's dtype."""
    if overwrite:
        acc.copy_(product)
    else:
        acc.add_(product)


class _DwAccumulator:
    """Accumulates dW = sum over chunks of G_c^T X_c, in fp32 (``add_product``) or in the weight dtype.

    With ``single_chunk`` there is nothing to accumulate: the one GEMM sums over all tokens in fp32 inside
    cuBLAS and writes dW in the weight dtype, rounded once, as eager's dW GEMM does (not for fp16 gradients, whose
    sums ``_run_chunks`` keeps in fp32 to fit them into fp16's range). An fp32 accumulator there
    would only add a V x H fp32 write, its read and a conversion (at GPT-2's 50304 x 768: 385 MB of traffic
    and a launch, in the calls that are bound by the host).

    ``rows``: the vocabulary's V where the gradient's rows run past it (pad_vocab; ``weight`` may have the zero
    rows too, or be V rows: ``padded_tail``), else None. A single chunk then writes dW's V rows straight, in two
    GEMMs: the aligned head (``layout.aligned_head_rows``) and the odd tail, each row summed as in one GEMM. At
    4096 x 768 x 50257 on an H200 the two took 7 us more than the padded GEMM and spared the 45 us copy of V rows
    out of it, and its 77 MB (``pad_vocab_gemms_NVIDIA_H200.md``).

    ``columns``: dW's columns (the weight's but frozen ones, ``GradRequest.dw_from``; default all).

    ``finish_rows``: V, when the last chunk's GEMM may finish dW (``dw_final``: dw_path "addmm" over several chunks
    in fp32, where the kernel runs): it adds its product to the fp32 sums and stores the V rows of dW rounded, in
    one kernel, instead of cuBLAS writing the sums and a copy rounding them (that copy reads V x H fp32 and writes
    dW; the op took 0.3-1.0% of the floor less without it at H = 4096 on an H100). None: the copy (dw_path
    "addmm_round").
    """

    def __init__(self, weight: torch.Tensor, accum_dtype: torch.dtype, dw_path: str,
                 single_chunk: bool = False, rows: int | None = None, columns: int | None = None,
                 finish_rows: int | None = None) -> None:
        self.dtype = weight.dtype
        self.separate = accum_dtype != weight.dtype and not single_chunk
        shape = (weight.shape[0], weight.shape[1] if columns is None else columns)
        # (head rows, V): the single chunk's two GEMMs, or None for one GEMM over every row of ``weight``
        self.split = None
        if single_chunk and rows is not None:
            self.split = (aligned_head_rows(rows, weight.element_size()), rows)
            shape = (rows, *shape[1:])
        # Not zeroed: the first chunk's GEMM overwrites it (beta = 0). Zeroing was a V x H memset per call
        # (154 MB in fp32 at GPT-2's 50304 x 768), GPU time and one more launch.
        self.acc = torch.empty(shape, dtype=accum_dtype if self.separate else weight.dtype, device=weight.device)
        self.written = False
        self.dw_path = dw_path
        self.finish_rows = finish_rows if self.separate else None
        self.final: torch.Tensor | None = None  # dW, when the last chunk's GEMM wrote it

    def add(self, grad_t: torch.Tensor, x: torch.Tensor, last: bool = False) -> None:
        first, self.written = not self.written, True
        if last and not first and self.finish_rows is not None:
            from . import dw_final  # (imports triton: only where a loop may use it)

            out = torch.empty((self.finish_rows, self.acc.shape[1]), dtype=self.dtype, device=self.acc.device)
            if dw_final.finish(grad_t, x, self.acc, out):
                self.final = out
                return
        if self.split is not None:  # one chunk, one call: the V rows of a padded weight, aligned head and odd tail
            head, rows = self.split
            torch.mm(grad_t[:head], x, out=self.acc[:head])
            torch.mm(grad_t[head:rows], x, out=self.acc[head:])
        elif not self.separate:
            if first:
                torch.mm(grad_t, x, out=self.acc)
            else:
                self.acc.addmm_(grad_t, x)
        else:
            add_product(self.acc, grad_t, x, self.dw_path, overwrite=first)

    def summed(self) -> torch.Tensor:
        """The sums over every padded row, in the accumulator's dtype (0 when no chunk ran: no tokens)."""
        if not self.written:
            self.acc.zero_()
        return self.acc

    def result(self, rows: int) -> torch.Tensor:
        """dW for the first ``rows`` rows (the rest are pad_vocab's zero rows), as a tensor of its own: a view
        into the padded accumulator would keep the padding alive and is not a valid custom-op output. (The chunks'
        GEMMs keep the padded rows: with only V rows, GPT-2's odd V = 50257 sent the dW GEMM to a slower cuBLAS
        kernel, GEMMs 1.42 against 1.20 ms per call on an H200, more than the 0.08 ms of copies it saved:
        ``kernel_breakdown_NVIDIA_H200_dw_rows.md``. A single chunk splits its GEMM instead: ``split``.)"""
        if self.final is not None:  # (V rows: ``finish_rows``)
            return self.final if rows == self.final.shape[0] else self.final[:rows].clone()
        acc = self.summed()
        if self.separate:
            return acc[:rows].to(self.dtype)
        return acc if rows == acc.shape[0] else acc[:rows].clone()


#: The cuBLAS flags that let split-K GEMMs reduce in bf16/fp16 (torch.backends.cuda.matmul attributes).
_REDUCTION_FLAGS = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")


def _read_reduction_flag(name: str) -> bool | tuple[bool, bool]:
    """The full state of one flag: ``(reduced_precision, split_k)`` where torch has the split-K half (the
    plain attribute then reads only the first), else the bool. Restoring this value restores the flag exactly."""
    matmul = torch.backends.cuda.matmul
    reduced = getattr(matmul, name)
    try:
        split_k = getattr(matmul, name + "_split_k")
    except AttributeError:  # torch without the split-K setting (2.11): a plain bool
        return reduced
    return (reduced, split_k)


def _forbid_reduced_precision(saved: bool | tuple[bool, bool]) -> bool | tuple[bool, bool]:
    """The flag value with reduced-precision reductions off and the user's split-K choice kept."""
    return (False, saved[1]) if isinstance(saved, tuple) else False


class _ReductionFlagsGuard:
    """Process-wide save/restore of the reduced-precision flags, shared by every thread that runs the loop.

    The flags are global state, so overlapping calls on several threads must not each save and restore them:
    the first to enter saves the user's values and turns reduced precision off, the last to leave restores
    them, and a lock guards the count. No thread then restores while another still runs its GEMMs, and the
    user's values, split-K half included, come back exactly.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: dict[str, bool | tuple[bool, bool]] = {}

    def enter(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._saved = {name: _read_reduction_flag(name) for name in _REDUCTION_FLAGS}
                for name, value in self._saved.items():
                    setattr(torch.backends.cuda.matmul, name, _forbid_reduced_precision(value))
            self._depth += 1

    def exit(self) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                for name, value in self._saved.items():
                    setattr(torch.backends.cuda.matmul, name, value)


_REDUCTION_FLAGS_GUARD = _ReductionFlagsGuard()


@contextlib.contextmanager
def full_precision_gemm_reductions(device: torch.device, chunked: bool = True) -> Iterator[None]:
    """Forbid cuBLAS from reducing split-K partial sums of bf16/fp16 GEMMs in bf16/fp16 while the loop runs.

    PyTorch allows those reductions by default. A chunk's GEMMs are smaller than eager's single GEMM and more
    often split, so with them our dX came out less exact than eager's (H200, bf16, 20 tokens in 7-token
    chunks: relative error 3.8e-3 vs 3.3e-3; identical to eager's with fp32 reductions). A call that fits in
    one chunk (``chunked=False``) runs eager's own GEMM shapes, so it keeps the user's flags, and with them
    eager's numerics and speed: fp32 reductions cost 11% at 4096 x 768 x 50257 (one chunk) on the H200.

    The flags are the only way to ask for this: fp32-output GEMMs would give the same numerics without global
    state, but the logits GEMM would then write an fp32 chunk (twice the largest buffer). So they are saved
    and restored exactly, under a lock shared by all threads (``_ReductionFlagsGuard``); while any thread runs
    a chunked loop, GEMMs elsewhere in the process also reduce in fp32. The flags are host-side state, so this
    costs no sync.
    """
    if device.type != "cuda" or not chunked:
        yield
        return
    _REDUCTION_FLAGS_GUARD.enter()
    try:
        yield
    finally:
        _REDUCTION_FLAGS_GUARD.exit()


def _reduction_scales(
    target: torch.Tensor, ce_weight: torch.Tensor | None, p: LossParams, vocab: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row factors of the CE and z-loss terms: 1/sum(w[y]) and 1/valid-count for "mean", else 1, in ``dtype``.

    Computed on the device: a mean over an all-ignored batch is 0/0 = nan, as in torch.
    """
    if p.reduction == "sum":
        # 1, or 0 when no token counts: the gradients are then exactly 0, as torch's, and ``output_factor`` keeps
        # them 0 whatever grad_output is (a Hugging Face loss divides this sum by num_items_in_batch, which is 0
        # for a batch of prompts only: grad_output inf, and 0 * inf = nan would reach the weights).
        any_valid = (target != p.ignore_index).any().to(dtype)
        return any_valid, any_valid
    if p.reduction != "mean":
        one = torch.ones((), dtype=dtype, device=target.device)
        return one, one
    valid = target != p.ignore_index
    # reciprocal is the IEEE division 1 / x, as exact as ``one / x`` without the ``one`` (each op is a launch,
    # and at small shapes the op is bound by launches).
    z_scale = torch.reciprocal(valid.sum(dtype=dtype))
    if ce_weight is None:
        return z_scale, z_scale  # the same tensor: _gradient_scales and _reduced_loss reuse its work
    return torch.reciprocal(_counted_weights(target, valid, ce_weight, vocab).sum()), z_scale


def _counted_weights(target: torch.Tensor, valid: torch.Tensor, ce_weight: torch.Tensor, vocab: int) -> torch.Tensor:
    """w[y] of each row, 0 for the rows not counted (``valid`` False)."""
    safe = torch.where(valid, target, 0).clamp_(0, vocab - 1)
    return torch.where(valid, ce_weight[safe], 0.0)


def _largest_row_factor(ce_scale: torch.Tensor, target: torch.Tensor, ce_weight: torch.Tensor, p: LossParams,
                        weight: torch.Tensor) -> torch.Tensor:
    """A bound on a row's CE factor with class weights (``_gradient_scales``' ``ce_bound``), in units that also
    bound the row's dX entries: |ce_scale| * max |w[y]| over the counted rows, their own classes rather than all
    classes, so that an absent heavy class does not shrink the others' fp16 gradients below eager's. Label
    smoothing eps adds eps/V * (p[c] * sum w - w[c]) to every row's gradient, so there the bound grows by
    eps/V * (|sum w| + max |w|), which an absent heavy class does reach. The CE step multiplies the gradient by
    logit_scale (inf at a class weighted 1e6 with logit_scale 20, a review found), so the bound takes
    |logit_scale|. dX sums the gradient (|.|_1 <= 2) against W's rows, up to 2 max |W| times it (inf dX with
    entries of W near 25): max(1, max |W| / 4) keeps a row's dX within 2^15 at the 2^12 the headroom allows.
    That factor shrinks every lighter row too (a second review: light-row dX 4x eager's error under a loss
    scale with max |W| = 14 when it was max |W|), so it counts only from max |W| = 4 on; an lm_head's entries
    are far below."""
    vocab = weight.shape[0]
    if target.shape[0] == 0:  # (amax of nothing raises; with no row every factor is 0 anyway)
        return torch.zeros_like(ce_scale)
    own = _counted_weights(target, target != p.ignore_index, ce_weight, vocab).abs().amax()
    if p.label_smoothing:
        eps = p.label_smoothing
        weights = ce_weight.to(ce_scale.dtype)
        own = (1.0 - eps) * own + (eps / vocab) * (weights.sum().abs() + weights.abs().amax())
    # in the weight's dtype (a max is exact there; dtype= would cast a V x H copy first)
    largest_entry = torch.linalg.vector_norm(weight, float("inf")).to(ce_scale.dtype)
    return ce_scale.abs() * own * abs(p.logit_scale) * torch.clamp(largest_entry * 0.25, min=1.0)


class GradientScales(NamedTuple):
    """The reduction's factors for the gradient: ``ce`` and ``z`` go into the logit gradient (and the loss
    rows), ``post`` (0-dim: 1, or a power of two split out of an fp16 "mean"; 0 for a "mean" or "sum" without a
    counted token) multiplies the loss and, in backward, dX/dW/db (``output_factor``)."""

    ce: torch.Tensor
    z: torch.Tensor
    post: torch.Tensor
    #: isfinite of the CE factor before the split, when it came for free (it is the z-loss factor: no class
    #: weights); else None and ``_reduced_loss`` computes it.
    ce_finite: torch.Tensor | None = None
    #: What the loss rows' sum is multiplied by: post, or nan where the loss is nan (``kernels.scales``); None:
    #: ``_reduced_loss`` forms it.
    loss_factor: torch.Tensor | None = None


def _power_of_two_split(base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(post, two_m) with base = two_m * post, post a power of two and two_m in [1, 2), both exact: for
    base = m * 2^e (m in [0.5, 1)), two_m = 2m and post = 2^(e-1), an IEEE division of a power-of-two ratio."""
    mantissa, _ = torch.frexp(base)
    two_m = mantissa * 2.0
    return base / two_m, two_m


def _split_sum(ce_scale: torch.Tensor, ce_bound: torch.Tensor) -> GradientScales:
    """An fp16 "sum"'s factors with class weights: a row's gradient is w[y] * (p - y), which passed fp16's range
    at a class weighted 1e5 (inf before backward's grad_output of, say, 1/count could bring it back, where
    eager's folded factor stays finite). A power of two post >= 1 with ce_bound / post below 2^12 is split off
    and applied after the GEMMs, as for the mean; ``ce_scale`` is 1, or 0 without a counted token."""
    base = torch.where(torch.isfinite(ce_bound), torch.clamp(ce_bound * 2.0**-11, min=1.0), 1.0)
    post, _ = _power_of_two_split(base)  # >= 1 as base is
    factor = ce_scale / post
    return GradientScales(ce=factor, z=factor, post=ce_scale * post)


def output_factor(grad_output: torch.Tensor, post: torch.Tensor) -> torch.Tensor:
    """What backward multiplies the forward's gradients by: grad_output * post in post's dtype, and 0 where post
    is 0 (no token counted, so every gradient is exactly 0, as in torch, where nothing multiplies them): a
    grad_output of inf or nan (a sum divided by a count of 0) would make them 0 * inf = nan."""
    if grad_output.layout != torch.strided:  # a sparse 0-dim grad_output (autograd lets one through): its value
        grad_output = grad_output.to_dense()
    return torch.where(post != 0, grad_output.to(post.dtype) * post, 0.0)


def keeps_power_of_two_apart(dtype: torch.dtype) -> bool:
    """Whether a "mean" over inputs of ``dtype`` splits its 1/count into the gradient's part and a power of two
    applied after the GEMMs (``_gradient_scales``): fp16 only. bf16, fp32 and fp64 share fp32's exponent range
    (or more), so the whole factor goes into the gradient; grad_scale is then 1 and, with the usual
    grad_output of 1, backward's scale of dX/dW/db is skipped on the GPU (a V x H read and write: 0.6 ms at
    16384 x 4096 x 128256 on an H200)."""
    return dtype == torch.float16


def _gradient_scales(ce_scale: torch.Tensor, z_scale: torch.Tensor, reduction: str = "mean",
                     split: bool = True, ce_bound: torch.Tensor | None = None) -> GradientScales:
    """The mean's 1/count for the logit gradient: whole (``split=False``) or, for fp16, split into a power of two
    applied after the GEMMs.

    Folded into an fp16 gradient, 1/count flushes every p/count below fp16's smallest subnormal to 0 before
    a loss scale (GradScaler's 65536) reaches it in backward: at 2048 x 8192 dX was 4x less exact than
    eager's. So with ``split`` the gradient keeps z_scale / 2^k in [1, 2) (and the CE term its own ratio to it,
    O(1)), and 2^k is applied to dX/dW/db in fp32 together with grad_output. A power of two scales exactly, so
    the results are bit for bit those of folding the whole factor in, which is what bf16/fp32 inputs do
    (``keeps_power_of_two_apart``; their exponent range has no such flush); applying all of 1/count afterwards
    would round dX/dW a second time. With no valid token (z_scale = inf) every gradient factor is 0: the
    gradients come out exactly 0, never 0 * inf.

    With class weights a row's CE factor is ce_scale * w[y], up to count times z_scale: one heavily weighted
    token among 70000 made its fp16 gradient count * w[y] / sum(w) times (p - y) and overflowed, where eager's
    stays within 1. ``ce_bound`` (``_largest_row_factor``, the largest row factor's bound) / 2^11 sets the power
    of two when it is the larger, so every row's factor stays within 2^12.

    For "sum" and "none" every factor is ``_reduction_scales``' one tensor (1, or for "sum" 0 without a counted
    token), no work; except an fp16 "sum" with a ``ce_bound`` past 2^11, whose factor is split the same way
    (``_split_sum``). Without a valid token ``post`` is 0 for "mean" too (``output_factor``).
    """
    if reduction != "mean":
        if reduction == "sum" and split and ce_bound is not None:
            return _split_sum(ce_scale, ce_bound)
        return GradientScales(ce=ce_scale, z=z_scale, post=z_scale)
    finite = torch.isfinite(z_scale)
    same = ce_scale is z_scale
    if not split:
        z = torch.where(finite, z_scale, 0.0)
        return GradientScales(
            ce=z if same else torch.where(finite, ce_scale, 0.0),
            z=z,
            post=finite.to(z_scale.dtype),  # 1, or 0 without a valid token; storage of its own (it is grad_scale)
            ce_finite=finite if same else None,
        )
    base = z_scale
    if ce_bound is not None:  # (a bound of inf or nan, from weights that sum to 0, leaves the split as it was)
        # Headroom of 2^11 below fp16's range: a bound that raised the power of two whenever a row's factor
        # passed 2 shrank every lighter row's gradient by max(w)/mean(w) and flushed it under a loss scale
        # (3.5x eager's dX error at one class weighted 1e3, found by a review).
        base = torch.where(torch.isfinite(ce_bound), torch.maximum(z_scale, ce_bound * 2.0**-11), z_scale)
    post, two_m = _power_of_two_split(base)
    z = torch.where(finite, two_m if base is z_scale else z_scale / post, 0.0)
    return GradientScales(
        ce=z if same else torch.where(finite, ce_scale / post, 0.0),
        z=z,
        post=torch.where(finite, post, 0.0),
        ce_finite=finite if same else None,
    )


def _run_chunks(
    ops: Operands,
    p: LossParams,
    config: FLCEConfig,
    accum_dtype: torch.dtype,
    grads: GradRequest,
    *,
    ce_scale: torch.Tensor,
    z_scale: torch.Tensor,
    loss_rows: torch.Tensor | None,
    kept_out: torch.Tensor | None,
    kept_in: torch.Tensor | None,
    logits_out: torch.Tensor | None = None,
    weight_sum: torch.Tensor | None = None,
    raw_sums: bool = False,
    track_top: bool = False,
) -> Grads:
    """The chunk loop. ``logits_out`` (N, V) contiguous, when given, receives the logits, which stay intact.
    ``kept_out`` receives, and ``kept_in`` gives, what a backward that recomputes the logits needs (``kept_rows``):
    the lse and the target's z, and with ``track_top`` each row's largest z and its class too (otherwise those rows
    are left as they are: a backward that recomputes each chunk in the same GEMM as here gets the same logits).

    With ``raw_sums`` dW and db come back as their fp32 sums over the padded vocabulary, for
    ``_fit_stored_sums`` to round.

    With aligned rows (V a multiple of 128 bytes) the logits GEMM writes straight into ``logits_out`` and the
    CE step writes each chunk's gradient into a chunk buffer of its own. Otherwise an unaligned leading
    dimension would send cuBLAS to its slow kernels, so the GEMM writes the padded chunk buffer as without
    ``logits_out``, the chunk is copied out, and the CE step overwrites the buffer with its gradient.

    With ``config.fp32_logits`` (bf16/fp16 inputs) the GEMM writes one fp32 chunk buffer instead, the CE step
    reads it and writes the gradient into the compute-dtype chunk buffer and each row's true-class rounding into
    a vector that goes back into dX, dW and db (``true_class``), and ``logits_out`` receives the logits rounded
    once, as eager's GEMM rounds them.
    """
    x, weight, target, bias, ce_weight = ops.x, ops.weight, ops.target, ops.bias, ops.ce_weight
    n, hidden = x.shape
    vocab = weight.shape[0]
    device = x.device
    ce_step = _ce_step(config)
    if weight_sum is None:
        weight_sum = _weight_sum(ce_weight, vocab, math_dtype(x.dtype), device)
    lse_rows, target_z_rows = (kept_out[0], kept_out[1]) if kept_out is not None else (None, None)
    lse_in, target_z_in = (kept_in[0], kept_in[1]) if kept_in is not None else (None, None)
    step_rows = _StepRows(target, ce_weight, weight_sum, ce_scale, z_scale, loss_rows, lse_rows, target_z_rows,
                          lse_in, target_z_in, top_rows=kept_out[2:] if kept_out is not None and track_top else None)
    chunk = max(1, min(config.chunk_tokens, n))
    # One chunk has nothing to overlap: its dW GEMM would wait for its dX GEMM on the side stream anyway, and the
    # stream switch, two events and a second chunk buffer would be pure cost.
    overlap = _stream_overlap(config, device, grads) if chunk < n else None
    row_stride = padded_row_elements(vocab, x.element_size())
    gemm_vocab = row_stride if config.pad_vocab else vocab  # the GEMMs' V; the CE step always sees V columns
    wide = fp32_logits_on(config.fp32_logits, x.dtype)
    # One chunk writes dW straight in the weight dtype; not with fp32 logits, whose true-class correction is
    # added into the fp32 sums afterwards (rounding it into bf16 dW would round twice), nor with ``raw_sums``
    # (fp16: the sums are fitted into fp16's range first, whatever accum_dtype; ``_fit_stored_sums``).
    dw_straight = chunk >= n and not wide and not raw_sums
    # An odd V's GEMMs over padded rows: the weight's aligned head as it is and a padded copy of its few tail rows
    # (``padded_tail``), or, where that does not apply, a zero-padded copy of the whole weight.
    tail = None
    if gemm_vocab != vocab and splits_padding(x, bias, dw_straight, vocab, gemm_vocab):
        tail = padded_tail(weight, gemm_vocab)
    elif gemm_vocab != vocab:
        weight = zero_padded_rows(weight, gemm_vocab)
        bias = zero_padded_rows(bias, gemm_vocab) if bias is not None else None
    # Logits written straight into the caller's tensor (see the docstring); the chunk buffers then hold only
    # the gradient, and are needed only when there is one.
    direct = logits_out is not None and row_stride == vocab and not wide
    # On the CPU the buffers' rows are exactly the GEMMs' width: torch's single-threaded CPU bf16 GEMM (seen in
    # 2.13) writes and reads one column past an odd width when the row stride is larger, so the padding got
    # garbage and rows of dX came out NaN now and then. Aligned rows only pay off on the GPU.
    buffer_stride = row_stride if device.type != "cpu" else gemm_vocab
    buffers = [
        torch.empty(chunk, buffer_stride, dtype=x.dtype, device=device)[:, :gemm_vocab]
        for _ in range((2 if overlap else 1) if grads.any or not (direct or wide) else 0)
    ]
    # The fp32 logits: one buffer even with stream overlap, since only the main stream reads it (the side
    # stream's GEMMs read the gradient buffers). The gradient buffers' padding columns are then written by no
    # GEMM: zeroed once, so the padded dW/db rows stay exact zeros.
    wide_buffer = (torch.empty(chunk, buffer_stride, dtype=torch.float32, device=device)[:, :gemm_vocab] if wide
                   else None)
    bias32 = bias.float() if wide and bias is not None else None
    if wide and gemm_vocab != vocab:
        for buffer in buffers:
            buffer[:, vocab:].zero_()
    # With fp32 logits, each row's true-class rounding is added back (``true_class``): one vector per gradient
    # buffer, since the side stream's dW work reads it as it reads that buffer.
    residuals = [torch.empty(chunk, dtype=torch.float32, device=device) for _ in buffers] if wide and grads.any else []
    # Contiguous whatever x's strides, as the fake implementation promises.
    dx = torch.empty(x.shape, dtype=x.dtype, device=device) if grads.dx else None
    # The last chunk's GEMM may finish dW (``_DwAccumulator``): not when the sums take more after it (fp32 logits'
    # true-class correction, ``raw_sums``' fitting) or run on the side stream (its output would belong there); on
    # the CPU only for a Triton strategy under the interpreter (the tests).
    finish = (config.dw_path == "addmm" and not wide and not raw_sums and overlap is None
              and (device.type == "cuda" or registry.get(config.strategy).triton_only))
    dw_acc = _DwAccumulator(weight, torch.float32 if raw_sums else accum_dtype, config.dw_path,
                            single_chunk=dw_straight, rows=vocab if gemm_vocab != vocab else None,
                            columns=hidden - grads.dw_from, finish_rows=vocab if finish else None) if grads.dw else None
    # dW's GEMMs read the columns of x that are not frozen (a strided view: cuBLAS takes its row stride)
    x_dw = x[:, grads.dw_from:] if grads.dw_from else x
    db_acc = (
        torch.zeros(gemm_vocab, dtype=math_dtype(x.dtype), device=device) if grads.db and bias is not None else None
    )
    weight_t = weight.t()

    # One chunk runs eager's own GEMM shapes; only a split call needs fp32 reductions (see the docstring).
    with full_precision_gemm_reductions(device, chunked=chunk < n):
        try:
            for index, start in enumerate(range(0, n, chunk)):
                stop = min(start + chunk, n)
                slot = index % max(1, len(buffers))
                grad = _take(buffers[slot], 0, stop - start) if buffers else None  # padding columns stay 0
                logits = _take(logits_out, start, stop) if direct else grad
                x_c = _take(x, start, stop)
                x_dw_c = _take(x_dw, start, stop) if x_dw is not x else x_c
                if overlap is not None:
                    overlap.wait_for_buffer(slot)
                if wide_buffer is not None:
                    logits = wide_buffer[: stop - start]
                    fp32_logits_into(logits, x_c, weight, bias32)
                elif tail is not None:
                    tail.logits_into(logits, x_c)
                elif bias is not None:
                    torch.addmm(bias, x_c, weight_t, out=logits)
                else:
                    torch.mm(x_c, weight_t, out=logits)
                rows = slice(start, stop)
                if logits_out is not None and not direct:
                    logits_out[rows].copy_(_columns(logits, vocab))
                separate_grad = (direct or wide) and grads.any
                residual = residuals[slot][: stop - start] if residuals else None
                ce_step(
                    step_rows.chunk(_columns(logits, vocab), rows, write_grad=grads.any,
                                    grad_out=_columns(grad, vocab) if separate_grad else None,
                                    residual_out=residual, padded=not direct,
                                    scratch=not direct or wide_buffer is not None),
                    p,
                )
                if not grads.any:
                    continue
                if dx is not None and residual is not None:
                    addend = true_class.dx_addend(weight, true_class.target_rows(target[rows], 0, vocab), residual)
                    torch.addmm(addend, grad, weight, out=_take(dx, start, stop))
                elif dx is not None and tail is not None:
                    tail.dx_into(_take(dx, start, stop), grad)
                elif dx is not None:
                    torch.mm(grad, weight, out=_take(dx, start, stop))
                with overlap.on_side(slot) if overlap is not None else contextlib.nullcontext():
                    _accumulate_weight_grads(dw_acc, db_acc, grad, x_dw_c, last=stop >= n)
                    if residual is not None:
                        true_class.add_to_weight_grads(dw_acc.acc if dw_acc is not None else None, db_acc,
                                                       true_class.target_rows(target[rows], 0, vocab), residual,
                                                       x_dw_c)
        finally:
            if overlap is not None:
                overlap.join()  # also on an error: the buffers are freed when this frame unwinds
    if raw_sums:
        return dx, dw_acc.summed() if dw_acc is not None else None, db_acc
    dw = dw_acc.result(vocab) if dw_acc is not None else None
    db = db_acc[:vocab].to(bias.dtype, copy=True) if db_acc is not None else None
    return dx, dw, db


#: fp16's largest finite value is 65504 (~2^16): the sums are stored at most 2^14, leaving backward's rounding
#: and a grad_output of up to 4 room.
_STORED_SUM_LIMIT = 2.0**14


def _divided_into(sums: torch.Tensor, divisor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sums / divisor`` rounded to ``dtype``, as a tensor of its own; ``sums`` is divided in place. (In one
    pass, ``torch.div(sums, divisor, out=<fp16>)``, the CPU allocated an fp32 temporary of the sums' size:
    3.7 MB above the memory bound at 4096 x 256, a test found.)"""
    return sums.div_(divisor).to(dtype)


def _fit_stored_sums(dx: torch.Tensor | None, dw_sum: torch.Tensor | None, db_sum: torch.Tensor | None,
                     post: torch.Tensor, vocab: int, dtypes: tuple[torch.dtype, torch.dtype | None],
                     ) -> tuple[Grads, torch.Tensor]:
    """((dx, dw, db), grad_scale) for an fp16 "mean" or "sum" whose gradients are stored divided by ``post``.

    dX rows are each within a few times the largest weight row, but dW and db sum over every token: divided by
    post (about 1/count) they are about count times the true gradient and passed fp16's 65504 (dW inf at 20000
    tokens with |dW| = 3.9, where eager's is finite); a "sum" meets the same before a grad_output of 1/count.
    So when the fp32 sums' largest magnitude is above 2^14, all three are divided by the power of two that
    brings it there, and grad_scale grows by as much: exact (powers of two) except for dX values pushed below
    fp16's normal range. Costs one read of the fp32 sums and one pass over dX, fp16 only. ``dtypes``: those of
    dW and db (the weight's and the bias')."""
    # The inf norm is max |.| in one read, with no |.| temporary (abs().amax() writes one: 1.5 ms at 128256 x
    # 4096 fp32 on an H200); it propagates nan.
    sums = [torch.linalg.vector_norm(t, float("inf")) for t in (dw_sum, db_sum) if t is not None and t.numel()]
    if not sums:  # (a hidden size of 0: nothing to fit, but the sums are still rounded below)
        sums = [torch.zeros((), dtype=post.dtype, device=post.device)]
    largest = sums[0] if len(sums) == 1 else torch.maximum(*sums)
    # 2^(floor(log2(largest / limit)) + 1), at least 1; inf or nan sums are left as they are (a nan loss's
    # gradients)
    _, exponent = torch.frexp(largest / _STORED_SUM_LIMIT)
    shrink = torch.where(torch.isfinite(largest) & (largest > _STORED_SUM_LIMIT),
                         torch.ldexp(torch.ones_like(largest), exponent), 1.0)
    if dx is not None:
        # By 1/shrink (2^-1 .. 2^-24 is exact in fp16; shrink itself as fp16, which CUDA's kernels convert a
        # 0-dim factor to, is inf past 2^15): exact wherever the result stays normal.
        dx.mul_(torch.reciprocal(shrink).to(dx.dtype))
    # Rounded into tensors of their own (a view of the padded sums would keep them alive).
    dw = _divided_into(dw_sum[:vocab], shrink, dtypes[0]) if dw_sum is not None else None
    db = _divided_into(db_sum[:vocab], shrink, dtypes[1]) if db_sum is not None else None
    return (dx, dw, db), post * shrink


def _weight_sum(ce_weight: torch.Tensor | None, vocab: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The CE step's ``weight_sum``: the sum of the class weights, or V without them (0-dim, ``dtype``)."""
    return ce_weight.sum() if ce_weight is not None else torch.full((), float(vocab), dtype=dtype, device=device)


def _rows_of(t: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """A per-row tensor's ``rows``; a 0-dim factor (one for all rows) or None as it is."""
    return _take(t, rows.start, rows.stop) if t is not None and t.dim() else t


def _take(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``t[start:stop]``, or ``t`` itself when that is all of it: a one-chunk call then slices nothing (each
    slice is an op call, ~2 us of host time, and a one-chunk call is the host-bound case)."""
    return t if start == 0 and stop >= t.shape[0] else t[start:stop]


def _columns(t: torch.Tensor, columns: int) -> torch.Tensor:
    """``t[:, :columns]``, or ``t`` itself when it has no more columns."""
    return t if t.shape[1] == columns else t[:, :columns]


@dataclass(frozen=True)
class _StepRows:
    """What the CE step reads and writes per row, over all N rows of a call (see ``CEStepArgs``): ``chunk``
    cuts one chunk's step arguments out of it. Shared by the chunk loop and the loss over kept logits."""

    target: torch.Tensor
    ce_weight: torch.Tensor | None
    weight_sum: torch.Tensor
    ce_scale: torch.Tensor
    z_scale: torch.Tensor
    loss_rows: torch.Tensor | None = None
    lse_rows: torch.Tensor | None = None
    target_z_rows: torch.Tensor | None = None
    lse_in: torch.Tensor | None = None
    target_z_in: torch.Tensor | None = None
    top_rows: torch.Tensor | None = None

    def chunk(self, logits: torch.Tensor, rows: slice, *, write_grad: bool,
              grad_out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
              padded: bool = False, scratch: bool = False) -> CEStepArgs:
        return CEStepArgs(
            logits=logits,
            target=_take(self.target, rows.start, rows.stop),
            ce_weight=self.ce_weight,
            weight_sum=self.weight_sum,
            ce_scale=_rows_of(self.ce_scale, rows),
            z_scale=_rows_of(self.z_scale, rows),
            loss_out=_rows_of(self.loss_rows, rows),
            lse_out=_rows_of(self.lse_rows, rows),
            lse_in=_rows_of(self.lse_in, rows),
            target_z_out=_rows_of(self.target_z_rows, rows),
            target_z_in=_rows_of(self.target_z_in, rows),
            top_out=self.top_rows[:, rows] if self.top_rows is not None else None,
            write_grad=write_grad,
            grad_out=grad_out,
            residual_out=residual_out,
            padded=padded,
            scratch=scratch,
        )


def _accumulate_weight_grads(
    dw_acc: _DwAccumulator | None, db_acc: torch.Tensor | None, grad: torch.Tensor, x_c: torch.Tensor,
    last: bool = False,
) -> None:
    if dw_acc is not None:
        dw_acc.add(grad.t(), x_c, last)
    if db_acc is not None:
        db_acc.add_(grad.sum(dim=0, dtype=db_acc.dtype))


#: The dtype of the lse a forward keeps for backward: fp64, the fp32 max plus log(sum) without rounding them
#: together (the loss and gradient math stays fp32).
LSE_DTYPE = torch.float64


#: Rows of ``kept_rows``.
KEPT_ROWS = 4


def kept_rows(n: int, device: torch.device) -> torch.Tensor:
    """What a forward keeps per token for a backward that recomputes the logits, (KEPT_ROWS, N) in ``LSE_DTYPE``:
    row 0 the lse, row 1 the target's z as the forward's logits had it, rows 2-3 the row's largest z and its
    class (``CEStepArgs.top_out``); backward forms those two classes' probabilities from them
    (``CEStepArgs.target_z_in``, ``top_in``: recomputed logits can round apart from the forward's, and a class
    near p = 1 takes that whole)."""
    return torch.empty(KEPT_ROWS, n, dtype=LSE_DTYPE, device=device)


class ForwardResult(NamedTuple):
    """What ``fused_forward`` returns: loss is 0-dim for mean/sum and (N,) for "none"; lse, from ``kept_rows``
    (the lse, the target's z and, when asked, the largest z and its class), only for "none" or when asked (a
    backward that recomputes the logits needs it); gradients only for mean/sum, divided by ``grad_scale`` and
    unscaled by grad_output (the true gradient is ``grad_scale * grad_output * dx``, see ``_gradient_scales``);
    logits (N, V) only when asked to keep them, contiguous. The loss and grad_scale are in ``math_dtype``, the lse
    in ``LSE_DTYPE``."""

    loss: torch.Tensor
    lse: torch.Tensor | None
    dx: torch.Tensor | None
    dw: torch.Tensor | None
    db: torch.Tensor | None
    logits: torch.Tensor | None
    grad_scale: torch.Tensor


def _use_scales_kernel(device: torch.device) -> bool:
    """Whether a "mean" or "sum" without class weights takes its factors from ``kernels.scales`` (one launch)
    rather than from torch ops (ten for a mean, three for a sum): on CUDA, where launches are what a small call
    waits for. The values are the same."""
    return device.type == "cuda"


def fused_forward(
    ops: Operands, p: LossParams, config: FLCEConfig, accum_dtype: torch.dtype, grads: GradRequest,
    *, keep_logits: bool = False, keep_lse: bool = False,
) -> ForwardResult:
    """Loss of ``ops`` and, when asked, its gradients (and the logits, and each token's lse), in one chunked
    pass. ``keep_lse``: keep ``kept_rows`` whole, the largest z and its class included, for a backward that
    recomputes the logits in other GEMMs (``recompute``); "none" keeps them without the largest z."""
    n = ops.x.shape[0]
    vocab = ops.weight.shape[0]
    dtype = math_dtype(ops.x.dtype)
    per_token = p.reduction == "none"
    weight_sum = None
    split = keeps_power_of_two_apart(ops.x.dtype)
    if (p.reduction != "none" and ops.ce_weight is None and dtype == torch.float32
            and _use_scales_kernel(ops.x.device)):
        from ..kernels.scales import loss_scales

        z, post, loss_factor, weight_sum = loss_scales(ops.target, p.ignore_index, vocab, split=split,
                                                       reduction=p.reduction)
        ce_scale, scales = None, GradientScales(ce=z, z=z, post=post, loss_factor=loss_factor)
    else:
        ce_scale, z_scale = _reduction_scales(ops.target, ops.ce_weight, p, vocab, dtype)
        ce_bound = (_largest_row_factor(ce_scale, ops.target, ops.ce_weight, p, ops.weight)
                    if split and ops.ce_weight is not None and not per_token else None)
        scales = _gradient_scales(ce_scale, z_scale, p.reduction, split, ce_bound)
    loss_rows = torch.empty(n, dtype=dtype, device=ops.x.device)
    # fp64: backward forms p = exp(z - lse) from it, and an fp32 lse rounded at the logits' magnitude (2e-6 at
    # 20) took a confident row's 1 - p with it (``LSE_DTYPE``)
    kept = kept_rows(n, ops.x.device) if per_token or keep_lse else None
    if kept is not None and not keep_lse:
        # Largest z not tracked (its backward recomputes each chunk in this loop's GEMM): class -1, none
        kept[3].fill_(-1)
    logits = torch.empty(n, vocab, dtype=ops.x.dtype, device=ops.x.device) if keep_logits else None
    # fp16: dW and db sum over all tokens, divided by post for a "mean" and before grad_output (often 1/count
    # after a "sum") in both, which can pass fp16's range (``_fit_stored_sums``)
    fit_sums = split and not per_token and (grads.dw or (grads.db and ops.bias is not None))
    dx, dw, db = _run_chunks(
        ops, p, config, accum_dtype, GradRequest() if per_token else grads,
        ce_scale=scales.ce, z_scale=scales.z, loss_rows=loss_rows, kept_out=kept, kept_in=None, logits_out=logits,
        weight_sum=weight_sum, raw_sums=fit_sums, track_top=keep_lse,
    )
    if per_token:
        return ForwardResult(loss_rows, kept, None, None, None, logits, scales.post)
    loss = _reduced_loss(loss_rows, ce_scale, scales, p)
    grad_scale = scales.post
    if fit_sums:
        (dx, dw, db), grad_scale = _fit_stored_sums(dx, dw, db, scales.post, vocab, (
            ops.weight.dtype, ops.bias.dtype if ops.bias is not None else None))
    return ForwardResult(loss, kept, dx, dw, db, logits, grad_scale)


def _reduced_loss(loss_rows: torch.Tensor, ce_scale: torch.Tensor, scales: GradientScales,
                  p: LossParams) -> torch.Tensor:
    """The mean/sum loss from rows formed with ``scales.ce``/``scales.z``: their sum times ``scales.post``
    (exact: a power of two). An all-ignored batch has a zero denominator: torch's mean is then 0/0 = nan, and
    so is ours."""
    if scales.loss_factor is not None:
        return loss_rows.sum() * scales.loss_factor
    loss = loss_rows.sum() * scales.post
    if p.reduction == "mean":
        finite = scales.ce_finite if scales.ce_finite is not None else torch.isfinite(ce_scale)
        loss = torch.where(finite, loss, float("nan"))
    return loss


def fused_backward_per_token(
    ops: Operands,
    kept: torch.Tensor,
    grad_rows: torch.Tensor,
    p: LossParams,
    config: FLCEConfig,
    accum_dtype: torch.dtype,
    grads: GradRequest,
) -> Grads:
    """Gradients of sum_i grad_rows[i] * loss_i for reduction="none": recomputes each chunk's logits (a fourth
    GEMM) because dW = sum_i g_i G_i^T x_i needs the per-token factors before the dW GEMM. ``kept``: the
    forward's ``kept_rows``.

    The per-token factors stay in the logit gradient, as eager's: a loss scale arrives with them, before the
    rounding to fp16 (at 2048 x 8192 fp16 with scale 65536, dX and dW are as exact as eager's)."""
    scale = grad_rows.to(math_dtype(ops.x.dtype)).contiguous()
    return _run_chunks(
        ops, p, config, accum_dtype, grads,
        ce_scale=scale, z_scale=scale, loss_rows=None, kept_out=None, kept_in=kept,
    )
