"""Compression candidates for the state-file format, measured on a real KV cache.

Takes the sections a saved engine state holds (``Engine.save_state``, read back) from the
default model (Gemma 3 270M) after a prefill of ``--tokens`` (default 4032) tokens of
real text (Python's pydoc topics, as ``tools.bench_kv``):

* ``k f16`` / ``v f16``: per layer, the float16 K and V of the blocks the layer holds,
  token-major ``[Hkv][slots][D]`` as the state file stores them (Gemma's sliding-window
  layers hold only their 512-slot window), and the keys' RoPE frames,
* ``k f32`` / ``v f32``: the same from a second run with ``kv_type="f32"``,
* ``q8_0 codes`` / ``q8_0 scales``, ``q4_0 codes`` / ``q4_0 scales``: the f16 keys (and
  values) of each layer quantized with ``gguf.quants.quantize`` and each block split into
  its fp16 scale and its code bytes (int8 values, or packed 4-bit nibbles),
* ``importance f16`` (per layer, tracked as a sparse engine does), ``tokens i32``,
  ``positions i32`` (per layer),

then times every candidate codec on each. Every candidate codes each layer's array on its
own, as the state file does; a row gives the kind's total raw bytes over its total stored
bytes, and encoding / decoding speed in MB/s of raw bytes over all its arrays (best of
``--reps``; one thread). Candidates: plain zstd; byte-plane shuffle + zstd (the state
file's codec 2); ``delta`` and ``xor`` + shuffle + zstd (each value against the same
channel's previous row: the difference of the float bit patterns mapped to ordered
integers, or their XOR); ``pred-f16`` (:mod:`pyimp.kv.floatcodec`, the state file's codec 3)
without and with the keys' RoPE frame (``+rope``); and, where installed, blosc2
(SHUFFLE / BITSHUFFLE / SHUFFLE+BYTEDELTA filters with ZSTD, one thread) and, for uint8
planes, an order-0 ANS coder (``constriction``) whose model is the plane's own byte
histogram (stored with the payload and counted in its size). It ends with an end-to-end
``write_state`` / ``read_state`` of the whole f16 state as ``Engine.save_state`` writes
it (a dense engine's: tokens, positions, K, V): its ratio against the raw bytes of all
sections and of the KV sections alone (the bytes the cache holds), the KV sections' own
ratio, and the times.

    python -m tools.bench_statefile [--data NPZ] [--save-data NPZ] [--reps 3] [--tokens 4032]

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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tools.bench import cpu_model  # noqa: E402


# ---------------------------------------------------------------------- data
def _prefill(kv_type: str, n_tokens: int) -> dict[str, np.ndarray]:
    """The sections of the state of the default model after a prefill of ``n_tokens`` of
    pydoc text, and per layer the keys' RoPE frame (``theta.<il>``, ``pairs.<il>``)."""
    import pyimp
    from pyimp.kv import state
    from pyimp.kv.statefile import read_state
    from tools.eval_sparse import pydoc_text
    eng = pyimp.load(None, n_ctx=n_tokens + 64, kv_type=kv_type, track=True)
    toks = [eng.cfg.bos_id] + eng.tokenize(pydoc_text(), add_bos=False)[:n_tokens - 1]
    eng.warmup()
    t0 = time.perf_counter()
    eng.eval(toks)
    print(f"# prefill of {len(toks)} tokens (kv_type {kv_type}): {time.perf_counter() - t0:.1f} s; "
          f"KV held {eng.cache.bytes_held() / 1e6:.2f} MB", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "state.pkv")
        eng.save_state(path)
        header, arrays = read_state(path)
    c = eng.cache
    for il in range(c.n_layer):
        frame = state._rope_frame(eng, il, c.positions(il), arrays[f"k.{il}"].shape[1])
        if frame is not None:
            arrays[f"theta.{il}"] = frame.theta
            arrays[f"pairs.{il}"] = frame.pairs
    arrays["n_layer"] = np.array(c.n_layer)
    eng.close()
    return arrays


def load_arrays(data: str | None, save: str | None, n_tokens: int) -> dict[str, np.ndarray]:
    """The real arrays: from ``data`` (an npz) or from two prefills of the default model
    (f16 sections as they are, f32 ones prefixed ``f32:``)."""
    if data:
        with np.load(data) as z:
            return {k: z[k] for k in z.files}
    arrays = _prefill("f16", n_tokens)
    f32 = _prefill("f32", n_tokens)
    arrays.update({f"f32:{k}": f32[k] for k in f32 if k.startswith(("k.", "v."))})
    if save:
        np.savez(save, **arrays)
    return arrays


def split_blocks(x: np.ndarray, qtype_name: str) -> tuple[np.ndarray, np.ndarray]:
    """Quantize ``x`` (any float array whose size is a multiple of 32) to a ggml block type
    and split the blocks into their fp16 scales and their code bytes."""
    import gguf
    from gguf.quants import quantize
    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    q = quantize(x.reshape(-1, 32).astype(np.float32), qtype)
    block = {"Q8_0": 34, "Q4_0": 18}[qtype_name]
    blocks = q.reshape(-1, block)
    return blocks[:, :2].copy().view(np.float16).reshape(-1), blocks[:, 2:].copy()


@dataclass
class Kind:
    label: str
    arrays: list[np.ndarray]          # one per section, coded each on its own
    frames: list | None = None        # the keys' RoPE frames (floatcodec.Rotary), per section

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


def data_kinds(arrays: dict[str, np.ndarray]) -> list[Kind]:
    """Every data kind benchmarked."""
    from pyimp.kv.floatcodec import Rotary
    L = int(arrays["n_layer"])
    frames = []
    for il in range(L):
        if f"theta.{il}" in arrays:
            frames.append(Rotary(arrays[f"pos.{il}"], arrays[f"theta.{il}"], arrays[f"pairs.{il}"]))
        else:
            frames.append(None)
    for il, f in enumerate(frames):        # rows past the slots: the positions that follow
        if f is not None and f.positions.shape[0] < arrays[f"k.{il}"].shape[1]:
            n = arrays[f"k.{il}"].shape[1]
            last = f.positions[-1] if f.positions.size else -1
            pos = np.concatenate([f.positions, last + 1 + np.arange(n - f.positions.shape[0])])
            frames[il] = Rotary(pos, f.theta, f.pairs)
    layer = lambda name: [arrays[f"{name}.{il}"] for il in range(L)]  # noqa: E731
    kinds = [Kind("k f16", layer("k"), frames), Kind("v f16", layer("v"))]
    if "f32:k.0" in arrays:
        kinds += [Kind("k f32", layer("f32:k"), frames), Kind("v f32", layer("f32:v"))]
    for qt in ("Q8_0", "Q4_0"):
        for side in "kv":
            parts = [split_blocks(a, qt) for a in layer(side)]
            kinds += [Kind(f"{side} {qt.lower()} codes", [p[1] for p in parts]),
                      Kind(f"{side} {qt.lower()} scales", [p[0] for p in parts])]
    if "importance.0" in arrays:
        kinds.append(Kind("importance f16", layer("importance")))
    kinds += [Kind("tokens i32", [arrays["tokens"]]), Kind("positions i32", layer("pos"))]
    return kinds


# -------------------------------------------------------------------- codecs
@dataclass
class Codec:
    name: str
    encode: Callable[..., bytes]                        # (array, frame) -> stored
    decode: Callable[[bytes, np.ndarray], np.ndarray]   # (stored, like) -> array
    applies: Callable[[np.ndarray], bool] = lambda a: True
    uses_frame: bool = False


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


def _uint(a: np.ndarray) -> np.ndarray:
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _ordered(u: np.ndarray) -> np.ndarray:
    """Float bit patterns (unsigned) -> integers in the order of the floats they encode."""
    bits = 8 * u.dtype.itemsize
    sign = np.array(1 << (bits - 1), u.dtype)
    return np.where(u & sign, ~u, u | sign)


def _unordered(o: np.ndarray) -> np.ndarray:
    sign = np.array(1 << (8 * o.dtype.itemsize - 1), o.dtype)
    return np.where(o & sign, o & ~sign, ~o)


def _rows(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1, a.shape[-1]) if a.ndim >= 2 else a.reshape(-1, 1)


def _delta_rows(a: np.ndarray, xor: bool) -> np.ndarray:
    """Each row against the previous row (same channel): ordered-integer difference (mod
    2^bits) or XOR of the bit patterns; the first row as it is."""
    u = _rows(_uint(a))
    o = u if xor else _ordered(u)
    out = o.copy()
    out[1:] = o[1:] ^ o[:-1] if xor else o[1:] - o[:-1]
    return out


def _undelta_rows(d: np.ndarray, like: np.ndarray, xor: bool) -> np.ndarray:
    if xor:
        o = np.bitwise_xor.accumulate(d, axis=0)
    else:
        o = np.cumsum(d, axis=0, dtype=d.dtype)
    u = o if xor else _unordered(o)
    return u.view(like.dtype).reshape(like.shape)


def zstd_codecs(levels: list[int]) -> list[Codec]:
    import zstandard
    out = []
    floats = lambda a: a.dtype.kind == "f"           # noqa: E731
    for lv in levels:
        cctx = zstandard.ZstdCompressor(level=lv)
        dctx = zstandard.ZstdDecompressor()
        out.append(Codec(
            f"zstd-{lv}", lambda a, f, c=cctx: c.compress(a.tobytes()),
            lambda s, like, d=dctx: np.frombuffer(d.decompress(s), like.dtype).reshape(like.shape).copy()))
        out.append(Codec(
            f"shuffle+zstd-{lv}", lambda a, f, c=cctx: c.compress(_shuffle(a)),
            lambda s, like, d=dctx: _unshuffle(d.decompress(s), like),
            applies=lambda a: a.dtype.itemsize > 1))
        if lv != 3:
            continue
        for xor in (False, True):
            name = "xor" if xor else "delta"
            out.append(Codec(
                f"{name}+shuffle+zstd-{lv}",
                lambda a, f, c=cctx, x=xor: c.compress(_shuffle(_delta_rows(a, x))),
                lambda s, like, d=dctx, x=xor: _undelta_rows(
                    _unshuffle(d.decompress(s), _rows(_uint(like))), like, x),
                applies=floats))
    return out


def pred_codecs() -> list[Codec]:
    from pyimp.kv import floatcodec

    def dec(s: bytes, like: np.ndarray) -> np.ndarray:
        def fail(reason):
            raise RuntimeError(reason)
        return floatcodec.decode(s, like.shape, fail)
    f16 = lambda a: a.dtype == np.float16 and floatcodec.applies(a.shape)  # noqa: E731
    return [Codec("pred-f16", lambda a, f: floatcodec.encode(a), dec, applies=f16),
            Codec("pred-f16+rope", lambda a, f: floatcodec.encode(a, f), dec, applies=f16,
                  uses_frame=True)]


def blosc2_codecs(levels: list[int]) -> list[Codec]:
    import blosc2
    blosc2.set_nthreads(1)
    filters = {"shuffle": [blosc2.Filter.SHUFFLE],
               "bitshuffle": [blosc2.Filter.BITSHUFFLE],
               "shuffle+bytedelta": [blosc2.Filter.SHUFFLE, blosc2.Filter.BYTEDELTA]}
    out = []
    for fname, flist in filters.items():
        for lv in levels:
            def enc(a: np.ndarray, f, flist=flist, lv=lv) -> bytes:
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

    def enc(a: np.ndarray, f) -> bytes:
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
    codecs = [Codec("raw", lambda a, f: a.tobytes(),
                    lambda s, like: np.frombuffer(s, like.dtype).reshape(like.shape).copy())]
    for make, args, lib in ((zstd_codecs, (zstd_levels,), "zstandard"),
                            (pred_codecs, (), "pyimp.kv.floatcodec"),
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


def measure(kind: Kind, codec: Codec, reps: int) -> tuple[float, float, float] | None:
    """(ratio, encode MB/s, decode MB/s) of ``codec`` over the kind's arrays, each coded on
    its own; None when the codec applies to none of them or needs frames the kind lacks."""
    if codec.uses_frame and kind.frames is None:
        return None
    if not any(codec.applies(a) for a in kind.arrays):
        return None
    raw = stored_total = 0
    tc = td = 0.0
    for i, a in enumerate(kind.arrays):
        if not codec.applies(a):
            continue
        frame = kind.frames[i] if kind.frames is not None else None
        t, stored = best_time(lambda a=a, f=frame: codec.encode(a, f), reps)
        tc += t
        t, back = best_time(lambda s=stored, a=a: codec.decode(s, a), reps)
        td += t
        if back.dtype != a.dtype or back.shape != a.shape or back.tobytes() != a.tobytes():
            raise SystemExit(f"error: {codec.name} did not round-trip {kind.label} [{i}]")
        raw += a.nbytes
        stored_total += len(stored)
    return raw / max(1, stored_total), raw / 1e6 / tc, raw / 1e6 / td


def end_to_end(arrays: dict[str, np.ndarray], reps: int) -> None:
    """write_state / read_state of the f16 state of a dense engine (tokens, positions, K,
    V) as Engine.save_state writes it."""
    from pyimp.kv.floatcodec import Rotary
    from pyimp.kv.statefile import read_state, write_state
    L = int(arrays["n_layer"])
    keep = ("tokens", "pos.", "k.", "v.")          # a dense engine's state (no importance)
    named = {k: v for k, v in arrays.items() if k.startswith(keep)}
    frames = {}
    for il in range(L):
        if f"theta.{il}" in arrays:
            n = arrays[f"k.{il}"].shape[1]
            pos = arrays[f"pos.{il}"].astype(np.int64)
            last = pos[-1] if pos.size else -1
            pos = np.concatenate([pos, last + 1 + np.arange(n - pos.size)])
            frames[f"k.{il}"] = Rotary(pos, arrays[f"theta.{il}"], arrays[f"pairs.{il}"])
    raw = sum(a.nbytes for a in named.values())
    kv_raw = sum(a.nbytes for k, a in named.items() if k.startswith(("k.", "v.")))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "state.pkv")
        tw, stats = best_time(lambda: write_state(path, {"bench": True}, named, rotary=frames), reps)
        tr, (_, back) = best_time(lambda: read_state(path), reps)
        size = os.path.getsize(path)
    assert all(back[k].tobytes() == named[k].tobytes() for k in named)
    kv_stored = sum(s["stored_bytes"] for k, s in stats["sections"].items() if k.startswith(("k.", "v.")))
    codecs = sorted({s["codec"] for s in stats["sections"].values()})
    print(f"\nstatefile end to end ({len(named)} sections, codecs {', '.join(codecs)}): "
          f"{raw / 1e6:.2f} MB raw ({kv_raw / 1e6:.2f} MB of KV held) -> {size / 1e6:.2f} MB; "
          f"ratio {raw / size:.4f} against all sections, {kv_raw / size:.4f} against the KV "
          f"held; KV sections alone {kv_raw / 1e6:.2f} -> {kv_stored / 1e6:.2f} MB, ratio "
          f"{kv_raw / kv_stored:.4f}. write {tw:.2f} s ({raw / 1e6 / tw:.0f} MB/s), "
          f"read {tr:.2f} s ({raw / 1e6 / tr:.0f} MB/s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="read the arrays from this npz instead of running the model")
    p.add_argument("--save-data", help="save the arrays the model produced to this npz")
    p.add_argument("--tokens", type=int, default=4032, help="prefill length (default 4032)")
    p.add_argument("--reps", type=int, default=3, help="repetitions, best kept (default 3)")
    p.add_argument("--zstd-levels", default="-1,1,3,9", help="zstd levels (default -1,1,3,9)")
    p.add_argument("--blosc-levels", default="1,5", help="blosc2 clevels (default 1,5)")
    p.add_argument("--only", default="", help="comma-separated substrings of data kinds to run")
    p.add_argument("--codecs", default="", help="comma-separated substrings of codec names to run")
    p.add_argument("--no-end-to-end", action="store_true", help="skip the write/read_state row")
    args = p.parse_args(argv)

    from pyimp.runtime.process import configure_process
    configure_process()
    arrays = load_arrays(args.data, args.save_data, args.tokens)
    codecs = all_codecs([int(x) for x in args.zstd_levels.split(",")],
                        [int(x) for x in args.blosc_levels.split(",")])
    only = [s for s in args.only.split(",") if s]
    want = [s for s in args.codecs.split(",") if s]
    print(f"# CPU: {cpu_model()}; single-threaded codecs; MB = 1e6 bytes of raw data; each "
          f"layer's array coded on its own")
    print(f"{'data kind':<18} {'MB':>7} {'codec':<30} {'ratio':>7} {'comp MB/s':>10} {'decomp MB/s':>12}")
    for kind in data_kinds(arrays):
        if only and not any(s in kind.label for s in only):
            continue
        for codec in codecs:
            if want and codec.name != "raw" and not any(s in codec.name for s in want):
                continue
            got = measure(kind, codec, args.reps)
            if got is None:
                continue
            ratio, c, d = got
            print(f"{kind.label:<18} {kind.nbytes / 1e6:>7.2f} {codec.name:<30} {ratio:>7.3f} "
                  f"{c:>10.1f} {d:>12.1f}", flush=True)
    if not args.no_end_to_end:
        end_to_end(arrays, args.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
