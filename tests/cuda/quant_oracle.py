"""The quantizer and dequantizer the kernel tests compare against: gguf's NumPy ones where gguf
is installed (CI, the simulator run), pyimp's CPU ones where it is not (the GPU machine's
image has no gguf). The CPU ones are checked against gguf's in the main suite, byte for byte
(tests/test_quantize.py: legacy types and BF16) and bit for bit (tests/test_quants_legacy.py,
tests/test_quants_k.py: dequantization), so a kernel equal to either is equal to gguf's.

``quantize(x, qtype)``: float32 [..., n] -> float32 (F32), float16 (F16), uint16 bit patterns
(BF16) or uint8 blocks [..., row bytes] (legacy types); ``dequantize(raw, qtype)``: uint8
[..., row bytes] -> float32 [..., n]. ``SOURCE`` says which ("gguf" or "pyimp").
"""
from __future__ import annotations

import numpy as np

try:
    from gguf.quants import dequantize, quantize
    SOURCE = "gguf"
except ImportError:
    from loaders import ggml_types, quants
    from loaders.ggml_types import QT
    from loaders.quantize import f32_to_bf16, quantize_rows
    SOURCE = "pyimp"

    def quantize(x: np.ndarray, qtype) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        qtype = QT(qtype)
        if qtype == QT.F32:
            return x.copy()
        if qtype == QT.F16:
            return x.astype(np.float16)
        if qtype == QT.BF16:
            return f32_to_bf16(x)
        rows = quantize_rows(x.reshape(-1, x.shape[-1]), qtype)
        return rows.reshape(*x.shape[:-1], rows.shape[-1])

    def dequantize(raw: np.ndarray, qtype) -> np.ndarray:
        raw = np.ascontiguousarray(raw).view(np.uint8)
        qtype = QT(qtype)
        n = raw.shape[-1] // ggml_types.type_size(qtype) * ggml_types.block_size(qtype)
        out = quants.dequantize(raw.reshape(-1, raw.shape[-1]), qtype, n)
        return out.reshape(*raw.shape[:-1], n)
