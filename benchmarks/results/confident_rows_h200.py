"""Confident rows on the H200 (fp32, the default config): errors against fp64 of eager (CUDA) and the op, mean and
none, margins 10 and 16."""
import torch, torch.nn.functional as F
from flce_compile import fused_linear_cross_entropy
g = torch.Generator(device="cuda").manual_seed(0)
n, h, v = 4096, 64, 1024
w = torch.randn(v, h, device="cuda", generator=g); w = w / w.norm(dim=1, keepdim=True)
t = torch.randint(0, v, (n,), device="cuda", generator=g)
for margin in (10.0, 16.0):
    x = w[t] * margin + torch.randn(n, h, device="cuda", generator=g) * 0.1
    for red in ("mean", "none"):
        def run(fn, dt):
            a = x.to(dt).detach().requires_grad_(); b = w.to(dt).detach().requires_grad_()
            l = fn(a, b); l.sum().backward(); return l.detach().double(), a.grad.double(), b.grad.double()
        r = run(lambda a, b: F.cross_entropy(F.linear(a, b), t, reduction=red), torch.float64)
        e = run(lambda a, b: F.cross_entropy(F.linear(a, b), t, reduction=red), torch.float32)
        o = run(lambda a, b: fused_linear_cross_entropy(a, b, t, reduction=red), torch.float32)
        rel = lambda u, q: float((u - q).norm() / q.norm())
        print(f"margin {margin} {red}: loss max abs ours {float((o[0]-r[0]).abs().max()):.2e} eager {float((e[0]-r[0]).abs().max()):.2e}; "
              f"dX ours {rel(o[1], r[1]):.2e} eager {rel(e[1], r[1]):.2e}; dW ours {rel(o[2], r[2]):.2e} eager {rel(e[2], r[2]):.2e}")
