"""KV blocks on the device: one element reader per storage format, the device quantizer, and
:class:`DeviceQuantizedKV` (a quantized layer as the device kernels take it).

**Formats.** ``"float"`` (f16 or f32 arrays ``[Hkv][NB][B*D]``; the array's dtype types the
kernel) and the ggml block types ``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1`` stored exactly
as the host cache stores them (:mod:`pyimp.kv.cache`): ``data`` uint8 ``[Hkv][NB][bytes]``, token
t's D values along head_dim at bytes ``[t*RB, (t+1)*RB)`` of its block's row (``RB = D/32 *
block bytes``; K, and V in the ``"token"`` layout, the only V layout on the device), plus the
float32 *tail* ``[Hkv][B*D]`` holding the block being filled (K token-major ``t*D + d``, V
channel-major ``d*B + t``, as on the host) and the physical block it stands for
(``tail_block``, -1: none).

**Kernel operands.** A kernel that reads a side takes ``(c, tail, tail_block)``: the float
array or ``data``, the tail (a ``[1, 1]`` placeholder for a float side, never read) and the
tail block (int32, -1 for a float side); :func:`operand` makes the triple. The readers, one
pair per format (:func:`readers`, cached), are the only code that knows how a cached element
is stored::

    kget(c, tail, tb, kvh, pb, e)             float32 key element e = t*D + d of block pb
    vget(c, tail, tb, kvh, pb, t, d, B, D)    float32 value of token t, channel d of block pb

A quantized reader takes block ``tail_block`` from the tail and decodes every other block in
place through the weight decoders of :mod:`pyimp.cuda.linear` (``_w_q8_0`` ..., bit-identical
to ``gguf.quants.dequantize``) on the kv head's ``[NB][bytes]`` rows: no dequantized copy of the
cache, no scratch.

**The quantizer.** :func:`quantize_block` (a device function) writes one block of 32 float32
values, byte-identical to :func:`loaders.quantize.quantize_block` (and so to ggml's
``quantize_row_*_ref``): the same float32 operations in the same order, with every product
that the CPU rounds before an add through ``ops.mul_rn`` (never contracted into an FMA),
IEEE division, fp16 stores rounded to nearest even. One rule differs, for inputs the host cache
refuses to store (NaN, inf, or ``|x| >= 65520``, which would overflow an fp16 scale): the
device does not check its writes, so such a block is stored with NaN scales (quants zero) and
every value read from it is NaN, which the engine's check of the logits reports.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int32, uint8, uint32
from numba.core.types import float16

from loaders.quantize import BLOCK_BYTES, CODES

from ..kv.cache import QUANT_TYPES, QuantizedKV
from . import device
from .ops import mul_rn

FORMATS = ("float",) + tuple(QUANT_TYPES)

_0 = np.float32(0.0)
_1 = np.float32(1.0)
_HALF = np.float32(0.5)
_127 = np.float32(127.0)
_NAN = np.float32(np.nan)
# the host cache refuses |x| >= 65520 for the types with fp16 scales (pyimp.kv.cache._FINITE_LIMIT)
_LIMIT = np.float32(65520.0)


# ---------------------------------------------------------------- the quantized operand

class DeviceQuantizedKV:
    """One layer's quantized K or V on the device (the twin of :class:`pyimp.kv.cache.QuantizedKV`).

    ``data`` uint8 ``[Hkv][NB][bytes]`` and ``tail`` float32 ``[Hkv][B*D]`` are device arrays,
    ``tail_block`` the physical block the tail stands for (-1: none). ``shape`` is the float
    layout's ``(Hkv, NB, B*D)``."""

    def __init__(self, side: str, kv_type: str, data, tail, tail_block: int, head_dim: int,
                 block_len: int):
        if kv_type not in QUANT_TYPES:
            raise ValueError(f"{kv_type!r} is not a quantized KV type ({', '.join(QUANT_TYPES)})")
        self.side, self.kv_type = side, kv_type
        self.data, self.tail = data, tail
        self.tail_block = int(tail_block)
        self.head_dim, self.block_len = head_dim, block_len

    @property
    def shape(self) -> tuple[int, int, int]:
        return int(self.data.shape[0]), int(self.data.shape[1]), int(self.tail.shape[1])

    @classmethod
    def from_host(cls, q: QuantizedKV) -> DeviceQuantizedKV:
        """A device copy of a host layer (token-row storage only)."""
        if not q.by_token:
            raise ValueError("V stored by channel (v_layout='channel') has no device reader: "
                             "the device stores quantized V by token")
        return cls(q.side, q.kv_type, device.to_device(q.data), device.to_device(q.tail),
                   q.tail_block, q.head_dim, q.block_len)

    def host(self) -> QuantizedKV:
        """A host copy (:class:`pyimp.kv.cache.QuantizedKV`: dequantization, the references)."""
        return QuantizedKV(self.side, self.kv_type, device.to_host(self.data),
                           device.to_host(self.tail), self.tail_block, self.head_dim,
                           self.block_len, True)


def fmt_of(c) -> str:
    """The storage format of a side: its quantized type, or "float"."""
    return c.kv_type if isinstance(c, DeviceQuantizedKV) else "float"


def operand(c, placeholder) -> tuple:
    """``(array, tail, tail_block)`` of a side for the kernels; ``placeholder``: the float32
    ``[1, 1]`` device array a float side passes as its tail."""
    if isinstance(c, DeviceQuantizedKV):
        return c.data, c.tail, np.int32(c.tail_block)
    return c, placeholder, np.int32(-1)


# ---------------------------------------------------------------- readers

@functools.cache
def readers(fmt: str):
    """(kget, vget) device functions of a storage format (see the module docstring)."""
    if fmt == "float":
        @cuda.jit(device=True)
        def kget(c, tail, tb, kvh, pb, e):
            return float32(c[kvh, pb, e])

        @cuda.jit(device=True)
        def vget(c, tail, tb, kvh, pb, t, d, B, D):
            return float32(c[kvh, pb, d * B + t])

        return kget, vget
    from . import linear
    dec = linear._DECODERS[QUANT_TYPES[fmt]]

    @cuda.jit(device=True)
    def kget(c, tail, tb, kvh, pb, e):
        if pb == tb:
            return tail[kvh, e]
        return dec(c[kvh], pb, e)

    @cuda.jit(device=True)
    def vget(c, tail, tb, kvh, pb, t, d, B, D):
        if pb == tb:
            return tail[kvh, d * B + t]
        return dec(c[kvh], pb, t * D + d)

    return kget, vget


# ---------------------------------------------------------------- the quantizer

@cuda.jit(device=True)
def _put_f16(w, o, f):
    """The fp16 (round to nearest even) of the float32 f at the even byte offset o of row w."""
    w.view(np.float16)[o >> 1] = float16(f)


@cuda.jit(device=True)
def _inverse(d):
    if d != _0:
        return _1 / d
    return _0


@cuda.jit(device=True)
def _roundf(y):
    """C roundf (half away from zero) of a float32 of magnitude < 2**31, as int32 (the CPU's
    floor(a) + floor(2 * (a - floor(a))): a - floor(a) is exact)."""
    a = abs(y)
    fl = int32(a)                       # a >= 0: truncation is floor
    r = fl
    if a - float32(fl) >= _HALF:
        r = fl + 1
    if y < _0:
        return -r
    return r


@cuda.jit(device=True)
def _nibbles(qv, w, o):
    for j in range(16):
        w[o + j] = uint8(qv[j] | (qv[j + 16] << 4))


@cuda.jit(device=True)
def _high_bits(qv, w, o):
    """The fifth bits as the little-endian u32 qh at w[o:o+4]; qv keeps its low four bits."""
    qh = uint32(0)
    for j in range(32):
        qh |= uint32((qv[j] >> 4) & 1) << uint32(j)
    for b in range(4):
        w[o + b] = uint8((qh >> uint32(8 * b)) & uint32(0xFF))
    for j in range(32):
        qv[j] = qv[j] & 15


@cuda.jit(device=True)
def _poison(w, wo, bsz, has_min):
    """A block of NaN scales (and minimums) and zero quants."""
    for k in range(bsz):
        w[wo + k] = uint8(0)
    _put_f16(w, wo, _NAN)
    if has_min:
        _put_f16(w, wo + 2, _NAN)


@cuda.jit(device=True)
def quantize_block(code, x, w, wo):
    """Quantize x[0:32] (float32, a local array) into the block of type ``code`` (loaders.quantize
    CODES: 0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q5_0, 4 Q5_1) at byte wo of the uint8 row w."""
    ok = True
    for k in range(32):
        if not abs(x[k]) < _LIMIT:      # NaN fails the comparison
            ok = False
    if code == 0:
        if not ok:
            _poison(w, wo, 34, False)
            return
        amax = _0
        for k in range(32):
            a = abs(x[k])
            if a > amax:
                amax = a
        d = amax / _127
        inv = _inverse(d)
        _put_f16(w, wo, d)
        for k in range(32):
            q = _roundf(x[k] * inv)
            w[wo + 2 + k] = uint8(q & 0xFF)
        return
    qv = cuda.local.array(32, int32)
    if code == 1 or code == 3:          # Q4_0 (levels 8), Q5_0 (16): d = max / -levels
        levels = 8 if code == 1 else 16
        top = 15 if code == 1 else 31
        qo = 2 if code == 1 else 6
        if not ok:
            _poison(w, wo, 18 if code == 1 else 22, False)
            return
        amax = _0
        mx = _0
        for k in range(32):
            a = abs(x[k])
            if a > amax:
                amax = a
                mx = x[k]
        d = mx / float32(-levels)
        inv = _inverse(d)
        bias = float32(levels) + _HALF
        _put_f16(w, wo, d)
        for k in range(32):
            qv[k] = min(top, int32(mul_rn(x[k], inv) + bias))
        if code == 3:
            _high_bits(qv, w, wo + 2)
        _nibbles(qv, w, wo + qo)
        return
    # Q4_1 (top 15), Q5_1 (31): d = (max - min) / top, m = min
    top = 15 if code == 2 else 31
    qo = 4 if code == 2 else 8
    if not ok:
        _poison(w, wo, 20 if code == 2 else 24, True)
        return
    lo = x[0]
    hi = x[0]
    for k in range(1, 32):
        v = x[k]
        if v < lo:
            lo = v
        if v > hi:
            hi = v
    d = (hi - lo) / float32(top)
    inv = _inverse(d)
    _put_f16(w, wo, d)
    _put_f16(w, wo + 2, lo)
    for k in range(32):
        qv[k] = min(top, int32(mul_rn(x[k] - lo, inv) + _HALF))
    if code == 4:
        _high_bits(qv, w, wo + 4)
    _nibbles(qv, w, wo + qo)


@cuda.jit
def _quantize_rows_kernel(x, code, bsz, out):
    """Test entry: row r of x float32 [rows, n] into out uint8 [rows, n/32 * bsz], one thread
    per (row, block) in a grid-stride loop."""
    rows, n = x.shape
    nb = n // 32
    v = cuda.local.array(32, float32)
    i = cuda.grid(1)
    while i < rows * nb:
        r = i // nb
        b = i % nb
        for k in range(32):
            v[k] = x[r, b * 32 + k]
        quantize_block(code, v, out[r], b * bsz)
        i += cuda.gridsize(1)


def quantize_rows(x, kv_type: str):
    """float32 ``[rows, n]`` (n a multiple of 32; a host array) quantized on the device into a
    host uint8 ``[rows, n/32 * block bytes]`` (the twin of :func:`loaders.quantize.quantize_rows`,
    for tests)."""
    code = CODES[QUANT_TYPES[kv_type]]
    bsz = BLOCK_BYTES[code]
    x = np.ascontiguousarray(x, np.float32)
    if x.ndim != 2 or x.shape[1] % 32:
        raise ValueError(f"rows to quantize must be [rows, n] with n a multiple of 32, got "
                         f"{x.shape}")
    out = device.zeros((x.shape[0], x.shape[1] // 32 * bsz), np.uint8)
    n = x.shape[0] * (x.shape[1] // 32)
    if n:
        nt = 8 if device.SIMULATOR else 128
        device.launch(_quantize_rows_kernel, 1 if device.SIMULATOR else device.blocks_for(n, nt),
                      nt, device.to_device(x), np.int32(code), np.int32(bsz), out)
    return device.to_host(out)
