"""Reference losses for the tests: the spec's formula in eager PyTorch, at the inputs' dtype or in fp64; and the
small random inputs the CPU tests share."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flce_compile import fused_linear_cross_entropy


def reference_loss(x, w, t, b=None, *, ce_weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                   softcap=None, logit_scale=1.0, z_loss=0.0, upcast=None):
    """F.cross_entropy(z.float()) (+ z-loss) with s = logit_scale * (x W^T + b) and z the soft-capped s.

    upcast=torch.float64 computes everything in fp64 (the ground truth); None computes the linear layer and
    softcap in the inputs' dtype as eager PyTorch code would, then the CE in fp32.
    """
    if upcast is not None:
        x, w = x.to(upcast), w.to(upcast)
        b = b.to(upcast) if b is not None else None
    s = F.linear(x, w, b)
    if logit_scale != 1.0:
        s = s * logit_scale
    z = softcap * torch.tanh(s / softcap) if softcap else s
    z = z.float() if upcast is None else z
    V = w.shape[0]
    cw = ce_weight.to(z.dtype) if ce_weight is not None else None
    loss = F.cross_entropy(z.reshape(-1, V), t.reshape(-1), weight=cw, ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing)
    if z_loss:
        lse = torch.logsumexp(z.reshape(-1, V), dim=-1)
        valid = (t.reshape(-1) != ignore_index).to(lse.dtype)
        zl = z_loss * lse * lse * valid
        loss = loss + {"mean": lambda: zl.sum() / valid.sum(), "sum": zl.sum, "none": lambda: zl}[reduction]()
    return loss.view(t.shape) if reduction == "none" else loss


def random_inputs(n=20, h=16, v=40, dtype=torch.float32, seed=0):
    """x (n, h), weight (v, h) scaled for logits of std ~1, and targets (n,) in [0, v), all on the CPU."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    return x, w, t


def fp16_grad_errors(x0, w0, t, b0=None, config=None, grad_output=1.0, **loss_kwargs):
    """(ours, eager's) relative errors of each fp16 gradient (dX, dW, and db with a bias) of
    ``grad_output * loss`` against fp64 on the same inputs, and whether all of ours are finite. ``loss_kwargs``
    are the op's (ce_weight, reduction, label_smoothing, logit_scale)."""
    def grads(fn, dtype):
        leaves = [a.to(dtype).detach().requires_grad_() for a in (x0, w0, b0) if a is not None]
        (fn(*leaves) * grad_output).backward()
        return [a.grad.double() for a in leaves]

    torch_kwargs = {("weight" if k == "ce_weight" else k): v for k, v in loss_kwargs.items()}
    scale = torch_kwargs.pop("logit_scale", 1.0)

    def unfused(a, b, c, upcast):
        logits = F.linear(a, b, c) * scale if scale != 1.0 else F.linear(a, b, c)
        return F.cross_entropy(logits.to(upcast), t, **{k: v.to(upcast) if torch.is_tensor(v) else v
                                                        for k, v in torch_kwargs.items()})

    exact = grads(lambda a, b, c=None: unfused(a, b, c, torch.float64), torch.float64)
    theirs = grads(lambda a, b, c=None: unfused(a, b, c, torch.float32), torch.float16)
    ours = grads(lambda a, b, c=None: fused_linear_cross_entropy(a, b, t, bias=c, config=config, **loss_kwargs),
                 torch.float16)
    rel = [(float((o - r).norm() / r.norm()), float((e - r).norm() / r.norm()))
           for o, e, r in zip(ours, theirs, exact)]
    return rel, all(bool(torch.isfinite(o).all()) for o in ours)
