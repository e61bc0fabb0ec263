"""Saved engine state (prompt-cache files): exact reload, prefix reuse, refusals that leave the
engine untouched, the CLI's --prompt-cache, version-2 files, and the codec the float KV
sections get."""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyimp
from conftest import count_sparse_steps
from pyimp.cli.run import main
from pyimp.kv import state as state_mod
from pyimp.kv.statefile import StateFileError, read_state, write_state
from tools.write_synthetic_gguf import SynthSpec, write
from tools.write_synthetic_gguf import prompt_ids as _ids


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write(tmp_path_factory.mktemp("state") / "m.gguf",
                 SynthSpec(arch="llama", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=256,
                           vocab_size=300, seed=21))


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    return write(tmp_path_factory.mktemp("state2") / "o.gguf",
                 SynthSpec(arch="llama", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=256,
                           vocab_size=300, seed=22))



def _greedy(eng, first_logits, n):
    rows = [first_logits]
    for _ in range(n):
        rows.append(eng.eval([int(np.argmax(rows[-1]))])[-1])
    return np.array(rows[1:])


CONFIGS = [dict(kv_type="f16"),
           dict(cache_type_k="q8_0", cache_type_v="q4_1", v_layout="channel"),
           dict(cache_type_k="q5_0", cache_type_v="f32", sparse=True, topk=1, anchor="dynamic"),
           dict(kv_type="q4_0", kv_rotate=True, sparse=True, topk=2, anchor="quest",
                retrieval="qhead")]


@pytest.mark.parametrize("opts", CONFIGS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_reloaded_state_gives_bit_identical_logits(model, tmp_path, opts):
    ids = _ids(90)                       # 90 = 2 full blocks of 32 and a partial (float) tail
    a = pyimp.load(model, n_ctx=256, block_len=32, batch_size=32, **opts)
    # sparse configurations: the block-sparse kernels on every decode step, never the dense
    # fallback (a selection of every block), so the reload is checked on the sparse path
    ran_a = count_sparse_steps(a) if a.sparse is not None else None
    first = a.eval(ids)[-1]
    path = tmp_path / "s.pkv"
    a.save_state(path)
    ref = _greedy(a, first, 40)          # crosses into a new block: the tail gets quantized
    b = pyimp.load(model, n_ctx=256, block_len=32, batch_size=32, **opts)
    ran_b = count_sparse_steps(b) if b.sparse is not None else None
    assert b.load_state(path) == 90 and b.tokens == ids
    got = _greedy(b, first, 40)
    assert np.array_equal(got, ref)
    if a.sparse is not None:
        assert len({n for _, n in ran_a}) == 40 and ran_b == ran_a
        assert np.array_equal(np.asarray(a.sparse.importance_), np.asarray(b.sparse.importance_))


def test_version_2_files_still_load(model, tmp_path):
    """Version 2 stored a float side's blocks as the cache holds them ([Hkv][nlb][B*D], V
    channel-major): such a file loads and the engine continues bit for bit."""
    ids = _ids(90)
    a = pyimp.load(model, n_ctx=256, block_len=32, batch_size=32, kv_type="f16")
    first = a.eval(ids)[-1]
    a.save_state(tmp_path / "v3.pkv")
    header, arrays = read_state(tmp_path / "v3.pkv")
    assert header["version"] == state_mod.VERSION == 3
    c = a.cache
    for il in range(c.n_layer):
        bt = c.table(il)[:-(-c.slot_count(il) // c.block_len)].astype(np.int64)
        arrays[f"k.{il}"] = c.k_store[il][:, bt]
        arrays[f"v.{il}"] = c.v_store[il][:, bt]
    write_state(tmp_path / "v2.pkv", dict(header, version=2), arrays)
    ref = _greedy(a, first, 40)
    b = pyimp.load(model, n_ctx=256, block_len=32, batch_size=32, kv_type="f16")
    assert b.load_state(tmp_path / "v2.pkv") == 90 and b.tokens == ids
    assert np.array_equal(_greedy(b, first, 40), ref)
    write_state(tmp_path / "v1.pkv", dict(header, version=1), arrays)
    _state_error(b, tmp_path / "v1.pkv", "state version 1 is not supported")


def _payload_flags(path, name) -> int:
    """Byte 1 (the flags) of section ``name``'s payload in a state file."""
    data = open(path, "rb").read()
    _, _, hlen, tlen, n, _ = struct.unpack_from("<8sIIIII", data)
    t, table = 0, data[28 + hlen + 4:28 + hlen + 4 + tlen]
    at = 28 + hlen + 4 + tlen + 4
    for _ in range(n):
        (nlen,) = struct.unpack_from("<H", table, t)
        sec = table[t + 2:t + 2 + nlen].decode()
        t += 2 + nlen
        ndim = table[t + 2]
        t += 3 + 8 * ndim
        _, stored, _ = struct.unpack_from("<QQI", table, t)
        t += 20
        if sec == name:
            return data[at + 1]
        at += stored
    raise KeyError(name)


def test_float16_kv_gets_the_predictive_codec_and_the_keys_their_rope_frame(model, tmp_path):
    a = pyimp.load(model, n_ctx=256, block_len=32, batch_size=32, kv_type="f16")
    a.eval(_ids(200))
    path = tmp_path / "s.pkv"
    stats = a.save_state(path)
    assert stats["sections"]["k.0"]["codec"] == stats["sections"]["v.0"]["codec"] == "pred-f16"
    assert _payload_flags(path, "k.0") & 1 and not _payload_flags(path, "v.0") & 1
    kv = [s for name, s in stats["sections"].items() if name[0] in "kv"]
    assert sum(s["raw_bytes"] for s in kv) == a.cache.bytes_held()
    frame = state_mod._rope_frame(a, 0, a.cache.positions(0), 7 * 32)
    assert frame.pairs[:2].tolist() == [[0, 1], [2, 3]]                 # llama: adjacent pairs
    assert frame.positions.tolist() == list(range(7 * 32))
    rotated = pyimp.load(model, n_ctx=256, block_len=32, kv_type="f16", kv_rotate=True)
    assert state_mod._rope_frame(rotated, 0, np.arange(4), 4) is None


def test_level_0_stores_every_section_raw_and_reloads_the_same(model, tmp_path):
    """save_state(path, level=0): a short-lived file (a grid's shared prefill) skips the codecs,
    and loads back to the same greedy continuation as the compressed file."""
    a = pyimp.load(model, n_ctx=256, block_len=32, batch_size=32, kv_type="f16", track=True)
    first = a.eval(_ids(120))[-1]
    raw, packed = tmp_path / "raw.pkv", tmp_path / "packed.pkv"
    stats = a.save_state(raw, level=0)
    assert {s["codec"] for s in stats["sections"].values()} == {"raw"}
    assert stats["file_bytes"] >= stats["raw_bytes"]
    assert a.save_state(packed)["sections"]["k.0"]["codec"] == "pred-f16"
    rows = []
    for path in (raw, packed):
        b = pyimp.load(model, n_ctx=256, block_len=32, batch_size=32, kv_type="f16", track=True)
        assert b.load_state(path) == 120
        assert np.array_equal(np.asarray(b.sparse.importance_), np.asarray(a.sparse.importance_))
        rows.append(_greedy(b, first, 20))
    assert np.array_equal(rows[0], rows[1])


def test_prefix_reuse_evaluates_only_the_rest(model, tmp_path):
    p1, p2 = _ids(100, seed=1), _ids(100, seed=1)[:70] + _ids(30, seed=2)
    a = pyimp.load(model, n_ctx=256, block_len=32, batch_size=32, kv_type="f32")
    a.eval(p1)
    a.save_state(tmp_path / "p.pkv")
    b = pyimp.load(model, n_ctx=256, block_len=32, batch_size=32, kv_type="f32")
    b.load_state(tmp_path / "p.pkv")
    got = b.prime(p2)[-1]
    assert b.timings.extra["prefix_reused"] == 70 and b.tokens == p2
    fresh = pyimp.load(model, n_ctx=256, block_len=32, batch_size=32, kv_type="f32").eval(p2)[-1]
    # f32 KV: the same keys and values; only the prefill chunking differs (BLAS blocking of the
    # projections): measured max |dlogit| ~1e-6 at logits of magnitude ~10
    np.testing.assert_allclose(got, fresh, rtol=1e-4, atol=1e-4)
    # the whole prompt cached: one token is evaluated again, for its logits
    b.prime(p2)
    assert b.timings.extra["prefix_reused"] == 99


def test_prefix_reuse_inside_a_quantized_block_zeroes_later_importance(model, tmp_path):
    a = pyimp.load(model, n_ctx=256, block_len=32, batch_size=32, kv_type="q8_0", sparse=True,
                   anchor="dynamic")
    a.eval(_ids(100, seed=3))
    a._truncate(70)
    imp = np.asarray(a.sparse.importance_)
    bt = a.cache.table(0)
    assert not imp[:, bt[2], 70 - 64:].any() and not imp[:, bt[3]].any()
    assert imp[:, bt[2], :70 - 64].any()
    K, _ = a.cache.gather(0, 70)
    assert np.isfinite(K).all() and a.cache.k_layer(0).tail_block == bt[2]


def _state_error(eng, path, needle):
    before = (list(eng.tokens), np.asarray(eng.cache.k_store).copy())
    with pytest.raises(StateFileError, match=needle or None) as e:
        eng.load_state(path)
    assert str(path) in str(e.value)
    assert eng.tokens == before[0] and np.array_equal(np.asarray(eng.cache.k_store), before[1])


def test_refusals_name_the_file_and_leave_the_engine_alone(model, other_model, tmp_path):
    a = pyimp.load(model, n_ctx=128, block_len=32, kv_type="q8_0")
    a.eval(_ids(50))
    path = tmp_path / "a.pkv"
    a.save_state(path)
    b = pyimp.load(model, n_ctx=128, block_len=32, kv_type="q8_0")
    b.eval(_ids(20, seed=9))
    _state_error(pyimp.load(other_model, n_ctx=128, block_len=32, kv_type="q8_0"), path,
                 "another model")
    _state_error(pyimp.load(model, n_ctx=128, block_len=16, kv_type="q8_0"), path, "block_len")
    _state_error(pyimp.load(model, n_ctx=128, block_len=32, kv_type="f16"), path, "type_k")
    _state_error(pyimp.load(model, n_ctx=32, block_len=32, kv_type="q8_0"), path, "context size")
    _state_error(b, tmp_path / "missing.pkv", "")
    raw = path.read_bytes()
    for cut in (10, len(raw) // 2, len(raw) - 1):
        p = tmp_path / f"cut{cut}.pkv"
        p.write_bytes(raw[:cut])
        _state_error(b, p, "")
    assert b.tokens == _ids(20, seed=9)


@settings(deadline=None, max_examples=25)
@given(frac=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_any_flipped_bit_is_refused(model, tmp_path_factory, frac, bit):
    d = tmp_path_factory.mktemp("flip")
    a = pyimp.load(model, n_ctx=64, block_len=32, kv_type="q4_0", sparse=True)
    a.eval(_ids(40))
    a.save_state(d / "s.pkv")
    raw = bytearray((d / "s.pkv").read_bytes())
    raw[int(frac * len(raw))] ^= 1 << bit
    (d / "f.pkv").write_bytes(bytes(raw))
    _state_error(a, d / "f.pkv", "")


def test_cli_prompt_cache(model, tmp_path, capsys):
    pc = str(tmp_path / "pc.pkv")
    base = [model, "-p", "abcdefgh", "-n", "4", "--temp", "0", "-c", "128", "--json",
            "--prompt-cache", pc, "-ctk", "q8_0"]
    assert main(base) == 0
    first = json.loads(capsys.readouterr().out)
    assert os.path.exists(pc)
    assert main(base + ["--prompt-cache-ro"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["tokens"] == first["tokens"]
    assert again["timings"]["prompt_cache_reused"] == len(first["prompt_tokens"]) - 1
    # a state from other cache types: one line naming the file and the key, exit 1
    code = main(base[:-2] + ["-ctk", "f16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and pc in err[0] and "type_k" in err[0]
    code = main(base[:-4] + ["--prompt-cache", str(tmp_path / "none.pkv"), "--prompt-cache-ro"])
    err = capsys.readouterr().err
    assert code == 1 and "no such file" in err and "Traceback" not in err


def test_a_file_with_a_sampled_fingerprint_is_refused_as_such(model, tmp_path):
    """A state file whose model fingerprint is of the earlier, sampled kind ("sha256:..."):
    it cannot be checked against the model, and the refusal says so (not "another model")."""
    a = pyimp.load(model, n_ctx=128, block_len=32, kv_type="q8_0")
    a.eval(_ids(40))
    path = tmp_path / "old.pkv"
    a.save_state(path)
    header, arrays = read_state(path)
    header["model"] = "sha256:" + "0" * 64
    write_state(path, header, arrays)
    b = pyimp.load(model, n_ctx=128, block_len=32, kv_type="q8_0")
    with pytest.raises(StateFileError, match="earlier pyimp whose model fingerprint sampled"):
        b.load_state(path)
    assert b.tokens == []
