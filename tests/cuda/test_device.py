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
    m = device.block_max(v, red)
    if tid == 0:
        out[cuda.blockIdx.x, 0] = s
        out[cuda.blockIdx.x, 1] = m


@pytest.mark.parametrize("threads", [1, 4, 32, 64])
def test_block_reductions(threads):
    rng = np.random.default_rng(threads)
    x = rng.standard_normal((2, threads)).astype(np.float32)
    x[1, threads // 2] = -np.inf if threads > 1 else x[1, 0]
    out = device.zeros((2, 2), np.float32)
    device.launch(_reduce_kernel, 2, threads, device.to_device(x), out)
    got = device.to_host(out)
    # f32 sums in another order: a few ulps of the magnitudes summed
    np.testing.assert_allclose(got[:, 0], x.sum(1, dtype=np.float64), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[:, 1], x.max(1))
