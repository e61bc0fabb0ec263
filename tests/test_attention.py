"""Dense paged attention: GQA / paging mapping, Numba == NumPy == flat float64, importance mass."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from types import SimpleNamespace

from conftest import prefill_path

from pyimp.attention.attend import (attention_decode, attention_prefill, gather_kv)
from pyimp.kv.cache import KVCache
from pyimp.sparse.policy import SparseOptions, SparseState

DTYPES = [np.float16, np.float32]


# --------------------------------------------------------------------------
# building a paged cache from flat K/V with the docs/kvcache.md section 3 mapping
# --------------------------------------------------------------------------


def paged_from_flat(Kf, Vf, B, NB, block_table, dtype):
    """Kf, Vf: [n, Hkv, D] -> k_cache [Hkv][NB][B*D], v_cache [Hkv][NB][D*B].

    Written element by element from the mapping: position p is row t = p % B of
    physical block block_table[p // B]; K row t spans [t*D, (t+1)*D), V channel
    d of token t sits at [d*B + t]. Unused slots hold NaN so any read of a
    position outside 0..n-1 poisons the result.
    """
    n, Hkv, D = Kf.shape
    kc = np.full((Hkv, NB, B * D), np.nan, dtype)
    vc = np.full((Hkv, NB, D * B), np.nan, dtype)
    for p in range(n):
        b, t = block_table[p // B], p % B
        for j in range(Hkv):
            kc[j, b, t * D:(t + 1) * D] = Kf[p, j]
            for d in range(D):
                vc[j, b, d * B + t] = Vf[p, j, d]
    return kc, vc


def flat_attention64(q, Kf, Vf, qpos, scale, window):
    """float64 reference from flat arrays. q [T, Hq, D], K/V [n, Hkv, D]; query h uses kv h // G."""
    T, Hq, D = q.shape
    n, Hkv, _ = Kf.shape
    G = Hq // Hkv
    out = np.zeros((T, Hq, D))
    P = np.zeros((T, Hq, n))
    for i in range(T):
        keys = np.arange(n)
        ok = keys <= qpos[i]
        if window > 0:
            ok &= qpos[i] - keys < window
        for h in range(Hq):
            s = Kf[:, h // G, :].astype(np.float64) @ q[i, h].astype(np.float64) * scale
            s = np.where(ok, s, -np.inf)
            e = np.exp(s - s.max())
            P[i, h] = e / e.sum()
            out[i, h] = P[i, h] @ Vf[:, h // G, :].astype(np.float64)
    return out, P


@st.composite
def cache_case(draw, max_n=70):
    Hkv = draw(st.integers(1, 3))
    G = draw(st.sampled_from([1, 2, 3, 4, 8]))       # 1, 2, 4, 8: grouped decode (fp16, B % 16 == 0)
    B = draw(st.sampled_from([1, 2, 4, 8, 16, 32]))   # 16, 32: lane partials or grouped decode
    D = draw(st.sampled_from([1, 3, 8, 16, 64]))
    n = draw(st.integers(1, max_n))
    spare = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    dtype = draw(st.sampled_from(DTYPES))
    rng = np.random.default_rng(seed)
    nlb = -(-n // B)
    NB = nlb + spare
    bt = rng.permutation(NB)[:nlb].astype(np.int32)  # non-identity logical -> physical
    Kf = rng.standard_normal((n, Hkv, D)).astype(dtype)
    Vf = rng.standard_normal((n, Hkv, D)).astype(dtype)
    kc, vc = paged_from_flat(Kf, Vf, B, NB, bt, dtype)
    return dict(Hkv=Hkv, G=G, Hq=Hkv * G, B=B, D=D, n=n, NB=NB, bt=bt, Kf=Kf, Vf=Vf, kc=kc, vc=vc,
                dtype=dtype, rng=rng)


# --------------------------------------------------------------------------
# GQA / paging mapping (section 3)
# --------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 4), st.sampled_from([1, 2, 4, 8]),
       st.sampled_from([1, 3, 8, 16]), st.integers(1, 60), st.integers(0, 2**31 - 1), st.data())
def test_gqa_mapping_over_layers(L, Hkv, G, B, D, n, seed, data):
    """Through the engine's own cache: KVCache.write / gather per layer == flat, and attention,
    importance_[l] and anchor_[l] of layer l follow h -> h // G and the block table."""
    rng = np.random.default_rng(seed)
    Hq = Hkv * G
    # two sequences reserving blocks in turns, sequence 1 first: sequence 0's logical ->
    # physical map is not the identity (and sequence 1's data sits in the other blocks)
    cache = KVCache(L, Hkv, D, n, block_len=B, kv_type="f16", n_seq=2)
    done = [0, 0]
    while min(done) < n:
        for s in (1, 0):
            k = min(int(rng.integers(1, 2 * B + 1)), n - done[s])
            if k:
                cache.reserve(done[s] + k, seq=s)   # (counted from the committed 0 tokens)
                done[s] += k
    bt = cache.table(0)
    assert bt[0] != 0
    flats = [(rng.standard_normal((n, Hkv, D)).astype(np.float16),
              rng.standard_normal((n, Hkv, D)).astype(np.float16)) for _ in range(L)]
    cut = data.draw(st.integers(0, n))                        # written in two chunks
    for il, (K, V) in enumerate(flats):
        for a, b in [(0, cut), (cut, n)]:
            if b > a:
                cache.write(il, K[a:b].astype(np.float32), V[a:b].astype(np.float32), a)
                cache.write(il, -K[a:b].astype(np.float32), V[a:b].astype(np.float32), a, seq=1)
    cache.commit(n)
    cache.commit(n, seq=1)
    for il, (Kf, Vf) in enumerate(flats):
        K, V = cache.gather(il)
        # gather is a pure copy of the fp16 values: exact
        assert np.array_equal(K, Kf.transpose(1, 0, 2).astype(np.float32))
        assert np.array_equal(V, Vf.transpose(1, 0, 2).astype(np.float32))
        # and the layout is the documented one: row t of block bt[p // B] holds key p
        for p in range(n):
            b, t = bt[p // B], p % B
            assert np.array_equal(cache.k_cache_fp16_[il][:, b, t * D:(t + 1) * D], Kf[p])
            assert np.array_equal(cache.v_cache_fp16_[il][:, b, t::B], Vf[p])

    l = data.draw(st.integers(0, L - 1))
    Kf, Vf = flats[l]
    cfg = SimpleNamespace(n_layer=L, n_head=Hq, n_head_kv=Hkv, head_dim=D, is_swa=lambda il: False)
    st_ = SparseState(SparseOptions(enabled=True, anchor="quest"), cfg, cache)
    q = rng.standard_normal((Hq, D)).astype(np.float32)
    out = np.empty((Hq, D), np.float32)
    attention_decode(q, cache.k_cache_fp16_[l], cache.v_cache_fp16_[l], bt, n, 0.5, 0, out,
                     st_.importance_[l])
    ref, P = flat_attention64(q[None], Kf, Vf, [n - 1], 0.5, 0)
    # float32 dot products of <= 16 unit normals and softmax over <= 60 keys: error << 1e-4
    np.testing.assert_allclose(out, ref[0], rtol=0, atol=1e-4)
    # importance_[l][b][t][h] holds the probability of position lb*B + t for query head h
    for p in range(n):
        b, t = bt[p // B], p % B
        # fp16 storage: relative error 2**-11 (2**-25 absolute for subnormals); the float32
        # softmax adds ~1e-6 relative
        np.testing.assert_allclose(st_.importance_[l, b, t].astype(np.float64), P[0, :, p],
                                   rtol=2**-11 + 1e-6, atol=2**-25)
    others = [i for i in range(L) if i != l]
    assert not st_.importance_[others].any()  # other layers untouched
    # anchor_[l][b][a][h]: QUEST max / min over the block's valid keys of kv head h // G
    st_.after_prefill(n)
    for il in range(L):
        an = st_.anchor_[il]
        assert an.shape == (cache.max_blocks, 2, Hq, D)
        Kl = flats[il][0].astype(np.float32)
        for lb in range(-(-n // B)):
            keys = Kl[lb * B:min(n, (lb + 1) * B)]           # [valid, Hkv, D]
            for h in range(Hq):
                # fp16 keys: their max and min are fp16 values, stored exactly
                assert np.array_equal(an[bt[lb], 0, h], keys[:, h // G].max(axis=0))
                assert np.array_equal(an[bt[lb], 1, h], keys[:, h // G].min(axis=0))


def test_gqa_heads_read_their_kv_head():
    """Query heads of one group see the same keys; a different group sees its own."""
    rng = np.random.default_rng(3)
    Hkv, G, B, D, n = 2, 3, 4, 8, 10
    Kf = np.zeros((n, Hkv, D), np.float32)
    Vf = np.zeros((n, Hkv, D), np.float32)
    Vf[:, 0, :] = 1.0   # kv head 0 values are all 1
    Vf[:, 1, :] = -2.0  # kv head 1 values are all -2
    bt = np.array([2, 0, 1], np.int32)
    kc, vc = paged_from_flat(Kf, Vf, B, 3, bt, np.float32)
    q = rng.standard_normal((Hkv * G, D)).astype(np.float32)
    out = np.empty((Hkv * G, D), np.float32)
    attention_decode(q, kc, vc, bt, n, 1.0, 0, out)
    # convex combination of constant rows: exact up to float32 rounding of the weights
    np.testing.assert_allclose(out[:G], 1.0, atol=1e-6)
    np.testing.assert_allclose(out[G:], -2.0, atol=2e-6)


# --------------------------------------------------------------------------
# dense prefill / decode: Numba == NumPy reference == flat float64
# --------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["kernel", "tiled"])
@settings(max_examples=40, deadline=None)
@given(cache_case(), st.data())
def test_prefill_matches_references(path, c, data):
    n, Hq, D = c["n"], c["Hq"], c["D"]
    T = data.draw(st.integers(1, n))
    pos0 = n - T
    window = data.draw(st.sampled_from([0, 1, 3, 17, 1000]))
    scale = data.draw(st.sampled_from([1.0, 0.125, 0.7]))
    rng = c["rng"]
    q = (rng.standard_normal((T, Hq, D)) * 1.5).astype(np.float32)
    o_nb = np.full((T, Hq, D), np.nan, np.float32)
    o_np = np.empty((T, Hq, D), np.float32)
    with prefill_path(path):
        lse_nb = attention_prefill(q, c["kc"], c["vc"], c["bt"], pos0, scale, window, o_nb)
    lse_np = attention_prefill(q, c["kc"], c["vc"], c["bt"], pos0, scale, window, o_np,
                               backend="numpy")
    ref, _ = flat_attention64(q, c["Kf"], c["Vf"], pos0 + np.arange(T), scale, window)
    assert np.isfinite(o_nb).all()  # NaN padding never read
    # Numba vs NumPy: both float32, only summation order differs (|s| <~ 15, n <= 70)
    np.testing.assert_allclose(o_nb, o_np, rtol=0, atol=2e-5)
    np.testing.assert_allclose(lse_nb, lse_np, rtol=0, atol=2e-5)
    # vs float64 from the flat arrays (same fp16/f32 inputs): float32 accumulation only
    np.testing.assert_allclose(o_nb, ref, rtol=0, atol=5e-5)


@settings(max_examples=40, deadline=None)
@given(cache_case(max_n=120), st.data())
def test_decode_matches_references(c, data):
    n, Hq, D = c["n"], c["Hq"], c["D"]
    window = data.draw(st.sampled_from([0, 1, 5, 40]))
    nsplit = data.draw(st.sampled_from([None, 1, 2, 7]))
    rng = c["rng"]
    q = (rng.standard_normal((Hq, D)) * 1.5).astype(np.float32)
    o_nb = np.empty((Hq, D), np.float32)
    o_np = np.empty((Hq, D), np.float32)
    lse_nb = attention_decode(q, c["kc"], c["vc"], c["bt"], n, 0.3, window, o_nb, nsplit=nsplit)
    lse_np = attention_decode(q, c["kc"], c["vc"], c["bt"], n, 0.3, window, o_np, backend="numpy")
    ref, _ = flat_attention64(q[None], c["Kf"], c["Vf"], [n - 1], 0.3, window)
    assert np.isfinite(o_nb).all()
    # same reasoning as the prefill test; splits only reorder float32 sums
    np.testing.assert_allclose(o_nb, o_np, rtol=0, atol=2e-5)
    np.testing.assert_allclose(lse_nb, lse_np, rtol=0, atol=2e-5)
    np.testing.assert_allclose(o_nb, ref[0], rtol=0, atol=5e-5)


def test_softmax_exp_within_two_ulp():
    """The decode kernels' vectorized exp of softmax exponents (x <= 0) is within 2 ulp of the
    float64 value down to the smallest normal result (0.94 measured), 0 below it and at -inf,
    NaN for NaN."""
    import numba

    from pyimp.attention import kernels as K

    @numba.njit
    def ev(x):
        o = np.empty_like(x)
        for i in range(x.size):
            o[i] = K.exp_nonpos(x[i])
        return o

    x = -np.linspace(0, 87.3, 400001).astype(np.float32)
    got = ev(x).astype(np.float64)
    ref = np.exp(x.astype(np.float64))
    ulp = np.spacing(ref.astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got - ref) / ulp) <= 2.0
    special = ev(np.array([-np.inf, np.nan, 0.0, -0.0, -87.5, -1e30], np.float32))
    assert special[0] == 0 and np.isnan(special[1]) and special[2] == 1 and special[3] == 1
    assert special[4] == 0 and special[5] == 0


def test_decode_equals_last_prefill_row():
    rng = np.random.default_rng(7)
    Hkv, G, B, D, n = 2, 2, 8, 16, 45
    bt = rng.permutation(6).astype(np.int32)
    Kf = rng.standard_normal((n, Hkv, D)).astype(np.float16)
    Vf = rng.standard_normal((n, Hkv, D)).astype(np.float16)
    kc, vc = paged_from_flat(Kf, Vf, B, 6, bt, np.float16)
    q = rng.standard_normal((5, Hkv * G, D)).astype(np.float32)
    o_pre = np.empty((5, Hkv * G, D), np.float32)
    attention_prefill(q, kc, vc, bt, n - 5, 0.25, 0, o_pre)
    o_dec = np.empty((Hkv * G, D), np.float32)
    attention_decode(q[-1], kc, vc, bt, n, 0.25, 0, o_dec)
    # different kernels, same math: float32 reordering only
    np.testing.assert_allclose(o_dec, o_pre[-1], rtol=0, atol=1e-5)


def test_sliding_window_boundary_is_exclusive():
    """gemma: key masked iff p_q - p_k >= window. One key with a huge score sits exactly at distance
    window (masked) or window - 1 (visible)."""
    B, D, n, window = 4, 2, 12, 5
    Kf = np.zeros((n, 1, D), np.float32)
    Vf = np.zeros((n, 1, D), np.float32)
    bt = np.arange(3, dtype=np.int32)
    q = np.array([[10.0, 0.0]], np.float32)
    for dist, visible in [(window, False), (window - 1, True)]:
        Kf[:] = 0.0
        Vf[:] = 0.0
        p = n - 1 - dist
        Kf[p, 0, 0] = 10.0
        Vf[p, 0, 0] = 1.0
        kc, vc = paged_from_flat(Kf, Vf, B, 3, bt, np.float32)
        for backend in ["numba", "numpy"]:
            out = np.empty((1, D), np.float32)
            attention_decode(q, kc, vc, bt, n, 1.0, window, out, backend=backend)
            # score 100 vs 0: the hot key takes all but e^-100 of the mass when visible
            assert out[0, 0] == pytest.approx(1.0 if visible else 0.0, abs=1e-6)


# --------------------------------------------------------------------------
# importance mass through attention (section 4)
# --------------------------------------------------------------------------


def _mass(imp):
    return imp.astype(np.float64).sum(axis=(0, 1))  # per query head


@settings(max_examples=25, deadline=None)
@given(cache_case(), st.data())
def test_prefill_importance_conservation_chunked(c, data):
    """A prompt prefilled in chunks with obs_start = len - W adds min(W, len) per head."""
    n, Hq, D, B, NB = c["n"], c["Hq"], c["D"], c["B"], c["NB"]
    W = data.draw(st.integers(1, 80))
    window = data.draw(st.sampled_from([0, 3, 20]))
    cut = data.draw(st.integers(0, n - 1))  # chunk boundary: [0, cut), [cut, n)
    backend = data.draw(st.sampled_from(["numba", "numba-tiled", "numpy"]))
    rng = c["rng"]
    q = rng.standard_normal((n, Hq, D)).astype(np.float32)
    imp = np.zeros((NB, B, Hq), np.float16)
    obs_start = max(0, n - W)
    for a, b in [(0, cut), (cut, n)]:
        if b > a:
            out = np.empty((b - a, Hq, D), np.float32)
            with prefill_path("tiled" if backend == "numba-tiled" else "kernel"):
                attention_prefill(q[a:b], c["kc"], c["vc"], c["bt"], a, 0.4, window, out, imp,
                                  obs_start=obs_start, backend=backend.split("-")[0])
    # each observed row adds probabilities summing to 1 (float32, ~1e-6), and each of the
    # <= n entries is rounded once or twice to fp16 (relative 2**-11 each)
    expect = min(W, n)
    np.testing.assert_allclose(_mass(imp), expect, rtol=2 * 2**-11, atol=1e-4)
    # and the kernel distributes the mass like the float64 reference
    _, P = flat_attention64(q, c["Kf"], c["Vf"], np.arange(n), 0.4, window)
    ref = P[obs_start:].sum(axis=0)  # [Hq, n]
    got = np.stack([imp[c["bt"][p // B], p % B] for p in range(n)], axis=1).astype(np.float64)
    np.testing.assert_allclose(got, ref, rtol=2**-9, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(cache_case(), st.data())
def test_prefill_second_window_is_a_prefill_with_that_window(c, data):
    """importance2 / obs_start2 leave importance2 with the bits a call with importance and
    obs_start = obs_start2 leaves, and importance with those of a call without them, chunk by
    chunk, on every backend (the same sums over the same rows)."""
    n, Hq, D, B, NB = c["n"], c["Hq"], c["D"], c["B"], c["NB"]
    starts = [max(0, n - data.draw(st.integers(1, 80))) for _ in range(2)]
    window = data.draw(st.sampled_from([0, 3, 20]))
    cut = data.draw(st.integers(0, n - 1))
    backend = data.draw(st.sampled_from(["numba", "numba-tiled", "numpy"]))
    q = c["rng"].standard_normal((n, Hq, D)).astype(np.float32)
    both, second = np.zeros((NB, B, Hq), np.float16), np.zeros((NB, B, Hq), np.float16)
    alone = [np.zeros((NB, B, Hq), np.float16) for _ in starts]
    for a, b in [(0, cut), (cut, n)]:
        if b == a:
            continue
        out = np.empty((b - a, Hq, D), np.float32)
        args = (q[a:b], c["kc"], c["vc"], c["bt"], a, 0.4, window, out)
        with prefill_path("tiled" if backend == "numba-tiled" else "kernel"):
            attention_prefill(*args, both, obs_start=starts[0], importance2=second,
                              obs_start2=starts[1], backend=backend.split("-")[0])
            for imp, s0 in zip(alone, starts):
                attention_prefill(*args, imp, obs_start=s0, backend=backend.split("-")[0])
    assert np.array_equal(both, alone[0]) and np.array_equal(second, alone[1])
    assert second.any()
    with pytest.raises(ValueError, match="importance2 must be given with importance"):
        attention_prefill(*args, None, importance2=second, obs_start2=0)


@settings(max_examples=25, deadline=None)
@given(cache_case(max_n=100), st.data())
def test_decode_importance_adds_one_per_head(c, data):
    n, Hq, D, B, NB = c["n"], c["Hq"], c["D"], c["B"], c["NB"]
    window = data.draw(st.sampled_from([0, 4, 33]))
    rng = c["rng"]
    imp0 = rng.uniform(0, 3, (NB, B, Hq)).astype(np.float16)
    res = {}
    for backend in ["numba", "numpy"]:
        imp = imp0.copy()
        out = np.empty((Hq, D), np.float32)
        q = np.random.default_rng(1).standard_normal((Hq, D)).astype(np.float32)
        attention_decode(q, c["kc"], c["vc"], c["bt"], n, 0.5, window, out, imp, backend=backend)
        # <= 120 entries each rounded to fp16 (spacing 2**-9 below 4): |error| <= 120 * 2**-10
        np.testing.assert_allclose(_mass(imp) - _mass(imp0), 1.0, atol=n * 2**-10)
        res[backend] = imp
    # Numba and NumPy agree up to one fp16 rounding step per entry
    np.testing.assert_allclose(res["numba"].astype(np.float64), res["numpy"], rtol=2**-10,
                               atol=1e-7)


def test_masked_tokens_get_no_importance():
    rng = np.random.default_rng(11)
    Hkv, G, B, D, n, window = 1, 2, 4, 8, 23, 6
    bt = rng.permutation(7)[:6].astype(np.int32)
    Kf = rng.standard_normal((n, Hkv, D)).astype(np.float16)
    Vf = rng.standard_normal((n, Hkv, D)).astype(np.float16)
    kc, vc = paged_from_flat(Kf, Vf, B, 7, bt, np.float16)
    imp = np.zeros((7, B, Hkv * G), np.float16)
    out = np.empty((Hkv * G, D), np.float32)
    attention_decode(rng.standard_normal((Hkv * G, D)).astype(np.float32), kc, vc, bt, n, 1.0,
                     window, out, imp)
    pos_mass = np.array([imp[bt[p // B], p % B].astype(np.float64).sum() for p in range(n)])
    assert not pos_mass[:n - window].any()  # outside the window: exactly zero
    assert (pos_mass[n - window:] > 0).all()
