"""Where the host time of one eager forward + backward call goes: cProfile of the op, CUDA graph replay on and off.

For each mode: the median and least host time of a whole call (the GPU drained before each, as
host_overhead.py times it), of its forward and of its backward alone, then the functions with the most own
time over ``--calls`` back-to-back calls. Then the stages of a call (``stages``: inclusive host time of each
step of the op's path, and how many graph replays a call made), called eagerly and from inside the user's own
``torch.compile``. Then the floors of this host, timed the same way, the pieces taking turns: one kernel
launch, one graph replay, and a trivial autograd.Function built like our replayed call (forward: copy the hidden
states and targets into a graph's inputs, replay it, clone the loss; backward: copy grad_output, replay a second
graph, return preformed gradients): what any custom op with CUDA-graph replay costs here before doing any work;
the same Function over the op's own two captured graphs, and the op itself, timed alongside. Writes
``host_profile_<gpu>.txt`` (GPU name and versions first).

    python benchmarks/host_profile.py                        # 2048x768x50304 bf16 on the GPU
    python benchmarks/host_profile.py --out benchmarks/results --top 30
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._common import make_inputs, versions  # noqa: E402
from benchmarks.host_overhead import graph_of, host_times  # noqa: E402
from flce_compile import fused_linear_cross_entropy, graph_replay, set_cuda_graphs  # noqa: E402


def _host_us(fn, calls: int) -> tuple[float, float]:
    """Median and least host us of a call, timed as ``host_overhead`` times it."""
    times = host_times(fn, calls, cuda=True)
    return statistics.median(times) * 1e6, min(times) * 1e6


def profile_mode(mode: str, shape: str, calls: int, top: int) -> str:
    n, h, v = (int(s) for s in shape.split("x"))
    x, w, t = make_inputs(n, h, v)
    x.requires_grad_()
    w.requires_grad_()
    set_cuda_graphs(mode)

    def step() -> None:
        x.grad = w.grad = None
        fused_linear_cross_entropy(x, w, t).backward()

    for _ in range(20):
        step()
    whole = _host_us(step, calls)
    fwd, bwd = [], []
    for _ in range(calls):
        x.grad = w.grad = None
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = fused_linear_cross_entropy(x, w, t)
        mid = time.perf_counter()
        loss.backward()
        fwd.append(mid - start)
        bwd.append(time.perf_counter() - mid)
        del loss
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(calls):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return (f"## CUDA graphs {mode} ({graph_replay.graph_count()} captured)\n\n"
            f"host us per fwd+bwd: median {whole[0]:.0f}, least {whole[1]:.0f}; forward median "
            f"{statistics.median(fwd) * 1e6:.0f}, backward median {statistics.median(bwd) * 1e6:.0f}\n\n"
            + text.getvalue().strip() + "\n")


#: How ``stages`` calls the op: as users call it eagerly, or inside their own ``torch.compile``.
STAGE_CALLERS = ("eager", "in-compile")


def _stage_targets(caller: str = "eager") -> list[tuple[object, str, str]]:
    """(owner, attribute, label) of the functions ``stages`` times, in call order. Inside torch.compile only
    what runs at run time is timed: the API is traced away, and backward is the compiled graph's. The stages
    are those of a replayed call through the shortcuts: a shape whose calls run uncaptured (above the "auto"
    limits) shows only the whole-call lines."""
    import flce_compile.api as api
    import flce_compile.eager_shortcut as shortcut
    import flce_compile.op as op

    label = "graph replay: copies, replay, aliases"
    if caller == "in-compile":  # a call like the last one takes the op body's shortcut to the graph (as below)
        return [(op, "_forward_result", "op body"),
                (graph_replay, "body_shortcut_recent", "graph_replay.body_shortcut_recent"),
                (graph_replay, "body_shortcut_key", "graph_replay.body_shortcut_key"),
                (graph_replay, "body_shortcut_replay", "graph_replay.body_shortcut_replay"),
                (graph_replay._Graph, "replay", label)]
    # An eager call like the last one takes the shortcut (``eager_shortcut``) to the graph: its recent call's own
    # instance (``replay_recent``), else one it keys and picks (``key_of``, ``replay``).
    return [(api, "fused_linear_cross_entropy", "api call (whole forward)"),
            (shortcut, "replay_recent", "eager_shortcut.replay_recent"),
            (shortcut, "key_of", "eager_shortcut.key_of"),
            (shortcut, "replay", "eager_shortcut.replay"),
            (shortcut._ReplayedCall, "forward", "autograd.Function forward"),
            (graph_replay._Graph, "replay_unbiased", label),
            (shortcut._ReplayedCall, "backward", "shortcut backward"),
            (graph_replay._Graph, "scale_grads", "backward's scaling (graph_replay._Graph.scale_grads)")]


def stages(shape: str, calls: int, caller: str = "eager", compile_backend: str = "inductor") -> str:
    """Median host us per call of each stage of a forward + backward (inclusive: a stage's time holds the
    stages it calls), the GPU drained before each call, and how many graph replays a call made (0: the op ran
    its chunk loop uncaptured). ``caller``: "eager" (the API called directly) or "in-compile" (the API inside a
    ``torch.compile(backend=compile_backend)`` of the user's)."""
    import flce_compile.api as api

    if caller not in STAGE_CALLERS:
        raise ValueError(f"caller={caller!r}: use one of {STAGE_CALLERS}")
    n, h, v = (int(s) for s in shape.split("x"))
    x, w, t = make_inputs(n, h, v)
    x.requires_grad_()
    w.requires_grad_()
    set_cuda_graphs("auto")
    spent: dict[str, float] = {}
    replays = [0]
    originals = []

    def timed(fn, label):
        def wrapper(*args, **kwargs):
            if label.startswith("graph replay"):
                replays[0] += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - start
        return wrapper

    targets = _stage_targets(caller)
    for owner, name, label in targets:
        original = owner.__dict__[name]
        originals.append((owner, name, original))
        fn = original.__func__ if isinstance(original, staticmethod) else original
        wrapped = timed(fn, label)
        setattr(owner, name, staticmethod(wrapped) if isinstance(original, staticmethod) else wrapped)
    if caller == "eager":
        def loss_fn(a, b, c):
            return api.fused_linear_cross_entropy(a, b, c)  # through the module: the timed wrapper
    else:
        torch._dynamo.reset()
        loss_fn = torch.compile(lambda a, b, c: api.fused_linear_cross_entropy(a, b, c), backend=compile_backend,
                                dynamic=False)
    per_call: dict[str, list[float]] = {}
    replays_per_call = []
    try:
        for i in range(calls + 20):
            x.grad = w.grad = None
            torch.cuda.synchronize()
            spent.clear()
            replays[0] = 0
            start = time.perf_counter()
            loss = loss_fn(x, w, t)
            mid = time.perf_counter()
            loss.backward()
            end = time.perf_counter()
            if i < 20:
                continue
            spent["whole call"], spent["loss.backward() (whole backward)"] = end - start, end - mid
            for label, seconds in spent.items():
                per_call.setdefault(label, []).append(seconds * 1e6)
            replays_per_call.append(replays[0])
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    lines = [f"## Stages of a call, {caller} ({graph_replay.graph_count()} captured; replays per call: "
             f"{statistics.median(replays_per_call):g}; us per call, median, inclusive)", ""]
    in_backward = {"backward", "scale_grads"}  # the stages that run inside loss.backward()
    forward = [label for _, name, label in targets if name not in in_backward]
    rest = [label for _, name, label in targets if name in in_backward]
    for label in ["whole call"] + forward + ["loss.backward() (whole backward)"] + rest:
        if label in per_call:
            lines.append(f"- {label}: {statistics.median(per_call[label]):.0f}")
    return "\n".join(lines) + "\n"


class _ReplayFloor(torch.autograd.Function):
    """The structure of a replayed call of our op, doing nothing else (see ``floors``)."""

    @staticmethod
    def forward(ctx, x, w, t, parts):
        if parts["x"] is not None:  # a bound graph (``graph_replay``) reads them where they lie: no buffers
            parts["x"].copy_(x)
            parts["t"].copy_(t)
        parts["forward"].replay()
        ctx.parts = parts
        return parts["loss"].clone()

    @staticmethod
    def backward(ctx, grad):
        parts = ctx.parts
        if parts.get("direct_at") == grad.data_ptr():  # the op's graph reading grad_output where it lies
            parts["direct"].replay()
        else:
            parts["grad"].copy_(grad)
            parts["backward"].replay()
        return parts["dx"].detach(), parts["dw"].detach(), None, None


def _own_graph_parts(x, w, t) -> dict | None:
    """``_ReplayFloor``'s parts over the op's own captured graphs for (x, w, t), once calls have captured both
    (the forward's and the gradient scaling's), else None: what a replayed call of this op costs with nothing
    of ours around the two replays."""
    for _ in range(4):
        x.grad = w.grad = None
        fused_linear_cross_entropy(x, w, t).backward()
    x.grad = w.grad = None
    for instances in graph_replay._cache.graphs.values():
        for g in instances:
            if g.out.dx.shape == x.shape and g.scale_graph is not None:
                return {"x": g.x, "t": g.target, "forward": g.graph, "loss": g.out.loss, "grad": g.scale_in,
                        "backward": g.scale_graph, "dx": g.out.dx, "dw": g.out.dw, "direct": g.direct_graph,
                        "direct_at": g.direct_at[0] if g.direct_at is not None else None}
    return None


def floors(shape: str, calls: int) -> str:
    """Host us (median, least) of the pieces any replayed custom op pays, timed as a whole call is."""
    n, h, v = (int(s) for s in shape.split("x"))
    x, w, t = make_inputs(n, h, v)
    x.requires_grad_()
    w.requires_grad_()
    small = torch.zeros(16, device="cuda")
    parts = {"x": torch.empty_like(x), "t": torch.empty_like(t), "loss": torch.zeros((), device="cuda"),
             "grad": torch.zeros((), device="cuda"), "dx": torch.zeros_like(x), "dw": torch.zeros_like(w)}
    parts["forward"] = graph_of(lambda: parts["loss"].add_(parts["x"][0, 0].float()))
    parts["backward"] = graph_of(lambda: parts["dx"][0].mul_(parts["grad"].to(x.dtype)))
    one_node = graph_of(lambda: small.add_(1))

    def trivial_op() -> None:
        x.grad = w.grad = None
        _ReplayFloor.apply(x, w, t, parts).backward()

    pieces = {"one kernel launch (small.add_(1))": lambda: small.add_(1),
              "one graph replay (one node)": one_node.replay,
              "copy_ of the hidden states": lambda: parts["x"].copy_(x),
              "torch.cuda.current_stream()": torch.cuda.current_stream,
              "trivial replayed autograd.Function, fwd+bwd": trivial_op}
    own = _own_graph_parts(x, w, t)
    if own is not None:
        def own_graphs_op() -> None:
            x.grad = w.grad = None
            _ReplayFloor.apply(x, w, t, own).backward()

        def the_op() -> None:
            x.grad = w.grad = None
            fused_linear_cross_entropy(x, w, t).backward()

        pieces["the same Function over the op's own two graphs, fwd+bwd"] = own_graphs_op
        pieces["the op itself (eager shortcut), fwd+bwd"] = the_op
    for fn in pieces.values():
        for _ in range(20):
            fn()
    lines = [f"## Floors of this host (us: median, least; the GPU drained before each call; the pieces take "
             f"turns, {FLOOR_ROUNDS} rounds)", ""]
    for name, times in in_turns(pieces, calls).items():
        lines.append(f"- {name}: {statistics.median(times) * 1e6:.0f}, {min(times) * 1e6:.0f}")
    return "\n".join(lines) + "\n"


#: Rounds ``floors`` splits each piece's calls into.
FLOOR_ROUNDS = 10


def in_turns(pieces: dict[str, Callable[[], None]], calls: int, rounds: int = FLOOR_ROUNDS,
             cuda: bool = True) -> dict[str, list[float]]:
    """Host seconds of ``calls`` calls of each piece (``host_times``: on CUDA the GPU drained before each), the
    pieces taking turns over ``rounds`` rounds, so a slow spell of the host falls on all of them alike rather
    than on whichever ran then (this host's drained times drift by tens of microseconds within a run)."""
    times: dict[str, list[float]] = {name: [] for name in pieces}
    per_round = [calls // rounds + (i < calls % rounds) for i in range(rounds)]
    for n in per_round:
        for name, fn in pieces.items():
            times[name] += host_times(fn, n, cuda=cuda)
    return times


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="2048x768x50304", help="BT x H x V")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--top", type=int, default=22, help="functions listed per mode")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_profile.py profiles the CUDA launch path: it needs a GPU")
    gpu = torch.cuda.get_device_name()
    header = f"# host_profile: {gpu}, {versions()}, bf16 {args.shape}\n\n"
    report = header + "\n".join(profile_mode(mode, args.shape, args.calls, args.top) for mode in ("auto", "off"))
    report += "".join("\n" + stages(args.shape, args.calls, caller) for caller in STAGE_CALLERS)
    report += "\n" + floors(args.shape, args.calls)
    set_cuda_graphs("auto")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"host_profile_{gpu.replace(' ', '_')}.txt"
    path.write_text(report)
    print(report)
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
