"""Attention over the paged KV cache (docs/kvcache.md sections 2-4).

- ``attend``: dense and block-sparse decode (one block-list kernel family), prefill, and the
  softmax-partial algebra, each beside its NumPy reference.
- ``kernels``: the Numba kernels ``attend`` dispatches to.
- ``importance``: the importance matrix update the kernels feed, and its fp16 codec.
- ``checks``: the argument checks at the Python boundary of the attention and sparse kernels.
"""
