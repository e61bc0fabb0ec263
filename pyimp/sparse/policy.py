"""The engine side of importance-guided sparse attention (docs/kvcache.md sections 4-8).

:class:`SparseState` owns the two extra buffers of the cache and decides, per
layer and decode step, which blocks attention reads:

    importance_  float16 [L][NB][B][Hq]      softmax mass each token received, per query head
    anchor_      float16 [L][NB][A][Hq][D]   per-block key summaries used to score blocks

``importance_`` is a plain array on every layer. With ``second_window`` set, ``importance2_``
(the same shape) holds what the last ``second_window`` rows of each prefill added (0: every
row), as ``importance_`` would under ``importance_window = second_window``: one prefill serves
policies that score by two windows. Decode steps add to ``importance_`` alone. ``anchor_`` keeps the
documented ``[L][NB][A][Hq][D]`` indexing (:class:`AnchorBuffer`) but stores
only what retrieval reads: the layers that run retrieval (the lead sparse
layers, see ``layer_step``; none without ``enabled``), and for every anchor
type but DYNAMIC one slot per kv head instead of one per query head (the G
query heads of a GQA group hold the same value).

Prefill adds the probabilities of the last ``importance_window`` prompt rows;
``decay`` is applied once per prefill, to what earlier prompts and steps left
(``decay * old + new``, whatever the prefill's chunking). Decode adds each
step's probabilities (only attended tokens on sparse layers) with ``decay``
applied once per step.

Anchors are computed for every block after a prefill. During decode a block's
anchor is recomputed right before a retrieval reads it whenever its inputs
changed since it was computed: its keys (the block holding the newest token)
or, for DYNAMIC, the importance of its tokens (the blocks attended since; every
block when ``decay != 1``, see :meth:`SparseState.decode_attention`). So the
anchors retrieval reads always equal a full recomputation from the current
keys and importance.

A selection made at one step is reused for ``token_step`` steps (and by the
``layer_step - 1`` layers after its lead layer); a reused selection always
gains the blocks started since it was made, so the query's own token and every
token since the selection are attended. Sliding-window layers and
``dense_layers`` stay dense.

What the decode steps did (statistics, recall, the selections kept for traces and
heatmaps) is recorded by observers the state notifies (:mod:`pyimp.sparse.stats`);
pyimp-run draws the heatmap (:mod:`pyimp.cli.plotting`).
"""
from __future__ import annotations

from collections import deque

import numpy as np

from ..attention.attend import decode_over_blocks, every_block, sparse_attention_decode
from ..attention.importance import decay_importance
from ..kv.cache import KVCache, QuantizedKV
from ..options import SparseOptions
from . import AnchorType, RetrievalType, compute_anchors, retrieve_blocks
from .anchors import block_anchors, group_shared, min_anchor_num
from .retrieval import (block_center_logits, n_sets, recent_blocks, retrieve_unchecked,
                        select_blocks, select_for_recall)
from .select_modes import LayerKeys, block_max, pattern_scores
from .stats import CallbackObserver, DecodeStats, SparseObserver, SparseRecorder, sparse_report

# decode steps whose block selections the state's recorder keeps (per sparse layer) for heatmaps
# and reports; older ones are dropped so that a long --report / track run stays bounded in memory
SELECTION_HISTORY = 1024


def plan_layers(opts: SparseOptions, cfg) -> tuple[list, dict]:
    """(sparse layers, {sparse layer: lead layer whose selection it uses}).

    Sparse layers are the global-attention layers not in ``dense_layers``, and
    only with ``enabled``; the lead layers (every ``layer_step``-th sparse
    layer) run retrieval and are the only layers with anchors.
    """
    if not opts.enabled:
        return [], {}
    dense = set(opts.dense_layers)
    layers = [il for il in range(cfg.n_layer) if not cfg.is_swa(il) and il not in dense]
    lead = {il: layers[i - i % opts.layer_step] for i, il in enumerate(layers)}
    return layers, lead


class AnchorBuffer:
    """``anchor_``: the documented float16 ``[L][NB][A][Hq][D]`` anchors, stored only where read.

    Storage is one array per lead sparse layer, ``[NB][A][Ha][D]`` with ``Ha =
    Hkv`` for the group-shared types and ``Ha = Hq`` for DYNAMIC
    (:meth:`storage`, what the kernels read and write). Indexing gives the
    documented layout, read-only: ``anchor_[l]`` is ``[NB][A][Hq][D]`` (kv
    head ``h // G``'s value in query-head slot h, built on access for a shared
    type; zeros, without memory, for a layer that never runs retrieval), and
    ``anchor_[l, b, a, h]`` etc. index into it. :meth:`grouped` is a zero-copy
    ``[NB][A][Hkv][G][D]`` view. ``nbytes`` counts the storage actually held.
    """

    def __init__(self, n_layer: int, layers, n_blocks: int, anchor_num: int, n_head: int,
                 n_head_kv: int, head_dim: int, shared: bool):
        self.shape = (n_layer, n_blocks, anchor_num, n_head, head_dim)
        self.dtype = np.dtype(np.float16)
        self.ndim = 5
        self.n_head_kv = n_head_kv
        self.group = n_head // n_head_kv
        self.heads = n_head_kv if shared else n_head
        self._store = {il: np.zeros((n_blocks, anchor_num, self.heads, head_dim), np.float16)
                       for il in layers}

    @staticmethod
    def bytes_for(n_layers: int, n_blocks: int, anchor_num: int, heads: int, head_dim: int) -> int:
        return n_layers * n_blocks * anchor_num * heads * head_dim * 2

    @property
    def layers(self) -> list:
        """The layers that hold anchors."""
        return sorted(self._store)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._store.values())

    def __len__(self) -> int:
        return self.shape[0]

    def _layer(self, il) -> int:
        L = self.shape[0]
        il = int(il)
        if not -L <= il < L:
            raise IndexError(f"layer {il} is out of range for {L} layers")
        return il % L

    def storage(self, il: int) -> np.ndarray:
        """The writable ``[NB][A][Ha][D]`` array of a layer that holds anchors."""
        s = self._store.get(self._layer(il))
        if s is None:
            raise ValueError(f"layer {il} holds no anchors (layers with anchors: {self.layers})")
        return s

    def grouped(self, il: int) -> np.ndarray:
        """Read-only ``[NB][A][Hkv][G][D]`` view of layer il (no copy)."""
        il = self._layer(il)
        NB, A, Hq, D = self.shape[1:]
        s = self._store.get(il)
        if s is None:
            return np.broadcast_to(np.float16(0), (NB, A, self.n_head_kv, self.group, D))
        if self.heads == Hq:
            v = s.reshape(NB, A, self.n_head_kv, self.group, D).view()
            v.flags.writeable = False
            return v
        return np.broadcast_to(s[:, :, :, None, :], (NB, A, self.n_head_kv, self.group, D))

    def _full(self, il: int) -> np.ndarray:
        NB, A, Hq, D = self.shape[1:]
        s = self._store.get(il)
        if s is None:
            return np.broadcast_to(np.float16(0), (NB, A, Hq, D))
        if self.heads == Hq:
            v = s.view()
        else:
            v = np.repeat(s, self.group, axis=2)
        v.flags.writeable = False
        return v

    def __getitem__(self, key):
        first, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        if isinstance(first, (int, np.integer)):
            v = self._full(self._layer(first))
            return v[rest] if rest else v
        return np.asarray(self)[key]

    def __array__(self, dtype=None, copy=None):
        full = np.stack([self._full(il) for il in range(self.shape[0])])
        return full if dtype is None else full.astype(dtype)

    def zero(self) -> None:
        for a in self._store.values():
            a[:] = 0


class SparseState:
    """Importance matrix, anchors and block selection for one engine's cache.

    What the decode steps did is kept by observers (:mod:`pyimp.sparse.stats`) the state
    notifies: ``recorder``, a :class:`SparseRecorder` (statistics, the latest selections for
    traces, the selection history for heatmaps), is attached at construction when
    :meth:`records` says so; ``observe(callback)`` and :meth:`add_observer` attach more.
    ``stats``, ``selections`` and ``last_selection`` read the recorder's (empty without one).
    """

    # the host state records always: its statistics cost little, a trace reads last_selection
    # and the report's attended fraction needs no flag
    records_always = True

    def __init__(self, opts: SparseOptions, cfg, cache):
        opts.validate(cfg.n_layer)
        self.opts = opts
        self.cache = cache
        self.anchor_type = AnchorType(opts.anchor)
        self.retrieval_type = RetrievalType(opts.retrieval)
        L, NB, B = cfg.n_layer, cache.max_blocks, cache.block_len
        Hq, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        self.n_head, self.n_head_kv = Hq, Hkv
        A = opts.anchor_num or min_anchor_num(self.anchor_type)
        # layers that run block-sparse decode ([] without ``enabled``) and their lead layers
        self.sparse_layers, self._lead = plan_layers(opts, cfg)
        # [L][NB][B][Hq]: attention mass per token and query head (old + new, fp16), every layer
        self.importance_ = np.zeros((L, NB, B, Hq), dtype=np.float16)
        # the second window's prefill mass (None without second_window)
        self.importance2_ = (None if opts.second_window is None else
                             np.zeros_like(self.importance_))
        # [L][NB][A][Hq][D] view; storage on the lead layers only, per kv head unless DYNAMIC
        self.anchor_ = AnchorBuffer(L, sorted(set(self._lead.values())), NB, A, Hq, Hkv, D,
                                    group_shared(self.anchor_type))
        # per anchor layer: logical blocks whose anchor inputs changed since it was computed
        self._dirty = {il: np.zeros(cache.blocks_per_seq, bool) for il in self.anchor_.layers}
        self._sel: dict = {}   # lead layer -> (sel, cnt, step, logical blocks at selection time)
        self._est: dict = {}   # layer -> this step's estimated recall per set (recall target)
        self._keys: dict = {}  # lead layer -> LayerKeys (lowrank / lsh selection modes)
        self._prefill = None   # (prompt end, next position) of the prefill in progress
        self._every = (None, None)   # ((n_ctx, window), every_block's lists) of the latest dense layer
        self._chunk_is_prefill = False
        # when every block would be selected (F <= init + topk + local) a sparse layer runs the
        # dense kernel (the same result, faster); False runs the block-sparse kernels over every
        # block instead (to check them against dense attention at full budget)
        self.dense_fallback = True
        self.step = 0                # decode steps since the last reset (token_step's clock)
        self._observers: list = []   # SparseObserver, see add_observer()
        self._selection_observers: list = []   # those that want on_selection
        self._measure_recall = False           # one of them asked for each sparse step's recall
        self.recorder: SparseRecorder | None = None
        if self.records(opts):
            self.recorder = SparseRecorder(len(self.sparse_layers), SELECTION_HISTORY,
                                           keep_selections=opts.report or opts.track,
                                           measure_recall=opts.report)
            self.add_observer(self.recorder)

    @classmethod
    def records(cls, opts: SparseOptions) -> bool:
        """Is a :class:`SparseRecorder` attached to a state made with ``opts``?"""
        return cls.records_always or opts.report or opts.track

    # ------------------------------------------------------------- observers
    def add_observer(self, observer: SparseObserver) -> None:
        """Notify ``observer`` (:class:`pyimp.sparse.stats.SparseObserver`) from now on."""
        self._observers.append(observer)
        self._selection_observers = [ob for ob in self._observers if ob.wants_selections]
        self._measure_recall = any(ob.measure_recall for ob in self._observers)

    def observe(self, callback) -> None:
        """Call ``callback(il, q, n_ctx, scale, window, sparse)`` after every decode attention;
        ``sparse`` says whether layer il took the block-sparse path."""
        self.add_observer(CallbackObserver(callback))

    def _notify_selection(self, il: int, n_ctx: int, sel: np.ndarray, cnt: np.ndarray,
                          recall: np.ndarray | None, est: np.ndarray | None = None) -> None:
        for ob in self._selection_observers:
            ob.on_selection(il, self.step, n_ctx, self.cache.block_len, sel, cnt, recall, est)

    def _notify_attention(self, il: int, q, n_ctx: int, scale: float, window: int,
                          sparse: bool) -> None:
        for ob in self._observers:
            ob.on_attention(il, q, n_ctx, scale, window, sparse)

    @property
    def stats(self) -> DecodeStats:
        """The recorder's statistics (without a recorder: no layer's, the steps counted)."""
        return self.recorder.stats if self.recorder is not None else DecodeStats(steps=self.step)

    @property
    def selections(self) -> deque:
        """(step, layer, sorted logical block ids attended by set 0) of the last
        ``selection_history`` decode steps of every sparse layer (the recorder's, with
        ``report`` or ``track``), for heatmaps."""
        return self.recorder.selections if self.recorder is not None else deque()

    @property
    def selection_history(self) -> int:
        return self.recorder.history if self.recorder is not None else SELECTION_HISTORY

    @property
    def last_selection(self) -> dict:
        """layer -> (sel, cnt) of its latest block-sparse decode step (what a trace records)."""
        return self.recorder.last_selection if self.recorder is not None else {}

    @staticmethod
    def bytes_needed(opts: SparseOptions, cfg, max_blocks: int, block_len: int) -> int:
        """Bytes of importance_ and anchor_ storage for a cache of ``max_blocks`` blocks
        (without allocating); 0 when the options are not active (no SparseState is made)."""
        if not opts.active:
            return 0
        L, Hq, Hkv, D = cfg.n_layer, cfg.n_head, cfg.n_head_kv, cfg.head_dim
        atype = AnchorType(opts.anchor)
        A = opts.anchor_num or min_anchor_num(atype)
        importance = L * max_blocks * block_len * Hq * 2          # float16 [L][NB][B][Hq]
        _, lead = plan_layers(opts, cfg)
        heads = Hkv if group_shared(atype) else Hq
        return importance + AnchorBuffer.bytes_for(len(set(lead.values())), max_blocks, A, heads, D)

    # ------------------------------------------------------------- lifecycle
    def reset(self) -> None:
        self._zero_buffers()
        for d in self._dirty.values():
            d[:] = False
        self._sel.clear()
        self._keys.clear()
        self._prefill = None
        self.step = 0
        for ob in self._observers:
            ob.on_reset()

    def _zero_buffers(self) -> None:
        """importance_ and the anchors <- 0."""
        for imp in self.importances():
            imp[:] = 0
        self.anchor_.zero()

    def warmup(self) -> None:
        """Compile the anchor, retrieval and sparse-attention kernels on a throwaway 4-block cache."""
        if not self.sparse_layers:
            return
        c = self.cache
        _, _, A, Hq, D = self.anchor_.shape
        Hkv, B = self.n_head_kv, c.block_len
        tiny = KVCache(1, Hkv, D, 4 * B, block_len=B, type_k=c.type_k, type_v=c.type_v,
                       v_layout=c.v_layout)            # the same storage kinds, all zero
        tiny.reserve(4 * B)
        kc, vc = tiny.k_layer(0), tiny.v_layer(0)
        bt = tiny.table(0)
        anchor = np.zeros((4, A, self.anchor_.heads, D), np.float16)
        imp = np.zeros((4, B, Hq), np.float16)
        compute_anchors(self.anchor_type, kc, np.arange(4), np.full(4, B), anchor, imp)
        q = np.zeros((Hq, D), np.float32)
        sel, cnt = retrieve_blocks(q, anchor, bt, 4 * B, B, Hkv, self.retrieval_type, 1, 1, 1,
                                   self.anchor_type)
        sparse_attention_decode(q, kc, vc, bt, 4 * B, 1.0, 0, sel, cnt, np.empty((Hq, D), np.float32),
                                importance=imp, decay=self.opts.decay, recall=self._measure_recall)

    def obs_start(self, prompt_end: int) -> int:
        """First absolute position whose query row adds importance during a prefill."""
        W = self.opts.importance_window
        return 0 if W == 0 else max(0, prompt_end - W)

    def obs_start2(self, prompt_end: int) -> int:
        """First absolute position whose query row adds to ``importance2_`` during a prefill
        (-1: no second window)."""
        W = self.opts.second_window
        return -1 if W is None else 0 if W == 0 else max(0, prompt_end - W)

    def importances(self) -> list:
        """The importance buffers: ``importance_``, and ``importance2_`` with a second window."""
        return [self.importance_] + ([] if self.importance2_ is None else [self.importance2_])

    # ----------------------------------------------------- engine forward hooks
    def begin_forward(self, pos0: int, T: int, prompt_end: int | None) -> bool:
        """Called by the engine once per forward, before the layers; True for a prefill chunk.

        A forward is a prefill chunk when it has several tokens, when more
        chunks of its prompt follow (``prompt_end > pos0 + T``), or when it
        continues the prefill in progress; a lone token otherwise is a decode
        step. At the first chunk of a prefill ``decay`` scales the importance
        of the tokens cached before it, once, so chunks add plain mass and the
        result does not depend on the batch size.
        """
        end = pos0 + T if prompt_end is None else int(prompt_end)
        cont = self._prefill is not None and self._prefill == (end, pos0)
        prefill = cont or T > 1 or end > pos0 + T
        if prefill and not cont and self.opts.decay != 1.0 and pos0 > 0:
            self._decay(pos0)
        self._prefill = (end, pos0 + T) if prefill and pos0 + T < end else None
        self._chunk_is_prefill = prefill
        return prefill

    def _decay(self, n_ctx: int) -> None:
        """importance_ <- decay * importance_ for every slot each layer held before this forward
        (``n_ctx``: the positions cached then)."""
        for buf in self.importances():
            for il, imp in enumerate(buf):
                decay_importance(imp, self.cache.table(il), self.cache.slot_count(il),
                                 self.opts.decay)

    def end_forward(self, n_ctx: int) -> None:
        """Called by the engine once the forward's tokens are in every layer's cache."""
        if not self._chunk_is_prefill:
            self.after_decode(n_ctx)
        elif self._prefill is None:
            self.after_prefill(n_ctx)

    def _blocks_upto(self, il: int, n_ctx: int,
                     lbs: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Physical ids and valid-token counts of layer il's slot blocks lbs (default: every
        block of its first n_ctx slots)."""
        B = self.cache.block_len
        if lbs is None:
            lbs = np.arange(-(-n_ctx // B))
        blocks = self.cache.table(il)[lbs]
        n_valid = np.minimum(B, n_ctx - lbs * B)
        return blocks, n_valid

    def refresh_anchors(self, n_ctx: int | None = None, lbs: np.ndarray | None = None) -> None:
        """Recompute the anchors of slot blocks ``lbs`` (default: every block a layer holds, the
        partial tail included) on every layer that holds anchors. ``n_ctx``: the slots to
        count (default: each layer's own)."""
        for il in self.anchor_.layers:
            n = self.cache.slot_count(il) if n_ctx is None else n_ctx
            blocks, n_valid = self._blocks_upto(il, n, lbs)
            compute_anchors(self.anchor_type, self.cache.k_layer(il), blocks, n_valid,
                            self.anchor_.storage(il), self.importance_[il])
            if lbs is None:
                self._dirty[il][:] = False

    def after_prefill(self, n_ctx: int) -> None:
        self.refresh_anchors()
        self._sel.clear()
        for il in list(self._keys):       # lowrank / lsh: fitted again on the whole prompt
            self._keys[il].data = None

    def compacted(self, il: int, old_blocks: np.ndarray) -> None:
        """Layer il was compacted (its importance_ moved with its slots, see
        :meth:`KVCache.compact`); ``old_blocks``: the physical blocks it held before. The
        importance of emptied slots and released blocks is zeroed (new tokens land there),
        cached selections are dropped and the layer's anchors recomputed when next read."""
        c, B = self.cache, self.cache.block_len
        m = c.slot_count(il)
        row = c.table(il)
        held = row[:-(-m // B)]
        gone = np.setdiff1d(old_blocks, held)
        for imp in self.importances():
            imp[il, gone] = 0
            if m % B:
                imp[il, row[m // B], m % B:] = 0
        if il in self._dirty:
            self._dirty[il][:] = True
        if il in self._keys:              # slots moved: summarized again (same basis)
            lk = self._keys[il]
            lk.data, lk.n = None, 0
        self._sel.clear()

    def after_decode(self, n_ctx: int) -> None:
        """Called once a decode token is in every layer's cache."""
        self.step += 1
        for ob in self._observers:
            ob.on_step(self.step)

    def _fresh_anchors(self, il: int, n_ctx: int) -> np.ndarray:
        """Layer il's anchor storage, with every block whose inputs changed recomputed."""
        d = self._dirty[il]
        lbs = np.flatnonzero(d[:-(-n_ctx // self.cache.block_len)])
        if lbs.size:
            self._anchors(il, lbs, n_ctx)
            d[:] = False
        return self.anchor_.storage(il)

    def _anchors(self, il: int, lbs: np.ndarray, n_ctx: int) -> None:
        """Recompute layer il's anchors of logical blocks lbs (of its first n_ctx slots)."""
        blocks, n_valid = self._blocks_upto(il, n_ctx, lbs)
        kc = self.cache.k_layer(il)
        if self.anchor_type is AnchorType.DYNAMIC or isinstance(kc, QuantizedKV):
            compute_anchors(self.anchor_type, kc, blocks, n_valid, self.anchor_.storage(il),
                            self.importance_[il])
        else:                  # the cache's own blocks: no argument checks on this path
            block_anchors(self.anchor_type, kc, blocks, n_valid, self.anchor_.storage(il))

    def _mark(self, il: int, n_ctx: int, sel: np.ndarray | None, cnt: np.ndarray | None) -> None:
        """Record which DYNAMIC anchors of layer il this step's importance update made stale
        (sel None: dense attention)."""
        d = self._dirty.get(il)
        if d is None:
            return
        n_lb = -(-n_ctx // self.cache.block_len)
        if self.anchor_type is not AnchorType.DYNAMIC:
            return                                # other types depend on the keys only
        if sel is None or self.opts.decay != 1.0:
            # every token's importance changed: a uniform decay rounded to fp16 can tie (and so
            # reorder) tokens of a block nobody attended, so the cheap path is exact only at 1
            d[:n_lb] = True
        else:
            d[sel[np.arange(sel.shape[1])[None, :] < cnt[:, None]]] = True

    @staticmethod
    def _extend(cached, n_lb: int) -> tuple[np.ndarray, np.ndarray]:
        """A stored selection plus every logical block started since it was made."""
        sel, cnt, _, n_lb0 = cached
        extra = n_lb - n_lb0
        if extra <= 0:
            return sel, cnt
        nsets, K = sel.shape
        out = np.full((nsets, K + extra), -1, np.int32)
        out[:, :K] = sel
        out[np.arange(nsets)[:, None], cnt[:, None] + np.arange(extra)[None, :]] = \
            np.arange(n_lb0, n_lb, dtype=np.int32)[None, :]
        return out, (cnt + extra).astype(np.int32)

    # ------------------------------------------------------------ public API
    def restore_prefix(self, importance: np.ndarray, n_ctx: int) -> None:
        """Install the ``importance_`` a prefill left (as saved by a caller that rewinds the
        cache to that prefix) and recompute the anchors, as a prefill ends."""
        self.importance_[...] = importance
        self.after_prefill(n_ctx)

    def restored(self, n_ctx: int) -> None:
        """After importance_ and anchors of ``n_ctx`` tokens were installed from a saved state:
        nothing is stale, no selection is cached, no prefill is in progress."""
        for d in self._dirty.values():
            d[:] = False
        self._sel.clear()
        self._prefill = None

    def truncate(self, n_ctx: int) -> None:
        """The cache was cut back to ``n_ctx`` tokens: in every layer the importance of the slots
        past the ones it keeps is zeroed (they will be written again and must not inherit mass)
        and the block the cut falls in has its anchors recomputed when next read."""
        B = self.cache.block_len
        for il in range(len(self.importance_)):
            bt, s = self.cache.table(il), self.cache.slot_count(il)
            n_lb = int((bt >= 0).sum())
            lb0 = s // B
            if lb0 < n_lb:
                for imp in self.importances():
                    imp[il, bt[lb0], s - lb0 * B:] = 0
                    imp[il, bt[lb0 + 1:n_lb]] = 0
                if s % B and il in self._dirty:
                    self._dirty[il][lb0] = True
            lk = self._keys.get(il)
            if lk is not None and lk.data is not None and lk.n > s:
                lk.data, lk.n = lk.data[:s], s
        self._sel.clear()
        self._prefill = None

    def is_sparse_step(self, il: int, n_ctx: int) -> bool:
        """Does layer il take the block-sparse path with n_ctx tokens cached (new one included)?"""
        o = self.opts
        every = n_ctx // self.cache.block_len <= o.init_blocks + o.topk + o.local_blocks
        return il in self._lead and not (every and self.dense_fallback)

    # --------------------------------------------------------------- decode
    def decode_attention(self, il: int, q: np.ndarray, n_ctx: int, scale: float, window: int,
                         out: np.ndarray, sparse: bool | None = None) -> None:
        """Attention of the decode query q float32[Hq, D] of layer il into out float32[Hq, D]
        (``n_ctx``: the slots layer il holds, the new token's included; ``window`` in slots,
        see :func:`pyimp.attention.slot_window`); ``sparse``: the step's decision for the layer
        (the engine's Step; None: :meth:`is_sparse_step`)."""
        o, c = self.opts, self.cache
        kc, vc, bt = c.k_layer(il), c.v_layer(il), c.table(il)
        imp = self.importance_[il]
        if il in self._dirty:
            self._dirty[il][-(-n_ctx // c.block_len) - 1] = True   # the newest token's key joined it
        if sparse is None:
            sparse = self.is_sparse_step(il, n_ctx)
        # the cache's own arrays and a selection made here: the kernels run without the public
        # entry points' argument checks (their reductions cost ~1 ms a token at 16k)
        if not sparse:
            key = (n_ctx, window)                 # the step's dense layers share their block lists
            if self._every[0] != key:
                self._every = (key, every_block(n_ctx, c.block_len, window))
            sel, cnt = self._every[1]
            decode_over_blocks(q, kc, vc, bt, n_ctx, scale, window, sel, cnt, out, imp, o.decay,
                               min_blocks=8, bias=c.bias(il))      # as attention_decode
            self._mark(il, n_ctx, None, None)
        else:
            sel, cnt = self._selection(il, q, n_ctx, scale)
            if self._measure_recall:    # the recall diagnostic: the checked entry point computes it
                _, rec = sparse_attention_decode(q, kc, vc, bt, n_ctx, scale, window, sel, cnt,
                                                 out, importance=imp, decay=o.decay, recall=True,
                                                 bias=c.bias(il))
            else:
                decode_over_blocks(q, kc, vc, bt, n_ctx, scale, window, sel, cnt, out, imp,
                                   o.decay, bias=c.bias(il))
                rec = None
            self._mark(il, n_ctx, sel, cnt)
            self._notify_selection(il, n_ctx, sel, cnt, rec, self._est.pop(il, None))
        self._notify_attention(il, q, n_ctx, scale, window, sparse)

    def _selection(self, il: int, q: np.ndarray, n_ctx: int,
                   scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """The blocks layer il attends: every block at full budget, else its lead layer's cached
        selection while fresh (plus the blocks started since), else a new retrieval (with a
        recall target: blocks heaviest first until the estimated recall reaches it)."""
        o, B = self.opts, self.cache.block_len
        n_lb = -(-n_ctx // B)
        if n_ctx // B <= o.init_blocks + o.topk + o.local_blocks:
            return self._all_blocks(n_sets(self.retrieval_type, self.n_head, self.n_head_kv), n_lb)
        lead, step = self._lead[il], self.step
        cached = self._sel.get(lead)
        if lead == il and (cached is None or step - cached[2] >= o.token_step):
            sel, cnt = self._retrieve(il, q, n_ctx, scale)
            self._sel[lead] = (sel, cnt, step, n_lb)
            return sel, cnt
        return self._extend(cached, n_lb)

    @staticmethod
    def _all_blocks(nsets: int, n_lb: int) -> tuple[np.ndarray, np.ndarray]:
        """Every set selects logical blocks 0 .. n_lb-1."""
        return (np.tile(np.arange(n_lb, dtype=np.int32), (nsets, 1)),
                np.full(nsets, n_lb, np.int32))

    def _retrieve(self, il: int, q: np.ndarray, n_ctx: int, scale: float):
        """A new selection for lead layer il (more blocks than the budget): the selection mode's,
        the recall target's (its estimate kept for the observers) or the anchors' top-k."""
        o, B = self.opts, self.cache.block_len
        # anchors are brought up to date right before retrieval reads them
        if o.select != "anchors":
            return self._mode_selection(il, q, n_ctx)
        if o.recall_target > 0:
            sel, cnt, est = self._recall_selection(il, q, n_ctx, scale)
            self._est[il] = est
            return sel, cnt
        # the cache's own arrays: no argument checks
        Hq = q.shape[0]
        return retrieve_unchecked(q, self._fresh_anchors(il, n_ctx), self.cache.table(il),
                                  n_ctx, B, n_sets(self.retrieval_type, Hq, self.n_head_kv),
                                  Hq // self.n_head_kv, o.init_blocks, o.topk,
                                  o.local_blocks, self.anchor_type)

    def _mode_selection(self, il: int, q: np.ndarray, n_ctx: int):
        """(sel, cnt) of a selection mode other than the anchors (:mod:`pyimp.sparse.select_modes`)."""
        o, B = self.opts, self.cache.block_len
        nsets = n_sets(self.retrieval_type, q.shape[0], self.n_head_kv)
        F = n_ctx // B
        lb_end = F - recent_blocks(n_ctx, B, o.local_blocks)
        if o.select in ("sink_window", "strided"):
            scores, pick = pattern_scores(o.select, o.init_blocks, lb_end, F, o.stride, nsets)
        else:
            lk = self._keys.setdefault(il, LayerKeys(o.select, o.rank, o.lsh_tables, o.lsh_bits,
                                                     seed=1000 + il))
            if lk.data is None or (o.select == "lowrank" and lk.basis is None):
                lk.build(self.cache.gather(il, n_ctx)[0])
            elif lk.n < n_ctx:
                lk.extend(self.cache.gather(il, n_ctx, start=lk.n)[0], lk.n)
            ts = lk.token_scores(q, nsets, o.lsh_min_hits)
            scores, pick = block_max(ts, o.init_blocks, lb_end, B, n_ctx), o.topk
        return select_blocks(scores, n_ctx, B, o.init_blocks, pick, o.local_blocks)

    def _recall_selection(self, il: int, q: np.ndarray, n_ctx: int, scale: float):
        """(sel, cnt, estimated recall per set) for the recall target: every block scored."""
        o, B = self.opts, self.cache.block_len
        Hq = q.shape[0]
        nsets = n_sets(self.retrieval_type, Hq, self.n_head_kv)
        anchor = self._fresh_anchors(il, n_ctx)
        n_lb = -(-n_ctx // B)
        n_valid = np.minimum(B, n_ctx - np.arange(n_lb) * B)
        tokens = n_valid
        bias = self.cache.bias(il)
        if bias is not None:         # a merged slot stands for exp(lmul) tokens
            t = self.cache.table(il)[:n_lb]
            tokens = np.where(np.arange(B) < n_valid[:, None], np.exp(bias[t].astype(np.float64)),
                              0.0).sum(axis=1)
        logits = block_center_logits(q, anchor, self.cache.table(il), n_valid, self.anchor_type,
                                     Hq // self.n_head_kv)
        return select_for_recall(logits, n_ctx, B, o.init_blocks, o.local_blocks, Hq // nsets,
                                 scale, o.recall_target, o.topk, o.recall_max_blocks, tokens)

    # -------------------------------------------------------------- report
    def report(self) -> dict:
        """Recall per layer and head, attended fraction, buffer sizes in bytes
        (:func:`pyimp.sparse.stats.sparse_report` over the recorder's statistics).

        ``mode`` says whether any layer ran sparse: without ``enabled`` it is
        "tracking only" and ``sparse_layers`` is empty (every layer attended densely).
        """
        return sparse_report(self.stats, enabled=self.opts.enabled, sparse_layers=self.sparse_layers,
                             steps=self.step,
                             nbytes={"kv": int(self.cache.nbytes),
                                     "importance": int(self.importance_.nbytes),
                                     "anchors": int(self.anchor_.nbytes)})
