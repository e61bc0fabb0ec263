"""Dense and block-sparse attention over the paged KV cache (prefill and decode).

Layer-slice buffers (docs/kvcache.md section 2), as the engine passes them:

- ``k_cache`` ``[Hkv][NB][B*D]``: row t of a block is the key of token t.
- ``v_cache`` ``[Hkv][NB][D*B]``: transposed, channel d of token t at ``[d*B + t]``.
- float16 (kernels get ``.view(np.uint16)`` plus the fp16 table), float32, or a
  quantized layer (:class:`pyimp.kv.cache.QuantizedKV`, read block by block by the
  kernels; the NumPy references dequantize it first). K and V types may differ.
- ``block_table`` int32 ``[NB_logical]``: slot block -> physical block; slot s
  is row ``s % B`` of block ``block_table[s // B]``. Slots are in position
  order; ``positions`` (int32, slot -> position, None: slot == position) gives
  the positions of a compacted layer (see :mod:`pyimp.kv.cache`).
- ``importance`` float16 ``[NB][B][Hq]`` (optional), see :mod:`pyimp.attention.importance`.

Query head h reads kv head ``h // G`` with ``G = Hq // Hkv``. Masks: a query at
position ``p_q`` sees keys ``p_k <= p_q``, and with ``window > 0`` only keys with
``p_q - p_k < window``. The kernels apply them in slot space: a query sees the
slots before its own from the first visible one (:func:`first_visible`). Softmax is max-stabilized in float32; ``scale``
multiplies the scores. Each kernel returns the log-sum-exp of the scaled,
masked scores per row and head (for recall diagnostics).

Each public function dispatches to the Numba kernels of :mod:`pyimp.attention.kernels`
(``backend="numba"``, default) or to the NumPy reference beside it
(``backend="numpy"``). Decode is the block-list decode kernel
(:func:`decode_over_blocks`): dense decode runs it with every block of the window selected
(:func:`every_block`), block-sparse decode (:func:`sparse_attention_decode`) over a selection
from :mod:`pyimp.sparse.retrieval`: ``sel`` int32 [nsets, K] logical block ids (-1 padded) and
``cnt`` int32 [nsets]; query head h uses set ``h // (Hq // nsets)``.

A block's partial is its local max ``m``, the sum ``l = sum exp(s - m)`` and
the unnormalized output ``o = sum exp(s - m) v``; partials merge with the
max-stabilized rule::

    m = max(m1, m2);  l = l1 e^(m1-m) + l2 e^(m2-m);  o = o1 e^(m1-m) + o2 e^(m2-m)

The Numba kernel folds each work item's blocks into a running partial with
this rule (online softmax) and merges the per-thread partials serially; the
NumPy reference of the sparse decode forms every block's partial and merges them in order.

With every block selected the sparse decode equals dense attention to float32 rounding, in
any block order. Masks are the dense ones (causal to n_ctx, sliding window).
Importance receives this step's probabilities on attended tokens only.
"""
from __future__ import annotations

import functools

import numpy as np

from pyimp.attention import kernels as K
from pyimp.attention import checks
from pyimp.attention.importance import (fp16_lut, importance_update, importance_update_blocks,
                                        kernel_view)
from pyimp.kv.cache import as_float

PREFILL_TILE = 16  # query rows sharing one pass over the keys
# prompt chunks whose rows see this many slots on average take the tiled prefill (matrix
# products through BLAS, see _prefill_tiled); the flash-style kernel is faster below (measured
# on Gemma's shape: a 128-row chunk at position 0, 64 slots a row, 1.4 ms vs 3.7; 256 rows,
# 128 slots, 4.2 vs 2.3; 16 rows after 300 tokens 1.2 vs 0.5)
TILED_MIN_KEYS = 96
KEY_CHUNK = 512    # slots gathered at once by the tiled prefill (a multiple of any block length
                   # dividing it; rounded to the block length)
ROW_CHUNK = 128    # query rows per product in the tiled prefill


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


def first_visible(positions, s0: int, T: int, window: int) -> np.ndarray:
    """First slot each of the query rows in slots s0..s0+T-1 sees: int64 [T] (0 without a
    window). ``positions``: int32 slot -> position of slots 0..s0+T-1, increasing (None: slot
    == position)."""
    if window <= 0:
        return np.zeros(T, np.int64)
    if positions is None:
        return np.maximum(0, s0 + np.arange(T, dtype=np.int64) - window + 1)
    pq = positions[s0:s0 + T].astype(np.int64)
    return np.searchsorted(positions[:s0 + T], pq - window + 1).astype(np.int64)


def slot_window(positions, n: int, window: int) -> int:
    """The decode kernels' window in slots (they see slots n - w .. n - 1) for the query in
    slot n - 1 and a window of ``window`` positions (0: global)."""
    if window <= 0 or positions is None:
        return window
    return n - int(first_visible(positions, n - 1, 1, window)[0])


def slot_bias(bias, block_table: np.ndarray, n: int, block_len: int) -> np.ndarray:
    """The per-slot score bias of slots 0..n-1, float32 [n] (zeros when ``bias`` is None)."""
    if bias is None:
        return np.zeros(n, np.float32)
    s = np.arange(n)
    return bias[block_table[s // block_len], s % block_len].astype(np.float32)


def attention_prefill_ref(q, k_cache, v_cache, block_table, pos0, scale, window, out,
                          importance=None, obs_start=0, decay=1.0, positions=None, bias=None,
                          importance2=None, obs_start2=-1):
    """NumPy reference of :func:`attention_prefill` (float32 throughout)."""
    k_cache, v_cache = as_float(k_cache), as_float(v_cache)
    T, Hq, D = q.shape
    Hkv = k_cache.shape[0]
    G = Hq // Hkv
    n = pos0 + T
    K, V = gather_kv(k_cache, v_cache, block_table, n, D)
    pk = np.arange(n) if positions is None else positions[:n].astype(np.int64)
    pq = pk[pos0:]
    mask = np.arange(n)[None, :] <= (pos0 + np.arange(T))[:, None]
    if window > 0:
        mask &= (pq[:, None] - pk[None, :]) < window
    # (buffer, its observed rows, their mass) of each importance buffer given
    sums = [(imp, pq >= start, np.zeros((Hq, n), np.float32))
            for imp, start in ((importance, obs_start), (importance2, obs_start2))
            if imp is not None and start >= 0]
    lse = np.empty((T, Hq), np.float32)
    sb = slot_bias(bias, block_table, n, k_cache.shape[2] // D)
    for h in range(Hq):
        s = (q[:, h, :].astype(np.float32) @ K[h // G].T) * np.float32(scale) + sb  # [T, n]
        s = np.where(mask, s, np.float32(-np.inf))
        m = s.max(axis=1, keepdims=True)
        e = np.exp(s - m)
        l = e.sum(axis=1, keepdims=True)
        P = e / l
        out[:, h, :] = P @ V[h // G]
        lse[:, h] = (m + np.log(l))[:, 0]
        for _, obs, new in sums:
            new[h] = P[obs].sum(axis=0)
    for imp, obs, new in sums:
        if obs.any():
            importance_update(imp, block_table, new, 0, decay, backend="numpy")
    return lse


def attention_decode_ref(q, k_cache, v_cache, block_table, n_ctx, scale, window, out,
                         importance=None, decay=1.0, bias=None):
    """NumPy reference of :func:`attention_decode`."""
    o = np.empty((1,) + q.shape, np.float32)
    lse = attention_prefill_ref(q[None], k_cache, v_cache, block_table, n_ctx - 1, scale, window,
                                o, importance, 0, decay, bias=bias)
    out[...] = o[0]
    return lse[0]


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
# NumPy reference: block-sparse decode
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
    """Shapes, dtypes and block ids of an attention call (see :mod:`pyimp.attention.checks`); a
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
    """Run :func:`pyimp.attention.kernels.decode_blocks` on checked arguments and add the attended
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


# --------------------------------------------------------------------------
# dispatchers
# --------------------------------------------------------------------------


def attention_prefill(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                      block_table: np.ndarray, pos0: int, scale: float, window: int,
                      out: np.ndarray, importance: np.ndarray | None = None, obs_start: int = 0,
                      decay: float = 1.0, backend: str = "numba",
                      positions: np.ndarray | None = None,
                      bias: np.ndarray | None = None, importance2: np.ndarray | None = None,
                      obs_start2: int = -1) -> np.ndarray:
    """Causal (optionally sliding-window) attention of a prompt chunk over the cache.

    q: float32 [T, Hq, D], row i in slot pos0 + i; the chunk's K/V must already be
    in the cache (slots 0..pos0+T-1 valid). ``positions``: int32 slot -> position of
    those slots (None: slot == position); the chunk's rows have consecutive positions.
    out: float32 [T, Hq, D], written. window: 0 = global, else keys with
    p_q - p_k < window. importance: float16 [NB][B][Hq] or None; when given,
    the probabilities of query rows at absolute positions >= ``obs_start`` are
    summed per key and added (old*decay + new, see pyimp.attention.importance).
    For an observation window of the last W prompt rows pass
    ``obs_start = max(0, prompt_len - W)`` (a position) to every chunk of that prompt
    (``obs_start=0``: every row counts). ``bias``: float32 [NB][B] added to the score of the
    key in each physical slot (merged slots' log-multiplicity, :mod:`pyimp.kv.merge`), or
    None. ``importance2`` (same shape as importance) gets the rows at positions >=
    ``obs_start2`` the same way (a second observation window; -1: none). Returns float32
    [T, Hq] log-sum-exp.
    """
    check_args(q, k_cache, v_cache, block_table, None, window, out, importance, pos0=pos0,
               decay=decay, bias=bias)
    if importance2 is not None and (importance is None or importance2.shape != importance.shape
                                    or importance2.dtype != importance.dtype):
        raise ValueError("importance2 must be given with importance, of its shape and dtype")
    if positions is not None:
        checks.positions(positions, int(pos0) + q.shape[0])
    if backend == "numpy":
        return attention_prefill_ref(q, k_cache, v_cache, block_table, pos0, scale, window, out,
                                     importance, obs_start, decay, positions, bias,
                                     importance2, obs_start2)
    q = np.ascontiguousarray(q, dtype=np.float32)
    T, Hq, D = q.shape
    kc, vc = kernel_view(k_cache), kernel_view(v_cache)
    lut = fp16_lut()
    row_m = np.empty((T, Hq), np.float32)
    row_l = np.empty((T, Hq), np.float32)
    rlo = first_visible(positions, int(pos0), T, int(window))
    B = k_cache.shape[2] // D
    kbias = no_bias(B) if bias is None else bias
    if float(np.mean(int(pos0) + 1 + np.arange(T) - rlo)) >= TILED_MIN_KEYS:
        _prefill_tiled(q, kc, vc, block_table, int(pos0), float(scale), rlo, lut, out, row_m,
                       row_l, B, bias)
    else:
        K.prefill(q, kc, vc, block_table, int(pos0), float(scale), rlo, lut, PREFILL_TILE,
                  out, row_m, row_l, kbias)
    p_row0 = int(pos0) if positions is None else int(positions[pos0])
    for imp, start in ((importance, obs_start), (importance2, obs_start2)):
        r0 = max(0, int(start) - p_row0)
        if imp is not None and start >= 0 and r0 < T:
            new = np.empty((Hq, pos0 + T), np.float32)
            K.prefill_mass(q, kc, block_table, int(pos0), float(scale), rlo, lut, row_m,
                           row_l, r0, new, kbias)
            importance_update(imp, block_table, new, int(rlo[r0]), decay)
    return row_m + np.log(row_l)


def _prefill_tiled(q, kc, vc, bt, s0, scale, rlo, lut, out, row_m, row_l, B, bias=None) -> None:
    """The prefill of :func:`pyimp.attention.kernels.prefill` (same arguments and outputs) as
    online softmax over tiles: per kv head and chunk of ``ROW_CHUNK`` query rows, the slots
    those rows see are gathered ``KEY_CHUNK`` at a time as float32
    (:func:`pyimp.attention.kernels.gather_tile`, the cache's own block loads), and the scores
    ``S = (scale q) K^T`` of the rows' G query heads and the update
    ``o = o e^(m - m') + e^(S - m') V`` are two matrix products (BLAS), the softmax between them
    NumPy passes. Scratch is bounded by the chunk sizes, not the context. Row i (slot s0 + i)
    sees slots rlo[i] .. s0 + i; kc, vc are the kernels' views of the cache (arrays or a
    quantized layer's tuple), B its block length, ``bias`` the per-slot score bias or None."""
    T, Hq, D = q.shape
    Hkv = (kc[0] if isinstance(kc, tuple) else kc).shape[0]
    G = Hq // Hkv
    C = max(B, KEY_CHUNK // B * B)
    rows = s0 + np.arange(T)
    Kt = np.empty((C, D), np.float32)
    Vt = np.empty((C, D), np.float32)
    qs = q * np.float32(scale)
    for kvh in range(Hkv):
        hs = slice(kvh * G, (kvh + 1) * G)
        Q = np.ascontiguousarray(qs[:, hs, :]).reshape(T * G, D)    # row (i, g) = i * G + g
        for r0 in range(0, T, ROW_CHUNK):
            r1 = min(T, r0 + ROW_CHUNK)
            Qr = Q[r0 * G:r1 * G]
            m = np.full((r1 - r0) * G, -np.inf, np.float32)
            l = np.zeros((r1 - r0) * G, np.float32)
            o = np.zeros(((r1 - r0) * G, D), np.float32)
            hi = int(rows[r1 - 1]) + 1                      # slots the rows see: [rlo[r0], hi)
            for c0 in range(int(rlo[r0]) // B * B, hi, C):
                c1 = min(hi, c0 + C)
                nk = c1 - c0
                K.gather_tile(kc, vc, bt, kvh, c0, c1, D, lut, Kt, Vt)
                S = Qr @ Kt[:nk].T                                      # [(r1-r0)*G, nk]
                if bias is not None:
                    sl = np.arange(c0, c1)
                    S += bias[bt[sl // B], sl % B][None, :]
                if c1 - 1 > rows[r0] or rlo[r1 - 1] > c0:   # the causal or the window edge
                    slot = np.arange(c0, c1)
                    hide = (slot[None, :] > rows[r0:r1, None]) | (slot[None, :] < rlo[r0:r1, None])
                    S[np.repeat(hide, G, axis=0)] = -np.inf
                m_new = np.maximum(m, S.max(axis=1))
                m_ref = np.where(m_new > -np.inf, m_new, np.float32(0.0))   # rows yet unseen
                alpha = np.exp(m - m_ref)
                S -= m_ref[:, None]
                np.exp(S, out=S)
                l = l * alpha + S.sum(axis=1)
                o *= alpha[:, None]
                o += S @ Vt[:nk]
                m = m_new
            out[r0:r1, hs, :] = (o / l[:, None]).reshape(r1 - r0, G, D)
            row_m[r0:r1, hs] = m.reshape(r1 - r0, G)
            row_l[r0:r1, hs] = l.reshape(r1 - r0, G)


def attention_decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                     block_table: np.ndarray, n_ctx: int, scale: float, window: int,
                     out: np.ndarray, importance: np.ndarray | None = None, decay: float = 1.0,
                     nsplit: int | None = None, backend: str = "numba",
                     bias: np.ndarray | None = None) -> np.ndarray:
    """Attention of one query (position n_ctx - 1) over the cached positions 0..n_ctx-1.

    q: float32 [Hq, D]; out: float32 [Hq, D], written. importance (float16
    [NB][B][Hq] or None) receives this step's probabilities. nsplit: block
    splits per kv head (None: enough to keep every thread busy).
    splits per kv head (None: enough to keep every thread busy). ``bias``: as
    :func:`attention_prefill`. Returns float32 [Hq] log-sum-exp.
    """
    check_args(q, k_cache, v_cache, block_table, n_ctx, window, out, importance, nsplit=nsplit,
               decay=decay, bias=bias)
    if backend == "numpy":
        return attention_decode_ref(q, k_cache, v_cache, block_table, n_ctx, scale, window, out,
                                    importance, decay, bias)
    sel, cnt = every_block(n_ctx, k_cache.shape[2] // q.shape[1], window)
    return decode_over_blocks(q, k_cache, v_cache, block_table, n_ctx, scale, window, sel, cnt,
                              out, importance, decay, nsplit, min_blocks=8, bias=bias)


def sparse_attention_decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                            block_table: np.ndarray, n_ctx: int, scale: float, window: int,
                            sel: np.ndarray, cnt: np.ndarray, out: np.ndarray,
                            importance: np.ndarray | None = None, decay: float = 1.0,
                            recall: bool = False, nsplit: int | None = None,
                            backend: str = "numba", bias: np.ndarray | None = None
                            ) -> tuple[np.ndarray, np.ndarray | None]:
    """Decode attention of one query (position n_ctx - 1) over the selected blocks.

    q: float32 [Hq, D]; k_cache/v_cache: float16 or float32 [Hkv][NB][B*D] /
    [Hkv][NB][D*B], or a quantized layer (:class:`pyimp.kv.cache.QuantizedKV`); block_table: int32 [NB_logical]; sel, cnt: see module
    docstring; out: float32 [Hq, D], written. importance: float16 [NB][B][Hq]
    or None, receives the probabilities of the attended tokens (with
    ``decay != 1`` every valid token is decayed, unattended ones gain 0).
    recall: also run dense attention and return the attention recall, the
    fraction of the dense softmax mass inside the selected blocks (float32
    [Hq], 1.0 = lossless). ``bias``: float32 [NB][B] added to the score of each physical
    slot (the log-multiplicity of merged slots, :mod:`pyimp.kv.merge`), or None.
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
