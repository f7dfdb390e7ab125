"""CUDA-graph replay of the fused op (its forward, and backward's scaling): the launch path for small calls,
which the host bounds.

At GPT-2's 2048 x 768 x 50304 the GPU finishes a forward + backward in about 1 ms, and issuing it from Python
(the chunk loop, a dozen launches, allocations) takes as long (issue #13). A CUDA graph issues the same work
in one launch. The first call with a given key runs as usual (it compiles the Triton kernels, warms cuBLAS);
the second captures the chunk loop into a graph on a side stream and replays it; later calls only copy the
hidden states and targets into the graph's own input buffers and replay. Once an instance gets them at the same
addresses twice in a row (a training loop's allocator hands out the same blocks each step), it is captured again
reading them where they lie, and calls with them there replay it with no copies (``_Graph.bound_at``). From an
instance's second backward on, backward's scaling of the outputs by grad_output is replayed from a small graph
too. The results are bit-identical to the uncaptured loop: the same kernels with the same launch parameters run
on the same data.

What a graph keys on (``replayed_forward``): device, calling stream, shapes, dtypes, the weight's (and bias's and
class weights') address and strides, the loss options, the resolved config, the requested gradients and torch's
global math settings (``math_settings``). A graph reads the weight where it was at capture; keying on the address
makes that the caller's live weight (an optimizer updates it in place, so a training loop keeps one key).

Outputs. The graph writes dX, dW, db and the gradient scale into memory it owns; a call hands out aliases of
them, and the slot of a ring its replay wrote the loss into (``LossRing``). Autograd adopts a handed-out dW as
``weight.grad``, so backward needs no copy.
An instance is only replayed when no alias of its outputs is alive anywhere (the storages' use counts, and the
Python references to their storage objects, are back to what the graph alone holds): a second forward before the
first one's backward, or gradients kept across micro-batches, captures a second instance (``MAX_INSTANCES``),
and beyond that a call runs uncaptured. Nothing a caller holds is ever overwritten. As with the caching
allocator, a consumer on another stream must be ordered after its own use before it drops the tensor; for these
outputs ``record_stream`` does not do it (a dropped loss goes back to the ring, not to the allocator). A capture
(the forward's, once per key and instance and again when its inputs settle or move; the backward scaling's, a few
times per instance) puts torch's default CUDA generator into capture mode while it lasts: another thread drawing
CUDA random numbers in that moment gets an error from torch ("off" avoids it: then nothing is captured, in forward
or backward). A capture that fails leaves the call to the uncaptured loop.

When (``set_cuda_graphs`` / ``$FLCE_CUDA_GRAPHS``): "auto" (the default) graphs calls of at most
``AUTO_MAX_FLOPS`` (6 N H V, the three GEMMs: below it the host's ~1 ms per call is not hidden behind the GPU)
whose graph would hold at most ``auto_pool_limit`` bytes (1 GiB or 2% of the GPU's memory, the smaller): a graph
keeps the op's working set, which the uncaptured op returns to the allocator after each call. "on" graphs every
eligible call, "off" none. Eligible: CUDA, reduction "mean" or "sum" with the gradients formed in forward, no
kept logits, contiguous hidden states and targets, plain tensors, bf16/fp16/fp32, no capture under way, and
no Inductor CUDA-graph trees about to run the op in their warm-up: the eager call (``op.call_fused``) and graphs
compiled by the ``flce`` backend without CUDA graphs of their own say so (``allow``); elsewhere (the op inside
the user's own ``torch.compile``) it holds while this thread has no CUDA-graph tree. Inductor's
``mode="reduce-overhead"`` graphs the op itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .call_guard import RecentCall
from .log import logger
from .plan.choose import choice_generations
from .strategies import ForwardResult, Operands

MODES = ("auto", "on", "off")
ENV_VAR = "FLCE_CUDA_GRAPHS"
#: "auto": calls with at most this many GEMM floating-point operations (6 N H V): ~3 ms on an H200 in bf16.
AUTO_MAX_FLOPS = 2e12
#: "auto": a graph holds at most this many bytes, and at most ``AUTO_MAX_POOL_SHARE`` of the GPU's memory.
AUTO_MAX_POOL_BYTES = 1 << 30
AUTO_MAX_POOL_SHARE = 0.02
#: Captured graphs kept, least recently used dropped first (dropping one frees its memory).
MAX_GRAPHS = 4
#: Graphs per key: one per forward whose outputs are still alive when the next forward of that key starts.
MAX_INSTANCES = 2
#: A key captured this many times (evicted and back, again and again) runs uncaptured from then on.
MAX_CAPTURES_PER_KEY = 3
#: Captures per key that read the hidden states and targets in place (``_Graph.bound_at``); after that, a key
#: whose inputs keep moving between addresses copies them in.
MAX_BINDS = 3
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Tensor types a replayed call may take (a subclass may mean a mode or wrapper the graph would not see).
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
#: Devices with graphs to replay (the CPU tests of the cache policy add "cpu", with a stand-in capture).
_DEVICE_TYPES = ("cuda",)


def _mode_from_env() -> str:
    value = os.environ.get(ENV_VAR, "auto").strip().lower()
    aliases = {"1": "on", "true": "on", "0": "off", "false": "off", "": "auto"}
    value = aliases.get(value, value)
    if value not in MODES:
        logger.warning("%s=%r is not one of %s (or 1/0); using 'auto'", ENV_VAR, os.environ[ENV_VAR], MODES)
        return "auto"
    return value


_mode = _mode_from_env()


def set_cuda_graphs(mode: str | bool) -> None:
    """Set when the fused op replays CUDA graphs, for this process: "auto" (default), "on"/True or "off"/False
    (see the module docstring). Turning them off drops the captured graphs and the memory they hold."""
    global _mode
    mode = {True: "on", False: "off"}.get(mode, mode) if isinstance(mode, bool) else mode
    if mode not in MODES:
        raise ValueError(f"set_cuda_graphs(mode={mode!r}): use one of {MODES}, True or False")
    _mode = mode
    if mode == "off":
        clear()


def cuda_graphs_mode() -> str:
    """The current mode: "auto", "on" or "off"."""
    return _mode


class _CallerState(threading.local):
    allowed = False
    disabled = 0
    replayed_key: tuple | None = None  # the key of this thread's last replayed forward (``record_shortcut``)


_caller = _CallerState()


def allow(on: bool) -> bool:
    """Let this thread's op calls replay graphs (``on``) or not; returns the previous setting, to restore.
    The eager call and the ``flce`` backend's graphs set it. Other calls through the dispatcher (the op inside a
    graph that Inductor compiled for the user) replay only while this thread has no Inductor CUDA-graph tree
    (``_inductor_graph_trees``): its warm-up runs the graph with a memory pool installed that must not receive
    our buffers, and that cannot be told apart from inside the op."""
    previous = _caller.allowed
    _caller.allowed = on
    return previous


class _Allowed:
    """``allowed``'s manager (a class: the eager call enters it every time)."""

    __slots__ = ("_previous",)

    def __enter__(self) -> None:
        self._previous = allow(True)

    def __exit__(self, *exc: object) -> bool:
        allow(self._previous)
        return False


def allowed() -> contextlib.AbstractContextManager:
    """``allow(True)`` for the body (the eager call, and the ``flce`` backend's compiled graphs without CUDA
    graphs of their own)."""
    return _Allowed()


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """No graph replay in this thread for the body (benchmarks measuring the op's own peak memory)."""
    _caller.disabled += 1
    try:
        yield
    finally:
        _caller.disabled -= 1


_storage_uses = getattr(torch._C, "_storage_Use_Count", None)
_CAN_COUNT_USES = _storage_uses is not None

#: How many times an instance captures the scaling graph that reads grad_output where it lies (again when
#: grad_output settles at another address); after that the graph that copies grad_output serves every call.
MAX_DIRECT_CAPTURES = 4

_HAS_FP16_ACCUMULATION = hasattr(torch._C, "_get_cublas_allow_fp16_accumulation")
# Getters of CUDA (and ROCm) builds only, or of a newer torch; where one is missing its feature does not exist, and
# the stand-in (a C call, as cheap as the getter) answers the same constant on every call.
_tunableop_enabled = getattr(torch._C, "_cuda_tunableop_is_enabled", bool)
_tunableop_tuning = getattr(torch._C, "_cuda_tunableop_tuning_is_enabled", bool)
_cublas_workspace = getattr(torch._C, "_cuda_getCublasWorkspaceSize", int)
_cublaslt_workspace = getattr(torch._C, "_cuda_getCublasLtWorkspaceSize", int)
_sm_carveout = getattr(torch._C, "_get_sm_carveout_experimental", type(None))


def math_settings() -> tuple:
    """torch's global settings that decide which kernels the op's GEMMs and operators run, and so what a capture
    fixes: TF32 for fp32 matmuls, fp16 accumulation, the preferred BLAS library, deterministic algorithms (and,
    when on, warn_only: a GEMM whose cuBLAS config is not deterministic raises without it, and warns with it),
    cuBLAS's reduced-precision (split-K) reductions of bf16 and fp16 GEMMs, TunableOp (``torch.cuda.tunable``:
    when on, a GEMM runs the solution it tuned or looked up, rocBLAS / hipBLASLt ones on ROCm, cuBLASLt ones on
    CUDA, not cuBLAS's own; and, when on, whether it tunes shapes it has no result for), the cuBLAS and cuBLASLt
    workspace sizes (``torch.backends.cuda.cublas_workspace_size``: the algorithms cuBLAS may pick) and the SM
    carveout (cuBLASLt's SM count target). In every graph and shortcut key: after a change a call takes the full
    path and gets a graph of its own, as the uncaptured op would follow the change. (A one-chunk call runs under
    the user's reduction flags; a chunked loop turns them off while it runs, in every thread: a capture then is
    keyed on the flags it ran under, so calls after the loop do not replay it.) Each flag that matters only when
    another is on is read only then: the common state costs one C call per setting."""
    C = torch._C
    try:
        tf32 = C._get_cublas_allow_tf32()
    except RuntimeError:  # the legacy and new precision APIs were mixed, and torch refuses the legacy read
        tf32 = C._get_fp32_precision_getter("cuda", "matmul")
    fp16_accumulation = C._get_cublas_allow_fp16_accumulation() if _HAS_FP16_ACCUMULATION else None
    deterministic = C._get_deterministic_algorithms()
    tunable = _tunableop_enabled()
    return (tf32, fp16_accumulation, C._get_blas_preferred_backend(), deterministic,
            deterministic and C._get_deterministic_algorithms_warn_only(),
            C._get_cublas_allow_bf16_reduced_precision_reduction(),
            C._get_cublas_allow_fp16_reduced_precision_reduction(),
            tunable, tunable and _tunableop_tuning(), _cublas_workspace(), _cublaslt_workspace(), _sm_carveout())


def _python_refs(objects: tuple) -> tuple[int, ...]:
    """Python references to each of ``objects`` (as counted from here: compare only with this function's own
    earlier answers)."""
    return tuple(map(sys.getrefcount, objects))  # (no Python frame per object: this runs on every call)


#: Slots of a forward graph's loss ring: a caller may keep this many losses (a training loop keeps one) before a
#: slot it still holds comes round, which is then replaced (``LossRing.next_slot``).
LOSS_SLOTS = 8


class LossRing:
    """Where a forward graph's replays put their losses: ``LOSS_SLOTS`` separate 0-dim tensors, written in turn
    by a kernel captured at the end of the graph (``kernels.loss_ring``), so that a replayed call hands out the
    slot its replay wrote instead of launching a copy of the graph's loss (15-20 us of host time on the H200
    while the graph runs, issue #13). The device counts the replays and picks the slot; the host counts them too
    (``next_slot`` before each replay, ``replayed`` after it), so each knows the slot without asking the other.

    A slot still held by anyone when its turn comes (an alias, a view, its storage object: as ``_Graph.free``
    asks of the outputs) is replaced by a fresh tensor first, its address written into the device's table (one
    small launch, only then): nothing a caller holds is overwritten. The slots, table and counter are ordinary
    allocations made before the capture, not the graph's pool."""

    __slots__ = ("slots", "table", "counter", "next")

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.slots = [_RingSlot(torch.empty((), dtype=dtype, device=device)) for _ in range(LOSS_SLOTS)]
        self.table = torch.tensor([s.tensor.data_ptr() for s in self.slots], dtype=torch.int64, device=device)
        self.counter = torch.zeros((), dtype=torch.int64, device=device)
        self.next = 0
        self.store(self.slots[0].tensor)  # compiled and loaded now, not inside the capture (counts reset after it)

    def store(self, loss: torch.Tensor) -> None:
        """Captured at the end of the forward graph: the loss into the counter's slot, the counter advanced."""
        from .kernels.loss_ring import store_in_ring  # triton, on first capture only

        dtype = self.slots[0].tensor.dtype
        if loss.dtype != dtype or loss.dim() != 0:
            raise RuntimeError(f"the loss ring holds 0-dim {dtype} losses, got {loss.dtype} of shape "
                               f"{tuple(loss.shape)}")
        store_in_ring(loss, self.table, self.counter)

    def reset(self) -> None:
        """After the capture: both counts at 0 (a stand-in capture on the CPU runs the graph's body once)."""
        self.counter.zero_()
        self.next = 0

    def next_slot(self) -> torch.Tensor:
        """The slot the next replay writes (called right before it), replaced first if anyone still holds it.
        Counted only by ``replayed``: a call that fails before its replay ran (an out-of-memory error for the fresh
        slot, say) leaves both counts where they were, and the table and the host's slot agree whichever step
        raised (the fresh slot is the host's only once the table holds it)."""
        i = self.next
        slot = self.slots[i]
        if _storage_uses(slot.storage) != slot.base_uses or sys.getrefcount(slot.storage_object) != slot.base_refs:
            fresh = _RingSlot(torch.empty_like(slot.tensor))
            self.table[i] = fresh.tensor.data_ptr()  # on the stream the replay runs on, before it
            slot = self.slots[i] = fresh
        return slot.tensor

    def replayed(self) -> None:
        """After a replay ran: the device's counter moved on, and so does the host's."""
        self.next = (self.next + 1) % LOSS_SLOTS


class _RingSlot:
    """One slot of a ``LossRing``: the tensor, and what tells whether anyone else holds it (as ``_Graph`` reads
    its outputs: the storage's use count and its storage object's Python references, taken when only the slot
    holds them)."""

    __slots__ = ("tensor", "storage_object", "storage", "base_uses", "base_refs")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.storage_object = tensor.untyped_storage()  # made once: it counts as a use from then on
        self.storage = self.storage_object._cdata
        self.base_uses = _storage_uses(self.storage)
        self.base_refs = sys.getrefcount(self.storage_object)


@dataclass(repr=False)  # the generated repr would print every element of the outputs' storages
class _Graph:
    """One captured forward: the graph, its input buffers and its outputs (with their storages' use counts and
    Python references when only the graph holds them), and once backward has run twice, the graphs that
    scale the outputs by grad_output (``scale_grads``: one reading a copy of it, one reading it in place).

    A handed-out output is held either through a tensor (an alias, a view, ``.grad``: each adds a use of the
    storage) or through its Python storage object alone (``t.untyped_storage()`` kept after the tensors are
    gone). That object is made once, at capture, and counts as one use whether anyone keeps it or not, so
    keeping it shows only in its Python references. Both are read once at capture: making the storage object
    on every check cost a few microseconds per output per call (issue #13)."""

    graph: Any  # torch.cuda.CUDAGraph
    x: torch.Tensor | None  # the graph's own input buffers, which each call copies into (None when bound)
    target: torch.Tensor | None
    out: ForwardResult
    handed: tuple[torch.Tensor, ...]
    storages: tuple[int, ...]  # each handed output's StorageImpl address, whose uses ``free`` counts
    base_uses: tuple[int, ...]
    storage_objects: tuple  # each handed output's Python storage object, whose references ``free`` counts
    base_refs: tuple[int, ...]
    held_bytes: int
    pool_bytes: int = 0  # what the forward graph's memory pool holds (a replacement reuses it: ``retire``)
    target_dtype: torch.dtype | None = None  # the targets' dtype the graph was captured for
    backwards: int = 0
    scale_graph: Any = None
    scale_in: torch.Tensor | None = None
    scale_failed: bool = False
    direct_graph: Any = None  # the scaling reading grad_output where it lies, at ``direct_at``
    direct_at: tuple | None = None  # (address, dtype) of the grad_output ``direct_graph`` reads
    last_grad_at: tuple | None = None  # (address, dtype) of the previous backward's grad_output
    direct_captures: int = 0
    direct_bytes: int = 0  # what ``direct_graph``'s pool holds (it replaces the last one's)
    # The forward's own capture (``_capture``): ``run`` captures it again, reading the call's hidden states and
    # targets in place when the instance gets them where its last call had them (``last_at``); a bound instance
    # replays only for calls with them at ``bound_at`` and copies nothing. (Both as ``_addresses`` gives them.)
    run: Callable[[Operands], ForwardResult] | None = None
    bound_at: tuple | None = None  # where the hidden states and targets the graph reads lie
    last_at: tuple | None = None  # where the last call's lay
    ring: LossRing | None = None  # where each replay's loss goes (the graph's own ``out.loss`` is overwritten)

    def __repr__(self) -> str:
        return (f"_Graph(bound_at={self.bound_at}, held_bytes={self.held_bytes}, backwards={self.backwards}, "
                f"scale_graph={self.scale_graph is not None}, direct_at={self.direct_at})")

    def retire(self) -> None:
        """Drop what this free instance holds (outputs, input buffers, scaling graphs) but its forward graph, which
        keeps the graph's memory pool alive for the capture that replaces it to reuse (``_captured_again``): the
        instance is never replayed again, and never stays in the cache (its ``free`` would read storages that are
        gone). Its scaling graphs' small pools are not reused: the replacement's take new ones."""
        self.out = self.handed = self.storage_objects = self.x = self.target = self.scale_in = None
        self.scale_graph = self.direct_graph = self.ring = None

    def free(self) -> bool:
        """Whether nothing outside holds the outputs (so replaying cannot overwrite anything held)."""
        return (tuple(map(_storage_uses, self.storages)) == self.base_uses
                and _python_refs(self.storage_objects) == self.base_refs)

    def replay(self, x: torch.Tensor, target: torch.Tensor) -> ForwardResult:
        """The forward on ``x`` and ``target`` (a bound instance's caller has checked they lie at ``bound_at``)."""
        if self.bound_at is None:
            self.x.copy_(x)
            self.target.copy_(target)
        loss = self.ring.next_slot()
        self.graph.replay()
        self.ring.replayed()
        out = self.out
        grad_scale = _alias(out.grad_scale)
        grad_scale._flce_graph = self  # how backward finds the graph that owns these outputs (``scaled_by_graph``)
        return ForwardResult(loss.detach(), None, _alias(out.dx), _alias(out.dw), _alias(out.db), None, grad_scale)

    def replay_unbiased(self, x: torch.Tensor, target: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """``replay`` for a call without bias whose caller keeps this graph for backward itself (the eager
        shortcut): (loss, dx, dw, grad_scale), with no result object and no tag on grad_scale (each a few
        microseconds of a host-bound call, issue #13)."""
        if self.bound_at is None:
            self.x.copy_(x)
            self.target.copy_(target)
        loss = self.ring.next_slot()
        self.graph.replay()
        self.ring.replayed()
        out = self.out
        dx, dw = out.dx, out.dw
        return (loss.detach(), dx.detach() if dx is not None else None, dw.detach() if dw is not None else None,
                out.grad_scale.detach())

    def scale_grads(self, grad_output: torch.Tensor, scale: Callable[[tuple, torch.Tensor, torch.Tensor], None]
                    ) -> bool:
        """Scale the outputs in place by grad_output through a captured ``scale(grads, grad_output, grad_scale)``
        (captured at the second backward: the first compiles and warms what it launches). False: run it
        uncaptured.

        The first graph reads a copy of grad_output (``scale_in``). In a training loop ``loss.backward()``'s
        grad_output (``ones_like``) usually comes from the same caching-allocator block every step, so once two
        backwards in a row had it at one address, a second graph is captured that reads grad_output there
        itself, and calls with grad_output at that address (and of that dtype) replay it without the copy: a
        copy issued while the forward's graph still runs cost ~30-50 us of host time on the H200 (issue #13).
        The graph reads whatever lies at the address when it runs, which is then this call's grad_output."""
        self.backwards += 1
        try:
            at = (grad_output.data_ptr(), grad_output.dtype) if _memory_is_value(grad_output) else None
        except RuntimeError:  # no memory to read (a sparse or vmap-batched grad_output): the op's own scaling
            return False
        if at is not None and at == self.direct_at:
            self.direct_graph.replay()
            return True
        if self.scale_graph is None:
            if self.scale_failed or self.backwards < 2:
                return False
            grad_in = torch.empty_like(grad_output)
            if not self._capture_scaling(grad_in, scale, direct=False):
                return False
            self.scale_in = grad_in
        elif (at is not None and at == self.last_grad_at and self.direct_captures < MAX_DIRECT_CAPTURES
              and self._capture_scaling(grad_output, scale, direct=True)):
            self.direct_at = at
            self.direct_graph.replay()
            return True
        self.last_grad_at = at
        self.scale_in.copy_(grad_output)
        self.scale_graph.replay()
        return True

    def _capture_scaling(self, grad_in: torch.Tensor, scale: Callable[[tuple, torch.Tensor, torch.Tensor], None],
                         direct: bool) -> bool:
        """Capture ``scale`` reading grad_output from ``grad_in`` into ``direct_graph`` (``direct``: the caller's
        own grad_output, not kept) or ``scale_graph``; False, logged, when the capture fails (the first
        graph's failure turns captured scaling off for this instance)."""
        out = self.out
        grads = tuple(t if t is not None else out.grad_scale.new_empty(0) for t in (out.dx, out.dw, out.db))

        def body() -> None:
            scale(grads, grad_in, out.grad_scale)

        with _cache.lock:  # one capture at a time on the device's capture stream
            try:
                graph, _, pool_bytes = _captured(body, grad_in.device, _current_stream(grad_in.device),
                                                 outputs=False)
            except Exception as exc:  # noqa: BLE001 - run it uncaptured
                if direct:
                    self.direct_captures = MAX_DIRECT_CAPTURES
                else:
                    self.scale_failed = True
                logger.warning("flce: CUDA-graph capture of the gradient scaling failed, running it %s: %r",
                               "from the copied grad_output" if direct else "uncaptured", exc)
                return False
        if direct:
            self.held_bytes -= self.direct_bytes
            self.direct_graph, self.direct_bytes = graph, pool_bytes
            self.direct_captures += 1
        else:
            self.scale_graph = graph
        self.held_bytes += pool_bytes
        return True


def _alias(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.detach() if t is not None else None


class _Cache:
    """Captured graphs by key (least recently used first), keys seen once, and capture counts."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.graphs: OrderedDict[tuple, list[_Graph]] = OrderedDict()
        self.seen: OrderedDict[tuple, tuple | None] = OrderedDict()  # key -> its warm-up call's ``_addresses``
        self.captures: dict[tuple, int] = {}
        self.binds: dict[tuple, int] = {}
        self.failed: set[tuple] = set()

    def count(self) -> int:
        return sum(len(v) for v in self.graphs.values())

    def evict_beyond(self, limit: int) -> None:
        while self.graphs and self.count() > limit:
            key, instances = next(iter(self.graphs.items()))
            instances.pop(0)
            if not instances:
                del self.graphs[key]


_cache = _Cache()


def clear() -> None:
    """Drop every captured graph (their memory returns once no handed-out output is alive)."""
    global _HOT_BODY
    with _cache.lock:
        _cache.graphs.clear()
        _cache.seen.clear()
        _cache.captures.clear()
        _cache.binds.clear()
        _cache.failed.clear()
    _BODY_SHORTCUTS.clear()
    _RECENT_BODY.clear()
    _HOT_BODY = None


def held_bytes(device: torch.device | None = None) -> int:
    """Bytes the captured graphs hold (their memory pools and input buffers), on ``device`` or all devices."""
    wanted = None if device is None else _normal(torch.device(device))
    with _cache.lock:
        return sum(g.held_bytes for key, instances in _cache.graphs.items() for g in instances
                   if wanted is None or key[0] == wanted)


def graph_count() -> int:
    """How many captured graphs are kept."""
    with _cache.lock:
        return _cache.count()


def _normal(device: torch.device) -> torch.device:
    """``device`` with its index ("cuda" is the current GPU), as tensors name theirs."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class GraphKey(tuple):
    """A graph's key (``replayed_forward``), its hash computed once. The shortcuts look their graph key up twice
    on every call (the cache's lookup and its least-recently-used order), and a key holds some twenty values,
    the resolved config's dataclass among them, whose hash Python would otherwise work out afresh each time
    (a few microseconds a call on the H200's host, issue #13). Equal to, and hashed as, the plain tuple."""

    def __new__(cls, items: tuple) -> "GraphKey":
        key = super().__new__(cls, items)
        key._hash = tuple.__hash__(key)
        return key

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:  # a copy hashes afresh: another process hashes strings otherwise
        return GraphKey, (tuple(self),)


def _tensor_key(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def _eligible(ops: Operands, grads_in_forward: bool) -> bool:
    x, target = ops.x, ops.target
    if not grads_in_forward or not replay_allowed_now(x.is_cuda):
        return False
    if x.device.type not in _DEVICE_TYPES or x.dtype not in _DTYPES or x.numel() == 0:
        return False
    if not _caller.allowed and _inductor_graph_trees(x.get_device() if x.is_cuda else -1):
        return False
    if not x.is_contiguous() or not target.is_contiguous():
        return False
    tensors = (x, ops.weight, target, ops.bias, ops.ce_weight)
    return all(t is None or type(t) in PLAIN_TENSORS for t in tensors)


def _inductor_graph_trees(cuda_index: int) -> bool:
    """Whether Inductor's CUDA-graph trees (``mode="reduce-overhead"``) have a manager for CUDA device
    ``cuda_index`` (-1: not a GPU, which has none) in this thread, or whether that cannot be told (then the
    answer is yes). By index, not device object: the body shortcut asks on every call."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:  # never imported: no compiled graph of this process uses them
        return False
    if cuda_index < 0:
        return False
    try:
        return trees.get_manager(cuda_index, create_if_none_exists=False) is not None
    except Exception:  # noqa: BLE001 - another torch's internals: assume the trees are there
        return True


def _current_stream(device: torch.device) -> Any:
    """The calling stream (CUDA); None elsewhere (only the CPU tests of the cache get there). Only a capture
    needs the object; keys use ``_stream_id``."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


# torch.cuda.current_stream builds a Stream object through Python (~10 us per call on the H200's host, issue
# #13); the raw handle is one C call (what Inductor's generated code uses).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream_id(device: torch.device) -> int | None:
    """The calling stream's handle on ``device`` (CUDA; None elsewhere), to key graphs on."""
    return stream_handle(device.index) if device.type == "cuda" else None


def stream_handle(index: int) -> int:
    """The calling stream's handle on CUDA device ``index``."""
    if _raw_stream is None:  # a torch without the raw call
        return torch.cuda.current_stream(index).cuda_stream
    return _raw_stream(index)


def auto_pool_limit(device: torch.device) -> int:
    """The most bytes an "auto" graph may hold on ``device``: 1 GiB, or 2% of its memory when that is less."""
    total = torch.cuda.get_device_properties(device).total_memory
    return int(min(AUTO_MAX_POOL_BYTES, AUTO_MAX_POOL_SHARE * total))


def _worth_it(ops: Operands, estimated_bytes: Callable[[], int]) -> bool:
    """Whether the mode graphs this call (asked again each time: the mode can change)."""
    if _mode == "on":
        return True
    n, h = ops.x.shape
    flops = 6.0 * n * h * ops.weight.shape[0]
    return flops <= AUTO_MAX_FLOPS and estimated_bytes() <= auto_pool_limit(ops.x.device)


def replayed_forward(
    ops: Operands,
    key_extra: tuple,
    run: Callable[[Operands], ForwardResult],
    *,
    grads_in_forward: bool,
    estimated_bytes: Callable[[], int],
) -> ForwardResult | None:
    """``run(ops)`` through a captured graph, or None when this call should run uncaptured (ineligible, the
    key's first call, every instance busy, or the capture failed): the caller then calls ``run(ops)`` itself.

    ``key_extra``: whatever else decides the captured work (loss options, resolved config, gradients asked).
    ``estimated_bytes``: what a graph of this call would hold (for "auto"), asked only when it matters.
    """
    if not _eligible(ops, grads_in_forward):
        return None
    device = ops.x.device
    key = GraphKey((device, _stream_id(device), tuple(ops.x.shape), ops.x.dtype, ops.target.dtype,
                    _tensor_key(ops.weight), _tensor_key(ops.bias), _tensor_key(ops.ce_weight),
                    torch.is_inference_mode_enabled(), math_settings()) + key_extra)
    with _cache.lock:
        instances, free = _free_instance_locked(key, ops.x, ops.target, lambda dtype: ops)
        if free is not None:
            return free.replay(ops.x, ops.target)
        at = _addresses(ops.x, ops.target)
        if instances is not None:
            if len(instances) >= MAX_INSTANCES:
                return None
        elif key not in _cache.seen:  # the first call warms up (Triton compiles, cuBLAS initialises)
            _cache.seen[key] = at
            while len(_cache.seen) > 256:
                _cache.seen.popitem(last=False)
            return None
        if key in _cache.failed or _cache.captures.get(key, 0) >= MAX_CAPTURES_PER_KEY:
            return None
        if not _worth_it(ops, estimated_bytes):
            return None
        _cache.captures[key] = _cache.captures.get(key, 0) + 1
        if len(_cache.captures) > 1024:
            _cache.captures.clear()
            _cache.binds.clear()
        # The warm-up call had its inputs where this one has them: read them there from the start.
        bind = instances is None and at is not None and _cache.seen.get(key) == at and _take_bind(key)
        try:
            g = _capture(ops, run, _current_stream(device), bind=bind)
        except Exception as exc:  # noqa: BLE001 - a capture problem must not fail the call: run it uncaptured
            _cache.failed.add(key)
            logger.warning("flce: CUDA-graph capture of the fused op failed, running it uncaptured: %r", exc)
            return None
        _cache.graphs.setdefault(key, []).append(g)
        _cache.graphs.move_to_end(key)
        _cache.evict_beyond(MAX_GRAPHS)
        logger.debug("flce: captured a CUDA graph of the fused op (%d held, %.1f MB)", _cache.count(),
                     g.held_bytes / 1e6)
        _caller.replayed_key = key
        return g.replay(ops.x, ops.target)


def replays_on(cuda: bool) -> bool:
    """Whether calls on a GPU (``cuda``), or else on the CPU, ever replay graphs (the CPU only in tests, with a
    stand-in capture): the shortcuts key no call that never could."""
    return ("cuda" if cuda else "cpu") in _DEVICE_TYPES


def forget_replayed_key() -> None:
    """Start a call whose replay (if any) ``record_shortcut`` is then to record."""
    _caller.replayed_key = None


def record_shortcut(table: dict, limit: int, key: tuple | None, value_of: Callable[[tuple], Any]) -> None:
    """After a call with shortcut ``key`` ran in full: if its forward was replayed (the key of the graph this
    thread replayed since ``forget_replayed_key``), ``table[key] = value_of(graph key)``, so later calls with
    the key go to that graph; the table starts afresh beyond ``limit`` keys. Nothing is recorded when the tuning
    DB could not be read (a shortcut key is (varying, rest), and the last of varying, its ``choice_generations``,
    holds None): nothing is memoised on it then. The shortcuts' common last step (``body_shortcut_remember``,
    ``eager_shortcut.remember``)."""
    graph_key = _caller.replayed_key
    if key is None or graph_key is None or key[0][-1][1] is None:
        return
    if len(table) >= limit:
        table.clear()
    table[key] = value_of(graph_key)


def replay_free_instance(key: tuple, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         run: Callable[[_Graph], Any]) -> Any:
    """``run(graph)`` on a captured instance of ``key`` whose outputs nobody holds and that can read ``x`` and
    ``target`` (the call's hidden states and targets, of any leading dimensions, the targets of any integer dtype),
    under the cache's lock (so no other thread replays it meanwhile): ``run`` replays it (``_Graph.replay``, or
    ``_Graph.replay_unbiased`` for the eager shortcut). None,
    running nothing, when the key was dropped (evicted, ``clear``), every instance is busy, or capturing one for
    this call failed. For the shortcuts, which keyed the call themselves (a call without bias or class weights);
    counts as a use of the key, as a replay through ``replayed_forward`` does, and is what ``record_shortcut``
    records."""
    def operands(dtype: torch.dtype) -> Operands:  # the full path converts the targets to the graph's dtype
        return Operands(x.view(-1, x.shape[-1]), weight, target.view(-1).to(dtype))

    with _cache.lock:
        _, free = _free_instance_locked(key, x, target, operands)
        return run(free) if free is not None else None


def replay_bound_instance(key: tuple, graph: _Graph, x: torch.Tensor, target: torch.Tensor,
                          apply: Callable[..., Any], args: tuple) -> Any:
    """``apply(*args)`` (which replays ``graph``) under the cache's lock, when ``graph`` is still an instance of
    ``key``, nothing outside holds its outputs and it reads its inputs where ``x`` and ``target`` lie; None,
    running nothing, otherwise. The shortcuts' repeat of their recent call (``eager_shortcut.replay_recent``,
    ``body_shortcut_recent``), which keeps the instance it replayed: what ``replay_free_instance`` finds among the
    key's instances, asked of that one. Counts as a use of the key."""
    with _cache.lock:
        instances = _cache.graphs.get(key)
        if instances is None:
            return None
        for g in instances:  # by identity: a retired or evicted instance is in no list (and is never replayed)
            if g is graph:
                break
        else:
            return None
        if graph.bound_at != _addresses(x, target) or not graph.free():  # (``hot_record``: bound_at is set)
            return None
        _cache.graphs.move_to_end(key)
        # As ``_free_instance_locked``: an eager call that took the full path may reach the op body's shortcut, and
        # its ``eager_shortcut.remember`` records the eager key from this.
        _caller.replayed_key = key
        return apply(*args)


def _memory_is_value(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory holds its value, so that a graph may read it where it lies: not for a negative view
    (``z.conj().imag`` lies where ``z.imag`` does) or a zero tensor; those are copied in."""
    return not (t.is_neg() or t._is_zerotensor())


def _addresses(x: torch.Tensor, target: torch.Tensor) -> tuple | None:
    """Where a call's hidden states and targets lie, with the targets' dtype (a graph keyed on other targets'
    dtype reads converted copies), as a bound graph reads them in place; None when their memory is not their
    value (``_memory_is_value``): such a call copies. (The hidden states' dtype is in every key.)"""
    if x.is_neg() or x._is_zerotensor() or target.is_neg() or target._is_zerotensor():  # ``_memory_is_value``, inline
        return None
    return x.data_ptr(), target.data_ptr(), target.dtype


def _free_instance_locked(key: tuple, x: torch.Tensor, target: torch.Tensor,
                          operands: Callable[[torch.dtype], Operands]) -> tuple[list[_Graph] | None, _Graph | None]:
    """(``key``'s captured instances or None, an instance to replay for a call on ``x`` and ``target`` or None),
    the key marked as used and, when there is an instance to replay, as this thread's replayed key. The caller
    holds ``_cache.lock`` and replays the instance before releasing it.

    Of the instances whose outputs nobody holds, one bound where the call's inputs lie comes first, then one
    that copies them in. A copying instance that gets them where its last call had them is captured anew, bound
    there, and a free instance bound elsewhere, when no other can take the call, is captured anew copying
    (``operands(dtype)``: the call's operands, its targets in that dtype, for the capture): either replaces the
    old instance and reuses its memory. When that capture fails the old instance is gone too, and the answer is
    None."""
    instances = _cache.graphs.get(key)
    if instances is None:
        return None, None
    _cache.graphs.move_to_end(key)
    at = _addresses(x, target)
    copying = elsewhere = None
    for i, g in enumerate(instances):
        if not g.free():
            continue
        if g.bound_at is None:
            if copying is None:
                copying = i
        elif g.bound_at == at:
            _caller.replayed_key = key
            return instances, g
        elif elsewhere is None:
            elsewhere = i
    if copying is not None:
        g = instances[copying]
        settled = at is not None and at == g.last_at and at[2] == g.target_dtype
        g.last_at = at
        if settled and key not in _cache.failed and _take_bind(key):
            g = _captured_again(key, instances, copying, operands(g.target_dtype), bind=True)
    elif elsewhere is not None and key not in _cache.failed:
        g = _captured_again(key, instances, elsewhere, operands(instances[elsewhere].target_dtype), bind=False)
    else:
        g = None
    if g is None:
        return instances, None
    _caller.replayed_key = key
    return instances, g


def _take_bind(key: tuple) -> bool:
    """Whether ``key`` may capture one more graph that reads its inputs in place (``MAX_BINDS``); counts it."""
    taken = _cache.binds.get(key, 0)
    if taken >= MAX_BINDS:
        return False
    _cache.binds[key] = taken + 1
    return True


def _captured_again(key: tuple, instances: list[_Graph], i: int, ops: Operands, *, bind: bool) -> _Graph | None:
    """Instance ``i`` of ``key`` (free: nothing held is lost) captured anew on ``ops``, reading their hidden states
    and targets in place (``bind``) or copies of them, in the old one's place and its memory pool: the old outputs
    are dropped first, so the new graph's take their memory instead of adding to it. None when the capture fails
    (logged): the old instance is gone, the key binds no more, and the call takes the full path (which captures a
    copying instance, or runs uncaptured). (A capture that CUDA itself refused leaves torch counting one more
    graph on the old pool, which is then never released: rare, and one pool per key at most.)"""
    old = instances[i]
    old.retire()
    try:
        g = _capture(ops, old.run, _current_stream(ops.x.device), bind=bind, pool_of=old)
    except BaseException as exc:  # a retired instance must never stay in the cache, even on KeyboardInterrupt
        del instances[i]
        if not instances:
            del _cache.graphs[key]
        _cache.binds[key] = MAX_BINDS
        if not isinstance(exc, Exception):  # the call is abandoned (an interrupt)
            raise
        logger.warning("flce: CUDA-graph capture of the fused op %s failed; its inputs are copied from now on: %r",
                       "reading its inputs in place" if bind else "copying its inputs", exc)
        return None
    instances[i] = g
    logger.debug("flce: captured the fused op again, %s", "reading its inputs in place" if bind else "copying them")
    return g


def replay_allowed_now(cuda: bool) -> bool:
    """What ``_eligible``, the shortcuts (forward and the eager one's backward) and ``scaled_by_graph`` ask of this
    thread's state on every call, beyond
    the call's own tensors: graphs not turned off, no ``disabled()`` block, no dispatch mode (a FLOP counter, say,
    must see every operator), and (``cuda``: the call's tensors are on a GPU) no capture under way on the current
    stream."""
    if _mode == "off" or _caller.disabled or not _CAN_COUNT_USES or torch._C._len_torch_dispatch_stack():
        return False
    return not (cuda and _stream_capturing())


# ``torch.cuda.is_current_stream_capturing`` without its Python frame (each frame of a replayed call costs
# several times its tight-loop time on the H200's host, issue #13).
_stream_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


# -- the op body's shortcut -------------------------------------------------------------------------------------
#
# Through the dispatcher (the op in a compiled graph) every call runs the op body: options decoded, the device
# switched, the config looked up, eligibility asked, the graph key built (~40-60 us on the H200's host, issue
# #13). A call with the arguments of one whose forward was replayed (same options, config string, gradients,
# shapes, dtypes, devices, weight address and layout, stream, inference mode, math settings, tensor types) has the
# same answers, so it replays that graph directly; what can change between such calls (the mode, ``disabled``, a
# dispatch mode, a capture, Inductor's graph trees, inference mode, the config's generations, a free instance) is
# asked again. A call that the recent call's C guard (``call_guard``) admits, with the same varying parts
# (``_body_varying``), has its key without working it out.

#: Body calls' keys -> the graph key their full body replayed.
_BODY_SHORTCUTS: dict[tuple, tuple] = {}
MAX_BODY_SHORTCUTS = 64
#: The last body call that took the shortcut, whose key a call its guard admits has too (``body_shortcut_key``).
_RECENT_BODY = RecentCall(MAX_BODY_SHORTCUTS)
#: ``hot_record`` of the recent body shortcut call (``body_shortcut_recent``).
_HOT_BODY: tuple | None = None


def body_shortcut_key(ops: Operands, extra: tuple) -> tuple | None:
    """The body shortcut's key of a forward on ``ops`` with the op's other arguments ``extra``, or None when the
    call cannot take the shortcut (a bias or class weights, tensor subclasses, non-contiguous inputs, a device
    without graphs). Holds the config's generations, read before the full body chooses the config (a change then
    makes a new key). A call that the recent call's guard admits, with equal other parts (``_body_varying``), has
    its key (``call_guard.RecentCall``). Forgets the replayed key a previous forward left behind
    (``body_shortcut_remember`` reads this call's)."""
    forget_replayed_key()
    x, weight, target = ops.x, ops.weight, ops.target
    if ops.bias is not None or ops.ce_weight is not None:
        return None
    recent = _RECENT_BODY.last  # (inline, as in ``eager_shortcut.key_of``: a method would add a frame per call)
    if recent is not None:
        key, varying, cuda, index, guard = recent
        if guard.admits(x, weight, target) and _body_varying(extra, weight, cuda, index) == varying:
            return key
    if not replays_on(x.is_cuda) or type(x) not in PLAIN_TENSORS:
        return None
    if type(weight) not in PLAIN_TENSORS or type(target) not in PLAIN_TENSORS:
        return None
    if not (x.is_contiguous() and target.is_contiguous()):
        return None
    cuda = x.is_cuda
    index = x.get_device()
    return GraphKey((_body_varying(extra, weight, cuda, index), (
        cuda, index, x.shape, x.dtype, target.shape, target.get_device(), target.dtype, weight.shape, weight.dtype,
        weight.stride(), weight.get_device())))


def _body_varying(extra: tuple, weight: torch.Tensor, cuda: bool, index: int) -> tuple:
    """The parts of a body call's key that its guard does not cover: the op's other arguments, inference mode (in
    the body, below autograd, it changes no dispatch key the guard sees: a graph captured in it holds inference
    tensors), the stream, the weight's address, torch's math settings and the config's generations (last, as
    ``record_shortcut`` reads them)."""
    return (extra, torch.is_inference_mode_enabled(), stream_handle(index) if cuda else None, weight.data_ptr(),
            math_settings(), choice_generations(cuda))


def body_shortcut_recent(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, extra: tuple
                         ) -> ForwardResult | None:
    """The forward of a body call (no bias, no class weights) that repeats the recent body shortcut call, from the
    very instance that call replayed; None, running nothing, for any other call (then ``body_shortcut_key`` and
    ``body_shortcut_replay``). ``body_shortcut_key``'s and ``body_shortcut_replay``'s checks in one frame, as
    ``eager_shortcut.replay_recent`` asks them for the eager call (issue #13)."""
    hot = _HOT_BODY
    if hot is None:
        return None
    key, varying, cuda, index, guard, graph_key, graph_ref = hot
    if not (guard.admits(x, weight, target) and _body_varying(extra, weight, cuda, index) == varying
            and replay_allowed_now(cuda)):
        return None
    if not _caller.allowed and _inductor_graph_trees(index if cuda else -1):
        return None
    graph = graph_ref()
    if graph is None:
        return None
    return replay_bound_instance(graph_key, graph, x, target, graph.replay, (x, target))


def hot_record(recent: RecentCall, key: tuple, destination: Any, graph: _Graph) -> tuple | None:
    """What a repeat of the call just replayed through a shortcut needs (``body_shortcut_recent``,
    ``eager_shortcut.replay_recent``): the recent call's record (``recent.last``, when it is this call's ``key``)
    with where the shortcut sends it (``destination``: the graph key, or the eager shortcut's entry, which holds it) and
    the instance, held weakly (``clear`` must free it; a record outliving its instance's place in the cache is
    refused by ``replay_bound_instance``); None when the instance copies its inputs (a repeat must find them where
    it reads them) or the guard did not record the call."""
    last = recent.last
    if last is None or last[0] is not key or graph.bound_at is None:
        return None
    return (*last, destination, weakref.ref(graph))


def body_shortcut_replay(key: tuple | None, ops: Operands) -> ForwardResult | None:
    """The forward of a body call through its shortcut (``body_shortcut_key``), or None: run the full body."""
    global _HOT_BODY
    graph_key = _BODY_SHORTCUTS.get(key) if key is not None else None
    if graph_key is None:
        return None
    cuda, index = key[1][:2]  # (varying, (cuda, index, ...)): ``body_shortcut_key``
    if not replay_allowed_now(cuda):
        return None
    if not _caller.allowed and _inductor_graph_trees(index if cuda else -1):
        return None
    x, weight, target = ops.x, ops.weight, ops.target
    replayed = replay_free_instance(graph_key, x, weight, target, lambda g: (g.replay(x, target), g))
    if replayed is None:
        return None
    result, graph = replayed
    _RECENT_BODY.note(key, (x, weight, target))
    _HOT_BODY = hot_record(_RECENT_BODY, key, graph_key, graph)
    return result


def body_shortcut_remember(key: tuple | None) -> None:
    """After a body call with ``key`` ran in full: if its forward was replayed, later calls with the key go to
    that graph (``record_shortcut``)."""
    record_shortcut(_BODY_SHORTCUTS, MAX_BODY_SHORTCUTS, key, lambda graph_key: graph_key)


def _capture(ops: Operands, run: Callable[[Operands], ForwardResult], stream: Any, *, bind: bool = False,
             pool_of: _Graph | None = None) -> _Graph:
    """Capture ``run`` ordered after ``stream``, on copies of the hidden states and targets, or (``bind``) on
    them where they lie: the graph then keeps only their addresses, which a call must match to replay it.
    ``pool_of``: a retired instance whose memory pool the graph allocates from (``_captured_again``)."""
    if bind:  # the caller's memory, not its tensors (nothing may keep its leaves, or their .grad, alive)
        x = target = None
        static = dataclasses.replace(ops, x=ops.x.detach(), target=ops.target.detach())
    else:
        x, target = torch.empty_like(ops.x), torch.empty_like(ops.target)
        static = dataclasses.replace(ops, x=x, target=target)
    pool = pool_of.graph.pool() if pool_of is not None else None
    ring = LossRing(ops.x.device, torch.float32)  # (graphs take bf16/fp16/fp32 inputs: an fp32 loss)

    def body() -> ForwardResult:
        result = run(static)
        ring.store(result.loss)
        return result

    with torch.no_grad():  # a shortcut captures again outside the op's autograd Function
        graph, out, pool_bytes = _captured(body, ops.x.device, stream, pool=pool)
    ring.reset()
    if pool_of is not None:
        pool_bytes += pool_of.pool_bytes
    if out.lse is not None or out.logits is not None:
        raise RuntimeError("only forwards that form their gradients are captured")
    handed = tuple(t for t in (out.dx, out.dw, out.db, out.grad_scale) if t is not None)
    storage_objects = tuple(t.untyped_storage() for t in handed)
    storages = tuple(o._cdata for o in storage_objects)
    buffers = 0 if bind else x.nbytes + target.nbytes
    at = _addresses(ops.x, ops.target)
    g = _Graph(graph, x, target, out, handed, storages, tuple(map(_storage_uses, storages)), storage_objects, (),
               pool_bytes + buffers, pool_bytes=pool_bytes, target_dtype=ops.target.dtype, run=run,
               bound_at=at if bind else None, last_at=at, ring=ring)
    g.base_refs = _python_refs(g.storage_objects)  # read as ``free`` reads them, from where it reads them
    return g


_capture_streams: dict[torch.device, torch.cuda.Stream] = {}


def _captured(fn: Callable[[], Any], device: torch.device, stream: Any, *, outputs: bool = True, pool: Any = None
              ) -> tuple[Any, Any, int]:
    """Capture ``fn()`` into a CUDA graph on the device's capture stream, ordered after ``stream`` (and
    ``stream`` after it): (the graph, what ``fn`` returned, the bytes its memory pool took). ``outputs``: whether
    ``fn`` returns the tensors the graph writes, or only updates tensors in place (the CPU tests' stand-in
    capture has to run the first kind once, and must not run the second). ``pool``: another graph's memory pool
    to allocate from (``torch.cuda.CUDAGraph.pool()``), else a new one."""
    side = _capture_streams.get(device)
    if side is None:
        side = _capture_streams[device] = torch.cuda.Stream(device)
    # The graph's private pool is new memory: what the capture adds to the reserved bytes (approximate when
    # other threads allocate meanwhile).
    reserved = torch.cuda.memory_reserved(device)
    side.wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        # thread_local: another thread's CUDA calls during the capture neither break it nor are refused.
        _ended_or_reset(graph.capture_begin, side, pool=pool, capture_error_mode="thread_local")
        try:
            result = fn()
        finally:
            _ended_or_reset(graph.capture_end, side)
    stream.wait_stream(side)
    return graph, result, max(torch.cuda.memory_reserved(device) - reserved, 0)


def scaled_by_graph(grad_scale: torch.Tensor, grad_output: torch.Tensor,
                    scale: Callable[[tuple, torch.Tensor, torch.Tensor], None]) -> bool:
    """Backward's scaling of a replayed forward's outputs (``grad_scale`` is its handed-out alias) by
    ``grad_output``, replayed from a graph of ``scale(grads, grad_output, grad_scale)``; False when this call
    must run it itself (not a replayed forward, an unusual grad_output, inside a capture or a dispatch mode, graphs
    turned off since the forward or a ``disabled()`` block)."""
    owner = getattr(grad_scale, "_flce_graph", None)
    if owner is None or type(grad_output) is not torch.Tensor or grad_output.dim() != 0:
        return False
    # Device indices and is_cuda, not device objects: this runs in every backward of a replayed call.
    if grad_output.get_device() != grad_scale.get_device() or grad_output.is_cuda != grad_scale.is_cuda:
        return False
    if not replay_allowed_now(grad_output.is_cuda):  # the thread state a forward's replay asks of too
        return False
    return owner.scale_grads(grad_output, scale)


def _ended_or_reset(step: Callable[..., None], side: torch.cuda.Stream, **kwargs: Any) -> None:
    """Run ``step`` (a capture's begin or end); if it raises, end the CUDA RNG's capture mode before re-raising.

    capture_begin puts the default CUDA generator into capture mode and only a capture_end that succeeds takes
    it out; after an invalidated capture (an operation the capture refuses) every later random op of the
    process would raise "Offset increment outside graph capture". A small capture that succeeds, on the same
    stream, takes the generator out again."""
    try:
        step(**kwargs)
    except Exception:
        try:
            probe = torch.zeros(1, device=side.device)
            reset = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                reset.capture_begin(capture_error_mode="thread_local")
                try:
                    probe.add_(1)  # a node, so the graph is not empty (torch warns about empty ones)
                finally:
                    reset.capture_end()
        except Exception as exc:  # noqa: BLE001 - report, then raise the capture's own error
            logger.warning("flce: could not reset CUDA RNG state after a failed graph capture: %r", exc)
        raise
