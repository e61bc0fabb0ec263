"""Process-wide settings that only pyimp's own programs apply.

Importing pyimp changes nothing in the host process. The console scripts
(``pyimp-run``, ``pyimp-tokenize``, ``pyimp-fetch-model``), the ``tools/``
scripts and the benchmark subprocesses call :func:`configure_process` first,
before NumPy, Numba or BLAS start any threads.
"""
from __future__ import annotations

import os

# Numba's OpenMP workers spin after each parallel kernel unless told to sleep, and then fight
# OpenBLAS's threads during prefill (which interleaves both): measured 600 -> 52 tok/s prefill
# on 2 cores. libgomp reads the variable once, when Numba first starts its thread pool.
ENV_DEFAULTS = {"OMP_WAIT_POLICY": "passive"}


def configure_process(environ=None) -> None:
    """Set the environment defaults above (a value the user already set wins)."""
    env = os.environ if environ is None else environ
    for key, value in ENV_DEFAULTS.items():
        env.setdefault(key, value)
