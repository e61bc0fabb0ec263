"""What an engine's options allocate: the slots a layer holds and the bytes of the KV cache and
the sparse buffers, refused before anything is allocated when they exceed the memory."""
from __future__ import annotations

from . import ops
from .kv.policy import KVPolicy
from .kv.cache import KVCache
from .runtime.memory import check_fits, fmt_bytes
from .sparse.policy import SparseState


def max_slots(opts, cfg, n_ctx: int) -> int:
    """Slots a layer holds at most: the context, or what the eviction budget needs."""
    return KVPolicy.max_slots(opts.policy, cfg, n_ctx, opts.batch_size, opts.block_len)


def check_memory(opts, cfg, n_ctx: int) -> dict:
    """Bytes of the KV cache and sparse buffers ``opts`` (EngineOptions) allocate for model
    ``cfg`` at context ``n_ctx``; refuses (one InsufficientMemoryError) what exceeds the
    available memory, before allocating anything."""
    slots = max_slots(opts, cfg, n_ctx)
    kv = KVCache.bytes_needed(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, n_ctx,
                              block_len=opts.block_len, type_k=opts.type_k,
                              type_v=opts.type_v, v_layout=opts.v_layout, max_slots=slots)
    if opts.kv_rotate:
        ops.hadamard(cfg.head_dim)            # refuses a head dim that is not a power of 2
    sparse = 0
    if opts.sparse_options().active:
        sparse = SparseState.bytes_needed(opts.sparse_options(), cfg,
                                          -(-slots // opts.block_len), opts.block_len)
    what = f"context {n_ctx} with block length {opts.block_len}: KV cache {fmt_bytes(kv)}"
    if sparse:
        what += f" + importance and anchors {fmt_bytes(sparse)}"
    if opts.device == "cpu":          # on the GPU these buffers take device memory
        check_fits(kv + sparse, what, "lower the context size (-c), block length or anchor count")
    return {"kv": kv, "sparse": sparse}
