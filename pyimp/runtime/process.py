"""Process-wide settings that only pyimp's own programs apply: the thread pools' waiting.

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


def _defaults(env) -> dict:
    out = {}
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        out["GOMP_SPINCOUNT"] = SPIN_COUNT
    if "OPENBLAS_THREAD_TIMEOUT" not in env and "GOTO_THREAD_TIMEOUT" not in env:
        out["OPENBLAS_THREAD_TIMEOUT"] = BLAS_THREAD_TIMEOUT
    return out


def configure_process(environ=None) -> None:
    """Set the thread-pool defaults above (a value the user already set wins)."""
    env = os.environ if environ is None else environ
    env.update(_defaults(env))


def numba_env_error(environ=None) -> str | None:
    """Why Numba would refuse this environment at import (one line naming the variable), or
    None. NUMBA_NUM_THREADS below 1 makes ``import numba`` raise; a value that is not a number
    Numba itself ignores, with a warning."""
    env = os.environ if environ is None else environ
    v = env.get("NUMBA_NUM_THREADS")
    if v is not None and v.strip():
        try:
            n = int(v)
        except ValueError:
            return None
        if n < 1:
            return f"NUMBA_NUM_THREADS={v}: Numba needs at least 1 thread (set it higher or unset it)"
    return None
