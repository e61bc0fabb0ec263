"""The Numba attention kernels over the paged KV cache and the helpers they are built from.

Layout and masks: see :mod:`pyimp.attention` (docs/kvcache.md section 2). Every
kernel is built from four steps, each one function here:

1. **load**: :func:`load_keys` / :func:`load_values` decode tokens ``[t0, t1)``
   of one physical K / V block into float32 scratch (``kb`` ``[B*D]`` token-major,
   ``vb`` ``[D*B]`` channel-major, or token-major for token-row quantized V). This
   is the only place that knows how a cached block is stored: fp16 bits, float32,
   or a quantized layer given as the tuple ``(data, tail, meta)`` of
   :class:`pyimp.kv.cache.QuantizedKV` (the block
   being filled read from the float tail, every other block decoded in place by
   the per-type block decoders of :mod:`loaders.quantize`; no dequantized copy).
2. **attend**: :func:`attend_block` folds one block into a running partial
   (max ``m``, sum ``l``, un-normalized output ``o``) with the max-stabilized
   rule of docs/kvcache.md section 7 (online softmax).
3. **merge**: :func:`merge_splits` merges the partials of the work items that
   split one head's blocks.
4. the kernels: :func:`decode_blocks` (decode attention of one query over a
   list of logical blocks per head set: dense decode passes every block of the
   window, block-sparse decode its selection, the recall diagnostic both),
   :func:`prefill` and :func:`prefill_mass` (importance of a prompt chunk).

Kernels that are cheap at small sizes take ``parallel`` (bool): the same
kernel runs its outer loop with ``prange`` or serially (no thread-pool wake-up).
"""
from __future__ import annotations

import llvmlite.binding as llvm_binding
import numpy as np
from llvmlite import ir as llvm_ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from loaders import half, jit, quantize, quants, quants_legacy
from loaders.half import (fpext_half, f32_to_half_bits, fma16, half_bits_to_f32, hsum16,
                          lane_dot, lane_dot_rows, lane_sum)
from loaders.quantize import decode_qblocks
from loaders.quants_legacy import bits_f32

jit.kernel_module(__file__, half, quantize, quants_legacy)

# Fast-math flags: FMA contraction and signed-zero freedom, no reassociation (each compilation
# of a reassociated sum may pick its own order, so a kernel compiled in this process and the
# same kernel loaded from Numba's cache would differ in the last bits) and no nnan/ninf (-inf
# masks and NaN checks keep their IEEE meaning). Vectorized sums are written in a fixed order
# instead (loaders.half.lane_dot / lane_sum / hsum16).
FM = {"contract", "nsz"}

# llvm.prefetch is overloaded on the pointer type: opaque pointers from LLVM 15 on
_PREFETCH_NAME = ("llvm.prefetch.p0" if llvm_binding.llvm_version_info[0] >= 15
                  else "llvm.prefetch.p0i8")


@intrinsic
def prefetch(typingctx, arr, idx):
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


def load_f32(src, start, n, dst, lut):
    """dst[start:start+n] = float32 value of src[start:start+n] (fp16 bits, or float32);
    jitted code only (see the overload)."""


@overload(load_f32)
def _load_f32_ov(src, start, n, dst, lut):
    if src.dtype == types.uint16:
        def impl(src, start, n, dst, lut):
            s = src[start:start + n]
            d = dst[start:start + n]
            for i in range(n):
                d[i] = half_bits_to_f32(s[i])
        return impl

    def impl(src, start, n, dst, lut):
        s = src[start:start + n]
        d = dst[start:start + n]
        for i in range(n):
            d[i] = s[i]
    return impl


def default_splits(n_blocks: int, n_units: int, min_blocks: int) -> int:
    """Splits of each work unit's blocks so that units*splits covers the threads ~4x over,
    with at least ``min_blocks`` blocks per split. The threads are those the call's work is
    divided for (:func:`loaders.quants.work_threads`): a decode attention that a thread choice
    runs serially splits its blocks, and so sums them, as its parallel run does."""
    target = 4 * quants.work_threads()
    return max(1, min(-(-target // max(n_units, 1)), n_blocks // min_blocks))


# --------------------------------------------------------------------------
# 1. load (the one place that knows how a cached block is stored)
# --------------------------------------------------------------------------


def kv_dims(c):
    """(Hkv, NB, B*D) of a cache operand (float array or quantized tuple); jitted code only."""


@overload(kv_dims)
def _kv_dims_ov(c):
    if isinstance(c, types.BaseTuple):
        def impl(c):
            return c[0].shape[0], c[0].shape[1], c[1].shape[1]
        return impl

    def impl(c):
        return c.shape[0], c.shape[1], c.shape[2]
    return impl


def load_keys(kc, kvh, pb, t0, t1, D, kb, lut):
    """kb[t*D:(t+1)*D] = float32 key of token t of physical block pb (kv head kvh), t in [t0, t1);
    jitted code only (see the overload)."""


@overload(load_keys)
def _load_keys_ov(kc, kvh, pb, t0, t1, D, kb, lut):
    if isinstance(kc, types.BaseTuple):   # quantized: (data, tail, meta), see pyimp.kv.cache
        def impl(kc, kvh, pb, t0, t1, D, kb, lut):
            data, tail, meta = kc
            if pb == meta[0]:
                load_f32(tail[kvh], t0 * D, (t1 - t0) * D, kb, lut)
                return
            nb = D // 32                       # token rows are consecutive blocks
            decode_qblocks(meta[1], data[kvh, pb], t0 * nb * meta[2], (t1 - t0) * nb, kb, t0 * D,
                          1, lut)
        return impl

    def impl(kc, kvh, pb, t0, t1, D, kb, lut):
        load_f32(kc[kvh, pb], t0 * D, (t1 - t0) * D, kb, lut)
    return impl


def values_by_token(vc):
    """True when :func:`load_values` leaves the values token-major (quantized V stored in
    token rows: decoding them channel-major would scatter every element); jitted code only."""


@overload(values_by_token)
def _values_by_token_ov(vc):
    if isinstance(vc, types.BaseTuple):
        def impl(vc):
            return vc[2][3] != 0
        return impl

    def impl(vc):
        return False
    return impl


@jit.njit(fastmath=FM)
def _load_values_float(vrow, t0, t1, D, B, vb, lut):
    if t1 - t0 == B:  # full block: one contiguous decode
        load_f32(vrow, 0, D * B, vb, lut)
    else:
        for d in range(D):
            load_f32(vrow, d * B + t0, t1 - t0, vb, lut)


def load_values(vc, kvh, pb, t0, t1, D, B, vb, lut):
    """The values of tokens t in [t0, t1) of physical block pb as float32: channel-major
    vb[d*B + t] (f16/f32 stores, channel-row quantized V) or token-major vb[t*D + d]
    (token-row quantized V; :func:`values_by_token` tells which); entries outside the
    range may be written too. Jitted code only."""


@overload(load_values)
def _load_values_ov(vc, kvh, pb, t0, t1, D, B, vb, lut):
    if isinstance(vc, types.BaseTuple):
        def impl(vc, kvh, pb, t0, t1, D, B, vb, lut):
            data, tail, meta = vc
            if t1 <= t0:          # a block the masks hide entirely (t0 may lie past B)
                return
            if pb == meta[0]:                  # the float32 tail holds channel rows
                if meta[3]:
                    tr = tail[kvh]
                    for t in range(t0, t1):
                        for d in range(D):
                            vb[t * D + d] = tr[d * B + t]
                else:
                    _load_values_float(tail[kvh], t0, t1, D, B, vb, lut)
                return
            w = data[kvh, pb]
            code, bsz = meta[1], meta[2]
            if meta[3]:                        # rows by token, along head_dim: token-major vb
                nb = D // 32
                decode_qblocks(code, w, t0 * nb * bsz, (t1 - t0) * nb, vb, t0 * D, 1, lut)
            else:                              # rows by channel, along the token axis
                nb = B // 32
                b0, b1 = t0 // 32, (t1 + 31) // 32
                for d in range(D):
                    decode_qblocks(code, w, (d * nb + b0) * bsz, b1 - b0, vb, d * B + b0 * 32, 1, lut)
        return impl

    def impl(vc, kvh, pb, t0, t1, D, B, vb, lut):
        _load_values_float(vc[kvh, pb], t0, t1, D, B, vb, lut)
    return impl


def prefetch_row(c, kvh, pb):
    """Hint the stored row of physical block pb (kv head kvh) into the cache; jitted code only."""


@overload(prefetch_row)
def _prefetch_row_ov(c, kvh, pb):
    if isinstance(c, types.BaseTuple):
        def impl(c, kvh, pb):
            row = c[0][kvh, pb]
            for e in range(0, row.size, 64):
                prefetch(row, e)
        return impl
    step = max(1, 64 // (c.dtype.bitwidth // 8))

    def impl(c, kvh, pb):
        row = c[kvh, pb]
        for e in range(0, row.size, step):
            prefetch(row, e)
    return impl


def f16_store(c):
    """True when c is an fp16 store (uint16 bits) whose block rows can be read in place;
    jitted code only."""


@overload(f16_store)
def _f16_store_ov(c):
    ok = isinstance(c, types.Array) and c.dtype == types.uint16

    def impl(c):
        return ok
    return impl


def f16_row(c, kvh, pb):
    """The stored uint16 row of physical block pb (kv head kvh) of an fp16 store; an empty
    row for other stores (never read: :func:`f16_store` is False). Jitted code only."""


@overload(f16_row)
def _f16_row_ov(c, kvh, pb):
    if isinstance(c, types.Array) and c.dtype == types.uint16:
        def impl(c, kvh, pb):
            return c[kvh, pb]
        return impl

    def impl(c, kvh, pb):
        return np.zeros(0, np.uint16)
    return impl


def f16_rows(c, kvh):
    """The stored uint16 block rows [NB][B*D] of kv head kvh of an fp16 store; an empty 2-D
    array for other stores (never read). Jitted code only."""


@overload(f16_rows)
def _f16_rows_ov(c, kvh):
    if isinstance(c, types.Array) and c.dtype == types.uint16:
        def impl(c, kvh):
            return c[kvh]
        return impl

    def impl(c, kvh):
        return np.zeros((0, 0), np.uint16)
    return impl


# --------------------------------------------------------------------------
# 2. attend, 3. merge
# --------------------------------------------------------------------------


@jit.njit(inline="always")
def dot(a, b, n):
    """sum of a[d] * b[d] for d < n, in lane_dot's fixed order (1-D contiguous arrays)."""
    return lane_dot(a, 0, b, 0, n)


@jit.njit(fastmath=FM)
def block_scores(qh, kb, t0, t1, D, sc, s, m, l, j, br):
    """Scores of tokens [t0, t1) of a loaded block (kb as :func:`key_dot` reads it) into s[t],
    the running max m[j] raised to the block's and the running sum l[j] rescaled; returns
    the factor the partial output must be scaled by (1.0 when the max did not rise)."""
    bm = np.float32(-np.inf)
    hasb = br.size > 0
    for t in range(t0, t1):
        x = key_dot(qh, kb, t, D) * sc
        if hasb:
            x += br[t]
        s[t] = x
        if x > bm:
            bm = x
    alpha = np.float32(1.0)
    if bm > m[j]:
        alpha = np.float32(0.0)
        if m[j] > -np.inf:
            alpha = np.exp(m[j] - bm)
        l[j] *= alpha
        m[j] = bm
    return alpha


@jit.njit(fastmath=FM)
def attend_block(qh, kb, vb, t0, t1, D, B, sc, s, o, m, l, j, vtok, br):
    """Fold tokens [t0, t1) of a loaded block into partial j (m[j], l[j], o [D]) of query qh;
    ``vtok``: vb is token-major (see :func:`load_values`); ``br``: the block's per-slot score
    bias (float32 [B], the log-multiplicity of merged slots) or an empty array (none).

    Leaves ``exp(score - m[j])`` of token t in s[t] (s: float32 [B] scratch).
    """
    alpha = block_scores(qh, kb, t0, t1, D, sc, s, m, l, j, br)
    if alpha != 1.0:
        for d in range(D):
            o[d] *= alpha
    mj = m[j]
    ls = np.float32(0.0)
    for t in range(t0, t1):
        e = np.exp(s[t] - mj)
        s[t] = e
        ls += e
    l[j] += ls
    if vtok:
        for t in range(t0, t1):
            _axpy(s[t], vb[t * D:(t + 1) * D], o, D)
        return
    sv = s[t0:t1]
    for d in range(D):
        o[d] += dot(sv, vb[d * B + t0:d * B + t1], t1 - t0)


@jit.njit(fastmath=FM)
def _axpy(a, x, y, n):
    for d in range(n):
        y[d] += a * x[d]


# Channel-major values (vb[d*B + t], the f16/f32 cache's layout) folded into LANES partial sums
# per channel: o16[d, k] += sum over c of p[c*LANES + k] * v[d, c*LANES + k], a vector FMA per
# channel and LANES tokens. attend_block's o[d] += dot(p, v[d, :]) reduces LANES lanes to one
# number per channel and block (a horizontal sum each time, about two thirds of a decode step's
# attention work); here the lanes are summed once per channel at the end (:func:`lanes_out`).
LANES = 16


@jit.njit(inline="always")
def dot_f16(a, h, ho, n):
    """sum of a[d] * (fp16 value of h[ho + d]) for d < n (h uint16 bits, converted exactly),
    in lane_dot's fixed order."""
    return lane_dot(a, 0, h, ho, n)


# exp of a softmax exponent x = score - running max <= 0, in arithmetic LLVM vectorizes
# (np.exp is a libm call per element: a fifth of a decode step's attention). Cody-Waite
# reduction x = k ln2 + r, |r| <= ln2 / 2, then Cephes' degree-7 expf polynomial: within
# 2 ulp of the exact value (tests/test_attention.py checks it against float64 over the whole
# range); results below 2**-126 (x < -87.33) are 0, -inf gives 0 and NaN gives NaN.
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_MIN = np.float32(-87.33654)
_EXP_P = (np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3),
          np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1))


@jit.njit(inline="always")
def exp_nonpos(x):
    """exp(x) for float32 x <= 0 (see above); jitted code only."""
    xc = max(x, _EXP_MIN)
    k = np.floor(xc * _LOG2E + np.float32(0.5))
    r = xc - k * _LN2_HI
    r = r - k * _LN2_LO
    z = r * r
    p = _EXP_P[0]
    p = p * r + _EXP_P[1]
    p = p * r + _EXP_P[2]
    p = p * r + _EXP_P[3]
    p = p * r + _EXP_P[4]
    p = p * r + _EXP_P[5]
    p = p * z + r + np.float32(1.0)
    e = p * bits_f32(np.uint32((np.int32(k) + np.int32(127)) << np.int32(23)))
    if x != x:
        return x
    return e if x > _EXP_MIN else np.float32(0.0)


def key_dot(qh, kb, t, D):
    """q . key t of kb: float32 scratch (token-major) or a stored f16 block row (uint16 bits,
    converted exactly); jitted code only."""


@overload(key_dot)
def _key_dot_ov(qh, kb, t, D):
    if kb.dtype == types.uint16:
        def impl(qh, kb, t, D):
            return dot_f16(qh, kb, t * D, D)
        return impl

    def impl(qh, kb, t, D):
        return dot(qh, kb[t * D:(t + 1) * D], D)
    return impl


@jit.njit(fastmath=FM)
def attend_block_lanes(qh, kb, vb, t0, t1, D, B, sc, s, o16, m, l, j, br):
    """:func:`attend_block` for channel-major vb with B a multiple of LANES, into the lane
    partials o16 float32 [D * LANES] (channel d's at d * LANES) of partial j. kb and vb are the
    float32 scratch of :func:`load_keys` / :func:`load_values`, or a whole f16 block's stored
    rows (uint16, read in place). The scores, the running max and sum are attend_block's; s[t]
    keeps exp(score - m[j]) for t in [t0, t1) and 0 elsewhere. vb entries outside [t0, t1)
    must be finite (they are multiplied by 0)."""
    alpha = block_scores(qh, kb, t0, t1, D, sc, s, m, l, j, br)
    if alpha != 1.0:
        for i in range(D * LANES):
            o16[i] *= alpha
    mj = m[j]
    for t in range(B):
        s[t] = exp_nonpos(s[t] - mj) if t0 <= t < t1 else np.float32(0.0)
    l[j] += lane_sum(s, 0, B)
    for d in range(D):
        for c in range(0, B, LANES):
            fma16(o16, d * LANES, s, c, vb, d * B + c)


@jit.njit(fastmath=FM)
def lanes_out(o16, o):
    """o[d] = the sum of the LANES partials o16[d * LANES:(d + 1) * LANES], in a fixed
    pairwise order."""
    for d in range(o.shape[0]):
        o[d] = hsum16(o16, d * LANES)


# Grouped decode over fp16 stores: the query heads of a work unit share one kv head, so a
# block's stored keys and values are converted once for all of them. Two passes per group of
# PV_GROUP blocks: the group's scores (the running max raised, the partials rescaled), then
# its values weighted by exp(score - max) with channel-outer loops whose accumulators (two
# 8-lane vectors per head) stay in registers across the group (pv_channel).
# attend_block_lanes instead keeps 16 lanes per channel and head in memory (64 KB for four
# heads of 256 channels, past L1) and converts each block's values once per head: on AVX2
# cores (no 16-wide registers) 4-5 us per 32-token block of Gemma 3; grouped, about 2.
GROUP_HEADS = (1, 2, 4, 8)     # heads per work unit the grouped path takes (literal unrolls)
PV_GROUP = 8     # blocks read together: their values (8 x 16 KB for Gemma 3) stay in L2 between
                 # the passes (16k-slot decode, AMD EPYC znver3, cache cold: 4 blocks 2.4-2.6 ms,
                 # 8 1.8-2.7, 16 2.5-2.9, 32 5-6)


@intrinsic
def row_address(typingctx, row):
    """The address of row[0] (a 1-D array) as an int64, for :func:`pv_channel`; the caller keeps
    the array alive while the address is used."""
    sig = types.int64(row)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.ptrtoint(ary.data, llvm_ir.IntType(64))

    return sig, codegen


@intrinsic
def pv_channel(typingctx, ow, owo, p, ps, addr, nblk, vo, nb, nh):
    """ow[owo + 16g + lane] += sum over blocks k < nblk and 16-token chunks c < nb / 16 of
    p[g*ps + k*nb + 16c + lane'] * v_k[vo + 16c + lane'] (lane' = lane folded as two 8-lane fma
    chains per head: lanes 0-7 take chunk entries 0-7, lanes 8-15 entries 8-15), for g < nh (a
    literal); v_k the fp16 values (uint16 bits) at address addr[k] (:func:`row_address`). The
    accumulators are SSA values across the whole loop (registers), not memory."""
    if not isinstance(nh, types.IntegerLiteral):
        return None
    NH = nh.literal_value
    sig = types.void(ow, owo, p, ps, addr, nblk, vo, nb, nh)

    def codegen(context, builder, signature, args):
        i64 = llvm_ir.IntType(64)
        vf = llvm_ir.VectorType(llvm_ir.FloatType(), 8)
        vh = llvm_ir.VectorType(llvm_ir.IntType(16), 8)
        fma = cgutils.get_or_insert_function(builder.module, llvm_ir.FunctionType(vf, [vf, vf, vf]),
                                             "llvm.fma.v8f32")
        owty, _, pty, _, aty, _, _, _, _ = signature.args
        ow_a = context.make_array(owty)(context, builder, args[0])
        p_a = context.make_array(pty)(context, builder, args[2])
        ad_a = context.make_array(aty)(context, builder, args[4])

        def as64(x):
            return builder.sext(x, i64) if x.type.width < 64 else x
        owo_, ps_, nblk_, vo_, nb_ = (as64(args[1]), as64(args[3]), as64(args[5]), as64(args[6]),
                                      as64(args[7]))
        fptr = llvm_ir.FloatType().as_pointer()
        ow_p = builder.bitcast(ow_a.data, fptr)
        p_p = builder.bitcast(p_a.data, fptr)
        ad_p = builder.bitcast(ad_a.data, i64.as_pointer())
        accs = []
        for g in range(NH):
            for h in range(2):
                slot = cgutils.alloca_once(builder, vf)
                src = builder.gep(ow_p, [builder.add(owo_, llvm_ir.Constant(i64, 16 * g + 8 * h))])
                builder.store(builder.load(builder.bitcast(src, vf.as_pointer()), align=4), slot)
                accs.append(slot)
        nchunk = builder.udiv(nb_, llvm_ir.Constant(i64, 16))
        with cgutils.for_range(builder, nblk_, intp=i64) as outer:
            k = outer.index
            base = builder.inttoptr(builder.load(builder.gep(ad_p, [k])), llvm_ir.IntType(16).as_pointer())
            vrow = builder.gep(base, [vo_])
            prow = builder.gep(p_p, [builder.mul(k, nb_)])
            with cgutils.for_range(builder, nchunk, intp=i64) as inner:
                c16 = builder.mul(inner.index, llvm_ir.Constant(i64, 16))
                vv = []
                for h in range(2):
                    at = builder.gep(vrow, [builder.add(c16, llvm_ir.Constant(i64, 8 * h))])
                    hv = builder.load(builder.bitcast(at, vh.as_pointer()), align=2)
                    vv.append(fpext_half(builder, hv))
                for g in range(NH):
                    pg = builder.gep(prow, [builder.add(builder.mul(ps_, llvm_ir.Constant(i64, g)), c16)])
                    for h in range(2):
                        ph = builder.gep(pg, [llvm_ir.Constant(i64, 8 * h)])
                        pvv = builder.load(builder.bitcast(ph, vf.as_pointer()), align=4)
                        slot = accs[2 * g + h]
                        builder.store(builder.call(fma, [pvv, vv[h], builder.load(slot)]), slot)
        for g in range(NH):
            for h in range(2):
                dst = builder.gep(ow_p, [builder.add(owo_, llvm_ir.Constant(i64, 16 * g + 8 * h))])
                builder.store(builder.load(accs[2 * g + h]), builder.bitcast(dst, vf.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@jit.njit(inline="always")
def _pv_channels(ow, P, PS, addr, nblk, D, B, nh):
    """ow[d*16*nh + 16g + lane] += :func:`pv_channel`'s sums over the nblk blocks whose fp16
    value rows are at addr, for every channel d."""
    W = 16 * nh
    for d in range(D):
        pv_channel(ow, d * W, P, PS, addr, nblk, d * B, B, nh)


@jit.njit(fastmath=FM, inline="always")
def _qk_heads(q, h0, kr, ko, D, nh, sg, so, ss, sc):
    """sg[so + g*ss] = sc * (q[h0 + g] . fp16 key kr[ko:ko + D]) for g < nh (a literal in the
    callers): with four heads or more one :func:`lane_dot_rows` (each key chunk converted once
    for the nh heads, one accumulator chain per head), with fewer a :func:`lane_dot` each (four
    chains per head)."""
    if nh >= 4:
        lane_dot_rows(q, h0, nh, kr, ko, D, sg, so, ss, sc)
    else:
        for g in range(nh):
            sg[so + g * ss] = lane_dot(q[h0 + g], 0, kr, ko, D) * sc


@jit.njit(fastmath=FM)
def attend_split_grouped(q, h0, nh, kc, vc, kvh, bt, sel, si, k_beg, k_end, lo, n_ctx, D, B, sc,
                         bias, hasb, lut, m, l, o, bm, store, probs):
    """The nh query heads h0.. (sharing kv head kvh) over blocks sel[si, k_beg:k_end] of fp16
    stores (B a multiple of 16), PV_GROUP blocks at a time (see GROUP_HEADS): a group's scores,
    then its values weighted by exp(score - running max), the running sum and the output sums
    rescaled when the max rises (a group's keys and values are read together, from memory once).
    m[g], l[g] and o[g, :] receive the split's max, sum of exp(score - max) and output sum;
    with ``store``, bm[g, k - k_beg] = the running max m_k of block k's group and
    probs[h0 + g, k, t] = exp(score - m_k) (0 outside the masks). nh in GROUP_HEADS."""
    nk = k_end - k_beg
    GB = min(nk, PV_GROUP)
    PS = GB * B
    W = 16 * nh
    S = np.empty(nh * PS, np.float32)
    pbs = np.empty(GB, np.int64)
    parts = np.full(GB, -1, np.int64)
    addr = np.empty(GB, np.int64)
    # partial blocks' values, +0.0 elsewhere: at most two per split (the first visible block and
    # the newest), in rows 0 and 1; row 2 stays zero for blocks the masks hide entirely
    vpart = np.zeros((3, D * B), np.uint16)
    kb = np.empty(B * D, np.float32)
    vrows = f16_rows(vc, kvh)
    ow = np.zeros(D * W, np.float32)
    for g in range(nh):
        m[g] = -np.inf
        l[g] = 0.0
    for k0 in range(k_beg, k_end, GB):
        k1 = min(k0 + GB, k_end)
        npart = 0
        for kk in range(k1 - k0):                 # the group's scores
            base = sel[si, k0 + kk] * B
            pb = bt[sel[si, k0 + kk]]
            pbs[kk] = pb
            if kk + 1 < k1 - k0:
                prefetch_row(kc, kvh, bt[sel[si, k0 + kk + 1]])
            prefetch_row(vc, kvh, pb)
            t0 = max(lo - base, 0)
            t1 = max(min(n_ctx - base, B), t0)
            kr = f16_row(kc, kvh, pb)
            j = -1
            if t1 <= t0:
                j = 2
            elif t0 > 0 or t1 < B:                # first visible or newest block: copied
                j = npart % 2
                npart += 1
                load_keys(kc, kvh, pb, t0, t1, D, kb, lut)
                vr = vrows[pb]
                vp = vpart[j]
                vp[:] = 0
                for d in range(D):      # element by element: a slice copy compiles numba's
                    for t in range(t0, t1):     # shape-mismatch message (str formatting, ~3 s)
                        vp[d * B + t] = vr[d * B + t]
            parts[kk] = j
            if j < 0:                             # a whole stored block: keys read in place
                for t in range(B):
                    if nh == 1:
                        _qk_heads(q, h0, kr, t * D, D, 1, S, kk * B + t, PS, sc)
                    elif nh == 2:
                        _qk_heads(q, h0, kr, t * D, D, 2, S, kk * B + t, PS, sc)
                    elif nh == 4:
                        _qk_heads(q, h0, kr, t * D, D, 4, S, kk * B + t, PS, sc)
                    else:
                        _qk_heads(q, h0, kr, t * D, D, 8, S, kk * B + t, PS, sc)
            for g in range(nh):
                qh = q[h0 + g]
                sg = S[g * PS + kk * B:g * PS + (kk + 1) * B]
                for t in range(B):
                    if t < t0 or t >= t1:
                        sg[t] = -np.inf
                        continue
                    x = dot(qh, kb[t * D:(t + 1) * D], D) * sc if j >= 0 else sg[t]
                    if hasb:
                        x += bias[pb, t]
                    sg[t] = x
        n_s = (k1 - k0) * B
        for g in range(nh):                       # running max and sum, weights
            sg = S[g * PS:g * PS + n_s]
            gm = np.float32(-np.inf)
            for i in range(n_s):
                if sg[i] > gm:
                    gm = sg[i]
            if gm > m[g]:
                alpha = np.float32(0.0) if m[g] == -np.inf else np.exp(m[g] - gm)
                if m[g] > -np.inf:
                    l[g] *= alpha
                    for d in range(D):
                        for i in range(16):
                            ow[d * W + 16 * g + i] *= alpha
                m[g] = gm
            mg = m[g]
            if mg > -np.inf:
                for i in range(n_s):
                    sg[i] = exp_nonpos(sg[i] - mg)
                l[g] += lane_sum(sg, 0, n_s)
            else:
                sg[:] = 0.0
            if store:
                for kk in range(k1 - k0):
                    bm[g, k0 + kk - k_beg] = mg
                    for t in range(B):
                        probs[h0 + g, k0 + kk, t] = sg[kk * B + t]
        for kk in range(k1 - k0):                 # the group's values
            addr[kk] = row_address(vrows[pbs[kk]] if parts[kk] < 0 else vpart[parts[kk]])
        if nh == 1:
            _pv_channels(ow, S, PS, addr, k1 - k0, D, B, 1)
        elif nh == 2:
            _pv_channels(ow, S, PS, addr, k1 - k0, D, B, 2)
        elif nh == 4:
            _pv_channels(ow, S, PS, addr, k1 - k0, D, B, 4)
        else:
            _pv_channels(ow, S, PS, addr, k1 - k0, D, B, 8)
    for g in range(nh):
        for d in range(D):
            o[g, d] = hsum16(ow, d * W + 16 * g)


@jit.njit(fastmath=FM)
def merge_splits(m_part, l_part, o_part, out, lse, M, L):
    """Merge per-split partials [Hq, nsplit] into out [Hq, D] (normalized), lse [Hq] and the
    merged max M / sum L [Hq] (serial: Hq*nsplit*D work)."""
    Hq, nsplit, D = o_part.shape
    for h in range(Hq):
        mh = np.float32(-np.inf)
        for sp in range(nsplit):
            if m_part[h, sp] > mh:
                mh = m_part[h, sp]
        lh = np.float32(0.0)
        out[h, :] = 0.0
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


# --------------------------------------------------------------------------
# 4. kernels
# --------------------------------------------------------------------------


def decode_blocks(q, kc, vc, bt, n_ctx, scale, window, lut, sel, cnt, nsplit, out, lse, store,
                  probs, bias):
    """Decode attention of q [Hq, D] (position n_ctx - 1) over the logical blocks sel[si, :cnt[si]]
    of head set si (query head h uses set ``h // (Hq // nsets)``); blocks of a set are distinct.

    Work item = (unit, split of its blocks); a unit is the query heads of one kv head that share
    a set (G heads with one set per kv head or fewer, one head per set otherwise). With ``store``,
    probs [Hq, K, B] receives P of token t of the k-th block of h's set (0 outside the masks).
    ``bias``: float32 [NB][B] added to the score of the token in each physical slot (merged
    slots' log-multiplicity, :mod:`pyimp.kv.merge`), or shape (0, B): none.

    Two kernels share this contract, and a call compiles only the one it runs (each is most of
    a first run's compile time): fp16 stores with B a multiple of 16 and a unit of 1, 2, 4 or 8
    heads take :func:`decode_grouped` (:func:`attend_split_grouped`); every other store takes
    :func:`decode_folded`, which folds blocks one by one (online softmax).
    """
    grouped = False
    if (isinstance(kc, np.ndarray) and isinstance(vc, np.ndarray)
            and kc.dtype == vc.dtype == np.uint16):
        Hq, D = q.shape                    # fp16 stores: B and the unit as _decode_dims has them
        nh = min(Hq // sel.shape[0], Hq // kc.shape[0])
        grouped = kc.shape[2] // D % 16 == 0 and nh in GROUP_HEADS
    kernel = decode_grouped if grouped else decode_folded
    kernel(q, kc, vc, bt, n_ctx, scale, window, lut, sel, cnt, nsplit, out, lse, store, probs,
           bias)


@jit.njit(inline="always")
def _decode_dims(q, kc, sel, n_ctx, window, scale):
    """The decode kernels' sizes: block length B, query heads per kv head G, heads per set hps,
    heads per work unit nh, first visible slot lo, float32 scale."""
    Hq, D = q.shape
    Hkv, _, BD = kv_dims(kc)
    G = Hq // Hkv
    hps = Hq // sel.shape[0]
    lo = max(0, n_ctx - window) if window > 0 else 0
    return BD // D, G, hps, min(hps, G), lo, np.float32(scale)


@jit.njit
def _decode_partials(Hq, nsplit, D, Kw):
    """Per-split partials (max -inf, sum 0, output 0) and the block maxima of the decode kernels.
    Not inlined: in a parallel kernel each of these fills would become a parfor of its own (a
    gufunc compiled on a first run) for a few hundred elements."""
    return (np.full((Hq, nsplit), -np.inf, np.float32), np.zeros((Hq, nsplit), np.float32),
            np.zeros((Hq, nsplit, D), np.float32), np.empty((Hq, Kw), np.float32))


@jit.njit(inline="always")
def _work_item(w, nsplit, nh, G, hps, cnt):
    """Work item w of a decode kernel: (first head h0, split sp, kv head, head set, the split's
    block range [k_beg, k_end) of the set's cnt[si] blocks)."""
    h0, sp = (w // nsplit) * nh, w % nsplit
    si = h0 // hps
    per = (cnt[si] + nsplit - 1) // nsplit
    k_beg = sp * per
    return h0, sp, h0 // G, si, k_beg, min(cnt[si], k_beg + per)


@jit.njit
def _online_state(n, D):
    """Online-softmax state of n rows: running max -inf, sum 0, output sums 0. A function of
    its own: inside a parallel kernel these fills would each be a nested parfor to compile."""
    return np.full(n, -np.inf, np.float32), np.zeros(n, np.float32), np.zeros((n, D), np.float32)


@jit.njit(parallel=True, fastmath=FM)
def decode_grouped(q, kc, vc, bt, n_ctx, scale, window, lut, sel, cnt, nsplit, out, lse, store,
                   probs, bias):
    """:func:`decode_blocks` over fp16 stores, B a multiple of 16, units of 1, 2, 4 or 8 heads
    (its caller checks): each split through :func:`attend_split_grouped`."""
    Hq, D = q.shape
    B, G, hps, nh, lo, sc = _decode_dims(q, kc, sel, n_ctx, window, scale)
    hasb = bias.shape[0] > 0
    m_part, l_part, o_part, bmax = _decode_partials(Hq, nsplit, D, sel.shape[1])
    for w in prange(Hq // nh * nsplit):
        h0, sp, kvh, si, k_beg, k_end = _work_item(w, nsplit, nh, G, hps, cnt)
        mg = np.empty(nh, np.float32)
        lg = np.empty(nh, np.float32)
        og = np.empty((nh, D), np.float32)
        bg = np.empty((nh, max(k_end - k_beg, 1)), np.float32)
        if k_end > k_beg:
            attend_split_grouped(q, h0, nh, kc, vc, kvh, bt, sel, si, k_beg, k_end, lo, n_ctx,
                                 D, B, sc, bias, hasb, lut, mg, lg, og, bg, store, probs)
        else:                    # loops, not slice fills: those would be nested parfors
            for g in range(nh):
                mg[g] = -np.inf
                lg[g] = 0.0
                for d in range(D):
                    og[g, d] = 0.0
        for g in range(nh):
            m_part[h0 + g, sp] = mg[g]
            l_part[h0 + g, sp] = lg[g]
            for d in range(D):
                o_part[h0 + g, sp, d] = og[g, d]
            if store:
                for k in range(k_beg, k_end):
                    bmax[h0 + g, k] = bg[g, k - k_beg]
    _merge_and_scale(m_part, l_part, o_part, out, lse, store, probs, bmax, sel, cnt, hps, lo,
                     n_ctx, B)


@jit.njit(parallel=True, fastmath=FM)
def decode_folded(q, kc, vc, bt, n_ctx, scale, window, lut, sel, cnt, nsplit, out, lse, store,
                  probs, bias):
    """:func:`decode_blocks` over any store: blocks folded one by one into each head's running
    partial (:func:`attend_block`; full fp16 blocks of channel-major stores with B a multiple
    of LANES read in place by :func:`attend_block_lanes`)."""
    Hq, D = q.shape
    B, G, hps, nh, lo, sc = _decode_dims(q, kc, sel, n_ctx, window, scale)
    vtok = values_by_token(vc)
    hasb = bias.shape[0] > 0
    nob = np.empty(0, np.float32)         # not np.zeros: a parfor (a gufunc to compile) for nothing
    m_part, l_part, o_part, bmax = _decode_partials(Hq, nsplit, D, sel.shape[1])
    lanes = not vtok and B % LANES == 0      # channel-major values: lane partials
    for w in prange(Hq // nh * nsplit):
        h0, sp, kvh, si, k_beg, k_end = _work_item(w, nsplit, nh, G, hps, cnt)
        kb = np.empty(B * D, np.float32)
        vb = np.zeros(D * B, np.float32)        # entries no block loaded are multiplied by 0
        s = np.empty((nh, B), np.float32)
        m, l, o = _online_state(nh, D)
        o16 = np.zeros((nh if lanes else 0, D * LANES), np.float32)
        for k in range(k_beg, k_end):
            if k + 1 < k_end:  # physical blocks need not be adjacent: prefetch the next one
                prefetch_row(kc, kvh, bt[sel[si, k + 1]])
                prefetch_row(vc, kvh, bt[sel[si, k + 1]])
            base = sel[si, k] * B
            t0 = max(lo - base, 0)
            t1 = max(min(n_ctx - base, B), t0)  # a fully masked block is an empty range
            br = bias[bt[sel[si, k]]] if hasb else nob
            if lanes and t0 == 0 and t1 == B and f16_store(kc) and f16_store(vc):
                kr = f16_row(kc, kvh, bt[sel[si, k]])      # every slot written: read in place
                vr = f16_row(vc, kvh, bt[sel[si, k]])
                for g in range(nh):
                    attend_block_lanes(q[h0 + g], kr, vr, 0, B, D, B, sc, s[g], o16[g], m, l,
                                       g, br)
                    if store:
                        bmax[h0 + g, k] = m[g]
                        for t in range(B):
                            probs[h0 + g, k, t] = s[g, t]
                continue
            load_keys(kc, kvh, bt[sel[si, k]], t0, t1, D, kb, lut)
            load_values(vc, kvh, bt[sel[si, k]], t0, t1, D, B, vb, lut)
            for g in range(nh):
                if lanes:
                    attend_block_lanes(q[h0 + g], kb, vb, t0, t1, D, B, sc, s[g], o16[g], m, l,
                                       g, br)
                else:
                    attend_block(q[h0 + g], kb, vb, t0, t1, D, B, sc, s[g], o[g], m, l, g, vtok,
                                 br)
                if store:
                    bmax[h0 + g, k] = m[g]
                    for t in range(t0, t1):
                        probs[h0 + g, k, t] = s[g, t]
        if lanes:
            for g in range(nh):
                lanes_out(o16[g], o[g])
        for g in range(nh):
            m_part[h0 + g, sp] = m[g]
            l_part[h0 + g, sp] = l[g]
            for d in range(D):
                o_part[h0 + g, sp, d] = o[g, d]
    _merge_and_scale(m_part, l_part, o_part, out, lse, store, probs, bmax, sel, cnt, hps, lo,
                     n_ctx, B)


@jit.njit(parallel=True, fastmath=FM)
def _merge_and_scale(m_part, l_part, o_part, out, lse, store, probs, bmax, sel, cnt, hps, lo,
                     n_ctx, B):
    """The decode kernels' last step: merge the splits' partials into out and lse and, with
    ``store``, turn probs' exp(s - block max) into P (zero outside the masks and past cnt)."""
    Hq = out.shape[0]
    M = np.empty(Hq, np.float32)
    L = np.empty(Hq, np.float32)
    merge_splits(m_part, l_part, o_part, out, lse, M, L)
    if store:
        for h in prange(Hq):
            si = h // hps
            for k in range(sel.shape[1]):
                pk = probs[h, k]
                t0, t1 = 0, 0
                if k < cnt[si]:
                    t0 = max(lo - sel[si, k] * B, 0)
                    t1 = min(n_ctx - sel[si, k] * B, B)
                f = np.float32(0.0)
                if t1 > t0 and L[h] > 0.0 and bmax[h, k] > -np.inf:
                    f = np.exp(bmax[h, k] - M[h]) / L[h]
                for t in range(B):
                    pk[t] = pk[t] * f if t0 <= t < t1 else 0.0


@jit.njit(parallel=True, fastmath=FM)
def prefill(q, kc, vc, bt, s0, scale, rlo, lut, tile, out, row_m, row_l, bias):
    """Flash-style prefill of query rows in slots s0.. (row r sees slots rlo[r] .. s0 + r):
    work item = (query-row tile, kv head), online softmax over blocks; ``bias`` as
    :func:`decode_blocks`."""
    T, Hq, D = q.shape
    Hkv, _, BD = kv_dims(kc)
    B = BD // D
    G = Hq // Hkv
    ntile = (T + tile - 1) // tile
    sc = np.float32(scale)
    vtok = values_by_token(vc)
    hasb = bias.shape[0] > 0
    nob = np.empty(0, np.float32)         # not np.zeros: a parfor (a gufunc to compile) for nothing
    for w in prange(ntile * Hkv):
        # pair cheap early tiles with expensive late ones across the static thread split
        j = w // Hkv
        kvh = w - j * Hkv
        it = j // 2 if j % 2 == 0 else ntile - 1 - j // 2
        i0 = it * tile
        R = min(T, i0 + tile) - i0
        p_hi = s0 + i0 + R - 1
        p_lo = rlo[i0]                      # rows' first visible slots never decrease
        kb = np.empty(B * D, np.float32)
        vb = np.empty(D * B, np.float32)
        s = np.empty((R * G, B), np.float32)
        m, l, o = _online_state(R * G, D)
        for lb in range(p_lo // B, p_hi // B + 1):
            base = lb * B
            t0 = max(p_lo - base, 0)
            t1 = min(p_hi - base + 1, B)
            load_keys(kc, kvh, bt[lb], t0, t1, D, kb, lut)
            load_values(vc, kvh, bt[lb], t0, t1, D, B, vb, lut)
            br = bias[bt[lb]] if hasb else nob
            for r in range(R):
                tt0, tt1 = _row_range(rlo[i0 + r], s0 + i0 + r, base, t0, t1)
                for g in range(G):
                    if tt0 < tt1:
                        attend_block(q[i0 + r, kvh * G + g], kb, vb, tt0, tt1, D, B, sc,
                                     s[r * G + g], o[r * G + g], m, l, r * G + g, vtok, br)
        for r in range(R):
            for g in range(G):
                jj = r * G + g
                inv = np.float32(1.0) / l[jj]
                for d in range(D):
                    out[i0 + r, kvh * G + g, d] = o[jj, d] * inv
                row_m[i0 + r, kvh * G + g] = m[jj]
                row_l[i0 + r, kvh * G + g] = l[jj]


@jit.njit
def _row_range(lo, sq, base, t0, t1):
    """Rows of [t0, t1) (block starting at slot base) that the query in slot sq sees when its
    first visible slot is lo."""
    return max(lo - base, t0), min(sq - base + 1, t1)


@jit.njit(parallel=True, fastmath=FM)
def prefill_mass(q, kc, bt, s0, scale, rlo, lut, row_m, row_l, r0, new, bias):
    """new[h, s] = sum over rows r >= r0 of P[r, h, s], for slots s >= rlo[r0] (rows in slots
    s0.., row r sees slots rlo[r] .. s0 + r).

    Recomputes the scores of the observed rows per key block (work item =
    (kv head, key block), so every output element has exactly one writer); ``bias`` as
    :func:`decode_blocks`.
    """
    T, Hq, D = q.shape
    Hkv, _, BD = kv_dims(kc)
    B = BD // D
    G = Hq // Hkv
    n = s0 + T
    p_lo = rlo[r0]
    lbA = p_lo // B
    nb = (n + B - 1) // B - lbA
    sc = np.float32(scale)
    hasb = bias.shape[0] > 0
    for w in prange(Hkv * nb):
        kvh = w // nb
        base = (lbA + w - kvh * nb) * B
        t0 = max(p_lo - base, 0)
        t1 = min(n - base, B)
        kb = np.empty(B * D, np.float32)
        load_keys(kc, kvh, bt[base // B], t0, t1, D, kb, lut)
        bb = np.zeros(B, np.float32)
        if hasb:
            bb[:] = bias[bt[base // B]]
        acc = np.zeros((G, B), np.float32)
        for r in range(r0, T):
            tt0, tt1 = _row_range(rlo[r], s0 + r, base, t0, t1)
            for g in range(G):
                h = kvh * G + g
                inv = np.float32(1.0) / row_l[r, h]
                for t in range(tt0, tt1):
                    acc[g, t] += np.exp(dot(q[r, h], kb[t * D:(t + 1) * D], D) * sc + bb[t]
                                        - row_m[r, h]) * inv
        for g in range(G):
            for t in range(t0, t1):
                new[kvh * G + g, base + t] = acc[g, t]


@jit.njit(fastmath=FM)
def gather_tile(kc, vc, bt, kvh, c0, c1, D, lut, Kt, Vt):
    """Keys and values of slots [c0, c1) of kv head kvh (c0 a multiple of the block length) as
    float32 rows: Kt[s - c0] and Vt[s - c0] ``[D]`` (token-major both: the operands of the
    tiled prefill's two matrix products). Bounded scratch: one chunk of slots."""
    Hkv, _, BD = kv_dims(kc)
    B = BD // D
    vtok = values_by_token(vc)
    kb = np.empty(B * D, np.float32)
    vb = np.empty(D * B, np.float32)
    for lb in range(c0 // B, (c1 + B - 1) // B):
        base = lb * B
        t1 = min(c1 - base, B)
        load_keys(kc, kvh, bt[lb], 0, t1, D, kb, lut)
        load_values(vc, kvh, bt[lb], 0, t1, D, B, vb, lut)
        for t in range(t1):
            r = base - c0 + t
            for d in range(D):
                Kt[r, d] = kb[t * D + d]
            if vtok:
                for d in range(D):
                    Vt[r, d] = vb[t * D + d]
            else:
                for d in range(D):
                    Vt[r, d] = vb[d * B + t]
