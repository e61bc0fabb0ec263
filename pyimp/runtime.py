"""Process-wide settings that only pyimp's own programs apply.

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


def _defaults(env) -> dict:
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return {}
    return {"GOMP_SPINCOUNT": SPIN_COUNT}


def configure_process(environ=None) -> None:
    """Set the thread-pool defaults above (a value the user already set wins)."""
    env = os.environ if environ is None else environ
    env.update(_defaults(env))
