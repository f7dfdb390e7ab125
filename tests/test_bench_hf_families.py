"""benchmarks/hf_families.py: the family sweep writes one row per family, with the fused site and the
differences to eager, and names a family this transformers lacks instead of failing."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import hf_families  # noqa: E402


def test_sweep_row_and_table(tmp_path):
    result = hf_families.main(["gemma2", "--inner", "eager", "--out", str(tmp_path)])
    (row,) = result["rows"]
    keep, drop = row["keep"], row["drop"]
    assert row["status"] == "ok" and keep["graphs"] == drop["graphs"] == 1
    assert [s["path"] for s in keep["sites"]] == ["fused_lazy"] and [s["path"] for s in drop["sites"]] == ["fused"]
    assert keep["sites"][0]["softcap"] == pytest.approx(5.0)
    # What the compiled graphs held, not only what explain predicted.
    assert keep["fused_ops"] == drop["fused_ops"] == {"fused": 1, "fused_keep": 0}  # keep: logits computed when read
    assert keep["loss"] < 1e-5 and keep["grads"] < 1e-5 and keep["logits"] == 0.0 and not keep["logits_dropped"]
    assert drop["logits_dropped"] and drop["logits"] is None and drop["grads"] < 1e-5
    saved = json.loads((tmp_path / "hf_families_eager.json").read_text())
    assert saved["rows"] == result["rows"] and saved["env"]["transformers"]
    table = (tmp_path / "hf_families_eager.md").read_text()
    assert "| gemma2 | 5.0 | 1.0 | 1 (1 compiled) / 1 (1 compiled) | fused_lazy | 1 fused |" in table
    assert "| fused | 1 fused | yes |" in table
    assert keep["inner_failures"] == drop["inner_failures"] == 0


def test_sweep_under_autocast_fuses_bart_and_says_so(tmp_path):
    """--autocast bf16 runs eager and compiled steps under autocast with fp32 parameters, as the Trainer's bf16=True
    does: BART's fp32 final_logits_bias then promotes the bf16 logits (it was left unfused there); the file and the
    table say which autocast ran."""
    result = hf_families.main(["bart", "--inner", "eager", "--autocast", "bf16", "--out", str(tmp_path)])
    (row,) = result["rows"]
    assert row["status"] == "ok" and result["autocast"] == "bf16"
    assert [s["path"] for s in row["keep"]["sites"]] == ["fused_lazy"]
    assert row["drop"]["fused_ops"] == {"fused": 1, "fused_keep": 0} and row["keep"]["logits"] == 0.0
    table = (tmp_path / "hf_families_eager_bf16_autocast.md").read_text()
    assert "fp32 parameters under bf16 autocast on cpu" in table


def test_sweep_leaves_logging_alone(tmp_path):
    """main() is also called from tests: the transformers logger and warning filters stay as they were."""
    import logging
    import warnings

    level, filters = logging.getLogger("transformers").level, list(warnings.filters)
    hf_families.main(["llama", "--inner", "eager", "--out", str(tmp_path)])
    assert logging.getLogger("transformers").level == level and warnings.filters == filters


def test_recorder_counts_only_what_the_inner_compiler_compiled(monkeypatch):
    """A graph the inner compiler fails on never runs (Dynamo splits it): it is a failure, not a compiled graph."""
    from torch._dynamo.backends import registry

    def failing(gm, example_inputs, **kwargs):
        raise RuntimeError("aten._local_scalar_dense.default")

    monkeypatch.setattr(registry, "lookup_backend", lambda name: failing)
    recorder = hf_families._Recorder("inductor")
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError):
        recorder(gm, [])
    assert recorder.failed == 1 and recorder.graphs == [] and recorder.traced == []


def test_recorder_counts_a_fused_graph_the_backend_runs_as_traced(monkeypatch):
    """A fused graph whose failure Dynamo answers with a graph break runs as traced (flce.inner_failure's
    default): its fused op counts as run; the same failure on a graph without one does not."""
    from torch._dynamo.backends import registry
    from torch._subclasses.fake_tensor import DataDependentOutputException

    def failing(gm, example_inputs, **kwargs):
        raise DataDependentOutputException(torch.ops.aten._local_scalar_dense.default)

    lm_head, graphs = torch.nn.Linear(4, 8, bias=False), []

    def capture(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    head = torch.compile(lambda x, t: torch.nn.functional.cross_entropy(lm_head(x), t), backend="flce",
                         options={"flce.inner": capture, "flce.logits": "drop"})
    head(torch.randn(3, 4), torch.randint(0, 8, (3,)))
    (fused,) = graphs
    monkeypatch.setattr(registry, "lookup_backend", lambda name: failing)
    recorder = hf_families._Recorder("inductor")
    plain = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    for gm in (plain, fused):
        with pytest.raises(DataDependentOutputException):
            recorder(gm, [])
    assert recorder.failed == 2 and recorder.traced == [fused]
    assert recorder.fused_ops() == {"fused": 1, "fused_keep": 0}


def test_missing_family_is_a_row(monkeypatch):
    def missing():
        raise hf_families.FamilyMissing("transformers 0.0 has no NewForCausalLM")

    monkeypatch.setattr(hf_families, "builders", lambda: {"new": missing})
    row = hf_families.check_family("new", "eager")
    assert row["status"].startswith("not in this transformers")


def test_a_broken_config_is_not_a_missing_family(monkeypatch):
    """An error inside a family's own construction is the model's, not a missing class: it is raised."""
    def broken():
        raise AttributeError("'LlamaConfig' object has no attribute 'something'")

    monkeypatch.setattr(hf_families, "builders", lambda: {"llama": broken})
    with pytest.raises(AttributeError, match="something"):
        hf_families.check_family("llama", "eager")


def test_unknown_family_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown families"):
        hf_families.main(["no_such_family", "--out", str(tmp_path)])


def test_differences_past_rounding_are_compared_with_the_pass_off(tmp_path, monkeypatch):
    """A family whose differences to eager pass ``ATTRIBUTE`` is compiled again with the pass off, and the table
    says what the inner compiler alone gives (transformers 5.25's PaliGemma differs by 2e-3 in the loss either way);
    below it, no second compile. Forced here on Llama with a negative threshold."""
    result = hf_families.main(["llama", "--inner", "eager", "--out", str(tmp_path)])
    assert "pass_off" not in result["rows"][0]
    monkeypatch.setattr(hf_families, "ATTRIBUTE", -1.0)
    result = hf_families.main(["llama", "--inner", "eager", "--out", str(tmp_path)])
    off = result["rows"][0]["pass_off"]
    assert off["loss"] < 1e-5 and off["grads"] < 1e-5 and off["logits"] < 1e-5
    table = (tmp_path / "hf_families_eager.md").read_text()
    assert "against the same compile with the pass off" in table and "- llama: loss " in table
