"""benchmarks/hf_families.py: the family sweep writes one row per family, with the fused site and the
differences to eager, and names a family this transformers lacks instead of failing."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from benchmarks import hf_families  # noqa: E402


def test_sweep_row_and_table(tmp_path):
    result = hf_families.main(["gemma2", "--inner", "eager", "--out", str(tmp_path)])
    (row,) = result["rows"]
    assert row["status"] == "ok" and row["graphs"] == 1
    assert [s["fused"] for s in row["sites"]] == [True] and row["sites"][0]["softcap"] == pytest.approx(5.0)
    assert row["keep"]["loss"] < 1e-5 and row["keep"]["grads"] < 1e-5 and row["keep"]["logits"] == 0.0
    assert row["drop"]["logits_dropped"] and row["drop"]["grads"] < 1e-5
    saved = json.loads((tmp_path / "hf_families_eager.json").read_text())
    assert saved["rows"] == result["rows"] and saved["env"]["transformers"]
    assert "| gemma2 | yes | 5.0 | 1.0 | 1 |" in (tmp_path / "hf_families_eager.md").read_text()


def test_missing_family_is_a_row(monkeypatch):
    def missing():
        raise AttributeError("module transformers has no attribute 'NewForCausalLM'")

    monkeypatch.setattr(hf_families, "builders", lambda: {"new": missing})
    row = hf_families.check_family("new", "eager")
    assert row["status"].startswith("not in this transformers")


def test_unknown_family_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown families"):
        hf_families.main(["no_such_family", "--out", str(tmp_path)])
