"""The precision policies of the fused op: what each one asks of the accumulators and of the execution config.

A policy is the user's choice (``precision=`` on the op, ``flce.precision`` in the backend), never the tuner's:
the tuner samples no field a policy sets, so it cannot trade accuracy for speed behind the user's back.

- "exact" (the default): fp32 dW accumulator (and fp32 dX sum in the "recompute" strategy). Errors against
  fp64 are no larger than eager bf16/fp16 PyTorch's, which rounds the logits and the logit gradient to the
  compute dtype, as the op does.
- "compact": accumulators in the weight dtype. Saves the V x H fp32 accumulator; dW's error grows with the
  number of chunks.
- "precise": "exact" plus ``FLCEConfig.fp32_logits``: the logits stay fp32 from the GEMM's accumulator into the
  CE step, the logit gradient G is rounded once to the compute dtype for the dX and dW GEMMs, and what that
  rounding took from each row's true-class entry is added back beside them (``strategies.true_class``).

Why this and not a split of G. Eager's logit-gradient error has three sources: the logits rounded to bf16 before
the softmax (at logits of std 3 a top logit near 8 moves by up to 2^-6, its probability by up to 1.6%), G's
rounding to bf16 (2^-9 relative, noise), and, within the latter, the true-class entry g_y = a (p_y - 1), which
for a "mean" over a token count that is not a power of two rounds the same way in every row (a coherent error).
Measured on the CPU (``benchmarks/results/precision_errors_cpu.md``, bf16, std-3 logits, dX / dW error as a
multiple of eager's; the variants with a hi + lo split are emulated with explicit GEMMs):

- G kept fp32-grade as a bf16 pair hi + lo (G = hi + lo, lo = bf16(G - hi); two more GEMMs) on bf16 logits:
  0.96x-0.99x. The logits' rounding dominates, and the split cannot undo it.
- fp32 logits alone: 0.44x-0.50x with every target valid, 0.47x-0.55x with 6% ignored; at 256 x 128 x 4096
  with every 17th target ignored (``tests/test_op_numerics.py``'s peaky case) 0.81x, the coherent g_y rounding.
- fp32 logits + the true-class residual ("precise"): 0.43x-0.50x, and 0.23x in that test case.
- fp32 logits + hi + lo (five GEMMs): 0.01x below "precise". An fp32 or tf32 GEMM on an fp32 G would buy
  the same at 2x (tf32) or more the time of the bf16 dX and dW GEMMs.

What remains is dX's and dW's own rounding to bf16. So "precise" runs the three GEMMs of the floor: the logits
GEMM writes fp32 (its output traffic doubles), the CE step reads 4-byte logits and writes a 2-byte gradient into
a second chunk buffer (6 bytes per logit of a chunk instead of 2), and the correction is O(tokens x H) work.
For fp32/fp64 inputs it runs as "exact" (their logits and gradient already are fp32/fp64).
"""

from __future__ import annotations

from typing import Any

import torch

PRECISIONS = ("exact", "compact", "precise")

#: The config fields each policy forces (over the caller's config, the tuning DB and the heuristic).
_FORCED: dict[str, dict[str, Any]] = {"exact": {}, "compact": {}, "precise": {"fp32_logits": True}}


def check_precision(precision: object, name: str = "precision") -> str:
    """``precision`` if it names a policy, else an error that names the argument (``name``) and the policies."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"{name}={precision!r} is unknown; use one of {PRECISIONS} ('exact': errors no larger "
                         "than eager's, 'compact': accumulators in the weight dtype, 'precise': logit-gradient "
                         "errors below eager's)")
    return precision


def accum_dtype_for(precision: str, accum_dtype: torch.dtype | None, compute_dtype: torch.dtype) -> torch.dtype:
    """The accumulators' dtype: from ``precision`` unless ``accum_dtype`` is given (then the two must agree),
    checked against the compute dtype (the weight's, or autocast's). fp64 weights accumulate in fp64: an fp32
    accumulator would only lose precision."""
    check_precision(precision)
    if accum_dtype is not None and (not isinstance(accum_dtype, torch.dtype) or not accum_dtype.is_floating_point):
        raise TypeError(f"accum_dtype must be a floating torch.dtype (torch.float32, or the weight dtype) or None, "
                        f"got {type(accum_dtype).__name__} {accum_dtype!r}")
    implied = compute_dtype if precision == "compact" else torch.float32
    if accum_dtype is None:
        accum_dtype = implied
    elif precision == "compact" and accum_dtype != compute_dtype:
        raise ValueError(f"precision='compact' accumulates in the weight dtype ({compute_dtype}); it contradicts "
                         f"accum_dtype={accum_dtype}: pass one of the two")
    elif precision == "precise" and accum_dtype != torch.float32 and compute_dtype != torch.float64:
        raise ValueError(f"precision='precise' accumulates in fp32; it contradicts accum_dtype={accum_dtype}: "
                         "drop accum_dtype, or use precision='compact' for accumulators in the weight dtype")
    if accum_dtype not in (torch.float32, compute_dtype):
        raise TypeError(
            f"accum_dtype={accum_dtype} is unsupported with {compute_dtype} weights: use torch.float32 (default) "
            f"or the weight dtype ({compute_dtype}); "
            + ("fp64 accumulators go with fp64 weights (pass those to accumulate in fp64)"
               if accum_dtype == torch.float64 else "an accumulator less precise than the weight only loses accuracy")
        )
    return compute_dtype if compute_dtype == torch.float64 else accum_dtype


def forced_by(precision: str, forced: dict[str, Any] | None, wide_bias: bool = False) -> dict[str, Any] | None:
    """The caller's forced config fields (``config_overrides``) with those of ``precision`` laid over them: the
    policy wins over a config field (an ``FLCEConfig`` forces every field, fp32_logits=False included, so a
    config passed beside precision="precise" could not otherwise say it did not mean to turn it off).
    ``wide_bias``: an fp32 bias beside 16-bit weights, which promotes the logits: fp32_logits is forced too,
    whatever the policy."""
    fields = {**_FORCED[check_precision(precision)], **({"fp32_logits": True} if wide_bias else {})}
    if not fields:
        return forced
    return {**(forced or {}), **fields}


def fp32_logits_on(fp32_logits: bool, dtype: torch.dtype) -> bool:
    """Whether a call with ``FLCEConfig.fp32_logits`` and inputs of ``dtype`` computes fp32 logits beside its
    compute-dtype gradient: only for bf16/fp16, whose own logits would be rounded (fp32 and fp64 logits already
    are the GEMM's accumulator, so "precise" runs as "exact" there)."""
    return fp32_logits and dtype in (torch.bfloat16, torch.float16)
