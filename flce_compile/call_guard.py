"""Whether a call's tensors and torch's global state are those of an earlier call, in two C calls.

The replay shortcuts (``eager_shortcut``, ``graph_replay``'s body shortcut) key a call on its tensors' types,
shapes, strides, dtypes, devices and requires_grad and on torch's state: some 40 torch C calls, each about 1 us in
a host-bound call on the H200's host, where a tight loop takes a fifth of that (issue #13). Dynamo checks the same
in C++ before each run of a compiled frame: ``TensorGuards`` (each tensor's exact Python type, its dispatch keys
under the thread's included and excluded keys, so also dispatch modes, functorch transforms, conjugate, negative
or zero tensors and, outside an op's body, inference mode; then dtype, device index, requires_grad, sizes and
strides) and ``GlobalStateGuard`` (grad mode, autocast, torch-function state, deterministic algorithms, TF32,
reduced-precision reductions, thread count, default dtype). A ``CallGuard`` holds both, made from the tensors of a
call that a shortcut keyed in full: a later call that it admits has the same values of those parts of the key.
Inside an op's body (below autograd, where the Autograd keys are already excluded) inference mode changes no
dispatch key: the body shortcut asks it itself.

Both guards are private to torch. A torch without them, or whose guards fail ``_self_test`` (once per process, in
a thread of its own, whose state is torch's default: what the shortcuts rely on them to refuse, they must
refuse), gets no guard (``guard_of`` answers None), and the shortcuts key every call in full as before.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor

from .log import logger

try:
    from torch._C._dynamo.guards import GlobalStateGuard as _GlobalStateGuard
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # a torch without Dynamo's C guards
    _TensorGuards = _GlobalStateGuard = None


class CallGuard:
    """The two guards of one recorded call (``guard_of``)."""

    __slots__ = ("_tensors", "_state")

    def __init__(self, tensors: Any, state: Any) -> None:
        self._tensors = tensors
        self._state = state

    def admits(self, *tensors: Tensor) -> bool:
        """Whether ``tensors`` (in the recorded call's order) and torch's state now are as at the recorded call."""
        # Dynamo's C check reads strides, which a nested tensor's C++ throws past Python on (the process aborted)
        # and a sparse one's raises on: neither was recorded, so neither is admitted.
        try:
            for t in tensors:
                if t.is_nested:
                    return False
        except AttributeError:  # not a tensor: the check refuses it
            pass
        try:
            return self._tensors.check(*tensors) and self._state.check()
        except RuntimeError:  # a sparse layout's strides
            return False


def _build(tensors: tuple[Tensor, ...]) -> CallGuard:
    # Every size and stride given as a number: each is checked (None would leave that dimension free).
    return CallGuard(_TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                                   dynamic_dims_strides=[list(t.stride()) for t in tensors]),
                     _GlobalStateGuard())


def _self_test() -> bool:
    """Whether this torch's guards admit an equal call and refuse each change the shortcuts rely on them to see
    (on small CPU tensors, in grad mode, as the shortcuts record)."""
    def pair(dtype: torch.dtype = torch.float32, requires_grad: bool = False) -> tuple[Tensor, Tensor]:
        return torch.zeros(2, 3, dtype=dtype, requires_grad=requires_grad), torch.zeros(2, dtype=torch.long)

    with torch.enable_grad():
        guard = _build(pair())
        if not guard.admits(*pair()):
            return False
        x, t = pair()
        refused = [
            (torch.zeros(3, 3), t),  # sizes (the same strides)
            (x, torch.zeros(3, dtype=torch.long)),  # the second tensor's size
            (torch.zeros(3, 2).t(), t),  # strides (the same sizes, transposed)
            (x.unsqueeze(0), t),  # dimensions
            pair(torch.float64),  # dtype
            pair(requires_grad=True),  # requires_grad
            (torch.nn.Parameter(x, requires_grad=False), t),  # type
            (x, t.int()),  # the second tensor's dtype
            (x._neg_view(), t),  # memory that is not the value
        ]
        if any(guard.admits(*probe) for probe in refused):
            return False
        with torch.no_grad():
            if guard.admits(x, t):
                return False
        with torch.inference_mode(), torch.enable_grad():
            if guard.admits(x, t):
                return False
        with torch.autocast("cpu"):
            if guard.admits(x, t):
                return False
    return True


_usable: bool | None = None  # the self-test's answer, once asked


def _self_test_in_clean_state() -> bool:
    """``_self_test`` in a new thread: the caller's thread may be inside an op's body or in inference mode, where
    the probes' expectations do not hold (and the answer is for the whole process)."""
    answer: list[bool | BaseException] = []

    def run() -> None:
        try:
            answer.append(_self_test())
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            answer.append(exc)

    thread = threading.Thread(target=run, name="flce-guard-self-test", daemon=True)
    thread.start()
    thread.join()
    if isinstance(answer[0], BaseException):
        raise answer[0]
    return answer[0]


def guard_of(*tensors: Tensor) -> CallGuard | None:
    """A guard that admits calls with tensors like ``tensors`` and torch's state as it is now; None when this torch
    has no usable guards (then key every call in full)."""
    global _usable
    if _usable is None:
        try:
            _usable = _TensorGuards is not None and _self_test_in_clean_state()
            if not _usable:
                logger.debug("flce: torch has no C guards, or they failed the self-test; the replay shortcuts key "
                             "each call in full")
        except Exception as exc:  # noqa: BLE001 - another torch's guards: key in full
            logger.debug("flce: torch's C guards are not used: %r", exc)
            _usable = False
    if not _usable:
        return None
    try:
        return _build(tensors)
    except Exception as exc:  # noqa: BLE001 - a tensor the guards cannot describe: key in full
        logger.debug("flce: no C guard for this call: %r", exc)
        return None


class RecentCall:
    """A replay shortcut's last call keyed in full whose forward it replayed: the key, the parts of the key that a
    ``CallGuard`` does not cover (``varying``: the caller works them out on every call), the device, and the guard
    of the call's tensors and state. A later call that the guard admits and whose ``varying`` is equal has the key:
    ``last`` gives what to check it against, without working the key out.

    A guard is made once per key (for ``limit`` keys), so calls that alternate between keys make none anew, and
    again when it refuses a call of its own key (torch's state moved in a part that no key holds: the thread
    count, say)."""

    __slots__ = ("last", "_guards", "_limit")

    def __init__(self, limit: int) -> None:
        #: (key, varying, cuda, device index, guard) of the recent call, or None; one attribute, read once by the
        #: caller, so that another thread's ``note`` never mixes two calls' parts.
        self.last: tuple[Any, tuple, bool, int, CallGuard] | None = None
        self._guards: dict[Any, CallGuard] = {}
        self._limit = limit

    def clear(self) -> None:
        self.last = None
        self._guards = {}

    def note(self, key: tuple, tensors: tuple[Tensor, ...]) -> None:
        """After a call with ``key`` replayed: it is the recent call (a no-op when it came through ``last``). A
        shortcut key is ``(varying, (cuda, device index, ...))``: its varying part and device are read from it."""
        last = self.last
        if last is not None and last[0] is key:
            return
        varying, (cuda, index) = key[0], key[1][:2]
        guard = self._guards.get(key)
        if guard is None or not guard.admits(*tensors):  # (a call keyed in full: rarely the recent key's)
            guard = guard_of(*tensors)
            if guard is None:
                return
            if len(self._guards) >= self._limit:
                self._guards.clear()
            self._guards[key] = guard
        self.last = (key, varying, cuda, index, guard)
