"""Importance-guided block-sparse attention (docs/kvcache.md sections 4-8).

- ``importance``: the importance-matrix update and the fp16 codec.
- ``anchors``: per-block key summaries (AnchorType).
- ``retrieval``: block scores and selection (RetrievalType).
- ``sparse_attention``: decode attention over the selected blocks, LSE merge,
  attention recall.
"""
from pyimp.sparse.anchors import AnchorType, anchor_slots, block_spans, compute_anchors
from pyimp.sparse.importance import (FP16_MAX, FP16_STALL, decay_importance, fp16_lut,
                                     importance_update, importance_update_blocks)
from pyimp.sparse.retrieval import (RetrievalType, block_scores, retrieve_blocks,
                                    select_blocks, set_scores)
from pyimp.sparse.sparse_attention import merge_partials, sparse_attention_decode

__all__ = [
    "AnchorType", "anchor_slots", "block_spans", "compute_anchors",
    "FP16_MAX", "FP16_STALL", "decay_importance", "fp16_lut", "importance_update",
    "importance_update_blocks",
    "RetrievalType", "block_scores", "retrieve_blocks", "select_blocks", "set_scores",
    "merge_partials", "sparse_attention_decode",
]
