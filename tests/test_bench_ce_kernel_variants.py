"""benchmarks/ce_kernel_variants.py's stripped CE kernel on the CPU, through Triton's interpreter: every variant
the GPU table times must compute the same gradient (softmax - one_hot, over the mean) as torch, with the padding
columns' gradient 0 and an ignored row's all 0; otherwise the table would time wrong kernels."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@pytest.mark.parametrize("vocab", [203, 256])
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_every_variant_computes_the_gradient(vocab: int):
    import triton

    from benchmarks.ce_kernel_variants import VARIANTS, ce_variant_kernel

    rows, stride = 4, 272
    width = -(-vocab // 16) * 16
    gen = torch.Generator().manual_seed(vocab)
    base = (torch.randn(rows, stride, generator=gen) * 2).to(torch.bfloat16)
    target = torch.randint(0, vocab, (rows,), generator=gen)
    target[2] = -100
    want = torch.softmax(base[:, :vocab].float(), dim=1)
    want[torch.arange(rows), target.clamp(min=0)] -= 1
    want /= rows
    want[2] = 0
    for name, exp2, lane, evict, one_block, block_v, warps in VARIANTS:
        block_v = triton.next_power_of_2(width) if one_block else 64
        buf, loss = base.clone(), torch.empty(rows)
        ce_variant_kernel[(rows,)](buf, stride, target, loss, 1.0 / rows, vocab, width, EXP2=exp2, LANE=lane,
                                   EVICT=evict, ONE_BLOCK=one_block, BLOCK_V=block_v, num_warps=warps)
        torch.testing.assert_close(buf[:, :vocab].float(), want, rtol=0, atol=2e-3, msg=name)  # bf16 rounding
        assert torch.equal(buf[2, :vocab].float(), torch.zeros(vocab)), name
        assert torch.equal(buf[:, vocab:width].float(), torch.zeros(rows, width - vocab)), name
        assert torch.equal(buf[:, width:], base[:, width:]), name  # nothing past the padded width
