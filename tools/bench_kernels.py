"""Matvec throughput of the quantized kernels, in GB/s of weight bytes read.

Measures, with a fixed number of Numba threads (default 2):

* the machine's read bandwidth (NumPy sum over a 1 GB float32 array, best of a few),
* matvec on the real model's tensors (per type: its largest tensor, and all its
  tensors one after another as a forward pass reads them),
* matvec on a synthetic 4096 x 4096 matrix of every supported type,

in both numerics (``fp32``: fused kernels; ``ggml``: activation conversion plus
ggml-order integer dot products), and the kernels' compile time: first call with
an empty Numba cache, then first call in a fresh process that loads the cache.

    python -m tools.bench_kernels [--model PATH] [--threads 2] [--reps 15]

``--model`` defaults to the default model (Gemma 3 270M Q4_K_M, written into the
cache by ``pyimp.runtime.default_model``). A model that cannot be read is an error, not a
silently shorter table; ``--no-real`` times the synthetic matrices only. Types the
model holds no matrix of are listed as synthetic-only.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def resolve_model(path: str | None) -> str:
    """The GGUF to time: ``path``, else the default model. SystemExit with one line when
    it is missing or cannot be provided."""
    if path is None:
        from pyimp.runtime.default_model import DefaultModelError, default_model_path
        try:
            return str(default_model_path())
        except DefaultModelError as e:
            raise SystemExit(f"error: default model unavailable: {e} (or pass --model PATH, "
                             f"or --no-real for synthetic matrices only)") from None
    if not os.path.isfile(path):
        raise SystemExit(f"error: model {path}: no such file (or pass --no-real)")
    return path


def read_bandwidth(gb: float = 1.0, reps: int = 4) -> float:
    """GB/s of a NumPy float32 sum over ``gb`` GB (best of ``reps``)."""
    a = np.ones(int(gb * 1e9) // 4, dtype=np.float32)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    nbytes = a.nbytes
    del a
    return nbytes / best / 1e9


# Each timing repeats its call for at least this long. A call of these kernels takes about a
# millisecond, and on a VM one stretch of a few milliseconds can run at half speed (a vCPU
# taken away for a moment): a best of 3 such calls then read Gemma's Q4_K matrices at 33% of read
# bandwidth in one run and 59-62% in the next ones.
MIN_SECONDS = 0.25


def time_call(fn, reps: int, min_seconds: float = MIN_SECONDS) -> tuple[float, float]:
    """(best, median) seconds of ``fn()`` after one warm-up call, over at least ``reps``
    calls and at least ``min_seconds`` of calls."""
    fn()
    ts = []
    start = time.perf_counter()
    while len(ts) < reps or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts), float(np.median(ts))


def bench_matrix(raw: np.ndarray, qtype, n: int, reps: int) -> dict:
    """GB/s (best and median) of dispatcher matvec in both numerics on one weight matrix."""
    from loaders import quants as Q
    r = Q.as_raw(raw, qtype, n)
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    out = np.empty(r.shape[0], np.float32)
    res = {"bytes": r.nbytes}
    for numerics in ("fp32", "ggml"):
        best, med = time_call(lambda: Q.matvec(r, qtype, n, x, numerics, out=out), reps)
        res[numerics] = (r.nbytes / best / 1e9, r.nbytes / med / 1e9)
    return res


def bench_sequence(mats: list, qtype, reps: int) -> tuple[float, float]:
    """fp32 GB/s over all matrices of one type read one after another (best, median)."""
    from loaders import quants as Q
    rs = [(Q.as_raw(raw, qtype, n), n) for raw, n in mats]
    xs = [np.random.default_rng(1).standard_normal(n).astype(np.float32) for _, n in rs]
    outs = [np.empty(r.shape[0], np.float32) for r, _ in rs]

    def run():
        for (r, n), x, o in zip(rs, xs, outs):
            Q.matvec(r, qtype, n, x, "fp32", out=o)

    total = sum(r.nbytes for r, _ in rs)
    best, med = time_call(run, max(3, reps // 3))  # and MIN_SECONDS of calls
    return total / best / 1e9, total / med / 1e9


def synthetic(qtype, rows: int = 4096, n: int = 4096) -> np.ndarray:
    """Valid random weights of ``qtype``: random quant bytes with finite fp16 scales
    (a matvec's speed does not depend on the values)."""
    from loaders.ggml_types import QT, row_bytes
    rng = np.random.default_rng(0)
    if qtype == QT.F32:
        return rng.standard_normal((rows, n), dtype=np.float32).view(np.uint8)
    if qtype in (QT.F16, QT.BF16):
        return rng.standard_normal((rows, n), dtype=np.float32).astype(np.float16).view(np.uint8)
    try:
        from tools import ggml_oracle
        if ggml_oracle.available():
            return ggml_oracle.quantize(qtype, rng.standard_normal((rows, n), dtype=np.float32))
    except Exception:
        pass
    raw = rng.integers(0, 256, (rows, row_bytes(qtype, n)), dtype=np.uint8)
    raw[:, 1::2] &= 0x3B  # keep every fp16 field finite and moderate (exponent < 15)
    return raw


def real_matrix_rates(model: str, reps: int) -> tuple[list[dict], list[str]]:
    """Per weight type of ``model`` (its matrices; 1-D tensors are listed apart): the largest
    matrix timed in both numerics (:func:`bench_matrix`) and, for a type with more than one,
    fp32 over all its matrices but the token embedding in sequence (:func:`bench_sequence`).
    Returns (one dict per type, the names of the types with only 1-D tensors)."""
    from loaders.gguf_file import GGUFError, GGUFFile
    try:
        f = GGUFFile(model)
    except GGUFError as e:
        raise SystemExit(f"error: {e}") from None
    by_type: dict = {}
    for name, info in f.tensors.items():
        if len(info.shape) >= 2:
            by_type.setdefault(info.qtype, []).append(name)
    skipped = sorted({info.type_name for info in f.tensors.values() if info.qtype not in by_type})
    out = []
    for qt in sorted(by_type, key=int):
        tensors = [f.tensor(nm) for nm in by_type[qt]]
        big = max(tensors, key=lambda t: t.raw.nbytes)
        e = {"qtype": big.qtype, "name": big.name, "shape": f"{big.n_rows}x{big.n_per_row}",
             "big": bench_matrix(big.raw, big.qtype, big.n_per_row, reps), "seq": None}
        mats = [(t.raw, t.n_per_row) for t in tensors if t.name != "token_embd.weight"]
        if len(tensors) > 1 and mats:
            e["seq"] = bench_sequence(mats, big.qtype, reps)
            e["seq_n"], e["seq_mb"] = len(mats), sum(m[0].nbytes for m in mats) / 1e6
        out.append(e)
    return out, skipped


def layer_rate(entry: dict) -> float:
    """The fp32 GB/s a type's entry of :func:`real_matrix_rates` stands for: over all its layer
    matrices in sequence where it has several, else its one matrix."""
    return entry["seq"][0] if entry["seq"] is not None else entry["big"]["fp32"][0]


# ----------------------------------------------------------------------------- compile time

_COMPILE_SNIPPET = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np, numba
numba.set_num_threads({threads})
sys.path.insert(0, {root!r})
from loaders import quants as Q
from loaders.ggml_types import block_size, row_bytes
res = {{"import": time.perf_counter() - t0}}
for qt in sorted(Q.available_types(), key=int):
    n = max(256, block_size(qt))
    raw = np.zeros((4, row_bytes(qt, n)), np.uint8)
    x = np.ones((2, n), np.float32)
    t0 = time.perf_counter()
    Q.dequantize(raw, qt, n)
    Q.matvec(raw, qt, n, x[0])
    Q.matmul(raw, qt, n, x, numerics="ggml")
    res[qt.name] = time.perf_counter() - t0
print("RESULT" + json.dumps(res))
"""


def compile_times(threads: int) -> tuple[dict, dict]:
    """Seconds to the first finished call of dequantize + matvec + ggml matmul per type:
    (empty cache, cache filled by the first process)."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        code = _COMPILE_SNIPPET.format(threads=threads, root=ROOT)
        runs = []
        for _ in range(2):
            p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
            if p.returncode or not line:
                raise RuntimeError(f"compile-time subprocess failed:\n{p.stderr[-2000:]}")
            runs.append(json.loads(line[0][len("RESULT"):]))
    return runs[0], runs[1]


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help="GGUF file whose tensors to time (default: the default model, Gemma 3 270M Q4_K_M)")
    ap.add_argument("--no-real", action="store_true", help="time synthetic matrices only")
    ap.add_argument("--threads", type=int, default=2, help="Numba threads (default 2)")
    ap.add_argument("--reps", type=int, default=15,
                    help=f"timed calls per measurement, at least (and at least {MIN_SECONDS} s of calls)")
    ap.add_argument("--no-compile", action="store_true", help="skip the compile-time subprocesses")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error(f"--reps {args.reps}: must be at least 1")
    if args.threads < 1:
        ap.error(f"--threads {args.threads}: must be at least 1")
    model = None if args.no_real else resolve_model(args.model)

    import numba
    numba.set_num_threads(args.threads)
    from loaders import quants as Q

    print(f"numba {numba.__version__}, {args.threads} threads, {os.cpu_count()} CPUs; "
          f"throughput = weight bytes / time, best (median) of at least {args.reps} calls "
          f"and {MIN_SECONDS} s")
    print(f"load average at start: {os.getloadavg()[0]:.2f} (other processes on these CPUs skew the numbers)")
    bw = read_bandwidth()
    print(f"machine read bandwidth (NumPy sum over 1 GB, best of 4): {bw:.1f} GB/s\n")

    def row(label, shape, r):
        f_b, f_m = r["fp32"]
        g_b, g_m = r["ggml"]
        print(f"{label:<34s} {shape:>13s} {r['bytes'] / 1e6:9.2f} {f_b:7.2f} ({f_m:6.2f}) "
              f"{100 * f_b / bw:5.0f}% {g_b:7.2f} ({g_m:6.2f})")

    header = (f"{'matrix':<34s} {'rows x n':>13s} {'MB':>9s} {'fp32 GB/s':>16s} {'of bw':>6s} "
              f"{'ggml GB/s':>16s}")

    real_types: set = set()
    if model is not None:
        entries, skipped = real_matrix_rates(model, args.reps)
        real_types = {int(e["qtype"]) for e in entries}
        print(f"real tensors: {os.path.basename(model)}")
        print(header)
        for e in entries:
            row(f"{e['qtype'].name} {e['name']}", e["shape"], e["big"])
            if e["seq"] is not None:
                sb, sm = e["seq"]
                label = f"{e['qtype'].name} all {e['seq_n']} (seq, fp32)"
                print(f"{label:<34s} {'':>13s} {e['seq_mb']:9.2f} {sb:7.2f} ({sm:6.2f}) "
                      f"{100 * sb / bw:5.0f}%")
        if skipped:
            print(f"(types with only 1-D tensors, not timed: {', '.join(skipped)})")
        print()
    else:
        print("real tensors: not timed (--no-real)\n")

    print("synthetic 4096 x 4096")
    print(header)
    for qt in sorted(Q.available_types(), key=int):
        r = bench_matrix(synthetic(qt), qt, 4096, args.reps)
        row(qt.name, "4096x4096", r)
    synthetic_only = [qt.name for qt in sorted(Q.available_types(), key=int) if int(qt) not in real_types]
    if model is not None and synthetic_only:
        print(f"(no matrix of these types in {os.path.basename(model)}, synthetic rows only: "
              f"{', '.join(synthetic_only)})")
    print()

    print(f"load average after the timings: {os.getloadavg()[0]:.2f}; "
          f"threading layer used: {numba.threading_layer()}\n")
    if not args.no_compile:
        cold, warm = compile_times(args.threads)
        print("compile: first dequantize + matvec + ggml matmul per type, seconds")
        print(f"{'type':<8s} {'empty cache':>12s} {'cached':>8s}")
        for k in cold:
            print(f"{k:<8s} {cold[k]:12.2f} {warm.get(k, float('nan')):8.2f}")
        tot_c = sum(v for k, v in cold.items() if k != "import")
        tot_w = sum(v for k, v in warm.items() if k != "import")
        print(f"{'total':<8s} {tot_c:12.2f} {tot_w:8.2f}   (kernels only, import excluded)")
    return 0


if __name__ == "__main__":
    from pyimp.runtime.process import configure_process
    configure_process()   # before the first parallel kernel starts OpenMP (workers inherit it)
    raise SystemExit(main())
