"""benchmarks/logits_epilogue_gemm.py's Triton GEMM on the CPU, through Triton's interpreter (fp32: the
interpreter's bf16 dot is not what the GPU computes): the logits must be x @ w^T and the epilogue's per-tile
statistics must combine to each row's lse over the first V columns, at sizes that leave partial tiles in M and N;
otherwise the GPU table would time a wrong kernel."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@pytest.mark.parametrize("stats", [False, True], ids=["plain", "epilogue"])
def test_gemm_and_its_statistics(stats: bool):
    from benchmarks.logits_epilogue_gemm import combined_lse, logits_gemm

    rows, hidden, vocab, width = 20, 32, 70, 72  # partial tiles: 20 rows in 16s, 72 columns in 32s
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=gen)
    w = torch.zeros(width, hidden)
    w[:vocab] = torch.randn(vocab, hidden, generator=gen)
    out = torch.full((rows, width), float("nan"))
    tiles = logits_gemm(x, w, out, vocab, (16, 32, 16, 4, 4, 1), stats)  # a group taller than the 2 row tiles
    torch.testing.assert_close(out, x @ w.t(), rtol=1e-5, atol=1e-5)
    if stats:
        torch.testing.assert_close(combined_lse(*tiles), torch.logsumexp(out[:, :vocab], 1), rtol=1e-6, atol=1e-6)
    else:
        assert tiles is None


def test_hidden_must_fill_whole_k_blocks():
    from benchmarks.logits_epilogue_gemm import logits_gemm

    with pytest.raises(ValueError, match="BLOCK_K"):
        logits_gemm(torch.zeros(4, 24), torch.zeros(8, 24), torch.zeros(4, 8), 8, (16, 32, 16, 2, 4, 1), False)


@pytest.mark.parametrize("warp_specialize", [False, True], ids=["plain", "warp_specialized"])
@pytest.mark.parametrize("stats", [False, True], ids=["gemm", "epilogue"])
def test_persistent_tma_gemm_and_its_statistics(stats: bool, warp_specialize: bool):
    """The persistent TMA kernel: 3 programs walk 8 tiles (so each takes several, the last ones partial in M and
    N; the descriptors zero-fill the loads past the edges and clip the stores), out's rows padded past N."""
    from benchmarks.logits_epilogue_gemm import combined_lse, logits_gemm_tma

    rows, hidden, vocab, width = 20, 32, 54, 56
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, hidden, generator=gen)
    w = torch.zeros(width, hidden)
    w[:vocab] = torch.randn(vocab, hidden, generator=gen)
    out = torch.full((rows, 64), float("nan"))  # 64 columns: a row stride of 256 bytes, past the 56 written
    tiles = logits_gemm_tma(x, w, out, vocab, (16, 16, 16, 4, 4, 1, warp_specialize), stats, programs=3)
    torch.testing.assert_close(out[:, :width], x @ w.t(), rtol=1e-5, atol=1e-5)
    assert out[:, width:].isnan().all()  # the store is clipped to N columns
    if stats:
        torch.testing.assert_close(combined_lse(*tiles), torch.logsumexp(out[:, :vocab], 1), rtol=1e-6, atol=1e-6)
    else:
        assert tiles is None


def test_tma_gemm_needs_16_byte_rows():
    from benchmarks.logits_epilogue_gemm import logits_gemm_tma

    with pytest.raises(ValueError, match="16 bytes"):
        logits_gemm_tma(torch.zeros(4, 16), torch.zeros(8, 16), torch.zeros(4, 9)[:, :8], 8,
                        (16, 16, 16, 2, 4, 1, False), False, programs=1)
