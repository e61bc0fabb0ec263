"""The engine side of importance-guided sparse attention (KVCACHE.md sections 4-8).

:class:`SparseState` owns the two extra buffers of the cache and decides, per
layer and decode step, which blocks attention reads:

    importance_  float16 [L][NB][B][Hq]      softmax mass each token received, per query head
    anchor_      float16 [L][NB][A][Hq][D]   per-block key summaries used to score blocks

Prefill adds the probabilities of the last ``importance_window`` prompt rows;
decode adds each step's probabilities (only attended tokens on sparse
layers). Anchors are computed for every block after a prefill and for each
block that fills during decode; DYNAMIC anchors are refreshed every
``token_step`` steps. Sliding-window layers and ``dense_layers`` stay dense.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import attention
from .sparse import AnchorType, RetrievalType, compute_anchors, retrieve_blocks, sparse_attention_decode
from .sparse.anchors import min_anchor_num


@dataclass(frozen=True)
class SparseOptions:
    """Options of the sparse path (the CLI flags of the same names)."""

    enabled: bool = False           # block-sparse decode attention on eligible layers
    anchor: str = "quest"           # fixed, dynamic, quest, block_mean, block_max, cuboid_mean
    anchor_num: int = 0             # 0 = the type's minimum (2 for quest / cuboid_mean, else 1)
    retrieval: str = "kvhead"       # layer, kvhead, qhead
    topk: int = 8                   # pick_block_num: best-scoring blocks besides sinks and locals
    init_blocks: int = 1            # attention-sink blocks always attended
    local_blocks: int = 2           # most recent full blocks always attended
    importance_window: int = 128    # prefill rows that add importance; 0 = all rows
    token_step: int = 1             # reuse a selection for this many decode steps
    layer_step: int = 1             # reuse a lead layer's selection for this many sparse layers
    dense_layers: tuple = ()        # layers kept dense besides the sliding-window ones
    decay: float = 1.0              # importance <- decay * importance + new
    report: bool = False            # measure attention recall (runs dense attention too)
    track: bool = False             # keep importance_ / anchors even when not sparse

    def validate(self, n_layer: int) -> None:
        try:
            atype = AnchorType(self.anchor)
        except ValueError:
            raise ValueError(f"anchor type {self.anchor!r} is not one of "
                             f"{', '.join(a.value for a in AnchorType)}") from None
        try:
            RetrievalType(self.retrieval)
        except ValueError:
            raise ValueError(f"retrieval type {self.retrieval!r} is not one of "
                             f"{', '.join(r.value for r in RetrievalType)}") from None
        if self.anchor_num and self.anchor_num < min_anchor_num(atype):
            raise ValueError(f"{self.anchor} anchors need anchor_num >= {min_anchor_num(atype)}")
        for name in ("topk", "init_blocks", "local_blocks", "importance_window", "anchor_num"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("token_step", "layer_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        bad = [il for il in self.dense_layers if not 0 <= il < n_layer]
        if bad:
            raise ValueError(f"dense layer {bad[0]} does not exist (the model has {n_layer} layers)")

    @property
    def active(self) -> bool:
        return self.enabled or self.report or self.track


@dataclass
class _Stats:
    steps: int = 0
    recall_sum: dict = field(default_factory=dict)      # layer -> float64[Hq]
    recall_n: dict = field(default_factory=dict)        # layer -> sparse steps measured
    attended: dict = field(default_factory=dict)        # layer -> tokens attended (sum over steps, mean over sets)
    context: dict = field(default_factory=dict)         # layer -> context tokens (sum over steps)


class SparseState:
    """Importance matrix, anchors and block selection for one engine's cache."""

    def __init__(self, opts: SparseOptions, cfg, cache):
        opts.validate(cfg.n_layer)
        self.opts = opts
        self.cache = cache
        self.anchor_type = AnchorType(opts.anchor)
        self.retrieval_type = RetrievalType(opts.retrieval)
        L, NB, B = cfg.n_layer, cache.max_blocks, cache.block_len
        Hq, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        self.n_head_kv = Hkv
        A = opts.anchor_num or min_anchor_num(self.anchor_type)
        # [L][NB][B][Hq]: attention mass per token and query head (old + new, fp16)
        self.importance_ = np.zeros((L, NB, B, Hq), dtype=np.float16)
        # [L][NB][A][Hq][D]: per-block anchors (per query head; GQA groups share unless DYNAMIC)
        self.anchor_ = np.zeros((L, NB, A, Hq, D), dtype=np.float16)
        self.sparse_layers = [il for il in range(L)
                              if not cfg.is_swa(il) and il not in set(opts.dense_layers)]
        self._lead = {}   # layer -> lead layer whose selection it reuses (layer_step)
        for i, il in enumerate(self.sparse_layers):
            self._lead[il] = self.sparse_layers[i - i % opts.layer_step]
        self._sel: dict = {}   # lead layer -> (sel, cnt, step)
        self.stats = _Stats()
        self.selections: list = []   # (step, layer, sorted logical block ids attended) for heatmaps

    @staticmethod
    def bytes_needed(opts: SparseOptions, cfg, max_blocks: int, block_len: int) -> int:
        """Bytes of importance_ and anchor_ for a cache of ``max_blocks`` blocks (without allocating)."""
        L, Hq, D = cfg.n_layer, cfg.n_head, cfg.head_dim
        A = opts.anchor_num or min_anchor_num(AnchorType(opts.anchor))
        importance = L * max_blocks * block_len * Hq * 2          # float16 [L][NB][B][Hq]
        anchors = L * max_blocks * A * Hq * D * 2                 # float16 [L][NB][A][Hq][D]
        return importance + anchors

    # ------------------------------------------------------------- lifecycle
    def reset(self) -> None:
        self.importance_[:] = 0
        self.anchor_[:] = 0
        self._sel.clear()
        self.stats = _Stats()
        self.selections = []

    def warmup(self) -> None:
        """Compile the anchor, retrieval and sparse-attention kernels on a throwaway 4-block cache."""
        if not self.opts.enabled or not self.sparse_layers:
            return
        c = self.cache
        _, _, A, Hq, D = self.anchor_.shape
        Hkv, B = self.n_head_kv, c.block_len
        kc = np.zeros((Hkv, 4, B * D), c.dtype)
        vc = np.zeros((Hkv, 4, D * B), c.dtype)
        bt = np.arange(4, dtype=np.int32)
        anchor = np.zeros((4, A, Hq, D), np.float16)
        imp = np.zeros((4, B, Hq), np.float16)
        compute_anchors(self.anchor_type, kc, np.arange(4), np.full(4, B), anchor, imp)
        q = np.zeros((Hq, D), np.float32)
        sel, cnt = retrieve_blocks(q, anchor, bt, 4 * B, B, Hkv, self.retrieval_type, 1, 1, 1,
                                   self.anchor_type)
        sparse_attention_decode(q, kc, vc, bt, 4 * B, 1.0, 0, sel, cnt, np.empty((Hq, D), np.float32),
                                importance=imp, decay=self.opts.decay, recall=self.opts.report)

    def obs_start(self, prompt_end: int) -> int:
        """First absolute position whose query row adds importance during a prefill."""
        W = self.opts.importance_window
        return 0 if W == 0 else max(0, prompt_end - W)

    def _blocks_upto(self, n_ctx: int, lb_from: int = 0) -> tuple[np.ndarray, np.ndarray]:
        B = self.cache.block_len
        nlb = -(-n_ctx // B)
        lbs = np.arange(lb_from, nlb)
        blocks = self.cache.block_table[0][lbs]
        n_valid = np.minimum(B, n_ctx - lbs * B)
        return blocks, n_valid

    def refresh_anchors(self, n_ctx: int, lb_from: int = 0) -> None:
        """Recompute anchors of logical blocks lb_from.. (partial tail included) on sparse layers."""
        blocks, n_valid = self._blocks_upto(n_ctx, lb_from)
        for il in self.sparse_layers:
            compute_anchors(self.anchor_type, self.cache.k_cache_fp16_[il], blocks, n_valid,
                            self.anchor_[il], self.importance_[il])

    def after_prefill(self, n_ctx: int) -> None:
        self.refresh_anchors(n_ctx)
        self._sel.clear()

    def after_decode(self, n_ctx: int) -> None:
        """Called once a decode token is in every layer's cache."""
        B = self.cache.block_len
        self.stats.steps += 1
        if self.anchor_type is AnchorType.DYNAMIC and self.stats.steps % self.opts.token_step == 0:
            self.refresh_anchors(n_ctx)
        elif n_ctx % B == 0:
            self.refresh_anchors(n_ctx, n_ctx // B - 1)   # the block that just filled

    # --------------------------------------------------------------- decode
    def decode_attention(self, il: int, q: np.ndarray, n_ctx: int, scale: float, window: int,
                         out: np.ndarray) -> None:
        """Attention of the decode query q float32[Hq, D] of layer il into out float32[Hq, D]."""
        o, c = self.opts, self.cache
        kc, vc = c.k_cache_fp16_[il], c.v_cache_fp16_[il]
        bt = c.block_table[0]
        imp = self.importance_[il]
        F = n_ctx // c.block_len
        if not o.enabled or il not in self._lead or F <= o.init_blocks + o.topk + o.local_blocks:
            attention.attention_decode(q, kc, vc, bt, n_ctx, scale, window, out, importance=imp,
                                       decay=o.decay)
            return
        lead = self._lead[il]
        step = self.stats.steps
        cached = self._sel.get(lead)
        if lead == il and (cached is None or step - cached[2] >= o.token_step):
            sel, cnt = retrieve_blocks(q, self.anchor_[il], bt, n_ctx, c.block_len, self.n_head_kv,
                                       self.retrieval_type, o.init_blocks, o.topk, o.local_blocks,
                                       self.anchor_type)
            self._sel[lead] = (sel, cnt, step)
        else:
            sel, cnt, _ = self._sel[lead]
        _, rec = sparse_attention_decode(q, kc, vc, bt, n_ctx, scale, window, sel, cnt, out,
                                         importance=imp, decay=o.decay, recall=o.report)
        st = self.stats
        if rec is not None:
            st.recall_sum[il] = st.recall_sum.get(il, 0.0) + rec.astype(np.float64)
            st.recall_n[il] = st.recall_n.get(il, 0) + 1
        attended = np.minimum(cnt.astype(np.int64) * c.block_len, n_ctx).mean()
        st.attended[il] = st.attended.get(il, 0.0) + float(attended)
        st.context[il] = st.context.get(il, 0) + n_ctx
        if o.report or o.track:
            self.selections.append((step, il, np.unique(sel[0, :cnt[0]]).tolist()))

    # -------------------------------------------------------------- report
    def report(self) -> dict:
        """Recall per layer and head, attended fraction, buffer sizes in bytes."""
        st = self.stats
        layers = {}
        for il in self.sparse_layers:
            entry = {}
            if il in st.recall_n:
                r = st.recall_sum[il] / st.recall_n[il]
                entry["recall_per_head"] = [round(float(x), 6) for x in r]
                entry["recall"] = round(float(r.mean()), 6)
            if st.context.get(il):
                entry["attended_fraction"] = round(st.attended[il] / st.context[il], 6)
            if entry:
                layers[str(il)] = entry
        recalls = [v["recall"] for v in layers.values() if "recall" in v]
        fracs = [v["attended_fraction"] for v in layers.values() if "attended_fraction" in v]
        return {
            "sparse_layers": self.sparse_layers,
            "decode_steps": st.steps,
            "mean_recall": float(np.mean(recalls)) if recalls else None,
            "mean_attended_fraction": float(np.mean(fracs)) if fracs else None,
            "layers": layers,
            "bytes": {"kv": int(self.cache.nbytes), "importance": int(self.importance_.nbytes),
                      "anchors": int(self.anchor_.nbytes)},
        }

    def heatmap(self, path: str, n_ctx: int) -> None:
        """PNG: importance_ summed over heads per layer x token, and block selections over time."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise RuntimeError("heatmaps need matplotlib: pip install 'pyimp[plot]'") from None
        B = self.cache.block_len
        nlb = -(-n_ctx // B)
        blocks = self.cache.block_table[0][:nlb]
        imp = self.importance_[:, blocks].astype(np.float32).sum(-1).reshape(len(self.importance_), -1)[:, :n_ctx]
        fig, axes = plt.subplots(2, 1, figsize=(10, 7))
        im = axes[0].imshow(np.log1p(imp), aspect="auto", interpolation="nearest", cmap="magma")
        axes[0].set_title("log(1 + importance_) summed over query heads")
        axes[0].set_xlabel("token position")
        axes[0].set_ylabel("layer")
        fig.colorbar(im, ax=axes[0])
        lay = self.sparse_layers[0] if self.sparse_layers else None
        rows = [(s, blk) for s, il, blk in self.selections if il == lay]
        grid = np.zeros((max(len(rows), 1), nlb), np.float32)
        for i, (_, blk) in enumerate(rows):
            grid[i, [b for b in blk if b < nlb]] = 1.0
        axes[1].imshow(grid, aspect="auto", interpolation="nearest", cmap="Greys")
        axes[1].set_title(f"selected blocks per decode step (layer {lay}, first set)")
        axes[1].set_xlabel("logical block")
        axes[1].set_ylabel("decode step")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
