"""The shortcuts' C guard (``call_guard``): a call that the recent call's guard admits reuses its key without
working it out, every change the key holds still sends a call to the full path with the full path's results, a
guard that refused a call of its own key is made anew, and a torch whose guards fail the self-test keys every call
in full. On the CPU with the stand-in capture (``cpu_graphs``)."""

from __future__ import annotations

import pytest
import torch

from flce_compile import call_guard, eager_shortcut, fused_linear_cross_entropy, graph_replay, set_cuda_graphs
from flce_compile.params import LossParams, encode_params

#: The eager API's options in ``key_of``'s order, at their defaults.
_OPTIONS = (-100, "mean", 0.0, None, 1.0, 0.0, None, None, False, "exact", None)


@pytest.fixture(autouse=True)
def fresh_self_test(monkeypatch):
    """Each test asks the self-test afresh (its answer is per process), wherever its first guard is made."""
    monkeypatch.setattr(call_guard, "_usable", None)


@pytest.fixture
def eager_hits(cpu_graphs, shortcut_hits):
    return shortcut_hits(eager_shortcut, "replay", first="replay_recent")


@pytest.fixture
def guards_made(shortcut_hits):
    """Per ``call_guard.guard_of`` call (``RecentCall`` making a guard): whether it answered one."""
    return shortcut_hits(call_guard, "guard_of")


def _inputs(seed=0, n=12, h=8, v=40):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g)
    w = (torch.randn(v, h, generator=g) * 0.3).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    return x, w, t


def _step(x, w, t):
    """Forward + backward on a fresh leaf of ``x``: (loss, dx, dw) as copies; nothing of the call outlives it."""
    xl = x.clone().requires_grad_()
    loss = fused_linear_cross_entropy(xl, w, t)
    loss.backward()
    dw, w.grad = w.grad.clone(), None
    return loss.detach().clone(), xl.grad.clone(), dw


def _reference(x, w, t):
    set_cuda_graphs("off")
    try:
        return _step(x, w, t)
    finally:
        set_cuda_graphs("on")


def _equal(got, expected):
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def _recent_key():
    recent = eager_shortcut._RECENT.last
    return None if recent is None else recent[0]


def test_this_torchs_guards_pass_the_self_test():
    """On the torch CI installs the guard is in use (otherwise the shortcuts fall back to keying in full, slower)."""
    assert call_guard._self_test()
    x, w, t = _inputs()
    assert call_guard.guard_of(x, w, t) is not None


def test_guards_that_admit_what_they_must_refuse_fail_the_self_test(monkeypatch):
    class Lax:  # a torch whose tensor guards ignored strides, say
        def __init__(self, *tensors, **sizes):
            pass

        def check(self, *tensors):
            return True

    monkeypatch.setattr(call_guard, "_TensorGuards", Lax)
    monkeypatch.setattr(call_guard, "_usable", None)
    assert not call_guard._self_test()
    x, w, t = _inputs()
    assert call_guard.guard_of(x, w, t) is None


def test_a_call_the_recent_guard_admits_reuses_its_key_with_the_same_results(eager_hits):
    x, w, t = _inputs(1)
    expected = _reference(x, w.detach().requires_grad_(), t)
    eager_hits.clear()
    results = [_step(x, w, t) for _ in range(4)]
    assert eager_hits == [False, False, True, True]
    key = _recent_key()
    assert key is not None and key in eager_shortcut._ENTRIES
    # the next call's key is the recent one itself, not worked out again
    assert eager_shortcut.key_of(x.clone().requires_grad_(), w, t.clone(), None, None, _OPTIONS) is key
    for got in results:
        _equal(got, expected)


def test_a_nested_tensor_is_refused_by_the_guard_without_aborting_the_process():
    """Dynamo's C check reads a tensor's strides, which a nested tensor's C++ throws on past Python: once a training
    step had recorded a guard, a nested argument aborted the process (rc 134). Run in a child process, so that a
    regression fails this test, not the test run."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import warnings, torch
        from flce_compile import call_guard
        warnings.simplefilter("ignore")
        x, w, t = torch.zeros(4, 8), torch.zeros(16, 8), torch.zeros(4, dtype=torch.long)
        with torch.enable_grad():
            guard = call_guard.guard_of(x, w, t)
            nested = torch.nested.nested_tensor([torch.randn(2, 8)] * 2)
            print(guard.admits(x, w, t), guard.admits(nested, w, t), guard.admits(x, nested, t),
                  guard.admits(x, w.to_sparse_csr(), t), guard.admits(x, w.to_sparse(), t), guard.admits([1], w, t))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False", "False", "False", "False", "False"]


def test_sparse_nested_and_negative_tensors_after_a_recorded_call(eager_hits):
    """After calls that recorded the shortcut: a sparse weight or a nested input gets the full path's error that
    names it (key_of read their contiguity or shape first: "Sparse CSR tensors do not have is_contiguous"), and a
    negative view of the weight, at the weight's address with its shape, strides and dtype, gets its own values
    (it replayed the weight's graph, which reads +w there: 6.33 for 3.52 in a bug hunt's run)."""
    x, w, t = _inputs(2)
    for _ in range(3):
        _step(x, w, t)
    assert eager_hits[-1]
    xl = x.clone().requires_grad_()
    with pytest.raises(TypeError, match="weight must be a dense tensor, got a torch.sparse_csr one"):
        fused_linear_cross_entropy(xl, w.detach().to_sparse_csr(), t)
    nested = torch.nested.nested_tensor([x[:6], x[6:]])
    with pytest.raises(TypeError, match="input must be a dense tensor, got a nested one"):
        fused_linear_cross_entropy(nested, w, t)
    negative = torch._neg_view(w)
    assert negative.data_ptr() == w.data_ptr() and negative.stride() == w.stride()
    loss = fused_linear_cross_entropy(xl, negative, t)
    expected = torch.nn.functional.cross_entropy(x @ -w.detach().t(), t)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)


def test_what_the_guard_covers_sends_a_changed_call_to_the_full_path(eager_hits):
    """With the guard live, a call whose tensors differ in a part the guard checks (type, strides, dtype,
    requires_grad, negative bit) or whose state differs (grad mode, inference mode, autocast) does not reuse the
    key; each gets the full path's answer."""
    x, w, t = _inputs(2)
    for _ in range(3):
        _step(x, w, t)
    key = _recent_key()
    assert key is not None
    xl = x.clone().requires_grad_()
    changed = {
        "input not contiguous": (x.t().contiguous().t().requires_grad_(), w, t),
        "input gradient not asked": (x.clone(), w, t),
        "input dtype": (x.double().requires_grad_(), w, t),
        "targets dtype": (xl, w, t.int()),
        "weight a Parameter": (xl, torch.nn.Parameter(w.detach()), t),
        "input a negative view": (x.neg()._neg_view().requires_grad_(), w, t),
    }
    for name, args in changed.items():
        assert eager_shortcut.key_of(*args, None, None, _OPTIONS) is not key, name
    with torch.no_grad():
        assert eager_shortcut.key_of(xl, w, t, None, None, _OPTIONS) is None
    with torch.inference_mode(), torch.enable_grad():
        assert eager_shortcut.key_of(xl, w, t, None, None, _OPTIONS) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert eager_shortcut.key_of(xl, w, t, None, None, _OPTIONS) is None
    # torch-function modes and forward-mode AD, which the guard admits, are asked every call
    # (``op.interception_free``)
    class Passing(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passing():
        assert eager_shortcut.key_of(xl, w, t, None, None, _OPTIONS) is None
    with torch.autograd.forward_ad.dual_level():
        assert eager_shortcut.key_of(xl, w, t, None, None, _OPTIONS) is None
    # and what it does not cover is asked every call: options (1.0 == 1 but not the same option; a tensor option
    # is refused by its type, never compared by value), the weight's address
    smoothing_int = _OPTIONS[:2] + (0,) + _OPTIONS[3:]
    assert eager_shortcut.key_of(xl, w, t, None, None, smoothing_int) is not key
    two_scales = _OPTIONS[:4] + (torch.tensor([1.0, 2.0]),) + _OPTIONS[5:]
    assert eager_shortcut.key_of(xl, w, t, None, None, two_scales) is None
    other_w = w.detach().clone().requires_grad_()
    assert eager_shortcut.key_of(xl, other_w, t, None, None, _OPTIONS) is not key
    assert eager_shortcut.key_of(xl, w, t, None, None, _OPTIONS) is key

    # through the API, each changed call is right (the full path, or a shortcut of its own key)
    for name, (xa, wa, ta) in changed.items():
        if name in ("input dtype", "input a negative view"):
            continue  # (not calls a model makes: the op refuses mixed dtypes; a negative view is copied)
        expected = _reference(xa.detach(), wa.detach().requires_grad_(), ta)
        eager_hits.clear()
        xa_leaf = xa.detach().clone() if name != "input not contiguous" else xa.detach()
        got = fused_linear_cross_entropy(xa_leaf.requires_grad_(xa.requires_grad), wa, ta)
        got.backward()
        assert eager_hits == [False], name
        assert torch.equal(got.detach(), expected[0]), name
        wa.grad = None


def test_a_guard_that_refused_a_call_of_its_key_is_made_anew_and_alternating_keys_make_none(eager_hits,
                                                                                           guards_made):
    x, w, t = _inputs(3)
    for _ in range(3):
        _step(x, w, t)
    assert guards_made == [True]
    key = _recent_key()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(1, threads // 2) if threads > 1 else 2)  # torch's state, in no key
        eager_hits.clear()
        _step(x, w, t)  # the guard refuses it, its key is worked out: the same key, a guard made anew
        assert eager_hits == [True] and guards_made == [True, True]
        assert _recent_key() == key
        assert eager_shortcut.key_of(x.clone().requires_grad_(), w, t, None, None, _OPTIONS) is _recent_key()
    finally:
        torch.set_num_threads(threads)
    # two keys in turn: each keeps its guard
    x2, _, t2 = _inputs(4, n=6)
    for _ in range(3):
        _step(x2, w, t2)
    made = len(guards_made)
    eager_hits.clear()
    for _ in range(3):
        _step(x, w, t)
        _step(x2, w, t2)
    assert eager_hits == [True] * 6
    assert len(guards_made) == made + 1  # the first key's guard, made anew for the old thread count, then kept


def test_without_usable_guards_every_call_is_keyed_in_full(eager_hits, monkeypatch):
    monkeypatch.setattr(call_guard, "_usable", False)
    x, w, t = _inputs(5)
    expected = _reference(x, w.detach().requires_grad_(), t)
    eager_hits.clear()
    results = [_step(x, w, t) for _ in range(4)]
    assert eager_hits == [False, False, True, True]
    assert eager_shortcut._RECENT.last is None
    for got in results:
        _equal(got, expected)


@pytest.fixture
def body_calls(cpu_graphs, shortcut_hits, monkeypatch):
    """(call, hits, reused): ``call(x, w, t, grads)`` runs the op through the dispatcher, as a compiled graph calls
    it, and returns (loss, dx, dw) as copies; per body call, ``hits`` says whether it took the body shortcut and
    ``reused`` whether its key was the recent call's own (through the guard)."""
    hits = shortcut_hits(graph_replay, "body_shortcut_replay", first="body_shortcut_recent")
    reused = []
    real_key = graph_replay.body_shortcut_key

    def body_shortcut_key(ops, extra):
        recent = graph_replay._RECENT_BODY.last
        key = real_key(ops, extra)
        reused.append(recent is not None and key is recent[0])
        return key

    monkeypatch.setattr(graph_replay, "body_shortcut_key", body_shortcut_key)
    real_recent = graph_replay.body_shortcut_recent

    def body_shortcut_recent(*args):  # a repeat of the recent call: its key, without working it out
        result = real_recent(*args)
        if result is not None:
            reused.append(True)
        return result

    monkeypatch.setattr(graph_replay, "body_shortcut_recent", body_shortcut_recent)
    params = encode_params(LossParams())

    def call(x, w, t, grads=(True, True, False)):
        loss, _lse, dx, dw, _db, scale = torch.ops.flce.fused_linear_cross_entropy(
            x, w, t, None, None, params, torch.float32, *grads, "")
        return loss.clone(), (dx * scale).clone(), (dw * scale).clone()

    return call, hits, reused


def test_op_body_calls_the_recent_guard_admits_reuse_its_key(body_calls, guards_made):
    """The guard is made in the op's body (its dispatch keys are the body's; the self-test's answer does not depend
    on where it is first asked) and admits the next equal call there; another token count, a weight at the same
    address with other strides, other gradients asked or torch's state moved are not admitted."""
    call, hits, reused = body_calls
    x, w, t = _inputs(6)
    w = w.detach()
    set_cuda_graphs("off")
    expected = call(x, w, t)
    set_cuda_graphs("on")
    hits.clear()
    reused.clear()
    results = [call(x, w, t) for _ in range(4)]
    assert hits == [False, False, True, True] and reused == [False, False, False, True]
    assert guards_made == [True]
    # a column-major weight at the same address: a key of its own (its strides)
    w_cols = w.as_strided(w.shape, (1, w.shape[0]))
    assert w_cols.data_ptr() == w.data_ptr()
    hits.clear()
    reused.clear()
    call(x[:6], w, t[:6])
    call(x, w_cols, t)
    call(x, w, t, (True, False, False))
    results.append(call(x, w, t))  # (none of the three replayed: the first call's is still the recent key)
    assert hits == [False, False, False, True] and reused == [False, False, False, True]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(1, threads // 2) if threads > 1 else 2)  # in the guard's state only
        reused.clear()
        results.append(call(x, w, t))
        results.append(call(x, w, t))
        assert reused == [False, True] and guards_made == [True, True]  # the refused guard, made anew
    finally:
        torch.set_num_threads(threads)
    for got in results:
        _equal(got, expected)


@pytest.mark.parametrize("first", ["inference_mode", "no_grad"])
def test_op_body_calls_in_and_out_of_inference_mode_never_share_a_graph(body_calls, first):
    """In the op's body inference mode changes no dispatch key the guard sees; the body shortcut asks it itself. A
    graph captured in inference mode holds inference tensors, which a call outside it cannot write (the hidden
    states at a new address each call: an instance that copies them in)."""
    call, hits, reused = body_calls
    x, w, t = _inputs(7)
    w = w.detach()
    modes = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}
    second = "no_grad" if first == "inference_mode" else "inference_mode"
    expected = call(x, w, t, (False, False, False))[0]
    kept = []
    for mode in (first, second):
        hits.clear()
        reused.clear()
        for _ in range(4):
            kept.append(x.clone())
            with modes[mode]():
                loss = call(kept[-1], w, t, (False, False, False))[0]
            assert torch.equal(loss, expected)
        assert reused[0] is False, mode
