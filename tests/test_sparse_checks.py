"""Kernel entry points refuse wrong dtypes, shapes and block ids with one ValueError naming the
argument (a float32 importance read as fp16 bits, or a -1 block id wrapped to the last block,
would otherwise give silent garbage)."""
import numpy as np
import pytest

from pyimp.attention.attend import attention_decode, attention_prefill
from pyimp.sparse.anchors import AnchorType, compute_anchors
from pyimp.attention.importance import (decay_importance, importance_update,
                                        importance_update_blocks)
from pyimp.sparse.retrieval import RetrievalType, block_scores, retrieve_blocks, select_blocks, set_scores
from pyimp.attention.attend import sparse_attention_decode

Hkv, G, B, D, n = 2, 2, 4, 8, 14
Hq, NB, n_lb = Hkv * G, 5, 4


@pytest.fixture
def c():
    rng = np.random.default_rng(0)
    return dict(kc=rng.standard_normal((Hkv, NB, B * D)).astype(np.float16),
                vc=rng.standard_normal((Hkv, NB, D * B)).astype(np.float16),
                bt=np.array([3, 0, 4, 1, -1], np.int32),
                q=rng.standard_normal((Hq, D)).astype(np.float32),
                imp=np.zeros((NB, B, Hq), np.float16),
                out=np.empty((Hq, D), np.float32),
                sel=np.array([[0, 2, 3]], np.int32), cnt=np.array([3], np.int32),
                anchor=np.zeros((NB, 2, Hkv, D), np.float16))


def _calls(c):
    """name -> callable(**overrides) running one entry point on valid arguments by default."""
    def dec(**o):
        a = {**c, **o}
        return attention_decode(a["q"], a["kc"], a["vc"], a["bt"], a.get("n", n), 0.5, 0, a["out"],
                                importance=a["imp"], backend=a.get("backend", "numba"))

    def pre(**o):
        a = {**c, **o}
        q = np.repeat(a["q"][None], 3, axis=0) if a["q"].ndim == 2 else a["q"]
        out = np.empty(q.shape, np.float32) if "out" not in o else a["out"]
        return attention_prefill(q, a["kc"], a["vc"], a["bt"], a.get("n", n) - 3, 0.5, 0, out,
                                 importance=a["imp"], backend=a.get("backend", "numba"))

    def sparse(**o):
        a = {**c, **o}
        return sparse_attention_decode(a["q"], a["kc"], a["vc"], a["bt"], a.get("n", n), 0.5, 0,
                                       a["sel"], a["cnt"], a["out"], importance=a["imp"],
                                       backend=a.get("backend", "numba"))

    def upd(**o):
        a = {**c, **o}
        return importance_update(a["imp"], a["bt"], np.ones((Hq, a.get("n", n)), np.float32),
                                 backend=a.get("backend", "numba"))

    def upd_blocks(**o):
        a = {**c, **o}
        probs = np.zeros((Hq, a["sel"].shape[1], B), np.float32)
        return importance_update_blocks(a["imp"], a["bt"], a["sel"], a["cnt"], probs, a.get("n", n),
                                        backend=a.get("backend", "numba"))

    def decay(**o):
        a = {**c, **o}
        return decay_importance(a["imp"], a["bt"], a.get("n", n), 0.5, backend=a.get("backend", "numba"))

    def anchors(**o):
        a = {**c, **o}
        lbs = np.arange(-(-a.get("n", n) // B))
        return compute_anchors(AnchorType.QUEST, a["kc"], a["bt"][lbs],
                               np.minimum(B, a.get("n", n) - lbs * B), a["anchor"], a["imp"])

    def retrieve(**o):
        a = {**c, **o}
        return retrieve_blocks(a["q"], a["anchor"], a["bt"], a.get("n", n), B, Hkv,
                               RetrievalType.KVHEAD, 1, 1, 0, AnchorType.QUEST,
                               backend=a.get("backend", "numba"))

    def scores(**o):
        a = {**c, **o}
        return block_scores(a["q"], a["anchor"], a["bt"], 0, a.get("n", n) // B, 2, G,
                            backend=a.get("backend", "numba"))

    def sets(**o):
        a = {**c, **o}
        return set_scores(a["q"], a["anchor"], a["bt"], 0, a.get("n", n) // B, Hkv, 2, G,
                          ordered=True, backend=a.get("backend", "numba"))

    return dict(decode=dec, prefill=pre, sparse=sparse, update=upd, update_blocks=upd_blocks,
                decay=decay, anchors=anchors, retrieve=retrieve, scores=scores, sets=sets)


ALL = ["decode", "prefill", "sparse", "update", "update_blocks", "decay", "anchors", "retrieve",
       "scores", "sets"]
WITH_IMPORTANCE = ["decode", "prefill", "sparse", "update", "update_blocks", "decay", "anchors"]
BACKENDS = ["numba", "numpy"]


@pytest.mark.parametrize("name", ALL)
def test_valid_arguments_run(c, name):
    _calls(c)[name]()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", WITH_IMPORTANCE)
def test_float32_importance_is_refused(c, name, backend):
    imp32 = np.zeros((NB, B, Hq), np.float32)
    with pytest.raises(ValueError, match=r"importance must be a float16"):
        _calls(c)[name](imp=imp32, backend=backend)
    if name in ("decode", "prefill", "sparse"):   # q gives the head count: a wrong one is refused
        with pytest.raises(ValueError, match=r"importance must be a float16 of shape \(5, 4, 4\)"):
            _calls(c)[name](imp=np.zeros((NB, B, Hq + 1), np.float16), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ALL)
def test_unreserved_block_is_refused(c, name, backend):
    # logical block 4 maps to -1: a context of 17 tokens reads it
    bt = c["bt"]
    n_bad = 4 * B + 1
    if name in ("scores", "sets"):
        bt = np.array([3, -1, 4, 1, 2], np.int32)   # scored range 0..3 holds the -1
        n_bad = n
    sel = np.array([[0, 2, 4]], np.int32)
    with pytest.raises(ValueError, match=r"block_table\S* = -1 is not a physical block id|"
                                         r"blocks holds -1"):
        _calls(c)[name](bt=bt, n=n_bad, sel=sel, backend=backend)
    with pytest.raises(ValueError, match=r"block_table.*= 7 is not a physical block id|blocks holds 7"):
        _calls(c)[name](bt=np.array([3, 0, 7, 1, 2], np.int32), n=n_bad, sel=sel, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_selection_is_refused(c, backend):
    run = _calls(c)["sparse"]
    with pytest.raises(ValueError, match=r"sel holds logical block 4"):
        run(sel=np.array([[0, 4]], np.int32), cnt=np.array([2], np.int32), backend=backend)
    with pytest.raises(ValueError, match=r"sel\[0\] lists a block twice"):
        run(sel=np.array([[1, 1]], np.int32), cnt=np.array([2], np.int32), backend=backend)
    with pytest.raises(ValueError, match=r"cnt\[0\] = 3 is outside"):
        run(sel=np.array([[1, 2]], np.int32), cnt=np.array([3], np.int32), backend=backend)
    with pytest.raises(ValueError, match=r"sel must be a int32"):
        run(sel=np.array([[1, 2]], np.int64), cnt=np.array([2], np.int32), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_shapes_are_refused(c, backend):
    calls = _calls(c)
    with pytest.raises(ValueError, match=r"out must be a float32 of shape \(4, 8\)"):
        calls["decode"](out=np.empty((Hq, D - 1), np.float32), backend=backend)
    with pytest.raises(ValueError, match=r"q has 3 query heads"):
        calls["decode"](q=np.zeros((3, D), np.float32), out=np.empty((3, D), np.float32),
                        backend=backend)
    # K and V types may differ (-ctk f16 -ctv f32), their shapes may not
    with pytest.raises(ValueError, match=r"v_cache must be a float16 or float32 of shape"):
        calls["sparse"](vc=c["vc"][:, :-1].astype(np.float32), backend=backend)
    with pytest.raises(ValueError, match=r"v_cache must be a float16 or float32"):
        calls["sparse"](vc=c["vc"].astype(np.float64), backend=backend)
    with pytest.raises(ValueError, match=r"n_ctx .* must be in \[1, 20\], got 21"):
        calls["decode"](n=21, backend=backend)
    with pytest.raises(ValueError, match=r"anchor has 3 heads"):
        calls["retrieve"](anchor=np.zeros((NB, 2, 3, D), np.float16), backend=backend)
    with pytest.raises(ValueError, match=r"scores has 1 rows, expected one per candidate block \(2"):
        select_blocks(np.zeros((1, 1), np.float32), n, B, 1, 1, 0, backend)


def test_dynamic_anchors_need_query_head_slots(c):
    with pytest.raises(ValueError, match=r"anchor has 2 heads: DYNAMIC anchors are stored per query"):
        compute_anchors(AnchorType.DYNAMIC, c["kc"], [0], [B], c["anchor"], c["imp"])
    with pytest.raises(ValueError, match=r"n_valid holds 5"):
        compute_anchors(AnchorType.QUEST, c["kc"], [0], [B + 1], c["anchor"], c["imp"])
    with pytest.raises(ValueError, match=r"blocks lists a physical block twice"):
        compute_anchors(AnchorType.QUEST, c["kc"], [0, 0], [B, B], c["anchor"], c["imp"])
