"""Compression candidates for the state-file format, measured on a real KV cache.

Builds the data kinds a saved engine state holds, from the default model (Gemma 3 270M)
after a prefill of about 4000 tokens of real text:

* ``k f16`` / ``v f16``: the float16 K and V planes of the used blocks (``kv_type="f16"``),
* ``k f32`` / ``v f32``: the same from a second run with ``kv_type="f32"``,
* ``q8_0 codes`` / ``q8_0 scales``, ``q4_0 codes`` / ``q4_0 scales``: the f16 keys (and
  values) quantized with ``gguf.quants.quantize`` and each block split into its fp16 scale
  and its code bytes (int8 values, or packed 4-bit nibbles),
* ``importance f16``: the sparse-attention importance matrix,
* ``tokens i32`` / ``block table i32``: the small integer arrays,

then times every candidate codec on each: plain zstd, a NumPy byte-plane shuffle followed
by zstd, blosc2 (SHUFFLE / BITSHUFFLE / SHUFFLE+BYTEDELTA filters with ZSTD, one thread)
and, for uint8 planes, an order-0 ANS coder (``constriction``) whose model is the plane's
own byte histogram (stored with the payload and counted in its size). It prints one row
per (data kind, codec): compression ratio (raw / stored bytes), compression and
decompression speed in MB/s of raw bytes (best of ``--reps``; single thread), and ends
with an end-to-end ``write_state`` / ``read_state`` timing of the whole f16 state.

    python -m tools.bench_statefile [--data NPZ] [--save-data NPZ] [--reps 3] [--tokens 4000]

``--data`` reads the arrays from an ``.npz`` written earlier by ``--save-data`` instead of
running the model (two prefills). Optional codec libraries that are not installed are
reported and skipped.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tools.bench import cpu_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# ---------------------------------------------------------------------- data
def _stores(cache) -> tuple[np.ndarray, np.ndarray]:
    """The cache's K and V float buffers ``[L][Hkv][NB][...]``: ``k_store`` / ``v_store``
    where the cache names its buffer in use (an array or an attribute name), else the
    ``k_cache_fp16_`` / ``v_cache_fp16_`` buffers (which hold the kv_type's dtype)."""
    out = []
    for side in ("k", "v"):
        store = getattr(cache, f"{side}_store", None)
        if isinstance(store, str):
            store = getattr(cache, store)
        out.append(store if isinstance(store, np.ndarray) else getattr(cache, f"{side}_cache_fp16_"))
    return out[0], out[1]


def _prefill(kv_type: str, n_tokens: int, sparse: bool) -> dict[str, np.ndarray]:
    """K/V planes (used blocks only) and, with ``sparse``, the importance matrix, tokens and
    block table of the default model after a prefill of ``n_tokens`` of the README."""
    import pyimp
    eng = pyimp.load(None, n_ctx=max(4096, n_tokens + 64), kv_type=kv_type, sparse=sparse)
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    toks = eng.tokenize(text * (1 + 4 * n_tokens // max(1, len(text))))[:n_tokens]
    t0 = time.perf_counter()
    eng.eval(toks)
    print(f"# prefill of {len(toks)} tokens (kv_type {kv_type}): {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    cache = eng.cache
    n = int(cache.cache_seqlens[0])
    ids = cache.table(0)[:-(-n // cache.block_len)]
    k_store, v_store = _stores(cache)
    out = {"k": k_store[:, :, ids].copy(), "v": v_store[:, :, ids].copy()}
    if sparse:
        out["imp"] = eng.sparse.importance_[:, ids].copy()
        out["tokens"] = np.asarray(eng.tokens, dtype=np.int32)
        out["block_table"] = ids.astype(np.int32)
    return out


def load_arrays(data: str | None, save: str | None, n_tokens: int) -> dict[str, np.ndarray]:
    """The real arrays: from ``data`` (an npz) or from two prefills of the default model."""
    if data:
        with np.load(data) as z:
            return {k: z[k] for k in z.files}
    f16 = _prefill("f16", n_tokens, sparse=True)
    f32 = _prefill("f32", n_tokens, sparse=False)
    arrays = {"k16": f16["k"], "v16": f16["v"], "imp": f16["imp"], "tokens": f16["tokens"],
              "block_table": f16["block_table"], "k32": f32["k"], "v32": f32["v"]}
    if save:
        np.savez(save, **arrays)
    return arrays


def split_blocks(x: np.ndarray, qtype_name: str) -> tuple[np.ndarray, np.ndarray]:
    """Quantize ``x`` (any float array whose size is a multiple of 32) to a ggml block type
    and split the blocks into their fp16 scales and their code bytes."""
    import gguf
    from gguf.quants import quantize
    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    q = quantize(x.reshape(-1, 256).astype(np.float32), qtype)
    block = {"Q8_0": 34, "Q4_0": 18}[qtype_name]
    blocks = q.reshape(-1, block)
    return blocks[:, :2].copy().view(np.float16).reshape(-1), blocks[:, 2:].copy()


def data_kinds(arrays: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """(label, array) pairs of every data kind benchmarked."""
    kinds = [("k f16", arrays["k16"]), ("v f16", arrays["v16"]),
             ("k f32", arrays["k32"]), ("v f32", arrays["v32"])]
    for qt in ("Q8_0", "Q4_0"):
        for name in ("k16", "v16"):
            scales, codes = split_blocks(arrays[name], qt)
            kinds += [(f"{name[0]} {qt.lower()} codes", codes), (f"{name[0]} {qt.lower()} scales", scales)]
    kinds += [("importance f16", arrays["imp"]), ("tokens i32", arrays["tokens"]),
              ("block table i32", arrays["block_table"])]
    return kinds


# -------------------------------------------------------------------- codecs
@dataclass
class Codec:
    name: str
    encode: Callable[[np.ndarray], bytes]
    decode: Callable[[bytes, np.ndarray], np.ndarray]    # (stored, like) -> array
    applies: Callable[[np.ndarray], bool] = lambda a: True


def _shuffle(a: np.ndarray) -> np.ndarray:
    """Bytes of ``a`` regrouped as byte planes (all first bytes, then all second bytes...)."""
    n = a.dtype.itemsize
    return np.ascontiguousarray(a.reshape(-1).view(np.uint8).reshape(-1, n).T)


def _unshuffle(planes: bytes, like: np.ndarray) -> np.ndarray:
    n = like.dtype.itemsize
    b = np.frombuffer(planes, dtype=np.uint8).reshape(n, -1)
    out = np.empty((b.shape[1], n), dtype=np.uint8)
    for i in range(n):                  # one strided copy per plane: faster than b.T
        out[:, i] = b[i]
    return out.view(like.dtype).reshape(like.shape)


def zstd_codecs(levels: list[int]) -> list[Codec]:
    import zstandard
    out = []
    for lv in levels:
        cctx = zstandard.ZstdCompressor(level=lv)
        dctx = zstandard.ZstdDecompressor()
        out.append(Codec(
            f"zstd-{lv}", lambda a, c=cctx: c.compress(a.tobytes()),
            lambda s, like, d=dctx: np.frombuffer(d.decompress(s), like.dtype).reshape(like.shape).copy()))
        out.append(Codec(
            f"shuffle+zstd-{lv}", lambda a, c=cctx: c.compress(_shuffle(a)),
            lambda s, like, d=dctx: _unshuffle(d.decompress(s), like),
            applies=lambda a: a.dtype.itemsize > 1))
    return out


def blosc2_codecs(levels: list[int]) -> list[Codec]:
    import blosc2
    blosc2.set_nthreads(1)
    filters = {"shuffle": [blosc2.Filter.SHUFFLE],
               "bitshuffle": [blosc2.Filter.BITSHUFFLE],
               "shuffle+bytedelta": [blosc2.Filter.SHUFFLE, blosc2.Filter.BYTEDELTA]}
    out = []
    for fname, flist in filters.items():
        for lv in levels:
            def enc(a: np.ndarray, flist=flist, lv=lv) -> bytes:
                cparams = {"codec": blosc2.Codec.ZSTD, "clevel": lv, "filters": flist,
                           "typesize": a.dtype.itemsize, "nthreads": 1}
                return blosc2.SChunk(data=a.tobytes(), cparams=cparams,
                                     dparams={"nthreads": 1}).to_cframe()

            def dec(s: bytes, like: np.ndarray) -> np.ndarray:
                sc = blosc2.schunk_from_cframe(s, copy=False)
                return np.frombuffer(sc[:], like.dtype).reshape(like.shape).copy()
            out.append(Codec(f"blosc2 {fname}+zstd-{lv}", enc, dec))
    return out


def ans_codec() -> Codec:
    """Order-0 ANS over bytes; the payload is the 256-entry uint32 histogram followed by
    the coder's uint32 words."""
    import constriction

    def enc(a: np.ndarray) -> bytes:
        sym = a.reshape(-1).view(np.uint8)
        hist = np.bincount(sym, minlength=256).astype(np.uint32)
        model = constriction.stream.model.Categorical(hist.astype(np.float64), perfect=False)
        coder = constriction.stream.stack.AnsCoder()
        coder.encode_reverse(sym.astype(np.int32), model)
        return hist.tobytes() + coder.get_compressed().tobytes()

    def dec(s: bytes, like: np.ndarray) -> np.ndarray:
        hist = np.frombuffer(s[:1024], dtype=np.uint32)
        words = np.frombuffer(s[1024:], dtype=np.uint32)
        model = constriction.stream.model.Categorical(hist.astype(np.float64), perfect=False)
        coder = constriction.stream.stack.AnsCoder(words.copy())
        return coder.decode(model, like.size).astype(np.uint8).reshape(like.shape)

    return Codec("ans order-0", enc, dec, applies=lambda a: a.dtype == np.uint8)


def all_codecs(zstd_levels: list[int], blosc_levels: list[int]) -> list[Codec]:
    codecs = [Codec("raw", lambda a: a.tobytes(),
                    lambda s, like: np.frombuffer(s, like.dtype).reshape(like.shape).copy())]
    for make, args, lib in ((zstd_codecs, (zstd_levels,), "zstandard"),
                            (blosc2_codecs, (blosc_levels,), "blosc2"),
                            (ans_codec, (), "constriction")):
        try:
            got = make(*args)
        except ImportError:
            print(f"# {lib} is not installed: its candidates are skipped", file=sys.stderr)
            continue
        codecs += got if isinstance(got, list) else [got]
    return codecs


# --------------------------------------------------------------------- timing
def best_time(fn: Callable[[], object], reps: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def measure(label: str, a: np.ndarray, codec: Codec, reps: int) -> tuple[str, str, float, float, float]:
    tc, stored = best_time(lambda: codec.encode(a), reps)
    td, back = best_time(lambda: codec.decode(stored, a), reps)
    if back.dtype != a.dtype or back.shape != a.shape or back.tobytes() != a.tobytes():
        raise SystemExit(f"error: {codec.name} did not round-trip {label}")
    mb = a.nbytes / 1e6
    return label, codec.name, a.nbytes / max(1, len(stored)), mb / tc, mb / td


def end_to_end(arrays: dict[str, np.ndarray], reps: int) -> None:
    """write_state / read_state of the whole f16 state (K, V, importance, tokens, table)."""
    from pyimp.statefile import read_state, write_state
    named = {"tokens": arrays["tokens"], "block_table": arrays["block_table"],
             "importance": arrays["imp"]}
    for il in range(arrays["k16"].shape[0]):
        named[f"k.{il}"] = arrays["k16"][il]
        named[f"v.{il}"] = arrays["v16"][il]
    raw = sum(a.nbytes for a in named.values())
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "state.pkv")
        tw, _ = best_time(lambda: write_state(path, {"bench": True}, named), reps)
        tr, (_, back) = best_time(lambda: read_state(path), reps)
        size = os.path.getsize(path)
    assert all(back[k].tobytes() == named[k].tobytes() for k in named)
    print(f"\nstatefile end to end ({len(named)} sections, {raw / 1e6:.1f} MB raw -> "
          f"{size / 1e6:.1f} MB, ratio {raw / size:.3f}): write {tw:.2f} s "
          f"({raw / 1e6 / tw:.0f} MB/s), read {tr:.2f} s ({raw / 1e6 / tr:.0f} MB/s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="read the arrays from this npz instead of running the model")
    p.add_argument("--save-data", help="save the arrays the model produced to this npz")
    p.add_argument("--tokens", type=int, default=4000, help="prefill length (default 4000)")
    p.add_argument("--reps", type=int, default=3, help="repetitions, best kept (default 3)")
    p.add_argument("--zstd-levels", default="-1,1,3,9", help="zstd levels (default -1,1,3,9)")
    p.add_argument("--blosc-levels", default="1,5", help="blosc2 clevels (default 1,5)")
    p.add_argument("--only", default="", help="comma-separated substrings of data kinds to run")
    p.add_argument("--no-end-to-end", action="store_true", help="skip the write/read_state row")
    args = p.parse_args(argv)

    arrays = load_arrays(args.data, args.save_data, args.tokens)
    codecs = all_codecs([int(x) for x in args.zstd_levels.split(",")],
                        [int(x) for x in args.blosc_levels.split(",")])
    only = [s for s in args.only.split(",") if s]
    print(f"# CPU: {cpu_model()}; single-threaded codecs; MB = 1e6 bytes of raw data")
    print(f"{'data kind':<18} {'MB':>7} {'codec':<30} {'ratio':>7} {'comp MB/s':>10} {'decomp MB/s':>12}")
    for label, a in data_kinds(arrays):
        if only and not any(s in label for s in only):
            continue
        for codec in codecs:
            if not codec.applies(a):
                continue
            _, name, ratio, c, d = measure(label, a, codec, args.reps)
            print(f"{label:<18} {a.nbytes / 1e6:>7.2f} {name:<30} {ratio:>7.3f} {c:>10.0f} {d:>12.0f}",
                  flush=True)
    if not args.no_end_to_end:
        end_to_end(arrays, args.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
