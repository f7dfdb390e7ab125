"""Triton helper: the grouped order in which a GEMM's programs walk its output tiles."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of the ``tile``-th output tile: GROUP_M row tiles walk the column tiles together, so
    the operand tiles they share stay in L2 while they are read."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + ((tile % in_group) % size_m), (tile % in_group) // size_m
