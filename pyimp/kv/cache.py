"""Paged KV cache in the ggml / docs/kvcache.md layout, float or quantized.

Buffers (allocated once in :class:`KVCache`; ``L`` layers, ``Hkv`` kv heads,
``NB`` physical blocks, ``B`` tokens per block, ``D`` head dim)::

    K  [L][Hkv][NB][B*D]   row t of a block = post-RoPE key of the token in that slot
    V  [L][Hkv][NB][D*B]   transposed: entry d*B + t = channel d of the token in slot t
    tables       int32[n_seq][L][NB_logical]  per layer: slot block -> physical block (-1 = none)
    n_slots      int32[n_seq][L]              slots each layer holds
    slot_pos     int32[n_seq][L][slots]       the position of the token in each slot
    cache_seqlens int32[n_seq]                positions processed (the next token's position)

**Slots and positions.** Attention kernels work in *slot* space: slot s of a
layer is row ``s % B`` of physical block ``table[s // B]``, and slots are in
position order. A layer that never dropped a token has slot == position. An
eviction policy (:mod:`pyimp.kv.policy`) or the sliding-window trim drops
tokens with :meth:`KVCache.compact`: the kept slots move, in order, to the
front (whole leading blocks just leave the table), emptied blocks return to the
layer's pool, and ``slot_pos`` keeps each token's original position. Keys keep
the RoPE of that position. The causal mask needs no map (every cached slot
precedes the query's), and a sliding window becomes a first visible slot per
query row, found in ``slot_pos`` (:func:`pyimp.attention.first_visible`).
Every layer has its own pool: the stores are allocated once (``max_slots``
per layer: the context, or an eviction budget) and zero-filled by the OS on
first touch; blocks are handed out lowest id first, so the pages a layer
touches follow the most blocks it held at once.

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

Physical blocks come from a free pool as the sequence grows, so slot and
physical order differ after a reset or a compaction.
"""
from __future__ import annotations

import numpy as np

from loaders import half, jit, quants, quantize
from loaders.ggml_types import QT
from loaders.half import f32_to_half_bits
from loaders.quantize import BLOCK_BYTES, CODES, quantize_block

from ..choices import FLOAT_KV_TYPES, KV_TYPES, QUANT_KV_TYPES
from ..ops import NonFiniteError

jit.kernel_module(__file__, quantize, half)

# the types' names: pyimp.choices; here what each is stored as
FLOAT_TYPES = {t: np.dtype(f"float{t[1:]}").type for t in FLOAT_KV_TYPES}    # f16: np.float16
QUANT_TYPES = {t: QT[t.upper()] for t in QUANT_KV_TYPES}                    # q8_0: QT.Q8_0
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
        (``loaders.quants.dequantize``, bit-identical to ggml's dequantization; the tail block
        from the tail)."""
        blocks = np.asarray(blocks, dtype=np.int64).reshape(-1)
        Hkv, B, D = self.data.shape[0], self.block_len, self.head_dim
        raw = self.data[:, blocks]                                     # [Hkv, n, bytes]
        rows, n = (B, D) if self.by_token else (D, B)
        vals = quants.dequantize(raw.reshape(Hkv * blocks.size * rows, raw.shape[2] // rows),
                                 self.qtype, n)
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
def _store_float(x, s0, bt, store, by_token, half):
    """Write x float32 [T, Hkv, D] (slots s0..s0+T-1) into a float layer store
    [Hkv][NB][B*D]: token rows (t*D + d) or channel rows (d*B + t); ``half``: the store holds
    fp16 bits (uint16, rounded as NumPy's astype(float16)), else float32 values."""
    T, Hkv, D = x.shape
    B = store.shape[2] // D
    for i in range(T):
        p = s0 + i
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
def _within(k, v, lim_k, lim_v):
    """Every element of k strictly inside (-lim_k, lim_k) and of v inside (-lim_v, lim_v);
    a NaN fails (it fails every comparison). k, v float32 1-D."""
    for i in range(k.shape[0]):
        if not (k[i] < lim_k and k[i] > -lim_k):
            return False
    for i in range(v.shape[0]):
        if not (v[i] < lim_v and v[i] > -lim_v):
            return False
    return True


@jit.njit
def _store_quantized(x, s0, bt, tail, tail_pb, data, code, bsz, by_token, tok_stride,
                     ch_stride):
    """Write x float32 [T, Hkv, D] (slots s0..s0+T-1) through the float tail
    (element (t, d) of a block at ``t*tok_stride + d*ch_stride``); each block completed here is
    quantized into data [Hkv][NB][bytes] (rows by token or by channel). Returns the physical
    block left in the tail (-1: none)."""
    T, Hkv, D = x.shape
    B = tail.shape[1] // D
    n_end = s0 + T
    tmp = np.empty(32, np.float32)
    for lb in range(s0 // B, (n_end - 1) // B + 1):
        base = lb * B
        p_lo = max(s0, base)
        p_hi = min(n_end, base + B)
        pb = bt[lb]
        if p_lo > base and tail_pb != pb:
            raise ValueError("KV cache: the float tail does not hold the block being continued")
        for p in range(p_lo, p_hi):
            t = p - base
            for h in range(Hkv):
                for d in range(D):
                    tail[h, t * tok_stride + d * ch_stride] = x[p - s0, h, d]
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
    """Paged K/V storage for one or more sequences (the engine uses sequence 0).

    Every layer has its own block table and slot count: slot s of layer l is row ``s % B`` of
    physical block ``tables[seq, l, s // B]`` and holds the token at position
    ``slot_pos[seq, l, s]``. Slots are in position order. Until a layer is compacted
    (:meth:`compact`: eviction, or the sliding-window trim) slot == position.
    """

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, n_ctx: int,
                 block_len: int = 32, kv_type: str = "f16", n_seq: int = 1,
                 type_k: str | None = None, type_v: str | None = None, v_layout: str = "token",
                 max_slots: int | None = None):
        type_k, type_v = type_k or kv_type, type_v or kv_type
        self.check_geometry(head_dim, block_len, n_ctx, type_k, type_v, v_layout)
        self.n_layer, self.n_head_kv, self.head_dim = n_layer, n_head_kv, head_dim
        self.block_len = B = block_len
        self.n_ctx = n_ctx
        self.type_k, self.type_v, self.v_layout = type_k, type_v, v_layout
        # slots a layer holds at most (n_ctx unless an eviction policy bounds it)
        self.max_slots = min(n_ctx, max_slots or n_ctx)
        self.blocks_per_seq = -(-self.max_slots // B)
        self.max_blocks = NB = self.blocks_per_seq * n_seq
        self.tables = np.full((n_seq, n_layer, self.blocks_per_seq), -1, dtype=np.int32)
        self.n_slots = np.zeros((n_seq, n_layer), dtype=np.int32)
        self.slot_pos = np.zeros((n_seq, n_layer, self.blocks_per_seq * B), dtype=np.int32)
        # largest position a layer has dropped (-1: none): what a rewind can still restore
        self.max_evicted = np.full((n_seq, n_layer), -1, dtype=np.int64)
        self.cache_seqlens = np.zeros(n_seq, dtype=np.int32)       # positions processed
        # one pool per layer; pop() hands out the lowest id first, so the pages a layer touches
        # (the stores are zero-filled on first touch) follow the most blocks it held at once
        self._free = [list(range(NB - 1, -1, -1)) for _ in range(n_layer)]
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
                store = self._alloc(shape + (rows * n // 32 * BLOCK_BYTES[code],), np.uint8)
                self._tail[side] = self._alloc((n_seq, n_layer, n_head_kv, B * head_dim), np.float32)
                self._tail_block[side] = np.full((n_seq, n_layer), -1, np.int64)
                self._by_token[side] = by_token
            setattr(self, buffer_name(side, t), store)
        self.k_store = getattr(self, buffer_name("k", type_k))
        self.v_store = getattr(self, buffer_name("v", type_v))
        # per physical slot, the log of how many tokens the slot stands for (merged slots,
        # :mod:`pyimp.kv.merge`), added to its score by every attention kernel; None until
        # merging is enabled
        self.lmul: np.ndarray | None = None

    def enable_merging(self) -> None:
        """Allocate the per-slot log-multiplicity ``lmul`` float32 [L][NB][B] (all 0)."""
        if self.lmul is None:
            self.lmul = np.zeros((self.n_layer, self.max_blocks, self.block_len), np.float32)

    def bias(self, layer: int) -> np.ndarray | None:
        """The score bias the attention kernels add per physical slot of a layer (float32
        [NB][B]: the log-multiplicity of merged slots), or None without merging."""
        return None if self.lmul is None else self.lmul[layer]

    @staticmethod
    def _alloc(shape: tuple, dtype) -> np.ndarray:
        """Zeroed storage of a K/V store or float tail (the device cache allocates on the device)."""
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
                     type_v: str | None = None, v_layout: str = "token",
                     max_slots: int | None = None) -> int:
        """Bytes the buffers of a cache of this shape take (computed without allocating)."""
        type_k, type_v = type_k or kv_type, type_v or kv_type
        KVCache.check_geometry(head_dim, block_len, n_ctx, type_k, type_v, v_layout)
        blocks_per_seq = -(-min(n_ctx, max_slots or n_ctx) // block_len)
        nb = blocks_per_seq * n_seq
        total = 0
        for t in (type_k, type_v):
            per_block = round(KVCache.bytes_per_token(head_dim, t) * block_len)
            total += n_layer * n_head_kv * nb * per_block
            if t in QUANT_TYPES:                  # the float32 tail and its block id
                total += n_seq * n_layer * (n_head_kv * block_len * head_dim * 4 + 8)
        # tables and slot positions (int32), slot counts (int32), max_evicted (int64), seqlens
        book = n_seq * n_layer * (blocks_per_seq * 4 + blocks_per_seq * block_len * 4 + 4 + 8)
        return total + book + n_seq * 4

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

    def table(self, layer: int, seq: int = 0) -> np.ndarray:
        """Layer ``layer``'s block table, int32 [blocks]: slot block -> physical block (-1 none)."""
        return self.tables[seq, layer]

    def slot_count(self, layer: int, seq: int = 0) -> int:
        """Slots layer ``layer`` holds (committed tokens it has not dropped)."""
        return int(self.n_slots[seq, layer])

    def positions(self, layer: int, seq: int = 0, n: int | None = None) -> np.ndarray:
        """Positions of the first ``n`` slots of a layer (default: every committed slot),
        int32, increasing (a view)."""
        return self.slot_pos[seq, layer, :self.slot_count(layer, seq) if n is None else n]

    def compacted(self, layer: int, seq: int = 0) -> bool:
        """Has the layer dropped tokens (so slot != position)?"""
        return bool(self.max_evicted[seq, layer] >= 0)

    @property
    def quantized(self) -> bool:
        return self.type_k in QUANT_TYPES or self.type_v in QUANT_TYPES

    def layer_token_bytes(self) -> float:
        """Bytes of K and V one token occupies in one layer (all kv heads)."""
        return self.n_head_kv * (self.bytes_per_token(self.head_dim, self.type_k) +
                                 self.bytes_per_token(self.head_dim, self.type_v))

    def block_bytes(self) -> int:
        """Bytes of K and V one physical block of one layer holds (all kv heads)."""
        return int(self.k_store[0, :, 0].nbytes + self.v_store[0, :, 0].nbytes)

    def bytes_held(self, seq: int = 0) -> int:
        """Bytes of K and V in the blocks the sequence's layers hold now."""
        return int((self.tables[seq] >= 0).sum()) * self.block_bytes()

    # ------------------------------------------------------------------ pool
    def _release(self, layer: int, blocks) -> None:
        self._free[layer].extend(int(b) for b in sorted((int(b) for b in blocks), reverse=True))
        self._free[layer].sort(reverse=True)          # lowest id handed out first

    def reset(self, seq: int = 0) -> None:
        """Forget sequence ``seq``; its blocks return to the pool (contents are left as they are)."""
        for il in range(self.n_layer):
            row = self.tables[seq, il]
            self._release(il, row[row >= 0])
        self.tables[seq] = -1
        self.n_slots[seq] = 0
        self.max_evicted[seq] = -1
        self.cache_seqlens[seq] = 0
        for tb in self._tail_block.values():
            if tb is not None:
                tb[seq] = -1

    def reserve(self, n_tokens: int, seq: int = 0) -> None:
        """Make room for ``n_tokens`` more tokens in every layer, taking blocks from the pools."""
        n_new = int(self.cache_seqlens[seq]) + n_tokens
        if n_new > self.n_ctx:
            raise ContextFullError(f"context full: {int(self.cache_seqlens[seq])} cached + "
                                   f"{n_tokens} new tokens exceed the context size {self.n_ctx}")
        for il in range(self.n_layer):
            s_new = int(self.n_slots[seq, il]) + n_tokens
            if s_new > self.max_slots:
                raise ContextFullError(f"layer {il}: {int(self.n_slots[seq, il])} held + "
                                       f"{n_tokens} new tokens exceed the {self.max_slots} slots "
                                       f"a layer holds")
            row = self.tables[seq, il]
            # the blocks below the one the layer's next slot falls in hold its tokens: mapped
            for lb in range(int(self.n_slots[seq, il]) // self.block_len,
                            -(-s_new // self.block_len)):
                if row[lb] < 0:
                    if not self._free[il]:
                        raise ContextFullError(f"layer {il}: KV block pool exhausted")
                    row[lb] = self._free[il].pop()

    # ----------------------------------------------------------------- write
    def slots(self, s0: int, n: int, seq: int = 0, layer: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Physical block and in-block row of slots s0 .. s0+n-1 of a layer: (int64[n], int64[n])."""
        s = np.arange(s0, s0 + n)
        blocks = self.tables[seq, layer][s // self.block_len].astype(np.int64)
        return blocks, s % self.block_len

    def slot_of(self, layer: int, pos: int, seq: int = 0) -> int:
        """The slot a token at position ``pos`` (not yet committed, or any position of a layer
        that never dropped a token) is written to."""
        if not self.compacted(layer, seq):
            return int(pos)
        n = int(self.cache_seqlens[seq])
        if pos < n:
            raise ValueError(f"layer {layer} dropped tokens: position {pos} < {n} cannot be "
                             f"rewritten in place")
        return int(self.n_slots[seq, layer]) + int(pos) - n

    def write(self, layer: int, k: np.ndarray, v: np.ndarray, pos0: int, seq: int = 0) -> None:
        """Store k, v float32[T, Hkv, D] of positions pos0 .. pos0+T-1 in their slots
        (:meth:`slot_of`; blocks must be reserved)."""
        T = k.shape[0]
        if T == 0:
            return
        # f16 turns |x| >= 65520 into inf without a word (quantized types store fp16 scales),
        # and a NaN here poisons every later attention read: refuse before anything is stored
        # (the cache keeps what it held). One pass over both (_within), a few us per layer
        # per decode step (four NumPy reductions took ~10).
        lim_k, lim_v = (float("inf") if t == "f32" else _FINITE_LIMIT for t in (self.type_k, self.type_v))
        if not _within(np.ravel(k).astype(np.float32, copy=False), np.ravel(v).astype(np.float32, copy=False),
                       lim_k, lim_v):
            raise NonFiniteError(self._non_finite_message(layer, k, v))
        s0 = self.slot_of(layer, pos0, seq)
        self.slot_pos[seq, layer, s0:s0 + T] = np.arange(pos0, pos0 + T, dtype=np.int32)
        B, D = self.block_len, self.head_dim
        bt = self.tables[seq, layer]
        if self.lmul is not None:        # a slot freed by a merge or a rewind stands for one token
            sl = np.arange(s0, s0 + T)
            self.lmul[layer][bt[sl // B], sl % B] = 0.0
        for side, x in (("k", k), ("v", v)):
            store = self.k_store if side == "k" else self.v_store
            if self._tail[side] is None:    # f16 / f32: K token rows, V channel rows
                half = store.dtype == np.float16
                _store_float(np.ascontiguousarray(x, dtype=np.float32), s0, bt,
                             store[layer].view(np.uint16) if half else store[layer], side == "k", half)
                continue
            qt = QUANT_TYPES[self.type_k if side == "k" else self.type_v]
            code = CODES[qt]
            tok_stride, ch_stride = (D, 1) if side == "k" else (1, B)
            tb = self._tail_block[side]
            tb[seq, layer] = _store_quantized(
                np.ascontiguousarray(x, dtype=np.float32), s0, bt,
                self._tail[side][seq, layer], int(tb[seq, layer]), store[layer], code,
                BLOCK_BYTES[code], self._by_token[side], tok_stride, ch_stride)

    def write_slots(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray,
                    seq: int = 0) -> None:
        """Overwrite the keys and values of held slots ``slots`` (int, any order) with k, v
        float32 [n, Hkv, D] (merged slots, :mod:`pyimp.kv.merge`). A quantized side quantizes
        each row into its block (K and token-layout V keep one row per token), or writes it to
        the float tail when the slot is the tail block's; V stored by channel cannot (its
        rows span 32 tokens): ValueError."""
        slots = np.asarray(slots, dtype=np.int64)
        if slots.size == 0:
            return
        n = int(self.n_slots[seq, layer])
        if slots.min() < 0 or slots.max() >= n:
            raise ValueError(f"layer {layer}: slots to overwrite must be in 0..{n - 1}")
        B, D, Hkv = self.block_len, self.head_dim, self.n_head_kv
        bt = self.tables[seq, layer]
        for side, x in (("k", k), ("v", v)):
            x = np.ascontiguousarray(x, dtype=np.float32)
            store = (self.k_store if side == "k" else self.v_store)[layer]
            if self._tail[side] is None:
                half = store.dtype == np.float16
                for i, sl in enumerate(slots):
                    _store_float(x[i:i + 1], int(sl), bt,
                                 store.view(np.uint16) if half else store, side == "k", half)
                continue
            if not self._by_token[side]:
                raise ValueError("V stored by channel (v_layout='channel') cannot rewrite single "
                                 "tokens: use v_layout='token' to merge tokens")
            qt = QUANT_TYPES[self.type_k if side == "k" else self.type_v]
            rows = quantize.quantize_rows(x.reshape(-1, D), qt).reshape(len(slots), Hkv, -1)
            rb = rows.shape[2]
            tb = int(self._tail_block[side][seq, layer])
            tok_stride, ch_stride = (D, 1) if side == "k" else (1, B)
            for i, sl in enumerate(slots):
                pb, t = int(bt[sl // B]), int(sl % B)
                if pb == tb:
                    idx = t * tok_stride + np.arange(D) * ch_stride
                    self._tail[side][seq, layer][:, idx] = x[i]
                else:
                    store[:, pb, t * rb:(t + 1) * rb] = rows[i]

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
        self.n_slots[seq] += n

    # -------------------------------------------------------------- eviction
    def compact(self, layer: int, keep: np.ndarray, seq: int = 0, extra=()) -> None:
        """Keep only slots ``keep`` (increasing slot indices) of a layer: they move, in order,
        to slots 0..len(keep)-1 and the blocks left empty return to the pool. Keys keep the
        RoPE of their positions; ``slot_pos`` moves with them. ``extra``: more per-slot arrays
        indexed ``[physical block][row]...`` (a layer's ``importance_``) moved the same way.

        A quantized side keeps its float tail as it is, so there a compaction must drop a
        multiple of B slots and keep the tail's slots (the last ``n % B``); ValueError
        otherwise. V stored by channel (``v_layout="channel"``) only drops whole leading
        blocks (its rows span 32 tokens).
        """
        B, D, Hkv = self.block_len, self.head_dim, self.n_head_kv
        n = int(self.n_slots[seq, layer])
        keep = np.asarray(keep, dtype=np.int64)
        m = keep.size
        if m and (keep[0] < 0 or keep[-1] >= n or np.any(np.diff(keep) <= 0)):
            raise ValueError(f"layer {layer}: slots to keep must be increasing, in 0..{n - 1}")
        if m == n:
            return
        if self.lmul is not None:
            extra = tuple(extra) + (self.lmul[layer],)
        dropped = np.setdiff1d(np.arange(n), keep)
        pos = self.slot_pos[seq, layer]
        self.max_evicted[seq, layer] = max(int(self.max_evicted[seq, layer]),
                                           int(pos[dropped].max()))
        row = self.tables[seq, layer]
        front = n - m
        if front % B == 0 and np.array_equal(keep, np.arange(front, n)):
            # whole leading blocks: rotate the table, nothing moves
            k = front // B
            self._release(layer, row[:k])
            nb_used = -(-n // B)
            row[:nb_used - k] = row[k:nb_used].copy()
            row[nb_used - k:] = -1
            pos[:m] = pos[front:n].copy()
            self.n_slots[seq, layer] = m
            return
        if self.quantized:
            tail_n = n % B
            if front % B or (tail_n and not np.array_equal(keep[m - tail_n:], np.arange(n - tail_n, n))):
                raise ValueError(f"layer {layer}: a quantized KV cache drops a multiple of "
                                 f"{B} tokens and keeps the last {tail_n} (the float tail)")
            if self._tail["v"] is not None and not self._by_token["v"]:
                raise ValueError("V stored by channel (v_layout='channel') cannot drop single "
                                 "tokens: use v_layout='token' with an eviction policy")
        src_b, src_r = row[keep // B].astype(np.int64), keep % B
        dst = np.arange(m)
        dst_b, dst_r = row[dst // B].astype(np.int64), dst % B
        moved = keep != dst
        for side in ("k", "v"):
            store = (self.k_store if side == "k" else self.v_store)[layer]
            mv = moved.copy()
            if self._tail[side] is not None and n % B:    # the tail's slots stay in the tail
                mv[m - n % B:] = False
            sb, sr, db, dr = src_b[mv], src_r[mv], dst_b[mv], dst_r[mv]
            if self._tail[side] is None:
                if side == "k":
                    view = store.reshape(Hkv, -1, B, D)
                    view[:, db, dr, :] = view[:, sb, sr, :]
                else:
                    view = store.reshape(Hkv, -1, D, B)
                    view[:, db, :, dr] = view[:, sb, :, sr]
            else:
                view = store.reshape(Hkv, store.shape[1], B, -1)
                view[:, db, dr, :] = view[:, sb, sr, :]
        for arr in extra:
            arr[dst_b[moved], dst_r[moved]] = arr[src_b[moved], src_r[moved]]
        pos[:m] = pos[keep]
        nb_old, nb_new = -(-n // B), -(-m // B)
        self._release(layer, row[nb_new:nb_old])
        row[nb_new:] = -1
        self.n_slots[seq, layer] = m
        for side, tb in self._tail_block.items():
            if tb is not None and tb[seq, layer] >= 0:
                tb[seq, layer] = row[(m - 1) // B] if m % B else -1

    # ------------------------------------------------------- rewind / restore
    def checkpoint(self, seq: int = 0):
        """What :meth:`truncate` needs to rewind exactly to the current length (the float tails
        of a quantized cache; None for a float cache)."""
        if not self.quantized:
            return None
        return {side: (self._tail[side][seq].copy(), self._tail_block[side][seq].copy())
                for side in ("k", "v") if self._tail[side] is not None}

    def truncate(self, n: int, seq: int = 0, checkpoint=None) -> None:
        """Forget positions n.. of sequence ``seq`` in every layer (their blocks stay reserved).

        With the ``checkpoint`` taken when the cache held exactly n tokens the float tails
        are restored as they were (exact). Otherwise a quantized block that the cut falls
        inside is dequantized into its tail: the kept tokens read back as their quantized
        values. Slots a layer dropped (eviction, the sliding-window trim) do not come back:
        see :meth:`rewinds_exactly`.
        """
        self.cache_seqlens[seq] = n
        for il in range(self.n_layer):
            s = int(self.n_slots[seq, il])
            self.n_slots[seq, il] = int(np.searchsorted(self.slot_pos[seq, il, :s], n))
        if checkpoint is not None:
            for side, (tail, tb) in checkpoint.items():
                self._restore_tail(side, seq, tail, tb)
            return
        B = self.block_len
        for side in ("k", "v"):
            if self._tail[side] is None:
                continue
            tb = self._tail_block[side][seq]
            for layer in range(self.n_layer):
                s = int(self.n_slots[seq, layer])
                if s % B == 0:
                    tb[layer] = -1
                    continue
                pb = int(self.tables[seq, layer][s // B])
                if tb[layer] != pb:
                    self._refill_tail(side, layer, seq, pb)
                    tb[layer] = pb

    def _restore_tail(self, side: str, seq: int, tail, tail_block: np.ndarray) -> None:
        """Put back a side's float tails and tail blocks of every layer (a checkpoint's)."""
        self._tail[side][seq] = tail
        self._tail_block[side][seq] = tail_block

    def _refill_tail(self, side: str, layer: int, seq: int, pb: int) -> None:
        """The tail of a layer's side = the dequantized block pb (in the float layout)."""
        self._tail[side][seq, layer] = self.layer(side, layer, seq).blocks_f32([pb])[:, 0]

    def rewinds_exactly(self, n: int, windows, seq: int = 0) -> bool:
        """Would :meth:`truncate` to ``n`` leave every layer holding what it needs to continue
        from position n, as if the tokens after n had never come? ``windows[il]``: the layer's
        sliding window (0: global). A global layer must not have dropped anything; a
        sliding-window layer only tokens that position n would no longer see."""
        for il, w in enumerate(windows):
            ev = int(self.max_evicted[seq, il])
            if ev >= 0 and (w <= 0 or ev > n - w):
                return False
        return True

    def install(self, n_tokens: int, positions, max_evicted, seq: int = 0) -> None:
        """Take blocks for an emptied sequence that will hold ``positions[il]`` (int32, slot ->
        position) in each layer after ``n_tokens`` positions (restoring a saved state: the
        caller writes the blocks' contents)."""
        if int(self.cache_seqlens[seq]) or self.n_slots[seq].any():
            raise ValueError("install needs an empty sequence (reset it first)")
        for il, pos in enumerate(positions):
            s = len(pos)
            row = self.tables[seq, il]
            for lb in range(-(-s // self.block_len)):
                row[lb] = self._free[il].pop()
            self.slot_pos[seq, il, :s] = pos
            self.n_slots[seq, il] = s
        self.max_evicted[seq] = max_evicted
        self.cache_seqlens[seq] = n_tokens

    def set_tail(self, side: str, layer: int, tail: np.ndarray, block: int, seq: int = 0) -> None:
        """Install a quantized side's float tail and the physical block it stands for
        (restoring a saved state)."""
        self._tail[side][seq, layer] = tail
        self._tail_block[side][seq, layer] = block

    # ------------------------------------------------------------------ read
    def gather(self, layer: int, n: int | None = None, seq: int = 0,
               start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of the layer's slots ``start .. n-1`` in slot order: float32
        [Hkv, n - start, D] each (their positions: :meth:`positions`).

        A readable (slow) view of the paged layout, used by references, tests and the
        lowrank / lsh selection modes.
        """
        n = self.slot_count(layer, seq) if n is None else n
        blocks, rows = self.slots(start, n - start, seq, layer)
        B, D = self.block_len, self.head_dim
        kc = as_float(self.k_layer(layer, seq)).reshape(self.n_head_kv, -1, B, D)
        vc = as_float(self.v_layer(layer, seq)).reshape(self.n_head_kv, -1, D, B)
        k = kc[:, blocks, rows, :].astype(np.float32)          # [Hkv, n, D]
        v = vc[:, blocks, :, rows].transpose(1, 0, 2).astype(np.float32)  # [n, Hkv, D] -> [Hkv, n, D]
        return k, v

    @property
    def book_nbytes(self) -> int:
        """Bytes of the bookkeeping: tables, slot positions and counts, sequence lengths."""
        return int(self.tables.nbytes + self.slot_pos.nbytes + self.n_slots.nbytes +
                   self.max_evicted.nbytes + self.cache_seqlens.nbytes)

    @property
    def nbytes(self) -> int:
        tails = sum(t.nbytes for t in (*self._tail.values(), *self._tail_block.values())
                    if t is not None)
        return self.k_store.nbytes + self.v_store.nbytes + tails
