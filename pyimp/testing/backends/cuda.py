"""pyimp's numba-cuda kernels under the conformance interface.

Inputs are uploaded, the kernel runs, results come back to the host: what the suite checks
is the kernels' arithmetic and indexing, not the transfers. Runs on a GPU, or on numba-cuda's
simulator with ``NUMBA_ENABLE_CUDASIM=1`` set before numba is imported (slow: keep
``--examples`` small there). ``importance_update`` has no standalone device kernel (the
attention kernels update importance themselves, which their checks cover), so it is not
exported.
"""
from __future__ import annotations

import numpy as np

from loaders.ggml_types import QT
from pyimp.cuda import attention as _att
from pyimp.cuda import device as _dev
from pyimp.cuda import linear as _lin
from pyimp.cuda import sparse as _sp
from pyimp.sparse.anchors import AnchorType
from pyimp.sparse.retrieval import RetrievalType

FP16 = "float16"


def _up(*arrays):
    return [None if a is None else _dev.to_device(np.ascontiguousarray(a)) for a in arrays]


def _back(dst, d) -> None:
    """Copy device array d into the host array dst (an in-place output)."""
    if dst is not None:
        dst[...] = _dev.to_host(d)


def dequantize(qtype, raw, n):
    out = _dev.empty((raw.shape[0], n), np.float32)
    (d_raw, ids) = _up(raw, np.arange(raw.shape[0], dtype=np.int32))
    _lin.get_rows(d_raw, QT[qtype], n, ids, out)
    return _dev.to_host(out)


def matvec(qtype, raw, n, x):
    out = _dev.empty((raw.shape[0],), np.float32)
    d_raw, d_x = _up(raw, x)
    _lin.matvec(d_raw, QT[qtype], n, d_x, out)
    return _dev.to_host(out)


def _lse(M, L):
    with np.errstate(divide="ignore"):
        return (_dev.to_host(M) + np.log(_dev.to_host(L))).astype(np.float32)


def attention_decode(q, k_cache, v_cache, block_table, n_ctx, scale, window, out):
    dq, dk, dv, dbt = _up(q[None], k_cache, v_cache, block_table)
    d_out = _dev.zeros((1,) + q.shape, np.float32)
    M, L = _att.decode(dq, dk, dv, dbt, n_ctx, scale, window, d_out)
    out[...] = _dev.to_host(d_out)[0]
    return _lse(M, L)[0]


def attention_prefill(q, k_cache, v_cache, block_table, pos0, scale, window, out,
                      importance=None, obs_start=0):
    dq, dk, dv, dbt, dimp = _up(q, k_cache, v_cache, block_table, importance)
    d_out = _dev.zeros(q.shape, np.float32)
    M, L = _att.prefill(dq, dk, dv, dbt, pos0, scale, window, d_out, dimp, obs_start)
    out[...] = _dev.to_host(d_out)
    _back(importance, dimp)
    return _lse(M, L)


def sparse_attention_decode(q, k_cache, v_cache, block_table, n_ctx, scale, window, sel, cnt,
                            out, importance=None):
    dq, dk, dv, dbt, dsel, dcnt, dimp = _up(q[None], k_cache, v_cache, block_table, sel, cnt,
                                            importance)
    d_out = _dev.zeros((1,) + q.shape, np.float32)
    M, L = _att.decode(dq, dk, dv, dbt, n_ctx, scale, window, d_out, sel=dsel, cnt=dcnt,
                       n_sel=sel.shape[1], importance=dimp)
    out[...] = _dev.to_host(d_out)[0]
    _back(importance, dimp)
    return _lse(M, L)[0]


def compute_anchors(anchor_type, k_cache, blocks, n_valid, anchor, importance=None):
    dk, db, dn, da, dimp = _up(k_cache, blocks.astype(np.int32), n_valid.astype(np.int32),
                               anchor, importance)
    _sp.compute_anchors(AnchorType(anchor_type), dk, db, dn, da, dimp)
    _back(anchor, da)


def block_scores(q, anchor, block_table, lb_start, lb_end, n_slots, G):
    # one set per query head: the per-head scores
    dq, da, dbt = _up(q, anchor, block_table)
    return _dev.to_host(_sp.set_scores(dq, da, dbt, lb_start, lb_end, q.shape[0], n_slots, G,
                                       shared=False))


def select_blocks(scores, n_ctx, block_len, init, pick, local):
    (ds,) = _up(scores)
    sel, cnt = _sp.select_blocks(ds, n_ctx, block_len, init, pick, local)
    return _dev.to_host(sel), _dev.to_host(cnt)


def retrieve_blocks(q, anchor, block_table, n_ctx, block_len, n_kv_heads, retrieval_type,
                    init, pick, local, anchor_type):
    dq, da, dbt = _up(q, anchor, block_table)
    sel, cnt = _sp.retrieve_blocks(dq, da, dbt, n_ctx, block_len, n_kv_heads,
                                   RetrievalType(retrieval_type), init, pick, local,
                                   AnchorType(anchor_type))
    return _dev.to_host(sel), _dev.to_host(cnt)
