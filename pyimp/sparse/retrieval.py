"""Block retrieval: score blocks against the query and pick the ones to attend.

Score (KVCACHE.md section 6), for logical block b and query head h::

    s[b, h] = sum_d max_a(anchor[block_table[b]][a][h][d] * q[h][d])

over the first ``n_slots`` anchor slots (see ``anchors.anchor_slots``). With
``group_shared`` (every anchor type but DYNAMIC) the G query heads of a kv
head hold identical anchors, so only the first head's slot is read and scored
against each of the G query vectors (G times less anchor traffic).

Granularity: LAYER ranks by ``sum_h s``, one set for all heads; KVHEAD by the
sum over a kv head's G query heads, one set per kv head; QHEAD one set per
query head. Set ``i`` serves query heads ``[i*Hq/nsets, (i+1)*Hq/nsets)``.

Selection for ``n_ctx`` tokens, ``F = n_ctx // B`` full blocks: blocks
``0..init-1`` (sinks), the ``pick`` best-scoring of ``init..F-local-1`` (ties:
lower block first), the last ``local`` full blocks ``F-local..F-1`` and the
partial tail ``F`` if ``n_ctx % B``. If ``F <= init + pick + local`` every
block is selected (dense). Result: int32 ``sel[nsets, K]`` of logical block
ids in ascending order, padded with -1, ``K = init + pick + local + 1``, and
int32 ``cnt[nsets]``.
"""
from __future__ import annotations

import enum

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from pyimp.sparse.anchors import AnchorType, anchor_slots, group_shared
from pyimp.sparse.importance import fp16_lut

_FM = {"reassoc", "contract", "nsz"}  # no nnan/ninf: -inf anchors keep their meaning


class RetrievalType(enum.Enum):
    LAYER = "layer"
    KVHEAD = "kvhead"
    QHEAD = "qhead"


def n_sets(retrieval_type: RetrievalType, n_q_heads: int, n_kv_heads: int) -> int:
    """Number of block sets a granularity produces."""
    return {RetrievalType.LAYER: 1, RetrievalType.KVHEAD: n_kv_heads,
            RetrievalType.QHEAD: n_q_heads}[retrieval_type]


def _load_f32(src, dst, lut):
    """dst[:] = float32 value of src (fp16 bits or float32), same length."""
    dst[:] = lut[src] if src.dtype == np.uint16 else src


@overload(_load_f32)
def _load_f32_ov(src, dst, lut):
    if src.dtype == types.uint16:
        def impl(src, dst, lut):
            for i in range(dst.size):
                dst[i] = lut[src[i]]
        return impl

    def impl(src, dst, lut):
        for i in range(dst.size):
            dst[i] = src[i]
    return impl


# --------------------------------------------------------------------------
# scores
# --------------------------------------------------------------------------


def block_scores_ref(q, anchor, block_table, lb_start, lb_end, n_slots, G, shared):
    """NumPy reference of :func:`block_scores`."""
    Hq, D = q.shape
    an = anchor[block_table[lb_start:lb_end], :n_slots].astype(np.float32)  # [C, S, Hq, D]
    if shared:
        an = an[:, :, (np.arange(Hq) // G) * G, :]
    return (an * q[None, None].astype(np.float32)).max(axis=1).sum(axis=-1).astype(np.float32)


@njit(parallel=True, cache=True, fastmath=_FM)
def _scores_kernel(q, anc, bt, lb_start, n_slots, G, shared, lut, out):
    C, Hq = out.shape
    D = q.shape[1]
    for i in prange(C):
        pb = bt[lb_start + i]
        a = np.empty((n_slots, D), np.float32)
        a0 = a[0]
        # (loops specialized per slot count so each inner loop vectorizes)
        if n_slots == 1:
            for h in range(Hq):
                if not shared or h % G == 0:  # shared: the group leader's slot serves all G
                    _load_f32(anc[pb, 0, h], a0, lut)
                qh = q[h]
                acc = np.float32(0.0)
                for d in range(D):
                    acc += a0[d] * qh[d]
                out[i, h] = acc
        elif n_slots == 2:
            a1 = a[1]
            for h in range(Hq):
                if not shared or h % G == 0:
                    _load_f32(anc[pb, 0, h], a0, lut)
                    _load_f32(anc[pb, 1, h], a1, lut)
                qh = q[h]
                acc = np.float32(0.0)
                for d in range(D):
                    x = a0[d] * qh[d]
                    y = a1[d] * qh[d]
                    acc += x if x > y else y
                out[i, h] = acc
        else:
            for h in range(Hq):
                if not shared or h % G == 0:
                    for sl in range(n_slots):
                        _load_f32(anc[pb, sl, h], a[sl], lut)
                qh = q[h]
                acc = np.float32(0.0)
                for d in range(D):
                    mx = a[0, d] * qh[d]
                    for sl in range(1, n_slots):
                        y = a[sl, d] * qh[d]
                        mx = mx if mx > y else y
                    acc += mx
                out[i, h] = acc


def block_scores(q, anchor, block_table, lb_start, lb_end, n_slots, G, shared=True,
                 backend="numba"):
    """float32 [lb_end - lb_start, Hq] scores of logical blocks [lb_start, lb_end).

    q: float32 [Hq, D]; anchor: float16 (or float32) [NB][A][Hq][D];
    G: query heads per kv head; shared: anchors identical within a GQA group.
    """
    if backend == "numpy":
        return block_scores_ref(q, anchor, block_table, lb_start, lb_end, n_slots, G, shared)
    q = np.ascontiguousarray(q, dtype=np.float32)
    out = np.empty((max(lb_end - lb_start, 0), q.shape[0]), np.float32)
    anc = anchor.view(np.uint16) if anchor.dtype == np.float16 else anchor
    _scores_kernel(q, anc, block_table, int(lb_start), int(n_slots), int(G), bool(shared),
                   fp16_lut(), out)
    return out


# --------------------------------------------------------------------------
# selection
# --------------------------------------------------------------------------


def _aggregate_ref(scores, nsets):
    """float32 [C, nsets]: per-set sums over heads, added in head order in float32."""
    C, Hq = scores.shape
    hps = Hq // nsets
    agg = np.zeros((C, nsets), np.float32)
    for j in range(hps):
        agg += scores[:, np.arange(nsets) * hps + j]
    return np.where(np.isnan(agg), np.float32(-np.inf), agg)


def select_blocks_ref(scores, nsets, n_ctx, block_len, init, pick, local):
    """NumPy reference of :func:`select_blocks` (stable sort)."""
    F = n_ctx // block_len
    n_lb = -(-n_ctx // block_len)
    K = init + pick + local + 1
    sel = np.full((nsets, K), -1, np.int32)
    cnt = np.zeros(nsets, np.int32)
    if F <= init + pick + local:
        sel[:, :n_lb] = np.arange(n_lb)
        cnt[:] = n_lb
        return sel, cnt
    agg = _aggregate_ref(scores, nsets)  # candidates init..F-local-1
    for si in range(nsets):
        order = np.argsort(-agg[:, si], kind="stable")[:pick]
        chosen = np.concatenate([np.arange(init), init + np.sort(order),
                                 np.arange(F - local, F), np.arange(F, n_lb)])
        sel[si, :chosen.size] = chosen
        cnt[si] = chosen.size
    return sel, cnt


@njit(cache=True)
def _select_one(scores, si, init, pick, local, F, n_lb, sel, cnt):
    """Fill sel[si], cnt[si] for set si (heads [si*hps, (si+1)*hps))."""
    C, Hq = scores.shape
    hps = Hq // sel.shape[0]
    agg = np.zeros(C, np.float32)
    for j in range(hps):
        h = si * hps + j
        for i in range(C):
            agg[i] += scores[i, h]
    for i in range(C):
        if agg[i] != agg[i]:
            agg[i] = -np.inf
    k = 0
    for b in range(init):
        sel[si, k] = b
        k += 1
    if pick > 0:
        kth = np.partition(agg.copy(), C - pick)[C - pick]  # pick-th largest
        need = pick
        for i in range(C):
            if agg[i] > kth:
                need -= 1
        for i in range(C):  # ascending block order; among ties the lower blocks win
            take = agg[i] > kth
            if not take and agg[i] == kth and need > 0:
                take = True
                need -= 1
            if take:
                sel[si, k] = init + i
                k += 1
    for b in range(F - local, n_lb):
        sel[si, k] = b
        k += 1
    cnt[si] = k
    for j in range(k, sel.shape[1]):
        sel[si, j] = -1


@njit(parallel=True, cache=True)
def _select_kernel_par(scores, init, pick, local, F, n_lb, sel, cnt):
    for si in prange(sel.shape[0]):
        _select_one(scores, si, init, pick, local, F, n_lb, sel, cnt)


@njit(cache=True)
def _select_kernel(scores, init, pick, local, F, n_lb, sel, cnt):
    for si in range(sel.shape[0]):
        _select_one(scores, si, init, pick, local, F, n_lb, sel, cnt)


def select_blocks(scores, nsets, n_ctx, block_len, init, pick, local, backend="numba"):
    """Pick blocks from candidate scores.

    scores: float32 [C, Hq], C = F - init - local candidate blocks
    ``init..F-local-1`` (ignored in the dense case). Returns (sel int32
    [nsets, K], cnt int32 [nsets]) as described in the module docstring.
    """
    if backend == "numpy":
        return select_blocks_ref(scores, nsets, n_ctx, block_len, init, pick, local)
    F = n_ctx // block_len
    n_lb = -(-n_ctx // block_len)
    K = init + pick + local + 1
    if F <= init + pick + local:
        sel = np.full((nsets, K), -1, np.int32)
        sel[:, :n_lb] = np.arange(n_lb, dtype=np.int32)
        return sel, np.full(nsets, n_lb, np.int32)
    sel = np.empty((nsets, K), np.int32)
    cnt = np.empty(nsets, np.int32)
    # one set (LAYER) or little work: a parallel region costs more than it saves
    kernel = _select_kernel_par if nsets * scores.shape[0] >= 16384 else _select_kernel
    kernel(np.ascontiguousarray(scores, dtype=np.float32), int(init), int(pick), int(local), F,
           n_lb, sel, cnt)
    return sel, cnt


def retrieve_blocks(q, anchor, block_table, n_ctx, block_len, n_kv_heads,
                    retrieval_type=RetrievalType.LAYER, init_block_num=1, pick_block_num=8,
                    local_block_num=2, anchor_type=AnchorType.QUEST, backend="numba"):
    """Score the candidate blocks and select (sel int32 [nsets, K], cnt int32 [nsets]).

    q: float32 [Hq, D] (post-RoPE, as attention sees it); anchor: float16
    [NB][A][Hq][D] of the layer; block_table: int32 [NB_logical].
    """
    Hq = q.shape[0]
    G = Hq // n_kv_heads
    nsets = n_sets(retrieval_type, Hq, n_kv_heads)
    F = n_ctx // block_len
    init, pick, local = init_block_num, pick_block_num, local_block_num
    if F <= init + pick + local:
        scores = np.empty((0, Hq), np.float32)
    else:
        scores = block_scores(q, anchor, block_table, init, F - local,
                              anchor_slots(anchor_type, anchor.shape[1]), G,
                              group_shared(anchor_type), backend)
    return select_blocks(scores, nsets, n_ctx, block_len, init, pick, local, backend)
