"""The weight kernels (pyimp.cuda.linear) against gguf's dequantization and float64 NumPy.

get_rows must equal gguf's dequantization bit for bit (every decoder is exercised by it);
matvec and matmul are the dequantized weights times x, summed in float32, checked against
float64 within a rounding bound. Legacy blocks come from gguf's quantizer (and, for
get_rows, random bytes too), K blocks are random bytes with finite fp16 scales. gguf's
quantizer and dequantizer, or where gguf is missing (the GPU machine) pyimp's CPU ones that
the main suite checks against gguf's: ``quant_oracle``.
Shapes are tiny (the simulator runs a Python thread per CUDA thread).
"""
import re

import numpy as np
import pytest
from quant_oracle import dequantize, quantize

from loaders import ggml_types
from loaders.ggml_types import QT
from pyimp.cuda import device, linear

FLOAT_TYPES = [QT.F32, QT.F16, QT.BF16]
LEGACY_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0]
K_TYPES = [QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K]
ALL_TYPES = FLOAT_TYPES + LEGACY_TYPES + K_TYPES
# byte offsets of the fp16 scales inside one block (d, and m / dmin where the type has one)
F16_OFFSETS = {QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q8_0: (0,),
               QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}
U32 = 2.0 ** -24          # float32 unit roundoff
ids_ = [t.name for t in ALL_TYPES]


def n_for(qtype) -> int:
    """A row length covering two blocks (a float row not a multiple of 32)."""
    return {1: 40, 32: 64, 256: 512}[ggml_types.block_size(qtype)]


def finite_f16_bits(rng, shape) -> np.ndarray:
    """Random finite fp16 bit patterns (subnormals and signed zeros included)."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] ^= 0x4000
    return bits


def random_blocks(qtype, rows, n, rng) -> np.ndarray:
    """uint8[rows, row_bytes]: random bytes, every fp16 scale set to a random finite value."""
    bb = ggml_types.type_size(qtype)
    nb = n // ggml_types.block_size(qtype)
    raw = rng.integers(0, 256, size=(rows, nb * bb), dtype=np.uint8)
    blk = raw.reshape(rows, nb, bb)
    for off in F16_OFFSETS[qtype]:
        blk[:, :, off:off + 2] = finite_f16_bits(rng, (rows, nb)).view(np.uint8).reshape(rows, nb, 2)
    return raw


def make_raw(qtype, rows, n, rng) -> np.ndarray:
    """Stored rows uint8[rows, row_bytes] of a weight of type qtype."""
    if qtype in K_TYPES:
        return random_blocks(qtype, rows, n, rng)
    w = rng.standard_normal((rows, n)).astype(np.float32)
    raw = np.ascontiguousarray(quantize(w, qtype)).view(np.uint8).reshape(rows, -1)
    assert raw.shape[1] == ggml_types.row_bytes(qtype, n)
    return raw


def reference(qtype, raw) -> np.ndarray:
    return dequantize(raw, qtype)


def magnitude(w, x) -> np.ndarray:
    """sum_j |w[r, j] * x[t, j]| as float64[T, rows]: the size of what a dot product sums."""
    return np.abs(np.atleast_2d(x).astype(np.float64)) @ np.abs(w.astype(np.float64)).T


# ---------------------------------------------------------------- get_rows

@pytest.mark.parametrize("qtype", ALL_TYPES, ids=ids_)
def test_get_rows_bit_exact(qtype):
    rng = np.random.default_rng(int(qtype))
    n = n_for(qtype)
    raw = make_raw(qtype, 3, n, rng)
    ids = np.array([2, 0, 2], np.int64 if int(qtype) % 2 else np.int32)
    out = device.to_device(np.full((3, n), np.nan, np.float32))
    linear.get_rows(device.to_device(raw), qtype, n, device.to_device(ids), out)
    ref = reference(qtype, raw)[ids]
    # exact: the decoders do gguf's float32 operations in gguf's order
    np.testing.assert_array_equal(device.to_host(out).view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("qtype", LEGACY_TYPES, ids=[t.name for t in LEGACY_TYPES])
def test_get_rows_random_legacy_blocks(qtype):
    """Every bit pattern of the quants (quantize() output does not hit them all)."""
    rng = np.random.default_rng(100 + int(qtype))
    raw = random_blocks(qtype, 2, 64, rng)
    ids = np.array([1, 0], np.int32)
    out = device.zeros((2, 64), np.float32)
    linear.get_rows(device.to_device(raw), qtype, 64, device.to_device(ids), out)
    ref = reference(qtype, raw)[ids]
    np.testing.assert_array_equal(device.to_host(out).view(np.uint32), ref.view(np.uint32))


def test_get_rows_bad_id_gives_nan():
    rng = np.random.default_rng(7)
    raw = make_raw(QT.Q8_0, 2, 32, rng)
    out = device.zeros((3, 32), np.float32)
    linear.get_rows(device.to_device(raw), QT.Q8_0, 32, device.to_device(np.array([1, 2, -1], np.int32)), out)
    got = device.to_host(out)
    np.testing.assert_array_equal(got[0], reference(QT.Q8_0, raw)[1])
    assert np.isnan(got[1:]).all()


# ---------------------------------------------------------------- matvec / matmul

def check_close(got, w, x, n):
    ref = np.atleast_2d(x).astype(np.float64) @ w.astype(np.float64).T
    # float32 products and sums in some order: at most n + 1 roundings touch a term, so
    # |got - exact| <= gamma_(n+1) * sum |w * x| < (n + 2) * u * sum |w * x|; w itself is
    # exact (the decoders equal gguf's dequantization, checked above)
    tol = (n + 2) * U32 * magnitude(w, x)
    got = np.atleast_2d(got)
    assert np.all(np.isfinite(got))
    err = np.abs(got - ref)
    assert np.all(err <= tol), f"max err/tol {np.max(err / np.maximum(tol, 1e-300)):.3g}"


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=ids_)
def test_matvec(qtype):
    rng = np.random.default_rng(10 + int(qtype))
    n, rows = n_for(qtype), 3
    raw = make_raw(qtype, rows, n, rng)
    x = rng.standard_normal(n).astype(np.float32)
    out = device.to_device(np.full(rows, np.nan, np.float32))
    linear.matvec(device.to_device(raw), qtype, n, device.to_device(x), out)
    check_close(device.to_host(out), reference(qtype, raw), x, n)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=ids_)
def test_matmul(qtype):
    rng = np.random.default_rng(20 + int(qtype))
    n, rows, T = n_for(qtype), 5, 3
    raw = make_raw(qtype, rows, n, rng)
    x = rng.standard_normal((T, n)).astype(np.float32)
    out = device.to_device(np.full((T, rows), np.nan, np.float32))
    linear.matmul(device.to_device(raw), qtype, n, device.to_device(x), out)
    check_close(device.to_host(out), reference(qtype, raw), x, n)


@pytest.mark.parametrize("qtype", [QT.F32, QT.Q4_0], ids=["F32", "Q4_0"])
def test_matmul_several_tiles(qtype):
    """Two tiles in rows and in tokens, partial edge tiles, a partial k step (F32, n = 40)."""
    rng = np.random.default_rng(30 + int(qtype))
    n, rows, T = n_for(qtype), 35, 33
    raw = make_raw(qtype, rows, n, rng)
    x = rng.standard_normal((T, n)).astype(np.float32)
    out = device.to_device(np.full((T, rows), np.nan, np.float32))
    linear.matmul(device.to_device(raw), qtype, n, device.to_device(x), out)
    check_close(device.to_host(out), reference(qtype, raw), x, n)


def test_matvec_matches_matmul_row():
    """A token's matmul row and its matvec sum the same terms (in another order)."""
    rng = np.random.default_rng(3)
    n, rows = 64, 4
    raw = make_raw(QT.Q5_1, rows, n, rng)
    x = rng.standard_normal((1, n)).astype(np.float32)
    mv = device.zeros(rows, np.float32)
    mm = device.zeros((1, rows), np.float32)
    d_raw = device.to_device(raw)
    linear.matvec(d_raw, QT.Q5_1, n, device.to_device(x[0]), mv)
    linear.matmul(d_raw, QT.Q5_1, n, device.to_device(x), mm)
    w = reference(QT.Q5_1, raw)
    check_close(device.to_host(mv), w, x, n)
    check_close(device.to_host(mm), w, x, n)


# ---------------------------------------------------------------- launcher checks

def test_unsupported_type_names_it():
    raw = device.zeros((2, 36), np.uint8)
    x = device.zeros(32, np.float32)
    out = device.zeros(2, np.float32)
    iq2_xxs = 16      # named IQ2_XXS where the type table is gguf's, type#16 with pyimp's own
    with pytest.raises(ValueError, match=re.escape(ggml_types.type_name(iq2_xxs))):
        linear.matvec(raw, iq2_xxs, 256, x, out)
    with pytest.raises(ValueError, match="Q8_1"):
        linear.matmul(raw, QT.Q8_1, 32, device.zeros((1, 32), np.float32), device.zeros((1, 2), np.float32))
    with pytest.raises(ValueError, match="type#9999"):
        linear.get_rows(raw, 9999, 32, device.zeros(1, np.int32), device.zeros((1, 32), np.float32))


def test_bad_arguments_are_named():
    raw = device.zeros((2, 34), np.uint8)
    x = device.zeros(32, np.float32)
    out = device.zeros(2, np.float32)
    with pytest.raises(ValueError, match="raw"):
        linear.matvec(device.zeros((2, 33), np.uint8), QT.Q8_0, 32, x, out)
    with pytest.raises(ValueError, match="n_in"):
        linear.matvec(raw, QT.Q8_0, 30, x, out)
    with pytest.raises(ValueError, match="x"):
        linear.matvec(raw, QT.Q8_0, 32, device.zeros(32, np.float64), out)
    with pytest.raises(ValueError, match="out"):
        linear.matvec(raw, QT.Q8_0, 32, x, device.zeros(3, np.float32))
    with pytest.raises(ValueError, match="x"):
        linear.matmul(raw, QT.Q8_0, 32, device.zeros((2, 64), np.float32), device.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="ids"):
        linear.get_rows(raw, QT.Q8_0, 32, device.zeros(1, np.float32), device.zeros((1, 32), np.float32))
    with pytest.raises(ValueError, match="out"):
        linear.get_rows(raw, QT.Q8_0, 32, device.zeros(2, np.int64), device.zeros((1, 32), np.float32))
