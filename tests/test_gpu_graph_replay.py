"""Real CUDA-graph replay of the fused op (``graph_replay``): bit-identical to the uncaptured loop, outputs held
by the caller never overwritten, no capture inside someone else's capture, the ``flce`` backend's compiled
graphs replaying and Inductor's CUDA graphs left alone, and the memory a graph holds bounded as documented.
The cache policy itself is tested on the CPU (test_graph_replay.py)."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import flce_compile.compiler  # noqa: F401  (registers backend="flce" without the installed entry point)
from cuda_capture import plain_and_captured
from replay_steps import instances, steps_at
from flce_compile import FLCEConfig, eager_shortcut, fused_linear_cross_entropy, graph_replay, set_cuda_graphs

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def fresh_graphs():
    graph_replay.clear()
    eager_shortcut.clear()
    set_cuda_graphs("auto")
    yield
    set_cuda_graphs("auto")
    graph_replay.clear()
    eager_shortcut.clear()


def _inputs(seed, n=2048, h=768, v=50304, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    w = (torch.randn(v, h, device="cuda", generator=g) * 2.0 / h**0.5).to(dtype)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[::13] = -100
    return x, w, t


def _training_run(w0, batches, config=None, grad_factor=1.0):
    """A plain loop: forward, backward, an in-place update, weight.grad dropped, the last loss kept into the
    next step. The hidden states come out of an op, as a model's do (a leaf's .grad would keep the graph's dX
    alive through the kept loss). Returns every step's (loss, dx, dw)."""
    w = w0.clone().requires_grad_()
    out = []
    for x, t in batches:
        x = x.clone().requires_grad_()
        loss = fused_linear_cross_entropy(x * 1, w, t, config=config)
        (loss * grad_factor).backward()
        out.append((loss.detach().clone(), x.grad.clone(), w.grad.clone()))
        with torch.no_grad():
            w.sub_(1e-2 * w.grad)
        w.grad = None
    return out


@pytest.mark.parametrize("streams", [False, True])
@pytest.mark.parametrize("grad_factor", [1.0, 1 / 3])
def test_replay_is_bit_identical_to_the_uncaptured_loop(streams, grad_factor):
    _, w0, _ = _inputs(0)
    batches = [_inputs(s)[::2] for s in range(1, 6)]
    config = {"chunk_tokens": 512, "streams": streams}
    graphed = _training_run(w0, batches, config, grad_factor)
    assert graph_replay.graph_count() == 1
    set_cuda_graphs("off")
    assert graph_replay.graph_count() == 0
    plain = _training_run(w0, batches, config, grad_factor)
    for step, (a, b) in enumerate(zip(graphed, plain)):
        for name, u, v in zip(("loss", "dx", "dw"), a, b):
            assert torch.equal(u, v), f"step {step}: {name} differs"


def test_the_eager_shortcut_is_bit_identical_to_the_uncaptured_loop(shortcut_hits):
    """Default options and 3-D hidden states, as a model calls the op: from the third step on the calls take the
    eager shortcut (``eager_shortcut``) to the graph, with the uncaptured loop's results bit for bit."""
    _, w0, _ = _inputs(0)
    batches = [(x.view(8, 256, -1), t.view(8, 256)) for x, t in (_inputs(s)[::2] for s in range(1, 6))]
    hits = shortcut_hits(eager_shortcut, "replay", first="replay_recent")
    graphed = _training_run(w0, batches)
    assert hits == [False, False, True, True, True]
    set_cuda_graphs("off")
    plain = _training_run(w0, batches)
    for got, expected in zip(graphed, plain):
        for a, b in zip(got, expected):
            assert a.shape == b.shape and torch.equal(a, b)


def test_the_scaling_reads_a_settled_grad_output_in_place_bit_identically():
    """The backward scaling's graph that reads grad_output where it lies (``_Graph.scale_grads``): with the same
    gradient tensor every step, its value changed in place (1, 0.5, 3, 1/3, ...), and in a steady loop of plain
    ``loss.backward()``, whose ``ones_like`` the caching allocator then hands the same block each step; both
    bit-identical to the uncaptured loop."""
    _, w0, _ = _inputs(0)
    batches = [_inputs(s)[::2] for s in range(1, 8)]
    grad = torch.ones((), device="cuda")

    def run():
        w = w0.clone().requires_grad_()
        out = []
        for (x, t), factor in zip(batches, (1.0, 1.0, 0.5, 3.0, 1 / 3, 0.1, 2.0)):
            x = x.clone().requires_grad_()
            loss = fused_linear_cross_entropy(x * 1, w, t)
            grad.fill_(factor)
            loss.backward(grad)
            out.append((loss.detach().clone(), x.grad.clone(), w.grad.clone()))
            w.grad = None
        return out

    def steady():  # nothing kept across steps: the allocator's state repeats
        x, t = batches[0]
        x, w = x.clone().requires_grad_(), w0.clone().requires_grad_()
        for _ in range(6):
            x.grad = w.grad = None
            fused_linear_cross_entropy(x, w, t).backward()
        return [(x.grad.clone(), w.grad.clone())]

    graphed = run()
    assert [g.direct_at for g in instances()] == [(grad.data_ptr(), torch.float32)]
    graph_replay.clear()
    eager_shortcut.clear()
    graphed += steady()
    assert [g.direct_graph is not None for g in instances()] == [True]
    set_cuda_graphs("off")
    for got, expected in zip(graphed, run() + steady()):
        for a, b in zip(got, expected):
            assert torch.equal(a, b)


def test_inputs_read_in_place_where_they_settle_are_bit_identical_and_never_read_elsewhere():
    """A loop whose hidden states and targets stay at one address (values changed in place) replays a graph that
    reads them there; inputs elsewhere get the copying graph, then a bound one again once they settle. Each
    capture again takes the memory of the graph it replaces: the reserved memory stays where the first left it."""
    x0, w0, t0 = _inputs(0)

    def observe():
        return [g.bound_at is not None and g.x is None for g in instances()], torch.cuda.memory_reserved()

    def run():
        w = w0.clone().requires_grad_()
        a, b = (x0.clone(), t0.clone()), ((x0 * 0.5).clone(), t0.flip(0).clone())
        out, seen = steps_at(w, [a] * 4 + [b] + [a] * 3, observe)
        return out, [bound for bound, _ in seen], [reserved for _, reserved in seen]

    graphed, bound, reserved = run()
    assert bound == [[], [True], [True], [True], [False], [False], [True], [True]]
    # steps 2-4 hold the first bound graph and its scaling graphs; steps 5 and 7 replaced it twice
    assert max(reserved[3:]) - reserved[3] <= 0.05 * graph_replay.held_bytes(), (reserved, graph_replay.held_bytes())
    set_cuda_graphs("off")
    expected, _, _ = run()
    for got, want in zip(graphed, expected):
        for u, v in zip(got, want):
            assert torch.equal(u, v)


def test_outputs_held_by_the_caller_are_never_overwritten():
    x, w, t = _inputs(0)
    w.requires_grad_()
    fused_linear_cross_entropy(x, w, t).backward()  # warm-up
    w.grad = None
    inputs = [_inputs(s)[::2] for s in (1, 2, 3)]
    losses = [fused_linear_cross_entropy(xi, w, ti) for xi, ti in inputs]  # three forwards, then one backward
    assert graph_replay.graph_count() == graph_replay.MAX_INSTANCES
    sum(losses).backward()
    set_cuda_graphs("off")
    w_ref = w.detach().clone().requires_grad_()
    ref = [fused_linear_cross_entropy(xi, w_ref, ti) for xi, ti in inputs]
    sum(ref).backward()
    for a, b in zip(losses, ref):
        assert torch.equal(a.detach(), b.detach())
    assert torch.equal(w.grad, w_ref.grad)


def test_every_kept_loss_keeps_its_value_past_the_loss_rings_length():
    """A loop that keeps each step's loss (for a later mean) past ``LOSS_SLOTS`` steps: the ring's held slots are
    swapped for fresh ones on the device's table, and every kept loss is the uncaptured op's, bit for bit. A loop
    that keeps only the last loss reads its losses from slots the kernel wrote (not the graph's own loss)."""
    _, w, _ = _inputs(0)
    w.requires_grad_()
    batches = [_inputs(s)[::2] for s in range(1, 3 * graph_replay.LOSS_SLOTS)]
    kept = []
    for x, t in batches:
        loss = fused_linear_cross_entropy(x, w, t)
        loss.backward()
        w.grad = None
        kept.append(loss.detach())
    (instance,) = instances()
    assert kept[-1].data_ptr() in {slot.tensor.data_ptr() for slot in instance.ring.slots}
    assert kept[-1].data_ptr() != instance.out.loss.data_ptr()
    set_cuda_graphs("off")
    for loss, (x, t) in zip(kept, batches):
        assert torch.equal(loss, fused_linear_cross_entropy(x, w.detach(), t))


def test_no_replay_inside_a_callers_capture():
    x, w, t = _inputs(0, n=1024)
    args = (x, w, t)
    for _ in range(3):
        fused_linear_cross_entropy(*args)
    assert graph_replay.graph_count() == 1
    expected, captured = plain_and_captured(lambda: fused_linear_cross_entropy(*args))
    assert torch.equal(expected, captured)


def test_large_calls_are_not_graphed_by_default():
    x, w, t = _inputs(0, n=8192, h=2048, v=65536)  # 6.6e12 GEMM flops: above AUTO_MAX_FLOPS
    for _ in range(3):
        fused_linear_cross_entropy(x, w, t)
    assert graph_replay.graph_count() == 0
    set_cuda_graphs("on")
    for _ in range(2):
        fused_linear_cross_entropy(x, w, t)
    assert graph_replay.graph_count() == 1


def test_memory_a_graph_holds_is_within_its_estimate():
    x, w, t = _inputs(0)
    x.requires_grad_()
    w.requires_grad_()
    for _ in range(3):
        fused_linear_cross_entropy(x, w, t).backward()
        x.grad = w.grad = None
    held = graph_replay.held_bytes()
    from flce_compile.op import _graph_bytes
    from flce_compile.params import LossParams
    from flce_compile.plan.choose import op_config
    from flce_compile.strategies import GradRequest, Operands

    cfg = op_config("", 2048, 50304, 768, torch.bfloat16, x.device)
    estimate = _graph_bytes(Operands(x, w, t), LossParams(), cfg, torch.float32, GradRequest(True, True, False))
    assert 0 < held <= estimate * 1.25 + (64 << 20)  # allocator rounding, a cuBLAS workspace
    assert estimate <= graph_replay.auto_pool_limit(x.device)


class _Head(torch.nn.Module):
    def __init__(self, h, v):
        super().__init__()
        self.norm = torch.nn.LayerNorm(h, device="cuda", dtype=torch.bfloat16)
        self.lm_head = torch.nn.Linear(h, v, bias=False, device="cuda", dtype=torch.bfloat16)

    def forward(self, x, t):
        return F.cross_entropy(self.lm_head(self.norm(x)).float(), t)


def _compiled_steps(mode, steps=4):
    """Steps of a compiled head (loss kept into the next step, gradients zeroed): (loss, dx, dW) each."""
    torch._dynamo.reset()
    x, _, t = _inputs(0, n=1024, h=256, v=8192)
    torch.manual_seed(0)
    model = _Head(256, 8192)
    compiled = torch.compile(model, backend="flce", mode=mode)
    out = []
    for step in range(steps):
        if mode:
            torch.compiler.cudagraph_mark_step_begin()
        xi = (x * (1 + step / 8)).requires_grad_()
        loss = compiled(xi, t)
        loss.backward()
        out.append((loss.detach().clone(), xi.grad.clone(), model.lm_head.weight.grad.clone()))
        model.zero_grad(set_to_none=True)
    return out


def test_the_op_inside_a_users_inductor_compile_replays_before_any_graph_tree_exists(shortcut_hits):
    """The op called from a function the user compiled with Inductor (default mode): replayed, from the third
    step through the op body's shortcut, bit-identical to the same compiled function with graph replay off.
    (Runs before the reduce-overhead test below, whose CUDA-graph tree manager turns this path off for the rest
    of the thread.)"""
    x, w, t = _inputs(0, n=1024, h=256, v=8192)
    w.requires_grad_()
    hits = shortcut_hits(graph_replay, "body_shortcut_replay", first="body_shortcut_recent")

    def loss_fn(x, w, t):
        return fused_linear_cross_entropy(x, w, t)

    def steps():
        torch._dynamo.reset()
        compiled = torch.compile(loss_fn)
        out = []
        for step in range(4):
            leaf = x.clone().requires_grad_()
            loss = compiled(leaf * (1 + step / 8), w, t)
            loss.backward()
            out.append((loss.detach().clone(), leaf.grad.clone(), w.grad.clone()))
            w.grad = None
        return out

    graphed = steps()
    assert graph_replay.graph_count() == 1
    assert hits == [False, False, True, True]
    assert graph_replay._RECENT_BODY.last is not None  # the last call's key came through its guard
    set_cuda_graphs("off")
    for a, b in zip(graphed, steps()):
        for u, v in zip(a, b):
            assert torch.equal(u, v)


def test_the_recent_calls_guard_sends_a_call_on_another_stream_or_under_autocast_to_the_full_path(shortcut_hits):
    """With the shortcut's C guard live (``call_guard``), a call on another stream (in no guard: asked every call)
    or under CUDA autocast (in the guard) is not taken as the recent call; the losses are the uncaptured op's."""
    x, w, t = _inputs(0, n=1024)
    w.requires_grad_()
    hits = shortcut_hits(eager_shortcut, "replay", first="replay_recent")

    def call():
        leaf = x.clone().requires_grad_()
        loss = fused_linear_cross_entropy(leaf, w, t)
        loss.backward()
        w.grad = None
        return loss.detach().clone()

    for _ in range(3):
        call()
    assert eager_shortcut._RECENT.last is not None
    hits.clear()
    replayed = call()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = call()
    torch.cuda.current_stream().wait_stream(side)
    with torch.autocast("cuda", dtype=torch.float16):
        cast = call()
    again = call()
    assert hits == [True, False, False, True]
    set_cuda_graphs("off")
    assert torch.equal(replayed, call()) and torch.equal(on_side, replayed) and torch.equal(again, replayed)
    with torch.autocast("cuda", dtype=torch.float16):
        assert torch.equal(cast, call())


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_flce_backend_graphs_replay_only_without_inductors_cuda_graphs(mode):
    graphed = _compiled_steps(mode)
    assert graph_replay.graph_count() == (0 if mode else 1)
    set_cuda_graphs("off")
    plain = _compiled_steps(mode)
    for a, b in zip(graphed, plain):
        for u, v in zip(a, b):
            assert torch.equal(u, v)


@contextlib.contextmanager
def _traced_in_place():
    """The op's backward traced to scale in place (``op.traced_for_cuda_graphs`` off), with no compile caches."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    from flce_compile import op

    with mock.patch.object(op, "traced_for_cuda_graphs", lambda grad_scale: False), \
            inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


@pytest.mark.parametrize("grad_factor", [1.0, 1 / 3])
def test_under_reduce_overhead_graph_trees_rebuild_no_more_tensors_than_for_compiled_torch(grad_factor):
    """Inductor's CUDA-graph trees rebuild an output from metadata at every replay when it aliases another graph's
    output. Traced for CUDA graphs, the op's backward scales dX and dW into new buffers (scaled_gradients.py), so a
    step of the op inside the user's reduce-overhead compile rebuilds no more tensors than compiled torch's (scaled
    in place: 4 against 1), and its gradients are the eager op's, bit for bit."""
    from benchmarks.reduce_overhead import rebuilt_per_step

    x, w, t = _inputs(0, n=1024, h=256, v=8192)
    w.requires_grad_()

    def flce(x, w, t):
        return fused_linear_cross_entropy(x, w, t)

    def torch_loss(x, w, t):
        return F.cross_entropy(F.linear(x, w).float(), t)

    def in_place(x, w, t):
        return fused_linear_cross_entropy(x, w, t)

    def training_step(fn, tracing=contextlib.nullcontext()):
        compiled = torch.compile(fn, mode="reduce-overhead")
        grads = []

        def step():
            torch.compiler.cudagraph_mark_step_begin()
            leaf = x.clone().requires_grad_()
            (compiled(leaf, w, t) * grad_factor).backward()
            grads[:] = [leaf.grad.clone(), w.grad.clone()]
            w.grad = None

        with tracing:
            for _ in range(4):  # compile, the trees' warm-up and recording
                step()
        return step, grads

    ours, our_grads = training_step(flce)
    theirs, _ = training_step(torch_loss)
    # As before: scaled in place (no compile caches: they would hand it the graph compiled for ``flce`` above).
    before, _ = training_step(in_place, _traced_in_place())
    assert rebuilt_per_step(ours, 6) <= rebuilt_per_step(theirs, 6) < rebuilt_per_step(before, 6)
    leaf = x.clone().requires_grad_()
    (fused_linear_cross_entropy(leaf, w, t) * grad_factor).backward()
    assert torch.equal(our_grads[0], leaf.grad) and torch.equal(our_grads[1], w.grad)
    w.grad = None


def test_a_capture_the_stream_refuses_leaves_the_call_uncaptured_and_random_numbers_working(monkeypatch, caplog):
    import logging

    from flce_compile.strategies import chunked

    original = chunked._ce_step

    def syncing_step(config):
        step = original(config)

        def run(args, p):
            torch.cuda.synchronize()  # not allowed while capturing: invalidates the capture
            step(args, p)

        return run

    x, w, t = _inputs(0, n=1024)
    expected = fused_linear_cross_entropy(x, w, t)
    monkeypatch.setattr(chunked, "_ce_step", syncing_step)
    with caplog.at_level(logging.WARNING, logger="flce_compile"):
        for _ in range(3):
            assert torch.equal(fused_linear_cross_entropy(x, w, t), expected)
    assert "capture of the fused op failed" in caplog.text
    assert graph_replay.graph_count() == 0
    torch.randn(4, device="cuda")  # the default generator left capture mode


def test_fp16_loss_scale_and_fp32_replay_match_uncaptured():
    for dtype in (torch.float16, torch.float32):
        _, w0, _ = _inputs(0, n=1024, h=512, v=16384, dtype=dtype)
        batches = [_inputs(s, n=1024, h=512, v=16384, dtype=dtype)[::2] for s in range(1, 4)]
        graph_replay.clear()
        set_cuda_graphs("auto")
        graphed = _training_run(w0, batches, FLCEConfig(strategy="triton", chunk_tokens=256), 1024.0)
        set_cuda_graphs("off")
        plain = _training_run(w0, batches, FLCEConfig(strategy="triton", chunk_tokens=256), 1024.0)
        for a, b in zip(graphed, plain):
            for u, v in zip(a, b):
                assert torch.equal(u, v)


def test_a_tf32_change_after_capture_gets_a_graph_of_its_own():
    """A capture fixes cuBLAS's math mode: calls after TF32 is turned on match the uncaptured loop under TF32 bit
    for bit, not the graph captured before in full fp32 (``graph_replay.math_settings`` is in the keys)."""
    shape = {"n": 1024, "h": 512, "v": 16384, "dtype": torch.float32}
    _, w0, _ = _inputs(0, **shape)
    batches = [_inputs(s, **shape)[::2] for s in range(1, 5)]
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        graphed_fp32 = _training_run(w0, batches)  # captured and taken through the shortcut, in full fp32
        torch.backends.cuda.matmul.allow_tf32 = True
        graphed_tf32 = _training_run(w0, batches)
        set_cuda_graphs("off")
        plain_tf32 = _training_run(w0, batches)
        torch.backends.cuda.matmul.allow_tf32 = False
        plain_fp32 = _training_run(w0, batches)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert not torch.equal(plain_tf32[-1][2], plain_fp32[-1][2])  # TF32 changes the results here
    for graphed, plain in ((graphed_tf32, plain_tf32), (graphed_fp32, plain_fp32)):
        for got, expected in zip(graphed, plain):
            assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_reduction_flag_change_after_capture_gets_a_graph_of_its_own(dtype):
    """A one-chunk call runs under the user's cuBLAS reduced-precision (split-K) reduction flags, and a capture
    fixes the kernels they chose: after a toggle the calls match the uncaptured loop under the new flag bit for
    bit (the flags were in no key until 2026-12-06, so the graph of before kept replaying). A shape whose dW GEMM
    sums over many tokens into a small output, where cuBLAS may split K. On an H100 with torch 2.11 the flags
    changed no result at the seven one-chunk shapes tried (this one included), so there this holds the replayed
    calls to the uncaptured op under both settings; test_replay_shortcuts checks that the key follows the flags."""
    shape = {"n": 8192, "h": 64, "v": 1024, "dtype": dtype}
    name = ("allow_bf16_reduced_precision_reduction" if dtype == torch.bfloat16
            else "allow_fp16_reduced_precision_reduction")
    matmul = torch.backends.cuda.matmul
    _, w0, _ = _inputs(0, **shape)
    batches = [_inputs(s, **shape)[::2] for s in range(1, 5)]
    before = getattr(matmul, name)
    try:
        setattr(matmul, name, True)
        graphed_reduced = _training_run(w0, batches)
        setattr(matmul, name, False)
        graphed_full = _training_run(w0, batches)
        set_cuda_graphs("off")
        plain_full = _training_run(w0, batches)
        setattr(matmul, name, True)
        plain_reduced = _training_run(w0, batches)
    finally:
        setattr(matmul, name, before)
    for graphed, plain in ((graphed_full, plain_full), (graphed_reduced, plain_reduced)):
        for got, expected in zip(graphed, plain):
            assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_fully_masked_batch_keeps_zero_gradients_under_replay_whatever_grad_output_is(dtype, reduction):
    """A batch of prompts only (every target ignored) whose loss is divided by a count of 0, as a Hugging Face
    "sum" over num_items_in_batch: grad_output inf. Torch's gradients are exactly 0; ours must be too in every
    call, through the uncaptured loop, the captured graph, its scaling graphs and the eager shortcut (the factor
    of a mean's scales kernel and of a sum are 0 then, and 0 * inf must not reach the gradients)."""
    x0, w0, t = _inputs(0, dtype=dtype)
    t.fill_(-100)
    w = w0.clone().requires_grad_()
    for step in range(6):
        x = x0.clone().requires_grad_()
        loss = fused_linear_cross_entropy(x * 1, w, t, reduction=reduction)
        assert (loss.isnan() if reduction == "mean" else loss == 0).item()
        (loss / torch.zeros((), device="cuda")).backward()
        assert torch.equal(x.grad, torch.zeros_like(x)), step
        assert torch.equal(w.grad, torch.zeros_like(w)), step
        w.grad = None
    if dtype == torch.bfloat16:
        assert graph_replay.graph_count() == 1  # the later calls replayed
