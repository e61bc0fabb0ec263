"""loaders.half's fixed-order sums (lane_dot, lane_sum, lane_dot_rows, hsum16) against their
NumPy reference, bit for bit: the same operations in the same order, for every length class
(whole groups of four 16-element chunks, leftover chunks, a tail past the last chunk) and for
fp16 operands."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numba import njit
from loaders.half import hsum16, lane_dot, lane_dot_ref, lane_dot_rows, lane_sum


@njit
def _dot(a, ao, b, bo, n):
    return lane_dot(a, ao, b, bo, n)


@njit
def _sum(x, xo, n):
    return lane_sum(x, xo, n)


@njit
def _hsum(x, xo):
    return hsum16(x, xo)


@njit
def _rows4(a, r0, b, bo, n, out, scale):
    lane_dot_rows(a, r0, 4, b, bo, n, out, 1, 2, scale)


def _data(n, seed):
    rng = np.random.default_rng(seed)
    # values of mixed magnitude: a sum's rounding depends on its order
    return (rng.standard_normal(n) * np.exp(rng.uniform(-4, 4, n))).astype(np.float32)


@settings(deadline=None, max_examples=60)
@given(n=st.integers(0, 300), ao=st.integers(0, 5), bo=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_lane_dot_and_sum_are_the_reference_bit_for_bit(n, ao, bo, seed):
    a = _data(n + ao, seed)
    b = _data(n + bo, seed + 1)
    assert _dot(a, ao, b, bo, n) == lane_dot_ref(a[ao:], b[bo:])
    assert _sum(a, ao, n) == lane_dot_ref(a[ao:])


@pytest.mark.parametrize("n", [16, 64, 100, 256])
def test_fp16_operands_are_converted_exactly(n):
    a = _data(n, 3)
    h = _data(n + 2, 4).astype(np.float16)
    assert _dot(a, 0, h.view(np.uint16), 2, n) == lane_dot_ref(a, h[2:].astype(np.float32))


def test_the_order_is_the_documented_one_not_a_plain_sum():
    """A sum whose value depends on the order (1 + 2**-24 sixteen times against a large
    cancelling pair): the reference's order, not left-to-right."""
    x = np.zeros(64, np.float32)
    x[0], x[1:17], x[32] = 1.0, np.float32(2.0 ** -24), -1.0
    left_to_right = np.float32(0.0)
    for v in x:
        left_to_right = np.float32(left_to_right + v)
    assert _sum(x, 0, 64) == lane_dot_ref(x)
    assert _sum(x, 0, 64) != left_to_right


def test_hsum16_halves():
    x = _data(20, 9)
    v = x[3:19]
    ref = v.copy()
    while ref.size > 1:
        ref = ref[:ref.size // 2] + ref[ref.size // 2:]
    assert _hsum(x, 3) == ref[0]


@pytest.mark.parametrize("n", [15, 32, 200, 256])
@pytest.mark.parametrize("half", [False, True])
def test_lane_dot_rows(n, half):
    rng = np.random.default_rng(n)
    a = _data(6 * n, 5).reshape(6, n)
    b = _data(n + 1, 6)
    if half:
        b = b.astype(np.float16)
    out = np.full(9, 7.0, np.float32)
    sc = np.float32(rng.uniform(0.1, 2.0))
    _rows4(a, 1, b.view(np.uint16) if half else b, 1, n, out, sc)
    bf = b[1:].astype(np.float32)
    for g in range(4):
        assert out[1 + 2 * g] == np.float32(lane_dot_ref(a[1 + g], bf, rows=True) * sc), g
    assert (out[[0, 2, 4, 6, 8]] == 7.0).all()           # only the strided slots written


def test_non_contiguous_operands_are_refused_at_compile_time():
    from numba.core.errors import TypingError
    a = np.ones((4, 32), np.float32)
    with pytest.raises(TypingError):
        _dot(a[:, 0], 0, a[0], 0, 4)
