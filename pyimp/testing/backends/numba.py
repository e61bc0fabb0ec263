"""pyimp's CPU kernels (Numba) under the conformance interface.

Each function is a call of the dispatcher the engine uses, with ``backend="numba"``; the
arguments arrive as the interface gives them (fp16 as float16: the dispatchers make their
own uint16 views). Anchors: the compiled path of :func:`pyimp.sparse.anchors.compute_anchors`
for every type but DYNAMIC, whose anchors stay in NumPy (the reference's code, so that check
passes by construction here and is meaningful for the other backends).
"""
from __future__ import annotations

import numpy as np

from loaders import quants
from loaders.ggml_types import QT
from pyimp.attention import attend as _att
from pyimp.attention import importance as _imp
from pyimp.sparse import anchors as _anc
from pyimp.sparse import retrieval as _ret

FP16 = "float16"


def dequantize(qtype, raw, n):
    return quants.dequantize(raw, int(QT[qtype]), n)


def matvec(qtype, raw, n, x):
    return quants.matvec(raw, int(QT[qtype]), n, x)


def attention_decode(q, k_cache, v_cache, block_table, n_ctx, scale, window, out):
    return _att.attention_decode(q, k_cache, v_cache, block_table, n_ctx, scale, window, out)


def attention_prefill(q, k_cache, v_cache, block_table, pos0, scale, window, out,
                      importance=None, obs_start=0):
    return _att.attention_prefill(q, k_cache, v_cache, block_table, pos0, scale, window, out,
                                  importance, obs_start)


def sparse_attention_decode(q, k_cache, v_cache, block_table, n_ctx, scale, window, sel, cnt,
                            out, importance=None):
    return _att.sparse_attention_decode(q, k_cache, v_cache, block_table, n_ctx, scale, window,
                                        sel, cnt, out, importance)[0]


def importance_update(importance, block_table, new, pos_lo=0, decay=1.0):
    _imp.importance_update(importance, block_table, new, pos_lo, decay)


def compute_anchors(anchor_type, k_cache, blocks, n_valid, anchor, importance=None):
    _anc.compute_anchors(_anc.AnchorType(anchor_type), k_cache, blocks, n_valid, anchor,
                         importance)


def block_scores(q, anchor, block_table, lb_start, lb_end, n_slots, G):
    return _ret.block_scores(q, anchor, block_table, lb_start, lb_end, n_slots, G, False)


def select_blocks(scores, n_ctx, block_len, init, pick, local):
    return _ret.select_blocks(np.ascontiguousarray(scores), n_ctx, block_len, init, pick, local)


def retrieve_blocks(q, anchor, block_table, n_ctx, block_len, n_kv_heads, retrieval_type,
                    init, pick, local, anchor_type):
    return _ret.retrieve_blocks(q, anchor, block_table, n_ctx, block_len, n_kv_heads,
                                _ret.RetrievalType(retrieval_type), init, pick, local,
                                _anc.AnchorType(anchor_type))
