"""Block-sparse decode: == dense when all blocks are selected (any order); LSE merge algebra;
importance on attended tokens only; attention recall."""
import numpy as np
from hypothesis import given, settings, strategies as st

from pyimp.attention.attend import attention_decode
from pyimp.attention.attend import block_partial, merge_partials, sparse_attention_decode


@st.composite
def sparse_case(draw):
    Hkv = draw(st.integers(1, 3))
    G = draw(st.sampled_from([1, 2, 3, 4, 8]))       # 1, 2, 4, 8: grouped decode (fp16, B % 16 == 0)
    B = draw(st.sampled_from([1, 2, 4, 8, 16, 32]))
    D = draw(st.sampled_from([1, 4, 16, 64]))
    n_ctx = draw(st.integers(1, 12 * B))
    dtype = draw(st.sampled_from([np.float16, np.float32]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    n_lb = -(-n_ctx // B)
    NB = n_lb + 2
    bt = rng.permutation(NB)[:n_lb].astype(np.int32)
    kc = rng.standard_normal((Hkv, NB, B * D)).astype(dtype)
    vc = rng.standard_normal((Hkv, NB, D * B)).astype(dtype)
    # stale data past the tail must never be read
    tail = n_ctx - (n_lb - 1) * B
    K4 = kc.reshape(Hkv, NB, B, D)
    K4[:, bt[-1], tail:] = np.nan
    V4 = vc.reshape(Hkv, NB, D, B)
    V4[:, bt[-1], :, tail:] = np.nan
    q = (rng.standard_normal((Hkv * G, D)) * 1.5).astype(np.float32)
    return dict(Hkv=Hkv, G=G, Hq=Hkv * G, B=B, D=D, n_ctx=n_ctx, n_lb=n_lb, NB=NB, bt=bt, kc=kc,
                vc=vc, q=q, rng=rng)


def _all_blocks(c, nsets, extra=2):
    """Every logical block in each set, each set in its own random order."""
    sel = np.full((nsets, c["n_lb"] + extra), -1, np.int32)
    for i in range(nsets):
        sel[i, :c["n_lb"]] = c["rng"].permutation(c["n_lb"])
    return sel, np.full(nsets, c["n_lb"], np.int32)


@settings(max_examples=50, deadline=None)
@given(sparse_case(), st.data())
def test_all_blocks_selected_equals_dense(c, data):
    Hq, D = c["Hq"], c["D"]
    nsets = data.draw(st.sampled_from([1, c["Hkv"], Hq]))
    window = data.draw(st.sampled_from([0, 0, 3, 20]))
    nsplit = data.draw(st.sampled_from([None, 1, 3]))
    sel, cnt = _all_blocks(c, nsets)
    args = (c["q"], c["kc"], c["vc"], c["bt"], c["n_ctx"], 0.35, window)
    o_dense = np.empty((Hq, D), np.float32)
    lse_dense = attention_decode(*args, o_dense)
    vmax = np.nanmax(np.abs(c["vc"].astype(np.float32)))
    for backend in ["numba", "numpy"]:
        o = np.empty((Hq, D), np.float32)
        lse, _ = sparse_attention_decode(*args, sel, cnt, o, nsplit=nsplit, backend=backend)
        assert np.isfinite(o).all()
        # outputs are convex combinations of V rows: compare relative to max|V|; float32
        # accumulation over <= 192 tokens in a different order stays within 1e-6 of it
        assert np.abs(o - o_dense).max() <= 1e-6 * vmax
        np.testing.assert_allclose(lse, lse_dense, rtol=1e-6, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(sparse_case(), st.data())
def test_subset_numba_equals_reference(c, data):
    """Different block sets per head (QHEAD / KVHEAD / LAYER) and window: Numba == NumPy."""
    Hq, D, n_lb = c["Hq"], c["D"], c["n_lb"]
    nsets = data.draw(st.sampled_from([1, c["Hkv"], Hq]))
    window = data.draw(st.sampled_from([0, 5]))
    rng = c["rng"]
    K = n_lb + 1
    sel = np.full((nsets, K), -1, np.int32)
    cnt = np.zeros(nsets, np.int32)
    for i in range(nsets):
        k = int(rng.integers(1, n_lb + 1))
        sel[i, :k] = np.sort(rng.choice(n_lb, k, replace=False))
        sel[i, k - 1] = n_lb - 1 if n_lb - 1 not in sel[i, :k] else sel[i, k - 1]
        sel[i, :k] = np.sort(sel[i, :k])
        cnt[i] = k
    args = (c["q"], c["kc"], c["vc"], c["bt"], c["n_ctx"], 0.35, window, sel, cnt)
    outs, lses, imps = [], [], []
    for backend in ["numba", "numpy"]:
        o = np.empty((Hq, D), np.float32)
        imp = np.zeros((c["NB"], c["B"], Hq), np.float16)
        lse, _ = sparse_attention_decode(*args, o, importance=imp, backend=backend)
        outs.append(o)
        lses.append(lse)
        imps.append(imp)
    # float32, summation order only; max|V| ~ 4 for unit normals
    np.testing.assert_allclose(outs[0], outs[1], rtol=0, atol=2e-5)
    np.testing.assert_allclose(lses[0], lses[1], rtol=0, atol=2e-5)
    # one fp16 rounding step of difference at most
    np.testing.assert_allclose(imps[0].astype(np.float64), imps[1], rtol=2**-10, atol=1e-7)


def test_block_order_does_not_matter():
    rng = np.random.default_rng(2)
    Hkv, G, B, D, n = 2, 4, 8, 32, 8 * 30 + 5
    NB = 31
    bt = rng.permutation(NB).astype(np.int32)
    kc = (rng.standard_normal((Hkv, NB, B * D)) * 2).astype(np.float16)
    vc = rng.standard_normal((Hkv, NB, D * B)).astype(np.float16)
    q = rng.standard_normal((Hkv * G, D)).astype(np.float32)
    ref = None
    for _ in range(4):
        sel = rng.permutation(NB)[None].astype(np.int32)
        o = np.empty((Hkv * G, D), np.float32)
        sparse_attention_decode(q, kc, vc, bt, n, 0.2, 0, sel, np.array([NB], np.int32), o)
        if ref is None:
            ref = o
        # |V| <= ~4.5: float32 reordering error ~1e-7 relative
        assert np.abs(o - ref).max() <= 1e-6 * 4.5


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=3, max_size=3), st.integers(1, 8),
       st.integers(0, 2**31 - 1), st.sampled_from([1.0, 30.0]))
def test_lse_merge_associative_and_exact(sizes, D, seed, spread):
    """merge is associative and commutative, and equals the partial of the concatenated block."""
    rng = np.random.default_rng(seed)
    blocks = [((rng.standard_normal(n) * spread).astype(np.float32),
               rng.standard_normal((n, D)).astype(np.float32)) for n in sizes]
    if rng.integers(2):  # a fully masked block is the identity
        blocks[1] = (np.full(sizes[1], -np.inf, np.float32), blocks[1][1])
    a, b, c = (block_partial(s, v) for s, v in blocks)
    left = merge_partials(merge_partials(a, b), c)
    right = merge_partials(a, merge_partials(b, c))
    swapped = merge_partials(c, merge_partials(b, a))
    whole = block_partial(np.concatenate([x[0] for x in blocks]),
                          np.concatenate([x[1] for x in blocks]))
    for other in (right, swapped, whole):
        assert left[0] == other[0]  # the max is exact
        # float32: a few roundings of exp and of sums of <= 18 terms
        np.testing.assert_allclose(left[1], other[1], rtol=1e-5)
        np.testing.assert_allclose(left[2] / left[1], other[2] / other[1], rtol=0, atol=1e-5)


def test_merge_survives_large_scores():
    """Scores of 1e4: unstabilized exp overflows, the max-stabilized merge does not."""
    v = np.ones((1, 2), np.float32)
    a = block_partial(np.array([1e4], np.float32), v)
    b = block_partial(np.array([1e4 - 1], np.float32), 2 * v)
    m, l, o = merge_partials(a, b)
    w = 1 / (1 + np.exp(-1.0))
    np.testing.assert_allclose(o / l, w * 1 + (1 - w) * 2, rtol=1e-6)
    assert m == np.float32(1e4)


@settings(max_examples=100, deadline=None)
@given(sparse_case(), st.data())
def test_importance_only_on_attended_tokens_and_sums_to_one(c, data):
    Hq, D, B, n_lb, n_ctx = c["Hq"], c["D"], c["B"], c["n_lb"], c["n_ctx"]
    rng = c["rng"]
    nsets = data.draw(st.sampled_from([1, c["Hkv"], Hq]))
    k = int(rng.integers(1, n_lb + 1))
    sel = np.full((nsets, n_lb), -1, np.int32)
    cnt = np.full(nsets, k, np.int32)
    for i in range(nsets):
        sel[i, :k] = np.sort(rng.choice(n_lb, k, replace=False))
    imp = np.zeros((c["NB"], B, Hq), np.float16)
    o = np.empty((Hq, D), np.float32)
    _, rec = sparse_attention_decode(c["q"], c["kc"], c["vc"], c["bt"], n_ctx, 0.35, 0, sel, cnt,
                                     o, importance=imp, recall=True)
    hps = Hq // nsets
    for h in range(Hq):
        chosen = set(sel[h // hps, :k].tolist())
        for lb in range(n_lb):
            vals = imp[c["bt"][lb], :min(B, n_ctx - lb * B), h]
            if lb not in chosen:
                assert not vals.any()  # unattended: exactly zero
        # the sparse softmax renormalizes: the attended mass is 1 per head. Rounding each
        # probability p to fp16 errs by <= 2**-11 * p (normal range) or 2**-25 (subnormal), so
        # the sum errs by <= 2**-11 * 1 + n_ctx * 2**-25; the float32 probabilities themselves
        # sum to 1 within ~n_ctx * 2**-23
        tol = 2**-11 + n_ctx * (2**-25 + 2**-23)
        assert abs(imp[..., h].astype(np.float64).sum() - 1.0) <= tol
    # recall = dense softmax mass inside the selected blocks
    imp_dense = np.zeros((c["NB"], B, Hq), np.float32)
    o_d = np.empty((Hq, D), np.float32)
    imp16 = np.zeros((c["NB"], B, Hq), np.float16)
    attention_decode(c["q"], c["kc"], c["vc"], c["bt"], n_ctx, 0.35, 0, o_d, imp16)
    imp_dense[:] = imp16
    for h in range(Hq):
        chosen = sel[h // hps, :k]
        mass = sum(imp_dense[c["bt"][lb], :, h].sum() for lb in chosen)
        # mass: dense probabilities rounded to fp16 (relative 2**-11, subnormals 2**-25 each) and
        # summed in float32; rec = exp(lse_sparse - lse_dense) of two float32 log-sum-exps of
        # |lse| <~ 20 (scores <= 0.35 * 1.5 * 4 * 3 * sqrt(64)): ~2 * 20 * 2**-24 <= 3e-6
        tol = 2**-11 * mass + n_ctx * (2**-25 + 2**-23) + 3e-6
        assert abs(rec[h] - mass) <= tol
        assert 0.0 < rec[h] <= 1.0 + 1e-6


def test_recall_is_one_with_every_block():
    rng = np.random.default_rng(4)
    Hkv, G, B, D, n = 1, 2, 4, 8, 37
    n_lb = 10
    bt = rng.permutation(n_lb).astype(np.int32)
    kc = rng.standard_normal((Hkv, n_lb, B * D)).astype(np.float16)
    vc = rng.standard_normal((Hkv, n_lb, D * B)).astype(np.float16)
    q = rng.standard_normal((Hkv * G, D)).astype(np.float32)
    sel = np.arange(n_lb, dtype=np.int32)[None]
    o = np.empty((Hkv * G, D), np.float32)
    _, rec = sparse_attention_decode(q, kc, vc, bt, n, 0.3, 0, sel, np.array([n_lb], np.int32), o,
                                     recall=True)
    np.testing.assert_allclose(rec, 1.0, atol=2e-6)  # exp of an LSE difference ~1e-7


def test_sparse_decay_path():
    """decay != 1: every valid token decays, attended ones gain their probability."""
    rng = np.random.default_rng(8)
    Hkv, G, B, D, n = 1, 2, 4, 4, 14
    n_lb = 4
    bt = np.array([3, 1, 0, 2], np.int32)
    kc = rng.standard_normal((Hkv, 4, B * D)).astype(np.float16)
    vc = rng.standard_normal((Hkv, 4, D * B)).astype(np.float16)
    q = rng.standard_normal((Hkv * G, D)).astype(np.float32)
    sel = np.array([[0, 3, -1]], np.int32)
    cnt = np.array([2], np.int32)
    for backend in ["numba", "numpy"]:
        imp = np.full((4, B, Hkv * G), 4.0, np.float16)
        o = np.empty((Hkv * G, D), np.float32)
        sparse_attention_decode(q, kc, vc, bt, n, 0.5, 0, sel, cnt, o, importance=imp, decay=0.5,
                                backend=backend)
        for lb in (1, 2):  # unattended blocks: 4 * 0.5
            assert (imp[bt[lb]] == 2.0).all()
        total = sum(imp[bt[lb], :min(B, n - lb * B)].astype(np.float64).sum(axis=0)
                    for lb in (0, 3))
        # 6 attended tokens at 2 + p each: 12 + 1 per head, fp16 spacing 2**-9 near 2
        np.testing.assert_allclose(total, 13.0, atol=6 * 2**-10)
        assert (imp[bt[3], 2:] == 4.0).all()  # positions past n_ctx untouched
