"""KV eviction policies: which cached tokens each layer keeps (``--kv-policy``).

After every forward the engine asks :class:`KVPolicy` which slots each layer keeps and
compacts the layer (:meth:`pyimp.kv.cache.KVCache.compact`: the kept slots move to the
front in order, emptied blocks return to the layer's pool, keys keep the RoPE of their
positions, ``importance_`` moves with its tokens).

Policies (``budget`` = ``--kv-budget`` tokens per layer, ``keep`` = ``--keep`` sink
tokens, the first positions of the sequence, as llama.cpp's n_keep):

- ``full``: nothing is dropped from global-attention layers (the default).
- ``streaming`` (StreamingLLM): the sinks and the most recent tokens.
- ``h2o`` (heavy hitters): the sinks, the ``recent`` most recent tokens and, from the
  rest, the tokens with the most accumulated attention: ``importance_`` summed over the
  layer's query heads (every prompt row and every decode step adds to it). Re-decided as
  decode goes on.
- ``snapkv``: once, at the end of each prefill: prompt tokens scored by the attention of
  the last ``obs_window`` prompt rows (the observation window that feeds
  ``importance_``), summed over query heads, 1-D average pooled (kernel ``pool``); the
  window itself, the sinks and the top of the rest are kept. Decode tokens are not
  evicted until the next prefill.
- ``pyramidkv``: snapkv with a budget per layer shrinking linearly with depth (PyramidKV:
  ``(budget - W) / 20`` above the window on the last layer, ``2 (budget - W)`` minus that
  on the first; the mean over layers is ``budget``).

``obs_weight`` λ > 0 (``--kv-obs-weight``) gives h2o SnapKV's observation window beside its
accumulated attention: a prefill's last ``obs_window`` rows accumulate into a buffer of
their own (:meth:`KVPolicy.observe_start`, which the engine calls before it runs those rows
as a chunk of their own), and h2o ranks a layer's tokens by ``acc / sum(acc) + λ obs /
sum(obs)``. Accumulated attention over thousands of rows drowns what the prompt's last
rows ask for (a passkey question attends to the key; the filler before it never did); the
window alone misses what the whole text keeps returning to. The window's buffer moves with
compaction and is replaced at the next prefill's end; decode rows add to ``acc`` only.

``depth_ratio`` R > 1 (``--kv-depth-ratio``) gives streaming, h2o and snapkv a budget
shrinking linearly with depth over the layers they actually evict from (the global-attention
layers; every layer with ``swa_full``): the first of them gets ``2R / (1 + R)`` of
``budget``, the last ``2 / (1 + R)``, their mean stays ``budget``, and a sliding-window
layer keeps ``budget`` (in practice its window). Errors in an early layer's attention
reach every later layer, so early layers are worth more of the memory (PyramidKV's
observation, applied where the memory is: on Gemma 3 the 3 global layers of 18 hold 62 % of
a 4k window-only cache, so PyramidKV's schedule over all layers would give most of the
budget to sliding-window layers that cannot use it).

Selection is per layer, over the layer's tokens, with the scores of all its query heads
summed: a layer keeps one set of tokens for all its kv heads (Gemma 3 has one kv head, so
there the selection is SnapKV's and H2O's per-head one).

Rules every policy follows (property-tested):

- **Sliding-window layers keep only their window** under every policy, ``full``
  included (as llama.cpp's iSWA cache): tokens no later query can see are dropped. The
  policy then applies to what is left. ``swa_full`` (``--swa-full``, llama.cpp's flag)
  keeps them instead: a prompt cache can then reuse any prefix, where a trimmed layer
  only allows prefixes whose window it still holds.
- **Budgets in whole blocks.** A layer is compacted when it holds more than ``budget``
  tokens, down to ``budget + (excess mod B)``: whole blocks leave at a time (a quantized
  cache keeps its float tail block as it is), so it holds at most ``budget + B - 1``
  tokens after a forward, and a decode step compacts once every B steps.
- The sinks (``keep`` first positions, while held), the newest ``n mod B`` tokens (the
  partial block, which holds the current token) and, for h2o and streaming, the
  ``recent`` window are always kept.
- ``budget >= n`` keeps everything: full attention, exactly.

``neighbours`` R > 0 (``--kv-neighbours``) makes h2o, snapkv and pyramidkv rank a token by the
largest score among the held tokens within R positions of it (max pooling; ties by its own
score): thresholding that ranking keeps every held token within R of a token whose own score
passes, so a kept token keeps its neighbours. A multi-token unit that the query attends to at one token (a number's first
digit after "The pass key is") otherwise loses the tokens that continue it, and a copy
of it stops there.

``follow`` F > 0 (``--kv-follow``) makes them rank a token by the largest score among itself and the
held tokens up to F positions before it: a kept token keeps the F tokens that follow it. A
question attends to a needle's key ("... for named-executing is:"), not to the value after
it, which the answer copies one token at a time during decoding; ranking the value by its
own score (or by its neighbours' within a few positions) drops most of its digits. With
``neighbours`` too, a token looks back max(R, F) positions and ahead R.

The decision functions (``*_keep``) are plain NumPy over a layer's positions and scores.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..choices import KV_POLICIES as POLICIES

PYRAMID_BETA = 20          # PyramidKV's ratio of the largest to the smallest layer budget


@dataclass(frozen=True)
class PolicyOptions:
    """Options of the eviction policy (the CLI flags of the same names)."""

    policy: str = "full"      # full, streaming, h2o, snapkv, pyramidkv
    budget: int = 0           # tokens per layer (--kv-budget); needed by every policy but full
    keep: int = 4             # sink tokens: the first positions (--keep, llama.cpp's n_keep)
    recent: int = 0           # h2o / streaming recent window; 0 = half the budget
    obs_window: int = 32      # snapkv / pyramidkv observation window (SnapKV's 32)
    pool: int = 5             # snapkv / pyramidkv 1-D average pooling kernel (odd)
    depth_ratio: float = 1.0  # first / last evicting layer's budget (1: uniform)
    obs_weight: float = 0.0   # h2o: weight of the observation window's attention (0: off)
    neighbours: int = 0       # h2o / snapkv / pyramidkv: rank by the max score within R positions
    follow: int = 0           # h2o / snapkv / pyramidkv: rank by the max score of the F positions
                              # before a token and its own (a kept token keeps what follows it)

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"kv policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        for name in ("budget", "keep", "recent", "obs_window"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.neighbours < 0:
            raise ValueError(f"neighbours must be >= 0, got {self.neighbours}")
        if self.neighbours and self.policy not in ("h2o", "snapkv", "pyramidkv"):
            raise ValueError(f"neighbour keeping ranks tokens by their scores: it applies to h2o, "
                             f"snapkv and pyramidkv, not {self.policy}")
        if self.follow < 0:
            raise ValueError(f"follow must be >= 0, got {self.follow}")
        if self.follow and self.policy not in ("h2o", "snapkv", "pyramidkv"):
            raise ValueError(f"keeping what follows a kept token ranks tokens by their scores: it "
                             f"applies to h2o, snapkv and pyramidkv, not {self.policy}")
        if self.pool < 1 or self.pool % 2 == 0:
            raise ValueError(f"pooling kernel must be odd and >= 1, got {self.pool}")
        if not 1.0 <= self.depth_ratio < float("inf"):
            raise ValueError(f"depth ratio must be >= 1 (1: the same budget in every layer), "
                             f"got {self.depth_ratio}")
        if not 0.0 <= self.obs_weight < float("inf"):
            raise ValueError(f"observation weight must be a finite number >= 0, got "
                             f"{self.obs_weight}")
        if self.obs_weight and self.obs_window < 1:
            raise ValueError("the observation weight needs an observation window (obs_window >= 1)")
        if self.obs_weight and self.policy != "h2o":
            raise ValueError(f"the observation weight applies to h2o (snapkv and pyramidkv rank "
                             f"by the window alone), not {self.policy}")
        if self.depth_ratio != 1.0 and self.policy == "pyramidkv":
            raise ValueError("pyramidkv has its own depth schedule: the depth ratio applies to "
                             "streaming, h2o and snapkv")
        if self.policy != "full":
            if self.budget <= 0:
                raise ValueError(f"kv policy {self.policy} needs a budget (--kv-budget N "
                                 f"tokens per layer)")
            if self.keep + self.window >= self.budget:
                raise ValueError(f"kv budget {self.budget} must exceed the sink tokens "
                                 f"({self.keep}) plus the recent window ({self.window})")

    @property
    def evicts(self) -> bool:
        return self.policy != "full"

    @property
    def window(self) -> int:
        """Recent tokens always kept (snapkv: the observation window) under ``budget``."""
        return self.window_for(self.budget)

    def window_for(self, budget: int) -> int:
        """Recent tokens always kept in a layer whose budget is ``budget`` (h2o / streaming
        without ``recent``: half of it)."""
        if self.policy in ("snapkv", "pyramidkv"):
            return self.obs_window
        if self.policy == "full":
            return 0
        return self.recent or budget // 2

    def short_layer(self, budgets: np.ndarray, block_len: int) -> int:
        """A layer whose budget does not exceed the sinks plus the larger of its recent window
        and a block (the most short of them), or -1 when every budget is large enough."""
        if not self.evicts:
            return -1
        need = np.array([self.keep + max(self.window_for(int(b)), block_len) for b in budgets])
        il = int(np.argmin(np.asarray(budgets) - need))
        return il if budgets[il] <= need[il] else -1

    def min_budget(self, block_len: int) -> int:
        """The smallest ``budget`` these options accept in every layer (the depth profiles'
        last layer included; their end points do not depend on the layer count)."""
        import dataclasses

        def accepted(b: int) -> bool:
            o = dataclasses.replace(self, budget=b)
            try:
                o.validate()
            except ValueError:
                return False
            return o.short_layer(o.layer_budgets(2), block_len) < 0

        b = self.keep + 1
        while not accepted(b):
            b += 1
        return b

    def layer_budgets(self, n_layer: int, profiled=None) -> np.ndarray:
        """Tokens each layer keeps, int64 [n_layer]: pyramidkv shrinks them with depth over
        every layer; ``depth_ratio`` over the layers where ``profiled`` (bool [n_layer], the
        layers the policy evicts from; default all) is true."""
        if self.policy != "pyramidkv" or n_layer == 1:
            out = np.full(n_layer, self.budget, np.int64)
            idx = np.flatnonzero(np.ones(n_layer, bool) if profiled is None
                                 else np.asarray(profiled, bool))
            if self.depth_ratio != 1.0 and idx.size > 1:
                r = self.depth_ratio
                hi, lo = 2 * r / (1 + r), 2 / (1 + r)
                w = hi - (hi - lo) * np.arange(idx.size) / (idx.size - 1)
                out[idx] = np.round(self.budget * w).astype(np.int64)
            return out
        c = self.budget - self.obs_window
        lo = c / PYRAMID_BETA
        hi = 2 * c - lo
        steps = hi - (hi - lo) * np.arange(n_layer) / (n_layer - 1)
        return (np.round(steps).astype(np.int64) + self.obs_window).clip(min=self.keep + 1 +
                                                                          self.obs_window)


# --------------------------------------------------------------------------
# decisions (NumPy): slots to keep, increasing
# --------------------------------------------------------------------------


def target_size(n: int, budget: int, block_len: int) -> int:
    """Slots a layer of n keeps under ``budget``: n if within it, else budget + (excess mod B)
    (whole blocks leave)."""
    if n <= budget:
        return n
    return budget + (n - budget) % block_len


def _forced(pos: np.ndarray, keep: int, recent: int, block_len: int) -> np.ndarray:
    """Slots every policy keeps: sinks, the last ``recent`` and the partial block's."""
    n = pos.size
    must = pos < keep
    must[max(0, n - max(recent, n % block_len, 1)):] = True
    return must


def _top_up(must: np.ndarray, score: np.ndarray, m: int,
            tie: np.ndarray | None = None) -> np.ndarray:
    """``must`` plus the best-scoring others up to m slots (ties: the higher ``tie``, then the
    later slot), increasing."""
    chosen = np.flatnonzero(must)
    free = m - chosen.size
    if free > 0:
        rest = np.flatnonzero(~must)
        keys = (-rest, -score[rest]) if tie is None else (-rest, -tie[rest], -score[rest])
        order = np.lexsort(keys)                           # score desc, tie desc, later slot
        chosen = np.concatenate([chosen, rest[order[:free]]])
    return np.sort(chosen)


def maxpool1d(score: np.ndarray, radius: int, pos: np.ndarray | None = None,
              behind: int | None = None) -> np.ndarray:
    """``out[i]``: the largest ``score[j]`` over the slots j whose position lies from ``behind``
    (default ``radius``) positions before slot i's to ``radius`` after it (``pos``: increasing
    positions of the slots; default the slot indices), float64. Slots of a compacted layer that
    hold distant positions are not each other's neighbours."""
    s = np.asarray(score, np.float64)
    out = s.copy()
    p = np.arange(s.size) if pos is None else np.asarray(pos, np.int64)
    behind = radius if behind is None else behind
    for d in range(1, min(max(radius, behind), s.size - 1) + 1):   # positions increase
        gap = p[d:] - p[:-d]                             # slot k + d's position minus slot k's
        ahead = gap <= radius                            # slot k sees slot k + d
        out[:-d] = np.where(ahead, np.maximum(out[:-d], s[d:]), out[:-d])
        back = gap <= behind                             # slot k + d sees slot k
        out[d:] = np.where(back, np.maximum(out[d:], s[:-d]), out[d:])
    return out


def _ranked_top_up(must: np.ndarray, score: np.ndarray, m: int, neighbours: int,
                   pos: np.ndarray, follow: int = 0) -> np.ndarray:
    """_top_up by ``score``, or with ``neighbours`` R > 0 by its max over the positions within
    R (ties: the slot's own score): the slots ranked above a threshold are those within R of
    a slot whose own score is above it, so a kept token's neighbours are kept with it, as long
    as the budget lasts (the digits after the one a question attends to, a word's other
    pieces). ``follow`` F > 0: the max also looks F positions back, so the F tokens after a
    slot whose own score is above the threshold rank above it too (a key's value)."""
    if neighbours <= 0 and follow <= 0:
        return _top_up(must, score, m)
    return _top_up(must, maxpool1d(score, neighbours, pos, behind=max(neighbours, follow)), m,
                   tie=np.asarray(score, np.float64))


def streaming_keep(pos: np.ndarray, keep: int, m: int, block_len: int) -> np.ndarray:
    """StreamingLLM: the sink slots and the most recent others, m in all."""
    must = _forced(pos, keep, 0, block_len)
    return _top_up(must, np.arange(pos.size, dtype=np.float64), m)


def h2o_keep(pos: np.ndarray, score: np.ndarray, keep: int, recent: int, m: int,
             block_len: int, neighbours: int = 0, follow: int = 0) -> np.ndarray:
    """H2O: sinks, the ``recent`` newest, and the highest accumulated ``score`` of the rest
    (``neighbours`` R: ranked by the score max-pooled over the positions within R; ``follow``
    F: and over the F positions before)."""
    return _ranked_top_up(_forced(pos, keep, recent, block_len), score, m, neighbours, pos,
                          follow)


def pool1d(score: np.ndarray, kernel: int) -> np.ndarray:
    """Average pool over neighbouring slots (edges averaged over the slots that exist)."""
    if kernel <= 1 or score.size == 0:
        return score.astype(np.float64)
    r = kernel // 2
    c = np.concatenate([[0.0], np.cumsum(score, dtype=np.float64)])
    i = np.arange(score.size)
    lo, hi = np.maximum(0, i - r), np.minimum(score.size, i + r + 1)
    return (c[hi] - c[lo]) / (hi - lo)


def snapkv_keep(pos: np.ndarray, score: np.ndarray, keep: int, window: int, pool: int, m: int,
                block_len: int, neighbours: int = 0, follow: int = 0) -> np.ndarray:
    """SnapKV: the last ``window`` slots (the observation window), sinks, and the top of the
    pooled observation-window ``score`` among the rest (``neighbours`` R: that pooled score
    max-pooled over the positions within R; ``follow`` F: and over the F positions before)."""
    return _ranked_top_up(_forced(pos, keep, window, block_len), pool1d(score, pool), m,
                          neighbours, pos, follow)


def window_keep(pos: np.ndarray, next_pos: int, window: int, block_len: int) -> np.ndarray:
    """Sliding-window trim: slots a query at ``next_pos`` or later can still see, rounded
    down to whole leading blocks (the leading whole blocks of stale slots leave)."""
    stale = int(np.searchsorted(pos, next_pos - window + 1))
    return np.arange(stale - stale % block_len, pos.size)


# --------------------------------------------------------------------------
# the engine side
# --------------------------------------------------------------------------


class KVPolicy:
    """Applies :class:`PolicyOptions` to an engine's cache after each forward."""

    def __init__(self, opts: PolicyOptions, cfg, cache, sparse, trim_windows: bool = True,
                 merger=None):
        opts.validate()
        self.opts, self.cfg, self.cache, self.sparse = opts, cfg, cache, sparse
        self.merger = merger             # a pyimp.kv.merge.KVMerger, run between trim and policy
        # trim_windows False (llama.cpp's --swa-full): sliding-window layers keep every token,
        # so any prefix of the cache can be reused
        self.windows = [cfg.sliding_window if cfg.is_swa(il) and trim_windows else 0
                        for il in range(cfg.n_layer)]
        self.budgets = opts.layer_budgets(cfg.n_layer, [w == 0 for w in self.windows])
        self.recent = [opts.window_for(int(b)) for b in self.budgets]
        if opts.policy in ("h2o", "snapkv", "pyramidkv") and sparse is None:
            raise ValueError(f"kv policy {opts.policy} scores tokens by importance_: the engine "
                             f"needs its sparse state (tracking)")
        il = opts.short_layer(self.budgets, cache.block_len)
        if il >= 0:
            raise ValueError(f"kv budget {int(self.budgets[il])} (layer {il}'s) must exceed "
                             f"the sink tokens ({opts.keep}) plus the larger of the recent "
                             f"window ({self.recent[il]}) and the block length "
                             f"({cache.block_len})")
        self.evicted = 0                 # tokens dropped by the policy (not the window trim)
        self.obs = None                  # float16 like importance_: the window's attention
        self._saved = None               # importance_ before the window's rows (while they run)

    @property
    def observes(self) -> bool:
        """Does this policy want a prefill's last ``obs_window`` rows run as a chunk of their own,
        after :meth:`observe_start`?"""
        return self.opts.obs_weight > 0          # validate() ensured obs_window >= 1

    def observe_start(self) -> None:
        """The next rows are a prefill's observation window: set importance_ aside and let
        them accumulate from zero (:meth:`after_forward` at the prefill's end keeps what they
        added as the window's buffer and adds it back)."""
        imp = self.sparse.importance_
        self._saved = imp.astype(np.float32)
        imp[:] = 0

    def cancel_observation(self) -> None:
        """importance_ gets back what was set aside (also when a forward of the window
        failed)."""
        if self._saved is not None:
            imp = self.sparse.importance_
            imp[:] = (self._saved + imp.astype(np.float32)).astype(imp.dtype)
            self._saved = None

    def forget(self) -> None:
        """The sequence was reset: no window buffer, nothing set aside."""
        self.obs = None
        self._saved = None

    def _end_observation(self) -> None:
        """The window's rows are in: keep what they added, give the rest back."""
        self.obs = self.sparse.importance_.copy()
        self.cancel_observation()

    @staticmethod
    def max_slots(opts: PolicyOptions, cfg, n_ctx: int, batch: int, block_len: int) -> int:
        """Slots a layer needs at most: the largest budget plus one prefill chunk and a block
        (n_ctx without a budget, and for snapkv / pyramidkv, which see the whole prompt before
        they evict)."""
        if opts.policy in ("full", "snapkv", "pyramidkv"):
            return n_ctx
        top = int(opts.layer_budgets(cfg.n_layer).max())   # the first profiled layer's
        return min(n_ctx, top + block_len + batch)

    def after_forward(self, n_ctx: int, prefill_done: bool) -> None:
        """Drop what the policy and the sliding windows no longer keep (``n_ctx``: positions
        processed; ``prefill_done``: a prefill just completed)."""
        c, o, B = self.cache, self.opts, self.cache.block_len
        if self._saved is not None and prefill_done:
            self._end_observation()
        merge = self.merger is not None and self.merger.due(prefill_done)
        for il in range(c.n_layer):
            pos = c.positions(il)
            keep = None
            w = self.windows[il]
            if w > 0:
                k = window_keep(pos, n_ctx, w, B)
                if k.size < pos.size:
                    keep = k
            if merge:        # trimmed first (no work on what the window drops), then merged
                if keep is not None:
                    self._compact(il, keep)
                    keep = None
                self.merger.merge_layer(il)
                pos = c.positions(il)
            n_now = pos.size if keep is None else keep.size
            budget = int(self.budgets[il])
            m = target_size(n_now, budget, B)
            decide = o.policy in ("streaming", "h2o") or (o.policy in ("snapkv", "pyramidkv")
                                                         and prefill_done)
            if o.evicts and decide and m < n_now:
                sub = pos if keep is None else pos[keep]
                picked = self._pick(il, sub, keep, m)
                keep = picked if keep is None else keep[picked]
                self.evicted += n_now - m
            if keep is not None:
                self._compact(il, keep)

    def _pick(self, il: int, pos: np.ndarray, sub: np.ndarray | None, m: int) -> np.ndarray:
        o, B = self.opts, self.cache.block_len
        if o.policy == "streaming":
            return streaming_keep(pos, o.keep, m, B)
        score = self._scores(il)
        if sub is not None:
            score = score[sub]
        if o.policy == "h2o":
            return h2o_keep(pos, score, o.keep, self.recent[il], m, B, o.neighbours, o.follow)
        return snapkv_keep(pos, score, o.keep, o.obs_window, o.pool, m, B, o.neighbours,
                           o.follow)

    def _scores(self, il: int) -> np.ndarray:
        """importance_ of each slot of layer il summed over query heads, float64 [slots]."""
        c = self.cache
        blocks, rows = c.slots(0, c.slot_count(il), layer=il)
        acc = self.sparse.importance_[il, blocks, rows].astype(np.float64).sum(-1)
        if self.obs is None or not self.opts.obs_weight:
            return acc
        obs = self.obs[il, blocks, rows].astype(np.float64).sum(-1)
        return (acc / max(acc.sum(), 1e-30) +
                self.opts.obs_weight * obs / max(obs.sum(), 1e-30))

    def _compact(self, il: int, keep: np.ndarray) -> None:
        c, sp = self.cache, self.sparse
        old = c.table(il)[:-(-c.slot_count(il) // c.block_len)].copy()
        extra = () if sp is None else tuple(imp[il] for imp in sp.importances())
        if self.obs is not None:
            extra += (self.obs[il],)
        c.compact(il, keep, extra=extra)
        if sp is not None:
            sp.compacted(il, old)
