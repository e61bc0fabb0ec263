"""A barrier scheduler for numba-cuda's simulator, installed by this folder's conftest.

The simulator runs each CUDA thread of a block as a Python thread; its block manager finds
out that every live thread has reached ``syncthreads`` by polling all of them in a loop, and
that loop competes for the GIL with the threads doing the work (in a profile of an engine
test, three quarters of the time went to ``Thread.is_alive``). Here the threads meet at a
condition variable instead: the last live thread to arrive (or to exit) releases the others,
and the manager just joins them. The semantics are the simulator's: threads that have
exited do not count at a barrier, the first exception aborts the block and is re-raised with
its CUDA thread and block named. Kernels, arrays and the fake ``cuda`` module are untouched.

It also makes ``cuda.shared.array`` atomic. The simulator finds a block's static shared array
by its call site, and creates it when the site is not in its table yet: two threads that
both look before either stores get two different arrays, and the block then computes with
both (a rare, timing-dependent wrong answer: a radix select that indexed out of its output).
Here the look-up and the creation happen under one lock.

And it calls device functions directly. The simulator swaps the fake ``cuda`` module into a
device function's module globals around every call (a lock, a reference count and an import:
in a profile of an engine test about half of the CUDA threads' own time). Here a module's
globals are swapped at the first device call of a launch and stay swapped until the launch
ends; every thread of a launch sees the same fake module either way (the simulator runs one
launch at a time).
"""
import contextlib
import sys
import threading

import numpy as np

_SHARED_LOCK = threading.Lock()


def _new_array(shape, dtype):
    return np.empty(shape, dtype)


def _shared_array(self, shape, dtype, alignment=None):
    """``FakeCUDAShared.array`` with the call-site look-up and the creation under one lock
    (dynamic shared memory, ``shape == 0``, and the refusals stay the simulator's)."""
    if alignment is not None or shape == 0:
        return _STOCK_SHARED_ARRAY(self, shape, dtype, alignment)
    from numba.cuda.simulator import kernelapi as api
    if isinstance(dtype, api.types.Type):
        dtype = api.numpy_support.as_dtype(dtype)
    f = sys._getframe(1)
    site = (f.f_code.co_filename, f.f_lineno)
    with _SHARED_LOCK:
        res = self._allocations.get(site)
        if res is None:
            res = self._allocations[site] = _new_array(shape, dtype)
    return res


_STOCK_SHARED_ARRAY = None


class _Barrier:
    """One thread block's barrier: live threads, threads waiting, a generation count."""

    def __init__(self, n: int):
        self.cv = threading.Condition()
        self.live = n
        self.waiting = 0
        self.generation = 0
        self.error = None          # (exception, traceback) of the first thread that raised

    def _release(self):
        self.waiting = 0
        self.generation += 1
        self.cv.notify_all()

    def arrive(self):
        with self.cv:
            if self.error is not None:
                raise RuntimeError("aborted: another thread of the block raised")
            gen = self.generation
            self.waiting += 1
            if self.waiting == self.live:
                self._release()
                return
            while gen == self.generation and self.error is None:
                self.cv.wait()
            if self.error is not None:
                raise RuntimeError("aborted: another thread of the block raised")

    def leave(self, exception):
        with self.cv:
            self.live -= 1
            if exception is not None and self.error is None:
                self.error = exception
                self.cv.notify_all()
            elif self.live and self.waiting == self.live:
                self._release()


_HOLD_LOCK = threading.Lock()
_held: set = set()            # ids of the module globals the current launch holds swapped
_held_stack = None            # the launch's swaps, undone when it ends


def _kernel_call(stock_call, K):
    from numba.cuda.simulator.kernelapi import swapped_cuda_module

    def call(self, *args):
        ctx = K._kernel_context
        if ctx is None or _held_stack is None:
            if self._device or ctx is not None:          # outside a launch: the stock swap
                return stock_call(self, *args)
            return _launch(stock_call, self, args)
        gid = id(self.fn.__globals__)
        if gid not in _held:
            with _HOLD_LOCK:
                if gid not in _held:
                    _held_stack.enter_context(swapped_cuda_module(self.fn, ctx))
                    _held.add(gid)
        return self.fn(*args)
    return call


def _launch(stock_call, kernel, args):
    global _held_stack
    _held_stack = contextlib.ExitStack()
    try:
        return stock_call(kernel, *args)
    finally:
        with _HOLD_LOCK:
            stack, _held_stack = _held_stack, None
            _held.clear()
        stack.close()


def install() -> bool:
    """Replace the simulator's block scheduling; False (stock simulator kept) if this
    numba-cuda does not have the classes and attributes it replaces."""
    try:
        from numba.cuda.simulator import kernel as K
    except ImportError:
        return False
    BT, BM = getattr(K, "BlockThread", None), getattr(K, "BlockManager", None)
    if BT is None or BM is None or not hasattr(BT, "syncthreads") or not hasattr(BM, "run"):
        return False
    if getattr(BM, "_pyimp_barrier", False):
        return True
    stock_run = BT.run

    def thread_run(self):
        stock_run(self)                       # stores an exception in self.exception
        self._barrier.leave(self.exception)

    def syncthreads(self):
        self._barrier.arrive()

    def manager_run(self, grid_point, *args):
        barrier = _Barrier(int(np.prod(self._block_dim)))
        threads = []
        for block_point in np.ndindex(*self._block_dim):
            def target():
                self._f(*args)
            t = BT(target, self, grid_point, block_point, self._debug)
            t._barrier = barrier
            threads.append(t)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if barrier.error is not None:
            exc, tb = barrier.error
            raise exc.with_traceback(tb)

    BT.run, BT.syncthreads, BM.run = thread_run, syncthreads, manager_run
    FK = getattr(K, "FakeCUDAKernel", None)
    if FK is not None and hasattr(K, "_kernel_context"):
        FK.__call__ = _kernel_call(FK.__call__, K)
    BM._pyimp_barrier = True
    global _STOCK_SHARED_ARRAY
    from numba.cuda.simulator import kernelapi
    sh = getattr(kernelapi, "FakeCUDAShared", None)
    if sh is not None and hasattr(sh, "array"):
        _STOCK_SHARED_ARRAY = sh.array
        sh.array = _shared_array
    return True
