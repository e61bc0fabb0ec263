"""Block-sparse decode attention over the selected blocks: defined in :mod:`pyimp.attention`
(which holds dense and sparse decode, one kernel family), re-exported here under the names
this module has always offered."""
from pyimp.attention import (add_block_mass, block_partial, check_args, decode_over_blocks,
                             every_block, merge_partials, no_bias, scatter_probs,
                             sparse_attention_decode, sparse_attention_decode_ref)

__all__ = ["add_block_mass", "block_partial", "check_args", "decode_over_blocks", "every_block",
           "merge_partials", "no_bias", "scatter_probs", "sparse_attention_decode",
           "sparse_attention_decode_ref"]
