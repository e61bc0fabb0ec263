"""The block-wide reductions every kernel builds on."""
import numpy as np
import pytest
from numba import cuda, float32

from pyimp.cuda import device


@cuda.jit
def _reduce_kernel(x, out):
    red = cuda.shared.array(256, float32)
    tid = cuda.threadIdx.x
    v = x[cuda.blockIdx.x, tid]
    s = device.block_sum(v, red)
    if tid == 0:
        out[cuda.blockIdx.x, 0] = s


@pytest.mark.parametrize("threads", [1, 4, 32, 64])
def test_block_reductions(threads):
    rng = np.random.default_rng(threads)
    x = rng.standard_normal((2, threads)).astype(np.float32)
    out = device.zeros((2, 1), np.float32)
    device.launch(_reduce_kernel, 2, threads, device.to_device(x), out)
    got = device.to_host(out)
    # f32 sums in another order: a few ulps of the magnitudes summed
    np.testing.assert_allclose(got[:, 0], x.sum(1, dtype=np.float64), rtol=1e-5, atol=1e-5)


@cuda.jit
def _reduce_n_kernel(x, out):
    red = cuda.shared.array(3 * 128, float32)          # n = 3 values per thread
    tid = cuda.threadIdx.x
    b = cuda.blockIdx.x
    v = cuda.local.array(3, float32)
    for g in range(3):
        v[g] = x[b, g, tid]
    device.block_max_n(v, 3, red)
    w = cuda.local.array(3, float32)
    for g in range(3):
        w[g] = x[b, g, tid]
    device.block_sum_n(w, 3, red)
    if tid == cuda.blockDim.x - 1:                      # every thread gets the results
        for g in range(3):
            out[b, 0, g] = v[g]
            out[b, 1, g] = w[g]


@pytest.mark.parametrize("threads", [32, 64, 128])   # whole warps, as the kernels launch them
def test_block_reductions_of_n_values(threads):
    """block_max_n / block_sum_n reduce each of n values over the block at once (a -inf
    among them included)."""
    rng = np.random.default_rng(threads)
    x = rng.standard_normal((2, 3, threads)).astype(np.float32)
    x[1, 2, threads // 2] = -np.inf
    x[1, 2, :threads // 2] = -np.inf
    out = device.zeros((2, 2, 3), np.float32)
    device.launch(_reduce_n_kernel, 2, threads, device.to_device(x), out)
    got = device.to_host(out)
    np.testing.assert_array_equal(got[:, 0], x.max(2))
    # f32 sums in another order: a few ulps of the magnitudes summed (-inf where one is -inf)
    np.testing.assert_allclose(got[:, 1], x.sum(2, dtype=np.float64), rtol=1e-5, atol=1e-5)
