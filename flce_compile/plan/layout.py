"""Row alignment of the vocabulary dimension: how far a logits row or the weight is padded so that every GEMM
operand has an aligned leading dimension. Pure arithmetic, shared by the chunk loop, the memory bound, the
default config and the tuner."""

from __future__ import annotations

#: Alignment of a logits chunk's rows, in bytes (the alignment Inductor pads its strides to).
ROW_ALIGN_BYTES = 128


def padded_row_elements(vocab: int, itemsize: int) -> int:
    """Row stride of a logits chunk: ``vocab`` rounded up to a multiple of ROW_ALIGN_BYTES.

    With an odd vocabulary (GPT-2's 50257) an unpadded chunk gives every GEMM that writes or reads it a
    misaligned leading dimension, which sends cuBLAS to its slow kernels; the padding columns are never read.
    """
    per_row = -(-vocab * itemsize // ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES
    return per_row // itemsize


def aligned_head_rows(vocab: int, itemsize: int) -> int:
    """The most leading rows of a (V, ...) operand whose count is a multiple of ROW_ALIGN_BYTES of elements: a
    GEMM over them alone runs at the padded GEMM's speed, with the odd rest in a small GEMM of its own (the
    single-chunk dW of an odd V, ``chunked._DwAccumulator``)."""
    per_align = max(1, ROW_ALIGN_BYTES // itemsize)
    return vocab // per_align * per_align


def vocab_needs_padding(vocab: int, itemsize: int) -> bool:
    """Whether ``pad_vocab`` changes anything for this V: its rows are not already a multiple of the padded
    row (GPT-2's 50257 is not; 128256 is)."""
    return padded_row_elements(vocab, itemsize) != vocab


#: Weight rows upcast to fp32 at once by the fp32-logits GEMM where there is no mixed-dtype GEMM (the CPU;
#: ``strategies.wide_logits``), which bounds the copy the memory bound counts.
UPCAST_VOCAB_BLOCK = 1024
