"""The paged KV cache on the device: :class:`DeviceKVCache`.

Same geometry and bookkeeping as :class:`pyimp.kv.cache.KVCache` (block table, sequence
lengths, slot positions, the block pool, checkpoints and truncation are the host class's own
code, kept on the host); only the K/V storage lives on the device, in the same layout and under
the same names: ``k_cache_fp16_`` / ``v_cache_fp16_`` for f16, ``k_cache_f32_`` /
``v_cache_f32_`` for f32, and for the ggml block types ``k_cache_q8_0_``, ``v_cache_q4_1_``,
... (uint8 ``[L][Hkv][NB][bytes]``, the host's byte layout) with their float32 tails
``[n_seq][L][Hkv][B*D]`` on the device too (the physical block each tail stands for stays on
the host). Quantized V is stored by token (``v_layout="token"``); the channel layout stays on
the CPU (a clear error names the option). Layer 0's block table is mirrored to the device
(``bt_dev``, one device array for the cache's life: the entries :meth:`reserve` or
:meth:`reset` change are copied into it), and every layer reads it: the device cache
never compacts a layer (no eviction policy, no sliding-window trim on the device), so every
layer's pool hands out the same blocks.

Kernels (grid-stride loops; the host decides from the positions which blocks a write
completes, so nothing is read back):

- ``_store``: float sides, one thread per (token, kv head, channel) of the written rows; K rows
  token-major, V rows channel-major (transposed), fp16 rounded to nearest even as NumPy's
  ``astype``.
- ``_quantize``: a quantized side's blocks that the write completes, one thread per (block,
  kv head, token, 32-value group): the group's values come from the written rows, or from the
  tail for the tokens written before (the block being continued), and
  :func:`pyimp.cuda.kvblocks.quantize_block` writes them, byte-identical to the host's quantizer.
- ``_store_tail``: the written tokens of a block left partial, into the tail (launched after
  ``_quantize``, which may still read the tail's previous tokens).
- ``_unpack``: a quantized block dequantized into the tail (a truncation that cuts inside a
  quantized block and has no checkpoint, as on the host).

Launches per layer and write: a float side 1; a quantized side 1 (2 when a block completes
and another is begun in the same write).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32

from loaders.quantize import BLOCK_BYTES, CODES

from ..kv.cache import QUANT_TYPES, KVCache, as_float
from . import device
from .kvblocks import DeviceQuantizedKV, quantize_block, readers


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


@cuda.jit
def _quantize(x, s0, bt, lb0, nblk, tail, ts, cs, data, code, bsz):
    """Blocks lb0 .. lb0+nblk-1 (complete after this write of x's rows at slots s0..): element
    (t, d) of a block is x's row for slots >= s0, else the tail's at t*ts + d*cs."""
    T, Hkv, D = x.shape
    B = tail.shape[1] // D
    nb = D // 32
    v = cuda.local.array(32, float32)
    i = cuda.grid(1)
    while i < nblk * Hkv * B * nb:
        b = i % nb
        t = (i // nb) % B
        kvh = (i // (nb * B)) % Hkv
        lb = lb0 + i // (nb * B * Hkv)
        p = lb * B + t
        for k in range(32):
            d = b * 32 + k
            if p < s0:
                v[k] = tail[kvh, t * ts + d * cs]
            else:
                v[k] = x[p - s0, kvh, d]
        quantize_block(code, v, data[kvh, bt[lb]], (t * nb + b) * bsz)
        i += cuda.gridsize(1)


@cuda.jit
def _store_tail(x, s0, p_lo, p_hi, tail, ts, cs):
    """x's rows of slots p_lo .. p_hi-1 (one block) into the tail at t*ts + d*cs."""
    T, Hkv, D = x.shape
    B = tail.shape[1] // D
    i = cuda.grid(1)
    while i < (p_hi - p_lo) * Hkv * D:
        d = i % D
        kvh = (i // D) % Hkv
        p = p_lo + i // (D * Hkv)
        tail[kvh, (p % B) * ts + d * cs] = x[p - s0, kvh, d]
        i += cuda.gridsize(1)


@functools.cache
def _unpack_kernel(kv_type: str):
    kget = readers(kv_type)[0]

    @cuda.jit
    def _unpack(data, placeholder, pb, D, tail, ts, cs):
        """tail = quantized block pb dequantized (element (t, d) at t*ts + d*cs)."""
        Hkv = data.shape[0]
        B = tail.shape[1] // D
        i = cuda.grid(1)
        while i < Hkv * B * D:
            d = i % D
            t = (i // D) % B
            kvh = i // (B * D)
            tail[kvh, t * ts + d * cs] = kget(data, placeholder, -1, kvh, pb, t * D + d)
            i += cuda.gridsize(1)

    return _unpack


def _launch_grid(n: int) -> tuple[int, int]:
    """(blocks, threads) of a grid-stride loop over n items (one small block on the simulator)."""
    nt = 8 if device.SIMULATOR else 128
    return (1 if device.SIMULATOR else device.blocks_for(n, nt)), nt


class DeviceKVCache(KVCache):
    """A :class:`KVCache` whose K/V storage (and quantized sides' float tails) is on the device."""

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, n_ctx: int,
                 block_len: int = 32, type_k: str = "f16", type_v: str = "f16",
                 v_layout: str = "token"):
        if type_v in QUANT_TYPES and v_layout != "token":
            raise ValueError(f"device cuda stores quantized V by token only: "
                             f"v_layout={v_layout!r} (V cache type {type_v}) runs on the CPU "
                             f"(device='cpu'); use v_layout='token' on the device")
        super().__init__(n_layer, n_head_kv, head_dim, n_ctx, block_len=block_len,
                         type_k=type_k, type_v=type_v, v_layout=v_layout)
        self.bt_dev = device.to_device(self.table(0))
        self._placeholder = device.zeros((1, 1), np.float32)

    @staticmethod
    def _alloc(shape: tuple, dtype):
        return device.zeros(shape, dtype)

    def reserve(self, n_tokens: int, seq: int = 0) -> None:
        before = self.table(0, seq).copy()
        super().reserve(n_tokens, seq)
        if seq == 0:
            self._upload_table(before)

    def reset(self, seq: int = 0) -> None:
        before = self.table(0, seq).copy()
        super().reset(seq)
        if seq == 0:
            self._upload_table(before)

    def _upload_table(self, before: np.ndarray) -> None:
        """Copy the entries of layer 0's block table that changed into ``bt_dev`` in place
        (the array stays where it is: a captured decode step keeps reading it)."""
        now = self.table(0)
        changed = np.flatnonzero(before != now)
        if changed.size == 0:
            return
        lo, hi = int(changed[0]), int(changed[-1]) + 1
        device.upload(self.bt_dev[lo:hi], now[lo:hi])

    # ----------------------------------------------------------------- write
    def write(self, layer: int, k, v, pos0: int, seq: int = 0) -> None:
        """Store device k, v float32 ``[T, Hkv, D]`` of positions pos0.. (blocks reserved).
        Unlike the host cache nothing is read back to check finiteness: a NaN or inf shows in
        the logits, which the engine checks (a quantized block holding a value the host would
        refuse is stored with NaN scales, see :mod:`pyimp.cuda.kvblocks`)."""
        T, Hkv, D = k.shape
        if T == 0:
            return
        self.slot_pos[seq, layer, pos0:pos0 + T] = np.arange(pos0, pos0 + T, dtype=np.int32)
        for side, x in (("k", k), ("v", v)):
            store = self.k_store if side == "k" else self.v_store
            if self._tail[side] is None:
                grid, nt = _launch_grid(T * Hkv * D)
                device.launch(_store, grid, nt, x, np.int32(pos0), self.bt_dev, store[layer],
                              side == "k")
            else:
                self._write_quantized(side, layer, x, pos0, seq, store[layer])

    def _write_quantized(self, side: str, layer: int, x, pos0: int, seq: int, data) -> None:
        T, Hkv, D = x.shape
        B = self.block_len
        bt = self.table(layer, seq)
        tb = self._tail_block[side]
        tail = self._tail[side][seq, layer]
        ts, cs = (D, 1) if side == "k" else (1, B)          # the host tail's layout
        code = CODES[QUANT_TYPES[self.type_k if side == "k" else self.type_v]]
        n_end = pos0 + T
        lb0, lb_end = pos0 // B, n_end // B                 # blocks [lb0, lb_end) complete
        if pos0 % B and tb[seq, layer] != bt[lb0]:
            raise ValueError("KV cache: the float tail does not hold the block being continued")
        if lb_end > lb0:
            n = (lb_end - lb0) * Hkv * B * (D // 32)
            grid, nt = _launch_grid(n)
            device.launch(_quantize, grid, nt, x, np.int32(pos0), self.bt_dev, np.int32(lb0),
                          np.int32(lb_end - lb0), tail, np.int32(ts), np.int32(cs), data,
                          np.int32(code), np.int32(BLOCK_BYTES[code]))
        if n_end % B:
            p_lo = max(pos0, lb_end * B)
            grid, nt = _launch_grid((n_end - p_lo) * Hkv * D)
            device.launch(_store_tail, grid, nt, x, np.int32(pos0), np.int32(p_lo),
                          np.int32(n_end), tail, np.int32(ts), np.int32(cs))
            tb[seq, layer] = bt[lb_end]
        else:
            tb[seq, layer] = -1

    # ------------------------------------------------------- rewind / restore
    def checkpoint(self, seq: int = 0):
        """The float tails (device copies) and their blocks, as :meth:`truncate` restores them;
        None for a float cache."""
        if not self.quantized:
            return None
        return {side: (device.copy(self._tail[side][seq]), self._tail_block[side][seq].copy())
                for side in ("k", "v") if self._tail[side] is not None}

    def _restore_tail(self, side: str, seq: int, tail, tail_block: np.ndarray) -> None:
        device.upload(self._tail[side][seq], tail)
        self._tail_block[side][seq] = tail_block

    def _refill_tail(self, side: str, layer: int, seq: int, pb: int) -> None:
        D, B = self.head_dim, self.block_len
        ts, cs = (D, 1) if side == "k" else (1, B)
        grid, nt = _launch_grid(self.n_head_kv * B * D)
        store = self.k_store if side == "k" else self.v_store
        device.launch(_unpack_kernel(self.type_k if side == "k" else self.type_v), grid, nt,
                      store[layer], self._placeholder, np.int32(pb), np.int32(D),
                      self._tail[side][seq, layer], np.int32(ts), np.int32(cs))

    # ------------------------------------------------------------------ read
    def layer(self, side: str, layer: int, seq: int = 0):
        """A layer's K or V as the device kernels take it: the device array [Hkv][NB][B*D] of a
        float side, a :class:`pyimp.cuda.kvblocks.DeviceQuantizedKV` of a quantized one."""
        store = self.k_store if side == "k" else self.v_store
        if self._tail[side] is None:
            return store[layer]
        return DeviceQuantizedKV(side, self.type_k if side == "k" else self.type_v, store[layer],
                                 self._tail[side][seq, layer],
                                 self._tail_block[side][seq, layer], self.head_dim,
                                 self.block_len)

    def k_layer(self, layer: int, seq: int = 0):
        return self.layer("k", layer, seq)

    def v_layer(self, layer: int, seq: int = 0):
        return self.layer("v", layer, seq)

    def host_layer(self, side: str, layer: int, seq: int = 0):
        """A host copy of a layer's side: a float array, or a :class:`pyimp.kv.cache.QuantizedKV`."""
        c = self.layer(side, layer, seq)
        return c.host() if isinstance(c, DeviceQuantizedKV) else device.to_host(c)

    def gather(self, layer: int, n: int | None = None, seq: int = 0, start: int = 0):
        """Keys and values of tokens start..n-1, float32 ``[Hkv, n - start, D]`` each, on the
        host (quantized sides dequantized)."""
        n = int(self.cache_seqlens[seq]) if n is None else n
        blocks, rows = self.slots(start, n - start, seq)
        B, D = self.block_len, self.head_dim
        kc = as_float(self.host_layer("k", layer, seq)).reshape(self.n_head_kv, -1, B, D)
        vc = as_float(self.host_layer("v", layer, seq)).reshape(self.n_head_kv, -1, D, B)
        k = kc[:, blocks, rows, :].astype(np.float32)
        v = vc[:, blocks, :, rows].transpose(1, 0, 2).astype(np.float32)
        return k, v

    @property
    def nbytes(self) -> int:
        tails = sum(int(t.nbytes) for t in self._tail.values() if t is not None)
        return int(self.k_store.nbytes + self.v_store.nbytes) + tails
