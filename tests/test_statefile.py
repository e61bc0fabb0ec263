"""pyimp.kv.statefile: round trips, detection of every truncation and bit flip (in every codec's
payloads), atomic writes, files of the first release's codecs, and the refusals at write
time."""
from __future__ import annotations

import base64
import itertools
import os
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pyimp.kv import statefile
from pyimp.kv.statefile import Rotary, StateFileError, read_header, read_state, write_state

DTYPES = [np.float16, np.float32, np.uint8, np.int8, np.uint16, np.int32, np.int64, np.uint32]


# ------------------------------------------------------------------------ strategies
@st.composite
def any_array(draw, dtype) -> np.ndarray:
    """An array of ``dtype`` of rank 0..3 (empty allowed); float arrays are drawn as bit
    patterns, so NaNs with any payload, infinities and subnormals all occur."""
    dtype = np.dtype(dtype)
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=12))
    if dtype.kind == "f":
        return draw(hnp.arrays(np.dtype(f"u{dtype.itemsize}"), shape)).view(dtype)
    return draw(hnp.arrays(dtype, shape))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
headers = st.dictionaries(st.text(max_size=12), json_values, max_size=6)
array_dicts = st.dictionaries(st.text(min_size=1, max_size=16),
                              st.sampled_from(DTYPES).flatmap(any_array), max_size=6)


def same_arrays(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for name, a in want.items():
        b = got[name]
        assert b.dtype == a.dtype.newbyteorder("="), name
        assert b.shape == a.shape, name
        assert b.tobytes() == np.asarray(a, dtype=b.dtype).tobytes(), name
        assert b.flags.c_contiguous and b.flags.writeable and b.flags.owndata, name


# -------------------------------------------------------------------------- helpers
def layout(data: bytes) -> list[tuple[str, int, int]]:
    """(region, start, end) of the preamble, header, table and every section payload of a
    state file, parsed from the layout the module docstring documents; also checks that
    every checksum is the CRC-32 the docstring names."""
    magic, version, hlen, tlen, n, crc = struct.unpack_from("<8sIIIII", data)
    assert (magic, version) == (b"PYIMPST\0", 1)
    assert crc == zlib.crc32(data[:24])
    out = [("preamble", 0, 28)]
    pos = 28
    assert struct.unpack_from("<I", data, pos + hlen)[0] == zlib.crc32(data[pos:pos + hlen])
    out.append(("header", pos, pos + hlen + 4))
    pos += hlen + 4
    table = data[pos:pos + tlen]
    assert struct.unpack_from("<I", data, pos + tlen)[0] == zlib.crc32(table)
    out.append(("section table", pos, pos + tlen + 4))
    pos += tlen + 4
    t = 0
    for _ in range(n):
        (nlen,) = struct.unpack_from("<H", table, t)
        name = table[t + 2:t + 2 + nlen].decode("utf-8")
        t += 2 + nlen
        _code, _codec, ndim = struct.unpack_from("<BBB", table, t)
        t += 3 + 8 * ndim
        _raw_len, stored_len, scrc = struct.unpack_from("<QQI", table, t)
        t += 20
        assert scrc == zlib.crc32(data[pos:pos + stored_len])
        out.append((f"section {name!r}", pos, pos + stored_len))
        pos += stored_len
    assert t == tlen and pos == len(data)
    return out


def kv_plane(rows: int, channels: int, seed: int = 0) -> np.ndarray:
    """float16 tokens x channels with correlated channels that drift with the token."""
    rng = np.random.default_rng(seed)
    walk = rng.normal(0, 0.3, (rows, channels)).cumsum(axis=0)
    mix = rng.normal(0, 1, (channels, channels)) * (rng.random((channels, channels)) < 0.2)
    return (walk @ (np.eye(channels) + mix) + rng.normal(0, 1, channels)).astype(np.float16)


def section_codecs(data: bytes) -> dict[str, str]:
    """The codec of each section of a state file, from its table."""
    _, _, hlen, tlen, n, _ = struct.unpack_from("<8sIIIII", data)
    table, t, out = data[28 + hlen + 4:28 + hlen + 4 + tlen], 0, {}
    for _ in range(n):
        (nlen,) = struct.unpack_from("<H", table, t)
        name = table[t + 2:t + 2 + nlen].decode("utf-8")
        t += 2 + nlen
        _code, codec, ndim = struct.unpack_from("<BBB", table, t)
        t += 3 + 8 * ndim + 20
        out[name] = statefile.CODEC_NAMES[codec]
    return out


def sample_state(n: int) -> tuple[dict, dict[str, np.ndarray]]:
    """A header and arrays that exercise every codec: a smooth float16 plane of a few
    channels and a float32 one (shuffle-zstd), a KV-like float16 plane (pred-f16; from
    n = 256), skewed uint8 codes (zstd), a small int32 array, incompressible bytes (raw
    fallback), a 0-d array and an empty one (raw)."""
    rng = np.random.default_rng(7)
    t = np.linspace(0, 8, n)
    arrays = {
        "k.0": (np.sin(t)[:, None] * np.arange(1, 9)).astype(np.float16),
        "k.1": kv_plane(n // 2, 16),
        "v.0": np.cos(t).astype(np.float32),
        "codes": np.clip(rng.normal(0, 12, n), -127, 127).astype(np.int8).view(np.uint8),
        "tokens": rng.integers(0, 262144, n // 4).astype(np.int32),
        "noise": rng.integers(0, 256, 96, dtype=np.uint8),
        "n_past": np.array(n, dtype=np.int64),
        "empty": np.zeros((0, 3), dtype=np.uint16),
    }
    header = {"model": {"fingerprint": "abc123", "n_layer": 1}, "n_tokens": n, "note": "état ✓"}
    return header, arrays


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("statefile")


@pytest.fixture(scope="module")
def fuzz_file(workdir) -> tuple[bytes, list[tuple[str, int, int]]]:
    """A real state file's bytes and its regions (each non-empty)."""
    path = workdir / "fuzz.pkv"
    header, arrays = sample_state(512)
    stats = write_state(path, header, arrays)
    assert {s["codec"] for s in stats["sections"].values()} == set(statefile.CODEC_NAMES.values())
    assert stats["sections"]["k.1"]["codec"] == "pred-f16"
    data = path.read_bytes()
    return data, [r for r in layout(data) if r[2] > r[1]]


def write_bytes(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


# ------------------------------------------------------------------------ round trip
@settings(deadline=None, max_examples=60)
@given(header=headers, arrays=array_dicts)
def test_round_trip_is_exact(workdir, header, arrays):
    path = workdir / "roundtrip.pkv"
    stats = write_state(path, header, arrays)
    got_header, got = read_state(path)
    assert got_header == header
    same_arrays(got, arrays)
    assert read_header(path) == header
    assert list(stats["sections"]) == list(arrays)
    assert stats["file_bytes"] == os.path.getsize(path)
    assert stats["raw_bytes"] == sum(a.nbytes for a in arrays.values())


@pytest.mark.parametrize("level", [None, 0, 1, 19])
def test_round_trip_every_codec_and_level(workdir, level):
    header, arrays = sample_state(3000)
    path = workdir / f"levels-{level}.pkv"
    stats = write_state(path, header, arrays, level=level)
    got_header, got = read_state(path)
    assert got_header == header
    same_arrays(got, arrays)
    codecs = {name: s["codec"] for name, s in stats["sections"].items()}
    if level == 0:
        assert set(codecs.values()) == {"raw"}
    else:
        assert codecs["v.0"] == "shuffle-zstd" and codecs["k.1"] == "pred-f16"
        assert codecs["k.0"] in ("shuffle-zstd", "pred-f16")      # the smaller, as measured
        assert codecs["codes"] == "zstd"
        assert codecs["noise"] == codecs["n_past"] == codecs["empty"] == "raw"
        assert stats["file_bytes"] < stats["raw_bytes"]
    for s in stats["sections"].values():
        assert s["stored_bytes"] <= s["raw_bytes"]
    assert stats["seconds"] >= 0


def test_strided_big_endian_and_fortran_inputs(workdir):
    base = np.arange(240, dtype=np.float32).reshape(12, 20)
    arrays = {"strided": base[::2, 1::3], "fortran": np.asfortranarray(base),
              "big": base.astype(">f4"), "big16": np.arange(100, dtype=">u2")}
    path = workdir / "layouts.pkv"
    write_state(path, {}, arrays)
    _, got = read_state(path)
    same_arrays(got, arrays)


def test_real_kv_like_planes_compress(workdir):
    """Smooth float16 planes (as KV caches are) shrink, most with pred-f16; NaN payloads
    survive bitwise."""
    rng = np.random.default_rng(0)
    k = (rng.normal(0, 1, (4, 64, 128)).cumsum(axis=1) * 0.1).astype(np.float16)
    k.reshape(-1)[::97] = np.array(0x7E01, dtype=np.uint16).view(np.float16)   # NaN payload
    path = workdir / "kv.pkv"
    stats = write_state(path, {"kind": "kv"}, {"k": k})
    assert stats["sections"]["k"]["codec"] == "pred-f16"
    assert stats["sections"]["k"]["stored_bytes"] < 0.9 * k.nbytes
    _, got = read_state(path)
    assert got["k"].view(np.uint16).tobytes() == k.view(np.uint16).tobytes()


def test_rotary_frames_are_used_and_round_trip(workdir):
    """Keys with RoPE applied: with their frame pred-f16 stores them smaller."""
    T, D, h = 256, 32, 16
    rng = np.random.default_rng(1)
    z = rng.normal(0, 1, (T, D)) + rng.normal(0, 4, D)
    theta = 10000.0 ** (-np.arange(h) / h)
    ang = np.outer(np.arange(T), theta)
    c, s = np.cos(ang), np.sin(ang)
    k = np.concatenate([c * z[:, :h] - s * z[:, h:], s * z[:, :h] + c * z[:, h:]], 1)
    k = k.astype(np.float16)[None]
    frame = Rotary(np.arange(T), theta, np.stack([np.arange(h), np.arange(h) + h], 1))
    path = workdir / "rope.pkv"
    plain = write_state(path, {}, {"k": k})["sections"]["k"]
    framed = write_state(path, {}, {"k": k}, rotary={"k": frame})["sections"]["k"]
    assert framed["codec"] == "pred-f16" and framed["stored_bytes"] < plain["stored_bytes"]
    _, got = read_state(path)
    same_arrays(got, {"k": k})
    misfit = Rotary(np.arange(T - 1), theta, frame.pairs)     # ignored
    write_state(path, {}, {"k": k}, rotary={"k": misfit})
    same_arrays(read_state(path)[1], {"k": k})


# a file of the first release (format 1, codecs raw / zstd / shuffle-zstd) of these arrays
FIRST_RELEASE_FILE = base64.b64decode("""
UFlJTVBTVAABAAAAIgAAAOIAAAAGAAAAc9NJVHsibWFkZV9ieSI6ImZvcm1hdCAxLCBjb2RlY3MgMC0yIn1WnwXWAwBr
LjABAgJgAAAAAAAAAAgAAAAAAAAAAAYAAAAAAACHBAAAAAAAAD+W11sDAHYuMAICAWAAAAAAAAAAgAEAAAAAAABFAQAA
AAAAAHTzrncFAGNvZGVzAwEBLAEAAAAAAAAsAQAAAAAAABkBAAAAAAAARwSZRgYAdG9rZW5zBgIBKAAAAAAAAACgAAAA
AAAAAGQAAAAAAAAA8SDqkgUAbm9pc2UDAAFQAAAAAAAAAFAAAAAAAAAAUAAAAAAAAADubU5DBgBuX3Bhc3QHAAAIAAAA
AAAAAAgAAAAAAAAA0n/Jta1/5cMotS/9ZAAFzSMAZD8AAGNjCmO8CrdjYmIKYrsKtmIICAwICgwOCF1dBl20BrJdsLAE
sC4E2rAApqb5ps/5EaZKSu9KnO+hSuvrcOtmcC7rioroihbouYomJlwmeFxBJr+/z7/Xz8e/Kio/KjQ/SSpzc6xzj6zI
c7m5FrnnFiK5/v59/j19Xv5AQOBAkOCYQICAIIDgINCAvb1OvSxOBr34+Hr4dno5+DAwpDC8pGowZWXMZf7MmWWYmPKY
H/LFmMfHFcc8Fe7H8/M281g2FfMcHFUcclU5HEJCckKJclpCZWWMZZ+MeGWEhKOEs6OUhKCguKDEuKyguLjKuNPKwbjN
zdrN4NrTzd7e597r5+Pe7Ozx7PTx7+z29vn2+vn49v39/v3+/v39AP/7+/z7/fz7+/Pz9vP49vTz5+ft5/Ht6ufY2OLY
5+Ld2MXF1MXb1M3Fr6/Dr83Dua+VlbCVvbCjlXh4mnirmol4WFiCWJeCbVg0NGc0gGdNNA0NSg1oSisN4uIq4k0qBuK1
tQi1MQjetYSE44QT47SEUVG9UeW9h1EbG5QboZRXG+HhaeFaaSXhpqY8pg888aZnZw5nwQ66ZycnuidwuoIn4+NV4xxV
R+Oenu2exu0KnldXgldsgphXDQ0UDREUFw2yo5OE6uow6lIwDepNTbpN4LqDTa2tQq0YQvetCwuQC02QaQtmZplmf5my
Zn5+n36vn45+LS2iLbiiZy3Z2UbZEEY+2QcHRQdkRSYHWFiEWG6Emlibm/SbIfTHmywsQiw3Qk4seXmbeaybinlsbNFs
BNGfbIyM04yv0/aM4eFo4VloJeEyMmYyf2ZMMkBAYEBQYHFA5uZY5h9YSeaJiSaJ6ybYiSkpnymzn2QpYWGJYZ2JdWH5
+fv5+/v6+UZGaUZYaXtGjo7VjrLV+Y7U1D7UCT451BgYoxheo3UYWVkDWa8DrlmYmDKY/jLlmNTUX9RJXxrUDg6KDpGK
TA4pLTAxMjQ0NS0xNDU2ODg5MDQ2ODk6OzwxNTg5Ojw8PTI2OTo8PT0+NDg6PD0+P0BAQDU5O0E1OTw9P0BBQTY6PD5A
QEFCNztCQzg8PkBBQkNEP0BBQ0RCQ0REOT0/RTk9QEFCRENERTo+RUZEQUJERUZGOz9GRzxAQkhGREJEQ0Q2Oj1CMzc5
Ozw9Pj8yNjg6MDQ3PC8zNTcsMDI0NTY3OCYqLC4wMDEypKiqrK2ur7Crr7GztLW2t66ytLa4uLm6sLS2uLm6u7yxtbi5
u7y9vbO3vr+0uLrAtLi7vL6/wMC1uby9vsDAwba6wcK2ur2+wMHBwre7vcO4vL7Ev8DCw8TEub2/wcLDxMW5vcDBwsTD
xMXFur7AwsPExcY7ILAio5n5kDyCK7NZf31/aYP3qcRuFu1jHVk0/7fboE1nY9kBA3YlLh3GZgmnEJrbc8TWCSwZ4M7G
YdsAxSTAPjaslWBsAM83jSEmRqC3wau9jh4h1i7yo4Q7Yqy0+GVMxojCeDWbD8IVQRIe7LGhbUlkrY8kcEIQMoubUWY9
zDZiFa7VKLUv/WSAAL0JALQSAOrE3LYJwv8UhQmHF/+23UHbzF8CSu7Izza6xB++wWkynDq6ybDWvlBak5Cc0hMsDdHh
LCS7Bzut1lXxmGGQlAq8pvMAW8Y0z/IvSz87ogxES1TFNnBvXI+REvM8He8wAMUX9WBZ3/Wd1qQHA5jLnRIr7Vt4R8wM
CpajRohwCVzkqBmSMV8z6sacDSNl+EI40gZmj3gdfI9TxeKlDRa9AN1QWfUk4i8Lc2jq95C1ZqVxzLczQ+ci9mVyIHBo
CVZVgH9/fXx6d3RxbWllYFpUTkhBOTIqIhkRCP3q18Ovm4ZiOA7GYVPvkeceSXOOorfL3vICCxQdJS01PENKUVdcYmZr
b3J2eHt9fn9/f39+fXt5dnNwbGdjXVhSTEU+Ny8nPz8+PT08vL29vr8EEAAa8Uy7ROopHP7Rmyi1L/1kLABdCADG0kEx
kKVpAymye8mSTUgixO7WEFv71Sr///////////+1HL+y/+3NGtkmjUg2iexNiMiUAjQANQAyAEyU6GIhj6MiTzalcQtr
Pmvyn+Wi7sm6ZSJhgnPmYAo+HmBfmaL/8M2dKnwXAvWRt7VRcATtsAGxvkEjq8bippg/RY7h7x2tpyQAIQZGbySROFgs
+3y/4PWgnkS2MBUQzUmZ573F5HY0BYgnZsjPz/2Vmf10kzwKXovUHHqsJIVUaoa6dbsAEtSXseQQOm4dyKK9fJ077XRb
cV8CtaEP3aAYtbIqS0yICQDl/A13F8Ll5rSD3oFVsjMjNnf10cz/0XNai9q0gGvRM5ZYNmUHEABDyao2KLUv/SSgvQIA
9ATZj49JU82Tq62udXeesAItnar/TbLXNgPMv3alI3QmJnOZzJF2ZRscAgEAAQMBAgEAAwAAAQMCAAMDAQEAAgAAAwEB
AgACAQMBAAEBAgIAAQCPoyAKn7Du0RSJX3Kjwe3VMuFAsPaNjmpiey6vvAL/Pr9tpVgDTfM425feW8amoqb2/d0q/iE/
DDSlLrHDjJQ+g2SGYLmFzU2Ge7xC4oQsQv42JjvDBAm7YAAAAAAAAAA=
""")


def first_release_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    t = np.linspace(0, 4, 96)
    return {
        "k.0": (np.sin(t)[:, None] * np.arange(1, 9)).astype(np.float16),
        "v.0": np.cos(t).astype(np.float32),
        "codes": np.clip(rng.normal(0, 12, 300), -127, 127).astype(np.int8).view(np.uint8),
        "tokens": rng.integers(0, 1000, 40).astype(np.int32),
        "noise": rng.integers(0, 256, 80, dtype=np.uint8),
        "n_past": np.array(96, dtype=np.int64),
    }


def test_first_release_files_still_load(workdir):
    path = workdir / "first.pkv"
    write_bytes(path, FIRST_RELEASE_FILE)
    header, got = read_state(path)
    assert header == {"made_by": "format 1, codecs 0-2"}
    same_arrays(got, first_release_arrays())
    assert set(section_codecs(FIRST_RELEASE_FILE).values()) == {"raw", "zstd", "shuffle-zstd"}


def test_pred_codec_on_a_section_that_is_not_float16_is_refused(workdir, fuzz_file):
    """The table names each section's codec: pred-f16 on an int32 section is corrupt."""
    content, regions = fuzz_file
    table = next(r for r in regions if r[0] == "section table")
    data = bytearray(content)
    hlen, tlen, n = struct.unpack_from("<III", content, 12)
    t, pos = table[1], 0
    for _ in range(n):
        (nlen,) = struct.unpack_from("<H", content, t + pos)
        name = content[t + pos + 2:t + pos + 2 + nlen].decode()
        pos += 2 + nlen
        if name == "tokens":
            data[t + pos + 1] = statefile.PRED_F16
        ndim = content[t + pos + 2]
        pos += 3 + 8 * ndim + 20
    struct.pack_into("<I", data, t + tlen, zlib.crc32(bytes(data[t:t + tlen])))
    path = workdir / "pred-int.pkv"
    write_bytes(path, bytes(data))
    with pytest.raises(StateFileError, match="codec pred-f16 for a int32 section"):
        read_state(path)


# ------------------------------------------------------------------- the file layout
def test_layout_is_as_documented(fuzz_file):
    data, regions = fuzz_file
    names = [r[0] for r in regions]
    assert names[:3] == ["preamble", "header", "section table"]
    assert data[:8] == statefile.MAGIC
    # every byte is in exactly one region: no padding, nothing after the last payload
    covered = sorted((s, e) for _, s, e in regions)
    assert covered[0][0] == 0 and covered[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))


# ---------------------------------------------------------------------- corruption
@settings(deadline=None, max_examples=150)
@given(data=st.data())
def test_every_truncation_is_detected(workdir, fuzz_file, data):
    content, regions = fuzz_file
    region, start, end = data.draw(st.sampled_from(regions))
    cut = data.draw(st.integers(start, end - 1))
    path = workdir / "truncated.pkv"
    write_bytes(path, content[:cut])
    with pytest.raises(StateFileError) as e:
        read_state(path)
    msg = str(e.value)
    assert str(path) in msg
    if cut == 0:
        assert "empty file" in msg
    elif region == "section table" and cut == start:
        assert "truncated in section table" in msg
    else:
        assert f"truncated in {region}" in msg
    if region in ("preamble", "header"):
        with pytest.raises(StateFileError):
            read_header(path)


@settings(deadline=None, max_examples=200)
@given(data=st.data())
def test_every_bit_flip_is_detected(workdir, fuzz_file, data):
    content, regions = fuzz_file
    _region, start, end = data.draw(st.sampled_from(regions))
    pos = data.draw(st.integers(start, end - 1))
    bit = data.draw(st.integers(0, 7))
    corrupt = bytearray(content)
    corrupt[pos] ^= 1 << bit
    path = workdir / "flipped.pkv"
    write_bytes(path, bytes(corrupt))
    with pytest.raises(StateFileError) as e:
        read_state(path)
    assert str(path) in str(e.value)


def test_every_bit_flip_of_a_small_file_is_detected(workdir):
    """Exhaustively: each of the file's bits flipped alone makes read_state fail."""
    header, arrays = sample_state(64)
    path = workdir / "small.pkv"
    write_state(path, header, arrays)
    content = path.read_bytes()
    target = workdir / "small-flipped.pkv"
    for pos in range(len(content)):
        for bit in range(8):
            corrupt = bytearray(content)
            corrupt[pos] ^= 1 << bit
            write_bytes(target, bytes(corrupt))
            with pytest.raises(StateFileError):
                read_state(target)


def test_trailing_bytes_are_refused(workdir, fuzz_file):
    path = workdir / "trailing.pkv"
    write_bytes(path, fuzz_file[0] + b"\0")
    with pytest.raises(StateFileError, match="unexpected bytes after the last section"):
        read_state(path)


def test_read_header_skips_the_payloads(workdir, fuzz_file):
    content, regions = fuzz_file
    _, start, _ = regions[-1]
    corrupt = bytearray(content)
    corrupt[start] ^= 0xFF
    path = workdir / "bad-payload.pkv"
    write_bytes(path, bytes(corrupt))
    assert read_header(path)["model"]["fingerprint"] == "abc123"
    with pytest.raises(StateFileError, match="checksum mismatch in section"):
        read_state(path)


def test_wrong_magic(workdir, fuzz_file):
    path = workdir / "magic.pkv"
    write_bytes(path, b"GGUF" + fuzz_file[0][4:])
    for read in (read_state, read_header):
        with pytest.raises(StateFileError, match="bad magic") as e:
            read(path)
        assert str(path) in str(e.value)


def test_future_version(workdir, fuzz_file):
    data = bytearray(fuzz_file[0])
    struct.pack_into("<I", data, 8, 3)
    struct.pack_into("<I", data, 24, zlib.crc32(bytes(data[:24])))
    path = workdir / "future.pkv"
    write_bytes(path, bytes(data))
    for read in (read_state, read_header):
        with pytest.raises(StateFileError) as e:
            read(path)
        assert str(e.value) == (f"state file {path}: format version 3 is not supported "
                                f"(this build reads 1)")


def test_paths_that_are_not_state_files(workdir):
    missing = workdir / "missing.pkv"
    for path, reason in ((missing, "no such file"), (workdir, "is a directory"),
                         ("/dev/null", "not a regular file")):
        for read in (read_state, read_header):
            with pytest.raises(StateFileError, match=reason) as e:
                read(path)
            assert e.value.path == str(path) and str(path) in str(e.value)
            assert isinstance(e.value, ValueError)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_is_refused_without_blocking(workdir):
    fifo = workdir / "fifo.pkv"
    os.mkfifo(fifo)
    with pytest.raises(StateFileError, match="not a regular file"):
        read_state(fifo)


# ----------------------------------------------------------------------- atomicity
def _listing(d) -> list[str]:
    return sorted(os.listdir(d))


@pytest.mark.parametrize("where", ["codec", "fsync", "replace", "interrupt"])
def test_failed_write_leaves_the_old_file(tmp_path, monkeypatch, where):
    path = tmp_path / "state.pkv"
    _, arrays = sample_state(256)
    write_state(path, {"generation": 1}, arrays)
    before = path.read_bytes()

    class Boom(Exception):
        pass

    if where == "codec":                     # fails on the second section: the first is written
        real, calls = statefile._encode, []

        def encode(*args):
            calls.append(1)
            if len(calls) == 2:
                raise Boom("codec")
            return real(*args)
        monkeypatch.setattr(statefile, "_encode", encode)
    elif where == "fsync":
        monkeypatch.setattr(statefile.os, "fsync", lambda fd: (_ for _ in ()).throw(Boom("fsync")))
    elif where == "replace":
        monkeypatch.setattr(statefile.os, "replace", lambda a, b: (_ for _ in ()).throw(Boom("replace")))
    else:
        def interrupted(*args):              # after the first payload is written
            raise KeyboardInterrupt
        monkeypatch.setattr(statefile, "_table_entry", interrupted)
    expected = KeyboardInterrupt if where == "interrupt" else Boom
    with pytest.raises(expected):
        write_state(path, {"generation": 2}, arrays)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert _listing(tmp_path) == ["state.pkv"]
    assert read_state(path)[0] == {"generation": 1}


def test_failed_first_write_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(statefile.os, "replace", lambda a, b: (_ for _ in ()).throw(OSError("disk")))
    with pytest.raises(OSError, match="disk"):
        write_state(tmp_path / "new.pkv", {}, {"a": np.arange(1000, dtype=np.int32)})
    assert _listing(tmp_path) == []


def test_successful_write_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "state.pkv"
    write_state(path, {"generation": 1}, {"a": np.zeros(10, np.int8)})
    write_state(path, {"generation": 2}, {"b": np.ones(3, np.float32)})
    header, arrays = read_state(path)
    assert header == {"generation": 2} and list(arrays) == ["b"]
    assert _listing(tmp_path) == ["state.pkv"]


def test_writing_onto_a_directory_fails_cleanly(tmp_path):
    target = tmp_path / "dir"
    target.mkdir()
    with pytest.raises(OSError):
        write_state(target, {}, {"a": np.zeros(3, np.int8)})
    assert _listing(tmp_path) == ["dir"] and _listing(target) == []


# ------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("dtype", [np.float64, np.bool_, np.complex64, np.int16, object,
                                   np.dtype([("a", "<f4")]), "U3"])
def test_unsupported_dtype_is_refused(tmp_path, dtype):
    path = tmp_path / "x.pkv"
    arrays = {"fine": np.zeros(3, np.float16), "bad one": np.zeros(3, dtype=dtype)}
    with pytest.raises(ValueError, match="'bad one'") as e:
        write_state(path, {}, arrays)
    assert str(np.dtype(dtype)) in str(e.value)
    assert _listing(tmp_path) == []


@pytest.mark.parametrize("name", [1, b"k.0", None, ("k", 0)])
def test_non_string_name_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match=f"array name {name!r}".replace("(", r"\(").replace(")", r"\)")):
        write_state(tmp_path / "x.pkv", {}, {name: np.zeros(2, np.int8)})
    assert _listing(tmp_path) == []


@pytest.mark.parametrize("name", ["", "x" * 1025, "\ud800"])
def test_bad_name_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match="array name"):
        write_state(tmp_path / "x.pkv", {}, {name: np.zeros(2, np.int8)})


def test_non_array_value_is_refused(tmp_path):
    with pytest.raises(ValueError, match="array 'tokens' is a list"):
        write_state(tmp_path / "x.pkv", {}, {"tokens": [1, 2, 3]})


@pytest.mark.parametrize(("header", "names"), [
    ({"model": {"fingerprint": {1, 2}}}, ["'model'", "'fingerprint'", "set"]),
    ({"scale": float("nan")}, ["'scale'", "nan"]),
    ({"shape": (1, 2)}, ["'shape'", "tuple"]),
    ({"layers": [1, np.int64(2)]}, ["'layers'", "[1]", "int64"]),
    ({"bad": {3: "x"}}, ["'bad'", "key 3"]),
    ({"s": "\udc80"}, ["'s'", "UTF-8"]),
    ([1, 2], ["header must be a dict"]),
])
def test_non_json_header_is_refused(tmp_path, header, names):
    path = tmp_path / "x.pkv"
    write_bytes(path, b"keep")
    with pytest.raises(ValueError) as e:
        write_state(path, header, {"a": np.zeros(2, np.int8)})
    for part in names:
        assert part in str(e.value)
    assert path.read_bytes() == b"keep" and _listing(tmp_path) == ["x.pkv"]


@pytest.mark.parametrize(("rotary", "match"), [
    ({"nope": Rotary([0], [1.0], [[0, 1]])}, "'nope', which is not one of the arrays"),
    ({"a": (np.arange(2), [1.0], [[0, 1]])}, "rotary\\['a'\\] is a tuple"),
    ([1], "rotary must be a mapping"),
])
def test_bad_rotary_is_refused(tmp_path, rotary, match):
    with pytest.raises(ValueError, match=match):
        write_state(tmp_path / "x.pkv", {}, {"a": np.zeros((2, 2), np.float16)}, rotary=rotary)
    assert _listing(tmp_path) == []


@pytest.mark.parametrize("level", [-1, 23, 1.5, True, "3"])
def test_bad_level_is_refused(tmp_path, level):
    with pytest.raises(ValueError, match="level"):
        write_state(tmp_path / "x.pkv", {}, {}, level=level)


# ------------------------------------------------------------- termination, stale temporaries
_TERM_CHILD = r"""
import sys, threading, time
import numpy as np
from pyimp.kv import statefile
real = statefile._encode
first = threading.Lock()       # arrays are encoded on several threads: announce only once
def encode(*args):
    if first.acquire(blocking=False):
        print("encoding", flush=True)      # the temporary file exists now
    time.sleep(0.5)
    return real(*args)
statefile._encode = encode
statefile.write_state(sys.argv[1], {"generation": 2},
                      {"a": np.arange(4096, dtype=np.int32), "b": np.ones(4096, np.float32)})
print("finished", flush=True)
"""


@pytest.mark.parametrize("existing", [False, True])
def test_sigterm_during_a_write_removes_the_temporary(tmp_path, existing):
    """SIGTERM while a state is written: the temporary file is removed, a file already at the
    path is left as it was, and the process still ends by SIGTERM, without a traceback."""
    import signal
    import subprocess
    import sys
    path = tmp_path / "state.pkv"
    if existing:
        write_state(path, {"generation": 1}, {"a": np.zeros(3, np.int8)})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = subprocess.Popen([sys.executable, "-c", _TERM_CHILD, str(path)], cwd=root,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "encoding\n"
        assert any(n.endswith(".tmp") for n in os.listdir(tmp_path))
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGTERM, (out, err)
    assert "finished" not in out and "Traceback" not in err, err
    assert _listing(tmp_path) == (["state.pkv"] if existing else [])
    if existing:
        assert read_state(path)[0] == {"generation": 1}


def test_the_sigterm_handler_is_installed_only_while_writing(tmp_path, monkeypatch):
    import signal
    seen = []
    real = statefile._encode

    def encode(*args):
        seen.append(signal.getsignal(signal.SIGTERM))
        return real(*args)
    monkeypatch.setattr(statefile, "_workers", lambda: 1)      # encode on this thread
    monkeypatch.setattr(statefile, "_encode", encode)
    prev = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        write_state(tmp_path / "s.pkv", {}, {"a": np.zeros(3, np.int8)})
        assert seen and callable(seen[0]) and seen[0] not in (signal.SIG_DFL, signal.SIG_IGN)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        # a process's own handling of SIGTERM (here: ignoring it) is left alone
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        seen.clear()
        write_state(tmp_path / "s.pkv", {}, {"a": np.zeros(3, np.int8)})
        assert seen == [signal.SIG_IGN] and signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, prev)


def test_stale_temporaries_are_removed_and_live_ones_kept(tmp_path, monkeypatch):
    """Writing ``state.pkv`` removes the temporaries of earlier writes of it that no process
    holds (the writer holds a lock on its temporary) and that are older than STALE_TMP_S;
    a locked one, a fresh one and other names stay."""
    import fcntl
    import time
    old = time.time() - 3600
    names = {"stale": ".state.pkv.0123456789ab.tmp", "locked": ".state.pkv.aaaaaaaaaaaa.tmp",
             "fresh": ".state.pkv.bbbbbbbbbbbb.tmp", "other": ".other.pkv.0123456789ab.tmp",
             "odd": ".state.pkv.notahexname1.tmp"}
    for key, name in names.items():
        (tmp_path / name).write_bytes(b"partial")
        if key != "fresh":
            os.utime(tmp_path / name, (old, old))
    held = os.open(tmp_path / names["locked"], os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    locked_seen = []
    real = statefile._encode

    def encode(*args):               # the writer's own temporary is locked while it writes
        mine = [n for n in os.listdir(tmp_path) if n.endswith(".tmp") and n not in names.values()]
        fd = os.open(tmp_path / mine[0], os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked_seen.append(False)
        except BlockingIOError:
            locked_seen.append(True)
        finally:
            os.close(fd)
        return real(*args)
    monkeypatch.setattr(statefile, "_encode", encode)
    try:
        write_state(tmp_path / "state.pkv", {}, {"a": np.zeros(3, np.int8)})
    finally:
        os.close(held)
    assert locked_seen and all(locked_seen)
    left = set(_listing(tmp_path))
    assert left == {"state.pkv"} | {n for k, n in names.items() if k != "stale"}
    assert statefile.STALE_TMP_S <= 600
