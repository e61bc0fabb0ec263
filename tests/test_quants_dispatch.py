"""The kernel dispatcher over every supported weight type, and its input checks."""
from __future__ import annotations

import time

import gguf
import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loaders import quants as Q
from loaders import quants_k as K
from loaders import quants_legacy as L
from loaders.ggml_types import SUPPORTED_TYPES, block_size, row_bytes
from tools import ggml_oracle

QT = gguf.GGMLQuantizationType
U = 2.0 ** -24  # float32 unit roundoff
K_TYPES = {QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K}
ALL = sorted(SUPPORTED_TYPES, key=lambda t: t.name)

needs_oracle = pytest.mark.skipif(not ggml_oracle.available(),
                                  reason=f"libggml oracle unavailable: {ggml_oracle.unavailable_reason()}")


def require(qtype):
    if qtype not in Q.available_types():
        reason = "loaders.quants_k is not present" if qtype in K_TYPES else "no kernels"
        pytest.skip(f"{qtype.name}: {reason}")


# byte offsets of the fp16 super-block scales inside one K-quant block: d, and dmin where
# the type has one
K_SCALE_OFFSETS = {QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}


def weights(qtype, rows, n, seed=0):
    """Valid weights of qtype, the same on every machine: gguf-py's quantizer of normal
    values; for K-quants (gguf-py has no K quantizer) random quant bytes with random
    moderate fp16 super-block scales."""
    rng = np.random.default_rng(seed)
    if qtype in K_TYPES:
        raw = rng.integers(0, 256, (rows, row_bytes(qtype, n)), dtype=np.uint8)
        blk = raw.reshape(rows, n // 256, -1)
        for off in K_SCALE_OFFSETS[qtype]:
            d = rng.uniform(2.0 ** -12, 2.0 ** -6, blk.shape[:2]).astype(np.float16)
            blk[:, :, off:off + 2] = d.view(np.uint8).reshape(*blk.shape[:2], 2)
        return raw
    w = rng.standard_normal((rows, n)).astype(np.float32)
    return np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8).reshape(rows, -1)


def ggml_quantized(qtype, rows, n, seed=0):
    """Weights from ggml's own quantizer (needs the oracle)."""
    return ggml_oracle.quantize(qtype, np.random.default_rng(seed).standard_normal((rows, n)).astype(np.float32))


def n_for(qtype, nblocks=3):
    return max(block_size(qtype), 32) * nblocks * (1 if block_size(qtype) == 256 else 4)


def worst_case(n, w, X):
    """|err| of any float32 summation order of n products against exact: gamma_(n+1) * sum|w*x|."""
    k = n + 1
    return k * U / (1 - k * U) * (np.abs(X.astype(np.float64)) @ np.abs(w.astype(np.float64)).T)


def converted_activations(X, act):
    """float32 values of X after conversion to the activation type ``act`` (what the ggml
    numerics multiply the weights with)."""
    if act == QT.F32:
        return X
    xq = np.ascontiguousarray(Q.quantize_activations(X, act)).view(np.uint8)
    if act == QT.Q8_K:
        return K.dequantize_act_q8_k(xq)
    if act == QT.Q8_1:
        # block: fp16 d, fp16 s (= d * sum q), 32 int8 q; value = d * q
        blk = xq.reshape(X.shape[0], -1, 36)
        d = np.ascontiguousarray(blk[:, :, 0:2]).view(np.float16).astype(np.float32)
        q = np.ascontiguousarray(blk[:, :, 4:]).view(np.int8).astype(np.float32)
        return (d * q).reshape(X.shape)
    return L.dequantize_reference(act, xq).reshape(X.shape)


def q8_1_sum_term(raw, qtype, X):
    """Q4_1/Q5_1 x Q8_1: ggml adds m_w * s_x per block, with s_x = fp16(d * sum q) stored in
    the activation block, not the exact d * sum q of the converted values. Returns
    sum over blocks |m_w| * |s_x - d * sum q| [m, rows] (zeros for other types)."""
    if qtype not in (QT.Q4_1, QT.Q5_1):
        return np.zeros((X.shape[0], raw.shape[0]))
    m_w = np.ascontiguousarray(raw.reshape(raw.shape[0], X.shape[1] // 32, -1)[:, :, 2:4])
    m_w = m_w.view(np.float16).astype(np.float64)[:, :, 0]
    blk = np.ascontiguousarray(Q.quantize_activations(X, QT.Q8_1)).view(np.uint8).reshape(X.shape[0], -1, 36)
    d = np.ascontiguousarray(blk[:, :, 0:2]).view(np.float16).astype(np.float64)[:, :, 0]
    s_x = np.ascontiguousarray(blk[:, :, 2:4]).view(np.float16).astype(np.float64)[:, :, 0]
    qsum = np.ascontiguousarray(blk[:, :, 4:]).view(np.int8).astype(np.float64).sum(axis=2)
    return np.abs(s_x - d * qsum) @ np.abs(m_w).T


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_dispatch_every_supported_type(qtype):
    require(qtype)
    n, rows, m = n_for(qtype), 37, 3
    raw = weights(qtype, rows, n)
    X = np.random.default_rng(1).standard_normal((m, n)).astype(np.float32)

    w = Q.dequantize(raw, qtype, n)
    assert w.shape == (rows, n) and w.dtype == np.float32
    want = gguf.quants.dequantize(raw, qtype).reshape(rows, n)
    assert np.array_equal(w.view(np.uint32), want.view(np.uint32))  # exact, bit patterns included

    idx = np.array([5, 0, 36, 5])
    assert np.array_equal(Q.dequantize_rows(raw, qtype, n, idx).view(np.uint32), w[idx].view(np.uint32))

    ref = X.astype(np.float64) @ w.astype(np.float64).T
    # fp32 numerics: float32 products and sums in some fixed order, never worse than the
    # recursive-summation bound gamma_(n+1) * sum|w*x| (kernels use lanes, BLAS its own blocking)
    bound = worst_case(n, w, X)
    mv = Q.matvec(raw, qtype, n, X[0])
    assert mv.shape == (rows,) and np.all(np.abs(mv - ref[0]) <= bound[0])
    mm = Q.matmul(raw, qtype, n, X)
    assert mm.shape == (m, rows) and np.all(np.abs(mm - ref) <= bound)
    mm1 = Q.matmul(raw, qtype, n, X[:1])
    assert np.array_equal(mm1[0], mv)  # m == 1 goes through matvec

    # ggml numerics: integer/float dots of the converted activations, never worse than the
    # same recursive-summation bound on the converted operands
    g = Q.matmul(raw, qtype, n, X, numerics="ggml")
    assert g.shape == (m, rows) and np.all(np.isfinite(g))
    xa = converted_activations(X, Q.kernels(qtype).act_type)
    ref_g = xa.astype(np.float64) @ w.astype(np.float64).T
    assert np.all(np.abs(g - ref_g) <= worst_case(n, w, xa) + q8_1_sum_term(raw, qtype, X))
    gv = Q.matvec(raw, qtype, n, X[0], numerics="ggml")
    assert np.array_equal(gv, g[0])  # m == 1 goes through the same kernel


@needs_oracle
@pytest.mark.parametrize("source", ["fixed", "ggml_quantizer"])
@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_dispatch_ggml_numerics_vs_libggml(qtype, source):
    require(qtype)
    n, rows, m = n_for(qtype), 37, 3
    raw = weights(qtype, rows, n) if source == "fixed" else ggml_quantized(qtype, rows, n)
    X = np.random.default_rng(1).standard_normal((m, n)).astype(np.float32)
    w = Q.dequantize(raw, qtype, n)
    g = Q.matmul(raw, qtype, n, X, numerics="ggml")
    want = ggml_oracle.matmul(qtype, raw, X)
    scale = np.abs(X.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    # acceptance bar for ggml numerics: within 3e-7 of sum|w*x| (the scale of a dot
    # product's rounding errors; |result| itself can be tiny through cancellation)
    assert np.all(np.abs(g - want) <= 3e-7 * scale)


@needs_oracle
@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_quantize_activations_bytes(qtype):
    require(qtype)
    act = Q.kernels(qtype).act_type
    assert int(act) == ggml_oracle.vec_dot_type(qtype)  # act_type is ggml's vec_dot_type
    n = n_for(qtype)
    X = (np.random.default_rng(2).standard_normal((2, n)) * 3).astype(np.float32)
    xq = Q.quantize_activations(X, act)
    for i in range(2):
        got = np.ascontiguousarray(xq[i]).view(np.uint8)
        assert np.array_equal(got, ggml_oracle.from_float(act, X[i]))  # byte equality


def test_fp32_matmul_tiles(monkeypatch):
    """Row tiles of the fp32 matmul cover all rows, including a short last tile."""
    monkeypatch.setattr(Q, "MATMUL_TILE_ROWS", 16)
    n, rows = 64, 53
    raw = weights(QT.Q8_0, rows, n)
    X = np.random.default_rng(3).standard_normal((4, n)).astype(np.float32)
    w = Q.dequantize(raw, QT.Q8_0, n)
    got = Q.matmul(raw, QT.Q8_0, n, X)
    assert np.all(np.abs(got - X.astype(np.float64) @ w.T.astype(np.float64)) <= worst_case(n, w, X))


def test_typed_float_inputs():
    rng = np.random.default_rng(4)
    w32 = rng.standard_normal((6, 40)).astype(np.float32)
    x = rng.standard_normal(40).astype(np.float32)
    for qtype, arr in [(QT.F32, w32), (QT.F16, w32.astype(np.float16)),
                       (QT.F16, w32.astype(np.float16).view(np.uint16)),
                       (QT.BF16, (w32.view(np.uint32) >> 16).astype(np.uint16))]:
        via_bytes = Q.matvec(arr.view(np.uint8), qtype, 40, x)
        assert np.array_equal(Q.matvec(arr, qtype, 40, x), via_bytes)
        assert np.array_equal(Q.dequantize(arr.ravel(), qtype, 40), Q.dequantize(arr, qtype, 40))
    # a read-only memory-map-like view is accepted as is
    ro = w32.view(np.uint8)
    ro.flags.writeable = False
    assert np.array_equal(Q.dequantize(ro, QT.F32, 40), w32)


GROUP_TYPES = sorted((t for t in Q.available_types() if Q.kernels(t).matvec_group is not None),
                     key=lambda t: t.name)


def test_every_quantized_type_takes_matvec_groups():
    assert {t for t in Q.available_types() if t not in (QT.F32, QT.F16, QT.BF16)} <= set(GROUP_TYPES)


@settings(max_examples=40, deadline=None)
@given(qtype=st.sampled_from(GROUP_TYPES), rows=st.lists(st.integers(1, 90), min_size=1, max_size=3),
       seed=st.integers(0, 2 ** 16))
def test_matvec_group_is_each_matrix_matvec_bit_for_bit(qtype, rows, seed):
    """One grouped call over 1-3 matrices (a layer's q, k, v) gives each row the bits of its own
    matrix's matvec: work items cross the matrices' boundaries (up to 270 rows in 64 items),
    each row's sum is unchanged. Read-only rows, as the engine's memory-mapped weights."""
    n = n_for(qtype, 1)
    raws = []
    for i, r in enumerate(rows):
        raw = Q.as_raw(weights(qtype, r, n, seed + i), qtype, n)
        raw.flags.writeable = False
        raws.append(raw)
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    out = np.full(sum(rows), np.nan, np.float32)
    Q.kernels(qtype).matvec_group(tuple(raws), x, out)
    want = np.concatenate([Q.matvec(raw, qtype, n, x) for raw in raws])
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))


def test_out_argument_is_filled():
    raw = weights(QT.Q8_0, 9, 64)
    x = np.ones(64, np.float32)
    out = np.zeros(9, np.float32)
    res = Q.matvec(raw, QT.Q8_0, 64, x, out=out)
    assert res is out and np.array_equal(out, Q.matvec(raw, QT.Q8_0, 64, x))
    out2 = np.zeros((2, 9), np.float32)
    res2 = Q.matmul(raw, QT.Q8_0, 64, np.ones((2, 64), np.float32), out=out2)
    assert res2 is out2 and np.array_equal(out2[0], out)


@pytest.mark.parametrize("call, match", [
    (lambda raw: Q.dequantize(raw, QT.Q8_0, 48), "multiple of"),
    (lambda raw: Q.dequantize(raw[:, :-1], QT.Q8_0, 64), "bytes"),
    (lambda raw: Q.dequantize(raw.ravel()[:-3], QT.Q8_0, 64), "whole rows"),
    (lambda raw: Q.dequantize(raw.view(np.float32), QT.Q8_0, 64), "expected uint8"),
    (lambda raw: Q.dequantize(raw[None], QT.Q8_0, 64), "1-D or 2-D"),
    (lambda raw: Q.matvec(raw, QT.Q8_0, 64, np.ones(63, np.float32)), "x must be"),
    (lambda raw: Q.matmul(raw, QT.Q8_0, 64, np.ones((2, 32), np.float32)), "X must be"),
    (lambda raw: Q.matvec(raw, QT.Q8_0, 64, np.ones(64, np.float32), numerics="fast"), "numerics"),
    (lambda raw: Q.matvec(raw, QT.Q8_0, 64, np.ones(64, np.float32), out=np.zeros(3, np.float32)), "out must"),
    (lambda raw: Q.dequantize(raw, QT.IQ2_XS, 256), "no kernels|multiple of"),
    (lambda raw: Q.quantize_activations(np.ones((2, 64), np.float32), QT.IQ2_XS), "no activation"),
])
def test_clear_errors(call, match):
    raw = np.zeros((4, row_bytes(QT.Q8_0, 64)), np.uint8)
    with pytest.raises(ValueError, match=match):
        call(raw)


def test_as_raw_fast_path_only_for_what_it_would_return():
    """as_raw hands back an array that is already read-only uint8[rows, row_bytes] as it is (a
    decode step's calls), and still checks every other input after that row size is known."""
    raw = weights(QT.Q8_0, 4, 64)
    r = Q.as_raw(raw, QT.Q8_0, 64)
    assert r is not raw and not r.flags.writeable           # a writable array: a read-only view
    assert Q.as_raw(r, QT.Q8_0, 64) is r and Q.as_raw(r, int(QT.Q8_0), 64) is r
    with pytest.raises(ValueError, match="bytes"):          # the same array, another row length
        Q.as_raw(r, QT.Q8_0, 96)
    with pytest.raises(ValueError, match="bytes"):          # another type of the same block size
        Q.as_raw(r, QT.Q4_0, 64)
    x = np.ones(64, np.float32)
    assert np.array_equal(Q.matvec(r, int(QT.Q8_0), 64, x), Q.matvec(raw, QT.Q8_0, 64, x))


@pytest.mark.parametrize("qtype", sorted(Q.available_types(), key=int), ids=lambda q: q.name)
def test_rows_of_no_elements_give_zeros(qtype):
    """An empty row's dot product is 0 in every type's matvec (the Q4_K driver that decodes
    each block's head a block ahead skips such rows before its first head)."""
    out = Q.matvec(np.zeros((3, 0), np.uint8), qtype, 0, np.zeros(0, np.float32))
    assert np.array_equal(out, np.zeros(3, np.float32))


def test_dequantize_rows_bounds():
    raw = np.zeros((4, row_bytes(QT.Q8_0, 64)), np.uint8)
    with pytest.raises(IndexError):
        Q.dequantize_rows(raw, QT.Q8_0, 64, [4])


class _Clock:
    """A clock for ThreadChoice that moves only when a call advances it: the timed calls take
    exactly the time they say, whatever the machine does meanwhile."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 Numba threads")
@pytest.mark.parametrize("faster", ["serial", "parallel"])
def test_thread_choice_keeps_the_measured_faster_mode(faster):
    """ThreadChoice alternates serial and parallel calls for its trials, keeps the mode whose best
    time was lower (here 20 ms against 1 ms on its clock), and tries again when the thread
    count changes; the caller's thread count is restored after each call."""
    seen, clock = [], _Clock()

    def call(out):
        n = numba.get_num_threads()
        seen.append(n)
        clock.now += 0.02 if (n == 1) == (faster == "parallel") else 0.001
        out[0] += 1

    choice, out = Q.ThreadChoice(clock=clock), np.zeros(1)
    prev = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        for _ in range(2 * Q.ThreadChoice.TRIALS + 4):
            choice.run(call, out)
            assert numba.get_num_threads() == 2
        trials = 2 * Q.ThreadChoice.TRIALS
        assert sorted(seen[:trials]) == [1] * Q.ThreadChoice.TRIALS + [2] * Q.ThreadChoice.TRIALS
        assert seen[trials:] == [1 if faster == "serial" else 2] * 4
        assert choice.parallel == (faster == "parallel") and out[0] == len(seen)
        numba.set_num_threads(1)           # one thread: nothing to choose, no trials
        choice.run(call, out)
        assert choice.parallel is None and seen[-1] == 1
    finally:
        numba.set_num_threads(prev)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 Numba threads")
def test_thread_choice_is_checked_again_and_undoes_a_choice_made_while_slowed():
    """A choice made while the parallel mode was slowed (a call takes 10 ms serial, 20 ms
    parallel while the other CPU is busy, no time once it is free, on the choice's clock) is
    checked again after RECHECK calls, then after twice as many: one timed call in each mode,
    and the best times decide anew, so parallel wins once it is fast. Each call runs exactly
    once."""
    class Quick(Q.ThreadChoice):
        RECHECK = 4
    seen, slow, clock = [], {"parallel": True}, _Clock()

    def call(out):
        n = numba.get_num_threads()
        seen.append(n)
        clock.now += 0.01 if n == 1 else 0.02 if slow["parallel"] else 0.0
        out[0] += 1

    choice, out = Quick(clock=clock), np.zeros(1)
    prev = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        trials = 2 * Quick.TRIALS
        for _ in range(trials):
            choice.run(call, out)
        assert choice.parallel is False
        slow["parallel"] = False           # the other CPU is free again
        for _ in range(Quick.RECHECK - 1):
            choice.run(call, out)
        assert seen[trials:] == [1] * (Quick.RECHECK - 1) and choice.parallel is False
        choice.run(call, out)              # the check: one serial and one parallel timed call
        choice.run(call, out)
        assert sorted(seen[-2:]) == [1, 2] and choice.parallel is True
        for _ in range(2 * Quick.RECHECK - 1):   # the next check comes twice as late
            choice.run(call, out)
        assert seen[-(2 * Quick.RECHECK - 1):] == [2] * (2 * Quick.RECHECK - 1)
        assert choice.parallel is True and out[0] == len(seen)
    finally:
        numba.set_num_threads(prev)


def test_thread_choice_times_with_the_real_clock_by_default():
    assert Q.ThreadChoice().clock is time.perf_counter


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 Numba threads")
def test_fast_thread_count_agrees_with_numba():
    """quants.thread_count and the serial mode read and set the same per-thread count as
    numba.get_num_threads / set_num_threads (they skip only the public functions' checks)."""
    prev = numba.get_num_threads()
    try:
        for n in (1, 2):
            numba.set_num_threads(n)
            assert Q.thread_count() == numba.get_num_threads() == n
        seen = []
        with Q._single_thread():
            seen.append((Q.thread_count(), numba.get_num_threads()))
        assert seen == [(1, 1)] and numba.get_num_threads() == 2
    finally:
        numba.set_num_threads(prev)
