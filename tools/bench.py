"""End-to-end speed: pyimp vs llama.cpp (flash attention on) in the same run.

For each model and context length C: prefill C tokens (tok/s), then decode
``--decode`` tokens on top (tok/s), 2 threads each, every measurement in a
fresh subprocess so that peak RSS is per engine and per run. The prompt is
real text (Python's pydoc topics, tokenized by the model's own vocabulary) for
models with a real vocabulary, random ids for the synthetic TinyLlama.
``--repeat R`` runs each engine R times, alternating, and keeps each one's best.

    python -m tools.bench                      # gemma3 270M + synthetic TinyLlama-1.1B Q4_0
    python -m tools.bench --models gemma --ctx 128 1024
    python -m tools.bench --models gemma --ctx 16384 32000 --sparse-budget 0.125
    python -m tools.bench --models gemma --startup --profile   # start-up times, decode profile
    python -m tools.bench --goals          # the speed goals' grid, then each goal met or not
    python -m tools.bench --goals --target znver3   # both engines built for an AVX2 CPU

``--target CPU`` compiles pyimp's kernels for another CPU's instruction set
(``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES``) and runs llama.cpp from
``python -m tools.build_peer --target CPU``'s build: the code a machine of that kind
runs, on this machine's cores and memory.

The speed goals (:data:`GOALS`) live here, not in timed tests: ``--goals`` runs
the rows they name (:data:`GOAL_PLAN`), the start-up times and the matvecs'
share of read bandwidth (``tools.bench_kernels``), and ends with one line per
goal: the figure measured on this machine and whether it meets the goal.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

from tools.mca_steps import TARGETS


class BenchError(RuntimeError):
    """A measurement subprocess failed; the message ends with its last line of stderr."""


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "no output"


def _tokens(n: int, n_vocab: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(10, min(n_vocab, 32000), n)]


def text_tokens(model: str, n: int) -> list[int] | None:
    """n ids of real text (pydoc topics, repeated if it is shorter) in the model's vocabulary,
    BOS first; None for a model without a usable vocabulary (the synthetic TinyLlama)."""
    from pyimp.engine import Engine, EngineOptions
    from tools.eval_sparse import pydoc_text
    with Engine(model, EngineOptions(n_ctx=256)) as eng:
        if eng.vocab is None or eng.cfg.name.startswith("synthetic"):
            return None
        ids = eng.tokenize(pydoc_text(), add_bos=False)
        bos = [eng.cfg.bos_id] if eng.cfg.bos_id >= 0 else []
    body = (ids * (n // max(len(ids), 1) + 1))[:max(0, n - len(bos))]
    return bos + body


def _fill_cache(eng, ctx: int) -> None:
    """Decode-speed runs at long context without the prefill: random keys and values for
    ``ctx`` positions (a decode step's cost does not depend on what the cache holds)."""
    rng = np.random.default_rng(0)
    c = eng.cache
    c.reserve(ctx)
    for il in range(c.n_layer):       # through write(): quantized caches store blocks as they fill
        k, v = rng.standard_normal((2, ctx, c.n_head_kv, c.head_dim), np.float32)
        c.write(il, k, v, 0)
    c.commit(ctx)
    eng.tokens.extend(_tokens(ctx, eng.cfg.n_vocab))
    if eng.sparse is not None:
        eng.sparse.after_prefill(ctx)


def peak_rss_mb() -> float:
    """This process's peak resident set in MB: VmHWM from /proc/self/status, which counts its
    own address space only. getrusage's ru_maxrss is no use in a worker: Linux carries the
    high-water mark of the process that forked it across exec, so every worker of this bench
    reported at least the parent's peak (its tokenizer, or the synthetic TinyLlama it wrote).
    ru_maxrss only where /proc is absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _profiled(eng):
    """Time a pyimp engine's decode by part: each weight matvec (the output head apart, layer
    matrices by type) and the decode attention; returns the dict of seconds it fills."""
    import collections

    from pyimp import cpu_forward
    from pyimp import model as model_mod
    spent = collections.defaultdict(float)
    on = {"active": False}

    def timed(key_of, fn):
        def wrapper(*a, **kw):
            if not on["active"]:
                return fn(*a, **kw)
            t = time.perf_counter()
            r = fn(*a, **kw)
            spent[key_of(*a)] += time.perf_counter() - t
            return r
        return wrapper

    def matvec_key(lin, *_):
        return (f"output head matvec ({lin.qtype.name})" if not lin.name.startswith("blk.")
                else f"layer matvecs {lin.qtype.name}")

    model_mod.Linear._matvec = timed(matvec_key, model_mod.Linear._matvec)
    # a layer's q/k/v and gate/up of one type run as one grouped call (model.LinearGroup)
    model_mod.LinearGroup.__call__ = timed(lambda group, *_: matvec_key(group.linears[0]),
                                           model_mod.LinearGroup.__call__)
    cpu_forward.decode_over_blocks = timed(lambda *a: "decode attention", cpu_forward.decode_over_blocks)
    if eng.sparse is not None:
        eng.sparse.decode_attention = timed(lambda *a: "decode attention (block-sparse)",
                                            eng.sparse.decode_attention)
    return spent, on


def worker(engine: str, model: str, ctx: int, n_decode: int, threads: int, numerics: str,
           sparse_budget: float = 0.0, synthetic_cache: bool = False, tokens_file: str | None = None,
           profile: bool = False) -> dict:
    """Runs inside the subprocess; returns timings and peak RSS (and a decode profile)."""
    t0 = time.perf_counter()
    toks = None if tokens_file is None else [int(t) for t in np.load(tokens_file)[:ctx + n_decode]]
    extra = {}
    if engine == "pyimp":
        from pyimp.engine import Engine, EngineOptions
        from pyimp.runtime.warmup import numba_cache_has_kernels
        from pyimp.sparse.policy import SparseOptions
        # a run that compiles its kernels (in warmup, before the timings) is no warm run all the
        # same: LLVM's memory counts in its peak RSS, about 200 MB for Gemma
        extra["compiled"] = numba_cache_has_kernels() is False
        sparse = SparseOptions()
        if sparse_budget > 0:
            # sinks + topk + locals (+ tail) ~ budget * ctx tokens, block length 32
            topk = max(1, int(sparse_budget * ctx / 32) - 3)
            sparse = SparseOptions(enabled=True, anchor="block_mean", topk=topk)
        eng = Engine(model, EngineOptions(n_ctx=ctx + n_decode + 8, n_threads=threads, numerics=numerics,
                                          sparse=sparse))
        load = time.perf_counter() - t0
        compile_s = eng.warmup()
        toks = toks or _tokens(ctx + n_decode, eng.cfg.n_vocab)
        spent, on = _profiled(eng) if profile else ({}, {})
        t = time.perf_counter()
        if synthetic_cache:
            _fill_cache(eng, ctx)
        else:
            eng.eval(toks[:ctx], all_logits=False)
        prefill = time.perf_counter() - t
        on["active"] = True
        t = time.perf_counter()
        for tok in toks[ctx:]:
            eng.eval([tok], all_logits=False)
        decode = time.perf_counter() - t
        if profile:
            parts = {k: v / n_decode * 1e3 for k, v in spent.items()}
            parts["everything else (Python, norms, RoPE, KV writes, residuals)"] = \
                decode / n_decode * 1e3 - sum(parts.values())
            extra["profile_ms_per_token"] = parts
    else:
        from tools import llamacpp_peer
        m = llamacpp_peer.open_model(model, n_ctx=ctx + n_decode + 8, n_batch=512, kv_type="f16",
                                     flash_attn=True, n_threads=threads, logits_all=False)
        load = time.perf_counter() - t0
        compile_s = 0.0
        toks = toks or _tokens(ctx + n_decode, m.n_vocab())
        t = time.perf_counter()
        m.eval(toks[:ctx])
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        for tok in toks[ctx:]:
            m.eval([tok])
        decode = time.perf_counter() - t
    return {"engine": engine, "ctx": ctx, "load_s": load, "compile_s": compile_s,
            "prefill_tok_s": ctx / prefill, "decode_tok_s": n_decode / decode,
            "peak_rss_mb": peak_rss_mb(), **extra}


def _thread_env(threads: int) -> dict:
    """This environment with every thread pool (Numba, OpenMP, OpenBLAS) at ``threads``."""
    return dict(os.environ, NUMBA_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
                OPENBLAS_NUM_THREADS=str(threads))


def _pyimp_env(threads: int) -> dict:
    """:func:`_thread_env` with pyimp's thread-pool defaults (pyimp.runtime.process)."""
    from pyimp.runtime.process import configure_process
    env = _thread_env(threads)
    configure_process(env)
    return env


def _spawn(engine, model, ctx, n_decode, threads, numerics, sparse_budget=0.0, synthetic_cache=False,
           tokens_file=None, profile=False) -> dict:
    cmd = [sys.executable, "-m", "tools.bench", "--worker", engine, "--model", model, "--ctx", str(ctx),
           "--decode", str(n_decode), "--threads", str(threads), "--numerics", numerics,
           "--sparse-budget", str(sparse_budget)] + (["--synthetic-cache"] if synthetic_cache else []) \
        + (["--tokens", tokens_file] if tokens_file else []) + (["--profile"] if profile else [])
    # a pyimp program's thread-pool defaults; the peer runs in the environment a llama.cpp user
    # has (its OpenMP pool tuned by libgomp's own defaults, as llama-cli would run)
    env = _pyimp_env(threads) if engine == "pyimp" else _peer_env(threads)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if r.returncode:
        raise BenchError(f"{engine} worker ({os.path.basename(model)}, context {ctx}) failed: "
                         f"{_last_line(r.stderr)}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def tinyllama_path(n_ctx: int = 2048) -> str:
    """The synthetic TinyLlama-1.1B-shaped Q4_0 model (written into the cache once)."""
    from pyimp.runtime.default_model import cache_dir
    from tools.write_synthetic_gguf import PRESETS, SynthSpec, write
    suffix = "" if n_ctx == 2048 else f"-ctx{n_ctx}"
    p = cache_dir() / f"synthetic-tinyllama-1.1b-q4_0{suffix}.gguf"
    if not p.exists():
        tmp = p.with_suffix(".tmp")
        kw = dict(PRESETS["tinyllama"], n_ctx=n_ctx)
        write(tmp, SynthSpec(weight_type="Q4_0", embd_type="Q4_0", tied_output=False, **kw))
        os.replace(tmp, p)
    return str(p)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown CPU" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def host_kernels() -> str:
    """What the two engines' kernels are built for here: LLVM's name for this CPU (Numba's
    target), the kernel set NumPy's OpenBLAS runs, with an OPENBLAS_CORETYPE from the
    environment named (it overrides OpenBLAS's own choice), and who computes pyimp's fp32
    prefill products (loaders.quants.FP32_PRODUCTS)."""
    from llvmlite import binding as llb

    from loaders import quants
    env = os.environ.get("OPENBLAS_CORETYPE")
    return (f"LLVM host {llb.get_host_cpu_name()}; NumPy's OpenBLAS {quants.blas_core() or 'unknown'} "
            f"kernels" + (f" (OPENBLAS_CORETYPE={env} in the environment)" if env else "")
            + f"; pyimp's fp32 prefill products: "
            + ("loaders.gemm (512-bit)" if quants.FP32_PRODUCTS == "gemm" else "BLAS"))


def numba_target() -> str:
    """What Numba compiles pyimp's kernels for: the host's CPU, or the ``NUMBA_CPU_NAME`` /
    ``NUMBA_CPU_FEATURES`` target in the environment with the speed features of the host it
    leaves out (loaders.jit.unused_host_features)."""
    from numba.core import config

    from loaders import jit
    if config.CPU_NAME is None and config.CPU_FEATURES is None:
        return "Numba compiles for this host"
    missing = jit.unused_host_features()
    return (f"Numba compiles for {config.CPU_NAME or 'host'}"
            + (" with NUMBA_CPU_FEATURES" if config.CPU_FEATURES is not None else "")
            + (f", without the host's {', '.join(missing)}" if missing else ""))


# set by main() for --target: the folder of llama.cpp's build for that CPU (tools.build_peer),
# put first on the llama.cpp workers' PYTHONPATH
_PEER_DIR: str | None = None


def _peer_env(threads: int) -> dict:
    """:func:`_thread_env`, with the --target build of llama.cpp first on PYTHONPATH."""
    env = _thread_env(threads)
    if _PEER_DIR:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PEER_DIR, env.get("PYTHONPATH")) if p)
    return env


def peer_build(threads: int = 2) -> str:
    """The instruction sets the llama.cpp the workers load was built with, from its system info
    ("AVX2 AVX512 ..."), read in a subprocess with their environment. Raises BenchError when
    a --target build is not the one that loads."""
    code = ("import llama_cpp\nfrom tools import llamacpp_peer\n"
            "print(llama_cpp.__file__)\nprint(llamacpp_peer.system_info())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_peer_env(threads),
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if r.returncode:        # no peer here: the first llama.cpp row says why
        return f"unknown ({_last_line(r.stderr)})"
    where, info = r.stdout.strip().splitlines()[-2:]
    if _PEER_DIR and not os.path.abspath(where).startswith(os.path.abspath(_PEER_DIR) + os.sep):
        raise BenchError(f"llama.cpp loads from {where}, not from the --target build in {_PEER_DIR}")
    flags = [k.strip() for part in info.split("|") if "=" in part
             for k, v in [part.rsplit("=", 1)] if v.strip() == "1"]
    return " ".join(f.split(":")[-1].strip() for f in flags) or info


def target_env(name: str) -> dict:
    """NUMBA_CPU_NAME / NUMBA_CPU_FEATURES for one of tools.mca_steps.TARGETS, so that pyimp's
    kernels are those that CPU would run (its instruction set, on this host's cores). Raises
    BenchError when the target uses a feature this host lacks: its code could not run here.
    (loaders.cpu reads the host: Numba must not be imported before the variables are set.)"""
    from loaders.cpu import host_features
    cpu, features, _ = TARGETS[name]
    host = host_features()
    lacking = sorted(f[1:] for f in features.split(",") if f.startswith("+") and f[1:] not in host)
    if lacking:
        raise BenchError(f"--target {name}: this CPU lacks {', '.join(lacking)}, which "
                         f"that target's kernels may use")
    return {"NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": features}


def use_target(name: str) -> None:
    """Both engines built for CPU ``name``: Numba's target for this process's pyimp
    subprocesses, and llama.cpp from ``tools.build_peer --target name``'s folder (BenchError
    when it has not been built)."""
    global _PEER_DIR
    from tools import build_peer
    env = target_env(name)
    where = build_peer.target_dir(name)
    if build_peer.installed_stamp(where) is None:
        raise BenchError(f"--target {name}: no llama.cpp build for it in {where}; make one with "
                         f"python -m tools.build_peer --target {name}")
    os.environ.update(env)
    _PEER_DIR = str(where)


def read_bandwidth() -> float:
    """tools.bench_kernels.read_bandwidth in a subprocess, so that its 1 GB array does not stay
    in this process (which starts every worker)."""
    code = "from tools.bench_kernels import read_bandwidth; print(read_bandwidth())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return float(r.stdout.split()[-1])


# pyimp-run in a process that reports its own peak RSS (peak_rss_mb) on stderr as it exits
_RUN_CLI = ("import atexit, runpy, sys\n"
            "from tools.bench import peak_rss_mb\n"
            "atexit.register(lambda: print(f'PEAK_RSS_MB {peak_rss_mb()}', file=sys.stderr))\n"
            "sys.argv = ['pyimp-run'] + sys.argv[1:]\n"
            "runpy.run_module('pyimp.cli.run', run_name='__main__')\n")


def startup(model: str, threads: int, cold: bool) -> tuple[float, float]:
    """(seconds from process start to the first generated token of ``pyimp-run -n 1``, its
    peak RSS in MB): with ``cold`` an empty Numba cache (every kernel compiled), else the cache
    as it is."""
    import tempfile
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads))
    with tempfile.TemporaryDirectory() as d:
        if cold:
            env["NUMBA_CACHE_DIR"] = d
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", _RUN_CLI, model, "-p", "Hello", "-n", "1", "--temp", "0",
                            "-t", str(threads)], capture_output=True, text=True, env=env,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        seconds = time.perf_counter() - t
    if r.returncode:       # its own last line, not the wrapper's peak RSS after it
        why = _last_line("\n".join(ln for ln in r.stderr.splitlines() if not ln.startswith("PEAK_RSS_MB ")))
        raise BenchError(f"pyimp-run ({'empty' if cold else 'warm'} cache) failed: {why}")
    peak = [float(ln.split()[1]) for ln in r.stderr.splitlines() if ln.startswith("PEAK_RSS_MB ")]
    return seconds, (peak[-1] if peak else float("nan"))


# The speed goals, all measured in one run of this benchmark on one machine: ratios are pyimp
# over llama.cpp (flash attention, f16 KV) in the same run, 2 threads, fp32 numerics.
GOALS = {
    "gemma_decode": 0.6,          # Gemma 3 270M decode at 128, 1024 and 4096 context
    "gemma_prefill": 0.6,         # ... and prefill at those rows
    "long_dense_decode": 0.8,     # Gemma at 16384 and 32000 after a real prefill: dense decode
    "long_sparse_decode": 1.3,    # ... and block-sparse decode, budget 1/8 of the context
    "tinyllama_decode": 0.5,      # TinyLlama-1.1B-shape Q4_0 (random ids) decode
    "tinyllama_prefill": 0.4,     # ... and prefill
    "warm_start_s": 3.0,          # pyimp-run process start to first token, warm Numba cache
    "cold_start_s": 20.0,         # ... with an empty Numba cache (every kernel compiled)
    "matvec_share": 0.5,          # fp32 matvec over the default model's real matrices, per
                                  # type, as a share of single-thread read bandwidth
    "rss_margin_mb": 400.0,       # peak RSS of every pyimp run <= GGUF + KV + this
}
SHORT_CTX = (128, 1024, 4096)     # the Gemma rows the short-context goals hold at
LONG_CTX = (16384, 32000)         # ... and the long-context goals
# (model, context lengths, block-sparse budget) of the rows --goals runs (8192: measured, in
# no goal)
GOAL_PLAN = (("gemma", SHORT_CTX, 0.0), ("gemma", (8192,) + LONG_CTX, 0.125),
             ("tinyllama", (128, 1024), 0.0))


def verdicts(rows: list[dict], startup_s: tuple | None = None,
             shares: dict | None = None) -> list[tuple[str, str, bool | None]]:
    """(goal, figure measured, met: True / False, None where nothing measured it) for each goal
    of :data:`GOALS`, from the bench's rows (dicts with model, ctx, pyimp, peer, sparse: the
    worker results, sparse None when not run; rss_limit_mb), the start-up seconds (cold, warm)
    and the matvec shares of read bandwidth by type name. Each goal holds at every row it
    names: a row under its threshold fails it, and a goal no row measured is not met."""
    G = GOALS
    out = []

    def ratio(r, key, run="pyimp"):
        return r[run][key] / r["peer"][key]

    def each(label, sel, key, least, run="pyimp"):
        rs = [r for r in rows if sel(r) and (run != "sparse" or r.get("sparse"))]
        if not rs:
            out.append((label, "not measured", None))
            return
        vals = [(r["ctx"], ratio(r, key, run)) for r in rs]
        out.append((label, ", ".join(f"{v:.2f}x at {c}" for c, v in vals),
                    all(v >= least for _, v in vals)))

    short = lambda r: r["model"] == "gemma" and r["ctx"] in SHORT_CTX   # noqa: E731
    long_ = lambda r: r["model"] == "gemma" and r["ctx"] in LONG_CTX    # noqa: E731
    tiny = lambda r: r["model"].startswith("tinyllama")               # noqa: E731
    each(f"Gemma decode >= {G['gemma_decode']}x llama.cpp", short, "decode_tok_s", G["gemma_decode"])
    each(f"Gemma prefill >= {G['gemma_prefill']}x", short, "prefill_tok_s", G["gemma_prefill"])
    each(f"Gemma long-context dense decode >= {G['long_dense_decode']}x", long_, "decode_tok_s",
         G["long_dense_decode"])
    each(f"Gemma long-context block-sparse decode >= {G['long_sparse_decode']}x", long_,
         "decode_tok_s", G["long_sparse_decode"], run="sparse")
    each(f"TinyLlama-shape decode >= {G['tinyllama_decode']}x", tiny, "decode_tok_s",
         G["tinyllama_decode"])
    each(f"TinyLlama-shape prefill >= {G['tinyllama_prefill']}x", tiny, "prefill_tok_s",
         G["tinyllama_prefill"])
    if startup_s is None:
        out += [(f"warm start <= {G['warm_start_s']:g} s", "not measured", None),
                (f"cold first run <= {G['cold_start_s']:g} s", "not measured", None)]
    else:
        cold, warm = startup_s
        out += [(f"warm start <= {G['warm_start_s']:g} s", f"{warm:.2f} s", warm <= G["warm_start_s"]),
                (f"cold first run <= {G['cold_start_s']:g} s", f"{cold:.1f} s", cold <= G["cold_start_s"])]
    label = f"every type's matvec >= {G['matvec_share']:.0%} of read bandwidth"
    if not shares:
        out.append((label, "not measured", None))
    else:
        out.append((label, ", ".join(f"{t} {v:.0%}" for t, v in shares.items()),
                    all(v >= G["matvec_share"] for v in shares.values())))
    runs = [(r, run) for r in rows for run in ("pyimp", "sparse") if r.get(run)]
    label = f"peak RSS <= GGUF + KV + {G['rss_margin_mb']:.0f} MB"
    if not runs:
        out.append((label, "not measured", None))
    else:
        over = [f"{r['model']} {r['ctx']}{' sparse' if run == 'sparse' else ''}: "
                f"{r[run]['peak_rss_mb']:.0f} > {r['rss_limit_mb']:.0f} MB"
                + (" (compiled kernels)" if r[run].get("compiled") else "")
                for r, run in runs if r[run]["peak_rss_mb"] > r["rss_limit_mb"]]
        worst = max(r[run]["peak_rss_mb"] - r["rss_limit_mb"] for r, run in runs)
        out.append((label, "; ".join(over) if over else
                    f"{len(runs)} runs, the closest {-worst:.0f} MB under", not over))
    return out


def kernel_shares(threads: int, reps: int = 9) -> dict:
    """Each weight type's fp32 matvec over the default model's real matrices as a share of
    single-thread read bandwidth (``tools.bench_kernels``), measured in a subprocess with
    the environment of the bench's pyimp workers (:func:`_pyimp_env`)."""
    code = ("import json, numba\n"
            "from tools.bench_kernels import layer_rate, read_bandwidth, real_matrix_rates, resolve_model\n"
            f"numba.set_num_threads({threads})\n"
            f"entries, _ = real_matrix_rates(resolve_model(None), {reps})\n"
            "bw = read_bandwidth()\n"
            "print(json.dumps({e['qtype'].name: layer_rate(e) / bw for e in entries}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=_pyimp_env(threads),
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if r.returncode:
        raise BenchError(f"kernel bandwidth subprocess failed: {_last_line(r.stderr)}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def print_verdicts(vs: list[tuple[str, str, bool | None]]) -> int:
    """The goals' table; returns how many are not met (unmeasured ones included)."""
    print("\ngoals (this machine, this run):")
    w = max(len(g) for g, _, _ in vs)
    for goal, figure, met in vs:
        word = "met" if met else ("NOT MET" if met is False else "not measured")
        print(f"  {word:12} {goal:{w}}  {figure}")
    return sum(1 for _, _, met in vs if not met)


def _compiled_mark(run: dict) -> str:
    """A row's note when its pyimp run compiled kernels (not a warm run: see worker)."""
    return "  (pyimp compiled kernels in this run)" if run.get("compiled") else ""


def _best(runs: list[dict]) -> dict:
    """The run with the fastest decode, with the fastest prefill of all runs."""
    best = dict(max(runs, key=lambda r: r["decode_tok_s"]))
    best["prefill_tok_s"] = max(r["prefill_tok_s"] for r in runs)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=["gemma", "tinyllama", "tinyllama-32k"],
                    help="default: gemma tinyllama")
    ap.add_argument("--ctx", nargs="+", type=int, help="default: 128 1024 4096")
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--numerics", default="fp32", choices=["fp32", "ggml"])
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs per engine and row, alternating; each engine's best is shown")
    ap.add_argument("--sparse-budget", type=float, default=0.0,
                    help="also run pyimp with block-sparse decode attending this fraction of the context")
    ap.add_argument("--synthetic-cache", action="store_true",
                    help="pyimp only: fill the KV cache with random values instead of a prefill "
                         "(decode speed at long context; prefill figures are then meaningless)")
    ap.add_argument("--startup", action="store_true",
                    help="also time pyimp-run from process start to its first token, with an empty "
                         "and with a warm Numba cache")
    ap.add_argument("--profile", action="store_true",
                    help="also show where a pyimp decode token's time goes (ms per token by part)")
    ap.add_argument("--goals", action="store_true",
                    help="run the rows of the speed goals (GOAL_PLAN), the start-up times and the "
                         "kernels' share of read bandwidth, then say of each goal whether this "
                         "machine meets it (exit status 1 if any is not met)")
    ap.add_argument("--target", metavar="CPU", choices=sorted(TARGETS),
                    help="both engines built for this CPU's instruction set instead of the host's "
                         "(%(choices)s): pyimp's kernels through NUMBA_CPU_NAME / "
                         "NUMBA_CPU_FEATURES, llama.cpp from python -m tools.build_peer --target "
                         "CPU. The code a machine of that kind runs, timed on this one's cores")
    ap.add_argument("--worker", choices=["pyimp", "llama.cpp"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {a.repeat}")
    if a.goals and (a.models or a.ctx or a.sparse_budget or a.synthetic_cache or a.numerics != "fp32"):
        ap.error("--goals runs the goals' own rows (fp32 numerics): leave out --models, --ctx, "
                 "--sparse-budget, --synthetic-cache and --numerics")
    if a.goals:
        a.models, a.startup = sorted({m for m, _, _ in GOAL_PLAN}), True
    if a.target and not a.worker:
        # before Numba is imported here, and inherited by every pyimp subprocess
        use_target(a.target)
    a.models = a.models or ["gemma", "tinyllama"]
    a.ctx = a.ctx or [128, 1024, 4096]
    if a.worker:
        print(json.dumps(worker(a.worker, a.model, a.ctx[0], a.decode, a.threads, a.numerics,
                                a.sparse_budget, a.synthetic_cache, a.tokens, a.profile)))
        return 0
    import tempfile

    from pyimp.runtime.default_model import default_model_path
    paths = {"gemma": str(default_model_path())}
    if "tinyllama" in a.models:
        paths["tinyllama"] = tinyllama_path()
    if "tinyllama-32k" in a.models:
        paths["tinyllama-32k"] = tinyllama_path(32768)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} CPUs; single-thread read bandwidth "
          f"{read_bandwidth():.1f} GB/s (NumPy sum over 1 GB, best of 4)")
    print(host_kernels())
    print(f"{numba_target()}; llama.cpp built with {peer_build(a.threads)}"
          + (f" (from {_PEER_DIR})" if _PEER_DIR else ""))
    print(f"threads {a.threads}, decode {a.decode} tokens after the prefill, numerics {a.numerics}, "
          f"llama.cpp with flash_attn, both f16 KV, best of {a.repeat} run(s) per engine")
    startup_s = None
    if a.startup:
        cold, cold_rss = startup(paths[a.models[0]], a.threads, cold=True)
        warm, warm_rss = min(startup(paths[a.models[0]], a.threads, cold=False) for _ in range(3))
        startup_s = (cold, warm)
        print(f"pyimp-run start to first token ({a.models[0]}): cold (empty Numba cache) {cold:.1f} s, "
              f"peak RSS {cold_rss:.0f} MB; warm {warm:.2f} s, peak RSS {warm_rss:.0f} MB")
    hdr = (f"{'model':10} {'ctx':>5} | {'pyimp pf':>9} {'llama pf':>9} {'ratio':>6} | {'pyimp dec':>9} "
           f"{'llama dec':>9} {'ratio':>6} | {'pyimp RSS':>9} {'llama RSS':>9} {'GGUF+KV+400':>11}")
    print(hdr)
    print("-" * len(hdr))
    profiles, rows = [], []
    plan = GOAL_PLAN if a.goals else tuple((m, tuple(a.ctx), a.sparse_budget) for m in a.models)
    with tempfile.TemporaryDirectory() as tmp:
        for name, ctxs, budget in plan:
            rows += _model_rows(name, paths[name], ctxs, budget, a, tmp, profiles)
    for name, ctx, parts, total in profiles:
        print(f"\npyimp decode profile, {name} at {ctx}: {total:.1f} ms per token (best run)")
        for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"  {v:7.2f} ms  {k}")
    if a.goals:
        shares = kernel_shares(a.threads)
        return 1 if print_verdicts(verdicts(rows, startup_s, shares)) else 0
    return 0


def _model_rows(name: str, path: str, ctxs, budget: float, a, tmp: str, profiles: list) -> list[dict]:
    """Run and print one model's rows (each context length: pyimp and llama.cpp, alternating
    ``a.repeat`` times, then block-sparse pyimp when ``budget`` > 0); returns them as
    :func:`verdicts` reads them. Context lengths past the model's trained context are left out."""
    from loaders.config import read_config
    from loaders.gguf_file import GGUFFile
    gguf_mb = os.path.getsize(path) / 2**20
    cfg = read_config(GGUFFile(path))
    ctxs = [c for c in ctxs if c + a.decode + 8 <= cfg.n_ctx_train]
    if not ctxs:
        return []
    tf = None
    ids = text_tokens(path, max(ctxs) + a.decode)
    if ids is not None:
        tf = os.path.join(tmp, f"{name}-{max(ctxs)}.npy")
        np.save(tf, np.asarray(ids, np.int64))
    # an untimed pyimp run first fills Numba's cache with every kernel the rows use, so that no
    # timed run compiles (a first run's figures are --startup's)
    for b in sorted({0.0, budget}):
        _spawn("pyimp", path, min(ctxs), 1, a.threads, a.numerics, b, a.synthetic_cache, tf)
    rows = []
    for ctx in ctxs:
        runs_p, runs_q = [], []
        for _ in range(a.repeat):
            runs_p.append(_spawn("pyimp", path, ctx, a.decode, a.threads, a.numerics, 0.0,
                                 a.synthetic_cache, tf, a.profile))
            runs_q.append(_spawn("llama.cpp", path, ctx, a.decode, a.threads, a.numerics,
                                 tokens_file=tf))
        p, q = _best(runs_p), _best(runs_q)
        if a.profile:
            profiles.append((name, ctx, p["profile_ms_per_token"], 1e3 / p["decode_tok_s"]))
        kv_mb = cfg.n_layer * cfg.n_head_kv * cfg.head_dim * 2 * 2 * (ctx + a.decode + 8) / 2**20
        row = {"model": name, "ctx": ctx, "pyimp": p, "peer": q, "sparse": None,
               "rss_limit_mb": gguf_mb + kv_mb + GOALS["rss_margin_mb"]}
        print(f"{name:10} {ctx:5d} | {p['prefill_tok_s']:9.1f} {q['prefill_tok_s']:9.1f} "
              f"{p['prefill_tok_s'] / q['prefill_tok_s']:6.2f} | {p['decode_tok_s']:9.2f} "
              f"{q['decode_tok_s']:9.2f} {p['decode_tok_s'] / q['decode_tok_s']:6.2f} | "
              f"{p['peak_rss_mb']:8.0f}M {q['peak_rss_mb']:8.0f}M {row['rss_limit_mb']:10.0f}M"
              + ("" if tf else "  (random token ids)")
              + _compiled_mark(p), flush=True)
        if budget > 0:
            sp = _best([_spawn("pyimp", path, ctx, a.decode, a.threads, a.numerics, budget,
                               a.synthetic_cache, tf) for _ in range(a.repeat)])
            row["sparse"] = sp
            print(f"{'  sparse':10} {ctx:5d} | {'':9} {'':9} {'':6} | {sp['decode_tok_s']:9.2f} "
                  f"{q['decode_tok_s']:9.2f} {sp['decode_tok_s'] / q['decode_tok_s']:6.2f} | "
                  f"{sp['peak_rss_mb']:8.0f}M   (pyimp block-sparse, budget {budget:g})"
                  + _compiled_mark(sp), flush=True)
        rows.append(row)
    return rows


def cli(argv=None) -> int:
    """:func:`main`, with a failed measurement subprocess one line on stderr (exit status 1)."""
    try:
        return main(argv)
    except BenchError as e:
        print(f"tools.bench: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    # no configure_process here: the workers get their environments from _spawn (pyimp's
    # thread-pool defaults for pyimp, the caller's plain environment for the peer)
    sys.exit(cli())
