"""Triton kernels, one a file.

``CE_CHUNK_REVISION`` and ``LANE_WIDTH`` are importable without triton: the tuner records the revision with each
CE tile it picks, and ``strategies.ce_triton`` counts a launch's lanes with the width.
"""

#: Revision of ``ce_chunk.ce_chunk_kernel``, bumped when a change to it can change which tile is fastest (2: the
#: padded walk and the leaner per-element math of 2026-12-01; 3: ignored rows skipped, and pass 1's -inf fill
#: instead of a select, later that day; 4: pass 2 walks each row backwards, 2026-12-04; 5: a tile may run pass 1
#: lane-wise, ``FLCEConfig.lane_pass``, 2026-12-07: the re-pick times every tile both ways).
#: ``flce-tune --retune-ce-tiles --skip-existing`` re-picks the entries whose tile was picked for another revision.
CE_CHUNK_REVISION = 5
#: Elements a lane holds in each block of the CE kernel's lane-wise pass 1 (``ce_chunk._lane_pass``): one
#: thread's 16-byte load of bf16. ``ce_triton.lanes`` sizes a launch's LANES by it; the kernel lays its tile out by it.
LANE_WIDTH = 8
