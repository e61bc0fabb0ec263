"""A lossless predictive codec for float16 arrays of tokens x channels (KV-cache planes).

:mod:`pyimp.kv.statefile` uses it as codec ``pred-f16`` for float16 sections. An array is
read as ``H`` independent planes ``[T][D]``: the last axis holds channels, the one before
it tokens (rows), the others are flattened into planes (a 1-d array is one plane of one
channel). Each value is coded, row by row, from a prediction made of values already
coded:

* **Frame.** Channels are coded in *groups*: single channels or, with a rotary frame
  (:class:`Rotary`: a position per row, channel ``pairs`` and their frequencies
  ``theta``, as rotary position embedding gives a transformer's keys), the two channels
  of a pair, whose values are rotated back by ``position * theta`` before they serve as
  features. Keys after RoPE have per-channel means that turn with position; rotated back
  they are fixed, and channels are far more correlated (Gemma 3 270M's keys: a Gaussian
  coding gain of decorrelation of 0.8-0.9 bits a value in that frame, 0.2-0.3 without).
* **Predictor.** Per channel, a bias and up to ``MAX_TAPS`` linear taps on the previous
  row's (rotated-back) values and on the current row's earlier groups, chosen by the
  encoder (greedy matching pursuit on the plane's covariance; a tap is kept while its
  estimated coding gain exceeds what it costs in the payload) and stored. A pair's two
  members are predicted in the rotated-back frame and rotated forward; the second
  member's prediction then adds the first member's error times their residual
  regression coefficient at that angle.
* **Repeated rows.** A row that repeats an earlier one (up to ``MAX_BACK`` rows back) in
  the rotated-back frame, up to rounding, is predicted by that row instead, with scales
  of its own. A first layer's values are a function of the token and its keys that
  function rotated by the position, so every recurring token gives such a row (311 of
  the 512 rows of Gemma's first layer after 4k tokens of prose: its keys shrink 2.6x
  instead of 1.24x).
* **Coding.** Given the prediction ``p`` and the residual scale ``s`` (per channel, or per
  row for a pair's rotated members), a value's sign and exponent are one symbol (does
  the sign agree with ``p``'s; the exponent relative to that of max(|p|, s)) in a context
  of ``|p| / s`` (22 half-octave buckets from 1/4 to 256). Its 10 mantissa bits are stored
  as they are when ``s`` spans at least 2^10 spacings of the value's binade (uniform
  there: measured 9.97 bits and more); otherwise they become a rank of distance from
  ``p`` inside the binade, whose bit length and first bit are a symbol in a context of
  ``s`` in spacings (11 buckets) and of whether ``p`` lies in the binade, the rest stored
  as they are. Symbols go through two interleaved static rANS coders (32-bit states,
  16-bit words, 14-bit probabilities; the frequency tables are in the payload), stored
  bits through their own bit stream.

Every prediction is float64 arithmetic of correctly rounded IEEE-754 operations (+, -,
*, /, sqrt) and exact ones (floor, frexp): the sines and cosines of the rotary frame are
polynomials evaluated here, not libm calls. The encoder and the decoder run the same
expressions in the same order, and Numba compiles without fast-math (nothing is
reassociated or fused into FMAs), so both see bit-identical predictions on any IEEE-754
machine. Infinities and NaNs (any payload) are coded like every other bit pattern; as
features they count as +-131008.

Payload layout (little-endian)::

    u8  version (1)
    u8  flags          bit 0: rotary frame; bit 1: repeated rows
    u32 model_len      bytes of the zstd frame that follows
    u32 bits_len       bytes of the stored-bit stream (a multiple of 4)
    model              one zstd frame: dims, rotary frame, taps, coefficients, scales,
                       repeated rows, frequency tables (see _pack_model)
    bits               stored bits, u32 words, least significant bit first
    rans               u16 words: the two final rANS states (low word first), then the
                       renormalization words in decoding order

The decoder checks every field (sizes, the model frame's declared size, tap indices and
their causality, repeated rows, table sums, finite parameters) before it runs, and
afterwards that both rANS states are back at their initial value with every word and
stored bit consumed.

Measured on the f16 KV cache of Gemma 3 270M after a 4032-token prefill of Python's
pydoc topics (``tools/bench_statefile.py``; 18 layers, 15 of them holding only their
512-slot window, 20.25 MB of KV): keys 1.23-1.32x per layer (the first layer 2.61x),
values 1.15-1.20x (the first 3.06x); all the KV 1.259x, against 1.16x for byte-plane
zstd (keys 1.314x against 1.136x, values 1.209x against 1.188x). On one core of an AMD
EPYC VM it encodes at 11-15 MB/s (the fit included) and decodes at 26-39 MB/s, against
1-2 GB/s for zstd. Its kernels compile on first use (about 15 s, once: Numba's on-disk
cache keeps them). Without the first layer the KV shrinks 1.241x, so how far past 1.25x
a state gets depends on how often its tokens recur.
"""
from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import NoReturn

import numpy as np
import zstandard

from loaders import jit

jit.kernel_module(__file__)

__all__ = ["Rotary", "applies", "decode", "encode"]

VERSION = 1
MAX_TAPS = 16
MAX_CHANNELS = 1024          # wider planes are not for this codec (the fit is O(D^2))
PROB_BITS = 14
PROB_SCALE = 1 << PROB_BITS
RANS_L = 1 << 16
NZ = 22                      # contexts of the sign/exponent symbol
N1 = 96                      # sign/exponent symbols: agree * 48 + relative exponent
EOFF = 24                    # relative exponent offset; 0 and 47 are escapes
SB_RAW = 11                  # s >= 2^(SB_RAW-1) spacings: mantissa stored as it is
NS2 = 2 * SB_RAW             # contexts of the mantissa-rank symbol
N2 = 20                      # mantissa-rank symbols
FEATURE_CLAMP = 131008.0     # what a non-finite float16 stands for as a feature
PRED_CLAMP = 131072.0
SIG_MIN = 2.0 ** -30
SIG_MAX = 65504.0
TAP_BITS = 32.0              # about what a tap costs in the compressed model
BIAS_STEP = 1.0 / 64         # biases are stored as integers times scale / 64
MAX_BACK = 4096              # how far back a repeated row may look
REPEAT_MIN_CHANNELS = 8      # narrower rows are never repeats
_FIXED = struct.Struct("<BBII")
_DIMS = struct.Struct("<IIIIQ")
_TWO_PI = 6.283185307179586
_INV_TWO_PI = 0.15915494309189535


def _f16_table() -> np.ndarray:
    t = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float64)
    bad = ~np.isfinite(t)
    t[bad] = np.where(np.arange(65536)[bad] & 0x8000, -FEATURE_CLAMP, FEATURE_CLAMP)
    return t


F16 = _f16_table()                                             # bit pattern -> float64


# ------------------------------------------------------------------ deterministic sin/cos
@jit.njit
def _sincos(a):
    """(sin a, cos a) from IEEE operations only: reduction by 2 pi and by quadrant, then
    Taylor polynomials on [-pi/4, pi/4] (error < 1e-15 there; reducing a huge argument
    loses accuracy, which only weakens a prediction)."""
    k = math.floor(a * _INV_TWO_PI + 0.5)
    r = a - k * _TWO_PI
    q = math.floor(r * (4.0 * _INV_TWO_PI) + 0.5)
    y = r - q * (0.25 * _TWO_PI)
    y2 = y * y
    s = y * (1.0 + y2 * (-1.0 / 6 + y2 * (1.0 / 120 + y2 * (-1.0 / 5040 + y2 * (
        1.0 / 362880 + y2 * (-1.0 / 39916800 + y2 * (1.0 / 6227020800)))))))
    c = 1.0 + y2 * (-0.5 + y2 * (1.0 / 24 + y2 * (-1.0 / 720 + y2 * (1.0 / 40320 + y2 * (
        -1.0 / 3628800 + y2 * (1.0 / 479001600 + y2 * (-1.0 / 87178291200)))))))
    qi = int(q) & 3
    if qi == 0:
        return s, c
    if qi == 1:
        return c, -s
    if qi == 2:
        return -s, -c
    return -c, s


@jit.njit
def _rotations(positions, theta):
    """cos, sin float64[T, P] of position * theta."""
    T, P = positions.shape[0], theta.shape[0]
    cs = np.empty((T, P))
    sn = np.empty((T, P))
    for t in range(T):
        p = float(positions[t])
        for i in range(P):
            s, c = _sincos(p * theta[i])
            cs[t, i] = c
            sn[t, i] = s
    return cs, sn


# ------------------------------------------------------------------------ small helpers
@jit.njit(inline="always")
def _zbucket(rbits):
    """Context 0..NZ-1 of r = |prediction| / scale from the quotient's float64 bits: its
    half-octave 2 floor(log2 r) + (first mantissa bit), offset and clamped (bucket edges
    0.25, 0.375, 0.5, 0.75, 1, 1.5, ... 12, 16 for NZ = 14)."""
    h = 2 * (((rbits >> 52) & 0x7FF) - 1023) + ((rbits >> 51) & 1) + 5
    return 0 if h < 0 else (NZ - 1 if h > NZ - 1 else h)


@jit.njit(inline="always")
def _floor_log2(s):
    """floor(log2 s) of a positive finite float64, exactly."""
    return math.frexp(s)[1] - 1


@jit.njit(inline="always")
def _clampp(p):
    if p != p:
        return 0.0
    if p > PRED_CLAMP:
        return PRED_CLAMP
    if p < -PRED_CLAMP:
        return -PRED_CLAMP
    return p


@jit.njit(inline="always")
def _clamps(s):
    if not s > SIG_MIN:          # NaN too
        return SIG_MIN
    if s > SIG_MAX:
        return SIG_MAX
    return s


@jit.njit
def _pair_token(cr, sr, siga, sigb, rho, psa, pkap, psb, psa_bits, psb_bits, plsa, plsb):
    """For one token, per rotary pair (cos cr, sin sr; sig/rho of its rotated-back
    residuals): the scales of its two members after rotation (psa, psb), the regression
    of the second member's error on the first's (pkap), and floor(log2) of the scales
    (from their bits; psa_bits / psb_bits are int64 views of psa / psb). Vectorizable;
    the same function serves the encoder and the decoder."""
    for i in range(cr.shape[0]):
        c = cr[i]
        s = sr[i]
        sa = siga[i]
        sb = sigb[i]
        va = sa * sa
        vb = sb * sb
        cv = rho[i] * sa * sb
        saa = c * c * va + s * s * vb - 2.0 * c * s * cv
        sbb = s * s * va + c * c * vb + 2.0 * c * s * cv
        sab = c * s * va - c * s * vb + (c * c - s * s) * cv
        saa = saa if saa > 1e-60 else 1e-60
        kap = sab / saa
        rb = sbb - sab * kap
        rb = rb if rb > 1e-60 else 1e-60
        ra = math.sqrt(saa)
        rb = math.sqrt(rb)
        psa[i] = ra if ra > SIG_MIN else SIG_MIN      # as _clamps (a NaN becomes SIG_MIN)
        psb[i] = rb if rb > SIG_MIN else SIG_MIN
        psa[i] = psa[i] if psa[i] < SIG_MAX else SIG_MAX
        psb[i] = psb[i] if psb[i] < SIG_MAX else SIG_MAX
        pkap[i] = kap
    for i in range(cr.shape[0]):
        plsa[i] = ((psa_bits[i] >> 52) & 0x7FF) - 1023
        plsb[i] = ((psb_bits[i] >> 52) & 0x7FF) - 1023


@jit.njit(inline="always")
def _binade(p, agree, e):
    """(lo, hi, centre, inside, ue) of the value's binade: magnitudes lo..hi in units of its
    spacing 2^ue, the one nearest the prediction, and whether the prediction lies inside."""
    if e > 0:
        lo, hi, ue = 1024, 2047, e - 25
    else:
        lo, hi, ue = 0, 1023, -24
    if agree == 0:
        return lo, hi, lo, 0, ue
    q = abs(p) * float(1 << (-ue)) if ue <= 0 else abs(p) / float(1 << ue)
    if q < lo:
        return lo, hi, lo, 0, ue
    if q > hi:
        return lo, hi, hi, 0, ue
    qi = int(math.floor(q + 0.5))
    if qi > hi:
        qi = hi
    return lo, hi, qi, 1, ue


@jit.njit(inline="always")
def _bitlen(r):
    """Bit length of 0 <= r < 2^52 (exact: frexp of a float that holds r exactly)."""
    return math.frexp(float(r))[1] if r > 0 else 0


@jit.njit(inline="always")
def _symbols(u, p, ls, el, ctx1):
    """(ctx1, sym1, ctx2, sym2 (255: none), stored bits, their count) of the float16 bit
    pattern u given prediction p, floor(log2) of its scale (ls) and of max(|p|, scale)
    (el), and the context ctx1."""
    sg = u >> 15
    e = (u >> 10) & 31
    agree = 1 if (sg == 0) == (p >= 0.0) else 0
    d = e - el - 15 + EOFF
    lit = 0
    nlit = 0
    if d <= 0 or d >= 47:
        d = 0 if d <= 0 else 47
        lit = e
        nlit = 5
    sym1 = agree * 48 + d
    lo, hi, qi, inside, ue = _binade(p, agree, e)
    sb = ls - ue + 1
    if e == 31 or sb >= SB_RAW:
        return ctx1, sym1, 0, 255, lit | ((u & 1023) << nlit), nlit + 10
    if sb < 0:
        sb = 0
    dd = (u & 1023) + lo - qi
    a = abs(dd)
    room = min(qi - lo, hi - qi)
    if a <= room:
        rank = 0 if a == 0 else (2 * a - 1 if dd > 0 else 2 * a)
    else:
        rank = 2 * room + (a - room)
    bl = _bitlen(rank)
    if bl < 2:
        sym2 = bl
    else:
        sym2 = 2 + (bl - 2) * 2 + ((rank >> (bl - 2)) & 1)
        lit |= (rank & ((1 << (bl - 2)) - 1)) << nlit
        nlit += bl - 2
    return ctx1, sym1, sb * 2 + inside, sym2, lit, nlit


@jit.njit(inline="always")
def _rank_value(rank, qi, lo, hi):
    """Inverse of the rank of _symbols: the magnitude (lo..hi, or -1 if out of range)."""
    room = min(qi - lo, hi - qi)
    if rank == 0:
        dd = 0
    elif rank <= 2 * room:
        a = (rank + 1) >> 1
        dd = a if rank & 1 else -a
    else:
        a = rank - room
        dd = a if hi - qi > qi - lo else -a
    mag = qi + dd
    return mag if lo <= mag <= hi else -1


# ------------------------------------------------------------------ encoder / decoder
# The two kernels walk the values in the same order and compute every prediction with the
# same expressions. Each plane's model is first laid out flat in coding order (_layout):
# the hot loops index one-dimensional arrays and call only scalar helpers (an array
# argument to a helper costs reference-count updates on every call).
@jit.njit
def _layout(h, groups, gsize, ntaps, feat, coef, bias, sig):
    """Plane h's model in coding order q = 0..D-1 (a pair's two members consecutive):
    channel, kind (0 alone, 1 first of a pair, 2 second), taps [t0[q], t0[q+1]) of flat
    feature ids / coefficients, bias (the stored integer times scale * BIAS_STEP), clamped
    scale and its floor(log2)."""
    D = sig.shape[1]
    qch = np.empty(D, np.int64)
    kind = np.empty(D, np.int64)
    t0 = np.zeros(D + 1, np.int64)
    qbias = np.empty(D)
    qs = np.empty(D)
    qls = np.empty(D, np.int64)
    q = 0
    for g in range(groups.shape[0]):
        for mi in range(gsize[g]):
            m = groups[g, mi]
            qch[q] = m
            kind[q] = 0 if gsize[g] == 1 else 1 + mi
            t0[q + 1] = t0[q] + ntaps[h, m]
            qs[q] = _clamps(sig[h, m])
            qls[q] = _floor_log2(qs[q])
            qbias[q] = float(bias[h, m]) * (qs[q] * BIAS_STEP)
            q += 1
    tf = np.empty(t0[D], np.int64)
    tc = np.empty(t0[D])
    for q in range(D):
        m = qch[q]
        for j in range(ntaps[h, m]):
            tf[t0[q] + j] = feat[h, m, j]
            tc[t0[q] + j] = coef[h, m, j]
    return qch, kind, t0, tf, tc, qbias, qs, qls


@jit.njit
def _pair_scales(h, groups, P, sig, rho):
    """Clamped rotated-back scales of each pair's members and the pairs' rho (plane h)."""
    siga = np.empty(P)
    sigb = np.empty(P)
    rh = np.empty(P)
    for g in range(P):
        siga[g] = _clamps(sig[h, groups[g, 0]])
        sigb[g] = _clamps(sig[h, groups[g, 1]])
        rh[g] = rho[h, g]
    return siga, sigb, rh


@jit.njit
def _history_rows(refs):
    """Rows of rotated-back values the kernels keep (0: no row repeats an earlier one)."""
    H, T = refs.shape
    for h in range(H):
        for t in range(T):
            if refs[h, t] >= 0:
                return min(T, MAX_BACK + 1)
    return 0


@jit.njit
def _match_scales(h, qch, sigm):
    """Clamped scales of repeated rows in coding order, and their floor(log2)."""
    D = qch.shape[0]
    qsm = np.empty(D)
    qlsm = np.empty(D, np.int64)
    for q in range(D):
        qsm[q] = _clamps(sigm[h, qch[q]])
        qlsm[q] = _floor_log2(qsm[q])
    return qsm, qlsm


@jit.njit
def _n_pairs(gsize):
    P = 0
    while P < gsize.shape[0] and gsize[P] == 2:       # the pairs are the first groups
        P += 1
    return P


@jit.njit(nogil=True)
def _analyse(x, tab, cs, sn, groups, gsize, ntaps, feat, coef, bias, sig, rho, refs, sigm,
             syms, lits, nlits):
    """Encoder pass: per value in coding order, its symbols (ctx1, sym1, ctx2, sym2) and
    stored bits."""
    H, T, D = x.shape
    P = _n_pairs(gsize)
    zz = np.zeros(2 * D)
    psa = np.empty(P)
    psb = np.empty(P)
    pkap = np.empty(P)
    plsa = np.empty(P, np.int64)
    plsb = np.empty(P, np.int64)
    psa_bits = psa.view(np.int64)
    psb_bits = psb.view(np.int64)
    fb = np.empty(1)
    ib = fb.view(np.int64)
    R = _history_rows(refs)
    hist = np.zeros((max(R, 1), D))
    zr = hist[0]
    i = 0
    for h in range(H):
        qch, kind, t0, tf, tc, qbias, qs, qls = _layout(h, groups, gsize, ntaps, feat, coef,
                                                         bias, sig)
        siga, sigb, rh = _pair_scales(h, groups, P, sig, rho)
        qsm, qlsm = _match_scales(h, qch, sigm)
        zz[:] = 0.0
        for t in range(T):
            m = refs[h, t]
            if m >= 0:
                zr = hist[m % R]
            if P:
                _pair_token(cs[t, :P], sn[t, :P], siga, sigb, rh, psa, pkap, psb, psa_bits,
                            psb_bits, plsa, plsb)
            c = 1.0
            sv = 0.0
            pa = 0.0
            pb0 = 0.0
            kap = 0.0
            xa = 0.0
            g = 0
            for q in range(D):
                kd = kind[q]
                if m >= 0:                   # the row repeats row m (rotated-back frame)
                    s = qsm[q]
                    ls = qlsm[q]
                    if kd == 0:
                        p = _clampp(zr[qch[q]])
                    elif kd == 1:
                        g = q >> 1
                        c = cs[t, g]
                        sv = sn[t, g]
                        za = zr[qch[q]]
                        zb = zr[qch[q + 1]]
                        pa = _clampp(c * za - sv * zb)
                        pb0 = sv * za + c * zb
                        kap = 0.0
                        p = pa
                    else:
                        p = _clampp(pb0)
                elif kd == 2:
                    p = _clampp(pb0 + kap * (xa - pa))
                    s = psb[g]
                    ls = plsb[g]
                else:
                    acc = qbias[q]
                    for j in range(t0[q], t0[q + 1]):
                        acc += tc[j] * zz[tf[j]]
                    if kd == 0:
                        p = _clampp(acc)
                        s = qs[q]
                        ls = qls[q]
                    else:
                        g = q >> 1
                        accb = qbias[q + 1]
                        for j in range(t0[q + 1], t0[q + 2]):
                            accb += tc[j] * zz[tf[j]]
                        c = cs[t, g]
                        sv = sn[t, g]
                        pa = _clampp(c * acc - sv * accb)
                        pb0 = sv * acc + c * accb
                        kap = pkap[g]
                        p = pa
                        s = psa[g]
                        ls = plsa[g]
                ap = abs(p)
                fb[0] = ap / s
                ctx = _zbucket(ib[0])
                fb[0] = ap if ap > s else s
                el = ((ib[0] >> 52) & 0x7FF) - 1023
                u = x[h, t, qch[q]]
                r = _symbols(u, p, ls, el, ctx)
                syms[i, 0], syms[i, 1], syms[i, 2], syms[i, 3] = r[0], r[1], r[2], r[3]
                lits[i], nlits[i] = r[4], r[5]
                i += 1
                xv = tab[u]
                if kd == 0:
                    zz[D + qch[q]] = xv
                elif kd == 1:
                    xa = xv
                else:
                    zz[D + qch[q - 1]] = c * xa + sv * xv
                    zz[D + qch[q]] = c * xv - sv * xa
            for j in range(D):
                zz[j] = zz[D + j]
            if R:
                hist[t % R, :] = zz[:D]
    return i


@jit.njit(nogil=True)
def _decode_kernel(out, tab, cs, sn, groups, gsize, ntaps, feat, coef, bias, sig, rho, refs,
                   sigm, st, words, bits, nbits, slot1, fc1, slot2, fc2):
    """Decode into out uint16[H, T, D]; returns an error code (0: fine). slot1/slot2: the
    symbol of each (context, slot), flat; fc1/fc2: frequency << 16 | cumulative frequency
    of each (context, symbol), flat."""
    # The prediction below (through ``el``) and the row update after each value are those of
    # _analyse, line for line: a decoder that predicts anything else decodes garbage, which
    # the round-trip tests catch. One shared per-value njit function was measured 6x slower
    # to decode (the reference counting of its twenty array arguments on every call).
    H, T, D = out.shape
    P = _n_pairs(gsize)
    zz = np.zeros(2 * D)
    psa = np.empty(P)
    psb = np.empty(P)
    pkap = np.empty(P)
    plsa = np.empty(P, np.int64)
    plsb = np.empty(P, np.int64)
    psa_bits = psa.view(np.int64)
    psb_bits = psb.view(np.int64)
    fb = np.empty(1)
    ib = fb.view(np.int64)
    R = _history_rows(refs)
    hist = np.zeros((max(R, 1), D))
    zr = hist[0]
    nwords = words.shape[0]
    oflat = out.reshape(-1)
    x0 = np.uint64(st[0])
    x1 = np.uint64(st[1])
    k = 0
    wp = 0
    bp = 0
    for h in range(H):
        qch, kind, t0, tf, tc, qbias, qs, qls = _layout(h, groups, gsize, ntaps, feat, coef,
                                                         bias, sig)
        siga, sigb, rh = _pair_scales(h, groups, P, sig, rho)
        qsm, qlsm = _match_scales(h, qch, sigm)
        zz[:] = 0.0
        for t in range(T):
            m = refs[h, t]
            if m >= 0:
                zr = hist[m % R]
            if P:
                _pair_token(cs[t, :P], sn[t, :P], siga, sigb, rh, psa, pkap, psb, psa_bits,
                            psb_bits, plsa, plsb)
            c = 1.0
            sv = 0.0
            pa = 0.0
            pb0 = 0.0
            kap = 0.0
            xa = 0.0
            g = 0
            base = (h * T + t) * D
            for q in range(D):
                kd = kind[q]
                if m >= 0:                   # the row repeats row m (rotated-back frame)
                    s = qsm[q]
                    ls = qlsm[q]
                    if kd == 0:
                        p = _clampp(zr[qch[q]])
                    elif kd == 1:
                        g = q >> 1
                        c = cs[t, g]
                        sv = sn[t, g]
                        za = zr[qch[q]]
                        zb = zr[qch[q + 1]]
                        pa = _clampp(c * za - sv * zb)
                        pb0 = sv * za + c * zb
                        kap = 0.0
                        p = pa
                    else:
                        p = _clampp(pb0)
                elif kd == 2:
                    p = _clampp(pb0 + kap * (xa - pa))
                    s = psb[g]
                    ls = plsb[g]
                else:
                    acc = qbias[q]
                    for j in range(t0[q], t0[q + 1]):
                        acc += tc[j] * zz[tf[j]]
                    if kd == 0:
                        p = _clampp(acc)
                        s = qs[q]
                        ls = qls[q]
                    else:
                        g = q >> 1
                        accb = qbias[q + 1]
                        for j in range(t0[q + 1], t0[q + 2]):
                            accb += tc[j] * zz[tf[j]]
                        c = cs[t, g]
                        sv = sn[t, g]
                        pa = _clampp(c * acc - sv * accb)
                        pb0 = sv * acc + c * accb
                        kap = pkap[g]
                        p = pa
                        s = psa[g]
                        ls = plsa[g]
                ap = abs(p)
                fb[0] = ap / s
                ctx = _zbucket(ib[0])
                fb[0] = ap if ap > s else s
                el = ((ib[0] >> 52) & 0x7FF) - 1023
                # sign / exponent symbol
                x = x1 if k & 1 else x0
                sl = np.int64(x & np.uint64(PROB_SCALE - 1))
                sym = np.int64(slot1[ctx * PROB_SCALE + sl])
                fcv = fc1[ctx * N1 + sym]
                x = np.uint64(fcv >> 16) * (x >> np.uint64(PROB_BITS)) + np.uint64(sl) - \
                    np.uint64(fcv & 0xFFFF)
                if x < np.uint64(RANS_L):
                    if wp >= nwords:
                        return 1
                    x = (x << np.uint64(16)) | np.uint64(words[wp])
                    wp += 1
                if k & 1:
                    x1 = x
                else:
                    x0 = x
                k += 1
                agree = 1 if sym >= 48 else 0
                d = sym - 48 * agree
                if d == 0 or d == 47:
                    if bp + 5 > nbits:
                        return 2
                    w = bp >> 5
                    o = bp & 31
                    v = np.uint64(bits[w]) >> np.uint64(o)
                    if o + 5 > 32:
                        v |= np.uint64(bits[w + 1]) << np.uint64(32 - o)
                    e = np.int64(v & np.uint64(31))
                    bp += 5
                    r = e - el - 15 + EOFF
                    if (d == 0 and r > 0) or (d == 47 and r < 47):
                        return 3
                else:
                    e = d + el + 15 - EOFF
                    if e < 0 or e > 31:
                        return 3
                sg = 0 if (agree == 1) == (p >= 0.0) else 1
                lo, hi, qi, inside, ue = _binade(p, agree, e)
                sb = ls - ue + 1
                if e == 31 or sb >= SB_RAW:
                    nb = 10
                else:
                    if sb < 0:
                        sb = 0
                    ctx = sb * 2 + inside
                    x = x1 if k & 1 else x0
                    sl = np.int64(x & np.uint64(PROB_SCALE - 1))
                    sym = np.int64(slot2[ctx * PROB_SCALE + sl])
                    fcv = fc2[ctx * N2 + sym]
                    x = np.uint64(fcv >> 16) * (x >> np.uint64(PROB_BITS)) + np.uint64(sl) - \
                        np.uint64(fcv & 0xFFFF)
                    if x < np.uint64(RANS_L):
                        if wp >= nwords:
                            return 1
                        x = (x << np.uint64(16)) | np.uint64(words[wp])
                        wp += 1
                    if k & 1:
                        x1 = x
                    else:
                        x0 = x
                    k += 1
                    nb = 0 if sym < 2 else (sym - 2) // 2
                low = np.int64(0)
                if nb > 0:
                    if bp + nb > nbits:
                        return 2
                    w = bp >> 5
                    o = bp & 31
                    v = np.uint64(bits[w]) >> np.uint64(o)
                    if o + nb > 32:
                        v |= np.uint64(bits[w + 1]) << np.uint64(32 - o)
                    low = np.int64(v & np.uint64((1 << nb) - 1))
                    bp += nb
                if nb == 10:
                    u = (sg << 15) | (e << 10) | low
                else:
                    rank = sym if sym < 2 else (1 << (nb + 1)) | (((sym - 2) & 1) << nb) | low
                    mag = _rank_value(rank, qi, lo, hi)
                    if mag < 0:
                        return 4
                    u = (sg << 15) | (e << 10) | (mag - lo)
                oflat[base + qch[q]] = u
                xv = tab[u]
                if kd == 0:
                    zz[D + qch[q]] = xv
                elif kd == 1:
                    xa = xv
                else:
                    zz[D + qch[q - 1]] = c * xa + sv * xv
                    zz[D + qch[q]] = c * xv - sv * xa
            for j in range(D):
                zz[j] = zz[D + j]
            if R:
                hist[t % R, :] = zz[:D]
    st[0] = x0
    st[1] = x1
    if x0 != np.uint64(RANS_L) or x1 != np.uint64(RANS_L):
        return 5
    if wp != nwords:
        return 6
    if bp != nbits:
        return 7
    return 0


@jit.njit
def _pack_bits(lits, nlits, out):
    """Stored bits, least significant first, into u32 words; returns the words used."""
    acc = np.uint64(0)
    n = 0
    w = 0
    for i in range(lits.shape[0]):
        k = np.int64(nlits[i])
        if k == 0:
            continue
        acc |= np.uint64(lits[i]) << np.uint64(n)
        n += k
        if n >= 32:
            out[w] = np.uint32(acc & np.uint64(0xFFFFFFFF))
            w += 1
            acc >>= np.uint64(32)
            n -= 32
    if n > 0:
        out[w] = np.uint32(acc & np.uint64(0xFFFFFFFF))
        w += 1
    return w


@jit.njit
def _rans_encode(syms, freq1, cum1, freq2, cum2, out):
    """Encode the symbols (value by value: sym1, then sym2 unless 255) in reverse, symbol k
    with state k & 1. Renormalization words go into out backwards from its end; returns
    (words written, final state 0, final state 1)."""
    n = syms.shape[0]
    k = 0
    for i in range(n):
        k += 1 if syms[i, 3] == 255 else 2
    st0 = np.uint64(RANS_L)
    st1 = np.uint64(RANS_L)
    w = out.shape[0]
    for i in range(n - 1, -1, -1):
        for part in range(2):
            if part == 0:
                if syms[i, 3] == 255:
                    continue
                f = np.uint64(freq2[syms[i, 2], syms[i, 3]])
                c = np.uint64(cum2[syms[i, 2], syms[i, 3]])
            else:
                f = np.uint64(freq1[syms[i, 0], syms[i, 1]])
                c = np.uint64(cum1[syms[i, 0], syms[i, 1]])
            k -= 1
            x = st1 if k & 1 else st0
            xmax = ((np.uint64(RANS_L) >> np.uint64(PROB_BITS)) << np.uint64(16)) * f
            while x >= xmax:
                w -= 1
                out[w] = np.uint16(x & np.uint64(0xFFFF))
                x >>= np.uint64(16)
            x = ((x // f) << np.uint64(PROB_BITS)) + (x % f) + c
            if k & 1:
                st1 = x
            else:
                st0 = x
    return out.shape[0] - w, st0, st1


@jit.njit
def _slots(freq):
    C, S = freq.shape
    slot = np.zeros((C, PROB_SCALE), np.uint8)
    cum = np.zeros((C, S), np.int64)
    for c in range(C):
        acc = 0
        for s in range(S):
            cum[c, s] = acc
            for k in range(freq[c, s]):
                slot[c, acc + k] = s
            acc += freq[c, s]
    return slot, cum


# --------------------------------------------------------------------------- fitting
@jit.njit
def _spd_solve(A, b):
    """x with A x = b for a symmetric positive definite A (Cholesky; a pivot that is not
    positive is taken as a tiny one, so a degenerate system still gives finite taps)."""
    n = b.shape[0]
    L = np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1):
            acc = A[i, j]
            for k in range(j):
                acc -= L[i, k] * L[j, k]
            if i == j:
                L[i, i] = math.sqrt(acc) if acc > 1e-300 else 1e-150
            else:
                L[i, j] = acc / L[j, j]
    y = np.zeros(n)
    for i in range(n):
        acc = b[i]
        for k in range(i):
            acc -= L[i, k] * y[k]
        y[i] = acc / L[i, i]
    x = np.zeros(n)
    for i in range(n - 1, -1, -1):
        acc = y[i]
        for k in range(i + 1, n):
            acc -= L[k, i] * x[k]
        x[i] = acc / L[i, i]
    return x


@jit.njit
def _omp(C, groups, gsize, D, max_taps, T, tap_bits):
    """Greedy tap selection per channel on the covariance C [2D, 2D] of the features
    (previous token's D values, current token's D). A channel may use the previous token
    and the current token's earlier groups; a tap is added while its Gaussian coding gain
    (T/2 log2 of the variance ratio) exceeds tap_bits. Returns ntaps, feat, weights."""
    ntaps = np.zeros(D, np.int64)
    feat = np.zeros((D, MAX_TAPS), np.int64)
    w = np.zeros((D, MAX_TAPS))
    allowed = np.zeros(2 * D, np.bool_)
    allowed[:D] = True
    taken = np.zeros(2 * D, np.bool_)
    rc = np.zeros(2 * D)
    S = np.zeros(MAX_TAPS, np.int64)
    for g in range(groups.shape[0]):
        for mi in range(gsize[g]):
            m = groups[g, mi]
            y = D + m
            var = C[y, y]
            k = 0
            wk = np.zeros(0)
            taken[:] = False
            rc[:] = C[:, y]                # covariance of the residual with each feature
            while k < max_taps and var > 0:
                best = -1
                bestg = 0.0
                for j in range(2 * D):
                    if allowed[j] and not taken[j] and C[j, j] > 0:
                        gain = rc[j] * rc[j] / C[j, j]
                        if gain > bestg:
                            bestg = gain
                            best = j
                if best < 0 or bestg >= var:
                    break
                if 0.5 * T * math.log2(var / (var - bestg)) < tap_bits:
                    break
                S[k] = best
                taken[best] = True
                k += 1
                A = np.empty((k, k))
                rhs = np.empty(k)
                for p in range(k):
                    rhs[p] = C[S[p], y]
                    for q in range(k):
                        A[p, q] = C[S[p], S[q]]
                    A[p, p] += 1e-9 * C[S[p], S[p]] + 1e-30
                wk = _spd_solve(A, rhs)
                var = C[y, y]
                for p in range(k):
                    var -= wk[p] * rhs[p]
                for j in range(2 * D):
                    acc = C[j, y]
                    for p in range(k):
                        acc -= C[j, S[p]] * wk[p]
                    rc[j] = acc
            ntaps[m] = k
            for p in range(k):
                feat[m, p] = S[p]
                w[m, p] = wk[p]
        for mi in range(gsize[g]):
            allowed[D + groups[g, mi]] = True
    return ntaps, feat, w


@jit.njit
def _frames(x, tab, cs, sn, groups, gsize, gpair):
    """Rotated-back values z[T, D] of one plane x uint16[T, D]."""
    T, D = x.shape
    z = np.empty((T, D))
    for t in range(T):
        for g in range(groups.shape[0]):
            a = groups[g, 0]
            if gsize[g] == 2:
                b = groups[g, 1]
                c, s = cs[t, gpair[g]], sn[t, gpair[g]]
                xa, xb = tab[x[t, a]], tab[x[t, b]]
                z[t, a] = c * xa + s * xb
                z[t, b] = c * xb - s * xa
            else:
                z[t, a] = tab[x[t, a]]
    return z


@jit.njit
def _residuals(z, ntaps, feat, coef, bias):
    T, D = z.shape
    r = np.empty((T, D))
    zz = np.zeros(2 * D)
    for t in range(T):
        zz[D:] = z[t]
        for m in range(D):
            acc = bias[m]
            for j in range(ntaps[m]):
                acc += coef[m, j] * zz[feat[m, j]]
            r[t, m] = z[t, m] - acc
        zz[:D] = z[t]
    return r


def _groups(D: int, pairs: np.ndarray | None):
    """Coding groups (rows of two channel ids), their sizes and rotary pair index: the
    pairs in order, then every other channel alone."""
    rows, size, pidx = [], [], []
    used = np.zeros(D, bool)
    if pairs is not None:
        for i, (a, b) in enumerate(pairs):
            rows.append((a, b))
            size.append(2)
            pidx.append(i)
            used[a] = used[b] = True
    for c in np.flatnonzero(~used):
        rows.append((c, c))
        size.append(1)
        pidx.append(0)
    return (np.array(rows, np.int64).reshape(-1, 2), np.array(size, np.int64),
            np.array(pidx, np.int64))


def _repeats(z: np.ndarray) -> np.ndarray:
    """Per row, an earlier row (at most MAX_BACK back) it repeats in the rotated-back frame
    up to rounding, else -1: the latest earlier row with the same key (the 16 widest
    channels quantized to 1/16 of their spread) is the candidate, the whole row's squared
    distance (at most 1e-4 of the total variance) confirms it. Rows of fewer than
    REPEAT_MIN_CHANNELS channels are never repeats (a back reference would cost more than
    it saves). Tokens that recur give such rows in a first layer (its values are a
    function of the token alone, its keys that function rotated by the position)."""
    T, D = z.shape
    refs = np.full(T, -1, np.int64)
    if T < 2 or D < REPEAT_MIN_CHANNELS:
        return refs
    sd = z.std(0)
    total = float((sd * sd).sum())
    if not total > 0 or not np.isfinite(total):
        return refs
    pick = np.argsort(sd)[-16:]
    step = np.maximum(sd[pick] / 16, 1e-300)
    with np.errstate(over="ignore", invalid="ignore"):
        keys = np.clip(np.nan_to_num(np.rint(z[:, pick] / step)), -2.0 ** 62, 2.0 ** 62)
    keys = np.ascontiguousarray(keys.astype(np.int64))
    _, group = np.unique(keys.view(np.dtype((np.void, 8 * keys.shape[1]))), return_inverse=True)
    group = group.reshape(-1)
    order = np.lexsort((np.arange(T), group))           # by key, then row
    same = group[order[1:]] == group[order[:-1]]
    t, r = order[1:][same], order[:-1][same]           # each row and the latest earlier twin
    near = t - r <= MAX_BACK
    t, r = t[near], r[near]
    d = z[t] - z[r]
    ok = np.einsum("ij,ij->i", d, d) <= 1e-4 * total
    refs[t[ok]] = r[ok]
    return refs


def _fit_plane(x: np.ndarray, cs, sn, groups, gsize, gpair, max_taps: int):
    """Model of one plane x uint16[T, D]: ntaps, feat, coef (float16), bias multiples
    (int64), sig (float16, per channel), rho (float16, per group), the rows repeated rows
    repeat (int64, -1: none) and the scales of repeated rows (float16, per channel)."""
    T, D = x.shape
    G = groups.shape[0]
    if T == 0:
        return (np.zeros(D, np.int64), np.zeros((D, MAX_TAPS), np.int64),
                np.zeros((D, MAX_TAPS), np.float16), np.zeros(D, np.int64),
                np.zeros(D, np.float16), np.zeros(G, np.float16), np.zeros(0, np.int64),
                np.zeros(D, np.float16))
    z = _frames(x, F16, cs, sn, groups, gsize, gpair)
    refs = _repeats(z)
    rep = refs >= 0
    zprev = np.zeros_like(z)
    zprev[1:] = z[:-1]
    fit = ~rep if (~rep).sum() >= 1 else np.ones(T, bool)
    zc, zp = z[fit], zprev[fit]
    n = zc.shape[0]
    mu_cur, mu_prev = zc.mean(0), zp.mean(0)
    g00 = zc.T @ zc
    C = np.empty((2 * D, 2 * D))
    C[:D, :D] = zp.T @ zp
    C[:D, D:] = zp.T @ zc
    C[D:, :D] = C[:D, D:].T
    C[D:, D:] = g00
    mu = np.concatenate([mu_prev, mu_cur])
    C = C / n - np.outer(mu, mu)
    C = np.nan_to_num(C, nan=0.0, posinf=0.0, neginf=0.0)
    ntaps, feat, w = _omp(C, groups, gsize, D, max_taps, n, TAP_BITS)
    coef = np.clip(np.nan_to_num(w), -65504, 65504).astype(np.float16)
    c64 = coef.astype(np.float64)
    bias = mu_cur.copy()
    for m in range(D):
        k = ntaps[m]
        bias[m] -= float(np.dot(c64[m, :k], mu[feat[m, :k]]))
    bias = np.clip(np.nan_to_num(bias), -PRED_CLAMP, PRED_CLAMP)
    r = _residuals(z, ntaps, feat, c64, bias)[fit]
    sig = np.sqrt((r * r).mean(0))
    sig16 = np.clip(np.nan_to_num(sig, nan=SIG_MAX, posinf=SIG_MAX), 0, SIG_MAX).astype(np.float16)
    step = np.clip(sig16.astype(np.float64), SIG_MIN, SIG_MAX) * BIAS_STEP
    bias_n = np.rint(bias / step).astype(np.int64)
    rho = np.zeros(G)
    two = gsize == 2
    if two.any():
        a, b = groups[two, 0], groups[two, 1]
        den = sig[a] * sig[b]
        with np.errstate(invalid="ignore", divide="ignore"):
            rho[two] = np.where(den > 0, (r[:, a] * r[:, b]).mean(0) / den, 0.0)
    rho16 = np.clip(np.nan_to_num(rho), -0.999, 0.999).astype(np.float16)
    sigm = np.zeros(D)
    if rep.any():
        t = np.flatnonzero(rep)
        zr = z[refs[t]]
        pred = zr.copy()
        for g in np.flatnonzero(two):
            a, b = groups[g]
            c, sv = cs[t, gpair[g]], sn[t, gpair[g]]
            pred[:, a] = c * zr[:, a] - sv * zr[:, b]
            pred[:, b] = sv * zr[:, a] + c * zr[:, b]
        err = F16[x[t]] - pred
        sigm = np.sqrt((err * err).mean(0))
    sigm16 = np.clip(np.nan_to_num(sigm, nan=SIG_MAX, posinf=SIG_MAX), 0, SIG_MAX)
    sigm16 = sigm16.astype(np.float16)
    return ntaps, feat, coef, bias_n, sig16, rho16, refs, sigm16


@jit.njit
def _normalize(counts):
    """Frequencies summing to PROB_SCALE per context (contexts never used: all zero), at
    least 1 for every symbol that occurs; the rounding is settled one step at a time where
    it costs least."""
    C, S = counts.shape
    out = np.zeros((C, S), np.int64)
    for c in range(C):
        tot = 0
        for j in range(S):
            tot += counts[c, j]
        if tot == 0:
            continue
        acc = 0
        for j in range(S):
            f = (counts[c, j] * PROB_SCALE) // tot
            if counts[c, j] > 0 and f == 0:
                f = 1
            out[c, j] = f
            acc += f
        while acc != PROB_SCALE:
            best = -1
            bestv = 0.0
            for j in range(S):
                n = counts[c, j]
                f = out[c, j]
                if acc < PROB_SCALE and n > 0:
                    v = n * math.log2((f + 1) / f)          # bits saved by one more
                    if best < 0 or v > bestv:
                        best, bestv = j, v
                elif acc > PROB_SCALE and f > 1:
                    v = n * math.log2(f / (f - 1))          # bits lost by one less
                    if best < 0 or v < bestv:
                        best, bestv = j, v
            if acc < PROB_SCALE:
                out[c, best] += 1
                acc += 1
            else:
                out[c, best] -= 1
                acc -= 1
    return out


def _pair_layout(mode: int, P: int, D: int) -> np.ndarray:
    """The pairs of a standard layout: 1 (i, i + D/2) (RoPE "neox"), 2 (2i, 2i + 1)."""
    i = np.arange(P, dtype=np.int64)
    return np.stack([i, i + D // 2] if mode == 1 else [2 * i, 2 * i + 1], axis=1)


def _geometric_series(first, ratio, n: int) -> np.ndarray:
    """theta[0] = first, theta[i + 1] = theta[i] * ratio, in float32 arithmetic."""
    out = np.empty(n, np.float32)
    t = np.float32(first)
    r = np.float32(ratio)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        for i in range(n):
            out[i] = t
            t = np.float32(t * r)
    return out


def _geometric(theta: np.ndarray) -> np.float32 | None:
    """The float32 ratio of theta when it is a float32 geometric series, else None."""
    t = theta.astype(np.float32)
    if len(t) < 2 or not np.isfinite(t).all() or t[0] == 0:
        return None
    r = np.float32(t[1] / t[0])
    return r if np.array_equal(_geometric_series(t[0], r, len(t)), t) else None


# ------------------------------------------------------------------------------- API
class Rotary:
    """A rotary frame for :func:`encode`: ``positions`` int[T] (one per token), ``pairs``
    int[P, 2] (channel ids, each at most once) and ``theta`` float[P] (radians per
    position; stored as float32)."""

    def __init__(self, positions, theta, pairs):
        self.positions = np.ascontiguousarray(positions, dtype=np.int64).reshape(-1)
        self.theta = np.asarray(theta, dtype=np.float32).astype(np.float64).reshape(-1)
        self.pairs = np.ascontiguousarray(pairs, dtype=np.int64).reshape(-1, 2)

    def fits(self, T: int, D: int) -> bool:
        p = self.pairs
        return (self.positions.shape[0] == T and p.shape[0] == self.theta.shape[0]
                and 1 <= p.shape[0] <= D // 2 and bool(((p >= 0) & (p < D)).all())
                and len(np.unique(p)) == p.size and bool(np.isfinite(self.theta).all())
                and bool((np.abs(self.positions) < 2 ** 40).all()))


def _planes(shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(shape) == 0:
        return 1, 1, 1
    if len(shape) == 1:
        return 1, shape[0], 1
    return math.prod(shape[:-2]), shape[-2], shape[-1]


def applies(shape: tuple[int, ...]) -> bool:
    """Can :func:`encode` take a float16 array of this shape (channels <= MAX_CHANNELS)?"""
    return _planes(shape)[2] <= MAX_CHANNELS


def encode(a: np.ndarray, rotary: Rotary | None = None, max_taps: int = MAX_TAPS) -> bytes:
    """The payload of the float16 array ``a`` (any shape :func:`applies` to; read as
    little-endian C order). ``rotary`` is used when it fits the planes' tokens and
    channels, ignored otherwise."""
    H, T, D = _planes(a.shape)
    if D > MAX_CHANNELS:
        raise ValueError(f"{D} channels: the predictive codec takes at most {MAX_CHANNELS}")
    x = np.ascontiguousarray(a, dtype="<f2").view("<u2").astype(np.uint16, copy=False)
    x = x.reshape(H, T, D)
    if rotary is not None and not rotary.fits(T, D):
        rotary = None
    groups, gsize, gpair = _groups(D, rotary.pairs if rotary is not None else None)
    cs, sn = ((_rotations(rotary.positions, rotary.theta)) if rotary is not None
              else (np.zeros((1, 1)), np.zeros((1, 1))))
    models = [_fit_plane(np.ascontiguousarray(x[h]), cs, sn, groups, gsize, gpair, max_taps)
              for h in range(H)]
    G = groups.shape[0]
    if models:
        ntaps, feat, coef, bias, sig, rho, refs, sigm = (np.stack(v) for v in zip(*models))
    else:
        ntaps, feat = np.zeros((0, D), np.int64), np.zeros((0, D, MAX_TAPS), np.int64)
        coef, bias = np.zeros((0, D, MAX_TAPS), np.float16), np.zeros((0, D), np.int64)
        sig, rho = np.zeros((0, D), np.float16), np.zeros((0, G), np.float16)
        refs, sigm = np.zeros((0, T), np.int64), np.zeros((0, D), np.float16)
    repeats = bool((refs >= 0).any())
    n = H * T * D
    syms = np.empty((n, 4), np.uint8)
    lits = np.empty(n, np.int32)
    nlits = np.empty(n, np.uint8)
    _analyse(x, F16, cs, sn, groups, gsize, ntaps, feat, coef.astype(np.float64),
             bias, sig.astype(np.float64), rho.astype(np.float64), refs,
             sigm.astype(np.float64), syms, lits, nlits)
    c1 = np.bincount(syms[:, 0].astype(np.int64) * N1 + syms[:, 1], minlength=NZ * N1)
    has2 = syms[:, 3] != 255
    c2 = np.bincount(syms[has2, 2].astype(np.int64) * N2 + syms[has2, 3], minlength=NS2 * N2)
    f1 = _normalize(c1.reshape(NZ, N1).astype(np.int64))
    f2 = _normalize(c2.reshape(NS2, N2).astype(np.int64))
    cum1 = np.cumsum(f1, axis=1) - f1
    cum2 = np.cumsum(f2, axis=1) - f2
    words = np.empty(2 * n + 16, np.uint16)
    nw, st0, st1 = _rans_encode(syms, f1, cum1, f2, cum2, words)
    head = np.array([int(st0) & 0xFFFF, int(st0) >> 16, int(st1) & 0xFFFF, int(st1) >> 16],
                    np.uint16)
    nbits = int(nlits.sum(dtype=np.int64))
    bitbuf = np.zeros(nbits // 32 + 2, np.uint32)
    nb = _pack_bits(lits, nlits, bitbuf)
    model = _pack_model(H, T, D, G, rotary, ntaps, feat, coef, bias, sig, rho,
                        refs if repeats else None, sigm, f1, f2, nbits)
    mz = zstandard.ZstdCompressor(level=19).compress(model)
    flags = (1 if rotary is not None else 0) | (2 if repeats else 0)
    return b"".join([_FIXED.pack(VERSION, flags, len(mz), 4 * nb), mz,
                     bitbuf[:nb].astype("<u4").tobytes(), head.astype("<u2").tobytes(),
                     words[words.shape[0] - nw:].astype("<u2").tobytes()])


def _pack_model(H, T, D, G, rotary, ntaps, feat, coef, bias, sig, rho, refs, sigm, f1, f2,
                nbits) -> bytes:
    """dims (H, T, D, groups, stored bits); with a rotary frame: P, pair layout (u1: 0
    listed, 1 (i, i + D/2), 2 (2i, 2i + 1)), theta layout (u1: 0 listed, 1 geometric:
    theta[0] and the float32 ratio), position steps (i8), the pairs (u2) and theta (f4) as
    listed; then per plane and channel: tap counts (u1), the taps' feature ids (u2) and
    coefficients (f2), bias multiples (i8), scales (f2), per group rho (f2); with repeated
    rows, per plane and row how far back the row it repeats is (u2, 0: none) and per
    plane and channel the scales of repeated rows (f2); then the two frequency tables
    (u2)."""
    parts = [_DIMS.pack(H, T, D, G, nbits)]
    if rotary is not None:
        P = rotary.pairs.shape[0]
        pmode = next((m for m in (1, 2) if np.array_equal(rotary.pairs, _pair_layout(m, P, D))), 0)
        ratio = _geometric(rotary.theta)
        parts += [struct.pack("<IBB", P, pmode, 0 if ratio is None else 1),
                  np.diff(rotary.positions, prepend=np.int64(0)).astype("<i8").tobytes()]
        if pmode == 0:
            parts.append(rotary.pairs.astype("<u2").tobytes())
        theta = rotary.theta if ratio is None else np.array([rotary.theta[0], ratio])
        parts.append(theta.astype("<f4").tobytes())
    used = np.arange(MAX_TAPS)[None, None, :] < ntaps[:, :, None]
    parts += [ntaps.astype("u1").tobytes(), feat[used].astype("<u2").tobytes(),
              coef[used].astype("<f2").tobytes(), bias.astype("<i8").tobytes(),
              sig.astype("<f2").tobytes(), rho.astype("<f2").tobytes()]
    if refs is not None:
        back = np.where(refs >= 0, np.arange(T)[None, :] - refs, 0)
        parts += [back.astype("<u2").tobytes(), sigm.astype("<f2").tobytes()]
    parts += [f1.astype("<u2").tobytes(), f2.astype("<u2").tobytes()]
    return b"".join(parts)


class _Cursor:
    def __init__(self, data: bytes, fail):
        self.data, self.pos, self.fail = data, 0, fail

    def take(self, dtype, count: int) -> np.ndarray:
        dt = np.dtype(dtype)
        if count < 0 or self.pos + dt.itemsize * count > len(self.data):
            self.fail("predictive payload: model truncated")
        out = np.frombuffer(self.data, dt, count, self.pos)
        self.pos += dt.itemsize * count
        return out


def decode(stored: bytes, shape: tuple[int, ...], fail: Callable[[str], NoReturn],
           out: np.ndarray | None = None) -> np.ndarray:
    """The float16 array (native byte order) of a payload made by :func:`encode`, decoded
    into ``out`` (a C-contiguous float16 array of ``shape``) or a new array;
    ``fail(reason)`` raises the caller's error for anything inconsistent."""
    H, T, D = _planes(shape)
    if D > MAX_CHANNELS:
        fail(f"predictive payload for {D} channels (at most {MAX_CHANNELS})")
    if len(stored) < _FIXED.size:
        fail("predictive payload: too short")
    version, flags, mlen, blen = _FIXED.unpack_from(stored)
    if version != VERSION:
        fail(f"predictive payload version {version} is not supported (this build reads {VERSION})")
    if flags & ~3:
        fail(f"predictive payload: unknown flags {flags:#x}")
    pos = _FIXED.size
    if pos + mlen + blen + 8 > len(stored) or blen % 4 or (len(stored) - pos - mlen - blen) % 2:
        fail("predictive payload: section lengths do not match the payload")
    bound = (_DIMS.size + 6 + 8 * T + 8 * D + H * D * (1 + 4 * MAX_TAPS + 8 + 2 + 2 + 2)
             + 2 * H * T + 2 * (NZ * N1 + NS2 * N2))
    frame = stored[pos:pos + mlen]
    try:
        size = zstandard.frame_content_size(frame)
        if not 0 <= size <= bound:
            fail(f"predictive payload: model frame of {size} bytes (at most {bound})")
        model = zstandard.ZstdDecompressor().decompress(frame, max_output_size=bound)
    except zstandard.ZstdError as e:
        fail(f"predictive payload: bad model frame ({e})")
    if len(model) != size:
        fail("predictive payload: model frame shorter than it declares")
    pos += mlen
    bits = np.frombuffer(stored, "<u4", blen // 4, pos).astype(np.uint32)
    pos += blen
    rans = np.frombuffer(stored, "<u2", (len(stored) - pos) // 2, pos).astype(np.uint16)
    cur = _Cursor(model, fail)
    mh, mt, md, G, nbits = _DIMS.unpack(cur.take("u1", _DIMS.size).tobytes())
    if (mh, mt, md) != (H, T, D):
        fail(f"predictive payload: model of {mh}x{mt}x{md} planes for shape {shape}")
    rotary = None
    if flags & 1:
        P, pmode, tmode = struct.unpack("<IBB", cur.take("u1", 6).tobytes())
        if not 1 <= P <= D // 2 or pmode > 2 or tmode > 1:
            fail(f"predictive payload: bad rotary frame ({P} pairs for {D} channels, "
                 f"layouts {pmode}, {tmode})")
        positions = np.cumsum(cur.take("<i8", T).astype(np.int64))
        pairs = (cur.take("<u2", 2 * P).astype(np.int64) if pmode == 0
                 else _pair_layout(pmode, P, D))
        theta = cur.take("<f4", P if tmode == 0 else 2)
        if tmode == 1:
            theta = _geometric_series(theta[0], theta[1], P)
        rotary = Rotary(positions, theta, pairs)
        if not rotary.fits(T, D):
            fail("predictive payload: bad rotary frame")
    groups, gsize, gpair = _groups(D, rotary.pairs if rotary is not None else None)
    if G != groups.shape[0]:
        fail(f"predictive payload: {G} channel groups, expected {groups.shape[0]}")
    ntaps = cur.take("u1", H * D).astype(np.int64).reshape(H, D)
    if (ntaps > MAX_TAPS).any():
        fail("predictive payload: too many taps")
    used = np.arange(MAX_TAPS)[None, None, :] < ntaps[:, :, None]
    nt = int(ntaps.sum())
    feat = np.zeros((H, D, MAX_TAPS), np.int64)
    coef = np.zeros((H, D, MAX_TAPS))
    feat[used] = cur.take("<u2", nt)
    coef[used] = cur.take("<f2", nt)
    bias = cur.take("<i8", H * D).astype(np.int64).reshape(H, D)
    sig = cur.take("<f2", H * D).astype(np.float64).reshape(H, D)
    rho = cur.take("<f2", H * G).astype(np.float64).reshape(H, G)
    refs = np.full((H, T), -1, np.int64)
    sigm = np.zeros((H, D))
    if flags & 2:
        back = cur.take("<u2", H * T).astype(np.int64).reshape(H, T)
        t = np.arange(T)[None, :]
        if (back > np.minimum(t, MAX_BACK)).any():
            fail("predictive payload: a repeated row before the first row or too far back")
        refs = np.where(back > 0, t - back, -1)
        sigm = cur.take("<f2", H * D).astype(np.float64).reshape(H, D)
    f1 = cur.take("<u2", NZ * N1).astype(np.int64).reshape(NZ, N1)
    f2 = cur.take("<u2", NS2 * N2).astype(np.int64).reshape(NS2, N2)
    if cur.pos != len(model):
        fail("predictive payload: bytes after the model")
    # a tap on the current token must name a channel of an earlier group
    rank = np.empty(D, np.int64)
    for g in range(G):
        rank[groups[g, :gsize[g]]] = g
    if (feat >= 2 * D).any():
        fail("predictive payload: tap index out of range")
    now = used & (feat >= D)
    if (now & (rank[np.clip(feat - D, 0, max(D - 1, 0))] >= rank[None, :, None])).any():
        fail("predictive payload: a tap reads a value not yet decoded")
    if not (np.isfinite(coef).all() and (np.abs(bias) <= 2 ** 53).all() and np.isfinite(sig).all()
            and np.isfinite(rho).all() and np.isfinite(sigm).all()) or (sig < 0).any() \
            or (sigm < 0).any() or (np.abs(rho) >= 1).any():
        fail("predictive payload: bad model parameters")
    for name, fr in (("sign/exponent", f1), ("mantissa", f2)):
        sums = fr.sum(axis=1)
        if not ((sums == 0) | (sums == PROB_SCALE)).all():
            fail(f"predictive payload: {name} frequency table does not sum to {PROB_SCALE}")
    if (nbits + 31) // 32 != bits.shape[0]:
        fail("predictive payload: stored bit count does not match its stream")
    slot1, cum1 = _slots(f1)
    slot2, cum2 = _slots(f2)
    cs, sn = ((_rotations(rotary.positions, rotary.theta)) if rotary is not None
              else (np.zeros((1, 1)), np.zeros((1, 1))))
    st = np.array([int(rans[0]) | (int(rans[1]) << 16), int(rans[2]) | (int(rans[3]) << 16)],
                  np.uint64)
    if (st < RANS_L).any():
        fail("predictive payload: bad rANS state")
    if out is None:
        out = np.empty(shape, np.float16)
    elif out.shape != tuple(shape) or out.dtype != np.float16 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous float16 array of shape {shape}")
    err = _decode_kernel(out.view(np.uint16).reshape(H, T, D), F16, cs, sn, groups, gsize, ntaps,
                         feat, coef, bias, sig, rho, refs, sigm, st, rans[4:], bits, nbits,
                         slot1.reshape(-1), (f1 << 16 | cum1).reshape(-1), slot2.reshape(-1),
                         (f2 << 16 | cum2).reshape(-1))
    if err:
        fail(f"predictive payload: corrupt symbol stream (code {err})")
    return out
