"""The peak-memory bound of the fused op, as one sympy expression.

"Peak" means bytes allocated above the inputs and the returned loss/gradients. The tuner checks candidate
configs against a budget with it, the docs quote it, and the tests hold measured peaks to it.
"""

from __future__ import annotations

import functools
import numbers

import sympy
import torch

from . import registry
from .config import FLCEConfig
from .layout import ROW_ALIGN_BYTES, UPCAST_VOCAB_BLOCK, vocab_needs_padding
from .precision import fp32_logits_on

BT, V, H, CHUNK = sympy.symbols("BT V H chunk", integer=True, positive=True)
#: dW's columns: H less the weight's frozen leading columns (``LossParams.frozen_weight_columns``), which get none.
HW = sympy.symbols("H_dw", integer=True, nonnegative=True)
#: itemsize of the compute dtype, bytes per element of the dW accumulator (0 = accumulate in the output).
S, ACC = sympy.symbols("s acc", integer=True, nonnegative=True)
#: 0/1 switches: dW wanted, bias gradient wanted, dW via a temporary (dw_path "mm_add").
NEED_DW, NEED_DB, DW_TMP = sympy.symbols("need_dw need_db dw_tmp", integer=True, nonnegative=True)
#: fp32 temporaries of one chunk that the strategy's CE step holds at once (``Strategy.temporaries``: 2 or 3
#: for the pure-PyTorch step, 0 or 1 where it works in the fp32 chunk itself (fp32 inputs off CUDA), 0 for the
#: Triton kernel).
K32 = sympy.symbols("k32", integer=True, nonnegative=True)
#: Chunk buffers of logits alive at once: 2 with stream overlap (double buffering), else 1.
BUFFERS = sympy.symbols("buffers", integer=True, positive=True)
#: 0/1: config.pad_vocab with a V that needs padding (a zero-padded weight copy; dW/db over the padded rows).
#: A call through ``strategies.padded_tail`` copies only the weight's odd rows: the bound counts the whole copy.
PAD = sympy.symbols("pad_vocab", integer=True, nonnegative=True)
#: 0/1: dW accumulates in the weight dtype, in the buffer that is returned (acc = 0).
IN_PLACE = sympy.symbols("acc_in_place", integer=True, nonnegative=True)

#: 0/1: fp32 logits (``FLCEConfig.fp32_logits`` with bf16/fp16 inputs, the "precise" policy).
FP32L = sympy.symbols("fp32_logits", integer=True, nonnegative=True)
#: 0/1: fp32 sums of bf16/fp16 products where there is no mixed-dtype GEMM (off CUDA): ``add_product`` upcasts both
#: operands of each product it adds into an fp32 buffer (the chunked loop's dW sums; the recompute loop's dX sum
#: and a block's dW rows).
UPCAST = sympy.symbols("upcast_operands", integer=True, nonnegative=True)
#: 0/1: frozen weight columns with dW wanted: dW's own ``HW`` columns are padded to H at the end
#: (``op._input_grads``), the unpadded dW alive beside the returned one.
FROZEN = sympy.symbols("frozen_pad", integer=True, nonnegative=True)
#: 0/1: the torch CE step works in the fp32 chunk itself (fp32 inputs off CUDA: ``Strategy.works_in_fp32_chunk``),
#: so ``k32`` counts no spare chunk; its vectors over the chunk's rows and over its classes then count on their
#: own (``TORCH_STEP_ROW_BYTES``, ``TORCH_STEP_CLASS_BYTES``).
STEP_VECTORS = sympy.symbols("torch_step_vectors", integer=True, nonnegative=True)
#: 0/1: fp64 inputs to the chunked loop: backward returns scaled copies of the forward's gradients and keeps the
#: originals (``op._scaled_forward_grads``: backward may run again, as gradcheck runs it).
F64 = sympy.symbols("fp64_copies", integer=True, nonnegative=True)

#: Per-token vectors, bytes per token: fp32 loss rows, the four fp64 rows kept for backward
#: (``chunked.kept_rows``), and the int64 copy of targets of another integer dtype (int32 ones: 8 bytes a token
#: the bound missed, a bug hunt measured). Per chunk row: int64/bool masks of one chunk.
PER_TOKEN_BYTES = 44
#: The recompute loop's per-row factors of a "none" loss (``recompute.row_factors``): grad_output in the math
#: dtype, the two factors and a temporary, bytes per token (fp32; an fp64 loss's larger ones fit in the fp64
#: terms' slack, measured at 1M tokens). Counted for every reduction: the bound does not know it.
RECOMPUTE_ROW_FACTOR_BYTES = 16
PER_CHUNK_ROW_BYTES = 64
#: The torch CE step's own per-row vectors of a chunk beyond ``PER_CHUNK_ROW_BYTES`` (bool masks, int64 indices,
#: the fp64 lse and loss terms), counted where ``k32`` holds no fp32 chunk besides the step's to cover them
#: (``STEP_VECTORS``). Measured on the CPU with fp32 inputs, at 2^17-row chunks of V <= 128 where nothing else
#: dwarfs them: up to 31 bytes a row past the other terms (a softcap, label smoothing, class weights, z-loss,
#: ignored rows and int32 targets at once), so 64 is twice that.
TORCH_STEP_ROW_BYTES = 64
#: The same for the torch step's fp32 vectors over a chunk's classes, bytes a class: label smoothing's class
#: weights of ones (without ``ce_weight``) and the chunk's column sums for db. One at a time was measured (7.6 MiB
#: past a bound without them at V = 2M, 6.6 past its slack), so 8 counts two.
TORCH_STEP_CLASS_BYTES = 8
#: Fixed slack for allocator rounding and small scalars.
SLACK_BYTES = 1 << 20
#: With stream overlap, cuBLAS allocates a workspace for the side stream on its first GEMM there (32 MiB on
#: Hopper by default; bounded generously). It stays cached by the allocator afterwards.
SIDE_STREAM_WORKSPACE_BYTES = 64 << 20


def _fp32_logits_bytes(rows: sympy.Expr, columns: sympy.Expr, row_bytes: sympy.Expr) -> sympy.Expr:
    """With fp32 logits: their chunk buffer (``rows`` rows of ``row_bytes`` in the compute dtype, so
    ``row_bytes / s`` fp32 values each), the fp32 bias, and the upcast operands of the GEMM where there is no
    mixed-dtype one (the CPU: ``rows`` x H and ``UPCAST_VOCAB_BLOCK`` x H fp32 values; counted on every device,
    a bound). The gradient goes into the usual compute-dtype buffer(s). The true-class correction
    (``strategies.true_class``) adds per row two fp32 residuals, its int64 row indices and, at once, the dX
    addend (2 bytes per hidden unit) and the dW product (4)."""
    upcast = 4 * H * (rows + sympy.Min(columns, UPCAST_VOCAB_BLOCK))
    true_class = rows * (6 * H + 2 * 4 + 4 * 8)
    return FP32L * (rows * row_bytes / S * 4 + columns * 4 + upcast + true_class)


def _step_vectors(rows: sympy.Expr, classes: sympy.Expr) -> sympy.Expr:
    """The torch CE step's own vectors over a chunk's ``rows`` and ``classes``, where ``k32`` holds no spare
    chunk to cover them (``STEP_VECTORS``)."""
    return STEP_VECTORS * (rows * TORCH_STEP_ROW_BYTES + classes * TORCH_STEP_CLASS_BYTES)


@functools.cache
def peak_bytes_expr() -> sympy.Expr:
    """Bytes above inputs and outputs: one chunk of logits (two with stream overlap; + CE temporaries; + an
    fp32 chunk with fp32 logits), the dW/db accumulators, the padded weight copy (pad_vocab) and the per-token
    vectors. Nothing is BT x V. (dW over all H columns; ``peak_bytes`` counts dW's own, ``HW``, with frozen
    weight columns.)"""
    return _chunked_terms().subs(HW, H)


@functools.cache
def _chunked_terms() -> sympy.Expr:
    """``peak_bytes_expr`` with dW's columns their own symbol, ``HW``."""
    rows = sympy.Min(CHUNK, BT)
    row_bytes = sympy.ceiling(V * S / ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES  # rows padded for aligned GEMMs
    pad_rows = row_bytes / S - V
    logits_chunk = BUFFERS * rows * row_bytes
    ce_temporaries = K32 * rows * (V + PAD * pad_rows) * 4
    dw_accumulator = NEED_DW * (V * HW * ACC + DW_TMP * V * HW * S)
    db_accumulator = NEED_DB * V * 4
    # With pad_vocab: the padded weight and bias copies, the padding rows of the dW/db accumulators, and, when dW
    # accumulates over chunks in the weight dtype (acc_in_place = 1), the whole padded accumulator next to the
    # unpadded dW it is copied into at the end (a single chunk writes dW's V rows straight).
    padding = PAD * (
        row_bytes * H + row_bytes + pad_rows * (NEED_DW * HW * (ACC + DW_TMP * S) + NEED_DB * 4)
        + NEED_DW * IN_PLACE * row_bytes * HW
    )
    per_token = BT * PER_TOKEN_BYTES + rows * PER_CHUNK_ROW_BYTES
    step_vectors = _step_vectors(rows, V + PAD * pad_rows)
    side_stream = (BUFFERS - 1) * SIDE_STREAM_WORKSPACE_BYTES
    wide = _fp32_logits_bytes(rows, V + PAD * pad_rows, row_bytes)
    upcast = UPCAST * NEED_DW * 4 * rows * (V + PAD * pad_rows + H)  # a chunk's gradient and hidden states, in fp32
    frozen_pad = FROZEN * NEED_DW * V * HW * S
    fp64_copies = F64 * (NEED_DX * BT * H * S + NEED_DW * V * HW * S + NEED_DB * V * S)
    return (logits_chunk + ce_temporaries + wide + dw_accumulator + db_accumulator + padding + per_token
            + step_vectors + side_stream + upcast + frozen_pad + fp64_copies + SLACK_BYTES)


#: The recompute strategy: vocabulary rows per backward block, 0/1 for dX wanted, and the itemsize of its block
#: sums (the accumulator dtype's, also when it is the weight's: the block is summed apart from dW).
VB, NEED_DX, ACC_BLOCK = sympy.symbols("vocab_block need_dx acc_block", integer=True, nonnegative=True)


@functools.cache
def recompute_peak_bytes_expr() -> sympy.Expr:
    """The "recompute" strategy's bound: the larger of its forward (the chunk loop without gradients: one chunk
    of logits and the CE temporaries, less the returned gradients, which do not exist yet) and its backward (the
    dX sum over all tokens and one block's dW rows, in the accumulator dtype when it differs from the weight's,
    one chunk x block buffer of logits and its CE temporaries), plus the saved lse and the per-token vectors.
    Nothing is V x H or BT x V. (dW over all H columns; ``peak_bytes`` counts dW's own, ``HW``, with frozen
    weight columns.)"""
    return _recompute_terms().subs(HW, H)


@functools.cache
def _recompute_terms() -> sympy.Expr:
    """``recompute_peak_bytes_expr`` with dW's columns their own symbol, ``HW``."""
    rows = sympy.Min(CHUNK, BT)
    block = sympy.Min(VB, V)
    row_bytes = sympy.ceiling(V * S / ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES
    block_bytes = sympy.ceiling(block * S / ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES
    # Forward runs before the returned gradients exist, so its chunk of logits is counted against the space
    # they take later (the bound is the peak above inputs and gradients): a chunk of 4096 x 128256 bf16
    # logits (1.05 GB) fits under the 1.18 GB of dX + dW at 16384 x 4096 x 128256.
    returned = NEED_DX * BT * H * S + NEED_DW * V * HW * S + NEED_DB * V * S
    # With pad_vocab the forward's chunk loop runs on a zero-padded copy of the weight and bias (as the chunked
    # loop's): a bound without it was exceeded by 3 MiB at V = 4097, H = 1024 (a bug hunt).
    padded_copy = PAD * (row_bytes * H + row_bytes)
    forward = (rows * row_bytes + K32 * rows * V * 4 + _fp32_logits_bytes(rows, V, row_bytes) + padded_copy
               - returned)
    # Off CUDA each product summed in fp32 has both operands upcast: a block's weight rows and its gradient for
    # dX, the chunk's hidden states for the block's dW rows (the larger pair at once, bounded by all three).
    upcast = UPCAST * 4 * (block * H + rows * block + rows * H)
    backward = (NEED_DX * BT * H * ACC + NEED_DW * block * HW * ACC_BLOCK + NEED_DB * block * 4
                + rows * block_bytes + K32 * rows * block * 4 + _fp32_logits_bytes(rows, block, block_bytes)
                + FP32L * V * 4 + upcast)  # FP32L * V * 4: the whole fp32 bias
    per_token = BT * (PER_TOKEN_BYTES + RECOMPUTE_ROW_FACTOR_BYTES) + rows * PER_CHUNK_ROW_BYTES
    step_vectors = _step_vectors(rows, V)  # (over all V classes: forward's chunks have them, backward's blocks fewer)
    return (sympy.Max(forward, backward) + FROZEN * NEED_DW * V * HW * S + per_token + step_vectors
            + SLACK_BYTES)


def peak_bytes(
    config: FLCEConfig,
    num_tokens: int,
    vocab: int,
    hidden: int,
    dtype: torch.dtype,
    accum_dtype: torch.dtype = torch.float32,
    *,
    need_dw: bool = True,
    need_db: bool = False,
    softcap: bool = False,
    need_dx: bool = True,
    frozen_columns: int = 0,
    device: torch.device | str = "cuda",
) -> int:
    """Evaluate ``peak_bytes_expr`` (or the recompute loop's) for one call of the op with ``config``; dW has
    ``hidden - frozen_columns`` columns. ``device``: where the call runs (a strategy's CE step can hold more fp32
    copies of a chunk off the GPU: the recompute strategy's torch step on the CPU; or fewer: the torch step over
    fp32 inputs off CUDA works in the chunk itself). Memoised: a sympy evaluation
    takes about a millisecond, and a memory budget asks for the same bounds on every call of the op and every
    proposal of the tuner."""
    if not isinstance(config, FLCEConfig):
        raise TypeError(f"peak_bytes: config must be an FLCEConfig (e.g. FLCEConfig(chunk_tokens=1024) or "
                        f"flce_compile.which_config(...).config), got {type(config).__name__}")
    for name, value in (("dtype", dtype), ("accum_dtype", accum_dtype)):
        if not isinstance(value, torch.dtype) or not value.is_floating_point:
            raise TypeError(f"peak_bytes: {name}={value!r} must be a floating-point torch.dtype, e.g. torch.bfloat16")
    for name, value, least in (("num_tokens", num_tokens, 0), ("vocab", vocab, 1), ("hidden", hidden, 0),
                               ("frozen_columns", frozen_columns, 0)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < least:
            raise ValueError(f"peak_bytes: {name}={value!r} must be an int >= {least}")
    if frozen_columns > hidden:
        raise ValueError(f"peak_bytes: frozen_columns={frozen_columns} must be <= hidden={hidden}")
    return _peak_bytes(config, num_tokens, vocab, hidden, dtype, accum_dtype, need_dw, need_db, softcap, need_dx,
                       registry.generation(), frozen_columns, torch.device(device).type)


@functools.lru_cache(maxsize=4096)
def _peak_bytes(config: FLCEConfig, num_tokens: int, vocab: int, hidden: int, dtype: torch.dtype,
                accum_dtype: torch.dtype, need_dw: bool, need_db: bool, softcap: bool, need_dx: bool,
                generation: int, frozen_columns: int,  # noqa: ARG001 - generation: misses the cache
                device_type: str) -> int:
    strategy = registry.get(config.strategy)
    k32 = strategy.temporaries(softcap, device_type, dtype, accum_dtype)
    step_vectors_on = int(strategy.works_in_fp32_chunk(device_type, dtype, accum_dtype))
    off_cuda = device_type != "cuda"
    frozen_pad = int(frozen_columns > 0)
    if strategy.loop == "recompute":
        return int(_recompute_terms().subs({
            BT: max(num_tokens, 1), V: vocab, H: hidden, HW: hidden - frozen_columns, CHUNK: config.chunk_tokens,
            VB: config.vocab_block,
            S: dtype.itemsize, ACC: accum_dtype.itemsize if accum_dtype != dtype else 0,
            ACC_BLOCK: accum_dtype.itemsize, NEED_DX: int(need_dx),
            NEED_DW: int(need_dw), NEED_DB: int(need_db), K32: k32, STEP_VECTORS: step_vectors_on,
            FP32L: int(fp32_logits_on(config.fp32_logits, dtype)),
            UPCAST: int(off_cuda and accum_dtype.itemsize > dtype.itemsize), FROZEN: frozen_pad,
            PAD: int(config.pad_vocab and vocab_needs_padding(vocab, dtype.itemsize)),
        }))
    wide = fp32_logits_on(config.fp32_logits, dtype)
    # One chunk (the loop's own test) writes dW in the weight dtype and has nothing to overlap (chunked.py).
    single_chunk = config.chunk_tokens >= num_tokens
    # An fp16 "mean" sums dW in fp32 whatever the chunking and accum_dtype (``chunked._fit_stored_sums``);
    # counted for every fp16 reduction, an upper bound for "sum".
    fp16_sums = need_dw and dtype == torch.float16
    separate_acc = fp16_sums or (need_dw and accum_dtype != dtype and not (single_chunk and not wide))
    if fp16_sums:
        accum_dtype = torch.float32
    values = {
        BT: max(num_tokens, 1),
        V: vocab,
        H: hidden,
        HW: hidden - frozen_columns,
        CHUNK: config.chunk_tokens,
        S: dtype.itemsize,
        ACC: accum_dtype.itemsize if separate_acc else 0,
        NEED_DW: int(need_dw),
        NEED_DB: int(need_db),
        DW_TMP: int(separate_acc and config.dw_path == "mm_add"),
        K32: k32,
        STEP_VECTORS: step_vectors_on,
        BUFFERS: 2 if config.streams and not single_chunk else 1,
        PAD: int(config.pad_vocab and vocab_needs_padding(vocab, dtype.itemsize)),  # else a no-op
        IN_PLACE: int(need_dw and not separate_acc and not (single_chunk and not wide)),
        FP32L: int(wide),
        UPCAST: int(off_cuda and separate_acc and accum_dtype.itemsize > dtype.itemsize),
        FROZEN: frozen_pad,
        F64: int(dtype == torch.float64),
        NEED_DX: int(need_dx),
    }
    return int(_chunked_terms().subs(values))
