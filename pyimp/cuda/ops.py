"""Element-wise and normalization ops of the GPU path (twins of :mod:`pyimp.ops`), float32.

Launchers take device arrays (host arrays under ``device.compile_only``) and write in place
or into ``out``; they check shapes and dtypes and raise ValueError naming the argument.

Design (grid / block mapping):

rms_norm      one thread block per row of x[R, n] (32..256 threads): the threads stride over
              the row summing squares in float32, ``device.block_sum`` adds them, every
              thread then scales its own elements (so out may be x).
rope          one thread per rotated pair (t, h, i) of x[T, H, D], 1-D grid.
element-wise  one thread per element of the flattened arrays, 256-thread blocks (silu,
              gelu_tanh, softcap, glu, add, scale).

Rounding. GPU compilers contract ``a * b + c`` into one fused multiply-add; where the NumPy
reference rounds a product before adding, the product goes through :func:`mul_rn`
(``mul.rn.f32``, never contracted), and where the reference fuses (RoPE), through
:func:`fma32`. The transcendental functions are libdevice's float32 ones (``expf``,
``tanhf``: <= 2 ulp), NumPy's are < 1 ulp: results of silu, gelu_tanh and softcap differ
from the references by a few float32 ulps.

Also here: the scalar device helpers the weight kernels (:mod:`pyimp.cuda.linear`) share,
each with a simulator twin (the simulator runs kernels as Python and has no libdevice).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32

from . import device

F32 = np.float32
EW_THREADS = 8 if device.SIMULATOR else 256    # element-wise kernels
_MAX_ROW_THREADS = 256    # rms_norm (slots of its reduction array)

# constants of pyimp.ops.gelu_tanh (same float32 values)
_SQRT_2_OVER_PI = F32(0.79788456080286535587989211986876)
_GELU_COEF_A = F32(0.044715)

# ---------------------------------------------------------------- scalar device helpers

if device.SIMULATOR:
    @cuda.jit(device=True)
    def mul_rn(a, b):
        """float32 a * b, rounded once and never fused with a following add."""
        return float32(a * b)

    @cuda.jit(device=True)
    def fma32(a, b, c):
        """float32 a * b + c; here through float64 (a*b exact there, two roundings of the
        sum, as the NumPy references do), on hardware one fused rounding."""
        return float32(np.float64(a) * np.float64(b) + np.float64(c))

    @cuda.jit(device=True)
    def bits_to_f32(u):
        """The float32 whose bit pattern is the low 32 bits of the integer u."""
        return np.uint32(int(u) & 0xFFFFFFFF).view(np.float32)
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def mul_rn(a, b):
        return libdevice.fmul_rn(a, b)

    @cuda.jit(device=True)
    def fma32(a, b, c):
        return cuda.fma(a, b, c)

    @cuda.jit(device=True)
    def bits_to_f32(u):
        return libdevice.int_as_float(int32(u))


# ---------------------------------------------------------------- launcher checks

def _shape(a) -> tuple:
    return tuple(int(s) for s in a.shape)


def _c_contiguous(a) -> bool:
    return bool(a.flags.c_contiguous) if isinstance(a, np.ndarray) else bool(a.is_c_contiguous())


def check_array(name: str, a, dtype, shape=None, ndim=None) -> None:
    """ValueError naming ``name`` unless a is a C-contiguous ``dtype`` array of that shape / ndim."""
    if not hasattr(a, "dtype") or not hasattr(a, "shape"):
        raise ValueError(f"{name} must be a device array, got {type(a).__name__}")
    if a.dtype != dtype:
        raise ValueError(f"{name} must be {np.dtype(dtype).name}, got {a.dtype}")
    if ndim is not None and len(a.shape) != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {list(_shape(a))}")
    if shape is not None and _shape(a) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(_shape(a))}")
    if not _c_contiguous(a):
        raise ValueError(f"{name} must be C-contiguous")


def _flat(a):
    return a.reshape(int(np.prod(_shape(a), dtype=np.int64)))


def _ew_grid(n: int) -> int:
    """Blocks of EW_THREADS for n elements (the kernels loop over the grid's stride; the
    simulator, one Python thread per CUDA thread, gets one block)."""
    return 1 if device.SIMULATOR else device.blocks_for(n, EW_THREADS)


# ---------------------------------------------------------------- rms_norm

@cuda.jit
def _rms_norm_kernel(x, w, eps, out):
    red = cuda.shared.array(_MAX_ROW_THREADS, float32)
    r = cuda.blockIdx.x
    n = x.shape[1]
    tid = cuda.threadIdx.x
    s = float32(0.0)
    i = tid
    while i < n:
        v = x[r, i]
        s += v * v
        i += cuda.blockDim.x
    ss = device.block_sum(s, red)
    scale = float32(1.0) / float32(math.sqrt(ss / float32(n) + eps))
    i = tid
    while i < n:
        out[r, i] = (x[r, i] * scale) * w[i]
        i += cuda.blockDim.x


def rms_norm(x, w, eps, out) -> None:
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w for x float32[R, n], w float32[n];
    out float32[R, n] (may be x). The sum of squares is float32 (the reference's is float64)."""
    check_array("x", x, np.float32, ndim=2)
    R, n = _shape(x)
    check_array("w", w, np.float32, shape=(n,))
    check_array("out", out, np.float32, shape=(R, n))
    if R == 0 or n == 0:
        return
    device.launch(_rms_norm_kernel, R, device.row_threads(n, _MAX_ROW_THREADS), x, w, F32(eps),
                  out)


# ---------------------------------------------------------------- rope

@cuda.jit(device=True)
def rope_index(i, half, neox):
    """The channels of rotated pair i: (i, i + half) NEOX, (2i, 2i + 1) NORM."""
    if neox != 0:
        return i, i + half
    return 2 * i, 2 * i + 1


@cuda.jit(device=True)
def rope_pair(x0, x1, c, s):
    """The pair (x0, x1) rotated by the angle of cosine c and sine s. The reference computes
    x0*c - x1*s with x0*c exact and x1*s rounded (ggml's fma)."""
    return fma32(x0, c, -mul_rn(x1, s)), fma32(x0, s, mul_rn(x1, c))


@cuda.jit
def _rope_kernel(x, cos, sin, neox):
    H = x.shape[1]
    half = cos.shape[1]
    idx = cuda.grid(1)
    while idx < x.shape[0] * H * half:
        i = idx % half
        th = idx // half
        h = th % H
        t = th // H
        i0, i1 = rope_index(i, half, neox)
        x[t, h, i0], x[t, h, i1] = rope_pair(x[t, h, i0], x[t, h, i1], cos[t, i], sin[t, i])
        idx += cuda.gridsize(1)


def rope(x, cos, sin, neox) -> None:
    """Rotate the first ``2 * cos.shape[1]`` channels of x float32[T, H, D] in place with the
    tables of :func:`pyimp.ops.rope_cache` (cos, sin float32[T, n_rot / 2]); NEOX pairs
    (i, i + n_rot/2), NORM pairs (2i, 2i + 1), as :func:`pyimp.ops.rope_ref`."""
    check_array("x", x, np.float32, ndim=3)
    T, H, D = _shape(x)
    check_array("cos", cos, np.float32, ndim=2)
    half = _shape(cos)[1]
    if _shape(cos)[0] != T or 2 * half > D:
        raise ValueError(f"cos {list(_shape(cos))} does not fit x {[T, H, D]}")
    check_array("sin", sin, np.float32, shape=(T, half))
    n = T * H * half
    if n == 0:
        return
    device.launch(_rope_kernel, _ew_grid(n), EW_THREADS, x, cos, sin, np.int32(bool(neox)))


# ---------------------------------------------------------------- element-wise

@cuda.jit(device=True)
def _silu(v):
    return v / (float32(1.0) + float32(math.exp(-v)))


@cuda.jit(device=True)
def _gelu_tanh(v):
    inner = _SQRT_2_OVER_PI * v * (float32(1.0) + _GELU_COEF_A * v * v)
    return float32(0.5) * v * (float32(1.0) + float32(math.tanh(inner)))


def _unary_kernel(fn):
    @cuda.jit
    def kernel(x, out):
        i = cuda.grid(1)
        while i < x.shape[0]:
            out[i] = fn(x[i])
            i += cuda.gridsize(1)
    return kernel


def _glu_kernel(fn):
    @cuda.jit
    def kernel(g, u, out):
        i = cuda.grid(1)
        while i < g.shape[0]:
            out[i] = fn(g[i]) * u[i]
            i += cuda.gridsize(1)
    return kernel


_ACTS = {"silu": _silu, "gelu_tanh": _gelu_tanh}
_UNARY = {name: _unary_kernel(fn) for name, fn in _ACTS.items()}
_GLU = {name: _glu_kernel(fn) for name, fn in _ACTS.items()}


@cuda.jit
def _softcap_kernel(x, inv, cap, out):
    i = cuda.grid(1)
    while i < x.shape[0]:
        out[i] = float32(math.tanh(x[i] * inv)) * cap
        i += cuda.gridsize(1)


@cuda.jit
def _add_kernel(x, y):
    i = cuda.grid(1)
    while i < x.shape[0]:
        x[i] = x[i] + y[i]
        i += cuda.gridsize(1)


@cuda.jit
def _add_rows_kernel(x, b):
    i = cuda.grid(1)
    n = b.shape[0]
    while i < x.shape[0]:
        x[i] = x[i] + b[i % n]
        i += cuda.gridsize(1)


@cuda.jit
def _scale_kernel(x, s):
    i = cuda.grid(1)
    while i < x.shape[0]:
        x[i] = x[i] * s
        i += cuda.gridsize(1)


def _out_like(x, out, name="out"):
    if out is None:
        return x
    check_array(name, out, np.float32, shape=_shape(x))
    return out


def _unary(act: str, x, out):
    check_array("x", x, np.float32)
    out = _out_like(x, out)
    n = int(np.prod(_shape(x), dtype=np.int64))
    if n:
        device.launch(_UNARY[act], _ew_grid(n), EW_THREADS, _flat(x), _flat(out))
    return out


def silu(x, out=None):
    """x / (1 + exp(-x)) element-wise into out (in place when out is None); returns out."""
    return _unary("silu", x, out)


def gelu_tanh(x, out=None):
    """tanh-approximated GELU (the float32 formula of pyimp.ops.gelu_tanh) into out
    (in place when out is None); returns out."""
    return _unary("gelu_tanh", x, out)


def softcap(x, cap, out=None):
    """cap * tanh(x / cap) (as pyimp.ops.softcap: x times the float32 1/cap) into out
    (in place when out is None); returns out."""
    check_array("x", x, np.float32)
    out = _out_like(x, out)
    c = F32(cap)
    if not np.isfinite(c) or c == 0:
        raise ValueError(f"cap must be finite and non-zero, got {cap}")
    n = int(np.prod(_shape(x), dtype=np.int64))
    if n:
        device.launch(_softcap_kernel, _ew_grid(n), EW_THREADS, _flat(x), F32(1.0) / c, c, _flat(out))
    return out


def glu(g, u, out, act: str) -> None:
    """out = act(g) * u element-wise (the gated FFN), act "silu" or "gelu_tanh"; g, u, out
    float32 of one shape (out may be g or u)."""
    if act not in _GLU:
        raise ValueError(f"act must be one of {sorted(_GLU)}, got {act!r}")
    check_array("g", g, np.float32)
    check_array("u", u, np.float32, shape=_shape(g))
    check_array("out", out, np.float32, shape=_shape(g))
    n = int(np.prod(_shape(g), dtype=np.int64))
    if n:
        device.launch(_GLU[act], _ew_grid(n), EW_THREADS, _flat(g), _flat(u), _flat(out))


def add(x, y) -> None:
    """x += y in place (the residual add); x, y float32 of one shape."""
    check_array("x", x, np.float32)
    check_array("y", y, np.float32, shape=_shape(x))
    n = int(np.prod(_shape(x), dtype=np.int64))
    if n:
        device.launch(_add_kernel, _ew_grid(n), EW_THREADS, _flat(x), _flat(y))


def add_rows(x, b) -> None:
    """x[t] += b for every row t of x float32 [T, n] (a projection's bias), b float32 [n]: the
    rows of NumPy's ``x + b``."""
    check_array("x", x, np.float32, ndim=2)
    n = _shape(x)[1]
    check_array("b", b, np.float32, shape=(n,))
    size = int(np.prod(_shape(x), dtype=np.int64))
    if size:
        device.launch(_add_rows_kernel, _ew_grid(size), EW_THREADS, _flat(x), b)


def scale(x, s) -> None:
    """x *= s in place (s rounded to float32 first)."""
    check_array("x", x, np.float32)
    n = int(np.prod(_shape(x), dtype=np.int64))
    if n:
        device.launch(_scale_kernel, _ew_grid(n), EW_THREADS, _flat(x), F32(s))
