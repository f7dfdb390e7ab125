"""A caller's own CUDA-graph capture of a function, next to the same function run on a side stream (the warm-up
torch's docs prescribe), for the GPU tests that check the op can be captured."""

from __future__ import annotations

from typing import Any, Callable

import torch


def plain_and_captured(fn: Callable[[], Any]) -> tuple[Any, Any]:
    """(``fn()`` run on a side stream, ``fn()`` captured into a CUDA graph and replayed once)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        plain = fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    graph.replay()
    torch.cuda.synchronize()
    return plain, captured
