"""Triton kernels, one a file.

``CE_CHUNK_REVISION`` is importable without triton: the tuner records it with each CE tile it picks.
"""

#: Revision of ``ce_chunk.ce_chunk_kernel``, bumped when a change to it can change which tile is fastest (2: the
#: padded walk and the leaner per-element math of 2026-12-01; 3: ignored rows skipped, and pass 1's -inf fill
#: instead of a select, later that day; 4: pass 2 walks each row backwards, 2026-12-04).
#: ``flce-tune --retune-ce-tiles --skip-existing`` re-picks the entries whose tile was picked for another revision.
CE_CHUNK_REVISION = 4
