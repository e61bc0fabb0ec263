"""Importance matrix update and the fp16 codec shared by the attention kernels.

Buffer (one layer's slice of ``importance_``): float16 ``[NB][B][Hq]``, indexed by
*physical* block; token ``p`` of the sequence lives at
``[block_table[p // B], p % B, h]`` (docs/kvcache.md sections 2-4).

Update rule, computed in float32 and stored once::

    importance[b, t, h] = fp16(min(decay * fp32(old) + new[h, p], FP16_MAX))

FP16 limits (documented behaviour, tested):

- Stall at 2048: fp16 values in [2048, 4096) are spaced 2 apart, so adding
  ``x <= 1`` to 2048 rounds back to 2048 (``x == 1`` is a tie and rounds to the
  even 2048). A decode step adds at most 1 to any entry (a softmax
  probability), so an entry that reaches 2048 by decode stops growing. In
  general an entry ``v`` ignores any increment below half the fp16 spacing at
  ``v`` (2**-11 relative).
- Saturation at 65504: sums that would round to fp16 infinity are clamped to
  65504, the largest finite fp16, so importance never becomes inf (inf would
  make rankings and decay meaningless). A prefill adds up to ``W`` per entry
  at once, so long observation windows reach this limit on sink tokens.
- ``decay < 1`` (``new = decay*old + new``) keeps entries bounded:
  a steady per-step mass ``x`` converges to ``x / (1 - decay)``.

Numba kernels take the fp16 buffers as ``.view(np.uint16)``, decode with the
float32 table from :func:`fp16_lut` and encode with round-to-nearest-even on
the float32 bit pattern (bit-identical to NumPy's ``astype(np.float16)``); the
decode step's block update uses LLVM's half conversions instead (the same
values, F16C instructions on x86).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import prange

from loaders import jit
from pyimp.attention import kernels as attn_kernels, checks
from loaders.half import f32_to_half_bits, half_bits_to_f32

jit.kernel_module(__file__, attn_kernels)

FP16_MAX = 65504.0  # largest finite float16; importance saturates here
FP16_STALL = 2048.0  # from here on fp16 spacing is 2: adding <= 1 is lost
PARALLEL_MIN_WORK = 1 << 16  # entries below which the update kernels run single-threaded


def kernel_view(cache):
    """A KV cache layer as kernels take it: fp16 travels as uint16 bits, float32 as it is, a
    quantized layer (:class:`pyimp.kv.cache.QuantizedKV`) as its (data, tail, meta) tuple."""
    from pyimp.kv.cache import QuantizedKV
    if isinstance(cache, QuantizedKV):
        return cache.operand()
    if cache.dtype == np.float16:
        return cache.view(np.uint16)
    if cache.dtype == np.float32:
        return cache
    raise TypeError(f"KV cache dtype must be float16 or float32, got {cache.dtype}")


@functools.lru_cache(maxsize=1)
def fp16_lut() -> np.ndarray:
    """float32[65536]: value of every fp16 bit pattern (read-only)."""
    lut = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    lut.setflags(write=False)
    return lut


# --------------------------------------------------------------------------
# float32 -> fp16 bits (round to nearest, ties to even)
# --------------------------------------------------------------------------


@jit.njit
def _f16_bits(u32):
    """uint16 bit pattern of the fp16 nearest to the float32 with bits ``u32``."""
    u = np.int64(u32)
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a >= 0x7F800000:  # inf or NaN
        if a > 0x7F800000:
            return np.uint16(sign | 0x7E00)
        return np.uint16(sign | 0x7C00)
    if a >= 0x477FF000:  # >= 65520 rounds to inf
        return np.uint16(sign | 0x7C00)
    if a >= 0x38800000:  # normal fp16 range (>= 2**-14)
        h = (a >> 13) - 0x1C000  # rebias exponent 127 -> 15, keep 10 mantissa bits
        rem = a & 0x1FFF
        if rem > 0x1000 or (rem == 0x1000 and (h & 1) == 1):
            h += 1
        return np.uint16(sign | h)
    if a < 0x33000000:  # below 2**-25: rounds to zero
        return np.uint16(sign)
    # fp16 subnormal: value / 2**-24 rounded
    e = a >> 23
    m = (a & 0x7FFFFF) | 0x800000
    shift = 126 - e
    h = m >> shift
    rem = m & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    if rem > half or (rem == half and (h & 1) == 1):
        h += 1
    return np.uint16(sign | h)


@jit.njit
def _encode_fp16_kernel(x, out):
    bits = x.view(np.uint32)
    for i in range(x.size):
        out[i] = _f16_bits(bits[i])


def encode_fp16(x: np.ndarray) -> np.ndarray:
    """float32[n] -> uint16[n] fp16 bits, via the kernels' encoder (for tests)."""
    x = np.ascontiguousarray(x, dtype=np.float32).ravel()
    out = np.empty(x.size, np.uint16)
    _encode_fp16_kernel(x, out)
    return out


# --------------------------------------------------------------------------
# dense update: new mass indexed by absolute position
# --------------------------------------------------------------------------


@jit.njit
def _update_block(imp, bt, new, pos_lo, decay, lut, lb, tmp, bits):
    """Update the B rows of logical block lb (tmp/bits: float32 [Hq] scratch and its bits)."""
    NB, B, Hq = imp.shape
    n_pos = new.shape[1]
    pb = bt[lb]
    dec = np.float32(decay)
    for t in range(B):
        p = lb * B + t
        if p >= n_pos:
            break
        if decay == 1.0 and p < pos_lo:
            continue
        for h in range(Hq):
            x = lut[imp[pb, t, h]]
            if decay != 1.0:
                x = dec * x
            if p >= pos_lo:
                x = x + new[h, p]
            if x > FP16_MAX:
                x = np.float32(FP16_MAX)
            tmp[h] = x
        for h in range(Hq):
            imp[pb, t, h] = _f16_bits(bits[h])


@jit.njit(parallel=True)
def _importance_update_kernel(imp, bt, new, pos_lo, decay, lut, parallel):
    """One writer per physical block; ``parallel`` False runs the same loop on this thread."""
    B, Hq = imp.shape[1], imp.shape[2]
    n_lb = (new.shape[1] + B - 1) // B
    lb0 = 0 if decay != 1.0 else pos_lo // B
    if parallel:
        for lb in prange(lb0, n_lb):
            tmp = np.empty(Hq, np.float32)
            _update_block(imp, bt, new, pos_lo, decay, lut, lb, tmp, tmp.view(np.uint32))
    else:
        tmp = np.empty(Hq, np.float32)
        for lb in range(lb0, n_lb):
            _update_block(imp, bt, new, pos_lo, decay, lut, lb, tmp, tmp.view(np.uint32))


def importance_update_ref(importance, block_table, new, pos_lo=0, decay=1.0) -> None:
    """NumPy reference of :func:`importance_update`."""
    NB, B, Hq = importance.shape
    n_pos = new.shape[1]
    p = np.arange(n_pos)
    pb, t = block_table[p // B], p % B
    old = importance[pb, t, :].astype(np.float32)  # [n_pos, Hq]
    add = np.asarray(new, np.float32).T.copy()
    add[p < pos_lo] = 0.0
    if decay != 1.0:
        x = np.float32(decay) * old + add
        rows = p
    else:
        x = old + add
        rows = p[p >= pos_lo]
        x = x[p >= pos_lo]
    x = np.minimum(x, np.float32(FP16_MAX))
    importance[block_table[rows // B], rows % B, :] = x.astype(np.float16)


def _check_update(importance, block_table, new, pos_lo, decay) -> None:
    checks.array("importance", importance, np.float16, 3, layout="[NB][B][Hq]")
    checks.writable("importance", importance)
    NB, B, Hq = importance.shape
    checks.array("new", new, np.float32, shape=(Hq, None), layout="[Hq, n_pos]")
    n_pos = new.shape[1]
    checks.count("pos_lo", pos_lo, 0, n_pos)
    checks.block_table(block_table, -(-n_pos // B), NB)
    if not 0.0 < float(decay) <= 1.0:
        raise ValueError(f"decay must be in (0, 1], got {decay}")


def importance_update(importance: np.ndarray, block_table: np.ndarray, new: np.ndarray,
                      pos_lo: int = 0, decay: float = 1.0, backend: str = "numba") -> None:
    """Add attention mass to one layer's importance slice, in place.

    importance: float16 [NB][B][Hq]; block_table: int32 [NB_logical];
    new: float32 [Hq, n_pos], mass of absolute positions 0..n_pos-1 (entries
    below ``pos_lo`` are treated as 0 and, when ``decay == 1``, not touched);
    decay: ``new = decay*old + new`` applied to every position < n_pos.
    """
    _check_update(importance, block_table, new, pos_lo, decay)
    if backend == "numpy":
        importance_update_ref(importance, block_table, new, pos_lo, decay)
        return
    # small updates (short contexts) cost less than waking the thread pool
    n_work = new.shape[0] * (new.shape[1] if decay != 1.0 else new.shape[1] - pos_lo)
    _importance_update_kernel(importance.view(np.uint16), block_table, new, int(pos_lo),
                              float(decay), fp16_lut(), n_work >= PARALLEL_MIN_WORK)


# --------------------------------------------------------------------------
# sparse update: mass of the selected blocks only (decay == 1)
# --------------------------------------------------------------------------


@jit.njit
def _update_set_block(imp, bt, sel, cnt, probs, n_ctx, si, k):
    """Add probs[h, k] of the heads h of set si into their columns of its k-th selected block."""
    B, Hq = imp.shape[1], imp.shape[2]
    hps = Hq // sel.shape[0]
    lb = sel[si, k]
    pb = bt[lb]
    for t in range(min(B, n_ctx - lb * B)):
        for h in range(si * hps, (si + 1) * hps):
            # the IR conversions (vcvtph2ps / vcvtps2ph where the CPU has F16C): the same
            # values as the table and _f16_bits, without a 256 KB table read per entry (a
            # decode step updates every layer's window, 18 x 2048 entries for Gemma 3)
            x = half_bits_to_f32(imp[pb, t, h]) + probs[h, k, t]
            if x > FP16_MAX:
                x = np.float32(FP16_MAX)
            imp[pb, t, h] = f32_to_half_bits(x)


@jit.njit(parallel=True)
def _importance_update_blocks_kernel(imp, bt, sel, cnt, probs, n_ctx, parallel):
    """Work item = (set, selected block): the heads of a set and the blocks of a set are
    distinct, so every entry has one writer."""
    nsets, Kw = sel.shape
    if parallel:
        for w in prange(nsets * Kw):
            if w % Kw < cnt[w // Kw]:
                _update_set_block(imp, bt, sel, cnt, probs, n_ctx, w // Kw, w % Kw)
    else:
        for si in range(nsets):
            for k in range(cnt[si]):
                _update_set_block(imp, bt, sel, cnt, probs, n_ctx, si, k)


def importance_update_blocks_ref(importance, block_table, sel, cnt, probs, n_ctx) -> None:
    """NumPy reference of :func:`importance_update_blocks`."""
    NB, B, Hq = importance.shape
    hps = Hq // sel.shape[0]
    for h in range(Hq):
        si = h // hps
        for k in range(cnt[si]):
            lb = sel[si, k]
            nt = min(B, n_ctx - lb * B)
            pb = block_table[lb]
            x = importance[pb, :nt, h].astype(np.float32) + probs[h, k, :nt]
            importance[pb, :nt, h] = np.minimum(x, np.float32(FP16_MAX)).astype(np.float16)


def importance_update_blocks(importance: np.ndarray, block_table: np.ndarray, sel: np.ndarray,
                             cnt: np.ndarray, probs: np.ndarray, n_ctx: int,
                             backend: str = "numba", checked: bool = False) -> None:
    """Add the mass of a block-sparse step (no decay), in place.

    importance: float16 [NB][B][Hq]; sel: int32 [nsets, K] logical block ids
    (query head h uses set ``h // (Hq // nsets)``), cnt: int32 [nsets];
    probs: float32 [Hq, K, B], probability of token t of the k-th selected
    block; positions >= n_ctx are ignored. Blocks within a set must be distinct.
    ``checked``: the caller has validated these arrays already (a decode kernel's own
    arguments, :func:`pyimp.attention.decode_over_blocks`): the checks, whose
    reductions cost more than the update, are skipped.
    """
    if not checked:
        checks.array("importance", importance, np.float16, 3, layout="[NB][B][Hq]")
        checks.writable("importance", importance)
        NB, B, Hq = importance.shape
        checks.array("block_table", block_table, np.int32, 1, layout="[NB_logical]")
        checks.count("n_ctx", n_ctx, 1, block_table.shape[0] * B)
        n_lb = -(-int(n_ctx) // B)
        checks.block_table(block_table, n_lb, NB)
        checks.selection(sel, cnt, Hq, 1, n_lb)
        checks.array("probs", probs, np.float32, shape=(Hq, sel.shape[1], B), layout="[Hq, K, B]")
    if backend == "numpy":
        importance_update_blocks_ref(importance, block_table, sel, cnt, probs, n_ctx)
        return
    parallel = probs.shape[0] * int(cnt.max(initial=0)) * probs.shape[2] >= PARALLEL_MIN_WORK
    _importance_update_blocks_kernel(importance.view(np.uint16), block_table, sel, cnt, probs,
                                     int(n_ctx), parallel)


def decay_importance(importance: np.ndarray, block_table: np.ndarray, n_ctx: int, decay: float,
                     backend: str = "numba") -> None:
    """Scale every valid entry by ``decay`` (``new = decay*old``), in place."""
    Hq = importance.shape[2]
    importance_update(importance, block_table, np.zeros((Hq, n_ctx), np.float32), n_ctx,
                      decay, backend)
