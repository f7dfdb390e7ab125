"""benchmarks/bench_e2e.py without a GPU: the attention work-around that gives compiled HF models eager's
mask-free SDPA call, checked on the graph Dynamo hands to the backend."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
import transformers.masking_utils as masking_utils  # noqa: E402

import flce_compile  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def sdpa_calls(model: torch.nn.Module, ids: torch.Tensor) -> list[dict]:
    """kwargs of every SDPA call in the graphs Dynamo captures, nested (checkpointed) subgraphs included."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=capture)(input_ids=ids, labels=ids)
    torch._dynamo.reset()
    return [dict(node.kwargs) for gm in graphs for sub in gm.modules() if hasattr(sub, "graph")
            for node in sub.graph.nodes if node.target is torch.nn.functional.scaled_dot_product_attention]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_e2e", REPO / "benchmarks" / "bench_e2e.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_rows_as_users_run_them_come_first():
    """The default run: every variant as users run it, then only the compiled ones with the mask patch, and the
    Liger variants (which patch the model in place) last."""
    bench = _bench()
    runs = bench.plan_runs(list(bench.DEFAULT_VARIANTS), [16384, 65536], "both")
    first_patched = next(i for i, (_, _, m) in enumerate(runs) if m == "patched")
    assert all(m == "as-is" for _, _, m in runs[:first_patched])
    assert [v for v, _, _ in runs[-2:]] == ["liger-flce", "liger-flce"]
    assert runs[0] == ("eager", 16384, "as-is") and runs[-1] == ("liger-flce", 65536, "as-is")
    patched = {v for v, _, m in runs if m == "patched"}
    assert patched == {"inductor", "flce", "flce-drop"}
    assert {v for v, _, m in runs if m == "as-is"} == set(bench.DEFAULT_VARIANTS)
    assert bench.FLCE_OPTIONS["flce"] is None  # backend="flce" exactly as users call it
    table = bench._table([{"variant": "flce", "seq": 8, "mask": "patched", "status": "ok", "peak_gb": 1.0,
                           "step_ms": 2.0, "loss": 3.0},
                          {"variant": "inductor", "seq": 8, "mask": "patched", "status": "ok", "peak_gb": 2.0,
                           "step_ms": 2.0, "loss": 3.0}])
    assert "bench-only mask patch" in table and "1.00x, 0.50x (vs inductor)" in table
    # the step's own memory (peak above what the timed steps started from) and the steps' range
    table = bench._table([{"variant": "flce", "seq": 8, "mask": "as-is", "status": "ok", "peak_gb": 7.25,
                           "base_gb": 2.5, "step_ms": 433.0, "step_ms_range": [431.2, 440.7], "loss": 3.0}])
    assert "| 8 | flce | ok | 7.25 | 4.75 | 433 (431-441) | 3.0000 |" in table


def test_no_timed_step_and_a_timed_compile_are_refused(capsys):
    bench = _bench()
    for argv in (["--steps", "0"], ["--warmup", "0"]):  # no step timed, or the compile's step timed
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert "--steps and --warmup must be >= 1" in capsys.readouterr().err


def test_gpt2_is_built_as_transformers_builds_it():
    """``--model gpt2``: GPT-2 small with as many positions as the longest run, its loss type unset (the case the
    backend keeps in one graph, ``hf_logging``), dropout off, checkpointed, in training mode; an unknown family is
    refused."""
    bench = _bench()
    model = bench.build_model("cpu", torch.float32, family="gpt2", positions=64)
    assert type(model).__name__ == "GPT2LMHeadModel" and model.loss_type is None and model.training
    assert (model.config.n_positions, model.config.vocab_size, model.config.n_embd) == (64, 50257, 768)
    # dropout off: the variants' losses compare (each drew its own masks, 0.1 by default)
    assert (model.config.resid_pdrop, model.config.embd_pdrop, model.config.attn_pdrop) == (0.0, 0.0, 0.0)
    assert model.is_gradient_checkpointing
    with pytest.raises(ValueError, match="family='bert' is unknown"):
        bench.build_model("cpu", torch.float32, family="bert")


def test_qwen3moe_is_qwen3_30b_a3b_layers():
    """``--model qwen3moe``: Qwen3-30B-A3B's layer shape (8 of the experts per token, untied head, V = 151936), at
    the layers and experts asked."""
    cfg = _bench().qwen3moe_config(layers=2, experts=16)
    assert (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.vocab_size) == (
        2048, 768, 8, 151936)
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.tie_word_embeddings) == (2, 16, False)


def test_causal_skip_gives_compiled_models_eager_attention(monkeypatch):
    bench = _bench()
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.config.use_cache = False  # as in the benchmark (and any run with gradient checkpointing)
    ids = torch.randint(0, 128, (1, 16))

    # Without the work-around Dynamo's graph carries an explicit S x S mask (flash attention impossible): with
    # no cache, transformers looks for packed sequences in the position ids, which it cannot rule out while
    # tracing.
    assert all(kw["attn_mask"] is not None for kw in sdpa_calls(model, ids))
    for name in ("_ignore_causal_mask_sdpa", "find_packed_sequence_indices"):
        monkeypatch.setattr(masking_utils, name, getattr(masking_utils, name))  # restored after the test
    bench.allow_causal_skip_under_compile()
    calls = sdpa_calls(model, ids)
    assert calls and all(kw["attn_mask"] is None and kw["is_causal"] for kw in calls)
    # Padded batches still get their mask.
    assert masking_utils._ignore_causal_mask_sdpa(torch.ones(1, 16, dtype=torch.bool), 16, 16, 0, 0) is not None


def test_bart_is_bart_large_shaped_with_a_random_logits_bias():
    """``--model bart``: BART-large's shape at the layers asked, as many positions as the longest run, its
    final_logits_bias random (zeros when built would leave nothing to fold), an fp32 buffer beside fp32 weights
    (the autocast case the backend folds), checkpointed, in training mode."""
    model = _bench().build_model("cpu", torch.float32, family="bart", positions=64, layers=1)
    cfg = model.config
    assert type(model).__name__ == "BartForConditionalGeneration" and model.training
    assert (cfg.d_model, cfg.vocab_size, cfg.encoder_ffn_dim, cfg.max_position_embeddings) == (1024, 50265, 4096, 64)
    assert (cfg.encoder_layers, cfg.decoder_layers) == (1, 1) and model.is_gradient_checkpointing
    bias = model.final_logits_bias
    assert bias.dtype == torch.float32 and not bias.requires_grad and bias.std() > 0.5


def test_the_log_prob_objective_is_fused_and_equals_eager():
    """``--objective log-probs``: the hand-written policy-gradient objective, compiled as the flce variants compile
    it, fuses its per-token log-prob pick and gives eager's loss and gradients; Liger has no row for it."""
    bench = _bench()
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 256, (1, 24))

    def run(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(ids)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    ref, ref_g = run(bench.prepare("eager", model, "log-probs"))
    objective = bench.log_prob_objective(model)
    (report,) = flce_compile.explain(objective, ids, options={"flce.inner": "aot_eager"})
    assert report.fused and "gather of log_softmax" in report.loss, str(report)
    got, got_g = run(bench.compile_variant("flce", objective, flce_inner="aot_eager"))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    with pytest.raises(RuntimeError, match="unavailable"):
        bench.prepare("liger-flce", model, "log-probs")
