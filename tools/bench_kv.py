"""KV cache types: quality, bytes, speed, and prompt-cache files, beside llama.cpp.

    python -m tools.bench_kv [--ctx 4096] [--windows 2] [--score 64] [--decode-ctx 16384]
                             [--no-peer] [--json FILE]

1. Quality per cache type on the default Gemma: for each of ``--windows`` windows of
   ``--ctx`` tokens of real text (Python's pydoc topics), prefill all but the last
   ``--score`` tokens, then decode those one by one and compare each step's next-token
   distribution with the f16 cache's: mean KL(f16 || type) and top-1 agreement. The same
   for llama.cpp (llama-cpp-python, flash attention on, ``type_k`` / ``type_v``) against its
   own f16 cache, in the same run. Also pyimp's V layouts, and the Hadamard rotation beside
   llama.cpp's with its rotation on (its default) and off (LLAMA_ATTN_ROT_DISABLE=1).
2. Bytes of KV per token per type, prefill and decode tok/s per type (the windows' runs),
   and decode tok/s at ``--decode-ctx`` (cache filled with random keys and values through
   the cache's own writer: a decode step's cost does not depend on what the cache holds).
3. Prompt-cache files for the first window's f16 and q8_0 caches: file size against the
   raw KV bytes, save and load time against the prefill time they replace.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

from pyimp.runtime.process import configure_process

# (label, pyimp options, llama.cpp (type_k, type_v, rotation) or None). llama.cpp rotates
# quantized K/V by a Hadamard transform by default (head dims that are a multiple of 64): K
# by the largest power-of-2 Hadamard matrix dividing the head dim (on Gemma 3 270M the 256 x
# 256 one, the matrix of pyimp's kv_rotate), V by 64 x 64 blocks; its environment switch
# LLAMA_ATTN_ROT_DISABLE=1, read when a context is created, turns that off. So each row compares like with like: pyimp without rotation
# beside llama.cpp with its rotation off, "+ rotation" rows beside llama.cpp's default.
CONFIGS = [
    ("f16", dict(kv_type="f16"), ("f16", "f16", False)),
    ("q8_0", dict(kv_type="q8_0"), ("q8_0", "q8_0", False)),
    ("q5_1", dict(kv_type="q5_1"), ("q5_1", "q5_1", False)),
    ("q5_0", dict(kv_type="q5_0"), ("q5_0", "q5_0", False)),
    ("q4_1", dict(kv_type="q4_1"), ("q4_1", "q4_1", False)),
    ("q4_0", dict(kv_type="q4_0"), ("q4_0", "q4_0", False)),
    ("k q8_0 / v q4_0", dict(cache_type_k="q8_0", cache_type_v="q4_0"), ("q8_0", "q4_0", False)),
    ("q8_0, V by channel", dict(kv_type="q8_0", v_layout="channel"), None),
    ("q4_0, V by channel", dict(kv_type="q4_0", v_layout="channel"), None),
    ("q8_0 + rotation", dict(kv_type="q8_0", kv_rotate=True), ("q8_0", "q8_0", True)),
    ("q5_0 + rotation", dict(kv_type="q5_0", kv_rotate=True), ("q5_0", "q5_0", True)),
    ("q4_0 + rotation", dict(kv_type="q4_0", kv_rotate=True), ("q4_0", "q4_0", True)),
]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def windows(tokenizer_engine, ctx: int, n: int) -> list[list[int]]:
    from tools.eval_sparse import pydoc_text
    ids = tokenizer_engine.tokenize(pydoc_text(), add_bos=False)
    bos = tokenizer_engine.cfg.bos_id
    need = n * (ctx - 1)
    if len(ids) < need:
        raise SystemExit(f"the text has {len(ids)} tokens, {need} needed")
    return [[bos] + ids[w * (ctx - 1):(w + 1) * (ctx - 1)] for w in range(n)]


def run_pyimp(opts: dict, toks: list[int], score: int, state_path: str | None = None) -> dict:
    import pyimp
    eng = pyimp.load(None, n_ctx=len(toks) + 8, **opts)
    eng.warmup()
    prefix, tail = toks[:-score], toks[-score:]
    t = time.perf_counter()
    eng.eval(prefix)
    prefill_s = time.perf_counter() - t
    out = {"prefill_tok_s": len(prefix) / prefill_s, "prefill_s": prefill_s}
    if state_path:
        t = time.perf_counter()
        stats = eng.save_state(state_path)
        out["save_s"] = time.perf_counter() - t
        out["file_bytes"] = os.path.getsize(state_path)
        # the KV the state holds: sliding-window layers keep only their window, so this is
        # far less than len(prefix) * layer_token_bytes * n_layer (the untrimmed context)
        out["raw_kv_bytes"] = int(eng.cache.bytes_held())
        del stats
        fresh = pyimp.load(None, n_ctx=len(toks) + 8, **opts)
        t = time.perf_counter()
        fresh.load_state(state_path)
        out["load_s"] = time.perf_counter() - t
        fresh.close()
    rows = []
    t = time.perf_counter()
    for tok in tail:
        rows.append(eng.eval([tok])[-1])
    out["decode_tok_s"] = len(tail) / (time.perf_counter() - t)
    out["logits"] = np.array(rows)
    out["bytes_per_token"] = eng.cache.layer_token_bytes() * eng.cfg.n_layer
    eng.close()
    return out


def run_peer(model: str, types: tuple[str, str, bool], toks: list[int], score: int) -> dict:
    """llama.cpp's logits of the scored steps with cache types ``types[:2]`` (flash attention
    on, :func:`tools.llamacpp_peer.open_model`); ``types[2]``: keep llama.cpp's default
    Hadamard rotation of quantized K/V (else LLAMA_ATTN_ROT_DISABLE=1 for this context)."""
    from tools.llamacpp_peer import _quiet, open_model
    m = open_model(model, n_ctx=len(toks) + 8, n_batch=512, type_k=types[0], type_v=types[1],
                   flash_attn=True, logits_all=False, rotate=types[2])
    n_vocab = m.n_vocab()
    prefix, tail = toks[:-score], toks[-score:]
    t = time.perf_counter()
    with _quiet():
        m.eval(prefix)
    prefill_s = time.perf_counter() - t
    rows = []
    t = time.perf_counter()
    with _quiet():
        for tok in tail:
            m.eval([tok])
            rows.append(np.ctypeslib.as_array(m._ctx.get_logits(), shape=(n_vocab,)).copy())
    decode_s = time.perf_counter() - t
    m.close()
    return {"prefill_tok_s": len(prefix) / prefill_s, "decode_tok_s": len(tail) / decode_s,
            "logits": np.array(rows)}


def _record(rows: dict, label: str, r: dict, kl: float, top1: float) -> dict:
    """Append one window's KL, top-1 and speeds to the row of ``label``; returns the row."""
    row = rows.setdefault(label, {"kl": [], "top1": [], "prefill": [], "decode": []})
    row["kl"].append(kl)
    row["top1"].append(top1)
    row["prefill"].append(r["prefill_tok_s"])
    row["decode"].append(r["decode_tok_s"])
    return row


def compare(ref: np.ndarray, other: np.ndarray) -> tuple[float, float]:
    p, q = log_softmax(ref), log_softmax(other)
    kl = float((np.exp(p) * (p - q)).sum(axis=-1).mean())
    top1 = float((ref.argmax(-1) == other.argmax(-1)).mean())
    return kl, top1


def decode_speed(opts: dict, ctx: int, steps: int = 24) -> float:
    import pyimp
    eng = pyimp.load(None, n_ctx=ctx + steps + 8, **opts)
    eng.warmup()
    c = eng.cache
    rng = np.random.default_rng(0)
    c.reserve(ctx)
    for il in range(c.n_layer):
        k, v = rng.standard_normal((2, ctx, c.n_head_kv, c.head_dim), np.float32)
        c.write(il, k, v, 0)
    c.commit(ctx)
    eng.tokens.extend(rng.integers(3, 1000, ctx).tolist())
    eng.eval([5])                                   # one step untimed
    t = time.perf_counter()
    for tok in rng.integers(3, 1000, steps):
        eng.eval([int(tok)])
    rate = steps / (time.perf_counter() - t)
    eng.close()
    return rate


def main(argv=None) -> int:
    configure_process()
    ap = argparse.ArgumentParser(prog="python -m tools.bench_kv", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--score", type=int, default=64, help="decode steps scored per window")
    ap.add_argument("--decode-ctx", type=int, default=16384, help="0: skip the long decode rows")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--json", help="write every figure to this file")
    ap.add_argument("--skip", default="", help="comma-separated config labels to leave out")
    args = ap.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    configs = [c for c in CONFIGS if c[0] not in skip]

    import pyimp
    from pyimp.runtime.default_model import default_model_path
    from tools.bench import cpu_model, read_bandwidth
    model = str(default_model_path())
    tok_engine = pyimp.load(None, n_ctx=64)
    wins = windows(tok_engine, args.ctx, args.windows)
    tok_engine.close()
    print(f"# {cpu_model()}, single-thread read {read_bandwidth():.1f} GB/s; Gemma 3 270M "
          f"Q4_K_M, {args.windows} windows x {args.ctx} tokens, {args.score} decode steps scored",
          flush=True)
    res: dict = {"pyimp": {}, "peer": {}, "prompt_cache": {}, "decode_long": {}}
    tmp = tempfile.mkdtemp(prefix="bench_kv")
    for w, toks in enumerate(wins):
        ref = None
        for label, opts, _ in configs:
            state = os.path.join(tmp, "s.pkv") if w == 0 and label in ("f16", "q8_0") else None
            r = run_pyimp(opts, toks, args.score, state)
            if ref is None:
                ref = r["logits"]
            kl, top1 = compare(ref, r["logits"])
            _record(res["pyimp"], label, r, kl, top1)["bytes_per_token"] = r["bytes_per_token"]
            if state:
                res["prompt_cache"][label] = {k: r[k] for k in ("file_bytes", "raw_kv_bytes",
                                                                 "save_s", "load_s", "prefill_s")}
            print(f"  window {w} pyimp {label:20s} KL {kl:.2e} top1 {top1:.3f} prefill "
                  f"{r['prefill_tok_s']:.0f} decode {r['decode_tok_s']:.1f} tok/s", flush=True)
        if args.no_peer:
            continue
        pref = None
        for label, _, types in configs:
            if types is None:
                continue
            r = run_peer(model, types, toks, args.score)
            if pref is None:
                pref = r["logits"]
            kl, top1 = compare(pref, r["logits"])
            _record(res["peer"], label, r, kl, top1)
            print(f"  window {w} llama.cpp {label:16s} KL {kl:.2e} top1 {top1:.3f} prefill "
                  f"{r['prefill_tok_s']:.0f} decode {r['decode_tok_s']:.1f} tok/s", flush=True)
    if args.decode_ctx:
        for label, opts in (("f16", dict(kv_type="f16")), ("q8_0", dict(kv_type="q8_0")),
                            ("q4_0", dict(kv_type="q4_0"))):
            res["decode_long"][label] = decode_speed(opts, args.decode_ctx)
            print(f"  decode at {args.decode_ctx}: {label} {res['decode_long'][label]:.1f} tok/s",
                  flush=True)

    print("\n| cache type | bytes/token | pyimp mean KL vs f16 | top-1 | llama.cpp mean KL vs f16 "
          "| top-1 | pyimp prefill / decode tok/s |")
    print("|---|---|---|---|---|---|---|")
    for label, _, types in configs:
        r = res["pyimp"][label]
        p = res["peer"].get(label)
        peer = (f"{np.mean(p['kl']):.2e} | {np.mean(p['top1']):.3f}" if p else "- | -")
        print(f"| {label} | {r['bytes_per_token']:.0f} | {np.mean(r['kl']):.2e} | "
              f"{np.mean(r['top1']):.3f} | {peer} | {np.mean(r['prefill']):.0f} / "
              f"{np.mean(r['decode']):.1f} |")
    for label, pc in res["prompt_cache"].items():
        print(f"\nprompt cache {label}: file {pc['file_bytes'] / 1e6:.1f} MB, raw KV "
              f"{pc['raw_kv_bytes'] / 1e6:.1f} MB (ratio {pc['raw_kv_bytes'] / pc['file_bytes']:.3f}); "
              f"save {pc['save_s']:.2f} s, load {pc['load_s']:.2f} s = "
              f"{100 * pc['load_s'] / pc['prefill_s']:.1f}% of the {pc['prefill_s']:.1f} s prefill")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
