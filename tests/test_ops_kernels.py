"""Compiled ops of the forward pass against their NumPy references."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyimp import ops


@settings(deadline=None, max_examples=60)
@given(rows=st.integers(1, 9), n=st.sampled_from([1, 7, 64, 640]), scale=st.floats(1e-3, 1e3),
       eps=st.sampled_from([1e-6, 1e-5]), seed=st.integers(0, 2**31 - 1))
def test_rms_norm_matches_numpy_reference(rows, n, scale, eps, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, 2, n)) * scale).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    got = ops.rms_norm(x, w, eps)
    want = ops.rms_norm_ref(x, w, eps)
    assert got.shape == x.shape and got.dtype == np.float32
    # the two sum the same float32 squares in float64 in different orders (the kernel in
    # element order as ggml, NumPy pairwise): the float64 sums differ by ~1e-16 relative, the
    # float32 mean by at most one rounding, so the outputs by at most 2 ulp (2.4e-7 relative)
    tol = 2.4e-7 * np.abs(want) + np.finfo(np.float32).tiny
    assert np.all(np.abs(got - want) <= tol)


def test_rms_norm_is_ggmls_arithmetic_bit_for_bit():
    # ggml: sum += (double)(x*x) in element order; mean = (float)(sum/n);
    # scale = 1.0f/sqrtf(mean + eps); y = x*scale; then the mul by the weight
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((6, 640)) * 5).astype(np.float32)   # a group of 4 rows and 2 more
    w = rng.standard_normal(640).astype(np.float32)
    want = np.empty_like(x)
    for r in range(6):
        ss = 0.0
        for v in x[r]:
            ss += float(np.float32(v * v))
        scale = np.float32(1.0) / np.sqrt(np.float32(ss / 640) + np.float32(1e-6))
        want[r] = (x[r] * scale) * w
    np.testing.assert_array_equal(ops.rms_norm(x, w, 1e-6), want)
    np.testing.assert_array_equal(ops.rms_norm(x[5:], w, 1e-6), want[5:])


def test_rms_norm_propagates_non_finite_values():
    x = np.array([[1.0, np.inf, 2.0], [1.0, np.nan, 2.0]], np.float32)
    out = ops.rms_norm(x, np.ones(3, np.float32), 1e-6)
    assert np.isnan(out).any(axis=1).all()


@settings(deadline=None, max_examples=40)
@given(T=st.integers(1, 6), H=st.integers(1, 4), half=st.sampled_from([1, 4, 32, 64]),
       extra=st.sampled_from([0, 8]), neox=st.booleans(), pos0=st.integers(0, 40000),
       seed=st.integers(0, 2**31 - 1))
def test_rope_is_the_numpy_reference_bit_for_bit(T, H, half, extra, neox, pos0, seed):
    """The compiled rope does the reference's float32/float64 operations element by element,
    so the results are identical, also for channels past the rotated ones (left alone)."""
    rng = np.random.default_rng(seed)
    D = 2 * half + extra
    x = (rng.standard_normal((T, H, D)) * 3).astype(np.float32)
    cos, sin = ops.rope_cache(np.arange(pos0, pos0 + T), 2 * half, 10000.0, 1.0)
    want = ops.rope_ref(x.copy(), cos, sin, neox)
    got = x.copy()
    assert ops.rope(got, cos, sin, neox) is got
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@settings(deadline=None, max_examples=30)
@given(positions=st.lists(st.integers(0, 2**20), min_size=1, max_size=5),
       half=st.sampled_from([1, 16, 64, 128]), base=st.sampled_from([10000.0, 1e6, 500000.0]))
def test_rope_angles_are_the_numpy_recurrence_bit_for_bit(positions, half, base):
    """The compiled angle recurrence (p * ts**i by repeated float32 products) gives the NumPy
    reference's bits, also at positions where float32 products round."""
    ts = ops._theta_scale(base, 2 * half)
    got = np.empty((len(positions), half), np.float32)
    ops._rope_theta(np.asarray(positions).astype(np.float32), ts, got)
    want = ops.rope_theta_ref(np.asarray(positions), ts, half)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_gelu_tanh_is_the_formula_bit_for_bit():
    """ops.gelu_tanh (in-place passes) computes exactly the one-expression formula."""
    F = np.float32
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(4096).astype(F) * F(4), np.array(
        [0.0, -0.0, 1e-30, -1e-30, 10.0, -10.0, 3e4, -3e4, np.inf, -np.inf], F)])
    with np.errstate(over="ignore", invalid="ignore"):
        want = F(0.5) * x * (F(1.0) + np.tanh(ops._SQRT_2_OVER_PI * x * (F(1.0) + ops._GELU_COEF_A * x * x)))
        got = ops.gelu_tanh(x.reshape(2, -1)).reshape(-1)
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))   # NaN of -inf included


def test_gelu_tanh_mul_is_gelu_tanh_times_u_bit_for_bit():
    """ops.gelu_tanh_mul (two compiled loops around NumPy's tanh) gives the bits of
    ``gelu_tanh(x) * u``, special values and a 2-D shape included."""
    F = np.float32
    rng = np.random.default_rng(4)
    x = np.concatenate([rng.standard_normal(4086).astype(F) * F(4), np.array(
        [0.0, -0.0, 1e-30, -1e-30, 10.0, -10.0, 3e4, -3e4, np.inf, -np.inf], F)])
    u = rng.standard_normal(x.size).astype(F)
    u[:3] = [np.inf, 0.0, np.nan]
    with np.errstate(over="ignore", invalid="ignore"):
        want = ops.gelu_tanh(x) * u
        got = ops.gelu_tanh_mul(x.reshape(2, -1), u.reshape(2, -1))
    assert got.shape == (2, x.size // 2) and got.dtype == np.float32
    assert np.array_equal(got.reshape(-1).view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="shapes"):
        ops.gelu_tanh_mul(x, u[:-1])


def _bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@settings(max_examples=40, deadline=None)
@given(hq=st.integers(1, 8), hkv=st.integers(1, 4), half=st.integers(1, 16), extra=st.integers(0, 6),
       neox=st.booleans(), norm=st.booleans(), prescale=st.booleans(), pos=st.integers(0, 40000),
       seed=st.integers(0, 2 ** 32 - 1))
def test_fused_qk_norm_rope_is_the_separate_ops_bit_for_bit(hq, hkv, half, extra, neox, norm, prescale,
                                                            pos, seed):
    """A one-token forward's fused call (norms, RoPE, q prescale) gives the bits of rms_norm,
    rope and the NumPy product it replaces."""
    rng = np.random.default_rng(seed)
    D = 2 * half + extra
    q = (rng.standard_normal((1, hq, D)) * 3).astype(np.float32)
    k = (rng.standard_normal((1, hkv, D)) * 3).astype(np.float32)
    wq, wk = (rng.standard_normal(D) + 1).astype(np.float32), (rng.standard_normal(D) + 1).astype(np.float32)
    cos, sin = ops.rope_cache(np.array([pos]), 2 * half, 10000.0, 1.0)
    scale = np.float32(1.0 / np.sqrt(D))
    want_q, want_k = q.copy(), k.copy()
    if norm:
        want_q, want_k = ops.rms_norm(want_q, wq, 1e-6), ops.rms_norm(want_k, wk, 1e-6)
    ops.rope(want_q, cos, sin, neox)
    ops.rope(want_k, cos, sin, neox)
    if prescale:
        want_q *= scale
    ops.qk_norm_rope_fused(q[0], k[0], wq, wk, 1e-6, cos[0], sin[0], neox, norm, scale, prescale)
    assert np.array_equal(_bits(q), _bits(want_q))
    assert np.array_equal(_bits(k), _bits(want_k))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 700), post=st.booleans(), seed=st.integers(0, 2 ** 32 - 1))
def test_fused_add_norm_is_the_separate_ops_bit_for_bit(n, post, seed):
    """x += rms_norm(y) * wpost (or x += y), h = rms_norm(x) * wnext: the bits of the forward's
    separate rms_norm calls and NumPy sum."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((1, n)) * 10).astype(np.float32)
    y = (rng.standard_normal((1, n)) * 10).astype(np.float32)
    wp, wn = (rng.standard_normal(n) + 1).astype(np.float32), (rng.standard_normal(n) + 1).astype(np.float32)
    want_x = x + (ops.rms_norm(y, wp, 1e-5) if post else y)
    want_h = ops.rms_norm(want_x, wn, 1e-5)
    h = np.full_like(x, np.nan)
    ops.add_norm_fused(x[0], y[0], wp, post, wn, 1e-5, h[0])
    assert np.array_equal(_bits(x), _bits(want_x))
    assert np.array_equal(_bits(h), _bits(want_h))
