"""Quickstart: train a small Llama-style model with ``torch.compile(model, backend="flce")``, with the logits
dropped, and with the inner compiler alone, then compare losses and peak memory.

    python examples/quickstart.py            # about 40 s on a 2-core CPU (aot_eager inner); GPU when available
    python examples/quickstart.py --steps 5 --inner aot_eager

It prints what the pass does with the model (``flce_compile.explain`` on the very model it trains, so the
options match), one line per step, and a summary line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from typing import Callable, Iterator

import torch
import transformers

import flce_compile
import flce_compile.compiler  # noqa: F401  (registers backend="flce" when the package is not installed)


def make_model(device: torch.device, dtype: torch.dtype, vocab: int) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(device, dtype)
    model.config.use_cache = False
    return model


@contextlib.contextmanager
def _quiet_native_output() -> Iterator[None]:
    """Silence what the CPU profiler's native code prints on stdout/stderr (start/stop lines)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(1), os.dup(2)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (devnull, *saved):
            os.close(fd)


def peak_bytes(fn: Callable[[], float], device: torch.device) -> tuple[float, int]:
    """Run fn; return its result and its peak bytes above what was allocated before: CUDA's allocator stats,
    or on the CPU the profiler's allocation records replayed in time order."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with _quiet_native_output(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    live = peak = 0
    for event in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
        if event.name() == "[memory]":
            live += event.nbytes()
            peak = max(peak, live)
    return out, peak


def train(model: torch.nn.Module, compiled: Callable, batches: list[torch.Tensor]) -> tuple[list[float], list[int]]:
    """A few SGD steps of ``loss = compiled(...).loss; loss.backward()``; the weights are restored after."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    losses, peaks = [], []
    for ids in batches:
        def step() -> float:
            opt.zero_grad(set_to_none=True)
            loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            return loss.detach().float().item()

        loss, peak = peak_bytes(step, ids.device)
        losses.append(loss)
        peaks.append(peak)
    model.load_state_dict(state)  # both runs start from the same weights
    return losses, peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--inner", default=None,
                        help="inner compiler (default: inductor on a GPU; aot_eager on the CPU, where Inductor's "
                             "C++ compile of even a small model takes minutes)")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    inner = args.inner or ("inductor" if device.type == "cuda" else "aot_eager")
    model = make_model(device, dtype, args.vocab)
    g = torch.Generator(device="cpu").manual_seed(0)
    batches = [torch.randint(0, args.vocab, (2, args.seq), generator=g).to(device) for _ in range(args.steps)]

    # Exactly what users type on a GPU: backend="flce" and nothing else (the inner compiler is Inductor).
    options = None if inner == "inductor" else {"flce.inner": inner}
    ours = torch.compile(model, backend="flce", options=options)
    report = flce_compile.explain(ours, input_ids=batches[0], labels=batches[0])  # the model it trains
    print(report)

    drop = torch.compile(model, backend="flce", options={**(options or {}), "flce.logits": "drop"})
    runs = {f"{inner} alone": torch.compile(model, backend=inner), 'backend="flce"': ours,
            'backend="flce", flce.logits="drop"': drop}
    results = {}
    for name, compiled in runs.items():
        torch._dynamo.reset()
        start = time.perf_counter()
        results[name] = train(model, compiled, batches)
        print(f"{name}: {time.perf_counter() - start:.1f} s for {args.steps} steps, compile included")

    (ref_losses, ref_peaks), (losses, peaks), (drop_losses, drop_peaks) = results.values()
    for i in range(args.steps):
        print(f"step {i}: loss {ref_losses[i]:.5f} / {losses[i]:.5f} / {drop_losses[i]:.5f}, peak "
              f"{ref_peaks[i] / 2**20:.1f} / {peaks[i] / 2**20:.1f} / {drop_peaks[i] / 2**20:.1f} MiB "
              f"({' / '.join(results)})")
    diff = max(abs(a - b) for a, b in zip(ref_losses + ref_losses, losses + drop_losses))
    fused = sum(r.fused for r in report)

    def compare(ref: int, ours: int, drop: int) -> str:
        return (f"{ours / 2**20:.1f} MiB vs {ref / 2**20:.1f} MiB with {inner} alone ({(ours - ref) / ref:+.0%}), "
                f"{drop / 2**20:.1f} MiB ({(drop - ref) / ref:+.0%}) with the logits dropped")

    # The run's peak and the last step's: the first step of a run can allocate once what later steps reuse.
    whole_run = compare(max(ref_peaks), max(peaks), max(drop_peaks))
    last_step = compare(ref_peaks[-1], peaks[-1], drop_peaks[-1])
    print(f"flce: {fused} of {len(report)} site(s) fused; peak over the run {whole_run}; in the last step "
          f"{last_step}; loss difference {diff:.1e}")


if __name__ == "__main__":
    main()
