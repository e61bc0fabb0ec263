"""Row quantizers for the legacy block types, byte-identical to ggml's reference quantizers.

``quantize_row_{q4_0,q4_1,q5_0,q5_1,q8_0}_ref`` of ggml-quants.c (and ``gguf.quants``,
which reproduces them): per block of 32 float32 values,

    Q8_0  d = amax / 127;        q = roundf(x / d)            (round half away from zero)
    Q4_0  d = max / -8;          q = min(15, trunc(x / d + 8.5))      max: the signed value of
    Q5_0  d = max / -16;         q = min(31, trunc(x / d + 16.5))     largest magnitude (first)
    Q4_1  d = (max - min) / 15;  q = min(15, trunc((x - min) / d + 0.5)),  m = min
    Q5_1  d = (max - min) / 31;  q = min(31, trunc((x - min) / d + 0.5)),  m = min

where ``x / d`` is ``x * id`` with ``id = 1 / d`` (0 when d is 0), all in float32, and d, m
are stored as fp16 (round to nearest even). Byte layouts: :mod:`loaders.quants_legacy`.

(ggml's CPU backend converts Q8_0 *activations* with a SIMD routine that rounds half to
even and scales by ``127 / amax``; that one lives in ``quants_legacy.quantize_act_q8``.
The reference quantizer here is the one ``gguf`` and ggml's ``quantize_row_*_ref`` share.)

``quantize_block(code, x, xo, w, wo)`` writes the block of x[xo:xo+32] at w[wo:] for the
type with code ``code`` (see :data:`CODES`); it is meant to be inlined into other kernels
(the KV cache's writer); ``decode_qblocks(code, w, wo, nb, out, oo, step, f16)`` is its inverse,
through the per-type decoders of :mod:`loaders.quants_legacy` (bit-identical to
``gguf.quants.dequantize``), writing element j at ``out[oo + j * step]``.
:func:`quantize_rows` is the array entry point; :func:`f32_to_bf16` converts float32 to bfloat16
bit patterns as ggml does.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from . import jit, quants_legacy
from .ggml_types import QT, type_size
from .quants_legacy import (deq_q4_0, deq_q4_1, deq_q5_0, deq_q5_1, deq_q8_0,
                            f32_to_f16_bits, head_d, head_d_qh, head_dm, head_dm_qh,
                            pair_q4_0, pair_q4_1, pair_q5_0, pair_q5_1, pair_q8_0, load_u16, load_u32,
                            q_weight)

jit.kernel_module(__file__, quants_legacy)


# type -> small integer code the kernels branch on, and bytes per block of 32 by code (the
# block geometry: loaders.ggml_types)
CODES: dict[QT, int] = {QT.Q8_0: 0, QT.Q4_0: 1, QT.Q4_1: 2, QT.Q5_0: 3, QT.Q5_1: 4}
BLOCK_BYTES: tuple[int, ...] = tuple(type_size(t) for t in sorted(CODES, key=CODES.get))

_0 = np.float32(0.0)
_1 = np.float32(1.0)
_HALF = np.float32(0.5)


@jit.njit(inline="always")
def _put_f16(w, o, f):
    h = f32_to_f16_bits(f)
    w[o] = np.uint8(h & 0xFF)
    w[o + 1] = np.uint8(h >> 8)


@jit.njit(inline="always")
def _roundf(v):
    """C roundf (half away from zero) in float32, as gguf's np_roundf."""
    a = abs(v)
    fl = np.floor(a)
    r = fl + np.floor(np.float32(2.0) * (a - fl))
    return -r if v < _0 else r


@jit.njit(inline="always")
def _inverse(d):
    return _1 / d if d != _0 else _0


@jit.njit(inline="always")
def _signed_max(x, xo):
    """The value of largest magnitude in x[xo:xo+32] (the first one on ties)."""
    amax = _0
    mx = _0
    for k in range(32):
        a = abs(x[xo + k])
        if a > amax:
            amax = a
            mx = x[xo + k]
    return mx


@jit.njit(inline="always")
def _min_max(x, xo):
    lo = x[xo]
    hi = x[xo]
    for k in range(1, 32):
        v = x[xo + k]
        if v < lo:
            lo = v
        if v > hi:
            hi = v
    return lo, hi


@jit.njit(inline="always")
def _q8_0(x, xo, w, wo):
    amax = _0
    for k in range(32):
        a = abs(x[xo + k])
        if a > amax:
            amax = a
    d = amax / np.float32(127.0)
    inv = _inverse(d)
    _put_f16(w, wo, d)
    for k in range(32):
        q = np.int32(_roundf(x[xo + k] * inv))
        w[wo + 2 + k] = np.uint8(q & 0xFF)


@jit.njit(inline="always")
def _nibbles(qv, w, o):
    for j in range(16):
        w[o + j] = np.uint8(qv[j] | (qv[j + 16] << 4))


@jit.njit(inline="always")
def _high_bits(qv, w, o):
    qh = np.uint32(0)
    for j in range(32):
        qh |= np.uint32((qv[j] >> 4) & 1) << np.uint32(j)
    for b in range(4):
        w[o + b] = np.uint8((qh >> np.uint32(8 * b)) & np.uint32(0xFF))
    for j in range(32):
        qv[j] &= 0xF


@jit.njit(inline="always")
def _symmetric(x, xo, w, wo, levels, top, qo, hi_bits):
    """Q4_0 (levels 8, top 15) and Q5_0 (16, 31): d = max / -levels."""
    d = _signed_max(x, xo) / np.float32(-levels)
    inv = _inverse(d)
    bias = np.float32(levels) + _HALF
    _put_f16(w, wo, d)
    qv = np.empty(32, np.int32)
    for k in range(32):
        qv[k] = min(top, np.int32(np.trunc(x[xo + k] * inv + bias)))
    if hi_bits:
        _high_bits(qv, w, wo + 2)
    _nibbles(qv, w, wo + qo)


@jit.njit(inline="always")
def _affine(x, xo, w, wo, top, qo, hi_bits):
    """Q4_1 (top 15) and Q5_1 (31): d = (max - min) / top, m = min."""
    lo, hi = _min_max(x, xo)
    d = (hi - lo) / np.float32(top)
    inv = _inverse(d)
    _put_f16(w, wo, d)
    _put_f16(w, wo + 2, lo)
    qv = np.empty(32, np.int32)
    for k in range(32):
        qv[k] = min(top, np.int32(np.trunc((x[xo + k] - lo) * inv + _HALF)))
    if hi_bits:
        _high_bits(qv, w, wo + 4)
    _nibbles(qv, w, wo + qo)


@jit.njit(inline="always")
def quantize_block(code, x, xo, w, wo):
    """Quantize x[xo:xo+32] (float32) into the block at w[wo:] (uint8) of type ``code``."""
    if code == 0:
        _q8_0(x, xo, w, wo)
    elif code == 1:
        _symmetric(x, xo, w, wo, 8, 15, 2, False)
    elif code == 2:
        _affine(x, xo, w, wo, 15, 4, False)
    elif code == 3:
        _symmetric(x, xo, w, wo, 16, 31, 6, True)
    else:
        _affine(x, xo, w, wo, 31, 8, True)


@jit.njit(inline="always")
def _decode(w, wo, nb, bsz, out, oo, step, f16, head, pair, has_min):
    for b in range(nb):
        o = wo + b * bsz
        d, m, aux = head(w, o, f16)
        base = oo + b * 32 * step
        for j in range(16):
            lo, hi = pair(w, o, aux, j)
            out[base + j * step] = q_weight(d, m, lo, has_min)
            out[base + (j + 16) * step] = q_weight(d, m, hi, has_min)


# --------------------------------------------------------------------------------------
# contiguous decode (step 1, what attention's block loads use): one block as vector IR
# (the block decoders of loaders.quants_legacy, which weight dequantization uses too)
# --------------------------------------------------------------------------------------


@jit.njit(inline="always")
def _decode_contiguous(code, w, wo, nb, out, oo, f16):
    if code == 0:
        for b in range(nb):
            deq_q8_0(w, wo + b * 34, f16, out, oo + b * 32)
    elif code == 1:
        for b in range(nb):
            deq_q4_0(w, wo + b * 18, f16, out, oo + b * 32)
    elif code == 2:
        for b in range(nb):
            deq_q4_1(w, wo + b * 20, f16, out, oo + b * 32)
    elif code == 3:
        for b in range(nb):
            deq_q5_0(w, wo + b * 22, f16, out, oo + b * 32)
    else:
        for b in range(nb):
            deq_q5_1(w, wo + b * 24, f16, out, oo + b * 32)


@jit.njit(inline="always")
def decode_qblocks(code, w, wo, nb, out, oo, step, f16):
    """Decode the nb consecutive blocks of type ``code`` at w[wo:] (uint8): element j of block b
    goes to out[oo + (32*b + j) * step]; f16: the fp16 -> float32 table. (The type switch
    is taken once per call, so each type's loop is branch-free.) The caller guarantees the
    bounds: nothing is checked."""
    if step == 1:
        _decode_contiguous(code, w, wo, nb, out, oo, f16)
        return
    if code == 0:
        _decode(w, wo, nb, 34, out, oo, step, f16, head_d, pair_q8_0, False)
    elif code == 1:
        _decode(w, wo, nb, 18, out, oo, step, f16, head_d, pair_q4_0, False)
    elif code == 2:
        _decode(w, wo, nb, 20, out, oo, step, f16, head_dm, pair_q4_1, True)
    elif code == 3:
        _decode(w, wo, nb, 22, out, oo, step, f16, head_d_qh, pair_q5_0, False)
    else:
        _decode(w, wo, nb, 24, out, oo, step, f16, head_dm_qh, pair_q5_1, True)


@jit.njit(parallel=True)
def _quantize_rows(x, code, bsz, out):
    rows, n = x.shape
    for r in prange(rows):
        xr = x[r]
        wr = out[r]
        for b in range(n // 32):
            quantize_block(code, xr, b * 32, wr, b * bsz)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values -> their bfloat16 bit patterns (uint16, same shape), as ggml converts:
    the top 16 bits rounded to nearest, ties to even (finite values past bfloat16's range
    become infinities); a NaN keeps its sign and top payload bits and is made quiet."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


def quantize_rows(x: np.ndarray, qtype: QT) -> np.ndarray:
    """float32 [rows, n] (n a multiple of 32) -> uint8 [rows, n / 32 * block bytes]."""
    if qtype not in CODES:
        raise ValueError(f"no row quantizer for {QT(qtype).name}; one of "
                         f"{', '.join(t.name for t in CODES)}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % 32:
        raise ValueError(f"rows to quantize must be [rows, n] with n a multiple of 32, got {x.shape}")
    code = CODES[QT(qtype)]
    bsz = BLOCK_BYTES[code]
    out = np.empty((x.shape[0], x.shape[1] // 32 * bsz), np.uint8)
    _quantize_rows(x, code, bsz, out)
    return out
