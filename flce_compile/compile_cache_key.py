"""The key torch's compile caches must hold for graphs that call this package: a digest of its source and of the
strategy registry.

torch's AOT autograd cache and Inductor's FX graph cache key a graph on its nodes, its inputs, torch and its config,
not on what a custom op's Python does: a graph calling ``flce::fused_linear_cross_entropy`` holds the op's name, not
its autograd formula or fake implementation. A cache filled by another version of this package would serve that
version's traced backward (after 240ab6e, the backward scaled in place that CUDA-graph trees rebuild at every
replay, found by a review; a change of what the op's outputs mean would make it a wrong gradient). So whenever one
of the ops is traced (its fake implementation runs: Dynamo calls it before any cache is looked up) this key goes
into Inductor's config, which both caches key on (``key_compile_caches``); the ``flce`` backend's own functions
carry it too (``compiler/graph_cache.py``).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable
from pathlib import Path

from .plan import registry

#: The config entry that holds the key (``unsafe_marked_cacheable_functions`` maps names to keys).
ENTRY = "flce_compile.op"

_source: str | None = None  # ``source_key``'s answer, once read


def source_key() -> str:
    """A digest of every Python file of the package (their paths and contents)."""
    package = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return "flce_compile-" + digest.hexdigest()[:16]


def cache_key() -> str:
    """The key: the package's source and each registered strategy's name and loop (a strategy of the "recompute"
    loop saves other tensors for backward)."""
    global _source
    if _source is None:
        _source = source_key()
    loops = ",".join(f"{name}:{registry.get(name).loop}" for name in sorted(registry.names()))
    return f"{_source}-{hashlib.sha256(loops.encode()).hexdigest()[:8]}"


def mark_cacheable(names: Iterable[str]) -> bool:
    """Hold ``cache_key`` under each of ``names`` in Inductor's ``unsafe_marked_cacheable_functions``, which torch's
    compile caches read into every key (and where the AOT autograd cache looks up the functions a graph may call),
    beside the user's entries; a dict the user assigns later drops ours until the next call. False, changing
    nothing, without Inductor's config loaded (nothing is compiled then) or on a torch without the setting. Cheap
    when the entries are there already. ``cache_key``'s errors (an unreadable source file) are the caller's."""
    config = sys.modules.get("torch._inductor.config")
    marked = getattr(config, "unsafe_marked_cacheable_functions", None) if config is not None else None
    if not isinstance(marked, dict):
        return False
    key = cache_key()
    ours = {name: key for name in names}
    if any(marked.get(name) != value for name, value in ours.items()):
        # A new dict, assigned: the one there may be the config's default, which must stay as it is.
        config.unsafe_marked_cacheable_functions = {**marked, **ours}
    return True


def key_compile_caches() -> None:
    """Hold ``cache_key`` in Inductor's config (``unsafe_marked_cacheable_functions[ENTRY]``), where torch's compile
    caches read it into every key from now on (``mark_cacheable``): called whenever an op is traced."""
    mark_cacheable((ENTRY,))
