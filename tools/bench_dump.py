"""Cost of a full tensor dump against the plain run it records.

The same prompt, prefill + N greedy decode steps, on one warm engine: plain (``eval`` and
argmax, taps off) against ``Engine.trace`` recording every tensor plus writing the GGUF dump.
Best of ``--repeat`` runs each.

    python -m tools.bench_dump [MODEL] [-p PROMPT] [--steps 4] [--repeat 3]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np


def plain(engine, ids, steps: int) -> float:
    t0 = time.perf_counter()
    engine.reset()
    logits = engine.eval(ids)[-1]
    for _ in range(steps):
        logits = engine.eval([int(np.argmax(logits))])[-1]
    return time.perf_counter() - t0


def dumped(engine, ids, steps: int, path: str) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    tr = engine.trace(ids, steps=steps)
    t1 = time.perf_counter()
    tr.write(path)
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1, len(tr.tensors)


def main(argv=None) -> int:
    from pyimp.runtime.process import configure_process
    configure_process()
    from pyimp.engine import Engine, EngineOptions

    p = argparse.ArgumentParser(prog="python -m tools.bench_dump", description=__doc__.split("\n")[0])
    p.add_argument("model", nargs="?", help="GGUF model (default: the embedded Gemma 3 270M)")
    p.add_argument("-p", "--prompt", default="The capital of France is")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--numerics", choices=("fp32", "ggml"), default="fp32")
    args = p.parse_args(argv)
    if args.model is None:
        from pyimp.runtime.default_model import default_model_path
        args.model = str(default_model_path())
    eng = Engine(args.model, EngineOptions(n_ctx=256, numerics=args.numerics))
    eng.warmup()
    ids = eng.tokenize(args.prompt)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "dump.gguf")
        dumped(eng, ids, args.steps, out)                  # first trace: nothing left to compile
        base = min(plain(eng, ids, args.steps) for _ in range(args.repeat))
        runs = [dumped(eng, ids, args.steps, out) for _ in range(args.repeat)]
        size = os.path.getsize(out)
    total, write, n = min(runs)
    print(f"{args.model}: {len(ids)} prompt tokens + {args.steps} steps, numerics {args.numerics}")
    print(f"plain run        {base * 1e3:8.1f} ms")
    print(f"dump (trace+write) {total * 1e3:6.1f} ms  ({total / base:.2f}x; write {write * 1e3:.1f} ms; "
          f"{n} tensors, {size / 2**20:.1f} MiB)")
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
