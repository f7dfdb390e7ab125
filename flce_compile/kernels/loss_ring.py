"""Triton kernel: store a 0-dim loss into the next slot of a ring of separate 0-dim tensors.

A replayed forward graph (``graph_replay``) writes its loss to the same address every replay, so each call used
to copy it out (a launch after the replay: 15-20 us of host time on the H200 while the graph runs, issue #13).
Captured at the end of the graph, this kernel writes the loss into one of several slots instead, picked by a
counter on the device that the kernel advances: the host knows which slot each replay wrote by counting its
replays, and hands out that slot, with no launch of its own. The slots' addresses are read from a table on the
device, so a slot can be swapped for a fresh tensor without capturing the graph again (``graph_replay.LossRing``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def loss_ring_kernel(loss_ptr, table_ptr, counter_ptr, SIZE: tl.constexpr):
    count = tl.load(counter_ptr)
    address = tl.load(table_ptr + count % SIZE)
    slot = address.to(tl.pointer_type(loss_ptr.dtype.element_ty), bitcast=True)
    tl.store(slot, tl.load(loss_ptr))
    tl.store(counter_ptr, count + 1)


def store_in_ring(loss: torch.Tensor, table: torch.Tensor, counter: torch.Tensor) -> None:
    """``slot[counter % len(table)] = loss`` and ``counter += 1``, on the device, in one launch: ``table`` holds the
    slots' addresses (int64, each slot a 0-dim tensor of ``loss``'s dtype and device), ``counter`` is a 0-dim
    int64 tensor."""
    loss_ring_kernel[(1,)](loss, table, counter, SIZE=table.numel())
