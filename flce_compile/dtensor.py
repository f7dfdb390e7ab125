"""Recognising DTensor arguments, for the ops' error messages and the vocabulary-parallel route.

The single-device op takes plain tensors only: a DTensor weight reaching it is either sharded over the
vocabulary for tensor parallelism (``vocab_parallel.vocab_parallel_linear_cross_entropy`` is its op) or laid out
some other way (FSDP's Shard(0) over a data-parallel mesh, a 2-D mesh, Shard(1), ...), which only the full
tensor can serve. Without this check torch fails deep inside with "got mixed torch.Tensor and DTensor".
"""

from __future__ import annotations

from typing import Any

import torch


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (False on a torch without torch.distributed). Plain tensors and parameters
    are answered without importing torch.distributed.tensor (the single-device op asks on every call)."""
    if t is None or type(t) in (torch.Tensor, torch.nn.Parameter):
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(t, DTensor)


def describe_layout(t: Any) -> str:
    """'placements (Shard(dim=0),) on a 1-D mesh' for a DTensor."""
    return f"placements {tuple(t.placements)} on a {t.device_mesh.ndim}-D mesh"


def is_vocab_sharded(weight: Any) -> bool:
    """Whether ``weight`` is a DTensor sharded over its rows (the vocabulary) on a 1-D mesh: (Shard(0),)."""
    if not is_dtensor(weight):
        return False
    from torch.distributed.tensor import Shard

    return weight.device_mesh.ndim == 1 and tuple(weight.placements) == (Shard(0),)


def refuse_dtensors(**tensors: Any) -> None:
    """Raise a ValueError that names the fix when any argument of the single-device op is a DTensor."""
    names = [name for name, t in tensors.items() if is_dtensor(t)]
    if not names:
        return
    weight = tensors.get("weight")
    if is_vocab_sharded(weight):
        raise ValueError(
            f"weight is a DTensor sharded over the vocabulary ({describe_layout(weight)}). If its rows are split "
            "for tensor parallelism, with the same input and target on every rank, call "
            "flce_compile.vocab_parallel_linear_cross_entropy(input, weight, target, ...): each rank computes its "
            "slice, nothing is gathered. If it is a parameter sharded for data parallelism (FSDP2), call the op "
            "inside the module's forward, where FSDP has gathered it, or pass weight.full_tensor()"
        )
    first = names[0]
    raise ValueError(
        f"{first} is a DTensor with {describe_layout(tensors[first])}: fused_linear_cross_entropy takes plain "
        f"tensors. Pass {first}.full_tensor() (exact, but gathers it on every rank); a weight sharded over the "
        "vocabulary, placements (Shard(0),) on a 1-D mesh, is served without gathering by "
        "flce_compile.vocab_parallel_linear_cross_entropy"
    )
