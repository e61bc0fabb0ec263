"""Dense attention over the paged KV cache (prefill and decode).

Layer-slice buffers (KVCACHE.md section 2), as the engine passes them:

- ``k_cache`` ``[Hkv][NB][B*D]``: row t of a block is the key of token t.
- ``v_cache`` ``[Hkv][NB][D*B]``: transposed, channel d of token t at ``[d*B + t]``.
- both float16 (kernels get ``.view(np.uint16)`` plus the fp16 table) or float32.
- ``block_table`` int32 ``[NB_logical]``: logical block -> physical block; the
  token at absolute position p is row ``p % B`` of block ``block_table[p // B]``.
- ``importance`` float16 ``[NB][B][Hq]`` (optional), see ``pyimp.sparse.importance``.

Query head h reads kv head ``h // G`` with ``G = Hq // Hkv``. Masks: a query at
position ``p_q`` sees keys ``p_k <= p_q``, and with ``window > 0`` only keys with
``p_q - p_k < window``. Softmax is max-stabilized in float32; ``scale``
multiplies the scores. Each kernel returns the log-sum-exp of the scaled,
masked scores per row and head (for recall diagnostics).

Each public function dispatches to a Numba kernel (``backend="numba"``, default)
or to the NumPy reference beside it (``backend="numpy"``).
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
from pyimp.sparse.importance import fp16_lut, importance_update, kernel_view

# Fast-math flags without nnan/ninf: reassociation lets LLVM vectorize the dot
# products; -inf masks and NaN checks keep their IEEE meaning.
_FM = {"reassoc", "contract", "nsz"}

PREFILL_TILE = 16  # query rows sharing one pass over the keys

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


def default_splits(n_blocks: int, n_heads: int, min_blocks: int = 8) -> int:
    """Block splits per head so that heads*splits covers the threads ~4x over."""
    target = 4 * numba.get_num_threads()
    want = max(1, -(-target // max(n_heads, 1)))
    return max(1, min(want, n_blocks // min_blocks))


# --------------------------------------------------------------------------
# NumPy reference
# --------------------------------------------------------------------------


def gather_kv(k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray, n: int,
              head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat float32 K, V ``[Hkv, n, D]`` of positions 0..n-1 from the paged cache."""
    Hkv, NB, BD = k_cache.shape
    D = head_dim
    B = BD // D
    p = np.arange(n)
    pb, t = block_table[p // B], p % B
    kb = k_cache.reshape(Hkv, NB, B, D)
    vb = v_cache.reshape(Hkv, NB, D, B)
    K = kb[:, pb, t, :].astype(np.float32)  # [Hkv, n, D]
    V = vb[:, pb, :, t].astype(np.float32)  # advanced indices first: [n, Hkv, D]
    return K, np.ascontiguousarray(V.transpose(1, 0, 2))


def attention_prefill_ref(q, k_cache, v_cache, block_table, pos0, scale, window, out,
                          importance=None, obs_start=0, decay=1.0):
    """NumPy reference of :func:`attention_prefill` (float32 throughout)."""
    T, Hq, D = q.shape
    Hkv = k_cache.shape[0]
    G = Hq // Hkv
    n = pos0 + T
    K, V = gather_kv(k_cache, v_cache, block_table, n, D)
    pq = pos0 + np.arange(T)
    pk = np.arange(n)
    mask = pk[None, :] <= pq[:, None]
    if window > 0:
        mask &= (pq[:, None] - pk[None, :]) < window
    obs = pq >= obs_start
    new = np.zeros((Hq, n), np.float32)
    lse = np.empty((T, Hq), np.float32)
    for h in range(Hq):
        s = (q[:, h, :].astype(np.float32) @ K[h // G].T) * np.float32(scale)  # [T, n]
        s = np.where(mask, s, np.float32(-np.inf))
        m = s.max(axis=1, keepdims=True)
        e = np.exp(s - m)
        l = e.sum(axis=1, keepdims=True)
        P = e / l
        out[:, h, :] = P @ V[h // G]
        lse[:, h] = (m + np.log(l))[:, 0]
        new[h] = P[obs].sum(axis=0)
    if importance is not None and obs.any():
        importance_update(importance, block_table, new, 0, decay, backend="numpy")
    return lse


def attention_decode_ref(q, k_cache, v_cache, block_table, n_ctx, scale, window, out,
                         importance=None, decay=1.0):
    """NumPy reference of :func:`attention_decode`."""
    o = np.empty((1,) + q.shape, np.float32)
    lse = attention_prefill_ref(q[None], k_cache, v_cache, block_table, n_ctx - 1, scale, window,
                                o, importance, 0, decay)
    out[...] = o[0]
    return lse[0]


# --------------------------------------------------------------------------
# Numba kernels
# --------------------------------------------------------------------------


@njit(parallel=True, cache=True, fastmath=_FM)
def _prefill_kernel(q, kc, vc, bt, pos0, scale, window, lut, tile, out, row_m, row_l):
    """Flash-style prefill: work item = (query-row tile, kv head), online softmax over blocks."""
    T, Hq, D = q.shape
    Hkv = kc.shape[0]
    B = kc.shape[2] // D
    G = Hq // Hkv
    ntile = (T + tile - 1) // tile
    sc = np.float32(scale)
    for w in prange(ntile * Hkv):
        # pair cheap early tiles with expensive late ones across the static thread split
        j = w // Hkv
        kvh = w - j * Hkv
        it = j // 2 if j % 2 == 0 else ntile - 1 - j // 2
        i0 = it * tile
        i1 = min(T, i0 + tile)
        R = i1 - i0
        p_hi = pos0 + i1 - 1
        p_lo = 0
        if window > 0:
            p_lo = max(0, pos0 + i0 - window + 1)
        kb = np.empty(B * D, np.float32)
        vb = np.empty(D * B, np.float32)
        s = np.empty((R * G, B), np.float32)
        m = np.full(R * G, -np.inf, np.float32)
        l = np.zeros(R * G, np.float32)
        o = np.zeros((R * G, D), np.float32)
        for lb in range(p_lo // B, p_hi // B + 1):
            pb = bt[lb]
            base = lb * B
            t0 = max(p_lo - base, 0)
            t1 = min(p_hi - base + 1, B)
            _load_f32(kc[kvh, pb], t0 * D, (t1 - t0) * D, kb, lut)
            vrow = vc[kvh, pb]
            if t1 - t0 == B:  # full block: one contiguous decode
                _load_f32(vrow, 0, D * B, vb, lut)
            else:
                for d in range(D):
                    _load_f32(vrow, d * B + t0, t1 - t0, vb, lut)
            for r in range(R):
                pq = pos0 + i0 + r
                rlo = 0
                if window > 0:
                    rlo = max(0, pq - window + 1)
                tt0 = max(rlo - base, t0)
                tt1 = min(pq - base + 1, t1)
                if tt0 >= tt1:
                    continue
                for g in range(G):
                    h = kvh * G + g
                    jj = r * G + g
                    qh = q[i0 + r, h]
                    sj = s[jj]
                    oj = o[jj]
                    bm = np.float32(-np.inf)
                    for t in range(tt0, tt1):
                        kr = kb[t * D:(t + 1) * D]
                        acc = np.float32(0.0)
                        for d in range(D):
                            acc += qh[d] * kr[d]
                        x = acc * sc
                        sj[t] = x
                        if x > bm:
                            bm = x
                    if bm > m[jj]:
                        alpha = np.float32(0.0)
                        if m[jj] > -np.inf:
                            alpha = np.exp(m[jj] - bm)
                        l[jj] *= alpha
                        for d in range(D):
                            oj[d] *= alpha
                        m[jj] = bm
                    mj = m[jj]
                    ls = np.float32(0.0)
                    for t in range(tt0, tt1):
                        e = np.exp(sj[t] - mj)
                        sj[t] = e
                        ls += e
                    l[jj] += ls
                    sv = sj[tt0:tt1]
                    nt = tt1 - tt0
                    for d in range(D):
                        vr = vb[d * B + tt0:d * B + tt1]
                        acc = np.float32(0.0)
                        for t in range(nt):
                            acc += sv[t] * vr[t]
                        oj[d] += acc
        for r in range(R):
            for g in range(G):
                h = kvh * G + g
                jj = r * G + g
                inv = np.float32(1.0) / l[jj]
                for d in range(D):
                    out[i0 + r, h, d] = o[jj, d] * inv
                row_m[i0 + r, h] = m[jj]
                row_l[i0 + r, h] = l[jj]


@njit(parallel=True, cache=True, fastmath=_FM)
def _prefill_mass_kernel(q, kc, bt, pos0, scale, window, lut, row_m, row_l, r0, new):
    """new[h, p] = sum over rows r >= r0 of P[r, h, p], for keys p >= the first visible one.

    Recomputes the scores of the observed rows per key block (work item =
    (kv head, key block), so every output element has exactly one writer).
    """
    T, Hq, D = q.shape
    Hkv = kc.shape[0]
    B = kc.shape[2] // D
    G = Hq // Hkv
    n = pos0 + T
    p_lo = 0
    if window > 0:
        p_lo = max(0, pos0 + r0 - window + 1)
    lbA = p_lo // B
    nb = (n + B - 1) // B - lbA
    sc = np.float32(scale)
    for w in prange(Hkv * nb):
        kvh = w // nb
        lb = lbA + (w - kvh * nb)
        pb = bt[lb]
        base = lb * B
        t0 = max(p_lo - base, 0)
        t1 = min(n - base, B)
        kb = np.empty(B * D, np.float32)
        _load_f32(kc[kvh, pb], t0 * D, (t1 - t0) * D, kb, lut)
        acc = np.zeros((G, B), np.float32)
        for r in range(r0, T):
            pq = pos0 + r
            rlo = 0
            if window > 0:
                rlo = max(0, pq - window + 1)
            tt0 = max(rlo - base, t0)
            tt1 = min(pq - base + 1, t1)
            if tt0 >= tt1:
                continue
            for g in range(G):
                h = kvh * G + g
                mm = row_m[r, h]
                inv = np.float32(1.0) / row_l[r, h]
                qh = q[r, h]
                ag = acc[g]
                for t in range(tt0, tt1):
                    kr = kb[t * D:(t + 1) * D]
                    a = np.float32(0.0)
                    for d in range(D):
                        a += qh[d] * kr[d]
                    ag[t] += np.exp(a * sc - mm) * inv
        for g in range(G):
            h = kvh * G + g
            for t in range(t0, t1):
                new[h, base + t] = acc[g, t]


@njit(parallel=True, cache=True, fastmath=_FM)
def _decode_kernel(q, kc, vc, bt, n_ctx, scale, window, lut, nsplit, out, lse, store, probs, bmax,
                   pf_step):
    """Decode attention; work item = (kv head, block split), partials merged serially.

    With ``store``, probs[h, p] receives P of position p (positions below the
    window start are left untouched) and bmax is scratch [Hq, n_logical_blocks].
    """
    Hq, D = q.shape
    Hkv = kc.shape[0]
    B = kc.shape[2] // D
    G = Hq // Hkv
    lo = 0
    if window > 0:
        lo = max(0, n_ctx - window)
    lb0 = lo // B
    lb1 = (n_ctx + B - 1) // B
    per = (lb1 - lb0 + nsplit - 1) // nsplit
    sc = np.float32(scale)
    m_part = np.full((Hq, nsplit), -np.inf, np.float32)
    l_part = np.zeros((Hq, nsplit), np.float32)
    o_part = np.zeros((Hq, nsplit, D), np.float32)
    for w in prange(Hkv * nsplit):
        kvh = w // nsplit
        sp = w - kvh * nsplit
        b_beg = lb0 + sp * per
        b_end = min(lb1, b_beg + per)
        kb = np.empty(B * D, np.float32)
        vb = np.empty(D * B, np.float32)
        s = np.empty((G, B), np.float32)
        m = np.full(G, -np.inf, np.float32)
        l = np.zeros(G, np.float32)
        o = np.zeros((G, D), np.float32)
        for lb in range(b_beg, b_end):
            if lb + 1 < b_end:  # physical blocks need not be adjacent: prefetch the next one
                kn = kc[kvh, bt[lb + 1]]
                vn = vc[kvh, bt[lb + 1]]
                for e in range(0, kn.size, pf_step):
                    _prefetch(kn, e)
                    _prefetch(vn, e)
            pb = bt[lb]
            base = lb * B
            t0 = max(lo - base, 0)
            t1 = min(n_ctx - base, B)
            _load_f32(kc[kvh, pb], t0 * D, (t1 - t0) * D, kb, lut)
            vrow = vc[kvh, pb]
            if t1 - t0 == B:  # full block: one contiguous decode
                _load_f32(vrow, 0, D * B, vb, lut)
            else:
                for d in range(D):
                    _load_f32(vrow, d * B + t0, t1 - t0, vb, lut)
            for g in range(G):
                h = kvh * G + g
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
                    bmax[h, lb] = mg
                    ph = probs[h]
                    for t in range(t0, t1):
                        ph[base + t] = sg[t]
                sv = sg[t0:t1]
                nt = t1 - t0
                for d in range(D):
                    vr = vb[d * B + t0:d * B + t1]
                    acc = np.float32(0.0)
                    for t in range(nt):
                        acc += sv[t] * vr[t]
                    og[d] += acc
        for g in range(G):
            h = kvh * G + g
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
            inv = np.float32(1.0) / L[h]
            for lb in range(lb0, lb1):
                base = lb * B
                f = np.exp(bmax[h, lb] - M[h]) * inv
                for t in range(max(lo - base, 0), min(n_ctx - base, B)):
                    probs[h, base + t] *= f


# --------------------------------------------------------------------------
# dispatchers
# --------------------------------------------------------------------------


def _check_args(q, k_cache, v_cache, block_table, n_ctx, window, out, importance,
                pos0: int | None = None) -> None:
    """Shapes, dtypes and block ids of a dense attention call (see :mod:`pyimp.sparse.checks`);
    a prefill passes ``pos0`` (then n_ctx is pos0 + the query rows)."""
    Hkv, NB, BD = checks.kv_cache(k_cache, v_cache)
    Hq, D = checks.query("q", q, Hkv, BD, rows=pos0 is not None)
    B = BD // D
    if pos0 is not None:
        if q.shape[0] == 0:
            raise ValueError("q holds no query rows")
        if int(pos0) < 0:
            raise ValueError(f"pos0 must be >= 0, got {pos0}")
        n_ctx = int(pos0) + q.shape[0]
    checks.array("block_table", block_table, np.int32, 1, layout="[NB_logical]")
    checks.count("n_ctx (tokens cached, query included)", n_ctx, 1, block_table.shape[0] * B)
    checks.block_table(block_table, -(-int(n_ctx) // B), NB)
    checks.array("out", out, np.float32, shape=q.shape, layout="(as q)")
    checks.writable("out", out)
    if int(window) < 0:
        raise ValueError(f"window must be >= 0 (0 = global attention), got {window}")
    if importance is not None:
        checks.importance(importance, NB, B, Hq)


def attention_prefill(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                      block_table: np.ndarray, pos0: int, scale: float, window: int,
                      out: np.ndarray, importance: np.ndarray | None = None, obs_start: int = 0,
                      decay: float = 1.0, backend: str = "numba") -> np.ndarray:
    """Causal (optionally sliding-window) attention of a prompt chunk over the cache.

    q: float32 [T, Hq, D], row i at absolute position pos0 + i; the chunk's K/V
    must already be in the cache (positions 0..pos0+T-1 valid).
    out: float32 [T, Hq, D], written. window: 0 = global, else keys with
    p_q - p_k < window. importance: float16 [NB][B][Hq] or None; when given,
    the probabilities of query rows at absolute positions >= ``obs_start`` are
    summed per key and added (old*decay + new, see pyimp.sparse.importance).
    For an observation window of the last W prompt rows pass
    ``obs_start = max(0, prompt_len - W)`` to every chunk of that prompt
    (``obs_start=0``: every row counts). Returns float32 [T, Hq] log-sum-exp.
    """
    _check_args(q, k_cache, v_cache, block_table, None, window, out, importance, pos0=pos0)
    if backend == "numpy":
        return attention_prefill_ref(q, k_cache, v_cache, block_table, pos0, scale, window, out,
                                     importance, obs_start, decay)
    q = np.ascontiguousarray(q, dtype=np.float32)
    T, Hq, D = q.shape
    kc, vc = kernel_view(k_cache), kernel_view(v_cache)
    lut = fp16_lut()
    row_m = np.empty((T, Hq), np.float32)
    row_l = np.empty((T, Hq), np.float32)
    _prefill_kernel(q, kc, vc, block_table, int(pos0), float(scale), int(window), lut,
                    PREFILL_TILE, out, row_m, row_l)
    r0 = max(0, int(obs_start) - int(pos0))
    if importance is not None and r0 < T:
        n = pos0 + T
        new = np.empty((Hq, n), np.float32)
        _prefill_mass_kernel(q, kc, block_table, int(pos0), float(scale), int(window), lut,
                             row_m, row_l, r0, new)
        p_lo = 0 if window <= 0 else max(0, pos0 + r0 - window + 1)
        importance_update(importance, block_table, new, p_lo, decay)
    return row_m + np.log(row_l)


def attention_decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                     block_table: np.ndarray, n_ctx: int, scale: float, window: int,
                     out: np.ndarray, importance: np.ndarray | None = None, decay: float = 1.0,
                     nsplit: int | None = None, backend: str = "numba") -> np.ndarray:
    """Attention of one query (position n_ctx - 1) over the cached positions 0..n_ctx-1.

    q: float32 [Hq, D]; out: float32 [Hq, D], written. importance (float16
    [NB][B][Hq] or None) receives this step's probabilities. nsplit: block
    splits per kv head (None: enough to keep every thread busy).
    Returns float32 [Hq] log-sum-exp.
    """
    _check_args(q, k_cache, v_cache, block_table, n_ctx, window, out, importance)
    if nsplit is not None and int(nsplit) < 1:
        raise ValueError(f"nsplit must be >= 1, got {nsplit}")
    if backend == "numpy":
        return attention_decode_ref(q, k_cache, v_cache, block_table, n_ctx, scale, window, out,
                                    importance, decay)
    q = np.ascontiguousarray(q, dtype=np.float32)
    Hq, D = q.shape
    B = k_cache.shape[2] // D
    lo = 0 if window <= 0 else max(0, n_ctx - window)
    nlb = -(-n_ctx // B)
    if nsplit is None:
        nsplit = default_splits(nlb - lo // B, k_cache.shape[0])
    store = importance is not None
    if store:
        probs = np.empty((Hq, n_ctx), np.float32)
        bmax = np.empty((Hq, nlb), np.float32)
    else:
        probs = np.empty((0, 0), np.float32)
        bmax = probs
    lse = np.empty(Hq, np.float32)
    _decode_kernel(q, kernel_view(k_cache), kernel_view(v_cache), block_table, int(n_ctx),
                   float(scale), int(window), fp16_lut(), int(nsplit), out, lse, store, probs, bmax,
                   64 // k_cache.itemsize)
    if store:
        importance_update(importance, block_table, probs, lo, decay)
    return lse

