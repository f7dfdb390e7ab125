"""backend="flce" as real training code calls it: Hugging Face ``Trainer`` (compiled with ``model.compile``
before the Trainer is built; ``TrainingArguments(torch_compile_backend="flce")`` is refused by accelerate, which
only knows its own backend list), and a nanoGPT-style loop with gradient accumulation. Each trains a few
steps and must match the same run uncompiled. aot_eager is the inner compiler: it traces the same graphs as
Inductor through AOT autograd, at a fraction of the CPU compile time."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flce_compile.compiler  # noqa: F401  (registers backend="flce" in dev checkouts)

OPTIONS = {"flce.inner": "aot_eager"}


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n: int = 4, seq: int = 12) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 160, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train_with_trainer(tmp_path, compile_model: bool):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    model = _tiny_llama()
    if compile_model:
        model.compile(backend="flce", options=OPTIONS)  # the route the README documents
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("flce" if compile_model else "eager")), max_steps=4,
        per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Rows())
    trainer.train()
    losses = [float(r["loss"]) for r in trainer.state.log_history if "loss" in r]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_hf_trainer_matches_uncompiled(tmp_path, caplog):
    ref_losses, ref_params = _train_with_trainer(tmp_path, compile_model=False)
    torch._dynamo.reset()
    with caplog.at_level("INFO", logger="flce_compile"):
        losses, params = _train_with_trainer(tmp_path, compile_model=True)
    assert "-> fused_lazy" in caplog.text  # HF returns the logits too: computed if read, the loss fused
    assert len(losses) == len(ref_losses) == 4
    for a, b in zip(losses, ref_losses):
        assert a == pytest.approx(b, rel=1e-4)
    assert losses[-1] < losses[0]  # it trained (the same batch every step)
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-4, atol=1e-5, msg=name)


class NanoGPT(nn.Module):
    """nanoGPT's shape: tied embedding, one block, lm_head, F.cross_entropy with ignore_index=-1."""

    def __init__(self, vocab: int = 96, dim: int = 32) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(64, dim)
        self.ln = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=idx.device), 1)
        x = x + self.attn(self.ln(x), self.ln(x), self.ln(x), attn_mask=mask, need_weights=False)[0]
        x = x + self.mlp(self.ln(x))
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def _nanogpt_loop(compiled: bool, steps: int = 3, accumulation: int = 2):
    torch.manual_seed(0)
    model = NanoGPT()
    step_fn = torch.compile(model, backend="flce", options=OPTIONS) if compiled else model
    # SGD, not Adam: Adam scales the ~1e-9 rounding noise of a zero gradient (attention's key bias) to full steps.
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        for _ in range(accumulation):
            idx = torch.randint(0, 96, (2, 16), generator=g)
            targets = torch.roll(idx, -1, 1)
            targets[:, -1] = -1
            _logits, loss = step_fn(idx, targets)
            (loss / accumulation).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_nanogpt_loop_with_gradient_accumulation_matches_uncompiled():
    ref_losses, ref_params = _nanogpt_loop(compiled=False)
    torch._dynamo.reset()
    losses, params = _nanogpt_loop(compiled=True)
    assert all(math.isfinite(v) for v in losses)
    for a, b in zip(losses, ref_losses):
        assert a == pytest.approx(b, rel=1e-4)
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-4, atol=1e-5, msg=name)
