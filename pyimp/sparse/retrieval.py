"""Block retrieval: score blocks against the query and pick the ones to attend.

Score (docs/kvcache.md section 6), for logical block b and query head h::

    s[b, h] = sum_d max_a(anchor[block_table[b]][a][h][d] * q[h][d])

over the first ``n_slots`` anchor slots (see ``anchors.anchor_slots``). With
``shared`` (every anchor type but DYNAMIC) the G query heads of a kv head hold
identical anchors, so only one slot per kv head is read: the group leader's
(head ``j*G``) of an anchor buffer laid out per query head ``[NB][A][Hq][D]``,
or slot ``j`` of one laid out per kv head ``[NB][A][Hkv][D]`` (how the engine
stores shared anchors).

Granularity: LAYER ranks blocks by ``sum_h s``, one set for all heads; KVHEAD
by the sum over a kv head's G query heads, one set per kv head; QHEAD one set
per query head. Set ``i`` serves query heads ``[i*Hq/nsets, (i+1)*Hq/nsets)``.

Set scores ``S[b, i] = sum over the set's heads of s[b, h]`` are computed
directly from "compressed" queries when anchors are shared and either have
one slot or two ordered slots (slot 0 >= slot 1 per channel, as QUEST and
CUBOID_MEAN store them). Then ``max(a0*x, a1*x)`` is ``a0*x`` for ``x >= 0``
and ``a1*x`` otherwise, so the sum over the heads of kv head j in set i is::

    a0_j . Q+[i, j] + a1_j . Q-[i, j],   Q+- = sum of max(q_h, 0) / min(q_h, 0)

(one-slot: ``a_j . sum_h q_h``): G times less work for LAYER and KVHEAD, the
same values up to float32 rounding. Other anchors fall back to per-head
scores summed in float32.

Selection for ``n_ctx`` tokens, ``F = n_ctx // B`` full blocks: blocks
``0..init-1`` (sinks), the ``pick`` best-scoring of ``init..F-local-1`` (ties:
lower block first), the last ``local`` full blocks ``F-local..F-1`` and the
partial tail ``F`` if ``n_ctx % B``. The block holding the newest token (the
query's own) is always selected: it is the partial tail, or, when ``n_ctx % B
== 0``, block ``F-1``, which with ``local == 0`` is then taken out of the
candidates and selected like a local block (``local_eff = 1``). So every
selection attends at least the query's own token, even with
``init = pick = local = 0``. If ``F <= init + pick + local`` every block is
selected (dense). Result: int32 ``sel[nsets, K]`` of logical block ids in
ascending order, padded with -1, ``K = init + pick + local + 1``, and int32
``cnt[nsets]``.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from loaders import jit
from pyimp.attention import kernels as attn_kernels, checks
from loaders.half import lane_dot, lane_sum
from pyimp.attention.kernels import FM as _FM, load_f32, prefetch
from pyimp.choices import RetrievalType
from pyimp.sparse.anchors import AnchorType, anchor_slots, group_shared
from pyimp.attention.importance import fp16_lut

jit.kernel_module(__file__, attn_kernels)

ORDERED_ANCHORS = (AnchorType.QUEST, AnchorType.CUBOID_MEAN)  # slot 0 >= slot 1 per channel


def n_sets(retrieval_type: RetrievalType, n_q_heads: int, n_kv_heads: int) -> int:
    """Number of block sets a granularity produces."""
    return {RetrievalType.LAYER: 1, RetrievalType.KVHEAD: n_kv_heads,
            RetrievalType.QHEAD: n_q_heads}[retrieval_type]


def _anchor_view(anchor):
    return anchor.view(np.uint16) if anchor.dtype == np.float16 else anchor


# --------------------------------------------------------------------------
# per-head scores
# --------------------------------------------------------------------------


def anchor_heads(Hq: int, G: int, Ha: int, shared: bool) -> np.ndarray:
    """int [Hq]: the anchor head each query head reads. Shared types: its group's slot, j*G
    (per-query-head layout, Ha = Hq) or j (per kv head, Ha = Hkv); else its own."""
    return (np.arange(Hq) // G) * (Ha * G // Hq) if shared else np.arange(Hq)


def block_scores_ref(q, anchor, block_table, lb_start, lb_end, n_slots, G, shared):
    """NumPy reference of :func:`block_scores`."""
    Hq, D = q.shape
    an = anchor[block_table[lb_start:lb_end], :n_slots].astype(np.float32)  # [C, S, Ha, D]
    an = an[:, :, anchor_heads(Hq, G, anchor.shape[2], shared), :]
    return (an * q[None, None].astype(np.float32)).max(axis=1).sum(axis=-1).astype(np.float32)


@jit.njit(fastmath=_FM, inline="always")
def _load_anchors(anc, bt, lb_start, i, C, astep, a, lut, pf_step):
    """a[j, sl] = float32 anchor slot sl of lead j (buffer head j * astep) of logical block
    lb_start + i, every row decoded first (independent loads overlap); the next block's rows,
    scattered lines, are prefetched."""
    nlead, n_slots, D = a.shape
    if i + 1 < C:
        pn = bt[lb_start + i + 1]
        for j in range(nlead):
            for sl in range(n_slots):
                for e in range(0, D, pf_step):
                    prefetch(anc[pn, sl, j * astep], e)
    pb = bt[lb_start + i]
    for j in range(nlead):
        for sl in range(n_slots):
            load_f32(anc[pb, sl, j * astep], 0, D, a[j, sl], lut)


@jit.njit(parallel=True, fastmath=_FM)
def _scores_kernel(q, anc, bt, lb_start, n_slots, G, shared, astep, lut, out, pf_step):
    C, Hq = out.shape
    D = q.shape[1]
    step = G if shared else 1  # shared: the group leader's slot serves all G heads
    nlead = Hq // step         # lead j's anchor is head j * astep of the buffer
    for i in prange(C):
        a = np.empty((nlead, n_slots, D), np.float32)
        mx = np.empty(D, np.float32)
        _load_anchors(anc, bt, lb_start, i, C, astep, a, lut, pf_step)
        # (loops specialized per slot count so each inner loop vectorizes; sums in
        # lane_dot / lane_sum's fixed order)
        if n_slots == 1:
            for h in range(Hq):
                out[i, h] = lane_dot(a[h // step, 0], 0, q[h], 0, D)
        elif n_slots == 2:
            for h in range(Hq):
                a0 = a[h // step, 0]
                a1 = a[h // step, 1]
                qh = q[h]
                for d in range(D):
                    x = a0[d] * qh[d]
                    y = a1[d] * qh[d]
                    mx[d] = x if x > y else y
                out[i, h] = lane_sum(mx, 0, D)
        else:
            for h in range(Hq):
                ah = a[h // step]
                qh = q[h]
                for d in range(D):
                    m = ah[0, d] * qh[d]
                    for sl in range(1, n_slots):
                        y = ah[sl, d] * qh[d]
                        m = m if m > y else y
                    mx[d] = m
                out[i, h] = lane_sum(mx, 0, D)


def block_scores(q: np.ndarray, anchor: np.ndarray, block_table: np.ndarray, lb_start: int,
                 lb_end: int, n_slots: int, G: int, shared: bool = True,
                 backend: str = "numba") -> np.ndarray:
    """float32 [lb_end - lb_start, Hq] per-head scores of logical blocks [lb_start, lb_end).

    q: float32 [Hq, D]; anchor: float16 (or float32) [NB][A][Hq][D];
    G: query heads per kv head; shared: anchors identical within a GQA group.
    """
    astep = _check_scores(q, anchor, block_table, lb_start, lb_end, n_slots, G, shared)
    if backend == "numpy":
        return block_scores_ref(q, anchor, block_table, lb_start, lb_end, n_slots, G, shared)
    return _block_scores_run(q, anchor, block_table, lb_start, lb_end, n_slots, G, shared, astep)


def _block_scores_run(q, anchor, block_table, lb_start, lb_end, n_slots, G, shared, astep):
    """:func:`block_scores`' kernel call, its arguments checked (astep from _check_scores)."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    out = np.empty((max(lb_end - lb_start, 0), q.shape[0]), np.float32)
    anc = _anchor_view(anchor)
    _scores_kernel(q, anc, block_table, int(lb_start), int(n_slots), int(G), bool(shared),
                   astep, fp16_lut(), out, 64 // anc.itemsize)
    return out


def check_anchor_heads(Ha: int, Hq: int, G: int, shared: bool) -> int:
    """Refuse (ValueError) anchors of Ha heads for Hq query heads in groups of G; returns Hkv."""
    if G < 1 or Hq % G:
        raise ValueError(f"G = {G} query heads per kv head does not divide the {Hq} query heads")
    Hkv = Hq // G
    if not (Ha == Hq or (shared and Ha == Hkv)):
        raise ValueError(f"anchor has {Ha} heads: expected {Hq} (per query head)"
                         + (f" or {Hkv} (per kv head)" if shared else
                            " (anchors that differ within a GQA group are stored per query head)"))
    return Hkv


def _check_scores(q, anchor, block_table, lb_start, lb_end, n_slots, G, shared) -> int:
    """Validate a scoring call; returns the anchor-head stride of a group leader (astep)."""
    checks.array("anchor", anchor, (np.float16, np.float32), 4, layout="[NB][A][Ha][D]")
    NB, A, Ha, D = anchor.shape
    if not isinstance(q, np.ndarray) or q.ndim != 2 or q.shape[1] != D:
        raise ValueError(f"q must be a float array [Hq, {D}] (the anchors' head dim), got "
                         f"{checks._desc(q)}")
    Hq = q.shape[0]
    Hkv = check_anchor_heads(Ha, Hq, G, shared)
    checks.count("n_slots", n_slots, 1, A)
    if not 0 <= int(lb_start) <= int(lb_end):
        raise ValueError(f"block range [{lb_start}, {lb_end}) is not a range of logical blocks")
    checks.array("block_table", block_table, np.int32, 1, layout="[NB_logical]")
    if lb_end > lb_start:
        checks.block_table(block_table[lb_start:lb_end], lb_end - lb_start, NB,
                           name=f"block_table[{lb_start}:{lb_end}]")
    return Ha // Hkv if shared else 1


# --------------------------------------------------------------------------
# set scores (what selection ranks)
# --------------------------------------------------------------------------


@jit.njit(parallel=True, fastmath=_FM)
def _set_scores_kernel(q, anc, bt, lb_start, G, n_slots, astep, lut, out, pf_step):
    C, nsets = out.shape
    Hq, D = q.shape
    Hkv = Hq // G
    hps = Hq // nsets
    # compressed queries Q+ / Q- (module docstring), built serially: Hq*D adds
    qc = np.zeros((nsets, Hkv, n_slots, D), np.float32)
    for h in range(Hq):
        dst = qc[h // hps, h // G]
        qh = q[h]
        for d in range(D):
            x = qh[d]
            if n_slots == 1:
                dst[0, d] += x
            elif x >= 0.0:
                dst[0, d] += x
            else:
                dst[1, d] += x
    for i in prange(C):
        a = np.empty((Hkv, n_slots, D), np.float32)
        _load_anchors(anc, bt, lb_start, i, C, astep, a, lut, pf_step)
        for si in range(nsets):
            acc = np.float32(0.0)
            # kv heads touched by the set's query heads [si*hps, (si+1)*hps)
            for j in range((si * hps) // G, ((si + 1) * hps - 1) // G + 1):
                for sl in range(n_slots):
                    acc += lane_dot(a[j, sl], 0, qc[si, j, sl], 0, D)
            out[i, si] = acc


def set_scores_ref(q, anchor, block_table, lb_start, lb_end, nsets, n_slots, G, shared):
    """NumPy reference of :func:`set_scores`: per-head scores summed over each set (float64)."""
    s = block_scores_ref(q, anchor, block_table, lb_start, lb_end, n_slots, G, shared)
    C, Hq = s.shape
    return s.astype(np.float64).reshape(C, nsets, Hq // nsets).sum(axis=2).astype(np.float32)


def set_scores(q: np.ndarray, anchor: np.ndarray, block_table: np.ndarray, lb_start: int,
               lb_end: int, nsets: int, n_slots: int, G: int, shared: bool = True,
               ordered: bool = False, backend: str = "numba") -> np.ndarray:
    """float32 [lb_end - lb_start, nsets] set scores of logical blocks [lb_start, lb_end).

    ordered: two-slot anchors satisfy slot 0 >= slot 1 per channel (QUEST,
    CUBOID_MEAN), which enables the compressed-query path with ``shared``.
    """
    astep = _check_scores(q, anchor, block_table, lb_start, lb_end, n_slots, G, shared)
    Hq = q.shape[0]
    if nsets < 1 or Hq % nsets:
        raise ValueError(f"nsets = {nsets} does not divide the {Hq} query heads")
    if backend == "numpy":
        return set_scores_ref(q, anchor, block_table, lb_start, lb_end, nsets, n_slots, G, shared)
    return _set_scores_run(q, anchor, block_table, lb_start, lb_end, nsets, n_slots, G, shared,
                           ordered, astep)


def _set_scores_run(q, anchor, block_table, lb_start, lb_end, nsets, n_slots, G, shared, ordered,
                    astep):
    """:func:`set_scores`' kernels, their arguments checked (astep from _check_scores)."""
    C = max(lb_end - lb_start, 0)
    if shared and (n_slots == 1 or (n_slots == 2 and ordered)):
        out = np.empty((C, nsets), np.float32)
        anc = _anchor_view(anchor)
        _set_scores_kernel(np.ascontiguousarray(q, dtype=np.float32), anc, block_table,
                           int(lb_start), int(G), int(n_slots), astep, fp16_lut(), out,
                           64 // anc.itemsize)
        return out
    s = _block_scores_run(q, anchor, block_table, lb_start, lb_end, n_slots, G, shared, astep)
    return s.reshape(C, nsets, q.shape[0] // nsets).sum(axis=2, dtype=np.float32)


# --------------------------------------------------------------------------
# selection
# --------------------------------------------------------------------------


def recent_blocks(n_ctx: int, block_len: int, local: int) -> int:
    """Full blocks at the end that are always selected: ``local``, or 1 when ``local == 0``
    and the newest token (the query's own) just filled block ``F-1``."""
    return local if local > 0 or n_ctx % block_len else 1


def n_candidates(n_ctx: int, block_len: int, init: int, local: int) -> int:
    """Number of scored candidate blocks ``init .. F - recent_blocks - 1`` (>= 0)."""
    return max(n_ctx // block_len - init - recent_blocks(n_ctx, block_len, local), 0)


def select_blocks_ref(scores, n_ctx, block_len, init, pick, local):
    """NumPy reference of :func:`select_blocks` (stable sort)."""
    nsets = scores.shape[1]
    F = n_ctx // block_len
    n_lb = -(-n_ctx // block_len)
    K = init + pick + local + 1
    sel = np.full((nsets, K), -1, np.int32)
    cnt = np.zeros(nsets, np.int32)
    if F <= init + pick + local:
        sel[:, :n_lb] = np.arange(n_lb)
        cnt[:] = n_lb
        return sel, cnt
    loc = recent_blocks(n_ctx, block_len, local)
    agg = np.where(np.isnan(scores), np.float32(-np.inf), scores)
    for si in range(nsets):
        order = np.argsort(-agg[:, si], kind="stable")[:pick]
        chosen = np.concatenate([np.arange(init), init + np.sort(order),
                                 np.arange(F - loc, F), np.arange(F, n_lb)])
        sel[si, :chosen.size] = chosen
        cnt[si] = chosen.size
    return sel, cnt


@jit.njit
def _select_one(scores, si, init, pick, local, F, n_lb, sel, cnt):
    """Fill sel[si], cnt[si] from column si of the set scores."""
    C = scores.shape[0]
    agg = np.empty(C, np.float32)
    for i in range(C):
        x = scores[i, si]
        agg[i] = x if x == x else -np.inf  # NaN ranks last
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


@jit.njit(parallel=True)
def _select_kernel(scores, init, pick, local, F, n_lb, sel, cnt, parallel):
    if parallel:
        for si in prange(sel.shape[0]):
            _select_one(scores, si, init, pick, local, F, n_lb, sel, cnt)
    else:
        for si in range(sel.shape[0]):
            _select_one(scores, si, init, pick, local, F, n_lb, sel, cnt)


def select_blocks(scores: np.ndarray, n_ctx: int, block_len: int, init: int, pick: int,
                  local: int, backend: str = "numba") -> tuple[np.ndarray, np.ndarray]:
    """Pick blocks per set from set scores.

    scores: float32 [C, nsets] for the C = F - init - local candidate blocks
    ``init..F-local-1`` (ignored in the dense case). Returns (sel int32
    [nsets, K], cnt int32 [nsets]) as described in the module docstring.
    """
    check_budget(n_ctx, block_len, init, pick, local)
    F = n_ctx // block_len
    if not isinstance(scores, np.ndarray) or scores.ndim != 2 or scores.shape[1] < 1:
        raise ValueError(f"scores must be a float array [C, nsets], got {checks._desc(scores)}")
    if F > init + pick + local and scores.shape[0] != n_candidates(n_ctx, block_len, init, local):
        raise ValueError(f"scores has {scores.shape[0]} rows, expected one per candidate block "
                         f"({n_candidates(n_ctx, block_len, init, local)}: blocks {init}.."
                         f"{F - recent_blocks(n_ctx, block_len, local) - 1})")
    if backend == "numpy":
        return select_blocks_ref(scores, n_ctx, block_len, init, pick, local)
    nsets = scores.shape[1]
    n_lb = -(-n_ctx // block_len)
    K = init + pick + local + 1
    if F <= init + pick + local:
        sel = np.full((nsets, K), -1, np.int32)
        sel[:, :n_lb] = np.arange(n_lb, dtype=np.int32)
        return sel, np.full(nsets, n_lb, np.int32)
    return _select_run(scores, n_ctx, block_len, init, pick, local)


def _select_run(scores, n_ctx, block_len, init, pick, local):
    """:func:`select_blocks`' kernel for a context of more blocks than the budget, its
    arguments checked."""
    nsets, F = scores.shape[1], n_ctx // block_len
    n_lb = -(-n_ctx // block_len)
    K = init + pick + local + 1
    sel = np.empty((nsets, K), np.int32)
    cnt = np.empty(nsets, np.int32)
    # one set (LAYER) or little work: a parallel region costs more than it saves
    _select_kernel(np.asarray(scores, dtype=np.float32), int(init), int(pick),
                   recent_blocks(n_ctx, block_len, local), F, n_lb, sel, cnt,
                   nsets * scores.shape[0] >= 16384)
    return sel, cnt


def check_budget(n_ctx, block_len, init, pick, local) -> None:
    if int(block_len) < 1:
        raise ValueError(f"block_len must be >= 1, got {block_len}")
    if int(n_ctx) < 1:
        raise ValueError(f"n_ctx must be >= 1 (the query's own token is cached), got {n_ctx}")
    for name, v in (("init_block_num", init), ("pick_block_num", pick), ("local_block_num", local)):
        if int(v) < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")


def retrieve_blocks(q: np.ndarray, anchor: np.ndarray, block_table: np.ndarray, n_ctx: int,
                    block_len: int, n_kv_heads: int,
                    retrieval_type: RetrievalType = RetrievalType.LAYER, init_block_num: int = 1,
                    pick_block_num: int = 8, local_block_num: int = 2,
                    anchor_type: AnchorType = AnchorType.QUEST,
                    backend: str = "numba") -> tuple[np.ndarray, np.ndarray]:
    """Score the candidate blocks and select (sel int32 [nsets, K], cnt int32 [nsets]).

    q: float32 [Hq, D] (post-RoPE, as attention sees it); anchor: float16
    [NB][A][Hq][D] of the layer (or [NB][A][Hkv][D] for the group-shared types),
    built with ``anchor_type``; block_table: int32 [NB_logical].
    """
    init, pick, local = init_block_num, pick_block_num, local_block_num
    check_budget(n_ctx, block_len, init, pick, local)
    Hq = q.shape[0]
    if n_kv_heads < 1 or Hq % n_kv_heads:
        raise ValueError(f"n_kv_heads = {n_kv_heads} does not divide the {Hq} query heads")
    G = Hq // n_kv_heads
    nsets = n_sets(retrieval_type, Hq, n_kv_heads)
    F = n_ctx // block_len
    # the selection names every block of the context: all of them must be reserved
    checks.array("anchor", anchor, (np.float16, np.float32), 4, layout="[NB][A][Ha][D]")
    checks.block_table(block_table, -(-n_ctx // block_len), anchor.shape[0])
    if F <= init + pick + local:
        scores = np.empty((0, nsets), np.float32)
    else:
        lb_end = F - recent_blocks(n_ctx, block_len, local)
        scores = set_scores(q, anchor, block_table, init, lb_end, nsets,
                            anchor_slots(anchor_type, anchor.shape[1]), G,
                            group_shared(anchor_type), anchor_type in ORDERED_ANCHORS, backend)
    return select_blocks(scores, n_ctx, block_len, init, pick, local, backend)


def retrieve_unchecked(q: np.ndarray, anchor: np.ndarray, block_table: np.ndarray, n_ctx: int,
                       block_len: int, nsets: int, G: int, init: int, pick: int, local: int,
                       anchor_type: AnchorType) -> tuple[np.ndarray, np.ndarray]:
    """:func:`retrieve_blocks`' selection when the context has more blocks than the budget,
    without its argument checks: for callers whose arrays are the cache's own, checked when
    they were made (the sparse decode step, three layers a token for Gemma 3, where the
    checks' reductions cost as much as the scoring). The same kernel calls
    (:func:`_set_scores_run`, :func:`_select_run`), so the same (sel, cnt) as retrieve_blocks
    (the tests hold them equal). ``nsets`` = :func:`n_sets`, ``G`` query heads per kv head."""
    lb_end = n_ctx // block_len - recent_blocks(n_ctx, block_len, local)
    shared = group_shared(anchor_type)
    astep = anchor.shape[2] // (q.shape[0] // G) if shared else 1
    scores = _set_scores_run(q, anchor, block_table, init, lb_end, nsets,
                             anchor_slots(anchor_type, anchor.shape[1]), G, shared,
                             anchor_type in ORDERED_ANCHORS, astep)
    return _select_run(scores, n_ctx, block_len, init, pick, local)


# --------------------------------------------------------------------------
# recall-targeted budget
# --------------------------------------------------------------------------


def block_center_logits(q: np.ndarray, anchor: np.ndarray, block_table: np.ndarray,
                        n_valid: np.ndarray, anchor_type, G: int) -> np.ndarray:
    """float32 [n_lb, Hq]: each query head's dot product with the centre of each logical
    block's anchor (n_lb = len(n_valid), the valid tokens of each block): ``(max + min) / 2``
    for QUEST and CUBOID_MEAN, the mean key for BLOCK_MEAN and FIXED, the summed keys over
    their count for DYNAMIC, the per-channel max for BLOCK_MAX.

    A block's typical logit, where the selection score is its largest: the recall target
    estimates mass from it (:func:`estimated_mass`). Layout and GQA mapping as
    :func:`block_scores`; for every type the centre of a block whose keys are all equal is
    that key."""
    n_lb = len(n_valid)
    n_slots = anchor_slots(anchor_type, anchor.shape[1])
    shared = group_shared(anchor_type)
    _check_scores(q, anchor, block_table, 0, n_lb, n_slots, G, shared)
    Hq = q.shape[0]
    lead, inv = np.unique(anchor_heads(Hq, G, anchor.shape[2], shared), return_inverse=True)
    an = anchor[np.asarray(block_table[:n_lb])[:, None, None], np.arange(n_slots)[None, :, None],
                lead[None, None, :]].astype(np.float32)           # [n_lb, S, L, D]
    centre = an.mean(axis=1) if n_slots > 1 else an[:, 0]
    q = np.asarray(q, np.float32)
    out = np.empty((n_lb, Hq), np.float32)
    for j in range(lead.size):
        hs = np.flatnonzero(inv == j)
        out[:, hs] = centre[:, j] @ q[hs].T
    if anchor_type == AnchorType.DYNAMIC:      # the sum of the block's min(A, n) hottest keys
        out /= np.maximum(np.minimum(anchor.shape[1], np.asarray(n_valid)), 1)[:, None]
    return out


def estimated_mass(logits: np.ndarray, heads_per_set: int, scale: float,
                   n_valid: np.ndarray) -> np.ndarray:
    """Estimated share of each set's softmax mass in each block: float64 [n_blocks, nsets],
    every column summing to 1 (zero where no block is finite).

    logits: [n_blocks, Hq] per-head typical q.k of each block (:func:`block_center_logits`;
    NaN or -inf: no keys). A block of n tokens is taken to weigh ``n * exp(scale * logit)``
    for each head; each head's weights are normalized over the blocks (recall is measured
    per head, and heads differ in scale) and a set's share is the mean over its heads.
    Exact when every key of a block equals its centre. Measured on Gemma 3 270M at 2k and
    4k context: selecting to 0.95 by this estimate captured 0.954 / 0.936 of the dense
    mass; the selection score (the anchors' upper bound on the largest logit) in its
    place, summed over the set, 0.904 / 0.834."""
    u = np.where(np.isnan(logits), -np.inf, np.asarray(logits, np.float64)) * scale
    nb, Hq = u.shape
    if Hq % heads_per_set:
        raise ValueError(f"{heads_per_set} heads per set do not divide the {Hq} heads")
    with np.errstate(divide="ignore"):
        lw = u + np.log(np.asarray(n_valid, np.float64))[:, None]
    top = lw.max(axis=0, keepdims=True) if nb else np.zeros((1, Hq))
    top = np.where(np.isfinite(top), top, 0.0)
    w = np.exp(lw - top)
    tot = w.sum(axis=0, keepdims=True)
    share = np.divide(w, tot, out=np.zeros_like(w), where=tot > 0)
    return share.reshape(nb, Hq // heads_per_set, heads_per_set).mean(axis=2)


def select_for_recall(logits: np.ndarray, n_ctx: int, block_len: int, init: int, local: int,
                      heads_per_set: int, scale: float, target: float, floor: int,
                      ceiling: int, tokens: np.ndarray | None = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks per set in estimated-mass order until the estimated captured mass reaches
    ``target``.

    logits: float32 [n_lb, Hq], every logical block's per-head typical logit (the partial
    tail's included; :func:`block_center_logits`); sets are runs of ``heads_per_set`` heads.
    The sinks, the ``local`` recent blocks and the tail are always selected and count
    toward the estimate (:func:`estimated_mass`); then candidates join heaviest first
    (ties: lower block) until the estimate reaches the target, at least ``floor`` and at
    most ``ceiling`` of them (ceiling 0: no limit). Returns (sel int32 [nsets, K], cnt
    int32 [nsets], the estimated recall float64 [nsets]); sel ascending and -1 padded as
    :func:`select_blocks`. tokens: the tokens each block stands for (default: its valid
    slots; with merged slots, the sum of their multiplicities).
    """
    F = n_ctx // block_len
    n_lb = -(-n_ctx // block_len)
    if logits.shape[0] != n_lb:
        raise ValueError(f"logits has {logits.shape[0]} rows, expected one per block ({n_lb})")
    if not 0.0 < target <= 1.0:
        raise ValueError(f"recall target must be in (0, 1], got {target}")
    if tokens is None:
        tokens = np.minimum(block_len, n_ctx - np.arange(n_lb) * block_len)
    w = estimated_mass(logits, heads_per_set, scale, tokens)
    nsets = w.shape[1]
    loc = recent_blocks(n_ctx, block_len, local)
    forced = np.zeros(n_lb, bool)
    forced[:min(init, n_lb)] = True
    forced[max(F - loc, 0):] = True
    cand = np.flatnonzero(~forced)
    ceil = cand.size if ceiling <= 0 else min(ceiling, cand.size)
    chosen, est = [], np.empty(nsets)
    for si in range(nsets):
        total = w[:, si].sum()
        have = w[forced, si].sum()
        order = cand[np.lexsort((cand, -w[cand, si]))]          # mass desc, lower block first
        got = np.cumsum(w[order, si]) + have
        thr = target * total * (1 - 1e-12)
        need = 0 if have >= thr else int(np.searchsorted(got, thr)) + 1
        k = min(max(need, floor), ceil)
        pick = np.sort(order[:k])
        chosen.append(np.sort(np.concatenate([np.flatnonzero(forced), pick])))
        est[si] = (have + w[pick, si].sum()) / total if total > 0 else 1.0
    K = max(c.size for c in chosen)
    sel = np.full((nsets, K), -1, np.int32)
    cnt = np.empty(nsets, np.int32)
    for si, c in enumerate(chosen):
        sel[si, :c.size] = c
        cnt[si] = c.size
    return sel, cnt, est
