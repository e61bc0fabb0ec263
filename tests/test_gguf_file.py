"""GGUF reader and ModelConfig: real file, synthetic files, and fuzzed broken files."""
from __future__ import annotations

import os
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


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frac=st.floats(0.0, 1.0, exclude_max=True))
def test_fuzz_truncated(tiny_llama, tmp_path, frac):
    data = open(tiny_llama, "rb").read()
    cut = int(frac * _tensor_ends(tiny_llama))
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:cut])
    with pytest.raises(GGUFError):
        _full_load(p)


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
    try:
        _full_load(p)  # a flip in a harmless place (a string's text) may still load
    except GGUFError:
        pass


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
    if which == "dim" and dim != first.shape[0] or which == "type" and type_id not in SUPPORTED_TYPES:
        with pytest.raises(GGUFError):
            _full_load(p)
    else:
        # another supported type: its data size changes, which either breaks the layout
        # (overlap / truncation: GGUFError) or reinterprets the bytes; nothing else may happen
        try:
            _full_load(p)
        except GGUFError:
            pass
