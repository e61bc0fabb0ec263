"""Float and legacy block kernels (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).

Oracles: ``gguf.quants.dequantize`` (dequantization, exact), float64 NumPy
(fp32 numerics, error bound), libggml through ``tools.ggml_oracle`` (ggml
numerics and activation bytes), and the NumPy references in the module.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loaders import quants_legacy as L
from loaders.ggml_types import row_bytes
from tools import ggml_oracle

QT = gguf.GGMLQuantizationType
TYPES = list(L.KERNELS)
BLOCK_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0]
U = 2.0 ** -24  # float32 unit roundoff

needs_oracle = pytest.mark.skipif(not ggml_oracle.available(),
                                  reason=f"libggml oracle unavailable: {ggml_oracle.unavailable_reason()}")


# ----------------------------------------------------------------------------- data


def random_raw(qtype: QT, rows: int, n: int, rng: np.random.Generator, scale_exp=(-14, 2)) -> np.ndarray:
    """Valid random weights: random quant bytes, random finite fp16 scales (d, m)."""
    rb = row_bytes(qtype, n)
    if qtype == QT.F32:
        return (rng.standard_normal((rows, n)) * 2.0 ** rng.integers(-8, 8, (rows, n))).astype(np.float32).view(np.uint8)
    if qtype == QT.F16:
        return (rng.standard_normal((rows, n)) * 2.0 ** rng.integers(-10, 6, (rows, n))).astype(np.float16).view(np.uint8)
    if qtype == QT.BF16:
        v = (rng.standard_normal((rows, n)) * 2.0 ** rng.integers(-20, 20, (rows, n))).astype(np.float32)
        return (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, (rows, rb), dtype=np.uint8)
    blk = raw.reshape(rows, n // 32, -1)
    nfp16 = 2 if qtype in (QT.Q4_1, QT.Q5_1) else 1
    for f in range(nfp16):
        sign = rng.choice([-1.0, 1.0], size=blk.shape[:2])
        val = sign * rng.uniform(1, 2, blk.shape[:2]) * 2.0 ** rng.integers(*scale_exp, size=blk.shape[:2])
        blk[:, :, 2 * f:2 * f + 2] = val.astype(np.float16).view(np.uint8).reshape(*blk.shape[:2], 2)
    return raw


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a = np.ascontiguousarray(a, np.float32)
    b = np.ascontiguousarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def run_dequantize(qtype, raw, n):
    out = np.full((raw.shape[0], n), np.nan, np.float32)
    L.KERNELS[qtype].dequantize(raw, out)
    return out


def run_matvec(qtype, raw, x):
    out = np.full(raw.shape[0], np.nan, np.float32)
    L.KERNELS[qtype].matvec(raw, x, out)
    return out


def run_matmul_ggml(qtype, raw, X):
    k = L.KERNELS[qtype]
    xq = L.ACT_CONVERTERS[k.act_type](X)
    out = np.full((X.shape[0], raw.shape[0]), np.nan, np.float32)
    k.matmul_ggml(raw, xq, out)
    return out, xq


# the libggml-cpu SIMD features under which ggml runs, per weight type, exactly the float
# operations the ggml-numerics kernels emulate
EMULATED_WITH = {**{t: ("avx2", "fma") for t in BLOCK_TYPES},
                 QT.F32: ("avx512",), QT.F16: ("avx512",), QT.BF16: ("avx512_bf16",)}


def require_emulated(qtype: QT) -> None:
    """Skip, with the reason, unless libggml runs qtype's ggml path as the kernels emulate it."""
    if not ggml_oracle.available():
        pytest.skip(f"bit-exact comparison needs the libggml oracle: {ggml_oracle.unavailable_reason()}")
    f = ggml_oracle.cpu_features()
    missing = [k for k in EMULATED_WITH[qtype] if not f.get(k, False)]
    if missing:
        have = ", ".join(k for k, v in f.items() if v) or "none"
        pytest.skip(f"{qtype.name}: bit-exact comparison needs libggml-cpu built with "
                    f"{'+'.join(missing)} (its SIMD features: {have}); the 3e-7 bound still ran")


# ----------------------------------------------------------------------------- dequantize


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), rows=st.integers(1, 5), nblocks=st.integers(1, 6))
def test_dequantize_bit_identical_to_gguf(qtype, seed, rows, nblocks):
    n = 32 * nblocks
    raw = random_raw(qtype, rows, n, np.random.default_rng(seed))
    got = run_dequantize(qtype, raw, n)
    want = gguf.quants.dequantize(raw, qtype).reshape(rows, n)
    # exact: the kernels do the same float32 operations in the same order as gguf-py
    assert bits_equal(got, want)
    assert bits_equal(L.dequantize_reference(qtype, raw), want)


def test_dequantize_extreme_scales():
    """Largest/smallest fp16 scales, subnormal scales, zero and negative zero."""
    rng = np.random.default_rng(7)
    specials = np.array([65504.0, -65504.0, 6.1e-5, 6e-8, -6e-8, 0.0, -0.0, 1.0], np.float16).view(np.uint8)
    for qtype in BLOCK_TYPES:
        raw = rng.integers(0, 256, (8, row_bytes(qtype, 64)), dtype=np.uint8)
        blk = raw.reshape(8, 2, -1)
        blk[:, 0, 0:2] = specials.reshape(8, 2)
        blk[:, 1, 0:2] = specials.reshape(8, 2)[::-1]
        if qtype in (QT.Q4_1, QT.Q5_1):
            blk[:, :, 2:4] = blk[:, ::-1, 0:2]
        with np.errstate(over="ignore", invalid="ignore"):
            want = gguf.quants.dequantize(raw, qtype)
        assert bits_equal(run_dequantize(qtype, raw, 64), want), qtype.name  # exact, as above


@pytest.fixture(scope="module")
def gemma_file(gemma_path):
    from loaders.gguf_file import GGUFFile
    return GGUFFile(gemma_path)


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.0.attn_v.weight", "blk.0.attn_q.weight",
                                  "blk.3.ffn_gate.weight", "blk.0.attn_norm.weight", "output_norm.weight"])
def test_dequantize_real_gemma_blocks(gemma_file, name):
    t = gemma_file.tensor(name)
    rng = np.random.default_rng(0)
    rows = np.sort(rng.choice(t.n_rows, size=min(64, t.n_rows), replace=False))
    raw = np.ascontiguousarray(t.raw[rows])
    got = run_dequantize(t.qtype, raw, t.n_per_row)
    assert bits_equal(got, gguf.quants.dequantize(raw, t.qtype))  # exact


# ----------------------------------------------------------------------------- fp32 numerics


def fp32_bound(n: int, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Worst-case error of the fp32 kernels against exact arithmetic on the dequantized weights:
    one rounding per product, n/32 sequential additions per lane, 5 pairwise levels over 32 lanes
    -> |err| <= gamma_(n/32 + 6) * sum|w*x|, gamma_k = k*u/(1-k*u); 1% slack for the float64 reference."""
    k = n // 32 + 6 + (1 if n % 32 else 0)
    return 1.01 * k * U / (1 - k * U) * (np.abs(w.astype(np.float64)) @ np.abs(x.astype(np.float64)))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), rows=st.integers(1, 9), nblocks=st.integers(1, 40))
def test_matvec_fp32_vs_float64(qtype, seed, rows, nblocks):
    rng = np.random.default_rng(seed)
    n = 32 * nblocks
    raw = random_raw(qtype, rows, n, rng)
    x = (rng.standard_normal(n) * 2.0 ** rng.integers(-4, 4)).astype(np.float32)
    w = L.dequantize_reference(qtype, raw)
    got = run_matvec(qtype, raw, x)
    ref = L.matvec_reference(qtype, raw, x)
    assert np.all(np.abs(got - ref) <= fp32_bound(n, w, x))


# The fp32 block matvec's lane arithmetic written per element (scalar decode, one llvm.fma.f32
# per weight into lane j for element j, both steps; then the pairwise lane sum): the vector-IR
# block steps must give these bits exactly, not only stay within the float64 bound above.
# the block steps this host compiles: the 512-bit one (True) needs AVX-512
_STEPS = (False, True) if L.WIDE_STEPS else (False,)
_SCALAR_DECODERS = {QT.Q4_0: (L.head_d, L.pair_q4_0, 18, False),
                    QT.Q4_1: (L.head_dm, L.pair_q4_1, 20, True),
                    QT.Q5_0: (L.head_d_qh, L.pair_q5_0, 22, False),
                    QT.Q5_1: (L.head_dm_qh, L.pair_q5_1, 24, True)}


_SCALAR_LANES: dict = {}


def _scalar_lanes(head, pair, bsz, has_min):
    """The scalar lanes' matvec for one type, compiled once (not per example)."""
    if bsz not in _SCALAR_LANES:          # bsz names the type (18, 20, 22, 24)
        _SCALAR_LANES[bsz] = _compile_scalar_lanes(head, pair, bsz, has_min)
    return _SCALAR_LANES[bsz]


def _compile_scalar_lanes(head, pair, bsz, has_min):
    from numba import njit

    @njit
    def mv(raw, x, out, f16):
        for r in range(raw.shape[0]):
            w = raw[r]
            acc = np.zeros(32, np.float32)
            for b in range(x.shape[0] // 32):
                o = b * bsz
                d, m, aux = head(w, o, f16)
                for j in range(16):
                    lo, hi = pair(w, o, aux, j)
                    acc[j] = L.fma32(L.q_weight(d, m, lo, has_min), x[b * 32 + j], acc[j])
                    acc[16 + j] = L.fma32(L.q_weight(d, m, hi, has_min), x[b * 32 + 16 + j], acc[16 + j])
            out[r] = L.lanes_sum32(acc)
    return mv


@pytest.mark.parametrize("qtype", list(_SCALAR_DECODERS), ids=lambda t: t.name)
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), rows=st.integers(1, 5), nblocks=st.integers(1, 24),
       x_exp=st.integers(-30, 30))
def test_matvec_fp32_block_step_bit_exact(qtype, seed, rows, nblocks, x_exp):
    """Both block steps (the 256-bit one row by row; the 512-bit one, where the host has
    AVX-512, by far row pairs) and the host's own dispatch give the bits of the scalar lanes.
    x never underflows a product here: the sign of a zero weight (ir_u4_groups) cannot show."""
    rng = np.random.default_rng(seed)
    n = 32 * nblocks
    raw = random_raw(qtype, rows, n, rng)
    x = (rng.standard_normal(n) * 2.0 ** x_exp).astype(np.float32)
    x[rng.random(n) < 0.1] = 0.0
    want = np.empty(rows, np.float32)
    _scalar_lanes(*_SCALAR_DECODERS[qtype])(raw, x, want, L.F16_TO_F32)
    for wide in _STEPS:
        got = np.full(rows, np.nan, np.float32)
        L.u4_matvec(qtype, wide)(raw, L.NO_ROWS, L.NO_ROWS, x, got, L.F16_TO_F32)
        assert bits_equal(got, want), f"wide={wide}"
    assert bits_equal(run_matvec(qtype, raw, x), want)


@pytest.mark.parametrize("qtype", list(_SCALAR_DECODERS), ids=lambda t: t.name)
@pytest.mark.parametrize("d, m", [(-0.375, 1.5), (0.003, -700.0)])
def test_matvec_fp32_wide_step_extreme_quants(qtype, d, m):
    """The quants' ends (the 512-bit step's table ends, its qh mask all set or all clear): every
    quant 0 or every quant 15 / 31, against the scalar lanes, both steps (where the host has
    them). With d = 0.003 and m = -700 (fp16: 0.0030003 and -700), m + 16 d is not a float32:
    a weight d * q + m for a quant with bit 4 made as d * (q - 16) + (m + 16 d) would round
    twice and differ (for q = 31 here)."""
    bsz = _SCALAR_DECODERS[qtype][2]
    raw = np.empty((4, 3 * bsz), np.uint8)
    for r, (qs, qh) in enumerate(((0x00, 0x00), (0xFF, 0xFF), (0x0F, 0xFF), (0xF0, 0x00))):
        blk = raw[r].reshape(3, bsz)
        blk[:] = qs
        blk[:, 0:2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
        if qtype in (QT.Q4_1, QT.Q5_1):
            blk[:, 2:4] = np.frombuffer(np.float16(m).tobytes(), np.uint8)
        if qtype in (QT.Q5_0, QT.Q5_1):
            o = 4 if qtype == QT.Q5_1 else 2
            blk[:, o:o + 4] = qh
    x = np.random.default_rng(5).standard_normal(96).astype(np.float32)
    w = L.dequantize_reference(qtype, raw)
    want = np.empty(4, np.float32)
    _scalar_lanes(*_SCALAR_DECODERS[qtype])(raw, x, want, L.F16_TO_F32)
    assert np.all(np.abs(want - L.matvec_reference(qtype, raw, x)) <= fp32_bound(96, w, x))
    for wide in _STEPS:
        got = np.full(4, np.nan, np.float32)
        L.u4_matvec(qtype, wide)(raw, L.NO_ROWS, L.NO_ROWS, x, got, L.F16_TO_F32)
        assert bits_equal(got, want), f"wide={wide}"


def test_u4_matvec_refuses_other_types():
    with pytest.raises(ValueError, match="Q8_0"):
        L.u4_matvec(QT.Q8_0, True)


@pytest.mark.skipif(L.WIDE_STEPS, reason="this host has AVX-512: the 512-bit step compiles")
def test_u4_matvec_wide_step_needs_avx512():
    with pytest.raises(ValueError, match="AVX-512"):
        L.u4_matvec(QT.Q5_0, True)


_F16_SCALAR: list = []


def _f16_scalar_matvec():
    """The F16 matvec's driver with the scalar step (:func:`quants_legacy._mac32_elems`) and an
    element decoder that reads the fp16 table instead of converting in hardware."""
    if not _F16_SCALAR:
        from numba import njit

        @njit(inline="always")
        def elem_lut(h, k, f16):
            return f16[h[k]]

        @njit(parallel=True)
        def mv(h, x, out, f16):
            L._matvec_elems(h, x, out, f16, elem_lut, L._mac32_elems)
        _F16_SCALAR.append(mv)
    return _F16_SCALAR[0]


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), rows=st.integers(1, 9), n=st.integers(1, 200),
       x_exp=st.integers(-20, 20), subnormal=st.booleans())
def test_matvec_f16_vector_step_is_the_scalar_loop(seed, rows, n, x_exp, subnormal):
    """F16's fp32 matvec converts 32 weights at a time in vector IR (_mul_add_f16x32); the
    scalar loop on table-converted weights gives the same bits, tails (n % 32) and fp16
    subnormals (``subnormal``: weights scaled into them) included."""
    rng = np.random.default_rng(seed)
    raw = random_raw(QT.F16, rows, n, rng)
    if subnormal:
        raw = (raw.view(np.float16).astype(np.float32) * np.float32(2.0 ** -14)).astype(np.float16).view(np.uint8)
    x = (rng.standard_normal(n) * 2.0 ** x_exp).astype(np.float32)
    want = np.full(rows, np.nan, np.float32)
    _f16_scalar_matvec()(raw.view(np.uint16).reshape(rows, n), x, want, L.F16_TO_F32)
    assert bits_equal(run_matvec(QT.F16, raw, x), want)


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16], ids=lambda t: t.name)
def test_matvec_float_types_odd_length(qtype):
    rng = np.random.default_rng(3)
    n = 77  # float types take any row length; the tail goes to the first lanes
    raw = random_raw(qtype, 5, n, rng)
    x = rng.standard_normal(n).astype(np.float32)
    got = run_matvec(qtype, raw, x)
    w = L.dequantize_reference(qtype, raw)
    assert np.all(np.abs(got - L.matvec_reference(qtype, raw, x)) <= fp32_bound(n, w, x))


# ----------------------------------------------------------------------------- activations


def test_f16_conversion_matches_numpy_all_ranges():
    """The in-kernel float32 -> fp16 rounding (used for Q8 scales and F16 activations) against
    NumPy's, over random bit patterns of every exponent plus the rounding boundaries."""
    rng = np.random.default_rng(11)
    bits = rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32)
    edges = []
    for e in range(95, 150):  # subnormal-half, normal-half and overflow exponents
        for mant in (0, 1, 0xFFF, 0x1000, 0x1001, 0x2000, 0x3000, 0x7FE000, 0x7FF000, 0x7FFFFF):
            edges.append((e << 23) | mant)
    bits = np.concatenate([bits, np.array(edges, np.uint32), np.array(edges, np.uint32) | 0x80000000])
    x = bits.view(np.float32)
    x = x[~np.isnan(x)].reshape(1, -1)
    got = L.convert_act_f16(x).view(np.uint16)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(got, want)


@needs_oracle
@pytest.mark.parametrize("act_type", [QT.Q8_0, QT.Q8_1, QT.F16, QT.BF16], ids=lambda t: t.name)
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), m=st.integers(1, 3), nblocks=st.integers(1, 12),
       zero_block=st.booleans())
def test_activation_bytes_equal_ggml(act_type, seed, m, nblocks, zero_block):
    rng = np.random.default_rng(seed)
    n = 32 * nblocks
    x = (rng.standard_normal((m, n)) * 2.0 ** rng.integers(-12, 12, (m, 1))).astype(np.float32)
    if zero_block:
        x[:, :32] = 0.0
    got = L.ACT_CONVERTERS[act_type](x)
    for i in range(m):
        assert np.array_equal(got[i], ggml_oracle.from_float(act_type, x[i]))  # byte equality
    assert np.array_equal(got, L.quantize_act_reference(act_type, x))


def test_q8_rounds_half_to_even():
    """ggml's SIMD quantizer rounds x*127/amax to nearest even (the scalar _ref rounds away)."""
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = 127.0
    x[0, 1] = 0.5
    x[0, 2] = 1.5
    x[0, 3] = -2.5
    q = L.quantize_act_q8_0(x)[0, 2:].view(np.int8)
    assert q[:4].tolist() == [127, 0, 2, -2]


def test_q8_multiplier_is_127_over_amax():
    """ggml's SIMD quantizer multiplies by 127/amax, not 1/d: values chosen where the two differ."""
    x = np.zeros((1, 32), np.float32)
    x[0, :3] = [2.7708886, 0.03272703, 0.054545052]
    assert L.quantize_act_q8_0(x)[0, 2:5].view(np.int8).tolist() == [127, 1, 2]
    assert L.quantize_act_q8_1(x)[0, 4:7].view(np.int8).tolist() == [127, 1, 2]


# ----------------------------------------------------------------------------- ggml numerics


def ggml_scale(w: np.ndarray, X: np.ndarray) -> np.ndarray:
    """sum_j |w_j x_j| per output [m, rows]: the magnitude that float rounding errors of a dot
    product scale with (|result| can be arbitrarily small through cancellation)."""
    return np.abs(X.astype(np.float64)) @ np.abs(w.astype(np.float64)).T


matmul_strategy = dict(seed=st.integers(0, 2 ** 32 - 1), rows=st.integers(1, 6), m=st.integers(1, 3),
                       n64=st.integers(1, 12))


def matmul_case(qtype, seed, rows, m, n64):
    rng = np.random.default_rng(seed)
    n = 64 * n64
    return random_raw(qtype, rows, n, rng), rng.standard_normal((m, n)).astype(np.float32)


def check_vs_libggml(qtype, raw, X):
    got, _ = run_matmul_ggml(qtype, raw, X)
    want = ggml_oracle.matmul(qtype, raw, X)
    scale = ggml_scale(L.dequantize_reference(qtype, raw), X)
    # acceptance bar on any libggml build: 3e-7 of sum|w*x|
    assert np.all(np.abs(got - want) <= 3e-7 * scale)


def check_bit_exact(qtype, raw, X):
    got, _ = run_matmul_ggml(qtype, raw, X)
    # the kernels replay ggml's operation order: on a libggml built for the emulated x86
    # paths (AVX2/FMA, AVX-512, AVX512-BF16) the results are the same bits
    assert bits_equal(got, ggml_oracle.matmul(qtype, raw, X))


@needs_oracle
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@settings(max_examples=8, deadline=None)
@given(**matmul_strategy)
def test_matmul_ggml_vs_libggml(qtype, seed, rows, m, n64):
    check_vs_libggml(qtype, *matmul_case(qtype, seed, rows, m, n64))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_ggml_bit_identical_to_libggml(qtype):
    require_emulated(qtype)

    @settings(max_examples=8, deadline=None)
    @given(**matmul_strategy)
    def run(seed, rows, m, n64):
        check_bit_exact(qtype, *matmul_case(qtype, seed, rows, m, n64))
    run()


FLOAT_TAILS = pytest.mark.parametrize("n", [64, 96, 100, 130, 200], ids=str)


def float_tail_case(qtype, n):
    """Row lengths that are not multiples of 64 take ggml's tail loops."""
    rng = np.random.default_rng(n)
    return random_raw(qtype, 4, n, rng), rng.standard_normal((2, n)).astype(np.float32)


@needs_oracle
@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16], ids=lambda t: t.name)
@FLOAT_TAILS
def test_matmul_ggml_float_tails(qtype, n):
    check_vs_libggml(qtype, *float_tail_case(qtype, n))


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16], ids=lambda t: t.name)
@FLOAT_TAILS
def test_matmul_ggml_float_tails_bit_identical(qtype, n):
    require_emulated(qtype)
    check_bit_exact(qtype, *float_tail_case(qtype, n))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_ggml_vs_numpy_reference(qtype):
    rng = np.random.default_rng(5)
    n = 320
    raw = random_raw(qtype, 7, n, rng)
    X = rng.standard_normal((3, n)).astype(np.float32)
    got, xq = run_matmul_ggml(qtype, raw, X)
    want = L.matmul_ggml_reference(qtype, raw, xq)
    w = L.dequantize_reference(qtype, raw)
    xa = X if qtype == QT.F32 else (L.dequantize_reference(qtype, xq) if qtype in (QT.F16, QT.BF16) else X)
    if qtype in BLOCK_TYPES:
        # same lane sums and fma order; the reference's fma rounds twice (float64 then float32),
        # which can move a lane by one float32 ulp in rare ties
        assert np.all(np.abs(got - want) <= 8 * U * ggml_scale(w, X))
    else:
        # reference is the exact (float64) dot of the converted operands; ggml's float32 lanes:
        # n/64 fused adds per lane, 2 register adds, 4 levels of reduce_add -> gamma_(n/64+7)
        k = n // 64 + 7 + n % 64
        assert np.all(np.abs(got - want) <= 1.01 * k * U * ggml_scale(w, xa))


def gemma_q5_0_case(gemma_file):
    t = gemma_file.tensor("blk.0.attn_q.weight")  # Q5_0, 1024 rows of 640
    assert t.qtype == QT.Q5_0
    raw = np.ascontiguousarray(t.raw[:128])
    x = np.random.default_rng(1).standard_normal(t.n_per_row).astype(np.float32)
    return t.qtype, raw, x


def test_real_gemma_q5_0_matvec_fp32(gemma_file):
    qtype, raw, x = gemma_q5_0_case(gemma_file)
    w = L.dequantize_reference(qtype, raw)
    got = run_matvec(qtype, raw, x)
    assert np.all(np.abs(got - L.matvec_reference(qtype, raw, x)) <= fp32_bound(x.size, w, x))


def test_real_gemma_q5_0_matmul_ggml_vs_numpy_reference(gemma_file):
    qtype, raw, x = gemma_q5_0_case(gemma_file)
    got, xq = run_matmul_ggml(qtype, raw, x[None])
    w = L.dequantize_reference(qtype, raw)
    # as in test_matmul_ggml_vs_numpy_reference for block types
    assert np.all(np.abs(got - L.matmul_ggml_reference(qtype, raw, xq)) <= 8 * U * ggml_scale(w, x[None]))


@needs_oracle
def test_real_gemma_q5_0_matmul_ggml_vs_libggml(gemma_file):
    qtype, raw, x = gemma_q5_0_case(gemma_file)
    check_vs_libggml(qtype, raw, x[None])


def test_real_gemma_q5_0_matmul_ggml_bit_identical(gemma_file):
    require_emulated(QT.Q5_0)
    qtype, raw, x = gemma_q5_0_case(gemma_file)
    check_bit_exact(qtype, raw, x[None])


@needs_oracle
def test_oracle_binding_sane():
    """The ctypes binding itself: ggml's quantizer equals gguf-py's (both are ggml's reference
    quantizers), traits report ggml's vec_dot types, and an F32 vec_dot is a dot product."""
    rng = np.random.default_rng(9)
    w = rng.standard_normal((3, 128)).astype(np.float32)
    for qtype in (QT.F16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0):
        ours = ggml_oracle.quantize(qtype, w)
        assert np.array_equal(ours, np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8).reshape(3, -1))
    assert [ggml_oracle.vec_dot_type(t) for t in (QT.F32, QT.F16, QT.BF16, QT.Q4_1, QT.Q8_0, QT.Q4_K)] == \
        [QT.F32, QT.F16, QT.BF16, QT.Q8_1, QT.Q8_0, QT.Q8_K]
    x = rng.standard_normal(128).astype(np.float32)
    got = ggml_oracle.vec_dot(QT.F32, w[0].view(np.uint8), x)
    ref = float(w[0].astype(np.float64) @ x.astype(np.float64))
    assert abs(got - ref) <= 140 * U * float(np.abs(w[0]) @ np.abs(x))  # gamma_(n+12) bound, n = 128


# ----------------------------------------------------------------------------- integer dot-product path

I8_CASES = [(qt, v) for qt in BLOCK_TYPES for v in L.i8_variants(qt)
            if (L.I8_WIDE if v == "vnni512" else L.I8_DOT == "vnni" or v == L.I8_DOT)]


def test_host_ggml_kernels_take_the_integer_path():
    """Where the host has the instructions, KERNELS' ggml numerics are the integer kernels (the
    other tests of this module then check them against libggml); elsewhere the portable ones."""
    for qt in BLOCK_TYPES:
        fast = L.I8_DOT is not None and L.I8_DOT in L.i8_variants(qt)
        assert (L.KERNELS[qt].matmul_ggml is not L.PORTABLE_GGML[qt]) == fast, qt.name


def extreme_raw(qtype: QT, rows: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """random_raw with every quant byte at an end of its range in some rows (all 0x00, all 0xFF,
    Q8_0's -128 and 127): the largest unsigned bytes and lane sums the integer path forms."""
    raw = random_raw(qtype, rows, n, rng)
    blk = raw.reshape(rows, n // 32, -1)
    head = {QT.Q4_0: 2, QT.Q4_1: 4, QT.Q5_0: 2, QT.Q5_1: 4, QT.Q8_0: 2}[qtype]
    for r in range(rows):
        fill = (0x00, 0xFF, 0x80, 0x7F, None)[r % 5]
        if fill is not None:
            blk[r, :, head:] = fill
    return raw


@pytest.mark.skipif(not I8_CASES, reason=f"no integer dot products on this host ({L.I8_DOT})")
@pytest.mark.parametrize("qtype,variant", I8_CASES, ids=lambda c: getattr(c, "name", c))
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), rows=st.integers(1, 9), m=st.integers(1, 19),
       nblocks=st.integers(1, 40), big=st.booleans())
def test_i8_path_bit_identical_to_portable(qtype, variant, seed, rows, m, nblocks, big):
    """The integer kernels replay _matmul_ggml_blocks exactly: any row count (odd ones pair the
    middle row with itself; prefill tiles of four rows clamp at the last), one activation row
    (decode) or several (in groups of four, or eight for "vnni512", a short last group), quants
    at their extremes,
    activations whose quants reach +-127 in every block (``big``: one huge element per block)."""
    rng = np.random.default_rng(seed)
    n = 32 * nblocks
    raw = extreme_raw(qtype, rows, n, rng)
    X = rng.standard_normal((m, n)).astype(np.float32)
    if big:
        X[:, ::32] *= 1e3
    xq = L.ACT_CONVERTERS[L.KERNELS[qtype].act_type](X)
    got = np.full((m, rows), np.nan, np.float32)
    want = np.full((m, rows), np.nan, np.float32)
    L.i8_matmul_ggml(qtype, variant)(raw, xq, got)
    L.PORTABLE_GGML[qtype](raw, xq, want)
    assert bits_equal(got, want)  # integer lane sums are exact; the float steps are the same


def test_i8_path_refuses_an_unknown_variant():
    with pytest.raises(ValueError, match="Q8_0 has no exact 'sse'"):
        L.i8_matmul_ggml(QT.Q8_0, "sse")


@pytest.mark.skipif(("Q8_0", "avx2") not in [(q.name, v) for q, v in I8_CASES],
                    reason="no AVX2 on this host")
def test_i8_q8_0_sign_trick_with_activation_quants_at_minus_128():
    """Q8_0 on AVX2 moves the weights' signs onto the activation quants (VPSIGNB), exact for
    the quants ggml's quantizer makes (|a| <= 127). Hand-made activation bytes holding -128,
    against weights of -128 (the largest pair sums), still give the portable kernel's bits:
    that call takes the portable kernel. Without that check, -128 * sign(-128) wraps to -128
    and the row's sums come out wrong."""
    rng = np.random.default_rng(5)
    n, rows = 64, 5
    raw = extreme_raw(QT.Q8_0, rows, n, rng)
    xq = L.ACT_CONVERTERS[QT.Q8_0](rng.standard_normal((2, n)).astype(np.float32))
    blk = xq.reshape(2, n // 32, 34)
    blk[0, :, 2:] = 0x80                       # every quant of row 0: -128
    blk[1, 0, 2:6] = 0x80                      # four of row 1
    got = np.full((2, rows), np.nan, np.float32)
    want = np.full((2, rows), np.nan, np.float32)
    L.i8_matmul_ggml(QT.Q8_0, "avx2")(raw, xq, got)
    L.PORTABLE_GGML[QT.Q8_0](raw, xq, want)
    assert bits_equal(got, want)


@pytest.mark.parametrize("act_type", [QT.Q8_0, QT.Q8_1], ids=lambda t: t.name)
def test_split_act_i8_matches_split_act_blocks(act_type):
    """The integer path's activation split equals the portable one, its lane corrections are
    -off times the sums of four quants, and it returns the smallest quant (the sign trick's
    -128 check), here too with a quant of -128 written in."""
    rng = np.random.default_rng(3)
    X = (rng.standard_normal((3, 96)) * 50).astype(np.float32)
    xq = L.ACT_CONVERTERS[act_type](X)
    with_sum = act_type == QT.Q8_1
    aq, ad, asum = L._split_act_blocks(xq, with_sum)
    got = (np.empty((3, 96), np.int8), np.empty((3, 3), np.float32), np.empty((3, 3), np.float32),
           np.empty((3, 24), np.int32))
    bsz = 36 if with_sum else 34
    lowest = L._split_act_i8(xq, bsz, np.int32(16), *got, L.F16_TO_F32)
    assert np.array_equal(got[0], aq) and bits_equal(got[1], ad)
    if with_sum:
        assert bits_equal(got[2], asum)
    assert np.array_equal(got[3], -16 * aq.astype(np.int32).reshape(3, 24, 4).sum(-1))
    assert lowest == min(int(aq.min()), 0) > -128
    xq[2, bsz + (bsz - 32) + 5] = 0x80          # row 2, block 1, quant 5: -128
    assert L._split_act_i8(xq, bsz, np.int32(16), *got, L.F16_TO_F32) == -128


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_matvec_ggml_equals_matmul_ggml(qtype):
    """The decode entry (one float row, converted inside) gives matmul_ggml's bits."""
    from loaders import quants
    rng = np.random.default_rng(11)
    raw = random_raw(qtype, 9, 320, rng)
    x = rng.standard_normal(320).astype(np.float32)
    got = quants.matvec(raw, qtype, 320, x, "ggml")
    want, _ = run_matmul_ggml(qtype, raw, x[None, :])
    assert bits_equal(got, want[0])


@pytest.mark.parametrize("qtype", sorted(L.FAR_PAIR_MATVEC), ids=lambda t: t.name)
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), rows=st.integers(1, 11), nblocks=st.integers(1, 30))
def test_far_pair_matvec_rows_as_computed_alone(qtype, seed, rows, nblocks):
    """The far-pair fp32 matvec does each row's operations exactly as for a matrix of that row
    alone: every row index reached once (odd counts pair the middle row with itself), in place."""
    rng = np.random.default_rng(seed)
    raw = random_raw(qtype, rows, 32 * nblocks, rng)
    x = rng.standard_normal(32 * nblocks).astype(np.float32)
    whole = run_matvec(qtype, raw, x)
    alone = np.concatenate([run_matvec(qtype, raw[r:r + 1], x) for r in range(rows)])
    assert bits_equal(whole, alone)
