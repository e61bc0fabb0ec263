"""Weight kernels of the GPU path: matvec (decode), matmul (prefill), get_rows (embeddings).

Weights stay on the device in their stored ggml block format: ``raw`` is
``uint8[n_out, row_bytes]``, the rows of ``loaders.gguf_file.QTensor.raw``. Each type has one
decoder ``_w_<type>(raw, r, e)``, the only code that knows its byte layout (the layouts are
spelled out in ``loaders/quants_legacy.py`` and ``loaders/quants_k.py``): the float32 weight
at element e of row r, bit-identical to ``gguf.quants.dequantize``: the same float32
operations in the same order, and a product that the reference rounds before an add or
subtract goes through ``ops.mul_rn``, which the compiler never fuses into an FMA (fp16 scales
times small integer quants are exact in float32, so this only makes sure). fp16 scales are
read through a float16 view of the row bytes (every one sits at an even offset), BF16
through a uint16 view. The three kernels read weights only through the decoder:

matvec    one thread block per output row (grid n_out, 32..256 threads): the threads stride
          over the row, consecutive threads on consecutive elements (neighbouring threads
          share a quant block's bytes and scales), each sums w * x in float32;
          ``device.block_sum`` adds the partial sums.
matmul    one 32 x 32 output tile (32 weight rows x 32 tokens) per thread block of 64
          threads (8 x 8); a thread owns 4 x 4 outputs, rows tx + 8i and tokens ty + 8j. The
          k loop takes 32 elements at a time: the block dequantizes the 32 x 32 weight tile
          and copies the 32 x 32 activation tile into shared memory (rows padded to 33 words:
          no bank conflicts), then every thread adds its 4 x 4 x 32 products from there.
          Each output is one float32 sum over k in order.
get_rows  one thread per output element: grid (n_in / 128, min(len(ids), 65535)), the rows
          of ids strided over grid y. An id outside [0, n_out) gives a row of NaN.

``n_in`` is the row length in elements (a multiple of the type's block size).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import cuda, float32, int32, uint32

from loaders import ggml_types
from loaders.ggml_types import QT

from . import device
from .ops import bits_to_f32, check_array, mul_rn

MV_MAX_THREADS = 256      # matvec block size cap (slots of its reduction array)
TILE = 32                 # matmul: output tile edge and k step (the shifts below assume 32)
MM_THREADS = 64           # matmul: 8 x 8 threads, 4 x 4 outputs each
MICRO = 4
_TILE_PAD = TILE + 1      # shared tile rows padded to 33 words (a compile-time constant)
GR_THREADS = 128          # get_rows
_MAX_GRID_Y = 65535


# ---------------------------------------------------------------- byte access

@cuda.jit(device=True)
def _u8(raw, r, o):
    """Byte o of row r as int32."""
    return int32(raw[r, o])


@cuda.jit(device=True)
def _f16(raw, r, o):
    """The fp16 at the even byte offset o of row r, as float32."""
    return float32(raw.view(np.float16)[r, o >> 1])


@cuda.jit(device=True)
def _nibble(v, hi):
    """Low (hi = 0) or high (hi = 1) nibble of the byte v."""
    return (v >> (hi << 2)) & 15


# ---------------------------------------------------------------- float types

@cuda.jit(device=True)
def _w_f32(raw, r, e):
    return raw.view(np.float32)[r, e]


@cuda.jit(device=True)
def _w_f16(raw, r, e):
    return float32(raw.view(np.float16)[r, e])


@cuda.jit(device=True)
def _w_bf16(raw, r, e):
    return bits_to_f32(uint32(raw.view(np.uint16)[r, e]) << 16)


# ---------------------------------------------------------------- legacy blocks (32 elements)
# element j of a block: quant byte j % 16, low nibble for j < 16, high nibble for j >= 16;
# Q5's fifth bit is bit j of the little-endian u32 qh (bit j % 8 of its byte j / 8)

@cuda.jit(device=True)
def _w_q4_0(raw, r, e):
    o = (e >> 5) * 18                                   # d f16 | qs[16]
    j = e & 31
    q = _nibble(_u8(raw, r, o + 2 + (j & 15)), j >> 4)
    return _f16(raw, r, o) * float32(q - 8)


@cuda.jit(device=True)
def _w_q4_1(raw, r, e):
    o = (e >> 5) * 20                                   # d f16 | m f16 | qs[16]
    j = e & 31
    q = _nibble(_u8(raw, r, o + 4 + (j & 15)), j >> 4)
    return mul_rn(_f16(raw, r, o), float32(q)) + _f16(raw, r, o + 2)


@cuda.jit(device=True)
def _w_q5_0(raw, r, e):
    o = (e >> 5) * 22                                   # d f16 | qh u32 | qs[16]
    j = e & 31
    q = _nibble(_u8(raw, r, o + 6 + (j & 15)), j >> 4) | (((_u8(raw, r, o + 2 + (j >> 3)) >> (j & 7)) & 1) << 4)
    return _f16(raw, r, o) * float32(q - 16)


@cuda.jit(device=True)
def _w_q5_1(raw, r, e):
    o = (e >> 5) * 24                                   # d f16 | m f16 | qh u32 | qs[16]
    j = e & 31
    q = _nibble(_u8(raw, r, o + 8 + (j & 15)), j >> 4) | (((_u8(raw, r, o + 4 + (j >> 3)) >> (j & 7)) & 1) << 4)
    return mul_rn(_f16(raw, r, o), float32(q)) + _f16(raw, r, o + 2)


@cuda.jit(device=True)
def _w_q8_0(raw, r, e):
    o = (e >> 5) * 34                                   # d f16 | qs i8[32]
    v = _u8(raw, r, o + 2 + (e & 31))
    return float32(v - ((v & 128) << 1)) * _f16(raw, r, o)


# ---------------------------------------------------------------- K blocks (256 elements)
# k = element within the block; k = 128*j + 32*l + b (j = k >> 7, l = (k >> 5) & 3, b = k & 31)

@cuda.jit(device=True)
def _w_q2_k(raw, r, e):
    o = (e >> 8) * 84                                   # scales[16] | qs[64] | d | dmin
    k = e & 255
    sc = _u8(raw, r, o + (k >> 4))
    q = (_u8(raw, r, o + 16 + ((k >> 7) << 5) + (k & 31)) >> (((k >> 5) & 3) << 1)) & 3
    dl = _f16(raw, r, o + 80) * float32(sc & 15)
    ml = mul_rn(_f16(raw, r, o + 82), float32(sc >> 4))
    return mul_rn(dl, float32(q)) - ml


@cuda.jit(device=True)
def _w_q3_k(raw, r, e):
    o = (e >> 8) * 110                                  # hmask[32] | qs[64] | scales[12] | d
    k = e & 255
    s = k >> 4
    lo = (_u8(raw, r, o + 96 + (s & 7)) >> ((s >> 3) << 2)) & 15
    hi = (_u8(raw, r, o + 104 + (s & 3)) >> ((s >> 2) << 1)) & 3
    ql = (_u8(raw, r, o + 32 + ((k >> 7) << 5) + (k & 31)) >> (((k >> 5) & 3) << 1)) & 3
    hbit = (_u8(raw, r, o + (k & 31)) >> (k >> 5)) & 1          # bit 4*j + l of hmask[b]
    dl = _f16(raw, r, o + 108) * float32((lo | (hi << 4)) - 32)
    return dl * float32(ql - 4 + (hbit << 2))


@cuda.jit(device=True)
def _scale_min_k4(raw, r, o, g):
    """The 6-bit scale and min of 32-element sub-block g of the Q4_K / Q5_K block at byte o
    (scales[12] at o + 4)."""
    if g < 4:
        sc = _u8(raw, r, o + 4 + g) & 63
        mn = _u8(raw, r, o + 8 + g) & 63
    else:
        sc = (_u8(raw, r, o + 8 + g) & 15) | ((_u8(raw, r, o + g) >> 6) << 4)
        mn = (_u8(raw, r, o + 8 + g) >> 4) | ((_u8(raw, r, o + 4 + g) >> 6) << 4)
    return sc, mn


@cuda.jit(device=True)
def _w_q4_k(raw, r, e):
    o = (e >> 8) * 144                                  # d | dmin | scales[12] | qs[128]
    k = e & 255
    sc, mn = _scale_min_k4(raw, r, o, k >> 5)
    q = _nibble(_u8(raw, r, o + 16 + ((k >> 6) << 5) + (k & 31)), (k >> 5) & 1)
    return mul_rn(_f16(raw, r, o) * float32(sc), float32(q)) - mul_rn(_f16(raw, r, o + 2), float32(mn))


@cuda.jit(device=True)
def _w_q5_k(raw, r, e):
    o = (e >> 8) * 176                                  # d | dmin | scales[12] | qh[32] | qs[128]
    k = e & 255
    g = k >> 5
    sc, mn = _scale_min_k4(raw, r, o, g)
    q = _nibble(_u8(raw, r, o + 48 + ((k >> 6) << 5) + (k & 31)), g & 1) \
        | (((_u8(raw, r, o + 16 + (k & 31)) >> g) & 1) << 4)
    return mul_rn(_f16(raw, r, o) * float32(sc), float32(q)) - mul_rn(_f16(raw, r, o + 2), float32(mn))


@cuda.jit(device=True)
def _w_q6_k(raw, r, e):
    o = (e >> 8) * 210                                  # ql[128] | qh[64] | scales i8[16] | d
    k = e & 255
    j = k >> 7
    l = (k >> 5) & 3
    b = k & 31
    lo = _nibble(_u8(raw, r, o + (j << 6) + ((l & 1) << 5) + b), l >> 1)
    hi = (_u8(raw, r, o + 128 + (j << 5) + b) >> (l << 1)) & 3
    s = _u8(raw, r, o + 192 + (k >> 4))
    return (_f16(raw, r, o + 208) * float32(s - ((s & 128) << 1))) * float32((lo | (hi << 4)) - 32)


_DECODERS = {
    QT.F32: _w_f32, QT.F16: _w_f16, QT.BF16: _w_bf16,
    QT.Q4_0: _w_q4_0, QT.Q4_1: _w_q4_1, QT.Q5_0: _w_q5_0, QT.Q5_1: _w_q5_1, QT.Q8_0: _w_q8_0,
    QT.Q2_K: _w_q2_k, QT.Q3_K: _w_q3_k, QT.Q4_K: _w_q4_k, QT.Q5_K: _w_q5_k, QT.Q6_K: _w_q6_k,
}

# ---------------------------------------------------------------- kernels (one set per decoder)


class _Kernels(NamedTuple):
    matvec: object
    matmul: object
    get_rows: object


def _make_kernels(dec) -> _Kernels:
    @cuda.jit
    def matvec_kernel(raw, n_in, x, out):
        red = cuda.shared.array(MV_MAX_THREADS, float32)
        r = cuda.blockIdx.x
        while r < out.shape[0]:                  # one row per block on hardware
            acc = float32(0.0)
            e = cuda.threadIdx.x
            while e < n_in:
                acc += dec(raw, r, e) * x[e]
                e += cuda.blockDim.x
            s = device.block_sum(acc, red)
            if cuda.threadIdx.x == 0:
                out[r] = s
            r += cuda.gridDim.x

    @cuda.jit
    def matmul_kernel(raw, n_in, x, out):
        ws = cuda.shared.array((TILE, _TILE_PAD), float32)      # [weight row, k]
        xs = cuda.shared.array((TILE, _TILE_PAD), float32)      # [token, k]
        acc = cuda.local.array((MICRO, MICRO), float32)        # [token j, row i]
        tid = cuda.threadIdx.x
        tx = tid & 7
        ty = tid >> 3
        r0 = cuda.blockIdx.x * TILE
        t0 = cuda.blockIdx.y * TILE
        n_tok = out.shape[0]
        n_out = out.shape[1]
        for j in range(MICRO):
            for i in range(MICRO):
                acc[j, i] = float32(0.0)
        active = r0 + tx < n_out and t0 + ty < n_tok
        for k0 in range(0, n_in, TILE):
            for m in range(TILE * TILE // MM_THREADS):
                idx = tid + m * MM_THREADS
                a = idx >> 5
                kk = idx & 31
                e = k0 + kk
                w = float32(0.0)
                if r0 + a < n_out and e < n_in:
                    w = dec(raw, r0 + a, e)
                ws[a, kk] = w
                v = float32(0.0)
                if t0 + a < n_tok and e < n_in:
                    v = x[t0 + a, e]
                xs[a, kk] = v
            cuda.syncthreads()
            if active:
                for kk in range(TILE):
                    w0 = ws[tx, kk]
                    w1 = ws[tx + 8, kk]
                    w2 = ws[tx + 16, kk]
                    w3 = ws[tx + 24, kk]
                    for j in range(MICRO):
                        xv = xs[ty + 8 * j, kk]
                        acc[j, 0] += xv * w0
                        acc[j, 1] += xv * w1
                        acc[j, 2] += xv * w2
                        acc[j, 3] += xv * w3
            cuda.syncthreads()
        for j in range(MICRO):
            t = t0 + ty + 8 * j
            if t < n_tok:
                for i in range(MICRO):
                    rr = r0 + tx + 8 * i
                    if rr < n_out:
                        out[t, rr] = acc[j, i]

    @cuda.jit
    def get_rows_kernel(raw, n_in, ids, out):
        e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        while e < n_in:
            i = cuda.blockIdx.y
            while i < ids.shape[0]:
                r = ids[i]
                if r >= 0 and r < raw.shape[0]:
                    out[i, e] = dec(raw, r, e)
                else:
                    out[i, e] = float32(np.nan)
                i += cuda.gridDim.y
            e += cuda.gridDim.x * cuda.blockDim.x

    return _Kernels(matvec_kernel, matmul_kernel, get_rows_kernel)


_KERNELS: dict[QT, _Kernels] = {qt: _make_kernels(dec) for qt, dec in _DECODERS.items()}

SUPPORTED_TYPES = frozenset(_KERNELS)


# ---------------------------------------------------------------- launchers

def _type_kernels(qtype) -> tuple[QT, _Kernels]:
    try:
        qt = QT(int(qtype))
        name = qt.name
    except (TypeError, ValueError):
        qt = None
        name = ggml_types.type_name(int(qtype)) if isinstance(qtype, (int, np.integer)) else repr(qtype)
    if qt not in _KERNELS:
        raise ValueError(f"qtype: no CUDA kernels for ggml type {name}; "
                         f"supported: {', '.join(sorted(t.name for t in _KERNELS))}")
    return qt, _KERNELS[qt]


def _check_raw(raw, qtype, n_in) -> tuple[_Kernels, int]:
    qt, kernels = _type_kernels(qtype)
    n_in = int(n_in)
    if n_in <= 0 or n_in % ggml_types.block_size(qt):
        raise ValueError(f"n_in: {n_in} is not a positive multiple of the {qt.name} block size "
                         f"{ggml_types.block_size(qt)}")
    check_array("raw", raw, np.uint8, ndim=2)
    rb = ggml_types.row_bytes(qt, n_in)
    if int(raw.shape[1]) != rb:
        raise ValueError(f"raw: rows of {int(raw.shape[1])} bytes, {qt.name} rows of {n_in} "
                         f"elements have {rb}")
    return kernels, int(raw.shape[0])


def matvec(raw, qtype, n_in, x, out) -> None:
    """out[r] = sum_j w[r, j] * x[j] (float32 sums) for raw uint8[n_out, row_bytes] of type
    ``qtype``, x float32[n_in], out float32[n_out]."""
    kernels, n_out = _check_raw(raw, qtype, n_in)
    check_array("x", x, np.float32, shape=(int(n_in),))
    check_array("out", out, np.float32, shape=(n_out,))
    if n_out == 0:
        return
    threads = device.row_threads(int(n_in) // 8, MV_MAX_THREADS)
    # the simulator (one Python thread per CUDA thread) gets two blocks that loop over the rows
    grid = min(n_out, 2) if device.SIMULATOR else n_out
    device.launch(kernels.matvec, grid, threads, raw, np.int32(n_in), x, out)


def matmul(raw, qtype, n_in, x, out) -> None:
    """out[t, r] = sum_j w[r, j] * x[t, j] (float32 sums) for x float32[T, n_in],
    out float32[T, n_out]."""
    kernels, n_out = _check_raw(raw, qtype, n_in)
    check_array("x", x, np.float32, ndim=2)
    T = int(x.shape[0])
    if int(x.shape[1]) != int(n_in):
        raise ValueError(f"x: rows of {int(x.shape[1])} elements, n_in is {int(n_in)}")
    check_array("out", out, np.float32, shape=(T, n_out))
    if T == 0 or n_out == 0:
        return
    if T > TILE * _MAX_GRID_Y:
        raise ValueError(f"x: {T} tokens, at most {TILE * _MAX_GRID_Y} a call")
    grid = (device.blocks_for(n_out, TILE), device.blocks_for(T, TILE))
    device.launch(kernels.matmul, grid, MM_THREADS, raw, np.int32(n_in), x, out)


def get_rows(raw, qtype, n_in, ids, out) -> None:
    """out[i] = the dequantized row ids[i] (bit-identical to gguf's dequantization) for ids
    int32 / int64[m], out float32[m, n_in]. An id outside [0, n_out) gives a row of NaN."""
    kernels, _ = _check_raw(raw, qtype, n_in)
    if not hasattr(ids, "dtype") or ids.dtype not in (np.int32, np.int64):
        raise ValueError(f"ids must be int32 or int64, got {getattr(ids, 'dtype', type(ids).__name__)}")
    check_array("ids", ids, ids.dtype, ndim=1)
    m = int(ids.shape[0])
    check_array("out", out, np.float32, shape=(m, int(n_in)))
    if m == 0:
        return
    if device.SIMULATOR:              # few Python threads; the kernel strides over the rest
        device.launch(kernels.get_rows, (1, min(m, 2)), 8, raw, np.int32(n_in), ids, out)
        return
    grid = (device.blocks_for(n_in, GR_THREADS), min(m, _MAX_GRID_Y))
    device.launch(kernels.get_rows, grid, GR_THREADS, raw, np.int32(n_in), ids, out)
