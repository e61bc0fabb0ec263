"""The importance matrix update and its fp16 codec: defined in :mod:`pyimp.importance` (below
:mod:`pyimp.attention`, whose kernels add their probabilities to it), re-exported here under
the names this module has always offered."""
from pyimp.importance import (FP16_MAX, FP16_STALL, PARALLEL_MIN_WORK, decay_importance,
                              encode_fp16, fp16_lut, importance_update, importance_update_blocks,
                              importance_update_blocks_ref, importance_update_ref, kernel_view)

__all__ = ["FP16_MAX", "FP16_STALL", "PARALLEL_MIN_WORK", "decay_importance", "encode_fp16",
           "fp16_lut", "importance_update", "importance_update_blocks",
           "importance_update_blocks_ref", "importance_update_ref", "kernel_view"]
