"""Device plumbing shared by the CUDA kernels: launches, buffers, block-wide reductions.

**Launches** go through :func:`launch`. Scalars are passed as NumPy scalars of an
explicit dtype (``np.int32``, ``np.float32``): a Python float would type the
kernel in float64. Under :func:`compile_only` nothing runs: each launch compiles its
kernel for the given compute capability with the launch's argument types
(``cuda.compile_ptx``, which needs NVVM but no GPU) and :func:`empty` / :func:`zeros` /
:func:`to_device` hand out host arrays, so a host program that drives the kernels
(the device engine included) type-checks every kernel it would launch. The
simulator does no type checking; this is how CI catches what would not compile.

**Reductions** over the threads of a block (:func:`block_sum`; :func:`block_max_n` /
:func:`block_sum_n` for n values at once): every thread calls them with its value(s) and gets
the result; ``red`` is a float32 shared array with one slot per thread (n per thread). On hardware a warp reduces with ``shfl_xor_sync`` and
the warps' results meet in ``red``; the simulator has no warp operations, so there every
thread sums all of ``red`` after one barrier (block sizes are powers of two, <= 1024).
"""
from __future__ import annotations

import contextlib
import functools
import math
import warnings

import numba
import numpy as np
from numba import cuda, float32

SIMULATOR = bool(numba.config.ENABLE_CUDASIM)
WARP = 32
FULL_MASK = 0xFFFFFFFF

_compile_cc: tuple | None = None
_compiled: set = set()
launches = 0          # kernels launched (or compiled) since import: launches per token = difference


@contextlib.contextmanager
def compile_only(cc: tuple = (9, 0)):
    """Inside: launches compile their kernel for ``cc`` instead of running (see the module doc)."""
    global _compile_cc
    from numba.cuda import dispatcher

    class _Target:                       # what device functions ask the driver for
        compute_capability = tuple(cc)

    prev, _compile_cc = _compile_cc, tuple(cc)
    prev_dev = dispatcher.get_current_device
    if not SIMULATOR:
        # device functions compile for the current device's capability; with no driver
        # (the point of this mode) report the target's instead
        dispatcher.get_current_device = _Target
    try:
        yield
    finally:
        _compile_cc = prev
        dispatcher.get_current_device = prev_dev


def compiling() -> bool:
    return _compile_cc is not None


_stream = None           # the stream launches go to (None: the default stream)


class Recorder:
    """A stand-in stream for the simulator's emulation of CUDA graph capture: a launch put on
    it is recorded (kernel, grid, block, arguments, shared bytes) instead of run."""

    def __init__(self):
        self.launches: list = []

    def replay(self) -> None:
        """Run the recorded launches in order, with the arguments they were recorded with."""
        for kernel, grid, block, args, shared in self.launches:
            launch(kernel, grid, block, *args, shared=shared)


@contextlib.contextmanager
def on_stream(stream):
    """Inside: :func:`launch` puts kernels on ``stream`` (a numba-cuda stream) instead of the
    default stream (a captured decode step, :mod:`pyimp.cuda.decode`)."""
    global _stream
    prev, _stream = _stream, stream
    try:
        yield
    finally:
        _stream = prev


def launch(kernel, grid, block, *args, shared: int = 0) -> None:
    """``kernel[grid, block, stream, shared](*args)`` (the stream of :func:`on_stream`, else
    the default one), or its compilation under :func:`compile_only`."""
    global launches
    launches += 1
    if _compile_cc is not None:
        sig = tuple(numba.typeof(a) for a in args)
        key = (kernel.py_func, sig, _compile_cc)
        if key not in _compiled:
            cuda.compile_ptx(kernel.py_func, sig, cc=_compile_cc)
            _compiled.add(key)
        return
    if isinstance(_stream, Recorder):
        _stream.launches.append((kernel, grid, block, args, shared))
        return
    if SIMULATOR:                 # the simulator's kernel[...] configures the kernel object itself
        kernel[grid, block, 0, shared](*args)
        return
    _configured(kernel, grid, block, shared, _stream)(*args)


class Counts:
    """What the device was asked to do while :func:`counting` was on: kernel launches,
    device allocations, host-to-device and device-to-host copies (and the bytes each way)."""

    def __init__(self):
        self.launches = self.allocations = self.h2d = self.d2h = 0
        self.h2d_bytes = self.d2h_bytes = 0

    def as_dict(self) -> dict:
        return dict(vars(self))


@contextlib.contextmanager
def counting():
    """Count, inside, every kernel launch, device allocation and host / device copy made
    through numba-cuda (not only through this module): numba's ``cuda.to_device``,
    ``device_array`` and ``device_array_like`` and the device arrays' ``copy_to_device`` /
    ``copy_to_host`` are wrapped for the duration, and on the simulator its kernel objects'
    launches and the host arrays a launch copies in and back. Yields a :class:`Counts`."""
    c = Counts()
    patches = []

    def patch(owner, name, wrap):
        orig = getattr(owner, name)
        patches.append((owner, name, orig, name in vars(owner)))
        setattr(owner, name, wrap(orig))

    def nbytes(a):
        return int(getattr(a, "nbytes", 0) or 0)

    def counted_to_device(orig):
        def to_device(ary, *a, **k):
            to = k.get("to", a[2] if len(a) > 2 else None)
            if to is None:
                c.allocations += 1
            c.h2d += 1
            c.h2d_bytes += nbytes(np.asarray(ary))
            return orig(ary, *a, **k)
        return to_device

    def counted_alloc(orig):
        def alloc(*a, **k):
            c.allocations += 1
            return orig(*a, **k)
        return alloc

    def counted_h2d(orig):
        def copy_to_device(self, ary, *a, **k):
            if isinstance(ary, np.ndarray):
                c.h2d += 1
                c.h2d_bytes += nbytes(ary)
            return orig(self, ary, *a, **k)
        return copy_to_device

    def counted_d2h(orig):
        def copy_to_host(self, *a, **k):
            c.d2h += 1
            c.d2h_bytes += nbytes(self)
            return orig(self, *a, **k)
        return copy_to_host

    patch(cuda, "to_device", counted_to_device)
    patch(cuda, "device_array", counted_alloc)
    patch(cuda, "device_array_like", counted_alloc)
    if SIMULATOR:
        from numba.cuda.simulator import kernel as simkernel
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray as arrays

        def counted_launch(orig):
            def __call__(self, *args):
                if not (self._device or simkernel._kernel_context):
                    c.launches += 1
                    for a in args:          # a host array is copied in and back by the launch
                        if isinstance(a, np.ndarray) and a.ndim > 0:
                            c.allocations += 1
                            c.h2d += 1
                            c.d2h += 1
                return orig(self, *args)
            return __call__
        patch(simkernel.FakeCUDAKernel, "__call__", counted_launch)
    else:
        from numba.cuda.cudadrv.devicearray import DeviceNDArray as arrays
        start = launches
    patch(arrays, "copy_to_device", counted_h2d)
    patch(arrays, "copy_to_host", counted_d2h)
    try:
        yield c
    finally:
        for owner, name, orig, own in reversed(patches):
            if own:
                setattr(owner, name, orig)
            else:                        # an inherited method: drop the wrapper again
                delattr(owner, name)
        if not SIMULATOR:            # on hardware the launches are this module's own count
            c.launches = launches - start


_configs: dict = {}


def _configured(kernel, grid, block, shared: int, stream=None):
    """``kernel[grid, block, 0, shared]``, made once per configuration. pyimp's grids are small
    on purpose (a block per head, per row group), and numba-cuda warns of "low occupancy" for
    every grid under 128 blocks: that warning is kept out of pyimp's own launches here, where a
    configuration is made, and nowhere else."""
    key = (kernel, grid, block, shared, stream)
    cfg = _configs.get(key)
    if cfg is None:
        if len(_configs) >= 4096:                  # grids follow the context length
            _configs.clear()
        with warnings.catch_warnings():
            for category in _performance_warnings():
                warnings.simplefilter("ignore", category)
            cfg = kernel[grid, block, 0 if stream is None else stream, shared]
        _configs[key] = cfg
    return cfg


@functools.cache
def _performance_warnings() -> tuple:
    """numba-cuda's performance-warning class (its own ``numba.cuda.core.errors`` since it
    left numba's tree; ``numba.core.errors`` before)."""
    import importlib
    found = []
    for mod in ("numba.cuda.core.errors", "numba.core.errors"):
        try:
            found.append(importlib.import_module(mod).NumbaPerformanceWarning)
        except (ImportError, AttributeError):
            pass
    return tuple(found)


def to_device(a: np.ndarray):
    """A device copy of a host array (the array itself under :func:`compile_only`)."""
    a = np.ascontiguousarray(a)
    return a if _compile_cc is not None else cuda.to_device(a)


def empty(shape, dtype):
    """An uninitialised device array (zeros on the host under :func:`compile_only`)."""
    if _compile_cc is not None:
        return np.zeros(shape, dtype)
    return cuda.device_array(shape, dtype)


def zeros(shape, dtype):
    """A zero-filled device array."""
    if _compile_cc is not None:
        return np.zeros(shape, dtype)
    return cuda.to_device(np.zeros(shape, dtype))


def copy(d):
    """A new device array holding what device array d holds (a device-to-device copy; a host
    copy under :func:`compile_only`)."""
    if isinstance(d, np.ndarray):
        return d.copy()
    out = cuda.device_array(d.shape, d.dtype)
    out.copy_to_device(d)
    return out


def upload(dst, a, stream=0) -> None:
    """Copy array a (host, or a device array of the same shape) into device array dst in
    place (no allocation; dst stays where it is); under :func:`compile_only` dst is a host
    array and takes a's values."""
    if isinstance(dst, np.ndarray):
        dst[...] = a
    else:
        dst.copy_to_device(np.ascontiguousarray(a) if isinstance(a, np.ndarray) else a,
                           stream=stream)


def to_host(d) -> np.ndarray:
    """A host copy of a device array (a host array is returned as is)."""
    return d if isinstance(d, np.ndarray) else d.copy_to_host()


def is_device_array(a) -> bool:
    return not isinstance(a, np.ndarray) and hasattr(a, "copy_to_host")


def blocks_for(n: int, threads: int) -> int:
    """Thread blocks of ``threads`` threads that cover n items (at least one)."""
    return max(1, -(-int(n) // threads))


def pow2_threads(n: int, lo: int = 32, hi: int = 256) -> int:
    """The smallest power of two >= n within [lo, hi]."""
    return int(min(hi, max(lo, 1 << max(0, math.ceil(math.log2(max(n, 1)))))))


def row_threads(n: int, hi: int = 256) -> int:
    """Threads of a block that strides over a row of n elements: a power of two in [32, hi] on
    hardware; 8 on the simulator, where each thread is a Python thread."""
    return 8 if SIMULATOR else pow2_threads(n, 32, hi)


# ---------------------------------------------------------------- reductions

if SIMULATOR:
    # two barriers: every barrier costs the simulator a thread switch per Python thread
    @cuda.jit(device=True)
    def block_sum(v, red):
        tid = cuda.threadIdx.x
        red[tid] = v
        cuda.syncthreads()
        r = float32(0.0)
        for i in range(cuda.blockDim.x):
            r += red[i]
        cuda.syncthreads()
        return r

else:
    @cuda.jit(device=True)
    def _warp_sum(v):
        off = 16
        while off > 0:
            v += cuda.shfl_xor_sync(FULL_MASK, v, off)
            off //= 2
        return v

    @cuda.jit(device=True)
    def _warp_max(v):
        off = 16
        while off > 0:
            v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, off))
            off //= 2
        return v

    @cuda.jit(device=True)
    def block_sum(v, red):
        tid = cuda.threadIdx.x
        nw = (cuda.blockDim.x + WARP - 1) // WARP
        v = _warp_sum(v)
        if tid % WARP == 0:
            red[tid // WARP] = v
        cuda.syncthreads()
        lane = tid % WARP
        w = red[lane] if lane < nw else float32(0.0)
        r = _warp_sum(w)
        cuda.syncthreads()
        return r



# ---------------------------------------------------------------- lane groups, n-wide reductions
#
# A *lane group* strides over one row (a key's channels) with consecutive threads, so its loads
# are coalesced: a warp on hardware, the whole block on the simulator (no warp operations
# there). ``lane_sums`` sums a thread's n partials over its group; ``block_max_n`` /
# ``block_sum_n`` reduce n values over the whole block at once (two barriers for all n).
# ``red``: float32 shared scratch of n * blockDim slots.

if SIMULATOR:
    @cuda.jit(device=True)
    def lane_group():
        """(lane, group, groups, lanes) of this thread: one group of every thread."""
        return cuda.threadIdx.x, 0, 1, cuda.blockDim.x

    @cuda.jit(device=True)
    def _block_reduce_n(v, n, red, take_max):
        """v[0:n] <- their maxima (take_max) or sums over the block, each in thread order
        (two barriers)."""
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        for g in range(n):
            red[g * nt + tid] = v[g]
        cuda.syncthreads()
        for g in range(n):
            r = red[g * nt]
            for i in range(1, nt):
                x = red[g * nt + i]
                r = max(r, x) if take_max else r + x
            v[g] = r
        cuda.syncthreads()

    @cuda.jit(device=True)
    def lane_sums(v, n, red):
        """v[0:n] <- their sums over this thread's lane group, the whole block here (every
        lane gets them); every thread of the block calls it (two barriers)."""
        _block_reduce_n(v, n, red, False)
else:
    @cuda.jit(device=True)
    def lane_group():
        """(lane, group, groups, lanes) of this thread: a warp is a group (blockDim a multiple
        of 32)."""
        tid = cuda.threadIdx.x
        return tid % WARP, tid // WARP, cuda.blockDim.x // WARP, WARP

    @cuda.jit(device=True)
    def lane_sums(v, n, red):
        """v[0:n] <- their sums over this thread's warp (butterfly shuffles: every lane gets
        them); no barrier, so a warp may call it alone."""
        for g in range(n):
            v[g] = _warp_sum(v[g])

    @cuda.jit(device=True)
    def _block_reduce_n(v, n, red, take_max):
        """v[0:n] <- their maxima (take_max) or sums over the block: warp shuffles, then the
        warps' results in order from shared memory (two barriers)."""
        tid = cuda.threadIdx.x
        nw = cuda.blockDim.x // WARP
        for g in range(n):
            x = _warp_max(v[g]) if take_max else _warp_sum(v[g])
            if tid % WARP == 0:
                red[g * nw + tid // WARP] = x
        cuda.syncthreads()
        for g in range(n):
            r = red[g * nw]
            for i in range(1, nw):
                x = red[g * nw + i]
                r = max(r, x) if take_max else r + x
            v[g] = r
        cuda.syncthreads()


@cuda.jit(device=True)
def block_max_n(v, n, red):
    """v[0:n] <- their maxima over the block (two barriers)."""
    _block_reduce_n(v, n, red, True)


@cuda.jit(device=True)
def block_sum_n(v, n, red):
    """v[0:n] <- their sums over the block (two barriers)."""
    _block_reduce_n(v, n, red, False)
