"""GGUF reader and ModelConfig: real file, synthetic files, and fuzzed broken files.

Broken files must end in a GGUFError whose message names the file (and, for the
targeted corruptions, the offending key or tensor); a mutated file that still
parses must give tensor views that lie inside the file's tensor data.
"""
from __future__ import annotations

import os
import re
import struct

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loaders.config import read_config
from loaders.ggml_types import SUPPORTED_TYPES
from loaders.gguf_file import GGUFError, GGUFFile, read_vocab
from tools.write_synthetic_gguf import SynthSpec, write


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    p = tmp_path_factory.mktemp("gguf") / "tiny_llama.gguf"
    return write(p, SynthSpec(arch="llama", n_layer=2, n_embd=32, n_head=4, n_head_kv=2, n_ff=64,
                              vocab_size=300, weight_type="Q8_0", rope_freqs=True, rope_scale=2.0,
                              tied_output=False, biases=True))


@pytest.fixture(scope="session")
def tiny_gemma(tmp_path_factory) -> str:
    p = tmp_path_factory.mktemp("gguf") / "tiny_gemma.gguf"
    return write(p, SynthSpec(arch="gemma3", n_layer=7, n_embd=32, n_head=4, n_head_kv=1, head_dim=16,
                              n_ff=64, vocab_size=300, weight_type="F16", sliding_window=8,
                              rope_base=1e6, rope_base_swa=1e4, final_softcap=30.0, rms_eps=1e-6))


def test_real_gemma_config(gemma_path):
    f = GGUFFile(gemma_path)
    cfg = read_config(f)
    assert (cfg.arch, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head_kv) == ("gemma3", 18, 640, 4, 1)
    assert (cfg.head_dim, cfg.head_dim_v, cfg.n_ff, cfg.n_vocab, cfg.n_ctx_train) == (256, 256, 2048, 262144, 32768)
    assert cfg.sliding_window == 512 and cfg.rope_base == 1e6 and cfg.rope_base_swa == 10000.0
    assert [il for il in range(18) if not cfg.is_swa(il)] == [5, 11, 17]
    assert cfg.tied_output and cfg.final_softcap == 0.0 and not cfg.has_rope_freqs
    assert cfg.rms_eps == pytest.approx(1e-6) and cfg.bos_id == 2 and cfg.eos_id == 1
    assert len(f.tensors) == 236
    t = f.tensor("token_embd.weight", (640, 262144))
    assert t.qtype == gguf.GGMLQuantizationType.Q8_0 and t.raw.shape == (262144, 680)
    # zero-copy: the view is backed by the map, not a copy
    assert not t.raw.flags.owndata and not t.raw.flags.writeable


def test_real_gemma_tensors_match_gguf_reader(gemma_path):
    """Every tensor's bytes, type and shape equal what gguf.GGUFReader reads."""
    ours = GGUFFile(gemma_path)
    ref = gguf.GGUFReader(gemma_path)
    assert len(ref.tensors) == len(ours.tensors)
    for t in ref.tensors:
        mine = ours.tensor(t.name)
        assert mine.qtype == t.tensor_type
        assert mine.shape == tuple(int(x) for x in t.shape)
        assert np.array_equal(mine.raw.reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1)), t.name
    for key in ("gemma3.attention.sliding_window", "tokenizer.ggml.model", "general.name"):
        assert ours.metadata[key] == ref.fields[key].contents()


def test_real_gemma_vocab(gemma_path):
    v = read_vocab(gemma_path)
    assert v.n_vocab == 262144 and v.model == "llama"
    assert v.tokens[2] == "<bos>" and v.special["bos"] == 2 and v.special["unk"] == 3
    assert v.scores.dtype == np.float32 and v.token_types.shape == (262144,)
    assert v.flags["add_bos_token"] is True and v.flags["add_space_prefix"] is False


def test_synthetic_llama_config(tiny_llama):
    cfg = read_config(GGUFFile(tiny_llama))
    assert (cfg.arch, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim) == ("llama", 2, 32, 4, 2, 8)
    assert cfg.n_gqa == 2 and cfg.n_ff == 64 and cfg.n_vocab == 300
    assert cfg.has_rope_freqs and cfg.rope_scale == 0.5 and not cfg.tied_output
    assert cfg.sliding_window == 0 and not any(cfg.swa_layers) and cfg.final_softcap == 0.0


def test_synthetic_gemma3_config(tiny_gemma):
    cfg = read_config(GGUFFile(tiny_gemma))
    assert (cfg.arch, cfg.n_layer, cfg.head_dim, cfg.n_head_kv) == ("gemma3", 7, 16, 1)
    assert cfg.sliding_window == 8 and cfg.swa_layers == (True,) * 5 + (False, True)
    assert cfg.rope_base == 1e6 and cfg.rope_base_swa == 1e4 and cfg.final_softcap == 30.0
    assert cfg.layer_rope_base(5) == 1e6 and cfg.layer_rope_base(0) == 1e4
    assert cfg.tied_output and cfg.rms_eps == pytest.approx(1e-6)


# ----------------------------------------------------------------- errors

def _expect(path, needle: str, fn=lambda p: read_config(GGUFFile(p))):
    with pytest.raises(GGUFError) as ei:
        fn(path)
    msg = str(ei.value)
    assert os.fspath(path) in msg and needle in msg, msg


def test_not_a_gguf(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("hello, this is not a model")
    _expect(p, "not a GGUF file")
    (tmp_path / "empty.gguf").write_bytes(b"")
    _expect(tmp_path / "empty.gguf", "not a GGUF file")
    _expect(tmp_path / "missing.gguf", "no such file")
    _expect(tmp_path, "directory")


def test_unsupported_version(tiny_llama, tmp_path):
    data = bytearray(open(tiny_llama, "rb").read())
    data[4:8] = struct.pack("<I", 7)
    p = tmp_path / "v7.gguf"
    p.write_bytes(bytes(data))
    _expect(p, "unsupported GGUF version 7")


def _writer(path, arch="llama"):
    w = gguf.GGUFWriter(os.fspath(path), arch)
    return w


def _finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_architecture(tmp_path):
    p = tmp_path / "bert.gguf"
    w = _writer(p, "bert")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    _finish(w)
    _expect(p, "unsupported architecture 'bert'")


def test_unsupported_tensor_type_missing_tensor_and_shape(tiny_llama, tmp_path):
    f = GGUFFile(tiny_llama)
    _expect(tiny_llama, "tensor 'blk.9.attn_q.weight' is missing", lambda p: f.tensor("blk.9.attn_q.weight"))
    _expect(tiny_llama, "expected [32, 99]", lambda p: f.tensor("blk.0.attn_q.weight", (32, 99)))
    p = tmp_path / "iq.gguf"
    w = _writer(p)
    w.add_tensor("w", np.zeros((2, 18), np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    _finish(w)
    _expect(p, "unsupported type IQ4_NL", lambda q: GGUFFile(q).tensor("w"))


def test_missing_metadata_key(tmp_path):
    p = tmp_path / "nokey.gguf"
    w = _writer(p)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    _finish(w)
    _expect(p, "'llama.block_count' is missing")


def _tensor_ends(path) -> int:
    f = GGUFFile(path)
    return max(t.offset + t.nbytes for t in f.tensors.values())


def _full_load(path) -> None:
    """Everything a model load reads from the file, shape checks included."""
    from pyimp.model import ModelWeights

    f = GGUFFile(path)
    ModelWeights(f, read_config(f))
    f.vocab()
    for name in f.tensors:
        f.tensor(name)


def _assert_views_inside(path) -> None:
    """A file that parses: every tensor's bytes lie in the data section, aligned, sized by
    its shape and type, disjoint from the others, and its view points into the map there."""
    f = GGUFFile(path)
    size = f.file_size()
    align = f.metadata.get("general.alignment", 32)
    base = f._bytes.__array_interface__["data"][0]
    spans = []
    for t in f.tensors.values():
        bs, ts = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.qtype)]
        assert t.nbytes == int(np.prod(t.shape, dtype=object)) // bs * ts, t.name
        assert f.data_start <= t.offset and t.offset + t.nbytes <= size, t.name
        assert (t.offset - f.data_start) % align == 0, t.name
        spans.append((t.offset, t.offset + t.nbytes))
        if t.qtype in SUPPORTED_TYPES:
            raw = f.tensor(t.name).raw
            at = raw.__array_interface__["data"][0] - base
            assert (at, raw.nbytes) == (t.offset, t.nbytes), t.name
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def _load_or_named_error(path) -> GGUFError | None:
    """Outcome of a full load of a mutated file: None when it loads (then its views are
    checked), else the GGUFError, which must name the file. Any other exception fails."""
    try:
        _full_load(path)
    except GGUFError as e:
        assert e.path == os.fspath(path) and str(e).startswith(os.fspath(path) + ": "), str(e)
        assert e.what.strip(), str(e)
        return e
    _assert_views_inside(path)
    return None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frac=st.floats(0.0, 1.0, exclude_max=True))
def test_fuzz_truncated(tiny_llama, tmp_path, frac):
    data = open(tiny_llama, "rb").read()
    f = GGUFFile(tiny_llama)
    cut = int(frac * _tensor_ends(tiny_llama))
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:cut])
    e = _load_or_named_error(p)
    assert e is not None, f"a file cut at byte {cut} loaded"
    if cut < 4:
        assert "not a GGUF file" in e.what
    elif cut < f.data_start:
        assert "truncated file" in e.what, e.what  # the header or tensor table is cut
    else:
        # the data section is cut: the error names a tensor whose data does not fit
        m = re.search(r"tensor '([^']+)' data ends at byte (\d+)", e.what)
        assert m, e.what
        t = f.tensors[m.group(1)]
        assert int(m.group(2)) == t.offset + t.nbytes > cut


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_flipped_header_bytes(tiny_llama, tmp_path, data):
    raw = bytearray(open(tiny_llama, "rb").read())
    header_end = GGUFFile(tiny_llama).data_start
    n = data.draw(st.integers(1, 4))
    for _ in range(n):
        i = data.draw(st.integers(0, header_end - 1))
        raw[i] ^= data.draw(st.integers(1, 255))
    p = tmp_path / "flip.gguf"
    p.write_bytes(bytes(raw))
    # a flip in a harmless place (a string's text) may still load; then the views are sound
    e = _load_or_named_error(p)
    if e is not None and raw[:4] != b"GGUF":
        assert "not a GGUF file" in e.what


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(type_id=st.integers(0, 2**32 - 1), dim=st.integers(0, 2**64 - 1), which=st.sampled_from(["type", "dim"]))
def test_fuzz_bad_type_ids_and_dims(tiny_llama, tmp_path, type_id, dim, which):
    """Overwrite the first tensor info's type id or first dimension."""
    raw = bytearray(open(tiny_llama, "rb").read())
    f = GGUFFile(tiny_llama)
    first = next(iter(f.tensors.values()))
    # locate the first tensor info: its name string follows the metadata
    needle = struct.pack("<Q", len(first.name)) + first.name.encode()
    at = raw.index(needle) + len(needle)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    if which == "type":
        struct.pack_into("<I", raw, at + 4 + 8 * n_dims, type_id)
    else:
        struct.pack_into("<Q", raw, at + 4, dim)
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(raw))
    e = _load_or_named_error(p)
    if which == "dim" and dim != first.shape[0] or which == "type" and type_id not in SUPPORTED_TYPES:
        assert e is not None
        # the changed tensor, or (data size changed) one it now overlaps or pushes out
        assert "tensor '" in e.what, e.what
        if which == "type" and type_id not in {int(t) for t in gguf.GGML_QUANT_SIZES}:
            assert f"tensor {first.name!r}: unknown ggml type id {type_id}" in e.what
    # else: another supported type; its data size changes, which either breaks the layout
    # (overlap / truncation: a named GGUFError) or reinterprets the bytes (views checked)


# ----------------------------------------------------------------- targeted corruptions
#
# Files built byte by byte, so that each breaks exactly one rule of the format.

def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + payload


def _kv_u32(key: str, v: int) -> bytes:
    return _kv(key, int(gguf.GGUFValueType.UINT32), struct.pack("<I", v))


def _kv_str(key: str, v: str | bytes) -> bytes:
    return _kv(key, int(gguf.GGUFValueType.STRING), _str(v))


def _tinfo(name: str, shape, qtype: int, offset: int, n_dims: int | None = None) -> bytes:
    n_dims = len(shape) if n_dims is None else n_dims
    return (_str(name) + struct.pack("<I", n_dims) + b"".join(struct.pack("<Q", d) for d in shape)
            + struct.pack("<I", qtype) + struct.pack("<Q", offset))


def _gguf(path, kvs=(), tinfos=(), data=b"", align=32, n_kv=None, n_tensors=None) -> str:
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tinfos) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tinfos)
    body += b"\0" * (-len(body) % align)
    path.write_bytes(body + data)
    return os.fspath(path)


F32 = int(gguf.GGMLQuantizationType.F32)
Q8_0 = int(gguf.GGMLQuantizationType.Q8_0)
ARCH = _kv_str("general.architecture", "llama")


def _open_error(path) -> str:
    with pytest.raises(GGUFError) as ei:
        GGUFFile(path)
    assert ei.value.path == os.fspath(path)
    return str(ei.value)


def test_well_formed_handmade_file_parses(tmp_path):
    # the builder itself is right: the same layout without a defect opens, with sound views
    p = _gguf(tmp_path / "ok.gguf", [ARCH], [_tinfo("a", (8,), F32, 0), _tinfo("b", (4, 2), F32, 32)],
              data=bytes(64))
    f = GGUFFile(p)
    assert f.metadata["general.architecture"] == "llama"
    assert (f.tensors["a"].nbytes, f.tensors["b"].shape) == (32, (4, 2))
    _assert_views_inside(p)


@pytest.mark.parametrize("case, needles", [
    ("duplicate_key", ["metadata key 'general.architecture' appears twice"]),
    ("unknown_value_type", ["metadata key 'general.name'", "unknown value type 99"]),
    ("bad_utf8_value", ["metadata key 'general.name'", "invalid UTF-8"]),
    ("string_past_end", ["truncated file", "metadata key 'general.name'"]),
    ("huge_array", ["truncated file", "metadata key 'tokenizer.ggml.scores'"]),
    ("nested_array", ["metadata key 'x'", "arrays of ARRAY are not supported"]),
    ("alignment_not_pow2", ["metadata key 'general.alignment'", "power of two"]),
    ("absurd_counts", ["truncated file", "header claims"]),
    ("zero_dims", ["tensor 'w'", "0 dimensions"]),
    ("five_dims", ["tensor 'w'", "5 dimensions"]),
    ("unknown_type", ["tensor 'w'", "unknown ggml type id 1000"]),
    ("row_not_block_multiple", ["tensor 'w'", "Q8_0", "block size 32"]),
    ("zero_dim", ["tensor 'w'", "shape [0, 2] is invalid"]),
    ("unaligned_offset", ["tensor 'w'", "offset 4 is not aligned to 32"]),
    ("data_past_end", ["tensor 'w'", "data ends at byte"]),
    ("overlap", ["tensor 'b'", "overlaps tensor 'a'"]),
    ("duplicate_tensor", ["tensor 'w' appears twice"]),
])
def test_targeted_corruption_names_key_or_tensor(tmp_path, case, needles):
    p = tmp_path / f"{case}.gguf"
    arr = int(gguf.GGUFValueType.ARRAY)
    u32 = int(gguf.GGUFValueType.UINT32)
    ok_tensor = [_tinfo("w", (8,), F32, 0)]
    build = {
        "duplicate_key": lambda: _gguf(p, [ARCH, ARCH]),
        "unknown_value_type": lambda: _gguf(p, [ARCH, _kv("general.name", 99, b"")]),
        "bad_utf8_value": lambda: _gguf(p, [ARCH, _kv_str("general.name", b"ab\xff\xfe")]),
        "string_past_end": lambda: _gguf(p, [ARCH, _kv("general.name", int(gguf.GGUFValueType.STRING),
                                                       struct.pack("<Q", 10**6) + b"abc")]),
        "huge_array": lambda: _gguf(p, [ARCH, _kv("tokenizer.ggml.scores", arr,
                                                  struct.pack("<IQ", int(gguf.GGUFValueType.FLOAT32), 2**40))]),
        "nested_array": lambda: _gguf(p, [_kv("x", arr, struct.pack("<IQ", arr, 1) + struct.pack("<IQ", u32, 0))]),
        "alignment_not_pow2": lambda: _gguf(p, [ARCH, _kv_u32("general.alignment", 24)]),
        "absurd_counts": lambda: _gguf(p, [ARCH], n_kv=2**40),
        "zero_dims": lambda: _gguf(p, [ARCH], [_tinfo("w", (), F32, 0, n_dims=0)], bytes(32)),
        "five_dims": lambda: _gguf(p, [ARCH], [_tinfo("w", (1,) * 5, F32, 0)], bytes(32)),
        "unknown_type": lambda: _gguf(p, [ARCH], [_tinfo("w", (8,), 1000, 0)], bytes(32)),
        "row_not_block_multiple": lambda: _gguf(p, [ARCH], [_tinfo("w", (48, 2), Q8_0, 0)], bytes(128)),
        "zero_dim": lambda: _gguf(p, [ARCH], [_tinfo("w", (0, 2), F32, 0)], bytes(32)),
        "unaligned_offset": lambda: _gguf(p, [ARCH], [_tinfo("w", (8,), F32, 4)], bytes(64)),
        "data_past_end": lambda: _gguf(p, [ARCH], ok_tensor, bytes(31)),
        "overlap": lambda: _gguf(p, [ARCH], [_tinfo("a", (16,), F32, 0), _tinfo("b", (8,), F32, 32)],
                                 bytes(96)),
        "duplicate_tensor": lambda: _gguf(p, [ARCH], ok_tensor * 2, bytes(32)),
    }
    msg = _open_error(build[case]())
    for needle in needles:
        assert needle in msg, msg


def _flip_byte(src, dst, at: int) -> str:
    data = bytearray(open(src, "rb").read())
    data[at] ^= 0x01
    with open(dst, "wb") as f:
        f.write(data)
    return str(dst)


def test_fingerprint_covers_every_weight_byte(tiny_llama, tmp_path):
    """Two files that differ in one weight byte (here a quarter into the largest tensor, away
    from its start, middle and end) have different fingerprints; a copy under another name
    has the same one."""
    with GGUFFile(tiny_llama) as f:
        fp = f.fingerprint()
        t = max(f.tensors.values(), key=lambda t: t.nbytes)
        assert t.nbytes >= 1024
        at = t.offset + t.nbytes // 4
    assert fp == GGUFFile(tiny_llama).fingerprint()                       # deterministic
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(open(tiny_llama, "rb").read())
    assert GGUFFile(str(copy)).fingerprint() == fp
    other = _flip_byte(tiny_llama, tmp_path / "other.gguf", at)
    with GGUFFile(other) as g:
        assert g.tensors[t.name].offset == t.offset
        assert g.fingerprint() != fp
