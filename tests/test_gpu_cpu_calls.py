"""On a machine with a GPU, the library's eager CPU calls leave CUDA uninitialized. Initializing it gives the
process a CUDA context (GPU memory of its own) and breaks DataLoader workers forked after it ("Cannot re-initialize
CUDA in forked subprocess"): no eager CPU call may ask the device anything (the replay keys, which read CUDA settings,
are built for devices that replay graphs only). Run in a fresh process: the suite's own GPU tests initialize CUDA.

Compiled calls are out of scope: torch.compile itself initializes CUDA on a machine with a GPU, whatever the backend
(Dynamo saves the CUDA RNG state around each frame it compiles and reads the current stream when it starts tracing;
seen on an H100 with torch 2.11, stock ``aot_eager`` included), so ``backend="flce"`` and ``explain`` cannot leave it
uninitialized. ``with_options`` builds a backend without compiling and is checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

_CPU_WORK = r"""
import torch
import flce_compile as fc

x = torch.randn(64, 16, requires_grad=True)
w = torch.randn(100, 16, requires_grad=True)
t = torch.randint(0, 100, (64,))
for _ in range(4):  # the full path, then the shortcut's key on later calls
    fc.fused_linear_cross_entropy(x, w, t).backward()
fc.FusedLinearCrossEntropyLoss(reduction="sum")(x, w, t).backward()
fc.choose_config(64, 100, 16, torch.float32, torch.device("cpu"))
fc.peak_bytes(fc.FLCEConfig(), 64, 100, 16, torch.float32, torch.float32, device="cpu")
fc.with_options(inner="aot_eager")
fc.with_options(mode="max-autotune-no-cudagraphs")  # Inductor's wrapper, built and checked at the call
print("CUDA_INITIALIZED", torch.cuda.is_initialized())
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_calls_leave_cuda_uninitialized():
    repo = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", _CPU_WORK], cwd=repo, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "CUDA_INITIALIZED False" in run.stdout, run.stdout[-2000:]
