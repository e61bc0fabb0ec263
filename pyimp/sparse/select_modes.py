"""Block selection without anchors: low-rank and LSH scoring, and predefined patterns.

Each mode scores the candidate blocks of a decode query (the blocks
``init..F-recent-1`` of :mod:`pyimp.sparse.retrieval`) and hands the scores to the same
selection as the anchors (sinks, the ``pick`` best, the recent blocks and the partial
tail), so every mode attends the query's own token and the same block budget.

- ``lowrank`` (Loki): per kv head, a basis of the top ``rank`` principal directions of
  the keys (eigenvectors of ``K^T K`` over the keys cached when the prefill ends; not
  centred, so projected dot products approximate ``q . k``). Keys are projected once and
  kept per slot (float32 ``[slots][Hkv][rank]``); a token's score is ``(P^T q_h) .
  (P^T k)`` summed over the set's query heads, a block's the largest of its tokens'.
  With ``rank == head_dim`` the scores are the exact ``q . k`` (up to float32 rounding).
- ``lsh`` (SimHash, MagicPIG-style): ``tables`` tables of ``bits`` random hyperplanes
  per layer; keys, centred on the prompt's mean key, and queries are hashed to one
  ``bits``-bit code per table (kept per slot, uint32 ``[slots][Hkv][tables]``). A token
  is a candidate for a query head when their codes agree in at least ``min_hits``
  tables; a block's score is its candidate tokens counted over the set's heads (ties:
  the larger total of agreeing tables).
- ``sink_window``: no candidate is picked (sinks + recent blocks + tail: StreamingLLM
  as a block mask).
- ``strided``: the candidates ``b`` with ``(F - 1 - b) % stride == 0``.

Keys are taken from the cache (dequantized for quantized KV) as slots fill; a layer
compacted by an eviction policy is projected / hashed again from scratch.
"""
from __future__ import annotations

import numpy as np

from pyimp.choices import SELECT_MODES as MODES  # noqa: F401 (the modes, under their name here)


def lowrank_basis(keys: np.ndarray, rank: int) -> np.ndarray:
    """float32 [Hkv, D, rank]: per kv head the top ``rank`` eigenvectors of K^T K (keys
    float32 [Hkv, n, D]), largest eigenvalue first."""
    Hkv, _, D = keys.shape
    out = np.empty((Hkv, D, rank), np.float32)
    for h in range(Hkv):
        k = keys[h].astype(np.float64)
        _, v = np.linalg.eigh(k.T @ k)
        out[h] = v[:, ::-1][:, :rank]
    return out


def lowrank_token_scores(q: np.ndarray, basis: np.ndarray, proj: np.ndarray,
                         nsets: int) -> np.ndarray:
    """float32 [n, nsets]: per token (proj float32 [n, Hkv, rank]) the approximate q.k
    summed over each set's query heads (q float32 [Hq, D])."""
    Hq = q.shape[0]
    Hkv = basis.shape[0]
    G = Hq // Hkv
    qr = np.einsum("hd,hdr->hr", q, np.repeat(basis, G, axis=0))       # [Hq, rank]
    s = np.einsum("nhr,hr->nh", np.repeat(proj, G, axis=1), qr)         # [n, Hq]
    return s.reshape(s.shape[0], nsets, Hq // nsets).sum(axis=2, dtype=np.float32)


def lsh_planes(seed: int, tables: int, bits: int, head_dim: int) -> np.ndarray:
    """float32 [tables, bits, D] Gaussian hyperplanes (a fixed seed per layer)."""
    return np.random.default_rng(seed).standard_normal((tables, bits, head_dim)).astype(np.float32)


def lsh_codes(x: np.ndarray, planes: np.ndarray) -> np.ndarray:
    """uint32 [..., tables]: the sign bits of x float32 [..., D] against each table's planes."""
    bits = np.einsum("...d,tbd->...tb", x, planes) >= 0
    weights = (np.uint32(1) << np.arange(planes.shape[1], dtype=np.uint32))
    return (bits.astype(np.uint32) * weights).sum(axis=-1, dtype=np.uint32)


def lsh_token_scores(q_codes: np.ndarray, codes: np.ndarray, nsets: int,
                     min_hits: int) -> np.ndarray:
    """float64 [n, nsets]: per token, candidates counted over each set's heads plus agreeing
    tables as a fraction (a tie-break below 1). q_codes uint32 [Hq, tables], codes uint32
    [n, Hkv, tables]."""
    Hq, T = q_codes.shape
    Hkv = codes.shape[1]
    G = Hq // Hkv
    hits = (np.repeat(codes, G, axis=1) == q_codes[None]).sum(axis=2)  # [n, Hq]
    cand = (hits >= min_hits).astype(np.float64)
    s = cand + hits / (T + 1.0) / Hq
    return s.reshape(s.shape[0], nsets, Hq // nsets).sum(axis=2)


def block_max(token_scores: np.ndarray, lb_start: int, lb_end: int, block_len: int,
              n_ctx: int) -> np.ndarray:
    """float32 [lb_end - lb_start, nsets]: the largest token score of each logical block of
    the range (tokens past n_ctx ignored); token_scores [>= n_ctx, nsets] indexed by slot."""
    nsets = token_scores.shape[1]
    C = max(lb_end - lb_start, 0)
    out = np.full((C, nsets), -np.inf, np.float32)
    if C == 0:
        return out
    s0, s1 = lb_start * block_len, min(lb_end * block_len, n_ctx)
    t = np.full((C * block_len, nsets), -np.inf, np.float64)
    t[:s1 - s0] = token_scores[s0:s1]
    return t.reshape(C, block_len, nsets).max(axis=1).astype(np.float32)


def pattern_scores(mode: str, lb_start: int, lb_end: int, F: int, stride: int,
                   nsets: int) -> tuple[np.ndarray, int]:
    """(scores float32 [C, nsets], blocks to pick) of a predefined pattern: strided marks the
    candidates with (F - 1 - b) % stride == 0 (all picked); sink_window picks none."""
    C = max(lb_end - lb_start, 0)
    if mode == "sink_window":
        return np.zeros((C, nsets), np.float32), 0
    b = np.arange(lb_start, lb_end)
    on = (F - 1 - b) % stride == 0
    return np.repeat(on.astype(np.float32)[:, None], nsets, axis=1), int(on.sum())


class LayerKeys:
    """Per-layer slot-indexed key summaries of a mode (projections or codes), extended as
    slots fill and rebuilt after a compaction."""

    def __init__(self, mode: str, rank: int, tables: int, bits: int, seed: int):
        self.mode, self.rank, self.tables, self.bits, self.seed = mode, rank, tables, bits, seed
        self.basis = None        # lowrank: [Hkv, D, r]
        self.center = None       # lsh: [Hkv, D]
        self.planes = None       # lsh: [tables, bits, D]
        self.data = None         # [slots, Hkv, r] float32 or [slots, Hkv, tables] uint32
        self.n = 0               # slots summarized

    def build(self, keys: np.ndarray) -> None:
        """Fit on the keys float32 [Hkv, n, D] cached when a prefill ends and summarize them."""
        D = keys.shape[2]
        if self.mode == "lowrank":
            self.basis = lowrank_basis(keys, min(self.rank or max(D // 4, 1), D))
        else:
            self.center = keys.mean(axis=1).astype(np.float32)
            self.planes = lsh_planes(self.seed, self.tables, self.bits, D)
        self.data = None
        self.n = 0
        self.extend(keys, 0)

    def _summarize(self, keys: np.ndarray) -> np.ndarray:
        """[Hkv, m, D] -> [m, Hkv, ...] summaries."""
        if self.mode == "lowrank":
            return np.einsum("hmd,hdr->mhr", keys, self.basis).astype(np.float32)
        return lsh_codes((keys - self.center[:, None, :]).transpose(1, 0, 2), self.planes)

    def extend(self, keys: np.ndarray, s0: int) -> None:
        """Summaries of slots s0.. from their keys [Hkv, m, D] (s0 <= self.n)."""
        new = self._summarize(keys)
        old = self.data[:s0] if self.data is not None else new[:0]
        self.data = np.concatenate([old, new])
        self.n = self.data.shape[0]

    def token_scores(self, q: np.ndarray, nsets: int, min_hits: int) -> np.ndarray:
        if self.mode == "lowrank":
            return lowrank_token_scores(q, self.basis, self.data, nsets)
        Hkv = self.center.shape[0]
        G = q.shape[0] // Hkv
        qc = lsh_codes(q - np.repeat(self.center, G, axis=0), self.planes)
        return lsh_token_scores(qc, self.data, nsets, min_hits)
