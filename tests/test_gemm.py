"""loaders.gemm (the fp32 matmul's products where BLAS runs narrower vectors than the host):
every output against its definition, at every edge of the tiling."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from hypothesis import given, settings
from hypothesis import strategies as st

from loaders import gemm, quants

U = 2.0 ** -24       # float32 unit roundoff


def _run(W, nw, X, cols, c0):
    out = np.full((X.shape[0], cols), np.nan, np.float32)
    gemm.products(W, nw, gemm.pack_columns(X), out, c0)
    return out


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 70), nw=st.integers(1, 40), K=st.integers(1, 300), extra=st.integers(0, 5),
       c0=st.integers(0, 7), seed=st.integers(0, 2 ** 32 - 1))
def test_integer_products_are_exact_and_land_in_their_columns(m, nw, K, extra, c0, seed):
    """Small integers: every partial sum is exact in float32 whatever the order, so each output
    must be exactly its dot product. Any m (the 32-column blocks padded), any row count (tiles
    of six rows, panels per thread), any K (chunks of KC and a short last one); columns outside
    [c0, c0 + nw) keep what they held."""
    rng = np.random.default_rng(seed)
    W = rng.integers(-8, 8, (gemm.tile_rows(nw) + extra, K)).astype(np.float32)
    X = rng.integers(-8, 8, (m, K)).astype(np.float32)
    cols = c0 + nw + 3
    out = _run(W, nw, X, cols, c0)
    want = X.astype(np.int64) @ W[:nw].T.astype(np.int64)      # |sum| <= 64 * 300: exact
    assert np.array_equal(out[:, c0:c0 + nw], want.astype(np.float32))
    assert np.isnan(out[:, :c0]).all() and np.isnan(out[:, c0 + nw:]).all()


@pytest.mark.parametrize("m,nw,K", [(1, 1, 1), (31, 7, 257), (32, 6, 256), (33, 97, 513), (130, 200, 2048)])
def test_float_products_within_the_fma_chain_bound(m, nw, K):
    """Random floats: each output is a chain of K fmas, so |out - exact| <= gamma_K * sum_k
    |x_k w_k| with gamma_K = K u / (1 - K u) (Higham, the recursive-summation bound; one
    rounding per fma)."""
    rng = np.random.default_rng(K)
    W = rng.standard_normal((gemm.tile_rows(nw), K)).astype(np.float32)
    X = rng.standard_normal((m, K)).astype(np.float32)
    out = _run(W, nw, X, nw, 0)
    exact = X.astype(np.float64) @ W[:nw].T.astype(np.float64)
    bound = K * U / (1 - K * U) * (np.abs(X).astype(np.float64) @ np.abs(W[:nw]).T.astype(np.float64))
    assert (np.abs(out - exact) <= bound).all()


def test_products_refuse_what_does_not_fit():
    W = np.zeros((6, 64), np.float32)
    XT = gemm.pack_columns(np.zeros((4, 64), np.float32))
    with pytest.raises(ValueError, match="do not fit"):
        gemm.products(W[:5], 5, XT, np.empty((4, 5), np.float32), 0)        # rows past nw missing
    with pytest.raises(ValueError, match="do not fit"):
        gemm.products(W, 6, XT, np.empty((4, 6), np.float32), 1)            # columns past out
    with pytest.raises(ValueError, match="C-contiguous"):
        gemm.products(np.asfortranarray(W), 6, XT, np.empty((4, 6), np.float32), 0)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q8_0, QT.Q5_1])
def test_fp32_matmul_through_gemm_matches_blas(qtype, monkeypatch):
    """quants.matmul with either product (FP32_PRODUCTS): the same exactly dequantized weights,
    so the two differ only by their summation orders, each within the fma chain bound of the
    exact product (twice the bound between them); a tile boundary (MATMUL_TILE_ROWS) inside."""
    rng = np.random.default_rng(int(qtype))
    n, rows, m = 256, 700, 40
    W = rng.standard_normal((rows, n)).astype(np.float32)
    from gguf.quants import quantize
    raw = quantize(W, qtype)
    X = rng.standard_normal((m, n)).astype(np.float32)
    monkeypatch.setattr(quants, "MATMUL_TILE_ROWS", 512)
    monkeypatch.setattr(quants, "MATMUL_TILE_BYTES", 0)
    got = {}
    for how in ("gemm", "blas"):
        monkeypatch.setattr(quants, "FP32_PRODUCTS", how)
        got[how] = quants.matmul(raw, qtype, n, X)
    w = quants.dequantize(raw, qtype, n).astype(np.float64)
    exact = X.astype(np.float64) @ w.T
    bound = n * U / (1 - n * U) * (np.abs(X).astype(np.float64) @ np.abs(w).T)
    assert (np.abs(got["gemm"] - exact) <= bound).all()
    assert (np.abs(got["gemm"] - got["blas"]) <= 2 * bound).all()


@pytest.mark.parametrize("avx512,core,want", [
    (True, "Haswell", "gemm"), (True, "Zen", "gemm"), (True, "SkylakeX", "blas"),
    (True, "SAPPHIRERAPIDS", "blas"), (True, None, "blas"), (False, "Haswell", "blas")])
def test_fp32_products_choice_follows_the_host_and_the_blas(monkeypatch, avx512, core, want):
    """gemm exactly where the host has AVX-512 and NumPy's OpenBLAS says it runs narrower
    kernels; BLAS where it runs AVX-512 ones, cannot say, or the host has no AVX-512."""
    from loaders import quants_legacy
    feats = {"avx2", "fma"} | ({"avx512f", "avx512bw"} if avx512 else set())
    monkeypatch.setattr(quants_legacy, "FEATURES", frozenset(feats))
    monkeypatch.setattr(quants, "blas_core", lambda: core)
    assert quants._fp32_products() == want


def test_blas_core_names_numpys_openblas_kernels():
    """Where NumPy links an OpenBLAS that says which kernels it runs, blas_core returns a name
    OpenBLAS uses (one of its x86 kernel sets, or another architecture's)."""
    core = quants.blas_core()
    if core is None:
        pytest.skip("NumPy's BLAS does not say which kernels it runs")
    assert core.isidentifier() and len(core) >= 3, core
