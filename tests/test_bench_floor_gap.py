"""benchmarks/floor_gap.py on the CPU: its chunked GEMM steps compute the op's dX and dW (against fp64), the steps
run in turns with the ratios taken of their medians (the GPU timer replaced by a scripted one). Its refusals of bad
arguments are tested with floor_operand.py's, whose command line it shares."""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytest.importorskip("triton")  # bench_flce times with triton.testing (_common.do_bench_ms)

import benchmarks.floor_gap as floor_gap  # noqa: E402


def test_chunks_cover_the_tokens_and_refuse_an_empty_chunk():
    assert floor_gap.chunks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert floor_gap.chunks(10, 16) == [(0, 10)]
    with pytest.raises(ValueError, match="chunk=0"):
        floor_gap.chunks(10, 0)


@pytest.mark.parametrize("chunk", [4, 16])  # three chunks summed in fp32; one written straight in bf16
def test_the_gemm_steps_give_the_ops_dx_and_dw(chunk):
    g = torch.Generator().manual_seed(0)
    n, h, v, v_padded = 10, 8, 13, 16
    x = torch.randn(n, h, generator=g).to(torch.bfloat16)
    weight = torch.zeros(v_padded, h, dtype=torch.bfloat16)
    weight[:v] = torch.randn(v, h, generator=g).to(torch.bfloat16)
    grad = torch.zeros(n, v_padded, dtype=torch.bfloat16)
    grad[:, :v] = (torch.randn(n, v, generator=g) * 0.1).to(torch.bfloat16)
    steps = floor_gap.GemmSteps(x, weight, grad, v, chunk)
    dw = steps.rounding()
    assert dw.dtype == torch.bfloat16 and dw.shape == (v, h)
    assert steps.dw.dtype == (torch.bfloat16 if chunk >= n else torch.float32)
    dw_ref = (grad.double().t() @ x.double())[:v]
    dx_ref = grad.double() @ weight.double()
    # one bf16 rounding of fp32 sums: within half a bf16 ulp (2^-8 relative) plus the sums' own fp32 error
    assert (dw.double() - dw_ref).abs().max() <= 2**-8 * dw_ref.abs().max() + 1e-6
    assert (steps.dx.double() - dx_ref).abs().max() <= 2**-8 * dx_ref.abs().max() + 1e-6


def test_the_steps_alternate_and_the_ratios_are_of_their_medians(tmp_path, monkeypatch):
    ran = []
    scripted = iter([10.0, 10.2, 10.5, 11.0,  # floor, gemms, rounding, op; three rounds
                     12.0, 12.1, 12.4, 12.6,
                     11.0, 11.1, 11.6, 11.5])

    def do_bench_ms(fn, warmup_ms, rep_ms):
        fn()  # the real step, on the CPU
        ran.append(fn)
        return next(scripted)

    monkeypatch.setattr(floor_gap, "do_bench_ms", do_bench_ms)
    monkeypatch.setattr(floor_gap, "make_inputs", _cpu_inputs)
    monkeypatch.setattr(floor_gap, "environment", lambda: {"gpu": "G P U", "torch": "2.x", "date": "today"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sys, "argv", ["floor_gap.py", "--shapes", "12x8x13", "--rounds", "3", "--tag", "_t",
                                      "--out", str(tmp_path)])
    floor_gap.main()
    assert len(ran) == 12
    data = json.loads((tmp_path / "floor_gap_G_P_U_t.json").read_text())
    row = data["rows"][0]
    assert row["rounds_ms"]["floor"] == [10.0, 12.0, 11.0]
    assert row["rounds_ms"]["op"] == [11.0, 12.6, 11.5]
    assert row["median_ms"] == {"floor": 11.0, "gemms": 11.1, "rounding": 11.6, "op": 11.5}
    assert row["over_floor"]["op"] == pytest.approx(11.5 / 11.0)
    assert data["beside"] == []
    md = (tmp_path / "floor_gap_G_P_U_t.md").read_text()
    # dW rounding = (11.6 - 11.1) / 11.0, CE and rest = (11.5 - 11.6) / 11.0
    assert (f"| 12x8x13 | {row['chunk_tokens']} | 11.00 | 11.10 (1.009) | 11.60 (1.055) | 11.50 (1.045) | 4.5% "
            "| -0.9% |") in md


def _cpu_inputs(n: int, h: int, v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).to(torch.bfloat16)
    w = (torch.randn(v, h, generator=g) / h**0.5).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), generator=g)
    t[0] = -100
    return x, w, t
