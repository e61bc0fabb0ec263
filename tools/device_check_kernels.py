"""tools/device_check.py's own kernels, in a module of their own so that device_check imports
numba-cuda only after its ``require`` step found it: ``fill`` (hashed values into a cache) and
two kernels that do nothing (the ``launch_cost`` step)."""
from numba import (  # NUMBA_ENABLE_CUDASIM (the simulator) must be set before this
    cuda,
    float32,
)


@cuda.jit
def fill(a, seed):
    """Hashed values in [-1, 1] into the flat array a."""
    i = cuda.grid(1)
    while i < a.size:
        h = (i * 2654435761 + seed * 97) % 4294967296
        h = (h ^ (h >> 13)) * 1274126177 % 4294967296
        a[i] = float32(h % 2001) * float32(0.001) - float32(1.0)
        i += cuda.gridsize(1)


@cuda.jit
def empty_1(a):
    """Does nothing: a launch's own cost."""


@cuda.jit
def empty_12(a0, a1, a2, a3, a4, a5, a6, a7, i0, i1, f0, f1):
    """Does nothing, with 8 array and 4 scalar arguments (a decode kernel's count)."""
