"""Every launcher of pyimp.cuda.linear (every weight type) and pyimp.cuda.ops compiled for real
hardware (sm_90) with the argument types it launches with: ``device.compile_only`` turns each
launch into an NVVM compilation, which type-checks what the simulator suite cannot (the
simulator runs kernels as Python). Under CI=true a missing numba-cuda or NVVM fails."""
import numpy as np
import pytest
from test_cuda import ptx  # noqa: F401  (the fixture: compile_only mode, or a skip without NVVM)

from loaders import ggml_types

CC = (9, 0)


def test_linear_kernels_compile(ptx):  # noqa: F811
    from pyimp.cuda import linear
    assert linear.SUPPORTED_TYPES == ggml_types.SUPPORTED_TYPES
    before = ptx.launches
    with ptx.compile_only(CC):
        for qt in sorted(linear.SUPPORTED_TYPES):
            n = ggml_types.block_size(qt) if ggml_types.block_size(qt) > 1 else 64
            raw = np.zeros((3, ggml_types.row_bytes(qt, n)), np.uint8)
            linear.matvec(raw, qt, n, np.zeros(n, np.float32), np.zeros(3, np.float32))
            linear.matmul(raw, qt, n, np.zeros((2, n), np.float32), np.zeros((2, 3), np.float32))
            linear.get_rows(raw, qt, n, np.zeros(2, np.int32), np.zeros((2, n), np.float32))
        linear.get_rows(raw, qt, n, np.zeros(2, np.int64), np.zeros((2, n), np.float32))
    assert ptx.launches - before == 3 * len(linear.SUPPORTED_TYPES) + 1


def test_ops_kernels_compile(ptx):  # noqa: F811
    from pyimp.cuda import ops
    f32 = np.float32
    with ptx.compile_only(CC):
        x = np.zeros((4, 64), f32)
        ops.rms_norm(x, np.zeros(64, f32), 1e-6, np.zeros_like(x))
        for neox in (True, False):
            ops.rope(np.zeros((2, 4, 16), f32), np.zeros((2, 4), f32), np.zeros((2, 4), f32), neox)
        ops.silu(x)
        ops.gelu_tanh(x, np.zeros_like(x))
        ops.softcap(x, 30.0)
        for act in ("silu", "gelu_tanh"):
            ops.glu(x, x, np.zeros_like(x), act)
        ops.add(x, np.ones_like(x))
        ops.scale(x, 0.5)


def test_compile_only_runs_nothing(ptx):  # noqa: F811
    """The host arrays come back untouched: nothing ran, only compiled."""
    from pyimp.cuda import ops
    with ptx.compile_only(CC):
        x = np.ones((2, 8), np.float32)
        ops.scale(x, 2.0)
    np.testing.assert_array_equal(x, 1.0)


@pytest.mark.parametrize("bad", ["IQ2_XXS", "Q8_K"])
def test_unsupported_type_names_it(bad):
    pytest.importorskip("numba.cuda")
    from gguf import GGMLQuantizationType as QT

    from pyimp.cuda import linear
    with pytest.raises(ValueError, match=bad):
        linear.matvec(np.zeros((1, 8), np.uint8), QT[bad], 256, np.zeros(256, np.float32),
                      np.zeros(1, np.float32))
