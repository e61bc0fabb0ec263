"""ggml tensor types: block geometry and the per-type kernel record.

This is the one module that takes ggml's and GGUF's constants from the ``gguf`` package:
``GGMLQuantizationType`` (the ggml type ids), ``GGML_QUANT_SIZES`` (elements per block,
bytes per block) and ``GGUFValueType`` (the ids of GGUF metadata value types). Where
``gguf`` cannot be imported (the GPU machine's image has neither it nor ``pyyaml``, which it
imports), the same names are made from :data:`OWN_QUANT_TYPES` and
:data:`OWN_VALUE_TYPES` below: IntEnums with gguf's member names and values, for the types
pyimp reads, computes with or converts activations to, and every GGUF value type.
``tests/test_ggml_types.py`` checks that these tables equal gguf's for every member they
name. Every other module takes the constants from here.
"""
from __future__ import annotations

from enum import IntEnum
from typing import Callable, NamedTuple

# ggml type name: (type id, elements per block, bytes per block)
OWN_QUANT_TYPES: dict[str, tuple[int, int, int]] = {
    "F32": (0, 1, 4),
    "F16": (1, 1, 2),
    "Q4_0": (2, 32, 18),        # fp16 d, 16 bytes of 4-bit quants
    "Q4_1": (3, 32, 20),        # fp16 d, m, 16 bytes of 4-bit quants
    "Q5_0": (6, 32, 22),        # fp16 d, 4 bytes of high bits, 16 bytes of low nibbles
    "Q5_1": (7, 32, 24),        # fp16 d, m, 4 bytes of high bits, 16 bytes of low nibbles
    "Q8_0": (8, 32, 34),        # fp16 d, 32 int8 quants
    "Q8_1": (9, 32, 40),        # fp16 d, s, 32 int8 quants (Q4_1 / Q5_1 activations)
    "Q2_K": (10, 256, 84),
    "Q3_K": (11, 256, 110),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
    "Q8_K": (15, 256, 292),     # float32 d, 256 int8 quants, 16 int16 sums (K activations)
    "BF16": (30, 1, 2),
}

# GGUF metadata value type name: id
OWN_VALUE_TYPES: dict[str, int] = {
    "UINT8": 0, "INT8": 1, "UINT16": 2, "INT16": 3, "UINT32": 4, "INT32": 5, "FLOAT32": 6,
    "BOOL": 7, "STRING": 8, "ARRAY": 9, "UINT64": 10, "INT64": 11, "FLOAT64": 12,
}


def own_constants() -> tuple[type[IntEnum], dict, type[IntEnum]]:
    """(GGMLQuantizationType, GGML_QUANT_SIZES, GGUFValueType) made from this module's own
    tables: what the module exports where ``gguf`` cannot be imported."""
    qt = IntEnum("GGMLQuantizationType", {k: v[0] for k, v in OWN_QUANT_TYPES.items()},
                 module=__name__)
    sizes = {qt[k]: (v[1], v[2]) for k, v in OWN_QUANT_TYPES.items()}
    vt = IntEnum("GGUFValueType", OWN_VALUE_TYPES, module=__name__)
    return qt, sizes, vt


try:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
    FROM_GGUF = True
except ImportError:             # no gguf (or no pyyaml, which it imports): the own tables
    GGMLQuantizationType, GGML_QUANT_SIZES, GGUFValueType = own_constants()
    FROM_GGUF = False

QT = GGMLQuantizationType

# Weight types pyimp can load and compute with.
SUPPORTED_TYPES: frozenset[QT] = frozenset({
    QT.F32, QT.F16, QT.BF16,
    QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0,
    QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K,
})


def type_name(qtype: int) -> str:
    """Readable name for a ggml type id, also for ids the type table does not know."""
    try:
        return QT(qtype).name
    except ValueError:
        return f"type#{qtype}"


def block_size(qtype: int) -> int:
    """Elements per block (1 for float types)."""
    return GGML_QUANT_SIZES[QT(qtype)][0]


def type_size(qtype: int) -> int:
    """Bytes per block."""
    return GGML_QUANT_SIZES[QT(qtype)][1]


def row_bytes(qtype: int, n: int) -> int:
    """Bytes of one row of ``n`` elements; ``n`` must be a multiple of the block size."""
    bs, ts = GGML_QUANT_SIZES[QT(qtype)]
    if n % bs:
        raise ValueError(f"row length {n} is not a multiple of {type_name(qtype)} block size {bs}")
    return n // bs * ts


class TypeKernels(NamedTuple):
    """Kernels for one weight type. ``raw`` is always ``uint8[rows, row_bytes]``.

    dequantize(raw, out)           out: float32[rows, n]
    matvec(raw, x, out)            fp32 numerics: out[r] = sum_j w[r, j] * x[j]; x float32[n]
    act_type                       ggml's vec_dot_type for this weight type (activation format)
    matmul_ggml(raw, xq, out)      ggml numerics: xq = activations already converted to
                                   ``act_type`` (uint8[m, act_row_bytes], or float32[m, n]
                                   when act_type is F32); out: float32[m, rows]
    matvec_ggml(raw, x, out)       ggml numerics of one float32[n] activation row (converted
                                   inside, as matmul_ggml's callers do), out float32[rows]; the
                                   decode step's call, with no byte form where the kernel does
                                   not need one (None: convert, then matmul_ggml)
    matvec_group(raws, x, out)     matvec of 1-3 matrices of this type and row length that read
                                   the same x, as one call: ``raws`` a tuple of them, out
                                   float32[their rows together], in order (None: the type's
                                   kernel has no groups; one matvec call per matrix)
    """

    dequantize: Callable
    matvec: Callable
    act_type: QT
    matmul_ggml: Callable
    matvec_ggml: Callable | None = None
    matvec_group: Callable | None = None


# Byte offsets of the fp16 fields inside one block of each quantized type (the scale d, and the
# min m / dmin where the type has one), as ggml's block structs lay them out; every other byte
# holds quants or packed sub-block scales, any value of which is valid.
FP16_FIELDS: dict[QT, tuple[int, ...]] = {
    QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q8_0: (0,),
    QT.Q2_K: (80, 82),      # scales[16], qs[64], d, dmin
    QT.Q3_K: (108,),        # hmask[32], qs[64], scales[12], d
    QT.Q4_K: (0, 2),        # d, dmin, scales[12], qs[128]
    QT.Q5_K: (0, 2),        # d, dmin, scales[12], qh[32], qs[128]
    QT.Q6_K: (208,),        # ql[128], qh[64], scales[16] (int8), d
}
