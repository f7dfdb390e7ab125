"""TORCH_LOGS="+flce_compile" turns on the package's debug log, as for torch.compile's own components."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = """
import torch, torch.nn.functional as F
import flce_compile.compiler
lm_head = torch.nn.Linear(8, 32, bias=False)
fn = lambda x, t: F.cross_entropy(lm_head(x).view(-1, 32), t.view(-1))
torch.compile(fn, backend="flce", options={"flce.inner": "eager"})(torch.randn(2, 3, 8), torch.randint(0, 32, (2, 3)))
"""


def _run(torch_logs: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    if torch_logs is not None:
        env["TORCH_LOGS"] = torch_logs
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                          check=True).stderr


def test_torch_logs_enables_the_package_log():
    debug = _run("+flce_compile")
    # Once: torch 2.13 imports the package while it parses TORCH_LOGS, and a second parse of ours doubled every
    # line's handler.
    assert debug.count("flce: loss cross_entropy -> fused") == 1, debug  # INFO
    assert "config for V=32 H=8" in debug  # DEBUG, from the op's config choice
    info = _run("flce_compile")
    assert "-> fused" in info and "config for V=32" not in info
    assert "flce:" not in _run(None)
