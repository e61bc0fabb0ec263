"""Importance update: fp16 codec, Numba == NumPy, FP16 stall / saturation, decay, block updates."""
import numpy as np
from hypothesis import given, settings, strategies as st

from pyimp.attention.importance import (FP16_MAX, FP16_STALL, PARALLEL_MIN_WORK, decay_importance,
                                        encode_fp16, fp16_lut, importance_update,
                                        importance_update_blocks)


def test_fp16_lut_is_exact():
    bits = np.arange(65536, dtype=np.uint16)
    lut = fp16_lut()
    ref = bits.view(np.float16).astype(np.float32)
    same = (lut == ref) | (np.isnan(lut) & np.isnan(ref))
    assert same.all()
    assert not lut.flags.writeable


def test_encoder_matches_numpy_exhaustively():
    """float32 -> fp16 bits (round to nearest even) for every fp16 value, every midpoint between
    neighbours (the ties), one float32 ulp either side of them, and random float32 bit patterns."""
    h = np.arange(65536, dtype=np.uint16).view(np.float16)
    fin = np.isfinite(h)
    f = h.astype(np.float32)
    assert np.array_equal(encode_fp16(f[fin]), h[fin].view(np.uint16))
    assert np.isnan(encode_fp16(f[np.isnan(h)]).view(np.float16)).all()
    vals = np.unique(f[fin])
    mid = ((vals[:-1].astype(np.float64) + vals[1:]) / 2).astype(np.float32)  # exact in float32
    big = np.float32(np.inf)
    with np.errstate(over="ignore"):
        for x in [mid, np.nextafter(mid, big), np.nextafter(mid, -big),
                  np.array([65519.99, 65520.0, 70000.0, -65520.0, 2.0**-25, 2.0**-26], np.float32)]:
            assert np.array_equal(encode_fp16(x), x.astype(np.float16).view(np.uint16))
        r = np.random.default_rng(0).integers(0, 2**32, 400_000, dtype=np.uint64)
        r = r.astype(np.uint32).view(np.float32)
        r = r[~np.isnan(r)]
        assert np.array_equal(encode_fp16(r), r.astype(np.float16).view(np.uint16))


@st.composite
def update_case(draw):
    NB = draw(st.integers(1, 6))
    B = draw(st.sampled_from([1, 2, 4, 8]))
    Hq = draw(st.integers(1, 6))
    n = draw(st.integers(1, NB * B))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    scale = draw(st.sampled_from([1.0, 100.0, 3000.0, 40000.0]))
    imp = (rng.uniform(0, 1, (NB, B, Hq)) * scale).astype(np.float16)
    new = (rng.uniform(0, 1, (Hq, n)) * draw(st.sampled_from([0.01, 1.0, 50.0, 30000.0])))
    bt = rng.permutation(NB).astype(np.int32)
    return imp, bt, new.astype(np.float32), rng


@settings(max_examples=60, deadline=None)
@given(update_case(), st.sampled_from([1.0, 0.5, 0.9]), st.data())
def test_update_numba_equals_numpy_exactly(case, decay, data):
    """Same float32 arithmetic and the same rounding: bit-identical results."""
    imp, bt, new, _ = case
    pos_lo = data.draw(st.integers(0, new.shape[1]))
    a, b = imp.copy(), imp.copy()
    importance_update(a, bt, new, pos_lo, decay)
    importance_update(b, bt, new, pos_lo, decay, backend="numpy")
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
    assert np.isfinite(a).all()  # saturates, never overflows


@settings(max_examples=40, deadline=None)
@given(update_case())
def test_update_is_the_documented_formula(case):
    imp, bt, new, _ = case
    NB, B, Hq = imp.shape
    a = imp.copy()
    importance_update(a, bt, new, 0, 1.0)
    for p in range(new.shape[1]):
        pb, t = bt[p // B], p % B
        x = imp[pb, t].astype(np.float32) + new[:, p]
        assert np.array_equal(a[pb, t], np.minimum(x, np.float32(FP16_MAX)).astype(np.float16))
    # positions >= n untouched
    touched = np.zeros((NB, B), bool)
    for p in range(new.shape[1]):
        touched[bt[p // B], p % B] = True
    assert np.array_equal(a[~touched], imp[~touched])


def test_below_pos_lo_untouched_without_decay():
    imp = np.full((2, 4, 3), 1.5, np.float16)
    bt = np.array([1, 0], np.int32)
    new = np.ones((3, 8), np.float32)
    importance_update(imp, bt, new, pos_lo=5)
    vals = np.array([imp[bt[p // 4], p % 4, 0] for p in range(8)], np.float32)
    assert np.array_equal(vals, [1.5] * 5 + [2.5] * 3)


def test_stall_at_2048():
    """Spacing is 2 from 2048 on: +0.9 and +1.0 (tie, to even) are lost, +1.01 rounds to 2050."""
    bt = np.array([0], np.int32)
    for backend in ["numba", "numpy"]:
        for inc, expect in [(0.9, 2048.0), (1.0, 2048.0), (1.01, 2050.0)]:
            imp = np.full((1, 1, 1), FP16_STALL, np.float16)
            importance_update(imp, bt, np.full((1, 1), inc, np.float32), backend=backend)
            assert float(imp[0, 0, 0]) == expect
        # just below the stall a full decode step still counts
        imp = np.full((1, 1, 1), 2047.0, np.float16)
        importance_update(imp, bt, np.full((1, 1), 1.0, np.float32), backend=backend)
        assert float(imp[0, 0, 0]) == 2048.0
        # and 100 decode steps of p = 1 from 2000 never get past 2048
        imp = np.full((1, 1, 1), 2000.0, np.float16)
        for _ in range(100):
            importance_update(imp, bt, np.ones((1, 1), np.float32), backend=backend)
        assert float(imp[0, 0, 0]) == 2048.0


def test_saturation_at_65504():
    bt = np.array([0], np.int32)
    for backend in ["numba", "numpy"]:
        imp = np.full((1, 1, 2), 65000.0, np.float16)
        importance_update(imp, bt, np.array([[600.0], [1e9]], np.float32), backend=backend)
        assert imp[0, 0].tolist() == [FP16_MAX, FP16_MAX]  # clamped, not inf
        importance_update(imp, bt, np.array([[1.0], [1e30]], np.float32), backend=backend)
        assert imp[0, 0].tolist() == [FP16_MAX, FP16_MAX]


def test_decay_converges_to_mass_over_one_minus_decay():
    """x_{k+1} = decay * x_k + 1 -> 1 / (1 - decay) = 10 (fp16 rounding of each step aside)."""
    bt = np.array([0], np.int32)
    imp = np.zeros((1, 1, 1), np.float16)
    for _ in range(150):  # 10 * 0.9**150 ~ 1e-6: converged
        importance_update(imp, bt, np.ones((1, 1), np.float32), decay=0.9)
    # fixed point of the rounded map lies within a few fp16 ulps (2**-7 at 10) of 10
    assert abs(float(imp[0, 0, 0]) - 10.0) <= 4 * 2**-7


def test_decay_applies_to_every_position():
    imp = np.full((3, 2, 2), 8.0, np.float16)
    bt = np.array([2, 0, 1], np.int32)
    new = np.zeros((2, 5), np.float32)
    new[:, 4] = 1.0
    importance_update(imp, bt, new, pos_lo=4, decay=0.5)
    got = np.array([imp[bt[p // 2], p % 2, 0] for p in range(6)], np.float32)
    assert got.tolist() == [4.0, 4.0, 4.0, 4.0, 5.0, 8.0]  # p = 5 is beyond n_pos
    decay_importance(imp, bt, 6, 0.25)
    got = np.array([imp[bt[p // 2], p % 2, 1] for p in range(6)], np.float32)
    assert got.tolist() == [1.0, 1.0, 1.0, 1.0, 1.25, 2.0]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.sampled_from([1, 2, 4]), st.integers(1, 3), st.integers(1, 3),
       st.integers(0, 2**31 - 1), st.data())
def test_block_update(NBl, B, Hkv, G, seed, data):
    """Sparse update == the dense update with the scattered mass; Numba == NumPy bit for bit."""
    rng = np.random.default_rng(seed)
    Hq = Hkv * G
    NB = NBl + 2
    n_ctx = data.draw(st.integers(1, NBl * B))
    n_lb = -(-n_ctx // B)
    bt = rng.permutation(NB)[:NBl].astype(np.int32)
    nsets = data.draw(st.sampled_from([1, Hkv, Hq]))
    K = n_lb + 1
    sel = np.full((nsets, K), -1, np.int32)
    cnt = np.zeros(nsets, np.int32)
    for i in range(nsets):
        c = int(rng.integers(1, n_lb + 1))
        sel[i, :c] = np.sort(rng.choice(n_lb, c, replace=False))
        cnt[i] = c
    probs = rng.uniform(0, 1, (Hq, K, B)).astype(np.float32)
    imp = rng.uniform(0, 5, (NB, B, Hq)).astype(np.float16)
    a, b, c_ = imp.copy(), imp.copy(), imp.copy()
    importance_update_blocks(a, bt, sel, cnt, probs, n_ctx)
    importance_update_blocks(b, bt, sel, cnt, probs, n_ctx, backend="numpy")
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
    dense = np.zeros((Hq, n_lb * B), np.float32)
    hps = Hq // nsets
    for h in range(Hq):
        for k in range(cnt[h // hps]):
            lb = sel[h // hps, k]
            dense[h, lb * B:(lb + 1) * B] = probs[h, k]
    importance_update(c_, bt, np.ascontiguousarray(dense[:, :n_ctx]), 0, 1.0)
    assert np.array_equal(a.view(np.uint16), c_.view(np.uint16))


def test_parallel_kernels_match_numpy():
    """Updates large enough for the multi-threaded kernels (>= PARALLEL_MIN_WORK entries)."""
    rng = np.random.default_rng(21)
    NB, B, Hq = 80, 32, 32
    n = 70 * B + 5
    assert Hq * n >= PARALLEL_MIN_WORK
    bt = rng.permutation(NB)[:71].astype(np.int32)
    imp = rng.uniform(0, 100, (NB, B, Hq)).astype(np.float16)
    new = rng.uniform(0, 2, (Hq, n)).astype(np.float32)
    for pos_lo, decay in [(0, 1.0), (999, 1.0), (0, 0.75)]:
        a, b = imp.copy(), imp.copy()
        importance_update(a, bt, new, pos_lo, decay)
        importance_update(b, bt, new, pos_lo, decay, backend="numpy")
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
    K = 71
    sel = np.sort(rng.permutation(71))[None].astype(np.int32)
    cnt = np.array([K], np.int32)
    probs = rng.uniform(0, 1, (Hq, K, B)).astype(np.float32)
    assert Hq * K * B >= PARALLEL_MIN_WORK
    a, b = imp.copy(), imp.copy()
    importance_update_blocks(a, bt, sel, cnt, probs, n)
    importance_update_blocks(b, bt, sel, cnt, probs, n, backend="numpy")
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
