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

# every simulated barrier waits for each Python thread to be scheduled: switch threads often
# (the default 5 ms interval makes a barrier cost ~20 ms)
sys.setswitchinterval(1e-4)

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1" and os.environ.get("PYIMP_CUDA_HW") != "1":
    raise RuntimeError("tests/cuda runs under NUMBA_ENABLE_CUDASIM=1 (tests/test_cuda.py starts it) "
                       "or on a GPU with PYIMP_CUDA_HW=1 (tools/device_check.py)")
