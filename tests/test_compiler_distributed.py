"""backend="flce" under torch.distributed, on the CPU: FSDP2 (``fully_shard``) with the whole Hugging Face model
compiled, in two gloo processes, against one process; and lm_head + loss inside an activation-checkpointed
region (moved out of the region and fused)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import flce_compile.compiler as fc
from flce_compile.compiler.rewrite import flce_fused_loss, flce_fused_loss_keep

V, H = 96, 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_llama():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model


def _rank_batch(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, 160, (2, 12), generator=g)
    return ids, ids.clone()


def _fsdp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Each logits mode: FSDP2 over every layer and the root, the whole model compiled with backend="flce",
    two steps; rank 0 saves losses, full gradients and the lm_head gradient's placements."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {}
        for logits in ("keep", "drop"):
            torch._dynamo.reset()
            model = _tiny_llama()
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            graphs = []

            def capture(gm, example_inputs, **kw):
                from torch._dynamo.backends.registry import lookup_backend

                graphs.append(gm)
                return lookup_backend("aot_eager")(gm, example_inputs, **kw)

            options = {"flce.inner": capture, "flce.logits": logits}
            compiled = torch.compile(model, backend="flce", options=options)
            ids, labels = _rank_batch(rank)
            losses = []
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                out = compiled(input_ids=ids, labels=labels)
                out.loss.backward()
                losses.append(out.loss.detach())
            placements = [(type(p).__name__, getattr(p, "dim", None)) for p in model.lm_head.weight.grad.placements]
            fused = [n.target.__name__ for gm in graphs for n in gm.graph.nodes
                     if n.op == "call_function" and n.target in (flce_fused_loss, flce_fused_loss_keep)]
            results[logits] = {"losses": losses, "logits_none": out.logits is None, "head_placements": placements,
                               "fused": fused,
                               "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()}}
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "rank0.pt"))
    finally:
        dist.destroy_process_group()


def test_fsdp2_whole_hf_model_compiled_matches_one_process(tmp_path):
    pytest.importorskip("transformers")
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    mp.spawn(_fsdp_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    results = torch.load(tmp_path / "rank0.pt")

    # One process, no sharding: each rank's loss on its own batch, gradients averaged as FSDP's reduce does.
    model = _tiny_llama()
    ref_grads: dict[str, torch.Tensor] = {}
    for rank in range(2):
        model.zero_grad(set_to_none=True)
        ids, labels = _rank_batch(rank)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        if rank == 0:
            ref_loss = loss.detach()
        for n, p in model.named_parameters():
            ref_grads[n] = ref_grads.get(n, 0) + p.grad / 2
    for logits, got in results.items():
        for loss in got["losses"]:
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=logits)
        for n, g in got["grads"].items():
            torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6, msg=f"{logits} {n}")
        assert got["head_placements"] == [("Shard", 0)]  # the lm_head's gradient is reduce-scattered as usual
        assert got["logits_none"] == (logits == "drop")
        assert got["fused"] == ["flce_fused_loss" if logits == "drop" else "flce_fused_loss_keep"]


class CheckpointedHead(nn.Module):
    """lm_head and loss written inside a checkpoint (to avoid keeping the logits), after a norm in the same
    region."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.norm = nn.LayerNorm(H)
        self.lm_head = nn.Linear(H, V, bias=False)

    def head_loss(self, h, t):
        return F.cross_entropy(self.lm_head(self.norm(h)).view(-1, V), t.view(-1))

    def forward(self, idx, t):
        return checkpoint(self.head_loss, torch.tanh(self.emb(idx)), t, use_reentrant=False)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_checkpointed_head_is_moved_out_and_fused(inner):
    torch.manual_seed(0)
    model = CheckpointedHead()
    idx, t = torch.randint(0, V, (2, 6)), torch.randint(0, V, (2, 6))
    model.zero_grad()
    ref = model(idx, t)
    ref.backward()
    ref_g = {n: p.grad.clone() for n, p in model.named_parameters()}
    report = fc.explain(model, idx, t)
    assert [r.path for r in report] == ["fused"]
    assert any("moved out of the checkpoint" in n and "1 other op" in n for n in report.notes), str(report)
    graphs = []

    def capture(gm, example_inputs, **kw):
        from torch._dynamo.backends.registry import lookup_backend

        graphs.append(gm)
        return lookup_backend(inner)(gm, example_inputs, **kw)

    torch._dynamo.reset()
    model.zero_grad()
    got = torch.compile(model, backend="flce", options={"flce.inner": capture})(idx, t)
    got.backward()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_g[n], rtol=1e-4, atol=1e-6, msg=n)
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert flce_fused_loss in targets
    assert not any("checkpoint" in str(t) for t in targets)
