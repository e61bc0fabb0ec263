"""Pictures of an engine's sparse state for pyimp-run (``--heatmap``; needs ``pyimp[plot]``).

Each drawing uses its own Agg canvas: pyplot and the process's matplotlib backend are not
touched, and matplotlib is imported only when something is drawn.
"""
from __future__ import annotations

import numpy as np


def sparse_heatmap(state, path, n_ctx: int) -> None:
    """Draw ``state``'s (a :class:`pyimp.sparse.policy.SparseState`) importance_ summed over
    heads per layer x token, and the block selections over time, to ``path`` (a file name or a
    binary file; the format is matplotlib's ``savefig.format`` for a file object)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeError("heatmaps need matplotlib: pip install 'pyimp[plot]'") from None
    c = state.cache
    B = c.block_len
    importance = state.importance_          # a host copy on the device: read once
    nlb = -(-n_ctx // B)
    imp = np.zeros((len(importance), n_ctx), np.float32)
    for il in range(len(importance)):       # by position (a compacted layer has gaps)
        s = c.slot_count(il)
        blocks, rows = c.slots(0, s, layer=il)
        imp[il, c.positions(il)] = importance[il, blocks, rows].astype(np.float32).sum(-1)
    fig = Figure(figsize=(10, 7))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 1)
    im = axes[0].imshow(np.log1p(imp), aspect="auto", interpolation="nearest", cmap="magma")
    axes[0].set_title("log(1 + importance_) summed over query heads")
    axes[0].set_xlabel("token position")
    axes[0].set_ylabel("layer")
    fig.colorbar(im, ax=axes[0])
    lay = state.sparse_layers[0] if state.sparse_layers else None
    rows = [(s, blk) for s, il, blk in state.selections if il == lay]
    grid = np.zeros((max(len(rows), 1), nlb), np.float32)
    for i, (_, blk) in enumerate(rows):
        grid[i, [b for b in blk if b < nlb]] = 1.0
    axes[1].imshow(grid, aspect="auto", interpolation="nearest", cmap="Greys")
    if lay is None:
        axes[1].set_title("no layer ran sparse (tracking only): no block selections")
    else:
        axes[1].set_title(f"selected blocks per decode step (layer {lay}, first set; "
                          f"last {state.selection_history} steps at most)")
    axes[1].set_xlabel("logical block")
    axes[1].set_ylabel("decode step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
