"""The GPU path on numba-cuda (imported only when ``device="cuda"`` is asked for).

Kernels are twins of the CPU kernels: the same array-only arguments and layouts
(docs/kvcache.md section 2), each tested against the NumPy reference its CPU twin is
tested against. fp16 buffers are float16 device arrays; every kernel loads fp16,
computes and accumulates in float32 and rounds once when it stores fp16. Quantized KV
caches keep the host's ggml block layout on the device; kernels decode the blocks they
read in place (:mod:`pyimp.cuda.kvblocks`).

:func:`require` is the one place that decides whether the device can be used; it
raises :class:`DeviceUnavailable` with a message naming what is missing.
``NUMBA_ENABLE_CUDASIM=1`` (set before numba is imported) runs every kernel on
numba-cuda's simulator, which is how the tests run them without a GPU.
"""
from __future__ import annotations

INSTALL_HINT = "pip install 'pyimp[cuda]'"


class DeviceUnavailable(RuntimeError):
    """``device="cuda"`` cannot run here; the message says what is missing."""


def require() -> None:
    """Raise :class:`DeviceUnavailable` unless numba-cuda imports and a GPU (or the simulator,
    under ``NUMBA_ENABLE_CUDASIM=1``) is there."""
    try:
        from numba import cuda
    except ImportError:
        raise DeviceUnavailable(f"device cuda needs numba-cuda, which is not installed "
                                f"({INSTALL_HINT})") from None
    import numba
    if numba.config.ENABLE_CUDASIM:
        return
    _check_compiler()
    from . import device
    if device.compiling():          # compile-only mode: nothing runs, no GPU needed
        return
    try:
        ok = cuda.is_available()
    except Exception as e:     # a driver that fails to initialise reports here
        raise DeviceUnavailable(f"device cuda: the CUDA driver failed to initialise ({e})") from None
    if not ok:
        raise DeviceUnavailable("device cuda: no CUDA GPU or driver found on this machine "
                                "(set NUMBA_ENABLE_CUDASIM=1 to run on numba-cuda's simulator)")


def _check_compiler(importer=None) -> None:
    """Raise :class:`DeviceUnavailable` if numba-cuda's array typing, which its first kernel
    compilation loads, fails to import under this NumPy. numba-cuda 0.30.4 with NumPy 2.5 does
    (``np.row_stack`` is gone): without this check that surfaced as a traceback at the first
    launch. A numba-cuda laid out otherwise is left to its first compilation."""
    import importlib
    importer = importer or importlib.import_module
    try:
        importer("numba.cuda.np.arrayobj")
    except ImportError:
        return
    except Exception as e:
        import numpy as np
        try:
            from importlib.metadata import version
            nc = version("numba-cuda")
        except Exception:
            nc = "?"
        raise DeviceUnavailable(
            f"device cuda: numba-cuda {nc} cannot compile kernels with NumPy {np.__version__} "
            f"({type(e).__name__}: {e}); install a NumPy it supports (pip install 'numpy<2.5') "
            f"or a numba-cuda that supports this one") from None
