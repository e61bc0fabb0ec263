"""ctypes binding to the libggml bundled with the ``llama_cpp`` package.

Used as the numerical oracle for pyimp's quantization kernels: ggml's own
quantizers (``ggml_quantize_chunk``), its CPU activation converters (the CPU
type traits' ``from_float``, i.e. the SIMD versions the CPU matmul runs) and its
CPU dot products (the traits' ``vec_dot``).

Struct layout checked against ``ggml/include/ggml-cpu.h`` of llama.cpp as
vendored by llama-cpp-python 0.3.36::

    struct ggml_type_traits_cpu {
        ggml_from_float_t from_float;   // void (*)(const float *, void *, int64_t)
        ggml_vec_dot_t    vec_dot;      // void (*)(int n, float *s, size_t bs, const void *x,
                                        //          size_t bx, const void *y, size_t by, int nrc)
        enum ggml_type    vec_dot_type;
        int64_t           nrows;
    };

All functions raise ``RuntimeError`` when the library is unavailable; check
``available()`` first (tests skip with ``unavailable_reason()``).
"""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
from functools import lru_cache

import numpy as np

__all__ = [
    "available", "unavailable_reason", "library_dir", "cpu_features",
    "quantize", "from_float", "vec_dot_type", "vec_dot", "vec_dot_q", "matmul",
    "row_size",
]

_FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t,
                            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                            ctypes.c_size_t, ctypes.c_int)


class _TypeTraitsCpu(ctypes.Structure):
    _fields_ = [
        ("from_float", ctypes.c_void_p),
        ("vec_dot", ctypes.c_void_p),
        ("vec_dot_type", ctypes.c_int),
        ("nrows", ctypes.c_int64),
    ]


class _Lib:
    def __init__(self, base: ctypes.CDLL, cpu: ctypes.CDLL, directory: str):
        self.base = base
        self.cpu = cpu
        self.directory = directory
        base.ggml_quantize_chunk.restype = ctypes.c_size_t
        base.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                             ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                             ctypes.c_void_p]
        base.ggml_row_size.restype = ctypes.c_size_t
        base.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
        base.ggml_blck_size.restype = ctypes.c_int64
        base.ggml_blck_size.argtypes = [ctypes.c_int]
        cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TypeTraitsCpu)
        cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
        cpu.ggml_cpu_init.restype = None
        cpu.ggml_cpu_init.argtypes = []
        # fills the fp16 conversion tables the CPU kernels read
        cpu.ggml_cpu_init()
        self._traits: dict[int, tuple] = {}

    def traits(self, qtype: int):
        """(from_float or None, vec_dot or None, vec_dot_type) for a ggml type id."""
        qtype = int(qtype)
        if qtype not in self._traits:
            t = self.cpu.ggml_get_type_traits_cpu(qtype).contents
            ff = _FROM_FLOAT(t.from_float) if t.from_float else None
            vd = _VEC_DOT(t.vec_dot) if t.vec_dot else None
            self._traits[qtype] = (ff, vd, int(t.vec_dot_type))
        return self._traits[qtype]


def library_dir() -> str | None:
    """Folder holding ``libggml-base`` / ``libggml-cpu`` inside the installed llama_cpp."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.origin:
        return None
    pkg = os.path.dirname(spec.origin)
    for sub in ("lib", ""):
        d = os.path.join(pkg, sub)
        if glob.glob(os.path.join(d, "libggml-base.*")) and glob.glob(os.path.join(d, "libggml-cpu.*")):
            return d
    return None


def _find(directory: str, stem: str) -> str:
    for pattern in (f"{stem}.so", f"{stem}.so.*", f"{stem}.dylib", f"{stem}*.dll"):
        hits = sorted(glob.glob(os.path.join(directory, pattern)))
        if hits:
            return hits[0]
    raise OSError(f"{stem} not found in {directory}")


@lru_cache(maxsize=1)
def _load() -> tuple[_Lib | None, str]:
    try:
        directory = library_dir()
    except (ImportError, ValueError) as e:  # broken installation
        return None, f"llama_cpp not importable: {e}"
    if directory is None:
        return None, "llama_cpp (llama-cpp-python) is not installed or ships no libggml-base/libggml-cpu"
    if os.environ.get("PYIMP_PEER_PROBE") != "child":
        # a libggml built for instructions this CPU lacks would kill this process on first use:
        # load it here only once a subprocess has run it (the probe itself runs in that child)
        from tools import llamacpp_peer
        ok, why = llamacpp_peer.probe()
        if not ok:
            return None, why
    try:
        mode = getattr(ctypes, "RTLD_GLOBAL", 0)
        base = ctypes.CDLL(_find(directory, "libggml-base"), mode=mode)
        cpu = ctypes.CDLL(_find(directory, "libggml-cpu"), mode=mode)
        return _Lib(base, cpu, directory), ""
    except (OSError, AttributeError) as e:
        return None, f"cannot load libggml from {directory}: {e}"


def available() -> bool:
    """True when libggml could be loaded from the llama_cpp package."""
    return _load()[0] is not None


def unavailable_reason() -> str:
    """Why ``available()`` is False ('' when it is True)."""
    return _load()[1]


def _lib() -> _Lib:
    lib, why = _load()
    if lib is None:
        raise RuntimeError(why)
    return lib


def cpu_features() -> dict[str, bool]:
    """SIMD features libggml-cpu was compiled for (``ggml_cpu_has_*``)."""
    lib = _lib()
    out = {}
    for name in ("avx", "avx2", "avx_vnni", "f16c", "fma", "avx512", "avx512_vnni",
                 "avx512_bf16", "llamafile"):
        fn = getattr(lib.cpu, "ggml_cpu_has_" + name, None)
        if fn is not None:
            fn.restype = ctypes.c_int
            out[name] = bool(fn())
    return out


def row_size(qtype: int, n: int) -> int:
    """Bytes of one row of ``n`` elements of ggml type ``qtype`` (``ggml_row_size``)."""
    return int(_lib().base.ggml_row_size(int(qtype), int(n)))


def quantize(qtype: int, x: np.ndarray) -> np.ndarray:
    """ggml's reference quantizer (``ggml_quantize_chunk``, no importance matrix).

    x: float32[rows, n] -> uint8[rows, row_bytes]
    """
    lib = _lib()
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2:
        raise ValueError(f"quantize expects float32[rows, n], got shape {x.shape}")
    rows, n = x.shape
    bs = int(lib.base.ggml_blck_size(int(qtype)))
    if n % bs:
        raise ValueError(f"row length {n} is not a multiple of block size {bs}")
    rb = row_size(qtype, n)
    out = np.zeros((rows, rb), dtype=np.uint8)
    written = lib.base.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data,
                                           0, rows, n, None)
    if written != rows * rb:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, expected {rows * rb}")
    return out


def vec_dot_type(qtype: int) -> int:
    """ggml type id the CPU matmul converts activations to for weights of ``qtype``."""
    return _lib().traits(qtype)[2]


def from_float(act_type: int, x: np.ndarray) -> np.ndarray:
    """The CPU traits' ``from_float`` for ``act_type`` (the SIMD converter the matmul uses).

    x: float32[n] -> uint8[row_bytes(act_type, n)]
    """
    lib = _lib()
    x = np.ascontiguousarray(x, dtype=np.float32).ravel()
    ff = lib.traits(act_type)[0]
    if ff is None:
        raise ValueError(f"ggml type {act_type} has no CPU from_float")
    out = np.zeros(row_size(act_type, x.size), dtype=np.uint8)
    ff(x.ctypes.data, out.ctypes.data, x.size)
    return out


def vec_dot_q(qtype: int, w_row: np.ndarray, xq: np.ndarray, n: int) -> float:
    """ggml CPU ``vec_dot`` of one weight row and activations already in ``vec_dot_type``.

    w_row: uint8[row_bytes(qtype, n)]; xq: uint8[row_bytes(vec_dot_type, n)]
    """
    lib = _lib()
    vd = lib.traits(qtype)[1]
    if vd is None:
        raise ValueError(f"ggml type {qtype} has no CPU vec_dot")
    w = np.ascontiguousarray(w_row).view(np.uint8).ravel()
    y = np.ascontiguousarray(xq).view(np.uint8).ravel()
    if w.size != row_size(qtype, n) or y.size != row_size(vec_dot_type(qtype), n):
        raise ValueError("vec_dot_q: byte sizes do not match n")
    s = np.zeros(1, dtype=np.float32)
    vd(int(n), s.ctypes.data, 0, w.ctypes.data, 0, y.ctypes.data, 0, 1)
    return float(s[0])


def vec_dot(qtype: int, w_row: np.ndarray, x: np.ndarray) -> float:
    """One output of ggml's CPU matmul: x converted with ``from_float`` of the weight's
    ``vec_dot_type``, then the traits' ``vec_dot``.

    w_row: uint8[row_bytes(qtype, n)] (any dtype view of those bytes); x: float32[n]
    """
    x = np.ascontiguousarray(x, dtype=np.float32).ravel()
    xq = from_float(vec_dot_type(qtype), x)
    return vec_dot_q(qtype, w_row, xq, x.size)


def matmul(qtype: int, w: np.ndarray, X: np.ndarray) -> np.ndarray:
    """ggml CPU matmul, one ``vec_dot`` per output (slow; for tests).

    w: uint8[rows, row_bytes]; X: float32[m, n] -> float32[m, rows]
    """
    X = np.ascontiguousarray(X, dtype=np.float32)
    if X.ndim == 1:
        X = X[None, :]
    m, n = X.shape
    w = np.ascontiguousarray(w).view(np.uint8).reshape(w.shape[0], -1)
    act = vec_dot_type(qtype)
    out = np.empty((m, w.shape[0]), dtype=np.float32)
    for i in range(m):
        xq = from_float(act, X[i])
        for r in range(w.shape[0]):
            out[i, r] = vec_dot_q(qtype, w[r], xq, n)
    return out
