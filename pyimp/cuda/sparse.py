"""CUDA twins of :mod:`pyimp.sparse`: anchors, block scoring, block selection, importance decay.

Operands are device arrays in the CPU layouts (docs/kvcache.md section 2): ``k_cache`` one layer
``[Hkv][NB][B*D]`` token-major, float16 or float32, or a quantized K layer
(:class:`pyimp.cuda.kvblocks.DeviceQuantizedKV`); ``anchor`` float16 ``[NB][A][Ha][D]``
(``Ha = Hkv`` or ``Hq`` for the group-shared types, ``Hq`` for DYNAMIC); ``importance``
float16 ``[NB][B][Hq]``; ``block_table`` int32 logical -> physical; query ``q`` float32
``[Hq, D]``; selections ``sel`` int32 ``[nsets, K]`` and ``cnt`` int32 ``[nsets]`` in the
CPU format (:mod:`pyimp.sparse.retrieval`). Host NumPy arrays are accepted for the small
integer operands (``blocks``, ``n_valid``, ``block_table``); they are copied to the device.

Kernels (``THREADS`` threads per block unless said otherwise):

The anchor kernels read keys through the K reader of :mod:`pyimp.cuda.kvblocks` (built once per
storage format, ``_anchor_kernels``): a quantized layer's anchors are those of its dequantized
keys (the tail block's from the float tail), decoded where they are read, which is what the
CPU computes from ``QuantizedKV.blocks_f32``.

- ``_anchor_kernel``: grid ``(n, Hkv)``, one thread block per (listed block, kv head) running
  ``_anchor_body`` (also called by the decode step's K store, :mod:`pyimp.cuda.decode`);
  ``anchor_threads(D)`` threads stride over the D channels, each runs over the block's valid
  tokens in order (float32 sums in token order, as NumPy's reduction over the token axis
  does), and writes the A slots of its channel into each of the ``Ha / Hkv`` head slots of
  the kv head. Types FIXED, QUEST, BLOCK_MEAN, BLOCK_MAX, CUBOID_MEAN (an int32 code).
- ``_dynamic_kernel``: grid ``(n, Hq)``, one thread block per (listed block, query head);
  threads stride over the valid tokens to rank them by importance (rank = number of tokens
  ahead in the CPU's stable descending order: higher importance first, ties lower position
  first, NaN last), then over the channels to sum the keys of the tokens ranked < A.
- ``_set_scores_kernel``: 1-D grid, one thread block per ``max(1, THREADS // Hq)`` candidate
  blocks; a thread computes the score of one (candidate, query head) pair, ``sum_d
  max_a(anchor * q)`` over the channels in order (as the CPU kernel does), into shared
  memory; after one barrier a thread per (candidate, set) sums the set's heads in order.
  Query head h reads anchor head ``(h // gdiv) * astep`` (its own, its group leader's, or its
  kv head's slot).
- ``_select_kernel``: grid ``nsets``, ``SELECT_THREADS`` threads, one thread block per set.
  Scores travel as their int32 bit patterns (a view of the float32 scores), mapped to
  order-preserving keys (NaN ranks as -inf, -0 == +0). A most-significant-digit radix select
  (4 passes of 8 bits, a shared 256-bin histogram) finds the ``pick``-th largest key and how
  many of the keys equal to it are taken; a compaction pass over the candidates in chunks of
  the block size (one packed block-wide prefix sum per chunk: warp shuffles on hardware, a
  shared-memory Hillis-Steele scan on the simulator) writes the picks in ascending
  block order, ties taken lowest block first, as the CPU's stable order does. Init, local
  and tail blocks, the -1 padding and the dense case ("attend everything") are written by
  the same kernel.
- ``_retrieve_kernel``: scoring and selection in one launch (``retrieve_blocks``): the scoring
  grid and threads; the last thread block to finish (an atomic ticket) selects each set in
  turn with the selection's code.
- ``_decay_kernel``: a 1-D grid over the ``n_ctx * Hq`` valid entries, one thread per entry:
  ``fp16(min(float32(decay) * old, 65504))`` as the CPU update rounds it.

QUEST and CUBOID_MEAN store their upper slot rounded up and their lower slot rounded down
(``_f16_up`` / ``_f16_down``: round to nearest, then one fp16 step outward where that moved
inward), bit-identical to the CPU's ``round_up_f16`` / ``_round_down_f16``; every other
store rounds to nearest even.

Launches: ``compute_anchors`` 1, ``set_scores`` 1, ``select_blocks`` 1, ``retrieve_blocks`` 1,
``decay_importance`` 1 (0 when decay == 1).

Differences from the CPU path: anchors are float16 only (the CPU also takes float32 anchor
buffers); the block ids a device array holds are not
range-checked (host arrays are); set scores are summed per head in channel order, then over
the set's heads in float32 (the CPU's numba path sums compressed queries, its reference sums
heads in float64): equal up to float32 rounding, so a near-tie may rank differently than the
CPU ranks its own scores; given the same scores, the selection is identical.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, int64
from numba.core.types import float16

from pyimp.sparse.anchors import AnchorType, anchor_slots, group_shared
from pyimp.sparse.retrieval import (RetrievalType, check_budget, check_anchor_heads,
                                    n_candidates, n_sets, recent_blocks)

from . import device, kvblocks

THREADS = 32 if device.SIMULATOR else 128          # scoring, decay
SELECT_THREADS = 32 if device.SIMULATOR else 256   # selection (one block per set)
MAX_THREADS = 1024                                 # shared scratch sized for any block size
MAX_BLOCK_LEN = 1024                               # DYNAMIC ranks a block's tokens in shared memory

FP16_MAX = np.float32(65504.0)
_F16_MIN_NORMAL = np.float32(2.0 ** -14)
_F16_TINY = np.float32(2.0 ** -24)                 # smallest fp16 subnormal = subnormal spacing
_NEG_INF = np.float32(-np.inf)
_STEP = np.float32(2.0 ** -11)
_STEP_BELOW = np.float32(2.0 ** -12)

# anchor type codes of _anchor_kernel
_FIXED, _QUEST, _MEAN, _MAX, _CUBOID = 0, 1, 2, 3, 4
_KIND = {AnchorType.FIXED: _FIXED, AnchorType.QUEST: _QUEST, AnchorType.BLOCK_MEAN: _MEAN,
         AnchorType.BLOCK_MAX: _MAX, AnchorType.CUBOID_MEAN: _CUBOID}


def anchor_threads(D: int) -> int:
    return device.pow2_threads(D, 32, 32 if device.SIMULATOR else 128)


# --------------------------------------------------------------------------
# fp16 directed rounding (what anchors.round_up_f16 / _round_down_f16 do)
# --------------------------------------------------------------------------


@cuda.jit(device=True)
def _f16_next_up(y):
    """The fp16 value just above the fp16 value y (float32; not +inf, not NaN), as float32.
    65504 goes to 65536, which stores as fp16 +inf (what np.nextafter gives)."""
    if y == _NEG_INF:
        return -FP16_MAX
    a = abs(y)
    if a < _F16_MIN_NORMAL or (y < float32(0.0) and a == _F16_MIN_NORMAL):
        r = float32(y + _F16_TINY)              # subnormal spacing
        if r == float32(0.0) and y < float32(0.0):
            r = float32(-0.0)                   # nextafter(-tiny, +inf) is -0
        return r
    # a = m * 2**e, 0.5 <= m < 1: the binade [2**(e-1), 2**e) has spacing 2**(e-11) = p / 2**11
    # with p = a / m = 2**e (exact); below a power of two (y < 0, m = 0.5) it is half that
    m, _ = math.frexp(a)
    p = float32(a / float32(m))
    if y < float32(0.0) and m == float32(0.5):
        return float32(y + p * _STEP_BELOW)
    return float32(y + p * _STEP)


@cuda.jit(device=True)
def _f16_up(x):
    """Smallest fp16 >= x (float32 in, the fp16 value as float32 out); NaN stays NaN."""
    y = float32(float16(x))
    if y < x:
        y = _f16_next_up(y)
    return y


@cuda.jit(device=True)
def _f16_down(x):
    """Largest fp16 <= x (float32 in, the fp16 value as float32 out); NaN stays NaN."""
    y = float32(float16(x))
    if y > x:
        y = -_f16_next_up(-y)
    return y


# --------------------------------------------------------------------------
# anchors
# --------------------------------------------------------------------------


@cuda.jit(device=True)
def _sampled(t, A, B):
    """FIXED samples in-block positions a*B//A (a < A): is t one of them?"""
    a = (t * A + B - 1) // B                   # smallest a with a*B//A >= t
    return a < A and (a * B) // A == t


@functools.cache
def _anchor_body(kfmt: str):
    """The device function that writes one block's anchors of one kv head, K read in format
    kfmt: ``body(kind, k_cache, kt, ktb, B, pb, nv, kvh, anchor)`` over physical block pb's
    first nv tokens, the thread block's threads striding over the D channels (each runs over
    the tokens in order: float32 sums in token order, as NumPy's reduction over the token axis
    does), the A slots of a channel written into each of the ``Ha / Hkv`` head slots of kv head
    kvh. Called by ``_anchor_kernel`` and by the decode step's store
    (:mod:`pyimp.cuda.decode`), which refreshes the block it wrote into."""
    kget = kvblocks.readers(kfmt)[0]

    @cuda.jit(device=True)
    def body(kind, k_cache, kt, ktb, B, pb, nv, kvh, anchor):
        _, A, Ha, D = anchor.shape
        rep = Ha // k_cache.shape[0]
        for d in range(cuda.threadIdx.x, D, cuda.blockDim.x):
            if kind == _MEAN or kind == _FIXED:
                acc = float32(0.0)
                ns = 0
                for t in range(nv):
                    if kind == _MEAN or _sampled(t, A, B):
                        acc += kget(k_cache, kt, ktb, kvh, pb, t * D + d)
                        ns += 1
                v0 = acc / float32(max(ns, 1))
                v1 = v0
            elif kind == _MAX:
                mx = _NEG_INF
                for t in range(nv):
                    mx = max(mx, kget(k_cache, kt, ktb, kvh, pb, t * D + d))
                v0 = mx
                v1 = mx
            else:                                   # QUEST, CUBOID_MEAN: ordered two-slot boxes
                hi = _NEG_INF
                lo = -_NEG_INF
                for t in range(nv):
                    x = kget(k_cache, kt, ktb, kvh, pb, t * D + d)
                    hi = max(hi, x)
                    lo = min(lo, x)
                if kind == _QUEST:
                    v0 = _f16_up(hi)
                    v1 = _f16_down(lo)
                else:
                    c = (hi + lo) * float32(0.5)
                    r = float32(0.0)
                    for t in range(nv):
                        r += abs(kget(k_cache, kt, ktb, kvh, pb, t * D + d) - c)
                    r = r / float32(max(nv, 1))
                    v0 = _f16_up(c + r)
                    v1 = _f16_down(c - r)
            for a in range(A):
                v = v1 if a == 1 else v0
                for g in range(rep):
                    anchor[pb, a, kvh * rep + g, d] = v

    return body


def anchor_code(anchor_type: AnchorType) -> int:
    """The kind code the anchor body takes for a key-only anchor type (not DYNAMIC)."""
    return _KIND[AnchorType(anchor_type)]


@functools.cache
def _anchor_kernels(kfmt: str):
    """(_anchor_kernel, _dynamic_kernel) reading K stored in format kfmt
    (:mod:`pyimp.cuda.kvblocks`)."""
    kget = kvblocks.readers(kfmt)[0]
    body = _anchor_body(kfmt)

    @cuda.jit
    def _anchor_kernel(kind, k_cache, kt, ktb, B, blocks, n_valid, anchor):
        i = cuda.blockIdx.x
        body(kind, k_cache, kt, ktb, B, blocks[i], n_valid[i], cuda.blockIdx.y, anchor)

    @cuda.jit
    def _dynamic_kernel(k_cache, kt, ktb, blocks, n_valid, importance, anchor):
        _, A, Hq, D = anchor.shape
        Hkv = k_cache.shape[0]
        B = importance.shape[1]
        G = Hq // Hkv
        i = cuda.blockIdx.x
        h = cuda.blockIdx.y
        kvh = h // G
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        pb = blocks[i]
        nv = n_valid[i]
        imp = cuda.shared.array(MAX_BLOCK_LEN, float32)
        take = cuda.shared.array(MAX_BLOCK_LEN, int32)
        for t in range(tid, nv, nt):
            imp[t] = float32(importance[pb, t, h])
        cuda.syncthreads()
        # rank of token t in the CPU's stable sort of -importance over the whole block (invalid
        # tokens sort as -inf importance, after every valid non-NaN one; NaN sorts last)
        for t in range(tid, nv, nt):
            x = imp[t]
            xnan = math.isnan(x)
            r = 0
            if xnan:
                r = B - nv
            for u in range(nv):
                if r >= A:
                    break
                y = imp[u]
                ynan = math.isnan(y)
                if xnan:
                    ahead = (not ynan) or u < t
                elif ynan:
                    ahead = False
                else:
                    ahead = y > x or (y == x and u < t)
                if ahead:
                    r += 1
            take[t] = 1 if r < A else 0
        cuda.syncthreads()
        for d in range(tid, D, nt):
            acc = float32(0.0)
            for t in range(nv):
                if take[t] != 0:
                    acc += kget(k_cache, kt, ktb, kvh, pb, t * D + d)
            for a in range(A):
                anchor[pb, a, h, d] = acc

    return _anchor_kernel, _dynamic_kernel


# --------------------------------------------------------------------------
# scores
# --------------------------------------------------------------------------


@cuda.jit(device=True)
def _score_rows(q, anchor, bt, lb_start, n_slots, gdiv, astep, out, s):
    """This thread block's candidates' set scores into out (see ``_set_scores_kernel``); s:
    shared float32 scratch of MAX_THREADS."""
    C, nsets = out.shape
    Hq, D = q.shape
    hps = Hq // nsets
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    cpb = max(1, nt // Hq)                      # candidates per thread block
    i0 = cuda.blockIdx.x * cpb
    for e in range(tid, cpb * Hq, nt):
        i = i0 + e // Hq
        if i < C:
            h = e % Hq
            pb = bt[lb_start + i]
            ah = (h // gdiv) * astep
            acc = float32(0.0)
            for d in range(D):
                qv = q[h, d]
                mx = float32(anchor[pb, 0, ah, d]) * qv
                for sl in range(1, n_slots):
                    y = float32(anchor[pb, sl, ah, d]) * qv
                    mx = mx if mx > y else y
                acc += mx
            s[e] = acc
    cuda.syncthreads()
    for e in range(tid, cpb * nsets, nt):
        i = i0 + e // nsets
        if i < C:
            si = e % nsets
            base = (e // nsets) * Hq + si * hps
            acc = float32(0.0)
            for j in range(hps):
                acc += s[base + j]
            out[i, si] = acc


@cuda.jit
def _set_scores_kernel(q, anchor, bt, lb_start, n_slots, gdiv, astep, out):
    s = cuda.shared.array(MAX_THREADS, float32)  # per-head scores of the block's candidates
    _score_rows(q, anchor, bt, lb_start, n_slots, gdiv, astep, out, s)


# --------------------------------------------------------------------------
# selection
# --------------------------------------------------------------------------


@cuda.jit(device=True)
def _key(b):
    """Order-preserving unsigned key (as int64) of a float32 with bit pattern b (int32):
    larger float, larger key; NaN ranks as -inf; -0 and +0 are one key."""
    u = int64(b) & 0xFFFFFFFF
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:
        return int64(0x007FFFFF)                # the key of -inf
    if a == 0:
        return int64(0x80000000)
    if u >= 0x80000000:
        return int64(0xFFFFFFFF) - u
    return u + int64(0x80000000)


if device.SIMULATOR:
    @cuda.jit(device=True)
    def _scan(v, buf):
        """Inclusive block-wide prefix sum of v (int) and the block total; buf: shared int32
        with one slot per thread (Hillis-Steele over buf: the simulator has no shuffles)."""
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        buf[tid] = v
        cuda.syncthreads()
        off = 1
        while off < nt:
            x = 0
            if tid >= off:
                x = buf[tid - off]
            cuda.syncthreads()
            buf[tid] += x
            cuda.syncthreads()
            off *= 2
        incl = buf[tid]
        tot = buf[nt - 1]
        cuda.syncthreads()
        return incl, tot
else:
    @cuda.jit(device=True)
    def _warp_scan(x, lane):
        """Inclusive prefix sum of the int32 x over the lanes of a full warp."""
        off = 1
        while off < device.WARP:
            y = cuda.shfl_up_sync(device.FULL_MASK, x, off)
            if lane >= off:
                x = int32(x + y)
            off *= 2
        return x

    @cuda.jit(device=True)
    def _scan(v, buf):
        """Inclusive block-wide prefix sum of v (int) and the block total; buf: shared int32
        of >= 64 slots; blockDim a multiple of 32. Warps scan with shuffles, then warp 0 scans
        the warp totals."""
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        lane = tid % device.WARP
        w = tid // device.WARP
        nw = nt // device.WARP
        x = _warp_scan(int32(v), lane)
        if lane == device.WARP - 1:
            buf[w] = x
        cuda.syncthreads()
        if w == 0:
            t = int32(0)
            if lane < nw:
                t = buf[lane]
            buf[device.WARP + lane] = _warp_scan(t, lane)
        cuda.syncthreads()
        incl = x
        if w > 0:
            incl = int32(x + buf[device.WARP + w - 1])
        tot = buf[device.WARP + nw - 1]
        cuda.syncthreads()
        return incl, tot


@cuda.jit(device=True)
def _select_set(sbits, si, init, pick, loc, F, n_lb, dense, sel, cnt, hist, buf, bc):
    """Set si's selection (see ``_select_kernel``) by the whole thread block; hist, buf, bc:
    shared int32 scratch of 256, MAX_THREADS and 2 slots."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    K = sel.shape[1]
    if dense:
        for j in range(tid, K, nt):
            sel[si, j] = j if j < n_lb else -1
        if tid == 0:
            cnt[si] = n_lb
        return
    total = init + pick + loc + (n_lb - F)
    for j in range(tid, K, nt):
        if j < init:
            sel[si, j] = j
        elif j >= init + pick:
            sel[si, j] = F - loc + (j - init - pick) if j < total else -1
    if tid == 0:
        cnt[si] = total
    if pick == 0:
        return

    C = sbits.shape[0]
    # radix select: kstar = the pick-th largest key, krem = how many keys == kstar are taken
    prefix = int64(0)
    krem = int64(pick)
    shift = 24
    while shift >= 0:
        for j in range(tid, 256, nt):
            hist[j] = 0
        cuda.syncthreads()
        for c in range(tid, C, nt):
            key = _key(sbits[c, si])
            if (key >> (shift + 8)) == (prefix >> (shift + 8)):
                cuda.atomic.add(hist, (key >> shift) & 255, int32(1))
        cuda.syncthreads()
        if tid == 0:
            acc = int64(0)
            dg = 255
            while dg > 0 and acc + hist[dg] < krem:
                acc += hist[dg]
                dg -= 1
            bc[0] = dg
            bc[1] = krem - acc
        cuda.syncthreads()
        prefix |= int64(bc[0]) << shift
        krem = int64(bc[1])
        cuda.syncthreads()
        shift -= 8
    kstar = prefix

    # compaction in ascending block order: one prefix sum of (ties << 16 | greater) per chunk
    taken = int64(0)
    ties = int64(0)
    c0 = 0
    while c0 < C:
        c = c0 + tid
        v = 0
        if c < C:
            key = _key(sbits[c, si])
            if key > kstar:
                v = 1
            elif key == kstar:
                v = 1 << 16
        incl, tot = _scan(v, buf)
        excl = incl - v
        rem = max(krem - ties, int64(0))
        gt_x = excl & 0xFFFF
        eq_x = excl >> 16
        if v == 1 or (v == 1 << 16 and eq_x < rem):
            sel[si, init + taken + gt_x + min(eq_x, rem)] = init + c
        taken += (tot & 0xFFFF) + min(tot >> 16, rem)
        ties += tot >> 16
        c0 += nt


@cuda.jit
def _select_kernel(sbits, init, pick, loc, F, n_lb, dense, sel, cnt):
    hist = cuda.shared.array(256, int32)
    buf = cuda.shared.array(MAX_THREADS, int32)
    bc = cuda.shared.array(2, int32)
    _select_set(sbits, cuda.blockIdx.x, init, pick, loc, F, n_lb, dense, sel, cnt, hist, buf, bc)


@cuda.jit
def _retrieve_kernel(q, anchor, bt, lb_start, n_slots, gdiv, astep, scores, sbits, counter,
                     init, pick, loc, F, n_lb, sel, cnt):
    """Scoring and selection in one launch: the thread blocks score their candidates as
    ``_set_scores_kernel`` does; the last one to finish (an atomic ticket on counter[0], the
    scores made visible first) selects every set in turn as ``_select_kernel`` does, and
    resets the counter for the next launch."""
    s = cuda.shared.array(MAX_THREADS, float32)
    hist = cuda.shared.array(256, int32)
    buf = cuda.shared.array(MAX_THREADS, int32)
    bc = cuda.shared.array(2, int32)
    ticket = cuda.shared.array(1, int32)
    _score_rows(q, anchor, bt, lb_start, n_slots, gdiv, astep, scores, s)
    cuda.threadfence()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        ticket[0] = cuda.atomic.add(counter, 0, 1)
    cuda.syncthreads()
    if ticket[0] != cuda.gridDim.x - 1:
        return
    cuda.threadfence()
    for si in range(sel.shape[0]):
        _select_set(sbits, si, init, pick, loc, F, n_lb, False, sel, cnt, hist, buf, bc)
        cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        counter[0] = 0                          # ready for the next launch


# --------------------------------------------------------------------------
# importance decay
# --------------------------------------------------------------------------


@cuda.jit
def _decay_kernel(importance, bt, n_ctx, decay):
    _, B, Hq = importance.shape
    idx = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if idx < n_ctx * Hq:
        p = idx // Hq
        h = idx % Hq
        pb = bt[p // B]
        t = p % B
        x = decay * float32(importance[pb, t, h])
        if x > FP16_MAX:
            x = FP16_MAX
        importance[pb, t, h] = x


# --------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------


def _desc(a) -> str:
    dt, shp = getattr(a, "dtype", None), getattr(a, "shape", None)
    if dt is None or shp is None:
        return type(a).__name__
    return f"{np.dtype(dt)} array of shape {tuple(shp)}"


def _arr(name: str, a, dtypes, ndim: int, layout: str) -> tuple:
    """Shape of a device (or host) array of one of ``dtypes`` with ``ndim`` dims, else ValueError."""
    dts = tuple(np.dtype(d) for d in dtypes)
    dt, shp = getattr(a, "dtype", None), getattr(a, "shape", None)
    if dt is None or shp is None or np.dtype(dt) not in dts or len(tuple(shp)) != ndim:
        want = " or ".join(str(d) for d in dts)
        raise ValueError(f"{name} must be a {want} array {layout}, got {_desc(a)}")
    return tuple(int(s) for s in shp)


def _ids(name: str, a, n: int | None = None):
    """int32 1-D operand on the device: host arrays are converted and copied."""
    if isinstance(a, np.ndarray) or not hasattr(a, "dtype"):
        a = np.asarray(a)
        if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
            raise ValueError(f"{name} must be a 1-D integer array, got {_desc(a)}")
        if n is not None and a.shape[0] != n:
            raise ValueError(f"{name} must hold {n} entries, got {a.shape[0]}")
        return a.astype(np.int32), device.to_device(a.astype(np.int32))
    shp = _arr(name, a, (np.int32,), 1, "[n]")
    if n is not None and shp[0] != n:
        raise ValueError(f"{name} must hold {n} entries, got {shp[0]}")
    return None, a


_PLACEHOLDER: dict = {}


def _placeholder():
    """The [1, 1] float32 tail a float K layer passes (one per mode: device, or host arrays
    under compile_only)."""
    key = device.compiling()
    if key not in _PLACEHOLDER:
        _PLACEHOLDER[key] = device.zeros((1, 1), np.float32)
    return _PLACEHOLDER[key]


def compute_anchors(anchor_type: AnchorType, k_cache, blocks, n_valid, anchor,
                    importance=None) -> None:
    """(Re)compute the anchors of the given physical blocks, in place (twin of
    :func:`pyimp.sparse.anchors.compute_anchors`).

    k_cache: float16/float32 ``[Hkv][NB][B*D]``, or a quantized K layer
    (:class:`pyimp.cuda.kvblocks.DeviceQuantizedKV`: anchors of the dequantized keys, the tail
    block's from the float tail, as the CPU computes them); blocks: int32 ``[n]`` distinct
    physical ids; n_valid: int32 ``[n]`` valid tokens per block (0..B); anchor: float16
    ``[NB][A][Ha][D]``;
    importance: float16 ``[NB][B][Hq]`` (DYNAMIC only). Bad shapes raise ValueError naming the
    argument (block ids and counts are range-checked when they come as host arrays).
    """
    anchor_type = AnchorType(anchor_type)
    if isinstance(k_cache, kvblocks.DeviceQuantizedKV):
        if k_cache.side != "k":
            raise ValueError("k_cache must be a K layer, got a quantized V layer")
        Hkv, NB, BD = k_cache.shape
    else:
        Hkv, NB, BD = _arr("k_cache", k_cache, (np.float16, np.float32), 3, "[Hkv][NB][B*D]")
    NBa, A, Ha, D = _arr("anchor", anchor, (np.float16,), 4, "[NB][A][Ha][D]")
    if NBa != NB or D == 0 or BD % D:
        raise ValueError(f"anchor of shape {(NBa, A, Ha, D)} does not fit k_cache of shape "
                         f"{(Hkv, NB, BD)} ([NB][A][Ha][D] with NB = {NB}, D dividing {BD})")
    B = BD // D
    hb, blocks = _ids("blocks", blocks)
    n = int(blocks.shape[0])
    hv, n_valid = _ids("n_valid", n_valid, n)
    if hb is not None and n and (hb.min() < 0 or hb.max() >= NB or np.unique(hb).size != n):
        raise ValueError(f"blocks must hold distinct physical block ids in 0..{NB - 1}, got "
                         f"{hb.tolist()}")
    if hv is not None and n and (hv.min() < 0 or hv.max() > B):
        raise ValueError(f"n_valid must hold counts in 0..{B} (the block length), got "
                         f"{hv.tolist()}")
    if anchor_type in (AnchorType.QUEST, AnchorType.CUBOID_MEAN) and A < 2:
        raise ValueError(f"{anchor_type.name} anchors need anchor_num >= 2, got {A}")
    anchor_kernel, dynamic_kernel = _anchor_kernels(kvblocks.fmt_of(k_cache))
    kop = kvblocks.operand(k_cache, _placeholder())
    if anchor_type is AnchorType.DYNAMIC:
        if importance is None:
            raise ValueError("DYNAMIC anchors need the importance matrix")
        NBi, Bi, Hq = _arr("importance", importance, (np.float16,), 3, "[NB][B][Hq]")
        if (NBi, Bi) != (NB, B):
            raise ValueError(f"importance of shape {(NBi, Bi, Hq)} does not fit k_cache "
                             f"([NB][B][Hq] with NB = {NB}, B = {B})")
        if Ha != Hq or Hq % Hkv:
            raise ValueError(f"anchor has {Ha} heads: DYNAMIC anchors are stored per query head "
                             f"({Hq}, a multiple of the {Hkv} kv heads)")
        if B > MAX_BLOCK_LEN:
            raise ValueError(f"k_cache has block length {B}: DYNAMIC anchors support up to "
                             f"{MAX_BLOCK_LEN}")
        if n:
            device.launch(dynamic_kernel, (n, Hq), anchor_threads(max(D, B)), *kop, blocks,
                          n_valid, importance, anchor)
        return
    if Ha % Hkv:
        raise ValueError(f"anchor has {Ha} heads: {anchor_type.name} anchors are stored per kv "
                         f"head ({Hkv}) or per query head (a multiple of {Hkv})")
    if n:
        device.launch(anchor_kernel, (n, Hkv), anchor_threads(D), np.int32(_KIND[anchor_type]),
                      *kop, np.int32(B), blocks, n_valid, anchor)


def _check_q_anchor(q, anchor, G: int, shared: bool) -> tuple:
    """(Hq, D, NB, A, gdiv, astep) of a scoring call (see _set_scores_kernel)."""
    NB, A, Ha, D = _arr("anchor", anchor, (np.float16,), 4, "[NB][A][Ha][D]")
    Hq, Dq = _arr("q", q, (np.float32,), 2, "[Hq, D]")
    if Dq != D:
        raise ValueError(f"q has head dim {Dq}, the anchors {D}")
    Hkv = check_anchor_heads(Ha, Hq, G, shared)
    if shared:
        return Hq, D, NB, A, G, Ha // Hkv
    return Hq, D, NB, A, 1, 1


def _check_table(block_table, n_lb: int, NB: int):
    hb, bt = _ids("block_table", block_table)
    if int(bt.shape[0]) < n_lb:
        raise ValueError(f"block_table has {bt.shape[0]} entries but {n_lb} logical blocks are "
                         f"used")
    if hb is not None and n_lb and (hb[:n_lb].min() < 0 or hb[:n_lb].max() >= NB):
        raise ValueError(f"block_table[:{n_lb}] holds ids outside 0..{NB - 1}")
    return bt


def set_scores(q, anchor, block_table, lb_start: int, lb_end: int, nsets: int, n_slots: int,
               G: int, shared: bool = True, out=None):
    """float32 ``[lb_end - lb_start, nsets]`` device set scores (twin of
    :func:`pyimp.sparse.retrieval.set_scores`; nsets = Hq gives the per-head scores of
    ``block_scores``). out: an optional float32 device array of that shape to write."""
    Hq, _, NB, A, gdiv, astep = _check_q_anchor(q, anchor, G, shared)
    if nsets < 1 or Hq % nsets:
        raise ValueError(f"nsets = {nsets} does not divide the {Hq} query heads")
    if not 1 <= int(n_slots) <= A:
        raise ValueError(f"n_slots must be in [1, {A}], got {n_slots}")
    lb_start, lb_end = int(lb_start), int(lb_end)
    if not 0 <= lb_start <= lb_end:
        raise ValueError(f"block range [{lb_start}, {lb_end}) is not a range of logical blocks")
    bt = _check_table(block_table, lb_end, NB)
    C = lb_end - lb_start
    if out is None:
        out = device.empty((C, nsets), np.float32)
    elif _arr("out", out, (np.float32,), 2, "[C, nsets]") != (C, nsets):
        raise ValueError(f"out must have shape {(C, nsets)}, got {tuple(out.shape)}")
    if Hq > MAX_THREADS:
        raise ValueError(f"q has {Hq} query heads: scoring supports up to {MAX_THREADS}")
    if C:
        cpb = max(1, THREADS // Hq)
        device.launch(_set_scores_kernel, device.blocks_for(C, cpb), THREADS, q, anchor, bt,
                      np.int32(lb_start), np.int32(n_slots), np.int32(gdiv), np.int32(astep), out)
    return out


def _outputs(nsets: int, K: int, sel, cnt):
    if sel is None:
        sel = device.empty((nsets, K), np.int32)
    elif _arr("sel", sel, (np.int32,), 2, "[nsets, K]") != (nsets, K):
        raise ValueError(f"sel must have shape {(nsets, K)}, got {tuple(sel.shape)}")
    if cnt is None:
        cnt = device.empty((nsets,), np.int32)
    elif _arr("cnt", cnt, (np.int32,), 1, "[nsets]") != (nsets,):
        raise ValueError(f"cnt must have shape {(nsets,)}, got {tuple(cnt.shape)}")
    return sel, cnt


def _launch_select(scores, n_ctx, B, init, pick, local, nsets, sel, cnt):
    F = n_ctx // B
    n_lb = -(-n_ctx // B)
    sel, cnt = _outputs(nsets, init + pick + local + 1, sel, cnt)
    dense = F <= init + pick + local
    if scores is None:                      # dense: the scores are not read
        scores = device.empty((1, nsets), np.float32)
    device.launch(_select_kernel, nsets, SELECT_THREADS, scores.view(np.int32), np.int32(init),
                  np.int32(pick), np.int32(recent_blocks(n_ctx, B, local)), np.int32(F),
                  np.int32(n_lb), np.bool_(dense), sel, cnt)
    return sel, cnt


def select_blocks(scores, n_ctx: int, block_len: int, init: int, pick: int, local: int,
                  sel=None, cnt=None):
    """Pick blocks per set from device set scores (twin of
    :func:`pyimp.sparse.retrieval.select_blocks`): scores float32 ``[C, nsets]`` for the
    candidate blocks (read only when the selection is not dense). Returns device ``(sel int32
    [nsets, K], cnt int32 [nsets])``, K = init + pick + local + 1; sel / cnt may be given."""
    check_budget(n_ctx, block_len, init, pick, local)
    n_ctx, B, init, pick, local = (int(v) for v in (n_ctx, block_len, init, pick, local))
    C, nsets = _arr("scores", scores, (np.float32,), 2, "[C, nsets]")
    if nsets < 1:
        raise ValueError("scores must have at least one set (column)")
    F = n_ctx // B
    if F > init + pick + local and C != n_candidates(n_ctx, B, init, local):
        raise ValueError(f"scores has {C} rows, expected one per candidate block "
                         f"({n_candidates(n_ctx, B, init, local)}: blocks {init}.."
                         f"{F - recent_blocks(n_ctx, B, local) - 1})")
    if not C:
        scores = None
    return _launch_select(scores, n_ctx, B, init, pick, local, nsets, sel, cnt)


def retrieve_blocks(q, anchor, block_table, n_ctx: int, block_len: int, n_kv_heads: int,
                    retrieval_type: RetrievalType = RetrievalType.LAYER, init_block_num: int = 1,
                    pick_block_num: int = 8, local_block_num: int = 2,
                    anchor_type: AnchorType = AnchorType.QUEST, sel=None, cnt=None,
                    scores=None, counter=None):
    """Score the candidate blocks and select, on the device in one launch with no host round
    trip (twin of :func:`pyimp.sparse.retrieval.retrieve_blocks`). Returns device ``(sel,
    cnt)``; ``sel``, ``cnt``, the float32 ``[C, nsets]`` scratch ``scores`` and the int32
    ``[1]`` zeroed ``counter`` (the launch leaves it zero) may be given to reuse buffers."""
    init, pick, local = int(init_block_num), int(pick_block_num), int(local_block_num)
    check_budget(n_ctx, block_len, init, pick, local)
    n_ctx, B = int(n_ctx), int(block_len)
    retrieval_type = RetrievalType(retrieval_type)
    anchor_type = AnchorType(anchor_type)
    Hq, _ = _arr("q", q, (np.float32,), 2, "[Hq, D]")
    if n_kv_heads < 1 or Hq % n_kv_heads:
        raise ValueError(f"n_kv_heads = {n_kv_heads} does not divide the {Hq} query heads")
    G = Hq // n_kv_heads
    nsets = n_sets(retrieval_type, Hq, n_kv_heads)
    shared = group_shared(anchor_type)
    _, _, NB, A, _, _ = _check_q_anchor(q, anchor, G, shared)
    n_lb = -(-n_ctx // B)
    bt = _check_table(block_table, n_lb, NB)
    F = n_ctx // B
    if F <= init + pick + local:
        return _launch_select(None, n_ctx, B, init, pick, local, nsets, sel, cnt)
    lb_end = F - recent_blocks(n_ctx, B, local)
    C = lb_end - init
    if scores is None:
        scores = device.empty((C, nsets), np.float32)
    elif _arr("scores", scores, (np.float32,), 2, "[C, nsets]") != (C, nsets):
        raise ValueError(f"scores must have shape {(C, nsets)}, got {tuple(scores.shape)}")
    if counter is None:
        counter = device.zeros((1,), np.int32)
    elif _arr("counter", counter, (np.int32,), 1, "[1]") != (1,):
        raise ValueError(f"counter must have shape (1,), got {tuple(counter.shape)}")
    if Hq > MAX_THREADS:
        raise ValueError(f"q has {Hq} query heads: scoring supports up to {MAX_THREADS}")
    sel, cnt = _outputs(nsets, init + pick + local + 1, sel, cnt)
    _, _, _, _, gdiv, astep = _check_q_anchor(q, anchor, G, shared)
    device.launch(_retrieve_kernel, device.blocks_for(C, max(1, THREADS // Hq)), THREADS, q,
                  anchor, bt, np.int32(init), np.int32(anchor_slots(anchor_type, A)),
                  np.int32(gdiv), np.int32(astep), scores, scores.view(np.int32), counter,
                  np.int32(init), np.int32(pick), np.int32(recent_blocks(n_ctx, B, local)),
                  np.int32(F), np.int32(n_lb), sel, cnt)
    return sel, cnt


def decay_importance(importance, block_table, n_ctx: int, decay) -> None:
    """Scale every valid entry by ``decay`` (``new = decay*old``), in place (twin of
    :func:`pyimp.attention.importance.decay_importance`): importance float16 ``[NB][B][Hq]``,
    block_table int32, the first ``n_ctx`` tokens. decay == 1 touches nothing."""
    NB, B, Hq = _arr("importance", importance, (np.float16,), 3, "[NB][B][Hq]")
    if not 0.0 < float(decay) <= 1.0:
        raise ValueError(f"decay must be in (0, 1], got {decay}")
    n_ctx = int(n_ctx)
    if n_ctx < 0:
        raise ValueError(f"n_ctx must be >= 0, got {n_ctx}")
    bt = _check_table(block_table, -(-n_ctx // B), NB)
    if float(decay) == 1.0 or n_ctx == 0:
        return
    device.launch(_decay_kernel, device.blocks_for(n_ctx * Hq, THREADS), THREADS, importance, bt,
                  np.int32(n_ctx), np.float32(decay))
