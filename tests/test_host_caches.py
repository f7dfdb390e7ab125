"""The caches of the op's host path (issue #13): each answers only for what decides its answer, and the tuning DB
changing (rewritten file, registry change) is still honoured; the direct call (no dispatcher round trip) gives
the dispatcher's results and steps aside wherever something intercepts operators."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flce_compile
from flce_compile import api, op
from flce_compile.params import LossParams, encode_params
from flce_compile.plan import choose, registry, tuning_db
from flce_compile.plan.config import FLCEConfig
from flce_compile.tuning import db

CUDA = torch.device("cuda")


def entry(chunk: int, tokens: int = 16384, vocab: int = 151936, hidden: int = 4096) -> db.Entry:
    return db.Entry(device="h200", vocab=vocab, hidden=hidden, dtype="bf16", tokens=tokens,
                    config=FLCEConfig(strategy="triton", chunk_tokens=chunk, block_v=8192, num_warps=8), ms=10.0)


@pytest.fixture
def dbs(tmp_path, monkeypatch):
    """A private user DB and an empty shipped directory; the CUDA device is an H200 by name only (the lookup
    needs no GPU)."""
    user = tmp_path / "user" / "tuning_db.json"
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setenv(db.ENV_USER_DB, str(user))
    monkeypatch.setenv(db.ENV_SHIPPED_DIR, str(shipped))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    db.invalidate_cache()
    yield user
    db.invalidate_cache()


def op_config(config: str = "", tokens: int = 16384, vocab: int = 151936, hidden: int = 4096,
              dtype: torch.dtype = torch.bfloat16, device: torch.device = CUDA) -> FLCEConfig:
    return choose.op_config(config, tokens, vocab, hidden, dtype, device)


def test_op_config_is_cached_and_keyed_by_everything_that_decides_it(dbs, monkeypatch):
    db.write_entries(dbs, [entry(512), entry(4096, vocab=32000, hidden=2048)])
    assert op_config().chunk_tokens == 512
    calls = []
    resolve = choose._resolve
    monkeypatch.setattr(choose, "_resolve", lambda *a: calls.append(a) or resolve(*a))
    assert op_config() == op_config() and calls == []  # cached: no second resolution
    # Each argument is part of the key: a different one is resolved afresh, to its own answer.
    assert op_config(vocab=32000, hidden=2048).chunk_tokens == 4096
    assert op_config(dtype=torch.float64).strategy == "torch"  # no fp64 in the DB, no Triton for fp64
    assert op_config(device=torch.device("cpu")).strategy == "torch"  # the CPU heuristic
    assert op_config('{"chunk_tokens": 1024}').chunk_tokens == 1024
    assert op_config(tokens=100, vocab=999, hidden=64).chunk_tokens == 256  # heuristic: no entry near
    assert len(calls) == 5
    assert op_config().chunk_tokens == 512 and len(calls) == 5


def test_op_config_follows_a_rewritten_db(dbs, monkeypatch):
    """A user DB rewritten by another process is picked up by the op's cache once the DB notices (RECHECK_S),
    and at once after invalidate_cache."""
    now = [1000.0]
    monkeypatch.setattr(tuning_db, "_clock", lambda: now[0])
    db.write_entries(dbs, [entry(512)])
    assert op_config().chunk_tokens == 512
    # Rewritten behind the reader's back (no invalidate_cache: as by another process), with a new mtime.
    dbs.write_text(dbs.read_text().replace('"chunk_tokens": 512', '"chunk_tokens": 2048'))
    os.utime(dbs, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert op_config().chunk_tokens == 512  # within RECHECK_S: the DB itself has not looked yet
    now[0] += tuning_db.RECHECK_S + 0.001
    assert op_config().chunk_tokens == 2048
    db.write_entries(dbs, [entry(1024)])  # the writer invalidates: seen at once
    assert op_config().chunk_tokens == 1024


def test_op_config_follows_the_registry(dbs):
    """A strategy registered after a config was cached changes the heuristic's pick (here: a toy one that names
    the CPU), so the cache must miss."""
    cpu = torch.device("cpu")
    assert op_config(device=cpu).strategy == "torch"
    toy = registry.Strategy(name="toy_cpu", summary="toy", params=("chunk_tokens",),
                            ce_step="flce_compile.strategies.ce_torch:ce_step_torch",
                            fp32_temporaries=lambda softcap: 2, devices=("cpu",))
    registry.register(toy)
    try:
        assert op_config(device=cpu).strategy == "toy_cpu"
    finally:
        registry.unregister("toy_cpu")
    assert op_config(device=cpu).strategy == "torch"


def test_config_arg_is_keyed_by_value_and_type():
    assert api.config_arg(None) == ""
    assert api.config_arg({"chunk_tokens": 64}) == '{"chunk_tokens": 64}'
    assert api.config_arg({"chunk_tokens": 64}) == '{"chunk_tokens": 64}'  # cached
    assert api.config_arg({"chunk_tokens": 128}) == '{"chunk_tokens": 128}'
    assert api.config_arg({"streams": True}) == '{"streams": true}'
    # Equal in Python, but 1 is not a bool: the cached answer for True must not hide the error.
    with pytest.raises(ValueError, match="must be True or False"):
        api.config_arg({"streams": 1})
    with pytest.raises(ValueError, match="must be True or False"):
        api.config_arg({"streams": 1})  # errors are not cached either
    full = FLCEConfig(chunk_tokens=32)
    assert api.config_arg(full) == full.to_json()
    assert api.config_arg('{"chunk_tokens": 8}') == '{"chunk_tokens": 8}'
    with pytest.raises(ValueError):  # unhashable: not cached, validated (and refused) every time
        api.config_arg({"chunk_tokens": [1]})


def _inputs(n=12, h=8, v=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64)
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = -100
    return x, w, t


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("return_logits", [False, True])
def test_direct_call_equals_the_dispatcher(reduction, return_logits, monkeypatch):
    """The direct call and the registered op run the same body: identical losses and gradients, bit for bit."""
    if return_logits and reduction == "none":
        pytest.skip("return_logits needs mean or sum")
    x, w, t = _inputs()

    def run():
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = flce_compile.fused_linear_cross_entropy(xg, wg, t, reduction=reduction, config={"chunk_tokens": 5},
                                                      return_logits=return_logits)
        loss = out[0] if return_logits else out
        (loss.sum() + (out[1].square().mean() if return_logits else 0)).backward()
        return loss, xg.grad, wg.grad

    direct = run()
    monkeypatch.setattr(op, "direct_call_ok", lambda *tensors: False)
    dispatched = run()
    for a, b in zip(direct, dispatched):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_direct_call_steps_aside_for_modes_and_meta():
    x, w, t = _inputs()
    assert op.direct_call_ok(x, w, t, None, None)
    assert op.direct_call_ok(x, torch.nn.Parameter(w), t, None, None)  # an lm_head's weight
    assert not op.direct_call_ok(x.to("meta"), w, t, None, None)

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        assert not op.direct_call_ok(x, w, t, None, None)
        flce_compile.fused_linear_cross_entropy(x, w, t)
    assert any("flce.fused_linear_cross_entropy" in name for name in seen)  # the mode saw the op, as before


def test_a_leaked_functorch_wrapper_goes_through_the_registered_op():
    """A tensor leaked out of torch.func.grad is a dead functorch wrapper of plain type: the direct call must
    leave it to the registered op (Function.apply's Python wrapper would have unwrapped it), and backward works."""
    x, w, t = _inputs()
    leaked = []

    def f(x):
        y = x * 2
        leaked.append(y)
        return y.sum()

    torch.func.grad(f)(x)
    assert not op.direct_call_ok(leaked[0], w, t, None, None)
    wg = w.clone().requires_grad_()
    flce_compile.fused_linear_cross_entropy(leaked[0], wg, t).backward()
    wp = w.clone().requires_grad_()
    torch.nn.functional.cross_entropy((x * 2) @ wp.t(), t).backward()
    torch.testing.assert_close(wg.grad, wp.grad)


def test_cached_encodings_change_with_the_options():
    """Different loss options give different op arguments (a stale cached encoding would compute another loss)."""
    x, w, t = _inputs()
    base = flce_compile.fused_linear_cross_entropy(x, w, t)
    smoothed = flce_compile.fused_linear_cross_entropy(x, w, t, label_smoothing=0.1)
    summed = flce_compile.fused_linear_cross_entropy(x, w, t, reduction="sum")
    assert len({float(base), float(smoothed), float(summed)}) == 3
    assert encode_params(LossParams(label_smoothing=0.1)) != encode_params(LossParams())


def test_params_arg_is_keyed_by_value_and_type_and_skips_tensors():
    """The memoised loss options: equal options share one answer; a tensor scale is read afresh every call."""
    first = api._params_arg(-100, "mean", 0.1, None, 1.0, 0.0)
    assert api._params_arg(-100, "mean", 0.1, None, 1.0, 0.0) is first  # cached
    assert first == (LossParams(label_smoothing=0.1), encode_params(LossParams(label_smoothing=0.1)))
    assert api._params_arg(-100, "mean", 0.1, 30.0, 1.0, 0.0)[0].softcap == 30.0
    assert api._params_arg(-100, "mean", 0.1, float("inf"), 1.0, 0.0)[0].softcap == 0.0  # an infinite cap is none
    assert api._params_arg(True, "mean", 0.0, None, 1.0, 0.0)[0].ignore_index == 1
    scale = torch.tensor(2.0)
    assert api._params_arg(-100, "mean", 0.0, None, scale, 0.0)[0].logit_scale == 2.0
    scale.fill_(3.0)  # changed in place: a memoised answer would still say 2.0
    assert api._params_arg(-100, "mean", 0.0, None, scale, 0.0)[0].logit_scale == 3.0
    x, w, t = _inputs()
    scaled = [float(flce_compile.fused_linear_cross_entropy(x, w, t, logit_scale=scale)) for _ in range(2)]
    scale.fill_(1.0)
    assert float(flce_compile.fused_linear_cross_entropy(x, w, t, logit_scale=scale)) != scaled[0] == scaled[1]


def test_direct_call_adds_one_backward_node():
    """A 2-D input is not reshaped (a view would add a node to every backward) and the direct call's node has
    one output, the loss; a 3-D input still gets its view, and equal gradients."""
    x, w, t = _inputs()
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = flce_compile.fused_linear_cross_entropy(xg, wg, t)
    nodes = [fn for fn, _ in loss.grad_fn.next_functions if fn is not None]
    assert [type(fn).__name__ for fn in nodes] == ["AccumulateGrad", "AccumulateGrad"]
    assert {id(fn.variable) for fn in nodes} == {id(xg), id(wg)}
    loss.backward()
    x3 = x.clone().view(3, 4, 8).requires_grad_()
    w3 = w.clone().requires_grad_()
    loss3 = flce_compile.fused_linear_cross_entropy(x3, w3, t.view(3, 4))
    loss3.backward()
    torch.testing.assert_close(loss3, loss, rtol=0, atol=0)
    torch.testing.assert_close(x3.grad.view(12, 8), xg.grad, rtol=0, atol=0)
    torch.testing.assert_close(w3.grad, wg.grad, rtol=0, atol=0)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("valid", [0, 1, 3, 7, 1000, 1023, 1025, 3000])
def test_scales_kernel_equals_the_torch_scales(valid, split, reduction):
    """kernels.scales (the GPU's one-launch factors; here in the Triton interpreter) writes exactly the factors
    of the torch ops, all-ignored batches included, with the mean's power of two split out (fp16) or not."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        device = "cuda"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        device = "cpu"
    else:
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    from flce_compile.kernels.scales import loss_scales
    from flce_compile.strategies import chunked

    n = max(valid, 1) + 37
    t = torch.randint(0, 50, (n,), device=device)
    t[valid:] = -7
    t = t[torch.randperm(n, device=device)]
    p = LossParams(ignore_index=-7, reduction=reduction)
    z, post, loss_factor, weight_sum = loss_scales(t, p.ignore_index, 50, split=split, reduction=reduction)
    expected = chunked._gradient_scales(*chunked._reduction_scales(t, None, p, 50, torch.float32), reduction, split)
    for got, want in ((z, expected.ce), (z, expected.z), (post, expected.post)):
        assert got.item() == want.item()
    assert weight_sum.item() == 50.0
    assert post.untyped_storage().data_ptr() != z.untyped_storage().data_ptr()  # grad_scale has its own memory
    if reduction == "sum":  # every factor 1, 0 without a valid token; the loss's too (a sum over nothing is 0)
        assert z.item() == post.item() == loss_factor.item() == (1.0 if valid else 0.0)
        return
    assert (loss_factor.isnan().item() if valid == 0 else loss_factor.item() == post.item())
    if not split:  # the whole 1/count in the gradient: grad_scale is 1 (backward's scale is skipped), 0 without a
        # valid token (backward's factor is then 0 whatever grad_output is: chunked.output_factor)
        assert post.item() == (1.0 if valid else 0.0)
        assert z.item() == torch.tensor(1 / max(valid, 1) if valid else 0.0).item()
    assert post.untyped_storage().data_ptr() != z.untyped_storage().data_ptr()  # grad_scale has its own memory


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("valid", [0, 5])
@pytest.mark.parametrize("return_logits", [False, True])
def test_triton_strategy_with_the_scales_kernel_is_bit_identical(valid, return_logits, reduction, monkeypatch):
    """The Triton strategy (interpreter on the CPU) with the kernel's factors gives the loss and gradients of the
    torch ops' factors, bit for bit, a fully masked batch included."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    from flce_compile.strategies import chunked

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1)
    x = torch.randn(13, 16, generator=g).to(device, torch.bfloat16)
    w = torch.randn(64, 16, generator=g).to(device, torch.bfloat16)
    t = torch.randint(0, 64, (13,), generator=g).to(device)
    t[valid:] = -100

    def run(kernel: bool):
        monkeypatch.setattr(chunked, "_use_scales_kernel", lambda dev: kernel)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = flce_compile.fused_linear_cross_entropy(xg, wg, t, config={"strategy": "triton", "chunk_tokens": 5},
                                                      return_logits=return_logits, reduction=reduction)
        loss = out[0] if return_logits else out
        (loss * (math.inf if valid == 0 else 1.0)).backward()  # a fully masked batch: zeros whatever grad_output
        return loss, xg.grad, wg.grad

    for a, b in zip(run(True), run(False)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_forward_ad_takes_the_dispatcher_path_which_refuses_it():
    """Dual tensors (forward-mode AD) take the dispatcher path, as before the direct call (the direct body's out=
    GEMMs would raise on them); there the op refuses them, since a torch.library op without a jvp rule gives a
    tangent of 0 (test_op_reliability)."""
    import torch.autograd.forward_ad as fwAD

    from flce_compile import fused_linear_cross_entropy
    from flce_compile.op import direct_call_ok

    x, w = torch.randn(8, 4), torch.randn(10, 4)
    t = torch.randint(0, 10, (8,))
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.randn_like(x))
        assert not direct_call_ok(dual, w, t)
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            fused_linear_cross_entropy(dual, w, t)
    assert direct_call_ok(x, w, t)


def test_a_db_pick_of_a_recompute_strategy_runs_the_heuristic_unless_forced(monkeypatch):
    """The loop is fixed at trace time from the forced fields, so an unforced call must not get a strategy of
    the recompute loop from the tuning DB; a forced one keeps it."""
    from flce_compile.plan import choose
    from flce_compile.plan.config import FLCEConfig

    picked = FLCEConfig(strategy="recompute", chunk_tokens=256, vocab_block=512)
    monkeypatch.setattr(choose, "_resolve", lambda forced, *a: (
        FLCEConfig(**{**picked.to_dict(), **dict(forced)}), "tuning_db:test"))
    monkeypatch.setattr(choose, "_OP_CONFIGS", {})
    args = (4096, 32000, 1024, torch.bfloat16, torch.device("cpu"))
    assert choose.op_config("", *args).strategy != "recompute"
    assert choose.op_config('{"strategy": "recompute"}', *args).strategy == "recompute"


@pytest.mark.parametrize("name", ["fused_linear_cross_entropy", "fused_linear_cross_entropy_with_logits",
                                  "fused_linear_cross_entropy_backward"])
def test_registered_ops_have_plain_cpu_and_cuda_kernels(name):
    """The bodies are the ops' CPU and CUDA kernels themselves (``op._KERNELS``), not behind custom_op's Python
    layers (a second kernel lookup and an aliasing check on every call, ~5-8 us on the CPU): the op in a compiled
    graph goes through the dispatcher on every call. Same results through both (opcheck elsewhere checks the
    aliasing)."""
    qualname = f"flce::{name}"
    for key in ("CPU", "CUDA"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key), key
    if name == "fused_linear_cross_entropy":
        from flce_compile import op
        from flce_compile.params import LossParams, encode_params

        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(8, 4, generator=g), torch.randn(16, 4, generator=g)
        t = torch.randint(0, 16, (8,), generator=g)
        args = (x, w, t, None, None, encode_params(LossParams()), torch.float32, True, True, False, "")
        through_dispatcher = torch.ops.flce.fused_linear_cross_entropy.default(*args)
        direct = op._fused_forward_body(*args)
        for a, b in zip(through_dispatcher, direct):
            assert torch.equal(a, b)


def test_a_memoised_cpu_config_of_a_triton_strategy_follows_triton_interpret(monkeypatch):
    """op_config memoised the verdict of whether a Triton strategy can run off the GPU, which TRITON_INTERPRET
    decides at each call: with the variable unset afterwards, a repeated call still got the config (and would
    have met Triton's own "0 active drivers" at the launch) instead of the error that names the fix."""
    from flce_compile.plan import choose

    monkeypatch.setattr(choose, "_OP_CONFIGS", {})
    args = ('{"strategy": "triton"}', 64, 1000, 32, torch.float32, torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert choose.op_config(*args).strategy == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        choose.op_config(*args)
