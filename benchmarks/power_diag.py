"""Why do_bench reads a few percent more than a profiled call at 16384 x 4096 x 128256 (issue #13).

One process, one H200: our op's fwd+bwd timed with ten CUDA-event runs while the GPU is cool, the three-GEMM
floor, then do_bench (a second of back-to-back calls), the ten runs again, and the floor again, with the SM
clock, memory clock, power and temperature from nvidia-smi beside them. Prints raw lines; the run cited in
docs/results_h200.md is ``results/power_diag_h200_20261201.log``. ("no-flush-free" is a shorter do_bench, 50 + 300 ms.)

    python benchmarks/power_diag.py
"""
import subprocess
import sys

import torch

sys.path.insert(0, '.')
from triton.testing import do_bench  # noqa: E402

from benchmarks._common import make_inputs, median_ms  # noqa: E402
from benchmarks.kernel_breakdown import floor_ms  # noqa: E402
from flce_compile import fused_linear_cross_entropy  # noqa: E402

if not torch.cuda.is_available():
    sys.exit("power_diag.py needs a CUDA GPU")
x, w, t = make_inputs(16384, 4096, 128256)
x.requires_grad_()
w.requires_grad_()


def step():
    x.grad = w.grad = None
    fused_linear_cross_entropy(x, w, t).backward()


def clk():
    return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu",
                           "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()


for _ in range(3):
    step()
torch.cuda.synchronize()
print("clk start", clk())
print("events median 10 (cool)", median_ms(step, 10, "cuda"))
print("floor events", floor_ms(x.detach(), w.detach()))
print("do_bench flce", do_bench(step, warmup=200, rep=1000, return_mode="median"), "clk", clk())
print("events median 10 (warm)", median_ms(step, 10, "cuda"))
print("do_bench flce no-flush-free", do_bench(step, warmup=50, rep=300, return_mode="median"))
print("floor events again", floor_ms(x.detach(), w.detach()), "clk", clk())
