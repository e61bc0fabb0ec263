"""CUDA attention kernels vs the NumPy references of the CPU path (pyimp.attention,
pyimp.sparse): dense decode, block-sparse decode for every set granularity, prefill, and the
importance updates they feed. Caches are fp16 (and f32) with a permuted block table and a
partial tail block."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyimp.attention.attend import attention_decode_ref, attention_prefill_ref
from pyimp.cuda import attention as CA
from pyimp.cuda import device
from pyimp.attention.attend import add_block_mass, sparse_attention_decode_ref

# f32 sums over at most a few hundred terms in another order than NumPy's, exp of the GPU
# (or the simulator's NumPy) against NumPy's: outputs agree to ~1e-6 relative; 2e-5 absolute on
# values of order 1 leaves room without hiding a wrong block (which moves outputs by ~1e-1)
ATOL = 2e-5


def _cache(rng, Hkv, NB, B, D, dtype):
    k = rng.standard_normal((Hkv, NB, B * D)).astype(dtype)
    v = rng.standard_normal((Hkv, NB, D * B)).astype(dtype)
    return k, v


def _imp_close(got, want):
    """importance within one fp16 ulp: the per-entry P differs by the last bits of exp
    (GPU expf vs glibc), which can flip one rounding to fp16."""
    g, w = got.astype(np.float32), want.astype(np.float32)
    ulp = np.spacing(np.maximum(np.abs(g), np.abs(w)).astype(np.float16)).astype(np.float32)
    assert np.all(np.abs(g - w) <= ulp), np.max(np.abs(g - w) / ulp)


def _dev(*arrays):
    return [device.to_device(a) for a in arrays]


class _Poisoned(CA.Scratch):
    """Scratch whose float buffers start as NaN: a partial the kernels fail to write shows in
    the output instead of a value an earlier call left there."""

    def get(self, name, shape, dtype):
        b = self._bufs.get(name)
        fresh = b is None or b.shape != tuple(shape) or b.dtype != np.dtype(dtype)
        b = super().get(name, shape, dtype)
        if fresh and np.dtype(dtype).kind == "f":
            b.copy_to_device(np.full(shape, np.nan, dtype))
        return b


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("window", [0, 9])
def test_decode_dense_matches_reference(dtype, window):
    rng = np.random.default_rng(1)
    Hkv, G, D, B, NB = 2, 2, 16, 4, 9
    Hq = Hkv * G
    kc, vc = _cache(rng, Hkv, NB, B, D, dtype)
    bt = rng.permutation(NB).astype(np.int32)
    n_ctx = 27                                     # 6 full blocks + a tail of 3
    q = rng.standard_normal((Hq, D)).astype(np.float32)
    imp = (rng.random((NB, B, Hq)) * 3).astype(np.float16)
    want = np.empty((Hq, D), np.float32)
    imp_want = imp.copy()
    lse = attention_decode_ref(q, kc, vc, bt, n_ctx, 0.25, window, want, imp_want)
    dq, dk, dv, dbt, dimp = _dev(q[None], kc, vc, bt, imp)
    out = device.zeros((1, Hq, D), np.float32)
    M, L = CA.decode(dq, dk, dv, dbt, n_ctx, 0.25, window, out, importance=dimp, nsplit=3)
    np.testing.assert_allclose(device.to_host(out)[0], want, atol=ATOL, rtol=ATOL)
    got_lse = device.to_host(M)[0] + np.log(device.to_host(L)[0])
    np.testing.assert_allclose(got_lse, lse, atol=ATOL, rtol=ATOL)
    _imp_close(device.to_host(dimp), imp_want)


@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_decode_decay_matches_reference(decay):
    rng = np.random.default_rng(2)
    Hkv, G, D, B, NB = 1, 4, 8, 4, 6
    Hq = Hkv * G
    kc, vc = _cache(rng, Hkv, NB, B, D, np.float16)
    bt = rng.permutation(NB).astype(np.int32)
    n_ctx = 22
    q = rng.standard_normal((Hq, D)).astype(np.float32)
    imp = (rng.random((NB, B, Hq)) * 5).astype(np.float16)
    imp_want = imp.copy()
    attention_decode_ref(q, kc, vc, bt, n_ctx, 0.3, 0, np.empty((Hq, D), np.float32), imp_want,
                         decay)
    dq, dk, dv, dbt, dimp = _dev(q[None], kc, vc, bt, imp)
    CA.decode(dq, dk, dv, dbt, n_ctx, 0.3, 0, device.zeros((1, Hq, D), np.float32),
              importance=dimp, decay=decay)
    _imp_close(device.to_host(dimp), imp_want)


def test_importance_saturates_at_fp16_max():
    """Entries near the fp16 maximum clamp to 65504 instead of overflowing to inf."""
    rng = np.random.default_rng(3)
    Hkv, G, D, B, NB = 1, 2, 8, 4, 3
    kc, vc = _cache(rng, Hkv, NB, B, D, np.float16)
    bt = np.arange(NB, dtype=np.int32)
    imp = np.full((NB, B, G), 65504, np.float16)
    dq, dk, dv, dbt, dimp = _dev(rng.standard_normal((1, G, D)).astype(np.float32), kc, vc, bt, imp)
    CA.decode(dq, dk, dv, dbt, 10, 1.0, 0, device.zeros((1, G, D), np.float32), importance=dimp)
    got = device.to_host(dimp)
    assert np.isfinite(got.astype(np.float32)).all() and (got == np.float16(65504)).all()


def _selection(rng, nsets, n_lb, K):
    sel = np.full((nsets, K), -1, np.int32)
    cnt = np.zeros(nsets, np.int32)
    for si in range(nsets):
        c = int(rng.integers(1, K + 1))
        sel[si, :c] = rng.permutation(n_lb)[:c]
        cnt[si] = c
    return sel, cnt


@settings(deadline=None, max_examples=12)
@given(Hkv=st.sampled_from([1, 2]), G=st.sampled_from([1, 2, 4]),
       granularity=st.sampled_from(["layer", "kvhead", "qhead"]), seed=st.integers(0, 2**16),
       window=st.sampled_from([0, 7]), nsplit=st.sampled_from([1, 2]))
def test_sparse_decode_matches_reference(Hkv, G, granularity, seed, window, nsplit):
    """Block-sparse decode for LAYER / KVHEAD / QHEAD sets (the GQA mapping: query head h reads
    kv head h // G and set h // (Hq // nsets)), with the importance of the attended tokens."""
    rng = np.random.default_rng(seed)
    D, B, NB = 8, 4, 8
    Hq = Hkv * G
    nsets = {"layer": 1, "kvhead": Hkv, "qhead": Hq}[granularity]
    kc, vc = _cache(rng, Hkv, NB, B, D, np.float16)
    bt = rng.permutation(NB).astype(np.int32)
    n_ctx = int(rng.integers(B + 1, NB * B + 1))
    n_lb = -(-n_ctx // B)
    sel, cnt = _selection(rng, nsets, n_lb, min(n_lb, 4))
    q = rng.standard_normal((Hq, D)).astype(np.float32)
    imp = (rng.random((NB, B, Hq)) * 2).astype(np.float16)
    want = np.empty((Hq, D), np.float32)
    probs = np.empty((Hq, sel.shape[1], B), np.float32)
    lse = sparse_attention_decode_ref(q, kc, vc, bt, n_ctx, 0.5, window, sel, cnt, want, probs)
    imp_want = imp.copy()
    add_block_mass(imp_want, bt, sel, cnt, probs, n_ctx, 1.0, backend="numpy")
    dq, dk, dv, dbt, dsel, dcnt, dimp = _dev(q[None], kc, vc, bt, sel, cnt, imp)
    out = device.zeros((1, Hq, D), np.float32)
    M, L = CA.decode(dq, dk, dv, dbt, n_ctx, 0.5, window, out, sel=dsel, cnt=dcnt,
                     importance=dimp, nsplit=nsplit)
    got = device.to_host(out)[0]
    live = np.isfinite(lse)           # a set whose blocks the window hides entirely: out = 0
    np.testing.assert_allclose(got[live], want[live], atol=ATOL, rtol=ATOL)
    assert np.all(got[~live] == 0)
    l = device.to_host(L)[0]
    with np.errstate(divide="ignore"):        # log(0) for the hidden sets, masked out below
        got_lse = device.to_host(M)[0] + np.log(l)
    np.testing.assert_allclose(got_lse[live], lse[live], atol=ATOL, rtol=ATOL)
    _imp_close(device.to_host(dimp), imp_want)


def test_sparse_at_full_budget_equals_dense():
    """Every block selected, in a shuffled order: the dense result (docs/kvcache.md section 7)."""
    rng = np.random.default_rng(5)
    Hkv, G, D, B, NB = 2, 2, 8, 4, 7
    Hq = Hkv * G
    kc, vc = _cache(rng, Hkv, NB, B, D, np.float16)
    bt = rng.permutation(NB).astype(np.int32)
    n_ctx = 26
    q = rng.standard_normal((1, Hq, D)).astype(np.float32)
    sel = rng.permutation(7).astype(np.int32)[None]
    dq, dk, dv, dbt, dsel, dcnt = _dev(q, kc, vc, bt, sel, np.array([7], np.int32))
    dense = device.zeros((1, Hq, D), np.float32)
    sparse = device.zeros((1, Hq, D), np.float32)
    CA.decode(dq, dk, dv, dbt, n_ctx, 0.4, 0, dense)
    CA.decode(dq, dk, dv, dbt, n_ctx, 0.4, 0, sparse, sel=dsel, cnt=dcnt)
    np.testing.assert_allclose(device.to_host(sparse), device.to_host(dense), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("rows", [1, 4, None])
@pytest.mark.parametrize("window,obs_start", [(0, 0), (0, 9), (5, 4)])
def test_prefill_matches_reference(window, obs_start, rows):
    """Query rows tiled 1, 4 (the last tile partial) or tile_rows' 8 (2 heads a unit) to a
    work item: each row keeps its own causal and window mask inside the tile."""
    rng = np.random.default_rng(7)
    Hkv, G, D, B, NB = 2, 2, 8, 4, 6
    Hq = Hkv * G
    kc, vc = _cache(rng, Hkv, NB, B, D, np.float16)
    bt = rng.permutation(NB).astype(np.int32)
    pos0, T = 5, 9                               # a second chunk after 5 cached tokens
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    imp = (rng.random((NB, B, Hq)) * 2).astype(np.float16)
    want = np.empty((T, Hq, D), np.float32)
    imp_want = imp.copy()
    lse = attention_prefill_ref(q, kc, vc, bt, pos0, 0.35, window, want, imp_want, obs_start)
    dq, dk, dv, dbt, dimp = _dev(q, kc, vc, bt, imp)
    out = device.zeros((T, Hq, D), np.float32)
    if rows is None:
        assert CA.tile_rows(T, G, D, B, CA.THREADS) == 8
    M, L = CA.prefill(dq, dk, dv, dbt, pos0, 0.35, window, out, importance=dimp,
                      obs_start=obs_start, rows=rows, scratch=_Poisoned())
    np.testing.assert_allclose(device.to_host(out), want, atol=ATOL, rtol=ATOL)
    np.testing.assert_allclose(device.to_host(M) + np.log(device.to_host(L)), lse, atol=ATOL,
                               rtol=ATOL)
    _imp_close(device.to_host(dimp), imp_want)


def test_prefill_importance_conservation():
    """Each observed row's probabilities sum to 1: a fresh prefill adds min(W, T) per head."""
    rng = np.random.default_rng(8)
    Hkv, G, D, B, NB = 1, 2, 8, 4, 5
    Hq = Hkv * G
    kc, vc = _cache(rng, Hkv, NB, B, D, np.float16)
    bt = np.arange(NB, dtype=np.int32)
    T, W = 18, 6
    dq, dk, dv, dbt, dimp = _dev(rng.standard_normal((T, Hq, D)).astype(np.float32), kc, vc, bt,
                                 np.zeros((NB, B, Hq), np.float16))
    CA.prefill(dq, dk, dv, dbt, 0, 0.3, 0, device.zeros((T, Hq, D), np.float32),
               importance=dimp, obs_start=T - W, scratch=_Poisoned())
    tot = device.to_host(dimp).astype(np.float32).sum(axis=(0, 1))
    # T entries per head, each rounded to fp16 once (relative error <= 2**-11)
    np.testing.assert_allclose(tot, W, rtol=T * 2.0 ** -11)
