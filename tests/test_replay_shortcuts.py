"""The shortcuts to a replayed CUDA graph, on the CPU with the stand-in capture (``cpu_graphs``): the eager
call's (``eager_shortcut``) and the op body's (``graph_replay.body_shortcut_*``, for calls through the
dispatcher, as compiled graphs make them): which calls take them, that they get the full path's results bit
for bit, and that whatever can change between calls with equal arguments sends the call back to the full
path."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from flce_compile import eager_shortcut, fused_linear_cross_entropy, graph_replay, set_cuda_graphs
from flce_compile.params import LossParams, encode_params
from flce_compile.plan import registry
from replay_steps import instances, steps_at


@pytest.fixture
def eager_hits(cpu_graphs, shortcut_hits):
    """Whether each eager call took the eager shortcut (True) or the full path (False)."""
    return shortcut_hits(eager_shortcut, "replay", first="replay_recent")


def _inputs(seed=0, shape=(12, 8), v=40):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(v, shape[-1], generator=g) * 0.3
    t = torch.randint(0, v, shape[:-1], generator=g)
    t.view(-1)[::5] = -100
    return x, w, t


def _call(x, w, t, *, grad_x=True, grad_w=True, scale=1.0, **options):
    """One forward + backward on fresh leaves; (loss, dx, dw) as copies."""
    xl, wl = x.clone().requires_grad_(grad_x), w.clone().requires_grad_(grad_w)
    loss = fused_linear_cross_entropy(xl, wl, t, **options)
    (loss * scale).backward()
    return loss.detach().clone(), _copy(xl.grad), _copy(wl.grad)


def _copy(t):
    return None if t is None else t.clone()


def _same(a, b):
    for got, expected in zip(a, b):
        assert (got is None) == (expected is None)
        if got is not None:
            assert got.shape == expected.shape and torch.equal(got, expected)


def _reference(*args, **kwargs):
    set_cuda_graphs("off")
    try:
        return _call(*args, **kwargs)
    finally:
        set_cuda_graphs("on")


@pytest.mark.parametrize("shape", [(12, 8), (2, 6, 8)])
def test_a_call_like_a_replayed_one_takes_the_shortcut_with_the_same_results(eager_hits, shape):
    x, w, t = _inputs(shape=shape)
    w = w.requires_grad_()  # one weight, as a model's lm_head: the graph keys on its address
    expected = _reference(x, w.detach(), t, scale=3.0)
    eager_hits.clear()

    def step():
        xl = x.clone().requires_grad_()
        loss = fused_linear_cross_entropy(xl, w, t)
        (loss * 3.0).backward()
        dw, w.grad = w.grad.clone(), None
        return loss.detach().clone(), xl.grad.clone(), dw

    results = [step() for _ in range(4)]
    # first call warms up, the second captures and replays (the full path, which records the shortcut)
    assert eager_hits == [False, False, True, True]
    for got in results:
        _same(got, expected)


def test_repeats_of_the_recent_call_replay_its_instance_and_anything_else_misses(cpu_graphs, shortcut_hits):
    """A training loop's calls (hidden states and targets at the same addresses, the outputs let go between
    steps) repeat the recent call: ``replay_recent`` replays its instance, with the full path's results. A call
    it does not suit (the instance's outputs still held, hidden states elsewhere, the graphs dropped) misses and
    still gets the right results; the recent record never keeps a dropped instance alive."""
    recent = shortcut_hits(eager_shortcut, "replay_recent")
    x, w, t = _inputs(3)
    w.requires_grad_()
    set_cuda_graphs("off")
    expected, _ = steps_at(w, [(x.clone(), t)] * 5)  # each step scales x by 1.25 first
    set_cuda_graphs("on")
    recent.clear()
    got, _ = steps_at(w, [(x, t)] * 5)
    for a, b in zip(got, expected):
        _same(a, b)
    # warm-up, capture (bound: the warm-up had the inputs there), the keyed shortcut, then every repeat
    assert recent == [False, False, False, True, True]
    instance = eager_shortcut._HOT[-1]
    assert instance() is not None

    def step(x_in):
        loss = fused_linear_cross_entropy(x_in.requires_grad_(), w, t)
        loss.backward()
        return loss

    with graph_replay.disabled():  # (keeps the graphs, unlike ``_reference``)
        reference = _call(x.detach(), w.detach(), t)
    recent.clear()
    held = step(x)  # w.grad (the instance's dw) kept: the next call cannot reuse the instance
    second = step(x)
    assert recent == [True, False]
    torch.testing.assert_close(second, reference[0], rtol=0, atol=0)
    del held, second
    x.grad = w.grad = None

    elsewhere = x.detach().clone()
    with graph_replay.disabled():
        reference = _call(elsewhere, w.detach(), t)
    recent.clear()
    _same((step(elsewhere).detach(), elsewhere.grad, w.grad), reference)
    assert recent == [False]  # its inputs lie elsewhere than the instance reads them
    elsewhere.grad = w.grad = None

    graph_replay.clear()
    gc.collect()
    assert instance() is None  # dropped with the cache: the recent record held it weakly
    recent.clear()
    step(x)
    assert recent == [False]


def _training_loop(x, w, t, steps):
    """``steps`` steps on hidden states and targets that stay where they are, the gradients let go each step (as
    ``optimizer.zero_grad()`` does: a .grad kept would keep the instance's outputs held)."""
    for _ in range(steps):
        fused_linear_cross_entropy(x, w, t).backward()
        x.grad = w.grad = None


def test_what_the_recent_call_shortcut_still_asks_each_call(cpu_graphs, shortcut_hits):
    """The recent-call shortcut asks what its guard does not cover: a torch-function mode or forward-mode AD (the
    op must be seen by them), targets written in place since (checked where the full path checks them), and whether
    its instance is still in the cache (an evicted instance may outlive its place: a held output reaches it)."""
    recent = shortcut_hits(eager_shortcut, "replay_recent")
    x, w, t = _inputs(4)
    x.requires_grad_()
    w.requires_grad_()
    _training_loop(x, w, t, 5)
    assert recent[-2:] == [True, True]

    class Seen(torch.overrides.TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.funcs = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.funcs.append(func)
            return func(*args, **(kwargs or {}))

    recent.clear()
    with Seen() as mode:
        _training_loop(x, w, t, 1)
    with torch.autograd.forward_ad.dual_level():
        _training_loop(x, w, t, 1)
    assert recent == [False, False] and mode.funcs

    _training_loop(x, w, t, 2)
    bad = t.clone()
    t[0] = 10 ** 6  # in place: the same address, so the instance still reads it
    recent.clear()
    with pytest.raises(ValueError, match="class id 1000000"):
        _training_loop(x, w, t, 1)
    t.copy_(bad)

    expected = _reference(x.detach(), w.detach(), t)  # (graphs off and on again: the cache starts afresh)
    _training_loop(x, w, t, 5)
    instance = eager_shortcut._HOT[-1]()
    assert instance is not None
    with graph_replay._cache.lock:  # evicted (``_Cache.evict_beyond``) while something still holds it
        for key_instances in graph_replay._cache.graphs.values():
            if any(g is instance for g in key_instances):
                key_instances.remove(instance)
    recent.clear()
    loss = fused_linear_cross_entropy(x, w, t)  # where the evicted instance reads its inputs
    loss.backward()
    _same((loss.detach(), x.grad, w.grad), expected)
    assert recent == [False]


def test_an_eager_call_served_by_the_op_bodys_shortcut_still_records_its_own(cpu_graphs, shortcut_hits):
    """An eager call without a shortcut of its own runs the op body, where the body's recent-call shortcut may serve
    it; the eager shortcut is recorded from that replay as from any other (or every later call would run in full)."""
    hits = shortcut_hits(eager_shortcut, "replay", first="replay_recent")
    x, w, t = _inputs(4)
    x.requires_grad_()
    w.requires_grad_()
    _training_loop(x, w, t, 4)
    for _ in range(2):  # the eager table dropped (as beyond its 64 keys) while the body's record stays
        eager_shortcut.clear()
        _training_loop(x, w, t, 1)
    hits.clear()
    _training_loop(x, w, t, 3)
    assert hits == [True, True, True]


@pytest.mark.parametrize("grad_x, grad_w", [(True, False), (False, True)])
def test_one_gradient_asked(eager_hits, grad_x, grad_w):
    x, w, t = _inputs(1)
    expected = _reference(x, w, t, grad_x=grad_x, grad_w=grad_w)
    eager_hits.clear()
    w_leaf = w.clone().requires_grad_(grad_w)

    def step():  # nothing of a call outlives it (a kept loss would keep x.grad, the graph's output, alive)
        xl = x.clone().requires_grad_(grad_x)
        loss = fused_linear_cross_entropy(xl, w_leaf, t)
        loss.backward()
        dw, w_leaf.grad = _copy(w_leaf.grad), None
        return loss.detach().clone(), _copy(xl.grad), dw

    results = [step() for _ in range(3)]
    assert eager_hits == [False, False, True]
    for got in results:
        _same(got, expected)


def _live_shortcut(x, w, t, hits):
    """Calls until the shortcut of (x, w, t) with default options is recorded and taken once."""
    for _ in range(3):
        fused_linear_cross_entropy(x, w, t).backward()
        w.grad = None
    assert hits[-1] is True
    hits.clear()


def test_what_changes_between_equal_calls_sends_them_to_the_full_path(eager_hits, monkeypatch):
    x, w, t = _inputs(2)
    x.requires_grad_()
    w.requires_grad_()
    _live_shortcut(x, w, t, eager_hits)

    def call(*args, **kwargs):
        loss = fused_linear_cross_entropy(*(args or (x, w, t)), **kwargs)
        if loss.requires_grad:
            loss.backward()
        x.grad = w.grad = None
        return loss

    with graph_replay.disabled():
        call()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        call()
    with FlopCounterMode(display=False):
        call()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call()
    with torch.no_grad():
        call()
    call(label_smoothing=torch.tensor(0.1))  # a tensor option's value can change in place
    call(config={"chunk_tokens": 4})
    # a profiled call takes the shortcut, named in the trace as the op (as unprofiled calls run)
    assert eager_hits == [False] * 3 + [True] + [False] * 3
    assert any(e.name == "flce::fused_linear_cross_entropy" for e in prof.events())
    assert call() is not None and eager_hits[-1] is True  # back on the shortcut

    # other options, another weight: each a key of its own, taken once the full path recorded it
    w2 = w.detach().clone().requires_grad_()
    for args, kwargs in (((), {"label_smoothing": 0.1}), ((x, w2, t), {})):
        eager_hits.clear()
        for _ in range(3):
            call(*args, **kwargs)
        assert eager_hits == [False, False, True]

    # a new strategy registry or tuning DB may choose another config: the full path decides again (here the
    # same config, so the same graph, which it records anew)
    eager_hits.clear()
    monkeypatch.setattr(registry, "_generation", registry.generation() + 1)
    call()
    call()
    set_cuda_graphs("off")  # drops the graphs
    call()
    assert eager_hits == [False, True, False]


def test_inference_mode_calls_take_the_full_path_and_leave_other_calls_their_own_graph(eager_hits):
    """Inside inference mode (grad re-enabled) the graph holds inference tensors: its calls never take the eager
    shortcut, and a later call outside it never reaches that graph."""
    x, w, t = _inputs(7)
    w.requires_grad_()
    with torch.inference_mode(), torch.enable_grad():
        for _ in range(3):
            fused_linear_cross_entropy(x, w, t)
    assert eager_hits == [False] * 3
    expected = _reference(x, w.detach(), t)
    eager_hits.clear()

    def step():
        loss = fused_linear_cross_entropy(x, w, t)
        loss.backward()
        dw, w.grad = w.grad.clone(), None
        return loss.detach().clone(), None, dw

    for _ in range(3):
        got = step()
        _same((got[0], got[2]), (expected[0], expected[2]))
    assert eager_hits == [False, False, True]  # a graph of its own: warm-up, capture, shortcut


def test_a_generation_change_while_the_full_path_runs_records_nothing_taken_later(eager_hits, monkeypatch):
    """The config's generations are read before the full path chooses the config: a change in between (another
    thread registering a strategy, a reloaded tuning DB) leaves an entry no later call matches."""
    import flce_compile.op as op

    x, w, t = _inputs(8)
    w.requires_grad_()
    real_config = op._config
    bump = [False]

    def config(*args):
        chosen = real_config(*args)
        if bump[0]:
            monkeypatch.setattr(registry, "_generation", registry.generation() + 1)
            bump[0] = False
        return chosen

    monkeypatch.setattr(op, "_config", config)
    fused_linear_cross_entropy(x, w, t).backward()  # warm-up
    w.grad = None
    bump[0] = True
    fused_linear_cross_entropy(x, w, t).backward()  # captured and replayed, the generation moved meanwhile
    w.grad = None
    fused_linear_cross_entropy(x, w, t).backward()  # the full path again, at the new generation
    w.grad = None
    fused_linear_cross_entropy(x, w, t).backward()
    assert eager_hits == [False, False, False, True]


def test_equal_keys_with_results_still_held_get_a_second_instance(eager_hits):
    """Gradients kept across micro-batches: the held graph's outputs are never overwritten."""
    x, w, t = _inputs(3)
    w.requires_grad_()
    x2 = torch.randn_like(x)
    set_cuda_graphs("off")
    fused_linear_cross_entropy(x, w, t).backward()
    fused_linear_cross_entropy(x2, w, t).backward()
    expected = w.grad.clone()
    w.grad = None
    set_cuda_graphs("on")
    for _ in range(3):  # recorded, shortcut live
        fused_linear_cross_entropy(x, w, t).backward()
        w.grad = None
    for _ in range(3):
        fused_linear_cross_entropy(x, w, t).backward()  # w.grad holds the graph's dW
        fused_linear_cross_entropy(x2, w, t).backward()  # accumulated into it, not overwritten
        assert torch.equal(w.grad, expected)
        w.grad = None


def test_the_shortcut_checks_targets_and_refuses_a_second_backward(eager_hits):
    x, w, t = _inputs(4)
    w.requires_grad_()
    _live_shortcut(x, w, t, eager_hits)
    bad = t.clone()
    bad[1] = w.shape[0]
    with pytest.raises(ValueError, match="outside"):
        fused_linear_cross_entropy(x, w, bad)
    assert eager_hits == []  # raised inside the shortcut (the key matches): its own check, as the full path's
    loss = fused_linear_cross_entropy(x, w, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()
    w.grad = None
    loss = fused_linear_cross_entropy(x, w, t)
    with pytest.raises(RuntimeError, match="double backward"):
        loss.backward(create_graph=True)
    assert eager_hits[-2:] == [True, True]


def test_a_profiled_call_is_named_once_whether_it_takes_the_shortcut_or_falls_back(eager_hits):
    """The shortcut names a profiled call after the op only once it has an instance to replay: a call whose
    instance is still held falls back to the full path, which names it, once."""
    x, w, t = _inputs(5)
    w.requires_grad_()
    _live_shortcut(x, w, t, eager_hits)

    def op_events(prof):
        return sum(e.name == "flce::fused_linear_cross_entropy" for e in prof.events())

    for keep in (True, False):  # (first, while the key has its one instance)
        fused_linear_cross_entropy(x, w, t).backward()
        held = w.grad if keep else None  # holds the instance's dW: the next call cannot replay it
        w.grad = None
        eager_hits.clear()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fused_linear_cross_entropy(x, w, t).backward()
        w.grad = None
        del held
        assert op_events(prof) == 1 and eager_hits == [not keep]


@pytest.fixture
def body_hits(cpu_graphs, shortcut_hits):
    """Whether each op-body call took the body shortcut (True) or ran the full body (False)."""
    return shortcut_hits(graph_replay, "body_shortcut_replay", first="body_shortcut_recent")


def _op_args(x, w, t, *, smoothing=0.0, config="", grads=(True, True, False)):
    return (x, w, t, None, None, encode_params(LossParams(label_smoothing=smoothing)), torch.float32) + grads + (
        config,)


def _op_call(args):
    """The registered op through the dispatcher, as a compiled graph calls it: (loss, dx, dw) as copies."""
    loss, _lse, dx, dw, _db, scale = torch.ops.flce.fused_linear_cross_entropy(*args)
    return loss.clone(), (dx * scale).clone(), (dw * scale).clone()


def test_op_body_repeats_of_the_recent_call_replay_its_instance_and_anything_else_misses(cpu_graphs,
                                                                                           shortcut_hits):
    """Through the dispatcher (a compiled graph's calls) as for the eager call: repeats of the recent body call
    replay its instance (``body_shortcut_recent``) with the full body's results; other options, inputs elsewhere
    or dropped graphs miss it; the record never keeps a dropped instance alive."""
    recent = shortcut_hits(graph_replay, "body_shortcut_recent")
    x, w, t = _inputs(5)
    args = _op_args(x, w, t)
    set_cuda_graphs("off")
    expected = _op_call(args)
    set_cuda_graphs("on")
    for _ in range(5):
        _same(_op_call(args), expected)
    assert recent[-2:] == [True, True]  # (after warm-up, capture and the keyed shortcut)
    recent.clear()
    _op_call(_op_args(x, w, t, smoothing=0.1))  # other options: another key
    _op_call(_op_args(x.clone(), w, t))  # hidden states elsewhere than the instance reads them
    assert recent == [False, False]
    for _ in range(4):  # back on the first key: bound again (a copying capture had replaced its instance)
        _same(_op_call(args), expected)
    assert recent[-2:] == [True, True]
    instance = graph_replay._HOT_BODY[-1]
    assert instance() is not None
    graph_replay.clear()
    gc.collect()
    assert instance() is None
    recent.clear()
    _same(_op_call(args), expected)
    assert recent == [False]


def test_op_calls_like_a_replayed_one_take_the_body_shortcut_with_the_same_results(body_hits):
    x, w, t = _inputs(5)
    args = _op_args(x, w, t)
    set_cuda_graphs("off")
    expected = _op_call(args)
    set_cuda_graphs("on")
    body_hits.clear()
    results = [_op_call(args) for _ in range(4)]
    assert body_hits == [False, False, True, True]  # warm-up, capture + replay (recorded), then the shortcut
    bound = [g.bound_at for g in instances()]
    assert bound == [(x.data_ptr(), t.data_ptr(), t.dtype)]  # the capture read them where the warm-up had them
    moved = _op_args(x.clone(), w, t)  # inputs elsewhere: the shortcut captures a copying graph in its place
    results.append(_op_call(moved))
    assert body_hits[-1] and [g.bound_at for g in instances()] == [None]
    for got in results:
        _same(got, expected)


def test_what_changes_between_equal_op_calls_sends_them_to_the_full_body(body_hits, monkeypatch):
    x, w, t = _inputs(6)
    args = _op_args(x, w, t)
    for _ in range(3):
        _op_call(args)
    assert body_hits[-1] is True
    body_hits.clear()
    with graph_replay.disabled():
        _op_call(args)
    monkeypatch.setattr(graph_replay, "_inductor_graph_trees", lambda cuda_index: True)  # a tree may be warming up
    _op_call(args)
    with graph_replay.allowed():  # the flce backend's own graphs say the call may replay
        _op_call(args)
    monkeypatch.setattr(graph_replay, "_inductor_graph_trees", lambda cuda_index: False)
    assert body_hits == [False, False, True]
    body_hits.clear()
    monkeypatch.setattr(registry, "_generation", registry.generation() + 1)  # the config may differ now
    _op_call(args)
    _op_call(args)
    assert body_hits == [False, True]
    # other options, config, gradients, weight: keys of their own
    for other in (_op_args(x, w, t, smoothing=0.1), _op_args(x, w, t, config='{"chunk_tokens": 4}'),
                  _op_args(x, w, t, grads=(True, False, False)), _op_args(x, w.clone(), t)):
        body_hits.clear()
        for _ in range(3):
            _op_call(other)
        assert body_hits == [False, False, True]
    bad = t.clone()
    bad[0] = w.shape[0]
    with pytest.raises(ValueError, match="outside"):  # the targets are checked before the shortcut
        _op_call(_op_args(x, w, bad))
    graph_replay.clear()  # drops the graphs and the shortcuts
    body_hits.clear()
    _op_call(args)
    assert body_hits == [False]


#: torch's math settings a capture fixes (``graph_replay.math_settings``), each changed as a user would, or (the
#: cuBLAS ones, which the CPU build stores but never reads) through the getter the key reads.
_MATH_CHANGES = {
    "deterministic algorithms": lambda mp: torch.use_deterministic_algorithms(True),
    "tf32": lambda mp: mp.setattr(torch._C, "_get_cublas_allow_tf32", lambda: True),
    "blas library": lambda mp: mp.setattr(torch._C, "_get_blas_preferred_backend", lambda: "cublaslt"),
    # a one-chunk call (those graphs are for) runs under the user's split-K reduction flags: they were in no key,
    # so after a change the graph of before kept replaying (a bug hunt of 2026-12-06)
    "bf16 reduced-precision reductions": lambda mp: setattr(
        torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction",
        not torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction),
    "fp16 reduced-precision reductions": lambda mp: setattr(
        torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction",
        not torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction),
    # TunableOp (torch.cuda.tunable.enable) runs a GEMM's tuned solution (rocBLAS / hipBLASLt on ROCm, cuBLASLt on
    # CUDA) instead of cuBLAS's own; it, the workspace sizes and the SM carveout were in no key, so after a change
    # the graph of before kept replaying the kernels of before (an audit of 2026-12-06). The CPU build has no
    # TunableOp or workspace getters: the key's own (``graph_replay._tunableop_enabled`` ...) stand in for them.
    "TunableOp": lambda mp: mp.setattr(graph_replay, "_tunableop_enabled", lambda: True, raising=False),
    "TunableOp tuning": lambda mp: mp.setattr(graph_replay, "_tunableop_tuning", lambda: True, raising=False),
    # a size other than the current one: a CUDA build's cuBLASLt getter answers 1 << 20 by default (torch 2.15)
    "cuBLAS workspace size": lambda mp: mp.setattr(
        graph_replay, "_cublas_workspace", lambda size=graph_replay._cublas_workspace() + (1 << 20): size),
    "cuBLASLt workspace size": lambda mp: mp.setattr(
        graph_replay, "_cublaslt_workspace", lambda size=graph_replay._cublaslt_workspace() + (1 << 20): size),
    "SM carveout": lambda mp: torch._C._set_sm_carveout_experimental(8),
    # with deterministic algorithms on, a GEMM under a cuBLAS config that is not deterministic warns (warn_only)
    # or raises: a replay must not answer where the uncaptured op raises
    "deterministic warn_only": lambda mp: torch.use_deterministic_algorithms(True),
}
#: The state before the change, where it is not torch's default.
_MATH_BEFORE = {
    "TunableOp tuning": lambda mp: (mp.setattr(graph_replay, "_tunableop_enabled", lambda: True, raising=False),
                                    mp.setattr(graph_replay, "_tunableop_tuning", lambda: False, raising=False)),
    "deterministic warn_only": lambda mp: torch.use_deterministic_algorithms(True, warn_only=True),
}


def _as_pair(flag) -> tuple:
    """A reduction flag's getter value as its setter's arguments (a (reduced, split_k) pair on torch >= 2.12)."""
    return tuple(flag) if isinstance(flag, tuple) else (flag,)


@pytest.mark.parametrize("change", _MATH_CHANGES)
def test_a_math_setting_change_gets_a_graph_of_its_own(cpu_graphs, eager_hits, monkeypatch, change):
    """A capture fixes the kernels torch's math settings chose (TF32 for fp32 matmuls, say): after a change
    neither shortcut nor the full path replays the graph of before; the calls get their own."""
    x, w, t = _inputs(9)
    w.requires_grad_()
    body = _op_args(x, w.detach(), t)  # the op through the dispatcher, as a compiled graph calls it
    body_hits = []
    real = graph_replay.body_shortcut_replay

    def body_replay(*args):
        result = real(*args)
        body_hits.append(result is not None)
        return result

    monkeypatch.setattr(graph_replay, "body_shortcut_replay", body_replay)

    def calls():
        eager_hits.clear()
        for _ in range(3):
            fused_linear_cross_entropy(x, w, t).backward()
            w.grad = None
        body_hits.clear()  # (the eager calls' full path runs the op body too)
        for _ in range(3):
            _op_call(body)

    deterministic = (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled())
    flags = (torch._C._get_cublas_allow_bf16_reduced_precision_reduction(),
             torch._C._get_cublas_allow_fp16_reduced_precision_reduction())
    has_carveout = hasattr(torch._C, "_get_sm_carveout_experimental")  # (torch >= 2.7)
    if change == "SM carveout" and not has_carveout:
        pytest.skip("this torch has no SM carveout")
    carveout = torch._C._get_sm_carveout_experimental() if has_carveout else None
    try:
        _MATH_BEFORE.get(change, lambda mp: None)(monkeypatch)
        calls()
        captures = len(cpu_graphs)
        _MATH_CHANGES[change](monkeypatch)
        calls()
    finally:
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        torch._C._set_cublas_allow_bf16_reduced_precision_reduction(*_as_pair(flags[0]))
        torch._C._set_cublas_allow_fp16_reduced_precision_reduction(*_as_pair(flags[1]))
        if has_carveout:
            torch._C._set_sm_carveout_experimental(carveout)
    # each: warm-up, capture (recorded), then the new graph's shortcut
    assert eager_hits == [False, False, True] and body_hits == [False, False, True]
    assert len(cpu_graphs) == captures + 2  # the eager calls' graph and the op body's (which asks for dX too)


def test_the_math_settings_getters_are_torchs_own():
    """The TunableOp and workspace getters the key reads exist only in CUDA (and ROCm) builds; elsewhere a stand-in
    answers a constant. Their names must be those torch's own API calls, or a CUDA build would key on the
    stand-ins' constants as well. The workspace APIs are newer than torch 2.11 (the GPU machine's, and a torch the
    CPU suite runs on): there neither they nor their getters exist, and the stand-in answers."""
    import inspect

    source = inspect.getsource(graph_replay)
    for module, api, name in ((torch.cuda.tunable, "is_enabled", "_cuda_tunableop_is_enabled"),
                              (torch.cuda.tunable, "tuning_is_enabled", "_cuda_tunableop_tuning_is_enabled"),
                              (torch.backends.cuda, "cublas_workspace_size", "_cuda_getCublasWorkspaceSize"),
                              (torch.backends.cuda, "cublaslt_workspace_size", "_cuda_getCublasLtWorkspaceSize")):
        assert f'getattr(torch._C, "{name}", ' in source
        if hasattr(module, api):
            assert f"torch._C.{name}()" in inspect.getsource(getattr(module, api))
    assert graph_replay._sm_carveout is getattr(torch._C, "_get_sm_carveout_experimental", type(None))


@pytest.mark.parametrize("frozen", [0.0, False])
def test_frozen_weight_columns_of_another_type_is_refused_after_a_shortcut_too(cpu_graphs, eager_hits, frozen):
    """``frozen_weight_columns`` must be an int: 0.0 or False equal 0, so once a key was recorded the shortcut
    took them and gave a loss, where the full path raises (a bug hunt of 2026-12-06)."""
    x, w, t = _inputs(3)
    w.requires_grad_()
    for _ in range(3):  # warm-up, capture, shortcut
        fused_linear_cross_entropy(x, w, t).backward()
        w.grad = None
    assert eager_hits[-1]
    with pytest.raises(TypeError, match="must be an int .how many leading weight"):
        fused_linear_cross_entropy(x, w, t, frozen_weight_columns=frozen)
