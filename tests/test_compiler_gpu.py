"""GPU: bf16 parity and a peak-memory bound for one HF Llama training step under backend="flce"."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

import flce_compile.compiler  # noqa: E402,F401  (registers backend="flce" in dev checkouts)


V, S = 32768, 4096


@pytest.fixture(autouse=True)
def no_graph_replay():
    """These tests compare one call's transient memory across modes; a replayed CUDA graph holds its memory
    between calls instead (test_gpu_graph_replay.py covers it), so graph replay is off here."""
    from flce_compile import graph_replay, set_cuda_graphs

    set_cuda_graphs("off")
    yield
    set_cuda_graphs("auto")
    graph_replay.clear()


@pytest.fixture(scope="module")
def llama():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=S)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    model.config.use_cache = False
    return model, torch.randint(0, V, (1, S), device="cuda")


def _step(model, ids, backend, options, hold_output=False):
    """One warm step, then a measured one: (loss, grads, peak above the model's own memory)."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, options=options)
    model.zero_grad(set_to_none=True)
    compiled(input_ids=ids, labels=ids).loss.backward()  # warm-up/compile
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = compiled(input_ids=ids, labels=ids)
    loss = out.loss
    if not hold_output:
        out = None  # as `loss = model(...).loss` does
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}, peak


def test_llama_bf16_parity_and_peak_memory(llama):
    model, ids = llama
    ref_loss, ref_g, ref_peak = _step(model, ids, "inductor", None)
    loss, grads, peak = _step(model, ids, "flce", {"flce.logits": "drop"})
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-2)
    for name, g in grads.items():
        cos = torch.nn.functional.cosine_similarity(g.flatten(), ref_g[name].flatten(), dim=0)
        assert cos > 0.99, name
    # Inductor alone already fuses the CE over one bf16 copy of the logits (and its gradient); the pass must
    # save at least that copy.
    logits_bf16 = S * V * 2
    assert peak < ref_peak - logits_bf16, (peak, ref_peak)


def test_llama_default_keeps_logits_for_their_bytes_only(llama):
    """backend="flce" with no options: the returned logits cost their own bytes and nothing more (no saved
    logits, no logits gradient, no zero tangent), whether the caller drops the output or holds it through
    backward; the loss matches the drop mode's."""
    model, ids = llama
    drop_loss, drop_g, drop_peak = _step(model, ids, "flce", {"flce.logits": "drop"})
    logits_bytes = S * V * 2
    for hold in (False, True):
        loss, grads, peak = _step(model, ids, "flce", None, hold_output=hold)
        torch.testing.assert_close(loss, drop_loss, rtol=1e-3, atol=1e-3)
        for name, g in grads.items():
            cos = torch.nn.functional.cosine_similarity(g.flatten(), drop_g[name].flatten(), dim=0)
            assert cos > 0.999, name
        assert peak <= drop_peak + logits_bytes * 1.02, (hold, peak, drop_peak, logits_bytes)
