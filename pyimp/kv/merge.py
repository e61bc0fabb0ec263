"""Merging near-duplicate cached tokens, found by SimHash (``--kv-merge``).

A layer's cached keys are hashed per kv head with SimHash: the signs of ``bits`` random
projections (Gaussian planes, seeded, one set per kv head). Tokens whose signatures agree in
every kv head fall in one bucket; inside a bucket, in slot order, a token joins the first
*representative* whose key has cosine similarity >= ``threshold`` with its own in every kv
head, else it becomes a representative itself. (The hash only proposes candidates; the
cosine test decides. A layer's slots are shared by its kv heads, so a token merges only
where it is a near-duplicate in all of them; on Gemma 3, with one kv head, that is the
per-head rule.)

Each representative r absorbs its members S (r included):

- K and V become the importance-weighted averages ``sum_j w_j x_j / sum_j w_j`` with
  ``w_j = importance_j + eps * c_j`` (``importance_`` summed over the layer's query heads,
  ``c_j`` the tokens slot j already stands for; ``eps`` keeps tokens nobody attended yet
  averaged by count), computed in float64 and stored in the cache's type;
- its multiplicity becomes ``c = sum_j c_j`` and the cache's ``lmul`` (per physical slot)
  ``log(c)``: every attention kernel adds it to the slot's score, so the slot carries the
  softmax mass of c tokens. For identical keys and values that is exact: the merged cache
  gives the attention of the unmerged one (property-tested);
- its ``importance_`` becomes the sum of its members' (clamped to the fp16 maximum), its
  position stays its own (keys keep the RoPE they were cached with).

Absorbed slots are dropped by :meth:`pyimp.kv.cache.KVCache.compact` (blocks left empty go
back to the pool). Never merged: the sinks (the first ``keep`` positions) and the newest
block's tokens (the one being filled, or the last full one when the count is a multiple of
the block length: it holds the current token). A quantized cache drops a multiple of the
block length and keeps its float tail, so there only the most similar merges are applied,
a multiple of B of them.

When: at the end of every prefill and each time a decode step fills a block, before the
eviction policy (``--kv-policy``) picks what to keep from what is left, so merging frees
room under a budget, or memory by itself under ``full``. CPU path only.

:func:`merge_plan` is the decision, plain NumPy over one layer's keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FP16_MAX = 65504.0
EPS = 1e-6      # weight per represented token added to importance (see the module docstring)


@dataclass(frozen=True)
class MergeOptions:
    """Options of the merge step (the CLI flags ``--kv-merge``, ``--kv-merge-bits``)."""

    threshold: float = 0.0     # cosine similarity to merge at; 0 = no merging
    bits: int = 12             # SimHash bits per kv head
    seed: int = 0              # seed of the random planes

    @property
    def enabled(self) -> bool:
        return self.threshold > 0.0

    def validate(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"merge threshold (cosine similarity) must be in (0, 1], or 0 for "
                             f"no merging, got {self.threshold}")
        if not 1 <= self.bits <= 62:
            raise ValueError(f"SimHash bits must be in 1..62, got {self.bits}")


def planes(n_head_kv: int, head_dim: int, bits: int, seed: int = 0) -> np.ndarray:
    """The SimHash projections: float32 [Hkv, bits, D], standard normal, seeded."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n_head_kv, bits, head_dim)).astype(np.float32)


def signatures(keys: np.ndarray, proj: np.ndarray) -> np.ndarray:
    """SimHash codes of keys float32 [Hkv, n, D]: int64 [n, Hkv], bit b of head h's code set
    where the key's projection on plane b is positive."""
    bits = proj.shape[1]
    pos = np.einsum("hnd,hbd->nhb", keys.astype(np.float32), proj) > 0
    return (pos.astype(np.int64) << np.arange(bits, dtype=np.int64)).sum(axis=-1)


def merge_plan(keys: np.ndarray, codes: np.ndarray, candidate: np.ndarray,
               threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """Which slot each token of a layer merges into.

    keys float32 [Hkv, n, D]; codes int64 [n, Hkv] (:func:`signatures`); candidate bool [n]
    (False: the slot is never merged, neither way). Returns (into int64 [n]: the
    representative slot of each absorbed token, -1 for the others; sim float64 [n]: its
    smallest cosine similarity to the representative over kv heads, -inf where not absorbed).
    """
    n = keys.shape[1]
    into = np.full(n, -1, np.int64)
    sim = np.full(n, -np.inf)
    idx = np.flatnonzero(candidate)
    if idx.size < 2:
        return into, sim
    k = keys[:, idx].astype(np.float64)
    k /= np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-30)
    _, bucket = np.unique(codes[idx], axis=0, return_inverse=True)
    bucket = bucket.reshape(-1)
    order = np.argsort(bucket, kind="stable")              # by bucket, slot order inside
    starts = np.flatnonzero(np.r_[True, bucket[order][1:] != bucket[order][:-1]])
    ends = np.r_[starts[1:], order.size]
    for a, b in zip(starts, ends):
        if b - a < 2:
            continue
        reps: list[int] = []
        for j in order[a:b]:
            for r in reps:
                c = float(np.min(np.einsum("hd,hd->h", k[:, j], k[:, r])))
                if c >= threshold:
                    into[idx[j]] = idx[r]
                    sim[idx[j]] = c
                    break
            else:
                reps.append(j)
    return into, sim


def limit_to_multiple(into: np.ndarray, sim: np.ndarray, block_len: int) -> np.ndarray:
    """Keep only the most similar merges, a multiple of ``block_len`` of them (a quantized
    cache drops whole multiples of B); returns the new ``into``."""
    absorbed = np.flatnonzero(into >= 0)
    m = absorbed.size // block_len * block_len
    out = np.full_like(into, -1)
    if m:
        best = absorbed[np.argsort(-sim[absorbed], kind="stable")[:m]]
        out[best] = into[best]
    return out


def merged_rows(into: np.ndarray, keys: np.ndarray, values: np.ndarray, weight: np.ndarray,
                counts: np.ndarray):
    """The representatives' merged rows. keys, values float32 [Hkv, n, D]; weight float64 [n]
    (importance summed over query heads); counts float64 [n] (tokens each slot stands for).
    Returns (reps int64 [r], k float32 [r, Hkv, D], v float32 [r, Hkv, D], counts float64 [r],
    member lists)."""
    reps = np.unique(into[into >= 0])
    members = [np.r_[r, np.flatnonzero(into == r)] for r in reps]
    kk = np.empty((reps.size, keys.shape[0], keys.shape[2]), np.float32)
    vv = np.empty_like(kk)
    cc = np.empty(reps.size)
    for i, mem in enumerate(members):
        w = weight[mem] + EPS * counts[mem]
        w = w / w.sum()
        kk[i] = np.einsum("j,hjd->hd", w, keys[:, mem].astype(np.float64)).astype(np.float32)
        vv[i] = np.einsum("j,hjd->hd", w, values[:, mem].astype(np.float64)).astype(np.float32)
        cc[i] = counts[mem].sum()
    return reps, kk, vv, cc, members


class KVMerger:
    """Applies :class:`MergeOptions` to an engine's cache (see the module docstring)."""

    def __init__(self, opts: MergeOptions, cfg, cache, sparse, keep: int):
        opts.validate()
        self.opts, self.cfg, self.cache, self.sparse, self.keep = opts, cfg, cache, sparse, keep
        cache.enable_merging()
        self.proj = planes(cache.n_head_kv, cache.head_dim, opts.bits, opts.seed)
        self.merged = 0             # tokens absorbed so far

    def due(self, prefill_done: bool) -> bool:
        """Merge after a prefill and when a decode step completed a block."""
        return prefill_done or int(self.cache.cache_seqlens[0]) % self.cache.block_len == 0

    def merge_layer(self, il: int) -> int:
        """Merge layer il's near-duplicates; returns how many tokens were absorbed."""
        c, B = self.cache, self.cache.block_len
        n = c.slot_count(il)
        if n < 2:
            return 0
        pos = c.positions(il)
        keys, values = c.gather(il)
        newest = n % B or B             # the block holding the current token (a float tail)
        candidate = (pos >= self.keep) & (np.arange(n) < n - newest)
        into, sim = merge_plan(keys, signatures(keys, self.proj), candidate, self.opts.threshold)
        if c.quantized:
            into = limit_to_multiple(into, sim, B)
        if not (into >= 0).any():
            return 0
        blocks, rows = c.slots(0, n, layer=il)
        lm = c.lmul[il]
        counts = np.exp(lm[blocks, rows].astype(np.float64))
        imp = None
        if self.sparse is not None:
            imp = self.sparse.importance_[il]
            weight = imp[blocks, rows].astype(np.float64).sum(-1)
        else:
            weight = np.zeros(n)
        reps, kk, vv, cc, members = merged_rows(into, keys, values, weight, counts)
        c.write_slots(il, reps, kk, vv)
        lm[blocks[reps], rows[reps]] = np.log(cc).astype(np.float32)
        if imp is not None:
            for r, mem in zip(reps, members):
                tot = imp[blocks[mem], rows[mem]].astype(np.float64).sum(0)
                imp[blocks[r], rows[r]] = np.minimum(tot, FP16_MAX).astype(np.float16)
        keep = np.flatnonzero(into < 0)
        old = c.table(il)[:-(-n // B)].copy()
        c.compact(il, keep, extra=() if imp is None else (imp,))
        if self.sparse is not None:
            self.sparse.compacted(il, old)
        absorbed = n - keep.size
        self.merged += absorbed
        return absorbed
