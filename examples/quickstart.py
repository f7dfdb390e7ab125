"""Quickstart: train a small Llama-style model with torch.compile(backend="flce") and with the plain inner
compiler, and compare losses and peak memory.

    python examples/quickstart.py            # CPU: a couple of minutes; GPU when available
    python examples/quickstart.py --steps 5 --inner aot_eager
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import flce_compile  # noqa: F401
from flce_compile.compiler import explain, flce_backend  # noqa: F401  (registers backend="flce" if needed)


def make_model(device: torch.device, dtype: torch.dtype, vocab: int) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(device, dtype)
    model.config.use_cache = False
    return model


def peak_memory(fn, device: torch.device) -> tuple[object, str]:
    """Run fn and report its peak memory: CUDA max_memory_allocated, or the CPU profiler's allocation peak."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        return out, f"{(torch.cuda.max_memory_allocated() - base) / 2**20:.1f} MiB"
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    # Replay the profiler's allocation events to find the peak of live bytes during the step.
    live = peak = 0
    for event in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
        if event.name() == "[memory]":
            live += event.nbytes()
            peak = max(peak, live)
    return out, f"{peak / 2**20:.1f} MiB (CPU profiler)"


def train(model, backend: str, options: dict | None, batches, lr: float = 1e-3):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    compiled = torch.compile(model, backend=backend, options=options)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, peaks = [], []
    for ids in batches:
        def step():
            opt.zero_grad(set_to_none=True)
            loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            return loss.detach().float().item()

        loss, peak = peak_memory(step, ids.device)
        losses.append(loss)
        peaks.append(peak)
    model.load_state_dict(state)  # both runs start from the same weights
    return losses, peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--inner", default=None, help="inner compiler (default: inductor on GPU, aot_eager on CPU)")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    inner = args.inner or ("inductor" if device.type == "cuda" else "aot_eager")
    model = make_model(device, dtype, args.vocab)
    g = torch.Generator(device="cpu").manual_seed(0)
    batches = [torch.randint(0, args.vocab, (2, args.seq), generator=g).to(device) for _ in range(args.steps)]

    print("== fused sites (flce_compile.explain) ==")
    print(explain(model, input_ids=batches[0], labels=batches[0]))

    runs = {
        f"{inner} (plain)": (inner, None),
        f"flce[{inner}] logits=drop": ("flce", {"flce.inner": inner, "flce.logits": "drop"}),
    }
    results = {}
    for name, (backend, options) in runs.items():
        torch._dynamo.reset()
        t0 = time.perf_counter()
        results[name] = train(model, backend, options, batches)
        print(f"{name}: {time.perf_counter() - t0:.1f}s (incl. compile)")

    print("\n== results ==")
    names = list(results)
    for i in range(args.steps):
        row = "  ".join(f"{n}: loss {results[n][0][i]:.5f} peak {results[n][1][i]}" for n in names)
        print(f"step {i}: {row}")
    ref, got = results[names[0]][0], results[names[1]][0]
    print(f"max |loss difference| over {args.steps} steps: {max(abs(a - b) for a, b in zip(ref, got)):.2e}")


if __name__ == "__main__":
    main()
