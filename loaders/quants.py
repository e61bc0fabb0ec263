"""Dispatcher over the per-type kernels: dequantize, gather rows, matvec, matmul.

Weights arrive as the bytes a GGUF tensor stores: ``uint8[rows, row_bytes]``
(a memory map slice), or a typed view of them for float types (``float32``
for F32, ``float16``/``uint16`` for F16, ``uint16`` for BF16).

Two numerics:

* ``"fp32"``: exact dequantized float32 weights, float32 products and sums
  (matvec: fused kernels that never build the float matrix; matmul: row tiles
  dequantized once, then BLAS, or :mod:`loaders.gemm` where BLAS runs narrower
  vectors than the host has: FP32_PRODUCTS).
* ``"ggml"``: activations converted to the weight type's ``act_type`` exactly
  as ggml's CPU matmul does, then ggml's per-block integer dot products and
  float accumulation order.
"""
from __future__ import annotations

import contextlib
import threading
import time

# The thread pool's spin (GOMP_SPINCOUNT) matters for speed (see pyimp/runtime/process.py) but is set only by
# pyimp's own programs: a library import must not change the host process's environment.
import numba
import numpy as np

from . import gemm, quants_legacy
from .ggml_types import QT, SUPPORTED_TYPES, TypeKernels, row_bytes, type_name


try:  # K-quants live in their own module
    from . import quants_k
except ImportError:  # pragma: no cover - only while quants_k is absent
    quants_k = None

KERNELS: dict[QT, TypeKernels] = dict(quants_legacy.KERNELS)
if quants_k is not None:
    KERNELS.update(quants_k.KERNELS)

_ACT_CONVERTERS = dict(quants_legacy.ACT_CONVERTERS)
if quants_k is not None:
    _ACT_CONVERTERS[QT.Q8_K] = quants_k.quantize_act_q8_k

NUMERICS = ("fp32", "ggml")
# rows dequantized at once by fp32 matmul: as many as fit MATMUL_TILE_BYTES of float32, at least
# MATMUL_TILE_ROWS (larger products run BLAS nearer its peak: a Gemma FFN matrix in one
# 5 MB tile instead of four took 9.3 instead of 10.4 ms for 512 tokens)
MATMUL_TILE_ROWS = 512
MATMUL_TILE_BYTES = 8 << 20

# NumPy's OpenBLAS kernel sets that use 512-bit vectors (OpenBLAS's core names, lower case)
BLAS_AVX512_CORES = frozenset({"skylakex", "cooperlake", "sapphirerapids"})


def blas_core() -> str | None:
    """The kernel set NumPy's OpenBLAS runs ("Haswell", "SkylakeX", ...), or None where NumPy's
    BLAS is not an OpenBLAS that says (another BLAS, another build)."""
    import ctypes
    import glob
    import os
    libs = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "*openblas*"))
    for lib in libs:
        try:
            cdll = ctypes.CDLL(lib)
        except OSError:
            continue
        for name in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename",
                     "openblas_get_corename64_", "openblas_get_corename"):
            f = getattr(cdll, name, None)
            if f is not None:
                f.restype = ctypes.c_char_p
                core = f()
                return core.decode() if core else None
    return None


def _fp32_products() -> str:
    """Who computes the fp32 matmul's products (fixed per process, so that a run's results do
    not depend on timing): "gemm" (loaders.gemm, 512-bit vectors) on a host with AVX-512 whose
    OpenBLAS runs kernels of narrower vectors (AMD EPYC znver5, OpenBLAS's Haswell kernels,
    pyimp-run's thread settings: Q4_0 5632 x 2048 with 128 activation rows 295 against 176
    GFLOP/s, 2048 x 640 Q5_0 with 512 rows 340 against 231); "blas" elsewhere, including where
    the BLAS cannot say which kernels it runs (OpenBLAS's own AVX-512 kernels ran those
    products at 335-509 GFLOP/s there)."""
    core = blas_core()
    if "avx512f" in quants_legacy.FEATURES and core is not None and core.lower() not in BLAS_AVX512_CORES:
        return "gemm"
    return "blas"


FP32_PRODUCTS = _fp32_products()
# activation rows from which the fp32 matmul takes loaders.gemm (it computes whole groups of
# gemm.COLS columns)
GEMM_MIN_ROWS = gemm.COLS

_TYPED_OK = {
    QT.F32: (np.float32,),
    QT.F16: (np.float16, np.uint16),
    QT.BF16: (np.uint16,),
}


def _thread_count_fns():
    """(get, set) of the calling thread's Numba thread count. numba.get_num_threads and
    set_num_threads check the threading layer and their argument on every call: 2-3 us each
    on a slow core, and a decode step's ~130 serial kernel calls each made four of them
    (1-1.5 ms a token). After the layer is up, the raw functions they wrap do the same for a
    value known to be valid (at most NUMBA_NUM_THREADS, as a count read back from Numba is);
    where this Numba does not expose them, the public functions. Made at the first kernel
    call, not at import: starting the threading layer reads its environment once (see
    pyimp.runtime.process), which a program sets before that."""
    from numba.np.ufunc import parallel as par
    numba.get_num_threads()                                    # starts the threading layer
    get, set_ = getattr(par, "_get_num_threads", None), getattr(par, "_set_num_threads", None)
    if get is None or set_ is None:                            # pragma: no cover - other Numba
        return numba.get_num_threads, numba.set_num_threads
    return get, set_


_THREAD_FNS: tuple | None = None


def _thread_fns() -> tuple:
    global _THREAD_FNS
    if _THREAD_FNS is None:
        _THREAD_FNS = _thread_count_fns()
    return _THREAD_FNS


def thread_count() -> int:
    """numba.get_num_threads() for the calling thread, without its per-call checks."""
    return (_THREAD_FNS or _thread_fns())[0]()


# the thread count a ThreadChoice's serial run was chosen under, per calling thread (as
# Numba's own thread count is); 0 outside such a run
_SERIAL_RUN = threading.local()
_SERIAL_RUN.of = 0


def work_threads() -> int:
    """The thread count a kernel divides its work for (splits of a reduction, say): the calling
    thread's Numba thread count, except inside a :class:`ThreadChoice`'s serial run, where it
    is the count the choice was made under. A serial run then computes the same splits as a
    parallel one, in the same order: the choice, made from timings, never changes the results."""
    of = getattr(_SERIAL_RUN, "of", 0)
    return of if of else (_THREAD_FNS or _thread_fns())[0]()


@contextlib.contextmanager
def _single_thread():
    get, set_ = _THREAD_FNS or _thread_fns()
    prev = get()
    set_(1)
    try:
        yield
    finally:
        set_(prev)


@contextlib.contextmanager
def _serial_run(n: int):
    """Numba's thread count 1 on the calling thread, work divided as for ``n`` threads."""
    get, set_ = _THREAD_FNS or _thread_fns()
    prev, outer = get(), getattr(_SERIAL_RUN, "of", 0)
    set_(1)
    _SERIAL_RUN.of = n
    try:
        yield
    finally:
        set_(prev)
        _SERIAL_RUN.of = outer


class ThreadChoice:
    """Whether a call repeated many times (one weight matrix's matvec, one layer's decode
    attention) runs faster on Numba's threads or on the calling thread alone, decided by
    timing it on this machine, as it is loaded now: its first ``2 * TRIALS`` calls alternate
    between the two and the faster (best time of each) is kept while the thread count stays
    the same. A fixed size threshold cannot make that choice: it depends on the core, on
    whether the thread pool's workers are awake (see pyimp.runtime.process) and on what else runs.

    A choice is checked again after ``RECHECK`` calls, then after twice as many each time:
    one more timed call in each mode, and the best times decide anew. Best times only fall,
    so a choice made while one mode was slowed (the other CPU busy for a moment, a stolen
    vCPU) does not stick for the rest of the run; the checks cost two timed calls per
    doubling of the call count."""

    TRIALS = 3
    RECHECK = 64

    def __init__(self, clock=time.perf_counter):
        self.clock = clock                              # seconds, for the timed calls
        self._n = 0
        self._times: tuple[list, list] = ([], [])      # serial, parallel
        self._want = self.TRIALS                        # timed calls per mode before deciding
        self._calls = 0                                 # calls since the last decision
        self._next = self.RECHECK                       # calls before the next check
        self.parallel: bool | None = None

    def run(self, fn, *args) -> None:
        get, set_ = _THREAD_FNS or _thread_fns()
        n = get()
        if n != self._n:
            self._n, self._times, self.parallel = n, ([], []), None
            self._want, self._calls, self._next = self.TRIALS, 0, self.RECHECK
        if n == 1:
            fn(*args)
            return
        if self.parallel is not None:
            self._calls += 1
            if self._calls < self._next:
                if self.parallel:
                    fn(*args)
                    return
                set_(1)                    # _serial_run inlined: this runs ~130 times a token
                _SERIAL_RUN.of = n
                try:
                    fn(*args)
                finally:
                    set_(n)
                    _SERIAL_RUN.of = 0
                return
            self.parallel, self._want = None, self._want + 1      # one more timed call each
            self._calls, self._next = 0, 2 * self._next
        serial, par = self._times
        trial_par = len(par) < len(serial)
        t0 = self.clock()
        if trial_par:
            fn(*args)
        else:
            with _serial_run(n):
                fn(*args)
        (par if trial_par else serial).append(self.clock() - t0)
        if len(par) == self._want:
            self.parallel = min(par) < min(serial)


# every thread choice of this process, by what decides a call's cost (see thread_choice)
_THREAD_CHOICES: dict[tuple, ThreadChoice] = {}


def thread_choice(key: tuple) -> ThreadChoice:
    """The process's one :class:`ThreadChoice` for calls of ``key``: a kernel and what decides
    its cost (a matvec: ``("matvec", type, weight shape, numerics)``). Calls that cost the same
    share one choice, so the 18 layers of a model time their matrices once, not 18 times."""
    choice = _THREAD_CHOICES.get(key)
    if choice is None:
        choice = _THREAD_CHOICES.setdefault(key, ThreadChoice())     # atomic: one per key
    return choice


def matvec_key(qtype, shape: tuple, numerics: str) -> tuple:
    """The :func:`thread_choice` key of a matvec of a ``qtype`` weight of raw ``shape``."""
    return ("matvec", qtype if type(qtype) in _EXACT_INT else QT(qtype), tuple(shape), numerics)


def available_types() -> frozenset[QT]:
    """Supported weight types whose kernels are present."""
    return frozenset(t for t in SUPPORTED_TYPES if t in KERNELS)


def kernels(qtype: int) -> TypeKernels:
    """The kernel record of ``qtype``; ValueError when unsupported."""
    if type(qtype) in _EXACT_INT:           # the per-call fast path: no enum made
        k = KERNELS.get(qtype)
        if k is not None:
            return k
    try:
        return KERNELS[QT(qtype)]
    except (KeyError, ValueError):
        raise ValueError(f"no kernels for ggml type {type_name(qtype)}") from None


# the checks' per-call fast paths: row bytes by (type, n), for the key types that hash as ints
# (a float 12.0 would too, and must take the checked path); uint8
_ROW_BYTES: dict[tuple, int] = {}
_EXACT_INT = (int, QT)
_U8 = np.dtype(np.uint8)


def as_raw(raw: np.ndarray, qtype: int, n: int) -> np.ndarray:
    """Weights of ``qtype`` with rows of ``n`` elements -> read-only ``uint8[rows, row_bytes]``.

    Accepts uint8/int8 bytes (2-D ``[rows, row_bytes]`` or 1-D holding whole rows)
    and, for float types, typed arrays (``[rows, n]`` or 1-D).
    """
    if (type(raw) is np.ndarray and raw.ndim == 2 and raw.dtype == _U8 and type(n) is int
            and type(qtype) in _EXACT_INT and not raw.flags.writeable and raw.flags.c_contiguous
            and raw.shape[1] == _ROW_BYTES.get((qtype, n), -1)):
        return raw                  # already what this returns: a decode step's calls come here
    qtype = QT(qtype)
    rb = row_bytes(qtype, n)
    _ROW_BYTES[(qtype, n)] = rb
    a = np.asarray(raw)
    if a.dtype not in (np.uint8, np.int8):
        if qtype not in _TYPED_OK or a.dtype.type not in _TYPED_OK[qtype]:
            raise ValueError(f"{type_name(qtype)} weights given as {a.dtype}; expected uint8 bytes"
                             + (f" or {[t.__name__ for t in _TYPED_OK[qtype]]}" if qtype in _TYPED_OK else ""))
    if a.ndim == 2:
        if a.shape[1] * a.itemsize != rb:
            raise ValueError(f"{type_name(qtype)} rows of {n} elements take {rb} bytes; "
                             f"got rows of {a.shape[1] * a.itemsize} bytes (shape {a.shape}, {a.dtype})")
        rows = a.shape[0]
    elif a.ndim == 1:
        if a.size * a.itemsize % rb:
            raise ValueError(f"{a.size * a.itemsize} bytes of {type_name(qtype)} weights are not "
                             f"whole rows of {n} elements ({rb} bytes each)")
        rows = a.size * a.itemsize // rb
    else:
        raise ValueError(f"weights must be 1-D or 2-D, got shape {a.shape}")
    a = np.ascontiguousarray(a)
    out = a.view(np.uint8).reshape(rows, rb)
    if out.flags.writeable:
        out = out.view()
        out.flags.writeable = False  # one compiled specialization for memmaps and arrays alike
    return out


def check_numerics(numerics: str) -> None:
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")


def _out(out: np.ndarray | None, shape: tuple) -> np.ndarray:
    if out is None:
        return np.empty(shape, dtype=np.float32)
    if out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32{list(shape)}, got {out.dtype}{list(out.shape)}")
    return out


def dequantize(raw: np.ndarray, qtype: int, n: int) -> np.ndarray:
    """Weights -> float32[rows, n] (bit-identical to ``gguf.quants.dequantize``)."""
    k = kernels(qtype)
    r = as_raw(raw, qtype, n)
    out = np.empty((r.shape[0], n), dtype=np.float32)
    k.dequantize(r, out)
    return out


def dequantize_rows(raw: np.ndarray, qtype: int, n: int, rows) -> np.ndarray:
    """Gather and dequantize rows (embedding lookup): -> float32[len(rows), n]."""
    r = as_raw(raw, qtype, n)
    idx = np.asarray(rows, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < -r.shape[0] or idx.max() >= r.shape[0]):
        raise IndexError(f"row index out of range for {r.shape[0]} rows")
    return dequantize(r[idx], qtype, n)


def quantize_activations(x: np.ndarray, act_type: int) -> np.ndarray:
    """float32[m, n] (or [n]) -> activations in ``act_type`` as ggml's CPU ``from_float``:
    uint8[m, act_row_bytes], float32[m, n] for F32."""
    try:
        conv = _ACT_CONVERTERS[QT(act_type)]
    except (KeyError, ValueError):
        raise ValueError(f"no activation converter for {type_name(act_type)}") from None
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2:
        raise ValueError(f"activations must be float32[m, n], got shape {x.shape}")
    return conv(np.ascontiguousarray(x))


def matvec(raw: np.ndarray, qtype: int, n: int, x: np.ndarray, numerics: str = "fp32",
           out: np.ndarray | None = None) -> np.ndarray:
    """W @ x: weights ``[rows, n]`` of ``qtype``, x float32[n] -> float32[rows]."""
    check_numerics(numerics)
    k = kernels(qtype)
    r = as_raw(raw, qtype, n)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape != (n,):
        raise ValueError(f"x must be float32[{n}], got shape {x.shape}")
    res = _out(out, (r.shape[0],))
    # serial or parallel as measured for this type, shape and numerics (see ThreadChoice)
    choice = thread_choice(matvec_key(qtype, r.shape, numerics))
    if numerics == "fp32":
        choice.run(k.matvec, r, x, res)
    else:
        choice.run(matvec_ggml_kernel, k, r, x, res)
    return res


def matvec_ggml_kernel(k: TypeKernels, r: np.ndarray, x: np.ndarray, res: np.ndarray) -> None:
    """ggml numerics of one checked activation row: ``k.matvec_ggml`` where the type has one,
    else the activations converted, then ``k.matmul_ggml``."""
    if k.matvec_ggml is not None:
        k.matvec_ggml(r, x, res)
    else:
        k.matmul_ggml(r, quantize_activations(x, k.act_type), res.reshape(1, -1))


def matmul(raw: np.ndarray, qtype: int, n: int, X: np.ndarray, numerics: str = "fp32",
           out: np.ndarray | None = None) -> np.ndarray:
    """X @ W.T: weights ``[rows, n]`` of ``qtype``, X float32[m, n] -> float32[m, rows]."""
    check_numerics(numerics)
    k = kernels(qtype)
    r = as_raw(raw, qtype, n)
    X = np.ascontiguousarray(X, dtype=np.float32)
    if X.ndim != 2 or X.shape[1] != n:
        raise ValueError(f"X must be float32[m, {n}], got shape {X.shape}")
    m, rows = X.shape[0], r.shape[0]
    res = _out(out, (m, rows))
    if numerics == "ggml":
        k.matmul_ggml(r, quantize_activations(X, k.act_type), res)
        return res
    if m == 1:
        k.matvec(r, X[0], res.reshape(-1))
        return res
    step = max(MATMUL_TILE_ROWS, MATMUL_TILE_BYTES // (4 * n))
    own = FP32_PRODUCTS == "gemm" and m >= GEMM_MIN_ROWS
    tile = np.empty((gemm.tile_rows(min(step, rows)) if own else min(step, rows), n), dtype=np.float32)
    if own:
        tile[min(step, rows):] = 0        # rows the kernel reads past a tile's end: finite values
    XT = gemm.pack_columns(X) if own else None
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        t = tile[:r1 - r0]
        # on the calling thread: Numba's workers would spin through the start of every BLAS call
        # (pyimp.runtime.process), while a tile takes a small fraction of its product's time
        with _single_thread():
            k.dequantize(r[r0:r1], t)
        if own:
            gemm.products(tile, r1 - r0, XT, res, r0)
        else:
            res[:, r0:r1] = X @ t.T
    return res
