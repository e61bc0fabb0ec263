"""K-quant kernels: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (256-element super-blocks).

Three kernels per type, all taking ``raw = uint8[rows, row_bytes]`` (one row =
``n // 256`` consecutive blocks):

``dequantize_<type>(raw, out)``
    ``out = float32[rows, n]``, bit-identical to ``gguf.quants.dequantize``
    (same float32 operations in the same order).
``matvec_<type>(raw, x, out)``
    fp32 numerics, ``out[r] = sum_j w[r, j] * x[j]`` with ``x = float32[n]``,
    ``out = float32[rows]``; parallel over rows. Reads the quantized bytes
    directly (the fp32 matrix never exists). Per sub-block the factors
    ``d * scale`` and ``dmin * min`` are formed once; the min term is applied
    once per sub-block through precomputed sums of ``x``; the inner loop
    decodes 32 quants and adds ``(d * scale) * (q * x)`` into 32 lane
    accumulators, summed once per row (cheaper in Numba than a horizontal
    reduction per sub-block).
``matmul_ggml_<type>(raw, xq, out)``
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
    bit for bit.

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
from gguf import GGMLQuantizationType
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic

from . import jit
from .ggml_types import TypeKernels

jit.kernel_module(__file__)

QT = GGMLQuantizationType
QK_K = 256
Q8_K_BYTES = 292  # float32 d + int8 qs[256] + int16 bsums[16]

BLOCK_BYTES = {QT.Q2_K: 84, QT.Q3_K: 110, QT.Q4_K: 144, QT.Q5_K: 176, QT.Q6_K: 210}

# fp16 bit pattern -> float32 value, passed to every kernel
F16_TABLE = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)


# ------------------------------------------------------------------ helpers

@intrinsic
def _fma_f32(typingctx, a, b, c):
    """float32 fused multiply-add a * b + c with one rounding (llvm.fma.f32)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        flt = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [flt], ir.FunctionType(flt, [flt, flt, flt]))
        return builder.call(fn, args)

    return sig, codegen


@jit.njit(inline="always")
def _f16(tab, q, o):
    """fp16 stored little endian at q[o], q[o+1] -> float32."""
    return tab[np.int64(q[o]) | (np.int64(q[o + 1]) << 8)]


@jit.njit(inline="always")
def _i8(v):
    """uint8 value -> its int8 reading, as int64."""
    return np.int64(v) - ((np.int64(v) & 128) << 1)


@jit.njit(inline="always")
def _scale_min_k4(q, o, s):
    """Q4_K/Q5_K 6-bit (scale, min) of sub-block s from the 12 bytes at q[o]."""
    if s < 4:
        sc = np.int64(q[o + s]) & 63
        mn = np.int64(q[o + s + 4]) & 63
    else:
        sc = (np.int64(q[o + s + 4]) & 15) | ((np.int64(q[o + s - 4]) >> 6) << 4)
        mn = (np.int64(q[o + s + 4]) >> 4) | ((np.int64(q[o + s]) >> 6) << 4)
    return sc, mn


@jit.njit(inline="always")
def _scale_q3_k(q, o, s):
    """Q3_K signed scale (-32..31) of sub-block s from the 12 bytes at q[o]."""
    lo = (np.int64(q[o + (s & 7)]) >> (4 * (s >> 3))) & 15
    hi = (np.int64(q[o + 8 + (s & 3)]) >> (2 * (s >> 2))) & 3
    return (lo | (hi << 4)) - 32


@jit.njit(inline="always")
def _hsum8(a):
    """Horizontal sum of 8 float32 lanes in ggml's hsum_float_8 order."""
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))


@jit.njit(inline="always")
def _block_lanes(w, y, tmp, lanes):
    """Exact lane sums of one block: lanes[k] = sum of w[e] * y[e] over (e % 32) // 4 == k.

    w float32[256] (scale * quant), y float32[256] (Q8_K quants), tmp float32[32]
    scratch, lanes float64[8] out. Every product is an integer below 2**24 in
    magnitude and so is every partial sum of the 8 products per tmp entry
    (worst case Q6_K: 8 * 128 * 63 * 127 < 2**23), so the float32 arithmetic is
    exact; the 4-term lane sums are exact in float64.
    """
    for b in range(32):
        tmp[b] = (((w[b] * y[b] + w[32 + b] * y[32 + b]) + (w[64 + b] * y[64 + b] + w[96 + b] * y[96 + b]))
                  + ((w[128 + b] * y[128 + b] + w[160 + b] * y[160 + b])
                     + (w[192 + b] * y[192 + b] + w[224 + b] * y[224 + b])))
    for k in range(8):
        lanes[k] = ((np.float64(tmp[4 * k]) + np.float64(tmp[4 * k + 1]))
                    + (np.float64(tmp[4 * k + 2]) + np.float64(tmp[4 * k + 3])))


@jit.njit
def _xsums(x, width):
    """float32 sums of x over consecutive groups of ``width`` elements (for the min terms)."""
    ng = x.shape[0] // width
    s = np.empty(ng, np.float32)
    for t in range(ng):
        acc = np.float32(0.0)
        for b in range(width):
            acc += x[width * t + b]
        s[t] = acc
    return s


# ------------------------------------------------------------------ Q8_K activations

@jit.njit(parallel=True)
def _quantize_q8_k(x, d, qs, bsums):
    """x float32[m, n] -> d float32[m, nb], qs int8[m, nb*256], bsums int16[m, nb*16].

    ggml's quantize_row_q8_K (the x86 build uses the reference code): the value
    of largest magnitude (first one on ties) maps to -127, iscale = -127 / max,
    q = min(127, round_half_even(iscale * x)), d = 1 / iscale.
    """
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


def quantize_act_q8_k(x: np.ndarray) -> np.ndarray:
    """Activations float32[m, n] (n % 256 == 0) -> Q8_K blocks uint8[m, n // 256 * 292]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    m, n = x.shape
    if n % QK_K:
        raise ValueError(f"row length {n} is not a multiple of {QK_K}")
    nb = n // QK_K
    d = np.empty((m, nb), np.float32)
    qs = np.empty((m, nb * QK_K), np.int8)
    bsums = np.empty((m, nb * 16), np.int16)
    _quantize_q8_k(x, d, qs, bsums)
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


# ------------------------------------------------------------------ Q2_K

@jit.njit(parallel=True)
def _dequantize_q2_k(raw, out, f16):
    rows = raw.shape[0]
    nb = raw.shape[1] // 84
    for r in prange(rows):
        q = raw[r]
        o = out[r]
        for i in range(nb):
            bo = i * 84
            d = _f16(f16, q, bo + 80)
            dmin = _f16(f16, q, bo + 82)
            for j in range(2):
                for l in range(4):
                    for h in range(2):
                        s = 8 * j + 2 * l + h
                        sc = np.int64(q[bo + s])
                        dl = d * np.float32(sc & 15)
                        ml = dmin * np.float32(sc >> 4)
                        for b in range(16 * h, 16 * h + 16):
                            v = (np.int64(q[bo + 16 + 32 * j + b]) >> (2 * l)) & 3
                            o[i * QK_K + 128 * j + 32 * l + b] = dl * np.float32(v) - ml


@jit.njit(parallel=True)
def _matvec_q2_k(raw, x, out, f16):
    rows = raw.shape[0]
    nb = raw.shape[1] // 84
    xs = _xsums(x, 16)
    for r in prange(rows):
        q = raw[r]
        acc = np.zeros(32, np.float32)
        accm = np.float32(0.0)
        for i in range(nb):
            bo = i * 84
            d = _f16(f16, q, bo + 80)
            dmin = _f16(f16, q, bo + 82)
            for s in range(16):
                accm += (dmin * np.float32(np.int64(q[bo + s]) >> 4)) * xs[16 * i + s]
            for j in range(2):
                qo = bo + 16 + 32 * j
                xo = i * QK_K + 128 * j
                for h in range(2):
                    # sub-block of element 128*j + 32*l + b (b in this half) is 8*j + 2*l + h
                    so = bo + 8 * j + h
                    a0 = d * np.float32(np.int64(q[so]) & 15)
                    a1 = d * np.float32(np.int64(q[so + 2]) & 15)
                    a2 = d * np.float32(np.int64(q[so + 4]) & 15)
                    a3 = d * np.float32(np.int64(q[so + 6]) & 15)
                    for b in range(16 * h, 16 * h + 16):
                        v = q[qo + b]
                        acc[b] += (a0 * (np.float32(np.uint8(v & 3)) * x[xo + b])
                                   + a1 * (np.float32(np.uint8((v >> 2) & 3)) * x[xo + 32 + b])
                                   + a2 * (np.float32(np.uint8((v >> 4) & 3)) * x[xo + 64 + b])
                                   + a3 * (np.float32(np.uint8(v >> 6)) * x[xo + 96 + b]))
        t = np.float32(0.0)
        for b in range(32):
            t += acc[b]
        out[r] = t - accm


@jit.njit(parallel=True)
def _matmul_ggml_q2_k(raw, yd, yf, ybs, out, f16):
    rows = raw.shape[0]
    m, nb = yd.shape
    for r in prange(rows):
        q = raw[r]
        acc = np.zeros((m, 8), np.float32)
        w = np.empty(QK_K, np.float32)
        mins = np.empty(16, np.int64)
        tmp = np.empty(32, np.float32)
        lanes = np.empty(8, np.float64)
        for i in range(nb):
            bo = i * 84
            dw = _f16(f16, q, bo + 80)
            dmw = _f16(f16, q, bo + 82)
            for s in range(16):
                mins[s] = np.int64(q[bo + s]) >> 4
            for j in range(2):
                qs = q[bo + 16 + 32 * j:bo + 48 + 32 * j]
                wj = w[128 * j:128 * j + 128]
                for h in range(2):
                    so = bo + 8 * j + h
                    a0 = np.float32(np.int64(q[so]) & 15)
                    a1 = np.float32(np.int64(q[so + 2]) & 15)
                    a2 = np.float32(np.int64(q[so + 4]) & 15)
                    a3 = np.float32(np.int64(q[so + 6]) & 15)
                    for b in range(16 * h, 16 * h + 16):
                        v = qs[b]
                        wj[b] = a0 * np.float32(np.uint8(v & 3))
                        wj[32 + b] = a1 * np.float32(np.uint8((v >> 2) & 3))
                        wj[64 + b] = a2 * np.float32(np.uint8((v >> 4) & 3))
                        wj[96 + b] = a3 * np.float32(np.uint8(v >> 6))
            for a in range(m):
                dy = yd[a, i]
                d = dy * dw
                dmin = (-dy) * dmw
                bs = ybs[a, 16 * i:16 * i + 16]
                _block_lanes(w, yf[a, i * QK_K:(i + 1) * QK_K], tmp, lanes)
                for k in range(8):
                    # mins first (lane k = sub-blocks 2k, 2k+1), then the scaled quants
                    pm = mins[2 * k] * np.int64(bs[2 * k]) + mins[2 * k + 1] * np.int64(bs[2 * k + 1])
                    acc[a, k] = _fma_f32(dmin, np.float32(pm), acc[a, k])
                    acc[a, k] = _fma_f32(d, np.float32(lanes[k]), acc[a, k])
        for a in range(m):
            out[a, r] = _hsum8(acc[a])


# ------------------------------------------------------------------ Q3_K

@jit.njit(parallel=True)
def _dequantize_q3_k(raw, out, f16):
    rows = raw.shape[0]
    nb = raw.shape[1] // 110
    for r in prange(rows):
        q = raw[r]
        o = out[r]
        for i in range(nb):
            bo = i * 110
            d = _f16(f16, q, bo + 108)
            for j in range(2):
                for l in range(4):
                    bit = 4 * j + l
                    for h in range(2):
                        s = 8 * j + 2 * l + h
                        dl = d * np.float32(_scale_q3_k(q, bo + 96, s))
                        for b in range(16 * h, 16 * h + 16):
                            lo = (np.int64(q[bo + 32 + 32 * j + b]) >> (2 * l)) & 3
                            hb = (np.int64(q[bo + b]) >> bit) & 1
                            v = lo - ((hb ^ 1) << 2)
                            o[i * QK_K + 128 * j + 32 * l + b] = dl * np.float32(v)


@jit.njit(parallel=True)
def _matvec_q3_k(raw, x, out, f16):
    rows = raw.shape[0]
    nb = raw.shape[1] // 110
    for r in prange(rows):
        q = raw[r]
        acc = np.zeros(32, np.float32)
        for i in range(nb):
            bo = i * 110
            d = _f16(f16, q, bo + 108)
            for j in range(2):
                qo = bo + 32 + 32 * j
                xo = i * QK_K + 128 * j
                mk0 = np.uint8(1 << (4 * j))     # hmask bit of l = 0..3
                mk1 = np.uint8(2 << (4 * j))
                mk2 = np.uint8(4 << (4 * j))
                mk3 = np.uint8(8 << (4 * j))
                for h in range(2):
                    s = 8 * j + h
                    a0 = d * np.float32(_scale_q3_k(q, bo + 96, s))
                    a1 = d * np.float32(_scale_q3_k(q, bo + 96, s + 2))
                    a2 = d * np.float32(_scale_q3_k(q, bo + 96, s + 4))
                    a3 = d * np.float32(_scale_q3_k(q, bo + 96, s + 6))
                    for b in range(16 * h, 16 * h + 16):
                        v = q[qo + b]
                        hb = q[bo + b]
                        q0 = np.int8((v & 3) - (0 if hb & mk0 else 4))
                        q1 = np.int8(((v >> 2) & 3) - (0 if hb & mk1 else 4))
                        q2 = np.int8(((v >> 4) & 3) - (0 if hb & mk2 else 4))
                        q3 = np.int8((v >> 6) - (0 if hb & mk3 else 4))
                        acc[b] += (a0 * (np.float32(q0) * x[xo + b])
                                   + a1 * (np.float32(q1) * x[xo + 32 + b])
                                   + a2 * (np.float32(q2) * x[xo + 64 + b])
                                   + a3 * (np.float32(q3) * x[xo + 96 + b]))
        t = np.float32(0.0)
        for b in range(32):
            t += acc[b]
        out[r] = t


@jit.njit(parallel=True)
def _matmul_ggml_q3_k(raw, yd, yf, ybs, out, f16):
    rows = raw.shape[0]
    m, nb = yd.shape
    for r in prange(rows):
        q = raw[r]
        acc = np.zeros((m, 8), np.float32)
        w = np.empty(QK_K, np.float32)
        tmp = np.empty(32, np.float32)
        lanes = np.empty(8, np.float64)
        for i in range(nb):
            bo = i * 110
            dw = _f16(f16, q, bo + 108)
            hm = q[bo:bo + 32]
            for j in range(2):
                qs = q[bo + 32 + 32 * j:bo + 64 + 32 * j]
                wj = w[128 * j:128 * j + 128]
                mk0 = np.uint8(1 << (4 * j))
                mk1 = np.uint8(2 << (4 * j))
                mk2 = np.uint8(4 << (4 * j))
                mk3 = np.uint8(8 << (4 * j))
                for h in range(2):
                    s = 8 * j + h
                    a0 = np.float32(_scale_q3_k(q, bo + 96, s))
                    a1 = np.float32(_scale_q3_k(q, bo + 96, s + 2))
                    a2 = np.float32(_scale_q3_k(q, bo + 96, s + 4))
                    a3 = np.float32(_scale_q3_k(q, bo + 96, s + 6))
                    for b in range(16 * h, 16 * h + 16):
                        v = qs[b]
                        hb = hm[b]
                        wj[b] = a0 * np.float32(np.int8((v & 3) - (0 if hb & mk0 else 4)))
                        wj[32 + b] = a1 * np.float32(np.int8(((v >> 2) & 3) - (0 if hb & mk1 else 4)))
                        wj[64 + b] = a2 * np.float32(np.int8(((v >> 4) & 3) - (0 if hb & mk2 else 4)))
                        wj[96 + b] = a3 * np.float32(np.int8((v >> 6) - (0 if hb & mk3 else 4)))
            for a in range(m):
                d = yd[a, i] * dw
                _block_lanes(w, yf[a, i * QK_K:(i + 1) * QK_K], tmp, lanes)
                for k in range(8):
                    acc[a, k] = _fma_f32(d, np.float32(lanes[k]), acc[a, k])
        for a in range(m):
            out[a, r] = _hsum8(acc[a])


# ------------------------------------------------------------------ Q4_K

@jit.njit(parallel=True)
def _dequantize_q4_k(raw, out, f16):
    rows = raw.shape[0]
    nb = raw.shape[1] // 144
    for r in prange(rows):
        q = raw[r]
        o = out[r]
        for i in range(nb):
            bo = i * 144
            d = _f16(f16, q, bo)
            dmin = _f16(f16, q, bo + 2)
            for j in range(4):
                sc0, m0 = _scale_min_k4(q, bo + 4, 2 * j)
                sc1, m1 = _scale_min_k4(q, bo + 4, 2 * j + 1)
                d0 = d * np.float32(sc0)
                dm0 = dmin * np.float32(m0)
                d1 = d * np.float32(sc1)
                dm1 = dmin * np.float32(m1)
                qo = bo + 16 + 32 * j
                xo = i * QK_K + 64 * j
                for b in range(32):
                    v = np.int64(q[qo + b])
                    o[xo + b] = d0 * np.float32(v & 15) - dm0
                    o[xo + 32 + b] = d1 * np.float32(v >> 4) - dm1


@jit.njit(parallel=True)
def _matvec_q4_k(raw, x, out, f16):
    rows = raw.shape[0]
    nb = raw.shape[1] // 144
    xs = _xsums(x, 32)
    for r in prange(rows):
        q = raw[r]
        acc = np.zeros(32, np.float32)
        accm = np.float32(0.0)
        for i in range(nb):
            bo = i * 144
            d = _f16(f16, q, bo)
            dmin = _f16(f16, q, bo + 2)
            for j in range(4):
                sc0, m0 = _scale_min_k4(q, bo + 4, 2 * j)
                sc1, m1 = _scale_min_k4(q, bo + 4, 2 * j + 1)
                d0 = d * np.float32(sc0)
                d1 = d * np.float32(sc1)
                accm += ((dmin * np.float32(m0)) * xs[8 * i + 2 * j]
                         + (dmin * np.float32(m1)) * xs[8 * i + 2 * j + 1])
                qo = bo + 16 + 32 * j
                xo = i * QK_K + 64 * j
                for b in range(32):
                    # nibbles split in float32 (exact for 0..255; vectorizes better than int64 ops)
                    fv = np.float32(q[qo + b])
                    hi = np.floor(fv * np.float32(0.0625))
                    lo = fv - np.float32(16.0) * hi
                    acc[b] += d0 * (lo * x[xo + b]) + d1 * (hi * x[xo + 32 + b])
        t = np.float32(0.0)
        for b in range(32):
            t += acc[b]
        out[r] = t - accm


@jit.njit(parallel=True)
def _matmul_ggml_q4_k(raw, yd, yf, ybs, out, f16):
    rows = raw.shape[0]
    m, nb = yd.shape
    for r in prange(rows):
        q = raw[r]
        acc = np.zeros((m, 8), np.float32)
        accm = np.zeros((m, 4), np.float32)
        w = np.empty(QK_K, np.float32)
        mins = np.empty(8, np.int64)
        tmp = np.empty(32, np.float32)
        lanes = np.empty(8, np.float64)
        for i in range(nb):
            bo = i * 144
            dw = _f16(f16, q, bo)
            dmw = _f16(f16, q, bo + 2)
            for j in range(4):
                sc0, m0 = _scale_min_k4(q, bo + 4, 2 * j)
                sc1, m1 = _scale_min_k4(q, bo + 4, 2 * j + 1)
                mins[2 * j] = m0
                mins[2 * j + 1] = m1
                s0 = np.float32(sc0)
                s1 = np.float32(sc1)
                qs = q[bo + 16 + 32 * j:bo + 48 + 32 * j]
                wj = w[64 * j:64 * j + 64]
                for b in range(32):
                    fv = np.float32(qs[b])
                    hi = np.floor(fv * np.float32(0.0625))
                    wj[b] = s0 * (fv - np.float32(16.0) * hi)
                    wj[32 + b] = s1 * hi
            for a in range(m):
                dy = yd[a, i]
                d = dy * dw
                dmin = (-dy) * dmw
                bs = ybs[a, 16 * i:16 * i + 16]
                # mins: 4 lanes, lane k = 32-element sub-blocks 2k, 2k+1 (bsums added in pairs)
                for k in range(4):
                    pm = (mins[2 * k] * (np.int64(bs[4 * k]) + np.int64(bs[4 * k + 1]))
                          + mins[2 * k + 1] * (np.int64(bs[4 * k + 2]) + np.int64(bs[4 * k + 3])))
                    accm[a, k] = _fma_f32(dmin, np.float32(pm), accm[a, k])
                _block_lanes(w, yf[a, i * QK_K:(i + 1) * QK_K], tmp, lanes)
                for k in range(8):
                    acc[a, k] = _fma_f32(d, np.float32(lanes[k]), acc[a, k])
        for a in range(m):
            out[a, r] = _hsum8(acc[a]) + ((accm[a, 0] + accm[a, 2]) + (accm[a, 1] + accm[a, 3]))


# ------------------------------------------------------------------ Q5_K

@jit.njit(parallel=True)
def _dequantize_q5_k(raw, out, f16):
    rows = raw.shape[0]
    nb = raw.shape[1] // 176
    for r in prange(rows):
        q = raw[r]
        o = out[r]
        for i in range(nb):
            bo = i * 176
            d = _f16(f16, q, bo)
            dmin = _f16(f16, q, bo + 2)
            for j in range(4):
                sc0, m0 = _scale_min_k4(q, bo + 4, 2 * j)
                sc1, m1 = _scale_min_k4(q, bo + 4, 2 * j + 1)
                d0 = d * np.float32(sc0)
                dm0 = dmin * np.float32(m0)
                d1 = d * np.float32(sc1)
                dm1 = dmin * np.float32(m1)
                qo = bo + 48 + 32 * j
                xo = i * QK_K + 64 * j
                for b in range(32):
                    v = np.int64(q[qo + b])
                    hb = np.int64(q[bo + 16 + b]) >> (2 * j)
                    o[xo + b] = d0 * np.float32((v & 15) | ((hb & 1) << 4)) - dm0
                    o[xo + 32 + b] = d1 * np.float32((v >> 4) | ((hb & 2) << 3)) - dm1


@jit.njit(parallel=True)
def _matvec_q5_k(raw, x, out, f16):
    rows = raw.shape[0]
    nb = raw.shape[1] // 176
    xs = _xsums(x, 32)
    for r in prange(rows):
        q = raw[r]
        acc = np.zeros(32, np.float32)
        accm = np.float32(0.0)
        for i in range(nb):
            bo = i * 176
            d = _f16(f16, q, bo)
            dmin = _f16(f16, q, bo + 2)
            for j in range(4):
                sc0, m0 = _scale_min_k4(q, bo + 4, 2 * j)
                sc1, m1 = _scale_min_k4(q, bo + 4, 2 * j + 1)
                d0 = d * np.float32(sc0)
                d1 = d * np.float32(sc1)
                accm += ((dmin * np.float32(m0)) * xs[8 * i + 2 * j]
                         + (dmin * np.float32(m1)) * xs[8 * i + 2 * j + 1])
                qo = bo + 48 + 32 * j
                xo = i * QK_K + 64 * j
                mk0 = np.uint8(1 << (2 * j))     # qh bit of sub-block 2j
                mk1 = np.uint8(2 << (2 * j))     # qh bit of sub-block 2j + 1
                for b in range(32):
                    v = q[qo + b]
                    hb = q[bo + 16 + b]
                    q0 = np.uint8((v & 15) | (16 if hb & mk0 else 0))
                    q1 = np.uint8((v >> 4) | (16 if hb & mk1 else 0))
                    acc[b] += d0 * (np.float32(q0) * x[xo + b]) + d1 * (np.float32(q1) * x[xo + 32 + b])
        t = np.float32(0.0)
        for b in range(32):
            t += acc[b]
        out[r] = t - accm


@jit.njit(parallel=True)
def _matmul_ggml_q5_k(raw, yd, yf, ybs, out, f16):
    rows = raw.shape[0]
    m, nb = yd.shape
    for r in prange(rows):
        q = raw[r]
        acc = np.zeros((m, 8), np.float32)
        summs = np.zeros(m, np.float32)
        w = np.empty(QK_K, np.float32)
        mins = np.empty(8, np.int64)
        tmp = np.empty(32, np.float32)
        lanes = np.empty(8, np.float64)
        for i in range(nb):
            bo = i * 176
            dw = _f16(f16, q, bo)
            dmw = _f16(f16, q, bo + 2)
            qh = q[bo + 16:bo + 48]
            for j in range(4):
                sc0, m0 = _scale_min_k4(q, bo + 4, 2 * j)
                sc1, m1 = _scale_min_k4(q, bo + 4, 2 * j + 1)
                mins[2 * j] = m0
                mins[2 * j + 1] = m1
                s0 = np.float32(sc0)
                s1 = np.float32(sc1)
                mk0 = np.uint8(1 << (2 * j))
                mk1 = np.uint8(2 << (2 * j))
                qs = q[bo + 48 + 32 * j:bo + 80 + 32 * j]
                wj = w[64 * j:64 * j + 64]
                for b in range(32):
                    v = qs[b]
                    hb = qh[b]
                    wj[b] = s0 * np.float32(np.uint8((v & 15) | (16 if hb & mk0 else 0)))
                    wj[32 + b] = s1 * np.float32(np.uint8((v >> 4) | (16 if hb & mk1 else 0)))
            for a in range(m):
                dy = yd[a, i]
                d = dy * dw
                dmin = (-dy) * dmw
                bs = ybs[a, 16 * i:16 * i + 16]
                # mins: one integer sum per block, then summs = fma(dmin, float(sum), summs)
                pm = 0
                for s in range(8):
                    pm += mins[s] * (np.int64(bs[2 * s]) + np.int64(bs[2 * s + 1]))
                summs[a] = _fma_f32(dmin, np.float32(pm), summs[a])
                _block_lanes(w, yf[a, i * QK_K:(i + 1) * QK_K], tmp, lanes)
                for k in range(8):
                    acc[a, k] = _fma_f32(d, np.float32(lanes[k]), acc[a, k])
        for a in range(m):
            out[a, r] = _hsum8(acc[a]) + summs[a]


# ------------------------------------------------------------------ Q6_K

@jit.njit(parallel=True)
def _dequantize_q6_k(raw, out, f16):
    rows = raw.shape[0]
    nb = raw.shape[1] // 210
    for r in prange(rows):
        q = raw[r]
        o = out[r]
        for i in range(nb):
            bo = i * 210
            d = _f16(f16, q, bo + 208)
            for j in range(2):
                for l in range(4):
                    lo_o = bo + 64 * j + 32 * (l & 1)
                    lo_sh = 4 * (l >> 1)
                    for h in range(2):
                        s = 8 * j + 2 * l + h
                        dl = d * np.float32(_i8(q[bo + 192 + s]))
                        for b in range(16 * h, 16 * h + 16):
                            lo = (np.int64(q[lo_o + b]) >> lo_sh) & 15
                            hi = (np.int64(q[bo + 128 + 32 * j + b]) >> (2 * l)) & 3
                            o[i * QK_K + 128 * j + 32 * l + b] = dl * np.float32((lo | (hi << 4)) - 32)


@jit.njit(parallel=True)
def _matvec_q6_k(raw, x, out, f16):
    rows = raw.shape[0]
    nb = raw.shape[1] // 210
    for r in prange(rows):
        q = raw[r]
        acc = np.zeros(32, np.float32)
        ds = np.empty(8, np.float32)
        for i in range(nb):
            bo = i * 210
            d = _f16(f16, q, bo + 208)
            for j in range(2):
                so = bo + 192 + 8 * j
                for t in range(8):
                    ds[t] = d * np.float32(_i8(q[so + t]))
                qo = bo + 64 * j
                ho = bo + 128 + 32 * j
                xo = i * QK_K + 128 * j
                for h in range(2):
                    a0 = ds[h]
                    a1 = ds[2 + h]
                    a2 = ds[4 + h]
                    a3 = ds[6 + h]
                    for b in range(16 * h, 16 * h + 16):
                        v0 = q[qo + b]
                        v1 = q[qo + 32 + b]
                        hb = q[ho + b]
                        # truncating to int8 keeps the vectorized integer work 8 bits wide
                        q0 = np.int8(((v0 & 15) | ((hb & 3) << 4)) - 32)
                        q1 = np.int8(((v1 & 15) | ((hb & 12) << 2)) - 32)
                        q2 = np.int8(((v0 >> 4) | (hb & 48)) - 32)
                        q3 = np.int8(((v1 >> 4) | ((hb & 192) >> 2)) - 32)
                        acc[b] += (a0 * (np.float32(q0) * x[xo + b])
                                   + a1 * (np.float32(q1) * x[xo + 32 + b])
                                   + a2 * (np.float32(q2) * x[xo + 64 + b])
                                   + a3 * (np.float32(q3) * x[xo + 96 + b]))
        t = np.float32(0.0)
        for b in range(32):
            t += acc[b]
        out[r] = t


@jit.njit(parallel=True)
def _matmul_ggml_q6_k(raw, yd, yf, ybs, out, f16):
    rows = raw.shape[0]
    m, nb = yd.shape
    for r in prange(rows):
        q = raw[r]
        acc = np.zeros((m, 8), np.float32)
        w = np.empty(QK_K, np.float32)
        sc = np.empty(16, np.int64)
        tmp = np.empty(32, np.float32)
        lanes = np.empty(8, np.float64)
        for i in range(nb):
            bo = i * 210
            dw = _f16(f16, q, bo + 208)
            for s in range(16):
                sc[s] = _i8(q[bo + 192 + s])
            # unsigned 6-bit quants times scale; the -32 offset goes through bsums below
            for j in range(2):
                ql = q[bo + 64 * j:bo + 64 * j + 64]
                qh = q[bo + 128 + 32 * j:bo + 160 + 32 * j]
                wj = w[128 * j:128 * j + 128]
                for h in range(2):
                    a0 = np.float32(sc[8 * j + h])
                    a1 = np.float32(sc[8 * j + 2 + h])
                    a2 = np.float32(sc[8 * j + 4 + h])
                    a3 = np.float32(sc[8 * j + 6 + h])
                    for b in range(16 * h, 16 * h + 16):
                        v0 = ql[b]
                        v1 = ql[32 + b]
                        hb = qh[b]
                        wj[b] = a0 * np.float32(np.uint8((v0 & 15) | ((hb & 3) << 4)))
                        wj[32 + b] = a1 * np.float32(np.uint8((v1 & 15) | ((hb & 12) << 2)))
                        wj[64 + b] = a2 * np.float32(np.uint8((v0 >> 4) | (hb & 48)))
                        wj[96 + b] = a3 * np.float32(np.uint8((v1 >> 4) | ((hb & 192) >> 2)))
            for a in range(m):
                d = yd[a, i] * dw
                bs = ybs[a, 16 * i:16 * i + 16]
                _block_lanes(w, yf[a, i * QK_K:(i + 1) * QK_K], tmp, lanes)
                for k in range(8):
                    # lane k's offset term uses the bsums of sub-blocks 2k, 2k+1 (exact in float64)
                    sub = 32 * (np.int64(bs[2 * k]) * sc[2 * k] + np.int64(bs[2 * k + 1]) * sc[2 * k + 1])
                    acc[a, k] = _fma_f32(d, np.float32(lanes[k] - np.float64(sub)), acc[a, k])
        for a in range(m):
            out[a, r] = _hsum8(acc[a])


# ------------------------------------------------------------------ public wrappers

def dequantize_q2_k(raw: np.ndarray, out: np.ndarray) -> None:
    """Q2_K uint8[rows, n/256*84] -> out float32[rows, n]."""
    _dequantize_q2_k(raw, out, F16_TABLE)


def dequantize_q3_k(raw: np.ndarray, out: np.ndarray) -> None:
    """Q3_K uint8[rows, n/256*110] -> out float32[rows, n]."""
    _dequantize_q3_k(raw, out, F16_TABLE)


def dequantize_q4_k(raw: np.ndarray, out: np.ndarray) -> None:
    """Q4_K uint8[rows, n/256*144] -> out float32[rows, n]."""
    _dequantize_q4_k(raw, out, F16_TABLE)


def dequantize_q5_k(raw: np.ndarray, out: np.ndarray) -> None:
    """Q5_K uint8[rows, n/256*176] -> out float32[rows, n]."""
    _dequantize_q5_k(raw, out, F16_TABLE)


def dequantize_q6_k(raw: np.ndarray, out: np.ndarray) -> None:
    """Q6_K uint8[rows, n/256*210] -> out float32[rows, n]."""
    _dequantize_q6_k(raw, out, F16_TABLE)


def matvec_q2_k(raw: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out float32[rows] = Q2_K weights @ x float32[n], fp32 numerics."""
    _matvec_q2_k(raw, x, out, F16_TABLE)


def matvec_q3_k(raw: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out float32[rows] = Q3_K weights @ x float32[n], fp32 numerics."""
    _matvec_q3_k(raw, x, out, F16_TABLE)


def matvec_q4_k(raw: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out float32[rows] = Q4_K weights @ x float32[n], fp32 numerics."""
    _matvec_q4_k(raw, x, out, F16_TABLE)


def matvec_q5_k(raw: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out float32[rows] = Q5_K weights @ x float32[n], fp32 numerics."""
    _matvec_q5_k(raw, x, out, F16_TABLE)


def matvec_q6_k(raw: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out float32[rows] = Q6_K weights @ x float32[n], fp32 numerics."""
    _matvec_q6_k(raw, x, out, F16_TABLE)


def matmul_ggml_q2_k(raw: np.ndarray, xq: np.ndarray, out: np.ndarray) -> None:
    """out float32[m, rows] = Q8_K activations xq uint8[m, n/256*292] @ Q2_K weights.T, ggml numerics."""
    _matmul_ggml_q2_k(raw, *_ggml_act(xq), out, F16_TABLE)


def matmul_ggml_q3_k(raw: np.ndarray, xq: np.ndarray, out: np.ndarray) -> None:
    """out float32[m, rows] = Q8_K activations xq uint8[m, n/256*292] @ Q3_K weights.T, ggml numerics."""
    _matmul_ggml_q3_k(raw, *_ggml_act(xq), out, F16_TABLE)


def matmul_ggml_q4_k(raw: np.ndarray, xq: np.ndarray, out: np.ndarray) -> None:
    """out float32[m, rows] = Q8_K activations xq uint8[m, n/256*292] @ Q4_K weights.T, ggml numerics."""
    _matmul_ggml_q4_k(raw, *_ggml_act(xq), out, F16_TABLE)


def matmul_ggml_q5_k(raw: np.ndarray, xq: np.ndarray, out: np.ndarray) -> None:
    """out float32[m, rows] = Q8_K activations xq uint8[m, n/256*292] @ Q5_K weights.T, ggml numerics."""
    _matmul_ggml_q5_k(raw, *_ggml_act(xq), out, F16_TABLE)


def matmul_ggml_q6_k(raw: np.ndarray, xq: np.ndarray, out: np.ndarray) -> None:
    """out float32[m, rows] = Q8_K activations xq uint8[m, n/256*292] @ Q6_K weights.T, ggml numerics."""
    _matmul_ggml_q6_k(raw, *_ggml_act(xq), out, F16_TABLE)


KERNELS: dict[QT, TypeKernels] = {
    QT.Q2_K: TypeKernels(dequantize_q2_k, matvec_q2_k, QT.Q8_K, matmul_ggml_q2_k),
    QT.Q3_K: TypeKernels(dequantize_q3_k, matvec_q3_k, QT.Q8_K, matmul_ggml_q3_k),
    QT.Q4_K: TypeKernels(dequantize_q4_k, matvec_q4_k, QT.Q8_K, matmul_ggml_q4_k),
    QT.Q5_K: TypeKernels(dequantize_q5_k, matvec_q5_k, QT.Q8_K, matmul_ggml_q5_k),
    QT.Q6_K: TypeKernels(dequantize_q6_k, matvec_q6_k, QT.Q8_K, matmul_ggml_q6_k),
}


# ------------------------------------------------------------------ NumPy references

def dequantize_reference(qtype: QT, raw: np.ndarray) -> np.ndarray:
    """Plain NumPy dequantization (gguf-py): uint8[rows, row_bytes] -> float32[rows, n]."""
    from gguf.quants import dequantize
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
