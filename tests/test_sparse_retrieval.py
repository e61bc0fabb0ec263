"""Block retrieval: scores == naive loop; LAYER/KVHEAD/QHEAD selection == a naive implementation."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pyimp.sparse.anchors import AnchorType, block_spans, compute_anchors, group_shared
from pyimp.sparse.anchors import anchor_slots
from pyimp.sparse.retrieval import (ORDERED_ANCHORS, RetrievalType, block_scores, n_sets,
                                    recent_blocks, retrieve_blocks, retrieve_unchecked,
                                    select_blocks, set_scores)


def naive_scores(q, anchor, bt, lb_start, lb_end, n_slots):
    """s[b, h] = sum_d max_a anchor[bt[b]][a][h][d] * q[h][d], float64, every head's own slot."""
    Hq, D = q.shape
    out = np.zeros((lb_end - lb_start, Hq))
    for i, lb in enumerate(range(lb_start, lb_end)):
        for h in range(Hq):
            out[i, h] = sum(max(float(anchor[bt[lb], a, h, d]) * float(q[h, d])
                                for a in range(n_slots)) for d in range(D))
    return out


def head_sets(rtype, Hq, Hkv):
    """The query heads of each set, straight from the definition."""
    G = Hq // Hkv
    return {RetrievalType.LAYER: [list(range(Hq))],
            RetrievalType.KVHEAD: [list(range(j * G, (j + 1) * G)) for j in range(Hkv)],
            RetrievalType.QHEAD: [[h] for h in range(Hq)]}[rtype]


def naive_set_scores(head_scores, rtype, Hkv):
    """float64 [C, nsets]: per-head scores summed over each set's heads."""
    sets = head_sets(rtype, head_scores.shape[1], Hkv)
    return np.stack([head_scores[:, hs].astype(np.float64).sum(axis=1) for hs in sets], axis=1)


def own_block_local(n_ctx, B, local):
    """The local count actually used: the query's own block (the last one, n_lb - 1) is always
    attended, so with local = 0 and no partial tail the last full block counts as local."""
    return 1 if local == 0 and n_ctx % B == 0 else local


def naive_select(set_sc, n_ctx, B, init, pick, local):
    """Per set: a sorted list of logical blocks, straight from the definition."""
    F = n_ctx // B
    n_lb = -(-n_ctx // B)
    result = []
    for si in range(set_sc.shape[1]):
        if F <= init + pick + local:
            result.append(list(range(n_lb)))
            continue
        loc = own_block_local(n_ctx, B, local)
        col = set_sc[:, si]
        assert len(col) == F - init - loc        # candidates: init .. F - loc - 1
        ranked = sorted(range(len(col)), key=lambda i: (-col[i], i))[:pick]
        chosen = set(range(init)) | {init + i for i in ranked} | set(range(F - loc, F))
        if n_ctx % B:
            chosen.add(F)
        result.append(sorted(chosen))
    return result


@st.composite
def select_case(draw, over_budget: bool = False):
    """(Hkv, G, B, n_ctx, init, pick, local, rng, ties); with ``over_budget`` only contexts of
    more full blocks than init + pick + local (retrieval selects; otherwise every block)."""
    Hkv = draw(st.integers(1, 3))
    G = draw(st.integers(1, 3))
    B = draw(st.sampled_from([1, 2, 4, 16]))
    if over_budget:
        init = draw(st.integers(0, 3))
        pick = draw(st.integers(0, 8))
        local = draw(st.integers(0, 3))
        n_ctx = draw(st.integers((init + pick + local + 1) * B, 40 * B))
    else:
        n_ctx = draw(st.integers(1, 40 * B))
        init = draw(st.integers(0, 3))
        pick = draw(st.integers(0, 8))
        local = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    ties = draw(st.booleans())
    return Hkv, G, B, n_ctx, init, pick, local, np.random.default_rng(seed), ties


@settings(max_examples=80, deadline=None)
@given(select_case(), st.sampled_from(list(RetrievalType)))
def test_selection_matches_naive(case, rtype):
    Hkv, G, B, n_ctx, init, pick, local, rng, ties = case
    Hq = Hkv * G
    F = n_ctx // B
    C = max(F - init - own_block_local(n_ctx, B, local), 0)
    nsets = n_sets(rtype, Hq, Hkv)
    scores = rng.standard_normal((C, nsets)).astype(np.float32)
    if ties:
        scores = np.round(scores).astype(np.float32)  # many equal scores: tie rule = lower block
    want = naive_select(scores, n_ctx, B, init, pick, local)
    n_lb = -(-n_ctx // B)
    for backend in ["numba", "numpy"]:
        sel, cnt = select_blocks(scores, n_ctx, B, init, pick, local, backend)
        assert sel.shape == (nsets, init + pick + local + 1) and sel.dtype == np.int32
        for si in range(nsets):
            got = sel[si, :cnt[si]].tolist()
            assert got == want[si]
            assert (sel[si, cnt[si]:] == -1).all()
            # always included: sinks, last local full blocks, and the query's own block
            must = set(range(min(init, F))) | set(range(max(F - local, 0), F)) | {n_lb - 1}
            assert must <= set(got)
            assert len(got) == min(n_lb, init + pick + own_block_local(n_ctx, B, local)
                                   + (1 if n_ctx % B else 0))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.sampled_from([1, 2, 3]), st.sampled_from([1, 4, 8]),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_scores_match_naive(Hkv, G, n_slots, D, shared, seed):
    rng = np.random.default_rng(seed)
    Hq = Hkv * G
    NB, nlb = 9, 7
    bt = rng.permutation(NB)[:nlb].astype(np.int32)
    anchor = (rng.standard_normal((NB, 3, Hq, D)) * 2).astype(np.float16)
    if shared:  # group-shared anchors: each kv head's value repeated into its G query heads
        anchor = np.repeat(anchor[:, :, ::G], G, axis=2)
    q = rng.standard_normal((Hq, D)).astype(np.float32)
    want = naive_scores(q, anchor, bt, 1, 6, n_slots)
    for backend in ["numba", "numpy"]:
        got = block_scores(q, anchor, bt, 1, 6, n_slots, G, shared, backend)
        # float32 sum of D <= 8 products of magnitude <~ 30: error < 1e-5
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    for backend in ["numba", "numpy"]:  # float32 anchors too
        got = block_scores(q, anchor.astype(np.float32), bt, 1, 6, n_slots, G, shared, backend)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


def test_shared_reads_only_the_group_leader():
    """With shared=True the non-leader slots are never read (fill them with NaN)."""
    rng = np.random.default_rng(5)
    Hkv, G, D = 2, 3, 4
    anchor = rng.standard_normal((4, 1, Hkv * G, D)).astype(np.float16)
    for h in range(Hkv * G):
        if h % G:
            anchor[:, :, h] = np.nan
    bt = np.arange(4, dtype=np.int32)
    q = rng.standard_normal((Hkv * G, D)).astype(np.float32)
    s = block_scores(q, anchor, bt, 0, 4, 1, G, True)
    assert np.isfinite(s).all()
    for nsets in (1, Hkv, Hkv * G):
        assert np.isfinite(set_scores(q, anchor, bt, 0, 4, nsets, 1, G, True)).all()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.sampled_from([1, 4, 16]),
       st.sampled_from(list(AnchorType)), st.sampled_from(list(RetrievalType)),
       st.integers(0, 2**31 - 1))
def test_set_scores_match_naive(Hkv, G, D, anchor_type, rtype, seed):
    """Fast (compressed-query) and fallback paths == per-head scores summed per set."""
    rng = np.random.default_rng(seed)
    Hq, B, NB, n_ctx = Hkv * G, 4, 12, 4 * 11 + 2
    bt = rng.permutation(NB).astype(np.int32)
    kc = (rng.standard_normal((Hkv, NB, B * D)) * 2).astype(np.float16)
    imp = rng.uniform(0, 2, (NB, B, Hq)).astype(np.float16)
    anchor = np.zeros((NB, 2, Hq, D), np.float16)
    compute_anchors(anchor_type, kc, *block_spans(bt, n_ctx, B), anchor, imp)
    q = rng.standard_normal((Hq, D)).astype(np.float32)
    slots = 2 if anchor_type in (AnchorType.QUEST, AnchorType.CUBOID_MEAN) else 1
    shared = anchor_type is not AnchorType.DYNAMIC
    ordered = slots == 2
    want = naive_set_scores(naive_scores(q, anchor, bt, 1, 10, slots), rtype, Hkv)
    nsets = n_sets(rtype, Hq, Hkv)
    mag = np.abs(q).sum() * np.abs(anchor.astype(np.float32)).max()  # >= |any set score|
    for backend in ["numba", "numpy"]:
        got = set_scores(q, anchor, bt, 1, 10, nsets, slots, G, shared, ordered, backend)
        assert got.shape == (9, nsets) and got.dtype == np.float32
        # float32 sums of <= Hq*D products in another order: error well below 1e-5 * magnitude
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * mag)


def _anchored(rng, anchor_type, Hkv, G, B, n_ctx, D, spare):
    """A shuffled block table (``spare`` physical blocks unused), anchors of ``anchor_type``
    over random fp16 keys and importance, and a float32 query [Hkv*G, D]."""
    Hq, n_lb = Hkv * G, -(-n_ctx // B)
    NB = n_lb + spare
    bt = rng.permutation(NB)[:n_lb].astype(np.int32)
    kc = rng.standard_normal((Hkv, NB, B * D)).astype(np.float16)
    imp = rng.uniform(0, 2, (NB, B, Hq)).astype(np.float16)
    anchor = np.zeros((NB, 2, Hq, D), np.float16)
    compute_anchors(anchor_type, kc, *block_spans(bt, n_ctx, B), anchor, imp)
    return bt, anchor, rng.standard_normal((Hq, D)).astype(np.float32)


@settings(max_examples=30, deadline=None)
@given(select_case(), st.sampled_from(list(RetrievalType)),
       st.sampled_from([AnchorType.QUEST, AnchorType.BLOCK_MEAN, AnchorType.DYNAMIC,
                        AnchorType.CUBOID_MEAN]))
def test_retrieve_end_to_end(case, rtype, anchor_type):
    """Anchors -> set scores -> selection: sinks, local and tail present, and the picked blocks
    are a top-pick of the naive float64 set scores (up to float32 rounding)."""
    Hkv, G, B, n_ctx, init, pick, local, rng, _ = case
    Hq = Hkv * G
    n_lb = -(-n_ctx // B)
    bt, anchor, q = _anchored(rng, anchor_type, Hkv, G, B, n_ctx, D=4, spare=1)
    F = n_ctx // B
    loc = own_block_local(n_ctx, B, local)
    slots = 2 if anchor_type in (AnchorType.QUEST, AnchorType.CUBOID_MEAN) else 1
    naive = naive_set_scores(naive_scores(q, anchor, bt, init, max(F - loc, init), slots),
                             rtype, Hkv)
    for backend in ["numba", "numpy"]:
        sel, cnt = retrieve_blocks(q, anchor, bt, n_ctx, B, Hkv, rtype, init, pick, local,
                                   anchor_type, backend)
        for si in range(n_sets(rtype, Hq, Hkv)):
            got = sel[si, :cnt[si]].tolist()
            if F <= init + pick + local:
                assert got == list(range(n_lb))
                continue
            must = set(range(init)) | set(range(F - loc, F)) | ({F} if n_ctx % B else set())
            assert n_lb - 1 in must                  # the query's own block
            assert must <= set(got) and len(got) == len(must) + pick
            picked = [b - init for b in got if init <= b < F - loc]
            rest = np.setdiff1d(np.arange(F - loc - init), picked)
            if rest.size and picked:
                # every picked block scores at least as high as every unpicked one, up to the
                # float32 rounding of a sum of <= Hq*D terms
                tol = 1e-5 * (np.abs(naive).max() + 1.0)
                assert naive[picked, si].min() >= naive[rest, si].max() - tol


@settings(max_examples=40, deadline=None)
@given(select_case(over_budget=True), st.sampled_from(list(RetrievalType)),
       st.sampled_from(list(AnchorType)))
def test_unchecked_retrieval_is_the_checked_chain(case, rtype, anchor_type):
    """retrieve_unchecked (the sparse decode step's path) gives exactly what the checked public
    chain set_scores -> select_blocks gives, for every anchor type (group-shared scoring kernel
    and per-head block scores alike) and set kind, whenever the context exceeds the budget
    (within it retrieve_blocks returns every block without retrieval: not drawn here)."""
    Hkv, G, B, n_ctx, init, pick, local, rng, _ = case
    assert n_ctx // B > init + pick + local
    Hq = Hkv * G
    bt, anchor, q = _anchored(rng, anchor_type, Hkv, G, B, n_ctx, D=8, spare=2)
    nsets = n_sets(rtype, Hq, Hkv)
    lb_end = n_ctx // B - recent_blocks(n_ctx, B, local)
    scores = set_scores(q, anchor, bt, init, lb_end, nsets, anchor_slots(anchor_type, 2), G,
                        group_shared(anchor_type), anchor_type in ORDERED_ANCHORS)
    want = select_blocks(scores, n_ctx, B, init, pick, local)
    got = retrieve_unchecked(q, anchor, bt, n_ctx, B, nsets, G, init, pick, local, anchor_type)
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and np.array_equal(g, w)
    # the checked entry point takes the same path
    for w, g in zip(want, retrieve_blocks(q, anchor, bt, n_ctx, B, Hkv, rtype, init, pick, local,
                                          anchor_type)):
        assert np.array_equal(g, w)


def test_layer_picks_the_hot_block():
    """A block whose keys align with q outranks the others; the dense fallback returns all."""
    rng = np.random.default_rng(0)
    Hkv, G, B, D, n_ctx = 2, 2, 4, 8, 4 * 20 + 3
    n_lb = -(-n_ctx // B)
    bt = rng.permutation(n_lb).astype(np.int32)
    kc = (rng.standard_normal((Hkv, n_lb, B * D)) * 0.1).astype(np.float16)
    q = rng.standard_normal((Hkv * G, D)).astype(np.float32)
    q[1::2] = q[0::2]  # heads of a group share a direction
    hot = 9
    for j in range(Hkv):
        kc[j, bt[hot]] = np.tile(q[j * G] * 3, B).astype(np.float16)
    anchor = np.zeros((n_lb, 2, Hkv * G, D), np.float16)
    compute_anchors(AnchorType.QUEST, kc, *block_spans(bt, n_ctx, B), anchor)
    sel, cnt = retrieve_blocks(q, anchor, bt, n_ctx, B, Hkv, RetrievalType.LAYER, 1, 1, 1,
                               AnchorType.QUEST)
    assert sel[0, :cnt[0]].tolist() == [0, hot, 19, 20]
    sel, cnt = retrieve_blocks(q, anchor, bt, n_ctx, B, Hkv, RetrievalType.LAYER, 8, 8, 4,
                               AnchorType.QUEST)
    assert sel[0, :cnt[0]].tolist() == list(range(n_lb))  # F = 20 <= 8 + 8 + 4: dense


def test_selection_large_sets_match_naive():
    """Enough work for the parallel selection path (nsets * candidates >= 16384), with ties."""
    # (QHEAD: 8 sets x 3992 candidates; LAYER and KVHEAD take the serial path)
    rng = np.random.default_rng(12)
    Hkv, G, B = 2, 4, 2
    n_ctx = 2 * 4000 + 1
    init, pick, local = 3, 500, 5
    F = n_ctx // B
    for rtype in RetrievalType:
        nsets = n_sets(rtype, Hkv * G, Hkv)
        scores = np.round(rng.standard_normal((F - init - local, nsets)) * 4).astype(np.float32)
        want = naive_select(scores, n_ctx, B, init, pick, local)
        sel, cnt = select_blocks(scores, n_ctx, B, init, pick, local)
        assert [sel[i, :cnt[i]].tolist() for i in range(nsets)] == want


@settings(deadline=None, max_examples=150)
@given(st.integers(1, 400), st.sampled_from([1, 4, 16]), st.integers(0, 3), st.integers(0, 3),
       st.integers(1, 3), st.floats(0.05, 1.0), st.integers(0, 6), st.integers(0, 30),
       st.integers(0, 2**31 - 1))
def test_recall_target_selection(n_ctx, B, init, local, nsets, target, floor, ceiling, seed):
    """Forced blocks always; candidates in estimated-mass order; the smallest prefix of that
    order whose estimate reaches the target, within the floor and ceiling; the estimate is
    the selected share of the estimated mass."""
    from pyimp.sparse.retrieval import estimated_mass, recent_blocks, select_for_recall
    rng = np.random.default_rng(seed)
    n_lb = -(-n_ctx // B)
    F = n_ctx // B
    logits = (rng.standard_normal((n_lb, 2 * nsets)) * 4).astype(np.float32)   # 2 heads a set
    sel, cnt, est = select_for_recall(logits, n_ctx, B, init, local, 2, 0.5, target, floor,
                                      ceiling)
    n_valid = np.minimum(B, n_ctx - np.arange(n_lb) * B)
    w = estimated_mass(logits, 2, 0.5, n_valid)
    assert w.shape == (n_lb, nsets)
    np.testing.assert_allclose(w.sum(axis=0), 1.0, rtol=1e-12)
    forced = set(range(min(init, n_lb))) | set(range(max(F - recent_blocks(n_ctx, B, local), 0),
                                                     n_lb))
    cand = [b for b in range(n_lb) if b not in forced]
    for si in range(nsets):
        chosen = sel[si, :cnt[si]]
        assert np.all(np.diff(chosen) > 0) and np.all(sel[si, cnt[si]:] == -1)
        assert forced <= set(chosen.tolist())
        picked = [b for b in chosen.tolist() if b not in forced]
        k = len(picked)
        ceil = len(cand) if ceiling <= 0 else min(ceiling, len(cand))
        assert min(floor, ceil) <= k <= ceil
        # the picked are the k heaviest candidates
        order = sorted(cand, key=lambda b: (-w[b, si], b))
        assert set(picked) == set(order[:k])
        total = w[:, si].sum()
        got = w[chosen, si].sum() / total
        assert est[si] == pytest.approx(got, rel=1e-9)
        if k < ceil:
            assert got >= target * (1 - 1e-9)
        if k > max(floor, 0):                       # one fewer would miss the target
            assert (w[chosen, si].sum() - w[order[k - 1], si]) / total < target


@settings(deadline=None, max_examples=60)
@given(st.integers(1, 200), st.sampled_from([1, 4, 8]), st.sampled_from([(1, 1), (1, 4), (2, 2)]),
       st.sampled_from(list(AnchorType)), st.integers(0, 2**31 - 1))
def test_estimated_mass_is_exact_for_constant_blocks(n_ctx, B, heads, atype, seed):
    """When every key of a block is the same vector, the block's centre is that key for every
    anchor type, and the estimate is each head's true softmax mass per block (from the keys,
    in float64), averaged over the set's heads. The GQA mapping and the partial tail are
    exercised; f16-exact keys, so the anchors round nothing."""
    from pyimp.sparse.retrieval import block_center_logits, estimated_mass
    Hkv, G = heads
    Hq, D, A = Hkv * G, 8, 2
    rng = np.random.default_rng(seed)
    nb = -(-n_ctx // B)
    kb = (np.round(rng.standard_normal((nb, Hkv, D)) * 8) / 8).astype(np.float16)
    K = np.repeat(kb, B, axis=0)[:n_ctx]                        # [n, Hkv, D]
    kc = np.zeros((Hkv, nb * B, D), np.float16)
    kc[:, :n_ctx] = K.transpose(1, 0, 2)
    kc = kc.reshape(Hkv, nb, B * D)                             # [Hkv][NB][B*D]
    nv = np.minimum(B, n_ctx - np.arange(nb) * B)
    anchor = np.zeros((nb, A, Hkv if group_shared(atype) else Hq, D), np.float16)
    compute_anchors(atype, kc, np.arange(nb), nv, anchor,
                    (rng.random((nb, B, Hq)) + 0.5).astype(np.float16))
    q = rng.standard_normal((Hq, D)).astype(np.float32)
    bt = np.arange(nb, dtype=np.int32)
    logits = block_center_logits(q, anchor, bt, nv, atype, G)
    scale = 0.3
    true_logit = scale * np.einsum("hd,nhd->hn", q.astype(np.float64),
                                   K[:, np.arange(Hq) // G].astype(np.float64))   # [Hq, n]
    m = np.exp(true_logit - true_logit.max(axis=1, keepdims=True))
    block_mass = np.add.reduceat(m, np.arange(0, n_ctx, B), axis=1)            # [Hq, nb]
    share = (block_mass / block_mass.sum(axis=1, keepdims=True)).T             # [nb, Hq]
    for hps in (1, G):
        want = share.reshape(nb, Hq // hps, hps).mean(axis=2)
        # float32 dot products of the centre (a few ulps of |q||k| ~ 1e-5 in the logit)
        np.testing.assert_allclose(estimated_mass(logits, hps, scale, nv), want, rtol=1e-4,
                                   atol=1e-9)
    # merged slots: a block standing for mult times its tokens weighs mult times as much
    mult = rng.integers(1, 4, nb)
    bm = block_mass * mult
    want = (bm / bm.sum(axis=1, keepdims=True)).T.reshape(nb, Hq // G, G).mean(axis=2)
    np.testing.assert_allclose(estimated_mass(logits, G, scale, nv * mult), want, rtol=1e-4,
                               atol=1e-9)
