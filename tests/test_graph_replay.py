"""The CUDA-graph launch path's policy, on the CPU: warm-up, instances whose outputs are still held, keys,
eviction, failed captures, modes, and who may replay.

A CPU "graph" stands in for the CUDA one: its replay runs the captured forward again on the graph's own input
buffers and writes the results into the graph's output tensors, as a real replay writes into its pool. The
cache, the aliasing of outputs and the busy checks are the library's own. Real captures run in
test_gpu_graph_replay.py.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from flce_compile import fused_linear_cross_entropy, graph_replay, set_cuda_graphs
from flce_compile.compiler.inner import no_cuda_graphs_of_its_own
from flce_compile.compiler.options import FLCEOptions
from flce_compile.params import LossParams, encode_params
from replay_steps import instances, steps_at


def _inputs(seed, n=12, h=8, v=40):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=torch.float32)
    w = torch.randn(v, h, generator=g, dtype=torch.float32) * 0.3
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = -100
    return x, w, t


def _step(x, w, t):
    """One eager forward + backward; returns (loss, dx, dw) as fresh copies."""
    x = x.clone().requires_grad_()
    loss = fused_linear_cross_entropy(x, w, t)
    loss.backward()
    dw = w.grad.clone()
    w.grad = None
    return loss.detach().clone(), x.grad.clone(), dw


def test_first_call_warms_up_second_captures_then_replays_with_identical_results(cpu_graphs):
    _, w, _ = _inputs(0)
    w.requires_grad_()
    results = []
    for seed in range(4):
        x, _, t = _inputs(seed + 1)
        results.append((_step(x, w, t), x, t))
        with torch.no_grad():
            w.mul_(0.99)  # an optimizer step: in place, same address
    assert len(cpu_graphs) == 1 and graph_replay.graph_count() == 1
    set_cuda_graphs("off")
    assert graph_replay.graph_count() == 0
    w2 = w.detach().clone()
    w2.div_(0.99**4)  # back to the weights of the first call
    for (got, x, t) in results:
        w2.requires_grad_()
        expected = _step(x, w2, t)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        with torch.no_grad():
            w2.mul_(0.99)


def test_outputs_still_held_get_a_second_instance_and_are_never_overwritten(cpu_graphs):
    x, w, t = _inputs(0)
    w.requires_grad_()
    fused_linear_cross_entropy(x.requires_grad_(), w, t).backward()  # warm-up
    w.grad = None
    losses, xs = [], []
    for seed in range(3):  # three forwards before any backward
        xi, _, ti = _inputs(seed + 10)
        xi.requires_grad_()
        losses.append(fused_linear_cross_entropy(xi, w, ti))
        xs.append((xi, ti))
    assert graph_replay.graph_count() == graph_replay.MAX_INSTANCES  # the third ran uncaptured
    sum(losses).backward()
    set_cuda_graphs("off")
    w_ref = w.detach().clone().requires_grad_()
    ref = sum(fused_linear_cross_entropy(xi.detach().clone().requires_grad_(), w_ref, ti) for xi, ti in xs)
    ref.backward()
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(sum(losses).detach(), ref.detach(), rtol=0, atol=1e-6)


def test_weight_grad_kept_across_micro_batches_accumulates_exactly(cpu_graphs):
    """Autograd adopts the graph's dW as weight.grad: while it is held, later micro-batches use another
    instance, and the sum is the uncaptured one's."""
    _, w, _ = _inputs(0)
    w.requires_grad_()
    batches = [_inputs(s)[::2] for s in range(1, 6)]
    fused_linear_cross_entropy(*batches[0][:1], w, batches[0][1]).backward()  # warm-up, as a previous step
    w.grad = None  # zero_grad(): the first micro-batch's dW becomes weight.grad
    for x, t in batches:
        fused_linear_cross_entropy(x, w, t).backward()
    assert graph_replay.graph_count() == 2
    set_cuda_graphs("off")
    w_ref = w.detach().clone().requires_grad_()
    for x, t in batches:
        fused_linear_cross_entropy(x, w_ref, t).backward()
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=0, atol=1e-6)


def test_a_kept_storage_object_alone_holds_the_outputs(cpu_graphs):
    """Keeping only ``w.grad.untyped_storage()`` (no tensor) holds the graph's dW as a tensor would: the
    storage object counts as one use whether kept or not, so its Python references tell."""
    _, w, _ = _inputs(0)
    w.requires_grad_()
    kept = []
    for seed in range(4):
        x, _, t = _inputs(seed + 1)
        fused_linear_cross_entropy(x, w, t).backward()
        kept.append((w.grad.untyped_storage(), w.grad.clone()))
        w.grad = None
    assert graph_replay.graph_count() == graph_replay.MAX_INSTANCES  # the held storages kept both busy
    for storage, dw in kept:
        assert torch.empty(0).set_(storage, 0, dw.shape).equal(dw)  # nothing kept was overwritten


def _ring_of_the_only_graph():
    (instance,) = instances()
    return instance.ring


def test_losses_come_from_the_ring_and_a_loop_keeping_one_replaces_no_slot(cpu_graphs):
    """A replayed call hands out the ring slot its replay wrote (no copy of the graph's loss); a loop that keeps
    only its last loss never finds a slot held when the slot's turn comes back."""
    _, w, _ = _inputs(0)
    w.requires_grad_()
    loss = None
    steps = 3 * graph_replay.LOSS_SLOTS
    for seed in range(steps):
        x, _, t = _inputs(seed + 1)
        loss = fused_linear_cross_entropy(x, w, t)  # the last step's loss is still held here, as in a loop
        loss.backward()
        w.grad = None
        if seed == 2:
            ring = _ring_of_the_only_graph()
            first_slots = [slot.tensor for slot in ring.slots]
    ring = _ring_of_the_only_graph()
    assert all(slot.tensor is first for slot, first in zip(ring.slots, first_slots))  # no slot replaced
    assert loss.data_ptr() in {slot.tensor.data_ptr() for slot in ring.slots}  # a slot, not a copy of one
    set_cuda_graphs("off")
    x, _, t = _inputs(steps)
    torch.testing.assert_close(loss.detach(), fused_linear_cross_entropy(x, w.detach(), t), rtol=0, atol=0)


@pytest.mark.parametrize("keep", ["tensor", "storage object"])
def test_kept_losses_are_never_overwritten_when_their_slot_comes_round(cpu_graphs, keep):
    """Keeping every loss (a list for a later mean), or only a loss's storage object, past the ring's length: the
    held slots are replaced before their turn, and every kept value is the uncaptured op's."""
    _, w, _ = _inputs(0)
    w.requires_grad_()
    kept, inputs = [], []
    for seed in range(3 * graph_replay.LOSS_SLOTS):
        x, _, t = _inputs(seed + 1)
        loss = fused_linear_cross_entropy(x, w, t)
        loss.backward()
        w.grad = None
        kept.append(loss.detach() if keep == "tensor" else loss.untyped_storage())
        inputs.append((x, t))
        del loss
    set_cuda_graphs("off")
    for held, (x, t) in zip(kept, inputs):
        value = held if keep == "tensor" else torch.empty(0).set_(held, 0, ())
        torch.testing.assert_close(value, fused_linear_cross_entropy(x, w.detach(), t), rtol=0, atol=0)


def test_a_slot_swap_that_fails_leaves_the_ring_in_step(cpu_graphs, monkeypatch):
    """A fresh slot that cannot be allocated (an out-of-memory error) fails that call before its replay; a loop
    that skips the batch and goes on keeps every later loss right, and no kept loss is overwritten: the host's
    count and the device's stay together."""
    _, w, _ = _inputs(0)
    w.requires_grad_()
    real_slot, failing = graph_replay._RingSlot, [False]

    def slot(tensor):
        if failing[0]:
            failing[0] = False
            raise torch.OutOfMemoryError("a stand-in for the allocator's")
        return real_slot(tensor)

    monkeypatch.setattr(graph_replay, "_RingSlot", slot)
    kept, inputs, failed = [], [], 0
    for seed in range(3 * graph_replay.LOSS_SLOTS):
        x, _, t = _inputs(seed + 1)
        failing[0] = seed == graph_replay.LOSS_SLOTS + 4  # slots are held (all losses kept): this call swaps one
        try:
            loss = fused_linear_cross_entropy(x, w, t)
        except torch.OutOfMemoryError:
            failed += 1
            continue
        loss.backward()
        w.grad = None
        kept.append(loss.detach())
        inputs.append((x, t))
    assert failed == 1
    ring = _ring_of_the_only_graph()
    assert ring.next == int(ring.counter) % graph_replay.LOSS_SLOTS
    set_cuda_graphs("off")
    for held, (x, t) in zip(kept, inputs):
        torch.testing.assert_close(held, fused_linear_cross_entropy(x, w.detach(), t), rtol=0, atol=0)


def test_a_new_weight_is_a_new_key(cpu_graphs):
    x, w, t = _inputs(0)
    for _ in range(2):
        fused_linear_cross_entropy(x, w, t)
    w2 = w.clone()
    for _ in range(2):
        fused_linear_cross_entropy(x, w2, t)
    assert cpu_graphs == [w.data_ptr(), w2.data_ptr()]


def test_least_recently_used_graphs_are_dropped_and_a_churning_key_stops_capturing(cpu_graphs):
    x, _, t = _inputs(0)
    weights = [torch.randn(40, 8) for _ in range(graph_replay.MAX_GRAPHS + 1)]
    for _ in range(graph_replay.MAX_CAPTURES_PER_KEY + 1):
        for w in weights:
            for _ in range(2):
                fused_linear_cross_entropy(x, w, t)
    assert graph_replay.graph_count() <= graph_replay.MAX_GRAPHS
    assert max(cpu_graphs.count(w.data_ptr()) for w in weights) == graph_replay.MAX_CAPTURES_PER_KEY


def test_failed_capture_runs_uncaptured_once_and_is_not_retried(cpu_graphs, monkeypatch, caplog):
    calls = []

    def failing(fn, device, stream, **options):
        calls.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graph_replay, "_captured", failing)
    x, w, t = _inputs(0)
    expected = fused_linear_cross_entropy(x, w, t)
    with caplog.at_level(logging.WARNING, logger="flce_compile"):
        for _ in range(3):
            assert torch.equal(fused_linear_cross_entropy(x, w, t), expected)
    assert len(calls) == 1
    assert "capture of the fused op failed" in caplog.text


def test_dispatcher_calls_replay_unless_inductor_graph_trees_may_be_warming_up(cpu_graphs, monkeypatch):
    from flce_compile.params import LossParams, encode_params

    x, w, t = _inputs(0)
    args = (x, w, t, None, None, encode_params(LossParams()), torch.float32, False, False, False, "")
    monkeypatch.setattr(graph_replay, "_inductor_graph_trees", lambda cuda_index: True)
    for _ in range(3):
        torch.ops.flce.fused_linear_cross_entropy(*args)
    assert not cpu_graphs
    with graph_replay.allowed():  # a caller that knows (the flce backend's own graphs)
        for _ in range(2):
            torch.ops.flce.fused_linear_cross_entropy(*args)
    assert len(cpu_graphs) == 1
    monkeypatch.setattr(graph_replay, "_inductor_graph_trees", lambda cuda_index: False)
    w2 = w.clone()
    args = (x, w2) + args[2:]
    for _ in range(2):
        torch.ops.flce.fused_linear_cross_entropy(*args)
    assert len(cpu_graphs) == 2
    with graph_replay.disabled():
        fused_linear_cross_entropy(x, w, t)
        fused_linear_cross_entropy(x, w2, t)
    assert len(cpu_graphs) == 2


@pytest.mark.parametrize("manager, expected", [(None, False), (object(), True), (RuntimeError("tls"), True)])
def test_inductor_graph_trees_read_from_the_tree_manager(monkeypatch, manager, expected):
    """A CUDA device's answer comes from Inductor's tree manager of this thread; an error reading it counts as
    trees being there (no replay)."""
    from torch._inductor import cudagraph_trees

    def get_manager(device_index, create_if_none_exists=True):
        assert device_index == 0 and create_if_none_exists is False
        if isinstance(manager, Exception):
            raise manager
        return manager

    monkeypatch.setattr(cudagraph_trees, "get_manager", get_manager)
    assert graph_replay._inductor_graph_trees(0) is expected
    assert graph_replay._inductor_graph_trees(-1) is False


def test_per_token_losses_and_kept_logits_are_not_graphed(cpu_graphs):
    x, w, t = _inputs(0)
    for _ in range(3):
        fused_linear_cross_entropy(x, w, t, reduction="none")
    assert not cpu_graphs


@pytest.mark.parametrize("text, mode", [("1", "on"), ("off", "off"), ("AUTO", "auto"), ("bogus", "auto"),
                                        ("0", "off")])
def test_mode_from_the_environment(monkeypatch, text, mode):
    monkeypatch.setenv(graph_replay.ENV_VAR, text)
    assert graph_replay._mode_from_env() == mode


def test_set_cuda_graphs_names_the_argument_on_a_bad_mode():
    with pytest.raises(ValueError, match="set_cuda_graphs"):
        set_cuda_graphs("sometimes")
    set_cuda_graphs(True)
    assert graph_replay.cuda_graphs_mode() == "on"
    set_cuda_graphs("auto")


@pytest.mark.parametrize("inner, mode, options, ok", [
    ("inductor", None, {}, True),
    ("inductor", "reduce-overhead", {}, False),
    ("inductor", "max-autotune", {}, False),
    ("inductor", "max-autotune-no-cudagraphs", {}, True),
    ("inductor", None, {"triton.cudagraphs": True}, False),
    ("aot_eager", None, {}, True),
    ("cudagraphs", None, {}, False),
])
def test_backend_allows_replay_only_without_cuda_graphs_of_the_inner_compiler(inner, mode, options, ok):
    assert no_cuda_graphs_of_its_own(FLCEOptions(inner=inner), mode, options) is ok


def test_backward_scaling_is_replayed_from_the_second_backward_on(cpu_graphs, monkeypatch):
    """Backward's scaling of a replayed forward's outputs by grad_output is itself captured (at the instance's
    second backward) and gives the uncaptured results, for grad_output 1 and not."""
    _, w, _ = _inputs(0)
    w.requires_grad_()
    steps = [(_inputs(s)[::2], factor) for s, factor in zip(range(1, 7), (1.0, 0.5, 1 / 3, 3.0, 1.0, 0.1))]
    replayed = []  # per backward of the replayed forward: whether a graph scaled it
    real = graph_replay._Graph.scale_grads
    monkeypatch.setattr(graph_replay._Graph, "scale_grads",
                        lambda self, *args: replayed.append(real(self, *args)) or replayed[-1])

    def run():
        out = []
        for (x, t), factor in steps:
            x = x.clone().requires_grad_()
            (fused_linear_cross_entropy(x * 1, w, t) * factor).backward()
            out.append((x.grad.clone(), w.grad.clone()))
            w.grad = None
        return out

    graphed = run()
    (instance,) = instances()
    # step 1 warms up, step 2 captures the forward (its backward runs uncaptured), step 3 captures the scaling;
    # the later ones replay it, or the graph reading grad_output in place where the allocator's address repeated.
    # (Counted per backward: the replays of the graphs themselves miss a direct graph an address repeated later
    # replaced, which happened in one CI run.)
    assert instance.scale_graph is not None and replayed == [False, True, True, True, True], replayed
    set_cuda_graphs("off")
    for a, b in zip(graphed, run()):
        for u, v in zip(a, b):
            assert torch.equal(u, v)


def _steps_with_gradients(w, grads, before=lambda step: None):
    """One step per gradient: ``before(step)``, forward on fresh inputs, ``backward(grads[step])``; returns each
    step's (dx, dw) copies."""
    out = []
    for step, g in enumerate(grads):
        before(step)
        x, _, t = _inputs(step + 1)
        x.requires_grad_()
        fused_linear_cross_entropy(x, w, t).backward(g)
        out.append((x.grad.clone(), w.grad.clone()))
        w.grad = None
    return out


def test_backward_scaling_reads_a_settled_grad_output_where_it_lies(cpu_graphs):
    """Once two backwards in a row got grad_output at one address, the scaling replays a graph that reads it
    there, without copying it: the value there may change in place between calls; a grad_output elsewhere goes
    back to the copying graph. Every result is the uncaptured one."""
    _, w, _ = _inputs(0)
    w.requires_grad_()
    settled, elsewhere = torch.ones(()), torch.ones(())
    steps = [(settled, 1.0), (settled, 1.0), (settled, 0.5), (settled, 3.0), (elsewhere, 0.25), (settled, 1 / 3)]

    def run():
        return _steps_with_gradients(w, [g for g, _ in steps], before=lambda i: steps[i][0].fill_(steps[i][1]))

    graphed = run()
    (instance,) = instances()
    # backward 2 (step 3) captures the copying graph; backward 3 (step 4) finds grad_output where backward 2 had
    # it and captures the in-place one; step 5 copies; step 6 is back at the settled address
    assert instance.scale_graph.replays == 2 and instance.direct_graph.replays == 2
    assert instance.direct_at == (settled.data_ptr(), torch.float32) and instance.direct_captures == 1
    assert len(repr(instance)) < 300  # not the outputs' storages, element by element
    set_cuda_graphs("off")
    for a, b in zip(graphed, run()):
        for u, v in zip(a, b):
            assert torch.equal(u, v)


def test_a_negative_view_at_the_settled_address_is_copied_not_read_in_place(cpu_graphs):
    """``z.conj().imag`` lies where ``z.imag`` does, with the same dtype, but reads as its negation: the graph
    reading grad_output in place would see the memory, +2, so such a grad_output takes the copying graph."""
    _, w, _ = _inputs(0)
    w.requires_grad_()
    z = torch.tensor(1 + 2j)
    grads = [z.imag] * 4 + [z.conj().imag]
    assert grads[-1].data_ptr() == grads[0].data_ptr() and grads[-1].is_neg()

    def run():
        return _steps_with_gradients(w, grads)

    graphed = run()
    (instance,) = instances()
    assert instance.direct_graph.replays == 1 and instance.scale_graph.replays == 2
    set_cuda_graphs("off")
    for a, b in zip(graphed, run()):
        for u, v in zip(a, b):
            assert torch.equal(u, v)


def test_a_grad_output_the_scaling_graph_cannot_read_is_scaled_by_the_ops_kernels(cpu_graphs, shortcut_hits):
    """A grad_output of a tensor subclass (a Parameter here) reaching the eager shortcut's backward once the
    scaling graph was captured: the graph, which reads plain memory, is skipped, and the op's own scaling gives
    the uncaptured results."""
    from flce_compile import eager_shortcut

    hits = shortcut_hits(eager_shortcut, "replay", first="replay_recent")
    _, w, _ = _inputs(0)
    w.requires_grad_()
    grads = [torch.ones(())] * 3 + [torch.nn.Parameter(torch.tensor(0.5), requires_grad=False)]

    def run():
        return _steps_with_gradients(w, grads)

    graphed = run()
    (instance,) = instances()
    # step 1 warms up, step 2 captures the forward, step 3 the scaling; step 4 replays the forward through the
    # shortcut, but not the scaling
    assert hits[-1] is True and instance.scale_graph.replays == 1 and instance.direct_graph is None
    set_cuda_graphs("off")
    for a, b in zip(graphed, run()):
        for u, v in zip(a, b):
            assert torch.equal(u, v)


def test_a_grad_output_without_memory_to_read_is_scaled_by_the_ops_kernels(cpu_graphs):
    """A sparse grad_output (autograd lets one through for a dense loss) has no data pointer for the scaling graph
    to read: it takes the op's own scaling, with the uncaptured results (it raised before)."""
    _, w, _ = _inputs(0)
    w.requires_grad_()
    grads = [torch.ones(())] * 3 + [torch.tensor(0.5).to_sparse()]
    graphed = _steps_with_gradients(w, grads)
    set_cuda_graphs("off")
    for a, b in zip(graphed, _steps_with_gradients(w, grads)):
        for u, v in zip(a, b):
            assert torch.equal(u, v)


def test_a_graph_key_hashes_as_its_tuple_and_a_copy_hashes_afresh():
    import pickle

    key = graph_replay.GraphKey(("cuda", (2048, 768), torch.bfloat16, "params"))
    plain = tuple(key)
    assert hash(key) == hash(plain) and key == plain and {plain: 1}[key] == 1
    key._hash = 0  # as a key pickled in another process would carry its hash of strings
    copy = pickle.loads(pickle.dumps(key))
    assert type(copy) is graph_replay.GraphKey and hash(copy) == hash(plain)


def test_no_backward_capture_once_graphs_are_off(cpu_graphs):
    """A forward replayed before ``set_cuda_graphs("off")`` scales its gradients uncaptured in a backward after
    it: "off" means no capture anywhere (a capture briefly puts torch's CUDA generator in capture mode)."""
    _, w, _ = _inputs(0)
    w.requires_grad_()
    grad = torch.ones(())
    for s in range(3):  # warm-up, forward captured, scaling captured
        x, _, t = _inputs(s + 1)
        fused_linear_cross_entropy(x, w, t).backward(grad)
    (instance,) = instances()
    w.grad = None
    x, _, t = _inputs(4)
    loss = fused_linear_cross_entropy(x, w, t)  # replayed
    set_cuda_graphs("off")
    grad.fill_(0.5)
    loss.backward(grad)  # the second backward in a row with grad at one address: would capture the in-place graph
    assert instance.direct_graph is None and instance.scale_graph.replays == 1
    expected_w = w.detach().clone().requires_grad_()
    fused_linear_cross_entropy(x, expected_w, t).backward(grad)
    assert torch.equal(w.grad, expected_w.grad)


def _two_places():
    (xa, _, ta), (xb, _, tb) = _inputs(1), _inputs(2)
    return (xa, ta), (xb, tb)


def _addresses(place):
    return place[0].data_ptr(), place[1].data_ptr(), place[1].dtype


def test_inputs_where_the_last_call_had_them_are_read_in_place_and_never_elsewhere(cpu_graphs, shortcut_hits):
    """A call with its hidden states and targets where the key's last call had them replays a graph that reads
    them there, with no copies (values changed in place are read); inputs elsewhere get a copying graph again,
    in the bound one's place. Every result is the uncaptured one."""
    from flce_compile import eager_shortcut

    hits = shortcut_hits(eager_shortcut, "replay", first="replay_recent")
    _, w, _ = _inputs(0)
    w.requires_grad_()
    a, b = _two_places()
    graphed, bound = steps_at(w, [a, a, a, a, b, a])
    # step 1 warms up; step 2 has its inputs where step 1 had them: captured reading them in place; step 5's
    # are elsewhere: captured copying them (through the shortcut), and step 6 copies too (its last call was at b)
    assert bound == [[], [_addresses(a)], [_addresses(a)], [_addresses(a)], [None], [None]]
    assert hits == [False, False, True, True, True, True]
    assert len(cpu_graphs) == 2 and instances()[0].x is not None
    set_cuda_graphs("off")
    a, b = _two_places()
    expected, _ = steps_at(w, [a, a, a, a, b, a])
    for got, want in zip(graphed, expected):
        for u, v in zip(got, want):
            assert torch.equal(u, v)


def test_a_key_whose_inputs_keep_moving_binds_a_bounded_number_of_times(cpu_graphs):
    _, w, _ = _inputs(0)
    w.requires_grad_()
    a, b = _two_places()
    places = [a, a, b, b] * 3
    graphed, bound = steps_at(w, places)
    # bound at a, b, a (MAX_BINDS), each undone by the next move; from then on the copying graph takes them all
    at_a, at_b = _addresses(a), _addresses(b)
    assert graph_replay.MAX_BINDS == 3 and len(cpu_graphs) == 2 * graph_replay.MAX_BINDS
    assert bound == [[]] + [[at] for at in (at_a, None, at_b, None, at_a, None)] + [[None]] * 5
    set_cuda_graphs("off")
    a, b = _two_places()
    expected, _ = steps_at(w, [a, a, b, b] * 3)
    for got, want in zip(graphed, expected):
        for u, v in zip(got, want):
            assert torch.equal(u, v)


def _graphed_and_off(run):
    """``run()`` with graphs on (the fixture's), then off; asserts every result equal; returns what run() did."""
    graphed = run()
    set_cuda_graphs("off")
    for got, want in zip(graphed, run()):
        for u, v in zip(got, want):
            assert torch.equal(u, v)
    return graphed


def test_targets_of_another_dtype_or_a_negative_view_are_never_read_in_place(cpu_graphs):
    """A bound graph reads memory: int32 targets lying where its int64 ones did (a freed block handed on, here a
    view), int32 targets in a loop (the full path converts them, so the graph's are int64), or a negative view of
    its hidden states (their memory, negated) must each be converted or copied, not read as they lie."""
    _, w, _ = _inputs(0)
    w.requires_grad_()

    def run():
        x, _, t = _inputs(1)
        _, _, other = _inputs(2)
        labels = other.clamp(min=0).int()
        out = []

        def step(xx, tt):
            loss = fused_linear_cross_entropy(xx, w, tt)
            loss.backward()
            out.append((loss.detach().clone(), w.grad.clone()))
            w.grad = None

        x.requires_grad_()
        for _ in range(3):  # int64 targets: bound at x, t from the second call on
            step(x, t)
        t32 = t.view(torch.int32)[:t.numel()]  # int32 labels in t's memory
        t32.copy_(labels)
        for _ in range(3):
            step(x, t32)
        for _ in range(2):
            step(torch._neg_view(x), t32)
        return out

    _graphed_and_off(run)


def test_a_failed_capture_again_drops_the_instance_and_later_calls_copy(cpu_graphs, monkeypatch, caplog):
    """When capturing a bound instance anew as a copying one fails, the instance is dropped, the key binds no more,
    and the call takes the full path, which captures a copying instance: it then takes inputs anywhere."""
    failures = [1]
    real = graph_replay._capture

    def capture(ops, run, stream, **options):
        if options.get("pool_of") is not None and failures:
            failures.pop()
            raise torch.OutOfMemoryError("injected")
        return real(ops, run, stream, **options)

    monkeypatch.setattr(graph_replay, "_capture", capture)
    _, w, _ = _inputs(0)
    w.requires_grad_()
    a, b = _two_places()
    with caplog.at_level(logging.WARNING, logger="flce_compile"):
        graphed, bound = steps_at(w, [a, a, b, b, a, b])
    assert "its inputs are copied from now on" in caplog.text
    assert bound == [[], [_addresses(a)]] + [[None]] * 4
    set_cuda_graphs("off")
    a, b = _two_places()
    expected, _ = steps_at(w, [a, a, b, b, a, b])
    for got, want in zip(graphed, expected):
        for u, v in zip(got, want):
            assert torch.equal(u, v)


def test_a_capture_again_allocates_from_the_replaced_graphs_pool_and_an_interrupt_leaves_nothing_retired(
        cpu_graphs, monkeypatch):
    """A capture that replaces an instance allocates from the old forward graph's memory pool (first captures get
    a new one); an interrupt during it (Ctrl-C while Triton compiles) leaves no retired instance in the cache
    (its ``free`` would fail, and read storages that are gone, on every later call of the key)."""
    pools = []
    stand_in = graph_replay._captured

    def captured(fn, device, stream, *, outputs=True, pool=None):
        if outputs:  # the forward's captures
            pools.append(pool)
        return stand_in(fn, device, stream, outputs=outputs, pool=pool)

    monkeypatch.setattr(graph_replay, "_captured", captured)
    _, w, _ = _inputs(0)
    w.requires_grad_()
    a, b = _two_places()
    steps_at(w, [a, a])  # warm-up, then captured bound
    (bound,) = instances()
    steps_at(w, [b])  # elsewhere: captured again, copying, in the bound one's pool
    assert pools == [None, bound.graph]
    real = graph_replay._capture

    def interrupted(ops, run, stream, **options):
        if options.get("pool_of") is not None:
            raise KeyboardInterrupt
        return real(ops, run, stream, **options)

    monkeypatch.setattr(graph_replay, "_capture", interrupted)
    with pytest.raises(KeyboardInterrupt):
        steps_at(w, [b])  # where the copying instance's last call was: bound anew, interrupted
    assert instances() == []
    twin = (a[0].detach().clone(), a[1].clone())
    with graph_replay.disabled():
        expected, _ = steps_at(w, [twin])
    graphed, _ = steps_at(w, [a])  # the key works again: captured anew
    assert len(instances()) == 1
    for u, v in zip(graphed[0], expected[0]):
        assert torch.equal(u, v)


_PARAMS = encode_params(LossParams())


def _random_calls(seed: int, toggles: random.Random | None) -> list[torch.Tensor]:
    """A random sequence of eager calls (some through the dispatcher) and backwards, the same for a given
    ``seed``: hidden states and targets that stay put (values changed in place) or move, int64 or int32 targets in
    one memory, negative views of the hidden states, 3-D inputs, two weights, up to two forwards pending and their
    backwards in any order, gradients kept or dropped.
    ``toggles`` (graphed run only) adds ``clear()`` and graphs off for a few calls. Returns what each step got."""
    rng = random.Random(seed)
    weights = [_inputs(50 + k)[1].requires_grad_() for k in range(2)]
    # (hidden states, the targets' memory, the labels): the labels go into that memory as int64 or int32, as a
    # freed block of the allocator takes either
    places = [[_inputs(s)[0].requires_grad_(), torch.empty(12, dtype=torch.int64), _inputs(s)[2]]
              for s in range(1, 3)]
    pending, got, off_until = [], [], -1
    for step in range(60):
        if toggles is not None:
            if toggles.random() < 0.05:
                graph_replay.clear()
            if toggles.random() < 0.05:
                set_cuda_graphs("off")
                off_until = step + toggles.randrange(1, 4)
            if step == off_until:
                set_cuda_graphs("on")
        if not pending or (len(pending) < 2 and rng.random() < 0.3):
            place = places[0 if rng.random() < 0.8 else 1]
            if rng.random() < 0.1:  # the inputs move
                place[0], place[1] = place[0].detach().clone().requires_grad_(), place[1].clone()
            x, memory, labels = place
            with torch.no_grad():
                x.mul_(1.0 + 0.01 * rng.random())
            t = memory.view(torch.int32)[:12] if rng.random() < 0.3 else memory
            t.copy_(labels)
            x_in = torch._neg_view(x) if rng.random() < 0.15 else x  # at x's address, the value -x
            if rng.random() < 0.15:  # through the dispatcher, as a compiled graph calls the op (int64 targets)
                memory.copy_(labels)
                loss, _lse, dx, dw, _db, scale = torch.ops.flce.fused_linear_cross_entropy(
                    x_in.detach(), weights[0].detach(), memory, None, None, _PARAMS, torch.float32, True, True,
                    False, "")
                got += [loss.clone(), dx * scale, dw * scale]
                continue
            if rng.random() < 0.3:
                x_in, t = x_in.view(3, 4, -1), t.view(3, 4)
            w = weights[0 if rng.random() < 0.9 else 1]
            loss = fused_linear_cross_entropy(x_in, w, t)
            got.append(loss.detach().clone())
            pending.append((loss, x, w))
            if len(pending) > 2:
                pending.pop(0)
        else:
            loss, x, w = pending.pop(rng.randrange(len(pending)))
            loss.backward()
            got += [x.grad.clone(), w.grad.clone()]
            if rng.random() < 0.7:
                x.grad = None
            if rng.random() < 0.6:
                w.grad = None
    set_cuda_graphs("on" if toggles is not None else "off")
    return got


@pytest.mark.parametrize("seed", range(10))
def test_random_call_sequences_match_the_uncaptured_op(cpu_graphs, seed):
    """The replay policy as a whole (instances, binds and their replacements, shortcuts, scaling graphs,
    ``clear()``, graphs off and on) against the uncaptured op, bit for bit."""
    graphed = _random_calls(seed, random.Random(1000 + seed))
    assert len(cpu_graphs) > 0
    set_cuda_graphs("off")
    expected = _random_calls(seed, None)
    assert len(graphed) == len(expected)
    for step, (u, v) in enumerate(zip(graphed, expected)):
        assert torch.equal(u, v), step


def test_backend_wrapper_allows_replay_only_inside_the_compiled_call_and_keeps_boxed_calls():
    from flce_compile.compiler.backend import _AllowGraphReplay

    seen = []

    def compiled(args):
        seen.append(graph_replay._caller.allowed)
        if args == ["boom"]:
            raise RuntimeError("boom")
        return args

    compiled._boxed_call = True
    wrapped = _AllowGraphReplay(compiled)
    assert wrapped._boxed_call is True
    assert wrapped([1]) == [1]
    with pytest.raises(RuntimeError, match="boom"):
        wrapped(["boom"])
    assert seen == [True, True] and graph_replay._caller.allowed is False
