"""A checkpointed forward that writes state (as transformers 5.25's ``kernels`` layer hook does) stays in one graph
under ``backend="flce"``, and only there (``compiler/checkpoint_side_effects.py``)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.config as dynamo_config
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from flce_compile.compiler import backend as flce
from flce_compile.compiler import checkpoint_side_effects
from flce_compile.compiler.options import split_options
from flce_compile.compiler.rewrite import flce_fused_loss

FLAG = checkpoint_side_effects.FLAG
pytestmark = pytest.mark.skipif(not checkpoint_side_effects.flag_supported(), reason="this torch has no such flag")


class _Runs:
    """A global object a checkpointed forward writes to, as the kernels hook's ``CompileableContextVar`` does
    under compile (it marks itself in use): a side effect Dynamo refuses inside a checkpoint unless the flag is
    on. Eager runs it twice a step, in the forward and in the backward's recompute."""

    count = 0


RUNS = _Runs()


class _Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        RUNS.count += 1
        return torch.tanh(self.lin(x))


class _Model(nn.Module):
    def __init__(self, hidden: int = 16, vocab: int = 40) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.block = nn.Embedding(vocab, hidden), _Block(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = checkpoint(self.block, self.emb(ids), use_reentrant=False)
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


IDS = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(1))


def _step(backend_for, wrap=None) -> tuple[list, torch.Tensor, list, bool, int]:
    """(the graphs the inner compiler got, loss, gradients, the flag after the step, the block's runs) of one
    compiled step, right after a bare ``torch._dynamo.reset()`` (which clears Dynamo's callbacks: ours come back);
    ``backend_for(inner)``: (torch.compile's backend, its other keyword arguments) around the inner compiler;
    ``wrap``: a module wrapper (DDP)."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = _Model()
    torch._dynamo.reset()
    backend, kwargs = backend_for(counting)
    before = RUNS.count
    loss = torch.compile(wrap(model) if wrap else model, backend=backend, **kwargs)(IDS, IDS)
    loss.backward()
    flag_after = getattr(dynamo_config, FLAG)
    torch._dynamo.reset()
    return graphs, loss.detach(), [p.grad for p in model.parameters()], flag_after, RUNS.count - before


def _flce(spelling: str, mode: str | None = None):
    """The backend as users name it: ``"flce"`` with torch.compile's options, or ``with_options``."""
    ours = {} if mode is None else {"checkpoint_side_effects": mode}
    if spelling == "options":
        return lambda inner: ("flce", {"options": {"flce.inner": inner, **{"flce." + k: v for k, v in ours.items()}}})
    return lambda inner: (flce.with_options(inner=inner, **ours), {})


def _assert_as_eager(loss: torch.Tensor, grads: list) -> None:
    model = _Model()
    before = RUNS.count
    eager_loss = model(IDS, IDS)
    eager_loss.backward()
    assert RUNS.count - before == 2  # eager's recompute runs the forward's side effect again
    torch.testing.assert_close(loss, eager_loss.detach(), rtol=1e-6, atol=1e-6)
    for got, param in zip(grads, model.parameters()):
        torch.testing.assert_close(got, param.grad, rtol=1e-5, atol=1e-6)


def _fused(graphs: list) -> int:
    return sum(n.target is flce_fused_loss for gm in graphs for n in gm.graph.nodes)


@pytest.mark.parametrize("spelling", ["options", "with_options"])
def test_the_default_keeps_a_checkpointed_side_effect_in_one_fused_graph(spelling):
    graphs, loss, grads, flag_after, runs = _step(_flce(spelling))
    assert len(graphs) == 1 and _fused(graphs) == 1
    assert flag_after is False  # put back once the compile ended
    assert runs == 1  # the side effect ran in the forward only
    _assert_as_eager(loss, grads)


def test_replay_leaves_dynamos_graph_break_with_the_same_results():
    graphs, loss, grads, flag_after, runs = _step(_flce("options", "replay"))
    assert len(graphs) > 1 and _fused(graphs) == 1 and flag_after is False
    assert runs == 2  # the checkpoint ran as in eager
    _assert_as_eager(loss, grads)


def test_another_backend_compiles_with_dynamos_default():
    """The callbacks are installed for the whole process, but turn the flag on only for this package's compiles."""
    graphs, _loss, _grads, flag_after, runs = _step(lambda inner: (inner, {}))
    assert len(graphs) > 1 and _fused(graphs) == 0 and flag_after is False and runs == 2


def test_a_flag_the_user_turned_on_stays_on():
    with dynamo_config.patch(**{FLAG: True}):
        graphs, _loss, _grads, flag_after, runs = _step(_flce("with_options", "replay"))
    assert len(graphs) == 1 and flag_after is True and runs == 1


def test_a_bad_mode_names_the_option_and_its_values():
    with pytest.raises(ValueError, match=r"flce.checkpoint_side_effects.*'twice'.*\('once', 'replay'\)"):
        split_options({"flce.checkpoint_side_effects": "twice"})
    assert split_options({"flce.checkpoint_side_effects": "replay"})[0].checkpoint_side_effects == "replay"
    assert split_options(None)[0].checkpoint_side_effects == "once"


def test_a_flag_left_on_by_a_compile_without_its_end_is_put_back_at_the_next_start(monkeypatch):
    """Dynamo runs the callbacks when its count of compiles under way (one for all threads) leaves and returns to
    0: a compile that overlaps another thread's sees no end. Registered twice, the callbacks run twice."""
    backend = {"now": flce.flce_backend}
    monkeypatch.setattr(checkpoint_side_effects, "compiling_backend", lambda: backend["now"])
    with dynamo_config.patch(**{FLAG: False}):
        for _ in range(2):
            checkpoint_side_effects._on_compile_start(None)
            assert getattr(dynamo_config, FLAG) is True
        for _ in range(2):
            checkpoint_side_effects._on_compile_end(None)
            assert getattr(dynamo_config, FLAG) is False
        checkpoint_side_effects._on_compile_start(None)  # ... and this compile's end never comes
        backend["now"] = lambda gm, example_inputs: gm.forward
        checkpoint_side_effects._on_compile_start(None)  # another backend's compile
        assert getattr(dynamo_config, FLAG) is False


def test_under_ddp_the_backend_is_found_inside_ddps_graph_splitter(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        graphs, loss, grads, flag_after, runs = _step(_flce("options"), wrap=DistributedDataParallel)
    finally:
        dist.destroy_process_group()
    assert _fused(graphs) == 1 and runs == 1 and flag_after is False
    _assert_as_eager(loss, grads)
