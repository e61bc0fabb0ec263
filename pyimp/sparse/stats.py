"""What a sparse state's decode steps did, kept beside it: the observers of :class:`pyimp.sparse.policy.SparseState`.

The state decides which blocks each layer attends and keeps the anchors fresh; it
tells the observers attached to it what it did, through one small interface
(:class:`SparseObserver`):

- ``on_selection(il, step, n_ctx, block_len, sel, cnt, recall, est)`` after every
  block-sparse decode attention (host arrays: the selection ``sel`` int32
  ``[nsets, K]`` with ``cnt`` int32 ``[nsets]`` valid entries per set; the recall per
  query head when an observer asked for it (``measure_recall``), else None; the recall
  target's estimate per set when it chose the blocks, else None);
- ``on_attention(il, q, n_ctx, scale, window, sparse)`` after every decode attention,
  dense or sparse (``observe(callback)``'s callbacks);
- ``on_step(step)`` once a decode token is in every layer's cache (``step``: the decode
  steps since the last reset);
- ``on_reset()`` when the state is reset.

:class:`SparseRecorder` is the statistics observer: :class:`DecodeStats` (attended
tokens, the recall and the recall target's estimate per layer), the latest selection
of every layer (what a trace records) and the selections of the last ``history``
decode steps (for heatmaps). :func:`sparse_report` turns them into the report.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass
class DecodeStats:
    """What the sparse decode steps did, per sparse layer (see :func:`sparse_report`)."""

    steps: int = 0
    recall_sum: dict = field(default_factory=dict)      # layer -> float64[Hq]
    recall_n: dict = field(default_factory=dict)        # layer -> sparse steps measured
    attended: dict = field(default_factory=dict)        # layer -> tokens attended (sum over steps, mean over sets)
    context: dict = field(default_factory=dict)         # layer -> context tokens (sum over steps)
    est_sum: dict = field(default_factory=dict)         # layer -> estimated recall (recall target)
    est_n: dict = field(default_factory=dict)

    def add(self, il: int, n_ctx: int, block_len: int, sel: np.ndarray, cnt: np.ndarray,
            recall: np.ndarray | None, est: np.ndarray | None = None) -> None:
        """One sparse step of layer il: real tokens attended per set (a partial tail counts its
        valid tokens), mean over sets; the recall per head if measured; the recall target's
        estimate (mean over sets) if it chose the blocks."""
        if est is not None:
            self.est_sum[il] = self.est_sum.get(il, 0.0) + float(np.mean(est))
            self.est_n[il] = self.est_n.get(il, 0) + 1
        if recall is not None:
            self.recall_sum[il] = self.recall_sum.get(il, 0.0) + recall.astype(np.float64)
            self.recall_n[il] = self.recall_n.get(il, 0) + 1
        live = np.arange(sel.shape[1])[None, :] < cnt[:, None]
        ntok = np.where(live, np.minimum(block_len, n_ctx - sel.astype(np.int64) * block_len), 0)
        self.attended[il] = self.attended.get(il, 0.0) + float(ntok.sum(axis=1).mean())
        self.context[il] = self.context.get(il, 0) + n_ctx


class SparseObserver:
    """The interface a sparse state notifies (every method a no-op here; see the module docstring)."""

    measure_recall = False     # the state measures each sparse step's recall for this observer
    wants_selections = True    # on_selection is called (the device state copies selections to the host)

    def on_selection(self, il: int, step: int, n_ctx: int, block_len: int, sel: np.ndarray,
                     cnt: np.ndarray, recall: np.ndarray | None, est: np.ndarray | None) -> None:
        pass

    def on_attention(self, il: int, q, n_ctx: int, scale: float, window: int, sparse: bool) -> None:
        pass

    def on_step(self, step: int) -> None:
        pass

    def on_reset(self) -> None:
        pass


class CallbackObserver(SparseObserver):
    """``callback(il, q, n_ctx, scale, window, sparse)`` after every decode attention."""

    wants_selections = False

    def __init__(self, callback):
        self.callback = callback

    def on_attention(self, il, q, n_ctx, scale, window, sparse) -> None:
        self.callback(il, q, n_ctx, scale, window, sparse)


class SparseRecorder(SparseObserver):
    """The statistics of a sparse state's decode steps.

    ``stats``: :class:`DecodeStats`; ``last_selection``: layer -> (sel, cnt) of its latest
    block-sparse decode step (what a trace records); ``selections``: (step, layer, sorted
    logical block ids attended by set 0) of the last ``history`` decode steps of every sparse
    layer, kept with ``keep_selections`` only (heatmaps, reports). ``measure_recall`` asks the
    state for each sparse step's recall (an extra cost on every sparse step).
    """

    def __init__(self, n_sparse_layers: int, history: int, keep_selections: bool,
                 measure_recall: bool):
        self.history = history
        self.keep_selections = keep_selections
        self.measure_recall = measure_recall
        self.stats = DecodeStats()
        self.last_selection: dict = {}
        self.selections: deque = deque(maxlen=history * max(n_sparse_layers, 1))

    def on_selection(self, il, step, n_ctx, block_len, sel, cnt, recall, est) -> None:
        self.last_selection[il] = (sel, cnt)
        self.stats.add(il, n_ctx, block_len, sel, cnt, recall, est)
        if self.keep_selections:
            self.selections.append((step, il, np.unique(sel[0, :cnt[0]]).tolist()))

    def on_step(self, step: int) -> None:
        self.stats.steps = step

    def on_reset(self) -> None:
        self.stats = DecodeStats()
        self.selections.clear()
        self.last_selection.clear()


def sparse_report(stats: DecodeStats, *, enabled: bool, sparse_layers, steps: int,
                  nbytes: dict) -> dict:
    """Recall per layer and head, attended fraction, buffer sizes in bytes (see
    :meth:`pyimp.sparse.policy.SparseState.report`)."""
    st = stats
    layers = {}
    for il in sparse_layers:
        entry = {}
        if il in st.recall_n:
            r = st.recall_sum[il] / st.recall_n[il]
            entry["recall_per_head"] = [round(float(x), 6) for x in r]
            entry["recall"] = round(float(r.mean()), 6)
        if st.context.get(il):
            entry["attended_fraction"] = round(st.attended[il] / st.context[il], 6)
        if st.est_n.get(il):
            entry["estimated_recall"] = round(st.est_sum[il] / st.est_n[il], 6)
        if entry:
            layers[str(il)] = entry
    recalls = [v["recall"] for v in layers.values() if "recall" in v]
    fracs = [v["attended_fraction"] for v in layers.values() if "attended_fraction" in v]
    ests = [v["estimated_recall"] for v in layers.values() if "estimated_recall" in v]
    return {
        "mode": "sparse" if enabled else "tracking only (every layer dense)",
        "sparse_layers": list(sparse_layers),
        "decode_steps": steps,
        "mean_recall": float(np.mean(recalls)) if recalls else None,
        "mean_attended_fraction": float(np.mean(fracs)) if fracs else None,
        "mean_estimated_recall": float(np.mean(ests)) if ests else None,
        "layers": layers,
        "bytes": nbytes,
    }
