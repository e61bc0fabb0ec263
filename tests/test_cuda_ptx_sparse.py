"""Every launcher of pyimp.cuda.sparse compiled for real hardware (sm_90) with the argument types
it launches with: every anchor type over fp16 and fp32 caches, every retrieval type (scores and
selection, dense and sparse), the importance decay. ``device.compile_only`` turns each launch
into an NVVM compilation, which type-checks what the simulator suite cannot (the simulator
runs kernels as Python, and the selection's warp-shuffle scan exists only on hardware).
Under CI=true a missing numba-cuda or NVVM fails instead of skipping."""
import numpy as np
import pytest
from conftest import in_ci

CC = (9, 0)


def _need(what: str, why: str):
    if in_ci():
        pytest.fail(f"CI=true and {what} is missing: {why}")
    pytest.skip(f"{what} unavailable: {why}")


@pytest.fixture(scope="module")
def ptx():
    """compile_only mode of pyimp.cuda.device, or a skip (a failure in CI) without NVVM."""
    try:
        from numba import cuda
    except ImportError as e:
        _need("numba-cuda", f"{e} (pip install 'pyimp[test]')")
    try:
        cuda.compile_ptx(lambda a: None, "(float32[:],)", cc=CC)
    except Exception as e:
        _need("NVVM (numba-cuda[cu12])", str(e).splitlines()[0])
    from pyimp.cuda import device
    return device


def test_anchor_kernels_compile(ptx):
    from pyimp.cuda import sparse
    from pyimp.sparse import AnchorType
    Hkv, G, NB, B, D = 2, 2, 6, 8, 16
    blocks, n_valid = np.arange(3, dtype=np.int32), np.array([B, B, 3], np.int32)
    imp = np.zeros((NB, B, Hkv * G), np.float16)
    before = ptx.launches
    with ptx.compile_only(CC):
        for kdt in (np.float16, np.float32):
            kc = np.zeros((Hkv, NB, B * D), kdt)
            for atype in AnchorType:
                Ha = Hkv * G if atype is AnchorType.DYNAMIC else Hkv
                anchor = np.zeros((NB, 2, Ha, D), np.float16)
                sparse.compute_anchors(atype, kc, blocks, n_valid, anchor, imp)
    assert ptx.launches - before == 2 * len(AnchorType)


def test_retrieval_kernels_compile(ptx):
    from pyimp.cuda import sparse
    from pyimp.sparse import AnchorType, RetrievalType
    Hkv, G, B, D = 2, 2, 8, 16
    n_ctx = 40 * B + 3
    NB = 48
    q = np.zeros((Hkv * G, D), np.float32)
    bt = np.arange(NB, dtype=np.int32)
    before = ptx.launches
    with ptx.compile_only(CC):
        for rtype in RetrievalType:
            for atype in (AnchorType.QUEST, AnchorType.BLOCK_MEAN, AnchorType.DYNAMIC):
                Ha = Hkv * G if atype is AnchorType.DYNAMIC else Hkv
                anchor = np.zeros((NB, 2, Ha, D), np.float16)
                sparse.retrieve_blocks(q, anchor, bt, n_ctx, B, Hkv, rtype, 1, 4, 2, atype)
                sparse.retrieve_blocks(q, anchor, bt, 3 * B, B, Hkv, rtype, 1, 4, 2, atype)
        sparse.select_blocks(np.zeros((37, 2), np.float32), n_ctx, B, 1, 4, 2)
        anchor = np.zeros((NB, 2, Hkv, D), np.float16)
        sparse.set_scores(q, anchor, bt, 1, 38, 2, 2, G)
    # a retrieval is one launch (scores and selection); the selection and the scores alone
    assert ptx.launches - before == 3 * 3 * 2 + 1 + 1


def test_decay_kernel_compiles(ptx):
    from pyimp.cuda import sparse
    before = ptx.launches
    with ptx.compile_only(CC):
        imp = np.ones((6, 8, 4), np.float16)
        sparse.decay_importance(imp, np.arange(6, dtype=np.int32), 40, 0.5)
        sparse.decay_importance(imp, np.arange(6, dtype=np.int32), 40, 1.0)   # no launch
    assert ptx.launches - before == 1
    np.testing.assert_array_equal(imp, 1.0)           # compiled, not run
