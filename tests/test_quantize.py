"""Row quantizers (loaders.quantize) against gguf.quants, byte for byte."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from loaders.quantize import CODES, f32_to_bf16, quantize_rows

TYPES = sorted(CODES, key=lambda t: t.name)

# float32 values as KV caches hold them (finite; fp16 range for the scales to stay finite).
# -0.0 is folded to +0.0: on a block whose minimum is a tie between 0.0 and -0.0 the sign of
# the stored fp16 minimum depends on which one NumPy's min reduction returns (value-identical).
# Magnitudes below 1e-30 are folded to 0: a block whose scale is an fp32 subnormal has an
# infinite 1/d, and the conversion of inf / NaN quants to integers is undefined in C and NumPy.
_vals = st.floats(-6.0e4, 6.0e4, width=32, allow_nan=False, allow_infinity=False).map(
    lambda v: v if abs(v) >= 1e-30 else 0.0)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@settings(deadline=None, max_examples=60)
@given(data=st.data())
def test_quantize_rows_bytes_equal_gguf(qtype, data):
    rows = data.draw(st.integers(1, 3))
    nb = data.draw(st.integers(1, 4))
    x = data.draw(hnp.arrays(np.float32, (rows, nb * 32), elements=_vals)) + np.float32(0.0)
    # also blocks with repeated extremes (ties of the signed max / of min and max)
    if data.draw(st.booleans()):
        x[:, 5] = x[:, 0]
        x[:, 9] = -x[:, 0]
    ours = quantize_rows(x, qtype)
    ref = gq.quantize(x, qtype)
    assert np.array_equal(ours, ref)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_quantize_rows_real_scale(qtype):
    """Gaussian rows of the scale keys and values have, and an all-zero block (d = 0)."""
    rng = np.random.default_rng(int(CODES[qtype]))
    x = (rng.standard_normal((64, 256)) * rng.uniform(0.01, 30, (64, 1))).astype(np.float32)
    x[3, 32:64] = 0.0
    assert np.array_equal(quantize_rows(x, qtype), gq.quantize(x, qtype))


def test_quantize_rows_refuses():
    with pytest.raises(ValueError, match="Q4_K"):
        quantize_rows(np.zeros((1, 256), np.float32), QT.Q4_K)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_rows(np.zeros((1, 48), np.float32), QT.Q8_0)



def test_f32_to_bf16_equals_gguf():
    """bfloat16 bits of random values, rounding ties both ways, the largest finite values (to
    inf), infinities, subnormals, signed zeros and NaNs with payloads equal gguf's BF16."""
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(4000).astype(np.float32) * 10.0 ** rng.integers(-40, 39, 4000),
                        rng.integers(0, 1 << 32, 4000, dtype=np.uint64).astype(np.uint32).view(np.float32)])
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000,
                     0x7F800000, 0xFF800000, 0x00000001, 0x80008000, 0x00000000, 0x80000000,
                     0x7F800001, 0xFFC00000, 0x7FBFFFFF, 0xFF80FFFF], np.uint32)
    x = np.concatenate([x, ties.view(np.float32)]).reshape(8, -1)
    with np.errstate(all="ignore"):
        ref = np.asarray(gq.quantize(x, QT.BF16)).view(np.uint16).reshape(x.shape)
    got = f32_to_bf16(x)
    assert got.dtype == np.uint16 and got.shape == x.shape
    np.testing.assert_array_equal(got, ref)


@functools.lru_cache(maxsize=1)
def _decoder():
    """decode_qblocks is inline-only: a jitted caller (compiled once)."""
    import numba

    from loaders.quantize import decode_qblocks

    @numba.njit
    def decode(code, w, wo, nb, out, oo, step, f16):
        decode_qblocks(code, w, wo, nb, out, oo, step, f16)
    return decode


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@settings(deadline=None, max_examples=30)
@given(data=st.data())
def test_decode_qblocks_equals_gguf(qtype, data):
    """decode_qblocks, contiguous (the vector path attention's block loads take) and strided
    (the scalar path), is bit-identical to gguf's dequantization, from any block and into any
    output offset; blocks carry random bytes (every quant and fifth-bit pattern) and fp16
    scales / mins of every magnitude and sign."""
    from pyimp.attention.importance import fp16_lut
    from pyimp.testing import strategies as S
    raw, n = data.draw(S.quant_rows(qtype.name, max_rows=2, max_blocks=4))
    ref = gq.dequantize(raw, qtype).reshape(-1)
    nb = ref.size // 32
    b0 = data.draw(st.integers(0, nb - 1))
    bsz = raw.shape[1] // (n // 32)
    oo = data.draw(st.integers(0, 5))
    for step in (1, 3):
        out = np.full(oo + (nb - b0) * 32 * step, np.nan, np.float32)
        _decoder()(CODES[qtype], raw.reshape(-1), b0 * bsz, nb - b0, out, oo, step, fp16_lut())
        got = out[oo::step]
        assert np.array_equal(got.view(np.uint32), ref[b0 * 32:].view(np.uint32)), step
