"""pyimp.cuda.sparse against the CPU path of pyimp.sparse: anchors (all six types, fp16 and fp32
caches), set scores, device selection, retrieval chained on the device, importance decay.

Shapes are tiny (the simulator runs one Python thread per CUDA thread). Block tables are
permutations, tail blocks partial, GQA groups G in 1, 2, 4.
"""
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from pyimp.cuda import device
from pyimp.cuda import sparse as cs
from pyimp.attention.importance import decay_importance
from pyimp.sparse import AnchorType, RetrievalType, compute_anchors
from pyimp.sparse.anchors import _round_down_f16, round_up_f16, group_shared
from pyimp.sparse.retrieval import (
    n_candidates,
    n_sets,
    retrieve_blocks,
    select_blocks,
    select_blocks_ref,
    set_scores_ref,
)

EPS32 = 2.0 ** -24          # float32 unit roundoff
TWO_SLOT = (AnchorType.QUEST, AnchorType.CUBOID_MEAN)


@pytest.fixture(autouse=True, scope="module")
def _short_switch_interval():
    """Simulated barriers wait for GIL hand-offs (5 ms each by default): a short interval makes
    the barrier-heavy kernels several times faster. Restored after the module."""
    prev = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    yield
    sys.setswitchinterval(prev)


def _perm_blocks(rng, NB, n):
    return rng.permutation(NB)[:n].astype(np.int32)


def _f16_ulp(x):
    """fp16 spacing at |x| (float64), for finite x."""
    return np.spacing(np.abs(np.asarray(x, np.float16))).astype(np.float64)


# --------------------------------------------------------------------------
# fp16 directed rounding
# --------------------------------------------------------------------------


@cuda.jit
def _directed_kernel(x, up, dn):
    i = cuda.grid(1)
    if i < x.size:
        up[i] = cs._f16_up(x[i])
        dn[i] = cs._f16_down(x[i])


def _directed(x):
    """_f16_up / _f16_down of every element: called directly on the simulator (a launch there
    would start one Python thread per element), in a kernel on a GPU."""
    if device.SIMULATOR:
        return (np.array([cs._f16_up(v) for v in x], np.float32),
                np.array([cs._f16_down(v) for v in x], np.float32))
    up, dn = device.empty(x.shape, np.float32), device.empty(x.shape, np.float32)
    device.launch(_directed_kernel, device.blocks_for(x.size, 256), 256, device.to_device(x),
                  up, dn)
    return device.to_host(up), device.to_host(dn)


def assert_f16_bits_equal(got, ref):
    """fp16 arrays bit for bit, except that a NaN only has to be a NaN: a GPU's float -> fp16
    conversion (PTX cvt) writes its canonical NaN 0x7FFF whatever the payload, where the CPU
    keeps the payload's top bits (0x7E00). The NaN positions must agree."""
    got, ref = np.asarray(got, np.float16), np.asarray(ref, np.float16)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    keep = ~np.isnan(ref)
    np.testing.assert_array_equal(got.view(np.uint16)[keep], ref.view(np.uint16)[keep])


def test_f16_bits_compare_catches_a_flip():
    a = np.float16([1.0, np.nan, -0.0, 65504])
    assert_f16_bits_equal(a, a.copy())
    assert_f16_bits_equal(a, np.uint16([0x3C00, 0x7FFF, 0x8000, 0x7BFF]).view(np.float16))
    for bad in ([0x3C01, 0x7E00, 0x8000, 0x7BFF], [0x3C00, 0x7E00, 0x0000, 0x7BFF],
                [0x3C00, 0x3C00, 0x8000, 0x7BFF]):
        with pytest.raises(AssertionError):
            assert_f16_bits_equal(np.uint16(bad).view(np.float16), a)


def test_f16_directed_rounding_exhaustive():
    """_f16_up / _f16_down (device functions) == the CPU's round_up_f16 / _round_down_f16, bit
    for bit, on every finite fp16 value, its float32 neighbours, the overflow boundary,
    subnormals, infinities and NaN (NaN as NaN: see assert_f16_bits_equal)."""
    h = np.arange(65536, dtype=np.uint16).view(np.float16)
    h = h[np.isfinite(h)].astype(np.float32)
    x = np.concatenate([h, np.nextafter(h, np.float32(np.inf)), np.nextafter(h, np.float32(-np.inf)),
                        np.float32([65519.99, 65520.0, 7e4, -65519.99, -65520.0, -7e4, 3e38,
                                    np.inf, -np.inf, np.nan, 1e-9, -1e-9, 2.0 ** -25])])
    x = x.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):   # 65536 and beyond store as fp16 inf
        up, dn = (a.astype(np.float16) for a in _directed(x))
        ref_up, ref_dn = round_up_f16(x), _round_down_f16(x)
    assert_f16_bits_equal(up, ref_up)
    assert_f16_bits_equal(dn, ref_dn)


# --------------------------------------------------------------------------
# anchors
# --------------------------------------------------------------------------

# (k dtype, G, anchors stored per kv head) per case: every type sees both cache dtypes, every
# G in 1, 2, 4 and both layouts across its cases
_ANCHOR_CASES = [(np.float16, 1, True), (np.float32, 2, False), (np.float16, 4, True),
                 (np.float32, 4, False)]


def _anchor_inputs(rng, kdt, G, per_kv, atype, B=8, D=16, Hkv=2, NB=7, A=3, scale=1.0):
    Hq = Hkv * G
    Ha = Hkv if per_kv and group_shared(atype) else Hq
    kc = (rng.standard_normal((Hkv, NB, B * D)) * scale).astype(kdt)
    # importance with many ties, an inf and a NaN (the CPU's stable descending order: ties lower
    # position first, NaN last)
    imp = rng.integers(0, 3, (NB, B, Hq)).astype(np.float16)
    blocks = _perm_blocks(rng, NB, 5)
    n_valid = np.array([B, 3, B, 0, 1], np.int32)      # full, partial tails, an empty block
    imp[blocks[0], 1, 0] = np.inf
    imp[blocks[0], 4, -1] = np.nan
    imp[blocks[1], 2, 0] = np.nan   # sorts after the block's invalid tokens too: not among 3
    anchor0 = rng.standard_normal((NB, A, Ha, D)).astype(np.float16)   # rows not listed stay
    return kc, imp, blocks, n_valid, anchor0


def _run_anchors(atype, kc, imp, blocks, n_valid, anchor0):
    ref = anchor0.copy()
    compute_anchors(atype, kc, blocks, n_valid, ref, imp)
    d_anchor = device.to_device(anchor0)
    cs.compute_anchors(atype, device.to_device(kc), device.to_device(blocks),
                       device.to_device(n_valid), d_anchor, device.to_device(imp))
    return device.to_host(d_anchor), ref


def _sum_slack(kc, blocks, n_valid, anchor_shape):
    """Per anchor entry, what float32 summation in another order could change before the fp16
    rounding: the sums have at most B terms, each at most 2 * max|k| in magnitude (|k - c| for
    CUBOID_MEAN, |k| otherwise), so two orders differ by at most 2 * B * EPS32 * (B * 2 max|k|)
    (a mean divides that by its count, which only helps)."""
    Hkv, _, BD = kc.shape
    _, _, Ha, D = anchor_shape
    B = BD // D
    slack = np.zeros(anchor_shape)
    for b, nv in zip(blocks, n_valid):
        k = np.abs(kc[:, b].astype(np.float64).reshape(Hkv, B, D)[:, :nv])
        mx = k.max(axis=1) if nv else np.zeros((Hkv, D))            # [Hkv, D]
        slack[b] = np.repeat(2 * B * EPS32 * B * 2 * mx, Ha // Hkv, axis=0)[None]
    return slack


# an empty block's CUBOID_MEAN center is (-inf + inf) / 2 = NaN on both sides
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("kdt,G,per_kv", _ANCHOR_CASES)
@pytest.mark.parametrize("atype", list(AnchorType))
def test_anchors_match_cpu(atype, kdt, G, per_kv):
    rng = np.random.default_rng([list(AnchorType).index(atype), G, int(per_kv)])
    kc, imp, blocks, n_valid, anchor0 = _anchor_inputs(rng, kdt, G, per_kv, atype)
    got, ref = _run_anchors(atype, kc, imp, blocks, n_valid, anchor0)
    if atype in (AnchorType.BLOCK_MAX, AnchorType.QUEST):
        # a max / min of the keys and one (directed) rounding: exact
        np.testing.assert_array_equal(got.view(np.uint16), ref.view(np.uint16))
        return
    # BLOCK_MEAN, FIXED, CUBOID_MEAN, DYNAMIC sum keys in float32. Both sides add in token
    # order (NumPy reduces the token axis row by row), so they agree bit for bit in practice;
    # the assertion allows what another summation order could change: the float32 slack of
    # _sum_slack, which a rounding to fp16 (nearest or directed) turns into at most one fp16
    # step more.
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    assert np.array_equal(np.isinf(got), np.isinf(ref))
    assert np.array_equal(got[np.isinf(got)], ref[np.isinf(ref)])
    fin = np.isfinite(ref)
    g64, r64 = got[fin].astype(np.float64), ref[fin].astype(np.float64)
    tol = np.maximum(_f16_ulp(g64), _f16_ulp(r64)) + _sum_slack(kc, blocks, n_valid, got.shape)[fin]
    assert np.all(np.abs(g64 - r64) <= tol), np.abs(g64 - r64).max()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("atype", TWO_SLOT)
@pytest.mark.parametrize("scale", [1e-6, 3e4])
def test_bound_anchors_round_outward(atype, scale):
    """A float32 cache with keys in the fp16 subnormal range and near the fp16 maximum (65504):
    the upper slot rounds up (to +inf past 65504), the lower slot down, as on the CPU."""
    rng = np.random.default_rng(int(scale))
    kc, imp, blocks, n_valid, anchor0 = _anchor_inputs(rng, np.float32, 2, True, atype,
                                                       scale=scale)
    got, ref = _run_anchors(atype, kc, imp, blocks, n_valid, anchor0)
    # the empty block's CUBOID_MEAN slots are NaN: as NaN, whatever their payload
    assert_f16_bits_equal(got, ref)


def test_dynamic_single_anchor_exact():
    """DYNAMIC with A = 1 is the hottest token's key (no sum): exact, ties and NaN included."""
    rng = np.random.default_rng(11)
    kc, imp, blocks, n_valid, anchor0 = _anchor_inputs(rng, np.float16, 2, False,
                                                       AnchorType.DYNAMIC, A=1)
    got, ref = _run_anchors(AnchorType.DYNAMIC, kc, imp, blocks, n_valid, anchor0)
    np.testing.assert_array_equal(got.view(np.uint16), ref.view(np.uint16))


# --------------------------------------------------------------------------
# scores, selection, retrieval
# --------------------------------------------------------------------------


def _score_inputs(rng, atype, Hkv, G, per_kv, NB, A, D, integer):
    Hq = Hkv * G
    Ha = Hkv if per_kv and group_shared(atype) else Hq
    if integer:   # exact in float32 whatever the order: products <= 32, sums << 2**24
        anc = rng.integers(-8, 9, (NB, A, Ha, D)).astype(np.float16)
        q = rng.integers(-4, 5, (Hq, D)).astype(np.float32)
    else:
        anc = rng.standard_normal((NB, A, Ha, D)).astype(np.float16)
        q = rng.standard_normal((Hq, D)).astype(np.float32)
    if atype in TWO_SLOT:     # the types' stored order: slot 0 >= slot 1 per channel
        hi, lo = np.maximum(anc[:, 0], anc[:, 1]), np.minimum(anc[:, 0], anc[:, 1])
        anc[:, 0], anc[:, 1] = hi, lo
    elif group_shared(atype) and Ha == Hq:   # shared types repeat a kv head's anchor
        anc = np.repeat(anc[:, :, ::G], G, axis=2)
    return anc, q


def _score_bound(q, anc, bt, lb_start, lb_end, nsets, n_slots, G, shared):
    """Summation-order bound between the device scores (per head in channel order, then the
    set's heads in order, float32) and set_scores_ref (per head in float32, heads in float64,
    one final rounding): each side is within gamma_n * sum|terms| of the exact sum, n = D + hps
    terms deep, plus the reference's final rounding."""
    Hq, D = q.shape
    hps = Hq // nsets
    absq = np.abs(q)
    absa = np.abs(anc.astype(np.float32))
    a = set_scores_ref(absq, absa, bt, lb_start, lb_end, nsets, n_slots, G, shared)
    return (2 * (D + hps) + 2) * EPS32 * a.astype(np.float64)


@pytest.mark.parametrize("atype", [AnchorType.QUEST, AnchorType.BLOCK_MEAN, AnchorType.DYNAMIC])
@pytest.mark.parametrize("G", [1, 2, 4])
def test_set_scores_and_chain(atype, G):
    """Random float data: device set scores == set_scores_ref within the summation bound, for
    every retrieval type; the one-launch device retrieval (its last thread block selecting)
    == the CPU selection of those scores, twice over one counter."""
    rng = np.random.default_rng([G, list(AnchorType).index(atype)])
    Hkv, B, D, A = 2, 4, 8, 2
    n_ctx = 22 * B + 3                                  # 22 full blocks and a partial tail
    n_lb = -(-n_ctx // B)
    NB = n_lb + 3
    bt = _perm_blocks(rng, NB, n_lb)
    anc, q = _score_inputs(rng, atype, Hkv, G, G % 2 == 0, NB, A, D, integer=False)
    n_slots = 2 if atype in TWO_SLOT else 1
    shared = group_shared(atype)
    d_anc, d_q, d_bt = device.to_device(anc), device.to_device(q), device.to_device(bt)
    init, pick, local = 1, 5, 2
    for rtype in RetrievalType:
        nsets = n_sets(rtype, Hkv * G, Hkv)
        lb_end = n_lb - 1 - local
        got = device.to_host(cs.set_scores(d_q, d_anc, d_bt, init, lb_end, nsets, n_slots, G,
                                           shared))
        ref = set_scores_ref(q, anc, bt, init, lb_end, nsets, n_slots, G, shared)
        bound = _score_bound(q, anc, bt, init, lb_end, nsets, n_slots, G, shared)
        assert np.all(np.abs(got.astype(np.float64) - ref) <= bound)
        scratch = device.empty(got.shape, np.float32)
        counter = device.zeros((1,), np.int32)
        rsel, rcnt = select_blocks_ref(got, n_ctx, B, init, pick, local)
        assert -(-got.shape[0] // max(1, cs.THREADS // (Hkv * G))) > 1   # several thread blocks
        for _ in range(2):        # the launch leaves its counter zero: a second one selects too
            n0 = device.launches
            sel, cnt = cs.retrieve_blocks(d_q, d_anc, d_bt, n_ctx, B, Hkv, rtype, init, pick,
                                          local, atype, scores=scratch, counter=counter)
            assert device.launches - n0 == 1       # scores and selection in one launch
            assert device.to_host(counter)[0] == 0
            np.testing.assert_array_equal(device.to_host(scratch), got)
            assert not isinstance(sel, np.ndarray) and not isinstance(cnt, np.ndarray)
            np.testing.assert_array_equal(device.to_host(sel), rsel)
            np.testing.assert_array_equal(device.to_host(cnt), rcnt)


@st.composite
def _gqa_case(draw):
    Hkv = draw(st.sampled_from([1, 2]))
    G = draw(st.sampled_from([1, 2, 4]))
    B = draw(st.sampled_from([4, 8, 16]))
    D = draw(st.sampled_from([4, 8]))
    n_ctx = draw(st.integers(1, 24 * B))
    init = draw(st.integers(0, 2))
    pick = draw(st.integers(0, 6))
    local = draw(st.integers(0, 2))
    atype = draw(st.sampled_from(list(AnchorType)))
    rtype = draw(st.sampled_from(list(RetrievalType)))
    per_kv = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return Hkv, G, B, D, n_ctx, init, pick, local, atype, rtype, per_kv, seed


@settings(deadline=None, max_examples=40)
@given(_gqa_case())
def test_retrieval_gqa_mapping(case):
    """Integer anchors and queries (every score exact in float32, ties frequent): the device's
    set scores equal set_scores_ref and its chained selection equals the CPU retrieve_blocks,
    for random Hkv, G, B, D, layouts, anchor and retrieval types, permuted block tables and
    partial tails."""
    Hkv, G, B, D, n_ctx, init, pick, local, atype, rtype, per_kv, seed = case
    rng = np.random.default_rng(seed)
    Hq = Hkv * G
    n_lb = -(-n_ctx // B)
    NB = n_lb + 2
    A = 2 if atype in TWO_SLOT else 1
    anc, q = _score_inputs(rng, atype, Hkv, G, per_kv, NB, A, D, integer=True)
    bt = _perm_blocks(rng, NB, n_lb)
    d_anc, d_q = device.to_device(anc), device.to_device(q)
    nsets = n_sets(rtype, Hq, Hkv)
    F = n_ctx // B
    if F > init + pick + local:
        C = n_candidates(n_ctx, B, init, local)
        got = cs.set_scores(d_q, d_anc, bt, init, init + C, nsets, A, G, group_shared(atype))
        ref = set_scores_ref(q, anc, bt, init, init + C, nsets, A, G, group_shared(atype))
        np.testing.assert_array_equal(device.to_host(got), ref)
    sel, cnt = cs.retrieve_blocks(d_q, d_anc, bt, n_ctx, B, Hkv, rtype, init, pick, local, atype)
    rsel, rcnt = retrieve_blocks(q, anc, bt, n_ctx, B, Hkv, rtype, init, pick, local, atype)
    np.testing.assert_array_equal(device.to_host(sel), rsel)
    np.testing.assert_array_equal(device.to_host(cnt), rcnt)


@st.composite
def _select_case(draw):
    B = draw(st.sampled_from([1, 4, 16]))
    n_ctx = draw(st.integers(1, 90 * B))
    init = draw(st.integers(0, 3))
    pick = draw(st.integers(0, 70))
    local = draw(st.integers(0, 3))
    nsets = draw(st.sampled_from([1, 2, 3]))
    kind = draw(st.sampled_from(["ties", "bits", "normal"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return B, n_ctx, init, pick, local, nsets, kind, seed


@settings(deadline=None, max_examples=40)
@given(_select_case())
def test_select_matches_cpu(case):
    """Device selection == the CPU's (numba and NumPy reference) on the same scores: candidate
    counts beyond the block size (several chunks), heavy ties, NaN, +-inf, +-0 and arbitrary
    float32 bit patterns (every radix digit matters), dense contexts, local = 0 with and
    without a partial tail."""
    B, n_ctx, init, pick, local, nsets, kind, seed = case
    rng = np.random.default_rng(seed)
    C = n_candidates(n_ctx, B, init, local) if n_ctx // B > init + pick + local else 0
    if kind == "ties":
        scores = rng.choice(np.float32([-np.inf, -1.0, -0.0, 0.0, 0.5, 1.0, np.nan, np.inf]),
                            (C, nsets))
    elif kind == "bits":
        scores = rng.integers(0, 2**32, (C, nsets), dtype=np.uint64).astype(np.uint32)
        scores = scores.view(np.float32)
    else:
        scores = rng.standard_normal((C, nsets)).astype(np.float32)
    scores = np.ascontiguousarray(scores, np.float32)
    if C == 0:
        scores = np.zeros((0, nsets), np.float32)
    d_scores = device.to_device(scores) if C else device.empty((0, nsets), np.float32)
    sel, cnt = cs.select_blocks(d_scores, n_ctx, B, init, pick, local)
    rsel, rcnt = select_blocks(scores, n_ctx, B, init, pick, local)
    nsel, ncnt = select_blocks_ref(scores, n_ctx, B, init, pick, local)
    np.testing.assert_array_equal(rsel, nsel)
    np.testing.assert_array_equal(rcnt, ncnt)
    np.testing.assert_array_equal(device.to_host(sel), rsel)
    np.testing.assert_array_equal(device.to_host(cnt), rcnt)


def test_select_reuses_buffers_and_many_chunks():
    """Given sel / cnt (stale contents) are overwritten in place; 300 candidates of equal score
    except a few (the first pick of the ties win), over ~10 chunks of the block size."""
    B, init, pick, local = 2, 2, 7, 1
    n_ctx = (init + 300 + local) * B + 1
    scores = np.zeros((300, 2), np.float32)
    scores[[5, 250, 299], 0] = 1.0
    scores[[0, 7], 1] = -1.0
    sel = device.to_device(np.full((2, init + pick + local + 1), 99, np.int32))
    cnt = device.to_device(np.full(2, 99, np.int32))
    out = cs.select_blocks(device.to_device(scores), n_ctx, B, init, pick, local, sel=sel, cnt=cnt)
    assert out[0] is sel and out[1] is cnt
    rsel, rcnt = select_blocks_ref(scores, n_ctx, B, init, pick, local)
    np.testing.assert_array_equal(device.to_host(sel), rsel)
    np.testing.assert_array_equal(device.to_host(cnt), rcnt)


# --------------------------------------------------------------------------
# importance decay
# --------------------------------------------------------------------------


@pytest.mark.parametrize("decay", [0.5, 0.9, 0.999, 1.0])
@pytest.mark.parametrize("G", [1, 4])
def test_decay_matches_cpu(decay, G):
    """fp16 in and out with the CPU's rounding: bit-identical, including large values, inf (clamped
    to 65504), subnormals; NaN stays NaN (its payload is the GPU's own, assert_f16_bits_equal);
    entries past n_ctx and unmapped blocks untouched."""
    rng = np.random.default_rng([G, int(decay * 1000)])
    NB, B, Hq = 6, 4, 2 * G
    imp = (rng.random((NB, B, Hq)) * 10.0 ** rng.integers(-7, 5, (NB, B, Hq))).astype(np.float16)
    imp.flat[:6] = np.float16([np.inf, np.nan, 65504, 2048, 6e-8, 1e-5])
    n_ctx = 3 * B + 2
    bt = _perm_blocks(rng, NB, 4)
    ref = imp.copy()
    decay_importance(ref, bt, n_ctx, decay)
    ref2 = imp.copy()
    decay_importance(ref2, bt, n_ctx, decay, backend="numpy")
    np.testing.assert_array_equal(ref.view(np.uint16), ref2.view(np.uint16))
    d_imp = device.to_device(imp)
    cs.decay_importance(d_imp, device.to_device(bt), n_ctx, decay)
    assert_f16_bits_equal(device.to_host(d_imp), ref)


# --------------------------------------------------------------------------
# argument checks
# --------------------------------------------------------------------------


def test_launchers_name_bad_arguments():
    kc = device.zeros((2, 4, 32), np.float16)
    anc = device.zeros((4, 2, 2, 8), np.float16)
    blocks, nv = np.arange(2, dtype=np.int32), np.full(2, 4, np.int32)
    with pytest.raises(ValueError, match="k_cache"):
        cs.compute_anchors(AnchorType.QUEST, device.zeros((2, 4, 32), np.float64), blocks, nv, anc)
    with pytest.raises(ValueError, match="anchor"):
        cs.compute_anchors(AnchorType.QUEST, kc, blocks, nv, device.zeros((4, 2, 2, 8), np.float32))
    with pytest.raises(ValueError, match="anchor_num"):
        cs.compute_anchors(AnchorType.QUEST, kc, blocks, nv, device.zeros((4, 1, 2, 8), np.float16))
    with pytest.raises(ValueError, match="importance"):
        cs.compute_anchors(AnchorType.DYNAMIC, kc, blocks, nv, anc)
    with pytest.raises(ValueError, match="n_valid"):
        cs.compute_anchors(AnchorType.QUEST, kc, blocks, np.full(2, 5), anc)
    with pytest.raises(ValueError, match="blocks"):
        cs.compute_anchors(AnchorType.QUEST, kc, np.array([1, 1]), nv, anc)
    q = device.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="q has head dim"):
        cs.set_scores(device.zeros((4, 6), np.float32), anc, blocks, 0, 2, 1, 2, 2)
    with pytest.raises(ValueError, match="DYNAMIC|per query head"):
        cs.retrieve_blocks(q, anc, np.arange(4, dtype=np.int32), 16, 4, 2,
                           anchor_type=AnchorType.DYNAMIC)
    with pytest.raises(ValueError, match="block_table"):
        cs.retrieve_blocks(q, anc, np.arange(2, dtype=np.int32), 16, 4, 2)
    with pytest.raises(ValueError, match="scores has 3 rows"):
        cs.select_blocks(device.zeros((3, 1), np.float32), 40, 4, 1, 2, 1)
    with pytest.raises(ValueError, match="sel"):
        cs.select_blocks(device.zeros((8, 1), np.float32), 40, 4, 1, 2, 1,
                         sel=device.zeros((1, 3), np.int32))
    with pytest.raises(ValueError, match="decay"):
        cs.decay_importance(device.zeros((4, 4, 2), np.float16), blocks, 8, 1.5)
