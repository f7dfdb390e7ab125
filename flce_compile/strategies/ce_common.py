"""The contract between the chunk loop and a cross-entropy step implementation."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CEStepArgs:
    """One chunk's CE step.

    logits: (rows, V) raw logits x W^T + b in the compute dtype, or fp32 from bf16/fp16 operands
        (``FLCEConfig.fp32_logits``; ``grad_out`` then holds the gradient), unit column stride and any row stride
        (rows are padded for aligned GEMMs); overwritten with dloss/dlogits when ``write_grad`` and no
        ``grad_out``.
    target: (rows,) int64 class ids.
    ce_weight: (V,) class weights or None; weight_sum: 0-dim sum of the class weights (V if None). These and
        every float below are fp32 (fp64 for fp64 logits).
    ce_scale, z_scale: 0-dim or (rows,): the factor applied to the cross-entropy and z-loss terms of each row
        (for "mean", 1/sum of target weights and 1/valid tokens divided by the power of two that is applied
        after the GEMMs, see ``chunked._gradient_scales``; 1 for "sum" (0 when no token counts); grad_output for
        the per-token backward).
    loss_out, lse_out: (rows,) outputs or None; lse_in: a known lse (rows,) that skips the first pass. The lse
        a forward keeps for backward is fp64 (``chunked.LSE_DTYPE``: max + log(sum) unrounded, which an fp32 lse
        rounds at the logits' magnitude); an lse in the math dtype works too, with that rounding in a confident
        row's 1 - p.
    target_z_out, target_z_in: (rows,) fp64 or None. Out: each row's target z (after logit_scale and softcap),
        with ``lse_out``, for a backward that recomputes the logits. In: with ``lse_in``, the target's
        probability is formed from that z, not from the logits at hand: recomputed in another GEMM (a vocabulary
        block, another rank's shard layout), a logit can round 1-2 ulps apart from the forward's, and at a
        confident row's target that is more than its 1 - p (dX 6-11x eager's error, found 2026-12-04).
    top_out, top_in: (2, rows) fp64 or None, the same for the row's largest z, which may be another class than
        the target: a confident wrong class's p near 1 moved by the ulps (fp32 on an H100, backward blocks of 1000:
        dX 32x eager's error at margins of 24, found 2026-12-06). Out: row 0 the largest z of the columns (after
        logit_scale and softcap), row 1 its class (``class_offset`` + its column, as a float; -1 for a row with
        no finite z), written by the pass that finds the lse (needs ``lse_out`` or ``stats_out``; a slice's own
        largest). In: with ``lse_in`` and ``write_grad``, that class's column, where it lies among the columns,
        takes that z.
    grad_out: (rows, V) in the compute dtype, unit column stride, that receives dloss/dlogits instead of the
        logits (the keep path: the logits are returned to the caller and must stay intact; fp32 logits); None =
        in place.
    class_offset, num_classes: see below (a slice of the classes, e.g. one block of the vocabulary).
    stats_out: (3, rows), fp64 (``chunked.LSE_DTYPE``) or the math dtype, or None: a slice's partial statistics,
        for a caller that combines the slices itself (the vocabulary-parallel op, one slice per rank): row 0 the
        slice's own lse_r of z (max + log(sum), unrounded in fp64: a confident row's 1 - p survives it), row 1
        z at the target when the target lies in the slice (else 0), row 2 the smoothing sum over the slice
        relative to its lse, sum_c w_c (z_c - lse_r) (w_c = 1 without class weights; 0 without label smoothing;
        a row of -inf keeps sum_c w_c z_c). Needs no ``lse_in``.
    padded: the caller owns each row's columns up to V rounded up to 16 in ``logits`` and ``grad_out`` (the padding
        of its own buffers): the kernel may read them, ignores what they hold, and writes them a gradient of 0.
    residual_out: (rows,) fp32 or None: with ``write_grad``, receives what rounding the gradient to its dtype
        took from each row's true-class entry, g_y - round(g_y) (0 where the target is not among the columns),
        which the loop adds back beside the GEMMs (``strategies.true_class``; the "precise" policy).
    scratch: the caller owns ``logits`` and reads nothing of them after the step, so a step that does not write
        the gradient may still work in them (the torch step then needs no chunk-sized copy of fp32 logits: under
        no_grad it held two chunks, one with gradients).
    """

    logits: torch.Tensor
    target: torch.Tensor
    ce_weight: torch.Tensor | None
    weight_sum: torch.Tensor
    ce_scale: torch.Tensor
    z_scale: torch.Tensor
    loss_out: torch.Tensor | None
    lse_out: torch.Tensor | None
    lse_in: torch.Tensor | None
    write_grad: bool
    grad_out: torch.Tensor | None = None
    target_z_out: torch.Tensor | None = None
    target_z_in: torch.Tensor | None = None
    top_out: torch.Tensor | None = None
    top_in: torch.Tensor | None = None
    #: The logits' columns are classes [class_offset, class_offset + columns) of num_classes (None: all of
    #: them). A slice needs ``lse_in`` for its gradient; its loss cannot be computed (``loss_out`` None).
    class_offset: int = 0
    num_classes: int | None = None
    stats_out: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None
    padded: bool = False
    scratch: bool = False

    def classes(self) -> int:
        """How many classes the loss is over (the columns, unless the logits hold a slice)."""
        return self.num_classes if self.num_classes is not None else self.logits.shape[1]

    def check_slice(self) -> None:
        """A slice of the classes has no loss of its own: the call must bring the lse (or ask for the slice's
        statistics only) and ask for no loss."""
        if self.classes() != self.logits.shape[1] or self.class_offset:
            if ((self.lse_in is None and self.stats_out is None) or self.loss_out is not None
                    or self.target_z_out is not None):
                raise ValueError("a CE step over a slice of the classes needs lse_in (or stats_out) and computes "
                                 "no loss_out or target_z_out")
            if self.stats_out is not None and (self.lse_in is not None or self.write_grad):
                raise ValueError("a CE step writing a slice's stats_out takes no lse_in and writes no gradient")
        if self.top_out is not None and ((self.lse_out is None and self.stats_out is None) or self.lse_in is not None):
            raise ValueError("a CE step writing top_out finds the lse: it needs lse_out (or stats_out) and no lse_in")
