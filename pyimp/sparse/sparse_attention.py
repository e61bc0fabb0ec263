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

import functools

import numpy as np

from pyimp import attn_kernels as K
from pyimp.kvcache import as_float
from pyimp.sparse import checks
from pyimp.sparse.importance import (fp16_lut, importance_update, importance_update_blocks,
                                     kernel_view)


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
                                out, probs=None, bias=None):
    """NumPy reference: per-block partials merged in selection order (``bias``: float32
    [NB][B] added to each physical slot's score, or None).

    Returns float32 [Hq] log-sum-exp; fills probs float32 [Hq, K, B] if given.
    """
    k_cache, v_cache = as_float(k_cache), as_float(v_cache)
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
            s = (K @ q[h].astype(np.float32)) * np.float32(scale)
            if bias is not None:
                s = s + bias[pb]
            s = np.where(ok, s, -np.inf).astype(np.float32)
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
            for k, s in enumerate(scores):     # 0 for a head whose blocks the masks hide
                probs[h, k] = np.exp(s - lse[h]) if l > 0 else 0.0
    return lse


# --------------------------------------------------------------------------
# the decode kernel family (dense decode: every block; sparse: a selection)
# --------------------------------------------------------------------------


def check_args(q, k_cache, v_cache, block_table, n_ctx, window, out, importance, pos0=None,
               nsplit=None, decay=1.0, sel=None, cnt=None, bias=None) -> None:
    """Shapes, dtypes and block ids of an attention call (see :mod:`pyimp.sparse.checks`); a
    prefill passes ``pos0`` (then n_ctx is pos0 + the query rows), a sparse decode its selection."""
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
    if sel is not None:
        checks.selection(sel, cnt, Hq, Hq // Hkv, -(-int(n_ctx) // B))
    checks.array("out", out, np.float32, shape=q.shape, layout="(as q)")
    checks.writable("out", out)
    if int(window) < 0:
        raise ValueError(f"window must be >= 0 (0 = global attention), got {window}")
    if importance is not None:
        checks.importance(importance, NB, B, Hq)
    if bias is not None:
        checks.array("bias", bias, np.float32, shape=(NB, B), layout="[NB][B]")
    if not 0.0 < float(decay) <= 1.0:
        raise ValueError(f"decay must be in (0, 1], got {decay}")
    if nsplit is not None and int(nsplit) < 1:
        raise ValueError(f"nsplit must be >= 1, got {nsplit}")


def every_block(n_ctx: int, block_len: int, window: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One set (sel int32 [1, n], cnt int32 [1]) of every logical block the masks leave visible."""
    lb0 = 0 if window <= 0 else max(0, n_ctx - window) // block_len
    sel = np.arange(lb0, -(-n_ctx // block_len), dtype=np.int32)[None]
    return sel, np.array([sel.shape[1]], np.int32)


@functools.lru_cache(maxsize=8)
def no_bias(block_len: int) -> np.ndarray:
    """The kernels' ``bias`` argument when no slot carries a score bias: float32 [0][B] (one
    shared empty array per block length)."""
    return np.zeros((0, block_len), np.float32)


def decode_over_blocks(q, k_cache, v_cache, block_table, n_ctx, scale, window, sel, cnt, out,
                       importance=None, decay=1.0, nsplit=None, min_blocks=4,
                       bias=None) -> np.ndarray:
    """Run :func:`pyimp.attn_kernels.decode_blocks` on checked arguments and add the attended
    probabilities to ``importance`` (if given); returns lse float32 [Hq]. nsplit None: enough
    splits of at least ``min_blocks`` blocks to keep every thread busy. ``bias``: float32
    [NB][B] score bias per physical slot (merged slots), or None."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    Hq, B = q.shape[0], k_cache.shape[2] // q.shape[1]
    if nsplit is None:
        units = Hq // min(Hq // sel.shape[0], Hq // k_cache.shape[0])
        nsplit = K.default_splits(int(cnt.max()), units, min_blocks)
    store = importance is not None
    probs = np.empty((Hq, sel.shape[1], B) if store else (0, 0, 0), np.float32)
    lse = np.empty(Hq, np.float32)
    K.decode_blocks(q, kernel_view(k_cache), kernel_view(v_cache), block_table, int(n_ctx),
                    float(scale), int(window), fp16_lut(), sel, cnt, int(nsplit), out, lse, store,
                    probs, no_bias(B) if bias is None else bias)
    if store:
        add_block_mass(importance, block_table, sel, cnt, probs, n_ctx, decay)
    return lse


def add_block_mass(importance, block_table, sel, cnt, probs, n_ctx, decay, backend="numba"):
    """importance <- decay * importance + the per-block probs [Hq, K, B] of a decode step
    (arguments as a decode kernel took them: checked by its caller)."""
    if decay == 1.0:
        importance_update_blocks(importance, block_table, sel, cnt, probs, n_ctx, backend,
                                 checked=True)
    else:
        importance_update(importance, block_table, scatter_probs(probs, sel, cnt, n_ctx), 0,
                          decay, backend)


def sparse_attention_decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                            block_table: np.ndarray, n_ctx: int, scale: float, window: int,
                            sel: np.ndarray, cnt: np.ndarray, out: np.ndarray,
                            importance: np.ndarray | None = None, decay: float = 1.0,
                            recall: bool = False, nsplit: int | None = None,
                            backend: str = "numba", bias: np.ndarray | None = None
                            ) -> tuple[np.ndarray, np.ndarray | None]:
    """Decode attention of one query (position n_ctx - 1) over the selected blocks.

    q: float32 [Hq, D]; k_cache/v_cache: float16 or float32 [Hkv][NB][B*D] /
    [Hkv][NB][D*B], or a quantized layer (:class:`pyimp.kvcache.QuantizedKV`); block_table: int32 [NB_logical]; sel, cnt: see module
    docstring; out: float32 [Hq, D], written. importance: float16 [NB][B][Hq]
    or None, receives the probabilities of the attended tokens (with
    ``decay != 1`` every valid token is decayed, unattended ones gain 0).
    recall: also run dense attention and return the attention recall, the
    fraction of the dense softmax mass inside the selected blocks (float32
    [Hq], 1.0 = lossless). ``bias``: float32 [NB][B] added to the score of each physical
    slot (the log-multiplicity of merged slots, :mod:`pyimp.kv_merge`), or None.
    Returns (lse float32 [Hq], recall or None).
    """
    check_args(q, k_cache, v_cache, block_table, n_ctx, window, out, importance, nsplit=nsplit,
               decay=decay, sel=sel, cnt=cnt, bias=bias)
    Hq, B = q.shape[0], k_cache.shape[2] // q.shape[1]
    if backend != "numpy":
        lse = decode_over_blocks(q, k_cache, v_cache, block_table, n_ctx, scale, window, sel, cnt,
                                 out, importance, decay, nsplit, bias=bias)
    else:
        store = importance is not None
        probs = np.empty((Hq, sel.shape[1], B), np.float32) if store else None
        lse = sparse_attention_decode_ref(q, k_cache, v_cache, block_table, n_ctx, scale, window,
                                          sel, cnt, out, probs, bias)
        if store:
            add_block_mass(importance, block_table, sel, cnt, probs, n_ctx, decay, backend)
    rec = None
    if recall:  # the same kernel family over every block: fraction of the dense mass attended
        dense_out = np.empty_like(out)
        if backend == "numpy":
            from pyimp.attention import attention_decode_ref
            lse_dense = attention_decode_ref(q, k_cache, v_cache, block_table, n_ctx, scale,
                                             window, dense_out, bias=bias)
        else:
            lse_dense = decode_over_blocks(q, k_cache, v_cache, block_table, n_ctx, scale, window,
                                           *every_block(n_ctx, B, window), dense_out, min_blocks=8,
                                           bias=bias)
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
