"""The precision policies of the fused op: what each one asks of the accumulators and of the execution config.

A policy is the user's choice (``precision=`` on the op, ``flce.precision`` in the backend), never the tuner's:
the tuner samples no field a policy sets, so it cannot trade accuracy for speed behind the user's back.

- "exact" (the default): fp32 dW accumulator (and fp32 dX sum in the "recompute" strategy). Errors against
  fp64 are no larger than eager bf16/fp16 PyTorch's, which rounds the logits and the logit gradient to the
  compute dtype, as the op does.
- "compact": accumulators in the weight dtype. Saves the V x H fp32 accumulator; dW's error grows with the
  number of chunks.
- "precise": "exact" plus ``FLCEConfig.fp32_logits``: the logits stay fp32 from the GEMM's accumulator into the
  CE step, and the logit gradient G is rounded once, to the compute dtype, for the dX and dW GEMMs.

Why "precise" keeps the logits, not the gradient, in fp32. Eager's logit-gradient error has two sources: the
logits rounded to bf16 before the softmax (at logits of std 3 a top logit near 8 moves by up to 2^-6, so its
probability by up to 1.6%), and G rounded to bf16 (2^-9 relative). Measured on the CPU (512 x 256 x 8192 and
1024 x 512 x 4096, bf16, logits of std 3; dX error against fp64 as a multiple of eager's): fp32 logits with G
in bf16, 0.50x and 0.45x; G kept fp32-grade as a bf16 pair hi + lo (G = hi + lo, lo = bf16(G - hi), two more
GEMMs) on bf16 logits, 0.98x and 0.99x; both together, 0.49x and 0.43x. What remains is dX's own rounding to
bf16. So the split's two extra GEMMs buy 1-2% of eager's error and the fp32 logits the rest; an fp32 or tf32
GEMM on an fp32 G would cost 2x (tf32) or more the time of the bf16 GEMMs for that same 1-2%. "precise" runs
the three GEMMs of the floor: the logits GEMM writes fp32 (its output traffic doubles), and the CE step reads
4-byte logits and writes a 2-byte gradient into a second chunk buffer (memory: 6 bytes per logit of a chunk
instead of 2).
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
            f"or the weight dtype ({compute_dtype}); an accumulator less precise than the weight only loses accuracy"
        )
    return compute_dtype if compute_dtype == torch.float64 else accum_dtype


def forced_by(precision: str, forced: dict[str, Any] | None) -> dict[str, Any] | None:
    """The caller's forced config fields (``config_overrides``) with those of ``precision`` laid over them: the
    policy wins over a config field (an ``FLCEConfig`` forces every field, fp32_logits=False included, so a
    config passed beside precision="precise" could not otherwise say it did not mean to turn it off)."""
    fields = _FORCED[check_precision(precision)]
    if not fields:
        return forced
    return {**(forced or {}), **fields}


def fp32_logits_on(fp32_logits: bool, dtype: torch.dtype) -> bool:
    """Whether a call with ``FLCEConfig.fp32_logits`` and inputs of ``dtype`` computes fp32 logits beside its
    compute-dtype gradient: only for bf16/fp16, whose own logits would be rounded (fp32 and fp64 logits already
    are the GEMM's accumulator, so "precise" runs as "exact" there)."""
    return fp32_logits and dtype in (torch.bfloat16, torch.float16)
