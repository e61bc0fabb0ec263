"""Importance-guided block-sparse attention (docs/kvcache.md sections 4-8): which blocks a decode
step attends to. Built on :mod:`pyimp.attention`, which runs the attention itself (dense and
over a selection), and on :mod:`pyimp.importance`, which its kernels update; neither imports
this package.

- ``anchors``: per-block key summaries (AnchorType).
- ``retrieval``: block scores and selection (RetrievalType).
- ``select_modes``: the selection patterns beyond top-k.
- ``importance``, ``sparse_attention``: the names of :mod:`pyimp.importance` and of the
  block-sparse decode of :mod:`pyimp.attention`, re-exported.
"""
from pyimp.attention import merge_partials, sparse_attention_decode
from pyimp.importance import (FP16_MAX, FP16_STALL, decay_importance, fp16_lut,
                              importance_update, importance_update_blocks)
from pyimp.sparse.anchors import AnchorType, anchor_slots, block_spans, compute_anchors
from pyimp.sparse.retrieval import (RetrievalType, block_scores, retrieve_blocks,
                                    select_blocks, set_scores)

__all__ = [
    "AnchorType", "anchor_slots", "block_spans", "compute_anchors",
    "FP16_MAX", "FP16_STALL", "decay_importance", "fp16_lut", "importance_update",
    "importance_update_blocks",
    "RetrievalType", "block_scores", "retrieve_blocks", "select_blocks", "set_scores",
    "merge_partials", "sparse_attention_decode",
]
