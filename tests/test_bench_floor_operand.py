"""benchmarks/floor_operand.py: the floor on each dX/dW operand, in turns (CPU: the GPU timer is replaced by a
scripted one), and bench_flce's floor refusing an operand it does not know; the command line that floor_operand.py
and floor_gap.py share (``_common.parse_turns_args``) refusing bad arguments by name."""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytest.importorskip("triton")  # bench_flce times with triton.testing (_common.do_bench_ms)

import benchmarks.bench_flce as bench  # noqa: E402
import benchmarks.floor_gap as floor_gap  # noqa: E402
import benchmarks.floor_operand as floor_operand  # noqa: E402


def test_the_operands_alternate_and_the_ratio_is_of_their_medians(tmp_path, monkeypatch):
    calls = []
    times = iter([10.0, 9.0, 12.0, 11.5, 11.0, 9.5])  # logits, gradient; three rounds

    def time_floor(x, w, t, operand="gradient"):
        calls.append(operand)
        return next(times)

    monkeypatch.setattr(floor_operand, "time_floor", time_floor)
    monkeypatch.setattr(floor_operand, "make_inputs", lambda n, h, v: (None, None, None))
    monkeypatch.setattr(floor_operand, "environment", lambda: {"gpu": "G P U", "torch": "2.x", "date": "today"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sys, "argv", ["floor_operand.py", "--shapes", "8x4x16", "--rounds", "3", "--tag", "_t",
                                      "--out", str(tmp_path)])
    floor_operand.main()
    assert calls == ["logits", "gradient"] * 3
    data = json.loads((tmp_path / "floor_operand_G_P_U_t.json").read_text())
    row = data["rows"][0]
    assert row["rounds_ms"] == {"logits": [10.0, 12.0, 11.0], "gradient": [9.0, 11.5, 9.5]}
    assert row["median_ms"] == {"logits": 11.0, "gradient": 9.5}
    assert row["gradient_over_logits"] == pytest.approx(9.5 / 11.0)
    md = (tmp_path / "floor_operand_G_P_U_t.md").read_text()
    assert "| 8x4x16 | 11.00 | 9.50 | 0.864 |" in md


@pytest.mark.parametrize("module", [floor_operand, floor_gap], ids=["floor_operand", "floor_gap"])
def test_zero_rounds_and_no_gpu_are_refused_by_name(module, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sys, "argv", ["bench.py", "--rounds", "0"])
    with pytest.raises(SystemExit):
        module.main()
    assert "--rounds 0" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["bench.py"])
    with pytest.raises(SystemExit):
        module.main()
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_floor_refuses_an_unknown_operand():
    with pytest.raises(ValueError, match="operand='dx'"):
        bench.time_floor(None, None, None, operand="dx")
