"""Element-wise and normalization ops of the forward pass, in NumPy float32.

Each op follows ggml's CPU arithmetic where that is cheap to do (double sums
in RMSNorm, float32 RoPE angle recurrence, fp16 GELU table in ``ggml``
numerics), so that the two engines differ only by summation order.
"""
from __future__ import annotations

import functools

import numpy as np

from loaders import jit

jit.kernel_module(__file__)

F32 = np.float32


@jit.njit(inline="always")
def _rms_scale(ss, n, e):
    return np.float32(1.0) / np.sqrt(np.float32(ss / n) + e)


@jit.njit
def rms_norm_rows(x, w, eps, out):
    """ggml's rms_norm then mul, per row of x float32[rows, n]: float32 squares summed in
    float64 in element order, mean rounded to float32, scale = 1 / sqrt(mean + eps). Rows go
    four at a time (four independent sums in flight instead of one latency-bound chain)."""
    rows, n = x.shape
    e = np.float32(eps)
    ss = np.empty(4)
    for r0 in range(0, rows, 4):
        g = min(4, rows - r0)
        if g == 4:
            s0 = s1 = s2 = s3 = 0.0
            for i in range(n):
                s0 += np.float64(x[r0, i] * x[r0, i])
                s1 += np.float64(x[r0 + 1, i] * x[r0 + 1, i])
                s2 += np.float64(x[r0 + 2, i] * x[r0 + 2, i])
                s3 += np.float64(x[r0 + 3, i] * x[r0 + 3, i])
            ss[0], ss[1], ss[2], ss[3] = s0, s1, s2, s3
        else:
            for k in range(g):
                s = 0.0
                for i in range(n):
                    s += np.float64(x[r0 + k, i] * x[r0 + k, i])
                ss[k] = s
        for k in range(g):
            scale = _rms_scale(ss[k], n, e)
            for i in range(n):
                out[r0 + k, i] = (x[r0 + k, i] * scale) * w[i]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis times ``weight``; x float32[..., n], weight float32[n].

    Sum of squares in float64 in element order, as ggml does; the scale is float32. One
    compiled call (a NumPy version costs ~30 us of dispatch per call, 100+ calls a token).
    """
    x2 = np.ascontiguousarray(x, dtype=F32).reshape(-1, x.shape[-1])
    out = np.empty_like(x2)
    rms_norm_rows(x2, np.ascontiguousarray(weight, dtype=F32), float(eps), out)
    return out.reshape(x.shape)


def rms_norm_ref(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """NumPy reference of :func:`rms_norm` (its float64 sum is pairwise, not in order)."""
    n = x.shape[-1]
    ss = np.sum(np.square(x).astype(np.float64), axis=-1, keepdims=True)
    mean = (ss / n).astype(F32)
    scale = F32(1.0) / np.sqrt(mean + F32(eps))
    return (x * scale) * weight


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x) in float32, as ggml's silu: x / (1 + exp(-x))."""
    with np.errstate(over="ignore"):
        return x / (F32(1.0) + np.exp(-x))


_SQRT_2_OVER_PI = F32(0.79788456080286535587989211986876)
_GELU_COEF_A = F32(0.044715)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """tanh-approximated GELU in float32: 0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x x))),
    the same float32 operations in the same order, in two buffers (a prefill's [T, n_ff]
    activations made eight temporaries)."""
    a = x * _SQRT_2_OVER_PI
    b = x * _GELU_COEF_A
    b *= x
    b += F32(1.0)
    a *= b
    np.tanh(a, out=a)
    a += F32(1.0)
    np.multiply(x, F32(0.5), out=b)
    b *= a
    return b


@jit.njit
def _gelu_tanh_arg(x, a):
    """a = (x * sqrt(2/pi)) * ((x * 0.044715) * x + 1), float32 in gelu_tanh's order."""
    for i in range(x.size):
        v = x[i]
        a[i] = (v * _SQRT_2_OVER_PI) * ((v * _GELU_COEF_A) * v + F32(1.0))


@jit.njit
def _gelu_tanh_finish_mul(x, t, u, out):
    """out = ((x * 0.5) * (t + 1)) * u, float32 (t: the tanh of :func:`_gelu_tanh_arg`)."""
    for i in range(x.size):
        out[i] = ((x[i] * F32(0.5)) * (t[i] + F32(1.0))) * u[i]


def gelu_tanh_mul(x: np.ndarray, u: np.ndarray) -> np.ndarray:
    """``gelu_tanh(x) * u`` (the GeGLU product), the same float32 operations in the same order
    and so the same bits, in three calls (two compiled loops around NumPy's tanh) instead of a
    NumPy operation per term: a decode step's [1, n_ff] product cost ~30 us in ten calls."""
    xf = np.ascontiguousarray(x, dtype=F32).reshape(-1)
    uf = np.ascontiguousarray(u, dtype=F32).reshape(-1)
    if uf.shape != xf.shape:
        raise ValueError(f"gelu_tanh_mul: shapes {x.shape} and {u.shape} differ")
    a = np.empty_like(xf)
    _gelu_tanh_arg(xf, a)
    np.tanh(a, out=a)
    out = np.empty_like(xf)
    _gelu_tanh_finish_mul(xf, a, uf, out)
    return out.reshape(x.shape)


def _libm_tanhf():
    """glibc's tanhf through ctypes, or None where no C math library is found."""
    import ctypes
    import ctypes.util
    name = ctypes.util.find_library("m")
    if not name:
        return None
    try:
        fn = ctypes.CDLL(name).tanhf
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_float
    fn.argtypes = [ctypes.c_float]
    return fn


@functools.lru_cache(maxsize=1)
def _gelu_fp16_table() -> np.ndarray:
    """float32[65536]: GELU of every fp16 value, rounded to fp16, as ggml builds its table.

    ggml evaluates 0.5f*x*(1 + tanhf(k*x*(1 + a*x*x))) with the inner sum contracted to
    fma(a*x, x, 1) and the C library's tanhf; many entries sit near an fp16 rounding tie, so
    the float32 value has to be reproduced exactly (float64 holds (a*x)*x exactly).
    """
    xs = np.arange(65536, dtype=np.uint16).view(np.float16).astype(F32)
    with np.errstate(invalid="ignore", over="ignore"):
        ax = _GELU_COEF_A * xs
        inner = (ax.astype(np.float64) * xs + 1.0).astype(F32)
        z = _SQRT_2_OVER_PI * xs * inner
        tanhf = _libm_tanhf()
        t = np.array([tanhf(float(v)) for v in z], dtype=F32) if tanhf else np.tanh(z)
        y = F32(0.5) * xs * (F32(1.0) + t)
        return y.astype(np.float16).astype(F32)


def gelu_tanh_ggml(x: np.ndarray) -> np.ndarray:
    """GELU as ggml's CPU computes it: fp16 lookup table inside (-10, 10), identity/zero outside."""
    idx = x.astype(np.float16).view(np.uint16)
    y = _gelu_fp16_table()[idx]
    y = np.where(x <= F32(-10.0), F32(0.0), y)
    return np.where(x >= F32(10.0), x, y).astype(F32)


@functools.lru_cache(maxsize=8)
def hadamard(n: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard matrix of order n (a power of 2), float32 [n, n]: symmetric
    and its own inverse, so rotating q and k by it keeps every q.k, and rotating v and then the
    attention output by it keeps the output (up to float32 rounding). Used for KV rotation:
    spreading an outlier channel over all channels before a row is quantized. Read-only."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"KV rotation needs a head dim that is a power of 2, got {n}")
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    out = (h / np.sqrt(n)).astype(np.float32)
    out.setflags(write=False)
    return out


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """cap * tanh(x / cap), float32."""
    c = F32(cap)
    return np.tanh(x * (F32(1.0) / c)) * c


@functools.lru_cache(maxsize=64)
def _theta_scale(base: float, n_dims: int) -> np.float32:
    # powf(freq_base, -2.0f/n_dims) as ggml: the exponent in float32, the power correctly
    # rounded to float32 as glibc's powf returns it (NumPy's float32 power can be 1 ulp off)
    expo = F32(-2.0) / F32(n_dims)
    return F32(np.float64(F32(base)) ** np.float64(expo))


@jit.njit
def _rope_theta(t, ts, theta):
    """theta[r, i] = t[r] * ts**i by repeated float32 multiplication (ggml's recurrence), one
    compiled call: a decode step's single position took 128 NumPy operations per table."""
    T, half = theta.shape
    for r in range(T):
        v = t[r]
        for i in range(half):
            theta[r, i] = v
            v = v * ts


def rope_theta_ref(positions: np.ndarray, ts: np.float32, half: int) -> np.ndarray:
    """NumPy reference of :func:`_rope_theta`: float32[T, half]."""
    theta = np.empty((len(positions), half), dtype=F32)
    t = np.asarray(positions).astype(F32)
    for i in range(half):
        theta[:, i] = t
        t = t * F32(ts)
    return theta


def rope_cache(positions: np.ndarray, n_dims: int, base: float, freq_scale: float,
               freq_factors: np.ndarray | None = None, ext_factor: float = 0.0,
               n_ctx_orig: int = 0, attn_factor: float = 1.0, beta_fast: float = 32.0,
               beta_slow: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: float32[T, n_dims // 2] for integer ``positions`` int[T].

    The angle of pair i is ``p * theta_scale**i`` built by repeated float32
    multiplication (ggml's recurrence), divided by ``freq_factors[i]``
    (rope_freqs) and multiplied by ``freq_scale`` (1 / linear scaling).
    cos and sin are evaluated in float64 and rounded, i.e. correctly rounded
    float32 values, as glibc's cosf/sinf return, then multiplied by ``attn_factor``.

    YaRN (``ext_factor`` != 0, ggml's rope_yarn): pair i's angle mixes the scaled
    (interpolated) angle with the unscaled (extrapolated) one by a ramp over the pairs between
    the correction dims of ``beta_fast`` and ``beta_slow`` rotations in ``n_ctx_orig``
    positions, and cos / sin are scaled by ``attn_factor * (1 + 0.1 ln(1 / freq_scale))``.
    """
    half = n_dims // 2
    ts = _theta_scale(float(base), n_dims)
    theta = np.empty((len(positions), half), dtype=F32)
    _rope_theta(np.asarray(positions).astype(F32), ts, theta)
    if freq_factors is not None:
        theta = theta / freq_factors.astype(F32)[:half]
    extrap = theta
    theta = theta * F32(freq_scale)
    mscale = F32(attn_factor)
    if ext_factor != 0.0:
        low, high = yarn_corr_dims(n_dims, n_ctx_orig, base, beta_fast, beta_slow)
        i = np.arange(half, dtype=F32)
        ramp = F32(1) - np.clip((i - F32(low)) / F32(max(0.001, high - low)), 0, 1).astype(F32)
        mix = ramp * F32(ext_factor)
        theta = theta * (F32(1) - mix) + extrap * mix
        mscale = mscale * (F32(1) + F32(0.1) * F32(np.log(F32(1) / F32(freq_scale))))
    th = theta.astype(np.float64)
    cos, sin = np.cos(th).astype(F32), np.sin(th).astype(F32)
    if mscale != F32(1):
        cos, sin = cos * mscale, sin * mscale
    return cos, sin


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, base: float, beta_fast: float,
                   beta_slow: float) -> tuple[float, float]:
    """The first and last pair YaRN's ramp runs between (ggml_rope_yarn_corr_dims): the pairs
    that turn ``beta_fast`` and ``beta_slow`` times over ``n_ctx_orig`` positions."""
    def corr(beta):
        return F32(n_dims * np.log(F32(n_ctx_orig) / F32(beta * 2 * np.pi))
                   / F32(2 * np.log(F32(base))))
    return float(max(0.0, np.floor(corr(beta_fast)))), float(min(n_dims - 1.0,
                                                                  np.ceil(corr(beta_slow))))


@jit.njit(inline="always")
def _rope_row(xr, cos, sin, neox):
    """In place over one head's channels xr by one position's cos, sin float32[half]: the
    arithmetic of :func:`rope_ref`, element by element (x0*c exact in float64, minus the
    float32 product x1*s, rounded once)."""
    half = cos.shape[0]
    for i in range(half):
        i0, i1 = (i, i + half) if neox else (2 * i, 2 * i + 1)
        c, s = cos[i], sin[i]
        x0, x1 = xr[i0], xr[i1]
        xr[i0] = np.float32(np.float64(x0) * np.float64(c) - np.float64(x1 * s))
        xr[i1] = np.float32(np.float64(x0) * np.float64(s) + np.float64(x1 * c))


@jit.njit
def _rope_rows(x, cos, sin, neox):
    """In place over x float32[T, H, D]: :func:`_rope_row` for each token and head."""
    T, H, _ = x.shape
    for t in range(T):
        for h in range(H):
            _rope_row(x[t, h], cos[t], sin[t], neox)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> np.ndarray:
    """Rotate the first ``2 * cos.shape[1]`` channels of x float32[T, H, D] in place; returns x.

    NORM mode (llama) rotates adjacent pairs (2i, 2i+1); NEOX mode (gemma3)
    rotates (i, i + n_dims/2). One compiled call, bit-identical to :func:`rope_ref`
    (whose NumPy temporaries cost ~16 us a call, two calls per layer and token).
    """
    if x.dtype != F32 or x.ndim != 3 or not x.flags.c_contiguous:
        raise ValueError(f"rope rotates a C-contiguous float32[T, H, D] in place, got {x.dtype}{list(x.shape)}")
    if cos.shape != sin.shape or cos.shape[0] != x.shape[0] or 2 * cos.shape[1] > x.shape[2]:
        raise ValueError(f"cos/sin {list(cos.shape)}/{list(sin.shape)} do not fit x {list(x.shape)}")
    _rope_rows(x, np.ascontiguousarray(cos, dtype=F32), np.ascontiguousarray(sin, dtype=F32), bool(neox))
    return x


def rope_ref(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> np.ndarray:
    """NumPy reference of :func:`rope` (in place; returns x)."""
    half = cos.shape[1]
    c = cos[:, None, :]
    s = sin[:, None, :]
    if neox:
        x0 = x[..., :half].copy()
        x1 = x[..., half:2 * half].copy()
    else:
        x0 = x[..., 0:2 * half:2].copy()
        x1 = x[..., 1:2 * half:2].copy()
    # ggml's compiled rope contracts x0*c - x1*s into fma(x0, c, -(x1*s)) (and likewise for
    # r1); float64 holds x0*c exactly, so rounding the float64 sum once reproduces the fma
    f64 = np.float64
    r0 = (x0.astype(f64) * c - (x1 * s)).astype(F32)
    r1 = (x0.astype(f64) * s + (x1 * c)).astype(F32)
    if neox:
        x[..., :half] = r0
        x[..., half:2 * half] = r1
    else:
        x[..., 0:2 * half:2] = r0
        x[..., 1:2 * half:2] = r1
    return x


# ---------------------------------------------------------------------------------------
# a decode step's small ops, fused: one compiled call where the layer loop made several
# (each Python-level op costs a few microseconds of dispatch and argument checks, ~25 of
# them per layer and token); the same float32 operations in the same order as the separate
# ops above, so the same bits (tests/test_ops_kernels.py compares them)


@jit.njit(inline="always")
def _rms_row(x, w, e, out):
    """out = rms_norm(x) * w for one row, as :func:`rms_norm_rows` computes each row."""
    n = x.shape[0]
    s = 0.0
    for i in range(n):
        s += np.float64(x[i] * x[i])
    scale = _rms_scale(s, n, e)
    for i in range(n):
        out[i] = (x[i] * scale) * w[i]


@jit.njit(inline="always")
def _norm_rope_heads(a, w, e, cos, sin, neox, norm):
    """Each row (head) of a float32[H, D]: RMSNorm times w (``norm``), then RoPE
    (:func:`_rope_row`) by cos, sin float32[half]."""
    for h in range(a.shape[0]):
        r = a[h]
        if norm:
            _rms_row(r, w, e, r)
        _rope_row(r, cos, sin, neox)


@jit.njit
def qk_norm_rope_fused(q, k, wq, wk, eps, cos, sin, neox, qk_norm, qscale, prescale):
    """In place on q float32[Hq, D] and k float32[Hkv, D] of one token: per-head RMSNorm
    times wq / wk (``qk_norm``), RoPE by cos, sin float32[half], then q *= qscale
    (``prescale``): the arithmetic of rms_norm, rope and the NumPy product in the forward."""
    e = np.float32(eps)
    _norm_rope_heads(q, wq, e, cos, sin, neox, qk_norm)
    _norm_rope_heads(k, wk, e, cos, sin, neox, qk_norm)
    if prescale:
        for h in range(q.shape[0]):
            for i in range(q.shape[1]):
                q[h, i] = q[h, i] * qscale


@jit.njit
def add_norm_fused(x, y, wpost, post, wnext, eps, h):
    """x += rms_norm(y) * wpost (``post``; else x += y), then h = rms_norm(x) * wnext: a
    residual and the next RMSNorm of one token (x, y, h float32[n])."""
    e = np.float32(eps)
    if post:
        _rms_row(y, wpost, e, y)
    for i in range(x.shape[0]):
        x[i] = x[i] + y[i]
    _rms_row(x, wnext, e, h)


def token_logprob(logits: np.ndarray, token: int) -> float:
    """log softmax(logits)[token] for float32[n_vocab] logits (exp in float32, sum in float64)."""
    m = logits.max()
    lse = float(m) + float(np.log(np.exp(logits - m).sum(dtype=np.float64)))
    return float(logits[token]) - lse


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities over the last axis."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


class NonFiniteError(FloatingPointError):
    """NaN or inf where the forward pass needs finite numbers; the message names the layer."""


def all_finite(x: np.ndarray) -> bool:
    """True when ``x`` holds no NaN and no inf."""
    return bool(np.isfinite(x).all())
