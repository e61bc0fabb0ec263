"""Block-sparse decode attention over the selected blocks of the paged cache.

Inputs are the dense decode's (see ``pyimp.attention``) plus a selection from
``retrieval``: ``sel`` int32 [nsets, K] logical block ids (-1 padded) and
``cnt`` int32 [nsets]; query head h uses set ``h // (Hq // nsets)``.

A block's partial is its local max ``m``, the sum ``l = sum exp(s - m)`` and
the unnormalized output ``o = sum exp(s - m) v``; partials merge with the
max-stabilized rule::

    m = max(m1, m2);  l = l1 e^(m1-m) + l2 e^(m2-m);  o = o1 e^(m1-m) + o2 e^(m2-m)

The Numba kernel folds each work item's blocks into a running partial with
this rule (online softmax) and merges the per-thread partials serially; the
NumPy reference forms every block's partial and merges them in order.

With every block selected it equals dense attention to float32 rounding, in
any block order. Masks are the dense ones (causal to n_ctx, sliding window).
Importance receives this step's probabilities on attended tokens only.
"""
from __future__ import annotations

import llvmlite.binding as llvm_binding
import numba
import numpy as np
from llvmlite import ir as llvm_ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from pyimp.sparse import checks
from pyimp.sparse.importance import (fp16_lut, importance_update, importance_update_blocks,
                                     kernel_view)

_FM = {"reassoc", "contract", "nsz"}  # no nnan/ninf: -inf masks keep their meaning

# llvm.prefetch is overloaded on the pointer type: opaque pointers from LLVM 15 on
_PREFETCH_NAME = ("llvm.prefetch.p0" if llvm_binding.llvm_version_info[0] >= 15
                  else "llvm.prefetch.p0i8")


@intrinsic
def _prefetch(typingctx, arr, idx):
    """Cache-line prefetch hint for ``arr[idx]`` (no effect on results)."""
    sig = types.void(arr, idx)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        i8p = llvm_ir.IntType(8).as_pointer()
        i32 = llvm_ir.IntType(32)
        fnty = llvm_ir.FunctionType(llvm_ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, _PREFETCH_NAME)
        # read access, high temporal locality, data cache
        builder.call(fn, [builder.bitcast(ptr, i8p), llvm_ir.Constant(i32, 0),
                          llvm_ir.Constant(i32, 3), llvm_ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


def _load_f32(src, start, n, dst, lut):
    """dst[start:start+n] = float32 value of src[start:start+n] (fp16 bits or float32)."""
    if src.dtype == np.uint16:
        dst[start:start + n] = lut[src[start:start + n]]
    else:
        dst[start:start + n] = src[start:start + n]


@overload(_load_f32)
def _load_f32_ov(src, start, n, dst, lut):
    if src.dtype == types.uint16:
        def impl(src, start, n, dst, lut):
            s = src[start:start + n]
            d = dst[start:start + n]
            for i in range(n):
                d[i] = lut[s[i]]
        return impl

    def impl(src, start, n, dst, lut):
        s = src[start:start + n]
        d = dst[start:start + n]
        for i in range(n):
            d[i] = s[i]
    return impl


# --------------------------------------------------------------------------
# partial-softmax algebra (NumPy): a partial is (m, l, o)
# --------------------------------------------------------------------------


def block_partial(s, v):
    """Partial of one block: scores s float32 [n] (-inf = masked), values v [n, D]."""
    m = np.max(s) if s.size else np.float32(-np.inf)
    if not np.isfinite(m):
        return np.float32(-np.inf), np.float32(0.0), np.zeros(v.shape[1], np.float32)
    e = np.exp(s - m).astype(np.float32)
    return np.float32(m), np.float32(e.sum()), (e @ v).astype(np.float32)


def merge_partials(a, b):
    """Max-stabilized merge of two partials (m, l, o)."""
    m1, l1, o1 = a
    m2, l2, o2 = b
    m = max(m1, m2)
    if m == -np.inf:
        return m, np.float32(0.0), o1 * 0
    f1 = np.float32(np.exp(m1 - m)) if m1 > -np.inf else np.float32(0.0)
    f2 = np.float32(np.exp(m2 - m)) if m2 > -np.inf else np.float32(0.0)
    return np.float32(m), np.float32(l1 * f1 + l2 * f2), (o1 * f1 + o2 * f2).astype(np.float32)


# --------------------------------------------------------------------------
# NumPy reference
# --------------------------------------------------------------------------


def sparse_attention_decode_ref(q, k_cache, v_cache, block_table, n_ctx, scale, window, sel, cnt,
                                out, probs=None):
    """NumPy reference: per-block partials merged in selection order.

    Returns float32 [Hq] log-sum-exp; fills probs float32 [Hq, K, B] if given.
    """
    Hq, D = q.shape
    Hkv = k_cache.shape[0]
    B = k_cache.shape[2] // D
    G = Hq // Hkv
    hps = Hq // sel.shape[0]
    lo = 0 if window <= 0 else max(0, n_ctx - window)
    kb = k_cache.reshape(Hkv, -1, B, D)
    vb = v_cache.reshape(Hkv, -1, D, B)
    lse = np.empty(Hq, np.float32)
    for h in range(Hq):
        si = h // hps
        parts, scores = [], []
        for k in range(cnt[si]):
            lb = sel[si, k]
            pb = block_table[lb]
            pos = lb * B + np.arange(B)
            ok = (pos < n_ctx) & (pos >= lo)
            K = np.where(ok[:, None], kb[h // G, pb].astype(np.float32), 0.0)
            V = np.where(ok[:, None], vb[h // G, pb].astype(np.float32).T, 0.0)
            s = np.where(ok, (K @ q[h].astype(np.float32)) * np.float32(scale), -np.inf)
            s = s.astype(np.float32)
            scores.append(s)
            parts.append(block_partial(s, V))
        tot = (np.float32(-np.inf), np.float32(0.0), np.zeros(D, np.float32))
        for p in parts:
            tot = merge_partials(tot, p)
        m, l, o = tot
        out[h] = o / l if l > 0 else 0.0
        lse[h] = m + np.log(l) if l > 0 else -np.inf
        if probs is not None:
            probs[h] = 0.0
            for k, s in enumerate(scores):
                probs[h, k] = np.exp(s - lse[h])
    return lse


# --------------------------------------------------------------------------
# Numba kernel
# --------------------------------------------------------------------------


@njit(parallel=True, cache=True, fastmath=_FM)
def _sparse_decode_kernel(q, kc, vc, bt, n_ctx, scale, window, lut, sel, cnt, nsplit, out, lse,
                          store, probs, pf_step):
    """Work item = (unit, split of its selected blocks); a unit is the query heads of one
    kv head that share a set (G heads for LAYER/KVHEAD, one head for QHEAD)."""
    Hq, D = q.shape
    Hkv = kc.shape[0]
    B = kc.shape[2] // D
    G = Hq // Hkv
    nsets = sel.shape[0]
    hps = Hq // nsets
    nh = min(hps, G)
    nunits = Hq // nh
    lo = 0
    if window > 0:
        lo = max(0, n_ctx - window)
    sc = np.float32(scale)
    Kw = sel.shape[1]
    m_part = np.full((Hq, nsplit), -np.inf, np.float32)
    l_part = np.zeros((Hq, nsplit), np.float32)
    o_part = np.zeros((Hq, nsplit, D), np.float32)
    bmax = np.empty((Hq, Kw), np.float32)
    for w in prange(nunits * nsplit):
        u = w // nsplit
        sp = w - u * nsplit
        h0 = u * nh
        kvh = h0 // G
        si = h0 // hps
        c = cnt[si]
        per = (c + nsplit - 1) // nsplit
        k_beg = sp * per
        k_end = min(c, k_beg + per)
        kb = np.empty(B * D, np.float32)
        vb = np.empty(D * B, np.float32)
        s = np.empty((nh, B), np.float32)
        m = np.full(nh, -np.inf, np.float32)
        l = np.zeros(nh, np.float32)
        o = np.zeros((nh, D), np.float32)
        for k in range(k_beg, k_end):
            if k + 1 < k_end:  # selected blocks are scattered: prefetch the next one
                pn = bt[sel[si, k + 1]]
                kn = kc[kvh, pn]
                vn = vc[kvh, pn]
                for e in range(0, kn.size, pf_step):
                    _prefetch(kn, e)
                    _prefetch(vn, e)
            lb = sel[si, k]
            pb = bt[lb]
            base = lb * B
            t0 = max(lo - base, 0)
            t1 = max(min(n_ctx - base, B), t0)  # a fully masked block is an empty range
            _load_f32(kc[kvh, pb], t0 * D, (t1 - t0) * D, kb, lut)
            vrow = vc[kvh, pb]
            if t1 - t0 == B:  # full block: one contiguous decode
                _load_f32(vrow, 0, D * B, vb, lut)
            else:
                for d in range(D):
                    _load_f32(vrow, d * B + t0, t1 - t0, vb, lut)
            for g in range(nh):
                h = h0 + g
                qh = q[h]
                sg = s[g]
                og = o[g]
                bm = np.float32(-np.inf)
                for t in range(t0, t1):
                    kr = kb[t * D:(t + 1) * D]
                    acc = np.float32(0.0)
                    for d in range(D):
                        acc += qh[d] * kr[d]
                    x = acc * sc
                    sg[t] = x
                    if x > bm:
                        bm = x
                if bm > m[g]:
                    alpha = np.float32(0.0)
                    if m[g] > -np.inf:
                        alpha = np.exp(m[g] - bm)
                    l[g] *= alpha
                    for d in range(D):
                        og[d] *= alpha
                    m[g] = bm
                mg = m[g]
                ls = np.float32(0.0)
                for t in range(t0, t1):
                    e = np.exp(sg[t] - mg)
                    sg[t] = e
                    ls += e
                l[g] += ls
                if store:
                    bmax[h, k] = mg
                    pk = probs[h, k]
                    for t in range(t0, t1):
                        pk[t] = sg[t]
                sv = sg[t0:t1]
                nt = t1 - t0
                for d in range(D):
                    vr = vb[d * B + t0:d * B + t1]
                    acc = np.float32(0.0)
                    for t in range(nt):
                        acc += sv[t] * vr[t]
                    og[d] += acc
        for g in range(nh):
            h = h0 + g
            m_part[h, sp] = m[g]
            l_part[h, sp] = l[g]
            for d in range(D):
                o_part[h, sp, d] = o[g, d]
    # serial log-sum-exp merge of the split partials
    M = np.full(Hq, -np.inf, np.float32)
    L = np.zeros(Hq, np.float32)
    for h in range(Hq):
        mh = np.float32(-np.inf)
        for sp in range(nsplit):
            if m_part[h, sp] > mh:
                mh = m_part[h, sp]
        lh = np.float32(0.0)
        for d in range(D):
            out[h, d] = 0.0
        for sp in range(nsplit):
            if m_part[h, sp] > -np.inf:
                f = np.exp(m_part[h, sp] - mh)
                lh += l_part[h, sp] * f
                for d in range(D):
                    out[h, d] += o_part[h, sp, d] * f
        if lh > 0.0:
            inv = np.float32(1.0) / lh
            for d in range(D):
                out[h, d] *= inv
        M[h] = mh
        L[h] = lh
        lse[h] = mh + np.log(lh)
    if store:
        for h in prange(Hq):
            si = h // hps
            ph = probs[h]
            for k in range(Kw):
                pk = ph[k]
                if k >= cnt[si]:
                    for t in range(B):
                        pk[t] = 0.0
                    continue
                base = sel[si, k] * B
                t0 = max(lo - base, 0)
                t1 = min(n_ctx - base, B)
                f = np.float32(0.0)
                if L[h] > 0.0 and bmax[h, k] > -np.inf:
                    f = np.exp(bmax[h, k] - M[h]) / L[h]
                for t in range(B):
                    if t >= t0 and t < t1:
                        pk[t] *= f
                    else:
                        pk[t] = 0.0


def sparse_attention_decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                            block_table: np.ndarray, n_ctx: int, scale: float, window: int,
                            sel: np.ndarray, cnt: np.ndarray, out: np.ndarray,
                            importance: np.ndarray | None = None, decay: float = 1.0,
                            recall: bool = False, nsplit: int | None = None,
                            backend: str = "numba") -> tuple[np.ndarray, np.ndarray | None]:
    """Decode attention of one query (position n_ctx - 1) over the selected blocks.

    q: float32 [Hq, D]; k_cache/v_cache: float16 or float32 [Hkv][NB][B*D] /
    [Hkv][NB][D*B]; block_table: int32 [NB_logical]; sel, cnt: see module
    docstring; out: float32 [Hq, D], written. importance: float16 [NB][B][Hq]
    or None, receives the probabilities of the attended tokens (with
    ``decay != 1`` every valid token is decayed, unattended ones gain 0).
    recall: also run dense attention and return the attention recall, the
    fraction of the dense softmax mass inside the selected blocks (float32
    [Hq], 1.0 = lossless). Returns (lse float32 [Hq], recall or None).
    """
    Hkv, NB, BD = checks.kv_cache(k_cache, v_cache)
    Hq, D = checks.query("q", q, Hkv, BD)
    B = BD // D
    checks.array("block_table", block_table, np.int32, 1, layout="[NB_logical]")
    checks.count("n_ctx (tokens cached, query included)", n_ctx, 1, block_table.shape[0] * B)
    n_lb = -(-int(n_ctx) // B)
    checks.block_table(block_table, n_lb, NB)
    checks.selection(sel, cnt, Hq, Hq // Hkv, n_lb)
    checks.array("out", out, np.float32, shape=(Hq, D), layout="[Hq, D]")
    checks.writable("out", out)
    if int(window) < 0:
        raise ValueError(f"window must be >= 0 (0 = global attention), got {window}")
    if importance is not None:
        checks.importance(importance, NB, B, Hq)
    if not 0.0 < float(decay) <= 1.0:
        raise ValueError(f"decay must be in (0, 1], got {decay}")
    if nsplit is not None and int(nsplit) < 1:
        raise ValueError(f"nsplit must be >= 1, got {nsplit}")
    Kw = sel.shape[1]
    store = importance is not None
    probs = np.empty((Hq, Kw, B), np.float32) if store else np.empty((0, 0, 0), np.float32)
    if backend == "numpy":
        lse = sparse_attention_decode_ref(q, k_cache, v_cache, block_table, n_ctx, scale, window,
                                          sel, cnt, out, probs if store else None)
    else:
        q = np.ascontiguousarray(q, dtype=np.float32)
        if nsplit is None:
            units = Hq // min(Hq // sel.shape[0], Hq // k_cache.shape[0])
            target = 4 * numba.get_num_threads()
            nsplit = max(1, min(-(-target // units), int(cnt.max()) // 4))
        lse = np.empty(Hq, np.float32)
        _sparse_decode_kernel(q, kernel_view(k_cache), kernel_view(v_cache), block_table,
                              int(n_ctx), float(scale), int(window), fp16_lut(), sel, cnt,
                              int(nsplit), out, lse, store, probs, 64 // k_cache.itemsize)
    if store:
        if decay == 1.0:
            importance_update_blocks(importance, block_table, sel, cnt, probs, n_ctx, backend)
        else:
            new = scatter_probs(probs, sel, cnt, n_ctx)
            importance_update(importance, block_table, new, 0, decay, backend)
    rec = None
    if recall:
        from pyimp.attention import attention_decode

        dense_out = np.empty_like(out)
        lse_dense = attention_decode(q, k_cache, v_cache, block_table, n_ctx, scale, window,
                                     dense_out, backend=backend)
        rec = np.exp(lse - lse_dense).astype(np.float32)
    return lse, rec


def scatter_probs(probs, sel, cnt, n_ctx):
    """Dense float32 [Hq, n_ctx] mass from per-block probs [Hq, K, B] (0 where unattended)."""
    Hq, Kw, B = probs.shape
    hps = Hq // sel.shape[0]
    n_lb = -(-n_ctx // B)
    new = np.zeros((Hq, n_lb, B), np.float32)
    for h in range(Hq):
        c = cnt[h // hps]
        new[h, sel[h // hps, :c]] = probs[h, :c]
    return np.ascontiguousarray(new.reshape(Hq, n_lb * B)[:, :n_ctx])
