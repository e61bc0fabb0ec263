"""The NumPy references, under the names and argument order a backend implements.

Each function here is the interface of one operation (see :mod:`pyimp.testing` for the
conventions every backend follows) and its reference result. They are thin adaptors over
the references pyimp's own kernels are tested against (``*_ref`` beside each kernel, and
the dequantization that is bit-exact to ``gguf.quants``): one source of truth for pyimp's
tests and for other backends.

Arrays: float32 unless stated; "fp16" arrays are float16 (or their uint16 views, when the
backend module sets ``FP16 = "uint16"``). Cache layouts (docs/kvcache.md section 2), one layer:

- ``k_cache`` fp16/float32 ``[Hkv][NB][B*D]``: row t of physical block b is the key of the
  token in slot t of that block;
- ``v_cache`` fp16/float32 ``[Hkv][NB][D*B]``: transposed, channel d of slot t at ``d*B + t``;
- ``block_table`` int32 ``[NB_logical]``: logical block -> physical block; position p lives
  in row ``p % B`` of physical block ``block_table[p // B]``;
- ``importance`` fp16 ``[NB][B][Hq]``; ``anchor`` fp16 ``[NB][A][Hq][D]``.

Query head h reads kv head ``h // G`` (``G = Hq // Hkv``; heads ordered ``kv_head*G + g``).
"""
from __future__ import annotations

import numpy as np

from loaders import quants_k, quants_legacy
from loaders.ggml_types import QT
from pyimp.attention.attend import attention_decode_ref, attention_prefill_ref, sparse_attention_decode_ref
from pyimp.attention.importance import importance_update_blocks_ref, importance_update_ref
from pyimp.sparse.anchors import AnchorType
from pyimp.sparse.anchors import compute_anchors as _compute_anchors
from pyimp.sparse.retrieval import RetrievalType, block_scores_ref, select_blocks_ref
from pyimp.sparse.retrieval import retrieve_blocks as _retrieve

# the names a backend may export (the interface), in the order the suite checks them
NAMES = ("dequantize", "matvec", "attention_decode", "attention_prefill",
         "sparse_attention_decode", "importance_update", "compute_anchors", "block_scores",
         "select_blocks", "retrieve_blocks")

K_QUANTS = (QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K)


def dequantize(qtype: str, raw: np.ndarray, n: int) -> np.ndarray:
    """Weights of ggml type ``qtype`` (its name: "Q4_K", "F16", ...) stored as
    uint8 ``[rows, row_bytes]`` -> float32 ``[rows, n]``, bit-exact to ``gguf.quants``."""
    qt = QT[qtype]
    mod = quants_k if qt in K_QUANTS else quants_legacy
    return mod.dequantize_reference(qt, raw).reshape(raw.shape[0], n).astype(np.float32)


def matvec(qtype: str, raw: np.ndarray, n: int, x: np.ndarray) -> np.ndarray:
    """``W @ x`` for the weights of :func:`dequantize` and x float32 ``[n]`` -> float32
    ``[rows]`` (the reference sums in float64; backends sum in float32)."""
    return (dequantize(qtype, raw, n).astype(np.float64) @ x.astype(np.float64)).astype(np.float32)


def attention_decode(q, k_cache, v_cache, block_table, n_ctx: int, scale: float, window: int,
                     out) -> np.ndarray:
    """One query q ``[Hq, D]`` at position n_ctx - 1 over positions 0..n_ctx-1 (causal, keys
    with ``n_ctx - 1 - p < window`` when window > 0); softmax of ``scale * q.k``, max-stabilized.
    Writes out ``[Hq, D]``; returns the log-sum-exp ``[Hq]``."""
    return attention_decode_ref(q, k_cache, v_cache, block_table, n_ctx, scale, window, out)


def attention_prefill(q, k_cache, v_cache, block_table, pos0: int, scale: float, window: int,
                      out, importance=None, obs_start: int = 0) -> np.ndarray:
    """Prompt rows q ``[T, Hq, D]`` at positions pos0..pos0+T-1 (their K/V already cached) over
    the cache, causal and windowed as decode. Writes out ``[T, Hq, D]``; returns the lse
    ``[T, Hq]``. ``importance`` (fp16, or None) gains, per key and query head, the summed
    probabilities of the rows at positions >= ``obs_start`` (see :func:`importance_update`)."""
    return attention_prefill_ref(q, k_cache, v_cache, block_table, pos0, scale, window, out,
                                 importance, obs_start)


def sparse_attention_decode(q, k_cache, v_cache, block_table, n_ctx: int, scale: float,
                            window: int, sel, cnt, out, importance=None) -> np.ndarray:
    """Decode attention over selected blocks only: ``sel`` int32 ``[nsets, K]`` logical block
    ids (-1 padded), ``cnt`` int32 ``[nsets]``; query head h uses set ``h // (Hq // nsets)``.
    Masks as :func:`attention_decode`. Writes out, returns the lse over the attended tokens;
    ``importance`` gains this step's probabilities on the attended tokens only."""
    probs = None if importance is None else np.empty((q.shape[0], sel.shape[1],
                                                      k_cache.shape[2] // q.shape[1]), np.float32)
    lse = sparse_attention_decode_ref(q, k_cache, v_cache, block_table, n_ctx, scale, window,
                                      sel, cnt, out, probs)
    if importance is not None:
        importance_update_blocks_ref(importance, block_table, sel, cnt, probs, n_ctx)
    return lse


def importance_update(importance, block_table, new, pos_lo: int = 0, decay: float = 1.0) -> None:
    """In place, for positions p < n_pos = new.shape[1] (``new`` float32 ``[Hq, n_pos]``)::

        importance[bt[p // B], p % B, h] = fp16(min(fp32(decay) * fp32(old) + new[h, p], 65504))

    rounded to nearest even (one float32 multiply and one add, no FMA; ``decay == 1`` skips the
    multiply and leaves positions below ``pos_lo`` untouched; with decay != 1, entries of new
    below pos_lo count as 0)."""
    importance_update_ref(importance, block_table, new, pos_lo, decay)


def compute_anchors(anchor_type: str, k_cache, blocks, n_valid, anchor, importance=None) -> None:
    """Anchors of the physical ``blocks`` (int64 ``[n]``, distinct) from their first
    ``n_valid[i]`` keys, written in place into ``anchor`` fp16 ``[NB][A][Hq][D]``; the anchor
    type's name: block_mean, block_max, fixed, dynamic, quest, cuboid_mean (formulas and
    fp16 rounding: :mod:`pyimp.sparse.anchors`; every type but dynamic repeats kv head j's
    vector into query-head slots j*G..j*G+G-1). ``importance`` fp16: for dynamic."""
    _compute_anchors(AnchorType(anchor_type), k_cache, blocks, n_valid, anchor, importance,
                     backend="numpy")


def block_scores(q, anchor, block_table, lb_start: int, lb_end: int, n_slots: int,
                 G: int) -> np.ndarray:
    """``s[b - lb_start, h] = sum_d max_{a < n_slots} anchor[bt[b], a, h, d] * q[h, d]`` for
    logical blocks lb_start..lb_end-1: float32 ``[lb_end - lb_start, Hq]``."""
    return block_scores_ref(q, anchor, block_table, lb_start, lb_end, n_slots, G, False)


def select_blocks(scores, n_ctx: int, block_len: int, init: int, pick: int, local: int):
    """Block sets from set scores float32 ``[C, nsets]`` of the candidates init..init+C-1: the
    sinks, the ``pick`` best (ties: the lower block), the last ``local`` full blocks and the
    partial tail (rules: :mod:`pyimp.sparse.retrieval`). Returns (sel int32 ``[nsets, K]``
    ascending, -1 padded, K = init + pick + local + 1; cnt int32 ``[nsets]``)."""
    return select_blocks_ref(scores, n_ctx, block_len, init, pick, local)


def retrieve_blocks(q, anchor, block_table, n_ctx: int, block_len: int, n_kv_heads: int,
                    retrieval_type: str, init: int, pick: int, local: int, anchor_type: str):
    """Score (set scores summed over each set's heads: layer / kvhead / qhead) and select, as
    :func:`block_scores` then :func:`select_blocks`. Returns (sel, cnt)."""
    return _retrieve(q, anchor, block_table, n_ctx, block_len, n_kv_heads,
                     RetrievalType(retrieval_type), init, pick, local, AnchorType(anchor_type),
                     backend="numpy")
