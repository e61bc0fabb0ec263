"""ggml tensor types: block geometry and the per-type kernel record.

Block geometry comes from ``gguf.GGML_QUANT_SIZES`` (elements per block,
bytes per block); this module only narrows it to the types pyimp supports.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QT = GGMLQuantizationType

# Weight types pyimp can load and compute with.
SUPPORTED_TYPES: frozenset[QT] = frozenset({
    QT.F32, QT.F16, QT.BF16,
    QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0,
    QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K,
})


def type_name(qtype: int) -> str:
    """Readable name for a ggml type id, also for ids gguf does not know."""
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
