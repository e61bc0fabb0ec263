"""Block anchors: per-block key summaries that queries are scored against.

Buffer (one layer's slice of ``anchor_``): float16 ``[NB][A][Ha][D]``, indexed
by physical block (docs/kvcache.md section 5). Anchors are built from the block's
valid keys (``n_valid`` tokens; a partial tail block uses only those).

Under GQA query head h reads kv head ``h // G``: every type except DYNAMIC
depends only on the kv head; DYNAMIC picks tokens by the importance of query
head h. The head axis ``Ha`` is either ``Hq`` (the documented layout: a
shared type's value is repeated into each of the G query-head slots) or, for
the shared types, ``Hkv`` (one slot per kv head: G times less memory, what
the engine stores; retrieval reads both).

Slots (the score is ``sum_d max_a(anchor[a][h][d] * q[h][d])``):

- BLOCK_MEAN: per-channel mean of the valid keys.
- BLOCK_MAX: per-channel max (starting from -inf, so an empty block is -inf).
- FIXED: mean of the keys at in-block positions ``a*B//A`` for a < A (only
  the valid ones; position 0 always is).
- DYNAMIC: sum of the keys of the A most important valid tokens for head h
  (ties: lower position first); A = 1 is the hottest token's key.
- QUEST: slot 0 = per-channel max, slot 1 = per-channel min. The score is then
  Quest's upper bound on ``max_t q . k_t`` inside the block.
- CUBOID_MEAN: center ``c = (max + min) / 2``, radius ``r = mean_t |k_t - c|``
  per channel; slot 0 = ``c + r``, slot 1 = ``c - r``, scored like QUEST. Since
  ``r <= (max - min) / 2`` the box is inside QUEST's, so its score is at most
  QUEST's and at least ``q . c``; it is *not* an upper bound on ``max_t q . k_t``
  (a key far from the center on a channel can stick out of the box).

The single-vector types (BLOCK_MEAN, BLOCK_MAX, FIXED, DYNAMIC) write their
vector into every one of the A slots, so the max over slots equals the plain
dot product; :func:`anchor_slots` tells retrieval how many slots it needs to
read (1 for these, 2 for QUEST and CUBOID_MEAN).

QUEST and CUBOID_MEAN round their upper slot up and their lower slot down
when storing fp16, so the bound survives the fp16 anchor buffer even for a
float32 cache; the other types round to nearest.
"""
from __future__ import annotations

import numpy as np

from loaders import jit
from pyimp.attention import kernels as attn_kernels, checks
from loaders.half import f32_to_half_bits, half_bits_to_f32
from pyimp.attention.kernels import load_f32
from pyimp.choices import AnchorType

jit.kernel_module(__file__, attn_kernels)


_TWO_SLOT = (AnchorType.QUEST, AnchorType.CUBOID_MEAN)


def anchor_slots(anchor_type: AnchorType, anchor_num: int) -> int:
    """Number of anchor slots that carry distinct information (what retrieval reads)."""
    return 2 if anchor_type in _TWO_SLOT else 1


def min_anchor_num(anchor_type: AnchorType) -> int:
    """Smallest A the type can be stored in."""
    return 2 if anchor_type in _TWO_SLOT else 1


def group_shared(anchor_type: AnchorType) -> bool:
    """True when all G query heads of a kv head hold the same anchor."""
    return anchor_type is not AnchorType.DYNAMIC


def block_spans(block_table: np.ndarray, n_ctx: int, block_len: int, lb_start: int = 0,
                lb_end: int | None = None):
    """Physical ids and valid-token counts of logical blocks [lb_start, lb_end) (int64 arrays)."""
    n_lb = -(-n_ctx // block_len)
    lb_end = n_lb if lb_end is None else min(lb_end, n_lb)
    lb = np.arange(lb_start, lb_end)
    n_valid = np.minimum(block_len, n_ctx - lb * block_len)
    return block_table[lb].astype(np.int64), n_valid.astype(np.int64)


def round_up_f16(x: np.ndarray) -> np.ndarray:
    y = x.astype(np.float16)
    low = y.astype(np.float32) < x
    y[low] = np.nextafter(y[low], np.float16(np.inf))
    return y


def _round_down_f16(x: np.ndarray) -> np.ndarray:
    y = x.astype(np.float16)
    high = y.astype(np.float32) > x
    y[high] = np.nextafter(y[high], np.float16(-np.inf))
    return y


# --------------------------------------------------------------------------
# the anchors of every type but DYNAMIC, compiled (the NumPy code in compute_anchors is the
# reference): one pass over a block's keys per kv head, in the reference's order
# --------------------------------------------------------------------------

_FIXED, _QUEST, _MEAN, _MAX, _CUBOID = 0, 1, 2, 3, 4
_KIND = {AnchorType.FIXED: _FIXED, AnchorType.QUEST: _QUEST, AnchorType.BLOCK_MEAN: _MEAN,
         AnchorType.BLOCK_MAX: _MAX, AnchorType.CUBOID_MEAN: _CUBOID}


@jit.njit
def _f16_up_bits(x):
    """fp16 bits of the smallest fp16 >= x (x float32; NaN stays NaN): round_up_f16."""
    h = f32_to_half_bits(x)
    if half_bits_to_f32(h) < x:          # never for NaN or +inf
        if h == 0 or h == 0x8000:
            return np.uint16(1)
        return np.uint16(h - 1) if h & 0x8000 else np.uint16(h + 1)
    return h


@jit.njit
def _f16_down_bits(x):
    """fp16 bits of the largest fp16 <= x: _round_down_f16."""
    h = f32_to_half_bits(x)
    if half_bits_to_f32(h) > x:
        if h == 0 or h == 0x8000:
            return np.uint16(0x8001)
        return np.uint16(h + 1) if h & 0x8000 else np.uint16(h - 1)
    return h


@jit.njit
def _anchor_rows(kind, k_cache, blocks, n_valid, out):
    """out[i, a, kvh*rep + g, :] = fp16 bits of slot a of block blocks[i]'s anchor for kv head
    kvh (rep = out heads / kv heads), from k_cache [Hkv][NB][B*D] (fp16 bits as uint16, or
    float32; token-major blocks) and n_valid [n]. Reductions run over the tokens in order, the
    first token's value (or the masked fill) first, as NumPy reduces the token axis of the
    reference, masked tokens included: so the sums are the same float32 values (a -0 sum
    turns +0 as there); a maximum or minimum among keys of both zero signs may keep either
    sign."""
    Hkv, _, BD = k_cache.shape
    n = blocks.shape[0]
    A, Ha, D = out.shape[1], out.shape[2], out.shape[3]
    B = BD // D
    rep = Ha // Hkv
    inf = np.float32(np.inf)
    k = np.empty(BD, np.float32)
    s0 = np.empty(D, np.float32)
    s1 = np.empty(D, np.float32)
    b0 = np.empty(D, np.uint16)
    b1 = np.empty(D, np.uint16)
    for i in range(n):
        nv = n_valid[i]
        for kvh in range(Hkv):
            load_f32(k_cache[kvh, blocks[i]], 0, BD, k, k)
            if kind == _MEAN or kind == _FIXED:
                ns = 0
                for t in range(B):
                    take = t < nv
                    if kind == _FIXED and take:
                        a = (t * A + B - 1) // B          # smallest a with a*B//A >= t
                        take = a < A and (a * B) // A == t
                    ns += take
                    for d in range(D):
                        x = k[t * D + d] if take else np.float32(0.0)
                        s0[d] = x if t == 0 else s0[d] + x
                c = np.float32(max(ns, 1) if kind == _FIXED else max(nv, 1))
                for d in range(D):
                    b0[d] = f32_to_half_bits(s0[d] / c)
                    b1[d] = b0[d]
            else:
                for t in range(B):
                    take = t < nv
                    for d in range(D):
                        x = k[t * D + d]
                        hi = x if take else -inf
                        lo = x if take else inf
                        if t == 0:
                            s0[d], s1[d] = hi, lo
                        else:
                            s0[d] = max(s0[d], hi)
                            s1[d] = min(s1[d], lo)
                if kind == _MAX:
                    for d in range(D):
                        b0[d] = f32_to_half_bits(s0[d])
                        b1[d] = b0[d]
                elif kind == _QUEST:
                    for d in range(D):
                        b0[d] = _f16_up_bits(s0[d])
                        b1[d] = _f16_down_bits(s1[d])
                else:                                   # CUBOID_MEAN
                    cnt = np.float32(max(nv, 1))
                    for d in range(D):
                        c = (s0[d] + s1[d]) * np.float32(0.5)
                        r = np.float32(0.0)
                        for t in range(B):
                            x = abs(k[t * D + d] - c) if t < nv else np.float32(0.0)
                            r = x if t == 0 else r + x
                        r = r / cnt
                        b0[d] = _f16_up_bits(c + r)
                        b1[d] = _f16_down_bits(c - r)
            for a in range(A):
                src = b1 if a == 1 else b0
                for g in range(rep):
                    for d in range(D):
                        out[i, a, kvh * rep + g, d] = src[d]


def _compiled_anchors(anchor_type: AnchorType, k_cache: np.ndarray, ids: np.ndarray,
                      n_valid: np.ndarray, anchor: np.ndarray, blocks: np.ndarray) -> None:
    """anchor[blocks] = the anchors of k_cache's blocks ``ids`` (_anchor_rows)."""
    out = np.empty((ids.shape[0],) + anchor.shape[1:], np.uint16)
    kc = k_cache.view(np.uint16) if k_cache.dtype == np.float16 else k_cache
    # int64 ids and counts whatever the caller's: one compiled specialization per cache type
    # (the one the sparse state's warmup compiles)
    _anchor_rows(_KIND[anchor_type], kc, ids.astype(np.int64, copy=False),
                 n_valid.astype(np.int64, copy=False), out)
    anchor[blocks] = out.view(np.float16)


def block_anchors(anchor_type: AnchorType, k_cache: np.ndarray, blocks: np.ndarray,
                  n_valid: np.ndarray, anchor: np.ndarray) -> None:
    """:func:`compute_anchors`' compiled path without its argument checks, for a caller whose
    arguments are its own buffers, valid by construction (the sparse state's per-step refresh
    of a block or two, where the checks cost more than the anchors): every type but DYNAMIC,
    a float16 / float32 ``k_cache``; blocks / n_valid int arrays."""
    _compiled_anchors(anchor_type, k_cache, blocks, n_valid, anchor, blocks)


def compute_anchors(anchor_type: AnchorType, k_cache: np.ndarray, blocks, n_valid,
                    anchor: np.ndarray, importance: np.ndarray | None = None,
                    backend: str = "numba") -> None:
    """(Re)compute the anchors of the given physical blocks, in place.

    k_cache: float16/float32 [Hkv][NB][B*D] or a quantized K layer
    (:class:`pyimp.kv.cache.QuantizedKV`: anchors come from the dequantized keys); blocks: int [n] physical ids
    (distinct); n_valid: int [n] valid tokens of each block (0..B);
    anchor: float16 [NB][A][Ha][D], rows ``blocks`` written, ``Ha`` = Hq or (shared
    types) Hkv, see the module docstring; importance: float16 [NB][B][Hq], required
    for DYNAMIC. Bad arguments raise ValueError naming the argument. backend "numba": the
    compiled :func:`_anchor_rows` for every type but DYNAMIC; "numpy": the reference below.
    """
    if backend not in ("numba", "numpy"):
        raise ValueError(f"backend must be 'numba' or 'numpy', got {backend!r}")
    from pyimp.kv.cache import QuantizedKV
    quantized = isinstance(k_cache, QuantizedKV)
    if not quantized:
        checks.array("k_cache", k_cache, checks.KV_DTYPES, 3, layout="[Hkv][NB][B*D]")
    Hkv, NB, BD = k_cache.shape
    checks.array("anchor", anchor, (np.float16, np.float32), 4, layout="[NB][A][Ha][D]")
    _, A, Ha, D = anchor.shape
    if anchor.shape[0] != NB or D == 0 or BD % D:
        raise ValueError(f"anchor of shape {anchor.shape} does not fit k_cache of shape "
                         f"{k_cache.shape} ([NB][A][Ha][D] with NB = {NB}, D dividing {BD})")
    checks.writable("anchor", anchor)
    B = BD // D
    blocks = np.asarray(blocks)
    n_valid = np.asarray(n_valid)
    if blocks.ndim != 1 or not np.issubdtype(blocks.dtype, np.integer) and blocks.size:
        raise ValueError(f"blocks must be a 1-D array of physical block ids, got {blocks!r}")
    blocks = blocks.astype(np.int64)
    if n_valid.shape != blocks.shape:
        raise ValueError(f"n_valid must give one count per block ({blocks.size}), got shape "
                         f"{n_valid.shape}")
    n_valid = n_valid.astype(np.int64)
    if blocks.size == 0:
        return
    if blocks.min() < 0 or blocks.max() >= NB:
        bad = int(blocks[(blocks < 0) | (blocks >= NB)][0])
        raise ValueError(f"blocks holds {bad}, not a physical block id (0..{NB - 1})")
    if np.unique(blocks).size != blocks.size:
        raise ValueError(f"blocks lists a physical block twice: {blocks.tolist()}")
    if n_valid.min() < 0 or n_valid.max() > B:
        bad = int(n_valid[(n_valid < 0) | (n_valid > B)][0])
        raise ValueError(f"n_valid holds {bad}, outside 0..{B} (the block length)")
    if anchor_type in _TWO_SLOT and A < 2:
        raise ValueError(f"{anchor_type.name} anchors need anchor_num >= 2, got {A}")
    if importance is not None:
        checks.array("importance", importance, np.float16, shape=(NB, B, None), layout="[NB][B][Hq]")
        Hq = importance.shape[2]
    else:
        Hq = Ha
    if Hq % Hkv or not (Ha == Hq or (Ha == Hkv and group_shared(anchor_type))):
        raise ValueError(f"anchor has {Ha} heads: {anchor_type.name} anchors are stored per query "
                         f"head ({Hq})" + ("" if not group_shared(anchor_type) else
                                           f" or per kv head ({Hkv})"))
    G = Hq // Hkv
    n = blocks.size
    if backend == "numba" and anchor_type is not AnchorType.DYNAMIC:
        if quantized:                 # the dequantized keys, blocks in the order listed
            _compiled_anchors(anchor_type, k_cache.blocks_f32(blocks).reshape(Hkv, n, BD),
                              np.arange(n), n_valid, anchor, blocks)
        else:
            block_anchors(anchor_type, k_cache, blocks, n_valid, anchor)
        return
    K = (k_cache.blocks_f32(blocks) if quantized else
         k_cache[:, blocks].astype(np.float32)).reshape(Hkv, n, B, D)
    valid = np.arange(B)[None, :] < n_valid[:, None]  # [n, B]
    vmask = valid[None, :, :, None]  # [1, n, B, 1]
    cnt = np.maximum(n_valid, 1).astype(np.float32)[None, :, None]  # [1, n, 1]

    if anchor_type is AnchorType.DYNAMIC:
        if importance is None:
            raise ValueError("DYNAMIC anchors need the importance matrix")
        imp = importance[blocks].astype(np.float32)  # [n, B, Hq]
        imp = np.where(valid[:, :, None], imp, -np.inf)
        order = np.argsort(-imp, axis=1, kind="stable")  # [n, B, Hq]
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.arange(B)[None, :, None], axis=1)
        w = ((rank < A) & valid[:, :, None]).astype(np.float32)  # [n, B, Hq]
        vec = np.empty((n, Hq, D), np.float32)
        for kvh in range(Hkv):
            hs = slice(kvh * G, (kvh + 1) * G)
            vec[:, hs, :] = np.einsum("nbg,nbd->ngd", w[:, :, hs], K[kvh])
        anchor[blocks] = vec[:, None, :, :].astype(np.float16)
        return

    if anchor_type is AnchorType.BLOCK_MEAN:
        vec = np.where(vmask, K, 0.0).sum(axis=2) / cnt  # [Hkv, n, D]
        slots = [vec.astype(np.float16)] * A
    elif anchor_type is AnchorType.BLOCK_MAX:
        vec = np.where(vmask, K, -np.inf).max(axis=2)
        slots = [vec.astype(np.float16)] * A
    elif anchor_type is AnchorType.FIXED:
        pos = (np.arange(A) * B) // A
        sample = np.zeros((n, B), bool)
        sample[:, pos] = True
        sample &= valid
        ns = np.maximum(sample.sum(axis=1), 1).astype(np.float32)[None, :, None]
        vec = np.where(sample[None, :, :, None], K, 0.0).sum(axis=2) / ns
        slots = [vec.astype(np.float16)] * A
    elif anchor_type is AnchorType.QUEST:
        hi = np.where(vmask, K, -np.inf).max(axis=2)
        lo = np.where(vmask, K, np.inf).min(axis=2)
        slots = [round_up_f16(hi), _round_down_f16(lo)] + [round_up_f16(hi)] * (A - 2)
    elif anchor_type is AnchorType.CUBOID_MEAN:
        hi = np.where(vmask, K, -np.inf).max(axis=2)
        lo = np.where(vmask, K, np.inf).min(axis=2)
        c = (hi + lo) * np.float32(0.5)
        r = np.where(vmask, np.abs(K - c[:, :, None, :]), 0.0).sum(axis=2) / cnt
        slots = [round_up_f16(c + r), _round_down_f16(c - r)] + [round_up_f16(c + r)] * (A - 2)
    else:  # pragma: no cover - enum is closed
        raise ValueError(anchor_type)
    st = np.stack(slots, axis=0).transpose(2, 0, 1, 3)  # [A][Hkv, n, D] -> [n, A, Hkv, D]
    if Ha == Hkv:
        anchor[blocks] = st                               # one slot per kv head
    else:
        anchor[blocks] = np.repeat(st, G, axis=2)         # each kv head into its G query heads
