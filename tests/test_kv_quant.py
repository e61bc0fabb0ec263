"""Quantized KV cache: stored bytes = ggml's reference quantizer, the float tail rule, attention
kernels on quantized layers = their NumPy references, rewinds, and the engine end to end."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import quants as gq
from hypothesis import given, settings
from hypothesis import strategies as st

import pyimp
from pyimp import ops
from conftest import count_sparse_steps, prefill_path

from pyimp.attention.attend import attention_decode, attention_prefill
from pyimp.kv.cache import QUANT_TYPES, KVCache, QuantizedKV
from pyimp.attention.attend import sparse_attention_decode
from tools.write_synthetic_gguf import SynthSpec, write
from tools.write_synthetic_gguf import prompt_ids as _ids

QTYPES = sorted(QUANT_TYPES)


def _cache(type_k, type_v, layout="token", Hkv=2, D=64, B=32, n_ctx=160, n_seq=1):
    return KVCache(1, Hkv, D, n_ctx, block_len=B, type_k=type_k, type_v=type_v, v_layout=layout,
                   n_seq=n_seq)


def _fill(cache, n, splits, rng, scale=1.0):
    """Write n random tokens in chunks cut at ``splits``; returns K, V float32 [n, Hkv, D]."""
    k = (rng.standard_normal((n, cache.n_head_kv, cache.head_dim)) * scale).astype(np.float32)
    v = (rng.standard_normal((n, cache.n_head_kv, cache.head_dim)) * scale).astype(np.float32)
    cache.reserve(n)
    cuts = [0] + sorted(set(s for s in splits if 0 < s < n)) + [n]
    for a, b in zip(cuts[:-1], cuts[1:]):
        cache.write(0, k[a:b], v[a:b], a)
    cache.commit(n)
    return k, v


@settings(deadline=None, max_examples=40)
@given(tk=st.sampled_from(QTYPES), tv=st.sampled_from(QTYPES),
       layout=st.sampled_from(["token", "channel"]), n=st.integers(1, 150),
       splits=st.lists(st.integers(1, 149), max_size=5), seed=st.integers(0, 2**31 - 1))
def test_full_blocks_hold_ggml_bytes_and_the_tail_holds_floats(tk, tv, layout, n, splits, seed):
    rng = np.random.default_rng(seed)
    c = _cache(tk, tv, layout)
    k, v = _fill(c, n, splits, rng)
    B, Hkv = c.block_len, c.n_head_kv
    n_full = n // B
    for h in range(Hkv):
        for lb in range(n_full):               # blocks quantized from the float32 values at once
            pb = c.table(0)[lb]
            kk = k[lb * B:(lb + 1) * B, h]                      # [B, D] token rows
            vv = v[lb * B:(lb + 1) * B, h]
            assert np.array_equal(c.k_store[0, h, pb], gq.quantize(kk, QUANT_TYPES[tk]).ravel())
            vrows = vv if layout == "token" else vv.T                  # channel rows: [D, B]
            assert np.array_equal(c.v_store[0, h, pb], gq.quantize(vrows, QUANT_TYPES[tv]).ravel())
    K, V = c.gather(0)
    tail = slice(n_full * B, n)                                 # the block being filled: exact
    assert np.array_equal(K[:, tail], k[tail].transpose(1, 0, 2))
    assert np.array_equal(V[:, tail], v[tail].transpose(1, 0, 2))
    kv = c.k_layer(0)
    assert isinstance(kv, QuantizedKV)
    assert kv.tail_block == (c.table(0)[n_full] if n % B else -1)


@st.composite
def attn_case(draw):
    # K: fp16 bits or quantized, V: float32 or quantized (every kernel compiles once per
    # pair of storage kinds; all five block types share the quantized kind)
    tk = draw(st.sampled_from(["f16", "q8_0", "q4_1", "q5_0"]))
    tv = draw(st.sampled_from(["f32", "q4_0", "q5_1", "q8_0"]))
    layout = draw(st.sampled_from(["token", "channel"]))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.integers(1, 3))
    D = draw(st.sampled_from([32, 64]))
    n = draw(st.integers(1, 130))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    c = _cache(tk, tv, layout, Hkv=Hkv, D=D, n_ctx=160, n_seq=2)
    c.reserve(20, seq=1)                   # another sequence first: physical != logical order
    _fill(c, n, draw(st.lists(st.integers(1, 129), max_size=3)), rng, scale=2.0)
    q = rng.standard_normal((n, Hkv * G, D)).astype(np.float32)
    return c, q, n, rng


# Tolerances: kernel and reference read the same dequantized values (the decoders are
# bit-identical to gguf.quants.dequantize, the tail is the same float32 array); they differ
# only in float32 summation order over <= 130 keys. An output is a weighted sum of values up
# to vmax ~ 8 that can cancel to ~0.1, so the error scales with vmax, not with the output:
# observed <= 1.5e-6 * vmax, asserted 1e-5 * vmax absolute, 1e-5 relative.
def _tol(c):
    vmax = float(np.abs(c.gather(0)[1]).max())
    return dict(rtol=1e-5, atol=1e-5 * max(vmax, 1.0))


@settings(deadline=None, max_examples=30)
@given(case=attn_case(), window=st.sampled_from([0, 0, 7, 40]))
def test_attention_kernels_on_quantized_layers_equal_references(case, window):
    c, q, n, rng = case
    kc, vc, bt = c.k_layer(0), c.v_layer(0), c.table(0)
    TOL = _tol(c)
    Hq, D = q.shape[1:]
    # prefill: the last rows as one chunk (keys before them already cached), with importance
    pos0 = max(0, n - 20)
    outs, lses, imps = [], [], []
    for backend in ("numpy", "kernel", "tiled"):      # the two Numba prefill paths
        out = np.empty((n - pos0, Hq, D), np.float32)
        imp = np.zeros((c.max_blocks, c.block_len, Hq), np.float16)
        with prefill_path(backend):
            lses.append(attention_prefill(q[pos0:], kc, vc, bt, pos0, 0.3, window, out,
                                          importance=imp,
                                          backend="numpy" if backend == "numpy" else "numba"))
        outs.append(out)
        imps.append(imp.astype(np.float32))
    for k in (1, 2):
        np.testing.assert_allclose(outs[k], outs[0], **TOL)
        np.testing.assert_allclose(lses[k], lses[0], **TOL)
        # importance: fp16 sums of probabilities; one fp16 ulp (2**-10 relative) apart at most
        np.testing.assert_allclose(imps[k], imps[0], rtol=2 ** -10, atol=2 ** -14)
    # decode and block-sparse decode over a random subset of blocks
    n_lb = -(-n // c.block_len)
    # block 0 first: with a window it is often wholly masked and must read nothing
    sel = np.concatenate([[0], 1 + rng.permutation(n_lb - 1)[:n_lb // 2]]).astype(np.int32)[None]
    cnt = np.array([sel.shape[1]], np.int32)
    for fn, extra in ((attention_decode, ()), (sparse_attention_decode, (sel, cnt))):
        res = []
        for backend in ("numba", "numpy"):
            out = np.empty((Hq, D), np.float32)
            r = fn(q[-1], kc, vc, bt, n, 0.3, window, *extra, out, backend=backend)
            res.append((out, r[0] if isinstance(r, tuple) else r))
        np.testing.assert_allclose(res[0][0], res[1][0], **TOL)
        np.testing.assert_allclose(res[0][1], res[1][1], **TOL)


def test_stale_bytes_past_the_tail_are_never_read():
    """A block's bytes beyond the valid tokens (and a stale quantized block under the tail)
    must not reach the output: poison them and compare with a clean cache."""
    rng = np.random.default_rng(5)
    clean, dirty = _cache("q4_0", "q8_0"), _cache("q4_0", "q8_0")
    for c in (clean, dirty):
        _fill(c, 75, [40], np.random.default_rng(1))
    pb_tail = dirty.table(0)[2]
    dirty.k_store[0, :, pb_tail] = 0xFF          # tail block's stale bytes: NaN scales
    dirty.v_store[0, :, pb_tail] = 0xFF
    q = rng.standard_normal((4, 64)).astype(np.float32)
    o1, o2 = np.empty((4, 64), np.float32), np.empty((4, 64), np.float32)
    attention_decode(q, clean.k_layer(0), clean.v_layer(0), clean.table(0), 75, 0.2, 0, o1)
    attention_decode(q, dirty.k_layer(0), dirty.v_layer(0), dirty.table(0), 75, 0.2, 0, o2)
    assert np.array_equal(o1, o2)


@pytest.mark.parametrize("tk,tv", [("q8_0", "q5_1"), ("q4_1", "f16")])
def test_truncate_with_checkpoint_is_exact_and_without_dequantizes(tk, tv):
    rng = np.random.default_rng(0)
    c = _cache(tk, tv)
    k, v = _fill(c, 40, [], rng)
    ck = c.checkpoint()
    K0, V0 = c.gather(0)
    # 40 more tokens complete block 1 (quantized now) and reach into block 2
    k2 = rng.standard_normal((40, 2, 64)).astype(np.float32)
    c.reserve(40)
    c.write(0, k2, k2, 40)
    c.commit(40)
    c.truncate(40, checkpoint=ck)                 # exact: block 1's first 8 tokens are floats again
    K1, V1 = c.gather(0)
    assert np.array_equal(K0, K1) and np.array_equal(V0, V1)
    # without a checkpoint, cutting inside a quantized block keeps its quantized values
    c.reserve(40)
    c.write(0, k2, k2, 40)
    c.commit(40)
    Kq, _ = c.gather(0)
    c.truncate(50)
    K2, _ = c.gather(0)
    assert np.array_equal(K2, Kq[:, :50])
    assert c.k_layer(0).tail_block == c.table(0)[1]
    # and writing on from there works (the tail holds the block being continued)
    c.reserve(5)
    c.write(0, k2[:5], k2[:5], 50)
    c.commit(5)
    K3, _ = c.gather(0)
    assert np.array_equal(K3[:, :50], Kq[:, :50]) and np.array_equal(K3[:, 50:], k2[:5].transpose(1, 0, 2))


def test_geometry_refusals_name_the_value():
    with pytest.raises(ValueError, match="head dim 16 .*multiple of 32"):
        KVCache(1, 1, 16, 64, type_k="q8_0", type_v="f16")
    with pytest.raises(ValueError, match="block length 16 .*channel"):
        KVCache(1, 1, 64, 64, block_len=16, type_k="f16", type_v="q4_0", v_layout="channel")
    with pytest.raises(ValueError, match="cache type for V 'q3_k' is not one of"):
        KVCache(1, 1, 64, 64, type_v="q3_k")
    KVCache(1, 1, 64, 64, block_len=16, type_k="q8_0", type_v="q4_0")      # token layout: fine


def test_bytes_needed_matches_allocation():
    for tk, tv, lay in [("q8_0", "q4_0", "token"), ("q5_1", "f32", "channel"), ("f16", "q4_1", "token")]:
        c = KVCache(3, 2, 64, 100, block_len=32, type_k=tk, type_v=tv, v_layout=lay)
        want = KVCache.bytes_needed(3, 2, 64, 100, block_len=32, type_k=tk, type_v=tv, v_layout=lay)
        assert want == c.nbytes + c.book_nbytes
    # q8_0 is 34/64 of f16 per token, q4_0 18/64
    assert KVCache.bytes_per_token(256, "q8_0") / KVCache.bytes_per_token(256, "f16") == 34 / 64


# ------------------------------------------------------------------ engine


@pytest.fixture(scope="module")
def llama32(tmp_path_factory):
    """A synthetic llama with head dim 32 (quantized K needs a multiple of 32)."""
    return write(tmp_path_factory.mktemp("kvq") / "llama32.gguf",
                 SynthSpec(arch="llama", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=256,
                           vocab_size=300, seed=11))



def _logits(path, ids, n_decode=8, sparse_ran=None, **opts):
    """Prefill ids then greedy-decode n_decode tokens; every step's logits [n_decode + 1, V].
    With a list ``sparse_ran`` the sparse decode never falls back to the dense kernel and the
    list collects its sparse steps (conftest.count_sparse_steps)."""
    eng = pyimp.load(path, n_ctx=256, block_len=32, batch_size=32, **opts)
    ran = count_sparse_steps(eng) if sparse_ran is not None else None
    rows = [eng.eval(ids)[-1]]
    for _ in range(n_decode):
        rows.append(eng.eval([int(np.argmax(rows[-1]))])[-1])
    if ran is not None:
        sparse_ran.extend(ran)
    return np.array(rows)


def test_engine_quantized_kv_costs_what_its_bits_say(llama32):
    ids = _ids(90)
    ref = _logits(llama32, ids, kv_type="f32")
    err = {t: float(np.abs(_logits(llama32, ids, kv_type=t) - ref).max())
           for t in ("f16", "q8_0", "q4_0")}
    # every type really changes what attention reads, and fewer bits cost more
    assert 0 < err["f16"] < err["q8_0"] < err["q4_0"]
    # 8-bit blocks keep the distributions close: measured on this model (logits of std 3.1)
    # max |dlogit| 0.07 and mean KL 3.2e-5 against the f32 cache; bound 6x the KL measured
    # (the q8_0 bar on the real Gemma is 2e-3)
    ref_lp = ref - np.logaddexp.reduce(ref, axis=1, keepdims=True)
    q8 = _logits(llama32, ids, kv_type="q8_0")
    q8_lp = q8 - np.logaddexp.reduce(q8, axis=1, keepdims=True)
    kl = float((np.exp(ref_lp) * (ref_lp - q8_lp)).sum(axis=1).mean())
    assert 0 < kl < 2e-4, kl


def test_engine_mixed_types_and_sparse_run(llama32):
    ids = _ids(120, seed=2)
    dense = _logits(llama32, ids, n_decode=4, cache_type_k="q8_0", cache_type_v="q4_1")
    # sparse with a budget covering every block and no dense fallback: the block-sparse
    # kernels over every block of the quantized cache
    ran = []
    sparse = _logits(llama32, ids, n_decode=4, cache_type_k="q8_0", cache_type_v="q4_1",
                     sparse=True, topk=16, anchor="block_mean", sparse_ran=ran)
    assert sorted({n for _, n in ran}) == [121, 122, 123, 124]   # every decode step ran sparse
    np.testing.assert_allclose(sparse, dense, rtol=1e-4, atol=1e-4)   # f32 merge order only


def test_kv_rotation_is_neutral_without_quantization(llama32):
    ids = _ids(70, seed=3)
    plain = _logits(llama32, ids, n_decode=4, kv_type="f32")
    rotated = _logits(llama32, ids, n_decode=4, kv_type="f32", kv_rotate=True)
    # H is orthonormal: q.k and the output are unchanged up to float32 rounding of the
    # rotations (a 32-term sum each)
    np.testing.assert_allclose(rotated, plain, rtol=1e-4, atol=1e-4)
    h = ops.hadamard(32)
    np.testing.assert_allclose(h @ h, np.eye(32), atol=1e-6)
    with pytest.raises(ValueError, match="power of 2, got 48"):
        ops.hadamard(48)


def test_engine_refuses_quantized_k_on_head_dim_16(tmp_path):
    path = write(tmp_path / "d16.gguf", SynthSpec(arch="llama", n_layer=1, n_embd=64, n_head=4,
                                                  n_head_kv=2, n_ff=64, vocab_size=300))
    with pytest.raises(ValueError, match="cache type q8_0 for K needs a head dim 16"):
        pyimp.load(path, n_ctx=64, cache_type_k="q8_0")


@settings(deadline=None, max_examples=30)
@given(t=st.sampled_from(["f16", "f32"]), n=st.integers(1, 100), splits=st.lists(st.integers(1, 99), max_size=4),
       # up to 2**12: a normal draw times 2**12 stays below the largest f16 (65504) unless it
       # exceeds 16 sigma (2**15 made a 2-sigma draw overflow, which write() rightly refuses)
       scale_exp=st.integers(-20, 12), seed=st.integers(0, 2**31 - 1))
def test_float_stores_hold_numpys_conversion_at_the_paged_slots(t, n, splits, scale_exp, seed):
    """The compiled f16/f32 writer puts token p of kv head h at row p % B of block
    block_table[p // B], K as token rows and V as channel rows, each value converted as
    NumPy's astype (round to nearest even, subnormals included: scales down to 2**-20)."""
    rng = np.random.default_rng(seed)
    c = _cache(t, t, B=16, n_ctx=112)
    c.tables[0, 0] = rng.permutation(c.tables.shape[2]).astype(np.int32)  # non-identity table
    c._free = [[] for _ in c._free]
    k, v = _fill(c, n, splits, rng, scale=2.0 ** scale_exp)
    dt = np.float16 if t == "f16" else np.float32
    kst, vst = c.k_store[0], c.v_store[0]
    for p in range(n):
        pb, r = c.table(0)[p // 16], p % 16
        for h in range(c.n_head_kv):
            np.testing.assert_array_equal(kst[h, pb].reshape(16, -1)[r], k[p, h].astype(dt))
            np.testing.assert_array_equal(vst[h, pb].reshape(-1, 16)[:, r], v[p, h].astype(dt))


@settings(deadline=None, max_examples=60)
@given(k=st.lists(st.sampled_from([0.0, -1.5, 65519.0, 65520.0, -65520.0, 1e30, np.inf, -np.inf,
                                   np.nan]), min_size=1, max_size=6),
       v=st.lists(st.sampled_from([0.0, 2.0, -65519.0, 65520.0, np.nan, np.inf]), min_size=0, max_size=6),
       lim_k=st.sampled_from([65520.0, np.inf]), lim_v=st.sampled_from([65520.0, np.inf]))
def test_kv_write_check_is_the_numpy_bounds(k, v, lim_k, lim_v):
    """KVCache.write's one-pass check (kvcache._within) against its NumPy statement: every
    value strictly inside the store's limit (f16: |x| < 65520, f32: finite), NaN refused."""
    from pyimp.kv.cache import _within
    k, v = np.array(k, np.float32), np.array(v, np.float32)

    def ok(x, lim):
        return bool(np.all((x < lim) & (x > -lim)))
    assert _within(k, v, lim_k, lim_v) == (ok(k, lim_k) and ok(v, lim_v))


# ------------------------------------------------------------------ against llama.cpp

KL_TEXT_TOKENS = 1400     # BOS + the first 1399 tokens of Python's "Execution model" pydoc topic
KL_SCORED = 128           # the last positions, evaluated as one chunk after the rest
KL_TYPES = ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0")


def _mean_kl(ref: np.ndarray, other: np.ndarray) -> float:
    """Mean over rows of KL(softmax(ref) || softmax(other)), in float64."""
    p = ref.astype(np.float64)
    q = other.astype(np.float64)
    p -= np.logaddexp.reduce(p, axis=1, keepdims=True)
    q -= np.logaddexp.reduce(q, axis=1, keepdims=True)
    return float((np.exp(p) * (p - q)).sum(axis=1).mean())


def _kl_text_tokens(gemma_path) -> list[int]:
    import pydoc_data.topics
    eng = pyimp.load(gemma_path, n_ctx=64)
    ids = eng.tokenize(pydoc_data.topics.topics["execmodel"], add_bos=False)
    bos = eng.cfg.bos_id
    eng.close()
    assert len(ids) >= KL_TEXT_TOKENS - 1
    return [bos] + ids[:KL_TEXT_TOKENS - 1]


def _pyimp_last_logits(gemma_path, toks, **opts) -> np.ndarray:
    eng = pyimp.load(gemma_path, n_ctx=len(toks) + 8, **opts)
    eng.eval(toks[:-KL_SCORED])
    out = np.asarray(eng.eval(toks[-KL_SCORED:], all_logits=True), np.float32)
    eng.close()
    return out


@pytest.mark.slow
def test_quantized_kv_kl_within_llamacpps_on_gemma(peer, gemma_path):
    """Each cache type's cost on real text, pyimp against llama.cpp: mean KL of the last 128
    positions' next-token distributions (a 1400-token text, the last 128 as one chunk), each
    engine against its own f16 cache. llama.cpp runs flash attention (a quantized V needs it;
    its f16 reference too, so that only the cache type differs) and by default rotates a
    quantized K (Hadamard of the head dim) and V (blocks of 64) before storing them; pyimp's
    default stores them unrotated (``kv_rotate=True``: one Hadamard of the head dim for q,
    k, v). Per type, pyimp's default against llama.cpp's default (what ``-ctk T -ctv T``
    gives), and for q4_0 also like against like: both unrotated, both rotated."""
    toks = _kl_text_tokens(gemma_path)
    ours_ref = _pyimp_last_logits(gemma_path, toks, kv_type="f16")

    def theirs(t, rotate=True):
        return peer.logits(gemma_path, toks, n_batch=512, kv_type=t, flash_attn=True,
                           rotate=rotate, last=KL_SCORED)
    theirs_ref = theirs("f16")
    ours = {t: _mean_kl(ours_ref, _pyimp_last_logits(gemma_path, toks, kv_type=t)) for t in KL_TYPES}
    peer_kl = {t: _mean_kl(theirs_ref, theirs(t)) for t in KL_TYPES}
    ours["q4_0 rotated"] = _mean_kl(ours_ref, _pyimp_last_logits(gemma_path, toks, kv_type="q4_0",
                                                                  kv_rotate=True))
    peer_kl["q4_0 rotated"] = peer_kl["q4_0"]
    ours["q4_0 unrotated"] = ours["q4_0"]
    peer_kl["q4_0 unrotated"] = _mean_kl(theirs_ref, theirs("q4_0", rotate=False))
    report = ", ".join(f"{t}: {ours[t]:.3g} vs {peer_kl[t]:.3g}" for t in ours)
    # every type really changes what attention reads, in both engines, and fewer bits cost
    # more (measured KLs span 6.3e-4 .. 0.15 in pyimp, 9e-3 .. 0.18 in llama.cpp)
    for kl in (ours, peer_kl):
        assert 0 < kl["q8_0"] < kl["q5_1"] and kl["q5_0"] < kl["q4_0"], report
    # Measured here (pyimp / llama.cpp): q8_0 6.3e-4 / 9.0e-3, q5_1 0.035 / 0.043, q5_0 0.040
    # / 0.055, q4_1 0.092 / 0.122, q4_0 0.147 / 0.137 (1.07x), q4_0 both unrotated 0.147 /
    # 0.176, both rotated 0.121 / 0.137. Like against like pyimp's cache is the more exact:
    # its bytes are ggml's reference quantizer's (llama.cpp's cache writer stores the same for
    # these rows, q8_0 up to half-even ties), the block being filled stays float32 and q is
    # not rounded to q8_0 (one layer at a time, 3 texts: attention-output error 1.52e-2 vs
    # 1.77e-2 for a q4_0 K). What llama.cpp gains by default is its rotation (K's error -35%,
    # V's -54% per layer). The bar is the 1.2x, held on this fixed text: the ratio
    # of two single-text means moves with the text (q4_0 defaults on two more pydoc topics:
    # 1.39x on "compound", 0.99x on "types"; unrotated pyimp is the lower on all three).
    for t in ours:
        assert ours[t] <= 1.2 * peer_kl[t], f"{t}: pyimp {ours[t]:.3g} > 1.2 x llama.cpp's; {report}"
