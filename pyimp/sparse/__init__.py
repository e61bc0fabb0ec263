"""Importance-guided block-sparse attention (docs/kvcache.md sections 4-8): which blocks a decode
step attends to, built on :mod:`pyimp.attention` (which runs the attention itself, dense and over a
selection, and updates the importance matrix); nothing in :mod:`pyimp.attention` imports this
package.

- ``anchors``: per-block key summaries (AnchorType).
- ``retrieval``: block scores and selection (RetrievalType).
- ``select_modes``: the selection patterns beyond top-k.
- ``policy``: the engine's sparse state: when a layer goes sparse, anchor freshness, the
  selection of a decode step.
- ``stats``: its observers: decode statistics and the selections kept for traces and heatmaps.
"""
from pyimp.sparse.anchors import AnchorType, anchor_slots, block_spans, compute_anchors
from pyimp.sparse.retrieval import (RetrievalType, block_scores, retrieve_blocks,
                                    select_blocks, set_scores)

__all__ = [
    "AnchorType", "anchor_slots", "block_spans", "compute_anchors",
    "RetrievalType", "block_scores", "retrieve_blocks", "select_blocks", "set_scores",
]
