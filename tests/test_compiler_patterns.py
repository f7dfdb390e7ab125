"""Site matching on small hand-written modules (nanoGPT style and the other supported forms), compiled with
backend="flce" and inner "eager" (so the reference is the module run as is), plus sites that must be left alone
and explain() reports."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flce_compile.compiler as fc
from flce_compile.compiler.patterns import CHECKPOINTED_HEAD_REASON, is_checkpoint, meta_value
from flce_compile.compiler.rewrite import flce_fused_loss, flce_fused_loss_keep, flce_kept_logits_loss, run_pass

V, H = 96, 16


class Head(nn.Module):
    """A tiny trunk plus lm_head; ``loss_fn(self, x, logits_fn, targets)`` supplies the form under test."""

    def __init__(self, form, bias=False):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.proj = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, V, bias=bias)
        self.register_buffer("cw", torch.rand(V) + 0.5)
        self.ce = nn.CrossEntropyLoss(weight=torch.rand(V) + 0.5, label_smoothing=0.1, ignore_index=-1)
        self.form = form

    def forward(self, idx, targets):
        x = torch.tanh(self.proj(self.emb(idx)))
        return self.form(self, x, targets)


def nanogpt(m, x, t):
    logits = m.lm_head(x)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), t.view(-1), ignore_index=-1)


FORMS = {
    "nanogpt": nanogpt,
    "ce_module": lambda m, x, t: m.ce(m.lm_head(x).view(-1, V), t.view(-1)),
    "ncd_transpose": lambda m, x, t: F.cross_entropy(m.lm_head(x).transpose(1, 2), t, reduction="none"),
    "logits_shift": lambda m, x, t: F.cross_entropy(m.lm_head(x)[:, :-1].reshape(-1, V), t[:, 1:].reshape(-1)),
    "ellipsis_shift": lambda m, x, t: F.cross_entropy(
        m.lm_head(x)[..., :-1, :].contiguous().view(-1, V), t[..., 1:].contiguous().view(-1)),
    "to_flatten_contig": lambda m, x, t: F.cross_entropy(
        m.lm_head(x).to(torch.float32).flatten(0, 1).contiguous(), t.flatten(), reduction="sum"),
    "tied_embedding": lambda m, x, t: F.cross_entropy(F.linear(x, m.emb.weight).view(-1, V), t.view(-1)),
    "matmul_T": lambda m, x, t: F.cross_entropy((x @ m.emb.weight.T).view(-1, V), t.view(-1)),
    "einsum": lambda m, x, t: F.cross_entropy(torch.einsum("bsh,vh->bsv", x, m.emb.weight).view(-1, V), t.view(-1)),
    # the weight first, read as (H, V), with an ellipsis
    "einsum_hv_first": lambda m, x, t: F.cross_entropy(
        torch.einsum("hv, ...h -> ...v", m.emb.weight.t(), x).view(-1, V), t.view(-1)),
    "log_softmax_nll": lambda m, x, t: F.nll_loss(F.log_softmax(m.lm_head(x), dim=-1).view(-1, V), t.view(-1)),
    "scale": lambda m, x, t: F.cross_entropy((m.lm_head(x) * 0.5).view(-1, V), t.view(-1)),
    "divisor": lambda m, x, t: F.cross_entropy((m.lm_head(x) / 3.0).view(-1, V), t.view(-1)),
    "softcap": lambda m, x, t: F.cross_entropy((torch.tanh(m.lm_head(x) / 4.0) * 4.0).float().view(-1, V),
                                               t.view(-1)),
    # the number first, as nanoGPT-style code writes a softcap: c * tanh(s / c)
    "softcap_number_first": lambda m, x, t: F.cross_entropy((4.0 * torch.tanh(m.lm_head(x) / 4.0)).view(-1, V),
                                                            t.view(-1)),
    "scale_number_first": lambda m, x, t: F.cross_entropy((0.5 * m.lm_head(x)).view(-1, V), t.view(-1)),
    # c * tanh(s / c) with c < 0 is |c| * tanh(s / |c|) (tanh is odd); the op only takes softcap > 0
    "negative_softcap": lambda m, x, t: F.cross_entropy((torch.tanh(m.lm_head(x) / -4.0) * -4.0).view(-1, V),
                                                        t.view(-1)),
    "smoothing_weights": lambda m, x, t: F.cross_entropy(
        m.lm_head(x).view(-1, V), t.view(-1), weight=m.cw, label_smoothing=0.2, ignore_index=-1),
    "positional_args": lambda m, x, t: F.cross_entropy(m.lm_head(x).view(-1, V), t.view(-1), m.cw, None, -1,
                                                       None, "sum"),
    "method_forms": lambda m, x, t: F.cross_entropy(
        m.lm_head(x).float().mul(2.0).reshape(-1, V), t.reshape(-1)),
    # a vocabulary-sized tensor added to the head's output (BART's final_logits_bias), either order, (V,) or (1, V)
    "bias_add_tensor": lambda m, x, t: F.cross_entropy((m.lm_head(x) + m.cw).view(-1, V), t.view(-1)),
    "bias_add_first": lambda m, x, t: F.cross_entropy((m.cw.view(1, V) + m.lm_head(x)).view(-1, V), t.view(-1)),
    "bias_add_method": lambda m, x, t: F.cross_entropy(m.lm_head(x).add(m.cw).view(-1, V), t.view(-1)),
    # a narrower bias (bf16 on fp32 logits, which stay fp32): exact once cast up
    "bias_add_narrower": lambda m, x, t: F.cross_entropy((m.lm_head(x) + m.cw.bfloat16()).view(-1, V), t.view(-1)),
    # an fp64 head (the op computes fp64 in fp64; it was left unfused, refused by dtype)
    "float64_head": lambda m, x, t: F.cross_entropy(F.linear(x.double(), m.lm_head.weight.double()).view(-1, V),
                                                    t.view(-1)),
    # per-token log-probs as RL and preference losses pick them (the negated per-token cross-entropy), shifted
    "log_prob_gather": lambda m, x, t: torch.gather(F.log_softmax(m.lm_head(x)[:, :-1].float(), dim=-1), 2,
                                                    t[:, 1:].unsqueeze(-1)).squeeze(-1),
    "log_prob_method": lambda m, x, t: m.lm_head(x).log_softmax(-1).gather(-1, t[..., None]).squeeze(-1),
    "log_prob_take_along": lambda m, x, t: torch.take_along_dim(torch.log_softmax(m.lm_head(x), dim=-1),
                                                                t.unsqueeze(-1), dim=-1),
    "log_prob_rows": lambda m, x, t: F.log_softmax(m.lm_head(x).view(-1, V), 1).gather(1, t.view(-1, 1)) * 0.5,
    # shifted and cast after the log_softmax; an index with fewer rows than the log-probs (gather reads a prefix)
    "log_prob_shift_after": lambda m, x, t: m.lm_head(x).float().log_softmax(-1)[:, :-1].gather(
        -1, t[:, 1:, None]).squeeze(-1),
    "log_prob_prefix": lambda m, x, t: m.lm_head(x).log_softmax(-1).gather(-1, t[:, :3, None]),
    # log-probs as the picked logit minus the logsumexp (no log_softmax tensor), squeezed or with keepdim, cast and
    # shifted; and the reverse difference, the per-token cross-entropy
    "log_prob_difference": lambda m, x, t: _pick_minus_lse(m.lm_head(x)[:, :-1].float(), t[:, 1:]),
    "log_prob_difference_keepdim": lambda m, x, t: _pick_minus_lse_keepdim(m.lm_head(x), t),
    "ce_difference": lambda m, x, t: _lse_minus_pick(m.lm_head(x) * 0.5, t),
    # TRL's selective_log_softmax in fp32: the logsumexp a row at a time, stacked (Dynamo unrolls the loop)
    "log_prob_rows_stacked": lambda m, x, t: _trl_selective_log_softmax(m.lm_head(x).float(), t),
    # a view of the logits whose result is discarded: Dynamo keeps it with no user (the site was left with the
    # lm_head's GEMM in the graph, its logits taken for returned ones)
    "discarded_view": lambda m, x, t: _discarding_a_view(m.lm_head(x), t),
}


def _discarding_a_view(logits, t):
    logits.view(-1, V)  # (unused)
    return F.cross_entropy(logits.view(-1, V), t.view(-1))


def _trl_selective_log_softmax(logits, index):
    selected = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
    return selected - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])


def _pick_minus_lse(logits, t):
    return logits.gather(-1, t.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(dim=-1)


def _pick_minus_lse_keepdim(logits, t):
    return torch.gather(logits, -1, t[..., None]) - torch.logsumexp(logits, -1, keepdim=True)


def _lse_minus_pick(logits, t):
    return torch.logsumexp(logits, dim=[-1]) - torch.gather(logits, 2, t[..., None]).squeeze(dim=-1)


def _data(seq=6):
    g = torch.Generator().manual_seed(seq)
    idx = torch.randint(0, V, (2, seq), generator=g)
    t = torch.randint(0, V, (2, seq), generator=g)
    t[0, 0] = -1
    return idx, t


def _run(model, fn, idx, t):
    model.zero_grad(set_to_none=True)
    loss = fn(idx, t)
    loss.sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compile(model, **flce):
    graphs = []

    def capture(gm, example_inputs, **kw):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    options = {"flce.inner": capture, **{f"flce.{k}": v for k, v in flce.items()}}
    return torch.compile(model, backend="flce", options=options), graphs


CASES = [(f, False) for f in FORMS] + [(f, True) for f in ("nanogpt", "softcap", "logits_shift", "bias_add_tensor")]


@pytest.mark.parametrize("form,bias", CASES, ids=[f"{f}{'-bias' if b else ''}" for f, b in CASES])
def test_form_is_fused_and_exact(form, bias):
    torch.manual_seed(0)
    model = Head(FORMS[form], bias=bias)
    idx, t = _data()
    if form not in ("smoothing_weights", "positional_args", "ce_module", "nanogpt"):
        t = t.clamp_min(0)  # forms with the default ignore_index=-100 get no -1 targets
    ref, ref_g = _run(model, model, idx, t)
    compiled, graphs = _compile(model)
    got, got_g = _run(model, compiled, idx, t)
    targets = [n.target for n in graphs[0].graph.nodes]
    assert targets.count(flce_fused_loss) == 1, graphs[0].code
    heads = (torch._C._nn.linear, torch.matmul, operator.matmul, torch.einsum, torch.functional.einsum)
    assert not any(n.op == "call_function" and n.target in heads
                   and n.meta["example_value"].shape[-1] == V for n in graphs[0].graph.nodes), graphs[0].code
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert ref_g.keys() == got_g.keys()
    for name in ref_g:
        torch.testing.assert_close(got_g[name], ref_g[name], rtol=1e-4, atol=1e-6, msg=name)
    if form in ("softcap", "softcap_number_first"):
        node = next(n for n in graphs[0].graph.nodes if n.target is flce_fused_loss)
        assert node.args[8] == 4.0 and node.args[9] == 1.0


class Escaping(nn.Module):
    """nanoGPT that returns its logits too (the kept-logits path), and one whose logits feed argmax; its loss a
    cross-entropy or the mean of log-probs written as the picked logit minus the logsumexp."""

    def __init__(self, extra_use=False, difference=False):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.extra_use, self.difference = extra_use, difference

    def forward(self, idx, t):
        logits = self.lm_head(self.emb(idx))
        if self.difference:
            loss = -_pick_minus_lse(logits[:, :-1].float(), t[:, 1:]).mean()
        else:
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, V), t[:, 1:].reshape(-1), label_smoothing=0.1)
        if self.extra_use:
            return loss, (logits.argmax(-1) == t).float().mean()
        return loss, logits


@pytest.mark.parametrize("mode", ["keep", "materialize", "drop"])
@pytest.mark.parametrize("extra_use", [False, True], ids=["returned", "argmax"])
@pytest.mark.parametrize("difference", [False, True], ids=["ce", "log_prob_difference"])
def test_escaping_logits(mode, extra_use, difference):
    torch.manual_seed(0)
    model = Escaping(extra_use, difference)
    idx, t = _data()
    t = t.clamp_min(0)
    model.zero_grad()
    ref = model(idx, t)
    ref[0].backward()
    ref_g = [p.grad.clone() for p in model.parameters()]
    compiled, graphs = _compile(model, logits=mode)
    model.zero_grad()
    got = compiled(idx, t)
    got[0].backward()
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    for a, b in zip((p.grad for p in model.parameters()), ref_g):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    targets = [n.target for n in graphs[0].graph.nodes]
    if mode == "drop" and not extra_use:
        assert got[1] is None and targets.count(flce_fused_loss) == 1
    elif mode == "keep" and not extra_use:  # computed when read, outside the graph
        assert targets.count(flce_fused_loss) == 1 and torch._C._nn.linear not in targets
        torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)
    elif difference:  # per-token log-probs ('none'): taken from the logits the graph keeps, as a log_softmax's are
        torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)
        assert targets.count(flce_kept_logits_loss) == 1 and "logsumexp" not in str(graphs[0].code)
    else:
        torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)
        assert targets.count(flce_fused_loss_keep) == 1  # logits from the op itself: one GEMM, exact
        assert torch._C._nn.linear not in targets


class LogProbs(nn.Module):
    """Per-token log-probs as a preference loss picks them, the log_softmax also read by an entropy bonus (the
    kept-logits path), or the logits returned beside them."""

    def __init__(self, extra):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.extra = extra

    def forward(self, idx, t):
        logits = self.lm_head(torch.tanh(self.emb(idx)))
        log_probs = F.log_softmax(logits.float(), dim=-1)
        picked = log_probs.gather(-1, t.unsqueeze(-1)).squeeze(-1)
        if self.extra == "entropy":
            return picked - 0.1 * (log_probs.exp() * log_probs).sum(-1)
        return (picked, logits) if self.extra == "logits" else picked


@pytest.mark.parametrize("extra,path", [("entropy", None), ("logits", flce_fused_loss)])
def test_log_probs_read_elsewhere_or_returned_are_exact(extra, path):
    """Returned logits are computed when read (the pick fused); log-probs an entropy also reads stay the graph's
    (a gather of kept log-probs is no cross-entropy of them), as they do when written in place."""
    torch.manual_seed(0)
    model = LogProbs(extra)
    idx, t = _data()
    t = t.clamp_min(0)
    weights = torch.rand(t.shape)  # a per-token weighting, as advantages weight them

    def run(fn):
        model.zero_grad(set_to_none=True)
        out = fn(idx, t)
        picked = out[0] if isinstance(out, tuple) else out
        (picked * weights).sum().backward()
        return out, [p.grad.clone() for p in model.parameters()]

    ref, ref_g = run(model)
    compiled, graphs = _compile(model)
    got, got_g = run(compiled)
    targets = [n.target for n in graphs[0].graph.nodes]
    if path is None:
        assert not {flce_fused_loss, flce_kept_logits_loss} & set(targets), graphs[0].code
    else:
        assert targets.count(path) == 1, graphs[0].code
    for a, b in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_log_probs_fuse_when_the_index_rows_are_symbolic():
    """Sequence lengths that vary between calls: after Dynamo's recompile the labels' length is a symbol of its own,
    not known equal to the log-probs' (gather only needs it no larger), which left the pick unfused; the rewrite
    narrows the hidden states to the index's rows instead."""
    torch.manual_seed(0)
    emb, head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)

    def log_probs(ids, labels):
        return head(emb(ids))[:, :-1].log_softmax(-1).gather(-1, labels[:, 1:, None]).squeeze(-1)

    graphs = []

    def capture(gm, example_inputs, **kw):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(log_probs, backend="flce", options={"flce.inner": capture})
    for seq in (5, 7, 9):
        ids, labels = torch.randint(0, V, (2, seq)), torch.randint(0, V, (2, seq))
        torch.testing.assert_close(compiled(ids, labels), log_probs(ids, labels), rtol=1e-5, atol=1e-6)
    assert len(graphs) == 2 and all(flce_fused_loss in {n.target for n in g.graph.nodes} for g in graphs)
    assert "narrow" in {n.target for n in graphs[1].graph.nodes}, graphs[1].code


class WrittenAfterItsStep(nn.Module):
    """Logits scaled out of place, then written in place before the loss reads the scaled copy (``case`` "ce"),
    or log-probs taken from them before the write ("gather"), or the log-probs themselves written ("log_probs")."""

    def __init__(self, case):
        super().__init__()
        self.emb, self.lm_head, self.case = nn.Embedding(V, H), nn.Linear(H, V, bias=False), case

    def forward(self, idx, t):
        logits = self.lm_head(self.emb(idx))
        step = logits * 0.5 if self.case == "ce" else logits.log_softmax(-1)
        (step if self.case == "log_probs" else logits).mul_(2.0)
        if self.case == "ce":
            return F.cross_entropy(step.view(-1, V), t.view(-1), reduction="none"), logits
        return step.gather(-1, t.unsqueeze(-1)), logits


@pytest.mark.parametrize("case", ["ce", "gather", "log_probs"])
def test_a_write_after_the_kept_logits_were_read_is_seen(case):
    """Review cases (2026-12-03): the kept-logits loss replayed the steps after the logits where the loss ran, so
    a write to the logits after a step had read them reached the loss (max error 5.25 against eager, the
    cross-entropy before this change too); a write to log-probs before their pick was taken for the pick of their
    log_softmax (1.03 to 4.85). Both sites now stay as traced."""
    torch.manual_seed(0)
    model = WrittenAfterItsStep(case)
    idx, t = _data()
    t = t.clamp_min(0)
    with torch.no_grad():
        ref = model(idx, t)
        compiled, graphs = _compile(model)
        got = compiled(idx, t)
    assert not {flce_fused_loss, flce_kept_logits_loss} & {n.target for n in graphs[0].graph.nodes}
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


class HeadWithoutGrad(nn.Module):
    """The lm_head under ``torch.no_grad()`` (a reference model's logits), its loss outside it; ``case``: the
    loss ("ce", "gather"), or the logits also read by an argmax and written after the loss ("written_after")."""

    def __init__(self, case):
        super().__init__()
        self.emb, self.lm_head, self.case = nn.Embedding(V, H), nn.Linear(H, V, bias=False), case

    def forward(self, idx, t):
        h = torch.tanh(self.emb(idx))
        if self.case == "written_after":
            logits = self.lm_head(h)
            picked = -F.cross_entropy(logits.view(-1, V), t.view(-1), reduction="none").view(t.shape)
            accuracy = (logits.argmax(-1) == t).float().mean()
            logits.detach().mul_(3.0)
            return (picked * h.sum(-1)).sum() + accuracy
        with torch.no_grad():
            logits = self.lm_head(h)
        if self.case == "gather":
            picked = logits.log_softmax(-1).gather(-1, t[..., None]).squeeze(-1)
        else:
            picked = -F.cross_entropy(logits.view(-1, V), t.view(-1), reduction="none").view(t.shape)
        return (picked * h.sum(-1)).sum()  # differentiable through h alone


@pytest.mark.parametrize("case", ["ce", "gather", "written_after"])
def test_logits_without_grad_and_logits_written_after_the_loss_are_as_eager(case):
    """Review cases (2026-12-03): logits formed under no_grad and picked outside it got a gradient into the
    lm_head (max 4.97; eager's is None) and the hidden states (off by 1.17), the fused op running where the loss
    ran, with grad on: the cross-entropy before this change too; the op now reads detached operands there. Logits
    written after a "none" loss on the kept-logits path failed backward's version check (the loss keeps the logits
    for its backward, eager's log_softmax its output): that site stays as traced."""
    torch.manual_seed(0)
    model = HeadWithoutGrad(case)
    idx, t = _data()
    t = t.clamp_min(0)
    ref, ref_g = _run(model, model, idx, t)
    compiled, graphs = _compile(model)
    got, got_g = _run(model, compiled, idx, t)
    targets = {n.target for g in graphs for n in g.graph.nodes}
    assert (flce_fused_loss in targets) == (case != "written_after"), graphs[0].code
    assert flce_kept_logits_loss not in targets
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert ref_g.keys() == got_g.keys()
    for name in ref_g:
        torch.testing.assert_close(got_g[name], ref_g[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_log_prob_index_out_of_range_raises_as_gather_does():
    """A log-prob gather ignores no class: an index of -100 (an unmasked label) is an error, as in eager, and so
    is -2**31, the op's own "no class ignored" marker (it was read as an ignored token, log-prob 0)."""
    model = LogProbs(None)
    idx, t = _data()
    t = t.clamp_min(0)
    compiled, _ = _compile(model)
    for bad in (-100, -(2**31)):
        t_bad = t.clone()
        t_bad[0, 1] = bad
        with pytest.raises(RuntimeError, match="out of bounds"):
            model(idx, t_bad)
        with pytest.raises(RuntimeError, match=f"gather.s index holds class id {bad}, outside"):
            compiled(idx, t_bad)  # the exception eager's gather raises (it was a ValueError only)


UNSAFE = {
    "tensor_scale": lambda m, x, t: F.cross_entropy((m.lm_head(x) * m.cw).view(-1, V), t.view(-1)),
    # a bias added after a scale (the op adds its bias before the logit scale)
    "bias_add_after_scale": lambda m, x, t: F.cross_entropy((m.lm_head(x) * 2.0 + m.cw).view(-1, V), t.view(-1)),
    # promoted: the fp64 sum has another dtype than the head's logits
    "bias_add_promoting": lambda m, x, t: F.cross_entropy((m.lm_head(x) + m.cw.double()).view(-1, V), t.view(-1)),
    "vocab_slice": lambda m, x, t: F.cross_entropy(m.lm_head(x)[..., : V // 2].reshape(-1, V // 2),
                                                   t.view(-1) % (V // 2)),
    "token_mixing": lambda m, x, t: F.cross_entropy(m.lm_head(x).transpose(0, 1).reshape(-1, V), t.view(-1)),
    "nll_without_log_softmax": lambda m, x, t: F.nll_loss(m.lm_head(x).view(-1, V), t.view(-1)),
    "soft_targets": lambda m, x, t: F.cross_entropy(m.lm_head(x).view(-1, V),
                                                    F.one_hot(t.view(-1), V).float()),
    "inplace_scale": lambda m, x, t: F.cross_entropy(m.lm_head(x).mul_(2.0).view(-1, V), t.view(-1)),
    # log-probs gathered two per row, or from a log_softmax over the tokens
    "log_prob_two_per_row": lambda m, x, t: F.log_softmax(m.lm_head(x), -1).gather(-1, torch.stack([t, t], -1)),
    "log_prob_over_tokens": lambda m, x, t: F.log_softmax(m.lm_head(x), 1).gather(-1, t[..., None]),
    # take_along_dim broadcasts an index with one row over the log-probs' rows (a gather would read one row)
    "log_prob_take_along_broadcast": lambda m, x, t: torch.take_along_dim(F.log_softmax(m.lm_head(x), -1),
                                                                          t[:1, :, None], dim=-1),
    # a pick minus a logsumexp: with one row's index (the difference broadcasts it over the rows), with a
    # logsumexp that keeps its dim against a squeezed pick, and with the logsumexp also returned
    "difference_broadcast_index": lambda m, x, t: _broadcast_pick(m.lm_head(x), t),
    "difference_lse_read_elsewhere": lambda m, x, t: _difference_and_lse(m.lm_head(x), t),
    # the op's own marker of "no class ignored" as a user's ignore_index
    "ignore_index_int32_min": lambda m, x, t: F.cross_entropy(m.lm_head(x).view(-1, V), t.view(-1),
                                                              ignore_index=-(2**31)),
}


def _broadcast_pick(logits, t):
    return logits.gather(-1, t[:1, :, None]).squeeze(-1) - logits.logsumexp(-1)


def _dims_differ(logits, t):
    return logits.gather(-1, t[..., None]).squeeze(-1) - logits.logsumexp(-1, keepdim=True)


def _difference_and_lse(logits, t):
    lse = logits.logsumexp(-1)
    return (logits.gather(-1, t[..., None]).squeeze(-1) - lse) + 0.0 * lse


@pytest.mark.parametrize("form", [*UNSAFE, "difference_dims_differ"])
def test_unsafe_sites_left_alone(form, caplog):
    torch.manual_seed(0)
    if form == "difference_dims_differ":  # a squeezed pick minus a logsumexp that keeps its dim: as many tokens as
        model, (idx, t) = Head(lambda m, x, t: _dims_differ(m.lm_head(x), t)), _data(seq=2)  # rows, so it broadcasts
    else:
        model, (idx, t) = Head(UNSAFE[form]), _data()
    t = t.clamp_min(0)
    ref, _ = _run(model, model, idx, t)
    compiled, graphs = _compile(model)
    with caplog.at_level("INFO", logger="flce_compile"):
        got, _ = _run(model, compiled, idx, t)
    assert flce_fused_loss not in [n.target for n in graphs[0].graph.nodes]
    assert "not fused" in caplog.text and "rewriting loss" not in caplog.text  # rejected by the analysis
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_logits_viewed_as_another_dtype_are_left_alone():
    """``logits.view(dtype)`` reinterprets their bits (no gradient flows through it): not a reshape step, so the
    loss is not fused and gives eager's number (it was fused as a reshape, the bits' reading dropped, found by a
    review)."""
    def f(h, w, t):
        z = (h @ w.T).view(torch.int32).float() * 1e-9
        return F.cross_entropy(z.view(-1, V), t.view(-1))

    h, w, t = torch.randn(2, 4, H), torch.randn(V, H), torch.randint(0, V, (2, 4))
    (report,) = fc.explain(f, h, w, t)
    assert not report.fused and "to a dtype, which reinterprets the logits' bits" in report.reason, report.reason
    compiled, graphs = _compile(f)
    torch.testing.assert_close(compiled(h, w, t), f(h, w, t), rtol=1e-6, atol=1e-6)
    assert flce_fused_loss not in [n.target for n in graphs[0].graph.nodes]


@pytest.mark.parametrize("draw_between", [True, False], ids=["other_draw_between", "no_draw_between"])
def test_a_target_drawn_at_random_keeps_eager_draws(draw_between):
    """fused_keep moves the target's computation before the lm_head: a target drawn at random after another node
    that draws (``torch.rand``) stays where it is (the loss from the kept logits), so both draw eager's numbers
    (they were drawn in the other order, found by a review); with no draw in between it still moves."""
    def f(h, w):
        logits = h @ w.T
        noise = torch.rand(3) if draw_between else torch.zeros(3)
        t = torch.randint(0, V, (h.shape[0] * h.shape[1],))
        return F.cross_entropy(logits.view(-1, V), t), noise, t, logits.sum()  # logits read in the graph

    h, w = torch.randn(2, 4, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    torch.manual_seed(1)
    (report,) = fc.explain(f, h, w)
    assert report.path == ("kept_logits" if draw_between else "fused_keep"), report
    torch.manual_seed(1)
    ref = f(h, w)
    compiled, _ = _compile(f)
    torch.manual_seed(1)
    got = compiled(h, w)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_a_stack_of_row_logsumexps_in_another_order_is_no_log_prob():
    """The rows' logsumexps stacked in another order than the rows (here reversed) are not the logsumexp of the
    logits: the difference is left as it is, and gives eager's numbers."""
    def reversed_rows(m, x, t):
        logits = m.lm_head(x)
        lse = torch.stack([torch.logsumexp(logits[i], -1) for i in reversed(range(logits.shape[0]))])
        return logits.gather(-1, t[..., None]).squeeze(-1) - lse

    torch.manual_seed(0)
    model = Head(reversed_rows)
    idx, t = _data()
    t = t.clamp_min(0)
    ref, ref_g = _run(model, model, idx, t)
    compiled, graphs = _compile(model)
    got, got_g = _run(model, compiled, idx, t)
    assert flce_fused_loss not in [n.target for n in graphs[0].graph.nodes]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for name in ref_g:
        torch.testing.assert_close(got_g[name], ref_g[name], rtol=1e-5, atol=1e-6)


class Mutating(nn.Module):
    """A fusable site next to the user's own in-place ops, whose results nothing in the graph uses."""

    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(H, V, bias=False)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.ones(H))

    def forward(self, x, t):
        self.steps.add_(1)
        self.ema.mul_(0.5)
        return F.cross_entropy(self.lm_head(x).view(-1, V), t.view(-1))


def test_user_inplace_ops_survive_the_pass():
    """The pass removes the logits path it made dead, not the user's side effects (FX's dead-code elimination
    treats unused method calls such as ``buf.add_(1)`` as pure)."""
    model = Mutating()
    compiled, graphs = _compile(model)
    x, t = torch.randn(2, 3, H), torch.randint(0, V, (2, 3))
    for _ in range(2):
        loss = compiled(x, t)
    assert int(model.steps) == 2 and torch.equal(model.ema, torch.full((H,), 0.25))
    torch.testing.assert_close(loss, F.cross_entropy(model.lm_head(x).view(-1, V), t.view(-1)))
    nodes = graphs[0].graph.nodes
    assert [n.target for n in nodes].count(flce_fused_loss) == 1
    assert {"add_", "mul_"} <= {n.target for n in nodes if n.op == "call_method"}
    assert not any(n.op == "call_function" and n.target is torch._C._nn.linear for n in nodes), graphs[0].code


class DiscardedRead(nn.Module):
    """A read of the logits whose result the model discards but which has an effect no schema shows: a batch
    norm's running statistics, an embedding's rows renormalized under max_norm, or random draws (the loss then
    adds a draw of its own, which a dropped draw before it would change)."""

    def __init__(self, kind):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.bn = nn.BatchNorm1d(V)
        self.table = nn.Embedding(V, 4, max_norm=1.0)
        with torch.no_grad():
            self.table.weight.mul_(10.0)  # rows longer than max_norm: each row read is renormalized
        self.kind = kind

    def forward(self, idx, t):
        logits = self.lm_head(torch.tanh(self.emb(idx)))
        flat = logits.view(-1, V)
        if self.kind == "batch_norm":
            self.bn(flat)
        elif self.kind == "F.batch_norm":
            F.batch_norm(flat, self.bn.running_mean, self.bn.running_var, training=True)
        elif self.kind == "embedding_max_norm":
            self.table(logits.argmax(-1))
        elif self.kind == "gumbel_softmax":
            F.gumbel_softmax(flat)
        elif self.kind == "fractional_max_pool2d":
            F.fractional_max_pool2d(flat[None, None], 2, output_size=(3, 8))
        return F.cross_entropy(flat, t.view(-1)) + torch.rand(())


@pytest.mark.parametrize("kind", ["batch_norm", "F.batch_norm", "embedding_max_norm", "gumbel_softmax",
                                  "fractional_max_pool2d"])
def test_a_discarded_read_of_the_logits_with_an_effect_stays(kind):
    """An unused read of the logits is erased with the chain only when erasing it changes nothing: a batch norm
    in training (its running statistics), F.embedding with max_norm (the rows it renormalizes) and
    F.gumbel_softmax or F.fractional_max_pool2d (their draws) are no such reads, though their ATen names or
    schemas mark no write and no draw. They were erased: the running statistics and the table stayed as they
    were, and the loss's own draw after them drew other numbers than eager's."""
    torch.manual_seed(0)
    ref_model = DiscardedRead(kind)
    model = DiscardedRead(kind)
    model.load_state_dict(ref_model.state_dict())
    idx, t = _data()
    t = t.clamp_min(0)
    torch.manual_seed(1)
    ref = ref_model(idx, t)
    compiled, _ = _compile(model)
    torch.manual_seed(1)
    got = compiled(idx, t)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for (name, want), have in zip(ref_model.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(have, want, rtol=0, atol=0, msg=name)


def test_a_discarded_batch_norm_module_call_stays():
    """The same as a call_module node (a symbolic_trace graph): nn.BatchNorm1d in training updates its running
    statistics, which no graph node shows; the pass erased the call with the unread view."""
    from torch.fx.passes.shape_prop import ShapeProp

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(H, V)
            self.bn = nn.BatchNorm1d(V)

        def forward(self, x, t):
            logits = self.lm_head(x)
            self.bn(logits.view(-1, V))
            return F.cross_entropy(logits.view(-1, V), t.view(-1))

    torch.manual_seed(0)
    m = M()
    gm = torch.fx.symbolic_trace(m)
    x, t = torch.randn(2, 5, H), torch.randint(0, V, (2, 5))
    ShapeProp(gm).propagate(x, t)
    m.bn.reset_running_stats()
    run_pass(gm, [x, t])
    gm(x, t)
    assert "bn" in [n.target for n in gm.graph.nodes if n.op == "call_module"], gm.code
    assert m.bn.running_mean.abs().sum() > 0


def test_a_weight_renormalized_between_the_lm_head_and_the_loss_is_seen():
    """F.embedding with max_norm renormalizes, in place, the rows of its weight it reads: on the lm_head's own
    (tied) weight between the lm_head and the loss, it is a write the fused op would see, as eager's logits did
    not (the loss was fused with the renormalized weight)."""
    def f(x, w, ids, t):
        logits = x @ w.T
        rows = F.embedding(ids, w, max_norm=0.5)
        return F.cross_entropy(logits.view(-1, V), t.view(-1)), rows

    torch.manual_seed(0)
    x, w = torch.randn(2, 4, H), torch.randn(V, H) * 3
    ids, t = torch.randint(0, V, (5,)), torch.randint(0, V, (2, 4))
    ref = f(x, w.clone(), ids, t)
    compiled, _ = _compile(f)
    got = compiled(x, w.clone(), ids, t)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)


def test_inplace_ops_near_the_logits_keep_semantics():
    """In-place ops on the logits, or on the hidden states between lm_head and loss: never a wrong result."""
    torch.manual_seed(0)
    lm_head = nn.Linear(H, V, bias=False)

    def scaled_in_place(x, t):  # the loss and the returned logits both see the mutation
        logits = lm_head(x)
        logits.mul_(2.0)  # a statement: no graph node uses its result
        return F.cross_entropy(logits.view(-1, V), t.view(-1)), logits

    def scaled_in_place_loss_only(x, t):
        logits = lm_head(x)
        logits.mul_(2.0)
        return F.cross_entropy(logits.view(-1, V), t.view(-1)), t

    def hidden_mutated_after_head(x, t):  # a fused op at the loss would read the mutated hidden states
        logits = lm_head(x)
        x.add_(1.0)
        return F.cross_entropy(logits.view(-1, V), t.view(-1)), x

    for fn in (scaled_in_place, scaled_in_place_loss_only, hidden_mutated_after_head):
        x, t = torch.randn(2, 5, H), torch.randint(0, V, (2, 5))
        ref = fn(x.clone(), t)  # forward only: backward through a mutated saved input would raise
        graphs = []
        torch._dynamo.reset()
        got = torch.compile(fn, backend="flce", options={"flce.inner": lambda gm, ex, **kw: (
            graphs.append(gm), gm.forward)[1]})(x.clone(), t)
        torch.testing.assert_close(got[0], ref[0], msg=fn.__name__)
        torch.testing.assert_close(got[1], ref[1], msg=fn.__name__)
        assert flce_fused_loss not in [n.target for n in graphs[0].graph.nodes], fn.__name__
        assert sum(n.target in ("mul_", "add_") for n in graphs[0].graph.nodes) == 1, graphs[0].code


def test_autocast_region_ending_before_the_loss():
    """lm_head under autocast, loss outside it: the op computes in the lm_head's dtype, as autocast did."""
    torch.manual_seed(0)
    lm_head = nn.Linear(H, V, bias=False)

    def fn(x, t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = lm_head(x)
        return F.cross_entropy(logits.float().view(-1, V), t.view(-1))

    x, t = torch.randn(4, 8, H), torch.randint(0, V, (4, 8))
    ref = fn(x, t)
    ref.backward()
    ref_grad, lm_head.weight.grad = lm_head.weight.grad, None
    graphs = []
    torch._dynamo.reset()
    got = torch.compile(fn, backend="flce", options={"flce.inner": lambda gm, ex, **kw: (
        graphs.append(gm), gm.forward)[1]})(x, t)
    got.backward()
    node = next(n for n in graphs[0].graph.nodes if n.target is flce_fused_loss)
    assert node.args[12] == torch.bfloat16
    # fp32 logits would differ from the bf16 reference by ~1e-4
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert lm_head.weight.grad.dtype == torch.float32
    torch.testing.assert_close(lm_head.weight.grad, ref_grad, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_an_lm_head_kept_out_of_autocast_computes_in_fp32_where_its_loss_runs_under_autocast(inner):
    """The "keep the LM head in fp32" idiom: ``with autocast(enabled=False): logits = lm_head(x.float())``
    inside a bf16 region, the loss after that block (back under autocast). The fused node stands where the loss
    stood, and the op applied the autocast it found there: the head's GEMMs ran in bf16 (loss 4e-6 and
    weight gradient 2.5e-3 off eager). The op now computes in the head's dtype with autocast off."""
    torch.manual_seed(0)
    l1, lm_head = nn.Linear(H, H), nn.Linear(H, V)

    def fn(x, t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.relu(l1(x))
            with torch.autocast("cpu", enabled=False):
                logits = lm_head(h.float())
            return F.cross_entropy(logits.view(-1, V), t.view(-1))

    x, t = torch.randn(4, 16, H), torch.randint(0, V, (4, 16))
    ref = fn(x, t)
    ref.backward()
    ref_grads = [p.grad for p in (lm_head.weight, lm_head.bias)]
    lm_head.zero_grad(set_to_none=True)
    graphs = []

    def recording(gm, example_inputs, **kwargs):
        from torch._dynamo.backends.registry import lookup_backend

        graphs.append(gm)
        return lookup_backend(inner)(gm, example_inputs, **kwargs)

    torch._dynamo.reset()
    got = torch.compile(fn, backend="flce", options={"flce.inner": recording})(x, t)
    got.backward()
    assert any(n.target is flce_fused_loss for n in graphs[0].graph.nodes)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)  # bf16 GEMMs: ~4e-6 off
    for grad, ref_grad in zip((lm_head.weight.grad, lm_head.bias.grad), ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cast", ["float", "to", "none"])
def test_drop_drops_logits_returned_through_a_cast(cast):
    """``return loss, logits.float()`` (Accelerate's fp32 outputs) under ``flce.logits="drop"``: the returned cast
    is dropped with the logits (None), and the site is plainly fused. It took the kept path, forming the logits
    and their gradient buffer: more memory than the default's lazy logits, under the option that promises least."""
    torch.manual_seed(0)
    lm_head = nn.Linear(H, V, bias=False)

    def fn(x, t):
        logits = lm_head(torch.tanh(x))
        loss = F.cross_entropy(logits.view(-1, V), t.view(-1))
        returned = {"float": lambda z: z.float(), "to": lambda z: z.to(torch.float32), "none": lambda z: z}[cast]
        return loss, returned(logits)

    x, t = torch.randn(2, 8, H), torch.randint(0, V, (2, 8))
    ref = fn(x, t)[0]
    ref.backward()
    ref_grad, lm_head.weight.grad = lm_head.weight.grad, None
    graphs = []
    torch._dynamo.reset()
    inner = lambda gm, ex, **kw: (graphs.append(gm), gm.forward)[1]  # noqa: E731
    loss, logits = torch.compile(fn, backend="flce", options={"flce.logits": "drop", "flce.inner": inner})(x, t)
    loss.backward()
    assert logits is None
    targets = [n.target for n in graphs[0].graph.nodes]
    assert flce_fused_loss in targets and "float" not in targets and "to" not in targets, graphs[0].code
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(lm_head.weight.grad, ref_grad)


def test_a_graph_under_a_torch_func_transform_is_left_unfused():
    """``torch.compile(torch.func.grad(loss_fn))``: Dynamo traces the transform into the graph, and the fused op
    (which forms its gradients itself) failed the compile there. The site is left alone, with the reason."""
    from torch.func import functional_call, grad

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(H, H), nn.Tanh(), nn.Linear(H, V, bias=False))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_fn(p, x, t):
        return F.cross_entropy(functional_call(model, p, (x,)).view(-1, V), t.view(-1))

    x, t = torch.randn(2, 8, H), torch.randint(0, V, (2, 8))
    ref = grad(loss_fn)(params, x, t)
    graphs = []
    torch._dynamo.reset()
    got = torch.compile(grad(loss_fn), backend="flce", options={"flce.inner": lambda gm, ex, **kw: (
        graphs.append(gm), gm.forward)[1]})(params, x, t)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name])
    assert not any(n.target is flce_fused_loss for gm in graphs for n in gm.graph.nodes)
    from flce_compile.compiler.decide import analyze

    (site,) = analyze(graphs[0])
    assert not site.fused and "torch.func transform" in site.reason


def test_analysis_error_leaves_only_that_site_alone(monkeypatch):
    """A bug in the analysis of one site costs that site, not the others (nor explain())."""
    import flce_compile.compiler.patterns as patterns

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(H, V, bias=False)
            self.b = nn.Linear(H, V, bias=False)

        def forward(self, x, t):
            return (F.cross_entropy(self.a(x).view(-1, V), t.view(-1))
                    + F.cross_entropy(self.b(x).view(-1, V), t.view(-1)))

    real = patterns._check_linear
    calls = []

    def flaky(gm, site):
        calls.append(site)
        if len(calls) % 2 == 1:
            raise IndexError("boom")
        real(gm, site)

    monkeypatch.setattr(patterns, "_check_linear", flaky)
    model = TwoHeads()
    x, t = torch.randn(2, 3, H), torch.randint(0, V, (2, 3))
    compiled, graphs = _compile(model)
    torch.testing.assert_close(compiled(x, t), model(x, t))
    assert [n.target for n in graphs[0].graph.nodes].count(flce_fused_loss) == 1
    calls.clear()
    report = fc.explain(model, x, t)
    assert [r.fused for r in report] == [False, True] and "analysis failed" in report[0].reason


def test_call_module_forms_symbolic_trace():
    """nn.Linear / nn.CrossEntropyLoss as call_module nodes (graphs not produced by Dynamo's inlining)."""
    from torch.fx.passes.shape_prop import ShapeProp

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(H, V, bias=True)
            self.loss = nn.CrossEntropyLoss(weight=torch.rand(V) + 0.5, label_smoothing=0.1)

        def forward(self, x, t):
            return self.loss(self.lm_head(x).view(-1, V), t.view(-1))

    torch.manual_seed(0)
    m = M()
    gm = torch.fx.symbolic_trace(m)
    x, t = torch.randn(2, 5, H), torch.randint(0, V, (2, 5))
    ShapeProp(gm).propagate(x, t)
    results = run_pass(gm, [x, t]).sites
    assert [r.path for r in results] == ["fused"]
    assert not any(n.op == "call_module" for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x, t), m(x, t), rtol=1e-5, atol=1e-6)


def test_a_symbolic_label_smoothing_says_the_compile_traces_again(caplog):
    """An nn.CrossEntropyLoss module under dynamic=True: Dynamo leaves its label_smoothing a symbolic float, and
    the first trace is refused; AOT autograd (inductor, aot_eager) then specializes the float and Dynamo traces
    again, which fuses. explain shows only the first trace: its reason says so (it read "label_smoothing=item is
    not a constant number"), and the refusal is logged at INFO, not warned."""
    torch.manual_seed(0)
    model = Head(FORMS["ce_module"])
    idx, t = _data()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="flce", dynamic=True, options={"flce.inner": "aot_eager"})
    (report,) = fc.explain(compiled, idx, t)
    assert not report.fused and "traces the frame again, which fuses" in report.reason
    torch._dynamo.reset()
    with caplog.at_level("INFO", logger="flce_compile"):
        loss = compiled(idx, t)
    assert "-> fused" in caplog.text
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "label_smoothing" in r.getMessage()]
    torch.testing.assert_close(loss, model(idx, t), rtol=1e-5, atol=1e-6)


def test_explain_estimates_the_memory_against_the_ops_own():
    """The estimate is the unfused loss's logits-sized buffers less the op's working set and the dX and dW it holds
    from forward to backward (it counted the logits alone, and read "saved" where a step's peak rose: 64 tokens
    against H = 512). Many tokens: saved; fewer than about H: a cost, with what outweighs the logits."""

    def site(hidden, vocab, tokens, frozen=False):
        head = nn.Linear(hidden, vocab, bias=False).requires_grad_(not frozen)

        def fn(x, t):
            return F.cross_entropy(head(x), t)

        x, t = torch.randn(tokens, hidden, requires_grad=True), torch.randint(0, vocab, (tokens,))
        (report,) = fc.explain(fn, x, t, options={"flce.inner": "aot_eager"})
        return report

    many = site(64, 4000, 16384)  # (the CPU's heuristic runs 4096-token chunks)
    unfused = 16384 * 4000 * 12  # fp32: logits, log-softmax and its gradient
    held = (16384 * 64 + 4000 * 64) * 4  # dX and dW
    assert 0 < many.est_saved_bytes < unfused - held and "est. memory saved" in str(many)
    few = site(512, 32000, 16)
    assert few.est_saved_bytes < 0 and "est. memory cost" in str(few) and "the dX and dW the op forms" in str(few)
    frozen = site(64, 4000, 16, frozen=True)  # no dW: the working set's slack outweighs 16 tokens' logits
    assert frozen.est_saved_bytes < 0 and "a small shape: the op's working set" in str(frozen), str(frozen)


def test_explain_names_what_dynamos_counters_recorded_for_breaks_it_gave_no_reason_for():
    """A break Dynamo counts without a reason (transformers' first forward installs its output hooks, a setattr
    Dynamo cannot trace) is named from its break counters, each reason's first line with its count."""
    from collections import Counter

    from flce_compile.compiler.explain import ExplainReport, _counted_breaks

    counted = Counter({"setattr() on unsupported type\n  Explanation: ... next_id 1": 2,
                       "setattr() on unsupported type\n  Explanation: ... next_id 2": 1,
                       "Unsupported context manager\n  Explanation: lock": 4})
    assert _counted_breaks(counted) == ["Unsupported context manager (4x)", "setattr() on unsupported type (3x)"]
    report = ExplainReport()
    report.graph_count, report.graph_breaks, report.graph_break_count = 2, [], 1
    report.counted_breaks, report.notes = _counted_breaks(counted), []
    assert str(report).splitlines()[-1] == (
        '  graph break: 1 more that Dynamo gave no reason for (TORCH_LOGS="graph_breaks" names each); its break '
        "counters recorded, in this frame or the frames it calls: Unsupported context manager (4x); setattr() on "
        "unsupported type (3x)")


def test_explain_reports_sites_and_graph_breaks():
    torch.manual_seed(0)
    idx, t = _data()
    report = fc.explain(Escaping(), idx, t.clamp_min(0))
    assert len(report) == 1 and report[0].fused and report[0].path == "fused_lazy"
    assert report[0].vocab == V and report[0].hidden == H
    # 12 tokens, H = 16: the op's working set (1 MiB of allocator slack) and its dW cost more than the logits
    assert report[0].est_saved_bytes < 0 and "est. memory cost" in str(report)
    assert report[0].kept_logits_bytes == 0 and "computed when first read" in str(report)
    report = fc.explain(Escaping(), idx, t.clamp_min(0), options={"flce.logits": "materialize"})
    assert len(report) == 1 and report[0].fused and report[0].path == "fused_keep"
    assert report[0].kept_logits_bytes == 2 * 6 * V * 4  # the logits themselves, nothing more
    assert "flce.logits='materialize'" in str(report) and "'flce.logits': 'drop'" in str(report)
    # Logits an op of the graph reads (an accuracy metric) are not freed by "drop": the report says what reads
    # them and gives no such advice (it did).
    for mode in ("keep", "drop"):
        report = fc.explain(Escaping(extra_use=True), idx, t.clamp_min(0), options={"flce.logits": mode})
        assert report[0].path == "fused_keep" and report[0].logits_users == ["argmax"], str(report)
        assert "read them (argmax)" in str(report) and "'flce.logits': 'drop'} frees" not in str(report)

    def through_a_view(m, x, t):  # the reader behind a view that is also returned is named, not the view
        logits = m.lm_head(x)
        flat = logits.view(-1, V)
        return F.cross_entropy(logits.view(-1, V), t.view(-1)), flat.float(), flat.argmax(-1)

    report = fc.explain(Head(through_a_view), idx, t.clamp_min(0))
    assert report[0].logits_users == ["argmax"], str(report)

    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(H, V, bias=False)

        def forward(self, x, t):
            logits = self.lm_head(x)
            torch._dynamo.graph_break()
            return F.cross_entropy(logits.view(-1, V), t.view(-1))

    report = fc.explain(Broken(), torch.randn(2, 5, H), torch.randint(0, V, (2, 5)))
    assert not any(r.fused for r in report)
    text = str(report)
    assert "graph break" in text and "nothing to fuse" in text
    assert report.graph_breaks and report.graph_break_count == len(report.graph_breaks) == 1
    assert "1 graph break(s)" in text and "more that Dynamo gave no reason for" not in text
    # Dynamo counts breaks it gives no reason for (transformers' use_cache warning under checkpointing, found by a
    # review: explain said 0 breaks beside 2 graphs): the count is its, and a line says how many are unnamed.
    report.graph_break_count = 3
    text = str(report)
    assert "3 graph break(s)" in text and "graph break: 2 more that Dynamo gave no reason for" in text


def test_explain_tries_the_rewrite_and_reports_a_failed_one_unfused(monkeypatch, caplog):
    """explain tries the backend's rewrite on a copy of each graph: a site whose rewrite raises, or a pass that fails
    as a whole, is reported unfused, as the backend leaves it (explain only analyzed, and called such sites fused).
    The trial logs nothing, and leaves the pass's once-a-process warnings to the compile."""
    import flce_compile.compiler.rewrite as rewrite

    idx, t = _data()
    t = t.clamp_min(0)
    with caplog.at_level("INFO", logger="flce_compile"):
        (fine,) = fc.explain(Escaping(), idx, t)
    assert fine.fused and "fused_lazy" in caplog.text and "-> fused" not in caplog.text  # (the report; no pass log)

    class LossAfterBreak(nn.Module):  # an unfused site whose pass warns once a process
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(H, V, bias=False)

        def forward(self, x, t):
            logits = self.lm_head(x)
            torch._dynamo.graph_break()
            return F.cross_entropy(logits.view(-1, V), t.view(-1))

    monkeypatch.setattr(rewrite, "_warned_graph_break", False)
    assert not any(r.fused for r in fc.explain(LossAfterBreak(), torch.randn(2, 5, H), t[:, :5].contiguous()))
    assert rewrite._warned_graph_break is False  # the compile still warns

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(rewrite, "_rewrite", broken)
    (site,) = fc.explain(Escaping(), idx, t)
    assert not site.fused and site.path == "unchanged" and site.reason == "rewrite failed: RuntimeError('boom')"
    assert "NOT fused - rewrite failed" in str(site)
    monkeypatch.undo()
    monkeypatch.setattr(rewrite.OutputFixup, "apply", broken)  # after every site's rewrite: the pass fails whole
    (site,) = fc.explain(Escaping(), idx, t)
    assert not site.fused and "the fusion pass failed on this graph (RuntimeError('boom'))" in site.reason


def test_a_trial_of_the_pass_quiets_its_own_thread_and_the_compilers_modules_only():
    """The trial's quiet is its thread's, and the compiler's: a compile in another thread meanwhile logs (and warns
    once) as it would (the trial restored the once-a-process flags it found, losing a warning the other thread's
    compile had taken, a review showed), and a warning from elsewhere in the package in the trial's own thread (the
    tuning DB's, read by a budget's config choice) still shows."""
    import logging
    import threading

    import flce_compile.compiler.rewrite as rewrite
    import flce_compile.plan.tuning_db as tuning_db

    quiet = rewrite._TrialRecords()

    def record(path):
        return logging.LogRecord("flce_compile", logging.WARNING, path, 1, "m", None, None)

    ours, elsewhere = record(rewrite.__file__), record(tuning_db.__file__)
    assert quiet.filter(ours)  # no trial under way
    rewrite._trial.active = True
    try:  # in a trial the log helpers neither log nor set their flags
        assert rewrite._in_trial()
        assert not quiet.filter(ours) and quiet.filter(elsewhere)
        other = []
        thread = threading.Thread(target=lambda: other.append((rewrite._in_trial(),
                                                               quiet.filter(record(rewrite.__file__)))))
        thread.start()
        thread.join()
        assert other == [(False, True)]
    finally:
        rewrite._trial.active = False


def _explained_path(model_or_compiled, idx, t, **kw):
    report = fc.explain(model_or_compiled, idx, t, **kw)
    assert len(report) == 1
    return report.options.logits, report[0].path


def test_explain_reports_what_the_compiled_model_does():
    """explain() follows the options a model was compiled with, however it was compiled; options= overrides
    them and serves uncompiled models."""
    torch.manual_seed(0)
    idx, t = _data()
    t = t.clamp_min(0)
    model = Escaping()
    assert _explained_path(model, idx, t) == ("keep", "fused_lazy")
    assert _explained_path(model, idx, t, options={"flce.logits": "drop"}) == ("drop", "fused")
    compiled = torch.compile(model, backend="flce", options={"flce.logits": "drop", "flce.inner": "eager"})
    assert _explained_path(compiled, idx, t) == ("drop", "fused")
    assert _explained_path(compiled, idx, t, options={"flce.logits": "keep"}) == ("keep", "fused_lazy")
    assert _explained_path(compiled, idx, t, options={"flce.logits": "materialize"}) == ("materialize", "fused_keep")
    bound = torch.compile(model, backend=fc.with_options(logits="drop", inner="eager"))
    assert _explained_path(bound, idx, t) == ("drop", "fused")
    in_place = Escaping()
    in_place.compile(backend="flce", options={"flce.logits": "drop", "flce.inner": "eager"})
    assert _explained_path(in_place, idx, t) == ("drop", "fused")
    assert not hasattr(in_place, "flce_options")  # nothing stored on the model
    report = fc.explain(torch.compile(model, backend="flce", options={"flce.enabled": False}), idx, t)
    assert not report[0].fused and "flce.enabled=False" in str(report)


def test_kept_logits_loss_rejects_out_of_range_targets(monkeypatch):
    """The kept-logits loss never turns a bad class id into a finite loss: it raises on the CPU (like the fused
    op) and, where the check is skipped to avoid a host sync (GPU), the token's loss is NaN."""
    from flce_compile import kept_logits

    logits = torch.randn(2, 5, 11)
    target = torch.randint(0, 11, (2, 5))
    target[1, 2] = 11
    with pytest.raises(ValueError, match="outside"):
        kept_logits.kept_logits_cross_entropy(logits, target)
    monkeypatch.setattr(kept_logits, "check_targets", lambda *a: None)
    per_token = kept_logits.kept_logits_cross_entropy(logits, target, reduction="none")
    assert torch.isnan(per_token[1, 2]) and torch.isfinite(per_token[0]).all()
    assert torch.isnan(kept_logits.kept_logits_cross_entropy(logits, target))
    weighted = kept_logits.kept_logits_cross_entropy(logits, target, ce_weight=torch.rand(11), reduction="none")
    assert torch.isnan(weighted[1, 2]) and torch.isfinite(weighted[0]).all()


class LogitsOnly(nn.Module):
    """Returns its logits; the training loop computes the loss after the compiled code."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, idx):
        return self.lm_head(torch.tanh(self.emb(idx)))


def test_logits_returned_for_a_loss_after_the_compiled_code_are_warned_of_once(caplog, monkeypatch):
    """A compiled model whose loss the loop computes: nothing can be fused, which a training graph (logits
    requiring grad) says once at WARNING, naming the fixes (it was silent); an eval graph says so at INFO."""
    import flce_compile.compiler.rewrite as rewrite

    monkeypatch.setattr(rewrite, "_warned_graph_break", False)
    model = LogitsOnly()
    idx, t = _data()
    with caplog.at_level("INFO", logger="flce_compile"):
        with torch.no_grad():
            _compile(model)[0](idx)
        for _ in range(2):
            compiled, graphs = _compile(model)
            F.cross_entropy(compiled(idx).view(-1, V), t.clamp_min(0).view(-1)).backward()
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "no loss in this graph" in r.getMessage()]
    assert [level for level, _ in said] == ["INFO", "WARNING", "INFO"], said
    assert "Compile a function that calls the model and computes the loss" in said[1][1]
    assert flce_fused_loss not in [n.target for n in graphs[0].graph.nodes]


class WidensBeforeABreak(nn.Module):
    """An FFN's up-projection (4x, in an ``mlp``) whose output a graph break hands to the next graph, then a head
    the graph only returns: tied to the embedding (``tied``), under a name no lm_head has (``unnamed``, 3x), or an
    lm_head that is an ``nn.Sequential`` of a norm and the linear (``sequential``, 3x)."""

    def __init__(self, head):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.mlp = nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H))
        self.proj = nn.Linear(H, 3 * H, bias=False)
        self.lm_head = nn.Sequential(nn.LayerNorm(H), nn.Linear(H, 3 * H))
        self.head = head

    def forward(self, idx):
        x = self.emb(idx)
        u = self.mlp[0](x)
        torch._dynamo.graph_break()
        x = x + self.mlp[2](self.mlp[1](u))
        if self.head == "tied":
            return F.linear(x, self.emb.weight)
        return self.proj(x) if self.head == "unnamed" else self.lm_head(x)


@pytest.mark.parametrize("head", ["tied", "unnamed", "sequential"])
def test_a_widening_linear_before_a_graph_break_is_no_lone_head(head, caplog):
    """A 4x up-projection of an ``mlp`` whose output a graph break returns is not reported as an lm_head whose loss
    is computed elsewhere (it was, at WARNING); a head at least twice its input's width under any other name still
    is (a first version, keeping only names known for heads, missed the Sequential's ``lm_head.1``)."""
    model = WidensBeforeABreak(head)
    idx, _ = _data()
    with caplog.at_level("INFO", logger="flce_compile"):
        _compile(model)[0](idx)
    said = [r.getMessage() for r in caplog.records if "no loss in this graph" in r.getMessage()]
    assert len(said) == 1 and f"(V={V if head == 'tied' else 3 * H}," in said[0], said


@pytest.mark.parametrize("returned", ["logits", "view", "used"])
def test_a_checkpoint_wrapped_lm_head_whose_logits_are_returned_is_reported(returned, caplog):
    """``checkpoint_wrapper(model.lm_head)`` makes the head a checkpointed region of its own: its logits returned
    (or a view of them) for a loss after the compiled code are reported as a plain head's are (they were not:
    the region hid the linear); logits the graph goes on to use are not."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = LogitsOnly()
    model.lm_head = checkpoint_wrapper(model.lm_head)
    forward = model.forward
    if returned == "view":
        model.forward = lambda idx: forward(idx).view(-1, V)
    elif returned == "used":
        model.forward = lambda idx: forward(idx).softmax(-1)
    idx, _ = _data()
    with caplog.at_level("INFO", logger="flce_compile"):
        _compile(model)[0](idx)
    said = [r.getMessage() for r in caplog.records if "no loss in this graph" in r.getMessage()]
    if returned == "used":
        assert said == []
    else:
        assert len(said) == 1 and f"(V={V}," in said[0], said


class SequenceClassifier(nn.Module):
    """A decoder's sequence classifier as Hugging Face writes it: 3 class scores per token, each sequence's last
    token's picked with a tensor index and returned with the loss."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.score = nn.Linear(H, 3, bias=False)

    def forward(self, idx, labels):
        logits = self.score(torch.tanh(self.emb(idx)))
        pooled = logits[torch.arange(idx.shape[0]), (idx != 0).sum(-1) - 1]  # each sequence's last non-pad token
        return F.cross_entropy(pooled, labels), pooled


def test_a_sequence_classifier_gets_no_warning_nor_advice_that_cannot_help(caplog, monkeypatch):
    """Its loss is taken from the kept logits (a tensor index the op does not take): a few classes, so logged at
    INFO, and without offering flce.logits='drop' (which leaves it unfused and frees nothing: it was a WARNING
    offering it); the numbers are eager's."""
    import flce_compile.compiler.rewrite as rewrite

    model = SequenceClassifier()
    idx, _ = _data()
    labels = torch.tensor([0, 2])
    ref, ref_logits = model(idx, labels)
    monkeypatch.setattr(rewrite, "_warned_kept_logits", False)
    compiled, graphs = _compile(model)
    with caplog.at_level("INFO", logger="flce_compile"):
        got, logits = compiled(idx, labels)
    (said,) = [r for r in caplog.records if "is taken from the logits the graph keeps" in r.getMessage()]
    assert said.levelname == "INFO" and "flce.logits" not in said.getMessage(), said.getMessage()
    assert "the fused op cannot return the logits here" in said.getMessage()
    assert not rewrite._warned_kept_logits
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(logits, ref_logits)
    (site,) = fc.explain(model, idx, labels)
    assert site.path == "kept_logits" and "flce.logits" not in str(site), str(site)


class QuestionAnswering(nn.Module):
    """A question-answering head as Hugging Face writes it: 2 scores per token split into start and end logits,
    each a cross-entropy over the positions (a site the pass cannot fuse, and no lm_head)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.qa_outputs = nn.Linear(H, 2)

    def forward(self, idx, start, end):
        start_logits, end_logits = self.qa_outputs(torch.tanh(self.emb(idx))).split(1, dim=-1)
        start_logits, end_logits = start_logits.squeeze(-1), end_logits.squeeze(-1)
        return (F.cross_entropy(start_logits, start) + F.cross_entropy(end_logits, end)) / 2


def test_a_question_answering_head_is_not_warned_of_as_an_lm_head(caplog, monkeypatch):
    """Its losses stay unfused and say so at INFO, naming the linear's 2 outputs (the first was a WARNING about an
    lm_head)."""
    import flce_compile.compiler.rewrite as rewrite

    monkeypatch.setattr(rewrite, "_warned_unfused", False)
    model = QuestionAnswering()
    idx, _ = _data()
    start, end = torch.tensor([1, 2]), torch.tensor([3, 4])
    with caplog.at_level("INFO", logger="flce_compile"):
        got = _compile(model)[0](idx, start, end)
    said = [r for r in caplog.records if "not fused" in r.getMessage()]
    assert len(said) == 2 and all(r.levelname == "INFO" and "its linear has 2 outputs" in r.getMessage()
                                  for r in said)
    assert not rewrite._warned_unfused
    torch.testing.assert_close(got, model(idx, start, end))


class WritesAfterItsHead(nn.Module):
    """Per-token losses from returned logits, with a write to the head's input between the head and the loss (a
    site "drop" leaves unfused)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, idx, t):
        h = torch.tanh(self.emb(idx))
        logits = self.lm_head(h)
        h.mul_(0.5)
        return F.cross_entropy(logits.view(-1, V), t.view(-1), reduction="none"), logits


def test_drop_is_offered_only_where_it_fuses(caplog, monkeypatch):
    """A kept-logits loss whose head's input is written before the loss: "drop" would leave it unfused (worse than
    keep), so it is not offered (it was)."""
    import flce_compile.compiler.rewrite as rewrite

    model = WritesAfterItsHead()
    idx, t = _data()
    monkeypatch.setattr(rewrite, "_warned_kept_logits", False)
    with caplog.at_level("INFO", logger="flce_compile"):
        _compile(model)[0](idx, t.clamp_min(0))
    (said,) = [r.getMessage() for r in caplog.records if "is taken from the logits" in r.getMessage()]
    assert "flce.logits" not in said, said
    (site,) = fc.explain(model, idx, t.clamp_min(0))
    assert site.path == "kept_logits" and "flce.logits" not in str(site), str(site)


class TensordotHead(nn.Module):
    """A vocabulary head the pass does not match (``torch.tensordot``) after an FFN that narrows 4H -> H."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.up, self.down = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
        self.w = nn.Parameter(torch.randn(H, V) * 0.1)

    def forward(self, idx, t):
        h = self.down(F.gelu(self.up(self.emb(idx))))
        return F.cross_entropy(torch.tensordot(h, self.w, dims=1).view(-1, V), t.view(-1).clamp_min(0))


def test_a_vocabulary_head_the_pass_cannot_read_is_warned_of(caplog, monkeypatch):
    """Its refused loss is warned of: the walk to the linear stops at the contraction (it went on to the FFN's
    narrowing linear and called the loss a classifier's, at INFO)."""
    import flce_compile.compiler.rewrite as rewrite

    monkeypatch.setattr(rewrite, "_warned_unfused", False)
    idx, t = _data()
    with caplog.at_level("INFO", logger="flce_compile"):
        _compile(TensordotHead())[0](idx, t)
    (said,) = [r for r in caplog.records if "not fused" in r.getMessage()]
    assert said.levelname == "WARNING" and "outputs" not in said.getMessage(), said.getMessage()


def test_the_backend_copies_only_graphs_with_a_loss_site(monkeypatch):
    """The copy of the graph that guards the fusion pass (``backend.copy_graph``, ~0.45 s per 30k nodes) is taken
    for a graph with a loss site only (one in a checkpointed region's body counts); the others are only read.
    Most graphs of a model Dynamo splits hold no loss."""
    from flce_compile.compiler import backend
    from flce_compile.compiler.rewrite import has_loss_site

    copies = []
    real = backend.copy_graph
    monkeypatch.setattr(backend, "copy_graph", lambda graph: copies.append(graph) or real(graph))
    idx, t = _data()
    _compile(LogitsOnly())[0](idx)
    assert copies == []
    compiled, graphs = _compile(Head(FORMS["nanogpt"]))
    compiled(idx, t).backward()
    assert len(copies) == 1 and flce_fused_loss in [n.target for n in graphs[0].graph.nodes]

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Head(FORMS["nanogpt"])

        def forward(self, idx, targets):
            return torch.utils.checkpoint.checkpoint(self.inner, idx, targets, use_reentrant=False)

    seen = []

    def capture(gm, example_inputs, **kw):
        seen.append(has_loss_site(gm))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(Checkpointed(), backend=capture)(idx, t)
    assert seen == [True]
    torch._dynamo.reset()
    torch.compile(LogitsOnly(), backend=capture)(idx)
    assert seen == [True, False]


def _checkpointed_loss(m, x, t):
    """The loss alone in a checkpointed function, its logits formed before it (to recompute the fp32 copy and the
    softmax in backward)."""
    def loss_fn(logits, targets):
        return F.cross_entropy(logits.float().view(-1, V), targets.view(-1), ignore_index=-1)

    return torch.utils.checkpoint.checkpoint(loss_fn, m.lm_head(x), t, use_reentrant=False)


def _checkpointed_unfusable_loss(m, x, t):
    def loss_fn(logits, targets):  # a constant added to the logits: not a bias the op takes
        return F.cross_entropy((logits + 3.0).view(-1, V), targets.view(-1), ignore_index=-1)

    return torch.utils.checkpoint.checkpoint(loss_fn, m.lm_head(x), t, use_reentrant=False)


def _checkpointed_head(m, x, t):
    logits = torch.utils.checkpoint.checkpoint(m.lm_head, x, use_reentrant=False)
    return F.cross_entropy(logits.view(-1, V), t.view(-1), ignore_index=-1)


def test_a_checkpointed_loss_of_an_outer_head_is_fused_and_exact(caplog):
    """``checkpoint(loss_fn, lm_head(x), labels)``: the region is moved out and the loss fused with the head before
    it (the backend said nothing, and explain counted no site, before); the numbers are eager's."""
    model = Head(_checkpointed_loss)
    idx, t = _data()
    ref, ref_g = _run(model, model, idx, t)
    compiled, graphs = _compile(model)
    with caplog.at_level("INFO", logger="flce_compile"):
        got, got_g = _run(model, compiled, idx, t)
    targets = [n.target for n in graphs[0].graph.nodes]
    assert targets.count(flce_fused_loss) == 1 and not any(is_checkpoint(n) for n in graphs[0].graph.nodes)
    assert "moved out of the checkpoint to fuse its loss site(s) with the lm_head before it" in caplog.text
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert ref_g.keys() == got_g.keys()
    for name in ref_g:
        torch.testing.assert_close(got_g[name], ref_g[name], rtol=1e-4, atol=1e-6, msg=name)
    explained = fc.explain(model, idx, t)
    (site,) = explained
    assert site.fused and "with the lm_head before it" in " ".join(explained.notes)


def test_a_checkpointed_loss_that_cannot_fuse_keeps_its_checkpoint_and_says_why(caplog):
    """Where the outer head and the region's loss would not fuse, the region stays checkpointed (its recomputation
    is then what saves memory) and the reason is reported."""
    model = Head(_checkpointed_unfusable_loss)
    idx, t = _data()
    ref, ref_g = _run(model, model, idx, t)
    compiled, graphs = _compile(model)
    with caplog.at_level("INFO", logger="flce_compile"):
        got, got_g = _run(model, compiled, idx, t)
    assert flce_fused_loss not in [n.target for n in graphs[0].graph.nodes]
    assert any(is_checkpoint(n) for n in graphs[0].graph.nodes)
    assert "not fused" in caplog.text and "unsupported op between lm_head and the loss" in caplog.text
    torch.testing.assert_close(got, ref)
    for name in ref_g:
        torch.testing.assert_close(got_g[name], ref_g[name], msg=name)
    (report,) = fc.explain(model, idx, t)
    assert not report.fused and "checkpointed region" in report.reason


def _checkpointed_loss_and_entropy(m, x, t):
    def loss_fn(logits, targets):  # the entropy reads the logits: fused, they would be formed and saved
        entropy = logits.logsumexp(-1) - (logits.softmax(-1) * logits).sum(-1)
        return F.cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index=-1) - 0.01 * entropy.mean()

    return torch.utils.checkpoint.checkpoint(loss_fn, m.lm_head(x), t, use_reentrant=False)


def test_a_checkpointed_loss_whose_region_reads_the_logits_stays_checkpointed():
    """Moved out, a region whose own ops read the logits beside the loss (an entropy) would be fused only around
    logits formed in the forward and saved for its backward, what its checkpoint recomputes: it stays (it was moved
    out), and explain says why."""
    model = Head(_checkpointed_loss_and_entropy)
    idx, t = _data()
    ref, ref_g = _run(model, model, idx, t)
    compiled, graphs = _compile(model)
    got, got_g = _run(model, compiled, idx, t)
    assert any(is_checkpoint(n) for n in graphs[0].graph.nodes)
    fused = {flce_fused_loss, flce_fused_loss_keep, flce_kept_logits_loss}
    assert not fused & {n.target for n in graphs[0].graph.nodes}
    torch.testing.assert_close(got, ref)
    for name in ref_g:
        torch.testing.assert_close(got_g[name], ref_g[name], msg=name)
    (site,) = fc.explain(model, idx, t)
    assert not site.fused and "logits formed in the forward (fused_keep" in site.reason, site.reason


def test_a_checkpointed_head_with_the_loss_outside_says_how_to_fuse():
    """The lm_head inside a checkpoint, the loss after it: not fused, and the reason says what to move (it named
    Dynamo's tag_activation_checkpoint)."""
    model = Head(_checkpointed_head)
    idx, t = _data()
    (report,) = fc.explain(model, idx, t)
    assert not report.fused and report.reason.endswith(CHECKPOINTED_HEAD_REASON), report.reason


def _log_probs_and_entropy(m, x, t):
    logits = m.lm_head(x)
    log_probs = logits.log_softmax(-1).gather(-1, t.clamp_min(0)[..., None]).squeeze(-1)
    entropy = logits.logsumexp(-1) - (logits.softmax(-1) * logits).sum(-1)
    return -(log_probs + 0.01 * entropy).mean()


def test_log_probs_beside_an_entropy_say_why_their_logits_stay(caplog, monkeypatch):
    """Per-token log-probs beside an entropy the graph computes from the same logits: the loss is taken from the
    kept logits, exact, and the reason names the log-probs (it named reduction='none', which the user never wrote)
    and the readers; "drop", which cannot free logits the graph's own ops read, is not offered."""
    import flce_compile.compiler.rewrite as rewrite

    model = Head(_log_probs_and_entropy)
    idx, t = _data()
    ref, ref_g = _run(model, model, idx, t)
    compiled, graphs = _compile(model)
    monkeypatch.setattr(rewrite, "_warned_kept_logits", False)
    with caplog.at_level("INFO", logger="flce_compile"):
        got, got_g = _run(model, compiled, idx, t)
    assert flce_kept_logits_loss in [n.target for n in graphs[0].graph.nodes]
    (warned,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "the loss is per-token log-probs" in warned and "reduction='none'" not in warned, warned
    assert "the graph's own ops read them (" in warned and "flce.logits" not in warned, warned
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for name in ref_g:
        torch.testing.assert_close(got_g[name], ref_g[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_promoting_bias_is_named_as_such():
    """A bias that promotes the logits to another dtype than fp32 (fp64 on fp32 logits) is not folded, and the
    reason says why (it read "unsupported op ... add")."""
    model = Head(UNSAFE["bias_add_promoting"])
    idx, t = _data()
    (report,) = fc.explain(model, idx, t.clamp_min(0))
    assert not report.fused and "bias added to torch.float32 logits, which promotes them" in report.reason
    assert "only fp32 on bf16/fp16 logits" in report.reason


class WideBias(nn.Module):
    """A bf16 model whose logits get an fp32 bias buffer added, which promotes them to fp32: BART's
    ``final_logits_bias`` under autocast, in a model small enough for the CPU. ``grad_bias``: a parameter instead;
    ``own_bias``: the head has a bias of its own too."""

    def __init__(self, grad_bias=False, own_bias=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, H)
        self.proj = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, V, bias=own_bias)
        self.to(torch.bfloat16)
        fb = torch.randn(1, V) * 2
        if grad_bias:
            self.fb = nn.Parameter(fb)
        else:
            self.register_buffer("fb", fb)

    def forward(self, idx, t):
        z = self.lm_head(torch.tanh(self.proj(self.emb(idx)))) + self.fb
        return F.cross_entropy(z.view(-1, V), t.view(-1)), z


@pytest.mark.parametrize("mode", ["keep", "drop", "materialize"])
def test_an_fp32_bias_buffer_on_bf16_logits_is_folded_nearer_fp64_than_eager(mode):
    """The fp32 bias promotes the bf16 logits: the op adds it to fp32 logits (unrounded, so the loss and the
    gradients are nearer fp64 than eager's), and the returned logits are eager's, bit for bit: computed when read
    (keep, the GEMM in bf16 and the bias added after it), or by the graph itself (materialize, whose op with logits
    would return them unpromoted: the loss is taken from the graph's logits, the kept_logits path). The site was
    left unfused."""
    model = WideBias()
    idx, t = _data()
    t = t.clamp_min(0)
    model.zero_grad(set_to_none=True)
    ref_loss, ref_z = model(idx, t)
    ref_loss.backward()
    ref_g = {n: p.grad.clone() for n, p in model.named_parameters()}
    # The head in fp64 on the trunk's bf16 hidden states (both runs compute those alike).
    h64 = torch.tanh(model.proj(model.emb(idx))).detach().double()
    w64 = model.lm_head.weight.detach().double().requires_grad_()
    exact = F.cross_entropy((h64 @ w64.T + model.fb.double()).view(-1, V), t.view(-1))
    exact.backward()
    compiled, graphs = _compile(model, logits=mode)
    model.zero_grad(set_to_none=True)
    loss, z = compiled(idx, t)
    loss.backward()
    nodes = [n for n in graphs[0].graph.nodes if n.target in (flce_fused_loss, flce_kept_logits_loss)]
    assert [n.target for n in nodes] == [flce_kept_logits_loss if mode == "materialize" else flce_fused_loss]
    if mode == "materialize":
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(z, ref_z, rtol=0, atol=0)
        return
    assert nodes[0].kwargs["wide_bias"] is True and nodes[0].args[12] is None  # the GEMMs in bf16: no casts
    assert not [n for n in graphs[0].graph.nodes if n.op == "call_function" and n.target is not flce_fused_loss
                and n.meta["example_value"].shape[-1:] == (V,) and n.meta["example_value"].dim() > 1], "no logits"
    assert abs(loss.double() - exact) < abs(ref_loss.double() - exact) / 10
    ours, eager = (model.lm_head.weight.grad.double() - w64.grad).norm(), (ref_g["lm_head.weight"] - w64.grad).norm()
    assert ours <= eager * 1.05, (ours, eager)
    for name, p in model.named_parameters():  # the trunk's bf16 backward from dX: as eager's, up to rounding
        assert (p.grad - ref_g[name]).float().norm() <= 2e-2 * ref_g[name].float().norm(), name
    if mode == "drop":
        assert z is None
        return
    assert type(z).__name__ == "LazyLogits" and z.dtype == torch.float32
    torch.testing.assert_close(z, ref_z, rtol=0, atol=0)


def test_a_bf16_bias_on_fp16_logits_promotes_them_and_is_folded_in_fp32():
    """bf16 + fp16 promotes to fp32 as fp32 + fp16 does: the bias is cast to fp32 (exactly) and folded as a wide
    bias. The pass took it for a wide bias and the op then refused its dtype: explain said fused, the rewrite
    failed with a TypeError and the site ran unfused (review of 2026-12-03)."""
    model = WideBias().half()
    model.fb = model.fb.bfloat16()
    idx, t = _data()
    t = t.clamp_min(0)
    ref_loss, ref_z = model(idx, t)
    assert ref_z.dtype == torch.float32
    compiled, graphs = _compile(model)
    loss, z = compiled(idx, t)
    (node,) = [n for n in graphs[0].graph.nodes if n.target is flce_fused_loss]
    assert node.kwargs["wide_bias"] is True and meta_value(node.args[3]).dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(z, ref_z, rtol=0, atol=0)


@pytest.mark.parametrize("grad_bias, own_bias, why", [
    (True, False, "and requires grad: the fused op's bias gradient would sum torch.bfloat16 logit gradients"),
    (False, True, "on a head with its own bias"),
])
def test_an_fp32_bias_on_bf16_logits_that_needs_a_gradient_or_meets_a_head_bias_is_not_folded(grad_bias, own_bias,
                                                                                                why):
    """The op's bias gradient would come from bf16 logit gradients, less exact than eager's fp32 sums; a head's
    own bias beside it is not combined. Each names its reason."""
    idx, t = _data()
    (report,) = fc.explain(WideBias(grad_bias, own_bias), idx, t.clamp_min(0))
    assert not report.fused and why in report.reason, report.reason


def test_a_second_bias_in_16_bits_is_not_folded():
    """A bf16 head with a bias of its own and one added: their sum, formed once for every token, would be rounded
    where eager rounds each token's logits (a loss error 10x eager's in a review's case), so the site is left alone
    and says why."""
    model = Head(FORMS["bias_add_tensor"], bias=True).to(torch.bfloat16)
    idx, t = _data()
    (report,) = fc.explain(model, idx, t.clamp_min(0))
    assert not report.fused and "logits of a head with its own bias" in report.reason, report.reason
    (report,) = fc.explain(Head(FORMS["bias_add_tensor"]).to(torch.bfloat16), idx, t.clamp_min(0))
    assert report.fused


def test_the_first_unfused_site_is_a_warning(caplog, monkeypatch):
    """A loss the backend leaves unfused keeps its logits: the first one in a process says so at WARNING (it was
    INFO, unseen by default, even under flce.logits="drop"), later ones at INFO."""
    import flce_compile.compiler.rewrite as rewrite

    monkeypatch.setattr(rewrite, "_warned_unfused", False)
    idx, t = _data()
    with caplog.at_level("INFO", logger="flce_compile"):
        for form in ("tensor_scale", "soft_targets"):
            _compile(Head(UNSAFE[form]), logits="drop")[0](idx, t.clamp_min(0))
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "not fused" in r.getMessage()]
    assert [level for level, _ in said] == ["WARNING", "INFO"], said
    assert "multiplication by a tensor" in said[0][1] and "flce_compile.explain" in said[0][1]


class BiasAfterAWrite(nn.Module):
    """A frozen head whose input is written in place after the GEMM and before its added bias (and a bias the
    graph computes after the GEMM): the op, which runs where the GEMM ran, must read the hidden states unwritten."""

    def __init__(self, computed_bias: bool):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.proj = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, V, bias=False).requires_grad_(False)
        self.fb = nn.Parameter(torch.randn(V))
        self.computed_bias = computed_bias

    def forward(self, idx, t):
        h = self.proj(self.emb(idx))
        z = self.lm_head(h)
        h.mul_(0.5)
        z = z + (self.fb * 2.0 if self.computed_bias else self.fb)
        return F.cross_entropy(z.view(-1, V), t.view(-1)), z


@pytest.mark.parametrize("computed_bias", [False, True])
@pytest.mark.parametrize("mode", ["keep", "materialize", "drop"])
def test_a_write_between_the_head_and_its_added_bias_is_seen(mode, computed_bias):
    """The write checks started at the sum, so the write was missed and the op read the written hidden states
    (loss 5.531 against eager's 5.674 under keep and materialize)."""
    torch.manual_seed(0)
    model = BiasAfterAWrite(computed_bias)
    idx, t = _data()
    t = t.clamp_min(0)
    model.zero_grad(set_to_none=True)
    ref_loss, ref_z = model(idx, t)
    ref_loss.backward()
    ref_g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    compiled, _ = _compile(model, logits=mode)
    model.zero_grad(set_to_none=True)
    loss, z = compiled(idx, t)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    if mode != "drop":
        torch.testing.assert_close(z, ref_z, rtol=1e-6, atol=1e-6)
    for name, g in ref_g.items():
        torch.testing.assert_close(model.get_parameter(name).grad, g, rtol=1e-5, atol=1e-6, msg=name)


def test_logits_a_refused_loss_reads_are_no_lone_head():
    """Logits returned and read by a loss the analysis refuses (a scale by a tensor) get that loss's reason alone:
    they were also reported as a head no loss reads, at WARNING, beside it."""

    def scaled(m, x, t):
        logits = m.lm_head(x)
        return F.cross_entropy((logits * m.cw).view(-1, V), t.view(-1)), logits

    idx, t = _data()
    report = fc.explain(Head(scaled), idx, t.clamp_min(0))
    assert len(report) == 1 and "multiplication by a tensor" in report[0].reason, str(report)
