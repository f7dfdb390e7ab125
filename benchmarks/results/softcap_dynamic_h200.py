"""A softcap Dynamo left symbolic (torch.compile(..., dynamic=True)) read by the fused op at run time, on the H200
with Inductor: tiny Gemma-2 (transformers) and the tests' nanoGPT-style LM, logits kept and dropped. Per value:
whether the op read it, loss and gradients against eager, and the graphs compiled so far."""
import sys, os, logging
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
logging.basicConfig(level=logging.WARNING)
from tests.test_compiler_hf import _make
from test_compiler_keep import LM, _data
from flce_compile import op
seen = []
real = op.runtime_params
op.runtime_params = lambda p, v: (seen.append(None if v is None else float(v)), real(p, v))[1]

def graphs():
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]

def check(name, model, call, set_cap, caps, atol):
    print(f"\n{name}")
    compiled = torch.compile(model, **call["compile"])
    for cap in caps:
        set_cap(cap)
        model.zero_grad(set_to_none=True)
        ref = call["loss"](model); ref.backward()
        rg = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        seen.clear()
        out = call["loss"](compiled); out.backward()
        worst = max((p.grad - rg[k]).abs().max().item() for k, p in model.named_parameters() if p.grad is not None)
        print(f"  softcap {cap}: op read {seen} loss {out.item():.6f} eager {ref.item():.6f} "
              f"|dgrad| max {worst:.2e} ok {abs(out.item() - ref.item()) < 1e-4 and worst < atol} graphs {graphs()}")

torch.manual_seed(0)
gemma = _make("gemma2").cuda()
ids = torch.randint(0, gemma.config.vocab_size, (2, 24), device="cuda")
for logits in ("keep", "drop"):
    torch._dynamo.reset()
    check(f"gemma2, flce.logits={logits}", gemma,
          {"compile": {"backend": "flce", "dynamic": True, "options": {"flce.logits": logits}},
           "loss": lambda m: m(input_ids=ids, labels=ids).loss},
          lambda c: setattr(gemma.config, "final_logit_softcapping", c), (30.0, 5.0, -7.0, 30.0), 1e-4)
lm = LM(softcap=5.0).cuda()
idx, labels = (t.cuda() for t in _data())
for logits in ("keep", "drop"):
    torch._dynamo.reset()
    check(f"nanoGPT-style LM, flce.logits={logits}", lm,
          {"compile": {"backend": "flce", "dynamic": True, "options": {"flce.logits": logits}},
           "loss": lambda m: m(idx, labels)[0]},
          lambda c: setattr(lm, "softcap", c), (5.0, 7.0, -3.0), 1e-5)
