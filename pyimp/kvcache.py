"""Paged KV cache in the ggml / KVCACHE.md layout, float or quantized.

Buffers (allocated once in :class:`KVCache`; ``L`` layers, ``Hkv`` kv heads,
``NB`` physical blocks, ``B`` tokens per block, ``D`` head dim)::

    K  [L][Hkv][NB][B*D]   row t of a block = post-RoPE key of token t
    V  [L][Hkv][NB][D*B]   transposed: entry d*B + t = channel d of token t
    block_table    int32[n_seq][NB]    logical block -> physical block (-1 = none)
    cache_seqlens  int32[n_seq]        valid tokens per sequence

Cache types (``type_k`` / ``type_v``, llama.cpp's ``--cache-type-k/-v`` names):
``f16`` (the default), ``f32``, and the ggml block types ``q8_0``, ``q4_0``,
``q4_1``, ``q5_0``, ``q5_1`` (32 values per block; byte layouts in
:mod:`loaders.quants_legacy`, quantizer in :mod:`loaders.quantize`). Each stored
type has a plain buffer name: ``k_cache_fp16_`` / ``v_cache_fp16_`` (f16),
``k_cache_f32_``, ``k_cache_q8_0_``, ... ; :attr:`KVCache.k_store` /
:attr:`KVCache.v_store` name whichever is in use.

Quantized storage, per layer, kv head and physical block (``uint8``):

- K is quantized along head_dim: token t's D values are ``D/32`` blocks at bytes
  ``[t*RB, (t+1)*RB)`` of the block's row, ``RB = D/32 * block bytes``.
- V has two layouts (``v_layout``). ``"token"`` (the default, as llama.cpp
  stores V with flash attention): like K, token t's D channels along head_dim.
  ``"channel"``: the transposed rows quantized along the token axis, channel
  d's B values at ``[d*RC, (d+1)*RC)``, ``RC = B/32 * block bytes`` (needs a
  block length that is a multiple of 32). ``tools/bench_kv.py`` measures both;
  the token layout has the lower KL on Gemma (per-token groups keep each
  token's scale, channel groups mix 32 tokens of very different magnitude).

**The float tail.** A block is quantized once, when its last token is written.
Until then its tokens live in a float32 *tail* (per sequence, layer and side:
``[Hkv][B*D]`` token-major for K, ``[Hkv][D*B]`` channel-major for V) and the
physical block it stands for is recorded (``tail_block``); attention reads that
block from the tail, every other block from the quantized bytes. So the cache
holds at most one float block per layer and sequence, and a full block is
quantized from the float32 values exactly as computed (ggml quantizes its KV
rows from float32 too). Rewinding into a quantized block (:meth:`truncate`)
dequantizes its kept tokens back into the tail: a lossy step, taken only when
a cache is cut inside a block (prompt-cache prefix reuse).

Physical blocks come from a free pool as the sequence grows, so logical and
physical order differ after a reset.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants as gguf_quants

from loaders import jit, quantize
from loaders.quantize import BLOCK_BYTES, CODES, quantize_block

from . import attn_kernels
from .attn_kernels import f32_to_half_bits
from .ops import NonFiniteError

jit.kernel_module(__file__, quantize, attn_kernels)

FLOAT_TYPES = {"f16": np.float16, "f32": np.float32}
QUANT_TYPES = {"q8_0": QT.Q8_0, "q4_0": QT.Q4_0, "q4_1": QT.Q4_1, "q5_0": QT.Q5_0,
               "q5_1": QT.Q5_1}
KV_TYPES = tuple(FLOAT_TYPES) + tuple(QUANT_TYPES)
V_LAYOUTS = ("token", "channel")
F16_MAX = 65504.0
# float32 values below this magnitude round to a finite float16 (65504 at most); from it on,
# inf. Quantized types store their scales and minimums as fp16: the same bound keeps them finite.
_FINITE_LIMIT = 65520.0


class ContextFullError(ValueError):
    """More tokens than the cache was sized for."""


def buffer_name(side: str, kv_type: str) -> str:
    """Attribute name of a side's ("k" / "v") buffer of type kv_type: k_cache_fp16_, k_cache_q8_0_."""
    return f"{side}_cache_{'fp16' if kv_type == 'f16' else kv_type}_"


def _check_type(side: str, kv_type: str) -> None:
    if kv_type not in KV_TYPES:
        raise ValueError(f"cache type for {side.upper()} {kv_type!r} is not one of "
                         f"{', '.join(KV_TYPES)}")


def _row_geometry(side: str, kv_type: str, head_dim: int, block_len: int, v_layout: str):
    """(stored rows per block, values per row) of a quantized side; raises on a shape the
    32-value blocks do not divide."""
    by_token = side == "k" or v_layout == "token"
    rows, n = (block_len, head_dim) if by_token else (head_dim, block_len)
    if n % 32:
        what = (f"head dim {head_dim}" if by_token else f"block length {block_len} (V layout "
                f"'channel' quantizes along the token axis)")
        raise ValueError(f"cache type {kv_type} for {side.upper()} needs a {what} that is a "
                         f"multiple of 32")
    return rows, n, by_token


class QuantizedKV:
    """One layer's quantized K or V (one sequence's view) as the attention functions take it.

    ``data`` uint8 [Hkv][NB][bytes] (the stored blocks), ``tail`` float32 [Hkv][B*D] (the
    block being filled, in the float layout of its side), ``tail_block`` the physical block
    the tail stands for (-1: none). ``shape`` is the float layout's ``(Hkv, NB, B*D)``.
    """

    def __init__(self, side: str, kv_type: str, data: np.ndarray, tail: np.ndarray,
                 tail_block: int, head_dim: int, block_len: int, by_token: bool):
        self.side, self.kv_type = side, kv_type
        self.data, self.tail = data, tail
        self.tail_block = int(tail_block)
        self.head_dim, self.block_len, self.by_token = head_dim, block_len, by_token
        self.qtype = QUANT_TYPES[kv_type]
        code = CODES[self.qtype]
        self.meta = np.array([self.tail_block, code, BLOCK_BYTES[code], int(by_token)], np.int64)

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.data.shape[0], self.data.shape[1], self.tail.shape[1]

    def operand(self) -> tuple:
        """The tuple the Numba kernels take: (data, tail, meta int64[tail_block, code, block
        bytes, by_token])."""
        return self.data, self.tail, self.meta

    def blocks_f32(self, blocks) -> np.ndarray:
        """Dequantized blocks (physical ids) in the float layout: float32 [Hkv][n][B*D]
        (NumPy: ``gguf.quants.dequantize``; the tail block from the tail)."""
        blocks = np.asarray(blocks, dtype=np.int64).reshape(-1)
        Hkv, B, D = self.data.shape[0], self.block_len, self.head_dim
        raw = self.data[:, blocks]                                     # [Hkv, n, bytes]
        rows = B if self.by_token else D
        vals = gguf_quants.dequantize(raw.reshape(Hkv * blocks.size * rows, -1), self.qtype)
        if self.by_token:
            vals = vals.reshape(Hkv, blocks.size, B, D)
            if self.side == "v":
                vals = vals.transpose(0, 1, 3, 2)                      # channel-major
        else:
            vals = vals.reshape(Hkv, blocks.size, D, B)
        out = np.ascontiguousarray(vals, dtype=np.float32).reshape(Hkv, blocks.size, B * D)
        hit = blocks == self.tail_block
        if hit.any():
            out[:, hit] = self.tail[:, None, :]
        return out

    def dequantize(self) -> np.ndarray:
        """The whole layer in the float layout, float32 [Hkv][NB][B*D] (references, tests)."""
        return self.blocks_f32(np.arange(self.data.shape[1]))


def as_float(cache) -> np.ndarray:
    """A layer's K or V as a float array in the float layout (quantized ones dequantized)."""
    return cache.dequantize() if isinstance(cache, QuantizedKV) else cache


@jit.njit
def _store_float(x, pos0, bt, store, by_token, half):
    """Write x float32 [T, Hkv, D] (positions pos0..pos0+T-1) into a float layer store
    [Hkv][NB][B*D]: token rows (t*D + d) or channel rows (d*B + t); ``half``: the store holds
    fp16 bits (uint16, rounded as NumPy's astype(float16)), else float32 values."""
    T, Hkv, D = x.shape
    B = store.shape[2] // D
    for i in range(T):
        p = pos0 + i
        pb = bt[p // B]
        t = p % B
        for h in range(Hkv):
            row = store[h, pb]
            for d in range(D):
                o = t * D + d if by_token else d * B + t
                if half:
                    row[o] = f32_to_half_bits(x[i, h, d])
                else:
                    row[o] = x[i, h, d]


@jit.njit
def _store_quantized(x, pos0, bt, tail, tail_pb, data, code, bsz, by_token, tok_stride,
                     ch_stride):
    """Write x float32 [T, Hkv, D] (positions pos0..pos0+T-1) through the float tail
    (element (t, d) of a block at ``t*tok_stride + d*ch_stride``); each block completed here is
    quantized into data [Hkv][NB][bytes] (rows by token or by channel). Returns the physical
    block left in the tail (-1: none)."""
    T, Hkv, D = x.shape
    B = tail.shape[1] // D
    n_end = pos0 + T
    tmp = np.empty(32, np.float32)
    for lb in range(pos0 // B, (n_end - 1) // B + 1):
        base = lb * B
        p_lo = max(pos0, base)
        p_hi = min(n_end, base + B)
        pb = bt[lb]
        if p_lo > base and tail_pb != pb:
            raise ValueError("KV cache: the float tail does not hold the block being continued")
        for p in range(p_lo, p_hi):
            t = p - base
            for h in range(Hkv):
                for d in range(D):
                    tail[h, t * tok_stride + d * ch_stride] = x[p - pos0, h, d]
        if p_hi < base + B:
            tail_pb = pb
            continue
        for h in range(Hkv):
            w = data[h, pb]
            if by_token:
                nb = D // 32
                for t in range(B):
                    for b in range(nb):
                        for j in range(32):
                            tmp[j] = tail[h, t * tok_stride + (b * 32 + j) * ch_stride]
                        quantize_block(code, tmp, 0, w, (t * nb + b) * bsz)
            else:
                nb = B // 32
                for d in range(D):
                    for b in range(nb):
                        for j in range(32):
                            tmp[j] = tail[h, (b * 32 + j) * tok_stride + d * ch_stride]
                        quantize_block(code, tmp, 0, w, (d * nb + b) * bsz)
        tail_pb = -1
    return tail_pb


class KVCache:
    """Paged K/V storage for one or more sequences (the engine uses sequence 0)."""

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, n_ctx: int,
                 block_len: int = 32, kv_type: str = "f16", n_seq: int = 1,
                 type_k: str | None = None, type_v: str | None = None, v_layout: str = "token"):
        type_k, type_v = type_k or kv_type, type_v or kv_type
        self.check_geometry(head_dim, block_len, n_ctx, type_k, type_v, v_layout)
        self.n_layer, self.n_head_kv, self.head_dim = n_layer, n_head_kv, head_dim
        self.block_len = B = block_len
        self.n_ctx = n_ctx
        self.type_k, self.type_v, self.v_layout = type_k, type_v, v_layout
        self.max_blocks = NB = -(-n_ctx // B) * n_seq
        self.blocks_per_seq = -(-n_ctx // B)
        self.block_table = np.full((n_seq, self.blocks_per_seq), -1, dtype=np.int32)
        self.cache_seqlens = np.zeros(n_seq, dtype=np.int32)
        self._free = list(range(NB - 1, -1, -1))  # pop() hands out the lowest id first
        shape = (n_layer, n_head_kv, NB)
        self._tail: dict[str, np.ndarray | None] = {}
        self._tail_block: dict[str, np.ndarray | None] = {}
        self._by_token: dict[str, bool] = {}
        for side, t in (("k", type_k), ("v", type_v)):
            if t in FLOAT_TYPES:
                store = self._alloc(shape + (B * head_dim,), FLOAT_TYPES[t])
                self._tail[side] = self._tail_block[side] = None
            else:
                rows, n, by_token = _row_geometry(side, t, head_dim, B, v_layout)
                code = CODES[QUANT_TYPES[t]]
                store = np.zeros(shape + (rows * n // 32 * BLOCK_BYTES[code],), dtype=np.uint8)
                self._tail[side] = np.zeros((n_seq, n_layer, n_head_kv, B * head_dim), np.float32)
                self._tail_block[side] = np.full((n_seq, n_layer), -1, np.int64)
                self._by_token[side] = by_token
            setattr(self, buffer_name(side, t), store)
        self.k_store = getattr(self, buffer_name("k", type_k))
        self.v_store = getattr(self, buffer_name("v", type_v))

    @staticmethod
    def _alloc(shape: tuple, dtype) -> np.ndarray:
        """Zeroed storage of a float K/V side (the device cache allocates on the device)."""
        return np.zeros(shape, dtype=dtype)

    @staticmethod
    def check_geometry(head_dim: int, block_len: int, n_ctx: int, type_k: str, type_v: str,
                       v_layout: str = "token") -> None:
        """Refuse (ValueError naming the value) a cache this geometry and these types cannot hold."""
        _check_type("k", type_k)
        _check_type("v", type_v)
        if v_layout not in V_LAYOUTS:
            raise ValueError(f"V layout {v_layout!r} is not one of {', '.join(V_LAYOUTS)}")
        if block_len <= 0:
            raise ValueError(f"block length must be positive, got {block_len}")
        if n_ctx <= 0:
            raise ValueError(f"context size must be positive, got {n_ctx}")
        for side, t in (("k", type_k), ("v", type_v)):
            if t in QUANT_TYPES:
                _row_geometry(side, t, head_dim, block_len, v_layout)

    @staticmethod
    def bytes_per_token(head_dim: int, kv_type: str) -> float:
        """Bytes one kv head's K (or V) of one token takes in a full block of this type."""
        if kv_type in FLOAT_TYPES:
            return head_dim * np.dtype(FLOAT_TYPES[kv_type]).itemsize
        return head_dim / 32 * BLOCK_BYTES[CODES[QUANT_TYPES[kv_type]]]

    @staticmethod
    def bytes_needed(n_layer: int, n_head_kv: int, head_dim: int, n_ctx: int, block_len: int = 32,
                     kv_type: str = "f16", n_seq: int = 1, type_k: str | None = None,
                     type_v: str | None = None, v_layout: str = "token") -> int:
        """Bytes the buffers of a cache of this shape take (computed without allocating)."""
        type_k, type_v = type_k or kv_type, type_v or kv_type
        KVCache.check_geometry(head_dim, block_len, n_ctx, type_k, type_v, v_layout)
        blocks_per_seq = -(-n_ctx // block_len)
        nb = blocks_per_seq * n_seq
        total = 0
        for t in (type_k, type_v):
            per_block = round(KVCache.bytes_per_token(head_dim, t) * block_len)
            total += n_layer * n_head_kv * nb * per_block
            if t in QUANT_TYPES:                  # the float32 tail and its block id
                total += n_seq * n_layer * (n_head_kv * block_len * head_dim * 4 + 8)
        return total + n_seq * blocks_per_seq * 4 + n_seq * 4       # + block_table, cache_seqlens

    # ------------------------------------------------------------ layer views
    def layer(self, side: str, layer: int, seq: int = 0):
        """Layer ``layer``'s K or V as the attention functions take it: the float array
        [Hkv][NB][B*D] for f16 / f32, a :class:`QuantizedKV` otherwise."""
        store = self.k_store if side == "k" else self.v_store
        tail = self._tail[side]
        if tail is None:
            return store[layer]
        return QuantizedKV(side, self.type_k if side == "k" else self.type_v, store[layer],
                           tail[seq, layer], self._tail_block[side][seq, layer], self.head_dim,
                           self.block_len, self._by_token[side])

    def k_layer(self, layer: int, seq: int = 0):
        return self.layer("k", layer, seq)

    def v_layer(self, layer: int, seq: int = 0):
        return self.layer("v", layer, seq)

    @property
    def quantized(self) -> bool:
        return self.type_k in QUANT_TYPES or self.type_v in QUANT_TYPES

    def layer_token_bytes(self) -> float:
        """Bytes of K and V one token occupies in one layer (all kv heads)."""
        return self.n_head_kv * (self.bytes_per_token(self.head_dim, self.type_k) +
                                 self.bytes_per_token(self.head_dim, self.type_v))

    # ------------------------------------------------------------------ pool
    def reset(self, seq: int = 0) -> None:
        """Forget sequence ``seq``; its blocks return to the pool (contents are left as they are)."""
        used = self.block_table[seq][self.block_table[seq] >= 0]
        self._free.extend(int(b) for b in used[::-1])
        self.block_table[seq] = -1
        self.cache_seqlens[seq] = 0
        for tb in self._tail_block.values():
            if tb is not None:
                tb[seq] = -1

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
        if T == 0:
            return
        # f16 turns |x| >= 65520 into inf without a word (quantized types store fp16 scales),
        # and a NaN here poisons every later attention read: refuse before anything is stored
        # (the cache keeps what it held). Four float32 reductions (a NaN fails every
        # comparison): ~10 us per layer per decode step.
        for side, x, t in (("key", k, self.type_k), ("value", v, self.type_v)):
            lim = float("inf") if t == "f32" else _FINITE_LIMIT
            if not (x.max() < lim and x.min() > -lim):
                raise NonFiniteError(self._non_finite_message(layer, k, v))
        B, D = self.block_len, self.head_dim
        for side, x in (("k", k), ("v", v)):
            store = self.k_store if side == "k" else self.v_store
            if self._tail[side] is None:    # f16 / f32: K token rows, V channel rows
                half = store.dtype == np.float16
                _store_float(np.ascontiguousarray(x, dtype=np.float32), int(pos0), self.block_table[seq],
                             store[layer].view(np.uint16) if half else store[layer], side == "k", half)
                continue
            qt = QUANT_TYPES[self.type_k if side == "k" else self.type_v]
            code = CODES[qt]
            tok_stride, ch_stride = (D, 1) if side == "k" else (1, B)
            tb = self._tail_block[side]
            tb[seq, layer] = _store_quantized(
                np.ascontiguousarray(x, dtype=np.float32), int(pos0), self.block_table[seq],
                self._tail[side][seq, layer], int(tb[seq, layer]), store[layer], code,
                BLOCK_BYTES[code], self._by_token[side], tok_stride, ch_stride)

    def _non_finite_message(self, layer: int, k: np.ndarray, v: np.ndarray) -> str:
        for name, x in (("key", k), ("value", v)):
            if not np.isfinite(x).all():
                return (f"layer {layer}: NaN or inf in the {name}s written to the KV cache (the hidden "
                        f"state is no longer finite at this layer: corrupted weights or an overflow)")
        big = max(float(np.abs(k).max()), float(np.abs(v).max()))
        kind = (self.type_k if self.type_k == self.type_v else
                f"K {self.type_k} / V {self.type_v}")
        return (f"layer {layer}: a key or value of magnitude {big:.4g} does not fit the {kind} "
                f"KV cache (largest finite f16: {F16_MAX:g}); use kv_type='f32' (pyimp-run "
                f"--kv-type f32)")

    def commit(self, n: int, seq: int = 0) -> None:
        """Mark ``n`` more tokens valid after every layer has written them."""
        self.cache_seqlens[seq] += n

    # ------------------------------------------------------- rewind / restore
    def checkpoint(self, seq: int = 0):
        """What :meth:`truncate` needs to rewind exactly to the current length (the float tails
        of a quantized cache; None for a float cache)."""
        if not self.quantized:
            return None
        return {side: (self._tail[side][seq].copy(), self._tail_block[side][seq].copy())
                for side in ("k", "v") if self._tail[side] is not None}

    def truncate(self, n: int, seq: int = 0, checkpoint=None) -> None:
        """Forget positions n.. of sequence ``seq`` (their blocks stay reserved).

        With the ``checkpoint`` taken when the cache held exactly n tokens the float tails
        are restored as they were (exact). Otherwise a quantized block that n cuts is
        dequantized into its tail: the kept tokens read back as their quantized values.
        """
        self.cache_seqlens[seq] = n
        if checkpoint is not None:
            for side, (tail, tb) in checkpoint.items():
                self._tail[side][seq] = tail
                self._tail_block[side][seq] = tb
            return
        B = self.block_len
        for side in ("k", "v"):
            if self._tail[side] is None:
                continue
            tb = self._tail_block[side][seq]
            if n % B == 0:
                tb[:] = -1
                continue
            pb = int(self.block_table[seq][n // B])
            for layer in range(self.n_layer):
                if tb[layer] != pb:
                    view = self.layer(side, layer, seq)
                    self._tail[side][seq, layer] = view.blocks_f32([pb])[:, 0]
                    tb[layer] = pb

    def set_tail(self, side: str, layer: int, tail: np.ndarray, block: int, seq: int = 0) -> None:
        """Install a quantized side's float tail and the physical block it stands for
        (restoring a saved state)."""
        self._tail[side][seq, layer] = tail
        self._tail_block[side][seq, layer] = block

    # ------------------------------------------------------------------ read
    def gather(self, layer: int, n: int | None = None, seq: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of the first ``n`` tokens in position order: float32[Hkv, n, D] each.

        A readable (slow) view of the paged layout, used by references and tests.
        """
        n = int(self.cache_seqlens[seq]) if n is None else n
        blocks, rows = self.slots(0, n, seq)
        B, D = self.block_len, self.head_dim
        kc = as_float(self.k_layer(layer, seq)).reshape(self.n_head_kv, -1, B, D)
        vc = as_float(self.v_layer(layer, seq)).reshape(self.n_head_kv, -1, D, B)
        k = kc[:, blocks, rows, :].astype(np.float32)          # [Hkv, n, D]
        v = vc[:, blocks, :, rows].transpose(1, 0, 2).astype(np.float32)  # [n, Hkv, D] -> [Hkv, n, D]
        return k, v

    @property
    def nbytes(self) -> int:
        tails = sum(t.nbytes for t in (*self._tail.values(), *self._tail_block.values())
                    if t is not None)
        return self.k_store.nbytes + self.v_store.nbytes + tails
