"""backend="flce" under torch.distributed, on the CPU: DDP and FSDP2 (``fully_shard``) with the whole Hugging Face
model compiled, and the op called directly under FSDP2, in two gloo processes, against one process; and
lm_head + loss inside an activation-checkpointed region (moved out of the region and fused)."""

from __future__ import annotations


import os
import socket

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import flce_compile
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


class _Capture:
    """Inner compiler that records the graphs it gets, then runs aot_eager."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs, **kw):
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs, **kw)

    def fused(self) -> list[str]:
        return [n.target.__name__ for gm in self.graphs for n in gm.graph.nodes
                if n.op == "call_function" and n.target in (flce_fused_loss, flce_fused_loss_keep)]


class _DirectOpLM(nn.Module):
    """The route for models whose layer loop sits in the head's frame: compile the layers, call the op."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        hidden = self.model.model(input_ids=input_ids).last_hidden_state
        labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return flce_compile.fused_linear_cross_entropy(hidden, self.model.lm_head.weight, labels)


def _wrap(scenario: str, model, capture: _Capture):
    """The model of one scenario, as its users would build it; returns (module to step, callable)."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    kind, logits = scenario.split("-")
    options = {"flce.inner": capture, "flce.logits": logits}
    if kind == "ddp":
        return model, torch.compile(DistributedDataParallel(model), backend="flce", options=options)
    for layer in model.model.layers:
        fully_shard(layer)
    if kind == "fsdp2":
        fully_shard(model)
        return model, torch.compile(model, backend="flce", options=options)
    for layer in model.model.layers:  # "direct": the blocks compiled, the op called in the root's forward
        layer.compile(backend="flce", options=options)
    direct = _DirectOpLM(model)
    fully_shard(direct)
    return model, direct


SCENARIOS = ("fsdp2-keep", "fsdp2-materialize", "fsdp2-drop", "ddp-keep", "ddp-drop", "direct-drop")


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Each scenario: two training steps on this rank's batch; rank 0 saves losses, full gradients, the lm_head
    gradient's placements and which graphs were fused."""
    import torch.distributed as dist

    # The ranks share the host's cores (two on CI, with another test worker): one intra-op thread each, so that
    # neither rank's thread pool takes the core that the other rank, which it waits for in each collective, needs.
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {}
        for scenario in SCENARIOS:
            torch._dynamo.reset()
            capture = _Capture()
            model, step = _wrap(scenario, _tiny_llama(), capture)
            ids, labels = _rank_batch(rank)
            losses = []
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                out = step(input_ids=ids, labels=labels)
                loss = out if isinstance(out, torch.Tensor) else out.loss
                # Read before backward: FSDP frees the unsharded weight after it, and "keep"'s logits not read
                # by then can no longer be computed (an error says so).
                logits = None if isinstance(out, torch.Tensor) or out.logits is None else out.logits.detach()
                loss.backward()
                losses.append(loss.detach())
            grads = {n: p.grad for n, p in model.named_parameters()}
            head = grads["lm_head.weight"]
            results[scenario] = {
                "losses": losses, "fused": capture.fused(),
                "logits_none": None if isinstance(out, torch.Tensor) else out.logits is None,
                "logits": logits, "stale_after_backward": None,
                "head_placements": [(type(p).__name__, getattr(p, "dim", None)) for p in head.placements]
                if hasattr(head, "placements") else None,
                "grads": {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()},
            }
            if scenario == "fsdp2-keep":  # held through backward unread: FSDP freed their weight
                from flce_compile.compiler.lazy_logits import StaleLogitsError

                model.zero_grad(set_to_none=True)  # (the gradients above stay as they are)
                held = step(input_ids=ids, labels=labels)
                held.loss.backward()
                try:
                    held.logits.sum()
                    results[scenario]["stale_after_backward"] = False
                except StaleLogitsError:
                    results[scenario]["stale_after_backward"] = True
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "rank0.pt"))
    finally:
        dist.destroy_process_group()


def test_ddp_and_fsdp2_match_one_process(tmp_path):
    """DDP (Dynamo's DDPOptimizer splits the graph by gradient bucket), FSDP2 with the whole HF model compiled,
    and the direct op under FSDP2, in two gloo processes, each against one process."""
    pytest.importorskip("transformers")
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    results = torch.load(tmp_path / "rank0.pt")

    # One process, no sharding: each rank's loss on its own batch, gradients averaged as DDP and FSDP do.
    model = _tiny_llama()
    ref_grads: dict[str, torch.Tensor] = {}
    for rank in range(2):
        model.zero_grad(set_to_none=True)
        ids, labels = _rank_batch(rank)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        if rank == 0:
            ref_loss = loss.detach()
            ref_logits = model(input_ids=ids, labels=labels).logits.detach()
        for n, p in model.named_parameters():
            ref_grads[n] = ref_grads.get(n, 0) + p.grad / 2
    assert list(results) == list(SCENARIOS)
    for scenario, got in results.items():
        for loss in got["losses"]:
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=scenario)
        for n, g in got["grads"].items():
            torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{scenario} {n}: {m}")
        kind, logits = scenario.split("-")
        if kind != "direct":
            assert got["logits_none"] == (logits == "drop"), scenario
            assert got["fused"] == ["flce_fused_loss_keep" if logits == "materialize" else "flce_fused_loss"], scenario
            assert got["stale_after_backward"] == (True if scenario == "fsdp2-keep" else None), scenario
            if logits != "drop":  # "keep": computed when read (here before backward); "materialize": in the graph
                torch.testing.assert_close(got["logits"], ref_logits, rtol=1e-5, atol=1e-6, msg=scenario)
        if kind != "ddp":  # the lm_head's gradient is reduce-scattered as usual
            assert got["head_placements"] == [("Shard", 0)], scenario


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
