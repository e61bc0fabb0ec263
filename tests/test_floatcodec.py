"""pyimp.kv.floatcodec (the state files' pred-f16 codec): bit-exact round trips of any float16
bit patterns in any shape, with and without a rotary frame and repeated rows; payloads
that are cut or corrupted fail through the caller's handler instead of decoding garbage
or crashing; and the predictions do what they are for on KV-like data."""
from __future__ import annotations

import math

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pyimp.kv import floatcodec as fc

# special bit patterns: zeros, infinities, NaNs (quiet, signalling, payloads), the
# smallest and largest subnormals and normals, one, and their negatives
SPECIAL = np.array([0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0x7FFF, 0xFFFF, 0xFE01,
                    0x0001, 0x8001, 0x03FF, 0x83FF, 0x0400, 0x8400, 0x7BFF, 0xFBFF, 0x3C00,
                    0xBC00], dtype=np.uint16)


class Bad(Exception):
    pass


def fail(reason):
    raise Bad(reason)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype="<f2").view("<u2").astype(np.uint16)


def round_trip(a: np.ndarray, rotary=None, **kw) -> bytes:
    payload = fc.encode(a, rotary, **kw)
    back = fc.decode(payload, a.shape, fail)
    assert back.dtype == np.float16 and back.shape == a.shape and back.flags.owndata
    assert back.view(np.uint16).tobytes() == bits(a).tobytes()
    return payload


# ------------------------------------------------------------------------ strategies
@st.composite
def patterns(draw, shape) -> np.ndarray:
    """float16 bit patterns of ``shape``: uniform (NaNs and infinities included), special
    values, a constant, a smooth walk, subnormals only, or a mixture of those."""
    n = math.prod(shape)
    kind = draw(st.sampled_from(["uniform", "special", "constant", "smooth", "subnormal", "mix"]))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        u = rng.integers(0, 65536, n)
    elif kind == "special":
        u = rng.choice(SPECIAL, n)
    elif kind == "constant":
        u = np.full(n, draw(st.sampled_from(list(SPECIAL) + [int(rng.integers(65536))])))
    elif kind == "smooth":
        scale = draw(st.sampled_from([1e-6, 1e-3, 1.0, 300.0]))
        walk = rng.normal(0, scale, shape).cumsum(axis=-2 if len(shape) >= 2 else 0)
        u = np.clip(walk, -65504, 65504).astype(np.float16).view(np.uint16).reshape(-1)
    elif kind == "subnormal":
        u = rng.integers(0, 1024, n) | (rng.integers(0, 2, n) << 15)
    else:
        u = np.where(rng.random(n) < 0.3, rng.choice(SPECIAL, n),
                     np.float16(rng.normal(0, 2, n)).view(np.uint16))
    return np.asarray(u, dtype=np.uint16).reshape(shape).view(np.float16)


@st.composite
def rotaries(draw, T: int, D: int):
    """None, or a rotary frame over some channel pairs (which may not fit: then ignored)."""
    if D < 2 or not draw(st.booleans()):
        return None
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    P = draw(st.integers(1, D // 2))
    pairs = rng.permutation(D)[:2 * P].reshape(P, 2)
    theta = rng.choice([0.0, 1e-6, 0.01, 1.0, 3.0, 1e3], P) * rng.random(P)
    rows = T + draw(st.sampled_from([0, 0, 1]))            # one row too many: ignored
    positions = np.sort(rng.integers(-5, 10 ** draw(st.integers(1, 9)), rows))
    return fc.Rotary(positions, theta, pairs)


shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=9) | \
    st.tuples(st.integers(0, 70), st.integers(0, 40)) | \
    st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(0, 24))


# ------------------------------------------------------------------------ round trips
@settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip_is_bit_exact(data):
    shape = data.draw(shapes)
    a = data.draw(patterns(shape))
    H, T, D = fc._planes(a.shape)
    rotary = data.draw(rotaries(T, D))
    max_taps = data.draw(st.sampled_from([0, 1, fc.MAX_TAPS]))
    round_trip(a, rotary, max_taps=max_taps)


@settings(deadline=None, max_examples=60)
@given(data=st.data())
def test_repeated_rows_round_trip(data):
    """Rows that repeat earlier ones (exactly, or rotated by the frame and rounded) take
    the repeated-row path, whatever else is in the plane."""
    T = data.draw(st.integers(2, 60))
    D = 2 * data.draw(st.integers(1, 12))
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    base = rng.normal(0, 1, (5, D))
    z = base[rng.integers(0, 5, T)]
    theta = rng.random(D // 2)
    i = np.arange(D // 2)
    rot = fc.Rotary(np.arange(T) * 3, theta, np.stack([i, i + D // 2], 1))
    if data.draw(st.booleans()):
        a = z.astype(np.float16)
        rot = None
    else:
        c, s = (np.cos(np.outer(rot.positions, theta)), np.sin(np.outer(rot.positions, theta)))
        h = D // 2
        a = np.concatenate([c * z[:, :h] - s * z[:, h:], s * z[:, :h] + c * z[:, h:]], 1)
        a = a.astype(np.float16)
    a = a.reshape(T, D)
    u = a.view(np.uint16)
    if data.draw(st.booleans()):                # and some special values in the mix
        u.reshape(-1)[rng.integers(0, u.size, 3)] = rng.choice(SPECIAL, 3)
    round_trip(a, rot)


@pytest.mark.parametrize("shape", [(), (0,), (1,), (2,), (0, 0), (0, 5), (5, 0), (1, 1), (1, 7),
                                   (7, 1), (3, 0, 4), (0, 3, 4), (2, 1, 1), (1, 1, 1, 1),
                                   (3, 5, 2, 3)])
def test_edge_shapes(shape):
    rng = np.random.default_rng(1)
    n = math.prod(shape)
    for u in (rng.integers(0, 65536, n), np.zeros(n, int), np.full(n, 0x7E00),
              rng.choice(SPECIAL, n)):
        a = np.asarray(u, np.uint16).reshape(shape).view(np.float16)
        round_trip(a)
        H, T, D = fc._planes(shape)
        if D >= 2:
            pairs = np.arange(2 * (D // 2)).reshape(-1, 2)
            round_trip(a, fc.Rotary(np.arange(T), np.ones(D // 2), pairs))


def test_constant_and_special_planes():
    for v in SPECIAL:
        round_trip(np.full((40, 8), v, np.uint16).view(np.float16))
    every = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    round_trip(every.view(np.float16).reshape(256, 256))        # every bit pattern once
    round_trip(every[::-1].copy().view(np.float16).reshape(4096, 16))
    round_trip(np.repeat(SPECIAL, 37).view(np.float16).reshape(-1, 1))


def test_big_endian_and_strided_inputs():
    a = (np.random.default_rng(2).normal(size=(30, 12)).cumsum(0)).astype(np.float16)
    p = fc.encode(a)
    assert fc.encode(a.astype(">f2")) == p
    assert fc.encode(np.asfortranarray(a)) == p
    s = a[::2, ::3]
    round_trip(s)


def test_encoding_is_deterministic():
    a = (np.random.default_rng(4).normal(size=(50, 32)).cumsum(0)).astype(np.float16)
    i = np.arange(16)
    rot = fc.Rotary(np.arange(50), 0.3 ** i, np.stack([i, i + 16], 1))
    assert fc.encode(a, rot) == fc.encode(a.copy(), rot)


def test_rotary_frame_that_does_not_fit_is_ignored():
    a = np.random.default_rng(5).normal(size=(20, 8)).astype(np.float16)
    wrong_rows = fc.Rotary(np.arange(19), np.ones(4), np.arange(8).reshape(4, 2))
    twice = fc.Rotary(np.arange(20), np.ones(2), np.array([[0, 1], [1, 2]]))
    out_of_range = fc.Rotary(np.arange(20), np.ones(1), np.array([[0, 8]]))
    for rot in (wrong_rows, twice, out_of_range):
        p = round_trip(a, rot)
        assert p[1] & 1 == 0 and p == fc.encode(a)


def test_too_many_channels():
    a = np.zeros((2, fc.MAX_CHANNELS + 1), np.float16)
    assert not fc.applies(a.shape) and fc.applies((5, fc.MAX_CHANNELS))
    with pytest.raises(ValueError, match="channels"):
        fc.encode(a)


def test_sincos_is_accurate():
    a = np.concatenate([np.linspace(-10, 10, 2001), np.geomspace(1e-9, 1e5, 500)])
    got = np.array([fc._sincos(float(v)) for v in a])
    assert np.abs(got[:, 0] - np.sin(a)).max() < 1e-9
    assert np.abs(got[:, 1] - np.cos(a)).max() < 1e-9


def test_standard_rotary_layouts_are_stored_compactly():
    """Pairs (i, i + D/2) or (2i, 2i + 1) and a float32 geometric theta are stored as
    layout codes (a ratio for theta), anything else as listed."""
    T, D = 64, 32
    a = (np.random.default_rng(6).normal(size=(T, D)).cumsum(0)).astype(np.float16)
    theta = fc._geometric_series(np.float32(1.0), np.float32(0.7), D // 2)
    i = np.arange(D // 2)
    for pairs, th, modes in ((np.stack([i, i + D // 2], 1), theta, (1, 1)),
                             (np.stack([2 * i, 2 * i + 1], 1), theta, (2, 1)),
                             (np.stack([i, i + D // 2], 1)[::-1], theta, (0, 1)),
                             (np.stack([i, i + D // 2], 1), theta * (1 + 1e-3 * i), (1, 0))):
        p = round_trip(a, fc.Rotary(np.arange(T), th, pairs))
        mlen = int.from_bytes(p[2:6], "little")
        model = zstandard.ZstdDecompressor().decompress(p[10:10 + mlen])
        assert tuple(model[28:30]) == modes


# ------------------------------------------------------------- what the codec is for
def _keys(T=512, D=64, seed=0, repeat=False):
    """Post-RoPE keys: per-channel means and correlated channels in the un-rotated frame."""
    rng = np.random.default_rng(seed)
    h = D // 2
    mix = rng.normal(0, 1, (D, D)) * (rng.random(D) < 0.2)
    z = rng.normal(0, 1, (T, D)) @ (np.eye(D) + 0.8 * mix) + rng.normal(0, 3, D)
    if repeat:
        z = z[rng.integers(0, 40, T)]
    theta = fc._geometric_series(np.float32(1.0), np.float32(10000 ** (-1 / h)), h)
    theta = theta.astype(np.float64)
    ang = np.outer(np.arange(T), theta)
    c, s = np.cos(ang), np.sin(ang)
    x = np.concatenate([c * z[:, :h] - s * z[:, h:], s * z[:, :h] + c * z[:, h:]], 1)
    i = np.arange(h)
    return x.astype(np.float16), fc.Rotary(np.arange(T), theta, np.stack([i, i + h], 1))


def test_rotary_frame_and_taps_pay_off_on_keys():
    from pyimp.kv.statefile import _shuffle
    k, rot = _keys()
    plain = len(zstandard.ZstdCompressor(level=3).compress(_shuffle(k)))
    no_taps = len(round_trip(k, max_taps=0))
    taps = len(round_trip(k))
    framed = len(round_trip(k, rot))
    assert framed < taps < no_taps < plain
    assert k.nbytes / framed > 1.2


def test_repeated_rows_are_nearly_free():
    k, rot = _keys(repeat=True)
    p = round_trip(k, rot)
    assert p[1] == 3                                     # rotary frame and repeated rows
    assert k.nbytes / len(p) > 3


# ----------------------------------------------------------------- corrupt payloads
@pytest.fixture(scope="module")
def payloads():
    k, rot = _keys(T=40, D=16, seed=3, repeat=True)
    v = np.random.default_rng(8).normal(size=(2, 30, 12)).astype(np.float16)
    return [(fc.encode(k, rot), k.shape), (fc.encode(v), v.shape),
            (fc.encode(np.zeros((0, 4), np.float16)), (0, 4))]


def _decode_or_fail(payload: bytes, shape) -> None:
    try:
        out = fc.decode(payload, shape, fail)
    except Bad:
        return
    assert out.shape == shape and out.dtype == np.float16


@settings(deadline=None, max_examples=400)
@given(data=st.data())
def test_corrupt_payload_fails_cleanly(payloads, data):
    """A flipped, cut, extended or overwritten payload either decodes to an array of the
    right shape or fails through ``fail``: never a crash, a hang or an exception of its own.
    (State files checksum every payload; this covers what a checksum cannot.)"""
    payload, shape = data.draw(st.sampled_from(payloads))
    b = bytearray(payload)
    how = data.draw(st.sampled_from(["flip", "cut", "extend", "overwrite"]))
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(b) - 1))
            b[i] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "cut":
        b = b[:data.draw(st.integers(0, len(b) - 1))]
    elif how == "extend":
        b += bytes(data.draw(st.binary(min_size=1, max_size=8)))
    else:
        i = data.draw(st.integers(0, len(b) - 1))
        chunk = data.draw(st.binary(min_size=1, max_size=16))
        b[i:i + len(chunk)] = chunk
    _decode_or_fail(bytes(b), shape)


def test_wrong_shape_and_version_fail(payloads):
    payload, shape = payloads[0]
    for other in [(shape[0] + 1, shape[1]), (shape[0], shape[1] * 2), (2,) + shape]:
        with pytest.raises(Bad, match="planes"):
            fc.decode(payload, other, fail)
    with pytest.raises(Bad, match="version 2"):
        fc.decode(bytes([2]) + payload[1:], shape, fail)
    with pytest.raises(Bad, match="too short"):
        fc.decode(payload[:3], shape, fail)
