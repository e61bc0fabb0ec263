"""Merging near-duplicate tokens (pyimp.kv.merge): the kernels' per-slot score bias, the
SimHash plan, and merged caches against the caches they stand for."""
import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pyimp
from conftest import prefill_path
from pyimp.kv import merge as kv_merge
from pyimp.attention.attend import attention_decode, attention_prefill
from pyimp.kv.cache import KVCache
from pyimp.attention.attend import every_block, sparse_attention_decode
from test_kv_policy import _run, llama  # noqa: F401  (the policy tests' model and runner)
from tools.write_synthetic_gguf import prompt_ids as _ids


def _cache(kv_type, k, v, B, seed, n_ctx=None):
    """A one-layer cache holding k, v float32 [n, Hkv, D], physical blocks shuffled."""
    n, Hkv, D = k.shape
    rng = np.random.default_rng(seed)
    c = KVCache(1, Hkv, D, n_ctx or n + 64, block_len=B, kv_type=kv_type)
    for f in c._free:
        rng.shuffle(f)
    c.reserve(n)
    c.write(0, k, v, 0)
    c.commit(n)
    return c


def _flat_attention64(q, K, V, scale):
    """float64 softmax attention of q [Hq, D] over every row of K, V [n, Hkv, D]."""
    Hq, D = q.shape
    G = Hq // K.shape[1]
    out = np.empty((Hq, D))
    for h in range(Hq):
        s = K[:, h // G].astype(np.float64) @ q[h].astype(np.float64) * scale
        e = np.exp(s - s.max())
        out[h] = e @ V[:, h // G].astype(np.float64) / e.sum()
    return out


# ----------------------------------------------------------------- the kernels' bias


@settings(deadline=None, max_examples=40)
@given(st.sampled_from(["f16", "f32", "q8_0"]), st.integers(1, 90), st.sampled_from([4, 8, 32]),
       st.integers(1, 2), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_a_slot_of_multiplicity_c_attends_as_c_copies(kv_type, n, B, Hkv, G, seed):
    """Decode attention over n tokens where slot i carries log(c_i) equals float64 attention
    over the cache with token i repeated c_i times (dense and block-sparse decode, Numba and
    NumPy): the bias is exactly the softmax mass of the copies."""
    D = 32
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((n, Hkv, D)).astype(np.float32)
    c = _cache(kv_type, k, v, B, seed)
    counts = rng.integers(1, 5, n)
    c.enable_merging()
    blocks, rows = c.slots(0, n)
    c.lmul[0][blocks, rows] = np.log(counts).astype(np.float32)
    kq, vq = c.gather(0)                        # what the cache holds (quantized: dequantized)
    Ke, Ve = np.repeat(kq.transpose(1, 0, 2), counts, 0), np.repeat(vq.transpose(1, 0, 2), counts, 0)
    q = rng.standard_normal((Hkv * G, D)).astype(np.float32)
    want = _flat_attention64(q, Ke, Ve, 0.2)
    bt, bias = c.table(0), c.bias(0)
    sel, cnt = every_block(n, B)
    for backend in ("numba", "numpy"):
        out = np.empty((Hkv * G, D), np.float32)
        attention_decode(q, c.k_layer(0), c.v_layer(0), bt, n, 0.2, 0, out, backend=backend,
                         bias=bias)
        # float32 scores and sums over <= 360 copies, |s| <~ 10; log(c) rounded to float32
        # (relative 6e-8 of the mass): the same bound as the dense attention tests
        np.testing.assert_allclose(out, want, rtol=0, atol=5e-5)
        out[:] = np.nan
        sparse_attention_decode(q, c.k_layer(0), c.v_layer(0), bt, n, 0.2, 0, sel, cnt, out,
                                backend=backend, bias=bias)
        np.testing.assert_allclose(out, want, rtol=0, atol=5e-5)


@pytest.mark.parametrize("path", ["kernel", "tiled"])
@settings(deadline=None, max_examples=25)
@given(st.sampled_from(["f16", "q8_0"]), st.integers(2, 90), st.sampled_from([4, 8]),
       st.integers(1, 2), st.integers(1, 2), st.sampled_from([0, 5, 40]), st.integers(0, 2**31 - 1))
def test_prefill_with_bias_matches_the_reference(path, kv_type, n, B, Hkv, G, window, seed):
    """Both Numba prefill paths, and the importance they add, against the NumPy reference
    with the same per-slot bias."""
    D = 32
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((n, Hkv, D)).astype(np.float32)
    c = _cache(kv_type, k, v, B, seed)
    c.enable_merging()
    blocks, rows = c.slots(0, n)
    c.lmul[0][blocks, rows] = np.log(rng.integers(1, 6, n)).astype(np.float32)
    T = int(rng.integers(1, n + 1))
    q = rng.standard_normal((T, Hkv * G, D)).astype(np.float32)
    NB = c.k_layer(0).shape[1]
    outs, imps, lses = [], [], []
    for backend in ("numba", "numpy"):
        out = np.empty((T, Hkv * G, D), np.float32)
        imp = np.zeros((NB, B, Hkv * G), np.float16)
        with prefill_path(path):
            lse = attention_prefill(q, c.k_layer(0), c.v_layer(0), c.table(0), n - T, 0.3,
                                    window, out, importance=imp, backend=backend, bias=c.bias(0))
        outs.append(out)
        imps.append(imp.astype(np.float32))
        lses.append(lse)
    # float32 on both sides, summation orders differ (|s| <~ 12, n <= 90): as the dense tests
    np.testing.assert_allclose(outs[0], outs[1], rtol=0, atol=2e-5)
    np.testing.assert_allclose(lses[0], lses[1], rtol=0, atol=2e-5)
    # importance: per-key mass summed over <= 90 rows, then one fp16 rounding (2^-11 relative)
    np.testing.assert_allclose(imps[0], imps[1], rtol=2e-3, atol=1e-4)


def test_bias_shape_is_checked():
    c = _cache("f16", np.zeros((8, 1, 32), np.float32), np.zeros((8, 1, 32), np.float32), 4, 0)
    out = np.empty((1, 32), np.float32)
    with pytest.raises(ValueError, match="bias"):
        attention_decode(np.zeros((1, 32), np.float32), c.k_layer(0), c.v_layer(0), c.table(0),
                         8, 1.0, 0, out, bias=np.zeros((3, 4), np.float32))


# ----------------------------------------------------------------- the plan


@settings(deadline=None, max_examples=60)
@given(st.integers(1, 80), st.integers(1, 2), st.integers(1, 16), st.floats(0.5, 1.0),
       st.integers(0, 2**31 - 1))
def test_plan_rules(n, Hkv, bits, threshold, seed):
    rng = np.random.default_rng(seed)
    D = 16
    keys = rng.standard_normal((Hkv, n, D)).astype(np.float32)
    dup = rng.random(n) < 0.4                 # plant near-duplicates of earlier tokens
    for j in np.flatnonzero(dup):
        if j:
            keys[:, j] = keys[:, rng.integers(0, j)] * rng.uniform(0.5, 2.0)
    codes = kv_merge.signatures(keys, kv_merge.planes(Hkv, D, bits, seed))
    candidate = rng.random(n) < 0.8
    into, sim = kv_merge.merge_plan(keys, codes, candidate, threshold)
    a = np.flatnonzero(into >= 0)
    r = into[a]
    assert candidate[a].all() and candidate[r].all()          # protected slots never take part
    assert (into[r] == -1).all()                               # representatives stay
    assert (r < a).all()                                       # the first of a group represents it
    assert (codes[a] == codes[r]).all()                        # same signature in every kv head
    kn = keys / np.linalg.norm(keys, axis=-1, keepdims=True)
    cos = np.einsum("hnd,hnd->hn", kn[:, a], kn[:, r]).min(0)
    assert (cos >= threshold - 1e-6).all()
    np.testing.assert_allclose(sim[a], cos, atol=1e-6)
    # a scaled copy has cosine 1: every planted duplicate whose original represents and
    # shares its candidacy is absorbed by some representative
    lim = kv_merge.limit_to_multiple(into, sim, 4)
    assert (lim >= 0).sum() % 4 == 0 and set(np.flatnonzero(lim >= 0)) <= set(a)


def test_signatures_are_the_projection_signs():
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((2, 5, 8)).astype(np.float32)
    proj = kv_merge.planes(2, 8, 6, 1)
    codes = kv_merge.signatures(keys, proj)
    for h in range(2):
        for i in range(5):
            bits = [(keys[h, i] @ proj[h, b]) > 0 for b in range(6)]
            assert codes[i, h] == sum(1 << b for b, on in enumerate(bits) if on)


# ----------------------------------------------------------------- merged caches


class _Imp:
    """The slice of a sparse state the merger uses: importance_ and compacted()."""

    def __init__(self, cache, Hq, rng):
        NB, B = cache.k_layer(0).shape[1], cache.block_len
        self.importance_ = rng.uniform(0, 3, (1, NB, B, Hq)).astype(np.float16)
        self.calls = 0

    def compacted(self, il, old):
        self.calls += 1


@pytest.mark.parametrize("kv_type", ["f16", "f32", "q8_0", "q4_0"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_merging_identical_tokens_keeps_attention_and_frees_blocks(kv_type, seed):
    """A cache where many tokens are exact copies of earlier ones: after the merge the layer
    holds fewer slots, returns emptied blocks to the pool, every slot's multiplicity counts
    the tokens it stands for, and decode attention equals attention over the unmerged cache."""
    rng = np.random.default_rng(seed)
    n, Hkv, D, B, Hq = 150, 1, 32, 8, 4
    base = rng.standard_normal((20, Hkv, D)).astype(np.float32)
    pick = rng.integers(0, 20, n)
    pick[:20] = np.arange(20)
    k = base[pick]
    vbase = rng.standard_normal((20, Hkv, D)).astype(np.float32)
    v = vbase[pick]
    c = _cache(kv_type, k, v, B, seed)
    c_ref = _cache(kv_type, k, v, B, seed)
    sp = _Imp(c, Hq, rng)
    merger = kv_merge.KVMerger(kv_merge.MergeOptions(threshold=0.999), None, c, sp, keep=4)
    held = c.bytes_held()
    b0, r0 = c.slots(0, n)
    imp_before = sp.importance_[0][b0, r0].astype(np.float64).sum()
    absorbed = merger.merge_layer(0)
    m = c.slot_count(0)
    assert absorbed == n - m > 0 and sp.calls == 1
    if c.quantized:
        assert absorbed % B == 0
    assert c.bytes_held() < held
    assert len(c._free[0]) == c.max_blocks - (-(-m // B))
    blocks, rows = c.slots(0, m)
    counts = np.exp(c.lmul[0][blocks, rows].astype(np.float64))
    np.testing.assert_allclose(counts.sum(), n, rtol=1e-6)    # every token is represented
    pos = c.positions(0)
    assert (pos[:4] == np.arange(4)).all()                    # the sinks stay, in place
    assert (pos[-(n % B or B):] == np.arange(n - (n % B or B), n)).all()   # the newest block
    # importance moved and summed (fp16 roundings of <= 150 terms of <= 3 each)
    np.testing.assert_allclose(sp.importance_[0][blocks, rows].astype(np.float64).sum(),
                               imp_before, rtol=2e-3)
    q = rng.standard_normal((Hq, D)).astype(np.float32)
    got = np.empty((Hq, D), np.float32)
    want = np.empty((Hq, D), np.float32)
    attention_decode(q, c.k_layer(0), c.v_layer(0), c.table(0), m, 0.3, 0, got, bias=c.bias(0))
    attention_decode(q, c_ref.k_layer(0), c_ref.v_layer(0), c_ref.table(0), n, 0.3, 0, want)
    # identical tokens average to themselves (float64, one rounding back: exact for float
    # caches; a quantized row is requantized from its own dequantized values, which q8_0 and
    # q4_0 reproduce within one step of the block's scale); the rest is float32 summation
    tol = 5e-5 if kv_type in ("f16", "f32") else 2e-2
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)


def test_slots_freed_by_a_merge_start_again_at_multiplicity_one():
    rng = np.random.default_rng(4)
    B, D = 4, 32
    k = np.repeat(rng.standard_normal((1, 1, D)).astype(np.float32), 40, 0)
    c = _cache("f16", k, k.copy(), B, 0, n_ctx=80)
    merger = kv_merge.KVMerger(kv_merge.MergeOptions(threshold=0.9), None, c, None, keep=1)
    assert merger.merge_layer(0) > 0
    m = c.slot_count(0)
    new = rng.standard_normal((12, 1, D)).astype(np.float32)
    c.reserve(12)
    c.write(0, new, new, 40)
    c.commit(12)
    blocks, rows = c.slots(m, 12)
    assert (c.lmul[0][blocks, rows] == 0).all()


def test_write_slots_quantizes_rows_as_the_writer_does():
    rng = np.random.default_rng(5)
    n, D, B = 21, 64, 8
    k = rng.standard_normal((n, 1, D)).astype(np.float32)
    v = rng.standard_normal((n, 1, D)).astype(np.float32)
    c = _cache("q4_1", k, v, B, 1)
    new = rng.standard_normal((3, 1, D)).astype(np.float32)
    slots = np.array([2, 9, 19])                 # 19 sits in the float tail (21 % 8 = 5 left)
    c.write_slots(0, slots, new, new)
    k2 = k.copy()
    k2[slots] = new
    want = _cache("q4_1", k2, k2.copy(), B, 1)
    got_k, got_v = c.gather(0)
    ref_k, ref_v = want.gather(0)
    assert np.array_equal(got_k, ref_k)
    np.testing.assert_array_equal(got_v[:, slots], ref_v[:, slots])


# ----------------------------------------------------------------- the engine


def test_engine_without_duplicates_is_unchanged(llama):
    """A threshold nothing reaches merges nothing: logits bit-identical to no merging."""
    ids = _ids(60)
    _, plain = _run(llama, ids, 10, track=True)
    eng, got = _run(llama, ids, 10, track=True, kv_merge=1.0, kv_merge_bits=4)
    assert eng.merger.merged == 0
    assert np.array_equal(plain, got)


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_engine_merges_a_repeated_prompt(llama, kv):
    """A prompt of one token repeated: its cached keys differ only by RoPE, so a loose
    threshold merges many and the layers hold fewer slots than tokens. The next decode step
    over the merged cache gives the logits of an engine without merging whose layers hold
    every merged slot's key and value repeated as many times as the slot's multiplicity."""
    ids = [1] + [7] * 100
    eng, rows = _run(llama, ids, 12, track=True, kv_type=kv, kv_merge=0.5, kv_merge_bits=2)
    n = len(eng.tokens)
    assert eng.merger.merged > 0
    assert all(eng.cache.slot_count(il) < n for il in range(eng.cfg.n_layer))
    ref = pyimp.load(llama, n_ctx=256, block_len=8, batch_size=16, kv_type=kv)
    ref.eval(eng.tokens)                     # n slots per layer, overwritten below
    c = eng.cache
    for il in range(eng.cfg.n_layer):
        m = c.slot_count(il)
        blocks, slot_rows = c.slots(0, m, layer=il)
        mult = np.exp(c.bias(il)[blocks, slot_rows].astype(np.float64))
        counts = np.rint(mult).astype(np.int64)
        np.testing.assert_allclose(mult, counts, rtol=1e-6)     # log(count) rounded to float32
        assert counts.sum() == n and counts.max() > 1
        k, v = c.gather(il)                                      # [Hkv, m, D]
        ref.cache.write_slots(il, np.arange(n), np.repeat(k.transpose(1, 0, 2), counts, 0),
                              np.repeat(v.transpose(1, 0, 2), counts, 0))
        for x, y in zip(ref.cache.gather(il), (k, v)):
            np.testing.assert_array_equal(x, np.repeat(y, counts, 1))
    tok = int(np.argmax(rows[-1]))
    got, want = eng.eval([tok])[-1], ref.eval([tok])[-1]
    # the repeated rows are the merged slots' stored values (q8_0 rows requantized from their
    # own dequantized values come back the same, checked above); what differs is the float32 attention over
    # m biased slots instead of n plain ones, and log(count) rounded to float32 (6e-8 of a
    # slot's mass): measured 1.8e-7 (f16) and 6.2e-7 (q8_0) of the largest |logit| after 2
    # layers. 1e-5 leaves 16x of margin; decode attention without the multiplicities moves
    # the logits by 0.25-0.37 of it.
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("merge_on_load", [0.5, 0.0])
def test_a_merged_state_reloads_bit_for_bit(llama, tmp_path, merge_on_load):
    """The state file keeps the slots' multiplicities: a fresh engine (merging or not) that
    loads it continues with the logits of the engine that saved it."""
    ids = [1] + [7] * 100
    eng, _ = _run(llama, ids, 3, track=True, kv_merge=0.5, kv_merge_bits=2)
    path = str(tmp_path / "m.pkv")
    eng.save_state(path)
    assert eng.merger.merged > 0
    want = [eng.eval([t])[-1] for t in (5, 9, 11)]
    fresh = pyimp.load(llama, n_ctx=256, block_len=8, batch_size=16, track=True,
                       kv_merge=merge_on_load, kv_merge_bits=2)
    fresh.eval([3, 4, 5])                # a different state first: load replaces it all
    fresh.load_state(path)
    assert fresh.cache.lmul is not None and fresh.cache.lmul.max() > 0
    got = [fresh.eval([t])[-1] for t in (5, 9, 11)]
    assert np.array_equal(np.array(want), np.array(got))
    plain = pyimp.load(llama, n_ctx=256, block_len=8, batch_size=16, track=True)
    plain.load_state(path)
    assert not np.array_equal(np.array(want)[0], _without_bias(plain, 5))


def _without_bias(eng, tok):
    """The next logits if the loaded multiplicities were ignored (they matter: a check that
    the reload test above compares something the multiplicities change)."""
    eng.cache.lmul[:] = 0
    return eng.eval([tok])[-1]


@pytest.mark.parametrize("kw, msg", [
    (dict(kv_merge=1.5), "merge threshold"),
    (dict(kv_merge=0.9, kv_merge_bits=0), "SimHash bits"),
    (dict(kv_merge=0.9, kv_type="q8_0", v_layout="channel"), "channel"),
])
def test_engine_refusals(llama, kw, msg):
    with pytest.raises(ValueError, match=msg):
        pyimp.load(llama, n_ctx=64, **kw)


def test_cli_flag_errors_are_one_line(llama):
    r = subprocess.run([sys.executable, "-m", "pyimp.cli.run", llama, "-p", "hi", "-n", "1",
                        "--kv-merge", "2"], capture_output=True, text=True)
    assert r.returncode == 2 and "--kv-merge must be in" in r.stderr
    assert "Traceback" not in r.stderr


def test_recall_target_counts_merged_tokens(llama):
    """The recall target's mass estimate counts a merged slot as the exp(lmul) tokens it
    stands for; with every block selected the merged sparse run equals the merged dense one."""
    from pyimp.sparse.retrieval import block_center_logits, estimated_mass
    ids = [1] + [7] * 60 + _ids(80)[1:]         # merged slots, then blocks of single tokens
    kw = dict(track=True, kv_merge=0.5, kv_merge_bits=2)
    _, dense = _run(llama, ids, 4, **kw)
    eng, sparse = _run(llama, ids, 4, sparse=True, topk=0, recall_target=1.0, report=True,
                       local_blocks=1, **kw)
    np.testing.assert_allclose(sparse, dense, rtol=0, atol=1e-4 * np.abs(dense).max())
    sp, c = eng.sparse, eng.cache
    il = sp.sparse_layers[0]
    n, B = c.slot_count(il), c.block_len
    assert np.any(c.bias(il) != 0), "nothing merged: the test needs multiplicities"
    q = np.random.default_rng(0).standard_normal((eng.cfg.n_head, eng.cfg.head_dim))
    q = q.astype(np.float32)
    sp.opts = dataclasses.replace(sp.opts, recall_target=0.6)
    sel, cnt, est = sp._recall_selection(il, q, n, 0.125)
    assert np.all(cnt < -(-n // B)), "every block selected: the estimate decides nothing"
    n_lb = -(-n // B)
    nv = np.minimum(B, n - np.arange(n_lb) * B)
    logits = block_center_logits(q, sp._fresh_anchors(il, n), c.table(il), nv, sp.anchor_type,
                                 eng.cfg.n_head // eng.cfg.n_head_kv)
    lm = c.bias(il)[c.table(il)[:n_lb]]
    tokens = np.where(np.arange(B) < nv[:, None], np.exp(lm.astype(np.float64)), 0).sum(1)
    w = estimated_mass(logits, eng.cfg.n_head // est.size, 0.125, tokens)
    assert not np.allclose(w, estimated_mass(logits, eng.cfg.n_head // est.size, 0.125, nv))
    for si in range(est.size):
        assert est[si] == pytest.approx(w[sel[si, :cnt[si]], si].sum(), rel=1e-9)
