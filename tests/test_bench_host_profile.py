"""benchmarks/host_profile.py's stage timings on the CPU, with a stand-in for the CUDA graph (the real run needs a
GPU): every stage it names exists, is timed, and is put back afterwards."""

from __future__ import annotations

import pytest
import torch

from benchmarks import _common, host_profile
from flce_compile import graph_replay


class _NoReplay:
    def replay(self) -> None:
        pass


@pytest.fixture
def cpu_stand_in(monkeypatch, cuda_settings_stand_in):
    def captured(fn, device, stream, *, outputs=True, pool=None):
        result = fn() if outputs else None
        return _NoReplay(), result, 0

    monkeypatch.setattr(graph_replay, "_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(graph_replay, "_captured", captured)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(host_profile, "make_inputs", lambda n, h, v: _common.make_inputs(n, h, v, device="cpu"))
    monkeypatch.setattr(host_profile, "set_cuda_graphs", lambda mode: graph_replay.set_cuda_graphs("on"))
    graph_replay.clear()
    yield
    graph_replay.set_cuda_graphs("auto")
    graph_replay.clear()


@pytest.mark.parametrize("caller", host_profile.STAGE_CALLERS)
def test_stages_times_every_named_stage_and_restores_them(cpu_stand_in, caller):
    targets = host_profile._stage_targets(caller)
    before = [owner.__dict__[name] for owner, name, _ in targets]
    # aot_eager: the same traced graph and custom-op call as Inductor's, without a C++ compile on the CPU.
    text = host_profile.stages("16x8x32", 4, caller, compile_backend="aot_eager")
    assert "(1 captured; replays per call: 1;" in text  # the calls were replayed, as on the GPU
    # Repeats of the recent call take the recent-call shortcut; the keyed one runs only when it misses (first calls).
    missed = {"eager_shortcut.key_of", "eager_shortcut.replay", "graph_replay.body_shortcut_key",
              "graph_replay.body_shortcut_replay"}
    for _, _, label in targets:
        line = next((line for line in text.splitlines() if line.startswith(f"- {label}: ")), None)
        assert (line is None) if label in missed else int(line.rsplit(": ", 1)[1]) >= 0, label
    assert "- whole call: " in text and "- loss.backward() (whole backward): " in text
    assert [owner.__dict__[name] for owner, name, _ in targets] == before  # nothing left wrapped


def test_floor_pieces_take_turns_and_each_gets_its_calls():
    order: list[str] = []
    pieces = {name: (lambda name=name: order.append(name)) for name in ("a", "b", "c")}
    times = host_profile.in_turns(pieces, calls=7, rounds=3, cuda=False)
    assert {name: len(t) for name, t in times.items()} == {"a": 7, "b": 7, "c": 7}
    assert all(s >= 0 for t in times.values() for s in t)
    # rounds of 3, 2 and 2 calls, each piece in turn: a slow spell of the host cannot fall on one piece only
    assert order == ["a"] * 3 + ["b"] * 3 + ["c"] * 3 + (["a"] * 2 + ["b"] * 2 + ["c"] * 2) * 2
