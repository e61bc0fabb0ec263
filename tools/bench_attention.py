"""Micro-benchmark: dense paged decode attention vs block-sparse (retrieval + sparse attention).

Default shape is TinyLlama-1.1B's attention (Hq 32, Hkv 4, head_dim 64) with
32-token blocks and an fp16 cache filled with random keys/values; the sparse
budget is 1/8 of the blocks (sinks, local blocks and the tail included).
The first call of each kernel is timed apart as compile/warm-up time. By
default the caches are flushed (a 128 MiB buffer is read, untimed) before
every timed call, as in a real decode step where the other layers' data has
evicted this layer's K/V, anchors and importance; the 256 KiB fp16 decode
table is re-read after the flush, since every layer keeps it hot. ``--hot``
skips the flush.

    python tools/bench_attention.py --ctx 16384 32768 --threads 2
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def _timed(fn, reps, flush=None):
    """(first-call seconds, min seconds, median seconds) of fn(); flush() runs untimed before
    each timed call."""
    t = time.perf_counter()
    fn()
    first = time.perf_counter() - t
    ts = []
    for _ in range(reps):
        if flush is not None:
            flush()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return first, min(ts), float(np.median(ts))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--budget", type=int, default=8, help="attend to 1/budget of the blocks")
    ap.add_argument("--init", type=int, default=2, help="sink blocks")
    ap.add_argument("--local", type=int, default=4, help="last full blocks always attended")
    ap.add_argument("--anchor", default="quest", help="anchor type (quest, block_mean, ...)")
    ap.add_argument("--kv", choices=["f16", "f32"], default="f16")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hot", action="store_true", help="do not flush caches between calls")
    ap.add_argument("--shuffle", action="store_true",
                    help="random logical->physical block table (default: sequential, as a "
                         "freshly filled cache)")
    args = ap.parse_args(argv)

    import numba

    from pyimp.attention.attend import attention_decode, sparse_attention_decode
    from pyimp.attention.importance import fp16_lut
    from pyimp.sparse.anchors import AnchorType, block_spans, compute_anchors
    from pyimp.sparse.retrieval import RetrievalType, retrieve_blocks

    numba.set_num_threads(args.threads)
    anchor_type = AnchorType(args.anchor)
    Hq, Hkv, D, B = args.hq, args.hkv, args.head_dim, args.block
    dtype = np.float16 if args.kv == "f16" else np.float32
    rng = np.random.default_rng(args.seed)
    junk = np.ones(128 * 2**20 // 8)
    lut = fp16_lut()

    def flush():
        junk[::8].sum()  # read one word per 64-byte line: evicts everything, leaves lines clean
        lut.view(np.uint32).sum()  # the fp16 table stays hot in a real decode (all layers use it)

    flush = None if args.hot else flush
    scale = 1.0 / np.sqrt(D)
    print(f"Hq={Hq} Hkv={Hkv} D={D} B={B} kv={args.kv} threads={args.threads} "
          f"budget=1/{args.budget} anchor={anchor_type.name} reps={args.reps} "
          f"caches={'hot' if args.hot else 'flushed'} "
          f"blocks={'shuffled' if args.shuffle else 'sequential'} (times: min / median)")
    for n in args.ctx:
        n_lb = -(-n // B)
        k_cache = rng.standard_normal((Hkv, n_lb, B * D)).astype(dtype)
        v_cache = rng.standard_normal((Hkv, n_lb, D * B)).astype(dtype)
        block_table = (rng.permutation(n_lb) if args.shuffle else np.arange(n_lb)).astype(np.int32)
        q = rng.standard_normal((Hq, D)).astype(np.float32)
        out = np.empty((Hq, D), np.float32)
        A = 2 if anchor_type in (AnchorType.QUEST, AnchorType.CUBOID_MEAN) else 1
        # stored as the engine stores them: per kv head unless the type differs within a group
        anchor = np.zeros((n_lb, A, Hq if anchor_type is AnchorType.DYNAMIC else Hkv, D), np.float16)
        importance = np.zeros((n_lb, B, Hq), np.float16)
        compute_anchors(anchor_type, k_cache, *block_spans(block_table, n, B), anchor, importance)
        pick = max(n_lb // args.budget - args.init - args.local - (1 if n % B else 0), 0)

        first, dmin, dmed = _timed(lambda: attention_decode(q, k_cache, v_cache, block_table, n,
                                                            scale, 0, out), args.reps, flush)
        _, imin, imed = _timed(lambda: attention_decode(q, k_cache, v_cache, block_table, n, scale,
                                                        0, out, importance), args.reps, flush)
        print(f"\nctx {n}: {n_lb} blocks, {args.init}+{pick}+{args.local} selected "
              f"(+tail)   [first dense call {first * 1e3:.0f} ms]")
        print(f"  dense decode               {dmin * 1e3:7.3f} / {dmed * 1e3:7.3f} ms")
        print(f"  dense decode + importance  {imin * 1e3:7.3f} / {imed * 1e3:7.3f} ms")
        for rtype in RetrievalType:
            def retrieve():
                return retrieve_blocks(q, anchor, block_table, n, B, Hkv, rtype, args.init, pick,
                                       args.local, anchor_type)

            sel, cnt = retrieve()
            _, rmin, rmed = _timed(retrieve, args.reps, flush)
            _, smin, smed = _timed(lambda: sparse_attention_decode(
                q, k_cache, v_cache, block_table, n, scale, 0, sel, cnt, out), args.reps, flush)

            def step():
                s, c = retrieve()
                sparse_attention_decode(q, k_cache, v_cache, block_table, n, scale, 0, s, c, out)

            _, tmin, tmed = _timed(step, args.reps, flush)
            print(f"  {rtype.name:6s} retrieve {rmin * 1e3:6.3f} / {rmed * 1e3:6.3f}  "
                  f"sparse attn {smin * 1e3:6.3f} / {smed * 1e3:6.3f}  "
                  f"step {tmin * 1e3:6.3f} / {tmed * 1e3:6.3f} ms  "
                  f"speedup {dmin / tmin:4.1f}x / {dmed / tmed:4.1f}x")


if __name__ == "__main__":
    from pyimp.runtime.process import configure_process
    configure_process()   # before the first parallel kernel starts OpenMP
    main()
