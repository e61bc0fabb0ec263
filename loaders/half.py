"""fp16 <-> fp32 conversions for jitted code: in hardware (IR fpext / fptrunc of half,
F16C's vcvtph2ps / vcvtps2ph on x86), or in integer IR on an x86 target without F16C, with
the same values; :func:`fma16`, a 16-lane FMA whose operands may be fp16; and sums in a fixed
order that LLVM cannot change (:func:`lane_dot`, :func:`lane_sum`, :func:`lane_dot_rows`,
:func:`hsum16`, with NumPy references). Used by the float matvecs (F16 weights) and pyimp's KV
cache and attention kernels."""
from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir as llvm_ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import jit

X86_64 = platform.machine().lower() in ("x86_64", "amd64")
# the features Numba compiles for (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES honoured), not the host's
FEATURES = jit.target_features()

# fp16 <-> fp32 conversions in hardware: IR fpext / fptrunc of half. An x86 target without
# F16C (NUMBA_CPU_NAME=generic, a portable cache, compiles for baseline x86-64) has no such
# instruction: LLVM calls a runtime helper that Numba's JIT does not provide, and the process
# crashed on its first KV write. There the conversions are integer IR (_half_to_float_soft,
# _float_to_half_soft: the same values, tested against NumPy on every fp16 pattern).
HALF_IN_HARDWARE = not X86_64 or "f16c" in FEATURES


def _splat(ty, value):
    """The constant ``value`` of an IR scalar type, or in every lane of a vector type."""
    if isinstance(ty, llvm_ir.VectorType):
        return llvm_ir.Constant(ty, [value] * ty.count)
    return llvm_ir.Constant(ty, value)


def _half_to_float_soft(builder, hv):
    """fp16 bits (i16 or <N x i16>) -> their float values (float or <N x float>), exactly, with
    integer IR and one multiply: the exponent and mantissa shifted into a float's places are
    the value times 2^-112 (fp16 subnormals become float subnormals: exact, with no flush to
    zero), so one multiply by 2^112 rebiases them; inf and NaN keep their payload, NaN quieted
    (as vcvtph2ps does)."""
    n = hv.type.count if isinstance(hv.type, llvm_ir.VectorType) else None
    ity = llvm_ir.IntType(32) if n is None else llvm_ir.VectorType(llvm_ir.IntType(32), n)
    fty = llvm_ir.FloatType() if n is None else llvm_ir.VectorType(llvm_ir.FloatType(), n)
    c = lambda v: _splat(ity, v)        # noqa: E731
    h = builder.zext(hv, ity)
    sign = builder.shl(builder.and_(h, c(0x8000)), c(16))
    em = builder.and_(h, c(0x7FFF))
    shifted = builder.shl(em, c(13))
    finite = builder.bitcast(builder.fmul(builder.bitcast(shifted, fty), _splat(fty, 2.0 ** 112)), ity)
    special = builder.or_(shifted, c(0x7F800000))
    special = builder.select(builder.icmp_unsigned(">", em, c(0x7C00)),
                             builder.or_(special, c(0x00400000)), special)
    bits = builder.select(builder.icmp_unsigned(">=", em, c(0x7C00)), special, finite)
    return builder.bitcast(builder.or_(bits, sign), fty)


def _float_to_half_soft(builder, f):
    """float -> fp16 bits (i16), rounded to nearest even, with integer IR and one add: past
    the largest finite fp16 (rounding included) inf; NaN quieted with its payload's top bits
    (as vcvtps2ph does); below 2^-14 the fp16 subnormal that adding 0.5 rounds to (the float
    add rounds at fp16's subnormal step); elsewhere the rebiased bits plus the rounding
    increment 0xfff + the kept mantissa's last bit, shifted down."""
    i32 = llvm_ir.IntType(32)
    c = lambda v: llvm_ir.Constant(i32, v)        # noqa: E731
    b = builder.bitcast(f, i32)
    sign = builder.lshr(builder.and_(b, c(0x80000000)), c(16))
    a = builder.and_(b, c(0x7FFFFFFF))
    nan = builder.or_(c(0x7E00), builder.and_(builder.lshr(a, c(13)), c(0x3FF)))
    big = builder.select(builder.icmp_unsigned(">", a, c(0x7F800000)), nan, c(0x7C00))
    half_f = llvm_ir.Constant(llvm_ir.FloatType(), 0.5)
    sub = builder.sub(builder.bitcast(builder.fadd(builder.bitcast(a, llvm_ir.FloatType()), half_f),
                                      i32), c(0x3F000000))
    odd = builder.and_(builder.lshr(a, c(13)), c(1))
    norm = builder.lshr(builder.add(builder.add(a, c(0xC8000FFF)), odd), c(13))
    o = builder.select(builder.icmp_unsigned(">=", a, c(0x47800000)), big,
                       builder.select(builder.icmp_unsigned("<", a, c(0x38800000)), sub, norm))
    return builder.trunc(builder.or_(o, sign), llvm_ir.IntType(16))


def fpext_half(builder, hv):
    """fp16 bits (i16 or <N x i16>) -> float values: fpext where the target converts in
    hardware (HALF_IN_HARDWARE), else :func:`_half_to_float_soft`."""
    if not HALF_IN_HARDWARE:
        return _half_to_float_soft(builder, hv)
    if isinstance(hv.type, llvm_ir.VectorType):
        n = hv.type.count
        return builder.fpext(builder.bitcast(hv, llvm_ir.VectorType(llvm_ir.HalfType(), n)),
                             llvm_ir.VectorType(llvm_ir.FloatType(), n))
    return builder.fpext(builder.bitcast(hv, llvm_ir.HalfType()), llvm_ir.FloatType())


@intrinsic
def half_bits_to_f32(typingctx, h):
    """fp16 bit pattern (uint16) -> its float32 value, exactly (IR fpext from half: the
    conversion loops vectorize to vcvtph2ps on x86 with F16C, where a 65536-entry table
    lookup stays a scalar gather per element)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return fpext_half(builder, args[0])

    return sig, codegen


@intrinsic
def f32_to_half_bits(typingctx, f):
    """float32 -> fp16 bit pattern (uint16), rounded to nearest even as NumPy's astype(float16)
    (IR fptrunc to half: vcvtps2ph on x86 with F16C)."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        if not HALF_IN_HARDWARE:
            return _float_to_half_soft(builder, args[0])
        half = builder.fptrunc(args[0], llvm_ir.HalfType())
        return builder.bitcast(half, llvm_ir.IntType(16))

    return sig, codegen


@intrinsic
def fma16(typingctx, o, oo, a, ao, b, bo):
    """o[oo:oo+16] = fma(a[ao:ao+16], b[bo:bo+16], o[oo:oo+16]) as one <16 x float> operation,
    the scalar llvm.fma.f32 lane for lane (1-D arrays, no bounds check; o float32, a and b
    float32 or uint16 fp16 bits, converted exactly): LLVM leaves a 16-trip loop over arrays
    it cannot prove apart scalar."""
    sig = types.void(o, oo, a, ao, b, bo)

    def codegen(context, builder, signature, args):
        vf = llvm_ir.VectorType(llvm_ir.FloatType(), 16)
        fn = _fma_fns(builder)[0]

        def operand(k):         # (operand k as <16 x float>, its float pointer or None)
            aryty = signature.args[2 * k]
            ary = context.make_array(aryty)(context, builder, args[2 * k])
            p = cgutils.get_item_pointer(context, builder, aryty, ary, [args[2 * k + 1]],
                                         wraparound=False)
            if aryty.dtype == types.uint16:
                hv = builder.load(builder.bitcast(p, llvm_ir.VectorType(llvm_ir.IntType(16), 16).as_pointer()),
                                  align=2)
                return fpext_half(builder, hv), None
            fp = builder.bitcast(p, vf.as_pointer())
            return builder.load(fp, align=4), fp
        ov, po = operand(0)
        builder.store(builder.call(fn, [operand(1)[0], operand(2)[0], ov]), po, align=4)
        return context.get_dummy_value()

    return sig, codegen


# Reductions in a fixed order. LLVM vectorizes a sum only when allowed to reassociate it, and
# reassociation lets each optimization of the same code pick its own order: a kernel compiled
# in this process and the same kernel loaded from Numba's cache then sum differently. These
# intrinsics write the vector order out in IR (no fast-math flags), so every compilation sums
# alike: 16-lane FMAs into four accumulators (16-element chunk c into accumulator c % 4 for
# the whole groups of four chunks, the remaining chunks into accumulator 0), the accumulators
# added as (0 + 1) + (2 + 3), the 16 lanes by halving (lane i + lane i + 8, then + 4, + 2,
# + 1: :func:`hsum16`'s order), then the elements past the last whole chunk in index order.

def _operand_ptr(context, builder, aryty, ary_val, idx):
    """(pointer to ary[idx], True when its elements are fp16 bits) of a 1-D array operand."""
    ary = context.make_array(aryty)(context, builder, ary_val)
    return (cgutils.get_item_pointer(context, builder, aryty, ary, [idx], wraparound=False),
            aryty.dtype == types.uint16)


def _load_lanes(builder, ptr, is_half, idx, n):
    """Elements idx..idx+n-1 (n 1: a scalar) of a float32 or fp16-bits pointer, as float."""
    at = builder.gep(ptr, [idx])
    if n == 1:
        v = builder.load(at)
    else:
        ety = llvm_ir.IntType(16) if is_half else llvm_ir.FloatType()
        v = builder.load(builder.bitcast(at, llvm_ir.VectorType(ety, n).as_pointer()),
                         align=2 if is_half else 4)
    return fpext_half(builder, v) if is_half else v


def _hsum16_ir(builder, v):
    """The 16 lanes of <16 x float> v added by halving (see above)."""
    n = 16
    while n > 1:
        n //= 2
        mask = llvm_ir.VectorType(llvm_ir.IntType(32), n)
        lo = builder.shuffle_vector(v, v, llvm_ir.Constant(mask, list(range(n))))
        hi = builder.shuffle_vector(v, v, llvm_ir.Constant(mask, list(range(n, 2 * n))))
        v = builder.fadd(lo, hi)
    return builder.extract_element(v, llvm_ir.Constant(llvm_ir.IntType(32), 0))


def _fma_fns(builder):
    """The module's llvm.fma declarations: (<16 x float> fma, float fma)."""
    f32 = llvm_ir.FloatType()
    vf = llvm_ir.VectorType(f32, 16)
    return (cgutils.get_or_insert_function(builder.module, llvm_ir.FunctionType(vf, [vf, vf, vf]),
                                           "llvm.fma.v16f32"),
            cgutils.get_or_insert_function(builder.module, llvm_ir.FunctionType(f32, [f32, f32, f32]),
                                           "llvm.fma.f32"))


def _zero_slots(builder, ty, count):
    """``count`` stack slots of IR type ``ty`` (a float or float vector), each holding zero."""
    zero = llvm_ir.Constant(ty, [0.0] * ty.count) if isinstance(ty, llvm_ir.VectorType) else \
        llvm_ir.Constant(ty, 0.0)
    slots = []
    for _ in range(count):
        slot = cgutils.alloca_once(builder, ty)
        builder.store(zero, slot)
        slots.append(slot)
    return slots


def _count(builder, n):
    """An element count as i64, a negative one taken as 0."""
    n = _as_i64(builder, n)
    zero = llvm_ir.Constant(llvm_ir.IntType(64), 0)
    return builder.select(builder.icmp_signed("<", n, zero), zero, n)


def _fixed_order_reduce(context, builder, operands, n):
    """sum over i < n of the product of the operands' element i (one operand: the elements
    themselves), in the fixed order above; operands: (pointer, is_half) at element 0; n an
    integer IR value."""
    i64 = llvm_ir.IntType(64)
    f32 = llvm_ir.FloatType()
    fma_v, fma_s = _fma_fns(builder)
    k = lambda v: llvm_ir.Constant(i64, v)       # noqa: E731
    n = _count(builder, n)
    n16 = builder.udiv(n, k(16))
    n64 = builder.udiv(n16, k(4))
    accs = _zero_slots(builder, llvm_ir.VectorType(f32, 16), 4)

    def fold(slot, idx, width):
        xs = [_load_lanes(builder, p, h, idx, width) for p, h in operands]
        acc = builder.load(slot)
        if len(xs) == 1:
            builder.store(builder.fadd(acc, xs[0]), slot)
        else:
            builder.store(builder.call(fma_v if width > 1 else fma_s, [xs[0], xs[1], acc]), slot)

    with cgutils.for_range(builder, n64, intp=i64) as loop:
        base = builder.mul(loop.index, k(64))
        for j in range(4):
            fold(accs[j], builder.add(base, k(16 * j)), 16)
    with cgutils.for_range(builder, builder.sub(n16, builder.mul(n64, k(4))), intp=i64) as loop:
        fold(accs[0], builder.add(builder.mul(n64, k(64)), builder.mul(loop.index, k(16))), 16)
    a = [builder.load(s) for s in accs]
    total = cgutils.alloca_once(builder, f32)
    builder.store(_hsum16_ir(builder, builder.fadd(builder.fadd(a[0], a[1]), builder.fadd(a[2], a[3]))),
                  total)
    with cgutils.for_range(builder, builder.sub(n, builder.mul(n16, k(16))), intp=i64) as loop:
        fold(total, builder.add(builder.mul(n16, k(16)), loop.index), 1)
    return builder.load(total)


def _contiguous(*arys):
    """True when every operand is a C-contiguous array (the vector loads read consecutive
    elements); the intrinsics refuse other operands at typing time."""
    return all(isinstance(t, types.Array) and t.layout == "C" for t in arys)


def _as_i64(builder, v):
    return builder.sext(v, llvm_ir.IntType(64)) if v.type.width < 64 else v


@intrinsic
def lane_dot(typingctx, a, ao, b, bo, n):
    """sum of a[ao + i] * b[bo + i] for i < n, in the fixed order above, the same bits however
    the calling kernel is optimized (1-D contiguous arrays, no bounds check; float32 or uint16
    fp16 bits, converted exactly)."""
    if not _contiguous(a, b):
        return None
    sig = types.float32(a, ao, b, bo, n)

    def codegen(context, builder, signature, args):
        ta, _, tb, _, _ = signature.args
        ops = [_operand_ptr(context, builder, ta, args[0], args[1]),
               _operand_ptr(context, builder, tb, args[2], args[3])]
        return _fixed_order_reduce(context, builder, ops, args[4])

    return sig, codegen


@intrinsic
def lane_sum(typingctx, x, xo, n):
    """sum of x[xo + i] for i < n, in the fixed order above (as :func:`lane_dot`)."""
    if not _contiguous(x):
        return None
    sig = types.float32(x, xo, n)

    def codegen(context, builder, signature, args):
        ops = [_operand_ptr(context, builder, signature.args[0], args[0], args[1])]
        return _fixed_order_reduce(context, builder, ops, args[2])

    return sig, codegen


@intrinsic
def hsum16(typingctx, x, xo):
    """x[xo] + ... + x[xo + 15] added by halving (lane i + lane i + 8, then + 4, + 2, + 1), as
    one vector sequence (float32 1-D array, no bounds check)."""
    if not _contiguous(x):
        return None
    sig = types.float32(x, xo)

    def codegen(context, builder, signature, args):
        p, h = _operand_ptr(context, builder, signature.args[0], args[0], args[1])
        return _hsum16_ir(builder, _load_lanes(builder, p, h, llvm_ir.Constant(llvm_ir.IntType(64), 0), 16))

    return sig, codegen


@intrinsic
def lane_dot_rows(typingctx, a, r0, nr, b, bo, n, out, oo, ostride, scale):
    """out[oo + g * ostride] = scale * (a[r0 + g, :n] . b[bo:bo + n]) for g < nr (a literal): the
    rows share each 16-element chunk of b, converted once (b float32 or fp16 bits). Each row
    sums into one 16-lane accumulator, chunk by chunk (the nr rows' chains run side by side),
    then its lanes by halving (:func:`hsum16`), then the elements past the last whole chunk in
    index order: a fixed order, as :func:`lane_dot` (whose four-accumulator order differs).
    a: float32 2-D C-contiguous; out float32 1-D; no bounds check."""
    if not isinstance(nr, types.IntegerLiteral) or not _contiguous(a, b, out):
        return None
    NR = nr.literal_value
    sig = types.void(a, r0, nr, b, bo, n, out, oo, ostride, scale)

    def codegen(context, builder, signature, args):
        i64 = llvm_ir.IntType(64)
        f32 = llvm_ir.FloatType()
        fma_v, fma_s = _fma_fns(builder)
        k = lambda v: llvm_ir.Constant(i64, v)       # noqa: E731
        aty, _, _, bty, _, _, oty, _, _, _ = signature.args
        a_ary = context.make_array(aty)(context, builder, args[0])
        row_len = builder.extract_value(a_ary.shape, 1)
        r0_ = _as_i64(builder, args[1])
        a_p = builder.bitcast(a_ary.data, f32.as_pointer())
        b_p, b_half = _operand_ptr(context, builder, bty, args[3], args[4])
        n_ = _count(builder, args[5])
        rows = [builder.gep(a_p, [builder.mul(builder.add(r0_, k(g)), row_len)]) for g in range(NR)]
        n16 = builder.udiv(n_, k(16))
        accs = _zero_slots(builder, llvm_ir.VectorType(f32, 16), NR)
        with cgutils.for_range(builder, n16, intp=i64) as loop:
            idx = builder.mul(loop.index, k(16))
            bv = _load_lanes(builder, b_p, b_half, idx, 16)
            for g in range(NR):
                av = _load_lanes(builder, rows[g], False, idx, 16)
                builder.store(builder.call(fma_v, [av, bv, builder.load(accs[g])]), accs[g])
        totals = []
        for g in range(NR):
            t = cgutils.alloca_once(builder, f32)
            builder.store(_hsum16_ir(builder, builder.load(accs[g])), t)
            totals.append(t)
        with cgutils.for_range(builder, builder.sub(n_, builder.mul(n16, k(16))), intp=i64) as loop:
            idx = builder.add(builder.mul(n16, k(16)), loop.index)
            bs = _load_lanes(builder, b_p, b_half, idx, 1)
            for g in range(NR):
                av = _load_lanes(builder, rows[g], False, idx, 1)
                builder.store(builder.call(fma_s, [av, bs, builder.load(totals[g])]), totals[g])
        o_ary = context.make_array(oty)(context, builder, args[6])
        o_p = builder.bitcast(o_ary.data, f32.as_pointer())
        oo_, os_ = _as_i64(builder, args[7]), _as_i64(builder, args[8])
        sc = context.cast(builder, args[9], signature.args[9], types.float32)
        for g in range(NR):
            at = builder.gep(o_p, [builder.add(oo_, builder.mul(os_, k(g)))])
            builder.store(builder.fmul(builder.load(totals[g]), sc), at)
        return context.get_dummy_value()

    return sig, codegen


def fma32(a, b, c):
    """float32 fma(a, b, c) elementwise in NumPy: the product of two float32 is exact in float64
    and one float64 add then rounds (a second rounding to float32 could differ from a single
    one only in rare ties, none of which the tests' fixed data meet)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def _hsum16_ref(v):
    v = np.asarray(v, np.float32)
    while v.size > 1:
        v = v[:v.size // 2] + v[v.size // 2:]
    return v[0]


def lane_dot_ref(a, b=None, rows=False):
    """NumPy reference of :func:`lane_dot` (b given), :func:`lane_sum` (b None) and, with
    ``rows``, of one row of :func:`lane_dot_rows`: the same operations in the same order (a, b
    float32 1-D of one length)."""
    a = np.asarray(a, np.float32)
    b = np.ones_like(a) if b is None else np.asarray(b, np.float32)
    n = a.size
    n16 = n // 16
    if rows:
        acc = np.zeros(16, np.float32)
        for c in range(n16):
            acc = fma32(a[16 * c:16 * c + 16], b[16 * c:16 * c + 16], acc)
        s = _hsum16_ref(acc)
    else:
        acc = np.zeros((4, 16), np.float32)
        for c in range(n16):
            j = c % 4 if c < n16 // 4 * 4 else 0
            acc[j] = fma32(a[16 * c:16 * c + 16], b[16 * c:16 * c + 16], acc[j])
        s = _hsum16_ref((acc[0] + acc[1]) + (acc[2] + acc[3]))
    for i in range(16 * n16, n):
        s = fma32(a[i:i + 1], b[i:i + 1], np.array([s], np.float32))[0]
    return np.float32(s)
