"""The KV cache and what keeps it small (docs/kvcache.md section 2; docs/compression.md).

- ``cache``: the paged cache in the ggml layout (fp16, fp32 or quantized blocks), its block
  table, slot positions of a compacted layer.
- ``policy``: eviction policies (streaming, h2o, snapkv, pyramidkv) and their budgets.
- ``merge``: merging evicted keys and values into the kept ones.
- ``state``: prompt-cache files (``--prompt-cache``, ``Engine.save_state``).
- ``statefile``: the checksummed, entropy-coded container they are written in.
- ``floatcodec``: the fp16 entropy coder for the cache's planes.
"""
