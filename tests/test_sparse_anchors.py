"""Anchors: every type == a naive per-block loop; QUEST bound; CUBOID box; GQA slots."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pyimp.sparse.anchors import (AnchorType, anchor_slots, block_spans, compute_anchors,
                                  group_shared)
from pyimp.sparse.retrieval import block_scores
from pyimp.testing import suite


def _up(x):
    """Smallest fp16 >= x (scalar)."""
    y = np.float16(x)
    return np.nextafter(y, np.float16(np.inf)) if float(y) < x else y


def _down(x):
    y = np.float16(x)
    return np.nextafter(y, np.float16(-np.inf)) if float(y) > x else y


def naive_anchor(anchor_type, keys, imp_h, A, B):
    """One block, one query head. keys: float64 [n_valid, D] of the head's kv head;
    imp_h: float [n_valid] importance of this head. Returns fp16 [A, D]."""
    n, D = keys.shape
    out = np.zeros((A, D), np.float16)
    if anchor_type is AnchorType.BLOCK_MEAN:
        vec = [sum(keys[t, d] for t in range(n)) / n for d in range(D)]
        return np.array([vec] * A, np.float16)
    if anchor_type is AnchorType.BLOCK_MAX:
        vec = [max([-np.inf] + [keys[t, d] for t in range(n)]) for d in range(D)]
        return np.array([vec] * A, np.float16)
    if anchor_type is AnchorType.FIXED:
        pos = sorted({a * B // A for a in range(A)})
        pos = [p for p in pos if p < n]
        vec = [sum(keys[p, d] for p in pos) / len(pos) for d in range(D)]
        return np.array([vec] * A, np.float16)
    if anchor_type is AnchorType.DYNAMIC:
        order = sorted(range(n), key=lambda t: (-imp_h[t], t))[:A]
        vec = [sum(keys[t, d] for t in order) for d in range(D)]
        return np.array([vec] * A, np.float16)
    hi = [max(keys[t, d] for t in range(n)) for d in range(D)]
    lo = [min(keys[t, d] for t in range(n)) for d in range(D)]
    if anchor_type is AnchorType.QUEST:
        up, dn = [_up(x) for x in hi], [_down(x) for x in lo]
    else:  # CUBOID_MEAN
        c = [(hi[d] + lo[d]) / 2 for d in range(D)]
        r = [sum(abs(keys[t, d] - c[d]) for t in range(n)) / n for d in range(D)]
        up = [_up(c[d] + r[d]) for d in range(D)]
        dn = [_down(c[d] - r[d]) for d in range(D)]
    out[0], out[1] = up, dn
    for a in range(2, A):
        out[a] = up
    return out


@st.composite
def anchor_case(draw, min_full_blocks: int = 0):
    """A paged key cache of n_ctx tokens (at least ``min_full_blocks`` full blocks)."""
    Hkv = draw(st.integers(1, 3))
    G = draw(st.integers(1, 3))
    B = draw(st.sampled_from([1, 2, 4, 8, 16]))
    D = draw(st.sampled_from([1, 4, 8]))
    A = draw(st.integers(1, 4))
    n_ctx = draw(st.integers(max(1, min_full_blocks * B), 5 * B))
    dtype = draw(st.sampled_from([np.float16, np.float32]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    n_lb = -(-n_ctx // B)
    NB = n_lb + 2
    bt = rng.permutation(NB)[:n_lb].astype(np.int32)
    kc = (rng.standard_normal((Hkv, NB, B * D)) * 3).astype(dtype)
    # importance with ties (integers) so the tie rule is exercised
    imp = rng.integers(0, 4, (NB, B, Hkv * G)).astype(np.float16)
    return dict(Hkv=Hkv, G=G, Hq=Hkv * G, B=B, D=D, A=A, n_ctx=n_ctx, bt=bt, kc=kc, imp=imp,
                NB=NB, rng=rng)


@settings(max_examples=60, deadline=None)
@given(anchor_case(), st.sampled_from(list(AnchorType)))
def test_anchor_types_match_naive_loop(c, anchor_type):
    A = max(c["A"], 2) if anchor_type in (AnchorType.QUEST, AnchorType.CUBOID_MEAN) else c["A"]
    B, D, G, Hq = c["B"], c["D"], c["G"], c["Hq"]
    anchor = np.full((c["NB"], A, Hq, D), np.nan, np.float16)
    phys, n_valid = block_spans(c["bt"], c["n_ctx"], B)
    compute_anchors(anchor_type, c["kc"], phys, n_valid, anchor, c["imp"])
    for pb, nv in zip(phys, n_valid):
        for h in range(Hq):
            keys = c["kc"][h // G, pb].astype(np.float64).reshape(B, D)[:nv]
            want = naive_anchor(anchor_type, keys, c["imp"][pb, :nv, h].astype(np.float64), A, B)
            got = anchor[pb, :, h]
            if anchor_type in (AnchorType.BLOCK_MAX, AnchorType.QUEST):
                # pure selection of cache values (plus directed rounding): exact
                assert np.array_equal(got, want)
            else:
                # sums: float32 vs float64 accumulation may move the fp16 result by one ulp
                np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                           rtol=2**-10, atol=2**-24)
    # blocks not listed are untouched
    rest = np.setdiff1d(np.arange(c["NB"]), phys)
    assert np.isnan(anchor[rest].astype(np.float32)).all()


@settings(max_examples=40, deadline=None)
@given(anchor_case(), st.sampled_from([a for a in AnchorType if a is not AnchorType.DYNAMIC]))
def test_gqa_slots_repeat_the_kv_head(c, anchor_type):
    A = max(c["A"], 2)
    G, Hq = c["G"], c["Hq"]
    anchor = np.zeros((c["NB"], A, Hq, c["D"]), np.float16)
    phys, n_valid = block_spans(c["bt"], c["n_ctx"], c["B"])
    compute_anchors(anchor_type, c["kc"], phys, n_valid, anchor)
    assert group_shared(anchor_type)
    for h in range(Hq):
        assert np.array_equal(anchor[phys, :, h], anchor[phys, :, (h // G) * G])


def test_dynamic_uses_each_query_heads_importance():
    """Two query heads of one kv head with different hot tokens get different anchors."""
    B, D = 4, 3
    keys = np.arange(B * D, dtype=np.float32).reshape(B, D)
    kc = keys.reshape(1, 1, B * D).astype(np.float16)
    imp = np.zeros((1, B, 2), np.float16)
    imp[0, 1, 0] = 5.0  # head 0: token 1 hottest
    imp[0, 3, 1] = 5.0  # head 1: token 3 hottest
    anchor = np.zeros((1, 1, 2, D), np.float16)
    compute_anchors(AnchorType.DYNAMIC, kc, [0], [B], anchor, imp)
    assert np.array_equal(anchor[0, 0, 0], keys[1])
    assert np.array_equal(anchor[0, 0, 1], keys[3])
    assert not group_shared(AnchorType.DYNAMIC)


def test_partial_tail_uses_only_valid_tokens():
    B, D = 8, 2
    kc = np.full((1, 1, B * D), 1000.0, np.float16)  # stale data beyond the valid tokens
    kc[0, 0, :3 * D] = np.array([1, -1, 2, -2, 3, -3], np.float16)
    for at, want in [(AnchorType.BLOCK_MEAN, [[2, -2]]), (AnchorType.BLOCK_MAX, [[3, -1]]),
                     (AnchorType.QUEST, [[3, -1], [1, -3]])]:
        anchor = np.zeros((1, len(want), 1, D), np.float16)
        compute_anchors(at, kc, [0], [3], anchor)
        assert anchor[0, :, 0].tolist() == want


def test_block_max_starts_at_minus_infinity():
    """All-negative keys: the max is negative (a 0 start would report 0)."""
    kc = -np.arange(1, 9, dtype=np.float16).reshape(1, 1, 8)
    anchor = np.zeros((1, 1, 1, 2), np.float16)
    compute_anchors(AnchorType.BLOCK_MAX, kc, [0], [4], anchor)
    assert anchor[0, 0, 0].tolist() == [-1.0, -2.0]


def _true_block_max(q, kc, bt, n_ctx, B, D, G):
    """float64 [F, Hq]: max_t q_h . k_t over the valid tokens of each full block."""
    F = n_ctx // B
    Hq = q.shape[0]
    out = np.empty((F, Hq))
    for lb in range(F):
        for h in range(Hq):
            K = kc[h // G, bt[lb]].astype(np.float64).reshape(B, D)
            out[lb, h] = (K @ q[h].astype(np.float64)).max()
    return out


@settings(max_examples=50, deadline=None)
@given(anchor_case(min_full_blocks=1))
def test_quest_score_bounds_block_max(c):
    B, D, G, Hq = c["B"], c["D"], c["G"], c["Hq"]
    F = c["n_ctx"] // B
    assert F >= 1
    q = (c["rng"].standard_normal((Hq, D)) * 2).astype(np.float32)
    quest = np.zeros((c["NB"], 2, Hq, D), np.float16)
    cub = np.zeros((c["NB"], 2, Hq, D), np.float16)
    phys, n_valid = block_spans(c["bt"], c["n_ctx"], B)
    compute_anchors(AnchorType.QUEST, c["kc"], phys, n_valid, quest)
    compute_anchors(AnchorType.CUBOID_MEAN, c["kc"], phys, n_valid, cub)
    true_max = _true_block_max(q, c["kc"], c["bt"], c["n_ctx"], B, D, G)
    mag = np.abs(q).sum(axis=1)[None, :] * np.abs(c["kc"].astype(np.float32)).max()
    for backend in ["numba", "numpy"]:
        sq = block_scores(q, quest, c["bt"], 0, F, 2, G, True, backend).astype(np.float64)
        sc = block_scores(q, cub, c["bt"], 0, F, 2, G, True, backend).astype(np.float64)
        # anchors round outward, so only the float32 sum of D terms can undercut: 1e-6 * sum|q||k|
        assert (sq >= true_max - 1e-6 * mag).all()
        # CUBOID's box lies inside QUEST's: never above the QUEST bound
        assert (sc <= sq + 1e-6 * mag).all()
        # max of two slots >= their mean: never below q . (stored box center)
        center = (cub[c["bt"][:F], 0].astype(np.float64) + cub[c["bt"][:F], 1]) / 2  # [F, Hq, D]
        qc = np.einsum("fhd,hd->fh", center, q.astype(np.float64))
        assert (sc >= qc - 1e-6 * mag).all()


def test_cuboid_is_not_an_upper_bound():
    """Keys 0, 5, 10 on one channel: center 5, radius 10/3, box top 8.33 < 10 = max q.k."""
    kc = np.array([[[0.0, 5.0, 10.0]]], np.float16)  # Hkv=1, NB=1, B=3, D=1
    bt = np.array([0], np.int32)
    q = np.array([[1.0]], np.float32)
    cub = np.zeros((1, 2, 1, 1), np.float16)
    quest = np.zeros((1, 2, 1, 1), np.float16)
    compute_anchors(AnchorType.CUBOID_MEAN, kc, [0], [3], cub)
    compute_anchors(AnchorType.QUEST, kc, [0], [3], quest)
    s_cub = block_scores(q, cub, bt, 0, 1, 2, 1)[0, 0]
    s_quest = block_scores(q, quest, bt, 0, 1, 2, 1)[0, 0]
    assert s_quest == 10.0
    assert 5.0 < s_cub < 10.0
    assert s_cub == pytest.approx(5.0 + 10.0 / 3.0, abs=2**-7)  # fp16 spacing at 8 is 2**-7


def test_cuboid_equals_quest_when_keys_sit_on_box_faces():
    """Every key at min or max on each channel: mean |k - c| = half range, boxes coincide."""
    kc = np.array([[[1.0, -3.0, 5.0, 2.0, 1.0, 2.0, 5.0, -3.0]]], np.float16)  # B=4, D=2
    cub = np.zeros((1, 2, 1, 2), np.float16)
    quest = np.zeros((1, 2, 1, 2), np.float16)
    compute_anchors(AnchorType.CUBOID_MEAN, kc, [0], [4], cub)
    compute_anchors(AnchorType.QUEST, kc, [0], [4], quest)
    assert np.array_equal(cub, quest)


def test_anchor_slots():
    assert anchor_slots(AnchorType.QUEST, 4) == 2
    assert anchor_slots(AnchorType.CUBOID_MEAN, 2) == 2
    for at in (AnchorType.BLOCK_MEAN, AnchorType.BLOCK_MAX, AnchorType.FIXED, AnchorType.DYNAMIC):
        assert anchor_slots(at, 3) == 1
    with pytest.raises(ValueError):
        compute_anchors(AnchorType.QUEST, np.zeros((1, 1, 4), np.float16), [0], [2],
                        np.zeros((1, 1, 1, 2), np.float16))


@st.composite
def kernel_case(draw):
    """anchor_case plus what the kernel must meet exactly: keys of both zero signs, fp16
    subnormals and values near 65504 (the directed roundings' edges), empty blocks."""
    c = draw(anchor_case())
    kind = draw(st.sampled_from(["normal", "zeros", "tiny", "huge"]))
    kc = c["kc"].astype(np.float32)
    rng = c["rng"]
    if kind == "zeros":
        kc = np.where(rng.random(kc.shape) < 0.5, np.float32(0.0), np.float32(-0.0)) + \
            np.where(rng.random(kc.shape) < 0.3, kc, np.float32(0.0)) * 0
    elif kind == "tiny":
        kc = kc * np.float32(1e-6)
    elif kind == "huge":
        kc = np.float32(65500.0) + kc * np.float32(8.0)
    c["kc"] = kc.astype(c["kc"].dtype) if kind != "huge" else kc
    return c


@settings(max_examples=150, deadline=None)
@given(kernel_case(), st.sampled_from([a for a in AnchorType if a is not AnchorType.DYNAMIC]),
       st.booleans(), st.booleans())
def test_compiled_anchors_match_the_numpy_reference(c, anchor_type, shared, empty):
    """compute_anchors' compiled path (_anchor_rows) == its NumPy reference bit for bit: sums in
    the same order, the same roundings (nearest and directed), the same NaN of an empty
    CUBOID_MEAN block; only the sign of a zero maximum / minimum may differ (the two
    compare equal and score the same). Per-kv-head and per-query-head storage."""
    A = max(c["A"], 2) if anchor_type in (AnchorType.QUEST, AnchorType.CUBOID_MEAN) else c["A"]
    Ha = c["Hkv"] if shared else c["Hq"]
    phys, n_valid = block_spans(c["bt"], c["n_ctx"], c["B"])
    if empty:                                    # a spare physical block with no valid token
        spare = np.setdiff1d(np.arange(c["NB"]), phys)[:1]
        phys, n_valid = np.append(phys, spare), np.append(n_valid, np.zeros(spare.size, int))
    got = np.full((c["NB"], A, Ha, c["D"]), 7.0, np.float16)
    want = got.copy()
    with np.errstate(invalid="ignore", over="ignore"):
        compute_anchors(anchor_type, c["kc"], phys, n_valid, got, c["imp"])
        compute_anchors(anchor_type, c["kc"], phys, n_valid, want, c["imp"], backend="numpy")
    # 0 fp16 steps apart, +0 == -0, a NaN only where the other has one (the conformance
    # suite's comparison, tested in tests/test_conformance.py)
    suite._ulps16("compute_anchors", got, want, 0)


def test_compute_anchors_refuses_an_unknown_backend():
    kc = np.zeros((1, 2, 8), np.float16)
    with pytest.raises(ValueError, match="backend"):
        compute_anchors(AnchorType.QUEST, kc, [0], [2], np.zeros((2, 2, 1, 4), np.float16),
                        backend="cuda")
