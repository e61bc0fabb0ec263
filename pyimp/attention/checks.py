"""Argument checks at the Python boundary of the attention and sparse kernels.

Numba kernels do not bounds-check and take fp16 buffers as ``uint16`` bits:
a float32 importance matrix would be read as garbage, a ``-1`` block-table
entry would wrap to the last block, and a short output buffer would be
written past its end. Every public entry point calls these helpers first;
each raises one ``ValueError`` naming the argument and the value it got.
The checks look at dtypes and shapes (free) and at the block ids actually
used (a min/max over a few entries).
"""
from __future__ import annotations

import numpy as np

KV_DTYPES = (np.float16, np.float32)


def _desc(a) -> str:
    if not isinstance(a, np.ndarray):
        return type(a).__name__
    return f"{a.dtype} array of shape {a.shape}"


def array(name: str, a, dtypes, ndim: int | None = None, shape: tuple | None = None,
          layout: str = "") -> np.ndarray:
    """``a`` must be an ndarray of one of ``dtypes`` with ``ndim`` dims / ``shape`` (None entries
    are free); ``layout`` names the documented layout in the message."""
    dts = tuple(np.dtype(d) for d in (dtypes if isinstance(dtypes, (tuple, list)) else (dtypes,)))
    ok = isinstance(a, np.ndarray) and a.dtype in dts
    if ok and ndim is not None:
        ok = a.ndim == ndim
    if ok and shape is not None:
        ok = a.ndim == len(shape) and all(w is None or w == g for w, g in zip(shape, a.shape))
    if not ok:
        want = " or ".join(str(d) for d in dts)
        if shape is not None:
            want += " of shape (" + ", ".join("*" if w is None else str(w) for w in shape) + \
                    ("," if len(shape) == 1 else "") + ")"
        elif ndim is not None:
            want += f" with {ndim} dimensions"
        if layout:
            want += f" {layout}"
        raise ValueError(f"{name} must be a {want}, got {_desc(a)}")
    return a


def writable(name: str, a: np.ndarray) -> None:
    if not a.flags.writeable:
        raise ValueError(f"{name} must be writable (the kernel writes into it)")


def kv_cache(k_cache, v_cache) -> tuple[int, int, int]:
    """(Hkv, NB, B*D) of a layer's K and V caches (float arrays or quantized layers)."""
    from pyimp.kv.cache import QuantizedKV
    shape = None
    for name, c, side, lay in (("k_cache", k_cache, "k", "[Hkv][NB][B*D]"),
                               ("v_cache", v_cache, "v", "[Hkv][NB][D*B]")):
        if isinstance(c, QuantizedKV):
            if c.side != side:
                raise ValueError(f"{name} must be a {side.upper()} layer, got a quantized "
                                 f"{c.side.upper()} layer")
        else:
            array(name, c, KV_DTYPES, 3, shape=shape, layout=lay)
        if shape is not None and tuple(c.shape) != shape:
            raise ValueError(f"{name} of shape {tuple(c.shape)} does not match k_cache's {shape}")
        shape = tuple(c.shape)
    return shape


def query(name: str, q, Hkv: int, BD: int, rows: bool = False) -> tuple[int, int]:
    """(Hq, D) of a query float [Hq, D] (or [T, Hq, D] with ``rows``) against the cache."""
    nd = 3 if rows else 2
    if not isinstance(q, np.ndarray) or q.ndim != nd or not np.issubdtype(q.dtype, np.floating):
        lay = "[T, Hq, D]" if rows else "[Hq, D]"
        raise ValueError(f"{name} must be a float array {lay}, got {_desc(q)}")
    Hq, D = q.shape[-2:]
    if Hq == 0 or Hq % Hkv:
        raise ValueError(f"{name} has {Hq} query heads, not a positive multiple of the cache's "
                         f"{Hkv} kv heads")
    if D == 0 or BD % D:
        raise ValueError(f"{name} has head dim {D}, which does not divide the cache's block row "
                         f"of {BD} values (B*D)")
    return Hq, D


def block_table(bt, n_lb: int, NB: int, name: str = "block_table") -> None:
    """bt int32 [>= n_lb]; entries 0..n_lb-1 must be physical ids in [0, NB)."""
    array(name, bt, np.int32, 1, layout="[NB_logical]")
    if n_lb > bt.shape[0]:
        raise ValueError(f"{name} has {bt.shape[0]} entries but {n_lb} logical blocks are used")
    if n_lb:
        used = bt[:n_lb]
        lo, hi = int(used.min()), int(used.max())
        if lo < 0 or hi >= NB:
            i = int(np.argmax((used < 0) | (used >= NB)))
            raise ValueError(f"{name}[{i}] = {int(used[i])} is not a physical block id "
                             f"(0..{NB - 1}): logical block {i} is not reserved")


def importance(imp, NB: int, B: int, Hq: int, name: str = "importance") -> None:
    array(name, imp, np.float16, shape=(NB, B, Hq), layout="[NB][B][Hq]")
    writable(name, imp)


def count(name: str, n: int, lo: int, hi: int) -> int:
    n = int(n)
    if not lo <= n <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {n}")
    return n


def selection(sel, cnt, Hq: int, G: int, n_lb: int) -> None:
    """sel int32 [nsets, K], cnt int32 [nsets]: distinct logical blocks < n_lb per set."""
    array("sel", sel, np.int32, 2, layout="[nsets, K]")
    nsets, K = sel.shape
    array("cnt", cnt, np.int32, shape=(nsets,), layout="[nsets]")
    if nsets == 0 or Hq % nsets:
        raise ValueError(f"sel has {nsets} sets, which does not divide the {Hq} query heads")
    hps = Hq // nsets
    if hps % G and G % hps:
        raise ValueError(f"sel has {nsets} sets of {hps} query heads: a set must hold whole GQA "
                         f"groups of {G} heads or part of one")
    if nsets and (int(cnt.min()) < 0 or int(cnt.max()) > K):
        i = int(np.argmax((cnt < 0) | (cnt > K)))
        raise ValueError(f"cnt[{i}] = {int(cnt[i])} is outside [0, {K}] (the width of sel)")
    live = np.arange(K)[None, :] < cnt[:, None]
    if live.any():
        vals = sel[live]
        if int(vals.min()) < 0 or int(vals.max()) >= n_lb:
            bad = int(vals[(vals < 0) | (vals >= n_lb)][0])
            raise ValueError(f"sel holds logical block {bad}, outside 0..{n_lb - 1} "
                             f"(the blocks of the context)")
        # unique per row: pad the dead entries with distinct negatives, sort, look for repeats
        x = np.sort(np.where(live, sel, -1 - np.arange(K)[None, :]), axis=1)
        if (np.diff(x, axis=1) == 0).any():
            row = int(np.argmax((np.diff(x, axis=1) == 0).any(axis=1)))
            raise ValueError(f"sel[{row}] lists a block twice: {sel[row, :cnt[row]].tolist()}")


def positions(pos, n: int) -> None:
    """``pos``: int32 slot -> position of at least ``n`` slots, strictly increasing."""
    array("positions", pos, np.int32, 1, layout="[slots] (slot -> position)")
    if pos.shape[0] < n:
        raise ValueError(f"positions holds {pos.shape[0]} slots, the call reads {n}")
    if n > 1 and not (np.diff(pos[:n]) > 0).all():
        raise ValueError("positions must increase with the slot (slots are kept in position order)")
