"""backend="flce" on tiny random Hugging Face causal LMs: parity with the inner compiler alone, the graph the
inner compiler receives, dropped/kept logits, and recompiles under varying sequence length."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flce_compile.compiler import flce_backend  # noqa: E402  (registers backend="flce" in dev checkouts)
from flce_compile.compiler import hf_logging  # noqa: E402
from flce_compile.compiler.lazy_logits import LazyLogits  # noqa: E402
from flce_compile.compiler.outputs import LogitsGrad  # noqa: E402
from flce_compile.compiler.rewrite import flce_fused_loss, flce_fused_loss_keep  # noqa: E402

from benchmarks.hf_families import V, H, FamilyMissing, batch as _batch, make_model  # noqa: E402
from benchmarks.hf_families import train_step as _step  # noqa: E402

#: The families kept here (``benchmarks/hf_families.py`` sweeps them all): the common layouts, a final-logit softcap
#: (Gemma 2 and 3), a logit scale multiplied (Cohere) or divided (Granite) into the logits, a router's auxiliary
#: loss added to the cross-entropy (Mixtral), latent attention (DeepSeek V3), no attention at all (Mamba) and an
#: encoder-decoder whose logits get a bias added (BART's final_logits_bias).
FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gpt2", "phi3", "cohere", "granite", "gemma3",
            "mixtral_aux", "deepseek_v3", "mamba", "bart"]


def _make(name: str) -> torch.nn.Module:
    try:
        model = make_model(name)
    except FamilyMissing as exc:  # only a family this transformers lacks; any other error fails the test
        pytest.skip(f"transformers {transformers.__version__}: {exc}")
    if model.loss_type is None and not hf_logging.can_list():
        # A torch where the backend cannot keep GPT-2's loss in the graph (2.11; test_compiler_hf_logging covers
        # it): the family tests then test the rest with the fix the backend names.
        model.loss_type = "ForCausalLM"
    return model


class Capture:
    """An inner compiler that records the graph it receives and then runs aot_eager."""

    def __init__(self, inner: str = "aot_eager") -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.inner = inner

    def __call__(self, gm, example_inputs, **kwargs):
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs.append(gm)
        return lookup_backend(self.inner)(gm, example_inputs, **kwargs)


def _assert_same(ref, got, ref_grads, got_grads):
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert ref_grads.keys() == got_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(got_grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _logits_gemms(gm) -> int:
    """GEMMs in the graph whose output has the vocab as last dim (logits-sized)."""
    count = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in (torch._C._nn.linear, torch.nn.functional.linear, torch.matmul):
            val = n.meta.get("example_value")
            if isinstance(val, torch.Tensor) and val.shape[-1] == V:
                count += 1
    return count


@pytest.fixture(scope="module")
def reference():
    """Each family's loss and grads under the inner compiler "eager" alone (= the model run as is), once."""
    cache = {}

    def get(name):
        if name not in cache:
            model = _make(name)
            ids, labels = _batch()
            ref, grads = _step(model, model, ids, labels)
            cache[name] = (model, ids, labels, ref, grads)
        return cache[name]

    return get


@pytest.mark.parametrize("name", FAMILIES)
def test_family_drop_logits_parity_and_graph(name, reference):
    model, ids, labels, ref, ref_grads = reference(name)
    cap = Capture("eager")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": cap, "flce.logits": "drop"})
    got, grads = _step(model, compiled, ids, labels)
    assert got.logits is None
    _assert_same(ref, got, ref_grads, grads)
    gm = cap.graphs[0]
    assert _targets(gm).count(flce_fused_loss) == 1
    assert torch.nn.functional.cross_entropy not in _targets(gm)
    assert _logits_gemms(gm) == 0, gm.code
    node = next(n for n in gm.graph.nodes if n.target is flce_fused_loss)
    softcap, scale = {"gemma2": (5.0, 1.0), "gemma3": (4.0, 1.0), "cohere": (None, 0.25), "granite": (None, 0.25)
                      }.get(name, (None, 1.0))
    assert node.args[8] == (pytest.approx(softcap) if softcap else None), node.args  # absorbed into the op
    assert node.args[9] == pytest.approx(scale), node.args
    if softcap:
        assert torch.tanh not in _targets(gm)


@pytest.mark.parametrize("name, mode", [(name, "keep") for name in
                                        ["llama", "gemma2", "gpt2", "cohere", "gemma3", "mixtral_aux", "bart"]]
                         + [("llama", "materialize"), ("gemma2", "materialize"), ("bart", "materialize")])
def test_family_keep_logits_exact(name, mode, reference):
    """The logits the model returns, held through backward (``out = model(...); out.loss.backward()``): eager's,
    bit for bit. By default the graph forms none (they are computed when read: here after backward); under
    "materialize" the op computes them, once."""
    model, ids, labels, ref, ref_grads = reference(name)
    cap = Capture("eager")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": cap, "flce.logits": mode})
    got, grads = _step(model, compiled, ids, labels)
    torch.testing.assert_close(got.logits, ref.logits, rtol=0, atol=0)
    _assert_same(ref, got, ref_grads, grads)
    gm = cap.graphs[0]
    assert _logits_gemms(gm) == 0  # none, or the op computes the kept logits, once
    assert torch.nn.functional.cross_entropy not in _targets(gm)
    assert not any(n.op == "call_method" and n.target == "float" and n.meta["example_value"].shape[-1] == V
                   for n in gm.graph.nodes), "no fp32 copy of the logits"
    # Mixtral's graph reads its logits itself under torch 2.13 (the kept path); torch 2.11 breaks its MoE graph
    # elsewhere, the logits leave the head's graph unread, and they take the lazy path as the others do.
    if mode == "keep" and (name != "mixtral_aux" or flce_fused_loss_keep not in _targets(gm)):
        assert _targets(gm).count(flce_fused_loss) == 1 and flce_fused_loss_keep not in _targets(gm)
        assert type(got.logits) is LazyLogits and got.logits.computed
        assert type(got.logits.grad_fn).__name__ == "_LazyHeadBackward"
        return
    assert _targets(gm).count(flce_fused_loss_keep) == 1
    # The returned logits come from the graph detached, with the lm_head's gradient re-attached outside it:
    # the caller that never uses them gets no logits-sized zero gradient in backward.
    assert type(got.logits.grad_fn).__name__ == f"{LogitsGrad.__name__}Backward"


@pytest.mark.parametrize("mode", ["keep", "drop", "materialize"])
def test_bart_under_bf16_autocast_is_fused_and_as_exact_as_eager(mode, reference):
    """BART as the Trainer runs it with bf16=True: fp32 parameters under autocast, where the fp32
    final_logits_bias buffer promotes the bf16 logits to fp32. The op adds it to fp32 logits, so the loss and the
    lm_head's (tied) gradient is as near fp64 as eager's, or nearer, and the loss close to eager's; the returned logits are eager's, bit for bit, computed
    when read (keep) or by the graph (materialize: the loss then comes from them, the kept_logits path). The site
    was left unfused ("promotes them")."""
    import copy

    model, ids, labels, _, _ = reference("bart")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, ref_grads = _step(model, model, ids, labels)
    m64 = copy.deepcopy(model).double()
    exact, exact_grads = _step(m64, m64, ids, labels)
    cap = Capture("eager")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": cap, "flce.logits": mode})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, grads = _step(model, compiled, ids, labels)
    targets = [t for gm in cap.graphs for t in _targets(gm)]
    assert torch.nn.functional.cross_entropy not in targets
    if mode == "materialize":
        assert flce_fused_loss not in targets
        torch.testing.assert_close(got.logits, ref.logits, rtol=0, atol=0)
        _assert_same(ref, got, ref_grads, grads)
        return
    (node,) = [n for gm in cap.graphs for n in gm.graph.nodes if n.target is flce_fused_loss]
    assert node.args[12] == torch.bfloat16 and node.kwargs["wide_bias"]  # the GEMMs in bf16, as autocast's
    # Both round the head's operands to bf16, which dominates one batch's loss error against the fp64 model (ours
    # 8.7e-5 here, eager's 1.2e-4, but either may be the nearer); eager also rounds the logits.
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-4, atol=1e-4)
    head = "model.shared.weight"
    ours, eager = ((g[head].double() - exact_grads[head]).norm() for g in (grads, ref_grads))
    assert ours <= eager * 1.05, (ours, eager)
    for name, g in grads.items():  # the rest: the trunk's backward under autocast, as eager's up to its rounding
        assert (g - ref_grads[name]).norm() <= 2e-2 * ref_grads[name].norm() + 1e-6, name
    if mode == "drop":
        assert got.logits is None
        return
    assert type(got.logits) is LazyLogits and got.logits.dtype == torch.float32
    torch.testing.assert_close(got.logits, ref.logits, rtol=0, atol=0)


def test_bart_in_bf16_returns_eager_logits_bit_for_bit(reference):
    """A bf16 BART's final_logits_bias (bf16 too) is folded into the op's GEMM, rounded once; the returned logits,
    computed when read, add it after the GEMM as eager does, so they are eager's bit for bit (they differed in
    the last bit in 16% of elements: the lazy head added it inside the GEMM). The loss is close to eager's."""
    import copy

    model = copy.deepcopy(reference("bart")[0]).to(torch.bfloat16)
    ids, labels = _batch()
    ref, _ = _step(model, model, ids, labels)
    torch._dynamo.reset()
    got, _ = _step(model, torch.compile(model, backend="flce", options={"flce.inner": "aot_eager"}), ids, labels)
    assert type(got.logits) is LazyLogits and got.logits.dtype == torch.bfloat16
    assert torch.equal(got.logits, ref.logits)
    torch.testing.assert_close(got.loss, ref.loss, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("logits", ["drop", "keep"])
def test_aot_eager_inner_llama(logits, reference):
    """Through AOT autograd (the fused op's fake impl and autograd traced), vs aot_eager without the pass."""
    model, ids, labels, _, _ = reference("llama")
    torch._dynamo.reset()
    ref, ref_grads = _step(model, torch.compile(model, backend="aot_eager"), ids, labels)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": "aot_eager", "flce.logits": logits})
    got, grads = _step(model, compiled, ids, labels)
    _assert_same(ref, got, ref_grads, grads)
    assert (got.logits is None) == (logits == "drop")


def test_num_items_in_batch_sum_reduction(reference):
    model, ids, labels, _, _ = reference("llama")
    n = torch.tensor(int((labels[:, 1:] != -100).sum()))
    ref, ref_grads = _step(model, model, ids, labels, num_items_in_batch=n)
    cap = Capture("eager")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": cap, "flce.logits": "drop"})
    got, grads = _step(model, compiled, ids, labels, num_items_in_batch=n)
    _assert_same(ref, got, ref_grads, grads)
    node = next(n for n in cap.graphs[0].graph.nodes if n.target is flce_fused_loss)
    assert node.args[6] == "sum"


@pytest.mark.parametrize("logits", ["drop", "keep"])
def test_a_batch_of_prompts_only_keeps_every_gradient_zero_as_eager(logits, reference):
    """What the Trainer does with an accumulated batch whose labels are all -100: num_items_in_batch = 0, so the
    loss is 0 / 0 and grad_output inf. Eager's gradients are exactly 0 (an optimizer step changes nothing); the
    compiled model's were nan (every weight nan after the step)."""
    model, ids, _, _, _ = reference("llama")
    labels = torch.full_like(ids, -100)
    n = torch.tensor(0)
    ref, ref_grads = _step(model, model, ids, labels, num_items_in_batch=n)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", options={"flce.inner": "aot_eager", "flce.logits": logits})
    got, grads = _step(model, compiled, ids, labels, num_items_in_batch=n)
    assert ref.loss.isnan() and got.loss.isnan()
    for name, grad in grads.items():
        assert torch.equal(ref_grads[name], torch.zeros_like(grad)), name  # eager's
        assert torch.equal(grad, torch.zeros_like(grad)), name


def _count_compiles(model, seqs, backend, options=None, mark=False):
    torch._dynamo.reset()
    calls = []

    def counting(gm, example_inputs, **kw):
        calls.append(gm)
        return gm.forward

    opts = {"flce.inner": counting, "flce.logits": "drop"} if backend == "flce" else None
    compiled = torch.compile(model, backend=backend if backend == "flce" else counting, options=opts)
    losses = []
    for s in seqs:
        ids, labels = _batch(s)
        if mark:
            torch._dynamo.mark_dynamic(ids, 1)
            torch._dynamo.mark_dynamic(labels, 1)
        losses.append(compiled(input_ids=ids, labels=labels).loss)
    return len(calls), losses


def test_recompiles_under_varying_seq_len(reference):
    model = reference("llama")[0]
    seqs = [8, 12, 16, 9]
    n_flce, losses = _count_compiles(model, seqs, "flce")
    n_plain, _ = _count_compiles(model, seqs, "plain")
    assert n_flce == n_plain <= 2  # static first graph, then one automatic-dynamic graph
    n_marked, _ = _count_compiles(model, seqs, "flce", mark=True)
    assert n_marked == 1
    with torch.no_grad():
        for s, loss in zip(seqs, losses):
            ids, labels = _batch(s)
            torch.testing.assert_close(loss, model(input_ids=ids, labels=labels).loss, rtol=1e-5, atol=1e-6)


class TinyLM(torch.nn.Module):
    """Embedding -> MLP -> lm_head -> HF-style loss: few kernels, so inductor compiles it quickly on CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, H)
        self.mlp = torch.nn.Linear(H, H)
        self.lm_head = torch.nn.Linear(H, V, bias=False)

    def forward(self, ids, labels):
        logits = self.lm_head(torch.tanh(self.mlp(self.emb(ids))))
        return torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, V), labels[:, 1:].reshape(-1))


def test_inductor_inner():
    torch.manual_seed(0)
    model = TinyLM()
    ids, labels = _batch(16)
    results = []
    for backend, options in (("inductor", None), ("flce", {"flce.logits": "drop"})):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend, options=options)
        model.zero_grad(set_to_none=True)
        loss = compiled(ids, labels)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (ref, ref_g), (got, got_g) = results
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
