"""Tests of the CUDA kernels on numba-cuda's simulator.

They run in their own pytest process with ``NUMBA_ENABLE_CUDASIM=1`` set before numba is
imported (``tests/test_cuda.py`` starts it; the main run skips this folder). Shapes are tiny:
the simulator runs one Python thread per CUDA thread. ``tools/device_check.py`` runs the same
tests on a real GPU with ``PYIMP_CUDA_HW=1`` instead.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    # threads meet at a condition variable instead of a polling manager (fastsim.py): an
    # engine test ~2.2x faster. The stock simulator needed a 0.1 ms switch interval (each
    # barrier waited for every Python thread to be scheduled); with the barrier 1 ms and
    # 5 ms measured the same, 0.1 ms 15% slower.
    from fastsim import install
    if install():
        sys.setswitchinterval(1e-3)
    else:
        sys.setswitchinterval(1e-4)

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1" and os.environ.get("PYIMP_CUDA_HW") != "1":
    raise RuntimeError("tests/cuda runs under NUMBA_ENABLE_CUDASIM=1 (tests/test_cuda.py starts it) "
                       "or on a GPU with PYIMP_CUDA_HW=1 (tools/device_check.py)")
