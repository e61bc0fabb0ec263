"""The paged KV cache on the device: :class:`DeviceKVCache`.

Same geometry and bookkeeping as :class:`pyimp.kvcache.KVCache` (block table, sequence
lengths, the block pool, checkpoints and truncation are the host class's own code, kept on the
host); only the K/V storage lives on the device, in the same layout and under the same names
(``k_cache_fp16_`` / ``v_cache_fp16_`` for f16, ``k_cache_f32_`` / ``v_cache_f32_`` for f32).
Layer 0's block table is mirrored to the device (``bt_dev``) whenever :meth:`reserve` changes
it, and every layer reads it: the device cache never compacts a layer (no eviction policy, no
sliding-window trim on the device), so every layer's pool hands out the same blocks.
Quantized KV types stay on the CPU path for now (a clear error names them).

``_store``: a grid-stride loop over (token, kv head, channel) of the written rows; K rows token-major,
V rows channel-major (transposed), fp16 rounded to nearest even as NumPy's ``astype``.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ..kvcache import FLOAT_TYPES, KVCache
from . import device


@cuda.jit
def _store(x, pos0, bt, store, by_token):
    T, Hkv, D = x.shape
    B = store.shape[2] // D
    i = cuda.grid(1)
    while i < T * Hkv * D:
        t = i // (Hkv * D)
        kvh = (i // D) % Hkv
        d = i % D
        p = pos0 + t
        pb = bt[p // B]
        r = p % B
        if by_token:
            store[kvh, pb, r * D + d] = x[t, kvh, d]
        else:
            store[kvh, pb, d * B + r] = x[t, kvh, d]
        i += cuda.gridsize(1)


class DeviceKVCache(KVCache):
    """A :class:`KVCache` whose K/V storage is on the device (f16 or f32)."""

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, n_ctx: int,
                 block_len: int = 32, type_k: str = "f16", type_v: str = "f16"):
        for side, t in (("K", type_k), ("V", type_v)):
            if t not in FLOAT_TYPES:
                raise ValueError(f"device cuda keeps the KV cache as f16 or f32; {side} cache "
                                 f"type {t!r} runs on the CPU only (--device cpu)")
        super().__init__(n_layer, n_head_kv, head_dim, n_ctx, block_len=block_len,
                         type_k=type_k, type_v=type_v)
        self.bt_dev = device.to_device(self.table(0))

    @staticmethod
    def _alloc(shape: tuple, dtype):
        return device.zeros(shape, dtype)

    def reserve(self, n_tokens: int, seq: int = 0) -> None:
        before = self.table(0, seq).copy()
        super().reserve(n_tokens, seq)
        if seq == 0 and not np.array_equal(before, self.table(0)):
            self.bt_dev = device.to_device(self.table(0))

    def reset(self, seq: int = 0) -> None:
        super().reset(seq)
        if seq == 0:
            self.bt_dev = device.to_device(self.table(0))

    def write(self, layer: int, k, v, pos0: int, seq: int = 0) -> None:
        """Store device k, v float32 ``[T, Hkv, D]`` of positions pos0.. (blocks reserved).
        Unlike the host cache nothing is read back to check finiteness: a NaN or inf shows in
        the logits, which the engine checks."""
        T, Hkv, D = k.shape
        n = T * Hkv * D
        for x, store, by_token in ((k, self.k_store, True), (v, self.v_store, False)):
            nt = 8 if device.SIMULATOR else 128
            device.launch(_store, 1 if device.SIMULATOR else device.blocks_for(n, nt), nt, x,
                          np.int32(pos0), self.bt_dev, store[layer], by_token)

    def k_layer(self, layer: int, seq: int = 0):
        return self.k_store[layer]

    def v_layer(self, layer: int, seq: int = 0):
        return self.v_store[layer]

    def layer(self, side: str, layer: int, seq: int = 0):
        return (self.k_store if side == "k" else self.v_store)[layer]

    def gather(self, layer: int, n: int | None = None, seq: int = 0, start: int = 0):
        """Keys and values of tokens start..n-1, float32 ``[Hkv, n - start, D]`` each, on the
        host."""
        n = int(self.cache_seqlens[seq]) if n is None else n
        blocks, rows = self.slots(start, n - start, seq)
        B, D = self.block_len, self.head_dim
        kc = device.to_host(self.k_store[layer]).reshape(self.n_head_kv, -1, B, D)
        vc = device.to_host(self.v_store[layer]).reshape(self.n_head_kv, -1, D, B)
        k = kc[:, blocks, rows, :].astype(np.float32)
        v = vc[:, blocks, :, rows].transpose(1, 0, 2).astype(np.float32)
        return k, v

    @property
    def nbytes(self) -> int:
        return int(self.k_store.nbytes + self.v_store.nbytes)
