"""fp16 <-> fp32 conversions for jitted code: in hardware (IR fpext / fptrunc of half,
F16C's vcvtph2ps / vcvtps2ph on x86), or in integer IR on an x86 target without F16C, with
the same values; and :func:`fma16`, a 16-lane FMA whose operands may be fp16. Used by the
float matvecs (F16 weights) and pyimp's KV cache and attention kernels."""
from __future__ import annotations

import platform

from llvmlite import ir as llvm_ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import jit

_X86_64 = platform.machine().lower() in ("x86_64", "amd64")
# the features Numba compiles for (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES honoured), not the host's
_FEATURES = jit.target_features()

# fp16 <-> fp32 conversions in hardware: IR fpext / fptrunc of half. An x86 target without
# F16C (NUMBA_CPU_NAME=generic, a portable cache, compiles for baseline x86-64) has no such
# instruction: LLVM calls a runtime helper that Numba's JIT does not provide, and the process
# crashed on its first KV write. There the conversions are integer IR (_half_to_float_soft,
# _float_to_half_soft: the same values, tested against NumPy on every fp16 pattern).
HALF_IN_HARDWARE = not _X86_64 or "f16c" in _FEATURES


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


def _fpext_half(builder, hv):
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
        return _fpext_half(builder, args[0])

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
        fn = cgutils.get_or_insert_function(builder.module, llvm_ir.FunctionType(vf, [vf, vf, vf]),
                                            "llvm.fma.v16f32")

        def operand(k):         # (operand k as <16 x float>, its float pointer or None)
            aryty = signature.args[2 * k]
            ary = context.make_array(aryty)(context, builder, args[2 * k])
            p = cgutils.get_item_pointer(context, builder, aryty, ary, [args[2 * k + 1]],
                                         wraparound=False)
            if aryty.dtype == types.uint16:
                hv = builder.load(builder.bitcast(p, llvm_ir.VectorType(llvm_ir.IntType(16), 16).as_pointer()),
                                  align=2)
                return _fpext_half(builder, hv), None
            fp = builder.bitcast(p, vf.as_pointer())
            return builder.load(fp, align=4), fp
        ov, po = operand(0)
        builder.store(builder.call(fn, [operand(1)[0], operand(2)[0], ov]), po, align=4)
        return context.get_dummy_value()

    return sig, codegen
