"""Saved engine state: prompt-cache files (``--prompt-cache``, :meth:`Engine.save_state`).

A state file is a :mod:`pyimp.kv.statefile` container (checksummed sections, entropy coded,
written atomically). Its header holds::

    format "pyimp-kv-state", version 3 (version 2 files load too)
    model       the GGUF fingerprint (:meth:`loaders.gguf_file.GGUFFile.fingerprint`)
    geometry    n_layer, n_head, n_head_kv, head_dim, block_len, type_k, type_v, v_layout,
                kv_rotate, numerics (what the stored values depend on)
    sparse      the SparseOptions fields that shape importance_ / anchor_ (or null)
    n_tokens    tokens (positions) processed
    slots       per layer, the slots it holds (fewer than n_tokens once it dropped tokens)
    max_evicted per layer, the largest position it dropped (-1: none)
    tail_k / tail_v   per layer, the slot block held in the float tail of a quantized side
                (-1: none)
    merged      whether the cache carries slot multiplicities (``--kv-merge``; absent: no)

and its sections, per layer in slot block order (``nlb = ceil(slots / B)``; block ids are
not saved: a loaded state takes fresh physical blocks from the pools)::

    tokens                 int32 [n]
    pos.<il>               int32 [slots]: the position of each slot
    k.<il> / v.<il>        f16 / f32 sides: the layer's blocks token-major, [Hkv][nlb*B][D]
                           (row s = slot s; V is transposed from its channel-major blocks).
                           Version 2 stored the blocks as they are, [Hkv][nlb][B*D].
    k.<il>.head / .qs      quantized sides: block header bytes (d, m, qh) and quant bytes
                           of the stored blocks, split so each compresses on its own
    k.<il>.tail            quantized sides: the float32 tail's valid tokens [Hkv][r][D]
                           (r = slots % B when the tail holds a block, else 0)
    importance.<il>        float16 [nlb][B][Hq] (sparse engines)
    anchor.<il>            float16 [nlb][A][Ha][D] (sparse engines, anchor layers)
    lmul.<il>              float32 [nlb][B]: each slot's log-multiplicity (merged caches;
                           loading one gives the engine's cache the multiplicities, with or
                           without --kv-merge, since attention depends on them)

Loading checks the header (model, geometry, sparse options) before decoding anything and
every section before touching the engine: a file from another model, geometry or version,
a truncated file or a flipped bit raises :class:`StateFileError` naming the file and the
reason, and the engine keeps the state it had.

On a prefix match (:meth:`Engine.prime`) the reused tokens keep their saved
``importance_`` and anchors; the block the cut falls in has its anchors recomputed.

Float16 K/V sections are what the container's ``pred-f16`` codec predicts best: tokens by
channels. For the keys the writer also hands it their RoPE frame (each row's position,
the rotated channel pairs and their frequencies), so it predicts keys in the un-rotated
frame, where channels are far more correlated (not with ``kv_rotate``, whose Hadamard
rotation mixes the pairs). On the default Gemma 3 270M after a 4k prefill the f16 state
file is 1.258x smaller than the 20.25 MB of KV it holds (1.155x with byte-plane zstd) and
loads in 0.3-0.65 s, 3-6 % of the prefill it replaces (``tools/bench_statefile.py``,
``tools/bench_kv.py``).
"""
from __future__ import annotations

import os
import time

import numpy as np

from loaders.quantize import BLOCK_BYTES, CODES

from .cache import FLOAT_TYPES, QUANT_TYPES
from .statefile import Rotary, StateFileError, read_header, read_state, write_state

FORMAT = "pyimp-kv-state"
VERSION = 3
READS = (2, 3)       # version 2: float K/V sections in block layout [Hkv][nlb][B*D]
# bytes of each block type's header fields (d; d, m; d, qh; d, m, qh) before its quants
_HEAD_BYTES = {"q8_0": 2, "q4_0": 2, "q4_1": 4, "q5_0": 6, "q5_1": 8}
_SPARSE_KEYS = ("anchor", "anchor_num", "retrieval", "layer_step", "dense_layers")

__all__ = ["StateFileError", "check", "save", "load"]


def geometry(engine) -> dict:
    cfg, c, o = engine.cfg, engine.cache, engine.options
    return {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_head_kv": cfg.n_head_kv,
            "head_dim": cfg.head_dim, "block_len": c.block_len, "type_k": c.type_k,
            "type_v": c.type_v, "v_layout": c.v_layout, "kv_rotate": bool(o.kv_rotate),
            "numerics": o.numerics}


def _sparse_desc(engine) -> dict | None:
    if engine.sparse is None:
        return None
    o = engine.sparse.opts
    return {k: (list(getattr(o, k)) if k == "dense_layers" else getattr(o, k))
            for k in _SPARSE_KEYS}


def _bsz(kv_type: str) -> int:
    return BLOCK_BYTES[CODES[QUANT_TYPES[kv_type]]]


def _tail_rows(tail: np.ndarray, side: str, r: int, B: int, D: int) -> np.ndarray:
    """The first r tokens of a float tail as [Hkv][r][D] (K tails are token-major, V tails
    channel-major)."""
    if side == "k":
        return np.ascontiguousarray(tail.reshape(-1, B, D)[:, :r])
    return np.ascontiguousarray(tail.reshape(-1, D, B)[:, :, :r].transpose(0, 2, 1))


def _tail_from_rows(rows: np.ndarray, side: str, B: int, D: int) -> np.ndarray:
    Hkv, r = rows.shape[:2]
    if side == "k":
        out = np.zeros((Hkv, B, D), np.float32)
        out[:, :r] = rows
    else:
        out = np.zeros((Hkv, D, B), np.float32)
        out[:, :, :r] = rows.transpose(0, 2, 1)
    return out.reshape(Hkv, B * D)


def _token_major(blocks: np.ndarray, side: str, B: int, D: int) -> np.ndarray:
    """A float side's blocks [Hkv][nlb][B*D] as rows of slots [Hkv][nlb*B][D] (V blocks are
    channel-major: transposed)."""
    Hkv, nlb = blocks.shape[:2]
    if side == "k":
        return np.ascontiguousarray(blocks.reshape(Hkv, nlb * B, D))
    return np.ascontiguousarray(blocks.reshape(Hkv, nlb, D, B).transpose(0, 1, 3, 2)).reshape(
        Hkv, nlb * B, D)


def _blocks(rows: np.ndarray, side: str, B: int, D: int) -> np.ndarray:
    """Inverse of :func:`_token_major`."""
    Hkv, n = rows.shape[:2]
    if side == "k":
        return rows.reshape(Hkv, n // B, B * D)
    return np.ascontiguousarray(rows.reshape(Hkv, n // B, B, D).transpose(0, 1, 3, 2)).reshape(
        Hkv, n // B, D * B)


def _rope_frame(engine, il: int, positions: np.ndarray, n_rows: int) -> Rotary | None:
    """The RoPE frame of layer ``il``'s stored keys (rows past the slots get the positions
    that would follow), or None where the keys are Hadamard-rotated or their rotation is not a
    plain angle per pair times the position (YaRN's mixed angles, a scaled cos / sin)."""
    cfg = engine.cfg
    rope = cfg.layer_rope(il)
    if (engine.options.kv_rotate or cfg.rope_dim < 2 or rope["ext_factor"] != 0.0
            or rope["attn_factor"] != 1.0):
        return None
    half = cfg.rope_dim // 2
    ratio = np.float32(np.float64(cfg.layer_rope_base(il)) ** (-2.0 / cfg.rope_dim))
    theta = np.empty(half, np.float32)
    t = np.float32(cfg.layer_rope_scale(il))
    for i in range(half):            # the float32 recurrence of the angles' scales, as ggml
        theta[i] = t
        t = np.float32(t * ratio)
    freqs = engine.weights.rope_freqs
    if freqs is not None:
        theta = theta / np.asarray(freqs, np.float32)[:half]
    i = np.arange(half)
    pairs = np.stack([i, i + half] if engine.weights.arch.rope_neox else [2 * i, 2 * i + 1], 1)
    pos = np.asarray(positions, np.int64)
    last = int(pos[-1]) if pos.size else -1
    rows = np.concatenate([pos, last + 1 + np.arange(n_rows - pos.size, dtype=np.int64)])
    return Rotary(rows, theta, pairs)


def save(engine, path: str | os.PathLike, level: int | None = None) -> dict:
    """Write the engine's cached tokens, KV, importance_ and anchors to ``path`` (atomic);
    ``level``: :func:`pyimp.kv.statefile.write_state`'s zstd level (None: its default, 0: raw)."""
    c = engine.cache
    n = len(engine.tokens)
    B = c.block_len
    slots = [c.slot_count(il) for il in range(c.n_layer)]
    tables = [c.table(il)[:-(-s // B)].astype(np.int64) for il, s in enumerate(slots)]
    arrays: dict[str, np.ndarray] = {"tokens": np.asarray(engine.tokens, dtype=np.int32)}
    for il in range(c.n_layer):
        arrays[f"pos.{il}"] = np.ascontiguousarray(c.positions(il))
    tails: dict[str, list] = {}
    frames: dict[str, Rotary] = {}
    for side, kv_type in (("k", c.type_k), ("v", c.type_v)):
        store = c.k_store if side == "k" else c.v_store
        tails[side] = []
        for il in range(c.n_layer):
            bt = tables[il]
            blocks = store[il][:, bt]
            if kv_type in FLOAT_TYPES:
                arrays[f"{side}.{il}"] = _token_major(blocks, side, B, c.head_dim)
                if side == "k":
                    frame = _rope_frame(engine, il, c.positions(il), len(bt) * B)
                    if frame is not None:
                        frames[f"k.{il}"] = frame
                continue
            view = c.layer(side, il)
            tail_lb = int(np.flatnonzero(bt == view.tail_block)[0]) if view.tail_block in bt else -1
            tails[side].append(tail_lb)
            if tail_lb >= 0:          # the tail block's stored bytes are stale: not saved
                blocks = blocks.copy()
                blocks[:, tail_lb] = 0
            rows = blocks.reshape(-1, _bsz(kv_type))
            hb = _HEAD_BYTES[kv_type]
            arrays[f"{side}.{il}.head"] = np.ascontiguousarray(rows[:, :hb].T)
            arrays[f"{side}.{il}.qs"] = np.ascontiguousarray(rows[:, hb:])
            arrays[f"{side}.{il}.tail"] = _tail_rows(
                view.tail, side, slots[il] % B if tail_lb >= 0 else 0, B, c.head_dim)
    sp = engine.sparse
    if sp is not None:
        for il in range(c.n_layer):
            arrays[f"importance.{il}"] = sp.importance_[il, tables[il]]
        for il in sp.anchor_.layers:
            arrays[f"anchor.{il}"] = sp.anchor_.storage(il)[tables[il]]
    if c.lmul is not None:           # merged slots' log-multiplicities (pyimp.kv.merge)
        for il in range(c.n_layer):
            arrays[f"lmul.{il}"] = np.ascontiguousarray(c.lmul[il, tables[il]])
    header = {"format": FORMAT, "version": VERSION, "model": engine.file.fingerprint(),
              "geometry": geometry(engine), "sparse": _sparse_desc(engine), "n_tokens": n,
              "slots": slots, "max_evicted": [int(x) for x in c.max_evicted[0]],
              "tail_k": tails["k"], "tail_v": tails["v"], "merged": c.lmul is not None}
    return write_state(path, header, arrays, level=level, rotary=frames)


def _check_header(engine, path, header: dict) -> None:
    def fail(why):
        raise StateFileError(path, why)
    if header.get("format") != FORMAT:
        fail(f"not a pyimp KV state (format {header.get('format')!r})")
    if header.get("version") not in READS:
        fail(f"state version {header.get('version')!r} is not supported (this build reads "
             f"{', '.join(map(str, READS))})")
    saved_model = str(header.get("model"))
    if saved_model != engine.file.fingerprint():
        if not saved_model.startswith("sha256-file:"):
            fail("saved by an earlier pyimp whose model fingerprint sampled the weights instead "
                 "of hashing them all: it cannot be checked against this model; delete it and "
                 "let the next run write it again")
        fail(f"saved from another model (fingerprint {saved_model[:24]}..., this "
             f"model {engine.file.fingerprint()[:24]}...)")
    want = geometry(engine)
    got = header.get("geometry") or {}
    for key, val in want.items():
        if got.get(key) != val:
            fail(f"saved with {key} = {got.get(key)!r}, this engine has {val!r}")
    if header.get("sparse") != _sparse_desc(engine):
        fail(f"saved with sparse options {header.get('sparse')}, this engine has "
             f"{_sparse_desc(engine)}")
    n = header.get("n_tokens")
    if not isinstance(n, int) or not 0 <= n <= engine.n_ctx:
        fail(f"{n!r} tokens do not fit this engine's context size {engine.n_ctx}")
    L = engine.cfg.n_layer
    for key, lo in (("slots", 0), ("max_evicted", -1)):
        v = header.get(key)
        if not isinstance(v, list) or len(v) != L or not all(isinstance(x, int) and lo <= x <= n
                                                              for x in v):
            fail(f"bad {key} {v!r}")
    cap = engine.cache.max_slots
    big = [il for il, s in enumerate(header["slots"]) if s > cap]
    if big:
        fail(f"layer {big[0]} holds {header['slots'][big[0]]} tokens, this engine's layers hold "
             f"at most {cap} (a larger --kv-budget or context size)")


def check(engine, path: str | os.PathLike) -> dict:
    """The header of the state file at ``path`` once it is found to fit ``engine`` (model,
    geometry, sparse options, token and slot counts); reads only the header (no section is
    decoded) and raises :class:`StateFileError` naming the file and the reason."""
    header = read_header(path)
    _check_header(engine, path, header)
    return header


def load(engine, path: str | os.PathLike) -> int:
    """Replace the engine's state by the one saved at ``path``; returns the tokens loaded."""
    t0 = time.perf_counter()
    _check_header(engine, path, read_header(path))
    header, arrays = read_state(path)
    _check_header(engine, path, header)
    c = engine.cache
    n, B = header["n_tokens"], c.block_len
    slots = header["slots"]
    nlbs = [-(-s // B) for s in slots]
    Hkv, D, L = c.n_head_kv, c.head_dim, c.n_layer

    def need(name, shape, dtype):
        a = arrays.get(name)
        if a is None or a.shape != tuple(shape) or a.dtype != np.dtype(dtype):
            got = "missing" if a is None else f"{a.dtype} {a.shape}"
            raise StateFileError(path, f"section {name!r} is {got}, expected "
                                       f"{np.dtype(dtype)} {tuple(shape)}")
        return a

    tokens = need("tokens", (n,), np.int32)
    if n and (tokens.min() < 0 or tokens.max() >= engine.cfg.n_vocab):
        raise StateFileError(path, "token ids outside the vocabulary")
    positions = []
    for il in range(L):
        p = need(f"pos.{il}", (slots[il],), np.int32)
        if p.size and (p[0] < 0 or p[-1] >= n or not (np.diff(p) > 0).all()):
            raise StateFileError(path, f"slot positions of layer {il} are not increasing in 0..{n - 1}")
        positions.append(p)
    sides = {}
    for side, kv_type in (("k", c.type_k), ("v", c.type_v)):
        per = []
        tails = header.get(f"tail_{side}")
        if kv_type in FLOAT_TYPES:
            for il in range(L):
                if header["version"] == 2:
                    per.append(need(f"{side}.{il}", (Hkv, nlbs[il], B * D), FLOAT_TYPES[kv_type]))
                else:
                    rows = need(f"{side}.{il}", (Hkv, nlbs[il] * B, D), FLOAT_TYPES[kv_type])
                    per.append(_blocks(rows, side, B, D))
        else:
            if not isinstance(tails, list) or len(tails) != L or \
                    not all(isinstance(t, int) and -1 <= t < nb for t, nb in zip(tails, nlbs)):
                raise StateFileError(path, f"bad tail_{side} {tails!r}")
            store = c.k_store if side == "k" else c.v_store
            hb = _HEAD_BYTES[kv_type]
            for il in range(L):
                nrows = Hkv * nlbs[il] * store.shape[3] // _bsz(kv_type)
                head = need(f"{side}.{il}.head", (hb, nrows), np.uint8)
                qs = need(f"{side}.{il}.qs", (nrows, _bsz(kv_type) - hb), np.uint8)
                r = slots[il] % B if tails[il] >= 0 else 0
                rows = need(f"{side}.{il}.tail", (Hkv, r, D), np.float32)
                per.append((np.concatenate([head.T, qs], axis=1).reshape(Hkv, nlbs[il], -1),
                            _tail_from_rows(rows, side, B, D), tails[il]))
        sides[side] = per
    sp = engine.sparse
    if sp is not None:
        imp = [need(f"importance.{il}", (nlbs[il],) + sp.importance_.shape[2:], np.float16)
               for il in range(L)]
        anchors = {il: need(f"anchor.{il}", (nlbs[il],) + sp.anchor_.storage(il).shape[1:],
                            np.float16)
                   for il in sp.anchor_.layers}
    lmul = None
    if header.get("merged"):
        lmul = [need(f"lmul.{il}", (nlbs[il], B), np.float32) for il in range(L)]
        if any(not (np.isfinite(x).all() and (x >= 0).all()) for x in lmul):
            raise StateFileError(path, "a slot multiplicity (lmul) is negative or not finite")
    # everything checked: now replace the engine's state
    engine.reset()
    c.install(n, positions, header["max_evicted"])
    tables = [c.table(il)[:nb].astype(np.int64) for il, nb in enumerate(nlbs)]
    for side, per in sides.items():
        store = c.k_store if side == "k" else c.v_store
        for il, item in enumerate(per):
            bt = tables[il]
            if isinstance(item, np.ndarray):
                store[il][:, bt] = item
                continue
            data, tail, tail_lb = item
            store[il][:, bt] = data
            c.set_tail(side, il, tail, int(bt[tail_lb]) if tail_lb >= 0 else -1)
    if lmul is not None:
        c.enable_merging()
    if c.lmul is not None:
        c.lmul[:] = 0
        for il in range(L if lmul is not None else 0):
            c.lmul[il, tables[il]] = lmul[il]
    engine.tokens = [int(t) for t in tokens]
    if sp is not None:
        for il in range(L):
            sp.importance_[il, tables[il]] = imp[il]
        for il, a in anchors.items():
            sp.anchor_.storage(il)[tables[il]] = a
        sp.restored(n)
    engine.timings.extra["state_load_s"] = time.perf_counter() - t0
    return n
