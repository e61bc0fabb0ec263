"""K-quant kernels: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (256-element super-blocks).

Each type has one decoder, the only code that knows its byte layout: ``head``
(the super-block scales and the per-sub-block scales and mins) and ``quad``
(four quants at once, see the decoders section). Three generic drivers, inlined
into one small kernel per type and operation, build every kernel from it. All
take ``raw = uint8[rows, row_bytes]`` (one row = ``n // 256`` consecutive blocks):

``dequantize``
    ``out = float32[rows, n]``, bit-identical to ``gguf.quants.dequantize``
    (same float32 operations in the same order).
``matvec``
    fp32 numerics, ``out[r] = sum_j w[r, j] * x[j]`` with ``x = float32[n]``,
    ``out = float32[rows]``; parallel over rows. Reads the quantized bytes
    directly (the fp32 matrix never exists). Per sub-block the factors
    ``d * scale`` and ``dmin * min`` are formed once; the min term is applied
    once per sub-block through precomputed sums of ``x``; the inner loop
    decodes quants and adds ``(d * scale) * (q * x)`` into 32 lane
    accumulators (Q4_K: ``((d * scale) * q) * x``, WEIGHT_FIRST), summed once
    per row.
``matmul_ggml``
    ggml numerics: ``xq = uint8[m, n // 256 * 292]`` holds the activations as
    Q8_K blocks (from :func:`quantize_act_q8_k`); ``out = float32[m, rows]``.
    Exact integer dot products per block (computed in float32/float64, where
    they are exact, see :func:`_block_lanes`), then the float accumulation of
    ggml's x86 AVX2 ``ggml_vec_dot_<type>_q8_K`` operation for operation:
    eight float32 lanes, lane ``k`` holding the elements ``e`` with
    ``(e % 32) // 4 == k``, one fused multiply-add
    ``acc[k] = fma(d, float(int_sum[k]), acc[k])`` per block with
    ``d = d_act * d_weight``, the ``dmin * bsums`` min terms accumulated as
    each type's kernel does (Q2_K: into the same lanes first; Q4_K: four extra
    lanes; Q5_K: one scalar FMA per block; Q6_K: ``32 * bsums * scale`` taken
    off the integer lane sums), and the final horizontal sum
    ``((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))``. The results equal libggml's
    bit for bit. Q4_K and Q6_K take the same numbers through SIMD integer dot
    products where the host has AVX2 or VNNI (``_matmul_ggml_k_i8``); the
    portable kernels stay in ``PORTABLE_GGML``.

Block layouts (little endian; ``fp16`` = IEEE half; element indices within a
256-element block; ggml field names):

Q2_K, 84 bytes::

    scales[16]  per 16-element sub-block s: low nibble = scale, high nibble = min
    qs[64]      2-bit quants: element 128*j + 32*l + b is bits 2l..2l+1 of qs[32*j + b]
    d    fp16
    dmin fp16
    w = d * (scales[s] & 15) * q - dmin * (scales[s] >> 4),   s = e // 16

Q3_K, 110 bytes::

    hmask[32]   high bit: element 128*j + 32*l + b is bit (4*j + l) of hmask[b]
    qs[64]      low 2 bits, same order as Q2_K
    scales[12]  sixteen 6-bit scales A..P (sub-blocks 0..15), stored +32:
                  byte  0: IIIIAAAA   byte  4: MMMMEEEE   byte  8: MMIIEEAA
                  byte  1: JJJJBBBB   byte  5: NNNNFFFF   byte  9: NNJJFFBB
                  byte  2: KKKKCCCC   byte  6: OOOOGGGG   byte 10: OOKKGGCC
                  byte  3: LLLLDDDD   byte  7: PPPPHHHH   byte 11: PPLLHHDD
                (low 4 bits of scale s: nibble s // 8 of byte s % 8; high 2 bits:
                 bits 2*(s // 4) of byte 8 + s % 4)
    d    fp16
    w = d * (scale_s - 32) * (q_low - (0 if high bit set else 4))

Q4_K, 144 bytes::

    d    fp16
    dmin fp16
    scales[12]  eight 6-bit scales (A..H) and eight 6-bit mins (a..h):
                  byte 0..3 : EEAAAAAA FFBBBBBB GGCCCCCC HHDDDDDD
                  byte 4..7 : eeaaaaaa ffbbbbbb ggcccccc hhdddddd
                  byte 8..11: eeeeEEEE ffffFFFF ggggGGGG hhhhHHHH
                (scales/mins 0..3: low 6 bits of bytes 0..3 / 4..7; 4..7: nibble of
                 bytes 8..11 plus the top 2 bits of bytes 0..3 / 4..7)
    qs[128]     element 64*j + b = low nibble of qs[32*j + b],
                element 64*j + 32 + b = high nibble (sub-blocks of 32: s = e // 32)
    w = d * scale_s * q - dmin * min_s

Q5_K, 176 bytes::

    d, dmin, scales[12]   as Q4_K
    qh[32]      fifth bit: element 32*s + b is bit s of qh[b]
    qs[128]     low 4 bits as Q4_K
    w = d * scale_s * q - dmin * min_s

Q6_K, 210 bytes::

    ql[128]     low 4 bits: element 128*j + 32*l + b is the nibble (l // 2) of
                ql[64*j + 32*(l % 2) + b]
    qh[64]      high 2 bits: bits 2l..2l+1 of qh[32*j + b]
    scales[16]  int8, per 16-element sub-block
    d    fp16
    w = d * scales[e // 16] * (q - 32)

Q8_K activations, 292 bytes: float32 d, int8 qs[256], int16 bsums[16] (sum of
each 16 consecutive qs); value = d * qs.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import jit, quants_legacy
from .ggml_types import QT, TypeKernels, type_size
from .quants_legacy import (I32, X86_64, I8_DOT, PREFETCH_BYTES, WIDE_STEPS, ROW_CHUNKS, far_pair,
                            fma32, hsum8, as_i8, stack_f32,
                            I8T as _I8, group_row, lanes_sum32, prefetch_at,
                            quant_kernels, load_u16, vector_of, ir_fma, ir_lane_sums, ir_ptr, ir_splat)

jit.kernel_module(__file__, quants_legacy)

QK_K = 256
Q8_K_BYTES = 292  # float32 d + int8 qs[256] + int16 bsums[16]

BLOCK_BYTES = {t: type_size(t) for t in (QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K)}

_F32_0 = np.float32(0.0)


# ------------------------------------------------------------------ shared pieces

@jit.njit(inline="always")
def _block_lanes(w, y, tmp, lanes):
    """Exact lane sums of one block: lanes[k] = sum of w[e] * y[e] over (e % 32) // 4 == k.

    w float32[256] (scale * quant), y float32[256] (Q8_K quants), tmp float32[32]
    scratch, lanes float64[8] out. Every product is an integer below 2**20 in
    magnitude (worst case Q6_K, whose stored quants go in: 128 * 63 * 127) and every
    partial sum of the 8 products per tmp entry below 2**23, so the float32 arithmetic
    is exact; the 4-term lane sums are exact in float64.
    """
    for b in range(32):
        tmp[b] = (((w[b] * y[b] + w[32 + b] * y[32 + b]) + (w[64 + b] * y[64 + b] + w[96 + b] * y[96 + b]))
                  + ((w[128 + b] * y[128 + b] + w[160 + b] * y[160 + b])
                     + (w[192 + b] * y[192 + b] + w[224 + b] * y[224 + b])))
    for k in range(8):
        lanes[k] = ((np.float64(tmp[4 * k]) + np.float64(tmp[4 * k + 1]))
                    + (np.float64(tmp[4 * k + 2]) + np.float64(tmp[4 * k + 3])))


@jit.njit
def _xsums(x, sub):
    """float32 sums of x over consecutive ``sub``-element sub-blocks (for the min terms)."""
    s = np.zeros(x.shape[0] // sub, np.float32)
    for t in range(s.shape[0]):
        for b in range(sub):
            s[t] += x[sub * t + b]
    return s


# ------------------------------------------------------------------ Q8_K activations

@jit.njit(parallel=True)
def _quantize_q8_k(x, d, qs, bsums):
    """x float32[m, n] -> d float32[m, nb], qs int8[m, nb*256], bsums int16[m, nb*16].

    ggml's quantize_row_q8_K (the x86 build uses the reference code): the value
    of largest magnitude (first one on ties) maps to -127, iscale = -127 / max,
    q = min(127, round_half_even(iscale * x)), d = 1 / iscale.
    """
    _quantize_q8_k_rows(x, d, qs, bsums)


@jit.njit
def _quantize_q8_k_serial(x, d, qs, bsums):
    """_quantize_q8_k on the calling thread (one decode row: no thread-pool launch)."""
    _quantize_q8_k_rows(x, d, qs, bsums)


@jit.njit(inline="always")
def _quantize_q8_k_rows(x, d, qs, bsums):
    m, n = x.shape
    nb = n // QK_K
    for a in prange(m):
        for i in range(nb):
            o = i * QK_K
            amax = np.float32(0.0)
            mx = np.float32(0.0)
            for j in range(QK_K):
                v = x[a, o + j]
                av = abs(v)
                if av > amax:
                    amax = av
                    mx = v
            if amax == 0:
                d[a, i] = 0
                for j in range(QK_K):
                    qs[a, o + j] = 0
                for j in range(16):
                    bsums[a, 16 * i + j] = 0
                continue
            iscale = np.float32(-127.0) / mx
            for j in range(QK_K):
                p = iscale * x[a, o + j]                 # float32 product, rounded once
                v = np.int64(np.rint(p))                 # = ggml nearest_int (ties to even)
                qs[a, o + j] = min(127, v)
            for j in range(16):
                s = 0
                for b in range(16):
                    s += np.int64(qs[a, o + 16 * j + b])
                bsums[a, 16 * i + j] = s
            d[a, i] = np.float32(1.0) / iscale


def _q8_k_arrays(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Contiguous float32[m, n] (n % 256 == 0) -> Q8_K's (d float32[m, nb], qs int8[m, n],
    bsums int16[m, nb*16]); one row on the calling thread."""
    m, n = x.shape
    nb = n // QK_K
    d = np.empty((m, nb), np.float32)
    qs = np.empty((m, nb * QK_K), np.int8)
    bsums = np.empty((m, nb * 16), np.int16)
    (_quantize_q8_k_serial if m == 1 else _quantize_q8_k)(x, d, qs, bsums)
    return d, qs, bsums


def quantize_act_q8_k(x: np.ndarray) -> np.ndarray:
    """Activations float32[m, n] (n % 256 == 0) -> Q8_K blocks uint8[m, n // 256 * 292]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    m, n = x.shape
    if n % QK_K:
        raise ValueError(f"row length {n} is not a multiple of {QK_K}")
    nb = n // QK_K
    d, qs, bsums = _q8_k_arrays(x)
    out = np.empty((m, nb, Q8_K_BYTES), np.uint8)
    out[:, :, 0:4] = d.view(np.uint8).reshape(m, nb, 4)
    out[:, :, 4:260] = qs.view(np.uint8).reshape(m, nb, QK_K)
    out[:, :, 260:292] = bsums.view(np.uint8).reshape(m, nb, 32)
    return out.reshape(m, nb * Q8_K_BYTES)


def quantize_act_q8_k_reference(x: np.ndarray) -> np.ndarray:
    """Plain NumPy twin of :func:`quantize_act_q8_k`."""
    x = np.asarray(x, dtype=np.float32)
    m, n = x.shape
    nb = n // QK_K
    blk = x.reshape(m, nb, QK_K)
    idx = np.argmax(np.abs(blk), axis=-1)[..., None]           # first index of the largest |x|
    mx = np.take_along_axis(blk, idx, axis=-1)                  # signed value there
    zero = mx == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(zero, np.float32(0), np.float32(-127.0) / np.where(zero, np.float32(1), mx))
        q = np.minimum(np.rint(iscale * blk), 127).astype(np.int8)
        d = np.where(zero, np.float32(0), np.float32(1.0) / np.where(zero, np.float32(1), iscale))
    bsums = q.reshape(m, nb, 16, 16).astype(np.int16).sum(axis=-1, dtype=np.int16)
    out = np.empty((m, nb, Q8_K_BYTES), np.uint8)
    out[:, :, 0:4] = d.astype(np.float32).view(np.uint8).reshape(m, nb, 4)
    out[:, :, 4:260] = q.view(np.uint8)
    out[:, :, 260:292] = bsums.view(np.uint8).reshape(m, nb, 32)
    return out.reshape(m, nb * Q8_K_BYTES)


def _ggml_act(xq: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q8_K bytes -> (d float32[m, nb], qs as float32[m, nb*256], bsums int16[m, nb*16]) for the kernels."""
    d, qs, bsums = split_q8_k(xq)
    return d, qs.astype(np.float32), bsums


def split_q8_k(xq: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q8_K bytes uint8[m, nb*292] -> (d float32[m, nb], qs int8[m, nb*256], bsums int16[m, nb*16])."""
    m = xq.shape[0]
    nb = xq.shape[1] // Q8_K_BYTES
    blk = xq.reshape(m, nb, Q8_K_BYTES)
    d = np.ascontiguousarray(blk[:, :, 0:4]).view(np.float32).reshape(m, nb)
    qs = np.ascontiguousarray(blk[:, :, 4:260]).view(np.int8).reshape(m, nb * QK_K)
    bsums = np.ascontiguousarray(blk[:, :, 260:292]).view(np.int16).reshape(m, nb * 16)
    return d, qs, bsums


def dequantize_act_q8_k(xq: np.ndarray) -> np.ndarray:
    """Q8_K bytes uint8[m, nb*292] -> float32[m, nb*256] (d * qs)."""
    d, qs, _ = split_q8_k(xq)
    m, nb = d.shape
    return (d[:, :, None] * qs.reshape(m, nb, QK_K).astype(np.float32)).reshape(m, nb * QK_K)


# ------------------------------------------------------------------ decoders (the only code that knows the layouts)
#
# head(q, f16, sc, mn) -> (d, dmin) of the block q (its bytes), and fills sc, mn
#   int32[16] with the scale and min of each sub-block (16 of 16 elements, or 8 of 32
#   for Q4_K/Q5_K); types without a min return dmin = 0 and leave mn alone.
# quad(q, j, b, stored) -> the float32 quants of elements 128*j + 32*l + b, l = 0..3
#   (j = 0, 1; b = 0..31), the q of w = d * scale * q - dmin * min: signed for Q3_K
#   and Q6_K (offsets applied), else unsigned; with ``stored`` Q6_K's as stored (0..63,
#   what ggml multiplies before it takes the offset off; the ggml driver asks for that).
# Element 128*j + 32*l + b is in sub-block 8*j + 2*l + (b >= 16) of 16 elements, or
# 4*j + l of 32. The drivers take ``sub``, the elements per sub-block; with 32 their inner
# loops run over all 32 b at once.


@jit.njit(inline="always")
def _head_q2_k(q, f16, sc, mn):
    for s in range(16):
        v = np.int32(q[s])
        sc[s] = v & 15
        mn[s] = v >> 4
    return f16[load_u16(q, 80)], f16[load_u16(q, 82)]


@jit.njit(inline="always")
def _quad_q2_k(q, j, b, stored):
    v = q[16 + 32 * j + b]
    return (np.float32(np.uint8(v & 3)), np.float32(np.uint8((v >> 2) & 3)),
            np.float32(np.uint8((v >> 4) & 3)), np.float32(np.uint8(v >> 6)))


@jit.njit(inline="always")
def _head_q3_k(q, f16, sc, mn):
    for s in range(16):
        lo = (np.int32(q[96 + (s & 7)]) >> (4 * (s >> 3))) & 15
        hi = (np.int32(q[104 + (s & 3)]) >> (2 * (s >> 2))) & 3
        sc[s] = (lo | (hi << 4)) - 32
    return f16[load_u16(q, 108)], _F32_0


@jit.njit(inline="always")
def _quad_q3_k(q, j, b, stored):
    v = q[32 + 32 * j + b]
    hb = q[b]
    # the hmask bit of element 128*j + 32*l + b is bit 4*j + l
    mk0, mk1, mk2, mk3 = (np.uint8(1 << (4 * j)), np.uint8(2 << (4 * j)),
                          np.uint8(4 << (4 * j)), np.uint8(8 << (4 * j)))
    return (np.float32(np.int8((v & 3) - (0 if hb & mk0 else 4))),
            np.float32(np.int8(((v >> 2) & 3) - (0 if hb & mk1 else 4))),
            np.float32(np.int8(((v >> 4) & 3) - (0 if hb & mk2 else 4))),
            np.float32(np.int8((v >> 6) - (0 if hb & mk3 else 4))))


@jit.njit(inline="always")
def _head_q4_k(q, f16, sc, mn):
    """Q4_K and Q5_K: eight 6-bit (scale, min) pairs of 32-element sub-blocks."""
    for g in range(4):
        sc[g] = np.int32(q[4 + g]) & 63
        mn[g] = np.int32(q[8 + g]) & 63
        sc[4 + g] = (np.int32(q[12 + g]) & 15) | ((np.int32(q[4 + g]) >> 6) << 4)
        mn[4 + g] = (np.int32(q[12 + g]) >> 4) | ((np.int32(q[8 + g]) >> 6) << 4)
    return f16[load_u16(q, 0)], f16[load_u16(q, 2)]


@jit.njit(inline="always")
def _quad_q4_k(q, j, b, stored):
    v0 = q[16 + 64 * j + b]
    v1 = q[48 + 64 * j + b]
    return (np.float32(np.uint8(v0 & 15)), np.float32(np.uint8(v0 >> 4)),
            np.float32(np.uint8(v1 & 15)), np.float32(np.uint8(v1 >> 4)))


@jit.njit(inline="always")
def _quad_q5_k(q, j, b, stored):
    v0 = q[48 + 64 * j + b]
    v1 = q[80 + 64 * j + b]
    hb = q[16 + b]
    # the qh bit of element 32*g + b is bit g (g = 4*j + l)
    mk0, mk1, mk2, mk3 = (np.uint8(1 << (4 * j)), np.uint8(2 << (4 * j)),
                          np.uint8(4 << (4 * j)), np.uint8(8 << (4 * j)))
    return (np.float32(np.uint8((v0 & 15) | (16 if hb & mk0 else 0))),
            np.float32(np.uint8((v0 >> 4) | (16 if hb & mk1 else 0))),
            np.float32(np.uint8((v1 & 15) | (16 if hb & mk2 else 0))),
            np.float32(np.uint8((v1 >> 4) | (16 if hb & mk3 else 0))))


@jit.njit(inline="always")
def _head_q6_k(q, f16, sc, mn):
    for s in range(16):
        sc[s] = as_i8(q[192 + s])
    return f16[load_u16(q, 208)], _F32_0


@jit.njit(inline="always")
def _quad_q6_k(q, j, b, stored):
    v0 = q[64 * j + b]
    v1 = q[64 * j + 32 + b]
    hb = q[128 + 32 * j + b]
    q0 = np.uint8((v0 & 15) | ((hb & 3) << 4))
    q1 = np.uint8((v1 & 15) | ((hb & 12) << 2))
    q2 = np.uint8((v0 >> 4) | (hb & 48))
    q3 = np.uint8((v1 >> 4) | ((hb & 192) >> 2))
    if stored:
        return np.float32(q0), np.float32(q1), np.float32(q2), np.float32(q3)
    # truncating to int8 keeps the vectorized integer work 8 bits wide
    return (np.float32(np.int8(q0 - 32)), np.float32(np.int8(q1 - 32)),
            np.float32(np.int8(q2 - 32)), np.float32(np.int8(q3 - 32)))


# ------------------------------------------------------------------ vector IR


def _emit_mac4(context, builder, xty, xb, xo, quants, scales, aty, acc):
    """IR of one fp32 matvec step of the K types over four 32-element sub-blocks (LLVM leaves
    the fully unrolled scalar loop unvectorized): for lanes b = 0..31,
    ``acc[b] = fma(a3, q3*x3, fma(a2, q2*x2, fma(a1, q1*x1, fma(a0, q0*x0, acc[b]))))`` with
    qk, ak lane b of the <32 x float> IR values ``quants[k]``, ``scales[k]`` and xk =
    xb[xo + 32k + b]: the scalar driver's operations lane for lane, so the same bits. (A sum
    of the four products, then one add, cost an add per weight more.)"""
    i32 = ir.IntType(32)
    vf = ir.VectorType(ir.FloatType(), 32)
    fma = ir_fma(builder, vf)
    xp = ir_ptr(context, builder, xty, xb, xo, vf)
    ap = ir_ptr(context, builder, aty, acc, ir.Constant(ir.IntType(64), 0), vf)
    a = builder.load(ap, align=4)
    for k in range(4):
        xk = builder.load(builder.gep(xp, [ir.Constant(i32, k)]) if k else xp, align=4)
        a = builder.call(fma, [scales[k], builder.fmul(quants[k], xk), a])
    builder.store(a, ap, align=4)


def _emit_mac_q4k(context, builder, qty, q, p0, p1, xty, xb, xo, scales, aty, acc, hbits=None):
    """One fp32 step over four 32-element sub-blocks of Q4_K (hosts without AVX-512; with it,
    Q4_K takes :func:`_q4k_step_ahead`) or Q5_K (every host): q0, q1 the low and high
    nibbles of bytes q[p0:p0 + 32], q2, q3 those of q[p1:p1 + 32]; ``scales`` four float IR
    values (one per sub-block). For k = 0..3 in turn, lane b: Q4_K ``acc[b] = fma((d * scale_k) * qk, xk,
    acc[b])`` (the weight first, WEIGHT_FIRST), Q5_K ``acc[b] = fma(scale_k, qk * xk, acc[b])``
    (:func:`_emit_mac4`'s), xk = xb[xo + 32k + b]. Q5_K: ``hbits`` = (the 32 qh bytes as eight
    i32 words, j): bit 4j + k of qh byte b is bit 4 of quant qk of element b, taken from the
    words as the nibbles are.

    The lanes are in :func:`_lane` order (``perm``): the 32 bytes are read as eight 32-bit
    words and byte t of every word is shifted down and masked (lane 8t + i holds element
    4i + t), so the quants reach 32-bit lanes without byte shuffles (zero-extending the bytes
    in order took a shuffle instruction per conversion; one znver3 core, a matrix in L2:
    38 -> 28 ns a block). xb holds the block's activations in that order.

    The IR takes one group of eight lanes at a time (t = 0..3: its own accumulator), its
    quants unpacked, converted and summed before the next group's. Made as four <32 x float>
    vectors first, LLVM had kept all sixteen <8 x float> parts of a half block live, more than
    AVX2's sixteen registers, and spilled about 30 of them a block. The same operations on the
    same values: the same bits. One core of an AMD EPYC znver4 running the kernels compiled
    for znver3 (AVX2), Gemma's 640 x 2048 Q4_K ffn_down in L2, best of 300: 81 -> 66 cycles a
    block (209 instructions a block instead of 249); a 512 x 2048 Q5_K matrix in L2, 96 cycles
    a block either way compiled for znver3, 99 -> 86 compiled for the znver4 host."""
    i32 = ir.IntType(32)
    v8 = ir.VectorType(i32, 8)
    vf8 = ir.VectorType(ir.FloatType(), 8)
    fma = ir_fma(builder, vf8)
    xp = ir_ptr(context, builder, xty, xb, xo, vf8)
    ap = ir_ptr(context, builder, aty, acc, ir.Constant(ir.IntType(64), 0), vf8)
    accs = [builder.load(builder.gep(ap, [ir.Constant(i32, t)]), align=4) for t in range(4)]
    words = [builder.load(ir_ptr(context, builder, qty, q, p, v8), align=1) for p in (p0, p1)]
    for k in range(4):
        pi, nib = k // 2, 4 * (k % 2)       # low nibbles: sub-block 2pi; high: 2pi + 1
        sc = ir_splat(builder, scales[k], vf8)
        for t in range(4):
            sh = nib + 8 * t
            qv = builder.and_(builder.lshr(words[pi], ir.Constant(v8, [sh] * 8)) if sh else words[pi],
                              ir.Constant(v8, [15] * 8))
            if hbits is not None:           # Q5_K: qh bit 4j + k of byte 4i + t to bit 4 of lane i
                hw, j = hbits
                up = 8 * t + 4 * j + k - 4
                b = (builder.lshr(hw, ir.Constant(v8, [up] * 8)) if up > 0 else
                     builder.shl(hw, ir.Constant(v8, [-up] * 8)) if up < 0 else hw)
                qv = builder.or_(qv, builder.and_(b, ir.Constant(v8, [16] * 8)))
            qf = builder.sitofp(qv, vf8)
            xk = builder.load(builder.gep(xp, [ir.Constant(i32, 4 * k + t)]), align=4)
            accs[t] = (builder.call(fma, [builder.fmul(sc, qf), xk, accs[t]]) if hbits is None else
                       builder.call(fma, [sc, builder.fmul(qf, xk), accs[t]]))
    for t in range(4):
        builder.store(accs[t], builder.gep(ap, [ir.Constant(i32, t)]), align=4)


def _emit_fma_weights(context, builder, xty, xb, xo, weights, aty, acc):
    """IR of ``acc[b] = fma(w3, x3, fma(w2, x2, fma(w1, x1, fma(w0, x0, acc[b]))))`` for lanes
    b = 0..31, wk lane b of the <32 x float> ``weights[k]`` (four 32-element sub-blocks' weights
    d * scale * q, the min terms apart), xk = xb[xo + 32k + b]: Q4_K's step on AVX-512 hosts
    (:func:`_emit_q4k_tables`, WEIGHT_FIRST)."""
    vf = ir.VectorType(ir.FloatType(), 32)
    fma = ir_fma(builder, vf)
    xp = ir_ptr(context, builder, xty, xb, xo, vf)
    ap = ir_ptr(context, builder, aty, acc, ir.Constant(ir.IntType(64), 0), vf)
    a = builder.load(ap, align=4)
    for k, wk in enumerate(weights):
        xk = builder.load(builder.gep(xp, [ir.Constant(ir.IntType(32), k)]) if k else xp, align=4)
        a = builder.call(fma, [wk, xk, a])
    builder.store(a, ap, align=4)


def _emit_q4k_tables(context, builder, qty, q, ps, xty, xb, xo, scales, aty, acc):
    """Q4_K's step over four sub-blocks (:func:`_emit_mac_q4k`'s) on hosts with AVX-512
    (WIDE_STEPS, :func:`_q4k_step_ahead`), its weights by table lookups: per sub-block the
    weight of every nibble value t, (d * scale) * t, as a <16 x float> table, then each 16
    weights by one VPERMPS of the table by the nibbles (it reads the low 4 bits of each index,
    so they need no mask), in the same lanes as the other path (lane 8t + i: element 4i + t).
    The same products: the same bits. One core of an AMD EPYC znver4 (AVX-512 on 256-bit
    units), Gemma's 640 x 2048 ffn_down in L2, best of 7: 97-98 -> 85-86 us
    (the mask, convert and multiply per vector gone). ``scales``: the four sub-blocks' scales,
    each a <16 x float> splat; q[ps[k]:ps[k] + 32] (ps i64 IR values) as in _emit_mac_q4k."""
    i32 = ir.IntType(32)
    v8, v16 = ir.VectorType(i32, 8), ir.VectorType(i32, 16)
    vf16 = ir.VectorType(ir.FloatType(), 16)
    cat32 = ir.Constant(ir.VectorType(i32, 32), list(range(32)))
    perm = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf16, [vf16, v16]),
                                          "llvm.x86.avx512.permvar.sf.512")
    values = ir.Constant(vf16, [float(t) for t in range(16)])
    weights = []
    for pi, p in enumerate(ps):
        w = builder.load(ir_ptr(context, builder, qty, q, p, v8), align=1)
        w16 = builder.shuffle_vector(w, ir.Constant(v8, ir.Undefined), ir.Constant(v16, list(range(8)) * 2))
        for nib in (0, 4):                  # low nibbles: sub-block 2pi; high: 2pi + 1
            table = builder.fmul(scales[2 * pi + nib // 4], values)
            halves = [builder.call(perm, [table, builder.lshr(w16, ir.Constant(
                v16, [nib + 16 * h] * 8 + [nib + 16 * h + 8] * 8))]) for h in range(2)]
            weights.append(builder.shuffle_vector(halves[0], halves[1], cat32))
    _emit_fma_weights(context, builder, xty, xb, xo, weights, aty, acc)


def _block_loader(context, builder, qty, q):
    """load(off, vty): the vector of IR type vty at byte ``off`` of the block q (uint8 bytes)."""
    def load(off, vty):
        return builder.load(ir_ptr(context, builder, qty, q, ir.Constant(ir.IntType(64), off), vty), align=1)
    return load


def _emit_mac_sub16(context, builder, xty, xb, j, quants, scv, aty, acc):
    """:func:`_emit_mac4` for half j of a block of sixteen 16-element sub-blocks (Q2_K, Q3_K,
    Q6_K): quants[k] the <32 x float> quants of elements 128j + 32k + b (b = 0..31), lanes
    b < 16 scaled by scv[8j + 2k], the others by scv[8j + 2k + 1] (scv <16 x float>: the
    sub-blocks' scales times d).

    On x86-64 the scales go through a stack slot LLVM cannot see through
    (:func:`_opaque_ptr`), so that each reaches its fma as a broadcast load folded into it
    (``vfmadd231ps m32{1to16}``); from a register each took a shuffle (VSHUFF64X2, VSHUFPS,
    VBROADCASTSS: about 25 a block), on the units the quants' conversions need too. The same
    values: the same bits. 4096 x 4096 matrices, one core of an AMD EPYC znver4, cycles a
    block: Q6_K 68.7 -> 56.2, Q3_K 78.4 -> 61.2, Q2_K 65.7 -> 57.2; Q6_K compiled for znver3
    (AVX2) on the same core, 75.4 -> 72.9. (llvm-mca's Ice Lake model charges the folded
    load's latency to the accumulator chain: 88 cycles a Q6_K block instead of 59. On the
    core, an fma's chain through its accumulator stays 4 cycles with a broadcast operand, as
    without.)"""
    vf16 = ir.VectorType(ir.FloatType(), 16)
    sel = ir.VectorType(ir.IntType(32), 32)
    if X86_64:                 # each scale a broadcast load (see above)
        slot = cgutils.alloca_once(builder, vf16)
        builder.store(scv, slot)
        fp = _opaque_ptr(builder, builder.bitcast(slot, ir.FloatType().as_pointer()))

        scales = [builder.shuffle_vector(_load_splat(builder, fp, 8 * j + 2 * k),
                                         _load_splat(builder, fp, 8 * j + 2 * k + 1),
                                         ir.Constant(sel, list(range(32)))) for k in range(4)]
    else:
        scales = [builder.shuffle_vector(scv, ir.Constant(vf16, ir.Undefined),
                                         ir.Constant(sel, [8 * j + 2 * k] * 16 + [8 * j + 2 * k + 1] * 16))
                  for k in range(4)]
    _emit_mac4(context, builder, xty, xb, ir.Constant(ir.IntType(64), 128 * j), quants, scales, aty, acc)


def _bytes32(v):
    """<32 x i8> with every lane v."""
    return ir.Constant(ir.VectorType(ir.IntType(8), 32), [v] * 32)


@intrinsic
def _block_q6k(typingctx, q, d, xb, acc):
    """One whole Q6_K block of the fp32 matvec as vector IR, the scalar driver's operations
    lane for lane (so the same bits): the sixteen int8 scales times d as one <16 x float>,
    and per half j of the block the 6-bit quants of elements 128j + 32k + b (k = 0..3, b =
    0..31) from ql bytes 64j + b, 64j + 32 + b and qh byte 128 + 32j + b, minus 32, into
    :func:`_emit_mac_sub16`."""
    sig = types.void(q, d, xb, acc)

    def codegen(context, builder, signature, args):
        qty, _, xty, aty = signature.args
        q_, d_, xb_, acc_ = args
        vb, vb16 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(8), 16)
        vf, vf16 = ir.VectorType(ir.FloatType(), 32), ir.VectorType(ir.FloatType(), 16)
        load, c = _block_loader(context, builder, qty, q_), _bytes32
        scv = builder.fmul(ir_splat(builder, d_, vf16), builder.sitofp(load(192, vb16), vf16))
        for j in range(2):
            v0, v1, hb = load(64 * j, vb), load(64 * j + 32, vb), load(128 + 32 * j, vb)
            six = (builder.or_(builder.and_(v0, c(15)), builder.shl(builder.and_(hb, c(3)), c(4))),
                   builder.or_(builder.and_(v1, c(15)), builder.shl(builder.and_(hb, c(12)), c(2))),
                   builder.or_(builder.lshr(v0, c(4)), builder.and_(hb, c(48))),
                   builder.or_(builder.lshr(v1, c(4)), builder.lshr(builder.and_(hb, c(192)), c(2))))
            quants = [builder.sitofp(builder.sub(u, c(32)), vf) for u in six]
            _emit_mac_sub16(context, builder, xty, xb_, j, quants, scv, aty, acc_)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _block_q2k(typingctx, q, d, dmin, xb, xs, xso, acc, accm):
    """One whole Q2_K block of the fp32 matvec as vector IR, the scalar driver's operations
    lane for lane (so the same bits): the sixteen 4-bit scales (low nibbles of bytes 0-15)
    times d and mins (high nibbles) times dmin as <16 x float>, the min terms
    ``accm[t] += (dmin * mn[t]) * xs[xso + t]`` as one 16-lane step, and per half j of the
    block the quants (bits 2k of byte 16 + 32j + b) into :func:`_emit_mac_sub16`."""
    sig = types.void(q, d, dmin, xb, xs, xso, acc, accm)

    def codegen(context, builder, signature, args):
        qty, _, _, xty, xsty, _, aty, mty = signature.args
        q_, d_, dmin_, xb_, xs_, xso_, acc_, accm_ = args
        vb, vb16 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(8), 16)
        vf, vf16 = ir.VectorType(ir.FloatType(), 32), ir.VectorType(ir.FloatType(), 16)
        load, c = _block_loader(context, builder, qty, q_), _bytes32
        head = load(0, vb16)
        sc = builder.and_(head, ir.Constant(vb16, [15] * 16))
        mn = builder.lshr(head, ir.Constant(vb16, [4] * 16))
        # the 4-bit values are non-negative as int8: sitofp is the scalar's float32(int)
        scv = builder.fmul(ir_splat(builder, d_, vf16), builder.sitofp(sc, vf16))
        mins = builder.fmul(ir_splat(builder, dmin_, vf16), builder.sitofp(mn, vf16))
        xsv = builder.load(ir_ptr(context, builder, xsty, xs_, xso_, vf16), align=4)
        mp = ir_ptr(context, builder, mty, accm_, ir.Constant(ir.IntType(64), 0), vf16)
        builder.store(builder.fadd(builder.load(mp, align=4), builder.fmul(mins, xsv)), mp, align=4)
        for j in range(2):
            v = load(16 + 32 * j, vb)
            quants = [builder.sitofp(builder.and_(builder.lshr(v, c(2 * k)) if k else v, c(3)), vf)
                      for k in range(4)]
            _emit_mac_sub16(context, builder, xty, xb_, j, quants, scv, aty, acc_)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _block_q3k(typingctx, q, d, xb, acc):
    """One whole Q3_K block of the fp32 matvec as vector IR, the scalar driver's operations
    lane for lane (so the same bits): the sixteen 6-bit scales (low nibbles from bytes 96-103,
    high pairs from 104-107, less 32) times d as one <16 x float>, and per half j of the block
    the quants of elements 128j + 32k + b (k = 0..3, b = 0..31): bits 2k of qs byte 32 + 32j + b
    with bit 4j + k of hmask byte b as their bit 2, less 4, into :func:`_emit_mac_sub16`."""
    sig = types.void(q, d, xb, acc)

    def codegen(context, builder, signature, args):
        qty, _, xty, aty = signature.args
        q_, d_, xb_, acc_ = args
        vb, vb16 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(8), 16)
        v16 = ir.VectorType(ir.IntType(32), 16)
        vf, vf16 = ir.VectorType(ir.FloatType(), 32), ir.VectorType(ir.FloatType(), 16)
        load, c = _block_loader(context, builder, qty, q_), _bytes32

        def c16(vals):
            return ir.Constant(v16, vals)
        # bytes 94-109 (in the block: 96-111 would read past its end); scale s takes its low
        # nibble from byte 96 + s % 8 (shifted by 4 for s >= 8), its high pair from byte
        # 104 + s % 4 (shifted by 2 * (s // 4))
        tail = load(94, vb16)

        def pick(idx):
            return builder.zext(builder.shuffle_vector(tail, ir.Constant(vb16, ir.Undefined),
                                                       c16(idx)), v16)
        lo = builder.and_(builder.lshr(pick([2 + (t & 7) for t in range(16)]),
                                       c16([4 * (t >> 3) for t in range(16)])), c16([15] * 16))
        hi = builder.and_(builder.lshr(pick([10 + (t & 3) for t in range(16)]),
                                       c16([2 * (t >> 2) for t in range(16)])), c16([3] * 16))
        sc = builder.sub(builder.or_(lo, builder.shl(hi, c16([4] * 16))), c16([32] * 16))
        scv = builder.fmul(ir_splat(builder, d_, vf16), builder.sitofp(sc, vf16))
        hb = load(0, vb)
        for j in range(2):
            v = load(32 + 32 * j, vb)
            quants = []
            for k in range(4):
                low = builder.and_(builder.lshr(v, c(2 * k)) if k else v, c(3))
                bit = builder.and_(builder.lshr(hb, c(4 * j + k)) if 4 * j + k else hb, c(1))
                u = builder.or_(low, builder.shl(bit, c(2)))
                quants.append(builder.sitofp(builder.sub(u, c(4)), vf))
            _emit_mac_sub16(context, builder, xty, xb_, j, quants, scv, aty, acc_)
        return context.get_dummy_value()

    return sig, codegen


def _emit_q45k_head(context, builder, qty, q_, off, d_, dmin_):
    """The scales ``d * sc[t]`` and mins ``dmin * mn[t]`` (t = 0..7) of the Q4_K / Q5_K block at
    byte ``off`` (an i64 IR value) of q_, as two <8 x float> IR values: the eight 6-bit (scale,
    min) pairs decoded from bytes 4-15 as <8 x i32> vectors (the scalar head took as long as
    the block's 256 products)."""
    v8 = ir.VectorType(I32, 8)
    vf8 = ir.VectorType(ir.FloatType(), 8)
    vb16 = ir.VectorType(ir.IntType(8), 16)
    head = builder.load(ir_ptr(context, builder, qty, q_, off, vb16), align=1)

    def pick(idx):          # bytes idx of the block's first 16, zero-extended to i32
        sh = builder.shuffle_vector(head, ir.Constant(vb16, ir.Undefined), ir.Constant(v8, idx))
        return builder.zext(sh, v8)

    def c8(vals):
        return ir.Constant(v8, vals)

    def high2(b):           # (b >> 6) << 4 in lanes 4-7, 0 in lanes 0-3
        return builder.and_(builder.shl(builder.lshr(b, c8([6] * 8)), c8([4] * 8)),
                            c8([0] * 4 + [48] * 4))
    # sc[g] = q[4+g] & 63, sc[4+g] = (q[12+g] & 15) | ((q[4+g] >> 6) << 4); mn likewise
    # from q[8+g] and the high nibbles of q[12+g]
    sc = builder.or_(builder.and_(pick([4, 5, 6, 7, 12, 13, 14, 15]), c8([63] * 4 + [15] * 4)),
                     high2(pick([4, 5, 6, 7, 4, 5, 6, 7])))
    mn = builder.or_(builder.and_(builder.lshr(pick([8, 9, 10, 11, 12, 13, 14, 15]),
                                               c8([0] * 4 + [4] * 4)), c8([63] * 8)),
                     high2(pick([8, 9, 10, 11, 8, 9, 10, 11])))
    return (builder.fmul(ir_splat(builder, d_, vf8), builder.sitofp(sc, vf8)),
            builder.fmul(ir_splat(builder, dmin_, vf8), builder.sitofp(mn, vf8)))


def _opaque_ptr(builder, p):
    """Pointer ``p`` through an empty inline asm (x86-64 hosts only call this), so that
    LLVM cannot tell which memory it points to: it keeps the loads and stores through it in
    memory, neither forwarding a stored value to a later load nor hoisting them. (The asm is
    not marked as having side effects, so an LLVM could still hoist it out of a loop and then
    forward through it: the results would be the same, the speed not. Compiled with LLVM 22,
    the steps' hot loops load each scale from the slot: ``tools.mca_steps.compile_asm`` and
    ``hot_loop`` give their assembly.)"""
    return builder.call(ir.InlineAsm(ir.FunctionType(p.type, [p.type]), "", "=r,0"), [p])


def _load_splat(builder, fp, i):
    """float fp[i] in every lane of a <16 x float> (fp an opaque float*, :func:`_opaque_ptr`):
    on x86-64 a broadcast load, folded into the instruction that takes it."""
    return ir_splat(builder, builder.load(builder.gep(fp, [ir.Constant(I32, i)]), align=4),
                    ir.VectorType(ir.FloatType(), 16))


def _ahead_ptr(context, builder, hty, h):
    """float* to the 16-float slot ``h`` of :func:`_q4k_step_ahead` (opaque: :func:`_opaque_ptr`)."""
    fp = ir_ptr(context, builder, hty, h, ir.Constant(ir.IntType(64), 0), ir.FloatType())
    return _opaque_ptr(builder, fp)


def _store_head(context, builder, qty, w_, o_, d_, dmin_, hp):
    """Decode the head of the Q4_K block at byte o_ of row w_ (:func:`_emit_q45k_head`) into the
    slot at float* hp: its scales in floats 0-7, its mins in 8-15."""
    vf8 = ir.VectorType(ir.FloatType(), 8)
    scales, mins = _emit_q45k_head(context, builder, qty, w_, o_, d_, dmin_)
    builder.store(scales, builder.bitcast(hp, vf8.as_pointer()), align=4)
    builder.store(mins, builder.bitcast(builder.gep(hp, [ir.Constant(I32, 8)]), vf8.as_pointer()), align=4)


@intrinsic
def _q4k_head_ahead(typingctx, w, o, d, dmin, h):
    """The first block's head for :func:`_q4k_step_ahead`: the scales and mins of the Q4_K block
    at byte o of row w (d, dmin its fp16 fields) into the float32[16] slot h."""
    def codegen(context, builder, signature, args):
        qty, _, _, _, hty = signature.args
        w_, o_, d_, dmin_, h_ = args
        _store_head(context, builder, qty, w_, o_, d_, dmin_, _ahead_ptr(context, builder, hty, h_))
        return context.get_dummy_value()
    return types.void(w, o, d, dmin, h), codegen


@intrinsic
def _q4k_step_ahead(typingctx, w, o, on, dn, dminn, xb, xo, xs, xso, acc, accm, h):
    """One Q4_K block of the fp32 matvec on AVX-512 hosts (WIDE_STEPS), its head decoded one
    block ahead: the block at byte o of row w takes its scales and mins from the float32[16]
    slot h (written by the step before, or :func:`_q4k_head_ahead`), adds its min terms
    ``accm[t] += mins[t] * xs[xso + t]`` and its products (:func:`_emit_q4k_tables`, x from
    xb[xo:], lanes in K_LANE_ELEMENT order), then decodes the head of the block at byte on
    (dn, dminn: its fp16 fields) into h for the next step. The same operations on the same
    values as :func:`_block_q4k` (the same bits); only the order of work changes.

    Each scale reaches its table as a broadcast load folded into the multiply (``vmulps
    m32{1to16}``; kept in registers, LLVM made each a VPERMPS, and the permutes are what a
    block waits on), and the head's decode, its stores and those loads lie a block apart: on
    the block's own path they had held its table lookups back. One core of an AMD EPYC
    znver4 (AVX-512 on 256-bit units), Gemma's 640 x 2048 ffn_down in L2, best of 300:
    90.6 us (the scales by VPERMPS) -> 82.0 (broadcast loads) -> 77.3 (one block ahead);
    4096 x 4096 synthetic, with the broadcast loads: 52 -> 49.5 cycles a block."""
    def codegen(context, builder, signature, args):
        qty, _, _, _, _, xty, _, xsty, _, aty, mty, hty = signature.args
        w_, o_, on_, dn_, dminn_, xb_, xo_, xs_, xso_, acc_, accm_, h_ = args
        i64 = ir.IntType(64)
        vf8 = ir.VectorType(ir.FloatType(), 8)
        hp = _ahead_ptr(context, builder, hty, h_)
        spl = [_load_splat(builder, hp, k) for k in range(8)]
        mins = builder.load(builder.bitcast(builder.gep(hp, [ir.Constant(I32, 8)]), vf8.as_pointer()), align=4)
        xsv = builder.load(ir_ptr(context, builder, xsty, xs_, xso_, vf8), align=4)
        mp = ir_ptr(context, builder, mty, accm_, ir.Constant(i64, 0), vf8)
        builder.store(builder.fadd(builder.load(mp, align=4), builder.fmul(mins, xsv)), mp, align=4)
        o64, xo64 = (builder.sext(v, i64) if v.type.width < 64 else v for v in (o_, xo_))
        for j in range(2):
            ps = (builder.add(o64, ir.Constant(i64, 16 + 64 * j)), builder.add(o64, ir.Constant(i64, 48 + 64 * j)))
            xo = builder.add(xo64, ir.Constant(i64, 128 * j))
            _emit_q4k_tables(context, builder, qty, w_, ps, xty, xb_, xo, spl[4 * j:4 * j + 4], aty, acc_)
        _store_head(context, builder, qty, w_, on_, dn_, dminn_, hp)
        return context.get_dummy_value()
    return types.void(w, o, on, dn, dminn, xb, xo, xs, xso, acc, accm, h), codegen


def _block_q45k_codegen(five: bool):
    """The codegen of :func:`_block_q4k` (``five`` False) and :func:`_block_q5k` (True: the
    quants' bit 4 from the qh bytes 16-47, the nibbles from bytes 48-175)."""
    def codegen(context, builder, signature, args):
        qty, _, _, xty, xsty, _, aty, mty = signature.args
        q_, d_, dmin_, xb_, xs_, xso_, acc_, accm_ = args
        i32, i64 = ir.IntType(32), ir.IntType(64)
        v8 = ir.VectorType(i32, 8)
        vf8 = ir.VectorType(ir.FloatType(), 8)
        scales, mins = _emit_q45k_head(context, builder, qty, q_, ir.Constant(i64, 0), d_, dmin_)
        xsv = builder.load(ir_ptr(context, builder, xsty, xs_, xso_, vf8), align=4)
        mp = ir_ptr(context, builder, mty, accm_, ir.Constant(i64, 0), vf8)
        builder.store(builder.fadd(builder.load(mp, align=4), builder.fmul(mins, xsv)), mp, align=4)
        hw = (builder.load(ir_ptr(context, builder, qty, q_, ir.Constant(i64, 16), v8), align=1)
              if five else None)
        qs = 48 if five else 16
        for j in range(2):
            a = [builder.extract_element(scales, ir.Constant(i32, 4 * j + k)) for k in range(4)]
            _emit_mac_q4k(context, builder, qty, q_, ir.Constant(i64, qs + 64 * j),
                          ir.Constant(i64, qs + 32 + 64 * j), xty, xb_, ir.Constant(i64, 128 * j), a, aty,
                          acc_, (hw, j) if five else None)
        return context.get_dummy_value()
    return codegen


@intrinsic
def _block_q4k(typingctx, q, d, dmin, xb, xs, xso, acc, accm):
    """One whole Q4_K block of the fp32 matvec as vector IR, the scalar driver's operations
    lane for lane (so the same bits): the eight 6-bit scales and mins decoded from bytes 4-15
    as <8 x i32> vectors (the scalar head took as long as the block's 256 products), the min
    terms ``accm[t] += (dmin * mn[t]) * xs[xso + t]`` as one 8-lane step, and the scales
    ``d * sc[t]`` fed to :func:`_emit_mac_q4k`'s step for the two halves of the block."""
    return types.void(q, d, dmin, xb, xs, xso, acc, accm), _block_q45k_codegen(False)


@intrinsic
def _block_q5k(typingctx, q, d, dmin, xb, xs, xso, acc, accm):
    """:func:`_block_q4k` for Q5_K (the same head; each quant's bit 4 from the qh bytes)."""
    return types.void(q, d, dmin, xb, xs, xso, acc, accm), _block_q45k_codegen(True)


# ------------------------------------------------------------------ generic drivers (inlined into the per-type kernels)

@jit.njit(inline="always")
def _dequantize_k(raw, out, f16, head, quad, bsz, sub):
    """w = (d * scale) * q - dmin * min, as gguf.quants (dmin = 0 for Q3_K/Q6_K: x - 0.0 == x)."""
    rows = raw.shape[0]
    nb = out.shape[1] // QK_K
    st = 2 if sub == 16 else 1  # sub-blocks per 32 elements (no division: it costs in the loops)
    nchunk = min(rows, ROW_CHUNKS)
    for c in prange(nchunk):
        sc = np.empty(16, np.int32)
        mn = np.zeros(16, np.int32)
        for r in range(c * rows // nchunk, (c + 1) * rows // nchunk):
            for i in range(nb):
                q = raw[r, i * bsz:(i + 1) * bsz]
                o = out[r, i * QK_K:(i + 1) * QK_K]
                d, dmin = head(q, f16, sc, mn)
                for j in range(2):
                    for h in range(st):
                        s = 4 * j * st + h
                        d0, d1, d2, d3 = (d * np.float32(sc[s]), d * np.float32(sc[s + st]),
                                          d * np.float32(sc[s + 2 * st]), d * np.float32(sc[s + 3 * st]))
                        m0, m1, m2, m3 = (dmin * np.float32(mn[s]), dmin * np.float32(mn[s + st]),
                                          dmin * np.float32(mn[s + 2 * st]), dmin * np.float32(mn[s + 3 * st]))
                        for b in range(sub * h, sub * h + sub):
                            q0, q1, q2, q3 = quad(q, j, b, False)
                            o[128 * j + b] = d0 * q0 - m0
                            o[128 * j + 32 + b] = d1 * q1 - m1
                            o[128 * j + 64 + b] = d2 * q2 - m2
                            o[128 * j + 96 + b] = d3 * q3 - m3


@jit.njit(inline="always")
def _vblock_q2k(q, f16, xb, xs, xso, acc, accm):
    """The Q2_K block of :func:`_matvec_k` as vector IR (:func:`_block_q2k`); True: done."""
    _block_q2k(q, f16[load_u16(q, 80)], f16[load_u16(q, 82)], xb, xs, xso, acc, accm)
    return True


@jit.njit(inline="always")
def _vblock_q3k(q, f16, xb, xs, xso, acc, accm):
    """The Q3_K block of :func:`_matvec_k` as vector IR (:func:`_block_q3k`); True: done."""
    _block_q3k(q, f16[load_u16(q, 108)], xb, acc)
    return True


@jit.njit(inline="always")
def _vblock_q4k(q, f16, xb, xs, xso, acc, accm):
    """The Q4_K block of :func:`_matvec_k` as vector IR (:func:`_block_q4k`); True: done."""
    _block_q4k(q, f16[load_u16(q, 0)], f16[load_u16(q, 2)], xb, xs, xso, acc, accm)
    return True


@jit.njit(inline="always")
def _vblock_q5k(q, f16, xb, xs, xso, acc, accm):
    """The Q5_K block of :func:`_matvec_k` as vector IR (:func:`_block_q5k`); True: done."""
    _block_q5k(q, f16[load_u16(q, 0)], f16[load_u16(q, 2)], xb, xs, xso, acc, accm)
    return True


@jit.njit(inline="always")
def _vblock_q6k(q, f16, xb, xs, xso, acc, accm):
    """The Q6_K block of :func:`_matvec_k` as vector IR (:func:`_block_q6k`); True: done."""
    _block_q6k(q, f16[load_u16(q, 208)], xb, acc)
    return True


@jit.njit(inline="always")
def _vblock_none(q, f16, xb, xs, xso, acc, accm):
    """No vector-IR block: :func:`_matvec_k` runs its scalar loop (False)."""
    return False


@jit.njit(inline="always")
def _lane(b, perm):
    """The accumulator lane of element b (0..31) of a 32-element sub-block: b itself, or with
    ``perm`` (the order of Q4_K's and Q5_K's vector IR blocks) 8 * (b % 4) + b // 4."""
    return ((b & 3) << 3) | (b >> 2) if perm else b


# the element of a 32-element sub-block in each lane of Q4_K's / Q5_K's vector IR block (the
# inverse of _lane's permutation: lane 8t + i holds element 4i + t)
K_LANE_ELEMENT = np.array([4 * (L % 8) + L // 8 for L in range(32)], np.int64)


@jit.njit(inline="always")
def _permute_blocks(x, lane_element):
    """x with each 32-element block's activations in a vector block step's lane order:
    out[32b + L] = x[32b + lane_element[L]] (K_LANE_ELEMENT)."""
    out = np.empty_like(x)
    for b in range(x.shape[0] // 32):
        for k in range(32):
            out[32 * b + k] = x[32 * b + lane_element[k]]
    return out


@jit.njit(inline="always")
def _matvec_k(raw, raw1, raw2, x, out, f16, head, quad, bsz, sub, has_min, vblock, perm, wfirst):
    """fp32 numerics: per sub-block d * scale formed once, the min term once per sub-block
    through the sums of x, 32 lane accumulators summed once per row; each lane takes
    ``fma(d * scale, q * x, acc)`` for the sub-blocks of a block in order, or with ``wfirst``
    (WEIGHT_FIRST) ``fma((d * scale) * q, x, acc)``: the weight, then its product. ``vblock``: the
    type's whole block as vector IR (:func:`_vblock_q2k` .. :func:`_vblock_q6k`), or
    :func:`_vblock_none`: the scalar loop (the reference the vector IR is tested against).
    ``perm``: the lanes hold a sub-block's elements in permuted order (:func:`_lane`); the
    vector IR block reads x permuted likewise, once per call. The rows
    are a group's (raw, raw1, raw2 one after another: quants_legacy.group_row)."""
    rows = raw.shape[0] + raw1.shape[0] + raw2.shape[0]
    nb = x.shape[0] // QK_K
    st = 2 if sub == 16 else 1  # sub-blocks per 32 elements (no division: it costs in the loops)
    nsub = 8 * st
    xs = _xsums(x, sub) if has_min else np.zeros(0, np.float32)   # only the min terms read them
    xv = _permute_blocks(x, K_LANE_ELEMENT) if perm else x                          # the vector IR's activations
    nchunk = min(rows, ROW_CHUNKS)
    for c in prange(nchunk):
        sc = np.empty(16, np.int32)
        mn = np.zeros(16, np.int32)
        acc = stack_f32(32)                  # in registers across the blocks (stack_f32)
        accm = stack_f32(16)[:nsub]          # min terms, one lane per sub-block position
        for r in range(c * rows // nchunk, (c + 1) * rows // nchunk):
            w = group_row(raw, raw1, raw2, r)
            acc[:] = 0
            accm[:] = 0
            for i in range(nb):
                q = w[i * bsz:(i + 1) * bsz]
                if vblock(q, f16, xv[i * QK_K:(i + 1) * QK_K], xs, nsub * i, acc, accm):
                    continue
                xb = x[i * QK_K:(i + 1) * QK_K]
                d, dmin = head(q, f16, sc, mn)
                if has_min:
                    for t in range(nsub):
                        accm[t] += (dmin * np.float32(mn[t])) * xs[nsub * i + t]
                for j in range(2):
                    for h in range(st):
                        s = 4 * j * st + h
                        a0, a1, a2, a3 = (d * np.float32(sc[s]), d * np.float32(sc[s + st]),
                                          d * np.float32(sc[s + 2 * st]), d * np.float32(sc[s + 3 * st]))
                        for b in range(sub * h, sub * h + sub):
                            q0, q1, q2, q3 = quad(q, j, b, False)
                            ln = _lane(b, perm)
                            if wfirst:
                                a = fma32(a0 * q0, xb[128 * j + b], acc[ln])
                                a = fma32(a1 * q1, xb[128 * j + 32 + b], a)
                                a = fma32(a2 * q2, xb[128 * j + 64 + b], a)
                                acc[ln] = fma32(a3 * q3, xb[128 * j + 96 + b], a)
                            else:
                                a = fma32(a0, q0 * xb[128 * j + b], acc[ln])
                                a = fma32(a1, q1 * xb[128 * j + 32 + b], a)
                                a = fma32(a2, q2 * xb[128 * j + 64 + b], a)
                                acc[ln] = fma32(a3, q3 * xb[128 * j + 96 + b], a)
            out[r] = lanes_sum32(acc) - (accm.sum() if has_min else _F32_0)


@jit.njit(inline="always")
def _matvec_q4k_ahead(raw, raw1, raw2, x, out, f16, bsz):
    """Q4_K's fp32 matvec on AVX-512 hosts: :func:`_matvec_k`'s operations (the same bits) by
    :func:`_q4k_step_ahead`, each block's scales and mins decoded one block ahead into a stack
    slot. The next block of the row's last is itself (decoded again, not used). ``bsz``: Q4_K's
    bytes per block (_TYPES)."""
    rows = raw.shape[0] + raw1.shape[0] + raw2.shape[0]
    nb = x.shape[0] // QK_K
    xs = _xsums(x, 32)
    xv = _permute_blocks(x, K_LANE_ELEMENT)
    nchunk = min(rows, ROW_CHUNKS)
    for c in prange(nchunk):
        acc = stack_f32(32)                  # in registers across the blocks (stack_f32)
        accm = stack_f32(8)
        ahead = stack_f32(16)                # the next block's scales and mins
        for r in range(c * rows // nchunk, (c + 1) * rows // nchunk):
            w = group_row(raw, raw1, raw2, r)
            acc[:] = 0
            accm[:] = 0
            if nb == 0:                       # rows of no elements: no head to read
                out[r] = _F32_0
                continue
            _q4k_head_ahead(w, 0, f16[load_u16(w, 0)], f16[load_u16(w, 2)], ahead)
            for i in range(nb):
                on = min(i + 1, nb - 1) * bsz
                _q4k_step_ahead(w, i * bsz, on, f16[load_u16(w, on)], f16[load_u16(w, on + 2)], xv, i * QK_K,
                                xs, 8 * i, acc, accm, ahead)
            out[r] = lanes_sum32(acc) - accm.sum()


@jit.njit(inline="always")
def _matmul_ggml_k(raw, yd, yf, ybs, out, f16, head, quad, bsz, sub, nmin, off):
    """ggml numerics. ``nmin`` is how the type's AVX2 kernel accumulates the
    ``dmin * min * bsums`` terms: 0 none (Q3_K, Q6_K), 8 into the quant lanes, before
    them (Q2_K), 4 in four extra lanes (Q4_K), 1 in a scalar (Q5_K). Q6_K (``off`` 32)
    multiplies its stored quants and takes ``off * scale * bsums`` of sub-blocks 2k and
    2k + 1 off lane k, as ggml does (exact in float64)."""
    rows = raw.shape[0]
    m, nb = yd.shape
    per = 2 if nmin == 8 else (4 if nmin == 4 else 16)  # 16-element bsums per min lane
    st = 2 if sub == 16 else 1  # sub-blocks per 32 elements (no division: it costs in the loops)
    nchunk = min(rows, ROW_CHUNKS)
    for c in prange(nchunk):
        acc = np.empty((m, 8), np.float32)
        accm = np.empty((m, 4), np.float32)
        wf = np.empty(QK_K, np.float32)
        sc = np.empty(16, np.int32)
        mn = np.zeros(16, np.int32)
        tmp = np.empty(32, np.float32)
        lanes = np.empty(8, np.float64)
        for r in range(c * rows // nchunk, (c + 1) * rows // nchunk):
            acc[:] = 0
            accm[:] = 0
            for i in range(nb):
                q = raw[r, i * bsz:(i + 1) * bsz]
                dw, dmw = head(q, f16, sc, mn)
                for j in range(2):
                    for h in range(st):
                        s = 4 * j * st + h
                        a0, a1, a2, a3 = (np.float32(sc[s]), np.float32(sc[s + st]),
                                          np.float32(sc[s + 2 * st]), np.float32(sc[s + 3 * st]))
                        for b in range(sub * h, sub * h + sub):
                            q0, q1, q2, q3 = quad(q, j, b, off != 0)
                            wf[128 * j + b] = a0 * q0
                            wf[128 * j + 32 + b] = a1 * q1
                            wf[128 * j + 64 + b] = a2 * q2
                            wf[128 * j + 96 + b] = a3 * q3
                for a in range(m):
                    dy = yd[a, i]
                    bs = ybs[a, 16 * i:16 * i + 16]
                    dmin = (-dy) * dmw
                    for k in range(nmin):
                        pm = 0
                        for t in range(per * k, per * (k + 1)):
                            pm += np.int64(mn[t if st == 2 else t >> 1]) * np.int64(bs[t])
                        if nmin == 8:
                            acc[a, k] = fma32(dmin, np.float32(pm), acc[a, k])
                        else:
                            accm[a, k] = fma32(dmin, np.float32(pm), accm[a, k])
                    _block_lanes(wf, yf[a, i * QK_K:(i + 1) * QK_K], tmp, lanes)
                    d = dy * dw
                    for k in range(8):
                        lk = lanes[k]
                        if off:
                            lk -= np.float64(off) * np.float64(np.int64(bs[2 * k]) * sc[2 * k]
                                                               + np.int64(bs[2 * k + 1]) * sc[2 * k + 1])
                        acc[a, k] = fma32(d, np.float32(lk), acc[a, k])
            for a in range(m):
                if nmin == 4:
                    out[a, r] = hsum8(acc[a]) + ((accm[a, 0] + accm[a, 2]) + (accm[a, 1] + accm[a, 3]))
                elif nmin == 1:
                    out[a, r] = hsum8(acc[a]) + accm[a, 0]
                else:
                    out[a, r] = hsum8(acc[a])


# ------------------------------------------------------------------ ggml numerics on SIMD integer dot products
# The K types on x86 with AVX2 or VNNI: the same integer lane sums _matmul_ggml_k forms in
# float32/float64, taken per 32-element group by VPDPBUSD (or VPMADDUBSW + VPMADDWD) over the
# unsigned quants and the Q8_K quants, times the group's scales, in int32 (exact: |lane| <
# 2**26); then the same fma per block and lane, min terms and final sums. Unsigned quants up to
# 63 keep VPMADDUBSW's pair sums below 2**15; Q3_K's signed ones (-4 .. 3) take the sign trick
# (quants_legacy.ir_lane_sums).


_I64 = ir.IntType(64)


def _k_lanes_codegen(kind: int, use_vnni: bool, nrows: int):
    """The codegen of :func:`_k_lanes` (``nrows`` 0: ``a`` one row of quants) and
    :func:`_k_lanes_rows` (``a`` a matrix, rows a0 .. a0 + nrows - 1): the block's quants are
    unpacked and its scales spread to lanes once, then each activation row takes its lane
    sums over them. ``kind`` 2 .. 6: Q2_K .. Q6_K."""
    k6 = kind == 6

    def codegen(context, builder, signature, args):
        if nrows:
            qty, aty, _, _, scty, lty = signature.args[:6]
            q_, a_, a0_, ao_, sc_, l_ = args[:6]
        else:
            qty, aty, _, scty, lty = signature.args[:5]
            q_, a_, ao_, sc_, l_ = args[:5]
        v32, v8 = vector_of(_I8, 32), vector_of(I32, 8)
        c = lambda ty, vals: ir.Constant(ty, vals)         # noqa: E731
        ao64 = builder.sext(ao_, _I64) if ao_.type.width < 64 else ao_

        def ld(ty, arr, off, vty):
            return builder.load(ir_ptr(context, builder, ty, arr, off, vty), align=1)

        if nrows:
            a0_64 = builder.sext(a0_, _I64) if a0_.type.width < 64 else a0_
            a_arr = context.make_array(aty)(context, builder, a_)

        def a_group(row, g):                  # Q8_K quants of 32-element group g of a row
            off = builder.add(ao64, c(_I64, 32 * g))
            if not nrows:
                return ld(aty, a_, off, v32)
            p = cgutils.get_item_pointer(context, builder, aty, a_arr, [builder.add(a0_64, c(_I64, row)), off],
                                         wraparound=False)
            return builder.load(builder.bitcast(p, v32.as_pointer()), align=1)

        scv = ld(scty, sc_, c(_I64, 0), vector_of(I32, 16))
        groups = []                           # (unsigned quants, group index)
        if k6:
            for j in range(2):
                v0 = ld(qty, q_, c(_I64, 64 * j), v32)
                v1 = ld(qty, q_, c(_I64, 64 * j + 32), v32)
                hb = ld(qty, q_, c(_I64, 128 + 32 * j), v32)

                def high2(mask, shift):       # the qh bits under mask moved to bits 4-5
                    t = builder.and_(hb, c(v32, [mask] * 32))
                    if shift >= 0:
                        return builder.shl(t, c(v32, [shift] * 32))
                    return builder.lshr(t, c(v32, [-shift] * 32))

                lo4, sh4 = c(v32, [15] * 32), c(v32, [4] * 32)
                groups += [(builder.or_(builder.and_(v0, lo4), high2(3, 4)), 4 * j),
                           (builder.or_(builder.and_(v1, lo4), high2(12, 2)), 4 * j + 1),
                           (builder.or_(builder.lshr(v0, sh4), high2(48, 0)), 4 * j + 2),
                           (builder.or_(builder.lshr(v1, sh4), high2(192, -2)), 4 * j + 3)]
        elif kind in (2, 3):
            # element 128j + 32l + b of Q2_K / Q3_K: bits 2l of qs byte 32j + b (qs at 16 / 32);
            # Q3_K's bit 2 is bit 4j + l of hmask byte b, the quant that less 4 (signed)
            hb = ld(qty, q_, c(_I64, 0), v32) if kind == 3 else None
            for j in range(2):
                v = ld(qty, q_, c(_I64, (32 if kind == 3 else 16) + 32 * j), v32)
                for l in range(4):
                    u = builder.and_(builder.lshr(v, c(v32, [2 * l] * 32)) if l else v, c(v32, [3] * 32))
                    if hb is not None:
                        g = 4 * j + l
                        bit = builder.and_(builder.lshr(hb, c(v32, [g] * 32)) if g else hb, c(v32, [1] * 32))
                        u = builder.sub(builder.or_(u, builder.shl(bit, c(v32, [2] * 32))), c(v32, [4] * 32))
                    groups.append((u, 4 * j + l))
        else:
            # Q5_K: the qs nibbles at 48..175, bit 4 of element b of sub-block s: bit s of qh
            # byte 16 + b
            hb = ld(qty, q_, c(_I64, 16), v32) if kind == 5 else None
            for g in range(4):
                v = ld(qty, q_, c(_I64, (48 if kind == 5 else 16) + 32 * g), v32)
                for s, u in ((2 * g, builder.and_(v, c(v32, [15] * 32))),
                             (2 * g + 1, builder.lshr(v, c(v32, [4] * 32)))):
                    if hb is not None:
                        bit = builder.lshr(hb, c(v32, [s] * 32)) if s else hb
                        u = builder.or_(u, builder.shl(builder.and_(bit, c(v32, [1] * 32)), c(v32, [4] * 32)))
                    groups.append((u, s))
        scales = [builder.shuffle_vector(scv, scv, c(v8, [2 * g] * 4 + [2 * g + 1] * 4) if kind in (2, 3, 6)
                                         else c(v8, [g] * 8)) for _, g in groups]
        for row in range(max(nrows, 1)):
            lp = ir_ptr(context, builder, lty, l_, c(_I64, 8 * row), v8)
            tot = builder.load(lp, align=4) if k6 else c(v8, [0] * 8)
            for (u, g), scale in zip(groups, scales):
                # Q3_K's signed quants: the sign trick (|q| <= 4, Q8_K quants within +-127)
                s = ir_lane_sums(builder, u, a_group(row, g), c(v8, [0] * 8), use_vnni, kind == 3)
                tot = builder.add(tot, builder.mul(s, scale))
            builder.store(tot, lp, align=4)
        return context.get_dummy_value()

    return codegen


def _k_literals(kind, vnni) -> bool:
    return isinstance(kind, types.IntegerLiteral) and isinstance(vnni, types.BooleanLiteral)


@intrinsic
def _k_lanes(typingctx, q, a, ao, sc, lanes, kind, vnni):
    """lanes int32[8] = one super-block's integer lane sums: lane l sums scale * quant * a over
    the elements 4l .. 4l + 3 of every 32-element group. q: the block's bytes (uint8[bsz]);
    a: int8 Q8_K quants from a[ao]; sc int32[16]: the scales (Q4_K, Q5_K: sc[s] of 32-element
    sub-block s; Q2_K, Q3_K, Q6_K: sc[s] of 16-element sub-block s, the first 4 lanes of group g
    take sc[2g], the last 4 sc[2g + 1]); ``lanes`` holds Q6_K's start value on entry (the
    offset terms), is overwritten for the others. ``kind`` 2 .. 6 and ``vnni`` are literals."""
    if not _k_literals(kind, vnni):
        return None
    return (types.void(q, a, ao, sc, lanes, kind, vnni),
            _k_lanes_codegen(kind.literal_value, vnni.literal_value, 0))


@intrinsic
def _k_lanes_rows(typingctx, q, a, a0, ao, sc, lanes, kind, vnni, nrows):
    """:func:`_k_lanes` for activation rows a0 .. a0 + nrows - 1 of the int8 matrix ``a`` at
    once (``lanes`` int32[8 * nrows], row r's lanes at 8r): the block's quants unpacked once
    for all of them (a prefill tile). ``nrows`` is a literal too."""
    if not _k_literals(kind, vnni) or not isinstance(nrows, types.IntegerLiteral):
        return None
    return (types.void(q, a, a0, ao, sc, lanes, kind, vnni, nrows),
            _k_lanes_codegen(kind.literal_value, vnni.literal_value, nrows.literal_value))


@jit.njit(inline="always")
def _k_head(q, f16, sc, mn, kind):
    """The super-block's (d, dmin) and scales (and Q2_K's, Q4_K's and Q5_K's mins) into sc, mn."""
    if kind == 6:
        return _head_q6_k(q, f16, sc, mn)
    if kind == 3:
        return _head_q3_k(q, f16, sc, mn)
    if kind == 2:
        return _head_q2_k(q, f16, sc, mn)
    return _head_q4_k(q, f16, sc, mn)


@jit.njit(inline="always")
def _k_pre(bs, ydi, dmw, sc, mn, lanes, lo, accm, mo, acc, ao, kind):
    """Before the lane sums of one super-block and activation row (block sums bs, scale ydi):
    Q6_K's offset terms into lanes[lo:lo+8], Q4_K's min terms into accm[mo:mo+4], Q5_K's
    (one sum over the block, as _matmul_ggml_k's nmin 1) into accm[mo], Q2_K's into the quant
    lanes acc[ao:ao+8] (nmin 8); Q3_K has none."""
    if kind == 6:
        for k in range(8):                   # ggml takes 32 * scale * bsums off lane k
            lanes[lo + k] = -32 * (np.int32(bs[2 * k]) * sc[2 * k] + np.int32(bs[2 * k + 1]) * sc[2 * k + 1])
    elif kind == 2:
        dmin = (-ydi) * dmw                  # into the quant lanes, before them (nmin 8)
        for k in range(8):
            pm = mn[2 * k] * np.int32(bs[2 * k]) + mn[2 * k + 1] * np.int32(bs[2 * k + 1])
            acc[ao + k] = fma32(dmin, np.float32(pm), acc[ao + k])
    elif kind == 5:
        pm = np.int32(0)
        for t in range(16):
            pm += mn[t >> 1] * np.int32(bs[t])
        accm[mo] = fma32((-ydi) * dmw, np.float32(pm), accm[mo])
    else:
        dmin = (-ydi) * dmw
        for k in range(4):
            pm = (mn[2 * k] * (np.int32(bs[4 * k]) + np.int32(bs[4 * k + 1]))
                  + mn[2 * k + 1] * (np.int32(bs[4 * k + 2]) + np.int32(bs[4 * k + 3])))
            accm[mo + k] = fma32(dmin, np.float32(pm), accm[mo + k])


@jit.njit(inline="always")
def _k_post(ydi, dw, lanes, lo, acc, ao):
    """After the lane sums: acc[ao:ao+8] takes d * lanes[lo:lo+8], one fma a lane."""
    d = ydi * dw
    for k in range(8):
        acc[ao + k] = fma32(d, np.float32(lanes[lo + k]), acc[ao + k])


@jit.njit(inline="always")
def _k_step(q, yq, i, ybs, ydi, dw, dmw, sc, mn, lanes, acc, ao, accm, mo, kind, vnni):
    """One super-block of one weight row (its head already in dw, dmw, sc, mn) against one
    activation row (quants yq, block sums ybs, scale ydi): acc[ao:ao+8] and accm[mo:mo+4]
    take _matmul_ggml_k's steps."""
    _k_pre(ybs[16 * i:16 * i + 16], ydi, dmw, sc, mn, lanes, 0, accm, mo, acc, ao, kind)
    _k_lanes(q, yq, i * QK_K, sc, lanes, kind, vnni)
    _k_post(ydi, dw, lanes, 0, acc, ao)


@jit.njit(inline="always")
def _k_step4(q, yq, ybs, yd, a0, t, i, dw, dmw, sc, mn, lanes, acc, accm, kind, vnni):
    """_k_step for activation rows a0 .. a0 + 3 against weight row t of a pair (its
    accumulators at acc[16a + 8t], accm[8a + 4t]): the same operations per row, the block's
    quants unpacked once for the four (_k_lanes_rows). lanes int32[32]."""
    for r in range(4):
        a = a0 + r
        _k_pre(ybs[a, 16 * i:16 * i + 16], yd[a, i], dmw, sc, mn, lanes, 8 * r, accm, 8 * a + 4 * t,
               acc, 16 * a + 8 * t, kind)
    _k_lanes_rows(q, yq, a0, i * QK_K, sc, lanes, kind, vnni, 4)
    for r in range(4):
        a = a0 + r
        _k_post(yd[a, i], dw, lanes, 8 * r, acc, 16 * a + 8 * t)


@jit.njit(inline="always")
def _matmul_ggml_k_i8(raw, yd, yq, ybs, out, f16, bsz, kind, vnni):
    """_matmul_ggml_k's results for Q2_K .. Q6_K (kind 2 .. 6) through _k_lanes. Two
    weight rows per work item, r and r + ceil(rows / 2), prefetched (as _matmul_ggml_i8);
    with several activation rows (prefill) each block's heads are decoded once for all."""
    rows = raw.shape[0]
    m, nb = yd.shape
    half = (rows + 1) // 2
    for p in prange(half):
        r0, r1 = far_pair(p, half, rows)
        sc0 = np.zeros(16, np.int32)
        mn0 = np.zeros(16, np.int32)
        sc1 = np.zeros(16, np.int32)
        mn1 = np.zeros(16, np.int32)
        lanes = np.zeros(32, np.int32)
        acc = np.zeros(16 * m, np.float32)
        accm = np.zeros(8 * m, np.float32)
        for i in range(nb):
            o = i * bsz
            prefetch_at(raw[r0], o + PREFETCH_BYTES)
            prefetch_at(raw[r1], o + PREFETCH_BYTES)
            q0 = raw[r0, o:o + bsz]
            q1 = raw[r1, o:o + bsz]
            dw0, dmw0 = _k_head(q0, f16, sc0, mn0, kind)
            dw1, dmw1 = _k_head(q1, f16, sc1, mn1, kind)
            if m == 1:                       # constant offsets: a decode step's matvec
                _k_step(q0, yq[0], i, ybs[0], yd[0, i], dw0, dmw0, sc0, mn0, lanes, acc, 0, accm, 0, kind, vnni)
                _k_step(q1, yq[0], i, ybs[0], yd[0, i], dw1, dmw1, sc1, mn1, lanes, acc, 8, accm, 4, kind, vnni)
                continue
            # Q6_K: four activation rows per unpacked block, then the rest (Gemma's ffn_down with
            # 512 rows, two znver5 threads: 71-75 -> 94-100 GFLOP/s); Q4_K's unpack is a mask or a
            # shift per group, and the four-row tile made it slower (115-119 -> 86-100)
            m4 = m - m % 4 if kind == 6 else 0
            for a0 in range(0, m4, 4):
                _k_step4(q0, yq, ybs, yd, a0, 0, i, dw0, dmw0, sc0, mn0, lanes, acc, accm, kind, vnni)
                _k_step4(q1, yq, ybs, yd, a0, 1, i, dw1, dmw1, sc1, mn1, lanes, acc, accm, kind, vnni)
            for a in range(m4, m):
                _k_step(q0, yq[a], i, ybs[a], yd[a, i], dw0, dmw0, sc0, mn0, lanes, acc, 16 * a, accm, 8 * a,
                        kind, vnni)
                _k_step(q1, yq[a], i, ybs[a], yd[a, i], dw1, dmw1, sc1, mn1, lanes, acc, 16 * a + 8, accm,
                        8 * a + 4, kind, vnni)
        for a in range(m):
            for t in range(2):
                r = r0 if t == 0 else r1
                v = hsum8(acc[16 * a + 8 * t:16 * a + 8 * t + 8])
                e = 8 * a + 4 * t
                if kind == 4:
                    v += (accm[e] + accm[e + 2]) + (accm[e + 1] + accm[e + 3])
                elif kind == 5:
                    v += accm[e]
                out[a, r] = v


# K types with an integer ggml path -> _matmul_ggml_k_i8's ``kind``
_I8_KIND = {QT.Q2_K: 2, QT.Q3_K: 3, QT.Q4_K: 4, QT.Q5_K: 5, QT.Q6_K: 6}


def i8_variants(qtype: QT) -> tuple:
    """The integer dot-product variants ("vnni", "avx2") of ``qtype``'s ggml numerics
    (every K type)."""
    return ("vnni", "avx2") if qtype in _I8_KIND else ()


def _i8_kernel(qtype: QT, variant: str):
    """_matmul_ggml_k_i8 specialized for a K type and ``variant`` (the host must
    have its instructions); ValueError for a type or variant without an integer path."""
    qtype = QT(qtype)
    if variant not in i8_variants(qtype):
        raise ValueError(f"{qtype.name} has no {variant!r} integer path")
    name = f"_matmul_ggml_i8_{qtype.name.lower()}_{variant}"
    kind = _I8_KIND[qtype]
    return globals().get(name) or jit.specialize(
        globals(), name, "raw, yd, yq, ybs, out, f16",
        f"_matmul_ggml_k_i8(raw, yd, yq, ybs, out, f16, {BLOCK_BYTES[qtype]}, {kind}, {variant == 'vnni'})",
        parallel=True)


def i8_matmul_ggml(qtype: QT, variant: str):
    """The ggml-numerics wrapper ``matmul_ggml(raw, xq, out)`` of a K type on
    _matmul_ggml_k_i8 with the instructions of ``variant`` (the host must have them). Q3_K's
    sign trick needs Q8_K quants within +-127, which ggml's quantizer always makes: hand-made
    activation bytes holding -128 take the portable kernel."""
    mm = _i8_kernel(qtype, variant)
    signed = QT(qtype) == QT.Q3_K

    def matmul_ggml(raw, xq, out):
        yd, yq, ybs = split_q8_k(xq)
        if signed and yq.min(initial=0) == -128:
            PORTABLE_GGML[QT.Q3_K](raw, xq, out)
            return
        mm(raw, yd, yq, ybs, out, quants_legacy.F16_TO_F32)

    matmul_ggml.__name__ = matmul_ggml.__qualname__ = f"matmul_ggml_{QT(qtype).name.lower()}"
    return matmul_ggml


def i8_matvec_ggml(qtype: QT, variant: str):
    """``matvec_ggml(raw, x, out)`` of a K type: x float32[n] quantized to Q8_K as
    :func:`quantize_act_q8_k` does, without its byte form, then _matmul_ggml_k_i8."""
    mm = _i8_kernel(qtype, variant)

    def matvec_ggml(raw, x, out):
        mm(raw, *_q8_k_arrays(x.reshape(1, -1)), out.reshape(1, -1), quants_legacy.F16_TO_F32)

    matvec_ggml.__name__ = matvec_ggml.__qualname__ = f"matvec_ggml_{QT(qtype).name.lower()}"
    return matvec_ggml


# ------------------------------------------------------------------ per-type kernels: a driver with the type's decoder

# type: decoder (head, quad), bytes per block, elements per sub-block, ggml min lanes
# (0: the type has no min), ggml quant offset
_TYPES = {
    QT.Q2_K: ("_head_q2_k", "_quad_q2_k", 84, 16, 8, 0),
    QT.Q3_K: ("_head_q3_k", "_quad_q3_k", 110, 16, 0, 0),
    QT.Q4_K: ("_head_q4_k", "_quad_q4_k", 144, 32, 4, 0),
    QT.Q5_K: ("_head_q4_k", "_quad_q5_k", 176, 32, 1, 0),
    QT.Q6_K: ("_head_q6_k", "_quad_q6_k", 210, 16, 0, 32),
}


# the K types whose fp32 matvec runs each block as vector IR (_matvec_k's ``vblock``)
_VECTOR_IR = {QT.Q2_K: "_vblock_q2k", QT.Q3_K: "_vblock_q3k", QT.Q4_K: "_vblock_q4k", QT.Q5_K: "_vblock_q5k", QT.Q6_K: "_vblock_q6k"}
# the K types whose fp32 matvec lanes hold a sub-block's elements in _lane(b, True) order
PERMUTED_LANES = frozenset({QT.Q4_K, QT.Q5_K})
# the K types whose fp32 matvec forms each weight (d * scale) * q before its product with x
# (_matvec_k's ``wfirst``): Q4_K, whose step on AVX-512 takes the weights from tables
# (_emit_q4k_tables); the others multiply q * x first
WEIGHT_FIRST = frozenset({QT.Q4_K})
# the K types whose fp32 matvec decodes each block's head one block ahead (_matvec_q4k_ahead):
# Q4_K on AVX-512 hosts, with the table step
AHEAD = frozenset({QT.Q4_K}) if WIDE_STEPS else frozenset()


def _k_kernels(qtype: QT, head: str, quad: str, bsz: int, sub: int, nmin: int, off: int) -> TypeKernels:
    """A K type's kernels; ggml activations are Q8_K blocks."""
    dec = f"{head}, {quad}, {bsz}, {sub}"
    return quant_kernels(globals(), qtype, QT.Q8_K, _ggml_act,
                          f"_dequantize_k(raw, out, f16, {dec})",
                          f"_matvec_q4k_ahead(raw, raw1, raw2, x, out, f16, {bsz})" if qtype in AHEAD else
                          f"_matvec_k(raw, raw1, raw2, x, out, f16, {dec}, {nmin > 0}, "
                          f"{_VECTOR_IR.get(qtype, '_vblock_none')}, {qtype in PERMUTED_LANES}, "
                          f"{qtype in WEIGHT_FIRST})",
                          "yd, yf, ybs", f"_matmul_ggml_k(raw, yd, yf, ybs, out, f16, {dec}, {nmin}, np.float32({off}))")


KERNELS: dict[QT, TypeKernels] = {qt: _k_kernels(qt, *row) for qt, row in _TYPES.items()}
# the portable ggml-numerics kernel of each K type (_matmul_ggml_k); KERNELS takes the integer
# one where the host has its instructions
PORTABLE_GGML = {qt: k.matmul_ggml for qt, k in KERNELS.items()}
for _qt in KERNELS:
    if I8_DOT is not None and I8_DOT in i8_variants(_qt):
        KERNELS[_qt] = KERNELS[_qt]._replace(matmul_ggml=i8_matmul_ggml(_qt, I8_DOT),
                                             matvec_ggml=i8_matvec_ggml(_qt, I8_DOT))


# ------------------------------------------------------------------ NumPy references

def dequantize_reference(qtype: QT, raw: np.ndarray) -> np.ndarray:
    """Plain NumPy dequantization (gguf-py's): uint8[rows, row_bytes] -> float32[rows, n].
    Where gguf cannot be imported (the GPU machine's image has none) this module's own
    dequantization kernel stands in; tests/test_quants_k.py checks it bit for bit against
    gguf's."""
    try:
        from gguf.quants import dequantize
    except ImportError:
        qtype = QT(qtype)
        r = np.ascontiguousarray(raw, dtype=np.uint8)
        if r.ndim != 2 or r.shape[1] % type_size(qtype):
            raise ValueError(f"{qtype.name} rows must be uint8[rows, whole blocks of "
                             f"{type_size(qtype)} bytes], got shape {r.shape}") from None
        out = np.empty((r.shape[0], r.shape[1] // type_size(qtype) * QK_K), np.float32)
        r = r.view()
        r.flags.writeable = False            # the specialization the loaders compile
        KERNELS[qtype].dequantize(r, out)
        return out
    return dequantize(np.asarray(raw), qtype)


def matvec_reference(qtype: QT, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float64[rows]: dequantized weights @ x, accumulated in float64."""
    return dequantize_reference(qtype, raw).astype(np.float64) @ np.asarray(x, np.float64)


def matmul_ggml_reference(qtype: QT, raw: np.ndarray, xq: np.ndarray) -> np.ndarray:
    """float64[m, rows]: dequantized Q8_K activations @ dequantized weights.T, in float64.

    Equals ggml's result up to ggml's float32 rounding of the per-block scale
    products and accumulations.
    """
    w = dequantize_reference(qtype, raw).astype(np.float64)
    return dequantize_act_q8_k(xq).astype(np.float64) @ w.T
