"""loaders.gguf_writer: the same bytes as gguf's GGUFWriter for the same metadata and tensors,
synthetic models that gguf's GGUFReader and loaders.gguf_file read alike, and one clear error
(the file and the key or tensor named) for what cannot be written."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from loaders.ggml_types import QT, GGUFValueType, row_bytes
from loaders.gguf_file import GGUFFile
from loaders.gguf_writer import GGUFWriter
from tools.write_synthetic_gguf import SynthSpec, write

VT = GGUFValueType

# (key, value, value type, array element type)
_SCALARS = [("u8", 200, VT.UINT8), ("i8", -100, VT.INT8), ("u16", 60000, VT.UINT16),
            ("i16", -30000, VT.INT16), ("u32", 4_000_000_000, VT.UINT32),
            ("i32", -2_000_000_000, VT.INT32), ("f32", 0.1, VT.FLOAT32), ("b", True, VT.BOOL),
            ("u64", 2 ** 63 + 5, VT.UINT64), ("i64", -2 ** 62, VT.INT64),
            ("f64", 1 / 3, VT.FLOAT64), ("s", "näive ☃", VT.STRING)]
_ARRAYS = [("a.u8", [0, 255, 7], VT.UINT8), ("a.i32", [-1, 2, 2 ** 31 - 1], VT.INT32),
           ("a.f32", [0.5, -1e-3, 3.25e7], VT.FLOAT32), ("a.bool", [True, False, True], VT.BOOL),
           ("a.u64", [2 ** 64 - 1, 0], VT.UINT64), ("a.f64", [1e300, -0.0], VT.FLOAT64),
           ("a.str", ["", "ab", "<0x0A>", "\u2581x"], VT.STRING)]


def _tensors():
    """(name, data, type) of every way add_tensor takes data; sizes that need padding."""
    rng = np.random.default_rng(0)
    q8 = rng.integers(0, 256, (3, row_bytes(QT.Q8_0, 64)), dtype=np.uint8)
    q4k = rng.integers(0, 256, (2, 2, row_bytes(QT.Q4_K, 256)), dtype=np.uint8)
    return [("vec", rng.standard_normal(7).astype(np.float32), QT.F32),
            ("half", rng.standard_normal((3, 5)).astype(np.float16), QT.F16),
            ("bf16", rng.integers(0, 1 << 16, (2, 3), dtype=np.uint16), QT.BF16),
            ("f32_bytes", rng.standard_normal((2, 3)).astype(np.float32).view(np.uint8), QT.F32),
            ("q8", q8, QT.Q8_0), ("q4k", q4k, QT.Q4_K),
            ("four_d", rng.standard_normal((1, 2, 1, 3)).astype(np.float32), QT.F32)]


def test_bytes_equal_gguf_writer(tmp_path):
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    g = gguf.GGUFWriter(str(theirs), "llama")         # writes general.architecture first
    w = GGUFWriter(ours)
    w.add_string("general.architecture", "llama")
    for key, val, vt in _SCALARS:
        g.add_key_value(key, val, gguf.GGUFValueType(vt))
        w.add(key, val, vt)
    for key, vals, et in _ARRAYS:
        g.add_key_value(key, vals, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType(et))
        w.add_array(key, vals, et)
    for name, data, qt in _tensors():
        g.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType(qt))
        w.add_tensor(name, data, qt)
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    assert w.write() == str(ours)
    a, b = ours.read_bytes(), theirs.read_bytes()
    assert len(a) == len(b) and a == b


def test_both_readers_read_what_was_written(tmp_path):
    w = GGUFWriter(tmp_path / "m.gguf")
    for key, val, vt in _SCALARS:
        w.add(key, val, vt)
    for key, vals, et in _ARRAYS:
        w.add_array(key, vals, et)
    for name, data, qt in _tensors():
        w.add_tensor(name, data, qt)
    path = w.write()
    ref = gguf.GGUFReader(path)
    with GGUFFile(path) as f:
        for key, val, vt in _SCALARS + _ARRAYS:
            want_types = [VT.ARRAY, vt] if isinstance(val, list) else [vt]
            assert ref.fields[key].types == want_types, key
            got = ref.fields[key].contents()
            if vt == VT.FLOAT32:                 # written as float32: equal after rounding
                assert np.array_equal(np.float32(got), np.float32(val)), key
            else:
                assert got == val, key
            mine = f.metadata[key]
            assert (list(mine) if isinstance(val, list) else mine) == got, key
        for name, data, qt in _tensors():
            t = next(t for t in ref.tensors if t.name == name)
            assert t.tensor_type == qt
            raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
            assert np.array_equal(np.asarray(t.data).view(np.uint8).reshape(-1), raw), name
            assert np.array_equal(f.tensor(name).raw.reshape(-1), raw), name
            # the values' shape in NumPy order (bytes: the last axis counted in elements)
            bs, ts = gguf.GGML_QUANT_SIZES[qt]
            want = data.shape if data.dtype != np.uint8 else (*data.shape[:-1],
                                                              data.shape[-1] // ts * bs)
            assert tuple(int(d) for d in reversed(t.shape)) == want, name
            assert f.tensor(name).shape == tuple(reversed(want)), name


def test_synthetic_model_read_by_gguf_reader(tmp_path):
    """write_synthetic_gguf's file: gguf.GGUFReader finds the metadata it was given (types
    included) and every tensor's bytes where loaders.gguf_file finds them."""
    path = write(tmp_path / "g.gguf", SynthSpec(
        arch="gemma3", n_layer=2, n_embd=64, n_head=4, n_head_kv=1, head_dim=32, n_ff=64,
        vocab_size=300, weight_type="Q8_0", embd_type="Q4_0", sliding_window=8, swa_pattern=2,
        final_softcap=30.0, rope_scale=2.0))
    ref = gguf.GGUFReader(path)
    want = {"general.architecture": ("gemma3", VT.STRING), "general.name": ("synthetic gemma3", VT.STRING),
            "gemma3.block_count": (2, VT.UINT32), "gemma3.attention.head_count_kv": (1, VT.UINT32),
            "gemma3.attention.key_length": (32, VT.UINT32),
            "gemma3.attention.sliding_window": (8, VT.UINT32),
            "gemma3.attention.sliding_window_pattern": (2, VT.UINT32),
            "gemma3.final_logit_softcapping": (30.0, VT.FLOAT32),
            "gemma3.rope.scaling.type": ("linear", VT.STRING),
            "gemma3.rope.scaling.factor": (2.0, VT.FLOAT32),
            "general.file_type": (7, VT.UINT32), "tokenizer.ggml.model": ("llama", VT.STRING),
            "tokenizer.ggml.bos_token_id": (1, VT.UINT32)}
    for key, (val, vt) in want.items():
        assert ref.fields[key].types[0] == vt and ref.fields[key].contents() == val, key
    toks = ref.fields["tokenizer.ggml.tokens"]
    assert toks.types == [VT.ARRAY, VT.STRING] and len(toks.contents()) == 300
    assert ref.fields["tokenizer.ggml.token_type"].types == [VT.ARRAY, VT.INT32]
    assert ref.fields["tokenizer.ggml.scores"].types == [VT.ARRAY, VT.FLOAT32]
    with GGUFFile(path) as f:
        assert len(ref.tensors) == len(f.tensors) == 2 + 2 * 13     # embeddings, norm; 13 a layer
        for t in ref.tensors:
            mine = f.tensor(t.name)
            assert mine.qtype == t.tensor_type and mine.shape == tuple(int(x) for x in t.shape)
            assert np.array_equal(mine.raw.reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))
        assert f.tensor("token_embd.weight").qtype == QT.Q4_0
        assert f.tensor("blk.0.attn_q.weight").qtype == QT.Q8_0


def test_big_endian_values_written_little_endian(tmp_path):
    x = np.arange(1, 6, dtype=np.float32)
    a, b = GGUFWriter(tmp_path / "a.gguf"), GGUFWriter(tmp_path / "b.gguf")
    a.add_tensor("x", x)
    b.add_tensor("x", x.astype(">f4"), QT.F32)
    a.write()
    b.write()
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    with GGUFFile(tmp_path / "b.gguf") as f:
        assert np.array_equal(f.tensor("x").raw.view("<f4").reshape(-1), x)


@pytest.mark.parametrize("add, what", [
    (lambda w: (w.add_uint32("k", 1), w.add_uint32("k", 2)), "metadata key 'k' added twice"),
    (lambda w: w.add_uint32("k", 2 ** 32), "metadata key 'k': 4294967296 does not fit UINT32"),
    (lambda w: w.add_uint32("k", -1), "metadata key 'k': -1 does not fit UINT32"),
    (lambda w: w.add_uint32("k", 1.5), "metadata key 'k': 1.5 is not an integer"),
    (lambda w: w.add_uint32("k", True), "metadata key 'k': True is not an integer"),
    (lambda w: w.add_bool("k", 1), "metadata key 'k': 1 is not a bool"),
    (lambda w: w.add_string("k", 5), "metadata key 'k': 5 is not a string"),
    (lambda w: w.add("k", [1], VT.ARRAY), "metadata key 'k': arrays go through add_array"),
    (lambda w: w.add_array("k", [[1]], VT.ARRAY), "metadata key 'k': arrays of arrays"),
    (lambda w: w.add_array("k", ["a", 1], VT.STRING), "metadata key 'k': 1 is not a string"),
    (lambda w: w.add_array("k", [1, 300], VT.UINT8), "metadata key 'k': values 1..300 do not fit UINT8"),
    (lambda w: w.add_array("k", [1.5], VT.INT32), "metadata key 'k': INT32 array holds 1.5"),
    (lambda w: w.add_array("k", [[1, 2]], VT.INT32), "metadata key 'k': INT32 array holds [1, 2]"),
    (lambda w: w.add_array("k", np.zeros((1, 2), np.int32), VT.INT32),
     "metadata key 'k': array values must be one-dimensional"),
    (lambda w: w.add_array("k", np.zeros(2), VT.INT32), "metadata key 'k': INT32 array given as float64"),
    (lambda w: w.add_array("k", np.array([1, 300]), VT.UINT8), "metadata key 'k': values 1..300 do not fit"),
    (lambda w: w.add_tensor("t", np.zeros((2, 33), np.uint8), QT.Q8_0),
     "tensor 't': rows of 33 bytes are not whole Q8_0 blocks of 34 bytes"),
    (lambda w: w.add_tensor("t", np.zeros(4, np.float64)), "tensor 't': give the ggml type of float64"),
    (lambda w: w.add_tensor("t", np.zeros(4, np.float16), QT.F32),
     "tensor 't': F32 data given as float16; expected uint8 bytes or float32"),
    (lambda w: w.add_tensor("t", np.zeros((1,) * 5, np.float32)), "tensor 't': shape [1, 1, 1, 1, 1]"),
    (lambda w: w.add_tensor("t", np.zeros(0, np.float32)), "tensor 't': shape [0]"),
    (lambda w: w.add_tensor("t", np.zeros(4, np.uint8), 77), "tensor 't': unknown ggml type type#77"),
    (lambda w: (w.add_tensor("t", np.zeros(4, np.float32)), w.add_tensor("t", np.zeros(4, np.float32))),
     "tensor 't' added twice"),
])
def test_bad_input_names_file_and_key(tmp_path, add, what):
    w = GGUFWriter(tmp_path / "bad.gguf")
    with pytest.raises(ValueError) as e:
        add(w)
    assert str(e.value).startswith(f"{tmp_path / 'bad.gguf'}: {what}"), str(e.value)
    assert not (tmp_path / "bad.gguf").exists()
