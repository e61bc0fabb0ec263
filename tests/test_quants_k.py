"""K-quant kernels (loaders.quants_k) against gguf-py, float64 NumPy and ggml itself.

- dequantize: bit-identical to ``gguf.quants.dequantize`` on random blocks
  (hypothesis), on ggml-quantized weights and on real blocks of the gemma file;
- matvec (fp32 numerics): against dequantize-then-float64, with a rounding
  error bound;
- matmul_ggml (ggml numerics): against the module's float64 NumPy twin (always),
  against ``tools.ggml_oracle`` (libggml's CPU ``vec_dot``) within 3e-7
  relative, and, as a test of its own, bit-identical where libggml runs its
  AVX2 kernels (skipped, with the reason, where it does not);
- Q8_K activations: byte-identical to libggml's ``from_float``.

The real-model tests read the default model (Gemma 3 270M Q4_K_M, the
``gemma_path`` fixture). It holds Q4_K and Q6_K tensors only, so those tests run for
these two types; random and ggml-quantized blocks cover Q2_K, Q3_K and Q5_K.
"""
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from loaders import quants_k as K
from tools import ggml_oracle as O

K_TYPES = [QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K]
# byte offsets of the fp16 super-block scales inside one block: d, and dmin where the type has one
SCALE_OFFSETS = {QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}
U32 = 2.0 ** -24  # float32 unit roundoff
# tensors of the default model read by the real-model tests (the model's first
# Q4_K and Q6_K matrices); the model has no Q2_K, Q3_K or Q5_K tensor
GEMMA_TENSORS = {QT.Q4_K: "blk.0.attn_output.weight", QT.Q6_K: "blk.0.ffn_down.weight"}

needs_oracle = pytest.mark.skipif(not O.available(), reason=f"ggml oracle: {O.unavailable_reason()}")
ids = [t.name for t in K_TYPES]


# ------------------------------------------------------------------ helpers

def finite_f16_bits(rng: np.random.Generator, shape) -> np.ndarray:
    """Random finite fp16 bit patterns (all exponents, subnormals and signed zeros included)."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    inf_nan = (bits & 0x7C00) == 0x7C00
    bits[inf_nan] ^= 0x4000  # exponent 31 -> 15: finite
    return bits


def random_blocks(qtype: QT, rows: int, nb: int, rng: np.random.Generator) -> np.ndarray:
    """uint8[rows, nb * block_bytes]: random bytes with random finite fp16 d (and dmin)."""
    bb = K.BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, size=(rows, nb * bb), dtype=np.uint8)
    blk = raw.reshape(rows, nb, bb)
    for off in SCALE_OFFSETS[qtype]:
        blk[:, :, off:off + 2] = finite_f16_bits(rng, (rows, nb)).view(np.uint8).reshape(rows, nb, 2)
    return raw


def term_parts(qtype: QT, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d * scale * q, -dmin * min) per element as float64[rows, n] (zeros for types without dmin).

    Built with gguf's dequantization after zeroing dmin, resp. d; each part is
    within one float32 rounding of the exact term the kernels sum.
    """
    offs = SCALE_OFFSETS[qtype]
    bb = K.BLOCK_BYTES[qtype]
    if len(offs) == 1:
        return gguf_dequantize(raw, qtype).astype(np.float64), np.zeros(1)
    no_min = raw.copy()
    no_min.reshape(raw.shape[0], -1, bb)[:, :, offs[1]:offs[1] + 2] = 0
    no_scale = raw.copy()
    no_scale.reshape(raw.shape[0], -1, bb)[:, :, offs[0]:offs[0] + 2] = 0
    return (gguf_dequantize(no_min, qtype).astype(np.float64),
            gguf_dequantize(no_scale, qtype).astype(np.float64))


def term_magnitude(qtype: QT, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float64[m, rows]: sum over elements of (|d*scale*q| + |dmin*min|) * |x|.

    The size of the terms a dot product adds up; float rounding errors scale
    with it, while the result itself can cancel to ~0.
    """
    s, mn = term_parts(qtype, raw)
    xa = np.abs(np.atleast_2d(x).astype(np.float64))
    return xa @ (np.abs(s) + np.abs(mn)).T


def check_dequantize(qtype: QT, raw: np.ndarray) -> None:
    ref = gguf_dequantize(raw, qtype)
    out = np.full(ref.shape, np.nan, np.float32)
    K.KERNELS[qtype].dequantize(raw, out)
    # exact: same float32 operations in the same order as gguf-py
    np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))


def check_matvec(qtype: QT, raw: np.ndarray, x: np.ndarray) -> None:
    rows, n = raw.shape[0], x.size
    out = np.full(rows, np.nan, np.float32)
    K.KERNELS[qtype].matvec(raw, x, out)
    ref = K.matvec_reference(qtype, raw, x)
    mag = term_magnitude(qtype, raw, x)[0]
    # Float32 roundings a term passes through: scale path 2 products + n/32
    # additions into its lane + 31 across lanes + 1; min path <= 31 in the
    # sub-block sum of x + 2 products + n/16 additions + 1; gguf's rounding of w
    # in the float64 reference adds 1. Error bound gamma_k * sum|terms| with
    # k = n/16 + 36 (about 6e-6 relative at n = 1024).
    tol = (n // 16 + 36) * U32 * mag
    assert np.all(np.isfinite(out))
    err = np.abs(out - ref)
    assert np.all(err <= tol), f"max err/tol {np.max(err / np.maximum(tol, 1e-300)):.3g}"


def run_matmul_ggml(qtype: QT, raw: np.ndarray, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float32[m, rows] result of the ggml-numerics kernel, its Q8_K activations)."""
    xq = K.quantize_act_q8_k(X)
    out = np.full((X.shape[0], raw.shape[0]), np.nan, np.float32)
    K.KERNELS[qtype].matmul_ggml(raw, xq, out)
    return out, xq


def check_matmul_ggml_vs_twin(qtype: QT, raw: np.ndarray, X: np.ndarray) -> None:
    out, xq = run_matmul_ggml(qtype, raw, X)
    assert np.all(np.isfinite(out))
    mag = term_magnitude(qtype, raw, K.dequantize_act_q8_k(xq))
    # plain NumPy twin (float64 from dequantized operands): ggml rounds the
    # per-block scale product, the lane conversion, nb FMAs into a lane and 4
    # levels of final sums; the twin's operands carry gguf's rounding of w and
    # of d * q: k = nb + 12 roundings at most
    ref = K.matmul_ggml_reference(qtype, raw, xq)
    nb = X.shape[1] // 256
    np.testing.assert_array_less(np.abs(out - ref), (nb + 12) * U32 * mag + 1e-300)


def check_matmul_ggml_vs_libggml(qtype: QT, raw: np.ndarray, X: np.ndarray) -> None:
    out, xq = run_matmul_ggml(qtype, raw, X)
    ora = O.matmul(qtype, raw, X)
    # relative to the magnitude of the terms ggml sums (weights times the
    # dequantized Q8_K activations): results that cancel to ~0 have no
    # meaningful relative error of their own
    mag = term_magnitude(qtype, raw, K.dequantize_act_q8_k(xq))
    err = np.abs(out.astype(np.float64) - ora)
    assert np.all(err <= 3e-7 * mag), f"max err/mag {np.max(err / np.maximum(mag, 1e-300)):.3g}"


def check_matmul_ggml_bit_exact(qtype: QT, raw: np.ndarray, X: np.ndarray) -> None:
    out, _ = run_matmul_ggml(qtype, raw, X)
    ora = O.matmul(qtype, raw, X)
    # the kernels replicate ggml's AVX2 float operations (lanes, FMAs, final
    # horizontal sum) one for one, so the results are the same bits
    np.testing.assert_array_equal(out.view(np.uint32), ora.view(np.uint32))


@pytest.fixture
def ggml_avx2() -> None:
    """Skips (with the reason) unless libggml's CPU backend runs the AVX2 kernels the
    ggml mode replicates bit for bit."""
    if not O.available():
        pytest.skip(f"bit-exact comparison needs the ggml oracle: {O.unavailable_reason()}")
    feats = O.cpu_features()
    if not feats.get("avx2", False):
        have = ", ".join(k for k, v in feats.items() if v) or "none"
        pytest.skip(f"bit-exact comparison needs libggml-cpu built with AVX2 "
                    f"(its SIMD features: {have}); the 3e-7 bound tests still ran")


@pytest.fixture(scope="module")
def gemma(gemma_path):
    from loaders.gguf_file import GGUFFile
    f = GGUFFile(gemma_path)
    yield f
    f.close()


def gemma_tensor(gemma, qtype: QT):
    """The default model's tensor of ``qtype`` (one of GEMMA_TENSORS)."""
    t = gemma.tensor(GEMMA_TENSORS[qtype])
    assert t.qtype == qtype
    return t


# ------------------------------------------------------------------ dequantize

@settings(max_examples=40, deadline=None)
@given(qtype=st.sampled_from(K_TYPES), rows=st.integers(1, 3), nb=st.integers(1, 3), data=st.data())
def test_dequantize_random_blocks_bit_exact(qtype, rows, nb, data):
    bb = K.BLOCK_BYTES[qtype]
    raw = np.frombuffer(data.draw(st.binary(min_size=rows * nb * bb, max_size=rows * nb * bb)),
                        dtype=np.uint8).reshape(rows, nb * bb).copy()
    f16 = st.floats(width=16, allow_nan=False, allow_infinity=False)
    for off in SCALE_OFFSETS[qtype]:
        vals = np.array(data.draw(st.lists(f16, min_size=rows * nb, max_size=rows * nb)), dtype=np.float16)
        raw.reshape(rows, nb, bb)[:, :, off:off + 2] = vals.view(np.uint8).reshape(rows, nb, 2)
    check_dequantize(qtype, raw)


@pytest.mark.parametrize("qtype", K_TYPES, ids=ids)
def test_dequantize_many_random_blocks_bit_exact(qtype):
    check_dequantize(qtype, random_blocks(qtype, 37, 5, np.random.default_rng(int(qtype))))


@pytest.mark.parametrize("qtype", K_TYPES, ids=ids)
def test_dequantize_reference_without_gguf_is_gguf_bit_for_bit(qtype, monkeypatch):
    """dequantize_reference where gguf cannot be imported (its own kernel stands in) gives
    gguf's values bit for bit; rows that are not whole blocks are refused."""
    raw = random_blocks(qtype, 5, 3, np.random.default_rng(50 + int(qtype)))
    ref = gguf_dequantize(raw, qtype)
    monkeypatch.setitem(sys.modules, "gguf.quants", None)       # import gguf.quants fails
    got = K.dequantize_reference(qtype, raw)
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
    with pytest.raises(ValueError, match=f"{qtype.name} rows must be"):
        K.dequantize_reference(qtype, raw[:, 1:])


def test_the_default_model_holds_only_the_k_types_read_here(gemma):
    """The real-model tests run on GEMMA_TENSORS' types; the default model has no tensor of
    the other K types (they are covered by random and ggml-quantized blocks only)."""
    held = {t.qtype for t in gemma.tensors.values()} & set(K_TYPES)
    assert held == set(GEMMA_TENSORS), "the default model's K types changed: update GEMMA_TENSORS"


@pytest.mark.parametrize("qtype", list(GEMMA_TENSORS), ids=lambda q: q.name)
def test_dequantize_gemma_tensor_bit_exact(gemma, qtype):
    t = gemma_tensor(gemma, qtype)
    check_dequantize(qtype, t.raw)  # the whole tensor, read-only memory-mapped bytes


def test_dequantize_detects_a_flipped_scale_bit():
    # the exact comparison sees a single changed scale bit
    raw = random_blocks(QT.Q4_K, 2, 2, np.random.default_rng(7))
    raw.reshape(2, 2, 144)[:, :, 0:2] = np.array([0x00, 0x3C], np.uint8)  # d = 1
    ref = gguf_dequantize(raw, QT.Q4_K)
    raw[0, 4] ^= 1
    out = np.empty_like(ref)
    K.KERNELS[QT.Q4_K].dequantize(raw, out)
    assert not np.array_equal(out, ref)


# ------------------------------------------------------------------ matvec (fp32)

@pytest.mark.parametrize("qtype", K_TYPES, ids=ids)
def test_matvec_random_blocks(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    raw = random_blocks(qtype, 33, 4, rng)
    check_matvec(qtype, raw, rng.standard_normal(1024).astype(np.float32))


@needs_oracle
@pytest.mark.parametrize("qtype", K_TYPES, ids=ids)
def test_matvec_and_dequantize_ggml_quantized_weights(qtype):
    rng = np.random.default_rng(200 + int(qtype))
    W = rng.standard_normal((19, 1536)).astype(np.float32) * np.float32(0.05)
    raw = O.quantize(qtype, W)
    check_dequantize(qtype, raw)
    check_matvec(qtype, raw, rng.standard_normal(1536).astype(np.float32))


@pytest.mark.parametrize("qtype", list(GEMMA_TENSORS), ids=lambda q: q.name)
def test_matvec_gemma_tensor(gemma, qtype):
    t = gemma_tensor(gemma, qtype)
    x = np.random.default_rng(3).standard_normal(t.n_per_row).astype(np.float32)
    check_matvec(qtype, t.raw, x)


def test_matvec_bound_catches_a_wrong_scale():
    # the tolerance is tight enough to see one sub-block with a changed 6-bit scale
    rng = np.random.default_rng(11)
    raw = random_blocks(QT.Q4_K, 4, 4, rng)
    raw.reshape(4, 4, 144)[:, :, 0:4] = np.array([0x00, 0x3C, 0x00, 0x38], np.uint8)  # d = 1, dmin = 0.5
    x = rng.standard_normal(1024).astype(np.float32)
    bad = raw.copy()
    bad[:, 4] ^= 0x20  # flip one bit of sub-block 0's scale in block 0
    out = np.empty(4, np.float32)
    K.KERNELS[QT.Q4_K].matvec(bad, x, out)
    ref = K.matvec_reference(QT.Q4_K, raw, x)
    tol = (1024 // 16 + 36) * U32 * term_magnitude(QT.Q4_K, raw, x)[0]
    assert np.any(np.abs(out - ref) > tol)


# ------------------------------------------------------------------ Q8_K activations

def tie_rows() -> np.ndarray:
    """Rows with exact rounding ties, magnitude ties and an all-zero block."""
    x = np.zeros((3, 512), np.float32)
    x[0, :256] = (np.arange(256) % 200 - 100) + 0.5     # k + 0.5 ...
    x[0, 3] = 127.0                                      # ... with max 127 (first of the tie with
    x[0, 7] = -127.0                                     # -127): iscale = -1, p = -(k + 0.5) exactly
    x[0, 256:] = np.linspace(-1, 1, 256)
    x[1, :256] = np.linspace(-3, 3, 256)
    x[1, 10] = -5.0
    x[1, 20] = 5.0                                       # equal magnitudes: the first one sets the sign
    x[2, 256:] = np.float32(1e-3) * np.arange(256)       # first block all zero
    return x


def test_q8_k_activation_kernel_matches_numpy_twin():
    rng = np.random.default_rng(6)
    X = np.concatenate([tie_rows(), rng.standard_normal((5, 512)).astype(np.float32)])
    got = K.quantize_act_q8_k(X)
    np.testing.assert_array_equal(got, K.quantize_act_q8_k_reference(X))
    # round trip: within half a quantization step d / 2 of the input, plus the
    # float32 roundings of iscale * x, d = 1 / iscale and d * q, each at most
    # u * max|x| = u * 127 * d
    d = K.split_q8_k(got)[0]
    step = np.repeat(np.abs(d), 256, axis=1)
    err = np.abs(K.dequantize_act_q8_k(got).astype(np.float64) - X)
    assert np.all(err <= 0.5 * step + 4 * U32 * 127 * step)


@needs_oracle
def test_q8_k_activation_bytes_match_ggml():
    rng = np.random.default_rng(5)
    X = np.concatenate([tie_rows(),
                        rng.standard_normal((4, 512)).astype(np.float32),
                        (rng.standard_normal((2, 512)) * 1e4).astype(np.float32)])
    got = K.quantize_act_q8_k(X)
    want = np.stack([O.from_float(QT.Q8_K, row) for row in X])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(K.quantize_act_q8_k_reference(X), want)


@needs_oracle
@settings(max_examples=30, deadline=None)
@given(data=st.data(), nb=st.integers(1, 2))
def test_q8_k_activation_bytes_match_ggml_hypothesis(data, nb):
    vals = data.draw(st.lists(st.floats(min_value=-1e6, max_value=1e6, width=32, allow_subnormal=False),
                              min_size=256 * nb, max_size=256 * nb))
    x = np.array(vals, np.float32)[None, :]
    x[np.abs(x) < 1e-20] = 0  # keeps -127 / max finite, as it is for any real activation
    want = O.from_float(QT.Q8_K, x[0])[None, :]
    np.testing.assert_array_equal(K.quantize_act_q8_k(x), want)
    np.testing.assert_array_equal(K.quantize_act_q8_k_reference(x), want)


# ------------------------------------------------------------------ matmul_ggml (ggml numerics)

def case_random_blocks(qtype, request):
    rng = np.random.default_rng(300 + int(qtype))
    raw = random_blocks(qtype, 24, 3, rng)
    X = np.concatenate([rng.standard_normal((2, 768)).astype(np.float32), tie_rows()[:1, :256].repeat(3, 1)])
    return raw, X


def case_ggml_quantized(qtype, request):
    if not O.available():
        pytest.skip(f"ggml-quantized weights need the ggml oracle: {O.unavailable_reason()}")
    rng = np.random.default_rng(400 + int(qtype))
    raw = O.quantize(qtype, rng.standard_normal((21, 1024)).astype(np.float32))
    return raw, rng.standard_normal((3, 1024)).astype(np.float32)


def case_gemma_rows(qtype, request):
    t = gemma_tensor(request.getfixturevalue("gemma"), qtype)
    X = np.random.default_rng(9).standard_normal((2, t.n_per_row)).astype(np.float32)
    return np.ascontiguousarray(t.raw[:48]), X


MATMUL_CASES = [case_random_blocks, case_ggml_quantized, case_gemma_rows]
# the default model's rows only for the types it holds
MATMUL_PARAMS = [(c, q) for c in MATMUL_CASES for q in K_TYPES
                 if c is not case_gemma_rows or q in GEMMA_TENSORS]
matmul_params = pytest.mark.parametrize(
    "case, qtype", MATMUL_PARAMS, ids=[f"{c.__name__[5:]}-{q.name}" for c, q in MATMUL_PARAMS])


@matmul_params
def test_matmul_ggml_vs_numpy_twin(case, qtype, request):
    check_matmul_ggml_vs_twin(qtype, *case(qtype, request))


@needs_oracle
@matmul_params
def test_matmul_ggml_vs_libggml(case, qtype, request):
    check_matmul_ggml_vs_libggml(qtype, *case(qtype, request))


@matmul_params
def test_matmul_ggml_bit_identical_to_libggml_avx2(case, qtype, request, ggml_avx2):
    check_matmul_ggml_bit_exact(qtype, *case(qtype, request))


def test_kernel_table():
    assert set(K.KERNELS) == set(K_TYPES)
    for qtype, kern in K.KERNELS.items():
        assert kern.act_type == QT.Q8_K
        assert kern.dequantize.__name__ == f"dequantize_{qtype.name.lower()}"
        assert kern.matvec.__name__ == f"matvec_{qtype.name.lower()}"
        assert kern.matmul_ggml.__name__ == f"matmul_ggml_{qtype.name.lower()}"


def _scalar_matvec(qtype: QT):
    """The fp32 matvec of a vector-IR K type compiled from the same driver with its scalar head
    and loop (``vblock`` :func:`_vblock_none`), compiled once per type."""
    from numba import njit
    head, quad, bsz, sub, nmin, _ = K._TYPES[qtype]
    head, quad, has_min = getattr(K, head), getattr(K, quad), nmin > 0
    perm, wfirst = qtype in K.PERMUTED_LANES, qtype in K.WEIGHT_FIRST

    @njit
    def scalar(raw, x, out, f16):
        K._matvec_k(raw, L.NO_ROWS, L.NO_ROWS, x, out, f16, head, quad, bsz, sub, has_min, K._vblock_none,
                    perm, wfirst)
    return scalar


def test_k_lane_table_is_the_inverse_of_the_scalar_lane_order():
    """The vector IR block reads x permuted by K_LANE_ELEMENT (quants_k._permute_blocks);
    the scalar loop puts element b in lane _lane(b, True): the two orders must agree."""
    assert [int(K.K_LANE_ELEMENT[K._lane(b, True)]) for b in range(32)] == list(range(32))
    x = np.arange(64, dtype=np.float32)
    got = K._permute_blocks.py_func(x, K.K_LANE_ELEMENT)
    assert all(got[32 * g + K._lane(b, True)] == x[32 * g + b] for g in range(2) for b in range(32))


_SCALAR_MATVEC: dict = {}


@pytest.mark.parametrize("qtype", sorted(K._VECTOR_IR, key=int), ids=lambda q: q.name)
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 4), nb=st.integers(1, 4), x_exp=st.integers(-20, 20),
       seed=st.integers(0, 2**32 - 1))
def test_matvec_vector_ir_block_is_the_scalar_loop_bit_for_bit(qtype, rows, nb, x_exp, seed):
    """The K types' fp32 matvecs run each block as vector IR (quants_k._block_q2k ..
    _block_q6k: scales, mins and products); the scalar head and loop they replace, compiled
    from the same driver, give the same bits."""
    rng = np.random.default_rng(seed)
    raw = random_blocks(qtype, rows, nb, rng)
    x = (rng.standard_normal(nb * 256) * 2.0 ** x_exp).astype(np.float32)
    scalar = _SCALAR_MATVEC.setdefault(qtype, _scalar_matvec(qtype))
    want = np.empty(rows, np.float32)
    scalar(raw, x, want, K.quants_legacy.F16_TO_F32)
    got = np.empty(rows, np.float32)
    K.KERNELS[qtype].matvec(raw, x, got)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


# ------------------------------------------------------------------ integer dot-product path

from loaders import quants_legacy as L  # noqa: E402

I8_CASES = [(qt, v) for qt in K_TYPES for v in K.i8_variants(qt) if L.I8_DOT == "vnni" or v == L.I8_DOT]


def test_host_k_kernels_take_the_integer_path():
    """The K types' ggml numerics are the integer kernels where the host has them (the libggml
    tests above then run them); elsewhere the portable kernel."""
    for qt in K_TYPES:
        fast = L.I8_DOT is not None and L.I8_DOT in K.i8_variants(qt)
        assert (K.KERNELS[qt].matmul_ggml is not K.PORTABLE_GGML[qt]) == fast, qt.name


@pytest.mark.skipif(not I8_CASES, reason=f"no integer dot products on this host ({L.I8_DOT})")
@pytest.mark.parametrize("qtype,variant", I8_CASES, ids=lambda c: getattr(c, "name", c))
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), rows=st.integers(1, 7), nb=st.integers(1, 3), m=st.integers(1, 10),
       extreme=st.sampled_from([None, 0x00, 0xFF]))
def test_k_i8_path_bit_identical_to_portable(qtype, variant, seed, rows, nb, m, extreme):
    """Bit for bit the portable kernel's results (which equal libggml's): any row count, any
    finite fp16 scales, one or more activation rows, quant bytes (and Q4_K's / Q5_K's scale,
    min and qh bytes) all 0x00 or all 0xFF, activations whose quants reach +-127."""
    rng = np.random.default_rng(seed)
    raw = random_blocks(qtype, rows, nb, rng)
    if extreme is not None:
        blk = raw.reshape(rows, nb, -1)
        if qtype in (QT.Q4_K, QT.Q5_K):
            blk[:, :, 4:] = extreme              # scales, mins (qh) and quants
        else:                                    # quants (hmask, qh) and scales, not d / dmin
            blk[:, :, :{QT.Q2_K: 80, QT.Q3_K: 108, QT.Q6_K: 208}[qtype]] = extreme
    X = rng.standard_normal((m, 256 * nb)).astype(np.float32)
    X[:, ::16] *= 1e3
    xq = K.quantize_act_q8_k(X)
    got = np.full((m, rows), np.nan, np.float32)
    want = np.full((m, rows), np.nan, np.float32)
    with np.errstate(all="ignore"):
        K.i8_matmul_ggml(qtype, variant)(raw, xq, got)
        K.PORTABLE_GGML[qtype](raw, xq, want)
    # exact integer lane sums, then the same float operations in the same order
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_k_i8_path_refuses_an_unknown_variant():
    with pytest.raises(ValueError, match="Q3_K has no 'vnni512' integer path"):
        K.i8_matmul_ggml(QT.Q3_K, "vnni512")


@pytest.mark.skipif(not I8_CASES, reason=f"no integer dot products on this host ({L.I8_DOT})")
@pytest.mark.parametrize("variant", sorted({v for _, v in I8_CASES}))
def test_k_i8_q3_k_sign_trick_with_activation_quants_at_minus_128(variant):
    """Q3_K's integer path moves its signed quants' signs onto the Q8_K quants (VPSIGNB), exact
    for the quants ggml's quantizer makes (within +-127). Hand-made activation bytes holding
    -128 still give the portable kernel's bits: that call takes the portable kernel."""
    rng = np.random.default_rng(9)
    raw = random_blocks(QT.Q3_K, 5, 2, rng)
    xq = K.quantize_act_q8_k(rng.standard_normal((3, 512)).astype(np.float32))
    blk = xq.reshape(3, 2, K.Q8_K_BYTES)
    blk[0, :, 4:260] = 0x80                   # every quant of row 0: -128
    blk[2, 1, 4:12] = 0x80                    # eight of row 2
    got = np.full((3, 5), np.nan, np.float32)
    want = np.full((3, 5), np.nan, np.float32)
    K.i8_matmul_ggml(QT.Q3_K, variant)(raw, xq, got)
    K.PORTABLE_GGML[QT.Q3_K](raw, xq, want)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", K_TYPES, ids=ids)
def test_matvec_ggml_equals_matmul_ggml(qtype):
    """The decode entry (one float row, Q8_K made without its byte form where the type has an
    integer path) gives matmul_ggml's bits."""
    from loaders import quants
    rng = np.random.default_rng(12)
    raw = random_blocks(qtype, 9, 2, rng)
    x = rng.standard_normal(512).astype(np.float32)
    with np.errstate(all="ignore"):
        got = quants.matvec(raw, qtype, 512, x, "ggml")
        want = np.empty((1, 9), np.float32)
        K.KERNELS[qtype].matmul_ggml(raw, K.quantize_act_q8_k(x[None, :]), want)
    assert np.array_equal(got.view(np.uint32), want[0].view(np.uint32))
