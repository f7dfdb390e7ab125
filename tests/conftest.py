"""Shared test set-up: the `gpu` marker skips without CUDA; without CUDA the Triton kernels run in the
interpreter (TRITON_INTERPRET=1 must be set before the kernel module is imported); ``cpu_graphs``, CUDA-graph
replay on the CPU with a stand-in capture; ``shortcut_hits``, which calls took a replay shortcut."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _share_the_cores_among_xdist_workers() -> None:
    """Each pytest-xdist worker would start one torch thread per core, so the README's test command on CI's 2
    cores ran 2 workers x 2 threads, which wait on each other's spinning threads: test_op_memory and
    test_op_numerics took 189 s that way and 148 s with one thread a worker. Give each worker its share."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // workers))


_share_the_cores_among_xdist_workers()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class _Rerun:
    """A stand-in graph: replay runs the captured function again and writes its outputs (if any) into the
    tensors the capture returned."""

    def __init__(self, fn, result) -> None:
        self.fn, self.result, self.replays = fn, result, 0

    def pool(self) -> "_Rerun":  # a real graph's memory pool id, which a replacing capture reuses: here itself
        return self

    def replay(self) -> None:
        self.replays += 1
        fresh = self.fn()
        if self.result is not None:
            for dst, src in zip(self.result, fresh):
                if dst is not None:
                    dst.copy_(src)


@pytest.fixture
def cuda_settings_stand_in(monkeypatch):
    """For tests that replay graphs on the CPU, whose keys (outside tests, only CUDA calls are keyed) read torch's
    CUDA settings: cuBLAS's workspace getter (CUDA builds of torch after 2.11) asks the device unless a size was
    set, which raises on a CUDA build without a usable driver. It answers 0, as the key's stand-in does on CPU
    builds."""
    from flce_compile import graph_replay

    monkeypatch.setattr(graph_replay, "_cublas_workspace", int)


@pytest.fixture
def cpu_graphs(monkeypatch, cuda_settings_stand_in):
    """Graph replay on the CPU with the stand-in capture; lists each forward capture's weight address. The
    graphs and the eager shortcuts to them start and end empty."""
    from flce_compile import eager_shortcut, graph_replay, set_cuda_graphs

    captures = []
    real_capture = graph_replay._capture

    def capture(ops, run, stream, **options):
        captures.append(ops.weight.data_ptr())  # not the operands: holding the caller's input would hold its .grad
        return real_capture(ops, run, stream, **options)

    def captured(fn, device, stream, *, outputs=True, pool=None):
        result = fn() if outputs else None  # a real capture runs nothing; outputs need allocating here
        return _Rerun(fn, result), result, 0

    monkeypatch.setattr(graph_replay, "_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(graph_replay, "_capture", capture)
    monkeypatch.setattr(graph_replay, "_captured", captured)
    graph_replay.clear()
    eager_shortcut.clear()
    set_cuda_graphs("on")
    yield captures
    set_cuda_graphs("auto")
    graph_replay.clear()
    eager_shortcut.clear()


@pytest.fixture
def shortcut_hits(monkeypatch):
    """``watch(owner, name)`` wraps a shortcut's replay function (``eager_shortcut.replay``,
    ``graph_replay.body_shortcut_replay``) and returns the list of whether each call took the shortcut (True: it
    returned a result) or the full path (False). ``first``: a function of ``owner`` tried before it
    (``eager_shortcut.replay_recent``), whose result is a hit too and whose miss leads to ``name``. Only the answer
    is kept: a kept result's aliases would keep the graph busy."""
    def watch(owner, name, first=None):
        hits: list[bool] = []

        def wrap(function, misses_count):
            real = getattr(owner, function)

            def replay(*args):
                result = real(*args)
                if result is not None or misses_count:
                    hits.append(result is not None)
                return result

            monkeypatch.setattr(owner, function, replay)

        wrap(name, True)
        if first is not None:
            wrap(first, False)
        return hits

    return watch
