"""Kernels for the float and legacy block types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Byte layouts (one block; ggml field names; all multi-byte fields little-endian):

    F32   4 bytes   float32 value                                   (1 element)
    F16   2 bytes   IEEE half                                       (1 element)
    BF16  2 bytes   upper 16 bits of a float32                      (1 element)
    Q4_0 18 bytes   d: f16 | qs: u8[16]                             (32 elements)
                    q[j] = qs[j] & 0xF, q[j+16] = qs[j] >> 4;  w = d * (q - 8)
    Q4_1 20 bytes   d: f16 | m: f16 | qs: u8[16]                    (32 elements)
                    q as Q4_0;                                  w = d * q + m
    Q5_0 22 bytes   d: f16 | qh: u32 | qs: u8[16]                   (32 elements)
                    q[j]    = (qs[j] & 0xF) | ((qh >> j) & 1) << 4
                    q[j+16] = (qs[j] >> 4)  | ((qh >> (j+16)) & 1) << 4;  w = d * (q - 16)
    Q5_1 24 bytes   d: f16 | m: f16 | qh: u32 | qs: u8[16]          (32 elements)
                    q as Q5_0;                                  w = d * q + m
    Q8_0 34 bytes   d: f16 | qs: i8[32];                        w = d * qs[j]
    Q8_1 36 bytes   d: f16 | s: f16 | qs: i8[32]  (activations only; s = fp16(d * sum(qs)))

Dequantization is bit-identical to ``gguf.quants.dequantize`` (same float32
operations in the same order: ``d * q`` then ``+ m``).

Two numerics:

* fp32 (``matvec_*``): reads the quantized bytes directly, each weight is the
  exact dequantized float32 value, multiplied and summed in float32 with 32
  independent lane accumulators per row (a fixed summation order; the block types
  use fused multiply-adds, one rounding per term, Q8_0 a product and a sum).
* ggml (``matmul_ggml_*``): activations already converted to the weight type's
  ``act_type`` exactly as ggml's CPU ``from_float`` does (Q8_0 for Q4_0, Q5_0,
  Q8_0; Q8_1 for Q4_1, Q5_1; the float types convert to themselves), then the
  dot product of ggml's x86 CPU ``vec_dot`` as compiled for AVX-512/AVX2
  (integer block sums over 8 lanes of 4 elements, ``fma`` into 8 float lanes,
  ``hsum_float_8``; F32/F16 with 64 FMA lanes and ``_mm512_reduce_add_ps``,
  BF16 with ``vdpbf16ps`` pairs). On x86 hosts with AVX2 (and, for Q8_0, VNNI)
  the block types take the same numbers through SIMD integer dot products
  (``_matmul_ggml_i8``: VPDPBUSD or VPMADDUBSW + VPMADDWD, two rows at a time,
  prefetched); the portable kernels stay in ``PORTABLE_GGML``.

Every kernel takes ``raw`` as ``uint8[rows, row_bytes]``; fp16 scales are decoded
through the 65536-entry table ``F16_TO_F32``, F16 weights by the hardware conversions of
:mod:`loaders.half` (the same values, vectorized). Plain NumPy references of every
kernel are at the end of this module (``*_ref``).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import half, jit
from .ggml_types import QT, TypeKernels, type_size
# the target's architecture and the features Numba compiles for (NUMBA_CPU_NAME /
# NUMBA_CPU_FEATURES honoured), not the host's
from .half import FEATURES, X86_64, fma16, half_bits_to_f32

jit.kernel_module(__file__, half)


# fp16 bit pattern -> float32 value (exact), passed to every kernel that reads fp16
F16_TO_F32: np.ndarray = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)

_F32_0 = np.float32(0.0)
_F32_127 = np.float32(127.0)

# ---------------------------------------------------------------------------------------
# scalar building blocks (compiled inline into the kernels of this module)
# ---------------------------------------------------------------------------------------


@intrinsic
def fma32(typingctx, a, b, c):
    """float32 fused multiply-add a * b + c with a single rounding (llvm.fma.f32)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f, [f, f, f]),
                                            "llvm.fma.f32")
        return builder.call(fn, args)

    return sig, codegen


@intrinsic
def _f32_bits(typingctx, a):
    """Bit pattern of a float32 as uint32."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def bits_f32(typingctx, a):
    """uint32 bit pattern -> float32."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


# Quant decoding in 32-bit integers. Numba types every integer expression on small ints as
# int64, and LLVM then vectorizes a block's decode 8 lanes wide (64-bit lanes) or not at all;
# these compute in i32 and return int32, so a block decodes 8-16 lanes per instruction and
# the float conversion is a 32-bit one (Q5_0 fp32 matvec +30%, Q8_0 +25% on real rows).
I32 = ir.IntType(32)


def _arg_i32(builder, ty, v):
    """An integer argument as i32 (truncated, or extended by its signedness)."""
    if ty.bitwidth > 32:
        return builder.trunc(v, I32)
    if ty.bitwidth < 32:
        return builder.sext(v, I32) if ty.signed else builder.zext(v, I32)
    return v


@intrinsic
def _s8(typingctx, u):
    """A byte (uint8) as a signed value, int32."""
    sig = types.int32(u)

    def codegen(context, builder, signature, args):
        b = args[0] if args[0].type.width == 8 else builder.trunc(args[0], ir.IntType(8))
        return builder.sext(b, I32)

    return sig, codegen


@intrinsic
def _nibbles(typingctx, u, off):
    """(low nibble - off, high nibble - off) of a byte, int32."""
    sig = types.UniTuple(types.int32, 2)(u, off)

    def codegen(context, builder, signature, args):
        v = _arg_i32(builder, signature.args[0], args[0])
        o = _arg_i32(builder, signature.args[1], args[1])
        lo = builder.and_(v, ir.Constant(I32, 15))
        hi = builder.lshr(builder.and_(v, ir.Constant(I32, 255)), ir.Constant(I32, 4))
        return context.make_tuple(builder, signature.return_type, (builder.sub(lo, o), builder.sub(hi, o)))

    return sig, codegen


@intrinsic
def _q5(typingctx, u, qh, j, off):
    """Q5 quants j and j+16 minus off from qs byte u and the 32 high bits qh, int32:
    ((u & 15) | bit j of qh << 4) - off, ((u >> 4) | bit j+16 of qh << 4) - off."""
    sig = types.UniTuple(types.int32, 2)(u, qh, j, off)

    def codegen(context, builder, signature, args):
        v, h, k, o = (_arg_i32(builder, t, a) for t, a in zip(signature.args, args))
        c1, c4 = ir.Constant(I32, 1), ir.Constant(I32, 4)

        def bit(s):
            set_ = builder.icmp_unsigned("!=", builder.and_(h, builder.shl(c1, s)), ir.Constant(I32, 0))
            return builder.select(set_, ir.Constant(I32, 16), ir.Constant(I32, 0))

        lo = builder.or_(builder.and_(v, ir.Constant(I32, 15)), bit(k))
        hi = builder.or_(builder.lshr(builder.and_(v, ir.Constant(I32, 255)), c4),
                         bit(builder.add(k, ir.Constant(I32, 16))))
        return context.make_tuple(builder, signature.return_type, (builder.sub(lo, o), builder.sub(hi, o)))

    return sig, codegen


# Whole-block vector IR. LLVM fully unrolls the 32-wide loops of one block and leaves the
# unrolled code scalar (checked in the assembly: one byte load, shift, convert and FMA per
# weight); these helpers emit a block's 32 lanes as two <16 x ...> vector operations instead.
# Each lane is the scalar decoders' value exactly: the same integer quant, one exact
# int -> float conversion, one product d * q, (types with a min) one sum, and the FMA
# ``llvm.fma.v16f32`` rounds once per lane as ``llvm.fma.f32`` does.

def ir_ptr(context, builder, aryty, ary, idx, vty):
    """Pointer to ary[idx] as a pointer to type vty, a vector or a scalar (no bounds check)."""
    a = context.make_array(aryty)(context, builder, ary)
    p = cgutils.get_item_pointer(context, builder, aryty, a, [idx], wraparound=False)
    return builder.bitcast(p, vty.as_pointer())


def ir_fma(builder, vty):
    """llvm.fma for float vector type vty (``<N x float>``), declared in the builder's module:
    call it as ``builder.call(ir_fma(builder, vty), [a, b, c])`` for a * b + c, one rounding."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(vty, [vty, vty, vty]),
                                          f"llvm.fma.v{vty.count}f32")


def ir_splat(builder, x, vty):
    """x broadcast to every lane of vector type vty."""
    und = ir.Constant(vty, ir.Undefined)
    one = builder.insert_element(und, x, ir.Constant(ir.IntType(32), 0))
    mask = ir.Constant(ir.VectorType(ir.IntType(32), vty.count), [0] * vty.count)
    return builder.shuffle_vector(one, und, mask)


def ir_u4_weights(context, builder, sig_args, args):
    """The 32 weights of a Q4_0 / Q4_1 / Q5_0 / Q5_1 block as two <16 x float> vectors
    (elements 0-15, 16-31). ``args`` = (w, wo, qh, d, m, off): the 16 qs bytes at w[wo:]
    (element j < 16: low nibble of byte j, element j + 16: its high nibble), ``qh`` a uint32
    whose bit k is bit 4 of element k (or None), weight = d * float32(q - off) (+ m unless m
    is None). The quants are unpacked and offset at byte width
    (:func:`ir_unpack_u8x32`; q - off lies in [-16, 31], an int8), then widened: the same
    values with fewer instructions than unpacking at 32 bits (the fp32 matvec of Q5_0 went
    from 7.1 to 8.7 GB/s with it, before it took steps of its own: ir_u4_groups,
    ir_u4_lanes_wide). The dequantization of these types takes it."""
    wty, _, qhty, _, mty, offty = sig_args
    w, wo, qh, d, m, off = args
    nbits = 4 if isinstance(qhty, types.NoneType) else 5
    v8 = ir.VectorType(ir.IntType(8), 32)
    q = ir_unpack_u8x32(context, builder, wty, w, wo, qhty, qh, nbits)
    q = builder.sub(q, ir_splat(builder, builder.trunc(_arg_i32(builder, offty, off), ir.IntType(8)), v8))
    vf = ir.VectorType(ir.FloatType(), 16)
    dv = ir_splat(builder, d, vf)
    out = []
    for elems in (range(16), range(16, 32)):
        qh16 = builder.shuffle_vector(q, ir.Constant(v8, ir.Undefined),
                                      ir.Constant(ir.VectorType(ir.IntType(32), 16), list(elems)))
        r = builder.fmul(dv, builder.sitofp(qh16, vf))
        if not isinstance(mty, types.NoneType):
            r = builder.fadd(r, ir_splat(builder, m, vf))
        out.append(r)
    return out


# the widest vector an x86 register ("x" constraint) holds on that target, in bits
_X86_VECTOR_BITS = 512 if "avx512f" in FEATURES else 256 if "avx" in FEATURES else 128


def ir_opaque(builder, v):
    """``v``, hidden from LLVM's optimizer: an empty inline asm on x86-64 where one register
    holds ``v`` (``v`` itself elsewhere: a 256-bit vector on a target without AVX, e.g.
    NUMBA_CPU_NAME=generic, has no register for the asm and LLVM would refuse to compile it).
    LLVM then cannot rewrite what takes ``v`` by its value: :func:`ir_u4_groups`' blend with a
    zero vector stays one blend, where LLVM would make a compare and an and-not of it."""
    t = v.type
    el, n = (t.element, t.count) if isinstance(t, ir.VectorType) else (t, 1)
    bits = n * (el.width if isinstance(el, ir.IntType) else 32 if isinstance(el, ir.FloatType) else 64)
    if not X86_64 or bits > _X86_VECTOR_BITS:
        return v
    asm = ir.InlineAsm(ir.FunctionType(v.type, [v.type]), "", "=x,0")
    return builder.call(asm, [v])


def ir_u4_groups(context, builder, sig_args, args):
    """The 32 weights of a Q4_0 / Q4_1 / Q5_0 / Q5_1 block (arguments as :func:`ir_u4_weights`)
    as four <8 x float> vectors in element order (vector k: elements 8k .. 8k + 7), for hosts
    with 256-bit vectors. Each 8 qs bytes reach 32-bit lanes by one zero-extending load
    (VPMOVZXBD); a mask keeps the low nibbles (elements 0-15), a shift right by 4 the high ones
    (16-31). Each weight is then one fma, d * float32(q) + c with c = -off * d (Q4_0, Q5_0) or
    m (Q4_1, Q5_1): the exact product d * q plus c, rounded once, which is d * float32(q - off)
    (+ m), the value of the other steps (d * (q - off) has at most 16 significant bits, so it
    is exact). One difference: a zero weight (q = off, no m) is +0 here where d * 0.0 is -0
    for a negative d; that changes a sum only where an accumulator is -0, which takes a product
    that underflows to zero. A 5-bit quant's bit 4 (qh bit j for element j) is brought to the
    sign bit of its lane by one per-lane shift; a blend then picks (16 - off) d over c for Q5_0
    (0, kept opaque so that LLVM does not turn the blend into a compare and an and-not), or 16
    over 0 to add to float32(q) for Q5_1 (m + 16 d would be rounded before the sum: two
    roundings).

    It replaced a step that unpacked the qs words by shifts in a permuted lane order (x
    permuted once a call) and made each weight by a convert and a multiply. Compiled for
    znver3, one core of an AMD EPYC znver4, 4096 x 2048 matrices, cycles a block (with the
    scale's index by one load, :func:`load_u16`): Q4_0 7.2 -> 6.5, Q4_1 7.9 -> 5.9, Q5_0 10.5 ->
    9.1, Q5_1 12.3 -> 9.3; two threads, Gemma 3 270M's Q5_0 ffn_gate 13.5 -> 14.9 GB/s.
    Far row pairs of it ran slower (Q4_0, two threads, 19.6 -> 16.5 GB/s), and so did bit 4 by
    an arithmetic shift and an and-not in place of the blend (Q5_0 9.1 -> 10.0 cycles)."""
    wty, _, qhty, _, mty, offty = sig_args
    w, wo, qh, d, m, off = args
    i32 = ir.IntType(32)
    v8, f8 = ir.VectorType(i32, 8), ir.VectorType(ir.FloatType(), 8)
    fma = ir_fma(builder, f8)
    dv = ir_splat(builder, d, f8)
    has_min, five = not isinstance(mty, types.NoneType), not isinstance(qhty, types.NoneType)

    def times_d(k):                     # k * d for an int32 k, exact (at most 16 bits)
        return builder.fmul(dv, builder.sitofp(ir_splat(builder, k, v8), f8))
    offset = _arg_i32(builder, offty, off)
    c = ir_splat(builder, m, f8) if has_min else times_d(builder.neg(offset))
    if five:
        h = ir_splat(builder, _arg_i32(builder, qhty, qh), v8)
        zero = ir_opaque(builder, ir.Constant(f8, [0.0] * 8))
        if has_min:                     # bit 4 adds 16 to the quant: m + 16 d would round
            hi = ir.Constant(f8, [16.0] * 8)
        else:                           # c + 16 d = (16 - off) d: 0 for Q5_0
            hi = zero if getattr(off, "constant", None) == 16 else times_d(builder.sub(ir.Constant(i32, 16), offset))
    zs = [builder.zext(builder.load(ir_ptr(context, builder, wty, w, builder.add(wo, ir.Constant(wo.type, 8 * k)),
                                           ir.VectorType(ir.IntType(8), 8)), align=1), v8) for k in range(2)]
    out = []
    for k in range(4):
        z = zs[k % 2]
        q = builder.and_(z, ir.Constant(v8, [15] * 8)) if k < 2 else builder.lshr(z, ir.Constant(v8, [4] * 8))
        qf, ck = builder.sitofp(q, f8), c
        if five:
            top = builder.shl(h, ir.Constant(v8, [31 - (8 * k + i) for i in range(8)]))
            bit = builder.icmp_signed("<", top, ir.Constant(v8, [0] * 8))
            if has_min:
                qf = builder.fadd(qf, builder.select(bit, hi, zero))
            else:
                ck = builder.select(bit, hi, c)
        out.append(builder.call(fma, [dv, qf, ck]))
    return out


def ir_u4_lanes_wide(context, builder, sig_args, args):
    """The 32 weights of a Q4_0 / Q4_1 / Q5_0 / Q5_1 block (arguments as :func:`ir_u4_weights`)
    as two <16 x float> vectors in element order (elements 0-15, 16-31), for hosts with AVX-512
    (WIDE_STEPS), by table lookups: the block's weight for every quant value, table[t] =
    d * float32(t - off) (+ m), made once a block (one or two <16 x float> vectors), then each
    vector's weights by one permute of the table by the quants (VPERMPS, a 32-entry VPERMI2PS
    for the 5-bit types). The qs bytes are zero-extended to 32-bit lanes once (the low nibble
    of byte j is element j, the high one element 16 + j); VPERMPS reads the low 4 bits of each
    index, so the nibbles need no mask; a 5-bit quant's bit 4 is set by an OR under a mask
    register loaded from ``qh`` (bit k of qh is element k's). Each weight has the other steps'
    bits (the same float operations on the same values); only the lanes it is summed in differ.

    It replaced a step that made each weight from its quant by shift, mask, qh rotate, a float
    made from the bits, a subtract and a multiply per vector. One core of an AMD EPYC znver4
    (AVX-512 on 256-bit units), Gemma 3 270M's 2048 x 640 Q5_0 ffn_gate in L2, best of 7:
    118 -> 96 us (7.6 -> 9.3 GB/s); two threads 61-67 -> 49-50 us."""
    wty, _, qhty, _, mty, offty = sig_args
    w, wo, qh, d, m, off = args
    i32 = ir.IntType(32)
    v16 = ir.VectorType(i32, 16)
    vf = ir.VectorType(ir.FloatType(), 16)
    five = not isinstance(qhty, types.NoneType)
    qs = builder.load(ir_ptr(context, builder, wty, w, wo, ir.VectorType(ir.IntType(8), 16)), align=1)
    z = builder.zext(qs, v16)
    nibbles = (builder.and_(z, ir.Constant(v16, [15] * 16)) if five else z,
               builder.lshr(z, ir.Constant(v16, [4] * 16)))
    dv = ir_splat(builder, d, vf)
    offv = builder.sitofp(ir_splat(builder, _arg_i32(builder, offty, off), v16), vf)
    tables = []
    for t0 in ((0, 16) if five else (0,)):
        t = builder.fmul(dv, builder.fsub(ir.Constant(vf, [float(t0 + i) for i in range(16)]), offv))
        if not isinstance(mty, types.NoneType):
            t = builder.fadd(t, ir_splat(builder, m, vf))
        tables.append(t)
    if not five:
        perm = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, v16]),
                                              "llvm.x86.avx512.permvar.sf.512")
        return [builder.call(perm, [tables[0], q]) for q in nibbles]
    perm = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, v16, vf]),
                                          "llvm.x86.avx512.vpermi2var.ps.512")
    bits = _arg_i32(builder, qhty, qh)
    out = []
    for k, q in enumerate(nibbles):
        half = builder.trunc(builder.lshr(bits, ir.Constant(i32, 16)) if k else bits, ir.IntType(16))
        high = builder.bitcast(half, ir.VectorType(ir.IntType(1), 16))
        q = builder.select(high, builder.or_(q, ir.Constant(v16, [16] * 16)), q)
        out.append(builder.call(perm, [tables[0], q, tables[1]]))
    return out


def _fma_u4x32_codegen(lanes):
    """The codegen of :func:`_fma_u4x32` / :func:`_fma_u4x32_wide`: the block's weight vectors
    from ``lanes`` (element order), each into an FMA with as many activations and accumulators."""
    def codegen(context, builder, signature, args):
        ws = lanes(context, builder, signature.args[:6], args[:6])
        vf = ws[0].type
        fma = ir_fma(builder, vf)
        xp = ir_ptr(context, builder, signature.args[6], args[6], args[7], vf)
        ap = ir_ptr(context, builder, signature.args[8], args[8], ir.Constant(ir.IntType(64), 0), vf)
        for k, wv in enumerate(ws):
            xk = builder.gep(xp, [ir.Constant(ir.IntType(32), k)]) if k else xp
            ak = builder.gep(ap, [ir.Constant(ir.IntType(32), k)]) if k else ap
            r = builder.call(fma, [wv, builder.load(xk, align=4), builder.load(ak, align=4)])
            builder.store(r, ak, align=4)
        return context.get_dummy_value()
    return codegen


@intrinsic
def _fma_u4x32(typingctx, w, wo, qh, d, m, off, x, xo, acc):
    """acc[L] = fma(weight[L], x[xo + L], acc[L]) over the 32 weights of one Q4_0 / Q4_1 /
    Q5_0 / Q5_1 block (arguments w..off as :func:`ir_u4_weights`); acc float32[32]. The weights
    made by :func:`ir_u4_groups` (256-bit vectors)."""
    return types.void(w, wo, qh, d, m, off, x, xo, acc), _fma_u4x32_codegen(ir_u4_groups)


@intrinsic
def _fma_u4x32_wide(typingctx, w, wo, qh, d, m, off, x, xo, acc):
    """:func:`_fma_u4x32` with the weights made by :func:`ir_u4_lanes_wide` (AVX-512 only): the
    same products in the same lanes."""
    return types.void(w, wo, qh, d, m, off, x, xo, acc), _fma_u4x32_codegen(ir_u4_lanes_wide)


@jit.njit(inline="always")
def f32_to_f16_bits(f):
    """float32 -> IEEE half bits, round to nearest even (as F16C ``vcvtps2ph`` and NumPy)."""
    b = np.uint32(_f32_bits(np.float32(f)))
    sign = np.uint32((b >> 16) & 0x8000)
    e = np.int32((b >> 23) & 0xFF)
    m = np.uint32(b & 0x7FFFFF)
    if e == 0xFF:  # inf / nan (nan made quiet)
        if m == 0:
            return np.uint16(sign | 0x7C00)
        return np.uint16(sign | 0x7E00 | (m >> 13))
    if e >= 143:  # |f| >= 2^16: overflow to inf
        return np.uint16(sign | 0x7C00)
    if e >= 113:  # normal half
        h = np.uint32(((e - 112) << 10) | (m >> 13))
        rest = m & 0x1FFF
        if rest > 0x1000 or (rest == 0x1000 and (h & 1) == 1):
            h += 1  # a carry into the exponent is the correct rounding (up to inf)
        return np.uint16(sign | h)
    if e < 102:  # below half of the smallest subnormal: signed zero
        return np.uint16(sign)
    # subnormal half: value = sig * 2^(e - 150), unit 2^-24
    sig = m | 0x800000
    shift = np.uint32(126 - e)  # 14 .. 24
    h = sig >> shift
    rest = sig & ((np.uint32(1) << shift) - 1)
    half = np.uint32(1) << (shift - 1)
    if rest > half or (rest == half and (h & 1) == 1):
        h += 1
    return np.uint16(sign | h)


@jit.njit(inline="always")
def _f32_to_bf16_bits(f):
    """float32 -> bfloat16 bits as ggml_compute_fp32_to_bf16 (nearest even, nan made quiet)."""
    b = np.uint32(_f32_bits(np.float32(f)))
    if (b & 0x7FFFFFFF) > 0x7F800000:
        return np.uint16((b >> 16) | 64)
    return np.uint16((b + (0x7FFF + ((b >> 16) & 1))) >> 16)


@jit.njit(inline="always")
def as_i8(u):
    """uint8 byte -> signed value (int32)."""
    v = np.int32(u)
    return v - ((v & 0x80) << 1)


@intrinsic
def load_u16(typingctx, w, o):
    """Little-endian uint16 at byte offset o of a uint8 row (no bounds check), as int32: one
    16-bit load (Numba's targets are little-endian), where the two bytes' loads, shift and OR
    stayed four instructions (LLVM did not merge them). Every block type's fp16 scale index."""
    def codegen(context, builder, signature, args):
        o = context.cast(builder, args[1], signature.args[1], types.intp)
        p = ir_ptr(context, builder, signature.args[0], args[0], o, ir.IntType(16))
        return builder.zext(builder.load(p, align=1), I32)
    return types.int32(w, o), codegen


@jit.njit(inline="always")
def load_u32(w, o):
    """Little-endian uint32 at byte offset o of a uint8 row."""
    return (np.uint32(w[o]) | (np.uint32(w[o + 1]) << 8)
            | (np.uint32(w[o + 2]) << 16) | (np.uint32(w[o + 3]) << 24))


@jit.njit(inline="always")
def hsum8(a):
    """ggml hsum_float_8 order: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))."""
    r0 = a[4] + a[0]
    r1 = a[5] + a[1]
    r2 = a[6] + a[2]
    r3 = a[7] + a[3]
    return (r0 + r2) + (r1 + r3)


@jit.njit(inline="always")
def _reduce16(a, o):
    """_mm512_reduce_add_ps order (GCC) over a[o:o+16]."""
    t0 = a[o + 8] + a[o + 0]
    t1 = a[o + 9] + a[o + 1]
    t2 = a[o + 10] + a[o + 2]
    t3 = a[o + 11] + a[o + 3]
    t4 = a[o + 12] + a[o + 4]
    t5 = a[o + 13] + a[o + 5]
    t6 = a[o + 14] + a[o + 6]
    t7 = a[o + 15] + a[o + 7]
    u0 = t4 + t0
    u1 = t5 + t1
    u2 = t6 + t2
    u3 = t7 + t3
    return (u0 + u2) + (u1 + u3)


@jit.njit(inline="always")
def lanes_sum32(acc):
    """Sum of 32 float32 lane accumulators, pairwise (fixed order)."""
    for w in (16, 8, 4, 2, 1):
        for k in range(w):
            acc[k] = acc[k] + acc[k + w]
    return acc[0]


# ---------------------------------------------------------------------------------------
# activation converters (ggml CPU from_float, SIMD versions)
# ---------------------------------------------------------------------------------------


@jit.njit(parallel=True)
def quantize_act_q8(x, out, with_sum):
    """x: float32[m, n] -> Q8_0 (with_sum False) or Q8_1 (True) blocks in out: uint8[m, bytes]."""
    _quantize_act_q8_rows(x, out, with_sum)


@jit.njit
def _quantize_act_q8_serial(x, out, with_sum):
    """quantize_act_q8 on the calling thread (one decode row: no thread-pool launch)."""
    _quantize_act_q8_rows(x, out, with_sum)


@jit.njit(inline="always")
def _quantize_act_q8_rows(x, out, with_sum):
    m, n = x.shape
    nb = n // 32
    bsz = 36 if with_sum else 34
    oq = 4 if with_sum else 2
    for i in prange(m):
        for b in range(nb):
            amax = _F32_0
            for k in range(32):
                a = abs(x[i, b * 32 + k])
                if a > amax:
                    amax = a
            d = amax / _F32_127
            inv = _F32_127 / amax if amax != _F32_0 else _F32_0
            o = b * bsz
            hd = f32_to_f16_bits(d)
            out[i, o] = np.uint8(hd & 0xFF)
            out[i, o + 1] = np.uint8(hd >> 8)
            isum = 0
            for k in range(32):
                q = np.int32(np.rint(np.float32(x[i, b * 32 + k] * inv)))
                q = min(max(q, -128), 127)
                isum += q
                out[i, o + oq + k] = np.uint8(q & 0xFF)
            if with_sum:
                hs = f32_to_f16_bits(np.float32(d * np.float32(isum)))
                out[i, o + 2] = np.uint8(hs & 0xFF)
                out[i, o + 3] = np.uint8(hs >> 8)


@jit.njit(inline="always")
def _encode_elems(x, out, encode):
    """x: float32[m, n] -> out uint16[m, n] bit patterns, element by element."""
    m, n = x.shape
    for i in prange(m):
        for j in range(n):
            out[i, j] = encode(x[i, j])


@jit.njit(parallel=True)
def _convert_act_f16(x, out):
    _encode_elems(x, out, f32_to_f16_bits)


@jit.njit(parallel=True)
def _convert_act_bf16(x, out):
    _encode_elems(x, out, _f32_to_bf16_bits)


def _as_2d_f32(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2:
        raise ValueError(f"activations must be float32[m, n], got shape {x.shape}")
    return x


def _quantize_act_blocks(x: np.ndarray, with_sum: bool) -> np.ndarray:
    name, bsz = ("Q8_1", 36) if with_sum else ("Q8_0", 34)
    x = _as_2d_f32(x)
    if x.shape[1] % 32:
        raise ValueError(f"{name} activations need n % 32 == 0, got n={x.shape[1]}")
    out = np.empty((x.shape[0], x.shape[1] // 32 * bsz), dtype=np.uint8)
    (_quantize_act_q8_serial if x.shape[0] == 1 else quantize_act_q8)(x, out, with_sum)
    return out


def quantize_act_q8_0(x: np.ndarray) -> np.ndarray:
    """float32[m, n] -> Q8_0 blocks uint8[m, n//32*34], bytes as ggml's CPU quantize_row_q8_0."""
    return _quantize_act_blocks(x, False)


def quantize_act_q8_1(x: np.ndarray) -> np.ndarray:
    """float32[m, n] -> Q8_1 blocks uint8[m, n//32*36], bytes as ggml's CPU quantize_row_q8_1."""
    return _quantize_act_blocks(x, True)


def _encode_act(x: np.ndarray, kernel) -> np.ndarray:
    x = _as_2d_f32(x)
    out = np.empty(x.shape, dtype=np.uint16)
    kernel(x, out)
    return out.view(np.uint8)


def convert_act_f16(x: np.ndarray) -> np.ndarray:
    """float32[m, n] -> fp16 bytes uint8[m, 2n] (ggml_cpu_fp32_to_fp16: nearest even)."""
    return _encode_act(x, _convert_act_f16)


def convert_act_bf16(x: np.ndarray) -> np.ndarray:
    """float32[m, n] -> bf16 bytes uint8[m, 2n] (ggml_cpu_fp32_to_bf16)."""
    return _encode_act(x, _convert_act_bf16)


def convert_act_f32(x: np.ndarray) -> np.ndarray:
    """float32[m, n] -> float32[m, n] (F32 weights take activations as they are)."""
    return _as_2d_f32(x)


# ---------------------------------------------------------------------------------------
# Decoders: the only code that knows each type's bit layout. Every kernel below is a
# generic driver specialized (inlined) with one type's decoder.
#
# Float types decode one element:  elem(h, k, f16) -> float32 value of element k of row h
# Block types (32 elements) decode a block at byte offset o of a row w in two steps:
#   head(w, o, f16)   -> (d, m, aux)        scale, minimum (0 for the types without one),
#                                           per-block bits the quants need (Q5: qh)
#   pair(w, o, aux, j) -> (q[j], q[j+16])   integer quants for j in 0..15, offsets applied
# and element k is d * q[k] (+ m for the types with a minimum): the float32 operations
# of gguf.quants.dequantize, so dequantization is bit-identical.
# ---------------------------------------------------------------------------------------


@jit.njit(inline="always")
def _elem_f32(w, k, f16):
    return w[k]


@jit.njit(inline="always")
def _elem_f16(h, k, f16):
    return half_bits_to_f32(h[k])


@jit.njit(inline="always")
def _elem_bf16(h, k, f16):
    return bits_f32(np.uint32(h[k]) << 16)


@jit.njit(inline="always")
def head_d(w, o, f16):
    """Q4_0 / Q8_0: d: f16."""
    return f16[load_u16(w, o)], _F32_0, np.uint32(0)


@jit.njit(inline="always")
def head_dm(w, o, f16):
    """Q4_1: d: f16 | m: f16."""
    return f16[load_u16(w, o)], f16[load_u16(w, o + 2)], np.uint32(0)


@jit.njit(inline="always")
def head_d_qh(w, o, f16):
    """Q5_0: d: f16 | qh: u32."""
    return f16[load_u16(w, o)], _F32_0, load_u32(w, o + 2)


@jit.njit(inline="always")
def head_dm_qh(w, o, f16):
    """Q5_1: d: f16 | m: f16 | qh: u32."""
    return f16[load_u16(w, o)], f16[load_u16(w, o + 2)], load_u32(w, o + 4)


@jit.njit(inline="always")
def pair_q4_0(w, o, aux, j):
    """qs: u8[16] at o+2: low nibbles are q[0:16], high nibbles q[16:32]; minus 8."""
    return _nibbles(w[o + 2 + j], 8)


@jit.njit(inline="always")
def pair_q4_1(w, o, aux, j):
    """qs: u8[16] at o+4, nibbles as Q4_0, unsigned."""
    return _nibbles(w[o + 4 + j], 0)


@jit.njit(inline="always")
def pair_q5_0(w, o, qh, j):
    """qs: u8[16] at o+6, the fifth bit of q[k] is bit k of qh; minus 16."""
    return _q5(w[o + 6 + j], qh, j, 16)


@jit.njit(inline="always")
def pair_q5_1(w, o, qh, j):
    """qs: u8[16] at o+8, as Q5_0, unsigned."""
    return _q5(w[o + 8 + j], qh, j, 0)


@jit.njit(inline="always")
def pair_q8_0(w, o, aux, j):
    """qs: i8[32] at o+2."""
    return _s8(w[o + 2 + j]), _s8(w[o + 18 + j])


@jit.njit(inline="always")
def _mac_q8_0(w, o, f16, x, xo, acc):
    d = f16[load_u16(w, o)]
    for j in range(32):
        acc[j] += (d * np.float32(_s8(w[o + 2 + j]))) * x[xo + j]


# the fp32 block steps of the 4/5-bit types, ``_fma_q4_0(w, o, f16, x, xo, acc)`` etc. and their
# 512-bit twins ``_fma_q4_0_wide``: one block at w[o:] into acc (_fma_u4x32, _fma_u4x32_wide)
# from the block's fields (qs offset, qh, d, m, quant offset) as the table gives them
_U4_FIELDS = {
    "q4_0": "o + 2, None, f16[load_u16(w, o)], None, 8",
    "q4_1": "o + 4, None, f16[load_u16(w, o)], f16[load_u16(w, o + 2)], 0",
    "q5_0": "o + 6, load_u32(w, o + 2), f16[load_u16(w, o)], None, 16",
    "q5_1": "o + 8, load_u32(w, o + 4), f16[load_u16(w, o)], f16[load_u16(w, o + 2)], 0",
}
for _t, _fields in _U4_FIELDS.items():
    for _suffix, _fma in (("", "_fma_u4x32"), ("_wide", "_fma_u4x32_wide")):
        jit.specialize(globals(), f"_fma_{_t}{_suffix}", "w, o, f16, x, xo, acc",
                       f"{_fma}(w, {_fields}, x, xo, acc)", inline="always", cache=False)


@jit.njit(inline="always")
def q_weight(d, m, q, has_min):
    return d * np.float32(q) + m if has_min else d * np.float32(q)


# ---------------------------------------------------------------------------------------
# block decoders as vector IR: the 32 weights of one block to out[oo:oo+32] (weight
# dequantization, and the KV cache's quantized blocks in loaders.quantize). A 32-element loop
# with a constant trip count is fully unrolled by LLVM before its loop vectorizer runs, and
# the unrolled scalar code is not re-vectorized (Q4_0, Q4_1 and Q8_0 dequantized at 4 G
# weights/s that way, 5x slower than as vector IR); these emit the block's vector operations
# directly. Each output is the scalar decoders' float32 value (``head``/``pair``, q_weight):
# the same integer quant, one exact int -> float conversion, one product d * q and (types
# with a minimum) one sum.
# ---------------------------------------------------------------------------------------


@intrinsic
def _s8x32(typingctx, w, wo, d, out, oo):
    """out[oo:oo+32] = d * float32(int8 bytes w[wo:wo+32]) (Q8_0's quants)."""
    sig = types.void(w, wo, d, out, oo)

    def codegen(context, builder, signature, args):
        wty, _, _, oty, _ = signature.args
        vf = ir.VectorType(ir.FloatType(), 32)
        q = builder.load(ir_ptr(context, builder, wty, args[0], args[1],
                                ir.VectorType(ir.IntType(8), 32)), align=1)
        r = builder.fmul(ir_splat(builder, args[2], vf), builder.sitofp(q, vf))
        builder.store(r, ir_ptr(context, builder, oty, args[3], args[4], vf), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _u4x32(typingctx, w, wo, qh, d, m, off, out, oo):
    """The 32 weights of a Q4_0 / Q4_1 / Q5_0 / Q5_1 block (arguments w..off as
    :func:`ir_u4_weights`) to out[oo:oo+32]."""
    sig = types.void(w, wo, qh, d, m, off, out, oo)

    def codegen(context, builder, signature, args):
        vf = ir.VectorType(ir.FloatType(), 16)
        dst = ir_ptr(context, builder, signature.args[6], args[6], args[7], vf)
        for k, r in enumerate(ir_u4_weights(context, builder, signature.args[:6], args[:6])):
            builder.store(r, builder.gep(dst, [ir.Constant(ir.IntType(32), k)]) if k else dst,
                          align=4)
        return context.get_dummy_value()

    return sig, codegen


@jit.njit(inline="always")
def deq_q4_0(w, o, f16, out, oo):
    _u4x32(w, o + 2, None, f16[load_u16(w, o)], None, 8, out, oo)


@jit.njit(inline="always")
def deq_q4_1(w, o, f16, out, oo):
    _u4x32(w, o + 4, None, f16[load_u16(w, o)], f16[load_u16(w, o + 2)], 0, out, oo)


@jit.njit(inline="always")
def deq_q5_0(w, o, f16, out, oo):
    _u4x32(w, o + 6, load_u32(w, o + 2), f16[load_u16(w, o)], None, 16, out, oo)


@jit.njit(inline="always")
def deq_q5_1(w, o, f16, out, oo):
    _u4x32(w, o + 8, load_u32(w, o + 4), f16[load_u16(w, o)], f16[load_u16(w, o + 2)], 0, out, oo)


@jit.njit(inline="always")
def deq_q8_0(w, o, f16, out, oo):
    _s8x32(w, o + 2, f16[load_u16(w, o)], out, oo)


# ---------------------------------------------------------------------------------------
# generic drivers (inlined into the per-type kernels)
# ---------------------------------------------------------------------------------------


@jit.njit(inline="always")
def _dequantize_elems(h, out, f16, elem):
    """h: [rows, n] elements -> out float32[rows, n]."""
    rows, n = h.shape
    for r in prange(rows):
        hr = h[r]
        for j in range(n):
            out[r, j] = elem(hr, j, f16)


@intrinsic
def _mul_add_f16x32(typingctx, acc, h, ho, x, xo):
    """acc[0:32] += float32(h[ho:ho+32]) * x[xo:xo+32], lane by lane (a product, then a sum,
    each rounded as the scalar loop rounds them): h uint16 fp16 bits, converted exactly
    (loaders.half). LLVM leaves the scalar loop one vcvtph2ps, multiply and add per element
    (12 GB/s, 4096 x 4096 F16, two threads on the znver5 host)."""
    sig = types.void(acc, h, ho, x, xo)

    def codegen(context, builder, signature, args):
        accty, hty, _, xty, _ = signature.args
        vf = ir.VectorType(ir.FloatType(), 32)
        hp = ir_ptr(context, builder, hty, args[1], args[2], ir.VectorType(ir.IntType(16), 32))
        xp = ir_ptr(context, builder, xty, args[3], args[4], vf)
        ap = ir_ptr(context, builder, accty, args[0], ir.Constant(ir.IntType(64), 0), vf)
        w = half.fpext_half(builder, builder.load(hp, align=2))
        builder.store(builder.fadd(builder.load(ap, align=4), builder.fmul(w, builder.load(xp, align=4))),
                      ap, align=4)
        return context.get_dummy_value()

    return sig, codegen


@jit.njit(inline="always")
def _mac32_elems(hr, j0, x, acc, f16, elem):
    """acc[k] += elem k of hr[j0:j0 + 32] * x[j0 + k], k < 32 (the float types' matvec step)."""
    hb = hr[j0:j0 + 32]
    xb = x[j0:j0 + 32]
    for k in range(32):
        acc[k] += elem(hb, k, f16) * xb[k]


@jit.njit(inline="always")
def _mac32_f16(hr, j0, x, acc, f16, elem):
    """:func:`_mac32_elems` for F16 as one vector step (:func:`_mul_add_f16x32`): the same bits."""
    _mul_add_f16x32(acc, hr, j0, x, j0)


@jit.njit(inline="always")
def _matvec_elems(h, x, out, f16, elem, mac32):
    """fp32 numerics, 32 lane accumulators: h [rows, n], x float32[n] -> out float32[rows];
    ``mac32`` the step over 32 elements (:func:`_mac32_elems` or the type's vector step)."""
    rows, n = h.shape
    n32 = n // 32 * 32
    nchunk = min(rows, ROW_CHUNKS)
    for c in prange(nchunk):
        lo, hi = _chunk(c, rows, nchunk)
        acc = stack_f32(32)
        for r in range(lo, hi):
            hr = h[r]
            acc[:] = 0.0
            for j0 in range(0, n32, 32):
                mac32(hr, j0, x, acc, f16, elem)
            for j in range(n32, n):
                acc[j - n32] += elem(hr, j, f16) * x[j]
            out[r] = lanes_sum32(acc)


@jit.njit(inline="always")
def _dequantize_blocks(raw, out, f16, deq, bsz):
    """raw: uint8[rows, nb*bsz] -> out float32[rows, nb*32] (C-contiguous), block by block
    through the type's vector block decoder ``deq``."""
    rows = raw.shape[0]
    nb = out.shape[1] // 32
    for r in prange(rows):
        w = raw[r]
        orow = out[r]
        for b in range(nb):
            deq(w, b * bsz, f16, orow, b * 32)


@intrinsic
def stack_f32(typingctx, n):
    """A float32[n] scratch array (n a literal) in the calling function's stack frame instead
    of the heap: LLVM then keeps a matvec's lane accumulators in registers across its blocks
    (through heap memory each block's FMA waits on the previous block's store). Valid while
    the calling function runs; one buffer per call site, reused when it is reached again."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    N = n.literal_value
    arrty = types.Array(types.float32, 1, "C")
    sig = arrty(n)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        buf = cgutils.alloca_once(builder, ir.ArrayType(f32, N))
        data = builder.bitcast(buf, f32.as_pointer())
        ary = context.make_array(arrty)(context, builder)
        itemsize = context.get_constant(types.intp, 4)
        context.populate_array(ary, data=data, shape=[context.get_constant(types.intp, N)],
                               strides=[itemsize], itemsize=itemsize, meminfo=None)
        return ary._getvalue()

    return sig, codegen


@jit.njit(inline="always")
def _chunk(c, n, nchunk):
    """[lo, hi) of chunk c when n items are cut into nchunk contiguous chunks."""
    ci = np.intp(c)                      # prange's index may be unsigned: uint + int is float
    return ci * n // nchunk, (ci + 1) * n // nchunk


# a group's unused member (see group_row): no rows; read-only like the weights as_raw gives,
# so a one-matrix call and a group's are one specialization
NO_ROWS = np.empty((0, 0), np.uint8)
NO_ROWS.flags.writeable = False


@jit.njit(inline="always")
def group_row(raw, raw1, raw2, r):
    """Row r of a group: the rows of raw, then raw1's, then raw2's (matrices of one type and
    row length, read by one call; NO_ROWS for an unused member)."""
    n0 = raw.shape[0]
    if r < n0:
        return raw[r]
    n1 = raw1.shape[0]
    if r < n0 + n1:
        return raw1[r - n0]
    return raw2[r - n0 - n1]


@jit.njit(inline="always")
def _matvec_blocks(raw, raw1, raw2, x, out, f16, bsz, vec):
    """fp32 numerics: each weight the exact dequantized value, 32 lane accumulators. ``vec``
    is the type's block step (``_fma_q4_0`` ...: one block's 32 lanes as vector FMAs, one
    rounding per term, lane L element L; ``_mac_q8_0``: Q8_0's product and sum, which LLVM
    vectorizes as written). The rows are those of a group
    (:func:`group_row`: raw, raw1, raw2 one after another, out likewise), so matrices that
    read the same x (a layer's q, k, v) are one call. Work items are ROW_CHUNKS
    contiguous row ranges; the accumulators are a stack_f32 buffer, held in registers (a
    heap array per row cost as much as the 20 blocks of a 640-wide row, and made every
    block's FMA wait on the previous block's store)."""
    rows = raw.shape[0] + raw1.shape[0] + raw2.shape[0]
    nb = x.shape[0] // 32
    nchunk = min(rows, ROW_CHUNKS)
    for c in prange(nchunk):
        lo, hi = _chunk(c, rows, nchunk)
        acc = stack_f32(32)
        for r in range(lo, hi):
            w = group_row(raw, raw1, raw2, r)
            acc[:] = 0.0
            for b in range(nb):
                vec(w, b * bsz, f16, x, b * 32, acc)
            out[r] = lanes_sum32(acc)


@jit.njit(inline="always")
def far_pair(p, half, rows):
    """Rows of work item p when item p holds rows p and p + half (half = ceil(rows / 2)): an
    odd row count gives the middle row to its item twice (computed twice, written the same)."""
    r0 = np.intp(p)                      # prange's index may be unsigned: uint + int is float
    r1 = r0 + half
    return r0, (r1 if r1 < rows else r0)


@jit.njit(inline="always")
def _matvec_blocks_far_pairs(raw, raw1, raw2, x, out, f16, bsz, vec):
    """_matvec_blocks with rows r and r + ceil(rows / 2) per step, each prefetched
    PREFETCH_BYTES bytes ahead: the same operations per row (the same bits), two memory streams
    far apart that the hardware prefetchers alone do not keep fed. For the types whose block
    step is light enough to wait on memory (FAR_PAIR_MATVEC). Work items are ROW_CHUNKS
    ranges of steps, accumulators in registers as in _matvec_blocks; rows of a group as there."""
    rows = raw.shape[0] + raw1.shape[0] + raw2.shape[0]
    nb = x.shape[0] // 32
    half = (rows + 1) // 2
    nchunk = min(half, ROW_CHUNKS)
    for c in prange(nchunk):
        lo, hi = _chunk(c, half, nchunk)
        acc0 = stack_f32(32)
        acc1 = stack_f32(32)
        for p in range(lo, hi):
            r0, r1 = far_pair(p, half, rows)
            w0 = group_row(raw, raw1, raw2, r0)
            w1 = group_row(raw, raw1, raw2, r1)
            acc0[:] = 0.0
            acc1[:] = 0.0
            for b in range(nb):
                prefetch_at(w0, b * bsz + PREFETCH_BYTES)
                prefetch_at(w1, b * bsz + PREFETCH_BYTES)
                vec(w0, b * bsz, f16, x, b * 32, acc0)
                vec(w1, b * bsz, f16, x, b * 32, acc1)
            out[r0] = lanes_sum32(acc0)
            out[r1] = lanes_sum32(acc1)


@jit.njit(inline="always")
def _ggml_lanes64(wr, ar, npart, acc):
    """ggml_vec_dot_f32 / _f16 (AVX-512) main part: 4x16 FMA lanes over the first npart
    elements (wr, ar float32 or fp16 bits: loaders.half.fma16 converts them; the scalar loop
    had run one element at a time, 5 GB/s for F16), folded 64 -> 16 and reduced as
    _mm512_reduce_add_ps."""
    acc[:] = 0
    for j0 in range(0, npart, 64):
        for k in range(0, 64, 16):
            fma16(acc, k, wr, j0 + k, ar, j0 + k)
    for k in range(16):
        acc[k] = acc[k] + acc[32 + k]
        acc[16 + k] = acc[16 + k] + acc[48 + k]
    for k in range(16):
        acc[k] = acc[k] + acc[16 + k]
    return _reduce16(acc, 0)


@jit.njit(inline="always")
def _decode_ints(w, qw, dw, mw, f16, head, pair, bsz, off):
    """A weight row -> integer quants minus ``off``, qw int8[nb*32], d, m."""
    for b in range(dw.shape[0]):
        o = b * bsz
        d, mn, aux = head(w, o, f16)
        dw[b] = d
        mw[b] = mn
        q = qw[b * 32:b * 32 + 32]
        for j in range(16):
            lo, hi = pair(w, o, aux, j)
            q[j] = lo - off
            q[16 + j] = hi - off


@jit.njit(inline="always")
def _matmul_ggml_blocks(raw, aq, ad, asum, out, f16, head, pair, bsz, has_min, off):
    """ggml vec_dot of Q4_0/Q5_0/Q8_0 x Q8_0 and Q4_1/Q5_1 x Q8_1 (AVX2 code paths).

    raw: uint8[rows, row_bytes]; aq: int8[m, n] activation quants; ad: float32[m, nb] their d;
    asum: float32[m, nb] their s (Q8_1 only); out: float32[m, rows]. A weight row is decoded
    once to integer quants, then per activation row and block: 8 int32 lanes of 4 products,
    acc[lane] = fma(d_w * d_a, lane, acc[lane]); the result is hsum_float_8(acc), plus
    sum_b fma(m_w, s_a) for the types with a minimum. Quants decoded minus ``off`` get
    ``off * (sum of the lane's 4 activation quants)`` back in each exact integer lane sum."""
    rows = raw.shape[0]
    m = aq.shape[0]
    nb = ad.shape[1]
    alanes = np.zeros((m, nb * 8), np.int32)
    if off:
        for i in range(m):
            for j in range(nb * 8):
                alanes[i, j] = (np.int32(aq[i, 4 * j]) + np.int32(aq[i, 4 * j + 1])
                                + np.int32(aq[i, 4 * j + 2]) + np.int32(aq[i, 4 * j + 3]))
    nchunk = min(rows, ROW_CHUNKS)
    for c in prange(nchunk):
        # scratch per chunk of rows, not per row
        qw = np.empty(nb * 32, np.int8)
        dw = np.empty(nb, np.float32)
        mw = np.zeros(nb, np.float32)
        isum = np.empty(nb * 8, np.int32)
        acc = np.empty(8, np.float32)
        for r in range(c * rows // nchunk, (c + 1) * rows // nchunk):
            _decode_ints(raw[r], qw, dw, mw, f16, head, pair, bsz, off)
            for i in range(m):
                a = aq[i]
                for j in range(nb * 8):
                    k = 4 * j
                    isum[j] = (np.int32(qw[k]) * np.int32(a[k]) + np.int32(qw[k + 1]) * np.int32(a[k + 1])
                               + np.int32(qw[k + 2]) * np.int32(a[k + 2])
                               + np.int32(qw[k + 3]) * np.int32(a[k + 3]) + off * alanes[i, j])
                acc[:] = 0
                summs = _F32_0
                for b in range(nb):
                    d = dw[b] * ad[i, b]
                    if has_min:
                        summs = fma32(mw[b], asum[i, b], summs)
                    for lane in range(8):
                        acc[lane] = fma32(d, np.float32(isum[8 * b + lane]), acc[lane])
                out[i, r] = hsum8(acc) + summs if has_min else hsum8(acc)


# prange work items of the ggml block kernels: contiguous row ranges sharing one scratch allocation
ROW_CHUNKS = 64


# ---------------------------------------------------------------------------------------
# ggml numerics of the block types on SIMD integer dot products (x86 with AVX2)
# ---------------------------------------------------------------------------------------
# The same numbers as _matmul_ggml_blocks, in far fewer instructions per weight byte: a block's
# 32 quants are unpacked as unsigned bytes u (Q4_*: nibbles, Q5_*: nibbles | fifth bit << 4,
# Q8_0: the int8 quant + 128), and its 8 integer lane sums sum_{k<4} (u - off) * a are taken
# by one VPDPBUSD (AVX-512 VNNI) or VPMADDUBSW + VPMADDWD (AVX2) over the unsigned
# bytes, starting from -off * (the lane's 4 activation quants): integers, exact in any order,
# so every lane is the value ggml's sign-trick products give. Then one fma per lane and block
# into 8 float lanes, in block order, and hsum_float_8, exactly as _matmul_ggml_blocks.
# VPMADDUBSW saturates its int16 pair sums: 2 * 31 * 128 fits, 2 * 255 * 128 does not, so
# Q8_0 on AVX2 keeps its quants signed and takes ggml's own sign trick instead: VPSIGNB makes
# them |q| (unsigned, at most 128) and moves their signs onto the activation quants, whose pair
# sums 2 * 128 * 127 then fit. That needs activation quants in [-127, 127], which ggml's
# quantizer (round(x * 127 / amax)) always makes; hand-made activation bytes holding -128 take
# the portable kernel (i8_matmul_ggml checks).


# "vnni": VPDPBUSD on 256-bit vectors (AVX-512 VNNI with VL; an AVX-VNNI-only host takes "avx2",
# the encoding not tried here); "avx2": VPMADDUBSW + VPMADDWD; None: no integer path
I8_DOT = ("vnni" if "avx512vnni" in FEATURES and "avx512vl" in FEATURES
          else "avx2" if "avx2" in FEATURES else None)
# prefill tiles on 512-bit vectors (_step8 in _prefill_tile_i8): two activation rows per VPDPBUSD
# (AVX-512 VNNI on zmm registers, byte shuffles of AVX-512 BW)
I8_WIDE = I8_DOT == "vnni" and {"avx512f", "avx512bw"} <= FEATURES
# hosts with AVX-512 (32 vector registers hold two rows' accumulators and the step's constants):
# the fp32 matvec of Q4_0 / Q4_1 / Q5_0 / Q5_1 takes the 512-bit block step (_fma_u4x32_wide,
# table permutes: AVX-512 only) by far row pairs; elsewhere the 256-bit step, one row at a time
# (tuned on znver3, AVX2)
WIDE_STEPS = "avx512f" in FEATURES


def vector_of(t, n):
    return ir.VectorType(t, n)


I8T, _I16T = ir.IntType(8), ir.IntType(16)


def ir_unpack_u8x32(context, builder, wty, w, wo, qhty, qh, nbits, signed=False):
    """One block's 32 quants as a <32 x i8> of unsigned values: ``nbits`` 4 (the 16 bytes at
    w[wo:] hold element j in the low nibble of byte j and j + 16 in its high one), 5 (those
    nibbles | bit k of the uint32 ``qh`` << 4) or 8 (the 32 int8 at w[wo:] + 128; with
    ``signed``, the int8 themselves, for :func:`ir_lane_sums`' sign trick)."""
    v32 = vector_of(I8T, 32)
    if nbits == 8:
        q = builder.load(ir_ptr(context, builder, wty, w, wo, v32), align=1)
        return q if signed else builder.xor(q, ir.Constant(v32, [0x80] * 32))
    q16 = builder.load(ir_ptr(context, builder, wty, w, wo, vector_of(I8T, 16)), align=1)
    # the high nibbles by a 16-bit shift of the 16 bytes (no byte shifts on x86)
    hi = builder.bitcast(builder.lshr(builder.bitcast(q16, vector_of(_I16T, 8)),
                                      ir.Constant(vector_of(_I16T, 8), [4] * 8)), vector_of(I8T, 16))
    q = builder.shuffle_vector(q16, hi, ir.Constant(vector_of(I32, 32), list(range(32))))
    q = builder.and_(q, ir.Constant(v32, [15] * 32))
    if nbits == 5:
        # byte k of the broadcast qh holds bits 8(k//8)..; element k tests bit k % 8
        h4 = builder.bitcast(_arg_i32(builder, qhty, qh), vector_of(I8T, 4))
        hb = builder.shuffle_vector(h4, h4, ir.Constant(vector_of(I32, 32), [k // 8 for k in range(32)]))
        set_ = builder.icmp_unsigned("!=", builder.and_(hb, ir.Constant(v32, [1 << (k % 8) for k in range(32)])),
                                     ir.Constant(v32, [0] * 32))
        q = builder.or_(q, builder.select(set_, ir.Constant(v32, [16] * 32), ir.Constant(v32, [0] * 32)))
    return q


def ir_lane_sums(builder, q, a, c, use_vnni, signed=False):
    """<8 x i32> c + (sum of 4 products of unsigned bytes q and signed bytes a per lane). With
    ``signed`` (VPSIGNB: x86 with AVX2, VNNI hosts included), q holds signed bytes and a values
    in [-127, 127]: the products |q| * (a with q's sign), the same sums, without saturating
    VPMADDUBSW's pair sums."""
    m = builder.module
    v32, v8 = vector_of(I8T, 32), vector_of(I32, 8)
    if signed:
        sign = cgutils.get_or_insert_function(m, ir.FunctionType(v32, [v32, v32]), "llvm.x86.avx2.psign.b")
        q, a = builder.call(sign, [q, q]), builder.call(sign, [a, q])
    if use_vnni:
        dp = cgutils.get_or_insert_function(m, ir.FunctionType(v8, [v8, v8, v8]), "llvm.x86.avx512.vpdpbusd.256")
        return builder.call(dp, [c, builder.bitcast(q, v8), builder.bitcast(a, v8)])
    ubs = cgutils.get_or_insert_function(m, ir.FunctionType(vector_of(_I16T, 16), [v32, v32]), "llvm.x86.avx2.pmadd.ub.sw")
    wd = cgutils.get_or_insert_function(m, ir.FunctionType(v8, [vector_of(_I16T, 16), vector_of(_I16T, 16)]),
                                        "llvm.x86.avx2.pmadd.wd")
    return builder.add(builder.call(wd, [builder.call(ubs, [q, a]), ir.Constant(vector_of(_I16T, 16), [1] * 16)]), c)


def ir_fma_lanes(context, builder, accty, acc, oo, d, s):
    """acc[oo:oo+8] = fma(splat(d), float32(s), acc[oo:oo+8]) for <8 x i32> s."""
    vf = vector_of(ir.FloatType(), 8)
    fma = ir_fma(builder, vf)
    ap = ir_ptr(context, builder, accty, acc, oo, vf)
    builder.store(builder.call(fma, [ir_splat(builder, d, vf), builder.sitofp(s, vf), builder.load(ap, align=4)]),
                  ap, align=4)


@intrinsic
def prefetch_at(typingctx, w, o):
    """Prefetch (for reading, into every cache level) the byte at offset ``o`` of 1-D array w.
    The address may lie past w's end: it is formed without an in-bounds assumption, and a
    prefetch never faults."""
    sig = types.void(w, o)

    def codegen(context, builder, signature, args):
        i64, p8 = ir.IntType(64), ir.IntType(8).as_pointer()
        a = context.make_array(signature.args[0])(context, builder, args[0])
        base = builder.ptrtoint(a.data, i64)
        off = builder.sext(args[1], i64) if args[1].type.width < 64 else args[1]
        ptr = builder.inttoptr(builder.add(base, off), p8)
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [p8, I32, I32, I32]),
                                           "llvm.prefetch.p0i8")
        builder.call(f, [ptr, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])
        return context.get_dummy_value()

    return sig, codegen


def _signed_quants(nbits: int, use_vnni: bool) -> bool:
    """Whether the integer path keeps a block's quants signed (Q8_0 on AVX2: the sign trick of
    :func:`ir_lane_sums`) instead of unsigned with an offset."""
    return nbits == 8 and not use_vnni


@intrinsic
def _fma_dot2(typingctx, w0, w1, wo, qh0, qh1, bits, a, ao, c, co, d0, d1, acc, vnni):
    """A decode step's block: for the blocks of rows w0 and w1 at byte wo (quants unpacked in
    registers by ir_unpack_u8x32, ``bits`` a literal), acc[8k:8k+8] = fma(d_k, float32(s),
    acc[8k:8k+8]) with the int32 lane sums s[l] = c[co + l] + sum_{j<4} u[4l + j] * a[ao + 4l + j]
    of row k's unsigned quants u: a int8 activation quants and c int32 (-off times their lane
    sums), loaded once for both rows; ``vnni`` (a literal) True: VPDPBUSD, False: VPMADDUBSW +
    VPMADDWD."""
    if not isinstance(bits, types.IntegerLiteral) or not isinstance(vnni, types.BooleanLiteral):
        return None
    nbits, use_vnni = bits.literal_value, vnni.literal_value
    sig = types.void(w0, w1, wo, qh0, qh1, bits, a, ao, c, co, d0, d1, acc, vnni)
    signed = _signed_quants(nbits, use_vnni)

    def codegen(context, builder, signature, args):
        wty, _, _, qhty, _, _, aty, _, cty, _, _, _, accty, _ = signature.args
        w0_, w1_, wo_, qh0_, qh1_, _, a_, ao_, c_, co_, d0_, d1_, acc_, _ = args
        av = builder.load(ir_ptr(context, builder, aty, a_, ao_, vector_of(I8T, 32)), align=1)
        cv = builder.load(ir_ptr(context, builder, cty, c_, co_, vector_of(I32, 8)), align=4)
        for k, (w_, qh_, d_) in enumerate(((w0_, qh0_, d0_), (w1_, qh1_, d1_))):
            q = ir_unpack_u8x32(context, builder, wty, w_, wo_, qhty, qh_, nbits, signed)
            ir_fma_lanes(context, builder, accty, acc_, ir.Constant(ir.IntType(64), 8 * k), d_,
                         ir_lane_sums(builder, q, av, cv, use_vnni, signed))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _fma_dot_tile(typingctx, ws, wo, qhs, bits, aq, ad, corr, rows4, b, dws, acc, vnni):
    """Prefill's step: the blocks b (at offset wo) of R weight rows ``ws`` (a tuple of uint8
    rows, with their ``qhs`` and scales ``dws``), each unpacked once, against the activation
    rows rows4 = (i0, i1, i2, i3) of aq int8[m, n], ad float32[m, nb] and corr int32[m, nb * 8]:
    for each t and k, acc[8(Rt + k):8(Rt + k) + 8] takes the :func:`_fma_dot2` step of row k
    and activation row i_t with d = dws[k] * ad[i_t, b] (a float32 product). Constant
    accumulator offsets: LLVM keeps the 4R fma chains in registers across blocks."""
    if not isinstance(bits, types.IntegerLiteral) or not isinstance(vnni, types.BooleanLiteral):
        return None
    nbits, use_vnni = bits.literal_value, vnni.literal_value
    nrow = len(ws)
    sig = types.void(ws, wo, qhs, bits, aq, ad, corr, rows4, b, dws, acc, vnni)
    signed = _signed_quants(nbits, use_vnni)

    def codegen(context, builder, signature, args):
        wsty, _, qhsty, _, aqty, adty, cty, _, _, _, accty, _ = signature.args
        ws_, wo_, qhs_, _, aq_, ad_, c_, r4_, b_, dws_, acc_, _ = args
        i64 = ir.IntType(64)
        qs = [ir_unpack_u8x32(context, builder, wsty[k], builder.extract_value(ws_, k), wo_, qhsty[k],
                              builder.extract_value(qhs_, k), nbits, signed) for k in range(nrow)]
        dw = [builder.extract_value(dws_, k) for k in range(nrow)]
        b64 = builder.sext(b_, i64) if b_.type.width < 64 else b_
        aqa = context.make_array(aqty)(context, builder, aq_)
        ada = context.make_array(adty)(context, builder, ad_)
        ca = context.make_array(cty)(context, builder, c_)

        def ptr(aty, arr, idx, vty):
            p = cgutils.get_item_pointer(context, builder, aty, arr, idx, wraparound=False)
            return builder.bitcast(p, vty.as_pointer())

        for t in range(4):
            i = builder.extract_value(r4_, t)
            i = builder.sext(i, i64) if i.type.width < 64 else i
            av = builder.load(ptr(aqty, aqa, [i, builder.mul(b64, ir.Constant(i64, 32))], vector_of(I8T, 32)), align=1)
            cv = builder.load(ptr(cty, ca, [i, builder.mul(b64, ir.Constant(i64, 8))], vector_of(I32, 8)), align=4)
            da = builder.load(cgutils.get_item_pointer(context, builder, adty, ada, [i, b64], wraparound=False))
            for k in range(nrow):
                ir_fma_lanes(context, builder, accty, acc_, ir.Constant(i64, 8 * (nrow * t + k)),
                             builder.fmul(dw[k], da), ir_lane_sums(builder, qs[k], av, cv, use_vnni, signed))
        return context.get_dummy_value()

    return sig, codegen


# bytes ahead of the block being read that _matmul_ggml_i8 prefetches in each of its two rows
# (Q4_0 5632 x 2048, 24 matrices in turn so that they stream from memory, AMD EPYC znver4: one
# thread 6.9 -> 11.0-11.7 GB/s with 256-1024, two threads 11.4 -> 16-19 GB/s)
PREFETCH_BYTES = 768


@jit.njit(inline="always")
def _matmul_ggml_i8(raw, aq, ad, asum, corr, out, f16, head, bsz, qo, bits, has_min, vnni, act_rows, step,
                    lanes, nacc, nmin):
    """_matmul_ggml_blocks' results through _fma_dot2 (decode) and _fma_dot_tile (prefill).
    Two weight rows per work item, r and r + ceil(rows / 2): two fma chains in flight when
    m == 1 (a decode step's matvec), and two memory streams far apart, prefetched
    PREFETCH_BYTES bytes ahead (two adjacent rows read block by block streamed at 4 GB/s, the
    far pair at 7, prefetched at 11: the hardware prefetchers alone fall behind). With m > 1
    the even work items take tiles of four rows (theirs and the next item's), each block
    unpacked once for a group of activation rows (:func:`_prefill_tile_i8`; ``act_rows`` ..
    ``nmin``: its tile, TILE_4X4 or TILE_4X8)."""
    rows = raw.shape[0]
    m = aq.shape[0]
    nb = ad.shape[1]
    half = (rows + 1) // 2
    for p in prange(half):
        r0, r1 = far_pair(p, half, rows)
        w0 = raw[r0]
        w1 = raw[r1]
        if m == 1:
            acc = stack_f32(16)                # registers across the blocks (stack_f32)
            acc[:] = 0.0
            summs = stack_f32(2)
            summs[:] = 0.0
            # a decode step's matvec: quants unpacked in registers, the accumulators at constant
            # addresses (LLVM keeps both fma chains in registers; through the loop over i they
            # would go through memory, a store-to-load forwarding per block on each chain)
            a0 = aq[0]
            c0 = corr[0]
            for b in range(nb):
                o = b * bsz
                prefetch_at(w0, o + PREFETCH_BYTES)
                prefetch_at(w1, o + PREFETCH_BYTES)
                d0, m0, h0 = head(w0, o, f16)
                d1, m1, h1 = head(w1, o, f16)
                da = ad[0, b]
                _fma_dot2(w0, w1, o + qo, h0, h1, bits, a0, b * 32, c0, b * 8, d0 * da, d1 * da, acc, vnni)
                if has_min:
                    summs[0] = fma32(m0, asum[0, b], summs[0])
                    summs[1] = fma32(m1, asum[0, b], summs[1])
            out[0, r0] = hsum8(acc[0:8]) + summs[0] if has_min else hsum8(acc[0:8])
            out[0, r1] = hsum8(acc[8:16]) + summs[1] if has_min else hsum8(acc[8:16])
            continue
        if p % 2:                        # prefill: four rows per tile, made by the even items
            continue
        _prefill_tile_i8(raw, aq, ad, asum, corr, out, f16, head, bsz, qo, bits, has_min, vnni,
                         r0, min(r0 + 1, half - 1), half, act_rows, step, lanes, nacc, nmin)


@jit.njit(inline="always")
def _act_rows4(g, m):
    """Activation rows g .. g + 3 of a prefill tile, the last repeated past m."""
    return (g, min(g + 1, m - 1), min(g + 2, m - 1), min(g + 3, m - 1))


@jit.njit(inline="always")
def _act_rows8(g, m):
    """Activation rows g .. g + 7 of a wide prefill tile, the last repeated past m."""
    return (g, min(g + 1, m - 1), min(g + 2, m - 1), min(g + 3, m - 1),
            min(g + 4, m - 1), min(g + 5, m - 1), min(g + 6, m - 1), min(g + 7, m - 1))


@jit.njit(inline="always")
def _step4(ws, wo, qhs, bits, aq, ad, corr, rows, b, dws, acc, vnni):
    """A block of the four weight rows against four activation rows (:func:`_fma_dot_tile`);
    the 8 lanes of weight row k and activation row t at acc[8(4t + k)]."""
    _fma_dot_tile(ws, wo, qhs, bits, aq, ad, corr, rows, b, dws, acc, vnni)


@jit.njit(inline="always")
def _step8(ws, wo, qhs, bits, aq, ad, corr, rows, b, dws, acc, vnni):
    """A block of the four weight rows against eight activation rows, two per 512-bit vector
    (:func:`_fma_dot_tile_wide`, VNNI); the 8 lanes of weight row k and activation row t at
    acc[16(4(t // 2) + k) + 8(t % 2)]."""
    _fma_dot_tile_wide(ws, wo, qhs, bits, aq, ad, corr, rows, b, dws, acc)


@jit.njit(inline="always")
def _lanes4(t, k):
    return 8 * (4 * t + k)


@jit.njit(inline="always")
def _lanes8(t, k):
    return 16 * (4 * (t // 2) + k) + 8 * (t % 2)


# a prefill tile's arguments of _matmul_ggml_i8 (as specialization source): four weight rows by
# four activation rows (ymm), or by eight, two per zmm ("vnni512")
TILE_4X4 = "_act_rows4, _step4, _lanes4, 128, 16"
TILE_4X8 = "_act_rows8, _step8, _lanes8, 256, 32"


@jit.njit(inline="always")
def _prefill_tile_i8(raw, aq, ad, asum, corr, out, f16, head, bsz, qo, bits, has_min, vnni, p0, p1, half,
                     act_rows, step, lanes, nacc, nmin):
    """The rows of work items p0 and p1 of _matmul_ggml_i8 (p0, p0 + half, p1, p1 + half, each
    clamped to the last row) against every activation row, a group at a time (a short last
    group repeats its last row: the same values computed again and written again). The tile
    (TILE_4X4 or TILE_4X8): the group's rows (_act_rows4 / _act_rows8), the block step
    (_step4 / _step8), where a pair's lanes are (_lanes4 / _lanes8), and the float32 count of
    the lane and min accumulators (literals)."""
    rows = raw.shape[0]
    m = aq.shape[0]
    nb = ad.shape[1]
    rr = (p0, min(p0 + half, rows - 1), p1, min(p1 + half, rows - 1))
    ws = (raw[rr[0]], raw[rr[1]], raw[rr[2]], raw[rr[3]])
    acc = stack_f32(nacc)                      # registers across the blocks (stack_f32)
    smin = stack_f32(nmin)
    for g in range(0, m, nmin // 4):
        rows_t = act_rows(g, m)
        acc[:] = 0
        smin[:] = 0
        for b in range(nb):
            o = b * bsz
            d0, m0, h0 = head(ws[0], o, f16)
            d1, m1, h1 = head(ws[1], o, f16)
            d2, m2, h2 = head(ws[2], o, f16)
            d3, m3, h3 = head(ws[3], o, f16)
            step(ws, o + qo, (h0, h1, h2, h3), bits, aq, ad, corr, rows_t, b, (d0, d1, d2, d3), acc, vnni)
            if has_min:
                for t in range(len(rows_t)):
                    sa = asum[rows_t[t], b]
                    smin[4 * t] = fma32(m0, sa, smin[4 * t])
                    smin[4 * t + 1] = fma32(m1, sa, smin[4 * t + 1])
                    smin[4 * t + 2] = fma32(m2, sa, smin[4 * t + 2])
                    smin[4 * t + 3] = fma32(m3, sa, smin[4 * t + 3])
        for t in range(len(rows_t)):
            for k in range(4):
                a0 = lanes(t, k)
                v = hsum8(acc[a0:a0 + 8])
                out[rows_t[t], rr[k]] = v + smin[4 * t + k] if has_min else v


@intrinsic
def _fma_dot_tile_wide(typingctx, ws, wo, qhs, bits, aq, ad, corr, rows, b, dws, acc):
    """:func:`_fma_dot_tile` (VNNI) for an even number of activation rows ``rows``, two per
    512-bit vector: for pair p (rows i = rows[2p], j = rows[2p + 1]) and weight row k,
    acc[16(Rp + k):16(Rp + k) + 16] holds row i's 8 lanes then row j's, and takes one VPDPBUSD
    over row k's unpacked block (duplicated into both halves) and the two rows' activation
    quants, one conversion, one product d = dws[k] * ad[., b] per lane (each half its own row's
    float32 product) and one fma: lane for lane the operations of _fma_dot_tile, so the same
    bits, with half the vector instructions on cores that run 512-bit vectors at full width."""
    if not isinstance(bits, types.IntegerLiteral) or len(rows) % 2:
        return None
    nbits = bits.literal_value
    nrow, npair = len(ws), len(rows) // 2
    sig = types.void(ws, wo, qhs, bits, aq, ad, corr, rows, b, dws, acc)

    def codegen(context, builder, signature, args):
        wsty, _, qhsty, _, aqty, adty, cty, _, _, _, accty = signature.args
        ws_, wo_, qhs_, _, aq_, ad_, c_, rows_, b_, dws_, acc_ = args
        i64 = ir.IntType(64)
        vf16 = vector_of(ir.FloatType(), 16)
        v16 = vector_of(I32, 16)
        both = ir.Constant(vector_of(I32, 64), list(range(32)) * 2)
        cat64 = ir.Constant(vector_of(I32, 64), list(range(64)))
        cat16 = ir.Constant(vector_of(I32, 16), list(range(16)))
        q2 = []
        for k in range(nrow):
            q = ir_unpack_u8x32(context, builder, wsty[k], builder.extract_value(ws_, k), wo_, qhsty[k],
                                builder.extract_value(qhs_, k), nbits)
            q2.append(builder.bitcast(builder.shuffle_vector(q, q, both), v16))
        dw = [ir_splat(builder, builder.extract_value(dws_, k), vf16) for k in range(nrow)]
        b64 = builder.sext(b_, i64) if b_.type.width < 64 else b_
        aqa = context.make_array(aqty)(context, builder, aq_)
        ada = context.make_array(adty)(context, builder, ad_)
        ca = context.make_array(cty)(context, builder, c_)
        dp = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16, v16, v16]),
                                            "llvm.x86.avx512.vpdpbusd.512")
        fma = ir_fma(builder, vf16)

        def ptr(aty, arr, idx, vty):
            p = cgutils.get_item_pointer(context, builder, aty, arr, idx, wraparound=False)
            return builder.bitcast(p, vty.as_pointer())

        for p in range(npair):
            avs, cvs, das = [], [], []
            for t in (2 * p, 2 * p + 1):
                i = builder.extract_value(rows_, t)
                i = builder.sext(i, i64) if i.type.width < 64 else i
                avs.append(builder.load(ptr(aqty, aqa, [i, builder.mul(b64, ir.Constant(i64, 32))],
                                            vector_of(I8T, 32)), align=1))
                cvs.append(builder.load(ptr(cty, ca, [i, builder.mul(b64, ir.Constant(i64, 8))],
                                            vector_of(I32, 8)), align=4))
                das.append(ir_splat(builder, builder.load(cgutils.get_item_pointer(
                    context, builder, adty, ada, [i, b64], wraparound=False)), vector_of(ir.FloatType(), 8)))
            av = builder.bitcast(builder.shuffle_vector(avs[0], avs[1], cat64), v16)
            cv = builder.shuffle_vector(cvs[0], cvs[1], cat16)
            da = builder.shuffle_vector(das[0], das[1], cat16)
            for k in range(nrow):
                s = builder.call(dp, [cv, q2[k], av])
                ap = ir_ptr(context, builder, accty, acc_, ir.Constant(i64, 16 * (nrow * p + k)), vf16)
                builder.store(builder.call(fma, [builder.fmul(dw[k], da), builder.sitofp(s, vf16),
                                                 builder.load(ap, align=4)]), ap, align=4)
        return context.get_dummy_value()

    return sig, codegen


@jit.njit
def _split_act_i8(xq, bsz, off, aq, ad, asum, corr, f16):
    """Q8_0 (bsz 34) / Q8_1 (bsz 36) activation bytes uint8[m, nb*bsz] -> quants aq int8[m, nb*32],
    d and s float32[m, nb] (s: Q8_1 only), and corr[i, l] = -off * (the sum of quants 4l .. 4l+3
    of row i), int32[m, nb*8]; on the calling thread (a decode step's row: microseconds).
    Returns the smallest quant (0 if none is negative): -128 is one ggml's quantizer never
    makes, which the sign trick cannot take (i8_matmul_ggml)."""
    m = xq.shape[0]
    nb = ad.shape[1]
    oq = bsz - 32
    lowest = np.int32(0)
    for i in range(m):
        for b in range(nb):
            o = b * bsz
            ad[i, b] = f16[load_u16(xq[i], o)]
            if oq == 4:
                asum[i, b] = f16[load_u16(xq[i], o + 2)]
            for k in range(32):
                v = _s8(xq[i, o + oq + k])
                lowest = min(lowest, v)
                aq[i, b * 32 + k] = np.int8(v)
            for l in range(8):
                j = b * 32 + 4 * l
                corr[i, b * 8 + l] = -off * (np.int32(aq[i, j]) + np.int32(aq[i, j + 1])
                                             + np.int32(aq[i, j + 2]) + np.int32(aq[i, j + 3]))
    return lowest


# ---------------------------------------------------------------------------------------
# ggml numerics of the float types (their own code: ggml's float dot products)
# ---------------------------------------------------------------------------------------


@jit.njit(parallel=True)
def _matmul_ggml_f32(w, xa, out, f16):
    """ggml_vec_dot_f32 (AVX-512): 4x16 FMA lanes, reduce; tail: whole 16-element chunks as
    mul then add, the rest fused. w: float32[rows, n], xa: float32[m, n]."""
    rows, n = w.shape
    npart = n & ~63
    for r in prange(rows):
        acc = stack_f32(64)
        for i in range(xa.shape[0]):
            s = _ggml_lanes64(w[r], xa[i], npart, acc)
            j = npart
            while j + 16 <= n:
                for k in range(16):
                    s = s + np.float32(w[r, j + k] * xa[i, j + k])
                j += 16
            for jj in range(j, n):
                s = fma32(w[r, jj], xa[i, jj], s)
            out[i, r] = s


@jit.njit(parallel=True)
def _matmul_ggml_f16(h, ha, out, f16):
    """ggml_vec_dot_f16 (AVX-512, no FP16 arithmetic): 4x16 FMA lanes, tail summed in double.
    h: uint16[rows, n], ha: uint16[m, n] fp16 bits."""
    rows, n = h.shape
    npart = n & ~63
    for r in prange(rows):
        acc = stack_f32(64)
        for i in range(ha.shape[0]):
            s = np.float64(_ggml_lanes64(h[r], ha[i], npart, acc))
            for j in range(npart, n):
                s += np.float64(f16[h[r, j]] * f16[ha[i, j]])
            out[i, r] = np.float32(s)


@intrinsic
def _dot_bf16x64(typingctx, acc, w, a, j0):
    """One 64-element step of vdpbf16ps on two 16-lane accumulators: for c < 2, k < 16 and
    j = j0 + 32c + 2k, acc[16c + k] = (acc[16c + k] + w[j+1] a[j+1]) + w[j] a[j], with w, a
    bf16 bits (uint16) widened exactly and the products and sums rounded as the scalar loop
    rounds them, 16 lanes at a time."""
    sig = types.void(acc, w, a, j0)

    def codegen(context, builder, signature, args):
        accty, wty, aty, _ = signature.args
        acc_, w_, a_, j0_ = args
        i16, i32 = ir.IntType(16), ir.IntType(32)
        v32h, v16i, vf = ir.VectorType(i16, 32), ir.VectorType(i32, 16), ir.VectorType(ir.FloatType(), 16)
        even = ir.Constant(v16i, list(range(0, 32, 2)))
        odd = ir.Constant(v16i, list(range(1, 32, 2)))

        def halves(ty, arr, c):          # (even, odd) elements of 32 at j0 + 32c, as floats
            idx = builder.add(j0_, ir.Constant(j0_.type, 32 * c))
            v = builder.load(ir_ptr(context, builder, ty, arr, idx, v32h), align=2)
            return [builder.bitcast(builder.shl(builder.zext(builder.shuffle_vector(v, v, sel), v16i),
                                                ir.Constant(v16i, [16] * 16)), vf) for sel in (even, odd)]
        for c in range(2):
            (we, wo), (ae, ao) = halves(wty, w_, c), halves(aty, a_, c)
            ap = ir_ptr(context, builder, accty, acc_, ir.Constant(ir.IntType(64), 16 * c), vf)
            s = builder.fadd(builder.load(ap, align=4), builder.fmul(wo, ao))
            builder.store(builder.fadd(s, builder.fmul(we, ae)), ap, align=4)
        return context.get_dummy_value()

    return sig, codegen


@jit.njit(parallel=True)
def _matmul_ggml_bf16(h, ha, out, f16):
    """ggml_vec_dot_bf16 (AVX512-BF16): two 16-lane vdpbf16ps accumulators, double tail.
    h: uint16[rows, n], ha: uint16[m, n] bf16 bits."""
    rows, n = h.shape
    npart = n & ~63
    for r in prange(rows):
        hr = h[r]
        acc = stack_f32(32)
        for i in range(ha.shape[0]):
            ar = ha[i]
            acc[:] = 0
            for j0 in range(0, npart, 64):
                _dot_bf16x64(acc, hr, ar, j0)
            s = np.float64(_reduce16(acc, 0))
            s += np.float64(_reduce16(acc, 16))
            for j in range(npart, n):
                s += np.float64(_elem_bf16(hr, j, f16) * _elem_bf16(ar, j, f16))
            out[i, r] = np.float32(s)


# ---------------------------------------------------------------------------------------
# public wrappers: raw is uint8[rows, row_bytes]
# ---------------------------------------------------------------------------------------


def _split_act_blocks(xq: np.ndarray, with_sum: bool):
    """Q8_0 / Q8_1 activation bytes uint8[m, nb*bsz] -> (int8[m, nb*32], d float32[m, nb], s float32[m, nb])."""
    bsz = 36 if with_sum else 34
    m = xq.shape[0]
    blk = xq.reshape(m, -1, bsz)
    nb = blk.shape[1]
    head = 4 if with_sum else 2
    aq = np.ascontiguousarray(blk[:, :, head:]).view(np.int8).reshape(m, nb * 32)
    ad = np.ascontiguousarray(blk[:, :, 0:2]).view(np.float16).reshape(m, nb).astype(np.float32)
    if with_sum:
        asum = np.ascontiguousarray(blk[:, :, 2:4]).view(np.float16).reshape(m, nb).astype(np.float32)
    else:
        asum = ad
    return aq, ad, asum


def _float_kernels(qtype: QT, elem: str, dtype, mm, mac32: str) -> TypeKernels:
    """One float type's kernels (``_matvec_f16`` etc.) and wrappers (rows viewed as ``dtype``)."""
    t = qtype.name.lower()
    mv = jit.specialize(globals(), f"_matvec_{t}", "h, x, out, f16",
                        f"_matvec_elems(h, x, out, f16, {elem}, {mac32})", parallel=True)
    if qtype == QT.F32:
        def dequantize(raw, out):
            out[...] = raw.view(dtype)
    else:
        deq = jit.specialize(globals(), f"_dequantize_{t}", "h, out, f16",
                             f"_dequantize_elems(h, out, f16, {elem})", parallel=True)

        def dequantize(raw, out):
            deq(raw.view(dtype), out, F16_TO_F32)

    def matvec(raw, x, out):
        mv(raw.view(dtype), x, out, F16_TO_F32)

    def matmul_ggml(raw, xa, out):
        mm(raw.view(dtype), xa.view(dtype), out, F16_TO_F32)

    return _named(t, TypeKernels(dequantize, matvec, qtype, matmul_ggml))


def quant_kernels(ns: dict, qtype: QT, act_type: QT, split_act, deq_call: str, mv_call: str,
                   mm_params: str, mm_call: str) -> TypeKernels:
    """One quantized type's three kernels (``_dequantize_q4_0``, ``_matvec_q4_0``,
    ``_matmul_ggml_q4_0``), specialized in the module of globals ``ns`` from one driver call
    each, and their wrappers; ``split_act`` turns ggml activation bytes into the arrays the
    ggml kernel takes before ``out``."""
    t = qtype.name.lower()
    deq = jit.specialize(ns, f"_dequantize_{t}", "raw, out, f16", deq_call, parallel=True)
    mv = jit.specialize(ns, f"_matvec_{t}", "raw, raw1, raw2, x, out, f16", mv_call, parallel=True)
    mm = jit.specialize(ns, f"_matmul_ggml_{t}", f"raw, {mm_params}, out, f16", mm_call, parallel=True)

    def dequantize(raw, out):
        deq(raw, out, F16_TO_F32)

    def matvec(raw, x, out):
        mv(raw, NO_ROWS, NO_ROWS, x, out, F16_TO_F32)

    def matvec_group(raws, x, out):
        mv(*raws, *(NO_ROWS,) * (3 - len(raws)), x, out, F16_TO_F32)

    def matmul_ggml(raw, xq, out):
        mm(raw, *split_act(xq), out, F16_TO_F32)

    return _named(t, TypeKernels(dequantize, matvec, act_type, matmul_ggml, matvec_group=matvec_group))


def _matvec_call(qtype: QT, wide: bool) -> str:
    """The fp32 matvec driver call of a block type: for Q4_0 / Q4_1 / Q5_0 / Q5_1 with the
    512-bit block step by far row pairs (``wide``, see WIDE_STEPS) or the 256-bit step row by
    row; Q8_0 by far row pairs (FAR_PAIR_MATVEC). Both steps hold element L in lane L: the same
    products in the same lanes, the same sums (a zero weight's sign aside, see ir_u4_groups)."""
    _, _, bsz, _, _, _, vec = _BLOCK_TYPES[qtype]
    u4 = vec in _U4_STEPS
    far = qtype in _FAR_PAIR_ALWAYS or (u4 and wide)
    driver = "_matvec_blocks_far_pairs" if far else "_matvec_blocks"
    return f"{driver}(raw, raw1, raw2, x, out, f16, {bsz}, {vec}{'_wide' if u4 and wide else ''})"


def u4_matvec(qtype: QT, wide: bool):
    """The fp32 matvec kernel ``(raw, raw1, raw2, x, out, f16)`` of a Q4_0 / Q4_1 / Q5_0 / Q5_1
    with the block step and driver ``wide`` picks (:func:`_matvec_call`), whatever the host's
    choice (WIDE_STEPS), for the tests; the 512-bit step needs AVX-512."""
    qtype = QT(qtype)
    if _BLOCK_TYPES[qtype][-1] not in _U4_STEPS:
        raise ValueError(f"{qtype.name} has no 4/5-bit block step")
    if wide and not WIDE_STEPS:
        raise ValueError("the 512-bit block step needs AVX-512 (this target has no avx512f)")
    name = f"_matvec_{qtype.name.lower()}_{'wide' if wide else 'narrow'}"
    return globals().get(name) or jit.specialize(globals(), name, "raw, raw1, raw2, x, out, f16",
                                                 _matvec_call(qtype, wide), parallel=True)


def _block_kernels(qtype: QT, head: str, pair: str, bsz: int, has_min: bool, off: int,
                   act_type: QT, vec: str) -> TypeKernels:
    """A block type's kernels; ggml activations are Q8_0 or Q8_1 blocks. Where the host has
    the integer dot products (I8_DOT), ggml numerics run _matmul_ggml_i8; the portable kernel
    stays in PORTABLE_GGML (the tests compare the two)."""
    dec = f"{head}, {pair}, {bsz}, {has_min}"
    with_sum = act_type == QT.Q8_1
    k = quant_kernels(globals(), qtype, act_type, lambda xq: _split_act_blocks(xq, with_sum),
                       f"_dequantize_blocks(raw, out, f16, deq_{qtype.name.lower()}, {bsz})",
                       _matvec_call(qtype, WIDE_STEPS),
                       "aq, ad, asum", f"_matmul_ggml_blocks(raw, aq, ad, asum, out, f16, {dec}, {off})")
    PORTABLE_GGML[qtype] = k.matmul_ggml
    variant = ("vnni512" if I8_WIDE else I8_DOT) if I8_DOT is not None and I8_DOT in i8_variants(qtype) else None
    if variant is None:
        return k
    mm = i8_matmul_ggml(qtype, variant)

    def matvec_ggml(raw, x, out):
        mm(raw, _quantize_act_blocks(x, with_sum), out.reshape(1, -1))

    matvec_ggml.__name__ = matvec_ggml.__qualname__ = f"matvec_ggml_{qtype.name.lower()}"
    return k._replace(matmul_ggml=mm, matvec_ggml=matvec_ggml)


def i8_variants(qtype: QT) -> tuple:
    """The integer dot-product variants ("vnni512", "vnni", "avx2") that compute ``qtype``'s
    ggml numerics exactly: every legacy block type has all three (Q8_0's "avx2" by the sign
    trick, see above). "vnni512" is "vnni" with prefill tiles on 512-bit vectors (a host with
    I8_WIDE)."""
    return ("vnni512", "vnni", "avx2") if QT(qtype) in _I8_LAYOUT else ()


def i8_matmul_ggml(qtype: QT, variant: str):
    """The ggml-numerics wrapper ``matmul_ggml(raw, xq, out)`` of a block type on
    _matmul_ggml_i8 with the instructions of ``variant`` (one of :func:`i8_variants`; the
    host must have them: see I8_DOT)."""
    qtype = QT(qtype)
    if variant not in i8_variants(qtype):
        raise ValueError(f"{qtype.name} has no exact {variant!r} integer path")
    head, _, bsz, has_min, _, act_type, _ = _BLOCK_TYPES[qtype]
    bits, qo, uoff = _I8_LAYOUT[qtype]
    signed = _signed_quants(bits, variant != "avx2")
    if signed:
        uoff = 0                              # the quants stay signed: no offset to take back
    portable = PORTABLE_GGML[qtype]           # _block_kernels made it first
    with_sum = act_type == QT.Q8_1
    t = qtype.name.lower()
    name = f"_matmul_ggml_i8_{t}_{variant}"
    mm = globals().get(name) or jit.specialize(
        globals(), name, "raw, aq, ad, asum, corr, out, f16",
        f"_matmul_ggml_i8(raw, aq, ad, asum, corr, out, f16, {head}, {bsz}, {qo}, {bits}, {has_min}, "
        f"{variant != 'avx2'}, {TILE_4X8 if variant == 'vnni512' else TILE_4X4})",
        parallel=True)

    bsz_act = 36 if with_sum else 34

    def matmul_ggml(raw, xq, out):
        m, nb = xq.shape[0], xq.shape[1] // bsz_act
        aq = np.empty((m, nb * 32), np.int8)
        ad = np.empty((m, nb), np.float32)
        asum = np.empty((m, nb), np.float32)
        corr = np.empty((m, nb * 8), np.int32)
        lowest = _split_act_i8(xq, bsz_act, np.int32(uoff), aq, ad, asum, corr, F16_TO_F32)
        if signed and lowest == -128:             # not from ggml's quantizer: the sign trick
            portable(raw, xq, out)                # would overflow, the portable sums do not
            return
        mm(raw, aq, ad, asum, corr, out, F16_TO_F32)

    matmul_ggml.__name__ = matmul_ggml.__qualname__ = f"matmul_ggml_{t}"
    return matmul_ggml


# fp32 matvec by far row pairs, prefetched: Q8_0 (Gemma 3 270M's 262144 x 640 output head, two
# threads, AMD EPYC znver4: 14.3-18.8 -> 10.2-12.2 ms, bit-identical); Q5_0 with the 256-bit
# step gained nothing on its 81 layer matrices (6.6-7.0 ms either way: its block step, not
# memory, was the limit). With the 512-bit step (WIDE_STEPS), two threads, AMD EPYC znver5, the
# four 4/5-bit types run by far pairs too: Gemma's 81 Q5_0 matrices 16.6-17.0 -> 23.3 GB/s (22.0
# with the wide step alone), TinyLlama-shape layer matrices Q4_0 23.5 -> 31.0-31.5, Q4_1
# 22.5-23.3 -> 30.1-30.3, Q5_1 17.9-18.1 -> 25.6-27.5 GB/s (the wide step alone: 23.6-25.0,
# 20.4-21.4, 21.5-22.2): its lighter step leaves each row's one FMA chain a block the limit
_FAR_PAIR_ALWAYS = frozenset({QT.Q8_0})
# the 4/5-bit types' block steps (a 256-bit and a 512-bit one each)
_U4_STEPS = frozenset({"_fma_q4_0", "_fma_q4_1", "_fma_q5_0", "_fma_q5_1"})
# the types whose fp32 matvec runs by far row pairs on this host
FAR_PAIR_MATVEC = _FAR_PAIR_ALWAYS | (frozenset({QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1}) if WIDE_STEPS
                                     else frozenset())
# block type -> (bits of the unsigned quants ir_unpack_u8x32 makes, offset of the quants in the
# block, offset subtracted from them to get ggml's signed quants)
_I8_LAYOUT = {QT.Q4_0: (4, 2, 8), QT.Q4_1: (4, 4, 0), QT.Q5_0: (5, 6, 16), QT.Q5_1: (5, 8, 0),
              QT.Q8_0: (8, 2, 128)}
# the portable ggml-numerics kernel of each block type (_matmul_ggml_blocks)
PORTABLE_GGML: dict = {}


def _named(t: str, k: TypeKernels) -> TypeKernels:
    """Name the wrappers ``matvec_q4_0`` etc. (profiles, tracebacks)."""
    for f in (k.dequantize, k.matvec, k.matmul_ggml) + ((k.matvec_group,) if k.matvec_group else ()):
        f.__name__ = f.__qualname__ = f"{f.__name__}_{t}"
    return k


# ---------------------------------------------------------------------------------------
# kernel table
# ---------------------------------------------------------------------------------------

# float type: element decoder, element dtype of a row view, ggml-numerics kernel, fp32 matvec step
_FLOAT_TYPES = {
    QT.F32: ("_elem_f32", np.float32, _matmul_ggml_f32, "_mac32_elems"),
    QT.F16: ("_elem_f16", np.uint16, _matmul_ggml_f16, "_mac32_f16"),
    QT.BF16: ("_elem_bf16", np.uint16, _matmul_ggml_bf16, "_mac32_elems"),
}
# block type: decoder (head, pair), bytes per block, minimum, ggml quant offset (Q5_1's
# quants are decoded as q - 16: LLVM vectorizes that signed decode, not the unsigned one),
# ggml activation type, fp32 matvec block step
_BLOCK_TYPES = {
    QT.Q4_0: ("head_d", "pair_q4_0", 18, False, 0, QT.Q8_0, "_fma_q4_0"),
    QT.Q4_1: ("head_dm", "pair_q4_1", 20, True, 0, QT.Q8_1, "_fma_q4_1"),
    QT.Q5_0: ("head_d_qh", "pair_q5_0", 22, False, 0, QT.Q8_0, "_fma_q5_0"),
    QT.Q5_1: ("head_dm_qh", "pair_q5_1", 24, True, 16, QT.Q8_1, "_fma_q5_1"),
    QT.Q8_0: ("head_d", "pair_q8_0", 34, False, 0, QT.Q8_0, "_mac_q8_0"),
}

KERNELS: dict[QT, TypeKernels] = {
    **{qt: _float_kernels(qt, *row) for qt, row in _FLOAT_TYPES.items()},
    **{qt: _block_kernels(qt, *row) for qt, row in _BLOCK_TYPES.items()},
}

# activation converters by act_type: float32[m, n] -> uint8[m, act_row_bytes] (float32 for F32)
ACT_CONVERTERS = {
    QT.F32: convert_act_f32,
    QT.F16: convert_act_f16,
    QT.BF16: convert_act_bf16,
    QT.Q8_0: quantize_act_q8_0,
    QT.Q8_1: quantize_act_q8_1,
}


# ---------------------------------------------------------------------------------------
# plain NumPy references (test oracles beside the kernels)
# ---------------------------------------------------------------------------------------

_BLOCK_BYTES = {t: type_size(t) for t in (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0)}


def _ref_f16(b: np.ndarray) -> np.ndarray:
    """uint8[..., 2] little-endian fp16 bytes -> float32[...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _ref_ints(qtype: QT, raw: np.ndarray):
    """Block fields of a legacy type: (q int32[rows, nb, 32] unsigned quants, d, m float32[rows, nb])."""
    rows = raw.shape[0]
    blk = np.asarray(raw, dtype=np.uint8).reshape(rows, -1, _BLOCK_BYTES[qtype])
    d = _ref_f16(blk[..., 0:2])
    m = _ref_f16(blk[..., 2:4]) if qtype in (QT.Q4_1, QT.Q5_1) else None
    if qtype == QT.Q8_0:
        return blk[..., 2:].view(np.int8).astype(np.int32), d, m
    head = {QT.Q4_0: 2, QT.Q4_1: 4, QT.Q5_0: 6, QT.Q5_1: 8}[qtype]
    qs = blk[..., head:head + 16].astype(np.int32)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)
    if qtype in (QT.Q5_0, QT.Q5_1):
        qh = np.ascontiguousarray(blk[..., head - 4:head]).view(np.uint32)[..., 0]
        q |= ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int32) << 4
    return q, d, m


def dequantize_reference(qtype: QT, raw: np.ndarray) -> np.ndarray:
    """uint8[rows, row_bytes] -> float32[rows, n], the same float32 operations as the kernels."""
    qtype = QT(qtype)
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if qtype == QT.F32:
        return raw.view(np.float32).copy()
    if qtype == QT.F16:
        return raw.view(np.float16).astype(np.float32)
    if qtype == QT.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    q, d, m = _ref_ints(qtype, raw)
    off = {QT.Q4_0: 8, QT.Q5_0: 16}.get(qtype, 0)
    w = d[..., None] * (q - off).astype(np.float32)
    if m is not None:
        w = w + m[..., None]
    return w.reshape(raw.shape[0], -1)


def matvec_reference(qtype: QT, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float64[rows]: dequantized weights @ x in float64."""
    return dequantize_reference(qtype, raw).astype(np.float64) @ np.asarray(x, np.float64)


def _ref_f32_to_f16_bytes(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, np.float32).astype(np.float16).view(np.uint8).reshape(*np.shape(v), 2)


def quantize_act_reference(act_type: QT, x: np.ndarray) -> np.ndarray:
    """float32[m, n] -> activation bytes as ggml's CPU from_float (Q8_0, Q8_1, F16, BF16)."""
    act_type = QT(act_type)
    x = _as_2d_f32(x)
    m, n = x.shape
    if act_type == QT.F32:
        return x.copy()
    if act_type == QT.F16:
        return x.astype(np.float16).view(np.uint8)
    if act_type == QT.BF16:
        u = x.view(np.uint32).astype(np.uint64)
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        b = np.where(nan, (u >> 16) | 64, (u + (0x7FFF + ((u >> 16) & 1))) >> 16)
        return b.astype(np.uint16).view(np.uint8)
    xb = x.reshape(m, n // 32, 32)
    amax = np.abs(xb).max(axis=-1)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv[..., None]), -128, 127).astype(np.int32)
    parts = [_ref_f32_to_f16_bytes(d)]
    if act_type == QT.Q8_1:
        parts.append(_ref_f32_to_f16_bytes(d * q.sum(axis=-1).astype(np.float32)))
    elif act_type != QT.Q8_0:
        raise ValueError(f"no activation reference for {act_type.name}")
    parts.append(q.astype(np.int8).view(np.uint8))
    return np.concatenate(parts, axis=-1).reshape(m, -1)


def _ref_fma32(a, b, c):
    """float32 a*b+c through float64: a*b is exact there; the sum is rounded twice
    (to float64, then float32), which differs from one fused rounding only in rare ties."""
    return (np.float64(a) * np.float64(b) + np.float64(c)).astype(np.float32)


def matmul_ggml_reference(qtype: QT, raw: np.ndarray, xq: np.ndarray) -> np.ndarray:
    """float32[m, rows]: ggml CPU numerics in NumPy (block types: the same 8-lane integer sums,
    fused multiply-adds and hsum order as the kernels; float types: float64 dot products,
    the exact-summation limit of ggml's float32 lanes)."""
    qtype = QT(qtype)
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    rows = raw.shape[0]
    if qtype in (QT.F32, QT.F16, QT.BF16):
        w = dequantize_reference(qtype, raw).astype(np.float64)
        if qtype == QT.F32:
            a = np.asarray(xq, np.float32).astype(np.float64)
        else:
            a = dequantize_reference(qtype, np.asarray(xq, np.uint8)).astype(np.float64)
        return (a @ w.T).astype(np.float32)
    q, d, mw = _ref_ints(qtype, raw)
    off = {QT.Q4_0: 8, QT.Q5_0: 16}.get(qtype, 0)
    q = (q - off).astype(np.int64)                                  # [rows, nb, 32]
    with_sum = qtype in (QT.Q4_1, QT.Q5_1)
    aq, ad, asum = _split_act_blocks(np.ascontiguousarray(xq, dtype=np.uint8), with_sum)
    m = aq.shape[0]
    nb = q.shape[1]
    a = aq.astype(np.int64).reshape(m, nb, 32)
    # lane sums [m, rows, nb, 8]
    isum = np.einsum("rbk,ibk->irbk", q, a).reshape(m, rows, nb, 8, 4).sum(axis=-1)
    acc = np.zeros((m, rows, 8), np.float32)
    summs = np.zeros((m, rows), np.float32)
    for b in range(nb):
        dd = (d[None, :, b] * ad[:, None, b]).astype(np.float32)   # [m, rows]
        acc = _ref_fma32(dd[..., None], isum[:, :, b, :].astype(np.float32), acc)
        if with_sum:
            summs = _ref_fma32(mw[None, :, b], asum[:, None, b], summs)
    r0 = acc[..., 4] + acc[..., 0]
    r1 = acc[..., 5] + acc[..., 1]
    r2 = acc[..., 6] + acc[..., 2]
    r3 = acc[..., 7] + acc[..., 3]
    out = (r0 + r2) + (r1 + r3)
    return out + summs if with_sum else out
