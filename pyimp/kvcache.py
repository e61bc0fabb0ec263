"""Paged KV cache in the ggml / KVCACHE.md layout.

Buffers (allocated once in :class:`KVCache`; ``L`` layers, ``Hkv`` kv heads,
``NB`` physical blocks, ``B`` tokens per block, ``D`` head dim)::

    k_cache_fp16_  [L][Hkv][NB][B*D]   row t of a block = post-RoPE key of token t
    v_cache_fp16_  [L][Hkv][NB][D*B]   transposed: entry d*B + t = channel d of token t
    block_table    int32[n_seq][NB]    logical block -> physical block (-1 = none)
    cache_seqlens  int32[n_seq]        valid tokens per sequence

The element type is float16 (the default, as llama.cpp's ``-ctk f16``) or
float32 (``kv_type="f32"``, for exact comparisons); the buffer names keep the
design's spelling either way. Physical blocks come from a free pool as the
sequence grows, so logical and physical order differ after a reset.
"""
from __future__ import annotations

import numpy as np

from .ops import NonFiniteError

KV_TYPES = {"f16": np.float16, "f32": np.float32}
F16_MAX = 65504.0
# float32 values below this magnitude round to a finite float16 (65504 at most); from it on, inf
_FINITE_LIMIT = {"f16": 65520.0, "f32": float("inf")}


class ContextFullError(ValueError):
    """More tokens than the cache was sized for."""


class KVCache:
    """Paged K/V storage for one or more sequences (the engine uses sequence 0)."""

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, n_ctx: int,
                 block_len: int = 32, kv_type: str = "f16", n_seq: int = 1):
        if kv_type not in KV_TYPES:
            raise ValueError(f"kv type {kv_type!r} is not one of {', '.join(KV_TYPES)}")
        if block_len <= 0:
            raise ValueError(f"block length must be positive, got {block_len}")
        if n_ctx <= 0:
            raise ValueError(f"context size must be positive, got {n_ctx}")
        self.n_layer, self.n_head_kv, self.head_dim = n_layer, n_head_kv, head_dim
        self.block_len = B = block_len
        self.n_ctx = n_ctx
        self.kv_type = kv_type
        self.dtype = KV_TYPES[kv_type]
        self.max_blocks = NB = -(-n_ctx // B) * n_seq
        self.blocks_per_seq = -(-n_ctx // B)
        # [L][Hkv][NB][B*D] and transposed [L][Hkv][NB][D*B]
        self.k_cache_fp16_ = np.zeros((n_layer, n_head_kv, NB, B * head_dim), dtype=self.dtype)
        self.v_cache_fp16_ = np.zeros((n_layer, n_head_kv, NB, head_dim * B), dtype=self.dtype)
        self.block_table = np.full((n_seq, self.blocks_per_seq), -1, dtype=np.int32)
        self.cache_seqlens = np.zeros(n_seq, dtype=np.int32)
        self._free = list(range(NB - 1, -1, -1))  # pop() hands out the lowest id first

    @staticmethod
    def bytes_needed(n_layer: int, n_head_kv: int, head_dim: int, n_ctx: int, block_len: int = 32,
                     kv_type: str = "f16", n_seq: int = 1) -> int:
        """Bytes the buffers of a cache of this shape take (computed without allocating)."""
        if kv_type not in KV_TYPES:
            raise ValueError(f"kv type {kv_type!r} is not one of {', '.join(KV_TYPES)}")
        blocks_per_seq = -(-n_ctx // block_len)
        nb = blocks_per_seq * n_seq
        item = np.dtype(KV_TYPES[kv_type]).itemsize
        kv = 2 * n_layer * n_head_kv * nb * block_len * head_dim * item
        return kv + n_seq * blocks_per_seq * 4 + n_seq * 4       # + block_table, cache_seqlens

    # ------------------------------------------------------------------ pool
    def reset(self, seq: int = 0) -> None:
        """Forget sequence ``seq``; its blocks return to the pool (contents are left as they are)."""
        used = self.block_table[seq][self.block_table[seq] >= 0]
        self._free.extend(int(b) for b in used[::-1])
        self.block_table[seq] = -1
        self.cache_seqlens[seq] = 0

    def reserve(self, n_tokens: int, seq: int = 0) -> None:
        """Make room for ``n_tokens`` more tokens, taking blocks from the pool."""
        n_new = int(self.cache_seqlens[seq]) + n_tokens
        if n_new > self.n_ctx:
            raise ContextFullError(f"context full: {int(self.cache_seqlens[seq])} cached + "
                                   f"{n_tokens} new tokens exceed the context size {self.n_ctx}")
        need = -(-n_new // self.block_len)
        row = self.block_table[seq]
        for lb in range(need):
            if row[lb] < 0:
                if not self._free:
                    raise ContextFullError("KV block pool exhausted")
                row[lb] = self._free.pop()

    # ----------------------------------------------------------------- write
    def slots(self, pos0: int, n: int, seq: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Physical block and in-block row of positions pos0 .. pos0+n-1: (int64[n], int64[n])."""
        pos = np.arange(pos0, pos0 + n)
        blocks = self.block_table[seq][pos // self.block_len].astype(np.int64)
        return blocks, pos % self.block_len

    def write(self, layer: int, k: np.ndarray, v: np.ndarray, pos0: int, seq: int = 0) -> None:
        """Store k, v float32[T, Hkv, D] of positions pos0 .. pos0+T-1 (blocks must be reserved)."""
        T = k.shape[0]
        blocks, rows = self.slots(pos0, T, seq)
        B, D = self.block_len, self.head_dim
        kc = self.k_cache_fp16_[layer].reshape(self.n_head_kv, -1, B, D)
        vc = self.v_cache_fp16_[layer].reshape(self.n_head_kv, -1, D, B)
        # f16 turns |x| >= 65520 into inf without a word, and a NaN here poisons every later
        # attention read: refuse before anything is stored (the cache keeps what it held).
        # Four float32 reductions (a NaN fails every comparison): ~10 us per layer per decode step.
        lim = _FINITE_LIMIT[self.kv_type]
        if T and not (k.max() < lim and k.min() > -lim and v.max() < lim and v.min() > -lim):
            raise NonFiniteError(self._non_finite_message(layer, k, v))
        kc[:, blocks, rows, :] = k.transpose(1, 0, 2).astype(self.dtype)  # indexed as [Hkv, T, D]
        # advanced indices separated by a slice put the token axis first: [T, Hkv, D]
        vc[:, blocks, :, rows] = v.astype(self.dtype)

    def _non_finite_message(self, layer: int, k: np.ndarray, v: np.ndarray) -> str:
        for name, x in (("key", k), ("value", v)):
            if not np.isfinite(x).all():
                return (f"layer {layer}: NaN or inf in the {name}s written to the KV cache (the hidden "
                        f"state is no longer finite at this layer: corrupted weights or an overflow)")
        big = max(float(np.abs(k).max()), float(np.abs(v).max()))
        return (f"layer {layer}: a key or value of magnitude {big:.4g} does not fit the f16 KV cache "
                f"(largest finite f16: {F16_MAX:g}); use kv_type='f32' (pyimp-run --kv-type f32)")

    def commit(self, n: int, seq: int = 0) -> None:
        """Mark ``n`` more tokens valid after every layer has written them."""
        self.cache_seqlens[seq] += n

    # ------------------------------------------------------------------ read
    def gather(self, layer: int, n: int | None = None, seq: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of the first ``n`` tokens in position order: float32[Hkv, n, D] each.

        A readable (slow) view of the paged layout, used by references and tests.
        """
        n = int(self.cache_seqlens[seq]) if n is None else n
        blocks, rows = self.slots(0, n, seq)
        B, D = self.block_len, self.head_dim
        kc = self.k_cache_fp16_[layer].reshape(self.n_head_kv, -1, B, D)
        vc = self.v_cache_fp16_[layer].reshape(self.n_head_kv, -1, D, B)
        k = kc[:, blocks, rows, :].astype(np.float32)          # [Hkv, n, D]
        v = vc[:, blocks, :, rows].transpose(1, 0, 2).astype(np.float32)  # [n, Hkv, D] -> [Hkv, n, D]
        return k, v

    @property
    def nbytes(self) -> int:
        return self.k_cache_fp16_.nbytes + self.v_cache_fp16_.nbytes
