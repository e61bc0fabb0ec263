"""float32 products of dequantized weight tiles on 512-bit vectors: the fp32 prefill's X @ W.T.

``fp32`` numerics multiply activations by exactly dequantized weights in float32
(:func:`loaders.quants.matmul`: weight rows dequantized a tile at a time, then a
product). NumPy's BLAS does the product where it runs AVX-512 kernels; where it
runs AVX2 ones on a host that has AVX-512 (an OpenBLAS forced to its Haswell
kernels by OPENBLAS_CORETYPE, or one that does not know the CPU), this kernel
does, at up to twice the width:

* out^T = W @ X^T, six weight rows by 32 activation columns at a time
  (:func:`_tile_6x32`): per k, two 16-lane loads of X^T[k] and six weight values
  broadcast from their rows, 12 fmas into 12 accumulators held in registers;
* X^T is packed once per product (columns padded to 32); weight rows are read
  in place from the tile; k runs in chunks of KC so that the six rows' chunk and
  X^T's stay in L1/L2; the work items are panels of weight rows.

Each output is one float32 fma chain over k in order: a different rounding from
BLAS's, within the fma chain's error bound (tests/test_gemm.py).
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import jit, quants_legacy
from .quants_legacy import ir_ptr, ir_splat

jit.kernel_module(__file__, quants_legacy)      # its IR helpers: a change there recompiles

MW = 6          # weight rows per tile: 12 accumulators, 2 X^T vectors, a broadcast: 15 of 32 registers
COLS = 32       # activation columns per tile (two 16-lane vectors)
KC = 256        # k per chunk: the six rows' chunk (6 KB) and X^T's (32 KB) stay in L1/L2
# (AMD EPYC znver5, 2 threads, a 1056 x 2048 tile hot in L3, 128 activation rows, before X^T
# was blocked: KC 256 393 GFLOP/s, KC 128 357; twelve weight rows per tile, 24 accumulators,
# 78-229)
PANEL_ROWS = 96  # weight rows per work item at most (fewer, to give every thread the same number)


@intrinsic
def _tile_6x32(typingctx, W, wo, ldw, XT, xo, ldx, kc, CT, co, ldc):
    """CT[co + j*ldc + c] += sum_{k < kc} W[wo + j*ldw + k] * XT[xo + k*ldx + c] for j < MW,
    c < COLS (1-D float32 arrays, offsets in elements): the accumulators are loaded from CT,
    kept in registers over k (one fma per k, in order), and stored back."""
    sig = types.void(W, wo, ldw, XT, xo, ldx, kc, CT, co, ldc)

    def codegen(context, builder, signature, args):
        i64, f32 = ir.IntType(64), ir.FloatType()
        vf = ir.VectorType(f32, 16)
        wty, _, _, xty, _, _, _, cty, _, _ = signature.args

        def as64(v):
            return builder.sext(v, i64) if v.type.width < 64 else v

        def const(v):
            return ir.Constant(i64, v)

        wo_, ldw_, xo_, ldx_, kc_, co_, ldc_ = (as64(args[i]) for i in (1, 2, 4, 5, 6, 8, 9))
        wp, xp, cp = (ir_ptr(context, builder, ty, args[i], const(0), f32)
                      for ty, i in ((wty, 0), (xty, 3), (cty, 7)))
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]),
                                             "llvm.fma.v16f32")
        nv = COLS // 16
        cptr = [[builder.bitcast(builder.gep(cp, [builder.add(co_, builder.add(builder.mul(ldc_, const(j)),
                                                                               const(16 * v)))]),
                                 vf.as_pointer()) for v in range(nv)] for j in range(MW)]
        accs = []
        for j in range(MW):
            for v in range(nv):
                a = cgutils.alloca_once(builder, vf)
                builder.store(builder.load(cptr[j][v], align=4), a)
                accs.append(a)
        wrow = [builder.gep(wp, [builder.add(wo_, builder.mul(ldw_, const(j)))]) for j in range(MW)]
        xbase = builder.gep(xp, [xo_])
        with cgutils.for_range(builder, kc_, intp=i64) as loop:
            k = loop.index
            xr = builder.gep(xbase, [builder.mul(k, ldx_)])
            xv = [builder.load(builder.bitcast(builder.gep(xr, [const(16 * v)]), vf.as_pointer()), align=4)
                  for v in range(nv)]
            for j in range(MW):
                b = ir_splat(builder, builder.load(builder.gep(wrow[j], [k])), vf)
                for v in range(nv):
                    a = accs[j * nv + v]
                    builder.store(builder.call(fma, [b, xv[v], builder.load(a)]), a)
        for j in range(MW):
            for v in range(nv):
                builder.store(builder.load(accs[j * nv + v]), cptr[j][v], align=4)
        return context.get_dummy_value()

    return sig, codegen


@jit.njit
def _zeros(n):
    """float32 zeros of its own function: in the parallel kernel a fill would be a nested parfor."""
    return np.zeros(n, np.float32)


@jit.njit(parallel=True)
def _products(W, nw, XT, out, c0, panel, kc):
    """out[i, c0 + j] = sum_k W[j, k] * X[i, k] for j < nw, i < out.shape[0]. W float32[rows,
    K] with rows >= nw rounded up to MW (rows past nw are read, their sums dropped), XT
    (:func:`pack_columns`) float32[mp / COLS, K, COLS]; work items of ``panel`` rows."""
    K = W.shape[1]
    mp = XT.shape[0] * COLS
    m = out.shape[0]
    Wf = W.reshape(-1)
    Xf = XT.reshape(-1)
    for p in prange((nw + panel - 1) // panel):
        j0 = p * panel
        nj = min(panel, nw - j0)
        nt = (nj + MW - 1) // MW * MW
        CT = _zeros(nt * mp)
        for k0 in range(0, K, kc):
            kn = min(kc, K - k0)
            for jt in range(0, nt, MW):
                for i0 in range(0, mp, COLS):
                    _tile_6x32(Wf, (j0 + jt) * K + k0, K, Xf, (i0 * K + k0 * COLS), COLS, kn, CT,
                               jt * mp + i0, mp)
        for i in range(m):
            for j in range(nj):
                out[i, c0 + j0 + j] = CT[j * mp + i]


def pack_columns(X: np.ndarray) -> np.ndarray:
    """X float32[m, K] -> X^T in blocks of COLS columns, float32[mp / COLS, K, COLS], mp = m
    rounded up to COLS (the padding columns are zeros: their sums are computed and dropped).
    A block's rows lie next to each other: as X^T[K, mp] they would be mp * 4 bytes apart,
    and at 1-2 KB the chunk of a tile maps onto a few L1 sets (a 2048 x 640 Q5_0 product
    with 256 activation rows ran at 85 GFLOP/s that way, against 247 for BLAS)."""
    m, K = X.shape
    nb = -(-m // COLS)
    XT = np.zeros((nb, K, COLS), np.float32)
    for b in range(nb):
        rows = X[b * COLS:(b + 1) * COLS]
        XT[b, :, :rows.shape[0]] = rows.T
    return XT


def tile_rows(n: int) -> int:
    """Rows to allocate for a weight tile of n rows (the kernel reads whole groups of MW)."""
    return -(-n // MW) * MW


def products(W: np.ndarray, nw: int, XT: np.ndarray, out: np.ndarray, c0: int) -> None:
    """out[:, c0:c0 + nw] = X @ W[:nw].T with XT = :func:`pack_columns` (X); W float32[rows, K]
    C-contiguous with rows >= :func:`tile_rows` (nw); out float32[m, cols] C-contiguous."""
    if (XT.ndim != 3 or XT.shape[2] != COLS or W.shape[0] < tile_rows(nw) or W.shape[1] != XT.shape[1]
            or out.shape[0] > XT.shape[0] * COLS or out.shape[1] < c0 + nw):
        raise ValueError(f"products: W {W.shape} (nw {nw}), XT {XT.shape}, out {out.shape} do not fit")
    if not (W.flags.c_contiguous and XT.flags.c_contiguous and out.flags.c_contiguous):
        raise ValueError("products: W, XT and out must be C-contiguous")
    if nw > 0 and out.shape[0] > 0:
        threads = numba.get_num_threads()
        npanel = -(-nw // PANEL_ROWS)
        npanel = -(-npanel // threads) * threads         # every thread the same share
        _products(W, nw, XT, out, c0, tile_rows(-(-nw // npanel)), KC)
