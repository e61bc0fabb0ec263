"""Process-wide settings that only pyimp's own programs apply: the thread pools' waiting, and
OpenBLAS's kernels on CPUs it does not know.

Importing pyimp changes nothing in the host process. The console scripts
(``pyimp-run``, ``pyimp-tokenize``, ``pyimp-fetch-model``), the ``tools/``
scripts and the benchmark subprocesses call :func:`configure_process` first,
before NumPy, Numba or BLAS start any threads.
"""
from __future__ import annotations

import os

# Numba's OpenMP workers (libgomp) wait for the next parallel kernel by spinning GOMP_SPINCOUNT
# times, then sleep. A decode step launches ~130 kernels, tens to hundreds of microseconds
# apart: a sleeping worker costs a wake-up per kernel (on a VM ~50-100 us, more than a layer
# matrix's whole matvec: a second thread made those slower), while libgomp's default spin
# (300000 pauses, several milliseconds) makes the workers fight OpenBLAS's threads during
# prefill (600 -> 52 tok/s on 2 cores). 30000 pauses spin about 1 ms on a 2.8 GHz Xeon: the
# workers stay awake across a decode step, and prefill keeps Numba's workers out of the BLAS
# calls by dequantizing weight tiles on the calling thread (loaders.quants.matmul). Measured
# (tools.bench, Gemma 270M, 2 threads): decode 23-26 tok/s with 3000, 26-31 with 30000,
# prefill unchanged. libgomp reads these once, when Numba starts its pool; a user who sets
# OMP_WAIT_POLICY or GOMP_SPINCOUNT keeps their choice.
SPIN_COUNT = "30000"

# OpenBLAS's workers (NumPy's BLAS, prefill's matrix products) busy-wait 2**THREAD_TIMEOUT
# cycles after each call before they sleep: 2**28 by default, ~0.1 s. For that long after a
# prefill they hold a core that Numba's kernels need: the first decode token took 72-95 ms
# instead of 15, and a 128-token prefill ran at 430 tok/s instead of 650 (its attention and
# output head are Numba kernels between the BLAS calls). 2**4 (OpenBLAS's smallest) lets them
# sleep at once; waking them costs less than a prefill's gaps between its products (measured
# with tools.bench and per-token times, Gemma 270M, 2 threads, AMD EPYC: prefill 1024 tokens
# 622-657 -> 677 tok/s). A user's OPENBLAS_THREAD_TIMEOUT or GOTO_THREAD_TIMEOUT wins.
BLAS_THREAD_TIMEOUT = "4"


# OpenBLAS (a DYNAMIC_ARCH build, as NumPy's wheels ship it) picks its kernels by CPU family
# and model, and takes a family it does not know for Haswell (AVX2): NumPy's OpenBLAS 0.3.31
# reports "Haswell" on an AMD EPYC of family 0x1A (Zen 5) that has AVX-512. Its AVX-512 kernels
# ("SkylakeX") run prefill's float32 products there 1.4-1.9x faster (numpy X @ W.T, 2 threads:
# 128 x 2048 x 5632 246 -> 351 GFLOP/s, 1024 x 2048 x 5632 273 -> 509; TinyLlama-1.1B-shape
# Q4_0 prefill of 1024 tokens 103 -> 166 tok/s). Set only for AMD families from 0x1A on with
# the AVX-512 subsets those kernels use; a user's OPENBLAS_CORETYPE wins.
AVX512_FOR_SKYLAKEX = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
FIRST_UNKNOWN_AMD_FAMILY = 0x1A


def blas_coretype(cpuinfo: str) -> str | None:
    """The OPENBLAS_CORETYPE to set for a CPU described by ``cpuinfo`` (the text of
    /proc/cpuinfo), or None where OpenBLAS's own choice stands."""
    vendor, family, flags = "", -1, set()
    for line in cpuinfo.splitlines():
        key, _, val = line.partition(":")
        key = key.strip()
        if key == "vendor_id" and not vendor:
            vendor = val.strip()
        elif key == "cpu family" and family < 0:
            try:
                family = int(val.strip())
            except ValueError:
                return None
        elif key == "flags" and not flags:
            flags = set(val.split())
        if vendor and family >= 0 and flags:
            break
    if vendor == "AuthenticAMD" and family >= FIRST_UNKNOWN_AMD_FAMILY and AVX512_FOR_SKYLAKEX <= flags:
        return "SkylakeX"
    return None


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _defaults(env) -> dict:
    out = {}
    if "OPENBLAS_CORETYPE" not in env:
        core = blas_coretype(_cpuinfo())
        if core is not None:
            out["OPENBLAS_CORETYPE"] = core
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        out["GOMP_SPINCOUNT"] = SPIN_COUNT
    if "OPENBLAS_THREAD_TIMEOUT" not in env and "GOTO_THREAD_TIMEOUT" not in env:
        out["OPENBLAS_THREAD_TIMEOUT"] = BLAS_THREAD_TIMEOUT
    return out


def configure_process(environ=None) -> None:
    """Set the thread-pool defaults above (a value the user already set wins)."""
    env = os.environ if environ is None else environ
    env.update(_defaults(env))
