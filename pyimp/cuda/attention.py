"""CUDA twins of :mod:`pyimp.attention.kernels`: paged decode and prefill attention over the ggml
layout, block-sparse decode over a selection, and the importance updates they feed.

Operands are device arrays in the CPU layouts (docs/kvcache.md section 2): ``kc`` ``[Hkv][NB][B*D]``
token-major and ``vc`` ``[Hkv][NB][D*B]`` transposed, float16 or float32, or either side a
quantized layer (:class:`pyimp.cuda.kvblocks.DeviceQuantizedKV`: ggml blocks in the host's byte
layout, V by token, and the float32 tail of the block being filled); K and V types may differ.
``bt`` int32 logical -> physical block; ``importance`` float16 ``[NB][B][Hq]``; selections
``sel`` int32 ``[nsets, K]``, ``cnt`` int32 ``[nsets]`` (query head h uses set
``h // (Hq // nsets)``).

Kernels read the cache only through the element readers of :mod:`pyimp.cuda.kvblocks` (one
per storage format): a quantized block is decoded in the kernel where it is read (the tail
block from the tail), so there is no dequantized copy of the cache and no scratch that grows
with it. ``_attend`` and ``_prefill_mass`` are built once per pair of formats (K, V) they read
(``_attend_kernel``, ``_prefill_mass_kernel``) and compiled at their first launch.

Kernels (one thread block per work item, ``THREADS`` threads):

- ``_attend``: work item = (tile of query rows, unit, split). A unit is the query heads of one
  kv head that share a set (as on the CPU); a prefill tile is up to ``tile_rows`` consecutive
  rows (decode: one), and its (row, head) pairs are the work item's *virtual heads*, whose
  queries sit in shared memory, so each KV block is read once for all of them. Per KV block
  of its share of the blocks: a lane group (a warp on hardware) takes a key row, its lanes
  over the channels (consecutive loads) with one partial dot product per virtual head,
  summed over the group with warp shuffles (``score_block_fn``); each row's own causal /
  sliding-window mask sets its hidden scores to -inf; the maxima, then the sums, of every
  virtual head are reduced over the block together to fold the block into the running
  (m, l) with the max-stabilized rule (``fold_block``); then the block's values are staged
  into shared memory 32 channels at a time by loads in storage order (consecutive threads,
  consecutive elements: a transposed float V's rows, a quantized V's tokens) and each thread
  accumulates its (head, channel) outputs over the block's tokens from there
  (``accumulate_v_fn``). The split writes its partial
  (m, l, o) (flash-decoding); with ``store`` it also keeps exp(score - running max) per
  attended token and the running max per block. A tile's blocks are either every block its
  rows' masks leave visible (dense, prefill) or the selection of its set (sparse decode).
- ``_merge``: work item = (row, head): merges the splits, normalizes, writes the output and the
  row's max M and sum L (lse = M + log L).
- ``_block_mass`` / ``_decay_mass``: a decode step's probabilities
  P = stored * exp(block max - M) / L added to ``importance`` (one writer per entry; float32
  sum, clamped to the fp16 maximum, rounded once to fp16 as the CPU path does). ``_decay_mass``
  is the ``decay != 1`` path: every valid entry becomes ``decay*old + P``.
- ``_prefill_mass``: work item = (kv head, key block): the mass the observed prompt rows give
  each key (scores recomputed against the rows' M and L), added to ``importance``.

Launches per call: decode 2 (+1 with importance), prefill 2 (+1 with importance).
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from . import device, kvblocks

THREADS = 8 if device.SIMULATOR else 128
MAX_UNIT_HEADS = 16      # query heads one work item serves (a GQA group at most)
FP16_MAX = 65504.0
NEG_INF = -math.inf


# --------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------


@cuda.jit(device=True)
def fold_block(s, B, t0, t1, nh, m, l, alpha, red):
    """Fold one KV block's scores s[g*B + t0 .. g*B + t1) of each of the nh heads into the
    heads' running max m[g] and sum l[g] (the max-stabilized rule): s becomes exp(s - m),
    alpha[g] the factor the head's earlier output is rescaled by. A -inf score (a masked
    token) becomes 0, also while a head has seen nothing else. The nh maxima, then the nh
    sums, are reduced over the block together (``device.block_max_n`` / ``block_sum_n``: red
    holds nh * blockDim slots). Ends with a barrier (every exp visible to every thread)."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    v = cuda.local.array(MAX_UNIT_HEADS, float32)
    for g in range(nh):
        x = float32(NEG_INF)
        for t in range(t0 + tid, t1, nt):
            x = max(x, s[g * B + t])
        v[g] = x
    device.block_max_n(v, nh, red)
    for g in range(nh):
        bm = v[g]
        a = float32(1.0)
        if bm > m[g]:
            a = float32(0.0)
            if m[g] > NEG_INF:
                a = math.exp(m[g] - bm)
            m[g] = bm
        alpha[g] = a
        ls = float32(0.0)
        for t in range(t0 + tid, t1, nt):
            e = float32(0.0)
            if m[g] > NEG_INF:
                e = math.exp(s[g * B + t] - m[g])
            s[g * B + t] = e
            ls += e
        v[g] = ls
    device.block_sum_n(v, nh, red)
    for g in range(nh):
        l[g] = l[g] * alpha[g] + v[g]


@functools.cache
def score_block_fn(kfmt: str):
    """The device function scoring one KV block, K read in format kfmt:
    ``score_block(qs, kc, kt, ktb, kvh, pb, t0, t1, nh, D, sc, s, B, part, red)`` writes
    s[g*B + t] = sc * (qs[g*D:(g+1)*D] . key t of physical block pb, kv head kvh) for t in
    [t0, t1), g < nh. A lane group takes a key row: its lanes stride over the channels
    (consecutive fp16 loads), each lane keeps nh partial dot products (``part``, a local array
    of >= nh), and ``device.lane_sums`` adds them over the group (warp shuffles on hardware);
    the key is read once for all nh heads. Every thread of the block calls it; the caller
    syncs before reading s."""
    kget = kvblocks.readers(kfmt)[0]

    @cuda.jit(device=True)
    def score_block(qs, kc, kt, ktb, kvh, pb, t0, t1, nh, D, sc, s, B, part, red):
        lane, grp, ngrp, lanes = device.lane_group()
        for t in range(t0 + grp, t1, ngrp):
            for g in range(nh):
                part[g] = float32(0.0)
            for d in range(lane, D, lanes):
                kv = kget(kc, kt, ktb, kvh, pb, t * D + d)
                for g in range(nh):
                    part[g] += qs[g * D + d] * kv
            device.lane_sums(part, nh, red)
            if lane == 0:
                for g in range(nh):
                    s[g * B + t] = part[g] * sc

    return score_block


VROWS = 32               # V rows (channels) a block stages into shared memory at a time


@functools.cache
def accumulate_v_fn(vfmt: str):
    """The device function adding one KV block's values to the outputs, V read in format vfmt:
    ``accumulate_v(vc, vt, vtb, kvh, pb, t0, t1, nh, D, B, s, alpha, o, vs)`` makes
    o[g*D + d] = o[g*D + d] * alpha[g] + sum over t in [t0, t1) of s[g*B + t] * V[t, d] (in
    token order). VROWS channels at a time, the block's values are staged into the shared
    ``vs`` (VROWS * (B + 1) slots: a row stride of B + 1 keeps the threads of neighbouring
    channels on different banks) by loads in storage order, consecutive threads reading
    consecutive elements (a float V row is its tokens, a quantized V's its channels); then a
    thread per (head, channel) sums from shared memory. Every thread of the block calls it;
    it ends with a barrier."""
    vget = kvblocks.readers(vfmt)[1]
    by_token = vfmt != "float"

    @cuda.jit(device=True)
    def accumulate_v(vc, vt, vtb, kvh, pb, t0, t1, nh, D, B, s, alpha, o, vs):
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        ntok = t1 - t0
        for d0 in range(0, D, VROWS):
            nd = min(VROWS, D - d0)
            for i in range(tid, nd * ntok, nt):
                if by_token:
                    t = t0 + i // nd
                    dd = i % nd
                else:
                    dd = i // ntok
                    t = t0 + i % ntok
                vs[dd * (B + 1) + t] = vget(vc, vt, vtb, kvh, pb, t, d0 + dd, B, D)
            cuda.syncthreads()
            for i in range(tid, nh * nd, nt):
                g = i // nd
                dd = i % nd
                acc = float32(0.0)
                for t in range(t0, t1):
                    acc += s[g * B + t] * vs[dd * (B + 1) + t]
                j = g * D + d0 + dd
                o[j] = o[j] * alpha[g] + acc
            cuda.syncthreads()

    return accumulate_v


@cuda.jit(device=True)
def merge_splits(m_part, l_part, o_part, r, h, out):
    """Merge head h's split partials of row r (m_part / l_part [R, Hq, nsplit], o_part
    [R, Hq, nsplit, D]) into out[r, h] (the block's threads over D); returns the row's max M
    and sum L (lse = M + log L)."""
    nsplit = m_part.shape[2]
    D = o_part.shape[3]
    mh = float32(NEG_INF)
    for sp in range(nsplit):
        mh = max(mh, m_part[r, h, sp])
    lh = float32(0.0)
    for sp in range(nsplit):
        if m_part[r, h, sp] > NEG_INF:
            lh += l_part[r, h, sp] * math.exp(m_part[r, h, sp] - mh)
    inv = float32(1.0)
    if lh > 0.0:
        inv = float32(1.0) / lh
    for d in range(cuda.threadIdx.x, D, cuda.blockDim.x):
        acc = float32(0.0)
        for sp in range(nsplit):
            if m_part[r, h, sp] > NEG_INF:
                acc += o_part[r, h, sp, d] * math.exp(m_part[r, h, sp] - mh)
        out[r, h, d] = acc * inv if lh > 0.0 else acc
    return mh, lh


@cuda.jit(device=True)
def split_blocks(n_ctx, lo, B, dense, cnt, si, nsplit, sp):
    """(lb_first, n_blocks, k_beg, k_end) of a split: a dense walk covers the logical blocks
    lb_first .. of the visible tokens [lo, n_ctx), a sparse one set si's cnt[si] selected
    blocks (lb_first 0); split sp of nsplit takes walk steps [k_beg, k_end)."""
    lb_first = 0
    if dense:
        lb_first = lo // B
        n_blocks = (n_ctx - 1) // B - lb_first + 1
    else:
        n_blocks = cnt[si]
    per = (n_blocks + nsplit - 1) // nsplit
    k_beg = sp * per
    return lb_first, n_blocks, k_beg, min(n_blocks, k_beg + per)


@cuda.jit(device=True)
def attend_shared(nv, D, B):
    """(qs, o, s, red, vs): the dynamic shared memory of an attention work item with nv
    virtual heads, as ``_shared_bytes`` sizes it: queries and outputs [nv * D], one block's
    scores [nv * B], the n-wide reductions' scratch [nv * blockDim], the staged values
    [VROWS * (B + 1)]."""
    sh = cuda.shared.array(0, float32)
    a = nv * D
    b = 2 * a + nv * B
    c = b + nv * cuda.blockDim.x
    return sh[0:a], sh[a:2 * a], sh[2 * a:b], sh[b:c], sh[c:c + VROWS * (B + 1)]


@functools.cache
def _attend_kernel(kfmt: str, vfmt: str):
    """``_attend`` for K stored in format kfmt and V in vfmt (:mod:`pyimp.cuda.kvblocks`)."""
    score_block = score_block_fn(kfmt)
    accumulate_v = accumulate_v_fn(vfmt)

    @cuda.jit
    def _attend(q, kc, kt, ktb, vc, vt, vtb, B, bt, pos0, scale, window, sel, cnt, dense, nsplit,
                nh, rt, m_part, l_part, o_part, store, probs, bmax):
        R, Hq, D = q.shape
        Hkv = kc.shape[0]
        G = Hq // Hkv
        hps = Hq // sel.shape[0]
        units = Hq // nh
        nv = rt * nh                                # virtual heads: (tile row, unit head)
        bid = cuda.blockIdx.x
        sp = bid % nsplit
        u = (bid // nsplit) % units
        r0 = (bid // (nsplit * units)) * rt
        h0 = u * nh
        kvh = h0 // G
        si = h0 // hps
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        sc = float32(scale)
        n_ctx = pos0 + min(r0 + rt, R)              # the tile's last row sees the most keys
        lo = 0
        if window > 0:
            lo = max(0, pos0 + r0 + 1 - window)     # ... and its first row the earliest
        lb_first, n_blocks, k_beg, k_end = split_blocks(n_ctx, lo, B, dense, cnt, si, nsplit,
                                                        sp)
        qs, o, s, red, vs = attend_shared(nv, D, B)
        m = cuda.local.array(MAX_UNIT_HEADS, float32)
        l = cuda.local.array(MAX_UNIT_HEADS, float32)
        alpha = cuda.local.array(MAX_UNIT_HEADS, float32)
        part = cuda.local.array(MAX_UNIT_HEADS, float32)
        for i in range(tid, nv * D, nt):
            r = r0 + i // (nh * D)
            qs[i] = q[r, h0 + (i // D) % nh, i % D] if r < R else float32(0.0)
            o[i] = float32(0.0)
        for g in range(nv):
            m[g] = float32(NEG_INF)
            l[g] = float32(0.0)
        cuda.syncthreads()

        for k in range(k_beg, k_end):
            if dense:
                lb = lb_first + k
            else:
                lb = sel[si, k]
            pb = bt[lb]
            base = lb * B
            t0 = max(lo - base, 0)
            t1 = max(min(n_ctx - base, B), t0)      # a block the masks hide is an empty range
            ntok = t1 - t0
            score_block(qs, kc, kt, ktb, kvh, pb, t0, t1, nv, D, sc, s, B, part, red)
            cuda.syncthreads()
            if rt > 1:                              # each row's own causal / window mask
                for i in range(tid, nv * ntok, nt):
                    g = i // ntok
                    t = t0 + i % ntok
                    r = r0 + g // nh
                    p = base + t
                    if r >= R or p > pos0 + r or (window > 0 and p <= pos0 + r - window):
                        s[g * B + t] = float32(NEG_INF)
                cuda.syncthreads()
            fold_block(s, B, t0, t1, nv, m, l, alpha, red)
            accumulate_v(vc, vt, vtb, kvh, pb, t0, t1, nv, D, B, s, alpha, o, vs)
            if store:                               # decode only: one row, nv == nh
                for i in range(tid, nh * ntok, nt):
                    g = i // ntok
                    t = t0 + i % ntok
                    probs[h0 + g, k, t] = s[g * B + t]
                for g in range(tid, nh, nt):
                    bmax[h0 + g, k] = m[g]
            cuda.syncthreads()                      # s is rewritten by the next block

        for i in range(tid, nv * D, nt):
            r = r0 + i // (nh * D)
            if r < R:
                o_part[r, h0 + (i // D) % nh, sp, i % D] = o[i]
        for g in range(tid, nv, nt):               # more virtual heads than threads: a loop
            r = r0 + g // nh
            if r < R:
                m_part[r, h0 + g % nh, sp] = m[g]
                l_part[r, h0 + g % nh, sp] = l[g]

    return _attend

@cuda.jit
def _merge(m_part, l_part, o_part, out, M, L):
    Hq = o_part.shape[1]
    r = cuda.blockIdx.x // Hq
    h = cuda.blockIdx.x % Hq
    mh, lh = merge_splits(m_part, l_part, o_part, r, h, out)
    if cuda.threadIdx.x == 0:
        M[r, h] = mh
        L[r, h] = lh


@cuda.jit(device=True)
def prob(probs, bmax, Mh, Lh, h, k, t):
    """P of token t of the k-th attended block of head h, whose row max and sum are Mh, Lh
    (0 where nothing was attended)."""
    if Lh > 0.0 and bmax[h, k] > NEG_INF:
        return probs[h, k, t] * (math.exp(bmax[h, k] - Mh) / Lh)
    return float32(0.0)


@cuda.jit(device=True)
def store_mass(importance, pb, t, h, x):
    """importance[pb, t, h] = x, clamped to the fp16 maximum (rounded once to fp16)."""
    if x > FP16_MAX:
        x = float32(FP16_MAX)
    importance[pb, t, h] = x


@cuda.jit
def _block_mass(importance, bt, sel, cnt, dense, lb_first, n_blocks, probs, bmax, M, L, n_ctx,
                window):
    """decay == 1: work item = (set, k-th block of the set); threads over (token, head of set)."""
    NB, B, Hq = importance.shape
    nsets = sel.shape[0]
    hps = Hq // nsets
    Kw = probs.shape[1]
    si = cuda.blockIdx.x // Kw
    k = cuda.blockIdx.x % Kw
    count = n_blocks if dense else cnt[si]
    if k >= count:
        return
    lb = lb_first + k if dense else sel[si, k]
    pb = bt[lb]
    base = lb * B
    lo = 0
    if window > 0:
        lo = max(0, n_ctx - window)
    t0 = max(lo - base, 0)
    t1 = min(n_ctx - base, B)
    for i in range(cuda.threadIdx.x, B * hps, cuda.blockDim.x):
        t = i // hps
        h = si * hps + i % hps
        if t0 <= t < t1:
            x = float32(importance[pb, t, h]) + prob(probs, bmax, M[0, h], L[0, h], h, k, t)
            store_mass(importance, pb, t, h, x)


@cuda.jit
def _decay_mass(importance, bt, sel, cnt, dense, lb_first, n_blocks, probs, bmax, M, L, n_ctx,
                window, decay):
    """decay != 1: work item = logical block lb; every valid entry becomes decay*old + P."""
    NB, B, Hq = importance.shape
    nsets = sel.shape[0]
    hps = Hq // nsets
    lb = cuda.blockIdx.x
    pb = bt[lb]
    base = lb * B
    lo = 0
    if window > 0:
        lo = max(0, n_ctx - window)
    dec = float32(decay)
    for i in range(cuda.threadIdx.x, B * Hq, cuda.blockDim.x):
        t = i // Hq
        h = i % Hq
        if base + t >= n_ctx:
            continue
        x = dec * float32(importance[pb, t, h])
        if base + t >= lo:
            si = h // hps
            k = -1
            if dense:
                if lb_first <= lb < lb_first + n_blocks:
                    k = lb - lb_first
            else:
                for j in range(cnt[si]):
                    if sel[si, j] == lb:
                        k = j
            if k >= 0:
                x += prob(probs, bmax, M[0, h], L[0, h], h, k, t)
        store_mass(importance, pb, t, h, x)


@functools.cache
def _prefill_mass_kernel(kfmt: str):
    """``_prefill_mass`` for K stored in format kfmt."""
    kget = kvblocks.readers(kfmt)[0]

    @cuda.jit
    def _prefill_mass(q, kc, kt, ktb, B, bt, pos0, scale, window, M, L, r0, lbA, importance,
                      decay):
        """Work item = (kv head, key block lbA + j); threads over (token, head of the group)."""
        T, Hq, D = q.shape
        Hkv = kc.shape[0]
        G = Hq // Hkv
        nkb = cuda.gridDim.x // Hkv
        kvh = cuda.blockIdx.x // nkb
        lb = lbA + cuda.blockIdx.x % nkb
        pb = bt[lb]
        base = lb * B
        n = pos0 + T
        p_lo = 0
        if window > 0:
            p_lo = max(0, pos0 + r0 - window + 1)
        sc = float32(scale)
        dec = float32(decay)
        for i in range(cuda.threadIdx.x, B * G, cuda.blockDim.x):
            t = i // G
            h = kvh * G + i % G
            p = base + t
            if p >= n:
                continue
            x = float32(importance[pb, t, h])
            if decay != 1.0:
                x = dec * x
            elif p < p_lo:
                continue
            if p >= p_lo:
                acc = float32(0.0)
                for r in range(r0, T):
                    pq = pos0 + r
                    if p <= pq and (window <= 0 or pq - p < window):
                        dot = float32(0.0)
                        for d in range(D):
                            dot += q[r, h, d] * kget(kc, kt, ktb, kvh, pb, t * D + d)
                        acc += math.exp(dot * sc - M[r, h]) * (float32(1.0) / L[r, h])
                x += acc
            store_mass(importance, pb, t, h, x)

    return _prefill_mass


# --------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------


def _unit_heads(Hq: int, Hkv: int, nsets: int) -> int:
    """Query heads per work item: the heads of one kv head that share a set."""
    nh = min(Hq // nsets, Hq // Hkv)
    if nh > MAX_UNIT_HEADS:
        raise ValueError(f"{nh} query heads per kv head exceed the device kernels' "
                         f"{MAX_UNIT_HEADS}")
    return nh


def _shared_bytes(nv: int, D: int, B: int, nt: int) -> int:
    """Dynamic shared memory of ``_attend`` with nv virtual heads: queries, outputs, one
    block's scores, the n-wide reductions' scratch and the staged values."""
    return (2 * nv * D + nv * B + nv * nt + VROWS * (B + 1)) * 4


SHARED_BUDGET = 48 * 1024     # dynamic shared memory a launch gets without opting in


def tile_rows(T: int, nh: int, D: int, B: int, nt: int) -> int:
    """Query rows per prefill work item: as many as keep ``rows * nh`` heads within
    MAX_UNIT_HEADS and the shared memory within SHARED_BUDGET (each KV block is then read
    once for all of them)."""
    rt = max(1, min(T, MAX_UNIT_HEADS // nh))
    while rt > 1 and _shared_bytes(rt * nh, D, B, nt) > SHARED_BUDGET:
        rt -= 1
    return rt


def default_splits(n_blocks: int, units: int, min_blocks: int = 4, target: int = 264) -> int:
    """Splits per unit so that units * splits fills ~``target`` thread blocks (2 per SM of an
    H200), with at least ``min_blocks`` KV blocks per split."""
    return max(1, min(-(-target // max(units, 1)), n_blocks // max(min_blocks, 1)))


def _check(q, kc, vc, bt):
    """(R, Hq, D, Hkv, B) of an attention call; kc / vc: float device arrays or
    :class:`pyimp.cuda.kvblocks.DeviceQuantizedKV` layers (shape: the float layout's)."""
    ks, vs = tuple(int(x) for x in kc.shape), tuple(int(x) for x in vc.shape)
    if len(q.shape) != 3 or len(ks) != 3 or len(vs) != 3:
        raise ValueError("q must be [R, Hq, D] and the caches [Hkv][NB][B*D] / [Hkv][NB][D*B]")
    R, Hq, D = (int(x) for x in q.shape)
    Hkv, NB, BD = ks
    if vs != ks:
        raise ValueError(f"v cache shape {vs} differs from the k cache's {ks}")
    if Hq % Hkv or BD % D:
        raise ValueError(f"query heads {Hq} / kv heads {Hkv} / head dim {D} do not fit "
                         f"the cache rows of {BD}")
    for name, c in (("k", kc), ("v", vc)):
        if isinstance(c, kvblocks.DeviceQuantizedKV) and c.head_dim != D:
            raise ValueError(f"{name} cache is quantized for head dim {c.head_dim}, q has {D}")
    return R, Hq, D, Hkv, BD // D


def _operands(kc, vc, scratch):
    """The attention kernel of the two sides' formats and its cache arguments."""
    ph = scratch.get("tail0", (1, 1), np.float32)
    kern = _attend_kernel(kvblocks.fmt_of(kc), kvblocks.fmt_of(vc))
    return kern, kvblocks.operand(kc, ph) + kvblocks.operand(vc, ph)


class Scratch:
    """Device buffers of the decode partials, grown on demand and reused across calls."""

    def __init__(self):
        self._bufs: dict = {}

    def get(self, name: str, shape: tuple, dtype) -> object:
        b = self._bufs.get(name)
        if b is None or b.shape != tuple(shape) or b.dtype != np.dtype(dtype):
            b = device.empty(tuple(shape), dtype)
            self._bufs[name] = b
        return b


_SCRATCH = Scratch()


def decode(q, kc, vc, bt, n_ctx: int, scale: float, window: int, out, sel=None, cnt=None,
           n_sel: int = 0, importance=None, decay: float = 1.0, nsplit: int | None = None,
           scratch: Scratch | None = None):
    """Decode attention of q ``[1, Hq, D]`` (position n_ctx - 1) into out ``[1, Hq, D]``.

    ``sel`` None: every block the masks leave visible (dense). Otherwise the selection
    (``sel``, ``cnt`` on the device) with ``n_sel`` = sel.shape[1]. ``importance`` (float16
    ``[NB][B][Hq]``, on the device) receives the step's probabilities (``decay*old + P`` with
    decay != 1). Returns (M, L) device arrays ``[1, Hq]`` (lse = M + log L)."""
    R, Hq, D, Hkv, B = _check(q, kc, vc, bt)
    if R != 1:
        raise ValueError(f"decode takes one query row, got {R}")
    scratch = scratch or _SCRATCH
    dense = sel is None
    lo = max(0, n_ctx - window) if window > 0 else 0
    lb_first = lo // B
    if dense:
        n_blocks = (n_ctx - 1) // B - lb_first + 1
        sel = scratch.get("sel0", (1, 1), np.int32)
        cnt = scratch.get("cnt0", (1,), np.int32)
        nsets, Kw = 1, n_blocks
    else:
        nsets, Kw = sel.shape
        n_blocks = Kw
    nh = _unit_heads(Hq, Hkv, nsets)
    units = Hq // nh
    if nsplit is None:
        nsplit = default_splits(n_blocks, units)
    store = importance is not None
    m_part = scratch.get("m", (1, Hq, nsplit), np.float32)
    l_part = scratch.get("l", (1, Hq, nsplit), np.float32)
    o_part = scratch.get("o", (1, Hq, nsplit, D), np.float32)
    probs = scratch.get("p", (Hq, Kw, B) if store else (1, 1, 1), np.float32)
    bmax = scratch.get("bm", (Hq, Kw) if store else (1, 1), np.float32)
    M = scratch.get("M", (1, Hq), np.float32)
    L = scratch.get("L", (1, Hq), np.float32)
    nt = THREADS
    attend, kv = _operands(kc, vc, scratch)
    device.launch(attend, units * nsplit, nt, q, *kv, np.int32(B), bt, np.int32(n_ctx - 1),
                  np.float32(scale), np.int32(window), sel, cnt, dense, np.int32(nsplit),
                  np.int32(nh), np.int32(1), m_part, l_part, o_part, store, probs, bmax,
                  shared=_shared_bytes(nh, D, B, nt))
    device.launch(_merge, Hq, min(nt, device.pow2_threads(D)), m_part, l_part, o_part, out, M, L)
    if store:
        if decay == 1.0:
            device.launch(_block_mass, nsets * Kw, nt, importance, bt, sel, cnt, dense,
                          np.int32(lb_first), np.int32(n_blocks), probs, bmax, M, L,
                          np.int32(n_ctx), np.int32(window))
        else:
            device.launch(_decay_mass, -(-n_ctx // B), nt, importance, bt, sel, cnt, dense,
                          np.int32(lb_first), np.int32(n_blocks), probs, bmax, M, L,
                          np.int32(n_ctx), np.int32(window), np.float32(decay))
    return M, L


def prefill(q, kc, vc, bt, pos0: int, scale: float, window: int, out, importance=None,
            obs_start: int = 0, decay: float = 1.0, scratch: Scratch | None = None,
            rows: int | None = None):
    """Causal (optionally sliding-window) attention of a prompt chunk q ``[T, Hq, D]`` (row i at
    position pos0 + i; its K/V already cached) into out ``[T, Hq, D]``. ``importance`` receives
    the probabilities of the rows at positions >= ``obs_start`` (``decay*old + new``).
    ``rows``: query rows per work item (default :func:`tile_rows`). Returns (M, L) device
    arrays ``[T, Hq]``."""
    T, Hq, D, Hkv, B = _check(q, kc, vc, bt)
    scratch = scratch or _SCRATCH
    nh = _unit_heads(Hq, Hkv, 1)
    units = Hq // nh
    m_part = scratch.get("pm", (T, Hq, 1), np.float32)
    l_part = scratch.get("pl", (T, Hq, 1), np.float32)
    o_part = scratch.get("po", (T, Hq, 1, D), np.float32)
    M = scratch.get("pM", (T, Hq), np.float32)
    L = scratch.get("pL", (T, Hq), np.float32)
    dummy_sel = scratch.get("sel0", (1, 1), np.int32)
    dummy_cnt = scratch.get("cnt0", (1,), np.int32)
    dummy_p = scratch.get("p0", (1, 1, 1), np.float32)
    dummy_b = scratch.get("bm0", (1, 1), np.float32)
    nt = THREADS
    attend, kv = _operands(kc, vc, scratch)
    rt = tile_rows(T, nh, D, B, nt) if rows is None else int(rows)
    if not 1 <= rt * nh <= MAX_UNIT_HEADS:
        raise ValueError(f"rows = {rows}: rows x {nh} heads per work item must be in "
                         f"1..{MAX_UNIT_HEADS}")
    device.launch(attend, -(-T // rt) * units, nt, q, *kv, np.int32(B), bt, np.int32(pos0),
                  np.float32(scale), np.int32(window), dummy_sel, dummy_cnt, True, np.int32(1),
                  np.int32(nh), np.int32(rt), m_part, l_part, o_part, False, dummy_p, dummy_b,
                  shared=_shared_bytes(rt * nh, D, B, nt))
    device.launch(_merge, T * Hq, min(nt, device.pow2_threads(D)), m_part, l_part, o_part, out,
                  M, L)
    r0 = max(0, int(obs_start) - int(pos0))
    if importance is not None and r0 < T:
        n = pos0 + T
        p_lo = 0 if window <= 0 else max(0, pos0 + r0 - window + 1)
        lbA = 0 if decay != 1.0 else p_lo // B
        nkb = -(-n // B) - lbA
        device.launch(_prefill_mass_kernel(kvblocks.fmt_of(kc)), Hkv * nkb, nt, q, *kv[:3],
                      np.int32(B), bt, np.int32(pos0), np.float32(scale), np.int32(window), M, L,
                      np.int32(r0), np.int32(lbA), importance, np.float32(decay))
    return M, L
