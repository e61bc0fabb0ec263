"""The sparse path's state on the device: :class:`DeviceSparseState`.

The decisions are :class:`pyimp.sparse.policy.SparseState`'s own (which layers run sparse,
lead layers, ``token_step`` reuse, when anchors are stale); only the buffers and the kernels
move to the device:

- ``importance_dev`` float16 ``[L][NB][B][Hq]`` and the anchor storage (:class:`DeviceAnchors`)
  live on the device. ``importance_`` and ``anchor_[...]`` read as host copies, made on demand
  (reports, heatmaps, Python access).
- Retrieval (scores and top-k) and the decode attention run on the device: a selection never
  comes to the host. It does for the observers that want selections only (the statistics'
  recorder, attached with ``--report`` / ``track`` only: the attended fraction and the recall
  need host numbers), so those flags cost a copy per sparse layer and step.
- DYNAMIC anchors: the host does not see which blocks a step attended, so every block of a
  DYNAMIC layer is recomputed before its next retrieval (the same anchors as the CPU path's
  per-block bookkeeping gives, at the cost of recomputing unattended blocks).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ..sparse import AnchorType
from ..sparse.anchors import group_shared
from ..sparse.policy import AnchorBuffer, SparseState
from ..sparse.retrieval import n_candidates, n_sets
from . import attention, device
from . import sparse as dsparse


@cuda.jit
def _extend(sel, cnt, n_lb0, n_lb, out, out_cnt):
    """out[si] = sel[si, :cnt[si]] followed by the logical blocks n_lb0 .. n_lb-1."""
    si = cuda.blockIdx.x
    c = cnt[si]
    K = out.shape[1]
    for j in range(cuda.threadIdx.x, K, cuda.blockDim.x):
        if j < c:
            out[si, j] = sel[si, j]
        elif j < c + n_lb - n_lb0:
            out[si, j] = n_lb0 + j - c
        else:
            out[si, j] = -1
    if cuda.threadIdx.x == 0:
        out_cnt[si] = c + n_lb - n_lb0


class DeviceAnchors(AnchorBuffer):
    """``anchor_`` with its storage on the device; indexing returns host copies."""

    def __init__(self, n_layer, layers, n_blocks, anchor_num, n_head, n_head_kv, head_dim, shared):
        super().__init__(n_layer, [], n_blocks, anchor_num, n_head, n_head_kv, head_dim, shared)
        self._store = {il: device.zeros((n_blocks, anchor_num, self.heads, head_dim), np.float16)
                       for il in layers}

    def _host(self, il: int) -> np.ndarray | None:
        s = self._store.get(il)
        return None if s is None else device.to_host(s)

    def grouped(self, il: int) -> np.ndarray:
        il = self._layer(il)
        NB, A, Hq, D = self.shape[1:]
        s = self._host(il)
        if s is None:
            return np.broadcast_to(np.float16(0), (NB, A, self.n_head_kv, self.group, D))
        if self.heads == Hq:
            return s.reshape(NB, A, self.n_head_kv, self.group, D)
        return np.broadcast_to(s[:, :, :, None, :], (NB, A, self.n_head_kv, self.group, D))

    def _full(self, il: int) -> np.ndarray:
        NB, A, Hq, D = self.shape[1:]
        s = self._host(il)
        if s is None:
            return np.broadcast_to(np.float16(0), (NB, A, Hq, D))
        return s if self.heads == Hq else np.repeat(s, self.group, axis=2)

    def zero(self) -> None:
        for il, a in self._store.items():
            self._store[il] = device.zeros(a.shape, np.float16)


class DeviceSparseState(SparseState):
    """:class:`SparseState` over a :class:`pyimp.cuda.kvcache.DeviceKVCache`.

    The policy (sparse and lead layers, when a selection is reused or made again, which anchors
    are stale, the step clock, reset, the observers) is the base class's; what is overridden
    moves a buffer or a kernel to the device:

    - ``importance_`` (a property over ``importance_dev``), ``_zero_buffers``, ``_decay``,
      ``restore_prefix`` and ``truncate``: the importance buffer lives on the device (a rewind
      goes through a host copy; the device cache never compacts, so one block table and one
      count serve every layer);
    - ``_anchors`` and ``refresh_anchors``: the anchors are computed by the device kernel (one
      slot count for every layer); in a fused decode step (:meth:`fused_anchors`) the K store
      itself recomputes the anchors of the block its key joined, so that block is not marked
      stale and a retrieval refreshes nothing;
    - ``_mark``: the attended blocks are not seen on the host, so a DYNAMIC layer's every block
      turns stale;
    - ``_all_blocks``, ``_retrieve`` and ``_extend``: the selections are device arrays, made by
      the device's retrieval (anchors only: the capability table refuses the other selection
      modes and the recall target on the device);
    - ``decode_attention``: the device's attention kernels; the recall, when an observer asks
      for it, is measured by a dense pass beside the sparse one;
    - ``warmup``: the device kernels compile at their first launch.

    The statistics' recorder is attached with ``report`` or ``track`` only (``records_always``
    False): its numbers need the selections on the host.
    """

    records_always = False

    def __init__(self, opts, cfg, cache):
        super().__init__(opts, cfg, cache)
        A = self.anchor_.shape[2]
        self.anchor_ = DeviceAnchors(cfg.n_layer, self.anchor_.layers, cache.max_blocks, A,
                                     cfg.n_head, cfg.n_head_kv, cfg.head_dim,
                                     group_shared(self.anchor_type))
        self.scratch = attention.Scratch()
        # block ids and valid counts of an anchor refresh, in one upload (no allocation)
        self._ids = device.zeros((2 * cache.max_blocks,), np.int32)
        self._ret: dict = {}        # lead layer -> its retrieval's (sel, cnt, scores) buffers

    # importance_: the device buffer; the attribute reads a host copy, an assignment uploads
    @property
    def importance_(self) -> np.ndarray:
        return device.to_host(self.importance_dev)

    @importance_.setter
    def importance_(self, value: np.ndarray) -> None:
        self.importance_dev = device.to_device(np.asarray(value, np.float16))

    def warmup(self) -> None:
        """The device kernels compile at their first launch."""

    def _zero_buffers(self) -> None:
        """Fresh zeroed device buffers (no host round trip)."""
        self.importance_dev = device.zeros(self.importance_dev.shape, np.float16)
        self.anchor_.zero()

    def _decay(self, n_ctx: int) -> None:
        """The decay kernel on the device buffer (one block table for every layer)."""
        for il in range(self.importance_dev.shape[0]):
            dsparse.decay_importance(self.importance_dev[il], self.cache.bt_dev, n_ctx,
                                     self.opts.decay)

    def truncate(self, n_ctx: int) -> None:
        """As the host's, through a host copy of importance_; every anchor from the cut's block
        on turns stale."""
        imp = self.importance_                      # a rewind is rare: host round trip
        bt, B = self.cache.table(0), self.cache.block_len
        n_lb = int((bt >= 0).sum())
        lb0 = n_ctx // B
        if lb0 < n_lb:
            imp[:, bt[lb0], n_ctx - lb0 * B:] = 0
            imp[:, bt[lb0 + 1:n_lb]] = 0
            self.importance_ = imp
            for d in self._dirty.values():
                d[lb0:] = True
        self._sel.clear()
        self._prefill = None

    def restore_prefix(self, importance: np.ndarray, n_ctx: int) -> None:
        """Uploads importance (the host's writes into the array importance_ reads)."""
        self.importance_ = importance
        self.after_prefill(n_ctx)

    def _anchors(self, il: int, lbs: np.ndarray, n_ctx: int) -> None:
        """The device kernel over layer il's logical blocks lbs (block ids uploaded)."""
        blocks, n_valid = self._blocks_upto(il, n_ctx, lbs)
        n = len(blocks)
        device.upload(self._ids[:2 * n], np.concatenate([blocks, n_valid]).astype(np.int32))
        dsparse.compute_anchors(self.anchor_type, self.cache.k_layer(il), self._ids[:n],
                                self._ids[n:2 * n], self.anchor_.storage(il),
                                self.importance_dev[il])

    def refresh_anchors(self, n_ctx: int | None = None, lbs: np.ndarray | None = None) -> None:
        """As the host's, with the device kernel and one slot count for every layer."""
        if n_ctx is None:               # the device cache never compacts: one count for all
            n_ctx = self.cache.slot_count(0)
        if lbs is None:
            lbs = np.arange(-(-n_ctx // self.cache.block_len))
        for il in self.anchor_.layers:
            self._anchors(il, lbs, n_ctx)
            if lbs.size == -(-n_ctx // self.cache.block_len):
                self._dirty[il][:] = False

    def _mark(self, il: int, n_ctx: int, sel, cnt) -> None:
        """A DYNAMIC layer's every block turns stale (the selection stays on the device)."""
        d = self._dirty.get(il)
        if d is not None and self.anchor_type is AnchorType.DYNAMIC:
            d[:-(-n_ctx // self.cache.block_len)] = True     # attended blocks are not known here

    def _extend(self, cached, n_lb: int):
        """The host's, as a device kernel into scratch arrays."""
        sel, cnt, _, n_lb0 = cached
        if n_lb <= n_lb0:
            return sel, cnt
        nsets, K = sel.shape
        out = self.scratch.get(f"ext{K + n_lb - n_lb0}", (nsets, K + n_lb - n_lb0), np.int32)
        out_cnt = self.scratch.get("ext_cnt", (nsets,), np.int32)
        device.launch(_extend, nsets, 32, sel, cnt, np.int32(n_lb0), np.int32(n_lb), out, out_cnt)
        return out, out_cnt

    def _all_blocks(self, nsets: int, n_lb: int):
        """The host's, uploaded."""
        sel, cnt = SparseState._all_blocks(nsets, n_lb)
        return device.to_device(sel), device.to_device(cnt)

    def _retrieve(self, il: int, q, n_ctx: int, scale: float):
        """The anchors' top-k on the device (q: ``[1, Hq, D]``)."""
        o, B = self.opts, self.cache.block_len
        bufs = self._ret.get(il)
        if bufs is None:               # one set of buffers per lead layer, made at its first use
            nsets = n_sets(self.retrieval_type, self.n_head, self.n_head_kv)
            K = o.init_blocks + o.topk + o.local_blocks + 1
            bufs = self._ret[il] = (device.zeros((nsets, K), np.int32),
                                    device.zeros((nsets,), np.int32),
                                    device.zeros((self.cache.max_blocks, nsets), np.float32),
                                    device.zeros((1,), np.int32))
        sel, cnt, scores, counter = bufs
        F = n_ctx // B
        C = n_candidates(n_ctx, B, o.init_blocks, o.local_blocks) \
            if F > o.init_blocks + o.topk + o.local_blocks else 0
        return dsparse.retrieve_blocks(q[0], self._fresh_anchors(il, n_ctx), self.cache.bt_dev,
                                       n_ctx, B, self.n_head_kv, self.retrieval_type,
                                       o.init_blocks, o.topk, o.local_blocks, self.anchor_type,
                                       sel=sel, cnt=cnt, scores=scores[:C] if C else None,
                                       counter=counter)

    def fused_ok(self) -> bool:
        """Can a decode step of this state run the fused decode's attention launch
        (:mod:`pyimp.cuda.decode`: importance added with decay 1, nobody watching q or the
        selections)?"""
        return self.opts.decay == 1.0 and not self._observers

    def fused_anchors(self, il: int):
        """(kind code, anchor storage) for the fused step's K store to refresh layer il's
        anchors of the block the new key joins (:mod:`pyimp.cuda.decode`), or None: layers
        without anchors, DYNAMIC anchors (they follow importance_, not the keys), and steps
        the fused attention does not take (:meth:`fused_ok`)."""
        if (il not in self._dirty or self.anchor_type is AnchorType.DYNAMIC
                or not self.fused_ok()):
            return None
        return dsparse.anchor_code(self.anchor_type), self.anchor_.storage(il)

    def _joined(self, il: int, n_ctx: int, anchors_fresh: bool) -> None:
        """The newest key joined its block: stale anchors, unless the store refreshed them."""
        if il in self._dirty and not anchors_fresh:
            self._dirty[il][-(-n_ctx // self.cache.block_len) - 1] = True

    def dense_step(self, il: int, q, n_ctx: int, scale: float, window: int, attend,
                   anchors_fresh: bool = False) -> None:
        """A dense decode step of layer il: the bookkeeping around ``attend()``, the launch
        that attends and adds the step's importance. ``anchors_fresh``: the step's K store
        recomputed the anchors of the block the key joined (:meth:`fused_anchors`)."""
        self._joined(il, n_ctx, anchors_fresh)
        attend()
        self._mark(il, n_ctx, None, None)
        self._notify_attention(il, q, n_ctx, scale, window, False)

    def sparse_step(self, il: int, q, n_ctx: int, scale: float, window: int, attend,
                    anchors_fresh: bool = False) -> None:
        """A block-sparse decode step of layer il: the selection (a retrieval, a lead layer's
        reuse or every block) and the bookkeeping around ``attend(sel, cnt)``, the launch that
        attends the selected blocks and adds the step's importance (no observer: see
        :meth:`fused_ok`); ``anchors_fresh`` as in :meth:`dense_step`."""
        self._joined(il, n_ctx, anchors_fresh)
        sel, cnt = self._selection(il, q, n_ctx, scale)
        attend(sel, cnt)
        self._mark(il, n_ctx, sel, cnt)
        self._notify_attention(il, q, n_ctx, scale, window, True)

    def decode_attention(self, il: int, q, n_ctx: int, scale: float, window: int, out,
                         sparse: bool | None = None) -> None:
        """Attention of the device query q ``[1, Hq, D]`` of layer il into out ``[1, Hq, D]``;
        ``sparse`` as :meth:`pyimp.sparse.policy.SparseState.decode_attention`."""
        o, c = self.opts, self.cache
        kc, vc, bt = c.k_layer(il), c.v_layer(il), c.bt_dev
        imp = self.importance_dev[il]
        if sparse is None:
            sparse = self.is_sparse_step(il, n_ctx)
        if not sparse:
            self.dense_step(il, q, n_ctx, scale, window, lambda: attention.decode(
                q, kc, vc, bt, n_ctx, scale, window, out, importance=imp, decay=o.decay,
                scratch=self.scratch))
            return
        if il in self._dirty:
            self._dirty[il][-(-n_ctx // c.block_len) - 1] = True
        sel, cnt = self._selection(il, q, n_ctx, scale)
        M, L = attention.decode(q, kc, vc, bt, n_ctx, scale, window, out, sel=sel, cnt=cnt,
                                importance=imp, decay=o.decay, scratch=self.scratch)
        self._mark(il, n_ctx, sel, cnt)
        if self._selection_observers:
            rec = None
            if self._measure_recall:    # recall = exp(lse_sparse - lse_dense), as on the CPU
                Ms, Ls = device.to_host(M)[0], device.to_host(L)[0]
                dense = device.empty(out.shape, np.float32)
                Md, Ld = attention.decode(q, kc, vc, bt, n_ctx, scale, window, dense,
                                          scratch=attention.Scratch())
                Md, Ld = device.to_host(Md)[0], device.to_host(Ld)[0]
                with np.errstate(divide="ignore", invalid="ignore"):
                    rec = np.where(Ld > 0, Ls / Ld * np.exp(Ms - Md), 0).astype(np.float32)
            self._notify_selection(il, n_ctx, device.to_host(sel), device.to_host(cnt), rec)
        self._notify_attention(il, q, n_ctx, scale, window, sparse)
