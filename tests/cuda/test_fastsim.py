"""The simulator's barrier scheduler (fastsim.py): barriers across rounds, threads that exit
before a barrier, exceptions that abort the block instead of hanging it, and the
syncthreads reductions built on it."""
import os

import numpy as np
import pytest
from numba import cuda, int32

from pyimp.cuda import device

pytestmark = pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1",
                                reason="the simulator's scheduler")


def test_installed():
    from numba.cuda.simulator import kernel as K
    assert getattr(K.BlockManager, "_pyimp_barrier", False)


@cuda.jit
def _rounds(out, n_rounds, exit_from):
    """Each round every live thread adds its id to a shared slot after a barrier; threads
    with id >= exit_from leave after the first round."""
    sh = cuda.shared.array(64, int32)
    tid = cuda.threadIdx.x
    for r in range(n_rounds):
        sh[tid] = tid + r
        cuda.syncthreads()
        # read a neighbour's slot: wrong unless the barrier waited for it
        j = (tid + 1) % cuda.blockDim.x
        if j < exit_from or r == 0:
            out[cuda.blockIdx.x, r, tid] = sh[j]
        cuda.syncthreads()
        if tid >= exit_from:
            return


@pytest.mark.parametrize("threads,exit_from", [(1, 1), (8, 8), (8, 3), (16, 0)])
def test_barriers_with_early_exits(threads, exit_from):
    R = 4
    out = np.full((2, R, threads), -1, np.int32)
    _rounds[2, threads](out, R, exit_from)
    for b in range(2):
        for r in range(R):
            for t in range(threads):
                j = (t + 1) % threads
                live = r == 0 or t < exit_from
                want = j + r if live and (j < exit_from or r == 0) else -1
                assert out[b, r, t] == want, (b, r, t)


@cuda.jit
def _raises(out):
    tid = cuda.threadIdx.x
    cuda.syncthreads()
    out[tid] = 1          # out has fewer elements than threads: the last threads raise
    cuda.syncthreads()    # the others wait here until the block is aborted


def test_an_exception_aborts_the_block():
    with pytest.raises(IndexError, match=r"tid=\[7"):
        _raises[1, 8](np.zeros(7, np.int32))


@cuda.jit
def _count(x, out):
    tid = cuda.threadIdx.x
    out[0] = cuda.syncthreads_count(x[tid] > 0)
    out[1] = cuda.syncthreads_or(x[tid] > 5)
    out[2] = cuda.syncthreads_and(x[tid] >= 0)


def test_syncthreads_reductions():
    x = np.array([0, 3, 7, 1, 0, 2], np.int32)
    out = np.zeros(3, np.int32)
    _count[1, 6](x, out)
    assert out.tolist() == [4, 1, 1]


def test_shared_array_creation_is_atomic(monkeypatch):
    """Threads asking for the same call site's shared array at once all get one array, even
    when creating it takes long enough for every thread to look first (the stock simulator
    gave each a new one)."""
    import threading
    import time

    import fastsim
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    def slow(shape, dtype):
        time.sleep(0.02)                      # every other thread looks meanwhile
        return np.zeros(shape, dtype)

    monkeypatch.setattr(fastsim, "_new_array", slow)
    shared = FakeCUDAShared(0)
    got = [None] * 8
    start = threading.Barrier(8)

    def alloc(i):
        start.wait()
        got[i] = shared.array(16, int32)      # one call site for every thread

    threads = [threading.Thread(target=alloc, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(g is got[0] for g in got) and got[0].dtype == np.int32
    assert shared.array(0, np.dtype(np.float32)).size == 0          # dynamic shared memory: the stock path


@cuda.jit
def _sums(x, out):
    red = cuda.shared.array(64, np.float32)
    for r in range(2):                       # the same device function twice in a launch
        out[r] = device.block_sum(x[cuda.threadIdx.x] * (r + 1), red)


def test_device_calls_see_the_launch_and_leave_real_cuda_behind():
    """Device functions of another module (pyimp.cuda.device's block_sum: threadIdx,
    syncthreads) run with the launch's fake module inside a launch, and after it that module's
    globals hold the real numba.cuda again (the next launch gets its own block shape)."""
    import numba.cuda as real_cuda
    for n in (8, 5):
        x = np.arange(1, n + 1, dtype=np.float32)
        out = np.zeros(2, np.float32)
        _sums[1, n](x, out)
        assert out.tolist() == [x.sum(), 2 * x.sum()]
        assert device.cuda is real_cuda
